"""Data parallel: FSDP2 with gradients summed (not averaged) over dp, or a plain all-reduce-sum.

Why a sum: the training loss is normalised by the global number of loss tokens (over every dp and
cp rank and microbatch), so each rank's gradient is already its share of the global gradient and
the shares must be added. FSDP2 divides by the dp size by default (a mean), which would make every
gradient dp times too small — and, when an encoder's dp differs from the LLM's, scale encoder and
LLM gradients differently. `apply_fsdp` therefore sets the divide factor to 1 on every FSDP module.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    blocks: Sequence[nn.Module],
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> None:
    """`fully_shard` each of `blocks`, then `model` (the rest of its parameters); sum over dp.

    Parameters that are already DTensors on a tp mesh become 2-D (dp x tp) DTensors; `dp_mesh` and
    that tp mesh must share one root mesh. `mp_policy`: FSDP2's mixed precision (default: none).
    """
    kwargs = dict(mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                  mp_policy=mp_policy or MixedPrecisionPolicy())
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            sum_gradients_over_dp(module)


def sum_gradients_over_dp(module: FSDPModule) -> None:
    """Make FSDP2 reduce this module's gradients with a plain sum over its dp mesh.

    `set_gradient_divide_factor(1.0)` alone asks for `ReduceOp.PREMUL_SUM(1.0)` on fp32/bf16,
    which gloo does not implement; forcing sum-only reductions makes FSDP2 use `ReduceOp.SUM`
    and skip the division by 1. Both setters act on this module's own parameter group only, so
    they are applied to every FSDP module.
    """
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)


@torch.no_grad()
def allreduce_gradients(module: nn.Module, dp_mesh: DeviceMesh | None,
                        reduce_dtype: torch.dtype | None = None) -> None:
    """Sum the gradients of `module`'s parameters over `dp_mesh` (the non-FSDP data parallel path).

    Call after backward, before clipping and the optimizer step, on every rank of the mesh.
    DTensor (tensor-parallel) gradients are reduced shard by shard: each tp rank sums its own
    shard with the same shard on the other dp replicas. Bucketed all-reduces per dtype
    (`sum_in_place`; plus one of presence flags), in `reduce_dtype` if given (e.g. bf16: half
    the bytes; the sums land back in the gradients' dtype). A mesh of size 1 or None does nothing.
    """
    if dp_mesh is None or dp_mesh.size() == 1:
        return
    group = dp_mesh.get_group()
    params = [p for p in module.parameters() if p.requires_grad]
    # A parameter unused on one dp rank (no gradient) may be used on another: agree on which
    # gradients exist, so every rank reduces the same flat buffers; unused everywhere stays None.
    here = [p.grad is not None for p in params]
    present = torch.tensor(here, dtype=torch.int32).to(params[0].device if params else dp_mesh.device_type,
                                                         non_blocking=True)
    dist.all_reduce(present, op=dist.ReduceOp.MAX, group=group)
    # A rank with every gradient knows them all present without reading the flags (a host sync);
    # only a rank missing some reads which another rank has.
    used_anywhere = [True] * len(params) if all(here) else [bool(u) for u in present.tolist()]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param, used in zip(params, used_anywhere):
        if not used:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        sum_in_place(grads, group, reduce_dtype)


BUCKET_BYTES = 32 << 20
"""About how many bytes `sum_in_place` reduces in one all-reduce."""


@torch.no_grad()
def sum_in_place(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup,
                 dtype: torch.dtype | None = None, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Replace each of `tensors` (one dtype) by its sum over `group`, in `dtype` if given (the
    sums land back in the tensors' own dtype).

    In buckets of consecutive tensors of about `bucket_bytes`, each one all-reduce of a flat
    copy (a tensor alone in its bucket, contiguous and already in `dtype`, is reduced where it
    lies, no copy), two in flight: one bucket's copies in and out overlap the next one's
    reduction, and the extra memory is two buckets, not a copy of every tensor. Every rank of
    `group` must pass tensors of the same shapes in the same order (the same buckets, so the
    same sequence of collectives: NCCL's rule), as replicas of one module do."""
    pending: list[tuple[list[torch.Tensor], torch.Tensor, dist.Work]] = []
    for bucket in _buckets(tensors, bucket_bytes):
        one = bucket[0]
        if len(bucket) == 1 and one.is_contiguous() and one.dtype == (dtype or one.dtype):
            flat = one.view(-1)  # reduced where it is
        else:
            flat = torch.cat([t.reshape(-1) for t in bucket]).to(dtype or one.dtype)
        pending.append((bucket, flat, dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)))
        if len(pending) == 2:
            _land(*pending.pop(0))
    for args in pending:
        _land(*args)


def _buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """`tensors` in order, cut into runs of about `bucket_bytes` (a larger tensor alone)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return buckets


def _land(bucket: list[torch.Tensor], flat: torch.Tensor, work: dist.Work) -> None:
    """Wait for `flat`'s reduction and copy the sums back into `bucket`'s tensors (nothing to
    copy when `flat` is the one tensor's own storage)."""
    work.wait()
    if flat.data_ptr() == bucket[0].data_ptr() and len(bucket) == 1:
        return
    offset = 0
    for t in bucket:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
