"""The round loop, top to bottom in one place.

A run is a git repository (``generated/<run>``) plus its state. Round 0 writes the starter stack
(on a real target with the pre-screen on, the measured traces of validated rounds calibrate the
twin); every later
round: the policy picks a parent candidate and a task → the implementer edits a fresh worktree of
the parent (up to ``max_attempts`` times, each fed the judge's reasons) → what it left is copied
into a worktree of the harness's own, the candidate from then on → the twin pre-screens it
(a real target: one predicted too far behind the best ends the round here) → the judge gates it →
the evaluator measures it → the candidate is committed (validated) or kept under a
rejected ref → ``DESIGN.md``, the backlog and the run state are updated. One round's failure never
stops the run; a budget (rounds, wall time) stops it cleanly between rounds; a killed run resumes
with every validated commit intact and no round done twice.
"""

from __future__ import annotations

import errno
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from git.exc import GitCommandError

from agents import workspace_git
from agents.roles import AgentError, Agents, Evaluation, RoundContext, Task, Verdict
from orchestrator.history import History, HistoryError, Trailers
from orchestrator.policies import Policy
from orchestrator.prescreen import Twin, clears, twin_said
from orchestrator.run_dir import RunDir
from orchestrator.state import RoundRecord, RunState, RunStateError, save_llm_spend
from orchestrator.tables import promotion, promotion_short
from skills.design_doc import DesignDoc
from targets.errors import UserError
from targets.harness.session import Paired, Session
from targets.harness.target import Target
from targets.spec import TargetSpec


class RunError(UserError, RuntimeError):
    """The run cannot go on (disk full, a broken repository); the message says what to do."""

    exit_code = 1


@dataclass
class Loop:
    target: Target
    state: RunState
    history: History
    agents: Agents
    policy: Policy
    run_dir: Path
    workspaces: Path
    on_event: Callable[..., None] = lambda kind, **data: None
    session: Session | None = None  # the judge's: the twin runs in its sandbox, under its limits
    _llm_at_start: dict = field(default_factory=dict)  # accounting when llm_used was last saved
    _twin: Twin | None = None

    @property
    def spec(self) -> TargetSpec:
        return self.target.spec

    # -- the run -----------------------------------------------------------------------------------
    def run(self) -> RunState:
        started = time.monotonic()
        spent_before = self.state.seconds_used
        self.reconcile_with_git()
        if self.state.next_round == 0:
            self.finish_round(self.round_zero())
        if self.state.best is None:
            starter = self.state.record(0)
            self.on_event(
                "budget",
                reason=f"the starter stack was not validated ({starter.verdict}): "
                + "; ".join(starter.reasons[:3])
                + " (nothing to resume from: fix the cause and start the run again)",
            )
            return self.state
        if self.state.config.prescreen and self.state.twin is None:
            self.calibrate_twin()
        while self.state.next_round <= self.state.config.rounds:
            elapsed = spent_before + time.monotonic() - started
            budget = self.state.config.max_minutes
            if budget is not None and elapsed >= budget * 60:
                self.on_event("budget", reason=f"wall-time budget of {budget:g} min spent ({elapsed / 60:.1f} min)")
                break
            spent = self.llm_budget_spent()
            if spent:
                self.on_event("budget", reason=spent)
                break
            llm_before = self.agents.accounting.snapshot() if self.agents.accounting is not None else {}
            proposal = self.policy.propose(self.state, self.params_of)  # an LLM planner's call counts to the round
            if proposal is None:
                reason = "nothing left to try: the backlog is empty and no composition or parameter move is new"
                self.on_event("budget", reason=reason)
                break
            parent, task = proposal
            record = self.round(self.state.next_round, parent, task, llm_before)
            self.finish_round(record)
            if self.state.config.prescreen and record.verdict == "accepted":
                self.calibrate_twin()  # one more real run to learn from
            self.state.seconds_used = spent_before + time.monotonic() - started
            self.save()
        self.state.seconds_used = spent_before + time.monotonic() - started
        self.save()
        return self.state

    def round_zero(self) -> RoundRecord:
        starter = self.state.config.starter
        task = Task(
            id=f"starter={starter}",
            title=f"starter stack ({starter})",
            source="starter",
            rationale=f"the {starter} baseline built from the skills library's recipes",
            skills=[starter],
            acceptance=["vibetrain check passes"],
        )
        return self.round(0, None, task)

    def llm_budget_spent(self) -> str:
        """Why the LLM budget stops the run ('' while it does not)."""
        used, config = self.llm_totals(), self.state.config
        if config.max_cost is not None and used.get("cost_usd", 0.0) >= config.max_cost:
            return f"cost budget of ${config.max_cost:g} spent (${used['cost_usd']:.4f})"
        if (
            config.max_tokens is not None
            and used.get("input_tokens", 0) + used.get("output_tokens", 0) >= config.max_tokens
        ):
            return f"token budget of {config.max_tokens} spent ({used['input_tokens'] + used['output_tokens']})"
        return ""

    def llm_totals(self) -> dict:
        """This run's LLM use, previous sessions of it included."""
        totals = dict(self.state.llm_used)
        if self.agents.accounting is not None:
            for key, value in self.agents.accounting.snapshot().items():
                totals[key] = totals.get(key, 0) + value - self._llm_at_start.get(key, 0)
        return totals

    # -- one round ---------------------------------------------------------------------------------
    def round(self, number: int, parent: RoundRecord | None, task: Task, llm_before: dict | None = None) -> RoundRecord:
        self.on_event("round_start", round=number, task=task, parent=parent.round if parent else None)
        started = time.monotonic()
        if llm_before is None:
            llm_before = self.agents.accounting.snapshot() if self.agents.accounting is not None else {}
        parent_commit = parent.commit if parent else self.history.root()
        workspace = self.history.worktree(self.workspaces / f"round-{number}", parent_commit)
        out = RunDir(self.run_dir).round_outputs(number)
        shutil.rmtree(out, ignore_errors=True)
        record = RoundRecord(
            round=number,
            task=task,
            parent_round=parent.round if parent else None,
            parent_commit=parent_commit,
            verdict="error",
            parent_headline=parent.headline if parent else None,
        )
        seeds = self.seeds(number)
        try:
            verdict, candidate = self.implement_and_judge(record, workspace, out, seeds[0])
            if verdict.passed:
                baseline = self.history.export(self.state.best.commit, out / "baseline") if self.state.best else None
                evaluation = self.agents.evaluator.evaluate(candidate, out / "evaluate", baseline, seeds, verdict.run)
                if evaluation.findings:  # every measured run is judged: a finding in any one rejects
                    verdict = Verdict(
                        False,
                        [f"measurement: {f}" for f in evaluation.findings],
                        verdict.checks + [{"name": "measured_runs", "passed": False, "reasons": evaluation.findings}],
                    )
                    record.reasons = verdict.reasons
                    self.reject(record, candidate, verdict)
                else:
                    self.accept(record, evaluation, candidate, verdict)
            elif record.screened_out:
                self.reject(record, candidate, verdict, "prescreened")
            else:
                self.reject(record, candidate, verdict)
        except OSError as error:
            if error.errno == errno.ENOSPC:
                raise RunError(
                    f"disk full during round {number}: every validated candidate is committed; "
                    "free some space and run again with --resume"
                ) from None
            record.verdict, record.reasons = "error", [f"{type(error).__name__}: {error}", *record.reasons]
        except RunError:  # the run itself cannot go on (its spend could not be saved): not this round's fault
            raise
        except Exception as error:  # one round's failure never stops the run; the reason is recorded and shown
            record.verdict, record.reasons = "error", [f"{type(error).__name__}: {error}", *record.reasons]
        record.seconds = time.monotonic() - started
        if self.agents.accounting is not None:
            record.llm = {k: v - llm_before.get(k, 0) for k, v in self.agents.accounting.snapshot().items()}
        for tree in (workspace, self._frozen(number)):  # a tree that will not go is said, and the run goes on
            try:
                self.history.remove_worktree(tree)
            except (HistoryError, GitCommandError, OSError) as error:
                record.reasons.append(f"the worktree {tree} was not removed: {error}")
        return record

    def seeds(self, number: int) -> list[int]:
        """The round's workload seeds, one per measured pair; the judge's run uses the first (and
        opens pair 0). Drawn from the run's seed and the round: a rerun measures the same workloads."""
        rng = random.Random(f"{self.state.config.seed}:{number}")
        return [rng.randrange(2**31) for _ in range(self.state.config.repeat)]

    def _frozen(self, number: int) -> Path:
        return self.workspaces / f"round-{number}-judged"

    def freeze(self, workspace: Path, record: RoundRecord) -> tuple[Path, list[str]]:
        """The candidate as its agent left it, copied into a worktree the agent never had: what the
        twin predicts, the judge checks, the evaluator measures and the round commits (a rejection's
        too). A process the agent left running (a detached command, a container past its timeout)
        can go on writing in the workspace, never in this copy, so what is committed is what was
        judged. Also: what could not be copied, and why (``workspace_git.copy_candidate``)."""
        frozen = self.history.worktree(self._frozen(record.round), record.parent_commit)
        return frozen, workspace_git.copy_candidate(workspace, frozen)

    def _failed(self, record: RoundRecord, attempt: int, verdict: Verdict) -> list[str]:
        """An attempt that ends before the judge: its reasons recorded and shown, and fed to the next."""
        record.reasons = verdict.reasons
        self.on_event("verdict", round=record.round, attempt=attempt, passed=False, reasons=verdict.reasons)
        return verdict.reasons

    def implement_and_judge(
        self, record: RoundRecord, workspace: Path, out: Path, seed: int = 0
    ) -> tuple[Verdict, Path]:
        """Up to ``max_attempts`` implementations, each fed the judge's reasons for the last one;
        the record keeps the attempt count and the latest reasons even if a later step fails.
        Returns the verdict and the candidate it is about: the last attempt's frozen copy."""
        feedback: list[str] = []
        verdict = Verdict(False, ["no attempt was made"], [])
        candidate = workspace
        parent = self.state.record(record.parent_round) if record.round else None
        context = RoundContext(
            parent_round=record.parent_round,
            parent_metrics=parent.metrics if parent else {},
            parent_spread=parent.spread if parent else {},
            parent_hints=parent.hints if parent else [],
            simulated=self.state.config.simulated,
            max_attempts=self.state.config.max_attempts,
        )
        for attempt in range(1, self.state.config.max_attempts + 1):
            record.attempts = context.attempt = attempt
            context.previous_account, context.account = context.account, ""  # its edits stay in the workspace
            try:
                if record.round == 0:
                    change = self.agents.implementer.starter(workspace, self.state.config.starter)
                else:
                    change = self.agents.implementer.implement(
                        record.task, workspace, feedback, context.parent_hints, context
                    )
                record.account = context.account = change.summary
            except AgentError as error:  # this attempt ends; the next one is told why
                candidate, _ = self.freeze(workspace, record)  # what it left: the evidence a rejection keeps
                verdict = Verdict(False, [f"attempt {attempt}: {type(error).__name__}: {error}"], [])
                feedback = self._failed(record, attempt, verdict)
                continue
            candidate, refused = self.freeze(workspace, record)
            if refused:
                verdict = Verdict(
                    False,
                    [f"the candidate could not be copied as it is: {reason}" for reason in refused],
                    [{"name": "frozen_copy", "passed": False, "reasons": refused}],
                )
                feedback = self._failed(record, attempt, verdict)
                continue
            screened = self.prescreen(record, candidate, out / f"twin-{attempt}")
            if screened is not None:
                feedback = self._failed(record, attempt, screened)
                if record.screened_out:
                    return screened, candidate  # predicted too slow: another attempt at the same task is not the fix
                verdict = screened
                continue
            verdict = self.agents.judge.judge(candidate, out / f"judge-{attempt}", record.task, seed, context)
            record.reasons = verdict.reasons
            self.on_event(
                "verdict", round=record.round, attempt=attempt, passed=verdict.passed, reasons=verdict.reasons
            )
            if verdict.passed:
                break
            feedback = verdict.reasons
        return verdict, candidate

    def accept(self, record: RoundRecord, evaluation: Evaluation, workspace: Path, verdict: Verdict) -> None:
        tampered = workspace_git.tampering(workspace)  # since the judge looked: the harness writes there next
        if tampered:
            raise workspace_git.Tampered("; ".join(tampered))
        record.verdict, record.headline = "accepted", evaluation.headline
        record.metrics = {k: v for k, v in evaluation.metrics.items() if k != "device_utilization"}
        record.spread, record.hints = evaluation.spread, [h.model_dump() for h in evaluation.hints]
        record.profile = evaluation.profile
        if evaluation.paired is not None:  # the rule it was promoted (or not) by stays with the pair
            record.paired = {**evaluation.paired, "threshold": self.spec.noise_threshold}
        record.became_best = self.state.best is None or (
            evaluation.paired is not None and Paired(**evaluation.paired).clears(self.spec.noise_threshold)
        )
        self.update_design(workspace, record)
        metric = self.spec.headline_metric.name
        trailers = Trailers(
            record.round,
            record.task.id,
            self.agents.backend,
            "accepted",
            f"{metric}={evaluation.headline:.6g}",
            self._parent_metric(record),
            promotion_short(record),
        )
        body = f"{record.task.rationale}\n\nImplementer: {record.account}\n\n{promotion(record)}\n\n"
        body += (
            (f"{twin_said(record)}\n\n" if record.prediction else "")
            + "Hints: "
            + ("; ".join(h.message for h in evaluation.hints) or "none")
        )
        records = {  # the judge's evidence (each check with its margins) stays with the candidate it trusted
            "judge.json": {"reasons": verdict.reasons, "checks": verdict.checks},
            "round.json": record.model_dump(mode="json"),
        }
        # The trace is kept before the commit: a kill in between then leaves a round redone on --resume
        # (its trace overwritten), never a validated round whose trace went with its outputs.
        if evaluation.trace_path is not None:
            run_dir = RunDir(self.run_dir)
            run_dir.traces.mkdir(parents=True, exist_ok=True)
            shutil.copy(evaluation.trace_path, run_dir.trace(record.round))
        record.commit = self.history.commit_validated(
            workspace, record.round, record.task.title, trailers, records, body
        )

    def reject(self, record: RoundRecord, workspace: Path, verdict: Verdict, name: str = "rejected") -> None:
        """Kept under the rejected ref with the reasons: by the judge, or (``prescreened``) by the twin.
        What the agent planted for git or the harness is undone first (``workspace_git``): the files stay."""
        record.verdict = name
        undone = workspace_git.disarm(workspace)
        self.update_design(workspace, record)
        trailers = Trailers(
            record.round, record.task.id, self.agents.backend, name, "none", self._parent_metric(record)
        )
        record.commit = self.history.commit_rejected(
            workspace,
            record.round,
            record.task.title,
            trailers,
            {
                "judge.json": {"reasons": verdict.reasons, "checks": verdict.checks},
                "round.json": record.model_dump(mode="json"),
            },
            f"{record.task.rationale}\n\nImplementer: {record.account or '(no attempt)'}"
            + (f"\n\nUndone before committing (planted for git or the harness): {'; '.join(undone)}" if undone else ""),
        )

    def _parent_metric(self, record: RoundRecord) -> str:
        if record.parent_headline is None:
            return "none"
        return f"{self.spec.headline_metric.name}={record.parent_headline:.6g}"

    def finish_round(self, record: RoundRecord) -> None:
        """Git first, then the state: a kill in between is repaired by ``reconcile_with_git``."""
        if record.became_best and record.commit:
            self.history.set_best(record.commit)
            self.state.best_round = record.round
        self.state.rounds.append(record)
        if record.verdict == "accepted":
            self.policy.observe(self.state, record, self.params_of(record))
        shutil.rmtree(RunDir(self.run_dir).round_outputs(record.round), ignore_errors=True)
        self.save()
        self.on_event("round_end", record=record, best=self.state.best)

    # -- the twin pre-screen ------------------------------------------------------------------------
    def calibrate_twin(self) -> None:
        """The twin, fitted to the median traces of every validated round so far; the predictions
        made on the previous twin are dropped."""
        run_dir = RunDir(self.run_dir)
        rounds = [r.round for r in self.state.accepted() if run_dir.trace(r.round).exists()]
        path = run_dir.twin_spec
        try:
            self._twin = Twin.calibrated(self.session, [run_dir.trace(n) for n in rounds], path)
        except (OSError, ValueError, RuntimeError) as error:
            raise RunError(
                f"could not calibrate the twin from the traces of rounds {rounds}: {type(error).__name__}: "
                f"{error}; resume with --no-prescreen to judge every candidate for real"
            ) from None
        self.state.twin, self.state.twin_from, self.state.twin_predictions = str(path), rounds, {}
        self.state.twin_unfitted = list(self._twin.unfitted)
        self.save()
        self.on_event("twin", path=path, rounds=rounds)

    def twin(self) -> Twin | None:
        if not self.state.config.prescreen or self.state.twin is None:
            return None
        if self._twin is None:
            self._twin = Twin.load(self.session, Path(self.state.twin), self.state.twin_unfitted)
        return self._twin

    def prescreen(self, record: RoundRecord, workspace: Path, out: Path) -> Verdict | None:
        """None: the candidate goes on to the judge. Otherwise the verdict that stops it here: it
        failed on the twin (the attempt's feedback), or ``record.prediction`` says it was predicted
        beyond the margin behind the best."""
        twin = self.twin()
        best = self.state.best
        if twin is None or record.round == 0 or best is None:
            return None
        metric = self.spec.headline_metric
        best_headline = self.state.twin_predictions.get(best.commit)
        if best_headline is None:
            measured = twin.predict(self.history.export(best.commit, out / "best-stack"), out / "best")
            if not measured.ok:  # the twin cannot run the best: judge for real, and say so
                record.prediction = {
                    "skipped": f"the best (round {best.round}) failed on the twin: " + "; ".join(measured.reasons[:2])
                }
                return None
            best_headline = self.state.twin_predictions[best.commit] = twin.headline(measured)
        measured = twin.predict(workspace, out / "candidate")
        if not measured.ok:
            reasons = [f"twin: {reason}" for reason in measured.reasons]
            return Verdict(False, reasons, [{"name": "twin_prescreen", "passed": False, "reasons": reasons}])
        predicted, margin = twin.headline(measured), self.state.config.prescreen_margin
        guessed = twin.guessed(measured)
        passed = bool(guessed) or clears(predicted, best_headline, margin, metric.direction == "maximize")
        record.prediction = {
            "metric": metric.name,
            "headline": predicted,
            "best": best_headline,
            "best_round": best.round,
            "margin": margin,
            "passed": passed,
        }
        if guessed:
            record.prediction["untrusted"] = (
                f"it does what no real run has shown the twin yet ({', '.join(guessed)}): the twin's cost for that "
                "is the spec's guess, so it is judged for real"
            )
        self.on_event("prescreen", round=record.round, **record.prediction)
        if passed:
            return None
        reason = (
            f"twin pre-screen: predicted {metric.name} {predicted:.4g} against the best's (round {best.round}) "
            f"{best_headline:.4g} ({predicted / best_headline - 1:+.1%}), beyond the {margin:.0%} margin: "
            "not run for real"
        )
        return Verdict(False, [reason], [{"name": "twin_prescreen", "passed": False, "reasons": [reason]}])

    # -- helpers -----------------------------------------------------------------------------------
    def params_of(self, record: RoundRecord) -> dict:
        return self.history.params(record.commit)

    def update_design(self, workspace: Path, record: RoundRecord) -> None:
        doc = DesignDoc.load(workspace / "DESIGN.md")
        task = record.task
        for earlier in self.state.rounds:  # the plan carries every round of the run, whatever its branch
            if not doc.step(earlier.task.id) and earlier.round > 0:
                doc.record_round(earlier.round, earlier.task.id, earlier.task.title, *self._status(earlier))
        decision, findings = "", []
        if record.verdict == "accepted":
            metric = self.spec.headline_metric.name
            parent = f" (parent {record.parent_headline:.4g})" if record.parent_headline is not None else ""
            decision = (
                f"{task.title}. Why: {task.rationale}. Change: {record.account}. "
                f"Measured {metric} {record.headline:.4g}{parent}."
            )
            findings = [f"{h['message']} [{h['code']}]" for h in record.hints]
        doc.record_round(record.round, task.id, task.title, *self._status(record), decision, findings)
        doc.plan_pending([(pending.id, pending.title) for pending in self.state.backlog])
        doc.save(workspace / "DESIGN.md")

    def _status(self, record: RoundRecord) -> tuple[str, str]:
        if record.verdict == "accepted":
            if record.became_best or record.round == 0:
                return "DONE", ""
            return "ABANDONED", f"round {record.round}: {promotion(record)}"
        reason = record.reasons[0] if record.reasons else record.verdict
        return "ABANDONED", f"round {record.round} {record.verdict}: {reason[:160]}"

    def reconcile_with_git(self) -> None:
        """Rounds committed to git after the last state save (a kill in between) join the state."""
        while True:
            number = self.state.next_round
            commit = self.history.round_commit(number) or self.history.rejected_commit(number)
            if commit is None:
                return
            record = RoundRecord.model_validate(self.history.record(commit, "round.json"))
            record.commit = commit
            self.on_event("recovered", round=number)
            self.finish_round(record)

    def save_llm_spend(self) -> None:
        """After every LLM call: a run killed mid-round resumes knowing what the round already spent."""
        try:
            save_llm_spend(self.run_dir, self.llm_totals())
        except RunStateError as error:
            raise RunError(str(error)) from None

    def save(self) -> None:
        self.state.llm_used = self.llm_totals()
        self._llm_at_start = self.agents.accounting.snapshot() if self.agents.accounting is not None else {}
        try:
            self.state.save(self.run_dir)
        except RunStateError as error:
            raise RunError(str(error)) from None
