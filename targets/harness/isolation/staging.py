"""What a measured run runs: a copy of the candidate's ``stack/`` alone, in a fresh folder of its own.

A candidate and the best it is paired with were run from folders that told them apart: the candidate from
the round's git worktree (a ``.git`` file, its name ``round-N-judged``), the best from an export (named
``baseline``, its files carrying the commit's times, its DESIGN.md holding its own round's entry, its
``.vibetrain`` records). A red team's stack slowed itself only where it found itself the baseline: once
best, it had every later candidate promoted, its own copy included. Staged, every run sees the same
folder: a random name holding ``stack/`` alone, every file and folder of one time and standard modes
(git's archive and a worktree leave them differently). What it still sees apart is said in docs/judge.md."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from targets.harness.isolation.stack_digest import TRASH
from targets.harness.isolation.written import remove_tree

PREFIX = "vibetrain-stack-"


@contextlib.contextmanager
def staged(candidate: Path) -> Iterator[Path]:
    """``candidate``'s ``stack/`` copied (links kept as links, bytecode caches left out) into a fresh folder,
    removed after the run (``remove_tree``: folders a candidate locked too, never raised over its result)."""
    folder = Path(tempfile.mkdtemp(prefix=PREFIX))
    try:
        caches = shutil.ignore_patterns("__pycache__", f"{TRASH}*")
        shutil.copytree(candidate / "stack", folder / "stack", symlinks=True, ignore=caches)
        _normalize(folder)
        yield folder
    finally:
        remove_tree(folder)


def _normalize(folder: Path) -> None:
    """One time (whole seconds) and standard modes for everything under ``folder``: nothing of where the copy
    came from."""
    now = int(time.time()) * 10**9
    for root, _, files in os.walk(folder, topdown=False):  # each folder once, as a root (links never walked)
        for path in (os.path.join(root, name) for name in files):
            if not os.path.islink(path):
                os.chmod(path, 0o755 if os.stat(path).st_mode & 0o111 else 0o644)
                os.utime(path, ns=(now, now))
        os.chmod(root, 0o755)  # after its files: its own time is not moved by settling them
        os.utime(root, ns=(now, now))
