"""The update: per-module AdamW with an lr schedule and one global clip (`MimoOptimizer`), and one
training step over a `MimoModel` (`train_step`: its program, the gradient reduction, the step's one
all-reduce, clip and AdamW)."""

from dtensor_mimo.optim.optimizer import AdamWConfig, LRSchedule, MimoOptimizer, grad_sumsq_shares
from dtensor_mimo.optim.step import StepMetrics, UnusableBatch, train_step

__all__ = ["AdamWConfig", "LRSchedule", "MimoOptimizer", "StepMetrics", "UnusableBatch", "grad_sumsq_shares",
           "train_step"]
