"""Run PyTorch's own SDPA tests plain and under ``attnhub.patch()``, and compare.

PyTorch's ``test/test_transformers.py`` is not part of attnhub (its code does not carry
over): pass the path of a copy. The script runs it with pytest twice, in two fresh
processes on CPU: once as it is, once with ``attnhub.patch()`` entered for the whole
session (before the test module is imported, so its ``from torch.nn.functional
import scaled_dot_product_attention`` binds the patched function too). It then lists
the tests that pass plain but fail patched, which is what attnhub must not cause,
except the tests docs/retrofit.md names as checking PyTorch's kernel choice or its
dropout stream (``EXPECTED_DIFFERENCES`` below).

    python benchmarks/pytorch_sdpa_tests.py /path/to/test_transformers.py \\
        --pythonpath /path/with/expecttest --output benchmarks/results/pytorch-sdpa-tests-cpu.md

``torch.testing._internal`` ships with the torch wheel but needs the ``expecttest``
package; ``--pythonpath`` adds a folder where it is installed (``pip install --target``)
without touching the environment. Everything after ``--`` goes to pytest.

The same file is the pytest plugin of the patched run (``-p pytorch_sdpa_tests``): it
enters the patch in ``pytest_configure`` and writes ``attnhub.stats()`` at the end, to
show that attnhub did serve the calls.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PLUGIN = Path(__file__).stem
_PATCH_ENV = "ATTNHUB_SDPA_TESTS_PATCH"  # "1" in the patched run's environment
_STATS_ENV = "ATTNHUB_SDPA_TESTS_STATS"  # where the patched run writes attnhub.stats()

# test_scaled_dot_product_fused_attention_mask_vs_math_cpu has 3072 variants; at batch 12
# or query length 1030 they take 15 of the 16.5 minutes of a whole run on two cores
# (measured 2026-12-01). The default keeps every combination of dtype, mask dimension
# and kind, causal, training and head count at batch 2 and query lengths 11 and 514
# (the large sizes run the same code on bigger tensors), about 1.5 minutes a run;
# -k '' runs everything.
DEFAULT_SELECTION = "not (mask_vs_math_cpu and (batch_size_12 or q_seq_len_1030))"

# Tests that legitimately differ under the patch, by name fragment, with the reason
# (docs/retrofit.md lists them too). Empty: none differ in the committed run.
EXPECTED_DIFFERENCES: dict[str, str] = {}


# --- the pytest plugin (patched run) ---------------------------------------------------


def pytest_configure(config: Any) -> None:
    if os.environ.get(_PATCH_ENV) != "1":
        return
    import attnhub

    config._attnhub_patch = attnhub.patch()
    attnhub.reset_stats()


def pytest_unconfigure(config: Any) -> None:
    handle = getattr(config, "_attnhub_patch", None)
    if handle is None:
        return
    import attnhub

    path = os.environ.get(_STATS_ENV)
    if path:
        Path(path).write_text(json.dumps(attnhub.stats(), sort_keys=True))
    handle.undo()


# --- the runner ------------------------------------------------------------------------


@dataclass
class Run:
    """One pytest run: each test's outcome ("passed", "failed", "skipped") and message."""

    label: str
    seconds: float
    returncode: int
    outcomes: dict[str, str] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)

    def count(self, outcome: str) -> int:
        return sum(1 for o in self.outcomes.values() if o == outcome)


def _parse_junit(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                text = child.get("message") or (child.text or "")
                messages[test] = " ".join(text.split())[:300]
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "skipped"
        outcomes[test] = outcome
    return outcomes, messages


def run_tests(
    test_file: Path, patched: bool, selection: str, pythonpath: list[str], timeout: float,
    pytest_args: list[str],
) -> Run:  # fmt: skip
    """Run the test file once in a fresh process; patched runs load this file as plugin."""
    label = "patched" if patched else "plain"
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        stats = Path(tmp) / "stats.json"
        env = dict(os.environ)
        paths = [str(Path(__file__).resolve().parent), *pythonpath]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env[_PATCH_ENV] = "1" if patched else "0"
        env[_STATS_ENV] = str(stats)
        command = [
            sys.executable, "-m", "pytest", str(test_file), "-q", "-p", "no:cacheprovider",
            "-p", PLUGIN, f"--junitxml={junit}", "-o", "junit_family=xunit1",
            *(["-k", selection] if selection else []), *pytest_args,
        ]  # fmt: skip
        start = time.perf_counter()
        try:
            # The test file's own folder as working directory: PyTorch's tests expect it.
            done = subprocess.run(command, env=env, cwd=test_file.parent, timeout=timeout)
            returncode = done.returncode
        except subprocess.TimeoutExpired:
            returncode = -1
        seconds = time.perf_counter() - start
        run = Run(label, seconds, returncode)
        if junit.exists():
            run.outcomes, run.messages = _parse_junit(junit)
        if stats.exists():
            run.stats = json.loads(stats.read_text())
    return run


def _expected_reason(test: str) -> str | None:
    return next((why for key, why in EXPECTED_DIFFERENCES.items() if key in test), None)


def compare(plain: Run, patched: Run) -> dict[str, list[str]]:
    """Tests grouped by how their outcome changed under the patch."""
    groups: dict[str, list[str]] = {
        "regressed": [], "expected": [], "fixed": [], "fail_both": [], "missing": [],
    }  # fmt: skip
    for test, before in sorted(plain.outcomes.items()):
        after = patched.outcomes.get(test)
        if after is None:
            groups["missing"].append(test)
        elif before == "passed" and after == "failed":
            groups["expected" if _expected_reason(test) else "regressed"].append(test)
        elif before == "failed" and after == "passed":
            groups["fixed"].append(test)
        elif before == "failed" and after == "failed":
            groups["fail_both"].append(test)
    return groups


def _per_class(runs: list[Run]) -> list[str]:
    classes = sorted({t.partition("::")[0] for r in runs for t in r.outcomes})
    rows = ["| class | " + " | ".join(f"{r.label} pass/fail/skip" for r in runs) + " |"]
    rows.append("|---|" + "---|" * len(runs))
    for cls in classes:
        cells = []
        for r in runs:
            mine = [o for t, o in r.outcomes.items() if t.partition("::")[0] == cls]
            cells.append("/".join(str(mine.count(o)) for o in ("passed", "failed", "skipped")))
        rows.append(f"| {cls} | " + " | ".join(cells) + " |")
    return rows


def report(plain: Run, patched: Run, header: dict[str, str]) -> str:
    groups = compare(plain, patched)
    lines = ["# PyTorch's SDPA tests, plain and under `attnhub.patch()`", ""]
    lines += [f"- {key}: {value}" for key, value in header.items()]
    lines += ["", "| run | tests | passed | failed | skipped | wall time | pytest exit |"]
    lines += ["|---|---|---|---|---|---|---|"]
    for r in (plain, patched):
        lines.append(
            f"| {r.label} | {len(r.outcomes)} | {r.count('passed')} | {r.count('failed')} | "
            f"{r.count('skipped')} | {r.seconds:.0f} s | {r.returncode} |"
        )
    lines += ["", f"Calls served under the patch (`attnhub.stats()`): `{patched.stats}`", ""]
    lines += [*_per_class([plain, patched]), ""]
    lines.append(f"## Pass plain, fail patched: {len(groups['regressed'])}")
    lines += [f"- `{t}`: {patched.messages.get(t, '')}" for t in groups["regressed"]]
    lines.append(
        f"\n## Expected differences (kernel choice, dropout stream): {len(groups['expected'])}"
    )
    lines += [f"- `{t}`: {_expected_reason(t)}" for t in groups["expected"]]
    lines.append(f"\n## Fail plain, pass patched: {len(groups['fixed'])}")
    lines += [f"- `{t}`" for t in groups["fixed"]]
    lines.append(f"\n## Fail both (not attnhub's): {len(groups['fail_both'])}")
    lines += [f"- `{t}`: {plain.messages.get(t, '')}" for t in groups["fail_both"]]
    if groups["missing"]:
        lines.append(f"\n## Not run patched (timeout or crash): {len(groups['missing'])}")
        lines += [f"- `{t}`" for t in groups["missing"]]
    return "\n".join(lines) + "\n"


def _header(test_file: Path, source: str, selection: str) -> dict[str, str]:
    import torch

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        cwd=Path(__file__).parent,
    ).stdout.strip()  # fmt: skip
    return {
        "date": time.strftime("%Y-%m-%d"),
        "torch": f"{torch.__version__} ({torch.version.git_version[:12]})",
        "attnhub commit": commit or "unknown",
        "test file": source or str(test_file),
        "selection (`-k`)": f"`{selection}`" if selection else "all",
        "machine": f"{os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}",
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("test_file", type=Path, help="a copy of PyTorch's test_transformers.py")
    parser.add_argument("-k", dest="selection", default=DEFAULT_SELECTION,
                        help="pytest -k expression ('' runs everything)")  # fmt: skip
    parser.add_argument("--pythonpath", action="append", default=[],
                        help="folder to add to PYTHONPATH (expecttest)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--source", default="", help="where the test file came from")
    parser.add_argument("--output", type=Path, help="write the markdown report here")
    args = parser.parse_args(argv)
    test_file = args.test_file.resolve()
    if not test_file.is_file():
        parser.error(f"test_file {test_file} is not a file")
    runs = [
        run_tests(test_file, patched, args.selection, args.pythonpath, args.timeout, pytest_args)
        for patched in (False, True)
    ]
    text = report(*runs, _header(test_file, args.source, args.selection))
    if args.output:
        args.output.write_text(text)
    print(text)
    return 1 if compare(*runs)["regressed"] else 0


if __name__ == "__main__":
    sys.exit(main())
