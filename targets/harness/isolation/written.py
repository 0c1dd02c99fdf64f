"""What a candidate has written to disk, for the watchdog: its processes' logs and its scratch folders.

A candidate that prints or writes without end would fill the host's disk, and its log outlives the run;
so the harness child names each such path to the watchdog (a marks line ``writes PATH``), which sums
the blocks they hold once a second and kills the run past ``Limits.disk_mb``. Blocks, not sizes: a
sparse file claims no disk. A file deleted while still open holds its blocks where no walk finds it:
when the filesystems under those paths have grown past the limit since the last look (two ``statvfs``),
the run's processes' open files are read too (``/proc/PID/fd``, too dear to read every second). A
killed run's scratch folders are removed by the watchdog (the child that would have removed them is
gone); its logs stay, within the limit, for the reasons they give.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("vibetrain.isolation")

WRITES = "writes"  # a marks line ``writes PATH``: a log or a scratch folder the candidate writes
MEASURE_EVERY_S = 1.0  # a walk of the folders: not at every 0.25 s poll of the watchdog
MAX_ENTRIES = 100_000  # files and folders the walk counts before it calls the candidate's a file storm


@dataclass(frozen=True)
class Written:
    blocks_bytes: int
    entries: int

    @property
    def mb(self) -> float:
        return self.blocks_bytes / 2**20


def measure(paths: Iterable[Path], max_entries: int = MAX_ENTRIES) -> Written:
    """The disk ``paths`` and everything under them hold (a path gone in the meantime holds none).
    Stops counting past ``max_entries``. A folder the candidate made unreadable raises PermissionError."""
    total = entries = 0
    pending = [os.fspath(p) for p in paths]
    while pending and entries <= max_entries:
        path = pending.pop()
        try:
            info = os.lstat(path)
            entries += 1
            total += info.st_blocks * 512
            if stat.S_ISDIR(info.st_mode):
                with os.scandir(path) as listing:
                    pending.extend(entry.path for entry in listing)
        except FileNotFoundError:
            continue  # removed while we looked: the run's own end removes its scratch
    return Written(total, entries)


@dataclass
class DiskWatch:
    """The watchdog's view of what the run's candidate writes (paths named by the child as it starts
    candidate processes)."""

    paths: set[Path] = field(default_factory=set)
    measured_at: float = float("-inf")
    filesystems: dict[int, Path] = field(default_factory=dict)  # st_dev: a folder on it that stays
    baseline_bytes: int = 0  # the filesystems' use that is not the run's candidate's, as last reckoned

    def excess(self, limit_mb: float, pids: list[int]) -> str:
        """Why the run must be killed for what it wrote, or '' (measured at most once a second).
        ``pids``: the run's processes, whose open files are read when the filesystems grew past the limit."""
        if not self.paths or time.monotonic() - self.measured_at < MEASURE_EVERY_S:
            return ""
        self.measured_at = time.monotonic()
        self._new_filesystems()
        try:
            written = measure(self.paths)
            if written.entries > MAX_ENTRIES:
                return f"made over {MAX_ENTRIES} files and folders in its scratch folders (a file storm?)"
            if written.mb > limit_mb:
                return f"wrote {written.mb:.0f} MB to its logs and scratch folders, over its limit of {limit_mb:g} MB"
            used = self._used_bytes()
            if used - self.baseline_bytes <= limit_mb * 2**20:
                return ""
            held = unlinked_open_bytes(pids, set(self.filesystems))
        except PermissionError as error:
            return f"hid its files from the harness ({error}): the disk limit cannot be held"
        if written.blocks_bytes + held > limit_mb * 2**20:
            return (
                f"holds {held / 2**20:.0f} MB in files it deleted while open and {written.mb:.0f} MB in its logs "
                f"and scratch folders, over its limit of {limit_mb:g} MB"
            )
        self.baseline_bytes = used - written.blocks_bytes - held  # the growth was another's (the harness's weights)
        return ""

    def _new_filesystems(self) -> None:
        """Each filesystem the paths are on, its use at first sight counted as not the candidate's."""
        for path in self.paths:
            folder = path.parent  # stays: a scratch root is removed at the run's end, /tmp is not
            try:
                device = os.stat(folder).st_dev
            except FileNotFoundError:
                continue
            if device not in self.filesystems:
                self.filesystems[device] = folder
                self.baseline_bytes += _used(folder)

    def _used_bytes(self) -> int:
        return sum(_used(folder) for folder in self.filesystems.values())

    def remove_scratch(self) -> None:
        """The folders of a killed run (its logs, files, stay): logged, never raised, if one cannot go."""
        for path in sorted(p for p in self.paths if p.is_dir()):
            try:
                shutil.rmtree(path)
            except FileNotFoundError:
                continue  # the child removed it before it was killed
            except OSError as error:
                log.warning("could not remove the killed run's scratch folder %s: %s", path, error)


def _used(folder: Path) -> int:
    stats = os.statvfs(folder)
    return (stats.f_blocks - stats.f_bfree) * stats.f_frsize


def unlinked_open_bytes(pids: list[int], devices: set[int]) -> int:
    """Blocks held by files on ``devices`` that ``pids`` keep open after deleting them (each file once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for pid in pids:
        try:
            descriptors = os.listdir(f"/proc/{pid}/fd")
        except (FileNotFoundError, ProcessLookupError):
            continue  # the process ended while we looked
        for fd in descriptors:
            try:
                info = os.stat(f"/proc/{pid}/fd/{fd}")
            except (FileNotFoundError, ProcessLookupError):
                continue  # closed while we looked
            key = (info.st_dev, info.st_ino)
            if info.st_nlink == 0 and info.st_dev in devices and key not in seen:
                seen.add(key)
                total += info.st_blocks * 512
    return total
