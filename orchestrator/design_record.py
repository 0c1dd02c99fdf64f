"""How a round updates its stack's ``DESIGN.md`` (``skills/design_doc.py`` holds the format): every
round of the run in the plan with its status, the decision a validated round made and the evaluator's
findings, and the backlog still pending. The loop's sections are its own record, rebuilt on the parent's:
an implementer edits the file (it may), and what it wrote is kept as its notes, marked as its words (a
red team's implementer wrote a decision "Round 1: ... Measured goodput 55.1" for a rejected round 1, and
it read as the loop's)."""

from __future__ import annotations

from pathlib import Path

from orchestrator.state import RoundRecord, RunState, near_miss
from orchestrator.tables import promotion
from skills.design_doc import DesignDoc
from targets.printable import one_line
from targets.spec import TargetSpec


def status(record: RoundRecord, in_lineage: bool = True) -> tuple[str, str]:
    """DONE for a round that became best on this stack's own line (``in_lineage``: the stack descends
    from it); ABANDONED, with why, for every other."""
    if record.verdict == "accepted":
        if record.became_best and in_lineage:
            return "DONE", ""
        if record.became_best:
            return (
                "ABANDONED",
                f"round {record.round}: the best on another line, which this stack does not descend from",
            )
        inside = " (a near miss: a gain inside the noise)" if near_miss(record) else ""
        return "ABANDONED", f"round {record.round}: {promotion(record)}{inside}"
    reason = record.reasons[0] if record.reasons else record.verdict
    return "ABANDONED", f"round {record.round} {record.verdict}: {reason[:160]}"


def lineage(state: RunState, commit: str) -> set[str]:
    """The validated commits ``commit`` descends from, itself included."""
    parent_of = {r.commit: r.parent_commit for r in state.accepted() if r.commit}
    line: set[str] = set()
    while commit in parent_of and commit not in line:
        line.add(commit)
        commit = parent_of[commit]
    return line


NOTE_CHARS = 2000  # of one line an implementer wrote: its notes are for the next rounds' agents, not a store
DESIGN_BYTES = 4 << 20  # of the DESIGN.md a round leaves that is read (what is past it is no note anyone keeps)
NOTES_PER_ROUND = 50  # lines of them a round keeps (a candidate may be 256 MB, and every descendant inherits them)
NOTES_KEPT = 500  # of all rounds' notes, the newest


def update_design(
    workspace: Path, record: RoundRecord, state: RunState, spec: TargetSpec, parent_design: str | None
) -> None:
    """Every earlier round of the run in the plan, whatever its branch: a task tried more than once says
    its latest trial, except that its DONE on this stack's own line stands (the first result won before,
    and a rejected trial on one best left the step NOT_STARTED on the next, its plan's pending entry).
    ``parent_design``: the parent's ``DESIGN.md`` as committed, the record this round's is rebuilt on (None
    for a starter, whose document the library wrote)."""
    written = DesignDoc.load(workspace / "DESIGN.md", DESIGN_BYTES)  # the implementer's, as far as it is kept
    doc = written if parent_design is None else DesignDoc.parse(parent_design)
    if parent_design is not None:
        added = written.added_to(doc)
        said = [one_line(item)[:NOTE_CHARS] for item in added[:NOTES_PER_ROUND]]
        doc.notes += [f"Round {record.round}'s implementer: {item}" for item in said if item]
        if len(added) > NOTES_PER_ROUND:
            doc.notes.append(
                f"Round {record.round}'s implementer: ({len(added) - NOTES_PER_ROUND} more lines not kept)"
            )
        doc.notes = doc.notes[-NOTES_KEPT:]
    task = record.task
    line = lineage(state, record.parent_commit)
    earlier = sorted(
        (r for r in state.rounds if r.round < record.round and r.task.source != "starter"), key=lambda r: r.round
    )
    tried = state.tried()
    for trial in earlier:
        said = status(trial, trial.commit in line)
        if trial.verdict == "error" and (trial.parent_commit, trial.task.id) not in tried:  # open for its retry
            said = (
                "NOT_STARTED",
                f"round {trial.round} ended in an error, its candidate never judged: tried again",
            )
        doc.record_round(trial.round, trial.task.id, trial.task.title, *said)
    for trial in earlier:  # what this stack holds: the rounds it descends from
        if trial.commit in line:
            doc.record_round(trial.round, trial.task.id, trial.task.title, "DONE")
    decision, findings = "", []
    if record.verdict == "accepted":
        metric = spec.headline_metric.name
        parent = f" (parent {record.parent_headline:.4g})" if record.parent_headline is not None else ""
        decision = (
            f"{task.title}. Why: {task.rationale}. Change: {record.account}. "
            f"Measured {metric} {record.headline:.4g}{parent}."
        )
        findings = [f"{h.said} [{h.code}]" for h in record.hints]
    doc.record_round(record.round, task.id, task.title, *status(record), decision, findings)
    doc.plan_pending([(pending.id, pending.title) for pending in state.backlog])
    doc.save(workspace / "DESIGN.md")
