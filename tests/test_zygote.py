"""Warm starts. The harness child: each run's child is a fork of one zygote per orchestrator process,
in a session of its own, with the run's working directory, log and marks pipe; its exit code comes
back through the zygote; a zygote that went away is started again, and its children (watching their
parent) go down with it. The subprocess sandbox's candidate processes: forks of a zygote that holds
nothing secret, killed with the connection that asked for them. A zygote forks only its kind's modules
(the harness zygote: harness children and their judges)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from targets.harness.isolation.zygote_client import MARKS_FD, Zygote, ZygoteError, zygote

_spawned: list[int] = []


@pytest.fixture(autouse=True)
def _no_child_left():
    """A test that failed while its child blocked on its FIFO leaves no process behind."""
    yield
    while _spawned:
        with contextlib.suppress(ProcessLookupError):
            os.kill(_spawned.pop(), signal.SIGKILL)


def _spawn(tmp_path, name: str, owner: Zygote | None = None):
    """A child whose target is a FIFO: it blocks reading it until the test writes one."""
    owner = owner or zygote()
    fifo = tmp_path / f"{name}.yaml"
    os.mkfifo(fifo)
    log = (tmp_path / f"{name}.log").open("w")
    read_fd, write_fd = os.pipe()
    argv = ["--target", fifo.name, "--stack", str(tmp_path), "--out", str(tmp_path / name)]  # relative: cwd
    argv += ["--mode", "check", "--sandbox", "subprocess", "--execution", "real", "--marks-fd", str(MARKS_FD)]
    argv += ["--parent-pid", str(owner.process.pid)]
    child = owner.spawn(argv, dict(os.environ), log.fileno(), write_fd)
    _spawned.append(child.pid)
    os.close(write_fd)
    log.close()
    return child, fifo, read_fd


def _gone_within(pid: int, seconds: float) -> bool:
    """Whether ``pid`` left ``/proc`` (ended and reaped) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.1)
    return not os.path.exists(f"/proc/{pid}")


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
    with (
        (tmp_path / "refused.log").open("w") as log,
        pytest.raises(ZygoteError, match="harness zygote runs none of 'os'"),
    ):
        first.spawn([], dict(os.environ), log.fileno(), main="os")  # its kind's modules only (child, judge_process)
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
    assert _gone_within(child.pid, 10), "the orphaned child outlived its zygote"
    assert child.wait() == -signal.SIGKILL and child.owner.went_away.startswith("the harness zygote went away: ")


def test_a_child_whose_zygote_dies_before_it_starts_watching_ends_too(tmp_path, monkeypatch):
    """The zygote killed as soon as the fork's pid comes back, before the child runs its main (held
    there: on an idle machine that takes a few ms, on a busy one long enough for a kill to land). A child
    that took whoever adopted it for its parent waited on its FIFO for ever (a fresh-clone CI run at
    c51a69e failed the test above so)."""
    monkeypatch.chdir(tmp_path)
    owner = zygote()
    child, _, _ = _spawn(tmp_path, "early")
    os.kill(child.pid, signal.SIGSTOP)  # held where it is (its first steps take a few ms on an idle machine)
    os.kill(owner.process.pid, signal.SIGKILL)
    owner.process.wait()
    os.kill(child.pid, signal.SIGCONT)
    assert _gone_within(child.pid, 10), "the child outlived a zygote that died before it watched"


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


# -- the candidate zygote: the subprocess sandbox's candidate processes -----------------------------------

_PROBE = """import json, os, sys, time

orphan = os.fork()
if orphan == 0:  # left running when the process ends: re-parented away from it, still in its process group
    time.sleep(120)
    os._exit(0)

facts = {
    "orphan": orphan,
    "session": os.getsid(0), "pid": os.getpid(), "parent": os.getppid(), "cwd": os.getcwd(),
    "mark": os.environ.get("MARK"), "keys": [k for k in os.environ if "KEY" in k],
    "secret_in_exec_env": b"orchestrator-secret" in open("/proc/self/environ", "rb").read(),
    "warm": "torch.distributed.fsdp" in sys.modules,
}
print("FACTS " + json.dumps(facts), flush=True)


def build(runtime):
    raise RuntimeError("the probe builds no stack")
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a killed orphan nobody reaped yet is a zombie, or dead: it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def _heap_or_stack_holds(pid: int, needle: bytes) -> bool:
    """Whether the process's heap or stack (where the environment it was started with lies) holds ``needle``."""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb") as mem:
        for line in maps:
            fields = line.split()
            if len(fields) > 5 and fields[5] in ("[heap]", "[stack]"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                mem.seek(start)
                if needle in mem.read(end - start):
                    return True
    return False


def test_a_candidate_process_is_a_warm_fork_that_holds_none_of_the_orchestrators_secrets(tmp_path, monkeypatch):
    """In the subprocess sandbox a run's candidate processes are forks of the candidate zygote: warm (torch
    and FSDP2 already imported), each in a session of its own with the run's environment, working
    directory and log. The zygote was started with the scrubbed environment, so no secret of the
    orchestrator's is in a fork's environment, its exec-time environment or its heap and stack; its exit
    code and CPU time come back; a connection that closes takes the children it asked for along, and
    what an ended one left running."""
    import json
    import socket

    from targets.harness.ipc.channel import Frame, SyncChannel
    from targets.harness.ipc.wire import put_runtime
    from targets.harness.isolation.zygote_client import ZygoteClient
    from targets.harness.target import Target

    monkeypatch.setenv("OPENAI_API_KEY", "sk-orchestrator-secret")
    owner = Zygote("candidate")  # a fresh one, started from this environment
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "c.sock"))
    listener.listen(2)
    try:
        (tmp_path / "cand" / "stack").mkdir(parents=True)
        (tmp_path / "cand" / "stack" / "__init__.py").write_text(_PROBE)
        scratch = tmp_path / "scratch"
        scratch.mkdir()
        env = {"PATH": os.environ["PATH"], "VIBETRAIN_CACHE": os.environ["VIBETRAIN_CACHE"], "MARK": "the run's"}
        asker = ZygoteClient(owner.connect(), "candidate")
        argv = ["components", str(tmp_path / "c.sock"), str(tmp_path / "cand")]
        with (tmp_path / "probe.log").open("w") as log:
            child = asker.spawn(argv, env, log.fileno(), cwd=str(scratch))
        channel = SyncChannel(listener.accept()[0])
        channel.send(Frame(kind="init", runtime=put_runtime(Target.load("tiny-qwen3-cpu").runtime())))
        assert channel.recv()["kind"] == "failed"  # the probe's build: the process then ends on its own
        assert child.wait(timeout=30) == 0 and child.cpu_s > 0
        said = (tmp_path / "probe.log").read_text()
        facts = json.loads(next(line[6:] for line in said.splitlines() if line.startswith("FACTS ")))
        assert facts["session"] == facts["pid"] == child.pid and facts["parent"] == owner.process.pid
        assert facts["cwd"] == str(scratch) and facts["mark"] == "the run's" and facts["warm"], facts
        assert facts["keys"] == [] and not facts["secret_in_exec_env"], facts
        assert not _heap_or_stack_holds(owner.process.pid, b"sk-orchestrator-secret")  # what every fork starts from

        with (tmp_path / "held.log").open("w") as log:  # waits for an init frame that never comes
            held = asker.spawn(argv, env, log.fileno(), cwd=str(scratch))
        listener.accept()
        assert _running(facts["orphan"])  # what the first one left, still running
        asker._socket.close()  # whoever asked went away: so does what it started, and what that left
        deadline = time.monotonic() + 10
        left = [held.pid, facts["orphan"]]
        while time.monotonic() < deadline and (left := [p for p in left if _running(p)]):
            time.sleep(0.1)
        assert not left, f"outlived the connection that asked for them: {left}"
    finally:
        listener.close()
        owner.process.kill()
        owner.process.wait()


def test_a_connection_killed_with_an_exit_report_unread_leaves_the_zygote_serving(tmp_path):
    """A harness child the watchdog kills may leave the zygote's report of a candidate's exit unread: the
    zygote then reads a reset, not an end of file, and must treat it as the same close (it used to die
    of it, and the next run in the subprocess sandbox with it)."""
    from targets.harness.isolation.zygote_client import ZygoteClient

    owner = Zygote("candidate")
    try:
        asker = ZygoteClient(owner.connect(), "candidate")
        with (tmp_path / "usage.log").open("w") as log:  # no arguments: it prints its usage and exits
            child = asker.spawn([], {"PATH": os.environ["PATH"]}, log.fileno(), cwd=str(tmp_path))
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{child.pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # its exit report is waiting, unread, on the asker's socket
        asker._socket.close()
        again = ZygoteClient(owner.connect(), "candidate")
        with (tmp_path / "again.log").open("w") as log:
            assert again.spawn([], {"PATH": os.environ["PATH"]}, log.fileno(), cwd=str(tmp_path)).wait(30) == 2
        assert owner.process.poll() is None
    finally:
        owner.process.kill()
        owner.process.wait()


def test_a_zygote_whose_orchestrator_dies_while_it_warms_ends_at_once(tmp_path):
    """A zygote imports for seconds (longer on a busy machine) before it first reads its connection: an
    orchestrator killed meanwhile (``timeout vibetrain check ...``) must not leave it importing on. Its
    warm-up is held here by a ``safetensors`` on its path that sleeps a minute."""
    import subprocess
    import sys
    from pathlib import Path

    planted = tmp_path / "path" / "safetensors"
    planted.mkdir(parents=True)
    (planted / "__init__.py").write_text("import time\ntime.sleep(60)\n")
    project = Path(__file__).resolve().parents[1]
    script = "from targets.harness.isolation.zygote_client import Zygote\nprint(Zygote('candidate').process.pid)\n"
    orchestrator = subprocess.Popen(
        [sys.executable, "-c", script + "import time\ntime.sleep(60)\n"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=project,
        env={**os.environ, "PYTHONPATH": str(planted.parent), "PYTHONUNBUFFERED": "1"},
    )
    warming = int(orchestrator.stdout.readline())
    time.sleep(1)  # well into its imports
    orchestrator.kill()
    orchestrator.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _running(warming):
        time.sleep(0.1)
    assert not _running(warming), "the zygote warmed on after its orchestrator died"


def test_a_zygote_watches_the_parent_its_launcher_names_not_the_one_it_finds(tmp_path):
    """The launcher names itself in the zygote's argv: read at ``main``, the parent of a launcher that
    died in the meantime is already init (or a subreaper), and the zygote would warm on. Named here: a
    launcher that is gone before the zygote starts (its warm-up held a minute as above)."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    planted = tmp_path / "path" / "safetensors"
    planted.mkdir(parents=True)
    (planted / "__init__.py").write_text("import time\ntime.sleep(60)\n")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid names a launcher that died before the zygote could look
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    zygote = subprocess.Popen(
        [sys.executable, "-m", "targets.harness.isolation.zygote", str(theirs.fileno()), "candidate", str(gone.pid)],
        pass_fds=(theirs.fileno(),),
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "PYTHONPATH": str(planted.parent)},
    )
    theirs.close()
    try:
        assert zygote.wait(10) == 1, "the zygote warmed on for a launcher that was gone"
    finally:
        zygote.kill()
        zygote.wait()
        ours.close()


def test_a_runs_candidate_processes_are_forks_reported_as_they_start_and_fresh_ones_once_dropped(tmp_path):
    """A harness child given a connection to the candidate zygote forks its candidate processes there
    (in the subprocess sandbox) and reports each pid as it starts, for the watchdog that holds the run's
    limits (a fork is the zygote's child, not the harness child's); dropped, they are fresh processes."""
    import subprocess

    from targets.harness.isolation.processes import CandidateProcesses
    from targets.harness.isolation.sandbox import Sandbox
    from targets.harness.isolation.zygote_client import ReportedForks, ZygoteChild, ZygoteClient, drop_forks, use_forks

    (tmp_path / "cand" / "stack").mkdir(parents=True)
    (tmp_path / "cand" / "stack" / "__init__.py").write_text("")
    reported: list[int] = []
    use_forks(ReportedForks(ZygoteClient(zygote("candidate").connect(), "candidate"), reported.append))
    forked = CandidateProcesses(Sandbox("subprocess"), tmp_path / "cand", tmp_path)
    try:
        forked.launch("components")
        assert isinstance(forked.processes["components"], ZygoteChild)
        assert reported == [forked.processes["components"].pid]
    finally:
        drop_forks("candidate")
        forked.stop(grace_s=0)  # it waits for a connection nobody accepts: killed at once
    fresh = CandidateProcesses(Sandbox("subprocess"), tmp_path / "cand", tmp_path)
    try:
        fresh.launch("components")
        assert isinstance(fresh.processes["components"], subprocess.Popen) and len(reported) == 1
    finally:
        fresh.stop(grace_s=0)


def test_a_childs_imports_never_come_from_its_working_folder(tmp_path):
    """The harness child's import path began with its working folder, as ``python -m`` there would have it:
    started from a candidate's folder (a run's checkout of ``best``, a CLI agent's check), a module there
    named like one the child imports after the fork (``pynvml`` on a GPU target) ran in the judge,
    unsandboxed. The project comes first, then PYTHONPATH (a user's environment), never the folder."""
    from targets import PROJECT_ROOT
    from targets.harness.isolation.zygote import child_path

    path = child_path({"PYTHONPATH": f"{tmp_path / 'user'}{os.pathsep}"}, ["/site"])
    assert path == [str(PROJECT_ROOT), str(tmp_path / "user"), "/site"]
