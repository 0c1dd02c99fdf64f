"""The candidate's processes: each started in the sandbox, connected to the harness by a Unix socket
of its own, and stopped (with everything it started) at the end. In the ``subprocess`` sandbox a harness
child that was given a connection to the candidate zygote (``zygote.py``) forks them from there,
warm, and tells its watchdog each one's pid (they are not its children); otherwise each is a fresh
process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from targets.harness.ipc.channel import AsyncChannel
from targets.harness.ipc.remote import CandidateError
from targets.harness.isolation.containers import new_owner, remove_containers
from targets.harness.isolation.process_tree import kill_tree
from targets.harness.isolation.sandbox import Sandbox
from targets.harness.isolation.written import LOG, SCRATCH, SCRATCH_PARENT, SCRATCH_PREFIX, last_bytes, remove_tree
from targets.harness.isolation.zygote_client import ZygoteChild, forks_of
from targets.printable import printable

# How long candidate processes get to exit on their own once a run is over: a cluster closes Ray and
# its actors. A run the harness abandoned (a refusal at hello, a crash, any error) leaves them
# waiting on channels nobody will answer, so they get only the short grace (the suite spent 20 s on
# each such run before).
STOP_GRACE_S = 20.0
ABANDONED_GRACE_S = 2.0
TAIL_BYTES = 64 << 10  # of a log, the most a failure's reason quotes from


def model_paths(model: Path) -> list[Path]:
    """What a candidate reads a model directory through: the directory, and what each link in it leads to,
    that file or folder alone (a Hugging Face cache's snapshot links each file to a blob outside it; the
    blob's folder, or a linked file's, may hold what is none of the candidate's business). A user's directory
    outside vibetrain's cache was hidden by the bubblewrap sandbox: every candidate failed to load it (a
    review). A link that leads nowhere is left for the loader to name."""
    paths = [model.resolve()]
    for folder, subfolders, files in os.walk(model):
        for name in [*subfolders, *files]:
            path = Path(folder) / name
            if path.is_symlink() and path.exists():
                paths.append(path.resolve())
    return list(dict.fromkeys(paths))


class CandidateProcesses:
    """Starts candidate processes in the sandbox, each connected to the harness by a Unix socket of
    its own (accepted once, then unlinked), and stops them all at the end: used as a context manager,
    with the short grace when the run is abandoned by an exception."""

    def __init__(
        self,
        sandbox: Sandbox,
        stack_dir: Path,
        logs: Path,
        gpus: bool = False,
        written: Callable[[str, Path], None] = lambda kind, path: None,
        memory_bytes: int | None = None,
        model: Path | None = None,
    ) -> None:
        """``written``: told each path the candidate writes on the host, a log (``written.LOG``) or the
        scratch folders' root (``written.SCRATCH``), for the watchdog's disk limit. ``memory_bytes``: the
        run's memory limit, each Docker container's own (its processes are the daemon's, outside the tree
        the watchdog measures), and in bubblewrap the size of each of a process's tmpfs (``Sandbox.wrap``).
        ``model``: the directory ``Runtime.model_path`` names, readable to the candidate wherever it is."""
        self.sandbox, self.stack_dir, self.logs, self.gpus = sandbox, Path(stack_dir).resolve(), logs, gpus
        self.model = model_paths(model) if model is not None else []
        # short: a socket path has 108 bytes
        self.root = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=SCRATCH_PARENT))
        self.written, self.memory_bytes = written, memory_bytes
        written(SCRATCH, self.root)
        (self.root / "sockets").mkdir()
        self.processes: dict[str, subprocess.Popen | ZygoteChild] = {}
        self._logs: dict[str, IO] = {}
        self._listeners: dict[str, socket.socket] = {}
        self._connections: dict[str, int] = {}  # connections each role has yet to make
        self.owner = new_owner(sandbox.backend)  # of its Docker containers, removed at ``stop``

    def launch(self, role: str, connections: int = 1) -> None:
        """Starts ``role``, which connects ``connections`` times (each taken by one ``accept``)."""
        path = self.root / "sockets" / f"{role}.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(connections)
        self._listeners[role] = listener
        self._connections[role] = connections
        if self.sandbox.backend == "subprocess":  # no private /tmp: a folder of the host's, under the disk limit
            scratch = self.root / f"scratch-{role}"
            scratch.mkdir()
            writable, cwd = [scratch], scratch
        else:  # its private /tmp (memory, sized: Sandbox.wrap): no folder of the host's disk is writable to it
            scratch, writable, cwd = self.root, [], Path("/tmp")
        argv = [role, str(path), str(self.stack_dir)]  # what the candidate process's main takes
        command = [sys.executable, "-m", "targets.harness.isolation.candidate_process", *argv]
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
        command, env = self.sandbox.wrap(
            command,
            env,
            readable=[self.stack_dir, self.root / "sockets", *self.model],
            writable=writable,
            cwd=cwd,
            gpus=self.gpus,
            owner=self.owner,
            memory_bytes=self.memory_bytes,
        )
        self._logs[role] = (self.logs / f"{role.split('-')[0]}.log").open("w")
        self.written(LOG, Path(self._logs[role].name).resolve())
        forks = forks_of("candidate")  # a harness child's connection to the candidate zygote, if it was given one
        if self.sandbox.backend == "subprocess" and forks is not None:
            self.processes[role] = forks.spawn(argv, env, self._logs[role].fileno(), cwd=str(scratch))
        else:
            self.processes[role] = subprocess.Popen(
                command, stdout=self._logs[role], stderr=subprocess.STDOUT, env=env, cwd=scratch
            )

    def accept(self, role: str) -> socket.socket:
        """The role's next connection, in the order it connects; fails with the process's last words
        if it dies first. The socket goes once the last connection is made."""
        listener, process = self._listeners[role], self.processes[role]
        self._connections[role] -= 1
        listener.settimeout(0.25)
        try:
            while True:
                try:
                    connection, _ = listener.accept()
                    connection.settimeout(None)
                    return connection
                except TimeoutError:
                    if process.poll() is not None:
                        raise CandidateError(
                            f"the candidate's {role} process exited with code {process.returncode} before "
                            f"connecting:\n{self.log_tail(role)}"
                        ) from None
        finally:
            if self._connections[role] == 0 or process.poll() is not None:
                self._listeners.pop(role).close()
                (self.root / "sockets" / f"{role}.sock").unlink(missing_ok=True)

    def forked_cpu_seconds(self) -> float:
        """CPU time of the processes forked for this run that ended (a fresh process's is its parent's
        ``RUSAGE_CHILDREN`` once reaped)."""
        return sum(p.cpu_s for p in self.processes.values() if isinstance(p, ZygoteChild) and p.poll() is not None)

    def log_tail(self, role: str) -> str:
        self._logs[role].flush()
        return log_tail(self.logs / f"{role.split('-')[0]}.log")

    def __enter__(self) -> CandidateProcesses:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.stop(STOP_GRACE_S if kind is None else ABANDONED_GRACE_S, raising=error)

    def stop(self, grace_s: float = STOP_GRACE_S, raising: BaseException | None = None) -> None:
        """Waits up to ``grace_s`` for every process to exit, then kills what is left, and removes their
        Docker containers, which outlive a killed client (again: a no-op). ``raising``: the exception
        the run is abandoned by, which a failure to remove them is logged beside, never raised over."""
        owner, self.owner = self.owner, None
        try:
            self._end(grace_s)
        except BaseException as error:
            if owner is not None:
                remove_containers(owner, raising=error)
            raise
        if owner is not None:  # before the scratch folders go: a container may still be writing there
            remove_containers(owner, raising=raising)
        for log in self._logs.values():
            log.close()
        for listener in self._listeners.values():  # a role that never connected
            listener.close()
        self._listeners.clear()
        remove_tree(self.root)

    def _end(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_tree(process.pid, signal.SIGKILL)
                process.wait()


async def channel_of(processes: CandidateProcesses, role: str) -> AsyncChannel:
    """The role's (first) connection as a channel."""
    return await AsyncChannel.over(processes.accept(role))


def log_tail(path: Path, lines: int = 15, line_chars: int = 400) -> str:
    """The last ``lines`` of a candidate's log, each cut to ``line_chars``, read from its last 64 KiB: a
    candidate may print gigabytes on one line before it exits, and the tail goes into the verdict (its control
    characters as escapes: a terminal would run them)."""
    tail = printable(last_bytes(path, TAIL_BYTES)[0].decode(errors="replace")).splitlines()[-lines:]
    return "\n".join(line if len(line) <= line_chars else line[:line_chars] + " [...]" for line in tail)
