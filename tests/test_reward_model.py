"""A reward model that judges each finished trajectory (RollArt-like targets): the spec and its
refusals, the simulated judge where a stack places it (beside the policy, on devices set aside,
serverless), and the reward_placement technique seen from the trace, with its misuses planted: a
dedicated device the controller rolls out on, a placement the target does not offer."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from targets.api import Device, EngineSettings, TokenCount, TraceEvent, TrainBatch, Trajectory
from targets.harness.judge.audit import audit_run
from targets.harness.reward_model.service import JudgeProcessError, RewardModelService, fresh_process
from targets.harness.sim.cluster import SimCluster
from targets.harness.sim.cost_model import ClusterCosts
from targets.harness.sim.response_length import ResponseLengths
from targets.harness.sim.reward import (
    SERVERLESS_CONCURRENCY,
    RewardService,
    dedicated_engines,
    judge_costs_of,
    placement_refused,
)
from targets.harness.sim.virtual_time import run_virtual
from targets.harness.trace import Trace
from targets.spec import CATALOG_DIR, SpecError, parse_target
from targets.spec.reward import ServerlessSpec
from tests.technique_run import planted, round_hints, target_run

pytestmark = pytest.mark.usefixtures("shared_ray")  # its real runs join one Ray cluster (conftest.py)

JUDGE = "qwen3-8b-h800x16-judge"


def _catalog() -> dict:
    return yaml.safe_load((CATALOG_DIR / f"{JUDGE}.yaml").read_text())


def _small() -> dict:
    """The judged target at a quarter of its size: 4 devices, batch 16, 2 steps."""
    data = _catalog()
    data["hardware"]["count"] = 4
    data["workload"].update(batch_size=16, train_steps=2)
    data["baselines"] = [{"name": "time_multiplex", "train_devices": 2}]
    return data


# -- the contract --------------------------------------------------------------------------------------


def test_the_judged_target_carries_its_reward_model_and_the_stack_is_told_of_it():
    from targets.harness.target import workload_view

    spec = parse_target(_catalog())
    judge = spec.workload.reward_model
    assert judge.model.param_counts().active == pytest.approx(7.62e9) and judge.serverless.max_devices == 8
    assert workload_view(spec).reward_model and not workload_view(parse_target(_plain())).reward_model


def _plain() -> dict:
    data = _catalog()
    del data["workload"]["reward_model"]
    return data


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"workload.reward_model.output_tokens": 0}, "workload.reward_model.output_tokens"),
        ({"workload.reward_model.serverless.cold_start_s": -1}, "workload.reward_model.serverless.cold_start_s"),
        ({"workload.reward_model.serverless.pool": "h20"}, "`workload.reward_model.serverless.pool`: unknown field"),
    ],
)
def test_a_bad_reward_model_field_is_named_by_its_path(change, message):
    data = _catalog()
    for path, value in change.items():
        *parents, last = path.split(".")
        node = data
        for key in parents:
            node = node[key]
        node[last] = value
    with pytest.raises(SpecError, match=message):
        parse_target(data)


def test_a_placement_the_target_does_not_offer_is_refused_by_name():
    judged, plain = parse_target(_catalog()).workload, parse_target(_plain()).workload
    devices = [f"h800:{i}" for i in range(16)]
    rollout, train = devices[:8], devices[8:14]
    dedicated = EngineSettings(reward="dedicated", reward_devices=("h800:14", "h800:15"))
    assert placement_refused(judged, dedicated, rollout, train, devices) is None
    assert placement_refused(judged, EngineSettings(reward="serverless"), rollout, train, devices) is None
    cases = [
        (plain, EngineSettings(reward="serverless"), "the target has none"),
        (
            judged.model_copy(update={"reward_model": judged.reward_model.model_copy(update={"serverless": None})}),
            EngineSettings(reward="serverless"),
            "offers no serverless service",
        ),
        (judged, EngineSettings(reward="dedicated"), "go with a dedicated reward model"),
        (judged, EngineSettings(reward="colocated", reward_devices=("h800:15",)), "go with a dedicated reward model"),
        (judged, EngineSettings(reward="dedicated", reward_devices=("h20:0",)), "are not the job's devices"),
        (judged, EngineSettings(reward="dedicated", reward_devices=("h800:7",)), "the controller places rollout"),
    ]
    for workload, engine, message in cases:
        assert message in placement_refused(workload, engine, rollout, train, devices)


# -- the judge alone ---------------------------------------------------------------------------------


def _judged(
    where: str, finishing: list[float], reserved: tuple[str, ...] = (), tokens: int = 8192
) -> tuple[dict, list, dict]:
    """The small target's judge placed ``where``, fed one 8K-token trajectory at each time of
    ``finishing`` (virtual seconds): (its summary at the end, each verdict's (start, end), the
    rollout engines' KV capacity, the cluster, the trace, what the run was failed with)."""
    spec = parse_target(_small())
    every = [Device(f"h800:{i}", "h800", i) for i in range(4)]
    devices = [d for d in every if d.id not in reserved]
    costs = ClusterCosts.from_spec(spec)
    judge_costs = judge_costs_of(spec)
    if where == "colocated":
        costs = costs.hosting(judge_costs.shared.weight_bytes)
    placement = EngineSettings(reward=where, reward_devices=reserved)

    async def main():
        trace = Trace(_Clock(), record_tokens=False)
        lengths = ResponseLengths(spec.workload.tokens, 0)
        cluster = SimCluster(every, devices, costs, lengths, judging=reserved)
        failures: list[BaseException] = []
        service = RewardService(
            spec.workload.reward_model, placement, cluster, judge_costs, costs.shared, trace, failures.append
        )
        loop, verdicts = asyncio.get_running_loop(), []
        for i, t in enumerate(finishing):

            def finish(i=i, start=t):  # what the judge reads of an episode whose last step ended now
                ended = types.SimpleNamespace(
                    episode_id=f"g{i}/e0", context_tokens=tokens, last_step=TraceEvent("env_step", loop.time(), {})
                )
                service.judge(ended, lambda score: verdicts.append((start, loop.time())))

            loop.call_at(t, finish)
        for _ in range(2000):  # 1,000 virtual seconds at most: a verdict never answered fails the test
            if len(verdicts) == len(finishing) or failures:
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(200)  # long enough for idle instances to be released
        summary = service.summary(loop.time())
        state = {"capacity": cluster.engines[0].capacity, "cluster": cluster, "trace": trace, "failed": failures}
        return summary, verdicts, state

    return run_virtual(main())


class _Clock:
    def now(self) -> float:
        return asyncio.get_running_loop().time()


def test_verdicts_queued_behind_others_on_one_instance_are_timed_from_their_turn(monkeypatch):
    """A review of the harness: a verdict's timeout counted the time it waited for its instance's pipes, so
    verdicts routed to one busy instance (a colocated placement serving many episodes ending at once) timed
    out in the queue, and the run stopped as the reward model's failure. Here the limit is 0.25 s and each
    verdict takes 0.1 s: the fourth in the queue waits 0.3 s for its turn and is still scored."""
    from targets.harness.reward_model import service as reward_service
    from targets.harness.reward_model.service import JudgeInstance, Usage

    monkeypatch.setattr(reward_service, "VERDICT_TIMEOUT_S", 0.25)
    failures, scores = [], []

    class Pipes:  # the judge process's two pipes: a request line in, after 0.1 s its verdict line out
        def write(self, data: bytes) -> None:
            pass

        async def drain(self) -> None:
            pass

        async def readline(self) -> bytes:
            await asyncio.sleep(0.1)
            return b'{"score": 0.5}\n'

    async def run() -> None:
        service = object.__new__(RewardModelService)
        service.trace, service.where, service.fail = Trace(_Clock(), record_tokens=False), "colocated", failures.append
        service._closing, service.scored = False, 0
        instance = JudgeInstance("judge:cpu:0", ["cpu:0"], Usage(0.0, 1), requests=Pipes(), verdicts=Pipes())
        instance.starting = asyncio.get_running_loop().create_future()
        instance.starting.set_result(None)
        verdicts = [service._verdict(instance, f"g0/e{m}", [5, 6], 0.0, scores.append) for m in range(4)]
        await asyncio.gather(*verdicts)

    asyncio.run(run())
    assert failures == [] and scores == [0.5] * 4, failures


def test_colocated_verdicts_run_on_the_rollout_engines_and_take_room_from_their_kv_cache():
    summary, verdicts, state = _judged("colocated", [1.0, 1.0, 5.0])
    spec = parse_target(_small())
    policy = ClusterCosts.from_spec(spec).shared
    judge_tokens = judge_costs_of(spec).shared.weight_bytes / policy.kv_bytes_per_token  # the policy's KV it displaces
    assert state["capacity"] == pytest.approx(policy.kv_capacity_tokens - judge_tokens, abs=2)
    assert summary["where"] == "colocated" and summary["scored"] == 3 and summary["device_s"] == 0
    assert all(end > start for start, end in verdicts)
    records = [e for e in state["trace"].events if e.kind == "reward"]
    assert len(records) == 3 and {r.data["device"] for r in records} <= {f"h800:{i}" for i in range(4)}


def test_a_serverless_judge_starts_instances_cold_scales_with_its_verdicts_and_lets_idle_ones_go():
    serverless = parse_target(_small()).workload.reward_model.serverless
    burst = [1.0] * (SERVERLESS_CONCURRENCY + 1) + [100.0]  # one more than an instance takes, then one late
    summary, verdicts, _ = _judged("serverless", burst)
    first = verdicts[0]
    assert first[1] - first[0] >= serverless.cold_start_s  # the first verdict waited for a cold start
    assert summary["instances"] == 2  # the burst outgrew one instance; the late verdict found one warm
    late = verdicts[-1]
    assert late[1] - late[0] < serverless.cold_start_s
    # billed from each start to its release, keep_warm_s after its last verdict: less than the whole run
    assert 0 < summary["busy_s"] < summary["device_s"] < 2 * (100 + 200)
    assert 0 < summary["utilization"] < 1


def test_a_dedicated_judge_holds_its_devices_for_the_whole_run_and_they_never_train():
    summary, verdicts, state = _judged("dedicated", [1.0, 2.0, 3.0], reserved=("h800:3",))
    end = max(t for _, t in verdicts) + 200
    assert summary["instances"] == 1 and summary["device_s"] == pytest.approx(end, abs=1)  # held from the start
    assert summary["utilization"] < 0.5  # three verdicts in a run of over 200 s: idle most of it
    assert {e.data["device"] for e in state["trace"].events if e.kind == "reward"} == {"h800:3"}
    cluster = state["cluster"]

    async def train():
        batch = TrainBatch([Trajectory.start("g0/e0", "g0", TokenCount(16))], [1.0])
        await cluster.train(batch, [d for d in cluster.devices if d.id == "h800:3"])

    with pytest.raises(ValueError, match=r"set aside for the reward model \(reward_devices\): training never"):
        run_virtual(train())


def _mixed_judged() -> ClusterCosts:
    """The RollArt-like H20 + H800 target with the judged target's reward model: its judge's costs."""
    data = yaml.safe_load((CATALOG_DIR / "qwen3-8b-h20x8-h800x8.yaml").read_text())
    data["workload"]["reward_model"] = _catalog()["workload"]["reward_model"]
    return judge_costs_of(parse_target(data))


def test_a_dedicated_judge_runs_at_the_pace_of_the_pool_its_devices_are_in():
    judge_costs = _mixed_judged()
    engines = dedicated_engines(("h20:0", "h800:0"), judge_costs)
    assert engines == [["h20:0"], ["h800:0"]]
    h20, h800 = judge_costs.of("h20:0"), judge_costs.of("h800:0")
    assert h20.prefill_s(8192, 0) > 2 * h800.prefill_s(8192, 0)  # H20: under a sixth of an H800's FLOP/s


def test_a_judge_whose_weights_need_two_devices_gets_engines_of_two_within_one_pool():
    judge_costs = dataclasses.replace(
        _mixed_judged(), pools={n: dataclasses.replace(c, engine_devices=2) for n, c in _mixed_judged().pools.items()}
    )
    assert dedicated_engines(("h800:0", "h800:1", "h20:2", "h20:3"), judge_costs) == [
        ["h800:0", "h800:1"],
        ["h20:2", "h20:3"],
    ]
    for reserved in [("h800:0",), ("h800:0", "h20:0"), ("h800:0", "h800:1", "h800:2")]:
        refused = dedicated_engines(reserved, judge_costs)
        assert isinstance(refused, str) and "engines of the reward model's 2 devices within one pool" in refused


def test_a_serverless_cap_that_holds_no_instance_of_the_judge_is_named():
    """A 72B judge needs 4 H800s an instance: a cap of 1 device started none, and the first verdict
    raised min() of an empty sequence deep in the run."""
    data = _catalog()
    judge = data["workload"]["reward_model"]
    judge["model"]["params"] = {"total": 72e9, "active": 72e9}
    judge["serverless"]["max_devices"] = 1
    with pytest.raises(ValueError, match="serverless.max_devices 1 holds no instance of the judge: its weights need 4"):
        judge_costs_of(parse_target(data))


# -- the technique, simulated end to end ---------------------------------------------------------------


def _run(tmp_path, params: dict, patch=None):
    spec, run = target_run(tmp_path, _small(), params, True, patch=patch)
    return spec, run


@pytest.mark.slow
@pytest.mark.parametrize(("placement", "where"), [(0, "colocated"), (1, "dedicated"), (2, "serverless")])
def test_every_trained_trajectory_was_judged_where_the_stack_placed_the_judge(tmp_path, placement, where):
    params = {"reward_placement": placement, "reward_devices": 1, "train_devices": 1}
    spec, run = _run(tmp_path, params)
    assert run.ok, run.cause
    assert run.results["audit"]["result"]["passed"], run.results["audit"]["result"]["reasons"]
    events = Trace.load_events(run.out / "trace.jsonl")
    verdicts = {e.data["episode"]: e for e in events if e.kind == "reward"}
    assert {e.data["where"] for e in verdicts.values()} == {where}
    ends = {e.data["episode"]: e for e in events if e.kind == "env_step" and e.data["done"]}
    used = [t["episode"] for e in events if e.kind == "train" for t in e.data["trajectories"]]
    assert len(used) == spec.workload.batch_size * spec.workload.train_steps
    for episode in used:
        end = ends[episode]
        if not end.data["timed_out"] and not end.data["lost"]:
            assert episode in verdicts and verdicts[episode].data["start"] == pytest.approx(end.t)
    service = next(e.data for e in events if e.kind == "reward_service")
    assert service["where"] == where and service["scored"] == len(verdicts)
    if where == "dedicated":
        assert service["device_s"] > 0 and not any(
            "h800:3" in e.data.get("devices", [e.data.get("device")]) for e in events if e.kind in ("generate", "train")
        )
    start = next(e for e in events if e.kind == "run_start").data["engine"]
    assert start["reward"] == where


@pytest.mark.slow
@pytest.mark.parametrize("technique", [{"redundant_envs": 2}, {"tail_round": 4}])
def test_spares_and_deferrals_are_judged_by_when_the_stack_heard_of_the_end_the_verdict(tmp_path, technique):
    """With a reward model an episode's last answer waits for its verdict: until then the stack knows
    it as running, so a spare dropped or a group deferred in that wait is honest. The audit reads an
    episode's end from the verdict (a 20-round search rejected both techniques when it read the step).
    Spares also keep their groups' shorter members, which the selection net bounds below what they choose
    here (docs/judge.md): this target allows it, as the verdict's timing is what is tested."""
    data = _small()
    if "redundant_envs" in technique:
        data["accuracy"] = {**data.get("accuracy", {}), "selection_member_shortfall": 0.6}
    spec, run = target_run(tmp_path, data, {"train_devices": 1, **technique}, True)
    assert run.ok, run.cause
    assert run.results["audit"]["result"]["passed"], run.results["audit"]["result"]["reasons"]
    events = Trace.load_events(run.out / "trace.jsonl")
    reason = "redundant" if "redundant_envs" in technique else "deferred"
    assert any(e.kind == "sample_dropped" and e.data["reason"] == reason for e in events)


@pytest.mark.slow
def test_a_controller_that_rolls_out_on_the_judges_devices_is_refused_at_its_hello(tmp_path):
    # the plant: the judge's devices set aside in the declaration, but the controller still given them
    greedy = planted(
        "reward_placement.py",
        "    return dataclasses.replace(runtime, devices=kept), where, tuple(d.id for d in reserved)",
        "    return runtime, where, tuple(d.id for d in reserved)",
    )
    _, run = _run(tmp_path, {"reward_placement": 1, "reward_devices": 1, "train_devices": 1}, patch=greedy)
    assert not run.ok and "set aside for the reward model: the controller places rollout or training there" in run.cause


@pytest.mark.slow
def test_a_serverless_judge_on_a_target_without_the_service_is_refused_by_name(tmp_path):
    data = _small()
    del data["workload"]["reward_model"]["serverless"]
    _, run = target_run(tmp_path, data, {"reward_placement": 2}, True)
    assert not run.ok and "the target offers no serverless service" in run.cause


# -- the audit: a reward is the judge's, on the trajectory trained, before it is trained on ------------


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    """An honest colocated run on the small judged target: (spec, its trace's events, its summary)."""
    spec, run = _run(tmp_path_factory.mktemp("judged"), {"train_devices": 1})
    assert run.ok, run.cause
    return spec, Trace.load_events(run.out / "trace.jsonl"), run.results["system"]


def _verdict_of_a_trained_episode(events) -> tuple[TraceEvent, TraceEvent]:
    """(the verdict of the first trained episode that was judged, the train event that used it)."""
    train = min((e for e in events if e.kind == "train"), key=lambda e: e.data["start"])
    verdicts = {e.data["episode"]: e for e in events if e.kind == "reward"}
    episode = next(t["episode"] for t in train.data["trajectories"] if t["episode"] in verdicts)
    return verdicts[episode], train


def _audit_of(spec, events):
    return audit_run(spec, events, lambda v: None, lambda s: None, spec.workload.train_steps)


def _moved_after(verdict, train):
    return dataclasses.replace(verdict, t=train.data["start"] + 1.0)


def _read_less(verdict, train):
    return dataclasses.replace(verdict, data={**verdict.data, "tokens": verdict.data["tokens"] - 1})


@pytest.mark.slow
def test_the_honest_judged_run_passes_the_verdict_audit(judged):
    spec, events, summary = judged
    result = _audit_of(spec, events)
    assert result.passed, result.reasons
    assert result.details["verdicts"] > 0
    # the run's summary says the KV room its engines had, the judge's weights beside them taken out
    policy, judge = ClusterCosts.from_spec(spec), judge_costs_of(spec)
    assert summary["kv_capacity_tokens"] == policy.hosting(judge.shared.weight_bytes).shared.kv_capacity_tokens
    assert summary["kv_capacity_tokens"] < policy.shared.kv_capacity_tokens
    # a round's evaluator reads the judge's figures from the summary it keeps: the placement hint follows
    (hint,) = [h for h in round_hints(spec, events, summary) if h.code == "judge_placement"]
    assert hint.evidence["where"] == "colocated" and hint.evidence["verdict_s"] > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("plant", "reason"),
    [
        (None, "with 0 verdicts of the reward model"),  # a reward the judge never gave
        (_moved_after, "before the reward model's verdict"),  # trained on a guessed reward
        (_read_less, "not its whole context"),  # the judge read another trajectory
    ],
)
def test_a_reward_that_is_not_the_judges_verdict_on_the_trained_trajectory_is_rejected(judged, plant, reason):
    spec, events, _ = judged
    events = copy.deepcopy(events)
    verdict, train = _verdict_of_a_trained_episode(events)
    at = events.index(verdict)
    events[at : at + 1] = [plant(verdict, train)] if plant else []
    result = _audit_of(spec, events)
    assert not result.passed
    assert any(reason in line and verdict.data["episode"] in line for line in result.reasons), result.reasons


@pytest.mark.parametrize("where", ["colocated", "dedicated", "serverless"])
def test_a_verdict_no_engine_can_take_fails_the_run_by_name(where):
    """A trajectory longer than the judge's engine holds is the run's failure, said, not a hang."""
    reserved = ("h800:3",) if where == "dedicated" else ()
    _, verdicts, state = _judged(where, [1.0], reserved=reserved, tokens=10**8)
    assert not verdicts and len(state["failed"]) == 1
    assert "exceeds the KV capacity" in str(state["failed"][0])


# -- the judge run for real on the CPU target ---------------------------------------------------------


def _real_judged(devices: int) -> dict:
    """The CPU judged target (its tiny judge, a serverless service starting an instance in a second),
    on ``devices`` devices, at the fast target's batch and two steps."""
    data = yaml.safe_load((CATALOG_DIR / "tiny-qwen3-cpu-judge.yaml").read_text())
    data["hardware"]["count"] = devices
    data["workload"].update(batch_size=16, train_steps=2)
    data["baselines"] = [{"name": "time_multiplex"}]  # the catalog's splits need its 3 devices
    return data


def _real_run(tmp_path, placement: int, devices: int = 2, patch=None):
    params = {"reward_placement": placement, **({"reward_devices": 1} if placement == 1 else {})}
    return target_run(tmp_path, _real_judged(devices), params, simulate=False, patch=patch)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("placement", "where", "devices"), [(0, "colocated", 2), (1, "dedicated", 3), (2, "serverless", 2)]
)
def test_a_real_reward_model_judges_each_trajectory_where_the_stack_places_it(tmp_path, placement, where, devices):
    """The judge's processes really run: each verdict is its score of the episode's whole context,
    added to the environment's last reward, and the audit holds the trained rewards to it."""
    spec, run = _real_run(tmp_path, placement, devices)
    assert run.ok, run.cause
    audit = run.results["audit"]["result"]
    assert audit["passed"], audit["reasons"]
    events = Trace.load_events(run.out / "trace.jsonl")
    verdicts = [e for e in events if e.kind == "reward"]
    trained = {t["episode"] for e in events if e.kind == "train" for t in e.data["trajectories"]}
    assert trained and trained <= {v.data["episode"] for v in verdicts} | _ended_badly(events)
    paid = {e.data["episode"]: 0.0 for e in events if e.kind == "env_step"}
    for e in events:
        if e.kind == "env_step":
            paid[e.data["episode"]] += e.data["reward"]
    score = {v.data["episode"]: v.data["score"] for v in verdicts}
    for t in (t for e in events if e.kind == "train" for t in e.data["trajectories"]):  # the score reached training
        assert t["reward"] == pytest.approx(paid[t["episode"]] + score.get(t["episode"], 0.0), abs=1e-6)
    scores = [v.data["score"] for v in verdicts]
    assert all(0 < s < 1 for s in scores) and len(set(scores)) > 1  # a model's verdicts, not a constant
    assert {v.data["where"] for v in verdicts} == {where}
    (service,) = [e.data for e in events if e.kind == "reward_service"]
    assert service["scored"] == len(verdicts) and service["busy_s"] > 0
    rolled = {e.data["device"] for e in events if e.kind == "generate" and not e.data["aborted"]}
    if where == "colocated":  # beside the engine that served the last turn
        assert {v.data["device"] for v in verdicts} <= rolled and service["device_s"] == 0
    elif where == "dedicated":  # the job's last device, set aside: it never rolls out or trains
        assert {v.data["device"] for v in verdicts} == {"cpu:2"} and "cpu:2" not in rolled
        assert not any("cpu:2" in e.data["devices"] for e in events if e.kind == "train")
        assert 0 < service["utilization"] < 1
        # planted: a train call on the judge's device, which a real cluster would not refuse by itself
        train = next(e for e in events if e.kind == "train")
        planted_events = [
            dataclasses.replace(e, data={**e.data, "devices": [*e.data["devices"], "cpu:2"]}) if e is train else e
            for e in events
        ]
        result = _audit_of(spec, planted_events)
        assert any("reward device used" in line and "cpu:2" in line for line in result.reasons), result.reasons
    else:  # outside the job, started cold on demand
        assert all(v.data["device"].startswith("serverless:") for v in verdicts)
        assert service["instances"] >= 1 and service["device_s"] > 0
        first = min(verdicts, key=lambda v: v.t)
        cold = _real_judged(devices)["workload"]["reward_model"]["serverless"]["cold_start_s"]
        assert first.t - first.data["start"] >= cold  # the first verdict waited for a cold start


def _ended_badly(events) -> set[str]:
    return {e.data["episode"] for e in events if e.kind == "env_step" and (e.data["timed_out"] or e.data["lost"])}


@pytest.mark.slow
def test_a_stack_that_scores_its_own_episodes_is_rejected_for_the_reward_it_trained_on(tmp_path):
    """A stack that gives each finished episode full marks in place of the judge's verdict."""
    patch = planted(
        "env_manager.py",
        "result = await episode.step(completion.tokens)\n",
        "result = await episode.step(completion.tokens)\n"
        "                if result.done:  # planted: the stack's own verdict\n"
        "                    result = dataclasses.replace(result, reward=1.0)\n",
    )
    _, run = _real_run(tmp_path, 0, patch=patch)
    assert not run.ok or not run.results["audit"]["result"]["passed"]
    reasons = run.results["audit"]["result"]["reasons"]
    assert any("altered reward" in r and "environment and reward model paid" in r for r in reasons), reasons


# -- the real service's failures, with stand-in judge processes (no model to load) ------------------------

PIPES = (  # a judge process's two pipes, the last arguments of its command line
    "import json, os, sys\nrequests, verdicts = open(int(sys.argv[-2])), open(int(sys.argv[-1]), 'w', buffering=1)\n"
)
JUDGE_ANSWERS = (
    PIPES + "verdicts.write('ready\\n')\nfor line in requests: verdicts.write(json.dumps({'score': 0.5}) + '\\n')"
)
JUDGE_DIES = "import sys\nsys.stderr.write('no weights at that path')\nsys.exit(3)"
JUDGE_BABBLES = PIPES + "verdicts.write('ready\\n')\nfor line in requests: verdicts.write('I think so\\n')"


class _StandInJudges(RewardModelService):
    """The real service with a judge process that runs ``code`` in place of a model's."""

    def __init__(self, code: str, where: str, failures: list, keep_warm_s: float = 60.0) -> None:
        spec = parse_target(_real_judged(3))
        judge = spec.workload.reward_model.model_copy(
            update={"serverless": ServerlessSpec(cold_start_s=0.0, keep_warm_s=keep_warm_s, max_devices=2)}
        )
        reserved = ("cpu:2",) if where == "dedicated" else ()
        placement = EngineSettings(reward=where, reward_devices=reserved)
        devices = ["cpu:0", "cpu:1", "cpu:2"]
        trace = Trace(_Clock(), record_tokens=False)
        nowhere = Path("/nonexistent")  # the stand-ins read no model
        super().__init__(
            judge, placement, devices, nowhere, nowhere, judge_costs_of(spec), trace, {}.get, failures.append
        )
        self.code = code

    async def launch(self, requests: int, verdicts: int, log: int, env: dict[str, str]):
        return await fresh_process([sys.executable, "-c", self.code], requests, verdicts, log, env)


def _ended(name: str, at: float) -> types.SimpleNamespace:
    return types.SimpleNamespace(episode_id=name, context=[5, 6, 7], last_step=TraceEvent("env_step", at, {}))


def test_a_judge_process_that_dies_at_start_fails_the_run_by_name():
    async def main():
        service = _StandInJudges(JUDGE_DIES, "dedicated", [])
        try:
            with pytest.raises(
                JudgeProcessError, match="judge:cpu:2 said b'' instead of ready:\nno weights at that path"
            ):
                await service.start(["cpu:0"])
        finally:
            await service.close()

    asyncio.run(main())


def test_a_judge_that_answers_no_verdict_fails_the_run_never_leaves_the_episode_waiting():
    async def main():
        failures: list = []
        service = _StandInJudges(JUDGE_BABBLES, "dedicated", failures)
        await service.start(["cpu:0"])
        answered: list = []
        service.judge(_ended("g0/e0", 0.0), answered.append)
        for _ in range(100):
            if failures:
                break
            await asyncio.sleep(0.05)
        await service.close()
        return failures, answered

    failures, answered = asyncio.run(main())
    assert not answered and len(failures) == 1 and isinstance(failures[0], JudgeProcessError)
    assert "judge:cpu:2 answered out of turn" in str(failures[0])


def test_a_real_serverless_judge_lets_an_idle_instance_go_and_starts_another_when_asked_again():
    async def main():
        failures: list = []
        service = _StandInJudges(JUDGE_ANSWERS, "serverless", failures, keep_warm_s=0.3)
        await service.start([])
        answered: list = []
        loop = asyncio.get_running_loop()
        for name in ("g0/e0", "g1/e0"):  # the second long after the first instance went idle
            service.judge(_ended(name, loop.time()), answered.append)
            for _ in range(200):
                if len(answered) == (1 if name == "g0/e0" else 2) or failures:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)
        summary = service.summary(loop.time())
        processes = [i.process for i in service.instances]
        await service.close()
        return failures, answered, summary, processes

    failures, answered, summary, processes = asyncio.run(main())
    assert not failures and answered == [0.5, 0.5]
    assert summary["instances"] == 2 and summary["scored"] == 2  # the first was let go, the second started cold
    assert all(p.returncode is not None for p in processes)  # each process ended with its release or the close
    assert 0 < summary["busy_s"] < summary["device_s"] < 2 * 2.5


def test_a_launched_runs_judge_is_a_warm_fork_of_the_harness_zygote_and_scores_as_a_fresh_one():
    """A harness child the launcher started forks its judges from the harness zygote (torch and
    transformers imported there once; a fresh judge process imports them, ~5 CPU-seconds), tells its
    watchdog of each (the run's limits hold them), and a fork's verdict is a fresh process's."""
    from targets.harness.isolation.zygote_client import ReportedForks, ZygoteClient, drop_forks, use_forks, zygote
    from targets.harness.model import model_dir
    from targets.harness.reward_model import service as judges

    spec = parse_target(_real_judged(2))
    judge = spec.workload.reward_model

    def colocated() -> RewardModelService:
        trace = Trace(_Clock(), record_tokens=False)
        return RewardModelService(
            judge,
            EngineSettings(reward="colocated"),
            ["cpu:0", "cpu:1"],
            model_dir(judge.model),
            model_dir(spec.model),
            judge_costs_of(spec),
            trace,
            {}.get,
            pytest.fail,
        )

    async def score_once(service: RewardModelService):
        await service.start(["cpu:0"])
        (instance,) = service.instances
        try:
            return instance.process, await instance.score([5, 6, 7, 8], 60.0)
        finally:
            await service.close()

    harness, reported = zygote(), []
    use_forks(ReportedForks(ZygoteClient(harness.connect(), "harness"), reported.append))
    try:
        forked, forked_score = asyncio.run(score_once(colocated()))
    finally:
        drop_forks("harness")
    assert isinstance(forked, judges.ForkedJudge) and reported == [forked.child.pid]
    assert forked.returncode == 0  # it ended with the service's close
    fresh, fresh_score = asyncio.run(score_once(colocated()))
    assert isinstance(fresh, asyncio.subprocess.Process) and fresh.returncode == 0
    assert 0 < forked_score < 1 and forked_score == fresh_score


def test_a_judge_process_imports_the_harness_whatever_folder_the_run_started_in(tmp_path, monkeypatch):
    """Its ``python -m`` imports from its working directory first: a run started in a folder holding a
    ``targets`` package of its own (the user's project) gave the judge's process that one."""
    (tmp_path / "targets").mkdir()
    (tmp_path / "targets" / "__init__.py").write_text("raise ImportError('the decoy targets package')\n")
    monkeypatch.chdir(tmp_path)
    plain = subprocess.run([sys.executable, "-c", "import targets"], capture_output=True, text=True)
    assert plain.returncode != 0 and "the decoy targets package" in plain.stderr  # the plant acts on a plain start
    imports_the_harness = "import targets.harness.reward_model.judge_process\n" + JUDGE_BABBLES

    async def main() -> int:
        service = _StandInJudges(imports_the_harness, "dedicated", [])
        try:
            await service.start(["cpu:0"])  # raises with the process's last words if it never said ready
            return sum(i.process is not None and i.process.returncode is None for i in service.instances)
        finally:
            await service.close()

    assert asyncio.run(main()) == 1  # its judge process started, said ready and was running


def test_the_reference_loop_and_export_refuse_a_judged_target_by_name(tmp_path):
    """Both would train on the environment's rewards alone, with no judge: they say so instead."""
    from typer.testing import CliRunner

    from orchestrator.cli import app
    from orchestrator.export import ExportError, export_project
    from skills.starter import write_starter
    from targets.spec import load_target

    result = CliRunner().invoke(app, ["reference", "tiny-qwen3-cpu-judge", "--steps", "1"])
    assert result.exit_code == 2 and "has a reward model" in result.output and "Traceback" not in result.output
    candidate = write_starter(tmp_path / "stack", load_target("tiny-qwen3-cpu-judge"), "colocate")
    with pytest.raises(ExportError, match=r"has a reward model \(workload.reward_model\)"):
        export_project(candidate, "tiny-qwen3-cpu-judge", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_real_reward_model_on_gpus_or_with_a_long_verdict_is_refused_by_its_path():
    data = _real_judged(3)
    data["hardware"] = {"kind": "h100", "count": 3}
    with pytest.raises(SpecError, match="workload.reward_model: a reward model runs for real on CPU targets only"):
        parse_target(data)
    data = _real_judged(3)
    data["workload"]["reward_model"]["output_tokens"] = 16
    with pytest.raises(SpecError, match="a real judge gives a score, one token; got 16"):
        parse_target(data)
