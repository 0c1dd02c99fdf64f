"""The fluid lower bound of a training step, read from a run's trace with the cost model.

No schedule can beat either of two limits:

* **work**: the step's rollout and training work spread perfectly over all devices. A turn's
  rollout work is its prefill with the previous turn's prefix cached, plus its decode at the
  largest batch the KV capacity admits at that context (the cheapest per-token cost the model
  allows), times the engine's devices; training work is the batch's training FLOPs at the MFU.
* **critical path**: each step's longest trained trajectory, decoded alone (batch 1) with its
  environment latencies and each request's overhead in between. A trajectory trained at step ``k``
  was generated from a version no older than ``k - 1 - a`` (``a = async_ratio``), so it ran within
  steps ``k - a .. k``: summed over the steps, these paths are at most ``1 + a`` times the run's
  duration, and their mean over ``1 + a`` is at most the mean step time (the target's
  ``max_async_ratio`` where it lets stacks choose). The run's single longest path would not be: one
  long trajectory bounds the steps it spans, not every step.

The step's bound is the larger of the two; ``fraction = bound / measured step time``.
"""

from __future__ import annotations

from collections import defaultdict

from targets.api import TraceEvent
from targets.harness.sim.cost_model import CostModel
from targets.harness.trace import token_count
from targets.spec import TargetSpec


def _turns(events: list[TraceEvent]) -> dict[str, list[tuple[int, int, int, float]]]:
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


def step_lower_bound(spec: TargetSpec, cost: CostModel, events: list[TraceEvent]) -> dict:
    turns = _turns(events)
    trains = [e for e in events if e.kind == "train"]
    if not trains:
        return {"lower_bound_step_s": 0.0, "work_bound_s": 0.0, "critical_path_bound_s": 0.0}
    devices = len(next(e for e in events if e.kind == "run_start").data["devices"])

    def rollout_work(episode: str) -> float:
        seconds = 0.0
        for context, new, response, _ in turns.get(episode, []):
            batch = max(1, cost.kv_capacity_tokens // max(1, context + response))
            per_token = cost.decode_iteration_s(batch, batch * (context + response / 2)) / batch
            seconds += cost.prefill_s(new, context - new) + response * per_token
        return seconds * cost.engine_devices

    def critical_path(episode: str) -> float:
        return sum(
            cost.prefill_s(new, context - new)
            + response * cost.decode_iteration_s(1, context + response / 2)
            + cost.request_overhead_s
            + latency
            for context, new, response, latency in turns.get(episode, [])
        )

    work, longest = [], []
    for train in trains:
        episodes = [t["episode"] for t in train.data["trajectories"]]
        lengths = [token_count(t["tokens"]) for t in train.data["trajectories"]]
        train_work = cost.train_s(lengths, 1) - cost.train_step_overhead_s
        work.append((sum(rollout_work(e) for e in episodes) + train_work) / devices)
        longest.append(max((critical_path(e) for e in episodes), default=0.0))
    work_bound = sum(work) / len(work)
    # the loosest staleness any stack may declare
    path_bound = sum(longest) / len(longest) / (1 + spec.workload.staleness_limit)
    return {
        "lower_bound_step_s": max(work_bound, path_bound),
        "work_bound_s": work_bound,
        "critical_path_bound_s": path_bound,
    }
