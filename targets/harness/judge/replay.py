"""The audit's replays: what really ran, recomputed by the reference from the harness's own weight
snapshots (never from a candidate's word).

* Turns: each generated turn (and each interrupted segment, which a resumed turn may keep) is
  teacher-forced through the reference model under the weights of the version the engine claimed;
  its logprobs must match. Every turn is replayed when that costs under ``REPLAY_ALL_FLOPS``;
  otherwise ``SAMPLED_TURNS`` turns drawn at random, enough that an engine claiming the wrong version
  on 1% of turns is caught with probability at least 0.99:
  P(miss) = 0.99^n <= 0.01  <=>  n >= ln(0.01) / ln(0.99) = 458.2, so n = 459.
  Finished turns and interrupted segments are drawn apart, ``SAMPLED_TURNS`` of each: a stack that
  interrupts often would otherwise fill one draw with its own short segments, and the bound would
  hold for neither. Each drawn turn brings the segments it resumes (a prefix of its own sequence, so
  little more to replay), for the independence test's runs to go on across them.
* Sampling: which tokens were drawn, tested on the replayed distributions
  (``sampling_tests.py``: temperature, ranks, stop and echo calibration, independence), each with an
  exact false-alarm bound.
* Training: every step is recomputed by the reference GRPO trainer, in float32 whatever the model's
  dtype, from the snapshot before it, on the exact batch the harness forwarded, with the reference's
  own AdamW state carried along; the update must match the snapshot after it within the target's
  ``update_rtol``, and no tensor the reference moves may be left behind (``update_error.py``; as in
  check 2).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from targets.api import StateDict, TraceEvent, TrainBatch, Trajectory
from targets.harness.judge.sampling_tests import FALSE_ALARM, Draw, SamplingTests, Segment, plan_guesses
from targets.harness.judge.update_error import step_fault, update_error
from targets.harness.reference.grpo import drawn_log_softmax

if TYPE_CHECKING:
    from targets.harness.judge.trace_index import Reasons, TraceIndex
    from targets.spec import TargetSpec

log = logging.getLogger("vibetrain.audit")

REPLAY_ALL_FLOPS = 4e12
SAMPLED_TURNS = math.ceil(math.log(0.01) / math.log(0.99))  # 459
POSITIONS_PER_CHUNK = 2048  # logits of at most this many positions at once (vocabularies are large)
BATCH_TOKENS = 8192  # padded tokens of one replay forward pass: short turns share a pass, not one each


def _covering_sequences(gens: list[TraceEvent]) -> list[tuple[list[int], list[TraceEvent]]]:
    """Turns of one episode under one version share a context: each (prompt + tokens) that is a
    prefix of a longer one rides along in the longer one's forward pass."""
    chosen: list[tuple[list[int], list[TraceEvent]]] = []
    for g in sorted(gens, key=lambda g: -(len(g.data["prompt"]) + len(g.data["tokens"]))):
        sequence = g.data["prompt"] + g.data["tokens"]
        for tokens, riders in chosen:
            if len(sequence) <= len(tokens) and tokens[: len(sequence)] == sequence:
                riders.append(g)
                break
        else:
            chosen.append((sequence, [g]))
    return chosen


def _forward_batches(
    sequences: list[tuple[list[int], list[TraceEvent]]],
) -> list[list[tuple[list[int], list[TraceEvent]]]]:
    """The covering sequences in forward passes of at most ``BATCH_TOKENS`` padded tokens (one longer
    sequence alone), longest first so that each batch pads little."""
    batches: list[list[tuple[list[int], list[TraceEvent]]]] = []
    for item in sorted(sequences, key=lambda s: -len(s[0])):
        if batches and len(batches[-1][0][0]) * (len(batches[-1]) + 1) <= BATCH_TOKENS:
            batches[-1].append(item)
        else:
            batches.append([item])
    return batches


@torch.no_grad()
def _hidden_states(model: torch.nn.Module, sequences: list[list[int]]) -> torch.Tensor:
    """The decoder's last hidden states of ``sequences`` in one forward pass, padded on the right: the
    attention is causal, so the padding after a sequence changes none of its positions."""
    device = next(model.parameters()).device
    ids = torch.zeros(len(sequences), max(map(len, sequences)), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence)
    return model.get_decoder()(input_ids=ids.to(device), use_cache=False).last_hidden_state  # no KV cache kept


@torch.no_grad()
def _position_logits(model: torch.nn.Module, hidden: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """Logits (float32) predicting the token after each of ``positions`` of one sequence's hidden states."""
    head = model.get_output_embeddings()
    index = torch.tensor(positions, device=hidden.device)
    return torch.cat(
        [
            head(hidden[index[i : i + POSITIONS_PER_CHUNK]]).float()
            for i in range(0, len(positions), POSITIONS_PER_CHUNK)
        ]
    )


def _rider_logits(
    model: torch.nn.Module, batch: list[tuple[list[int], list[TraceEvent]]]
) -> Iterator[tuple[TraceEvent, torch.Tensor, torch.Tensor]]:
    """Each turn of one forward pass, with the logits predicting its tokens and the tokens chosen."""
    hidden = _hidden_states(model, [sequence for sequence, _ in batch])
    for row, (_, riders) in enumerate(batch):
        positions = [len(g.data["prompt"]) - 1 + i for g in riders for i in range(len(g.data["tokens"]))]
        logits = _position_logits(model, hidden[row], positions)
        at = 0
        for g in riders:
            n = len(g.data["tokens"])
            yield g, logits[at : at + n], torch.tensor(g.data["tokens"], device=logits.device)
            at += n


@dataclass(frozen=True)
class VersionSeparation:
    """How far version v's logprobs lie from v-1's on the turns of v's first replayed pass, and how far
    the engine's recorded logprobs lie from each. When the two versions are closer than the replay's
    tolerance (a small step: lr 1e-6 in bf16), an engine that served v-1 and claimed v would pass the
    replay: this says whether the run's replay could tell (recorded, not judged)."""

    version: int
    tokens: int
    max_separation: float  # max |logprob under v - logprob under v-1|
    mean_to_claimed: float  # mean |recorded - logprob under v|
    mean_to_previous: float  # mean |recorded - logprob under v-1|

    def apart(self, atol: float) -> bool:
        return self.max_separation > atol


def _chosen_logprobs(rows: torch.Tensor, chosen: torch.Tensor, temperature: float) -> torch.Tensor:
    """The logprob of each chosen token under the distribution it was drawn from (``drawn_log_softmax``)."""
    return drawn_log_softmax(rows, temperature).gather(-1, chosen[:, None]).squeeze(-1)


def pass_logprobs(model: torch.nn.Module, batch: list[tuple[list[int], list[TraceEvent]]]) -> list[torch.Tensor]:
    """The chosen tokens' logprobs of each turn of one forward pass, in ``_rider_logits``'s order."""
    return [
        _chosen_logprobs(rows, chosen, g.data.get("temperature", 0.0)).cpu()
        for g, rows, chosen in _rider_logits(model, batch)
    ]


def version_separation(
    version: int,
    batch: list[tuple[list[int], list[TraceEvent]]],
    claimed: list[torch.Tensor],
    previous: list[torch.Tensor],
) -> VersionSeparation:
    """``claimed``, ``previous``: the logprobs of ``batch``'s turns under ``version`` and the one before,
    in ``_rider_logits``'s order."""
    recorded = [torch.tensor(g.data["logprobs"]) for _, riders in batch for g in riders]
    v, before, seen = (torch.cat(x).double() for x in (claimed, previous, recorded))
    return VersionSeparation(
        version,
        len(v),
        float((v - before).abs().max()),
        float((seen - v).abs().mean()),
        float((seen - before).abs().mean()),
    )


def _draw(ix: TraceIndex, g: TraceEvent) -> Draw:
    """``g`` as the independence test reads it; its line, the response it continues (its first segment's),
    or with a seed of the stack's its turn's (a seeded restart draws its attempt's noise again: not apart)."""
    d = g.data
    carried = d["prompt"][len(d["prompt"]) - d.get("continues", 0) :]
    seeded = d.get("seed") is not None
    line = ("seeded", d["episode"], d["turn"]) if seeded else id(ix.response(g).first)
    return Draw(d["start"], line, tuple(carried), tuple(d["tokens"]), frozenset(d.get("stop", ())))


def _segment(ix: TraceIndex, g: TraceEvent) -> Segment:
    """Where ``g``'s tokens sit in its turn's whole response, after the segments it resumes."""
    whole = ix.response(g)
    return Segment(key=id(g), after=tuple(map(id, whole.segments[:-1])), at=len(whole.tokens) - len(g.data["tokens"]))


def replay_turns(
    ix: TraceIndex,
    r: Reasons,
    spec: TargetSpec,
    load_weights: Callable[[int], StateDict | None],
    make_model: Callable[[StateDict], torch.nn.Module],
    seed: int = 0,
) -> dict:
    finished = [g for gs in ix.generated.values() for g in gs if g.data["tokens"]]
    cut = [g for gs in ix.partials.values() for g in gs if g.data["tokens"]]  # interrupted segments
    turns = finished + cut
    tokens = sum(len(g.data["prompt"]) + len(g.data["tokens"]) for g in turns)
    if 2 * spec.model.param_counts().active * tokens <= REPLAY_ALL_FLOPS:
        sample, coverage = turns, f"all {len(turns)} turns"
    else:  # each pool its own draw: interruptions, as many as the stack makes, cannot thin the finished turns'
        draw = random.Random(seed)
        whole, parts = (draw.sample(pool, min(SAMPLED_TURNS, len(pool))) for pool in (finished, cut))
        drawn_ids = {id(g) for g in whole + parts}  # and the segments each resumes, for its runs of guesses
        before = [s for g in whole + parts for s in ix.response(g).segments[:-1] if s.data["tokens"]]
        sample = whole + parts + [s for s in {id(s): s for s in before}.values() if id(s) not in drawn_ids]
        coverage = f"{len(whole)} of {len(finished)} turns and {len(parts)} of {len(cut)} interrupted segments"
        coverage += f", drawn at random (seed {seed})"
        if len(sample) > len(whole) + len(parts):
            coverage += f", and the {len(sample) - len(whole) - len(parts)} segments they resume"
    by_version: dict[int, dict[str, list[TraceEvent]]] = defaultdict(lambda: defaultdict(list))
    for g in sample:
        by_version[g.data["version"]][g.data["episode"]].append(g)
    worst, tests = 0.0, SamplingTests(spec.accuracy.logprob_atol, seed)
    # the independence test guesses each replayed turn's tokens from every earlier turn's, replayed or not
    drawn = [g for g in turns if g.data.get("temperature", 0.0) > 0]
    replayed = {id(g) for g in sample}
    planned = plan_guesses([_draw(ix, g) for g in drawn], {k for k, g in enumerate(drawn) if id(g) in replayed})
    guesses = {id(drawn[k]): made for k, made in planned.items()}
    log.info("replaying %s", coverage)
    separations: list[VersionSeparation] = []
    passes = {
        version: _forward_batches([c for gens in episodes.values() for c in _covering_sequences(gens)])
        for version, episodes in by_version.items()
    }
    earlier: dict[int, list[torch.Tensor]] = {}  # a version's first pass under the version before, run under it
    for version in sorted(by_version):
        started = time.monotonic()
        state = load_weights(version)
        if state is None:
            r.add("replay", f"no weights recorded for version {version}")
            continue
        model = make_model(state)
        loaded = time.monotonic()
        episodes, batches = by_version[version], passes[version]
        claimed: list[torch.Tensor] = []  # the first pass's logprobs, for the separation from the version before
        for done, batch in enumerate(batches, start=1):
            if done % 8 == 0:
                log.info("version %d: %d of %d forward passes replayed", version, done, len(batches))
            for g, rows, chosen in _rider_logits(model, batch):
                actual = _chosen_logprobs(rows, chosen, g.data.get("temperature", 0.0))
                if done == 1:
                    claimed.append(actual.cpu())
                diff = (actual - torch.tensor(g.data["logprobs"], device=rows.device)).abs()
                worst = max(worst, float(diff.max()))
                if not float(diff.max()) <= spec.accuracy.logprob_atol:  # a NaN is over any bound
                    i = int(diff.argmax())
                    r.add(
                        "replay",
                        f"episode {g.data['episode']} turn {g.data['turn']}: logprob {g.data['logprobs'][i]:.4f} but "
                        f"the model under version {version} gives {float(actual[i]):.4f}: it did not run with "
                        "those weights",
                    )
                temperature = g.data.get("temperature", 0.0)
                if temperature > 0:
                    stops, echoes = g.data.get("stop", []), ix.latest_observation(g)
                    tests.add(rows, chosen, temperature, stops, echoes, guesses.get(id(g), ()), _segment(ix, g))
        log.info(
            "version %d: %d episodes replayed in %.1f s (weights loaded in %.1f s)",
            version,
            len(episodes),
            time.monotonic() - loaded,
            loaded - started,
        )
        if version + 1 in passes:  # while this version's model is here: no second load of it
            earlier[version + 1] = pass_logprobs(model, passes[version + 1][0])
        del model  # before the version before is loaded (a version whose own turns were not replayed)
        if version not in earlier and version > 0 and (previous := load_weights(version - 1)) is not None:
            earlier[version] = pass_logprobs(make_model(previous), batches[0])
        if version in earlier:
            separations.append(version_separation(version, batches[0], claimed, earlier.pop(version)))
    details = {
        "replay_coverage": coverage,
        "replayed_turns": len(sample),
        "max_replay_logprob_diff": worst,
        "sampled_tokens": tests.temperature.tokens,
        "independence_guesses": sum(len(made) for made in planned.values()),
        "temperature_z": tests.temperature.z,
        "version_separation": [asdict(s) for s in separations],
        "versions_the_replay_tells_apart": f"{sum(s.apart(spec.accuracy.logprob_atol) for s in separations)} "
        f"of {len(separations)}",
    }
    for name, bound, seen in tests.results():
        details[f"{name.replace(' ', '_')}_false_alarm_bound"] = bound
        if bound < FALSE_ALARM:
            r.add(
                name,
                f"{seen}: an engine that samples at the spec's temperature "
                f"{spec.workload.training.temperature} from the claimed weights deviates this far with "
                f"probability at most {bound:.1e}, under {FALSE_ALARM:g}",
            )
    return details


def recorded_batch(train: dict) -> TrainBatch:
    """The batch a train call carried, as the harness recorded it (a ``train`` event's data)."""
    return TrainBatch(
        [
            Trajectory(t["episode"], t["group"], t["tokens"], t["loss_mask"], t["logprobs"], t["reward"], [])
            for t in train["trajectories"]
        ],
        list(train["advantages"]),
    )


def replay_training(
    ix: TraceIndex,
    r: Reasons,
    spec: TargetSpec,
    load_weights: Callable[[int], StateDict | None],
    make_model: Callable[[StateDict], torch.nn.Module],
) -> dict:
    from targets.harness.reference.trainer import ReferenceTrainer

    initial = load_weights(0)
    if initial is None:
        r.add("training replay", "no weights recorded for version 0")
        return {}
    # float32 whatever the model's dtype: a trainer keeps float32 masters (as in check 2), and a bf16
    # AdamW step at a small learning rate would not move bf16 weights at all. Every snapshot after
    # version 0 is the harness's float32 copy of those masters, loaded into float32 parameters exactly.
    trainer = ReferenceTrainer(make_model(initial).float(), spec.workload.training.config())
    before, errors, tensor_errors, reference_moved = initial, [], [], False
    followed, followed_matrices = [], []
    for k, train in enumerate(ix.trains, start=1):
        started = time.monotonic()
        after = load_weights(k)
        if after is None:
            r.add("training replay", f"no weights recorded after training step {k}")
            break
        trainer.load_state_dict(before)
        coast = trainer.coast()
        try:  # a batch the reference step refuses (a response token first) is named, not a crash
            trainer.train_step(recorded_batch(train.data))
        except ValueError as error:
            r.add("training replay", f"step {k}: the recorded batch cannot be replayed ({error})")
            break
        stepped = time.monotonic()
        off = update_error(before, after, trainer.state_dict(), coast)
        log.info(
            "training step %d replayed: %.1f s loading and stepping, %.1f s comparing (relative error %.3g, "
            "worst tensor %s %.3g, least following %s %.3g)",
            k,
            stepped - started,
            time.monotonic() - stepped,
            off.relative,
            off.worst_tensor,
            off.worst_relative,
            off.least_following,
            off.least_followed,
        )
        reference_moved = reference_moved or off.reference_moved
        errors.append(off.relative)
        tensor_errors.append(off.worst_relative)
        followed.append(off.least_followed)
        followed_matrices.append(off.least_followed_matrix)
        fault = step_fault(off, spec.accuracy.update_rtol, "the reference GRPO step on the batch the harness saw")
        if fault is not None:
            r.add("training replay", f"step {k}: {fault}")
        before = after
    # Unchanged weights are a reason only where the reference step moves them: a batch whose rewards are
    # all equal (a random model scoring 0 on a real task) has zero advantages, and an honest step then
    # leaves the weights where they were (the replay holds a trainer that moves them anyway).
    last = load_weights(len(ix.trains)) if ix.trains else None
    if reference_moved and last is not None and all(torch.equal(initial[k], last[k]) for k in initial):
        r.add("weights unchanged", f"training did not change the weights (version {len(ix.trains)} equals version 0)")
    return {
        "training_replay_steps": len(errors),
        "training_replay_max_error": max(errors, default=0.0),
        "training_replay_worst_tensor_error": max(tensor_errors, default=0.0),
        "training_replay_least_followed": min(followed, default=1.0),
        "training_replay_least_followed_matrix": min(followed_matrices, default=1.0),
    }
