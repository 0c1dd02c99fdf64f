"""A simulated system run: the candidate's controller, unchanged, on the harness's ``SimCluster``
under virtual time, with the harness environments (their latencies and turn counts drawn from the
workload) and a trace that keeps token counts instead of token lists."""

from __future__ import annotations

import time
from pathlib import Path

from targets.api import Runtime, Stack
from targets.harness.sim.cluster import SimCluster
from targets.harness.sim.cost_model import CostModel
from targets.harness.sim.virtual_time import VirtualClock, VirtualTimeLoop, run_virtual
from targets.harness.system_run import drive
from targets.harness.trace import Trace
from targets.spec import TargetSpec


def simulate(spec: TargetSpec, stack: Stack, runtime: Runtime, steps: int, seed: int, cost: CostModel | None = None) -> tuple[Trace, dict]:
    """Returns the trace and a summary (virtual and wall seconds, peak KV use)."""
    cost = cost or CostModel.from_spec(spec)
    loop = VirtualTimeLoop()
    trace = Trace(VirtualClock(loop), record_tokens=False)
    rollout, _ = stack.controller.placement(list(runtime.devices))
    summary: dict = {}

    async def main() -> None:
        cluster = SimCluster(runtime.devices, rollout, cost)
        try:
            await drive(spec, stack.controller, cluster, steps, seed, trace, {}, engines=cluster.engine_devices)
        finally:
            summary["peak_kv_fraction"] = cluster.peak_kv_fraction

    started = time.perf_counter()
    run_virtual(main(), loop)
    summary.update(virtual_seconds=loop.time(), wall_seconds=time.perf_counter() - started,
                   engine_devices=cost.engine_devices, kv_capacity_tokens=cost.kv_capacity_tokens)
    return trace, summary


def run_simulated_mode(spec: TargetSpec, stack, runtime: Runtime, out: Path, seed: int, steps: int) -> dict:
    """The runner's ``system`` phase for a simulated target: writes ``trace.jsonl`` to ``out``."""
    trace, summary = simulate(spec, stack.build(spec, runtime), runtime, steps, seed)
    trace.save(out / "trace.jsonl")
    return {"steps": steps, "simulated": True, **summary}
