"""Each stack's ``DESIGN.md``, the document-driven planning state: decisions with their rationale
and round, an ordered plan of steps with statuses (NOT_STARTED / IN_PROGRESS / DONE / ABANDONED
with a reason), and the evaluator's findings. Agents read it every round; the round loop updates
it every round (in the candidate's own tree, so each commit carries the plan it was made under). What an
implementer writes in it is kept under Notes, each line marked as its round's implementer's words: the
other sections are the loop's record alone.
The starter's first version and the rules a round updates it by live here with the format."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from targets.printable import one_line

NOTES = "Notes (the implementers' own words, unchecked)"
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
    notes: list[str] = field(default_factory=list)  # the implementers' own words, each with its round

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
            elif line.strip() and line.strip() not in ("(none yet)", "(empty)"):  # notes, or what an agent added
                doc.notes.append(line.removeprefix("- "))
        return doc

    def added_to(self, record: DesignDoc) -> list[str]:
        """What this document (an implementer's edit of ``record``) holds that ``record`` does not: its new
        decisions, plan steps, findings and notes (a line outside the sections is a note), in its order."""
        known = {*record.decisions, *(s.text for s in record.plan), *record.findings, *record.notes}
        return [
            item
            for item in (*self.decisions, *(s.text for s in self.plan), *self.findings, *self.notes)
            if item not in known
        ]

    @classmethod
    def starter(cls, controller: str, params: dict) -> DesignDoc:
        """Round 0's document: the starter's decision and a plan holding its one done step."""
        decision = (
            f"Round 0: controller `{controller}` with parameters `{json.dumps(params)}`. Starter stack written from "
            "the recipes in `skills/recipes` (paged-KV engine with continuous batching, FSDP2 GRPO trainer with "
            "float32 master weights, weight sync by placement, one coroutine per episode, group buffer with the "
            "staleness bound; a local cluster on one device, Ray otherwise)."
        )
        return cls(decisions=[decision], plan=[Step("Starter stack.", "DONE")])

    @classmethod
    def load(cls, path: Path, max_bytes: int | None = None) -> DesignDoc:
        """``path``'s document (an empty one where there is none); ``max_bytes``: read no further, a line cut
        there dropped (an implementer's file may be as large as its candidate)."""
        if not path.exists():
            return cls()
        with path.open("rb") as file:
            text = file.read(-1 if max_bytes is None else max_bytes)
        if max_bytes is not None and len(text) == max_bytes:  # cut: its last line is a part of one
            text = text[: text.rfind(b"\n") + 1]
        return cls.parse(text.decode(errors="replace"))

    def render(self) -> str:
        """Every entry on one line (a reason quoting a traceback, an account of several lines): read back by
        ``parse`` as it was, never as entries or notes of their own."""
        lines = [f"# {one_line(self.title)}", "", "## Decisions"]
        lines += [f"- {one_line(d)}" for d in self.decisions] or ["(none yet)"]
        lines += ["", "## Plan"]
        for i, step in enumerate(self.plan, 1):
            # a step's text never holds what ends it in ``STEP`` (a title's " — " took the id into the reason)
            text = one_line(step.text).replace(" — ", " - ").replace("(id: ", "(id ")
            line = f"{i}. [{step.status}] {text}"
            if step.id:
                line += f" (id: {step.id})"
            if step.reason:
                line += f" — {one_line(step.reason)}"
            lines.append(line)
        if not self.plan:
            lines.append("(empty)")
        lines += ["", "## Findings"]
        lines += [f"- {one_line(f)}" for f in self.findings] or ["(none yet)"]
        if self.notes:
            lines += ["", f"## {NOTES}", "", *(f"- {one_line(note)}" for note in self.notes)]
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

    def record_round(
        self,
        number: int,
        step_id: str,
        title: str,
        status: str,
        reason: str = "",
        decision: str = "",
        findings: list[str] = (),
    ) -> None:
        """One round's outcome: its plan step's status (round 0's step is the starter's), the decision
        an accepted round made, and the evaluator's findings on it."""
        if number > 0:
            self.set_status(step_id, title, status, reason)
        if decision:
            self.decisions.append(f"Round {number}: {decision}")
        self.findings += [f"Round {number}: {finding}" for finding in findings]

    def plan_pending(self, steps: list[tuple[str, str]]) -> None:
        """Steps still to try, as (id, title), appended NOT_STARTED unless the plan holds them."""
        for step_id, title in steps:
            self.plan_step(step_id, title)
