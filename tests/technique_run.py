"""A technique's run for the tests: the time_multiplex starter with chosen params on the fast target
(conftest.py), real or simulated, measured by the harness; the audited form must pass the audit."""

from __future__ import annotations

import json
import os
import re

import yaml

from skills.starter import write_starter
from targets.harness.isolation.launch import Limits, run_harness
from targets.harness.isolation.sandbox import Sandbox
from targets.harness.target import Target
from targets.harness.trace import Trace
from targets.spec import parse_target


def harness_run(
    tmp_path,
    fast_target,
    params: dict,
    simulate: bool,
    workload: dict | None = None,
    patch=None,
    seed: int = 0,
    controller: str = "time_multiplex",
):
    """The ``controller`` starter with ``params`` on the fast target with ``workload`` changes, measured;
    ``patch(stack_dir)`` plants a change in the written stack first. Returns (spec, run)."""
    data = yaml.safe_load(fast_target.read_text())
    data["workload"].update(workload or {})
    return target_run(tmp_path, data, params, simulate, patch, seed, controller)


def target_run(
    tmp_path, data: dict, params: dict, simulate: bool, patch=None, seed: int = 0, controller: str = "time_multiplex"
):
    """The ``controller`` starter with ``params`` on the target ``data`` (a spec's YAML as a dict),
    measured; ``patch(stack_dir)`` plants a change first. Returns (spec, run)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    target_path = tmp_path / "target.yaml"
    target_path.write_text(yaml.safe_dump(data))
    spec = parse_target(data)
    stack = write_starter(tmp_path / "stack", spec, controller)
    path = stack / "stack" / "params.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **params}))
    if patch:
        patch(stack / "stack")
    run = run_harness(
        Target.load(target_path, simulate=simulate),
        stack,
        tmp_path / "out",
        "measure",
        Limits(time_s=300),
        Sandbox("subprocess"),
        seed=seed,
    )
    return spec, run


def audited_run(
    tmp_path,
    fast_target,
    params: dict,
    simulate: bool,
    workload: dict | None = None,
    seed: int = 0,
    controller: str = "time_multiplex",
):
    """A run that must succeed and pass the audit: (spec, its trace's events)."""
    spec, run = harness_run(tmp_path, fast_target, params, simulate, workload, seed=seed, controller=controller)
    assert run.ok, run.cause
    audit = run.results["audit"]["result"]
    assert audit["passed"], audit["reasons"]
    if not params.get("route_admit"):  # KV admission queues turns in the controller: held, and judged (docs/judge.md)
        assert audit["details"].get("selection_groups_held", 0) == 0, "an honest stack held an episode unstepped"
    if not simulate and os.environ.get("RAY_ADDRESS"):  # the session's shared cluster (conftest.py), really joined
        log = (run.out / "cluster.log").read_text()
        assert "joined the Ray cluster at" in log
        # each engine's count of requests Ray delivered before an earlier one (skills/recipes/arrival_order.py)
        assert re.search(r"arrival order on \S+: \d+ requests came before an earlier one", log), log
    return spec, Trace.load_events(run.out / "trace.jsonl")


def planted(file: str, honest: str, cheat: str):
    """A patch for ``harness_run``/``target_run``: ``honest`` text of the stack's ``file`` becomes ``cheat``."""

    def patch(stack_dir) -> None:
        path = stack_dir / file
        assert honest in path.read_text()
        path.write_text(path.read_text().replace(honest, cheat))

    return patch


def round_hints(spec, events, child_result: dict) -> list:
    """The offline evaluator's hints on this run as a round draws them: from the summary a round reads
    (``BenchRun.summary``, which keeps only the metrics it summarizes), not from hand-made metrics."""
    from agents.offline.evaluator import hints_from
    from targets.harness.judge.check_result import CheckResult
    from targets.harness.measure.benchmark import BenchRun
    from targets.harness.measure.run_metrics import run_metrics
    from targets.harness.measure.session import Measurement

    measured = Measurement([CheckResult("system_audit", True, [], {})], run_metrics(spec, events, child_result))
    summary = BenchRun("candidate", [measured]).summary(spec.headline_metric.name)
    return hints_from(summary["metrics"], events, simulated=True)
