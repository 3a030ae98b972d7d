"""Parameters that stay identical over a mesh dim, and the proof that they do.

Tensor parallelism leaves some parameters whole on every tp rank: those its plan does not shard
(patch and position embeddings, convolutions, norms without sp). Their gradients are computed
from tp-replicated activations, so they agree on CPU — but nondeterministic GPU kernels may
make them differ in the last bits, and replicas that take different updates drift apart
silently. `average_tp_replicated_gradients` makes them identical by construction (one small
all-reduce over tp per step: the mean of copies that agree is the same copy); `check_replicas`
compares the replicas themselves, for debugging.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def tp_replicated(param: torch.Tensor) -> bool:
    """Whether `param` is held whole on every tp rank outside DTensor's tp bookkeeping: a plain
    tensor, or a DTensor on a mesh without a "tp" dim (e.g. FSDP2's dp-only sharding)."""
    return not isinstance(param, DTensor) or "tp" not in (param.device_mesh.mesh_dim_names or ())


@torch.no_grad()
def average_tp_replicated_gradients(params: Mapping[str, nn.Parameter], tp_mesh: DeviceMesh | None) -> None:
    """Replace the gradients of the tp-replicated `params` by their mean over `tp_mesh` (one flat
    all-reduce; nothing for tp 1). Call on every rank of the tp mesh after backward."""
    if tp_mesh is None or tp_mesh.size() == 1:
        return
    grads = [_local(p.grad) for p in params.values() if p.grad is not None and tp_replicated(p)]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, group=tp_mesh.get_group())  # SUM: gloo has no AVG
    flat /= tp_mesh.size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


@torch.no_grad()
def first_differing_replica(params: Mapping[str, nn.Parameter], mesh: DeviceMesh) -> str | None:
    """The name of the first of `params` (this rank's local values) that is not bitwise equal on
    every rank of `mesh`, or None. One MAX and one MIN all-reduce over `mesh`."""
    if mesh.size() == 1 or not params:
        return None
    names = list(params)
    flat = torch.cat([_local(p).detach().reshape(-1).double() for p in params.values()])
    high, low = flat.clone(), flat.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=mesh.get_group())
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=mesh.get_group())
    differs = high != low
    offset = 0
    for name, p in zip(names, params.values()):
        n = _local(p).numel()
        if differs[offset:offset + n].any():
            return name
        offset += n
    return None
