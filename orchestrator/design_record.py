"""How a round updates its stack's ``DESIGN.md`` (``skills/design_doc.py`` holds the format): every
round of the run in the plan with its status, the decision a validated round made and the evaluator's
findings, and the backlog still pending."""

from __future__ import annotations

from pathlib import Path

from orchestrator.state import RoundRecord, RunState, near_miss
from orchestrator.tables import promotion
from skills.design_doc import DesignDoc
from targets.spec import TargetSpec


def status(record: RoundRecord) -> tuple[str, str]:
    """DONE for a round that became best; ABANDONED, with why, for every other."""
    if record.verdict == "accepted":
        if record.became_best:
            return "DONE", ""
        inside = " (a near miss: a gain inside the noise)" if near_miss(record) else ""
        return "ABANDONED", f"round {record.round}: {promotion(record)}{inside}"
    reason = record.reasons[0] if record.reasons else record.verdict
    return "ABANDONED", f"round {record.round} {record.verdict}: {reason[:160]}"


def update_design(workspace: Path, record: RoundRecord, state: RunState, spec: TargetSpec) -> None:
    doc = DesignDoc.load(workspace / "DESIGN.md")
    task = record.task
    for earlier in state.rounds:  # the plan carries every round of the run, whatever its branch
        if not doc.step(earlier.task.id) and earlier.task.source != "starter":
            doc.record_round(earlier.round, earlier.task.id, earlier.task.title, *status(earlier))
    decision, findings = "", []
    if record.verdict == "accepted":
        metric = spec.headline_metric.name
        parent = f" (parent {record.parent_headline:.4g})" if record.parent_headline is not None else ""
        decision = (
            f"{task.title}. Why: {task.rationale}. Change: {record.account}. "
            f"Measured {metric} {record.headline:.4g}{parent}."
        )
        findings = [f"{h.message} [{h.code}]" for h in record.hints]
    doc.record_round(record.round, task.id, task.title, *status(record), decision, findings)
    doc.plan_pending([(pending.id, pending.title) for pending in state.backlog])
    doc.save(workspace / "DESIGN.md")
