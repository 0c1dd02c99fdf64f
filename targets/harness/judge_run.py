"""``vibetrain check``: every deterministic gate on one candidate directory, in order —
integrity scan, then (one child process) accuracy checks 1-3 and a system run, then its audit.

A candidate that fails the integrity scan is not executed at all: code that imports harness
internals or reports its own metrics has already failed, and running it would only give it a
chance to do more."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

from safetensors.torch import load_file

from targets.harness.accuracy import CheckResult
from targets.harness.audit import audit_run
from targets.harness.candidate import Launcher, Limits, run_candidate
from targets.harness.integrity import harness_digest, scan_stack
from targets.harness.model import load_model, model_dir
from targets.harness.trace import Trace
from targets.spec import TargetSpec


def audit_directory(spec: TargetSpec, out: Path, steps: int) -> CheckResult:
    events = Trace.load_events(out / "trace.jsonl")
    base: list = []  # loaded on the first replay only (a simulated run replays nothing)

    def load_weights(version: int):
        path = out / "weights" / f"v{version}.safetensors"
        return load_file(path) if path.exists() else None

    def make_model(state):
        if not base:
            base.append(load_model(model_dir(spec.model), spec.model.dtype))
        model = copy.deepcopy(base[0])
        model.load_state_dict(state)
        return model

    return audit_run(spec, events, load_weights, make_model, steps)


def check_candidate(target: str, spec: TargetSpec, stack_dir: Path, time_limit_s: float | Limits, out: Path | None = None,
                    launcher: Launcher | None = None, execution: str | None = None) -> list[CheckResult]:
    """``execution``: ``real`` or ``simulated`` to override the target's for the system run."""
    out = out or Path(tempfile.mkdtemp(prefix="vibetrain-check-"))
    integrity = scan_stack(stack_dir)
    if not integrity.passed:
        return [integrity, CheckResult("not_run", False, ["the candidate was not executed: it failed the integrity scan"], {})]
    results = [integrity]
    before = harness_digest()
    run = run_candidate(target, stack_dir, out, "check", time_limit_s, launcher=launcher, execution=execution)
    changed = sorted(name for name, digest in harness_digest().items() if before.get(name) != digest)
    if changed:
        results.append(CheckResult("harness_unchanged", False, [f"harness files changed during the run: {changed[:5]}"], {}))
    accuracy = run.results.get("accuracy", {})
    if accuracy.get("status") != "ok":
        return results + [CheckResult("accuracy", False, [run.cause], {})]
    results += [CheckResult(c["name"], c["passed"], c["reasons"], c["details"]) for c in accuracy["checks"]]
    if not run.ok:
        return results + [CheckResult("system_run", False, [run.cause], {})]
    return results + [audit_directory(spec, out, spec.workload.train_steps)]
