"""Accuracy checks 1-3: each passes for the reference components and rejects a planted wrong one,
with a reason that names what is wrong."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from targets.api import TrainingConfig
from targets.harness.judge.accuracy import (
    CheckDraw,
    check_engine,
    check_trainer,
    check_weight_sync,
    fixed_prompts,
    fixed_train_batches,
)
from targets.harness.reference.engine import ReferenceEngine
from targets.harness.reference.grpo import grpo_loss, pad_trajectories, token_logprobs
from targets.harness.reference.trainer import ReferenceTrainer
from targets.spec import AccuracySpec

ACCURACY = AccuracySpec()
CONFIG = TrainingConfig(lr=1e-3, clip_eps=0.2, max_grad_norm=1.0)


# --- planted wrong engines ----------------------------------------------------------------


def _logit_hook(engine: ReferenceEngine, change) -> ReferenceEngine:
    engine.model.lm_head.register_forward_hook(lambda module, args, out: change(out))
    return engine


class StaleSyncEngine(ReferenceEngine):
    """Claims the new version but keeps serving the old weights."""

    def load_weights(self, state, version):
        self.weight_version = version


class PartialSyncEngine(ReferenceEngine):
    """Loads the new version but one layer's tensors: it serves weights that are neither version."""

    def load_weights(self, state, version):
        kept = self.model.state_dict()
        self.model.load_state_dict({k: (kept[k] if ".layers.0." in k else v) for k, v in dict(state).items()})
        self.weight_version = version


class VersionLyingEngine(ReferenceEngine):
    """Loads the weights but never updates its version."""

    def load_weights(self, state, version):
        self.model.load_state_dict(dict(state))


class NaNLogprobEngine(ReferenceEngine):
    """The reference's tokens, with a NaN for one logprob of each completion: a NaN compares false with
    any tolerance, so a check written ``diff > atol`` would pass it."""

    def generate(self, prompts, params):
        completions = super().generate(prompts, params)
        for c in completions:
            c.logprobs[len(c.logprobs) // 2] = float("nan")
        return completions


class DroppingEngine(ReferenceEngine):
    """Answers one prompt fewer than it was asked."""

    def generate(self, prompts, params):
        return super().generate(prompts, params)[:-1]


class ShortEngine(ReferenceEngine):
    """Stops each completion two tokens early."""

    def generate(self, prompts, params):
        return [
            dataclasses.replace(c, tokens=c.tokens[:-2], logprobs=c.logprobs[:-2])
            for c in super().generate(prompts, params)
        ]


class MisstampingEngine(ReferenceEngine):
    """Stamps its completions with a version it does not hold (what it did before a sync, say)."""

    def generate(self, prompts, params):
        return [dataclasses.replace(c, weight_version=c.weight_version + 1) for c in super().generate(prompts, params)]


# --- planted wrong trainers ---------------------------------------------------------------


class SkippedStepTrainer(ReferenceTrainer):
    """Computes the loss and gradients but never steps the optimizer."""

    def train_step(self, batch):
        padded = pad_trajectories(batch.trajectories)
        loss = grpo_loss(
            token_logprobs(self.model, padded.tokens, padded.attention, self.config.temperature),
            padded,
            torch.tensor(batch.advantages),
            self.config,
        )
        loss.backward()
        self.version += 1
        return self.version


class NaNWeightTrainer(ReferenceTrainer):
    """Steps as the reference does, then leaves a NaN in one weight: the relative error is NaN."""

    def train_step(self, batch):
        version = super().train_step(batch)
        with torch.no_grad():
            next(self.model.parameters()).view(-1)[0] = float("nan")
        return version


class VersionSkippingTrainer(ReferenceTrainer):
    """Trains as the reference does but counts two versions a step."""

    def train_step(self, batch):
        super().train_step(batch)
        self.version += 1
        return self.version


class PartialStateTrainer(ReferenceTrainer):
    """Exports every parameter but the output head's."""

    def state_dict(self):
        return {k: v for k, v in super().state_dict().items() if "lm_head" not in k}


class MisshapedStateTrainer(ReferenceTrainer):
    """Exports a layernorm's weights as a row (broadcast against the model's vector, the values compare equal)."""

    def state_dict(self):
        state = super().state_dict()
        return {k: v.reshape(1, -1) if k == "model.layers.0.input_layernorm.weight" else v for k, v in state.items()}


class UnclippedTrainer(ReferenceTrainer):
    """Ignores the ratio clipping (a plain policy gradient)."""

    def __init__(self, model, config):
        super().__init__(model, TrainingConfig(**{**config.__dict__, "clip_eps": 1e9}))


class AscentTrainer(ReferenceTrainer):
    """Flips the loss sign: pushes probability away from advantaged tokens."""

    def train_step(self, batch):
        flipped = type(batch)(batch.trajectories, [-a for a in batch.advantages])
        return super().train_step(flipped)


class FrozenTensorTrainer(ReferenceTrainer):
    """Trains every tensor but one layernorm, whose weight gradient it never computes: a share of the
    update small enough to hide under the whole model's bound."""

    def __init__(self, model, config):
        super().__init__(model, config)
        model.get_parameter("model.layers.0.input_layernorm.weight").requires_grad_(False)


class CoastingTrainer(ReferenceTrainer):
    """Trains every tensor on the first step; from the second on, one layernorm's weight gradient is
    never computed (zero) and AdamW's momentum carries it: off by less than 0.9, and the whole model
    under its bound."""

    def train_step(self, batch):
        if self.version == 0:
            return super().train_step(batch)
        coasting = self.model.get_parameter("model.layers.0.input_layernorm.weight")
        hook = coasting.register_hook(torch.zeros_like)
        try:
            return super().train_step(batch)
        finally:
            hook.remove()


class LossScaledTrainer(ReferenceTrainer):
    """The loss 100 times too large (the policy loss is linear in the advantages): clipped to the same
    gradient wherever the gradient norm is over the clip, so both steps clipped hid it."""

    def train_step(self, batch):
        return super().train_step(type(batch)(batch.trajectories, [100 * a for a in batch.advantages]))


class TokenSumTrainer(ReferenceTrainer):
    """Sums the loss over the batch's response tokens where the reference takes their mean."""

    def train_step(self, batch):
        tokens = sum(sum(t.loss_mask) for t in batch.trajectories)
        return super().train_step(type(batch)(batch.trajectories, [tokens * a for a in batch.advantages]))


class SequenceMeanTrainer(ReferenceTrainer):
    """Each trajectory's mean over its own response tokens, then the mean over trajectories: with every
    response 6 tokens long this was the reference's token mean exactly."""

    def train_step(self, batch):
        tokens, count = sum(sum(t.loss_mask) for t in batch.trajectories), len(batch.trajectories)
        scaled = [a * tokens / (count * sum(t.loss_mask)) for t, a in zip(batch.trajectories, batch.advantages)]
        return super().train_step(type(batch)(batch.trajectories, scaled))


class NeverClippedGradientTrainer(ReferenceTrainer):
    """Skips the global gradient-norm clipping."""

    def __init__(self, model, config):
        super().__init__(model, TrainingConfig(**{**config.__dict__, "max_grad_norm": 1e12}))


class ObservationTrainingTrainer(ReferenceTrainer):
    """Trains on every token after the prompt, the environment's observations included."""

    def train_step(self, batch):
        def unmasked(t):
            first = t.loss_mask.index(1)
            return type(t)(**{**t.__dict__, "loss_mask": [0] * first + [1] * (len(t.loss_mask) - first)})

        return super().train_step(type(batch)([unmasked(t) for t in batch.trajectories], batch.advantages))


def _factory(cls, base_model):
    def make(state, config):
        model = copy.deepcopy(base_model)
        model.load_state_dict(dict(state))
        return cls(model, config)

    return make


# --- check 1 ------------------------------------------------------------------------------


def test_engine_check_passes_the_reference_engine(tiny_model):
    result = check_engine(ReferenceEngine(copy.deepcopy(tiny_model)), tiny_model, ACCURACY)
    assert result.passed, result.reasons
    assert result.details["max_logprob_diff"] < ACCURACY.logprob_atol


def test_engine_check_rejects_scaled_logits(tiny_model):
    engine = _logit_hook(ReferenceEngine(copy.deepcopy(tiny_model)), lambda out: out * 1.1)
    result = check_engine(engine, tiny_model, ACCURACY)
    assert not result.passed
    assert any("logprob of token" in r for r in result.reasons)


def test_engine_check_rejects_biased_logits(tiny_model):
    def bias(out):
        out[..., 7] += 50.0
        return out

    result = check_engine(_logit_hook(ReferenceEngine(copy.deepcopy(tiny_model)), bias), tiny_model, ACCURACY)
    assert not result.passed
    assert any("greedy token" in r and "reference" in r for r in result.reasons)


@pytest.mark.parametrize(
    "planted, expected",
    [
        (DroppingEngine, "completions for 4 prompts"),
        (ShortEngine, "engine stopped after"),
        (MisstampingEngine, "completions report weight versions [1], engine is at 0"),
    ],
)
def test_engine_check_rejects_planted_engines(tiny_model, planted, expected):
    result = check_engine(planted(copy.deepcopy(tiny_model)), tiny_model, ACCURACY)
    assert not result.passed and any(expected in r for r in result.reasons), result.reasons


def test_weight_sync_check_rejects_completions_stamped_with_another_version(tiny_model):
    engine = MisstampingEngine(copy.deepcopy(tiny_model))
    result = check_weight_sync(engine, engine.load_weights, tiny_model, ACCURACY, version=3)
    assert not result.passed
    assert any("completions after sync are stamped with versions [4], expected 3" in r for r in result.reasons)


class RecognizingEngine(ReferenceEngine):
    """Serves the prompts it can read in the harness's source (the public draw) exactly, and every other
    one from wrong weights (a fast path that is wrong): the checks' inputs must be ones it cannot know."""

    def __init__(self, model, known):
        super().__init__(model)
        self.known = [list(p) for p in known]
        self.wrong = ReferenceEngine(copy.deepcopy(model))
        with torch.no_grad():
            for parameter in self.wrong.model.parameters():
                parameter.mul_(0.9)

    def generate(self, prompts, params):
        exact = all(list(p) in self.known for p in prompts)
        return super().generate(prompts, params) if exact else self.wrong.generate(prompts, params)


def test_the_checks_prompts_are_drawn_fresh_over_the_tokenizers_ids(tiny_model):
    """An engine that answers the public check prompts by an exact path passes the public draw; the judge's
    draw, fresh for every check, gives it prompts it cannot know (not even from an earlier attempt's
    reasons), over every id the model embeds."""
    public = CheckDraw()
    known = fixed_prompts(ACCURACY.prompts, public.engine_seed) + fixed_prompts(ACCURACY.prompts, public.sync_seed)
    assert check_engine(RecognizingEngine(copy.deepcopy(tiny_model), known), tiny_model, ACCURACY, public).passed
    vocabulary = tiny_model.config.vocab_size
    secret = CheckDraw.fresh(vocabulary)
    result = check_engine(RecognizingEngine(copy.deepcopy(tiny_model), known), tiny_model, ACCURACY, secret)
    assert not result.passed and any(r.startswith("prompt ") for r in result.reasons), result.reasons
    drawn = secret.prompts(50, secret.engine_seed)
    assert max(max(p) for p in drawn) >= public.vocabulary and max(max(p) for p in drawn) < vocabulary
    assert CheckDraw.fresh(vocabulary) != secret  # another check, other prompts
    assert result.details["seed"] == secret.engine_seed  # what reproduces the failure
    engine = RecognizingEngine(copy.deepcopy(tiny_model), known)
    assert check_weight_sync(engine, engine.load_weights, tiny_model, ACCURACY, draw=public).passed
    engine = RecognizingEngine(copy.deepcopy(tiny_model), known)
    assert not check_weight_sync(engine, engine.load_weights, tiny_model, ACCURACY, draw=secret).passed


def test_engine_check_rejects_nan_logprobs(tiny_model):
    result = check_engine(NaNLogprobEngine(copy.deepcopy(tiny_model)), tiny_model, ACCURACY)
    assert not result.passed
    assert any("logprob of token" in r and "nan" in r for r in result.reasons), result.reasons


# --- check 2 ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def batches(_tiny_model_loaded):
    return fixed_train_batches(_tiny_model_loaded)


def test_trainer_check_passes_the_reference_trainer(tiny_model, batches):
    result = check_trainer(_factory(ReferenceTrainer, tiny_model), tiny_model, CONFIG, ACCURACY, batches)
    assert result.passed, result.reasons
    assert result.details["relative_update_error"] < 1e-4
    # the first step's own figures, recorded for the GPU cards that will decide whether to judge them
    assert result.details["step_1_relative_update_error"] < 1e-4 and result.details["step_1_least_followed"] > 0.99


class FirstExportOffTrainer(ReferenceTrainer):
    """The reference trainer, whose export after its first step is the weights it started from."""

    def state_dict(self):
        return {k: v.detach().clone() for k, v in self.start.items()} if self.version == 1 else super().state_dict()

    def train_step(self, batch):
        if self.version == 0:
            self.start = super().state_dict()
        return super().train_step(batch)


def test_the_first_steps_figures_are_recorded_and_not_judged(tiny_model, batches):
    """What check 2 would have to allow to judge each step is measured on the cards first: a first step
    that reads as not having moved is recorded as such, and the two steps together still decide."""
    result = check_trainer(_factory(FirstExportOffTrainer, tiny_model), tiny_model, CONFIG, ACCURACY, batches)
    assert result.passed, result.reasons
    assert result.details["step_1_relative_update_error"] == 1.0 and result.details["relative_update_error"] < 1e-4


def test_fixed_batches_exercise_clipping(tiny_model, batches):
    padded = pad_trajectories(batches[0].trajectories)
    with torch.no_grad():
        ratio = torch.exp(token_logprobs(tiny_model, padded.tokens, padded.attention, 1.0) - padded.old_logprobs)
    on_mask = ratio[padded.loss_mask.bool()]
    assert ((on_mask > 1 + CONFIG.clip_eps) | (on_mask < 1 - CONFIG.clip_eps)).float().mean() > 0.2


@pytest.mark.parametrize(
    "planted, expected",
    [
        (SkippedStepTrainer, "optimizer step did not happen"),
        (UnclippedTrainer, "the weights are not the reference trainer's update over two steps"),
        (AscentTrainer, "the weights are not the reference trainer's update over two steps"),
        (NaNWeightTrainer, "relative error nan"),
        (VersionSkippingTrainer, "after step 1 the trainer returned version 2 and reports 2"),
        (PartialStateTrainer, "trainer state_dict lacks parameters"),
        (MisshapedStateTrainer, "trainer state_dict gives model.layers.0.input_layernorm.weight the shape (1, "),
        (FrozenTensorTrainer, "tensor model.layers.0.input_layernorm.weight was left behind"),
        (CoastingTrainer, "tensor model.layers.0.input_layernorm.weight did not follow the batch"),
        (LossScaledTrainer, "the weights are not the reference trainer's update over two steps"),
        (TokenSumTrainer, "the weights are not the reference trainer's update over two steps"),
        (SequenceMeanTrainer, "the weights are not the reference trainer's update over two steps"),
        (NeverClippedGradientTrainer, "the weights are not the reference trainer's update over two steps"),
        (ObservationTrainingTrainer, "the weights are not the reference trainer's update over two steps"),
    ],
)
def test_trainer_check_rejects_planted_trainers(tiny_model, batches, planted, expected):
    result = check_trainer(_factory(planted, tiny_model), tiny_model, CONFIG, ACCURACY, batches)
    assert not result.passed
    assert any(expected in r for r in result.reasons), result.reasons


@pytest.mark.parametrize("planted", [LossScaledTrainer, TokenSumTrainer, NeverClippedGradientTrainer])
def test_a_kl_term_does_not_blind_check_2_to_the_loss_scale(tiny_model, batches, planted):
    """With kl_coef > 0 the batches were left unscaled (both steps clipped): a loss 100x too large, a token
    sum and no gradient clipping passed again. The probe runs at the KL anchor, where the term adds no
    gradient: the batches straddle the clip whatever the KL coefficient."""
    config = TrainingConfig(**{**CONFIG.__dict__, "kl_coef": 0.1})
    assert check_trainer(_factory(ReferenceTrainer, tiny_model), tiny_model, config, ACCURACY, batches).passed
    assert not check_trainer(_factory(planted, tiny_model), tiny_model, config, ACCURACY, batches).passed


class UntemperedTrainer(ReferenceTrainer):
    """Trains the unscaled policy whatever temperature the rollout samples at (as the contract once said):
    its ratio and gradient are of another distribution than the one the tokens were drawn from."""

    def __init__(self, model, config):
        super().__init__(model, dataclasses.replace(config, temperature=1.0))


def test_check_2_at_the_spec_temperature_rejects_a_trainer_of_the_unscaled_policy(tiny_model):
    """A rollout at temperature 0.6 draws from softmax(logits / 0.6), and the GRPO step is taken of that
    policy (verl and TRL scale the logits too): check 2 samples its batches at the spec's temperature and
    the reference trains at it, so a trainer of the unscaled policy is told apart."""
    config = dataclasses.replace(CONFIG, temperature=0.6)
    batches = fixed_train_batches(tiny_model, temperature=0.6)
    honest = check_trainer(_factory(ReferenceTrainer, tiny_model), tiny_model, config, ACCURACY, batches)
    assert honest.passed, honest.reasons
    result = check_trainer(_factory(UntemperedTrainer, tiny_model), tiny_model, config, ACCURACY, batches)
    assert not result.passed
    assert any("the weights are not the reference trainer's update" in r for r in result.reasons), result.reasons


# --- check 3 ------------------------------------------------------------------------------


def test_weight_sync_check_passes_the_reference_engine(tiny_model):
    engine = ReferenceEngine(copy.deepcopy(tiny_model))
    result = check_weight_sync(engine, engine.load_weights, tiny_model, ACCURACY, version=3)
    assert result.passed, result.reasons


def test_weight_sync_check_rejects_stale_weights(tiny_model):
    engine = StaleSyncEngine(copy.deepcopy(tiny_model))
    result = check_weight_sync(engine, engine.load_weights, tiny_model, ACCURACY)
    assert not result.passed
    assert any("still serves the previous weights" in r for r in result.reasons)


def test_weight_sync_check_rejects_a_sync_that_loaded_part_of_the_weights(tiny_model):
    # neither the old weights (the stale reason) nor the new: only the comparison with the new version says so
    engine = PartialSyncEngine(copy.deepcopy(tiny_model))
    result = check_weight_sync(engine, engine.load_weights, tiny_model, ACCURACY)
    assert not result.passed
    assert not any("still serves the previous weights" in r for r in result.reasons), result.reasons
    assert any("greedy token" in r or "logprob of token" in r for r in result.reasons), result.reasons


def test_weight_sync_check_rejects_a_wrong_version(tiny_model):
    engine = VersionLyingEngine(copy.deepcopy(tiny_model))
    result = check_weight_sync(engine, engine.load_weights, tiny_model, ACCURACY, version=2)
    assert not result.passed
    assert any("reports weight version 0 after sync of version 2" in r for r in result.reasons)


def test_a_draw_whose_first_perturbation_cannot_be_told_from_the_base_tries_the_next():
    """On the 64-id MoE proxy of the 235B target, this fresh draw's prompts all meet a near-tie in their
    first token under seed 99's perturbation (so a stale engine would pass): CI once rejected the honest
    starter on such a draw. The check moves to the next seed, and a stale engine still fails."""
    from targets.harness.model import load_model, model_dir, proxy_model
    from targets.spec.loading import load_target

    spec = load_target("qwen3-235b-a22b-h800x160")
    model = load_model(model_dir(proxy_model(spec.model)), "float32")
    draw = CheckDraw(1, 2, sync_seed=1896571802901933758, vocabulary=64, perturbation_seed=99)
    engine = ReferenceEngine(copy.deepcopy(model))
    result = check_weight_sync(engine, engine.load_weights, model, spec.accuracy, draw=draw)
    assert result.passed and result.details["perturbation_seed"] > 99, (result.reasons, result.details)
    stale = StaleSyncEngine(copy.deepcopy(model))
    result = check_weight_sync(stale, stale.load_weights, model, spec.accuracy, draw=draw)
    assert any("still serves the previous weights" in r for r in result.reasons), result.reasons
