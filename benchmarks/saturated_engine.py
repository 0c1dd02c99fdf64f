"""Does one saturated engine ever finish before the fluid lower bound says it can?

One simulated engine is given every request at once (``requests`` turns of ``prompt + response`` tokens,
with the stack's drafts or prompt chunks where a shape names them); it admits by the KV its sequences hold
now and preempts when full (``engine.py``). The bound (``targets/harness/sim/lower_bound.py``) of the same
turns is read from a one-step trace: its rollout work over the engine's devices, and each request's
critical path (its alone-time). A ratio under 1 is a bound that is not one.

    python benchmarks/saturated_engine.py
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from rich.console import Console
from rich.table import Table

from targets.api import TraceEvent
from targets.harness.sim.cost_model import ClusterCosts
from targets.harness.sim.engine import SimEngine
from targets.harness.sim.lower_bound import step_lower_bound
from targets.harness.sim.virtual_time import VirtualTimeLoop, run_virtual
from targets.spec import load_target


class Shape(NamedTuple):
    target: str
    prompt: int
    response: int
    requests: int
    draft: int = 0  # the stack's speculative_tokens (0: none)
    chunk: int = 0  # the stack's prefill_chunk (0: decode pauses for a prefill)


SHAPES = (
    Shape("qwen3-8b-h800x16", 1000, 15_000, 300),  # 0.84 of the bound that batched a turn at its last size
    Shape("qwen3-8b-h800x16", 64, 512, 3000),
    Shape("qwen3-8b-h800x16", 30_000, 200, 500),
    Shape("qwen3-8b-h800x16", 100, 30_000, 1),
    Shape("qwen3-235b-a22b-h800x160", 2000, 6000, 800),
    Shape("qwen3-235b-a22b-h800x160", 2000, 6000, 800, draft=3),
    Shape("qwen3-235b-a22b-h800x160", 2000, 6000, 1, draft=3),
    Shape("qwen3-235b-a22b-h800x160", 20_000, 500, 2000, chunk=512),
    Shape("tiny-qwen3-cpu", 30, 20, 200),
)


def serve_all(shape: Shape) -> tuple[float, dict, int]:
    """(the engine's seconds to serve every request, the bound of those turns, 1 + the async ratio)."""
    spec = load_target(shape.target)
    costs = ClusterCosts.from_spec(spec)
    cost = costs.shared.speculating(shape.draft, 10**6).chunking(shape.chunk)
    devices = [f"d{i}" for i in range(cost.engine_devices)]
    episodes = [f"g{i}/e0" for i in range(shape.requests)]
    loop = VirtualTimeLoop()

    async def serve() -> float:
        engine = SimEngine("e", devices, cost)
        try:
            await asyncio.gather(*(engine.submit(e, shape.prompt, shape.response) for e in episodes))
            return loop.time()
        finally:
            engine.close()

    took = run_virtual(serve(), loop)
    events = [TraceEvent("run_start", 0.0, {"devices": devices})]
    for episode in episodes:
        events += [
            TraceEvent("env_reset", 0.0, {"episode": episode, "observation": shape.prompt}),
            TraceEvent(
                "env_step",
                took,
                {"episode": episode, "action": shape.response, "observation": 0, "latency": 0.0},
            ),
        ]
    trained = [{"episode": e, "tokens": shape.prompt + shape.response} for e in episodes]
    events += [TraceEvent("train", took, {"start": took, "trajectories": trained}), TraceEvent("run_end", took)]
    return took, step_lower_bound(spec, costs, events), 1 + spec.workload.staleness_limit


def main() -> None:
    table = Table("target", "turns", "drafts / chunk", "engine (s)", "over its work bound", "over its path")
    for shape in SHAPES:
        took, bound, stretch = serve_all(shape)
        table.add_row(
            shape.target,
            f"{shape.requests} x {shape.prompt} + {shape.response}",
            f"{shape.draft} / {shape.chunk}",
            f"{took:.1f}",
            f"{took / bound['rollout_bound_s']:.3f}",
            f"{took / (bound['critical_path_bound_s'] * stretch):.3f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
