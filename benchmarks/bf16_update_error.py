"""How far an honest bf16 trainer's update is from the float32 reference's, over the whole model and per
tensor: the figures the judge's update bounds are set against (``targets/harness/judge/update_error.py``).

    python benchmarks/bf16_update_error.py [--target tiny-qwen3-cpu] [--lr 1e-6] [--steps 2] [--coast NAME]
        [--stretch NAME] [--block NAME] [--half NAME] [--drop K] [--moe EXPERTSxPER_TOKEN]

The target's model in bfloat16; the honest trainer keeps float32 masters, computes the GRPO loss and its
gradients in bfloat16, and steps AdamW on the masters; the reference steps in float32 from the same masters
(its own AdamW state carried along, as in the training replay) on check 2's fixed batches, two and two
again. Printed per step: the relative update error of the whole model and of the three worst tensors (each
tensor the reference moved), and the vectors and the matrices that carry least of the batch's own pull (the
reference's step less its coast on zero gradients; each held to its own bound). ``--coast NAME``: from step
2 on, the trainer zeroes the gradients of the tensors whose names contain NAME and lets momentum carry them,
the evasion the pull bound catches. Also printed: the least share of its own pull any row or column of a
matrix carries (the unit ``carried`` counts by). ``--stretch NAME``: from step 2 on, the matrices whose
names contain NAME keep their coast in the rows holding 70% of the pull and move the other rows far enough
that one projection onto the pull reads 0.6 (the trainer's own update there, stretched): the evasion that
counting row by row catches. ``--block NAME``: from step 2 on, the matrices whose names contain NAME keep
their coast on half their rows by half their columns: the evasion a matrix's bound catches and a vector's
would not. ``--half NAME``: from step 2 on, the tensors whose names contain NAME get their gradient from
the first half of the batch's trajectories alone. ``--drop K``: from step 2 on, every tensor's gradient
leaves the batch's last K trajectories out (a trainer that skips some and claims all). ``--moe 64x2``:
the target's model made a Qwen3 MoE of 64
experts, 2 routed a token (each expert a quarter of the dense MLP's width); also printed, the least share
of its own pull one expert carries alone, and that expert's share of its stack's pull: experts are judged
as one stack, since bf16 routes some tokens to other experts than float32 does.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import typer
import yaml
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from targets.harness.judge.accuracy import fixed_train_batches  # noqa: E402
from targets.harness.judge.update_error import carried, update_error  # noqa: E402
from targets.harness.model import load_model, model_dir  # noqa: E402
from targets.harness.reference.trainer import ReferenceTrainer  # noqa: E402
from targets.spec import CATALOG_DIR, parse_target  # noqa: E402
from tests.bf16_masters import Bf16MasterTrainer  # noqa: E402


def least_row_carried(moved: torch.Tensor, pull: torch.Tensor) -> float:
    """The least share of its own pull a row or a column of the matrix carries (pulled rows only)."""
    least = 1.0
    for rows, along in ((moved, pull), (moved.T, pull.T)):
        own = (along * along).sum(dim=1)
        share = (rows * along).sum(dim=1)[own > 0] / own[own > 0]
        least = min(least, float(share.min()))
    return least


def least_expert_carried(moved: torch.Tensor, pull: torch.Tensor) -> tuple[float, float]:
    """Of a stack of experts (``[experts, out, in]``), the least share of its own pull one expert carries
    (``carried``), and that expert's share of the stack's pull."""
    own = (pull * pull).sum(dim=(1, 2))
    return min((carried(moved[e], pull[e]), float(own[e] / own.sum())) for e in range(len(own)) if own[e] > 0)


def moe_config(config: dict, experts_per_token: str) -> None:
    """``config`` (a dense Qwen3's) made an MoE's: ``64x2`` is 64 experts, 2 routed a token."""
    experts, per_token = (int(n) for n in experts_per_token.split("x"))
    config.update(
        num_experts=experts, num_experts_per_tok=per_token, moe_intermediate_size=config["intermediate_size"] // 4
    )


def stretched(got: torch.Tensor, coast: torch.Tensor, pull: torch.Tensor) -> torch.Tensor:
    """``got`` with the rows holding 70% of the pull back at their coast and the rest moved further."""
    own = (pull * pull).sum(dim=1)
    order = torch.argsort(own, descending=True)
    kept = torch.ones_like(own, dtype=torch.bool)
    kept[order[: int((own[order].cumsum(0) < 0.7 * own.sum()).sum())]] = False
    moved = got - coast
    stretch = 0.6 * float((pull * pull).sum()) / float((moved * pull)[kept].sum())
    return coast + torch.where(kept[:, None], stretch * moved, torch.zeros_like(moved))


def blocked(got: torch.Tensor, coast: torch.Tensor) -> torch.Tensor:
    """``got`` with half its rows by half its columns back at their coast."""
    block = got.clone()
    block[: got.shape[0] // 2, : got.shape[1] // 2] = coast[: got.shape[0] // 2, : got.shape[1] // 2]
    return block


def main(
    target: str = "tiny-qwen3-cpu",
    lr: float = 1e-6,
    steps: int = 2,
    coast: str = "",
    stretch: str = "",
    block: str = "",
    half: str = "",
    drop: int = 0,
    moe: str = "",
) -> None:
    data = yaml.safe_load((CATALOG_DIR / f"{target}.yaml").read_text())
    data["model"]["dtype"] = "bfloat16"
    if moe:
        data["model"]["family"] = "qwen3_moe"
        moe_config(data["model"]["config"], moe)
    data["workload"]["training"]["lr"] = lr
    spec = parse_target(data)
    base = load_model(model_dir(spec.model), "bfloat16")
    config = spec.workload.training.config()
    honest, reference = Bf16MasterTrainer(base, config), ReferenceTrainer(copy.deepcopy(base).float(), config)
    table = Table(
        "step",
        "whole model",
        "worst tensors (relative error, weights)",
        "least vectors (pull carried)",
        "least matrices (pull carried)",
        "least row or column of a 2-D matrix (own pull)",
        *(["least expert alone (its share of the stack's pull)"] if moe else []),
    )
    for step, batch in enumerate(
        fixed_train_batches(base, sizes=[(8, 12)[k % 2] for k in range(steps)], temperature=config.temperature), start=1
    ):
        start = honest.state_dict()
        reference.load_state_dict(start)  # the reference's AdamW state carried along, as in the replay
        coasted = reference.coast()
        reference.train_step(batch)
        honest.train_step(batch, coast if step >= 2 else "", half if step >= 2 else "", drop if step >= 2 else 0)
        got, want = honest.state_dict(), reference.state_dict()
        pulls = {k: want[k].double() - coasted[k].double() for k in want if want[k].dim() >= 2}
        for k in [k for k in pulls if pulls[k].dim() == 2] if step >= 2 else ():  # stacks of experts as they are
            if stretch and stretch in k:
                got[k] = stretched(got[k].double(), coasted[k].double(), pulls[k]).float()
            if block and block in k:
                got[k] = blocked(got[k].double(), coasted[k].double()).float()
        off = update_error(start, got, want, coasted)
        least_row = min(
            (least_row_carried(got[k].double() - coasted[k].double(), pulls[k]), k)
            for k in pulls
            if k in off.followed and pulls[k].dim() == 2  # an expert routed no token has no row figure
        )
        worst = sorted(((e, k) for k, e in off.tensors.items()), reverse=True)[:3]
        vectors = sorted((f, k) for k, f in off.followed.items() if start[k].dim() < 2)[:2]
        matrices = sorted((f, k) for k, f in off.followed.items() if start[k].dim() >= 2)[:2]
        table.add_row(
            str(step),
            f"{off.relative:.3f}",
            ", ".join(f"{k.removeprefix('model.')} {e:.3f} ({start[k].numel()})" for e, k in worst),
            ", ".join(f"{k.removeprefix('model.')} {f:.3f}" for f, k in vectors),
            ", ".join(f"{k.removeprefix('model.')} {f:.3f}" for f, k in matrices),
            f"{least_row[1].removeprefix('model.')} {least_row[0]:.3f}",
            *([least_expert(got, coasted, pulls, off.followed)] if moe else []),
        )
    Console().print(table)


def least_expert(got: dict, coasted: dict, pulls: dict, judged: dict) -> str:
    """The expert carrying least of its own pull, of every judged stack."""
    share, stack_share, name = min(
        (*least_expert_carried(got[k].double() - coasted[k].double(), pulls[k]), k)
        for k in pulls
        if pulls[k].dim() == 3 and k in judged
    )
    return f"{name.removeprefix('model.')} {share:.3f} ({stack_share:.3f})"


if __name__ == "__main__":
    typer.run(main)
