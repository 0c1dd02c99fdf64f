"""Offline judge: the harness's deterministic gate (``Session.check``: integrity scan, accuracy
checks 1-3, a system run and its audit, the parent's own checks) plus the agents' static scans: no
validation annotation left unexpanded, a ``stack/params.json`` the search can read, and no file git
ignores. Candidate code runs in the sandbox, out of the harness's process.

Why ignored files: the round commits the workspace with ``git add -A``, which leaves out what git
ignores, and the LLM review reads the diff. A file git ignores would run in the judged candidate yet
be missing from the review and from the committed one: an importable ``stack/x.pyc``, or a
``stack/hack.py`` the candidate added to its ``.gitignore``. Bytecode caches are the exception: they
are removed before every run (``remove_bytecode_caches``), so only source ever runs."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from agents import workspace_git
from agents.roles import Verdict
from skills.validation import unexpanded
from targets.harness.judge.check_result import CheckResult
from targets.harness.measure.session import Session, remove_bytecode_caches

# What Python could import from the candidate's folder, which is on sys.path (a zip or egg once added to it).
IMPORTABLE = (".py", ".pyc", ".pyo", ".pyd", ".so", ".pth", ".zip", ".egg")
SHOWN = 50  # entries of a list the candidate sizes (ignored files, left-out diffs) shown in a check or a prompt


def first_of(items: list[str], shown: int = SHOWN) -> list[str]:
    """The first ``shown`` of ``items``, and a line saying how many more: a list the candidate sizes
    (files it adds) must not fill a check's details or a reviewer's page."""
    return items[:shown] + ([f"... {len(items) - shown} more"] if len(items) > shown else [])


TOOL_CACHES = (".pytest_cache", ".ruff_cache", ".mypy_cache", ".hypothesis")  # each ignores itself (a "*" rule)


def remove_tool_caches(workspace: Path) -> list[str]:
    """The caches an agent's own test and lint runs leave (pytest's, ruff's), removed as bytecode caches are:
    ignored, they would otherwise be refused, and no stack reads them."""
    removed = []
    for folder, subfolders, _ in os.walk(workspace):  # links are not followed
        for name in [n for n in subfolders if n in TOOL_CACHES]:
            shutil.rmtree(Path(folder) / name)
            removed.append(str((Path(folder) / name).relative_to(workspace)))
            subfolders.remove(name)
    return sorted(removed)


def ignored_files(workspace: Path) -> list[str] | None:
    """Files under ``workspace`` that git ignores (its ``.gitignore`` files, ``.git/info/exclude``,
    the global excludes), relative to it; None when it is not in a git work tree (no commit then
    leaves anything out)."""
    inside = workspace_git.run(workspace, "rev-parse", "--is-inside-work-tree", check=False)
    if inside.returncode != 0 and "not a git repository" not in inside.stderr:  # a work tree git cannot read
        raise workspace_git.GitFailed(f"git rev-parse in {workspace} failed: {inside.stderr.strip()}")
    if inside.returncode != 0 or inside.stdout.strip() != "true":
        return None
    listed = workspace_git.output(workspace, "ls-files", "-z", "--others", "--ignored", "--exclude-standard")
    return sorted(p for p in listed.split("\0") if p)


def ignore_rules(workspace: Path, paths: list[str]) -> dict[str, str]:
    """For each ignored path, the rule that ignores it (``.gitignore:3:stack/hack.py``)."""
    if not paths:
        return {}
    found = workspace_git.run(
        workspace, "check-ignore", "--verbose", "-z", "--stdin", input="\0".join(paths) + "\0", check=False
    )
    if found.returncode not in (0, 1):  # 1: none of them ignored
        raise RuntimeError(f"git check-ignore in {workspace} failed: {found.stderr.strip()}")
    fields = found.stdout.split("\0")  # source, line, pattern, path; per path
    return {fields[i + 3]: f"{fields[i]}:{fields[i + 1]}:{fields[i + 2]}" for i in range(0, len(fields) - 3, 4)}


def ignored_files_check(workspace: Path) -> CheckResult:
    """Removes the bytecode caches, then fails on every file git ignores: the judged candidate is the one a
    commit holds. Under ``stack/`` or importable beside it, the run would import it; any other, the stack could
    open it (a red team's stack read an ignored ``answers.json`` that no later round, export or review saw)."""
    removed = remove_bytecode_caches(workspace) + remove_tool_caches(workspace)
    ignored = ignored_files(workspace)
    details: dict = {"removed_bytecode_caches": removed}
    if ignored is None:
        details["ignored"] = "not in a git work tree: a commit leaves nothing out"
        return CheckResult("ignored_files", True, [], details)
    details["ignored"] = first_of(ignored)
    rules = ignore_rules(workspace, ignored[:SHOWN])
    reasons = [
        f"{path}: git ignores it ({rules.get(path, 'no rule reported')}), yet {_how_the_run_uses(path)}: the run "
        "would use a file the review and the commit never see; delete it or stop ignoring it"
        for path in ignored[:SHOWN]
    ] + ([f"... {len(ignored) - SHOWN} more files git ignores"] if len(ignored) > SHOWN else [])
    return CheckResult("ignored_files", not reasons, reasons, details)


def _how_the_run_uses(path: str) -> str:
    if path.startswith("stack/"):
        return "it lies in stack/"
    if Path(path).suffix in IMPORTABLE:
        return "the stack could import it (its folder is on sys.path)"
    return "the stack could open it"


def params_check(workspace: Path) -> CheckResult:
    """``stack/params.json`` must hold a JSON object: the search reads each validated candidate's
    techniques and settings from it (the policies, the novelty rule, a resumed run), and a validated
    candidate without them would stop the run that found it."""
    path = workspace / "stack" / "params.json"
    try:
        params = json.loads(path.read_text())
    except FileNotFoundError:
        reason = "stack/params.json is missing: the search reads each candidate's parameters from it; keep it"
        return CheckResult("params", False, [reason])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return CheckResult("params", False, [f"stack/params.json cannot be read as JSON: {error}"])
    if not isinstance(params, dict):
        reason = f"stack/params.json must hold a JSON object (its parameters by name), not a {type(params).__name__}"
        return CheckResult("params", False, [reason])
    return CheckResult("params", True)


class OfflineJudge:
    def __init__(self, session: Session) -> None:
        self.session = session

    def judge(self, workspace: Path, out: Path, task=None, seed: int = 0, context=None) -> Verdict:
        tampered = workspace_git.tampering(workspace)
        if tampered:  # refused before git, or anything else, runs there
            return Verdict.refused("workspace_git", tampered)
        checks = [ignored_files_check(workspace), params_check(workspace)]
        left = unexpanded(workspace)
        if left:
            checks.append(CheckResult("annotations", False, [f"unexpanded validation annotation: {x}" for x in left]))
        if not all(c.passed for c in checks):  # refused before anything runs
            return Verdict(checks)
        run = self.session.judge(workspace, out, seed=seed)
        return Verdict(checks + run.checks, run if run.ok else None)
