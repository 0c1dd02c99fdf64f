"""Qwen3 (dense and MoE) as the trainer runs it: an ``nn.Module`` whose parameters carry the
transformers checkpoint's names and shapes (``model.layers.{i}.self_attn.q_proj.weight``, the MoE
experts fused per layer as transformers keeps them), read straight from the safetensors, with the
arithmetic of ``qwen3_model`` (the engine's) and attention by ``torch``'s SDPA over a padded batch.

Why not transformers' own class: importing its modeling stack costs each trainer process about two
CPU-seconds (torch._dynamo and the generation utilities come with it), paid by every rank of every
run; the harness keeps transformers as the reference the trainer is checked against.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .qwen3_model import load_checkpoint, rms_norm, rope_frequencies, rotate_half


class _Norm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _linear(inputs: int, outputs: int) -> nn.Linear:
    return nn.Linear(inputs, outputs, bias=False)


class _Attention(nn.Module):
    def __init__(self, config: dict, head_dim: int) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        self.heads, self.kv_heads, self.head_dim = (
            config["num_attention_heads"],
            config["num_key_value_heads"],
            head_dim,
        )
        self.q_proj = _linear(hidden, self.heads * head_dim)  # in transformers' order: state dicts list alike
        self.k_proj, self.v_proj = _linear(hidden, self.kv_heads * head_dim), _linear(hidden, self.kv_heads * head_dim)
        self.o_proj = _linear(self.heads * head_dim, hidden)
        self.q_norm, self.k_norm = _Norm(head_dim, eps), _Norm(head_dim, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, length, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.kv_heads != self.heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = _linear(hidden, intermediate), _linear(hidden, intermediate)
        self.down_proj = _linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Router(nn.Module):
    def __init__(self, experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden))


class _Experts(nn.Module):
    def __init__(self, experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, intermediate))


class _SparseMoE(nn.Module):
    """Top-k routing with the router's softmax in float32 (renormalised when ``norm_topk_prob``), each
    token through its chosen experts, weighted sums added back in token order."""

    def __init__(self, config: dict, experts: int) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.top_k, self.norm_topk = config["num_experts_per_tok"], config.get("norm_topk_prob", False)
        self.experts = _Experts(experts, hidden, config["moe_intermediate_size"])
        self.gate = _Router(experts, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        router = torch.softmax(F.linear(flat, self.gate.weight), dim=-1, dtype=torch.float32)
        top_weights, top_experts = torch.topk(router, self.top_k, dim=-1)
        if self.norm_topk:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        top_weights = top_weights.to(flat.dtype)
        out = torch.zeros_like(flat)
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        for expert in top_experts.unique().tolist():
            rows, slot = torch.where(top_experts == expert)
            gate, up = F.linear(flat[rows], gate_up[expert]).chunk(2, dim=-1)
            out = out.index_add(0, rows, F.linear(F.silu(gate) * up, down[expert]) * top_weights[rows, slot, None])
        return out.view_as(x)


class _Layer(nn.Module):
    def __init__(self, config: dict, head_dim: int, experts: int) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        self.self_attn = _Attention(config, head_dim)
        self.mlp = _SparseMoE(config, experts) if experts else _MLP(hidden, config["intermediate_size"])
        self.input_layernorm, self.post_attention_layernorm = _Norm(hidden, eps), _Norm(hidden, eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Backbone(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden, layers = config["hidden_size"], config["num_hidden_layers"]
        head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
        experts = config.get("num_experts") or config.get("num_local_experts") or 0  # transformers 5 writes the latter
        dense = set(config.get("mlp_only_layers") or [])
        step = config.get("decoder_sparse_step", 1)
        self.embed_tokens = nn.Embedding(config["vocab_size"], hidden)
        self.layers = nn.ModuleList(
            _Layer(config, head_dim, experts if i not in dense and (i + 1) % step == 0 else 0) for i in range(layers)
        )
        self.norm = _Norm(hidden, config["rms_norm_eps"])
        self.register_buffer("inv_freq", rope_frequencies(config, head_dim), persistent=False)


class Qwen3ForTraining(nn.Module):
    """``hidden(tokens, attention)`` gives the final hidden states of a right-padded batch;
    ``lm_head`` the logits. ``checkpointing`` recomputes each decoder layer in the backward pass."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.config, self.checkpointing = config, False
        self.model = _Backbone(config)
        self.lm_head = _linear(config["hidden_size"], config["vocab_size"])
        if config.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_pretrained(cls, model_path: str, dtype: torch.dtype) -> Qwen3ForTraining:
        config = json.loads((Path(model_path) / "config.json").read_text())
        with torch.device("meta"):
            model = cls(config)
        _, weights = load_checkpoint(model_path, "cpu", dtype)
        model.load_state_dict(weights, strict=True, assign=True)
        if config.get("tie_word_embeddings", False):  # assign=True loaded the two names as two tensors
            model.lm_head.weight = model.model.embed_tokens.weight
        model.model.inv_freq = rope_frequencies(config, model.model.layers[0].self_attn.head_dim)
        return model

    def hidden(self, tokens: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        backbone = self.model
        h = backbone.embed_tokens(tokens)
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        freqs = positions.float()[:, None] * backbone.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)  # [L, head_dim], broadcast over batch and heads
        mask = None
        if not bool(attention.all()):  # padding: causal and key-valid (rows are right-padded: none is empty)
            causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool, device=tokens.device).tril()
            mask = causal[None, None] & attention.bool()[:, None, None, :]
        for layer in backbone.layers:
            if self.checkpointing and self.training:
                h = checkpoint(layer, h, cos, sin, mask, use_reentrant=False)
            else:
                h = layer(h, cos, sin, mask)
        return backbone.norm(h)
