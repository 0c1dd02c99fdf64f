"""What the independence test's guess plan costs (``plan_guesses``, ``targets/harness/judge/sampling_tests.py``):
seconds and peak Python memory on random turns, every turn guessed, as a long-context GPU target's audit
would ask (459 drawn turns and as many segments at up to 64K tokens: millions of tokens).

    python benchmarks/plan_guesses_cost.py [--tokens 100000] [--turns 1000] [--vocab 151936]

Random tokens share few contexts, so every context is a new entry: the plan's worst case for memory.
"""

from __future__ import annotations

import random
import sys
import time
import tracemalloc
from pathlib import Path

import typer

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from targets.harness.judge.sampling_tests import Draw, plan_guesses  # noqa: E402


def main(tokens: int = 100_000, turns: int = 1000, vocab: int = 151_936, seed: int = 0) -> None:
    rng = random.Random(seed)
    length = tokens // turns
    draws = [
        Draw(float(k), f"e{k // 2}", (), tuple(rng.randrange(vocab) for _ in range(length)), frozenset({0}))
        for k in range(turns)
    ]
    start = time.perf_counter()
    plan = plan_guesses(draws, set(range(turns)))
    took = time.perf_counter() - start
    tracemalloc.start()  # a second pass for the memory (tracing slows Python several times over)
    plan_guesses(draws, set(range(turns)))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    guesses = sum(len(g) for g in plan.values())
    print(f"{turns * length:,} tokens in {turns:,} turns: {took:.2f} s, peak +{peak / 1e6:.0f} MB, {guesses:,} guesses")


if __name__ == "__main__":
    typer.run(main)
