"""Everything one measured run reports: the trace's metrics (``metrics.py``), the step's fluid lower
bound (``sim/lower_bound.py``) and the fraction of it reached, and the child's resource figures."""

from __future__ import annotations

from targets.api import TraceEvent
from targets.harness.measure.metrics import compute_metrics
from targets.harness.sim.cost_model import ClusterCosts
from targets.harness.sim.lower_bound import step_lower_bound
from targets.spec import TargetSpec


def run_metrics(spec: TargetSpec, events: list[TraceEvent], child_result: dict) -> dict:
    """Everything the benchmark reports for one run, from the harness trace (and the child's
    resource figures: peak process memory for real runs, and peak memory per GPU on a GPU target;
    peak KV use, KV preemptions and how full the engines' batches were while decoding for simulated ones)."""
    devices = spec.hardware.device_ids()
    metrics = compute_metrics(events, devices) | step_lower_bound(spec, ClusterCosts.from_spec(spec), events)
    metrics["lower_bound_fraction"] = (
        metrics["lower_bound_step_s"] / metrics["step_time_s"] if metrics["step_time_s"] else 0.0
    )
    for key in ("peak_process_memory_mb", "peak_device_memory_mb", "device_memory_mb", "peak_kv_fraction"):
        if key in child_result:
            metrics[key] = child_result[key]
    if "preemptions" in child_result:
        metrics["kv_preemptions"] = child_result["preemptions"]
    if "decode_batch" in child_result:  # the simulator's engines: how full their batches were while decoding
        metrics["decode_batch"] = child_result["decode_batch"]
        device_seconds = len(devices) * metrics["duration_s"]
        decoding = child_result["decode_seconds"] * child_result["engine_devices"]
        metrics["decode_share"] = decoding / device_seconds if device_seconds else 0.0
        engine_seconds = child_result["decode_seconds"] + child_result["prefill_seconds"]
        metrics["prefill_share"] = child_result["prefill_seconds"] / engine_seconds if engine_seconds else 0.0
        metrics["prefilled_tokens"] = child_result["prefilled_tokens"]
    return metrics
