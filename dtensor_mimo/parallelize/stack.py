"""The order every transformer stack is parallelized in: tensor parallel, activation checkpointing,
per-block compile, FSDP2 (or autocast without it)."""

from __future__ import annotations

from typing import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtensor_mimo.parallelize.checkpointing import checkpoint_blocks
from dtensor_mimo.parallelize.compile import compile_blocks
from dtensor_mimo.parallelize.options import ParallelOptions
from dtensor_mimo.parallelize.precision import apply_data_parallel
from dtensor_mimo.parallelize.tensor_parallel import tp_size


def parallelize_stack(
    model: nn.Module,
    tp_mesh: DeviceMesh | None,
    dp_mesh: DeviceMesh | None,
    options: ParallelOptions,
    apply_tp: Callable[..., None],
) -> nn.Module:
    """`apply_tp(model, tp_mesh, options)` when tp > 1, then activation checkpointing and compile
    of `model.layers` block by block, then FSDP2 over `dp_mesh` (each block, then the rest) when
    asked and dp > 1, with the options' mixed precision (autocast without FSDP); returns `model`.

    A module without ``layers`` (an ``nn.ModuleDict``) is compiled and sharded as one unit; it
    cannot take activation checkpointing (refused)."""
    if tp_size(tp_mesh) > 1:
        apply_tp(model, tp_mesh, options)
    blocks = getattr(model, "layers", None)
    if not isinstance(blocks, nn.ModuleDict):
        if options.activation_checkpointing:
            raise ValueError(f"{type(model).__name__} has no `layers` ModuleDict of blocks to checkpoint; "
                             "set activation_checkpointing=0")
        if options.compile:
            model.compile(backend=options.compile_backend)
        apply_data_parallel(model, dp_mesh, [], options)
        return model
    backend = options.compile_backend if options.compile else None
    done = (checkpoint_blocks(blocks, options.activation_checkpointing, backend)
            if options.activation_checkpointing else set())
    if options.compile:
        compile_blocks(blocks, options.compile_backend, skip=done)
    apply_data_parallel(model, dp_mesh, list(blocks.values()), options)
    return model


def user_tp_plan(model: nn.Module, tp_mesh: DeviceMesh, options: ParallelOptions) -> None:
    """A user module's own tensor parallel plan: its ``parallelize(tp_mesh, options)`` method
    (see `dtensor_mimo.models.protocol`)."""
    model.parallelize(tp_mesh, options)
