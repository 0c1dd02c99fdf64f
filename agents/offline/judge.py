"""Offline judge: the harness's deterministic gate (``Session.check``: integrity scan, accuracy
checks 1-3, a system run and its audit, the parent's own checks) plus the agents' static scan: no
validation annotation left unexpanded. Candidate code runs in the sandbox, out of the harness's
process."""

from __future__ import annotations

from pathlib import Path

from agents.roles import Verdict
from skills.validation import unexpanded
from targets.harness.session import Session


class OfflineJudge:
    def __init__(self, session: Session) -> None:
        self.session = session

    def judge(self, workspace: Path, out: Path, task=None, seed: int = 0) -> Verdict:
        left = unexpanded(workspace)
        if left:
            reasons = [f"unexpanded validation annotation: {line}" for line in left]
            return Verdict(False, reasons, [{"name": "annotations", "passed": False, "reasons": reasons}])
        run = self.session.judge(workspace, out, seed=seed)
        checks = [r.as_dict() for r in run.checks]
        return Verdict(run.ok, run.reasons, checks, run if run.ok else None)
