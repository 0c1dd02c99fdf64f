"""What a measured run runs: a copy of the candidate's ``stack/`` alone, in a fresh folder of its own.

A candidate and the best it is paired with were run from folders that told them apart: the candidate from
the round's git worktree (a ``.git`` file, its name ``round-N-judged``), the best from an export (named
``baseline``, its files carrying the commit's times, its DESIGN.md holding its own round's entry, its
``.vibetrain`` records). A red team's stack slowed itself only where it found itself the baseline: once
best, it had every later candidate promoted, its own copy included. Staged, every run sees the same thing:
a folder of a random name holding ``stack/``, its files as new as the copy."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

PREFIX = "vibetrain-stack-"


@contextlib.contextmanager
def staged(candidate: Path) -> Iterator[Path]:
    """``candidate``'s ``stack/`` copied (links kept as links, times the copy's) into a fresh folder, removed
    after the run."""
    folder = Path(tempfile.mkdtemp(prefix=PREFIX))
    try:
        shutil.copytree(candidate / "stack", folder / "stack", symlinks=True, copy_function=shutil.copy)
        yield folder
    finally:
        shutil.rmtree(folder)
