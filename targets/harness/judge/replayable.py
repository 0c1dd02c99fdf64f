"""What the replay may read: every token prompted, generated or trained on is an id of the model's vocabulary,
and no sequence is longer than the target allows. A turn's context (its prompt and the tokens it returned)
fits the workload's ``max_sequence`` (an honest stack drops an episode whose next turn would not fit), and a
trained trajectory, its last turn's context and the environment's last answer, twice that. Where a record
breaks either, the replay is skipped: it could not embed the token, or would hold the logits of a sequence the
candidate chose the length of (a hundred thousand tokens of a 150k vocabulary is 60 GB), and a crash of the
audit would be blamed on the harness instead of judging the candidate. The record is a reason either way."""

from __future__ import annotations

from targets.harness.judge.trace_index import Reasons, TraceIndex
from targets.spec import TargetSpec

TRAJECTORY_SEQUENCES = 2  # a trained trajectory's bound, in max_sequence: its last context and its last answer


def check_replayable(ix: TraceIndex, r: Reasons, spec: TargetSpec) -> bool:
    """True when every record is within the vocabulary and its bound (a simulated run records counts: True)."""
    if not ix.tokens_recorded:
        return True
    vocab, longest = spec.model.config.vocab_size, spec.workload.tokens.max_sequence
    recorded = [
        (
            f"{'interrupted generate' if g.data['aborted'] else 'generate'} (episode {g.data['episode']} "
            f"turn {g.data['turn']})",
            g.data["prompt"] + g.data["tokens"],
            longest,
        )
        for gs in [*ix.generated.values(), *ix.partials.values()]
        for g in gs
    ]
    recorded += [
        (f"training step {k} (episode {t['episode']})", t["tokens"], TRAJECTORY_SEQUENCES * longest)
        for k, train in enumerate(ix.trains, start=1)
        for t in train.data["trajectories"]
    ]
    clean = True
    for what, tokens, bound in recorded:
        if len(tokens) > bound:
            clean = False
            r.add("sequence too long", f"{what}: {len(tokens)} tokens, over the {bound} the target allows")
            continue
        outside = [t for t in tokens if not 0 <= t < vocab]
        if outside:
            clean = False
            r.add(
                "token outside the vocabulary",
                f"{what}: token id {outside[0]} is not in the model's vocabulary of {vocab}",
            )
    return clean
