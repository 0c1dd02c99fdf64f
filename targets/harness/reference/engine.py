"""The reference rollout engine: transformers forward over the whole sequence at every token (no
KV cache), left-padded batches. Slow and obviously right: the yardstick for engines."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from targets.api import Completion, SamplingParams, StateDict, TokenIds


@torch.no_grad()
def next_token_logits(model: PreTrainedModel, sequences: Sequence[TokenIds]) -> torch.Tensor:
    """Logits of the next token after each sequence, [B, V] in float32."""
    length = max(len(s) for s in sequences)
    tokens = torch.zeros(len(sequences), length, dtype=torch.long)
    attention = torch.zeros_like(tokens)
    for i, s in enumerate(sequences):
        tokens[i, length - len(s) :] = torch.tensor(s)
        attention[i, length - len(s) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    device = next(model.parameters()).device  # the reference runs where the target's model runs
    logits = model(
        input_ids=tokens.to(device), attention_mask=attention.to(device), position_ids=positions.to(device)
    ).logits
    return logits[:, -1].float().cpu()


class ReferenceEngine:
    """Follows ``targets.api.RolloutEngine``."""

    def __init__(self, model: PreTrainedModel, weight_version: int = 0, device: str = "reference") -> None:
        self.model = model.eval()
        self.weight_version = weight_version
        self.device = device

    def load_weights(self, state: StateDict, version: int) -> None:
        self.model.load_state_dict(dict(state), strict=True)
        self.weight_version = version

    def generate(self, prompts: Sequence[TokenIds], params: SamplingParams) -> list[Completion]:
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        sequences = [list(p) for p in prompts]
        outputs: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        finished: list[str | None] = [None] * len(prompts)
        for _ in range(params.max_new_tokens):
            active = [i for i, f in enumerate(finished) if f is None]
            if not active:
                break
            logits = next_token_logits(self.model, [sequences[i] for i in active])
            logp = torch.log_softmax(logits, dim=-1)
            if params.temperature == 0:
                chosen = logits.argmax(-1)
            else:
                probs = torch.softmax(logits / params.temperature, dim=-1)
                chosen = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            for row, i in enumerate(active):
                token = int(chosen[row])
                sequences[i].append(token)
                outputs[i].append(token)
                logprobs[i].append(float(logp[row, token]))
                if token in params.stop_token_ids:
                    finished[i] = "stop"
        return [
            Completion(outputs[i], logprobs[i], finished[i] or "length", self.weight_version, self.device)
            for i in range(len(prompts))
        ]
