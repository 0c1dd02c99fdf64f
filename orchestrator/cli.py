"""The ``vibetrain`` command line. TARGET is a catalog id or a path to a YAML spec everywhere."""

from __future__ import annotations

import json
import secrets
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import typer
import yaml
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from orchestrator.tables import (
    RoundsView,
    bench_table,
    checks_table,
    costs_table,
    num,
    plain,
    promotion,
    rounds_table,
)
from skills.starter import CONTROLLERS
from targets.harness.check_result import detail
from targets.spec import SpecError, TargetSpec, catalog_ids, load_target

HELP = {"help_option_names": ["-h", "--help"]}
app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    context_settings=HELP,
    help="Generate and benchmark time-multiplexed RL stacks.\n\n"
    "Start with: vibetrain generate tiny-qwen3-cpu --rounds 2, then vibetrain log RUN and vibetrain show RUN best.",
)
target_app = typer.Typer(no_args_is_help=True, context_settings=HELP, help="Inspect and validate target specs.")
app.add_typer(target_app, name="target")

console = Console()
console.soft_wrap = not console.is_terminal  # in a pipe or a file, whole lines: grep sees a path unbroken
errors = Console(stderr=True, soft_wrap=True)  # an error names paths and values: never broken mid-word


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        from orchestrator.provenance import source_commit

        sys.stdout.write(f"vibetrain {version('vibetrain')} ({source_commit()})\n")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="print the version and source commit, then exit"
    ),
) -> None:
    """SIGTERM (a timeout, a scheduler) unwinds like Ctrl-C, so the harness takes its candidate processes down."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


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


def _print_table(table: Table) -> None:
    """A table on a terminal; tab-separated rows in a pipe or a file (whole rows for grep and cut)."""
    if console.is_terminal:
        console.print(table)
    else:
        sys.stdout.write(plain(table))


def _print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=1, default=str) + "\n")


JSON_OPTION = typer.Option(False, "--json", help="print JSON instead of a table (for scripts)")


@app.command("targets")
def list_targets(as_json: bool = JSON_OPTION) -> None:
    """List the catalog targets.

    Example: vibetrain targets --json | jq -r '.[].id'
    """
    specs = [_load(target_id) for target_id in catalog_ids()]
    if as_json:
        _print_json([{"params": _params(spec), **spec.model_dump(mode="json")} for spec in specs])
        return
    table = Table(title="vibetrain targets")
    table.add_column("id", no_wrap=True)  # people copy ids from here: never truncate them
    for column in ("model", "hardware", "environment", "execution", "batch x group"):
        table.add_column(column, overflow="fold", min_width=len(column))
    for spec in specs:
        w = spec.workload
        table.add_row(
            spec.id,
            f"{spec.model.family} {_params(spec)}",
            f"{spec.hardware.count}x {spec.hardware.kind}",
            w.environment.name,
            spec.execution,
            f"{w.batch_size} x {w.group_size}",
        )
    _print_table(table)


@target_app.command("show")
def show_target(target: str) -> None:
    """Print a target's resolved spec (catalog hardware numbers filled in) as YAML that ``target validate`` accepts.

    Example: vibetrain target show tiny-qwen3-cpu > my-target.yaml
    """
    spec = _load(target)
    # plain text, never wrapped: ``target show X > x.yaml`` must give a spec ``target validate`` accepts
    sys.stdout.write(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False, width=10_000))
    sys.stdout.write(f"# params: {_params(spec)}; groups per step: {spec.workload.groups_per_step}\n")


@target_app.command("validate")
def validate_target(path: Path) -> None:
    """Validate a target spec YAML; exits non-zero naming each bad field.

    Example: vibetrain target validate my-target.yaml
    """
    if not path.exists():
        errors.print(f"[red]error:[/red] target spec file not found: {path}")
        raise typer.Exit(2)
    spec = _load(str(path))
    console.print(f"[green]ok[/green] {path} is a valid target spec (id {spec.id})")


@app.command("reference")
def reference(
    target: str,
    steps: int = typer.Option(30, min=1, help="training steps"),
    seed: int = typer.Option(0, help="seed for sampling and environments (weights come from the spec)"),
) -> None:
    """Run the reference co-located synchronous GRPO loop and print the reward per step.

    Example: vibetrain reference tiny-qwen3-cpu --steps 3
    """
    from targets.harness.reference.loop import run_reference  # heavy imports (torch) only here

    spec = _load(target)
    progress = Progress(
        TextColumn("[bold]reference"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("reward {task.fields[reward]}"),
        console=console,
    )
    with progress:
        task = progress.add_task("steps", total=steps, reward="-")

        def on_step(s) -> None:
            progress.console.print(
                f"step {s.step:3d}  reward {s.mean_reward:.3f}  turns {s.mean_turns:.2f}  "
                f"tokens {s.response_tokens:4d}  timeouts {s.timeouts}  loss {s.loss:+.4f}  {s.seconds:.2f}s",
                highlight=False,
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


@app.command("starter")
def starter(
    target: str,
    out: Path = typer.Option(..., help="directory to create (holds stack/ and DESIGN.md)"),
    controller: str = typer.Option("time_multiplex", help="colocate | static_split | time_multiplex"),
) -> None:
    """Write a starter candidate stack for TARGET (the recipes, wired for one controller).

    Example: vibetrain starter tiny-qwen3-cpu --out my-stack --controller static_split
    """
    from skills.starter import write_starter

    spec = _load(target)
    try:
        write_starter(_out_dir(out), spec, controller)
    except (ValueError, FileExistsError) as error:
        errors.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from None
    console.print(f"wrote {controller} starter stack to {out} (check it: vibetrain check {target} --stack {out})")


def _out_dir(path: Path, option: str = "--out") -> Path:
    """A directory this command may create or fill: an existing file there is refused by name."""
    if path.exists() and not path.is_dir():
        errors.print(f"[red]error:[/red] {option} {path}: a file is there; give a directory (new or existing)")
        raise typer.Exit(2)
    return path


def _out_file(path: Path | None, option: str) -> Path | None:
    """A file this command will write when it is done: checked (and its folder made) before any work,
    so a typo never costs a finished benchmark."""
    if path is None:
        return None
    if path.is_dir():
        errors.print(f"[red]error:[/red] {option} {path}: a directory is there; give a file path")
        raise typer.Exit(2)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        errors.print(f"[red]error:[/red] {option} {path}: cannot create its folder ({error.strerror})")
        raise typer.Exit(2) from None
    return path


def _open_tracker(track: str | None, track_dir: Path | None, default_dir: Callable[[], Path]):
    """``--track``'s writer and its directory, opened before any run (a missing package is said in
    seconds, not after the work; the writer writes nothing until the first scalar); (None, None)
    without ``--track``."""
    from targets.harness.tracking import TrackingError, open_tracker

    if track is None:
        if track_dir is not None:
            errors.print("[red]error:[/red] --track-dir needs --track tensorboard|jsonl")
            raise typer.Exit(2)
        return None, None
    track_dir = _out_dir(track_dir or default_dir(), "--track-dir")
    try:
        return open_tracker(track, track_dir), track_dir
    except TrackingError as error:
        errors.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from None


def _candidate(path: Path) -> Path:
    """A candidate directory (it holds the ``stack`` package), checked before any work starts."""
    if not (path / "stack" / "__init__.py").is_file():
        what = "does not exist" if not path.exists() else "holds no stack/__init__.py: it is not a candidate directory"
        errors.print(f"[red]error:[/red] --stack {path} {what}")
        raise typer.Exit(2)
    return path


def _session(target: str, sandbox: str, time_limit: float | None, simulate: bool = False):
    """The harness session for a command: the target resolved once, its model files built here (a
    sandboxed child sees the model cache read-only), the sandbox chosen."""
    from targets.harness.launch import Limits
    from targets.harness.sandbox import Sandbox, SandboxUnavailable
    from targets.harness.session import Session
    from targets.harness.target import Target, TargetUnavailable

    _load(target)  # clear errors for a bad spec first
    try:
        resolved = Target.load(target, simulate=simulate)
        resolved.runtime()
        return Session(resolved, Sandbox.detect(sandbox), Limits.of(resolved, time_limit))
    except (SandboxUnavailable, TargetUnavailable) as error:
        errors.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from None


@app.command("check")
def check(
    target: str,
    stack: Path = typer.Option(
        None, help="candidate directory (holds stack/) (default: the starter of the target's first baseline)"
    ),
    json_path: Path = typer.Option(None, "--json", help="write the results as JSON here"),
    out: Path = typer.Option(
        None, help="keep the harness's outputs here (trace, weights, candidate logs); default a temp dir"
    ),
    time_limit: float | None = typer.Option(
        None, min=1, help="seconds each child run may take (default: the target's limits.time_s)"
    ),
    sandbox: str = typer.Option("auto", help="auto | bubblewrap | docker | subprocess"),
    simulate: bool = typer.Option(False, help="run the system on the simulator, whatever the target's execution says"),
) -> None:
    """Judge a candidate: integrity scan, accuracy checks 1-3, a system run and its audit. Exit 1 on failure.

    Example: vibetrain check tiny-qwen3-cpu --stack my-stack --json verdict.json
    """
    import tempfile

    from skills.starter import write_starter

    if stack is not None:
        _candidate(stack)
    _out_file(json_path, "--json")
    session = _session(target, sandbox, time_limit, simulate)
    if stack is None:
        spec = session.target.spec
        stack = write_starter(Path(tempfile.mkdtemp(prefix="vibetrain-starter-")), spec, spec.baselines[0].name)
        console.print(f"checking the {spec.baselines[0].name} starter ({stack})")
    with console.status(f"checking {stack} on {session.target.id}"):
        results = session.check(stack, out, seed=secrets.randbelow(2**31))  # drawn, as the task key is
    _print_table(checks_table(results))
    passed = all(r.passed for r in results)
    if json_path:
        json_path.write_text(json.dumps([r.as_dict() for r in results], indent=1, default=str))
    console.print("[green]PASS[/green]" if passed else "[red]FAIL[/red]")
    raise typer.Exit(0 if passed else 1)


@app.command("bench")
def bench(
    target: str,
    stack: list[Path] = typer.Option(
        [], help="candidate directory, or RUN@best / RUN@round-N of a generate run (repeatable)"
    ),
    baselines: str = typer.Option(",".join(CONTROLLERS), help="comma-separated starter schedules"),
    repeat: int = typer.Option(
        None,
        min=1,
        help="runs per schedule; default 3 real, 1 simulated (the simulator is "
        "deterministic: repeats only vary the workload's seed)",
    ),
    json_path: Path = typer.Option(None, "--json", help="write the results as JSON here"),
    timeline: Path = typer.Option(None, help="write the per-device timeline PNG here"),
    track: str = typer.Option(
        None,
        help="tensorboard | jsonl: per training step ROLL-named scalars of every run (run <schedule>/r<repeat>), "
        "and trace.json, the timeline for Perfetto",
    ),
    track_dir: Path = typer.Option(
        None, help="where --track writes (default: beside --json, else --timeline, as <name>-track/; else a temp dir)"
    ),
    time_limit: float | None = typer.Option(
        None, min=1, help="seconds each child run may take (default: the target's limits.time_s)"
    ),
    simulate: bool = typer.Option(
        False, "--simulate", help="run on the cluster simulator even if the target runs for real here"
    ),
    sandbox: str = typer.Option("auto", help="auto | bubblewrap | docker | subprocess"),
) -> None:
    """Benchmark baselines and candidates side by side; ratios are to the first run listed.

    Example: vibetrain bench tiny-qwen3-cpu --baselines colocate --stack generated/tiny-qwen3-cpu@best --json b.json
    """
    import tempfile

    from skills.starter import write_starter
    from targets.harness.benchmark import BenchmarkFailed, benchmark
    from targets.harness.timeline import plot_timelines
    from targets.harness.tracking import TrackingError, track_trace, write_chrome_trace

    _out_file(json_path, "--json")
    _out_file(timeline, "--timeline")
    beside = json_path or timeline  # the tracking goes next to the other outputs, else a temp dir

    def default_track_dir() -> Path:
        return beside.with_name(f"{beside.stem}-track") if beside else Path(tempfile.mkdtemp(prefix="vibetrain-track-"))

    tracker, track_dir = _open_tracker(track, track_dir, default_track_dir)
    session = _session(target, sandbox, time_limit, simulate)
    spec, simulated = session.target.spec, session.target.simulated
    repeat = repeat or (1 if simulated else 3)
    work = Path(tempfile.mkdtemp(prefix="vibetrain-bench-"))
    stacks: list[tuple[str, Path]] = []
    for name in [b.strip() for b in baselines.split(",") if b.strip()]:
        try:
            stacks.append((name, write_starter(work / "stacks" / name, spec, name)))
        except ValueError as error:
            errors.print(f"[red]error:[/red] baseline {name!r}: {error}")
            raise typer.Exit(2) from None
    for path in stack:
        if "@" in str(path) and not path.exists():  # RUN@best, RUN@round-3: a candidate from a run's history
            from orchestrator.runs import RunSetupError, export_candidate

            try:
                path = export_candidate(str(path))
            except RunSetupError as error:
                errors.print(f"[red]error:[/red] {error}")
                raise typer.Exit(2) from None
        stacks.append((path.name, _candidate(path)))
    if not stacks:
        errors.print("[red]error:[/red] nothing to benchmark: give --baselines and/or --stack")
        raise typer.Exit(2)
    progress = Progress(
        TextColumn("[bold]bench"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
    )
    with progress:
        task = progress.add_task("", total=len(stacks) * repeat)
        try:
            runs = benchmark(
                session,
                stacks,
                repeat,
                work / "runs",
                on_run=lambda name, i: progress.update(task, advance=1, description=f"{name} #{i + 1}"),
            )
        except BenchmarkFailed as error:
            errors.print(f"[red]error:[/red] {error}")
            raise typer.Exit(1) from None
    console.print(bench_table(spec, runs, repeat, simulated))
    console.print(costs_table(runs, simulated))
    if json_path:
        summaries = [r.summary(spec.headline_metric.name) for r in runs]
        from orchestrator.provenance import BENCH_SCHEMA, provenance

        data = {
            "schema": BENCH_SCHEMA,
            "provenance": provenance(spec, simulated, session.sandbox.backend),
            "target": spec.id,
            "repeat": repeat,
            "runs": summaries,
        }
        json_path.write_text(json.dumps(data, indent=1))
        console.print(f"results: {json_path}")
    if timeline:
        devices = [f"{spec.hardware.kind}:{i}" for i in range(spec.hardware.count)]
        headline = spec.headline_metric.name
        titles = [
            (
                f"{r.name} (median repeat): {headline} {num(r.median(headline))}/s",
                r.measurements[r.median_index(headline)].events(),
                devices,
            )
            for r in runs
        ]
        plot_timelines(titles, timeline)
        console.print(f"timeline: {timeline}")
    if tracker is not None:
        traces = {f"{r.name}/r{i}": m.events() for r in runs for i, m in enumerate(r.measurements)}
        try:
            for run_name, events in traces.items():
                track_trace(tracker, run_name, events)
            chrome = write_chrome_trace(traces, track_dir / "trace.json")
        except TrackingError as error:
            errors.print(f"[red]error:[/red] {error}")
            raise typer.Exit(1) from None
        finally:
            tracker.close()
        console.print(f"tracking ({track}): {track_dir}")
        console.print(f"timeline for Perfetto (ui.perfetto.dev): {chrome}")


@app.command("calibrate")
def calibrate(
    target: str,
    stack: Path = typer.Option(..., help="candidate directory (holds stack/) to run for real"),
    out: Path = typer.Option(None, help="write the calibrated target spec here (default: a temp directory)"),
    steps: int = typer.Option(None, min=1, help="training steps of the real run (default: the target's)"),
    trace: Path = typer.Option(
        None,
        help="fit to this trace.jsonl of an earlier real run of STACK (a GPU machine's, say) instead of running it",
    ),
    time_limit: float | None = typer.Option(
        None, min=1, help="seconds each child run may take (default: the target's limits.time_s)"
    ),
    sandbox: str = typer.Option("auto", help="auto | bubblewrap | docker | subprocess"),
) -> None:
    """Fit the simulator's cost model to a real run of STACK, then simulate the same stack and print
    the prediction error; the calibrated spec is written for `vibetrain bench --simulate`.

    Example: vibetrain calibrate tiny-qwen3-cpu --stack my-stack --out twin.yaml
    """
    import shutil
    import tempfile

    from targets.harness.sim.calibrate import fit_and_predict, measure_and_predict, recorded_run

    session = _session(target, sandbox, time_limit)
    if session.target.simulated and trace is None:
        errors.print(
            f"[red]error:[/red] {session.target.id} is simulated here: calibration needs a real run of the stack "
            "(or --trace, the trace.jsonl of one recorded elsewhere)"
        )
        raise typer.Exit(2)
    if not (stack / "stack" / "__init__.py").exists():
        errors.print(f"[red]error:[/red] {stack} has no stack/__init__.py: not a candidate directory")
        raise typer.Exit(2)
    work = Path(tempfile.mkdtemp(prefix="vibetrain-calibrate-"))
    doing = (
        f"fitting to {trace}, then simulating {stack}"
        if trace
        else f"running {stack} for real, fitting, then simulating it"
    )
    with console.status(doing):
        try:
            if trace is None:
                report = measure_and_predict(session, stack, work, steps)
            else:
                events, recorded_steps = recorded_run(trace, session.target)
                report = fit_and_predict(session, stack, work, events, steps or recorded_steps)
        except RuntimeError as error:
            errors.print(f"[red]error:[/red] {error}")
            raise typer.Exit(1) from None
    calibration = report["calibration"]
    console.print(yaml.safe_dump(calibration.yaml_fields(), sort_keys=False), highlight=False, markup=False)
    for note in calibration.notes:
        console.print(f"note: {note}", highlight=False)
    table = Table(title=f"simulator prediction of the same run ({calibration.samples})", box=box.SIMPLE_HEAD)
    for column in ("metric", "real", "simulated", "error"):
        table.add_column(column, justify="right" if column != "metric" else "left")
    for metric, row in report["compared"].items():
        table.add_row(metric, num(row["real"]), num(row["simulated"]), f"{row['error']:+.1%}")
    console.print(table)
    path = report["calibrated_spec"]
    if out:
        shutil.copy(path, out)
        path = out
    console.print(f"calibrated spec: {path}")


RUN_FILE_SKIP = ("config", "print_config")


def _stored_options(run: Path) -> dict:
    """A run's stored configuration as ``generate`` options (``--print-config --resume``)."""
    from orchestrator.state import RunState, RunStateError

    try:
        config = RunState.load(run).config
    except RunStateError as error:
        errors.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from None
    stored = config.model_dump(exclude={"target_id", "simulated", "llm"})
    return {**stored, "simulate": config.simulated, "out": str(run), **config.llm}


# What --resume may change (or checks itself: the target, where the run is); every other option is
# the run's own, fixed when it started.
RESUME_MAY_CHANGE = (
    *("rounds", "max_minutes", "max_cost", "max_tokens", "time_limit", "track", "track_dir"),
    *("target", "out", "workspaces", "resume", "config", "print_config"),
)


def _changed_on_resume(ctx: typer.Context, run: Path) -> list[str]:
    """Options given to ``--resume`` (on the command line or in --config) that differ from the run's
    own: each would otherwise be ignored without a word."""
    stored = _stored_options(run)
    changed = []
    for name, value in ctx.params.items():
        source = ctx.get_parameter_source(name)
        if name in RESUME_MAY_CHANGE or name not in stored or source is None or source.name == "DEFAULT":
            continue
        given = str(value.resolve()) if isinstance(value, Path) else value
        if name == "prescreen" and not given:
            continue  # --no-prescreen turns the twin off from here on
        if given != stored[name]:
            changed.append(f"--{name.replace('_', '-')} {value} (this run's: {stored[name]})")
    return changed


def _run_file(ctx: typer.Context, path: Path | None) -> Path | None:
    """``--config run.yaml``: the file's values become this command's defaults (flags still win).
    Its keys are the option names as ``--print-config`` writes them; an unknown key is refused."""
    if path is None:
        return None
    from orchestrator.runs import unknown

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        errors.print(f"[red]error:[/red] --config {path}: {error}")
        raise typer.Exit(2) from None
    if not isinstance(data, dict):
        errors.print(
            f"[red]error:[/red] --config {path}: expected a mapping of option: value, got {type(data).__name__}"
        )
        raise typer.Exit(2)
    known = [p.name for p in ctx.command.params if p.name not in RUN_FILE_SKIP]
    bad = [key for key in data if key not in known]
    if bad:
        errors.print(f"[red]error:[/red] --config {path}: " + "; ".join(unknown("option", key, known) for key in bad))
        raise typer.Exit(2)
    ctx.default_map = {**(ctx.default_map or {}), **data}
    return path


@app.command("generate")
def generate(
    ctx: typer.Context,
    target: str,
    rounds: int = typer.Option(None, min=0, help="rounds after the starter (round 0); default 3, or the resumed run's"),
    policy: str = typer.Option("backlog", help="backlog | evolve | llm"),
    agents: str = typer.Option("offline", help="offline | openai | anthropic | cli:claude | cli:codex"),
    model: str = typer.Option(None, help="the LLM (openai/anthropic backends)"),
    base_url: str = typer.Option(None, help="an OpenAI-compatible server (vLLM, llama.cpp) or a proxy"),
    api_key_env: str = typer.Option(
        None, help="the variable holding the API key (default OPENAI_API_KEY / ANTHROPIC_API_KEY)"
    ),
    max_cost: float = typer.Option(
        None, min=0, help="USD budget for LLM calls, checked before each call (the model needs a price: see --prices)"
    ),
    max_tokens: int = typer.Option(None, min=1, help="token budget for LLM calls (input + output)"),
    max_output_tokens: int = typer.Option(
        None, min=1, help="the most tokens one LLM reply may have (default: 4096); a reply cut there is told so"
    ),
    prices: Path = typer.Option(
        None, help="YAML of model: (input, output) USD per million tokens (overrides the table)"
    ),
    stream: bool = typer.Option(True, help="stream LLM responses"),
    llm_review_required: bool = typer.Option(
        False,
        "--require-llm-review",
        help="reject a candidate whose LLM review cannot be had (a provider outage); by default the "
        "deterministic gate then decides alone and the round records that the review was unavailable",
    ),
    out: Path = typer.Option(None, help="run directory (a git repository); default generated/<target id>"),
    resume: bool = typer.Option(False, "--resume", help="continue the run in --out"),
    seed: int = typer.Option(0, help="seed of the agents and the search"),
    max_minutes: float = typer.Option(None, help="wall-time budget; the run stops cleanly between rounds"),
    repeat: int = typer.Option(
        None,
        min=1,
        help="measured pairs per candidate, each a run of it and of the best on one "
        "seed (default 3 real, 1 simulated: a simulation is exact for its seed)",
    ),
    max_attempts: int = typer.Option(2, min=1, help="implementer attempts per round, each fed the judge's reasons"),
    starter: str = typer.Option("colocate", help="round 0's controller"),
    sandbox: str = typer.Option("auto", help="auto | bubblewrap | docker | subprocess"),
    simulate: bool = typer.Option(False, "--simulate", help="run candidates on the cluster simulator"),
    workspaces: Path = typer.Option(Path("workspaces"), help="where each round's git worktree lives"),
    time_limit: float | None = typer.Option(
        None, min=1, help="seconds each candidate child run may take (default: the target's limits.time_s)"
    ),
    prescreen: bool = typer.Option(
        True,
        "--prescreen/--no-prescreen",
        help="real targets: run each candidate on the twin calibrated from round 0 first; judge only those "
        "predicted within --prescreen-margin of the best",
    ),
    prescreen_margin: float = typer.Option(0.05, help="how far (a fraction) below the best's prediction still goes on"),
    track: str = typer.Option(
        None,
        help="tensorboard | jsonl: each validated round's per-step ROLL-named scalars (run round-N), "
        "round/headline per round, and round-N.trace.json, its timeline for Perfetto",
    ),
    track_dir: Path = typer.Option(None, help="where --track writes (default: <out>/.git/vibetrain/track)"),
    config: Path = typer.Option(
        None,
        "--config",
        is_eager=True,
        callback=_run_file,
        help="YAML of option: value (as --print-config writes it); flags given here win",
    ),
    print_config: bool = typer.Option(
        False, "--print-config", help="print this run's options as YAML for --config, and exit"
    ),
) -> None:
    """Generate a stack for TARGET: rounds of plan -> implement -> judge -> evaluate -> commit.

    Example: vibetrain generate tiny-qwen3-cpu --rounds 3   (then: vibetrain log generated/tiny-qwen3-cpu)

    Example: vibetrain generate tiny-qwen3-cpu --seed 4 --print-config > run.yaml; vibetrain generate --config run.yaml
    """
    if print_config:
        values = {p.name: ctx.params[p.name] for p in ctx.command.params if p.name not in RUN_FILE_SKIP}
        if resume:  # what the run state stores wins: the file reproduces that run
            values.update(_stored_options(out or Path("generated") / _load(target).id))
        values = {k: str(v) if isinstance(v, Path) else v for k, v in values.items()}
        sys.stdout.write(yaml.safe_dump(values, sort_keys=False))
        raise typer.Exit()
    import logging

    from rich.live import Live
    from rich.logging import RichHandler

    from orchestrator.history import HistoryError
    from orchestrator.rounds import RunError
    from orchestrator.run_dir import RunDir
    from orchestrator.runs import RunSetupError, resume_run, start_run
    from orchestrator.state import RunStateError
    from targets.harness.tracking import TrackingError, track_round

    rounds_given = rounds is not None
    rounds = 3 if rounds is None else rounds
    logging.basicConfig(
        level=logging.WARNING, handlers=[RichHandler(console=errors, show_path=False)], format="%(message)s"
    )
    spec = _load(target)
    out = _out_dir(out or Path("generated") / spec.id)
    view, live = RoundsView(spec), None
    tracker, track_dir = _open_tracker(track, track_dir, lambda: RunDir(out).outputs / "track")

    def on_event(kind: str, **data) -> None:
        view.event(kind, **data)
        record = data.get("record")
        if tracker is not None and kind == "round_end" and record.verdict == "accepted":
            try:
                track_round(tracker, record.round, record.headline, RunDir(out).trace(record.round))
            except TrackingError as error:  # the run goes on: tracking is a view of it, not part of it
                errors.print(f"[yellow]warning:[/yellow] --track: {error}")
        if live is not None:
            live.update(view.render())
        elif not console.is_terminal:  # a pipe or a file: nothing redraws there, so each change is a line of its own
            console.print(view.line(kind))

    if resume and out.exists():
        changed = _changed_on_resume(ctx, out)
        if changed:
            errors.print(
                "[red]error:[/red] --resume continues a run as it was started, so these cannot change: "
                + "; ".join(changed)
                + " (drop them, or start a new run with another --out)"
            )
            raise typer.Exit(2)
    try:
        if resume:
            loop = resume_run(
                out,
                workspaces,
                target=target,
                rounds=rounds if rounds_given else None,
                max_minutes=max_minutes,
                time_limit_s=time_limit,
                on_event=on_event,
                max_cost=max_cost,
                max_tokens=max_tokens,
                prescreen=None if prescreen else False,
            )
        else:
            llm = {
                k: v
                for k, v in {
                    "model": model,
                    "base_url": base_url,
                    "api_key_env": api_key_env,
                    "prices": str(prices.resolve()) if prices else None,
                    "stream": stream,
                    "max_output_tokens": max_output_tokens,
                }.items()
                if v is not None
            }
            loop = start_run(
                target,
                out,
                workspaces,
                rounds=rounds,
                policy=policy,
                agents=agents,
                seed=seed,
                max_minutes=max_minutes,
                max_attempts=max_attempts,
                repeat=repeat,
                starter=starter,
                sandbox=sandbox,
                simulate=simulate,
                time_limit_s=time_limit,
                on_event=on_event,
                llm=llm,
                max_cost=max_cost,
                max_tokens=max_tokens,
                prescreen=prescreen,
                prescreen_margin=prescreen_margin,
                llm_review_required=llm_review_required,
            )
    except (RunSetupError, RunStateError, ValueError, RuntimeError) as error:
        errors.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from None
    try:
        if console.is_terminal:
            with Live(view.render(), console=console, refresh_per_second=4) as live:
                state = loop.run()
        else:
            state = loop.run()
            _print_table(view.render())
    except (RunError, HistoryError) as error:
        errors.print(f"[red]error:[/red] {error}")
        raise typer.Exit(1) from None
    finally:
        if tracker is not None:
            tracker.close()
    if tracker is not None:
        console.print(f"tracking ({track}): {track_dir}")
    best = state.best
    if best is None:
        console.print("[red]no validated candidate[/red] (see vibetrain log)")
        raise typer.Exit(1)
    starter_record = state.record(0)
    ratio = best.headline / starter_record.headline if starter_record and starter_record.headline else float("nan")
    console.print(
        f"best: round {best.round} ({best.task.title}), {spec.headline_metric.name} {num(best.headline)} "
        f"= {ratio:.2f}x the starter; {len(state.accepted())} validated of {len(state.rounds)} rounds"
    )
    console.print(f"review: vibetrain log {out}  |  git -C {out} log best  |  vibetrain report {out}")


def _state_and_history(run: Path):
    from orchestrator.history import History, HistoryError
    from orchestrator.state import RunState, RunStateError

    try:
        return RunState.load(run), History.open(run)
    except (RunStateError, HistoryError) as error:
        errors.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from None


@app.command("log")
def log_rounds(run: Path, as_json: bool = JSON_OPTION) -> None:
    """Table of a run's rounds: task, verdict, metric, delta vs parent, commit; rejected ones with
    reasons, validated ones with why they were (not) promoted. Tab-separated rows in a pipe.

    Example: vibetrain log generated/tiny-qwen3-cpu | grep rejected
    """
    state, _ = _state_and_history(run)
    if as_json:
        _print_json(
            {
                "run": str(run),
                "best_round": state.best_round,
                "llm_used": state.llm_used,
                "rounds": [r.model_dump(mode="json") for r in state.rounds],
            }
        )
        return
    _print_table(rounds_table(run, state))
    if state.llm_used:
        used = state.llm_used
        console.print(
            f"LLM use: {used.get('calls', 0)} calls, {used.get('input_tokens', 0)} tokens in, "
            f"{used.get('output_tokens', 0)} out, ${used.get('cost_usd', 0.0):.4f}",
            highlight=False,
        )


def _round_of(run: Path, state, which: str):
    """ROUND as the user wrote it: a number, ``best`` or ``latest``."""
    if not state.rounds:
        errors.print(f"[red]error:[/red] {run} has no finished round yet")
        raise typer.Exit(2)
    if which == "best":
        number = state.best_round
        if number is None:
            errors.print(f"[red]error:[/red] {run} has no validated candidate yet (vibetrain log {run})")
            raise typer.Exit(2)
    elif which == "latest":
        number = state.rounds[-1].round
    elif which.isdigit():
        number = int(which)
    else:
        errors.print(f"[red]error:[/red] ROUND must be a round number, 'best' or 'latest', not {which!r}")
        raise typer.Exit(2)
    record = state.record(number)
    if record is None:
        errors.print(f"[red]error:[/red] {run} has no round {number} (rounds 0-{state.next_round - 1})")
        raise typer.Exit(2)
    return record


@app.command("show")
def show_round(
    run: Path,
    which: str = typer.Argument("best", metavar="ROUND", help="a round number, best or latest"),
    as_json: bool = JSON_OPTION,
    profile: bool = typer.Option(False, "--profile", help="also print the harness's per-call profile"),
) -> None:
    """One round: task, the implementer's account, the judge's evidence (each check with its
    margins), metrics with spread, the paired comparison with the best, hints, then the stack's diff
    against its parent (bookkeeping files left out).

    Example: vibetrain show generated/tiny-qwen3-cpu best | less
    """
    state, history = _state_and_history(run)
    record = _round_of(run, state, which)
    judge = history.judge_report(record.commit) if record.commit else None
    diff = history.stack_diff(record.commit) if record.commit else ""
    if as_json:
        _print_json({**record.model_dump(mode="json"), "judge": judge, "diff": diff})
        return
    out = Console(soft_wrap=not console.is_terminal, highlight=False)  # whole lines in a pipe
    best = " (best)" if record.round == state.best_round else ""
    out.print(
        f"[bold]Round {record.round}[/bold]{best}: {record.task.title}  ({record.verdict}, "
        f"{record.attempts} attempt(s), {record.seconds:.0f}s)"
    )
    out.print(f"task {record.task.id} from {record.task.source or '-'}: {record.task.rationale}", markup=False)
    out.print(
        f"parent: round {record.parent_round} ({record.parent_commit[:10]}); commit {(record.commit or '-')[:10]}"
    )
    out.print(f"[bold]implementer[/bold]: {record.account or '(no account)'}")
    if judge is None:
        out.print(
            "[bold]judge[/bold]: no report kept for this round"
            + (f": {'; '.join(record.reasons)}" if record.reasons else "")
        )
    else:
        out.print("[bold]judge[/bold]: " + ("passed" if not judge["reasons"] else f"{len(judge['reasons'])} reason(s)"))
        for check in judge["checks"]:
            mark = "[green]pass[/green]" if check["passed"] else "[red]FAIL[/red]"
            details = ", ".join(f"{k} {detail(v)}" for k, v in check.get("details", {}).items())
            out.print(f"  {mark} {check['name']}" + (f": {details}" if details else ""))
            for reason in check.get("reasons", []):
                out.print(f"      {reason}", markup=False)
    if record.prediction is not None:
        from orchestrator.prescreen import twin_said

        out.print(twin_said(record), markup=False)
    if record.verdict == "accepted":
        out.print(f"[bold]against the best[/bold]: {promotion(record)}")
    if record.metrics:
        out.print(
            "[bold]metrics[/bold] (median; ± max-min): "
            + ", ".join(
                f"{k} {num(v)}" + (f" ± {num(record.spread[k])}" if k in record.spread else "")
                for k, v in record.metrics.items()
                if isinstance(v, (int, float))
            )
        )
    for hint in record.hints:
        out.print(f"hint {hint['code']}: {hint['message']}", markup=False)
    if profile and record.profile:
        out.print("[bold]profile[/bold] (each call as the harness timed it, median repeat):")
        out.print(record.profile.strip(), markup=False)
    if diff:
        out.print(f"[bold]diff against the parent[/bold] (git -C {run} show {record.commit[:10]} for everything):")
        out.print(diff, markup=False)


@app.command("export")
def export(
    candidate: str = typer.Argument(..., help="RUN@best, RUN@round-N, RUN@<commit>, or a candidate directory"),
    out: Path = typer.Option(..., help="directory to create (new or empty): the standalone project"),
    target: str = typer.Option(
        None, help="the target it trains on (default: the run's; required with a candidate directory)"
    ),
) -> None:
    """Write a candidate as a standalone project that trains on the target's hardware without vibetrain:
    its stack, the contract and harness modules it imports, the target spec, pinned requirements, a
    README and train.py.

    Example: vibetrain export generated/tiny-qwen3-cpu@best --out best-stack  (then: python best-stack/train.py)
    """
    from rich.markup import escape

    from orchestrator.export import ExportError, describe, export_project, resolve_candidate

    _out_dir(out)
    try:
        path, target_ref = resolve_candidate(candidate, target)
        exported = export_project(path, target_ref, out, source=candidate)
    except ExportError as error:
        errors.print(f"[red]error:[/red] {escape(str(error))}", highlight=False)
        raise typer.Exit(2) from None
    console.print(describe(exported), markup=False, highlight=False, soft_wrap=True)


@app.command("report")
def report(
    run: Path,
    out: Path = typer.Option(
        None, help="HTML file to write, or a directory to put <run>-report.html in (default: beside RUN)"
    ),
) -> None:
    """Static HTML: metric per round, the search tree, the timeline of best vs baselines, the rounds.

    Example: vibetrain report generated/tiny-qwen3-cpu --out reports/
    """
    from orchestrator.report import write_report

    _state_and_history(run)  # clear errors for a path that is not a run
    name = f"{run.resolve().name}-report.html"
    out = out or run.parent / name
    if out.is_dir():
        out = out / name
    out.parent.mkdir(parents=True, exist_ok=True)
    path = write_report(run, out)
    console.print(f"report: {path}")


if __name__ == "__main__":
    app()
