"""The fluid lower bound of a training step, read from a run's trace with the cost model.

No schedule can beat either of two limits:

* **work**: the step's rollout and training work spread perfectly over all devices. Rollout work is
  the larger of the turns' decode at the largest batch the KV capacity admits at its context (the
  cheapest per-token cost the model allows) and their compute alone (each turn's prefill with the
  previous turn's prefix cached, plus its decoded tokens' FLOPs), times the engine's devices: a prefill
  may run in the compute a memory-bound decode step leaves idle (chunked prefill), so the two do not
  add up. Training work is the batch's training FLOPs at the MFU.
  Decoding costs the cheapest draft length's ``iteration / E`` (``cost_model.py``: speculative
  decoding; with ``tokens.draft_acceptance`` 0, the plain iteration).
* **critical path**: each step's longest trained trajectory, decoded alone (batch 1) with its
  environment latencies and each request's overhead in between. A trajectory trained at step ``k``
  was generated from a version no older than ``k - 1 - a`` (``a = async_ratio``), so it ran within
  steps ``k - a .. k``: summed over the steps, these paths are at most ``1 + a`` times the run's
  duration, and their mean over ``1 + a`` is at most the mean step time (the target's
  ``max_async_ratio`` where it lets stacks choose). The run's single longest path would not be: one
  long trajectory bounds the steps it spans, not every step.

The step's bound is the larger of the two; ``fraction = bound / measured step time``. The work bound
is also given by phase (``rollout_bound_s``, ``train_bound_s``: each phase's work over all devices),
to set beside where the devices' time went (``metrics.py``: ``step_rollout_s``, ...
``step_idle_s``): the rest of the gap is each phase's excess over its work, switching and sync
(whose bound is zero), and idle time. On hardware of several pools every turn's work, every step's
training and every turn of a critical path is counted at the pool where it is cheapest: no placement
does better, so the bound still holds (and is loose by what the cheapest pool cannot hold); likewise
at every engine size the target lets a stack choose (``simulator.max_engine_scale``). Per step
(``lower_bound_steps``): each step's measured time (from the previous train call's end to its own),
its rollout and train work per device, and its longest path over ``1 + a``; the bound holds for
their mean, not for every step (work may move between neighbouring steps).
"""

from __future__ import annotations

from collections import Counter, defaultdict

from targets.api import TraceEvent
from targets.harness.sim.cost_model import ClusterCosts, CostModel
from targets.harness.trace import token_count
from targets.spec import TargetSpec


def trace_turns(events: list[TraceEvent]) -> dict[str, list[tuple[int, int, int, float]]]:
    """episode -> [(context before the turn, new prompt tokens, response tokens, env latency)]."""
    context: dict[str, int] = {}
    pending: dict[str, int] = {}  # prompt tokens not yet in any engine's cache
    turns: dict[str, list[tuple[int, int, int, float]]] = defaultdict(list)
    for e in events:
        if e.kind == "env_reset":
            context[e.data["episode"]] = pending[e.data["episode"]] = token_count(e.data["observation"])
        elif e.kind == "env_step":
            episode = e.data["episode"]
            action, observation = token_count(e.data["action"]), token_count(e.data["observation"])
            turns[episode].append((context[episode], pending[episode], action, e.data["latency"]))
            context[episode] += action + observation
            pending[episode] = observation
    return turns


def alone_s(pools: list[CostModel], context: int, new: int, response: int) -> float:
    """A turn's prefill and decode with nothing else on its engine (batch 1, the cheapest draft length), at
    the cheapest engine option: its least time in the engines."""
    return min(c.prefill_s(new, context - new) + response * c.fastest_token_s(1, context + response / 2) for c in pools)


def engine_options(spec: TargetSpec, costs: ClusterCosts) -> list[CostModel]:
    """Every pool's cost model at every engine size a stack may choose (``simulator.max_engine_scale``)
    that its devices hold: the bound takes the cheapest, so it holds whatever size a stack picks."""
    sizes = Counter(costs.pool_of.values())
    scales = [1 << i for i in range(spec.simulator.max_engine_scale.bit_length())]  # 1, 2, ... up to the maximum
    return [
        cost
        for scale in scales
        for name, cost in costs.scaled(scale).pools.items()
        if cost.engine_devices <= sizes[name]
    ]


def step_lower_bound(spec: TargetSpec, costs: ClusterCosts, events: list[TraceEvent]) -> dict:
    turns = trace_turns(events)
    trains = [e for e in events if e.kind == "train"]
    if not trains:
        zero = ("lower_bound_step_s", "work_bound_s", "critical_path_bound_s", "rollout_bound_s", "train_bound_s")
        return dict.fromkeys(zero, 0.0) | {"lower_bound_steps": []}
    run_start = next(e for e in events if e.kind == "run_start")
    devices = len(run_start.data["devices"])
    stretch = 1 + spec.workload.staleness_limit  # the loosest staleness any stack may declare

    pools = engine_options(spec, costs)

    def decode_work(cost, context: int, response: int) -> float:
        batch = max(1, cost.kv_capacity_tokens // max(1, context + response))
        per_token = cost.fastest_token_s(batch, batch * (context + response / 2)) / batch
        return response * per_token * cost.engine_devices

    def compute_work(cost, context: int, new: int, response: int) -> float:
        computed = cost.prefill_s(new, context - new) + response * cost.token_compute_s(context + response / 2)
        return computed * cost.engine_devices

    def rollout_work(episodes: list[str]) -> float:
        every = [turn for e in episodes for turn in turns.get(e, [])]
        decode = sum(min(decode_work(c, context, response) for c in pools) for context, _, response, _ in every)
        computed = sum(min(compute_work(c, *turn[:3]) for c in pools) for turn in every)
        return max(decode, computed)

    def critical_path(episode: str) -> float:
        return sum(
            alone_s(pools, context, new, response) + costs.shared.request_overhead_s + latency
            for context, new, response, latency in turns.get(episode, [])
        )

    def train_work(lengths: list[int]) -> float:
        return min(c.train_s(lengths, 1) - c.train_step_overhead_s for c in pools)

    steps = []
    previous_end = run_start.t
    for number, train in enumerate(trains, start=1):
        episodes = [t["episode"] for t in train.data["trajectories"]]
        lengths = [token_count(t["tokens"]) for t in train.data["trajectories"]]
        steps.append(
            {
                "step": number,
                "measured_s": train.t - previous_end,
                "rollout_s": rollout_work(episodes) / devices,
                "train_s": train_work(lengths) / devices,
                "path_s": max((critical_path(e) for e in episodes), default=0.0) / stretch,
            }
        )
        previous_end = train.t

    def mean(key: str) -> float:
        return sum(step[key] for step in steps) / len(steps)

    work_bound, path_bound = mean("rollout_s") + mean("train_s"), mean("path_s")
    return {
        "lower_bound_step_s": max(work_bound, path_bound),
        "work_bound_s": work_bound,
        "critical_path_bound_s": path_bound,
        "rollout_bound_s": mean("rollout_s"),
        "train_bound_s": mean("train_s"),
        "lower_bound_steps": steps,
    }
