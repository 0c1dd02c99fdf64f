"""Offline evaluator: the benchmark with repeats (the judge's own system run is the first), medians
and spreads, a cProfile summary of one repeat, and rule-based hints read from the median trace —
the findings the planner maps to skill triggers."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from agents.roles import Evaluation, Hint, Verdict
from agents.sandbox import Sandbox
from targets.harness.benchmark import SUMMARIZED, run_metrics
from targets.harness.candidate import Limits, run_candidate
from targets.harness.sim.calibrate import engine_batches
from targets.harness.trace import Trace
from targets.spec import TargetSpec

DEVICES_BUSY = 0.75  # mean device busy share under which devices idle
STALL_SHARE = 0.10  # share of the run with no request in flight
TAIL_SHARE = 0.15  # share of the run with under a quarter of the peak in flight
TRAIN_IDLE_SHARE = 0.4  # idle share of a training device that says it waits for data
ABORT_SHARE = 0.05
SMALL_BATCH = 4.0
SYNC_SHARE = 0.10


def concurrency_shares(events: list) -> tuple[float, float]:
    """Shares of the run with no request in flight (rollout stalled) and with under a quarter of
    the run's peak in flight (the long tail), from the generate events' start and end stamps."""
    start = next(e.t for e in events if e.kind == "run_start")
    end = next(e.t for e in events if e.kind == "run_end")
    changes = sorted([(e.data["start"], 1) for e in events if e.kind == "generate"] +
                     [(e.t, -1) for e in events if e.kind == "generate"])
    if not changes or end <= start:
        return 1.0, 0.0
    level, peak, levels = 0, 0, []  # (from, to, requests in flight)
    previous = start
    for when, delta in changes:
        levels.append((previous, when, level))
        level += delta
        peak = max(peak, level)
        previous = when
    levels.append((previous, end, level))
    duration = end - start
    stalled = sum(b - a for a, b, n in levels if n == 0) / duration
    tail = sum(b - a for a, b, n in levels if 0 < n < peak / 4) / duration
    return stalled, tail


def hints_from(metrics: dict, events: list, simulated: bool) -> list[Hint]:
    """Findings, each with its evidence; ``code`` is what skills list as triggers."""
    hints = []
    stalled, tail = concurrency_shares(events)
    if stalled > STALL_SHARE:
        hints.append(Hint(code="rollout_stalls", message=f"no rollout in flight for {stalled:.0%} of the run (training blocks it)",
                          evidence={"stalled_share": stalled}))
    if tail > TAIL_SHARE:
        hints.append(Hint(code="tail_idle", message=f"under a quarter of the peak requests in flight for {tail:.0%} of the run "
                                                    "(the batch's long tail)", evidence={"tail_share": tail}))
    busy = metrics["mean_device_busy"]
    if busy < DEVICES_BUSY:
        hints.append(Hint(code="devices_idle", message=f"devices are busy {busy:.0%} of the run", evidence={"mean_device_busy": busy}))
    utilization = metrics["device_utilization"]
    trainers = {d: u for d, u in utilization.items() if u["train"] > 0}
    if trainers:
        idle = statistics.mean(u["idle"] for u in trainers.values())
        if idle > TRAIN_IDLE_SHARE:
            hints.append(Hint(code="train_devices_idle", message=f"training devices idle {idle:.0%} of the run (waiting for data)",
                              evidence={"train_device_idle": idle, "devices": sorted(trainers)[:8]}))
    if metrics["timeout_ratio"] > 0.01:
        hints.append(Hint(code="timeouts", message=f"{metrics['timeout_ratio']:.0%} of trajectories timed out",
                          evidence={"timeout_ratio": metrics["timeout_ratio"]}))
    turns = sum(1 for e in events if e.kind == "generate")
    if turns and metrics["aborted_turns"] / turns > ABORT_SHARE:
        hints.append(Hint(code="many_aborts", message=f"{metrics['aborted_turns']} of {turns} turns aborted by shrinks",
                          evidence={"aborted_turns": metrics["aborted_turns"], "turns": turns}))
    if not simulated:
        batches = engine_batches(events)
        if batches:
            size = statistics.mean(len(members) for _, members in batches)
            if size < SMALL_BATCH:
                hints.append(Hint(code="small_engine_batches", message=f"engines batch {size:.1f} requests on average",
                                  evidence={"mean_engine_batch": size}))
    steps = max(1, sum(1 for e in events if e.kind == "train"))
    if metrics["sync_s"] * steps / metrics["duration_s"] > SYNC_SHARE:
        hints.append(Hint(code="slow_sync", message=f"weight sync takes {metrics['sync_s'] * steps / metrics['duration_s']:.0%} of the run",
                          evidence={"sync_s": metrics["sync_s"]}))
    return hints


class OfflineEvaluator:
    def __init__(self, target: str, spec: TargetSpec, sandbox: Sandbox, limits: Limits, repeat: int, simulated: bool) -> None:
        if repeat < 1:
            raise ValueError(f"repeat must be >= 1, got {repeat}")
        self.target, self.spec, self.sandbox, self.limits = target, spec, sandbox, limits
        self.repeat, self.simulated = repeat, simulated

    def evaluate(self, workspace: Path, verdict: Verdict, out: Path) -> Evaluation:
        if verdict.run_dir is None:
            raise ValueError("the judge's verdict carries no system run to start from")
        runs = [verdict.run_dir]
        for i in range(1, self.repeat):
            run = run_candidate(self.target, workspace, out / f"r{i}", "system", self.limits, seed=i,
                                execution="simulated" if self.simulated else "real", launcher=self.sandbox.launcher,
                                extra_args=("--profile",) if i == 1 else ())
            if not run.ok:
                raise RuntimeError(f"repeat {i} failed: {run.cause}")
            runs.append(run.out)
        repeats, traces = [], []
        for run_dir in runs:
            events = Trace.load_events(run_dir / "trace.jsonl")
            child = json.loads((run_dir / "system.json").read_text())
            repeats.append(run_metrics(self.spec, events, child))
            traces.append((run_dir / "trace.jsonl", events))
        headline = self.spec.headline_metric.name
        order = sorted(range(len(repeats)), key=lambda i: repeats[i][headline])
        median_index = order[(len(order) - 1) // 2]
        present = [m for m in SUMMARIZED if all(m in r for r in repeats)]
        metrics = {m: statistics.median(r[m] for r in repeats) for m in present}
        metrics["device_utilization"] = repeats[median_index]["device_utilization"]
        metrics["duration_s"] = repeats[median_index]["duration_s"]
        spread = {m: max(r[m] for r in repeats) - min(r[m] for r in repeats) for m in present}
        profile_path = out / "r1" / "profile.txt"
        profile = profile_path.read_text() if profile_path.exists() else ""
        hints = hints_from(metrics, traces[median_index][1], self.simulated)
        return Evaluation(metrics[headline], metrics, spread, repeats, hints, profile, traces[median_index][0])
