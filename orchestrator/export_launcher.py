"""The launcher of an exported stack: ``python train.py [--steps N] [--seed S]`` in the export's directory.

``vibetrain export`` copies this file to ``train.py`` with its ``targets`` imports rewritten to the
vendored ``vt_harness`` package; it is not run from inside vibetrain. It trains with the stack as the
harness's system run drives it, in one process: the target's runtime (model files, devices), the
harness's environments, ``stack.build(runtime)``, the stack's own cluster (its engines and trainers on
the target's hardware) and ``controller.run`` for N training steps, printing one line per step.

Left out on purpose: what the harness adds to *judge* a candidate (separate processes, the trace it
trusts, weight snapshots and the audit's replay). This trains with a stack that was judged already.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from targets.api import Cluster, Device, TrainBatch
from targets.harness.clock import WallClock
from targets.harness.environments import EnvironmentPool
from targets.harness.measure.tracking import KINDS, Tracker, TrackingError, open_tracker
from targets.harness.target import Target, TargetUnavailable, gpus_here
from targets.harness.trace import Trace

HERE = Path(__file__).resolve().parent
TARGET_YAML = HERE / "target.yaml"


@dataclass(frozen=True)
class StepRecord:
    """One training step as the launcher saw it at the cluster's ``train`` call."""

    step: int
    steps: int
    version: int
    mean_reward: float
    trajectories: int
    timeouts: int
    response_tokens: int
    step_seconds: float  # since the previous step ended (the run's start, for the first)
    train_seconds: float  # the train call alone


Reporter = Callable[[StepRecord], None]


def print_step(record: StepRecord) -> None:
    print(
        f"step {record.step}/{record.steps} reward {record.mean_reward:.4f} "
        f"step_time {record.step_seconds:.3f}s train_time {record.train_seconds:.3f}s "
        f"trajectories {record.trajectories} timeouts {record.timeouts} "
        f"response_tokens {record.response_tokens} version {record.version}",
        flush=True,
    )


class StepMeter:
    """The stack's cluster as its controller sees it here: ``train`` is timed and reported (the batch
    says the step's rewards); every other call goes to the stack's cluster untouched."""

    def __init__(self, inner: Cluster, steps: int, reporters: Sequence[Reporter]) -> None:
        self.inner, self.steps, self.reporters = inner, steps, list(reporters)
        self.devices: list[Device] = list(inner.devices)
        self.done = 0
        self.started = self.last_end = time.monotonic()
        self._parts: list = []  # the next step's trajectories given early (stream training)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def train_part(self, batch: TrainBatch, devices: Sequence[Device]) -> None:
        await self.inner.train_part(batch, devices)
        self._parts += batch.trajectories

    async def train(self, batch: TrainBatch, devices: Sequence[Device]) -> int:
        start = time.monotonic()
        version = await self.inner.train(batch, devices)
        end = time.monotonic()
        self.done += 1
        trajectories, self._parts = [*self._parts, *batch.trajectories], []
        record = StepRecord(
            step=self.done,
            steps=self.steps,
            version=version,
            mean_reward=sum(t.reward for t in trajectories) / len(trajectories),
            trajectories=len(trajectories),
            timeouts=sum(t.timed_out for t in trajectories),
            response_tokens=sum(t.response_tokens for t in trajectories),
            step_seconds=end - self.last_end,
            train_seconds=end - start,
        )
        self.last_end = end
        for report in self.reporters:
            report(record)
        return version


def track_step(tracker: Tracker) -> Reporter:
    """``--track``: each step's figures as the launcher measures them, under ROLL's names where it has
    them (``time/step_total``, ``time/step_train``, ``system/samples``); the reward and timeouts under
    ``reward/mean`` and ``system/timeouts``. No rollout/shrink split: nothing here traces the cluster."""
    samples = 0

    def log(record: StepRecord) -> None:
        nonlocal samples
        samples += record.trajectories
        tracker.log(
            "train",
            record.step,
            {
                "time/step_total": record.step_seconds,
                "time/step_train": record.train_seconds,
                "system/samples": samples,
                "system/timeouts": record.timeouts,
                "system/response_tokens": record.response_tokens,
                "reward/mean": record.mean_reward,
            },
        )

    return log


def load_target() -> Target:
    """The target from ``target.yaml``, refused unless it trains for real on this machine."""
    try:
        target = Target.load(TARGET_YAML)
    except TargetUnavailable as error:
        raise SystemExit(f"error: {error}") from None
    hardware = target.spec.hardware
    if target.simulated:
        raise SystemExit(
            f"error: target {target.id} trains on {hardware.summary} device(s) "
            f"(execution: {target.spec.execution}); this machine has {gpus_here()} GPU(s). "
            "Run this on a machine with the target's hardware."
        )
    return target


def import_stack():
    """The exported ``stack`` package; PYTHONPATH names this directory so processes the stack starts
    (Ray workers) import it and ``vt_harness`` too."""
    sys.path.insert(0, str(HERE))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return importlib.import_module("stack")


async def train(target: Target, steps: int, seed: int, report: Sequence[Reporter]) -> StepMeter:
    runtime = target.runtime()  # builds random weights into the model cache on first use
    stack = import_stack().build(runtime)
    if stack.make_cluster is None:
        raise SystemExit("error: this stack has no real cluster (stack.build returned make_cluster=None)")
    workload, declared = target.spec.workload, stack.declared
    refused = workload.over_declared_limits(declared)
    if refused:
        raise SystemExit(f"error: {refused}")
    clock = WallClock()
    envs = EnvironmentPool(workload, clock, Trace(clock, record_tokens=False), seed=seed, model_path=runtime.model_path)
    envs.max_extra = declared.redundant_per_group  # the spares per group the stack declares it launches
    try:
        cluster = await stack.make_cluster()
        try:
            meter = StepMeter(cluster, steps, report)
            await stack.controller.run(meter, envs, steps)
        finally:
            await cluster.close()
    finally:
        envs.close()  # the process a user's environments ran in
    if meter.done != steps:
        raise SystemExit(f"error: the controller returned after {meter.done} training steps of {steps}")
    return meter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python train.py", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="training steps [default: the target's train_steps]")
    parser.add_argument("--seed", type=int, default=0, help="seed of the environments' tasks")
    parser.add_argument("--track", choices=KINDS, default=None, help="also write each step's figures there")
    parser.add_argument("--track-dir", type=Path, default=HERE / "track", help="where --track writes")
    args = parser.parse_args(argv)
    try:
        tracker = open_tracker(args.track, args.track_dir) if args.track else None
    except TrackingError as error:
        raise SystemExit(f"error: {error}") from None
    target = load_target()
    steps = target.spec.workload.train_steps if args.steps is None else args.steps
    if steps < 1:
        parser.error(f"--steps must be >= 1, got {steps}")
    hardware = target.spec.hardware
    print(
        f"training target {target.id} on {hardware.summary} device(s) for {steps} step(s)",
        flush=True,
    )
    try:
        meter = asyncio.run(train(target, steps, args.seed, [print_step, *([track_step(tracker)] if tracker else [])]))
    finally:
        if tracker is not None:
            tracker.close()
    if tracker is not None:
        print(f"tracking ({args.track}): {args.track_dir}", flush=True)
    print(f"done: {meter.done} step(s) in {meter.last_end - meter.started:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
