"""Does the search specialize? For each simulated catalog target: a ``vibetrain generate`` run (offline
agents), then its best stack benchmarked side by side with every hand-written baseline in one bench
run. Prints one table: per target, the best's design (its controller, the techniques switched on and
the parameters moved off their defaults), its ratio over each baseline, and its ratio over the starter
where the search never looked beside its in-search one (what ``generate`` measured after its last
round: on held-out seeds, and on them with the workload perturbed; ``orchestrator/generalization.py``).

    python benchmarks/specialization.py [--rounds 6] [--targets a,b] [--out generated/specialization]
                                        [--policy backlog] [--sandbox auto]

A target whose run directory exists already is resumed up to ``--rounds`` (a finished run is only read).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from orchestrator.history import History
from orchestrator.state import RunState
from skills.library import defaults, load_skills
from skills.starter import CONTROLLERS
from targets.spec import catalog_ids, load_target

console = Console()


def design(params: dict) -> str:
    """What a stack is, read from its params.json: controller, techniques on, other parameters moved."""
    skills = load_skills()
    start = defaults(skills)
    on = [name for name, s in skills.items() if s.kind == "technique" and s.is_on(params)]
    switches = {p for name in on for p in skills[name].enable}
    moved = [
        f"{k}={v}"
        for k, v in sorted(params.items())
        if k not in ("controller", "engine") and k not in switches and k in start and v != start[k]
    ]
    return " + ".join([params.get("controller", "?"), *on]) + (f" ({', '.join(moved)})" if moved else "")


def vibetrain(*args: str) -> None:
    """One ``vibetrain`` command, its output on this terminal, exactly as a user would run it."""
    command = shutil.which("vibetrain")
    if command is None:
        raise SystemExit("the vibetrain command is not on PATH: pip install -e . first")
    console.rule(f"[bold]vibetrain {' '.join(args)}")
    if subprocess.run([command, *args]).returncode != 0:
        raise SystemExit(f"vibetrain {' '.join(args)} failed")


def main(
    rounds: int = typer.Option(6, min=1, help="rounds after the starter, per target"),
    targets: str = typer.Option("", help="comma-separated target ids; default every simulated catalog target"),
    out: Path = typer.Option(Path("generated/specialization"), help="where each target's run directory goes"),
    policy: str = typer.Option("backlog", help="the search policy: backlog | evolve"),
    sandbox: str = "auto",
) -> None:
    ids = [t.strip() for t in targets.split(",") if t.strip()] or [
        i for i in catalog_ids() if load_target(i).execution == "simulated"
    ]
    summary = Table(
        title=f"specialization: the best stack of a {rounds}-round generate run per target, against each baseline",
        box=box.SIMPLE_HEAD,
    )
    summary.add_column("target", no_wrap=True)
    summary.add_column("best design")
    summary.add_column("goodput", justify="right")
    for name in CONTROLLERS:
        summary.add_column(f"x {name}", justify="right", no_wrap=True)
    summary.add_column("timeouts", justify="right")
    for column in ("/ starter in search", "held out", "perturbed"):
        summary.add_column(column, justify="right", no_wrap=True)
    started = time.perf_counter()
    for target in ids:
        spec = load_target(target)
        run = out / spec.id
        resume = ["--resume"] if run.exists() else []
        vibetrain(
            "generate",
            target,
            "--rounds",
            str(rounds),
            "--policy",
            policy,
            "--sandbox",
            sandbox,
            "--out",
            str(run),
            *resume,
        )
        results = Path(tempfile.mkdtemp(prefix="specialization-")) / "bench.json"
        baselines = ",".join(CONTROLLERS)
        vibetrain(
            "bench",
            target,
            "--baselines",
            baselines,
            "--stack",
            f"{run}@best",
            "--sandbox",
            sandbox,
            "--json",
            str(results),
        )
        *bases, best = json.loads(results.read_text())["runs"]  # the baselines, then the --stack
        headline = spec.headline_metric.name
        history = History.open(run)
        g = RunState.load(run).generalization
        figures = (g.in_search, g.held_out, g.perturbed) if g is not None else (None, None, None)
        summary.add_row(
            spec.id,
            design(history.params(history.best())),
            f"{best['metrics'][headline]:.3g}",
            *(f"{best['metrics'][headline] / base['metrics'][headline]:.2f}x" for base in bases),
            f"{best['metrics']['timeout_ratio']:.0%}",
            *(f"{f.ratio:.2f}x" if f is not None else "-" for f in figures),
        )
    console.print(summary)
    console.print(f"{time.perf_counter() - started:.0f} s in all; command: python {' '.join(sys.argv)}")


if __name__ == "__main__":
    typer.run(main)
