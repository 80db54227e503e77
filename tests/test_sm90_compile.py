"""The Triton kernels (triton_flash, triton_blocksparse, the mask reading) compile for
sm_90 (Hopper), checked on a machine without a GPU.

The interpreter runs the kernels' arithmetic but not Triton's compiler, which rejects
code the interpreter accepts. This compiles representative launches ahead of time with
the ptxas that ships with Triton, in a fresh process without TRITON_INTERPRET.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

# A developer tool outside the installed package (benchmarks/, not in the wheel).
AOT_CHECK = Path(__file__).resolve().parents[1] / "benchmarks" / "aot_check.py"


_FAMILY_FLAGS = {"triton_flash": ["--quick"], "triton_blocksparse": ["--quick", "--blocksparse"],
                 "mask_reading": ["--mask-reading"]}  # fmt: skip


@pytest.mark.parametrize("backend", list(_FAMILY_FLAGS))
def test_kernels_compile_for_sm90(backend: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(AOT_CHECK), *_FAMILY_FLAGS[backend]],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    # The kernels beside the pointer ones that --quick's launches take, each compiled.
    if backend == "triton_flash":
        kernels: tuple[str, ...] = (
            "attn_fwd_kernel",
            "attn_fwd_tma_kernel",
            "attn_fwd_gluon_kernel",
            "attn_bwd_dkdv_gluon_kernel",  # forced, as the next (--quick's shapes are short)
            "attn_bwd_dq_gluon_kernel",
        )
    elif backend == "mask_reading":  # (their names as the script prints them)
        kernels = ("_union_and_keys_kernel", "_verify_kernel")
    else:  # every kernel of the family, recorded through triton_flash's launcher
        kernels = ("bs_fwd_kernel", "bs_fwd_gluon_kernel", "bs_bwd_dkdv_kernel", "bs_bwd_dq_kernel",
                   "bs_bwd_dq_gluon_kernel", "bs_bwd_dkdv_gluon_kernel")  # fmt: skip
    for kernel in kernels:
        assert f"ok {kernel} " in result.stdout, kernel


@pytest.mark.parametrize("mask", ["bool", "float"])
def test_the_dense_mask_forward_loads_its_mask_in_vectors(mask: str, tmp_path: Path) -> None:
    """The forward with an attn_mask at D=128 bf16, compiled for sm_90: the mask tile of
    an unmasked key tile is read in vectors (asynchronous copies), not one entry a load,
    and nothing spills. Its load mask varied along the keys until 2026-12-05: 32 scalar
    loads a tile (LDG.E.U8 / .U16) and 516-836 bytes of spills, 0.16-0.19x F.sdpa's
    speed on an H200 (benchmarks/results/archive/masked-fwd-probe-h200-2026-12-05-*)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(AOT_CHECK), "--dtype", "bf16", "--head-dim", "128",
         "--shape", "2,4,4,256,256", "--mask", mask, "--kernel", "fwd", "--registers",
         "--sass-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("ok attn_fwd_kernel ")]
    assert lines and all("spill_stores=0 " in line for line in lines), result.stdout
    sass = [p.read_text() for p in tmp_path.glob("attn_fwd_kernel-*.sass")]
    if not sass or any("cuobjdump failed" in text for text in sass):
        pytest.skip("cuobjdump did not run")
    for text in sass:
        assert "LDG.E.U8" not in text and "LDG.E.U16" not in text, text[:200]


def test_the_gluon_dkdv_kernel_keeps_its_masked_loops_free_of_spill_stores() -> None:
    """The Gluon dK/dV kernel (forced row), causal bottom-right with GQA, compiled for
    sm_90: no spill stores inside its loops. Reading a tile's lse and delta from shared
    memory before the tile's products kept them live across them: 23 spill stores and
    35 loads in the masked loop until 2026-12-05."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(AOT_CHECK), "--dtype", "bf16", "--head-dim", "128",
         "--shape", "1,4,2,1032,1100", "--causal", "--bottom-right", "--kernel", "bwd_kv",
         "--config", "bwd_kv=64,128,4,2,gluon", "--registers"],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines()
             if line.startswith("ok attn_bwd_dkdv_gluon_kernel ")]  # fmt: skip
    assert lines and all("loop_STL/LDL=0/" in line for line in lines), result.stdout
