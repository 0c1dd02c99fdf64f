"""The audit's statistics, on synthetic data where the truth is known: the temperature test's false
alarm rate on honest sampling (skewed sampling included, where a normal approximation fails) and its
power against too cold, too hot or greedy sampling, and the replay sample size's arithmetic."""

from __future__ import annotations

import copy
import logging
import math
from types import SimpleNamespace

import torch
from update_plants import coasting_a_block, coasting_most_and_stretching_the_rest

from targets.api import TraceEvent
from targets.harness.judge.accuracy import fixed_train_batches
from targets.harness.judge.replay import SAMPLED_TURNS, replay_training
from targets.harness.judge.sampling_tests import FALSE_ALARM, TemperatureTest
from targets.harness.judge.trace_index import Reasons
from targets.harness.judge.update_error import MATRIX_FOLLOWS_BATCH, TENSOR_FOLLOWS_BATCH
from targets.harness.reference.trainer import ReferenceTrainer


def _test(logits: torch.Tensor, temperature: float, sampled_at: float, generator: torch.Generator) -> TemperatureTest:
    """The temperature test over tokens sampled from softmax(logits / sampled_at), claimed at ``temperature``."""
    chosen = torch.multinomial(torch.softmax(logits / sampled_at, -1), 1, generator=generator).squeeze(-1)
    test = TemperatureTest()
    test.add(logits, chosen, temperature)
    return test


def _logits(generator: torch.Generator, tokens: int, vocab: int = 64) -> torch.Tensor:
    """Distributions from nearly flat to sharply peaked, as a small model's turns are."""
    sharpness = torch.rand(tokens, 1, generator=generator) * 4 + 0.2
    return torch.randn(tokens, vocab, generator=generator) * sharpness


def _peaked(tokens: int, vocab: int = 64, rare: float = 2e-3) -> torch.Tensor:
    """One likely token and a rare rest (``rare`` in all): a trained policy's turns. Honest sampling makes
    the sum of log-probabilities skewed, mostly small gains and a rare large loss."""
    logits = torch.full((tokens, vocab), math.log(rare / (vocab - 1)))
    logits[:, 0] = math.log(1 - rare)
    return logits


def test_honest_sampling_never_looks_dishonest():
    """1,500 honest runs of 30 to 3,000 tokens, mixed distributions: no alarm (the bound allows 1e-4)."""
    generator = torch.Generator().manual_seed(7)
    alarms = 0
    for tokens, trials in ((30, 800), (300, 550), (3000, 150)):
        for _ in range(trials):
            alarms += _test(_logits(generator, tokens), 1.0, 1.0, generator).false_alarm_bound() < FALSE_ALARM
    assert alarms == 0


def test_skewed_honest_sampling_fools_a_normal_approximation_but_not_the_bound():
    """The peaked case: |z| > 4 in 0.4% of honest runs here (the normal tail says 6.3e-5); the bound in none."""
    generator = torch.Generator().manual_seed(9)
    runs = [_test(_peaked(100, rare=1e-3), 1.0, 1.0, generator) for _ in range(1000)]
    normal_alarms = sum(abs(run.z) > 4.0 for run in runs)
    assert normal_alarms / len(runs) > 20 * 6.3e-5, normal_alarms  # what rejected an honest starter
    assert not [run for run in runs if run.false_alarm_bound() < FALSE_ALARM]


def test_sampling_too_cold_or_too_hot_is_caught():
    generator = torch.Generator().manual_seed(8)
    for sampled_at in (0.7, 1.4):
        tests = [_test(_logits(generator, 3000), 1.0, sampled_at, generator) for _ in range(20)]
        assert all(t.false_alarm_bound() < FALSE_ALARM for t in tests), (sampled_at, [t.z for t in tests])
        assert all((t.z > 0) == (sampled_at < 1.0) for t in tests)  # colder: tokens likelier than they should be
    greedy, logits = TemperatureTest(), _logits(generator, 300)  # always the likeliest token, 300 of them
    greedy.add(logits, logits.argmax(-1), 1.0)
    assert greedy.false_alarm_bound() < FALSE_ALARM and greedy.z > 0
    impossible, logits = TemperatureTest(), _logits(generator, 30)  # one token the model rules out
    logits[0, 5] = -math.inf
    impossible.add(logits, torch.tensor([5] + [0] * 29), 1.0)
    assert impossible.false_alarm_bound() == 0.0


def test_sampled_turns_is_the_least_count_that_misses_a_one_percent_cheat_at_most_one_time_in_100():
    assert SAMPLED_TURNS == 459
    assert 0.99**SAMPLED_TURNS <= 0.01 < 0.99 ** (SAMPLED_TURNS - 1)


def _bf16_spec_and_model():
    """tiny-qwen3-cpu in bfloat16 at lr 1e-6 with the 0.6B target's update bound: a bf16 AdamW step
    at that rate does not move bf16 weights, so only a float32 replay can follow an honest trainer."""
    import yaml

    from targets.harness.model import load_model, model_dir
    from targets.spec import CATALOG_DIR, parse_target

    data = yaml.safe_load((CATALOG_DIR / "tiny-qwen3-cpu.yaml").read_text())
    data["model"]["dtype"] = "bfloat16"
    data["workload"]["training"]["lr"] = 1e-6
    data["accuracy"] = {"update_rtol": 0.25, "logprob_atol": 0.05}
    spec = parse_target(data)
    return spec, load_model(model_dir(spec.model), "bfloat16")


def _train_event(batch) -> TraceEvent:
    return TraceEvent(
        "train",
        1.0,
        {
            "start": 0.5,
            "advantages": list(batch.advantages),
            "trajectories": [
                {
                    "episode": t.episode_id,
                    "group": t.group_id,
                    "tokens": t.tokens,
                    "loss_mask": t.loss_mask,
                    "logprobs": t.logprobs,
                    "reward": t.reward,
                }
                for t in batch.trajectories
            ],
        },
    )


def test_the_training_replay_follows_float32_masters_of_a_bf16_model(caplog):
    spec, base = _bf16_spec_and_model()
    batches = fixed_train_batches(base)
    honest = ReferenceTrainer(copy.deepcopy(base).float(), spec.workload.training.config())  # float32 masters
    weights = {0: {k: v.clone() for k, v in base.state_dict().items()}}  # the harness's v0, in bf16
    coasts = {}  # where each step would leave the weights on zero gradients (its momentum alone)
    for step, batch in enumerate(batches, start=1):
        coasts[step] = honest.coast()
        honest.train_step(batch)
        weights[step] = honest.state_dict()  # exported in float32, as the harness writes every version
    assert all(v.dtype == torch.bfloat16 for v in weights[0].values())
    moved = [k for k in weights[0] if not torch.equal(weights[0][k], weights[2][k].to(torch.bfloat16))]
    assert len(moved) < len(weights[0]), "lr 1e-6 must leave some bf16 weights unmoved for this test to mean much"

    def make_model(state):  # what the turn replay needs: the model in its own dtype
        model = copy.deepcopy(base)
        model.load_state_dict(state)
        return model

    ix = SimpleNamespace(trains=[_train_event(b) for b in batches])
    reasons = Reasons()
    with caplog.at_level(logging.INFO, logger="vibetrain.audit"):
        details = replay_training(ix, reasons, spec, weights.get, make_model)
    assert not reasons.lines(), reasons.lines()
    assert details["training_replay_steps"] == 2 and details["training_replay_max_error"] < 0.01
    # each step says where its time went (a GPU check ran out of time in an audit that said nothing)
    assert [m.split(":")[0] for m in caplog.messages] == ["training step 1 replayed", "training step 2 replayed"]

    skipped = {**weights, 2: weights[1]}  # a trainer that skipped the second step still fails
    reasons = Reasons()
    replay_training(ix, reasons, spec, skipped.get, make_model)
    assert any("the optimizer step did not happen" in line for line in reasons.lines()), reasons.lines()

    # a trainer that leaves one tensor where it was at step 2 (never computing its weight gradient): the
    # largest whose share of the update keeps the whole model's error under half its bound
    update = {k: float((weights[2][k].double() - weights[1][k].double()).norm()) ** 2 for k in weights[1]}
    share = {k: u / sum(update.values()) for k, u in update.items()}
    frozen = max(
        (k for k in share if math.sqrt(share[k]) < spec.accuracy.update_rtol / 2), key=lambda k: weights[1][k].numel()
    )
    left = {**weights, 2: {**weights[2], frozen: weights[1][frozen]}}
    reasons = Reasons()
    details = replay_training(ix, reasons, spec, left.get, make_model)
    assert details["training_replay_max_error"] < spec.accuracy.update_rtol / 2
    assert details["training_replay_worst_tensor_error"] == 1.0
    assert reasons.lines() == [
        f"training replay: step 2: tensor {frozen} was left behind: its update is 1 off, relative, against 0.9 "
        "(untrained is 1)"
    ], reasons.lines()

    # a trainer that lets momentum carry a tensor at step 2 (its weight gradient never computed, AdamW
    # stepping it on zero): off by less than 0.9, but carrying none of the batch's own pull on it. The
    # largest such tensor whose share keeps the whole model's error under half its bound.
    def coasted_error(k):
        return float((coasts[2][k].double() - weights[2][k].double()).norm()) / math.sqrt(update[k])

    coasting = max(
        (
            k
            for k in share
            if update[k] > 0 and coasted_error(k) < 0.9 and math.sqrt(share[k]) < spec.accuracy.update_rtol / 2
        ),
        key=lambda k: weights[1][k].numel(),
    )
    carried = {**weights, 2: {**weights[2], coasting: coasts[2][coasting]}}
    reasons = Reasons()
    details = replay_training(ix, reasons, spec, carried.get, make_model)
    assert details["training_replay_worst_tensor_error"] < 0.9, "the old bound would have let it through"
    assert details["training_replay_least_followed"] < 1e-6
    assert [line.split(":", 2)[2].split(" of ")[0] for line in reasons.lines()] == [
        f" tensor {coasting} did not follow the batch: its update carries 0"
    ], reasons.lines()

    # a trainer that lets momentum carry the rows of a matrix holding 70% of the batch's pull on it and
    # moves the other rows twice as far: one projection onto the pull nets the two out to 0.6, row by row
    # it carries under 0.3 (the matrix momentum alone carries nearest its step, the whole model's error
    # kept under half its bound)
    matrix = min(
        (
            k
            for k in share
            if weights[1][k].dim() == 2
            and update[k] > 0
            and math.sqrt(share[k]) * coasted_error(k) < spec.accuracy.update_rtol / 2
        ),
        key=coasted_error,
    )
    coast, pull = coasts[2][matrix].double(), weights[2][matrix].double() - coasts[2][matrix].double()
    stretched, _ = coasting_most_and_stretching_the_rest(coast, pull)
    projection = float(((stretched - coast) * pull).sum() / (pull * pull).sum())
    assert abs(projection - 0.6) < 1e-3, "a projection onto the pull alone would let it through"
    planted = {**weights, 2: {**weights[2], matrix: stretched.float()}}
    reasons = Reasons()
    details = replay_training(ix, reasons, spec, planted.get, make_model)
    assert details["training_replay_worst_tensor_error"] < 0.9
    assert details["training_replay_least_followed"] < 0.3
    assert [line.split(":", 2)[2].split(" of ")[0] for line in reasons.lines()] == [
        f" tensor {matrix} did not follow the batch: its update carries {details['training_replay_least_followed']:.3g}"
    ], reasons.lines()

    # a trainer that leaves a block of the same matrix to momentum, half its rows by half its columns: each
    # of those rows and columns still carries about half of its own pull, the matrix about three quarters,
    # over a vector's bound and under a matrix's
    planted = {**weights, 2: {**weights[2], matrix: coasting_a_block(coast, pull).float()}}
    reasons = Reasons()
    details = replay_training(ix, reasons, spec, planted.get, make_model)
    block_carried = details["training_replay_least_followed_matrix"]
    assert TENSOR_FOLLOWS_BATCH < block_carried < MATRIX_FOLLOWS_BATCH
    assert [line.split(":", 2)[2].split(" of ")[0] for line in reasons.lines()] == [
        f" tensor {matrix} did not follow the batch: its update carries {block_carried:.3g}"
    ], reasons.lines()


def test_an_honest_bf16_trainer_passes_a_step_of_weak_gradients():
    """A trainer that computes in bf16 over float32 masters keeps momentum of its own, not the replay's.
    On a step whose advantages are 1e-4 of the usual, the batch's pull on each tensor is 0.1% of the
    step, and that difference tilted an honest tensor's projection onto the pull to -1.2: such a pull is
    not judged (a tensor coasting there is off by as little)."""
    import dataclasses

    from bf16_masters import Bf16MasterTrainer

    spec, base = _bf16_spec_and_model()
    batches = fixed_train_batches(base, sizes=(8, 12, 8, 12))
    batches[3] = dataclasses.replace(batches[3], advantages=[a * 1e-4 for a in batches[3].advantages])
    honest = Bf16MasterTrainer(base, spec.workload.training.config())
    weights = {0: {k: v.clone() for k, v in base.state_dict().items()}}
    for step, batch in enumerate(batches, start=1):
        honest.train_step(batch)
        weights[step] = honest.state_dict()

    def make_model(state):
        model = copy.deepcopy(base)
        model.load_state_dict(state)
        return model

    reasons = Reasons()
    ix = SimpleNamespace(trains=[_train_event(b) for b in batches])
    details = replay_training(ix, reasons, spec, weights.get, make_model)
    assert not reasons.lines(), reasons.lines()
    assert details["training_replay_steps"] == 4 and details["training_replay_least_followed"] > 0.9


def test_equal_rewards_leave_honest_weights_where_they_were_and_the_replay_decides():
    """A random model on a real task scores 0 everywhere: every advantage is 0, so an honest GRPO step
    (no weight decay) leaves the weights unchanged. That is no reason to reject; a trainer that moves
    them anyway (here: on advantages of its own) is one, by the replay."""
    import dataclasses

    import yaml

    from targets.harness.model import load_model, model_dir
    from targets.spec import CATALOG_DIR, parse_target

    spec = parse_target(yaml.safe_load((CATALOG_DIR / "tiny-qwen3-cpu.yaml").read_text()))
    assert spec.workload.training.config().weight_decay == 0.0
    base = load_model(model_dir(spec.model))
    rewarded = fixed_train_batches(base)
    flat = [
        dataclasses.replace(
            b,
            trajectories=[dataclasses.replace(t, reward=0.0) for t in b.trajectories],
            advantages=[0.0] * len(b.advantages),
        )
        for b in rewarded
    ]
    v0 = {k: v.clone() for k, v in base.state_dict().items()}
    ix = SimpleNamespace(trains=[_train_event(b) for b in flat])
    unmoved = {0: v0, 1: v0, 2: v0}
    reasons = Reasons()
    replay_training(ix, reasons, spec, unmoved.get, lambda state: copy.deepcopy(base))
    assert not reasons.lines(), reasons.lines()

    trainer = ReferenceTrainer(copy.deepcopy(base), spec.workload.training.config())
    moved = {0: v0}
    for step, batch in enumerate(rewarded, start=1):  # trained on advantages the rewards never gave
        trainer.train_step(batch)
        moved[step] = trainer.state_dict()
    reasons = Reasons()
    replay_training(ix, reasons, spec, moved.get, lambda state: copy.deepcopy(base))
    assert any("relative error inf" in line for line in reasons.lines()), reasons.lines()

    rewarded_ix = SimpleNamespace(trains=[_train_event(b) for b in rewarded])  # rewards that differ: a
    reasons = Reasons()  # trainer that never moved is caught, by the replay and as unchanged weights
    replay_training(rewarded_ix, reasons, spec, unmoved.get, lambda state: copy.deepcopy(base))
    assert any("weights unchanged" in line for line in reasons.lines()), reasons.lines()


def test_short_sequences_replayed_together_see_what_each_alone_sees(tiny_model):
    """The turn replay pads sequences on the right and runs them through one forward pass: the attention
    is causal, so each sequence's positions are what a pass of its own gives, and each batch stays within
    its token budget (one longer sequence alone)."""
    from targets.harness.judge.replay import BATCH_TOKENS, _forward_batches, _hidden_states

    generator = torch.Generator().manual_seed(0)
    vocabulary = tiny_model.config.vocab_size
    sequences = [torch.randint(vocabulary, (n,), generator=generator).tolist() for n in (5, 17, 9, 33)]
    together = _hidden_states(tiny_model, sequences)
    for row, sequence in enumerate(sequences):
        alone = _hidden_states(tiny_model, [sequence])[0]
        torch.testing.assert_close(together[row, : len(sequence)], alone, rtol=1e-4, atol=1e-5)
    lengths = [BATCH_TOKENS + 1, 3000, 3000, 2000, 2000, 10]
    batches = _forward_batches([([0] * n, []) for n in lengths])
    assert [[len(s) for s, _ in batch] for batch in batches] == [[BATCH_TOKENS + 1], [3000, 3000], [2000, 2000, 10]]
