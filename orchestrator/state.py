"""Run state: what a run needs to continue after a crash or a kill — its configuration, the backlog,
every finished round, the budgets spent — written atomically (temp file, fsync, rename) after
every round. Git holds the candidates; on resume, a round committed to git but missing here (the
run died between the commit and this write) is taken from git, never redone."""

from __future__ import annotations

import errno
import json
import math
import os
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from agents.roles import Hint, PrintableText, Task
from orchestrator.config import RunConfig
from orchestrator.run_dir import RunDir
from targets.errors import UserError
from targets.harness.measure.session import Paired


class RunStateError(UserError, RuntimeError):
    """The state cannot be read or written (the message says what to do)."""


NEAR_MISS_TRIES = 2  # a gain inside the noise is tried on one later best before the run gives up on it
RETRIES_AFTER_ERROR = 1  # a change whose round ended in an error (never judged) is tried again this often


def near_miss(record: RoundRecord) -> bool:
    """Validated, not promoted, and its paired interval still reaches a gain: its upper end above 1, or
    where the interval is unbounded (a single real pair) its ratio. A controller switch is never one
    (a switch that lost has its own follow-up, ``policies/backlog.py``)."""
    paired = record.paired
    if record.verdict != "accepted" or record.became_best or paired is None or record.task.id.startswith("controller="):
        return False
    reach = paired.ratio if paired.high is None else paired.high
    return math.isfinite(reach) and reach > 1.0


class Promotion(BaseModel):
    """The paired comparison with the best that a validated round was promoted (or not) by: the
    geometric mean ratio, its 95% interval (``high`` None: unbounded), and the rule it had to clear
    (``threshold``: the low end must be above ``1 + threshold``)."""

    model_config = ConfigDict(extra="forbid")
    ratio: float
    low: float
    high: float | None
    pairs: int
    against: str = ""
    baseline_median: float | None = None  # the best's headline beside it (older records did not store it)
    threshold: float | None = None  # older records did not store it
    bound: float | None = None  # the lower end the rule read (``Paired.bound``; older records: ``low``)

    def paired(self) -> Paired:
        return Paired(self.ratio, self.low, self.high, self.pairs, self.against, self.baseline_median, self.bound)


class Prediction(BaseModel):
    """The twin's word on a candidate before the judge: its predicted headline against the best's,
    and whether that cleared the margin; or why the twin was not consulted (``skipped``)."""

    model_config = ConfigDict(extra="forbid")
    metric: str = ""
    headline: float | None = None
    best: float | None = None
    best_round: int | None = None
    margin: float | None = None
    passed: bool | None = None
    untrusted: PrintableText | None = None  # it did what no real run has shown the twin: judged for real
    skipped: PrintableText | None = None  # (both may quote a candidate's error on the twin)


class GeneralizationRejected(BaseModel):
    """A run of the best, or of the starter beside it, failed the judge where the search never looked:
    no figure of the best there can count, and the reader is told which run and why."""

    model_config = ConfigDict(extra="forbid")
    best_round: int
    best_commit: str
    held_out_seeds: list[int]
    figure: str  # "in-search", "held-out" or "perturbed"
    run: str  # "the best" or "the starter"
    seed: int
    reasons: list[PrintableText]

    def said(self) -> str:
        where = "on its round's seed" if self.figure == "in-search" else f"on {self.figure} seed"
        return f"{self.run} failed its checks {where} {self.seed}: {self.reasons[0] if self.reasons else '?'}"


class Generalization(BaseModel):
    """The best over the starter, paired by seed: in search (the best round's seeds), held out, and
    held out on a perturbed workload (``orchestrator/generalization.py``)."""

    model_config = ConfigDict(extra="forbid")
    best_round: int
    best_commit: str
    in_search: Promotion
    held_out: Promotion
    held_out_seeds: list[int]
    perturbed: Promotion | None = None
    perturbation: str = ""  # what was scaled, and by how much
    not_perturbed: str | None = None  # why the workload could not be perturbed
    # the best's step as a fraction of the step's fluid lower bound (median of its runs), per figure
    # ("in-search", "held-out", "perturbed"): unlike a ratio over the starter, it does not move with
    # how the starter itself fares on a workload (a tail-bound starter gains where the tail is capped)
    bound: dict[str, float] = {}
    # the same figures in the response tokens of the trajectories trained (the paired ratio, per figure):
    # below the ratio, the best trained shorter trajectories than the starter did on the same seeds
    tokens: dict[str, float] = {}

    def kept(self, figure: Promotion | None) -> float | None:
        """The share of the in-search ratio a figure keeps (1.0: all of it)."""
        if figure is None or not self.in_search.ratio:
            return None
        return figure.ratio / self.in_search.ratio


class RoundRecord(BaseModel):
    # validated as it is assigned too: the round loop fills a record in as the round goes (an account, reasons)
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    round: int
    task: Task
    parent_round: int | None
    parent_commit: str
    verdict: Literal["accepted", "rejected", "prescreened", "error"]
    commit: str | None = None
    headline: float | None = None
    parent_headline: float | None = None
    metrics: dict = {}
    spread: dict = {}
    hints: list[Hint] = []
    paired: Promotion | None = None
    prediction: Prediction | None = None
    profile: str = ""  # the harness's view of where the median repeat's time went, per call
    llm: dict = {}  # this round's LLM calls, tokens and cost (an LLM backend only)
    reasons: list[PrintableText] = []
    account: PrintableText = ""  # the implementer's own account of its last attempt's change
    attempts: int = 0
    seconds: float = 0.0
    became_best: bool = False

    @property
    def screened_out(self) -> bool:
        """The twin predicted it beyond the margin behind the best (not a twin failure, not a skip)."""
        return self.prediction is not None and self.prediction.passed is False


class RunState(BaseModel):
    model_config = ConfigDict(extra="forbid")
    config: RunConfig
    backlog: list[Task] = []
    rounds: list[RoundRecord] = []
    best_round: int | None = None
    seconds_used: float = 0.0
    llm_used: dict = {}  # calls, tokens and cost over the whole run, across resumes
    # the target spec the run started on, resolved (a --resume is refused where a value of it changed);
    # empty in runs from before it was kept
    spec_at_start: dict = {}
    created_at: float = 0.0
    twin: str | None = None  # the calibrated twin's spec, once round 0 has calibrated it
    twin_from: list[int] = []  # the validated rounds whose traces the twin is fitted to
    twin_unfitted: list[str] = []  # what no calibration run did (a candidate that does it is judged for real)
    twin_predictions: dict[str, float] = {}  # commit -> its headline on this twin (the best's, reused)
    harness_timed_predictions: dict[str, float] = {}  # the same on the twin of what the harness timed alone
    generalization: Generalization | None = None  # the best, measured where the search never looked
    generalization_rejected: GeneralizationRejected | None = None  # or why that measurement cannot count

    # -- queries -----------------------------------------------------------------------------------
    @property
    def next_round(self) -> int:
        return len(self.rounds)

    def record(self, number: int) -> RoundRecord | None:
        return next((r for r in self.rounds if r.round == number), None)

    @property
    def best(self) -> RoundRecord | None:
        return self.record(self.best_round) if self.best_round is not None else None

    def accepted(self) -> list[RoundRecord]:
        return [r for r in self.rounds if r.verdict == "accepted"]

    def abandoned(self) -> set[str]:
        """Task ids the run gave up on: rejected, screened out, or validated without beating the best,
        where tried on a best; a near miss (``near_misses``) only once it has missed on
        ``NEAR_MISS_TRIES`` bests. A follow-up on a controller switch that lost (its parent never the
        best) says nothing of the technique on the best's controller: the paper-scale search's host tier,
        tried first on a losing static split, was otherwise never tried again on the best's line."""
        missed: dict[str, int] = {}
        given_up = set()
        for r in self._measured_on_a_best():
            if near_miss(r):
                missed[r.task.id] = missed.get(r.task.id, 0) + 1
            else:
                given_up.add(r.task.id)
        return given_up | {task for task, count in missed.items() if count >= NEAR_MISS_TRIES}

    def near_misses(self) -> list[RoundRecord]:
        """The latest trial of each task that came out a gain inside the noise on a best (its paired
        interval reaches above 1 but its low end did not clear the threshold) and is not given up on:
        worth one more try on a later best, where the rest of the set may now favour it (the paper-scale
        search's host tier: +1% on round 4's best, 12-19% on later ones); none that a later try
        promoted. The closest to promotion first."""
        over = self.abandoned() | {r.task.id for r in self.rounds if r.became_best}
        latest = {r.task.id: r for r in self._measured_on_a_best() if r.task.id not in over}
        return sorted(latest.values(), key=lambda r: (-r.paired.ratio, r.round))

    def _measured_on_a_best(self) -> list[RoundRecord]:
        """The rounds tried on a candidate that was (or became) the best, and not promoted themselves."""
        bests = {r.commit for r in self.rounds if r.became_best and r.commit}
        return [
            r
            for r in self.rounds
            if r.round > 0
            and r.parent_commit in bests
            and (r.verdict in ("rejected", "prescreened") or (r.verdict == "accepted" and not r.became_best))
        ]

    def tried(self) -> set[tuple[str, str]]:
        """(parent commit, task id) pairs already attempted: never run the same change twice. A round that
        ended in an error (the best failing beside it, a git or disk error: the candidate was never judged)
        leaves its pair open once more; a second error closes it, so an error that always comes cannot loop."""
        errors = Counter((r.parent_commit, r.task.id) for r in self.rounds if r.verdict == "error")
        return {(r.parent_commit, r.task.id) for r in self.rounds if r.verdict != "error"} | {
            pair for pair, count in errors.items() if count >= RETRIES_AFTER_ERROR + 1
        }

    # -- persistence -------------------------------------------------------------------------------
    @classmethod
    def load(cls, run_dir: Path) -> RunState:
        """The saved state, with the LLM use of calls made after it was saved (a round killed midway
        paid for them: forgetting them would let a resumed run spend its budget twice)."""
        run = RunDir(run_dir)
        if not Path(run_dir).exists():
            raise RunStateError(f"{run_dir} does not exist: give the folder a run was started in (its --out)")
        if not Path(run_dir).is_dir():
            raise RunStateError(f"{run_dir} is a file: give the folder a run was started in (its --out)")
        if not run.state_file.exists():
            if _has_rounds(run_dir):  # a run's repository whose state went: "start it anew" would refuse it
                raise RunStateError(
                    f"{run_dir} has lost its run state ({run.state_file}), so it cannot go on; its candidates are "
                    f"intact in git (git -C {run_dir} log --all, each with its round's record): start a new run "
                    "with another --out, and vibetrain export a candidate from this one if you need it"
                )
            raise RunStateError(
                f"{run_dir} has no run state ({run.state_file}): not a vibetrain run, or it never started"
            )
        try:
            state = cls.model_validate_json(run.state_file.read_text())
        except OSError as error:  # a folder, unreadable
            raise RunStateError(f"{run.state_file} cannot be read ({error.strerror})") from None
        except ValidationError as error:
            first = _first_problem(error)
            raise RunStateError(
                f"{run.state_file} is corrupt ({first}); the candidates are intact in git: "
                f"git -C {run_dir} log --all lists them, each with its round's record"
            ) from None
        except ValueError as error:
            first = str(error).strip().splitlines()[0]
            raise RunStateError(
                f"{run.state_file} is corrupt ({first}); the candidates are intact in git: "
                f"git -C {run_dir} log --all lists them, each with its round's record"
            ) from None
        spend = load_llm_spend(run_dir)
        if spend.get("calls", 0) > state.llm_used.get("calls", 0):
            state.llm_used = spend
        return state

    def save(self, run_dir: Path) -> None:
        """Atomic: a reader (or a resumed run) sees the previous state or this one, never a torn file."""
        write_atomically(RunDir(run_dir).state_file, self.model_dump_json(indent=1), "the run state")


def save_llm_spend(run_dir: Path, used: dict) -> None:
    """The run's LLM use so far (calls, tokens, dollars), after every call."""
    write_atomically(RunDir(run_dir).llm_spend_file, json.dumps(used), "the LLM spend")


def load_llm_spend(run_dir: Path) -> dict:
    path = RunDir(run_dir).llm_spend_file
    if not path.exists():
        return {}
    try:
        used = json.loads(path.read_text())
    except ValueError as error:
        raise RunStateError(f"{path} is corrupt ({error}); delete it to count only the spend saved by rounds") from None
    if not isinstance(used, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in used.values()
    ):
        raise RunStateError(f"{path} holds {str(used)[:200]}, not the run's LLM use (numbers by name); delete it")
    return used


def _has_rounds(run_dir: Path) -> bool:
    """Whether a run's repository holds a committed round (a ref under ``refs/vibetrain/``, loose or packed):
    a start killed before its first state holds none, and is started again by the same command."""
    git_dir = run_dir / ".git"
    packed = git_dir / "packed-refs"
    return (git_dir / "refs" / "vibetrain").is_dir() or (packed.is_file() and "refs/vibetrain/" in packed.read_text())


def write_atomically(path: Path, text: str, what: str) -> None:
    """Temp file, fsync, rename, fsync of the folder: a reader sees the previous version or this one, never a
    torn file, and once this returns a power loss keeps this one."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:  # the rename itself flushed: else a power loss can bring back the previous version
            os.fsync(folder)
        finally:
            os.close(folder)
    except OSError as error:
        if "tmp" in locals() and os.path.exists(tmp):
            os.unlink(tmp)
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise RunStateError(
                f"disk full while saving {what} to {path}: every validated candidate is "
                "committed in git; free some space and run again with --resume"
            ) from None
        raise RunStateError(  # a disk error, a folder made read-only: said, with what the run kept
            f"{what} could not be saved to {path} ({error.strerror or error}): every validated candidate is "
            "committed in git; fix it and run again with --resume"
        ) from None


def new_state(config: RunConfig) -> RunState:
    return RunState(config=config, created_at=time.time())


def _first_problem(error: ValidationError) -> str:
    """A state's first problem by its field and value (pydantic's header line names neither)."""
    problem = error.errors()[0]
    where = ".".join(str(part) for part in problem["loc"]) or "the file"
    if problem["type"] == "json_invalid":
        return f"not JSON: {problem['msg']}"
    said = f"{where}: {problem['msg']}"
    if problem["type"] == "extra_forbidden":
        return f"{said}; a newer vibetrain may have written it"
    return f"{said} (got {problem['input']!r:.80})" if problem["type"] != "missing" else said
