"""What a git killed mid-write leaves in a run's repository, and when it may be taken away.

Git writes the index, HEAD or a ref to ``<file>.lock`` and renames it into place; killed in between, it
leaves the lock, and every later git call that needs that file refuses ("index.lock: File exists"). A
lock is stale only when no git is still at work on it: the run's writer lock says no other vibetrain
runs the run, but a git child of a vibetrain killed alone (not its process group) goes on, and so may a
person's own git in the run directory. So a lock is taken away only when no live ``git`` process works
in the run directory or one of its linked worktrees (read from ``/proc``: Linux, as the sandboxes are; a
git in a round's worktree takes the shared ``packed-refs`` and ref locks too), and the lock is the same
file, untouched, ``GRACE_S`` later. A linked worktree's own locks are not looked at:
``History.remove_worktree`` deletes the worktree's whole entry before its round is redone."""

from __future__ import annotations

import os
import time
from pathlib import Path

from targets.errors import UserError

GRACE_S = 1.0  # a lock found: how long it must stay the same file, untouched, to be a killed git's
WAIT_FOR_GIT_S = 10.0  # how long a git still at work in the run directory may take before the resume is refused


class GitStillRunning(UserError, RuntimeError):
    """A git process works in the run directory: its locks are not stale."""


def stale_locks(run_dir: Path, git_dir: Path) -> list[Path]:
    """The lock files at the top of ``git_dir`` and under its ``refs/`` that no live git holds."""
    found = _locks(git_dir)
    if not found:
        return []
    _wait_for_git(run_dir.resolve(), git_dir)
    before = {lock: _stamp(lock) for lock in found}
    time.sleep(GRACE_S)
    return [lock for lock in _locks(git_dir) if before.get(lock) is not None and _stamp(lock) == before[lock]]


def _locks(git_dir: Path) -> list[Path]:
    return sorted({*git_dir.glob("*.lock"), *git_dir.glob("refs/**/*.lock")})


def _stamp(lock: Path) -> tuple[int, int] | None:
    """Which file it is and when it was last written; None once it is gone."""
    try:
        stat = lock.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _work_trees(run_dir: Path, git_dir: Path) -> list[Path]:
    """Where a git that writes this repository works: the run directory, and each linked worktree git has
    an entry for (``worktrees/<id>/gitdir`` names its ``.git``, absolute or relative to the entry)."""
    trees = [run_dir]
    for gitdir in (git_dir / "worktrees").glob("*/gitdir"):
        named = gitdir.read_text(errors="replace").strip()
        if named:
            trees.append((gitdir.parent / named).resolve().parent)
    return trees


def _wait_for_git(run_dir: Path, git_dir: Path) -> None:
    deadline = time.monotonic() + WAIT_FOR_GIT_S
    while working := _git_processes_in(_work_trees(run_dir, git_dir)):
        if time.monotonic() > deadline:
            raise GitStillRunning(
                f"git (pid {', '.join(map(str, working))}) is still at work in {run_dir} or a "
                "round's worktree of it: let it finish, or stop "
                "it, before the run goes on"
            )
        time.sleep(0.2)


def _git_processes_in(trees: list[Path]) -> list[int]:
    """Live ``git`` processes whose working directory is in one of ``trees`` (GitPython runs git in the run
    directory, the harness in a round's worktree), but
    ``cat-file``: GitPython keeps one open beside each repository it has read objects through (a test's, a
    ``vibetrain log`` in another terminal); it reads, and takes no lock."""
    proc = Path("/proc")
    if not proc.is_dir():  # no /proc to read: the grace alone decides
        return []
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "comm").read_text().strip() != "git":
                continue
            cwd = Path(os.readlink(entry / "cwd"))
            if not any(cwd.is_relative_to(tree) for tree in trees):
                continue
            if (entry / "cmdline").read_bytes().split(b"\0")[1:2] != [b"cat-file"]:
                found.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):  # gone, or another user's
            continue
    return found
