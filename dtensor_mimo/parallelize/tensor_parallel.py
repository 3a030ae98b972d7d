"""Tensor- and sequence-parallel building blocks shared by every module kind.

One plan shape serves the Llama decoder and the ViT / audio encoders: a pre-norm block
`h = x + attn(norm(x)); out = h + mlp(norm(h))` whose attention input projections and first MLP
projection(s) are colwise, and whose attention output and last MLP projection are rowwise.

Activation contract of a parallelized block (the residual stream between blocks):

- without sp: a plain tensor `[B, S, dim]`, replicated over tp (Megatron-style TP);
- with sp: a DTensor on the tp mesh, `Shard(1)` (each rank holds a contiguous chunk of the
  sequence in the `torch.chunk` pattern, so S need not divide tp). Rowwise layers therefore keep
  `use_local_output=False`: a residual add of a DTensor and a local tensor would fail.

The first block of a module also accepts a plain tensor replicated over tp under sp, or a DTensor
with any placement on the tp mesh (`shard_sequence_on_entry`); it reshards it to `Shard(1)`
locally (a slice, no communication; its gradient is all-gathered, so the caller's gradient is the
full, replicated one). `replicated_local_output` turns whatever a module returns back into a plain
tensor replicated over tp, the form every module hands to the next one.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

SEQUENCE_DIM = 1  # activations are [batch, sequence, hidden] everywhere


def block_plan(
    *,
    sp: bool,
    attention: str,
    attention_colwise: tuple[str, ...],
    attention_rowwise: str,
    attention_extra_args: int,
    mlp: str,
    mlp_colwise: tuple[str, ...],
    mlp_rowwise: str,
    norms: tuple[str, ...],
) -> dict[str, ParallelStyle]:
    """The `parallelize_module` plan of one pre-norm transformer block.

    `attention` / `mlp` are submodule names; the projection names are relative to them.
    `attention_extra_args` counts the positional arguments the attention module takes after the
    activation (rope, indices, ...): they pass through untouched.
    """
    plan: dict[str, ParallelStyle] = {}
    for name in attention_colwise:
        plan[f"{attention}.{name}"] = ColwiseParallel()
    for name in mlp_colwise:
        plan[f"{mlp}.{name}"] = ColwiseParallel()
    if not sp:
        plan[f"{attention}.{attention_rowwise}"] = RowwiseParallel()
        plan[f"{mlp}.{mlp_rowwise}"] = RowwiseParallel()
        return plan
    # Sequence parallel: norms on the sequence shard; attention and MLP all-gather their input
    # (to a plain local tensor, so the module's own code sees ordinary tensors) and their rowwise
    # output is reduce-scattered back onto the sequence shard, kept as a DTensor for the residual.
    for name in norms:
        plan[name] = SequenceParallel(sequence_dim=SEQUENCE_DIM)
    extra = (None,) * attention_extra_args
    plan[attention] = PrepareModuleInput(
        input_layouts=(Shard(SEQUENCE_DIM), *extra),
        desired_input_layouts=(Replicate(), *extra),
        use_local_output=True,
    )
    plan[mlp] = PrepareModuleInput(
        input_layouts=(Shard(SEQUENCE_DIM),),
        desired_input_layouts=(Replicate(),),
        use_local_output=True,
    )
    rowwise = RowwiseParallel(output_layouts=Shard(SEQUENCE_DIM), use_local_output=False)
    plan[f"{attention}.{attention_rowwise}"] = rowwise
    plan[f"{mlp}.{mlp_rowwise}"] = RowwiseParallel(
        output_layouts=Shard(SEQUENCE_DIM), use_local_output=False
    )
    return plan


def weight_splits(plan: dict[str, ParallelStyle]) -> dict[str, int]:
    """The weight dim `plan` shards in each layer it names column- or row-parallel: 0 (the out
    features) for ``ColwiseParallel``, 1 (the in features) for ``RowwiseParallel``."""
    return {name: 0 if isinstance(style, ColwiseParallel) else 1 for name, style in plan.items()
            if isinstance(style, (ColwiseParallel, RowwiseParallel))}


def parallelize_blocks(blocks: Iterable[nn.Module], tp_mesh: DeviceMesh, layer_plan: dict[str, ParallelStyle],
                       *, sp: bool) -> None:
    """Apply `layer_plan` to every block; under sp each block also accepts a replicated input."""
    for block in blocks:
        parallelize_module(block, tp_mesh, layer_plan)
        if sp:
            shard_sequence_on_entry(block, tp_mesh)


def shard_sequence_on_entry(block: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Under sp, make `block` accept a plain (replicated) or any-placement DTensor activation.

    Registered on every block, it acts only where the activation is not yet a `Shard(1)`
    DTensor: the first block, or a pipeline stage's first block.
    """

    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (to_sequence_shard(args[0], tp_mesh), *args[1:])

    block.register_forward_pre_hook(hook)


def to_sequence_shard(x: torch.Tensor, tp_mesh: DeviceMesh) -> DTensor:
    """A plain tensor (replicated over tp) or a DTensor on `tp_mesh` -> DTensor `Shard(1)`.

    Every block but a stage's first receives its sequence shard already: that test is all a
    compiled block traces. The conversion itself runs outside the graph (`_to_sequence_shard`):
    dynamo cannot trace ``DTensor.from_local`` or ``redistribute`` here (torch 2.13: a
    ``DTensorSpec`` argument it cannot proxy, a debug-mode lookup it skips), and the graph
    breaks they caused split the first block into three graphs; now one clean break before it."""
    if isinstance(x, DTensor) and x.device_mesh == tp_mesh and tuple(x.placements) == (Shard(SEQUENCE_DIM),):
        return x
    return _to_sequence_shard(x, tp_mesh)


@torch.compiler.disable
def _to_sequence_shard(x: torch.Tensor, tp_mesh: DeviceMesh) -> DTensor:
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False, shape=x.shape, stride=x.stride())
    elif x.device_mesh != tp_mesh:
        raise ValueError(
            f"sequence-parallel input is a DTensor on mesh {x.device_mesh}, expected the module's "
            f"tp mesh {tp_mesh}; build it on that mesh, or pass the plain full tensor"
        )
    if tuple(x.placements) != (Shard(SEQUENCE_DIM),):
        x = x.redistribute(tp_mesh, [Shard(SEQUENCE_DIM)])
    return x


def replicated_local_output(module: nn.Module, keep_vocab_shards: bool = False) -> None:
    """Make `module` return a plain tensor replicated over tp, whatever its last layer returns;
    with `keep_vocab_shards`, logits sharded over their last dim (loss_parallel) stay a DTensor."""

    def hook(mod: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if not isinstance(output, DTensor):
            return output
        if keep_vocab_shards and any(p.is_shard(output.ndim - 1) or p.is_shard(-1) for p in output.placements):
            return output
        return output.full_tensor()

    module.register_forward_hook(hook)


def tp_size(tp_mesh: DeviceMesh | None) -> int:
    """1 without a tp mesh; tensor parallelism is applied only when this is > 1."""
    return 1 if tp_mesh is None else tp_mesh.size()


def check_divisible(module_name: str, sizes: dict[str, int], tp: int) -> None:
    """Raise naming every size that tensor parallelism over `tp` ranks cannot split evenly."""
    bad = {name: size for name, size in sizes.items() if size % tp != 0}
    if bad:
        detail = ", ".join(f"{name}={size}" for name, size in bad.items())
        raise ValueError(
            f"{module_name}: tensor parallel over tp={tp} needs these sizes divisible by {tp}: "
            f"{detail}; choose a tp that divides them"
        )
