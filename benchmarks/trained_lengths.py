"""How much of a best's ratio over its starter is the lengths it chose to train?

Goodput counts trajectories; a schedule that trains the shorter trajectories of a workload (spares keep the
first members to finish, a staleness bound drops the longest-lived, a fixed number of steps leaves the
longest running when the run ends) raises it more than it raises the tokens it trains. This script reads the
runs ``vibetrain generate --held-out N`` made where the search never looked (the best and the starter, paired
by seed, on the held-out seeds and on the perturbed workload) and prints, seed by seed, the goodput ratio,
the same ratio in trained response tokens (``trained_tokens_per_s``) and in trained context tokens, and the
trained trajectories' final contexts (median, 90th and 99th percentiles, and how many reached the workload's
``max_sequence``) for both. Where the two ratios agree, both trained the same lengths.

    python benchmarks/trained_lengths.py RUN
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from orchestrator.run_dir import RunDir
from targets.harness.measure.metrics import compute_metrics
from targets.harness.sim.lower_bound import trace_turns
from targets.harness.trace import Trace

CAPPED = 0.9  # a context within 10% of max_sequence counts as cut by it (a turn longer would not fit)


@dataclass(frozen=True)
class Trained:
    """One run: its goodput, its trained tokens per second, and its trained trajectories' final contexts."""

    goodput: float
    response_tokens_per_s: float
    context_tokens_per_s: float
    contexts: list[int]  # sorted

    def quantile(self, q: float) -> int:
        return self.contexts[int(q * (len(self.contexts) - 1))]


def read(run: Path) -> Trained:
    events = Trace.load_events(run / "trace.jsonl")
    devices = next(e for e in events if e.kind == "run_start").data["devices"]
    metrics = compute_metrics(events, devices)
    turns = trace_turns(events)
    trained = {t["episode"] for e in events if e.kind == "train" for t in e.data["trajectories"]}
    contexts = sorted(turns[ep][-1][0] + turns[ep][-1][2] for ep in trained if ep in turns)
    return Trained(
        goodput=metrics["goodput"],
        response_tokens_per_s=metrics["trained_tokens_per_s"],
        context_tokens_per_s=sum(contexts) / metrics["duration_s"],
        contexts=contexts,
    )


def main(run: Path) -> None:
    runs = RunDir(run).outputs / "generalization" / "runs"
    if not (runs / "perturbed.yaml").is_file():
        sys.exit(f"{run}: no runs on a perturbed workload (generate with --held-out N on a simulated catalog target)")
    # the perturbation keeps the model's sequence: one max_sequence for both workloads
    limit = yaml.safe_load((runs / "perturbed.yaml").read_text())["workload"]["tokens"]["max_sequence"]

    def lengths(t: Trained) -> str:
        capped = sum(1 for c in t.contexts if c >= CAPPED * limit)
        return f"{t.quantile(0.5)} / {t.quantile(0.9)} / {t.quantile(0.99)} / {capped}"

    print(
        "| workload | seed | goodput x | response tokens x | context tokens x | trained contexts, the starter: "
        "median / p90 / p99 / within 10% of max_sequence | the best: the same |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for workload in ("held-out", "perturbed"):
        for candidate in sorted((runs / workload).glob("candidate-*")):
            i = candidate.name.split("-")[1]
            starter, best = read(runs / workload / f"baseline-{i}"), read(candidate)
            print(
                f"| {workload} | {i} | {best.goodput / starter.goodput:.2f}x "
                f"| {best.response_tokens_per_s / starter.response_tokens_per_s:.2f}x "
                f"| {best.context_tokens_per_s / starter.context_tokens_per_s:.2f}x | {lengths(starter)} "
                f"| {lengths(best)} |"
            )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
