"""The multi-rank harness reports a failing rank's traceback and turns hangs into fast failures."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import DistributedTestFailure, run_on_ranks


def _sum_of_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _rank1_raises():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 would wait forever for rank 1


def _rank0_hangs():
    if dist.get_rank() == 0:
        time.sleep(60)


def test_results_per_rank():
    assert run_on_ranks(_sum_of_ranks, 2) == [1.0, 1.0]


def test_failing_rank_traceback_is_reported():
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure, match=r"(?s)rank 1 raised:.*ValueError: boom on rank one"
                                                     r".*ranks \[0\] did not finish after another rank failed"):
        run_on_ranks(_rank1_raises, 2, timeout=60)
    assert time.monotonic() - start < 20


def test_hang_fails_fast():
    with pytest.raises(DistributedTestFailure, match=r"ranks \[0\] did not finish within 3 s"):
        run_on_ranks(_rank0_hangs, 2, timeout=3)


def test_pool_recovers_after_failure():
    assert run_on_ranks(_sum_of_ranks, 2) == [1.0, 1.0]
