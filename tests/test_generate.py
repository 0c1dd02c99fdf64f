"""The outer loop end to end with offline agents: rounds commit real candidates to git with their
trailers, the best one beats the starter, a planted cheat is rejected and kept under its ref, a
SIGKILLed run resumes with nothing lost or done twice, a target written from scratch works, the
production-scale target runs on the simulator, and bad input gets a clear error."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import git
import pytest
import yaml
from typer.testing import CliRunner

from agents import workspace_git
from orchestrator.cli import app
from orchestrator.generalization import PERTURBATION, round_seeds
from orchestrator.history import History, HistoryError
from orchestrator.run_dir import RunDir
from orchestrator.runs import resume_run, run_workspaces
from orchestrator.state import RunState, RunStateError
from targets.harness.measure.metrics import compute_metrics
from targets.harness.measure.run_metrics import run_metrics
from targets.harness.trace import Trace
from targets.spec import load_target

runner = CliRunner()
ENV = {"COLUMNS": "120"}


def _generate(*args: str) -> str:
    result = runner.invoke(app, ["generate", *args], env=ENV)
    assert result.exit_code == 0, result.output
    return result.output


def _trailers(run: Path, ref: str = "best") -> str:
    return git.Repo(run).git.log("--format=%s%n%(trailers)", ref)


# -- the main job on a real target -------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_step_target(fast_target, tmp_path_factory) -> Path:
    """The fast target training two steps: a real round's commit, pair, twin prediction and screen
    need real runs, not four steps of them."""
    data = yaml.safe_load(fast_target.read_text())
    data["id"] += "-2"
    data["workload"]["train_steps"] = 2
    path = tmp_path_factory.mktemp("target") / "two-steps.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _start(target: Path, tmp_path: Path, **options):
    """A run started through the API (not the CLI) with the tests' settings: offline agents, one
    measured pair per candidate, round 0 the colocate starter, no held-out measurement after the last
    round (the production-scale test measures that)."""
    from orchestrator.config import RunConfig
    from orchestrator.runs import start_run

    settings = dict(rounds=1, policy="backlog", agents="offline", seed=0, max_minutes=None, max_attempts=2)
    settings.update(repeat=1, starter="colocate", sandbox="auto", time_limit_s=300, held_out=0)
    simulate = options.pop("simulate", False)
    config = RunConfig(**{**settings, **options})
    on_event = lambda kind, **data: None  # noqa: E731
    return start_run(str(target), tmp_path / "run", config, on_event, tmp_path / "ws", simulate=simulate)


@pytest.mark.slow
def test_generate_commits_validated_candidates_paired_with_the_best(tmp_path, two_step_target, shared_ray):
    """One measured pair per round on a real target says nothing of noise: round 1 is validated and
    committed, paired against the starter, and not promoted, with the interval that says why. (In the
    subprocess sandbox, on the test session's shared Ray cluster: the default sandbox's real check is
    tests/test_isolation.py's bubblewrap run; a simulated generate in it, below.)"""
    run = tmp_path / "run"
    output = _generate(
        str(two_step_target),
        *("--rounds", "1", "--repeat", "1", "--prescreen-margin", "1"),  # the twin predicts; nothing screened out
        *("--out", str(run), "--workspaces", str(tmp_path / "ws"), "--sandbox", "subprocess"),
    )
    state = RunState.load(run)
    assert [r.round for r in state.rounds] == [0, 1]
    assert len(state.accepted()) == 2, [(r.round, r.verdict, r.reasons) for r in state.rounds]
    candidate, best = state.record(1), state.best
    assert best.round == 0 and candidate.paired is not None and candidate.paired.pairs == 1
    assert "the starter" in output and "best: round" in output
    # the commit graph is the search tree, with trailers
    log = _trailers(run, "refs/vibetrain/rounds/1")
    assert "Round 1: " in log and "Agent-Backend: offline" in log and "Verdict: accepted" in log
    assert "Headline-Metric: goodput=" in log and "Parent-Metric: goodput=" in log
    promotion = r"Promotion: not promoted: [+-]\d+\.\d% \[unbounded: 1 pair\] of [\d.]+, needs low > \+\d+%"
    assert re.search(promotion, log), log  # 'of': the best's headline on the pair's seed
    body = git.Repo(run).git.log("-1", "--format=%B", "refs/vibetrain/rounds/1")
    assert re.search(r"not promoted: [+-]\d+(\.\d)?%", body) and "interval unbounded" in body, body
    assert f"Implementer: {candidate.account}" in body and candidate.account  # the implementer's own account
    # the twin, calibrated to round 0's real trace, predicted round 1 before it ran for real; then
    # it was fitted again to both rounds' traces
    twin = yaml.safe_load(Path(state.twin).read_text())
    assert state.config.prescreen and twin["simulator"] and twin["hardware"]["mfu"] > 0
    assert state.twin_from == [0, 1] and state.twin_predictions == {}  # predictions of the old twin dropped
    prediction = candidate.prediction
    assert prediction.passed and prediction.best_round == 0 and 0 < prediction.best
    assert f"Twin: predicted goodput {prediction.headline:.4g}" in body and f"measured {candidate.headline:.4g}" in body
    if prediction.untrusted is not None:  # the colocate starter never syncs: the twin's sync cost was a guess
        assert "(sync)" in prediction.untrusted and "not trusted: " in body
    for record in state.accepted():
        commit = git.Repo(run).commit(record.commit)
        parent = commit.parents[0].hexsha
        assert parent == record.parent_commit  # each candidate's parent is the one it was derived from
    design = (run / "DESIGN.md").read_text()
    assert "## Plan" in design and "[DONE]" in design and f"Round {best.round}:" in design
    assert f"Change: {state.record(0).account}" in design
    # review commands
    log_output = runner.invoke(app, ["log", str(run)], env=ENV).output
    assert "accepted (best)" in log_output and "starter stack (colocate)" in log_output
    show = runner.invoke(app, ["show", str(run), "1"], env=ENV).output
    assert "stack/params.json" in show and "rollout_throughput" in show and "not promoted" in show
    assert "Twin: predicted goodput" in show
    assert "pass system_audit" in show and "pass trainer: relative_update_error" in show  # why it was trusted
    assert ".vibetrain/round.json" not in show  # the stack's change, not the bookkeeping
    report = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "r.html")], env=ENV)
    assert report.exit_code == 0 and (tmp_path / "r.html").stat().st_size > 20_000
    # the best candidate, benchmarked straight from the run's history against the starter's baseline
    # (simulated: a real bench and its provenance are tests/test_stack_kit.py's)
    bench = runner.invoke(
        app,
        ["bench", str(two_step_target), "--simulate", "--baselines", "colocate", "--stack", f"{run}@best"]
        + ["--repeat", "1", "--json", str(tmp_path / "b.json")],
        env=ENV,
    )
    assert bench.exit_code == 0, bench.output
    data = json.loads((tmp_path / "b.json").read_text())
    assert [r["name"] for r in data["runs"]] == ["colocate", "run@best"]
    assert data["provenance"]["execution"] == "simulated"


@pytest.mark.slow
def test_a_candidate_the_twin_predicts_far_behind_the_best_is_screened_out_unjudged(
    tmp_path, two_step_target, shared_ray
):
    """The twin (here the target's own uncalibrated simulation: static_split about 8.4 goodput, colocate 4.8)
    stops a switch to colocate before the real judge; it is kept as prescreened, never validated. A
    switch to time_multiplex, which shrinks where no real run has shrunk, is judged for real (in the
    subprocess sandbox, on the test session's shared Ray cluster)."""
    from agents.roles import Task
    from skills.starter import starter_params
    from targets.spec import load_target

    run = tmp_path / "run"
    loop = _start(two_step_target, tmp_path, starter="static_split", rounds=2, sandbox="subprocess")
    twin = RunDir(run).twin_spec  # the target itself stands in for the calibrated one: deterministic predictions
    twin.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(two_step_target, twin)
    loop.state.twin = str(twin)
    loop.state.twin_from = [0]  # as a twin fitted to round 0, which never shrinks:
    loop.state.twin_unfitted = ["shrink", "expand"]
    spec = load_target(str(two_step_target))

    def switch(controller: str, rationale: str, priority: int) -> Task:
        return Task(
            id=f"controller={controller}",
            title=f"switch the controller to {controller}",
            rationale=rationale,
            skills=[controller],
            changes=starter_params(spec, controller),
            priority=priority,
        )

    loop.state.backlog = [  # before anything round 0's hints add
        switch("colocate", "a move the twin predicts far behind", 100),
        switch("time_multiplex", "it shrinks: the twin's cost for that is a guess", 99),
    ]
    state = loop.run()
    judged = state.record(2)  # whatever the twin predicted for it: its shrinks cost what the spec guesses
    assert judged.verdict == "accepted" and judged.headline is not None, (judged.verdict, judged.reasons)
    assert judged.prediction.passed and "expand, shrink" in judged.prediction.untrusted
    record = state.record(1)
    assert record.verdict == "prescreened" and record.attempts == 1, (record.verdict, record.reasons)
    prediction = record.prediction
    assert not prediction.passed and prediction.headline < 0.95 * prediction.best
    assert record.headline is None and record.commit and "twin_prescreen: predicted goodput" in record.reasons[0]
    history = History.open(run)
    assert history.round_commit(1) is None and history.rejected_commit(1) == record.commit  # never validated
    message = history.repo.commit(record.commit).message  # why, in git log too, with the prediction
    assert "Verdict: prescreened" in message and "\nPrescreened: twin_prescreen: predicted goodput" in message
    assert "\nTwin: predicted goodput" in message and "; not measured" in message, message
    assert state.best_round == 0 and "controller=colocate" in state.abandoned()
    show = runner.invoke(app, ["show", str(run), "1"], env=ENV).output
    assert "prescreened:" in show and "not measured" in show


# -- rejection: a planted cheat is caught, kept under its ref, and the run goes on ----------------


@pytest.mark.slow
def test_a_planted_cheat_is_rejected_kept_and_listed(tmp_path, fast_target, monkeypatch):
    from agents.offline.implementer import OfflineImplementer
    from agents.offline.judge import OfflineJudge

    original = OfflineImplementer.implement

    def cheating(self, task, workspace, feedback, hints=(), context=None):  # every later round reports its own metrics
        attempt = original(self, task, workspace, feedback, hints)
        if task.source == "starter":
            return attempt
        (workspace / "stack" / "report.py").write_text("def report(n, s):\n    return {'rollout_throughput': n / s}\n")
        return attempt

    judged, judge = [], OfflineJudge.judge

    def counted(self, workspace, out, task=None, seed=0, context=None):
        judged.append(int(out.parent.name.removeprefix("round-")))
        return judge(self, workspace, out, task, seed, context)

    run = tmp_path / "run"
    monkeypatch.setattr(OfflineImplementer, "implement", cheating)
    monkeypatch.setattr(OfflineJudge, "judge", counted)
    state = _start(fast_target, tmp_path, rounds=2, simulate=True, sandbox="subprocess").run()
    rejected = [r for r in state.rounds if r.verdict == "rejected"]
    assert [r.round for r in rejected] == [1, 2] and rejected[0].attempts == 2
    assert any("names the harness metric 'rollout_throughput'" in reason for reason in rejected[0].reasons)
    # the offline implementer's repair (the library's recipes) cannot remove a module of the stack's own:
    # its second attempt said so, and the same candidate was not judged again
    assert judged == [0, 1, 2], judged
    assert "attempt 1's verdict stands" in rejected[0].reasons[-1]  # what log and show say of attempt 2
    history = History.open(run)
    commit = history.rejected_commit(1)
    assert commit and "Verdict: rejected" in history.repo.commit(commit).message
    assert f"\nRejected: {rejected[0].reasons[0]}" in history.repo.commit(commit).message  # why, in git log
    assert any("rollout_throughput" in r for r in history.record(commit, "judge.json")["reasons"])
    design = history.repo.git.show(f"{commit}:DESIGN.md")
    assert "[ABANDONED]" in design and "round 1 rejected" in design
    log_output = runner.invoke(app, ["log", str(run)], env=ENV).output
    assert "rejected" in log_output and "integrity" in log_output
    assert state.best_round == 0  # the starter stays best; nothing rejected ever became a candidate


def test_each_attempt_is_judged_on_a_workload_of_its_own_and_pair_0_is_the_passing_ones(
    tmp_path, fast_target, monkeypatch
):
    """Every attempt of a round was judged on the round's first seed: an attempt's controller could raise
    with what it saw of the workload (the reasons reach the next attempt's prompt) and the next schedule it
    with foresight, measured as pair 0 (a review of the judge). Each attempt has a seed of its own now, and
    the attempt that passed opens pair 0 on its own."""
    from agents.offline.evaluator import OfflineEvaluator
    from agents.offline.implementer import OfflineImplementer
    from agents.offline.judge import OfflineJudge
    from agents.roles import Verdict
    from orchestrator.generalization import attempt_seed, round_seeds

    implement, judge, evaluate = OfflineImplementer.implement, OfflineJudge.judge, OfflineEvaluator.evaluate

    def again(self, task, workspace, feedback, hints=(), context=None):  # no repair: the candidate judged again
        return implement(self, task, workspace, [], hints)

    judged, measured = {}, []

    def first_attempt_fails(self, workspace, out, task=None, seed=0, context=None):
        judged[(out.parent.name, out.name)] = seed
        if (out.parent.name, out.name) == ("round-1", "judge-1"):
            return Verdict.refused("planted", ["attempt 1 fails, whatever it is"])
        return judge(self, workspace, out, task, seed, context)

    def recorded(self, workspace, out, baseline, seeds, first=None):
        measured.append((list(seeds), first))
        return evaluate(self, workspace, out, baseline, seeds, first)

    monkeypatch.setattr(OfflineImplementer, "implement", again)
    monkeypatch.setattr(OfflineJudge, "judge", first_attempt_fails)
    monkeypatch.setattr(OfflineEvaluator, "evaluate", recorded)
    state = _start(fast_target, tmp_path, rounds=1, simulate=True, sandbox="subprocess", repeat=2).run()
    assert state.rounds[1].attempts == 2 and state.rounds[1].verdict == "accepted", state.rounds[1].reasons
    first, second = judged[("round-1", "judge-1")], judged[("round-1", "judge-2")]
    assert first == round_seeds(0, 1, 2)[0] and second == attempt_seed(0, 1, 2) != first
    seeds, run = measured[-1]
    assert seeds == [second, round_seeds(0, 1, 2)[1]] and run is not None  # pair 0: the judged run, its seed


@pytest.mark.slow
def test_a_process_the_agent_left_running_changes_nothing_judged_or_committed(tmp_path, fast_target, monkeypatch):
    """The implementer returns while a detached process of its own goes on writing in its workspace
    (a command under setsid, a container past its timeout): the round judges, measures and commits
    the candidate as the agent left it. On the old flow (the workspace judged and committed) the late
    write landed in the commit."""
    from agents.offline.implementer import OfflineImplementer
    from orchestrator.rounds import Loop

    original, freeze = OfflineImplementer.implement, Loop.freeze
    frozen, written = tmp_path / "frozen", tmp_path / "late-write-done"

    def lingering(self, task, workspace, feedback, hints=(), context=None):
        attempt = original(self, task, workspace, feedback, hints)
        if task.source == "starter":
            return attempt
        target = workspace / "stack" / "__init__.py"
        script = (  # writes once the round has copied the candidate (a sleep raced the copy on a loaded machine)
            f"import pathlib, time\nwhile not pathlib.Path({str(frozen)!r}).exists(): time.sleep(0.05)\n"
            f"p = pathlib.Path({str(target)!r}); p.write_text(p.read_text() + 'LATE = True\\n')\n"
            f"pathlib.Path({str(written)!r}).touch()"
        )
        subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
        return attempt

    def copied(self, workspace, record):
        result = freeze(self, workspace, record)
        if record.round == 1:
            frozen.touch()
        return result

    monkeypatch.setattr(OfflineImplementer, "implement", lingering)
    monkeypatch.setattr(Loop, "freeze", copied)
    # the subprocess sandbox (its candidates start warm): the late write is in the workspace, whatever the sandbox
    state = _start(fast_target, tmp_path, rounds=1, simulate=True, sandbox="subprocess").run()
    deadline = time.monotonic() + 10
    while not written.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert written.exists(), "the late write never happened: the test shows nothing"
    record = state.rounds[1]
    assert record.commit, record.reasons
    assert "LATE" not in History.open(tmp_path / "run").read(record.commit, "stack/__init__.py")


def test_a_candidate_git_could_not_commit_for_a_full_disk_stops_the_run_and_is_redone(
    tmp_path, fast_target, monkeypatch
):
    """git's "No space left on device" came as its own error, not an OSError: the validated round 1 was
    recorded as an error, its candidate lost, and the run went on (exit 0). It stops the run now, records
    nothing of round 1, and a resume redoes it."""
    from agents.workspace_git import GitFailed
    from orchestrator.rounds import RunError
    from orchestrator.runs import resume_run

    def full(self, workspace, number, *args, **kwargs):
        raise GitFailed("fatal: unable to write loose object file: No space left on device")

    original = History.commit_validated
    monkeypatch.setattr(
        History,
        "commit_validated",
        lambda self, ws, number, *a, **k: (
            full(self, ws, number) if number == 1 else original(self, ws, number, *a, **k)
        ),
    )
    with pytest.raises(RunError, match="disk full during round 1: every validated candidate is committed"):
        _start(fast_target, tmp_path, rounds=1, simulate=True, sandbox="subprocess").run()
    assert [r.round for r in RunState.load(tmp_path / "run").rounds] == [0]
    monkeypatch.setattr(History, "commit_validated", original)
    state = resume_run(tmp_path / "run", {}, lambda kind, **data: None, tmp_path / "ws").run()
    assert [(r.round, r.verdict) for r in state.rounds] == [(0, "accepted"), (1, "accepted")]


def test_a_disk_gone_read_only_stops_the_run_and_the_round_is_redone(tmp_path, fast_target, monkeypatch):
    """A copy the disk refused for being read-only (or failing) was recorded as the round's error, and the run
    went on to meet it again every round; like a full disk, it stops the run, the round unrecorded."""
    import errno

    from orchestrator.rounds import Loop, RunError

    freeze = Loop.freeze

    def read_only(self, workspace, record):
        if record.round == 1:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(workspace))
        return freeze(self, workspace, record)

    monkeypatch.setattr(Loop, "freeze", read_only)
    with pytest.raises(RunError, match="round 1 stopped: the run's disk failed .*Read-only file system"):
        _start(fast_target, tmp_path, rounds=1, simulate=True, sandbox="subprocess").run()
    assert [r.round for r in RunState.load(tmp_path / "run").rounds] == [0]


def test_a_round_committed_whose_ref_git_refused_stops_the_run_and_the_resume_records_it(
    tmp_path, fast_target, monkeypatch
):
    """A ref git would not write after the commit (a lock another git holds, a failing disk): the round was
    recorded as an error and its worktree, the only thing holding the accepted commit, removed. Now the run
    stops with the worktree kept, and a resume records the round from that commit."""
    from orchestrator.rounds import RunError
    from orchestrator.runs import resume_run

    refused: list[str] = []

    def update_ref(self, *args, **kwargs):
        if args and args[0] == "refs/vibetrain/rounds/1":
            refused.append(args[1])
            raise git.GitCommandError(["git", "update-ref", *args], 128, b"fatal: cannot lock ref: File exists")
        return self._call_process("update_ref", *args, **kwargs)

    monkeypatch.setattr(git.Git, "update_ref", update_ref, raising=False)
    with pytest.raises(RunError, match="round 1 is committed .* could not write its ref .* cannot lock ref"):
        _start(fast_target, tmp_path, rounds=1, simulate=True, sandbox="subprocess").run()
    monkeypatch.undo()
    assert [r.round for r in RunState.load(tmp_path / "run").rounds] == [0] and len(refused) == 1
    state = resume_run(tmp_path / "run", {}, lambda kind, **data: None, tmp_path / "ws").run()
    assert [(r.round, r.verdict) for r in state.rounds][:2] == [(0, "accepted"), (1, "accepted")]
    assert state.rounds[1].commit == refused[0]


def test_a_best_branch_moved_by_hand_is_refused_on_resume(tmp_path, fast_target):
    """A commit of the user's on ``best`` was built on unsaid (and a later promotion's reset would have
    dropped it); ``export @best`` and the state disagreed. The resume names it and how to put it back."""
    from orchestrator.rounds import RunError
    from orchestrator.runs import resume_run

    _start(fast_target, tmp_path, rounds=0, simulate=True, sandbox="subprocess").run()
    run = tmp_path / "run"
    git.Repo(run).git.commit("--allow-empty", "-q", "-m", "my own change")
    loop = resume_run(run, {"rounds": 1}, lambda kind, **data: None, tmp_path / "ws")
    with pytest.raises(RunError, match="its best branch is at .* not at round 0's commit .* moved or committed on"):
        loop.run()
    assert [r.round for r in RunState.load(run).rounds] == [0]


def test_an_interrupted_generate_says_what_was_kept_and_how_to_go_on(tmp_path, fast_target, monkeypatch):
    """Ctrl-C (or SIGTERM) ended generate with no word: every other stop says that the validated candidates
    are committed and how to resume."""
    from orchestrator.rounds import Loop

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Loop, "run", interrupted)
    out = tmp_path / "run"
    result = runner.invoke(app, ["generate", str(fast_target), "--simulate", "--out", str(out)], env=ENV)
    said = " ".join(result.output.split())
    assert result.exit_code != 0 and "interrupted in round 0 (redone on resume, unless" in said, result.output
    assert f"--resume --out {out}" in said


def test_starter_params_are_round_0s_and_every_later_rounds(tmp_path, fast_target):
    """The GPU script's generate built its starter with the default engine even where the card failed
    that engine's test (the check's stack had the fallback's options): ``--starter-param`` sets them in
    round 0's params.json, later rounds inherit them, and a resume keeps them."""
    run = tmp_path / "run"
    given = ("--starter-param", "attention=sdpa", "--starter-param", "fused_kernels=false")
    _generate(
        str(fast_target),
        *given,
        *("--simulate", "--rounds", "1", "--repeat", "1", "--held-out", "0", "--sandbox", "subprocess"),
        *("--out", str(run), "--workspaces", str(tmp_path / "ws")),
    )
    state, history = RunState.load(run), History.open(run)
    assert state.config.starter_params == {"attention": "sdpa", "fused_kernels": False}
    assert state.record(0).task.title == 'starter stack (colocate, with attention="sdpa", fused_kernels=false)'
    assert len(state.rounds) == 2
    for record in state.rounds:
        params = json.loads(history.read(record.commit or history.rejected_commit(record.round), "stack/params.json"))
        assert (params["attention"], params["fused_kernels"]) == ("sdpa", False), (record.round, params)
    printed = yaml.safe_load(_generate(str(fast_target), "--out", str(run), "--resume", "--print-config"))
    assert printed["starter_param"] == ['attention="sdpa"', "fused_kernels=false"]  # as --config reads them back
    changed = runner.invoke(
        app, ["generate", str(fast_target), "--out", str(run), "--resume", "--starter-param", "attention=triton"]
    )
    assert changed.exit_code == 2 and "cannot change: --starter-param" in changed.output, changed.output


# -- SIGKILL mid-round, then --resume, on a target written from scratch ----------------------------

SCRATCH_TARGET = """
id: scratch-guess
description: written from scratch for the tests; guess_number on a small dense model, 2 CPU devices
headline_metric: {name: goodput, direction: maximize}
noise_threshold: 0.05
model:
  family: qwen3
  weights: random(7)
  config: {vocab_size: 64, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 1,
           num_attention_heads: 1, num_key_value_heads: 1, head_dim: 64, tie_word_embeddings: true}
hardware: {kind: cpu, count: 2}
workload:
  environment: {name: guess_number}
  turns: {max: 4}
  tokens: {prompt: 8, observation: 8, response: 4, max_sequence: 64}
  env_latency_s: {kind: lognormal, median: 0.01, sigma: 1.0}
  env_latency_max_s: 0.2
  trajectory_timeout_s: 20
  batch_size: 8
  group_size: 2
  async_ratio: 1
  train_steps: 3
execution: real
baselines:
  - {name: colocate}
  - {name: static_split, rollout_devices: 1, train_devices: 1}
"""


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "generate", *args],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **ENV},
    )


@pytest.mark.slow
def test_a_sigkilled_run_resumes_with_every_validated_commit_and_no_round_twice(tmp_path):
    target = tmp_path / "scratch.yaml"
    target.write_text(SCRATCH_TARGET)
    run, ws = tmp_path / "run", tmp_path / "ws"
    args = [str(target), "--rounds", "2", "--out", str(run), "--workspaces", str(ws), "--repeat", "1", "--simulate"]
    args += ["--held-out", "0"]  # what generate measures after its last round: tests/test_generate.py's big target
    args += ["--sandbox", "subprocess"]  # its candidate processes start warm
    process = _spawn(args, tmp_path / "first.log")
    deadline = time.monotonic() + 400
    judged = run_workspaces(ws, run) / "round-2-judged"  # its exact path: round 1's worktrees go meanwhile
    while not judged.exists():  # round 2 is under way (rounds 0 and 1 done): its candidate is being judged
        assert process.poll() is None, (tmp_path / "first.log").read_text()
        assert time.monotonic() < deadline, "round 2 never reached its judge"
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    history = History.open(run)
    before = {n: history.round_commit(n) for n in (0, 1)}
    assert all(before.values()), (before, (tmp_path / "first.log").read_text())

    result = runner.invoke(app, ["generate", str(tmp_path / "elsewhere.yaml"), "--resume", "--out", str(run)], env=ENV)
    assert result.exit_code == 2 and "not found" in result.output
    result = runner.invoke(
        app, ["generate", str(target), "--resume", "--out", str(run), "--workspaces", str(ws)], env=ENV
    )
    assert result.exit_code == 0, result.output
    state = RunState.load(run)
    assert [r.round for r in state.rounds] == [0, 1, 2]  # no round twice
    assert {n: History.open(run).round_commit(n) for n in (0, 1)} == before  # every validated commit intact
    refs = git.Repo(run).git.for_each_ref("--format=%(refname)", "refs/vibetrain/").split()
    assert len(refs) == len(set(refs)) == 3
    assert state.best is not None and History.open(run).best() == state.best.commit

    # killed between the commit and the state write: the round is taken from git, not redone
    data = json.loads((run / ".git" / "run_state.json").read_text())
    data["rounds"] = data["rounds"][:2]
    (run / ".git" / "run_state.json").write_text(json.dumps(data))
    result = runner.invoke(
        app, ["generate", str(target), "--resume", "--out", str(run), "--workspaces", str(ws)], env=ENV
    )
    assert result.exit_code == 0, result.output
    assert [r.round for r in RunState.load(run).rounds] == [0, 1, 2]
    assert RunState.load(run).record(2).commit == state.record(2).commit


# -- the production-scale target on the simulator --------------------------------------------------


@pytest.mark.slow
def test_generate_on_the_simulated_production_target_beats_the_static_split_where_it_never_looked(
    tmp_path, monkeypatch, capsys
):
    raw = yaml.safe_load(Path("targets/catalog/qwen3-235b-a22b-h800x160.yaml").read_text())
    raw["workload"].update(batch_size=64, train_steps=2)  # at 32 a static split beat the best on its seed once
    target = tmp_path / "big.yaml"
    target.write_text(yaml.safe_dump(raw))
    run = tmp_path / "run"
    args = [str(target), "--rounds", "2", "--out", str(run), "--workspaces", str(tmp_path / "ws"), "--repeat", "1"]
    args += ["--sandbox", "subprocess"]  # its candidate processes start warm (simulated: no Ray to join)
    output = _generate(*args, "--held-out", "1")
    state = RunState.load(run)
    history = History.open(run)
    controllers = {
        r.round: json.loads(history.repo.git.show(f"{r.commit}:stack/params.json"))["controller"]
        for r in state.accepted()
    }
    static = [r for r in state.accepted() if controllers[r.round] == "static_split"]
    # each static split, measured side by side with the best on its round's seed, lost (headlines of
    # different rounds come from different seeds: compared across rounds, one of them beat the best)
    assert static and all(r.paired is not None and r.paired.ratio < 1 for r in static)
    assert controllers[state.best_round] == "time_multiplex"

    # after the last round, the best over the starter where the search never looked (orchestrator/generalization.py)
    best, g = state.best, state.generalization
    assert g is not None and (g.best_round, g.best_commit) == (best.round, best.commit) and best.round > 0
    assert (
        g.in_search.pairs == g.held_out.pairs == g.perturbed.pairs == 1
    )  # one seed each (intervals: test_generalization)
    assert g.in_search.ratio > 1 and g.held_out.ratio > 1 and g.perturbed.ratio > 0
    assert f"x{PERTURBATION:g}" in g.perturbation and g.not_perturbed is None
    assert not set(g.held_out_seeds) & {s for r in range(3) for s in round_seeds(state.config.seed, r, 1)}
    assert "held-out seeds" in output and "of in-search" in output and "of its bound" in output
    runs = RunDir(run).outputs / "generalization" / "runs"
    events = Trace.load_events(runs / "in-search" / "candidate-0" / "trace.jsonl")
    devices = next(e for e in events if e.kind == "run_start").data["devices"]
    # the in-search figure is on the best round's own seed: a simulation repeats the round's measurement
    assert compute_metrics(events, devices)["goodput"] == pytest.approx(best.headline, rel=1e-9)
    # beside each ratio, the best's own share of the step's lower bound (its runs' median; one run in search)
    assert set(g.bound) == {"in-search", "held-out", "perturbed"} and all(0 < f <= 1 for f in g.bound.values())
    fraction = run_metrics(load_target(target), events, {})["lower_bound_fraction"]
    assert g.bound["in-search"] == pytest.approx(fraction, rel=1e-9) and f"{g.bound['perturbed']:.0%}" in output
    # and the same ratio in the trained trajectories' response tokens (one pair each: that pair's ratio)
    trained = [
        compute_metrics(Trace.load_events(runs / "held-out" / f"{who}-0" / "trace.jsonl"), devices)
        for who in ("candidate", "baseline")
    ]
    tokens = trained[0]["trained_tokens_per_s"] / trained[1]["trained_tokens_per_s"]
    assert set(g.tokens) == set(g.bound) and g.tokens["held-out"] == pytest.approx(tokens, rel=1e-9)
    assert "in tokens" in output and f"{g.tokens['perturbed']:.2f}x" in output
    # benchmarks/trained_lengths.py reads the same pairs, seed by seed
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
    from trained_lengths import main as trained_lengths

    trained_lengths(run)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| held-out | ")]
    assert len(rows) == 1 and f"| {g.held_out.ratio:.2f}x | {g.tokens['held-out']:.2f}x |" in rows[0], rows
    # benchmarks/judge_selection.py reads the selection net off the same runs, as their audits computed it
    from judge_selection import selection_of

    candidate = runs / "held-out" / "candidate-0"
    audited = json.loads((candidate / "audit.json").read_text())["result"]
    read = selection_of(load_target(target), candidate)
    assert "selection_task_bound" in read and set(read["reasons"]) <= set(audited["reasons"])
    assert {k: v for k, v in read.items() if k.startswith("selection_")} == {
        k: v for k, v in audited["details"].items() if k.startswith("selection_")
    }
    assert load_target(runs / "perturbed.yaml").workload.tokens.observation == round(
        raw["workload"]["tokens"]["observation"] * PERTURBATION
    )
    # the starter on one seed: the longer workload ran (its observations; not its turn count, which a fuller
    # context and the unchanged trajectory timeout cut short, by an amount the controller's CPU time moves)
    lengths = {
        name: _mean_observation(runs / name / "baseline-0" / "trace.jsonl") for name in ("held-out", "perturbed")
    }
    assert lengths["perturbed"] > 1.15 * lengths["held-out"], lengths
    log = runner.invoke(app, ["log", str(run), "--json"])
    assert json.loads(log.output)["generalization"]["best_commit"] == best.commit
    stamp = (runs / "held-out" / "candidate-0" / "trace.jsonl").stat().st_mtime_ns
    _generate(*args, "--held-out", "1", "--resume")  # no new best: not measured again
    assert (runs / "held-out" / "candidate-0" / "trace.jsonl").stat().st_mtime_ns == stamp


def _mean_observation(trace: Path) -> float:
    """The mean length of the observations the environment answered with (a last step's is empty)."""
    lengths = [e.data["observation"] for e in Trace.load_events(trace) if e.kind == "env_step"]
    lengths = [n if isinstance(n, int) else len(n) for n in lengths]
    return statistics.mean(n for n in lengths if n > 0)


@pytest.mark.slow
def test_the_evolve_policy_runs_rounds_from_its_population(tmp_path, fast_target):
    run = tmp_path / "run"
    _generate(
        str(fast_target),
        "--policy",
        "evolve",
        "--rounds",
        "2",
        "--simulate",
        "--repeat",
        "1",
        "--seed",
        "3",
        "--held-out",
        "0",
        "--out",
        str(run),
        "--workspaces",
        str(tmp_path / "ws"),
        *("--sandbox", "subprocess"),  # its candidate processes start warm
    )
    state = RunState.load(run)
    assert state.config.policy == "evolve" and [r.round for r in state.rounds] == [0, 1, 2]
    assert all(r.parent_round is not None for r in state.rounds[1:])


@pytest.mark.slow
def test_the_default_relative_paths_work_from_any_directory(tmp_path, fast_target, monkeypatch):
    """The README's command relies on cwd-relative defaults (generated/<id>, workspaces/); git and the
    sandbox run in other directories, so every path must be made absolute first."""
    monkeypatch.chdir(tmp_path)
    lines = _generate(str(fast_target), "--rounds", "0", "--simulate", "--repeat", "1").splitlines()
    # in a pipe nothing redraws: each change is a line as it happens, then the table once, tab-separated
    assert any("sandbox: " in line for line in lines), lines  # (after the model's progress bar, on a fresh cache)
    finished = [i for i, line in enumerate(lines) if line.startswith("round 0  ")]
    table = [i for i, line in enumerate(lines) if line.startswith("round\ttask\tverdict")]
    assert finished and "accepted" in lines[finished[0]] and table and finished[0] < table[0], lines
    state = RunState.load(Path("generated") / "tiny-qwen3-cpu-fast")
    assert state.record(0).verdict == "accepted", state.record(0).reasons
    assert (tmp_path / "generated" / "tiny-qwen3-cpu-fast" / "stack" / "params.json").exists()


# -- bad input ---------------------------------------------------------------------------------------


def test_a_prescreen_margin_outside_zero_to_one_is_refused(tmp_path):
    result = runner.invoke(
        app, ["generate", "tiny-qwen3-cpu", "--prescreen-margin", "1.5", "--out", str(tmp_path / "r")], env=ENV
    )
    assert result.exit_code == 2 and "--prescreen-margin 1.5" in result.output
    assert not (tmp_path / "r").exists()


def test_an_unknown_target_is_named(tmp_path):
    result = runner.invoke(app, ["generate", "no-such-target", "--out", str(tmp_path / "r")], env=ENV)
    assert result.exit_code == 2 and "unknown target 'no-such-target'" in result.output


def test_an_existing_out_without_resume_and_a_missing_run_with_resume_are_refused(tmp_path):
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "something").write_text("x")
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--out", str(existing)], env=ENV)
    said = " ".join(result.output.split())  # the console wraps a long temporary path's line anywhere
    assert result.exit_code == 2 and "already exists: continue it with --resume" in said
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--resume", "--out", str(tmp_path / "missing")], env=ENV)
    assert result.exit_code == 2 and "nothing to resume" in " ".join(result.output.split())


def test_a_start_killed_before_its_first_state_is_started_again_and_a_started_run_never(
    tmp_path, fast_target, monkeypatch
):
    """Killed between making its repository and saving its first state, a start left a folder that
    ``--resume`` called never started and a new start called taken; the new start now starts it again
    (nothing in it to keep). A folder with a round in it, or a state, is never taken back."""
    run = tmp_path / "run"
    History.create(run, "vibetrain run: killed before its state")
    resumed = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--resume", "--out", str(run)], env=ENV)
    assert resumed.exit_code == 2 and "never started" in resumed.output
    loop = _start(fast_target, tmp_path)
    loop.history.release()
    assert RunDir(run).state_file.exists() and len(list(loop.history.repo.iter_commits())) == 1
    history = History.open(run)  # a round's ref and no state: not a start killed before its state
    RunDir(run).state_file.unlink()
    history.repo.git.update_ref("refs/vibetrain/rejected/0", "HEAD")
    again = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--out", str(run)], env=ENV)
    assert again.exit_code == 2 and "already exists" in " ".join(again.output.split())
    assert history.rejected_commit(0) == history.repo.head.commit.hexsha  # the ref the refused start left alone
    killed = tmp_path / "k" / "run"  # killed inside History.create's first commit: no commit, its index.lock left
    unborn = git.Repo.init(killed, initial_branch="best")
    with unborn.config_writer() as config:
        config.set_value("user", "name", "vibetrain")
    (killed / ".git" / "index.lock").write_text("")
    from orchestrator import git_leftovers

    monkeypatch.setattr(git_leftovers, "GRACE_S", 0.0)
    _start(fast_target, tmp_path / "k").history.release()
    assert RunDir(killed).state_file.exists()
    mine = tmp_path / "mine"  # a person's repository on an empty orphan branch: a .git alone, as above
    repo = git.Repo.init(mine)
    (mine / "notes.txt").write_text("mine\n")
    repo.git.add("notes.txt")
    first = repo.index.commit("my work").hexsha
    repo.git.checkout("--orphan", "fresh")
    repo.git.rm("-rf", ".")
    refused = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--out", str(mine)], env=ENV)
    assert refused.exit_code == 2 and "already exists" in " ".join(refused.output.split())
    assert git.Repo(mine).commit(first).message == "my work"


def _empty_run(tmp_path: Path) -> Path:
    from orchestrator.state import new_state
    from tests.review_run import run_config

    run = tmp_path / "run"
    History.create(run, "vibetrain run: test")
    config = run_config()
    new_state(config).save(run)
    return run


def test_a_run_whose_spec_file_moved_says_so_and_what_to_do(tmp_path):
    """A run started from a spec file that later moved answered report, export and --resume with "target
    spec file not found: PATH", a path the user never typed there, and no way out."""
    from orchestrator.state import new_state
    from tests.review_run import run_config

    run, moved = tmp_path / "run", tmp_path / "moved-away.yaml"
    History.create(run, "vibetrain run: test")
    new_state(run_config(target=str(moved))).save(run)
    said = ""
    for args in (
        ["report", str(run)],
        ["generate", "tiny-qwen3-cpu", "--resume", "--out", str(run)],
        ["export", f"{run}@best", "--out", str(tmp_path / "x")],
    ):
        result = runner.invoke(app, args, env=ENV)
        said = " ".join(result.output.split())
        assert result.exit_code == 2, (args, said)
        assert f"was started from the target spec {moved}, which is no longer there" in said, (args, said)
    assert "or name one with --target" in said  # export can be given the target


def test_a_dirty_run_worktree_is_refused_on_resume(tmp_path):
    run = _empty_run(tmp_path)
    (run / "edited-by-hand.txt").write_text("x")
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--resume", "--out", str(run)], env=ENV)
    assert result.exit_code == 2 and "uncommitted changes" in result.output and "edited-by-hand.txt" in result.output
    result = runner.invoke(app, ["generate", "qwen3-8b-h100x8", "--resume", "--out", str(run)], env=ENV)
    (run / "edited-by-hand.txt").unlink()
    result = runner.invoke(app, ["generate", "qwen3-8b-h100x8", "--resume", "--out", str(run)], env=ENV)
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "is a run for tiny-qwen3-cpu" in said
    assert f"resume it with its own (vibetrain generate tiny-qwen3-cpu --out {run} --resume)" in said, said


def test_a_run_whose_state_was_deleted_says_it_cannot_go_on_not_to_start_it_again(tmp_path):
    """--resume said "not a vibetrain run, or it never started" and a fresh start "already exists: continue it
    with --resume": advice that went round. The resume now says what was lost and what is left."""
    from orchestrator.run_dir import RunDir
    from tests.review_run import make_review_run

    run = make_review_run(tmp_path)  # rounds committed
    RunDir(run).state_file.unlink()
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--resume", "--out", str(run)], env=ENV)
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "has lost its run state" in said and "start a new run with another --out" in said


def test_a_run_whose_starter_failed_says_resume_cannot_go_on(tmp_path):
    """A 1 s time limit fails the starter at its accuracy run; a --resume with a sane limit used to
    print the same failure and exit 0 having done nothing. It now says why it cannot go on, and what to do."""
    run = tmp_path / "run"
    args = ["generate", "tiny-qwen3-cpu", "--out", str(run), "--rounds", "1"]
    result = runner.invoke(app, [*args, "--time-limit", "1"], env=ENV)
    said = " ".join(result.output.split())
    assert "starter stack was not validated" in said and "start the run again" in said, said
    result = runner.invoke(app, [*args, "--resume", "--time-limit", "300"], env=ENV)
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "--resume has nothing to go on from" in said, said
    assert "exceeded its time limit of 1s" in said and "start the run again" in said


def test_options_fixed_when_the_run_started_are_refused_on_resume_by_name(tmp_path):
    """--resume used to go on with the stored policy and seed without a word."""
    run = _empty_run(tmp_path)
    args = ["generate", "tiny-qwen3-cpu", "--resume", "--out", str(run)]
    result = runner.invoke(app, [*args, "--policy", "evolve", "--seed", "7", "--rounds", "9"], env=ENV)
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "cannot change" in said, said
    assert "--policy evolve (this run's: backlog)" in said and "--seed 7 (this run's: 0)" in said
    assert "--rounds" not in said  # a resumed run may be given more rounds
    # a value no run takes was called a change ("cannot change: --policy evolv")
    result = runner.invoke(app, [*args, "--policy", "evolv"], env=ENV)
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "unknown policy 'evolv' (did you mean 'evolve'?)" in said, said


def test_a_workspace_left_by_a_deleted_run_is_replaced_and_a_live_runs_is_refused(tmp_path):
    """A killed run whose directory was deleted left its round worktree behind: the next run of the
    target failed on ``git worktree remove`` (not its worktree) with a traceback."""
    import shutil

    workspace = tmp_path / "workspaces" / "round-1"
    old = History.create(tmp_path / "old", "vibetrain run: old")
    old.worktree(workspace, old.root())
    new = History.create(tmp_path / "new", "vibetrain run: new")
    with pytest.raises(HistoryError, match="a worktree of another run's repository"):
        new.worktree(workspace, new.root())  # the old run still exists: its workspace is not ours to delete
    shutil.rmtree(tmp_path / "old")
    assert new.worktree(workspace, new.root()) == workspace.resolve()  # left by a deleted run: replaced
    assert git.Repo(workspace).head.commit.hexsha == new.root()
    new.remove_worktree(workspace)
    assert not workspace.exists()
    # a run deleted and started again at the same path: the workspace's link names the new repository's
    # git directory, which has no such worktree
    old = History.create(tmp_path / "old", "vibetrain run: old")
    old.worktree(workspace, old.root())
    shutil.rmtree(tmp_path / "old")
    again = History.create(tmp_path / "old", "vibetrain run: old, again")
    assert again.worktree(workspace, again.root()) == workspace.resolve()
    assert git.Repo(workspace).head.commit.hexsha == again.root()


def test_a_worktree_whose_add_was_killed_is_replaced_on_resume(tmp_path):
    """A run killed during ``git worktree add`` leaves the worktree locked ("initializing"): the resumed
    round's ``git worktree remove --force`` refused it and the round ended in an error (seen once in
    seven runs of the SIGKILL test above, killed as round 2's judged copy was being made)."""
    history = History.create(tmp_path / "run", "vibetrain run: killed")
    workspace = history.worktree(tmp_path / "ws" / "round-2-judged", history.root())
    history.repo.git.worktree("lock", "--reason", "initializing", str(workspace))  # as the killed add left it
    (workspace / "half-copied.py").write_text("X = 1\n")
    assert history.worktree(workspace, history.root()) == workspace
    assert not (workspace / "half-copied.py").exists() and git.Repo(workspace).head.commit.hexsha == history.root()
    history.remove_worktree(workspace)
    assert not workspace.exists() and "initializing" not in history.repo.git.worktree("list", "--porcelain")


@pytest.mark.parametrize("left", ["locked, no files yet", "a link to an entry never finished", "an empty link"])
def test_whatever_a_killed_worktree_add_left_is_replaced(tmp_path, left):
    """A kill inside ``git worktree add`` can leave more than a locked worktree with its files (above): an
    entry locked "initializing" before the worktree's ``.git`` was written (the add then refused the path:
    "a missing but locked worktree"), a ``.git`` naming an entry git had not finished ("failed to read
    commondir"), or an empty ``.git`` (read as a worktree of another run's, in "."). Each was found by a
    review that killed git at each of its system calls in turn; each is planted here as git left it."""
    history = History.create(tmp_path / "run", "vibetrain run: killed")
    workspace = history.worktree(tmp_path / "ws" / "round-2-judged", history.root())
    entry = Path(history.repo.git_dir) / "worktrees" / "round-2-judged"
    workspace_git.forget(workspace)  # the resumed run's process never made it (its link is not restored)
    if left == "locked, no files yet":
        history.repo.git.worktree("lock", "--reason", "initializing", str(workspace))
        (workspace / ".git").unlink()
    elif left == "a link to an entry never finished":
        (entry / "commondir").unlink()
        (entry / "HEAD").unlink()
    else:
        (workspace / ".git").write_text("")
    assert history.worktree(workspace, history.root()) == workspace
    assert git.Repo(workspace).head.commit.hexsha == history.root()
    listed = history.repo.git.worktree("list", "--porcelain")
    assert listed.count(str(workspace)) == 1 and "initializing" not in listed
    history.remove_worktree(workspace)
    assert not workspace.exists() and not list((Path(history.repo.git_dir) / "worktrees").glob("*"))


def test_the_lock_files_a_killed_git_left_are_removed_when_the_run_is_claimed(tmp_path):
    """A run killed inside ``git reset --hard`` (a round becoming best) left ``index.lock`` and its files half
    written: resume refused them as uncommitted changes, and the ``reset --hard best`` it advised failed on
    the lock; killed inside ``update-ref``, a round's ``N.lock`` failed the redone round's commit and listed
    itself as round "1.lock" (``int()`` of it raised in ``log`` and ``RUN@latest``). The run's writer, the
    one process that may hold it, finds them gone and says so."""
    run = _empty_run(tmp_path)
    history = History.open(run)
    git_dir = Path(history.repo.git_dir)
    (run / "DESIGN.md").write_text("a candidate's file, half written\n")
    history.repo.git.add("DESIGN.md")
    history.repo.index.commit("Round 1: the best so far")
    history.repo.git.update_ref("refs/vibetrain/rounds/1", "HEAD")
    (run / "DESIGN.md").write_text("half")  # the killed reset's work
    (git_dir / "index.lock").write_text("")
    (git_dir / "refs" / "vibetrain" / "rounds" / "2.lock").write_text("")
    assert history.round_numbers() == [1]
    said = []
    loop = resume_run(run, {}, lambda kind, **data: said.append((kind, data.get("reason"))), tmp_path / "ws")
    loop.history.release()  # resumed, not run: the uncommitted-changes refusal did not come
    [(_, removed), (_, reset)] = said[:2]
    assert removed == "removed what a killed git left: index.lock, refs/vibetrain/rounds/2.lock"
    kept = re.fullmatch(
        r"reset the run directory's files to best \(a killed update had left them half written; "
        r"as found: (refs/vibetrain/recovered/[0-9-]+)\)",
        reset,
    )
    assert kept, reset
    assert not list(git_dir.glob("**/*.lock")) and history.dirty() == []
    assert (run / "DESIGN.md").read_text() == "a candidate's file, half written\n"
    assert history.repo.git.show(f"{kept[1]}:DESIGN.md") == "half"  # the files as found, should they be a person's
    assert history.round_numbers() == [1]


def test_a_lock_a_live_git_holds_is_never_taken(tmp_path, monkeypatch):
    """A git still at work (the child of a vibetrain killed alone, or a person's own) holds its locks: one
    working in the run directory stops the resume, by name, after a wait; a lock that git rewrites or
    takes away during the grace is not stale; a ref's lock alone resets nothing."""
    from orchestrator import git_leftovers

    run = _empty_run(tmp_path)
    git_dir = run / ".git"
    fake_git = tmp_path / "bin" / "git"  # a process named git, at work in the run directory
    fake_git.parent.mkdir()
    fake_git.symlink_to(shutil.which("sleep"))
    worktree = History.open(run).worktree(tmp_path / "workspaces" / "round-1", "best")  # outside the run directory
    (git_dir / "index.lock").write_text("")
    monkeypatch.setattr(git_leftovers, "WAIT_FOR_GIT_S", 0.5)
    for where in (run, worktree / "stack"):  # the run directory; a folder of a round's worktree
        where.mkdir(exist_ok=True)
        working = subprocess.Popen([str(fake_git), "30"], cwd=where)
        while Path(f"/proc/{working.pid}/comm").read_text().strip() != "git":  # named once its exec is done
            time.sleep(0.01)
        try:
            with pytest.raises(git_leftovers.GitStillRunning, match=f"git \\(pid {working.pid}\\) is still at work in"):
                git_leftovers.stale_locks(run, git_dir)
        finally:
            working.kill()
            working.wait()
        assert (git_dir / "index.lock").exists()

    def rewritten(seconds):  # the git holding it commits a new one in the meantime
        (git_dir / "index.lock").unlink()
        (git_dir / "index.lock").write_text("another")

    monkeypatch.setattr(git_leftovers.time, "sleep", rewritten)
    assert git_leftovers.stale_locks(run, git_dir) == []
    (git_dir / "index.lock").unlink()
    (git_dir / "refs" / "vibetrain" / "rounds").mkdir(parents=True)
    (git_dir / "refs" / "vibetrain" / "rounds" / "2.lock").write_text("")
    monkeypatch.setattr(git_leftovers.time, "sleep", lambda seconds: None)
    assert History.open(run).claim() == ["removed what a killed git left: refs/vibetrain/rounds/2.lock"]


def test_a_run_another_process_is_running_is_refused_by_name_until_it_ends(tmp_path):
    """Two ``generate`` on one run wrote the same refs, worktrees and state at once; the second is refused,
    naming the first's pid, and may go on once that one has ended (here: killed, as a crash would)."""
    run = _empty_run(tmp_path)
    claim = f"from pathlib import Path; from orchestrator.history import History; History(Path({str(run)!r})).claim()"
    with _another_process_holding(claim) as holder:
        busy = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--resume", "--out", str(run)], env=ENV)
        assert busy.exit_code == 2, busy.output
        assert f"another vibetrain process (pid {holder.pid}) is running the run in {run.resolve()}" in busy.output
    History.open(run).claim()  # the kernel let go of the killed holder's lock


@contextlib.contextmanager
def _another_process_holding(claim: str):
    """A process that runs ``claim`` (Python taking a run's lock) and holds it until it is killed (as a
    crash would end it), yielded once it holds."""
    holder = subprocess.Popen(
        [sys.executable, "-c", f"{claim}; print('held', flush=True); import time; time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.kill()
        holder.wait()


def test_a_second_fresh_start_on_one_folder_is_refused_before_it_makes_anything(tmp_path, fast_target):
    """Two fresh starts on one --out raced: the run's lock was taken after its repository was made, so both
    made it and the second committed a root of its own on the first's. The lock now comes first: while
    another start holds it, the second is refused by name having made nothing; a start killed between
    its lock and its repository leaves a folder the next start takes back."""
    from orchestrator import writer_lock

    run = tmp_path / "run"
    claim = f"from pathlib import Path; from orchestrator import writer_lock; writer_lock.claim(Path({str(run)!r}))"
    with _another_process_holding(claim) as holder:
        busy = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--out", str(run)], env=ENV)
        assert busy.exit_code == 2, busy.output
        assert f"another vibetrain process (pid {holder.pid}) is running the run" in " ".join(busy.output.split())
        assert not (run / ".git" / "HEAD").exists() and not RunDir(run).state_file.exists()
    assert {p.name for p in (run / ".git").rglob("*")} == {"vibetrain", "writer.flock"}  # the lock, left
    loop = _start(fast_target, tmp_path)  # taken back, and started
    loop.history.release()
    assert RunDir(run).state_file.exists() and len(list(loop.history.repo.iter_commits())) == 1
    writer_lock.claim(run).release()


def test_a_full_disk_while_saving_state_says_what_to_do(tmp_path, monkeypatch):
    run = _empty_run(tmp_path)
    state = RunState.load(run)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(
        RunStateError, match="disk full .* every validated candidate is committed in git; free some space"
    ):
        state.save(run)
    assert RunState.load(run).config.target == "tiny-qwen3-cpu"  # the previous state is intact
    assert not list((run / ".git").glob(".state-*"))

    def broken(*args, **kwargs):  # any other error of the disk was a traceback
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(RunStateError, match="could not be saved to .* \\(Input/output error\\): every validated"):
        state.save(run)


@pytest.mark.parametrize(
    "mistake, says",
    [
        (["--sandbox", "foo"], "unknown sandbox 'foo'"),
        (["--agents", "openai", "--model", "gpt-4o", "--prices", "{missing}"], "No such file"),
        (["--agents", "openai", "--model", "gpt-4o", "--prices", "{a_list}"], "not a list"),
        (["--agents", "openai", "--model", "gpt-4o", "--prices", "{negative}"], "two numbers of at least 0, got [-2"),
        (["--agents", "openai", "--model", "gpt-4o", "--prices", "{a_bool}"], "two numbers of at least 0, got [True"),
    ],
    ids=["unknown sandbox", "missing price table", "price table not a mapping", "negative price", "boolean price"],
)
def test_a_setup_mistake_found_after_the_repository_was_made_leaves_nothing_behind(tmp_path, mistake, says):
    """The same command, corrected, starts the run: no repository left over to refuse it."""
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "negative.yaml").write_text("gpt-4o: [-2.5, 10]\n")
    (tmp_path / "bool.yaml").write_text("gpt-4o: [true, 10]\n")
    names = {"missing": str(tmp_path / "nope.yaml"), "a_list": str(tmp_path / "list.yaml")}
    names |= {"negative": str(tmp_path / "negative.yaml"), "a_bool": str(tmp_path / "bool.yaml")}
    args = ["generate", "tiny-qwen3-cpu", "--rounds", "0", "--out", str(tmp_path / "r"), "--workspaces", str(tmp_path)]
    result = runner.invoke(
        app, [*args, *(m.format(**names) for m in mistake)], env={**ENV, "OPENAI_API_KEY": "sk-test"}
    )
    assert result.exit_code == 2 and says in result.output, result.output
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("option", ["--time-limit", "--max-tokens"])
def test_a_limit_of_zero_is_refused(tmp_path, option):
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", option, "0", "--out", str(tmp_path / "r")], env=ENV)
    assert result.exit_code == 2 and option in result.output and not (tmp_path / "r").exists()


@pytest.mark.parametrize(("option", "value"), [("--time-limit", "inf"), ("--max-minutes", "nan")])
def test_a_limit_that_is_no_number_is_refused(tmp_path, option, value):
    """``--time-limit inf`` was taken, saved to JSON as null, and a resume ran under the target's default."""
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", option, value, "--out", str(tmp_path / "r")], env=ENV)
    assert result.exit_code == 2 and f"{option} {value}: Input should be a finite number" in result.output
    assert not (tmp_path / "r").exists()


def test_an_unknown_policy_is_refused_before_anything_is_written(tmp_path):
    result = runner.invoke(
        app, ["generate", "tiny-qwen3-cpu", "--policy", "random", "--out", str(tmp_path / "r")], env=ENV
    )
    assert result.exit_code == 2 and "unknown policy 'random'" in result.output
    assert not (tmp_path / "r").exists()


def test_an_unknown_sandbox_is_refused_before_anything_is_written(tmp_path):
    result = runner.invoke(
        app, ["generate", "tiny-qwen3-cpu", "--sandbox", "nope", "--out", str(tmp_path / "r")], env=ENV
    )
    assert result.exit_code == 2 and "unknown sandbox 'nope'; known: auto, bubblewrap" in result.output
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "options, named", [(["--model", "gpt-4o"], "--model given"), (["--max-cost", "2"], "--max-cost given")]
)
def test_llm_options_without_an_llm_backend_are_refused_not_ignored(tmp_path, options, named):
    """A forgotten --agents ran the offline agents, the model and the budget silently unused."""
    result = runner.invoke(app, ["generate", "qwen3-8b-h800x16", *options, "--out", str(tmp_path / "r")], env=ENV)
    assert result.exit_code == 2 and f"{named} with the offline agents" in result.output, result.output
    assert not (tmp_path / "r").exists()


def test_a_sandbox_that_cannot_run_takes_back_every_folder_the_run_made(tmp_path, monkeypatch):
    """Docker named without an image: the run's repository was taken back, the folders above it that the
    same command made (generated/ on a first run) were left behind."""
    monkeypatch.delenv("VIBETRAIN_DOCKER_IMAGE", raising=False)
    out = tmp_path / "generated" / "runs" / "r"
    result = runner.invoke(app, ["generate", "qwen3-8b-h800x16", "--sandbox", "docker", "--out", str(out)], env=ENV)
    assert result.exit_code == 2 and "--sandbox docker: set VIBETRAIN_DOCKER_IMAGE" in result.output, result.output
    assert not (tmp_path / "generated").exists()
    mine = tmp_path / "mine"
    mine.mkdir()  # an empty folder of the user's is emptied, not removed
    result = runner.invoke(app, ["generate", "qwen3-8b-h800x16", "--sandbox", "docker", "--out", str(mine)], env=ENV)
    assert result.exit_code == 2 and mine.is_dir() and not list(mine.iterdir())


def test_two_runs_named_alike_keep_their_worktrees_apart(tmp_path):
    """The default workspaces folder was keyed by the run directory's name: /a/run and /b/run met there."""
    from orchestrator.runs import run_workspaces

    first, second = (
        run_workspaces(tmp_path / "ws", tmp_path / "a" / "run"),
        run_workspaces(tmp_path / "ws", tmp_path / "b" / "run"),
    )
    assert first != second and first.parent == second.parent == (tmp_path / "ws").resolve()
    assert first.name.startswith("run-") and first == run_workspaces(tmp_path / "ws", tmp_path / "a" / "run")


def test_a_twin_that_cannot_be_loaded_stops_the_run_saying_what_to_do(tmp_path):
    """The twin's spec was written in place (a kill mid-write tore it) and loaded from the absolute path
    the state kept (a moved run lost it): every later round then ended in an error after its implementer
    had run, the run going on. The spec is written whole or not at all, read from the run's own folder,
    and one that cannot be loaded stops the run naming --no-prescreen."""
    from types import SimpleNamespace

    from orchestrator.prescreen import PreScreen, TwinError
    from orchestrator.run_dir import RunDir

    run_dir = RunDir(tmp_path / "run")
    run_dir.twin_spec.parent.mkdir(parents=True)
    run_dir.twin_spec.write_text("id: tiny-twin\nmodel: {family: qwen3\n")  # torn mid-write
    state = SimpleNamespace(config=SimpleNamespace(prescreen=True), twin="/moved/elsewhere/twin.yaml", twin_unfitted=[])
    prescreen = PreScreen(session=None, state=state, history=None, run_dir=run_dir, on_event=lambda *a, **k: None)
    with pytest.raises(TwinError) as refused:
        prescreen.twin()
    said = str(refused.value)
    assert said.startswith(f"the calibrated twin {run_dir.twin_spec} cannot be loaded (SpecError: ") and (
        said.endswith("resume with --no-prescreen to judge every candidate for real")
    )


def test_the_engines_word_alone_never_screens_a_candidate_out(tmp_path):
    """The twin's fit reads what the engines say of their work (waits, reused prefixes), which a candidate's
    engine could bend to steer later predictions. A second twin is fitted to what the harness timed alone
    (written only where an engine said anything), and a candidate the first twin would screen out is judged
    for real where the second predicts it within the margin, or cannot say; screened out only where both agree."""
    from types import SimpleNamespace

    from orchestrator.prescreen import PreScreen, Twin, harness_timed_path
    from targets.api import TraceEvent
    from targets.harness.isolation.sandbox import Sandbox
    from targets.harness.measure.session import Session
    from targets.harness.sim.request_spans import harness_timed
    from targets.harness.target import Target

    class Predicting:  # a twin whose predictions are known: a headline per stack folder's name
        def __init__(self, headlines, timed=None, runs=True):
            self.headlines, self.harness_timed, self.runs = headlines, timed, runs

        def predict(self, stack, out):
            return SimpleNamespace(ok=self.runs, reasons=["it crashed"], name=Path(stack).name)

        def headline(self, measured):
            return self.headlines[measured.name]

        def guessed(self, measured):
            return []

    metric = SimpleNamespace(name="goodput", direction="maximize")
    session = SimpleNamespace(target=SimpleNamespace(spec=SimpleNamespace(headline_metric=metric)))
    history = SimpleNamespace(export=lambda commit, path: path)  # the best's stack: "best-stack"

    def screened(twin):
        config = SimpleNamespace(prescreen=True, prescreen_margin=0.1)
        state = SimpleNamespace(config=config, twin="twin.yaml", best=SimpleNamespace(commit="c0", round=0))
        state.twin_predictions, state.harness_timed_predictions = {}, {}
        prescreen = PreScreen(session, state, history, RunDir(tmp_path), lambda *a, **k: None, twin)
        record = SimpleNamespace(round=3, prediction=None)
        return prescreen.screen(record, tmp_path / "candidate", tmp_path / "out"), record.prediction

    behind = {"best-stack": 10.0, "candidate": 5.0}
    verdict, prediction = screened(Predicting(behind))  # no engine said anything: one twin, as before
    assert verdict is not None and not prediction.passed
    verdict, prediction = screened(Predicting(behind, Predicting({"best-stack": 10.0, "candidate": 9.5})))
    assert (
        verdict is None and prediction.passed and "the engines' word alone would screen it out" in prediction.untrusted
    )
    verdict, prediction = screened(Predicting(behind, Predicting(behind, runs=False)))
    assert verdict is None and "could not run it (it crashed): judged for real" in prediction.untrusted
    verdict, prediction = screened(Predicting(behind, Predicting({"best-stack": 10.0, "candidate": 6.0})))
    assert verdict is not None and not prediction.passed  # both twins agree

    # calibrated: the second twin's spec is written beside the first only where an engine said anything
    def run(**said):
        turn = {"episode": "g0/e0", "turn": 0, "device": "cpu:0", "prompt": 50, "tokens": 8, "aborted": False}
        events = [TraceEvent("generate", 1.0 + i, turn | {"start": i + 0.0, "turn": i} | said) for i in range(3)]
        path = tmp_path / f"trace-{len(said)}.jsonl"
        path.write_text("".join(json.dumps(dataclasses.asdict(e)) + "\n" for e in events))
        return path

    real = Session(Target.load("tiny-qwen3-cpu"), Sandbox.detect("subprocess"), task_key=b"")
    (tmp_path / "twin").mkdir()
    twin = Twin.calibrated(real, [run(queued=0.5, cached=0)], tmp_path / "twin" / "twin.yaml")
    assert harness_timed_path(tmp_path / "twin" / "twin.yaml").exists() and twin.harness_timed is not None
    twin = Twin.calibrated(real, [run()], tmp_path / "twin" / "twin.yaml")
    assert not harness_timed_path(tmp_path / "twin" / "twin.yaml").exists() and twin.harness_timed is None
    # what a stack declared of its engines is their word too: a red team's declared drafts its engines never
    # made moved the fitted rates 5x (the harness-timed twin kept them)
    declared = TraceEvent("run_start", 0.0, {"engine": {"speculative_tokens": 8, "speculative_batch": 64}})
    events = [declared, TraceEvent("generate", 2.0, {"episode": "g0/e0", "device": "cpu:0", "start": 1.0})]
    assert harness_timed(events)[0].data["engine"] == {} and harness_timed(events)[1] == events[1]


def test_a_run_whose_last_round_spent_the_wall_time_budget_measures_nothing_more(tmp_path, monkeypatch):
    """The wall-time budget was checked only before a round: a run whose last round crossed it went on to
    measure the best where the search never looked (2 x (repeat + 2 x held-out) more runs, real ones on a
    real target). Checked again before that measurement, and said."""
    from orchestrator.rounds import Loop
    from tests.review_run import make_review_run

    run = make_review_run(tmp_path)
    state = RunState.load(run)
    state.seconds_used = 600.0  # its rounds took 10 minutes
    state.save(run)
    measured, said = [], []
    monkeypatch.setattr(Loop, "generalize", lambda self: measured.append(self.state.best_round))
    loop = resume_run(
        run, {"max_minutes": 5}, lambda kind, **data: said.append(data.get("reason", "")), tmp_path / "ws"
    )
    loop.run()
    assert measured == [] and any("wall-time budget of 5 min spent" in reason for reason in said), said
    loop = resume_run(run, {"max_minutes": 60}, lambda kind, **data: None, tmp_path / "ws")
    loop.run()
    assert measured == [0]  # within the budget: measured


def test_a_twin_fitted_to_other_rounds_than_the_validated_ones_is_fitted_again(tmp_path):
    """A run killed while it calibrated after a validated round (or once the new twin was written, before the
    state naming its rounds and predictions was) resumed with the old twin's state: the round's trace stayed
    out of the twin until the next validated round, or the new twin was read beside the old one's
    predictions. The loop fits the twin again whenever its rounds are not the validated rounds' traces."""
    from types import SimpleNamespace

    from orchestrator.prescreen import PreScreen

    run_dir = RunDir(tmp_path / "run")
    run_dir.traces.mkdir(parents=True)
    for number in (0, 2):  # round 1's trace was not kept
        run_dir.trace(number).write_text("")
    accepted = [SimpleNamespace(round=number) for number in (0, 1, 2)]
    state = SimpleNamespace(config=SimpleNamespace(prescreen=True), twin="twin.yaml", twin_from=[0])
    state.accepted = lambda: accepted
    prescreen = PreScreen(session=None, state=state, history=None, run_dir=run_dir, on_event=lambda *a, **k: None)
    assert prescreen.outdated() and prescreen.fitted_rounds() == [0, 2]
    state.twin_from = [0, 2]
    assert not prescreen.outdated()
    state.twin = None
    assert prescreen.outdated()


def test_a_resumed_run_whose_twin_missed_a_validated_round_fits_it_again_before_its_next_round(tmp_path):
    """The loop's own use of ``outdated``: a run killed while it calibrated after round 1 resumes with the
    twin of round 0; before round 3 it is fitted again (the calibration, stubbed here, is what runs first)."""
    from tests.review_run import make_review_run

    run = make_review_run(tmp_path)
    state = RunState.load(run)
    state.twin, state.twin_from = str(RunDir(run).twin_spec), [0]
    state.save(run)
    RunDir(run).traces.mkdir(parents=True)
    for number in (0, 1):
        RunDir(run).trace(number).write_text("")
    loop = resume_run(run, {"rounds": 3}, lambda kind, **data: None, tmp_path / "ws")

    class Calibrated(Exception):
        pass

    def calibrate():
        raise Calibrated(loop.prescreen.fitted_rounds())

    loop.calibrate_twin = calibrate
    with pytest.raises(Calibrated) as fitted:
        loop.run()
    assert fitted.value.args == ([0, 1],)


def test_a_round_committed_but_killed_before_its_ref_was_written_is_recovered_not_redone(tmp_path):
    """Between a round's commit (in its judged copy) and the ``update-ref`` that keeps it, a kill left the
    validated candidate reachable from that worktree's HEAD alone: the resumed run redid the round (its
    agents' spend again) and the redo's freeze deleted the commit's worktree. The resume now writes the ref
    from the commit's subject and recovers the round from its record, as for any round committed before a
    kill. A judged copy still at its parent (killed before the commit) is not taken for the round."""
    from agents.roles import Task
    from orchestrator.history import Trailers
    from orchestrator.state import RoundRecord
    from tests.review_run import make_review_run

    run = make_review_run(tmp_path)
    loop = resume_run(run, {"rounds": 4}, lambda kind, **data: None, tmp_path / "ws")
    best = loop.state.best
    judged = loop.history.worktree(loop._frozen(3), best.commit)
    loop.reconcile_with_git()  # at its parent: nothing to recover
    assert loop.state.next_round == 3
    [entry] = loop.history._entries_of(judged)
    (entry / "HEAD").write_text("0" * 40 + "\n")  # an add killed before it set HEAD: git writes zeros first
    loop.reconcile_with_git()
    assert loop.state.next_round == 3
    judged = loop.history.worktree(loop._frozen(3), best.commit)
    task = Task(id="tail_batching", title="add tail batching", rationale="stragglers", source="hint")
    record = RoundRecord(round=3, task=task, parent_round=0, parent_commit=best.commit, verdict="rejected")
    record.seconds = 42.0  # its wall time, stamped before the commit
    trailers = Trailers(3, task.id, "offline", "rejected", "goodput=1", "none")
    message = f"Round 3 (rejected): {task.title}\n\n{trailers.lines()}\n"
    commit = loop.history._commit_workspace(judged, message, {"round.json": record.model_dump(mode="json")})
    assert loop.history.rejected_commit(3) is None  # killed here: the ref never written
    before = loop.state.seconds_used
    loop.reconcile_with_git()
    assert loop.history.rejected_commit(3) == commit and loop.state.record(3).commit == commit
    assert loop.state.next_round == 4 and not judged.exists()  # the killed round's worktrees go with it
    assert loop.state.seconds_used == pytest.approx(before + 42.0)  # its time, which no save carried
    loop.history.release()


def test_a_recorded_rounds_worktrees_left_by_a_kill_are_removed_on_resume(tmp_path):
    """Killed after a round's state was saved, before its two worktrees were removed: no later round has
    their names, so they stayed for good (a copy of the stack each, and git's registration). The resume
    removes every recorded round's, here and in another session's workspaces, and keeps the next round's."""
    from tests.review_run import make_review_run

    run = make_review_run(tmp_path)
    loop = resume_run(run, {"rounds": 4}, lambda kind, **data: None, tmp_path / "ws")
    best = loop.state.best.commit
    left = [
        loop.history.worktree(tmp_path / "ws" / "round-1", best),
        loop.history.worktree(loop._frozen(1), best),
        loop.history.worktree(tmp_path / "other-folder" / "workspaces" / "round-0-judged", best),
    ]
    upcoming = loop.history.worktree(tmp_path / "ws" / "round-3", best)  # not recorded: a round to come
    loop.reconcile_with_git()
    assert loop.state.next_round == 3
    assert not any(tree.exists() for tree in left) and upcoming.exists()
    assert loop.history.worktree_folders() == [upcoming.resolve()]
    loop.history.release()


def test_a_round_killed_before_its_ref_is_recovered_from_another_sessions_workspaces(tmp_path):
    """The killed session ran from another folder, so its judged copy is under that folder's workspaces/
    (the default is relative): the resume looked only in its own, redid the round and orphaned the commit.
    Every worktree of the run's repository is searched now, and the killed session's are removed."""
    from agents.roles import Task
    from orchestrator.history import Trailers
    from orchestrator.state import RoundRecord
    from tests.review_run import make_review_run

    run = make_review_run(tmp_path)
    loop = resume_run(run, {"rounds": 4}, lambda kind, **data: None, tmp_path / "ws")
    best = loop.state.best
    judged = loop.history.worktree(tmp_path / "other-folder" / "workspaces" / "round-3-judged", best.commit)
    task = Task(id="tail_batching", title="add tail batching", rationale="stragglers", source="hint")
    record = RoundRecord(round=3, task=task, parent_round=0, parent_commit=best.commit, verdict="rejected")
    trailers = Trailers(3, task.id, "offline", "rejected", "goodput=1", "none")
    message = f"Round 3 (rejected): {task.title}\n\n{trailers.lines()}\n"
    commit = loop.history._commit_workspace(judged, message, {"round.json": record.model_dump(mode="json")})
    loop.reconcile_with_git()
    assert loop.history.rejected_commit(3) == commit and loop.state.record(3).commit == commit
    assert loop.state.next_round == 4 and not judged.exists()
    loop.history.release()


def test_a_run_killed_after_its_starter_keeps_the_time_the_starter_took(tmp_path, fast_target):
    """seconds_used was saved after each later round only (round 0 went on without it) and in the
    run's last save: a run killed after its starter resumed with no time used, and a scheduler that
    kills and resumes a run never reached its --max-minutes. Every save now carries the time so far."""
    loop = _start(fast_target, tmp_path, rounds=1, sandbox="subprocess", simulate=True)

    def kill_after_the_starter(kind: str, **data) -> None:
        if kind == "round_end" and data["record"].round == 0:
            raise KeyboardInterrupt  # the run killed right after round 0's state was saved

    loop.on_event = kill_after_the_starter
    with pytest.raises(KeyboardInterrupt):
        loop.run()
    assert RunState.load(tmp_path / "run").seconds_used > 0


def test_a_run_killed_mid_round_keeps_the_time_that_round_took(tmp_path, fast_target, monkeypatch):
    """The state saves the time between rounds only: a round killed before its commit lost its time, and a
    scheduler that kills and resumes a run overran --max-minutes by a round each cycle. The clock's file,
    saved every few seconds, counts it: the resumed run finds the budget spent and starts no round."""
    from orchestrator import run_clock
    from orchestrator.runs import resume_run

    monkeypatch.setattr(run_clock, "EVERY_S", 0.05)
    loop = _start(fast_target, tmp_path, rounds=1, sandbox="subprocess", simulate=True)

    def killed_in_round_1(kind: str, **data) -> None:
        if kind == "round_start" and data["round"] == 1:
            time.sleep(3.0)  # the round's work
            raise KeyboardInterrupt

    loop.on_event = killed_in_round_1
    with pytest.raises(KeyboardInterrupt):
        loop.run()
    saved = RunState.load(tmp_path / "run").seconds_used  # round 0's and what came before it
    assert saved > 0
    said, started = [], []
    budget_s = saved + 1.5  # short of what the killed session used

    def watch(kind: str, **data) -> None:
        said.append(data.get("reason", ""))
        started.append(kind == "round_start")

    resumed = resume_run(tmp_path / "run", {"max_minutes": budget_s / 60}, watch, tmp_path / "ws")
    resumed.run()
    assert not any(started) and any("wall-time budget" in reason for reason in said), said
    assert RunState.load(tmp_path / "run").seconds_used >= saved + 2.9


def test_a_corrupt_clock_file_stops_the_resume_naming_it(tmp_path):
    """The clock's file is read on resume like the state: a corrupt one is said, with what to do."""
    from orchestrator.rounds import RunError
    from orchestrator.runs import resume_run
    from tests.review_run import make_review_run

    run = make_review_run(tmp_path)
    RunDir(run).time_used_file.write_text('{"seconds_used": "ten"}')
    loop = resume_run(run, {}, lambda kind, **data: None, tmp_path / "ws")
    with pytest.raises(RunError, match="time_used.json holds .* delete it"):
        loop.run()


def test_a_round_rebuilt_from_git_after_a_kill_keeps_its_time(tmp_path, fast_target):
    """round.json was committed before the round's time and LLM spend were filled in: a round rebuilt
    from git after a kill between its commit and the state's save showed 0 s and no spend."""
    from orchestrator.runs import resume_run

    loop = _start(fast_target, tmp_path, rounds=0, sandbox="subprocess", simulate=True)

    def killed(record) -> None:  # the kill: after round 0's commit, before the state knew of it
        raise KeyboardInterrupt

    loop.finish_round = killed
    with pytest.raises(KeyboardInterrupt):
        loop.run()
    assert RunState.load(tmp_path / "run").rounds == []
    resumed = resume_run(tmp_path / "run", {}, lambda kind, **data: None, tmp_path / "ws")
    resumed.reconcile_with_git()
    assert resumed.state.record(0).seconds > 0


def test_a_run_inside_another_runs_worktree_is_refused_before_anything_is_written(tmp_path):
    """generate --out RUN/stack/new made a run inside another's worktree: an untracked folder there, which the
    outer run's --resume then refused (clearly, but only then)."""
    run = _empty_run(tmp_path)
    inner = run / "stack" / "new-run"
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--rounds", "0", "--out", str(inner)], env=ENV)
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and f"inside the run {run}, whose worktree holds only its commits" in said, said
    assert not inner.exists()
