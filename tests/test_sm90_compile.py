"""The Triton kernels (triton_flash, triton_blocksparse) compile for sm_90 (Hopper),
checked on a machine without a GPU.

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


@pytest.mark.parametrize("backend", ["triton_flash", "triton_blocksparse"])
def test_kernels_compile_for_sm90(backend: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    family = ["--blocksparse"] if backend == "triton_blocksparse" else []
    result = subprocess.run(
        [sys.executable, str(AOT_CHECK), "--quick", *family],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    if backend == "triton_flash":  # the forwards that --quick's launches take, each compiled
        kernels: tuple[str, ...] = (
            "attn_fwd_kernel",
            "attn_fwd_tma_kernel",
            "attn_fwd_gluon_kernel",
        )
    else:  # every kernel of the family, recorded through triton_flash's launcher
        kernels = ("bs_fwd_kernel", "bs_fwd_gluon_kernel", "bs_bwd_dkdv_kernel", "bs_bwd_dq_kernel")
    for kernel in kernels:
        assert f"ok {kernel} " in result.stdout, kernel
