"""Data parallel with FSDP2, gradients summed (not averaged) over dp (without FSDP2:
`dtensor_mimo.parallelize.reducer`).

Why a sum: the training loss is normalised by the global number of loss tokens (over every dp and
cp rank and microbatch), so each rank's gradient is already its share of the global gradient and
the shares must be added. FSDP2 divides by the dp size by default (a mean), which would make every
gradient dp times too small — and, when an encoder's dp differs from the LLM's, scale encoder and
LLM gradients differently. `apply_fsdp` therefore sets the divide factor to 1 on every FSDP module.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    blocks: Sequence[nn.Module],
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    root_policy: MixedPrecisionPolicy | None = None,
) -> None:
    """`fully_shard` each of `blocks`, then `model` (the rest of its parameters); sum over dp.
    `reshard_after_forward` applies to `blocks`; the root `model` is never resharded after forward.

    Parameters that are already DTensors on a tp mesh become 2-D (dp x tp) DTensors; `dp_mesh` and
    that tp mesh must share one root mesh. `mp_policy`: FSDP2's mixed precision (default: none);
    `root_policy`: the root's own (default: `mp_policy`).
    """
    kwargs = dict(mesh=dp_mesh, mp_policy=mp_policy or MixedPrecisionPolicy())
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root keeps its parameters gathered from forward to backward (FSDP2's own default for a
    # root: its backward starts at once). torch keeps that default only for `None`: an explicit
    # True reshards the root too, and its backward all-gathers them again (a decoder's embeddings
    # and output head, its largest tensors).
    fully_shard(model, reshard_after_forward=None if reshard_after_forward else False,
                **{**kwargs, "mp_policy": root_policy or kwargs["mp_policy"]})
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


def fsdp_units(module: nn.Module) -> list[FSDPModule]:
    """`module`'s FSDP2 modules (itself included), found on the first call after `apply_fsdp` and
    kept: a walk of every submodule on each step would be host work that grows with the model."""
    found = module.__dict__.get("_mimo_fsdp_units")
    if found is None:
        found = module.__dict__["_mimo_fsdp_units"] = [m for m in module.modules() if isinstance(m, FSDPModule)]
    return found


def reshard_fsdp_modules(module: nn.Module) -> None:
    """Put every FSDP2 module in `module` back on its parameter shards, freeing gathered copies
    (no communication; a module already sharded stays as it is).

    Why: FSDP2 never reshards a root after forward (`apply_fsdp`) but in its backward, so a
    forward without one (``MimoModel.predict``) leaves the root's parameters gathered, and the
    next forward uses that copy without gathering again. Weights written into the shards
    meanwhile (a checkpoint load) would go unseen by that forward and its gradients, and weights
    written through the module's registered parameters (the gathered copy then) would be dropped
    by the next reshard: call this before writing weights."""
    for m in fsdp_units(module):
        m.reshard()


def reduce_in_this_backward(module: nn.Module) -> None:
    """From now on, FSDP2 root `module` reduce-scatters each block's gradients as this backward
    produces them, and reshards (called as a pipeline stage's last backward of the step begins:
    `dtensor_mimo.parallelize.reducer.LastBackward`). Not FSDP2's "last backward": its end-of-
    backward callback would make the compute stream wait for every reduce-scatter, and the
    stage's gradient send to the stage before it with it (the pipeline's drain); torch's
    reduction after the schedule waits for them instead.

    torch's pipeline stages keep FSDP2 from reducing in every backward of a step (each microbatch
    accumulates unsharded gradients) and reduce all of a stage's gradients after the schedule
    (``perform_reduce_grad``), so none of that communication overlaps compute, not even at one
    microbatch. Turned on inside the stage's last backward (after torch turned it off for it),
    FSDP2's own post-backward hooks reduce-scatter block by block while the blocks before them
    compute, as FSDP2 does outside pipelines. torch's reduction after the schedule then finds
    no gradient left to reduce (FSDP2's post-backward is idempotent) and only waits. Every rank
    of the dp group runs the same stages, microbatches and blocks, so the reduce-scatters come in
    the same order on each (NCCL's rule), as they did after the schedule."""
    if isinstance(module, FSDPModule):
        module.set_reshard_after_backward(True)
        module.set_requires_gradient_sync(True)
