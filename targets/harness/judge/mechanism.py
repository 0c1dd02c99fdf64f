"""The audit's mechanism rule (``audit.py``), from the harness's own trace: the run's start and end
recorded once; no request served by a shrunk or suspended engine, none completed well after its
engine's shrink returned (a shrink aborts what it holds); never zero active rollout engines; an engine
and a trainer never on one device at once: no training call on a device whose engine the trace shows
awake (placed there at the hello, brought by an expand or serving there, and not shrunk or suspended
for the whole call: the controller's calls as the harness saw them), nor in the cluster's own residency
report (recorded after every switch); a suspend and a resume never under way at once (a suspended window
runs from the one's return to the other's start); the requested training steps ran, each returning the
next weight version."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

from targets.harness.judge.trace_index import Reasons, TraceIndex
from targets.spec import TargetSpec


def check_mechanism(ix: TraceIndex, r: Reasons, steps: int, spec: TargetSpec) -> None:
    """The cluster's mechanism as the trace shows it (the audit's "mechanism" in docs/judge.md)."""
    for kind in ("run_start", "run_end"):  # what every rule reads the run's settings and span from
        if len(ix.by_kind[kind]) != 1:
            r.add("trace", f"the harness's trace holds {len(ix.by_kind[kind])} {kind} events, not one")
    served = [g for gs in [*ix.generated.values(), *ix.partials.values()] for g in gs]
    windows = asleep(ix, r)
    slack = ix.reply_slack(spec)
    for g in served:
        for device, since, until in windows:
            if g.data["device"] != device:
                continue
            if g.data["start"] > since and g.t < until:
                r.add(
                    "served while shrunk",
                    f"{device} served episode {g.data['episode']} turn {g.data['turn']} while shrunk",
                )
            # In flight when its engine's shrink returned, a request was aborted by it; one completed well
            # after (the slack is the reply's way back) kept decoding beside the trainer that took its place.
            elif not g.data["aborted"] and g.data["start"] < since and g.t > since + slack:
                r.add(
                    "shrink without abort",
                    f"{device} went on serving episode {g.data['episode']} turn {g.data['turn']} after its "
                    f"shrink returned at {since:.2f}s (completed at {g.t:.2f}s, not aborted)",
                )
    check_trained_beside_awake_engines(ix, r, windows, slack)
    for suspend in ix.by_kind["suspend"]:
        # A resume begun before a suspend returned would leave it no window, while the controller link
        # counts the rollout paused from that return on (its held episodes held by no one).
        overlapping = next(
            (e for e in ix.by_kind["resume"] if e.data["start"] < suspend.t and e.t > suspend.data["start"]), None
        )
        if overlapping is not None:
            r.add(
                "suspend overlapped",
                f"the suspend begun at {suspend.data['start']:.2f}s (returned at {suspend.t:.2f}s) was under way "
                f"with the resume begun at {overlapping.data['start']:.2f}s: suspend, then resume",
            )
    for e in ix.by_kind["device_state"]:
        for device, components in e.data["resident"].items():
            if "engine" in components and "trainer" in components:
                r.add("memory shared", f"{device} held an engine and a trainer at once at {e.t:.2f}s")
    if len(ix.trains) != steps:
        r.add("steps", f"the controller ran {len(ix.trains)} training steps, {steps} were requested")
    for k, train in enumerate(ix.trains, start=1):
        if train.data["version"] != k:
            r.add("version numbering", f"training step {k} returned version {train.data['version']}, not {k}")


def asleep(ix: TraceIndex, r: Reasons | None = None) -> list[tuple[str, float, float]]:
    """Each engine's spans asleep, as (engine, since, until): from a shrink's return to the next expand's
    start (a serving pool's devices from the run's start, until a stack borrows them), from a suspend's
    return to the next resume's start. With ``r``, a shrink that left no rollout engine active is named."""
    serving = {g.data["device"] for gs in [*ix.generated.values(), *ix.partials.values()] for g in gs}
    # a serving pool's devices serve its traffic, not rollout, until a stack borrows them
    lendable = {ix.engine(d) for e in ix.by_kind["serving"] for d in e.data["devices"]}
    inactive_since: dict[str, float] = dict.fromkeys(lendable, ix.start_t)
    windows: list[tuple[str, float, float]] = []  # engine, shrunk at, expanded at
    for e in sorted(ix.by_kind["shrink"] + ix.by_kind["expand"], key=lambda e: e.t):
        for device in sorted({ix.engine(d) for d in e.data["devices"]}):
            if e.kind == "shrink":
                inactive_since.setdefault(device, e.t)  # shrunk again: inactive since the first
            elif device in inactive_since:
                windows.append((device, inactive_since.pop(device), e.data["start"]))
        if r is not None and e.kind == "shrink" and serving and serving <= set(inactive_since):
            r.add("no active engine", f"after the shrink at {e.t:.2f}s no rollout engine was active")
    windows += [(d, t, ix.end_t) for d, t in inactive_since.items()]
    resumes = sorted(ix.by_kind["resume"], key=lambda e: e.t)
    for suspend in ix.by_kind["suspend"]:
        until = next((e.data["start"] for e in resumes if e.t > suspend.t), ix.end_t)
        windows += [(device, suspend.t, until) for device in {ix.engine(d) for d in suspend.data["devices"]}]
    return windows


def wakes(ix: TraceIndex) -> Callable[[str | None, float], float]:
    """``woke(engine, at)``: when ``engine``, asleep at ``at`` (``asleep``'s windows), woke; -inf where it was
    awake then. A request forwarded to a sleeping engine is decoded from that moment on."""
    sleeps = defaultdict(list)
    for engine, since, until in asleep(ix):
        sleeps[engine].append((since, until))

    def woke(engine: str | None, at: float) -> float:
        return max((until for since, until in sleeps.get(engine, ()) if since < at < until), default=-math.inf)

    return woke


def check_trained_beside_awake_engines(
    ix: TraceIndex, r: Reasons, windows: list[tuple[str, float, float]], slack: float
) -> None:
    """No training call on a device whose engine is awake at any moment of it. The engines are those the
    trace shows: placed at the hello (``run_start``'s ``rollout``), brought by an expand, or serving a turn
    (the cluster's residency report is its own word; this is the controller's calls as the harness saw them,
    which the simulator enforces as it runs)."""
    start = ix.by_kind["run_start"][0].data if ix.by_kind["run_start"] else {}
    engines = {ix.engine(d) for d in start.get("rollout", [])}
    engines |= {ix.engine(d) for e in ix.by_kind["expand"] for d in e.data["devices"]}
    engines |= {g.data["device"] for gs in ix.generated.values() for g in gs}
    for call in [*ix.by_kind["train_part"], *ix.trains]:
        # a step holds its devices until the harness has sealed its weights: a cluster that answered train
        # at once and trained inside export_weights, which the call waits for, while its controller woke
        # the trainer's device, was a step of milliseconds (a review of the judge)
        end = max(call.t, ix.exported.get(call.data["step"], call.t)) if call.kind == "train" else call.t
        for engine in sorted({ix.engine(d) for d in call.data["devices"]} & engines):
            asleep = any(
                device == engine and since <= call.data["start"] + slack and end <= until + slack
                for device, since, until in windows
            )
            if not asleep:
                r.add(
                    "trained beside an awake engine",
                    f"{engine}'s engine was not shrunk or suspended while training step {call.data['step']} "
                    f"ran on it ({call.data['start']:.2f}s to {end:.2f}s, its weights sealed)",
                )
