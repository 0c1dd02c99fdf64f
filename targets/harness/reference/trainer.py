"""The reference trainer: one process, ``TrainingConfig``'s GRPO step, the batch in as few forwards as
its float32 logits allow (a whole batch of a 150k-token vocabulary would not fit one GPU)."""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel

from targets.api import StateDict, TrainBatch, TrainingConfig, Trajectory
from targets.harness.reference.grpo import grpo_loss, pad_trajectories, token_logprobs

LOGITS_BYTES = 1 << 30  # float32 logits of one micro-batch (padded positions x vocabulary x 4 bytes)


def micro_batches(trajectories: list[Trajectory], vocab_size: int) -> list[list[int]]:
    """Consecutive runs of trajectory indices whose padded float32 logits stay under ``LOGITS_BYTES``
    (a trajectory alone always makes one). A small vocabulary keeps the whole batch in one."""
    groups: list[list[int]] = [[]]
    longest = 0
    for i, trajectory in enumerate(trajectories):
        length = max(longest, len(trajectory.tokens))
        if groups[-1] and (len(groups[-1]) + 1) * length * vocab_size * 4 > LOGITS_BYTES:
            groups.append([])
            length = len(trajectory.tokens)
        groups[-1].append(i)
        longest = length
    return groups


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
        response_tokens = max(1.0, float(sum(sum(t.loss_mask) for t in batch.trajectories)))
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for group in micro_batches(batch.trajectories, self.model.config.vocab_size):
            padded = pad_trajectories([batch.trajectories[i] for i in group]).to(device)
            advantages = torch.tensor([batch.advantages[i] for i in group], dtype=torch.float32, device=device)
            ref_logprobs = None
            if self.reference is not None:
                with torch.no_grad():
                    ref_logprobs = token_logprobs(
                        self.reference, padded.tokens, padded.attention, self.config.temperature
                    )
            new_logprobs = token_logprobs(self.model, padded.tokens, padded.attention, self.config.temperature)
            loss = grpo_loss(new_logprobs, padded, advantages, self.config, ref_logprobs, response_tokens)
            loss.backward()  # gradients add up to the whole batch's token mean
            total += float(loss.detach())
        self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm))
        self.optimizer.step()
        self.last_loss = total
        self.version += 1
        return self.version

    def coast(self) -> dict[str, torch.Tensor]:
        """The weights the next step would give on a batch with zero gradients: AdamW's momentum and
        weight decay alone, what a trainer that ignored the batch would still move. The difference from
        the real next step is the batch's own pull, which the judge asks every tensor to follow
        (``judge/update_error.py``). The trainer is left as it was.

        One parameter at a time (AdamW steps only the parameters that have a gradient, and a parameter's
        step on zero gradients reads nothing but its own value and state), so what it holds besides the
        coast it returns is one parameter's weights and AdamW state, not a copy of all of them (~7 GB at
        0.6B parameters in float32)."""
        parameters = {id(p) for p in self.model.parameters()}
        coasted, names = {}, {}  # names: a parameter's state-dict names (tied weights have two)
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            if id(tensor) in parameters:
                names.setdefault(id(tensor), []).append(name)
            else:
                coasted[name] = tensor.detach().clone()  # a buffer: no step moves it
        self.optimizer.zero_grad(set_to_none=True)
        for parameter in self.model.parameters():
            state = self.optimizer.state.get(parameter)
            kept = None if state is None else {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
            weights = parameter.detach().clone()
            parameter.grad = torch.zeros_like(parameter)
            self.optimizer.step()
            coasted.update(dict.fromkeys(names[id(parameter)], parameter.detach().clone()))
            parameter.grad = None
            with torch.no_grad():
                parameter.copy_(weights)
            if kept is None:
                del self.optimizer.state[parameter]  # a first step creates the state: none before, none after
            else:
                self.optimizer.state[parameter] = kept
        return coasted

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: StateDict) -> None:
        self.model.load_state_dict(dict(state), strict=True)
