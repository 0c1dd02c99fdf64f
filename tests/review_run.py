"""A small finished run built without a model (real git commits through ``History``, a real run
state), for the review commands' tests: round 0 the starter (best), round 1 validated but not
promoted (under the noise threshold), round 2 rejected by the judge."""

from __future__ import annotations

import json
from pathlib import Path

from agents.roles import Task
from orchestrator.history import History, Trailers
from orchestrator.state import RoundRecord, RunConfig, new_state

CHECKS = [
    {"name": "integrity", "passed": True, "reasons": [], "details": {"files": 4}},
    {"name": "trainer", "passed": True, "reasons": [], "details": {"relative_update_error": 3.1e-7, "steps": 2}},
    {"name": "system_audit", "passed": True, "reasons": [], "details": {"trained_trajectories": 64}},
]


def run_config(**overrides) -> RunConfig:
    """A tiny-qwen3-cpu run's configuration with the tests' defaults (offline agents, backlog policy)."""
    settings = dict(target="tiny-qwen3-cpu", target_id="tiny-qwen3-cpu", policy="backlog", agents="offline")
    settings.update(seed=0, rounds=1, max_minutes=None, max_attempts=1, repeat=1, starter="colocate")
    return RunConfig(**{**settings, "simulated": False, "sandbox": "auto", **overrides})


def _round(history: History, workspaces: Path, record: RoundRecord, params: dict, judge: dict) -> RoundRecord:
    workspace = history.worktree(workspaces / f"round-{record.round}", record.parent_commit)
    (workspace / "stack").mkdir(exist_ok=True)
    (workspace / "stack" / "params.json").write_text(json.dumps(params, indent=1) + "\n")
    (workspace / "DESIGN.md").write_text(f"# design\n\nround {record.round}\n")
    trailers = Trailers(record.round, record.task.id, "offline", record.verdict, "goodput=1", "none")
    records = {"judge.json": judge, "round.json": record.model_dump(mode="json")}
    commit = (history.commit_validated if record.verdict == "accepted" else history.commit_rejected)(
        workspace, record.round, record.task.title, trailers, records
    )
    history.remove_worktree(workspace)
    return record.model_copy(update={"commit": commit})


def make_review_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    history = History.create(run, "vibetrain run: review test")
    config = run_config(rounds=2, repeat=3, sandbox="subprocess")
    state = new_state(config)
    state.spec_at_start = {"headline_metric": {"name": "goodput", "direction": "maximize"}}  # what log reads of it
    passed = {"reasons": [], "checks": CHECKS}
    starter = Task(id="starter", title="starter stack (colocate)", rationale="round 0", source="starter")
    r0 = RoundRecord(round=0, task=starter, parent_round=None, parent_commit=history.root(), verdict="accepted")
    r0 = r0.model_copy(update={"headline": 42.5, "metrics": {"goodput": 42.5}, "spread": {"goodput": 3.0}})
    r0 = _round(
        history, tmp_path / "ws", r0.model_copy(update={"became_best": True}), {"controller": "colocate"}, passed
    )
    history.set_best(r0.commit)
    switch = Task(
        id="controller=time_multiplex", title="switch to time_multiplex", rationale="rollout stalls", source="x"
    )
    r1 = RoundRecord(
        round=1,
        task=switch,
        parent_round=0,
        parent_commit=r0.commit,
        verdict="accepted",
        headline=43.5,
        parent_headline=42.5,
        metrics={"goodput": 43.5, "step_time_s": 2.5},
        spread={"goodput": 6.57},
        hints=[{"code": "rollout_stalls", "message": "no rollout in flight for 38% of the step"}],
        paired={"ratio": 1.024, "low": 0.97, "high": 1.08, "pairs": 3, "against": "round 0", "threshold": 0.05},
        account="set controller to time_multiplex in stack/params.json",
    )
    r1 = _round(history, tmp_path / "ws", r1, {"controller": "time_multiplex"}, passed)
    # an agent's text is text: a title holding what rich reads as markup must print as written
    hack = Task(id="skip-train", title="skip training of [/bold] long [red]episodes", rationale="faster", source="y")
    failed = {
        "reasons": ["system_audit: 12 trajectories counted as trained were never trained"],
        "checks": [
            *CHECKS[:2],
            {"name": "system_audit", "passed": False, "reasons": ["12 never trained"], "details": {}},
        ],
    }
    r2 = RoundRecord(
        round=2,
        task=hack,
        parent_round=0,
        parent_commit=r0.commit,
        verdict="rejected",
        parent_headline=42.5,
        reasons=failed["reasons"],
    )
    r2 = _round(history, tmp_path / "ws", r2, {"controller": "colocate", "drop_long": True}, failed)
    state.rounds, state.best_round = [r0, r1, r2], 0
    state.save(run)
    return run
