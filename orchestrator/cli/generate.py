"""``vibetrain generate``: its options are a ``RunConfig`` (defaults from the model; the LLM ones
its ``llm``), a run directory, and how to watch the run. ``--config run.yaml`` gives the options as
defaults (flags win); ``--print-config`` writes them (with ``--resume``, the stored run's)."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

import typer
import yaml
from rich.live import Live
from rich.logging import RichHandler
from rich.markup import escape

from orchestrator.cli.app import (
    TARGET_ARGUMENT,
    UsageError,
    app,
    argument,
    command,
    console,
    errors,
    open_tracker,
    out_dir,
    print_table,
    shown,
)
from orchestrator.config import ConfigError, LLMConfig, RunConfig, unknown
from orchestrator.run_dir import RunDir
from orchestrator.runs import WORKSPACES, check_config, resume_run, start_run
from orchestrator.state import RunState
from orchestrator.tables import RoundsView, best_generalization, best_over_starter, generalization_table, num
from skills.starter import CONTROLLERS, format_param, parse_params
from targets.spec import load_target
from targets.yaml_text import load_yaml

DEFAULT = RunConfig()
LLM_OPTIONS = tuple(LLMConfig.model_fields)  # model, base_url, ..., max_output_tokens, max_turns
RENAMED = {"time_limit": "time_limit_s"}  # option -> RunConfig field, where their names differ
NOT_CONFIG = ("target", "out", "resume", "simulate", "workspaces", "track", "track_dir", "config", "print_config")
RUN_FILE_SKIP = ("config", "print_config")


def _run_file(ctx: typer.Context, path: Path | None) -> Path | None:
    """``--config run.yaml``: the file's values become this command's defaults (flags still win).
    Its keys are the option names as ``--print-config`` writes them; an unknown key is refused."""
    if path is None:
        return None

    def refuse(message: str) -> typer.Exit:  # an option's callback runs before the command's own error handling
        errors.print(f"[red]error:[/red] --config {escape(str(path))}: {escape(message)}", highlight=False)
        return typer.Exit(2)

    try:
        data = load_yaml(path.read_text(), str(path))
    except OSError as error:
        raise refuse(f"cannot read it ({error.strerror})") from None
    except (UnicodeDecodeError, yaml.YAMLError) as error:
        raise refuse(str(error)) from None
    if not isinstance(data, dict):
        raise refuse(f"expected a mapping of option: value, got {type(data).__name__}")
    known = [p.name for p in ctx.command.params if p.name not in RUN_FILE_SKIP]
    bad = [key for key in data if key not in known]
    if bad:
        raise refuse("; ".join(unknown("option", key, known) for key in bad))
    params = {p.name: p for p in ctx.command.params}
    for key, value in data.items():  # checked here, where the file is named: a flag's error named a flag not typed
        try:
            params[key].process_value(ctx, value)
        except typer.BadParameter as error:
            raise refuse(f"{key}: {value!r}: {error.message or error.format_message()}") from None
    ctx.default_map = {**(ctx.default_map or {}), **data}
    return path


def config_of(options: dict, given: Mapping[str, str] | None = None) -> dict:
    """``RunConfig`` values from ``generate`` options (the LLM ones gathered into ``llm``); ``given``: how an
    option was given where not by its flag (``_from_file``), which an error names."""
    values: dict = {"llm": {}}
    for name, value in options.items():
        if name in NOT_CONFIG:
            continue
        if name == "starter_param":  # KEY=VALUE texts -> the params themselves (None: unset, as elsewhere)
            if value is not None:
                values["starter_params"] = starter_params_of(value, (given or {}).get(name, "--starter-param"))
            continue
        if name in LLM_OPTIONS:
            values["llm"][name] = str(value.resolve()) if isinstance(value, Path) else value
        else:
            values[RENAMED.get(name, name)] = value
    return values


def starter_params_of(texts: list[str], flag: str = "--starter-param") -> dict:
    """``--starter-param`` texts as params (a ``ConfigError`` for one that is not KEY=VALUE, naming ``flag``)."""
    try:
        return parse_params(texts, flag)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def options_of(config: RunConfig, run: Path) -> dict:
    """A stored run's configuration as ``generate`` options (``--print-config --resume``)."""
    values = {
        name: getattr(config, name)
        for name in RunConfig.model_fields
        if name not in ("llm", "target_id", "simulated", "starter_params", *RENAMED.values())
    }
    values["starter_param"] = [format_param(name, value) for name, value in config.starter_params.items()]
    values.update({option: getattr(config, field) for option, field in RENAMED.items()})
    values.update(config.llm.model_dump(), simulate=config.simulated, out=str(run))
    return values


def _from_file(ctx: typer.Context) -> dict[str, str]:
    """Each setting ``--config`` gave (not a flag), by its field: how an error names it."""
    path = ctx.params.get("config")
    return {
        RENAMED.get(name, name): f"--config {path}: {name}"
        for name in ctx.params
        if (source := ctx.get_parameter_source(name)) is not None and source.name == "DEFAULT_MAP"
    }


def _given(ctx: typer.Context) -> dict:
    """The options this command was given, on the command line or by ``--config`` (not defaults)."""
    return {
        name: value
        for name, value in ctx.params.items()
        if (source := ctx.get_parameter_source(name)) is not None and source.name != "DEFAULT"
    }


@command(app, "generate")
def generate(
    ctx: typer.Context,
    target: str = TARGET_ARGUMENT,
    rounds: int = typer.Option(DEFAULT.rounds, min=0, help="rounds after the starter (round 0)"),
    policy: str = typer.Option(DEFAULT.policy, help="backlog | evolve | llm"),
    selection: str = typer.Option(
        DEFAULT.selection,
        help="evolve's parents: fitness (the fitter of two drawn) | pareto (one drawn from the front of the "
        "headline and the trained tokens a second, which a schedule training short trajectories gives up)",
    ),
    agents: str = typer.Option(DEFAULT.agents, help="offline | openai | anthropic | cli:claude | cli:codex"),
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
    max_turns: int = typer.Option(
        None, min=1, help="the most model turns one implementer attempt may take (default: 40); then it ends"
    ),
    prices: Path = typer.Option(
        None, help="YAML of model: (input, output) USD per million tokens (overrides the table)"
    ),
    stream: bool = typer.Option(DEFAULT.llm.stream, help="stream LLM responses"),
    llm_review_required: bool = typer.Option(
        DEFAULT.llm_review_required,
        "--require-llm-review",
        help="reject a candidate whose LLM review cannot be had (a provider outage); by default the "
        "deterministic gate then decides alone and the round records that the review was unavailable",
    ),
    out: Path = typer.Option(None, help="run directory (a git repository); default generated/<target id>"),
    resume: bool = typer.Option(False, "--resume", help="continue the run in --out"),
    seed: int = typer.Option(DEFAULT.seed, help="seed of the agents and the search"),
    max_minutes: float = typer.Option(None, help="wall-time budget; the run stops cleanly between rounds"),
    repeat: int = typer.Option(
        None,
        min=1,
        help="measured pairs per candidate, each a run of it and of the best on one "
        "seed (default 3 real, 1 simulated: a simulation is exact for its seed)",
    ),
    held_out: int = typer.Option(
        None,
        min=0,
        help="after the last round, measure the best over the starter on this many seeds no round used, and "
        "on them with the workload perturbed (default 3 simulated, 0 real: each is four more real runs)",
    ),
    max_attempts: int = typer.Option(
        DEFAULT.max_attempts, min=1, help="implementer attempts per round, each fed the judge's reasons"
    ),
    starter: str = typer.Option(DEFAULT.starter, help=f"round 0's controller: {' | '.join(CONTROLLERS)}"),
    starter_param: list[str] = typer.Option(
        None,
        "--starter-param",
        help="KEY=VALUE over round 0's params.json defaults (repeatable; the value as JSON where it reads as "
        "JSON): an engine option a machine needs, e.g. fused_kernels=false; later rounds inherit it",
    ),
    sandbox: str = typer.Option(DEFAULT.sandbox, help="auto | bubblewrap | docker | subprocess"),
    simulate: bool = typer.Option(False, "--simulate", help="run candidates on the cluster simulator"),
    workspaces: Path = typer.Option(WORKSPACES, help="where each run keeps its rounds' git worktrees"),
    time_limit: float | None = typer.Option(
        None, min=1, help="seconds each candidate child run may take (default: the target's limits.time_s)"
    ),
    prescreen: bool = typer.Option(
        DEFAULT.prescreen,
        "--prescreen/--no-prescreen",
        help="real targets: run each candidate first on the twin calibrated on the validated rounds' real runs; "
        "judge only those predicted within --prescreen-margin of the best",
    ),
    prescreen_margin: float = typer.Option(
        DEFAULT.prescreen_margin, help="how far (a fraction) below the best's prediction still goes on"
    ),
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
    spec = load_target(target)
    out = out or Path("generated") / spec.id
    from_file = _from_file(ctx)  # what --config gave, which an error names by the file
    if print_config:
        values = {p.name: ctx.params[p.name] for p in ctx.command.params if p.name not in RUN_FILE_SKIP}
        if resume:  # what the run state stores wins: the file reproduces that run
            values.update(options_of(RunState.load(out).config, out))
        else:  # a file --config would refuse on any machine is not written (paths and keys are this one's)
            try:
                run_config = RunConfig.parse(config_of(ctx.params, from_file), from_file)
            except ConfigError as error:
                raise UsageError(str(error)) from None
            check_config(target, run_config, simulate, from_file.get("starter_param", "--starter-param"), here=False)
        values = {k: str(v) if isinstance(v, Path) else v for k, v in values.items()}
        sys.stdout.write(yaml.safe_dump(values, sort_keys=False))
        raise typer.Exit()
    out, workspaces = out_dir(out), out_dir(workspaces, "--workspaces")  # printing the config writes neither
    logging.basicConfig(
        level=logging.WARNING, handlers=[RichHandler(console=errors, show_path=False)], format="%(message)s"
    )
    view, live = RoundsView(spec), None
    tracker, track_dir = open_tracker(track, track_dir, lambda: RunDir(out).outputs / "track")

    def on_event(kind: str, **data) -> None:
        view.event(kind, **data)
        record = data.get("record")
        if tracker is not None and kind == "round_end" and record.verdict == "accepted":
            from targets.harness.measure.tracking import TrackingError, track_round

            try:
                track_round(tracker, record.round, record.headline, RunDir(out).trace(record.round))
            except TrackingError as error:  # the run goes on: tracking is a view of it, not part of it
                errors.print(f"[yellow]warning:[/yellow] --track: {shown(error)}")
        if live is not None:
            live.update(view.render())
        elif not console.is_terminal:  # a pipe or a file: nothing redraws there, so each change is a line of its own
            console.print(view.line(kind))

    try:
        if resume:
            overrides = config_of(_given(ctx))
            if out.exists():
                stored = RunState.load(out).config
                # the LLM settings a config file leaves unset (None) keep the run's
                given_llm = {k: v for k, v in overrides["llm"].items() if v is not None}
                overrides["llm"] = stored.llm.model_copy(update=given_llm).model_dump()
                source = ctx.get_parameter_source("simulate")  # typer's own click: compared by name, as _given does
                typed = source is not None and source.name == "COMMANDLINE"  # a config file's is its default
                if typed and simulate != stored.simulated:  # not a setting: how the run runs
                    started = "on the simulator" if stored.simulated else "for real"
                    raise UsageError(
                        f"--simulate: {out} was started {started}, and a resumed run goes on as it started"
                    )
            loop = resume_run(out, overrides, on_event, workspaces, target=target)
        else:
            run_config = RunConfig.parse(config_of(ctx.params, from_file), from_file)
            loop = start_run(
                target,
                out,
                run_config,
                on_event,
                workspaces,
                simulate=simulate,
                starter_params_from=from_file.get("starter_param", "--starter-param"),
            )
    except ConfigError as error:
        raise UsageError(str(error)) from None
    try:
        if console.is_terminal:
            with Live(view.render(), console=console, refresh_per_second=4) as live:
                state = loop.run()
        else:
            state = loop.run()
            if view.rows:  # the rounds this invocation ran (none: a finished run resumed as it was)
                print_table(view.render())
    except (KeyboardInterrupt, SystemExit) as stopped:  # Ctrl-C, or SIGTERM (app.py: sys.exit(128 + 15))
        if isinstance(stopped, KeyboardInterrupt) or stopped.code == 128 + signal.SIGTERM:
            console.print(
                f"interrupted in round {loop.state.next_round} (redone on resume, unless it was committed: then "
                "recovered from git): every validated candidate is committed; go on with: "
                f"vibetrain generate {argument(target)} --resume --out {argument(out)}"
            )
        raise
    finally:
        if tracker is not None:
            tracker.close()
    if tracker is not None:
        console.print(f"tracking ({track}): {shown(track_dir)}")
    best = state.best
    if best is None:
        console.print("[red]no validated candidate[/red] (see vibetrain log)")
        raise typer.Exit(1)
    generalization = best_generalization(state)
    ratio = best_over_starter(state, spec.headline_metric) or "no starter figure to compare"
    console.print(
        f"best: round {best.round} ({escape(best.task.title)}), {spec.headline_metric.name} {num(best.headline)} "
        f"= {escape(ratio)}; {len(state.accepted())} validated of {len(state.rounds)} rounds"
    )
    if generalization is not None:
        print_table(generalization_table(generalization))
    run = argument(out)
    console.print(f"review: vibetrain log {run}  |  git -C {run} log best  |  vibetrain report {run}")
