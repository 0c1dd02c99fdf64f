"""The system run's train step against the component benchmark's on the same tokens: every batch a
measured run trained on (read from the harness's trace) is trained again here by the recipe's FSDP2
trainer alone, warm, on the same device kind, and each step's system time is divided by its own.

    python benchmarks/train_step_ratio.py RUN_OUT --target tiny-qwen3-cpu [--repeat 3] [--json FILE]

RUN_OUT is a measured or checked run's output folder (``trace.jsonl`` in it: `vibetrain check ... --out`).
The system time of a step is the harness's, from the train call to its answer (the weight export after
it is timed apart, as ``weight_export``). On a CPU target the system step shares the machine's cores
with the engines still rolling out, so the ratio there is an upper bound on the stack's own overhead.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from skills.recipes.fsdp_trainer import FSDPTrainer  # noqa: E402
from targets.api import TrainBatch  # noqa: E402
from targets.harness.judge.replay import recorded_batch  # noqa: E402
from targets.harness.model import model_dir  # noqa: E402
from targets.harness.trace import Trace  # noqa: E402
from targets.spec import load_target  # noqa: E402

console = Console()


def recorded_steps(trace: Path) -> list[tuple[float, list[str], TrainBatch]]:
    """(system seconds, devices, batch) of every train call in the trace, in order."""
    steps = []
    for event in Trace.load_events(trace):
        if event.kind != "train":
            continue
        steps.append((event.t - event.data["start"], list(event.data["devices"]), recorded_batch(event.data)))
    return steps


def main(
    run_out: Path = typer.Argument(..., help="a run's output folder, holding trace.jsonl"),
    target: str = typer.Option("tiny-qwen3-cpu", help="the target the run was on"),
    device: str = typer.Option("cpu", help="where the component step runs (cuda:0 on a GPU)"),
    repeat: int = typer.Option(3, min=1, help="component steps timed per batch (median)"),
    json_out: Path | None = typer.Option(None, "--json", help="write the figures here too"),
) -> None:
    spec = load_target(target)
    steps = recorded_steps(run_out / "trace.jsonl")
    if not steps:
        raise typer.BadParameter(f"{run_out / 'trace.jsonl'} records no train call", param_hint="RUN_OUT")
    trainer = FSDPTrainer(str(model_dir(spec.model)), spec.workload.training.config(), spec.model.dtype, device)

    def synchronize() -> None:
        if device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(device)

    trainer.train_step(steps[0][2])  # warm: allocations and kernel choices before anything is timed
    synchronize()
    rows = []
    for k, (system_s, devices, batch) in enumerate(steps, start=1):
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            trainer.train_step(batch)
            synchronize()
            times.append(time.perf_counter() - started)
        component_s = statistics.median(times)
        tokens = sum(len(t.tokens) for t in batch.trajectories)
        rows.append(
            {
                "step": k,
                "devices": devices,
                "tokens": tokens,
                "system_s": system_s,
                "component_s": component_s,
                "component_spread_s": max(times) - min(times),
                "ratio": system_s / component_s,
            }
        )
        if json_out is not None:  # after every step: a run cut at its limit keeps the steps it measured
            json_out.write_text(json.dumps({"target": target, "device": device, "steps": rows}, indent=1))
    trainer.close()
    table = Table(title=f"{target}: the system run's train step / the trainer alone on the same batch ({device})")
    for column in ("step", "devices", "tokens", "system s", "component s (spread)", "ratio"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(row["step"]),
            ",".join(row["devices"]),
            str(row["tokens"]),
            f"{row['system_s']:.3f}",
            f"{row['component_s']:.3f} ({row['component_spread_s']:.3f})",
            f"{row['ratio']:.2f}x",
        )
    console.print(table)
    ratios = [row["ratio"] for row in rows]
    console.print(f"median ratio {statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f}x)")


if __name__ == "__main__":
    typer.run(main)
