"""Model factory: the target's model as a local HF directory (safetensors + config + tokenizer).

``random(SEED)`` weights are built from the config alone with transformers and cached under a
content hash of everything that determines them, so every process (harness, engines, trainers,
vLLM) loads the same files. A path is loaded as is. Nothing comes from a hub.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

from targets.cache import cache_error, cache_home
from targets.errors import UserError
from targets.harness.tokenizer import build_tokenizer, tokenizer_key
from targets.spec import ModelSpec
from targets.spec.model_tensors import BUFFERS, not_the_model

if TYPE_CHECKING:  # torch and transformers load where a model is built or loaded, not on import:
    import transformers  # a simulated run only needs the model's directory name
    from transformers import PreTrainedModel, PreTrainedTokenizerFast
FACTORY_VERSION = 1  # bump when the build recipe changes, to invalidate caches


def cache_root() -> Path:
    return cache_home() / "models"


def hf_config(model: ModelSpec) -> transformers.PretrainedConfig:
    import transformers

    fields = model.config.model_dump(exclude_none=True)
    if model.family == "qwen3":
        return transformers.Qwen3Config(**fields, dtype=model.dtype)
    return transformers.Qwen3MoeConfig(**fields, dtype=model.dtype)


def content_hash(model: ModelSpec) -> str:
    key = {
        "family": model.family,
        "config": model.config.model_dump(),
        "dtype": model.dtype,
        "weights": model.weights,
        "vocab": tokenizer_key(model.tokenizer_kind),
        "factory": FACTORY_VERSION,
        "transformers_major": version("transformers").split(".")[0],
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def model_dir(model: ModelSpec) -> Path:
    """The local directory holding this model; built (atomically) on first use for random weights."""
    seed = model.random_seed
    if seed is None:
        path = Path(model.weights)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.weights {path} has no config.json: not a model directory")
        return path
    target = cache_root() / f"{model.family}-{content_hash(model)}"
    if (target / "model.safetensors").exists() or (target / "model.safetensors.index.json").exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    except OSError as error:  # a file, a read-only folder: the user's to fix, said as such
        raise cache_error(target.parent, error) from None
    import torch
    from transformers import AutoModelForCausalLM

    try:
        torch.manual_seed(seed)
        built = AutoModelForCausalLM.from_config(hf_config(model), dtype=getattr(torch, model.dtype))
        built.save_pretrained(staging)
        build_tokenizer(model.config.vocab_size, model.tokenizer_kind).save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process built it first; theirs is identical
            if not (target / "config.json").exists():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return target


def proxy_model(model: ModelSpec) -> ModelSpec:
    """A tiny random model of the same family (dense or MoE), float32: what the accuracy checks run
    on when the target's own model is only simulated."""
    config = {
        "vocab_size": 64,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "max_position_embeddings": 512,
    }
    if model.family == "qwen3_moe":
        config.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96)
    return ModelSpec.model_validate(
        {"family": model.family, "dtype": "float32", "weights": "random(0)", "config": config}
    )


class WeightsMismatch(UserError, ValueError):
    """A model directory whose weights are not its config's model: loaded, it would run from random
    tensors where the weights are missing (transformers says so only in a table of its log)."""


def load_model(path: Path, dtype: str = "float32") -> PreTrainedModel:
    """The directory's model, refused (``WeightsMismatch``) where its files lack a tensor of the model, hold
    one at another shape or one the model has no place for (a deeper model's layers), or untie what its
    config ties (an ``lm_head`` of its own that differs from the embedding): transformers would make the
    tensor random, drop it, or untie the two, and say so only in its log, while the stack's own model
    loads the files as the config says."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()  # the harness loads small models often; bars are noise
    model, info = AutoModelForCausalLM.from_pretrained(  # a tensor at another shape: reported here, not raised
        path, dtype=getattr(torch, dtype), output_loading_info=True, ignore_mismatched_sizes=True
    )
    missing = sorted(info["missing_keys"])
    reshaped = [f"{entry[0]} at another shape" for entry in info["mismatched_keys"]]
    unexpected = sorted(k for k in info["unexpected_keys"] if not k.endswith(BUFFERS))
    output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    untied = model.config.tie_word_embeddings and output.weight is not embedding.weight
    said = not_the_model(path, missing, reshaped, unexpected, untied)
    if said is not None:
        raise WeightsMismatch(said)
    return model.eval()


def load_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path)
