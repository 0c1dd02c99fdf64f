"""Harness environments: scripted play gives the documented rewards; lifecycle misuse raises;
timeouts, turn caps and the trace are the harness's; latency and turn counts are long-tailed."""

from __future__ import annotations

import asyncio
import random
import statistics

import pytest

from targets.harness.environments import EnvironmentPool
from targets.harness.environments.base import FILLER_IDS
from targets.harness.tokenizer import LETTERS, NAMED_VOCAB, VOCAB
from targets.harness.trace import Trace
from targets.spec import Geometric, Lognormal, parse_target


class ManualClock:
    """Virtual time: sleeping advances it instantly."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += seconds


def _pool(catalog_yaml, environment: dict, turns: dict, seed: int = 3, **workload):
    catalog_yaml["workload"].update(environment=environment, turns=turns, **workload)
    spec = parse_target(catalog_yaml)
    clock = ManualClock()
    trace = Trace(clock)
    return EnvironmentPool(spec.workload, clock, trace, seed=seed), trace, clock


def _words(tokens) -> str:
    """The text after the padding (filler words drawn from the task's and the episode's keyed streams)."""
    tokens = list(tokens)
    while tokens and tokens[0] in FILLER_IDS:
        tokens.pop(0)
    return " ".join(VOCAB.word(t) for t in tokens)


def _run(coroutine):
    return asyncio.run(coroutine)


def test_guess_number_narrows_the_range_and_pays_on_success(catalog_yaml):
    environment = {"name": "guess_number", "params": {"hint_width": 4}}
    pool, trace, _ = _pool(catalog_yaml, environment, {"max": 8}, seed=2)
    episode = pool.new_group()[0]
    prompt = _words(_run(episode.reset()))
    secret, low, high = episode.task
    assert low < secret and high < 9  # seed 2's task (6 in 4..7): a guess below and one above both have room
    assert prompt == f"guess number between {low} and {high} <act>"
    answer = _run(episode.step(VOCAB.encode("x y")))
    assert _words(answer.observation) == f"invalid between {low} and {high} <act>" and answer.reward == 0
    credit = 0.5 / 8  # in_range_credit / max_turns
    answer = _run(episode.step(VOCAB.encode(str(low))))
    assert _words(answer.observation) == f"higher between {low + 1} and {high} <act>"
    assert answer.reward == pytest.approx(credit)
    answer = _run(episode.step(VOCAB.encode(f"{high + 1} {secret}")))  # only the first token counts
    assert _words(answer.observation).startswith("lower") and answer.reward == 0
    answer = _run(episode.step(VOCAB.encode(f"{secret} <eos>")))
    assert answer.done and answer.observation == []
    assert answer.reward == pytest.approx(credit + 0.9 ** (episode.turn - 1))
    kinds = [e.kind for e in trace.events]
    assert kinds.count("episode_created") == 4 and kinds.count("env_reset") == 1
    assert kinds.count("env_step") == episode.turn


def test_guess_number_ends_at_the_turn_cap(catalog_yaml):
    pool, _, _ = _pool(catalog_yaml, {"name": "guess_number"}, {"max": 3})
    episode = pool.new_group()[0]
    _run(episode.reset())
    results = [_run(episode.step(VOCAB.encode("a"))) for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert sum(r.reward for r in results) == 0


def test_synthetic_agent_scores_repetition(catalog_yaml):
    env = {"name": "synthetic_agent", "params": {"alphabet": 4, "symbols_per_turn": 2, "partial_credit": 0.25}}
    pool, _, _ = _pool(catalog_yaml, env, {"max": 6, "dist": {"kind": "fixed", "value": 3}})
    perfect, sloppy = pool.new_group()[:2]
    assert perfect.task is sloppy.task  # a group shares its task, drawn once
    assert [perfect.symbols(i) for i in range(6)] == [sloppy.symbols(i) for i in range(6)]
    shown = _words(_run(perfect.reset())).split()
    _run(sloppy.reset())
    total = 0.0
    while not perfect.done:
        assert shown[0] == "repeat"
        result = _run(perfect.step(VOCAB.encode(" ".join(shown[1:3]))))
        total += result.reward
        shown = _words(result.observation).split()
    assert perfect.turn == 3 and total == pytest.approx(1.0)
    # a letter of the alphabet in the wrong place earns partial credit only
    wrong = "a" if perfect.symbols(0)[0] != "a" else "b"
    result = _run(sloppy.step(VOCAB.encode(f"{wrong} {wrong}")))
    per_symbol = [1.0 if s == wrong else 0.25 for s in perfect.symbols(0)]
    assert result.reward == pytest.approx(sum(per_symbol) / 2 / 3)


@pytest.mark.parametrize("filler_as_letters", [False, True])
def test_filler_tokens_read_as_letters_only_when_asked(catalog_yaml, filler_as_letters):
    """A random model with a real vocabulary says filler tokens: read as letters (id mod alphabet),
    they can earn a reward; read as themselves, nothing does."""
    env = {
        "name": "synthetic_agent",
        "params": {"alphabet": 8, "symbols_per_turn": 2, "filler_as_letters": filler_as_letters},
    }
    pool, _, _ = _pool(catalog_yaml, env, {"max": 1, "dist": {"kind": "fixed", "value": 1}})
    episode = pool.new_group()[0]
    _run(episode.reset())
    wanted = episode.symbols(0)
    first = (len(NAMED_VOCAB) // 8 + 1) * 8  # the first filler id divisible by the alphabet (56 of 64 here)
    fillers = [first + LETTERS.index(symbol) for symbol in wanted]  # each the letter wanted in its place
    result = _run(episode.step(fillers))
    assert result.reward == pytest.approx(1.0 if filler_as_letters else 0.0)


def test_lifecycle_misuse_raises(catalog_yaml):
    pool, _, _ = _pool(catalog_yaml, {"name": "guess_number"}, {"max": 1})
    episode = pool.new_group()[0]
    with pytest.raises(RuntimeError, match="before its reset answered"):
        _run(episode.step([1]))
    _run(episode.reset())
    with pytest.raises(RuntimeError, match="reset twice"):
        _run(episode.reset())
    _run(episode.step([1]))
    with pytest.raises(RuntimeError, match="after it was done"):
        _run(episode.step([1]))


def test_a_step_while_the_previous_one_still_runs_is_refused(catalog_yaml):
    """Two steps of one episode at once would answer two actions for one turn."""
    pool, _, _ = _pool(catalog_yaml, {"name": "guess_number"}, {"max": 4})
    episode = pool.new_group()[0]
    _run(episode.reset())
    latency, failures = episode.begin_step()
    with pytest.raises(RuntimeError, match="previous step was still running"):
        episode.begin_step()
    episode.end_step(VOCAB.encode("1"), latency, failures)
    episode.begin_step()  # the next turn's step is fine


def test_a_simulated_run_s_episodes_answer_with_counts_and_score_the_same(catalog_yaml):
    """A simulated run's pool: prompts and observations are token counts of the lengths a real run's
    are, and the rewards are the same (the environment still reads the action)."""
    from targets.api import TokenCount

    env = {"name": "synthetic_agent", "params": {"alphabet": 4, "symbols_per_turn": 2}}
    catalog_yaml["workload"].update(environment=env, turns={"max": 3, "dist": {"kind": "fixed", "value": 3}})
    spec = parse_target(catalog_yaml)
    results = []
    for counts in (False, True):
        clock = ManualClock()
        pool = EnvironmentPool(spec.workload, clock, Trace(clock, record_tokens=not counts), seed=3, counts=counts)
        episode = pool.new_group()[0]
        prompt = _run(episode.reset())
        steps = [_run(episode.step(VOCAB.encode("a b"))) for _ in range(3)]
        results.append((len(prompt), [(len(s.observation), s.reward, s.done) for s in steps]))
        if counts:
            assert isinstance(prompt, TokenCount) and isinstance(steps[0].observation, TokenCount)
    assert results[0] == results[1]


def test_trajectory_timeout_is_enforced_by_the_harness_clock(catalog_yaml):
    pool, trace, clock = _pool(catalog_yaml, {"name": "guess_number"}, {"max": 8}, trajectory_timeout_s=1.0)
    episode = pool.new_group()[0]
    _run(episode.reset())
    clock.t += 5.0  # the agent took too long
    result = _run(episode.step(VOCAB.encode("5")))
    assert result.done and result.timed_out and result.reward == 0
    assert list(trace.of_kind("env_step"))[-1].data["timed_out"] is True


def test_pool_ids_are_unique_and_groups_differ(catalog_yaml):
    pool, _, _ = _pool(catalog_yaml, {"name": "guess_number"}, {"max": 8})
    groups = [pool.new_group() for _ in range(20)]
    ids = [e.episode_id for g in groups for e in g]
    assert len(ids) == len(set(ids)) == 80
    assert len({g[0].task for g in groups}) > 5


def test_latency_and_turn_distributions_are_long_tailed():
    rng = random.Random(0)
    latency = sorted(Lognormal(kind="lognormal", median=0.02, sigma=1.0).sample(rng) for _ in range(4000))
    median, p99 = latency[len(latency) // 2], latency[int(len(latency) * 0.99)]
    assert median == pytest.approx(0.02, rel=0.1) and p99 / median > 7
    turns = [Geometric(kind="geometric", mean=3).sample(rng) for _ in range(4000)]
    assert statistics.mean(turns) == pytest.approx(3, rel=0.1) and max(turns) >= 15


def test_an_episode_ends_when_its_context_window_is_full(catalog_yaml):
    """prompt 12 + 3 turns of (16 response + 8 observation) = 84 tokens; with max_sequence 90 the
    fourth turn's response no longer fits, so the third step ends the episode (truncated)."""
    catalog_yaml["workload"]["tokens"].update(max_sequence=90)
    pool, trace, _ = _pool(catalog_yaml, {"name": "synthetic_agent"}, {"max": 8, "dist": {"kind": "fixed", "value": 8}})
    episode = pool.new_group()[0]
    _run(episode.reset())
    results = [_run(episode.step([5] * 16)) for _ in range(3)]
    assert [r.done for r in results] == [False, False, True] and results[-1].observation == []
    assert [e.data["truncated"] for e in trace.of_kind("env_step")] == [False, False, True]
    assert episode.context_tokens + 16 > 90 >= episode.context_tokens


def test_a_failed_environment_step_costs_a_restart_and_is_retried(catalog_yaml):
    """With ``env_failure_rate`` a step may fail; the environment restarts (``env_restart_s``) and
    the step runs again: the episode goes on, the time it lost is the harness's, and the trace says
    how often it failed. Without failures the latency draws are exactly what they were."""
    env, turns = {"name": "synthetic_agent"}, {"max": 8, "dist": {"kind": "fixed", "value": 8}}
    common = {"env_latency_s": {"kind": "fixed", "value": 1.0}, "env_latency_max_s": 5.0, "trajectory_timeout_s": 1e6}
    plain, plain_trace, _ = _pool(catalog_yaml, env, turns, **common)
    failing, trace, clock = _pool(catalog_yaml, env, turns, **common, env_failure_rate=0.3, env_restart_s=10.0)
    for pool in (plain, failing):
        for episode in pool.new_group() + pool.new_group():  # 8 episodes of 8 turns, one after another
            _run(episode.reset())
            while not episode.done:
                _run(episode.step(VOCAB.encode("a b")))
    steps = [e.data for e in trace.of_kind("env_step")]
    failures = sum(s["failures"] for s in steps)
    assert len(steps) == 64 and 10 <= failures <= 45  # about 0.3 / 0.7 per step
    assert all(s["latency"] == pytest.approx(1.0 + 11.0 * s["failures"]) for s in steps)
    assert clock.t == pytest.approx(64 + 11.0 * failures)
    assert all(e.data["failures"] == 0 and e.data["latency"] == 1.0 for e in plain_trace.of_kind("env_step"))


def test_a_reset_takes_the_workloads_reset_time_and_nothing_may_step_before_it_answers(catalog_yaml):
    """``env_reset_s``: a sandbox's start. The reset answers after its draw, the trajectory's time (and its
    timeout) runs from the reset's start, a step or checkpoint before the answer is refused; the same episodes
    without it reset at once and draw the same tasks, turns and latencies (the reset draws from its own
    stream: a comparison with and without resets is on the same workload)."""
    env, turns = {"name": "synthetic_agent"}, {"max": 4, "dist": {"kind": "geometric", "mean": 3}}
    common = {
        "env_latency_s": {"kind": "lognormal", "median": 1.0, "sigma": 0.5},
        "env_latency_max_s": 5.0,
        "trajectory_timeout_s": 1e6,  # no reset-long episode timed out: the same turns with and without
    }
    resets = {"env_reset_s": {"kind": "lognormal", "median": 30.0, "sigma": 0.5}}
    stateful = {"env_state": {"change_rate": 0.5, "checkpoint_s": 0.1, "restore_s": 1.0}}
    plain, plain_trace, _ = _pool(catalog_yaml, env, turns, **common, **stateful)
    slow, trace, clock = _pool(catalog_yaml, env, turns, **common, **stateful, **resets)
    for pool in (plain, slow):
        for episode in pool.new_group():
            seconds = episode.begin_reset()
            with pytest.raises(RuntimeError, match="stepped before its reset answered"):
                episode.begin_step()
            with pytest.raises(RuntimeError, match="checkpointed before its reset answered"):
                episode.begin_checkpoint()
            with pytest.raises(RuntimeError, match="reset twice"):
                episode.begin_reset()
            if pool is slow:
                _run(clock.sleep(seconds))
            episode.end_reset()
            while not episode.done:
                _run(episode.step(VOCAB.encode("a b")))
    drawn = [e.data["latency"] for e in trace.of_kind("env_reset")]
    assert len(drawn) == 4 and all(5 < s < 200 for s in drawn) and len(set(drawn)) == 4, drawn
    assert all(e.data["latency"] == 0 for e in plain_trace.of_kind("env_reset"))
    assert [e.data["observation"] for e in trace.of_kind("env_reset")] == [
        e.data["observation"] for e in plain_trace.of_kind("env_reset")
    ]  # the same tasks
    drawn_steps = [(e.data["episode"], e.data["turn"], e.data["latency"]) for e in trace.of_kind("env_step")]
    assert drawn_steps == [
        (e.data["episode"], e.data["turn"], e.data["latency"]) for e in plain_trace.of_kind("env_step")
    ]


def test_a_trajectory_s_timeout_counts_its_reset(catalog_yaml):
    """A reset of 50 s in a trajectory of 60: the first step of 20 s ends it as timed out."""
    env, turns = {"name": "synthetic_agent"}, {"max": 4, "dist": {"kind": "fixed", "value": 4}}
    pool, trace, clock = _pool(
        catalog_yaml,
        env,
        turns,
        env_latency_s={"kind": "fixed", "value": 20.0},
        env_latency_max_s=30.0,
        env_reset_s={"kind": "fixed", "value": 50.0},
        trajectory_timeout_s=60.0,
    )
    episode = pool.new_group()[0]
    _run(episode.reset())
    assert clock.t == 50.0 and next(trace.of_kind("env_reset")).data["latency"] == 50.0
    assert _run(episode.step(VOCAB.encode("a"))).timed_out


def test_env_reset_s_is_refused_for_a_users_environment(catalog_yaml):
    from targets.spec import SpecError

    catalog_yaml["workload"].update(
        environment={"entry": "reasoning_gym:create_dataset", "adapter": "tasks", "params": {"name": "chain_sum"}},
        turns={"max": 1},
        env_reset_s={"kind": "fixed", "value": 1.0},
    )
    with pytest.raises(SpecError, match="env_reset_s models the resets of the harness's environments"):
        parse_target(catalog_yaml)


STATEFUL = {
    "env_failure_rate": 0.3,
    "env_state": {"change_rate": 0.5, "checkpoint_s": 0.1, "restore_s": 1.0, "checkpoint_mb": 2.0},
}


def _play(episode, level: int) -> list:
    """Play ``episode`` to its end, checkpointing as ``checkpoint_level`` ``level`` says (0 never,
    1 after a turn that changed state, 2 every turn); its step results."""

    async def play() -> list:
        await episode.reset()
        results = []
        while not results or not results[-1].done:
            results.append(await episode.step(VOCAB.encode("a")))
            if not results[-1].done and (level == 2 or (level == 1 and results[-1].state_changed)):
                await episode.checkpoint()
        return results

    return _run(play())


@pytest.mark.parametrize("level", [0, 1, 2])
def test_a_crash_loses_the_episode_unless_its_own_last_checkpoint_holds_its_state(catalog_yaml, level):
    """Crab's model: a failed step takes the sandbox with it; the harness restores the episode's own
    last checkpoint (``restore_s``) when no turn since changed state, else the episode ends lost.
    Never checkpointing loses episodes; checkpointing the turns that changed state loses none with
    fewer checkpoints than every turn."""
    pool, trace, _ = _pool(
        catalog_yaml, {"name": "synthetic_agent"}, {"max": 8, "dist": {"kind": "geometric", "mean": 4}}, **STATEFUL
    )
    episodes = [e for _ in range(20) for e in pool.new_group()]
    played = {e.episode_id: _play(e, level) for e in episodes}
    lost = [results for results in played.values() if results[-1].lost]
    steps = [e for e in trace.events if e.kind == "env_step"]
    checkpoints = [e for e in trace.events if e.kind == "env_checkpoint"]
    changed_and_live = sum(r.state_changed for results in played.values() for r in results if not r.done)
    live = sum(not r.done for results in played.values() for r in results)
    restored = [e for e in steps if e.data["failures"] and not e.data["lost"]]
    assert all(results[-1].reward == 0 and results[-1].done for results in lost)
    assert all(not r.lost for results in played.values() for r in results[:-1])  # lost ends the episode
    assert sum(e.data["lost"] for e in steps) == len(lost)
    assert all(e.data["latency"] >= 1.0 for e in restored)  # each restore took restore_s
    if level == 0:
        assert len(lost) >= 5 and not checkpoints, (len(lost), len(checkpoints))
    else:
        assert not lost and restored
        assert len(checkpoints) == (changed_and_live if level == 1 else live) and changed_and_live < live
        assert all(c.data["mb"] == 2.0 and c.t - c.data["start"] == pytest.approx(0.1) for c in checkpoints)


def test_a_checkpoint_only_at_a_turn_boundary_of_a_live_episode(catalog_yaml):
    pool, _, _ = _pool(
        catalog_yaml, {"name": "synthetic_agent"}, {"max": 1, "dist": {"kind": "geometric", "mean": 1}}, **STATEFUL
    )
    episode = pool.new_group()[0]
    with pytest.raises(RuntimeError, match="checkpointed before its reset answered"):
        _run(episode.checkpoint())
    _run(episode.reset())
    episode.begin_step()
    with pytest.raises(RuntimeError, match="checkpointed while a step was still running"):
        episode.begin_checkpoint()
    episode.end_step(VOCAB.encode("a"), 0.0, 0)
    with pytest.raises(RuntimeError, match="checkpointed after it was done"):
        _run(episode.checkpoint())
    turns = {"max": 2, "dist": {"kind": "geometric", "mean": 2}}
    stateless, _, _ = _pool(catalog_yaml, {"name": "synthetic_agent"}, turns, env_state=None)
    episode = stateless.new_group()[0]
    _run(episode.reset())
    with pytest.raises(ValueError, match="keep their state through a crash"):
        _run(episode.checkpoint())
