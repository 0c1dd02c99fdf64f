"""The parts of the judge that need no run: paired ratios and their intervals, the parent's
stopwatch against the harness clock, the channel against hostile bytes, and the sandbox's refusal
to run candidates unisolated unless asked by name."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import socket
import struct
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from agents.offline.evaluator import extended, undecided
from targets.api import TraceEvent
from targets.harness.ipc.channel import _BURST_END_BYTES, AsyncChannel, Frame, Received, SyncChannel
from targets.harness.ipc.protocol import ProtocolError
from targets.harness.ipc.wire import (
    PromptMemory,
    get_batch,
    get_completion,
    get_request,
    get_trajectory,
    put_batch,
    put_completion,
    put_request,
    put_tokens,
)
from targets.harness.isolation.launch import HarnessRun
from targets.harness.judge.check_result import CheckResult
from targets.harness.measure.session import Measurement, Paired, Session, clock_check

# -- paired measurement ------------------------------------------------------------------------------


def test_a_paired_ratio_with_its_interval():
    paired = Paired.of([110, 106, 114], [100, 100, 100])
    assert paired.ratio == pytest.approx(math.exp(sum(math.log(x / 100) for x in (110, 106, 114)) / 3))
    assert paired.low < paired.ratio < paired.high and paired.pairs == 3
    # the geometric mean's 95% t-interval over 3 pairs (t = 4.303): +10%, but its low end under +5%
    assert (paired.low, paired.high) == pytest.approx((1.00449, 1.20352), rel=1e-4)
    assert not paired.clears(0.05) and paired.clears(0.0)
    assert "interval [" in paired.describe() and "+10.0%" in paired.describe()
    assert Paired.of([110, 106, 114], [100, 90, 104]).baseline_median == 100  # the baseline's figure beside it


def test_noise_as_large_as_the_gain_keeps_a_candidate_from_promotion():
    """+2.4% on average, +/-10% pair to pair: the interval straddles 1 + threshold."""
    paired = Paired.of([112, 92.8, 102.4], [100, 100, 100])
    assert not paired.clears(0.05) and paired.low < 1.0 < paired.high


def test_a_clear_gain_is_promoted_and_a_metric_to_minimize_is_inverted():
    assert Paired.of([150, 152, 149, 151], [100, 100, 100, 100]).clears(0.05)
    assert Paired.of([5.0, 5.1, 4.9], [10.0, 10.0, 10.0], maximize=False).ratio == pytest.approx(2.0, rel=0.02)


def test_one_real_pair_says_nothing_of_noise_one_simulated_pair_is_exact():
    assert Paired.of([200], [100]).high is None and not Paired.of([200], [100]).clears(0.05)
    assert "unbounded" in Paired.of([200], [100]).describe()
    exact = Paired.of([200], [100], deterministic=True)
    assert exact.low == exact.high == pytest.approx(2.0) and exact.clears(0.05)
    # said as one seed's exact ratio, not as a 95% interval of zero width ("[+100%, +100%]"), which read as
    # certainty about every seed
    from orchestrator.state import Promotion
    from orchestrator.tables import paired_cell

    assert exact.describe() == "+100.0% on one seed (simulated: exact there; another seed would differ)"
    assert paired_cell(Promotion(**exact.as_dict())) == "+100% [1 seed] of 100"


def test_a_headline_of_zero_or_infinity_is_an_unbounded_ratio_not_a_crash():
    """Goodput 0 (every trained trajectory timed out) or a step time of infinity (no step finished)."""
    worse = Paired.of([0.0, 9.0], [10.0, 10.0])
    assert worse.ratio == 0.0 and worse.high is None and not worse.clears(0.05)
    better = Paired.of([10.0, 10.0], [0.0, 10.0])
    assert better.ratio == math.inf and not better.clears(0.05)  # no promotion over a baseline that broke
    assert "a headline was zero or infinite" in better.describe()
    assert Paired.of([math.inf, 5.0], [4.0, 5.0], maximize=False).ratio == 0.0
    assert Paired.of([0.0, 0.0], [0.0, 0.0]).ratio == 1.0  # both trained nothing: no difference


def test_the_interval_takes_student_s_t_for_its_pairs_at_any_confidence():
    """A table of t values took the wider row between its rows (2.228 for 11 degrees of freedom, 2.201
    true); the quantile is computed now, at any confidence a sequential look is given."""
    from targets.harness.measure import student_t

    logs = [math.log(r) for r in (1.1, 1.2, 1.0, 1.15, 1.05, 1.3, 0.95, 1.1, 1.2, 1.12, 1.08, 1.18)]
    paired = Paired.of([100 * math.exp(x) for x in logs], [100.0] * 12)
    half = math.log(paired.high / paired.ratio)
    mean = sum(logs) / 12
    stdev = math.sqrt(sum((x - mean) ** 2 for x in logs) / 11)
    assert half == pytest.approx(2.201 * stdev / math.sqrt(12), rel=1e-3)
    printed = {(0.975, 1): 12.706, (0.975, 2): 4.303, (0.975, 5): 2.571, (0.975, 30): 2.042, (0.9975, 2): 14.089}
    for (p, df), t in printed.items():  # the printed tables' values
        assert student_t.quantile(p, df) == pytest.approx(t, abs=1e-3)
    with pytest.raises(ValueError, match="0.5 < p < 1"):
        student_t.quantile(0.4, 3)


class ScriptedSession(Session):
    """``compare``'s own loop over runs whose headline is scripted per (stack, seed): no run is made."""

    def __init__(self, goodput: dict[tuple[str, int], float]) -> None:
        metric = SimpleNamespace(name="goodput", direction="maximize")
        super().__init__(SimpleNamespace(spec=SimpleNamespace(headline_metric=metric), simulated=False), None)
        self.goodput, self.runs = goodput, []

    def measure(self, stack_dir, out, seed, steps=None) -> Measurement:
        self.runs.append((str(stack_dir), seed))
        return Measurement([CheckResult("system_audit", True)], {"goodput": self.goodput[str(stack_dir), seed]})


def _scripted(ratios: list[float]) -> tuple[ScriptedSession, list[int]]:
    seeds = list(range(100, 100 + len(ratios)))
    goodput = {("base", s): 10.0 for s in seeds} | {("cand", s): 10.0 * r for s, r in zip(seeds, ratios)}
    return ScriptedSession(goodput), seeds


def test_an_undecided_gain_gets_more_pairs_until_its_interval_clears():
    """Three pairs of a true +38% with one bad pair straddle the bar (as tiny-qwen3-cpu's time_multiplex
    did: +31.9% [-2.0%, +77.3%]); the sequential rule adds pairs, interleaved as before, until it clears."""
    session, seeds = _scripted([1.45, 0.98, 1.35, 1.38, 1.37, 1.39])
    ours, theirs, paired = session.compare(
        Path("cand"), Path("base"), Path("out"), seeds, pairs=3, more=undecided(0.05)
    )
    three = Paired.of([14.5, 9.8, 13.5], [10.0] * 3)
    assert undecided(0.05)(three) and not three.clears(0.05)
    assert paired.pairs in (4, 5, 6) and paired.clears(0.05) and len(ours) == len(theirs) == paired.pairs
    order = [name for name, _ in session.runs]
    assert order[:8] == ["cand", "base", "base", "cand", "cand", "base", "base", "cand"]  # A B / B A


def test_a_sequential_comparison_promotes_a_candidate_at_the_threshold_no_more_often_than_its_alpha():
    """Every look of a sequential comparison was tested at 95%: a candidate exactly at the threshold
    (+5%) was promoted in 6% of 10,000 simulated evaluations of 3 to 6 pairs, not the 2.5% the rule
    promises. Each look now spends its share of the error (``look_confidence``): at most 2.5% in all,
    measured here through ``compare``'s own loop (2,000 evaluations, pair noise 0.1 in log)."""
    import random

    from targets.harness.measure.session import ALPHA, look_confidence

    assert [round(1 - look_confidence(n, 3, 6), 5) for n in (3, 4, 5, 6)] == [0.0025, 0.0025, 0.0025, 0.0175]
    assert look_confidence(3, 3, 3) == 1 - ALPHA  # not sequential: the plain 95% interval's low end
    draw, promoted, evaluations = random.Random(0), 0, 2000
    for _ in range(evaluations):
        session, seeds = _scripted([1.05 * math.exp(draw.gauss(0, 0.1)) for _ in range(6)])
        _, _, paired = session.compare(Path("cand"), Path("base"), Path("out"), seeds, pairs=3, more=undecided(0.05))
        promoted += paired.clears(0.05)
    assert promoted / evaluations <= ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / evaluations), promoted


def test_a_candidate_estimated_below_the_bar_stops_at_its_pairs():
    session, seeds = _scripted([0.98, 1.0, 1.03, 1.5, 1.5, 1.5])
    _, _, paired = session.compare(Path("cand"), Path("base"), Path("out"), seeds, pairs=3, more=undecided(0.05))
    assert paired.pairs == 3 and len(session.runs) == 6


def test_the_evaluator_extends_real_pairs_only_from_an_interval():
    """Up to twice ``--repeat`` on a real target from two pairs; never on a simulated one (a pair is
    exact for its seed) or from one real pair (its interval is unbounded)."""
    from agents.offline.evaluator import OfflineEvaluator

    def session(simulated: bool):
        return SimpleNamespace(target=SimpleNamespace(simulated=simulated))

    assert OfflineEvaluator(session(False), repeat=3).max_pairs == 6
    assert OfflineEvaluator(session(False), repeat=1).max_pairs == 1
    assert OfflineEvaluator(session(True), repeat=3).max_pairs == 3


def test_a_best_that_fails_beside_a_candidate_ends_the_round_in_an_error_not_the_candidates_rejection(tmp_path):
    """The best's own run failing the judge (here its integrity scan) was a finding against the candidate:
    the round rejected it, and marked its task tried."""
    from agents.offline.evaluator import BestFailed, OfflineEvaluator
    from skills.starter import write_starter
    from targets.harness.isolation.launch import Limits
    from targets.harness.isolation.sandbox import Sandbox
    from targets.harness.target import Target

    target = Target.load("qwen3-8b-h800x16")
    candidate = write_starter(tmp_path / "candidate", target.spec, "time_multiplex")
    best = write_starter(tmp_path / "best", target.spec, "colocate")
    (best / "stack" / "peek.py").write_text("from targets.harness.trace import Trace\n")  # planted in the best
    evaluator = OfflineEvaluator(Session(target, Sandbox("subprocess"), Limits(time_s=300)), repeat=1)
    judged = Measurement([CheckResult("system_audit", True)], {"goodput": 1.0})  # the candidate's, from its check
    with pytest.raises(BestFailed, match=r"the best failed measured run 0 beside this candidate .*targets.harness"):
        evaluator.evaluate(candidate, tmp_path / "out", best, seeds=[0], first=judged)


def test_extra_seeds_extend_the_rounds_own_and_are_the_same_on_a_rerun():
    assert extended([5, 6, 7], 3)[:3] == [5, 6, 7] and extended([5, 6, 7], 3) == extended([5, 6, 7], 3)
    assert len(set(extended([5, 6, 7], 3))) == 6 and extended([5, 6, 7], 0) == [5, 6, 7]


# -- the parent's stopwatch ----------------------------------------------------------------------------


def _events(duration: float) -> list[TraceEvent]:
    return [TraceEvent("run_start", 3.0, {}), TraceEvent("run_end", 3.0 + duration, {})]


def test_the_harness_clock_must_agree_with_the_parents_stopwatch():
    run = HarnessRun(True, "", Path("."), marks={"run_start": 100.0, "run_end": 110.0})
    assert clock_check(run, _events(10.05)).passed
    slow = clock_check(run, _events(6.0))  # a clock running at 0.6x: the run looks 40% faster
    assert not slow.passed and "did not keep time" in slow.reasons[0]
    unseen = clock_check(HarnessRun(True, "", Path("."), marks={"run_start": 1.0}), _events(5.0))
    assert not unseen.passed and "were not both seen" in unseen.reasons[0], unseen.reasons


# -- the channel against hostile bytes -------------------------------------------------------------------


def _pair():
    return socket.socketpair()


def test_an_audit_that_raises_is_the_harness_fault_not_a_verdict_on_the_candidate(tmp_path, monkeypatch, fast_target):
    """The audit reads only the harness's own trace and weights: a crash there is the harness's bug. It was
    a failed system_audit check, so the round rejected the candidate and told its implementer to fix it."""
    from skills.starter import write_starter
    from targets.harness.isolation import child
    from targets.harness.isolation.launch import Limits
    from targets.harness.isolation.sandbox import Sandbox
    from targets.harness.measure import session
    from targets.harness.measure.session import EnvironmentFailed
    from targets.harness.target import Target

    def audit() -> dict:
        raise KeyError("planted: an audit bug")

    out = tmp_path / "out"
    out.mkdir()
    assert child.record_phase(out, "system", lambda: {}) and not child.record_phase(out, "audit", audit)
    report = json.loads((out / "audit.json").read_text())
    assert report["fault"] == "harness" and report["message"] == "the audit raised KeyError: 'planted: an audit bug'"

    def the_run_above(target, stack, run_out, mode, *args, **kwargs) -> HarnessRun:
        results = {phase: json.loads((out / f"{phase}.json").read_text()) for phase in ("system", "audit")}
        return HarnessRun(False, "audit failed", run_out, results)

    monkeypatch.setattr(session, "run_harness", the_run_above)
    target = Target.load(fast_target)
    judged = Session(target, Sandbox("subprocess"), Limits(time_s=60))
    with pytest.raises(EnvironmentFailed, match="the audit raised KeyError") as failed:
        judged.measure(write_starter(tmp_path / "c", target.spec, "colocate"), out, seed=0)
    assert failed.value.part == "harness"


def test_a_run_killed_at_a_limit_after_its_phases_answered_is_no_measurement(tmp_path, monkeypatch, fast_target):
    """The launcher kills a run whose processes pass a limit (memory, time) even after the audit wrote its
    answer (a candidate process lingering past the run, growing): its phases all said ok, and the session
    measured it as if nothing had happened."""
    from skills.starter import write_starter
    from targets.harness.isolation.launch import Limits, killed_cause
    from targets.harness.isolation.sandbox import Sandbox
    from targets.harness.measure import session
    from targets.harness.target import Target

    audited = {"name": "system_audit", "passed": True, "reasons": [], "details": {}}
    results = {"system": {"status": "ok"}, "audit": {"status": "ok", "result": audited}}
    over = "used 9000 MB of resident memory, over its limit of 4096 MB"

    def killed_after_its_phases(target, stack, run_out, mode, *args, **kwargs) -> HarnessRun:
        return HarnessRun(False, killed_cause(("system", "audit"), results, over), run_out, results)

    monkeypatch.setattr(session, "run_harness", killed_after_its_phases)
    target = Target.load(fast_target)
    judged = Session(target, Sandbox("subprocess"), Limits(time_s=60))
    measurement = judged.measure(write_starter(tmp_path / "c", target.spec, "colocate"), tmp_path / "out", seed=0)
    assert not measurement.ok
    assert measurement.reasons == [f"system_run: the run, after every phase answered, {over} (killed)"]
    # not the audit's: it had answered (the cause named the last phase, as if killed in it)
    assert killed_cause(("system", "audit"), {"system": {}}, over) == f"audit run {over} (killed)"


def test_a_sync_channel_round_trips_arrays_and_refuses_garbage():
    a, b = _pair()
    left, right = SyncChannel(a), SyncChannel(b)
    frame = Frame(kind="x")
    frame.header["tokens"] = frame.array([1, 2, 3], "i4")
    left.send(frame)
    rx = right.recv()
    assert rx["kind"] == "x" and rx.ints(rx["tokens"]) == [1, 2, 3]
    a.sendall(struct.pack("!I", 5) + b"nope!")
    with pytest.raises(ProtocolError, match="not JSON"):
        right.recv()
    header = json.dumps({"blobs": [-1]}).encode()
    a.sendall(struct.pack("!I", len(header)) + header)
    with pytest.raises(ProtocolError, match="blob sizes"):
        right.recv()


def test_decoders_check_every_field_of_what_a_candidate_sends():
    memory = PromptMemory()
    frame = Frame()
    from targets.api import GenerateRequest, SamplingParams, TrainBatch, Trajectory

    request = GenerateRequest("g0/e0", 0, [1, 2, 3], SamplingParams(4))
    frame.header["r"] = put_request(frame, request, memory)
    rx = Received(json.loads(json.dumps({**frame.header, "blobs": [len(b) for b in frame.blobs]})), frame.blobs)
    assert get_request(rx, rx["r"], PromptMemory()).prompt == [1, 2, 3]
    bad = json.loads(json.dumps(rx["r"]))
    bad["prompt"]["prefix"] = 99  # refers to tokens the harness never saw
    with pytest.raises(ProtocolError, match="prefix 99"):
        get_request(rx, bad, PromptMemory())
    bad = json.loads(json.dumps(rx["r"]))
    bad["params"]["max_new_tokens"] = "lots"
    with pytest.raises(ProtocolError, match="max_new_tokens"):
        get_request(rx, bad, PromptMemory())
    bad = json.loads(json.dumps(rx["r"]))
    bad["device"] = 3  # a routing request must name a device
    with pytest.raises(ProtocolError, match="device must be a device id"):
        get_request(rx, bad, PromptMemory())
    batch = TrainBatch([Trajectory("g0/e0", "g0", [1, 2, 3], [0, 1, 1], [0.0, -1.0, -2.0], 1.0, [0])], [0.5])
    frame = Frame()
    frame.header["b"] = put_batch(frame, batch)
    rx = Received(json.loads(json.dumps({**frame.header, "blobs": [len(b) for b in frame.blobs]})), frame.blobs)
    assert get_batch(rx, rx["b"]).trajectories[0].logprobs == [0.0, -1.0, -2.0]
    bad = json.loads(json.dumps(rx["b"]))
    bad["advantages"] = [float("nan")]
    with pytest.raises(ProtocolError, match="finite"):
        get_batch(rx, bad)
    # a NaN logprob compares false with every tolerance: let through, it would switch off the audit's
    # logprob comparisons and (through the GRPO ratio) the training replay
    nan = TrainBatch([Trajectory("g0/e0", "g0", [1, 2, 3], [0, 1, 1], [0.0, -1.0, math.nan], 1.0, [0])], [0.5])
    frame = Frame()
    frame.header["b"] = put_batch(frame, nan)
    rx = Received(json.loads(json.dumps({**frame.header, "blobs": [len(b) for b in frame.blobs]})), frame.blobs)
    with pytest.raises(ProtocolError, match=r"trajectory g0/e0.logprobs: 1 non-finite value\(s\), the first nan at"):
        get_batch(rx, rx["b"])
    from targets.api import Completion

    for value in (math.nan, math.inf):
        frame = Frame()
        frame.header["c"] = put_completion(frame, Completion([4, 5], [-0.1, value], "length", 0, "cpu:0"))
        rx = Received(json.loads(json.dumps({**frame.header, "blobs": [len(b) for b in frame.blobs]})), frame.blobs)
        with pytest.raises(ProtocolError, match="completion.logprobs: 1 non-finite value.* at position 1"):
            get_completion(rx, rx["c"])
    with pytest.raises(ValueError, match="only 0 and 1"):  # the honest proxy will not send such a mask ...
        put_batch(Frame(), TrainBatch([Trajectory("g0/e0", "g0", [1, 2], [0, 2], [0.0, -1.0], 1.0, [0])], [0.5]))


def _received(build) -> tuple[Received, dict]:
    """What the harness decodes from a frame whose one entry ``build(frame)`` wrote (the candidate's
    process writes frames: a controller that writes its own skips every check the proxy makes)."""
    frame = Frame()
    frame.header["x"] = build(frame)
    rx = Received(json.loads(json.dumps({**frame.header, "blobs": [len(b) for b in frame.blobs]})), frame.blobs)
    return rx, rx["x"]


def test_the_harness_decoders_refuse_what_the_candidate_s_own_proxy_would_never_send():
    """... but the harness checks again what it receives: a mask weighting a token twice, a mask or
    logprobs that do not match the tokens, a continuation outside its prompt, an empty prompt, a
    completion's tokens without logprobs, and what an engine says of its work out of range."""
    from targets.api import Completion, GenerateRequest, SamplingParams

    def trajectory(mask, logprobs):
        def build(frame):
            fields = {"episode_id": "g0/e0", "group_id": "g0", "reward": 1.0, "weight_versions": [0]}
            fields |= {"created_at_step": 0, "timed_out": False, "tokens": frame.array([1, 2, 3], "i4")}
            return fields | {"loss_mask": frame.array(mask, "u1"), "logprobs": frame.array(logprobs, "f8")}

        return _received(build)

    for mask, logprobs, message in (
        ([0, 2, 1], [-1.0, -2.0], "loss_mask must hold only 0 and 1"),
        ([0, 1], [-1.0], "3 tokens, a mask of 2 with 1 response tokens"),
        ([0, 1, 1], [-1.0], "a mask of 3 with 2 response tokens, and 1 logprobs"),
    ):
        with pytest.raises(ProtocolError, match=message):
            get_trajectory(*trajectory(mask, logprobs), None)

    def request(prompt, continues):
        rx, d = _received(
            lambda frame: put_request(frame, GenerateRequest("g0/e0", 0, prompt, SamplingParams(4)), PromptMemory())
        )
        return rx, {**d, "continues": continues}

    assert get_request(*request([1, 2, 3], 2), PromptMemory()).continues == 2
    for continues in (3, -1):
        with pytest.raises(ProtocolError, match=r"continues .* must be within \[0, 3\)"):
            get_request(*request([1, 2, 3], continues), PromptMemory())
    with pytest.raises(ProtocolError, match="request for g0/e0: an empty prompt"):
        get_request(*request([], 0), PromptMemory())

    def completion(**fields):
        honest = Completion([4, 5], [-0.1, -0.2], "length", 0, "cpu:0", 0.5, 7)
        rx, d = _received(lambda frame: put_completion(frame, honest))
        if "logprobs" in fields:
            rx, d = _received(lambda frame: {**d, "logprobs": frame.array(fields.pop("logprobs"), "f8")})
        return rx, {**d, **fields}

    assert get_completion(*completion()) == Completion([4, 5], [-0.1, -0.2], "length", 0, "cpu:0", 0.5, 7)
    for fields, message in (
        ({"logprobs": [-0.1]}, "completion: 2 tokens but 1 logprobs"),
        ({"queued_s": -1.0}, "completion.queued_s: -1.0 seconds is negative"),
        ({"queued_s": "soon"}, "completion.queued_s: expected float"),
        ({"cached_tokens": -3}, "completion.cached_tokens: -3 is negative"),
        ({"cached_tokens": True}, "completion.cached_tokens: expected int"),
    ):
        with pytest.raises(ProtocolError, match=message):
            get_completion(*completion(**fields))


def test_an_async_channel_reports_a_peer_that_hangs_up_or_sends_garbage():
    async def main() -> tuple[str, str]:
        a, b = _pair()
        channel = await AsyncChannel.over(a)
        lost: list[str] = []
        channel.listen(lambda rx: None, lambda error: lost.append(str(error)))
        b.sendall(struct.pack("!I", 3) + b"{{{")
        await asyncio.sleep(0.05)
        c, d = _pair()
        other = await AsyncChannel.over(c)
        gone: list[str] = []
        other.listen(lambda rx: None, lambda error: gone.append(str(error)))
        d.close()
        await asyncio.sleep(0.05)
        return lost[0], gone[0]

    garbage, hangup = asyncio.run(main())
    assert "not JSON" in garbage and "closed the channel" in hangup


def test_a_peer_that_said_done_and_exited_is_heard_even_if_a_write_to_it_fails_first():
    """The CI failure of round 18: the controller sent "done" and exited; the harness's next reply hit
    a broken pipe, the transport closed before reading "done", and a good run was failed."""

    async def main() -> tuple[list[str], list[str]]:
        a, b = _pair()
        b.sendall(Frame(kind="done").encode())
        b.close()
        channel = await AsyncChannel.over(a)
        kinds: list[str] = []
        lost: list[str] = []
        channel.listen(lambda rx: kinds.append(rx.get("kind")), lambda error: lost.append(str(error)))
        channel.send(Frame(kind="reply"))  # before the loop has read anything: the write fails first
        await asyncio.sleep(0.05)
        return kinds, lost

    kinds, lost = asyncio.run(main())
    assert kinds == ["done"] and len(lost) == 1


def test_a_burst_is_handed_on_whole_however_the_socket_splits_it():
    """Under virtual time a burst's frames must reach the peer together: bytes that trickle in one at a
    time (a busy machine, a big burst) hand on nothing until the burst's marker, then all of it; a
    burst cut short by the sender's exit still hands on what did arrive."""

    async def main() -> tuple[list[str], list[str], list[str]]:
        a, b = _pair()
        receiver = await AsyncChannel.over(b)
        receiver.bursts = True
        handed: list[str] = []
        receiver.listen(lambda rx: handed.append(rx.get("kind")), lambda error: handed.append("lost"))
        burst = b"".join(Frame(kind=k, payload="x" * 3000).encode() for k in ("generate", "step", "idle"))
        marked = burst + _BURST_END_BYTES
        for at in range(len(marked) - 1):  # all but the marker's last byte, one byte a read
            a.send(marked[at : at + 1])
            await asyncio.sleep(0)
        await asyncio.sleep(0.02)
        before = list(handed)
        a.send(marked[-1:])
        await asyncio.sleep(0.02)
        whole = list(handed)
        handed.clear()
        a.sendall(Frame(kind="failed").encode())  # no marker: the sender died mid-burst
        a.close()
        await asyncio.sleep(0.05)
        return before, whole, handed

    before, whole, cut = asyncio.run(main())
    assert before == [] and whole == ["generate", "step", "idle"]
    assert cut == ["failed", "lost"]


def test_a_corked_burst_channel_ends_each_flush_with_the_marker_and_counts_only_frames():
    async def main() -> tuple[bytes, int]:
        a, b = _pair()
        sender = await AsyncChannel.over(a)
        sender.corked = sender.bursts = True
        sender.send(Frame(kind="generate"))
        sender.send(Frame(kind="idle"))
        sender.flush()
        sender.flush()  # nothing queued: no empty burst
        await asyncio.sleep(0.02)
        return b.recv(1 << 16), sender.sent

    data, sent = asyncio.run(main())
    assert data == Frame(kind="generate").encode() + Frame(kind="idle").encode() + _BURST_END_BYTES and sent == 2


def test_the_late_answer_to_a_call_whose_caller_went_away_is_dropped_and_the_channel_lives():
    """The controller finished with generates in flight, or dropped their episodes: the harness cancels
    their waiters and tells the cluster process to stop serving them, and an answer it sent before the
    cancel came arrives afterwards. It must not take the cluster channel down (a CI run failed a
    candidate with 'the peer closed the channel (invalid state)')."""
    from targets.api import Completion, Device, GenerateRequest, SamplingParams
    from targets.harness.ipc.remote import RemoteCluster
    from targets.harness.ipc.wire import put_completion

    async def main():
        a, b = _pair()
        cluster = RemoteCluster(await AsyncChannel.over(a), [Device("cpu:0", "cpu", 0)])
        cluster.start()
        peer = SyncChannel(b)
        request = GenerateRequest("e0", 0, [1, 2], SamplingParams(max_new_tokens=2))
        abandoned = asyncio.create_task(cluster.generate(request))
        await asyncio.sleep(0.01)
        first = await asyncio.to_thread(peer.recv)
        abandoned.cancel()
        await asyncio.sleep(0.01)
        cancel = await asyncio.to_thread(peer.recv)  # the cluster process cancels that call
        assert (cancel["method"], cancel["call"]) == ("cancel", first["id"])
        answer = Frame(id=first["id"])
        answer.header["completion"] = put_completion(answer, Completion([3, 4], [-0.1, -0.2], "length", 0, "e"))
        peer.send(answer)  # too late: its caller is gone
        second = asyncio.create_task(cluster.generate(request))
        rx = await asyncio.to_thread(peer.recv)
        reply = Frame(id=rx["id"])
        reply.header["completion"] = put_completion(reply, Completion([5], [-0.3], "stop", 0, "e"))
        peer.send(reply)
        return cluster._lost, await second

    lost, completion = asyncio.run(main())
    assert lost is None and completion.tokens == [5]


STUB_CLUSTER_STACK = """
import asyncio
from targets.api import Completion, Stack

CANCELLED = []  # the turns whose generate was cancelled


class Cluster:
    devices = []

    async def generate(self, request):
        if request.episode_id == "quick":
            return Completion([7], [-0.5], "stop", 0, "cpu:0")
        if request.episode_id == "self-cancelled":
            raise asyncio.CancelledError("the stack's own code, not the harness's cancel")
        try:
            await asyncio.Event().wait()  # a long turn
        except asyncio.CancelledError:
            CANCELLED.append(request.episode_id)
            raise

    async def close(self):
        pass


def build(runtime):
    async def make_cluster():
        return Cluster()

    return Stack(None, make_cluster, None, None, None)
"""


def test_the_cluster_process_cancels_a_generate_its_caller_gave_up(tmp_path, monkeypatch):
    """The harness cancels a turn whose episode was dropped: the cluster process cancels that call's
    task, so the candidate's ``generate`` sees the cancellation (and its engine can abort the request),
    acknowledges it (the harness then forgets the call: nothing kept a call a run) and serves the next
    calls. A CancelledError the stack's own code raises is an error like any, not a call left unanswered."""
    import sys

    from targets.api import Device, GenerateRequest, Runtime, SamplingParams, TrainingConfig, Workload
    from targets.harness.ipc.remote import CandidateError, RemoteCluster
    from targets.harness.ipc.wire import put_runtime
    from targets.harness.isolation.candidate_process import _serve_cluster

    (tmp_path / "stack").mkdir()
    (tmp_path / "stack" / "__init__.py").write_text(STUB_CLUSTER_STACK)
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # the stack's import prepends its folder
    workload = Workload(4, 2, 0, 0, 8, 8, 4, 32, TrainingConfig())
    runtime = Runtime("unused", "float32", (Device("cpu:0", "cpu", 0),), "vt_device_", (0,), workload, "cpu")

    async def main():
        ours, theirs = _pair()
        exports, _ = _pair()
        serving = asyncio.create_task(_serve_cluster(await AsyncChannel.over(theirs), exports, str(tmp_path)))
        channel = await AsyncChannel.over(ours)
        channel.send(Frame(kind="init", runtime=put_runtime(runtime)))
        assert (await channel.recv())["kind"] == "ready"
        cluster = RemoteCluster(channel, list(runtime.devices))
        cluster.start()
        params = SamplingParams(max_new_tokens=4)
        long = asyncio.create_task(cluster.generate(GenerateRequest("dropped", 0, [1, 2], params)))
        await asyncio.sleep(0.1)
        long.cancel()
        quick = await cluster.generate(GenerateRequest("quick", 0, [1, 2], params))
        with pytest.raises(CandidateError, match="CancelledError: the stack's own code"):
            await asyncio.wait_for(cluster.generate(GenerateRequest("self-cancelled", 0, [1, 2], params)), 10)
        await asyncio.sleep(0.1)
        cancelled = list(sys.modules["stack"].CANCELLED)  # before the close cancels whatever is left
        remembered = set(cluster._cancelled)
        await cluster.close()
        await serving
        return cancelled, quick, cluster._lost, remembered

    sys.modules.pop("stack", None)
    try:
        cancelled, quick, lost, remembered = asyncio.run(main())
    finally:
        sys.modules.pop("stack", None)
        sys.path.remove(str(tmp_path))
    assert cancelled == ["dropped"] and quick.tokens == [7] and lost is None and remembered == set()


# -- the sandbox refuses to fall back silently -------------------------------------------------------------


def test_auto_refuses_to_run_candidates_unisolated(monkeypatch):
    from targets.harness.isolation import sandbox

    monkeypatch.setattr(sandbox, "_bubblewrap_works", lambda: False)
    monkeypatch.setattr(sandbox, "_docker_image", lambda: None)
    with pytest.raises(sandbox.SandboxUnavailable, match="--sandbox subprocess"):
        sandbox.Sandbox.detect("auto")
    assert sandbox.Sandbox.detect("subprocess").backend == "subprocess"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_bubblewrap_binds_the_gpu_device_nodes_only_when_asked_and_keeps_writes_in(monkeypatch, tmp_path):
    """On a GPU target the candidate gets the NVIDIA device nodes; here a host character device not
    in bubblewrap's own /dev stands in for them (tests/test_gpu.py runs CUDA inside the sandbox)."""
    from targets.harness.isolation import sandbox

    node = next((n for n in ("/dev/vcs", "/dev/kmsg", "/dev/loop0", "/dev/vda") if os.path.exists(n)), None)
    if node is None:
        pytest.skip("no spare host device node to stand in for a GPU")
    monkeypatch.setattr(sandbox, "gpu_device_nodes", lambda: [node])
    box, work = sandbox.Sandbox("bubblewrap"), tmp_path / "work"
    work.mkdir()
    outside = (
        Path(sandbox.__file__).resolve().parents[2] / "written-from-the-sandbox"
    )  # the checkout: mounted read-only
    probe = (
        f"test -c {node} && echo sees-device; touch {work}/ok && echo wrote-inside; "
        f"touch {outside} || echo refused-outside"
    )
    for gpus, sees in ((True, True), (False, False)):
        command, env = box.wrap(["/bin/sh", "-c", probe], dict(os.environ), writable=[work], gpus=gpus)
        done = subprocess.run(command, capture_output=True, text=True, env=env or None, timeout=60, check=False)
        assert ("sees-device" in done.stdout) is sees, (gpus, done.stdout, done.stderr)
        assert "wrote-inside" in done.stdout and "refused-outside" in done.stdout, done.stdout
        assert not outside.exists()


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_a_command_tool_never_mounts_what_a_planted_link_points_to(tmp_path):
    """The implementer's shell command may write the workspace alone. A folder it named apart inside
    the workspace (``.vibetrain-tmp``, once) was mounted writable wherever a link planted there pointed."""
    from agents.llm.tools import RunCommand, Toolbox
    from targets.harness.isolation import sandbox

    workspace, elsewhere = tmp_path / "ws", tmp_path / "home"
    workspace.mkdir()
    elsewhere.mkdir()
    (workspace / ".vibetrain-tmp").symlink_to(elsewhere)
    box = sandbox.Sandbox("bubblewrap")
    tools = Toolbox(workspace, box)
    result = tools.run_command(RunCommand(command=f"touch {elsewhere}/planted; touch {workspace}/ok", timeout_s=60))
    assert (workspace / "ok").exists() and not (elsewhere / "planted").exists(), result
    with pytest.raises(ValueError, match="a writable path of the sandbox is a symbolic link"):
        box.wrap(["true"], {}, writable=[workspace / ".vibetrain-tmp"])


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_a_command_tool_reads_no_secret_from_the_sandboxs_init_nor_through_a_path_it_names(tmp_path, monkeypatch):
    """Planted by a prompt-injected agent: ``cat /proc/1/environ`` read the orchestrator's API keys from
    bwrap's own init (its environment was inherited whole: only the command's was cleared); and a command
    that is also a path (``WS/x;cat SECRET;:``, a link made first) was mounted read-only, link followed,
    showing the host's file. Neither reaches the agent now."""
    from agents.llm.tools import RunCommand, Toolbox
    from targets.harness.isolation import sandbox

    monkeypatch.setenv("OPENAI_API_KEY", "sk-orchestrators-own")
    workspace, secret = tmp_path / "ws", tmp_path / "home" / "id_rsa"
    workspace.mkdir()
    secret.parent.mkdir()
    secret.write_text("host secret\n")
    tools = Toolbox(workspace, sandbox.Sandbox("bubblewrap"))
    seen = tools.run_command(RunCommand(command="tr '\\0' '\\n' < /proc/1/environ; echo read-it", timeout_s=60))
    assert "read-it" in seen and "sk-orchestrators-own" not in seen, seen
    command = f"{workspace}/x;cat {secret};:"  # a shell command, and a path inside the workspace
    Path(command).parent.mkdir(parents=True)
    Path(command).symlink_to(secret)  # what the agent's first command made, in effect
    seen = tools.run_command(RunCommand(command=command, timeout_s=60))
    assert "host secret" not in seen, seen


# -- device memory, as the harness samples it ------------------------------------------------------------


def test_device_memory_is_sampled_on_the_visible_gpus_and_keeps_the_peak(monkeypatch):
    """NVML numbers devices physically: with CUDA_VISIBLE_DEVICES=3,5 the target's devices 0 and 1
    are GPUs 3 and 5. A fake NVML whose GPU 5 fills up and empties again: the peak stays."""
    import sys
    import threading
    import types

    from targets.harness.isolation.device_memory import DeviceMemoryMonitor

    used = {3: 100 << 20, 5: 200 << 20}
    full = threading.Event()  # the sampler read GPU 5 full (however late a busy machine ran it)

    def memory_info(handle):
        if used[handle] == 9000 << 20:
            full.set()
        return types.SimpleNamespace(used=used[handle])

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=memory_info,
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    with DeviceMemoryMonitor(2, interval_s=0.005) as monitor:
        used[5] = 9000 << 20
        assert full.wait(timeout=60)
        used[5] = 300 << 20
    assert monitor.peaks_mb == {0: 100.0, 1: 9000.0}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(RuntimeError, match="shows 1 GPU"):
        DeviceMemoryMonitor(2).__enter__()


def test_a_generate_and_a_drop_in_one_burst_decode_in_arrival_order():
    """A cancelled spare: its next turn's generate (a prompt delta against turn 0) and its drop arrive
    in one burst. The harness decodes the delta as the frame arrives, so the drop that follows (which
    forgets the episode's prompt) cannot break it; decoded in the call's task, it raised 'prefix 3'."""
    import asyncio

    from targets.api import Aborted, GenerateRequest, SamplingParams
    from targets.harness.clock import WallClock
    from targets.harness.ipc.channel import Received
    from targets.harness.isolation.controller_link import ControllerLink
    from targets.harness.isolation.traced_cluster import TracedCluster
    from targets.harness.trace import Trace

    controller_memory, seen, sent = PromptMemory(), [], []

    class Envs:  # what the link needs of the pool here
        def drop(self, episode, reason, idleness=None):
            seen.append(("drop", episode, reason))

    class Cluster:  # a candidate's cluster, answering by await
        devices: list = []

        async def generate(self, request):
            seen.append(("generate", request.prompt))
            raise Aborted("shrunk")

    def frame_of(request: GenerateRequest, id: int) -> Received:
        frame = Frame(kind="cluster", method="generate", id=id)
        frame.header["request"] = put_request(frame, request, controller_memory)
        return Received(json.loads(json.dumps({**frame.header, "blobs": [len(b) for b in frame.blobs]})), frame.blobs)

    async def burst():
        link = ControllerLink(None, Envs(), clock=WallClock(), virtual=False)
        link.cluster, link.send = TracedCluster(Cluster(), Trace(WallClock()), {}), sent.append
        link._dispatch(frame_of(GenerateRequest("g0/e5", 0, [1, 2, 3], SamplingParams(4)), 1))
        await asyncio.gather(*link._tasks.values(), return_exceptions=True)  # turn 0 served; then the burst:
        link._dispatch(frame_of(GenerateRequest("g0/e5", 1, [1, 2, 3, 4, 5], SamplingParams(4)), 2))
        link._dispatch(Received({"kind": "env", "method": "drop", "episode": "g0/e5", "reason": "redundant"}, []))
        await asyncio.gather(*link._tasks.values(), return_exceptions=True)
        assert not link.done.done(), link.done.exception()

    asyncio.run(burst())
    # turn 1 decoded whole, then cancelled by the drop before the cluster served it (the drop's
    # prompt-forgetting broke neither); both calls answered: turn 0 Aborted, turn 1 cancelled
    assert seen == [("generate", [1, 2, 3]), ("drop", "g0/e5", "redundant")]
    assert len(sent) == 2 and sent[0].header["error"]["type"] == "Aborted"
    assert "g0/e5 was dropped while its turn 1 generated" in sent[1].header["error"]["message"]


def test_a_turn_is_asked_once_at_a_time_and_a_failed_request_is_recorded():
    """Planted: a cluster that fails a turn it dislikes (an ordinary error after decoding it), or a
    controller that asks one turn twice at once so its cluster answers the draw it likes and never the
    other. The failure is in the trace (the audit refuses it: ``failed request``), and the second ask
    is refused while the first is under way; neither left a trace before."""
    from targets.api import GenerateRequest, SamplingParams
    from targets.harness.clock import WallClock
    from targets.harness.ipc.channel import Received
    from targets.harness.isolation.controller_link import ControllerLink
    from targets.harness.isolation.traced_cluster import TracedCluster
    from targets.harness.trace import Trace

    controller_memory, sent, trace = PromptMemory(), [], Trace(WallClock())
    unanswered = asyncio.Event()

    class Envs:
        def drop(self, episode, reason, idleness=None):
            pass

    class Cluster:  # turn 0 fails (a draw it disliked); turn 1 is never answered (a ghost to hedge with)
        devices: list = []

        async def generate(self, request):
            if request.turn == 0:
                raise RuntimeError("engine hiccup")
            await unanswered.wait()

    def frame_of(request: GenerateRequest, id: int) -> Received:
        frame = Frame(kind="cluster", method="generate", id=id)
        frame.header["request"] = put_request(frame, request, controller_memory)
        return Received(json.loads(json.dumps({**frame.header, "blobs": [len(b) for b in frame.blobs]})), frame.blobs)

    async def run():
        link = ControllerLink(None, Envs(), clock=WallClock(), virtual=False)
        link.cluster, link.send = TracedCluster(Cluster(), trace, {}), sent.append
        link._dispatch(frame_of(GenerateRequest("g0/e1", 0, [1, 2, 3], SamplingParams(4)), 1))
        await asyncio.gather(*link._tasks.values(), return_exceptions=True)
        link._dispatch(frame_of(GenerateRequest("g0/e1", 1, [1, 2, 3, 4], SamplingParams(4)), 2))
        link._dispatch(frame_of(GenerateRequest("g0/e1", 1, [1, 2, 3, 4], SamplingParams(4)), 3))
        await asyncio.sleep(0.01)
        for task in link._tasks.values():
            task.cancel()

    asyncio.run(run())
    failed = [e for e in trace.events if e.kind == "generate"]
    assert [(e.data["turn"], e.data["aborted"], e.data.get("failed")) for e in failed] == [
        (0, True, "RuntimeError: engine hiccup")
    ]
    assert [f.header["error"]["type"] for f in sent] == ["RuntimeError", "ValueError"], sent
    assert "g0/e1 turn 1 is being generated already" in sent[1].header["error"]["message"]


def test_an_engine_s_word_on_its_work_is_held_to_what_the_harness_saw():
    """``Completion.queued_s`` and ``cached_tokens`` are the engine's word (calibration's alone): a wait
    longer than the request took, or a prefix longer than its prompt, is recorded cut to what the harness
    saw and marked (it raised in the offline evaluator, turning a validated round into an error)."""
    from targets.api import Completion, GenerateRequest, SamplingParams
    from targets.harness.clock import WallClock
    from targets.harness.isolation.traced_cluster import TracedCluster
    from targets.harness.trace import Trace

    class Cluster:
        devices: list = []

        async def generate(self, request):
            await asyncio.sleep(0.01)
            said = (100.0, 99) if request.turn else (0.001, 2)  # turn 1 overstates both
            return Completion([7], [-0.5], "length", 0, "cpu:0", *said)

    trace = Trace(WallClock())

    async def run():
        cluster = TracedCluster(Cluster(), trace, {})
        for turn in (0, 1):
            answered = asyncio.get_running_loop().create_future()
            cluster.generate_then(GenerateRequest("g0/e0", turn, [1, 2, 3], SamplingParams(1)), answered.set_result)
            await answered

    asyncio.run(run())
    honest, overstated = [e.data for e in trace.events if e.kind == "generate"]
    assert (honest["queued"], honest["cached"], "word_cut" in honest) == (0.001, 2, False)
    assert overstated["queued"] <= 0.5 and overstated["cached"] == 3 and overstated["word_cut"] is True


def test_the_rollout_counts_as_suspended_until_its_resume_begins():
    """Planted: a cluster that holds its resume call open while it serves. Its episodes were counted as
    suspended until the resume returned, so one the stack held meanwhile was held by no one; the count now
    ends as the resume begins (an honest resume serves nothing until it returns)."""
    from targets.harness.clock import WallClock
    from targets.harness.ipc.channel import Received
    from targets.harness.isolation.controller_link import ControllerLink
    from targets.harness.isolation.traced_cluster import TracedCluster
    from targets.harness.trace import Trace

    woken, suspended_during = asyncio.Event(), []

    class Cluster:
        devices: list = []

        async def suspend(self):
            pass

        async def resume(self):
            await woken.wait()

        async def residency(self):
            return {}

    async def run():
        link = ControllerLink(None, SimpleNamespace(), clock=WallClock(), virtual=False)
        link.cluster, link.send = TracedCluster(Cluster(), Trace(WallClock()), {}), lambda frame: None
        link._dispatch(Received({"kind": "cluster", "method": "suspend", "id": 1}, []))
        await asyncio.gather(*link._tasks.values())
        suspended_during.append(link.activity._suspended)
        link._dispatch(Received({"kind": "cluster", "method": "resume", "id": 2}, []))
        await asyncio.sleep(0.01)
        suspended_during.append(link.activity._suspended)  # the resume under way
        woken.set()
        await asyncio.gather(*link._tasks.values())

    asyncio.run(run())
    assert suspended_during == [True, False]


@pytest.mark.parametrize("suspend", ["fails", "held open"])
def test_a_suspend_that_never_returned_paused_nothing(suspend):
    """Planted: the candidate's cluster fails its suspend (the controller swallows the error and goes on), or
    holds the call open while it serves. The rollout counted as suspended from the suspend's start and, the
    suspend never returning, for the rest of the run: every episode the stack then held was held by no one,
    and the net never judged its group. It now counts as suspended from the suspend's return (the mechanism
    rule's window begins there too), so an idle episode is held while another's request is under way."""
    from targets.harness.clock import WallClock
    from targets.harness.ipc.channel import Received
    from targets.harness.isolation.controller_link import ControllerLink
    from targets.harness.isolation.traced_cluster import TracedCluster
    from targets.harness.trace import Trace

    held, released = [], asyncio.Event()

    class Cluster:
        devices: list = []

        async def suspend(self):
            if suspend == "fails":
                raise RuntimeError("planted: a suspend that fails")
            await released.wait()

        async def residency(self):
            return {}

    async def run():
        link = ControllerLink(None, SimpleNamespace(), clock=WallClock(), virtual=False)
        link.cluster, link.send = TracedCluster(Cluster(), Trace(WallClock()), {}), lambda frame: None
        for episode in ("idle", "busy"):
            link.activity.created(episode)
        link.activity.begin("busy", generate=True)  # a request under way: the engines serve someone
        link._dispatch(Received({"kind": "cluster", "method": "suspend", "id": 1}, []))
        await asyncio.sleep(0.2)
        held.append(link.activity.of("idle").held_s)
        released.set()
        await asyncio.gather(*link._tasks.values(), return_exceptions=True)

    asyncio.run(run())
    assert held[0] >= 0.15, held


def test_a_cluster_call_right_behind_the_hello_waits_for_the_cluster():
    """A controller may say hello and call generate in one burst, before the harness has built the
    cluster: the call is served once it has, not refused as a protocol break; a call before any
    hello still is one."""
    from targets.api import Completion, Declared, EngineSettings, GenerateRequest, SamplingParams
    from targets.harness.clock import WallClock
    from targets.harness.ipc.channel import Received
    from targets.harness.ipc.wire import put_declared, put_engine_settings
    from targets.harness.isolation.controller_link import ControllerLink
    from targets.harness.isolation.traced_cluster import TracedCluster
    from targets.harness.trace import Trace

    sent = []
    envs = SimpleNamespace(workload=SimpleNamespace(over_declared_limits=lambda declared: None), max_extra=0)

    class Cluster:
        devices: list = []

        async def generate(self, request):
            return Completion([7, 8, 9], [0.0] * 3, "stop", 0)

    def generate(id: int) -> Received:  # the controller's first call for the episode
        frame = Frame(kind="cluster", method="generate", id=id)
        request = GenerateRequest("g0/e0", 0, [1, 2], SamplingParams(4))
        frame.header["request"] = put_request(frame, request, PromptMemory())
        return Received(json.loads(json.dumps({**frame.header, "blobs": [len(b) for b in frame.blobs]})), frame.blobs)

    async def run() -> None:
        early = ControllerLink(None, envs, clock=WallClock(), virtual=False)
        with pytest.raises(ProtocolError, match="before the controller's hello"):
            early._dispatch(generate(1))
        link = ControllerLink(None, envs, clock=WallClock(), virtual=False)
        link.send = sent.append
        hello = {"kind": "hello", "declared": put_declared(Declared()), "rollout": [], "train": []}
        hello["engine"] = put_engine_settings(EngineSettings())
        link._dispatch(Received(hello, []))
        link._dispatch(generate(1))
        assert not sent and not link._tasks  # waiting for the cluster
        link.open(TracedCluster(Cluster(), Trace(WallClock()), {}))
        await asyncio.gather(*link._tasks.values())
        assert not link.done.done(), link.done.exception()

    asyncio.run(run())
    assert len(sent) == 1 and sent[0].header.get("id") == 1 and "completion" in sent[0].header


@pytest.mark.parametrize(
    "frame, refused",
    [
        ({"kind": "env", "method": "new_group", "group": 3, "extra": 0}, "new group 3, the harness's next is 1"),
        ({"kind": "env", "method": "drop", "episode": "g0/e1", "reason": "too_long"}, "drop reason must be one of"),
        ({"kind": "env", "method": "drop", "episode": "g7/e0", "reason": "redundant"}, "no group of that name"),
        ({"kind": "env", "method": "reset", "episode": "g7/e0", "id": 5}, "no episode 'g7/e0': the harness never"),
        ({"kind": "cluster", "method": "shrink", "devices": ["cpu:9"], "id": 5}, "unknown devices ['cpu:9']"),
        # a device named twice counted twice in the simulator (a step on [d] * 8 trained 2.2x faster: a review
        # of the harness)
        (
            {"kind": "cluster", "method": "shrink", "devices": ["cpu:0", "cpu:0"], "id": 5},
            "shrink names a device twice: ['cpu:0', 'cpu:0']",
        ),
    ],
    ids=[
        "group numbered ahead",
        "drop reason",
        "drop of no group",
        "unknown episode",
        "unknown device",
        "a device twice",
    ],
)
def test_a_frame_the_controllers_proxy_never_sends_is_refused_by_the_harness(tiny_spec, frame, refused):
    """The controller's proxy (``isolation/candidate_process.py``) numbers groups, checks drop reasons and
    names only the runtime's devices, but a controller can write frames on the channel itself: the harness
    refuses each such frame on its own side. A break of the protocol's numbering fails the run; a call the
    contract refuses is answered with the error, as in-process."""
    from targets.harness.clock import WallClock
    from targets.harness.environments.pool import EnvironmentPool
    from targets.harness.ipc.channel import Received
    from targets.harness.isolation.controller_link import ControllerLink
    from targets.harness.isolation.traced_cluster import TracedCluster
    from targets.harness.trace import Trace

    sent = []

    class Cluster:
        devices = [SimpleNamespace(id="cpu:0"), SimpleNamespace(id="cpu:1")]

    async def run() -> None:
        clock = WallClock()
        envs = EnvironmentPool(tiny_spec.workload, clock, Trace(clock), counts=True)
        link = ControllerLink(None, envs, clock=clock, virtual=False)
        link.cluster, link.send = TracedCluster(Cluster(), Trace(clock), {}), sent.append
        link._dispatch(Received({"kind": "env", "method": "new_group", "group": 0, "extra": 0}, []))  # g0, honest
        if "id" not in frame:  # a frame that is not a call: refused as it is read
            with pytest.raises(ProtocolError, match=re.escape(refused)):
                link._dispatch(Received(frame, []))
            return
        link._dispatch(Received(frame, []))
        await asyncio.gather(*link._tasks.values())
        assert not link.done.done(), link.done.exception()  # the run goes on: the controller is told

    asyncio.run(run())
    if "id" in frame:
        [reply] = sent
        assert reply.header["id"] == 5 and refused in reply.header["error"]["message"], reply.header


@pytest.mark.parametrize("method", ["train", "train_part"])
def test_a_training_call_naming_no_device_is_refused(method):
    """Planted (a review of the harness): a colocated stack that never shrinks calls ``train(batch, [])`` and its
    cluster trains on a device whose engine is awake. The mechanism rule reads the devices a step names, and
    with none had nothing to hold; the harness refuses the call, before it reaches the cluster."""
    from targets.harness.clock import WallClock
    from targets.harness.ipc.channel import Frame, Received
    from targets.harness.isolation.controller_link import ControllerLink
    from targets.harness.isolation.traced_cluster import TracedCluster
    from targets.harness.trace import Trace

    class Cluster:
        devices = [SimpleNamespace(id="cpu:0")]

        async def train(self, batch, devices):  # pragma: no cover - refused before it is reached
            raise AssertionError("reached the cluster")

    async def run() -> None:
        link = ControllerLink(None, SimpleNamespace(), clock=WallClock(), virtual=False)
        link.cluster = TracedCluster(Cluster(), Trace(WallClock()), {})
        call = Received({"kind": "cluster", "method": method, "devices": [], "id": 5}, [])
        await link._cluster(call, Frame(kind="reply"), None)

    with pytest.raises(ValueError, match=f"{method} names no device: a step trains on the devices it names"):
        asyncio.run(run())


def test_a_step_whose_action_holds_an_id_outside_the_vocabulary_is_the_controllers_error(tiny_spec):
    """Planted (a review of the harness): a controller steps an episode with token id -1. A user's environment
    decodes actions with the model's tokenizer, as does the reward model at an episode's end: the tokenizer
    raised, and the run stopped as the environment's (or the reward model's) failure, the search with it. The
    harness refuses the step as the controller's error, and the run goes on."""
    from targets.harness.clock import WallClock
    from targets.harness.environments.pool import EnvironmentPool
    from targets.harness.ipc.channel import Frame, Received
    from targets.harness.isolation.controller_link import ControllerLink
    from targets.harness.isolation.traced_cluster import TracedCluster
    from targets.harness.trace import Trace

    sent, vocab = [], tiny_spec.model.config.vocab_size

    async def run() -> None:
        clock = WallClock()
        envs = EnvironmentPool(tiny_spec.workload, clock, Trace(clock))
        link = ControllerLink(None, envs, clock=clock, virtual=False, vocab=vocab)
        link.cluster, link.send = TracedCluster(SimpleNamespace(devices=[]), Trace(clock), {}), sent.append
        link._dispatch(Received({"kind": "env", "method": "new_group", "group": 0, "extra": 0}, []))
        link._dispatch(Received({"kind": "env", "method": "reset", "episode": "g0/e0", "id": 1}, []))
        for number, action in ((2, [5, -1]), (3, [5, vocab])):
            frame = Frame()
            step = {"kind": "env", "method": "step", "episode": "g0/e0", "action": frame.array(action, "i4")}
            link._dispatch(Received({**step, "id": number}, frame.blobs))
        assert not link.done.done(), link.done.exception()  # the run goes on: the controller is told

    asyncio.run(run())
    errors = [f.header["error"]["message"] for f in sent if "error" in f.header]
    assert errors == [
        f"step.action: token id -1 is not in the model's vocabulary of {vocab}",
        f"step.action: token id {vocab} is not in the model's vocabulary of {vocab}",
    ], [f.header for f in sent]


def test_groups_past_twice_the_in_flight_bound_are_a_protocol_break(tiny_spec):
    """Planted (a review of the harness): a controller calling ``new_group`` without end. The audit's in-flight
    bound is checked after the run, and until then each episode is an environment made: a user's factory
    failing at its thousandth would be blamed on the environment, and stop the search. The harness refuses a
    group past twice the bound as the controller's protocol break; dropped episodes leave the flight."""
    from targets.harness.clock import WallClock
    from targets.harness.environments.pool import EnvironmentPool
    from targets.harness.ipc.channel import Received
    from targets.harness.isolation.controller_link import FLIGHT_MARGIN, ControllerLink
    from targets.harness.isolation.traced_cluster import TracedCluster
    from targets.harness.trace import Trace

    w = tiny_spec.workload
    bound = w.groups_per_step * (1 + w.async_ratio) * w.group_size
    allowed = FLIGHT_MARGIN * bound // w.group_size  # groups

    async def run() -> None:
        clock = WallClock()
        link = ControllerLink(None, EnvironmentPool(w, clock, Trace(clock), counts=True), clock=clock, virtual=False)
        link.cluster = TracedCluster(SimpleNamespace(devices=[]), Trace(clock), {})  # the run started
        for group in range(allowed):
            link._dispatch(Received({"kind": "env", "method": "new_group", "group": group, "extra": 0}, []))
        with pytest.raises(ProtocolError, match=f"over {FLIGHT_MARGIN} times the bound of {bound} the audit holds"):
            link._dispatch(Received({"kind": "env", "method": "new_group", "group": allowed, "extra": 0}, []))
        # a training call on episodes of its own naming frees no room (simulated: a trajectory is its count)
        fake = {"group_id": "x", "count": 2, "reward": 0.0, "weight_versions": [0], "created_at_step": 0}
        batch = {"trajectories": [{**fake, "episode_id": f"x/e{m}", "timed_out": False} for m in range(64)]}
        batch["advantages"] = [0.0] * 64
        link.memory.counts = True
        link._dispatch(Received({"kind": "cluster", "method": "train", "devices": [], "batch": batch, "id": 9}, []))
        with pytest.raises(ProtocolError, match="over 2 times the bound"):
            link._dispatch(Received({"kind": "env", "method": "new_group", "group": allowed, "extra": 0}, []))
        for m in range(w.group_size):  # the first group handed back: room for one more
            link._dispatch(
                Received({"kind": "env", "method": "drop", "episode": f"g0/e{m}", "reason": "end_of_run"}, [])
            )
        link._dispatch(Received({"kind": "env", "method": "new_group", "group": allowed, "extra": 0}, []))
        await asyncio.gather(*link._tasks.values(), return_exceptions=True)

    asyncio.run(run())


def test_an_environment_the_users_entry_fails_to_make_mid_run_is_the_environments_fault(tiny_spec):
    """Environments after the first are made as the controller asks for groups; a factory that raised then
    (a UserEnvironmentError, a ValueError too) was read as the controller breaking the protocol: the round
    was rejected instead of the run stopping on the user's environment. It fails the run as that error."""
    from targets.harness.clock import WallClock
    from targets.harness.environments.adapters import UserEnvironmentError
    from targets.harness.ipc.channel import Received
    from targets.harness.isolation.controller_link import ControllerLink

    class Envs:  # a pool whose user factory raises when the second group is made
        groups_created, workload = 1, tiny_spec.workload

        def new_group(self, extra, relaunch):
            raise UserEnvironmentError("environment entry 'my_envs:make_flaky' raised OSError making an environment")

    async def run() -> BaseException | None:
        link = ControllerLink(None, Envs(), clock=WallClock(), virtual=False)
        link.cluster = SimpleNamespace()
        link._on_frame(Received({"kind": "env", "method": "new_group", "group": 1, "extra": 0}, []))
        return link.done.exception()

    failed = asyncio.run(run())
    assert isinstance(failed, UserEnvironmentError) and "make_flaky" in str(failed), failed


@pytest.mark.parametrize("state", [{"cpu:0": "engine"}, {"cpu:0": ["engine", 1]}, [["cpu:0", ["engine"]]]])
def test_a_residency_the_audit_could_not_read_is_refused_where_it_is_reported(state):
    """The order-of-service and placement rules read the cluster's residency after each switch: a report of
    another shape (a string where a list belongs, which every ``"engine" in ...`` test would read as true)
    ends the run at the switch it follows, not later inside the audit."""
    from targets.harness.clock import WallClock
    from targets.harness.isolation.traced_cluster import TracedCluster
    from targets.harness.trace import Trace

    class Cluster:
        devices: list = []

        async def shrink(self, devices):
            pass

        async def residency(self):
            return state

    traced = TracedCluster(Cluster(), Trace(WallClock()), {})
    with pytest.raises(ProtocolError, match="residency must map devices to lists of component names"):
        asyncio.run(traced.shrink([]))
    assert not [e for e in traced.trace.events if e.kind == "device_state"]


def test_a_harness_error_in_a_cluster_call_fails_the_run_instead_of_leaving_the_controller_waiting():
    """An error no cluster call may raise (a harness bug: here a ZeroDivisionError out of suspend) fails
    the run with it at once; before, it escaped a task nobody awaited and the controller waited for
    its answer until the run's time limit."""
    from targets.harness.clock import WallClock
    from targets.harness.ipc.channel import Received
    from targets.harness.isolation.controller_link import ControllerLink
    from targets.harness.isolation.traced_cluster import TracedCluster
    from targets.harness.trace import Trace

    sent = []

    class Cluster:
        devices: list = []

        async def suspend(self):
            raise ZeroDivisionError("planted: a harness bug")

    async def run() -> BaseException | None:
        link = ControllerLink(None, SimpleNamespace(), clock=WallClock(), virtual=False)
        link.cluster, link.send = TracedCluster(Cluster(), Trace(WallClock()), {}), sent.append
        link._dispatch(Received({"kind": "cluster", "method": "suspend", "id": 1}, []))
        await asyncio.gather(*link._tasks.values())
        return link.done.exception() if link.done.done() else None

    failure = asyncio.run(run())
    assert isinstance(failure, ZeroDivisionError) and "planted" in str(failure), failure
    assert not sent  # nothing to answer: the run is over


def test_a_step_answer_the_controllers_done_overtook_is_dropped_not_sent_on_its_closed_socket():
    """An honest controller may finish with a spare's step still under way, say done and exit: the
    step's timer can fire in the loop turn that read the done frame, its socket already closed. On the
    real run's strict loop that send raised 'the channel is closed' and failed the run (a fresh-clone
    suite, hardware affinity's real run); the answer is dropped now, and a send before done still goes."""
    from targets.api import StepResult
    from targets.harness.clock import WallClock
    from targets.harness.ipc.channel import Received
    from targets.harness.isolation.controller_link import ControllerLink
    from targets.harness.strict_loop import run_strict

    sent = []

    class Channel:  # the controller's socket: closed once the controller has exited
        closed = False
        closing = False  # the loss not yet seen (the next test's case): only the done frame drops the answer

        def send(self, frame):
            if self.closed:
                raise ProtocolError("the channel is closed")
            sent.append(frame)

    class Episode:
        asynchronous = False

        def begin_step(self):
            return 0.01, 0  # the environment's latency, failures

        def end_step(self, action, latency, failures):
            return StepResult([5], 0.0, False)

    def step(id: int) -> Received:
        frame = Frame(kind="env", method="step", episode="g0/e1", id=id)
        frame.header["action"] = put_tokens(frame, [3, 4], False)
        return Received(json.loads(json.dumps({**frame.header, "blobs": [len(b) for b in frame.blobs]})), frame.blobs)

    async def run(channel: Channel) -> None:
        link = ControllerLink(channel, SimpleNamespace(), clock=WallClock(), virtual=False)
        link.cluster, link.episodes["g0/e1"] = SimpleNamespace(training=False), Episode()  # the run has started
        link._dispatch(step(1))
        await asyncio.sleep(0.05)  # answered while the controller runs
        link._dispatch(step(2))
        link._dispatch(Received({"kind": "done"}, []))
        channel.closed = True
        await asyncio.sleep(0.05)  # the second step's timer fires after the done

    run_strict(run(Channel()), asyncio.new_event_loop())
    assert [frame.header["id"] for frame in sent] == [1]


def test_an_answer_due_as_the_controllers_channel_closes_leaves_the_run_to_the_loss():
    """The controller said its last and exited while the harness wrote to it: the failed write closes
    the transport at once, and ``connection_lost`` (which reads what the controller sent last) runs a
    loop turn later. An answer due in between (a generate's done callback, a step's timer) raised 'the
    channel is closed' out of a plain callback, and the run failed as the harness's own CallbackFailed
    (a planted judge test, under load). The answer is dropped; the loss still ends the run, with its cause."""
    from targets.harness.clock import WallClock
    from targets.harness.isolation.controller_link import ControllerLink
    from targets.harness.strict_loop import run_strict

    async def run() -> None:
        ours, theirs = socket.socketpair()
        channel = await AsyncChannel.over(ours)
        link = ControllerLink(channel, SimpleNamespace(), clock=WallClock(), virtual=False)
        served = asyncio.create_task(link.serve())
        await asyncio.sleep(0)
        theirs.close()
        channel.transport.close()  # as a failed write does: closing now, connection_lost next turn
        link.send(Frame(id=1))  # a generate's answer, due in between
        with pytest.raises(ProtocolError, match="hung up before it was done"):
            await served

    run_strict(run(), asyncio.new_event_loop())


def test_a_device_memory_sample_that_fails_mid_run_is_raised_not_a_lower_peak(monkeypatch):
    """NVML failing in the sampling thread ended the thread quietly: the peaks stopped there and the
    run's peak memory was under-reported. A fake NVML (this machine has no GPU) fails its third sample."""
    import time
    import types

    from targets.harness.isolation.device_memory import DeviceMemoryMonitor

    samples = []

    def memory_info(handle):
        samples.append(handle)
        if len(samples) == 3:
            raise OSError("planted: NVML_ERROR_GPU_IS_LOST")
        return SimpleNamespace(used=len(samples) * 2**20)

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=memory_info,
    )
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(RuntimeError, match="failed mid-run: planted: NVML_ERROR_GPU_IS_LOST"):
        with DeviceMemoryMonitor(1, interval_s=0.01):
            time.sleep(0.2)


def test_device_memory_finds_gpus_named_by_uuid_as_by_index(monkeypatch):
    """CUDA_VISIBLE_DEVICES may name GPUs by UUID or a UUID's prefix (schedulers often do): ``int()`` of one
    raised, and every GPU run under such a scheduler failed before it started. Whole UUIDs and prefixes are
    matched against each GPU's own (an older binding's as bytes); an entry matching none, or two, is named.
    A fake NVML (this machine has no GPU)."""
    import types

    from targets.harness.isolation.device_memory import DeviceMemoryMonitor

    uuids = [b"GPU-8f1c2a00-0000", b"GPU-8f1c2b00-0000", b"GPU-77aa0000-0000", b"GPU-0000aaaa-0000"]
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(uuids),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUUID=lambda gpu: uuids[gpu],
        nvmlDeviceGetMemoryInfo=lambda gpu: SimpleNamespace(used=(gpu + 1) * 2**20),
    )
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, GPU-77aa, GPU-8f1c2b00-0000")
    with DeviceMemoryMonitor(3, interval_s=0.01) as monitor:
        pass
    assert monitor.peaks_mb == {0: 4.0, 1: 3.0, 2: 2.0}  # GPUs 3, 2 and 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f1c")
    with pytest.raises(RuntimeError, match="'GPU-8f1c' names 2 of this machine's GPUs"):
        DeviceMemoryMonitor(1).__enter__()


def test_a_stack_runs_from_the_same_kind_of_folder_whether_it_is_the_candidate_or_the_best(tmp_path):
    """A red team's stack looked at the folder it ran from: the candidate's was the round's worktree (a .git
    file, named round-N-judged, times to the nanosecond), the best's an export named baseline with its
    DESIGN.md and .vibetrain records (whole-second times from git's archive). Slowed only where it found
    itself the best, it had every later candidate promoted, its own copy too. Every measured run runs a copy
    of ``stack/`` alone, in a fresh folder of a random name, of one time and standard modes; a link to a file
    beside ``stack/``, which dangles there, is no change the candidate made."""
    import os

    from skills.starter import write_starter
    from targets.harness.isolation.launch import Limits
    from targets.harness.isolation.sandbox import Sandbox
    from targets.harness.target import Target
    from tests.planting import replaced

    target = Target.load("qwen3-8b-h800x16")
    seen = (
        "    async def run(self, cluster, envs, steps: int) -> None:\n"
        "        from pathlib import Path\n"
        "        here = Path(__file__).resolve().parent\n"
        "        root, mode = here.parent, oct(here.stat().st_mode & 0o777)\n"
        "        whole = here.stat().st_mtime_ns % 10**9 == 0\n"
        "        raise RuntimeError(f'seen {root.name[:16]} {sorted(p.name for p in root.iterdir())} {whole} {mode}')\n"
    )
    said = []
    for name, extra in (("round-3-judged", ".git"), ("baseline", ".vibetrain")):
        stack = write_starter(tmp_path / name, target.spec, "colocate")
        path = stack / "stack" / "colocate.py"
        path.write_text(replaced(path.read_text(), seen.split("\n")[0] + "\n", seen, "run() not found"))
        (stack / extra).write_text("gitdir: elsewhere\n")
        if name == "baseline":  # as git's archive leaves it
            os.utime(stack / "stack", ns=(10**18, 10**18))
            os.chmod(stack / "stack", 0o775)
        else:
            (stack / "data.json").write_text("{}")
            (stack / "stack" / "data.json").symlink_to("../data.json")
        session = Session(target, Sandbox("subprocess"), Limits(time_s=300))
        measured = session.measure(stack, tmp_path / f"out-{name}", 0)
        assert not any("changed while it ran" in r for r in measured.reasons), measured.reasons
        said.append(next(r for r in measured.reasons if "seen" in r).split("seen ")[1].splitlines()[0])
    # (its folder's time is the run's own: it writes its bytecode there, as any run does)
    assert said[0] == said[1] and said[0].startswith("vibetrain-stack- ['stack'] ") and said[0].endswith(" 0o755"), said
    missing = Session(target, Sandbox("subprocess"), Limits(time_s=300)).measure(tmp_path, tmp_path / "out", 0)
    assert not missing.ok and any("has no stack/__init__.py" in r for r in missing.reasons), missing.reasons
