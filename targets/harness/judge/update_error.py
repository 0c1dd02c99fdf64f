"""How far a trainer's update is from the reference's, for check 2 and the training replay: relative L2
over all the weights, and each tensor's own.

The whole-model figure is bounded by the target's ``update_rtol``, which a bf16 trainer's honest error
needs loose (0.164 measured on the 0.6B target, bound 0.25: ``targets/catalog/qwen3-0.6b-h100x1.yaml``).
Under it, a trainer could leave a few whole tensors untrained (one decoder layer of the 0.6B model is
2.6% of its weights, sqrt(0.164^2 + 0.026) = 0.23) and save their weight gradients. A tensor left where it
was is off by exactly 1 relative to the reference's update of it, whatever its share, so no tensor the
reference moves may be off by ``TENSOR_LEFT_BEHIND``: honest bf16 trainers' worst tensors sit far under
it (a q_norm at 0.305 on the 0.6B target on an H100; a layernorm of 128 weights at 0.295 for tiny-qwen3-cpu
computed in bf16 over float32 masters at lr 1e-6 on CPU, where the whole model was 0.117:
``benchmarks/bf16_update_error.py``).

A tensor can also pass that bound without following the batch: AdamW moves a tensor by its momentum even
where a step's gradient is zero, so a trainer that skips some tensors' weight gradients on a step and
lets momentum carry them is 0.80-0.88 off on that step (tiny-qwen3-cpu in bf16), under 0.9; only carried
on for steps does it drift past. What the batch itself adds is the reference's step less its ``coast``
(the same step on zero gradients: ``ReferenceTrainer.coast``); each tensor's update, less the coast,
must carry a share of that pull (its projection onto it; its bound below). Honest bf16 trainers carried
0.91-1.0 of it over six steps at lr 1e-6 and 1e-4; a tensor momentum carried, 0-0.04 on its first such
step (``benchmarks/bf16_update_error.py --coast``). A matrix's share counts no row and no column past
its own pull, an overshoot counted as a shortfall (``carried``): otherwise a trainer could let momentum
carry most of its rows and stretch the rest, and the stretched rows would make up what the coasting ones
leave (70% of a matrix's rows coasted, the rest moved twice as far: 0.6 carried in one projection, 0.3
counted row by row). Honest bf16 trainers' rows and columns each carried 0.906-1.0 of their own pull,
and each matrix, its rows' noise averaged, 0.989-0.997; so a matrix must carry ``MATRIX_FOLLOWS_BATCH``
of its pull, a vector (a norm's weights, whose gradient costs nothing worth skipping)
``TENSOR_FOLLOWS_BATCH``. On a GPU: AdamW's first step is ~lr x sign(gradient), so bf16 flipping a share
p of the signs reads 2 sqrt(p) off and 1 - 2p carried; the worst honest tensor measured on an H100 (a
q_norm, 0.305 off) would carry ~0.95. Not measured on a card yet: a matrix's share there (check 2's
``least_followed_matrix``, the replay's ``training_replay_least_followed_matrix``, recorded on every
run). An MoE layer's experts are judged as one stack, never one expert alone: bf16 routes some tokens to
other experts than float32 does, so an honest expert can carry nothing of its own pull (0.0 and -6 of
it, at 1-3% of its stack's), while each stack carried 0.92-0.995 and each router 0.86-0.99 (a tiny
Qwen3 MoE of 8-128 experts in bf16 on CPU, ``--moe``; no MoE on a card yet). A block of a matrix left
to momentum reads one less its share of the pull: half the rows by half the columns, 0.75, which a
vector's bound would pass. The pull is judged only where it is at least
``PULL_JUDGED_SHARE`` of the reference's update of the tensor: an honest trainer's momentum is not the
replay's (its gradients were bf16), and on a step of weak gradients (advantages 1e-2 of the usual) that
difference tilted an honest tensor's projection to 0.55, at 1e-4 to -1.2, with the pull 7% and 0.1% of
the update. A tensor that coasts where its pull is under a quarter of its update is that little off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from targets.api import StateDict

TENSOR_LEFT_BEHIND = 0.9  # a tensor's relative update error at which it counts as untrained (frozen: 1)
TENSOR_FOLLOWS_BATCH = 0.5  # the least share of the batch's pull a vector's update must carry (a norm's weights)
MATRIX_FOLLOWS_BATCH = 0.8  # a matrix's, counted row by row and column by column (``carried``)
PULL_JUDGED_SHARE = 0.25  # a pull under this share of the reference's update of the tensor is not judged


def follows_bound(dims: int) -> float:
    """The least share of the batch's pull a tensor of ``dims`` dimensions must carry."""
    return MATRIX_FOLLOWS_BATCH if dims >= 2 else TENSOR_FOLLOWS_BATCH


def tensor_bound(update_rtol: float) -> float:
    """Each tensor's bound: ``TENSOR_LEFT_BEHIND``, or the whole model's where that is looser."""
    return max(TENSOR_LEFT_BEHIND, update_rtol)


@dataclass(frozen=True)
class UpdateError:
    relative: float  # the whole update's, relative to the reference's (inf: the reference did not move)
    tensors: dict[str, float]  # each tensor the reference moved: its own relative error
    followed: dict[str, float]  # each tensor the batch pulls (``PULL_JUDGED_SHARE``): the share carried (``carried``)
    follow_bounds: dict[str, float]  # each of those tensors' least share (``follows_bound``)
    matrices: frozenset[str]  # of those, the tensors of two dimensions or more
    reference_moved: bool
    candidate_moved: bool

    @property
    def worst_tensor(self) -> str:
        """Of the tensors the reference moved, the one furthest off (a NaN furthest; "" if none)."""
        return max(self.tensors, key=lambda n: math.inf if math.isnan(self.tensors[n]) else self.tensors[n], default="")

    @property
    def worst_relative(self) -> float:
        return self.tensors.get(self.worst_tensor, 0.0)

    def left_behind(self, update_rtol: float) -> bool:
        return not self.worst_relative < tensor_bound(update_rtol)  # a NaN is no match

    @property
    def least_following(self) -> str:
        """Of the tensors the batch pulls, the one whose update carries least of it (a NaN least)."""
        return min(self.followed, key=lambda n: _nan_least(self.followed[n]), default="")

    @property
    def least_followed(self) -> float:
        return self.followed.get(self.least_following, 1.0)

    @property
    def least_followed_matrix(self) -> float:
        """The least share any matrix carries (the figure ``MATRIX_FOLLOWS_BATCH`` is set against)."""
        shares = [f for n, f in self.followed.items() if n in self.matrices]
        return min(shares, key=_nan_least, default=1.0)

    @property
    def furthest_behind(self) -> str:
        """Of the tensors the batch pulls, the one whose share is least against its own bound (a NaN least):
        the one a verdict names."""
        return min(self.followed, key=lambda n: _nan_least(self.followed[n]) - self.follow_bounds[n], default="")

    def ignored_batch(self) -> bool:
        name = self.furthest_behind
        return bool(name) and not self.followed[name] >= self.follow_bounds[name]  # a NaN is no match


def _nan_least(share: float) -> float:
    return -math.inf if math.isnan(share) else share


def update_error(start: StateDict, got: StateDict, want: StateDict, coast: StateDict) -> UpdateError:
    """``got`` (the candidate's weights after the step) against ``want`` (the reference's), both from
    ``start``, with ``coast`` where the reference's last step would have left them on zero gradients;
    compared in float64 on the CPU."""
    err_sq = ref_sq = cand_sq = 0.0
    tensors: dict[str, float] = {}
    followed: dict[str, float] = {}
    follow_bounds: dict[str, float] = {}
    for name, before in start.items():
        origin, coasted = before.double().cpu(), coast[name].double().cpu()
        reached, wanted = got[name].double().cpu(), want[name].double().cpu()
        d_ref, d_cand = wanted - origin, reached - origin
        err, ref = float((d_cand - d_ref).norm()), float(d_ref.norm())
        err_sq, ref_sq, cand_sq = err_sq + err**2, ref_sq + ref**2, cand_sq + float(d_cand.norm()) ** 2
        if ref > 0:
            tensors[name] = err / ref
        pull = wanted - coasted
        pulled = float((pull * pull).sum())
        if pulled > 0 and math.sqrt(pulled) >= PULL_JUDGED_SHARE * ref:
            followed[name] = carried(reached - coasted, pull)
            follow_bounds[name] = follows_bound(pull.dim())
    if ref_sq == 0:
        relative = 0.0 if cand_sq == 0 else math.inf
    else:
        relative = math.sqrt(err_sq / ref_sq)
    moved = cand_sq != 0  # NaN weights moved (to NaN)
    matrices = frozenset(n for n in followed if start[n].dim() >= 2)
    return UpdateError(relative, tensors, followed, follow_bounds, matrices, ref_sq > 0, moved)


def carried(moved: torch.Tensor, pull: torch.Tensor) -> float:
    """The share of ``pull`` that ``moved`` carries: for a vector, its projection onto it; for a matrix,
    the lesser of that share counted row by row and column by column, each row (or column) counted for
    its own pull less how far its projection misses it, overshoot included (``_carried_by_row``). A row
    is a unit of a trainer's weight-gradient work (one output feature), a column too (one input
    feature); a stack of matrices (an MoE layer's experts, ``[experts, out, in]``) is counted by each
    expert's rows and columns. Rows left at their coast and the rest stretched net out in one projection,
    not here."""
    if moved.dim() < 2:
        return float((moved * pull).sum()) / float((pull * pull).sum())
    by_rows = moved.reshape(-1, moved.shape[-1]), pull.reshape(-1, pull.shape[-1])
    by_columns = (t.transpose(-1, -2).reshape(-1, t.shape[-2]) for t in (moved, pull))
    return min(_carried_by_row(*by_rows), _carried_by_row(*by_columns))


def _carried_by_row(moved: torch.Tensor, pull: torch.Tensor) -> float:
    """Each row counts its own pull less how far its projection misses it: a row that falls short counts
    what it carries, a row that overshoots counts no more than one that falls as short (otherwise the rows
    beside a block left at its coast, stretched, would make up for it)."""
    own = (pull * pull).sum(dim=1)
    missed = ((moved * pull).sum(dim=1) - own).abs()
    return float((own - missed).sum()) / float(own.sum())  # a NaN stays NaN


def step_fault(off: UpdateError, update_rtol: float, held_to: str) -> str | None:
    """What is wrong with one training step's update (check 2's and the training replay's words), the
    first of: it did not move, the whole update is off, a tensor was left behind, a tensor did not follow
    the batch; None when nothing is. ``held_to`` names the step it is held to."""
    if off.reference_moved and not off.candidate_moved:
        return f"the weights are not {held_to}: they did not move (the optimizer step did not happen)"
    if not off.relative <= update_rtol:  # NaN weights are no match
        worst = f"; worst tensor {off.worst_tensor}: {off.worst_relative:.3g}" if off.worst_tensor else ""
        return f"the weights are not {held_to} (relative error {off.relative:.3g} > {update_rtol:g}{worst})"
    if off.left_behind(update_rtol):
        return (
            f"tensor {off.worst_tensor} was left behind: its update is {off.worst_relative:.3g} off, relative, "
            f"against {tensor_bound(update_rtol):g} (untrained is 1)"
        )
    if off.ignored_batch():
        name = off.furthest_behind
        return (
            f"tensor {name} did not follow the batch: its update carries {off.followed[name]:.3g} of the batch's "
            "own pull on it (the reference's step less the same step on zero gradients), under "
            f"{off.follow_bounds[name]:g}: momentum moved it, not the batch's gradient"
        )
    return None
