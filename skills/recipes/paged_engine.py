"""Paged-KV rollout engine (in the spirit of nano-vllm): continuous batching over a block-managed KV
cache, per-request abort, prefix reuse across the turns of one episode, sleep and wake by tag, and on
GPU paged decode kernels (FlashInfer's, or Triton's where FlashInfer is missing) with CUDA graphs for
decode steps.

Every ``step`` admits waiting requests while their blocks fit (KV capacity, not a batch size, is the
limit), computes the new tokens of every running request in one flat forward (prompts and one token
per decoding request side by side), samples one token for each, and retires finished ones. A request
that cannot grow because the cache is full preempts the youngest running request, which later
recomputes its context. Logprobs: of the distribution drawn from (``targets.api.SamplingParams``).

Speculative decoding (``speculative_tokens`` > 0, the ``speculative_decoding`` skill): while at most
``speculative_batch`` requests run (the tail of a rollout, where a decode step reads all the weights
for a handful of tokens), a decoding request whose last ``speculative_ngram`` tokens occurred earlier
in its own context proposes the tokens that followed them there (prompt-lookup drafts: no draft
model). The step computes the draft beside the last token, and ``_verify`` keeps each drafted token
with the probability the model gives it, else draws from the model's distribution without it:
exactly the distribution of drawing token by token (speculative sampling with a one-hot draft).

``generate`` (the ``RolloutEngine`` protocol) submits a batch and steps until it is done; the engine
server drives ``step`` itself for many concurrent callers. ``submit``/``abort`` are safe from another
thread than the one stepping: they queue, and the step takes them in.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from collections.abc import Sequence

import torch

from targets.api import Completion, SamplingParams, StateDict, TokenIds

from .engine_weights import EngineWeights
from .kernel_choice import GRAPHED_ATTENTION, choose_attention, choose_fused
from .kv_cache import BlockManager, HostKV, KVPool
from .paged_attention import FlashInferAttention, SDPAAttention, StepLayout
from .qwen3_model import Qwen3, head_dim_of, load_checkpoint
from .request import Request, queue_by_arrival, refuse_unfit, step_takes
from .step_upload import StepUpload

TAGS = ("weights", "kv_cache")


class PagedEngine:
    """Follows ``targets.api.RolloutEngine``."""

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        device: str = "cpu",
        name: str = "engine",
        kv_tokens: int | None = None,
        kv_memory_fraction: float = 0.4,
        block_size: int = 16,
        max_batch: int = 256,
        cuda_graphs: bool = True,
        attention: str = "auto",
        separate_prefill: bool | None = None,
        speculative_tokens: int = 0,
        speculative_ngram: int = 2,
        speculative_batch: int = 64,
        host_kv_tokens: int = 0,
        fused_kernels: bool | None = None,
        prefill_chunk: int = 0,
    ) -> None:
        """``separate_prefill``: steps either prefill newly admitted requests or decode the running ones,
        never both, so every decode step is one the captured graphs replay (default: where graphs are
        captured; on CPU a mixed step is one forward instead of two). ``speculative_*``: drafts of up
        to that many tokens, found by a match of that many last tokens, while at most that many
        requests run (0 tokens: off). ``host_kv_tokens``: the host tier's capacity for evicted prefixes
        (the ``kv_host_tier`` skill; 0: an evicted prefix is lost). ``fused_kernels``: norms, RoPE and the
        MLP's activation in Triton kernels (``choose_fused``; default: with a GPU attention kernel).
        ``prefill_chunk``: prompt tokens a step computes beside the decoding requests (0: whole prompts)."""
        for option, value, low in (
            ("speculative_tokens", speculative_tokens, 0),
            ("speculative_ngram", speculative_ngram, 1),
            ("speculative_batch", speculative_batch, 1),
            ("prefill_chunk", prefill_chunk, 0),
            ("max_batch", max_batch, 1),  # 0 admits nothing: every generate would wait, the step loop spinning
            ("block_size", block_size, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: {option} must be an integer >= {low}, not {value!r}")
        self.speculative_tokens, self.speculative_ngram = speculative_tokens, speculative_ngram
        self.speculative_batch, self.prefill_chunk = speculative_batch, prefill_chunk
        self.drafted = self.accepted = self.chunks = 0  # drafted tokens, those kept; prompt chunks short of a prompt
        self.name, self.device, self.dtype = name, device, getattr(torch, dtype)
        self.config, self.weights = load_checkpoint(model_path, device, self.dtype)
        head_dim = head_dim_of(self.config)
        self.attention_kind = choose_attention(attention, device, self.dtype, head_dim, block_size)
        self.fused_kernels = choose_fused(fused_kernels, self.attention_kind, device, head_dim)
        self.store = EngineWeights(self.weights, self.config["num_hidden_layers"])  # q/k/v and gate/up fused
        if device.startswith("cuda"):  # the unfused copies' memory back, before the KV cache is sized from what is free
            torch.cuda.empty_cache()
        self.model = Qwen3(self.config, {**self.weights, **self.store.fused}, fused=self.fused_kernels)
        self.block_size, self.max_batch = block_size, max_batch
        self.host_kv = HostKV(host_kv_tokens, block_size) if host_kv_tokens else None
        kv_heads, head_dim = self.model.kv_heads, self.model.head_dim
        per_token = KVPool.bytes_per_token(self.model.layers, kv_heads, head_dim, self.dtype)
        if kv_tokens is None:
            kv_tokens = (
                int(torch.cuda.mem_get_info(device)[0] * kv_memory_fraction // per_token)  # of what is free now
                if device.startswith("cuda")
                else 1 << 15
            )
        if kv_tokens < 2 * block_size:  # said, not raised to two blocks: an engine that small serves nothing
            raise ValueError(
                f"{name}: a KV cache of {kv_tokens} tokens holds fewer than two blocks of {block_size} "
                "(free device memory times kv_memory_fraction, or kv_tokens, is too small)"
            )
        self.num_blocks = kv_tokens // block_size + 1  # the last block is a dummy for padded graph rows
        self.capacity_tokens = (self.num_blocks - 1) * block_size
        graphed = self.attention_kind in GRAPHED_ATTENTION and device.startswith("cuda")
        self._graph_batch = max_batch if (graphed and cuda_graphs and not self.model.moe) else 0
        self.separate_prefill = bool(self._graph_batch) if separate_prefill is None else separate_prefill
        self._prefilled_last = False  # the previous step was a prefill step (the next one decodes)
        self.weight_version = 0
        self._asleep: set[str] = set()
        self._ids = itertools.count()
        self._incoming: deque[Request] = deque()
        self._aborts: deque[int | None] = deque()  # None: abort everything
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.admitting = True  # False while a load drains: ``started`` requests finish (preempted first), none start
        # Own draws: engines seeded alike gave a prompt one sample everywhere (independence test); a request's seed wins
        self._generator = torch.Generator(device=device).manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        self.upload: StepUpload | None = None  # a graphed decode step's inputs, in one copy (made with the graphs)
        self._allocate_cache()

    # -- memory ---------------------------------------------------------------------------------------
    def _allocate_cache(self) -> None:
        spill = (lambda episode, prefix: self.host_kv.save(self.pool, episode, prefix)) if self.host_kv else None
        self.blocks = BlockManager(self.num_blocks - 1, self.block_size, spill)
        self.pool = KVPool(
            self.model.layers,
            self.num_blocks,
            self.block_size,
            self.model.kv_heads,
            self.model.head_dim,
            self.dtype,
            self.device,
        )
        heads, kv_heads, head_dim = self.model.heads, self.model.kv_heads, self.model.head_dim
        if self.attention_kind == "flashinfer":
            self.attention = FlashInferAttention(
                self.pool,
                heads,
                kv_heads,
                head_dim,
                self.dtype,
                self.device,
                self.num_blocks,
                graph_batch=self._graph_batch,
            )
        elif self.attention_kind == "triton":
            from .triton_attention import TritonAttention  # imported where it runs: Triton is optional

            longest = -(-self.config.get("max_position_embeddings", self.capacity_tokens) // self.block_size)
            widest = min(self.num_blocks, longest + 1)  # a graph's block-table row: one sequence's most blocks
            self.attention = TritonAttention(self.pool, heads, kv_heads, head_dim, self.device, widest)
        else:
            self.attention = SDPAAttention(self.pool, heads, kv_heads, head_dim)
        self.graphs: dict[int, tuple] = {}
        if self._graph_batch and "weights" not in self._asleep:
            self._capture_graphs()

    @property
    def offloaded(self) -> bool:
        return bool(self._asleep)

    def close(self) -> None:
        """Nothing to release: the weights and the KV pool are this process's memory, gone with it."""

    def sleep(self, tags: Sequence[str] = TAGS, discard_weights: bool = False) -> list[Request]:
        """Free the KV cache and/or move the weights to host memory (on GPU into pinned buffers kept from
        one sleep to the next: one copy each way, no allocation), keeping the tensors' identities for wake.
        ``discard_weights``: free them, no copy (a cluster that loads a new version on wake anyway); the
        version is then -1, no request taken until a load. Requests in flight are aborted and returned."""
        unknown = set(tags) - set(TAGS)
        if unknown:
            raise ValueError(f"unknown sleep tags {sorted(unknown)}; known: {TAGS}")
        self.abort_all()
        aborted = self._drain_control()
        self.graphs = {}  # they hold the addresses of the weights and the cache: recaptured on wake
        if "kv_cache" in tags and "kv_cache" not in self._asleep:
            self.pool = self.attention = self.blocks = None
            self._asleep.add("kv_cache")
        if "weights" in tags and "weights" not in self._asleep:
            if discard_weights:
                self.weight_version = -1
            elif self.device.startswith("cuda"):
                self.store.copy_to_host(pin=True)
                torch.cuda.synchronize(self.device)
            if discard_weights or self.device.startswith("cuda"):  # on CPU, host memory already
                self.store.free()
            self._asleep.add("weights")
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
        return aborted

    def wake(self, tags: Sequence[str] = TAGS) -> None:
        """Wake by tag; the order that avoids holding both copies is weights, then a weight load,
        then ``kv_cache`` (the engine refuses to serve until both are awake)."""
        if "weights" in tags and "weights" in self._asleep:
            self.store.allocate(self.device)  # what sleep freed, with its host copy if it made one
            self._asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self._asleep:
            self._asleep.discard("kv_cache")
            self._allocate_cache()
        if not self._asleep and self._graph_batch and not self.graphs:
            self._capture_graphs()

    def offload(self) -> None:
        self.sleep(TAGS)

    def reload(self) -> None:
        self.wake(TAGS)

    def load_weights(self, state: StateDict, version: int) -> None:
        """Replace the weights in place. Nothing may be running (a request would mix two versions:
        the server drains first), and cached prefixes, computed under the old weights, are dropped."""
        if "weights" in self._asleep:
            raise RuntimeError(f"{self.name}: load_weights while the weights sleep; wake them first")
        if self.started:
            raise RuntimeError(f"{self.name}: load_weights with requests started under the old weights; drain first")
        unknown = sorted(set(state) - set(self.weights))  # refused before anything changes: never half a load
        if unknown:
            raise KeyError(f"{self.name}: no parameter {unknown[0]!r} in this model")
        if self.weight_version < 0:  # discarded at sleep: a load must cover every tensor (a tied one by either name)
            missing = self.store.missing_from(state)
            if missing:
                raise KeyError(f"{self.name}: its weights were discarded; the load lacks {missing[:5]}")
        if self.blocks is not None:
            self.blocks.drop_prefixes()
        if self.host_kv is not None:
            self.host_kv.clear()
        for name, tensor in state.items():
            self.weights[name].copy_(tensor.to(self.device, self.dtype), non_blocking=True)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)
        self.weight_version = version

    # -- requests -------------------------------------------------------------------------------------
    def submit(
        self, prompt: TokenIds, params: SamplingParams, episode: str | None = None, arrival: int | None = None
    ) -> Request:
        """``arrival``: the cluster's number for the request, which admission follows (``queue_by_arrival``)."""
        refuse_unfit(self.name, prompt, params, self.capacity_tokens)
        if self.weight_version < 0:
            raise RuntimeError(f"{self.name}: its weights were discarded at sleep; load a version first")
        request = Request(next(self._ids), list(prompt), params, episode, tokens=list(prompt))
        request.arrival = request.id if arrival is None else arrival
        if params.seed is not None:
            request.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self._incoming.append(request)
        return request

    def abort(self, request_id: int) -> None:
        self._aborts.append(request_id)

    def abort_all(self) -> None:
        self._aborts.append(None)

    def has_work(self) -> bool:
        return bool(self._incoming or self._aborts or self.waiting or self.running)

    @property
    def started(self) -> bool:  # requests running, or preempted after they decoded: a weight load waits for both
        return bool(self.running) or any(request.decoded for request in self.waiting)

    def generate(self, prompts: Sequence[TokenIds], params: SamplingParams) -> list[Completion]:
        if self.offloaded:
            raise RuntimeError(f"{self.name}: generate while asleep")
        requests = [self.submit(p, params) for p in prompts]
        while not all(r.finish for r in requests):
            self.step()
        return [self.completion(r) for r in requests]

    def completion(self, request: Request) -> Completion:
        return request.completion(self.weight_version, self.name)

    # -- one iteration ----------------------------------------------------------------------------------
    def _drain_control(self) -> list[Request]:
        finished = []
        while self._incoming:
            queue_by_arrival(self.waiting, self._incoming.popleft())
        while self._aborts:
            target = self._aborts.popleft()
            for request in [*self.running, *self.waiting]:
                if target is None or request.id == target:
                    finished.append(self._retire(request, "abort"))
        return finished

    def _retire(self, request: Request, finish: str) -> Request:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self.blocks is not None:
            if finish == "abort":
                self.blocks.release(request.blocks)
            else:
                self.blocks.keep_prefix(request.episode, request.tokens[: request.computed], request.blocks)
        request.blocks, request.finish = [], finish
        request.done.set()
        return request

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting[0] if self.admitting else next((r for r in self.waiting if r.decoded), None)
            if request is None:  # draining: a preempted request that decoded may sit behind one that did not
                break
            needed = self.blocks.blocks_for(len(request.tokens))
            if not request.computed and self.host_kv is not None and request.episode in self.host_kv.saved:
                restored = self.host_kv.restore(self.pool, self.blocks, request.episode, request.tokens, needed)
                if restored is None:  # evicted, saved on the host, and no room for the request yet
                    break
                request.blocks, request.computed = restored
                self.waiting.remove(request)
                self.running.append(request)
                request.admitted()
                continue
            reused, cached = (
                self.blocks.take_prefix(request.episode, request.tokens) if not request.computed else ([], 0)
            )
            fresh = self.blocks.allocate(needed - len(reused))
            if fresh is None:
                self.blocks.release(reused)
                break
            request.blocks, request.computed = reused + fresh, cached
            self.waiting.remove(request)
            self.running.append(request)
            request.admitted()

    def _grow(self) -> None:
        """Every running request needs a block for the token it computes next; when none is left, preempt the
        youngest: readmitted, it recomputes its context, or reloads it from the host tier (``save_computed``)."""
        for request in list(self.running):
            while request in self.running and len(request.blocks) * self.block_size < len(request.tokens):
                block = self.blocks.allocate(1)
                if block is not None:
                    request.blocks += block
                    continue
                victim = self.running.pop()
                if self.host_kv is not None:
                    self.host_kv.save_computed(self.pool, victim)
                self.blocks.release(victim.blocks)
                victim.blocks, victim.computed = [], 0
                self.waiting.appendleft(victim)
                victim.waits()

    def step(self) -> list[Request]:
        """One scheduler iteration; returns the requests that finished (or were aborted) in it."""
        finished = self._drain_control()
        if self.offloaded:
            return finished
        self._admit()
        self._grow()
        if not self.running:
            return finished
        batch = self._this_step()
        takes = step_takes(batch, self.prefill_chunk)
        batch, takes = [r for r, n in zip(batch, takes) if n], [n for n in takes if n]
        drafts = self._drafts(batch)  # a request part-way through its prompt drafts nothing
        layout = StepLayout(
            [r.blocks for r in batch],
            [r.computed + n + len(d) for r, n, d in zip(batch, takes, drafts)],
            [n + len(d) for n, d in zip(takes, drafts)],
            self.block_size,
        )
        tokens = [t for r, n, d in zip(batch, takes, drafts) for t in r.tokens[r.computed : r.computed + n] + d]
        logits = self._forward(layout, tokens, [len(d) + 1 for d in drafts] if any(drafts) else None)
        whole = [r.computed + n == len(r.tokens) for r, n in zip(batch, takes)]  # the rest: a chunk, no token yet
        if not all(whole):
            self.chunks += whole.count(False)
            ends = itertools.accumulate(len(d) + 1 for d in drafts)  # each request's rows of logits end here
            rows = [row for end, d, w in zip(ends, drafts, whole) if w for row in range(end - len(d) - 1, end)]
            logits = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
            for request, n, w in zip(batch, takes, whole):
                request.computed += 0 if w else n
            batch, drafts = [r for r, w in zip(batch, whole) if w], [d for d, w in zip(drafts, whole) if w]
        if not batch:
            return finished
        if not any(drafts):  # the plain step: one row of logits a request, one batched draw
            chosen, logprobs = self._sample(batch, logits)
            news = [([token], [logprob]) for token, logprob in zip(chosen, logprobs)]
        else:
            news = self._verified(batch, drafts, logits)
        for request, (new_tokens, new_logprobs) in zip(batch, news):
            request.computed = len(request.tokens) + len(new_tokens) - 1  # a kept draft's keys are cached
            for token, logprob in zip(new_tokens, new_logprobs):
                request.tokens.append(token)
                request.logprobs.append(logprob)
                if token in request.params.stop_token_ids:
                    finished.append(self._retire(request, "stop"))
                    break
                if len(request.generated) >= request.params.max_new_tokens:
                    finished.append(self._retire(request, "length"))
                    break
            request.computed = min(request.computed, len(request.tokens))
        return finished

    # -- speculative decoding ---------------------------------------------------------------------------
    def _drafts(self, batch: list[Request]) -> list[list[int]]:
        """Each request's draft (most empty): a decoding request's continuation of the latest earlier
        occurrence of its last ``speculative_ngram`` tokens, short of its token budget, with the
        blocks it needs taken now (from free blocks and cached prefixes only: a draft never preempts)."""
        if not self.speculative_tokens or len(batch) > self.speculative_batch:
            return [[] for _ in batch]
        drafts = []
        n = self.speculative_ngram
        for request in batch:
            room = min(self.speculative_tokens, request.params.max_new_tokens - len(request.generated) - 1)
            tokens = request.tokens
            if len(tokens) - request.computed != 1 or room <= 0 or len(tokens) <= n:
                drafts.append([])
                continue
            for start in range(request.indexed, len(tokens) - n):  # each start indexed once: O(1) a token
                request.ngrams[tuple(tokens[start : start + n])] = start
            request.indexed = max(request.indexed, len(tokens) - n)
            start = request.ngrams.get(tuple(tokens[-n:]))
            draft = [] if start is None else tokens[start + n : start + n + room]
            need = self.blocks.blocks_for(len(tokens) + len(draft)) - len(request.blocks)
            more = self.blocks.allocate(need) if need > 0 and draft else []
            if more is None:
                draft = []
            else:
                request.blocks += more
            drafts.append(draft)
        return drafts

    def _verified(
        self, batch: list[Request], drafts: list[list[int]], logits: torch.Tensor
    ) -> list[tuple[list[int], list[float]]]:
        """Each request's new tokens and logprobs from its rows of ``logits`` (its draft's and its last
        token's): a request without a draft samples its one row with the others, batched."""
        ends = torch.tensor([len(d) + 1 for d in drafts]).cumsum(0)
        plain = [i for i, d in enumerate(drafts) if not d]
        news: dict[int, tuple[list[int], list[float]]] = {}
        if plain:
            chosen, logprobs = self._sample([batch[i] for i in plain], logits[ends[plain] - 1])
            news = {i: ([token], [logprob]) for i, token, logprob in zip(plain, chosen, logprobs)}
        for i, (request, draft) in enumerate(zip(batch, drafts)):
            if draft:
                end = int(ends[i])
                news[i] = self._verify(request, draft, logits[end - len(draft) - 1 : end])
        return [news[i] for i in range(len(batch))]

    def _verify(self, request: Request, draft: list[int], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Speculative sampling against a one-hot draft: row ``j`` of ``logits`` is the model's next-token
        distribution before ``draft[j]`` (the last row, after the whole draft). ``draft[j]`` is kept
        with probability ``p(draft[j])`` (greedy: when it is the argmax); at the first refusal the token
        is drawn from ``p`` without ``draft[j]``, renormalised; when all are kept a last token is drawn
        from the last row. Each token then has exactly the probability of sampling it directly."""
        temperature = request.params.temperature
        generator = request.generator if request.generator is not None else self._generator
        logp = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)  # what is drawn from
        probs = logp.exp() if temperature > 0 else None
        uniform = torch.rand(len(draft), generator=generator, device=logits.device, dtype=torch.float64)
        tokens: list[int] = []
        for j, proposal in enumerate(draft):
            if temperature > 0:
                kept = float(uniform[j]) < float(probs[j, proposal])
            else:
                kept = int(logits[j].argmax()) == proposal
            if not kept:
                if temperature > 0:
                    rest = probs[j].clone()
                    rest[proposal] = 0.0
                    token = int(torch.multinomial(rest / rest.sum(), 1, generator=generator)[0])
                else:
                    token = int(logits[j].argmax())
                tokens.append(token)
                break
            tokens.append(proposal)
        else:
            last = len(draft)
            if temperature > 0:
                tokens.append(int(torch.multinomial(probs[last], 1, generator=generator)[0]))
            else:
                tokens.append(int(logits[last].argmax()))
        self.drafted += len(draft)
        self.accepted += len(tokens) - 1  # the kept drafts, then one token of the model's own
        picked = logp[torch.arange(len(tokens), device=logits.device), torch.tensor(tokens, device=logits.device)]
        return tokens, picked.double().cpu().tolist()

    def _this_step(self) -> list[Request]:
        """The running requests this step computes: all of them, or (separating prefill) those with
        context to prefill, in admission order, then a decode step, so decoding waits one step at most."""
        if not self.separate_prefill:
            return list(self.running)
        prefill = [r for r in self.running if len(r.tokens) - r.computed > 1]
        decode = [r for r in self.running if len(r.tokens) - r.computed <= 1]
        self._prefilled_last = bool(prefill) and not (self._prefilled_last and decode)
        return prefill if self._prefilled_last else decode

    @torch.inference_mode()
    def _forward(self, layout: StepLayout, tokens: list[int], last: list[int] | None = None) -> torch.Tensor:
        """Logits of each sequence's last ``last[b]`` new tokens (default one), stacked in order,
        ``[sum(last), vocab]`` float32."""
        if layout.decode_only and self.graphs and len(tokens) <= max(self.graphs):
            return self._replay(layout, tokens)
        self.attention.plan(layout, self.device)
        positions = torch.tensor(layout.positions(), dtype=torch.long, device=self.device)
        hidden = self.model.hidden(
            torch.tensor(tokens, dtype=torch.long, device=self.device), positions, self.attention
        )
        if last is None:
            rows = torch.tensor(layout.new, device=self.device).cumsum(0) - 1
        else:
            ends = torch.tensor(layout.new).cumsum(0).tolist()
            rows = torch.tensor([r for end, k in zip(ends, last) for r in range(end - k, end)], device=self.device)
        return self.model.logits(hidden[rows])

    def _sample(self, batch: list[Request], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """One draw per row, on the device, in one call for every row that samples from the engine's
        generator (a request with its own seed draws from its own, reproducibly); the tokens and
        their log-probabilities come back to the host in one transfer. When every row draws from the
        engine's generator at one temperature (a system run's steps), nothing is sent to the device
        first. A log-probability is the drawn-from distribution's: tempered logit less its log-sum-exp."""
        temperatures = [request.params.temperature for request in batch]
        scales = [t if t > 0 else 1.0 for t in temperatures]  # greedy rows: the unscaled distribution
        if len(set(scales)) == 1:
            tempered = logits if scales[0] == 1.0 else logits / scales[0]
        else:
            tempered = logits / torch.tensor(scales, device=logits.device, dtype=logits.dtype)[:, None]
        shared = [i for i, r in enumerate(batch) if temperatures[i] > 0 and r.generator is None]
        if len(shared) == len(batch) and len(set(temperatures)) == 1:
            chosen = torch.multinomial(torch.softmax(tempered, -1), 1, generator=self._generator).squeeze(-1)
        else:
            chosen = logits.argmax(-1)
            if shared:
                rows = torch.tensor(shared, device=logits.device)
                chosen[rows] = torch.multinomial(torch.softmax(tempered[rows], -1), 1, generator=self._generator)[:, 0]
            for i, request in enumerate(batch):
                if temperatures[i] > 0 and request.generator is not None:
                    chosen[i] = torch.multinomial(torch.softmax(tempered[i], -1), 1, generator=request.generator)[0]
        picked = tempered.gather(-1, chosen[:, None]).squeeze(-1) - torch.logsumexp(tempered, dim=-1)
        both = torch.stack([chosen.to(torch.float64), picked.to(torch.float64)]).cpu()  # ids are exact in float64
        return both[0].long().tolist(), both[1].tolist()

    # -- CUDA graphs for decode steps ---------------------------------------------------------------------
    def _buckets(self) -> list[int]:
        sizes, size = [], 1
        while size < self._graph_batch:
            sizes.append(size)
            size *= 2
        return sizes + [self._graph_batch]

    def _padded(self, layout: StepLayout, size: int) -> StepLayout:
        """Padding rows read one token of the reserved dummy block (never handed to a request)."""
        pad = size - len(layout.new)
        dummy = self.num_blocks - 1
        return StepLayout(
            layout.block_tables + [[dummy]] * pad, layout.context + [1] * pad, layout.new + [1] * pad, self.block_size
        )

    def _send(self, layout: StepLayout, tokens: list[int]) -> dict[str, torch.Tensor]:
        """A graphed step's inputs (``layout`` padded to the graph's size) in one upload: the graph's token
        ids, positions and slots are views of it, fixed per size; the attention takes what it needs."""
        size = len(layout.new)
        sent = self.upload.send(
            [
                *tokens,
                *[0] * (size - len(tokens)),
                *layout.positions(),
                *layout.slots(),
                *self.attention.graph_inputs(layout),
            ]
        )
        static = {name: sent[i * size : (i + 1) * size] for i, name in enumerate(("tokens", "positions", "slots"))}
        self.attention.plan_graph(layout, static["slots"], sent[3 * size :])
        return static

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        if self.upload is None:
            self.upload = StepUpload(self._graph_batch * (3 + self.attention.inputs_per_row), self.device)
        for size in sorted(self._buckets(), reverse=True):
            static = self._send(self._padded(StepLayout([], [], [], self.block_size), size), [])
            for _ in range(2):  # warm up: kernels compiled and workspace sized outside the capture
                self.model.logits(self.model.hidden(static["tokens"], static["positions"], self.attention))
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model.logits(self.model.hidden(static["tokens"], static["positions"], self.attention))
            self.graphs[size] = (graph, static, out)

    def _replay(self, layout: StepLayout, tokens: list[int]) -> torch.Tensor:
        n = len(tokens)
        size = min(s for s in self.graphs if s >= n)
        graph, _, out = self.graphs[size]
        self._send(self._padded(layout, size), tokens)  # into the views the graph reads
        graph.replay()
        return out[:n]
