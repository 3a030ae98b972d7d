"""Train layer: per-module AdamW with an lr schedule and a global clip, one train step; the
global-batch token loss is re-exported from `dtensor_mimo.sequence.loss`, below the schedule that
calls it."""

from dtensor_mimo.train.loss import loss_normalizer, loss_weights, token_loss_sum
from dtensor_mimo.train.optimizer import AdamWConfig, LRSchedule, MimoOptimizer, grad_sumsq_shares

__all__ = [
    "AdamWConfig",
    "LRSchedule",
    "MimoOptimizer",
    "grad_sumsq_shares",
    "loss_normalizer",
    "loss_weights",
    "token_loss_sum",
]
