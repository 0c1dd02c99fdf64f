"""Fit the cost model's efficiencies and overheads (the spec's ``simulator`` section and
``hardware.mfu``) from a real run's trace, so the simulator predicts runs of that hardware.

* **training**: each ``train`` event's duration against its FLOPs (cost-model formula) over its
  devices: least squares ``duration = flops / (devices * peak * mfu) + train_step_overhead_s``.
* **rollout**: the real engines serve requests in batches (completions one device returns within
  a few milliseconds of each other are one batch). A batch of ``b`` prompts padded to ``p`` tokens that
  decodes ``s`` steps costs ``s * decode_step_overhead_s + flops / (peak * rollout_mfu)`` with the
  cost model's prefill and decode FLOPs: least squares over the batches gives both constants.
  A batch's duration runs from its last member's request (or the previous batch's end, if later)
  to its end: earlier members were queued behind the previous batch.
* **weight sync** and **offload/reload**: their mean durations less the modelled transfer time.
* **response lengths** (``workload.tokens.response_length``): the mean tokens a completed turn
  generated, and the log-space spreads by moments: ``turn_sigma^2`` the mean variance of log
  lengths within a group, ``task_sigma^2`` the variance of the groups' mean log lengths less
  ``turn_sigma^2 / turns per group`` (at least 0). Turns cut at the budget count at the budget,
  so a model that often runs to its budget gets spreads on the low side.

The rollout fit keeps both constants non-negative (a term noise outweighs is fitted as zero); a
degenerate fit, or a training fit with a negative term, falls back to the zero-overhead fit; each
says so in ``notes``; a device
measured faster than its catalog peak gets ``bf16_tflops`` raised (also in ``notes``).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from targets.api import TraceEvent
from targets.harness.environments.pool import group_of
from targets.harness.sim.cost_model import CostModel
from targets.harness.trace import token_count
from targets.spec import ResponseLengthSpec, SimulatorSpec, TargetSpec, resolve_target_path


@dataclass
class Calibration:
    simulator: SimulatorSpec
    mfu: float
    bf16_tflops: float
    response_length: ResponseLengthSpec | None = None  # None: the run completed no turn
    notes: list[str] = field(default_factory=list)
    samples: dict[str, int] = field(default_factory=dict)

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
            lengths = {k: round(v, 4) for k, v in self.response_length.model_dump().items()}
            fields["workload"] = {"tokens": {"response_length": lengths}}
        return fields


if TYPE_CHECKING:
    from targets.harness.session import Session


def _line_fit(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least squares ``y = a * x + b``; None when x does not vary."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var <= 0:
        return None
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    return a, my - a * mx


def _two_fit(rows: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """Least squares ``y = a * u + b * v`` (no intercept) with ``a, b >= 0``; None when singular.

    A negative coefficient means noise outweighs that term: the constrained optimum then lies on a
    boundary (``a = 0`` or ``b = 0``), whichever one-term fit leaves the smaller squared residual."""
    suu = sum(u * u for u, _, _ in rows)
    svv = sum(v * v for _, v, _ in rows)
    suv = sum(u * v for u, v, _ in rows)
    suy = sum(u * y for u, _, y in rows)
    svy = sum(v * y for _, v, y in rows)
    det = suu * svv - suv * suv
    if det <= 1e-12 * max(suu * svv, 1e-300):
        return None
    a, b = (suy * svv - svy * suv) / det, (svy * suu - suy * suv) / det
    if a >= 0 and b >= 0:
        return a, b
    boundaries = [(max(0.0, suy / suu), 0.0), (0.0, max(0.0, svy / svv))]
    return min(boundaries, key=lambda ab: sum((y - ab[0] * u - ab[1] * v) ** 2 for u, v, y in rows))


def engine_batches(events: list[TraceEvent], window_s: float = 0.003) -> list[tuple[float, list[TraceEvent]]]:
    """Completed generate events grouped into engine batches: on one device, completions the
    harness saw within ``window_s`` of each other. Returns (batch start, members), the start being
    the later of the last member's request and the previous batch's end on that device."""
    by_device: dict[str, list[TraceEvent]] = defaultdict(list)
    for e in events:
        if e.kind == "generate" and not e.data["aborted"]:
            by_device[e.data["device"]].append(e)
    batches = []
    for completions in by_device.values():
        completions.sort(key=lambda e: e.t)
        groups: list[list[TraceEvent]] = []
        for e in completions:
            if groups and e.t - groups[-1][0].t <= window_s:
                groups[-1].append(e)
            else:
                groups.append([e])
        previous_end = float("-inf")
        for group in groups:
            batches.append((max(previous_end, max(g.data["start"] for g in group)), group))
            previous_end = group[-1].t
    return batches


def calibrate(spec: TargetSpec, events: list[TraceEvent], batching: str = "continuous") -> Calibration:
    """``batching``: how the run's engines batched (the torch engine recipe: ``static``)."""
    cost = CostModel.from_spec(spec)
    notes: list[str] = []
    fitted = spec.simulator.model_dump() | {"batching": batching}

    # -- training ------------------------------------------------------------------------------
    train_rows = []
    for e in (e for e in events if e.kind == "train"):
        lengths = [token_count(t["tokens"]) for t in e.data["trajectories"]]
        flops = (cost.train_s(lengths, 1) - cost.train_step_overhead_s) * cost.peak_flops * cost.train_mfu
        train_rows.append((flops / (len(e.data["devices"]) * cost.peak_flops), e.t - e.data["start"]))
    mfu = spec.hardware.mfu
    if train_rows:
        fit = _line_fit([x for x, _ in train_rows], [y for _, y in train_rows])
        if fit and fit[0] > 0 and fit[1] >= 0:
            mfu, fitted["train_step_overhead_s"] = 1 / fit[0], fit[1]
        else:
            mfu = sum(x for x, _ in train_rows) / sum(y for _, y in train_rows)
            fitted["train_step_overhead_s"] = 0.0
            notes.append("training: durations do not grow with FLOPs here; fitted the MFU with no fixed overhead")

    # -- rollout ---------------------------------------------------------------------------------
    rollout_rows = []
    for start, batch in engine_batches(events):
        b = len(batch)
        padded = max(token_count(g.data["prompt"]) for g in batch)
        steps = max(token_count(g.data["tokens"]) for g in batch)
        flops = 2 * cost.active_params * b * (padded + steps)
        flops += 4 * cost.layers * cost.attn_width * b * (padded * padded / 2 + steps * (padded + steps / 2))
        duration = batch[0].t - start
        rollout_rows.append((steps, flops / cost.peak_flops, duration))
    if rollout_rows:
        fit = _two_fit(rollout_rows)
        if fit and fit[1] > 0:
            fitted["decode_step_overhead_s"], fitted["rollout_mfu"] = fit[0], 1 / fit[1]
            if fit[0] == 0:
                notes.append("rollout: durations do not grow with decode steps beyond their FLOPs: no step overhead")
        elif fit and fit[0] > 0:
            # The FLOPs are too few to see next to the per-step cost: compute at the catalog peak.
            fitted["rollout_mfu"] = 1.0
            beyond_compute = sum(u * (y - v) for u, v, y in rollout_rows) / sum(u * u for u, _, _ in rollout_rows)
            fitted["decode_step_overhead_s"] = max(0.0, beyond_compute)
            notes.append("rollout: durations do not grow with FLOPs beyond the step cost: compute at the catalog peak")
        else:
            fitted["decode_step_overhead_s"] = 0.0
            fitted["rollout_mfu"] = sum(v for _, v, _ in rollout_rows) / sum(y for _, _, y in rollout_rows)
            notes.append("rollout: no positive overhead fits; fitted the compute rate alone")

    # -- weight sync and switching ---------------------------------------------------------------
    def mean_duration(kinds: tuple[str, ...]) -> float | None:
        spans = [e.t - e.data["start"] for e in events if e.kind in kinds]
        return sum(spans) / len(spans) if spans else None

    sync = mean_duration(("sync",))
    if sync is not None:
        fitted["sync_overhead_s"] = max(0.0, sync - (cost.sync_s() - cost.sync_overhead_s))
    switch = mean_duration(("shrink", "expand"))
    if switch is not None:
        fitted["switch_overhead_s"] = max(0.0, switch - (cost.offload_s() - cost.switch_overhead_s))
    # Efficiencies are fractions of the catalog peak; a device faster than its catalog number gets
    # its peak raised so that the fastest fitted rate is 100% of it.
    peak = spec.hardware.bf16_tflops
    scale = max(1.0, mfu, fitted["rollout_mfu"])
    if scale > 1.0:
        notes.append(f"measured compute above the catalog peak ({peak:g} TFLOP/s): bf16_tflops raised {scale:.2f}x")
        peak, mfu, fitted["rollout_mfu"] = peak * scale, mfu / scale, fitted["rollout_mfu"] / scale
    lengths = response_lengths(spec, events)
    samples = {"train_steps": len(train_rows), "engine_batches": len(rollout_rows)}
    return Calibration(SimulatorSpec.model_validate(fitted), mfu, peak, lengths, notes, samples)


def response_lengths(spec: TargetSpec, events: list[TraceEvent]) -> ResponseLengthSpec | None:
    """The response-length model fitted to the turns the run completed whole (see the module doc)."""
    budget = spec.workload.tokens.response
    by_group: dict[str, list[float]] = defaultdict(list)
    lengths = []
    for e in events:
        if e.kind == "generate" and not e.data["aborted"] and not e.data.get("continues"):
            n = token_count(e.data["tokens"])
            if n:
                lengths.append(n)
                by_group[group_of(e.data["episode"])].append(math.log(n))
    if not lengths:
        return None

    def variance(xs: list[float]) -> float:
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1)

    groups = [g for g in by_group.values() if len(g) > 1]
    turn_var = sum(variance(g) for g in groups) / len(groups) if groups else 0.0
    means = [sum(g) / len(g) for g in by_group.values()]
    per_group = sum(len(g) for g in by_group.values()) / len(by_group)
    task_var = max(0.0, variance(means) - turn_var / per_group) if len(means) > 1 else 0.0
    mean = sum(lengths) / len(lengths)
    if turn_var + task_var == 0 or mean >= budget:
        return ResponseLengthSpec(mean=min(mean, budget))  # every turn alike: no spread to fit
    return ResponseLengthSpec(mean=mean, task_sigma=math.sqrt(task_var), turn_sigma=math.sqrt(turn_var))


def stack_batching(stack_dir: Path) -> str:
    """How the stack's engines batch: the torch engine recipe runs static batches, vLLM continuous."""
    params_path = stack_dir / "stack" / "params.json"
    engine = json.loads(params_path.read_text()).get("engine", "torch") if params_path.exists() else "torch"
    return "continuous" if engine == "vllm" else "static"


def measure_and_predict(session: Session, stack_dir: Path, work: Path, steps: int | None = None) -> dict:
    """Run the stack for real, fit the cost model to its trace, write the calibrated target spec,
    simulate the same stack on it, and compare: the simulator's prediction error on that run. Both
    runs are judged like any measured run."""
    from targets.harness.metrics import compute_metrics
    from targets.harness.session import Session
    from targets.harness.target import Target

    spec = session.target.spec
    real = session.measure(stack_dir, work / "real", seed=0, steps=steps)
    if not real.ok:
        raise RuntimeError("the real run failed: " + "; ".join(real.reasons[:3]))
    real_events = real.events()
    calibration = calibrate(spec, real_events, stack_batching(stack_dir))
    raw = yaml.safe_load(resolve_target_path(session.target.ref).read_text())
    fields = calibration.yaml_fields()
    raw["hardware"] = {**raw["hardware"], **fields["hardware"]}
    raw["simulator"] = fields["simulator"]
    if "workload" in fields:
        raw["workload"]["tokens"] = {**raw["workload"]["tokens"], **fields["workload"]["tokens"]}
    calibrated_path = work / f"{spec.id}.calibrated.yaml"
    calibrated_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    twin = Session(Target.load(calibrated_path, simulate=True), session.sandbox, session.limits)
    simulated = twin.measure(stack_dir, work / "simulated", seed=0, steps=steps)
    if not simulated.ok:
        raise RuntimeError("the simulated run failed: " + "; ".join(simulated.reasons[:3]))
    devices = [f"{spec.hardware.kind}:{i}" for i in range(spec.hardware.count)]
    measured = compute_metrics(real_events, devices)
    predicted = compute_metrics(simulated.events(), devices)
    compared = {
        m: {"real": measured[m], "simulated": predicted[m], "error": predicted[m] / measured[m] - 1}
        for m in ("step_time_s", "rollout_throughput", "train_s")
        if measured[m]
    }
    return {"calibration": calibration, "calibrated_spec": calibrated_path, "compared": compared}
