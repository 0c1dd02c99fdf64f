"""The judge's update bounds on hand-made tensors: what each share means, and the evasions it stops."""

from __future__ import annotations

import torch

from targets.harness.judge.update_error import TENSOR_FOLLOWS_BATCH, carried, update_error


def _matrix_step(seed: int = 0, shape: tuple[int, int] = (64, 48)):
    """A start, the coast (momentum's part of the step) and the reference's step for one matrix."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randn(shape, generator=g)
    coast = start + 1e-3 * torch.randn(shape, generator=g)
    pull = 1e-3 * torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g)  # rows pulled unevenly
    return start, coast, pull


def _coasting_most_and_stretching_the_rest(coast, pull, dim: int, coasted_share: float = 0.7):
    """Rows (dim 0) or columns (dim 1) holding ``coasted_share`` of the pull left at their coast; the rest
    moved far enough that the whole matrix's projection onto the pull is 0.6."""
    own = (pull * pull).sum(dim=1 - dim)
    order = torch.argsort(own, descending=True)
    coasting = order[: int((own[order].cumsum(0) < coasted_share * own.sum()).sum())]
    kept = torch.ones_like(own, dtype=torch.bool)
    kept[coasting] = False
    share_kept = float(own[kept].sum() / own.sum())
    mask = kept[:, None] if dim == 0 else kept[None, :]
    return coast + torch.where(mask, pull * (0.6 / share_kept), torch.zeros_like(pull)), share_kept


def test_an_honest_update_carries_all_of_the_pull_in_every_row_and_column():
    start, coast, pull = _matrix_step()
    noise = torch.randn(pull.shape, generator=torch.Generator().manual_seed(1))
    got = coast + pull + 0.1 * pull.norm() / pull.numel() ** 0.5 * noise  # a tenth of the pull's scale
    assert 0.95 < carried(got - coast, pull) <= 1.0
    off = update_error({"w": start}, {"w": got}, {"w": coast + pull}, {"w": coast})
    assert not off.ignored_batch()


def test_a_matrix_with_most_rows_coasting_and_the_rest_stretched_does_not_follow_the_batch():
    start, coast, pull = _matrix_step()
    for dim in (0, 1):
        got, share_kept = _coasting_most_and_stretching_the_rest(coast, pull, dim)
        moved = got - coast
        projection = float((moved * pull).sum() / (pull * pull).sum())
        assert abs(projection - 0.6) < 1e-4, "one projection alone would pass it"
        assert projection >= TENSOR_FOLLOWS_BATCH
        assert abs(carried(moved, pull) - share_kept) < 1e-4 and share_kept < TENSOR_FOLLOWS_BATCH
        off = update_error({"w": start}, {"w": got}, {"w": coast + pull}, {"w": coast})
        assert off.ignored_batch() and off.least_following == "w", (dim, off.followed)


def test_a_vector_is_judged_by_its_projection():
    pull, moved = torch.tensor([1.0, 2.0, 0.0]), torch.tensor([2.0, 0.0, 5.0])
    assert carried(moved, pull) == 2.0 / 5.0
    assert carried(torch.tensor([3.0, 6.0, 0.0]), pull) == 3.0  # a vector's stretch is the whole update's


def test_a_nan_carries_nothing():
    start, coast, pull = _matrix_step()
    got = coast + pull
    got[3, 5] = float("nan")
    off = update_error({"w": start}, {"w": got}, {"w": coast + pull}, {"w": coast})
    assert off.ignored_batch()
