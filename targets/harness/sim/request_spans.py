"""Requests as a trace records them, read as spans of engine time: when each request's engine admitted it
(its start plus the wait its engine said it had), which engine served it, and what it shared its engine
with (the in-flight count, and any quantity that ramps over a request's span, as a difference of two
prefix sums). Read by calibration and by the offline evaluator's hints."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np

from targets.api import TraceEvent


def request_concurrency(events: list[TraceEvent]) -> list[tuple[TraceEvent, float]]:
    """Each completed request with the mean number of requests in flight on its device over its
    span (itself included): the batch it shared its engine iterations with. From the integral of the
    device's in-flight count (each request, aborted ones too, in flight from its start to its end):
    O(n log n) a device (a pairwise scan grew with the square: 4 s for 4,000 overlapping requests of one
    device, 75x this)."""
    return concurrency_of(requests_by_device(events))


def concurrency_of(by_device: dict[str, list[TraceEvent]]) -> list[tuple[TraceEvent, float]]:
    """``request_concurrency`` of requests already grouped by ``requests_by_device``."""
    out = []
    for requests in by_device.values():
        in_flight = ramp_integral([(admitted_at(e), e.t, 1.0, 1.0) for e in requests])
        for e in requests:
            start, end = admitted_at(e), e.t
            if e.data["aborted"] or end <= start:
                continue
            together = in_flight(end) - in_flight(start)  # its own span counted once in it
            out.append((e, max(1.0, together / (end - start))))
    return out


def served(events: list[TraceEvent]) -> list[TraceEvent]:
    """The generate events an engine answered (one failed, or aborted before any token, names none)."""
    return [e for e in events if e.kind == "generate" and "device" in e.data]


def requests_by_device(events: list[TraceEvent]) -> dict[str, list[TraceEvent]]:
    """Each device's generate events, in the order their engines admitted them."""
    by_device: dict[str, list[TraceEvent]] = defaultdict(list)
    for e in sorted(served(events), key=admitted_at):
        by_device[e.data["device"]].append(e)
    return by_device


ENGINE_WORD = ("queued", "cached", "word_cut")  # what an engine said of its work, in a generate event


def harness_timed(run: list[TraceEvent]) -> list[TraceEvent]:
    """``run`` with the engines' word on their work set aside: what the harness timed alone. That is what
    each said of a request (its wait, its reused prefix) and what the stack declared of its engines
    (``run_start``'s ``engine``: drafts, span, host tier, which the fit reads its timings through: a red team's
    stack declaring drafts its engines never made moved the fitted rates 5x and flipped the twin's ranking)."""
    return [
        TraceEvent(e.kind, e.t, {k: v for k, v in e.data.items() if k not in ENGINE_WORD})
        if e.kind == "generate" and any(k in e.data for k in ENGINE_WORD)
        else TraceEvent(e.kind, e.t, {**e.data, "engine": {}})
        if e.kind == "run_start" and e.data.get("engine")
        else e
        for e in run
    ]


def admitted_at(request: TraceEvent) -> float:
    """When the request's engine began computing it: its start plus the wait its engine reported
    (``Completion.queued_s``, recorded as ``queued``, no longer than the request took); its start where
    the engine does not say (the wait is then counted as decoding, and ``calibrate``'s notes say for how
    many requests)."""
    start, queued = request.data["start"], request.data.get("queued")
    return start if queued is None else min(request.t, start + queued)


def ramp_integral(ramps: list[tuple[float, float, float, float]]) -> Callable[[float], float]:
    """``F(t)``: the integral up to ``t`` of the sum of ``ramps``, each ``(start, end, first, last)`` a value
    rising linearly from ``first`` at its start to ``last`` at its end, nothing outside (a ramp of no
    length, nothing). Between two edges the sum is ``a + b t``: its area is a difference of prefix sums."""
    edges = []
    for start, end, first, last in ramps:
        if end > start:
            slope = (last - first) / (end - start)
            edges += [(start, first - slope * start, slope), (end, slope * start - first, -slope)]
    edges.sort()
    times = np.array([t for t, _, _ in edges] or [0.0])
    a = np.cumsum([da for _, da, _ in edges] or [0.0])  # the sum is a + b t from each edge to the next
    b = np.cumsum([db for _, _, db in edges] or [0.0])

    def area(i, t0, t1):
        return a[i] * (t1 - t0) + b[i] * (t1 * t1 - t0 * t0) / 2

    at_edges = np.concatenate(([0.0], np.cumsum(area(np.arange(len(times) - 1), times[:-1], times[1:]))))

    def integral(t: float) -> float:
        i = int(np.searchsorted(times, t, side="right")) - 1
        return 0.0 if i < 0 else float(at_edges[i] + area(i, times[i], t))

    return integral
