"""Torch rollout engine: batched generation with a KV cache on one device.

Prefill runs the left-padded batch once; each decode step feeds one token per live row against the
cache. Rows that finish are dropped from the batch (cache rows selected away), so a long-tailed
batch does not keep paying for its finished members. Logprobs are of the unscaled distribution
(``targets.api.SamplingParams``). ``abort`` stops a generation between decode steps;
``offload``/``reload`` park the weights on a host copy and restore them in place.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from targets.api import Completion, SamplingParams, StateDict, TokenIds


class TorchEngine:
    """Follows ``targets.api.RolloutEngine``."""

    def __init__(self, model_path: str, dtype: str = "float32", device: str = "cpu", name: str = "engine") -> None:
        self.model_path, self.dtype, self.device, self.name = model_path, getattr(torch, dtype), device, name
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype).to(device).eval()
        self.weight_version = 0
        self._abort = threading.Event()
        self._host_state: dict[str, torch.Tensor] | None = None

    # -- weights ---------------------------------------------------------------------------------
    def load_weights(self, state: StateDict, version: int) -> None:
        if self.offloaded:
            raise RuntimeError(f"{self.name}: load_weights while offloaded; reload first")
        self.model.load_state_dict({k: v.to(self.device, self.dtype) for k, v in state.items()}, strict=True)
        self.weight_version = version

    def offload(self) -> None:
        """Move the weights to a host copy and free the device copy (the module itself stays, so
        reload is a copy back, not a rebuild)."""
        if self._host_state is not None:
            return
        self._host_state = {}
        for name, tensor in self._tensors():
            self._host_state[name] = tensor.data.to("cpu", copy=True)
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=self.device)

    def reload(self) -> None:
        if self._host_state is None:
            return
        for name, tensor in self._tensors():
            tensor.data = self._host_state[name].to(self.device)
        self._host_state = None

    def _tensors(self):
        """Parameters and buffers, each shared tensor once (tied embeddings)."""
        yield from self.model.named_parameters()
        yield from self.model.named_buffers()

    @property
    def offloaded(self) -> bool:
        return self._host_state is not None

    def abort(self) -> None:
        """Make the generation in progress (if any) return at its next decode step."""
        self._abort.set()

    # -- generation ------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: Sequence[TokenIds], params: SamplingParams) -> list[Completion]:
        if self.offloaded:
            raise RuntimeError(f"{self.name}: generate while offloaded")
        if not prompts:
            return []
        self._abort.clear()
        generator = torch.Generator(self.device).manual_seed(params.seed) if params.seed is not None else None
        n = len(prompts)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        finish: list[str] = ["length"] * n
        stop = torch.tensor(params.stop_token_ids or [-1], device=self.device)

        length = max(len(p) for p in prompts)
        input_ids = torch.zeros(n, length, dtype=torch.long, device=self.device)
        attention = torch.zeros(n, length, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            input_ids[i, length - len(p):] = torch.tensor(p, device=self.device)
            attention[i, length - len(p):] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        live = torch.arange(n, device=self.device)  # original row of each batch row
        cache = DynamicCache()
        logits = self._forward(input_ids, attention, positions, cache)

        for step in range(params.max_new_tokens):
            logp = torch.log_softmax(logits, dim=-1)
            if params.temperature == 0:
                chosen = logits.argmax(-1)
            else:
                probs = torch.softmax(logits / params.temperature, dim=-1)
                chosen = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            chosen_logp = logp.gather(-1, chosen[:, None]).squeeze(-1)
            for row, (token, lp) in enumerate(zip(chosen.tolist(), chosen_logp.tolist())):
                tokens[int(live[row])].append(token)
                logprobs[int(live[row])].append(lp)
            stopped = torch.isin(chosen, stop)
            for row in stopped.nonzero().flatten().tolist():
                finish[int(live[row])] = "stop"
            keep = (~stopped).nonzero().flatten()
            if keep.numel() == 0 or step == params.max_new_tokens - 1:
                break
            if self._abort.is_set():
                for row in keep.tolist():
                    finish[int(live[row])] = "abort"
                break
            if keep.numel() < live.numel():  # compact: drop finished rows from batch and cache
                cache.batch_select_indices(keep)
                live, chosen, attention, positions = live[keep], chosen[keep], attention[keep], positions[keep]
            attention = torch.cat([attention, attention.new_ones(live.numel(), 1)], dim=1)
            positions = positions[:, -1:] + 1
            logits = self._forward(chosen[:, None], attention, positions, cache)
        return [Completion(tokens[i], logprobs[i], finish[i], self.weight_version, self.name) for i in range(n)]

    def _forward(self, input_ids, attention, positions, cache) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions, past_key_values=cache, use_cache=True
        )
        return out.logits[:, -1].float()
