"""Cost of simulation against the size of the work: the same controller on the same simulated
target at 1x, 2x and 4x the batch, side by side in one run. Prints wall seconds, trajectory-turns
simulated, and microseconds per trajectory-turn (flat = linear scaling).

    python benchmarks/sim_scaling.py [--target qwen3-235b-a22b-h800x160] [--controller time_multiplex]
                                     [--base-batch 128] [--steps 2]
"""

from __future__ import annotations

import importlib
import sys
import tempfile
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from skills.starter import write_starter
from targets.harness.runner import runtime_for
from targets.harness.sim.run import simulate
from targets.spec import load_target


def main(
    target: str = "qwen3-235b-a22b-h800x160",
    controller: str = "time_multiplex",
    base_batch: int = 128,
    steps: int = 2,
) -> None:
    spec = load_target(target).model_copy(update={"execution": "simulated"})
    directory = write_starter(Path(tempfile.mkdtemp(prefix="sim-scaling-")) / controller, spec, controller)
    sys.path.insert(0, str(directory))
    stack = importlib.import_module("stack")
    table = Table(title=f"simulation cost on {spec.id} ({controller}, {steps} steps)")
    for column in ("batch", "wall s", "simulated s", "trajectory-turns", "µs per trajectory-turn"):
        table.add_column(column, justify="right")
    for factor in (1, 2, 4):
        batch = base_batch * factor
        workload = spec.workload.model_copy(update={"batch_size": batch, "train_steps": steps})
        scaled = spec.model_copy(update={"workload": workload})
        runtime = runtime_for(scaled)
        trace, summary = simulate(scaled, stack.build(scaled, runtime), runtime, steps, seed=0)
        turns = sum(1 for e in trace.events if e.kind == "env_step")
        table.add_row(f"{batch} ({factor}x)", f"{summary['wall_seconds']:.2f}", f"{summary['virtual_seconds']:.0f}",
                      str(turns), f"{1e6 * summary['wall_seconds'] / turns:.0f}")
    Console().print(table)


if __name__ == "__main__":
    typer.run(main)
