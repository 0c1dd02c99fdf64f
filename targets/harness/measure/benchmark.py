"""``vibetrain bench``: schedules side by side, every run judged like a check's and measured from the
harness trace.

Runs are interleaved (repeat i of every schedule, then repeat i + 1, ...) with one seed per repeat,
so a slow minute of the machine hits every schedule alike and each schedule is paired with the first
on the same workload: the ratio to the first comes with a 95% interval. Every result carries the
fluid lower bound of a step (``targets/harness/sim/lower_bound.py``) and the fraction of it reached.
Simulated runs measure virtual time, so they may run side by side; real runs go one at a time.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from targets.errors import UserError
from targets.harness.measure.session import Measurement, MeasurementFailed, Paired, Session

SUMMARIZED = (
    "goodput",
    "rollout_throughput",
    "tokens_per_s",
    "trained_tokens_per_s",
    "step_time_s",
    "timeout_ratio",
    "lost_ratio",
    "checkpoint_s",
    "mean_device_busy",
    "shrink_s",
    "expand_s",
    "sync_s",
    "train_s",
    "aborted_turns",
    "lower_bound_step_s",
    "lower_bound_fraction",
    "work_bound_s",
    "critical_path_bound_s",
    "rollout_bound_s",
    "train_bound_s",
    "step_rollout_s",
    "step_train_s",
    "step_sync_s",
    "step_switching_s",
    "step_idle_s",
    "peak_process_memory_mb",
    "peak_device_memory_mb",
    "peak_kv_fraction",
    "kv_preemptions",
    "decode_batch",
    "decode_share",
    "prefill_share",  # of the engines' busy time (simulated): prefills and host-tier copies, decode paused
    "prefilled_tokens",
    "serving_ttft_p99_s",  # a serving pool's (measure/metrics.py serving_metrics)
    "serving_tpot_p99_s",
    "lent_devices",
    "serving_lends",
    "serving_give_backs",
    "serving_aborted_turns",
    "reward_verdict_s",  # a reward model's (reward_metrics)
    "judge_device_s",
    "judge_utilization",
)
PARALLEL_SIMULATIONS = 2  # virtual time: contention slows them down, it does not change what they measure


@dataclass
class BenchRun:
    """One schedule's repeats. The timeline and device utilization come from the median repeat."""

    name: str
    measurements: list[Measurement] = field(default_factory=list)
    paired: Paired | None = None  # against the first schedule that passed (None for that one itself)

    @property
    def failures(self) -> list[MeasurementFailed]:
        """Its repeats that failed their checks: then none of its figures count."""
        return [MeasurementFailed(self.name, i, m.reasons) for i, m in enumerate(self.measurements) if not m.ok]

    @property
    def repeats(self) -> list[dict]:
        return [m.metrics for m in self.measurements]

    def median_index(self, metric: str) -> int:
        order = sorted(range(len(self.repeats)), key=lambda i: self.repeats[i][metric])
        return order[(len(order) - 1) // 2]

    def has(self, metric: str) -> bool:
        return all(metric in r for r in self.repeats)

    def median(self, metric: str) -> float:
        return statistics.median(r[metric] for r in self.repeats)

    def spread(self, metric: str) -> float:
        values = [r[metric] for r in self.repeats]
        return max(values) - min(values)

    def summary(self, headline: str) -> dict:
        """The metrics a round or a bench reports: medians, spreads, and the median repeat's
        utilization, duration and per-step bounds (one way, everywhere)."""
        present = [m for m in SUMMARIZED if self.has(m)]
        middle = self.repeats[self.median_index(headline)]
        return {
            "name": self.name,
            "metrics": {m: self.median(m) for m in present}
            | {"device_utilization": middle["device_utilization"], "duration_s": middle["duration_s"]},
            "lower_bound_steps": middle.get("lower_bound_steps", []),
            "spread": {m: self.spread(m) for m in present},
            "paired": self.paired.as_dict() if self.paired else None,
            "repeats": self.repeats,
        }


class BenchmarkFailed(UserError, RuntimeError):
    """A benchmarked run failed its checks: the bench cannot go on (the message says which and why)."""

    exit_code = 1


class SharedRunName(UserError, ValueError):
    """Two stacks of one bench under one name (a run is named by its directory): asked wrongly."""


def refuse_shared_names(stacks: list[tuple[str, Path]]) -> None:
    """Before any run: the bench's results and timeline are keyed by each stack's name."""
    names = [name for name, _ in stacks]
    if len(set(names)) != len(names):
        raise SharedRunName(
            f"two runs share a name: {names}; rename a candidate directory (a RUN@ reference is named by its "
            "run's folder: rename or copy one run's folder)"
        )


def benchmark(
    session: Session,
    stacks: list[tuple[str, Path]],
    repeat: int,
    out: Path,
    seeds: list[int] | None = None,
    on_run: Callable[[str, int], None] = lambda name, i: None,
    sessions: dict[str, Session] | None = None,
) -> list[BenchRun]:
    """Each stack ``repeat`` times, interleaved; ``sessions`` names the stacks measured under another
    session (a baseline on other hardware), the rest run under ``session``. A run that fails its
    checks fails its stack (``BenchRun.failures``), not the bench: the others are still measured and
    paired with the first stack that passed."""
    sessions = sessions or {}
    refuse_shared_names(stacks)
    seeds = seeds or list(range(repeat))
    # each repeat in the other order (A B, B A, ...), as ``Session.compare`` pairs: a warm-up or an order
    # effect then falls on every stack alike, not on the ratios
    jobs = [(name, stack_dir, i) for i in range(repeat) for name, stack_dir in (stacks if i % 2 == 0 else stacks[::-1])]

    def run_one(job: tuple[str, Path, int]) -> Measurement:
        name, stack_dir, i = job
        measurement = sessions.get(name, session).measure(stack_dir, out / name / f"r{i}", seeds[i])
        on_run(name, i)
        return measurement

    with ThreadPoolExecutor(max_workers=PARALLEL_SIMULATIONS if session.target.simulated else 1) as pool:
        outcomes = list(pool.map(run_one, jobs))
    runs = {name: BenchRun(name) for name, _ in stacks}
    for (name, _, _), measurement in zip(jobs, outcomes):
        runs[name].measurements.append(measurement)
    passed = [run for run in runs.values() if not run.failures]
    metric = session.target.spec.headline_metric
    for run in passed[1:]:
        run.paired = Paired.of(
            [r[metric.name] for r in run.repeats],
            [r[metric.name] for r in passed[0].repeats],
            metric.direction == "maximize",
            passed[0].name,
            deterministic=session.target.simulated,
        )
    return list(runs.values())
