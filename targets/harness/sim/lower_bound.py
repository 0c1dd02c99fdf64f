"""The fluid lower bound of a training step, read from a run's trace with the cost model.

No schedule can beat either of two limits:

* **work**: the step's rollout and training work spread perfectly over the devices. Rollout work is
  the larger of the turns' decode reads and their compute (each turn's prefill with the previous
  turn's prefix cached, and its tokens' share of the tensor-parallel all-reduces but not their fixed
  latency, which a chunk shares with the decode step beside it; plus its decoded tokens' FLOPs), times
  the engine's devices: a prefill may run in the compute a memory-bound decode step leaves idle
  (chunked prefill), so the two do not add up, over the run as over a step (one step's prompts may be
  computed beside another's decode): the larger of the run's two, per step on average.
  Training work is the batch's training FLOPs at the MFU.
* **critical path**: each step's longest trained trajectory, decoded alone (batch 1) with its
  environment latencies and each request's overhead in between (not its reset's, ``env_reset_s``: a stack
  may reset environments ahead of their turn). A trajectory trained at step ``k``
  was generated from a version no older than ``k - 1 - a`` (``a = async_ratio``), so it ran within
  steps ``k - a .. k``: summed over the steps, these paths are at most ``1 + a`` times the run's
  duration, and their mean over ``1 + a`` is at most the mean step time (the target's
  ``max_async_ratio`` where it lets stacks choose). The run's single longest path would not be: one
  long trajectory bounds the steps it spans, not every step.

**A decoded token's charge.** A decode step's memory time is ``R(b w) + beta C`` (``cost_model.py``:
the weights ``b`` sequences of ``w`` positions touch, their ``C`` tokens of KV, the step's overhead and
all-reduces), its progress ``E_k`` tokens a sequence (``w = k + 1``, speculative decoding). Its ``C`` is
at most the engine's KV capacity ``K``: the engine admits by the KV held *now*, so a batch mixes
sequences at every stage of their growth, and a sequence holding ``x`` tokens may share a step with
``K / x - 1`` others on average, not only with ``K / (c + r) - 1`` (its turn's last size): charging a
turn at the batch that fits its largest size let one saturated engine finish in 0.84 of the bound. A
sequence of context ``x`` is charged ``x / K`` of its step's fixed part at the batch ``K / x`` (its
share were every sequence as long, ``R(w K / x) x / K``), plus its own reads ``beta x``, over
``E_k``. These charges never add up to more than a step takes: ``R`` grows with the batch no faster than
in proportion (concave, ``R(0) > 0``; a MoE's touched experts ``1 - (1 - p)^(b w)``), so any mix of
contexts summing to at most ``K`` is charged at most ``R(b w) + beta C``. Decoded alone, a token costs
its batch-1 step's memory or compute time over ``E_k``; the schedule picks ``k`` and the engine option
for each token (the least charge). The least charge is concave and nondecreasing in ``x`` (a perspective
of a concave function, plus linear terms; a least of such), so a turn's ``r`` tokens, decoded at
contexts ``c, c + E, ...`` below ``c + r``, cost at least ``r`` times its chord between ``c`` and
``c + r`` at their mean context, which is at least ``c + (r - E_max) / 2`` (``over_turn``).

On hardware of several pools every turn's work, every step's training and every turn of a critical
path is counted at the pool where it is cheapest: no placement does better, so the bound still holds
(and is loose by what the cheapest pool cannot hold); likewise at every engine size the target lets a
stack choose (``simulator.max_engine_scale``) and every draft length up to ``MAX_DRAFT_TOKENS``. Rollout
may also borrow a serving pool's devices but one (``serving.py``): the work bound spreads rollout over
those too, training over the job's devices only.

The step's bound is the larger of the two; ``fraction = bound / measured step time``. The work bound
is also given by phase (``rollout_bound_s``, ``train_bound_s``: each phase's work over the devices it
may use), to set beside where the devices' time went (``metrics.py``: ``step_rollout_s``, ...
``step_idle_s``): the rest of the gap is each phase's excess over its work, switching and sync (whose
bound is zero), and idle time. Per step (``lower_bound_steps``): each step's measured time (from the
previous train call's end to its own), its rollout work (the larger of its decode reads and compute,
``decode_s`` and ``compute_s`` apart) and train work per device, and its longest path over ``1 + a``;
the bound holds for their mean, not for every step (work may move between neighbouring steps).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from targets.api import TraceEvent
from targets.harness.sim.cost_model import MAX_DRAFT_TOKENS, ClusterCosts, CostModel
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


@dataclass(frozen=True)
class DecodeCharges:
    """A decoded token's least charges at each of an array of contexts (the module's docstring), over the
    engine options and draft lengths."""

    options: list[tuple[CostModel, int]]  # (engine option, draft length)

    @classmethod
    def of(cls, pools: list[CostModel]) -> DecodeCharges:
        return cls(
            [(cost, k) for cost in pools for k in range(MAX_DRAFT_TOKENS + 1 if cost.draft_acceptance > 0 else 1)]
        )

    @property
    def most_per_step(self) -> float:
        """``E_max``: the most tokens a sequence gains in one step."""
        return max(cost.tokens_per_step(k) for cost, k in self.options)

    def shared(self, context: np.ndarray) -> np.ndarray:
        """Device-seconds of a token decoded at ``context`` beside whatever else its step decodes."""

        def charge(cost: CostModel, k: int) -> np.ndarray:
            batch = cost.kv_capacity_tokens / np.maximum(context, 1e-6)  # were every sequence this long (concave to 0)
            step = cost.decode_memory_s(batch, cost.kv_capacity_tokens, k + 1) + cost.decode_step_fixed_s(
                batch * (k + 1)
            )
            return step / batch / cost.tokens_per_step(k) * cost.engine_devices

        return np.minimum.reduce([charge(cost, k) for cost, k in self.options])

    def alone(self, context: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(memory, compute) seconds of a token of a sequence decoded alone at ``context``: its step takes
        the larger of the two."""

        def charge(cost: CostModel, k: int, part: Callable[..., np.ndarray]) -> np.ndarray:
            return (part(1, context, k + 1) + cost.decode_step_fixed_s(k + 1)) / cost.tokens_per_step(k)

        memory = np.minimum.reduce([charge(cost, k, cost.decode_memory_s) for cost, k in self.options])
        return memory, np.minimum.reduce([charge(cost, k, cost.decode_compute_s) for cost, k in self.options])

    def compute(self, context: np.ndarray) -> np.ndarray:
        """Device-seconds of a decoded token's FLOPs at ``context``: what any step spends on it at least
        (``w / E_k >= 1``)."""
        return np.minimum.reduce([cost.decode_compute_s(1, context) * cost.engine_devices for cost, _ in self.options])


def prefill_floor_s(cost: CostModel, new: np.ndarray, cached: np.ndarray) -> np.ndarray:
    """A prompt's least time in an engine: its compute and its tokens' share of the all-reduces, not their
    fixed latency, which a prompt computed in chunks beside a decode step shares with it."""
    return cost.prefill_compute_s(new, cached) + cost.tensor_parallel_s(new) - cost.tensor_parallel_s(0)


def over_turn(first: np.ndarray, last: np.ndarray, response: np.ndarray, step: float) -> np.ndarray:
    """At least what ``response`` tokens decoded from a context on cost, each gaining at most ``step``
    tokens a step, given a charge concave and nondecreasing in the context that is ``first`` there and
    ``last`` ``response`` tokens later: ``response`` times its chord at their least mean context (the
    module's docstring)."""
    return response * first + (last - first) * np.maximum(0.0, response - step) / 2


@dataclass(frozen=True)
class TurnCosts:
    """What each of a run's turns costs at least (arrays, a turn an entry): in the engines alone (its
    critical path's part), and as device-seconds of decode reads and of compute (its work's)."""

    alone_s: np.ndarray
    decode_reads: np.ndarray
    compute: np.ndarray

    @classmethod
    def of(cls, pools: list[CostModel], turns: np.ndarray) -> TurnCosts:
        """``turns``: rows of (context, new prompt tokens, response tokens)."""
        context, new, response = (turns[:, i].astype(float) for i in range(3))
        charges = DecodeCharges.of(pools)
        step = charges.most_per_step
        (memory, compute), (memory_end, compute_end) = charges.alone(context), charges.alone(context + response)
        floors = [(prefill_floor_s(c, new, context - new), c.engine_devices) for c in pools]
        prefill = np.minimum.reduce([seconds for seconds, _ in floors])
        prefill_work = np.minimum.reduce([seconds * devices for seconds, devices in floors])
        alone = prefill + np.maximum(
            over_turn(memory, memory_end, response, step), over_turn(compute, compute_end, response, step)
        )
        end = context + response
        return cls(
            alone_s=alone,
            decode_reads=over_turn(charges.shared(context), charges.shared(end), response, step),
            compute=prefill_work + over_turn(charges.compute(context), charges.compute(end), response, step),
        )


def lendable_serving_devices(spec: TargetSpec) -> int:
    """The serving pools' devices rollout may borrow: all but one of each (``serving.py``)."""
    return sum(max(0, pool.count - 1) for pool in spec.hardware.serving_pools)


def step_lower_bound(spec: TargetSpec, costs: ClusterCosts, events: list[TraceEvent]) -> dict:
    turns = trace_turns(events)
    trains = [e for e in events if e.kind == "train"]
    if not trains:
        zero = ("lower_bound_step_s", "work_bound_s", "critical_path_bound_s", "rollout_bound_s", "train_bound_s")
        return dict.fromkeys(zero, 0.0) | {"lower_bound_steps": []}
    run_start = next(e for e in events if e.kind == "run_start")
    devices = len(run_start.data["devices"])
    rollout_devices = devices + lendable_serving_devices(spec)
    stretch = 1 + spec.workload.staleness_limit  # the loosest staleness any stack may declare

    pools = engine_options(spec, costs)
    rows = [turn[:3] for episode in turns.values() for turn in episode]
    cost = TurnCosts.of(pools, np.array(rows, dtype=float).reshape(-1, 3))
    counts = [len(episode) for episode in turns.values()]
    ends = np.cumsum(counts)  # each episode's turns: a slice of the rows
    starts = ends - counts
    fixed = costs.shared.request_overhead_s
    episode_costs = {
        episode: (
            float(cost.decode_reads[a:b].sum()),
            float(cost.compute[a:b].sum()),
            float(cost.alone_s[a:b].sum()) + sum(fixed + latency for *_, latency in turns[episode]),
        )
        for episode, a, b in zip(turns, starts, ends, strict=True)
    }
    nothing = (0.0, 0.0, 0.0)

    def train_work(lengths: list[int]) -> float:
        return min(c.train_s(lengths, 1) - c.train_step_overhead_s for c in pools)

    steps = []
    previous_end = run_start.t
    for number, train in enumerate(trains, start=1):
        episodes = [episode_costs.get(t["episode"], nothing) for t in train.data["trajectories"]]
        lengths = [token_count(t["tokens"]) for t in train.data["trajectories"]]
        decode, computed = sum(e[0] for e in episodes), sum(e[1] for e in episodes)
        steps.append(
            {
                "step": number,
                "measured_s": train.t - previous_end,
                "rollout_s": max(decode, computed) / rollout_devices,
                "decode_s": decode / rollout_devices,
                "compute_s": computed / rollout_devices,
                "train_s": train_work(lengths) / devices,
                "path_s": max((e[2] for e in episodes), default=0.0) / stretch,
            }
        )
        previous_end = train.t

    def mean(key: str) -> float:
        return sum(step[key] for step in steps) / len(steps)

    # the run's decode reads and compute may overlap across steps (a step's prompts computed beside another's
    # decode): the larger of the two over the run, not the mean of each step's larger
    rollout = max(mean("decode_s"), mean("compute_s"))
    # rollout over every device it may use, training over the job's: both at once, and training alone
    work_bound = max(rollout + mean("train_s") * devices / rollout_devices, mean("train_s"))
    path_bound = mean("path_s")
    return {
        "lower_bound_step_s": max(work_bound, path_bound),
        "work_bound_s": work_bound,
        "critical_path_bound_s": path_bound,
        "rollout_bound_s": rollout,
        "train_bound_s": mean("train_s"),
        "lower_bound_steps": steps,
    }
