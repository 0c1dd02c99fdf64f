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

    def train_step(self, batch: TrainBatch, coasting: str = "", halving: str = "", dropping: int = 0) -> None:
        """One step; the tensors whose names contain ``coasting`` (if given) get zero gradients, so AdamW's
        momentum alone moves them (the evasion the judge's pull bound catches); those whose names contain
        ``halving`` get the gradient of the first half of the batch's trajectories alone (weight gradients
        computed on half the rows, scaled to the whole); ``dropping``: every tensor's gradient leaves the
        batch's last trajectories out (a trainer that skips a few and says it trained on all)."""
        self.compute.load_state_dict({k: v.to(torch.bfloat16) for k, v in self.masters.state_dict().items()})
        kept = len(batch.trajectories) - dropping
        grads = self._gradients(batch.trajectories[:kept], batch.advantages[:kept])
        half = len(batch.trajectories) // 2
        halved = self._gradients(batch.trajectories[:half], batch.advantages[:half]) if halving else {}
        for name, master in self.masters.named_parameters():
            if coasting and coasting in name:
                master.grad = torch.zeros_like(master)
            else:
                master.grad = halved[name] if halving and halving in name else grads[name]
        torch.nn.utils.clip_grad_norm_(self.masters.parameters(), self.config.max_grad_norm)
        self.optimizer.step()

    def _gradients(self, trajectories, advantages: list[float]) -> dict[str, torch.Tensor]:
        """The bf16 gradients of the GRPO loss over ``trajectories`` (a token mean over their own), float32."""
        self.compute.zero_grad(set_to_none=True)
        padded = pad_trajectories(trajectories)
        tokens = max(1.0, float(sum(sum(t.loss_mask) for t in trajectories)))
        logprobs = token_logprobs(self.compute, padded.tokens, padded.attention, self.config.temperature)
        grpo_loss(logprobs, padded, torch.tensor(advantages, dtype=torch.float32), self.config, None, tokens).backward()
        return {name: p.grad.float() for name, p in self.compute.named_parameters()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The float32 masters, copied (as the harness exports every version)."""
        return {k: v.detach().clone() for k, v in self.masters.state_dict().items()}
