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
