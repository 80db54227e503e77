"""``attnhub bench``'s block-sparse extra on CPU: layouts, rows, FLOPs, FlexAttention's
BlockMask, report and command line.

The kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, as tox's tests env
sets it), at tiny shapes in float32 (bfloat16 is broken in the interpreter).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    # Import Triton now, at collection, while TRITON_INTERPRET=1 holds: Triton's own
    # @triton.jit helpers take their mode when triton is imported, and test_bench.py's
    # fixture unsets the variable (a first import there breaks the kernels here).
    with contextlib.suppress(ImportError):
        import triton  # noqa: F401

from attnhub import BlockSparseLayout, bench, bench_report, cli, cost_table, tune
from attnhub.bench import BenchConfig, Point
from attnhub.registry import reload_registry

ROW_KEYS = {"backend", "dtype", "B", "Hq", "Hkv", "Nq", "Nk", "D", "causal", "mode", "ms",
            "tflops", "peak_mib", "density", "layout", "block_size"}  # fmt: skip
PNG = b"\x89PNG\r\n\x1a\n"
FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
SHAPE = (1, 1, 64, 16)  # B, H, N, D
BLOCK = 32
LAYOUTS = (("random", 1.0), ("random", 0.5), ("sliding_window", 16))
LONG_N = 128

interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="triton_blocksparse runs on CPU tensors under TRITON_INTERPRET=1 only",
)


def tiny(**overrides):  # type: ignore[no-untyped-def]
    base = dict(
        device="cpu",
        grid=False,
        modes=("fwd", "fwd_bwd"),
        block_sparse_layouts=LAYOUTS,
        block_sparse_shape=SHAPE,
        block_size=BLOCK,
        block_sparse_dtype="float32",
        block_sparse_long_seqlens=(LONG_N,),
        block_sparse_long_layout=("sliding_window", 16),
        cpu_reps=1,
    )
    return BenchConfig(**{**base, **overrides})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def run(tmp_path_factory):  # type: ignore[no-untyped-def]
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton_blocksparse runs on CPU tensors under TRITON_INTERPRET=1 only")
    pytest.importorskip("triton")
    saved = os.environ.pop("ATTNHUB_BACKEND", None)
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    _fresh_registry()
    try:
        out = tmp_path_factory.mktemp("bench") / "bs.json"
        data = bench.run_bench(tiny(), output=out, progress=False, commit="abc1234")
    finally:
        os.environ.pop("XDG_CACHE_HOME")
        if saved is not None:
            os.environ["ATTNHUB_BACKEND"] = saved
        cost_table.forget_tables()
    return data, out


def _fresh_registry() -> None:
    """Availability probes again, under TRITON_INTERPRET=1: the registry caches each
    backend's probe for the process, and an earlier test may have probed without it."""
    reload_registry()
    cost_table.forget_tables()


def _rows(data, **where):  # type: ignore[no-untyped-def]
    return [r for r in data["results"] if all(r.get(k) == v for k, v in where.items())]


def _expected_density(spec, n=SHAPE[2]):  # type: ignore[no-untyped-def]
    """Built here with the layout builders themselves, not through the bench."""
    kind, param = spec
    blocks = -(-n // BLOCK)
    if kind == "random":
        return max(1, round(param * blocks * blocks)) / (blocks * blocks)
    return BlockSparseLayout.sliding_window(n, int(param), BLOCK).density


# -- a run -------------------------------------------------------------------------


def test_rows_have_the_documented_shape_and_the_layouts_density(run):
    data, out = run
    assert json.loads(out.read_text()) == data
    b, h, n, d = SHAPE
    for r in data["results"]:
        assert set(r) == ROW_KEYS, r
        assert (r["B"], r["Hq"], r["Hkv"], r["D"], r["causal"]) == (b, h, h, d, False)
        assert r["block_size"] == BLOCK and r["ms"] > 0 and r["peak_mib"] is None
    sparse = _rows(data, backend="triton_blocksparse")
    got = sorted((tuple(r["layout"]), r["Nq"], r["mode"]) for r in sparse)
    want = [(s, n, m) for s in LAYOUTS for m in ("fwd", "fwd_bwd")]
    want += [(("sliding_window", 16), LONG_N, m) for m in ("fwd", "fwd_bwd")]
    assert got == sorted(want)
    for r in sparse:
        spec = tuple(r["layout"])
        assert r["density"] == pytest.approx(_expected_density(spec, r["Nq"]))
    assert {r["density"] for r in sparse if r["layout"] == ["random", 1.0]} == {1.0}


def test_the_dense_baseline_runs_once_without_a_layout(run):
    data, _ = run
    dense = _rows(data, backend="triton_flash")
    assert sorted(r["mode"] for r in dense) == ["fwd", "fwd_bwd"]
    for r in dense:
        assert r["layout"] == ["dense", 0] and r["density"] is None
        assert r["Nq"] == SHAPE[2]  # the extra's shape, not the memory point's
    assert {r["backend"] for r in data["results"]} == {"triton_flash", "triton_blocksparse"}


def test_tflops_count_the_pairs_inside_kept_blocks(run):
    data, _ = run
    b, h, _, d = SHAPE
    for r in data["results"]:
        kept = 1.0 if r["density"] is None else r["density"]  # N is a multiple of the block
        flops = 4 * b * h * d * kept * r["Nq"] * r["Nk"] * FACTOR[r["mode"]]
        assert r["tflops"] == pytest.approx(flops / (r["ms"] * 1e-3) / 1e12)


def test_flex_is_skipped_on_cpu_with_its_reason_at_every_layout(run):
    data, _ = run
    flex = [s for s in data["skipped"] if s["backend"] == "flex_attention"]
    assert sorted((tuple(s["layout"]), s["Nq"]) for s in flex) == sorted(
        [(s, SHAPE[2]) for s in LAYOUTS] + [(("sliding_window", 16), LONG_N)]
    )
    assert all("CUDA only" in s["reason"] and s["modes"] == ["fwd", "fwd_bwd"] for s in flex)
    assert [s["backend"] for s in data["skipped"]] == ["flex_attention"] * len(flex)


def test_report_has_the_block_sparse_table_and_plot_only(run, tmp_path):
    data, _ = run
    written = bench_report.write_report(data, tmp_path / "bs.json")
    assert sorted(p.name for p in written) == ["bs-block-sparse.png", "bs.md"]
    assert (tmp_path / "bs-block-sparse.png").read_bytes().startswith(PNG)
    text = (tmp_path / "bs.md").read_text()
    assert "TFLOP/s (auto/best" not in text  # the dense baseline is not a grid point
    assert "| fp32 B1 H1 N64 D16 block 32 | random 0.5 | 0.500 | fwd |" in text


# -- layouts and points --------------------------------------------------------------


def test_random_layouts_keep_exactly_round_s_blocks_with_a_fixed_seed():
    blocks = 8192 // 128
    for s in (1.0, 0.5, 0.25, 0.1, 0.05):
        layout = bench.build_layout(("random", s), 8192, 128)
        assert layout.block_size == (128, 128) and layout.shape == (1, 1, blocks, blocks)
        assert int(layout.block_mask.sum()) == round(s * blocks * blocks)
        assert layout.mask_mod is None and torch.equal(layout.full_mask, layout.block_mask)
    again = bench.build_layout(("random", 0.25), 8192, 128)
    assert torch.equal(again.block_mask, bench.build_layout(("random", 0.25), 8192, 128).block_mask)
    other = bench.build_layout(("random", 0.25), 8192, 128, seed=1)
    assert not torch.equal(again.block_mask, other.block_mask)
    assert bench.build_layout(("random", 1.0), 8192, 128).density == 1.0


def test_other_kinds_are_the_builders_layouts():
    n = 512
    for spec, want in (
        (("sliding_window", 100), BlockSparseLayout.sliding_window(n, 100, 64)),
        (("bigbird", 2), BlockSparseLayout.bigbird(n, 64, random_blocks=2)),
        (("strided", 4), BlockSparseLayout.strided(n, 64, stride=4)),
        (("causal", 0), BlockSparseLayout.causal(n, 64)),
    ):
        got = bench.build_layout(spec, n, 64)
        assert torch.equal(got.to_dense_mask(n, n), want.to_dense_mask(n, n)), spec
    for bad in (("random", 0), ("random", 1.5), ("diagonal", 1), ("sliding_window", -1)):
        with pytest.raises(ValueError):
            bench.build_layout(bad, 256, 64)  # type: ignore[arg-type]


def test_kept_pairs_clip_ragged_blocks():
    n = 200  # blocks of 64: the last one has 8 rows and 8 columns
    for spec in (("random", 0.5), ("bigbird", 1), ("causal", 0)):
        layout = bench.build_layout(spec, n, 64)
        blocks_only = BlockSparseLayout.from_block_mask(layout.block_mask, 64)
        assert bench.kept_pairs(layout, n) == int(blocks_only.to_dense_mask(n, n).sum())


def test_default_bench_has_no_block_sparse_points_and_the_extra_has_its_shape():
    assert not [p for p in BenchConfig(device="cpu").points() if p.layout is not None]
    config = BenchConfig(
        device="cpu",
        grid=False,
        block_sparse_layouts=bench.DEFAULT_BLOCK_SPARSE_LAYOUTS,
        block_sparse_long_seqlens=bench.DEFAULT_BLOCK_SPARSE_LONG_SEQLENS,
    )
    points = config.points()
    assert [(p.layout, p.seqlen) for p in points] == [
        (("dense", 0), 8192),
        *((s, 8192) for s in bench.DEFAULT_BLOCK_SPARSE_LAYOUTS),
        (("sliding_window", 1024), 65536),
    ]
    for p in points:
        assert (p.dtype, p.batch, p.heads, p.head_dim, p.causal) == ("bfloat16", 2, 16, 128, False)
        assert p.block_size == 128
    assert config.backends_for(points[0]) == ("triton_flash",)
    assert config.backends_for(points[1]) == ("triton_blocksparse", "flex_attention")
    assert [s for s in bench.DEFAULT_BLOCK_SPARSE_LAYOUTS if s[0] == "random"] == [
        ("random", s) for s in (1.0, 0.5, 0.25, 0.1, 0.05)
    ]
    with pytest.raises(ValueError, match="unknown layout kind"):
        BenchConfig(device="cpu", block_sparse_layouts=(("dense", 0),))


def test_point_flops_use_kept_pairs_when_set():
    p = Point("bfloat16", 2, 16, 8192, 128, False, layout=("random", 0.25), block_size=128)
    assert p.flops("fwd") == 4.0 * 2 * 16 * 128 * 8192 * 8192  # not built yet: dense
    layout = bench.build_layout(("random", 0.25), 8192, 128)
    built = Point(**{**p.__dict__, "kept_pairs": bench.kept_pairs(layout, 8192)})
    assert built.flops("fwd_bwd") == pytest.approx(3.5 * 4 * 2 * 16 * 128 * 0.25 * 8192**2)


# -- FlexAttention's BlockMask --------------------------------------------------------


def _block_mask_tokens(block_mask, n):  # type: ignore[no-untyped-def]
    """The token mask a kernel that visits only the listed blocks computes: full blocks
    whole, partial blocks through mask_mod."""
    bq, bk = block_mask.BLOCK_SIZE
    out = torch.zeros(n, n, dtype=torch.bool)
    zero = torch.zeros((), dtype=torch.long)
    lists = (
        (block_mask.kv_num_blocks, block_mask.kv_indices, False),
        (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, True),
    )
    for num, indices, full in lists:
        for qb in range(num.shape[-1]):
            for kb in indices[0, 0, qb, : int(num[0, 0, qb])].tolist():
                q = torch.arange(qb * bq, min((qb + 1) * bq, n)).view(-1, 1)
                kv = torch.arange(kb * bk, min((kb + 1) * bk, n)).view(1, -1)
                tile = torch.ones(q.shape[0], kv.shape[1], dtype=torch.bool)
                if not full:
                    tile = tile & block_mask.mask_mod(zero, zero, q, kv)
                out[q, kv] = tile
    return out


@pytest.mark.parametrize(
    "spec, n",
    [(("random", 0.5), 256), (("sliding_window", 70), 256), (("bigbird", 1), 256),
     (("causal", 0), 200), (("sliding_window", 40), 200)],
)  # fmt: skip
def test_flex_block_mask_means_the_layouts_dense_mask(spec, n):
    pytest.importorskip("torch.nn.attention.flex_attention")
    layout = bench.build_layout(spec, n, 64)
    want = layout.to_dense_mask(n, n)[0, 0]
    # The compiled kernel's view: listed blocks only, mask_mod on partial ones.
    kernel = bench.flex_layout_block_mask(layout, n, exact=False)
    assert kernel.BLOCK_SIZE == (64, 64)
    assert torch.equal(_block_mask_tokens(kernel, n), want)
    # The eager (CPU) view: mask_mod at every pair.
    exact = bench.flex_layout_block_mask(layout, n, exact=True)
    assert torch.equal(_block_mask_tokens(exact, n), want)
    q = torch.arange(n).view(-1, 1)
    kv = torch.arange(n).view(1, -1)
    zero = torch.zeros((), dtype=torch.long)
    assert torch.equal(exact.mask_mod(zero, zero, q, kv).expand(n, n), want)


# -- command line ----------------------------------------------------------------------


def _config(argv):  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return bench.config_from_args(parser.parse_args(["--device", "cpu", *argv]))


def test_options_turn_the_extra_on_and_leave_the_default_alone():
    assert _config([]).block_sparse_layouts == () and not _config([]).block_sparse_long_seqlens
    on = _config(["--block-sparse"])
    assert on.block_sparse_layouts == bench.DEFAULT_BLOCK_SPARSE_LAYOUTS
    assert on.block_sparse_long_seqlens == (65536,) and on.block_sparse_shape == (2, 16, 8192, 128)
    assert on.grid  # the grid still runs unless --no-grid
    assert _config(["--block-sparse", "--no-block-sparse-long"]).block_sparse_long_seqlens == ()
    custom = _config(["--block-sparse-layouts", "random:0.3,sliding_window:512,causal",
                      "--block-size", "64", "--block-sparse-long-seqlens", "16384,32768",
                      "--block-sparse-backends", "triton_blocksparse"])  # fmt: skip
    assert custom.block_sparse_layouts == (("random", 0.3), ("sliding_window", 512), ("causal", 0))
    assert custom.block_size == 64 and custom.block_sparse_long_seqlens == (16384, 32768)
    assert custom.block_sparse_backends == ("triton_blocksparse",)
    with pytest.raises(SystemExit):
        _config(["--block-sparse-layouts", "random:2"])


def test_tune_parser_has_no_block_sparse_options():
    parser = argparse.ArgumentParser()
    tune.add_arguments(parser)
    args = parser.parse_args(["--device", "cpu"])
    assert bench.config_from_args(args).block_sparse_layouts == ()
    help_text = argparse.ArgumentParser()
    bench.add_arguments(help_text)
    assert "--block-sparse-layouts" in help_text.format_help()


@interpreter
def test_cli_runs_the_extra(tmp_path, capsys, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("ATTNHUB_BACKEND", raising=False)
    _fresh_registry()
    out = tmp_path / "cli.json"
    argv = ["bench", "--device", "cpu", "--no-grid", "--block-sparse-layouts", "random:0.5",
            "--block-sparse-shape", "1,1,64,16", "--block-size", "32", "--block-sparse-dtype",
            "fp32", "--no-block-sparse-long", "--modes", "fwd", "--no-progress", "--no-plots",
            "-o", str(out)]  # fmt: skip
    try:
        assert cli.main(argv) == 0
    finally:
        cost_table.forget_tables()
    data = json.loads(out.read_text())
    got = [(r["backend"], r["layout"], r["density"]) for r in data["results"]]
    assert got == [
        ("triton_flash", ["dense", 0], None),
        ("triton_blocksparse", ["random", 0.5], 0.5),
    ]
    assert data["config"]["block_sparse_layouts"] == [["random", 0.5]]
    assert "| fp32 B1 H1 N64 D16 block 32 | random 0.5 | 0.500 | fwd |" in capsys.readouterr().out


def _synthetic() -> dict:  # type: ignore[type-arg]
    rows = []

    def row(backend, layout, density, mode, ms, n=8192):  # type: ignore[no-untyped-def]
        rows.append({
            "backend": backend, "dtype": "bfloat16", "B": 2, "Hq": 16, "Hkv": 16, "Nq": n,
            "Nk": n, "D": 128, "causal": False, "mode": mode, "ms": ms, "tflops": 1.0,
            "peak_mib": 10.0 * n / 8192, "density": density, "layout": layout, "block_size": 128,
        })  # fmt: skip

    for mode, scale in (("fwd", 1.0), ("fwd_bwd", 3.0)):
        row("triton_flash", ["dense", 0], None, mode, 10.0 * scale)
        for s in (1.0, 0.5, 0.25):
            row("triton_blocksparse", ["random", s], s, mode, 12.0 * s * scale)
            row("flex_attention", ["random", s], s, mode, 14.4 * s * scale)
        row("triton_blocksparse", ["sliding_window", 1024], 0.13, mode, 1.5 * scale)
        row("triton_blocksparse", ["sliding_window", 1024], 0.0165, mode, 1.6, n=65536)
    env = {"gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6.0", "cuda": "13.0",
           "date": "2026-12-01T00:00:00+00:00", "attnhub_commit": "abc1234"}  # fmt: skip
    return {"env": env, "results": rows, "skipped": [], "device_class": "sm90"}


def test_report_ratios_against_dense_and_flex(tmp_path):
    data = _synthetic()
    written = bench_report.write_report(data, tmp_path / "h200-bs.json")
    assert sorted(p.name for p in written) == ["h200-bs-block-sparse.png", "h200-bs.md"]
    png = tmp_path / "h200-bs-block-sparse.png"
    assert png.read_bytes().startswith(PNG) and png.stat().st_size > 5000
    lines = (tmp_path / "h200-bs.md").read_text().splitlines()
    header = [c.strip() for c in next(ln for ln in lines if ln.startswith("| shape |")).strip("|").split("|")]  # fmt: skip

    def cells(prefix):  # type: ignore[no-untyped-def]
        line = next(ln for ln in lines if ln.startswith(prefix))
        return dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))

    shape = "| bf16 B2 H16 N8192 D128 block 128 |"
    quarter = cells(f"{shape} random 0.25 | 0.250 | fwd |")
    # bs/dense = 3 / 10; target = s + 0.05; dense/bs = 10 / 3; flex/bs = 3.6 / 3.
    assert (quarter["bs/dense"], quarter["target"], quarter["dense/bs"], quarter["flex/bs"]) == (
        "0.30", "0.300", "3.33", "1.20"
    )  # fmt: skip
    assert quarter["triton_blocksparse MiB"] == "10.0"
    assert cells(f"{shape} random 0.25 | 0.250 | fwd_bwd |")["target"] == "-"
    dense = cells(f"{shape} dense | - | fwd |")
    assert dense["triton_flash ms"] == "10.000" and dense["bs/dense"] == "-"
    long = cells("| bf16 B2 H16 N65536 D128 block 128 | sliding_window 1024 |")
    assert long["triton_blocksparse MiB"] == "80.0" and long["bs/dense"] == "-"
    # Densities fall within a shape: random 1, 0.5, 0.25, then the other layouts.
    order = [ln.split("|")[2].strip() for ln in lines if ln.startswith(shape) and "| fwd |" in ln]
    assert order == ["dense", "random 1", "random 0.5", "random 0.25", "sliding_window 1024"]
    assert tune.table_from_results(data).entries  # the dense baseline feeds tune
