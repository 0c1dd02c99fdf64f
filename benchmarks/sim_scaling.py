"""Cost of simulation against the size of the work: the same controller on the same simulated
target at 1x, 2x and 4x the batch, side by side in one run, each through the harness exactly as a
judged run goes (the controller in its own sandboxed process, virtual time kept by the harness).
Prints wall seconds of the simulated system run (median and range over ``--repeat`` runs),
trajectory-turns simulated, microseconds per trajectory-turn (flat = linear scaling), how they split
between the two processes (the harness's own work, and its wait for the candidate's controller), and
the floor the isolation puts under it: the controller round trips the run needed (each time virtual
time moved to an event the controller had to react to, the harness waited for it) times the cost of
one bare round trip over the same link between two processes, measured in the same run.

    python benchmarks/sim_scaling.py [--target qwen3-235b-a22b-h800x160] [--controller time_multiplex]
                                     [--base-batch 128] [--steps 2] [--factors 1,2,4] [--repeat N]
                                     [--sandbox auto]

The production target as specified (160 devices, batch 512), ten steps:
``--base-batch 512 --steps 10 --factors 1 --repeat 3``.
"""

from __future__ import annotations

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
from targets.harness.ipc import shared_ring
from targets.harness.ipc.channel import AsyncChannel, Frame
from targets.harness.isolation.launch import Limits, run_harness
from targets.harness.isolation.sandbox import Sandbox
from targets.harness.sim.virtual_time import FollowerTimeLoop, VirtualTimeLoop, run_virtual
from targets.harness.target import Target
from targets.harness.trace import Trace
from targets.spec import load_target, resolve_target_path


def bare_round_trip_us(count: int = 20_000) -> float:
    """Microseconds for one controller round trip with no work on either side, over the machinery a
    simulated run uses: the harness's virtual-time loop sends a frame each virtual second, the
    controller's follower loop answers it with a call and its idle notice, over the shared-memory
    rings (or the socket where they are not supported), between two processes."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = os.fork()
    if child == 0:  # the controller's side
        ours.close()
        follower = FollowerTimeLoop()
        channel = AsyncChannel.polled(theirs, shared_ring.accept(theirs))
        channel.corked = channel.bursts = True
        follower.io = channel.transport
        follower.on_idle = lambda deadline: channel.flush(idle=(channel.received, deadline))

        async def answer() -> None:
            stop = follower.create_future()

            def on_frame(rx) -> None:
                follower.set_time(rx["t"])
                if rx["kind"] == "stop":
                    stop.set_result(None)
                else:
                    channel.send(Frame(kind="call", id=rx["id"]))

            channel.listen(on_frame, lambda error: None)
            await stop

        follower.run_until_complete(answer())
        os._exit(0)
    theirs.close()
    loop = VirtualTimeLoop()
    channel = AsyncChannel.polled(ours, shared_ring.offer(ours))
    channel.corked = channel.bursts = True

    class Peer:  # the harness's view of an idle controller (IdlePeer), as ControllerLink keeps it
        received, deadline = -1, None

        def idle_until(self):
            return self.received == channel.sent, self.deadline

        def wake(self, now: float) -> None:
            channel.send(Frame(kind="time", t=now))

        def flush(self) -> None:
            channel.flush()

        def on_idle(self, received: int, deadline: float | None) -> None:
            self.received, self.deadline = received, deadline

    async def ask() -> float:
        peer, done, ticks = Peer(), loop.create_future(), [0]
        channel.listen(lambda rx: None, lambda error: None, peer.on_idle)
        loop.peer, loop.io = peer, channel.transport

        def tick() -> None:
            ticks[0] += 1
            if ticks[0] > count:
                channel.send(Frame(kind="stop", t=loop.time()))
                done.set_result(None)
                return
            channel.send(Frame(kind="tick", id=ticks[0], t=loop.time()))
            loop.call_later(1.0, tick)

        started = time.perf_counter()
        tick()
        await done
        seconds = time.perf_counter() - started
        loop.peer = None
        channel.flush()
        return seconds

    seconds = run_virtual(ask(), loop)
    os.waitpid(child, 0)
    return 1e6 * seconds / count


def main(
    target: str = "qwen3-235b-a22b-h800x160",
    controller: str = "time_multiplex",
    base_batch: int = 128,
    steps: int = 2,
    factors: str = typer.Option("1,2,4", help="multiples of --base-batch to run, comma-separated"),
    repeat: int = typer.Option(1, min=1, help="runs of each batch: the table shows the median and the range"),
    sandbox: str = "auto",
) -> None:
    try:
        multiples = [int(f) for f in factors.split(",")]
    except ValueError:
        raise SystemExit(f"--factors {factors!r}: whole numbers separated by commas, e.g. 1,2,4") from None
    spec = load_target(target)
    work = Path(tempfile.mkdtemp(prefix="sim-scaling-"))
    directory = write_starter(work / controller, spec, controller)
    raw = yaml.safe_load(resolve_target_path(target).read_text())
    box = Sandbox.detect(sandbox)
    table = Table(title=f"simulation cost on {spec.id} ({spec.hardware.count} devices, {controller}, {steps} steps)")
    columns = (
        "batch",
        "wall s (median, range)",
        "simulated s",
        "trajectory-turns",
        "µs per trajectory-turn",
        "harness µs/turn",
        "controller µs/turn",
        "round trips",
        "floor s",
    )
    for column in columns:
        table.add_column(column, justify="right")
    bare_us = bare_round_trip_us()
    for factor in multiples:
        batch = base_batch * factor
        raw["workload"].update(batch_size=batch, train_steps=steps)
        path = work / f"batch{batch}.yaml"
        path.write_text(yaml.safe_dump(raw))
        runs = []
        for i in range(repeat):
            run = run_harness(
                Target.load(path, simulate=True),
                directory,
                work / f"out{batch}-{i}",
                "measure",
                Limits(time_s=1800, memory_mb=20_000),
                box,
            )
            if not run.ok:
                raise SystemExit(f"batch {batch}: {run.cause}")
            runs.append(json.loads((run.out / "system.json").read_text()))
        turns = sum(1 for e in Trace.load_events(run.out / "trace.jsonl") if e.kind == "env_step")
        walls = sorted(r["wall_seconds"] for r in runs)
        middle = runs[[r["wall_seconds"] for r in runs].index(walls[len(walls) // 2])]
        waited = middle["controller_wait_seconds"]
        table.add_row(
            f"{batch} ({factor}x)",
            f"{walls[len(walls) // 2]:.2f}" + (f" ({walls[0]:.2f}-{walls[-1]:.2f})" if repeat > 1 else ""),
            f"{middle['virtual_seconds']:.0f}",
            str(turns),
            f"{1e6 * middle['wall_seconds'] / turns:.0f}",
            f"{1e6 * (middle['wall_seconds'] - waited) / turns:.0f}",
            f"{1e6 * waited / turns:.0f}",
            str(middle["controller_round_trips"]),
            f"{middle['controller_round_trips'] * bare_us / 1e6:.1f}",
        )
    console = Console(width=max(Console().width, 160))  # the table's nine columns, whole even in a pipe
    console.print(table)
    console.print(
        f"floor s = round trips x {bare_us:.1f} µs, one bare controller round trip over the machinery a run uses "
        "(virtual-time loops, the shared-memory rings), measured now: the wall time of the round trips alone, "
        "before any simulation or controller work. harness µs/turn: the run's wall time less the time the harness "
        "waited for the controller (the simulator, environments, trace, its end of the link); controller µs/turn: "
        "that wait (the controller's own work and the handoffs both ways). The two take turns, so they add up to "
        "the wall time. The median run's figures; a simulated run is the same run each time, only its wall time varies"
    )


if __name__ == "__main__":
    typer.run(main)
