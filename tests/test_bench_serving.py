"""``attnhub bench --decode`` / ``--serving`` / ``--varlen``: the CLI's wiring, and the
decode report redrawn from the committed H200 run (the timing itself needs CUDA)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from attnhub import cli

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
@pytest.mark.parametrize("flag", ["--decode", "--serving", "--varlen"])
def test_without_cuda_the_serving_benches_say_so_and_exit_2(flag, capsys, tmp_path):
    assert cli.main(["bench", flag, "-o", str(tmp_path / "x.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_decode_report_redraws_the_table_and_the_bandwidth_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    pytest.importorskip("triton")
    source = tmp_path / "decode.json"
    shutil.copy(RESULTS / "decode-h200.json", source)
    rows = json.loads(source.read_text())["rows"]
    assert cli.main(["bench", "--decode", "--report", str(source)]) == 0
    table = (tmp_path / "decode.md").read_text()
    assert capsys.readouterr().out.strip() == table.strip()
    timed = [r for r in rows if r.get("ms")]
    for r in timed:  # every timed row of the run, with its time as the run recorded it
        assert f"| {r['case']} | {r['impl']} | {r['ms']:.4f} |" in table
    png = tmp_path / "decode-bandwidth.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_decode_sections_are_checked(tmp_path, capsys, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli.main(["bench", "--decode", "--decode-sections", "nq1,bogus"]) == 2
    assert "unknown bogus" in capsys.readouterr().err
