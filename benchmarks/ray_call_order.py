"""How often Ray starts an async actor's calls out of the order one caller sent them, and how late.

The judge's order-of-service rule (docs/judge.md) assumes an engine takes its requests in the order the
harness forwarded them; the kit's engines make it so (``skills/recipes/arrival_order.py``) because Ray
does not. This measures what they correct: one caller sends numbered calls in bursts to one async actor
(as the Ray cluster sends turns to an engine), the actor notes when each call starts, and the script
prints how many started after a later-numbered one and by how much, with ``--load`` busy processes
beside it (a loaded machine, as a test suite or a real run is).

    python benchmarks/ray_call_order.py --calls 1600 --load 0 --load 2
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import tempfile
import time

import typer

app = typer.Typer(add_completion=False)


def _spin(stop) -> None:
    while not stop.is_set():
        pass


async def _measure(calls: int, burst: int) -> tuple[int, float]:
    """(calls started after a later-numbered one, the most any started after the first later one started, s)."""
    import ray

    @ray.remote
    class Actor:
        def __init__(self) -> None:
            self.started: list[tuple[int, float]] = []

        async def call(self, number: int, prompt: list[int]) -> int:
            self.started.append((number, time.perf_counter()))
            await asyncio.sleep(0.05)  # a request under way, as an engine's is
            return number

        async def seen(self) -> list[tuple[int, float]]:
            return self.started

    actor = Actor.remote()
    await actor.seen.remote()
    sent = []
    for number in range(calls):
        sent.append(actor.call.remote(number, list(range(300))))  # a turn's prompt, inline
        await asyncio.sleep(0.001 if (number + 1) % burst else 0.005)
    await asyncio.gather(*sent)
    started = await actor.seen.remote()
    at = dict(started)
    late, worst, highest = 0, 0.0, -1
    for number, when in started:
        if number < highest:
            late += 1
            worst = max(worst, when - min(at[n] for n in range(number + 1, highest + 1)))
        highest = max(highest, number)
    return late, worst


@app.command()
def main(
    calls: int = typer.Option(1600, help="numbered calls sent, per load"),
    burst: int = typer.Option(8, help="calls sent 1 ms apart, then a 5 ms pause"),
    load: list[int] = typer.Option([0, 2], help="busy processes beside it (one figure each)"),
) -> None:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="vt-ray-order-"))
    try:
        print("| busy processes beside it | calls | started after a later one | the latest, after it (ms) |")
        print("| --- | --- | --- | --- |")
        for busy in load:
            stop = multiprocessing.Event()
            spinners = [multiprocessing.Process(target=_spin, args=(stop,)) for _ in range(busy)]
            for spinner in spinners:
                spinner.start()
            try:
                late, worst = asyncio.run(_measure(calls, burst))
            finally:
                stop.set()
                for spinner in spinners:
                    spinner.join()
            print(f"| {busy} | {calls} | {late} ({late / calls:.1%}) | {worst * 1000:.1f} |", flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    app()
