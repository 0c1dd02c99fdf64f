"""The simulator's cost model: what each mechanism costs, as formulas of the target spec.

Units are seconds, bytes and FLOPs. A *device* is one accelerator; a rollout *engine* spans
``engine_devices`` consecutive devices (tensor parallel) because the weights must fit. Terms:

* **engine size** ``d``: the smallest power of two with ``weight_bytes / d <= 0.9 * memory *
  kv_memory_fraction`` (at least a tenth of the usable memory is left for the KV cache).
* **KV capacity** (tokens per engine): ``(d * memory * kv_memory_fraction - weight_bytes) /
  kv_bytes_per_token`` with ``kv_bytes_per_token = 2 * layers * max(kv_heads, d) * head_dim * dtype_bytes``
  (a device holds at least one KV head a layer: an engine wider than the model's KV heads replicates them,
  as vLLM's tensor parallelism does; Qwen3-235B's 4 KV heads on 8 devices are stored twice).
  A request is admitted when its context fits beside what the running sequences hold now (idle
  cached prefixes are evicted to make room); the KV grows a token per sequence per iteration, and a
  full cache preempts the newest sequence, which later prefills its whole context again (vLLM's
  recompute; ``engine.py``). Requests that do not fit wait in the engine's queue.
* **response length**: a turn generates as many of its ``max_new_tokens`` as
  ``workload.tokens.response_length`` draws (long-tailed, persistent per task;
  ``response_length.py``), all of them without it.
* **host tier** (a stack's ``host_kv_tokens`` an engine, the ``kv_host_tier`` skill): an idle prefix
  evicted for room is kept in host memory (at most ``d * host_memory``); the copy out and, at the
  episode's next turn on that engine, the copy back each take ``tokens * kv_bytes_per_token / (d *
  host_link_bandwidth)`` seconds (decode pauses, as for a prefill) instead of a prefill of those
  tokens. A weight load drops the tier and the device's prefix cache (their keys and values are the
  old weights'), as a real engine does.
* **decode iteration** (one token for each of ``b`` running sequences holding ``C`` context tokens):
  ``max(bytes / (d * hbm * hbm_efficiency), flops / (d * peak * rollout_mfu)) + decode_step_overhead_s``
  with ``bytes = dense_bytes + expert_bytes * (1 - (1 - k/E)^b) + C * kv_bytes_per_token`` (a MoE
  layer reads each expert that at least one of the ``b`` tokens routes to) and
  ``flops = 2 * active_params * b + 4 * layers * attn_width * C``: bandwidth-bound at small batch. An
  untied input embedding (``vocab * hidden``) is in neither: a step reads only its tokens' rows of it and
  multiplies nothing (it is held, synced and offloaded with the rest of the weights); a tied one is the
  output head's, read whole and multiplied every step.
* **speculative decoding** (a stack's ``speculative_tokens`` ``k``, while at most
  ``speculative_batch`` sequences run): each sequence verifies ``k`` draft tokens beside its last
  one, so a step computes ``w = k + 1`` positions per sequence, reading the experts ``b * w`` tokens
  route to (``bytes`` with ``b * w``) and doing ``w`` times the FLOPs, and yields
  ``E = (1 - a^(k+1)) / (1 - a)`` tokens per sequence on average, ``a`` the workload's
  ``tokens.draft_acceptance`` (the share of drafted tokens the model keeps, each kept only if the
  ones before it were). A sequence then progresses a token every ``iteration(b, C, w) / E`` seconds;
  the draft's extra KV slots are not modelled. Above ``speculative_batch`` (or with ``k = 0``) the
  plain iteration. The fluid lower bound takes the cheapest ``k`` in ``0..MAX_DRAFT_TOKENS`` for each token.
* **tensor-parallel traffic** of an engine of ``d > 1`` devices: each decode or prefill step over ``t``
  token positions (``b * w``, or ``n``) pays two all-reduces a layer of its ``a = t * hidden *
  dtype_bytes`` activation bytes. Within a node, over its ``m = min(d, devices_per_node)`` devices'
  links: ``2 * (m - 1) / m * a / intra_node_bandwidth`` (a ring's bytes; the all-reduces' latency is
  part of ``decode_step_overhead_s``, fitted at the target's engine size). Across ``N = d /
  devices_per_node > 1`` nodes, hierarchical (each device sends its node's share), besides:
  ``inter_node_latency_s + 2 * (N - 1) / N * a / devices_per_node / inter_node_bandwidth``. The step
  pays ``2 * layers`` times their sum: at paper scale (8 H800s an engine) 13.5 us a token position, as
  much as a prefill's linear compute.
* **prefill** of ``n`` new tokens after ``p`` cached ones (prefix reuse on the engine that served
  the previous turn; full re-prefill after an abort or a move to another engine):
  ``flops = 2 * active_params * n + 4 * layers * attn_width * n * (p + n / 2)`` at
  ``d * peak * rollout_mfu`` (plus the tensor-parallel traffic): compute-bound.
* **chunked prefill** (a stack's ``prefill_chunk`` ``c`` tokens, the ``chunked_prefill`` skill): while
  sequences decode, an admitted request's prompt is computed ``c`` tokens an iteration beside them
  (Sarathi-Serve's stall-free batching) instead of decode pausing for all of it: such an iteration takes
  ``max(memory_s, compute_s + x) + decode_step_overhead_s`` plus the tensor-parallel traffic of its
  positions and the chunk's, ``x = c * prefill_s(n, p) / n`` (the request's prefill spread evenly over its
  ``n`` new tokens), so a chunk uses the compute a memory-bound iteration leaves idle. The request joins
  the batch when its last chunk is computed; an engine with nothing decoding prefills whole, as without.
* **request overhead**: every ``generate`` answer reaches its caller ``request_overhead_s`` after
  its engine finished it (the calls between the controller and the engine; the engine is free
  meanwhile).
* **training** on trajectories of lengths ``L_i`` over ``g`` devices:
  ``sum_i (6 * active_params * L_i + 6 * layers * attn_width * L_i^2) / (g * peak * mfu) +
  train_step_overhead_s`` (dense FLOPs, ``active_params`` as above, plus causal attention forward
  ``2 * layers * attn_width * L^2`` times three for forward and backward).
* **weight sync** to an engine: its shard ``weight_bytes / d`` per device over the link
  (intra-node when the whole cluster is one node, else inter-node) ``+ sync_overhead_s``.
* **offload / reload**: the shard over the host link ``+ switch_overhead_s``.
* **the harness's weight export** after each train step: ``weight_export_s`` (fitted; the real
  harness's copy for the audit, not the stack's work, but the train call waits for it).
* **batching**: ``continuous`` admits queued requests at every iteration (both engine recipes, the
  paged engine and vLLM; what calibration fits); ``static`` only when the running batch has finished
  (an engine without continuous batching, modelled for comparison).

``hardware.mfu`` is the training MFU; the other efficiencies and overheads are the spec's
``simulator`` section (defaults there), which ``vibetrain calibrate`` fits from a real run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from targets.api import EngineSettings
from targets.spec import TargetSpec
from targets.spec.model import ModelSpec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_DRAFT_TOKENS = 8  # the longest draft the speculative_decoding skill lets a stack choose


@dataclass(frozen=True)
class CostModel:
    # model
    layers: int
    attn_width: int  # attention heads x head_dim
    active_params: float
    dense_params: float  # read every decode iteration (attention, norms, routers, the output head)
    expert_params: float  # all experts of all layers (0 for dense models)
    experts: int
    experts_per_token: int
    dtype_bytes: int
    kv_heads: int
    head_dim: int
    # hardware, per device
    peak_flops: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float
    host_bytes_per_s: float
    host_memory_bytes: float  # a device's share of its node's host memory
    memory_bytes: float
    train_mfu: float
    # efficiencies and overheads (the spec's ``simulator`` section; calibration fits them)
    rollout_mfu: float
    hbm_efficiency: float
    kv_memory_fraction: float
    decode_step_overhead_s: float
    request_overhead_s: float
    train_step_overhead_s: float
    sync_overhead_s: float
    switch_overhead_s: float
    weight_export_s: float
    engine_devices: int
    # an engine's tensor-parallel all-reduces: within a node and across nodes
    hidden_size: int
    devices_per_node: int
    inter_node_bytes_per_s: float
    inter_node_latency_s: float
    intra_node_bytes_per_s: float  # a node's devices' all-reduces (NVLink)
    continuous_batching: bool = True
    # speculative decoding: the workload's draft acceptance; the stack's draft length and batch limit
    draft_acceptance: float = 0.0
    speculative_tokens: int = 0
    speculative_batch: int = 0
    host_kv_tokens: int = 0  # the stack's host tier an engine (0: none)
    prefill_chunk: int = 0  # the stack's prompt tokens an iteration computes beside its decode (0: decode pauses)
    resident_bytes: float = 0.0  # another model's weights an engine's devices hold (a colocated judge's)
    lookup_params: float = 0.0  # an untied input embedding: held, never read whole nor multiplied

    @classmethod
    def from_spec(cls, spec: TargetSpec, pool: str | None = None, model: ModelSpec | None = None) -> CostModel:
        """The cost model of the devices of ``pool`` (a single-pool target's only pool when None)
        running the target's model, or ``model`` (a serving pool's)."""
        pools = spec.hardware.by_name
        if pool is None and len(pools) > 1:
            raise ValueError(f"target {spec.id} has the pools {sorted(pools)}: name one (or use ClusterCosts)")
        hw, sim = pools[pool] if pool is not None else next(iter(pools.values())), spec.simulator
        model = model or spec.model
        c = model.config
        counts = model.param_counts()
        expert_params = 0.0
        if model.family == "qwen3_moe":
            expert_params = float(c.num_hidden_layers * c.num_experts * 3 * c.hidden_size * c.moe_intermediate_size)
        dtype_bytes = DTYPE_BYTES[model.dtype]
        lookup = 0.0 if c.tie_word_embeddings else float(c.vocab_size * c.hidden_size)
        single_node = hw.count <= hw.devices_per_node
        cost = cls(
            layers=c.num_hidden_layers,
            attn_width=c.num_attention_heads * c.head_dim,
            active_params=counts.active - lookup,
            dense_params=max(0.0, counts.total - expert_params - lookup),
            lookup_params=lookup,
            expert_params=expert_params,
            experts=c.num_experts or 1,
            experts_per_token=c.num_experts_per_tok or 1,
            dtype_bytes=dtype_bytes,
            kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            peak_flops=hw.bf16_tflops * 1e12,
            hbm_bytes_per_s=hw.hbm_bandwidth_gbs * 1e9,
            link_bytes_per_s=(hw.intra_node_bandwidth_gbs if single_node else hw.inter_node_bandwidth_gbs) * 1e9,
            host_bytes_per_s=hw.host_link_bandwidth_gbs * 1e9,
            host_memory_bytes=hw.host_memory_bytes,
            memory_bytes=hw.memory_bytes,
            train_mfu=hw.mfu,
            rollout_mfu=sim.rollout_mfu,
            hbm_efficiency=sim.hbm_efficiency,
            kv_memory_fraction=sim.kv_memory_fraction,
            decode_step_overhead_s=sim.decode_step_overhead_s,
            request_overhead_s=sim.request_overhead_s,
            train_step_overhead_s=sim.train_step_overhead_s,
            sync_overhead_s=sim.sync_overhead_s,
            switch_overhead_s=sim.switch_overhead_s,
            weight_export_s=sim.weight_export_s,
            engine_devices=1,
            continuous_batching=sim.batching == "continuous",
            draft_acceptance=spec.workload.tokens.draft_acceptance,
            hidden_size=c.hidden_size,
            devices_per_node=hw.devices_per_node,
            inter_node_bytes_per_s=hw.inter_node_bandwidth_gbs * 1e9,
            inter_node_latency_s=sim.inter_node_latency_s,
            intra_node_bytes_per_s=hw.intra_node_bandwidth_gbs * 1e9,
        )
        # the stack's engine size is its own model's: a serving pool's engine (one a device) and a judge
        # take their model's smallest fit (a pinned size gave each serving device two devices' bandwidth)
        pinned = sim.engine_devices if model is spec.model else None
        devices = pinned or cost._smallest_engine()
        if devices > hw.count:
            where = "hardware.count" if pool is None else f"hardware.pools.{pool}.count"
            raise ValueError(
                f"the model's weights ({cost.weight_bytes / 1e9:.0f} GB) need {devices} devices per engine, "
                f"but {where} is {hw.count}"
            )
        cost = replace(cost, engine_devices=devices)
        serving = getattr(hw, "serving", None)
        if serving is not None and model is serving.model:  # the serving model's own requests
            index = next(i for i, p in enumerate(spec.hardware.pools) if p.name == pool)
            sequence = serving.prompt_tokens + serving.output_tokens
            field = f"hardware.pools.{index}.serving.prompt_tokens + output_tokens"
        else:  # the job's model, or a reward model, on any pool
            sequence, field = spec.workload.tokens.max_sequence, "workload.tokens.max_sequence"
        if cost.kv_capacity_tokens < sequence:  # every request would fail, naming no field
            which = f"simulator.engine_devices {devices}" if sim.engine_devices else f"an engine of {devices} devices"
            where = "" if pool is None else f" of pool {pool}"
            raise ValueError(
                f"{which}{where}: the model's weights ({cost.weight_bytes / 1e9:.0f} GB) leave room for "
                f"{cost.kv_capacity_tokens} KV tokens an engine, fewer than one sequence's {sequence} ({field})"
            )
        return cost

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def weight_bytes(self) -> float:
        return (self.dense_params + self.expert_params + self.lookup_params) * self.dtype_bytes

    def _smallest_engine(self) -> int:
        devices = 1
        while self.weight_bytes / devices > 0.9 * self.memory_bytes * self.kv_memory_fraction:
            devices *= 2
        return devices

    @property
    def kv_bytes_per_token(self) -> float:
        """A token's keys and values across the engine's devices: a device holds at least one KV head a layer,
        so an engine wider than the model's KV heads replicates them (vLLM's tensor parallelism)."""
        return 2 * self.layers * max(self.kv_heads, self.engine_devices) * self.head_dim * self.dtype_bytes

    @property
    def kv_capacity_tokens(self) -> int:
        free = (
            self.engine_devices * self.memory_bytes * self.kv_memory_fraction - self.weight_bytes - self.resident_bytes
        )
        return max(0, int(free / self.kv_bytes_per_token))

    # -- rollout -------------------------------------------------------------------------------
    def decode_iteration_s(
        self, batch: float, context_tokens: float, width: int = 1, beside: tuple[float, int] = (0.0, 0)
    ) -> float:
        """One decode step of ``batch`` sequences holding ``context_tokens`` in all, ``width``
        positions each (1, or a draft's ``k + 1``); ``beside``: the compute seconds and tokens of a
        prefill chunk the same step computes (chunked prefill), which take the compute the reads leave."""
        prefill_s, prefill_tokens = beside
        return max(
            self.decode_memory_s(batch, context_tokens, width),
            self.decode_compute_s(batch, context_tokens, width) + prefill_s,
        ) + self.decode_step_fixed_s(batch * width + prefill_tokens)

    def decode_memory_s(self, batch: float, context_tokens: float, width: int = 1) -> float:
        """A decode step's reads (``decode_bytes``) at the engine's bandwidth."""
        return self.decode_bytes(batch * width, context_tokens) / self.read_bytes_per_s

    def decode_compute_s(self, batch: float, context_tokens: float, width: int = 1) -> float:
        """A decode step's FLOPs at the engine's rollout MFU."""
        return (
            width
            * self.decode_flops(batch, context_tokens)
            / (self.engine_devices * self.peak_flops * self.rollout_mfu)
        )

    def decode_step_fixed_s(self, positions: float) -> float:
        """What a decode step over ``positions`` takes beside its reads or its compute: its overhead and its
        all-reduces' bytes."""
        return self.decode_step_overhead_s + self.tensor_parallel_s(positions)

    @property
    def read_bytes_per_s(self) -> float:
        """What an engine's devices read a second while decoding: their HBM bandwidth at its efficiency."""
        return self.engine_devices * self.hbm_bytes_per_s * self.hbm_efficiency

    def tensor_parallel_s(self, positions: float) -> float:
        """The two all-reduces a layer of one step over ``positions`` token positions: the bytes within a
        node over its links (their latency is in the step's fitted overhead), and across nodes hierarchical,
        each device sending its node's share over the inter-node link. 0 for an engine of one device."""
        if self.engine_devices <= 1:
            return 0.0
        activations = positions * self.hidden_size * self.dtype_bytes
        local = min(self.engine_devices, self.devices_per_node)
        seconds = 2 * (local - 1) / local * activations / self.intra_node_bytes_per_s
        nodes = self.engine_devices / self.devices_per_node
        if nodes > 1:
            share = activations / self.devices_per_node
            seconds += self.inter_node_latency_s + 2 * (nodes - 1) / nodes * share / self.inter_node_bytes_per_s
        return 2 * self.layers * seconds

    def tokens_per_step(self, draft_tokens: int) -> float:
        """``E``: tokens a sequence gains per verification of a ``draft_tokens``-token draft."""
        a = self.draft_acceptance
        return float(draft_tokens + 1) if a >= 1 else (1 - a ** (draft_tokens + 1)) / (1 - a)

    def speculating(self, draft_tokens: int, batch_limit: int) -> CostModel:
        """This cost model for a stack whose engines draft ``draft_tokens`` while at most
        ``batch_limit`` sequences run."""
        return replace(self, speculative_tokens=draft_tokens, speculative_batch=batch_limit)

    def with_host_tier(self, tokens: int) -> CostModel:
        """This cost model for a stack whose engines keep up to ``tokens`` of evicted prefixes on the host."""
        return replace(self, host_kv_tokens=tokens)

    def chunking(self, tokens: int) -> CostModel:
        """This cost model for a stack whose engines compute up to ``tokens`` of prompts an iteration beside
        the decoding batch (the ``chunked_prefill`` skill; 0: decode pauses for a prefill)."""
        return replace(self, prefill_chunk=tokens)

    @property
    def host_tier_limit_tokens(self) -> int:
        """The most KV an engine's host tier may hold: all of its devices' host memory."""
        return int(self.engine_devices * self.host_memory_bytes / self.kv_bytes_per_token)

    def restore_s(self, tokens: float) -> float:
        """Copying ``tokens`` of an engine's keys and values back from host memory, over each device's link."""
        return tokens * self.kv_bytes_per_token / self.engine_devices / self.host_bytes_per_s

    def decode_token_s(self, batch: int, context_tokens: float, beside: tuple[float, int] = (0.0, 0)) -> float:
        """Seconds per token of each running sequence's progress: the plain iteration, or with the
        stack's drafts (at most ``speculative_batch`` running) the verification over ``E``; ``beside``:
        a prefill chunk each iteration computes too (``decode_iteration_s``)."""
        return self.drafting_token_s(batch, context_tokens, self.drafts_at(batch), beside)

    def drafts_at(self, batch: int) -> int:
        """The draft length the stack's engines verify while ``batch`` sequences run (0: plain decode)."""
        k = self.speculative_tokens
        return k if k and batch <= self.speculative_batch else 0

    def drafting_token_s(
        self, batch: int, context_tokens: float, draft_tokens: int, beside: tuple[float, int] = (0.0, 0)
    ) -> float:
        """Seconds per token of progress verifying ``draft_tokens`` drafts a step: ``iteration(b, C, k + 1) / E``."""
        iteration = self.decode_iteration_s(batch, context_tokens, draft_tokens + 1, beside)
        return iteration / self.tokens_per_step(draft_tokens)

    def decode_bytes(self, batch: float, context_tokens: float) -> float:
        """What one decode iteration reads: the weights its batch touches (an MoE's experts, only
        those its tokens route to) and the batch's KV."""
        touched = 1.0 - (1.0 - self.experts_per_token / self.experts) ** batch if self.expert_params else 0.0
        weights = (self.dense_params + self.expert_params * touched) * self.dtype_bytes
        return weights + context_tokens * self.kv_bytes_per_token

    def decode_flops(self, batch: float, context_tokens: float) -> float:
        return 2 * self.active_params * batch + 4 * self.layers * self.attn_width * context_tokens

    def prefill_flops(self, new_tokens: float, cached_tokens: float) -> float:
        return 2 * self.active_params * new_tokens + 4 * self.layers * self.attn_width * new_tokens * (
            cached_tokens + new_tokens / 2
        )

    def prefill_s(self, new_tokens: float, cached_tokens: float) -> float:
        return self.prefill_compute_s(new_tokens, cached_tokens) + self.tensor_parallel_s(new_tokens)

    def prefill_compute_s(self, new_tokens: float, cached_tokens: float) -> float:
        """A prefill's compute alone: a chunk of it beside a decode step shares that step's all-reduces."""
        return self.prefill_flops(new_tokens, cached_tokens) / (
            self.engine_devices * self.peak_flops * self.rollout_mfu
        )

    # -- training and weights -------------------------------------------------------------------
    def train_s(self, lengths: list[int], devices: int, overhead: bool = True) -> float:
        """A step's forward and backward over ``lengths`` (``overhead``: and its fixed cost, once a step)."""
        flops = sum(6 * self.active_params * n + 6 * self.layers * self.attn_width * n * n for n in lengths)
        return flops / (devices * self.peak_flops * self.train_mfu) + (self.train_step_overhead_s if overhead else 0.0)

    def sync_s(self) -> float:
        return self.weight_bytes / self.engine_devices / self.link_bytes_per_s + self.sync_overhead_s

    def offload_s(self) -> float:
        return self.weight_bytes / self.engine_devices / self.host_bytes_per_s + self.switch_overhead_s

    reload_s = offload_s


@dataclass(frozen=True)
class ClusterCosts:
    """What work costs on each device: each pool's ``CostModel``, the pool a device is in, and the
    bandwidth between pools (a single-pool target: one pool, no links; the formulas above unchanged).

    * **engines** lie within one pool and cost what their pool's devices cost; every pool's engines
      span the same ``engine_devices`` (set ``simulator.engine_devices`` where the fewest that fit differ).
    * **training** on devices of several pools runs at the slowest one's pace (a data-parallel step
      waits for its slowest rank): the largest of its pools' ``train_s`` over all the devices.
    * **weight sync** to an engine outside the pool that trained: its shard over the link between
      the two pools (``hardware.links``, per device) ``+ sync_overhead_s``; within it, the pool's own
      ``sync_s``.
    """

    pools: dict[str, CostModel]
    pool_of: dict[str, str]  # device id -> its pool
    links: dict[frozenset[str], float]  # two pools -> bytes/s per device between them

    @classmethod
    def from_spec(cls, spec: TargetSpec, model: ModelSpec | None = None) -> ClusterCosts:
        """Each pool running the target's model, or ``model`` (a reward model's)."""
        hardware = spec.hardware
        several = len(hardware.by_name) > 1  # a single pool's errors name hardware.count, as they always did
        serving = {pool.name for pool in hardware.serving_pools}  # listed after the job's: ``shared`` is the job's
        names = sorted(hardware.by_name, key=lambda name: name in serving)
        pools = {name: CostModel.from_spec(spec, name if several else None, model) for name in names}
        sizes = {name: cost.engine_devices for name, cost in pools.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(
                f"the pools need engines of different sizes {sizes}: set simulator.engine_devices to one size"
            )
        devices = hardware.device_ids() + hardware.serving_device_ids()  # rollout may borrow a serving device
        pool_of = {device: hardware.pool_name(device) for device in devices}
        links = {frozenset(link.between): link.bandwidth_gbs * 1e9 for link in hardware.links}
        return cls(pools, pool_of, links)

    @property
    def engine_devices(self) -> int:
        return self.shared.engine_devices  # the same in every pool (from_spec checks)

    @property
    def shared(self) -> CostModel:
        """The job's first pool's model, for the terms every pool shares (the model's sizes, the spec's
        overheads) and a serverless reward model's devices (a spec may list its serving pool first)."""
        return next(iter(self.pools.values()))

    def of(self, device: str) -> CostModel:
        return self.pools[self.pool_of[device]]

    def refusal(self, engine: EngineSettings, max_engine_scale: int) -> str | None:
        """Why the target cannot run the engines a stack declares (None: it can): wider than the target
        lets them grow, or a host tier larger than their devices' host memory."""
        scale = engine.engine_scale
        if scale > max_engine_scale:
            return (
                f"the stack's engines span {scale} x {self.engine_devices} devices (engine_scale {scale}), over "
                f"the target's simulator.max_engine_scale {max_engine_scale}"
            )
        limit = min(cost.host_tier_limit_tokens for cost in self.scaled(scale).pools.values())
        if engine.host_kv_tokens > limit:
            tokens = engine.host_kv_tokens
            return f"a host tier of {tokens} tokens an engine (host_kv_tokens): over its devices' host memory, {limit}"
        return None

    def for_engines(self, engine: EngineSettings) -> ClusterCosts:
        """The costs of a stack's engines as it declares them: their span, drafts, host tier and prefill chunks."""
        pools = {
            name: cost.speculating(engine.speculative_tokens, engine.speculative_batch)
            .with_host_tier(engine.host_kv_tokens)
            .chunking(engine.prefill_chunk)
            for name, cost in self.scaled(engine.engine_scale).pools.items()
        }
        return replace(self, pools=pools)

    def scaled(self, scale: int) -> ClusterCosts:
        """Engines of ``scale`` times ``engine_devices`` (a stack's ``EngineSettings.engine_scale``):
        more KV room and bandwidth an engine, and the tensor-parallel traffic of their span."""
        return replace(
            self, pools={n: replace(c, engine_devices=c.engine_devices * scale) for n, c in self.pools.items()}
        )

    def hosting(self, resident_bytes: float) -> ClusterCosts:
        """Every engine also holding ``resident_bytes`` of another model's weights (a colocated judge)."""
        return replace(self, pools={name: replace(c, resident_bytes=resident_bytes) for name, c in self.pools.items()})

    def train_s(self, lengths: list[int], devices: list[str], overhead: bool = True) -> float:
        return max(self.of(d).train_s(lengths, len(devices), overhead) for d in devices)

    def sync_s(self, engine: list[str], trained_on: set[str]) -> float:
        """Seconds to load a version into the engine on ``engine`` from the pools of ``trained_on``
        (the devices that made it; empty: the harness's version 0, loaded within the pool)."""
        pool = self.pool_of[engine[0]]
        cost = self.pools[pool]
        sources = {self.pool_of[d] for d in trained_on}
        if not sources or pool in sources:
            return cost.sync_s()
        link = max(self.links[frozenset((pool, source))] for source in sources)
        return cost.weight_bytes / cost.engine_devices / link + cost.sync_overhead_s
