"""What a candidate has written to disk, for the watchdog: its processes' logs and its scratch folders.

A candidate that prints or writes without end would fill the host's disk, and its log outlives the run;
so the harness child names each such path to the watchdog (a marks line ``writes PATH``), which sums
the blocks they hold once a second and kills the run past ``Limits.disk_mb``. Blocks, not sizes: a
sparse file claims no disk. A killed run's scratch folders are removed by the watchdog (the child that
would have removed them is gone); its logs stay, within the limit, for the reasons they give.
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

    def excess(self, limit_mb: float) -> str:
        """Why the run must be killed for what it wrote, or '' (measured at most once a second)."""
        if not self.paths or time.monotonic() - self.measured_at < MEASURE_EVERY_S:
            return ""
        self.measured_at = time.monotonic()
        try:
            written = measure(self.paths)
        except PermissionError as error:
            return f"hid its files from the harness ({error}): the disk limit cannot be held"
        if written.entries > MAX_ENTRIES:
            return f"made over {MAX_ENTRIES} files and folders in its scratch folders (a file storm?)"
        if written.mb > limit_mb:
            return f"wrote {written.mb:.0f} MB to its logs and scratch folders, over its limit of {limit_mb:g} MB"
        return ""

    def remove_scratch(self) -> None:
        """The folders of a killed run (its logs, files, stay): logged, never raised, if one cannot go."""
        for path in sorted(p for p in self.paths if p.is_dir()):
            try:
                shutil.rmtree(path)
            except FileNotFoundError:
                continue  # the child removed it before it was killed
            except OSError as error:
                log.warning("could not remove the killed run's scratch folder %s: %s", path, error)
