"""The reference trainer: one process, whole batch in one forward, ``TrainingConfig``'s GRPO step."""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel

from targets.api import StateDict, TrainBatch, TrainingConfig
from targets.harness.reference.grpo import grpo_loss, pad_trajectories, token_logprobs


class ReferenceTrainer:
    """Follows ``targets.api.Trainer``."""

    def __init__(self, model: PreTrainedModel, config: TrainingConfig, version: int = 0) -> None:
        self.model = model.train()
        self.config = config
        self.version = version
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
        )
        self.reference = copy.deepcopy(model).eval().requires_grad_(False) if config.kl_coef > 0 else None
        self.last_loss = float("nan")
        self.last_grad_norm = float("nan")

    def train_step(self, batch: TrainBatch) -> int:
        device = next(self.model.parameters()).device
        padded = pad_trajectories(batch.trajectories).to(device)
        advantages = torch.tensor(batch.advantages, dtype=torch.float32, device=device)
        ref_logprobs = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logprobs = token_logprobs(self.reference, padded.tokens, padded.attention)
        new_logprobs = token_logprobs(self.model, padded.tokens, padded.attention)
        loss = grpo_loss(new_logprobs, padded, advantages, self.config, ref_logprobs)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm))
        self.optimizer.step()
        self.last_loss = float(loss.detach())
        self.version += 1
        return self.version

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: StateDict) -> None:
        self.model.load_state_dict(dict(state), strict=True)
