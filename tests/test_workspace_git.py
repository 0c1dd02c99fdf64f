"""The harness's git in a round's workspace, against an agent that plants git metadata: a repository
inside the stack, or a rewritten ``.git`` link, each carrying config that makes git run a program.
Each plant is first shown to work on plain git (the program runs), then the gate refuses the
candidate before git touches it, the rejected commit keeps the candidate's files with the plant
undone, and the program never ran."""

from __future__ import annotations

import subprocess
from pathlib import Path

import git
import pytest

from agents import workspace_git
from agents.offline.judge import OfflineJudge
from orchestrator.history import History, Trailers

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
    assert not verdict.passed and verdict.checks[0]["name"] == "workspace_git"
    assert verdict.reasons[0].startswith(f"workspace_git: {reason}")
    with pytest.raises(workspace_git.Tampered, match=reason.split(":")[0]):
        workspace_git.run(workspace, "status")

    commit = history.commit_rejected(workspace, 1, "a task", TRAILERS, {"judge.json": {"reasons": verdict.reasons}})
    tree = git.Repo(history.path).commit(commit).tree
    assert (tree / "stack" / "model.py").data_stream.read() == b"VALUE = 1\n"  # the candidate's files, as evidence
    if plant is _plant_repository:  # its files, not a gitlink: the code is in the commit
        assert (tree / "stack" / "x" / "hidden.py").mode == 0o100644
    message = git.Repo(history.path).commit(commit).message
    assert "Undone before committing" in message
    history.remove_worktree(workspace)  # the link it rewrote does not decide what is removed
    assert not workspace.exists() and not marker.exists()


def test_an_untouched_workspace_commits_through_its_own_git_directory(run):
    history, workspace = run
    (workspace / "stack" / "model.py").write_text("VALUE = 2\n")
    assert workspace_git.tampering(workspace) == []
    assert "stack/model.py" in workspace_git.output(workspace, "status", "--porcelain")
    commit = history.commit_validated(workspace, 1, "a task", TRAILERS, {})
    assert history.read(commit, "stack/model.py") == "VALUE = 2\n"
