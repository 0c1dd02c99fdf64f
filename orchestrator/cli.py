"""The ``vibetrain`` command line. TARGET is a catalog id or a path to a YAML spec everywhere."""

from __future__ import annotations

from pathlib import Path

import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from targets.spec import SpecError, TargetSpec, catalog_ids, load_target

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Generate and benchmark time-multiplexed RL stacks.")
target_app = typer.Typer(no_args_is_help=True, help="Inspect and validate target specs.")
app.add_typer(target_app, name="target")

console = Console()
errors = Console(stderr=True)


def _load(target: str) -> TargetSpec:
    try:
        return load_target(target)
    except SpecError as error:
        errors.print(f"[red]error:[/red] {error}", highlight=False, markup=True, soft_wrap=True)
        raise typer.Exit(2) from None


def _params(spec: TargetSpec) -> str:
    counts = spec.model.param_counts()
    fmt = lambda n: f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"  # noqa: E731
    return fmt(counts.total) if counts.total == counts.active else f"{fmt(counts.total)} ({fmt(counts.active)} active)"


@app.command("targets")
def list_targets() -> None:
    """List the catalog targets."""
    table = Table(title="vibetrain targets")
    table.add_column("id", no_wrap=True)  # people copy ids from here: never truncate them
    for column in ("model", "hardware", "environment", "execution", "batch x group"):
        table.add_column(column, overflow="fold")
    for target_id in catalog_ids():
        spec = _load(target_id)
        w = spec.workload
        table.add_row(
            spec.id,
            f"{spec.model.family} {_params(spec)}",
            f"{spec.hardware.count}x {spec.hardware.kind}",
            w.environment.name,
            spec.execution,
            f"{w.batch_size} x {w.group_size}",
        )
    console.print(table)


@target_app.command("show")
def show_target(target: str) -> None:
    """Print a target's resolved spec (catalog hardware numbers filled in)."""
    spec = _load(target)
    console.print(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False), highlight=False, markup=False)
    console.print(f"# params: {_params(spec)}; groups per step: {spec.workload.groups_per_step}", highlight=False)


@target_app.command("validate")
def validate_target(path: Path) -> None:
    """Validate a target spec YAML; exits non-zero naming each bad field."""
    if not path.exists():
        errors.print(f"[red]error:[/red] target spec file not found: {path}")
        raise typer.Exit(2)
    spec = _load(str(path))
    console.print(f"[green]ok[/green] {path} is a valid target spec (id {spec.id})")


@app.command("reference")
def reference(
    target: str,
    steps: int = typer.Option(30, min=1, help="training steps"),
    seed: int = typer.Option(0, help="seed for weights sampling and environments"),
) -> None:
    """Run the reference co-located synchronous GRPO loop and print the reward per step."""
    from targets.harness.reference.loop import run_reference  # heavy imports (torch) only here

    spec = _load(target)
    progress = Progress(
        TextColumn("[bold]reference"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("reward {task.fields[reward]}"), console=console,
    )
    with progress:
        task = progress.add_task("steps", total=steps, reward="-")

        def on_step(s) -> None:
            progress.console.print(
                f"step {s.step:3d}  reward {s.mean_reward:.3f}  turns {s.mean_turns:.2f}  "
                f"tokens {s.response_tokens:4d}  timeouts {s.timeouts}  loss {s.loss:+.4f}  {s.seconds:.2f}s", highlight=False,
            )
            progress.update(task, advance=1, reward=f"{s.mean_reward:.3f}")

        try:
            history = run_reference(spec, steps, seed=seed, on_step=on_step)
        except ValueError as error:
            errors.print(f"[red]error:[/red] {error}")
            raise typer.Exit(2) from None
    window = max(1, min(5, len(history) // 3))
    first = sum(s.mean_reward for s in history[:window]) / window
    last = sum(s.mean_reward for s in history[-window:]) / window
    console.print(f"mean reward, first {window} steps: {first:.3f}; last {window} steps: {last:.3f}")


if __name__ == "__main__":
    app()
