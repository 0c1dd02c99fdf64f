"""The workload's secret (targets/harness/environments/seeds.py): one number and key give one workload,
another key another; the public derivation is the one runs had before keys."""

from __future__ import annotations

import asyncio

from targets.harness.clock import WallClock
from targets.harness.environments import EnvironmentPool
from targets.harness.environments.seeds import RunSeed
from targets.harness.sim.response_length import ResponseLengths
from targets.harness.trace import Trace
from targets.spec import load_target


def _openings(seed) -> list[list[int]]:
    spec = load_target("tiny-qwen3-cpu")
    pool = EnvironmentPool(spec.workload, WallClock(), Trace(WallClock()), seed=seed)
    return [list(asyncio.run(pool.new_group()[0].reset())) for _ in range(6)]


def test_the_key_decides_the_tasks_and_the_number_pairs_runs():
    public = _openings(0)
    assert _openings(RunSeed(0)) == public  # a bare number is the public derivation
    assert RunSeed(0).task(5) == 5 and RunSeed(2).episode(1, 0) == (2 * 1_000_003 + 1) * 131 + 1
    key = bytes(range(16))
    assert _openings(RunSeed(0, key)) == _openings(RunSeed(0, key))  # paired runs see the same tasks
    assert _openings(RunSeed(0, key)) != public
    assert _openings(RunSeed(0, key)) != _openings(RunSeed(0, bytes(16)))
    assert _openings(RunSeed(1, key)) != _openings(RunSeed(0, key))


def test_simulated_response_lengths_follow_the_key_too():
    tokens = load_target("qwen3-235b-a22b-h800x160").workload.tokens
    public = [ResponseLengths(tokens, 0).of(f"g{i}/e0", 0) for i in range(20)]
    keyed = [ResponseLengths(tokens, RunSeed(0, b"k" * 16)).of(f"g{i}/e0", 0) for i in range(20)]
    assert public == [ResponseLengths(tokens, RunSeed(0)).of(f"g{i}/e0", 0) for i in range(20)]
    assert keyed != public


def test_no_cluster_can_sample_a_run_s_opening_prompts_before_it_starts():
    """A red team's cluster sampled every opening prompt tiny-qwen3-cpu could draw (4: a constant filler
    before "repeat X <act>"; 64 on the 0.6B target) under version 0 while it started up, untimed, answered
    the run's first turns from that stock, and passed the check. The padding is drawn from the task's keyed
    seed: 24 groups draw 24 openings, under either key (the constant filler gave at most 4), and a group's
    members share theirs (and their prefix)."""
    spec = load_target("tiny-qwen3-cpu")
    for key in (bytes(range(16)), bytes(16)):
        pool = EnvironmentPool(spec.workload, WallClock(), Trace(WallClock()), seed=RunSeed(0, key))
        openings = []
        for _ in range(24):
            prompts = {tuple(asyncio.run(episode.reset())) for episode in pool.new_group()}
            assert len(prompts) == 1
            openings += prompts
        assert len(set(openings)) == 24
