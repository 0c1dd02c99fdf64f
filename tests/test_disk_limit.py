"""The watchdog's disk limit (``isolation/written.py``): a candidate that prints or writes without end is
killed before it fills the host's disk, the scratch folders of a killed run are removed and its logs cut,
a sandboxed candidate writes on no folder of the host's, and a failure quotes a bounded tail of a log
that may hold one line of gigabytes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from targets.harness.isolation import written
from targets.harness.isolation.launch import Limits, _watch, run_harness
from targets.harness.isolation.processes import CandidateProcesses, log_tail
from targets.harness.isolation.sandbox import Sandbox
from targets.harness.isolation.written import DiskWatch, measure, remove_tree
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
    assert "made over 50 files and folders" in DiskWatch(scratch={tmp_path}).excess(1000.0)
    assert DiskWatch(logs={tmp_path / "f0"}).excess(1000.0) == ""


def test_a_folder_too_deep_to_name_is_walked_and_an_unlocked_one_removed(tmp_path):
    """A path past PATH_MAX made the walk raise ENAMETOOLONG out of the watchdog, and a folder the
    candidate made unreadable stayed on the host after its run."""
    deep = tmp_path / "deep"
    deep.mkdir()
    fd = os.open(deep, os.O_RDONLY)
    try:
        for _ in range(20):  # 5,000 characters: made one folder at a time, by descriptor
            os.mkdir("d" * 250, dir_fd=fd)
            inner = os.open("d" * 250, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
        with open(os.open("file", os.O_WRONLY | os.O_CREAT, dir_fd=fd), "wb") as end:
            end.write(os.urandom(1 << 20))
    finally:
        os.close(fd)
    assert measure([deep]).entries == 22 and measure([deep]).mb >= 1
    locked = tmp_path / "vt-locked"
    (locked / "inner").mkdir(parents=True)
    (locked / "inner" / "file").write_text("x")
    os.chmod(locked / "inner", 0)
    remove_tree(locked)
    assert not locked.exists()


def test_the_watchdog_removes_only_scratch_folders_the_harness_makes(caplog):
    """The subprocess sandbox's candidate may write to the watchdog's marks pipe (its user's /proc): a
    ``scratch`` line naming any other folder is not watched, so never removed."""
    disk = DiskWatch()
    assert disk.heard("scratch /home") and disk.heard("scratch /tmp/elsewhere") and not disk.scratch
    assert "not watched" in caplog.text
    assert disk.heard("scratch /tmp/vt-abc") and disk.scratch == {Path("/tmp/vt-abc")}
    assert not disk.heard("run_start")  # a mark of another kind


_WRITER = (  # writes to its scratch folder and prints, without end
    "import os, sys, time\n"
    "print('ready', flush=True)\n"
    "with open(sys.argv[1] + '/out', 'wb') as f:\n"
    "    while True:\n"
    "        f.write(os.urandom(1 << 20)); f.flush(); print('x' * (128 << 10), flush=True); time.sleep(0.01)\n"
)


def test_a_process_that_writes_without_end_is_killed_at_the_disk_limit_and_its_scratch_removed(tmp_path):
    scratch, log = Path(tempfile.mkdtemp(prefix="vt-", dir="/tmp")), tmp_path / "cluster.log"
    read_fd, write_fd = os.pipe()
    exits_fd, exits_write_fd = os.pipe()  # no exit is said: the writer outlives the watch
    with log.open("w") as output:
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(scratch)], stdout=output)
    try:
        os.write(write_fd, f"{written.SCRATCH} {scratch}\n{written.LOG} {log}\n".encode())
        why = _watch(writer, Limits(time_s=30.0, disk_mb=20.0), read_fd, exits_fd, {}, [], [])
    finally:
        writer.kill()
        writer.wait()
        for fd in (read_fd, write_fd, exits_fd, exits_write_fd):
            os.close(fd)
    assert re.search(r"wrote \d+ MB to its logs and scratch folders, over its limit of 20 MB", why), why
    assert not scratch.exists()  # the run's scratch goes with it; its log stays, cut to its last MiB
    assert log.stat().st_size < (1 << 20) + 200 and log.read_text().startswith("[the harness cut this log")


def test_a_failure_quotes_a_bounded_tail_of_a_log_of_one_enormous_line(tmp_path):
    log = tmp_path / "controller.log"
    log.write_text("x" * (20 << 20) + "\nTraceback: the last words\n")
    tail = log_tail(log)
    assert len(tail) < 1000 and tail.endswith("the last words") and "[...]" in tail, tail[:200]


def test_a_logs_terminal_escapes_are_shown_never_run(tmp_path):
    """A red team's log line moved the cursor up and erased the line above (``ESC[1A ESC[2K``) when the check's
    table quoted it: the tail, and a candidate's error text, show control characters as escapes."""
    import io

    from rich.console import Console

    from orchestrator.tables import checks_table
    from targets.harness.ipc.remote import CandidateError, raise_if_error
    from targets.harness.judge.check_result import CheckResult

    log = tmp_path / "controller.log"
    log.write_text("PASS\n\x1b[1A\x1b[2Khidden\tkept\n")
    assert log_tail(log) == "PASS\n\\x1b[1A\\x1b[2Khidden\tkept"
    with pytest.raises(CandidateError) as raised:
        raise_if_error({"error": {"type": "E", "message": "\x1b[2K\x07", "traceback": ""}}, "train")
    assert "\x1b" not in str(raised.value) and "\\x1b[2K\\x07" in str(raised.value)
    shown = io.StringIO()
    Console(file=shown, color_system=None, width=200).print(checks_table([CheckResult("audit", False, ["\x1b[1A"])]))
    assert "\x1b" not in shown.getvalue() and "\\x1b[1A" in shown.getvalue()


@pytest.mark.slow
def test_a_candidate_that_prints_without_end_is_killed_before_it_fills_the_disk(tmp_path, tiny_spec):
    from tests.test_agents import _planted_build

    stack = _planted_build(
        tmp_path,
        tiny_spec,
        f"    import os, time\n    open({str(tmp_path / 'where')!r}, 'w').write(os.getcwd())\n"
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
    scratch = Path((tmp_path / "where").read_text())  # the subprocess sandbox: a folder of the host's
    assert scratch.name == "scratch-components" and not scratch.exists(), scratch
    assert log.read_text().startswith("[the harness cut this log")


@pytest.mark.skipif(not shutil.which("bwrap"), reason="bubblewrap not installed")
def test_a_sandboxed_candidate_process_writes_in_its_private_tmp_not_on_the_hosts_disk(tmp_path, monkeypatch):
    """Its scratch folder was a host folder bound writable: a file it wrote there and deleted while holding
    it open held the host's disk where no walk finds it. In bubblewrap its working directory is now its
    private /tmp (memory, sized at the run's limit), and no folder of the host's is writable to it."""
    from targets.harness.isolation import processes

    started: list[list[str]] = []
    monkeypatch.setattr(processes.subprocess, "Popen", lambda command, **kw: started.append(command))
    heard: list[tuple[str, Path]] = []
    stack = tmp_path / "stack"
    stack.mkdir()
    candidates = CandidateProcesses(
        Sandbox("bubblewrap"),
        stack,
        tmp_path,
        written=lambda kind, path: heard.append((kind, path)),
        memory_bytes=8 << 20,
    )
    try:
        candidates.launch("components")
    finally:
        remove_tree(candidates.root)
    command = started[0]
    assert command[command.index("--chdir") + 1] == "/tmp"
    assert "--bind" not in command, command  # nothing of the host's is writable
    at = command.index("/tmp")
    assert command[at - 3 : at] == ["--size", str(8 << 20), "--tmpfs"], command
    assert [kind for kind, _ in heard] == [written.SCRATCH, written.LOG]


def test_the_model_directory_and_where_its_files_link_are_bound_read_only(tmp_path, monkeypatch):
    """``Runtime.model_path`` is the candidate's to read wherever it lies: the directory and what its links
    lead to (a Hugging Face snapshot's blobs), each alone, are bound read-only in bubblewrap; not the folder
    a linked file lies in (a link to a file in the user's home would show the whole home)."""
    from targets.harness.isolation import processes

    started: list[list[str]] = []
    monkeypatch.setattr(processes.subprocess, "Popen", lambda command, **kw: started.append(command))
    model, blobs = tmp_path / "snapshot", tmp_path / "blobs"
    model.mkdir()
    blobs.mkdir()
    (model / "config.json").write_text("{}")
    (blobs / "abc").write_text("weights")
    (model / "model.safetensors").symlink_to(blobs / "abc")
    stack = tmp_path / "stack"
    stack.mkdir()
    candidates = CandidateProcesses(Sandbox("bubblewrap"), stack, tmp_path, model=model)
    try:
        candidates.launch("components")
    finally:
        remove_tree(candidates.root)
    pairs = list(zip(started[0], started[0][1:], started[0][2:]))
    for path in (model, blobs / "abc"):  # the linked file alone, not the folder it lies in
        assert ("--ro-bind", str(path.resolve()), str(path.resolve())) in pairs, started[0]
    assert not any(str(blobs.resolve()) == a for a in started[0]), started[0]
