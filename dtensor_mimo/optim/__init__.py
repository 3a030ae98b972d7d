"""The update: per-module AdamW with an lr schedule and one global clip (`MimoOptimizer`), and one
training step over a `MimoModel` (`train_step`: its program, the gradient reduction, the step's one
all-reduce, clip and AdamW)."""

from dtensor_mimo.optim.optimizer import AdamWConfig, LRSchedule, MimoOptimizer, grad_sumsq_shares
from dtensor_mimo.optim.step import StepMetrics, train_step

__all__ = ["AdamWConfig", "LRSchedule", "MimoOptimizer", "StepMetrics", "grad_sumsq_shares", "train_step"]
