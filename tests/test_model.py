"""Model factory: random weights are built offline once per content hash; paths load as given."""

from __future__ import annotations

import pytest
import torch

from targets.harness.model import load_model, load_tokenizer, model_dir
from targets.harness.tokenizer import NAMED_VOCAB, build_tokenizer


def test_random_weights_are_cached_by_content(tiny_spec):
    first = model_dir(tiny_spec.model)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert model_dir(tiny_spec.model) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    other = model_dir(tiny_spec.model.model_copy(update={"weights": "random(1)"}))
    assert other != first
    a, b = load_model(first), load_model(other)
    assert not torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)


def test_built_model_has_the_spec_shape_and_a_matching_tokenizer(tiny_spec):
    path = model_dir(tiny_spec.model)
    model = load_model(path)
    config = tiny_spec.model.config
    assert model.config.head_dim == config.head_dim >= 64  # vLLM's CPU build needs head_dim >= 64
    assert model.config.num_hidden_layers == config.num_hidden_layers
    tokenizer = load_tokenizer(path)
    assert len(tokenizer) == config.vocab_size
    ids = tokenizer.encode("guess number between 3 and 5 <act>")
    assert tokenizer.decode(ids) == "guess number between 3 and 5 <act>"
    assert tokenizer.convert_ids_to_tokens(config.vocab_size - 1).startswith("<u")


def test_a_local_path_loads_as_given(tiny_spec, tmp_path, catalog_yaml):
    from targets.spec import parse_target

    catalog_yaml["model"]["weights"] = str(model_dir(tiny_spec.model))
    spec = parse_target(catalog_yaml)
    assert model_dir(spec.model) == model_dir(tiny_spec.model)
    (tmp_path / "empty").mkdir()
    catalog_yaml["model"]["weights"] = str(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        model_dir(parse_target(catalog_yaml).model)


def test_vocabulary_too_small_is_refused():
    with pytest.raises(ValueError, match="vocab_size 10 is smaller than the harness vocabulary"):
        build_tokenizer(10)
    assert len(build_tokenizer(len(NAMED_VOCAB))) == len(NAMED_VOCAB)
