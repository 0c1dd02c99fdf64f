"""``vibetrain bench``: run each schedule ``repeat`` times in child processes, compute metrics from
the harness trace, and summarize with medians and spreads (max - min) side by side.

Every result carries the fluid lower bound of a step (``targets/harness/sim/lower_bound.py``) and
the fraction of it the schedule reaches. Real runs go one at a time (they share the machine);
simulated runs measure virtual time, so they run side by side.
"""

from __future__ import annotations

import statistics
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from targets.api import TraceEvent
from targets.harness.candidate import Launcher, run_candidate
from targets.harness.metrics import compute_metrics
from targets.harness.sim.cost_model import CostModel
from targets.harness.sim.lower_bound import step_lower_bound
from targets.harness.trace import Trace
from targets.spec import TargetSpec

SUMMARIZED = ("rollout_throughput", "tokens_per_s", "step_time_s", "timeout_ratio", "mean_device_busy",
              "shrink_s", "expand_s", "sync_s", "train_s", "aborted_turns", "lower_bound_step_s", "lower_bound_fraction",
              "peak_process_memory_mb", "peak_kv_fraction")
PARALLEL_SIMULATIONS = 2  # virtual time: contention slows them down, it does not change what they measure


@dataclass
class BenchRun:
    name: str
    repeats: list[dict] = field(default_factory=list)
    traces: list[list[TraceEvent]] = field(default_factory=list)  # one per repeat

    @property
    def median_events(self) -> list[TraceEvent]:
        """The trace of the repeat whose rollout throughput is the median: what a timeline shows."""
        order = sorted(range(len(self.repeats)), key=lambda i: self.repeats[i]["rollout_throughput"])
        return self.traces[order[(len(order) - 1) // 2]]

    def has(self, metric: str) -> bool:
        return all(metric in r for r in self.repeats)

    def median(self, metric: str) -> float:
        return statistics.median(r[metric] for r in self.repeats)

    def spread(self, metric: str) -> float:
        values = [r[metric] for r in self.repeats]
        return max(values) - min(values)

    def summary(self) -> dict:
        present = [m for m in SUMMARIZED if self.has(m)]
        return {
            "name": self.name,
            "metrics": {m: self.median(m) for m in present} | {"device_utilization": self.repeats[0]["device_utilization"]},
            "spread": {m: self.spread(m) for m in present},
            "repeats": self.repeats,
        }


class BenchmarkFailed(RuntimeError):
    pass


def run_metrics(spec: TargetSpec, events: list[TraceEvent], child_result: dict) -> dict:
    """Everything the benchmark reports for one run, from the harness trace (and the child's
    resource figures: peak process memory for real runs, peak KV use for simulated ones)."""
    devices = [f"{spec.hardware.kind}:{i}" for i in range(spec.hardware.count)]
    metrics = compute_metrics(events, devices) | step_lower_bound(spec, CostModel.from_spec(spec), events)
    metrics["lower_bound_fraction"] = metrics["lower_bound_step_s"] / metrics["step_time_s"] if metrics["step_time_s"] else 0.0
    for key in ("peak_process_memory_mb", "peak_kv_fraction"):
        if key in child_result:
            metrics[key] = child_result[key]
    return metrics


def benchmark(
    target: str, spec: TargetSpec, stacks: list[tuple[str, Path]], repeat: int, out: Path, time_limit_s: float,
    simulated: bool = False, on_run: Callable[[str, int], None] = lambda name, i: None, launcher: Launcher | None = None,
) -> list[BenchRun]:
    """``simulated``: run on the cluster simulator (whatever the target's own execution is)."""
    names = [name for name, _ in stacks]
    if len(set(names)) != len(names):
        raise BenchmarkFailed(f"two runs share a name: {names}; rename a candidate directory")
    jobs = [(name, stack_dir, i) for name, stack_dir in stacks for i in range(repeat)]

    def run_one(job: tuple[str, Path, int]) -> tuple[dict, list[TraceEvent]]:
        name, stack_dir, i = job
        result = run_candidate(target, stack_dir, out / name / f"r{i}", "system", time_limit_s, seed=i,
                               execution="simulated" if simulated else "real", launcher=launcher)
        if not result.ok:
            raise BenchmarkFailed(f"{name} (repeat {i}): {result.cause}")
        events = Trace.load_events(result.out / "trace.jsonl")
        metrics = run_metrics(spec, events, result.results["system"])
        on_run(name, i)
        return metrics, events

    with ThreadPoolExecutor(max_workers=PARALLEL_SIMULATIONS if simulated else 1) as pool:
        outcomes = list(pool.map(run_one, jobs))
    runs = {name: BenchRun(name) for name, _ in stacks}
    for (name, _, _), (metrics, events) in zip(jobs, outcomes):
        runs[name].repeats.append(metrics)
        runs[name].traces.append(events)
    return list(runs.values())
