"""`train_step`: forward, backward, gradient reduction, global norm and clipped step, on every rank."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtensor_mimo.bridge import PlanError
from dtensor_mimo.data import MimoBatch
from dtensor_mimo.mimo import MimoModel
from dtensor_mimo.train.optimizer import MimoOptimizer, grad_sumsq_shares

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepMetrics:
    """The same numbers on every rank: global loss, global and per-module gradient norms."""

    loss: float
    grad_norm: float
    module_grad_norms: dict[str, float]
    skipped: bool


def _now(device: torch.device) -> float:
    if device.type != "cpu":
        torch.accelerator.synchronize()
    return time.perf_counter()


def read_totals(totals: torch.Tensor) -> list[float]:
    """The step's all-reduced totals on the host: its ONE device-to-host sync, which the metrics
    and the clip / skip / raise decision need (every other count of a step comes from host metadata)."""
    return totals.tolist()


def train_step(model: MimoModel, optimizer: MimoOptimizer, batch: MimoBatch,
               timings: dict[str, float] | None = None) -> StepMetrics:
    """One optimizer step on the global `batch`; call on every rank with the same batch.

    One small all-reduce over the world carries the loss, every module's squared gradient norm
    and a status word, so every rank reports the same loss, takes the same clip and skip
    decision, and raises together when a pipelined step found encoder rows that contradict the
    batch metadata (`MimoModel.step_error`), before any weight changes.

    `timings`, if given, receives this rank's seconds in "forward_backward" (bridge included) and
    "optimizer" (gradient reduction, the norm's all-reduce, clip, AdamW); on GPUs timing syncs
    the device.

    Host syncs: one per step (`read_totals`), whatever the number of microbatches.
    """
    start = _now(model.device) if timings is not None else 0.0
    optimizer.zero_grad()
    share = model.forward_backward(batch)
    if timings is not None:
        middle = _now(model.device)
        timings["forward_backward"] = middle - start
    model.reduce_gradients()
    loss_part = share.detach().double().reshape(1) if model.holds_loss_share() else \
        torch.zeros(1, dtype=torch.float64, device=model.device)
    # The status word: ranks whose encoder rows contradicted the batch metadata (`step_error`).
    status = torch.full((1,), float(model.step_error is not None), dtype=torch.float64, device=model.device)
    totals = torch.cat([loss_part, status, grad_sumsq_shares(model)])
    dist.all_reduce(totals)
    loss, bad, *sumsq = read_totals(totals)
    if bad:
        optimizer.zero_grad()
        raise PlanError(model.step_error or (
            f"{int(bad)} rank(s) produced encoder rows that disagree with the batch "
            "metadata (their error names the encoder and the shapes); the step was not applied"))
    grad_norm = math.sqrt(sum(sumsq))
    skipped = not optimizer.step(grad_norm)
    if skipped and dist.get_rank() == 0:  # the same verdict on every rank: said once
        log.warning("step skipped after %d update(s): the global gradient norm is %s (loss %s); weights and "
                    "optimizer state are unchanged (a non-finite input or a too high lr?)",
                    optimizer.updates, grad_norm, loss)
    if timings is not None:
        timings["optimizer"] = _now(model.device) - middle
    return StepMetrics(loss, grad_norm, {n: math.sqrt(s) for n, s in zip(model.module_names, sumsq)},
                       skipped)
