"""Cost of simulation against the size of the work: the same controller on the same simulated
target at 1x, 2x and 4x the batch, side by side in one run, each through the harness exactly as a
judged run goes (the controller in its own sandboxed process, virtual time kept by the harness).
Prints wall seconds of the simulated system run, trajectory-turns simulated, microseconds per
trajectory-turn (flat = linear scaling), the CPU time per turn of each of the two processes (the harness's
and the candidate controller's), and the floor the isolation puts under it: the controller round
trips the run needed (each time virtual time moved to an event the controller had to react to, the harness
waited for it) times the cost of one bare round trip over the same channel between two processes,
measured in the same run.

    python benchmarks/sim_scaling.py [--target qwen3-235b-a22b-h800x160] [--controller time_multiplex]
                                     [--base-batch 128] [--steps 2] [--factors 1,2,4] [--sandbox auto]

The production target as specified (160 devices, batch 512), ten steps:
``--base-batch 512 --steps 10 --factors 1``.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import typer
import yaml
from rich.console import Console
from rich.table import Table

from skills.starter import write_starter
from targets.harness.channel import AsyncChannel, Frame
from targets.harness.launch import Limits, run_harness
from targets.harness.sandbox import Sandbox
from targets.harness.target import Target
from targets.harness.trace import Trace
from targets.spec import load_target, resolve_target_path


def bare_round_trip_us(count: int = 20_000) -> float:
    """Microseconds for one call and its reply between two processes over ``AsyncChannel`` on asyncio,
    with no work on either side: the least a controller round trip can cost."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = os.fork()
    if child == 0:  # the echoing peer
        ours.close()

        async def echo() -> None:
            channel, stop = await AsyncChannel.over(theirs), asyncio.get_running_loop().create_future()

            def on_frame(rx) -> None:
                if rx["kind"] == "stop":
                    stop.set_result(None)
                else:
                    channel.send(Frame(kind="reply", id=rx["id"]))

            channel.listen(on_frame, lambda error: None)
            await stop

        asyncio.run(echo())
        os._exit(0)
    theirs.close()

    async def ping() -> float:
        channel, loop = await AsyncChannel.over(ours), asyncio.get_running_loop()
        waiter: list[asyncio.Future] = []
        channel.listen(lambda rx: waiter[-1].set_result(rx), lambda error: None)
        started = time.perf_counter()
        for i in range(count):
            waiter.append(loop.create_future())
            channel.send(Frame(kind="call", id=i))
            await waiter[-1]
        seconds = time.perf_counter() - started
        channel.send(Frame(kind="stop"))
        await channel.close()
        return seconds

    seconds = asyncio.run(ping())
    os.waitpid(child, 0)
    return 1e6 * seconds / count


def main(
    target: str = "qwen3-235b-a22b-h800x160",
    controller: str = "time_multiplex",
    base_batch: int = 128,
    steps: int = 2,
    factors: str = typer.Option("1,2,4", help="multiples of --base-batch to run, comma-separated"),
    sandbox: str = "auto",
) -> None:
    spec = load_target(target)
    work = Path(tempfile.mkdtemp(prefix="sim-scaling-"))
    directory = write_starter(work / controller, spec, controller)
    raw = yaml.safe_load(resolve_target_path(target).read_text())
    box = Sandbox.detect(sandbox)
    table = Table(title=f"simulation cost on {spec.id} ({spec.hardware.count} devices, {controller}, {steps} steps)")
    columns = (
        "batch",
        "wall s",
        "simulated s",
        "trajectory-turns",
        "µs per trajectory-turn",
        "harness CPU µs/turn",
        "controller CPU µs/turn",
        "round trips",
        "floor s",
    )
    for column in columns:
        table.add_column(column, justify="right")
    try:
        multiples = [int(f) for f in factors.split(",")]
    except ValueError:
        raise SystemExit(f"--factors {factors!r}: whole numbers separated by commas, e.g. 1,2,4") from None
    bare_us = bare_round_trip_us()
    for factor in multiples:
        batch = base_batch * factor
        raw["workload"].update(batch_size=batch, train_steps=steps)
        path = work / f"batch{batch}.yaml"
        path.write_text(yaml.safe_dump(raw))
        run = run_harness(
            Target.load(path, simulate=True),
            directory,
            work / f"out{batch}",
            "measure",
            Limits(time_s=1800, memory_mb=20_000),
            box,
        )
        if not run.ok:
            raise SystemExit(f"batch {batch}: {run.cause}")
        summary = json.loads((run.out / "system.json").read_text())
        turns = sum(1 for e in Trace.load_events(run.out / "trace.jsonl") if e.kind == "env_step")
        controller_cpu = summary["controller_cpu_seconds"]  # None in a sandbox: its namespace keeps it
        table.add_row(
            f"{batch} ({factor}x)",
            f"{summary['wall_seconds']:.2f}",
            f"{summary['virtual_seconds']:.0f}",
            str(turns),
            f"{1e6 * summary['wall_seconds'] / turns:.0f}",
            f"{1e6 * summary['harness_cpu_seconds'] / turns:.0f}",
            "n/a" if controller_cpu is None else f"{1e6 * controller_cpu / turns:.0f}",
            str(summary["controller_round_trips"]),
            f"{summary['controller_round_trips'] * bare_us / 1e6:.1f}",
        )
    Console().print(table)
    Console().print(
        f"floor s = round trips x {bare_us:.0f} µs, one bare round trip between two processes over the same "
        "channel (measured now): the wall time of the round trips alone, before any simulation or controller work; "
        "CPU µs/turn: CPU time of the harness process (the simulator, environments, trace, its end of the channel) "
        "and of the candidate's controller process (its own code and its end of the channel), per trajectory-turn. "
        "The two take turns, so the wall time is close to their sum. The controller's is n/a in a sandbox (its "
        "process namespace keeps it from the harness): --sandbox subprocess shows it"
    )


if __name__ == "__main__":
    typer.run(main)
