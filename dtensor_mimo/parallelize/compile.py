"""Per-block `torch.compile`, keeping parameter names unchanged."""

from __future__ import annotations

from torch import nn


def compile_blocks(blocks: nn.ModuleDict, backend: str = "inductor", skip: set[str] = frozenset()) -> None:
    """Compile each block in place with `nn.Module.compile`.

    In-place compilation (rather than wrapping in an `OptimizedModule`) keeps parameter names free
    of `_orig_mod.`, so checkpoints, `init_weights` and gradient comparisons see the same names as
    the eager model. The block's hooks (tensor-parallel input/output preparation) are compiled with
    it; FSDP2's hooks, registered afterwards, are left to eager by dynamo.
    """
    for block in blocks.values():
        block.compile(backend=backend)
