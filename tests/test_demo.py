"""``attnhub demo``: runs a model stock and patched, judges both against the reference,
says which backend served each call, and exits 0 only when attnhub is right."""

from __future__ import annotations

import re
import sys

import pytest
import torch
import torch.nn.functional as F

import attnhub
from attnhub import cli, demo, dispatch
from attnhub import patching as patch_module
from attnhub.backends.torch_reference import TorchReference
from attnhub.registry import get_registry

ORIGINAL = F.scaled_dot_product_attention
SMALL = ["--device", "cpu", "--seq", "24", "--steps", "1"]


@pytest.mark.parametrize("model", ["builtin", "hf"])
def test_demo_reports_backend_verdicts_and_time(model, capsys):
    if model == "hf":
        pytest.importorskip("transformers")
    assert demo.main(["--model", model, *SMALL]) == 0
    out = capsys.readouterr().out
    assert F.scaled_dot_product_attention is ORIGINAL  # the demo leaves nothing patched
    # Which backend served the attention calls (2 layers), and why.
    assert re.search(r"2 call\(s\): q \(2, 4, 24, 32\)", out), out
    assert re.search(r"-> torch_sdpa: .*priority", out), out
    assert "torch_sdpa: 2" in out
    # Both ways judged against the float64 reference by the contract's rule.
    assert "reference (float64, attention by torch_reference)" in out, out
    assert re.search(r"stock +PASS: worst error [\d.]+x the bound", out), out
    assert re.search(r"patched +PASS: worst error [\d.]+x the bound", out), out
    assert re.search(r"stock [\d.]+ ms \([\d,]+ tokens/s\), patched [\d.]+ ms", out), out
    assert "OK: attnhub's results are finite and within the contract's tolerance" in out
    assert "NOTE: stock PyTorch gives NaN" not in out  # PyTorch's CPU kernel gives zeros
    if model == "hf":
        assert "LlamaForCausalLM" in out and "bool mask" in out  # the left-padded row
    else:
        assert "TinyGPT" in out and "is_causal=True, enable_gqa=True" in out


def _stock_like_cuda(fill: float):  # type: ignore[no-untyped-def]
    """PyTorch's function as its CUDA kernels behave: ``fill`` (NaN, or arbitrary finite
    values as cuDNN gives with a bool mask) on query rows with no visible key.

    Calls that attnhub's own backends make inside a patched call get the real function.
    """

    def sdpa(query, key, value, attn_mask=None, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = ORIGINAL(query, key, value, attn_mask, *args, **kwargs)
        if attn_mask is None or getattr(patch_module._inside, "active", False):
            return out
        visible = attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")
        empty = ~visible.any(dim=-1, keepdim=True).expand(*out.shape[:-1], 1)
        return out.masked_fill(empty, fill)

    return sdpa


@pytest.mark.parametrize("fill", [float("nan"), 3.0], ids=["nan", "garbage"])
def test_demo_says_when_stock_is_wrong_and_attnhub_is_not(monkeypatch, capsys, fill):
    pytest.importorskip("transformers")
    # The hf model's last row is left-padded: its first positions see no key at all.
    # Their own logits are excluded from the loss, but what stock puts there reaches
    # the other positions through the next layers and every gradient.
    monkeypatch.setattr(F, "scaled_dot_product_attention", _stock_like_cuda(fill))
    assert demo.main(["--model", "hf", *SMALL]) == 0
    out = capsys.readouterr().out
    if fill != fill:  # NaN
        assert re.search(r"stock +FAIL: .*NaN or inf in \d+ of \d+ tensors", out), out
        assert "NOTE: stock PyTorch's step has NaN or inf in" in out
    else:
        assert re.search(r"stock +FAIL: worst error [\d.]+x the bound", out), out
        assert re.search(r"NOTE: stock PyTorch's step has an error [\d.]+x the contract's", out)
    assert re.search(r"patched +PASS", out), out
    assert "In 6 query positions of the attention calls every key is masked" in out
    assert "a difference in attnhub's favour, not an error" in out


class _Wrong(TorchReference):
    """A backend that outranks the others and is wrong: outputs off by 1%, or NaN."""

    name = "wrong_for_demo_test"
    priority = 1000
    memory = "linear"
    nan = False

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        out = super().forward(query, key, value, attn_mask, params)
        return out * float("nan") if self.nan else out * 1.01


@pytest.fixture
def wrong_backend():  # type: ignore[no-untyped-def]
    registry = get_registry()
    backend = _Wrong()
    registry.add(backend)
    dispatch.clear_cache()
    yield backend
    registry.remove(backend.name)
    dispatch.clear_cache()


@pytest.mark.parametrize("nan", [False, True], ids=["off-by-1%", "nan"])
def test_demo_exits_1_and_says_so_when_attnhub_is_wrong(wrong_backend, nan, capsys):
    wrong_backend.nan = nan
    assert demo.main(["--model", "builtin", *SMALL]) == 1
    out = capsys.readouterr().out
    assert "-> wrong_for_demo_test" in out
    assert re.search(r"patched +FAIL", out), out
    assert re.search(r"stock +PASS", out), out
    if nan:
        assert "ERROR: attnhub's results hold NaN or inf in logits" in out, out
    else:
        assert re.search(r"ERROR: attnhub's \S+ deviates [\d.]+x the contract's tolerance", out)
    assert "OK:" not in out


def test_cli_demo_subcommand(capsys):
    argv = ["demo", "--model", "builtin", "--device", "cpu", "--seq", "8", "--steps", "1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "attnhub.stats()" in out and "torch_sdpa: 2" in out
    assert attnhub.stats()  # the demo's calls were counted


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_demo_on_the_gpu_exits_0_with_an_honest_report(capsys):
    # The large model, as `attnhub demo` runs it on a GPU, with fewer timed steps.
    assert demo.main(["--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "hidden 2048" in out and "x 4096 tokens" in out
    assert re.search(r"patched +PASS", out), out
    assert re.search(
        r"patched runs at [\d.]+x stock's speed \(2 step\(s\): too few to tell", out
    ), out


@pytest.mark.parametrize(
    ("option", "value"),
    [("--batch", "0"), ("--batch", "-1"), ("--seq", "-1"), ("--seq", "0"), ("--steps", "-3"),
     ("--steps", "0"), ("--steps", "x")],
)  # fmt: skip
def test_demo_rejects_sizes_below_1_naming_the_option(option, value, capsys):
    # Exit 1 means "attnhub's results are wrong": an unusable option is argparse's 2.
    with pytest.raises(SystemExit) as exited:
        cli.main(["demo", "--model", "builtin", "--device", "cpu", option, value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {option}: expected an integer >= 1, got {value!r}" in err, err


def test_demo_rejects_an_unknown_device(capsys):
    with pytest.raises(SystemExit) as exited:
        demo.main(["--model", "builtin", "--device", "tpu"])
    assert exited.value.code == 2
    assert "error: argument --device: " in capsys.readouterr().err


@pytest.mark.parametrize(
    ("stock", "patched", "verdict"),
    [
        # Every pair's ratio above 1: faster, with the middle half of the ratios.
        (
            [2.0, 2.2, 2.1, 2.0],
            [1.0, 1.0, 1.0, 1.0],
            "faster: the middle half of the paired ratios 2.00-2.12",
        ),
        (
            [1.0, 1.0, 1.0],
            [1.25, 1.25, 2.0],
            "slower: the middle half of the paired ratios 0.65-0.80",
        ),
        # Medians apart (1.0 vs 1.1) but pairs on both sides of 1: noise, not slower.
        (
            [1.0, 1.0, 1.2, 0.9, 1.3],
            [1.1, 0.9, 1.1, 1.1, 1.1],
            "no difference beyond this run's noise",
        ),
        ([1.0, 2.0], [2.0, 1.0], "2 step(s): too few to tell a difference from noise"),
    ],
)
def test_the_speed_verdict_reads_the_paired_steps(stock, patched, verdict):
    assert demo.speed_verdict(stock, patched).startswith(verdict)


def test_demo_honours_the_steps_asked_for(capsys):
    assert demo.main(["--model", "builtin", "--device", "cpu", "--seq", "8", "--steps", "2"]) == 0
    assert "(median of 2, interleaved)" in capsys.readouterr().out


def test_demo_model_hf_without_transformers_exits_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails
    assert demo.main(["--model", "hf", *SMALL]) == 2
    assert "--model hf needs transformers" in capsys.readouterr().err
