"""Per-module AdamW, a global gradient norm over every module on every mesh, clipping by it.

Each module's parameters live on its own mesh, sharded over some dims (FSDP over dp, tp) and
replicated over the others. A rank's contribution to the squared norm is its local gradient's
sum of squares divided by the number of ranks that hold an identical copy of that shard, so that
one all-reduce over the world adds up every distinct gradient element exactly once. The result is
the same number on every rank, so every rank takes the same clip factor and the same decision to
skip a step with a non-finite norm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from dtensor_mimo.mimo import MimoModel


@dataclass(frozen=True)
class AdamWConfig:
    """Hyperparameters of every module's `torch.optim.AdamW`."""

    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float | None = 1.0  # None: no clipping


def _local_grad(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's gradient shard of `param` and how many distinct shards the gradient has."""
    grad = param.grad
    if not isinstance(grad, DTensor):
        return grad, 1
    if any(p.is_partial() for p in grad.placements):
        raise RuntimeError("a gradient is still a partial sum: call model.reduce_gradients() first")
    # Any placement but Replicate splits the gradient (Shard, and FSDP-over-TP's _StridedShard).
    shards = math.prod(grad.device_mesh.size(i) for i, p in enumerate(grad.placements)
                       if not p.is_replicate())
    return grad.to_local(), shards


def grad_sumsq_shares(model: "MimoModel") -> torch.Tensor:
    """Per module (in `model.module_names` order), this rank's share of the squared gradient
    norm (float64); summed over the world it is each module's squared norm."""
    shares = torch.zeros(len(model.module_names), dtype=torch.float64, device=model.device)
    for i, name in enumerate(model.module_names):
        par = model.layout.parallelism(name)
        ranks = par.dp * par.cp * par.tp  # ranks holding one pp stage of the module
        for param in model.module_parameters(name).values():
            if param.grad is None:
                continue
            grad, shards = _local_grad(param)
            shares[i] += grad.double().pow(2).sum() * shards / ranks
    return shares


class MimoOptimizer:
    """One AdamW per module held on this rank, stepping together with a global clip.

    Example::

        optimizer = MimoOptimizer(model, AdamWConfig(lr=1e-3))
        ...backward on every rank, model.reduce_gradients()...
        total_norm = world sum of grad_sumsq_shares(model), sqrt   (see `train_step`)
        optimizer.step(total_norm)
    """

    def __init__(self, model: "MimoModel", config: AdamWConfig = AdamWConfig()) -> None:
        self.model, self.config = model, config
        self.optimizers = {
            name: torch.optim.AdamW(list(params.values()), lr=config.lr, betas=config.betas,
                                    eps=config.eps, weight_decay=config.weight_decay)
            for name in model.module_names
            if (params := model.module_parameters(name))
        }

    def zero_grad(self) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)

    @torch.no_grad()
    def step(self, total_norm: float) -> bool:
        """Clip every gradient by the global `total_norm` and step; False (skipped) if it is not
        finite. `total_norm` must be the same on every rank (it is, from `train_step`)."""
        if not math.isfinite(total_norm):
            self.zero_grad()
            return False
        max_norm = self.config.max_grad_norm
        if max_norm is not None:
            coef = min(1.0, max_norm / (total_norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s rule
            if coef < 1.0:
                for opt in self.optimizers.values():
                    for group in opt.param_groups:
                        for p in group["params"]:
                            if p.grad is not None:
                                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                                grad.mul_(coef)
        for opt in self.optimizers.values():
            opt.step()
        return True
