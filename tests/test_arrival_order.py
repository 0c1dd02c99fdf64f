"""An engine takes its requests in the order its cluster sent them, whatever order Ray delivers the calls
in (skills/recipes/arrival_order.py): a late call is waited for, a cancelled one is forgotten by number,
and a number that never comes is an error said, not a hang. Before, an honest run on a loaded machine was
rejected as "served out of order" when one call reached its engine ~90 ms after a later one."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest

from skills.recipes.arrival_order import ArrivalOrder
from targets.api import SamplingParams
from targets.harness.model import model_dir


async def _taken(order: ArrivalOrder, numbers: list[int], forgotten: tuple[int, ...] = ()) -> list[int]:
    """The order in which ``numbers``, started in the order given (``forgotten`` forgotten after them), are taken."""
    taken: list[int] = []

    async def one(number: int) -> None:
        if await order.turn(number):
            taken.append(number)

    tasks = [asyncio.create_task(one(n)) for n in numbers]
    await asyncio.sleep(0)
    for number in forgotten:
        order.forget(number)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    return taken


def test_requests_delivered_out_of_order_are_taken_in_the_clusters_order():
    assert asyncio.run(_taken(ArrivalOrder("e0"), [2, 0, 3, 1])) == [0, 1, 2, 3]


def test_a_cancelled_request_that_never_comes_holds_nothing_up_and_one_that_comes_late_is_not_served():
    order = ArrivalOrder("e0")
    assert asyncio.run(_taken(order, [2, 0, 3], forgotten=(1,))) == [0, 2, 3]

    async def late_and_forgotten() -> tuple[bool, bool]:
        order.forget(5)  # forgotten before it came: 4 goes on, 5 is not served when it comes
        four, five = await order.turn(4), await order.turn(5)
        return four, five

    assert asyncio.run(late_and_forgotten()) == (True, False)
    assert order.next == 6


def test_a_waiting_request_cancelled_lets_the_later_ones_go_on():
    async def main() -> list[int]:
        order = ArrivalOrder("e0")
        waiting = asyncio.create_task(order.turn(1))  # waits for 0
        later = asyncio.create_task(order.turn(2))
        await asyncio.sleep(0)
        waiting.cancel()  # its caller went away while it waited
        assert await order.turn(0)
        await asyncio.wait_for(later, 5)
        return [order.next, waiting.cancelled()]

    assert asyncio.run(main()) == [3, True]


def test_a_request_forgotten_while_it_waits_is_told_at_once():
    """Ray may deliver the cluster's forget before the cancel reaches the call: the call, waiting for an
    earlier number, is told it is not to be served (before, it waited the whole hole timeout, then failed)."""

    async def main() -> tuple[bool, int]:
        order = ArrivalOrder("e0", hole_wait_s=5)
        waiting = asyncio.create_task(order.turn(1))
        await asyncio.sleep(0)
        order.forget(1)
        served = await asyncio.wait_for(waiting, 1)
        assert await order.turn(0)
        return served, order.next

    assert asyncio.run(main()) == (False, 2)


def test_a_number_that_never_comes_is_an_error_that_names_it_once():
    async def main() -> bool:
        order = ArrivalOrder("cpu:1", hole_wait_s=0.05)
        with pytest.raises(RuntimeError, match=r"cpu:1: request 3 waited 0s for request 0, which the cluster numbered"):
            await order.turn(3)
        return await asyncio.wait_for(order.turn(1), 1)  # 0 was given up on: the engine serves on

    assert asyncio.run(main()) is True


def test_the_engine_server_admits_calls_in_the_clusters_order_not_as_they_come(tiny_spec):
    """Request 1's call comes first, request 0's a moment later (as Ray may deliver them): the engine
    submits 0 first. Before, it submitted 1 first, and 0 joined the batch behind it."""
    from skills.recipes.engine_server import EngineServer

    async def main() -> list[int | None]:
        server = EngineServer(str(model_dir(tiny_spec.model)), "float32", "e0")
        submitted: list[int | None] = []
        submit = server.engine.submit

        def recorded(prompt, params, episode=None, arrival=None):
            submitted.append(arrival)
            return submit(prompt, params, episode, arrival)

        server.engine.submit = recorded
        params = SamplingParams(max_new_tokens=2, temperature=0.0)
        second = asyncio.create_task(server.generate([1, 2, 3], params, "g0/e1", arrival=1))
        await asyncio.sleep(0.05)
        first = asyncio.create_task(server.generate([4, 5, 6], params, "g0/e0", arrival=0))
        await asyncio.wait_for(asyncio.gather(first, second), 60)
        await server.close()
        return submitted

    assert asyncio.run(main()) == [0, 1]


RAY_CANCELS = textwrap.dedent(
    """
    import asyncio
    from skills.recipes.ray_cluster import RayCluster
    from targets.api import GenerateRequest, SamplingParams
    from targets.harness.target import Target

    runtime = Target.load("tiny-qwen3-cpu").runtime()

    async def main():
        cluster = await RayCluster.start(runtime, runtime.devices[:1], [], runtime.workload.training)
        try:
            params = SamplingParams(max_new_tokens=4, temperature=0.0)
            for k in range(5):
                dropped = asyncio.ensure_future(cluster.generate(GenerateRequest(f"g{k}/e0", 0, [1, 2, 3], params)))
                await asyncio.sleep(0)  # numbered and sent
                dropped.cancel()  # as the harness cancels the turn of a dropped episode
                request = GenerateRequest(f"g{k}/e1", 0, [4, 5, 6], params)
                print("served", len((await asyncio.wait_for(cluster.generate(request), 20)).tokens), flush=True)
        finally:
            await cluster.close()

    asyncio.run(main())
    """
)


def test_a_call_ray_cancels_before_it_starts_holds_up_none_after_it():
    """A real Ray cluster: each request is cancelled as soon as it is sent, which Ray honours by never
    starting the call, and the next request on that engine is served at once. Without the cluster's
    forget, the engine waited for the cancelled number (measured: the second request timed out)."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)  # a Ray of its own, in its own process
    done = subprocess.run([sys.executable, "-c", RAY_CANCELS], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n").count("served 4") == 5, done.stdout
