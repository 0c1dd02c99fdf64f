"""The requesting side of the zygotes (``zygote.py`` is the zygote process and its protocol): the
orchestrator's handle that starts one, a connection to ask for forks on, and the forked child as a
launcher sees it."""

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
from collections.abc import Callable
from dataclasses import dataclass

from targets import PROJECT_ROOT


def passed_fd(position: int) -> int:
    """Where a fork finds the ``position``-th descriptor passed beside its log (``zygote.py`` places them
    at 3, 4, ... in the order given)."""
    return 3 + position


MARKS_FD = passed_fd(0)  # where a forked harness child finds its marks pipe (its argv says --marks-fd 3)
JUDGES_FD = passed_fd(1)  # its connection to the harness zygote, for its run's judges (--judges-fd 4)
FORKS_FD = passed_fd(2)  # its connection to the candidate zygote (--forks-fd 5), in the subprocess sandbox
MESSAGE_BYTES = 1 << 20


class ZygoteError(RuntimeError):
    """The zygote could not fork a child, or went away."""


class ZygoteClient:
    """One connection to a zygote: forks, and the exit codes of the children it asked for. Safe to
    share between threads."""

    def __init__(self, sock: socket.socket, kind: str) -> None:
        self._socket, self.kind, self._lock = sock, kind, threading.Lock()
        self._exits: dict[int, tuple[int, float]] = {}
        self.went_away = ""  # why, once it did: what a child's SIGKILL by its death is reported with

    @property
    def gone(self) -> bool:
        return bool(self.went_away)

    def fileno(self) -> int:
        """Readable when a message is waiting (a child's exit, ``exit_of``): a launcher waits on it."""
        return self._socket.fileno()

    def _last_words(self) -> str:
        return "its connection closed"

    def _receive(self, block: bool) -> dict | None:
        """One message (caller holds the lock); None when none is waiting and ``block`` is false."""
        if not block and not select.select([self._socket], [], [], 0)[0]:
            return None
        try:
            data = self._socket.recv(MESSAGE_BYTES)
        except ConnectionResetError:
            data = b""  # it went away with a request of ours unread
        if not data:
            self.went_away = f"the {self.kind} zygote went away: {self._last_words()}"
            raise ZygoteError(self.went_away)
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

    def spawn(
        self, argv: list[str], env: dict[str, str], log_fd: int, *extra_fds: int, cwd: str = "", main: str = ""
    ) -> ZygoteChild:
        """A fork running ``python -m <main> *argv`` (default main: the kind's first, ``zygote.MAINS``):
        output to ``log_fd``, ``extra_fds`` at 3, 4, ... and ``cwd`` (default: ours) its working directory."""
        request = {"argv": argv, "env": env, "cwd": cwd or os.getcwd(), **({"main": main} if main else {})}
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
            [sys.executable, "-m", "targets.harness.isolation.zygote", str(theirs.fileno()), kind, str(os.getpid())],
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


@dataclass
class ReportedForks:
    """Forks over a connection to a zygote, each reported as it starts: ``report(pid)`` tells whoever holds
    this process's limits (a harness child's watchdog), since a fork is the zygote's child, not ours."""

    client: ZygoteClient
    report: Callable[[int], None]

    def spawn(
        self, argv: list[str], env: dict[str, str], log_fd: int, *extra_fds: int, cwd: str = "", main: str = ""
    ) -> ZygoteChild:
        child = self.client.spawn(argv, env, log_fd, *extra_fds, cwd=cwd, main=main)
        self.report(child.pid)
        return child


_forks: dict[str, ReportedForks] = {}  # zygote kind -> the forks this process starts of that kind


def use_forks(forks: ReportedForks) -> None:
    """The processes of its zygote's kind this process starts are forks over ``forks``: a harness child's
    candidate processes over the candidate zygote (subprocess sandbox), its run's judges over the harness
    zygote, each connection given by its launcher."""
    _forks[forks.client.kind] = forks


def drop_forks(kind: str) -> None:
    """The processes of ``kind`` this process starts are fresh ones again."""
    _forks.pop(kind, None)


def forks_of(kind: str) -> ReportedForks | None:
    """What ``use_forks`` set for ``kind``, if anything."""
    return _forks.get(kind)


_zygotes: dict[str, Zygote] = {}
_starting = threading.Lock()


def zygote(kind: str = "harness") -> Zygote:
    """This process's zygote of ``kind``, started on first use (and again if it went away)."""
    with _starting:
        owner = _zygotes.get(kind)
        if owner is None or owner.gone or owner.process.poll() is not None:
            owner = _zygotes[kind] = Zygote(kind)
        return owner
