"""Updates a cheating trainer would export, made by hand from the reference's coast and the batch's pull
(``targets/harness/judge/update_error.py``), shared by the judge's unit tests and the replay's."""

from __future__ import annotations

import torch


def coasting_most_and_stretching_the_rest(
    coast: torch.Tensor, pull: torch.Tensor, dim: int = 0, coasted_share: float = 0.7
) -> tuple[torch.Tensor, float]:
    """Rows (dim 0) or columns (dim 1) of a matrix holding ``coasted_share`` of the pull left at their
    coast (momentum alone moved them), the rest moved far enough that the whole matrix's projection onto
    the pull is 0.6; with the share of the pull those rest hold."""
    own = (pull * pull).sum(dim=1 - dim)
    order = torch.argsort(own, descending=True)
    coasting = order[: int((own[order].cumsum(0) < coasted_share * own.sum()).sum())]
    kept = torch.ones_like(own, dtype=torch.bool)
    kept[coasting] = False
    share_kept = float(own[kept].sum() / own.sum())
    mask = kept[:, None] if dim == 0 else kept[None, :]
    return coast + torch.where(mask, pull * (0.6 / share_kept), torch.zeros_like(pull)), share_kept


def coasting_a_block(coast: torch.Tensor, pull: torch.Tensor, rows: float = 0.5, columns: float = 0.5) -> torch.Tensor:
    """A block of a matrix (its first ``rows`` of rows by its first ``columns`` of columns) left at its coast
    and the rest moved as the pull says: every row and column still carries some of its own pull."""
    block = torch.zeros(pull.shape, dtype=torch.bool)
    block[: int(rows * pull.shape[0]), : int(columns * pull.shape[1])] = True
    return coast + torch.where(block, torch.zeros_like(pull), pull)
