"""Parameters that stay identical over a mesh dim, and the proof that they do.

Tensor parallelism leaves some parameters whole on every tp rank: those its plan does not shard
(patch and position embeddings, convolutions, norms without sp). Most of them see tp-replicated
activations, so their gradients agree on CPU — but nondeterministic GPU kernels may make them
differ in the last bits, and replicas that take different updates drift apart silently.
`reduce_tp_replicated_gradients` makes them identical by construction (one small all-reduce over
tp per step: the mean of copies that agree is the same copy). A few see only this rank's heads
(Qwen3's per-head q/k norms, shared by every head): their gradient is the SUM over tp, which the
same all-reduce gives them (`head_local`). `first_differing_replica` compares the replicas
themselves, for debugging.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dtensor_mimo.models.layers import local_part
from dtensor_mimo.parallelize.reducer import (GradientReducer, allreduce_gradients, place_gradients, sum_gradients,
                                             sum_in_place)
from dtensor_mimo.parallelize.options import ParallelOptions
from dtensor_mimo.parallelize.precision import uses_fsdp


def tp_replicated(param: torch.Tensor) -> bool:
    """Whether `param` is held whole on every tp rank outside DTensor's tp bookkeeping: a plain
    tensor, or a DTensor on a mesh without a "tp" dim (e.g. FSDP2's dp-only sharding)."""
    return not isinstance(param, DTensor) or "tp" not in (param.device_mesh.mesh_dim_names or ())


def whole_over_tp(param: torch.Tensor) -> bool:
    """Whether every tp rank holds the same copy of `param`'s local part: a `tp_replicated` one,
    or a DTensor replicated over its mesh's "tp" dim (the norms under sp; FSDP2's 2-D ones, dp
    shards replicated over tp). Their copies must stay identical (`first_differing_replica`)."""
    return tp_replicated(param) or param.placements[param.device_mesh.mesh_dim_names.index("tp")].is_replicate()


# Parameters that act on this rank's heads only (a tp shard of the heads), shared by all heads.
HEAD_LOCAL = ("attention.q_norm.weight", "attention.k_norm.weight")


def head_local(name: str) -> bool:
    """Whether the parameter `name` is one of `HEAD_LOCAL` (its tp gradient is a partial sum)."""
    return name.endswith(HEAD_LOCAL)


@torch.no_grad()
def reduce_tp_replicated_gradients(params: Mapping[str, nn.Parameter], tp_mesh: DeviceMesh | None,
                                   summed: Callable[[str], bool] = head_local) -> None:
    """Make the gradients of the tp-replicated `params` identical over `tp_mesh`: their mean, or
    their sum for the names `summed` picks (partial per rank). Bucketed all-reduces per dtype;
    nothing for tp 1. Call on every rank of the tp mesh after backward."""
    if tp_mesh is None or tp_mesh.size() == 1:
        return
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = defaultdict(list)
    for name, p in params.items():
        if p.grad is not None and tp_replicated(p):
            by_dtype[p.grad.dtype].append((name, local_part(p.grad)))
    for grads in by_dtype.values():
        sum_in_place([g for _, g in grads], tp_mesh.get_group())  # a sum: gloo has no AVG
        for name, g in grads:
            if not summed(name):
                g.div_(tp_mesh.size())


@torch.no_grad()
def first_differing_replica(params: Mapping[str, nn.Parameter], mesh: DeviceMesh,
                            chunk_elements: int = 1 << 24) -> str | None:
    """The name of the first of `params` (this rank's local values) that is not bitwise equal on
    every rank of `mesh`, or None. A MAX and a MIN all-reduce over `mesh` per group of parameters
    of about `chunk_elements` (memory: three copies of one group, in fp32 or fp64, which hold
    every lower precision exactly)."""
    if mesh.size() == 1 or not params:
        return None
    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, p in params.items():
        if groups[-1] and size + local_part(p).numel() > chunk_elements:
            groups.append([])
            size = 0
        groups[-1].append((name, local_part(p).detach()))
        size += groups[-1][-1][1].numel()
    for group in groups:
        dtype = torch.float64 if any(t.dtype == torch.float64 for _, t in group) else torch.float32
        flat = torch.cat([t.reshape(-1).to(dtype) for _, t in group])
        high, low = flat.clone(), flat
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=mesh.get_group())
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=mesh.get_group())
        differs, offset = high != low, 0
        for name, t in group:
            if differs[offset:offset + t.numel()].any():
                return name
            offset += t.numel()
    return None


def replica_problems(name: str, params: Mapping[str, nn.Parameter], tp_mesh: DeviceMesh | None,
                     dp_mesh: DeviceMesh | None, options: ParallelOptions) -> list[str]:
    """What differs among module `name`'s replicas: the parameters tp leaves whole over
    `tp_mesh` (`whole_over_tp`); every parameter over `dp_mesh` when the module does not use
    FSDP2, and with HSDP each shard over its replica groups (the parameters' "dp_replicate" dim)."""
    checks = [("tp", tp_mesh, {n: p for n, p in params.items() if whole_over_tp(p)})]
    if not uses_fsdp(options, dp_mesh):
        checks.append(("dp·cp", dp_mesh, params))
    elif hsdp := {n: p for n, p in params.items() if isinstance(p, DTensor)
                  and "dp_replicate" in (p.device_mesh.mesh_dim_names or ())}:
        checks.append(("dp_replicate", next(iter(hsdp.values())).device_mesh["dp_replicate"], hsdp))
    return [f"module {name!r}: parameter {bad!r} differs over {dim}" for dim, mesh, group in checks
            if mesh is not None and (bad := first_differing_replica(group, mesh)) is not None]


@torch.no_grad()
def finish_gradients(module: nn.Module, params: Mapping[str, nn.Parameter], tp_mesh: DeviceMesh | None,
                     dp_mesh: DeviceMesh | None, options: ParallelOptions,
                     reducer: GradientReducer | None = None) -> str | None:
    """After backward, make `module`'s gradients (`params`: its parameters by name) what
    clipping and the optimizer expect: summed over `dp_mesh` without FSDP2 (FSDP2 already did),
    tp-replicated ones made identical (`reduce_tp_replicated_gradients`), and every gradient put
    on its parameter's placements: pending partial sums (the norm weights under sp) reduced, and
    replicated ones sharded like their parameter (the vocabulary-parallel embedding's: DTensor's
    embedding backward gives the whole table's gradient on every tp rank). So each rank keeps
    only its shard of every gradient, and AdamW's fused kernel steps the gradients themselves,
    not redistributed copies (whose clipping, `MimoOptimizer.launch`, would not be written back).
    `reducer`: the module's `GradientReducer`, whose buckets backward may already have launched
    (it then does the dp sums; returns its complaint, if any). Call on every rank of the
    module's meshes."""
    place_gradients(params.values())  # first: a replicated gradient sharded crosses dp 1/tp as large
    problem = None
    if reducer is not None:
        problem = reducer.finish()
        # Parameters made trainable after the reducer was built (its buckets are fixed then): summed
        # after backward, as `allreduce_gradients` sums every parameter that requires a gradient now.
        sum_gradients({n: p for n, p in params.items() if p.requires_grad and n not in reducer.known},
                      reducer.group, reducer.reduce_dtype, options.grad_bucket_bytes)
    elif not uses_fsdp(options, dp_mesh):
        allreduce_gradients(module, dp_mesh, options.gradient_reduce_dtype, options.grad_bucket_bytes)
    reduce_tp_replicated_gradients(params, tp_mesh)
    return problem
