"""The harness child's warm start: each run's child is a fork of one zygote per orchestrator process,
in a session of its own, with the run's working directory, log and marks pipe; its exit code comes
back through the zygote; a zygote that went away is started again, and its children (watching their
parent) go down with it."""

from __future__ import annotations

import os
import signal
import time

from targets.harness.isolation.zygote import MARKS_FD, Zygote, zygote


def _spawn(tmp_path, name: str, owner: Zygote | None = None):
    """A child whose target is a FIFO: it blocks reading it until the test writes one."""
    fifo = tmp_path / f"{name}.yaml"
    os.mkfifo(fifo)
    log = (tmp_path / f"{name}.log").open("w")
    read_fd, write_fd = os.pipe()
    argv = ["--target", fifo.name, "--stack", str(tmp_path), "--out", str(tmp_path / name)]  # relative: cwd
    argv += ["--mode", "check", "--sandbox", "subprocess", "--execution", "real", "--marks-fd", str(MARKS_FD)]
    child = (owner or zygote()).spawn(argv, dict(os.environ), log.fileno(), write_fd)
    os.close(write_fd)
    log.close()
    return child, fifo, read_fd


def _session_of(pid: int) -> int:
    deadline = time.monotonic() + 5  # setsid is the fork's first act (its pid comes back before it runs)
    while os.getsid(pid) != pid and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.getsid(pid)


def test_a_child_is_a_fork_of_the_zygote_in_its_own_session_and_a_dead_zygote_comes_back(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = zygote()
    child, fifo, marks = _spawn(tmp_path, "one")
    assert _session_of(child.pid) == child.pid  # a session (and process group) of its own: killed whole
    fifo.write_text("id: [not a target\n")  # it reads this through its relative path: it runs in our cwd
    assert child.wait() == 1
    assert os.read(marks, 100) == b""  # the marks pipe reached it (and closed when it ended)
    said = (tmp_path / "one.log").read_text()
    assert "one.yaml" in said, said  # its own account of the bad target, in the run's log

    os.kill(first.process.pid, signal.SIGKILL)
    first.process.wait()
    child, fifo, _ = _spawn(tmp_path, "two")
    second = zygote()
    assert second is not first and second.process.pid != first.process.pid
    fifo.write_text("id: [not a target\n")
    assert child.wait() == 1 and "two.yaml" in (tmp_path / "two.log").read_text()


def test_the_children_of_a_zygote_that_went_away_end_too(tmp_path, monkeypatch):
    """A child blocked on its FIFO ends within seconds of its zygote's death, as a fresh child ends when
    the orchestrator that started it dies."""
    monkeypatch.chdir(tmp_path)
    owner = zygote()
    child, _, _ = _spawn(tmp_path, "hung")
    assert _session_of(child.pid) == child.pid and child.poll() is None
    os.kill(owner.process.pid, signal.SIGKILL)
    owner.process.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{child.pid}"):
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{child.pid}"), "the orphaned child outlived its zygote"


def test_a_targets_folder_where_the_user_runs_never_stands_in_for_the_harness(tmp_path, monkeypatch):
    """``python -m`` imports from its working directory first: a zygote started in a folder holding a
    ``targets`` package of its own (the user's project, another checkout) imported that one, and its
    children ran it (and a sandbox then lacked the harness the orchestrator had)."""
    decoy = tmp_path / "targets"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the decoy targets package was imported')\n")
    monkeypatch.chdir(tmp_path)
    owner = Zygote()  # a fresh one, started here (the process's own may have started elsewhere)
    try:
        child, fifo, _ = _spawn(tmp_path, "shadowed", owner)
        fifo.write_text("id: [not a target\n")
        assert child.wait() == 1
        said = (tmp_path / "shadowed.log").read_text()
        assert "decoy targets" not in said and "shadowed.yaml" in said, said  # the harness's child read the target
    finally:
        owner.process.kill()
        owner.process.wait()
