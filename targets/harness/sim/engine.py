"""One simulated rollout engine: continuous batching under a KV-capacity limit, with a prefix cache.

KV is used as tokens are generated, as vLLM's paged cache is: a request is admitted when its
context fits beside what the running sequences hold now (idle cached prefixes are evicted, least
recently used, to make room), and under static batching only once the running batch has finished.
Admitted requests are prefilled (decode pauses meanwhile), then decode one token per iteration
together; with chunked prefill (``CostModel.prefill_chunk``) a request admitted while others decode is
computed a chunk an iteration beside them (``_Joining``) and joins the batch when its prompt is done.
When the running sequences' growth fills the cache, idle prefixes are evicted first;
then the most recently admitted sequence is preempted: its KV is freed and it goes back to the
head of the queue, to prefill its whole context (prompt plus what it generated) again when it fits
(vLLM's recompute preemption); with a host tier (``CostModel.host_kv_tokens``) an evicted prefix is
kept on the host, least recently evicted dropped first, and restored when its episode's next turn
comes back (``CostModel.restore_s``), and so is a preempted sequence's context when it is readmitted
(the paged engine's tier, as vLLM's KV offloading, saves it as it leaves). A weight load drops every
prefix, cached or on the host (their keys and values are the old weights'). An iteration's duration comes
from the cost model for the current batch and context. The engine advances event to event (an
arrival, a finished sequence, a full cache, an abort), never token by token, so a run of millions of
tokens simulates in seconds.

A turn generates ``length`` tokens of its ``max_new`` budget (finish "stop" below it, "length" at
it); the cluster draws the length (``response_length.py``). A finished turn's KV stays cached for
its episode, so the next turn on the same engine prefills only the new tokens; an abort (shrink,
suspend) or an offload drops everything.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from targets.api import Completion, TokenCount
from targets.harness.sim.cost_model import CostModel

# What a simulated response says: a fixed filler stream per episode (an environment reads its first words).
FILLER = np.array([(7 * i + 3) % 40 + 5 for i in range(8192)], dtype=np.int32)
EPS = 1e-9


def simulated_response(episode: str, n: int) -> np.ndarray:
    """The ``n`` tokens of a simulated turn of ``episode``: a completion crosses to the controller as
    a count, and the environment it steps reads these."""
    start = zlib.crc32(episode.encode()) % (len(FILLER) // 2)
    return FILLER[start : start + n] if start + n <= len(FILLER) else np.resize(np.roll(FILLER, -start), n)


@dataclass(eq=False)  # a sequence is itself: the batch finds and removes it by identity
class _Sequence:
    episode: str
    prompt_tokens: int
    max_new: int
    length: int  # tokens this turn generates (<= max_new)
    done: Callable[[Completion], None]  # told the completion, once
    generated: float = 0.0  # out of the batch; in it, what the engine's ``generated`` says
    version: int = 0
    preempted: bool = False  # waiting to be prefilled again after its KV was taken back
    mark: float = 0.0  # in the batch: the batch's iterations when this one would have had none
    admitted: int = -1  # in the batch: its admission number (the batch's order); -1 out of it
    answered: bool = False
    started: Callable[[], None] | None = None  # told when its prefill ends (its first token): a serving request's TTFT
    waiting_since: float | None = None  # in the queue: since when (submitted, or preempted); None out of it
    queued_s: float = 0.0  # virtual seconds it spent in the queue before its admissions so far
    cached_tokens: int | None = None  # its prompt's tokens the first admission reused (cached or restored)

    @property
    def context(self) -> float:
        """Prompt plus generated tokens, out of the batch (in it, the engine keeps them as a sum)."""
        return self.prompt_tokens + self.generated


@dataclass(eq=False)
class _Joining:
    """An admitted request whose prompt is computed in chunks beside the decoding batch: its KV is held,
    ``left`` tokens are still to compute, each at ``seconds_per_token`` of the engine's compute."""

    seq: _Sequence
    left: float
    seconds_per_token: float


@dataclass(frozen=True)
class _DecodeRun:
    """A run of decode iterations under way, from one event to the next: priced at its mean context
    (each iteration reads the KV as it has grown), and kept to credit it whole or cut short by a wake."""

    start: float  # the clock when it began
    token_s: float  # seconds a token of each sequence's progress, at the run's mean context
    iterations: float  # to its event
    chunk: float  # prompt tokens of the joining head computed a token of progress
    context: float  # the batch's KV when it began
    beside: tuple[float, int]  # the prefill chunk each iteration computes too


ROOT_TOLERANCE = 1e-9  # relative: the iterations a cut decode run is credited with, solved to this


class SimEngine:
    def __init__(self, name: str, devices: list[str], cost: CostModel) -> None:
        self.name, self.devices, self.cost = name, devices, cost
        self.capacity = cost.kv_capacity_tokens
        self.version = 0
        self.offloaded = False
        self.queue: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []  # in admission order: the last is the first preempted
        self.joining: deque[_Joining] = deque()  # admitted, prefilled a chunk an iteration (chunked prefill)
        self._joining_tokens = 0.0  # the KV they hold
        self.cached: OrderedDict[str, int] = OrderedDict()  # episode -> KV tokens kept after its turn
        self.host: OrderedDict[str, int] = OrderedDict()  # episode -> KV tokens of its evicted prefix on the host
        self._host_tokens = 0  # sum of ``host``
        self._saving_s = 0.0  # copies to the host tier not yet charged
        self.prefilled_tokens = self.restored_tokens = 0  # computed by prefills; copied back from the host
        self.prefill_seconds = 0.0  # virtual seconds of prefills (and host-tier copies), decode paused
        self.peak_kv_tokens = 0
        self.preemptions = 0
        self.decode_seconds = 0.0  # virtual seconds spent decoding (the running batch gaining tokens)
        self.decode_sequence_seconds = 0.0  # the same, each second times the sequences decoding in it
        self._cached_tokens = 0  # sum of ``cached``
        self._context = 0.0  # KV held by the running batch: its context tokens (what one iteration reads)
        # Every sequence of the batch gains a token an iteration, so each one's progress is one number
        # less its own mark, and the next to finish is the least (length + mark): a heap, never a scan.
        self._decoded = 0.0  # iterations the batch decoded since it was last empty
        self._ends: list[tuple[float, int, _Sequence]] = []  # (length + mark, admitted, sequence)
        self._admissions = itertools.count()
        self._paused = False  # a weight load waits for the running batch to drain
        self._drained = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._epoch = 0  # bumped by abort: work in progress from an older epoch is discarded
        self._epoch_at_top = 0  # the epoch when the serving loop last went round
        self._decoding: _DecodeRun | None = None  # the run of iterations decoding now
        self._phase = "starting"  # the serving loop's state: starting, prefill, decoding, idle, woken, closed
        self._prefilling: list[_Sequence] = []  # admitted with a ``started`` to tell when the prefill ends
        self._timer: asyncio.TimerHandle | None = None
        self._loop.call_soon(self._top)

    # -- requests --------------------------------------------------------------------------------
    @property
    def load(self) -> int:
        return len(self.queue) + len(self.joining) + len(self.running)

    @property
    def pending(self) -> int:
        """Requests still to be prefilled here (queued, or in the prefill running now, or joining)."""
        return len(self.queue) + len(self._prefilling) + len(self.joining)

    @property
    def _held(self) -> float:
        """KV the admitted requests hold: the running batch's and the joining requests'."""
        return self._context + self._joining_tokens

    def submit(
        self,
        episode: str,
        prompt_tokens: int,
        max_new: int,
        length: int | None = None,
        done: Callable[[Completion], None] | None = None,
        started: Callable[[], None] | None = None,
    ) -> asyncio.Future | _Sequence:
        """Queue a turn that generates ``length`` tokens (default: the whole ``max_new`` budget);
        ``done`` is told its completion (when not given, a future is, and is returned; when given, the
        request is returned, for ``cancel``), ``started`` each time its prefill ends."""
        length = max_new if length is None else length
        if self.offloaded:
            raise RuntimeError(f"{self.name}: request routed to an offloaded engine")
        if prompt_tokens + max_new > self.capacity:
            raise ValueError(
                f"{self.name}: a request of {prompt_tokens + max_new} tokens exceeds the KV capacity {self.capacity}"
            )
        if not 1 <= length <= max_new:
            raise ValueError(f"{self.name}: a turn of {length} tokens does not fit its budget of {max_new}")
        future = None
        if done is None:
            future = self._loop.create_future()
            done = future.set_result
        head = not self.queue  # behind others, it cannot be admitted before they are: no need to interrupt
        seq = _Sequence(episode, prompt_tokens, max_new, length, done, started=started, waiting_since=self._loop.time())
        self.queue.append(seq)
        if head and (self.cost.continuous_batching or not self.running):
            self._wake()
        return future if future is not None else seq

    def cancel(self, seq: _Sequence) -> None:
        """Stop serving ``seq``, whose caller has gone (its episode was dropped): it leaves the queue,
        the joining requests or the batch, its KV is freed (not cached: the episode has no next turn),
        and it is never answered. The batch's iterations so far are credited first, as for an abort."""
        if seq.answered:
            return
        seq.answered = True
        if seq in self.queue:  # waiting (a preempted one holds no KV either)
            self.queue.remove(seq)
        elif any(j.seq is seq for j in self.joining):
            self.joining = deque(j for j in self.joining if j.seq is not seq)
            self._joining_tokens -= seq.context
        elif seq in self.running:
            self._progress()
            self.running.remove(seq)
            self._leave_batch(seq)  # its entry in the ends heap is dropped when it comes up
            self._context -= seq.context
            if seq in self._prefilling:
                self._prefilling.remove(seq)
            if not self.running:
                self._empty_batch()
        else:
            return  # answered already, its answer on its way back
        if not self.running:
            self._drained.set()  # a weight load waiting for the batch re-checks it
        self._wake()  # the batch changed: the next event is another one

    def interrupt(self) -> None:
        """Answer the running requests (and the preempted ones waiting to resume) as aborted with the
        tokens decoded so far and free their KV (a continuation prefills its whole context again);
        queued requests stay queued."""
        self._progress()
        for seq in self.running:
            self._leave_batch(seq)
        answered = self.running + [j.seq for j in self.joining] + [s for s in self.queue if s.preempted]
        self.queue = deque(s for s in self.queue if not s.preempted)
        self.running = []
        self.joining.clear()
        self._joining_tokens = 0.0
        self._empty_batch()
        self._epoch += 1
        self._drained.set()
        self._wake()
        self._answer([(seq, self._completion(seq, "abort")) for seq in answered])

    def abort(self) -> None:
        """Interrupt the running requests, answer the queued ones as aborted too, and drop the
        prefix cache."""
        self.interrupt()
        answered, self.queue = self.queue, deque()
        self.cached.clear()
        self._cached_tokens = 0
        self._answer([(seq, self._completion(seq, "abort")) for seq in answered])

    # -- weights and memory -----------------------------------------------------------------------
    async def load_weights(self, version: int, seconds: float, interrupt: bool = False) -> None:
        """Stop admitting new requests, let the running batch (preempted members included) finish
        (never serve while weights change) or with ``interrupt`` answer it at once, load."""
        self._paused = True
        if interrupt:
            self.interrupt()
        self._wake()
        while self.running or self.joining or any(s.preempted for s in self.queue):
            self._drained.clear()
            await self._drained.wait()
        await asyncio.sleep(seconds)
        self.cached.clear()  # computed under the old weights, as the host tier's are
        self._cached_tokens = 0
        self._drop_host()
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
        self._phase = "closed"
        if self._timer is not None:
            self._timer.cancel()

    # -- the serving loop --------------------------------------------------------------------------
    # One loop, written as callbacks (a simulated run spends much of its time here, and a task's every
    # wake-up costs a future and a step): go round (``_top``): admit what fits and prefill it (decode
    # pauses, a wake changes nothing), then decode until the next sequence finishes or the cache
    # fills, or until woken (an arrival, an abort, a pause), and go round again. A wake takes effect
    # through a timer due at once, which runs after everything this instant has ready: the arrivals
    # of one burst wake an engine once.
    def _wake(self) -> None:
        """Interrupt the serving loop's wait: something changed (an arrival, an abort, a pause)."""
        if self._phase in ("idle", "decoding"):
            if self._timer is not None:
                self._timer.cancel()
            self._woken_from, self._phase = self._phase, "woken"
            self._timer = self._loop.call_later(0.0, self._resume)

    def _top(self) -> None:
        if self._phase == "closed":
            return
        self._epoch_at_top = self._epoch
        prefill = self._admit()
        if self.joining and not self.running:  # nothing decodes beside them: they prefill whole
            prefill += self._join_all()
        if prefill > 0:  # decode pauses while the new requests prefill
            self._phase = "prefill"
            self._timer = self._loop.call_later(prefill, self._after_prefill)
            return
        prefilled, self._prefilling = self._prefilling, []  # all of it cached: started at once
        for seq in prefilled:
            seq.started()
        self._decode()

    def _after_prefill(self) -> None:
        if self._phase == "closed":
            return
        prefilled, self._prefilling = self._prefilling, []
        if self._epoch_at_top == self._epoch:
            for seq in prefilled:
                seq.started()
        self._top()  # what arrived during the prefill is admitted now, as an iteration's scheduler would

    def _chunk_end(self) -> None:
        """The decoding chunk reached its event (a sequence done, the cache full): credited whole. From
        the clock, a chunk shorter than the clock resolves at that hour (1e-11 iterations at 4171 s)
        decoded nothing, and came round again for ever."""
        self._woken_from, self._phase = "chunk", "woken"
        self._resume()

    def _decode(self) -> None:
        """Decode until the next event, or wait for a wake when nothing runs."""
        if not self.running:
            self._drained.set()
            self._phase, self._timer = "idle", None
            return
        to_event, chunk, beside = self._iterations_to_event(), 0.0, (0.0, 0)
        if self.joining:  # a chunk of the head's prompt each iteration, beside the batch
            head, tokens = self.joining[0], self.cost.prefill_chunk
            beside = (tokens * head.seconds_per_token, tokens)
            gained = self.cost.tokens_per_step(self.cost.drafts_at(len(self.running)))  # tokens an iteration
            chunk = tokens / gained  # prompt tokens a token of progress
            to_event = min(to_event, head.left / chunk)
        # a token of each one's progress, priced at the chunk's mean context: each iteration reads the KV
        # as it has grown (a 30K-token tail priced at its first context all the way ran 8% fast, and
        # below the fluid bound, which prices a turn at its midpoint too)
        midway = self._context + to_event * len(self.running) / 2
        iteration = self.cost.decode_token_s(len(self.running), midway, beside)
        self._decoding = _DecodeRun(self._loop.time(), iteration, to_event, chunk, self._context, beside)
        self._phase = "decoding"
        self._timer = self._loop.call_later(to_event * iteration, self._chunk_end)

    def _resume(self) -> None:
        """After a wake or the chunk's end: credit what was decoded, finish, go round."""
        if self._phase == "closed":
            return
        self._timer = None  # the one that brought us here
        if self._woken_from in ("decoding", "chunk") and self._epoch_at_top == self._epoch:
            self._progress(whole=self._woken_from == "chunk")
            self._finish(self._finished())
            if self.running and self._iterations_to_full() <= EPS:
                self._preempt()
        self._top()

    def _cache(self, episode: str, tokens: int) -> None:
        self._uncache(episode)
        self.cached[episode] = tokens
        self._cached_tokens += tokens

    def _uncache(self, episode: str) -> int:
        tokens = self.cached.pop(episode, 0)
        self._cached_tokens -= tokens
        return tokens

    def _evict_to(self, limit: float) -> None:
        """Evict idle prefixes, least recently used first, until all KV fits in ``limit`` (to the host
        tier, if the stack has one)."""
        while self.cached and self._held + self._cached_tokens > limit + EPS:
            episode, tokens = self.cached.popitem(last=False)
            self._cached_tokens -= tokens
            self._to_host(episode, tokens)

    def _to_host(self, episode: str, tokens: int) -> None:
        """Keep ``tokens`` of the episode's KV in the host tier, if it has one that holds them (the least
        recently saved dropped beyond its capacity)."""
        if 0 < tokens <= self.cost.host_kv_tokens:
            self._host_tokens += tokens - self.host.pop(episode, 0)
            self.host[episode] = tokens
            self._saving_s += self.cost.restore_s(tokens)  # the copy out: the engine's next pause pays it
            while self._host_tokens > self.cost.host_kv_tokens:
                self._host_tokens -= self.host.popitem(last=False)[1]

    def _restore(self, episode: str, context: float) -> int:
        """The episode's prefix from the host tier (taken out of it), if it holds one that fits."""
        tokens = self.host.pop(episode, 0)
        self._host_tokens -= tokens
        return tokens if tokens < context else 0  # the prompt's last token is always computed

    def _drop_host(self) -> None:
        self.host.clear()
        self._host_tokens = 0

    def _admit(self) -> float:
        """Move queued requests whose context fits into the batch; returns the prefill seconds they need
        (requests admitted while others decode, with chunked prefill, join instead: none of their seconds)."""
        prefill, self._saving_s = self._saving_s, 0.0
        if self.running and not self.cost.continuous_batching:
            return prefill  # static batching: the running batch finishes first
        beside = self.cost.prefill_chunk > 0 and bool(self.running)  # chunks beside a decoding batch
        while self.queue and not self.offloaded:
            seq = self.queue[0]
            if self._paused and not seq.preempted:
                break  # a weight load waits: only the running batch's own preempted members go on
            context = seq.context
            if self._held + context + 1 > self.capacity:
                break  # does not fit even with every idle prefix evicted: wait
            cached = self._uncache(seq.episode)
            cached = cached if cached <= context else 0
            restored = self._restore(seq.episode, context) if not cached else 0
            self._evict_to(self.capacity - context)
            self.queue.popleft()
            seq.queued_s, seq.waiting_since = seq.queued_s + self._loop.time() - seq.waiting_since, None
            if restored:
                prefill += self.cost.restore_s(restored)
                cached, self.restored_tokens = restored, self.restored_tokens + restored
            if not seq.preempted:
                seq.version, seq.cached_tokens = self.version, int(cached)
            seq.preempted = False
            seconds = self.cost.prefill_s(context - cached, cached)
            self.prefilled_tokens += context - cached
            if beside and context - cached >= 1:  # its chunks' all-reduces are the decode steps' (counted there)
                compute = self.cost.prefill_compute_s(context - cached, cached)
                self.joining.append(_Joining(seq, context - cached, compute / (context - cached)))
                self._joining_tokens += context
                continue
            self._join(seq, context)
            prefill += seconds
            if seq.started is not None:
                self._prefilling.append(seq)
        self.peak_kv_tokens = max(self.peak_kv_tokens, int(self._held + self._cached_tokens))
        self.prefill_seconds += prefill
        return prefill

    def _join(self, seq: _Sequence, context: float) -> None:
        """``seq``, its prompt computed, enters the decoding batch holding ``context`` tokens of KV."""
        seq.mark, seq.admitted = self._decoded - seq.generated, next(self._admissions)
        heapq.heappush(self._ends, (seq.length + seq.mark, seq.admitted, seq))
        self.running.append(seq)
        self._context += context

    def _joined(self, joining: _Joining) -> None:
        """A joining request's prompt is computed: its KV moves to the batch, which it enters."""
        context = joining.seq.context
        self._joining_tokens -= context
        self._join(joining.seq, context)

    def _join_all(self) -> float:
        """Every joining request enters the batch at once; returns the seconds their prompts' rest takes
        (decode pauses: nothing else decodes)."""
        # their rest computed whole, with its own all-reduces (a chunk's were its decode step's)
        seconds = sum(j.left * j.seconds_per_token + self.cost.tensor_parallel_s(j.left) for j in self.joining)
        for joining in self.joining:
            self._joined(joining)
            if joining.seq.started is not None:
                self._prefilling.append(joining.seq)
        self.joining.clear()
        self.prefill_seconds += seconds
        return seconds

    def _progress(self, whole: bool = False) -> None:
        """Credit the running sequences with the iterations decoded since the chunk started (``whole``:
        all of the chunk's); their growth evicts idle prefixes."""
        if self._decoding is None:
            return
        run, self._decoding = self._decoding, None  # the batch has not changed since the run started
        if not self.running:
            return
        if whole:
            progressed, iteration = run.iterations, run.token_s
        else:
            progressed, iteration = self._decoded_in(run, self._loop.time() - run.start)
        chunk = run.chunk
        self.decode_seconds += progressed * iteration
        self.decode_sequence_seconds += progressed * iteration * len(self.running)
        self._decoded += progressed
        self._context += progressed * len(self.running)
        if self._decoded > 1e6:  # a batch never empty for that long: rebase, so EPS stays above the rounding
            for seq in self.running:
                seq.mark -= self._decoded
            self._ends = [(seq.length + seq.mark, seq.admitted, seq) for seq in self.running]
            heapq.heapify(self._ends)
            self._decoded = 0.0
        computed = progressed * chunk  # prompt tokens of the joining requests, the head first
        while self.joining and computed > 0:
            head = self.joining[0]
            used = min(head.left, computed)
            head.left, computed = head.left - used, computed - used
            if head.left <= EPS * max(1.0, chunk):
                self._joined(self.joining.popleft())
                if head.seq.started is not None:
                    head.seq.started()
        self._evict_to(self.capacity)
        self.peak_kv_tokens = max(self.peak_kv_tokens, int(self._held + self._cached_tokens))

    def _decoded_in(self, run: _DecodeRun, elapsed: float) -> tuple[float, float]:
        """The iterations ``p`` a run cut short after ``elapsed`` seconds decoded, and their seconds a
        token: ``p`` priced at its own mean context (not the whole run's, which a wake's early cut paid
        too much for), the root of ``p * decode_token_s(n, context + p * n / 2) = elapsed``. The left
        side grows with ``p``, and the root lies between ``elapsed`` over the whole run's price (the
        most a token of it costs) and over the price at its start (the least): found there by regula
        falsi (Illinois), a few prices a wake."""
        n = len(self.running)

        def excess(p: float) -> float:
            return p * self.cost.decode_token_s(n, run.context + p * n / 2, run.beside) - elapsed

        low = min(run.iterations, elapsed / run.token_s)
        high = min(run.iterations, elapsed / self.cost.decode_token_s(n, run.context, run.beside))
        below, above = excess(low), excess(high)
        if below >= 0.0 or high - low <= ROOT_TOLERANCE * high:
            return low, run.token_s
        if above <= 0.0:  # the whole run was decoded (``high`` is ``run.iterations``)
            return high, run.token_s
        side = 0
        for _ in range(100):
            p = high - above * (high - low) / (above - below)
            value = excess(p)
            if value > 0.0:
                high, above = p, value
                below, side = (below / 2, 1) if side == 1 else (below, 1)  # Illinois: the stuck end halved
            else:
                low, below = p, value
                above, side = (above / 2, -1) if side == -1 else (above, -1)
            if high - low <= ROOT_TOLERANCE * high or abs(value) <= ROOT_TOLERANCE * elapsed:
                return p, (value + elapsed) / p
        raise RuntimeError(f"{self.name}: no decode progress found for {elapsed} s of a run: [{low}, {high}]")

    def _iterations_to_event(self) -> float:
        """Decode iterations the running batch can take before a sequence finishes or the cache is full."""
        return max(0.0, min(self._next_end() - self._decoded, self._iterations_to_full()))

    def _iterations_to_full(self) -> float:
        return (self.capacity - self._held) / len(self.running)

    def _next_end(self) -> float:
        """(length + mark) of the batch's next sequence to finish (entries of those gone are dropped)."""
        ends = self._ends
        while ends and ends[0][1] != ends[0][2].admitted:
            heapq.heappop(ends)
        return ends[0][0] if ends else math.inf

    def _finished(self) -> list[_Sequence]:
        """The batch's sequences that have generated their length, in the batch's order."""
        done, ends = [], self._ends
        while ends and self._next_end() - self._decoded <= EPS:
            done.append(heapq.heappop(ends)[2])
        return sorted(done, key=lambda seq: seq.admitted)

    def _leave_batch(self, seq: _Sequence) -> None:
        """``seq`` leaves the batch: its progress becomes its own again."""
        seq.generated, seq.admitted = self._decoded - seq.mark, -1

    def _empty_batch(self) -> None:
        self._context, self._decoded = 0.0, 0.0  # no float drift carried into the next batch
        self._ends.clear()

    def _preempt(self) -> None:
        """The cache is full of running sequences: take back the last admitted one's KV; it waits at
        the head of the queue to prefill its whole context again, or to restore it from the host tier
        (all but its last token, which gives its next logits)."""
        seq = self.running.pop()
        self._leave_batch(seq)
        self._context -= seq.context
        self._to_host(seq.episode, math.ceil(seq.context) - 1)
        if not self.running:
            self._empty_batch()
        seq.preempted, seq.waiting_since = True, self._loop.time()
        self.queue.appendleft(seq)
        self.preemptions += 1

    def _finish(self, done: list[_Sequence]) -> None:
        for seq in done:
            self.running.remove(seq)
            self._leave_batch(seq)
            self._context -= seq.context
            seq.generated = seq.length
            self._cache(seq.episode, seq.prompt_tokens + seq.length)  # the turn's KV becomes the cached prefix
        if done and not self.running:
            self._empty_batch()
            self._drained.set()
        self._evict_to(self.capacity)
        self._answer([(seq, self._completion(seq, "stop" if seq.length < seq.max_new else "length")) for seq in done])

    def _answer(self, answers: list[tuple[_Sequence, Completion]]) -> None:
        """Tell each sequence its completion, once: after the engine's own state is whole again (an
        answer may lead straight to another request)."""
        for seq, completion in answers:
            if not seq.answered:
                seq.answered = True
                seq.done(completion)

    def _completion(self, seq: _Sequence, finish: str) -> Completion:
        """A count of tokens (a simulated run records counts; ``simulated_response`` says what they are)."""
        n = TokenCount(int(seq.generated + EPS) if finish == "abort" else seq.length)
        queued = seq.queued_s + (0.0 if seq.waiting_since is None else self._loop.time() - seq.waiting_since)
        return Completion(n, n, finish, seq.version, self.devices[0], queued, seq.cached_tokens)
