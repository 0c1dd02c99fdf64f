"""Target specs: the catalog loads, parameter counts are right, and every bad input names its field."""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from orchestrator.cli import app
from targets.spec import SpecError, catalog_ids, load_target, parse_target
from targets.yaml_text import load_yaml

runner = CliRunner()


def _error(data: dict) -> str:
    with pytest.raises(SpecError) as caught:
        parse_target(data, source="planted.yaml")
    return str(caught.value)


def test_catalog_has_the_thirteen_targets():
    assert catalog_ids() == [
        "qwen3-0.6b-h100x1",
        "qwen3-0.6b-h100x1-arithmetic",
        "qwen3-235b-a22b-h800x160",
        "qwen3-30b-a3b-h20x64",
        "qwen3-8b-h100x8",
        "qwen3-8b-h20x8-h800x8",
        "qwen3-8b-h800x16",
        "qwen3-8b-h800x16-judge",
        "qwen3-8b-h800x16-sandbox",
        "qwen3-8b-h800x16-serving",
        "tiny-qwen3-cpu",
        "tiny-qwen3-cpu-arithmetic",
        "tiny-qwen3-cpu-judge",
    ]
    math = load_target("qwen3-30b-a3b-h20x64")  # single-turn long chain-of-thought
    assert math.workload.turns.max == 1 and math.workload.group_size == 16 and math.workload.tokens.response == 16384
    mixed = load_target("qwen3-8b-h20x8-h800x8")  # RollArt-like: H20s beside H800s, 25 GB/s between
    sandbox = load_target("qwen3-8b-h800x16-sandbox")  # Crab-like: crashes lose state; 3 turns in 4 change none
    assert sandbox.workload.env_state.change_rate == 0.25 and sandbox.workload.env_failure_rate == 0.01
    assert mixed.hardware.summary == "8x h20 (h20) + 8x h800 (h800)" and mixed.hardware.link_gbs("h20", "h800") == 25
    tools = load_target("qwen3-8b-h800x16")  # slow, failing tools
    assert tools.workload.env_failure_rate == 0.02 and tools.workload.env_latency_s.median == 10.0
    for real_environment in ("tiny-qwen3-cpu-arithmetic", "qwen3-0.6b-h100x1-arithmetic"):
        spec = load_target(real_environment)  # the entry imports here (the envs extra)
        assert spec.workload.environment.adapter == "tasks" and spec.model.tokenizer_kind == "bpe"
    big = load_target("qwen3-235b-a22b-h800x160")
    assert big.hardware.kind == "h800" and big.hardware.count == 160
    assert big.workload.turns.max == 100 and big.workload.tokens.max_sequence == 65536
    assert big.workload.batch_size == 512 and big.workload.async_ratio == 1
    split = next(b for b in big.baselines if b.name == "static_split")
    assert (split.train_devices, split.rollout_devices) == (128, 32)
    multiplex = next(b for b in big.baselines if b.name == "time_multiplex")
    assert (multiplex.train_devices, multiplex.rollout_devices) == (128, 160)


def test_computed_param_counts_match_the_built_model(tiny_spec, tiny_model):
    assert tiny_spec.model.param_counts().total == sum(p.numel() for p in tiny_model.parameters())


@pytest.mark.parametrize(
    "target, total, active",
    [
        ("qwen3-0.6b-h100x1", 0.596e9, 0.596e9),
        ("qwen3-8b-h100x8", 8.19e9, 8.19e9),
        ("qwen3-235b-a22b-h800x160", 235e9, 22e9),
    ],
)
def test_computed_param_counts_match_published_sizes(target, total, active):
    spec = load_target(target)
    computed = spec.model.model_copy(update={"params": None}).param_counts()
    assert computed.total == pytest.approx(total, rel=0.03)
    assert computed.active == pytest.approx(active, rel=0.05)


@pytest.mark.parametrize("field", ["update_rtol", "selection_task_shortfall", "selection_member_shortfall"])
def test_a_tolerance_that_would_switch_its_check_off_is_refused(catalog_yaml, field):
    # a shortfall (1 - kept / all) never exceeds 1, and an update at relative error 1 is the reference step's
    # direction scaled to nothing: at 1 neither check can reject what it exists to reject
    catalog_yaml["accuracy"] = {**catalog_yaml.get("accuracy", {}), field: 1.0}
    assert f"field `accuracy.{field}`: Input should be less than 1" in _error(catalog_yaml)
    catalog_yaml["accuracy"][field] = 0.5
    assert getattr(parse_target(catalog_yaml).accuracy, field) == 0.5


@pytest.mark.parametrize("field", ["rope_theta", "rms_norm_eps"])
def test_a_model_constant_that_cannot_be_is_named_at_the_spec(catalog_yaml, field):
    """A negative RoPE base or norm epsilon validated and failed in the first forward pass, a NaN far from it."""
    catalog_yaml["model"]["config"][field] = -1.0
    assert f"field `model.config.{field}`: Input should be greater than 0" in _error(catalog_yaml)


def test_hardware_numbers_come_from_the_catalog_and_can_be_overridden(catalog_yaml):
    catalog_yaml["hardware"] = {"kind": "h100", "count": 2, "memory_gb": 94}
    spec = parse_target(catalog_yaml)
    assert spec.hardware.memory_gb == 94 and spec.hardware.hbm_bandwidth_gbs == 3350.0


# What the cards' drivers report as total memory (nvidia-smi, MiB), against which the catalog's
# figures are read: its "80 GB" is 80 GiB, not 80e9 bytes (7% less, and KV room with it).
REPORTED_MIB = {"h100": 81_559, "h800": 81_559, "h20": 97_871, "h200": 143_771}


@pytest.mark.parametrize("kind", sorted(REPORTED_MIB))
def test_catalog_memory_is_what_the_card_reports_and_links_are_one_way(catalog_yaml, kind):
    catalog_yaml["hardware"] = {"kind": kind, "count": 8}
    hardware = parse_target(catalog_yaml).hardware
    assert hardware.memory_bytes == pytest.approx(REPORTED_MIB[kind] * 2**20, rel=0.005)
    # NVLink's datasheet figure counts both directions; a transfer gets one (H800: 400 GB/s both ways)
    both_ways = 400 if kind == "h800" else 900
    assert hardware.intra_node_bandwidth_gbs == both_ways / 2


MIXED = {
    "pools": [
        {"name": "rollout", "kind": "h20", "count": 2},
        {"name": "train", "kind": "h800", "count": 2, "mfu": 0.3},
    ],
    "links": [{"between": ["rollout", "train"], "bandwidth_gbs": 25}],
}


def test_pools_name_their_devices_and_take_their_numbers_from_the_catalog(catalog_yaml):
    catalog_yaml["hardware"] = MIXED
    hardware = parse_target(catalog_yaml).hardware
    assert hardware.device_ids() == ["rollout:0", "rollout:1", "train:0", "train:1"]
    assert hardware.count == 4 and hardware.kind == "mixed" and hardware.summary == "2x h20 (rollout) + 2x h800 (train)"
    assert hardware.pool_of("train:1").bf16_tflops == 989.0 and hardware.pool_of("train:1").mfu == 0.3
    assert hardware.pool_of("rollout:0").hbm_bandwidth_gbs == 4000.0 and hardware.link_gbs("train", "rollout") == 25
    catalog_yaml["hardware"] = {"kind": "cpu", "count": 2}  # one pool: named by its kind, as before
    single = parse_target(catalog_yaml).hardware
    assert single.device_ids() == ["cpu:0", "cpu:1"] and list(single.by_name) == ["cpu"] and single.links == ()


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda h: h["pools"][1].update(count=0), "field `hardware.pools.1.count`: Input should be greater"),
        (
            lambda h: h["pools"][1].update(kind="h900"),
            "field `hardware.pools.1`: unknown hardware kind 'h900'",
        ),
        (
            lambda h: h["pools"][1].update(memroy_gb=1),  # a pool's own fields, through the list and the form
            "field `hardware.pools.1.memroy_gb`: unknown field (did you mean `memory_gb`?)",
        ),
        (lambda h: h["links"][0].update(between=["rollout", "trian"]), "links.0.between names the pool 'trian'"),
        (
            lambda h: h["links"][0].update(between=["train", "train"]),
            "links.0.between joins the pool 'train' to itself",
        ),
        (lambda h: h.update(links=[]), "no link between the pools 'rollout' and 'train'"),
        (lambda h: h["pools"][1].update(name="Train"), "field `hardware.pools.1.name`: String should match pattern"),
        (lambda h: h["pools"][1].update(name="rollout"), "pools: two pools are named 'rollout'"),
        (lambda h: h["links"][0].update(bandwidth_gbs=0), "field `hardware.links.0.bandwidth_gbs`"),
    ],
)
def test_a_bad_pool_or_link_is_named_by_its_path(catalog_yaml, change, named):
    import copy

    hardware = copy.deepcopy(MIXED)
    change(hardware)
    catalog_yaml["hardware"] = hardware
    error = _error(catalog_yaml)
    assert named in error
    # pydantic counts the pools without the one that failed: "at least 2 items ... not 1" for two written
    assert "should have at least 2 items" not in error, error


def test_one_pool_with_a_bad_field_is_also_too_few(catalog_yaml):
    """The too-short error left out for a list that held enough items stays for one that did not."""
    import copy

    hardware = copy.deepcopy(MIXED)
    hardware["pools"] = hardware["pools"][:1]
    hardware["pools"][0]["count"] = 0
    catalog_yaml["hardware"] = hardware
    error = _error(catalog_yaml)
    assert "pools.0.count" in error and "should have at least 2 items" in error, error


def test_a_baseline_on_other_hardware_is_labelled_and_fits_its_own_devices(catalog_yaml):
    """A single-kind cluster of the same cost beside a mixed one: the baseline's devices are counted on
    its own hardware, it needs a label, and the target as it runs it has that hardware alone."""
    catalog_yaml["hardware"] = MIXED
    other = {"name": "static_split", "rollout_devices": 4, "train_devices": 2, "hardware": {"kind": "h800", "count": 6}}
    catalog_yaml["baselines"] = [{"name": "colocate"}, {**other, "label": "h800-only"}]
    spec = parse_target(catalog_yaml)
    variant = spec.on_hardware(spec.baselines[1])
    assert variant.id == f"{spec.id}-h800-only" and variant.hardware.device_ids()[-1] == "h800:5"
    assert [b.name for b in variant.baselines] == ["static_split"] and variant.baselines[0].hardware is None
    catalog_yaml["baselines"] = [other]
    assert "a baseline on other hardware needs a label" in _error(catalog_yaml)
    catalog_yaml["baselines"] = [{**other, "label": "h800-only", "hardware": {"kind": "h800", "count": 5}}]
    assert "static_split uses 6 devices but baselines[0].hardware.count is 5" in _error(catalog_yaml)
    catalog_yaml["baselines"] = [{**other, "label": "colocate"}, {"name": "colocate"}]
    assert "two baselines are named 'colocate'" in _error(catalog_yaml)


def test_a_baseline_with_technique_params_is_labelled_and_its_params_are_the_skills(catalog_yaml):
    """An elastic or tuned baseline (a starter with techniques on, as the papers' baselines run): its
    params need a label, name parameters the skills or recipes know, within range, techniques allowed together."""
    from skills.starter import baseline_params

    tuned = {"name": "time_multiplex", "train_devices": 1, "label": "tm-partial", "params": {"partial_rollout": 1}}
    catalog_yaml["baselines"] = [{"name": "colocate"}, tuned]
    spec = parse_target(catalog_yaml)
    params = baseline_params(spec, spec.baselines[1])
    assert params["controller"] == "time_multiplex" and params["train_devices"] == 1 and params["partial_rollout"] == 1
    split = {"name": "static_split", "rollout_devices": 1, "train_devices": 1}  # its own split, not the plain one's
    labelled = {**split, "rollout_devices": 2, "label": "ss-partial", "params": {"partial_rollout": 1}}
    catalog_yaml["baselines"] = [split, labelled]
    catalog_yaml["hardware"]["count"] = 3
    spec = parse_target(catalog_yaml)
    assert baseline_params(spec, spec.baselines[1])["rollout_devices"] == 2
    catalog_yaml["hardware"]["count"] = 2
    bad = [
        ({"partial_rolout": 1}, "params.partial_rolout is no parameter of the skills library"),
        ({"partial_rollout": 7}, "params.partial_rollout = 7 is outside the range its skill allows"),
        (
            {"shrink_at": 0.5},
            "the params turn the progress_shrink technique on, but it runs under time_multiplex only, not static_split",
        ),
    ]
    for params, message in bad:
        name = "static_split" if "shrink_at" in params else "time_multiplex"
        split = {"rollout_devices": 1, "train_devices": 1} if name == "static_split" else {"train_devices": 1}
        catalog_yaml["baselines"] = [{"name": name, **split, "label": "tuned", "params": params}]
        spec = parse_target(catalog_yaml)
        with pytest.raises(ValueError, match=re.escape(message)):
            baseline_params(spec, spec.baselines[0])
    catalog_yaml["baselines"] = [{**tuned, "label": None}]
    assert "a baseline with technique params needs a label" in _error(catalog_yaml)


def test_a_technique_that_cannot_be_on_says_which_rule_it_breaks(tmp_path):
    """A technique switched on where it cannot be named every rule at once, with Python's lists, empty
    ones too ("needs a controller in [...], the techniques [] and none of []"), and not the controller
    chosen: each rule is said alone now, by what the user set."""
    from skills.library import load_skills, not_applicable

    skills = load_skills()
    tail, stream = skills["tail_batching"], skills["stream_training"]
    assert not_applicable(skills, tail, {"controller": "colocate", "tail_round": 4}) == (
        "it runs under static_split or time_multiplex only, not colocate"
    )
    assert not_applicable(skills, stream, {"controller": "time_multiplex", "stream_train": 1}) == (
        "it needs progress_shrink (shrink_at) on too"
    )
    params = {"controller": "time_multiplex", "stream_train": 1, "shrink_at": 0.8}
    assert not_applicable(skills, stream, params) is None
    skills["partial_rollout"] = skills["partial_rollout"].model_copy(update={"conflicts": ["stream_training"]})
    params["partial_rollout"] = 1  # either side's conflict counts
    assert not_applicable(skills, stream, params) == "it conflicts with partial_rollout (partial_rollout), on too"
    needing = stream.model_copy(update={"requires": ["kv_routing"]})  # named by the param that switches it on,
    assert not_applicable(skills, needing, params) == "it needs kv_routing (kv_routing) on too"  # not its tuning
    argv = ["starter", "tiny-qwen3-cpu", "--out", str(tmp_path / "s"), "--controller", "colocate"]
    result = CliRunner().invoke(app, [*argv, "--param", "tail_round=4"], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and not (tmp_path / "s").exists(), result.output
    said = " ".join(result.output.split())
    assert "the params turn the tail_batching technique on, but it runs under static_split or time_multiplex" in said
    # the controller as a param: the message named --starter, generate's flag, to a user of starter
    result = CliRunner().invoke(app, [*argv, "--param", "controller=static_split"], env={"COLUMNS": "200"})
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "controller is chosen by name (starter --controller, generate --starter" in said


def test_a_headline_metric_no_run_measures_is_named(catalog_yaml):
    from targets.harness.measure.benchmark import SUMMARIZED
    from targets.spec.target import HEADLINE_METRICS

    catalog_yaml["headline_metric"]["name"] = "goodputt"
    message = _error(catalog_yaml)
    assert "headline_metric.name" in message and "unknown metric 'goodputt'" in message, message
    assert set(HEADLINE_METRICS) <= set(SUMMARIZED)  # every one a round's summary keeps


def test_misspelled_field_is_named(catalog_yaml):
    """A misspelt field is named with the one it most likely meant, among those at its place (targets and
    params had a "did you mean", spec fields only "check its spelling"); one like none is not guessed at."""
    catalog_yaml["workload"]["batch_sise"] = catalog_yaml["workload"].pop("batch_size")
    catalog_yaml["workload"]["tokens"]["max_sequense"] = catalog_yaml["workload"]["tokens"].pop("max_sequence")
    catalog_yaml["hardware"]["hbm_bandwith_gbs"] = 1.0
    catalog_yaml["colour"] = "blue"
    catalog_yaml["descriptoin"] = "a field given twice"  # "description" is given: not a guess
    message = _error(catalog_yaml)
    assert "field `descriptoin`: unknown field (check its spelling)" in message
    assert "field `workload.batch_sise`: unknown field (did you mean `batch_size`?)" in message, message
    assert "field `workload.tokens.max_sequense`: unknown field (did you mean `max_sequence`?)" in message
    assert "field `hardware.hbm_bandwith_gbs`: unknown field (did you mean `hbm_bandwidth_gbs`?)" in message
    assert "field `colour`: unknown field (check its spelling)" in message
    assert "workload.batch_size" in message  # and the required one is reported missing
    # a missing field was shown with the type of the mapping around it, as if that were its value
    assert "field `workload.batch_size`: Field required\n" in message + "\n" and "(got dict)" not in message


def test_wrong_type_names_field_and_value(catalog_yaml):
    catalog_yaml["workload"]["group_size"] = "four"
    message = _error(catalog_yaml)
    assert "workload.group_size" in message and "'four'" in message


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("trajectory_timeout_s", float("inf"), "workload.trajectory_timeout_s`: Input should be a finite number"),
        ("env_latency_max_s", float("nan"), "workload.env_latency_max_s`: Input should be a finite number"),
        ("env_latency_s", {"kind": "geometric", "mean": 1e17}, "env_latency_s.geometric.mean`: Input should be less"),
        ("env_latency_s", {"kind": "lognormal", "median": 1, "sigma": 1000}, "lognormal.sigma`: Input should be less"),
    ],
    ids=["inf", "nan", "geometric past its precision", "lognormal past any tail"],
)
def test_a_number_no_draw_can_use_is_named_by_its_field(catalog_yaml, field, value, named):
    """An infinite timeout or latency was accepted and surfaced as a NaN, or as a ZeroDivisionError in a
    geometric draw (1 - 1/1e17 rounds to 1), deep in a run."""
    catalog_yaml["workload"][field] = value
    with pytest.raises(SpecError) as caught:
        parse_target(catalog_yaml)
    assert named in str(caught.value)


def test_a_staleness_maximum_below_the_targets_own_bound_is_named(catalog_yaml):
    assert parse_target(catalog_yaml).workload.staleness_limit == catalog_yaml["workload"]["async_ratio"]
    catalog_yaml["workload"].update(async_ratio=2, max_async_ratio=1)
    assert "max_async_ratio (1) must be at least async_ratio (2)" in _error(catalog_yaml)
    catalog_yaml["workload"]["max_async_ratio"] = 3
    assert parse_target(catalog_yaml).workload.staleness_limit == 3


def test_missing_weights_path_is_named(catalog_yaml, tmp_path):
    catalog_yaml["model"]["weights"] = "no/such/model"
    with pytest.raises(SpecError) as caught:
        parse_target(catalog_yaml, source="t.yaml", base_dir=tmp_path)
    assert "model.weights" in str(caught.value) and str(tmp_path / "no/such/model") in str(caught.value)


def test_unknown_hardware_kind_is_named(catalog_yaml):
    catalog_yaml["hardware"]["kind"] = "h900"
    message = _error(catalog_yaml)
    assert "hardware" in message and "'h900'" in message and "h100" in message


def test_unknown_environment_is_named(catalog_yaml):
    catalog_yaml["workload"]["environment"] = {"name": "chess"}
    message = _error(catalog_yaml)
    assert "workload.environment" in message and "'chess'" in message and "guess_number" in message


def test_unknown_environment_param_is_named(catalog_yaml):
    catalog_yaml["workload"]["environment"]["params"]["alphabett"] = 3
    assert "alphabett" in _error(catalog_yaml)


def test_turn_distribution_must_match_the_environment(catalog_yaml):
    drawn = copy.deepcopy(catalog_yaml)
    del drawn["workload"]["turns"]["dist"]
    assert "set turns.dist" in _error(drawn)
    played = copy.deepcopy(catalog_yaml)
    played["workload"]["environment"] = {"name": "guess_number"}
    assert "remove turns.dist" in _error(played)


def test_batch_must_be_whole_groups(catalog_yaml):
    catalog_yaml["workload"]["batch_size"] = 30
    assert "multiple of group_size" in _error(catalog_yaml)


def test_static_split_cannot_use_more_devices_than_exist(catalog_yaml):
    catalog_yaml["baselines"] = [{"name": "static_split", "rollout_devices": 2, "train_devices": 1}]
    assert "uses 3 devices but hardware.count is 2" in _error(catalog_yaml)


def test_not_a_mapping_and_not_yaml(tmp_path):
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    with pytest.raises(SpecError, match="top level must be a mapping"):
        load_target(listed)
    broken = tmp_path / "broken.yaml"
    broken.write_text("id: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_target(broken)


def test_unknown_catalog_id():
    with pytest.raises(SpecError, match="unknown target 'nope'.*tiny-qwen3-cpu"):
        load_target("nope")
    with pytest.raises(SpecError, match="unknown target 'tiny-qwen3-gpu' \\(did you mean 'tiny-qwen3-cpu'\\?\\)"):
        load_target("tiny-qwen3-gpu")


def test_a_folder_named_like_a_catalog_target_never_hides_it(tmp_path, monkeypatch):
    """Inside generated/ (a run named tiny-qwen3-cpu) every command read the folder as the spec: 'cannot
    read target spec tiny-qwen3-cpu: Is a directory', with no way to name the catalog's."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-qwen3-cpu").mkdir()
    (tmp_path / "my-run").mkdir()
    assert load_target("tiny-qwen3-cpu").id == "tiny-qwen3-cpu"
    with pytest.raises(SpecError, match="unknown target 'my-run': .* and a directory, not a spec's YAML file"):
        load_target("my-run")


# --- CLI ----------------------------------------------------------------------------------


def test_cli_targets_lists_the_catalog():
    result = runner.invoke(app, ["targets"])
    assert result.exit_code == 0
    for target in catalog_ids():
        assert target in result.output
    assert "unavailable" not in result.output


def test_a_catalog_target_whose_environment_is_not_installed_is_listed_as_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if the envs extra were not installed
    result = runner.invoke(app, ["targets"])
    assert result.exit_code == 0 and "tiny-qwen3-cpu\t" in result.output
    assert (
        "unavailable: field `workload.environment`: environment entry 'reasoning_gym:create_dataset': "
        "reasoning_gym is not installed here; the envs extra installs it: pip install -e '.[envs]'"
    ) in result.output
    result = runner.invoke(app, ["check", "tiny-qwen3-cpu-arithmetic"])
    assert result.exit_code == 2 and "reasoning_gym is not installed here" in result.output
    assert "Traceback" not in result.output


def test_cli_validate_accepts_a_good_spec_and_names_a_misspelled_field(catalog_yaml, tmp_path: Path):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(catalog_yaml))
    assert runner.invoke(app, ["target", "validate", str(good)]).exit_code == 0
    catalog_yaml["modle"] = catalog_yaml.pop("model")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(catalog_yaml))
    result = runner.invoke(app, ["target", "validate", str(bad)])
    assert result.exit_code == 2
    assert "field `modle`: unknown field (did you mean `model`?)" in result.output, result.output
    # validate takes a file: a catalog id named where it belongs, a folder said as one (not "not found")
    for given, said in [
        ("tiny-qwen3-cpu", "tiny-qwen3-cpu is a catalog id: vibetrain target show tiny-qwen3-cpu > FILE"),
        (str(tmp_path), "a directory, not a spec's YAML file"),
        (str(tmp_path / "nope.yaml"), "nope.yaml: no such file"),
        ("tiny-qwen3-cp", "no such file (the catalog's 'tiny-qwen3-cpu'? vibetrain target show tiny-qwen3-cpu"),
    ]:
        result = runner.invoke(app, ["target", "validate", given], env={"COLUMNS": "200"})
        assert result.exit_code == 2 and said in result.output, result.output


def test_cli_validate_names_a_baselines_misspelled_param_as_bench_would(catalog_yaml, tmp_path: Path):
    """validate passed a labelled baseline whose params named no parameter; bench refused it later."""
    catalog_yaml["baselines"].append({"name": "time_multiplex", "label": "tuned", "params": {"partial_rolout": 1}})
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(catalog_yaml))
    result = runner.invoke(app, ["target", "validate", str(spec)], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    said = "baseline 'tuned': params.partial_rolout is no parameter of the skills library (did you mean"
    assert said in result.output


def test_cli_names_a_spec_that_is_not_text(tmp_path: Path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00bad")
    result = runner.invoke(app, ["target", "validate", str(binary)])
    assert result.exit_code == 2 and "is not UTF-8 text" in result.output, result.output


def test_cli_show_prints_resolved_hardware():
    result = runner.invoke(app, ["target", "show", "qwen3-8b-h100x8"])
    assert result.exit_code == 0 and "hbm_bandwidth_gbs: 3350.0" in result.output


def test_cli_reference_refuses_a_simulated_target():
    result = runner.invoke(app, ["reference", "qwen3-235b-a22b-h800x160", "--steps", "1"])
    assert result.exit_code == 2 and "simulated-only" in result.output


def test_cli_starter_writes_a_candidate_and_refuses_bad_input(tmp_path):
    result = runner.invoke(
        app, ["starter", "tiny-qwen3-cpu", "--out", str(tmp_path / "c"), "--controller", "static_split"]
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "c" / "stack" / "params.json").exists() and (tmp_path / "c" / "DESIGN.md").exists()
    again = runner.invoke(app, ["starter", "tiny-qwen3-cpu", "--out", str(tmp_path / "c")])
    assert again.exit_code == 2 and "already exist" in again.output
    own = tmp_path / "own"  # a folder of the user's: its notes are never written over
    own.mkdir()
    (own / "DESIGN.md").write_text("my notes\n")
    refused = runner.invoke(app, ["starter", "tiny-qwen3-cpu", "--out", str(own)])
    assert refused.exit_code == 2 and "DESIGN.md already exist" in refused.output, refused.output
    assert (own / "DESIGN.md").read_text() == "my notes\n" and not (own / "stack").exists()
    unknown = runner.invoke(
        app, ["starter", "tiny-qwen3-cpu", "--out", str(tmp_path / "d"), "--controller", "round_robin"]
    )
    assert unknown.exit_code == 2 and "unknown controller 'round_robin'" in unknown.output


def test_cli_starter_by_default_writes_what_every_target_runs(tmp_path):
    """The default controller is generate's round 0 (colocate), which a one-device target can run: it was
    time_multiplex, refused there ("the target has one device") with no controller named."""
    result = runner.invoke(app, ["starter", "qwen3-0.6b-h100x1", "--out", str(tmp_path / "s")])
    assert result.exit_code == 0 and "wrote colocate starter" in result.output, result.output


def test_a_users_path_or_value_is_printed_as_it_is_never_as_markup(tmp_path):
    """A folder named st[/i] raised Rich's MarkupError after the starter was written (a traceback for a
    path); run:fire: printed as an emoji, cli:gemini as a zodiac sign; a path with a space broke the
    command the user is told to copy."""
    odd = tmp_path / "my st[/i] run:fire:"
    result = runner.invoke(app, ["starter", "tiny-qwen3-cpu", "--out", str(odd)])
    assert result.exit_code == 0 and result.exception is None, result.output
    said = " ".join(result.output.split())
    assert f"--stack '{odd}'" in said, said  # quoted for the shell, printed as it is
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--agents", "cli:gemini", "--out", str(tmp_path / "g")])
    assert result.exit_code == 2 and "cli:gemini" in result.output, result.output


def test_a_gpu_target_forced_real_without_a_gpu_fails_with_one_clear_message(tmp_path):
    data = yaml.safe_load((Path(__file__).parents[1] / "targets" / "catalog" / "qwen3-0.6b-h100x1.yaml").read_text())
    data["execution"] = "real"
    path = tmp_path / "forced.yaml"
    path.write_text(yaml.safe_dump(data))
    result = runner.invoke(app, ["check", str(path)])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "executes for real on 1x h100 GPU(s), and this machine has 0" in said and "Traceback" not in said


def test_pools_of_several_gpu_kinds_never_run_for_real_on_one_machines_cards(monkeypatch):
    """RollArt-like pools (H20s beside H800s) resolved to real on any machine with 16 GPUs of any kind: the
    run would have stood one card for both. ``auto`` simulates them; ``real`` is refused by name."""
    from targets.harness import target
    from targets.harness.target import TargetUnavailable, resolve_execution

    monkeypatch.setattr(target, "gpus_here", lambda: 64)
    mixed = load_target("qwen3-8b-h20x8-h800x8")
    assert resolve_execution(mixed.model_copy(update={"execution": "auto"})) == "simulated"
    with pytest.raises(TargetUnavailable, match="pools of several kinds of GPU .* cannot run for real"):
        resolve_execution(mixed.model_copy(update={"execution": "real"}))
    assert resolve_execution(load_target("qwen3-8b-h100x8").model_copy(update={"execution": "auto"})) == "real"


def test_limits_follow_the_model_size_unless_stated(catalog_yaml):
    from targets.harness.isolation.launch import Limits
    from targets.harness.target import Target

    assert load_target("qwen3-0.6b-h100x1").limits.resolved(596_049_920) == (64_000, 900)  # stated
    assert parse_target(catalog_yaml).limits.resolved(8_190_000_000) == (
        16_000 + 48 * 8190,
        600 * 8.19,
    )  # sized by the model
    tiny = Limits.of(Target.load("tiny-qwen3-cpu"))
    assert tiny.memory_mb == pytest.approx(16_000 + 48 * 0.402304) and tiny.time_s == 600
    assert Limits.of(Target.load("qwen3-8b-h100x8", simulate=True)).time_s == 600  # simulated: a tiny proxy runs here
    assert Limits.of(Target.load("tiny-qwen3-cpu"), time_s=30).time_s == 30


def test_target_show_piped_is_a_spec_that_validates(tmp_path):
    """Piped (not a terminal) the spec was wrapped at 80 columns mid-string and no longer parsed."""
    shown = runner.invoke(app, ["target", "show", "tiny-qwen3-cpu"])
    assert shown.exit_code == 0, shown.output
    path = tmp_path / "t.yaml"
    path.write_text(shown.output)
    result = runner.invoke(app, ["target", "validate", str(path)])
    assert result.exit_code == 0, result.output


def test_a_file_in_the_way_of_an_output_files_folder_is_named(tmp_path):
    """--json afile/x.json said "cannot create its folder (File exists)", of a folder that is no folder."""
    (tmp_path / "afile").write_text("mine\n")
    result = runner.invoke(app, ["bench", "tiny-qwen3-cpu", "--json", str(tmp_path / "afile" / "x.json")])
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and f"{tmp_path / 'afile'} is a file, not a folder" in said, said
    assert (tmp_path / "afile").read_text() == "mine\n"


def test_a_failed_command_leaves_no_folder_it_made_for_its_outputs(tmp_path):
    """``check typo --json new/v.json`` made ``new/`` before the target was looked at, and left it; a
    folder that was there already, and one something else wrote into meanwhile, stay."""
    (tmp_path / "there").mkdir()
    outputs = ["--json", str(tmp_path / "a" / "b" / "v.json"), "--timeline", str(tmp_path / "a" / "c" / "t.png")]
    result = runner.invoke(app, ["bench", "tiny-qwen3-cpux", *outputs, "--phases", str(tmp_path / "there" / "p.png")])
    assert result.exit_code == 2 and "did you mean" in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there"] and not any((tmp_path / "there").iterdir())


def test_an_output_whose_new_folder_a_failed_command_beside_it_removed_is_still_written(tmp_path, monkeypatch):
    """Two commands writing into one new folder: the one that failed removed it as its own (empty), and
    the other's write at its end raised FileNotFoundError after all its work. Every writer makes the
    folder again. Here a check the integrity scan fails (quick) loses its folder once its session starts."""
    from orchestrator.cli import harness_commands
    from skills.starter import write_starter
    from targets.spec import load_target

    stack = write_starter(tmp_path / "cheat", load_target("tiny-qwen3-cpu"), "colocate")
    (stack / "stack" / "notes.py").write_text("from targets.harness.trace import Trace  # noqa\n")
    verdict = tmp_path / "new" / "v.json"
    session = harness_commands.session

    def neighbour_removed_it(*args, **kwargs):
        opened = session(*args, **kwargs)
        verdict.parent.rmdir()  # what a failed command beside this one does to the empty folder it made
        return opened

    monkeypatch.setattr(harness_commands, "session", neighbour_removed_it)
    result = runner.invoke(app, ["check", "tiny-qwen3-cpu", "--stack", str(stack), "--json", str(verdict)])
    assert result.exit_code == 1 and "imports harness internals" in result.output, result.output
    assert json.loads(verdict.read_text())[0]["name"] == "integrity"


def test_an_out_path_that_is_a_file_is_refused_by_name(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n")
    for command in (["starter", "tiny-qwen3-cpu"], ["generate", "tiny-qwen3-cpu"]):
        result = runner.invoke(app, [*command, "--out", str(a_file)])
        assert result.exit_code == 2, (command, result.output)
        assert "a file is there" in result.output and isinstance(result.exception, SystemExit)
    assert a_file.read_text() == "mine\n"


def test_a_mistyped_candidate_or_starter_is_refused_before_any_work(tmp_path):
    """``bench --stack typo`` ran every baseline first; ``check --stack emptydir`` passed integrity and
    then failed in accuracy; ``generate --starter colocat`` left a run directory nothing could use."""
    bench = runner.invoke(app, ["bench", "qwen3-8b-h800x16", "--stack", str(tmp_path / "typo")])
    assert bench.exit_code == 2 and f"--stack {tmp_path / 'typo'} does not exist" in bench.output, bench.output
    (tmp_path / "empty").mkdir()
    check = runner.invoke(app, ["check", "tiny-qwen3-cpu", "--stack", str(tmp_path / "empty")])
    assert check.exit_code == 2 and "not a candidate directory" in check.output, check.output
    run = tmp_path / "run"
    generate = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--starter", "colocat", "--out", str(run)])
    assert generate.exit_code == 2 and "did you mean 'colocate'?" in generate.output, generate.output
    assert not run.exists()
    for param, said in (
        ("fused_kernel=false", "--starter-param: fused_kernel is no parameter of the skills library (did you mean"),
        (
            "partial_rollout=9",
            "--starter-param: partial_rollout = 9 is outside the range its skill allows on this target ([0, 1])",
        ),
        ("train_devices=1", "--starter-param: train_devices is the device split, the target's"),
        ("fused_kernels", "--starter-param 'fused_kernels': expected KEY=VALUE"),
        ("fused_kernels=False", 'fused_kernels must be one of null, true, false, not "False"'),  # truthy text
        ("block_size=abc", 'block_size must be a whole number, not "abc"'),  # a TypeError traceback before
        ("block_size=[1]", "--starter-param 'block_size=[1]': a value is a number, true, false, null or text"),
    ):
        generate = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--starter-param", param, "--out", str(run)])
        assert generate.exit_code == 2 and said in generate.output, generate.output
        assert not run.exists()


def test_a_key_given_twice_and_a_yes_no_for_a_number_are_named(tmp_path, catalog_yaml):
    """PyYAML keeps a key's last value silently (a batch_size set twice ran with the second), and pydantic read
    ``train_steps: true`` as 1; a broken file was cited as ``<unicode string>``."""
    text = yaml.safe_dump(catalog_yaml, sort_keys=False)
    spec = tmp_path / "spec.yaml"
    spec.write_text(text.replace("  batch_size:", "  batch_size: 4\n  batch_size:", 1))
    result = runner.invoke(app, ["target", "validate", str(spec)])
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "found the key 'batch_size' twice (first on line" in said, result.output
    assert f'in "{spec}", line' in said and "<unicode string>" not in said
    catalog_yaml["workload"]["train_steps"] = True
    assert "field `workload`: train_steps: True is a yes/no, not a number" in _error(catalog_yaml)
    merged = "base: &b {x: 1}\nm:\n  <<: *b\n  x: 2\n"  # a merge's keys are overridden by design
    assert load_yaml(merged, "m.yaml") == {"base": {"x": 1}, "m": {"x": 2}}
    # read as written, before merges rewrite a mapping: a merged source nested deeper is no duplicate, and a
    # mapping used only as a merge source is read too (a review's, session CD)
    nested = "a: {b: &s {<<: {x: 1}, x: 2}}\nc: {<<: *s}\n"
    assert load_yaml(nested, "n.yaml") == yaml.safe_load(nested)
    with pytest.raises(yaml.YAMLError, match="found the key 'a' twice"):
        load_yaml("top: {<<: &m {a: 2, a: 3}}\n", "s.yaml")
    with pytest.raises(yaml.YAMLError, match="found the key 1 twice"):  # the same value, written otherwise
        load_yaml("{1: a, 01: b}\n", "s.yaml")


def test_a_parameter_given_twice_is_refused(tmp_path):
    run = tmp_path / "run"
    params = ["--starter-param", "fused_kernels=true", "--starter-param", "fused_kernels=false"]
    generate = runner.invoke(app, ["generate", "tiny-qwen3-cpu", *params, "--out", str(run)])
    said = "--starter-param fused_kernels given twice (fused_kernels=true, fused_kernels=false)"
    assert generate.exit_code == 2 and said in generate.output, generate.output
    assert not run.exists()


def test_a_broken_catalog_entry_is_an_error_not_an_unavailable_row(monkeypatch, tmp_path, catalog_yaml):
    import targets.spec.loading

    catalog_yaml["workload"]["bacth_size"] = catalog_yaml["workload"].pop("batch_size")
    (tmp_path / "tiny-qwen3-cpu.yaml").write_text(yaml.safe_dump(catalog_yaml))
    monkeypatch.setattr(targets.spec.loading, "CATALOG_DIR", tmp_path)
    result = runner.invoke(app, ["targets"])
    assert result.exit_code == 2 and "bacth_size" in result.output and "unavailable" not in result.output


def test_env_state_errors_name_their_field(catalog_yaml):
    catalog_yaml["workload"]["env_state"] = {"change_rate": 1.5, "checkpoint_s": 1, "restore_s": 2}
    assert "workload.env_state.change_rate" in _error(catalog_yaml)
    catalog_yaml["workload"]["env_state"] = {"change_rate": 0.2, "checkpoint_s": 1}
    assert "workload.env_state.restore_s" in _error(catalog_yaml)


def test_the_component_benchmark_measures_a_card_against_its_own_figures_and_says_whose(monkeypatch):
    """An H200 lent for the H100 target gets the H200's 4.8 TB/s; an H100 PCIe (2.0 TB/s) is not in the
    card table, so its fractions are of the target's figures and the line says so (before, it got the
    SXM's figures by a word of its name, and an unknown card kept the target's without a word)."""
    import importlib

    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
    card = importlib.import_module("gpu_components")._card
    h100 = load_target("qwen3-0.6b-h100x1").hardware
    hardware, line = card(h100, "NVIDIA H200")
    assert (hardware.kind, hardware.hbm_bandwidth_gbs) == ("h200", 4800) and "catalog's h200 (4800 GB/s" in line
    for name in ("NVIDIA  H100 80GB HBM3", "cpu"):  # the target's kind, and a CPU run: the target's own figures
        hardware, line = card(h100, name)
        assert hardware == h100 and "target's h100 (3350 GB/s" in line and "not this card's" not in line
    for name in ("NVIDIA H100 PCIe", "NVIDIA H200 NVL", "NVIDIA B200"):
        hardware, line = card(h100, name)
        assert hardware == h100 and repr(name) in line and "not this card's" in line and "3350 GB/s" in line


def test_a_stack_written_before_the_temperature_moved_still_reads_it_from_its_workload(catalog_yaml):
    """The temperature moved to ``TrainingConfig`` (the policy the step trains); every stack written before
    reads ``Workload.temperature`` in its copy of the controller recipe, and would raise at start-up without it."""
    from targets.harness.target import workload_view

    catalog_yaml["workload"]["training"] = {**catalog_yaml["workload"].get("training", {}), "temperature": 0.7}
    workload = workload_view(parse_target(catalog_yaml))
    assert workload.temperature == workload.training.temperature == 0.7


def test_sizes_past_any_real_job_are_named_before_anything_runs(catalog_yaml):
    """A slipped exponent passed validation: hardware.count 1e30 ran a bench silently for minutes, vocab_size
    1e12 failed a reference build with an allocation traceback, num_hidden_layers 1e9 hung it."""
    catalog_yaml["hardware"]["count"] = 10**30
    catalog_yaml["model"]["config"]["vocab_size"] = 10**12
    catalog_yaml["model"]["config"]["num_hidden_layers"] = 10**9
    catalog_yaml["workload"]["batch_size"] = 4 * 10**12
    message = _error(catalog_yaml)
    for field in ("hardware.count", "model.config.vocab_size", "model.config.num_hidden_layers", "workload.batch_size"):
        assert f"field `{field}`: Input should be less than or equal to" in message, message
