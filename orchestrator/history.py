"""The run's git history (gitpython; this is its one writer). The commit graph is the search tree:

* a validated candidate is a commit whose parent is the candidate it was derived from, subject
  ``Round N: <task>``, with trailers (round, task, agent backend, verdict, headline metric and the
  parent's); ``refs/vibetrain/rounds/<N>`` keeps every one reachable;
* the branch ``best`` points at the best validated candidate (HEAD follows it);
* a rejected attempt is a commit on its parent kept under ``refs/vibetrain/rejected/<N>``, with the
  judge's report in ``.vibetrain/judge.json``.

Each round works in a linked worktree (``git worktree add --detach``) outside the repository.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import git

from agents import workspace_git
from orchestrator import git_leftovers, writer_lock
from targets.errors import UserError

RECORD_DIR = workspace_git.RECORD_DIR  # per-commit records (judge report, round) inside the candidate tree
VALIDATED, REJECTED = "rounds", "rejected"  # a round's commit, by what became of it: refs/vibetrain/<kind>/<N>
BEST = "best"  # the branch the run directory has checked out: the best validated candidate
# git flushes a commit's objects and the refs it moves before it returns (git 2.36 on; an older git ignores them)
DURABLE = {"core.fsync": "committed,reference", "core.fsyncMethod": "fsync"}


def _round_ref(kind: str, number: int | str) -> str:
    return f"refs/vibetrain/{kind}/{number}"


def _subject_start(kind: str, number: int) -> str:
    """How a round's commit subject begins (``adopt`` reads it back)."""
    return f"Round {number}: " if kind == VALIDATED else f"Round {number} (rejected): "


def _entry_head(entry: Path) -> str | None:
    """The commit a worktree entry (``.git/worktrees/<id>``) has checked out, detached; None for an add
    killed before it set HEAD (git writes 40 zeros first) or a HEAD that names no commit."""
    try:
        head = (entry / "HEAD").read_text(errors="replace").strip()
    except FileNotFoundError:
        return None
    return head if len(head) == 40 and all(c in "0123456789abcdef" for c in head) and head != "0" * 40 else None


class HistoryError(UserError, RuntimeError):
    """The run repository is not in a state this run can use (the message says what to do)."""


class RefNotWritten(HistoryError):
    """A round's commit was made and its ref could not be written: the round's worktree holds the commit, and
    a resume records the round from it, so the run stops here rather than remove that worktree."""


@dataclass(frozen=True)
class Trailers:
    round: int
    task: str
    backend: str
    verdict: str
    metric: str  # "name=value"
    parent_metric: str
    promotion: str = ""  # a validated round: promoted or not, the pair and the rule it had to clear

    def lines(self) -> str:
        return (
            f"Round: {self.round}\nTask: {self.task}\nAgent-Backend: {self.backend}\nVerdict: {self.verdict}\n"
            f"Headline-Metric: {self.metric}\nParent-Metric: {self.parent_metric}"
            + (f"\nPromotion: {self.promotion}" if self.promotion else "")
        )


class History:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.repo = git.Repo(path)
        self.writer: writer_lock.WriterLock | None = None  # held once this process claims the run

    @classmethod
    def create(cls, path: Path, description: str) -> History:
        """A new run repository whose root is an empty commit describing the run: every round's
        worktree, round 0's included, then starts from a commit."""
        path.mkdir(parents=True, exist_ok=True)
        repo = git.Repo.init(path, initial_branch=BEST)
        with repo.config_writer() as config:
            config.set_value("user", "name", "vibetrain")
            config.set_value("user", "email", "vibetrain@localhost")
            config.set_value("gc", "autoDetach", "false")  # a git's own gc ends with it, locks and all
        history = cls(path)
        history.make_durable()
        repo.git.commit("--allow-empty", "-m", description)
        return history

    def make_durable(self) -> None:
        """Have git flush each commit's objects and each ref it moves to disk before it returns (by default it
        flushes nothing): the run state, flushed after each round, names commits and refs that a power loss
        would otherwise leave empty or missing, the round's worktrees already removed."""
        try:
            with self.repo.config_writer() as config:
                for key, value in DURABLE.items():
                    section, option = key.split(".")
                    config.set_value(section, option, value)
        except OSError as error:  # a config.lock another git holds, a read-only repository
            raise HistoryError(f"{self.path}: git's config cannot be written ({error})") from None

    @classmethod
    def open(cls, path: Path) -> History:
        try:
            return cls(path)
        except (git.InvalidGitRepositoryError, git.NoSuchPathError):
            raise HistoryError(f"{path} is not a vibetrain run repository") from None

    def claim(self) -> list[str]:
        """Make this process the run's one writer until it exits (``WriterLock``: another is refused), then
        make good what a git killed mid-write left, which every later git call would refuse: its stale lock
        files (``git_leftovers.py``), and the run directory's files a killed ``reset --hard`` (``set_best``)
        left half written: kept as found under ``refs/vibetrain/recovered/<time>``, then reset to ``best``.
        Returns what it made good, to be said."""
        self.writer = writer_lock.claim(self.path)
        said = self._make_good()
        self.make_durable()  # a run made before git was told to flush (after a killed git's config.lock went)
        return said

    def _make_good(self) -> list[str]:
        """What ``claim`` makes good of a git killed mid-write, said."""
        git_dir = Path(self.repo.git_dir)
        left = git_leftovers.stale_locks(self.path, git_dir)
        if not left:
            return []
        for lock in left:
            lock.unlink(missing_ok=True)
        said = [f"removed what a killed git left: {', '.join(str(lock.relative_to(git_dir)) for lock in left)}"]
        tree_locks = {git_dir / name for name in ("index.lock", "HEAD.lock", "ORIG_HEAD.lock", "refs/heads/best.lock")}
        if tree_locks & set(left) and self.repo.head.is_valid():  # (no commit yet: a create killed, nothing to keep)
            found = self.repo.git.stash("create")  # the tracked files as found, a commit no branch holds
            kept = ""
            if found:
                ref = f"refs/vibetrain/recovered/{time.strftime('%Y%m%d-%H%M%S')}"
                self.repo.git.update_ref(ref, found)
                kept = f"; as found: {ref}"
            self.repo.git.reset("--hard")
            said.append(f"reset the run directory's files to best (a killed update had left them half written{kept})")
        return said

    def release(self) -> None:
        """The run is this process's no longer (the loop has ended)."""
        if self.writer is not None:
            self.writer.release()
            self.writer = None

    # -- state -----------------------------------------------------------------------------------
    def dirty(self) -> list[str]:
        """Uncommitted changes in the run repository's own worktree (someone edited it by hand)."""
        if not self.repo.head.is_valid():
            return []
        return [line for line in self.repo.git.status("--porcelain").splitlines() if line.strip()]

    def round_commit(self, number: int) -> str | None:
        return self._ref_commit(VALIDATED, number)

    def _ref_commit(self, kind: str, number: int) -> str | None:
        try:
            return self.repo.commit(_round_ref(kind, number)).hexsha
        except git.BadName:  # no such round (a ref that is there but unreadable is an error: raised)
            return None

    def round_numbers(self) -> list[int]:
        """Every round with a commit, validated or rejected, in order."""
        prefixes = (_round_ref(VALIDATED, ""), _round_ref(REJECTED, ""))
        # a ref's lock a killed git left (``N.lock``) is listed like a ref; git forbids such names for refs
        paths = [ref.path for ref in self.repo.refs if ref.path.startswith(prefixes) and not ref.path.endswith(".lock")]
        return sorted({int(path.rsplit("/", 1)[1]) for path in paths})

    def rejected_commit(self, number: int) -> str | None:
        return self._ref_commit(REJECTED, number)

    def best(self) -> str | None:
        """The best validated candidate's commit; None before the first (or in a repository that is no run)."""
        if not self.repo.head.is_valid():
            return None
        try:
            best = self.repo.commit(BEST)
        except git.BadName:  # a git repository without the run's ``best`` branch
            return None
        return best.hexsha if best.parents else None  # the run's empty first commit: no candidate yet

    def export(self, commit: str, directory: Path) -> Path:
        """The candidate's files at ``commit``, written to ``directory`` (created; must not exist)."""
        import tarfile

        directory.mkdir(parents=True)
        archive = directory / ".candidate.tar"
        try:
            self.repo.git.archive(commit, "--format=tar", "-o", str(archive))
        except git.GitCommandError as error:
            raise HistoryError(f"cannot read commit {commit}: {error.stderr.strip()}") from None
        with tarfile.open(archive) as tar:
            tar.extractall(directory, filter="data")
        archive.unlink()
        return directory

    def commit(self, commit: str) -> git.Commit:
        """The commit a run's record names; a commit the repository lacks (a state from another copy of
        the run, a history rewritten by hand) is named, not a traceback."""
        try:
            found = self.repo.commit(commit)
            found.tree  # noqa: B018 - resolved now: gitpython takes the all-zero id lazily, and fails on its first read
        except (ValueError, git.BadName):
            raise HistoryError(
                f"commit {commit[:10]} is not in {self.path}'s repository (git -C {self.path} log --all lists "
                "what it has)"
            ) from None
        return found

    def read(self, commit: str, path: str) -> str:
        """A file of a commit's tree (``stack/params.json``, ``DESIGN.md``)."""
        try:
            blob = self.commit(commit).tree / path
        except KeyError:
            raise HistoryError(f"commit {commit[:10]} has no {path}") from None
        return blob.data_stream.read().decode()

    def record(self, commit: str, name: str) -> dict:
        """A JSON record stored in a commit's tree under ``.vibetrain/``."""
        return json.loads(self.read(commit, f"{RECORD_DIR}/{name}"))

    def judge_report(self, commit: str) -> dict | None:
        """The judge's report kept with a candidate (``{"reasons", "checks"}``, each check with its
        details); None for a commit that kept none (validated before accepted rounds kept it)."""
        try:
            return self.record(commit, "judge.json")
        except HistoryError:
            return None

    def params(self, commit: str) -> dict:
        """The candidate's ``stack/params.json``."""
        return json.loads(self.read(commit, "stack/params.json"))

    # -- worktrees ---------------------------------------------------------------------------------
    def root(self) -> str:
        return self.repo.git.rev_list("--max-parents=0", BEST).splitlines()[0]

    def worktree(self, path: Path, parent: str) -> Path:
        """A fresh linked worktree at ``parent`` (detached HEAD)."""
        path = path.resolve()  # git runs in the repository, not here: a relative path would land there
        self.remove_worktree(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.repo.git.worktree("add", "--detach", str(path), parent)
        workspace_git.trust(path, Path(self.repo.git_dir))  # from here on, git there uses the git directory made now
        return path

    def remove_worktree(self, path: Path) -> None:
        """``path`` gone, and this repository's every registration of it: a worktree of the run's (its files
        and its entry under ``.git/worktrees``), what a killed ``git worktree add`` left of one (an entry
        locked "initializing" with no files yet, a ``.git`` link to an entry it never finished, an empty
        link), or a plain folder. A worktree of another repository is refused: two runs, one --workspaces."""
        path = path.resolve()
        workspace_git.disarm(path)  # a link the agent rewrote must not decide what is removed
        workspace_git.forget(path)
        git_dir = Path(self.repo.git_dir).resolve()
        if path.exists():
            link = path / ".git"
            named = link.read_text(errors="replace").removeprefix("gitdir:").strip() if link.is_file() else ""
            gitdir = (path / named).resolve() if named else None  # absolute, or relative to the worktree
            if gitdir is not None and gitdir.exists() and not gitdir.is_relative_to(git_dir):
                raise HistoryError(
                    f"{path} is a worktree of another run's repository ({gitdir}); give this run its own --workspaces"
                )
            workspace_git.remove_folder(path)  # a tree the agent nested thousands deep too
        for entry in self._entries_of(path):
            shutil.rmtree(entry)  # locked or not: a killed add locks it "initializing"
        self.repo.git.worktree("prune")

    def _entries_of(self, path: Path) -> list[Path]:
        """This repository's entries (``.git/worktrees/<id>``) for a worktree at ``path``: git's record of
        where each worktree is, its ``gitdir`` file (absolute, or relative to the entry)."""
        link = path.resolve() / ".git"
        return [entry for entry, linked in self._registered() if linked == link]

    def _registered(self) -> list[tuple[Path, Path]]:
        """(entry, the worktree's ``.git`` link it names, resolved) for each of this repository's worktree
        entries, wherever the worktree is."""
        return [
            (gitdir.parent, (gitdir.parent / gitdir.read_text(errors="replace").strip()).resolve())
            for gitdir in (Path(self.repo.git_dir).resolve() / "worktrees").glob("*/gitdir")
        ]

    def worktree_folders(self) -> list[Path]:
        """Where each of this repository's registered worktrees is (or was: a folder deleted by hand is
        still registered until removed)."""
        return [link.parent for _, link in self._registered()]

    def worktrees_named(self, name: str) -> list[tuple[Path, str]]:
        """(where, commit) of each of this repository's worktrees in a folder called ``name``, wherever it is:
        a run resumed from another working folder has its ``workspaces/`` elsewhere than the killed one's."""
        found = []
        for entry, link in self._registered():
            if link.parent.name == name and (head := _entry_head(entry)) is not None:
                found.append((link.parent, head))
        return found

    def adopt(self, number: int, commit: str) -> str | None:
        """Round ``number``'s ``commit`` whose ref was never written (a kill between the commit and its
        ``update-ref``), by its subject: the ref written now. None: the commit is no round ``number``'s."""
        try:
            message = self.repo.commit(commit).message
            recorded = self.record(commit, "round.json").get("round")
        except (ValueError, git.BadName, HistoryError):  # not in the repository, or no round's record
            return None
        for kind in (VALIDATED, REJECTED):
            if message.startswith(_subject_start(kind, number)) and recorded == number:
                self.repo.git.update_ref(_round_ref(kind, number), commit)
                return commit
        return None

    # -- commits -----------------------------------------------------------------------------------
    def _commit_workspace(self, workspace: Path, message: str, records: dict[str, dict]) -> str:
        """``git add -A`` and commit, through the worktree's own git directory (``workspace_git``):
        a workspace holding anything ``workspace_git.tampering`` names raises ``Tampered``."""
        records_dir = workspace / RECORD_DIR
        records_dir.mkdir(exist_ok=True)
        for name, data in records.items():
            (records_dir / name).write_text(json.dumps(data, indent=1, default=str) + "\n")
        workspace_git.run(workspace, "add", "-A")
        workspace_git.run(workspace, "commit", "--allow-empty", "-q", "-m", message)
        return workspace_git.output(workspace, "rev-parse", "HEAD")

    def commit_validated(
        self, workspace: Path, number: int, subject: str, trailers: Trailers, records: dict[str, dict], body: str = ""
    ) -> str:
        return self._commit_round(VALIDATED, workspace, number, subject, trailers, records, body)

    def commit_rejected(
        self, workspace: Path, number: int, subject: str, trailers: Trailers, records: dict[str, dict], body: str = ""
    ) -> str:
        return self._commit_round(REJECTED, workspace, number, subject, trailers, records, body)

    def _commit_round(
        self, kind: str, workspace: Path, number: int, subject: str, trailers: Trailers, records: dict, body: str
    ) -> str:
        parts = [_subject_start(kind, number) + subject, body.strip(), trailers.lines()]
        commit = self._commit_workspace(workspace, "\n\n".join(p for p in parts if p) + "\n", records)
        ref = _round_ref(kind, number)
        try:
            self.repo.git.update_ref(ref, commit)
        except git.GitCommandError as error:
            said = (error.stderr or str(error)).strip().removeprefix("stderr:").strip(" '\n")
            raise RefNotWritten(
                f"round {number} is committed ({commit[:12]}) but git could not write its ref {ref}: {said}. The "
                "commit is kept in the round's worktree: fix the repository and run again with --resume, which "
                "records the round from it"
            ) from None
        return commit

    def set_best(self, commit: str) -> None:
        """Move ``best`` (the checked-out branch) so the run directory shows the best candidate. A person who
        checked out another commit or branch there to look at it has ``best`` checked out again first: a
        reset alone moves whatever is checked out, and left ``best`` behind."""
        if self.repo.head.is_detached or self.repo.active_branch.name != BEST:
            self.repo.git.checkout("--force", "--quiet", BEST)
        self.repo.git.reset("--hard", commit)

    def stack_diff(self, commit: str, stat: bool = False) -> str:
        """What the candidate changed against its parent: the stack and its DESIGN.md, never the
        ``.vibetrain/`` bookkeeping (a round record would bury a one-line change)."""
        parents = self.commit(commit).parents
        base = parents[0].hexsha if parents else self.repo.git.hash_object("-t", "tree", "/dev/null")
        return self.repo.git.diff(*(["--stat"] if stat else []), base, commit, "--", ".", f":(exclude){RECORD_DIR}")
