"""``attnhub bench`` on CPU with tiny shapes: JSON shape, FLOP counts, skips, report, CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import attnhub
from attnhub import bench, bench_report, cli, cost_table, dispatch
from attnhub.backend import Backend
from attnhub.bench import BenchConfig, Point

ENV_KEYS = {"gpu", "torch", "triton", "cuda", "date", "attnhub_commit"}
ROW_KEYS = {"backend", "dtype", "B", "Hq", "Hkv", "Nq", "Nk", "D", "causal", "mode", "ms",
            "tflops", "peak_mib", "density"}  # fmt: skip
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def plain_cpu_dispatch(monkeypatch, tmp_path):  # type: ignore[no-untyped-def]
    """CPU dispatch without Triton's interpreter, env selections or a user's cost table."""
    for name in ("TRITON_INTERPRET", "ATTNHUB_BACKEND", "ATTNHUB_STRICT", "ATTNHUB_RANKING"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cost_table.forget_tables()
    yield
    cost_table.forget_tables()


def tiny(**overrides) -> BenchConfig:  # type: ignore[no-untyped-def]
    base = dict(
        device="cpu",
        dtypes=("float32",),
        head_dims=(16,),
        seqlens=(32, 64),
        tokens=128,
        hidden=32,
        backends=("torch_sdpa", "torch_sdpa_flash", "flex_attention", "auto"),
        windows=(8,),
        window_shape=(1, 2, 64, 16),
        cpu_reps=2,
    )
    return BenchConfig(**{**base, **overrides})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):  # type: ignore[no-untyped-def]
    import os

    saved = {k: os.environ.pop(k, None) for k in ("TRITON_INTERPRET", "ATTNHUB_BACKEND")}
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    cost_table.forget_tables()
    try:
        out = tmp_path_factory.mktemp("bench") / "run.json"
        data = bench.run_bench(tiny(), output=out, progress=False, commit="abc1234")
    finally:
        os.environ.pop("XDG_CACHE_HOME")
        for k, v in saved.items():
            if v is not None:
                os.environ[k] = v
        cost_table.forget_tables()
    return data, out


def _rows(data, **where):  # type: ignore[no-untyped-def]
    return [r for r in data["results"] if all(r.get(k) == v for k, v in where.items())]


def test_results_have_exactly_the_documented_shape(cpu_run):
    data, out = cpu_run
    assert set(data["env"]) == ENV_KEYS
    assert data["env"]["attnhub_commit"] == "abc1234"
    assert data["env"]["torch"] == torch.__version__ and data["env"]["cuda"] == torch.version.cuda
    assert data["device_class"] == "cpu"
    assert json.loads(out.read_text()) == data  # the file on disk is the returned data
    assert data["results"]
    for r in data["results"]:
        assert set(r) >= ROW_KEYS and set(r) - ROW_KEYS <= {"chosen", "window"}, r
        assert r["mode"] in ("fwd", "bwd", "fwd_bwd")
        assert r["density"] is None and r["peak_mib"] is None  # dense; no CUDA memory on CPU
        assert r["Hq"] == r["Hkv"] and r["Nq"] == r["Nk"]
        assert r["ms"] > 0 or r["mode"] == "bwd"


def test_every_grid_point_and_mode_is_timed_with_the_protocol_batch_and_heads(cpu_run):
    data, _ = cpu_run
    sdpa = _rows(data, backend="torch_sdpa", window=None)
    got = sorted((r["Nq"], r["causal"], r["mode"]) for r in sdpa)
    want = sorted((n, c, m) for n in (32, 64) for c in (False, True) for m in bench.MODES)
    assert got == want
    for r in sdpa:
        assert (r["B"], r["Hq"], r["D"]) == (128 // r["Nq"], 32 // 16, 16)


def test_tflops_count_matrix_products_halved_when_causal(cpu_run):
    data, _ = cpu_run
    for r in _rows(data, backend="torch_sdpa", window=None):
        pairs = r["Nq"] * r["Nk"] / (2 if r["causal"] else 1)
        factor = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[r["mode"]]
        flops = 4 * r["B"] * r["Hq"] * r["D"] * pairs * factor
        if r["ms"] > 0:
            assert r["tflops"] == pytest.approx(flops / (r["ms"] * 1e-3) / 1e12)


def test_point_flops_follow_anchors_protocol():
    p = Point("bfloat16", 4, 16, 4096, 128, causal=False)
    fwd = 4 * 4 * 16 * 4096 * 4096 * 128
    assert p.flops("fwd") == fwd
    assert p.flops("bwd") == 2.5 * fwd and p.flops("fwd_bwd") == 3.5 * fwd
    assert Point("bfloat16", 4, 16, 4096, 128, causal=True).flops("fwd") == fwd / 2
    # A causal window of W keys keeps min(i + 1, W) keys in row i.
    w = Point("bfloat16", 1, 1, 10, 1, causal=True, window=4)
    assert w.pairs() == sum(min(i + 1, 4) for i in range(10))


def test_unavailable_competitors_are_skipped_with_their_reason(cpu_run):
    data, _ = cpu_run
    skipped = data["skipped"]
    flash = [s for s in skipped if s["backend"] == "torch_sdpa_flash"]
    assert flash and all("CUDA is not available" in s["reason"] for s in flash)
    assert not _rows(data, backend="torch_sdpa_flash")
    flex = [s for s in skipped if s["backend"] == "flex_attention"]
    assert flex and all("CUDA only" in s["reason"] for s in flex)
    # torch_sdpa cannot serve the window: dispatch's own reason.
    window = [s for s in skipped if s["backend"] == "torch_sdpa" and "window" in s]
    assert window and "window (local attention) is not supported" in window[0]["reason"]


def test_auto_records_which_backend_it_chose(cpu_run):
    data, _ = cpu_run
    dense = _rows(data, backend="auto", window=None)
    assert len(dense) == 12 and {r["chosen"] for r in dense} == {"torch_sdpa"}
    windowed = [r for r in _rows(data, backend="auto") if r.get("window") == [7, 0]]
    assert {r["mode"] for r in windowed} == set(bench.MODES)
    # The only built-in with windows on the CPU; the flex plugin, where installed (the
    # GPU machine has it), serves windowed forwards there too, but has no CPU backward.
    windowed_fwd = {"torch_reference"} | ({"flex_attention"} & set(attnhub.get_registry().names()))
    for r in windowed:
        assert r["chosen"] in (windowed_fwd if r["mode"] == "fwd" else {"torch_reference"}), r
    assert not [r for r in data["results"] if r["backend"] != "auto" and "chosen" in r]


def test_sliding_window_rows_count_only_kept_pairs(cpu_run):
    data, _ = cpu_run
    (row,) = [r for r in _rows(data, backend="auto", mode="fwd") if r.get("window")]
    assert (row["B"], row["Hq"], row["Nq"], row["D"], row["causal"]) == (1, 2, 64, 16, True)
    pairs = sum(min(i + 1, 8) for i in range(64))
    assert row["tflops"] == pytest.approx(4 * 2 * 16 * pairs / (row["ms"] * 1e-3) / 1e12)


def test_modes_and_flex_lengths_select_subsets_without_compiling():
    config = tiny(
        seqlens=(32,),
        causal=(True,),
        modes=("fwd",),
        windows=(),
        backends=("torch_sdpa", "flex_attention"),
        flex_on_cpu=True,  # would compile; the length filter must stop it first
        flex_seqlens=(1024,),
    )
    data = bench.run_bench(config, progress=False)
    assert [(r["backend"], r["mode"]) for r in data["results"]] == [("torch_sdpa", "fwd")]
    (flex,) = data["skipped"]
    assert flex["backend"] == "flex_attention" and "--flex-seqlens" in flex["reason"]
    text = bench_report.markdown_table(data)
    assert "| torch_sdpa |" in text and bench_report.AUTO_NOISE not in text  # auto not timed


def test_a_backend_that_raises_is_recorded_and_the_run_goes_on():
    class Broken(Backend):
        name = "broken_for_bench"
        priority = -1000
        devices = frozenset({"cpu"})
        dtypes = frozenset({torch.float32})
        memory = "linear"
        backward = True

        def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
            raise RuntimeError("kernel exploded\nsecond line")

    registry = attnhub.get_registry()
    registry.add(Broken())
    try:
        data = bench.run_bench(
            tiny(
                seqlens=(32,),
                causal=(False,),
                windows=(),
                backends=("broken_for_bench", "torch_sdpa"),
            ),
            progress=False,
        )
    finally:
        registry.remove("broken_for_bench")
        dispatch.clear_cache()
    broken = [s for s in data["skipped"] if s["backend"] == "broken_for_bench"]
    assert {tuple(s["modes"]) for s in broken} == {("fwd",), ("bwd", "fwd_bwd")}
    assert all(s["reason"] == "raised RuntimeError: kernel exploded" for s in broken)
    assert len(_rows(data, backend="torch_sdpa")) == 3


def test_quick_and_default_grids():
    quick = BenchConfig.quick(device="cpu").points()
    assert [(p.dtype, p.head_dim, p.seqlen, p.causal) for p in quick] == [
        ("bfloat16", 128, n, c) for n in (1024, 4096) for c in (False, True)
    ]
    full = BenchConfig(device="cpu").points()
    assert len(full) == 2 * 2 * 5 * 2
    assert all(p.batch * p.seqlen == 16384 and p.heads * p.head_dim == 2048 for p in full)
    windows = BenchConfig(device="cpu", grid=False, windows=bench.DEFAULT_WINDOWS).points()
    assert [(p.batch, p.heads, p.seqlen, p.head_dim, p.window) for p in windows] == [
        (2, 16, 16384, 128, w) for w in (256, 1024, 4096)
    ]
    with pytest.raises(ValueError, match="unknown mode"):
        BenchConfig(modes=("fwd", "backward"))


# -- report ------------------------------------------------------------------------


def _synthetic() -> dict:  # type: ignore[type-arg]
    rows = []
    for n in (1024, 4096):
        for backend, ms in (("torch_sdpa_cudnn", 0.9), ("triton_flash", 1.2), ("auto", 1.0)):
            for mode in ("fwd", "fwd_bwd"):
                p = Point("bfloat16", 16384 // n, 16, n, 128, causal=True)
                rows.append({
                    "backend": backend, "dtype": "bfloat16", "B": p.batch, "Hq": 16, "Hkv": 16,
                    "Nq": n, "Nk": n, "D": 128, "causal": True, "mode": mode, "ms": ms,
                    "tflops": p.flops(mode) / (ms * 1e-3) / 1e12, "peak_mib": 100.0 * n / 1024,
                    "density": None, **({"chosen": "torch_sdpa_cudnn"} if backend == "auto" else {}),
                })  # fmt: skip
    for w in (256, 1024):
        rows.append({
            "backend": "triton_flash", "dtype": "bfloat16", "B": 2, "Hq": 16, "Hkv": 16,
            "Nq": 16384, "Nk": 16384, "D": 128, "causal": True, "mode": "fwd", "ms": w / 1000,
            "tflops": 1.0, "peak_mib": 1.0, "density": None, "window": [w - 1, 0],
        })  # fmt: skip
    env = {"gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6.0", "cuda": "13.0",
           "date": "2026-12-01T00:00:00+00:00", "attnhub_commit": "abc1234"}  # fmt: skip
    return {"env": env, "results": rows, "skipped": [], "device_class": "sm90"}


def test_report_writes_plots_and_a_table(tmp_path):
    data = _synthetic()
    written = bench_report.write_report(data, tmp_path / "h200.json")
    names = sorted(p.name for p in written)
    assert names == [
        "h200-memory-bf16.png", "h200-tflops-bf16.png", "h200-window.png", "h200.md"
    ]  # fmt: skip
    for p in written:
        if p.suffix == ".png":
            assert p.read_bytes().startswith(PNG) and p.stat().st_size > 5000
    table = (tmp_path / "h200.md").read_text()
    # auto/best = fastest registered (cudnn, 0.9 ms) over auto (1.0 ms); tf/cudnn = 0.9 / 1.2.
    line = next(
        ln for ln in table.splitlines() if ln.startswith("| bf16 | 128 | 4096 | yes | fwd |")
    )
    cells = [c.strip() for c in line.strip("|").split("|")]
    header_line = next(ln for ln in table.splitlines() if ln.startswith("| dtype |"))
    header = [c.strip() for c in header_line.strip("|").split("|")]
    row = dict(zip(header, cells))
    assert row["auto/best"] == "0.90" and row["tf/cudnn"] == "0.75"
    assert row["auto"].endswith("(torch_sdpa_cudnn)")
    assert bench_report.AUTO_NOISE in table  # auto was timed: say what auto/best can't resolve
    assert "| 256 | fwd | bf16 | 16384 | 0.256 |" in table


def test_report_on_cpu_results_has_no_memory_plot(cpu_run, tmp_path):
    data, _ = cpu_run
    names = sorted(p.name for p in bench_report.write_report(data, tmp_path / "cpu.json"))
    assert names == ["cpu-tflops-fp32.png", "cpu-window.png", "cpu.md"]
    text = (tmp_path / "cpu.md").read_text()
    assert "torch_sdpa_flash (5 point(s)): unavailable: CUDA is not available" in text


def test_cli_bench_writes_json_and_report_regenerates_it(tmp_path, capsys):
    out = tmp_path / "res" / "run.json"
    argv = ["bench", "--device", "cpu", "--dtypes", "fp32", "--head-dims", "16", "--seqlens", "32",
            "--tokens", "64", "--hidden", "32", "--causal", "yes", "--modes", "fwd",
            "--backends", "torch_sdpa,auto", "--no-progress", "--no-plots", "-o", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[-1] == "skipped: nothing"  # the table comes last
    assert "| fp32 | 16 | 32 | yes | fwd |" in printed
    data = json.loads(out.read_text())
    assert [(r["backend"], r["mode"]) for r in data["results"]] == [
        ("torch_sdpa", "fwd"),
        ("auto", "fwd"),
    ]
    (tmp_path / "res" / "run.md").unlink()
    assert cli.main(["bench", "--report", str(out)]) == 0
    assert (tmp_path / "res" / "run.md").is_file()
    assert (tmp_path / "res" / "run-tflops-fp32.png").read_bytes().startswith(PNG)


def test_bench_help_works_without_a_gpu():
    proc = subprocess.run(
        [sys.executable, "-m", "attnhub", "bench", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "--quick" in proc.stdout and "--report" in proc.stdout
