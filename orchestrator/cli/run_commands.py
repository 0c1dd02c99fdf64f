"""The commands that review a run: its rounds (``log``), one round (``show``), an HTML report, and
a candidate exported as a standalone project."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from orchestrator.cli.app import (
    JSON_OPTION,
    RUN_ARGUMENT,
    UsageError,
    app,
    argument,
    command,
    console,
    out_dir,
    out_file,
    print_json,
    print_table,
    shown,
)
from orchestrator.history import History
from orchestrator.state import RunState
from orchestrator.tables import (
    best_generalization,
    best_rejected_unseen,
    cut_diff,
    generalization_table,
    num,
    promotion,
    rounds_table,
)
from targets.harness.judge.check_result import detail
from targets.printable import indented, printable


def _state_and_history(run: Path, command: str) -> tuple[RunState, History]:
    folder, at, which = str(run).rpartition("@")
    if at and not run.exists() and Path(folder).is_dir():  # RUN@best, as check, bench and export take it
        if command == "show":
            raise UsageError(f"{run}: show names the round after the run's folder: vibetrain show {folder} {which}")
        raise UsageError(f"{run}: {command} takes the run's folder, not a candidate: vibetrain {command} {folder}")
    return RunState.load(run), History.open(run)


@command(app, "log")
def log_rounds(run: Path = RUN_ARGUMENT, as_json: bool = JSON_OPTION) -> None:
    """Table of a run's rounds: task, verdict, metric, delta vs parent, commit; rejected ones with
    reasons, validated ones with why they were (not) promoted. Tab-separated rows in a pipe.

    Example: vibetrain log generated/tiny-qwen3-cpu | grep rejected
    """
    state, _ = _state_and_history(run, "log")
    # an earlier best's figures (a run that found another since) are not shown
    generalization, rejected = best_generalization(state), best_rejected_unseen(state)
    if as_json:
        print_json(
            {
                "run": str(run),
                "best_round": state.best_round,
                "generalization": generalization.model_dump(mode="json") if generalization else None,
                "generalization_rejected": rejected.model_dump(mode="json") if rejected else None,
                "llm_used": state.llm_used,
                "rounds": [r.model_dump(mode="json") for r in state.rounds],
            }
        )
        return
    print_table(rounds_table(run, state))
    if not state.rounds:  # a header alone read as a run with nothing wrong
        resume = f"vibetrain generate {argument(state.config.target)} --resume --out {argument(run)}"
        console.print(f"no round has finished yet; one cut short is redone by: {resume}", highlight=False)
    if generalization is not None:
        print_table(generalization_table(generalization))
    if rejected is not None:
        console.print(
            f"[red]the best (round {rejected.best_round}) where the search never looked:[/red] "
            + escape(rejected.said())
        )
    if state.llm_used:
        used = state.llm_used
        console.print(
            f"LLM use: {used.get('calls', 0)} calls, {used.get('input_tokens', 0)} tokens in, "
            f"{used.get('output_tokens', 0)} out, ${used.get('cost_usd', 0.0):.4f}",
            highlight=False,
        )


def _round_of(run: Path, state, which: str):
    """ROUND as the user wrote it: a number (or ``round-N``, as in ``RUN@round-N``), ``best`` or ``latest``."""
    if not state.rounds:
        raise UsageError(f"{run} has no finished round yet")
    if which == "best":
        number = state.best_round
        if number is None:
            raise UsageError(f"{run} has no validated candidate yet (vibetrain log {run})")
    elif which == "latest":
        number = state.rounds[-1].round
    elif which.removeprefix("round-").isascii() and which.removeprefix("round-").isdigit():  # "²" is no int()
        number = int(which.removeprefix("round-"))
    else:
        raise UsageError(f"ROUND must be a round number (N or round-N), 'best' or 'latest', not {which!r}")
    record = state.record(number)
    if record is None:
        raise UsageError(f"{run} has no round {number} (rounds 0-{state.next_round - 1})")
    return record


@command(app, "show")
def show_round(
    run: Path = RUN_ARGUMENT,
    which: str = typer.Argument("best", metavar="ROUND", help="a round number (N or round-N), best or latest"),
    as_json: bool = JSON_OPTION,
    profile: bool = typer.Option(False, "--profile", help="also print the harness's per-call profile"),
) -> None:
    """One round: task, the implementer's account, the judge's evidence (each check with its
    margins), metrics with spread, the paired comparison with the best, hints, then the stack's diff
    against its parent (bookkeeping files left out).

    Example: vibetrain show generated/tiny-qwen3-cpu best | less
    """
    state, history = _state_and_history(run, "show")
    record = _round_of(run, state, which)
    judge = history.judge_report(record.commit) if record.commit else None
    diff = history.stack_diff(record.commit) if record.commit else ""
    if as_json:
        print_json({**record.model_dump(mode="json"), "judge": judge, "diff": diff})
        return
    out = Console(soft_wrap=not console.is_terminal, highlight=False, emoji=False)  # whole lines in a pipe
    best = " (best)" if record.round == state.best_round else ""
    out.print(  # what agents wrote is text, never markup (an LLM's "[/bold]" would break the line)
        f"[bold]Round {record.round}[/bold]{best}: {escape(record.task.title)}  ({record.verdict}, "
        f"{record.attempts} attempt(s), {record.seconds:.0f}s)"
    )
    # an agent's words: escaped as recorded, their lines after the first indented (none reads as a line of show's)
    out.print(
        f"task {record.task.id} from {record.task.source or '-'}: {indented(record.task.rationale)}", markup=False
    )
    parent = "the run's start" if record.parent_round is None else f"round {record.parent_round}"
    out.print(f"parent: {parent} ({record.parent_commit[:10]}); commit {(record.commit or '-')[:10]}")
    out.print(f"[bold]implementer[/bold]: {escape(indented(record.account or '(no account)'))}")
    if judge is None:
        out.print(
            "[bold]judge[/bold]: no report kept for this round"
            + (f": {escape(indented('; '.join(record.reasons)))}" if record.reasons else "")
        )
    else:
        out.print("[bold]judge[/bold]: " + ("passed" if not judge["reasons"] else f"{len(judge['reasons'])} reason(s)"))
        for check in judge["checks"]:
            mark = "[green]pass[/green]" if check["passed"] else "[red]FAIL[/red]"
            # a figure the check could not take (no witness, say) is left out, not printed as None
            details = ", ".join(f"{k} {detail(v)}" for k, v in check.get("details", {}).items() if v is not None)
            out.print(f"  {mark} {escape(check['name'])}" + (f": {escape(printable(details))}" if details else ""))
            for reason in check.get("reasons", []):  # escaped as made; a run recorded before that, here
                out.print(f"      {indented(printable(reason), ' ' * 8)}", markup=False)
    if record.prediction is not None:
        from orchestrator.prescreen import twin_said

        out.print(indented(twin_said(record)), markup=False)
    if record.verdict == "accepted":
        out.print(f"[bold]against the best[/bold]: {escape(promotion(record))}")
    if record.metrics:
        out.print(
            "[bold]metrics[/bold] (the repeats' median, and their spread: max - min): "
            + ", ".join(  # not "±": the spread is the whole range, and the median need not be its middle
                f"{k} {num(v)}" + (f" (spread {num(record.spread[k])})" if k in record.spread else "")
                for k, v in record.metrics.items()
                if isinstance(v, (int, float))
            )
        )
    for hint in record.hints:
        out.print(f"hint {hint.code}: {hint.said}", markup=False)
    if profile and record.profile:
        out.print(
            "[bold]profile[/bold] (each call as the harness timed it, median repeat; total s sums calls that "
            "overlapped, so it can exceed the run):"
        )
        out.print(record.profile.strip(), markup=False)
    elif profile:
        out.print("[bold]profile[/bold]: none (this round ran no benchmark)")
    if diff:  # cut as the report cuts it (round 0's is the whole starter, thousands of lines); --json has it all
        lines, cut = cut_diff(diff, argument(run), record.commit)
        out.print("[bold]diff against the parent[/bold] (the stack's files, without the round's records):")
        out.print("\n".join(lines), markup=False)
        if cut:
            out.print(cut, markup=False)


@command(app, "export")
def export(
    candidate: str = typer.Argument(
        ..., metavar="CANDIDATE", help="RUN@best (@latest, @round-N, @<commit>), or a candidate directory"
    ),
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
    from orchestrator.export import describe, export_project, resolve_candidate

    out_dir(out)
    path, target_ref, source = resolve_candidate(candidate, target)
    exported = export_project(path, target_ref, out, source=source)
    console.print(describe(exported), markup=False, highlight=False, soft_wrap=True)


@command(app, "report")
def report(
    run: Path = RUN_ARGUMENT,
    out: str = typer.Option(
        None,
        help="HTML file to write, or a directory (existing, or ending in /) to put <run>-report.html in "
        "(default: beside RUN)",
    ),
) -> None:
    """Static HTML: metric per round, the search tree, the timeline of best vs baselines, the rounds.

    Example: vibetrain report generated/tiny-qwen3-cpu --out reports/
    """
    from orchestrator.report import write_report

    _state_and_history(run, "report")  # clear errors for a path that is not a run
    name = f"{run.resolve().name}-report.html"
    where = run.resolve().parent / name if out is None else Path(out)  # "." has no parent of its own
    if where.is_dir() or (out is not None and out.endswith("/")):  # Path("reports/") drops the slash that says so
        where = where / name
    if where.is_file() and where.suffix.lower() not in (".html", ".htm"):  # a shell script was replaced so
        raise UsageError(f"--out {out}: {where} is there and is no report (not .html); name another file")
    path = write_report(run, out_file(where, "--out"))
    console.print(f"report: {shown(path)}")
