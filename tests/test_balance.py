"""Encoder dp balancing (`dtensor_mimo.data.balance`) and the bridge's explicit ragged split
(`MeshSpec.shard_bounds`), pure: no process group. The oracle cases `varied_*` and
`balanced_uniform` (tests/test_mimo.py) check that balanced steps change no number."""

from __future__ import annotations

import itertools
import random

import pytest
from torch.distributed.tensor import Replicate, Shard

from dtensor_mimo.bridge import MeshSpec, PlanError
from dtensor_mimo.bridge.plan import Recv, Send, plan_for_rank
from dtensor_mimo.data import ModalityInputs
from dtensor_mimo.data.balance import balanced_cuts, item_cost, max_over_mean, sample_cuts


def _best_max(costs: list[int], parts: int) -> int:
    """The smallest largest-run cost of any contiguous split, by trying every split."""
    n = len(costs)
    best = sum(costs)
    for inner in itertools.combinations_with_replacement(range(n + 1), parts - 1):
        cuts = (0, *inner, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(cuts, cuts[1:])))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_balanced_runs_are_the_best_contiguous_split(seed: int) -> None:
    rng = random.Random(seed)
    costs = [item_cost(rng.choice([0, 4, 16, 64, 256]), 32) for _ in range(rng.randint(0, 9))]  # 0: no rows
    parts = rng.randint(1, 6)  # more parts than items too
    cuts = balanced_cuts(costs, parts)
    assert len(cuts) == parts + 1 and cuts[0] == 0 and cuts[-1] == len(costs)
    assert all(a <= b for a, b in zip(cuts, cuts[1:]))
    runs = [sum(costs[a:b]) for a, b in zip(cuts, cuts[1:])]
    biggest = max(costs, default=0)
    assert max(runs) <= sum(costs) / parts + biggest
    assert max(runs) == _best_max(costs, parts)


@pytest.mark.parametrize("seed", range(20))
def test_cuts_do_not_depend_on_the_cost_unit_or_on_int64(seed: int) -> None:
    """Costs scaled by a constant cut alike: also where prefix * parts overflows int64 (the cuts
    then compare Python ints), and with thousands of parts for a few hundred items."""
    rng = random.Random(seed)
    costs = [item_cost(rng.choice([0, 16, 64, 196, 576, 1024]), 768) for _ in range(rng.randint(1, 300))]
    parts = rng.choice([1, 2, 7, 64, 1000, 5000])
    cuts = balanced_cuts(costs, parts)
    assert balanced_cuts([c * 3 for c in costs], parts) == cuts
    assert balanced_cuts([c * 10**12 for c in costs], parts) == cuts  # beyond int64 once times parts
    runs = [sum(costs[a:b]) for a, b in zip(cuts, cuts[1:])]
    assert max(runs) <= sum(costs) / parts + max(costs)


def test_large_items_get_runs_of_their_own() -> None:
    # Cutting at the prefix nearest k/3 of the total (7.3 and 14.7) gives runs [1+1+10, -, 10]:
    # one rank idle, one with 12; the best split gives each large item a run of its own.
    assert balanced_cuts([1, 1, 10, 10], 3) == (0, 2, 3, 4)
    # Within the least largest run, the cuts still come as near as they can to k / parts.
    assert balanced_cuts([5, 5, 5, 5, 5, 5, 6, 40, 4, 4, 4, 4], 4) == (0, 5, 7, 8, 12)  # runs 25, 11, 40, 16


def test_balancing_evens_out_what_the_sample_rule_leaves_uneven() -> None:
    # Two samples: four large images, then four small ones; by sample one rank gets all the large.
    tokens = [256] * 4 + [16] * 4
    costs = [item_cost(t, 64) for t in tokens]
    by_sample = sample_cuts([4, 4], 2)
    assert by_sample == (0, 4, 8)
    balanced = balanced_cuts(costs, 2)
    runs = [sum(costs[a:b]) for a, b in zip(balanced, balanced[1:])]
    assert max(runs) / (sum(costs) / 2) < 1.3
    assert balanced != by_sample


@pytest.mark.parametrize("parts, cuts", [
    (1, (0, 7)), (2, (0, 3, 7)), (3, (0, 3, 6, 7)), (4, (0, 3, 3, 6, 7)), (7, (0, 1, 3, 3, 6, 7, 7, 7))])
def test_sample_cuts_of_ragged_counts_follow_the_shard_rule(parts, cuts) -> None:
    """Items per sample 1, 2, 0, 3, 1 (7 items): part k starts at the first item of its first sample
    under torch.tensor_split's rule (the first 5 % parts parts take a sample more), written by hand:
    2 parts hold samples [0, 1, 2] [3, 4], 3 parts [0, 1] [2, 3] [4], 4 parts [0, 1] [2] [3] [4],
    7 parts one sample each then two empty parts."""
    got = sample_cuts([1, 2, 0, 3, 1], parts)
    assert tuple(got) == cuts and got == cuts and len(got) == parts + 1
    assert got[-1] == 7 and got[-2] == cuts[-2] and got[1:3] == cuts[1:3]


def test_shard_bounds_split_the_rows_as_given() -> None:
    src = MeshSpec([0, 1], (Shard(0),), sample_sizes=(6, 4, 2), shard_bounds=(0, 3, 12))
    assert src.local_range(0) == (0, 3) and src.local_range(1) == (3, 12)
    dst = MeshSpec([2], (Replicate(),), sample_sizes=(6, 4, 2))
    # Rank 2 holds all 12 rows: 3 from rank 0, 9 from rank 1, in row order.
    assert plan_for_rank(src, dst, 2).recvs == (Recv(0, 0, 3), Recv(1, 3, 12))
    assert plan_for_rank(src, dst, 0).sends == (Send(2, 0, 3),)
    assert plan_for_rank(src, dst, 1).sends == (Send(2, 0, 9),)


@pytest.mark.parametrize("bounds", [(0, 3), (0, 13, 12), (1, 3, 12), (0, 7, 5, 12)])
def test_shard_bounds_that_do_not_split_the_rows_are_refused(bounds) -> None:
    with pytest.raises(PlanError, match="shard_bounds"):
        MeshSpec([0, 1], (Shard(0),), sample_sizes=(6, 4, 2), shard_bounds=bounds)


def test_max_over_mean_by_hand() -> None:
    import torch

    items = [torch.zeros(3, 4, 4)] * 3
    m = ModalityInputs(inputs=items, items_per_sample=(2, 1), tokens_per_item=(4, 4, 16), special_token_id=9)
    assert max_over_mean(m, (0, 2, 3)) == 16 * 2 / 24  # parts of 8 and 16 tokens (width unknown)
    assert max_over_mean(m, (0, 3, 3)) == 2.0  # everything on one of two ranks
    width = 2  # cost t (6w + t): 4 -> 64, 16 -> 448
    assert max_over_mean(m, (0, 2, 3), width) == 448 * 2 / 576
