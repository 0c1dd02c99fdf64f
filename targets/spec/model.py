"""The model a target trains: family, HF-style config, dtype, weights (a directory or ``random(seed)``)."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from targets.spec.base import Strict
from targets.spec.model_tensors import Shapes, dense_tensors, mismatch

RANDOM_WEIGHTS = re.compile(r"^random\((\d+)\)$")
MODEL_FILES = {  # what a model directory holds (each by any of its names), and what each is called in an error
    "config.json": ("config.json",),
    "safetensors weights": ("*.safetensors", "model.safetensors.index.json"),
    "tokenizer.json": ("tokenizer.json",),
}


class ModelConfig(Strict):
    """The HF-style config fields vibetrain uses (Qwen3 dense and MoE)."""

    # the ceilings are past any real model: 1e12 (a slipped exponent) failed a reference build with a traceback
    vocab_size: int = Field(gt=0, le=10_000_000)
    hidden_size: int = Field(gt=0, le=1_000_000)
    intermediate_size: int = Field(gt=0, le=10_000_000)
    num_hidden_layers: int = Field(gt=0, le=10_000)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    max_position_embeddings: int = Field(default=4096, gt=0)
    rope_theta: float = Field(default=1_000_000.0, gt=0)
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    tie_word_embeddings: bool = False
    num_experts: int | None = Field(default=None, gt=0)
    num_experts_per_tok: int | None = Field(default=None, gt=0)
    moe_intermediate_size: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        return self


class ParamCounts(Strict):
    total: float = Field(gt=0)
    active: float = Field(gt=0)


class ModelSpec(Strict):
    family: Literal["qwen3", "qwen3_moe"]
    config: ModelConfig
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    weights: str
    tokenizer: Literal["words", "bpe"] | None = None  # built with random weights (docs/targets.md)
    params: ParamCounts | None = None

    @field_validator("weights")
    @classmethod
    def _weights_exist(cls, value: str, info: ValidationInfo) -> str:
        if RANDOM_WEIGHTS.match(value):
            return value
        base = (info.context or {}).get("base_dir", Path.cwd())
        path = Path(value).expanduser()
        path = path if path.is_absolute() else Path(base) / path
        if not path.exists():
            raise ValueError(f"weights path does not exist: {path} (use a local model directory or random(SEED))")
        if not path.is_dir():
            raise ValueError(f"weights {path} is a file: give the model's directory (config, safetensors, tokenizer)")
        missing = [what for what, names in MODEL_FILES.items() if not any(next(path.glob(n), None) for n in names)]
        if missing:
            raise ValueError(f"{path} is not a model directory: it has no {', no '.join(missing)}")
        return str(path.resolve())

    @model_validator(mode="after")
    def _config_of_the_directory(self) -> ModelSpec:
        """A model directory's config.json and the spec's ``config`` describe one model: the engines load
        the directory, the simulator and the cost model read the spec."""
        if self.random_seed is not None:
            return self
        path = Path(self.weights) / "config.json"
        try:
            stored = json.loads(path.read_text())
        except OSError as error:
            raise ValueError(f"cannot read {path} ({error.strerror})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{path} is not valid JSON ({error})") from None
        if not isinstance(stored, dict):
            raise ValueError(f"{path} holds a JSON {type(stored).__name__}, not a model config (a JSON object)")
        if stored.get("model_type", self.family) != self.family:
            raise ValueError(f"{path} is a {stored['model_type']!r} model, not family {self.family}")
        rope = stored.get("rope_scaling") or stored.get("rope_parameters") or {}
        rope_type = (rope.get("rope_type") or rope.get("type") or "default") if isinstance(rope, dict) else rope
        if rope_type != "default":  # transformers (the reference) would scale; the stack's model would not
            raise ValueError(
                f"{path}: rope type {rope_type!r} (rope_scaling / rope_parameters): the stack's Qwen3 computes the "
                "default RoPE only; use the model's unscaled config (and a max_sequence within its positions)"
            )
        ids, tensors = _check_weights_and_tokenizer(Path(self.weights))
        ours = self.config.model_dump()
        read = _read_config(path, *_stamp(path))  # as transformers reads it: defaults in, aliases resolved
        differ = [f"{k}: {v!r} there, {ours[k]!r} here" for k, v in read.items() if ours[k] != v]
        if differ:
            raise ValueError(
                f"config differs from the model directory's {path} (as transformers reads it): " + "; ".join(differ)
            )
        if self.family == "qwen3":  # the headers against the config: another model's weights named now
            wanted = dense_tensors(self.config, bool(stored.get("attention_bias", False)))
            said = mismatch(Path(self.weights), wanted, tensors, self.config.tie_word_embeddings)
            if said is not None:
                raise ValueError(said)
        if ids > self.config.vocab_size:
            raise ValueError(
                f"{Path(self.weights) / 'tokenizer.json'} defines {ids} token ids (its added tokens included), more "
                f"than the model's vocab_size {self.config.vocab_size}: its tokens past that have no embedding"
            )
        return self

    @model_validator(mode="after")
    def _family_fields(self) -> ModelSpec:
        moe_fields = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
        have = [f for f in moe_fields if getattr(self.config, f) is not None]
        if self.family == "qwen3_moe" and len(have) != len(moe_fields):
            missing = [f for f in moe_fields if f not in have]
            raise ValueError(f"family qwen3_moe needs config fields {missing}")
        if self.family == "qwen3" and have:
            raise ValueError(f"family qwen3 is dense; remove MoE config fields {have}")
        return self

    @model_validator(mode="after")
    def _tokenizer_with_random_weights(self) -> ModelSpec:
        if self.tokenizer is not None and self.random_seed is None:
            raise ValueError(
                f"tokenizer: {self.tokenizer} is for random weights; the model directory {self.weights} brings its own"
            )
        return self

    @property
    def tokenizer_kind(self) -> str | None:
        """The tokenizer built with random weights (``words`` unless stated); None for a directory's own."""
        return None if self.random_seed is None else self.tokenizer or "words"

    @property
    def random_seed(self) -> int | None:
        match = RANDOM_WEIGHTS.match(self.weights)
        return int(match.group(1)) if match else None

    def param_counts(self) -> ParamCounts:
        """Stated counts, else computed from the config (embeddings included)."""
        if self.params is not None:
            return self.params
        c = self.config
        attn = c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
        attn += 2 * c.head_dim + 2 * c.hidden_size  # q/k norms, two RMSNorms per layer
        embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2) + c.hidden_size
        if self.family == "qwen3_moe":
            expert = 3 * c.hidden_size * c.moe_intermediate_size
            router = c.hidden_size * c.num_experts
            total = embed + c.num_hidden_layers * (attn + router + c.num_experts * expert)
            active = embed + c.num_hidden_layers * (attn + router + c.num_experts_per_tok * expert)
            return ParamCounts(total=total, active=active)
        mlp = 3 * c.hidden_size * c.intermediate_size
        total = embed + c.num_hidden_layers * (attn + mlp)
        return ParamCounts(total=total, active=total)


LFS_POINTER = b"version https://git-lfs"  # what a clone without git-lfs leaves in place of a large file


def _check_weights_and_tokenizer(directory: Path) -> tuple[int, Shapes]:
    """The files a model directory's loaders read are what they say: no git-lfs pointer (a clone made
    without git-lfs), a safetensors header that reads, every shard its index names, weights that are a
    model's and not an adapter's alone, a tokenizer.json that is JSON. Each was a loader's traceback at
    the first run otherwise. Each file is read once per version of it (a spec is parsed in every process of
    a run). Returns how many token ids the tokenizer defines, and each tensor of the weights with its shape."""
    weights, tensors = sorted(directory.glob("*.safetensors")), {}
    index = directory / "model.safetensors.index.json"
    if index.exists():
        shards = _index_shards(index, *_stamp(index))
        missing = [name for name in shards if not (directory / name).is_file()]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ValueError(f"{index} names shards that are not there: {', '.join(missing[:3])}{more}")
    elif weights and all(path.name.startswith("adapter_") for path in weights):
        raise ValueError(
            f"{directory} holds an adapter ({weights[0].name}) and no model weights: give the base model's "
            "directory with the adapter merged into it"
        )
    try:
        for path in weights:
            tensors.update(_check_safetensors(path, *_stamp(path)))
        tokenizer = directory / "tokenizer.json"
        ids = _check_tokenizer(tokenizer, *_stamp(tokenizer))
        for name in ("tokenizer_config.json", "special_tokens_map.json"):  # where the end token is read
            if (directory / name).exists():
                _check_json_object(directory / name, *_stamp(directory / name))
        generation = directory / "generation_config.json"
        if generation.exists():
            _check_end_ids(generation, *_stamp(generation), ids)
        return ids, tensors
    except OSError as error:  # a link to a blob a cache lost, unreadable
        raise ValueError(f"{error.filename}: cannot read it ({error.strerror})") from None


@functools.lru_cache(maxsize=16)
def _check_json_object(path: Path, size: int, mtime_ns: int) -> None:
    try:
        parsed = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{path} holds a JSON {type(parsed).__name__}, not an object")


@functools.lru_cache(maxsize=8)
def _check_end_ids(path: Path, size: int, mtime_ns: int, ids: int) -> None:
    """A generation config's ``eos_token_id`` (every turn stops on it) is a token id, or a list of them,
    that the tokenizer defines (read once per version of the file, as the others)."""
    try:
        stated = json.loads(path.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        raise ValueError(f"{path} is not a generation config (a JSON object)") from None
    listed = [stated] if stated is None or isinstance(stated, int) else stated
    if stated is not None and not (isinstance(listed, list) and all(type(i) is int and 0 <= i < ids for i in listed)):
        raise ValueError(f"{path}: eos_token_id {stated!r} is not a token id the tokenizer defines (0 to {ids - 1})")


@functools.lru_cache(maxsize=8)
def _index_shards(path: Path, size: int, mtime_ns: int) -> list[str]:
    """The shard files a safetensors index's ``weight_map`` names."""
    try:
        weight_map = json.loads(path.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{path} is not a safetensors index (a JSON object whose weight_map names each shard)")
    return sorted(set(weight_map.values()))


@functools.lru_cache(maxsize=32)
def _read_config(path: Path, size: int, mtime_ns: int) -> dict:
    """A model directory's config.json as transformers reads it, for the fields ``ModelConfig`` states: its
    defaults filled in (a tie_word_embeddings it leaves out) and its names resolved (transformers 5's
    ``num_local_experts``, ``rope_parameters``), so the comparison sees the model the engines will load."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path.parent)
    except Exception as error:  # transformers and huggingface_hub raise types of their own (a field
        # of the wrong type is huggingface_hub's StrictDataclassFieldValidationError): each is the file's fault
        raise ValueError(f"{path}: transformers cannot read it ({type(error).__name__}: {error})") from None
    read = {}
    for name in ModelConfig.model_fields:
        value = getattr(config, name, None)
        if name == "rope_theta" and value is None:
            value = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
        if value is not None:
            read[name] = value
    return read


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=256)
def _check_safetensors(path: Path, size: int, mtime_ns: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The file's tensors, each name with its shape, read from its header (which must read)."""
    with path.open("rb") as file:
        start = file.read(8)
        if start.startswith(LFS_POINTER[:8]):
            raise ValueError(f"{path} is a git-lfs pointer, not the weights: fetch them (git lfs pull)")
        length = int.from_bytes(start, "little") if len(start) == 8 else 0
        try:
            header = json.loads(file.read(length)) if 0 < length < min(size, 100_000_000) else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            header = None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file (its header does not read)")
    tensors = {name: info.get("shape") if isinstance(info, dict) else None for name, info in header.items()}
    tensors.pop("__metadata__", None)
    if not all(isinstance(shape, list) and all(type(n) is int for n in shape) for shape in tensors.values()):
        raise ValueError(f"{path} is not a safetensors file (a tensor of its header has no shape)")
    return tuple((name, tuple(shape)) for name, shape in tensors.items())


@functools.lru_cache(maxsize=8)
def _check_tokenizer(path: Path, size: int, mtime_ns: int) -> int:
    """Read once per version of the file (a spec is parsed in every process of a run); how many ids it
    defines (one past the largest, its added tokens included)."""
    text = path.read_bytes()
    if text.startswith(LFS_POINTER):
        raise ValueError(f"{path} is a git-lfs pointer, not the tokenizer: fetch it (git lfs pull)")
    try:
        parsed = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("model"), dict):
        raise ValueError(f"{path} is not a tokenizers file (a JSON object with a model)")
    if not isinstance(parsed.get("added_tokens") or [], list):
        raise ValueError(f"{path}: added_tokens is a {type(parsed['added_tokens']).__name__}, not a list")
    from tokenizers import Tokenizer  # the Rust library alone

    try:
        Tokenizer.from_file(str(path))
    except Exception as error:  # the library raises a plain Exception for a file it cannot read
        raise ValueError(f"{path}: the tokenizers library cannot load it ({error})") from None
    vocab = parsed["model"].get("vocab")
    ids = (
        list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab or ())))
    )  # BPE's map, Unigram's list
    ids += [t.get("id") for t in parsed.get("added_tokens") or () if isinstance(t, dict)]
    return 1 + max((i for i in ids if isinstance(i, int)), default=-1)
