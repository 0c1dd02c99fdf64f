"""Cost of simulation against the size of the work: the same controller on the same simulated
target at 1x, 2x and 4x the batch, side by side in one run, each through the harness exactly as a
judged run goes (the controller in its own sandboxed process, virtual time kept by the harness).
Prints wall seconds of the simulated system run, trajectory-turns simulated, and microseconds per
trajectory-turn (flat = linear scaling).

    python benchmarks/sim_scaling.py [--target qwen3-235b-a22b-h800x160] [--controller time_multiplex]
                                     [--base-batch 128] [--steps 2] [--factors 1,2,4] [--sandbox auto]

The production target as specified (160 devices, batch 512), ten steps:
``--base-batch 512 --steps 10 --factors 1``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import typer
import yaml
from rich.console import Console
from rich.table import Table

from skills.starter import write_starter
from targets.harness.launch import Limits, run_harness
from targets.harness.sandbox import Sandbox
from targets.harness.target import Target
from targets.harness.trace import Trace
from targets.spec import load_target, resolve_target_path


def main(
    target: str = "qwen3-235b-a22b-h800x160",
    controller: str = "time_multiplex",
    base_batch: int = 128,
    steps: int = 2,
    factors: str = typer.Option("1,2,4", help="multiples of --base-batch to run, comma-separated"),
    sandbox: str = "auto",
) -> None:
    spec = load_target(target)
    work = Path(tempfile.mkdtemp(prefix="sim-scaling-"))
    directory = write_starter(work / controller, spec, controller)
    raw = yaml.safe_load(resolve_target_path(target).read_text())
    box = Sandbox.detect(sandbox)
    table = Table(title=f"simulation cost on {spec.id} ({spec.hardware.count} devices, {controller}, {steps} steps)")
    for column in ("batch", "wall s", "simulated s", "trajectory-turns", "µs per trajectory-turn"):
        table.add_column(column, justify="right")
    try:
        multiples = [int(f) for f in factors.split(",")]
    except ValueError:
        raise SystemExit(f"--factors {factors!r}: whole numbers separated by commas, e.g. 1,2,4") from None
    for factor in multiples:
        batch = base_batch * factor
        raw["workload"].update(batch_size=batch, train_steps=steps)
        path = work / f"batch{batch}.yaml"
        path.write_text(yaml.safe_dump(raw))
        run = run_harness(
            Target.load(path, simulate=True),
            directory,
            work / f"out{batch}",
            "measure",
            Limits(time_s=1800, memory_mb=20_000),
            box,
        )
        if not run.ok:
            raise SystemExit(f"batch {batch}: {run.cause}")
        summary = json.loads((run.out / "system.json").read_text())
        turns = sum(1 for e in Trace.load_events(run.out / "trace.jsonl") if e.kind == "env_step")
        table.add_row(
            f"{batch} ({factor}x)",
            f"{summary['wall_seconds']:.2f}",
            f"{summary['virtual_seconds']:.0f}",
            str(turns),
            f"{1e6 * summary['wall_seconds'] / turns:.0f}",
        )
    Console().print(table)


if __name__ == "__main__":
    typer.run(main)
