"""Warm starts: a process that has imported what its children need forks a child per request, instead
of a fresh interpreter paying those imports every time. Two kinds, one process of each per
orchestrator process, started on first use:

* ``harness``: forks each run's harness child (``child.py``), warm with torch, transformers and the
  harness's checks and drivers (3-4 CPU-seconds a run);
* ``candidate``: forks the candidate processes (``candidate_process.py``) of runs in the
  ``subprocess`` sandbox, warm with torch, its FSDP2 and the contract's wire (~4 CPU-seconds each for
  the components process, ~2 for the cluster's, every run). It is started with the scrubbed
  environment a candidate gets, so nothing secret is in its memory to inherit, and it never imports
  a candidate's code: that happens in the fork. (A sandbox with namespaces starts its processes
  fresh inside them.)

A zygote trusts nothing new: a fork runs the same program ``python -m <module>`` would, in its own
session, with the environment, working directory, descriptors and arguments of the request. It forks
only while it runs no Python thread but its own (checked before each fork; the native threads that
importing torch leaves waiting do not follow a fork, and no parallel region has run, so a child's
thread pools start fresh), reaps its children and reports each one's exit code and CPU time to the
connection that asked for it.

Connections are ``SOCK_SEQPACKET`` sockets; messages are single JSON datagrams, descriptors passed
alongside. The orchestrator holds the first connection; ``connect`` hands a further one to someone
else (a harness child asks the candidate zygote for its run's processes over one). Requests:
``{"argv", "env", "cwd"}`` with the log descriptor and any extra ones (they become 3, 4, ... in the
child) -> ``{"pid"}`` or ``{"error"}``, later ``{"exit": pid, "code", "cpu_s"}`` (a negative code:
killed by that signal); ``{"connect": true}`` with a socket -> a new connection. When a connection
closes, the children it asked for are killed; when the first one closes, the zygote kills all of its
children and exits (a harness child also watches its parent, and a candidate process dies with it).
"""

from __future__ import annotations

import ctypes
import fcntl
import importlib
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

MARKS_FD = 3  # where a forked harness child finds its marks pipe (its argv says --marks-fd 3)
FORKS_FD = 4  # where it finds its connection to the candidate zygote (--forks-fd 4), in the subprocess sandbox
_MESSAGE_BYTES = 1 << 20
MAINS = {"harness": "targets.harness.isolation.child", "candidate": "targets.harness.isolation.candidate_process"}
_PR_SET_PDEATHSIG = 1


# -- the requesting side ---------------------------------------------------------------------------------


class ZygoteError(RuntimeError):
    """The zygote could not fork a child, or went away."""


class ZygoteClient:
    """One connection to a zygote: forks, and the exit codes of the children it asked for. Safe to
    share between threads."""

    def __init__(self, sock: socket.socket, kind: str) -> None:
        self._socket, self.kind, self._lock = sock, kind, threading.Lock()
        self._exits: dict[int, tuple[int, float]] = {}
        self.gone = False

    def _last_words(self) -> str:
        return "its connection closed"

    def _receive(self, block: bool) -> dict | None:
        """One message (caller holds the lock); None when none is waiting and ``block`` is false."""
        if not block and not select.select([self._socket], [], [], 0)[0]:
            return None
        data = self._socket.recv(_MESSAGE_BYTES)
        if not data:
            self.gone = True
            raise ZygoteError(f"the {self.kind} zygote went away: {self._last_words()}")
        return json.loads(data)

    def _note(self, message: dict) -> None:
        self._exits[message["exit"]] = (message["code"], message["cpu_s"])

    def _ask(self, request: dict, fds: list[int]) -> dict:
        with self._lock:
            socket.send_fds(self._socket, [json.dumps(request).encode()], fds)
            while True:
                message = self._receive(block=True)
                if "exit" in message:
                    self._note(message)
                elif "error" in message:
                    raise ZygoteError(message["error"])
                else:
                    return message

    def spawn(self, argv: list[str], env: dict[str, str], log_fd: int, *extra_fds: int, cwd: str = "") -> ZygoteChild:
        """A fork running ``python -m <the kind's module> *argv``: output to ``log_fd``, ``extra_fds``
        at 3, 4, ... and ``cwd`` (default: ours) its working directory."""
        request = {"argv": argv, "env": env, "cwd": cwd or os.getcwd()}
        return ZygoteChild(self, self._ask(request, [log_fd, *extra_fds])["pid"])

    def connect(self) -> socket.socket:
        """A further connection to this zygote, for another process to ask on (its forks are its own)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._ask({"connect": True}, [theirs.fileno()])
        finally:
            theirs.close()
        return ours

    def exit_of(self, pid: int) -> tuple[int, float] | None:
        """``(exit code, CPU seconds)`` of ``pid`` once it ended; None while it runs."""
        with self._lock:
            try:
                while (message := self._receive(block=False)) is not None:
                    self._note(message)
            except ZygoteError:
                return self._exits.pop(pid, (-signal.SIGKILL, 0.0))  # its children are killed when it goes
            return self._exits.pop(pid, None)  # the child keeps it (``returncode``): none piles up here


class Zygote(ZygoteClient):
    """A zygote process of ``kind`` and the orchestrator's connection to it."""

    def __init__(self, kind: str = "harness") -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = tempfile.TemporaryFile()  # its own last words, for the error if it goes away
        env = None
        if kind == "candidate":  # what a candidate's environment may hold, and nothing more (sandbox.py)
            from targets.harness.isolation.sandbox import scrubbed_environment

            env = scrubbed_environment(dict(os.environ))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "targets.harness.isolation.zygote", str(theirs.fileno()), kind],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=PROJECT_ROOT,  # ``-m`` imports from its cwd first: the user's would import a ``targets`` of theirs
            env=env,
        )
        theirs.close()
        super().__init__(ours, kind)

    def _last_words(self) -> str:
        self._log.seek(0)
        last = self._log.read().decode(errors="replace").strip().splitlines()[-5:]
        return f"(pid {self.process.pid}) " + " | ".join(last)


class ZygoteChild:
    """What a launcher needs of ``subprocess.Popen``: ``pid``, ``poll``, ``wait``, ``returncode``; and
    the CPU time it used, once it ended (``cpu_s``)."""

    def __init__(self, owner: ZygoteClient, pid: int) -> None:
        self.owner, self.pid, self.returncode, self.cpu_s = owner, pid, None, 0.0

    def poll(self) -> int | None:
        if self.returncode is None and (ended := self.owner.exit_of(self.pid)) is not None:
            self.returncode, self.cpu_s = ended
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode


_zygotes: dict[str, Zygote] = {}
_starting = threading.Lock()


def zygote(kind: str = "harness") -> Zygote:
    """This process's zygote of ``kind``, started on first use (and again if it went away)."""
    with _starting:
        owner = _zygotes.get(kind)
        if owner is None or owner.gone or owner.process.poll() is not None:
            owner = _zygotes[kind] = Zygote(kind)
        return owner


# -- the zygote's side -----------------------------------------------------------------------------------


def _warm(kind: str) -> None:
    """What every child of ``kind`` imports, loaded once here. CUDA must stay untouched (a process that
    initialised it cannot hand it to a fork): an availability check at import time asks NVML instead,
    and a zygote that finds CUDA initialised anyway stops, saying so."""
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # the zygote's own; a child gets the request's environment
    import torch

    if kind == "harness":
        import transformers.models.qwen3.modeling_qwen3  # noqa: F401

        import targets.harness.ipc.remote  # noqa: F401
        import targets.harness.isolation.child  # noqa: F401
        import targets.harness.isolation.drive  # noqa: F401
        import targets.harness.judge.accuracy  # noqa: F401
        import targets.harness.judge.audit  # noqa: F401
        import targets.harness.sim.virtual_time  # noqa: F401
    else:  # what the contract's side of the wire and a stack's engine and trainer import, never a stack itself
        import safetensors.torch  # noqa: F401
        import torch.distributed.fsdp  # noqa: F401
        from torch.distributed.device_mesh import init_device_mesh  # noqa: F401

        import targets.harness.ipc.weight_export  # noqa: F401
        import targets.harness.isolation.candidate_process  # noqa: F401

    if torch.cuda.is_initialized():
        raise RuntimeError(f"importing the {kind} zygote's modules initialised CUDA: its forks could not use the GPU")


def _place(fds: list[int]) -> None:
    """The request's descriptors where the child expects them: the log on 1 and 2, the rest on 3, 4, ...;
    every other descriptor closed (moved out of the way first: a received one may sit on 3 or 4)."""
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 256) for fd in fds]
    os.dup2(high[0], 1)
    os.dup2(high[0], 2)
    for target, fd in enumerate(high[1:], start=3):
        os.dup2(fd, target)
    os.closerange(3 + len(high) - 1, os.sysconf("SC_OPEN_MAX"))


def _become_child(kind: str, request: dict, fds: list[int], base_path: list[str]) -> None:
    """In the forked process: the child's session, descriptors, environment and path, then its main."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if kind == "candidate":  # killed with the zygote; a harness child watches its parent itself
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        _place(fds)
        for stream in (sys.stdout, sys.stderr):  # as PYTHONUNBUFFERED gives a fresh child: a killed run's log is whole
            stream.reconfigure(line_buffering=True, write_through=True)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [request["cwd"], *extra, *base_path]  # as a fresh ``python -m`` there would have it
        importlib.invalidate_caches()
        module = importlib.import_module(MAINS[kind])
        sys.argv = [module.__file__, *request["argv"]]
        code = module.main(request["argv"])
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - printed to the child's log, then its exit code says so
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _kill(pids) -> None:
    from targets.harness.isolation.process_tree import kill_tree

    for pid in pids:
        kill_tree(pid)


class _Server:
    """The zygote's loop: connections, forks, and who asked for which child."""

    def __init__(self, kind: str, first: socket.socket, base_path: list[str]) -> None:
        self.kind, self.first, self.base_path = kind, first, base_path
        self.connections: dict[int, socket.socket] = {first.fileno(): first}
        self.asked_by: dict[int, socket.socket] = {}  # child pid -> the connection that asked for it

    def reap(self) -> None:
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            connection = self.asked_by.pop(pid, None)
            message = {"exit": pid, "code": os.waitstatus_to_exitcode(status), "cpu_s": usage.ru_utime + usage.ru_stime}
            if connection is not None and connection.fileno() in self.connections:
                try:
                    connection.send(json.dumps(message).encode())
                except OSError:
                    pass  # it closed meanwhile: its children are killed below, nobody waits for this one

    def serve(self, connection: socket.socket) -> bool:
        """One request on ``connection``; False once the first connection closed (the zygote ends)."""
        data, fds, _, _ = socket.recv_fds(connection, _MESSAGE_BYTES, 4)
        if not data:
            del self.connections[connection.fileno()]
            _kill([pid for pid, asker in self.asked_by.items() if asker is connection])
            connection.close()
            return connection is not self.first
        request = json.loads(data)
        if request.get("connect"):
            added = socket.socket(fileno=fds[0])
            self.connections[added.fileno()] = added
            connection.send(json.dumps({"connected": True}).encode())
            return True
        if threading.active_count() != 1:
            names = [t.name for t in threading.enumerate()]
            connection.send(json.dumps({"error": f"the zygote runs Python threads {names}: it cannot fork"}).encode())
        else:
            pid = os.fork()
            if pid == 0:
                for open_connection in self.connections.values():
                    open_connection.close()
                _become_child(self.kind, request, fds, self.base_path)
            self.asked_by[pid] = connection
            connection.send(json.dumps({"pid": pid}).encode())
        for descriptor in fds:
            os.close(descriptor)
        return True


def main(fd: int, kind: str) -> None:
    first = socket.socket(fileno=fd)
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_path = [p for p in sys.path[1:] if p not in own]  # without the zygote's cwd and PYTHONPATH
    _warm(kind)
    server = _Server(kind, first, base_path)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    try:
        while True:
            readable, _, _ = select.select([*server.connections.values(), wake_read], [], [])
            if wake_read in readable:
                os.read(wake_read, 4096)
            server.reap()
            for connection in readable:
                if connection is not wake_read and connection.fileno() in server.connections:
                    if not server.serve(connection):
                        return  # the orchestrator went away: so does the zygote, and its children with it
            server.reap()
    finally:
        _kill(list(server.asked_by))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "harness")
