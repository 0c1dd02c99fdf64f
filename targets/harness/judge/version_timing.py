"""When a turn's version existed, against when the turn was decoded (real runs).

A completion names the weight version it was decoded under, and the replay recomputes its logprobs
under that version. That alone cannot tell a turn decoded under version v from one decoded under v-1
and then prefilled once under v, the logprobs taken from the prefill: the tokens are v-1's, the claim
makes a stale sample look fresh (and the staleness bound, which counts versions, lets it by). The
harness knows when each version came to exist: when the training call that returned it returned
(an engine takes a version by a sync or an expand, both issued after that). So a request the harness
forwarded before its claimed version existed was decoded after that moment, at the pace engines
decode: it must have ended at least its tokens times the run's fastest pace later (the fastest any
request of the run showed from forwarding to answer, halved, and divided by the tokens a drafted step
may give, ``service_order.tokens_a_step``). The cheat above ends one prefill after the
version exists. Honest runs of the CPU target forward no request before the version it is served
under exists at all (docs/judge.md, "version timing")."""

from __future__ import annotations

import math

from targets.harness.judge.service_order import tokens_a_step
from targets.harness.judge.trace_index import Reasons, TraceIndex
from targets.harness.trace import token_count

PACE_MIN_TOKENS = 4  # a request this long sets the pace: a shorter one is mostly its prefill
PACE_SLACK = 0.5  # of the fastest pace: a request's own prefill and queueing are in that pace, not in its window


def check_version_timing(ix: TraceIndex, r: Reasons) -> dict:
    """Every turn and interrupted segment claiming a version its request arrived before; returns the
    audit's details: how many there were, and the least ratio of the time each had to the time it needed."""
    drafted = tokens_a_step(ix)
    if drafted is None:
        return {}
    existed = {train.data["version"]: train.t for train in ix.trains}
    turns = [(g, token_count(g.data.get("tokens", []))) for g in ix.by_kind["generate"]]
    turns = [(g, tokens) for g, tokens in turns if tokens]
    paces = [(g.t - g.data["start"]) / tokens for g, tokens in turns if tokens >= PACE_MIN_TOKENS]
    if not paces:
        return {}
    pace = PACE_SLACK * min(paces) / drafted
    early, least = 0, math.inf
    for g, tokens in turns:
        d = g.data
        since = existed.get(d["version"])
        if since is None or d["start"] >= since:
            continue
        early += 1
        had, needed = g.t - since, tokens * pace
        least = min(least, had / needed)
        if not had >= needed:
            r.add(
                "decoded before its version existed",
                f"episode {d['episode']} turn {d['turn']} on {d.get('device')}: forwarded at {d['start']:.2f}s, "
                f"before version {d['version']} existed ({since:.2f}s, its training call returned), and answered "
                f"{had:.3f}s after that with {tokens} tokens under that version, which take at least {needed:.3f}s "
                "at the run's fastest pace: decoded under an earlier version, its logprobs taken anew",
            )
    return {"version_timing_witnessed": early, "version_timing_least_ratio": None if not early else least}
