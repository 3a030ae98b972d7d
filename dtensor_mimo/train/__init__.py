"""The trainer, an application of the library: ``python -m dtensor_mimo.train`` (its launcher,
typed config, datasets, checkpoints and export). The library pieces it uses live below it
(`dtensor_mimo.optim`: the optimizer and the training step; `dtensor_mimo.layout.world`: joining
the process group; `dtensor_mimo.sequence.loss`: the global-batch token loss); their names stay
importable from here."""

from dtensor_mimo.layout.world import abort, init_distributed
from dtensor_mimo.optim import AdamWConfig, LRSchedule, MimoOptimizer, grad_sumsq_shares
from dtensor_mimo.sequence.loss import loss_normalizer, loss_weights, token_loss_sum

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
