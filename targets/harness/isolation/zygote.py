"""A warm start for the harness child: one process per orchestrator process that has imported what
every child imports (torch, transformers, the harness's checks and drivers) and forks a child per
run, instead of a fresh interpreter paying those imports (3-4 CPU-seconds) every run.

The zygote is the harness's own code and trusts nothing new: a forked child is the same program
``python -m targets.harness.isolation.child`` runs, in its own session, with the environment, working
directory, log and marks pipe the launcher gives it. The zygote computes nothing and forks only
while it runs no Python thread but its own (checked before each fork; the native threads importing
torch and transformers leave waiting do not follow a fork, and no parallel region has run, so a
child's thread pools start fresh); it reaps its children and reports their exit codes. It exits when the
orchestrator's end of its socket closes; its children, which watch their parent (``child.py``),
follow it down.

Messages are single datagrams on a ``SOCK_SEQPACKET`` socket pair, JSON, with the log and marks file
descriptors passed alongside a request: ``{"argv", "env", "cwd"}`` -> ``{"pid"}`` or ``{"error"}``;
later ``{"exit": pid, "code"}`` for each child that ended (a negative code: killed by that signal).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from targets import PROJECT_ROOT

MARKS_FD = 3  # where a forked child finds its marks pipe (its argv says --marks-fd 3)
_MESSAGE_BYTES = 1 << 20


# -- the orchestrator's side -----------------------------------------------------------------------------


class ZygoteError(RuntimeError):
    """The zygote could not fork a child, or went away."""


class Zygote:
    """The orchestrator's handle on its zygote process; safe to share between threads."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = tempfile.TemporaryFile()  # its own last words, for the error if it goes away
        self.process = subprocess.Popen(
            [sys.executable, "-m", "targets.harness.isolation.zygote", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=PROJECT_ROOT,  # ``-m`` imports from its cwd first: the user's would import a ``targets`` of theirs
        )
        theirs.close()
        self._socket, self._lock = ours, threading.Lock()
        self._exits: dict[int, int] = {}
        self.gone = False

    def _receive(self, block: bool) -> dict | None:
        """One message (caller holds the lock); None when none is waiting and ``block`` is false."""
        if not block and not select.select([self._socket], [], [], 0)[0]:
            return None
        data = self._socket.recv(_MESSAGE_BYTES)
        if not data:
            self.gone = True
            self._log.seek(0)
            last = self._log.read().decode(errors="replace").strip().splitlines()[-5:]
            raise ZygoteError(f"the harness zygote (pid {self.process.pid}) went away: " + " | ".join(last))
        return json.loads(data)

    def _note(self, message: dict) -> None:
        self._exits[message["exit"]] = message["code"]

    def spawn(self, argv: list[str], env: dict[str, str], log_fd: int, marks_fd: int) -> ZygoteChild:
        request = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd()}).encode()
        with self._lock:
            socket.send_fds(self._socket, [request], [log_fd, marks_fd])
            while True:
                message = self._receive(block=True)
                if "exit" in message:
                    self._note(message)
                elif "error" in message:
                    raise ZygoteError(message["error"])
                else:
                    return ZygoteChild(self, message["pid"])

    def exit_code(self, pid: int) -> int | None:
        with self._lock:
            try:
                while (message := self._receive(block=False)) is not None:
                    self._note(message)
            except ZygoteError:
                return self._exits.pop(pid, -signal.SIGKILL)  # its children kill themselves when it goes
            return self._exits.pop(pid, None)  # the child keeps it (``returncode``): none piles up here


class ZygoteChild:
    """What the launcher needs of ``subprocess.Popen``: ``pid``, ``poll``, ``wait``, ``returncode``."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.05)
        return self.returncode


_zygote: Zygote | None = None
_starting = threading.Lock()


def zygote() -> Zygote:
    """This process's zygote, started on first use (and again if it went away)."""
    global _zygote
    with _starting:
        if _zygote is None or _zygote.gone or _zygote.process.poll() is not None:
            _zygote = Zygote()
        return _zygote


# -- the zygote's side -----------------------------------------------------------------------------------


def _warm() -> None:
    """What a harness child imports whatever its mode, loaded once here. CUDA must stay untouched (a
    process that initialised it cannot hand it to a fork): an availability check at import time asks
    NVML instead, and a zygote that finds CUDA initialised anyway stops, saying so."""
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # the zygote's own; a child gets the run's environment
    import torch
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401

    import targets.harness.ipc.remote  # noqa: F401
    import targets.harness.isolation.child  # noqa: F401
    import targets.harness.isolation.drive  # noqa: F401
    import targets.harness.judge.accuracy  # noqa: F401
    import targets.harness.judge.audit  # noqa: F401
    import targets.harness.sim.virtual_time  # noqa: F401

    if torch.cuda.is_initialized():
        raise RuntimeError("importing the harness initialised CUDA in the zygote: its forks could not use the GPU")


def _become_child(request: dict, log_fd: int, marks_fd: int, base_path: list[str]) -> None:
    """In the forked process: the child's session, descriptors, environment and path, then its main."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.dup2(marks_fd, MARKS_FD)
        for stream in (sys.stdout, sys.stderr):  # as PYTHONUNBUFFERED gives a fresh child: a killed run's log is whole
            stream.reconfigure(line_buffering=True, write_through=True)
        os.closerange(MARKS_FD + 1, os.sysconf("SC_OPEN_MAX"))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [request["cwd"], *extra, *base_path]  # as a fresh ``python -m`` there would have it
        import importlib

        importlib.invalidate_caches()
        from targets.harness.isolation import child

        code = child.main(request["argv"])
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - printed to the run's log, then the child's exit code says so
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_path = [p for p in sys.path[1:] if p not in own]  # without the zygote's cwd and PYTHONPATH
    _warm()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        readable, _, _ = select.select([sock, wake_read], [], [])
        if wake_read in readable:
            os.read(wake_read, 4096)
            _reap(sock)
        if sock not in readable:
            continue
        data, fds, _, _ = socket.recv_fds(sock, _MESSAGE_BYTES, 2)
        if not data:
            return  # the orchestrator went away: so does the zygote, and its children after it
        if threading.active_count() != 1:
            names = [t.name for t in threading.enumerate()]
            sock.send(json.dumps({"error": f"the zygote runs Python threads {names}: it cannot fork"}).encode())
        else:
            pid = os.fork()
            if pid == 0:
                sock.close()
                _become_child(json.loads(data), fds[0], fds[1], base_path)
            sock.send(json.dumps({"pid": pid}).encode())
        for descriptor in fds:
            os.close(descriptor)
        _reap(sock)


if __name__ == "__main__":
    main(int(sys.argv[1]))
