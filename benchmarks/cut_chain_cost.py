"""What the audit's reading of one turn cut many times costs: seconds and peak memory at P and 2P
segments, side by side, and their ratio (2 where the cost is linear in the segments, 4 where quadratic).

    python benchmarks/cut_chain_cost.py [--segments 10000]

Interruptions are the stack's to make, so a turn may be cut as often as it likes. Three layouts:
- ``chain``: a one-token partial, then resumptions each cut at once with nothing decoded, each by an
  interrupting sync of its own, each bringing the version a step had just returned (every piece legal;
  ``TraceIndex.response`` chains them all);
- ``restarts``: the turn started again from scratch each time, each attempt cut after one token;
- ``open``: the restarts, beside one interrupting sync held open the whole run (matching each abort to
  the calls in progress once walked back through every call begun before it).
Timed apart: the chaining of responses and the per-request checks (``TraceIndex.response``,
``_request_fault``, ``check_partial_rollout``), and the interruption checks (``check_aborts`` and
``check_partial_progress``, which match every abort against every interrupting call).
"""

from __future__ import annotations

import sys
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import typer

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from targets.api import TraceEvent  # noqa: E402
from targets.harness.judge.audit import _request_fault  # noqa: E402
from targets.harness.judge.interruptions import check_aborts  # noqa: E402
from targets.harness.judge.selection import check_partial_progress, check_partial_rollout  # noqa: E402
from targets.harness.judge.trace_index import Reasons, TraceIndex  # noqa: E402

STEP_S = 0.002  # one segment's slot: forwarded, cut, and its interrupting sync


def turn_cut(segments: int, layout: str) -> list[TraceEvent]:
    """A one-episode trace whose first turn is cut ``segments`` times (the last segment finishes)."""
    declared = {"partial_rollout": layout == "chain"}  # a restart discards its attempt: no partial rollout
    base = int(layout == "open")  # the open sync brings version 1
    start = {"tokens_recorded": True, "stop_token_ids": [0], "declared": declared}
    events = [
        TraceEvent("run_start", 0.0, {**start, "engines": {"d": ["d"]}}),
        TraceEvent("episode_created", 0.0, {"episode": "E", "group": "g"}),
        TraceEvent("env_reset", 0.0, {"episode": "E", "group": "g", "observation": [1, 2]}),
    ]
    if layout == "open":
        events.append(TraceEvent("train", 0.0, {"start": 0.0, "version": 1, "trajectories": []}))
        held = {"start": 0.0, "devices": ["d"], "version": 1, "interrupt": True}
        events.append(TraceEvent("sync", segments * STEP_S, held))
    for k in range(segments):
        at, last = k * STEP_S, k == segments - 1
        continues = min(k, 1) if layout == "chain" else 0
        tokens = [5] if (k == 0 or layout == "restarts" or last) else []
        if not last:  # a step returns the version each interrupting sync brings (none interrupts for nothing)
            version = k + 1 + base
            events.append(TraceEvent("train", at + 0.0008, {"start": at, "version": version, "trajectories": []}))
            sync = {"start": at + 0.0009, "devices": ["d"], "version": version, "interrupt": True}
            events.append(TraceEvent("sync", at + 0.0011, sync))
        data = {"episode": "E", "turn": 0, "start": at, "aborted": not last, "device": "d", "routed": None}
        data.update(prompt=[1, 2] + [5] * continues, continues=continues, tokens=tokens, logprobs=[-1.0] * len(tokens))
        data.update(version=0, finish="length" if last else "abort", temperature=1.0, max_new_tokens=64, stop=[0])
        events.append(TraceEvent("generate", at + 0.001, data))
    return sorted(events, key=lambda e: e.t)


def run_part(events: list[TraceEvent], part: str) -> Reasons:
    ix, r = TraceIndex.of(events), Reasons()
    if part == "chaining":
        for g in ix.by_kind["generate"]:
            assert _request_fault(ix, g) is None, _request_fault(ix, g)
            ix.response(g)
        check_partial_rollout(ix, r)
    else:
        check_aborts(ix, r, SimpleNamespace(simulator=SimpleNamespace(request_overhead_s=0.0)))
        check_partial_progress(ix, r)
    return r


def measure(events: list[TraceEvent], part: str) -> tuple[float, float]:
    """Seconds, then peak traced MB in a second pass (tracing slows Python several times over), of one
    part of the audit on a fresh index."""
    began = time.perf_counter()
    r = run_part(events, part)
    took = time.perf_counter() - began
    assert not r.lines(), r.lines()  # the layouts are honest: every check passes
    tracemalloc.start()
    run_part(events, part)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return took, peak / 1e6


def main(segments: int = 10_000) -> None:
    print(f"one turn cut P and 2P times (P = {segments:,}); ratio 2P/P: 2 linear, 4 quadratic")
    for layout in ("chain", "restarts", "open"):
        for part in ("chaining", "interruptions"):
            (t1, m1), (t2, m2) = (measure(turn_cut(n, layout), part) for n in (segments, 2 * segments))
            print(
                f"{layout:9s} {part:13s} P: {t1:6.2f} s {m1:6.0f} MB   2P: {t2:6.2f} s {m2:6.0f} MB"
                f"   ratio {t2 / t1:4.1f} (time) {m2 / max(m1, 1e-9):4.1f} (memory)"
            )


if __name__ == "__main__":
    typer.run(main)
