"""``vibetrain check``: every deterministic gate on one candidate directory, in order —
integrity scan, accuracy checks 1-3 (child process), a system run (child process) and its audit."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

from safetensors.torch import load_file

from targets.harness.accuracy import CheckResult
from targets.harness.audit import audit_run
from targets.harness.candidate import run_candidate
from targets.harness.integrity import scan_stack
from targets.harness.model import load_model, model_dir
from targets.harness.trace import Trace
from targets.spec import TargetSpec


def audit_directory(spec: TargetSpec, out: Path, steps: int) -> CheckResult:
    events = Trace.load_events(out / "trace.jsonl")
    base = load_model(model_dir(spec.model), spec.model.dtype)

    def load_weights(version: int):
        path = out / "weights" / f"v{version}.safetensors"
        return load_file(path) if path.exists() else None

    def make_model(state):
        model = copy.deepcopy(base)
        model.load_state_dict(state)
        return model

    return audit_run(spec, events, load_weights, make_model, steps)


def check_candidate(target: str, spec: TargetSpec, stack_dir: Path, time_limit_s: float, out: Path | None = None) -> list[CheckResult]:
    out = out or Path(tempfile.mkdtemp(prefix="vibetrain-check-"))
    results = [scan_stack(stack_dir)]
    accuracy = run_candidate(target, stack_dir, out, "accuracy", time_limit_s)
    if not accuracy.ok:
        return results + [CheckResult("accuracy", False, [accuracy.cause], {})]
    results += [CheckResult(c["name"], c["passed"], c["reasons"], c["details"]) for c in accuracy.result["checks"]]
    system = run_candidate(target, stack_dir, out, "system", time_limit_s)
    if not system.ok:
        return results + [CheckResult("system_run", False, [system.cause], {})]
    return results + [audit_directory(spec, out, spec.workload.train_steps)]
