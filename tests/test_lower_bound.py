"""The fluid lower bound (``targets/harness/sim/lower_bound.py``): no schedule beats it, and each of its
charges is what its docstring derives."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import numpy as np
import pytest

from targets.api import TraceEvent
from targets.harness.sim.cost_model import ClusterCosts, CostModel
from targets.harness.sim.lower_bound import (
    DecodeCharges,
    engine_options,
    lendable_serving_devices,
    step_lower_bound,
)
from targets.spec import load_target


def _benchmark(name: str):
    """A script of ``benchmarks/`` as a module (its shapes parametrize a test at collection)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent.parent / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


saturated_engine = _benchmark("saturated_engine")
SHAPES, serve_all, _one_step = saturated_engine.SHAPES, saturated_engine.serve_all, saturated_engine.one_step_trace


@pytest.fixture(scope="module")
def big():
    return load_target("qwen3-235b-a22b-h800x160")


def _alone_token_s(cost: CostModel, context: float) -> float:
    memory, compute = DecodeCharges.of([cost]).alone(np.array(float(context)))
    return float(max(memory, compute))


@pytest.mark.parametrize(
    "shape", SHAPES, ids=lambda s: f"{s.target}-{s.requests}x{s.prompt}+{s.response}-{s.draft}-{s.chunk}"
)
def test_a_saturated_engine_never_finishes_before_the_bound(shape):
    """One engine given every request at once (admitted by the KV it holds now, preempting when full, with
    drafts or prompt chunks where given) takes at least the bound's rollout work over its devices, and
    each request at least its time alone (``benchmarks/saturated_engine.py``). The first shape ran in 0.84
    of the bound that batched a turn at the size that fits its last token; the last in 0.83 of the bound
    that charged each chunked prompt an all-reduce latency of its own."""
    served = serve_all(shape)
    assert served.bound["rollout_bound_s"] <= served.took * (1 + 1e-9)
    assert served.bound["critical_path_bound_s"] * served.stretch <= served.took * (1 + 1e-9)
    assert served.least_over_alone >= 1 - 1e-9  # a lone dense turn: equal, rounding aside


@pytest.mark.parametrize(
    "scale, draft", [(1, 0), (1, 3), (2, 0), (2, 8)], ids=["node", "node-drafts", "two-nodes", "two-nodes-drafts"]
)
def test_the_charges_of_any_batch_the_cache_holds_add_up_to_no_more_than_its_step(big, scale, draft):
    """The MoE's step reads the experts its batch touches (concave in the batch), and across two nodes pays
    all-reduces: a sequence's charge at its context is a share of a step at the batch ``K / x``; whatever
    mix of contexts fills at most the cache, their charges (times the tokens a step gains) sum to at most
    the step's memory time."""
    (cost,) = [
        c for c in engine_options(big, ClusterCosts.from_spec(big).scaled(scale)) if c.engine_devices == 8 * scale
    ]
    one = DecodeCharges([(cost, draft)])
    capacity, gained, rng = cost.kv_capacity_tokens, cost.tokens_per_step(draft), random.Random(0)
    for _ in range(200):
        batch = rng.choice([1, 2, 5, 30, 300, 3000])
        contexts = np.array([rng.choice([1, 100, 5000, 60_000]) * rng.random() + 1 for _ in range(batch)])
        contexts *= min(1.0, capacity * rng.random() / contexts.sum())
        contexts = np.maximum(contexts, 1.0)
        if contexts.sum() > capacity:
            continue
        charged = float(one.shared(contexts).sum()) * gained / cost.engine_devices
        step = cost.decode_memory_s(batch, contexts.sum(), draft + 1) + cost.decode_step_fixed_s(batch * (draft + 1))
        assert charged <= step * (1 + 1e-9), (batch, contexts.sum())


def test_a_dense_token_is_charged_its_share_of_the_weights_and_its_own_kv_by_hand():
    """On one device of the 8B (no drafts, no all-reduces) the charge is linear in the context:
    ``x (W / R + overhead) / K + x beta`` device-seconds, ``W`` the bytes a step reads."""
    spec = load_target("qwen3-8b-h800x16")
    cost = CostModel.from_spec(spec)
    charges = DecodeCharges.of([cost])
    assert charges.options == [(cost, 0)] and cost.engine_devices == 1
    x = np.array([1.0, 700.0, 30_000.0])
    read = cost.read_bytes_per_s
    weights = (8.19e9 - 151936 * 4096) * 2  # what a step reads: not the untied input embedding
    by_hand = x * (weights / read + cost.decode_step_overhead_s) / cost.kv_capacity_tokens
    by_hand += x * cost.kv_bytes_per_token / read
    assert charges.shared(x) == pytest.approx(by_hand, rel=1e-12)


@pytest.mark.parametrize("prompt, response", [(60_000, 16), (64, 4000)], ids=["prefill-heavy", "decode-heavy"])
def test_the_work_bound_lets_a_prefill_hide_in_the_compute_decode_leaves_idle(prompt, response):
    """A prompt computed in chunks beside a memory-bound decode (chunked prefill) costs no device time of
    its own while the decode leaves compute idle: the bound's rollout work is the larger of the decode's
    reads and the compute (the prefill, and the decoded tokens' FLOPs), never their sum. By hand on the
    dense 8B, whose charges are linear in the context: a turn's tokens at their mean context."""
    spec = load_target("qwen3-8b-h800x16")
    cost = CostModel.from_spec(spec)
    devices = [f"h800:{i}" for i in range(16)]
    bound = step_lower_bound(
        spec, ClusterCosts.from_spec(spec), _one_step(devices, {"g0/e0": (prompt, response)}, 10.0)
    )
    mean = prompt + (response - 1) / 2
    read = cost.read_bytes_per_s
    weights = (8.19e9 - 151936 * 4096) * 2
    per_token = (weights / read + cost.decode_step_overhead_s) / cost.kv_capacity_tokens
    decode = response * mean * (per_token + cost.kv_bytes_per_token / read)
    computed = cost.prefill_s(prompt, 0) + response * cost.decode_compute_s(1, mean)
    assert bound["rollout_bound_s"] == pytest.approx(max(decode, computed) / len(devices), rel=1e-9)
    assert bound["rollout_bound_s"] < (decode + cost.prefill_s(prompt, 0)) / len(devices)
    assert (computed > decode) is (prompt > response)


def test_rollout_may_spread_over_the_serving_devices_it_may_borrow_training_may_not():
    """ROSE-like: rollout may borrow all but one of the 16 serving devices (``serving.py``), so the work
    bound spreads the rollout over 16 + 15 devices and the training over the job's 16."""
    spec = load_target("qwen3-8b-h800x16-serving")
    assert lendable_serving_devices(spec) == 15
    pools = [p if not p.serving else p.model_copy(update={"count": 1}) for p in spec.hardware.pools]
    alone = spec.model_copy(update={"hardware": spec.hardware.model_copy(update={"pools": pools})})
    assert lendable_serving_devices(alone) == 0
    costs = ClusterCosts.from_spec(spec)
    events = _one_step([f"h800:{i}" for i in range(16)], {f"g{i}/e0": (1000, 8000) for i in range(64)}, 100.0)
    lent, kept = step_lower_bound(spec, costs, events), step_lower_bound(alone, costs, events)
    assert lent["rollout_bound_s"] * 31 == pytest.approx(kept["rollout_bound_s"] * 16)
    assert lent["train_bound_s"] == kept["train_bound_s"] > 0
    assert lent["work_bound_s"] == pytest.approx(lent["rollout_bound_s"] + lent["train_bound_s"] * 16 / 31)
    assert lent["work_bound_s"] < kept["work_bound_s"]


def test_the_bound_decodes_at_the_cheapest_engine_size_a_stack_may_choose(big):
    """With ``simulator.max_engine_scale`` 2 a stack may run engines of twice the devices, so the bound
    counts each turn at the cheaper size: the 235B's path stays at engines of one node (8: 4.2 ms a token
    alone, against 6.1 across two nodes), the 8B's on one H100 falls by a third (engines of 2 within a
    node pay no traffic term); the default, 1, offers the target's size only."""

    def options(spec, scale):
        spec = spec.model_copy(update={"simulator": spec.simulator.model_copy(update={"max_engine_scale": scale})})
        return engine_options(spec, ClusterCosts.from_spec(spec))

    assert [c.engine_devices for c in options(big, 1)] == [8]
    wide = options(big, 2)
    assert [c.engine_devices for c in wide] == [8, 16]
    assert min(wide, key=lambda c: _alone_token_s(c, 8000)).engine_devices == 8
    dense = load_target("qwen3-8b-h100x8")
    one, two = options(dense, 2)
    assert _alone_token_s(two, 8000) < 0.7 * _alone_token_s(one, 8000)  # 6.0 ms against 9.1
    assert [
        c.engine_devices
        for c in options(dense.model_copy(update={"hardware": dense.hardware.model_copy(update={"count": 1})}), 4)
    ] == [1]


def test_the_critical_path_bound_never_exceeds_the_mean_step_time():
    """One long trajectory (a 1000 s tool call) trained at step 2 of ``a + 3`` short steps bounds the
    steps it spans, not every step: the run's single longest path over ``1 + a`` would be more than
    the mean step time it claims to bound; the per-step paths' mean is not."""
    spec = load_target("qwen3-8b-h800x16")
    a = spec.workload.staleness_limit
    steps = a + 3
    ends = [800.0, 1000.0] + [1000.0 + 10 * k for k in range(1, steps - 1)]
    events = [TraceEvent("run_start", 0.0, {"devices": [f"h800:{i}" for i in range(16)]})]
    for k, end in enumerate(ends, start=1):
        episode, latency = f"g{k}/e0", (999.0 if k == 2 else 1.0)
        events += [
            TraceEvent("env_reset", 0.0, {"episode": episode, "observation": 64}),
            TraceEvent(
                "env_step",
                latency,
                {"episode": episode, "action": 8, "observation": 8, "latency": latency, "done": True},
            ),
            TraceEvent("train", end, {"start": end - 1, "trajectories": [{"episode": episode, "tokens": 80}]}),
        ]
    events.append(TraceEvent("run_end", ends[-1]))
    bound = step_lower_bound(spec, ClusterCosts.from_spec(spec), events)
    mean_step = ends[-1] / steps
    assert 999.0 / (1 + a) > mean_step  # what the run's longest path alone would have claimed
    assert 0 < bound["critical_path_bound_s"] <= mean_step


def test_a_token_alone_is_charged_no_more_than_any_draft_length_s_step(big):
    """Decoded alone, a token costs at least its batch-1 step's memory or compute over ``E_k``; the charge
    is the least over the draft lengths, so no length a stack picks pays less (the 235B MoE with its
    workload's acceptance 0.5, and the dense 8B without any)."""
    dense = CostModel.from_spec(load_target("qwen3-8b-h100x8"))
    for cost in (CostModel.from_spec(big), dense):
        for context in (1, 4000, 60_000):
            least = _alone_token_s(cost, context)
            for k in range(9 if cost.draft_acceptance else 1):
                assert least <= cost.speculating(k, 1).decode_token_s(1, context) * (1 + 1e-12), (cost, context, k)
    assert DecodeCharges.of([dense]).options == [(dense, 0)]
