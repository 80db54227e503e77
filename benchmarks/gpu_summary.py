"""Summarize the GPU run's pytest results into one committed JSON.

    python benchmarks/gpu_summary.py gpu-tests.xml run.log [...] --out gpu-check.json

Reads JUnit XML files, or ``pytest -v`` logs (``path::test[id] PASSED`` lines), which
survive a run cut short by a time limit where JUnit XML is never written.

Counts passed / failed / skipped tests per backend (read from the test ids, which
start with the backend's name) and keeps every failure's id and first message line,
with the environment the run saw.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import torch

_VERBOSE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def _backend_of(name: str) -> str:
    inside = name[name.find("[") + 1 :] if "[" in name else name
    inside = inside.removeprefix("attnhub[")
    return inside.split("-", 1)[0] if "-" in inside else "other"


def summarize(paths: list[Path]) -> dict:
    per_backend: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    failures = []
    for path in paths:
        if not path.exists():
            failures.append({"test": str(path), "message": "no result file: the step did not run"})
            continue
        if path.suffix != ".xml":
            for line in path.read_text(errors="replace").splitlines():
                match = _VERBOSE.match(line)
                if match:
                    test, outcome = match.groups()
                    key = {"PASSED": "passed", "SKIPPED": "skipped", "XFAIL": "skipped"}.get(
                        outcome, "failed"
                    )
                    per_backend[_backend_of(test)][key] += 1
                    if key == "failed":
                        failures.append({"test": test, "message": outcome})
            continue
        for case in ET.parse(path).getroot().iter("testcase"):
            name = case.get("name", "")
            backend = _backend_of(name)
            if case.find("failure") is not None or case.find("error") is not None:
                node = (
                    case.find("failure") if case.find("failure") is not None else case.find("error")
                )
                per_backend[backend]["failed"] += 1
                message = (node.get("message") or node.text or "").strip().splitlines()
                failures.append(
                    {
                        "test": f"{case.get('classname')}::{name}",
                        "message": message[0][:400] if message else "",
                    }
                )
            elif case.find("skipped") is not None:
                per_backend[backend]["skipped"] += 1
            else:
                per_backend[backend]["passed"] += 1
    return {
        "env": {
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
        "per_backend": {k: dict(v) for k, v in sorted(per_backend.items())},
        "failures": failures,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("xml", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    summary = summarize(args.xml)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    for backend, counts in summary["per_backend"].items():
        print(f"{backend:24s} {counts}")
    print(f"{len(summary['failures'])} failures")


if __name__ == "__main__":
    main()
