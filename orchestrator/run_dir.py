"""A generate run's directory and the named places in it. The best candidate's files are its work
tree; everything else the run keeps (its state, the judge's and evaluator's outputs, traces) lives
under ``.git/`` where no commit tracks it and ``git status`` stays clean."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def state_file(self) -> Path:
        return self.root / ".git" / "run_state.json"

    @property
    def llm_spend_file(self) -> Path:
        """The run's LLM use, saved after every call (the run state saves it only between rounds)."""
        return self.root / ".git" / "llm_spend.json"

    @property
    def time_used_file(self) -> Path:
        """The run's wall time, saved every few seconds (``run_clock.py``; the state saves it between rounds)."""
        return self.root / ".git" / "time_used.json"

    @property
    def outputs(self) -> Path:
        """Judge and evaluator outputs of rounds in progress, traces, rendered figures."""
        return self.root / ".git" / "vibetrain"

    @property
    def writer_lock(self) -> Path:
        """Held by the process running the run (``writer_lock.py``)."""
        return self.outputs / "writer.flock"

    def round_outputs(self, number: int) -> Path:
        return self.outputs / f"round-{number}"

    def error_file(self, number: int) -> Path:
        """The traceback of a round that met an error (kept: the round's outputs go when it ends)."""
        return self.outputs / "errors" / f"round-{number}.txt"

    @property
    def traces(self) -> Path:
        return self.outputs / "traces"

    def trace(self, number: int) -> Path:
        """The harness trace of an accepted round's median measured run."""
        return self.traces / f"round-{number}.jsonl"

    @property
    def twin_spec(self) -> Path:
        """The calibrated twin (a simulated target spec) the pre-screen runs candidates on."""
        return self.outputs / "twin.yaml"
