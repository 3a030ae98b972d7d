"""Per-block `torch.compile`, keeping parameter names unchanged."""

from __future__ import annotations

from typing import AbstractSet, Any, Mapping

from torch import nn


def compile_blocks(blocks: nn.ModuleDict, backend: str = "inductor", skip: AbstractSet[str] = frozenset(),
                   mode: str | None = None, options: Mapping[str, Any] | None = None) -> None:
    """Compile each block in place with `nn.Module.compile`, except the blocks named in `skip`;
    `mode` and `options`: torch.compile's (`ParallelOptions.compile_kwargs`; one or the other),
    None for its defaults.

    `skip`: blocks already compiled another way — `checkpoint_blocks` compiles a checkpointed
    block's forward *inside* its checkpoint; compiling it again from outside would trace the
    checkpoint itself (torch's traced checkpoint region, which fails on DTensor activations).

    In-place compilation (rather than wrapping in an `OptimizedModule`) keeps parameter names free
    of `_orig_mod.`, so checkpoints, `init_weights` and gradient comparisons see the same names as
    the eager model. The block's hooks (tensor-parallel input/output preparation) are compiled with
    it; FSDP2's hooks, registered afterwards, are left to eager by dynamo.
    """
    for name, block in blocks.items():
        if name not in skip:
            block.compile(backend=backend, mode=mode, options=options)
