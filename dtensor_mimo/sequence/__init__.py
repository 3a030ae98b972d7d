"""Sequence layer: context-parallel ("zigzag") sharding of a batch, the cp attention core, and the
token loss over a rank's part of the sequence, normalised by the global batch."""

from dtensor_mimo.sequence.context_parallel import ContextParallelAttention
from dtensor_mimo.sequence.generate import greedy_generate
from dtensor_mimo.sequence.loss import (
    linear_token_loss_sum,
    loss_normalizer,
    loss_weights,
    token_loss_sum,
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
)
from dtensor_mimo.sequence.sharding import (
    CPShard,
    shard_for_cp,
    zigzag_index,
    zigzag_shard,
)

__all__ = [
    "CPShard",
    "ContextParallelAttention",
    "greedy_generate",
    "linear_token_loss_sum",
    "loss_normalizer",
    "loss_weights",
    "shard_for_cp",
    "token_loss_sum",
    "vocab_parallel_argmax",
    "vocab_parallel_cross_entropy",
    "zigzag_index",
    "zigzag_shard",
]
