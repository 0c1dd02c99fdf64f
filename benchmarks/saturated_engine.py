"""Does one saturated engine ever finish before the fluid lower bound says it can?

One simulated engine is given every request at once (``requests`` turns of ``prompt + response`` tokens,
with the stack's drafts or prompt chunks where a shape names them, and where it names a ``leader`` that
request 50 ms ahead, decoding when the rest arrive); it admits by the KV its sequences hold now and
preempts when full (``engine.py``). The bound (``targets/harness/sim/lower_bound.py``) of the same turns is
read from a one-step trace: its rollout work over the engine's devices, and each request's time in the
engine against its alone-time (the critical path's part). A ratio under 1 is a bound that is not one.

    python benchmarks/saturated_engine.py
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import numpy as np
from rich.console import Console
from rich.table import Table

from targets.api import TraceEvent
from targets.harness.sim.cost_model import ClusterCosts
from targets.harness.sim.engine import SimEngine
from targets.harness.sim.lower_bound import TurnCosts, engine_options, step_lower_bound
from targets.harness.sim.virtual_time import VirtualTimeLoop, run_virtual
from targets.spec import load_target


class Shape(NamedTuple):
    target: str
    prompt: int
    response: int
    requests: int
    draft: int = 0  # the stack's speculative_tokens (0: none)
    chunk: int = 0  # the stack's prefill_chunk (0: decode pauses for a prefill)
    engine_devices: int = 0  # simulator.engine_devices pinned (0: the fewest that hold the weights)
    leader: tuple[int, int] | None = None  # (prompt, response) of a request sent 50 ms before the rest


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
    # engines across two nodes, short prompts chunked beside a decoding leader: each chunk shares its step's
    # all-reduce latency, which the bound charged every prompt whole (0.83 of it)
    Shape("qwen3-235b-a22b-h800x160", 50, 8, 1000, chunk=512, engine_devices=16, leader=(100, 400)),
    Shape("qwen3-235b-a22b-h800x160", 50, 1, 1, chunk=512, engine_devices=16, leader=(100, 400)),  # and alone
)


class Served(NamedTuple):
    took: float  # the engine's seconds to serve every request
    bound: dict  # the lower bound of those turns (``step_lower_bound``)
    stretch: int  # 1 + the async ratio (the path term's divisor)
    least_over_alone: float  # the least of each request's time in the engine over its alone-time


def one_step_trace(devices: list[str], turns: dict[str, tuple[int, int]], end: float) -> list[TraceEvent]:
    """The trace of one step on ``devices`` that trained ``turns`` (episode -> (prompt, response), one turn
    each), ending at ``end``: what the bound reads."""
    events = [TraceEvent("run_start", 0.0, {"devices": devices})]
    for episode, (prompt, response) in turns.items():
        events += [
            TraceEvent("env_reset", 0.0, {"episode": episode, "observation": prompt}),
            TraceEvent("env_step", end, {"episode": episode, "action": response, "observation": 0, "latency": 0.0}),
        ]
    trained = [{"episode": e, "tokens": p + r} for e, (p, r) in turns.items()]
    return [*events, TraceEvent("train", end, {"start": end, "trajectories": trained}), TraceEvent("run_end", end)]


def serve_all(shape: Shape) -> Served:
    spec = load_target(shape.target)
    if shape.engine_devices:
        spec = spec.model_copy(
            update={"simulator": spec.simulator.model_copy(update={"engine_devices": shape.engine_devices})}
        )
    costs = ClusterCosts.from_spec(spec)
    cost = costs.shared.speculating(shape.draft, 10**6).chunking(shape.chunk)
    devices = [f"d{i}" for i in range(cost.engine_devices)]
    turns = {f"g{i}/e0": (shape.prompt, shape.response) for i in range(shape.requests)}
    if shape.leader is not None:
        turns = {"leader/e0": shape.leader} | turns
    loop = VirtualTimeLoop()
    times: dict[str, float] = {}

    async def served(engine: SimEngine, episode: str) -> None:
        start = loop.time()
        await engine.submit(episode, *turns[episode])
        times[episode] = loop.time() - start

    async def serve() -> float:
        engine = SimEngine("e", devices, cost)
        try:
            leading = [asyncio.ensure_future(served(engine, "leader/e0"))] if shape.leader is not None else []
            if leading:
                await asyncio.sleep(0.05)
            await asyncio.gather(*leading, *(served(engine, e) for e in turns if e != "leader/e0"))
            return loop.time()
        finally:
            engine.close()

    took = run_virtual(serve(), loop)
    events = one_step_trace(devices, turns, took)
    rows = np.array([(p, p, r) for p, r in turns.values()], dtype=float)
    alone = TurnCosts.of(engine_options(spec, costs), rows).alone_s
    least = min(times[e] / a for e, a in zip(turns, alone, strict=True))
    return Served(took, step_lower_bound(spec, costs, events), 1 + spec.workload.staleness_limit, least)


def main() -> None:
    table = Table(
        "target", "turns", "drafts / chunk", "engine (s)", "over its work bound", "a request over its alone-time"
    )
    for shape in SHAPES:
        served = serve_all(shape)
        led = f" after 1 x {shape.leader[0]} + {shape.leader[1]}" if shape.leader else ""
        pinned = f", engines of {shape.engine_devices}" if shape.engine_devices else ""
        table.add_row(
            shape.target + pinned,
            f"{shape.requests} x {shape.prompt} + {shape.response}{led}",
            f"{shape.draft} / {shape.chunk}",
            f"{served.took:.1f}",
            f"{served.took / served.bound['rollout_bound_s']:.3f}",
            f"{served.least_over_alone:.3f} at least",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
