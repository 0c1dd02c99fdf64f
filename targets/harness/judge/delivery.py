"""The audit's delivery rule: the weight version a completion claims reached its engine by a call the
harness saw.

An engine holds version 0 from the run's start; a ``sync`` brings the version it names to the engines of
its devices; an ``expand`` or a ``resume`` brings the latest version a training call had returned when it
began (or, at the latest, when it returned), or gives the engine back the newest version it could have
held before (an engine that reloads its own offloaded weights, then syncs). A completion (or an
interrupted segment) claiming version v on engine E must claim what E held when its request was forwarded
(what the deliveries that had ended by then left it) or what a delivery under way while it ran brought. A
controller that never syncs, and a cluster that stamps its answers with a version its engine was never
given (a newer one, or an older one to make a group look stale enough to drop), are named. A sync the
cluster made a no-op is the replay's to find: it recomputes each sampled turn's logprobs under the
version claimed.
"""

from __future__ import annotations

from collections import defaultdict

from targets.harness.judge.trace_index import Reasons, TraceIndex


def check_delivered_versions(ix: TraceIndex, r: Reasons) -> None:
    calls = sorted(ix.by_kind["sync"] + ix.by_kind["expand"] + ix.by_kind["resume"], key=lambda e: e.t)
    held_now: dict[str, frozenset[int]] = defaultdict(lambda: frozenset({0}))
    # engine -> (start, end, what the call brought, what the engine held once it returned), in the order they ended
    deliveries: dict[str, list[tuple[float, float, frozenset[int], frozenset[int]]]] = defaultdict(list)
    for e in calls:
        for engine in sorted({ix.engine(d) for d in e.data["devices"]}):
            if e.kind == "sync":
                brought = held = frozenset({e.data["version"]})
            else:
                # the latest version (step k returns version k: the mechanism rule names any other), or back
                # to the newest it could have held (its own offloaded weights)
                brought = held = frozenset({ix.policy_at(e.data["start"]), ix.policy_at(e.t), max(held_now[engine])})
            held_now[engine] = held
            deliveries[engine].append((e.data["start"], e.t, brought, held))
    for g in sorted(ix.versioned_answers(), key=lambda g: g.t):
        engine, start, claimed = g.data["device"], g.data["start"], g.data["version"]
        given = deliveries.get(engine, [])
        ended = [held for _, end, _, held in given if end <= start]
        held = ended[-1] if ended else frozenset({0})
        during = frozenset().union(*(brought for s, end, brought, _ in given if s < g.t and end > start))
        if claimed not in held | during:
            r.add(
                "version never delivered",
                f"{engine} answered episode {g.data['episode']} turn {g.data['turn']} under version {claimed}, which "
                f"no sync, expand or resume had brought it (it held {sorted(held)} when the request came"
                + (f", and {sorted(during)} came while it ran)" if during else ")"),
            )
