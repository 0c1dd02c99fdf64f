"""Qwen3 (dense and MoE) as the paged engine runs it: the transformers checkpoint's own weights and
names, read straight from its safetensors (no transformers import: an engine starts in a fraction of
the time), and a forward over a flat batch of tokens from many sequences (``[T, hidden]``, each
sequence's new tokens back to back), with attention delegated to a paged-KV backend.

The arithmetic follows transformers' Qwen3 exactly where it matters for logprobs: RMSNorm in float32
then scaled, q/k norms per head before RoPE, RoPE with frequencies in float32, the MoE router's softmax
in float32 then top-k (renormalised when ``norm_topk_prob``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F


class Attention(Protocol):
    """Paged attention for one step: ``cache`` says where the step's new keys and values go (the layer's
    key and value rows ``[slots, kv_heads, dim]`` and each new token's slot); ``attend`` attends each
    query over its sequence's whole context, the step's keys and values written (causal within them)."""

    def cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor: ...


def checkpoint_files(model_path: str) -> list[Path]:
    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    names = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    return [root / name for name in names]


def parameter_count(model_path: str) -> int:
    """Parameters in the checkpoint, from the safetensors headers alone (nothing is loaded)."""
    from safetensors import safe_open

    count = 0
    for path in checkpoint_files(model_path):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                count += math.prod(f.get_slice(key).get_shape())
    return count


def load_checkpoint(model_path: str, device: str, dtype: torch.dtype) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, weights by transformers name) from a local checkpoint directory."""
    from safetensors.torch import load_file

    root = Path(model_path)
    config = json.loads((root / "config.json").read_text())
    weights: dict[str, torch.Tensor] = {}
    for name in checkpoint_files(model_path):
        for key, tensor in load_file(name, device="cpu").items():
            weights[key] = tensor.to(device=device, dtype=dtype)
    if "lm_head.weight" not in weights:  # tied embeddings are saved once
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return config, _fuse_experts(weights)


def _fuse_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoints store one tensor per expert; transformers (and so every state dict a trainer
    exports) fuses them per layer: ``experts.gate_up_proj [E, 2I, H]`` (gate rows first) and
    ``experts.down_proj [E, H, I]``. The engine keeps the fused form."""
    per_expert = [k for k in weights if ".mlp.experts." in k and k.endswith("_proj.weight")]
    layers = sorted({k.split(".mlp.experts.")[0] for k in per_expert})
    for prefix in layers:
        count = 1 + max(
            int(k.split(".mlp.experts.")[1].split(".")[0]) for k in per_expert if k.startswith(prefix + ".")
        )
        e = [f"{prefix}.mlp.experts.{i}." for i in range(count)]
        weights[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([weights.pop(x + "gate_proj.weight"), weights.pop(x + "up_proj.weight")]) for x in e]
        )
        weights[f"{prefix}.mlp.experts.down_proj"] = torch.stack([weights.pop(x + "down_proj.weight") for x in e])
    return weights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def head_dim_of(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


class TorchOps:
    """The layer's elementwise work in torch ops: the arithmetic of record (``fused_ops.py`` computes
    the same in three Triton kernels, for a GPU's decode steps)."""

    @staticmethod
    def add_rms_norm(
        h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = h if delta is None else h + delta
        return total, rms_norm(total, weight, eps)

    @staticmethod
    def norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float):
        x = rms_norm(x, weight, eps)
        return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]

    @staticmethod
    def rope_into_cache(
        qkv: torch.Tensor,
        qk_norm: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        eps: float,
        heads: tuple[int, int],
        cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """The fused q/k/v projection's output ``[tokens, (heads + 2 * kv_heads) * dim]``: its keys (per-head
        norm, then RoPE) and values written to the cache's rows at the step's slots; its queries (the
        same, with the q norm: ``qk_norm`` is the q norm's weights, then the k norm's) returned."""
        (q_heads, kv_heads), (k_rows, v_rows, slots) = heads, cache
        dim = k_rows.shape[-1]
        q, k, v = qkv.split([q_heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        k_rows[slots] = TorchOps.norm_rope(k.view(-1, kv_heads, dim), qk_norm[dim:], cos, sin, eps)
        v_rows[slots] = v.view(-1, kv_heads, dim)
        return TorchOps.norm_rope(q.view(-1, q_heads, dim), qk_norm[:dim], cos, sin, eps)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """``F.silu(gate) * up`` of the fused gate/up projection's output (gate's columns first)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def rope_frequencies(config: dict, head_dim: int) -> torch.Tensor:
    """RoPE's inverse frequencies in float32, as transformers computes them (default rope type)."""
    theta = (config.get("rope_parameters") or {}).get("rope_theta") or config.get("rope_theta", 10000.0)
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponent)


class Qwen3:
    """The forward pass over ``weights``: the checkpoint's, by name, and each dense layer's fused
    ``self_attn.qkv_proj`` and ``mlp.gate_up_proj`` (``engine_weights.py``). Tensors shared with the
    engine: a weight load replaces them in place, so nothing here holds a stale copy."""

    def __init__(self, config: dict, weights: dict[str, torch.Tensor], fused: bool = False) -> None:
        """``fused``: the elementwise work in Triton kernels (``fused_ops.py``), else in torch ops."""
        self.config, self.weights = config, weights
        if fused:
            from . import fused_ops as ops  # imported where it runs: Triton is optional
        else:
            ops = TorchOps
        self.ops = ops
        self.layers = config["num_hidden_layers"]
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = head_dim_of(config)
        self.eps = config["rms_norm_eps"]
        experts = config.get("num_experts") or config.get("num_local_experts")  # transformers 5 writes the latter
        sparse = set(range(self.layers)) - set(config.get("mlp_only_layers") or [])
        step = config.get("decoder_sparse_step", 1)
        self.moe_layers = {i for i in sparse if experts and (i + 1) % step == 0}
        self.moe = bool(self.moe_layers)
        self.top_k = config.get("num_experts_per_tok", 0)
        self.norm_topk = config.get("norm_topk_prob", False)
        device = weights["model.embed_tokens.weight"].device
        self.inv_freq = rope_frequencies(config, self.head_dim).to(device)  # on the device: a graph copies nothing

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` of each position, ``[T, head_dim]``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        w, p = self.weights, f"model.layers.{i}.mlp."
        if i not in self.moe_layers:
            return F.linear(self.ops.silu_mul(F.linear(h, w[p + "gate_up_proj.weight"])), w[p + "down_proj.weight"])
        router = torch.softmax(F.linear(h, w[p + "gate.weight"]), dim=-1, dtype=torch.float32)
        top_weights, top_experts = torch.topk(router, self.top_k, dim=-1)
        if self.norm_topk:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        top_weights = top_weights.to(h.dtype)
        out = torch.zeros_like(h)
        gate_up, down = w[p + "experts.gate_up_proj"], w[p + "experts.down_proj"]
        for expert in top_experts.unique().tolist():
            rows, slot = torch.where(top_experts == expert)
            gate, up = F.linear(h[rows], gate_up[expert]).chunk(2, dim=-1)
            out.index_add_(0, rows, F.linear(F.silu(gate) * up, down[expert]) * top_weights[rows, slot, None])
        return out

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        """Final hidden states of every new token, ``[T, hidden]``."""
        w, ops, eps = self.weights, self.ops, self.eps
        h = w["model.embed_tokens.weight"][tokens]
        cos, sin = self.rope(positions, h.dtype)
        delta = None  # what the last block adds to the residual stream, added by the next norm
        for i in range(self.layers):
            p = f"model.layers.{i}."
            h, x = ops.add_rms_norm(h, delta, w[p + "input_layernorm.weight"], eps)
            qkv = F.linear(x, w[p + "self_attn.qkv_proj.weight"])
            q = ops.rope_into_cache(
                qkv, w[p + "self_attn.qk_norm.weight"], cos, sin, eps, (self.heads, self.kv_heads), attention.cache(i)
            )
            a = attention.attend(i, q).reshape(-1, self.heads * self.head_dim)
            h, x = ops.add_rms_norm(
                h, F.linear(a, w[p + "self_attn.o_proj.weight"]), w[p + "post_attention_layernorm.weight"], eps
            )
            delta = self._mlp(i, x)
        return ops.add_rms_norm(h, delta, w["model.norm.weight"], eps)[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the rows of ``hidden`` (only the rows that sample: never the whole batch)."""
        return F.linear(hidden, self.weights["lm_head.weight"]).float()
