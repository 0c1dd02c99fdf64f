"""The reference implementation: GRPO math by hand, the engine against single-prompt decoding, and
the co-located loop really rolling out, training and learning."""

from __future__ import annotations

import math

import pytest
import torch

from targets.api import SamplingParams, TrainingConfig, Trajectory
from targets.harness.judge.accuracy import fixed_prompts, fixed_train_batches, reference_greedy
from targets.harness.reference.engine import ReferenceEngine
from targets.harness.reference.grpo import group_advantages, grpo_loss, pad_trajectories
from targets.harness.reference.loop import run_reference
from targets.harness.reference.trainer import ReferenceTrainer, micro_batches


def _traj(group: str, reward: float, tokens=(3, 4, 5), mask=(0, 1, 1), logprobs=(0.0, -1.0, -2.0)) -> Trajectory:
    return Trajectory("e", group, list(tokens), list(mask), list(logprobs), reward, [0])


def test_group_advantages_by_hand():
    trajectories = [_traj("a", 1.0), _traj("a", 3.0), _traj("b", 5.0), _traj("b", 5.0)]
    advantages = group_advantages(trajectories)
    assert advantages[0] == pytest.approx(-1.0, abs=1e-5) and advantages[1] == pytest.approx(1.0, abs=1e-5)
    assert advantages[2:] == [0.0, 0.0]  # equal rewards carry no signal
    # exactly, where the mean's rounding left +-1.4e-11 (a step that moved nothing read as a trainer that did not)
    assert group_advantages([_traj("c", 0.1) for _ in range(3)]) == [0.0, 0.0, 0.0]
    from skills.recipes.controller_base import group_advantages as the_kits

    assert the_kits([_traj("c", 0.1) for _ in range(3)]) == [0.0, 0.0, 0.0]


def test_grpo_loss_by_hand_with_clipping():
    batch = pad_trajectories([_traj("a", 0.0)])
    new = torch.tensor([[0.0, -0.5, -2.0]])  # ratios: e^0.5 (clipped to 1.2), e^0 = 1
    config = TrainingConfig(clip_eps=0.2)
    loss = grpo_loss(new, batch, torch.tensor([1.0]), config)
    assert float(loss) == pytest.approx(-(1.2 + 1.0) / 2)
    # negative advantage: min picks the unclipped, larger-magnitude penalty
    loss = grpo_loss(new, batch, torch.tensor([-1.0]), config)
    assert float(loss) == pytest.approx(-(-math.exp(0.5) - 1.0) / 2)


def test_micro_batches_bound_the_logits_and_keep_every_trajectory(monkeypatch):
    import targets.harness.reference.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "LOGITS_BYTES", 4 * 100 * 10)  # 1000 logits of a 10-token vocabulary
    trajectories = [
        _traj("a", 0.0, tokens=range(n), mask=[0] + [1] * (n - 1), logprobs=[0.0] * n) for n in (30, 30, 40, 200, 5)
    ]
    groups = micro_batches(trajectories, vocab_size=10)
    assert groups == [[0, 1], [2], [3], [4]]  # 2 x 40 x 10 = 800 fits, 3 x 40 would not; 200 goes alone
    assert micro_batches(trajectories, vocab_size=1) == [[0, 1, 2, 3, 4]]


def test_a_micro_batched_step_is_the_whole_batch_step(tiny_model, tiny_spec, monkeypatch):
    """A large vocabulary splits the batch; the gradients must still add up to the batch's token mean."""
    import copy

    import targets.harness.reference.trainer as trainer_module

    batch = fixed_train_batches(tiny_model)[0]
    config = tiny_spec.workload.training.config()
    whole = ReferenceTrainer(copy.deepcopy(tiny_model), config)
    whole.train_step(batch)
    monkeypatch.setattr(trainer_module, "LOGITS_BYTES", 1)  # one trajectory per forward
    split = ReferenceTrainer(copy.deepcopy(tiny_model), config)
    split.train_step(batch)
    start, a, b = tiny_model.state_dict(), whole.state_dict(), split.state_dict()
    moved = sum(float((a[k] - start[k]).norm()) ** 2 for k in a) ** 0.5
    off = sum(float((a[k] - b[k]).norm()) ** 2 for k in a) ** 0.5
    assert moved > 0 and off / moved < 1e-4, off / moved
    assert split.last_loss == pytest.approx(whole.last_loss, rel=1e-5)


def test_coasting_is_the_zero_gradient_step_and_changes_nothing(tiny_model, tiny_spec):
    """The judge's coast (``update_error.py``): one AdamW step on zero gradients, the trainer after it as
    before, so a replay that coasts steps exactly as one that does not."""
    import copy

    config = TrainingConfig(**{**tiny_spec.workload.training.config().__dict__, "weight_decay": 0.1})
    first, second = fixed_train_batches(tiny_model)
    coasting, plain = (ReferenceTrainer(copy.deepcopy(tiny_model), config) for _ in range(2))
    start = coasting.state_dict()
    coast = coasting.coast()  # no momentum yet: weight decay alone
    assert all(torch.allclose(coast[k], start[k] * (1 - config.lr * 0.1)) for k in start)
    for batch in (first, second):
        coasting.coast()
        coasting.train_step(batch)
        plain.train_step(batch)
        assert all(torch.equal(a, b) for a, b in zip(coasting.state_dict().values(), plain.state_dict().values()))
    moved = coasting.state_dict()
    before = {k: v.clone() for k, v in moved.items()}
    ahead = coasting.coast()  # momentum now: the coast moves every trained tensor
    assert all(not torch.equal(ahead[k], before[k]) for k in before)
    assert all(torch.equal(coasting.state_dict()[k], before[k]) for k in before)
    whole = copy.deepcopy(coasting)  # the coast taken one parameter at a time is the whole model's step
    for parameter in whole.model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    whole.optimizer.step()
    assert ahead.keys() == before.keys()
    assert all(torch.equal(ahead[k], v) for k, v in whole.state_dict().items())
    coasting.train_step(first)  # and the trainer, optimizer state included, is as it was
    plain.train_step(first)
    assert all(torch.equal(a, b) for a, b in zip(coasting.state_dict().values(), plain.state_dict().values()))


def test_reference_engine_and_greedy_batch_like_single_prompts(tiny_model):
    engine = ReferenceEngine(tiny_model)
    prompts = fixed_prompts(5)
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0))
    batched = reference_greedy(tiny_model, prompts, 8)  # left-padded, as the judge's checks 1 and 3 run it
    for prompt, completion, padded in zip(prompts, completions, batched, strict=True):
        single = reference_greedy(tiny_model, [prompt], 8)[0]  # alone: no padding
        assert completion.tokens == single.tokens == padded.tokens
        assert completion.logprobs == pytest.approx(single.logprobs, abs=1e-4)
        assert padded.logprobs == pytest.approx(single.logprobs, abs=1e-5)
        assert padded.margins == pytest.approx(single.margins, abs=1e-5)


def test_sampled_logprobs_are_those_of_the_distribution_drawn_from(tiny_model):
    """At temperature 0.6 the reference engine's logprobs are softmax(logits / 0.6)'s, the trainer's
    (``token_logprobs`` at the config's temperature) on the same tokens."""
    from targets.harness.reference.grpo import token_logprobs

    prompts = fixed_prompts(4)
    for prompt, completion in zip(prompts, ReferenceEngine(tiny_model).generate(prompts, SamplingParams(8, 0.6, 2))):
        sequence = torch.tensor([prompt + completion.tokens])
        with torch.no_grad():
            want = token_logprobs(tiny_model, sequence, torch.ones_like(sequence), 0.6)[0, len(prompt) :]
        assert completion.logprobs == pytest.approx(want.tolist(), abs=1e-4)


def test_sampling_is_seeded_and_stops_at_stop_tokens(tiny_model):
    engine = ReferenceEngine(tiny_model)
    prompts = fixed_prompts(6)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5)
    a, b = engine.generate(prompts, params), engine.generate(prompts, params)
    assert [c.tokens for c in a] == [c.tokens for c in b]
    stop = a[0].tokens[2]
    stopped = engine.generate(
        prompts, SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, stop_token_ids=(stop,))
    )
    assert stopped[0].tokens == a[0].tokens[: a[0].tokens.index(stop) + 1] and stopped[0].finish_reason == "stop"


def test_reference_loop_rolls_out_and_trains(tiny_spec, monkeypatch):
    """And trains float32 masters, whatever the model's dtype: in bfloat16 at lr 1e-6 its AdamW step moved
    1.9% of the weights (a review found the loop training the bf16 model itself)."""
    from targets.harness.reference import loop

    trained: list[torch.dtype] = []

    class Recording(loop.ReferenceTrainer):
        def __init__(self, model, config):
            trained.append(next(model.parameters()).dtype)
            super().__init__(model, config)

    monkeypatch.setattr(loop, "ReferenceTrainer", Recording)
    bf16 = tiny_spec.model_copy(update={"model": tiny_spec.model.model_copy(update={"dtype": "bfloat16"})})
    run_reference(bf16, steps=1, seed=1)
    assert trained == [torch.float32]
    history = run_reference(tiny_spec, steps=2, seed=1)
    assert [s.step for s in history] == [0, 1]
    for s in history:
        assert s.response_tokens > 0 and 1 <= s.mean_turns <= tiny_spec.workload.turns.max
        assert math.isfinite(s.loss) and s.grad_norm > 0


@pytest.mark.slow
@pytest.mark.parametrize("environment", ["synthetic_agent", "guess_number"])
def test_reference_loop_learns_each_environment(catalog_yaml, environment):
    """Each environment's reward is learnable by the tiny model within tens of GRPO steps."""
    from targets.spec import parse_target

    # Learnability, not latency, is under test: lockstep turns would wait on the slowest tool call.
    catalog_yaml["workload"]["env_latency_s"] = {"kind": "fixed", "value": 0.0}
    if environment == "guess_number":  # a one-token answer: long responses dilute its credit
        # 64 episodes a step, not the target's 32. Measured (seeds 0-5, 30 steps, lr 3e-3): with 32 the
        # rise of the last five steps over the first five was -0.05 to +0.26, and one seed's policy peaked
        # at step 11 and collapsed; with 64 it was +0.18 to +0.28 (mean 0.24), far clear of the 0.1 asked.
        catalog_yaml["workload"].update(environment={"name": "guess_number"}, turns={"max": 8}, batch_size=64)
        catalog_yaml["workload"]["tokens"].update(response=4, max_sequence=128)
    # synthetic_agent: 20 steps (seeds 0-2, the last five's rise over the first five: 0.23, 0.27, 0.16 at 20
    # steps; 0.33, 0.36, 0.44 at 30)
    steps = 30 if environment == "guess_number" else 20
    history = run_reference(parse_target(catalog_yaml), steps=steps, seed=0)
    first = sum(s.mean_reward for s in history[:5]) / 5
    last = sum(s.mean_reward for s in history[-5:]) / 5
    assert last > first + 0.1, f"mean reward {first:.3f} -> {last:.3f}"
