"""The engines' order of service (targets/harness/judge/service_order.py): a request a real cluster
held back while its engine served later ones decodes fewer tokens than those later ones prove it sat
through; an honest engine's never does (the audit of tests/test_audit.py's honest run says so too)."""

from __future__ import annotations

import pytest

from targets.api import TraceEvent
from targets.harness.judge.service_order import check_service_order
from targets.harness.judge.trace_index import Reasons, TraceIndex


def _start(speculative_tokens: int = 0, prefill_chunk: int = 0) -> TraceEvent:
    settings = {"speculative_tokens": speculative_tokens, "prefill_chunk": prefill_chunk}
    return TraceEvent(
        "run_start",
        0.0,
        {"devices": ["cpu:0", "cpu:1"], "tokens_recorded": True, "engines": {}, "declared": {}, "engine": settings},
    )


def _resident(t: float = 0.0, cpu1: str = "engine") -> TraceEvent:
    """The cluster's residency: cpu:0 an engine, cpu:1 ``cpu1``."""
    return TraceEvent("device_state", t, {"resident": {"cpu:0": ["engine"], "cpu:1": [cpu1]}})


def _served(episode: str, start: float, end: float, tokens: int | None, device: str | None = "cpu:0", **data):
    """Answered with ``tokens`` (``aborted=True``: interrupted with that partial; None: none sent)."""
    event = TraceEvent(
        "generate",
        end,
        {
            "episode": episode,
            "turn": 0,
            "start": start,
            "aborted": False,
            "device": device,
            "prompt": [4] * 12,
            "tokens": [5] * (tokens or 0),
            "finish": "length",
            **data,
        },
    )
    if tokens is None:
        del event.data["tokens"]
    return event


def _later_ones(device: str = "cpu:0", count: int = 10, tokens: int = 16, text: str = "") -> list[TraceEvent]:
    """``count`` requests received after the first one's 0.0 s, one after another, 0.25 s each; ``text``
    "repeated": each answers its prompt again (prompt lookup could draft all but its first token),
    "unrepeated": tokens its prompt never held (nothing to draft from), else one token repeated."""
    data = {
        "repeated": {"prompt": list(range(1, tokens + 1)), "tokens": list(range(1, tokens + 1))},
        "unrepeated": {"tokens": list(range(100, 100 + tokens))},
        "": {},
    }[text]
    served = [_served(f"g{k}/e0", 0.1 + 0.25 * k, 0.3 + 0.25 * k, tokens, device) for k in range(count)]
    for event in served:
        event.data.update(data)
    return served


def _judge(*events: TraceEvent, start: TraceEvent | None = None, resident: TraceEvent | None = None):
    ix = TraceIndex.of([start or _start(), resident or _resident(), *sorted(events, key=lambda e: e.t)])
    r = Reasons()
    details = check_service_order(ix, r)
    return r.lines(), details


def test_a_request_held_while_its_engine_served_later_ones_is_named():
    """Received first, answered after ten later requests of 16 tokens ran one after another: it sat
    through 160 decode steps at least, and decoded 16."""
    reasons, details = _judge(_served("held/e0", 0.0, 3.0, 16), *_later_ones())
    assert len(reasons) == 1 and reasons[0].startswith("served out of order: episode held/e0 turn 0 on cpu:0"), reasons
    assert "decoded 16 tokens" in reasons[0] and "at least 160 decode steps" in reasons[0], reasons
    assert details["service_order_least_margin"] == 16 - 160


def test_the_same_request_served_beside_them_passes():
    reasons, details = _judge(_served("long/e0", 0.0, 3.0, 170), *_later_ones())
    assert reasons == [] and details["service_order_least_margin"] == 10


def _named(reasons: list[str], episode: str = "a/e0") -> bool:
    """The one reason is the order of service's, naming ``episode`` (not any reason at all)."""
    return len(reasons) == 1 and reasons[0].startswith(f"served out of order: episode {episode}")


def test_later_requests_on_another_engine_say_nothing_of_it():
    reasons, details = _judge(_served("held/e0", 0.0, 3.0, 16), *_later_ones(device="cpu:1"))
    assert reasons == [] and details["service_order_witnessed"] == 0


def test_overlapping_later_requests_count_once_for_the_steps_they_share():
    """Two later requests running side by side prove the steps of one of them, not of both."""
    side_by_side = [_served("c/e0", 0.1, 1.0, 40), _served("c/e1", 0.2, 1.1, 40)]
    assert _judge(_served("a/e0", 0.0, 2.0, 40), *side_by_side)[0] == []
    assert _named(_judge(_served("a/e0", 0.0, 2.0, 39), *side_by_side)[0])


@pytest.mark.parametrize(
    ("settings", "text", "tokens", "named"),
    [
        # a later request answering its prompt again: its first token, then steps keeping 4 drafts and a token
        ({"speculative_tokens": 4}, "repeated", 40, False),  # 1 + 3 steps each (1, 5, 5, 5 tokens)
        ({"speculative_tokens": 4}, "repeated", 39, True),
        ({"speculative_tokens": 64}, "repeated", 30, False),  # credited as 8 drafts whatever is declared: 1 + 2 steps
        ({"speculative_tokens": 64}, "repeated", 29, True),
        # declared drafts and nothing a drafter could have kept: a token a step, as a stack that does not draft
        ({"speculative_tokens": 8}, "unrepeated", 160, False),
        ({"speculative_tokens": 8}, "unrepeated", 159, True),
        ({"prefill_chunk": 1}, "", 159, True),  # chunked prefill buys nothing: budgets go in admission order
    ],
    ids=[
        "drafts allowed",
        "drafts exceeded",
        "drafts capped",
        "capped drafts exceeded",
        "drafts declared, none possible",
        "drafts declared, never made",
        "chunks no excuse",
    ],
)
def test_what_an_honest_engine_may_lag_by(settings, text, tokens, named):
    """Drafts are credited as a prompt-lookup drafter could have kept them in each later request's text
    (``TraceIndex.decode_steps``), not as many as the hello declares: a stack declaring eight drafts and
    making none was allowed 2 steps for each later request of 16 tokens, here 16."""
    reasons, _ = _judge(_served("a/e0", 0.0, 3.0, tokens), *_later_ones(text=text), start=_start(**settings))
    assert _named(reasons) if named else reasons == [], reasons


@pytest.mark.parametrize("partial", [2, None], ids=["two tokens", "none sent"])
def test_a_request_held_then_handed_back_interrupted_is_named(partial):
    """Held until the next shrink, then returned as interrupted: its partial, what it decoded, is
    judged as an answer is (one sent without a partial decoded nothing)."""
    held = _served("held/e0", 0.0, 3.0, partial, aborted=True, finish="abort")
    reasons, _ = _judge(held, *_later_ones())
    assert len(reasons) == 1 and reasons[0].startswith("served out of order: episode held/e0"), reasons
    assert f"decoded {partial or 0} tokens" in reasons[0], reasons
    assert _judge(_served("held/e0", 0.0, 3.0, 160, aborted=True, finish="abort"), *_later_ones())[0] == []


def test_an_answer_a_moment_before_its_own_may_have_come_after():
    """Two replies of one engine step reach the harness in either order: a later request answered
    within the reply slack before it proves nothing."""
    assert _judge(_served("a/e0", 0.0, 1.0, 4), _served("c/e0", 0.1, 0.97, 16))[0] == []
    assert _named(_judge(_served("a/e0", 0.0, 1.0, 4), _served("c/e0", 0.1, 0.9, 16))[0])


def test_a_request_received_a_moment_after_may_have_reached_the_engine_first():
    """Ray starts an async actor's calls out of order when a long prompt goes through its object store:
    a request received within the arrival slack after it proves nothing either."""
    assert _judge(_served("a/e0", 0.0, 1.0, 4), _served("c/e0", 0.005, 0.5, 16))[0] == []
    assert _named(_judge(_served("a/e0", 0.0, 1.0, 4), _served("c/e0", 0.02, 0.5, 16))[0])


@pytest.mark.parametrize("device", [None, "", "cpu:7", "cpu:1"])
def test_a_completion_must_name_a_device_that_held_an_engine(device):
    """Else it is compared with nothing: a cluster could name no engine, or the trainer's device, for the
    requests it holds (cpu:1 holds the trainer here, by the cluster's own residency)."""
    reasons, _ = _judge(
        _served("held/e0", 0.0, 3.0, 16, device=device), *_later_ones(), resident=_resident(cpu1="trainer")
    )
    assert len(reasons) == 1 and reasons[0].startswith("unnamed engine: episode held/e0 turn 0"), reasons


def test_an_engine_resident_for_part_of_the_request_is_enough():
    """A request started while its device's expand was under way: the residency listed the engine once
    the expand returned (recorded after every switch)."""
    expanded = TraceEvent("device_state", 0.5, {"resident": {"cpu:0": ["engine"], "cpu:1": ["engine"]}})
    reasons, _ = _judge(_served("a/e0", 0.0, 1.0, 16, device="cpu:1"), expanded, resident=_resident(cpu1="trainer"))
    assert reasons == [], reasons


def test_a_turn_answered_during_the_expand_that_woke_its_engine_names_it():
    """The cluster routes to an engine as its expand wakes it; the harness asks for the residency once
    the expand has returned: a short turn served in between was answered before the record listing
    its engine (a real run of redundant_envs, rejected as an unnamed engine). A turn answered before
    that expand began still names a device that held none."""
    expand = TraceEvent("expand", 0.53, {"start": 0.5, "devices": ["cpu:1"]})
    woken = TraceEvent("device_state", 0.55, {"resident": {"cpu:0": ["engine"], "cpu:1": ["engine"]}})
    during = _served("a/e0", 0.52, 0.54, 4, device="cpu:1")
    assert _judge(during, expand, woken, resident=_resident(cpu1="trainer"))[0] == []
    before = _served("b/e0", 0.4, 0.45, 4, device="cpu:1")
    (reason,) = _judge(before, expand, woken, resident=_resident(cpu1="trainer"))[0]
    assert reason.startswith("unnamed engine: episode b/e0 turn 0"), reason


def test_a_simulated_run_is_not_judged_by_it():
    start = _start()
    start.data["tokens_recorded"] = False
    assert _judge(_served("held/e0", 0.0, 3.0, 16), *_later_ones(), start=start) == ([], {})
