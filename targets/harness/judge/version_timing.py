"""When a turn's version existed, and when its request was forwarded, against when it was answered
(real runs).

A completion names the weight version it was decoded under, and the replay recomputes its logprobs
under that version. That alone cannot tell a turn decoded under version v from one decoded under v-1
and then prefilled once under v, the logprobs taken from the prefill: the tokens are v-1's, the claim
makes a stale sample look fresh (and the staleness bound, which counts versions, lets it by). The
harness knows when each version came to exist: when the training call that returned it returned (an
engine takes a version by a sync or an expand, both issued after that), and when it forwarded each
request. So a turn under version v was decoded after both, at the pace engines decode: it must have
ended at least its tokens times the pace later. The pace is the run's fastest (the fastest any request
showed from forwarding to answer, halved), but never under the physical floor of a decode step: every
weight read once from device memory, all the job's devices reading together, halved
(``decode_step_floor``), since the run's fastest is the stack's to set (one sibling answered at once, from
a sample drafted while its groupmate decoded, would set it for every turn): that many seconds a step, for
the fewest steps the request's tokens could have taken (``TraceIndex.decode_steps``: a token a step, fewer
where the stack drafts and prompt lookup could have drafted them). The cheat above ends one prefill after the
version exists: **decoded before its version existed**; a turn decoded ahead, while v trained, and
forwarded once v existed, ends one prefill after it was forwarded: **answered faster than decoding**.
Honest runs of the CPU target forward no request before the version it is served under exists at all
(docs/judge.md, "version timing"). A request of under ``PACE_MIN_TOKENS`` is held to the floor alone: a
stop drawn at once in a quiet moment can beat half the pace long turns set in heavy batches (a red team's
toy: 2 tokens in 8 ms against 10 ms a token); a turn that short is little to decode ahead. A turn's short
requests together are held to the pace once they are as long as one that sets it: a turn decoded ahead and
handed back in segments of three tokens, each answered at the floor, was another red team's. Still open:
the floor is the hardware's limit, several times under a real engine's pace on a GPU, so a turn decoded
ahead and answered no sooner than the floor allows passes."""

from __future__ import annotations

import math
from collections import defaultdict

from targets.harness.judge.mechanism import wakes
from targets.harness.judge.service_order import engines_judged
from targets.harness.judge.trace_index import Reasons, TraceIndex
from targets.harness.sim.cost_model import DTYPE_BYTES
from targets.harness.trace import token_count
from targets.spec import TargetSpec

PACE_MIN_TOKENS = 4  # a request this long sets the pace: a shorter one is mostly its prefill
PACE_SLACK = 0.5  # of the fastest pace: a request's own prefill and queueing are in that pace, not in its window
FLOOR_SHARE = (
    0.5  # of a step's weight read at the spec's bandwidth: a card faster than its spec, an H200 run as an H100
)


def decode_step_floor(spec: TargetSpec) -> float:
    """Seconds a decode step takes at the least: the active weights read once from device memory at the
    bandwidth of every job device together (an engine spread over all of them), times ``FLOOR_SHARE``."""
    hardware = spec.hardware
    bandwidth = sum(hardware.pool_of(device).hbm_bandwidth_gbs * 1e9 for device in hardware.device_ids())
    config = spec.model.config  # an untied input embedding is looked up, not read whole (cost_model.py)
    lookup = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    weights = (spec.model.param_counts().active - lookup) * DTYPE_BYTES[spec.model.dtype]
    return FLOOR_SHARE * weights / bandwidth


def check_version_timing(ix: TraceIndex, r: Reasons, step_floor_s: float = 0.0) -> dict:
    """Every turn and interrupted segment against the latest of its forwarding, its version's making and
    its engine's wake (a request forwarded to an engine asleep, shrunk or suspended, is decoded once it
    wakes: one answered sooner after the wake than decoding takes was decoded beside the trainer, or
    while the rollout was suspended); returns the audit's details: how many were forwarded before their
    version existed, the least ratio of the time any request had to the time it needed, and the pace it
    was held to."""
    if not engines_judged(ix):
        return {}
    existed = {train.data["version"]: train.t for train in ix.trains}
    woke_at = wakes(ix)
    turns = [(g, token_count(g.data.get("tokens", []))) for g in ix.by_kind["generate"]]
    turns = [(g, tokens) for g, tokens in turns if tokens]
    paces = [(g.t - g.data["start"]) / tokens for g, tokens in turns if tokens >= PACE_MIN_TOKENS]
    # a decode step's, at the least (paces are a token's); with no request long enough to set a pace (a
    # budget of under PACE_MIN_TOKENS), every request is held to the floor alone
    pace = max(PACE_SLACK * min(paces), step_floor_s) if paces else step_floor_s
    early, least = 0, math.inf
    short: dict[tuple[str, int], list[tuple[float, int, int]]] = defaultdict(list)  # a turn's: had, tokens, steps
    for g, tokens in turns:
        d = g.data
        made = existed.get(d["version"], -math.inf)
        woke = woke_at(d.get("device"), d["start"])
        if g.t < woke:  # answered while its engine slept: the mechanism rule's ("served while shrunk")
            continue
        since = max(made, woke)
        # a short request (a stop drawn at once) answered in a quiet moment may beat a pace set by long turns
        # in heavy batches: it is held to the floor of a decode step alone
        steps = ix.decode_steps(g)  # its tokens, or fewer where drafts could have been kept
        had, needed = g.t - max(d["start"], since), steps * (pace if tokens >= PACE_MIN_TOKENS else step_floor_s)
        early += d["start"] < made
        if tokens < PACE_MIN_TOKENS:
            short[(d["episode"], d["turn"])].append((had, tokens, steps))
        if needed <= 0:  # a short request where no floor is known: nothing to hold it to
            continue
        least = min(least, had / needed)
        if had >= needed:
            continue
        where = f"episode {d['episode']} turn {d['turn']} on {d.get('device')}: forwarded at {d['start']:.2f}s"
        if woke > -math.inf and woke >= made:
            r.add(
                "decoded while asleep",
                f"{where}, while its engine was shrunk or suspended (until {woke:.2f}s), and answered {had:.3f}s "
                f"after it woke with {tokens} tokens, which take at least {needed:.3f}s at the run's pace: "
                "decoded while it slept, beside the trainer or with the rollout suspended",
            )
        elif d["start"] < made:
            r.add(
                "decoded before its version existed",
                f"{where}, before version {d['version']} existed ({made:.2f}s, its training call returned), and "
                f"answered {had:.3f}s after that with {tokens} tokens under that version, which take at least "
                f"{needed:.3f}s at the run's pace: decoded under an earlier version, its logprobs taken anew",
            )
        else:
            r.add(
                "answered faster than decoding",
                f"{where} and answered {had:.3f}s later with {tokens} tokens under version {d['version']}, which "
                f"take at least {needed:.3f}s at the run's pace: decoded before it was forwarded",
            )
    for (episode, turn), requests in short.items():
        tokens = sum(n for _, n, _ in requests)
        if tokens < PACE_MIN_TOKENS or pace <= 0:  # no pace: an instant answer and no floor known
            continue
        had, needed = sum(seconds for seconds, _, _ in requests), sum(steps for _, _, steps in requests) * pace
        least = min(least, had / needed)
        if had < needed:
            r.add(
                "answered faster than decoding",
                f"episode {episode} turn {turn}: {len(requests)} requests of under {PACE_MIN_TOKENS} tokens each, "
                f"{tokens} in all, were answered {had:.3f}s in all after they were forwarded and their versions "
                f"existed; {tokens} tokens take at least {needed:.3f}s at the run's pace: decoded ahead, "
                "handed back in pieces",
            )
    return {
        "version_timing_witnessed": early,
        "version_timing_least_ratio": least,
        "version_timing_pace_s": pace,
    }
