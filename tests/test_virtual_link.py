"""The simulated controller link, piece by piece: the shared-memory rings it travels on (and what a
hostile peer can do to them), the idle notice that ends a controller's burst, the virtual-time loop's
own timers and turns, and token counts, which are what every token sequence is in a simulated run."""

from __future__ import annotations

import asyncio
import fcntl
import math
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from targets.api import Completion, StepResult, TokenCount, Trajectory
from targets.harness.ipc import shared_ring
from targets.harness.ipc.channel import HEADER, IDLE, AsyncChannel, Frame
from targets.harness.ipc.protocol import ProtocolError
from targets.harness.ipc.wire import get_params, put_params
from targets.harness.sim.virtual_time import VirtualTimeLoop, run_virtual

rings = pytest.mark.skipif(not shared_ring.supported(), reason="the rings need x86's store and load order")


class Collect:
    """A protocol that keeps the bytes a transport hands it."""

    def __init__(self) -> None:
        self.buffer, self.data, self.lost = bytearray(1 << 16), bytearray(), "not lost"

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buffer)

    def buffer_updated(self, nbytes: int) -> None:
        self.data += self.buffer[:nbytes]

    def connection_lost(self, error) -> None:
        self.lost = error


def _pair() -> tuple[shared_ring.RingTransport, Collect, shared_ring.RingTransport, Collect]:
    """Both ends of a ring link in this process (the memory is the same region, mapped twice)."""
    harness_sock, controller_sock = socket.socketpair()
    harness_rings = shared_ring.offer(harness_sock)
    controller_rings = shared_ring.accept(controller_sock)
    ours, theirs = Collect(), Collect()
    return (
        shared_ring.RingTransport(harness_sock, *harness_rings, ours),
        ours,
        shared_ring.RingTransport(controller_sock, *controller_rings, theirs),
        theirs,
    )


@rings
def test_the_rings_carry_bytes_both_ways_and_wrap_around():
    harness, heard_by_harness, controller, heard_by_controller = _pair()
    sent = b""
    for i in range(3 * shared_ring.CAPACITY // 60_000):  # three times round the ring, in pieces
        piece = bytes([i % 251]) * 60_000
        harness.write(piece)
        sent += piece
        assert controller.poll()
        controller.write(b"ack")
    assert bytes(heard_by_controller.data) == sent
    harness.poll()
    assert bytes(heard_by_harness.data) == b"ack" * (3 * shared_ring.CAPACITY // 60_000)
    assert not controller.poll()  # nothing more


@rings
def test_a_write_bigger_than_the_ring_waits_for_the_reader_in_the_other_process():
    harness_sock, controller_sock = socket.socketpair()
    child = os.fork()
    if child == 0:  # the reader: takes 2.5 rings' worth, then says how much it got
        harness_sock.close()
        got = Collect()
        reader = shared_ring.RingTransport(controller_sock, *shared_ring.accept(controller_sock), got)
        while len(got.data) < 5 * shared_ring.CAPACITY // 2:
            reader.poll()
        reader.write(str(len(got.data)).encode())
        time.sleep(0.5)
        os._exit(0)
    controller_sock.close()
    heard = Collect()
    writer = shared_ring.RingTransport(harness_sock, *shared_ring.offer(harness_sock), heard)
    writer.write(b"x" * (5 * shared_ring.CAPACITY // 2))
    deadline = time.monotonic() + 30
    while not heard.data and time.monotonic() < deadline:
        writer.poll()
    os.waitpid(child, 0)
    assert heard.data == str(5 * shared_ring.CAPACITY // 2).encode()


@rings
def test_a_counter_the_other_side_breaks_loses_the_channel_with_why():
    """The controller maps the same counters: moving the harness's view of them past what its ring can
    hold is refused, not followed (the harness would read bytes nobody wrote)."""
    harness, heard, controller, _ = _pair()
    controller._counts[controller._out_written] = shared_ring.CAPACITY + 1  # planted: more than a ring holds
    assert harness.poll()  # "nothing more will come": the channel is gone
    assert isinstance(heard.lost, ProtocolError) and "ring counter" in str(heard.lost)


@rings
def test_the_region_is_sealed_against_a_controller_that_would_shrink_it_under_the_harness():
    harness_sock, controller_sock = socket.socketpair()
    shared_ring.offer(harness_sock)
    message, fds, _, _ = socket.recv_fds(controller_sock, 16, 1)
    assert message == b"rings"
    seals = fcntl.fcntl(fds[0], fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_SEAL
    with pytest.raises(PermissionError):
        os.ftruncate(fds[0], 4096)  # planted: a shrink would make the harness's next read a bus error
    os.close(fds[0])


@rings
def test_a_controller_answering_something_else_than_the_region_is_refused():
    harness_sock, controller_sock = socket.socketpair()
    harness_sock.sendall(b"trust me")
    with pytest.raises(ProtocolError, match="expected the rings' region"):
        shared_ring.accept(controller_sock)


@rings
def test_a_peer_that_wrote_and_went_away_is_read_before_it_is_lost():
    harness, heard, controller, _ = _pair()
    controller.write(b"done")
    controller.sock.close()  # the controller process exits
    for _ in range(100):  # the socket is looked at now and then: on every 64th empty poll
        harness.poll()
    assert heard.data == b"done" and heard.lost is None


@rings
def test_the_counters_are_never_seen_half_written():
    """A reader racing the writer: a count read half written (``struct.pack_into`` zeroes a value's
    bytes before it writes them) would look like a ring gone back, or ahead of its bytes."""
    code = textwrap.dedent(
        """
        import os, socket, time
        from targets.harness.ipc import shared_ring
        a, b = socket.socketpair()
        if os.fork() == 0:
            a.close(); memory, _ = shared_ring.accept(b); counts = memoryview(memory)[:4096].cast("Q")
            last, back = 0, 0
            while last < 1_000_000:
                value = counts[0]
                back += value < last
                last = max(last, value)
            print(back, flush=True)
            os._exit(0)
        b.close(); memory, _ = shared_ring.offer(a); counts = memoryview(memory)[:4096].cast("Q")
        for i in range(1, 1_000_001):
            counts[0] = i
        os.wait()
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "0"


# -- the idle notice -----------------------------------------------------------------------------------


def _idle_link():
    """A corked burst channel (the controller's end) and the harness's end, over a socket pair."""
    ours, theirs = socket.socketpair()
    return AsyncChannel.polled(ours), AsyncChannel.polled(theirs)


def test_the_idle_notice_ends_a_burst_with_what_the_controller_took_in_and_its_next_timer():
    controller, harness = _idle_link()
    controller.corked = controller.bursts = harness.bursts = True
    frames, notices = [], []
    harness.listen(lambda rx: frames.append(rx["kind"]), lambda error: None, lambda *notice: notices.append(notice))
    controller.send(Frame(kind="generate"))
    controller.flush(idle=(7, 12.5))
    controller.flush(idle=(8, None))  # an idle notice with no frame before it still crosses
    harness.transport.poll()
    assert frames == ["generate"] and notices == [(7, 12.5), (8, None)]


def test_an_idle_notice_that_came_before_the_harness_listened_is_not_lost():
    controller, harness = _idle_link()
    controller.corked = controller.bursts = harness.bursts = True
    controller.flush(idle=(3, None))
    harness.transport.poll()
    notices = []
    harness.listen(lambda rx: None, lambda error: None, lambda *notice: notices.append(notice))
    assert notices == [(3, None)]


@pytest.mark.parametrize("deadline", [math.inf, -math.inf])
def test_an_idle_notice_with_an_endless_deadline_breaks_the_protocol(deadline):
    controller, harness = _idle_link()
    harness.bursts, lost = True, []
    harness.listen(lambda rx: None, lost.append, lambda *notice: None)
    controller.transport.write(HEADER.pack(0xFFFFFFFE) + IDLE.pack(1, deadline))  # planted by hand
    harness.transport.poll()
    assert lost and "deadline" in str(lost[0])


def test_an_idle_notice_on_a_channel_that_takes_none_breaks_the_protocol():
    controller, harness = _idle_link()
    controller.corked = controller.bursts = harness.bursts = True
    lost = []
    harness.listen(lambda rx: None, lost.append)  # no on_idle: a controller's channel hears none
    controller.flush(idle=(1, None))
    harness.transport.poll()
    assert lost and "takes none" in str(lost[0])


# -- the virtual-time loop ------------------------------------------------------------------------------


def test_timers_of_one_instant_run_in_the_order_they_were_set_and_a_cancelled_one_never():
    order = []

    async def main():
        loop = asyncio.get_running_loop()
        for name in "abc":
            loop.call_later(2.0, order.append, name)
        loop.call_later(2.0, order.append, "cancelled").cancel()
        loop.call_later(1.0, order.append, "first")
        await asyncio.sleep(3.0)
        return loop.time()

    assert run_virtual(main()) == 3.0
    assert order == ["first", "a", "b", "c"]


def test_a_timer_that_raises_goes_to_the_loop_s_handler_and_the_others_of_its_instant_still_run():
    seen, errors = [], []

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda loop, context: errors.append(context["exception"]))
        loop.call_later(1.0, lambda: 1 / 0)
        loop.call_later(1.0, seen.append, "after")
        await asyncio.sleep(2.0)

    run_virtual(main())
    assert seen == ["after"] and isinstance(errors[0], ZeroDivisionError)


def test_a_turn_runs_what_callbacks_schedule_in_order_before_time_moves():
    order = []

    async def main():
        loop = asyncio.get_running_loop()

        def chain(n):
            order.append((n, loop.time()))
            if n < 3:
                loop.call_soon(chain, n + 1)

        loop.call_later(5.0, chain, 0)
        loop.call_later(5.0, order.append, ("timer", loop.time() + 5.0))
        await asyncio.sleep(6.0)

    loop = VirtualTimeLoop()
    run_virtual(main(), loop)
    assert order == [(0, 5.0), ("timer", 5.0), (1, 5.0), (2, 5.0), (3, 5.0)]


# -- token counts -----------------------------------------------------------------------------------------


def test_token_counts_join_like_sequences_and_refuse_to_be_read():
    assert TokenCount(3) + TokenCount(4) == TokenCount(7) and [1, 2] + TokenCount(3) == TokenCount(5)
    assert len(TokenCount(9)) == 9 and not TokenCount(0)
    with pytest.raises(TypeError, match="token counts, not tokens"):
        TokenCount(3)[0]
    with pytest.raises(TypeError, match="token counts, not tokens"):
        list(TokenCount(3))
    with pytest.raises(ValueError, match="TokenCount"):
        TokenCount(-1)


def test_a_trajectory_of_counts_keeps_its_length_and_its_response_tokens():
    t = Trajectory.start("g0/e0", "g0", TokenCount(4096))
    t.append_turn(Completion(TokenCount(300), TokenCount(300), "stop", 0), StepResult(TokenCount(512), 0.5, False))
    t.append_turn(Completion(TokenCount(20), TokenCount(20), "stop", 1), StepResult(TokenCount(0), 0.25, True))
    assert len(t.tokens) == len(t.loss_mask) == len(t.logprobs) == 4096 + 300 + 512 + 20
    assert t.response_tokens == 320 and t.weight_versions == [0, 1] and t.reward == 0.75
    real = Trajectory.start("g0/e1", "g0", [5, 6])
    real.append_turn(Completion([7], [-0.5], "stop", 0), StepResult([8, 9], 1.0, True))
    assert real.tokens == [5, 6, 7, 8, 9] and real.loss_mask == [0, 0, 1, 0, 0] and real.response_tokens == 1


def test_sampling_params_are_checked_once_per_exact_value():
    """The decoder keeps what it checked by the value's JSON: ``1.0`` and ``true`` where the contract
    wants an integer are refused every time, however often ``1`` was accepted before."""
    from targets.api import SamplingParams

    good = put_params(SamplingParams(max_new_tokens=1))
    assert get_params(good) is get_params(dict(good))
    for planted in ({**good, "max_new_tokens": True}, {**good, "max_new_tokens": 1.0}):
        with pytest.raises(ProtocolError, match="max_new_tokens"):
            get_params(planted)


def test_a_frame_whose_array_is_empty_keeps_its_blob():
    """A done step's observation is an empty array: its blob has no bytes, and must still be there."""
    sender, receiver = _idle_link()
    frames = []
    receiver.listen(frames.append, lambda error: None)
    frame = Frame(kind="env")
    frame.header["observation"] = frame.array([], "i4")
    sender.send(frame)
    receiver.transport.poll()
    assert frames and frames[0].ints(frames[0]["observation"]) == []


@pytest.mark.parametrize("schedule", ["call_later", "call_soon"])
def test_a_simulation_callback_that_raises_ends_the_run_with_its_error(schedule):
    """An engine's timer or a cluster's answer that raises is the simulator's bug: the run ends with it
    (the loop's default handler only logged it, and the simulation went on without what it did)."""
    from targets.harness.sim.virtual_time import SimulationError

    def broken() -> None:
        raise ZeroDivisionError("planted: a simulator bug")

    async def main() -> str:
        loop = asyncio.get_running_loop()
        loop.call_later(5.0, broken) if schedule == "call_later" else loop.call_soon(broken)
        await asyncio.sleep(3600.0)  # virtual: the run would otherwise wait it out, and pass
        return "finished"

    with pytest.raises(SimulationError, match="planted: a simulator bug"):
        run_virtual(main())


def test_a_callback_s_error_survives_a_cleanup_that_raises_after_the_cancel():
    """The run's own cleanup (closing its cluster, serving out its traffic) may raise once the failure
    cancels it: the callback's error is still the one the run ends with."""
    from targets.harness.sim.virtual_time import SimulationError

    def broken() -> None:
        raise ZeroDivisionError("planted: a simulator bug")

    async def main() -> None:
        asyncio.get_running_loop().call_later(1.0, broken)
        try:
            await asyncio.sleep(3600.0)
        finally:
            raise RuntimeError("cleanup that fails after the cancel")

    with pytest.raises(SimulationError, match="planted: a simulator bug"):
        run_virtual(main())


def test_a_real_runs_callback_that_raises_ends_it_at_once_not_at_its_time_limit():
    """A real run's loop (``child.py``): a step's answer or a trace callback that raised was only logged,
    the reply never sent, and the controller waited out the time limit with the candidate blamed."""
    import time

    from targets.harness.strict_loop import CallbackFailed, run_strict

    def broken() -> None:
        raise KeyError("planted: a harness bug")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, broken)
        await asyncio.to_thread(time.sleep, 0.01)  # the default executor, shut down at the end as asyncio.run does
        await asyncio.sleep(3600.0)  # wall time: would hang the test without the handler

    with pytest.raises(CallbackFailed, match="a harness callback raised KeyError.'planted: a harness bug'"):
        run_strict(main(), asyncio.new_event_loop())
    assert run_strict(asyncio.sleep(0, result="done"), asyncio.new_event_loop()) == "done"
