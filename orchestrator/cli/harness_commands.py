"""The commands that act on targets and the harness: list and inspect targets, the reference loop,
starter stacks, the judge (``check``), side-by-side benchmarks (``bench``) and calibration."""

from __future__ import annotations

import dataclasses
import difflib
import json
import secrets
import shutil
import sys
from collections.abc import Collection
from pathlib import Path

import typer
import yaml
from rich import box
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from orchestrator.cli.app import (
    JSON_OPTION,
    SANDBOX_OPTION,
    TARGET_ARGUMENT,
    TIME_LIMIT_OPTION,
    UsageError,
    app,
    argument,
    candidate_dir,
    command,
    console,
    folder_ready,
    open_tracker,
    out_dir,
    out_file,
    print_json,
    print_report,
    print_table,
    session,
    shown,
    target_app,
    workload_app,
)
from orchestrator.scratch import keep, scratch_folder
from orchestrator.tables import bench_table, checks_table, costs_table, num, phases_table
from skills.starter import CONTROLLERS, DEFAULT_CONTROLLER, unfit
from targets.errors import UserError
from targets.harness.environments.adapters import NOT_INSTALLED
from targets.spec import SpecError, TargetSpec, catalog_ids, load_target


class Failed(UserError):
    """The work the command was asked for could not be done (the message says why)."""

    exit_code = 1


def _params(spec: TargetSpec) -> str:
    counts = spec.model.param_counts()
    fmt = lambda n: f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"  # noqa: E731
    return fmt(counts.total) if counts.total == counts.active else f"{fmt(counts.total)} ({fmt(counts.active)} active)"


@command(app, "targets")
def list_targets(as_json: bool = JSON_OPTION) -> None:
    """List the catalog targets.

    Example: vibetrain targets --json | jq -r '.[].id'
    """
    specs, unavailable = [], {}
    for target_id in catalog_ids():
        try:
            specs.append(load_target(target_id))
        except SpecError as error:  # one target whose environment is not installed here: named, not fatal
            if NOT_INSTALLED not in str(error):
                raise  # a catalog entry that is wrong, not one this machine lacks a package for
            unavailable[target_id] = str(error).splitlines()[-1].strip()
    if as_json:
        listed = [{"params": _params(spec), **spec.model_dump(mode="json")} for spec in specs]
        print_json(listed + [{"id": target_id, "unavailable": why} for target_id, why in unavailable.items()])
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
            spec.hardware.summary,
            w.environment.label,
            spec.execution,
            f"{w.batch_size} x {w.group_size}",
        )
    for target_id, why in unavailable.items():
        table.add_row(target_id, "-", "-", escape(f"unavailable: {why}"), "-", "-")
    print_table(table)


@command(target_app, "show")
def show_target(target: str = TARGET_ARGUMENT) -> None:
    """Print a target's resolved spec (catalog hardware numbers filled in) as YAML that ``target validate`` accepts.

    Example: vibetrain target show tiny-qwen3-cpu > my-target.yaml
    """
    spec = load_target(target)
    # plain text, never wrapped: ``target show X > x.yaml`` must give a spec ``target validate`` accepts
    sys.stdout.write(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False, width=10_000))
    sys.stdout.write(f"# params: {_params(spec)}; groups per step: {spec.workload.groups_per_step}\n")


@command(target_app, "validate")
def validate_target(
    path: Path = typer.Argument(..., metavar="FILE", help="a target spec's YAML file (target show writes one to edit)"),
) -> None:
    """Validate a target spec YAML; exits non-zero naming each bad field. A user's environment is made
    once, through its adapter, so what its entry does with the params is known before any run.

    Example: vibetrain target validate my-target.yaml
    """
    from skills.starter import baseline_params
    from targets.harness.environments.hosted import check_environment
    from targets.harness.target import Target

    if not path.is_file():
        ids = catalog_ids()
        if str(path) in ids:  # the catalog's are valid: a user means the spec it resolves to
            raise UsageError(f"{path} is a catalog id: vibetrain target show {path} > FILE writes its spec to edit")
        close = difflib.get_close_matches(str(path), ids, n=1)
        near = f" (the catalog's {close[0]!r}? vibetrain target show {close[0]} prints its spec)" if close else ""
        what = "a directory, not a spec's YAML file" if path.is_dir() else f"no such file{near}"
        raise UsageError(f"target spec file {path}: {what}")
    spec = load_target(str(path))
    for baseline in spec.baselines:  # a labelled baseline's params, as bench checks them before it runs
        if baseline.params:
            variant = spec if baseline.hardware is None else spec.model_copy(update={"hardware": baseline.hardware})
            try:
                execution = "simulated" if variant.execution == "simulated" else "real"  # no devices needed here
                baseline_params(variant, baseline, Target(variant, str(path), execution).engine_devices)
            except ValueError as error:
                raise UsageError(f"{path}: {error}") from None
    check_environment(spec.workload.environment)  # one made (so bad params are named here) and closed
    console.print(f"[green]ok[/green] {shown(path)} is a valid target spec (id {shown(spec.id)})")


@command(app, "reference")
def reference(
    target: str = TARGET_ARGUMENT,
    steps: int = typer.Option(30, min=1, help="training steps"),
    seed: int = typer.Option(0, help="seed for sampling and environments (weights come from the spec)"),
) -> None:
    """Run the reference co-located synchronous GRPO loop and print the reward per step.

    Example: vibetrain reference tiny-qwen3-cpu --steps 3
    """
    from targets.harness.reference.loop import run_reference  # heavy imports (torch) only here

    spec = load_target(target)
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
            raise UsageError(str(error)) from None
    window = max(1, min(5, len(history) // 3))
    first = sum(s.mean_reward for s in history[:window]) / window
    last = sum(s.mean_reward for s in history[-window:]) / window
    console.print(f"mean reward, first {window} steps: {first:.3f}; last {window} steps: {last:.3f}")


@command(app, "starter")
def starter(
    target: str = TARGET_ARGUMENT,
    out: Path = typer.Option(..., help="directory to create (holds stack/ and DESIGN.md)"),
    controller: str = typer.Option(
        DEFAULT_CONTROLLER, help=f"{' | '.join(CONTROLLERS)} (the default is generate's round 0)"
    ),
    param: list[str] = typer.Option(
        None, help="KEY=VALUE over the params.json defaults (repeatable; the value as JSON where it reads as JSON)"
    ),
) -> None:
    """Write a starter candidate stack for TARGET (the recipes, wired for one controller).

    Example: vibetrain starter tiny-qwen3-cpu --out my-stack --controller static_split

    Example: vibetrain starter qwen3-0.6b-h100x1 --out my-stack --controller colocate --param fused_kernels=false
    """
    from skills.starter import parse_params, with_params, write_starter

    spec = load_target(target)
    try:
        params = with_params(spec, controller, parse_params(param or (), "--param"), "--param")
        write_starter(out_dir(out), spec, controller, params)
    except (ValueError, FileExistsError) as error:
        raise UsageError(str(error)) from None
    console.print(
        f"wrote {controller} starter stack to {shown(out)} (check it: vibetrain check {argument(target)} "
        f"--stack {argument(out)})"
    )


def say_execution(judge, simulate: bool) -> None:
    """Where the runs will happen, before they do: a GPU target on a machine without its GPUs is
    simulated (execution auto), which a PASS alone would not tell."""
    spec = judge.target.spec
    why = ""
    if judge.target.simulated and spec.execution == "auto" and not simulate:
        why = f" (execution auto: this machine lacks its {spec.hardware.summary})"
    console.print(f"{shown(spec.id)}: {judge.target.execution} execution{shown(why)}, {judge.sandbox.backend} sandbox")


@command(app, "check")
def check(
    target: str = TARGET_ARGUMENT,
    stack: Path = typer.Option(
        None,
        help="candidate directory (holds stack/) or RUN@best (@latest, @round-N); default: the first baseline starter",
    ),
    json_path: Path = typer.Option(None, "--json", help="write the results as JSON here"),
    out: Path = typer.Option(
        None, help="keep the harness's outputs here (trace, weights, candidate logs); default a temp dir"
    ),
    time_limit: float | None = TIME_LIMIT_OPTION,
    sandbox: str = SANDBOX_OPTION,
    simulate: bool = typer.Option(False, help="run the system on the simulator, whatever the target's execution says"),
) -> None:
    """Judge a candidate: integrity scan, accuracy checks 1-3, a system run and its audit. Exit 1 on failure.

    The workload is drawn from a seed and a secret of this check's own: no stack can know it in advance.

    Example: vibetrain check tiny-qwen3-cpu --stack my-stack --json verdict.json
    """
    from skills.starter import write_starter

    if stack is not None:
        stack = candidate_dir(stack)
    out_file(json_path, "--json")
    if out is not None:
        out_dir(out)
    judge = session(target, sandbox, time_limit, simulate)
    say_execution(judge, simulate)
    spec = judge.target.spec
    if stack is None:
        stack = write_starter(scratch_folder("vibetrain-starter-"), spec, spec.baselines[0].name)
        console.print(f"checking the {spec.baselines[0].name} starter")
    logs = out or scratch_folder("vibetrain-check-")
    with console.status(f"checking {shown(stack)} on {shown(judge.target.id)}"):
        results = judge.check(stack, logs, seed=secrets.randbelow(2**31))
    print_table(checks_table(results))
    passed = all(r.passed for r in results)
    if not passed and out is None and any(logs.iterdir()):  # a candidate the scan refused ran nothing to log
        console.print(f"the run's logs and trace: {shown(keep(logs))}")
    if json_path:
        folder_ready(json_path).write_text(json.dumps([r.as_dict() for r in results], indent=1, default=str))
    console.print("[green]PASS[/green]" if passed else "[red]FAIL[/red]")
    raise typer.Exit(0 if passed else 1)


def refuse_unknown_baselines(names: list[str], labelled: Collection[str]) -> None:
    """Before any starter is written: a name twice (its starter's folder would be written twice), or a
    name that is neither a controller nor one of the target's labelled baselines (listed, both kinds)."""
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"--baselines names {', '.join(twice)} more than once: each baseline runs once")
    unknown = [n for n in names if n not in CONTROLLERS and n not in labelled]
    if unknown:
        known = ", ".join([*CONTROLLERS, *labelled])
        raise UsageError(f"--baselines {', '.join(unknown)}: no such baseline (known here: {known})")


def other_hardware_session(measuring, baseline, work: Path, sandbox: str, time_limit: float | None):
    """The session a baseline on other hardware runs under: the target on that hardware (written where
    the harness's child reads it), simulated, drawing the bench's own workload secret so its runs pair
    with the others' by seed."""
    if not measuring.target.simulated:
        raise UsageError(f"baseline {baseline.label!r} runs on other hardware: only a simulated bench runs it")
    path = work / f"{baseline.label}.yaml"
    variant = measuring.target.spec.on_hardware(baseline)
    path.write_text(yaml.safe_dump(variant.model_dump(mode="json", exclude_none=True), sort_keys=False))
    return dataclasses.replace(session(str(path), sandbox, time_limit, True), task_key=measuring.task_key)


@command(app, "bench")
def bench(
    target: str = TARGET_ARGUMENT,
    stack: list[Path] = typer.Option(
        [], help="candidate directory, or RUN@best (@latest, @round-N) of a generate run (repeatable)"
    ),
    baselines: str = typer.Option(
        "", help="comma-separated starter schedules (default: every one that fits the target's devices)"
    ),
    repeat: int = typer.Option(
        None,
        min=1,
        help="runs per schedule; default 3 real, 1 simulated (the simulator is "
        "deterministic: repeats only vary the workload's seed)",
    ),
    json_path: Path = typer.Option(None, "--json", help="write the results as JSON here"),
    timeline: Path = typer.Option(None, help="write the per-device timeline PNG here"),
    phases: Path = typer.Option(None, help="write where a step goes (each phase beside its least time) as a PNG here"),
    track: str = typer.Option(
        None,
        help="tensorboard | jsonl: per training step ROLL-named scalars of every run (run <schedule>/r<repeat>), "
        "and trace.json, the timeline for Perfetto",
    ),
    track_dir: Path = typer.Option(
        None, help="where --track writes (default: beside --json, else --timeline, as <name>-track/; else a temp dir)"
    ),
    time_limit: float | None = TIME_LIMIT_OPTION,
    simulate: bool = typer.Option(
        False, "--simulate", help="run on the cluster simulator even if the target runs for real here"
    ),
    sandbox: str = SANDBOX_OPTION,
    task_key: str = typer.Option(
        None,
        help="the workload's secret, in hex, to reproduce a bench exactly (its --json records the one it drew); "
        "'' is the public derivation, as before workloads had a secret",
    ),
) -> None:
    """Benchmark baselines and candidates side by side; ratios are to the first run listed.

    Example: vibetrain bench tiny-qwen3-cpu --baselines colocate --stack generated/tiny-qwen3-cpu@best --json b.json
    """
    from skills.starter import baseline_params, write_starter
    from targets.harness.measure.benchmark import BenchmarkFailed, benchmark, refuse_shared_names
    from targets.harness.measure.timeline import plot_step_phases, plot_timelines
    from targets.harness.measure.tracking import track_trace, write_chrome_trace

    out_file(json_path, "--json")
    out_file(timeline, "--timeline", image=True)
    out_file(phases, "--phases", image=True)
    beside = json_path or timeline  # the tracking goes next to the other outputs, else a temp dir

    def default_track_dir() -> Path:
        return beside.with_name(f"{beside.stem}-track") if beside else keep(scratch_folder("vibetrain-track-"))

    tracker, track_dir = open_tracker(track, track_dir, default_track_dir)
    measuring = session(target, sandbox, time_limit, simulate)
    say_execution(measuring, simulate)
    if task_key is not None:
        try:
            measuring = dataclasses.replace(measuring, task_key=bytes.fromhex(task_key))
        except ValueError:
            what = "an odd number of digits" if len(task_key) % 2 else "not hex"
            raise UsageError(f"--task-key {task_key!r}: {what} (write it as --json recorded it)") from None
    spec, simulated = measuring.target.spec, measuring.target.simulated
    repeat = repeat or (1 if simulated else 3)
    labelled = {b.label: b for b in spec.baselines if b.label is not None}  # other hardware, or techniques on
    names = [b.strip() for b in baselines.split(",") if b.strip()]
    if baselines.strip() and not names:  # " , " names nothing: said, not read as "every baseline"
        raise UsageError(f"--baselines {baselines!r} names no baseline")
    names = names or [*(c for c in CONTROLLERS if unfit(spec, c) is None), *labelled]
    refuse_unknown_baselines(names, labelled)
    work = scratch_folder("vibetrain-bench-")
    stacks: list[tuple[str, Path]] = []
    sessions = {}
    for name in names:
        if name in labelled:
            baseline, variant = labelled[name], spec
            if baseline.hardware is not None:  # equal-cost other hardware
                sessions[name] = other_hardware_session(measuring, baseline, work, sandbox, time_limit)
                variant = sessions[name].target.spec
            try:
                params = baseline_params(variant, baseline, measuring.target.engine_devices)
            except ValueError as error:
                raise UsageError(str(error)) from None
            stacks.append((name, write_starter(work / "stacks" / name, variant, baseline.name, params)))
            continue
        try:
            stacks.append((name, write_starter(work / "stacks" / name, spec, name)))
        except ValueError as error:
            raise UsageError(f"baseline {name!r}: {error}") from None
    for path in stack:
        path = candidate_dir(path)
        stacks.append((path.name, path))
    if not stacks:
        raise UsageError("nothing to benchmark: give --baselines and/or --stack")
    refuse_shared_names(stacks)  # before the progress bar: asked wrongly, not a run that failed
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

        def done(name: str, i: int) -> None:
            progress.update(task, advance=1, description=f"last done: {name} #{i + 1}")

        try:
            runs = benchmark(measuring, stacks, repeat, work / "runs", sessions=sessions, on_run=done)
        except KeyboardInterrupt:  # Ctrl-C ended it with no word (exit 130): a partial bench is no comparison
            ran = int(progress.tasks[0].completed)
            console.print(f"bench interrupted after {ran} of {len(stacks) * repeat} runs: nothing written")
            raise typer.Exit(130) from None
    failed = [f for r in runs for f in r.failures]
    runs = [r for r in runs if not r.failures]  # a failed schedule's figures do not count
    if runs:
        print_report(bench_table(spec, runs, repeat, simulated))
        print_report(phases_table(runs))
        print_report(costs_table(runs, simulated))
    for failure in failed:
        console.print(f"[red]failed its checks:[/red] {shown(failure)}")
    if failed:
        console.print(f"the runs' logs and traces: {shown(keep(work) / 'runs')}")
    if json_path:
        from orchestrator.provenance import BENCH_SCHEMA, provenance

        data = {
            "schema": BENCH_SCHEMA,
            "provenance": provenance(spec, simulated, measuring.sandbox.backend),
            "task_key": measuring.task_key.hex(),  # the bench's own session: no candidate runs under it again
            "target": spec.id,
            "repeat": repeat,
            "runs": [r.summary(spec.headline_metric.name) for r in runs],
            "failed": [{"name": f.name, "repeat": f.repeat, "reasons": f.reasons} for f in failed],
        }
        folder_ready(json_path).write_text(json.dumps(data, indent=1))
        console.print(f"results: {shown(json_path)}")
    if timeline and runs:
        devices = [d.id for d in measuring.target.devices()]
        headline = spec.headline_metric.name
        titles = [
            (
                f"{r.name} (median repeat): {headline} {num(r.median(headline))}/s",
                r.measurements[r.median_index(headline)].events(),
                devices,
            )
            for r in runs
        ]
        plot_timelines(titles, folder_ready(timeline))
        console.print(f"timeline: {shown(timeline)}")
    if phases and runs:
        plot_step_phases(
            [(r.name, r.summary(spec.headline_metric.name)["metrics"]) for r in runs], folder_ready(phases)
        )
        console.print(f"where a step goes: {shown(phases)}")
    if tracker is not None:
        traces = {f"{r.name}/r{i}": m.events() for r in runs for i, m in enumerate(r.measurements)}
        try:
            for run_name, events in traces.items():
                track_trace(tracker, run_name, events)
            chrome = write_chrome_trace(traces, track_dir / "trace.json")
        finally:
            tracker.close()
        console.print(f"tracking ({track}): {shown(track_dir)}")
        console.print(f"timeline for Perfetto (ui.perfetto.dev): {shown(chrome)}")
    if failed:
        names = sorted({f.name for f in failed})
        raise BenchmarkFailed(
            f"{len(failed)} run(s) failed their checks ({', '.join(names)}): their figures are left out"
            + ("" if runs else "; no schedule passed")
        )


@command(app, "calibrate")
def calibrate(
    target: str = TARGET_ARGUMENT,
    stack: Path = typer.Option(
        ..., help="candidate directory (holds stack/) or RUN@best (@latest, @round-N): run for real"
    ),
    out: Path = typer.Option(None, help="write the calibrated target spec here (default: a temp directory)"),
    steps: int = typer.Option(None, min=1, help="training steps of the real run (default: the target's)"),
    trace: Path = typer.Option(
        None,
        help="fit to this trace.jsonl of an earlier real run of STACK (a GPU machine's, say) instead of running it",
    ),
    time_limit: float | None = TIME_LIMIT_OPTION,
    sandbox: str = SANDBOX_OPTION,
) -> None:
    """Fit the simulator's cost model to a real run of STACK, then simulate the same stack and print
    the prediction error; the calibrated spec is written for `vibetrain bench --simulate`.

    Example: vibetrain calibrate tiny-qwen3-cpu --stack my-stack --out twin.yaml
    """
    from targets.harness.sim.calibrate import fit_and_predict, measure_and_predict, recorded_run, refuse_pools

    # the public workload (no candidate is judged here): a refit of a recorded trace predicts the same
    fitting = dataclasses.replace(session(target, sandbox, time_limit), task_key=b"")
    refuse_pools(fitting.target.spec)  # before a run or a trace is read
    if fitting.target.simulated and trace is None:
        raise UsageError(
            f"{fitting.target.id} is simulated here: calibration needs a real run of the stack "
            "(or --trace, the trace.jsonl of one recorded elsewhere)"
        )
    stack = candidate_dir(stack)
    out = out_file(out, "--out")  # before the run: a typo never costs it
    work = scratch_folder("vibetrain-calibrate-")  # removed at exit unless it holds the spec printed
    doing = (
        f"fitting to {trace}, then simulating {stack}"
        if trace
        else f"running {stack} for real, fitting, then simulating it"
    )
    with console.status(shown(doing)):
        try:
            if trace is None:
                report = measure_and_predict(fitting, stack, work, steps)
            else:
                events, recorded_steps, note = recorded_run(trace, fitting.target, stack)
                if note is not None:
                    console.print(f"note: {shown(note)}", highlight=False)
                report = fit_and_predict(fitting, stack, work, events, steps or recorded_steps)
        except UserError:
            raise  # the trace given is no finished real run of the target: said as the user's mistake
        except RuntimeError as error:
            raise Failed(str(error)) from None
    calibration = report["calibration"]
    console.print(yaml.safe_dump(calibration.yaml_fields(), sort_keys=False), highlight=False, markup=False)
    for note in calibration.notes:
        console.print(f"note: {shown(note)}", highlight=False)
    table = Table(  # the fit's own data: an error on another run (another seed, another stack) can only be larger
        title=f"simulator prediction of the run it was fitted to, in sample ({calibration.samples})",
        box=box.SIMPLE_HEAD,
    )
    for column in ("metric", "real", "simulated", "error"):
        table.add_column(column, justify="right" if column != "metric" else "left")
    for metric, row in report["compared"].items():
        table.add_row(metric, num(row["real"]), num(row["simulated"]), f"{row['error']:+.1%}")
    print_report(table)
    path = report["calibrated_spec"]
    if out:
        shutil.copy(path, folder_ready(out))
        path = out
    else:
        keep(work)
    console.print(f"calibrated spec: {shown(path)}")


@command(workload_app, "profile")
def profile_workload(
    target: str = TARGET_ARGUMENT,
    out: Path = typer.Option(..., help="write the profile (a YAML fragment of workload keys) here"),
    stack: Path = typer.Option(
        None,
        help="candidate directory (holds stack/) or RUN@best (@latest, @round-N); default: the first baseline starter",
    ),
    steps: int = typer.Option(None, min=1, help="training steps of the real run (default: the target's)"),
    time_limit: float | None = TIME_LIMIT_OPTION,
    sandbox: str = SANDBOX_OPTION,
) -> None:
    """Run TARGET's environment for real and fit what the simulator draws from (turn counts, prompt,
    observation and response lengths, the environment's latency and failures); a simulated spec
    takes them with `workload: {profile: FILE}` and scales them to its own cluster.

    Example: vibetrain workload profile tiny-qwen3-cpu-arithmetic --out arithmetic.profile.yaml
    """
    from skills.starter import write_starter
    from targets.harness.sim.profile_fit import ProfileError, fit_profile

    out_file(out, "--out")
    measuring = dataclasses.replace(session(target, sandbox, time_limit), task_key=b"")
    spec = measuring.target.spec
    if measuring.target.simulated:
        raise UsageError(f"{spec.id} is simulated here: a profile measures a real run of its environment")
    if stack is None:
        stack = write_starter(scratch_folder("vibetrain-starter-"), spec, spec.baselines[0].name)
    stack = candidate_dir(stack)
    logs = scratch_folder("vibetrain-profile-")
    with console.status(f"running {shown(stack)} on {shown(spec.id)} for real"):
        run = measuring.measure(stack, logs, seed=0, steps=steps)
    if not run.ok:
        raise Failed(f"the real run failed (its logs: {keep(logs)}): " + "; ".join(run.reasons[:3]))
    try:
        profile = fit_profile(spec, [run.events()], f"{spec.id} ({spec.workload.environment.label})")
    except ProfileError as error:
        raise Failed(str(error)) from None
    folder_ready(out).write_text(yaml.safe_dump(profile, sort_keys=False))
    samples = profile["samples"]
    for note in samples["notes"]:
        console.print(f"note: {note}", highlight=False, markup=False)
    console.print(
        f"profile of {samples['episodes']} episodes, {samples['steps']} steps: {out}\n"
        f"a simulated spec names it as workload: {{profile: {out.resolve()}}} (or a path relative to the spec's "
        "own file), with a stand-in environment such as {name: synthetic_agent}",
        highlight=False,
        markup=False,
    )
