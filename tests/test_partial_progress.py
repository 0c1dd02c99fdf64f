"""The partial-progress rule (``check_partial_progress`` in targets/harness/judge/selection.py) on
traces built by hand: with ``partial_rollout`` declared, an interrupted request reported with nothing
decoded, once a request its engine received later had decoded a token, is a partial the cluster
emptied (the turn restarts from scratch, and the stack keeps the samples it likes). Each of the two
witnesses the rule takes is planted alone, and so are the honest traces beside them. The end-to-end
plant (``planting.PLANTS["empty_partials"]``, tests/test_isolation.py) acts only where the run gives it
a witness; these say which witness the rule read, every time."""

from __future__ import annotations

from targets.api import TraceEvent
from targets.harness.judge.selection import check_partial_progress
from targets.harness.judge.trace_index import Reasons, TraceIndex


def _start(partial_rollout: bool = True) -> TraceEvent:
    return TraceEvent(
        "run_start",
        0.0,
        {"devices": ["cpu:0"], "tokens_recorded": True, "declared": {"partial_rollout": partial_rollout}},
    )


def _request(episode: str, start: float, end: float, tokens: int, aborted: bool = False) -> TraceEvent:
    """One request on cpu:0: answered with ``tokens`` tokens, or (``aborted``) cut with that partial."""
    return TraceEvent(
        "generate",
        end,
        {
            "episode": episode,
            "turn": 0,
            "start": start,
            "aborted": aborted,
            "device": "cpu:0",
            "prompt": [4] * 12,
            "tokens": [5] * tokens,
            "logprobs": [-1.0] * tokens,
            "finish": "abort" if aborted else "length",
            "version": 0,
        },
    )


# the sync that cut cpu:0's requests short at 1.0 s (an abort the audit explains needs its cause)
CUT = TraceEvent("sync", 1.01, {"start": 0.99, "devices": ["cpu:0"], "version": 1, "interrupt": True})


def _judge(*requests: TraceEvent, partial_rollout: bool = True) -> list[str]:
    events = [_start(partial_rollout), *sorted([*requests, CUT], key=lambda e: e.t)]
    r = Reasons()
    check_partial_progress(TraceIndex.of(events), r)
    return r.lines()


def test_an_empty_partial_after_a_later_request_finished_is_named():
    """Witness one: a request received after it finished, with tokens, before it was cut."""
    reasons = _judge(_request("held/e0", 0.0, 1.0, 0, aborted=True), _request("later/e0", 0.1, 0.5, 8))
    assert len(reasons) == 1, reasons
    assert reasons[0].startswith("empty partial: episode held/e0 turn 0 was interrupted on cpu:0 at 1.00s"), reasons


def test_an_empty_partial_beside_a_later_request_cut_with_tokens_is_named():
    """Witness two: one interruption cut both, and the one received later had decoded a token."""
    reasons = _judge(_request("held/e0", 0.0, 1.0, 0, aborted=True), _request("later/e0", 0.1, 1.0, 3, aborted=True))
    assert len(reasons) == 1 and reasons[0].startswith("empty partial: episode held/e0 turn 0"), reasons


def test_the_honest_orders_of_the_same_requests_pass():
    """The later request empty (it waited behind the earlier one), or nothing decoded by anyone."""
    late = _request("late/e0", 0.1, 1.0, 0, aborted=True)
    assert _judge(_request("first/e0", 0.0, 0.5, 8), late) == []
    assert _judge(_request("first/e0", 0.0, 1.0, 3, aborted=True), late) == []
    assert _judge(_request("first/e0", 0.0, 1.0, 0, aborted=True), late) == []


def test_a_stack_that_restarts_its_turns_is_not_held_to_its_partials():
    """Without ``partial_rollout`` a cut turn is generated anew whatever it decoded: the partial is
    evidence of nothing the stack uses (the restart's own rules hold it: docs/judge.md, "selection")."""
    held, later = _request("held/e0", 0.0, 1.0, 0, aborted=True), _request("later/e0", 0.1, 0.5, 8)
    assert _judge(held, later, partial_rollout=False) == []
