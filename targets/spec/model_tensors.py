"""The tensors a dense Qwen3's checkpoint holds, by name and shape, from its config: what a model
directory's safetensors headers are held to when a spec is read (``model.py``), so that weights of another
model (a deeper one, another width, an adapter's alone) are named by ``target validate`` and before a run
starts, not at the first load of a large model minutes into it (``harness/model.py``'s ``WeightsMismatch``
still holds every load). An MoE checkpoint's experts are stored in more than one layout that transformers
converts as it loads: those are left to the load."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from targets.spec.model import ModelConfig

Shapes = dict[str, tuple[int, ...]]
BUFFERS = ("rotary_emb.inv_freq",)  # a buffer some checkpoints carry, which the model makes itself


def dense_tensors(c: ModelConfig, attention_bias: bool = False) -> Shapes:
    """Each weight of a dense Qwen3 (transformers' ``Qwen3ForCausalLM``) and its shape."""
    hidden, heads, kv, head = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    shapes: Shapes = {"model.embed_tokens.weight": (c.vocab_size, hidden), "model.norm.weight": (hidden,)}
    shapes["lm_head.weight"] = (c.vocab_size, hidden)
    for i in range(c.num_hidden_layers):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
            f"{layer}.self_attn.q_proj.weight": (heads * head, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv * head, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv * head, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, heads * head),
            f"{layer}.self_attn.q_norm.weight": (head,),
            f"{layer}.self_attn.k_norm.weight": (head,),
            f"{layer}.mlp.gate_proj.weight": (c.intermediate_size, hidden),
            f"{layer}.mlp.up_proj.weight": (c.intermediate_size, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, c.intermediate_size),
        }
        if attention_bias:
            shapes |= {
                f"{layer}.self_attn.{name}.bias": (size,)
                for name, size in (
                    ("q_proj", heads * head),
                    ("k_proj", kv * head),
                    ("v_proj", kv * head),
                    ("o_proj", hidden),
                )
            }
    return shapes


def mismatch(directory: Path, wanted: Shapes, found: Shapes, tied: bool) -> str | None:
    """What in ``found`` (the directory's headers) is not the model ``wanted`` describes, said as
    ``WeightsMismatch`` says it; None when they agree. A tied model may leave its ``lm_head`` out."""
    optional = {"lm_head.weight"} if tied else set()
    missing = sorted(set(wanted) - set(found) - optional)
    unexpected = sorted(name for name in set(found) - set(wanted) if not name.endswith(BUFFERS))
    shaped = [name for name in sorted(set(wanted) & set(found)) if tuple(found[name]) != wanted[name]]
    reshaped = [f"{name} is {list(found[name])}, the config's model {list(wanted[name])}" for name in shaped]
    return not_the_model(directory, missing, reshaped, unexpected)


def not_the_model(
    directory: Path, missing: list[str], reshaped: list[str], unexpected: list[str], untied: bool = False
) -> str | None:
    """What is wrong with a directory's weights, said one way whether its headers are read or the model is
    loaded (``harness/model.py``): tensors ``missing``, each of ``reshaped`` (a tensor at another shape, said),
    ``unexpected`` tensors, an ``untied`` lm_head. None when nothing is."""
    if not (missing or reshaped or unexpected or untied):
        return None
    said = [f"{len(missing)} of the model's tensors missing ({_some(missing)})"] if missing else []
    said += reshaped[:3]
    said += [f"{len(unexpected)} tensors the model has no place for ({_some(unexpected)})"] if unexpected else []
    said += ["tie_word_embeddings is true, yet its lm_head.weight differs from the embedding"] if untied else []
    return (
        f"{directory}: its weights are not the model its config.json describes: {'; '.join(said)} (a checkpoint "
        "of another model, or an adapter alone?)"
    )


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
