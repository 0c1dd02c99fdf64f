"""How much shorter, or better rewarded, what a stack trains is than what it launched: the selection net
of the audit (``targets/harness/judge/selection_net.py``) read from recorded runs, against its bounds. Runs
the given stacks on a target for the given seeds (traces kept under ``OUT/<stack>/<seed>/``; a rerun
skips those already there), or reads runs already recorded (a search's generalization runs,
say), and prints per run the tasks' and members' shortfall in turns and response tokens and the reward
shift, then per stack the range of each.

    python benchmarks/judge_selection.py --target qwen3-235b-a22b-h800x160 --seeds 0-9 \\
        --stack time_multiplex --stack spares4=time_multiplex:redundant_envs=4 --stack best=PATH
    python benchmarks/judge_selection.py RUN/.git/vibetrain/generalization/runs/*/*

A stack is ``NAME=CONTROLLER[:PARAM=VALUE,...]`` (a starter with its params.json changed), ``NAME=PATH``
(a stack directory), or a starter's name alone.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from skills.starter import write_starter
from targets.harness.judge.selection_net import check_selection
from targets.harness.judge.service_order import check_service_order
from targets.harness.judge.trace_index import Reasons, TraceIndex
from targets.harness.measure.session import Session
from targets.harness.target import Target
from targets.harness.trace import Trace
from targets.spec import TargetSpec

console = Console()

# by the harness's own draws: only the run's audit had the run's secret key
DRAWN = (
    "selection_tasks_drawn_tokens_a_turn",
    "selection_tasks_drawn_turns",
    "selection_tasks_drawn_response_tokens",
    "selection_members_drawn_turns",
    "selection_members_drawn_response_tokens",
)

PARTS = (  # column, the audit's detail, the bound it is held to
    ("tasks: turns", "selection_tasks_turns", "selection_task_bound"),
    ("tasks: response tokens", "selection_tasks_response_tokens", "selection_task_bound"),
    ("tasks: drawn tokens a turn", DRAWN[0], "selection_task_bound"),
    ("tasks: drawn turns", DRAWN[1], "selection_task_bound"),
    ("tasks: drawn tokens", DRAWN[2], "selection_task_bound"),
    ("members: turns", "selection_members_turns", "selection_member_bound"),
    ("members: response tokens", "selection_members_response_tokens", "selection_member_bound"),
    ("members: drawn turns", DRAWN[3], "selection_member_bound"),
    ("members: drawn tokens", DRAWN[4], "selection_member_bound"),
    ("reward (SD)", "selection_reward", "selection_reward_bound"),
)

COUNTS = (  # row, the figure: groups the stack left untrained that the net counts whole; the most held episode
    ("groups passed over", "selection_groups_passed_over"),
    ("groups held", "selection_groups_held"),
    ("most held: share of serving", "held_share"),
    ("most held: seconds", "held_s"),
    ("order of service: requests witnessed", "service_order_witnessed"),  # real runs
    ("order of service: least margin (tokens)", "service_order_least_margin"),
)


def parse_seeds(text: str) -> list[int]:
    """``0-9`` or ``0,3,5``."""
    if "-" in text:
        first, last = text.split("-", 1)
        return list(range(int(first), int(last) + 1))
    return [int(s) for s in text.split(",")]


def make_stack(spec: TargetSpec, text: str, stacks: Path) -> tuple[str, Path]:
    """A stack directory for ``NAME=CONTROLLER[:PARAM=VALUE,...]``, ``NAME=PATH`` or a starter's name."""
    name, _, how = text.partition("=")
    how = how or name
    directory = stacks / name
    if Path(how).is_dir():
        if not directory.exists():
            shutil.copytree(how, directory)
        return name, directory
    controller, _, assignments = how.partition(":")
    if not directory.exists():
        write_starter(directory, spec, controller)
        path = directory / "stack" / "params.json"
        params = json.loads(path.read_text())
        for assignment in filter(None, assignments.split(",")):
            key, _, value = assignment.partition("=")
            if key not in params:
                raise typer.BadParameter(f"{text}: the {controller} starter has no parameter {key!r}")
            params[key] = json.loads(value)
        path.write_text(json.dumps(params, indent=2))
    return name, directory


def selection_of(spec: TargetSpec, run: Path) -> dict:
    """The selection net's details on a recorded run, and its reasons. The parts by the harness's own
    draws need the run's secret key, which only its audit had: those figures are the ones its audit
    recorded."""
    reasons = Reasons()
    events = Trace.load_events(run / "trace.jsonl")
    ix = TraceIndex.of(events)
    details = {**check_selection(ix, reasons, spec), **check_service_order(ix, reasons)}
    lines = reasons.lines()
    held = [e.data for e in events if e.kind == "sample_dropped" and "held_s" in e.data]
    if held:  # recorded since the controller link counts it
        details["held_s"] = max(d["held_s"] for d in held)
        details["held_share"] = max(d["held_s"] / d["serving_s"] if d["serving_s"] else 0.0 for d in held)
    audit = run / "audit.json"
    if audit.exists():
        recorded = json.loads(audit.read_text()).get("result", {})
        drawn = dict(recorded.get("details", {}))
        if DRAWN[0] not in drawn and DRAWN[2] in drawn:  # audited before the tasks were judged by their members'
            drawn[DRAWN[0]] = drawn.pop(DRAWN[2])  # draws: its tasks' draw was their tokens a turn
        details.update({k: v for k, v in drawn.items() if k in DRAWN})
        lines += [x for x in recorded.get("reasons", []) if "shorter in drawn" in x]
    return {**details, "reasons": lines}


def main(
    target_ref: str = typer.Option("qwen3-235b-a22b-h800x160", "--target"),
    stack: list[str] = typer.Option([], help="NAME=CONTROLLER[:PARAM=VALUE,...], NAME=PATH, or a starter"),
    seeds: str = typer.Option("0-1", help="0-9 or 0,3,5"),
    runs: list[Path] = typer.Argument(None, help="recorded run directories (each with its trace.jsonl) to read"),
    out: Path = typer.Option(Path("generated/judge-selection")),
    sandbox: str = typer.Option("auto"),
    task_key: str = typer.Option(None, help="the workload's secret in hex ('' the public derivation); default: drawn"),
) -> None:
    target = Target.load(target_ref)
    measured: dict[str, list[tuple[str, dict]]] = {}
    for run in runs or []:
        if not (run / "trace.jsonl").exists():
            raise typer.BadParameter(f"{run} has no trace.jsonl")
        # OUT/<stack>/<seed> reads as <stack>, a search's held-out/candidate-2 as held-out/candidate
        group = run.parent.name if run.name.isdigit() else f"{run.parent.name}/{run.name.rstrip('-0123456789')}"
        measured.setdefault(group, []).append((str(run), selection_of(target.spec, run)))
    session = Session.open(target, sandbox=sandbox) if stack else None
    if session is not None and task_key is not None:
        session = dataclasses.replace(session, task_key=bytes.fromhex(task_key))
    for text in stack:
        name, directory = make_stack(target.spec, text, out / "stacks")
        for seed in parse_seeds(seeds):
            run = out / name / str(seed)
            if not (run / "trace.jsonl").exists():
                measurement = session.measure(directory, run, seed)
                console.print(
                    f"{name} seed {seed}: " + ("passed" if measurement.ok else "; ".join(measurement.reasons[:2]))
                )
            measured.setdefault(name, []).append((f"{name} seed {seed}", selection_of(target.spec, run)))
    table = Table(
        title=f"selection on {target.id}: what trained against what was launched (shortfall: a fraction of the mean)"
    )
    table.add_column("part / bound")
    for name in measured:
        table.add_column(name)
    table.add_row(
        "runs (rejected)", *(f"{len(rs)} ({sum(bool(r['reasons']) for _, r in rs)})" for rs in measured.values())
    )
    for part, key, bound in PARTS:
        row = [part]
        for results in measured.values():
            values = [r[key] for _, r in results if key in r]
            row.append(f"{min(values):.3f} to {max(values):.3f} / {results[0][1][bound]:.2f}" if values else "-")
        table.add_row(*row)
    for part, key in COUNTS:
        row = [part]
        for results in measured.values():
            values = [r[key] for _, r in results if r.get(key) is not None]
            row.append(f"{min(values):.3g} to {max(values):.3g}" if values else "-")
        table.add_row(*row)
    console.print(table)
    for results in measured.values():
        for where, r in results:
            for reason in r["reasons"]:
                console.print(f"{where}: {reason}")


if __name__ == "__main__":
    typer.run(main)
