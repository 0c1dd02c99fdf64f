"""Fit the cost model's efficiencies and overheads (the spec's ``simulator`` section and
``hardware.mfu``) from real runs' traces, so the simulator predicts runs of that hardware.

Several runs pool their samples (each request's concurrency and each task's lengths read within its
own run): a run of a controller that never shrinks has no offload to time, and a later run of one
that does supplies it.

* **training**: each ``train`` event's duration against its FLOPs (cost-model formula) over its
  devices: least squares ``duration = flops / (devices * peak * mfu) + train_step_overhead_s``.
* **rollout**: both engine recipes batch continuously, so each completed request is one row. A request
  that generated ``n`` tokens spanned ``n`` engine iterations (``n / E`` where its stack drafts ``k``
  tokens at ``b``, each iteration ``k + 1`` positions wide: the simulator's verification) beside, on
  average, ``b`` requests in flight on its device (``b`` from the trace: the overlap of the other
  requests' spans with its own, plus itself). A request's span starts when its engine admitted it: the
  wait its engine reported (``queued``, for KV room or behind a weight load) is neither decoding nor
  batch. Its latency is what the simulator charges: each of those iterations takes the larger of its
  read (the weights a ``b``-sequence batch touches and its KV, over the HBM bandwidth times
  ``hbm_efficiency``) and its decode FLOPs (over the peak times ``rollout_mfu``), plus
  ``decode_step_overhead_s`` (and, an engine of several devices, its all-reduces' bytes, which the
  spec's links price); the prefills of the requests that joined meanwhile add their FLOPs (new tokens
  only: a prefix the same device served the episode's previous turn is cached); the answer adds
  ``request_overhead_s``. The ratio of the two efficiencies is searched on a grid; at each, the rest is
  linear and solved by non-negative least squares. (A fit of compute alone put a memory-bound engine's
  reads into the per-iteration cost: on a simulated 8B H100 run, 26 ms an iteration where the spec says
  3.)
* **weight sync** and **offload/reload**: their mean durations less the modelled transfer time (a
  suspend times an offload; a resume with no sync in the run times a reload and a sync); with none in
  any run, the spec's constants are kept (``notes`` says so).
* **the harness's weight export** (``weight_export_s``): its mean duration; the train call of a real
  run waits for it (the 0.6B's float32 copy took 21-24 s a step on the first H100 run).
* **response lengths** (``workload.tokens.response_length``): the mean tokens a completed turn
  generated, and the log-space spreads by moments: ``turn_sigma^2`` the mean variance of log
  lengths within a group, ``task_sigma^2`` the variance of the groups' mean log lengths less
  ``turn_sigma^2 / turns per group`` (at least 0). Turns cut at the budget count at the budget,
  so a model that often runs to its budget gets spreads on the low side.

The rollout fit keeps its constants non-negative (a term noise outweighs is fitted as zero, and
``notes`` says so); a training fit with a negative term falls back to the zero-overhead fit; a device
measured faster than its catalog peak gets ``bf16_tflops`` raised (also in ``notes``).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import yaml

from targets.api import EngineSettings, TraceEvent
from targets.errors import UserError
from targets.harness.isolation.stack_digest import directory_digest
from targets.harness.sim.cost_model import ClusterCosts, CostModel
from targets.harness.sim.profile_fit import (
    ProfileError,
    fit_profile,
    held_spread,
    lengths_yaml,
    response_lengths,
    stand_in_workload,
)
from targets.harness.sim.request_spans import admitted_at, concurrency_of, ramp_integral, requests_by_device, served
from targets.harness.trace import consumed_at, token_count
from targets.spec import ResponseLengthSpec, SimulatorSpec, TargetSpec, load_target, resolve_target_path


@dataclass
class Calibration:
    simulator: SimulatorSpec
    mfu: float
    bf16_tflops: float
    response_length: ResponseLengthSpec | None = None  # None: the run completed no turn
    notes: list[str] = field(default_factory=list)
    samples: dict[str, int] = field(default_factory=dict)
    unfitted: list[str] = field(default_factory=list)  # trace event kinds whose cost stayed the spec's guess
    profile: dict | None = None  # a user's environment's measured workload (profile_fit), which the twin plays

    def yaml_fields(self) -> dict:
        """What to write into the target spec: ``hardware`` numbers, the ``simulator`` section and
        the response lengths (under ``workload.tokens``)."""
        fields = {
            "hardware": {"mfu": round(self.mfu, 4), "bf16_tflops": round(self.bf16_tflops, 6)},
            "simulator": {
                k: (round(v, 6) if isinstance(v, float) else v)
                for k, v in self.simulator.model_dump(exclude_none=True).items()
            },
        }
        if self.response_length is not None:
            fields["workload"] = {"tokens": {"response_length": lengths_yaml(self.response_length)}}
        return fields


if TYPE_CHECKING:
    from targets.harness.measure.session import Session
    from targets.harness.target import Target


def _line_fit(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least squares ``y = a * x + b``; None when x does not vary."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var <= 0:
        return None
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    return a, my - a * mx


def _nonnegative_fit(rows: list[tuple[float, ...]]) -> tuple[float, ...] | None:
    """Least squares ``y = sum_k c_k * x_k`` (no intercept; the last entry of a row is ``y``) with every
    ``c_k >= 0``; None when no subset of the terms can be solved.

    Exact for a handful of terms: the constrained optimum is the unconstrained fit on some subset of
    the terms (the rest at zero), so every subset is solved and the best feasible one kept. A term
    fitted as zero is one the noise outweighs."""
    xs = np.array([row[:-1] for row in rows], dtype=float)
    ys = np.array([row[-1] for row in rows], dtype=float)
    terms = xs.shape[1]
    best, best_residual = None, float("inf")
    for subset in itertools.chain.from_iterable(itertools.combinations(range(terms), k) for k in range(1, terms + 1)):
        columns = xs[:, subset]
        if np.linalg.matrix_rank(columns) < len(subset):
            continue
        solution = np.linalg.lstsq(columns, ys, rcond=None)[0]
        if (solution < 0).any():
            continue
        residual = float(((columns @ solution - ys) ** 2).sum())
        if residual < best_residual - 1e-15:
            coefficients = np.zeros(terms)
            coefficients[list(subset)] = solution
            best, best_residual = tuple(float(c) for c in coefficients), residual
    return best


PREFIX_EMPTYING = ("sync", "shrink", "expand", "suspend", "resume")  # trace events that empty an engine's cache


def _sync_times(run: list[TraceEvent]) -> list[float]:
    """Each sync's time less the drain it began with: a sync that does not interrupt waits for the requests
    its engines were serving to end (the simulator's too), so the time until the last of them ended is the
    batch's, not the sync's; fitted as sync overhead, the twin charged the drain twice (19 s of overhead
    fitted where 0.5 s was true). One run at a time: another run's requests are on another clock."""
    generates = [g for g in run if g.kind == "generate"]
    times = []
    for sync in (e for e in run if e.kind == "sync" and e.data["devices"]):  # one of no device moves nothing
        devices, start = set(sync.data["devices"]), sync.data["start"]
        drained = [
            g.t for g in generates if g.data.get("device") in devices and g.data["start"] < start < g.t <= sync.t
        ]
        times.append(sync.t - max([start, *drained]))
    return times


def _engines_of(spec: TargetSpec, run: list[TraceEvent]) -> CostModel:
    """The cost model of the run's engines as its stack declared them (``run_start``'s ``engine``: their
    span, drafts, host tier and prefill chunks, which the simulator charges), not the catalog's plain one:
    an engine of two devices reads twice as fast, and fitted as one it looked like catalog rates beaten."""
    start = next((e for e in run if e.kind == "run_start"), None)
    settings = EngineSettings(**((start.data.get("engine") or {}) if start is not None else {}))
    return ClusterCosts.from_spec(spec).for_engines(settings).pools[next(iter(spec.hardware.by_name))]


def _rollout_rows(cost: CostModel, events: list[TraceEvent]) -> list[tuple[float, float, float, float, float]]:
    """Per completed request: (iterations, one iteration's read time at full HBM bandwidth, one
    iteration's decode compute time at the peak (both over its drafts' positions too, where it drafted),
    its prefills' compute time at the peak, latency), each over the engine's devices (see the module
    doc). A prefill computes the prompt less the prefix its engine says it reused (``cached``); where the
    engine does not say, less the context the device held for the episode since its last weight load,
    offload or wake (no eviction seen)."""
    prefills: dict[int, tuple[int, int]] = {}  # id(event) -> (tokens its prefill computed, the prefix it read)
    cached: dict[tuple[str, str], int] = {}  # (episode, device) -> context the device holds for it
    # a weight load, an offload or a wake empties an engine's prefix cache (as the simulator's does)
    emptied = sorted((e.t, set(e.data["devices"])) for e in events if e.kind in PREFIX_EMPTYING)
    for e in sorted(served(events), key=admitted_at):
        while emptied and emptied[0][0] <= admitted_at(e):
            devices = emptied.pop(0)[1]
            cached = {key: tokens for key, tokens in cached.items() if key[1] not in devices}
        key = (e.data["episode"], e.data["device"])
        prompt = token_count(e.data["prompt"])
        prefix = e.data["cached"] if "cached" in e.data else cached.get(key, 0)  # the engine's word first
        prefills[id(e)] = (prompt - prefix, prefix) if prefix <= prompt else (prompt, 0)
        if "queued" in e.data and admitted_at(e) >= e.t:  # waited until it was aborted: never computed
            prefills[id(e)] = (0, 0)
        if e.data["aborted"]:
            cached.pop(key, None)  # an abort frees the sequence's KV
        else:
            cached[key] = prompt + token_count(e.data["tokens"])
    # per device, the requests' starts in order and the prefill FLOPs of those up to each (attention
    # over the prefix too): the prefills a span saw begin are a difference of two sums
    starts: dict[str, np.ndarray] = {}
    prefilled: dict[str, np.ndarray] = {}
    prefill_reduces: dict[str, np.ndarray] = {}  # and the seconds of their tensor-parallel all-reduces
    kv: dict[str, Callable[[float], float]] = {}  # per device, the integral of its requests' KV over time
    by_device = requests_by_device(events)
    for device, requests in by_device.items():
        starts[device] = np.array([admitted_at(o) for o in requests])
        flops = [cost.prefill_flops(*prefills[id(o)]) for o in requests]
        prefilled[device] = np.concatenate(([0.0], np.cumsum(flops)))
        reduces = [cost.tensor_parallel_s(prefills[id(o)][0]) if prefills[id(o)][0] else 0.0 for o in requests]
        prefill_reduces[device] = np.concatenate(([0.0], np.cumsum(reduces)))
        # each request's context grows from its prompt to its prompt and response over its span
        contexts = [(token_count(o.data["prompt"]), token_count(o.data.get("tokens", 0))) for o in requests]
        kv[device] = ramp_integral([(admitted_at(o), o.t, p, p + n) for o, (p, n) in zip(requests, contexts)])
    bandwidth = cost.engine_devices * cost.hbm_bytes_per_s
    compute = cost.engine_devices * cost.peak_flops
    rows = []
    for e, batch in concurrency_of(by_device):
        start, end = admitted_at(e), e.t
        n = token_count(e.data["tokens"])
        context = (kv[e.data["device"]](end) - kv[e.data["device"]](start)) / (end - start)  # the batch's mean KV
        first, past = np.searchsorted(starts[e.data["device"]], [start, end], side="left")  # start <= s < end
        prefill = float(prefilled[e.data["device"]][past] - prefilled[e.data["device"]][first])
        drafts = cost.drafts_at(batch)  # a stack that drafts verifies k + 1 positions a step for E tokens
        width = drafts + 1
        iterations = n / cost.tokens_per_step(drafts)
        read = cost.decode_bytes(batch * width, context) / bandwidth
        flops = width * cost.decode_flops(batch, context) / compute
        # an engine of several devices: the all-reduces' bytes the simulator charges (their latency is the
        # step overhead fitted here), its iterations' and the joining prefills'
        reduces = iterations * cost.tensor_parallel_s(batch * width) + float(
            prefill_reduces[e.data["device"]][past] - prefill_reduces[e.data["device"]][first]
        )
        rows.append((iterations, read, flops, prefill / compute, end - start - reduces))
    return rows


# An iteration takes the larger of its read and its compute, which no linear fit can express. But at a
# given ratio of the two efficiencies each request's time is linear in the rest: (its iterations' larger
# term plus its prefills) / rollout_mfu + n * decode_step_overhead_s + request_overhead_s. So the ratio
# is searched on a log grid, then on finer ones around the best, and the rest solved exactly
# (non-negative least squares) at each point.
RATIO_GRID = np.logspace(-3, 3, 121)  # rollout_mfu / hbm_efficiency
REFINEMENTS = 2  # each in tenths of the last step: the ratio to within 0.1%
# An MFU above 1 is compute faster than the catalog's peak. Where fixed costs explain the latencies
# nearly as well (a host-bound engine: the H200's 6.8 ms decode iterations against a 0.5 ms roofline fitted
# a 152x MFU, and the peak was then raised 152x), the MFU is held at 1 and the fixed costs carry the rest;
# only where that fits worse than this factor in squared error is the catalog's peak wrong (raised later).
PEAK_KEPT = 1.1
MIN_TRAIN_STEPS = 3  # training steps a fixed overhead is fitted from, at least
TRAIN_WORK_SPREAD = 1.2  # and the most work a step did over the least, at least


def _rollout_fit(rows: list[tuple[float, ...]]) -> tuple[float, float, float, float, float] | None:
    """(decode_step_overhead_s, rollout_mfu, request_overhead_s, hbm_efficiency, squared error) with
    latency = n * (max(read / hbm_efficiency, compute / rollout_mfu) + decode_step_overhead_s)
    + prefill / rollout_mfu + request_overhead_s: the simulator's own formula, so a memory-bound
    engine's reads are not fitted as a fixed cost per iteration. Reads faster than the catalog's
    bandwidth are not a fit (their ratio is skipped); of equally good fits the lowest ratio is kept, so
    reads no request was bound by get the catalog's bandwidth, not a lower one; nor is compute faster
    than the peak (an MFU above 1 is held at 1). None when latencies do not grow with the work at any
    ratio (or too few distinct requests)."""
    n, read, compute, prefill, latency = (np.array(column, dtype=float) for column in zip(*rows))
    ones = np.ones_like(n)
    tie = 1e-9 * float((latency**2).sum())  # squared errors this close are equally good fits

    def at(ratio: float, held: bool) -> tuple[float, float, float, float, float] | None:
        work = n * np.maximum(ratio * read, compute) + prefill  # seconds at 100% of the peak
        if held:  # rollout_mfu 1: the fixed costs fitted to what the work at the peak leaves
            fixed = _nonnegative_fit(list(zip(n, ones, latency - work)))
            fit = None if fixed is None else (1.0, *fixed)
        else:
            fit = _nonnegative_fit(list(zip(work, n, ones, latency)))
        if fit is None or fit[0] <= 0:
            return None
        per_work, step, request = fit
        if per_work * ratio < 1.0:  # hbm_efficiency above 1
            return None
        residual = float(((work * per_work + n * step + request - latency) ** 2).sum())
        return step, 1 / per_work, request, 1 / (per_work * ratio), residual

    def search(ratios, best, best_ratio, held):
        for ratio in map(float, ratios):
            fit = at(ratio, held)
            if fit is None:
                continue
            if best is None or fit[4] < best[4] - tie or (fit[4] <= best[4] + tie and ratio < best_ratio):
                best, best_ratio = fit, ratio
        return best, best_ratio

    def best_fit(held: bool):
        best, best_ratio = search(RATIO_GRID, None, 0.0, held)
        step = RATIO_GRID[1] / RATIO_GRID[0]
        for _ in range(REFINEMENTS):
            if best is None:
                return None
            best, best_ratio = search(best_ratio * np.logspace(-1, 1, 21, base=step), best, best_ratio, held)
            step = step**0.1
        return best

    free = best_fit(held=False)
    if free is None or free[1] <= 1.0:
        return free
    held = best_fit(held=True)  # compute faster than the peak: is the peak wrong, or the MFU unidentified?
    return held if held is not None and held[4] <= PEAK_KEPT * free[4] + tie else free


class PooledTarget(UserError, ValueError):
    """Calibration asked of a target of several pools: it fits one device kind's constants."""


def refuse_pools(spec: TargetSpec) -> None:
    """Calibration fits one device kind's constants."""
    if len(spec.hardware.by_name) > 1:
        pools = list(spec.hardware.by_name)
        raise PooledTarget(f"calibration fits one device kind; target {spec.id} has the pools {pools}")


def calibrate(spec: TargetSpec, runs: list[list[TraceEvent]]) -> Calibration:
    """The fit over the events of one or more real runs of ``spec``."""
    refuse_pools(spec)
    cost = CostModel.from_spec(spec)
    notes: list[str] = []
    fitted = spec.simulator.model_dump() | {"batching": "continuous"}  # both engine recipes batch continuously
    events = [e for run in runs for e in run]

    # -- training ------------------------------------------------------------------------------
    train_rows = []
    for e in (e for e in events if e.kind == "train"):  # a streamed step's call trains its own batch only
        own = [t for t in e.data["trajectories"] if consumed_at(e, t) == e.data["start"]]
        lengths = [token_count(t["tokens"]) for t in own]
        flops = (cost.train_s(lengths, 1) - cost.train_step_overhead_s) * cost.peak_flops * cost.train_mfu
        train_rows.append((flops / (len(e.data["devices"]) * cost.peak_flops), e.t - e.data["start"]))
    mfu = spec.hardware.mfu
    if train_rows:
        work = [x for x, _ in train_rows]
        # a line through two steps of nearly the same work is their timing noise: a step's jitter of 2% made
        # an overhead of 17.8 s (1 s true); the slope and the intercept need steps that differ in work
        spread = len(train_rows) >= MIN_TRAIN_STEPS and max(work) >= TRAIN_WORK_SPREAD * min(work)
        fit = _line_fit(work, [y for _, y in train_rows]) if spread else None
        if fit and fit[0] > 0 and fit[1] >= 0:
            mfu, fitted["train_step_overhead_s"] = 1 / fit[0], fit[1]
        else:
            mfu = sum(x for x, _ in train_rows) / sum(y for _, y in train_rows)
            fitted["train_step_overhead_s"] = 0.0
            why = (
                "durations do not grow with FLOPs here"
                if spread
                else (
                    f"{len(train_rows)} steps, too few or too alike in work (at least {MIN_TRAIN_STEPS}, the largest "
                    f"{TRAIN_WORK_SPREAD:g}x the smallest) to tell a fixed cost from the MFU"
                )
            )
            notes.append(f"training: {why}; fitted the MFU with no fixed overhead")

    # -- rollout ---------------------------------------------------------------------------------
    rollout_rows = [row for run in runs for row in _rollout_rows(_engines_of(spec, run), run)]
    answered = [e for e in served(events) if not e.data["aborted"]]  # (one aborted while waiting reused nothing)
    if unsaid := sum(1 for e in answered if e.data.get("queued") is None):
        notes.append(
            f"rollout: the engines did not say how long {unsaid} of {len(answered)} requests waited for admission "
            "(Completion.queued_s): their waits count as decoding, which makes the engines look slower"
        )
    if cut := sum(1 for e in served(events) if e.data.get("word_cut")):
        notes.append(
            f"rollout: the engines said more than the harness saw for {cut} requests (a wait longer than the request, "
            "a prefix longer than its prompt): held to what it saw; an engine whose word is wrong misleads the fit"
        )
    if unsaid := sum(1 for e in answered if e.data.get("cached") is None):
        notes.append(
            f"rollout: the engines did not say what prefix {unsaid} of {len(answered)} requests reused "
            "(Completion.cached_tokens): assumed kept since the last weight load (an eviction under KV pressure "
            "unseen, the prefills it costs look like slow decoding)"
        )
    fit = _rollout_fit(rollout_rows) if rollout_rows else None
    if fit is None and rollout_rows:
        fixed = _nonnegative_fit([(row[0], 1.0, row[-1]) for row in rollout_rows])
        if fixed is not None:
            notes.append("rollout: latencies do not grow with reads or FLOPs beyond fixed costs: both at catalog rates")
            fit = (fixed[0], 1.0, fixed[1], 1.0, 0.0)
    if fit is not None:
        step, mfu_rollout, request, hbm, _ = fit
        fitted |= {
            "decode_step_overhead_s": step,
            "rollout_mfu": mfu_rollout,
            "request_overhead_s": request,
            "hbm_efficiency": hbm,
        }
        for value, term in ((step, "engine iterations"), (request, "requests")):
            if value == 0:
                notes.append(f"rollout: latencies do not grow with {term} beyond their reads and FLOPs: no fixed cost")
    elif rollout_rows:
        notes.append("rollout: too few distinct requests to fit; the spec's rollout constants kept")

    # -- weight sync and switching ---------------------------------------------------------------
    def least_mean(name: str, per_run: list[list[float]]) -> float | None:
        """Each run's mean, and the least of them: a mechanism's cost is its stack's to make, so one stack's
        slow calls must not raise the twin's figure for the others it screens (a red team's stack stalled
        shrinks of no device 5 s each, and the twin pooling its trace screened out every switching candidate)."""
        means = [sum(spans) / len(spans) for spans in per_run if spans]
        if len(means) > 1 and max(means) > 2 * min(means):
            notes.append(
                f"{name}: the least of {len(means)} runs' means, {min(means):.3g} s (the most {max(means):.3g} s)"
            )
        return min(means) if means else None

    def mean_duration(kinds: tuple[str, ...]) -> float | None:
        """Over the calls that moved an engine: one naming no device moves nothing (the simulator charges none)."""
        return least_mean(
            "/".join(kinds),
            [[e.t - e.data["start"] for e in run if e.kind in kinds and e.data.get("devices") != []] for run in runs],
        )

    unfitted = []
    # A suspend offloads every engine, as a shrink does one: the switch's own cost. An expand or a resume
    # reloads them and then brings the stale ones to the latest weights (the simulator's order, and an
    # expand after training always finds its engines stale), so it times a sync too: fitted from them,
    # the switch would carry the sync the simulator charges again. With no sync of its own, a run's
    # resumes time the sync: what a resume takes beyond its reload (one device's colocate run).
    switch = mean_duration(("shrink", "suspend"))
    if switch is None and (switch := mean_duration(("expand",))) is not None:
        notes.append("switch_overhead_s fitted from expands alone, which time a weight load too: an upper bound")
    if switch is not None:
        fitted["switch_overhead_s"] = max(0.0, switch - (cost.offload_s() - cost.switch_overhead_s))
    else:
        notes.append(
            f"no shrink, expand or suspend in the run(s): switch_overhead_s kept at {cost.switch_overhead_s:g} s"
        )
        unfitted += ["shrink", "expand", "suspend"]
    export = mean_duration(("weight_export",))
    if export is not None:
        fitted["weight_export_s"] = export
    else:
        notes.append(f"no weight export in the run(s): weight_export_s kept at {spec.simulator.weight_export_s:g} s")
    sync = least_mean("sync", [_sync_times(run) for run in runs])
    resume = mean_duration(("resume",))
    if sync is None and resume is not None and switch is not None and resume > switch:
        sync = resume - switch
        notes.append(f"no weight sync in the run(s): fitted from the resumes, {sync:.3g} s beyond their reload")
    if sync is not None:
        fitted["sync_overhead_s"] = max(0.0, sync - (cost.sync_s() - cost.sync_overhead_s))
    else:
        notes.append(f"no weight sync in the run(s): sync_overhead_s kept at {cost.sync_overhead_s:g} s")
        unfitted.append("sync")
    # Efficiencies are fractions of the catalog peak; a device faster than its catalog number gets
    # its peak raised so that the fastest fitted rate is 100% of it.
    peak = spec.hardware.bf16_tflops
    scale = max(1.0, mfu, fitted["rollout_mfu"])
    if scale > 1.0:
        notes.append(f"measured compute above the catalog peak ({peak:g} TFLOP/s): bf16_tflops raised {scale:.2f}x")
        peak, mfu, fitted["rollout_mfu"] = peak * scale, mfu / scale, fitted["rollout_mfu"] / scale
    lengths = response_lengths(spec, runs)
    if lengths is not None:
        notes += held_spread(lengths)
    samples = {"train_steps": len(train_rows), "requests": len(rollout_rows)}
    # a user's environment only runs for real: the twin plays its measured profile on the stand-in
    stand_in = fit_profile(spec, runs, f"{spec.id} (calibration)", lengths) if spec.workload.environment.entry else None
    return Calibration(SimulatorSpec.model_validate(fitted), mfu, peak, lengths, notes, samples, unfitted, stand_in)


def write_calibrated_spec(target_ref: str, calibration: Calibration, path: Path) -> Path:
    """The target's own YAML with the fitted numbers in place: the calibrated twin, a simulated target.
    A user's environment, which only runs for real, is played by the stand-in with its measured profile."""
    raw, spec = yaml.safe_load(resolve_target_path(target_ref).read_text()), load_target(target_ref)
    if isinstance(raw.get("workload"), dict) and "profile" in raw["workload"]:  # its keys inline, then refitted
        raw["workload"] = spec.workload.model_dump(mode="json", exclude_none=True)
    # the copy lives elsewhere: a model directory named relative to the spec's folder is named absolute
    raw["model"]["weights"] = spec.model.weights
    if spec.workload.reward_model is not None:
        raw["workload"]["reward_model"]["model"]["weights"] = spec.workload.reward_model.model.weights
    fields = calibration.yaml_fields()
    raw["hardware"] = {**raw["hardware"], **fields["hardware"]}
    raw["simulator"] = fields["simulator"]
    raw["execution"] = "simulated"  # a twin is simulated, whatever its target (the stand-in runs only so)
    if calibration.profile is not None:
        raw["workload"] = stand_in_workload(raw["workload"], calibration.profile)
    if "workload" in fields:
        raw["workload"]["tokens"] = {**raw["workload"]["tokens"], **fields["workload"]["tokens"]}
    written = path.with_name(f".{path.name}.writing")  # then renamed: a kill never leaves a torn spec
    written.write_text(yaml.safe_dump(raw, sort_keys=False))
    os.replace(written, path)
    return path


def measure_and_predict(session: Session, stack_dir: Path, work: Path, steps: int | None = None) -> dict:
    """Run the stack for real, then ``fit_and_predict`` on its trace. The real run is judged like any
    measured run."""
    refuse_pools(session.target.spec)  # before the run it would fit
    real = session.measure(stack_dir, work / "real", seed=0, steps=steps)
    if not real.ok:
        raise RuntimeError("the real run failed: " + "; ".join(real.reasons[:3]))
    return fit_and_predict(session, stack_dir, work, real.events(), steps)


class TraceRefused(UserError, RuntimeError):
    """A trace given to fit that is not a finished real run of the target (a user's mistake: named)."""


def recorded_run(trace_path: Path, target: Target, stack_dir: Path) -> tuple[list[TraceEvent], int, str | None]:
    """The events and step count of a real run recorded elsewhere (a GPU machine's ``trace.jsonl``),
    refused with the reason if it is not a finished run of ``target``'s hardware by the stack in
    ``stack_dir`` (a fit to another stack's run predicts this one's with that stack's errors, and nothing
    else would say so). The third value: a note where the trace cannot say which stack ran it."""
    from targets.harness.trace import Trace

    if not trace_path.is_file():
        what = "a directory, not a file" if trace_path.is_dir() else "no such file"
        raise TraceRefused(f"--trace {trace_path}: {what} (the trace.jsonl of a recorded real run)")
    try:
        events = Trace.load_events(trace_path)
    except (OSError, ValueError, TypeError) as error:  # missing, not JSON lines, not trace events
        raise TraceRefused(f"--trace {trace_path}: not a readable trace ({error})") from None
    starts = [e for e in events if e.kind == "run_start"]
    if not starts or not any(e.kind == "run_end" for e in events):
        raise TraceRefused(f"--trace {trace_path}: not the trace of a finished run (no run_start/run_end event)")
    devices = [d.id for d in target.devices()]
    if starts[0].data.get("devices") != devices:
        raise TraceRefused(
            f"--trace {trace_path}: a run on {starts[0].data.get('devices')}, not {target.id}'s {devices}"
        )
    if not starts[0].data.get("tokens_recorded", True):
        raise TraceRefused(f"--trace {trace_path}: a simulated run (it recorded no tokens); calibration fits real ones")
    recorded, note = starts[0].data.get("stack"), None
    if recorded is None:  # a trace from before run_start named its stack
        note = f"--trace {trace_path} does not say which stack ran it: its fit is taken as {stack_dir}'s"
    elif recorded != directory_digest(stack_dir / "stack"):
        raise TraceRefused(
            f"--trace {trace_path}: a run of another stack than {stack_dir} (its stack/ differs from the one "
            "that run recorded): give --stack the candidate that ran it"
        )
    trained, planned = sum(1 for e in events if e.kind == "train"), starts[0].data.get("steps")
    if planned is not None and (not isinstance(planned, int) or isinstance(planned, bool)):
        raise TraceRefused(f"--trace {trace_path}: its run_start's steps is {planned!r}, not a number of steps")
    if trained == 0 or (planned is not None and trained < planned):
        raise TraceRefused(
            f"--trace {trace_path}: the run trained {trained} of its {planned} steps: fit a finished run"
        )
    return events, trained, note


def fit_and_predict(
    session: Session, stack_dir: Path, work: Path, real_events: list[TraceEvent], steps: int | None
) -> dict:
    """Fit the cost model to a real run's events, write the calibrated target spec, simulate the same
    stack on it, and compare: the simulator's prediction error on that run."""
    from targets.harness.measure.metrics import compute_metrics
    from targets.harness.measure.session import Session
    from targets.harness.target import Target

    spec = session.target.spec
    refuse_pools(spec)  # said as such, not as a trace this harness cannot read
    try:
        calibration = calibrate(spec, [real_events])
    except ProfileError as error:  # the run itself gave too little
        raise RuntimeError(f"the run cannot be fitted: {error}") from None
    except (KeyError, TypeError, AttributeError, ValueError) as error:  # a trace of another harness version
        raise RuntimeError(
            f"the trace cannot be fitted: an event lacks what this harness records ({error!r})"
        ) from None
    calibrated_path = write_calibrated_spec(session.target.ref, calibration, work / f"{spec.id}.calibrated.yaml")
    twin = Session(Target.load(calibrated_path, simulate=True), session.sandbox, session.limits, session.task_key)
    simulated = twin.measure(stack_dir, work / "simulated", seed=0, steps=steps)
    if not simulated.ok:
        raise RuntimeError("the simulated run failed: " + "; ".join(simulated.reasons[:3]))
    devices = [d.id for d in session.target.devices()]
    measured = compute_metrics(real_events, devices)
    predicted = compute_metrics(simulated.events(), devices)
    compared = {
        m: {"real": measured[m], "simulated": predicted[m], "error": predicted[m] / measured[m] - 1}
        for m in ("step_time_s", "rollout_throughput", "train_s")
        if measured[m]
    }
    return {"calibration": calibration, "calibrated_spec": calibrated_path, "compared": compared}
