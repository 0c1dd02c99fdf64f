"""The reference rollout engine: transformers' forward over left-padded batches. ``next_token_logits``
runs the whole sequence at every token (no KV cache): slow and obviously right, the yardstick the
judge's checks compare engines with. ``ReferenceEngine`` (the reference loop's rollouts, check 2's
batches) decodes with transformers' own KV cache, held to that yardstick by tests/test_reference.py."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from targets.api import Completion, SamplingParams, StateDict, TokenIds
from targets.harness.reference.grpo import drawn_log_softmax


def left_padded(sequences: Sequence[TokenIds]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, attention mask, position ids) of ``sequences`` padded on the left to one length."""
    length = max(len(s) for s in sequences)
    tokens = torch.zeros(len(sequences), length, dtype=torch.long)
    attention = torch.zeros_like(tokens)
    for i, s in enumerate(sequences):
        tokens[i, length - len(s) :] = torch.tensor(s)
        attention[i, length - len(s) :] = 1
    return tokens, attention, (attention.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def next_token_logits(model: PreTrainedModel, sequences: Sequence[TokenIds]) -> torch.Tensor:
    """Logits of the next token after each sequence, [B, V] in float32."""
    tokens, attention, positions = left_padded(sequences)
    device = next(model.parameters()).device  # the reference runs where the target's model runs
    logits = model(
        input_ids=tokens.to(device), attention_mask=attention.to(device), position_ids=positions.to(device)
    ).logits
    return logits[:, -1].float().cpu()


def cache_keyword(model: PreTrainedModel) -> str:
    """The name of the forward's KV-cache argument and output: ``cache`` from transformers 5.25 on (the
    old ``past_key_values`` still works there, with a deprecation warning), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class ReferenceEngine:
    """Follows ``targets.api.RolloutEngine``."""

    def __init__(self, model: PreTrainedModel, weight_version: int = 0, device: str = "reference") -> None:
        self.model = model.eval()
        self.cache_keyword = cache_keyword(model)
        self.weight_version = weight_version
        self.device = device

    def load_weights(self, state: StateDict, version: int) -> None:
        self.model.load_state_dict(dict(state), strict=True)
        self.weight_version = version

    @torch.no_grad()
    def generate(self, prompts: Sequence[TokenIds], params: SamplingParams) -> list[Completion]:
        """Every row stays in the batch to the end (a finished one decodes on, unread), so the cache
        keeps its shape; the draws are over the unfinished rows only, as without a cache."""
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        device = next(self.model.parameters()).device
        tokens, attention, positions = left_padded(prompts)
        cache = None
        outputs: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        finished: list[str | None] = [None] * len(prompts)
        for _ in range(params.max_new_tokens):
            active = [i for i, f in enumerate(finished) if f is None]
            if not active:
                break
            out = self.model(
                input_ids=tokens.to(device),
                attention_mask=attention.to(device),
                position_ids=positions.to(device),
                use_cache=True,
                **{self.cache_keyword: cache},
            )
            cache = out[self.cache_keyword]
            logits = out.logits[:, -1].float().cpu()[active]
            logp = drawn_log_softmax(logits, params.temperature)
            if params.temperature == 0:
                chosen = logits.argmax(-1)
            else:
                chosen = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
            tokens = torch.zeros(len(prompts), 1, dtype=torch.long)  # a finished row's next input: unread
            for row, i in enumerate(active):
                token = int(chosen[row])
                tokens[i, 0] = token
                outputs[i].append(token)
                logprobs[i].append(float(logp[row, token]))
                if token in params.stop_token_ids:
                    finished[i] = "stop"
            attention = torch.cat([attention, torch.ones(len(prompts), 1, dtype=torch.long)], dim=1)
            positions = positions[:, -1:] + 1
        return [
            Completion(outputs[i], logprobs[i], finished[i] or "length", self.weight_version, self.device)
            for i in range(len(prompts))
        ]
