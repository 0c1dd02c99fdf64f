"""Decode throughput of the engine recipes vs transformers' ``generate``, same model and batch, measured
side by side in one run: the paged engine (the starter's default). Prints tokens/s for each and the
ratio to transformers.

    python benchmarks/engine_decode.py [--target tiny-qwen3-cpu] [--batch 32] [--new-tokens 64] [--repeat 5]
"""

from __future__ import annotations

import statistics
import time

import torch
import typer
from rich.console import Console
from rich.table import Table
from transformers_baseline import generate_greedy

from skills.recipes.paged_engine import PagedEngine
from targets.api import SamplingParams
from targets.harness.judge.accuracy import fixed_prompts
from targets.harness.model import load_model, model_dir
from targets.spec import load_target


def _timed(fn, repeat: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main(
    target: str = "tiny-qwen3-cpu", batch: int = 32, new_tokens: int = 64, prompt_tokens: int = 16, repeat: int = 5
) -> None:
    spec = load_target(target)
    path = model_dir(spec.model)
    prompts = [p[:1] * (prompt_tokens - len(p)) + p for p in fixed_prompts(batch)]  # equal lengths: no padding
    engines = {
        "paged engine (recipe)": PagedEngine(
            str(path), spec.model.dtype, kv_tokens=batch * (prompt_tokens + new_tokens) * 2
        )
    }
    model = load_model(path, spec.model.dtype)
    input_ids = torch.tensor(prompts)
    greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)  # no stop tokens: exactly new_tokens each

    def runner(engine):
        def run() -> None:
            out = engine.generate(prompts, greedy)
            assert all(len(c.tokens) == new_tokens for c in out)

        return run

    def run_hf() -> None:
        generate_greedy(model, input_ids, new_tokens)

    tokens = batch * new_tokens
    results = {"transformers generate": _timed(run_hf, repeat)} | {
        name: _timed(runner(e), repeat) for name, e in engines.items()
    }
    base = statistics.median(results["transformers generate"])
    table = Table(
        title=f"decode on {target}: batch {batch}, {prompt_tokens} prompt + {new_tokens} new tokens, "
        f"{torch.get_num_threads()} threads"
    )
    for column in ("engine", "median s", "spread s", "tokens/s", "ratio vs transformers"):
        table.add_column(column, justify="right")
    for name, times in results.items():
        median = statistics.median(times)
        table.add_row(
            name, f"{median:.3f}", f"{max(times) - min(times):.3f}", f"{tokens / median:,.0f}", f"{base / median:.2f}x"
        )
    Console().print(table)


if __name__ == "__main__":
    typer.run(main)
