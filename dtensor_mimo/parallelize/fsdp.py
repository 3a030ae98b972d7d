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
