"""Twin pre-screen (cascade evaluation) on a real target.

The measured runs calibrate the cluster simulator to this machine (``vibetrain calibrate``'s fit):
the *twin*, a simulated copy of the target. It is fitted first to round 0's median trace and again
after every validated round, pooling all of them: a starter that never shrinks leaves the twin
guessing what a shrink costs until a candidate that shrinks has run for real. Every later
candidate is first run on the twin (seconds) next to the best, both on one seed; only a candidate
predicted within ``margin`` of the best goes on to the real judge and benchmark. A candidate whose
twin run uses a mechanism no real run has shown the twin yet (its cost is the spec's guess) is judged
for real whatever the prediction: else the first candidate that shrinks would be screened out on a
guess, and every one after it, since the twin only learns from candidates that ran for real. One predicted
further behind is recorded as ``prescreened``, kept under the rejected ref, never validated. The
prediction stays in the round record next to what the real benchmark then measured, so a reader
can see how far to trust the twin.

A candidate that fails on the twin is a defect (a controller must run on both clusters): its
attempt fails with the twin's reasons, like a judge's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from targets.harness.session import Measurement, Session
from targets.harness.sim.calibrate import calibrate, write_calibrated_spec
from targets.harness.target import Target
from targets.harness.trace import Trace

TWIN_SEED = 0  # one workload for every prediction, so the best's is computed once and reused


@dataclass
class Twin:
    session: Session  # a simulated target: the calibrated spec
    unfitted: tuple[str, ...] = ()  # trace event kinds no calibration run had: their cost is a guess

    @classmethod
    def calibrated(cls, real: Session, traces: list[Path], path: Path) -> Twin:
        """Fit the simulator to real runs' traces and write the twin's spec to ``path``."""
        calibration = calibrate(real.target.spec, [Trace.load_events(trace) for trace in traces])
        write_calibrated_spec(real.target.ref, calibration, path)
        return cls.load(real, path, calibration.unfitted)

    @classmethod
    def load(cls, real: Session, path: Path, unfitted: Sequence[str] = ()) -> Twin:
        return cls(Session(Target.load(path, simulate=True), real.sandbox, real.limits, real.task_key), tuple(unfitted))

    def guessed(self, measurement: Measurement) -> list[str]:
        """The mechanisms a twin run used whose cost no real run has fitted."""
        return sorted({e.kind for e in measurement.events()} & set(self.unfitted))

    def predict(self, stack_dir: Path, out: Path) -> Measurement:
        """The candidate's audited run on the twin (its ``ok`` says whether it ran cleanly)."""
        return self.session.measure(stack_dir, out, TWIN_SEED)

    def headline(self, measurement: Measurement) -> float:
        return measurement.metrics[self.session.target.spec.headline_metric.name]


def clears(predicted: float, best: float, margin: float, maximize: bool) -> bool:
    """Predicted within ``margin`` (a fraction) of the best, in the metric's direction."""
    return predicted >= best * (1 - margin) if maximize else predicted <= best * (1 + margin)


def twin_said(record) -> str:
    """The twin's prediction for a round, next to what was then measured for real."""
    prediction = record.prediction
    if "skipped" in prediction:
        return f"Twin: not consulted ({prediction['skipped']})"
    measured = f"; measured {record.headline:.4g}" if record.headline is not None else "; not measured"
    untrusted = f"; not trusted: {prediction['untrusted']}" if "untrusted" in prediction else ""
    return (
        f"Twin: predicted {prediction['metric']} {prediction['headline']:.4g} against the best's "
        f"{prediction['best']:.4g} (round {prediction['best_round']}, margin {prediction['margin']:.0%})"
        f"{untrusted}{measured}"
    )
