"""An honest trainer as a GPU stack runs one, for the judge's update bounds to be measured and tested
against: the GRPO loss and its gradients in bfloat16, AdamW on float32 master weights."""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel

from targets.api import TrainBatch, TrainingConfig
from targets.harness.reference.grpo import grpo_loss, pad_trajectories, token_logprobs


class Bf16MasterTrainer:
    """``base``: the model loaded in bfloat16 (its own float32 buffers, the rotary frequencies, kept)."""

    def __init__(self, base: PreTrainedModel, config: TrainingConfig) -> None:
        self.config = config
        self.masters, self.compute = copy.deepcopy(base).float(), copy.deepcopy(base).train()
        self.optimizer = torch.optim.AdamW(
            self.masters.parameters(),
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
        )

    def train_step(self, batch: TrainBatch, coasting: str = "") -> None:
        """One step; the tensors whose names contain ``coasting`` (if given) get zero gradients, so AdamW's
        momentum alone moves them (the evasion the judge's pull bound catches)."""
        self.compute.load_state_dict({k: v.to(torch.bfloat16) for k, v in self.masters.state_dict().items()})
        self.compute.zero_grad(set_to_none=True)
        padded = pad_trajectories(batch.trajectories)
        tokens = max(1.0, float(sum(sum(t.loss_mask) for t in batch.trajectories)))
        advantages = torch.tensor(batch.advantages, dtype=torch.float32)
        logprobs = token_logprobs(self.compute, padded.tokens, padded.attention)
        grpo_loss(logprobs, padded, advantages, self.config, None, tokens).backward()
        for (name, master), bf16 in zip(self.masters.named_parameters(), self.compute.parameters(), strict=True):
            master.grad = torch.zeros_like(master) if coasting and coasting in name else bf16.grad.float()
        torch.nn.utils.clip_grad_norm_(self.masters.parameters(), self.config.max_grad_norm)
        self.optimizer.step()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The float32 masters, copied (as the harness exports every version)."""
        return {k: v.detach().clone() for k, v in self.masters.state_dict().items()}
