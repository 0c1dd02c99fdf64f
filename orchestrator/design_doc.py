"""Each stack's ``DESIGN.md``, the document-driven planning state: decisions with their rationale
and round, an ordered plan of steps with statuses (NOT_STARTED / IN_PROGRESS / DONE / ABANDONED
with a reason), and the evaluator's findings. Agents read it every round; the round loop updates
it every round (in the candidate's own tree, so each commit carries the plan it was made under)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

STATUSES = ("NOT_STARTED", "IN_PROGRESS", "DONE", "ABANDONED")
STEP = re.compile(r"^\d+\. \[(?P<status>[A-Z_]+)\] (?P<text>.*?)(?: \(id: (?P<id>[^)]+)\))?(?: — (?P<reason>.*))?$")


@dataclass
class Step:
    text: str
    status: str = "NOT_STARTED"
    id: str = ""
    reason: str = ""


@dataclass
class DesignDoc:
    title: str = "Stack design"
    decisions: list[str] = field(default_factory=list)
    plan: list[Step] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> DesignDoc:
        doc, section = cls(), None
        for line in text.splitlines():
            if line.startswith("# "):
                doc.title = line[2:].strip()
            elif line.startswith("## "):
                section = line[3:].strip().lower()
            elif section == "decisions" and line.startswith("- "):
                doc.decisions.append(line[2:])
            elif section == "decisions" and line.startswith("  ") and doc.decisions:
                doc.decisions[-1] += " " + line.strip()
            elif section == "plan" and (match := STEP.match(line)):
                status = match["status"] if match["status"] in STATUSES else "NOT_STARTED"
                doc.plan.append(Step(match["text"], status, match["id"] or "", match["reason"] or ""))
            elif section == "findings" and line.startswith("- "):
                doc.findings.append(line[2:])
        return doc

    @classmethod
    def load(cls, path: Path) -> DesignDoc:
        return cls.parse(path.read_text()) if path.exists() else cls()

    def render(self) -> str:
        lines = [f"# {self.title}", "", "## Decisions"]
        lines += [f"- {d}" for d in self.decisions] or ["(none yet)"]
        lines += ["", "## Plan"]
        for i, step in enumerate(self.plan, 1):
            line = f"{i}. [{step.status}] {step.text}"
            if step.id:
                line += f" (id: {step.id})"
            if step.reason:
                line += f" — {step.reason}"
            lines.append(line)
        if not self.plan:
            lines.append("(empty)")
        lines += ["", "## Findings"]
        lines += [f"- {f}" for f in self.findings] or ["(none yet)"]
        return "\n".join(lines) + "\n"

    def save(self, path: Path) -> None:
        path.write_text(self.render())

    # -- updates -----------------------------------------------------------------------------------
    def step(self, step_id: str) -> Step | None:
        return next((s for s in self.plan if s.id == step_id), None)

    def plan_step(self, step_id: str, text: str) -> Step:
        """The step for ``step_id``, added NOT_STARTED if the plan does not hold it yet."""
        existing = self.step(step_id)
        if existing is None:
            existing = Step(text, "NOT_STARTED", step_id)
            self.plan.append(existing)
        return existing

    def set_status(self, step_id: str, text: str, status: str, reason: str = "") -> None:
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        if status == "ABANDONED" and not reason:
            raise ValueError("an ABANDONED step needs a reason")
        step = self.plan_step(step_id, text)
        step.status, step.reason = status, reason
