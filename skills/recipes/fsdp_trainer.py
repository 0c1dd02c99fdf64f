"""GRPO trainer on FSDP2: one rank of ``targets.api.TrainingConfig``'s step, sharded over the trainer's
devices with ``torch.distributed.fsdp.fully_shard`` (gloo on CPU, NCCL on GPU).

* Master weights and optimizer state are float32 whatever the model's dtype: at lr 1e-6 an update
  of ~1e-6 would round away in bf16 for most weights. On GPU, compute runs in bf16 (FSDP2's
  mixed-precision policy: bf16 parameters in the forward, float32 gradient reduction).
* Each rank trains on its share of the batch (trajectories ``rank::world_size``) in micro-batches of
  like-length rows whose padded size stays within a token budget (``micro_batches``). A rank's loss
  is its response-token sum over the *whole batch's* response-token count, times the world size
  (FSDP2 averages gradients over ranks), so the result is the token-mean loss of the whole batch.
* Log-probs come in chunks of positions, each chunk's logits recomputed in the backward pass:
  never the whole sequence's float32 full-vocabulary logits at once. Activation checkpointing per
  decoder layer is on by default on GPU.
* ``offload``/``reload`` move parameters and optimizer state to host memory and back, for a device
  that changes role between training and rollout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from targets.api import StateDict, TrainBatch, TrainingConfig, Trajectory, WeightExport

from .qwen3_trainable import Qwen3ForTraining
from .rendezvous import connect


class _Policy(torch.nn.Module):
    """The causal LM with a forward that returns each token's log-prob: FSDP2's root must own the
    whole computation (its hooks gather the parameters), the head's chunks included."""

    def __init__(self, lm: torch.nn.Module, chunk: int, temperature: float) -> None:
        super().__init__()
        self.lm, self.chunk, self.temperature = lm, chunk, temperature

    def _chunk_logprobs(self, head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = head(hidden).float() / self.temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)

    def forward(self, tokens: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """out[b, i] = log p(tokens[b, i] | tokens[b, :i]), p the policy the rollout samples from
        (softmax(logits / temperature), ``TrainingConfig``); out[:, 0] = 0."""
        hidden = self.lm.hidden(tokens, attention)
        head = self.lm.lm_head
        pieces = []
        for start in range(0, tokens.shape[1] - 1, self.chunk):
            end = min(start + self.chunk, tokens.shape[1] - 1)
            pieces.append(
                checkpoint(
                    self._chunk_logprobs,
                    head,
                    hidden[:, start:end],
                    tokens[:, start + 1 : end + 1],
                    use_reentrant=False,
                )
            )
        return F.pad(torch.cat(pieces, dim=1), (1, 0))


# float32 master weights (4), their gradients (4) and AdamW's two moments (8), per parameter
TRAINER_BYTES_PER_PARAMETER = 16
USABLE_MEMORY = 0.8  # the rest: activations, the bf16 copy of the layer being computed, allocator slack


def check_fits(model_path: str, ranks: int, device_memory_bytes: int) -> None:
    """Fail before anything starts when the sharded training state cannot fit a device."""
    from .qwen3_model import parameter_count

    parameters = parameter_count(model_path)
    per_device = parameters * TRAINER_BYTES_PER_PARAMETER / ranks
    if per_device > USABLE_MEMORY * device_memory_bytes:
        raise ValueError(
            f"the trainer does not fit: {parameters / 1e9:.3g}B parameters x {TRAINER_BYTES_PER_PARAMETER} bytes "
            "(float32 weights, gradients, AdamW moments) / "
            f"{ranks} FSDP rank(s) = {per_device / 2**30:.3g} GiB per device, over "
            f"{USABLE_MEMORY:.0%} of its {device_memory_bytes / 2**30:.3g} GiB; train on at least "
            f"{math.ceil(parameters * TRAINER_BYTES_PER_PARAMETER / (USABLE_MEMORY * device_memory_bytes))} devices"
        )


def micro_batches(items: list[tuple[Trajectory, float]], budget: int) -> list[list[tuple[Trajectory, float]]]:
    """Micro-batches whose *padded* size (rows x the longest row) stays within ``budget`` tokens: the
    trajectories longest first, so each micro-batch holds rows of like length. Packed in arrival
    order, one long row padded every short one beside it (a budget of raw tokens let the padded
    batch run to several times the budget). A row longer than the budget goes alone."""
    batches: list[list[tuple[Trajectory, float]]] = []
    for item in sorted(items, key=lambda item: -len(item[0].tokens)):
        if batches and (len(batches[-1]) + 1) * len(batches[-1][0][0].tokens) <= budget:
            batches[-1].append(item)
        else:
            batches.append([item])
    return batches or [[]]


class FSDPTrainer:
    """Follows ``targets.api.Trainer``."""

    def __init__(
        self,
        model_path: str,
        config: TrainingConfig,
        dtype: str = "float32",
        device: str = "cpu",
        rank: int = 0,
        world_size: int = 1,
        rendezvous: str | None = None,
        state: StateDict | None = None,
        micro_batch_tokens: int = 8192,
        logprob_chunk: int = 1024,
        checkpointing: bool | None = None,
        threads: int | None = None,
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # refused here, not by range() at the first train step, after a whole rollout
        for option, value in (("micro_batch_tokens", micro_batch_tokens), ("logprob_chunk", logprob_chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"trainer: {option} must be an integer >= 1, not {value!r}")
        if threads is not None:
            torch.set_num_threads(threads)
        self.config, self.device, self.rank, self.world_size = config, device, rank, world_size
        self.micro_batch_tokens = micro_batch_tokens
        cuda = device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(device)
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
            if rendezvous is not None:
                dist.init_process_group(backend, store=connect(rendezvous, "trainer"), rank=rank, world_size=world_size)
            elif world_size == 1:  # alone: a store in this process's memory (no file, no port)
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            else:
                raise ValueError(f"a trainer of {world_size} ranks needs a rendezvous (the address of a Rendezvous)")
        elif (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise RuntimeError(
                f"this process is already rank {dist.get_rank()} of a group of {dist.get_world_size()}, "
                f"not rank {rank} of {world_size}: close the other trainer first"
            )
        mesh = init_device_mesh("cuda" if cuda else "cpu", (world_size,))
        lm = Qwen3ForTraining.from_pretrained(model_path, torch.float32)  # float32 master weights, always
        if state is not None:
            lm.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
        lm.checkpointing = checkpointing if checkpointing is not None else cuda
        # the forward's dtype: the model's on GPU; float32 on CPU (its kernels are fastest there, and exact)
        compute = getattr(torch, dtype) if cuda else torch.float32
        self.reference = None
        if config.kl_coef > 0:  # the frozen reference policy (version 0), unsharded, in the compute dtype
            frozen = Qwen3ForTraining.from_pretrained(model_path, compute)
            self.reference = _Policy(frozen, logprob_chunk, config.temperature)
            self.reference.lm.load_state_dict(lm.state_dict())
            self.reference.requires_grad_(False).eval().to(device)
        policy = _Policy(lm.to(device), logprob_chunk, config.temperature)
        precision = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
        for layer in lm.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=precision)
        fully_shard(policy, mesh=mesh, mp_policy=precision)
        self.module = policy.train()
        # foreach: PyTorch picks it only for plain tensors, and FSDP2's parameters are DTensors; one
        # multi-tensor op per update term, not one op (and one sharding propagation) per parameter
        self.optimizer = torch.optim.AdamW(
            self.module.parameters(),
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
            foreach=True,
        )
        self.version = 0
        self.offloaded = False
        # FSDP2 pads a rank's uneven shard on the host as the module moves there: from a copy still in
        # flight it would read stale memory, so only evenly sharded parameters move asynchronously
        self._async_offload = all(p.dim() == 0 or p.shape[0] % world_size == 0 for p in self.module.parameters())
        self._streamed: int | None = None  # response tokens of this step's parts so far (stream training)

    # -- the step -------------------------------------------------------------------------------------
    def _micro_batches(self, mine: list[tuple[Trajectory, float]]) -> list[list[tuple[Trajectory, float]]]:
        return micro_batches(mine, self.micro_batch_tokens)

    def train_step(self, batch: TrainBatch) -> int:
        if self.offloaded:
            raise RuntimeError("train_step while offloaded; reload first")
        tokens = sum(t.response_tokens for t in batch.trajectories)
        if self._streamed is None:
            self.optimizer.zero_grad(set_to_none=True)
            self._backward(batch, self.world_size / max(1, tokens))
        else:  # the parts' gradients are sums: the step's token mean needs all of its tokens
            self._backward(batch, self.world_size)
            total = max(1, self._streamed + tokens)
            for parameter in self.module.parameters():
                if parameter.grad is not None:
                    parameter.grad.div_(total)
            self._streamed = None
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.version += 1
        return self.version

    def train_part(self, batch: TrainBatch) -> None:
        """Stream training: this part's gradients now, summed over its tokens (the step's count is not
        known yet); ``train_step`` adds its own batch's, divides by the step's tokens, clips and steps."""
        if self.offloaded:
            raise RuntimeError("train_part while offloaded; reload first")
        if self._streamed is None:
            self.optimizer.zero_grad(set_to_none=True)
            self._streamed = 0
        self._backward(batch, self.world_size)
        self._streamed += sum(t.response_tokens for t in batch.trajectories)

    def _backward(self, batch: TrainBatch, scale: float) -> None:
        """The batch's loss sums times ``scale``, backward, its gradients reduced once at the end.
        Every rank runs as many micro-batches as the busiest one (each forward and the last backward
        are collectives): a rank with fewer runs zero-weight ones."""
        pairs = list(zip(batch.trajectories, batch.advantages))
        counts = [
            len(self._micro_batches(pairs[r :: self.world_size])) if pairs[r :: self.world_size] else 0
            for r in range(self.world_size)
        ]
        chunks = self._micro_batches(pairs[self.rank :: self.world_size]) if counts[self.rank] else []
        for i in range(max(counts)):
            self.module.set_requires_gradient_sync(i == max(counts) - 1)
            if i < len(chunks):  # FSDP2 averages gradients over ranks: scaled by the world size, they sum
                loss = self._loss_sum([t for t, _ in chunks[i]], [a for _, a in chunks[i]]) * scale
            else:
                loss = self._loss_sum(batch.trajectories[:1], [0.0]) * 0.0
            loss.backward()

    def _loss_sum(self, trajectories: Sequence[Trajectory], advantages: Sequence[float]) -> torch.Tensor:
        """Sum over the chunk's response tokens of the clipped surrogate (+ k3 KL)."""
        length = max(len(t.tokens) for t in trajectories)
        shape = (len(trajectories), length)
        tokens = torch.zeros(shape, dtype=torch.long)
        attention = torch.zeros(shape, dtype=torch.long)
        mask = torch.zeros(shape)
        old = torch.zeros(shape)
        for i, t in enumerate(trajectories):
            n = len(t.tokens)
            tokens[i, :n], attention[i, :n] = torch.tensor(t.tokens), 1
            mask[i, :n], old[i, :n] = torch.tensor(t.loss_mask, dtype=torch.float32), torch.tensor(t.logprobs)
        tokens, attention, mask, old = (x.to(self.device) for x in (tokens, attention, mask, old))
        new = self.module(tokens, attention)
        ratio = torch.exp(new - old)
        adv = torch.tensor(advantages, device=self.device, dtype=new.dtype)[:, None]
        eps = self.config.clip_eps
        per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
        if self.reference is not None:
            with torch.no_grad():
                ref = self.reference(tokens, attention)
            per_token = per_token + self.config.kl_coef * (torch.exp(ref - new) - (ref - new) - 1)
        return (per_token * mask).sum()

    # -- weights and memory ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full float32 weights (transformers names) on CPU; every rank must call it (it gathers)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(
            self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False)
        )
        return {k.removeprefix("lm."): v for k, v in full.items()}

    @torch.no_grad()
    def device_state(self) -> dict[str, torch.Tensor]:
        """The full weights on the training device (no host round trip), for a sync by copy
        or broadcast; every rank must call it (it gathers the shards)."""
        return {
            name.removeprefix("lm."): tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            for name, tensor in self.module.state_dict().items()
        }

    @torch.no_grad()
    def export_to(self, into: WeightExport) -> None:
        """Every distinct weight once (a tied embedding and head are one tensor) into the harness's
        export region, straight from the device it lives on (the region takes float32 whatever the
        masters are); every rank must call it (it gathers), rank 0 writes."""
        parameter = {name: id(p) for name, p in self.module.named_parameters(remove_duplicate=False)}
        seen: set[object] = set()  # the same on every rank, so every rank gathers the same tensors
        for name, tensor in self.module.state_dict().items():
            if parameter.get(name, name) in seen:
                continue
            seen.add(parameter.get(name, name))
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if self.rank == 0:
                into.write(name.removeprefix("lm."), full)

    @torch.no_grad()
    def offload(self, parts: tuple[str, ...] = ("optimizer", "params")) -> None:
        """Optimizer state and/or parameters to host memory (nothing moves on a CPU device). A sync
        offloads the optimizer first, copies the weights out, then offloads the parameters. The copies
        are asynchronous into pinned memory (torch's host allocator keeps it from one switch to the
        next): a blocking copy of 2.4 GB of float32 weights into fresh pageable memory pays its page
        faults and a staged copy at every switch (parameters a rank's padded shard holds excepted: see
        ``_async_offload``). Finished before this returns."""
        if self.device.startswith("cuda"):
            if "optimizer" in parts:
                self._move_optimizer("cpu")
            if "params" in parts:
                self.module.to("cpu", non_blocking=self._async_offload)
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        self.offloaded = self.offloaded or "params" in parts

    @torch.no_grad()
    def reload(self) -> None:
        if self.device.startswith("cuda"):
            self.module.to(self.device, non_blocking=True)
            self._move_optimizer(self.device)
            torch.cuda.synchronize(self.device)
        self.offloaded = False

    def _move_optimizer(self, device: str) -> None:
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device, non_blocking=True)

    def close(self) -> None:
        """Leaves the process group this trainer started (one it joined stays for its owner)."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
