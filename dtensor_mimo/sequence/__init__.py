"""Sequence layer: context-parallel ("zigzag") sharding of a batch and the cp attention core."""

from dtensor_mimo.sequence.context_parallel import ContextParallelAttention
from dtensor_mimo.sequence.sharding import (
    CPShard,
    shard_for_cp,
    zigzag_index,
    zigzag_shard,
    zigzag_unshard,
)

__all__ = [
    "CPShard",
    "ContextParallelAttention",
    "shard_for_cp",
    "zigzag_index",
    "zigzag_shard",
    "zigzag_unshard",
]
