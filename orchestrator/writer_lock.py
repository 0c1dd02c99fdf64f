"""One writer a run: the process that runs it holds an exclusive ``flock`` on a file of the run's until
the run ends or the process does, however it ends (the kernel lets go of a killed process's locks). A
second ``generate`` on the same run is refused by name instead of writing the same refs, worktrees and
state at once; and the writer that holds it knows that a git lock file it finds in the run's repository
was left by a process that is gone (``History.claim``)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from orchestrator.run_dir import RunDir
from targets.errors import UserError


class RunBusy(UserError, RuntimeError):
    """Another process holds the run."""


class WriterLock:
    """The run's lock, held by this process from ``claim`` until ``release``."""

    def __init__(self, path: Path, run_dir: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a+")  # not truncated before it is ours: the holder's pid stays readable
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "unknown"
            self._file.close()
            raise RunBusy(
                f"another vibetrain process (pid {holder}) is running the run in {run_dir}: wait for it to end, "
                "or stop it, before you resume it"
            ) from None
        self._file.truncate(0)
        self._file.write(f"{os.getpid()}\n")
        self._file.flush()

    def release(self) -> None:
        if _HELD.get(self.path) is self:
            del _HELD[self.path]
        self._file.close()


# This process's locks: a second claim of a run in it shares the first (a flock is an open file's: a
# second open of the file would wait on this process's own lock, as a loop the tests keep does).
_HELD: dict[Path, WriterLock] = {}


def claim(run_dir: Path) -> WriterLock:
    """The run's lock for this process: refused (``RunBusy``) while another process holds it."""
    path = RunDir(run_dir).writer_lock.resolve()
    if path not in _HELD:
        _HELD[path] = WriterLock(path, run_dir)
    return _HELD[path]
