"""The ``attnhub`` command line: ``info`` survives backends whose own code fails, and
``explain`` turns bad option values into argparse errors (exit 2, naming the option)
while deciding exactly as for real tensors, without allocating the described call."""

from __future__ import annotations

import re

import pytest
import torch

import attnhub
from attnhub import cli, dispatch
from attnhub import registry as registry_module
from attnhub.backends.torch_reference import TorchReference
from attnhub.registry import BackendRegistry, PluginFailure


@pytest.fixture
def registry(monkeypatch):  # type: ignore[no-untyped-def]
    """An empty process registry for the test; caches are cleared both ways."""
    fresh = BackendRegistry()
    monkeypatch.setattr(registry_module, "_registry", fresh)
    dispatch.clear_cache()
    yield fresh
    dispatch.clear_cache()


# -- attnhub info ---------------------------------------------------------------------


class _CapabilitiesRaise(TorchReference):
    name = "caps_raises"

    def capabilities(self):  # type: ignore[no-untyped-def]
        raise RuntimeError("optional lib missing")


class _CapabilitiesNone(TorchReference):
    name = "caps_none"

    def capabilities(self):  # type: ignore[no-untyped-def]
        return None


class _PriorityFailsLater(TorchReference):
    """A ``priority`` property that is valid at registration and raises afterwards."""

    name = "priority_fails"
    failing = False

    @property
    def priority(self):  # type: ignore[no-untyped-def, override]
        if self.failing:
            raise RuntimeError("device query failed")
        return 5


def test_info_shows_broken_backends_and_prints_everything_else(registry, capsys):
    registry.add(TorchReference())
    registry.add(_CapabilitiesRaise())
    registry.add(_CapabilitiesNone())
    later = _PriorityFailsLater()
    registry.add(later)
    later.failing = True
    registry.failures.append(PluginFailure("broken", "attnhub-broken", "ImportError: nope"))
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    backends, capabilities = out.split("declared capabilities:")
    # The backend table: every backend; a priority that raises is shown as such.
    assert re.search(r"\ntorch_reference +registry.add at run time +-100 +yes\n", backends), out
    assert re.search(
        r"\npriority_fails +registry.add at run time +broken: priority raised RuntimeError: "
        r"device query failed +yes\n",
        backends,
    ), out
    assert re.search(r"\ncaps_raises +registry.add at run time +-100 +yes\n", backends), out
    # The capabilities table: the broken rows say why, the others are whole.
    assert re.search(
        r"\ncaps_raises +broken: capabilities\(\) raised RuntimeError: optional lib missing\n",
        capabilities,
    ), out
    assert re.search(
        r"\ncaps_none +broken: capabilities\(\) returned None, not a dict of str\n", capabilities
    ), out
    caps = TorchReference().capabilities()
    for name in ("torch_reference", "priority_fails"):
        assert re.search(rf"\n{name} +{re.escape(caps['devices'])} +{caps['dtypes']} ", out), out
    # And what comes after them.
    assert "  broken (distribution attnhub-broken): ImportError: nope" in out


# -- attnhub explain ------------------------------------------------------------------

EXPLAIN = ["explain", "--device", "cpu", "--shape", "1,4,8,16"]


def _tensors(b, h, n, d, *, nk=None, hkv=None, dtype=torch.float16, grad=False):  # type: ignore[no-untyped-def]
    """Real tensors of a described call, as explain's docstring promises it decides for."""
    q = torch.empty(b, h, n, d, dtype=dtype).requires_grad_(grad)
    k = torch.empty(b, hkv or h, nk or n, d, dtype=dtype)
    return q, k, torch.empty_like(k)


@pytest.mark.parametrize(
    ("argv", "tensors", "options"),
    [
        (["--shape", "2,4,64,32", "--causal"], _tensors(2, 4, 64, 32), {"causal": True}),
        (
            ["--shape", "1,8,16,64", "--kv-heads", "2", "--kv-len", "40", "--dtype", "float32",
             "--backward", "--lse", "--window", "4,0", "--alignment", "bottom_right"],
            _tensors(1, 8, 16, 64, nk=40, hkv=2, dtype=torch.float32, grad=True),
            {"return_lse": True, "window": (4, 0), "alignment": "bottom_right"},
        ),
        (
            ["--shape", "3,2,5,8", "--dtype", "float64", "--softcap", "30", "--dropout", "0.1"],
            _tensors(3, 2, 5, 8, dtype=torch.float64),
            {"softcap": 30.0, "dropout_p": 0.1},
        ),
    ],
    ids=["causal", "gqa-grad-lse-window", "softcap-dropout"],
)  # fmt: skip
def test_explain_decides_as_for_real_tensors(argv, tensors, options, capsys):
    decision = attnhub.explain(*tensors, **options)
    assert cli.main(["explain", "--device", "cpu", *argv]) == (0 if decision.chosen else 1)
    assert capsys.readouterr().out == f"{decision}\n"


def test_explain_allocates_nothing_of_the_described_calls_size(capsys):
    # 2**57 float16 elements a tensor: no machine could allocate them.
    assert cli.main([*EXPLAIN, "--shape", "1048576,1024,1048576,128"]) == 0
    assert "chosen: " in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--window", "256"], "--window"),
        (["--window", "a,b"], "--window"),
        (["--window", "1,2,3"], "--window"),
        (["--window=-1,0"], "--window"),  # (as one word: "-1,0" looks like an option)
        (["--device", "tpu"], "--device"),
        (["--shape", "1,2,-8,16"], "--shape"),
        (["--kv-len", "-1"], "--kv-len"),
        (["--kv-heads", "-2"], "--kv-heads"),
        (["--dtype", "float32x"], "--dtype"),
        (["--dtype", "int32"], "--dtype"),
    ],
)
def test_explain_rejects_bad_option_values_naming_the_option(argv, option, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main([*EXPLAIN, *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"attnhub explain: error: argument {option}: " in err, err
    assert "Traceback" not in err


def test_a_device_torch_cannot_allocate_on_is_refused_in_one_sentence(capsys):
    """PyTorch's "Could not run 'aten::empty.memory_format' ... from the 'XLA' backend"
    goes on to list every dispatch key: 2,000 characters in the usage error before."""
    with pytest.raises(SystemExit) as exited:
        cli.main([*EXPLAIN, "--device", "xla"])
    assert exited.value.code == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith(
        "attnhub explain: error: argument --device: device 'xla' cannot be used here: "
        "NotImplementedError: Could not run 'aten::empty.memory_format'"
    ), line
    assert len(line) < 250, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_explain_rejects_cuda_where_there_is_none(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main([*EXPLAIN, "--device", "cuda"])
    assert exited.value.code == 2
    assert "argument --device: 'cuda': CUDA is not available here" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-heads", "3"], "query heads Hq=4 must be a multiple of key/value heads Hkv=3"),
        (["--backend", "nope"], "unknown backend 'nope'"),
        (["--shape", "1,4,8,0"], "head dim D must be >= 1"),
    ],
)
def test_explain_reports_a_call_attention_would_refuse(argv, message, capsys):
    assert cli.main([*EXPLAIN, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnhub explain: ") and message in err, err


def test_explain_backend_follows_the_attnhub_backend_grammar(capsys):
    assert cli.main(EXPLAIN) == 0
    unrestricted = capsys.readouterr().out
    for nothing in (",", " , ,", ""):  # no names: no restriction, as ATTNHUB_BACKEND=",,,"
        assert cli.main([*EXPLAIN, "--backend", nothing]) == 0
        assert capsys.readouterr().out == unrestricted
    # Blanks around names trimmed, empty items and repeats ignored.
    q, k, v = _tensors(1, 4, 8, 16)
    for names in (" torch_reference , ,torch_reference", "torch_sdpa, torch_reference"):
        listed = list(dict.fromkeys(n.strip() for n in names.split(",") if n.strip()))
        expected = attnhub.explain(q, k, v, backend=listed)
        assert cli.main([*EXPLAIN, "--backend", names]) == 0
        assert capsys.readouterr().out == f"{expected}\n"


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--head-dims=0"], "--head-dims"),  # was a ZeroDivisionError traceback
        (["--head-dims=-64"], "--head-dims"),
        (["--seqlens="], "--seqlens"),
        (["--seqlens=1024,x"], "--seqlens"),
        (["--windows=0"], "--windows"),
        (["--flex-seqlens=0"], "--flex-seqlens"),
        (["--window-shape=2,16,128"], "--window-shape"),
        (["--tokens=0"], "--tokens"),
        (["--hidden=-1"], "--hidden"),
        (["--rep=0"], "--rep"),
        (["--time-budget=-1"], "--time-budget"),
        (["--time-budget=nan"], "--time-budget"),
        (["--block-size=0"], "--block-size"),
        (["--block-sparse-long-seqlens=0"], "--block-sparse-long-seqlens"),
        (["--iters=0"], "--iters"),
        (["--repeats=0"], "--repeats"),
        (["--budget=0"], "--budget"),
    ],
)
def test_bench_rejects_sizes_and_counts_below_one_naming_the_option(argv, option, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"attnhub bench: error: argument {option}: " in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "field",
    [
        {"head_dims": (0,)},
        {"seqlens": (1024, -1)},
        {"tokens": 0},
        {"hidden": 0},
        {"windows": (0,)},
        {"window_shape": (2, 0, 64, 16)},
        {"block_sparse_long_seqlens": (0,)},
        {"rep": 0},
        {"warmup": -1},
    ],
    ids=lambda f: next(iter(f)),
)
def test_bench_config_rejects_sizes_below_one(field):
    from attnhub.bench import BenchConfig

    with pytest.raises(ValueError, match=next(iter(field))):
        BenchConfig(**field)


@pytest.mark.parametrize(
    "content", [None, "not json", '{"a": 1}'], ids=["missing", "not-json", "not-results"]
)
@pytest.mark.parametrize(
    ("command", "argv"),
    [("bench", ["--report"]), ("tune", ["--from-results"]), ("bench", ["--decode", "--report"])],
    ids=["bench-report", "tune-from-results", "decode-report"],
)
def test_results_files_that_cannot_be_read_are_reported_naming_the_file(
    command, argv, content, tmp_path, capsys
):
    """A missing, non-JSON or non-results file: a one-line error naming it and exit
    status 2 (a FileNotFoundError, JSONDecodeError or ValueError traceback before)."""
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    assert cli.main([command, *argv, str(path)]) == 2
    err = capsys.readouterr().err
    assert f"attnhub {command}" in err and str(path) in err, err
    assert "Traceback" not in err
