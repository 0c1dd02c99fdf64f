"""The audit's interruption rules (docs/judge.md, selection): every interrupted request was cut short by a
shrink, a suspend or an interrupting sync of its engine in progress; such a call cuts everything its
engine has started at once; an interrupting sync brings a newer version, and every sync one a training
step returned. Interruptions are how a stack chooses what to restart, so each is a way to choose samples."""

from __future__ import annotations

import bisect
import math
from collections import defaultdict

from targets.api import TraceEvent
from targets.harness.judge.trace_index import Reasons, TraceIndex
from targets.spec import TargetSpec


def _interrupting_events(ix: TraceIndex) -> list[TraceEvent]:
    """The calls that may cut requests short, in the order ``interruptions`` numbers them."""
    return ix.by_kind["shrink"] + ix.by_kind["suspend"] + [e for e in ix.by_kind["sync"] if e.data.get("interrupt")]


class _SuffixMin:
    """The least value among positions ``>= i`` of a fixed length, with values lowered one at a time (a
    Fenwick tree read from the right)."""

    def __init__(self, n: int) -> None:
        self.n, self.tree = n, [math.inf] * (n + 1)

    def lower(self, i: int, value: float) -> None:
        i = self.n - i  # position i from the right, 1-based
        while i <= self.n:
            self.tree[i] = min(self.tree[i], value)
            i += i & -i

    def least_from(self, i: int) -> float:
        i, out = self.n - i, math.inf
        while i > 0:
            out = min(out, self.tree[i])
            i -= i & -i
        return out


def interruptions(ix: TraceIndex, slack: float) -> dict[int, int]:
    """Which call (a shrink, a suspend or an interrupting sync, by index) cut each interrupted request
    short: the first in progress on its engine while it ran and when its reply came (within ``slack``)
    (``id`` of the event -> index). One sweep an engine, its calls by start and its requests by reply, in
    O((calls + requests) log calls): a stack that holds one call open all run and cuts thousands of times
    costs no quadratic scan."""
    calls: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for k, e in enumerate(_interrupting_events(ix)):
        for engine in {ix.engine(d) for d in e.data["devices"]}:
            calls[engine].append((e.data["start"], e.t, k))
    cut: dict[str, list[TraceEvent]] = defaultdict(list)
    for g in ix.by_kind["generate"]:
        if g.data["aborted"] and g.data.get("device") and ix.engine(g.data["device"]) in calls:
            cut[ix.engine(g.data["device"])].append(g)
    found: dict[int, int] = {}
    for engine, requests in cut.items():
        by_start = sorted(calls[engine])
        ends = sorted(end for _, end, _ in by_start)
        begun, least = 0, _SuffixMin(len(ends))
        for g in sorted(requests, key=lambda g: g.t):
            while begun < len(by_start) and by_start[begun][0] <= g.t:  # the calls begun by its reply
                _, end, k = by_start[begun]
                least.lower(bisect.bisect_left(ends, end), k)
                begun += 1
            since = max(g.data["start"], g.t - slack)  # a call that ended before this neither overlapped nor caused it
            k = least.least_from(bisect.bisect_left(ends, since))
            if k < math.inf:
                found[id(g)] = int(k)
    return found


# A call cuts every request its engine has started at one instant; their replies reach the harness in any
# order a little after. Over 18 honest runs of benchmarks/judge_false_alarms.py (the starters on four
# seeds, each technique on one: 70 cuts; 55 requests forwarded before a cut and answered after its call
# began) every one completed before the cut (the latest 0.07 ms before it) or, 4 of them, after a sync
# under the version it brought (they had waited in the paged engine's queue); the
# slack leaves room for a reply's way back on a loaded machine, and bounds what a selective cut can let
# finish: a CPU target's interrupted request runs 10-30 ms, a GPU decode step 1-7 ms.
CUT_SLACK_S = 0.05


def check_aborts(ix: TraceIndex, r: Reasons, spec: TargetSpec) -> None:
    """An interrupted request is one a shrink, a suspend or an interrupting sync cut short on the
    engine it ran on, while it was in flight: a cluster that aborts on its own could resample the turns
    it dislikes (the long ones, or those that missed the reward) and hand the controller only the ones
    it likes. So every abort names its engine (``Aborted.partial``, possibly empty), and a call in
    progress must cover that engine. And the call cuts everything the engine holds at once
    (``_check_whole_cuts``): one that cut only the turns it dislikes, during a sync it made for the
    purpose, would choose as well; nor may a sync interrupt for nothing (``_check_needless_syncs``)."""
    causes = interruptions(ix, ix.reply_slack(spec))
    if ix.tokens_recorded:  # a simulated cluster is the harness's own
        _check_whole_cuts(ix, r, causes)
    _check_needless_syncs(ix, r)
    for g in ix.by_kind["generate"]:
        if not g.data["aborted"]:
            continue
        where = f"episode {g.data['episode']} turn {g.data['turn']} was aborted at {g.t:.2f}s"
        device = g.data.get("device")
        if "failed" in g.data:
            r.add(
                "failed request",
                f"episode {g.data['episode']} turn {g.data['turn']}: the cluster's generate failed at {g.t:.2f}s "
                f"({g.data['failed']}); a turn whose request may fail may be drawn again until one is liked",
            )
        elif not device:
            r.add(
                "unexplained abort",
                f"{where} without naming the engine that served it (an Aborted carries its partial: what "
                "the engine decoded, possibly nothing, and where)",
            )
        elif id(g) not in causes:
            r.add(
                "unexplained abort",
                f"{where} on {device} with no shrink, suspend or interrupting sync of it in progress",
            )


def _check_whole_cuts(ix: TraceIndex, r: Reasons, causes: dict[int, int]) -> None:
    """No request forwarded to an engine before a call's first cut there completes after that cut
    (``CUT_SLACK_S`` for the replies' order), unless under the version an interrupting sync brought: an
    engine cuts the requests it has started and serves those still waiting once the new weights are in. A
    cluster that cut the long turns and let the short ones finish would train the short draws of every
    turn it restarts. Measured from the first cut, not from the call's start (a shrink may take a while to
    reach its engine, and whatever completed before was not cut by it), and every request forwarded
    before that cut is held to it, not only those forwarded before the call began: else a sync kept open
    the whole step would explain any cut in it and excuse any survivor."""
    events = _interrupting_events(ix)
    first_cut: dict[tuple[int, str], float] = {}
    for g in ix.by_kind["generate"]:
        if (k := causes.get(id(g))) is not None:
            key = (k, ix.engine(g.data["device"]))
            first_cut[key] = min(first_cut.get(key, math.inf), g.t)
    completed: dict[tuple[str, int], list[TraceEvent]] = defaultdict(list)  # (engine, version) -> completions
    for gs in ix.generated.values():
        for g in gs:
            completed[(ix.engine(g.data["device"]), g.data["version"])].append(g)
    # per engine and version, its completed requests by when they were forwarded, with the latest answered
    # among the first i
    latest: dict[str, dict[int, tuple[list[float], list[TraceEvent]]]] = defaultdict(dict)
    for (engine, version), gs in completed.items():
        gs.sort(key=lambda g: g.data["start"])
        starts, last = [], []
        for g in gs:
            starts.append(g.data["start"])
            last.append(g if not last or g.t > last[-1].t else last[-1])
        latest[engine][version] = starts, last
    for (k, engine), cut in sorted(first_cut.items(), key=lambda item: item[1]):
        call = events[k]
        brought = call.data["version"] if call.kind == "sync" else math.inf
        for version, (starts, last) in sorted(latest.get(engine, {}).items()):
            held = bisect.bisect_left(starts, cut)
            if version >= brought or not held or (g := last[held - 1]).t <= cut + CUT_SLACK_S:
                continue
            r.add(
                "selective interruption",
                f"the {call.kind} begun at {call.data['start']:.2f}s first cut a request on {engine} at {cut:.2f}s, "
                f"yet episode {g.data['episode']} turn {g.data['turn']}, forwarded to it at {g.data['start']:.2f}s, "
                f"completed at {g.t:.2f}s under version {version}: an interruption cuts everything its engine "
                "has started",
            )
            break


def _check_needless_syncs(ix: TraceIndex, r: Reasons) -> None:
    """An interrupting sync brings each of its devices' engines a version newer than the last it is known to
    hold: version 0 from the run's start, then the version a sync brought it or the last answer it gave
    claimed (an expand or a resume may bring the latest version, which its next answer shows). One to the
    version the engine holds changes nothing but what it cuts: a controller could cut its engines whenever
    the turns in flight are the long ones and restart them, redrawing the tail at will (the honest runs of
    benchmarks/judge_false_alarms.py: 16 interrupting syncs, each the next version). And every sync brings a
    version a training step had returned before it began (or the harness's 0)."""
    existed = {train.data["version"]: train.t for train in ix.trains}
    # each moment a version became known on an engine, and each interrupting sync's start, in time order (a
    # sync's start before what ends in that instant: it could not know it)
    timeline = [(g.t, 1, g.data["device"], g.data["version"], None) for g in ix.versioned_answers()]
    for e in ix.by_kind["sync"]:
        for engine in sorted({ix.engine(d) for d in e.data["devices"]}):
            timeline.append((e.t, 1, engine, e.data["version"], None))
        timeline.append((e.data["start"], 0, "", e.data["version"], e))
    known: dict[str, int] = defaultdict(int)  # engine -> the version it last showed it held
    for _, _, engine, version, e in sorted(timeline, key=lambda item: item[:2]):
        if e is None:
            known[engine] = version
            continue
        if version != 0 and existed.get(version, math.inf) > e.data["start"]:
            r.add(  # a version of its own numbering would make every sync "newer"
                "unknown version",
                f"the sync begun at {e.data['start']:.2f}s brought version {version}, which no training "
                "step had returned by then",
            )
        held = [d for d in e.data["devices"] if known[ix.engine(d)] >= version]
        if e.data.get("interrupt") and held:
            r.add(
                "needless interruption",
                f"the sync begun at {e.data['start']:.2f}s interrupted {held[0]} to bring it version "
                f"{version}, which it held already (version {known[ix.engine(held[0])]}): it cut its requests "
                "for nothing",
            )
