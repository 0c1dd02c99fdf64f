"""Does a twin calibrated on one schedule's run rank the other schedules as the truth does?

The pre-screen (``orchestrator/prescreen.py``) simulates each candidate on a twin whose constants
``vibetrain calibrate`` fitted from a run, and keeps those predicted near the best. A fit that is off
compresses (or inflates) the differences between schedules, and a better candidate is screened out.
This script measures it where the truth is known: a simulated run of the target's spec (its constants
are the truth) of one schedule is calibrated, and each schedule's starter is simulated on the truth
and on the twin. It prints the fitted constants beside the true ones, each schedule's step time on both
and its speed-up over the fitted schedule on both.

    python benchmarks/twin_fidelity.py [--target qwen3-8b-h100x8] [--fitted static_split] [--steps 2]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import typer
import yaml
from rich.console import Console
from rich.table import Table

from skills.starter import starter_params, write_starter
from targets.api import TraceEvent
from targets.harness.isolation.launch import Limits, run_harness
from targets.harness.isolation.sandbox import Sandbox
from targets.harness.sim.calibrate import calibrate
from targets.harness.target import Target
from targets.harness.trace import Trace
from targets.spec import TargetSpec, load_target

SCHEDULES = ("colocate", "static_split", "time_multiplex")
CONSTANTS = ("rollout_mfu", "hbm_efficiency", "decode_step_overhead_s", "request_overhead_s", "sync_overhead_s")


def simulate(spec: TargetSpec, controller: str, work: Path) -> list[TraceEvent]:
    """The starter of ``controller`` run on the simulator through the harness, as a judged run is."""
    spec = spec.model_copy(update={"execution": "simulated"})
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"{spec.id}.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    stack = write_starter(work / "stack", spec, controller, starter_params(spec, controller))
    run = run_harness(
        Target.load(path), stack, work / "out", "measure", Limits(time_s=1800), Sandbox.detect("subprocess")
    )
    if not run.ok:
        raise SystemExit(f"{controller} on {spec.id}: {run.cause}")
    return Trace.load_events(run.out / "trace.jsonl")


def step_time(events: list[TraceEvent]) -> float:
    """Mean seconds a step: the last train event's end over the steps."""
    trains = [e for e in events if e.kind == "train"]
    return trains[-1].t / len(trains)


def main(target: str = "qwen3-8b-h100x8", fitted: str = "static_split", steps: int = 2) -> None:
    console = Console()
    spec = load_target(target)
    spec = spec.model_copy(update={"workload": spec.workload.model_copy(update={"train_steps": steps})})
    work = Path(tempfile.mkdtemp(prefix="vt-twin-"))
    began = time.perf_counter()
    truth = {fitted: simulate(spec, fitted, work / f"truth-{fitted}")}
    fit = calibrate(spec, [truth[fitted]])
    hardware = spec.hardware.model_copy(update={"bf16_tflops": fit.bf16_tflops, "mfu": fit.mfu})
    twin = spec.model_copy(update={"id": f"{spec.id}-twin", "simulator": fit.simulator, "hardware": hardware})
    constants = Table(title=f"constants: the spec's (truth) and fitted on {fitted}'s run")
    for column in ("constant", "truth", "fitted"):
        constants.add_column(column, justify="right" if column != "constant" else "left")
    for name in CONSTANTS:
        constants.add_row(name, f"{getattr(spec.simulator, name):.4g}", f"{getattr(fit.simulator, name):.4g}")
    constants.add_row("mfu (train)", f"{spec.hardware.mfu:.4g}", f"{fit.mfu:.4g}")
    console.print(constants)
    times: dict[str, tuple[float, float]] = {}
    for controller in SCHEDULES:
        if controller not in truth:
            truth[controller] = simulate(spec, controller, work / f"truth-{controller}")
        predicted = simulate(twin, controller, work / f"twin-{controller}")
        times[controller] = (step_time(truth[controller]), step_time(predicted))
    table = Table(
        title=f"{target}, {steps} steps: each schedule on the truth and on the twin",
        caption=f"gain: the schedule's speed-up over {fitted}, the schedule the twin was fitted on",
    )
    for column in ("schedule", "step s, truth", "twin", "twin error", "gain, truth", "twin"):
        table.add_column(column, justify="right" if column != "schedule" else "left")
    base_truth, base_twin = times[fitted]
    for controller, (true, predicted) in times.items():
        table.add_row(
            controller,
            f"{true:.1f}",
            f"{predicted:.1f}",
            f"{predicted / true - 1:+.1%}",
            f"{base_truth / true:.2f}x",
            f"{base_twin / predicted:.2f}x",
        )
    console.print(table)
    console.print(f"[dim]{time.perf_counter() - began:.0f} s; runs under {work}[/dim]")


if __name__ == "__main__":
    typer.run(main)
