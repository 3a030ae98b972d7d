"""Mixed precision, one meaning with or without FSDP2: compute in `ParallelOptions.param_dtype`,
keep the parameters, their gradients and the optimizer state in the parameters' own dtype (fp32
master weights), sum gradients over dp in `ParallelOptions.gradient_reduce_dtype`.

- With FSDP2 (dp > 1): its `MixedPrecisionPolicy` — parameters all-gathered in `param_dtype`
  (half the bytes), gradients reduce-scattered in the reduce dtype and kept in fp32.
- Without FSDP2: the module's forward runs under `torch.autocast(param_dtype)` (matmuls and
  attention in bf16, norms and softmax in fp32, as autocast decides); gradients land in the
  parameters' dtype and `allreduce_gradients` sums them in the reduce dtype.

What leaves a module towards another — a pipeline stage's hidden states, encoder rows crossing
the bridge — is cast to the compute dtype (`compute_dtype`), so it moves half the bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from dtensor_mimo.parallelize.fsdp import apply_fsdp
from dtensor_mimo.parallelize.options import ParallelOptions


FP32_INPUTS = "keeps_float_inputs"
"""A root module's class attribute: True where its floating forward inputs must reach it in their
own dtype under FSDP2's mixed precision (its activations arrive in the compute dtype already)."""


def compute_dtype(options: ParallelOptions, module: nn.Module) -> torch.dtype:
    """The dtype `module` computes in: `options.param_dtype`, else its parameters' dtype."""
    if options.param_dtype is not None:
        return options.param_dtype
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.get_default_dtype())


def uses_fsdp(options: ParallelOptions, dp_mesh: DeviceMesh | None, one_rank: bool = False) -> bool:
    """Whether a module with `options` on `dp_mesh` is sharded by FSDP2 (`one_rank`: also on a
    mesh of one rank)."""
    return options.fsdp and dp_mesh is not None and (dp_mesh.size() > 1 or one_rank)


def apply_data_parallel(root: nn.Module, dp_mesh: DeviceMesh | None, blocks: Sequence[nn.Module],
                        options: ParallelOptions, one_rank: bool = False) -> None:
    """FSDP2 on `blocks` and `root` over `dp_mesh` with the options' mixed precision policy when
    `options.fsdp` and dp > 1 (`one_rank`: or 1); otherwise (gradients summed later by
    `allreduce_gradients`) autocast around `root`'s forward when `options.param_dtype` is set."""
    if uses_fsdp(options, dp_mesh, one_rank):
        policy = MixedPrecisionPolicy(param_dtype=options.param_dtype,
                                      reduce_dtype=options.gradient_reduce_dtype)
        # FSDP2 casts every floating forward input of a module to param_dtype: a root whose float
        # inputs are not activations (the language stage's loss weights, `FP32_INPUTS`) keeps them
        root_policy = dataclasses.replace(policy, cast_forward_inputs=False) if getattr(
            root, FP32_INPUTS, False) else policy
        apply_fsdp(root, dp_mesh, blocks, options.reshard_after_forward, policy, root_policy)
    elif options.param_dtype is not None:
        autocast_forward(root, options.param_dtype)


def autocast_forward(module: nn.Module, dtype: torch.dtype) -> None:
    """Run every forward of `module` under ``torch.autocast(<its device type>, dtype)``.

    Hooks rather than a wrapper keep the module and its parameter names unchanged; the exit hook
    runs even when forward raises, so the autocast state never leaks.
    """
    active: list[torch.autocast] = []

    def enter(mod: nn.Module, _args: tuple) -> None:
        device = next(mod.parameters()).device
        context = torch.autocast(device.type, dtype=dtype)
        context.__enter__()
        active.append(context)

    def leave(_mod: nn.Module, _args: tuple, _output: object) -> None:
        active.pop().__exit__(None, None, None)

    # Eager even when the module itself is compiled (`nn.Module.compile` traces its hooks): the
    # autocast state they set is then a guard of the compiled graph, not part of it.
    module.register_forward_pre_hook(torch.compiler.disable(enter))
    module.register_forward_hook(torch.compiler.disable(leave), always_call=True)
