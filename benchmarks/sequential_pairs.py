"""What the evaluator's sequential rule (``agents/offline/evaluator.py``: one more pair while the
estimate clears the bar and the promotion rule does not, up to twice ``--repeat``, each look tested at
its share of the error, ``session.look_confidence``) does to promotions, by Monte Carlo over log-normal
pair-to-pair noise: the share of candidates promoted for each true gain, with a fixed number of pairs and
with the rule, and the pairs the rule spends on average. The row at the threshold is the rule's false
promotions (at most 2.5% by design); ``--every-look-at-95`` runs the rule as it was before (each look at
the plain 95% interval) beside it.

    python benchmarks/sequential_pairs.py [--pairs 3] [--factor 2] [--threshold 0.05] [--trials 4000]
"""

from __future__ import annotations

import math
import random

import typer
from rich.console import Console
from rich.table import Table

from agents.offline.evaluator import undecided
from targets.harness.measure.session import ALPHA, Paired, look_confidence


def promoted(
    true: float, noise: float, pairs: int, most: int, threshold: float, rng: random.Random, spent: bool = True
):
    """(promoted?, pairs measured) for one candidate whose true ratio is ``true`` (``spent``: each look at
    its share of the error, as the evaluator does; else every look at 95%)."""
    logs = [rng.gauss(math.log(true), noise) for _ in range(most)]
    more, count = undecided(threshold), pairs
    while True:
        confidence = look_confidence(count, pairs, most) if spent else 1 - ALPHA
        paired = Paired.of([math.exp(x) for x in logs[:count]], [1.0] * count, confidence=confidence)
        if count >= most or not more(paired):
            return paired.clears(threshold), count
        count += 1


def main(
    pairs: int = 3,
    factor: int = 2,
    threshold: float = 0.05,
    trials: int = 4000,
    seed: int = 1,
    every_look_at_95: bool = typer.Option(False, help="also the rule as it was: every look at 95%"),
) -> None:
    table = Table(title=f"promoted share, {pairs} pairs fixed vs sequential up to {factor * pairs} ({trials} trials)")
    columns = ["true gain", "pair noise", "fixed", "sequential", "mean pairs"]
    columns += ["every look at 95%", "its mean pairs"] if every_look_at_95 else []
    for column in columns:
        table.add_column(column, justify="right")
    for true in (1.0, 1 + threshold, 1.15, 1.30):
        for noise in (0.05, 0.12):
            rng = random.Random(seed)
            fixed = sum(promoted(true, noise, pairs, pairs, threshold, rng)[0] for _ in range(trials)) / trials
            row = [f"{true - 1:+.0%}", f"{noise:.0%}", f"{fixed:.3f}"]
            for spent in (True, False) if every_look_at_95 else (True,):
                rng = random.Random(seed)
                runs = [promoted(true, noise, pairs, factor * pairs, threshold, rng, spent) for _ in range(trials)]
                row += [f"{sum(p for p, _ in runs) / trials:.3f}", f"{sum(n for _, n in runs) / trials:.2f}"]
            table.add_row(*row)
    Console().print(table)


if __name__ == "__main__":
    typer.run(main)
