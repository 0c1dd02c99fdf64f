"""The version-timing rule (targets/harness/judge/version_timing.py) on small traces: a turn is answered no
sooner after the later of its forwarding and its version's making than decoding its tokens takes, at the
run's fastest pace but never under the floor of a decode step (the plant on a real run's trace is
tests/test_audit.py's ``test_a_turn_decoded_under_one_version_and_claimed_under_the_next``)."""

from __future__ import annotations

import pytest
import yaml

from targets.api import TraceEvent
from targets.harness.judge.trace_index import Reasons, TraceIndex
from targets.harness.judge.version_timing import check_version_timing, decode_step_floor
from targets.spec import CATALOG_DIR, parse_target

FLOOR_S = 2e-4  # a decode step's floor here: about the 0.6B target's on one H100 (``decode_step_floor``)


def _served(episode: str, start: float, end: float, tokens: int, version: int = 0) -> TraceEvent:
    data = {"episode": episode, "turn": 0, "start": start, "aborted": False, "device": "cuda:0"}
    data.update(prompt=[4] * 12, tokens=[5] * tokens, finish="length", version=version)
    return TraceEvent("generate", end, data)


def _judged(events: list[TraceEvent], floor_s: float = FLOOR_S, drafts: int = 0) -> tuple[list[str], dict]:
    engine = {"speculative_tokens": drafts}
    start = TraceEvent(
        "run_start",
        0.0,
        {"devices": ["cuda:0"], "tokens_recorded": True, "engines": {}, "declared": {}, "engine": engine},
    )
    trained = TraceEvent("train", 5.0, {"start": 1.0, "version": 1, "trajectories": []})
    r = Reasons()
    details = check_version_timing(TraceIndex.of([start, trained, *sorted(events, key=lambda e: e.t)]), r, floor_s)
    return r.lines(), details


HONEST = [_served(f"h{k}/e0", 0.1 + 0.3 * k, 0.3 + 0.3 * k, 16) for k in range(10)]  # 12.5 ms a token


def test_honest_requests_pass_and_the_pace_is_the_runs_fastest_halved():
    reasons, details = _judged(HONEST)
    assert not reasons and details["version_timing_pace_s"] == pytest.approx(0.5 * 0.2 / 16)
    assert details["version_timing_least_ratio"] == pytest.approx(2.0)


def test_a_run_of_short_requests_alone_is_held_to_the_floor():
    """Planted (a review of the judge): every request of the run under ``PACE_MIN_TOKENS`` tokens (a target
    whose response budget is 3), each answered a millisecond after it was forwarded under version 1, decoded
    ahead while version 1 trained. No request set a pace, and the rule returned before it held any to the
    floor: three tokens take three steps of it (0.6 ms here), so the one answered at once is named."""
    ahead = [_served(f"a{k}/e0", 5.0 + 0.1 * k, 5.0 + 0.1 * k + 0.002, 3, version=1) for k in range(4)]
    ahead.append(_served("instant/e0", 6.0, 6.0002, 3, version=1))
    reasons, details = _judged(ahead)
    assert len(reasons) == 1 and reasons[0].startswith("answered faster than decoding: episode instant/e0"), reasons
    assert details["version_timing_pace_s"] == FLOOR_S
    assert _judged(ahead[:-1])[0] == []  # 2 ms for three tokens: within the floor's 0.6 ms


def test_a_turn_decoded_ahead_and_answered_at_once_once_forwarded_is_named():
    """A red team's: siblings of a group decoded under v-1 while v trained, forwarded once v existed and
    answered 10 ms later with 400 tokens, claiming v. Only requests forwarded before their version existed
    were checked; every request is now, from the later of the two."""
    siblings = [_served(f"s/e{k}", 5.0 + 0.02 * k, 5.01 + 0.02 * k, 400, version=1) for k in range(1, 8)]
    reasons, details = _judged(HONEST + siblings)
    assert len(reasons) >= 3 and all(line.startswith("answered faster than decoding: ") for line in reasons)
    assert details["version_timing_witnessed"] == 0 and details["version_timing_least_ratio"] < 0.2


def test_drafts_are_credited_only_where_prompt_lookup_could_have_drafted_them():
    """A stack declaring eight drafts a step was allowed nine tokens a step whatever it made: a turn of 400
    tokens decoded under v0 while v1 trained, forwarded once v1 existed and answered 30 ms later (setting
    the run's pace itself, held to the floor of a decode step: 400 tokens over 9 a step take 8.9 ms) passed.
    Its tokens repeat nothing, so no drafter could have kept a draft of them: a token a step, 80 ms, and it
    is named. An honest turn as quick whose tokens repeat its prompt (an agent re-reading a file) could have
    been drafted nine tokens a step (46 steps, 9.2 ms), and passes."""
    ahead = _served("ahead/e0", 5.0, 5.03, 0, version=1)
    ahead.data["tokens"] = list(range(1000, 1400))
    copied = _served("copy/e0", 5.0, 5.03, 0, version=1)
    copied.data.update(prompt=list(range(1, 401)), tokens=list(range(1, 401)))
    reasons, details = _judged([*HONEST, ahead, copied], drafts=8)
    assert len(reasons) == 1 and reasons[0].startswith("answered faster than decoding: episode ahead/e0"), reasons
    assert details["version_timing_pace_s"] == pytest.approx(FLOOR_S)  # the quick turns' pace is under the floor
    assert _judged([*HONEST, copied], drafts=8)[0] == []
    reasons = _judged([*HONEST, ahead], drafts=0)[0]  # as a stack that does not draft
    assert len(reasons) == 1 and reasons[0].startswith("answered faster than decoding: episode ahead/e0"), reasons


def test_one_instant_answer_cannot_set_the_pace_under_the_floor_of_a_decode_step():
    """A red team's: a sibling answered 1 ms after it was forwarded (4 tokens sampled while its groupmate
    decoded) made the run's fastest pace 40 times faster, and a 400-token turn decoded under v0 while v1
    trained and claimed under v1 one prefill after v1 existed passed. The pace is never under a decode
    step's floor (here about the 0.6B target's on one H100): the turn is named (the instant answer, 4 tokens
    in 1 ms, is within the floor's 0.8 ms)."""
    cheat = _served("c/e0", 1.0, 5.06, 400, version=1)
    instant = _served("i/e1", 6.0, 6.001, 4)
    reasons, _ = _judged(HONEST + [cheat, instant], floor_s=0.0)
    assert reasons == [], "the hole: with no floor the instant answer sets the pace"
    reasons, details = _judged(HONEST + [cheat, instant])
    assert [line.split(":")[0] for line in reasons] == ["decoded before its version existed"], reasons
    assert "episode c/e0" in reasons[0]
    assert details["version_timing_pace_s"] == FLOOR_S


def test_a_short_turn_answered_in_a_quiet_moment_is_held_to_the_floor_alone():
    """A red team's: long turns in heavy batches at 10 ms a token set the pace (5 ms halved), and a turn that
    drew a stop at once, 2 tokens in 8 ms in a quiet moment, was named as answered faster than decoding
    (ratio 0.8). A request under ``PACE_MIN_TOKENS`` is held to the floor of a decode step alone; one
    answered under that floor still is."""
    busy = [_served(f"b{k}/e0", 1.0, 3.0, 200) for k in range(20)]
    reasons, details = _judged(busy + [_served("q/e0", 10.0, 10.008, 2)])
    assert not reasons and details["version_timing_least_ratio"] > 1
    reasons, _ = _judged(busy + [_served("q/e0", 10.0, 10.0001, 2)])
    assert [line.split(":")[0] for line in reasons] == ["answered faster than decoding"], reasons


def test_a_turn_decoded_ahead_and_handed_back_in_short_segments_is_held_to_the_pace_as_a_whole():
    """A red team's: a turn of 402 tokens decoded ahead, handed back as 134 interrupted segments of 3 tokens
    each answered 1 ms after it was forwarded, passed: each was short, and held to the floor alone. A turn's
    short requests together are held to the pace once they are as long as a request that sets it; two short
    segments of one turn, 2 tokens each in quiet moments, still pass."""
    busy = [_served(f"b{k}/e0", 1.0, 3.0, 200) for k in range(20)]  # 10 ms a token, a pace of 5 ms
    quiet = [_served("q/e0", 10.0, 10.011, 2), _served("q/e0", 10.1, 10.111, 2)]
    reasons, details = _judged(busy + quiet)
    assert not reasons and details["version_timing_least_ratio"] > 1
    pieces = [_served("p/e0", 12.0 + 0.01 * k, 12.001 + 0.01 * k, 3) for k in range(134)]
    for piece in pieces[:-1]:
        piece.data.update(aborted=True, finish="abort")
    reasons, details = _judged(busy + pieces)
    assert len(reasons) == 1 and reasons[0].startswith("answered faster than decoding: episode p/e0 turn 0: 134 ")
    assert details["version_timing_least_ratio"] == pytest.approx(0.134 / (402 * 0.005))


def test_the_floor_of_a_decode_step_is_the_weights_read_once_at_the_spec_bandwidth_halved():
    """The 0.6B target in bf16 on one H100: 596M active weights x 2 bytes over 3.35 TB/s, halved (an H200
    run as the H100 spec reads 1.4 times faster: still over the floor); the CPU target's, 40 us."""
    spec = parse_target(yaml.safe_load((CATALOG_DIR / "qwen3-0.6b-h100x1.yaml").read_text()))
    weights = spec.model.param_counts().active * 2
    assert decode_step_floor(spec) == pytest.approx(0.5 * weights / 3.35e12)
    assert 1.5e-4 < decode_step_floor(spec) < 2.0e-4
    cpu = parse_target(yaml.safe_load((CATALOG_DIR / "tiny-qwen3-cpu.yaml").read_text()))
    assert 2e-5 < decode_step_floor(cpu) < 1e-4


def test_a_step_taken_inside_the_weight_export_holds_its_devices_until_the_seal():
    """Planted (a review of the judge): the cluster answers ``train`` at once and takes the real step inside
    ``export_weights``, which the harness's train call then waits for; meanwhile its controller wakes the
    trainer's device and serves from it. Read from its call alone the step lasted 10 ms and nothing was seen;
    a step holds its devices to its export's seal now. A version still exists from the call's return: an
    honest cluster that lends an engine meanwhile (a serving harvest's expand) loads the version the call
    returned, and its turns under it are not early."""
    from targets.harness.judge.mechanism import check_mechanism

    spec = parse_target(yaml.safe_load((CATALOG_DIR / "tiny-qwen3-cpu.yaml").read_text()))

    def served(end: float, start: float, device: str, episode: str, version: int) -> TraceEvent:
        data = {"episode": episode, "turn": 0, "start": start, "aborted": False, "device": device, "version": version}
        data.update(prompt=[1], tokens=list(range(8)), logprobs=[0.0] * 8, finish="length")
        return TraceEvent("generate", end, data)

    events = [
        TraceEvent("run_start", 0.0, {"devices": ["cpu:0", "cpu:1"], "rollout": ["cpu:0", "cpu:1"], "engines": {}}),
        served(0.9, 0.1, "cpu:1", "e0", 0),
        TraceEvent("shrink", 1.0, {"start": 0.99, "devices": ["cpu:1"]}),
        TraceEvent("train", 1.02, {"start": 1.01, "step": 1, "devices": ["cpu:1"], "version": 1, "trajectories": []}),
        TraceEvent("expand", 1.06, {"start": 1.05, "devices": ["cpu:1"]}),  # woken while the step is under way
        served(3.0, 1.10, "cpu:1", "e1", 0),  # served beside the trainer
        served(4.0, 3.9, "cpu:0", "e2", 1),  # under the version the call returned, before the seal: honest
        TraceEvent("weight_export", 6.0, {"start": 1.02, "step": 1}),  # the step, taken here
        TraceEvent("run_end", 7.0, {}),
    ]
    ix, r = TraceIndex.of(events), Reasons()
    check_mechanism(ix, r, 1, spec)
    assert any(line.startswith("trained beside an awake engine: cpu:1") for line in r.lines()), r.lines()
    r = Reasons()
    check_version_timing(ix, r, FLOOR_S)
    assert r.lines() == []
