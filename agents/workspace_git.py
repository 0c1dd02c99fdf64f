"""git in a candidate's workspace, run by the harness outside any sandbox, without trusting what the
agent wrote there.

A round's workspace is a linked worktree its agent may write in. Git run there reads the git
directory its ``.git`` file names, and for a repository embedded in it (``stack/x/.git``) that
repository's config too, when it asks whether the embedded one is dirty (``status``, ``diff``): an
agent that rewrites the link or plants a repository chooses config (``core.fsmonitor``, hooks, diff
drivers) that git would execute here, unsandboxed. An embedded repository also commits as a gitlink:
the commit would hold a hash where the judged code was.

Two more plants need no config at all: a ``.gitattributes`` (``-diff`` turns the review's diff into
"Binary files differ", ``export-subst``/``export-ignore`` change what ``git archive`` exports as the
best, ``eol``/``ident`` change the committed bytes), and a symbolic link (git commits the link, not
what it names, and the harness, writing DESIGN.md or its records, would write through it wherever it
points).

So: the worktree's own git directory is recorded when the harness makes the worktree (``trust``),
every command names it (``--git-dir``) instead of reading the link, and a workspace with a changed
link, a repository of its own, a git control file or a symbolic link is refused before git or the
harness touches it (``Tampered``). ``disarm`` undoes each, so a refused candidate is still committed
(its files, as evidence) and its worktree removed.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
from pathlib import Path

# Config that makes git run a program, off whatever config git reads (the user's own included);
# diffs pass --no-ext-diff --no-textconv.
SAFE = ("-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null")

MAX_CANDIDATE_BYTES = 256 * 2**20  # a candidate is source and small data; more is refused, not copied
RECORD_DIR = ".vibetrain"  # the run's records in each commit (the judge's report, the round's): the harness's
RECORD_FILES = (f"{RECORD_DIR}/judge.json", f"{RECORD_DIR}/round.json")
MAX_DEPTH = 64  # folders nested in a candidate, at most: deeper is refused, never walked by recursion
LONG_PATH_BYTES = 2048  # a folder's path, at most: one past it is not walked (names inside reach PATH_MAX, 4096)

_TRUSTED: dict[Path, tuple[Path, bytes]] = {}  # workspace -> (its git directory, its .git link as written)


class Tampered(RuntimeError):
    """The workspace's git metadata is not what the harness made: git will not be run in it."""


class GitFailed(RuntimeError):
    """A git command in the workspace exited with an error (its stderr is the message)."""


CONTROL_FILES = (".gitattributes", ".lfsconfig", ".gitmodules")  # git reads them from the work tree


def trust(workspace: Path, repository: Path) -> None:
    """Record a worktree the harness has just made of ``repository`` (its git directory), before
    anything of the agent's is in it."""
    workspace = workspace.resolve()
    link = (workspace / ".git").read_bytes()
    git_dir = (workspace / link.decode().removeprefix("gitdir:").strip()).resolve()  # relative, or absolute
    if git_dir.parent != (repository.resolve() / "worktrees") or not (git_dir / "commondir").is_file():
        raise Tampered(f"{workspace} is not a linked worktree of {repository} (its .git names {git_dir})")
    _TRUSTED[workspace] = (git_dir, link)


def forget(workspace: Path) -> None:
    _TRUSTED.pop(workspace.resolve(), None)


def plants(workspace: Path) -> dict[str, list[str]]:
    """Below the workspace's root, relative to it: every ``.git`` (a repository, or a link to one),
    git control file, symbolic link, and special file (a FIFO, a socket, a device: reading one blocks or never
    ends) (the root's own ``.git`` aside)."""
    kinds = ("repositories", "control", "links", "special", "deep", "long", "records")
    found: dict[str, list[str]] = {kind: [] for kind in kinds}
    folders = [(workspace, 0)]  # walked with a list, not by recursion: a tree thousands deep is named, not a crash
    while folders:
        here, depth = folders.pop()
        for entry in sorted(os.scandir(here), key=lambda entry: entry.name):
            relative = str(Path(entry.path).relative_to(workspace))
            if entry.name == ".git":
                if here != workspace:
                    found["repositories"].append(relative)
            elif entry.name in CONTROL_FILES:
                found["control"].append(relative)
            elif entry.is_symlink():
                found["links"].append(relative)
            elif relative == RECORD_DIR and not entry.is_dir(follow_symlinks=False):
                found["records"].append(relative)  # a file where the records go: the commit could not write them
            elif entry.is_dir(follow_symlinks=False):
                if depth + 1 >= MAX_DEPTH:
                    found["deep"].append(relative)
                elif len(os.fsencode(entry.path)) > LONG_PATH_BYTES:  # a red team's 20 names of 250: ENAMETOOLONG
                    found["long"].append(relative)  # in every walk by path, the worktree's removal left undone
                else:
                    folders.append((Path(entry.path), depth + 1))
            elif not entry.is_file(follow_symlinks=False):
                found["special"].append(relative)
            elif relative.startswith(f"{RECORD_DIR}/") and relative not in RECORD_FILES:
                found["records"].append(relative)
    return {kind: sorted(paths) for kind, paths in found.items()}


def remove_folder(path: Path) -> None:
    """``path`` and all in it, however deep (``shutil.rmtree`` recurses, and a tree past Python's recursion
    limit raised from it), never following a link."""
    try:
        shutil.rmtree(path)
    except RecursionError:
        subprocess.run(["rm", "-rf", "--", str(path)], check=True, capture_output=True)


def tampering(workspace: Path) -> list[str]:
    """Why git (or the harness) must not touch ``workspace`` (empty: it may)."""
    workspace = workspace.resolve()
    found = plants(workspace)
    reasons = [
        f"{path}: a git repository inside the candidate: git would read its config (which can name "
        "programs git runs) and commit it as a bare hash instead of the code that was judged; delete it"
        for path in found["repositories"]
    ]
    reasons += [
        f"{path}: a git control file in the candidate: it changes what git diffs, commits and exports "
        "(the review's diff, the committed bytes, the exported best); delete it"
        for path in found["control"]
    ]
    reasons += [
        f"{path}: a symbolic link in the candidate: git commits the link, not what it names, and the harness "
        "would write through it; put the file itself there"
        for path in found["links"]
    ]
    reasons += [
        f"{path}: a FIFO, socket or device in the candidate: reading it blocks or never ends (git, the scans, the "
        "copy the judge runs); delete it"
        for path in found["special"]
    ]
    reasons += [f"{path}: folders nested {MAX_DEPTH} deep in the candidate; flatten it" for path in found["deep"]]
    reasons += [
        f"{path[:200]}... ({len(path)} characters): a folder whose path passes {LONG_PATH_BYTES} bytes; shorten it"
        for path in found["long"]
    ]
    reasons += [
        f"{path}: a file among the run's records ({RECORD_DIR}/), which the review's diff leaves out; put it in stack/"
        for path in found["records"]
    ]
    if _link_changed(workspace):
        reasons.append(
            ".git: the worktree's link to its git directory was changed: it is the harness's, and git "
            "would read the config of whatever it names"
        )
    return reasons


def _link_changed(workspace: Path) -> bool:
    """Whether a recorded worktree's ``.git`` is no longer the link the harness wrote (False for a
    folder the harness did not make)."""
    trusted = _TRUSTED.get(workspace)
    link = workspace / ".git"
    return trusted is not None and (link.is_symlink() or not link.is_file() or link.read_bytes() != trusted[1])


def run(workspace: Path, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """``git args`` in the workspace; a recorded worktree through its own git directory. Raises
    ``Tampered`` before running anything in a tampered workspace, ``GitFailed`` on an error exit
    (unless ``check`` is false)."""
    workspace = workspace.resolve()
    reasons = tampering(workspace)
    if reasons:
        raise Tampered("; ".join(reasons))
    trusted = _TRUSTED.get(workspace)
    where = ["--git-dir", str(trusted[0]), "--work-tree", str(workspace)] if trusted else []
    done = subprocess.run(
        ["git", *SAFE, *where, *args], cwd=workspace, input=input, capture_output=True, text=True, check=False
    )
    if check and done.returncode != 0:
        raise GitFailed(f"git {' '.join(args)} in {workspace} failed: {done.stderr.strip()}")
    return done


def output(workspace: Path, *args: str) -> str:
    """What ``git args`` prints, its last newline removed (as GitPython gives it)."""
    return run(workspace, *args).stdout.removesuffix("\n")


# what a failed copy means about the disk the copy writes to, not about what the agent did to its workspace
DISK_FAILURES = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS}


def copy_candidate(source: Path, target: Path) -> list[str]:
    """Make ``target``'s files those of ``source`` (every file but git's link, bytecode caches and the
    run's records) and say what was not copied and why. ``target`` is a worktree the harness made; its
    ``.git`` stays.

    A process of the agent's may still be changing ``source`` while this copies it, so nothing here
    trusts a name twice: each folder and file is opened relative to its opened parent without following
    links (a folder swapped for a link to ``~/.ssh`` is refused, not read), a file is copied only if the
    opened thing is a regular file (a FIFO would block, a device would not end), at most
    ``MAX_CANDIDATE_BYTES`` in all, and each copy is created new in a folder this made, so no write
    goes through a link. Links are recreated as links (never followed) after every file, for the gate
    to name."""
    for path in sorted(target.iterdir()):
        if path.name == ".git":
            continue
        if path.is_dir() and not path.is_symlink():
            remove_folder(path)
        else:
            path.unlink()
    refused: list[str] = []
    links: list[tuple[Path, str]] = []
    copied = 0

    def walk(folder_fd: int, into: Path, relative: Path) -> None:
        nonlocal copied
        for name in sorted(os.listdir(folder_fd)):
            if name in (".git", "__pycache__") or relative / name == Path(RECORD_DIR):
                continue  # the run's records are the harness's, written at the commit: the judged run never
                # reads what an agent left there (the review's diff leaves them out)
            where = relative / name
            try:
                kind = os.stat(name, dir_fd=folder_fd, follow_symlinks=False).st_mode
                if stat.S_ISLNK(kind):
                    links.append((where, os.readlink(name, dir_fd=folder_fd)))
                elif stat.S_ISDIR(kind) and len(where.parts) >= MAX_DEPTH:
                    refused.append(f"{where}: folders nested {MAX_DEPTH} deep, not copied")
                elif stat.S_ISDIR(kind):
                    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=folder_fd)
                    try:
                        (into / name).mkdir()
                        walk(fd, into / name, where)
                    finally:
                        os.close(fd)
                elif stat.S_ISREG(kind):
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder_fd)
                    with os.fdopen(fd, "rb") as file:
                        opened = os.fstat(file.fileno())
                        if not stat.S_ISREG(opened.st_mode):
                            refused.append(f"{where}: changed into a special file while the harness copied it")
                            continue
                        data = file.read(MAX_CANDIDATE_BYTES - copied + 1)  # one byte over: the limit passed
                        if copied + len(data) > MAX_CANDIDATE_BYTES:
                            refused.append(f"{where}: the candidate passes {MAX_CANDIDATE_BYTES // 2**20} MiB here")
                            continue
                        copied += len(data)
                        with open(into / name, "xb") as out:
                            out.write(data)
                        os.chmod(into / name, opened.st_mode & 0o777)
                else:
                    refused.append(f"{where}: a special file (a FIFO, socket or device), not a file or folder")
            except OSError as error:  # vanished, or swapped for a link, between the listing and the open
                if error.errno in DISK_FAILURES:  # the harness's own disk: the run's trouble, never the candidate's
                    raise
                refused.append(f"{where}: changed while the harness copied it ({error.strerror})")

    root = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        walk(root, target, Path())
    finally:
        os.close(root)
    for where, points_to in links:
        if (target / where).parent.is_dir():  # else its folder was refused, and said so
            (target / where).symlink_to(points_to)
    return refused


def disarm(workspace: Path) -> list[str]:
    """Restore a recorded worktree's link and delete what was planted in it (``plants``); say what
    was undone. A folder the harness did not make is left as it is."""
    workspace = workspace.resolve()
    trusted = _TRUSTED.get(workspace)
    if trusted is None or not workspace.is_dir():
        return []
    undone = []
    for path in [p for paths in plants(workspace).values() for p in paths]:
        planted = workspace / path
        if planted.is_dir() and not planted.is_symlink():
            remove_folder(planted)
        else:
            planted.unlink()
        undone.append(f"removed {path}")
    link = workspace / ".git"
    if _link_changed(workspace):
        if link.is_dir() and not link.is_symlink():
            shutil.rmtree(link)
        else:
            link.unlink(missing_ok=True)
        link.write_bytes(trusted[1])
        undone.append("restored .git")
    return undone
