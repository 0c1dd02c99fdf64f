"""Offline implementer: composes the stack from the skills library. It refreshes the recipe modules
a task names, with the recipe modules they import (a module newer than the stack's copy may need a
module the stack predates: ``fsdp_trainer`` and ``rendezvous``), applies the task's parameter
changes to ``params.json`` (checked against the skills' ranges), expands every validation
annotation, and records the decision in ``DESIGN.md``. Given the judge's feedback from a failed
attempt, it restores every recipe module from the library (the repair it knows) before applying the
task again; where that changes nothing, it says so (``NothingToRepair``) and the round ends on the
verdict it has, rather than judging the same candidate twice."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

from agents.offline.planner import OfflinePlanner
from agents.roles import AgentError, Attempt, Hint, NothingToRepair, Task
from skills.library import load_skills
from skills.starter import RECIPES, with_params, write_starter
from skills.validation import expand_file
from targets.spec import TargetSpec


class ImplementationError(AgentError):
    """The task cannot be carried out as written (the message says why)."""


class OfflineImplementer:
    def __init__(self, spec: TargetSpec, planner: OfflinePlanner) -> None:
        self.spec, self.planner = spec, planner
        self.skills = load_skills()

    def implement(
        self, task: Task, workspace: Path, feedback: list[str], hints: list[Hint] = (), context=None
    ) -> Attempt:
        stack = workspace / "stack"
        as_judged = _files(stack) if feedback else None  # the candidate the judge just rejected
        if task.source == "starter":  # a complete starter candidate, written afresh on every attempt
            controller, given = task.changes["controller"], {k: v for k, v in task.changes.items() if k != "controller"}
            params = with_params(self.spec, controller, given, f"task {task.id}", self.planner.engine_devices)
            write_starter(workspace, self.spec, controller, params, replace=True)
            if feedback and _files(stack) == as_judged:
                raise NothingToRepair("the starter is written from the library: it would be the one just rejected")
            return Attempt(f"starter stack with the {controller} controller", ["stack/", "DESIGN.md"])
        if not (stack / "params.json").exists():
            raise ImplementationError(f"{workspace} holds no stack/params.json: not a candidate workspace")
        changed: list[str] = []
        modules = {self.skills[name].recipe for name in task.skills if name in self.skills}
        unknown = [name for name in task.skills if name not in self.skills]
        if unknown:
            raise ImplementationError(f"task {task.id} names unknown skills {unknown}; known: {sorted(self.skills)}")
        if feedback:  # the repair it knows: every module back to the library's version
            modules |= {p.name for p in RECIPES.glob("*.py") if p.name != "__init__.py"}
        for module in sorted(recipe_imports(modules)):
            before = (stack / module).read_bytes() if (stack / module).exists() else None
            shutil.copy2(RECIPES / module, stack / module)
            expand_file(stack / module, workspace)
            if (stack / module).read_bytes() != before:
                changed.append(f"stack/{module}")
        parent = json.loads((stack / "params.json").read_text())
        params = dict(parent)
        for name, value in task.changes.items():
            if not self.planner.legal(name, value, task.skills):
                raise ImplementationError(f"task {task.id}: {name}={value!r} is outside its range on this target")
            params[name] = value
        before = set(self.planner.stranded(parent))
        stranded = [name for name in self.planner.stranded(params) if name not in before]  # what this task strands
        if stranded:  # a technique its controller never reads, or without what it requires: on in name only
            raise ImplementationError(f"task {task.id}: {', '.join(stranded)} cannot run with these parameters")
        (stack / "params.json").write_text(json.dumps(params, indent=2) + "\n")
        changed.append("stack/params.json")
        for path in sorted(stack.glob("*.py")):
            if expand_file(path, workspace):
                changed.append(f"stack/{path.name}")
        if feedback and _files(stack) == as_judged:
            raise NothingToRepair(
                "the offline implementer's one repair, the library's recipes and the task's parameters, changes "
                "nothing here: the judge would see the candidate it just rejected"
            )
        summary = f"{task.title} ({', '.join(f'{k}={v}' for k, v in task.changes.items()) or 'no parameter change'})"
        if feedback:
            summary += "; restored every recipe module from the library after the judge's feedback"
        return Attempt(summary, sorted(set(changed)))


def recipe_imports(modules: set[str]) -> set[str]:
    """``modules`` and every recipe module they import, transitively (``from .name import ...``)."""
    closure, pending = set(), list(modules)
    while pending:
        module = pending.pop()
        if module in closure:
            continue
        closure.add(module)
        tree = ast.parse((RECIPES / module).read_text(), filename=module)
        pending += [
            f"{node.module}.py"
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
        ]
    return closure


def _files(stack: Path) -> dict[str, bytes]:
    """The stack's files by path (compiled caches aside): what a repair would have to change."""
    return {
        str(path.relative_to(stack)): path.read_bytes()
        for path in sorted(stack.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }  # no stack (a starter's first attempt): none
