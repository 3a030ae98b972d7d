"""Specification of zigzag context-parallel sharding, `dtensor_mimo.sequence.sharding` (pure).

The sequence is cut into 2·cp equal chunks; cp rank r keeps chunks r and 2·cp−1−r. Expected
columns are written out by hand; shard contents are compared with hand-built slices.

| seq_len | cp | rank -> kept columns (by hand)                                    |
|---------|----|-------------------------------------------------------------------|
| 8       | 2  | 0: [0,1,6,7]  1: [2,3,4,5]                                        |
| 12      | 3  | 0: [0,1,10,11]  1: [2,3,8,9]  2: [4,5,6,7]                        |
| 16      | 4  | 0: [0,1,14,15]  1: [2,3,12,13]  2: [4,5,10,11]  3: [6,7,8,9]      |
| 4       | 2  | 0: [0,3]  1: [1,2]                                                |
| 5       | 1  | 0: [0..4] (cp 1 keeps everything, no padding needed)              |

Also: contents of `[B,S,H]`, `[B,S]` and `[B,H,S,D]` shards; every rank's shard put back at its
columns rebuilds the tensor (and gradients flow back the same way); `shard_for_cp` on every field
(None stays None); properties over random (seq_len, cp) (a permutation of the columns, equal
causal work per rank); error messages.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtensor_mimo.sequence import (
    CPShard,
    shard_for_cp,
    zigzag_index,
    zigzag_shard,
)

HAND = {
    (8, 2): [[0, 1, 6, 7], [2, 3, 4, 5]],
    (12, 3): [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]],
    (16, 4): [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]],
    (4, 2): [[0, 3], [1, 2]],
    (5, 1): [[0, 1, 2, 3, 4]],
}


@pytest.mark.parametrize("seq_len, cp", list(HAND))
def test_kept_columns_by_hand(seq_len, cp):
    for rank, expected in enumerate(HAND[(seq_len, cp)]):
        index = zigzag_index(seq_len, cp, rank)
        assert index.dtype == torch.int64
        assert index.tolist() == expected


def _values(*shape):
    # Distinct values, so a wrong column cannot match by accident.
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)


def test_shard_contents_seq8_cp2():
    x = _values(2, 8, 3)  # [B, S, H] embeddings
    expected_rank0 = torch.cat([x[:, 0:2], x[:, 6:8]], dim=1)
    torch.testing.assert_close(zigzag_shard(x, 2, 0), expected_rank0, rtol=0, atol=0)
    torch.testing.assert_close(zigzag_shard(x, 2, 1), x[:, 2:6], rtol=0, atol=0)
    labels = _values(2, 8).long()  # [B, S]
    assert zigzag_shard(labels, 2, 0).tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert zigzag_shard(labels, 2, 1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]


def test_shard_contents_seq12_cp3_attention_layout():
    x = _values(1, 2, 12, 4)  # [B, H, S, D]: sequence on dim 2
    expected = [
        torch.cat([x[:, :, 0:2], x[:, :, 10:12]], dim=2),
        torch.cat([x[:, :, 2:4], x[:, :, 8:10]], dim=2),
        x[:, :, 4:8],
    ]
    for rank in range(3):
        torch.testing.assert_close(zigzag_shard(x, 3, rank, dim=2), expected[rank], rtol=0, atol=0)


@pytest.mark.parametrize(
    "shape, dim, cp", [((2, 8, 3), 1, 2), ((2, 12), 1, 3), ((1, 2, 16, 4), 2, 4), ((3, 5), 1, 1)]
)
def test_shards_put_back_rebuild_the_tensor(shape, dim, cp):
    x = _values(*shape)
    rebuilt = torch.full_like(x, -1.0)
    for r in range(cp):
        shard = zigzag_shard(x, cp, r, dim)
        assert shard.shape[dim] == shape[dim] // cp
        rebuilt.index_copy_(dim, zigzag_index(shape[dim], cp, r), shard)
    torch.testing.assert_close(rebuilt, x, rtol=0, atol=0)


def test_shard_is_differentiable():
    x = _values(2, 8, 3).requires_grad_()
    weight = _values(2, 8, 3)
    sum(zigzag_shard(x * weight, 2, r).sum() for r in range(2)).backward()
    torch.testing.assert_close(x.grad, weight, rtol=0, atol=0)


@settings(max_examples=60, deadline=None)
@given(cp=st.integers(1, 8), chunk=st.integers(1, 5))
def test_properties(cp, chunk):
    seq_len = 2 * cp * chunk
    indices = [zigzag_index(seq_len, cp, r).tolist() for r in range(cp)]
    flat = sorted(c for idx in indices for c in idx)
    assert flat == list(range(seq_len))  # every column exactly once
    assert all(idx == sorted(idx) and len(idx) == seq_len // cp for idx in indices)
    # Load balance: query column t sees t + 1 keys under causal attention.
    work = {sum(c + 1 for c in idx) for idx in indices}
    assert len(work) == 1


def test_shard_for_cp_every_field():
    b, s, h = 2, 8, 3
    fields = dict(
        tokens=_values(b, s).long(),
        embeddings=_values(b, s, h),
        labels=_values(b, s).long() + 100,
        loss_mask=(_values(b, s).long() % 3 != 0),
        positions=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * b),
        document_ids=torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]] * b),
    )
    for rank, cols in enumerate(HAND[(8, 2)]):
        shard = shard_for_cp(2, rank, **fields)
        assert isinstance(shard, CPShard)
        assert shard.sequence_index.tolist() == [cols] * b
        for name, full in fields.items():
            torch.testing.assert_close(getattr(shard, name), full[:, cols], rtol=0, atol=0)


def test_shard_for_cp_none_stays_none():
    shard = shard_for_cp(2, 1, labels=_values(3, 4).long())
    assert shard.labels.tolist() == [[1, 2], [5, 6], [9, 10]]
    assert shard.sequence_index.tolist() == [[1, 2]] * 3
    for name in ("tokens", "embeddings", "loss_mask", "positions", "document_ids"):
        assert getattr(shard, name) is None


def test_error_names_seq_len_cp_and_fix():
    fix = r"pad the sequence to a multiple of 6 \(here 12\)"
    with pytest.raises(ValueError, match=r"seq_len=10.*2\*cp=6.*cp=3.*" + fix):
        zigzag_index(10, 3, 0)
    with pytest.raises(ValueError, match=r"seq_len=10.*cp=3"):
        shard_for_cp(3, 0, labels=torch.zeros(1, 10, dtype=torch.long))
    with pytest.raises(ValueError, match=r"seq_len=6.*2\*cp=4.*multiple of 4 \(here 8\)"):
        zigzag_shard(torch.zeros(1, 6), 2, 0)


def test_other_errors():
    with pytest.raises(ValueError, match=r"rank=2 is not a cp rank of cp=2"):
        zigzag_index(8, 2, 2)
    with pytest.raises(ValueError, match=r"cp=0"):
        zigzag_index(8, 0, 0)
    with pytest.raises(ValueError, match=r"labels.*embeddings|embeddings.*labels"):
        shard_for_cp(2, 0, embeddings=torch.zeros(1, 8, 4),
                     labels=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"at least one"):
        shard_for_cp(2, 0)
