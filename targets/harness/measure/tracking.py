"""Per-training-step metrics of a run, from the harness trace, to TensorBoard or JSONL; and the run's
per-device timeline as a Chrome trace-event JSON that Perfetto (ui.perfetto.dev) and chrome://tracing open.

Why ROLL's names: a vibetrain run and a ROLL run (``roll/pipeline/agentic/agentic_pipeline.py``)
then plot on the same axes. A step is ROLL's step: model update, expand, wait for the batch, shrink,
train. Here step k's window runs from the end of training step k-1 (the run's start for step 1) to
the end of training step k. The run's tail after its last training step (a final sync and expand,
episodes no step will train) is no step's: the per-step figures add up to the benchmark's
(``targets/harness/measure/metrics.py``) over the run up to its last training step. Spans are the harness
proxy's stamps of the cluster calls, never the candidate's word.

====================================  ===================================================================
ROLL name                             our figure for the step (from the trace)
====================================  ===================================================================
``time/step_total``                   the step's window
``time/step_model_update``            wall time covered by ``sync``, ``expand`` and ``resume`` spans: every
                                      way new weights reach an engine (ROLL's model update loads them onto
                                      every inference GPU, the ones training freed included; its expand
                                      only re-routes)
``time/step_rollout``                 the trainer's wait for the batch (ROLL times ``get_batch``): from the
                                      window's start to this step's ``train`` start, less the model-update,
                                      shrink and weight-export time in between. Near 0 when rollout
                                      overlapped training
``time/step_shrink``                  wall time covered by ``shrink`` and ``suspend`` spans (a suspend
                                      offloads every engine: the colocated schedule's shrink)
``time/step_train``                   this step's ``train`` span
``time/step_weight_export``           (ours) the harness's copy of the weights after a step, which the
                                      controller's train call waits on; not counted in ``step_rollout``
``shrink/shrink_duration_ms``         the step's ``shrink`` and ``suspend`` spans summed, in ms
``shrink/aborted``                    turns aborted during those spans (on their devices when the trace
                                      names the device)
``expand/expand_duration_ms``         the step's ``expand`` and ``resume`` spans summed, in ms
``expand/aborted``                    turns aborted during those spans
``system/tps``                        trained tokens (whole sequences: ROLL's attention-mask sum) per
                                      second, over the last 5 steps as ROLL's ``_Timer(window_size=5)``
``system/samples``                    trajectories trained so far (ROLL: steps x rollout batch size)
====================================  ===================================================================

Not emitted: ``shrink/remapped`` (the router's environment-to-engine map is not in the trace),
``shrink/offload_ranks`` and ``expand/load_ranks`` (lists, not scalars), ``*/rollout_scheduler_duration_ms``
(our proxy times the whole call once: that is ``*_duration_ms``). ROLL has no goodput and logs
timeouts only per environment tag, so ours go under its ``system/`` namespace, defined as the
benchmark's restricted to the step's window:
``system/goodput`` (trajectories trained in this step that neither timed out nor lost their environment, per
second of the window), ``system/rollout_throughput`` (episodes the environments saw finish in the window, per
second), ``system/tokens_per_s`` (response tokens the environments received, per second), ``system/timeouts``
and ``system/timeout_ratio`` (episodes that finished timed out in the window; their fraction of those
finished) and ``system/aborted_turns``.

This module imports nothing from vibetrain but the trace reader (``targets.harness.trace``, with the
``targets.harness.clock`` it types against) and the device-activity functions the PNG timeline uses
(``targets.harness.measure.metrics``), which import only ``targets.api``: an exported project that tracks
copies those modules with this one.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from targets.api import TraceEvent
from targets.errors import UserError
from targets.harness.measure.metrics import ACTIVITIES, device_intervals, exclusive_activity, failed_episodes
from targets.harness.trace import Trace, token_count

KINDS = ("tensorboard", "jsonl")
WEIGHTS_IN = ("sync", "expand", "resume")  # time/step_model_update
SWITCH_OUT = ("shrink", "suspend")  # time/step_shrink, shrink/*
SWITCH_IN = ("expand", "resume")  # expand/*
TPS_WINDOW = 5  # steps, as ROLL's system/tps


class TrackingError(UserError, ValueError):
    """Tracking cannot go on: an unknown writer, a missing package, a trace that is not a finished run."""


# -- per-step scalars ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    number: int  # the trace's training step (1-based)
    start: float  # seconds since the run's start
    end: float
    scalars: dict[str, float]


def _covered(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Wall time within [lo, hi] that at least one span covers (concurrent spans counted once)."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in spans if min(b, hi) > max(a, lo))
    total, reach = 0.0, lo
    for a, b in clipped:
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def steps(events: Sequence[TraceEvent]) -> list[Step]:
    """One ``Step`` per training step of a finished harness run, with ROLL-named scalars."""
    run_start = next((e for e in events if e.kind == "run_start"), None)
    run_end = next((e for e in events if e.kind == "run_end"), None)
    if run_start is None or run_end is None:
        raise TrackingError("the trace has no run_start/run_end: it is not a finished harness run")
    origin, engines = run_start.t, run_start.data.get("engines", {})
    trains = sorted((e for e in events if e.kind == "train"), key=lambda e: e.t)
    spans = {
        kind: [(e.data["start"] - origin, e.t - origin, set(e.data["devices"])) for e in events if e.kind == kind]
        for kind in ("sync", "expand", "resume", "shrink", "suspend")
    }
    weights_in = [(a, b) for kind in WEIGHTS_IN for a, b, _ in spans[kind]]
    switch_out = [(a, b) for kind in SWITCH_OUT for a, b, _ in spans[kind]]
    # the harness's copy of the weights after a step (its audit's): the controller's train call waits on it
    exports = [(e.data["start"] - origin, e.t - origin) for e in events if e.kind == "weight_export"]
    done = [e for e in events if e.kind == "env_step" and e.data["done"]]
    failed = failed_episodes(done)  # as metrics.py: over the whole run
    aborts = [
        (e.t - origin, set(engines.get(e.data["device"], [e.data["device"]])) if "device" in e.data else None)
        for e in events
        if e.kind == "generate" and e.data["aborted"]
    ]

    def aborted_during(kinds: tuple[str, ...], inside) -> int:
        ops = [(a, b, devices) for kind in kinds for a, b, devices in spans[kind] if inside(b)]
        return sum(
            any(a <= t <= b and (where is None or where & devices) for a, b, devices in ops) for t, where in aborts
        )

    def spent_ms(kinds: tuple[str, ...], inside) -> float:
        return 1000 * sum(b - a for kind in kinds for a, b, _ in spans[kind] if inside(b))

    ends = [e.t - origin for e in trains]
    bounds = [0.0, *ends]
    out: list[Step] = []
    samples, recent = 0, deque(maxlen=TPS_WINDOW)
    for k, train in enumerate(trains):
        lo, hi = bounds[k], bounds[k + 1]
        first = k == 0

        def inside(t: float, lo: float = lo, hi: float = hi, first: bool = first) -> bool:
            """In the window (lo, hi]; the first step also takes what came before the run's start."""
            return (first or t > lo) and t <= hi

        total = hi - lo
        train_start = train.data["start"] - origin
        trajectories = train.data["trajectories"]
        samples += len(trajectories)
        recent.append((sum(token_count(t["tokens"]) for t in trajectories), total))
        recent_s = sum(s for _, s in recent)
        finished = [e for e in done if inside(e.t - origin)]
        turns = [e for e in events if e.kind == "env_step" and inside(e.t - origin)]
        timeouts = sum(e.data["timed_out"] for e in finished)
        waited = max(0.0, train_start - lo)

        def rate(count: float, total: float = total) -> float:
            return count / total if total > 0 else 0.0  # two steps ending at one instant: the second's window is empty

        scalars = {
            "time/step_total": total,
            "time/step_model_update": _covered(weights_in, lo, hi),
            "time/step_rollout": max(
                0.0, waited - _covered(weights_in + switch_out + exports, lo, max(lo, train_start))
            ),
            "time/step_shrink": _covered(switch_out, lo, hi),
            "time/step_train": train.t - train.data["start"],
            "time/step_weight_export": _covered(exports, lo, hi),
            "shrink/shrink_duration_ms": spent_ms(SWITCH_OUT, inside),
            "shrink/aborted": aborted_during(SWITCH_OUT, inside),
            "expand/expand_duration_ms": spent_ms(SWITCH_IN, inside),
            "expand/aborted": aborted_during(SWITCH_IN, inside),
            "system/tps": sum(n for n, _ in recent) / recent_s if recent_s > 0 else 0.0,
            "system/samples": samples,
            "system/goodput": rate(len({t["episode"] for t in trajectories} - failed)),
            "system/rollout_throughput": rate(len(finished)),
            "system/tokens_per_s": rate(sum(token_count(e.data["action"]) for e in turns)),
            "system/timeouts": timeouts,
            "system/timeout_ratio": timeouts / len(finished) if finished else 0.0,
            "system/aborted_turns": sum(inside(t) for t, _ in aborts),
        }
        out.append(Step(train.data["step"], lo, hi, scalars))
    return out


# -- writers -------------------------------------------------------------------------------------


class Tracker(Protocol):
    """Where per-step scalars go. ``run`` names one series (a schedule, a round): a TensorBoard run."""

    directory: Path

    def log(self, run: str, step: int, scalars: Mapping[str, float]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def _run_name(run: str) -> str:
    """A run becomes a subdirectory (TensorBoard) or a field (JSONL): it must stay inside the directory."""
    parts = run.split("/")
    if not run or run.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise TrackingError(f"run name {run!r}: give one or more plain names joined by '/'")
    return run


def _summary_writer() -> type:
    """TensorBoard's writer class, or a TrackingError that says what to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise TrackingError(
            f"tracking to TensorBoard needs the tensorboard package ({error}): pip install tensorboard"
        ) from None
    return SummaryWriter


class TensorBoardTracker:
    """One ``SummaryWriter`` per run, in ``directory/<run>``, so TensorBoard overlays runs per tag."""

    def __init__(self, directory: Path) -> None:
        self.directory, self._writer_of, self._writers = directory, _summary_writer(), {}

    def log(self, run: str, step: int, scalars: Mapping[str, float]) -> None:
        if run not in self._writers:
            self._writers[run] = self._writer_of(log_dir=str(self.directory / _run_name(run)))
        for tag, value in scalars.items():
            self._writers[run].add_scalar(tag, value, global_step=step)

    def flush(self) -> None:
        for writer in self._writers.values():
            writer.flush()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()


class JsonlTracker:
    """``directory/metrics.jsonl``, one ``{"step", "run", tag: value}`` object a line, appended (a
    resumed run adds to it) and flushed a line at a time (a killed run keeps what it logged)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / "metrics.jsonl"
        self._file = None

    def log(self, run: str, step: int, scalars: Mapping[str, float]) -> None:
        if self._file is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")
        self._file.write(json.dumps({"step": step, "run": _run_name(run), **scalars}) + "\n")
        self._file.flush()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def tracker_kind(kind: str) -> Callable[[Path], Tracker]:
    """The writer class for ``--track KIND``, checked (a known kind, its package installed) before a
    command picks or makes the directory, so a refused ``--track`` leaves no folder behind."""
    if kind == "tensorboard":
        _summary_writer()
        return TensorBoardTracker
    if kind == "jsonl":
        return JsonlTracker
    raise TrackingError(f"--track {kind!r}: choose one of {', '.join(KINDS)}")


def open_tracker(kind: str, directory: Path) -> Tracker:
    """The writer for ``--track KIND``; nothing is written until the first scalar."""
    return tracker_kind(kind)(directory)


def track_trace(tracker: Tracker, run: str, events: Sequence[TraceEvent]) -> list[Step]:
    """Every training step of one run's trace, logged under ``run``."""
    measured = steps(events)
    for step in measured:
        tracker.log(run, step.number, step.scalars)
    tracker.flush()
    return measured


def track_round(tracker: Tracker, number: int, headline: float, trace_path: Path) -> Path:
    """A validated generate round: ``round/headline`` at step=round (run ``rounds``), its median
    measured run's steps (run ``round-N``), and that run's Chrome trace; returns the trace's path."""
    tracker.log("rounds", number, {"round/headline": headline})
    tracker.flush()
    if not trace_path.is_file():
        raise TrackingError(f"round {number} kept no trace at {trace_path}: only its headline was tracked")
    events = Trace.load_events(trace_path)
    track_trace(tracker, f"round-{number}", events)
    return write_chrome_trace({f"round-{number}": events}, tracker.directory / f"round-{number}.trace.json")


# -- Chrome trace-event JSON (Perfetto) ------------------------------------------------------------


def write_chrome_trace(runs: Mapping[str, Sequence[TraceEvent]], path: Path) -> Path:
    """One process per run, one thread per device (its activity as the PNG timeline colors it: each
    moment once, under the highest-priority activity) and a ``steps`` thread with each step's window
    and its scalars. Times are microseconds since each run's start, so runs line up."""
    out: list[dict] = []
    for pid, (name, events) in enumerate(runs.items(), start=1):
        measured = steps(events)
        run_start = next(e for e in events if e.kind == "run_start")
        intervals = device_intervals(list(events))
        devices = list(run_start.data["devices"])
        devices += sorted(set(intervals) - set(devices))  # an engine the trace names outside the device list
        out += [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "steps"}},
            {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": 0}},
        ]
        for step in measured:
            out.append(_slice(f"step {step.number}", "step", step.start, step.end, pid, 0, step.scalars))
        for tid, device in enumerate(devices, start=1):
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": device}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
            exclusive = exclusive_activity(intervals.get(device, {}))
            for activity in ACTIVITIES:
                out += [_slice(activity, activity, a, b, pid, tid) for a, b in exclusive[activity] if b > a]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": out, "displayTimeUnit": "ms"}))
    return path


def _slice(name: str, category: str, start: float, end: float, pid: int, tid: int, args: dict | None = None) -> dict:
    event = {"name": name, "cat": category, "ph": "X", "ts": start * 1e6, "dur": (end - start) * 1e6}
    event |= {"pid": pid, "tid": tid}
    return event | ({"args": args} if args else {})
