"""The facts an LLM role's prompt is rendered from (its context pack): a map of the candidate's files,
the skills index, the previous attempt's diff stat, the parent's measurement against the noise rule,
and what the execution mode can and cannot show. One function per fact, so each template takes what
its role needs."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from agents import workspace_git
from agents.roles import RoundContext
from skills.library import load_skills
from targets.harness.judge.integrity import MAX_SOURCE_BYTES
from targets.spec import TargetSpec

SIMULATED = (
    "simulated: the candidate's controller runs on the cluster simulator in virtual time; the simulator "
    "models placement, scheduling, switching and the parameters marked simulated, from a cost model of the "
    "target's model and hardware. Edits to the engine, the trainer or the model code cannot move the "
    "metric here: change the controller and its parameters."
)
REAL = (
    "real: the candidate runs on the target's devices; engine, trainer, weight sync and controller all "
    "count, and the judge replays training and checks the engine against the reference."
)


@dataclass
class FileEntry:
    path: str
    lines: int
    about: str  # the module docstring's first line


def file_map(workspace: Path) -> list[FileEntry]:
    """Every file of the candidate's ``stack/``, with its size in lines and what it says it is."""
    entries = []
    if (workspace / "stack").is_symlink():  # the host's folder it names would be listed, quoted (the gate refuses it)
        return entries
    for path in sorted((workspace / "stack").rglob("*")):
        if path.is_symlink() or not path.is_file() or "__pycache__" in path.parts:
            continue  # a link is not followed: it may point out of the workspace
        if (size := path.stat().st_size) > MAX_SOURCE_BYTES:  # its parse would take ~600 times that in memory
            entries.append(FileEntry(str(path.relative_to(workspace)), 0, f"({size} bytes: too large to read)"))
            continue
        text = path.read_text(errors="replace")
        about = _docstring_line(text) if path.suffix == ".py" else ""
        entries.append(FileEntry(str(path.relative_to(workspace)), len(text.splitlines()), about[:110]))
    return entries


def _docstring_line(source: str) -> str:
    try:
        docstring = ast.get_docstring(ast.parse(source)) or ""
    except SyntaxError as error:
        return f"(does not compile: {error.msg} at line {error.lineno})"
    return docstring.strip().splitlines()[0] if docstring.strip() else ""


def skills_index() -> list[tuple[str, str, str]]:
    """(name, kind, what it does) of every skill: the model reads the ones it needs with read_skill."""
    index = []
    for skill in load_skills().values():
        title = skill.text.strip().splitlines()[0] if skill.text.strip() else ""
        index.append((skill.name, skill.kind, title.lstrip("# ").split(" — ", 1)[-1][:100]))
    return index


def diff_stat(workspace: Path) -> str:
    """What the workspace changed since its parent commit (the previous attempts' edits stay); in a
    workspace git must not run in, why (the judge refuses it for the same reasons)."""
    reasons = workspace_git.tampering(workspace)
    if reasons:
        return "git cannot be run in this workspace: " + "; ".join(reasons)
    stat = workspace_git.output(workspace, "diff", "--no-ext-diff", "--stat", "HEAD", "--", "stack", "DESIGN.md")
    untracked = workspace_git.output(workspace, "ls-files", "--others", "--exclude-standard", "--", "stack")
    return "\n".join(filter(None, [stat, *(f"{p} (new)" for p in untracked.splitlines())])) or "(no change yet)"


def parent_lines(spec: TargetSpec, context: RoundContext | None) -> list[str]:
    """The parent's metrics with their spread, headline first."""
    if context is None or not context.parent_metrics:
        return []
    headline = spec.headline_metric.name
    names = [headline] + sorted(k for k in context.parent_metrics if k != headline)
    lines = []
    for name in names:
        value = context.parent_metrics.get(name)
        if not isinstance(value, (int, float)):
            continue
        spread = context.parent_spread.get(name)
        lines.append(f"{name}: {value:.4g}" + (f" (spread {spread:.3g})" if isinstance(spread, (int, float)) else ""))
    return lines


def budget_line(accounting, max_turns: int) -> str:
    """The turns this attempt has and what is left of the run's LLM budget."""
    parts = [f"{max_turns} turns for this attempt"]
    if accounting is not None and accounting.max_cost is not None:
        left = accounting.max_cost - accounting.run_cost()
        parts.append(f"${left:.2f} of the run's ${accounting.max_cost:g} left")
    if accounting is not None and accounting.max_tokens is not None:
        left = accounting.max_tokens - accounting.run_tokens()
        parts.append(f"{left} of the run's {accounting.max_tokens} tokens left")
    return "; ".join(parts)


def mode_text(context: RoundContext | None, spec: TargetSpec) -> str:
    simulated = context.simulated if context is not None else spec.execution == "simulated"
    return SIMULATED if simulated else REAL
