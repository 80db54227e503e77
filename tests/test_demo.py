"""``attnhub demo``: runs a model stock and patched and reports what served each call."""

from __future__ import annotations

import re

import pytest
import torch.nn.functional as F

import attnhub
from attnhub import cli, demo

ORIGINAL = F.scaled_dot_product_attention


def _deviations(text: str) -> list[float]:
    return [float(v) for v in re.findall(r"max \|patched - stock\| = (\S+)", text)]


@pytest.mark.parametrize("model", ["builtin", "hf"])
def test_demo_reports_backend_deviation_and_time(model, capsys):
    if model == "hf":
        pytest.importorskip("transformers")
    assert demo.main(["--model", model, "--device", "cpu", "--seq", "24", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert F.scaled_dot_product_attention is ORIGINAL  # the demo leaves nothing patched
    # Which backend served the attention calls (2 layers), and why.
    assert re.search(r"2 call\(s\): q \(2, 4, 24, 32\)", out), out
    assert re.search(r"-> torch_sdpa: .*priority", out), out
    assert "torch_sdpa: 2" in out
    # Largest deviation from stock (logits, gradients): numbers, and small.
    devs = _deviations(out)
    assert len(devs) == 2 and all(d <= 1e-4 for d in devs), out
    assert re.search(r"stock [\d.]+ ms, patched [\d.]+ ms", out), out
    if model == "hf":
        assert "LlamaForCausalLM" in out and "bool mask" in out  # the left-padded row
    else:
        assert "TinyGPT" in out and "is_causal=True, enable_gqa=True" in out


def test_cli_demo_subcommand(capsys):
    assert (
        cli.main(["demo", "--model", "builtin", "--device", "cpu", "--seq", "8", "--steps", "1"])
        == 0
    )
    out = capsys.readouterr().out
    assert "attnhub.stats()" in out and "torch_sdpa: 2" in out
    assert attnhub.stats()  # the demo's calls were counted
