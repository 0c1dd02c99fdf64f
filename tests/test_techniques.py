"""Each scheduling technique, seen working from the harness's trace: in a real run of the tiny CPU
target and in a simulated one, with the audit passing. (The audit's plants of each technique's
misuse are in tests/test_audit.py.) Speculative decoding, which works inside the engine, is read
from the engine's own log in a real run and from the turns' speed in a simulated one, with its misuse
planted here.
The real runs join the test session's shared Ray cluster (``shared_ray``), as a stack on a Ray cluster would."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections import Counter

import pytest
import yaml

from targets.harness.trace import Trace, token_count
from tests.technique_run import audited_run, harness_run, planted, round_hints, target_run

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]

# A real run of two training steps, not the fast target's four, where what is asserted happens from the
# first step on (an engine's drafts, restores and chunks; groups launched and routed before any training;
# the sync each step overlaps). Not timed one by one: a step of these runs is a few seconds here.
TWO_STEPS = {"train_steps": 2}


@pytest.mark.parametrize("simulate", [False, True], ids=["real", "simulated"])
def test_redundant_envs_keep_the_first_members_and_drop_the_spares(tmp_path, fast_target, simulate):
    """Keeping a group's first finishers is a choice of its shorter members: the audit measures it by the
    turns each member drew (a third shorter here, over the 19% two spares may choose by default), so this
    target allows it (``accuracy.selection_member_shortfall``) to show the mechanism."""
    data = yaml.safe_load(fast_target.read_text())
    data["accuracy"] = {**data.get("accuracy", {}), "selection_member_shortfall": 0.6}
    spec, run = target_run(tmp_path, data, {"redundant_envs": 2}, simulate)
    assert run.ok, run.cause
    audit = run.results["audit"]["result"]
    assert audit["passed"], audit["reasons"]
    assert audit["details"]["selection_members_drawn_turns"] > audit["details"]["selection_members_turns"] > 0
    events = Trace.load_events(run.out / "trace.jsonl")
    created = Counter(e.data["group"] for e in events if e.kind == "episode_created")
    assert set(created.values()) == {spec.workload.group_size + 2}  # every group launched with its spares
    group_of = {e.data["episode"]: e.data["group"] for e in events if e.kind == "episode_created"}
    redundant = Counter(
        group_of[e.data["episode"]] for e in events if e.kind == "sample_dropped" and e.data["reason"] == "redundant"
    )
    trained = Counter(group_of[t["episode"]] for e in events if e.kind == "train" for t in e.data["trajectories"])
    assert trained and set(trained.values()) == {spec.workload.group_size}  # groups train whole, spares never
    assert redundant and max(redundant.values()) <= 2
    assert sum(redundant[g] for g in trained) == 2 * len(trained)  # a trained group's spares all went back
    # a spare dropped mid-turn had its turn stopped on the engine as it was dropped, never completed
    dropped_at = {e.data["episode"]: e.t for e in events if e.kind == "sample_dropped"}
    cancelled = [e for e in events if e.kind == "generate_cancelled"]
    completed = {(e.data["episode"], e.data["turn"]) for e in events if e.kind == "generate" and not e.data["aborted"]}
    assert cancelled, "no spare was dropped while it generated"
    for e in cancelled:
        assert 0 <= e.t - dropped_at[e.data["episode"]] < 0.05 and e.data["start"] <= e.t
        assert (e.data["episode"], e.data["turn"]) not in completed


@pytest.mark.parametrize("simulate", [False, True], ids=["real", "simulated"])
def test_progress_shrink_starts_the_switch_before_the_batch_is_complete(tmp_path, fast_target, simulate):
    """async_ratio 0: at half the batch ready, half the outstanding groups still run, so one of the two
    rollout devices is free; it is the training device, and it shrinks before the batch's last episode ends."""
    spec, events = audited_run(tmp_path, fast_target, {"shrink_at": 0.5}, simulate, {"async_ratio": 0})
    finished = {e.data["episode"]: e.t for e in events if e.kind == "env_step" and e.data["done"]}
    trains = [e for e in events if e.kind == "train"]
    shrinks = [e for e in events if e.kind == "shrink"]
    assert len(trains) == spec.workload.train_steps
    early, previous_end = 0, 0.0
    for train in trains:  # a shrink of this step (after the last train ended) before its batch was complete
        batch_done = max(finished[t["episode"]] for t in train.data["trajectories"])
        early += any(previous_end < s.data["start"] < batch_done for s in shrinks)
        previous_end = train.t
    assert early >= 1, [(s.t, s.data) for s in shrinks]


def _stale_drops_in_flight(events) -> tuple[int, int]:
    """(stale drops of an episode still running, all stale drops), with each stale group dropped whole."""
    finished = {e.data["episode"]: e.t for e in events if e.kind == "env_step" and e.data["done"]}
    group_of = {e.data["episode"]: e.data["group"] for e in events if e.kind == "episode_created"}
    stale = [e for e in events if e.kind == "sample_dropped" and e.data["reason"] == "stale"]
    stale_groups = {group_of[e.data["episode"]] for e in stale}
    assert sum(1 for g in group_of.values() if g in stale_groups) == len(stale)  # whole groups
    running = sum(1 for e in stale if finished.get(e.data["episode"], float("inf")) > e.t)
    return running, len(stale)


# Tool calls with a heavy tail (a few take seconds): some groups still run two versions after their
# first turn, the point where async_ratio 1 can no longer train them.
SLOW_TOOLS = {
    "env_latency_s": {"kind": "lognormal", "median": 0.1, "sigma": 2.0},
    "env_latency_max_s": 10.0,
    "trajectory_timeout_s": 60,
    "turns": {"max": 12, "dist": {"kind": "geometric", "mean": 4}},
    "train_steps": 3,
}


def quicker_tools(workload: dict, factor: float) -> dict:
    """``workload`` with its tool latency's median and cap ``factor`` times theirs: a real run waits for
    its tools in wall time (a simulated one in virtual time, for nothing), so a real run whose tools'
    tail already outlasts a step gets the same phenomenon sooner."""
    latency = workload["env_latency_s"]
    return {
        **workload,
        "env_latency_s": {**latency, "median": latency["median"] * factor},
        "env_latency_max_s": workload["env_latency_max_s"] * factor,
    }


@pytest.mark.parametrize("simulate", [False, True], ids=["real", "simulated"])
def test_abort_stale_hands_groups_back_while_they_still_run(tmp_path, fast_target, simulate):
    """A group whose oldest turn falls more than async_ratio behind the policy goes back as soon as
    training returns that policy, mid-episode, not after its slowest member's last tool call. Five steps:
    whether some group is still running when it turns stale is chance (one seed in six misses it with
    three steps on the simulator; none of ten with five). The real run's tools at half the latency
    (seeds 0-2: 4-7 groups still running when dropped, against 3-6 at full latency; the run 20-22 s ->
    10-13 s)."""
    workload = {**SLOW_TOOLS, "train_steps": 5}
    workload = workload if simulate else quicker_tools(workload, 0.5)
    _, events = audited_run(tmp_path, fast_target, {"abort_stale": 1}, simulate, workload)
    running, stale = _stale_drops_in_flight(events)
    assert running >= 1, (running, stale)
    # each stale group's task runs again at the next launch (the long tasks go stale: dropping them for
    # new ones would train the short); a relaunch that goes stale in turn is not run a third time
    group_of = {e.data["episode"]: e.data["group"] for e in events if e.kind == "episode_created"}
    stale_groups = {
        group_of[e.data["episode"]] for e in events if e.kind == "sample_dropped" and e.data["reason"] == "stale"
    }
    relaunch_of = {
        e.data["group"]: e.data["relaunch"] for e in events if e.kind == "episode_created" and "relaunch" in e.data
    }
    assert relaunch_of and set(relaunch_of.values()) <= stale_groups, (relaunch_of, stale_groups)
    assert not set(relaunch_of.values()) & set(relaunch_of)
    last_created = max(e.t for e in events if e.kind == "episode_created")
    dropped_at = {
        group_of[e.data["episode"]]: e.t for e in events if e.kind == "sample_dropped" and e.data["reason"] == "stale"
    }
    waiting = {g for g in stale_groups - set(relaunch_of.values()) - set(relaunch_of) if dropped_at[g] < last_created}
    assert not waiting, waiting


def test_a_simulated_runs_audit_judges_the_tasks_by_their_own_draws(tmp_path, fast_target):
    """Where a simulated target draws each task's response lengths, the audit knows the run's seed and
    key and compares the tasks trained with those launched by each task's own draw, which no stack can
    shorten by stopping a task early: the figure is the one the harness's draws give (the public key)."""
    from targets.harness.environments.seeds import RunSeed
    from targets.harness.judge.selection_net import shortfall_of
    from targets.harness.judge.trace_index import TraceIndex
    from targets.harness.sim.response_length import ResponseLengths

    seed = 0  # a run that leaves tasks untrained (seed 2 trains every one; the run is the same each time)
    lengths = {"mean": 8, "task_sigma": 0.8, "turn_sigma": 0.6}
    tokens = {"prompt": 12, "observation": 8, "response": 16, "max_sequence": 256, "response_length": lengths}
    spec, run = harness_run(
        tmp_path, fast_target, {"abort_stale": 1}, True, {**SLOW_TOOLS, "tokens": tokens}, seed=seed
    )
    assert run.ok, run.cause
    details = run.results["audit"]["result"]["details"]
    ix = TraceIndex.of(Trace.load_events(run.out / "trace.jsonl"))
    launched = [e for e in ix.created if not (e in ix.dropped and ix.dropped[e].data["reason"] == "end_of_run")]
    tasks = {ix.relaunch_of.get(ix.group_of[e], ix.group_of[e]) for e in launched}
    trained = {ix.relaunch_of.get(ix.group_of[e], ix.group_of[e]) for e in launched if e in ix.trained_in}
    assert trained < tasks, "every task launched trained: nothing to compare"
    drawn = ResponseLengths(spec.workload.tokens, RunSeed(seed)).expected_of_task
    shortfall, _ = shortfall_of([drawn(t) for t in trained], [drawn(t) for t in tasks], 0.2)
    assert details["selection_tasks_drawn_tokens_a_turn"] == pytest.approx(shortfall)


STEPPED = "                turn += 1\n"


HOLD = {  # how a planted stack keeps an episode it holds: waiting on nothing, or checkpointing it again and again
    "waiting": "                    await asyncio.Event().wait()\n",
    "checkpointing": "                    while True:\n                        await episode.checkpoint()\n",
}


@pytest.mark.parametrize("how", list(HOLD))
def test_a_stack_holding_its_long_tasks_unstepped_to_the_end_is_rejected(tmp_path, fast_target, how):
    """The misuse, really run (simulated): the stack stops stepping each episode whose first response ran 12
    tokens or more (the long tasks: a task's tokens a turn persist) and holds it, up to 16 groups, until the run
    ends, where it goes back as ``end_of_run`` beside the episodes the end cut off. The controller link counted
    the seconds each sat with nothing under way while others generated: its group counts in the net, and the
    tasks trained are shorter by their draws than those launched, over the bound (at 32%). Before the harness
    counted it, the net set the held groups aside and the run passed. A stack that checkpoints what it holds
    over and over, to look busy, is counted the same: only the first checkpoint since a step is work."""
    hold = STEPPED + (
        "                long = len(completion.tokens) >= 12 and (episode.group_id in HELD or len(HELD) < 16)\n"
        "                if long and not result.done:\n"
        "                    HELD.add(episode.group_id)  # planted: never stepped again, handed back at the run's end\n"
        + HOLD[how]
    )

    def patch(stack_dir) -> None:
        planted("env_manager.py", STEPPED, hold)(stack_dir)
        path = stack_dir / "env_manager.py"
        text = path.read_text()
        cut = text.index("\nclass ")
        path.write_text(text[:cut] + "\nHELD: set = set()\n" + text[cut:])

    lengths = {"mean": 8, "task_sigma": 1.2, "turn_sigma": 0.6}
    tokens = {"prompt": 12, "observation": 8, "response": 16, "max_sequence": 256, "response_length": lengths}
    workload = {**SLOW_TOOLS, "tokens": tokens, "train_steps": 2, "batch_size": 64}
    if how == "checkpointing":  # sandboxes whose state a crash loses, so the stack may checkpoint them
        workload["env_state"] = {"change_rate": 0.4, "checkpoint_s": 0.5, "restore_s": 0.05}
    _, run = harness_run(tmp_path, fast_target, {}, True, workload, patch)
    assert run.ok, run.cause
    audit = run.results["audit"]["result"]
    assert audit["details"]["selection_groups_held"] == 16, audit["details"]
    assert not audit["passed"] and any("shorter in drawn tokens a turn" in r for r in audit["reasons"]), audit
    held = [
        e.data["held_s"]
        for e in Trace.load_events(run.out / "trace.jsonl")
        if e.kind == "sample_dropped" and e.data["held_s"] > 0
    ]
    assert len(held) >= 16 and min(held) > 1.0, held


def test_the_audit_draws_each_episode_again_as_the_harness_drew_it(tmp_path, fast_target):
    """The members' yardstick on a simulated run: every episode that ran to its end (no timeout, lost
    environment or full context) generated, turn by turn, exactly what ``WorkloadDraws`` draws again from
    the run's seed, relaunched tasks and spares included; so a spare cancelled early is judged by the
    turns it drew, and the audit records that figure."""
    from targets.harness.environments.seeds import RunSeed
    from targets.harness.judge.draws import WorkloadDraws
    from targets.harness.judge.trace_index import TraceIndex

    lengths = {"mean": 8, "task_sigma": 0.8, "turn_sigma": 0.6}
    tokens = {"prompt": 12, "observation": 8, "response": 16, "max_sequence": 256, "response_length": lengths}
    params = {"abort_stale": 1, "redundant_envs": 2}
    spec, run = harness_run(tmp_path, fast_target, params, True, {**SLOW_TOOLS, "tokens": tokens})
    assert run.ok, run.cause
    ix = TraceIndex.of(Trace.load_events(run.out / "trace.jsonl"))
    draws = WorkloadDraws(spec, RunSeed(0), ix.relaunch_of, simulated=True)
    whole = [
        e
        for e, steps in ix.env_steps.items()
        if steps[-1].data["done"] and not any(x.data[k] for x in steps for k in ("timed_out", "lost", "truncated"))
    ]
    assert len(whole) >= 20 and any(ix.group_of[e] in ix.relaunch_of for e in whole), len(whole)
    for e in whole:
        steps = ix.env_steps[e]
        assert len(steps) == draws.turns(e), e
        assert sum(token_count(x.data["action"]) for x in steps) == draws.response_tokens(e), e
    cancelled = [e for e, drop in ix.dropped.items() if drop.data["reason"] == "redundant"]
    assert any(
        draws.response_tokens(e) > sum(token_count(x.data["action"]) for x in ix.env_steps[e]) for e in cancelled
    )
    assert "selection_members_drawn_response_tokens" in run.results["audit"]["result"]["details"]


def test_abort_stale_planted_one_step_too_soon_fails_the_audit(tmp_path, fast_target):
    """The misuse, really run (simulated): an abort one version too soon throws away groups a step
    could still train; the audit names the unjustified drops."""
    honest = "if oldest is None or self.trained_from - oldest <= self.buffer.async_ratio:"

    def one_version_too_soon(stack_dir):
        manager = stack_dir / "env_manager.py"
        assert honest in manager.read_text()
        manager.write_text(
            manager.read_text().replace(honest, honest.replace("self.trained_from", "1 + self.trained_from"))
        )

    _, run = harness_run(tmp_path, fast_target, {"abort_stale": 1}, True, SLOW_TOOLS, one_version_too_soon)
    audit = run.results["audit"]["result"]
    assert not audit["passed"] and any("dropped as stale but every turn" in r for r in audit["reasons"]), audit


@pytest.mark.parametrize("simulate", [False, True], ids=["real", "simulated"])
def test_a_declared_staleness_bound_runs_further_ahead_within_the_targets_maximum(tmp_path, fast_target, simulate):
    """A target that lets stacks choose up to 2: the stack declares 2 and keeps three steps' groups
    outstanding, more than the default bound of 1 allows, and the audit holds it to 2."""
    workload = {"max_async_ratio": 2} | ({} if simulate else TWO_STEPS)  # the groups go out before any step
    spec, events = audited_run(tmp_path, fast_target, {"async_ratio": 2}, simulate, workload)
    w = spec.workload
    start = next(e for e in events if e.kind == "run_start")
    assert start.data["declared"]["async_ratio"] == 2
    outstanding = peak = 0
    changes = [(e.t, 1) for e in events if e.kind == "episode_created"]
    changes += [(e.data["start"], -len(e.data["trajectories"])) for e in events if e.kind == "train"]
    changes += [(e.t, -1) for e in events if e.kind == "sample_dropped"]
    for _, delta in sorted(changes):
        outstanding += delta
        peak = max(peak, outstanding)
    assert peak > w.groups_per_step * (1 + w.async_ratio) * w.group_size  # beyond what 1 allows


def test_a_staleness_bound_over_the_targets_maximum_is_refused(tmp_path, fast_target):
    _, run = harness_run(tmp_path, fast_target, {"async_ratio": 1}, True, {"max_async_ratio": 2})
    assert run.ok
    build = 'async_ratio=params.get("async_ratio"),'

    def declare_three(stack_dir):  # the controller stays within 2; only the declaration lies
        path = stack_dir / "build.py"
        assert build in path.read_text()
        path.write_text(path.read_text().replace(build, "async_ratio=3,"))

    _, run = harness_run(
        tmp_path / "over", fast_target, {"async_ratio": 2}, True, {"max_async_ratio": 2}, declare_three
    )
    assert not run.ok and "declares async_ratio 3, over the target's max_async_ratio 2" in run.cause


@pytest.mark.parametrize(
    ("field", "param", "limit"),
    [("tail_round", "tail_round", "groups per step 4"), ("redundant_per_group", "redundant_envs", "group_size 4")],
)
def test_a_declaration_over_what_the_workload_bounds_is_refused(tmp_path, fast_target, field, param, limit):
    """Planted: a stack declares one more than the fast target allows (4 groups a step, groups of 4).
    ``tail_round`` 5 could leave 4 deferred tasks, a whole batch's worth chosen by length, unrun at the
    end; 5 spares a group would keep the quickest 4 of 9. The harness refuses either at hello."""
    declared = f'{field}=params.get("{param}", 0),'

    def declare_five(stack_dir):  # the controller is the starter's; only the declaration asks for more
        path = stack_dir / "build.py"
        assert declared in path.read_text()
        path.write_text(path.read_text().replace(declared, f"{field}=5,"))

    _, run = harness_run(tmp_path, fast_target, {}, True, None, declare_five)
    assert not run.ok and f"declares {field} 5, over the target's {limit}" in run.cause, run.cause


def test_running_further_ahead_than_declared_fails_the_audit(tmp_path, fast_target):
    """Planted: the controller runs at 2 but the stack declares nothing, so the run is held to the
    target's 1; the audit finds the extra groups in flight."""

    def declare_nothing(stack_dir):
        path = stack_dir / "build.py"
        path.write_text(path.read_text().replace('async_ratio=params.get("async_ratio")', "async_ratio=None"))

    _, run = harness_run(tmp_path, fast_target, {"async_ratio": 2}, True, {"max_async_ratio": 2}, declare_nothing)
    audit = run.results["audit"]["result"]
    assert not audit["passed"] and any("too many episodes" in r for r in audit["reasons"]), audit["reasons"]


def _need(generate) -> int:
    return token_count(generate.data["prompt"]) + generate.data["max_new_tokens"]


def _engine_kv_peaks(events) -> dict[str, int]:
    """Per device, the most KV (context plus max_new_tokens) its answered requests held at once."""
    peaks: dict[str, int] = {}
    served = [e for e in events if e.kind == "generate" and not e.data["aborted"]]
    for g in served:
        device = g.data["device"]
        held = sum(_need(o) for o in served if o.data["device"] == device and o.data["start"] <= g.data["start"] < o.t)
        peaks[device] = max(peaks.get(device, 0), held)
    return peaks


@pytest.mark.parametrize("simulate", [False, True], ids=["real", "simulated"])
def test_kv_routing_routes_each_turn_and_bounds_each_engines_kv(tmp_path, fast_target, simulate):
    """Strict balance (slack 0) and an admission bound of one full sequence's KV per engine: every
    turn is served where the controller asked, turns leave their previous engine when it is
    the busier one, and no engine ever holds more than the bound, while the episodes in flight need
    several times what both engines may hold."""
    params = {"kv_routing": 1, "route_slack": 0.0, "route_admit": 1.0}
    spec, events = audited_run(tmp_path, fast_target, params, simulate, None if simulate else TWO_STEPS)
    bound = spec.workload.tokens.max_sequence
    served = [e for e in events if e.kind == "generate" and not e.data["aborted"]]
    routed = [g for g in served if g.data["routed"] is not None]
    assert len(routed) == len(served)  # every turn routed: time_multiplex never suspends
    assert all(g.data["device"] == g.data["routed"] for g in routed)  # the cluster honoured every request
    previous: dict[str, str] = {}
    moved = stayed = 0
    for g in sorted(served, key=lambda e: e.data["start"]):
        before = previous.get(g.data["episode"])
        moved += before is not None and g.data["routed"] not in (None, before)
        stayed += before is not None and g.data["routed"] == before
        previous[g.data["episode"]] = g.data["device"]
    assert moved and stayed  # sticky, and yielding to the less loaded engine
    peaks = _engine_kv_peaks(events)
    single = max(_need(g) for g in served)
    assert max(peaks.values()) <= max(bound, single)
    ended: dict[str, float] = {}
    for e in events:
        if e.kind == "sample_dropped" or (e.kind == "env_step" and e.data["done"]):
            ended.setdefault(e.data["episode"], e.t)
    created = [(e.t, ended.get(e.data["episode"], float("inf"))) for e in events if e.kind == "episode_created"]
    most = max(sum(1 for c, end in created if c <= g.data["start"] < end) for g in served)
    least_need = spec.workload.tokens.prompt + spec.workload.tokens.response  # a first turn's KV
    assert most * least_need > 2 * bound  # demand the bound had to hold back


TWO_KINDS = {  # one logical CPU device rich in bandwidth, one rich in compute (their numbers overridden)
    "pools": [
        {"name": "wide", "kind": "cpu", "count": 1, "bf16_tflops": 0.05, "hbm_bandwidth_gbs": 20.0},
        {"name": "dense", "kind": "cpu", "count": 1, "bf16_tflops": 0.4, "hbm_bandwidth_gbs": 10.0},
    ],
    "links": [{"between": ["wide", "dense"], "bandwidth_gbs": 1.0}],
}


EXPAND_REPLY_SLACK_S = 0.05


@pytest.mark.parametrize("simulate", [False, True], ids=["real", "simulated"])
def test_hardware_affinity_routes_by_each_episodes_measured_prefill_decode_balance(tmp_path, fast_target, simulate):
    """Two pools of different balance (time_multiplex trains on the compute-rich one, the last): read
    from the trace, every turn of an episode that had added at least ``affinity_ratio`` prompt tokens
    per generated token went to the compute-rich engine while it was rolling out (the slack is wide
    enough never to override), and to the other engine, not held, while it trained; the run had
    decode-heavy episodes too. Where a decode-heavy turn goes depends on the engines' load at that
    moment (mostly idle here, so its prefix's engine): the router's unit test pins that rule down."""
    data = yaml.safe_load(fast_target.read_text())
    data["hardware"] = TWO_KINDS
    target = tmp_path / "two-kinds.yaml"
    target.write_text(yaml.safe_dump(data))
    ratio = 0.6  # between a first turn's 12 prompt tokens per 16 generated and later turns' 8 per 16
    spec, events = audited_run(
        tmp_path, target, {"affinity_ratio": ratio, "route_slack": 16.0}, simulate, {"train_steps": 2}
    )
    assert [e.data["devices"] for e in events if e.kind == "run_start"] == [["wide:0", "dense:0"]]
    rolling: set[str] = {"wide:0", "dense:0"}  # time_multiplex starts with every engine awake
    counted: dict[str, list[int]] = {}  # episode -> [prefill, decode] before the turn, as the router counts
    context: dict[str, int] = {}
    classes = Counter()

    def when(e) -> float:  # the router drops an engine as its shrink starts and routes to it once expanded
        return e.data["start"] if e.kind in ("generate", "shrink", "suspend") else e.t

    back = [e for e in events if e.kind in ("expand", "resume")]
    dense_expands = [e.t for e in back if "dense:0" in e.data.get("devices", ["wide:0", "dense:0"])]
    for e in sorted(events, key=when):
        if e.kind in ("shrink", "suspend"):
            rolling -= set(e.data.get("devices", rolling))
        elif e.kind in ("expand", "resume"):
            rolling |= set(e.data.get("devices", ["wide:0", "dense:0"]))
        if e.kind != "generate" or e.data["aborted"] or e.data["continues"]:
            continue
        episode, prompt, generated = e.data["episode"], token_count(e.data["prompt"]), token_count(e.data["tokens"])
        if episode in counted and e.data["routed"] is not None:
            prefill, decode = counted[episode]
            heavy = prefill >= ratio * max(1, decode)
            # the router takes dense:0 back once its expand's reply reaches the controller, a little after the
            # harness stamped the expand's end: a turn forwarded in between may go either way (CI saw one)
            returning = any(0 <= e.data["start"] - t <= EXPAND_REPLY_SLACK_S for t in dense_expands)
            if heavy and returning:
                classes["prefill-heavy as dense:0 came back"] += 1
            elif heavy and "dense:0" in rolling:
                last_back = max((t for t in dense_expands if t <= e.data["start"]), default=None)
                assert e.data["routed"] == "dense:0", (episode, counted[episode], e.data["start"], last_back)
                classes["prefill-heavy"] += 1
            elif heavy:  # its preferred engine trains: the other one serves it, the turn is not held
                assert e.data["routed"] == "wide:0", (episode, counted[episode])
                classes["prefill-heavy while dense:0 trained"] += 1
            else:  # no preference: the least loaded engine, wherever it is
                classes["decode-heavy"] += 1
        before = counted.setdefault(episode, [0, 0])
        counted[episode] = [before[0] + max(0, prompt - context.get(episode, 0)), before[1] + generated]
        context[episode] = prompt + generated
    assert classes["prefill-heavy"] and classes["prefill-heavy while dense:0 trained"] and classes["decode-heavy"], (
        classes
    )


def test_a_cluster_obeying_a_route_to_a_shrunk_engine_fails_the_audit(tmp_path, fast_target):
    """The misuse routing makes possible: a turn asked for (and served by) an engine the controller
    had shrunk. Planted into a simulated routed run's trace: the audit rejects it."""
    from targets.harness.judge.audit import audit_run

    spec, events = audited_run(tmp_path, fast_target, {"kv_routing": 1, "route_slack": 0.0}, simulate=True)
    shrink = next(e for e in events if e.kind == "shrink")
    shrunk = shrink.data["devices"][0]
    expand = next(e for e in events if e.kind == "expand" and e.t > shrink.t and shrunk in e.data["devices"])
    late = next(e for e in events if e.kind == "generate" and not e.data["aborted"] and e.data["start"] > shrink.t)
    planted = dataclasses.replace(  # asked for the shrunk engine and served there, before the expand
        late,
        t=expand.data["start"] - 1e-3,
        data={**late.data, "routed": shrunk, "device": shrunk, "start": shrink.t + 1e-3},
    )
    events[events.index(late)] = planted
    result = audit_run(spec, events, lambda version: None, None, spec.workload.train_steps)
    assert not result.passed and any("served while shrunk" in line for line in result.reasons), result.reasons


def _resumed_turns(events) -> list[tuple[list, object]]:
    """(the turn's interrupted segments it resumed, in order, and its final generate) for every
    turn that resumed, rebuilt from the trace by matching each ``continues`` prefix."""
    partials = [e for e in events if e.kind == "generate" and e.data["aborted"] and "tokens" in e.data]
    out = []
    for g in events:
        if g.kind != "generate" or g.data["aborted"] or not g.data["continues"]:
            continue
        chain, need = [], g.data["continues"]
        while need:
            a = next(
                a
                for a in reversed(partials)
                if a.data["episode"] == g.data["episode"]
                and a.data["turn"] == g.data["turn"]
                and a.t <= (chain[0] if chain else g).data["start"]
                and a.data["continues"] + token_count(a.data["tokens"]) == need
            )
            chain.insert(0, a)
            need = a.data["continues"]
        out.append((chain, g))
    return out


# Long responses and batch 32, three steps. The first step's tail finishes during its training, so the
# second batch is ready at once, and the second step trains while a fresh wave of 8 groups (32
# trajectories, ~6 turns each) runs on the sampling-only engine alone: its sync meets turns decoding by
# construction, not by the timing of one run. Real runs get quick tools (a turn decodes most of its
# time: 12 turns caught where 0.3 s tools catch 4). The simulated twin switches slowly (its expand
# takes 2 s, the real one 0.05 s), so the fresh wave needs 0.3 s tools to still be running at the sync;
# a simulated run is deterministic, so passing once is passing always.
SYNC_MEETS_DECODING = {
    "tokens": {"prompt": 12, "observation": 8, "response": 64, "max_sequence": 512},
    "turns": {"max": 12, "dist": {"kind": "geometric", "mean": 6}},
    "batch_size": 32,
    "train_steps": 3,
}
TOOL_LATENCY_MEDIAN_S = {False: 0.02, True: 0.3}  # by ``simulate``


def _interrupted_by_syncs(events) -> list:
    """The aborted generates with a partial (some tokens decoded) that an interrupting sync of their
    device answered."""
    syncs = [e for e in events if e.kind == "sync" and e.data["interrupt"]]
    return [
        g
        for g in events
        if g.kind == "generate"
        and g.data["aborted"]
        and token_count(g.data.get("tokens", []))
        and any(g.data["device"] in s.data["devices"] and s.data["start"] <= g.t <= s.t for s in syncs)
    ]


@pytest.mark.parametrize("simulate", [False, True], ids=["real", "simulated"])
def test_partial_rollout_resumes_interrupted_turns_under_the_new_weights(tmp_path, fast_target, simulate):
    """The sampling-only engine's sync interrupts its running turns, and every interrupted turn that
    decoded something resumes from it (its prompt grown by the partial response, its budget shrunk by
    it); some resume under a newer version than their first segment's, and the audit (replaying every
    segment) passes.

    A real run's syncs meet a decoding turn only where rollout still runs when training ends (in one CI
    run of the suite none did: the engine had finished every turn launched), the last sync's interrupted
    turns never resume (the run ends), an interrupted turn may resume on an engine the sync has not
    reached yet (in one CI run on a loaded machine, every one did), and turns that outlast the weights'
    transfer finish before the interrupt reaches the engine (in one CI run with two test workers, every
    mid-run sync's did, in three runs): four training steps (three mid-run syncs) and up to five runs,
    the checks on the first whose sync interrupted a turn that then resumed under a newer version."""
    tools = {"env_latency_s": {"kind": "lognormal", "median": TOOL_LATENCY_MEDIAN_S[simulate], "sigma": 0.5}}
    for attempt in range(5 if not simulate else 1):
        workload = {**SYNC_MEETS_DECODING, **tools, **({} if simulate else {"train_steps": 4})}
        spec, events = audited_run(
            tmp_path / str(attempt), fast_target, {"partial_rollout": 1}, simulate, workload, attempt
        )
        assert next(e for e in events if e.kind == "run_start").data["declared"]["partial_rollout"]
        assert all(e.data["interrupt"] for e in events if e.kind == "sync")
        if _interrupted_by_syncs(events) and any(
            final.data["version"] > chain[0].data["version"] for chain, final in _resumed_turns(events)
        ):
            break
    assert _interrupted_by_syncs(events), "no sync interrupted a running turn"
    resumed = _resumed_turns(events)
    assert resumed, "no turn was resumed"
    response = spec.workload.tokens.response
    for chain, final in resumed:
        assert final.data["max_new_tokens"] == response - final.data["continues"]
        assert token_count(final.data["prompt"]) == token_count(chain[0].data["prompt"]) + final.data["continues"]
    assert any(final.data["version"] > chain[0].data["version"] for chain, final in resumed)


# Responses four times as long, twice the turns (within the model's 512 positions) and slower tools:
# rollout, not training, bounds a step, and a turn spans many decode iterations.
LONG_RESPONSES = {
    "tokens": {"prompt": 12, "observation": 8, "response": 64, "max_sequence": 512},
    "turns": {"max": 12, "dist": {"kind": "geometric", "mean": 6}},
    "env_latency_s": {"kind": "lognormal", "median": 0.3, "sigma": 0.5},
}


@pytest.mark.parametrize("simulate", [False, True], ids=["real", "simulated"])
def test_overlap_sync_expands_the_training_devices_while_the_others_sync(tmp_path, fast_target, simulate):
    """After each training step the sampling-only engine's sync and the training device's expand are
    issued together: their intervals overlap in the harness's record, every step, and the audit passes."""
    workload = LONG_RESPONSES if simulate else {**LONG_RESPONSES, **TWO_STEPS}  # 4 steps 12 s, 3 steps 9 s
    spec, events = audited_run(tmp_path, fast_target, {"overlap_sync": 1}, simulate, workload)
    trains = [e for e in events if e.kind == "train"]
    syncs = [e for e in events if e.kind == "sync"]
    expands = [e for e in events if e.kind == "expand"]
    assert len(trains) == spec.workload.train_steps
    for train in trains:
        sync = min((e for e in syncs if e.data["start"] >= train.t), key=lambda e: e.data["start"])
        expand = min((e for e in expands if e.data["start"] >= train.t), key=lambda e: e.data["start"])
        assert sync.data["start"] < expand.t and expand.data["start"] < sync.t, (train.t, sync, expand)


TAIL_TOOLS = {  # tool calls slow and long-tailed enough that some groups outlive a whole step
    "env_latency_s": {"kind": "lognormal", "median": 0.5, "sigma": 1.5},
    "env_latency_max_s": 8.0,
    "trajectory_timeout_s": 60,
}


@pytest.mark.parametrize("simulate", [False, True], ids=["real", "simulated"])
def test_tail_batching_defers_groups_that_outlive_a_step_and_runs_their_tasks_again(tmp_path, fast_target, simulate):
    """Groups still unfinished a whole step after launch go back whole as ``deferred``; each deferred
    task runs again in a relaunched group (tail_round 1: at once; unless it went back after the last
    group started), which is never deferred itself. The real run's tools at half the latency (seeds 0-2:
    1, 2 and 2 groups deferred, as at full latency; the run 19-25 s -> 10-14 s)."""
    workload = TAIL_TOOLS if simulate else quicker_tools(TAIL_TOOLS, 0.5)
    spec, events = audited_run(tmp_path, fast_target, {"tail_round": 1}, simulate, workload)
    group_of = {e.data["episode"]: e.data["group"] for e in events if e.kind == "episode_created"}
    dropped = {e.data["episode"]: e.data["reason"] for e in events if e.kind == "sample_dropped"}
    deferred = {group_of[episode] for episode, reason in dropped.items() if reason == "deferred"}
    assert deferred, "no group was deferred"
    for group in deferred:  # whole groups
        assert all(dropped.get(m) == "deferred" for m, g in group_of.items() if g == group)
    relaunch_of = {
        e.data["group"]: e.data["relaunch"] for e in events if e.kind == "episode_created" and "relaunch" in e.data
    }
    stale = {group_of[episode] for episode, reason in dropped.items() if reason == "stale"}
    relaunched = [g for g in relaunch_of.values() if g not in stale]
    assert len(relaunched) == len(set(relaunched)) and set(relaunched) <= deferred  # each at most once
    # each ran again, unless no group at all started after it went back (the run needed no more)
    deferred_at = {group_of[e.data["episode"]]: e.t for e in events if e.data.get("reason") == "deferred"}
    last_start = max(e.t for e in events if e.kind == "episode_created")
    unrun = {g: deferred_at[g] for g in deferred - set(relaunched) if deferred_at[g] < last_start}
    assert not unrun, f"deferred groups never relaunched though groups started after them: {unrun}"
    assert not deferred & set(relaunch_of)
    trained = {t["group"] for e in events if e.kind == "train" for t in e.data["trajectories"]}
    assert not trained & deferred


RESETS = {"env_reset_s": {"kind": "fixed", "value": 20.0}}  # a sandbox's start: far over a simulated step's training


@pytest.mark.parametrize("simulate", [False, True], ids=["real", "simulated"])
def test_env_prestart_resets_the_next_steps_environments_while_the_devices_train(tmp_path, fast_target, simulate):
    """Colocate launches each later step's groups as a batch is taken, behind the resume: created before that
    step's training began, their first request after it ended (under the new weights). Simulated with
    resets of 20 s, the run is shorter than colocate's without it, and the evaluator names the wait."""
    workload = RESETS if simulate else {}
    prestart = {"env_prestart": 1}
    spec, events = audited_run(tmp_path / "on", fast_target, prestart, simulate, workload, controller="colocate")
    trains, resumes, created = _prestarted_steps(events)
    for step, train in enumerate(trains[1:], start=1):
        episodes = [t["episode"] for t in train.data["trajectories"]]
        assert all(created[x] <= trains[step - 1].data["start"] for x in episodes), f"step {step}'s groups were late"
    # nothing launched for a step after the last (dropped at the end, it would pass the audit unseen)
    assert set(created) == {t["episode"] for train in trains for t in train.data["trajectories"]}
    if simulate:
        _, without = audited_run(tmp_path / "off", fast_target, {}, simulate, workload, controller="colocate")
        duration = {name: run[-1].t - run[0].t for name, run in (("on", events), ("off", without))}
        # each later step's resets ran from its launch to the resume (the training step between): that is saved
        launched = [min(created[t["episode"]] for t in train.data["trajectories"]) for train in trains]
        hidden = sum(resumes[k] - launched[k + 1] for k in range(len(trains) - 1))
        assert duration["off"] - duration["on"] > 0.8 * hidden > 0, (duration, hidden)
        assert "reset_wait" in {h.code for h in round_hints(spec, without, {})}


def test_env_prestart_at_half_the_batch_launches_the_next_steps_groups_while_its_tail_rolls_out(tmp_path, fast_target):
    """``prestart_at`` 0.5: the next step's groups start once half the batch's groups are ready, before the
    batch is complete; they still generate only after the resume, and the audit passes."""
    params = {"env_prestart": 1, "prestart_at": 0.5}
    spec, events = audited_run(tmp_path, fast_target, params, True, RESETS, controller="colocate")
    trains, _, created = _prestarted_steps(events)
    done = {e.data["episode"]: e.t for e in events if e.kind == "env_step" and e.data["done"]}
    for step, train in enumerate(trains[1:], start=1):
        episodes = [t["episode"] for t in train.data["trajectories"]]
        completed = max(done[t["episode"]] for t in trains[step - 1].data["trajectories"])
        assert min(created[x] for x in episodes) < completed, f"step {step}'s groups waited for the whole batch"


def _prestarted_steps(events) -> tuple[list, list[float], dict[str, float]]:
    """A prestarting colocate run's train events, resume times and each episode's creation, once every later
    step's episodes are seen to make their first request only after the resume before their step."""
    trains = [e for e in events if e.kind == "train"]
    resumes = [e.t for e in events if e.kind == "resume"]
    created = {e.data["episode"]: e.t for e in events if e.kind == "episode_created"}
    first_request: dict[str, float] = {}
    for e in events:
        if e.kind == "generate":
            first_request.setdefault(e.data["episode"], e.data["start"])
    for step, train in enumerate(trains[1:], start=1):
        episodes = [t["episode"] for t in train.data["trajectories"]]
        assert all(first_request[x] >= resumes[step - 1] for x in episodes), f"step {step} generated before the resume"
    return trains, resumes, created


@pytest.mark.parametrize(
    ("params", "said"),
    [
        # over 1, the next step's groups never launched: the run waited for them to its time limit
        ({"env_prestart": 1, "prestart_at": 1.5}, "params prestart_at must be a number within [0, 1]"),
        ({"env_prestart": 2}, "params env_prestart must be 0 (off) or 1 (on), got 2"),  # it was read as on
    ],
    ids=["prestart_at over 1", "env_prestart 2"],
)
def test_env_prestart_is_refused_where_it_cannot_work(tmp_path, fast_target, params, said):
    spec, run = harness_run(tmp_path, fast_target, params, True, controller="colocate")
    assert not run.ok and said in run.cause, run.cause


def test_env_prestart_declares_a_steps_groups_more_in_flight_and_keeps_the_staleness_bound(tmp_path, fast_target):
    """env_prestart needed async_ratio 1, which loosened the audit's staleness bound for the whole run (a turn
    a version behind would pass) although every prestarted sample is on-policy. It declares its own groups in
    flight now: at async_ratio 0 a prestarting colocate run passes the audit, held to 0, and its declaration
    reaches the harness and the audit's in-flight bound (one step's groups more)."""
    from targets.api import Declared
    from targets.harness.ipc.wire import get_declared, put_declared

    params = {"env_prestart": 1, "prestart_at": 0.5, "async_ratio": 0}
    spec, events = audited_run(tmp_path, fast_target, params, True, controller="colocate")
    declared = get_declared(next(e for e in events if e.kind == "run_start").data["declared"])
    assert declared == Declared(async_ratio=0, env_prestart=True)
    w = spec.workload
    assert spec.workload.staleness_bound(declared) == 0
    assert w.in_flight_bound(declared) == 2 * w.in_flight_bound(Declared(async_ratio=0)) == 2 * w.batch_size
    assert get_declared(put_declared(declared)) == declared


def test_a_waiting_batch_refills_at_once_when_woken_and_never_on_a_timer():
    """A group handed back whole (stale, deferred, its spares gone) frees a place the waiting batch
    fills when the environment manager wakes the buffer; it used to look once a second, leaving the
    place empty meanwhile and waking a simulated controller every virtual second for nothing."""
    from skills.recipes.sample_buffer import GroupBuffer
    from targets.api import Trajectory
    from targets.harness.sim.virtual_time import run_virtual

    looks, failures = [], []

    def check():
        if failures:
            raise RuntimeError("an episode coroutine failed")

    async def main():
        loop = asyncio.get_running_loop()
        buffer = GroupBuffer(group_size=1, async_ratio=0, envs=None)
        buffer.expect("g0")
        waiting = asyncio.ensure_future(buffer.wait_ready(1, 0, lambda: looks.append(loop.time()), check))
        await asyncio.sleep(0.5)
        buffer.wake()  # a group was handed back at 0.5 s
        await asyncio.sleep(5.0)
        buffer.put(Trajectory("g0/e0", "g0", [1], [0], [0.0], 1.0, [0]))
        await waiting
        crashed = asyncio.ensure_future(buffer.wait_ready(2, 0, lambda: None, check))
        await asyncio.sleep(1.0)
        failures.append(True)
        buffer.wake()  # an episode coroutine failed: the waiting batch raises it now, not a second later
        with pytest.raises(RuntimeError, match="coroutine failed"):
            await crashed
        return loop.time()

    assert run_virtual(main()) == 6.5
    assert looks == [0.0, 0.5, 5.5]


# -- speculative decoding: a mechanism inside the engine, so its account is the engine's own log ------

SPECULATIVE = {"speculative_tokens": 4, "speculative_ngram": 1, "speculative_batch": 64}
KEEP_IF = "                kept = float(uniform[j]) < float(probs[j, proposal])\n"


def _engine_counts(out, pattern: str) -> tuple[int, int]:
    """The two numbers ``pattern`` reads from each engine's line of the cluster's log (the engine's own
    counts), summed over the engines."""
    counts = re.findall(pattern, (out / "cluster.log").read_text())
    return sum(int(a) for a, _ in counts), sum(int(b) for _, b in counts)


def _drafted_in(out) -> tuple[int, int]:
    """(kept, drafted) over the engines."""
    return _engine_counts(out, r"speculative decoding on \S+: (\d+) of (\d+) drafted tokens kept")


def test_speculative_decoding_drafts_and_keeps_tokens_in_a_real_run_and_passes_the_audit(tmp_path, fast_target):
    """Every request the engines run at once drafts (batch limit 64); a turn's sampled tokens repeat
    often enough for one-token lookups to be kept, and the audit's replay and sampling tests pass."""
    _, events = audited_run(tmp_path, fast_target, SPECULATIVE, False, TWO_STEPS)
    assert any(e.kind == "generate" for e in events)
    kept, drafted = _drafted_in(tmp_path / "out")
    assert drafted > 0 and 0 < kept < drafted, (kept, drafted)


def test_a_verification_that_keeps_every_draft_is_rejected_by_the_audit(tmp_path, fast_target):
    """Planted: drafts kept without drawing against the model (the context copied forward). Each
    token still carries its true logprob; the audit finds the draws are not the model's."""

    def keep_every_draft(stack_dir):
        engine = stack_dir / "paged_engine.py"
        assert KEEP_IF in engine.read_text()
        engine.write_text(engine.read_text().replace(KEEP_IF, "                kept = True  # planted\n"))

    _, run = harness_run(tmp_path, fast_target, SPECULATIVE, False, patch=keep_every_draft)
    kept, drafted = _drafted_in(tmp_path / "out")
    assert kept == drafted > 0, (kept, drafted)  # the plant acted
    audit = run.results["audit"]["result"]
    assert not audit["passed"] and any(r.startswith("echo calibration: ") for r in audit["reasons"]), audit


def test_speculative_decoding_in_the_simulator_decodes_faster_and_the_trace_says_so(tmp_path, fast_target):
    """Simulated, on a workload whose drafts the model keeps 80% of the time: the run_start event
    records the stack's engine settings, and each turn takes fewer seconds a token than the same turn
    (same seed: the same tasks and lengths) without drafts."""
    tokens = {**yaml.safe_load(fast_target.read_text())["workload"]["tokens"], "draft_acceptance": 0.8}
    runs = {}
    for name, params in (("plain", {}), ("drafting", {"speculative_tokens": 4, "speculative_batch": 64})):
        _, events = audited_run(tmp_path / name, fast_target, params, True, {"tokens": tokens})
        start = next(e for e in events if e.kind == "run_start")
        told = {
            "speculative_tokens": params.get("speculative_tokens", 0),
            "speculative_batch": params.get("speculative_batch", 64),
            "reward": "colocated",  # the target has no reward model: the default placement, never used
            "reward_devices": [],
            "engine_scale": 1,
            "host_kv_tokens": 0,
            "prefill_chunk": 0,
        }
        assert start.data["engine"] == told
        served = [e for e in events if e.kind == "generate" and not e.data["aborted"]]
        runs[name] = sum(e.t - e.data["start"] for e in served) / sum(token_count(e.data["tokens"]) for e in served)
    # E = (1 - 0.8^5) / 0.2 = 3.4 tokens a verification, on a model whose step is mostly fixed cost: 0.4x measured
    assert runs["drafting"] < 0.8 * runs["plain"], runs


def _four_devices(fast_target, max_engine_scale: int) -> dict:
    """The fast target on four devices whose stacks may run engines of up to ``max_engine_scale`` devices."""
    data = yaml.safe_load(fast_target.read_text())
    data["hardware"]["count"] = 4
    data["simulator"] = {**data.get("simulator", {}), "max_engine_scale": max_engine_scale}
    return data


def test_engine_scale_runs_engines_of_twice_the_devices_which_decode_faster(tmp_path, fast_target):
    """Simulated: with engine_scale 2 the harness groups the four rollout devices into two engines of
    two (the run_start event says so, and the stack's setting; the run's summary weighs decoding time by
    that size), and the same seed's turns decode faster a token than on four engines of one; the audit
    passes."""
    per_token = {}
    for scale in (1, 2):
        params = {"engine_scale": scale, "train_devices": 2}
        _, run = target_run(tmp_path / f"scale{scale}", _four_devices(fast_target, 2), params, True)
        assert run.ok and run.results["audit"]["result"]["passed"], (run.cause, run.results.get("audit"))
        events = Trace.load_events(run.out / "trace.jsonl")
        start = next(e for e in events if e.kind == "run_start")
        assert start.data["engine"]["engine_scale"] == scale
        assert sorted(len(devices) for devices in start.data["engines"].values()) == [scale] * (4 // scale)
        assert run.results["system"]["engine_devices"] == scale  # what the metrics weigh decoding time by
        served = [e for e in events if e.kind == "generate" and not e.data["aborted"]]
        per_token[scale] = sum(e.t - e.data["start"] for e in served) / sum(
            token_count(e.data["tokens"]) for e in served
        )
    assert per_token[2] < per_token[1], per_token


def test_engine_scale_over_the_targets_maximum_is_refused_at_hello_and_on_a_real_cluster(tmp_path, fast_target):
    """The target decides whether engines may grow (simulator.max_engine_scale, 1 by default): the
    simulated run refuses more at hello, by name; a real cluster refuses any scale but 1 at build."""
    params = {"engine_scale": 2, "train_devices": 2}
    _, run = target_run(tmp_path / "simulated", _four_devices(fast_target, 1), params, True)
    assert not run.ok and "over the target's simulator.max_engine_scale 1" in run.cause, run.cause
    _, run = harness_run(tmp_path / "real", fast_target, {"engine_scale": 2}, False)
    assert not run.ok and "engine_scale 2: a real cluster's engines here span 1 device(s)" in run.cause, run.cause

    def declares_four(stack) -> None:  # a red team's stack: its engines honest, its declaration not
        build = stack / "build.py"
        build.write_text(build.read_text().replace("engine_scale=engine_scale,", "engine_scale=4,"))

    _, run = harness_run(tmp_path / "declared", fast_target, {}, False, patch=declares_four)
    assert not run.ok and "over the target's simulator.max_engine_scale 1" in run.cause, run.cause  # passed, and
    # the twin fitted to its trace read its timings as engines of four devices


# -- the Ray cluster the real runs join (conftest.py's shared_ray) ----------------------------------------


def test_a_stack_refuses_a_ray_cluster_that_lacks_its_devices(shared_ray):
    from types import SimpleNamespace

    import ray

    from skills.recipes.ray_cluster import join_or_start_ray
    from targets.harness.target import DEVICE_RESOURCE
    from tests.ray_session import DEVICES

    devices = [SimpleNamespace(index=i) for i in range(DEVICES + 1)]
    runtime = SimpleNamespace(accelerator="cpu", device_resource=DEVICE_RESOURCE, devices=devices, serving_devices=())
    with pytest.raises(RuntimeError, match=rf"RAY_ADDRESS={shared_ray} lacks {DEVICE_RESOURCE}{DEVICES} \(1\)"):
        join_or_start_ray(runtime)
    assert not ray.is_initialized()
    # a serving pool's devices, which rollout may borrow, are the cluster's to offer too
    runtime = SimpleNamespace(
        accelerator="cpu", device_resource=DEVICE_RESOURCE, devices=devices[:2], serving_devices=devices[-2:]
    )
    with pytest.raises(RuntimeError, match=rf"lacks {DEVICE_RESOURCE}{DEVICES} \(1\)"):
        join_or_start_ray(runtime)
    assert not ray.is_initialized()


# -- stream training: the step's groups trained as they arrive ---------------------------------------

STREAM = {"shrink_at": 0.5, "stream_train": 1}
# Groups finish far apart (the first ones wait for the tail); async_ratio 0: no next batch runs beside
# the tail, so at half the batch ready the remaining demand frees the training device. Tail batching's
# long-tailed tools at half the latency: the tail still outlasts half the batch (the real run 48 s -> 28 s).
STREAM_TOOLS = {
    **quicker_tools(TAIL_TOOLS, 0.5),
    "train_steps": 3,
    "async_ratio": 0,
}
PART_CALL = "            await cluster.train_part(TrainBatch(part, group_advantages(part)), train)\n"
STEP_CALL = "                return await self._train(cluster, batch, train)\n"


def _streamed_parts(events) -> list[tuple[object, list]]:
    """Each training step with the trajectories it took early (``consumed`` before the step's call),
    after checking that those are exactly its parts' episodes."""
    parts = [e for e in events if e.kind == "train_part"]
    steps = []
    for train in (e for e in events if e.kind == "train"):
        early = [t for t in train.data["trajectories"] if t["consumed"] < train.data["start"]]
        given = [p for p in parts if p.data["step"] == train.data["step"]]
        assert [t["episode"] for t in early] == [ep for p in given for ep in p.data["episodes"]]
        assert all(p.t <= train.data["start"] and p.data["devices"] == train.data["devices"] for p in given)
        steps.append((train, early))
    return steps


@pytest.fixture(scope="module")
def streamed(fast_target, tmp_path_factory, shared_ray):
    """A real streamed run, on the session's Ray cluster: (spec, run, events). Its tools at half the
    simulated runs' latency again (seeds 0-2, when it ran 3 steps: 12 of 16 groups streamed early in each
    step, each step's first part inside the tail, as at twice the latency; the run 21 s -> 10-13 s). Two
    steps since: two passes here, each streamed early and the drop-parts plant found its step."""
    workload = {**quicker_tools(STREAM_TOOLS, 0.5), **TWO_STEPS}
    spec, run = harness_run(tmp_path_factory.mktemp("streamed"), fast_target, STREAM, False, workload)
    assert run.ok, run.cause
    return spec, run, Trace.load_events(run.out / "trace.jsonl")


@pytest.mark.parametrize("simulate", [False, True], ids=["real", "simulated"])
def test_stream_training_trains_the_first_groups_while_the_batch_still_decodes(
    tmp_path, fast_target, request, simulate
):
    """At half the batch ready the remaining demand frees the training device: it leaves rollout and
    trains the ready groups as parts of the step, before the batch's last episode ends; the step lists
    them first, each with when it was taken, and the audit (the real run's training replay of every
    step) passes."""
    if simulate:
        spec, events = audited_run(tmp_path, fast_target, STREAM, True, STREAM_TOOLS)
    else:
        spec, run, events = request.getfixturevalue("streamed")
        audit = run.results["audit"]["result"]
        assert audit["passed"], audit["reasons"]
        assert audit["details"]["training_replay_steps"] == spec.workload.train_steps
    finished = {e.data["episode"]: e.t for e in events if e.kind == "env_step" and e.data["done"]}
    steps = _streamed_parts(events)
    assert len(steps) == spec.workload.train_steps and any(early for _, early in steps)
    for train, early in steps:
        if early:
            batch_done = max(finished[t["episode"]] for t in train.data["trajectories"])
            assert min(t["consumed"] for t in early) < batch_done  # training began inside the tail
            assert all(finished[t["episode"]] <= t["consumed"] for t in train.data["trajectories"])


def test_a_trainer_that_drops_its_parts_gradients_is_rejected_by_the_training_replay(streamed):
    """What a trainer that kept only the step's own groups leaves behind (the reference step on them
    alone, from the previous version): the replay of the whole batch, parts first, rejects that step.
    The step is one whose parts carry a training signal (a group whose rewards differ): dropping groups
    of equal rewards, whose advantages are zero, changes nothing a replay could see."""
    import copy

    from targets.harness.ipc.weight_export import load_snapshot
    from targets.harness.judge.replay import recorded_batch, replay_training
    from targets.harness.judge.trace_index import Reasons, TraceIndex
    from targets.harness.model import load_model, model_dir
    from targets.harness.reference.trainer import ReferenceTrainer

    spec, run, events = streamed
    weights = {int(p.stem[1:]): load_snapshot(p) for p in (run.out / "weights").glob("v*.safetensors")}
    base = load_model(model_dir(spec.model))

    def make_model(state):
        model = copy.deepcopy(base)
        model.load_state_dict(state)
        return model

    k, (train, early) = next(
        (k, (train, early))
        for k, (train, early) in enumerate(_streamed_parts(events), start=1)
        if any(abs(a) > 1e-6 for a, t in zip(train.data["advantages"], train.data["trajectories"]) if t in early)
    )
    own = [i for i, t in enumerate(train.data["trajectories"]) if t not in early]
    kept = {
        "trajectories": [train.data["trajectories"][i] for i in own],
        "advantages": [train.data["advantages"][i] for i in own],
    }
    trainer = ReferenceTrainer(make_model(weights[k - 1]).float(), spec.workload.training.config())
    trainer.train_step(recorded_batch(kept))
    reasons = Reasons()
    replay_training(TraceIndex.of(events), reasons, spec, weights.get, make_model)
    assert not reasons.lines()  # the honest weights replay
    forged = {**weights, k: trainer.state_dict()}
    replay_training(TraceIndex.of(events), reasons, spec, forged.get, make_model)
    said = f"training replay: step {k}: the weights are not the reference GRPO step"
    assert any(r.startswith(said) for r in reasons.lines()), reasons.lines()


def test_a_group_given_in_two_parts_is_used_twice(tmp_path, fast_target):
    _, run = harness_run(
        tmp_path, fast_target, STREAM, True, STREAM_TOOLS, patch=planted("time_multiplex.py", PART_CALL, PART_CALL * 2)
    )
    assert run.ok, run.cause
    audit = run.results["audit"]["result"]
    assert not audit["passed"] and any(r.startswith("used twice: ") for r in audit["reasons"]), audit


def test_a_step_on_other_devices_than_its_parts_is_refused_at_the_call(tmp_path, fast_target):
    elsewhere = STEP_CALL.replace("batch, train)", "batch, cluster.devices[:1])")
    _, run = harness_run(
        tmp_path, fast_target, STREAM, True, STREAM_TOOLS, patch=planted("time_multiplex.py", STEP_CALL, elsewhere)
    )
    assert not run.ok
    assert "this step's parts were trained on ['cpu:1'] (a step and its parts run on the same devices)" in run.cause


def test_a_part_the_run_never_trains_leaves_its_episodes_unaccounted(tmp_path, fast_target):
    """Planted: after the last step the controller takes one more group as a part and ends the run."""
    finish = "        await self._finish(buffer, manager)\n"
    extra = (
        "        await cluster.shrink(train)\n"
        "        await buffer.wait_ready(1, self.version, refill, manager.raise_if_failed)\n"
        "        part = buffer.take_part(1)\n"
        "        await cluster.train_part(TrainBatch(part, group_advantages(part)), train)\n"
    )
    _, run = harness_run(
        tmp_path, fast_target, STREAM, True, STREAM_TOOLS, patch=planted("time_multiplex.py", finish, extra + finish)
    )
    assert run.ok, run.cause
    audit = run.results["audit"]["result"]
    assert not audit["passed"] and any(r.startswith("unaccounted: ") for r in audit["reasons"]), audit


def test_parts_sent_at_once_on_other_devices_are_refused_however_they_race(tmp_path, fast_target):
    """Planted: a part on the training device and the same groups on the other device, both sent at
    once; the harness takes training calls one at a time, so the second meets the first's devices."""
    both = PART_CALL.replace(
        "await cluster.train_part(TrainBatch(part, group_advantages(part)), train)",
        "await asyncio.gather(*(cluster.train_part(TrainBatch(part, group_advantages(part)), on) "
        "for on in (train, cluster.devices[:1])))",
    )
    _, run = harness_run(
        tmp_path, fast_target, STREAM, True, STREAM_TOOLS, patch=planted("time_multiplex.py", PART_CALL, both)
    )
    assert not run.ok
    assert "(a step and its parts run on the same devices)" in run.cause, run.cause


# -- kv_host_tier: evicted prefixes restored from host memory ----------------------------------------

# The real engines' caches hold 384 tokens (one and a half full sequences): the episodes in flight evict
# each other's prefixes between turns. The simulator's engines (memory overridden) hold 625.
HOST_TIER = {"host_kv": 8, "kv_tokens": 384}
SMALL_KV = {"kind": "cpu", "count": 2, "memory_gb": 0.0025}
RESTORE_KEYS = "            pool.k[layer].index_copy_(0, index, k[layer][:usable].to(pool.k[layer].device))\n"


def _host_tier_counts(out) -> tuple[int, int]:
    """(tokens restored, tokens saved) over the engines."""
    return _engine_counts(out, r"host tier on \S+: (\d+) tokens restored of (\d+) saved")


def test_kv_host_tier_restores_evicted_prefixes_in_a_real_run_and_passes_the_audit(tmp_path, fast_target):
    """The engines save the prefixes they evict and restore some when their episodes come back; every
    turn's logprobs, restored context included, pass the audit's replay."""
    audited_run(tmp_path, fast_target, HOST_TIER, False, TWO_STEPS)
    restored, saved = _host_tier_counts(tmp_path / "out")
    assert 0 < restored <= saved, (restored, saved)


def test_a_host_tier_that_restores_other_keys_is_rejected_by_the_replay(tmp_path, fast_target):
    """Planted: a tier that restores zeros for the keys (what it saves is not what it gives back). The
    turns that read them carry logprobs the claimed weights do not give: the audit's replay rejects the run."""
    lost = RESTORE_KEYS.replace("k[layer][:usable]", "torch.zeros_like(k[layer][:usable])")
    patch = planted("kv_cache.py", RESTORE_KEYS, lost)
    _, run = harness_run(tmp_path, fast_target, HOST_TIER, False, TWO_STEPS, patch=patch)
    assert _host_tier_counts(tmp_path / "out")[0] > 0  # the plant acted
    audit = run.results["audit"]["result"]
    ran_otherwise = [r for r in audit["reasons"] if r.startswith("replay: ") and "did not run with those weights" in r]
    assert not audit["passed"] and ran_otherwise, audit["reasons"]


def test_kv_host_tier_in_the_simulator_restores_instead_of_prefilling(tmp_path, fast_target):
    """Simulated on engines whose cache the episodes in flight overfill: with the tier the run's
    engines restore evicted prefixes and prefill fewer tokens than the same seed without it; the
    stack's hello tells the harness the tier's size, and the audit passes."""
    runs = {}
    for name, params in (("plain", {}), ("tier", {"host_kv": 8})):
        data = yaml.safe_load(fast_target.read_text())
        data["hardware"] = SMALL_KV
        _, run = target_run(tmp_path / name, data, params, True)
        assert run.ok and run.results["audit"]["result"]["passed"], (run.cause, run.results.get("audit"))
        start = next(e for e in Trace.load_events(run.out / "trace.jsonl") if e.kind == "run_start")
        assert start.data["engine"]["host_kv_tokens"] == 8 * data["workload"]["tokens"]["max_sequence"] * bool(params)
        runs[name] = run.results["system"]
    assert runs["plain"]["restored_tokens"] == 0 < runs["tier"]["restored_tokens"], runs
    assert runs["tier"]["prefilled_tokens"] < runs["plain"]["prefilled_tokens"], runs
    # the seconds those prefills took are what the evaluator's prefill_bound finding reads (prefill_share)
    assert 0 < runs["tier"]["prefill_seconds"] < runs["plain"]["prefill_seconds"], runs


# -- chunked_prefill: prompts computed in chunks beside the decoding batch ------------------------------

CHUNKS = {"prefill_chunk": 8}
WHOLE_ROWS = "        whole = [r.computed + n == len(r.tokens) for r, n in zip(batch, takes)]"  # prompts done


def _chunks_in(out) -> int:
    """Prompt chunks computed short of their prompt's end, over the engines (each engine's log line)."""
    return sum(
        int(n) for n in re.findall(r"chunked prefill on \S+: (\d+) prompt chunks", (out / "cluster.log").read_text())
    )


def test_chunked_prefill_computes_prompts_in_chunks_in_a_real_run_and_passes_the_audit(tmp_path, fast_target):
    """The engines compute prompts 8 tokens a step beside their decoding requests; every turn's logprobs
    pass the audit's replay (a chunk's keys and values are the whole prompt's)."""
    audited_run(tmp_path, fast_target, CHUNKS, False, TWO_STEPS)
    assert _chunks_in(tmp_path / "out") > 0


def test_a_chunked_engine_that_samples_before_its_prompt_is_computed_is_rejected_by_the_replay(tmp_path, fast_target):
    """Planted: a request samples its first token after its prompt's first chunk (the rest of the prompt
    never computed). Its tokens' logprobs are not what the claimed weights give the whole context: the
    audit's replay rejects the run."""
    early = "        whole = [True for r in batch]"
    patch = planted("paged_engine.py", WHOLE_ROWS, early)
    _, run = harness_run(tmp_path, fast_target, CHUNKS, False, TWO_STEPS, patch=patch)
    audit = run.results["audit"]["result"]
    ran_otherwise = [r for r in audit["reasons"] if r.startswith("replay: ") and "did not run with those weights" in r]
    assert not audit["passed"] and ran_otherwise, audit["reasons"]


def test_chunked_prefill_in_the_simulator_pauses_decode_less(tmp_path, fast_target):
    """Simulated on engines whose episodes keep arriving while others decode: with chunks the engines pause
    decode for fewer seconds than the same seed without (the prompts are computed beside the batch); the
    stack's hello tells the harness the chunk, and the audit passes."""
    runs = {}
    for name, params in (("plain", {}), ("chunked", {"prefill_chunk": 64})):
        data = yaml.safe_load(fast_target.read_text())
        _, run = target_run(tmp_path / name, data, params, True)
        assert run.ok and run.results["audit"]["result"]["passed"], (run.cause, run.results.get("audit"))
        start = next(e for e in Trace.load_events(run.out / "trace.jsonl") if e.kind == "run_start")
        assert start.data["engine"]["prefill_chunk"] == params.get("prefill_chunk", 0)
        runs[name] = run.results["system"]
    assert 0 <= runs["chunked"]["prefill_seconds"] < runs["plain"]["prefill_seconds"], runs
