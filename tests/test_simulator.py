"""The cluster simulator: virtual time, the cost model's formulas by hand, the engine's KV limit and
prefix cache, the same controller modules on the simulated cluster (audited), the production-scale
target's ordering of schedules, calibration from a real run, and the bench on a simulated target."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from orchestrator.cli import app
from skills.starter import write_starter
from targets.api import Device, GenerateRequest, SamplingParams
from targets.harness.isolation.launch import Limits, run_harness
from targets.harness.isolation.sandbox import Sandbox
from targets.harness.judge.audit import audit_run
from targets.harness.measure.metrics import compute_metrics
from targets.harness.sim.cluster import SimCluster
from targets.harness.sim.cost_model import ClusterCosts, CostModel
from targets.harness.sim.engine import SimEngine
from targets.harness.sim.lower_bound import engine_options, step_lower_bound
from targets.harness.sim.response_length import ResponseLengths
from targets.harness.sim.virtual_time import SimulationStalled, VirtualTimeLoop, run_virtual
from targets.harness.target import Target
from targets.harness.trace import Trace
from targets.spec import load_target, parse_target

runner = CliRunner()


# -- virtual time ----------------------------------------------------------------------------------


def test_virtual_time_jumps_to_the_next_timer_and_keeps_asyncio_semantics():
    loop = VirtualTimeLoop()

    async def main():
        event = asyncio.Event()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), timeout=3600)  # an hour of virtual time
        ends = await asyncio.gather(*(asyncio.sleep(10 * i, result=i) for i in range(4)))
        return loop.time(), ends

    assert run_virtual(main(), loop) == (3630.0, [0, 1, 2, 3])


def test_a_controller_waiting_on_nothing_stalls_loudly():
    async def waits_forever():
        await asyncio.Event().wait()

    with pytest.raises(SimulationStalled, match="no timer is pending"):
        run_virtual(waits_forever())


# -- cost model ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big():
    return load_target("qwen3-235b-a22b-h800x160")


def test_cost_model_formulas_by_hand(big):
    cost = CostModel.from_spec(big)
    # 235B bf16 = 470 GB: 8 H800s of 80 GiB (72 GiB usable each) hold the weights with room for KV.
    assert cost.engine_devices == 8
    kv_per_token = 2 * 94 * 8 * 128 * 2  # 4 KV heads on 8 devices: each device holds one, so each is stored twice
    assert cost.kv_bytes_per_token == kv_per_token
    assert cost.kv_capacity_tokens == int((8 * 80 * 2**30 * 0.9 - 470e9) / kv_per_token)
    # batch 1: bandwidth-bound; the dense part plus 8 of 128 experts per layer are read, not the untied
    # input embedding (a step reads its tokens' rows of it)
    lookup = 151936 * 4096
    dense, experts = 235e9 - 94 * 128 * 3 * 4096 * 1536 - lookup, 94 * 128 * 3 * 4096 * 1536
    weights = (dense + experts * (8 / 128)) * 2
    all_reduces = 2 * 94 * 2 * 7 / 8 * 4096 * 2 / 200e9  # one position's two all-reduces a layer over NVLink
    expected = (weights + 1000 * kv_per_token) / (8 * 3350e9 * 0.8) + 0.003 + all_reduces
    assert cost.decode_iteration_s(1, 1000) == pytest.approx(expected)
    # many tokens touch almost every expert: the iteration approaches a full weight read
    assert cost.decode_iteration_s(512, 0) > 0.99 * 470e9 / (8 * 3350e9 * 0.8)
    # training: 6 * active * tokens + attention, at the spec's MFU over the devices
    train = (6 * (22e9 - lookup) * 1000 + 6 * 94 * 64 * 128 * 1000**2) / (128 * 989e12 * 0.4) + 1.0
    assert cost.train_s([1000], 128) == pytest.approx(train)


def test_an_untied_input_embedding_is_held_but_not_read_each_step_and_a_tied_one_is(big):
    """vLLM reads a step's tokens' rows of the input embedding and multiplies none of it: an untied table
    (the 235B's, 0.6 B parameters) counts in the weights an engine holds, syncs and offloads, not in a decode
    step's reads or any FLOPs; tied, it is the output head, read whole and multiplied every step."""
    untied = CostModel.from_spec(big)
    config = big.model.config.model_copy(update={"tie_word_embeddings": True})
    tied = CostModel.from_spec(big.model_copy(update={"model": big.model.model_copy(update={"config": config})}))
    lookup = 151936 * 4096
    assert untied.lookup_params == lookup and tied.lookup_params == 0
    assert untied.weight_bytes == tied.weight_bytes == 235e9 * 2  # the stated total, held either way
    assert tied.decode_bytes(1, 0) - untied.decode_bytes(1, 0) == pytest.approx(lookup * 2)
    assert tied.decode_flops(1, 0) - untied.decode_flops(1, 0) == pytest.approx(2 * lookup)
    assert untied.sync_s() == tied.sync_s() and untied.kv_capacity_tokens == tied.kv_capacity_tokens


def test_an_engine_pays_its_all_reduces_bytes_over_nvlink_and_across_nodes_over_the_inter_node_link_by_hand(big):
    """An engine of 8 H800s pays, each step, two ring all-reduces a layer of its positions' activations over
    NVLink (their latency is in the step's fitted overhead): 13.5 us a position, as much as a prefill's
    linear compute. Engines of 16 span two nodes of 8: hierarchical, the inter-node hop besides. An engine
    of one device pays nothing."""
    node = CostModel.from_spec(big)
    activations = 64 * 4096 * 2  # 64 positions of the 4096-wide activations
    within = 2 * 94 * 2 * 7 / 8 * activations / 200e9
    assert node.tensor_parallel_s(64) == pytest.approx(within)
    assert node.tensor_parallel_s(1) == pytest.approx(13.5e-6, rel=0.01)
    assert dataclasses.replace(node, engine_devices=1).tensor_parallel_s(64) == 0.0
    wide = CostModel.from_spec(
        big.model_copy(update={"simulator": big.simulator.model_copy(update={"engine_devices": 16})})
    )
    across = within + 2 * 94 * (30e-6 + 2 * (2 - 1) / 2 * activations / 8 / 50e9)
    assert wide.tensor_parallel_s(64) == pytest.approx(across)
    bandwidth = dataclasses.replace(node, engine_devices=16).decode_bytes(64, 64_000) / (16 * 3350e9 * 0.8)
    assert wide.decode_iteration_s(64, 64_000) == pytest.approx(bandwidth + 0.003 + across)
    assert wide.prefill_s(1000, 0) == pytest.approx(node.prefill_compute_s(1000, 0) / 2 + wide.tensor_parallel_s(1000))


def test_an_engine_wider_than_the_kv_heads_stores_them_replicated(big):
    """vLLM's tensor parallelism gives each device at least one KV head a layer: Qwen3-235B's 4 on an engine
    of 8 are stored twice, on 16 four times (half and a quarter of the tokens counting 4 would hold); an
    engine no wider than the heads stores each once."""
    per_head = 2 * 94 * 128 * 2
    cost = CostModel.from_spec(big)
    assert [dataclasses.replace(cost, engine_devices=d).kv_bytes_per_token for d in (1, 4, 8, 16)] == [
        4 * per_head,
        4 * per_head,
        8 * per_head,
        16 * per_head,
    ]
    wide = dataclasses.replace(cost, kv_heads=16)
    assert wide.kv_bytes_per_token == 16 * per_head
    assert cost.kv_capacity_tokens == int((8 * 80 * 2**30 * 0.9 - 470e9) / (8 * per_head))


def test_speculative_decoding_by_hand_pays_on_a_dense_model_in_the_tail_not_on_a_moe_at_batch_1(big):
    """``E = (1 - a^(k+1)) / (1 - a)`` tokens per verification of ``k + 1`` positions: on the dense 8B,
    batch 1 reads the weights once for E tokens (half the time a token); the 235B MoE's four draft
    positions route to their own experts, so at batch 1 a verification reads ~3x the expert bytes for
    under 2x the tokens and saves only the step's fixed overhead; compute-bound (a full batch without
    context), drafts only cost. With acceptance 0 nothing changes."""
    dense_spec = load_target("qwen3-8b-h100x8")
    tokens = dense_spec.workload.tokens.model_copy(update={"draft_acceptance": 0.5})
    dense = CostModel.from_spec(
        dense_spec.model_copy(update={"workload": dense_spec.workload.model_copy(update={"tokens": tokens})})
    )
    assert dense.tokens_per_step(4) == pytest.approx((1 - 0.5**5) / 0.5)  # 1.9375
    drafting = dense.speculating(4, 8)
    plain_1 = dense.decode_iteration_s(1, 4000)
    assert drafting.decode_token_s(1, 4000) == pytest.approx(dense.decode_iteration_s(1, 4000, 5) / 1.9375)
    assert drafting.decode_token_s(1, 4000) < 0.6 * plain_1  # the weights read once for ~1.9 tokens
    assert drafting.decode_token_s(9, 9 * 4000) == dense.decode_iteration_s(9, 9 * 4000)  # above the batch limit
    full = dense.speculating(4, 1024)
    assert full.decode_token_s(1024, 0) > dense.decode_iteration_s(1024, 0)  # compute-bound: drafts only cost
    moe = CostModel.from_spec(big)  # its catalog workload: half the drafted tokens kept
    assert moe.draft_acceptance == 0.5
    assert moe.speculating(4, 8).decode_token_s(1, 4000) > 0.9 * moe.decode_iteration_s(1, 4000)
    plain = CostModel.from_spec(dense_spec)  # the 8B's workload: no acceptance given
    assert plain.draft_acceptance == 0 and plain.decode_token_s(16, 16_000) == plain.decode_iteration_s(16, 16_000)


def test_engine_settings_a_hello_cannot_carry_are_refused_by_name():
    from targets.harness.ipc.protocol import ProtocolError
    from targets.harness.ipc.wire import get_engine_settings

    reward = {"reward": "colocated", "reward_devices": [], "engine_scale": 1, "host_kv_tokens": 0, "prefill_chunk": 0}
    assert get_engine_settings({"speculative_tokens": 4, "speculative_batch": 8, **reward}).speculative_tokens == 4
    with pytest.raises(ProtocolError, match="engine.engine_scale: 3 is not one of 1, 2, 4"):
        get_engine_settings({"speculative_tokens": 4, "speculative_batch": 8, **reward, "engine_scale": 3})
    with pytest.raises(ProtocolError, match=r"engine.speculative_tokens: 9 is not in \[0, 8\]"):
        get_engine_settings({"speculative_tokens": 9, "speculative_batch": 8, **reward})
    with pytest.raises(ProtocolError, match="engine.host_kv_tokens: -8 is negative"):
        get_engine_settings({"speculative_tokens": 4, "speculative_batch": 8, **reward, "host_kv_tokens": -8})
    with pytest.raises(ProtocolError, match="engine.prefill_chunk: -512 is negative"):
        get_engine_settings({"speculative_tokens": 4, "speculative_batch": 8, **reward, "prefill_chunk": -512})
    with pytest.raises(ProtocolError, match="engine.speculative_batch: -1 is negative"):
        get_engine_settings({"speculative_tokens": 4, "speculative_batch": -1, **reward})
    with pytest.raises(ProtocolError, match="speculative_tokens"):
        get_engine_settings({"speculative_batch": 8, **reward})
    with pytest.raises(ProtocolError, match="engine.reward: 'nearby' is not one of colocated, dedicated, serverless"):
        get_engine_settings({"speculative_tokens": 0, "speculative_batch": 0, **reward, "reward": "nearby"})
    with pytest.raises(ProtocolError, match="engine.reward_devices: .* not a list of distinct device ids"):
        get_engine_settings(
            {
                "speculative_tokens": 0,
                "speculative_batch": 0,
                **reward,
                "reward": "dedicated",
                "reward_devices": ["a", "a"],
            }
        )


def test_a_model_too_big_for_the_cluster_is_refused(big):
    small = big.model_copy(update={"hardware": big.hardware.model_copy(update={"count": 4})})
    with pytest.raises(ValueError, match="need 8 devices per engine, but hardware.count is 4"):
        CostModel.from_spec(small)
    # two devices an engine, as a spec may say: 470 GB of weights and no room for KV (every request
    # failed on a KV capacity of 0 that named no field)
    pinned = big.model_copy(update={"simulator": big.simulator.model_copy(update={"engine_devices": 2})})
    with pytest.raises(ValueError, match=r"simulator.engine_devices 2: .* room for 0 KV tokens an engine, fewer than"):
        CostModel.from_spec(pinned)


# -- one engine ------------------------------------------------------------------------------------


def _engine_run(cost: CostModel, body):
    loop = VirtualTimeLoop()

    async def main():
        engine = SimEngine("e", ["d0"], cost)
        try:
            return await body(engine, loop)
        finally:
            engine.close()

    return run_virtual(main(), loop)


def test_a_long_decode_reads_its_kv_as_it_grows():
    """A 30K-token tail was priced at its first context the whole way, 8% under the documented
    per-iteration formula and under the fluid bound (which prices a turn at its midpoint)."""
    cost = CostModel.from_spec(load_target("qwen3-8b-h100x8"))

    async def body(engine, loop):
        await engine.submit("a", 100, 30_000)
        return loop.time()

    by_iteration = cost.prefill_s(100, 0) + sum(cost.decode_token_s(1, 100 + i) for i in range(30_000))
    assert _engine_run(cost, body) == pytest.approx(by_iteration, rel=1e-3)

    async def woken(engine, loop):  # a wake every second that changes nothing (an arrival elsewhere would)
        turn = engine.submit("a", 100, 30_000)
        while not turn.done():
            await asyncio.sleep(1.0)
            engine.reload()
        return (await turn).tokens, engine.decode_seconds

    # a run cut short is credited at the context it reached, not at the whole run's midpoint (which
    # made every wake's first second decode too little: 4% slower with a wake a second)
    tokens, decode_seconds = _engine_run(cost, woken)
    assert len(tokens) == 30_000
    assert decode_seconds == pytest.approx(by_iteration - cost.prefill_s(100, 0), rel=1e-3)


def test_kv_capacity_queues_what_does_not_fit(big):
    cost = CostModel.from_spec(big)
    most = cost.kv_capacity_tokens - 200

    async def body(engine, loop):
        first = engine.submit("a", most, 100)
        second = engine.submit("b", 300, 100)  # its context does not fit beside the first's: waits
        done_first = (await first, loop.time())[1]
        done_second = (await second, loop.time())[1]
        return done_first, done_second, engine.preemptions

    first, second, preemptions = _engine_run(cost, body)
    assert second > first and preemptions == 0  # served after, not beside, the first


def test_kv_grows_with_the_tokens_and_a_full_cache_preempts_the_newest(big):
    """Admission looks at what the running sequences hold now, not at their budgets; when their
    growth fills the cache the last admitted is preempted and later prefilled again from scratch."""
    cost = CostModel.from_spec(big)
    half = cost.kv_capacity_tokens // 2

    async def body(engine, loop):
        first = engine.submit("a", half - 100, 1000)  # the two budgets together exceed the cache
        second = engine.submit("b", half - 100, 1000)
        await asyncio.sleep(1e-6)
        both_running = len(engine.running)
        a, b = await first, await second
        return both_running, engine.preemptions, a, b, engine.peak_kv_tokens

    both_running, preemptions, a, b, peak = _engine_run(cost, body)
    assert both_running == 2 and preemptions == 1
    assert len(a.tokens) == len(b.tokens) == 1000 and a.finish_reason == b.finish_reason == "length"
    assert peak <= cost.kv_capacity_tokens


def test_a_preempted_sequence_comes_back_from_the_host_tier_instead_of_prefilling_again(big):
    """With a host tier the preempted sequence's context (all but its last token) is saved as it leaves and
    restored when it is readmitted, as the paged engine's tier does (vLLM's KV offloading): the second prefill
    of the test above computes one token, and the pair finishes sooner."""
    plain = CostModel.from_spec(big)
    half = plain.kv_capacity_tokens // 2

    async def body(engine, loop):
        first, second = engine.submit("a", half - 100, 1000), engine.submit("b", half - 100, 1000)
        await first, await second
        return loop.time(), engine.preemptions, engine.prefilled_tokens, engine.restored_tokens

    end, preemptions, prefilled, restored = _engine_run(plain, body)
    tiered_end, tiered_preemptions, tiered_prefilled, tiered_restored = _engine_run(
        plain.with_host_tier(plain.kv_capacity_tokens), body
    )
    assert preemptions == tiered_preemptions == 1 and restored == 0
    assert tiered_restored > half - 100  # its prompt and what it had decoded, but the last token
    assert tiered_prefilled == prefilled - tiered_restored and tiered_end < end


@pytest.mark.parametrize("engine_devices", [8, 16], ids=["one node", "two nodes"])
def test_chunked_prefill_keeps_the_batch_decoding_while_a_long_prompt_is_computed_beside_it(big, engine_devices):
    """With ``prefill_chunk`` a request admitted while another decodes is computed a chunk an iteration
    beside it (stall-free batching): the decoding one never pauses, so it finishes sooner than when decode
    stops for the whole prompt; the newcomer's first token comes later (its prompt shares iterations); by
    hand, those iterations take ``max(memory, compute + chunk's compute) + overhead + all-reduces`` each.
    A chunk's all-reduces are its step's, once (across nodes they were counted in its share too: +19%)."""
    spanning = big.model_copy(update={"simulator": big.simulator.model_copy(update={"engine_devices": engine_devices})})
    paused = CostModel.from_spec(spanning)
    assert paused.tensor_parallel_s(1) > 0  # within a node over NVLink, across nodes over the link besides
    chunked = paused.chunking(2048)

    async def body(engine, loop):
        first = engine.submit("a", 1000, 2000)
        await asyncio.sleep(0.5)  # a decodes alone
        started: list[float] = []
        second = engine.submit("b", 60_000, 50, started=lambda: started.append(loop.time()))
        await asyncio.sleep(1e-6)
        joining = len(engine.joining)
        a, a_done = await first, loop.time()
        b = await second
        return a_done, started[0], joining, len(a.tokens), len(b.tokens), engine.prefill_seconds

    a_paused, b_first_paused, joining_paused, *tokens_paused, pause = _engine_run(paused, body)
    a_chunked, b_first_chunked, joining_chunked, *tokens_chunked, no_pause = _engine_run(chunked, body)
    assert tokens_paused == tokens_chunked == [2000, 50] and joining_paused == 0 < joining_chunked == 1
    assert a_chunked < a_paused and b_first_chunked > b_first_paused and no_pause < pause
    prompt_s = paused.prefill_compute_s(60_000, 0)
    iteration = paused.decode_iteration_s(
        1, 1000 + 0.5 / paused.decode_token_s(1, 1000), 1, (2048 * prompt_s / 60_000, 2048)
    )
    assert iteration > paused.decode_iteration_s(1, 1000) and iteration * 60_000 / 2048 > prompt_s
    assert b_first_chunked - 0.5 == pytest.approx(iteration * 60_000 / 2048, rel=0.02)


def test_a_request_aborted_while_its_prompt_is_computed_in_chunks_is_answered_and_frees_its_kv(big):
    chunked = CostModel.from_spec(big).chunking(512)

    async def body(engine, loop):
        first = engine.submit("a", 1000, 5000)
        await asyncio.sleep(0.1)
        second = engine.submit("b", 40_000, 50)
        await asyncio.sleep(0.05)
        held = engine._held
        engine.abort()
        return held, await first, await second, engine.joining, engine._held

    held, a, b, joining, left = _engine_run(chunked, body)
    assert held > 40_000 and a.finish_reason == b.finish_reason == "abort" and len(b.tokens) == 0
    assert not joining and left == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("late", [4171.229803885347, 12345.678901234, 98765.4321])
def test_a_full_cache_late_in_a_run_preempts_and_goes_on(big, late):
    """Many sequences filling the cache hours into a run: a chunk's end is credited whole. Credited
    from the clock, the chunk before the cache filled could fall 1e-11 iterations short, and the next
    chunk (under the clock's resolution at that hour) then decoded nothing, for ever: a paper-scale
    judge run hung so at 4171 s."""
    cost = CostModel.from_spec(big)
    sequences = 97

    async def body(engine, loop):
        await asyncio.sleep(late)
        share = cost.kv_capacity_tokens // sequences
        futures = [engine.submit(f"g{i}/e0", share - 1000 - 7 * i, 3000) for i in range(sequences)]
        done = [await f for f in futures]
        return done, engine.preemptions

    done, preemptions = _engine_run(cost, body)
    assert preemptions > 0 and all(len(c.tokens) == 3000 for c in done)


def test_a_turn_stops_at_its_drawn_length(big):
    cost = CostModel.from_spec(big)

    async def body(engine, loop):
        short = await engine.submit("a", 100, 1000, length=37)
        whole = await engine.submit("b", 100, 1000, length=1000)
        return short, whole

    short, whole = _engine_run(cost, body)
    assert (len(short.tokens), short.finish_reason) == (37, "stop")
    assert (len(whole.tokens), whole.finish_reason) == (1000, "length")


def test_response_lengths_are_long_tailed_with_the_spec_mean_and_persist_per_task(big):
    from targets.harness.sim.response_length import ResponseLengths

    tokens = big.workload.tokens
    assert tokens.response_length is not None
    lengths = ResponseLengths(tokens, seed=0)
    draws = {(g, e, t): lengths.of(f"g{g}/e{e}", t) for g in range(300) for e in range(4) for t in range(4)}
    values = sorted(draws.values())
    mean = sum(values) / len(values)
    assert abs(mean - tokens.response_length.mean) < 0.1 * tokens.response_length.mean
    assert values[-1] <= tokens.response and values[len(values) * 99 // 100] > 4 * values[len(values) // 2]
    assert lengths.of("g3/e1", 2) == ResponseLengths(tokens, seed=0).of("g3/e1", 2)  # a retry is the same length
    # per-task persistence: a group's members are more alike than members of different groups
    by_group = [sum(draws[(g, e, t)] for e in range(4) for t in range(4)) / 16 for g in range(300)]
    within = sum(abs(draws[(g, 0, 0)] - draws[(g, 1, 1)]) for g in range(300)) / 300
    across = sum(abs(draws[(g, 0, 0)] - draws[((g + 1) % 300, 1, 1)]) for g in range(300)) / 300
    assert within < 0.8 * across and max(by_group) > 5 * min(by_group)


def test_a_response_mean_beyond_the_budget_is_refused():
    from targets.spec import TokensSpec

    with pytest.raises(ValueError, match="response_length.mean"):
        TokensSpec(
            prompt=10, observation=4, response=16, max_sequence=64, response_length={"mean": 16, "turn_sigma": 1}
        )


def test_the_next_turn_reuses_the_cached_prefix(big):
    cost = CostModel.from_spec(big)

    async def body(engine, loop):
        await engine.submit("a", 20_000, 10)
        start = loop.time()
        await engine.submit("a", 20_010 + 500, 10)  # same episode: prefill only the 500 new tokens
        warm = loop.time() - start
        start = loop.time()
        await engine.submit("b", 20_510, 10)  # another episode: the whole prompt
        return warm, loop.time() - start

    warm, cold = _engine_run(cost, body)
    assert cold - warm == pytest.approx(cost.prefill_s(20_510, 0) - cost.prefill_s(500, 20_010), rel=1e-6)


def test_a_host_tier_gives_back_an_evicted_prefix_at_the_link_s_speed_until_a_weight_load(big):
    """Another episode's long context evicts the first one's prefix; its next turn prefills the whole
    context again, or with a host tier restores it, paying the copies out (b's prefix, evicted in turn)
    and back over the host link instead. After a weight load neither tier holds anything."""
    full = CostModel.from_spec(big).kv_capacity_tokens - 1000

    def turn_after_eviction(tier: int):
        cost = CostModel.from_spec(big).with_host_tier(tier)

        async def body(engine, loop):
            await engine.submit("a", 20_000, 10)  # a's 20,010 tokens cached
            await engine.submit("b", full, 10)  # b needs the room: a's prefix is evicted
            assert ("a" in engine.host) is bool(tier) and "a" not in engine.cached
            start = loop.time()
            await engine.submit("a", 20_010 + 500, 10)
            took, restored = loop.time() - start, engine.restored_tokens
            await engine.load_weights(1, 0.0)
            assert not engine.cached and not engine.host  # the old weights' keys and values
            await engine.submit("a", 20_520 + 500, 10)
            assert engine.restored_tokens == restored
            return took, restored

        return cost, _engine_run(cost, body)

    cost, (with_tier, restored) = turn_after_eviction(10**6)
    _, (without, none) = turn_after_eviction(0)
    assert restored == 20_010 and none == 0
    saved = cost.prefill_s(20_510, 0) - cost.prefill_s(500, 20_010) - cost.restore_s(20_010) - cost.restore_s(full + 10)
    assert without - with_tier == pytest.approx(saved, rel=1e-6)


def test_an_engine_says_how_long_a_request_waited_and_what_prefix_it_reused(big):
    """What calibration reads of an engine's work (``Completion.queued_s``, ``cached_tokens``): a request
    that waited for KV room says for how long (its time until admission, not its decoding), the next
    turn of a cached episode says its prefix, and one whose prefix was evicted says none."""
    full = CostModel.from_spec(big).kv_capacity_tokens - 1000

    async def body(engine, loop):
        first = await engine.submit("a", 20_000, 10)
        big_one = asyncio.ensure_future(engine.submit("b", full - 2_000, 2_000))  # holds the cache a while
        await asyncio.sleep(0)
        asked = loop.time()
        blocked = await engine.submit("c", 5_000, 10)  # no room until b is done
        took = loop.time() - asked
        again = await engine.submit("c", 5_010 + 100, 10)  # c's prefix cached
        evicted = await engine.submit("a", 20_010 + 100, 10)  # a's was evicted by b
        return first, await big_one, blocked, took, again, evicted

    first, b, blocked, took, again, evicted = _engine_run(CostModel.from_spec(big), body)
    assert first.queued_s == 0.0 and b.queued_s == 0.0 and first.cached_tokens == 0
    cost = CostModel.from_spec(big)
    # it waited until b ended, then was prefilled and decoded: its wait is its latency less its own work
    own = cost.prefill_s(5_000, 0) + sum(cost.decode_token_s(1, 5_000 + i) for i in range(10))
    assert blocked.queued_s == pytest.approx(took - own, rel=1e-3) and blocked.queued_s > 10 * own
    assert again.cached_tokens == 5_010 and again.queued_s == 0.0
    assert evicted.cached_tokens == 0


def test_a_host_tier_larger_than_the_engines_host_memory_is_refused(big):
    from targets.api import EngineSettings
    from targets.harness.sim.cost_model import ClusterCosts

    costs = ClusterCosts.from_spec(big)
    limit = costs.shared.host_tier_limit_tokens  # 8 devices of 256 GiB, 188 KB a token
    assert limit == int(8 * 256 * 2**30 / costs.shared.kv_bytes_per_token)
    assert costs.refusal(EngineSettings(host_kv_tokens=limit), 1) is None
    assert "over its devices' host memory" in costs.refusal(EngineSettings(host_kv_tokens=limit + 1), 1)


def test_abort_answers_everything_with_partial_tokens(big):
    cost = CostModel.from_spec(big)

    async def body(engine, loop):
        running = engine.submit("a", 100, 1000)
        queued = engine.submit("b", cost.kv_capacity_tokens - 50, 10)  # does not fit beside the first
        await asyncio.sleep(1.0)
        engine.abort()
        return await running, await queued

    running, queued = _engine_run(cost, body)
    assert running.finish_reason == queued.finish_reason == "abort"
    assert 0 < len(running.tokens) < 1000 and len(queued.tokens) == 0


def test_a_cancelled_request_gives_its_kv_back_at_once_and_is_never_answered(big):
    """A dropped spare's turn decoded on to its end, holding the KV a queued turn waited for. Cancelled,
    it leaves the batch at once: the queued turn is admitted then, not when the spare would have
    finished; a cancel of a queued or answered request is harmless, and neither is ever answered."""
    cost = CostModel.from_spec(big)
    told, admitted = [], []

    async def body(engine, loop, cancel: bool):
        running = engine.submit("a", 100, 1000, done=told.append)
        # does not fit beside "a": admitted when "a" leaves the batch
        queued = engine.submit("b", cost.kv_capacity_tokens - 50, 10, started=lambda: admitted.append(loop.time()))
        never = engine.submit("c", 10, 10, done=told.append)  # behind "b"
        await asyncio.sleep(1.0)
        if cancel:
            engine.cancel(running)
            engine.cancel(never)  # still queued
            engine.cancel(never)  # twice
        return await queued

    _engine_run(cost, lambda e, loop: body(e, loop, False))
    assert [c.finish_reason for c in told] == ["length", "length"]  # "a" and "c", in full
    (kept_at,) = admitted
    told.clear(), admitted.clear()
    b = _engine_run(cost, lambda e, loop: body(e, loop, True))
    assert told == [] and b.finish_reason == "length"  # the cancelled ones are never answered
    (cancelled_at,) = admitted
    prefill = cost.prefill_s(cost.kv_capacity_tokens - 50, 0)
    assert cancelled_at == pytest.approx(1.0 + prefill, abs=0.01)  # its prefill began at the cancel
    assert kept_at > cancelled_at + 3  # without it, after "a"'s 1000 tokens (5 s of decode)


def test_static_batching_admits_only_between_batches():
    spec = load_target("tiny-qwen3-cpu")
    continuous = CostModel.from_spec(spec)
    static = CostModel.from_spec(
        spec.model_copy(update={"simulator": spec.simulator.model_copy(update={"batching": "static"})})
    )

    async def body(engine, loop):
        engine.submit("a", 10, 200)  # a long request runs first
        await asyncio.sleep(0.01)
        short = engine.submit("b", 10, 5)
        await short
        return loop.time()

    assert _engine_run(static, body) > 5 * _engine_run(continuous, body)


# -- the same controllers on the simulated cluster -------------------------------------------------


def _simulated(tmp_path, spec, controller, steps=None, seed=0, params=None):
    """The starter for ``controller`` (its ``params`` over the defaults) run on the simulator through the
    harness, as any judged run: the controller in a process of its own, virtual time kept by the harness."""
    from skills.starter import starter_params

    spec = spec.model_copy(update={"execution": "simulated"})
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{spec.id}-{controller}.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    chosen = {**starter_params(spec, controller), **(params or {})}
    stack = write_starter(tmp_path / controller, spec, controller, chosen)
    run = run_harness(
        Target.load(path),
        stack,
        tmp_path / f"out-{controller}-{seed}",
        "measure",
        Limits(time_s=600),
        Sandbox.detect("subprocess"),
        seed=seed,
        steps=steps,
    )
    assert run.ok, run.cause
    return spec, Trace.load_events(run.out / "trace.jsonl"), run.results["system"]


@pytest.mark.parametrize("controller", ["colocate", "static_split", "time_multiplex"])
def test_each_recipe_controller_runs_on_the_simulator_and_passes_the_audit(tmp_path, controller):
    spec, events, system = _simulated(tmp_path, load_target("tiny-qwen3-cpu"), controller)
    result = audit_run(spec, events, lambda v: None, lambda s: None, spec.workload.train_steps)
    assert result.passed, result.reasons
    # what benchmarks/sim_scaling.py splits the wall time by: each side's CPU time, the controller's
    # counted because a plain subprocess is reaped by the harness
    assert system["harness_cpu_seconds"] > 0 and system["controller_cpu_seconds"] > 0, system
    assert "simulated run" in result.details["skipped"]
    assert sum(1 for e in events if e.kind == "train") == spec.workload.train_steps


def test_a_simulated_environment_takes_its_reset_time_before_its_first_prompt(tmp_path):
    """``workload.env_reset_s`` (a sandbox's start) through the harness's link under virtual time: every reset
    answers its 20 s after it was asked, no episode's first turn is forwarded before, the audit passes, and
    the run is longer than the same run with resets at once by at least one reset."""
    from targets.spec import Fixed

    spec = load_target("tiny-qwen3-cpu")
    resets = spec.workload.model_copy(update={"env_reset_s": Fixed(kind="fixed", value=20.0)})
    slow = spec.model_copy(update={"workload": resets})
    runs = {}
    for name, target in (("at-once", spec), ("slow", slow)):
        target, events, _ = _simulated(tmp_path / name, target, "colocate")
        result = audit_run(target, events, lambda v: None, lambda s: None, target.workload.train_steps)
        assert result.passed, result.reasons
        runs[name] = events
    events = runs["slow"]
    resets = {e.data["episode"]: e for e in events if e.kind == "env_reset"}
    assert resets and all(e.data["latency"] == pytest.approx(20.0) for e in resets.values())
    first = {}
    for e in events:
        if e.kind == "generate":
            first.setdefault(e.data["episode"], e.data["start"])
    assert first and all(start >= resets[episode].t for episode, start in first.items())

    def duration(events):
        return next(e.t for e in events if e.kind == "run_end") - next(e.t for e in events if e.kind == "run_start")

    assert duration(runs["slow"]) >= duration(runs["at-once"]) + 20.0


def test_a_simulated_run_is_the_same_run_on_a_busy_machine(tmp_path):
    """Virtual time must not depend on how fast either process runs: a CI run fitted one trace twice
    and the twin predicted +7.4% then +5.9%, because half a burst reached the other side and its
    callbacks ran before the rest arrived. The same run again, with every core busy, is identical."""
    import subprocess
    import sys

    spec = load_target("tiny-qwen3-cpu")
    (tmp_path / "quiet").mkdir(), (tmp_path / "busy").mkdir()
    _, quiet, _ = _simulated(tmp_path / "quiet", spec, "time_multiplex", steps=2)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4)]
    try:
        _, busy, _ = _simulated(tmp_path / "busy", spec, "time_multiplex", steps=2)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert len(quiet) > 100
    assert [(e.kind, e.t, e.data) for e in busy] == [(e.kind, e.t, e.data) for e in quiet]


def test_the_twin_charges_the_harness_s_weight_export_and_calibration_fits_it(tmp_path):
    """A real run's train call waits for the harness's copy of the weights (21-24 s a step for the 0.6B
    on the first H100 run, a fifth of its step): the twin charges its fitted ``weight_export_s`` after
    every step, and calibration reads it back from the ``weight_export`` events."""
    from targets.harness.sim.calibrate import calibrate

    spec = load_target("tiny-qwen3-cpu")
    exporting = spec.model_copy(update={"simulator": spec.simulator.model_copy(update={"weight_export_s": 3.0})})
    _, events, _ = _simulated(tmp_path, exporting, "colocate", steps=2)
    exports = [e for e in events if e.kind == "weight_export"]
    assert [e.t - e.data["start"] for e in exports] == pytest.approx([3.0, 3.0])
    assert calibrate(spec, [events]).simulator.weight_export_s == pytest.approx(3.0)
    (tmp_path / "plain").mkdir()
    _, plain, _ = _simulated(tmp_path / "plain", spec, "colocate", steps=2)
    assert [e.t - e.data["start"] for e in plain if e.kind == "weight_export"] == [0.0, 0.0]


def test_the_audit_still_catches_a_planted_cheat_in_a_simulated_trace(tmp_path):
    spec, events, _ = _simulated(tmp_path, load_target("tiny-qwen3-cpu"), "time_multiplex")
    train = next(e for e in events if e.kind == "train")
    train.data["trajectories"].append(dict(train.data["trajectories"][0]))
    result = audit_run(spec, events, lambda v: None, lambda s: None, spec.workload.train_steps)
    assert not result.passed and any("used twice" in r for r in result.reasons)


def test_a_controller_that_says_done_before_its_last_step_is_exported_is_refused(tmp_path):
    """A red team's controller fired its training call, polled ``sync_weights`` until the new version existed
    (the simulator has it before the harness's export, whose time it charges, and a failed sync leaves no
    trace) and went on: its last step was counted, recorded before its export, and the run ended with the
    controller's ``done`` one export early (20 of 734 simulated seconds on an 8B twin). A controller says done
    only once every training call it made has returned."""
    from tests.planting import planted

    spec = load_target("tiny-qwen3-cpu")
    spec = spec.model_copy(
        update={
            "execution": "simulated",
            "simulator": spec.simulator.model_copy(update={"weight_export_s": 5.0}),
        }
    )
    target = tmp_path / "target.yaml"
    target.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    early = (
        "        pending = __import__('asyncio').ensure_future(\n"
        "            cluster.train(TrainBatch(batch, group_advantages(batch)), devices)\n"
        "        )\n"
        "        self._planted = [*getattr(self, '_planted', []), pending]  # kept, never awaited\n"
        "        while True:  # the new version exists before its export ends\n"
        "            try:\n"
        "                await cluster.sync_weights(self.version + 1, [])\n"
        "                break\n"
        "            except ValueError:\n"
        "                await __import__('asyncio').sleep(0.01)\n"
        "        self.version += 1\n"
    )
    stack = planted(
        tmp_path / "stack",
        target,
        "colocate",
        {
            "controller_base.py": (
                "        self.version = await cluster.train(TrainBatch(batch, group_advantages(batch)), devices)\n",
                early,
            )
        },
    )
    run = run_harness(
        Target.load(target), stack, tmp_path / "out", "measure", Limits(time_s=600), Sandbox.detect("subprocess")
    )
    assert not run.ok and "said it was done while training step" in str(run.cause), run.cause


@pytest.fixture(scope="module")
def big_small_batch(big):
    """The production target's cluster and sequence lengths, with a batch of 128 and two steps."""
    return big.model_copy(update={"workload": big.workload.model_copy(update={"batch_size": 128, "train_steps": 2})})


def test_the_environment_ends_an_episode_whose_context_is_full(tmp_path, big_small_batch):
    spec, events, _ = _simulated(tmp_path, big_small_batch, "time_multiplex", steps=1)
    truncated = [e for e in events if e.kind == "env_step" and e.data["truncated"]]
    assert truncated and all(e.data["done"] and e.data["observation"] == 0 for e in truncated)
    assert not any(e.kind == "sample_dropped" and e.data["reason"] == "max_sequence" for e in events)


# -- the bench and calibration through the CLI ----------------------------------------------------


def test_bench_runs_a_baseline_on_its_own_hardware_paired_by_seed_with_the_mixed_cluster(tmp_path):
    """The RollArt-like target's equal-cost H800-only cluster, beside the mixed one, in one bench: its
    runs are on its own 11 devices, paired with the others by seed; every run is within its bound."""
    raw = yaml.safe_load(Path("targets/catalog/qwen3-8b-h20x8-h800x8.yaml").read_text())
    raw["workload"].update(batch_size=32, train_steps=1)
    target = tmp_path / "mixed.yaml"
    target.write_text(yaml.safe_dump(raw, sort_keys=False))
    args = ["bench", str(target), "--baselines", "time_multiplex,h800-only", "--repeat", "1"]
    result = runner.invoke(app, [*args, "--json", str(tmp_path / "b.json")], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    runs = {run["name"]: run for run in json.loads((tmp_path / "b.json").read_text())["runs"]}
    assert set(runs) == {"time_multiplex", "h800-only"}
    assert runs["h800-only"]["paired"]["against"] == "time_multiplex"
    for run in runs.values():
        assert 0 < run["metrics"]["lower_bound_fraction"] <= 1.0
    mixed, single = (set(runs[n]["metrics"]["device_utilization"]) for n in ("time_multiplex", "h800-only"))
    assert mixed == {f"h20:{i}" for i in range(8)} | {f"h800:{i}" for i in range(8)}
    assert single == {f"h800:{i}" for i in range(11)}


@pytest.mark.slow  # simulated runs of the 160-device target end to end
def test_bench_on_a_simulated_target_prints_the_bound_and_groups_the_timeline(tmp_path, big_small_batch):
    raw = yaml.safe_load(Path("targets/catalog/qwen3-235b-a22b-h800x160.yaml").read_text())
    raw["workload"].update(batch_size=128, train_steps=2)
    target = tmp_path / "big.yaml"
    target.write_text(yaml.safe_dump(raw))
    result = runner.invoke(
        app,
        [
            "bench",
            str(target),
            "--baselines",
            "static_split,time_multiplex",
            "--repeat",
            "1",
            "--json",
            str(tmp_path / "b.json"),
            "--timeline",
            str(tmp_path / "t.png"),
            "--phases",
            str(tmp_path / "p.png"),
        ],
        env={"COLUMNS": "80"},
    )
    assert result.exit_code == 0, result.output
    assert "simulated seconds" in result.output and "LB" in result.output and "where a step goes" in result.output
    # in a pipe at 80 columns the tables kept their width: no figure cut to an ellipsis ('1.33x [0.45, 3.…')
    assert "…" not in result.output and "ratio [95% CI]" in result.output
    runs = json.loads((tmp_path / "b.json").read_text())["runs"]
    for run in runs:
        m = run["metrics"]
        assert 0 < m["lower_bound_fraction"] <= 1.0
        assert m["lower_bound_step_s"] > 0 and "peak_kv_fraction" in m
        # where the step went sums to the step; each phase takes at least its work spread over every device
        phases = [m[f"step_{a}_s"] for a in ("rollout", "train", "sync", "switching", "idle")]
        assert sum(phases) == pytest.approx(m["step_time_s"], rel=1e-6)
        assert m["rollout_bound_s"] + m["train_bound_s"] == pytest.approx(m["work_bound_s"])
        assert m["step_rollout_s"] >= m["rollout_bound_s"] and m["step_train_s"] >= m["train_bound_s"]
        steps = run["lower_bound_steps"]
        assert [s["step"] for s in steps] == [1, 2] and all(s["measured_s"] > 0 for s in steps)
        assert sum(s["measured_s"] for s in steps) <= m["duration_s"]
        assert max(m["work_bound_s"], m["critical_path_bound_s"]) == m["lower_bound_step_s"]
        # how full the engines' batches were while decoding, and the devices' time spent decoding
        assert m["decode_batch"] >= 1 and 0 < m["decode_share"] <= m["mean_device_busy"] + 1e-9
    static, multiplexed = (run["metrics"] for run in runs)
    assert static["decode_share"] <= 32 / 160 + 1e-9  # its engines hold 32 of the 160 devices
    assert multiplexed["decode_share"] > static["decode_share"] and "decode batch:" in result.output
    # time multiplexing beats the static split at scale: 32 rollout devices hold a fifth of the KV that 160
    # do, so the static split queues. Each bench draws its tasks anew (a session's secret workload key), so
    # the ratio is a draw: 1.30-1.82x over 12 runs of this bench (median 1.40x); 1.3 failed a CI run at 1.298
    ratio = multiplexed["rollout_throughput"] / static["rollout_throughput"]
    assert ratio > 1.15 and multiplexed["mean_device_busy"] > static["mean_device_busy"], ratio
    # beside the paired ratio, the same in trained response tokens (one repeat: the medians are the runs)
    tokens = multiplexed["trained_tokens_per_s"] / static["trained_tokens_per_s"]
    row = next(line for line in result.output.splitlines() if line.strip().startswith("time_multiplex "))
    assert f" {tokens:.2f}x " in row, row
    assert (tmp_path / "t.png").stat().st_size > 10_000 and (tmp_path / "p.png").stat().st_size > 10_000


def test_calibrate_refuses_a_directory_that_is_not_a_candidate(tmp_path):
    result = runner.invoke(app, ["calibrate", "tiny-qwen3-cpu", "--stack", str(tmp_path)])
    assert result.exit_code == 2 and "not a candidate directory" in result.output


def test_calibrate_names_a_trace_that_is_a_directory(tmp_path, tiny_spec):
    stack = write_starter(tmp_path / "stack", tiny_spec, "colocate")
    result = runner.invoke(app, ["calibrate", "tiny-qwen3-cpu", "--stack", str(stack), "--trace", str(tmp_path)])
    assert result.exit_code == 2 and "a directory, not a file (the trace.jsonl" in result.output, result.output


def test_calibrate_refuses_a_target_of_several_pools_before_reading_anything(tmp_path, tiny_spec):
    stack = write_starter(tmp_path / "stack", tiny_spec, "colocate")
    args = ["calibrate", "qwen3-8b-h800x16-serving", "--stack", str(stack), "--trace", str(tmp_path / "x.jsonl")]
    (tmp_path / "x.jsonl").write_text("not json\n")  # read first, it said "not a readable trace" (exit 1)
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "calibration fits one device kind" in result.output, result.output


def _trace_line(kind: str, t: float, **data) -> str:
    return json.dumps({"kind": kind, "t": t, "data": data}) + "\n"


REAL_START = _trace_line("run_start", 0.0, devices=["cpu:0", "cpu:1"], steps=1, tokens_recorded=True)
BAD_TRACES = {
    "missing": (None, "no such file (the trace.jsonl of a recorded real run)"),
    "not JSON lines": ("not json\n", "not a readable trace"),
    "not trace events": ('{"kind": "train"}\n', "not a readable trace (line 1 is no trace event"),
    # a run killed while it streamed: the line named is the one cut short, not "line 1" of every line's own parse
    "cut short": (REAL_START + '{"kind": "train", "t": 1', "line 2 (the last, cut short: the trace of a run that"),
    "data no mapping": (_trace_line("run_start", 0.0).replace("{}", "[]"), "line 1 is no trace event"),
    "steps no number": (
        _trace_line("run_start", 0.0, devices=["cpu:0", "cpu:1"], steps="8", tokens_recorded=True)
        + _trace_line("run_end", 1.0),
        "its run_start's steps is '8', not a number of steps",
    ),
    "unfinished": (REAL_START, "not the trace of a finished run"),
    "stopped early": (REAL_START + _trace_line("run_end", 1.0), "the run trained 0 of its 1 steps"),
    "simulated": (
        _trace_line("run_start", 0.0, devices=["cpu:0", "cpu:1"], steps=1, tokens_recorded=False)
        + _trace_line("run_end", 1.0),
        "a simulated run",
    ),
    # a trace of another stack's run: a fit to it predicts this stack with that one's errors (it said nothing)
    "another stack": (
        _trace_line("run_start", 0.0, devices=["cpu:0", "cpu:1"], steps=1, tokens_recorded=True, stack="0" * 64)
        + _trace_line("train", 0.5)
        + _trace_line("run_end", 1.0),
        "a run of another stack than",
    ),
    "other hardware": (
        _trace_line("run_start", 0.0, devices=["h100:0"], steps=1, tokens_recorded=True) + _trace_line("run_end", 1.0),
        "not tiny-qwen3-cpu's ['cpu:0', 'cpu:1']",
    ),
}


@pytest.mark.parametrize("case", list(BAD_TRACES))
def test_calibrate_refuses_a_trace_it_cannot_fit(tmp_path, tiny_spec, case):
    content, says = BAD_TRACES[case]
    stack = write_starter(tmp_path / "stack", tiny_spec, "colocate")
    trace = tmp_path / "trace.jsonl"
    if content is not None:
        trace.write_text(content)
    result = runner.invoke(app, ["calibrate", "tiny-qwen3-cpu", "--stack", str(stack), "--trace", str(trace)])
    # a user's mistake, each of them (it was exit 1, "the work failed", for all but a missing file)
    assert result.exit_code == 2 and says in " ".join(result.output.split()), result.output
    assert "--trace" in result.output and "Traceback" not in result.output


def test_calibrate_leaves_no_scratch_folder_behind_when_it_prints_none(tmp_path, tiny_spec):
    """Each ``vibetrain calibrate`` made a folder under the system's temporary directory and never removed
    it, though it printed it only when the calibrated spec stayed there (no ``--out``): 124 were left on
    this machine's /tmp by the suite's runs. A refused trace now leaves none."""
    import subprocess
    import sys

    stack = write_starter(tmp_path / "stack", tiny_spec, "colocate")
    trace = tmp_path / "trace.jsonl"
    trace.write_text(BAD_TRACES["not JSON lines"][0])  # refused once the folder was made
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    args = [sys.executable, "-m", "orchestrator.cli", "calibrate", "tiny-qwen3-cpu", "--stack", str(stack)]
    # both: the folder went to the temporary directory (a plain mkdtemp) before it went to scratch_folder's
    env = {**os.environ, "VIBETRAIN_SCRATCH": str(scratch), "TMPDIR": str(scratch)}
    done = subprocess.run([*args, "--trace", str(trace)], env=env, capture_output=True, text=True, timeout=300)
    said = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2 and BAD_TRACES["not JSON lines"][1] in said, said  # refused after the folder was made
    assert not list(scratch.glob("vibetrain-calibrate-*")), sorted(p.name for p in scratch.iterdir())


def test_the_rollout_fit_recovers_its_constants_and_keeps_them_non_negative():
    """Exact latencies give back the constants they were made from; latencies that are all
    per-iteration cost plus noise would give the FLOPs term a negative rate (a negative MFU) by
    plain least squares: the fit puts it at zero instead and the other terms carry the latencies."""
    from targets.harness.sim.calibrate import _nonnegative_fit

    made = [(n, v, 1.0, 0.002 * n + 3.0 * v + 0.01) for n, v in [(10, 0.01), (20, 0.004), (40, 0.03), (5, 0.02)]]
    assert _nonnegative_fit(made) == pytest.approx((0.002, 3.0, 0.01))

    rows = [(10, 1.0, 1.0, 0.105), (20, 0.5, 1.0, 0.199), (40, 3.0, 1.0, 0.398), (80, 1.5, 1.0, 0.801)]
    import numpy as np

    unconstrained = np.linalg.lstsq(np.array([r[:3] for r in rows]), np.array([r[3] for r in rows]), rcond=None)[0]
    assert unconstrained[1] < 0  # the plant
    step, per_flop, request = _nonnegative_fit(rows)
    assert per_flop == 0.0 and step > 0 and request >= 0
    assert _nonnegative_fit([(10, 1.0, 0.2), (20, 2.0, 0.4)]) == pytest.approx((0.02, 0.0))  # collinear: one term


def test_the_rollout_fit_separates_memory_bound_iterations_from_fixed_costs():
    """Latencies made by the simulator's formula, from batches that read-bound (small) and
    compute-bound (large) iterations: the fit gives back both efficiencies and both fixed costs."""
    import numpy as np

    from targets.harness.sim.calibrate import _rollout_fit

    step, mfu, request, hbm = 0.003, 0.5, 0.2, 0.8
    rows = []
    for n, read, compute, prefill in [(5, 0.006, 0.0001, 0.01), (80, 0.007, 0.002, 0.02), (200, 0.009, 0.012, 0.05)]:
        for k in range(1, 5):
            r, c = read * k, compute * k**2
            latency = n * (max(r / hbm, c / mfu) + step) + prefill * k / mfu + request
            rows.append((float(n), r, c, prefill * k, latency))
    fitted = _rollout_fit(rows)
    assert fitted[:4] == pytest.approx((step, mfu, request, hbm), rel=0.01)
    # compute-bound everywhere: reads no request waited on get the catalog's bandwidth, not the grid's
    # edge (hbm_efficiency 1000x the MFU) and not a made-up lower one
    bound = [(n, r / 100, c, p, n * (c / mfu + step) + p / mfu + request) for n, r, c, p, _ in rows]
    fitted = _rollout_fit(bound)
    assert fitted[:3] == pytest.approx((step, mfu, request), rel=0.01) and 0.99 <= fitted[3] <= 1.0
    # no growth with the work at all: no fit here (calibrate keeps the fixed costs at catalog rates)
    assert _rollout_fit([(n, r, c, p, n * step + request) for n, r, c, p, _ in rows]) is None
    # host-bound (the H200 run of 11-29): latencies grow with the work 100x faster than the peak allows;
    # unbounded the fit said rollout_mfu 100 (then the catalog's peak was raised 100x to hold it)
    small = [(n, r / 1000, c / 1000, p / 1000) for n, r, c, p, _ in rows]  # the work: a sliver of each latency
    noise = 1 + 0.03 * np.random.default_rng(0).standard_normal(len(small))  # measured, not made exact
    host = [
        (n, r, c, p, (n * step + request + 0.01 * (n * max(r, c) + p)) * e) for (n, r, c, p), e in zip(small, noise)
    ]
    fitted = _rollout_fit(host)
    assert fitted[1] == 1.0 and fitted[3] <= 1.0  # the fixed costs (and the reads) carry what compute did not
    predicted = [n * (max(r / fitted[3], c) + fitted[0]) + p + fitted[2] for n, r, c, p, _ in host]
    assert predicted == pytest.approx([row[-1] for row in host], rel=0.05)


@pytest.mark.slow
def test_a_twin_calibrated_on_a_memory_bound_run_predicts_it(tmp_path):
    """The 8B target on H100s decodes memory-bound. Calibrated on its own simulated run, the twin's
    run of the same stack ends within 10% of it (fitting compute alone, 73% late: the reads became a
    26 ms cost per iteration)."""
    from targets.harness.sim.calibrate import calibrate
    from targets.spec import load_target

    spec = load_target("qwen3-8b-h100x8")
    spec = spec.model_copy(update={"workload": spec.workload.model_copy(update={"train_steps": 1})})
    _, events, _ = _simulated(tmp_path / "truth", spec, "time_multiplex")
    fit = calibrate(spec, [events])
    hardware = spec.hardware.model_copy(update={"bf16_tflops": fit.bf16_tflops, "mfu": fit.mfu})
    twin = spec.model_copy(update={"id": f"{spec.id}-twin", "simulator": fit.simulator, "hardware": hardware})
    _, predicted, _ = _simulated(tmp_path / "twin", twin, "time_multiplex")
    ends = [next(e.t for e in reversed(run) if e.kind == "train") for run in (events, predicted)]
    print(f"twin's step end {ends[1]:.1f} s, the run's {ends[0]:.1f} s ({ends[1] / ends[0] - 1:+.1%})")
    assert ends[1] == pytest.approx(ends[0], rel=0.10)


def test_a_twin_calibrated_on_engines_of_two_devices_predicts_their_run(tmp_path):
    """The fit priced every request on the catalog's one-device engine: engines of two devices read twice
    as fast, so the reads looked faster than the catalog allows, the bandwidth fit was thrown out, and the
    twin of the same stack came out 52% late. The fit now reads the run's engines as its stack declared them."""
    from targets.harness.sim.calibrate import calibrate
    from targets.spec import load_target

    spec = load_target("qwen3-8b-h100x8")
    spec = spec.model_copy(
        update={
            "workload": spec.workload.model_copy(update={"train_steps": 1}),
            "simulator": spec.simulator.model_copy(update={"max_engine_scale": 2}),
        }
    )
    scaled = {"engine_scale": 2}
    _, events, _ = _simulated(tmp_path / "truth", spec, "time_multiplex", params=scaled)
    fit = calibrate(spec, [events])
    assert not any("both at catalog rates" in note for note in fit.notes), fit.notes
    hardware = spec.hardware.model_copy(update={"bf16_tflops": fit.bf16_tflops, "mfu": fit.mfu})
    twin = spec.model_copy(update={"id": f"{spec.id}-twin", "simulator": fit.simulator, "hardware": hardware})
    _, predicted, _ = _simulated(tmp_path / "twin", twin, "time_multiplex", params=scaled)
    ends = [next(e.t for e in reversed(run) if e.kind == "train") for run in (events, predicted)]
    print(f"twin's step end {ends[1]:.1f} s, the run's {ends[0]:.1f} s ({ends[1] / ends[0] - 1:+.1%})")
    assert ends[1] == pytest.approx(ends[0], rel=0.15)


@pytest.mark.parametrize(
    "stack",
    [{"speculative_tokens": 4, "speculative_batch": 64}, {"engine_scale": 4}],
    ids=["drafting", "engines of 4 devices"],
)
def test_a_twin_calibrated_on_drafting_or_tensor_parallel_engines_fits_the_constants_and_predicts_their_decode(
    tmp_path, stack
):
    """The fit charges each request what the simulator does. A stack that drafts 4 tokens at acceptance 0.5
    takes ``n / E`` verifications of 5 positions for ``n`` tokens: counted as ``n`` plain iterations, both
    efficiencies fitted at 1 (the spec's 0.8 and 0.5) and the twin decoded 14% late. An engine of 4 devices
    pays its all-reduces' bytes each step: left in the latencies, the MFU fitted at 0.41 and the twin 3.6%
    late. (Turns of spread lengths: at the whole budget every turn, a step's overhead and a request's are
    one constant.)"""
    from targets.harness.sim.calibrate import calibrate
    from targets.spec import ResponseLengthSpec

    spec = load_target("qwen3-8b-h100x8")
    lengths = ResponseLengthSpec(mean=300, task_sigma=0.5, turn_sigma=0.5)
    tokens = spec.workload.tokens.model_copy(update={"draft_acceptance": 0.5, "response_length": lengths})
    spec = spec.model_copy(
        update={
            "workload": spec.workload.model_copy(update={"train_steps": 1, "tokens": tokens}),
            "simulator": spec.simulator.model_copy(update={"max_engine_scale": 4}),
        }
    )
    _, events, _ = _simulated(tmp_path / "truth", spec, "colocate", params=stack)
    fit = calibrate(spec, [events])
    assert fit.simulator.hbm_efficiency == pytest.approx(spec.simulator.hbm_efficiency, rel=0.1)
    assert fit.simulator.rollout_mfu == pytest.approx(spec.simulator.rollout_mfu, rel=0.1)
    hardware = spec.hardware.model_copy(update={"bf16_tflops": fit.bf16_tflops, "mfu": fit.mfu})
    twin = spec.model_copy(update={"id": f"{spec.id}-twin", "simulator": fit.simulator, "hardware": hardware})
    _, predicted, _ = _simulated(tmp_path / "twin", twin, "colocate", params=stack)
    decoding = [sum(e.t - e.data["start"] for e in run if e.kind == "generate") for run in (events, predicted)]
    print(f"twin's decode {decoding[1]:.1f} s, the run's {decoding[0]:.1f} s ({decoding[1] / decoding[0] - 1:+.1%})")
    assert decoding[1] == pytest.approx(decoding[0], rel=0.03)


@pytest.mark.slow
def test_a_twin_calibrated_on_a_kv_bound_run_ranks_the_other_schedules_as_the_truth_does(tmp_path):
    """The 8B static split's rollout engines run with a full KV cache: requests wait for room and prefixes
    are evicted. Fitted as if waiting were decoding and every prefix stayed cached (a ninth of the prefill
    done), with each request's batch taken to hold its own context, the twin predicted colocate 1.10x the
    static split (1.47x true) and time_multiplex 1.65x (2.07x): the pre-screen would throw out real gains.
    With the engines' word on their waits and reused prefixes and the batch's KV read from the trace, each
    schedule's gain over the fitted one comes out within 10% (``benchmarks/twin_fidelity.py``)."""
    from targets.harness.sim.calibrate import calibrate
    from targets.spec import load_target

    spec = load_target("qwen3-8b-h100x8")
    spec = spec.model_copy(update={"workload": spec.workload.model_copy(update={"train_steps": 2})})
    fitted_on = _simulated(tmp_path / "truth", spec, "static_split")[1]
    fit = calibrate(spec, [fitted_on])
    hardware = spec.hardware.model_copy(update={"bf16_tflops": fit.bf16_tflops, "mfu": fit.mfu})
    twin = spec.model_copy(update={"id": f"{spec.id}-twin", "simulator": fit.simulator, "hardware": hardware})

    def step_s(events):
        trains = [e for e in events if e.kind == "train"]
        return trains[-1].t / len(trains)

    base = {"truth": step_s(fitted_on), "twin": step_s(_simulated(tmp_path / "twin", twin, "static_split")[1])}
    for controller in ("colocate", "time_multiplex"):
        gains = {
            name: base[name] / step_s(_simulated(tmp_path / f"{name}-{controller}", target, controller)[1])
            for name, target in (("truth", spec), ("twin", twin))
        }
        print(f"{controller}: {gains['truth']:.2f}x the static split, {gains['twin']:.2f}x on the twin")
        assert gains["twin"] == pytest.approx(gains["truth"], rel=0.10), (controller, gains)


def test_the_fit_reads_the_engines_word_on_waits_and_prefixes_and_notes_where_it_is_missing_or_cut():
    """A request's wait (``queued``) starts its decoding span later and its reported prefix (``cached``)
    prices its prefill; where the engines say neither, or said more than the harness saw, the notes say
    how many requests that leaves. A
    request that failed or was aborted before any token (no engine named) is not a row, and no crash
    (it was a KeyError); one aborted while it waited computed nothing."""
    from targets.api import TraceEvent
    from targets.harness.sim.calibrate import _rollout_rows, calibrate
    from targets.harness.sim.request_spans import admitted_at

    spec = load_target("qwen3-8b-h100x8")
    cost = CostModel.from_spec(spec)

    def turn(t, episode, prompt=1000, **said):
        data = {"episode": episode, "turn": 0, "device": "h100:0", "prompt": prompt, "tokens": 100}
        return TraceEvent("generate", t + 2.0, data | {"start": t, "aborted": False} | said)

    told = [turn(0.0, "a", queued=0.0, cached=0), turn(0.5, "b", queued=1.5, cached=600)]
    # aborted after waiting its whole span (no prefix said: never admitted): no prefill inside b's span
    told.append(TraceEvent("generate", 2.2, turn(1.0, "e", queued=1.2).data | {"tokens": 0, "aborted": True}))
    lost = [
        TraceEvent("generate", 0.7, {"episode": "c", "turn": 0, "start": 0.6, "aborted": True}),
        TraceEvent("generate", 0.8, {"episode": "d", "turn": 0, "start": 0.6, "aborted": True, "failed": "boom"}),
    ]
    assert admitted_at(told[1]) == 2.0
    rows = _rollout_rows(cost, told + lost)
    assert len(rows) == 2 and rows[1][-1] == pytest.approx(0.5)  # b decoded from 2.0 to 2.5
    compute = cost.engine_devices * cost.peak_flops
    # a's prefill is over when b is admitted: b's span prices only its own, over the 600 tokens it reused
    assert rows[1][3] * compute == pytest.approx(cost.prefill_flops(400, 600))
    notes = calibrate(spec, [told + lost]).notes
    assert not any("did not say" in note for note in notes), notes
    unsaid = calibrate(spec, [[turn(0.0, "a"), turn(0.5, "b", queued=0.1)]]).notes
    assert any("did not say how long 1 of 2 requests waited" in note for note in unsaid), unsaid
    assert any("did not say what prefix 2 of 2 requests reused" in note for note in unsaid), unsaid
    # the harness holds an engine's word to what it saw (``TracedCluster``); one it had to cut is counted
    cut = calibrate(spec, [[turn(0.0, "a"), turn(0.5, "b", queued=2.0, word_cut=True)]]).notes
    assert any("said more than the harness saw for 1 requests" in note for note in cut), cut


def test_the_fit_prices_a_prefill_as_the_simulator_does_over_its_cached_prefix(big):
    """The fit charged a later turn's prefill as if nothing were cached (no attention over the prefix the
    simulator charges: 2x under at 30K cached) and kept the prefix across weight loads, which empty it."""
    from targets.api import TraceEvent
    from targets.harness.sim.calibrate import _rollout_rows

    cost = CostModel.from_spec(big)

    def turn(t: float, prompt: int, episode: str = "g0/0") -> TraceEvent:
        data = {"episode": episode, "device": "h800:0", "prompt": prompt, "tokens": 100, "aborted": False}
        return TraceEvent("generate", t + 1.0, data | {"start": t})

    events = [turn(0.0, 30_000), turn(2.0, 30_600), turn(4.0, 31_200)]
    sync = TraceEvent("sync", 3.5, {"start": 3.0, "devices": ["h800:0"]})  # between the second and third
    compute = cost.engine_devices * cost.peak_flops
    prefills = [row[3] * compute for row in _rollout_rows(cost, [*events, sync])]
    assert prefills[1] == pytest.approx(cost.prefill_flops(500, 30_100))  # its new 500 over the 30,100 cached
    assert prefills[2] == pytest.approx(cost.prefill_flops(31_200, 0))  # the load emptied the cache


def test_a_fixed_training_cost_is_fitted_only_from_steps_that_differ_in_work():
    """Two steps of nearly the same work, timed 2% apart, made a line whose intercept was a 17.8 s overhead
    (1 s true): the noise between them. Too few or too alike, the steps fit the MFU alone, and say so."""
    from targets.api import TraceEvent
    from targets.harness.sim.calibrate import calibrate
    from targets.spec import load_target

    spec = load_target("tiny-qwen3-cpu")

    def step(k: int, tokens: int, seconds: float) -> TraceEvent:
        trajectories = [{"episode": f"g{k}/{m}", "tokens": [1] * tokens} for m in range(8)]
        return TraceEvent(
            "train", 10.0 * k + seconds, {"start": 10.0 * k, "devices": ["cpu:0"], "trajectories": trajectories}
        )

    alike = [TraceEvent("run_start", 0.0), step(1, 100, 2.00), step(2, 105, 2.02), TraceEvent("run_end", 40.0)]
    fit = calibrate(spec, [alike])
    assert fit.simulator.train_step_overhead_s == 0.0
    assert any("2 steps, too few or too alike in work" in note for note in fit.notes), fit.notes


def test_a_syncs_overhead_is_fitted_without_the_drain_it_began_with():
    """A sync that does not interrupt waits for its engine's requests in flight to end, as the simulator's
    does: the fit counted that wait as sync overhead (19 s fitted where 0.5 s was true on the 8B target's
    static split), and the twin charged the drain twice."""
    from targets.api import TraceEvent
    from targets.harness.sim.calibrate import calibrate
    from targets.spec import load_target

    spec = load_target("tiny-qwen3-cpu")
    transfer = CostModel.from_spec(spec).sync_s() - spec.simulator.sync_overhead_s
    in_flight = {"episode": "g0/0", "device": "cpu:0", "start": 0.0, "prompt": 8, "tokens": 4, "aborted": False}
    run = [
        TraceEvent("run_start", 0.0),
        TraceEvent("generate", 5.4, in_flight),  # the sync began at 5.0 and waited for it
        TraceEvent("sync", 6.0, {"start": 5.0, "devices": ["cpu:0"], "version": 1, "interrupt": False}),
        TraceEvent("run_end", 7.0),
    ]
    fitted = calibrate(spec, [run])
    assert fitted.simulator.sync_overhead_s == pytest.approx(max(0.0, 0.6 - transfer))
    # another run's request, on its own clock, drains nothing of this run's sync
    alone = [run[0], run[2], run[3]]
    other = [run[0], run[1], run[3]]
    assert calibrate(spec, [alone, other]).simulator.sync_overhead_s == pytest.approx(max(0.0, 1.0 - transfer))


def test_calibration_pools_runs_and_says_which_constants_no_run_measured():
    """A starter that never shrinks leaves the switch cost at the spec's constant (and says so); a
    second run that shrinks supplies it: the twin pre-screen refits on every validated round."""
    from targets.api import TraceEvent
    from targets.harness.sim.calibrate import calibrate
    from targets.harness.sim.cost_model import CostModel
    from targets.spec import load_target

    spec = load_target("tiny-qwen3-cpu")
    modelled = CostModel.from_spec(spec).offload_s() - spec.simulator.switch_overhead_s
    colocate = [TraceEvent("run_start", 0.0), TraceEvent("run_end", 5.0)]
    shrinks = [  # as the harness records them
        TraceEvent("shrink", 1.2, {"start": 1.0, "devices": ["cpu:1"]}),
        TraceEvent("expand", 2.4, {"start": 2.0, "devices": ["cpu:1"]}),
    ]
    alone = calibrate(spec, [colocate])
    assert alone.simulator.switch_overhead_s == spec.simulator.switch_overhead_s
    assert any("no shrink, expand or suspend" in note for note in alone.notes)
    assert alone.unfitted == ["shrink", "expand", "suspend", "sync"]  # what the pre-screen will not predict on a guess
    pooled = calibrate(spec, [colocate, colocate + shrinks])
    # the shrink's 0.2 s alone: the expand's 0.4 s holds a weight load the simulator charges as a sync
    # (averaged in, the switch carried it and an expand paid it twice)
    assert pooled.simulator.switch_overhead_s == pytest.approx(max(0.0, 0.2 - modelled))
    expands_only = calibrate(spec, [colocate + shrinks[1:]])
    assert expands_only.simulator.switch_overhead_s == pytest.approx(max(0.0, 0.4 - modelled))
    assert any("fitted from expands alone" in note for note in expands_only.notes)
    assert not any("no shrink, expand or suspend" in note for note in pooled.notes)
    assert pooled.unfitted == ["sync"]


def test_one_stack_s_slow_mechanism_does_not_raise_the_pooled_twin_s_cost_for_the_others():
    """A red team's stack (static split, validated, its trace pooled into the pre-screen's twin) called
    shrink on no device twenty times, its cluster stalling each 5 s: the pooled fit's switch cost went from
    0.02 s to 3.6 s, and the twin screened out every candidate that switches (a time-multiplexed one 28%
    better for real was predicted 87% behind). A call naming no device moves no engine (the simulator
    charges it nothing) and is not fitted; each run's mean counts once, and the least of them is the twin's."""
    from targets.api import TraceEvent
    from targets.harness.sim.calibrate import calibrate
    from targets.harness.sim.cost_model import CostModel
    from targets.spec import load_target

    spec = load_target("tiny-qwen3-cpu")
    modelled = CostModel.from_spec(spec).offload_s() - spec.simulator.switch_overhead_s
    start, end = TraceEvent("run_start", 0.0), TraceEvent("run_end", 200.0)
    honest = [start, TraceEvent("shrink", 1.2, {"start": 1.0, "devices": ["cpu:1"]}), end]
    stalls = [TraceEvent("shrink", 5.0 + i, {"start": float(i), "devices": []}) for i in range(20)]
    no_device = calibrate(spec, [[start, *stalls, end]])
    assert "shrink" in no_device.unfitted and no_device.simulator.switch_overhead_s == spec.simulator.switch_overhead_s
    pooled = calibrate(spec, [honest, [start, *stalls, end]])
    assert pooled.simulator.switch_overhead_s == pytest.approx(max(0.0, 0.2 - modelled))
    slow = [
        start,
        *(TraceEvent("shrink", 10.0 * i + 5, {"start": 10.0 * i, "devices": ["cpu:1"]}) for i in range(5)),
        end,
    ]
    pooled = calibrate(spec, [honest, slow])  # a real engine's shrink stalled: that stack's cost, not the twin's
    assert pooled.simulator.switch_overhead_s == pytest.approx(max(0.0, 0.2 - modelled))
    assert any("shrink/suspend: the least of 2 runs' means, 0.2 s (the most 5 s)" in note for note in pooled.notes)
    sync = {"start": 10.0, "devices": [], "version": 1, "interrupt": False}
    stalled_sync = [start, TraceEvent("sync", 15.0, sync), end]  # nor a sync of no device
    assert "sync" in calibrate(spec, [stalled_sync]).unfitted


def test_one_device_s_suspends_and_resumes_time_the_switch_and_the_sync():
    """Colocate on one device never shrinks or syncs apart: a suspend is an offload, and a resume is a
    reload plus the sync to the weights trained meanwhile (the simulator's order)."""
    from targets.api import TraceEvent
    from targets.harness.sim.calibrate import calibrate
    from targets.harness.sim.cost_model import CostModel
    from targets.spec import load_target

    spec = load_target("tiny-qwen3-cpu")
    cost = CostModel.from_spec(spec)
    run = [
        TraceEvent("run_start", 0.0),
        TraceEvent("suspend", 3.0, {"start": 1.0, "devices": ["cpu:0"]}),
        TraceEvent("resume", 9.0, {"start": 4.0, "devices": ["cpu:0"]}),
        TraceEvent("run_end", 10.0),
    ]
    fitted = calibrate(spec, [run])
    assert fitted.simulator.switch_overhead_s == pytest.approx(2.0 - (cost.offload_s() - cost.switch_overhead_s))
    assert fitted.simulator.sync_overhead_s == pytest.approx(3.0 - (cost.sync_s() - cost.sync_overhead_s))
    assert fitted.unfitted == []


def test_request_concurrency_is_the_mean_batch_over_a_request_s_span():
    from targets.api import TraceEvent
    from targets.harness.sim.request_spans import request_concurrency

    def request(start, end, device="cpu:0", aborted=False):
        return TraceEvent("generate", end, {"start": start, "device": device, "aborted": aborted})

    events = [request(0.0, 1.0), request(0.5, 1.5), request(0.0, 2.0, "cpu:1"), request(0.0, 0.25, aborted=True)]
    batches = [batch for _, batch in request_concurrency(events)]
    # the first shares half its span with the second and a quarter with the aborted one
    assert batches == pytest.approx([1.75, 1.5, 1.0])
    # against the definition, pair by pair, on 300 random requests of two devices
    rng = np.random.default_rng(0)
    spans = [(float(s), float(s + d)) for s, d in zip(rng.uniform(0, 50, 300), rng.exponential(2.0, 300))]
    many = [request(s, e, f"cpu:{i % 2}", aborted=i % 7 == 0) for i, (s, e) in enumerate(spans)]
    for e, batch in request_concurrency(many):
        span = e.t - e.data["start"]
        overlap = sum(
            max(0.0, min(e.t, o.t) - max(e.data["start"], o.data["start"]))
            for o in many
            if o is not e and o.data["device"] == e.data["device"]
        )
        assert batch == pytest.approx(1.0 + overlap / span, rel=1e-9)


def _mixed(engine_devices=None):
    """The 8B target on two pools: bandwidth-rich H20s beside compute-rich H800s, 25 GB/s between."""
    data = load_target("qwen3-8b-h800x16").model_dump(mode="json")
    data["hardware"] = {
        "pools": [{"name": "rollout", "kind": "h20", "count": 2}, {"name": "train", "kind": "h800", "count": 2}],
        "links": [{"between": ["train", "rollout"], "bandwidth_gbs": 25}],
    }
    data["baselines"] = [{"name": "colocate"}]
    data["simulator"]["engine_devices"] = engine_devices
    return parse_target(data)


def test_pools_cost_what_their_devices_do_and_weights_cross_between_them_over_their_link():
    costs = ClusterCosts.from_spec(_mixed())
    h20, h800 = costs.of("rollout:1"), costs.of("train:0")
    # prefill is compute-bound: 989 / 148 TFLOP/s apart; decode at batch 1 is bandwidth-bound: 4000 / 3350 GB/s
    assert h20.prefill_s(2048, 0) / h800.prefill_s(2048, 0) == pytest.approx(989 / 148)
    assert h800.decode_iteration_s(1, 1000) > h20.decode_iteration_s(1, 1000)
    # a step on devices of both pools waits for its slowest rank
    assert costs.train_s([1000], ["train:0", "train:1"]) == pytest.approx(h800.train_s([1000], 2))
    assert costs.train_s([1000], ["rollout:0", "train:0"]) == pytest.approx(h20.train_s([1000], 2))
    # version v made on the H800s reaches an H20 engine over the 25 GB/s link; within a pool, the pool's own
    assert costs.sync_s(["rollout:0"], {"train:0"}) == pytest.approx(h20.weight_bytes / 25e9 + h20.sync_overhead_s)
    assert costs.sync_s(["train:1"], {"train:0"}) == pytest.approx(h800.sync_s())
    assert costs.sync_s(["rollout:0"], set()) == pytest.approx(h20.sync_s())  # version 0: the harness's, local
    # an engine costs what its pool's devices do
    lengths = ResponseLengths(_mixed().workload.tokens, seed=0)
    devices = [Device(d, "", i) for i, d in enumerate(_mixed().hardware.device_ids())]

    async def engine_costs():
        cluster = SimCluster(devices, devices, costs, lengths)
        await cluster.close()
        return {e.devices[0]: e.cost for e in cluster.engines}

    assert run_virtual(engine_costs()) == {"rollout:0": h20, "rollout:1": h20, "train:0": h800, "train:1": h800}


def test_the_simulated_cluster_refuses_what_no_real_device_allows():
    """The mechanism a simulated controller drives holds it to what hardware allows: training beside an
    awake engine (a schedule that looks faster by using a device twice), shrinking away the last active
    engine, and syncing a version other than the latest are refused by name; a legal sequence passes."""
    from targets.api import TrainBatch, Trajectory

    spec = load_target("tiny-qwen3-cpu")
    pool = [Device(f"cpu:{i}", "cpu", i) for i in range(2)]
    batch = TrainBatch([Trajectory("g0/e0", "g0", [1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], 1.0, [0])], [0.5])

    async def attempt(moves):
        cluster = SimCluster(pool, pool, ClusterCosts.from_spec(spec), ResponseLengths(spec.workload.tokens, seed=0))
        try:
            for move in moves:
                await move(cluster)
        finally:
            await cluster.close()

    shrink = lambda c: c.shrink(pool[:1])  # noqa: E731
    train = lambda c: c.train(batch, pool[:1])  # noqa: E731
    run_virtual(attempt([shrink, train, lambda c: c.sync_weights(1, pool[1:])]))  # legal: passes
    for moves, message in (
        ([train], r"the engines \['.*'\] on the training devices are awake: shrink or suspend them first"),
        ([shrink, lambda c: c.shrink(pool[1:])], r"shrinking \['cpu:1'\] would leave no active rollout engine"),
        ([shrink, train, lambda c: c.sync_weights(0, pool[1:])], "can only sync the latest version 1, not 0"),
    ):
        with pytest.raises(ValueError, match=message):
            run_virtual(attempt(moves))


def _placed(tmp_path, placement: str):
    """A simulated run of the colocate starter on the CPU target whose placement is ``placement`` (the body
    of ``ControllerBase.placement``, planted): the harness's measured run of it."""
    from tests.planting import planted

    spec = load_target("tiny-qwen3-cpu").model_copy(update={"execution": "simulated"})
    path = tmp_path / "target.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    own = "        return self._place([d for d in devices if d.id in self.own])\n"
    stack = planted(tmp_path / "stack", path, "colocate", {"controller_base.py": (own, placement)})
    return run_harness(
        Target.load(path), stack, tmp_path / "out", "measure", Limits(time_s=120), Sandbox.detect("subprocess")
    )


def test_a_simulated_run_refuses_engines_placed_on_devices_the_target_does_not_have(tmp_path):
    """A controller whose placement names a device of its own making (engines the harness would then
    simulate for free) is refused at its hello, by name."""
    extra = (
        "        return [*self._place([d for d in devices if d.id in self.own])[0], Device('cpu:9', 'cpu', 9)], []\n"
    )
    run = _placed(tmp_path, extra)
    assert not run.ok and "the controller placed engines on unknown devices" in run.cause, run.cause


def test_a_simulated_run_refuses_a_placement_naming_a_device_twice(tmp_path):
    """Planted (a review of the harness): a controller placing four engines on one device. The simulator
    builds an engine for each device named, so each would have had its own KV cache and compute: four
    engines for the price of one. Refused at its hello, by name."""
    twice = (
        "        rollout, train = self._place([d for d in devices if d.id in self.own])\n"
        "        return [rollout[0]] * 4, train\n"
    )
    run = _placed(tmp_path, twice)
    assert not run.ok and "the controller's rollout placement names a device twice" in run.cause, run.cause


def test_an_engine_never_spans_two_pools():
    spec = _mixed(engine_devices=2)
    devices = [Device(d, "", i) for i, d in enumerate(spec.hardware.device_ids())]
    lengths = ResponseLengths(spec.workload.tokens, seed=0)
    with pytest.raises(ValueError, match=r"the engine on \['rollout:1', 'train:0'\] would span pools"):
        SimCluster(devices, devices[1:3], ClusterCosts.from_spec(spec), lengths)


def test_each_answer_reaches_its_caller_a_request_overhead_after_its_engine(tmp_path):
    spec = load_target("tiny-qwen3-cpu")
    slow = spec.model_copy(
        update={"simulator": spec.simulator.model_copy(update={"request_overhead_s": 0.25, "batching": "continuous"})}
    )
    pool = [Device(f"cpu:{i}", "cpu", i) for i in range(2)]
    latencies = []
    for target in (spec, slow):

        async def one(target=target):
            cluster = SimCluster(
                pool, pool, ClusterCosts.from_spec(target), ResponseLengths(target.workload.tokens, seed=0)
            )
            start = cluster.now()
            await cluster.generate(GenerateRequest("g0/e0", 0, [1, 2, 3], SamplingParams(max_new_tokens=8)))
            return cluster.now() - start

        latencies.append(run_virtual(one()))
    assert latencies[1] == pytest.approx(latencies[0] + 0.25)


@pytest.mark.slow
def test_one_controller_module_on_the_real_cluster_and_the_simulator(tmp_path, fast_target, shared_ray):
    """Calibration runs the time_multiplex starter for real, fits the cost model to its trace and
    runs the very same stack directory on the simulator: both runs pass the audit, and the
    simulator's step time is compared with the real one."""
    from targets.harness.measure.session import Session
    from targets.harness.sim.calibrate import measure_and_predict

    spec = parse_target(yaml.safe_load(fast_target.read_text()))
    stack = write_starter(tmp_path / "stack", spec, "time_multiplex")
    # calibration measures with the public workload, so a refit of the recorded trace predicts the same
    session = Session(Target.load(fast_target), Sandbox.detect("subprocess"), Limits(time_s=300), task_key=b"")
    report = measure_and_predict(session, stack, tmp_path / "work")  # each run judged: it raises on a finding
    calibrated = load_target(report["calibrated_spec"])
    assert calibrated.simulator.batching == "continuous"
    # the tiny engine is host-bound, but its iterations and its work grow together here: the fit may give
    # the latencies to fixed costs or to the work (CI once fitted both fixed costs at 0); zeros are said
    fixed = calibrated.simulator.decode_step_overhead_s + calibrated.simulator.request_overhead_s
    notes = report["calibration"].notes
    assert fixed > 0 or sum("no fixed cost" in note for note in notes) == 2, notes
    for execution in ("real", "simulated"):
        audit = json.loads((tmp_path / "work" / execution / "audit.json").read_text())["result"]
        assert audit["passed"], (execution, audit["reasons"])
    error = report["compared"]["step_time_s"]["error"]
    print(f"simulator step-time prediction error after calibration: {error:+.1%}")
    assert abs(error) < 1.0  # same order as the real run; the figure itself is reported, not gated
    # the same trace fitted again from the file (as one fetched from a GPU machine): the same prediction
    refit = runner.invoke(
        app,
        [
            "calibrate",
            str(fast_target),
            "--stack",
            str(stack),
            "--trace",
            str(tmp_path / "work" / "real" / "trace.jsonl"),
        ],
        env={"COLUMNS": "120"},
    )
    assert refit.exit_code == 0, refit.output
    assert f"{error:+.1%}" in refit.output, refit.output
    assert "does not say which stack" not in refit.output  # the trace names the stack that ran it: this one


def test_a_simulated_run_s_controller_builds_its_stack_without_torch(tmp_path):
    """The controller process of a simulated run builds the stack and never makes a component; torch
    (imported by the weight-sync, engine and trainer recipes) cost it 1.2 s a run before build.py
    imported them lazily."""
    import subprocess
    import sys

    from targets.harness.ipc.wire import put_runtime

    target = Target.load("qwen3-235b-a22b-h800x160", simulate=True)
    directory = write_starter(tmp_path / "stack", target.spec, "time_multiplex")
    code = (
        "import json, sys\n"
        "from targets.harness.ipc.wire import get_runtime\n"
        f"sys.path.insert(0, {str(directory)!r})\n"
        "import stack\n"
        f"stack.build(get_runtime(json.loads({json.dumps(json.dumps(put_runtime(target.runtime())))})))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'ray')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout[:500]


def test_a_bench_run_that_fails_its_checks_is_named_and_the_others_still_count(tmp_path):
    """A failing candidate does not cost the bench its other runs: they are measured, paired and
    written; the failure is named with its reasons, and the command exits non-zero after all that.
    The baseline beside it is a labelled one carrying a technique (an elastic or tuned baseline)."""
    raw = yaml.safe_load(Path("targets/catalog/qwen3-8b-h800x16.yaml").read_text())
    raw["hardware"]["count"] = 4
    raw["workload"].update(batch_size=16, train_steps=1)
    raw["baselines"] = [
        {"name": "time_multiplex", "train_devices": 2, "label": "tm-partial", "params": {"partial_rollout": 1}}
    ]
    target = tmp_path / "small.yaml"
    target.write_text(yaml.safe_dump(raw))
    cheat = write_starter(tmp_path / "twice", parse_target(raw), "time_multiplex")
    base = cheat / "stack" / "controller_base.py"
    honest = "        self.version = await cluster.train(TrainBatch(batch,"
    assert honest in base.read_text()
    base.write_text(base.read_text().replace(honest, "        batch = batch + batch[:1]\n" + honest))
    result = runner.invoke(
        app,
        [
            "bench",
            str(target),
            "--baselines",
            "tm-partial",
            "--stack",
            str(cheat),
            "--json",
            str(tmp_path / "b.json"),
        ],
        env={"COLUMNS": "120"},
    )
    assert result.exit_code == 1, result.output
    assert "failed its checks: twice (repeat 0): system_audit:" in result.output
    assert "1 run(s) failed their checks (twice): their figures are left out" in result.output
    data = json.loads((tmp_path / "b.json").read_text())
    assert [r["name"] for r in data["runs"]] == ["tm-partial"] and data["runs"][0]["metrics"]["goodput"] > 0
    (failed,) = data["failed"]
    assert failed["name"] == "twice" and "system_audit: used twice: episode" in failed["reasons"][0]


def test_the_dual_bound_holds_for_each_schedule_and_reaches_the_path_term(tmp_path, monkeypatch):
    """benchmarks/bound_tightness.py's bound, which charges the engines for the batch a fast path allows: a
    lower bound, so no run beats it, and its largest-lambda end is the fluid bound's critical path."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
    from bound_tightness import dual_bound

    for controller in ("colocate", "time_multiplex"):
        spec, events, _ = _simulated(tmp_path / controller, load_target("tiny-qwen3-cpu"), controller)
        costs = ClusterCosts.from_spec(spec)
        bound, top, weight, split = dual_bound(spec, costs, events)
        measured = compute_metrics(events, next(e for e in events if e.kind == "run_start").data["devices"])
        fluid = step_lower_bound(spec, costs, events)
        assert 0 < bound <= measured["step_time_s"], controller
        # the tiny target's engines have room to spare: decoding the longest trajectories alone costs the rest
        # nothing, so the dual is the fluid bound's path term (its steps' longest paths over 1 + async ratio)
        assert bound == pytest.approx(fluid["critical_path_bound_s"], rel=0.05) and top == 1, controller


def test_the_dual_bounds_charge_for_a_token_is_at_most_what_any_batch_would_pay(big, monkeypatch):
    """Its batches come in ranges: a token's least charge over them is no more than its charge at any batch the
    KV cache admits, between the ranges' edges and at the largest, for any draft length and multiplier."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
    from bound_tightness import token_charges

    (cost,) = engine_options(big, ClusterCosts.from_spec(big))
    d, capacity = cost.engine_devices, cost.kv_capacity_tokens
    contexts = [0, 700, 8_000, 20_000, 300_000]
    for split in (1, 12, 10**9):
        seconds, charges = token_charges([cost], np.array(contexts), split)
        for row, context in enumerate(contexts):
            most = capacity - context + 1
            for batch in sorted({1, 7, 13, 100, 700, 1025, 5000, most} & set(range(1, most + 1))):
                for k in (0, 4):
                    gained, iteration = cost.tokens_per_step(k), cost.decode_iteration_s(batch, context, k + 1)
                    reads = cost.decode_bytes(batch * (k + 1), 0) / cost.read_bytes_per_s + cost.decode_step_overhead_s
                    by_context = (reads + cost.tensor_parallel_s(batch * (k + 1))) * context / capacity
                    by_context += context * cost.kv_bytes_per_token / cost.read_bytes_per_s
                    paid = d * (iteration / batch if batch < split else by_context) / gained
                    for weight in (0.0, 1.0, 100.0):
                        least = np.min(charges[row] + weight * seconds[row])
                        assert least <= paid + weight * iteration / gained + 1e-12, (split, context, batch, k)
