"""GRPO trainer: one data-parallel rank of the ``targets.api.TrainingConfig`` step.

Every rank receives the whole batch and trains on its shard (trajectories ``rank::world_size``),
in micro-batches. Each rank's loss is its response-token sum divided by the *whole batch's*
response-token count, so the all-reduced (summed) gradient equals the token-mean loss's gradient;
clipping and the AdamW step then run identically on every rank and the replicas stay equal.
With ``world_size == 1`` no process group is needed.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from targets.api import StateDict, TrainBatch, TrainingConfig, Trajectory


class GRPOTrainer:
    """Follows ``targets.api.Trainer``."""

    def __init__(
        self,
        model_path: str,
        config: TrainingConfig,
        dtype: str = "float32",
        device: str = "cpu",
        rank: int = 0,
        world_size: int = 1,
        init_method: str | None = None,
        micro_batch: int = 16,
        state: StateDict | None = None,
        threads: int | None = None,
    ) -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        self.config, self.device, self.rank, self.world_size, self.micro_batch = config, device, rank, world_size, micro_batch
        if world_size > 1:
            backend = "nccl" if device.startswith("cuda") else "gloo"
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device)
        if state is not None:
            self.model.load_state_dict(dict(state), strict=True)
        self.model.train()
        self.reference = None
        if config.kl_coef > 0:
            self.reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device).eval()
            self.reference.load_state_dict(self.model.state_dict())
            self.reference.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
        )
        self.version = 0

    def train_step(self, batch: TrainBatch) -> int:
        total_tokens = max(1, sum(t.response_tokens for t in batch.trajectories))
        mine = list(zip(batch.trajectories, batch.advantages))[self.rank :: self.world_size]
        self.optimizer.zero_grad(set_to_none=True)
        for start in range(0, len(mine), self.micro_batch):
            chunk = mine[start : start + self.micro_batch]
            loss_sum = self._loss_sum([t for t, _ in chunk], [a for _, a in chunk])
            (loss_sum / total_tokens).backward()
        if self.world_size > 1:
            for p in self.model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.version += 1
        return self.version

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
        new = self._token_logprobs(self.model, tokens, attention)
        ratio = torch.exp(new - old)
        adv = torch.tensor(advantages, device=self.device, dtype=new.dtype)[:, None]
        eps = self.config.clip_eps
        per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
        if self.reference is not None:
            with torch.no_grad():
                ref = self._token_logprobs(self.reference, tokens, attention)
            per_token = per_token + self.config.kl_coef * (torch.exp(ref - new) - (ref - new) - 1)
        return (per_token * mask).sum()

    @staticmethod
    def _token_logprobs(model, tokens: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=tokens, attention_mask=attention).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        return F.pad(logp, (1, 0))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def close(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
