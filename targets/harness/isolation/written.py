"""What a candidate writes to the host's disk, for the watchdog: its processes' logs, and in the
``subprocess`` sandbox its scratch folders (bubblewrap and Docker give a candidate process only its
private /tmp, memory sized by ``Sandbox.wrap``, to write in).

A candidate that prints or writes without end would fill the host's disk, and its log outlives the run;
so the harness child names each such path to the watchdog (marks lines ``writes PATH`` for a log,
``scratch PATH`` for a folder of its own making), which sums the blocks they hold once a second and kills
the run past ``Limits.disk_mb``. Blocks, not sizes: a sparse file claims no disk. A killed run's scratch
folders are removed by the watchdog (the child that would have removed them is gone), and when it was
killed for its disk its logs are cut to their last MiB. In the subprocess sandbox a candidate may write
wherever its user may (a file it deletes while holding it open, anywhere else on the host): that sandbox
isolates nothing, and says so.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("vibetrain.isolation")

LOG = "writes"  # a marks line ``writes PATH``: a log the candidate's output goes to (measured; kept)
SCRATCH = "scratch"  # ``scratch PATH``: a folder made for the run's candidate processes (measured; removed)
SCRATCH_PARENT, SCRATCH_PREFIX = Path("/tmp"), "vt-"  # where ``CandidateProcesses`` makes them: nothing else goes
MEASURE_EVERY_S = 1.0  # a walk of the folders: not at every 0.25 s poll of the watchdog
MAX_ENTRIES = 100_000  # files and folders the walk counts before it calls the candidate's a file storm
KEPT_LOG_BYTES = 1 << 20  # of each log of a run killed for its disk


@dataclass(frozen=True)
class Written:
    blocks_bytes: int
    entries: int

    @property
    def mb(self) -> float:
        return self.blocks_bytes / 2**20


def measure(paths: Iterable[Path], max_entries: int = MAX_ENTRIES) -> Written:
    """The disk ``paths`` and everything under them hold (a path gone in the meantime holds none),
    walked by folder descriptors (a path too long to name is no obstacle). Stops counting past
    ``max_entries``. A folder that cannot be read (made unreadable) raises its ``OSError``."""
    total = entries = 0
    for path in paths:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue  # removed before we looked: the run's own end removes its scratch
        entries, total = entries + 1, total + info.st_blocks * 512
        if not stat.S_ISDIR(info.st_mode):
            continue
        for _, folders, files, folder_fd in os.fwalk(path, onerror=_raise_unless_gone):
            for name in folders + files:
                try:
                    entries, total = entries + 1, total + os.lstat(name, dir_fd=folder_fd).st_blocks * 512
                except FileNotFoundError:
                    continue  # removed between the listing and the look
            if entries > max_entries:
                return Written(total, entries)
    return Written(total, entries)


def _raise_unless_gone(error: OSError) -> None:
    if error.errno not in (errno.ENOENT, errno.ENOTDIR):  # removed, or replaced by a file, while walked
        raise error


@dataclass
class DiskWatch:
    """The watchdog's view of what the run's candidate writes on the host (paths the child names)."""

    logs: set[Path] = field(default_factory=set)
    scratch: set[Path] = field(default_factory=set)
    measured_at: float = float("-inf")
    over: bool = False  # the run was found past its limit

    def heard(self, line: str) -> bool:
        """Takes a marks line that names a path; False if it is none of these."""
        kind, _, path = line.partition(" ")
        if kind == LOG:
            self.logs.add(Path(path))
        elif kind == SCRATCH:
            folder = Path(path)
            if folder.parent != SCRATCH_PARENT or not folder.name.startswith(SCRATCH_PREFIX):
                # never removed: the watchdog deletes only the folders the child makes, wherever a line came from
                log.warning("a scratch folder outside %s/%s*: %s; not watched", SCRATCH_PARENT, SCRATCH_PREFIX, path)
                return True
            self.scratch.add(folder)
        else:
            return False
        return True

    def excess(self, limit_mb: float) -> str:
        """Why the run must be killed for what it wrote, or '' (measured at most once a second)."""
        if time.monotonic() - self.measured_at < MEASURE_EVERY_S or not (self.logs or self.scratch):
            return ""
        self.measured_at = time.monotonic()
        try:
            written = measure(self.logs | self.scratch)
        except OSError as error:
            why = f"made its files unreadable to the harness ({error}): the disk limit cannot be held"
        else:
            if written.entries > MAX_ENTRIES:
                why = f"made over {MAX_ENTRIES} files and folders in its scratch folders (a file storm?)"
            elif written.mb > limit_mb:
                why = f"wrote {written.mb:.0f} MB to its logs and scratch folders, over its limit of {limit_mb:g} MB"
            else:
                return ""
        self.over = True
        return why

    def after_kill(self) -> None:
        """A killed run's leavings: its scratch folders removed, and when it was killed for its disk, each
        log cut to its last ``KEPT_LOG_BYTES`` (said at the top). Failures are logged, never raised."""
        for folder in sorted(self.scratch):
            remove_tree(folder)
        if not self.over:
            return
        for path in sorted(self.logs):
            try:
                _keep_tail(path)
            except OSError as error:
                log.warning("could not cut the killed run's log %s: %s", path, error)


def last_bytes(path: Path, count: int) -> tuple[bytes, int]:
    """The file's last ``count`` bytes, and its whole size (read without the rest: a log may hold gigabytes)."""
    with path.open("rb") as file:
        size = file.seek(0, os.SEEK_END)
        file.seek(max(0, size - count))
        return file.read(), size


def _keep_tail(path: Path) -> None:
    tail, size = last_bytes(path, KEPT_LOG_BYTES)
    if size <= KEPT_LOG_BYTES:
        return
    note = (
        f"[the harness cut this log to its last {KEPT_LOG_BYTES >> 20} MiB of {size / 2**20:.0f} MiB: the run "
        "was killed for its disk]\n"
    )
    path.write_bytes(note.encode() + tail)


def remove_tree(folder: Path) -> None:
    """Removes a folder a candidate wrote in, folders it made unreadable included (given back their
    permissions first; a link is never followed); what still cannot go is logged, never raised."""
    try:
        shutil.rmtree(folder)
        return
    except FileNotFoundError:
        return  # the child removed it before it ended
    except PermissionError:
        os.chmod(folder, 0o700)
        for root, folders, _ in os.walk(folder):  # top-down: each folder is unlocked before it is entered
            for name in folders:
                path = os.path.join(root, name)
                if not os.path.islink(path):
                    os.chmod(path, 0o700)
    try:
        shutil.rmtree(folder)
    except OSError as error:
        log.warning("could not remove the candidate's scratch folder %s: %s", folder, error)
