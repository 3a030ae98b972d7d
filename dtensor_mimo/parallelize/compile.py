"""Per-block `torch.compile`, keeping parameter names unchanged; dynamo's recompile limit sized for
the stacks whose compiled pieces share code (`share_variants`)."""

from __future__ import annotations

import weakref
from typing import AbstractSet, Any, Mapping

import torch
from torch import nn

VARIANTS_PER_STACK = 8
"""Compiled variants dynamo keeps of one stack's pieces: torch's default ``recompile_limit`` (a
stack's first count of rows, then any count; calls of no row and of one row; training and no-grad)."""

_SHARERS: dict[Any, weakref.WeakSet] = {}
"""Per compiled forward (its code object), the stacks whose pieces run it."""


def compile_blocks(blocks: nn.ModuleDict, backend: str = "inductor", skip: AbstractSet[str] = frozenset(),
                   mode: str | None = None, options: Mapping[str, Any] | None = None,
                   dynamic: bool | None = None) -> None:
    """Compile each block in place with `nn.Module.compile`, except the blocks named in `skip`;
    `mode` and `options`: torch.compile's (`ParallelOptions.compile_kwargs`; one or the other),
    None for its defaults; `dynamic`: torch.compile's (False: static shapes, one variant each).

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
            block.compile(backend=backend, mode=mode, options=options,
                          **({} if dynamic is None else {"dynamic": dynamic}))


def share_variants(stack: nn.Module, *pieces: nn.Module) -> None:
    """Keep dynamo's recompile limit at `VARIANTS_PER_STACK` for each stack whose compiled
    `pieces` (blocks, the stack whole, an encoder whole) run the same code as another's.

    Dynamo keeps one cache per code object, not per module: every `EncoderBlock` (a ViT's and an
    audio encoder's), every `Projection`, every `ModalityEncoder` compiled whole shares one, and
    its limit (``torch._dynamo.config.recompile_limit``, 8) counts the variants of all of them. Two
    encoders with their own norm eps, each called on one item, on several and on none, in training
    and in no-grad predictions, need more; past the limit dynamo runs each new variant eager,
    silently, for the rest of the process. The limit is raised (never lowered) to
    `VARIANTS_PER_STACK` times the most live stacks sharing one piece's code."""
    for piece in pieces:
        code = getattr(type(piece).forward, "__code__", None)
        if code is None:
            continue
        sharers = _SHARERS.setdefault(code, weakref.WeakSet())
        sharers.add(stack)
        need = VARIANTS_PER_STACK * len(sharers)
        if torch._dynamo.config.recompile_limit < need:
            torch._dynamo.config.recompile_limit = need
