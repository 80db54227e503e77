"""The measurement file: what a store reads from it, what it writes, and what it never
destroys (another program's file, another process's entries)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from attnhub import jsonfile, measured
from attnhub.request import AttentionRequest

Build = Callable[..., AttentionRequest]


def _measurement(ms: float = 1.0) -> measured.Measurement:
    return measured.Measurement({"torch_sdpa": ms}, measured.now())


def _entry(ms: object = 1.0, **more: object) -> dict[str, object]:
    return {"ms": {"torch_sdpa": ms}, "when": "2025-01-01T00:00:00+00:00", **more}


def _file(path: Path, entries: dict[str, object]) -> None:
    path.write_text(json.dumps({"format": measured.FORMAT, "entries": entries}))


def _keys(path: Path) -> set[str]:
    return set(json.loads(path.read_text())["entries"])


# -- a file that is not ours is never overwritten ------------------------------------

NOT_OURS = {
    "a newer attnhub's": json.dumps(
        {"format": "attnhub-measured/2", "entries": {"k": {"ms": {"x": 1.0}}}}
    ),
    "another program's JSON": json.dumps({"model": "llama", "layers": 32}),
    "a JSON list": "[1, 2, 3]",
    "not JSON": "this is not JSON\n",
}


@pytest.mark.parametrize("contents", NOT_OURS.values(), ids=NOT_OURS.keys())
def test_a_file_that_is_not_a_measurement_file_is_never_overwritten(
    tmp_path: Path, cuda_request: Build, caplog: pytest.LogCaptureFixture, contents: str
) -> None:
    path = tmp_path / "shared.json"
    path.write_text(contents)
    store = measured.MeasurementStore(path)
    first, second = cuda_request(seqlen_q=8), cuda_request(seqlen_q=64)
    with caplog.at_level(logging.WARNING, logger="attnhub"):
        store.put(first, _measurement())
        store.put(second, _measurement())
    assert path.read_text() == contents
    assert store.get(first) is not None and store.get(second) is not None  # in memory
    said = [r.getMessage() for r in caplog.records if "in memory only" in r.getMessage()]
    assert len(said) == 1 and str(path) in said[0]  # said once, not at every put
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [
        "shared.json"
    ]


def test_an_empty_file_is_ours_to_fill(tmp_path: Path, cuda_request: Build) -> None:
    """A file created empty (``touch``, for ``ATTNHUB_MEASUREMENTS``) holds nothing to
    destroy: measurements are written to it."""
    path = tmp_path / "shared.json"
    path.touch()
    request = cuda_request()
    measured.MeasurementStore(path).put(request, _measurement())
    assert _keys(path) == {measured.request_key(request)}


# -- writers merge: no process wipes another's entries -------------------------------

_CHILD = r"""
import pathlib, sys
from attnhub import measured
from attnhub.request import AttentionRequest
import torch
n = int(sys.argv[2])
request = AttentionRequest(device_type="cuda", capability=(9, 0), dtype=torch.bfloat16,
    batch=1, heads_q=2, heads_kv=2, seqlen_q=n, seqlen_k=n, same_seqlen=True,
    q_longer=False, head_dim=16, head_dim_v=16, causal=False)
store = measured.MeasurementStore(pathlib.Path(sys.argv[1]))  # read while the file is absent
print("ready", flush=True)
sys.stdin.readline()
store.put(request, measured.Measurement({"torch_sdpa": 1.0}, measured.now()))
print(measured.request_key(request), flush=True)
"""


def test_two_processes_writing_one_after_the_other_keep_both_entries(tmp_path: Path) -> None:
    """Both read the (absent) file first, then write one after the other: the second
    merges into what the first wrote instead of replacing it with its own copy."""
    path = tmp_path / "measured.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(path), str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for n in (8, 64)
    ]
    keys = set()
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write("\n")
            p.stdin.flush()
            keys.add(p.stdout.readline().strip())
            assert p.wait(timeout=60) == 0
    finally:
        for p in procs:
            p.kill()
    assert len(keys) == 2 and _keys(path) == keys


@pytest.mark.parametrize("lock", ["fcntl", "no fcntl"])
def test_a_write_keeps_entries_written_since_and_ours_win_for_the_same_key(
    tmp_path: Path, cuda_request: Build, monkeypatch: pytest.MonkeyPatch, lock: str
) -> None:
    """With the file lock, and without (Windows has no fcntl): merging is what keeps
    the other writer's entries, the lock only orders writers that overlap."""
    if lock == "no fcntl":
        monkeypatch.setattr(measured, "fcntl", None)
    path = tmp_path / "measured.json"
    shared, theirs, ours = (cuda_request(seqlen_q=n) for n in (8, 64, 512))
    mine, other = measured.MeasurementStore(path), measured.MeasurementStore(path)
    other.put(theirs, _measurement(2.0))
    other.put(shared, _measurement(2.0))
    mine.put(shared, _measurement(1.0))
    mine.put(ours, _measurement(1.0))
    again = measured.MeasurementStore(path)  # a third process, reading the file
    assert {r.seqlen_q: again.get(r).ms["torch_sdpa"] for r in (shared, theirs, ours)} == {  # type: ignore[union-attr]
        8: 1.0,
        64: 2.0,
        512: 1.0,
    }
    assert (tmp_path / "measured.json.lock").exists() == (lock == "fcntl")


def test_an_entry_read_earlier_does_not_overwrite_a_newer_one(
    tmp_path: Path, cuda_request: Build
) -> None:
    """Only what a process measured itself wins: an entry it merely read is stale
    beside the one another process wrote since."""
    path = tmp_path / "measured.json"
    first, second = cuda_request(seqlen_q=8), cuda_request(seqlen_q=64)
    measured.MeasurementStore(path).put(first, _measurement(3.0))
    reader, writer = measured.MeasurementStore(path), measured.MeasurementStore(path)
    writer.put(first, _measurement(1.0))  # measured again elsewhere
    reader.put(second, _measurement(1.0))
    found = measured.MeasurementStore(path).get(first)
    assert found is not None and found.ms == {"torch_sdpa": 1.0}


# -- an empty measurement (nothing could be timed) is not persisted --------------------


def test_an_empty_measurement_is_kept_in_memory_but_not_written(
    tmp_path: Path, cuda_request: Build
) -> None:
    """autotune keeps ``ms == {}`` where every candidate failed to time (out of memory,
    say): this process does not retry at every call, the next one measures again."""
    path = tmp_path / "measured.json"
    failed, timed = cuda_request(seqlen_q=8), cuda_request(seqlen_q=64)
    store = measured.MeasurementStore(path)
    nothing = measured.Measurement({}, measured.now(), {"torch_sdpa": "OutOfMemoryError"})
    store.put(failed, nothing)
    assert store.get(failed) == nothing
    store.put(timed, _measurement())
    assert _keys(path) == {measured.request_key(timed)}
    assert measured.MeasurementStore(path).get(failed) is None


def test_an_empty_measurement_in_the_file_is_not_a_measurement(
    tmp_path: Path, cuda_request: Build
) -> None:
    """Files written before empty measurements stopped being persisted hold some."""
    path = tmp_path / "measured.json"
    request = cuda_request()
    _file(path, {measured.request_key(request): {"ms": {}, "when": "x", "failed": {"a": "OOM"}}})
    assert measured.MeasurementStore(path).get(request) is None


# -- values are not coerced ----------------------------------------------------------

BAD_ENTRIES = {
    "ms as a string": _entry("1.5"),
    "ms as a bool": _entry(True),
    "ms below zero": _entry(-1.0),
    "ms not a mapping": {"ms": [1.0], "when": "x"},
    "when not a string": {"ms": {"torch_sdpa": 1.0}, "when": 5},
    "spread as a string": _entry(1.0, spread={"torch_sdpa": "0.1"}),
    "spread as a bool": _entry(1.0, spread={"torch_sdpa": False}),
    "failed not a string": _entry(1.0, failed={"flash": 3}),
    "not an object": [1.0],
}


@pytest.mark.parametrize("entry", BAD_ENTRIES.values(), ids=BAD_ENTRIES.keys())
def test_a_bad_entry_is_ignored_and_the_rest_read(
    tmp_path: Path, cuda_request: Build, caplog: pytest.LogCaptureFixture, entry: object
) -> None:
    """Like the cost table's loader, the reader takes numbers as numbers only (a bool is
    not one); a bad entry is logged and left out, the others still serve."""
    path = tmp_path / "measured.json"
    bad, good = cuda_request(seqlen_q=8), cuda_request(seqlen_q=64)
    bad_key = measured.request_key(bad)
    _file(path, {bad_key: entry, measured.request_key(good): _entry(2)})
    with caplog.at_level(logging.WARNING, logger="attnhub"):
        store = measured.MeasurementStore(path)
    assert store.get(bad) is None
    found = store.get(good)
    assert found is not None and found.ms == {"torch_sdpa": 2}  # an int is a number
    assert any(bad_key in r.getMessage() for r in caplog.records)


# -- atomic writes leave no temporary file behind -----------------------------------


def test_a_failed_rename_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "m.json"
    target.mkdir()  # os.replace cannot put a file over a directory
    with pytest.raises(OSError):
        jsonfile.write_json({"a": 1}, target)
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_a_failed_measurement_write_leaves_no_temporary_file(
    tmp_path: Path,
    cuda_request: Build,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As on Windows, where a file another process has open cannot be replaced."""

    def refuse(src: object, dst: object) -> None:
        raise PermissionError(13, "in use by another process")

    target = tmp_path / "m.json"
    monkeypatch.setattr(os, "replace", refuse)
    with caplog.at_level(logging.WARNING, logger="attnhub"):
        measured.MeasurementStore(target).put(cuda_request(), _measurement())
    assert "could not write measurements" in caplog.text
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_a_traced_request_reads_the_eager_measurement():
    """Measurements are taken eagerly; the same call traced by torch.compile (a request
    that differs only in ``traced``) is ranked by them too: one key for both."""
    import dataclasses

    import torch

    from attnhub.measured import request_key
    from attnhub.request import AttentionRequest

    eager = AttentionRequest("cuda", (9, 0), torch.bfloat16, 4, 16, 4, 4096, 4096, True, False, 128, 128)  # fmt: skip
    assert request_key(dataclasses.replace(eager, traced=True)) == request_key(eager)


def test_the_store_follows_the_measurement_variable_and_the_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """store_for keeps the store it found per device and the variables that name its
    file: a variable changed between calls names another file, changed back the first
    store again (its entries kept), as store_path says at each call."""
    import torch

    cpu = torch.device("cpu")
    monkeypatch.setenv("ATTNHUB_MEASUREMENTS", str(tmp_path / "a.json"))
    first = measured.store_for(cpu)
    assert measured.store_for(cpu) is first and first.path == measured.store_path(cpu)
    monkeypatch.setenv("ATTNHUB_MEASUREMENTS", str(tmp_path / "b.json"))
    assert measured.store_for(cpu).path == tmp_path / "b.json"
    monkeypatch.delenv("ATTNHUB_MEASUREMENTS")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert measured.store_for(cpu).path == measured.store_path(cpu)
    assert measured.store_for(cpu).path.parent == tmp_path / "cache" / "attnhub"
    monkeypatch.setenv("ATTNHUB_MEASUREMENTS", str(tmp_path / "a.json"))
    assert measured.store_for(cpu) is first
    measured.forget_stores()
    assert measured.store_for(cpu) is not first
