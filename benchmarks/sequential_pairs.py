"""What the evaluator's sequential rule (``agents/offline/evaluator.py``: one more pair while the
estimate clears the bar and its interval does not, up to twice ``--repeat``) does to promotions, by
Monte Carlo over log-normal pair-to-pair noise: the share of candidates promoted for each true gain,
with a fixed number of pairs and with the rule, and the pairs the rule spends on average.

    python benchmarks/sequential_pairs.py [--pairs 3] [--factor 2] [--threshold 0.05] [--trials 4000]
"""

from __future__ import annotations

import math
import random

import typer
from rich.console import Console
from rich.table import Table

from agents.offline.evaluator import undecided
from targets.harness.measure.session import Paired


def promoted(true: float, noise: float, pairs: int, most: int, threshold: float, rng: random.Random):
    """(promoted?, pairs measured) for one candidate whose true ratio is ``true``."""
    logs = [rng.gauss(math.log(true), noise) for _ in range(most)]
    more, count = undecided(threshold), pairs
    while True:
        paired = Paired.of([math.exp(x) for x in logs[:count]], [1.0] * count)
        if count >= most or not more(paired):
            return paired.clears(threshold), count
        count += 1


def main(pairs: int = 3, factor: int = 2, threshold: float = 0.05, trials: int = 4000, seed: int = 1) -> None:
    table = Table(title=f"promoted share, {pairs} pairs fixed vs sequential up to {factor * pairs} ({trials} trials)")
    for column in ("true gain", "pair noise", "fixed", "sequential", "mean pairs"):
        table.add_column(column, justify="right")
    for true in (1.0, 1 + threshold, 1.15, 1.30):
        for noise in (0.05, 0.12):
            rng = random.Random(seed)
            fixed = sum(promoted(true, noise, pairs, pairs, threshold, rng)[0] for _ in range(trials)) / trials
            rng = random.Random(seed)
            runs = [promoted(true, noise, pairs, factor * pairs, threshold, rng) for _ in range(trials)]
            table.add_row(
                f"{true - 1:+.0%}",
                f"{noise:.0%}",
                f"{fixed:.3f}",
                f"{sum(p for p, _ in runs) / trials:.3f}",
                f"{sum(n for _, n in runs) / trials:.2f}",
            )
    Console().print(table)


if __name__ == "__main__":
    typer.run(main)
