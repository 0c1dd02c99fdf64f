"""The harness's git in a round's workspace, against an agent that plants what git or the harness
would act on: a repository inside the stack, or a rewritten ``.git`` link, each carrying config that
makes git run a program; a ``.gitattributes`` that hides the change from the review's diff; a
DESIGN.md that is a link out of the workspace, which the round would write through. Each plant is
first shown to work, then the gate refuses the candidate before git touches it, the rejected commit
keeps the candidate's files with the plant undone, and the plant never took effect."""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
from pathlib import Path

import git
import pytest

from agents import workspace_git
from agents.llm.diff_page import change_of
from agents.offline.judge import OfflineJudge
from agents.roles import Task
from orchestrator.history import History, Trailers
from orchestrator.state import RoundRecord

TRAILERS = Trailers(1, "t", "offline", "rejected", "none", "none")


@pytest.fixture
def run(tmp_path) -> tuple[History, Path]:
    """A run repository with one candidate commit and a round's worktree on it."""
    history = History.create(tmp_path / "run", "vibetrain run: workspace git test")
    seed = history.worktree(tmp_path / "workspaces" / "round-0", history.root())
    (seed / "stack").mkdir()
    (seed / "stack" / "__init__.py").write_text("")
    parent = history.commit_validated(seed, 0, "starter", TRAILERS, {})
    history.remove_worktree(seed)
    return history, history.worktree(tmp_path / "workspaces" / "round-1", parent)


def test_best_moves_as_the_branch_whatever_a_person_checked_out_in_the_run(tmp_path, run):
    """A user looks at a candidate with ``git checkout`` in the run directory, then resumes: a reset alone moved
    what was checked out (their branch, a detached HEAD), left ``best`` behind and the next resume refused."""
    history, workspace = run
    first = history.best() or history.repo.commit("HEAD").hexsha
    (workspace / "stack" / "policy.py").write_text("X = 2\n")
    second = history.commit_validated(workspace, 1, "a change", TRAILERS, {})
    for look in (["--detach", first], ["-b", "mine", first]):
        history.repo.git.checkout("--quiet", *look)
        history.set_best(second)
        assert history.repo.commit("best").hexsha == second and history.repo.active_branch.name == "best"
        assert (history.path / "stack" / "policy.py").read_text() == "X = 2\n"
    assert history.repo.commit("mine").hexsha == first  # the person's branch is theirs


def test_the_run_repository_has_git_flush_its_commits_and_refs(tmp_path, monkeypatch):
    """git flushes nothing by default; the run state, flushed each round, would name commits a power loss left
    empty. A new run is told at its start, an older one when a process claims it: after the claim removed
    what a killed git left (a config.lock, which would make writing the config fail)."""
    from orchestrator import git_leftovers

    history = History.create(tmp_path / "run", "vibetrain run: durable")
    reader = history.repo.config_reader()
    assert reader.get_value("core", "fsync") == "committed,reference"
    with history.repo.config_writer() as config:  # a run made before this
        config.remove_option("core", "fsync")
    (Path(history.repo.git_dir) / "config.lock").write_text("")  # a git killed as it wrote its config
    monkeypatch.setattr(git_leftovers, "GRACE_S", 0.0)
    assert history.claim() == ["removed what a killed git left: config.lock"]
    try:
        assert history.repo.config_reader().get_value("core", "fsync") == "committed,reference"
    finally:
        history.release()


def _config_that_runs(git_dir: Path, marker: Path) -> None:
    """Config and a hook that each create ``marker`` when git runs them."""
    subprocess.run(["git", "--git-dir", str(git_dir), "config", "core.fsmonitor", f"touch {marker} #"], check=True)
    hook = git_dir / "hooks" / "pre-commit"
    hook.parent.mkdir(exist_ok=True)
    hook.write_text(f"#!/bin/sh\ntouch {marker}\n")
    hook.chmod(0o755)


def _plant_repository(workspace: Path, marker: Path) -> None:
    nested = workspace / "stack" / "x"
    nested.mkdir()
    (nested / "hidden.py").write_text("PLANTED = True\n")
    subprocess.run(["git", "init", "-q", str(nested)], check=True)
    subprocess.run(["git", "-C", str(nested), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(nested), "-c", "user.name=a", "-c", "user.email=a@b", "commit", "-qm", "x"])
    _config_that_runs(nested / ".git", marker)


def _rewrite_link(workspace: Path, marker: Path) -> None:
    fake = workspace / ".evil"  # a git directory of the agent's own, named by the link
    subprocess.run(["git", "init", "-q", "--bare", str(fake)], check=True)
    subprocess.run(["git", "--git-dir", str(fake), "config", "core.bare", "false"], check=True)
    _config_that_runs(fake, marker)
    (workspace / ".git").write_text(f"gitdir: {fake}\n")


def _real(workspace: Path, marker: Path) -> None:
    """The plant works: plain git, as the harness ran it, in a copy of the workspace runs the agent's
    program."""
    copy = workspace.parent / "copy"
    subprocess.run(["cp", "-a", str(workspace), str(copy)], check=True)
    if "/worktrees/" in (copy / ".git").read_text():  # the round's own link: a repository of the copy's own
        (copy / ".git").unlink()  # instead, so the copy's git never touches the round's index or HEAD
        subprocess.run(["git", "init", "-q", str(copy)], check=True)
    for command in (["add", "-A"], ["status"]):  # what the harness runs: the review's diff, the round's commit
        subprocess.run(["git", "-C", str(copy), *command], capture_output=True)
    subprocess.run(["git", "-C", str(copy), "-c", "user.name=a", "-c", "user.email=a@b", "commit", "-qm", "c"])
    assert marker.exists(), "the plant did not make plain git run its program"
    marker.unlink()


@pytest.mark.parametrize(
    "plant, reason",
    [
        (_plant_repository, "stack/x/.git: a git repository inside the candidate"),
        (_rewrite_link, ".git: the worktree's link to its git directory was changed"),
    ],
)
def test_planted_git_metadata_is_refused_and_its_program_never_runs(run, tmp_path, plant, reason):
    history, workspace = run
    marker = tmp_path / "ran"
    (workspace / "stack" / "model.py").write_text("VALUE = 1\n")
    plant(workspace, marker)
    _real(workspace, marker)

    verdict = OfflineJudge(session=None).judge(workspace, tmp_path / "judge")  # refused before anything runs
    assert not verdict.passed and verdict.checks[0].name == "workspace_git"
    assert verdict.reasons[0].startswith(f"workspace_git: {reason}")
    with pytest.raises(workspace_git.Tampered, match=re.escape(reason)):
        workspace_git.run(workspace, "status")

    undone = workspace_git.disarm(workspace)  # as the round's reject does, before it writes or commits
    commit = history.commit_rejected(workspace, 1, "a task", TRAILERS, {"judge.json": {"reasons": verdict.reasons}})
    tree = git.Repo(history.path).commit(commit).tree
    assert (tree / "stack" / "model.py").data_stream.read() == b"VALUE = 1\n"  # the candidate's files, as evidence
    if plant is _plant_repository:  # its files, not a gitlink: the code is in the commit
        assert (tree / "stack" / "x" / "hidden.py").mode == 0o100644 and "removed stack/x/.git" in undone
    else:
        assert "restored .git" in undone
    history.remove_worktree(workspace)  # the link it rewrote does not decide what is removed
    assert not workspace.exists() and not marker.exists()


def test_a_file_among_the_runs_records_is_refused(run, tmp_path):
    """The review's diff and ``vibetrain show`` leave ``.vibetrain/`` out (the run's records), yet a file the
    agent put there was committed with the candidate: code the reviewer never saw. Only the two records may
    be there."""
    history, workspace = run
    (workspace / ".vibetrain").mkdir(exist_ok=True)
    (workspace / ".vibetrain" / "round.json").write_text("{}")  # the parent's record: the harness's, rewritten
    assert workspace_git.tampering(workspace) == []
    (workspace / ".vibetrain" / "cache.py").write_text("import gc\n")
    verdict = OfflineJudge(session=None).judge(workspace, tmp_path / "judge")
    assert not verdict.passed and verdict.reasons == [
        "workspace_git: .vibetrain/cache.py: a file among the run's records (.vibetrain/), which the review's diff "
        "leaves out; put it in stack/"
    ]
    workspace_git.disarm(workspace)  # as a rejection does before it commits
    assert not (workspace / ".vibetrain" / "cache.py").exists()


def test_what_an_agent_writes_in_the_runs_records_never_reaches_the_judged_copy(run, tmp_path):
    """A red team wrote a payload into ``.vibetrain/judge.json`` (one of the two records a workspace may hold)
    and had its stack read it at run time: the review's diff leaves the records out, and the commit rewrote the
    file with the harness's own, so the code the judged run read was never seen or kept. The frozen copy (what
    is judged, measured and committed) takes no records from the workspace: the commit writes them."""
    history, workspace = run
    (workspace / ".vibetrain").mkdir(exist_ok=True)
    (workspace / ".vibetrain" / "judge.json").write_text('{"payload": "the reviewer never saw it"}')
    frozen = history.worktree(tmp_path / "workspaces" / "round-1-judged", history.root())
    assert workspace_git.copy_candidate(workspace, frozen) == []
    assert not (frozen / ".vibetrain").exists() and (frozen / "stack" / "__init__.py").exists()


def test_a_file_where_the_runs_records_go_is_refused_and_undone(run, tmp_path):
    """A ``.vibetrain`` that is a file passed the gate, and the commit could not write the records there
    (``FileExistsError``): the rejection was never committed, so its evidence was lost and the task retried."""
    history, workspace = run
    (workspace / ".vibetrain").write_text("not a folder")
    assert workspace_git.tampering(workspace) == [
        ".vibetrain: a file among the run's records (.vibetrain/), which the review's diff leaves out; put it in stack/"
    ]
    assert workspace_git.disarm(workspace) == ["removed .vibetrain"]
    assert history.commit_rejected(workspace, 1, "planted", TRAILERS, {"judge.json": {"reasons": ["x"]}})


def test_a_gitattributes_that_hides_the_change_from_the_review_is_refused(run, tmp_path):
    history, workspace = run
    (workspace / "stack" / "model.py").write_text("SKIP_TRAINING_WHEN_MEASURED = True\n")
    (workspace / ".gitattributes").write_text("stack/*.py -diff\n")
    subprocess.run(["git", "-C", str(workspace), "add", "-A"], check=True)  # plain git, as before
    shown = subprocess.run(["git", "-C", str(workspace), "diff", "--cached", "HEAD"], capture_output=True, text=True)
    assert "Binary files" in shown.stdout and "SKIP_TRAINING" not in shown.stdout  # the plant is real
    verdict = OfflineJudge(session=None).judge(workspace, tmp_path / "judge")
    assert not verdict.passed and verdict.reasons[0].startswith("workspace_git: .gitattributes: a git control file")
    assert workspace_git.disarm(workspace) == ["removed .gitattributes"]
    diff = change_of(workspace).diff  # the review's diff, once the plant is undone
    assert "+SKIP_TRAINING_WHEN_MEASURED = True" in diff


def test_the_round_never_writes_through_a_link_the_agent_planted(tmp_path, fast_target):
    """DESIGN.md as a link to a file outside: the round's reject writes the design record, and would
    have written it there; the link is undone first and the file outside keeps its bytes."""
    from orchestrator.config import RunConfig
    from orchestrator.runs import run_workspaces, start_run

    config = RunConfig(rounds=1, max_attempts=1, repeat=1, sandbox="auto", time_limit_s=300)
    loop = start_run(str(fast_target), tmp_path / "run", config, lambda kind, **data: None, tmp_path / "ws", True)
    outside = tmp_path / "bashrc"
    outside.write_text("# the user's own\n")
    workspace = loop.history.worktree(
        run_workspaces(tmp_path / "ws", tmp_path / "run") / "round-1", loop.history.root()
    )
    (workspace / "DESIGN.md").symlink_to(outside)
    verdict = OfflineJudge(session=None).judge(workspace, tmp_path / "judge")
    assert not verdict.passed and verdict.reasons[0].startswith("workspace_git: DESIGN.md: a symbolic link")
    task = Task(id="t", title="a task", rationale="why")
    record = RoundRecord(round=1, task=task, parent_round=None, parent_commit=loop.history.root(), verdict="error")
    loop.reject(record, workspace, verdict)
    assert outside.read_text() == "# the user's own\n"
    commit = git.Repo(tmp_path / "run").commit(record.commit)
    assert (commit.tree / "DESIGN.md").mode == 0o100644 and "removed DESIGN.md" in commit.message


def test_an_untouched_workspace_commits_through_its_own_git_directory(run):
    history, workspace = run
    (workspace / "stack" / "model.py").write_text("VALUE = 2\n")
    assert workspace_git.tampering(workspace) == []
    assert "stack/model.py" in workspace_git.output(workspace, "status", "--porcelain")
    commit = history.commit_validated(workspace, 1, "a task", TRAILERS, {})
    assert history.read(commit, "stack/model.py") == "VALUE = 2\n"


# -- the frozen copy, against an agent still writing while it is made -----------------------------


def test_the_frozen_copy_refuses_what_changes_under_it_and_never_follows_a_link(tmp_path, run, monkeypatch):
    """An agent's process swaps a folder for a link to a folder outside (``~/.ssh``, say) between the
    copy's look at it and its open, plants a FIFO (a read would block) and links: the copy reads and writes
    nothing outside, names each, keeps links as links, and the files copied are the agent's."""
    history, workspace = run
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "authorized_keys").write_text("SECRET\n")
    (workspace / "stack" / "d").mkdir()
    (workspace / "stack" / "d" / "authorized_keys").write_text("the agent's own\n")
    (workspace / "stack" / "policy.py").write_text("X = 1\n")
    (workspace / "stack" / "exe.sh").write_text("#!/bin/sh\n")
    (workspace / "stack" / "exe.sh").chmod(0o755)
    os.mkfifo(workspace / "stack" / "pipe")
    (workspace / "stack" / "out").symlink_to(outside)
    opened = os.open

    def swapping(name, flags, *args, **kwargs):
        here = workspace / "stack" / "d"
        if name == "d" and here.is_dir() and not here.is_symlink():
            shutil.rmtree(here)  # the agent's process, between the copy's look at "d" and its open
            here.symlink_to(outside)
        return opened(name, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", swapping)
    frozen = history.worktree(tmp_path / "workspaces" / "round-1-judged", history.root())
    refused = workspace_git.copy_candidate(workspace, frozen)
    monkeypatch.undo()
    assert any(r.startswith("stack/d: changed while the harness copied it") for r in refused), refused
    assert any(r.startswith("stack/pipe: a special file") for r in refused), refused
    assert not (frozen / "stack" / "d").exists() and (outside / "authorized_keys").read_text() == "SECRET\n"
    assert (frozen / "stack" / "out").is_symlink() and os.readlink(frozen / "stack" / "out") == str(outside)
    assert (frozen / "stack" / "policy.py").read_text() == "X = 1\n"
    assert os.access(frozen / "stack" / "exe.sh", os.X_OK)
    assert any("symbolic link" in reason for reason in workspace_git.tampering(frozen))  # the gate names it


def test_the_frozen_copy_stops_at_its_size_limit(tmp_path, run, monkeypatch):
    history, workspace = run
    monkeypatch.setattr(workspace_git, "MAX_CANDIDATE_BYTES", 1000)
    (workspace / "stack" / "a.py").write_text("A = 1\n")
    (workspace / "stack" / "z.bin").write_bytes(b"\0" * 5000)
    frozen = history.worktree(tmp_path / "workspaces" / "round-1-judged", history.root())
    refused = workspace_git.copy_candidate(workspace, frozen)
    assert refused == ["stack/z.bin: the candidate passes 0 MiB here"]
    assert (frozen / "stack" / "a.py").exists() and not (frozen / "stack" / "z.bin").exists()


def test_a_full_disk_during_the_frozen_copy_is_the_runs_error_not_the_candidates(tmp_path, run, monkeypatch):
    """A copy the harness's disk refuses (full, over quota, read-only, failing) raises: named as a file the
    agent changed, it made the round a rejection and gave up its task for the rest of the run."""
    history, workspace = run
    (workspace / "stack" / "a.py").write_text("A = 1\n")
    frozen = history.worktree(tmp_path / "workspaces" / "round-1-judged", history.root())

    def full(path, mode="r", *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(workspace_git, "open", full, raising=False)  # the module's name before the builtin
    with pytest.raises(OSError) as raised:
        workspace_git.copy_candidate(workspace, frozen)
    assert raised.value.errno == errno.ENOSPC


def test_folders_nested_thousands_deep_are_named_never_a_crash(tmp_path, run):
    """An agent's ``for i in $(seq 1500); do mkdir d && cd d; done``: every recursive walk (the tampering
    check, the frozen copy, the worktree's removal) raised RecursionError, which ended the run, and its
    --resume met it again. Refused by name past 64, copied to there, and removed however deep."""
    history, workspace = run
    # the same folders made in one call (the loop's 1,500 ever deeper lookups took 23 s of kernel time here)
    subprocess.run(["mkdir", "-p", "/".join(["d"] * 1500)], cwd=workspace / "stack", check=True)
    try:
        deep = "stack/" + "/".join(["d"] * 63)
        assert f"{deep}: folders nested 64 deep in the candidate; flatten it" in workspace_git.tampering(workspace)
        frozen = history.worktree(tmp_path / "workspaces" / "round-1-judged", history.root())
        assert workspace_git.copy_candidate(workspace, frozen) == [f"{deep}: folders nested 64 deep, not copied"]
        history.remove_worktree(workspace)
        history.remove_worktree(frozen)
        assert not workspace.exists() and not frozen.exists()
    finally:  # else pytest's own clean-up of old temp folders (shutil.rmtree) meets it in a later session
        subprocess.run(["rm", "-rf", str(workspace / "stack" / "d")], check=True)


def test_folders_of_long_names_are_named_and_removed_never_a_crash(tmp_path, run):
    """A red team's twenty nested folders of 250-character names: the tampering check's walk by path raised
    ENAMETOOLONG, the worktree was never removed, and --resume stopped on it. Named past 2048 bytes, removed."""
    history, workspace = run
    folder = os.open(workspace / "stack", os.O_RDONLY)
    for _ in range(20):  # each made in the last, opened: no path names the deepest (it passes PATH_MAX)
        os.mkdir("x" * 250, dir_fd=folder)
        inner = os.open("x" * 250, os.O_RDONLY, dir_fd=folder)
        os.close(folder)
        folder = inner
    os.close(folder)
    said = workspace_git.tampering(workspace)
    assert any(reason.startswith("stack/xxx") and "passes 2048 bytes; shorten it" in reason for reason in said), said
    history.remove_worktree(workspace)
    assert not workspace.exists()


def test_a_round_that_meets_a_bug_keeps_its_traceback_and_the_run_goes_on(tmp_path, fast_target):
    """One round's failure never stops the run; its record says what and where (the traceback, kept once
    the round has ended: it was in the round's outputs, removed with them): a bug in an agent or the loop
    would otherwise look like any failed candidate."""
    from orchestrator.config import RunConfig
    from orchestrator.runs import start_run

    config = RunConfig(rounds=1, max_attempts=1, repeat=1, sandbox="subprocess", time_limit_s=300)
    loop = start_run(str(fast_target), tmp_path / "run", config, lambda kind, **data: None, tmp_path / "ws", True)

    class Broken:
        def implement(self, *args, **kwargs):
            raise TypeError("planted: an agent's bug")

    loop.agents.implementer = Broken()
    task = Task(id="t", title="a task", rationale="why")
    record = loop.round(1, None, task, loop.budget.snapshot())
    loop.finish_round(record)
    assert record.verdict == "error" and record.reasons[0].startswith("TypeError: planted: an agent's bug (traceback: ")
    saved = Path(record.reasons[0].split("(traceback: ")[1].rstrip(")")).read_text()
    assert "Traceback (most recent call last)" in saved and "def implement" not in saved and "in implement" in saved
