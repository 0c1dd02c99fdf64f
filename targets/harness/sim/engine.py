"""One simulated rollout engine: continuous batching under a KV-capacity limit, with a prefix cache.

Requests wait in a FIFO queue until their context plus ``max_new_tokens`` fits in the KV cache
(idle cached prefixes are evicted, least recently used, to make room) and, under static batching,
until the running batch has finished. Admitted requests are
prefilled (decode pauses meanwhile), then decode one token per iteration together; an iteration's
duration comes from the cost model for the current batch and context. The engine advances
event to event (an arrival, a finished sequence, an abort), never token by token, so a run of
millions of tokens simulates in seconds.

A finished turn's KV stays cached for its episode, so the next turn on the same engine prefills
only the new tokens; an abort (shrink, suspend) or an offload drops everything.
"""

from __future__ import annotations

import asyncio
import itertools
import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass

from targets.api import Completion
from targets.harness.sim.cost_model import CostModel

FILLER = tuple((7 * i + 3) % 40 + 5 for i in range(8192))  # the tokens a simulated engine "emits"
EPS = 1e-9


@dataclass
class _Sequence:
    episode: str
    prompt_tokens: int
    max_new: int
    future: asyncio.Future
    generated: float = 0.0
    version: int = 0

    @property
    def context(self) -> float:
        return self.prompt_tokens + self.generated

    @property
    def reserved(self) -> int:
        return self.prompt_tokens + self.max_new


class SimEngine:
    def __init__(self, name: str, devices: list[str], cost: CostModel) -> None:
        self.name, self.devices, self.cost = name, devices, cost
        self.capacity = cost.kv_capacity_tokens
        self.version = 0
        self.offloaded = False
        self.queue: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        self.cached: OrderedDict[str, int] = OrderedDict()  # episode -> KV tokens kept after its turn
        self.peak_kv_tokens = 0
        self._kv_used = 0  # reserved by running sequences plus cached prefixes
        self._context = 0.0  # context tokens of the running batch (what one iteration reads)
        self._paused = False  # a weight load waits for the running batch to drain
        self._drained = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._wakeup: asyncio.Future | None = None  # set while the serving loop waits on a timer
        self._epoch = 0  # bumped by abort: work in progress from an older epoch is discarded
        self._decoding: tuple[float, float] | None = None  # (start, seconds per iteration) of the chunk running now
        self._task = self._loop.create_task(self._serve())

    # -- requests --------------------------------------------------------------------------------
    @property
    def load(self) -> int:
        return len(self.queue) + len(self.running)

    def submit(self, episode: str, prompt_tokens: int, max_new: int) -> asyncio.Future:
        if self.offloaded:
            raise RuntimeError(f"{self.name}: request routed to an offloaded engine")
        if prompt_tokens + max_new > self.capacity:
            raise ValueError(
                f"{self.name}: a request of {prompt_tokens + max_new} tokens exceeds the KV capacity {self.capacity}"
            )
        future = self._loop.create_future()
        head = not self.queue  # behind others, it cannot be admitted before they are: no need to interrupt
        self.queue.append(_Sequence(episode, prompt_tokens, max_new, future))
        if head and (self.cost.continuous_batching or not self.running):
            self._wake()
        return future

    def interrupt(self) -> None:
        """Answer the running requests as aborted with the tokens decoded so far and free their KV
        (a continuation prefills its whole context again); queued requests stay queued."""
        self._progress()
        for seq in self.running:
            if not seq.future.done():
                seq.future.set_result(self._completion(seq, "abort"))
            self._kv_used -= seq.reserved
        self.running, self._context = [], 0.0
        self._epoch += 1
        self._drained.set()
        self._wake()

    def abort(self) -> None:
        """Interrupt the running requests, answer the queued ones as aborted too, and drop the
        prefix cache."""
        self.interrupt()
        for seq in self.queue:
            if not seq.future.done():
                seq.future.set_result(self._completion(seq, "abort"))
        self.queue = deque()
        self.cached.clear()
        self._kv_used = 0

    # -- weights and memory -----------------------------------------------------------------------
    async def load_weights(self, version: int, seconds: float, interrupt: bool = False) -> None:
        """Stop admitting, let the running batch finish (never serve while weights change) or with
        ``interrupt`` answer it at once, load."""
        self._paused = True
        if interrupt:
            self.interrupt()
        self._wake()
        while self.running:
            self._drained.clear()
            await self._drained.wait()
        await asyncio.sleep(seconds)
        self.version = version
        self._paused = False
        self._wake()

    def offload(self) -> None:
        self.abort()
        self.offloaded = True

    def reload(self) -> None:
        self.offloaded = False
        self._wake()

    def close(self) -> None:
        self._task.cancel()

    # -- the serving loop --------------------------------------------------------------------------
    def _wake(self) -> None:
        """Interrupt the serving loop's wait: something changed (an arrival, an abort, a pause)."""
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def _wait(self, seconds: float | None) -> None:
        """Sleep until ``seconds`` pass (None: forever) or ``_wake`` is called, whichever is first."""
        self._wakeup = self._loop.create_future()
        timer = self._loop.call_later(seconds, self._wake) if seconds is not None else None
        try:
            await self._wakeup
        finally:
            if timer is not None:
                timer.cancel()
            self._wakeup = None

    def _admit(self) -> float:
        """Move queued requests that fit into the batch; returns the prefill seconds they need."""
        prefill = 0.0
        if self.running and not self.cost.continuous_batching:
            return prefill  # static batching: the running batch finishes first
        while self.queue and not self._paused and not self.offloaded:
            seq = self.queue[0]
            cached = self.cached.pop(seq.episode, 0)
            self._kv_used -= cached
            cached = cached if cached <= seq.prompt_tokens else 0
            if self._kv_used - sum(self.cached.values()) + seq.reserved > self.capacity:
                if cached:  # does not fit even with every idle prefix evicted: wait, evicting nothing
                    self.cached[seq.episode] = cached
                    self._kv_used += cached
                break
            while self._kv_used + seq.reserved > self.capacity:
                self._kv_used -= self.cached.popitem(last=False)[1]  # evict the least recently used idle prefix
            self.queue.popleft()
            seq.version = self.version
            self.running.append(seq)
            self._kv_used += seq.reserved
            self._context += seq.prompt_tokens
            prefill += self.cost.prefill_s(seq.prompt_tokens - cached, cached)
        self.peak_kv_tokens = max(self.peak_kv_tokens, self._kv_used)
        return prefill

    async def _serve(self) -> None:
        while True:
            epoch = self._epoch
            prefill = self._admit()
            if prefill > 0:
                await asyncio.sleep(prefill)  # decode pauses while the new requests prefill
                if epoch != self._epoch:
                    continue
            if not self.running:
                self._drained.set()
                await self._wait(None)
                continue
            iteration = self.cost.decode_iteration_s(len(self.running), self._context)
            steps = min(s.max_new - s.generated for s in self.running)
            self._decoding = (self._loop.time(), iteration)
            await self._wait(steps * iteration)
            if epoch != self._epoch:
                continue
            self._progress()
            self._finish([s for s in self.running if s.generated >= s.max_new - EPS])

    def _progress(self) -> None:
        """Credit the running sequences with the iterations decoded since the chunk started."""
        if self._decoding is None:
            return
        start, iteration = self._decoding
        self._decoding = None
        progressed = (
            min(min(s.max_new - s.generated for s in self.running), (self._loop.time() - start) / iteration)
            if self.running
            else 0.0
        )
        for seq in self.running:
            seq.generated += progressed
        self._context += progressed * len(self.running)

    def _finish(self, done: list[_Sequence]) -> None:
        for seq in done:
            self.running.remove(seq)
            self._context -= seq.context
            self._kv_used += seq.prompt_tokens + seq.max_new - seq.reserved  # the reservation becomes the cached prefix
            seq.generated = seq.max_new
            self.cached[seq.episode] = seq.prompt_tokens + seq.max_new
            seq.future.set_result(self._completion(seq, "length"))
        if done and not self.running:
            self._drained.set()

    def _completion(self, seq: _Sequence, finish: str) -> Completion:
        n = int(seq.generated + EPS) if finish == "abort" else seq.max_new
        start = zlib.crc32(seq.episode.encode()) % (len(FILLER) // 2)
        if start + n <= len(FILLER):
            tokens = list(FILLER[start : start + n])
        else:
            tokens = list(itertools.islice(itertools.cycle(FILLER), start, start + n))
        return Completion(tokens, [-1.0] * n, finish, seq.version, self.devices[0])
