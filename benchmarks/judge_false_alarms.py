"""Does the judge reject honest stacks, and does it catch the plants? Audited runs of the three
starters on many seeds, of each technique alone on a few, and of each plant of tests/planting.py on a
few, on a real target (the CPU one by default), each audited exactly as a measured run is; then, per
stack, how many were rejected and the smallest false-alarm bound each statistical test reached (a test
rejects under 1e-4) and the largest selection shortfalls and reward shift (against their bounds).

    python benchmarks/judge_false_alarms.py [--target tiny-qwen3-cpu] [--starter-seeds 20]
        [--technique-seeds 5] [--plant-seeds 3] [--out generated/judge-false-alarms] [--sandbox auto]

Every run's audit details are kept in ``OUT/runs.jsonl`` (a rerun skips the runs already there) and
every run's trace and weights under ``OUT/<stack>/<seed>/``, so the tests can be evaluated again on the
recorded traces (``--reaudit``) without running anything.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from skills.starter import write_starter
from targets.harness.environments.seeds import RunSeed
from targets.harness.isolation.launch import Limits
from targets.harness.isolation.sandbox import Sandbox
from targets.harness.judge.audit import audit_directory
from targets.harness.measure.session import Session
from targets.harness.target import Target
from targets.spec import CATALOG_DIR

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the plants are the tests' own
    sys.path.insert(0, str(ROOT))
from tests.planting import PLANTS, plant  # noqa: E402

console = Console()

STARTERS = ("colocate", "static_split", "time_multiplex")
# Each technique alone on the time_multiplex starter (staleness_bound needs a target that opts in). Spares
# keep each group's first finishers: on the CPU target's long-tailed turn counts their members drew about a
# third fewer turns than their groups, over the members' bound, so their rejection is the bound at work.
TECHNIQUES = {
    "redundant_envs": {"redundant_envs": 2},
    "progress_shrink": {"shrink_at": 0.5},
    "abort_stale": {"abort_stale": 1},
    "kv_routing": {"kv_routing": 1},
    "partial_rollout": {"partial_rollout": 1},
    "overlap_sync": {"overlap_sync": 1},
    "tail_batching": {"tail_round": 2},
}
BOUNDS = (
    "sampling_temperature",
    "sampled_ranks",
    "stop_calibration",
    "echo_calibration",
    "independent_samples",
)


def stacks(target: Target, out: Path) -> dict[str, Path]:
    made = {}
    for name in PLANTS:
        made[f"plant:{name}"] = out / "stacks" / f"plant-{name}"
        if not made[f"plant:{name}"].exists():
            spec_file = Path(target.ref) if Path(target.ref).exists() else CATALOG_DIR / f"{target.ref}.yaml"
            plant(name, made[f"plant:{name}"], spec_file)
    for controller in STARTERS:
        made[controller] = out / "stacks" / controller
        if not made[controller].exists():
            write_starter(made[controller], target.spec, controller)
    for name, params in TECHNIQUES.items():
        made[name] = out / "stacks" / name
        if not made[name].exists():
            write_starter(made[name], target.spec, "time_multiplex")
            path = made[name] / "stack" / "params.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), **params}, indent=2))
    return made


def main(
    target_ref: str = typer.Option("tiny-qwen3-cpu", "--target"),
    starter_seeds: int = typer.Option(20, min=1),
    technique_seeds: int = typer.Option(5, min=1),
    plant_seeds: int = typer.Option(3, min=0),
    out: Path = typer.Option(Path("generated/judge-false-alarms")),
    sandbox: str = typer.Option("auto"),
    reaudit: bool = typer.Option(False, help="audit the recorded runs again instead of running"),
) -> None:
    target = Target.load(target_ref)
    out.mkdir(parents=True, exist_ok=True)
    ledger = out / "runs.jsonl"
    lines = ledger.read_text().splitlines() if ledger.exists() else []
    done = {(r["stack"], r["seed"]): r for r in map(json.loads, lines)}
    session = Session(target, Sandbox.detect(sandbox), Limits.of(target, None))
    made = stacks(target, out)

    def seeds(name: str) -> int:
        return starter_seeds if name in STARTERS else plant_seeds if name.startswith("plant:") else technique_seeds

    plan = [(name, seed) for name in made for seed in range(seeds(name))]
    made_now: list[tuple[str, int]] = []
    started = time.monotonic()
    for i, (name, seed) in enumerate(plan, start=1):
        run_dir = out / name.replace(":", "-") / str(seed)
        if reaudit:
            if (name, seed) not in done:
                continue
            # the episodes are judged by their own draws too, as the first audit did (a ledger written
            # before runs recorded their key cannot say what they were drawn from)
            key = done[(name, seed)].get("task_key")
            workload = RunSeed(seed, bytes.fromhex(key)) if key is not None else None
            result = audit_directory(
                target, run_dir, target.spec.workload.train_steps, seed=secrets.randbits(63), workload=workload
            )
            done[(name, seed)].update(passed=result.passed, reasons=result.reasons, details=result.details)
            continue
        if (name, seed) in done:
            continue
        measurement = session.measure(made[name], run_dir, seed)
        audit = next((c for c in measurement.checks if c.name == "system_audit"), None)
        record = {
            "stack": name,
            "seed": seed,
            "passed": measurement.ok,
            "reasons": measurement.reasons,
            "details": audit.details if audit is not None else {},
        }
        done[(name, seed)] = record
        made_now.append((name, seed))
        with ledger.open("a") as f:
            f.write(json.dumps(record) + "\n")
        console.print(
            f"[{i}/{len(plan)}, {time.monotonic() - started:.0f}s] {name} seed {seed}: "
            + ("passed" if measurement.ok else "[red]rejected[/red]: " + "; ".join(measurement.reasons[:2]))
        )
    # What this invocation's runs were drawn from, for a re-audit: written once no candidate runs under it
    # (the ledger sits where a later run's sandbox could read it), as the bench's --json does.
    for made_run in made_now:
        done[made_run]["task_key"] = session.task_key.hex()
    if reaudit or made_now:
        ledger.write_text("".join(json.dumps(r) + "\n" for r in done.values()))
    table = Table(title=f"honest stacks on {target.id}: rejections and the smallest false-alarm bound per test")
    # the audit's selection details: each part's measurements (by prefix) and its bound
    selection = {
        "tasks": "selection_task_bound",
        "members": "selection_member_bound",
        "reward": "selection_reward_bound",
    }
    for column in ("stack", "runs", "rejected", *BOUNDS, *(f"selection: {part} / bound" for part in selection)):
        table.add_column(column.replace("_", " "))
    for name in [*STARTERS, *TECHNIQUES, *(f"plant:{p}" for p in PLANTS)]:
        runs = [r for (stack, _), r in done.items() if stack == name]
        if not runs:
            continue
        row = [name, str(len(runs)), str(sum(not r["passed"] for r in runs))]
        for bound in BOUNDS:
            values = [r["details"].get(f"{bound}_false_alarm_bound") for r in runs]
            values = [v for v in values if v is not None]
            row.append(f"{min(values):.2g}" if values else "-")
        for part, bound in selection.items():  # the largest shortfall (tasks, members) or reward shift
            shifts = [
                (v, r["details"][bound])
                for r in runs
                for k, v in r["details"].items()
                if k.startswith(f"selection_{part}") and not k.endswith("_bound")
            ]
            row.append(f"{max(shifts)[0]:.2f} / {max(shifts)[1]:.2f}" if shifts else "- (nothing dropped)")
        table.add_row(*row)
    console.print(table)
    for record in done.values():
        if not record["passed"] and not record["stack"].startswith("plant:"):
            console.print(f"{record['stack']} seed {record['seed']}: " + "; ".join(record["reasons"][:3]))
    for name in PLANTS:
        runs = [r for (stack, _), r in done.items() if stack == f"plant:{name}"]
        caught = sum(any(PLANTS[name][3] in reason for reason in r["reasons"]) for r in runs)
        console.print(f"plant {name}: caught by '{PLANTS[name][3]}' in {caught} of {len(runs)} runs")


if __name__ == "__main__":
    typer.run(main)
