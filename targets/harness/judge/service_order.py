"""The engines' order of service, witnessed from the harness's own stamps (real runs).

A real run's cluster is the candidate's: it could accept an episode's request and serve it late, so
that the episode looks under way (the held-episode count of ``isolation/episode_activity.py`` sees
a call under way) while the engines serve the others. Engines admit requests in the order they
arrive and preempt the youngest first (``targets.api.Aborted``), so while a request runs on an
engine, every request that engine received earlier is in its batch too and decodes a token every
step it does. A request that arrived after request A and was answered before A therefore lower-bounds
the engine steps A sat through, and several such requests that ran one after another add up: A must
have decoded at least that many tokens. A request held back, then served, decodes far fewer.

An interrupted request is judged the same way, by its partial (what it decoded before a shrink, a
suspend or an interrupting sync cut it short: always sent, ``targets.api.Aborted``); a cluster could
otherwise hold a request until the next interruption and hand it back with nothing decoded.

What an honest engine may lag by, and the audit allows: a drafted step (speculative decoding) gives a request
several tokens, so a later request proves no more steps than its tokens could have been decoded in with the
drafts its prompt and tokens let a prompt-lookup drafter keep (``TraceIndex.decode_steps``: at most ``1 +
speculative_tokens`` tokens a step, at most ``MAX_SPECULATIVE_TOKENS`` drafts credited); a reply can reach the
harness a little after a later one (``REPLY_ORDER_SLACK_S``), and a request reach the engine a little after a
later one (``ARRIVAL_ORDER_SLACK_S``). A prompt prefilled in chunks costs no allowance: both engines hand the
step's prefill budget out in admission order, so a later request cannot decode while an earlier one still
prefills. The engine a completion names is the cluster's word: it must be a device that held an engine during
the request (the cluster's own residency, which the audit holds against the trainer's), else the request is
compared with nothing (docs/judge.md, "order of service").
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass

from targets.api import TraceEvent
from targets.harness.judge.trace_index import Reasons, TraceIndex
from targets.harness.trace import token_count

# The answers of two requests finished in one engine step reach the harness in either order: the 392
# aborts of trace_index.py's measurement came back at most 18 ms late. A request answered later than
# another by less than this may have finished first.
REPLY_ORDER_SLACK_S = 0.05
# A request received this much later than another reached the engine after it. The harness forwards calls in
# the order it stamps them; Ray starts an async actor's calls in any order, so an engine must take its
# requests in the order its cluster sent them (the kit's do: skills/recipes/arrival_order.py).
ARRIVAL_ORDER_SLACK_S = 0.01


@dataclass(frozen=True)
class Served:
    """One request on one engine, answered or interrupted, as the harness stamped it."""

    episode: str
    turn: int
    start: float  # the harness forwarded it
    end: float  # the harness had its answer (or its interruption)
    tokens: int  # decoded: the response, or an interrupted request's partial
    steps: int  # the fewest engine steps those tokens could have taken (``TraceIndex.decode_steps``)


def engines_judged(ix: TraceIndex) -> bool:
    """Whether the engines' pace is the candidate's to judge: not in a simulated run (its engine is the
    harness's), nor on a trace without its start."""
    return ix.tokens_recorded and bool(ix.by_kind["run_start"])


def check_service_order(ix: TraceIndex, r: Reasons) -> dict:
    """A request's tokens against the engine steps that later requests, answered before it, prove it
    sat through. Real runs only (a simulated engine is the harness's). Returns the audit's details:
    how many requests had such a witness, and the least margin any left."""
    if not engines_judged(ix):
        return {}
    holding = _engine_spans(ix)
    by_engine: dict[str, list[Served]] = defaultdict(list)
    for g in ix.by_kind["generate"]:
        d = g.data
        device = d.get("device")
        if d["aborted"] and not device:
            continue  # check_aborts names an interruption that names no engine
        engine = ix.engine(device) if device else None
        if engine is None or not any(since <= g.t and d["start"] <= until for since, until in holding.get(engine, [])):
            r.add(
                "unnamed engine",
                f"episode {d['episode']} turn {d['turn']} was answered naming {device!r}, which held no engine "
                "while it ran (the cluster's residency): a completion names the engine that served it",
            )
            continue
        tokens = token_count(d.get("tokens", []))  # an interruption's partial is always sent
        by_engine[engine].append(Served(d["episode"], d["turn"], d["start"], g.t, tokens, ix.decode_steps(g)))
    witnessed, least = 0, math.inf
    for engine, requests in by_engine.items():
        spans = _distinct_spans(requests)
        starts = [s.start for s in spans]
        proved: dict[tuple[float, float], int] = {}  # copies of one span prove the same steps: counted once
        for a in requests:
            if (a.start, a.end) not in proved:
                proved[a.start, a.end] = _steps_sat_through(a, spans, starts)
            steps = proved[a.start, a.end]
            if not steps:
                continue
            witnessed += 1
            least = min(least, a.tokens - steps)
            if a.tokens < steps:
                r.add(
                    "served out of order",
                    f"episode {a.episode} turn {a.turn} on {engine}, received at {a.start:.2f}s and answered "
                    f"at {a.end:.2f}s, decoded {a.tokens} tokens, while requests that engine received after it "
                    f"and answered before it ran one after another for at least {steps} decode steps "
                    "(engines serve in arrival order: it was held back, then served)",
                )
    return {"service_order_witnessed": witnessed, "service_order_least_margin": None if least == math.inf else least}


SWITCHES = ("shrink", "expand", "train", "train_part", "suspend", "resume")  # each followed by a residency record


def _engine_spans(ix: TraceIndex) -> dict[str, list[tuple[float, float]]]:
    """When each engine was resident, by the cluster's residency records (asked for after every switch
    returns): from the start of the switch a record follows, during which the state it reports came
    about, until the next record. (An engine an expand woke serves as soon as the cluster routes to it,
    before the harness has its residency: a short turn was answered in that round trip, named by a
    record made after it.)"""
    records: list[tuple[TraceEvent, float]] = []
    since = -math.inf  # the first record is the run's start
    for e in ix.events:  # in the order recorded: a switch, then the record it was followed by
        if e.kind == "device_state":
            records.append((e, since))
        elif e.kind in SWITCHES:
            since = e.data["start"]
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for k, (e, since) in enumerate(records):
        until = records[k + 1][0].t if k + 1 < len(records) else math.inf
        for device, components in e.data["resident"].items():
            if "engine" in components:
                spans[ix.engine(device)].append((min(since, e.t) if k else -math.inf, until))
    return spans


def _distinct_spans(requests: list[Served]) -> list[Served]:
    """One request per span, the one that proves most steps, by start: of two received and answered at the
    same instants, a chain of disjoint requests holds one at most (thousands of copies of a turn cost
    the witness search nothing)."""
    most: dict[tuple[float, float], Served] = {}
    for s in requests:
        if (s.start, s.end) not in most or s.steps > most[s.start, s.end].steps:
            most[s.start, s.end] = s
    return sorted(most.values(), key=lambda s: s.start)


def _steps_sat_through(a: Served, requests: list[Served], starts: list[float]) -> int:
    """The most decode steps a chain of time-disjoint later requests, each received after ``a`` and
    answered before it, proves (each at least its fewest steps, ``Served.steps``): weighted interval
    scheduling over those inside ``a``'s span."""
    first = bisect.bisect_right(starts, a.start + ARRIVAL_ORDER_SLACK_S)
    last = bisect.bisect_left(starts, a.end - REPLY_ORDER_SLACK_S)
    inside = sorted(
        (c for c in requests[first:last] if c.end < a.end - REPLY_ORDER_SLACK_S and c.tokens),
        key=lambda c: c.end,
    )
    ends = [c.end for c in inside]
    best = [0] * (len(inside) + 1)  # best[i]: the most steps the first i (by answer) can prove
    for i, c in enumerate(inside):
        before = bisect.bisect_left(ends, c.start, 0, i)  # answered before c was received
        best[i + 1] = max(best[i], best[before] + c.steps)
    return best[-1]
