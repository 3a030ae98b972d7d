"""The training loss, re-exported from its home below the schedule that calls it:
`dtensor_mimo.sequence.loss` (per-token cross entropy, vocabulary-parallel or not, normalised by
the loss tokens of the whole global batch)."""

from dtensor_mimo.sequence.loss import (
    loss_normalizer,
    loss_weights,
    token_loss_sum,
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "loss_normalizer",
    "loss_weights",
    "token_loss_sum",
    "vocab_parallel_argmax",
    "vocab_parallel_cross_entropy",
]
