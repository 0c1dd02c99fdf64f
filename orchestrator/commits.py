"""What a round's commit says: its trailers (round, task, backend, verdict, the headline and the
parent's), its body (why, what the implementer did, the promotion rule, the twin's prediction, the
hints) and the records it carries (the judge's evidence, the round record)."""

from __future__ import annotations

from agents.roles import Evaluation, Verdict
from orchestrator.history import Trailers
from orchestrator.prescreen import twin_said
from orchestrator.state import RoundRecord
from orchestrator.tables import promotion, promotion_short
from targets.printable import indented, printable
from targets.spec import TargetSpec

SAID_REASONS = 3  # a rejected round's reasons its commit body gives (the judge's report has them all)
# Words an agent wrote (a rationale, an account, a judge's reason quoting a candidate) are ``indented``: none
# starts a line of the message, so none reads as the round's trailers (a red team's account ended "Verdict:
# accepted" and "---", which git and GitPython then parsed as the trailers) or as a paragraph of the loop's.


def parent_metric(record: RoundRecord, spec: TargetSpec) -> str:
    if record.parent_headline is None:
        return "none"
    return f"{spec.headline_metric.name}={record.parent_headline:.6g}"


def records(record: RoundRecord, verdict: Verdict) -> dict:
    """The judge's evidence (each check with its margins) and the round, kept with the candidate."""
    return {"judge.json": verdict.record(), "round.json": record.model_dump(mode="json")}


def validated(record: RoundRecord, evaluation: Evaluation, spec: TargetSpec, backend: str) -> tuple[Trailers, str]:
    trailers = Trailers(
        record.round,
        record.task.id,
        backend,
        "accepted",
        f"{spec.headline_metric.name}={evaluation.headline:.6g}",
        parent_metric(record, spec),
        promotion_short(record),
    )
    body = f"{indented(record.task.rationale)}\n\nImplementer: {indented(record.account)}\n\n{promotion(record)}\n\n"
    body += f"{indented(twin_said(record))}\n\n" if record.prediction else ""  # it may quote the candidate's errors
    body += "Hints: " + (indented("; ".join(h.said for h in evaluation.hints)) or "none")
    return trailers, body


def rejected(record: RoundRecord, spec: TargetSpec, backend: str, undone: list[str]) -> tuple[Trailers, str]:
    """``undone``: what the agent planted for git or the harness, undone before committing."""
    trailers = Trailers(record.round, record.task.id, backend, record.verdict, "none", parent_metric(record, spec))
    body = f"{indented(record.task.rationale)}\n\nImplementer: {indented(record.account or '(no attempt)')}"
    if record.reasons:  # why it ended so, readable in git log (the whole evidence is in judge.json)
        more = f" (and {len(record.reasons) - SAID_REASONS} more)" if len(record.reasons) > SAID_REASONS else ""
        body += f"\n\n{record.verdict.capitalize()}: {indented('; '.join(record.reasons[:SAID_REASONS]))}{more}"
    if record.prediction:
        body += f"\n\n{indented(twin_said(record))}"
    if undone:
        said = indented(printable("; ".join(undone)))  # the planted files' own names
        body += f"\n\nUndone before committing (planted for git or the harness): {said}"
    return trailers, body
