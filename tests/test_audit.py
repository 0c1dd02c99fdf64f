"""Every check of the system-run audit, planted one at a time into the trace of one honest run:
the honest trace passes, and each edited trace is rejected with the reason that names the cheat.
(tests/test_stack_kit.py plants the main cheats in real stacks end to end; this covers the rest.)"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import pytest
import yaml

from skills.starter import write_starter
from targets.api import TraceEvent
from targets.harness.ipc.weight_export import load_snapshot
from targets.harness.isolation.launch import Limits, run_harness
from targets.harness.isolation.sandbox import Sandbox
from targets.harness.judge.audit import audit_run
from targets.harness.judge.trace_index import ABORT_SLACK_S
from targets.harness.model import load_model, model_dir
from targets.harness.target import Target
from targets.harness.trace import Trace
from targets.spec import parse_target

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def honest(fast_target, tmp_path_factory, shared_ray):  # the run joins the session's Ray cluster (conftest.py)
    spec = parse_target(yaml.safe_load(fast_target.read_text()))
    work = tmp_path_factory.mktemp("audit")
    stack = write_starter(work / "stack", spec, "time_multiplex")
    run = run_harness(
        Target.load(fast_target), stack, work / "out", "measure", Limits(time_s=300), Sandbox("subprocess")
    )
    assert run.ok, run.cause
    assert run.results["audit"]["result"]["passed"], run.results["audit"]["result"]["reasons"]
    said = (run.out / "measure.log").read_text()  # where the audit's time went, said as it went
    assert "[audit " in said and "training step 1 replayed" in said, said[-2000:]
    assert set(run.results["audit"]["result"]["details"]["audit_seconds"]) == {
        "invariants",
        "turn_replay",
        "training_replay",
    }
    weights = {int(p.stem[1:]): load_snapshot(p) for p in (run.out / "weights").glob("v*.safetensors")}
    return spec, Trace.load_events(run.out / "trace.jsonl"), weights, load_model(model_dir(spec.model))


def _audit(honest, events=None, weights=None, steps=None):
    spec, honest_events, honest_weights, base = honest
    weights = honest_weights if weights is None else weights
    return audit_run(
        spec,
        honest_events if events is None else events,
        weights.get,
        lambda state: _loaded(base, state),
        spec.workload.train_steps if steps is None else steps,
    )


def _invariants(honest, events):
    """The audit of ``events`` without its two replays (three quarters of an audit's time), for an edit
    that a rule of the trace itself names. Edits of tokens, logprobs, prompts or versions keep the whole
    audit, so the replays also meet edited traces."""
    from targets.harness.judge import replay

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(replay, "replay_turns", lambda *args: {})
        patch.setattr(replay, "replay_training", lambda *args: {})
        return _audit(honest, events)


def _loaded(base, state):
    model = copy.deepcopy(base)
    model.load_state_dict(state)
    return model


def _edited(honest) -> list[TraceEvent]:
    return copy.deepcopy(honest[1])


def _first(events, kind):
    return next(e for e in events if e.kind == kind)


def _simulated_start(steps: int, declared: dict) -> TraceEvent:
    """The run_start of a simulated run (no tokens recorded) of ``steps`` steps declaring ``declared``."""
    return TraceEvent(
        "run_start",
        0.0,
        {
            "devices": [],
            "steps": steps,
            "stop_token_ids": [1],
            "tokens_recorded": False,
            "engines": {},
            "declared": declared,
        },
    )


def _rejects(result, reason: str) -> None:
    assert not result.passed
    assert any(reason in r for r in result.reasons), result.reasons


def test_the_honest_run_passes(honest):
    result = _audit(honest)
    assert result.passed, result.reasons
    assert result.details["replayed_turns"] >= 4
    # the engines' order of service held wherever it was witnessed (service_order.py). How many requests a
    # run witnesses is the traffic's: 1-273 in the honest runs of judge-service-order.yaml, and none in this
    # fixture's run once on a loaded CI machine; the rule's power is its plant's (test_stack_kit.py)
    witnessed, margin = result.details["service_order_witnessed"], result.details["service_order_least_margin"]
    # what the rule measured on this trace is a pass: no request decoded fewer tokens than the steps later
    # arrivals ran ahead of it (a negative margin is a request held back that the audit let by); with no
    # witness, no margin (test_service_order.py holds the honest margin on a trace that has witnesses)
    assert (margin is None) if witnessed == 0 else margin >= 0, (witnessed, margin)


def test_trajectory_the_harness_never_created(honest):
    events = _edited(honest)
    _first(events, "train").data["trajectories"][0]["episode"] = "g999/e0"
    _rejects(_invariants(honest, events), "fabricated episode")


def test_trajectory_used_twice(honest):
    events = _edited(honest)
    train = _first(events, "train")
    train.data["trajectories"].append(copy.deepcopy(train.data["trajectories"][0]))
    _rejects(_invariants(honest, events), "used twice")


def test_trained_and_dropped(honest):
    events = _edited(honest)
    episode = _first(events, "train").data["trajectories"][0]["episode"]
    events.insert(-1, TraceEvent("sample_dropped", events[-1].t, {"episode": episode, "reason": "end_of_run"}))
    _rejects(_invariants(honest, events), "trained and dropped")


def test_an_episode_dropped_twice(honest):
    # the first drop's reason is the one the audit checks: a second, under another reason, would go unread
    events = _edited(honest)
    drop = _first(events, "sample_dropped")
    events.insert(-1, TraceEvent("sample_dropped", events[-1].t, {**drop.data, "reason": "stale"}))
    _rejects(_invariants(honest, events), "dropped twice")


def test_episode_neither_trained_nor_dropped(honest):
    events = _edited(honest)
    events = [e for e in events if not (e.kind == "sample_dropped")]
    _rejects(_invariants(honest, events), "unaccounted: episode")


@pytest.mark.parametrize(
    "reason, said",
    [
        ("end_of_run", "dropped as end_of_run at"),
        ("stale", "dropped as stale but every turn of its group is within"),
        ("max_sequence", "unjustified drop"),  # which of its rules: the episode's; each has its own test
    ],
)
def test_drop_reason_the_trace_does_not_confirm(honest, reason, said):
    events = _edited(honest)
    train = _first(events, "train")
    first_step = _first(events, "env_step")
    episode = first_step.data["episode"]
    # move the episode out of training and drop it, early, claiming `reason`
    for e in events:
        if e.kind == "train":
            e.data["trajectories"] = [t for t in e.data["trajectories"] if t["episode"] != episode]
        if e.kind == "sample_dropped" and e.data["episode"] == episode:
            e.data["episode"] = "ignored"
    events.insert(
        events.index(train), TraceEvent("sample_dropped", train.t - 0.001, {"episode": episode, "reason": reason})
    )
    _rejects(_invariants(honest, events), said)


def test_a_max_sequence_drop_of_an_episode_whose_context_still_fits(honest):
    events = _edited(honest)
    steps = {}
    for e in events:
        if e.kind == "env_step":
            steps.setdefault(e.data["episode"], []).append(e)
    episode, (first, second, *_) = next((ep, s) for ep, s in steps.items() if len(s) >= 2)
    for e in events:  # out of training, dropped between its first and second turn, claiming max_sequence
        if e.kind == "train":
            e.data["trajectories"] = [t for t in e.data["trajectories"] if t["episode"] != episode]
        if e.kind == "sample_dropped" and e.data["episode"] == episode:
            e.data["episode"] = "ignored"
    at = (first.t + second.t) / 2
    events.insert(
        events.index(second), TraceEvent("sample_dropped", at, {"episode": episode, "reason": "max_sequence"})
    )
    _rejects(_invariants(honest, events), "which still fits")


@pytest.mark.parametrize(
    "missing, said",
    [
        (0, ["replay: no weights recorded for version 0", "training replay: no weights recorded for version 0"]),
        (1, ["training replay: no weights recorded after training step 1"]),
    ],
)
def test_a_version_the_harness_has_no_snapshot_of(honest, missing, said):
    """The replays read every version from the harness's own snapshots: one missing is named, never
    skipped, by the turns' replay and the training replay each (version 0 starts both)."""
    _, _, weights, _ = honest
    result = _audit(honest, weights={v: w for v, w in weights.items() if v != missing})
    assert not result.passed
    for line in said:
        assert line in result.reasons, (line, result.reasons)


def test_trained_tokens_differ_from_the_environment_record(honest):
    events = _edited(honest)
    trajectory = _first(events, "train").data["trajectories"][0]
    trajectory["tokens"][-1] = (trajectory["tokens"][-1] + 1) % 60
    _rejects(_audit(honest, events), "altered trajectory")


def test_trained_reward_differs_from_what_the_environment_paid(honest):
    events = _edited(honest)
    _first(events, "train").data["trajectories"][0]["reward"] += 1.0
    _rejects(_invariants(honest, events), "altered reward")


def test_action_not_produced_by_generate(honest):
    events = _edited(honest)
    step = _first(events, "env_step")
    for e in events:
        if (
            e.kind == "generate"
            and not e.data["aborted"]
            and e.data["episode"] == step.data["episode"]
            and e.data["turn"] == 0
        ):
            e.data["tokens"] = [(t + 1) % honest[0].model.config.vocab_size for t in e.data["tokens"]]
    _rejects(_audit(honest, events), "fabricated rollout")


def test_an_action_the_environment_had_before_its_generate_answered(honest):
    # the tokens match: the controller stepped the environment with tokens it had chosen, then asked
    # generate, whose answer (stamped by the harness after the step) only claims them
    events = _edited(honest)
    step = _first(events, "env_step")
    episode = step.data["episode"]
    at, g = next(
        (i, e)
        for i, e in enumerate(events)
        if e.kind == "generate" and not e.data["aborted"] and e.data["episode"] == episode and e.data["turn"] == 0
    )
    events[at] = dataclasses.replace(g, t=step.t + 1.0)
    _rejects(_invariants(honest, events), f"episode {episode} turn 0: the action was not produced by cluster.generate")


def test_behaviour_logprobs_altered(honest):
    events = _edited(honest)
    trajectory = _first(events, "train").data["trajectories"][0]
    at = trajectory["loss_mask"].index(1)
    trajectory["logprobs"][at] += 0.5
    _rejects(_audit(honest, events), "altered logprobs")


def test_a_trace_without_its_run_end_or_with_two_starts_is_named(honest):
    """Every rule reads the run's settings from its run_start and its span up to its run_end; a trace
    without one was audited on defaults (no engines, no stop tokens) and its order of service skipped."""
    events = [e for e in _edited(honest) if e.kind != "run_end"]
    _rejects(_invariants(honest, events), "trace: the harness's trace holds 0 run_end events, not one")
    events = _edited(honest)
    events.insert(1, copy.deepcopy(_first(events, "run_start")))
    _rejects(_invariants(honest, events), "trace: the harness's trace holds 2 run_start events, not one")


def test_a_nan_behaviour_logprob_switches_no_comparison_off(honest):
    """A NaN compares false with every tolerance: one behaviour logprob of NaN (which the wire refuses;
    planted past it here) must not pass the logprob comparison, and through the GRPO ratio it makes the
    reference step NaN, which must not pass the training replay either."""
    events = _edited(honest)
    trajectory = _first(events, "train").data["trajectories"][0]
    trajectory["logprobs"][trajectory["loss_mask"].index(1)] = float("nan")
    result = _audit(honest, events)
    _rejects(result, "altered logprobs")
    _rejects(result, "not the reference GRPO step on the batch the harness saw (relative error nan")


def test_a_run_too_large_to_replay_whole_replays_a_seeded_sample_that_still_catches_other_weights(honest, monkeypatch):
    """Past REPLAY_ALL_FLOPS (a GPU target's run) the turn replay draws SAMPLED_TURNS turns at random, by
    the audit's seed: here every run is that large, and twelve turns are drawn (so that some are under a
    version before the last, whose weights the swap below changes)."""
    from targets.harness.judge import replay

    monkeypatch.setattr(replay, "REPLAY_ALL_FLOPS", 0.0)
    monkeypatch.setattr(replay, "SAMPLED_TURNS", 12)
    spec, events, weights, _ = honest
    turns = [e for e in events if e.kind == "generate" and e.data["tokens"]]
    finished, cut = sum(not e.data["aborted"] for e in turns), sum(e.data["aborted"] for e in turns)
    result = _audit(honest)
    assert result.passed, result.reasons
    assert finished > 12 and result.details["replay_coverage"] == (
        f"12 of {finished} turns and {min(cut, 12)} of {cut} interrupted segments, drawn at random (seed 0)"
    )
    assert result.details["replayed_turns"] == 12 + min(cut, 12)
    swapped = {version: weights[max(weights)] for version in weights}  # every version's snapshot is the last
    _rejects(_audit(honest, weights=swapped), "did not run with those weights")


def test_interrupted_segments_by_the_ten_thousand_do_not_thin_the_sample_of_finished_turns(honest, monkeypatch):
    """Interruptions are the stack's to make: tens of thousands of short segments that replay right
    (copies here of turns under the last claimed version) filled one draw of four and left the finished
    turns, whose earlier versions' weights are wrong below, unreplayed (this seed: the swap went unseen).
    Each pool gets its own draw."""
    from targets.harness.judge import replay

    monkeypatch.setattr(replay, "REPLAY_ALL_FLOPS", 0.0)
    monkeypatch.setattr(replay, "SAMPLED_TURNS", 4)
    spec, _, weights, _ = honest
    events = _edited(honest)
    turns = [e for e in events if e.kind == "generate" and e.data["tokens"]]
    last = max(e.data["version"] for e in turns)
    latest = [e for e in turns if e.data["version"] == last]
    padding = [  # the copies share their token lists: nothing in the audit writes to an event
        TraceEvent(s.kind, s.t, {**s.data, "aborted": True}) for s in (latest[i % len(latest)] for i in range(30000))
    ]
    events[-1:-1] = padding
    swapped = {version: weights[last] for version in weights}  # every earlier version's snapshot is wrong
    result = _audit(honest, events, weights=swapped)
    cut = sum(e.kind == "generate" and e.data["aborted"] and bool(e.data["tokens"]) for e in events)
    assert f" and 4 of {cut} interrupted segments," in result.details["replay_coverage"], result.details
    _rejects(result, "did not run with those weights")


def test_turn_claiming_a_version_from_the_future(honest):
    events = _edited(honest)
    episode = _first(events, "train").data["trajectories"][0]["episode"]
    for e in events:
        if e.kind == "generate" and not e.data["aborted"] and e.data["episode"] == episode:
            e.data["version"] = 3
    _rejects(_audit(honest, events), "future version")


def test_a_turn_decoded_under_one_version_and_claimed_under_the_next(honest):
    """A turn decoded under version v-1 while v trained, prefilled once more under v as soon as v existed
    and answered with those logprobs (the stack trains on them too), claiming v: the replay agrees (the
    logprobs are v's), and the staleness bound counts it fresher than it is. It was forwarded before v
    existed and answered one prefill after; the version's timing tells (and the delivery rule: no sync had
    brought v to the engine by then)."""
    import bisect

    import torch

    from targets.harness.trace import token_count

    spec, _, weights, base = honest
    events = _edited(honest)
    existed = {e.data["version"]: e.t for e in events if e.kind == "train"}
    trained = {t["episode"]: (e, t) for e in events if e.kind == "train" for t in e.data["trajectories"]}
    in_flight = [  # forwarded before the next version existed, answered after; trained, if at all, under a later
        g  # policy (the cheat claims only what it can: a turn in flight then, not one trained on v-1)
        for g in events
        if g.kind == "generate"
        and not g.data["aborted"]
        and token_count(g.data["tokens"]) >= 4
        and g.data["version"] + 1 in existed
        and g.data["start"] < existed[g.data["version"] + 1] < g.t - 0.002
        and (g.data["episode"] not in trained or trained[g.data["episode"]][0].data["version"] > g.data["version"] + 1)
    ]
    if not in_flight:  # the rule itself on every run: test_the_version_timing_rule_on_any_turn_moved_after_its_version
        pytest.skip("the honest run left no turn in flight when a version that could train it came to exist")
    # the longest such turn (the cheat's motive): one of 4 tokens at a fast run's pace (half its fastest, about
    # 0.4 ms a token on a quick machine) takes under the 2 ms the edit gives it, and a CI run once drew one
    g = max(in_flight, key=lambda e: token_count(e.data["tokens"]))
    version = g.data["version"] = g.data["version"] + 1
    model = copy.deepcopy(base)
    model.load_state_dict(weights[version])
    prompt, tokens = g.data["prompt"], g.data["tokens"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    g.data["logprobs"] = logprobs
    if g.data["episode"] in trained:
        trajectory = trained[g.data["episode"]][1]
        assert trajectory["tokens"][len(prompt) : len(prompt) + len(tokens)] == tokens
        trajectory["logprobs"][len(prompt) : len(prompt) + len(tokens)] = logprobs
    events.remove(g)
    answered = dataclasses.replace(g, t=existed[version] + 0.002)  # one prefill after v existed, not the decode
    events.insert(bisect.bisect([e.t for e in events], answered.t), answered)
    result = _audit(honest, events)
    _rejects(result, "decoded before its version existed: episode " + g.data["episode"])
    # and nothing else could but the delivery rule (v had not reached the engine when the answer came): the
    # training replay differs only because a trace edit cannot retrain on the logprobs it changed (the
    # cheating stack's trainer would have, and matched)
    allowed = {"decoded before its version existed", "version never delivered", "training replay"}
    assert {r.split(":")[0] for r in result.reasons} <= allowed
    assert result.details["version_timing_witnessed"] == 1 and result.details["version_timing_least_ratio"] < 1


def test_the_version_timing_rule_on_any_turn_moved_after_its_version(honest):
    """The rule alone, whatever the honest run's timing: a turn forwarded before the next version existed,
    its claim moved to that version and its answer to one prefill after (the trace edited for this rule
    only), is named; the honest trace is not."""
    from targets.harness.judge.trace_index import Reasons, TraceIndex
    from targets.harness.judge.version_timing import check_version_timing

    events = _edited(honest)
    honest_reasons = Reasons()
    check_version_timing(TraceIndex.of(events, judged=False), honest_reasons)
    assert not honest_reasons.lines(), honest_reasons.lines()
    existed = {e.data["version"]: e.t for e in events if e.kind == "train"}
    g = next(
        e
        for e in events
        if e.kind == "generate"
        and not e.data["aborted"]
        and len(e.data["tokens"]) >= 4
        and e.data["version"] + 1 in existed
        and e.data["start"] < existed[e.data["version"] + 1]
    )
    g.data["version"] += 1
    events[events.index(g)] = dataclasses.replace(g, t=existed[g.data["version"]] + 0.002)
    r = Reasons()
    details = check_version_timing(TraceIndex.of(events, judged=False), r)
    assert r.lines() and all(line.startswith("decoded before its version existed") for line in r.lines())
    assert f"episode {g.data['episode']} turn {g.data['turn']}" in r.lines()[0], r.lines()
    assert details["version_timing_least_ratio"] < 1


@pytest.mark.parametrize("served", ["whole", "a token a segment", "a token a segment, an empty one between"])
def test_a_response_copied_to_a_groupmate_once_and_claimed_under_the_next_version(honest, served):
    """Two members of a group ask the same first prompt; the cluster decodes one and copies its response to
    the other, claimed under the next version with that version's logprobs (a prefill of the copy), once in
    the whole run: the replay agrees with every token, and the independence test compared responses under
    one version only, and counted repeats over every comparison, where the run's honest repeats of short
    answers hide one more. Now each token of the copy is guessed from its original and the guesses' chances
    are taken under the next version, and the copy is one run of drawn guesses, so improbable that its
    tokens past a chance of 1e-12 are the evidence. Served a token a segment (an interrupted segment of one
    token, resumed for the next), no segment's run was ever rare: a resumed turn's run now goes on from the
    segments before it, past empty ones (a request cut before it drew a token is never tested, and the
    run once started again after one: a red team's evasion)."""
    from targets.harness.judge.replay import replay_turns
    from targets.harness.judge.trace_index import Reasons, TraceIndex

    spec, _, weights, base = honest
    honest_reasons = Reasons()
    replay_turns(TraceIndex.of(_edited(honest)), honest_reasons, spec, weights.get, lambda state: _loaded(base, state))
    assert not honest_reasons.lines(), honest_reasons.lines()
    events, copied = _copied_to_a_groupmate(honest, served)
    r = Reasons()
    details = replay_turns(TraceIndex.of(events), r, spec, weights.get, lambda state: _loaded(base, state))
    assert details["independence_guesses"] >= copied - 1  # every token of the copy but a stop
    assert [line.split(":")[0] for line in r.lines()] == ["independent samples"], r.lines()


def _copied_to_a_groupmate(honest, served: str) -> tuple[list[TraceEvent], int]:
    """The honest trace with the longest answer to a prompt two episodes asked under one version copied to
    the later one, claimed under the next version with its logprobs there (``served`` whole, or a token a
    segment): (the events, the copy's tokens)."""
    import torch

    _, _, weights, base = honest
    events = _edited(honest)
    asked: dict[tuple, list[TraceEvent]] = {}
    for g in events:
        if g.kind == "generate" and not g.data["aborted"] and g.data["version"] + 1 in weights:
            asked.setdefault((g.data["version"], tuple(g.data["prompt"])), []).append(g)
    original, g = max(
        (
            (a, b)
            for answered in asked.values()
            for a in answered
            for b in answered
            if a.data["start"] < b.data["start"] and a.data["episode"] != b.data["episode"]
        ),
        key=lambda pair: len(pair[0].data["tokens"]),
    )
    prompt, tokens = original.data["prompt"], original.data["tokens"]
    assert len(tokens) >= 10, "the honest run asked no prompt twice with a long answer"
    version = g.data["version"] = g.data["version"] + 1
    with torch.no_grad():
        logits = _loaded(base, weights[version])(input_ids=torch.tensor([prompt + tokens])).logits[0]
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), -1)
    g.data.update(
        tokens=list(tokens),
        finish=original.data["finish"],
        logprobs=logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist(),
    )
    if served != "whole":
        _served_a_token_a_segment(events, g, empty_between=served.endswith("between"))
    return events, len(tokens)


def test_a_copy_served_a_token_a_segment_is_caught_where_the_replay_draws_a_sample(honest, monkeypatch):
    """A GPU target's run replays a sample of turns, and of interrupted segments apart: here every finished
    turn and a few of thousands of segments. A drawn turn brings the segments it resumes, so the copy's
    run goes on from its first token, whichever of its segments the draw missed."""
    from targets.harness.judge import replay
    from targets.harness.judge.trace_index import Reasons, TraceIndex

    spec, _, weights, base = honest
    events, _ = _copied_to_a_groupmate(honest, "a token a segment")
    finished = [e for e in events if e.kind == "generate" and not e.data["aborted"] and e.data["tokens"]]
    padding = []
    for i in range(3000):  # segments enough that a draw of the finished turns' number misses the copy's
        segment = copy.deepcopy(finished[i % len(finished)])
        segment.data["aborted"] = True
        padding.append(segment)
    events[-1:-1] = padding
    monkeypatch.setattr(replay, "REPLAY_ALL_FLOPS", 0.0)
    monkeypatch.setattr(replay, "SAMPLED_TURNS", len(finished))
    r = Reasons()
    details = replay.replay_turns(TraceIndex.of(events), r, spec, weights.get, lambda state: _loaded(base, state))
    assert "segments they resume" in details["replay_coverage"], details["replay_coverage"]
    assert "independent samples" in [line.split(":")[0] for line in r.lines()], r.lines()


def _served_a_token_a_segment(events: list[TraceEvent], g: TraceEvent, empty_between: bool = False) -> None:
    """``g`` replaced by interrupted segments of one token each, each resumed (``continues``) by the next;
    ``empty_between``: each resumed once more first and cut at once, before it drew a token."""
    d = g.data
    assert not d.get("continues"), "the copy is a whole turn"
    span = (g.t - d["start"]) / len(d["tokens"])
    segments = []
    for i in range(len(d["tokens"])):
        segment = {
            **copy.deepcopy(d),
            "start": d["start"] + i * span,
            "prompt": d["prompt"] + d["tokens"][:i],
            "continues": i,
            "tokens": d["tokens"][i : i + 1],
            "logprobs": d["logprobs"][i : i + 1],
            "max_new_tokens": d["max_new_tokens"] - i,
        }
        if i < len(d["tokens"]) - 1:
            segment.update(aborted=True, finish="abort")
        segments.append(TraceEvent("generate", d["start"] + (i + 0.5) * span, segment))
        if empty_between and i < len(d["tokens"]) - 1:
            empty = {**segment, "start": d["start"] + (i + 0.6) * span, "prompt": d["prompt"] + d["tokens"][: i + 1]}
            empty.update(continues=i + 1, tokens=[], logprobs=[], max_new_tokens=d["max_new_tokens"] - i - 1)
            segments.append(TraceEvent("generate", d["start"] + (i + 0.7) * span, empty))
    at = events.index(g)
    events[at : at + 1] = segments


def test_empty_prompts_under_two_versions_are_a_verdict_not_a_crash(honest):
    """Two groupmates asked with an empty prompt (no context at all), answered under two versions: the
    audit names the prompt (the independence test once crashed on them, scoring one after the other)."""
    events = _edited(honest)
    first = [g for g in events if g.kind == "generate" and not g.data["aborted"] and g.data["turn"] == 0]
    a = first[0]
    b = next(g for g in first if g.data["version"] != a.data["version"] and g.data["episode"] != a.data["episode"])
    for g in (a, b):
        g.data["prompt"] = []
    _rejects(_audit(honest, events), "whole context")


def test_generation_under_weights_other_than_claimed(honest):
    _, _, weights, _ = honest
    swapped = {version: weights[max(weights)] for version in weights}  # every version's snapshot is the last
    _rejects(_audit(honest, weights=swapped), "did not run with those weights")


def test_the_replay_records_whether_it_could_tell_each_version_from_the_one_before(honest):
    """An engine that served v-1 and claimed v passes the replay where the step between them moves no
    logprob past the tolerance (lr 1e-6 in bf16): the audit says, for each version, how far apart the
    two lie on the turns it replayed, and how far the engine's logprobs lie from each."""
    import torch

    spec, _, weights, _ = honest
    result = _audit(honest)
    separations = result.details["version_separation"]
    assert separations and {s["version"] for s in separations} <= set(weights) - {0}

    def moved(v: int) -> bool:  # a batch whose groups each drew one reward has no advantage: the step moves nothing
        return any(not torch.equal(weights[v][name], weights[v - 1][name]) for name in weights[v])

    for s in separations:  # on the CPU target a step is plain to see, and the engine ran the version it claimed
        if not moved(s["version"]):
            assert s["max_separation"] == 0, s
            continue
        assert s["tokens"] > 0 and s["max_separation"] > spec.accuracy.logprob_atol, s
        assert s["mean_to_claimed"] < s["mean_to_previous"], s
    told = sum(moved(s["version"]) for s in separations)
    assert told and result.details["versions_the_replay_tells_apart"] == f"{told} of {len(separations)}"
    v = next(s["version"] for s in separations if moved(s["version"]))
    unmoved = {**weights, v - 1: weights[v]}  # a step too small to see
    details = _audit(honest, weights=unmoved).details
    assert next(s for s in details["version_separation"] if s["version"] == v)["max_separation"] == 0
    # v's step now moves nothing; the step to v - 1, if it moved nothing before (a batch without advantage),
    # now moves what v's did (a CI run's draws: told 2 of 3 where 1 of 3 was asked)
    revealed = v - 1 in {s["version"] for s in separations} and not moved(v - 1)
    assert details["versions_the_replay_tells_apart"] == f"{told - 1 + revealed} of {len(separations)}"


def test_training_that_never_changed_the_weights(honest):
    _, _, weights, _ = honest
    frozen = {version: weights[0] for version in weights}
    _rejects(_audit(honest, weights=frozen), "training did not change the weights")


def test_fewer_steps_than_requested(honest):
    _rejects(_audit(honest, steps=honest[0].workload.train_steps + 2), "training steps")


def test_request_served_by_a_shrunk_engine(honest):
    events = _edited(honest)
    served = [e for e in events if e.kind == "generate" and not e.data["aborted"] and e.data["device"] == "cpu:0"]
    late = served[len(served) // 2]
    events.insert(
        events.index(late),
        TraceEvent("shrink", late.data["start"] - 0.002, {"start": late.data["start"] - 0.003, "devices": ["cpu:0"]}),
    )
    _rejects(_invariants(honest, events), "served while shrunk")


def test_a_request_the_cluster_failed_fails_the_audit(honest):
    """Planted: the cluster failed a turn it disliked (an ordinary error, not an Aborted naming its
    engine) and the controller asked it again; the failure is in the trace, and a failed request may be
    drawn again until one is liked."""
    events = _edited(honest)
    g = next(e for e in events if e.kind == "generate" and not e.data["aborted"])
    failed = {"episode": g.data["episode"], "turn": g.data["turn"], "start": g.data["start"] - 0.05}
    events.insert(
        events.index(g),
        TraceEvent("generate", g.data["start"], {**failed, "aborted": True, "failed": "RuntimeError: engine hiccup"}),
    )
    _rejects(_invariants(honest, events), "failed request")


def test_a_request_decoded_while_its_engine_slept_and_answered_as_it_woke(honest):
    """Planted: the cluster's shrink leaves its engine decoding; a turn forwarded to it while it is shrunk
    (the trainer beside it) is answered just after the expand begins. Answered before the wake it is
    "served while shrunk"; after it, too soon to have been decoded since, it was decoded asleep."""
    from targets.harness.trace import token_count

    events = _edited(honest)
    switching = [(e.data["start"], e.t) for e in events if e.kind in ("shrink", "expand", "suspend", "resume")]
    g = next(
        e
        for e in events
        if e.kind == "generate"
        and not e.data["aborted"]
        and e.data["device"] == "cpu:0"
        and token_count(e.data["tokens"]) >= 8
        and not any(start - 0.05 <= e.data["start"] and e.t <= t + 0.05 for start, t in switching)
    )
    shrunk, woke = g.data["start"] - 0.002, g.t - 1e-5
    at = events.index(g)
    events[at:at] = [TraceEvent("shrink", shrunk, {"start": shrunk - 0.001, "devices": ["cpu:0"]})]
    at = events.index(g)
    events[at:at] = [TraceEvent("expand", woke + 1e-6, {"start": woke, "devices": ["cpu:0"]})]
    events.sort(key=lambda e: e.t)
    result = _invariants(honest, events)
    _rejects(result, "decoded while asleep")
    named = f"episode {g.data['episode']} turn {g.data['turn']} on cpu:0"
    assert any(named in r and "decoded while asleep" in r for r in result.reasons), result.reasons


def test_a_shrink_that_leaves_its_requests_running(honest, monkeypatch):
    """Planted: the cluster's shrink returns without aborting what its engine runs, and the request
    completes seconds later, decoded beside the trainer the shrink made room for. The turn is one that
    starts while no switch of cpu:0 is under way (one CI run planted it in an expand not yet returned:
    the audit then measured from the real shrink before). Every other turn the planted shrink left
    running is named too: each is kept here (three a kind otherwise), so the planted one must be named."""
    from targets.harness.judge import trace_index

    monkeypatch.setattr(trace_index, "MAX_REASONS_PER_KIND", 10_000)
    events = _edited(honest)
    switching = [
        (e.data["start"], e.t) for e in events if e.kind in ("shrink", "expand") and "cpu:0" in e.data["devices"]
    ]
    served = [
        e
        for e in events
        if e.kind == "generate"
        and not e.data["aborted"]
        and e.data["device"] == "cpu:0"
        and not any(start <= e.data["start"] + 0.01 <= t for start, t in switching)
    ]
    g = served[len(served) // 2]
    shrunk_at = g.data["start"] + 0.01
    late = TraceEvent("generate", shrunk_at + ABORT_SLACK_S + 1.0, g.data)
    events[events.index(g)] = late
    events.insert(
        events.index(late), TraceEvent("shrink", shrunk_at, {"start": shrunk_at - 0.005, "devices": ["cpu:0"]})
    )
    result = _audit(honest, events)
    _rejects(result, "cpu:0 went on serving episode")
    named = f"cpu:0 went on serving episode {g.data['episode']} turn {g.data['turn']}"
    assert any(named in r for r in result.reasons), result.reasons


def test_an_engine_woken_before_its_trainer_left_the_device(honest):
    """The shortcut an overlapped sync (``overlap_sync``) tempts: waking the training device's engine
    while its trainer still holds the device, so the expand is quicker."""
    events = _edited(honest)
    expand = _first(events, "expand")
    device = expand.data["devices"][0]
    resident = {d: ["engine"] for d in _first(events, "run_start").data["devices"]} | {device: ["engine", "trainer"]}
    events.insert(events.index(expand), TraceEvent("device_state", expand.data["start"] + 1e-4, {"resident": resident}))
    _rejects(_invariants(honest, events), "memory shared")


def test_training_on_a_device_whose_engine_was_never_put_to_sleep(honest):
    """A controller that trains where its engine still runs (never shrinking or suspending it) while its
    cluster reports the engine alone resident: the residency report is the cluster's word; the harness's
    own record of the controller's calls shows the engine awake through the training step."""
    events = _edited(honest)
    train = _train(events)
    device = train.data["devices"][0]
    before = [e for e in events if e.kind in ("shrink", "suspend") and device in e.data["devices"] and e.t < train.t]
    assert before, "the honest run put the training device's engine to sleep before it trained"
    events = [e for e in events if e not in before and e.kind != "device_state"]
    result = _invariants(honest, events)
    _rejects(result, "trained beside an awake engine")
    assert any(f"{device}'s engine was not shrunk or suspended while training step 1" in r for r in result.reasons)
    assert _first(honest[1], "run_start").data["rollout"]  # the hello's placement is in the trace


def test_a_controller_that_never_syncs_and_a_cluster_that_claims_what_it_was_never_given(honest):
    """Versions are the cluster's word: with no sync in the trace (a controller that skips them, its cluster
    stamping each answer with the newest version there is), the engines that were never expanded answered
    under versions no call brought them; and an answer claiming an older version than its engine held (to
    make its group look stale enough to drop) is named too."""
    events = [e for e in _edited(honest) if e.kind != "sync"]
    result = _invariants(honest, events)
    _rejects(result, "version never delivered")
    events = _edited(honest)
    synced = [e for e in events if e.kind == "sync" and e.data["version"] >= 1]
    assert synced, "the honest run synced a trained version"
    sync = synced[0]
    later = next(
        g
        for g in events
        if g.kind == "generate"
        and not g.data["aborted"]
        and g.data["device"] in sync.data["devices"]
        and g.data["start"] > sync.t
        and g.data["version"] == sync.data["version"]
    )
    later.data["version"] -= 1
    result = _invariants(honest, events)
    _rejects(result, f"turn {later.data['turn']} under version {later.data['version']}, which no sync")


def test_no_active_engine_left(honest):
    events = _edited(honest)
    shrink = _first(events, "shrink")
    shrink.data["devices"] = ["cpu:0", "cpu:1"]
    _rejects(_invariants(honest, events), "no rollout engine was active")


# -- the judge issue's checks, planted into the honest trace -------------------------------------------


def _train(events, index=0):
    return [e for e in events if e.kind == "train"][index]


def _generates(events):
    return [e for e in events if e.kind == "generate" and not e.data["aborted"]]


def test_advantages_that_are_not_the_group_relative_ones(honest):
    events = _edited(honest)
    _train(events).data["advantages"][0] += 1.0
    _rejects(_invariants(honest, events), "altered advantages")


def test_a_batch_short_of_the_batch_size(honest):
    events = _edited(honest)
    train = _train(events)
    train.data["trajectories"].pop()
    train.data["advantages"].pop()
    _rejects(_invariants(honest, events), "batch size")


def test_a_batch_holding_part_of_a_group(honest):
    events = _edited(honest)
    first, second = _train(events, 0), _train(events, 1)
    second.data["trajectories"][0], first.data["trajectories"][0] = (
        first.data["trajectories"][0],
        second.data["trajectories"][0],
    )
    _rejects(_invariants(honest, events), "partial group")


def test_more_episodes_in_flight_than_the_staleness_bound_needs(honest):
    events = _edited(honest)
    start = next(i for i, e in enumerate(events) if e.kind == "episode_created")
    extra = [
        TraceEvent("episode_created", events[start].t, {"episode": f"g900/e{m}", "group": "g900"}) for m in range(8)
    ]
    events[start:start] = extra
    events.insert(-1, TraceEvent("sample_dropped", events[-1].t, {"episode": "g900/e0", "reason": "end_of_run"}))
    _rejects(_invariants(honest, events), "too many episodes")


def test_declared_spares_never_launched_buy_no_groups_more_in_flight(honest):
    """A red team's stack declared a group's worth of spares, launched none, and filled the episodes' bound
    it doubled with whole groups: twice the groups in flight, the episode bound met exactly, and check
    passed. Groups in flight are bounded too, whatever spares are declared; one group more is named."""
    events = _edited(honest)
    size = honest[0].workload.group_size
    _first(events, "run_start").data["declared"]["redundant_per_group"] = size  # room for a group's worth
    start = next(i for i, e in enumerate(events) if e.kind == "episode_created")
    extra = [
        TraceEvent("episode_created", events[start].t, {"episode": f"g900/e{m}", "group": "g900"}) for m in range(size)
    ]
    events[start:start] = extra
    end = events[-1].t
    events[-1:-1] = [
        TraceEvent("sample_dropped", end, {"episode": e.data["episode"], "reason": "end_of_run"}) for e in extra
    ]
    result = _invariants(honest, events)
    _rejects(result, "too many groups")
    assert not any("too many episodes" in reason for reason in result.reasons), result.reasons  # within that bound


@pytest.mark.parametrize(
    "edit, said",
    [
        ({"finish": "stop"}, "finish 'stop' but the last token"),  # the tokens say it ran to its budget
        ({"finish": "abort"}, "an aborted completion was handed back as a result"),
        ({"aborted": True}, "an interrupted segment went on past a stop token or its budget"),  # it decoded it all
    ],
    ids=["stop", "abort", "interrupted"],
)
def test_a_finish_reason_the_tokens_contradict(honest, edit, said):
    events = _edited(honest)
    g = next(g for g in _generates(events) if g.data["finish"] == "length")
    g.data.update(edit)
    _rejects(_invariants(honest, events), said)


def test_a_finish_length_short_of_the_budget(honest):
    events = _edited(honest)
    g = next(g for g in _generates(events) if g.data["finish"] == "stop" and len(g.data["tokens"]) > 1)
    g.data["finish"], g.data["tokens"], g.data["logprobs"] = "length", g.data["tokens"][:-1], g.data["logprobs"][:-1]
    _rejects(_invariants(honest, events), "finish 'length' after")


@pytest.mark.parametrize("reason", ["end_of_run", "stale"])
def test_a_dropped_episode_the_harness_never_created(honest, reason):
    """Named as such whatever reason the drop gives (a stale one once crashed the deferral rules: its group
    was None)."""
    events = _edited(honest)
    drop = _first(events, "sample_dropped")
    events.append(TraceEvent("sample_dropped", drop.t, {**drop.data, "episode": "g999/e0", "reason": reason}))
    _rejects(_invariants(honest, events), "dropped g999/e0, which the harness never created")


def test_a_loss_mask_that_trains_on_what_the_environment_said(honest):
    events = _edited(honest)
    trajectory = _first(events, "train").data["trajectories"][0]
    trajectory["loss_mask"][0] = 1  # the first observation token counted as the policy's
    result = _audit(honest, events)
    _rejects(result, "altered trajectory")
    _rejects(result, "the recorded batch cannot be replayed")  # named, where the replay crashed before


def test_generation_past_a_stop_token(honest):
    events = _edited(honest)
    g = next(g for g in _generates(events) if g.data["finish"] == "length" and len(g.data["tokens"]) > 2)
    g.data["tokens"][0] = g.data["stop"][0]
    _rejects(_invariants(honest, events), "past a stop token")


def test_an_engine_asked_with_less_than_the_whole_context(honest):
    events = _edited(honest)
    g = next(g for g in _generates(events) if g.data["turn"] > 0)
    g.data["prompt"] = g.data["prompt"][-8:]
    _rejects(_invariants(honest, events), "incomplete prompt")


def test_requests_at_another_temperature(honest):
    events = _edited(honest)
    _generates(events)[0].data["temperature"] = 0.5
    _rejects(_invariants(honest, events), "sampling parameters")


def test_logprobs_of_the_unscaled_distribution_at_another_temperature(honest):
    """Planted: at temperature 0.6 an engine reports each token's logprob under softmax(logits), not under
    the softmax(logits / 0.6) it drew from (what the contract once asked): its trainer's ratio is taken
    against another distribution than the draw's. The turn replay scores each turn at its own temperature."""
    spec, events, weights, base = honest
    training = spec.workload.training.model_copy(update={"temperature": 0.6})
    spec = spec.model_copy(update={"workload": spec.workload.model_copy(update={"training": training})})
    events = _edited(honest)
    for g in (e for e in events if e.kind == "generate" and "temperature" in e.data):
        g.data["temperature"] = 0.6  # asked as the spec says; the logprobs left as the honest T = 1 run's
    result = audit_run(spec, events, weights.get, lambda state: _loaded(base, state), spec.workload.train_steps)
    _rejects(result, "did not run with those weights")


@pytest.mark.parametrize("stop", [[0, 1, 2], []], ids=["extra stop tokens", "no stop token"])
def test_requests_that_stop_on_other_tokens(honest, stop):
    """Planted: a controller that stops every turn on whatever it samples (each token a genuine
    sample, so the replays pass) decodes and trains less per turn."""
    events = _edited(honest)
    _generates(events)[2].data["stop"] = stop
    _rejects(_invariants(honest, events), "asked to stop on tokens")


@pytest.mark.parametrize("partial", [False, True], ids=["no partial", "with its partial"])
def test_an_abort_no_mechanism_caused(honest, partial):
    """Planted: the cluster aborts a turn it dislikes while nothing is being shrunk, suspended or
    synced, and the controller retries it (a resample the audit would otherwise never see)."""
    events = _edited(honest)
    busy = [(e.data["start"], e.t) for e in events if e.kind in ("shrink", "suspend", "sync")]
    g = next(g for g in _generates(events) if not any(s <= g.t <= e + ABORT_SLACK_S for s, e in busy))
    aborted = copy.deepcopy(g.data) if partial else {k: g.data[k] for k in ("episode", "turn", "start")}
    aborted["aborted"] = True
    events.insert(events.index(g), TraceEvent("generate", g.t, aborted))
    _rejects(_invariants(honest, events), f"episode {g.data['episode']} turn {g.data['turn']} was aborted at")


def test_an_abort_on_an_engine_the_shrink_in_progress_left_alone(honest):
    """Planted: while one device shrinks, the cluster also aborts a turn another engine serves (one
    it dislikes), and the controller retries it. The shrink explains aborts on its own devices only."""
    events = _edited(honest)
    shrink = next(e for e in events if e.kind == "shrink")
    during = (shrink.data["start"] + shrink.t) / 2
    g = next(
        g for g in _generates(events) if g.data["device"] not in shrink.data["devices"] and g.data["start"] <= during
    )
    aborted = {**copy.deepcopy(g.data), "aborted": True, "finish": "abort"}
    events.insert(events.index(shrink), TraceEvent("generate", during, aborted))
    _rejects(_invariants(honest, events), f"aborted at {during:.2f}s on {g.data['device']} with no shrink")


def _engine_aborts(spec, aborts: list[tuple[str, float]], overhead: float = 0.0) -> list[str]:
    """The abort check's reasons on a simulated trace of two engines of two devices each: device h:1
    shrinks from 1.0 s to 1.5 s; each abort (the device its completion names, when) started at 0.5 s."""
    from targets.harness.judge.interruptions import check_aborts
    from targets.harness.judge.trace_index import Reasons, TraceIndex

    simulator = spec.simulator.model_copy(update={"request_overhead_s": overhead})
    spec = spec.model_copy(update={"simulator": simulator})
    engines = {"h:0": ["h:0", "h:1"], "h:2": ["h:2", "h:3"]}
    events = [
        TraceEvent(
            "run_start", 0.0, {"stop_token_ids": [1], "tokens_recorded": False, "engines": engines, "declared": {}}
        )
    ]
    events += [TraceEvent("shrink", 1.5, {"start": 1.0, "devices": ["h:1"]})]
    for i, (device, t) in enumerate(aborts):
        events.append(
            TraceEvent(
                "generate", t, {"episode": f"g0/e{i}", "turn": 0, "start": 0.5, "aborted": True, "device": device}
            )
        )
    reasons = Reasons()
    check_aborts(TraceIndex.of(sorted(events, key=lambda e: e.t)), reasons, spec)
    return reasons.lines()


def test_a_shrink_of_one_device_explains_aborts_on_its_whole_engine_only(tiny_spec):
    """In the simulator an engine spans devices and a completion names its first: a shrink of h:1
    takes engine h:0 whole, so an abort named h:0 is its doing (no false alarm), one on h:2 is not
    (planted), and a simulated answer's way back (request_overhead_s) is no reason either."""
    spec = tiny_spec
    assert _engine_aborts(spec, [("h:0", 1.2)]) == []
    lines = _engine_aborts(spec, [("h:0", 1.2), ("h:2", 1.2)])
    assert len(lines) == 1 and "g0/e1 turn 0 was aborted at 1.20s on h:2 with no shrink" in lines[0], lines
    late = 1.5 + ABORT_SLACK_S + 0.4
    assert _engine_aborts(spec, [("h:0", late)], overhead=0.5) == []
    assert "on h:0 with no shrink" in " ".join(_engine_aborts(spec, [("h:0", late)]))
    assert "without naming the engine" in " ".join(_engine_aborts(spec, [("", 1.2)]))


def _cut_reasons(spec, call: str, completions: list[tuple[float, float, int]], cut_at: float = 1.2) -> list[str]:
    """The abort rule's reasons on a real run's trace: engine d:0's ``call`` (a shrink, or a sync that
    interrupts to bring version 1, trained at 0.9 s) runs from 1.0 s to 1.4 s and cuts a request forwarded
    at 0.5 s at ``cut_at``; each completion (forwarded at, answered at, under version) is another request
    d:0 served to its end."""
    from targets.harness.judge.interruptions import check_aborts
    from targets.harness.judge.trace_index import Reasons, TraceIndex

    start = _simulated_start(0, {})
    start.data.update(tokens_recorded=True, engines={"d:0": ["d:0"], "d:1": ["d:1"]})
    events = [start, TraceEvent("train", 0.9, {"start": 0.2, "version": 1, "trajectories": []})]
    events.append(TraceEvent(call, 1.4, {"start": 1.0, "devices": ["d:0"], "interrupt": True, "version": 1}))
    cut = {"episode": "g0/e0", "turn": 0, "start": 0.5, "aborted": True, "device": "d:0", "tokens": [5, 6]}
    events.append(TraceEvent("generate", cut_at, cut))
    for i, (forwarded, answered, version) in enumerate(completions, start=1):
        data = {"episode": f"g0/e{i}", "turn": 0, "start": forwarded, "aborted": False, "device": "d:0"}
        events.append(TraceEvent("generate", answered, {**data, "version": version}))
    reasons = Reasons()
    check_aborts(TraceIndex.of(sorted(events, key=lambda e: e.t)), reasons, spec)
    return reasons.lines()


@pytest.mark.parametrize("call", ["sync", "shrink"])
def test_an_interruption_that_cuts_the_turns_it_dislikes_and_lets_the_others_finish(call, tiny_spec):
    """Planted (a red team's): during a sync it makes for the purpose, the cluster cuts only the long turns
    and lets the short ones finish; the controller restarts the cut ones from scratch, and trains the short
    draws. A call cuts everything its engine has started at one instant: a request forwarded before its
    first cut may complete before it (it had ended before the call reached the engine), or just after
    (replies come in any order), or, after a sync, under the version the sync brought (it waited in the
    queue while the weights loaded: the paged engine cuts only what it started), never later under the old
    weights; that holds for a request forwarded after the call began too (a sync kept open all step would
    otherwise excuse any survivor)."""
    from targets.harness.judge.interruptions import CUT_SLACK_S

    honest = [(0.6, 1.1, 0), (0.7, 1.2 + CUT_SLACK_S / 2, 0), (1.25, 1.3, 0)]  # before the cut, with it, after
    assert _cut_reasons(tiny_spec, call, honest) == []
    waited = _cut_reasons(tiny_spec, call, [*honest, (0.9, 1.35, 1)])
    assert waited == [] if call == "sync" else "g0/e4 turn 0, forwarded to it at 0.90s" in waited[0]
    for survivor in [(0.8, 1.3, 0), (1.1, 1.3, 0)]:  # forwarded before the call began, and after
        (reason,) = _cut_reasons(tiny_spec, call, [*honest, survivor])
        assert reason.startswith("selective interruption: ") and "first cut a request on d:0 at 1.20s" in reason
        assert f"episode g0/e4 turn 0, forwarded to it at {survivor[0]:.2f}s, completed at 1.30s" in reason


def test_an_interrupting_sync_to_a_version_its_engine_holds_is_named(tiny_spec):
    """Planted (a red team's): syncs to the version the engines already hold, made to interrupt them
    whenever the turns in flight are the long ones; the controller restarts what they cut. Syncs that
    bring the next version, or that interrupt nothing, pass; a sync to a version no step had returned (a
    reviewer's way past the rule: a numbering of the cluster's own) is named too."""
    from targets.harness.judge.interruptions import check_aborts
    from targets.harness.judge.trace_index import Reasons, TraceIndex

    def reasons(*syncs: tuple[float, int, bool]) -> list[str]:
        events = [_simulated_start(0, {})]
        events += [TraceEvent("train", 0.5, {"start": 0.1, "version": v, "trajectories": []}) for v in (1, 2)]
        for start, version, interrupt in syncs:
            data = {"start": start, "devices": ["d:0"], "version": version, "interrupt": interrupt}
            events.append(TraceEvent("sync", start + 0.1, data))
        r = Reasons()
        check_aborts(TraceIndex.of(events), r, tiny_spec)
        return r.lines()

    assert reasons((1.0, 1, True), (2.0, 2, True), (3.0, 2, False)) == []
    (reason,) = reasons((1.0, 1, True), (2.0, 1, True))
    assert reason.startswith("needless interruption: the sync begun at 2.00s interrupted d:0 to bring it version 1")
    # a version of its own numbering would make every sync newer: a sync brings one a step returned
    (reason,) = reasons((1.0, 1, True), (2.0, 1000, True))
    assert reason.startswith("unknown version: the sync begun at 2.00s brought version 1000, which no training")
    assert reasons((0.2, 1, False))[0].startswith("unknown version: the sync begun at 0.20s brought version 1")


def test_an_interrupting_sync_to_the_version_an_engine_answered_under_is_named(tiny_spec):
    """Planted: an interrupting sync to version 0, which every engine holds from the start, and one to the
    version an expand brought, which the engine's answers since have claimed: each cut its requests for
    nothing, once per device and step, at a moment the controller chose. The rule knew only what syncs had
    brought (nothing, at first), and let both by; the sync that brings the next version still passes."""
    from targets.harness.judge.interruptions import check_aborts
    from targets.harness.judge.trace_index import Reasons, TraceIndex

    def reasons(sync_start: float, version: int, answered_under: int | None) -> list[str]:
        events = [_simulated_start(0, {}), TraceEvent("train", 0.5, {"start": 0.1, "version": 1, "trajectories": []})]
        events.append(TraceEvent("expand", 0.7, {"start": 0.6, "devices": ["d:0"]}))
        if answered_under is not None:  # a turn d:0 answered after the expand, under the version it claims
            data = {"episode": "g0/e0", "turn": 0, "start": 0.75, "aborted": False, "device": "d:0"}
            data |= {"prompt": 4, "tokens": [5, 6], "logprobs": [-1.0, -1.0], "version": answered_under}
            events.append(TraceEvent("generate", 0.9, data))
        data = {"start": sync_start, "devices": ["d:0"], "version": version, "interrupt": True}
        events.append(TraceEvent("sync", sync_start + 0.1, data))
        r = Reasons()
        check_aborts(TraceIndex.of(sorted(events, key=lambda e: e.t)), r, tiny_spec)
        return [line for line in r.lines() if line.startswith("needless interruption")]

    (at_start,) = reasons(0.2, 0, None)
    assert at_start.startswith("needless interruption: the sync begun at 0.20s interrupted d:0 to bring it version 0")
    (after_expand,) = reasons(1.0, 1, 1)
    assert "to bring it version 1, which it held already (version 1)" in after_expand
    assert reasons(1.0, 1, 0) == [] and reasons(1.0, 1, None) == []  # what it is known to hold is older


def _mechanism_on_a_suspend(spec, generates: list[tuple[float, float]]) -> list[str]:
    """The mechanism rule's reasons on a simulated trace whose engine h:0 is suspended at 1.5 s (the call
    made at 1.0 s) and resumed at 3.0 s; each request (its start, its answer) served by h:0, not aborted."""
    from targets.harness.judge.mechanism import check_mechanism
    from targets.harness.judge.trace_index import Reasons, TraceIndex

    start = _simulated_start(0, {})
    start.data["engines"] = {"h:0": ["h:0"], "h:1": ["h:1"]}
    events = [start, TraceEvent("run_end", 9.0, {})]
    events += [TraceEvent("suspend", 1.5, {"start": 1.0, "devices": ["h:0"]})]
    events += [TraceEvent("resume", 3.2, {"start": 3.0, "devices": ["h:0"]})]
    for i, (begun, answered) in enumerate(generates):
        data = {"episode": f"g0/e{i}", "turn": 0, "start": begun, "aborted": False, "device": "h:0"}
        events.append(TraceEvent("generate", answered, data))
    reasons = Reasons()
    check_mechanism(TraceIndex.of(sorted(events, key=lambda e: e.t)), reasons, 0, spec)
    return reasons.lines()


def test_a_resume_begun_before_its_suspend_returned_is_named(tiny_spec):
    """Planted: a controller starts its resume while its suspend is under way, and the cluster answers the
    resume after the suspend: the suspended window (the suspend's return to the next resume's start) is
    empty, so nothing served in it could be named, while the controller link counted the rollout paused from
    the suspend's return (the episodes the stack held meanwhile held by no one)."""
    from targets.harness.judge.mechanism import check_mechanism
    from targets.harness.judge.trace_index import Reasons, TraceIndex

    start = _simulated_start(0, {})
    start.data["engines"] = {"h:0": ["h:0"], "h:1": ["h:1"]}

    def reasons(resume_start: float, resume_end: float) -> list[str]:
        events = [start, TraceEvent("run_end", 9.0, {}), TraceEvent("suspend", 1.5, {"start": 1.0, "devices": ["h:0"]})]
        events.append(TraceEvent("resume", resume_end, {"start": resume_start, "devices": ["h:0"]}))
        r = Reasons()
        check_mechanism(TraceIndex.of(sorted(events, key=lambda e: e.t)), r, 0, tiny_spec)
        return r.lines()

    assert reasons(3.0, 3.2) == []
    (overlapped,) = reasons(1.2, 2.0)
    assert overlapped.startswith("suspend overlapped: the suspend begun at 1.00s (returned at 1.50s) was under way")


def test_an_engine_that_serves_while_suspended(tiny_spec):
    """A colocated stack suspends its engines while the trainer holds the devices: a request served in
    that window, or one the suspend left decoding, is the engine running beside the trainer."""
    slack = ABORT_SLACK_S + tiny_spec.simulator.request_overhead_s
    assert _mechanism_on_a_suspend(tiny_spec, [(0.5, 1.2), (3.3, 4.0)]) == []  # before it, after the resume
    (served,) = _mechanism_on_a_suspend(tiny_spec, [(2.0, 2.5)])
    assert "h:0 served episode g0/e0 turn 0 while shrunk" in served
    (kept,) = _mechanism_on_a_suspend(tiny_spec, [(0.5, 1.5 + slack + 1.0)])
    assert "h:0 went on serving episode g0/e0 turn 0 after its shrink returned at 1.50s" in kept


def test_a_step_that_returns_the_wrong_version(honest):
    events = _edited(honest)
    _train(events, 1).data["version"] = 7
    _rejects(_invariants(honest, events), "version numbering")


def test_a_turn_sampled_twice(honest):
    events = _edited(honest)
    g = _generates(events)[3]
    events.insert(events.index(g), copy.deepcopy(g))
    _rejects(_audit(honest, events), "resampled turn")


def test_a_trainer_whose_step_is_not_the_reference_step_on_the_batch_it_got(honest):
    """What a trainer that drops half its batch leaves behind: a smaller step than the batch gives."""
    _, _, weights, _ = honest
    shrunk = dict(weights)
    shrunk[2] = {k: weights[1][k] + 0.5 * (weights[2][k] - weights[1][k]) for k in weights[2]}
    _rejects(_audit(honest, weights=shrunk), "training replay: step 2: the weights are not the reference GRPO step")


# -- hand-built traces: group-level staleness, redundancy ----------------------------------------------


def _mini_spec(honest):
    return honest[0]


def _group_trace(
    reason: str, versions: dict[str, int], declared: dict | None = None, drop_at: float = 9.0
) -> list[TraceEvent]:
    """Two episodes of one group, each generated once at the given version (at ``1 + version`` s), both
    dropped for ``reason`` at ``drop_at`` (policy 1 from 5 s, 2 from 6 s, 3 from 7 s)."""
    events = [
        _simulated_start(3, declared or {}),
    ]
    for episode in versions:
        events.append(TraceEvent("episode_created", 0.0, {"episode": episode, "group": "g0"}))
    for episode, version in versions.items():
        events.append(
            TraceEvent(
                "generate",
                1.0 + version,
                {
                    "episode": episode,
                    "turn": 0,
                    "start": 0.5,
                    "aborted": False,
                    "device": "cpu:0",
                    "prompt": 4,
                    "tokens": 2,
                    "logprobs": 2,
                    "version": version,
                    "finish": "length",
                },
            )
        )
    for step in range(3):
        events.append(
            TraceEvent(
                "train",
                5.0 + step,
                {
                    "start": 4.5 + step,
                    "step": step + 1,
                    "version": step + 1,
                    "devices": [],
                    "advantages": [],
                    "trajectories": [],
                },
            )
        )
    for episode in versions:
        events.append(TraceEvent("sample_dropped", drop_at, {"episode": episode, "reason": reason}))
    events.append(TraceEvent("run_end", 10.0))
    return events


def _drop_reasons(spec, events):
    from targets.harness.judge.selection import check_drop_reasons
    from targets.harness.judge.trace_index import Reasons, TraceIndex

    r = Reasons()
    check_drop_reasons(TraceIndex.of(events), r, spec)
    return r.lines()


def test_a_group_goes_stale_whole_when_one_member_is_stale(honest):
    """The buffer drops a group whole; the audit judges staleness per group, as the buffer must: a
    member whose own turns are fresh is justly dropped with its stale sibling (async_ratio 1)."""
    spec = _mini_spec(honest)
    assert _drop_reasons(spec, _group_trace("stale", {"g0/e0": 0, "g0/e1": 2})) == []
    lines = _drop_reasons(spec, _group_trace("stale", {"g0/e0": 2, "g0/e1": 2}))
    assert any("unjustified drop" in line and "dropped as stale" in line for line in lines), lines


def test_a_group_dropped_stale_in_part_while_its_other_members_train(honest):
    """Planted: a group with one member kept old on purpose (version 0) has it dropped as stale together
    with a fresh sibling it dislikes, and trains its third member: the stale reason holds for the group,
    so with spares this picks which members train by their reward. A group with a stale turn goes whole."""
    spec = _mini_spec(honest)
    events = _group_trace("stale", {"g0/e0": 0, "g0/e1": 2})
    events.insert(1, TraceEvent("episode_created", 0.0, {"episode": "g0/e2", "group": "g0"}))
    last_train = max(i for i, e in enumerate(events) if e.kind == "train")
    events[last_train].data["trajectories"] = [{"episode": "g0/e2", "group": "g0", "reward": 1.0}]
    lines = _drop_reasons(spec, events)
    assert any("dropped as stale while g0/e2 of its group g0 trained" in line for line in lines), lines


def test_a_group_whose_only_turns_are_interrupted_segments_may_go_stale(tiny_spec):
    """Honest (a ``partial_rollout`` stack): a shrink cut every member's first turn under version 0, the
    segments kept to resume; two steps later any resumption would train version 0's tokens, so the stack hands
    the group back as stale. Those segments count for a stack that resumes them (the rule read finished turns
    alone, and called the drop unjustified); for one that restarts its turns they do not."""
    from targets.harness.judge.selection import check_drop_reasons
    from targets.harness.judge.trace_index import Reasons, TraceIndex

    w = tiny_spec.workload
    members = [f"g0/e{m}" for m in range(w.group_size)]

    def reasons(declared: dict) -> list[str]:
        events = [_simulated_start(2, declared), TraceEvent("shrink", 0.6, {"start": 0.5, "devices": ["cpu:0"]})]
        for e in members:
            events.append(TraceEvent("episode_created", 0.0, {"episode": e, "group": "g0"}))
            events.append(TraceEvent("env_reset", 0.0, {"episode": e, "observation": w.tokens.prompt}))
            cut = {"episode": e, "turn": 0, "start": 0.1, "aborted": True, "device": "cpu:0", "prompt": w.tokens.prompt}
            cut |= {"continues": 0, "tokens": 5, "logprobs": 5, "version": 0, "finish": "abort"}
            events.append(TraceEvent("generate", 0.55, cut))
        for k, (start, end) in enumerate([(1.0, 2.0), (2.5, 3.0)], start=1):
            events.append(TraceEvent("train", end, {"start": start, "step": k, "version": k, "trajectories": []}))
        events += [TraceEvent("sample_dropped", 3.5, {"episode": e, "reason": "stale"}) for e in members]
        events.append(TraceEvent("run_end", 4.0))
        r = Reasons()
        check_drop_reasons(TraceIndex.of(sorted(events, key=lambda e: e.t)), r, tiny_spec)
        return r.lines()

    assert reasons({"partial_rollout": True}) == []
    assert any("dropped as stale but every turn of its group" in x for x in reasons({})), reasons({})


def test_an_early_stale_abort_must_already_be_certain(honest):
    """abort_stale hands a group back while it still runs: right once the policy is more than
    async_ratio (1) past its oldest turn (policy 2 over version 0), planted one step too soon (policy 1)."""
    spec = _mini_spec(honest)
    assert _drop_reasons(spec, _group_trace("stale", {"g0/e0": 0, "g0/e1": 0}, drop_at=6.5)) == []
    lines = _drop_reasons(spec, _group_trace("stale", {"g0/e0": 0, "g0/e1": 0}, drop_at=5.5))
    assert any("dropped as stale but every turn of its group is within" in line for line in lines), lines


def test_redundant_drops_need_declared_redundancy(honest):
    spec = _mini_spec(honest)
    lines = _drop_reasons(spec, _group_trace("redundant", {"g0/e0": 2, "g0/e1": 2}))
    assert any("declares no redundancy" in line for line in lines), lines


def _redundant_trace(group_size: int, spares: int, drop_at: float, declared: int) -> list[TraceEvent]:
    """One group of ``group_size + spares`` members: the first ``group_size`` finish at t=2, the
    spares are dropped as ``redundant`` at ``drop_at``."""
    members = [f"g0/e{m}" for m in range(group_size + spares)]
    events = [
        _simulated_start(1, {"redundant_per_group": declared}),
    ]
    events += [TraceEvent("episode_created", 0.0, {"episode": m, "group": "g0"}) for m in members]
    events += [
        TraceEvent("env_step", 2.0, {"episode": m, "action": 2, "observation": 2, "done": True})
        for m in members[:group_size]
    ]
    events += [
        TraceEvent("sample_dropped", drop_at, {"episode": m, "reason": "redundant"}) for m in members[group_size:]
    ]
    events.append(TraceEvent("run_end", 10.0))
    return events


def test_redundant_spares_dropped_once_their_group_finished_pass(honest):
    spec = _mini_spec(honest)
    assert _drop_reasons(spec, _redundant_trace(spec.workload.group_size, 2, drop_at=3.0, declared=2)) == []


def test_a_spare_dropped_before_its_group_finished_is_rejected(honest):
    """Planted: 'redundant' used to throw away a member the group still needed."""
    spec = _mini_spec(honest)
    lines = _drop_reasons(spec, _redundant_trace(spec.workload.group_size, 1, drop_at=1.0, declared=1))
    assert any("dropped as redundant at 1.00s, when only 0" in line for line in lines), lines


@pytest.mark.parametrize("finished_at", [1.0, 2.2], ids=["the-first-finisher", "the-last-of-the-first-finishers"])
def test_a_member_dropped_as_redundant_after_it_finished_among_the_first_is_rejected(honest, finished_at):
    """Planted: wait for every member, then drop as 'redundant' one of those that finished among the first
    ``group_size`` (the lowest reward, say) and train the spare that finished last in its place: selection by
    outcome. The member that completed the group (at 2.2 s, the others at 2.0) is no spare either: the rule
    once counted it among the finishers it was compared with, and let it go."""
    spec = _mini_spec(honest)
    size = spec.workload.group_size
    events = _redundant_trace(size, 1, drop_at=3.0, declared=1)
    spare, first = f"g0/e{size}", "g0/e0"
    for i, e in enumerate(events):
        if e.kind == "sample_dropped" and e.data["episode"] == spare:
            e.data["episode"] = first
        if e.kind == "env_step" and e.data["episode"] == first:
            events[i] = TraceEvent(e.kind, finished_at, e.data)
    events.insert(-2, TraceEvent("env_step", 2.5, {"episode": spare, "action": 2, "observation": 2, "done": True}))
    lines = _drop_reasons(spec, events)
    said = f"episode {first} finished at {finished_at:.2f}s, before {size} other members of its group g0 had (2.50s)"
    assert any(said in line for line in lines), lines
    # the same member dropped while the spare still ran (the honest order) passes
    honest_order = [e for e in events if not (e.kind == "env_step" and e.data["episode"] == spare)]
    for e in honest_order:
        if e.kind == "sample_dropped":
            e.data["episode"] = spare
    assert _drop_reasons(spec, honest_order) == []
    # and so does a spare that finished in the same instant as the member completing its group
    tied = _redundant_trace(size, 1, drop_at=3.0, declared=1)
    tied.insert(-2, TraceEvent("env_step", 2.0, {"episode": spare, "action": 2, "observation": 2, "done": True}))
    assert _drop_reasons(spec, tied) == []


def test_a_finished_group_passed_over_after_its_spare_was_dropped_is_out_of_order(tiny_spec):
    """Planted: a group with a spare completes, its spare is handed back as ``redundant`` at once (honest), and
    the stack then passes the finished group over for a younger one at the next step and lets it go stale. The
    oldest-first rule took a group's first drop as the moment it was taken, so the spare's drop, made before
    either step, exempted the group from the rule for the rest of the run."""
    from targets.harness.judge.audit import check_batches
    from targets.harness.judge.trace_index import Reasons, TraceIndex

    size = tiny_spec.workload.group_size
    old, young = [f"old/e{m}" for m in range(size + 1)], [f"young/e{m}" for m in range(size + 1)]
    events = [_simulated_start(2, {"redundant_per_group": 1})]
    events += [TraceEvent("episode_created", 0.0, {"episode": e, "group": e.split("/")[0]}) for e in old + young]

    def finish(episodes: list[str], t: float) -> list[TraceEvent]:
        return [
            TraceEvent("env_step", t, {"episode": e, "action": 2, "observation": 2, "done": True}) for e in episodes
        ]

    def train(start: float, end: float, k: int, episodes: list[str]) -> TraceEvent:
        trained = [{"episode": e, "group": e.split("/")[0], "reward": 0.0} for e in episodes]
        return TraceEvent("train", end, {"start": start, "step": k, "version": k, "trajectories": trained})

    events += finish(old[:size], 1.0) + [
        TraceEvent("sample_dropped", 1.0, {"episode": old[size], "reason": "redundant"})
    ]
    events += [train(1.5, 2.0, 1, [])]
    events += finish(young[:size], 2.5) + [
        TraceEvent("sample_dropped", 2.5, {"episode": young[size], "reason": "redundant"})
    ]
    events += [train(3.0, 3.5, 2, young[:size])]
    events += [TraceEvent("sample_dropped", 4.0, {"episode": e, "reason": "stale"}) for e in old[:size]]
    events.append(TraceEvent("run_end", 5.0))
    r = Reasons()
    check_batches(TraceIndex.of(events), r, tiny_spec)
    assert any(
        line.startswith("out of order: training step 2 took younger groups over group old") for line in r.lines()
    ), r.lines()
    # trained in its turn (the old group at step 2, the young one held for step 3's), nothing is out of order
    events[events.index(next(e for e in events if e.kind == "train" and e.data["version"] == 2))] = train(
        3.0, 3.5, 2, old[:size]
    )
    r = Reasons()
    check_batches(
        TraceIndex.of([e for e in events if not (e.kind == "sample_dropped" and e.data["reason"] == "stale")]),
        r,
        tiny_spec,
    )
    assert not [line for line in r.lines() if line.startswith("out of order")], r.lines()


def test_more_redundant_drops_than_declared_are_rejected(honest):
    spec = _mini_spec(honest)
    lines = _drop_reasons(spec, _redundant_trace(spec.workload.group_size, 3, drop_at=3.0, declared=2))
    assert any("dropped 3 episodes as redundant, over the declared 2" in line for line in lines), lines


def test_the_harness_refuses_more_spares_than_declared(tiny_spec):
    from targets.harness.clock import WallClock
    from targets.harness.environments.pool import EnvironmentPool
    from targets.harness.trace import Trace

    pool = EnvironmentPool(tiny_spec.workload, WallClock(), Trace(WallClock()))
    with pytest.raises(ValueError, match="declares redundant_per_group 0"):
        pool.new_group(extra=1)
    pool.max_extra = 2
    assert len(pool.new_group(extra=2)) == tiny_spec.workload.group_size + 2


def test_the_audit_redraws_each_episode_under_the_runs_secret_key(tiny_spec):
    """The pool and the audit draw from the same seed and secret key: each episode's turn count, and on a
    simulated target each turn's tokens (a relaunch's by the task it runs again), is what the pool drew;
    under another key the draws differ, so the audit needs the run's own."""
    from targets.harness.clock import WallClock
    from targets.harness.environments.pool import EnvironmentPool
    from targets.harness.environments.seeds import RunSeed
    from targets.harness.judge.draws import WorkloadDraws
    from targets.harness.sim.response_length import ResponseLengths
    from targets.spec.workload import ResponseLengthSpec

    lengths = ResponseLengthSpec(mean=8, task_sigma=0.8, turn_sigma=0.6)
    tokens = tiny_spec.workload.tokens.model_copy(update={"response_length": lengths})
    spec = tiny_spec.model_copy(update={"workload": tiny_spec.workload.model_copy(update={"tokens": tokens})})
    seed = RunSeed(5, bytes(range(16)))
    pool = EnvironmentPool(spec.workload, WallClock(), Trace(WallClock()), seed=seed, counts=True)
    pool.max_extra = 2
    episodes = [e for _ in range(6) for e in pool.new_group(extra=2)]
    for e in episodes[: spec.workload.group_size + 2]:
        pool.drop(e.episode_id, "stale")
    episodes += pool.new_group(relaunch="g0")
    drawn = ResponseLengths(spec.workload.tokens, seed, pool.task_of)
    draws = WorkloadDraws(spec, seed, {"g6": "g0"}, simulated=True)
    for e in episodes:
        assert draws.turns(e.episode_id) == e.max_turns, e.episode_id
        assert draws.response_tokens(e.episode_id) == sum(drawn.of(e.episode_id, t) for t in range(e.max_turns))
    other = WorkloadDraws(spec, RunSeed(5, bytes(16)), {"g6": "g0"}, simulated=True)
    assert [other.turns(e.episode_id) for e in episodes] != [e.max_turns for e in episodes]
    real = WorkloadDraws(spec, seed, {}, simulated=False)  # a real run's tokens are the model's
    assert real.response_tokens("g0/e0") is None and real.task_tokens_a_turn("g0") is None
    assert real.turns("g0/e0") == episodes[0].max_turns


# -- partial rollout: a finished turn of the honest run split into an interrupted segment and its
# resumption, exactly as a partial-rollout stack would have produced it (same tokens, same logprobs)


# What a turn cut where the run never cut it may be named for besides what a test plants: the requests its
# engine served in order around it, and the planted sync itself (to the version the engine held already,
# and cutting that one request alone)
PLANTED_CUT = ("served out of order: ", "needless interruption: ", "selective interruption: ")


def _resumed(honest, declared: bool = True, keep: int = 5, trained: bool = True):
    """The honest trace with one turn of the last step's batch (``trained``; else of an episode the run
    dropped untrained) resumed after ``keep`` tokens: (events, the interrupted segment, the resuming
    generate)."""
    events = [  # the honest stack restarted its interrupted turns: as if none had decoded anything
        TraceEvent(e.kind, e.t, {k: e.data[k] for k in ("episode", "turn", "start", "aborted", "device")})
        if e.kind == "generate" and e.data["aborted"]
        else e
        for e in _edited(honest)
    ]
    if trained:
        among = {t["episode"] for t in _train(events, -1).data["trajectories"]}
    else:
        among = {e.data["episode"] for e in events if e.kind == "sample_dropped"}
        among -= {t["episode"] for train in events if train.kind == "train" for t in train.data["trajectories"]}
    g = next(e for e in _generates(events) if e.data["episode"] in among and e.data["finish"] == "length")
    d = g.data
    middle = d["start"] + (g.t - d["start"]) / 2
    segment = TraceEvent(
        "generate",
        middle,
        {
            **copy.deepcopy(d),
            "aborted": True,
            "finish": "abort",
            "tokens": d["tokens"][:keep],
            "logprobs": d["logprobs"][:keep],
        },
    )
    d.update(
        start=middle,
        prompt=d["prompt"] + d["tokens"][:keep],
        continues=keep,
        max_new_tokens=d["max_new_tokens"] - keep,
        tokens=d["tokens"][keep:],
        logprobs=d["logprobs"][keep:],
    )
    events.insert(events.index(g), segment)
    # what interrupted it: a sync that cut the running batch short (an abort needs a cause)
    interrupt = {"start": middle - 0.001, "devices": [d["device"]], "version": d["version"], "interrupt": True}
    events.insert(events.index(segment) + 1, TraceEvent("sync", middle + 0.001, interrupt))
    _first(events, "run_start").data["declared"]["partial_rollout"] = declared
    return events, segment, g


def test_a_resumed_turn_that_resumes_what_was_interrupted_passes(honest):
    """Only the rules of the engines' arrival order may speak, and the partial-progress rule never of the
    resumed turn: ``_resumed`` empties every interrupted request of the honest run, and one emptied behind
    a request its engine received later and had already finished (a short turn that stopped early) is
    what that rule rightly names; the order of service names it too where later requests ran long enough
    (service_order.py), and may name the planted segment, cut at a time the run never cut it; so may the
    interruption rules name the planted sync (to the version its engine held, perhaps leaving other requests
    running)."""
    events, segment, _ = _resumed(honest)
    result = _audit(honest, events)
    at = f"episode {segment.data['episode']} turn {segment.data['turn']} "
    assert all(r.startswith((*PLANTED_CUT, "empty partial: ")) for r in result.reasons), result.reasons
    assert not any(r.startswith("empty partial: ") and at in r for r in result.reasons), result.reasons
    stripped = sum(1 for e in honest[1] if e.kind == "generate" and e.data["aborted"] and e.data.get("tokens"))
    assert result.details["replayed_turns"] == _audit(honest).details["replayed_turns"] - stripped + 1  # the segment


@pytest.mark.parametrize("seeds", [(None, None), (7, 7), (7, 8)], ids=["unseeded", "one seed", "reseeded"])
def test_a_restart_that_repeats_its_interrupted_attempt(honest, seeds):
    """A turn generated anew after an interruption (partial rollout not declared) is a draw apart from its
    interrupted attempt, and the independence test now guesses it from that attempt: only the response a
    segment continues is not its own source. A cluster that hands the restart the attempt's tokens again
    (keeping the attempts it likes, resampling the rest) was never guessed from its own episode and passed.
    The honest run's restarts raise nothing (``test_the_honest_run_passes``). A stack's own seed for the
    turn draws the attempt's noise again (a red team's false alarm): a seeded turn's segments are one line,
    and a turn's segments must share their seed (a new one for the attempts it dislikes would choose).
    The planted interruption is the test's, not the stack's: the rules of arrival order and of whole cuts may
    name it, as in ``test_a_resumed_turn_that_resumes_what_was_interrupted_passes``."""
    events = _edited(honest)
    g = max(_generates(events), key=lambda e: len(e.data["tokens"]))
    d, keep = g.data, 12
    middle = d["start"] + (g.t - d["start"]) / 2
    attempt = {**copy.deepcopy(d), "aborted": True, "finish": "abort"}
    attempt.update(tokens=d["tokens"][:keep], logprobs=d["logprobs"][:keep])
    events.insert(events.index(g), TraceEvent("generate", middle, attempt))
    interrupt = {"start": middle - 0.001, "devices": [d["device"]], "version": d["version"], "interrupt": True}
    events.insert(events.index(g), TraceEvent("sync", middle + 0.001, interrupt))
    d["start"] = middle + 0.002
    attempt["seed"], d["seed"] = seeds
    assert not _first(events, "run_start").data["declared"].get("partial_rollout")
    result = _audit(honest, events)
    if seeds == (7, 7):  # the planted cut, at a time the run never cut, may be named for itself (PLANTED_CUT)
        assert all(r.startswith(PLANTED_CUT) for r in result.reasons), result.reasons
    else:
        _rejects(result, "independent samples" if seeds[0] is None else "reseeded turn: ")


def test_a_partial_resumed_twice_in_an_episode_never_trained(honest):
    """A red team's junk branches: a spare that decodes the copy a token a segment, and before each real
    segment forwards a junk one resuming the same partial, cut at once; the junk, first to draw after
    each context, took the independence test's guesses, and the spare was dropped as redundant. Only
    trained episodes were held to partial rollout's rules; every episode's turn now is one chain."""
    events, segment, g = _resumed(honest, trained=False)
    episode = g.data["episode"]
    d = g.data  # the branch: the real segment's first token, a segment of its own (the rule is the shape's)
    branch = {**copy.deepcopy(d), "aborted": True, "finish": "abort", "tokens": d["tokens"][:1]}
    branch["logprobs"], end = d["logprobs"][:1], d["start"] + (g.t - d["start"]) / 2
    d["start"] = end + 0.002
    events.insert(events.index(g), TraceEvent("generate", end, branch))
    interrupt = {"start": end - 0.001, "devices": [d["device"]], "version": d["version"], "interrupt": True}
    events.insert(events.index(g), TraceEvent("sync", end + 0.001, interrupt))
    result = _audit(honest, events)  # beside the rules of arrival order the resumed turn may meet (above)
    allowed = (*PLANTED_CUT, "discarded partial: ", "empty partial: ")
    assert all(r.startswith(allowed) for r in result.reasons), result.reasons
    _rejects(result, f"discarded partial: episode {episode} turn {d['turn']}")


def test_resuming_without_declaring_partial_rollout(honest):
    events, _, _ = _resumed(honest, declared=False)
    _rejects(_invariants(honest, events), "undeclared continuation")


def test_a_turn_cut_thousands_of_times_is_read_whole_without_recursion():
    """A response is its segments' tokens, each segment finding the one it resumes: that lookup recursed a
    level a segment, and a turn cut ~330 times (a token a segment, as a copier hiding its runs might) ended
    the audit in a RecursionError. The segments are now answered in the order they ended
    (benchmarks/cut_chain_cost.py measures the cost)."""
    from targets.harness.judge.trace_index import TraceIndex

    cuts, prompt = 3000, [1, 2, 3]
    tokens = [4 + i % 7 for i in range(cuts)]
    events = [
        TraceEvent(
            "generate",
            float(i + 1),
            {
                "episode": "g0/e0",
                "turn": 0,
                "start": float(i),
                "aborted": i < cuts - 1,
                "prompt": prompt + tokens[:i],
                "continues": i,
                "tokens": tokens[i : i + 1],
                "logprobs": [-1.0],
                "version": 0,
            },
        )
        for i in range(cuts)
    ]
    ix = TraceIndex.of(events)
    whole = ix.response(events[-1])
    assert whole.tokens == tokens and whole.segments == events and whole.chained
    # each keeps the response it resumes, not a copy of its segments (P^2/2 of them, ~40 GB at P = 100K)
    assert whole.resumes is ix.response(events[-2]) and whole.first is events[0]


@pytest.mark.parametrize("fault", ["unknown episode", "turn out of place", "bad continuation"])
def test_a_request_cut_at_once_in_a_turn_its_episode_never_was_at_is_named(honest, fault):
    """A red team's decoys: an interrupted request in another episode's name (the next turn of one that had
    ended), its prompt that episode's context plus a copy's last tokens claimed as its response so far, cut
    at once: the independence test took its contexts, and only turns an environment stepped were held to
    their episode's place. Every request now is: its episode one the harness created, its turn the one the
    episode was at when it was forwarded, its carried tokens what its turn's segments drew."""
    events = _edited(honest)
    ended = next(e for e in events if e.kind == "env_step" and e.data["done"])
    episode, turns = (
        ended.data["episode"],
        sum(e.kind == "env_step" and e.data["episode"] == ended.data["episode"] for e in events),
    )
    last = max((g for g in _generates(events) if g.data["episode"] == episode), key=lambda g: g.data["turn"])
    decoy = copy.deepcopy(last.data)
    decoy.update(aborted=True, finish="abort", tokens=decoy["tokens"][:1], logprobs=decoy["logprobs"][:1])
    if fault == "unknown episode":
        decoy.update(episode="g999/e0", start=last.data["start"])
    elif fault == "turn out of place":
        decoy.update(turn=turns, start=ended.t + 0.001)
    else:  # its own turn, resuming tokens none of the turn's segments drew
        decoy.update(start=last.data["start"], prompt=decoy["prompt"] + [decoy["tokens"][0]] * 3, continues=3)
        decoy["max_new_tokens"] -= 3
    at = max(decoy["start"] + 0.0005, last.data["start"] + 0.0005)
    events.insert(next(k for k, e in enumerate(events) if e.t > at), TraceEvent("generate", at, decoy))
    _rejects(_invariants(honest, events), f"{fault}: ")


def test_a_request_for_a_turn_its_episode_had_played_is_named(honest):
    """The decoys' other place: a past turn asked again (its prompt, its first token) while the episode is
    further on, cut at once, would plant its context for the independence test a second time."""
    events = _edited(honest)
    step = next(e for e in events if e.kind == "env_step" and not e.data["done"])  # an episode past turn 0
    episode = step.data["episode"]
    first = next(g for g in _generates(events) if g.data["episode"] == episode and g.data["turn"] == 0)
    at = step.t + 0.001
    at_turn = sum(e.kind == "env_step" and e.data["episode"] == episode and e.t <= at for e in events)
    decoy = copy.deepcopy(first.data)
    decoy.update(aborted=True, finish="abort", tokens=decoy["tokens"][:1], logprobs=decoy["logprobs"][:1], start=at)
    events.insert(next(k for k, e in enumerate(events) if e.t > at), TraceEvent("generate", at, decoy))
    _rejects(
        _invariants(honest, events),
        f"turn out of place: episode {episode} turn 0: forwarded at {at:.2f}s, when the episode was at turn {at_turn}",
    )


@pytest.mark.parametrize("when", ["had not been reset", "was dropped"])
def test_a_request_for_an_episode_not_in_play_is_named(honest, when):
    """A red team's orphans: requests in the name of an episode the stack had dropped, or had not reset yet,
    cut at once. Their turn is one the episode never played, so no environment checks them; each request
    is now held to an episode in play when it was forwarded."""
    events = _edited(honest)
    if when == "was dropped":
        mark = next(e for e in events if e.kind == "sample_dropped")
        at = mark.t + 0.001  # forwarded after it was dropped (a short run's drops come at its end)
    else:
        mark = next(e for e in events if e.kind == "env_reset" and e.t > events[0].t + 0.01)
        at = mark.t - 0.001
    episode = mark.data["episode"]
    turn = sum(e.kind == "env_step" and e.data["episode"] == episode and e.t <= at for e in events)
    orphan = copy.deepcopy(next(g for g in _generates(events) if g.data["turn"] == 0).data)
    orphan.update(episode=episode, turn=turn, start=at, aborted=True, finish="abort", tokens=[], logprobs=[])
    events.insert(next((k for k, e in enumerate(events) if e.t > at), len(events)), TraceEvent("generate", at, orphan))
    _rejects(
        _audit(honest, events),
        f"turn out of place: episode {episode} turn {turn}: forwarded at {at:.2f}s, when the episode {when}",
    )


def test_two_segments_cut_at_one_instant_do_not_resume_each_other():
    """Two empty segments of a turn, each started and ended at one instant (a red team's): each was a
    candidate for the segment the other resumes, and reading the response recursed without end. Of two at
    one instant, only the one the trace holds first may be resumed."""
    from targets.harness.judge.trace_index import TraceIndex

    def served(t: float, start: float, continues: int, tokens: list[int], aborted: bool = True) -> TraceEvent:
        data = {"episode": "g0/e0", "turn": 0, "start": start, "aborted": aborted, "version": 0}
        data.update(prompt=[9, 5][: 1 + continues], continues=continues, tokens=tokens, logprobs=[0.0] * len(tokens))
        return TraceEvent("generate", t, data)

    events = [
        served(1.0, 0.0, 0, [5]),
        served(2.0, 2.0, 1, []),
        served(2.0, 2.0, 1, []),
        served(3.0, 2.5, 1, [6], False),
    ]
    whole = TraceIndex.of(events).response(events[-1])
    assert whole.tokens == [5, 6] and whole.chained and whole.segments[0] is events[0]


def test_resuming_from_tokens_no_interrupted_segment_produced(honest):
    events, segment, _ = _resumed(honest)
    vocab = honest[0].model.config.vocab_size
    segment.data["tokens"] = [(t + 1) % vocab for t in segment.data["tokens"]]  # not the prefix it resumed
    _rejects(_audit(honest, events), "bad continuation")


@pytest.mark.parametrize("past_the_end", [True, False], ids=["one past the last id", "negative id"])
def test_an_engine_returning_a_token_outside_the_vocabulary(honest, past_the_end):
    """Judged by a clean reason, not by the replay crashing on an id no embedding has."""
    events = _edited(honest)
    g = next(e for e in _generates(events) if e.data["tokens"])
    g.data["tokens"][0] = honest[0].model.config.vocab_size if past_the_end else -1
    result = _audit(honest, events)
    _rejects(result, "token outside the vocabulary")
    assert "replayed_turns" not in result.details and "outside the vocabulary" in result.details["skipped"]


def test_a_trained_token_outside_the_vocabulary(honest):
    # the generates are clean: only the training step's own tokens name it
    events = _edited(honest)
    t = _train(events).data["trajectories"][0]
    t["tokens"][-1] = honest[0].model.config.vocab_size
    _rejects(_invariants(honest, events), f"token outside the vocabulary: training step 1 (episode {t['episode']})")


@pytest.mark.parametrize("where", ["generate", "trained"])
def test_a_sequence_longer_than_the_target_allows_is_named_and_not_replayed(honest, where):
    """Planted (a review of the judge): the cluster answers a turn with far more tokens than any context holds,
    or the controller trains a trajectory that long. The replay held every position's logits of it (a hundred
    thousand tokens of a 150k vocabulary is 60 GB): its crash was blamed on the harness, and the search
    stopped. Such a record is now a reason and nothing is replayed; here one past the bound (twice
    ``max_sequence`` for a trained trajectory, its last context and the environment's last answer)."""
    events = _edited(honest)
    longest = honest[0].workload.tokens.max_sequence
    if where == "generate":
        g = next(e for e in _generates(events) if e.data["tokens"])
        g.data["tokens"] += [g.data["tokens"][0]] * (longest + 1 - len(g.data["prompt"]) - len(g.data["tokens"]))
        said = f"sequence too long: generate (episode {g.data['episode']} turn {g.data['turn']}): {longest + 1} tokens"
    else:
        t = _train(events).data["trajectories"][0]
        t["tokens"] += [t["tokens"][0]] * (2 * longest + 1 - len(t["tokens"]))
        said = f"sequence too long: training step 1 (episode {t['episode']}): {2 * longest + 1} tokens"
    result = _audit(honest, events)
    _rejects(result, said)
    assert "replayed_turns" not in result.details and "sequences over the target's" in result.details["skipped"]


def test_an_interrupted_segment_that_went_on_past_a_stop_token(honest):
    events, segment, _ = _resumed(honest)
    segment.data["tokens"][0] = segment.data["stop"][0]  # a segment that stopped is a finished turn, not a partial
    _rejects(_invariants(honest, events), "an interrupted segment went on past a stop token or its budget")


def test_a_resumed_turn_over_the_response_budget(honest):
    events, _, resumed = _resumed(honest)
    resumed.data["max_new_tokens"] += resumed.data["continues"]  # the whole budget again, on top of the partial
    _rejects(_invariants(honest, events), "sampling parameters")


def test_an_interrupted_segment_beyond_the_staleness_bound(honest):
    events, segment, _ = _resumed(honest)
    segment.data["version"] = 0  # its first tokens from a policy the last step may not train on
    _rejects(_invariants(honest, events), "stale sample")


def test_a_partial_discarded_and_the_turn_generated_anew(honest):
    """The cherry-pick partial rollout would allow: an interrupted segment thrown away, the turn
    sampled again from its start, by a stack that declares it resumes partials."""
    events, segment, resumed = _resumed(honest)
    discarded = TraceEvent("generate", segment.t, {**copy.deepcopy(segment.data), "tokens": segment.data["tokens"][:3]})
    discarded.data["logprobs"] = discarded.data["logprobs"][:3]
    events.insert(events.index(segment), discarded)
    _rejects(_invariants(honest, events), "discarded partial")


# -- tail batching: deferral is postponement, never selection -------------------------------------------


def _deferral_trace(
    group_size: int,
    finished: int = 0,
    deferred: int | None = None,
    tail_round: int = 1,
    relaunched: bool = True,
    defer_the_relaunch: bool = False,
    waited: bool = True,
) -> list[TraceEvent]:
    """Group g0: launched at t=0, a batch taken at t=1 (``waited``), ``finished`` members finish at t=2,
    ``deferred`` of them (default all) are dropped as ``deferred`` at t=3; g1 relaunches g0's task at
    t=3.5 (``relaunched``) and finishes at t=5 (or is itself deferred at t=4.5)."""
    members = [f"g0/e{m}" for m in range(group_size)]
    again = [f"g1/e{m}" for m in range(group_size)]
    deferred = group_size if deferred is None else deferred
    declared = {"tail_round": tail_round}
    events = [
        _simulated_start(1, declared),
    ]
    events += [TraceEvent("episode_created", 0.0, {"episode": m, "group": "g0"}) for m in members]
    if waited:  # a batch taken while g0 ran: it waited through a whole step
        events.append(
            TraceEvent(
                "train",
                1.5,
                {"start": 1.0, "step": 1, "version": 1, "devices": [], "advantages": [], "trajectories": []},
            )
        )
    events += [
        TraceEvent("env_step", 2.0, {"episode": m, "action": 2, "observation": 2, "done": True})
        for m in members[:finished]
    ]
    events += [TraceEvent("sample_dropped", 3.0, {"episode": m, "reason": "deferred"}) for m in members[:deferred]]
    events += [TraceEvent("sample_dropped", 3.0, {"episode": m, "reason": "end_of_run"}) for m in members[deferred:]]
    if relaunched:
        events += [TraceEvent("episode_created", 3.5, {"episode": m, "group": "g1", "relaunch": "g0"}) for m in again]
        reason = "deferred" if defer_the_relaunch else "end_of_run"
        events += [TraceEvent("sample_dropped", 4.5, {"episode": m, "reason": reason}) for m in again]
    events.append(TraceEvent("run_end", 10.0))
    return events


def _deferral_reasons(spec, events):
    from targets.harness.judge.selection import check_deferrals, check_drop_reasons
    from targets.harness.judge.trace_index import Reasons, TraceIndex

    r = Reasons()
    ix = TraceIndex.of(events)
    check_drop_reasons(ix, r, spec)
    check_deferrals(ix, r)
    return r.lines()


def test_an_unfinished_group_deferred_whole_and_relaunched_passes(honest):
    spec = _mini_spec(honest)
    events = _deferral_trace(spec.workload.group_size, finished=1)
    last = {"start": 4.0, "step": 2, "version": 2, "devices": [], "advantages": [], "trajectories": []}
    events.insert(-1, TraceEvent("train", 4.4, last))  # the relaunch ran while this step trained
    assert _deferral_reasons(spec, events) == []


def test_a_relaunch_made_after_the_last_training_step_does_not_count_as_running_the_task(honest):
    """Planted: defer the slow group, and once training is over relaunch its task and drop it at once
    as end_of_run: the task never ran again, and the tail was never paid for."""
    spec = _mini_spec(honest)
    train = TraceEvent(
        "train", 3.2, {"start": 3.1, "step": 1, "version": 1, "devices": [], "advantages": [], "trajectories": []}
    )
    events = _deferral_trace(spec.workload.group_size, finished=1)
    events.insert(-1, train)
    lines = _deferral_reasons(spec, events)
    assert any("1 deferred groups' tasks never ran again (e.g. g0)" in line for line in lines), lines
    # the same relaunch made while training still ran passes
    events[-2] = TraceEvent("train", 4.0, {**train.data, "start": 3.9})
    assert _deferral_reasons(spec, events) == []


def test_deferring_a_group_that_did_not_wait_through_a_whole_step(honest):
    """Planted: deferring a group launched since the last batch was taken: on a real run its relaunch
    redraws the episodes, so early deferral resamples the long ones (2.55 turns per trained episode
    against 2.94 in the judge issue's run)."""
    spec = _mini_spec(honest)
    lines = _deferral_reasons(spec, _deferral_trace(spec.workload.group_size, finished=1, waited=False))
    assert any("only a group that waited through a whole step may be deferred" in line for line in lines), lines

    # a group launched the instant its batch was taken waited through that step (a simulated static split
    # refills as the last group finishes and takes the batch at that instant: the judge rejected it); one
    # launched once the step's training had begun did not
    def launched_at(t):  # g0 launched at t, the batch taken at 1.0; its relaunch trained at 4.0
        trace = _deferral_trace(spec.workload.group_size, finished=1)
        last = {"start": 4.0, "step": 2, "version": 2, "devices": [], "advantages": [], "trajectories": []}
        trace.insert(-1, TraceEvent("train", 4.4, last))
        return [TraceEvent(e.kind, t, e.data) if e.kind == "episode_created" and e.t == 0.0 else e for e in trace]

    assert _deferral_reasons(spec, launched_at(1.0)) == []
    lines = _deferral_reasons(spec, launched_at(1.001))
    assert any("only a group that waited through a whole step may be deferred" in line for line in lines), lines


def test_deferring_without_declaring_tail_batching(honest):
    spec = _mini_spec(honest)
    lines = _deferral_reasons(spec, _deferral_trace(spec.workload.group_size, tail_round=0))
    assert any("declares no tail_round" in line for line in lines), lines


def test_deferring_a_group_that_had_finished(honest):
    """Planted: 'deferred' used to throw away a finished group the stack did not want to train."""
    spec = _mini_spec(honest)
    size = spec.workload.group_size
    lines = _deferral_reasons(spec, _deferral_trace(size, finished=size))
    assert any(f"had {size} finished members: only an unfinished group may be deferred" in line for line in lines), (
        lines
    )


def test_deferring_part_of_a_group(honest):
    spec = _mini_spec(honest)
    lines = _deferral_reasons(spec, _deferral_trace(spec.workload.group_size, deferred=1))
    assert any("was deferred in part" in line for line in lines), lines


def test_deferring_a_relaunched_group_again(honest):
    """Planted: a task deferred over and over is a task never trained."""
    spec = _mini_spec(honest)
    lines = _deferral_reasons(spec, _deferral_trace(spec.workload.group_size, defer_the_relaunch=True))
    assert any("was itself a relaunch" in line for line in lines), lines


def test_deferred_tasks_that_never_run_again(honest):
    """Planted: tasks deferred and dropped for good; tail_round 1 leaves none waiting at the end."""
    spec = _mini_spec(honest)
    lines = _deferral_reasons(spec, _deferral_trace(spec.workload.group_size, relaunched=False))
    assert any("deferred groups' tasks never ran again" in line for line in lines), lines
    assert _deferral_reasons(spec, _deferral_trace(spec.workload.group_size, relaunched=False, tail_round=2)) == []
    # deferred in the last step, nothing launched after: no relaunch could have been trained
    steps = [TraceEvent("train", t, {"start": t - 0.5, "trajectories": []}) for t in (1.0, 2.5, 4.0)]
    late = _deferral_trace(spec.workload.group_size, relaunched=False)
    assert _deferral_reasons(spec, late[:1] + steps + late[1:]) == []
    early = [TraceEvent("train", t, {"start": t - 0.5, "trajectories": []}) for t in (1.0, 4.0, 5.0)]
    lines = _deferral_reasons(spec, late[:1] + early + late[1:])
    assert any("deferred groups' tasks never ran again" in line for line in lines), lines


def test_the_harness_relaunches_only_a_deferred_group_and_only_once(tiny_spec):
    from targets.harness.clock import WallClock
    from targets.harness.environments.pool import EnvironmentPool
    from targets.harness.trace import Trace

    pool = EnvironmentPool(tiny_spec.workload, WallClock(), Trace(WallClock()))
    first = pool.new_group()
    with pytest.raises(ValueError, match="never deferred or dropped as stale"):
        pool.new_group(relaunch="g0")
    with pytest.raises(ValueError, match="no group of that name was created"):
        pool.drop("g7/e0", "deferred")  # a group the pool never made cannot be handed back, nor relaunched
    pool.drop(first[0].episode_id, "deferred")
    with pytest.raises(ValueError, match=f"not handed back whole \\({first[1].episode_id} is not dropped\\)"):
        pool.new_group(relaunch="g0")  # its other members still run: two draws of the task at once
    for episode in first[1:]:
        pool.drop(episode.episode_id, "deferred")
    again = pool.new_group(relaunch="g0")
    assert pool.task_of(again[0].episode_id) == pool.task_of(first[0].episode_id) == "g0"
    assert again[0].group_id == "g1" and again[0].task is not first[0].task  # new episodes, of the same task:
    assert [again[0].symbols(turn) for turn in range(5)] == [first[0].symbols(turn) for turn in range(5)]
    with pytest.raises(ValueError, match="already relaunched"):
        pool.new_group(relaunch="g0")


def test_the_harness_relaunches_a_stale_groups_task_once_and_never_a_relaunch(tiny_spec):
    """A stale drop may postpone its task as a deferral does (the long tasks go stale); a relaunch that
    goes stale in turn is not run a third time."""
    from targets.harness.clock import WallClock
    from targets.harness.environments.pool import EnvironmentPool
    from targets.harness.trace import Trace

    pool = EnvironmentPool(tiny_spec.workload, WallClock(), Trace(WallClock()))
    first = pool.new_group()
    for episode in first:
        pool.drop(episode.episode_id, "stale")
    again = pool.new_group(relaunch="g0")
    assert pool.task_of(again[0].episode_id) == "g0"
    for episode in again:
        pool.drop(episode.episode_id, "stale")
    with pytest.raises(ValueError, match="itself a relaunch"):
        pool.new_group(relaunch=again[0].group_id)
    with pytest.raises(ValueError, match="already relaunched"):
        pool.new_group(relaunch="g0")


# -- plants for the checks no run above exercises ----------------------------------------------------------


def test_a_trajectory_filed_under_another_group_of_its_batch(honest):
    """Planted: one trajectory labelled with another group of the batch (the counts per group still
    hold, by the harness's own record of the groups): its advantage is that group's."""
    events = _edited(honest)
    trajectories = _train(events).data["trajectories"]
    first = trajectories[0]
    other = next(t["group"] for t in trajectories if t["group"] != first["group"])
    first["group"] = other
    _rejects(_invariants(honest, events), f"files episode {first['episode']} under group {other}")


def _selection_reasons(
    spec,
    trained: list[str],
    rewards: dict[str, float],
    turns: dict[str, int],
    dropped: str | dict[str, str],
    finished: bool = True,
    declared: dict | None = None,
    verdicts: dict[str, float] | None = None,
    drawn: dict[str, float | None] | None = None,
    drawn_turns: dict[str, float] | None = None,
    drawn_episodes: dict[str, float] | None = None,
    held: dict[str, tuple[float, ...]] | None = None,
    answered_s: float | None = None,
    extra: tuple[TraceEvent, ...] = (),
) -> list[str]:
    """Check ``check_selection`` alone on episodes named ``g<k>/e<m>`` (group k), each run for the given
    turns (to its end if ``finished``, else still running when dropped) with the given reward: ``trained``
    train, the others are dropped for ``dropped`` (one reason, or each episode's); the stack declares
    ``declared``. With ``verdicts`` the target has a reward model, whose score of each episode named there
    comes at its end. ``drawn``: each task's tokens a turn by the harness's own draw (a simulated run's);
    ``drawn_turns``, ``drawn_episodes``: each episode's turns and tokens by it (any given: the net reads
    the draws; absent, not drawn). ``held``: the seconds each dropped episode named there sat unfinished with
    nothing under way while others generated, the seconds any request was under way in its life and (if given)
    how long its own request had been under way, as the controller link records them at the drop.
    ``answered_s``: the first trained episode's one answered request took that long. ``extra``: more events."""
    from targets.harness.judge.selection_net import check_selection
    from targets.harness.judge.trace_index import Reasons, TraceIndex

    events = [_simulated_start(1, declared or {})]
    events += [TraceEvent("episode_created", 0.0, {"episode": e, "group": e.split("/")[0]}) for e in rewards]
    events += [TraceEvent("env_reset", 0.5, {"episode": e, "observation": 2}) for e in rewards if turns[e]]
    for episode, reward in rewards.items():
        for turn in range(turns[episode]):
            last = turn == turns[episode] - 1 and (finished or episode in trained)
            step = {"episode": episode, "action": 2, "observation": 2, "done": last, "reward": reward if last else 0.0}
            events.append(TraceEvent("env_step", 1.0 + turn, {**step, "timed_out": False, "lost": False}))
            if last and episode in (verdicts or {}):
                events.append(TraceEvent("reward", 1.5 + turn, {"episode": episode, "score": verdicts[episode]}))
    batch = [{"episode": e, "group": e.split("/")[0], "reward": rewards[e]} for e in trained]
    events.append(TraceEvent("train", 6.0, {"start": 5.5, "step": 1, "version": 1, "trajectories": batch}))
    events += [
        TraceEvent(
            "sample_dropped",
            5.0,
            {"episode": e, "reason": dropped if isinstance(dropped, str) else dropped[e]}
            | (dict(zip(("held_s", "serving_s", "waiting_s"), held[e], strict=False)) if e in (held or {}) else {}),
        )
        for e in rewards
        if e not in trained
    ]
    if answered_s is not None:
        served = {"episode": trained[0], "start": 1.0 - answered_s, "aborted": False, "device": "d:0"}
        events.append(TraceEvent("generate", 1.0, served))
    events += extra
    events.append(TraceEvent("run_end", 7.0))
    events.sort(key=lambda e: e.t)
    r = Reasons()
    planted = (drawn, drawn_turns, drawn_episodes)
    draws = (
        None if planted == (None, None, None) else PlantedDraws(drawn or {}, drawn_turns or {}, drawn_episodes or {})
    )
    check_selection(TraceIndex.of(events, judged=verdicts is not None), r, spec, draws)
    return r.lines()


@dataclass
class PlantedDraws:
    """What the harness drew, as a test plants it: tasks' tokens a turn (None: a real run's), episodes'
    turns and tokens (absent: not drawn)."""

    tasks: dict[str, float | None]
    turn_counts: dict[str, float]
    episodes: dict[str, float]

    def task_tokens_a_turn(self, task: str) -> float | None:
        return self.tasks.get(task)

    def turns(self, episode: str) -> float | None:
        return self.turn_counts.get(episode)

    def response_tokens(self, episode: str) -> float | None:
        return self.episodes.get(episode)


def test_tasks_cut_short_and_left_untrained_are_judged_by_their_own_draws(tiny_spec):
    """Planted on a simulated run: the stack lets every task run one turn, holds back the ten whose
    first turn was long until they go stale, and trains the ten short ones. At their progress the
    dropped tasks look as short as the trained (one turn each), so the net by progress passes it; by
    the harness's own draw of each task's length it trains tasks 40% shorter than it launched. The same
    trace training ten tasks chosen by nothing passes."""
    episodes = [f"g{k}/e{m}" for k in range(20) for m in range(2)]
    long_tasks = {f"g{k}" for k in range(0, 20, 2)}
    drawn = {f"g{k}": 14.0 if f"g{k}" in long_tasks else 6.0 for k in range(20)}
    short = [e for e in episodes if e.split("/")[0] not in long_tasks]
    same = dict.fromkeys(episodes, 1)
    rewards = dict.fromkeys(episodes, 1.0)
    assert _selection_reasons(tiny_spec, short, rewards, same, "stale", finished=False) == []
    lines = _selection_reasons(tiny_spec, short, rewards, same, "stale", finished=False, drawn=drawn)
    assert any("20 launched" in x and "40% shorter in drawn tokens a turn" in x for x in lines), lines
    mixed = [e for e in episodes if int(e.split("/")[0][1:]) < 10]
    assert _selection_reasons(tiny_spec, mixed, rewards, same, "stale", finished=False, drawn=drawn) == []


def test_tasks_held_back_for_the_turns_their_members_drew_are_judged_by_those_draws(tiny_spec):
    """Planted on a real run (the tokens are the model's; only the turns are drawn): the stack learns how
    many turns each member drew (the reward's scale tells it), lets every task run one turn, holds back
    the ten whose members drew many until they go stale, and trains the ten others. At their progress the
    held-back look as short as the trained, so the net by progress passes it; by the turns the harness drew
    for their members it trains tasks 40% shorter than it launched. By drawn response tokens (a simulated
    run's) too. Training ten tasks chosen by nothing passes."""
    episodes = [f"g{k}/e{m}" for k in range(20) for m in range(2)]
    held = {f"g{k}" for k in range(0, 20, 2)}
    drawn_turns = {e: 14.0 if e.split("/")[0] in held else 6.0 for e in episodes}
    trained = [e for e in episodes if e.split("/")[0] not in held]
    same = dict.fromkeys(episodes, 1)
    rewards = dict.fromkeys(episodes, 1.0)
    real = dict.fromkeys({e.split("/")[0] for e in episodes})

    def reasons(chosen: list[str], tokens: dict[str, float] | None = None) -> list[str]:
        return _selection_reasons(
            tiny_spec, chosen, rewards, same, "stale", False, None, None, real, drawn_turns, tokens
        )

    assert _selection_reasons(tiny_spec, trained, rewards, same, "stale", finished=False) == []
    lines = reasons(trained)
    assert len(lines) == 1 and "tasks trained are 40% shorter in drawn turns than the 20 launched" in lines[0], lines
    tokens = {e: 10 * turns for e, turns in drawn_turns.items()}
    assert any("40% shorter in drawn response tokens than the 20 launched" in x for x in reasons(trained, tokens))
    mixed = [e for e in episodes if int(e.split("/")[0][1:]) < 10]
    assert reasons(mixed) == [] and reasons(mixed, tokens) == []
    # split: each held task hands back as stale only its member that drew fewest turns (6) and holds the other
    # (22) to the run's end; a task goes whole, so it is judged by both, not at its shortest member
    split_turns = {e: 22.0 if e.split("/")[0] in held and e.endswith("e1") else 6.0 for e in episodes}
    split = {e: "end_of_run" if e.endswith("e1") else "stale" for e in episodes}
    lines = _selection_reasons(tiny_spec, trained, rewards, same, split, False, None, None, real, split_turns)
    assert len(lines) == 1 and "tasks trained are 40% shorter in drawn turns" in lines[0], lines


def test_complete_groups_held_to_the_end_of_the_run_are_judged_as_passed_over(tiny_spec):
    """Planted: of twenty tasks (groups of four, the target's) the ten long ones finished before the batch
    was taken, and the stack trained the ten short ones and held the long ones in its buffer until the run
    ended, handing them back as ``end_of_run``. The run's end did not leave them untrained, the stack did:
    they count, and the tasks trained are a third shorter than launched. The same groups still running at
    the end are set aside (nothing could have trained them)."""
    episodes = [f"g{k}/e{m}" for k in range(20) for m in range(4)]
    held = {f"g{k}" for k in range(0, 20, 2)}
    turns = {e: 4 if e.split("/")[0] in held else 2 for e in episodes}
    trained = [e for e in episodes if e.split("/")[0] not in held]
    rewards = dict.fromkeys(episodes, 1.0)
    lines = _selection_reasons(tiny_spec, trained, rewards, turns, "end_of_run", finished=True)
    assert any("tasks trained are 33% shorter in turns than the 20 launched" in x for x in lines), lines
    assert _selection_reasons(tiny_spec, trained, rewards, turns, "end_of_run", finished=False) == []


def _held_tasks_reasons(
    spec,
    held: tuple[float, ...],
    answered_s: float | None = None,
    started: bool = True,
    probed: bool = False,
    extra: tuple[TraceEvent, ...] = (),
):
    """The plant of the two tests below: of twenty tasks (groups of four) the stack runs a turn of each, keeps
    back the ten whose members drew six turns (a reward's scale can tell) and hands them back, unfinished, at
    the run's end, each drop recording ``held`` (held_s, serving_s and perhaps waiting_s); it trains the ten
    that drew two. ``started`` False: the ten never reset instead; ``probed``: of each of the ten only the
    first member ran (its turn told the task's length: never held, 0 s idle), the others never reset."""
    episodes = [f"g{k}/e{m}" for k in range(20) for m in range(4)]
    trained = [e for e in episodes if int(e.split("/")[0][1:]) % 2]
    turns = {e: 2 if e in trained else int(started or (probed and e.endswith("/e0"))) for e in episodes}
    idle = {e: (0.0, *held[1:]) if probed and e.endswith("/e0") else held for e in episodes}
    drawn_turns = {e: 2.0 if e in trained else 6.0 for e in episodes}
    return _selection_reasons(
        spec,
        trained,
        dict.fromkeys(episodes, 1.0),
        turns,
        "end_of_run",
        False,
        drawn_turns=drawn_turns,
        held={e: idle[e] for e in episodes if e not in trained},
        answered_s=answered_s,
        extra=extra,
    )


HELD_AND_REJECTED = "tasks trained are 50% shorter in drawn turns than the 20 launched"


def test_groups_a_stack_stopped_stepping_and_held_to_the_end_are_judged_as_held(tiny_spec):
    """Planted (``_held_tasks_reasons``): nothing the run's end did left the ten long tasks untrained. The
    harness counted each member sitting 4 s of the 5 s the engines served in its life with nothing under way,
    so they count, 50% shorter by drawn turns than launched; so do members held 6 s of 100 (over 5%). The same
    groups cut off mid-turn by the end are set aside and pass: idle 0.5 s (a loaded machine's turnaround,
    under a second), or 4 s of 100 (under 5%); so are members never started (nothing to hold)."""
    for held in ((4.0, 5.0), (6.0, 100.0)):
        lines = _held_tasks_reasons(tiny_spec, held)
        assert any(HELD_AND_REJECTED in x for x in lines), (held, lines)
    assert _held_tasks_reasons(tiny_spec, (0.5, 5.0)) == []
    assert _held_tasks_reasons(tiny_spec, (4.0, 100.0)) == []
    assert _held_tasks_reasons(tiny_spec, (4.0, 5.0), started=False) == []


def test_members_never_started_beside_a_sibling_that_ran_are_held(tiny_spec):
    """Planted: of each new task the stack starts one member, whose first turn tells the task's length; the
    long tasks' other members it never starts, and hands the groups back at the run's end. A member never
    started is a spare only where the group had its ``group_size`` started without it: these were held (4 s
    of the 5 s the engines served), so the ten long tasks count, 50% shorter by drawn turns than launched."""
    lines = _held_tasks_reasons(tiny_spec, (4.0, 5.0), started=False, probed=True)
    assert any(HELD_AND_REJECTED in x for x in lines), lines
    assert _held_tasks_reasons(tiny_spec, (0.5, 5.0), started=False, probed=True) == []  # held under a second


def test_groups_whose_requests_a_cluster_never_served_are_judged_as_held(tiny_spec):
    """Planted: the stack of the test above keeps its held episodes "under way" instead: its own cluster (a real
    run's) accepts each one's next request and never serves it. Nothing looks idle, but a request under way for
    over twice as long as any the run answered took was held all the same: 4 s where the longest answered took
    1.5 s is counted (50% shorter by drawn turns, rejected), 2.5 s is not, nor is any under a second."""
    lines = _held_tasks_reasons(tiny_spec, (0.0, 5.0, 4.0), answered_s=1.5)
    assert any(HELD_AND_REJECTED in x for x in lines), lines
    assert _held_tasks_reasons(tiny_spec, (0.0, 5.0, 2.5), answered_s=1.5) == []
    assert _held_tasks_reasons(tiny_spec, (0.0, 5.0, 0.9)) == []


def test_a_request_parked_on_a_shrunk_engine_does_not_raise_the_bar_for_held_requests(tiny_spec):
    """Planted beside the test above: one request forwarded to an engine the stack keeps shrunk from 0.1 s
    to 4.8 s, decoded honestly once it wakes (answered at 4.95 s): it took 4.75 s, which set the bar for
    the held requests at twice that, over the 4 s they were held. Its time counts from the engine's wake
    (0.15 s), so the bar stays twice the 1.5 s the longest other request took."""
    parked = (
        TraceEvent("shrink", 0.1, {"start": 0.05, "devices": ["d:1"]}),
        TraceEvent("expand", 4.9, {"start": 4.8, "devices": ["d:1"]}),
        TraceEvent("generate", 4.95, {"episode": "g1/e1", "start": 0.2, "aborted": False, "device": "d:1"}),
    )
    lines = _held_tasks_reasons(tiny_spec, (0.0, 5.0, 4.0), answered_s=1.5, extra=parked)
    assert any(HELD_AND_REJECTED in x for x in lines), lines


def test_spares_cancelled_early_are_judged_by_their_own_draws(tiny_spec):
    """Planted: each group of 8 runs 4 spares, trains the 8 members that finish in 3 turns and cancels the
    4 whose draws are long after 1 turn each. At their progress the cancelled look shorter than the
    trained, so the net by progress passes it; by the turns the harness drew for each member (a real
    run's draws) and by their tokens over them (a simulated run's), the trained are 50% shorter than their
    groups, over the 31% four spares may choose. The same trace passes where the cancelled drew what the
    trained did (spares that finish last by chance)."""
    episodes = [f"g{k}/e{m}" for k in range(4) for m in range(12)]
    trained = [e for e in episodes if int(e.split("/e")[1]) < 8]
    turns = {e: 3 if e in trained else 1 for e in episodes}
    rewards = dict.fromkeys(episodes, 1.0)
    tasks = {f"g{k}": 10.0 for k in range(4)}
    declared = {"redundant_per_group": 4}
    long_turns = {e: 3.0 if e in trained else 12.0 for e in episodes}
    long_spares = {e: 30.0 if e in trained else 120.0 for e in episodes}

    def reasons(drawn: dict, drawn_turns: dict, drawn_episodes: dict | None = None) -> list[str]:
        return _selection_reasons(
            tiny_spec, trained, rewards, turns, "redundant", False, declared, None, drawn, drawn_turns, drawn_episodes
        )

    assert _selection_reasons(tiny_spec, trained, rewards, turns, "redundant", False, declared) == []
    lines = reasons(dict.fromkeys(tasks), long_turns)  # a real run: the tokens are the model's, the turns drawn
    assert len(lines) == 1 and "50% shorter in drawn turns" in lines[0] and "over the 31% allowed" in lines[0]
    lines = reasons(tasks, long_turns, long_spares)
    assert len(lines) == 2 and all("members of their groups" in x for x in lines), lines
    assert any("50% shorter in drawn response tokens" in x and "over the 31% allowed" in x for x in lines), lines
    assert reasons(tasks, dict.fromkeys(episodes, 3.0), dict.fromkeys(episodes, 30.0)) == []


def test_spares_a_trained_group_holds_to_the_end_of_the_run_still_count(tiny_spec):
    """Planted: each group of 8 trains its 8 members that finish in 3 turns and, instead of handing its 4
    spares back, keeps them running until the run ends, where they go back as ``end_of_run``. The net sets
    aside what only the run's end left untrained, but a trained group's members are not that: they were
    passed over. Counted, the trained are 44% shorter at progress than their groups (the spares ran 10
    turns), over the 31% four spares may choose, as the same trace handing them back as ``redundant`` is."""
    episodes = [f"g{k}/e{m}" for k in range(4) for m in range(12)]
    trained = [e for e in episodes if int(e.split("/e")[1]) < 8]
    turns = {e: 3 if e in trained else 10 for e in episodes}
    rewards = dict.fromkeys(episodes, 1.0)
    declared = {"redundant_per_group": 4}
    for reason in ("redundant", "end_of_run"):
        lines = _selection_reasons(tiny_spec, trained, rewards, turns, reason, False, declared)
        assert any("44% shorter in turns" in x and "members of their groups" in x for x in lines), (reason, lines)


def _redrawn_trace(original_turns: int, relaunched: int = 5, plain: int = 0) -> list[TraceEvent]:
    """``relaunched`` tasks, each first run by a group g<k> of two whose members finish after
    ``original_turns`` turns and are handed back as stale at t=4; g<k+5> runs the task again (one turn
    each) and trains. ``plain`` more groups (g<20+k>) run once, one turn each, and train."""
    events = [_simulated_start(1, {})]
    batch = []
    step = {"action": 2, "observation": 2, "done": True, "reward": 1.0, "timed_out": False, "lost": False}
    for k in range(plain):
        members = [f"g{20 + k}/e{m}" for m in range(2)]
        events += [TraceEvent("episode_created", 0.0, {"episode": e, "group": f"g{20 + k}"}) for e in members]
        events += [TraceEvent("env_step", 2.0, {**step, "episode": e}) for e in members]
        batch += [{"episode": e, "group": f"g{20 + k}", "reward": 1.0} for e in members]
    for k in range(relaunched):
        first, again = [f"g{k}/e{m}" for m in range(2)], [f"g{k + 5}/e{m}" for m in range(2)]
        events += [TraceEvent("episode_created", 0.0, {"episode": e, "group": f"g{k}"}) for e in first]
        for e in first:
            for turn in range(original_turns):
                step = {"episode": e, "action": 2, "observation": 2, "done": turn == original_turns - 1}
                events.append(
                    TraceEvent("env_step", 1.0 + turn * 0.5, {**step, "reward": 1.0, "timed_out": False, "lost": False})
                )
        events += [TraceEvent("sample_dropped", 4.0, {"episode": e, "reason": "stale"}) for e in first]
        events += [
            TraceEvent("episode_created", 4.5, {"episode": e, "group": f"g{k + 5}", "relaunch": f"g{k}"}) for e in again
        ]
        step = {"action": 2, "observation": 2, "done": True, "reward": 1.0, "timed_out": False, "lost": False}
        events += [TraceEvent("env_step", 5.0, {**step, "episode": e}) for e in again]
        batch += [{"episode": e, "group": f"g{k + 5}", "reward": 1.0} for e in again]
    events.append(TraceEvent("train", 6.0, {"start": 5.5, "step": 1, "version": 1, "trajectories": batch}))
    events.append(TraceEvent("run_end", 7.0))
    return events


def test_a_task_run_again_is_judged_with_the_members_it_drew_first(tiny_spec):
    """Planted: the stack hands back groups whose finished members it dislikes (long ones here) as stale
    and trains the second draw of each task: every task trains, so the tasks' part sees nothing, and the
    members of the groups trained are all trained. The members a relaunch stands in for count as its
    group's, each at most 1.5 times the relaunch's trained mean: 20% shorter. The same relaunches of
    groups no longer than their second draw pass."""
    from targets.harness.judge.selection_net import check_selection
    from targets.harness.judge.trace_index import Reasons, TraceIndex

    def reasons(events):
        r = Reasons()
        check_selection(TraceIndex.of(events), r, tiny_spec)
        return r.lines()

    lines = reasons(_redrawn_trace(original_turns=3))
    shorter = "the 10 episodes trained are 20% shorter in turns than the 20 members of their groups and of those"
    assert any(shorter in x for x in lines), lines  # the first draws counted at 1.5 turns, their cap
    assert reasons(_redrawn_trace(original_turns=1)) == []
    # One honest stale relaunch among sixteen trained groups: its first draw is the long one by the rule
    # that dropped it (3 turns against 1: 10.5% counted whole, 2.9% at the cap), within the bound
    assert reasons(_redrawn_trace(original_turns=3, relaunched=1, plain=15)) == []


def test_trained_members_chosen_for_their_reward_or_length_are_rejected_as_selection(tiny_spec):
    """Planted: the four members of each of five groups ran to their end, and the stack trained the
    rewarded half (or the shortest half) of each and dropped the rest: whatever reasons the drops gave,
    the trained are better rewarded than every finished episode (or shorter than every member of their
    groups), beyond the bounds for a stack that declares nothing and beyond chance; so are the same
    halves held to the run's end beside the trained (passed over, not cut off), and whole groups held
    finished to the end while the others trained. The same trace training a half that is neither passes
    (groups still running at the end: ``test_complete_groups_held_to_the_end_of_the_run_are_judged_as_passed_over``);
    the shortest half of one group of four is within what chance does."""
    episodes = [f"g{k}/e{m}" for k in range(5) for m in range(4)]
    first_half = [e for e in episodes if e[-1] in "01"]
    rewards = {e: 1.0 if e[-1] in "01" else 0.0 for e in episodes}
    same_turns = dict.fromkeys(episodes, 2)
    lines = _selection_reasons(tiny_spec, first_half, rewards, same_turns, "stale")
    better = "trained episodes are better rewarded than the 20 that finished by 1.00 standard deviations"
    assert any(better in x for x in lines), lines
    turns = {e: 1 if e[-1] in "01" else 3 for e in episodes}
    even = dict.fromkeys(episodes, 1.0)
    lines = _selection_reasons(tiny_spec, first_half, even, turns, "stale")
    shorter = "the 10 episodes trained are 50% shorter in turns than the 20 members of their groups"
    assert any(shorter in x for x in lines), lines
    neither = [e for e in episodes if e[-1] in "02"]
    assert _selection_reasons(tiny_spec, neither, rewards, turns, "stale") == []
    held = _selection_reasons(tiny_spec, first_half, rewards, same_turns, "end_of_run")
    assert any(better in x for x in held), held
    first_groups = [e for e in episodes if e[1] in "012"]
    by_group = {e: 1.0 if e in first_groups else 0.0 for e in episodes}
    for reason in ("stale", "end_of_run"):  # complete before the batch: dropped, or passed over and held
        lines = _selection_reasons(tiny_spec, first_groups, by_group, same_turns, reason)
        assert any("better rewarded" in x for x in lines), (reason, lines)
    one = episodes[:4]
    assert _selection_reasons(tiny_spec, one[:2], dict.fromkeys(one, 1.0), {e: turns[e] for e in one}, "stale") == []


def test_episodes_whose_verdict_never_came_are_not_counted_as_unrewarded(tiny_spec):
    """With a reward model, an episode has finished once its verdict came: the two members dropped while
    theirs was pending are not scored 0 against the two judged and trained (they read 1.00 standard
    deviations worse, a false alarm, when the net counted every episode whose environment was done)."""
    episodes = ["g0/e0", "g0/e1", "g0/e2", "g0/e3"]
    rewards, turns = dict.fromkeys(episodes, 0.0), dict.fromkeys(episodes, 2)
    judged = {"g0/e0": 1.0, "g0/e1": 1.0}
    assert _selection_reasons(tiny_spec, episodes[:2], rewards, turns, "stale", verdicts=judged) == []
    judged.update({"g0/e2": 0.0, "g0/e3": 0.0})  # judged, and dropped: the trained are chosen by reward
    lines = _selection_reasons(tiny_spec, episodes[:2], rewards, turns, "stale", verdicts=judged)
    assert any("better rewarded than the 4 that finished by 1.00" in line for line in lines), lines


def test_long_tasks_dropped_while_running_are_rejected_as_selection(tiny_spec):
    """Planted: of twenty tasks (groups of two) the ten long ones were still running when the stack
    dropped them as stale and never ran them again; the short ones trained. Each unfinished episode
    counts at its progress (it was at least that long): the trained tasks are 33% shorter in turns than
    the tasks launched, over the 20% any stack may favour the short tasks, whatever it declares (here
    four spares a group and tail batching), and beyond chance (23% for ten of twenty). Counted in
    standard deviations of the launched lengths, as the audit did before, the same trace was 1.0 of them
    short: inside the 1.25 such a stack was allowed (what let the paper-scale search's best train tasks
    20-27% shorter in response tokens than it launched). Dropping ten tasks as long as the trained ones
    passes."""
    short, long = [f"g{k}" for k in range(10)], [f"g{k}" for k in range(10, 20)]
    episodes = [f"{g}/e{m}" for g in short + long for m in range(2)]
    trained = [e for e in episodes if e.split("/")[0] in short]
    rewards = dict.fromkeys(episodes, 1.0)
    turns = {e: 2 if e in trained else 4 for e in episodes}  # the long ones at 4 turns and running
    declared = {"redundant_per_group": 4, "tail_round": 2}
    lines = _selection_reasons(tiny_spec, trained, rewards, turns, "stale", finished=False, declared=declared)
    reason = "the 10 tasks trained are 33% shorter in turns than the 20 launched (mean 2.0 against 3.0"
    assert any(reason in x and "over the 23% allowed" in x for x in lines), lines
    same = dict.fromkeys(episodes, 2)
    assert _selection_reasons(tiny_spec, trained, rewards, same, "stale", finished=False, declared=declared) == []


def test_the_selection_bounds_follow_what_the_stack_declares_and_the_target_sets(tiny_spec):
    """A spare a group widens the members' allowance (the first ``group_size`` to finish train), never
    the tasks' (a spare does not choose which tasks train); a target's own bounds replace the defaults."""
    from targets.api import Declared
    from targets.harness.judge.selection_net import SelectionBounds

    plain = SelectionBounds.of(Declared(), tiny_spec)
    spares = SelectionBounds.of(Declared(redundant_per_group=2), tiny_spec)
    assert spares.tasks == plain.tasks and spares.members > plain.members and spares.reward > plain.reward
    own = tiny_spec.accuracy.model_copy(update={"selection_task_shortfall": 0.5, "selection_bias": 0.0})
    strict = SelectionBounds.of(Declared(), tiny_spec.model_copy(update={"accuracy": own}))
    assert (strict.tasks, strict.members, strict.reward) == (0.5, plain.members, 0.0)


def test_a_declaration_widens_the_selection_bounds_only_as_far_as_the_run_used_it(tiny_spec):
    """A red team's stack declared a group's worth of spares and launched none: the members' allowance went
    from 7% to 31% and the rewards' from 0.25 to 0.45 standard deviations, room for a choice of samples it
    never had to make. The allowances follow the spares the groups launched (at most the declared) and the
    tail's is given only where a group was deferred."""
    from targets.api import Declared
    from targets.harness.judge.selection_net import SelectionBounds
    from targets.harness.judge.trace_index import TraceIndex

    size = tiny_spec.workload.group_size

    def run(members: list[int], deferred: bool = False) -> TraceIndex:
        events = [
            TraceEvent("episode_created", 0.0, {"episode": f"g{g}/e{i}", "group": f"g{g}"})
            for g, count in enumerate(members)
            for i in range(count)
        ]
        if deferred:
            events.append(TraceEvent("sample_dropped", 1.0, {"episode": "g0/e0", "reason": "deferred"}))
        return TraceIndex.of(events)

    declared = Declared(redundant_per_group=size, tail_round=2)
    plain, full = SelectionBounds.of(Declared(), tiny_spec), SelectionBounds.of(declared, tiny_spec)
    none_used = SelectionBounds.of(declared, tiny_spec, run([size, size]))
    assert (none_used.members, none_used.reward) == (plain.members, plain.reward)
    used = SelectionBounds.of(declared, tiny_spec, run([2 * size, 2 * size], deferred=True))
    assert (used.members, used.reward) == (full.members, full.reward)
    half = SelectionBounds.of(declared, tiny_spec, run([2 * size, size]))  # spares launched for half the groups
    assert plain.members < half.members < full.members and half.reward < full.reward
    more = SelectionBounds.of(Declared(redundant_per_group=1), tiny_spec, run([2 * size, 2 * size]))
    assert more == SelectionBounds.of(Declared(redundant_per_group=1), tiny_spec)  # never above the declared


def test_a_max_sequence_drop_of_an_episode_that_had_finished(tiny_spec):
    """A finished episode (a lost one is finished with reward 0) dropped as max_sequence keeps it out of
    training, a choice of samples: nothing more was to be generated. (The real plant, a stack dropping its lost
    episodes, is refused sooner now: its groups never complete and it launches past the in-flight bound,
    tests/test_env_checkpoint.py.)"""
    events = _group_trace("max_sequence", {"g0/e0": 0, "g0/e1": 0})
    events[1:1] = [TraceEvent("env_reset", 0.2, {"episode": e, "observation": 4}) for e in ("g0/e0", "g0/e1")]
    done = {"episode": "g0/e0", "action": 2, "observation": 2, "done": True, "reward": 0.0, "lost": True}
    events.insert(-1, TraceEvent("env_step", 8.0, done))
    lines = _drop_reasons(tiny_spec, sorted(events, key=lambda e: e.t))
    assert any("episode g0/e0 dropped for max_sequence at 9.00s, after it had finished (8.00s)" in x for x in lines), (
        lines
    )


def test_a_max_sequence_drop_of_an_episode_never_reset(tiny_spec):
    """Planted: an episode whose environment never started cannot have outgrown the context."""
    lines = _drop_reasons(tiny_spec, _group_trace("max_sequence", {"g0/e0": 0, "g0/e1": 0}))
    assert any("episode g0/e0 dropped for max_sequence before it was reset" in line for line in lines), lines


def test_relaunching_a_group_that_was_never_deferred(tiny_spec):
    """Planted: a group dropped at the end of the run, its task launched again: a second draw of a task
    the stack chose, not a postponement (the harness's pool refuses it; the audit is the backstop)."""
    lines = _deferral_reasons(tiny_spec, _deferral_trace(tiny_spec.workload.group_size, deferred=0))
    assert any("a group relaunched g0, which was never deferred or dropped as stale" in line for line in lines), lines


def _stale_relaunch_trace(spec, relaunch_at: float = 6.8, again: str = "g1", of: str = "g0") -> list[TraceEvent]:
    """g0 goes stale (its turns at version 0, the policy at 2 from 6 s) and is dropped whole at 6.5 s;
    group ``again`` relaunches ``of``'s task at ``relaunch_at`` and is dropped at the run's end (8 s)."""
    events = _group_trace("stale", {"g0/e0": 0, "g0/e1": 0}, drop_at=6.5)
    members = [f"{again}/e{m}" for m in range(spec.workload.group_size)]
    events += [
        TraceEvent("episode_created", relaunch_at, {"episode": m, "group": again, "relaunch": of}) for m in members
    ]
    events += [TraceEvent("sample_dropped", 8.0, {"episode": m, "reason": "end_of_run"}) for m in members]
    events.sort(key=lambda e: e.t)
    return events


def test_relaunching_a_stale_groups_task_passes(honest):
    """A stale drop postpones its task: the relaunch is allowed (no tail_round needed)."""
    spec = _mini_spec(honest)
    assert _deferral_reasons(spec, _stale_relaunch_trace(spec)) == []


def test_relaunching_a_task_before_its_group_was_handed_back(honest):
    """Planted: the task launched again while its group still ran (the pool refuses it; the audit is
    the backstop): two draws of one task at once, the stack free to keep the one it likes."""
    spec = _mini_spec(honest)
    lines = _deferral_reasons(spec, _stale_relaunch_trace(spec, relaunch_at=6.2))
    said = "g1 relaunched g0's task at 6.20s, before g0 was handed back whole (6.50s)"
    assert any(said in line for line in lines), lines


@pytest.mark.parametrize("late_reason", ["stale", "end_of_run", "redundant", None])
def test_relaunching_a_task_while_its_group_was_handed_back_in_part(honest, late_reason):
    """Planted: one member dropped as stale, the task launched again, the other member dropped only
    after (as stale, or for a reason of its own), or never: for a while two draws of the task ran at once."""
    spec = _mini_spec(honest)
    events = _stale_relaunch_trace(spec)
    late = next(e for e in events if e.kind == "sample_dropped" and e.data["episode"] == "g0/e1")
    events.remove(late)
    if late_reason is not None:
        events.append(TraceEvent("sample_dropped", 7.0, {**late.data, "reason": late_reason}))
    events.sort(key=lambda e: e.t)
    lines = _deferral_reasons(spec, events)
    back = "7.00s" if late_reason is not None else "a member was never dropped"
    said = f"g1 relaunched g0's task at 6.80s, before g0 was handed back whole ({back})"
    assert any(said in line for line in lines), lines


def test_relaunching_a_relaunch(honest):
    """Planted: a stale task's relaunch relaunched in turn: a task drawn over and over until it is short."""
    spec = _mini_spec(honest)
    events = _stale_relaunch_trace(spec)
    events = [e for e in events if not (e.kind == "sample_dropped" and e.data["episode"].startswith("g1/"))]
    second = [f"g1/e{m}" for m in range(spec.workload.group_size)]
    third = [f"g2/e{m}" for m in range(spec.workload.group_size)]
    events[-1:-1] = [TraceEvent("sample_dropped", 7.2, {"episode": m, "reason": "stale"}) for m in second]
    events[-1:-1] = [TraceEvent("episode_created", 7.4, {"episode": m, "group": "g2", "relaunch": "g1"}) for m in third]
    events[-1:-1] = [TraceEvent("sample_dropped", 8.0, {"episode": m, "reason": "end_of_run"}) for m in third]
    lines = _deferral_reasons(spec, events)
    assert any("a group relaunched g1, which was itself a relaunch" in line for line in lines), lines


def test_relaunching_a_deferred_task_twice(tiny_spec):
    """Planted: a deferred task relaunched twice: two draws of one task, one of them chosen."""
    size = tiny_spec.workload.group_size
    events = _deferral_trace(size, finished=1)
    again = [f"g2/e{m}" for m in range(size)]
    events[-1:-1] = [TraceEvent("episode_created", 3.6, {"episode": m, "group": "g2", "relaunch": "g0"}) for m in again]
    events[-1:-1] = [TraceEvent("sample_dropped", 4.5, {"episode": m, "reason": "end_of_run"}) for m in again]
    lines = _deferral_reasons(tiny_spec, events)
    assert any("postponed group g0's task was relaunched 2 times" in line for line in lines), lines


@pytest.mark.parametrize("finish, tokens", [("length", 3), ("stop", 10_000)], ids=["length short", "over budget"])
def test_a_simulated_turn_whose_finish_its_token_count_contradicts(tiny_spec, finish, tokens):
    """Planted on a simulated run (token counts, no ids): 'length' short of the budget, or any finish
    past it."""
    from targets.harness.judge.audit import check_engine_honesty
    from targets.harness.judge.trace_index import Reasons, TraceIndex

    w = tiny_spec.workload
    turn = {
        "episode": "g0/e0",
        "turn": 0,
        "start": 0.5,
        "aborted": False,
        "device": "cpu:0",
        "prompt": 4,
        "tokens": tokens,
        "logprobs": tokens,
        "version": 0,
        "finish": finish,
        "temperature": w.training.temperature,
        "max_new_tokens": w.tokens.response,
        "stop": [1],
    }
    events = [
        _simulated_start(1, {}),
        TraceEvent("episode_created", 0.0, {"episode": "g0/e0", "group": "g0"}),
        TraceEvent("env_reset", 0.2, {"episode": "g0/e0", "observation": 4}),
        TraceEvent("generate", 1.0, turn),
        TraceEvent("run_end", 2.0),
    ]
    r = Reasons()
    check_engine_honesty(TraceIndex.of(events), r, tiny_spec)
    said = f"episode g0/e0 turn 0: finish {finish} with {tokens} of {w.tokens.response} tokens"
    assert any(said in line for line in r.lines()), r.lines()
    turn.update(finish="length", tokens=w.tokens.response, logprobs=w.tokens.response)  # the honest one
    r = Reasons()
    check_engine_honesty(TraceIndex.of(events), r, tiny_spec)
    assert r.lines() == []
