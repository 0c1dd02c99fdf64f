"""``vibetrain bench``: run each schedule ``repeat`` times in child processes, compute metrics from
the harness trace, and summarize with medians and spreads (max - min) side by side."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from targets.api import TraceEvent
from targets.harness.candidate import run_candidate
from targets.harness.metrics import compute_metrics
from targets.harness.trace import Trace
from targets.spec import TargetSpec

SUMMARIZED = ("rollout_throughput", "tokens_per_s", "step_time_s", "timeout_ratio", "mean_device_busy",
              "shrink_s", "expand_s", "sync_s", "train_s", "aborted_turns", "peak_process_memory_mb")


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

    def median(self, metric: str) -> float:
        return statistics.median(r[metric] for r in self.repeats)

    def spread(self, metric: str) -> float:
        values = [r[metric] for r in self.repeats]
        return max(values) - min(values)

    def summary(self) -> dict:
        return {
            "name": self.name,
            "metrics": {m: self.median(m) for m in SUMMARIZED} | {"device_utilization": self.repeats[0]["device_utilization"]},
            "spread": {m: self.spread(m) for m in SUMMARIZED},
            "repeats": self.repeats,
        }


class BenchmarkFailed(RuntimeError):
    pass


def benchmark(
    target: str, spec: TargetSpec, stacks: list[tuple[str, Path]], repeat: int, out: Path, time_limit_s: float,
    on_run: Callable[[str, int], None] = lambda name, i: None,
) -> list[BenchRun]:
    devices = [f"{spec.hardware.kind}:{i}" for i in range(spec.hardware.count)]
    runs = []
    for name, stack_dir in stacks:
        run = BenchRun(name)
        for i in range(repeat):
            result = run_candidate(target, stack_dir, out / name / f"r{i}", "system", time_limit_s, seed=i)
            if not result.ok:
                raise BenchmarkFailed(f"{name} (repeat {i}): {result.cause}")
            events = Trace.load_events(result.out / "trace.jsonl")
            run.repeats.append(compute_metrics(events, devices) | {"peak_process_memory_mb": result.result["peak_process_memory_mb"]})
            run.traces.append(events)
            on_run(name, i)
        runs.append(run)
    return runs
