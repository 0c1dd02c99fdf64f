"""Offline judge: the harness's deterministic gate (``vibetrain check``: integrity scan, accuracy
checks 1-3, a system run and its audit) plus the agents' own static scan: no validation annotation
left unexpanded. Candidate code runs in the sandbox."""

from __future__ import annotations

from pathlib import Path

from agents.roles import Verdict
from agents.sandbox import Sandbox
from skills.validation import unexpanded
from targets.harness.candidate import Limits
from targets.harness.judge_run import check_candidate
from targets.spec import TargetSpec


class OfflineJudge:
    def __init__(self, target: str, spec: TargetSpec, sandbox: Sandbox, limits: Limits, simulated: bool = False) -> None:
        self.target, self.spec, self.sandbox, self.limits = target, spec, sandbox, limits
        self.execution = "simulated" if simulated else "real"

    def judge(self, workspace: Path, out: Path, task=None) -> Verdict:
        left = unexpanded(workspace)
        if left:
            reasons = [f"unexpanded validation annotation: {line}" for line in left]
            return Verdict(False, reasons, [{"name": "annotations", "passed": False, "reasons": reasons}])
        results = check_candidate(self.target, self.spec, workspace, self.limits, out=out, launcher=self.sandbox.launcher,
                                  execution=self.execution)
        reasons = [f"{r.name}: {reason}" for r in results if not r.passed for reason in r.reasons]
        checks = [{"name": r.name, "passed": r.passed, "reasons": r.reasons, "details": r.details} for r in results]
        ran = (out / "trace.jsonl").exists()
        return Verdict(all(r.passed for r in results), reasons, checks, out if ran else None)
