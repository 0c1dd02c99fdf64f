"""What generate measures its best on after the last round, where the search never looked: seeds
no round drew, and a perturbed workload (``orchestrator/generalization.py``). The run itself:
``tests/test_generate.py``'s production-scale target."""

from __future__ import annotations

import pytest

from orchestrator.generalization import PERTURBATION, held_out_seeds, perturbed_workload
from targets.spec import catalog_ids, load_target, parse_target


def test_held_out_seeds_are_none_a_round_drew_and_the_same_each_time():
    used = held_out_seeds(7, [], 5)[:2]  # a run whose rounds happened to draw the first two
    seeds = held_out_seeds(7, used, 3)
    assert len(set(seeds)) == 3 and not set(seeds) & set(used)
    assert seeds == held_out_seeds(7, used, 3) and seeds != held_out_seeds(8, used, 3)


@pytest.mark.parametrize("target", [t for t in catalog_ids() if load_target(t).workload.environment.entry is None])
def test_a_perturbed_workload_is_every_length_and_latency_scaled_and_still_a_valid_spec(target):
    spec = load_target(target)
    workload, what = perturbed_workload(spec)
    assert workload is not None and f"x{PERTURBATION:g}" in what
    raw = spec.model_dump(mode="json", exclude_none=True) | {"workload": workload}
    perturbed = parse_target(raw).workload  # what a perturbed session loads
    before = spec.workload
    assert perturbed.turns.max >= before.turns.max * PERTURBATION
    assert perturbed.tokens.observation == round(before.tokens.observation * PERTURBATION)
    assert perturbed.env_latency_s.mean_value() == pytest.approx(before.env_latency_s.mean_value() * PERTURBATION)
    if before.turns.dist is not None:
        assert perturbed.turns.dist.mean_value() == pytest.approx(before.turns.dist.mean_value() * PERTURBATION)
    if before.tokens.response_length is not None:
        assert perturbed.tokens.response_length.mean > before.tokens.response_length.mean
    assert perturbed.tokens.max_sequence == before.tokens.max_sequence  # the model's, not the workload's
    assert (perturbed.batch_size, perturbed.trajectory_timeout_s) == (before.batch_size, before.trajectory_timeout_s)


def test_a_user_environment_is_never_perturbed_and_says_why(catalog_yaml):
    catalog_yaml["model"]["tokenizer"] = "bpe"
    catalog_yaml["model"]["config"]["vocab_size"] = 320
    catalog_yaml["workload"].update(
        environment={"entry": "reasoning_gym:create_dataset", "adapter": "tasks"}, turns={"max": 1}
    )
    workload, why = perturbed_workload(parse_target(catalog_yaml))
    assert workload is None and "reasoning_gym:create_dataset is the user's environment" in why


def test_a_best_that_fails_the_judge_where_the_search_never_looked_is_told_with_its_run_and_seed(tmp_path):
    """A run of the measurement that fails its checks leaves no figure that can count: what comes back
    names the run (the best or the starter), the figure, the seed and the judge's reasons, and the run's
    summary line says it beside the best's ratio."""
    from orchestrator.generalization import measure_generalization
    from orchestrator.state import GeneralizationRejected
    from skills.starter import starter_params, write_starter
    from targets.harness.isolation.launch import Limits
    from targets.harness.isolation.sandbox import Sandbox
    from targets.harness.measure.session import Session
    from targets.harness.target import Target

    target = Target.load("tiny-qwen3-cpu", simulate=True)
    session = Session(target, Sandbox("subprocess"), Limits(time_s=120))
    write_starter(tmp_path / "starter", target.spec, "time_multiplex")
    # stream training without a shrink to start it: the stack refuses to run
    params = {**starter_params(target.spec, "time_multiplex"), "stream_train": 1}
    best = write_starter(tmp_path / "best", target.spec, "time_multiplex", params)
    result = measure_generalization(session, (3, "c0ffee", best), tmp_path / "starter", [11], [21, 22], tmp_path / "o")
    assert isinstance(result, GeneralizationRejected), result
    assert (result.best_round, result.figure, result.run, result.seed) == (3, "in-search", "the best", 11)
    assert result.held_out_seeds == [21, 22]
    assert any("stream_train needs shrink_at" in reason for reason in result.reasons), result.reasons
    assert result.said().startswith("the best failed its checks on its round's seed 11: ")


def test_a_starter_that_trained_nothing_gives_no_token_ratio_rather_than_zero():
    """The median ratio of trained tokens was 0.0 where the starter's median was 0, and the tables read
    '0.00x in trained tokens', as if the best had trained nothing; it is no ratio now ('-'). And it is the
    paired ratio, the headline's estimator on the same seeds (a ratio of medians beside a paired geometric
    mean read their difference as one of trajectories: 27% of the time 2% below it, lengths alike)."""
    from targets.harness.measure.session import Paired

    assert Paired.ratio_of([5.0], [0.0]) is None and Paired.ratio_of([0.0], [5.0]) is None
    assert Paired.ratio_of([5.0], [5.0]) == 1.0
    assert Paired.ratio_of([15.0, 50.0, 45.0], [10.0, 20.0, 30.0]) == pytest.approx(5.625 ** (1 / 3))
