"""The watchdog's disk limit (``isolation/written.py``): a candidate that prints or writes without end is
killed before it fills the host's disk, the scratch folders of a killed run are removed, and a failure
quotes a bounded tail of a log that may hold one line of gigabytes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from targets.harness.isolation import written
from targets.harness.isolation.launch import Limits, _watch, run_harness
from targets.harness.isolation.processes import log_tail
from targets.harness.isolation.sandbox import Sandbox
from targets.harness.isolation.written import DiskWatch, measure
from targets.harness.target import Target


def test_what_a_candidate_wrote_is_counted_in_blocks_so_a_sparse_file_claims_nothing(tmp_path):
    with (tmp_path / "sparse").open("wb") as sparse:
        sparse.truncate(1 << 30)  # a gigabyte long, no disk held
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "dense").write_bytes(os.urandom(3 << 20))
    os.sync()
    seen = measure([tmp_path, tmp_path / "gone"])  # a path removed before the walk holds nothing
    assert 3 <= seen.mb < 3.5 and seen.entries == 4, seen


def test_a_file_storm_is_named_before_its_walk_takes_the_watchdogs_time(tmp_path, monkeypatch):
    monkeypatch.setattr(written, "MAX_ENTRIES", 50)
    for i in range(60):
        (tmp_path / f"f{i}").touch()
    assert "made over 50 files and folders" in DiskWatch({tmp_path}).excess(1000.0)
    assert DiskWatch({tmp_path / "f0"}).excess(1000.0) == ""


_WRITER = (  # writes to its scratch folder and prints, without end
    "import os, sys, time\n"
    "print('ready', flush=True)\n"
    "with open(sys.argv[1] + '/out', 'wb') as f:\n"
    "    while True:\n"
    "        f.write(os.urandom(1 << 20)); f.flush(); print('x' * 4096, flush=True); time.sleep(0.01)\n"
)


def test_a_process_that_writes_without_end_is_killed_at_the_disk_limit_and_its_scratch_removed(tmp_path):
    scratch, log = tmp_path / "vt-scratch", tmp_path / "cluster.log"
    scratch.mkdir()
    read_fd, write_fd = os.pipe()
    exits_fd, exits_write_fd = os.pipe()  # no exit is said: the writer outlives the watch
    with log.open("w") as output:
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(scratch)], stdout=output)
    try:
        os.write(write_fd, f"{written.WRITES} {scratch}\n{written.WRITES} {log}\n".encode())
        why = _watch(writer, Limits(time_s=30.0, disk_mb=20.0), read_fd, exits_fd, {}, [], [])
    finally:
        writer.kill()
        writer.wait()
        for fd in (read_fd, write_fd, exits_fd, exits_write_fd):
            os.close(fd)
    assert re.search(r"wrote \d+ MB to its logs and scratch folders, over its limit of 20 MB", why), why
    assert not scratch.exists() and log.exists()  # the run's scratch goes with it; its log stays, for its reasons


def test_a_failure_quotes_a_bounded_tail_of_a_log_of_one_enormous_line(tmp_path):
    log = tmp_path / "controller.log"
    log.write_text("x" * (20 << 20) + "\nTraceback: the last words\n")
    tail = log_tail(log)
    assert len(tail) < 1000 and tail.endswith("the last words") and "[...]" in tail, tail[:200]


@pytest.mark.slow
def test_a_candidate_that_prints_without_end_is_killed_before_it_fills_the_disk(tmp_path, tiny_spec):
    from tests.test_agents import _planted_build

    stack = _planted_build(
        tmp_path,
        tiny_spec,
        "    import os, time\n    print('scratch', os.getcwd(), flush=True)\n"
        "    while True:  # planted: a log without end\n"
        "        print('y' * (1 << 20), flush=True)\n        time.sleep(0.005)\n",
    )
    out = tmp_path / "out"
    run = run_harness(
        Target.load("tiny-qwen3-cpu"), stack, out, "accuracy", Limits(time_s=120, disk_mb=64), Sandbox("subprocess")
    )
    assert not run.ok and "over its limit of 64 MB" in run.cause, run.cause
    log = out / "components.log"
    assert log.stat().st_size < 1 << 30  # measured once a second: what one second of printing adds, at most
    with log.open() as lines:
        scratch = Path(next(line.split()[1] for line in lines if line.startswith("scratch ")))
    assert not scratch.exists(), scratch
