"""The round loop, top to bottom in one place.

A run is a git repository (``generated/<run>``) plus its state. Every round, the starter (round 0)
included: the policy picks a parent candidate and a task (round 0's is the starter task) → the
implementer edits a fresh worktree of the parent (up to ``max_attempts`` times, each fed the judge's
reasons) → what it left is copied into a worktree of the harness's own, the candidate from then on →
on a real target with the pre-screen on, the twin (calibrated from the validated rounds' traces)
predicts it, and one predicted too far behind the best ends the round here → the judge gates it →
the evaluator measures it → the candidate is committed (validated) or kept under a rejected ref →
``DESIGN.md``, the backlog and the run state are updated. One round's failure never stops the run
(the user's environment failing does: every later round would meet it, and the round is redone on
``--resume``); a budget (rounds, wall time, LLM spend) stops it cleanly between rounds; a killed
run resumes with every validated commit intact and no round done twice.
"""

from __future__ import annotations

import errno
import itertools
import re
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from git.exc import GitCommandError

from agents import workspace_git
from agents.llm.errors import BudgetSpent, LLMUnusable
from agents.roles import (
    AgentError,
    Agents,
    Evaluation,
    NothingToRepair,
    RoundContext,
    Task,
    Verdict,
    starter_task,
)
from orchestrator import commits
from orchestrator.budget import LLMBudget
from orchestrator.design_record import update_design
from orchestrator.generalization import attempt_seed, held_out_seeds, measure_generalization, round_seeds
from orchestrator.history import History, HistoryError, RefNotWritten
from orchestrator.policies import Policy
from orchestrator.prescreen import PreScreen, TwinError
from orchestrator.run_clock import RunClock, load_time_used
from orchestrator.run_dir import RunDir
from orchestrator.state import (
    GeneralizationRejected,
    Promotion,
    RoundRecord,
    RunState,
    RunStateError,
    save_llm_spend,
)
from targets.errors import UserError
from targets.harness.judge.check_result import CheckResult
from targets.harness.measure.session import EnvironmentFailed, Session
from targets.harness.target import Target

ROUND_WORKTREE = re.compile(r"round-(\d+)(?:-judged)?")  # a round's workspace and its judged copy


class RunError(UserError, RuntimeError):
    """The run cannot go on (disk full, a broken repository); the message says what to do."""

    exit_code = 1


def unusable(error: LLMUnusable, who: str) -> str:
    """Why the run stops on a backend that refuses its configuration, and what to do."""
    return (
        f"{who}'s LLM backend refuses this run's configuration: {error}. Every validated candidate is committed; "
        "fix the model, key or endpoint (--model, --api-key-env, --base-url) and run again with --resume"
    )


def is_disk_full(error: BaseException) -> bool:
    """A write refused for space: Python's errno, or git's own words (it reports in its message)."""
    codes = (errno.ENOSPC, errno.EDQUOT)
    return getattr(error, "errno", None) in codes or any(
        words in str(error) for words in ("No space left on device", "Disk quota exceeded")
    )


def disk_full(number: int) -> str:
    return (
        f"disk full during round {number}: every validated candidate is committed (the round is redone); "
        "free some space and run again with --resume"
    )


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
    budget: LLMBudget = field(init=False)
    prescreen: PreScreen = field(init=False)
    _session_start: tuple[float, float] | None = None  # (monotonic clock, seconds the run had used) once it runs
    _round_start: tuple[float, dict] = (0.0, {})  # (monotonic clock, LLM spend) as the round under way began
    _clock: RunClock | None = None  # saves the time used every few seconds while the rounds run

    def __post_init__(self) -> None:
        self.budget = LLMBudget(self.agents.accounting)
        self.prescreen = PreScreen(self.session, self.state, self.history, RunDir(self.run_dir), self.on_event)

    # -- the run -----------------------------------------------------------------------------------
    def seconds_used(self) -> float:
        """The run's wall time: its earlier sessions' and this one's so far."""
        if self._session_start is None:  # not running (yet): what the state says
            return self.state.seconds_used
        started, spent_before = self._session_start
        return spent_before + time.monotonic() - started

    def run(self) -> RunState:
        """The rounds, to the budget; the run's writer lock let go however they end."""
        try:
            return self._run()
        finally:
            if self._clock is not None:
                self._clock.stop()
            self.history.release()

    def _run(self) -> RunState:
        self._session_start = (time.monotonic(), self.state.seconds_used)
        self.reconcile_with_git()
        self._count_time_saved_while_killed()
        self._clock = RunClock(RunDir(self.run_dir).time_used_file, self.seconds_used)
        self.refuse_a_moved_best()
        out_of_time = False
        if self.state.next_round > self.state.config.rounds:  # a finished run resumed as it was
            done, more = self.state.next_round - 1, self.state.next_round  # (round 0, the starter, is not counted)
            self.on_event("budget", reason=f"its {done} round(s) were done: --resume --rounds {more} goes on")
        while self.state.next_round <= self.state.config.rounds:
            if self.state.next_round > 0 and self.state.best is None:
                starter = self.state.record(0)
                reasons = "; ".join(starter.reasons[:3])
                self.on_event(
                    "budget",
                    reason=f"the starter stack was not validated ({starter.verdict}): {reasons} "
                    "(nothing to resume from: fix the cause and start the run again)",
                )
                break
            if self.prescreen.on and self.state.best is not None and self.prescreen.outdated():
                self.calibrate_twin()
            if self._clock.failure is not None:
                raise RunError(str(self._clock.failure))
            elapsed = self.seconds_used()
            limit = self.state.config.max_minutes
            if limit is not None and elapsed >= limit * 60:
                self.on_event("budget", reason=f"wall-time budget of {limit:g} min spent ({elapsed / 60:.1f} min)")
                out_of_time = True
                break
            spent = self.llm_budget_spent()
            if spent:
                self.on_event("budget", reason=spent)
                break
            llm_before = self.budget.snapshot()
            try:
                proposal = self.propose()  # an LLM planner's call counts to the round
            except BudgetSpent as spent:  # the planner's call found the budget spent: no round is started
                self.on_event("budget", reason=str(spent))
                break
            except LLMUnusable as refused:
                raise RunError(unusable(refused, "the planner")) from None
            if proposal is None:
                reason = "nothing left to try: the backlog is empty and no composition or parameter move is new"
                self.on_event("budget", reason=reason)
                break
            spent = self.llm_budget_spent()
            if spent:  # the planner's own call spent it: no round is started, its task is not marked tried
                self.on_event("budget", reason=spent)
                break
            try:
                record = self.round(self.state.next_round, *proposal, llm_before)
            except BudgetSpent as refused:  # the implementer found it spent: the round is redone on --resume
                self.on_event("budget", reason=f"round {self.state.next_round} stopped: {refused}")
                break
            self.finish_round(record)
            if record.task.source == "starter":
                continue  # the next turn calibrates the first twin, or says why the run cannot go on
            if self.prescreen.on and record.verdict == "accepted" and self.state.twin is not None:
                self.calibrate_twin()  # one more real run to learn from (saved with its time)
        limit = self.state.config.max_minutes  # the last round may have crossed it: then no more runs
        if not out_of_time and (limit is None or self.seconds_used() < limit * 60):
            self.generalize()  # the best, where the search never looked (more runs: not past the wall-time budget)
        elif not out_of_time:
            used = self.seconds_used() / 60
            self.on_event(
                "budget", reason=f"wall-time budget of {limit:g} min spent ({used:.1f} min) by the last round"
            )
        self.save()
        return self.state

    def llm_budget_spent(self) -> str:
        """Why the run's LLM budget stops it ('' while it does not), counting all its sessions' use."""
        return self.budget.spent(self.budget.totals(self.state.llm_used), self.state.config)

    def propose(self) -> tuple[RoundRecord | None, Task] | None:
        """Round 0 is the starter task; every later round's parent and task are the policy's."""
        if self.state.next_round == 0:
            return None, starter_task(self.state.config.starter, self.state.config.starter_params)
        return self.policy.propose(self.state, self.params_of)

    # -- one round ---------------------------------------------------------------------------------
    def round(self, number: int, parent: RoundRecord | None, task: Task, llm_before: dict) -> RoundRecord:
        self.on_event("round_start", round=number, task=task, parent=parent.round if parent else None)
        self._round_start = (time.monotonic(), llm_before)
        parent_commit = parent.commit if parent else self.history.root()
        try:
            workspace = self.history.worktree(self.workspaces / f"round-{number}", parent_commit)
        except (GitCommandError, OSError) as error:
            raise RunError(
                disk_full(number) if is_disk_full(error) else f"round {number}: its worktree could not be made: {error}"
            ) from None
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
        stop: RunError | BudgetSpent | None = None
        try:
            verdict, candidate = self.implement_and_judge(record, workspace, out)
            if verdict.passed:
                seeds = self.measured_seeds(record)  # pair 0 is the judged attempt's run
                baseline = self.history.export(self.state.best.commit, out / "baseline") if self.state.best else None
                evaluation = self.agents.evaluator.evaluate(candidate, out / "evaluate", baseline, seeds, verdict.run)
                if evaluation.findings:  # every measured run is judged: a finding in any one rejects
                    verdict = verdict.adding(CheckResult("measured_runs", False, evaluation.findings))
                    record.reasons = verdict.reasons
                    self.reject(record, candidate, verdict)
                else:
                    self.accept(record, evaluation, candidate, verdict)
            else:
                self.reject(record, candidate, verdict, "prescreened" if record.screened_out else "rejected")
        except RefNotWritten as error:  # committed, the ref refused: its worktree keeps it for the resume
            raise RunError(str(error)) from None  # (a full disk's words are in git's, which it quotes)
        except (OSError, workspace_git.GitFailed, GitCommandError) as error:
            if is_disk_full(error):  # git's own writes say so in their message: a candidate it could not commit
                raise RunError(disk_full(number)) from None
            if getattr(error, "errno", None) in workspace_git.DISK_FAILURES:  # read-only, failing: not the round's
                raise RunError(
                    f"round {number} stopped: the run's disk failed ({error}). Every validated candidate is "
                    "committed; fix the disk and run again with --resume (the round is redone)"
                ) from None
            record.verdict, record.reasons = "error", [f"{type(error).__name__}: {error}", *record.reasons]
        except RunError:  # the run itself cannot go on (its spend could not be saved): not this round's fault
            raise
        except TwinError as error:  # a twin that cannot be loaded: every later round would meet it too
            stop = RunError(f"round {number} stopped: {error}")
        except LLMUnusable as error:  # the backend as configured, which every later round would meet too
            stop = RunError(f"round {number} stopped: {unusable(error, 'an agent')}")
        except BudgetSpent as error:  # the implementer's call found it spent: the loop stops at its budget
            stop = error
        except EnvironmentFailed as error:  # the user's code, which every later round would meet too
            stop = RunError(
                f"round {number} stopped: {error}. This is the {error.part}'s failure, not the candidate's: "
                f"every validated candidate is committed; fix the {error.part} and run again with --resume "
                "(the round is redone)"
            )
        except Exception as error:  # one round's failure never stops the run; the reason is recorded and shown
            # with where it happened: an error in the loop, a policy or an agent looks like any other otherwise
            where = RunDir(self.run_dir).error_file(number)
            try:
                where.parent.mkdir(parents=True, exist_ok=True)
                where.write_text("".join(traceback.format_exception(error)))
            except OSError as unsaved:  # a full disk, say: the round still ends, its reason says so
                where = f"not saved: {unsaved}"
            record.verdict = "error"
            record.reasons = [f"{type(error).__name__}: {error} (traceback: {where})", *record.reasons]
        self._stamp(record)
        record.reasons += self._remove_worktrees(number)
        if stop is not None:
            raise stop
        return record

    def seeds(self, number: int) -> list[int]:
        """The round's workload seeds, one per measured pair; the judge's run of its first attempt uses the
        first. Drawn from the run's seed and the round (each session's workload key keeps the tasks behind
        them secret: ``targets/harness/environments/seeds.py``)."""
        return round_seeds(self.state.config.seed, number, self.state.config.repeat)

    def measured_seeds(self, record: RoundRecord) -> list[int]:
        """The seeds a validated round's pairs ran on: its judged attempt's (``attempt_seed``) opens pair 0."""
        return [attempt_seed(self.state.config.seed, record.round, record.attempts), *self.seeds(record.round)[1:]]

    def seeds_used(self) -> list[int]:
        """Every seed a judged or measured run of the rounds so far may have seen (none is held out)."""
        attempts = range(2, self.state.config.max_attempts + 1)
        return [
            seed
            for number in range(self.state.next_round)
            for seed in (*self.seeds(number), *(attempt_seed(self.state.config.seed, number, a) for a in attempts))
        ]

    def _remove_worktrees(self, number: int, also: list[Path] = ()) -> list[str]:
        """Round ``number``'s two worktrees gone, and ``also`` (a killed session's, in its own workspaces);
        what would not go, said (the run goes on)."""
        problems = []
        for tree in dict.fromkeys((self.workspaces / f"round-{number}", self._frozen(number), *also)):
            try:
                self.history.remove_worktree(tree)
            except (HistoryError, GitCommandError, OSError) as error:
                problems.append(f"the worktree {tree} was not removed: {error}")
        return problems

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

    def implement_and_judge(self, record: RoundRecord, workspace: Path, out: Path) -> tuple[Verdict, Path]:
        """Up to ``max_attempts`` implementations, each fed the judge's reasons for the last one and judged
        on a workload of its own (``attempt_seed``); the record keeps the attempt count and the latest
        reasons even if a later step fails. Returns the verdict and the candidate it is about: the last
        attempt's frozen copy."""
        feedback: list[str] = []
        verdict = Verdict.refused("implementer", ["no attempt was made"])
        candidate = workspace
        parent = self.state.record(record.parent_round) if record.parent_round is not None else None
        context = RoundContext(
            parent_round=record.parent_round,
            parent_metrics=parent.metrics if parent else {},
            parent_spread=parent.spread if parent else {},
            parent_hints=parent.hints if parent else [],
            simulated=self.state.config.simulated,
            max_attempts=self.state.config.max_attempts,
        )
        for attempt in range(1, self.state.config.max_attempts + 1):
            spent = self.llm_budget_spent()
            if attempt > 1 and spent:  # no call can be made: the last attempt's verdict stands, its reasons kept
                record.reasons = [*record.reasons, f"attempt {attempt} not made: {spent}"]
                break
            record.attempts = context.attempt = attempt
            context.previous_account, context.account = context.account, ""  # its edits stay in the workspace
            try:
                change = self.agents.implementer.implement(
                    record.task, workspace, feedback, context.parent_hints, context
                )
                record.account = context.account = change.summary
            except (LLMUnusable, BudgetSpent):
                raise  # every attempt would meet it: the round stops the run (a spent budget: cleanly, redone on
                # --resume, never recorded as the task tried)
            except NothingToRepair as error:  # the same candidate again: the last verdict stands
                said = f"attempt {attempt}: {error}; attempt {attempt - 1}'s verdict stands"
                record.reasons = [*record.reasons, said]  # last: log and show say why no judge ran again
                self.on_event("verdict", round=record.round, attempt=attempt, passed=False, reasons=[said])
                break
            except AgentError as error:  # this attempt ends; the next one is told why
                candidate, _ = self.freeze(workspace, record)  # what it left: the evidence a rejection keeps
                verdict = Verdict.refused("implementer", [f"attempt {attempt}: {type(error).__name__}: {error}"])
                feedback = self._failed(record, attempt, verdict)
                continue
            candidate, refused = self.freeze(workspace, record)
            if refused:
                verdict = Verdict.refused(
                    "frozen_copy", [f"the candidate could not be copied as it is: {r}" for r in refused]
                )
                feedback = self._failed(record, attempt, verdict)
                continue
            screened = self.prescreen.screen(record, candidate, out / f"twin-{attempt}")
            if screened is not None:
                feedback = self._failed(record, attempt, screened)
                if record.screened_out:
                    return screened, candidate  # predicted too slow: another attempt at the same task is not the fix
                verdict = screened
                continue
            seed = attempt_seed(self.state.config.seed, record.round, attempt)
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
        record.spread, record.hints = evaluation.spread, list(evaluation.hints)
        record.profile = evaluation.profile
        threshold = self.target.spec.noise_threshold
        if evaluation.paired is not None:  # the rule it was promoted (or not) by stays with the pair
            record.paired = Promotion(**evaluation.paired.as_dict(), threshold=threshold)
        record.became_best = self.state.best is None or (
            evaluation.paired is not None and evaluation.paired.clears(threshold)
        )
        update_design(workspace, record, self.state, self.target.spec, self._parent_design(record))
        self._stamp(record)  # committed with it: a round rebuilt from git after a kill keeps them
        trailers, body = commits.validated(record, evaluation, self.target.spec, self.agents.backend)
        # The trace is kept before the commit: a kill in between then leaves a round redone on --resume
        # (its trace overwritten), never a validated round whose trace went with its outputs.
        if evaluation.trace_path is not None:
            run_dir = RunDir(self.run_dir)
            run_dir.traces.mkdir(parents=True, exist_ok=True)
            shutil.copy(evaluation.trace_path, run_dir.trace(record.round))
        record.commit = self.history.commit_validated(
            workspace, record.round, record.task.title, trailers, commits.records(record, verdict), body
        )

    def _parent_design(self, record: RoundRecord) -> str | None:
        """The parent's ``DESIGN.md`` as the loop committed it (a starter's is the library's: None; the
        repository's first commit holds none: the record starts empty)."""
        if record.task.source == "starter":
            return None
        if record.parent_commit == self.history.root():
            return ""
        return self.history.read(record.parent_commit, "DESIGN.md")

    def reject(self, record: RoundRecord, workspace: Path, verdict: Verdict, name: str = "rejected") -> None:
        """Kept under the rejected ref with the reasons: by the judge, or (``prescreened``) by the twin.
        What the agent planted for git or the harness is undone first (``workspace_git``): the files stay."""
        record.verdict = name
        undone = workspace_git.disarm(workspace)
        update_design(workspace, record, self.state, self.target.spec, self._parent_design(record))
        self._stamp(record)  # committed with it: a round rebuilt from git after a kill keeps them
        trailers, body = commits.rejected(record, self.target.spec, self.agents.backend, undone)
        record.commit = self.history.commit_rejected(
            workspace, record.round, record.task.title, trailers, commits.records(record, verdict), body
        )

    def _stamp(self, record: RoundRecord) -> None:
        """The round's wall time and LLM spend so far, on its record (again at its end)."""
        started, llm_before = self._round_start
        record.seconds = time.monotonic() - started
        if self.agents.accounting is not None:
            record.llm = self.budget.since(llm_before)

    def finish_round(self, record: RoundRecord) -> None:
        """Git first, then the state: a kill in between is repaired by ``reconcile_with_git``."""
        if record.became_best and record.commit:
            try:
                self.history.set_best(record.commit)
            except (GitCommandError, OSError) as error:  # committed under its ref: --resume recovers it from git
                raise RunError(
                    disk_full(record.round) if is_disk_full(error) else f"round {record.round}: best not moved: {error}"
                ) from None
            self.state.best_round = record.round
        self.state.rounds.append(record)
        if record.verdict == "accepted":
            self.policy.observe(self.state, record, self.params_of(record))
        shutil.rmtree(RunDir(self.run_dir).round_outputs(record.round), ignore_errors=True)
        self.save()
        self.on_event("round_end", record=record, best=self.state.best)

    def calibrate_twin(self) -> None:
        try:
            self.prescreen.calibrate()
        except TwinError as error:
            raise RunError(str(error)) from None
        self.save()

    def generalize(self) -> None:
        """The best over the starter on its own round's seeds, on ``held_out`` seeds no round used and
        on those with the workload perturbed (``generalization.py``); once per best, so a resumed run
        that found no new one does not measure it again. A failed run is said, and loses nothing."""
        best, count = self.state.best, self.state.config.held_out or 0
        measured = self.state.generalization
        if not count or best is None or best.round == 0 or self.session is None:
            return
        for earlier in (measured, self.state.generalization_rejected):
            if earlier is not None and earlier.best_commit == best.commit and len(earlier.held_out_seeds) == count:
                return
        held_out = held_out_seeds(self.state.config.seed, self.seeds_used(), count)
        out = RunDir(self.run_dir).outputs / "generalization"
        shutil.rmtree(out, ignore_errors=True)
        best_dir = self.history.export(best.commit, out / "best")
        starter_dir = self.history.export(self.state.record(0).commit, out / "starter")
        runs, done = 2 * (len(self.measured_seeds(best)) + 2 * count), itertools.count(1)

        def on_run(name: str, i: int) -> None:
            self.on_event("generalize", round=best.round, run=name, done=next(done), runs=runs)

        self.on_event("generalize", round=best.round, run="", done=0, runs=runs)
        result = measure_generalization(
            self.session, (best.round, best.commit, best_dir), starter_dir, self.measured_seeds(best), held_out,
            out / "runs", on_run,
        )  # fmt: skip
        if isinstance(result, GeneralizationRejected):
            self.state.generalization_rejected = result
            self.on_event("budget", reason=f"the best was not measured where the search never looked: {result.said()}")
        else:
            self.state.generalization = result

    # -- helpers -----------------------------------------------------------------------------------
    def params_of(self, record: RoundRecord) -> dict:
        return self.history.params(record.commit)

    def reconcile_with_git(self) -> None:
        """Rounds committed to git after the last state save (a kill in between) join the state; so does
        one committed in its judged copy whose ref the kill kept from being written."""
        while True:
            number = self.state.next_round
            commit = self.history.round_commit(number) or self.history.rejected_commit(number)
            # its judged copy, wherever it is (a session started in another folder had its workspaces there)
            elsewhere = self.history.worktrees_named(self._frozen(number).name)
            for _, head in elsewhere if commit is None else ():
                if (commit := self.history.adopt(number, head)) is not None:
                    break
            if commit is None:
                self._remove_recorded_rounds_worktrees()
                return
            record = RoundRecord.model_validate(self.history.record(commit, "round.json"))
            record.commit = commit
            self.on_event("recovered", round=number)
            self._count_killed_time(record.seconds or 0.0)
            self.finish_round(record)
            edited = self.history.worktrees_named(f"round-{number}")
            for problem in self._remove_worktrees(number, [where for where, _ in [*elsewhere, *edited]]):
                self.on_event("recovered", reason=problem)

    def _remove_recorded_rounds_worktrees(self) -> None:
        """A kill after a round's state was saved, before its worktrees were removed, left them for good (no
        later round has their names): the worktrees of every recorded round go, wherever they are."""
        for folder in self.history.worktree_folders():
            named = ROUND_WORKTREE.fullmatch(folder.name)
            if named is not None and int(named[1]) < self.state.next_round:
                for problem in self._remove_worktrees(int(named[1]), [folder]):
                    self.on_event("recovered", reason=problem)

    def refuse_a_moved_best(self) -> None:
        """``best`` in git is the state's best (what ``export @best`` and the next round start from): a
        branch someone moved, or committed on, would be built on, or reset away, unsaid."""
        best = self.state.best
        there = self.history.best()
        if best is not None and best.commit and there != best.commit:
            raise RunError(
                f"{self.run_dir}: its best branch is at {(there or 'nothing')[:10]}, not at round {best.round}'s "
                f"commit {best.commit[:10]}, the run's best: it was moved or committed on by hand. Keep what you "
                f"need elsewhere, then git -C {self.run_dir} reset --hard {best.commit[:10]} and --resume"
            )

    def _count_killed_time(self, seconds: float) -> None:
        """A recovered round's wall time, which no save of the killed session carried, joins the run's."""
        if self._session_start is None:
            self.state.seconds_used += seconds
        else:
            started, spent_before = self._session_start
            self._session_start = (started, spent_before + seconds)

    def _count_time_saved_while_killed(self) -> None:
        """A round killed before its commit kept its time only in the clock's file: the larger count wins
        (the state's, with the rounds recovered from git, or the clock's; both fall short of the truth)."""
        try:
            saved = load_time_used(RunDir(self.run_dir).time_used_file)
        except RunStateError as error:
            raise RunError(str(error)) from None
        started, spent_before = self._session_start
        self._session_start = (started, max(spent_before, saved))

    def save_llm_spend(self) -> None:
        """After every LLM call: a run killed mid-round resumes knowing what the round already spent."""
        try:
            save_llm_spend(self.run_dir, self.budget.totals(self.state.llm_used))
        except RunStateError as error:
            raise RunError(str(error)) from None

    def save(self) -> None:
        """The state, with the time and the LLM spend so far (every round's end saves it: a kill loses at
        most the round under way)."""
        self.state.seconds_used = self.seconds_used()
        self.state.llm_used = self.budget.totals(self.state.llm_used)
        self.budget.saved()
        try:
            self.state.save(self.run_dir)
        except RunStateError as error:
            raise RunError(str(error)) from None
