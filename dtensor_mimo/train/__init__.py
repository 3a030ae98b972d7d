"""Train layer: per-module AdamW with an lr schedule and a global clip, one train step, joining the
world (`init_distributed`: a timeout, torchrun restarts, NCCL bound to the GPU); the
global-batch token loss is re-exported from `dtensor_mimo.sequence.loss`, below the schedule that
calls it."""

from dtensor_mimo.train.distributed import abort, init_distributed
from dtensor_mimo.train.loss import loss_normalizer, loss_weights, token_loss_sum
from dtensor_mimo.train.optimizer import AdamWConfig, LRSchedule, MimoOptimizer, grad_sumsq_shares

__all__ = [
    "AdamWConfig",
    "LRSchedule",
    "MimoOptimizer",
    "abort",
    "grad_sumsq_shares",
    "init_distributed",
    "loss_normalizer",
    "loss_weights",
    "token_loss_sum",
]
