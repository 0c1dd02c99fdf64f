"""Twin pre-screen (cascade evaluation) on a real target.

The measured runs calibrate the cluster simulator to this machine (``vibetrain calibrate``'s fit): the
*twin*, a simulated copy of the target. It is fitted first to round 0's median trace and again after
every validated round, pooling all of them: a starter that never shrinks leaves the twin guessing what a
shrink costs until a candidate that shrinks has run for real. Every later candidate is first run on the
twin (seconds) next to the best, both on one seed; only a candidate predicted within ``margin`` of the
best goes on to the real judge and benchmark. A candidate whose twin run uses a mechanism no real run
has shown the twin yet (its cost is the spec's guess) is judged for real whatever the prediction: else
the first candidate that shrinks would be screened out on a guess, and every one after it, since the
twin only learns from candidates that ran for real. The fit also reads the engines' word on their work
(how long a request waited, what prefix it reused), which a candidate's engine could bend; so a second
twin is fitted to what the harness timed alone, and a candidate the first would screen out is judged for
real where the second predicts it within the margin: the engines' word never screens a candidate out on
its own. One predicted further behind is recorded as ``prescreened``, kept under the rejected ref, never
validated. The prediction stays in the round record next to what the real benchmark then measured, so a
reader can see how far to trust the twin.

A candidate that fails on the twin is a defect (a controller must run on both clusters): its
attempt fails with the twin's reasons, like a judge's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agents.roles import Verdict
from orchestrator.history import History
from orchestrator.run_dir import RunDir
from orchestrator.state import Prediction, RoundRecord, RunState
from targets.harness.measure.session import Measurement, Session
from targets.harness.sim.calibrate import calibrate, write_calibrated_spec
from targets.harness.sim.request_spans import harness_timed
from targets.harness.target import Target, TargetUnavailable
from targets.harness.trace import Trace

TWIN_SEED = 0  # one workload for every prediction, so the best's is computed once and reused


@dataclass
class Twin:
    session: Session  # a simulated target: the calibrated spec
    unfitted: tuple[str, ...] = ()  # trace event kinds no calibration run had: their cost is a guess
    harness_timed: Twin | None = None  # fitted without the engines' word (None: no engine said any)

    @classmethod
    def calibrated(cls, real: Session, traces: list[Path], path: Path) -> Twin:
        """Fit the simulator to real runs' traces and write the twin's spec to ``path`` (and beside it
        the twin fitted to what the harness timed alone, where an engine said anything of its work)."""
        runs = [Trace.load_events(trace) for trace in traces]
        calibration = calibrate(real.target.spec, runs)
        write_calibrated_spec(real.target.ref, calibration, path)
        blind = harness_timed_path(path)
        timed = [harness_timed(run) for run in runs]
        if timed != runs:
            write_calibrated_spec(real.target.ref, calibrate(real.target.spec, timed), blind)
        else:
            blind.unlink(missing_ok=True)
        return cls.load(real, path, calibration.unfitted)

    @classmethod
    def load(cls, real: Session, path: Path, unfitted: Sequence[str] = ()) -> Twin:
        blind = harness_timed_path(path)
        timed = cls.load(real, blind, unfitted) if blind.exists() else None
        session = Session(Target.load(path, simulate=True), real.sandbox, real.limits, real.task_key)
        return cls(session, tuple(unfitted), timed)

    def guessed(self, measurement: Measurement) -> list[str]:
        """The mechanisms a twin run used whose cost no real run has fitted."""
        return sorted({e.kind for e in measurement.events()} & set(self.unfitted))

    def predict(self, stack_dir: Path, out: Path) -> Measurement:
        """The candidate's audited run on the twin (its ``ok`` says whether it ran cleanly)."""
        return self.session.measure(stack_dir, out, TWIN_SEED)

    def headline(self, measurement: Measurement) -> float:
        return measurement.metrics[self.session.target.spec.headline_metric.name]


def harness_timed_path(twin: Path) -> Path:
    """Where the twin fitted to what the harness timed alone is written, beside ``twin``."""
    return twin.with_name(f"{twin.stem}-harness-timed{twin.suffix}")


def clears(predicted: float, best: float, margin: float, maximize: bool) -> bool:
    """Predicted within ``margin`` (a fraction) of the best, in the metric's direction."""
    return predicted >= best * (1 - margin) if maximize else predicted <= best * (1 + margin)


def twin_said(record) -> str:
    """The twin's prediction for a round, next to what was then measured for real."""
    p = record.prediction
    if p.skipped is not None:
        return f"Twin: not consulted ({p.skipped})"
    measured = f"; measured {record.headline:.4g}" if record.headline is not None else "; not measured"
    untrusted = f"; not trusted: {p.untrusted}" if p.untrusted is not None else ""
    return (
        f"Twin: predicted {p.metric} {p.headline:.4g} against {p.best:.4g} for the best (round {p.best_round}), "
        f"both simulated on the twin, margin {p.margin:.0%}{untrusted}{measured}"
    )


class TwinError(RuntimeError):
    """The twin could not be calibrated (the round loop stops the run with what to do)."""


@dataclass
class PreScreen:
    """The twin's life in a run: calibrated from the traces of the validated rounds (after round 0,
    then after each validated round), and asked about each candidate before the judge."""

    session: Session  # the judge's: the twin runs in its sandbox, under its limits, with its workload key
    state: RunState
    history: History
    run_dir: RunDir
    on_event: Callable[..., None]
    _twin: Twin | None = None

    @property
    def on(self) -> bool:
        return self.state.config.prescreen

    def fitted_rounds(self) -> list[int]:
        """The validated rounds a twin is fitted to: those whose median trace the run kept."""
        return [r.round for r in self.state.accepted() if self.run_dir.trace(r.round).exists()]

    def outdated(self) -> bool:
        """No twin yet, or one fitted to other rounds than the validated ones: a run killed while it
        calibrated after a validated round (or after the new twin was written, before the state that
        names its rounds and predictions was) resumes with the old twin in its state."""
        return self.state.twin is None or self.state.twin_from != self.fitted_rounds()

    def calibrate(self) -> None:
        """The twin, fitted to the median traces of every validated round so far; the predictions
        made on the previous twin are dropped. The caller saves the state."""
        rounds = self.fitted_rounds()
        path = self.run_dir.twin_spec
        try:
            self._twin = Twin.calibrated(self.session, [self.run_dir.trace(n) for n in rounds], path)
        except (OSError, ValueError, RuntimeError) as error:
            raise TwinError(
                f"could not calibrate the twin from the traces of rounds {rounds}: {type(error).__name__}: "
                f"{error}; resume with --no-prescreen to judge every candidate for real"
            ) from None
        self.state.twin, self.state.twin_from, self.state.twin_predictions = str(path), rounds, {}
        self.state.harness_timed_predictions = {}
        self.state.twin_unfitted = list(self._twin.unfitted)
        self.on_event("twin", path=path, rounds=rounds)

    def twin(self) -> Twin | None:
        """The calibrated twin, loaded from the run's own folder (wherever the run was moved since)."""
        if not self.on or self.state.twin is None:
            return None
        if self._twin is None:
            path = self.run_dir.twin_spec
            try:
                self._twin = Twin.load(self.session, path, self.state.twin_unfitted)
            except (OSError, ValueError, TargetUnavailable) as error:
                raise TwinError(
                    f"the calibrated twin {path} cannot be loaded ({type(error).__name__}: {error}); "
                    "resume with --no-prescreen to judge every candidate for real"
                ) from None
        return self._twin

    def screen(self, record: RoundRecord, workspace: Path, out: Path) -> Verdict | None:
        """None: the candidate goes on to the judge. Otherwise the verdict that stops it here: it
        failed on the twin (the attempt's feedback), or ``record.prediction`` says it was predicted
        beyond the margin behind the best."""
        twin, best = self.twin(), self.state.best
        if twin is None or best is None:
            return None
        metric = self.session.target.spec.headline_metric
        best_headline = self._best_on(twin, self.state.twin_predictions, out)
        if isinstance(best_headline, str):  # the twin cannot run the best: judge for real, and say so
            record.prediction = Prediction(skipped=f"the best (round {best.round}) failed on the twin: {best_headline}")
            return None
        measured = twin.predict(workspace, out / "candidate")
        if not measured.ok:
            return Verdict.refused(
                "twin_prescreen", [f"the candidate failed on the twin: {r}" for r in measured.reasons]
            )
        predicted, margin = twin.headline(measured), self.state.config.prescreen_margin
        guessed = twin.guessed(measured)
        passed = bool(guessed) or clears(predicted, best_headline, margin, metric.direction == "maximize")
        untrusted = (
            f"it does what no real run has shown the twin yet ({', '.join(guessed)}): the twin's cost for that "
            "is the spec's guess, so it is judged for real"
            if guessed
            else None
        )
        if not passed and twin.harness_timed is not None:
            untrusted = self._harness_timed_clears(twin.harness_timed, workspace, out / "harness-timed")
            passed = untrusted is not None
        record.prediction = Prediction(
            metric=metric.name,
            headline=predicted,
            best=best_headline,
            best_round=best.round,
            margin=margin,
            passed=passed,
            untrusted=untrusted,
        )
        self.on_event("prescreen", round=record.round, prediction=record.prediction)
        if passed:
            return None
        reason = (
            f"predicted {metric.name} {predicted:.4g} against {best_headline:.4g} for the best (round {best.round}), "
            f"both simulated on the twin ({predicted / best_headline - 1:+.1%}), beyond the {margin:.0%} margin: "
            "not run for real"
        )
        return Verdict.refused("twin_prescreen", [reason])

    def _best_on(self, twin: Twin, predictions: dict[str, float], out: Path) -> float | str:
        """The best's headline on ``twin``, computed once a twin (kept in ``predictions``), or why the
        best failed on it."""
        best = self.state.best
        if best.commit not in predictions:
            measured = twin.predict(self.history.export(best.commit, out / "best-stack"), out / "best")
            if not measured.ok:
                return "; ".join(measured.reasons[:2])
            predictions[best.commit] = twin.headline(measured)
        return predictions[best.commit]

    def _harness_timed_clears(self, timed: Twin, workspace: Path, out: Path) -> str | None:
        """Why a candidate the twin would screen out is judged for real after all: the twin fitted to what
        the harness timed alone predicts it within the margin (or cannot say), so only the engines' word
        would have screened it out. None where that twin screens it out too."""
        best = self._best_on(timed, self.state.harness_timed_predictions, out)
        measured = timed.predict(workspace, out / "candidate")
        if isinstance(best, str) or not measured.ok:
            failed = best if isinstance(best, str) else "; ".join(measured.reasons[:2])
            return f"the twin fitted to what the harness timed alone could not run it ({failed}): judged for real"
        metric, predicted = self.session.target.spec.headline_metric, timed.headline(measured)
        if not clears(predicted, best, self.state.config.prescreen_margin, metric.direction == "maximize"):
            return None
        return (
            f"fitted to what the harness timed alone (the engines' word on their waits and prefixes set aside), "
            f"the twin predicts {metric.name} {predicted:.4g} against {best:.4g} for the best, within the margin: "
            "the engines' word alone would screen it out, so it is judged for real"
        )
