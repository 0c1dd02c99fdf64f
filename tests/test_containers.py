"""The Docker sandbox's containers go with whatever started them. No Docker daemon runs here: a fake
``docker`` client on PATH hands each ``run`` to a daemon thread of this test, which starts the command
as its own child, as dockerd does, so killing the client leaves the "container" running, as it does."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agents.llm.client import ToolCall
from agents.llm.tools import Toolbox
from skills.starter import write_starter
from targets.harness.isolation.containers import OWNER_ENV, ContainerCleanupError, label_of, owned_containers
from targets.harness.isolation.processes import CandidateProcesses
from targets.harness.isolation.sandbox import Sandbox

IMAGE = "vibetrain-fake-image"
CLIENT = """#!{python}
import json, os, sys, time, uuid
from pathlib import Path

spool = Path({spool!r})
args = sys.argv[1:]


def wait_exit(cid):
    while not (spool / f"{{cid}}.exit").exists():
        time.sleep(0.02)
    return int((spool / f"{{cid}}.exit").read_text())


if args[0] == "run":
    cid = uuid.uuid4().hex[:12]
    labels = [args[i + 1] for i, a in enumerate(args) if a == "--label"]
    spec = {{"labels": labels, "argv": args[args.index({image!r}) + 1 :]}}
    (spool / f"{{cid}}.tmp").write_text(json.dumps(spec))
    (spool / f"{{cid}}.tmp").rename(spool / f"{{cid}}.json")
    sys.exit(wait_exit(cid))
if args[0] == "ps":
    label = args[args.index("--filter") + 1].removeprefix("label=")
    for f in sorted(spool.glob("*.json")):
        if label in json.loads(f.read_text())["labels"]:
            print(f.stem)
if args[0] == "rm":
    for cid in args[2:]:
        (spool / f"{{cid}}.kill").write_text("")
        wait_exit(cid)
"""


class FakeDockerd:
    """Starts each spooled ``run`` as a child of this process; a ``rm --force`` kills it; an ended one is
    removed (``docker run --rm``)."""

    def __init__(self, spool: Path) -> None:
        self.spool, self.running, self.started = spool, {}, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            for spec in self.spool.glob("*.json"):
                if spec.stem not in self.running and not (self.spool / f"{spec.stem}.exit").exists():
                    argv = json.loads(spec.read_text())["argv"]
                    self.running[spec.stem] = subprocess.Popen(argv, start_new_session=True)
                    self.started.append(self.running[spec.stem].pid)
            for cid, process in list(self.running.items()):
                if (self.spool / f"{cid}.kill").exists() and process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                if process.poll() is not None:
                    (self.spool / f"{cid}.json").unlink()
                    (self.spool / f"{cid}.exit").write_text(str(process.returncode))
                    del self.running[cid]
            time.sleep(0.02)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for process in self.running.values():
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture
def dockerd(tmp_path, monkeypatch):
    (tmp_path / "spool").mkdir()
    (tmp_path / "bin").mkdir()
    client = tmp_path / "bin" / "docker"
    client.write_text(CLIENT.format(python=sys.executable, spool=str(tmp_path / "spool"), image=IMAGE))
    client.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    daemon = FakeDockerd(tmp_path / "spool")
    yield daemon
    daemon.close()


def _started(dockerd: FakeDockerd, count: int = 1) -> list[int]:
    """The pids of the first ``count`` containers, once the daemon has started them."""
    deadline = time.monotonic() + 30
    while len(dockerd.started) < count:
        assert time.monotonic() < deadline, "the fake daemon started no container in 30 s"
        time.sleep(0.02)
    return dockerd.started[:count]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_container_whose_client_was_killed_is_removed_by_its_owner(tmp_path, dockerd, monkeypatch):
    sandbox = Sandbox("docker", IMAGE)
    with owned_containers(sandbox.backend) as owner:
        command, env = sandbox.wrap(["sleep", "300"], {}, writable=[tmp_path], cwd=tmp_path, owner=owner)
        client = subprocess.Popen(command, env=env)
        _started(dockerd)
        client.kill()  # a time limit's SIGKILL: the container runs on
        client.wait()
        time.sleep(0.2)
        assert _alive(dockerd.started[0])
    assert not _alive(dockerd.started[0]) and not list(dockerd.spool.glob("*.json"))
    with pytest.raises(RuntimeError, match="needs an owner"):  # none unlabelled: nobody could remove it
        sandbox.wrap(["true"], {}, cwd=tmp_path)
    monkeypatch.setenv(OWNER_ENV, "a-run")  # what a harness child inherits from its launcher
    assert label_of("a-run") in sandbox.wrap(["true"], {}, cwd=tmp_path)[0]
    both = sandbox.wrap(["true"], {}, cwd=tmp_path, owner="a-phase")[0]  # whichever is done first removes it
    assert label_of("a-run") in both and label_of("a-phase") in both


def test_a_command_tool_past_its_time_leaves_no_container_running(tmp_path, dockerd, tiny_spec):
    """The reaper killed the docker client at the command's time limit; the container, no child of the
    client, ran on with the workspace mounted writable."""
    write_starter(tmp_path / "ws", tiny_spec, "colocate")
    toolbox = Toolbox(tmp_path / "ws", Sandbox("docker", IMAGE))
    # 3 s: the reaper, the docker client and the daemon's poll must start the container first (~0.2 s idle)
    result = toolbox.call(ToolCall("c", "run_command", json.dumps({"command": "sleep 300", "timeout_s": 3})))
    assert "ran past 3s; it and every process it started were stopped" in result
    assert dockerd.started and not _alive(dockerd.started[0])


def test_a_phase_removes_its_candidates_containers_before_the_next_one(tmp_path, dockerd, monkeypatch):
    """A harness child runs the check's phases one after another: a candidate process whose client was
    killed in one phase ran on, in its container, through the next; its phase now removes it."""
    monkeypatch.setenv(OWNER_ENV, "the-launcher")  # removes them too, but only when the whole run ends
    (tmp_path / "stack").mkdir()
    with CandidateProcesses(Sandbox("docker", IMAGE), tmp_path / "stack", tmp_path) as processes:
        processes.launch("controller")  # connects, and waits for a hello nobody sends
        (container,) = _started(dockerd)
        processes.processes["controller"].kill()  # the client, as a time limit kills it
        processes.processes["controller"].wait()
        time.sleep(0.2)
        assert _alive(container)
    assert not _alive(container) and not list(dockerd.spool.glob("*.json"))


def _docker_client(tmp_path, monkeypatch, script: str) -> None:
    (tmp_path / "bin").mkdir()
    client = tmp_path / "bin" / "docker"
    client.write_text("#!/bin/sh\n" + script)
    client.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")


def test_a_removal_that_fails_is_raised_and_never_hides_the_error_under_way(tmp_path, monkeypatch, caplog):
    """``docker`` failing to list the containers: raised when nothing else is, logged beside an error in
    flight (it had replaced a tool's own time-limit error)."""
    _docker_client(tmp_path, monkeypatch, "echo 'Cannot connect to the Docker daemon' >&2\nexit 1\n")
    with pytest.raises(ContainerCleanupError, match=r"docker ps --all failed \(1\): Cannot connect"):
        with owned_containers("docker"):
            pass
    with pytest.raises(subprocess.TimeoutExpired):  # the tool's own error, as it was
        with owned_containers("docker"):
            raise subprocess.TimeoutExpired("sleep", 1)
    assert "may still run: docker ps --all failed (1): Cannot connect" in caplog.text


def test_a_container_gone_before_its_removal_is_no_failure(tmp_path, monkeypatch):
    """Listed, then gone by itself (``--rm``) or removed by its other owner before ``rm``: rm fails on a
    container that no longer exists, which is what was wanted."""
    listed = tmp_path / "listed-once"
    _docker_client(
        tmp_path,
        monkeypatch,
        f'if [ "$1" = ps ] && [ ! -e {listed} ]; then touch {listed}; echo abc123; fi\n'
        'if [ "$1" = rm ]; then echo "Error: No such container: abc123" >&2; exit 1; fi\n',
    )
    with owned_containers("docker"):
        pass
    listed.unlink()
    _still = tmp_path / "bin" / "docker"  # listed every time: the rm's failure is real
    _still.write_text('#!/bin/sh\nif [ "$1" = ps ]; then echo abc123; fi\nif [ "$1" = rm ]; then exit 1; fi\n')
    with pytest.raises(ContainerCleanupError, match="docker rm --force failed"):
        with owned_containers("docker"):
            pass


def test_a_container_sees_the_checkout_as_bubblewrap_shows_it(tmp_path):
    """Docker mounted the checkout whole: other rounds' worktrees, the runs' repositories, the checkout's git
    and a ``.env`` in its root were all readable to a candidate there (bubblewrap hid them). Both now mount
    of the checkout its ``targets/`` alone, and what a candidate is given inside it (its own stack in a
    round's worktree); where a folder above the checkout is mounted (an import path, say), the checkout's
    hidden folders go under a tmpfs and its secret files under /dev/null, in either. The mounts as the
    daemon is asked for them (no daemon here)."""
    from targets.harness.isolation.sandbox import HIDDEN_IN_CHECKOUT, PROJECT_ROOT, checkout_masks

    root = PROJECT_ROOT.resolve()
    own = root / "workspaces" / f"probe-{os.getpid()}" / "stack"  # a round's own stack, inside a hidden folder
    own.mkdir(parents=True)
    dotenv = root / f".env.probe-{os.getpid()}"
    dotenv.write_text("OPENAI_API_KEY=sk-planted\n")
    try:
        command, _ = Sandbox("docker", IMAGE).wrap(
            ["python3", "-c", "pass"], dict(os.environ), readable=[own], writable=[tmp_path], owner="test"
        )
        hidden, given, secrets = checkout_masks([root.parent], [own], [tmp_path])  # a folder above it mounted
    finally:
        dotenv.unlink()
        shutil.rmtree(own.parent)
    pairs = list(zip(command, command[1:]))
    assert ("-v", f"{root}/targets:{root}/targets:ro") in pairs and ("-v", f"{own}:{own}:ro") in pairs, command
    assert not any(part.startswith(f"{root}:") for part in command) and ".env.probe" not in " ".join(command)
    assert hidden == [root / name for name in HIDDEN_IN_CHECKOUT if (root / name).is_dir()] and given == [own]
    assert dotenv in secrets
