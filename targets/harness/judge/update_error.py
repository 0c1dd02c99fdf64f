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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from targets.api import StateDict

TENSOR_LEFT_BEHIND = 0.9  # a tensor's relative update error at which it counts as untrained (frozen: 1)


def tensor_bound(update_rtol: float) -> float:
    """Each tensor's bound: ``TENSOR_LEFT_BEHIND``, or the whole model's where that is looser."""
    return max(TENSOR_LEFT_BEHIND, update_rtol)


@dataclass(frozen=True)
class UpdateError:
    relative: float  # the whole update's, relative to the reference's (inf: the reference did not move)
    tensors: dict[str, float]  # each tensor the reference moved: its own relative error
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


def update_error(start: StateDict, got: StateDict, want: StateDict) -> UpdateError:
    """``got`` (the candidate's weights after the step) against ``want`` (the reference's), both from
    ``start``; compared in float64 on the CPU."""
    err_sq = ref_sq = cand_sq = 0.0
    tensors: dict[str, float] = {}
    for name, before in start.items():
        origin = before.double().cpu()
        d_ref, d_cand = want[name].double().cpu() - origin, got[name].double().cpu() - origin
        err, ref = float((d_cand - d_ref).norm()), float(d_ref.norm())
        err_sq, ref_sq, cand_sq = err_sq + err**2, ref_sq + ref**2, cand_sq + float(d_cand.norm()) ** 2
        if ref > 0:
            tensors[name] = err / ref
    if ref_sq == 0:
        relative = 0.0 if cand_sq == 0 else math.inf
    else:
        relative = math.sqrt(err_sq / ref_sq)
    return UpdateError(relative, tensors, ref_sq > 0, cand_sq != 0)  # NaN weights moved (to NaN)
