"""GRPO math, written once and plainly: group-relative advantages, per-token logprobs of a padded
batch, and the clipped policy-gradient loss of ``TrainingConfig``. The reference trainer uses it;
candidate trainers must reproduce it (check 2 compares their update to this one's)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from targets.api import TrainingConfig, Trajectory

ADVANTAGE_EPS = 1e-6


def group_advantages(trajectories: list[Trajectory]) -> list[float]:
    """(reward - group mean) / (group population std + eps); exactly 0 for a group with equal rewards."""
    return group_advantages_of([(t.group_id, t.reward) for t in trajectories])


def group_advantages_of(members: list[tuple[str, float]]) -> list[float]:
    """``group_advantages`` from (group, reward) pairs (what the audit has of a recorded batch)."""
    by_group: dict[str, list[float]] = defaultdict(list)
    for group, reward in members:
        by_group[group].append(reward)
    stats = {}
    for group, rewards in by_group.items():
        r = torch.tensor(rewards, dtype=torch.float64)
        stats[group] = (r.mean().item(), r.std(unbiased=False).item())
    equal = {group for group, rewards in by_group.items() if max(rewards) == min(rewards)}  # no signal: exactly 0
    # (a mean's rounding left +-1e-11 over the 1e-6, and a step that moved nothing read as a trainer that did not)
    return [
        0.0 if group in equal else (reward - stats[group][0]) / (stats[group][1] + ADVANTAGE_EPS)
        for group, reward in members
    ]


@dataclass
class PaddedBatch:
    tokens: torch.Tensor  # [B, L] right-padded with 0
    attention: torch.Tensor  # [B, L] 1 for real tokens
    loss_mask: torch.Tensor  # [B, L] float, 1 for response tokens
    old_logprobs: torch.Tensor  # [B, L] behaviour logprobs (0 off the mask)

    def to(self, device: torch.device) -> PaddedBatch:
        return PaddedBatch(
            self.tokens.to(device), self.attention.to(device), self.loss_mask.to(device), self.old_logprobs.to(device)
        )


def pad_trajectories(trajectories: list[Trajectory]) -> PaddedBatch:
    length = max(len(t.tokens) for t in trajectories)
    size = (len(trajectories), length)
    tokens = torch.zeros(size, dtype=torch.long)
    attention = torch.zeros(size, dtype=torch.long)
    loss_mask = torch.zeros(size, dtype=torch.float32)
    old = torch.zeros(size, dtype=torch.float32)
    for i, t in enumerate(trajectories):
        n = len(t.tokens)
        if t.loss_mask and t.loss_mask[0]:
            raise ValueError(f"trajectory {t.episode_id}: the first token cannot be a response token")
        tokens[i, :n] = torch.tensor(t.tokens)
        attention[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
        old[i, :n] = torch.tensor(t.logprobs, dtype=torch.float32)
    return PaddedBatch(tokens, attention, loss_mask, old)


def drawn_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probabilities of the distribution a token is drawn from at ``temperature`` (``SamplingParams``):
    softmax(logits / temperature), the unscaled softmax(logits) for greedy (0)."""
    return torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)


def token_logprobs(
    model: torch.nn.Module, tokens: torch.Tensor, attention: torch.Tensor, temperature: float
) -> torch.Tensor:
    """out[b, i] = log p(tokens[b, i] | tokens[b, :i]) with p = softmax(logits / temperature); out[:, 0] = 0."""
    logits = model(input_ids=tokens, attention_mask=attention).logits.float()
    logp = drawn_log_softmax(logits[:, :-1], temperature).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return F.pad(logp, (1, 0))


def grpo_loss(
    new_logprobs: torch.Tensor,
    batch: PaddedBatch,
    advantages: torch.Tensor,
    config: TrainingConfig,
    ref_logprobs: torch.Tensor | None = None,
    response_tokens: float | None = None,
) -> torch.Tensor:
    """Token-mean over all response tokens of the clipped surrogate (+ k3 KL to the reference).
    ``response_tokens``: the whole batch's count when this is one micro-batch of it."""
    ratio = torch.exp(new_logprobs - batch.old_logprobs)
    adv = advantages[:, None].to(new_logprobs.dtype)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - config.clip_eps, 1 + config.clip_eps) * adv)
    per_token = -surrogate
    if config.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs reference logprobs")
        log_ratio = ref_logprobs - new_logprobs
        per_token = per_token + config.kl_coef * (torch.exp(log_ratio) - log_ratio - 1)
    mask = batch.loss_mask
    denominator = mask.sum().clamp(min=1.0) if response_tokens is None else response_tokens
    return (per_token * mask).sum() / denominator
