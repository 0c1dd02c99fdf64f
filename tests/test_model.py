"""Model factory: random weights are built offline once per content hash; paths load as given."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

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
    """A directory is the model when it holds one (config, safetensors, tokenizer) and its config is the
    spec's; anything else is named at the spec (it was a FileNotFoundError traceback at the first run)."""
    from targets.spec import SpecError, parse_target

    catalog_yaml["model"]["weights"] = str(model_dir(tiny_spec.model))
    spec = parse_target(catalog_yaml)
    assert model_dir(spec.model) == model_dir(tiny_spec.model)
    (tmp_path / "empty").mkdir()
    catalog_yaml["model"]["weights"] = str(tmp_path / "empty")
    with pytest.raises(SpecError, match="is not a model directory: it has no config.json, no safetensors weights, no"):
        parse_target(catalog_yaml)
    catalog_yaml["model"]["weights"] = str(model_dir(tiny_spec.model) / "config.json")
    with pytest.raises(SpecError, match="config.json is a file: give the model's directory"):
        parse_target(catalog_yaml)
    listed = tmp_path / "listed"  # a config.json that is no JSON object: named, not an AttributeError
    shutil.copytree(model_dir(tiny_spec.model), listed)
    (listed / "config.json").write_text("[]")
    catalog_yaml["model"]["weights"] = str(listed)
    with pytest.raises(SpecError, match="config.json holds a JSON list, not a model config"):
        parse_target(catalog_yaml)
    for broken, said in (  # a clone made without git-lfs, a file cut short, another architecture
        ("model.safetensors", "model.safetensors is a git-lfs pointer, not the weights: fetch them (git lfs pull)"),
        ("tokenizer.json", "tokenizer.json is a git-lfs pointer, not the tokenizer"),
    ):
        shutil.rmtree(listed)
        shutil.copytree(model_dir(tiny_spec.model), listed)
        (listed / broken).write_text("version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 1503\n")
        with pytest.raises(SpecError, match=re.escape(said)):
            parse_target(catalog_yaml)
    (listed / "tokenizer.json").write_text('{"model": {"vocab": ')
    shutil.copy(model_dir(tiny_spec.model) / "model.safetensors", listed / "model.safetensors")
    with pytest.raises(SpecError, match=r"tokenizer.json is not valid JSON \(Expecting value"):
        parse_target(catalog_yaml)
    shutil.copy(model_dir(tiny_spec.model) / "tokenizer.json", listed / "tokenizer.json")
    (listed / "model.safetensors").write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(SpecError, match=r"model.safetensors is not a safetensors file \(its header does not read\)"):
        parse_target(catalog_yaml)
    header = b'{"model.norm.weight": "F32"}'  # a header that reads, whose tensor is no entry (an AttributeError)
    (listed / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(SpecError, match=r"model.safetensors is not a safetensors file \(a tensor of its header has no"):
        parse_target(catalog_yaml)
    (listed / "model.safetensors").unlink()
    (listed / "model.safetensors").symlink_to(tmp_path / "blobs" / "gone")  # a cache that lost its blob
    with pytest.raises(SpecError, match=r"model.safetensors: cannot read it \(No such file or directory\)"):
        parse_target(catalog_yaml)
    (listed / "model.safetensors").unlink()
    shutil.copy(model_dir(tiny_spec.model) / "model.safetensors", listed / "model.safetensors")
    config = json.loads((model_dir(tiny_spec.model) / "config.json").read_text())
    (listed / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(SpecError, match="config.json is a 'llama' model, not family qwen3"):
        parse_target(catalog_yaml)
    catalog_yaml["model"]["weights"] = str(model_dir(tiny_spec.model))
    catalog_yaml["model"]["config"]["hidden_size"] *= 2
    hidden = tiny_spec.model.config.hidden_size
    with pytest.raises(SpecError, match=f"hidden_size: {hidden} there, {2 * hidden} here"):
        parse_target(catalog_yaml)


def test_a_model_directory_is_compared_as_transformers_reads_it(tiny_spec, tmp_path, catalog_yaml):
    """What the raw config.json left out or named otherwise passed: a tie_word_embeddings it omits (transformers'
    default), transformers 5's rope_parameters; a tokenizer with more ids than the embedding has rows, shards an
    index names that are not there, an adapter without its base model. Each was a traceback or a wrong model at
    the first run; each is named at the spec now."""
    from targets.spec import SpecError, parse_target

    mine = tmp_path / "mine"
    shutil.copytree(model_dir(tiny_spec.model), mine)
    catalog_yaml["model"]["weights"] = str(mine)
    config = json.loads((mine / "config.json").read_text())
    assert parse_target(catalog_yaml).model.weights == str(mine)
    assert config["tie_word_embeddings"] and catalog_yaml["model"]["config"]["tie_word_embeddings"]
    (mine / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "tie_word_embeddings"}))
    with pytest.raises(SpecError, match="as transformers reads it.*tie_word_embeddings: False there, True here"):
        parse_target(catalog_yaml)
    rope = {k: v for k, v in config.items() if k != "rope_theta"} | {"rope_parameters": {"rope_theta": 5.0}}
    (mine / "config.json").write_text(json.dumps({**rope, "rope_type": "default"}))
    with pytest.raises(SpecError, match="rope_theta: 5.0 there"):
        parse_target(catalog_yaml)
    (mine / "config.json").write_text(json.dumps(config))
    tokenizer = json.loads((mine / "tokenizer.json").read_text())
    vocab = tiny_spec.model.config.vocab_size
    tokenizer["added_tokens"].append({**tokenizer["added_tokens"][0], "id": vocab + 5, "content": "<extra>"})
    (mine / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(SpecError, match=f"defines {vocab + 6} token ids .* more than the model's vocab_size {vocab}"):
        parse_target(catalog_yaml)
    shutil.copy(model_dir(tiny_spec.model) / "tokenizer.json", mine / "tokenizer.json")
    for stated in ("<|im_end|>", [vocab + 1]):  # a traceback at the first run, or a stop no turn could draw
        (mine / "generation_config.json").write_text(json.dumps({"eos_token_id": stated}))
        with pytest.raises(
            SpecError, match=f"eos_token_id .* is not a token id the tokenizer defines \\(0 to {vocab - 1}"
        ):
            parse_target(catalog_yaml)
    (mine / "generation_config.json").unlink()
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}
    (mine / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SpecError, match="index.json names shards that are not there: model-00001-of-00002"):
        parse_target(catalog_yaml)
    (mine / "model.safetensors.index.json").unlink()
    (mine / "model.safetensors").rename(mine / "adapter_model.safetensors")
    with pytest.raises(SpecError, match="holds an adapter \\(adapter_model.safetensors\\) and no model weights"):
        parse_target(catalog_yaml)


def test_a_scaled_rope_and_sequences_past_the_models_positions_are_refused(tiny_spec, tmp_path, catalog_yaml):
    """A config with YaRN scaling was accepted: transformers (the reference) scaled RoPE and the stack's Qwen3
    did not, so every candidate failed check 1 with a greedy token that blamed the stack (a review of user
    models). Refused at the spec, naming the rope type; so is a max_sequence past the model's positions."""
    from targets.spec import SpecError, parse_target

    mine = tmp_path / "mine"
    shutil.copytree(model_dir(tiny_spec.model), mine)
    catalog_yaml["model"]["weights"] = str(mine)
    config = json.loads((mine / "config.json").read_text())
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    (mine / "config.json").write_text(json.dumps({**config, "rope_scaling": yarn}))
    with pytest.raises(SpecError, match="rope type 'yarn'.*default RoPE only"):
        parse_target(catalog_yaml)
    (mine / "config.json").write_text(json.dumps(config))
    catalog_yaml["workload"]["tokens"]["max_sequence"] = config["max_position_embeddings"] + 1
    with pytest.raises(SpecError, match="max_sequence 513 is past the model's max_position_embeddings 512"):
        parse_target(catalog_yaml)


def test_model_directory_files_that_their_loaders_cannot_read_are_named_at_the_spec(tiny_spec, tmp_path, catalog_yaml):
    """Each passed ``target validate`` or was a bare traceback there (a review of bad input): a tokenizer
    whose added_tokens is not a list (a TypeError), or whose model the tokenizers library cannot load; a
    tokenizer config that is not JSON (the run's first stop-token read); a config field of the wrong type
    (huggingface_hub's own error type). Each is named with its file now."""
    from targets.spec import SpecError, parse_target

    mine = tmp_path / "mine"
    shutil.copytree(model_dir(tiny_spec.model), mine)
    catalog_yaml["model"]["weights"] = str(mine)
    tokenizer = json.loads((mine / "tokenizer.json").read_text())
    for broken, said in (
        ({**tokenizer, "added_tokens": 5}, "added_tokens is a int, not a list"),
        ({**tokenizer, "model": {**tokenizer["model"], "type": "Nonsense"}}, "the tokenizers library cannot load"),
    ):
        (mine / "tokenizer.json").write_text(json.dumps(broken))
        with pytest.raises(SpecError, match=f"tokenizer.json: {said}"):
            parse_target(catalog_yaml)
    (mine / "tokenizer.json").write_text(json.dumps(tokenizer))
    (mine / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(SpecError, match="tokenizer_config.json is not valid JSON"):
        parse_target(catalog_yaml)
    (mine / "tokenizer_config.json").unlink()
    config = json.loads((mine / "config.json").read_text())
    (mine / "config.json").write_text(json.dumps({**config, "num_hidden_layers": "two"}))
    with pytest.raises(SpecError, match="config.json: transformers cannot read it"):
        parse_target(catalog_yaml)


def test_vocabulary_too_small_is_refused():
    with pytest.raises(ValueError, match="vocab_size 10 is smaller than the harness vocabulary"):
        build_tokenizer(10)
    assert len(build_tokenizer(len(NAMED_VOCAB))) == len(NAMED_VOCAB)


def test_a_built_in_environment_needs_the_word_tokenizer_it_writes_in(catalog_yaml, tmp_path):
    """The built-in environments write and read the harness's word ids: a BPE, or a user's model's own
    tokenizer, read their prompts as other text and their rewards meant nothing; such a spec was valid.
    A directory vibetrain built with the word tokenizer still takes them, and a simulated run reads no text."""
    import copy

    from targets.spec import SpecError, parse_target

    words, built_in = model_dir(parse_target(catalog_yaml).model), copy.deepcopy(catalog_yaml["workload"])
    name, vocab = built_in["environment"]["name"], catalog_yaml["model"]["config"]["vocab_size"]
    catalog_yaml["model"].update(tokenizer="bpe")
    catalog_yaml["model"]["config"]["vocab_size"] = 320
    with pytest.raises(SpecError, match=f"environment {name} is a built-in stand-in .* model.tokenizer: bpe tokenizer"):
        parse_target(catalog_yaml)
    assert parse_target({**catalog_yaml, "execution": "simulated"}).model.tokenizer == "bpe"
    _speaking_text(catalog_yaml)
    bpe = tmp_path / "bpe-model"  # a model directory with a tokenizer of its own
    shutil.copytree(model_dir(parse_target(catalog_yaml).model), bpe)
    catalog_yaml["workload"] = built_in
    catalog_yaml["model"].update(weights=str(bpe), tokenizer=None)
    with pytest.raises(SpecError, match=f"{bpe}'s tokenizer would read its token ids as other text"):
        parse_target(catalog_yaml)
    catalog_yaml["model"]["weights"] = str(words)
    catalog_yaml["model"]["config"]["vocab_size"] = vocab
    assert parse_target(catalog_yaml).workload.environment.name == name


TEXT_ENVIRONMENT = {"entry": "reasoning_gym:create_dataset", "adapter": "tasks", "params": {"name": "chain_sum"}}


def _speaking_text(catalog_yaml) -> None:
    """An environment of text (a built-in one speaks the word vocabulary only): reasoning-gym's tasks."""
    catalog_yaml["workload"].update(
        environment=TEXT_ENVIRONMENT,
        turns={"max": 1},
    )


def test_a_bpe_target_gets_a_chat_tokenizer_and_stops_on_its_end_of_turn(catalog_yaml, tmp_path):
    """``tokenizer: bpe``: any text encodes and decodes, the ChatML template renders a turn, and the
    runtime's stop tokens are the tokenizer's own (``<|im_end|>``), not the word-level ``<eos>``."""
    from targets.harness.target import Target
    from targets.harness.tokenizer import IM_END, STOP_TOKEN_IDS, stop_token_ids

    catalog_yaml["model"].update(tokenizer="bpe")
    catalog_yaml["model"]["config"]["vocab_size"] = 320
    _speaking_text(catalog_yaml)
    path = tmp_path / "bpe.yaml"
    path.write_text(__import__("yaml").safe_dump(catalog_yaml))
    target = Target.load(path)
    directory = model_dir(target.spec.model)
    tokenizer = load_tokenizer(directory)
    assert len(tokenizer) == 320 and tokenizer.chat_template
    text = "At turn 2, you guessed 5: the number is higher. \\boxed{7} ünïcode"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert tokenizer.decode(rendered) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    assert stop_token_ids(directory) == (im_end,) == target.runtime().stop_token_ids != STOP_TOKEN_IDS
    assert model_dir(target.spec.model) == directory  # cached: built once
    words = model_dir(target.spec.model.model_copy(update={"tokenizer": None}))
    assert words != directory and stop_token_ids(words) == STOP_TOKEN_IDS


def test_a_base_models_turns_stop_where_its_chat_template_ends_an_assistants_turn(catalog_yaml, tmp_path):
    """A base model (Qwen3-*-Base) names <|endoftext|> its eos and ships a chat template closing turns with
    <|im_end|>: its turns ran on past their end into a user turn the model made up, which the environment
    then read (a review of user models). The template's end of an assistant turn stops a turn too."""
    from targets.harness.tokenizer import END_OF_TEXT, IM_END, stop_token_ids
    from targets.spec import parse_target

    catalog_yaml["model"].update(tokenizer="bpe")
    catalog_yaml["model"]["config"]["vocab_size"] = 320
    _speaking_text(catalog_yaml)
    base = tmp_path / "base-model"
    shutil.copytree(model_dir(parse_target(catalog_yaml).model), base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": END_OF_TEXT}))
    tokenizer = load_tokenizer(base)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in (END_OF_TEXT, IM_END)]
    assert stop_token_ids(base) == tuple(sorted(ids))
    # a template that does not render a conversation is named with its model, not a jinja traceback
    from targets.harness.environments.chat_format import ChatTemplateError

    broken = tmp_path / "broken-template"
    shutil.copytree(base, broken)
    (broken / "chat_template.jinja").write_text("{{ raise_exception('no conversation renders') }}")
    with pytest.raises(ChatTemplateError, match="the chat template does not render a conversation"):
        stop_token_ids(broken)


def test_a_model_directory_brings_its_tokenizer_and_its_generation_configs_end_ids(catalog_yaml, tmp_path):
    import json

    from targets.harness.tokenizer import stop_token_ids
    from targets.spec import SpecError, parse_target

    catalog_yaml["model"].update(tokenizer="bpe")
    catalog_yaml["model"]["config"]["vocab_size"] = 320
    _speaking_text(catalog_yaml)
    mine = tmp_path / "my-model"
    shutil.copytree(model_dir(parse_target(catalog_yaml).model), mine)
    (mine / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    catalog_yaml["model"].update(weights=str(mine), tokenizer=None)
    assert stop_token_ids(model_dir(parse_target(catalog_yaml).model)) == (0, 2)
    catalog_yaml["model"].update(tokenizer="bpe")
    with pytest.raises(SpecError, match="model.*tokenizer: bpe is for random weights"):
        parse_target(catalog_yaml)
    # a checkpoint whose end of turn only its special_tokens_map.json names (transformers reads it there too)
    (mine / "generation_config.json").unlink()
    config = json.loads((mine / "tokenizer_config.json").read_text())
    (mine / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "eos_token"}))
    (mine / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    assert stop_token_ids(mine) == (load_tokenizer(mine).convert_tokens_to_ids("<|im_end|>"),)
    (mine / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nowhere|>"}))
    with pytest.raises(ValueError, match=re.escape("eos_token '<|nowhere|>' is not in the tokenizer's vocabulary")):
        stop_token_ids(mine)


def test_a_vocabulary_too_small_for_a_bpe_is_refused():
    with pytest.raises(ValueError, match="vocab_size 64 is too small for a byte-level BPE"):
        build_tokenizer(64, "bpe")


def test_a_bpe_past_its_corpus_merges_pads_with_fillers_no_environment_reads():
    """Qwen3-0.6B's 151,936 ids from a small corpus: the rest are named fillers, special tokens, so the
    text an environment reads of a random model's answer holds only what it generated as text."""
    tokenizer = build_tokenizer(151_936, "bpe")
    four = tokenizer.convert_tokens_to_ids("4")
    answer = [151_935, 151_000, four]
    assert len(tokenizer) == 151_936 and "<|filler_" in tokenizer.decode(answer)
    assert tokenizer.decode(answer, skip_special_tokens=True) == "4"  # what ChatFormat.text hands over


def test_weights_that_are_not_the_configs_model_are_refused_when_loaded(catalog_yaml, tmp_path):
    """A directory whose safetensors hold another model's tensors (or an adapter alone) passed, and
    transformers ran the missing tensors from random values, said only in a table of its log: `vibetrain
    reference` trained from noise. Loading it now names what is missing; the CLI says it, no traceback."""
    import yaml
    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from orchestrator.cli import app
    from targets.harness.model import WeightsMismatch
    from targets.spec import parse_target

    mine = tmp_path / "my model"
    shutil.copytree(model_dir(parse_target(catalog_yaml).model), mine)
    embedding = load_file(str(mine / "model.safetensors"))["model.embed_tokens.weight"].float()
    assert torch.equal(load_model(mine).get_input_embeddings().weight, embedding)  # the directory as built loads
    (mine / "model.safetensors").unlink()
    save_file({"x": torch.zeros(2)}, str(mine / "model.safetensors"))
    with pytest.raises(WeightsMismatch, match=r"of the model's tensors missing \((lm_head|model\.)"):
        load_model(mine)
    reshaped = tmp_path / "reshaped"  # a tensor at another shape raised transformers' RuntimeError, a traceback
    shutil.copytree(model_dir(parse_target(catalog_yaml).model), reshaped)
    tensors = load_file(str(reshaped / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(16)
    save_file(tensors, str(reshaped / "model.safetensors"))
    with pytest.raises(WeightsMismatch, match=r"model\.norm\.weight at another shape"):
        load_model(reshaped)
    deeper = tmp_path / "deeper"  # a deeper model's layers: transformers dropped them, the stack's loader raised
    shutil.copytree(model_dir(parse_target(catalog_yaml).model), deeper)
    tensors = load_file(str(deeper / "model.safetensors"))
    tensors |= {k.replace("layers.1.", "layers.7."): v.clone() for k, v in tensors.items() if "layers.1." in k}
    save_file(tensors, str(deeper / "model.safetensors"))
    with pytest.raises(WeightsMismatch, match=r"tensors the model has no place for \(model\.layers\.7\."):
        load_model(deeper)
    untied = tmp_path / "untied"  # a config that ties over an lm_head of its own: transformers unties them
    shutil.copytree(model_dir(parse_target(catalog_yaml).model), untied)
    assert json.loads((untied / "config.json").read_text())["tie_word_embeddings"]
    tensors = load_file(str(untied / "model.safetensors"))
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, str(untied / "model.safetensors"))
    with pytest.raises(WeightsMismatch, match="tie_word_embeddings is true, yet its lm_head.weight differs"):
        load_model(untied)
    catalog_yaml["model"].update(weights=str(mine))
    spec = tmp_path / "mine.yaml"
    spec.write_text(yaml.safe_dump(catalog_yaml))
    result = CliRunner().invoke(app, ["reference", str(spec), "--steps", "1"])
    assert result.exit_code == 2 and "its weights are not the model its config.json describes" in result.output


def test_a_directory_of_another_models_weights_is_named_when_the_spec_is_read(catalog_yaml, tmp_path):
    """The weights were checked at their first load only (minutes into a run of a large model): ``target
    validate`` called such a spec valid. Their safetensors headers are now held to the config's tensors
    when the spec is read (names and shapes; nothing loaded), for a dense Qwen3."""
    import yaml
    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from orchestrator.cli import app
    from targets.spec import SpecError, parse_target

    built = model_dir(parse_target(catalog_yaml).model)

    def spec_of(name: str, edit) -> dict:
        folder = tmp_path / name
        shutil.copytree(built, folder)
        tensors = load_file(str(folder / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(folder / "model.safetensors"))
        return {**catalog_yaml, "model": {**catalog_yaml["model"], "weights": str(folder)}}

    assert parse_target(spec_of("as-built", lambda t: None)).model.weights  # the directory as built is its model
    for name, edit, said in (
        ("missing", lambda t: t.pop("model.layers.1.mlp.down_proj.weight"), r"1 of the model's tensors missing"),
        ("reshaped", lambda t: t.update({"model.norm.weight": torch.ones(16)}), r"model\.norm\.weight is \[16\]"),
        (
            "deeper",
            lambda t: t.update(
                {k.replace("layers.1.", "layers.7."): v.clone() for k, v in t.items() if "layers.1." in k}
            ),
            r"tensors the model has no place for \(model\.layers\.7\.",
        ),
    ):
        with pytest.raises(SpecError, match=said):
            parse_target(spec_of(name, edit))
    path = tmp_path / "deeper.yaml"
    path.write_text(
        yaml.safe_dump(spec_of("deeper-cli", lambda t: t.update({"model.layers.9.x.weight": torch.ones(2)})))
    )
    result = CliRunner().invoke(app, ["target", "validate", str(path)])
    assert result.exit_code == 2 and "its weights are not the model its config.json describes" in result.output


def test_a_cache_that_is_no_writable_folder_is_said_and_a_relative_one_made_absolute(tiny_spec, tmp_path, monkeypatch):
    """$VIBETRAIN_CACHE naming a file failed `check` with NotADirectoryError's traceback; a relative one
    (or an empty one, read as the working folder) made a sandboxed candidate, which runs elsewhere, look
    for the model in its own folder, and the starter failed its engine check."""
    from targets.cache import CacheError, cache_home
    from targets.harness.isolation.sandbox import scrubbed_environment

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("VIBETRAIN_CACHE", str(tmp_path / "a-file"))
    with pytest.raises(CacheError, match=r"cannot write the model cache at .*a-file/models .*: Not a directory"):
        model_dir(tiny_spec.model.model_copy(update={"weights": "random(7)"}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VIBETRAIN_CACHE", "relative")
    assert cache_home() == tmp_path / "relative"
    assert scrubbed_environment({"VIBETRAIN_CACHE": "relative"})["VIBETRAIN_CACHE"] == str(tmp_path / "relative")
    monkeypatch.setenv("VIBETRAIN_CACHE", "")
    assert cache_home() == Path.home() / ".cache" / "vibetrain"
    assert scrubbed_environment({"VIBETRAIN_CACHE": ""})["VIBETRAIN_CACHE"] == str(cache_home())
