"""The judge's deterministic accuracy checks 1-3, runnable against any engine or trainer that follows
``targets.api``:

1. engine: greedy tokens equal the reference model's (plain transformers forward over the
   left-padded prompts, no cache) on drawn prompts (``CheckDraw``), and per-token logprobs agree within
   ``logprob_atol``;
2. trainer: two GRPO steps on drawn batches move the parameters like the reference trainer's, which
   keeps float32 master weights whatever the model's dtype (relative error of the update within
   ``update_rtol``: a trainer whose updates round away in bf16 fails), no tensor the reference moves is
   left behind, and each follows the last batch (``update_error.py``);
3. weight sync: after syncing version v, the engine's tokens and logprobs are the reference's
   under v's weights (and the report says so when they are still the old weights').

Each check returns a ``CheckResult`` whose reasons name exactly what differed.
"""

from __future__ import annotations

import copy
import math
import random
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from targets.api import (
    Completion,
    RolloutEngine,
    SamplingParams,
    StateDict,
    TokenIds,
    TrainBatch,
    Trainer,
    TrainingConfig,
    Trajectory,
)
from targets.harness.judge.check_result import CheckResult
from targets.harness.judge.update_error import UpdateError, step_fault, update_error
from targets.harness.reference.engine import ReferenceEngine, next_token_logits
from targets.harness.reference.grpo import group_advantages
from targets.harness.reference.trainer import ReferenceTrainer
from targets.harness.tokenizer import NAMED_VOCAB
from targets.spec import AccuracySpec


@dataclass
class GreedyReference:
    tokens: list[int]
    logprobs: list[float]
    margins: list[float]  # top-1 minus top-2 logit at each step


@dataclass(frozen=True)
class CheckDraw:
    """What checks 1-3 draw their prompts and batches from. The judge draws fresh seeds for every check
    (``fresh``): with public seeds a candidate that reads this file knows the exact prompts it is checked
    on, and could serve them by an exact path and everything else by a wrong one; with seeds fixed for a
    session, prompts a failing attempt raised with would come back in the reasons the next attempt is fed.
    The ids span what the model's tokenizer defines, not only the harness's words (the first 53 ids of a
    151k-token model). The defaults are the public draw tests and tools use."""

    engine_seed: int = 1234
    trainer_seed: int = 4321
    sync_seed: int = 77
    vocabulary: int = len(NAMED_VOCAB)  # prompts draw ids below it
    perturbation_seed: int = 99  # check 3's new weights: the first of the seeds it tries

    @classmethod
    def fresh(cls, vocabulary: int) -> CheckDraw:
        """Seeds no one knows before the check (recorded in its details, to reproduce a failure)."""
        engine, trainer, sync, perturbation = (secrets.randbits(63) for _ in range(4))
        return cls(engine, trainer, sync, vocabulary, perturbation)

    def prompts(self, count: int, seed: int) -> list[TokenIds]:
        return fixed_prompts(count, seed, self.vocabulary)


def fixed_prompts(count: int, seed: int = 1234, vocabulary: int = len(NAMED_VOCAB)) -> list[TokenIds]:
    """Deterministic prompts of varied length over the first ``vocabulary`` ids (by default the harness's
    named words)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocabulary) for _ in range(rng.randint(4, 14))] for _ in range(count)]


@torch.no_grad()
def reference_greedy(model: PreTrainedModel, prompts: Sequence[TokenIds], new_tokens: int) -> list[GreedyReference]:
    """Greedy decoding of each prompt with a full forward per token over the left-padded batch (no
    cache): one forward a token for all the prompts (a prompt alone has no padding; padded, its
    logprobs move by ~1e-7, tests/test_reference.py)."""
    sequences = [list(p) for p in prompts]
    out = [GreedyReference([], [], []) for _ in prompts]
    for _ in range(new_tokens):
        logits = next_token_logits(model, sequences)
        top2 = torch.topk(logits, 2, dim=-1).values
        logprobs = torch.log_softmax(logits, dim=-1)
        for i, token in enumerate(logits.argmax(-1).tolist()):
            out[i].tokens.append(token)
            out[i].logprobs.append(float(logprobs[i, token]))
            out[i].margins.append(float(top2[i, 0] - top2[i, 1]))
            sequences[i].append(token)
    return out


def compare_greedy(
    completions: Sequence[Completion], references: Sequence[GreedyReference], accuracy: AccuracySpec
) -> tuple[list[str], float]:
    """Reasons the completions differ from the references, and the max logprob difference seen.

    Comparison of a prompt stops at the first token where the engine differs from the reference if
    the reference's top-2 margin there is under ``greedy_tie_margin`` (a genuine near-tie).
    """
    reasons: list[str] = []
    worst = 0.0
    if len(completions) != len(references):
        return [f"engine returned {len(completions)} completions for {len(references)} prompts"], math.inf
    for i, (got, want) in enumerate(zip(completions, references)):
        for j, want_token in enumerate(want.tokens):
            if j >= len(got.tokens):
                reasons.append(
                    f"prompt {i}: engine stopped after {len(got.tokens)} tokens, reference made {len(want.tokens)}"
                )
                break
            if got.tokens[j] != want_token:
                if want.margins[j] >= accuracy.greedy_tie_margin:
                    reasons.append(
                        f"prompt {i}: greedy token {j} is {got.tokens[j]}, reference {want_token} "
                        f"(reference top-2 margin {want.margins[j]:.3g})"
                    )
                break
            diff = abs(got.logprobs[j] - want.logprobs[j])
            worst = max(worst, diff)
            if not diff <= accuracy.logprob_atol:  # a NaN is over any bound
                reasons.append(
                    f"prompt {i}: logprob of token {j} is {got.logprobs[j]:.5f}, reference {want.logprobs[j]:.5f} "
                    f"(|diff| {diff:.2e} > atol {accuracy.logprob_atol:.0e})"
                )
                break
    return reasons, worst


def _greedy(engine: RolloutEngine, prompts: Sequence[TokenIds], accuracy: AccuracySpec) -> list[Completion]:
    return engine.generate(prompts, SamplingParams(max_new_tokens=accuracy.new_tokens, temperature=0.0))


# --------------------------------------------------------------------------------------------
# Check 1: engine


def check_engine(
    engine: RolloutEngine,
    reference_model: PreTrainedModel,
    accuracy: AccuracySpec,
    draw: CheckDraw = CheckDraw(),
) -> CheckResult:
    prompts = draw.prompts(accuracy.prompts, draw.engine_seed)
    references = reference_greedy(reference_model, prompts, accuracy.new_tokens)
    completions = _greedy(engine, prompts, accuracy)
    reasons, worst = compare_greedy(completions, references, accuracy)
    versions = {c.weight_version for c in completions}
    if versions - {engine.weight_version}:
        reasons.append(f"completions report weight versions {sorted(versions)}, engine is at {engine.weight_version}")
    details = {"prompts": len(prompts), "max_logprob_diff": worst, "seed": draw.engine_seed}
    return CheckResult("engine", not reasons, reasons, details)


# --------------------------------------------------------------------------------------------
# Check 2: trainer


def fixed_train_batches(
    model: PreTrainedModel, draw: CheckDraw = CheckDraw(), sizes: Sequence[int] = (8, 12), temperature: float = 1.0
) -> list[TrainBatch]:
    """Batches sampled from the model itself at ``temperature`` (the spec's: the behaviour logprobs are of
    the distribution drawn from) on ``draw``'s prompts, with seeded rewards and behaviour
    logprobs perturbed by N(0, 0.3) so that some ratios fall outside the clip range and clipping is
    exercised. Responses of 1 to 6 tokens (all of 6 left a token mean and a mean per trajectory alike),
    every other trajectory of two turns with an observation between them (a mask over all that follows
    the prompt passed)."""
    engine = ReferenceEngine(copy.deepcopy(model))
    seed = draw.trainer_seed
    rng = random.Random(seed)
    batches = []
    for b, size in enumerate(sizes):
        prompts = draw.prompts(size, seed + b)
        completions = engine.generate(prompts, SamplingParams(6, temperature, seed + b))
        turns = [(prompt, c.tokens[: rng.randint(1, 6)], c.logprobs) for prompt, c in zip(prompts, completions)]
        contexts = [prompt + first + prompt[:3] for k, (prompt, first, _) in enumerate(turns) if k % 2]
        seconds = iter(engine.generate(contexts, SamplingParams(4, temperature, seed + b)))
        trajectories = []
        for k, (prompt, first, logprobs) in enumerate(turns):
            tokens, mask, behaviour = prompt + first, [0] * len(prompt) + [1] * len(first), [0.0] * len(prompt)
            behaviour += [lp + rng.gauss(0.0, 0.3) for lp in logprobs[: len(first)]]
            if k % 2:  # the observation (the prompt's first tokens, masked), then a second response
                second = next(seconds)
                tokens += prompt[:3] + second.tokens
                mask += [0] * len(prompt[:3]) + [1] * len(second.tokens)
                behaviour += [0.0] * len(prompt[:3]) + [lp + rng.gauss(0.0, 0.3) for lp in second.logprobs]
            trajectories.append(
                Trajectory(
                    episode_id=f"b{b}/t{k}",
                    group_id=f"b{b}/g{k // 4}",
                    tokens=tokens,
                    loss_mask=mask,
                    logprobs=behaviour,
                    reward=rng.random(),
                    weight_versions=[0],
                )
            )
        batches.append(TrainBatch(trajectories, group_advantages(trajectories)))
    return batches


CLIP_SPAN = 3.0  # the first step's gradient norm this many times under max_grad_norm, the last's as many over


def straddling_the_clip(
    batches: Sequence[TrainBatch], model: PreTrainedModel, config: TrainingConfig
) -> list[TrainBatch]:
    """``batches`` with the first one's advantages scaled so that the reference's gradient norm is a third
    of ``max_grad_norm`` and the last one's three times it. AdamW's step is blind to a gradient's scale
    unless clipping touches one step and not another: with both clipped (the drawn batches' norms were 3.9
    and 4.6 over a max of 1), a loss 100x too large, summed where it should be averaged, or never clipped
    passed check 2 (found by a review of the reference). The policy loss is linear in the advantages, so
    the scale is read from one probe of each batch's gradient at lr 0 (which never leaves the KL anchor,
    where a KL term's gradient is 0)."""
    probe = ReferenceTrainer(copy.deepcopy(model).float(), replace(config, lr=0.0))
    out = list(batches)
    for index, target in ((0, 1 / CLIP_SPAN), (len(out) - 1, CLIP_SPAN)):
        probe.train_step(out[index])
        if not probe.last_grad_norm > 0:
            raise RuntimeError("a fixed batch has no gradient (its advantages are all 0): it cannot test a trainer")
        factor = target * config.max_grad_norm / probe.last_grad_norm
        out[index] = TrainBatch(out[index].trajectories, [a * factor for a in out[index].advantages])
    return out


MakeTrainer = Callable[[StateDict, TrainingConfig], Trainer]


def _exported(trainer: Trainer, initial: StateDict) -> tuple[dict[str, torch.Tensor], str]:
    """The trainer's weights under ``initial``'s names, copied to the CPU (a trainer may export its live
    tensors), and what is wrong with them ('' when nothing; then no weights): a name its state_dict lacks,
    or a tensor not of the model's shape (compared anyway, it would be broadcast)."""
    exported = trainer.state_dict()
    missing = sorted(set(initial) - set(exported))
    if missing:
        return {}, f"trainer state_dict lacks parameters {missing[:5]}"
    for name, tensor in initial.items():
        if tuple(exported[name].shape) != tuple(tensor.shape):
            shape, want = tuple(exported[name].shape), tuple(tensor.shape)
            return {}, f"trainer state_dict gives {name} the shape {shape}, not the model's {want}"
    return {k: exported[k].detach().to("cpu", copy=True) for k in initial}, ""


def check_trainer(
    make_trainer: MakeTrainer,
    base_model: PreTrainedModel,
    config: TrainingConfig,
    accuracy: AccuracySpec,
    batches: Sequence[TrainBatch] | None = None,
) -> CheckResult:
    """Two steps, because AdamW's first step is ~lr*sign(grad): one step alone would hide a wrong
    loss scale or missing gradient clipping; the second step's update depends on their ratio. Judged
    over both at once, the pull (``update_error.py``) on the last batch: a bf16 trainer's first step alone
    is ~1.5x as far off as the two together (0.119 against 0.080 on tiny-qwen3-cpu in bf16), and the 0.6B
    target's bound is set on the two (0.164 on an H100). The training replay judges a system run's steps
    one by one. The first step's own figures are recorded, not judged (``step_1_*`` in the details): what
    judging check 2 step by step would have to allow, measured on each card the check runs on."""
    batches = list(batches) if batches is not None else fixed_train_batches(base_model, temperature=config.temperature)
    if len(batches) > 1:  # (at the anchor a KL term's gradient is 0: the probe reads the policy loss alone)
        batches = straddling_the_clip(batches, base_model, config)
    initial = {k: v.detach().cpu().clone() for k, v in base_model.state_dict().items()}
    reference = ReferenceTrainer(copy.deepcopy(base_model).float(), config)  # float32 masters, as a trainer keeps
    candidate = make_trainer({k: v.clone() for k, v in initial.items()}, config)
    reasons: list[str] = []
    coast: StateDict = initial
    first: UpdateError | None = None
    for step, batch in enumerate(batches, start=1):
        if step == 1 or step == len(batches):  # the pull judged is the last batch's; the first step's recorded
            coast = reference.coast()
        reference.train_step(batch)
        returned = candidate.train_step(batch)
        if returned != step or candidate.version != step:
            reasons.append(f"after step {step} the trainer returned version {returned} and reports {candidate.version}")
        if step == 1 < len(batches):
            after, wrong = _exported(candidate, initial)
            first = None if wrong else update_error(initial, after, reference.state_dict(), coast)
            del after
            coast = initial  # let go before the last step's coast is taken (each is a copy of the model)
    got, wrong = _exported(candidate, initial)
    if wrong:
        return CheckResult("trainer", False, [wrong], {})
    off = update_error(initial, got, reference.state_dict(), coast)
    if not off.reference_moved:
        raise RuntimeError("the reference trainer did not change the weights: the fixed batches cannot test a trainer")
    fault = step_fault(off, accuracy.update_rtol, "the reference trainer's update over two steps")
    if fault is not None:
        reasons.append(fault)
    details = {
        "relative_update_error": off.relative,
        "worst_tensor": off.worst_tensor,
        "worst_tensor_error": off.worst_relative,
        "least_following_tensor": off.least_following,
        "least_followed": off.least_followed,
        "least_followed_matrix": off.least_followed_matrix,
        "steps": len(batches),
    }
    if first is not None:
        details |= {
            "step_1_relative_update_error": first.relative,
            "step_1_worst_tensor_error": first.worst_relative,
            "step_1_least_followed": first.least_followed,
        }
    return CheckResult("trainer", not reasons, reasons, details)


# --------------------------------------------------------------------------------------------
# Check 3: weight sync


def perturbed_state(state: StateDict, seed: int = 99, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """A new weight version clearly different from ``state`` (seeded Gaussian noise per tensor).
    Tied tensors (the embedding and the head) stay tied: one perturbation for both names, so the
    state means the same whatever order a receiver applies it in."""
    generator = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    for name, tensor in state.items():
        if tensor.data_ptr() in seen:
            out[name] = out[seen[tensor.data_ptr()]]
            continue
        seen[tensor.data_ptr()] = name
        tensor = tensor.detach().cpu()
        spread = float(tensor.float().std()) if tensor.numel() > 1 else 0.0
        spread = spread or float(tensor.float().abs().mean()) or 1.0
        noise = torch.randn(tensor.shape, generator=generator) * scale * spread
        out[name] = (tensor.float() + noise).to(tensor.dtype)
    return out


PERTURBATION_TRIES = 8


@dataclass
class DistinctVersion:
    """Check 3's new weights and what greedy decoding gives under them and under the base."""

    state: dict[str, torch.Tensor]
    want_new: list[GreedyReference]
    want_old: list[GreedyReference]
    seed: int


def distinct_version(
    base_model: PreTrainedModel, prompts: Sequence[TokenIds], accuracy: AccuracySpec, first_seed: int
) -> DistinctVersion:
    """Perturbed weights whose outputs on ``prompts`` the comparison tells from the base's: a stale
    engine must fail the check. A small model's first tokens can all fall within the near-tie margin
    under one perturbation (1 draw in 100 on the 64-id MoE proxy), so the next seed is tried."""
    want_old = reference_greedy(base_model, prompts, accuracy.new_tokens)
    as_served = [Completion(w.tokens, w.logprobs, "length", 0) for w in want_old]
    for seed in range(first_seed, first_seed + PERTURBATION_TRIES):
        state = perturbed_state(base_model.state_dict(), seed % 2**63)
        new_model = copy.deepcopy(base_model)
        new_model.load_state_dict(state)
        want_new = reference_greedy(new_model, prompts, accuracy.new_tokens)
        if compare_greedy(as_served, want_new, accuracy)[0]:
            return DistinctVersion(state, want_new, want_old, seed % 2**63)
    raise RuntimeError(
        f"none of {PERTURBATION_TRIES} perturbations of the weights (seeds from {first_seed}) gives outputs the "
        "comparison tells from the base's: the sync check cannot discriminate"
    )


def check_weight_sync(
    engine: RolloutEngine,
    sync: Callable[[StateDict, int], None],
    base_model: PreTrainedModel,
    accuracy: AccuracySpec,
    version: int = 1,
    draw: CheckDraw = CheckDraw(),
) -> CheckResult:
    """``sync(state, version)`` pushes weights by the stack's own path; the engine must then serve them.

    The engine must start on ``base_model``'s weights (version 0).
    """
    prompts = draw.prompts(accuracy.prompts, draw.sync_seed)
    new = distinct_version(base_model, prompts, accuracy, draw.perturbation_seed)
    new_state, want_new, want_old = new.state, new.want_new, new.want_old

    sync(new_state, version)
    reasons: list[str] = []
    if engine.weight_version != version:
        reasons.append(f"engine reports weight version {engine.weight_version} after sync of version {version}")
    completions = _greedy(engine, prompts, accuracy)
    mismatch, worst = compare_greedy(completions, want_new, accuracy)
    if mismatch:
        stale, _ = compare_greedy(completions, want_old, accuracy)
        if not stale:
            reasons.append(f"engine still serves the previous weights after sync of version {version} (stale weights)")
        reasons.extend(mismatch)
    stamped = {c.weight_version for c in completions}
    if stamped != {version}:
        reasons.append(f"completions after sync are stamped with versions {sorted(stamped)}, expected {version}")
    details = {"version": version, "max_logprob_diff": worst, "seed": draw.sync_seed, "perturbation_seed": new.seed}
    return CheckResult("weight_sync", not reasons, reasons, details)
