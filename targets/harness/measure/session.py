"""The judge and the benchmark for one target: every run of candidate code goes through a ``Session``.

* ``check(stack)``: the static integrity scan (a candidate that fails it never runs), then one
  harness child running accuracy checks 1-3, a system run and its audit, then the checks only the
  parent can make: the harness's own files and the candidate's files unchanged, and the harness's
  clock against the parent's own measurement of the run.
* ``measure(stack, seed)``: a system run judged exactly like the check's (the same scan, the same
  audit, the same candidate processes with the same arguments: a candidate cannot tell them apart),
  and the metrics of its trace.
* ``compare(candidate, baseline, seeds)``: paired measurement, runs interleaved A B B A ... with the
  same seed per pair, and the ratio of the headline with a 95% confidence interval.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
import statistics
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from targets.api import TraceEvent
from targets.errors import UserError
from targets.harness.isolation.launch import HarnessRun, Limits, run_harness
from targets.harness.isolation.sandbox import Sandbox
from targets.harness.isolation.stack_digest import TRASH, directory_digest
from targets.harness.isolation.staging import staged
from targets.harness.judge import integrity as integrity_scan
from targets.harness.judge.check_result import CheckResult
from targets.harness.judge.integrity import compile_harness, harness_changes, harness_digest, scan_stack
from targets.harness.measure import student_t
from targets.harness.measure.run_metrics import run_metrics
from targets.harness.target import Target
from targets.harness.trace import Trace

CLOCK_TOLERANCE = (0.05, 0.5)  # relative, absolute seconds: the pipe and the parent's wake-up are fast
ALPHA = 0.025  # one-sided: a candidate no better than the threshold is promoted at most this often
EARLY_SHARE = 0.3  # of ALPHA, spent over a sequential comparison's looks before its last (the rest at its last)


def look_confidence(pairs: int, first: int, last: int) -> float:
    """The one-sided confidence a sequential comparison's look at ``pairs`` pairs is tested at, of looks
    from ``first`` to ``last`` pairs: its error spent over them (Bonferroni), 30% over the early looks and
    70% at the last, so that promoting at any look errs at most ALPHA in all. Testing every look at 95%
    promoted a candidate exactly at the threshold 6% of the time, not 2.5% (a simulation of 10,000
    evaluations, 3 to 6 pairs); spent so, 2.0%, and a real 15% gain is promoted 78% of the time at a
    noise of 0.06 (87% before, 84% deciding only at 6 pairs, which costs a clear winner 6 pairs, not 4)."""
    if last <= first:
        return 1 - ALPHA
    if pairs >= last:
        return 1 - ALPHA * (1 - EARLY_SHARE)
    return 1 - ALPHA * EARLY_SHARE / (last - first)


def remove_bytecode_caches(stack_dir: Path) -> list[str]:
    """Delete every ``__pycache__`` folder of a candidate directory (git's own folder aside) and name
    them. Called before each run of candidate code: Python loads a cached ``.pyc`` instead of its
    source when the header matches the source's size and time, or whatever the source says when the
    ``.pyc`` is unchecked-hash, so a planted one would run code the integrity scan never read (and the
    ``candidate_unchanged`` digest skips caches). Removing them loses nothing: bytecode is rebuilt
    from source on import, where the sandbox lets the candidate write it at all. A measured run runs a
    copy of ``stack/`` alone (``staging.py``, caches left out); the root's caches go too, for a benchmark
    that runs ``run_harness`` on the folder itself, whose root is then on ``sys.path``.

    Runs of one candidate may start side by side (``benchmark`` runs simulations in parallel), so a
    cache is first renamed away, which only one of them can do, and then deleted: a run that finds it
    gone leaves it to the other, and a candidate writing fresh bytecode starts a new folder."""
    removed = []
    for root, folders, _ in os.walk(stack_dir):
        caches = [f for f in folders if f == "__pycache__"]
        folders[:] = [f for f in folders if f not in (".git", "__pycache__")]  # a folder named like trash too
        for name in caches:
            cache = Path(root) / name
            trash = cache.with_name(f"{TRASH}{os.getpid()}.{threading.get_ident()}")
            try:
                os.rename(cache, trash)
            except FileNotFoundError:
                continue  # another run of this candidate removed it first
            if trash.is_symlink():
                trash.unlink()
            else:
                shutil.rmtree(trash)
            removed.append(str(cache.relative_to(stack_dir)))
    return sorted(removed)


def clock_check(run: HarnessRun, events: list[TraceEvent]) -> CheckResult:
    """The harness trace's run duration against the parent's own stopwatch of the same run."""
    start = next((e.t for e in events if e.kind == "run_start"), None)
    end = next((e.t for e in events if e.kind == "run_end"), None)
    measured = run.parent_seconds
    if start is None or end is None or measured is None:
        return CheckResult(
            "clock", False, ["the run's start and end were not both seen by the harness and the parent"], {}
        )
    recorded = end - start
    allowed = CLOCK_TOLERANCE[0] * measured + CLOCK_TOLERANCE[1]
    details = {"trace_seconds": recorded, "parent_seconds": measured}
    if abs(recorded - measured) > allowed:
        return CheckResult(
            "clock",
            False,
            [
                f"the trace says the run took {recorded:.2f}s, the parent measured {measured:.2f}s: "
                "the clock that stamped the trace did not keep time"
            ],
            details,
        )
    return CheckResult("clock", True, [], details)


@dataclass
class Measurement:
    """One audited system run: its checks (all must pass for the metrics to count) and metrics."""

    checks: list[CheckResult]
    metrics: dict = field(default_factory=dict)
    trace_path: Path | None = None
    seed: int = 0

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def reasons(self) -> list[str]:
        return [f"{c.name}: {reason}" for c in self.checks if not c.passed for reason in c.reasons]

    def events(self) -> list[TraceEvent]:
        return Trace.load_events(self.trace_path) if self.trace_path else []


def _log_ratio(better: float, worse: float) -> float:
    """log(better / worse), with a headline of zero or infinity (no trajectory trained, no step
    finished) as the infinite ratio it is, and two equal ones (both zero, say) as no difference."""
    if better == worse:
        return 0.0
    if better == 0 or worse == math.inf:
        return -math.inf
    if worse == 0 or better == math.inf:
        return math.inf
    return math.log(better / worse)


@dataclass
class Paired:
    """Candidate over baseline on the headline (>1 is better whatever the metric's direction): the
    geometric mean of per-pair ratios and its 95% t-interval; ``bound``, the lower end the promotion rule
    reads: the interval's, or in a sequential comparison its lower end at its look's confidence
    (``look_confidence``)."""

    ratio: float
    low: float
    high: float | None  # None: unbounded (a single real pair says nothing of noise)
    pairs: int
    against: str = ""
    baseline_median: float | None = None  # the baseline's headline beside the candidate (median of its runs)
    bound: float | None = None  # None: ``low`` (a record from before the rule kept it)

    @classmethod
    def of(
        cls,
        candidate: list[float],
        baseline: list[float],
        maximize: bool = True,
        against: str = "",
        deterministic: bool = False,
        confidence: float = 1 - ALPHA,
    ) -> Paired:
        """``confidence``: the one-sided confidence ``bound`` is taken at (the interval is always 95%)."""
        logs = [_log_ratio(c, b) if maximize else _log_ratio(b, c) for c, b in zip(candidate, baseline)]
        n = len(logs)
        mean = statistics.fmean(logs)
        beside = statistics.median(baseline[:n])
        if not all(math.isfinite(x) for x in logs):  # a headline of zero or infinity: no interval
            ratio = 0.0 if mean == -math.inf else math.inf if mean == math.inf else math.nan
            return cls(ratio, 0.0, None, n, against, beside, 0.0)
        if n < 2:  # one simulated pair is exact for its seed; one real pair says nothing of noise
            if not deterministic:
                return cls(math.exp(mean), 0.0, None, n, against, beside, 0.0)
            return cls(math.exp(mean), math.exp(mean), math.exp(mean), n, against, beside, math.exp(mean))
        error = statistics.stdev(logs) / math.sqrt(n)
        half = student_t.quantile(1 - ALPHA, n - 1) * error
        bound = math.exp(mean - student_t.quantile(confidence, n - 1) * error)
        return cls(math.exp(mean), math.exp(mean - half), math.exp(mean + half), n, against, beside, bound)

    @classmethod
    def ratio_of(cls, candidate: list[float], baseline: list[float]) -> float | None:
        """The paired ratio alone, for a secondary figure beside the headline's (the same estimator on the
        same seeds: a ratio of medians beside a paired geometric mean read a difference of estimators as one
        of trajectories); None where a run measured 0 or infinity."""
        ratio = cls.of(candidate, baseline).ratio
        return ratio if math.isfinite(ratio) and ratio > 0 else None

    @property
    def look_bound(self) -> float | None:
        """The bound a sequential comparison's look was tested at, where it is not the interval's low end."""
        return self.bound if self.bound is not None and self.bound != self.low else None

    def clears(self, noise_threshold: float) -> bool:
        """The promotion rule: its ``bound`` above ``1 + noise_threshold``."""
        return (self.low if self.bound is None else self.bound) > 1 + noise_threshold

    def describe(self) -> str:
        def pct(x: float) -> str:
            return f"{(x - 1) * 100:+.1f}%"

        if self.high is None:
            if not (math.isfinite(self.ratio) and self.ratio > 0):
                return (
                    f"{pct(self.ratio)}, interval unbounded over {self.pairs} pair(s) (a headline was zero or infinite)"
                )
            return f"{pct(self.ratio)}, interval unbounded over {self.pairs} pair (one real pair measures no noise)"
        if self.pairs == 1 and self.low == self.high:  # a simulated pair: exact on its seed, silent on others
            return f"{pct(self.ratio)} on one seed (simulated: exact there; another seed would differ)"
        return f"{pct(self.ratio)}, interval [{pct(self.low)}, {pct(self.high)}] over {self.pairs} pair(s)"

    def as_dict(self) -> dict:
        return {
            "ratio": self.ratio,
            "low": self.low,
            "high": self.high,
            "pairs": self.pairs,
            "against": self.against,
            "baseline_median": self.baseline_median,
            "bound": self.bound,
        }


@dataclass
class Session:
    """The judge and the measurements of one target. ``task_key``: the secret every run's workload is
    drawn with (``environments/seeds.py``), drawn here unless given (a twin shares its real session's,
    so that both see the same tasks; ``b""`` is the public derivation), never shown to a candidate."""

    target: Target
    sandbox: Sandbox
    limits: Limits = field(default_factory=Limits)
    task_key: bytes = field(default_factory=lambda: secrets.token_bytes(16), repr=False)

    @classmethod
    def open(cls, target: Target, sandbox: str = "auto", time_limit_s: float | None = None) -> Session:
        """The one way a command or a run makes its session: the target's model files built here (a
        sandboxed child sees the model cache read-only), the sandbox named (``auto``: the best one
        here), each run's time limit the target's unless given. Raises ``SandboxUnavailable``."""
        target.runtime()
        return cls(target, Sandbox.detect(sandbox), Limits.of(target, time_limit_s))

    # -- the judge -------------------------------------------------------------------------------------
    def check(self, stack_dir: Path, out: Path | None = None, seed: int = 0) -> list[CheckResult]:
        return self.judge(stack_dir, out, seed).checks

    def judge(self, stack_dir: Path, out: Path | None = None, seed: int = 0) -> Measurement:
        """The check, with the figures of its system run (a measured run like any other)."""
        out = Path(out or tempfile.mkdtemp(prefix="vibetrain-check-"))
        return self._judged_run(stack_dir, out, "check", seed)

    def measure(self, stack_dir: Path, out: Path, seed: int, steps: int | None = None) -> Measurement:
        return self._judged_run(stack_dir, out, "measure", seed, steps)

    def _judged_run(self, stack_dir: Path, out: Path, mode: str, seed: int, steps: int | None = None) -> Measurement:
        remove_bytecode_caches(Path(stack_dir))  # only source runs: a planted .pyc never shadows it
        integrity = scan_stack(Path(stack_dir))
        if not integrity.passed:
            return Measurement(
                [
                    integrity,
                    CheckResult("not_run", False, ["the candidate was not executed: it failed the integrity scan"]),
                ]
            )
        checks = [integrity]
        if not (Path(stack_dir) / "stack" / "__init__.py").is_file():
            return Measurement([*checks, CheckResult("not_run", False, [f"{stack_dir} has no stack/__init__.py"])])
        compile_harness()
        harness_before, stack_before = harness_digest(), directory_digest(Path(stack_dir) / "stack")
        with staged(Path(stack_dir)) as copy:  # the same folder whether it runs as the candidate or the best
            as_copied = directory_digest(copy / "stack")  # a link to a file beside stack/ dangles in the copy
            run = run_harness(
                self.target, copy, out, mode, self.limits, self.sandbox, seed=seed, steps=steps, task_key=self.task_key
            )
            rewritten = directory_digest(copy / "stack") != as_copied  # the copy it ran, by its own hand
        changed = harness_changes(harness_before, harness_digest())
        if changed:
            shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
            root = integrity_scan.HARNESS_ROOT
            if self.sandbox.backend != "subprocess":  # mounted read-only in its sandbox: not the candidate's doing
                raise EnvironmentFailed(
                    f"vibetrain's own files under {root} changed during the run ({shown}), which the "
                    f"{self.sandbox.backend} sandbox mounts read-only to the candidate: was the checkout edited or "
                    "updated meanwhile?",
                    "vibetrain checkout",
                )
            checks.append(
                CheckResult(
                    "harness_unchanged",
                    False,
                    [f"harness files under {root} changed during the run: {shown}"],
                )
            )
        if rewritten or directory_digest(Path(stack_dir) / "stack") != stack_before:
            checks.append(CheckResult("candidate_unchanged", False, ["the candidate's own files changed while it ran"]))
        if mode == "check":
            accuracy = run.results.get("accuracy", {})
            if accuracy.get("status") != "ok":
                return Measurement(checks + [CheckResult("accuracy", False, [run.cause])], seed=seed)
            checks += [CheckResult.from_dict(c) for c in accuracy["checks"]]
        fault = run.results.get("system", {}).get("fault")
        if fault is not None:  # the environment's or the reward model's, never held against the candidate
            raise EnvironmentFailed(run.results["system"]["message"], fault)
        if run.results.get("system", {}).get("status") != "ok":
            return Measurement(checks + [CheckResult("system_run", False, [run.cause])], seed=seed)
        audit = run.results.get("audit", {})
        if audit.get("fault") is not None:  # the harness's own bug: no verdict on the candidate either way
            raise EnvironmentFailed(f"{audit['message']} (traceback: {out / 'audit.json'})", audit["fault"])
        if audit.get("status") != "ok":
            return Measurement(checks + [CheckResult("system_audit", False, [run.cause])], seed=seed)
        checks.append(CheckResult.from_dict(audit["result"]))
        if not run.ok:  # every phase answered, yet the run was killed at a limit or its process failed after
            return Measurement(checks + [CheckResult("system_run", False, [run.cause])], seed=seed)
        events = Trace.load_events(out / "trace.jsonl")
        if not self.target.simulated:
            checks.append(clock_check(run, events))
        metrics = run_metrics(self.target.spec, events, run.results["system"])
        return Measurement(checks, metrics, out / "trace.jsonl", seed)

    # -- paired measurement ------------------------------------------------------------------------------
    def compare(
        self,
        candidate: Path,
        baseline: Path,
        out: Path,
        seeds: list[int],
        against: str = "",
        first: Measurement | None = None,
        on_run: Callable[[str, int], None] = lambda name, i: None,
        pairs: int | None = None,
        more: Callable[[Paired], bool] = lambda paired: False,
    ) -> tuple[list[Measurement], list[Measurement], Paired]:
        """Interleaved A B / B A pairs with one seed each; raises ``MeasurementFailed`` on any finding.
        ``first``: a candidate run already made with ``seeds[0]`` (the judge's), which opens pair 0.
        ``pairs`` (default: one per seed) are measured; each further seed adds a pair only while
        ``more`` says the comparison so far needs one (a sequential test: the caller's rule)."""
        ours, theirs = [], []
        pairs = len(seeds) if pairs is None else pairs
        for i, seed in enumerate(seeds):
            if i >= pairs and not more(self._paired(ours, theirs, against, look_confidence(i, pairs, len(seeds)))):
                break
            order = [("candidate", candidate, ours), ("baseline", baseline, theirs)]
            for name, stack, into in order if i % 2 == 0 else order[::-1]:
                if i == 0 and name == "candidate" and first is not None:
                    measurement = first
                else:
                    measurement = self.measure(stack, out / f"{name}-{i}", seed)
                if not measurement.ok:
                    raise MeasurementFailed(name, i, measurement.reasons)
                into.append(measurement)
                on_run(name, i)
        return ours, theirs, self._paired(ours, theirs, against, look_confidence(len(ours), pairs, len(seeds)))

    def _paired(self, ours: list[Measurement], theirs: list[Measurement], against: str, confidence: float) -> Paired:
        metric = self.target.spec.headline_metric
        return Paired.of(
            [m.metrics[metric.name] for m in ours],
            [m.metrics[metric.name] for m in theirs],
            metric.direction == "maximize",
            against,
            deterministic=self.target.simulated,
            confidence=confidence,
        )


class MeasurementFailed(RuntimeError):
    """A measured run failed its checks: its figures cannot count."""

    def __init__(self, name: str, repeat: int, reasons: list[str]) -> None:
        super().__init__(f"{name} (repeat {repeat}): " + "; ".join(reasons[:5]))
        self.name, self.repeat, self.reasons = name, repeat, reasons


class EnvironmentFailed(UserError, RuntimeError):
    """The user's environment, the reward model's process, or the harness's own audit failed during a
    run (the message names it, and the episode and turn): never held against the candidate that was
    running. ``part`` says which (``environment``, ``reward model``, ``harness``)."""

    exit_code = 1

    def __init__(self, message: str, part: str = "environment") -> None:
        super().__init__(message)
        self.part = part
