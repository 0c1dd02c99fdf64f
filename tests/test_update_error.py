"""The judge's update bounds on hand-made tensors: what each share means, and the evasions it stops."""

from __future__ import annotations

import torch
from update_plants import coasting_a_block, coasting_most_and_stretching_the_rest

from targets.harness.judge.update_error import MATRIX_FOLLOWS_BATCH, TENSOR_FOLLOWS_BATCH, carried, update_error


def _matrix_step(seed: int = 0, shape: tuple[int, int] = (64, 48)):
    """A start, the coast (momentum's part of the step) and the reference's step for one matrix."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randn(shape, generator=g)
    coast = start + 1e-3 * torch.randn(shape, generator=g)
    pull = 1e-3 * torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g)  # rows pulled unevenly
    return start, coast, pull


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
        got, share_kept = coasting_most_and_stretching_the_rest(coast, pull, dim)
        moved = got - coast
        projection = float((moved * pull).sum() / (pull * pull).sum())
        assert abs(projection - 0.6) < 1e-4, "one projection alone would pass it"
        assert projection >= TENSOR_FOLLOWS_BATCH
        assert carried(moved, pull) < share_kept < MATRIX_FOLLOWS_BATCH  # the stretched rows overshoot
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


def test_a_block_left_at_its_coast_is_not_made_up_by_stretching_the_strips_beside_it():
    """The rows of the block fall short, and the same rows outside it (and the block's columns outside it)
    are stretched until each row and column reaches its own pull: an overshoot counts as far against its
    row as a shortfall, so the stretch reads no better than the bare block."""
    start, coast, pull = _matrix_step(shape=(40, 40))
    block = torch.zeros(pull.shape, dtype=torch.bool)
    block[:30, :30] = True  # 56% of the elements
    bare = coast + torch.where(block, torch.zeros_like(pull), pull)
    stretched = bare.clone()
    stretched[:30, 30:] += pull[:30, 30:] * 3.0  # the block's rows, outside it
    stretched[30:, :30] += pull[30:, :30] * 3.0  # the block's columns, outside it
    assert carried(stretched - coast, pull) <= carried(bare - coast, pull) + 1e-6 < MATRIX_FOLLOWS_BATCH


def test_a_stack_of_expert_matrices_is_counted_by_each_experts_rows():
    """An MoE layer's experts are one tensor ``[experts, out, in]``: half of every expert's output rows left
    at their coast and the rest stretched is a matrix's evasion, counted as such."""
    g = torch.Generator().manual_seed(3)
    shape = (4, 16, 12)
    coast = torch.randn(shape, generator=g)
    pull = 1e-3 * torch.randn(shape, generator=g)
    kept = torch.arange(16) % 2 == 0
    got = coast + torch.where(kept[None, :, None], 2.0 * pull, torch.zeros_like(pull))
    projection = float(((got - coast) * pull).sum() / (pull * pull).sum())
    assert projection > 0.8, "one projection, or rows taken as whole experts, would let it through"
    assert carried(got - coast, pull) < 0.1


def test_experts_are_held_as_one_stack_not_one_by_one():
    """bf16 routes some tokens to other experts than float32 does, so an honest expert can carry nothing of
    its own pull (0.0 at 0.9% of its stack's: ``benchmarks/bf16_update_error.py --moe 128x8``). One expert
    of eight left at its coast passes with its stack; three of eight, 37% of the stack's pull, do not."""
    g = torch.Generator().manual_seed(5)
    shape = (8, 16, 12)
    start = torch.randn(shape, generator=g)
    coast = start + 1e-4 * torch.randn(shape, generator=g)
    pull = 1e-3 * torch.randn(shape, generator=g)
    for coasting in (1, 3):
        got = coast + pull
        got[:coasting] = coast[:coasting]
        assert carried(got[0] - coast[0], pull[0]) == 0.0
        off = update_error({"w": start}, {"w": got}, {"w": coast + pull}, {"w": coast})
        assert off.ignored_batch() is (coasting == 3), (coasting, off.followed)


def test_a_block_a_quarter_of_a_matrix_left_at_its_coast_does_not_follow_the_batch():
    """Half the rows by half the columns left to momentum: each of those rows and columns still carries
    half of its own pull, the matrix three quarters of it, over a vector's bound and under a matrix's
    (a matrix's rows average their noise: honest bf16 matrices carried 0.989-0.997). A tenth of the rows
    by a tenth of the columns, 1% of the pull, passes."""
    start, coast, pull = _matrix_step(shape=(40, 40))
    flat = torch.full(pull.shape, 1e-3)  # a pull spread evenly: the block's share is its area's
    for rows, shares in ((0.5, (TENSOR_FOLLOWS_BATCH, MATRIX_FOLLOWS_BATCH)), (0.1, (0.98, 1.0))):
        got = coasting_a_block(coast, flat, rows, rows)
        assert shares[0] < carried(got - coast, flat) < shares[1]
        off = update_error({"w": start}, {"w": got}, {"w": coast + flat}, {"w": coast})
        assert off.ignored_batch() is (rows == 0.5) and off.relative < 0.9, (rows, off)


def test_each_tensor_is_held_to_its_own_bound_and_the_least_share_is_reported_whatever_its_kind():
    """A vector carrying 0.6 and a matrix 0.95 both pass; the least share reported is the vector's (the
    figures are read as measured), the least matrix's apart. A matrix carrying 0.75 beside them is named."""
    start, coast, pull = _matrix_step(shape=(40, 40))
    flat = torch.full(pull.shape, 1e-3)
    vector_start, vector_coast, vector_pull = torch.zeros(8), torch.zeros(8), torch.full((8,), 1e-3)
    starts, coasts = {"v": vector_start, "w": start}, {"v": vector_coast, "w": coast}
    wants = {"v": vector_coast + vector_pull, "w": coast + flat}
    for matrix_share, rejected in ((0.95, False), (0.75, True)):
        got = {"v": vector_coast + 0.6 * vector_pull, "w": coast + matrix_share * flat}
        off = update_error(starts, got, wants, coasts)
        assert off.least_following == "v" and abs(off.least_followed - 0.6) < 1e-5  # float32 weights
        assert abs(off.least_followed_matrix - matrix_share) < 1e-4
        assert off.ignored_batch() is rejected and off.furthest_behind == ("w" if rejected else "v")
