"""Activation checkpointing per transformer block, keeping parameter names unchanged."""

from __future__ import annotations

import functools
from typing import Any, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _recomputed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(blocks: nn.ModuleDict, every: int, compile_backend: str | None = None,
                      compile_mode: str | None = None, compile_options: Mapping[str, Any] | None = None,
                      first: int = 0) -> set[str]:
    """Recompute the activations of every `every`-th block (the first, then every n-th) in
    backward instead of keeping them; returns the names of those blocks. `first`: the position
    of the first of `blocks` in the whole stack (a pipeline stage's blocks are counted as the
    whole module's: with `every` 2 the stage holding blocks 3-5 checkpoints block 4 alone).

    The block's own ``forward`` is wrapped in place (non-reentrant `torch.utils.checkpoint`),
    not the block in a wrapper module, so parameter names and checkpoints stay those of the
    eager model. With `compile_backend` (and torch.compile's `compile_mode` or `compile_options`), the block's
    forward is compiled *inside* the checkpoint (torch 2.13's traced checkpoint region fails on
    DTensor activations: "expected all tensors_saved_with_vc_check to be Tensors");
    recomputation reruns the compiled code.
    Applied before FSDP2, whose hooks sit outside ``forward``: its pre-backward unshard runs
    before the recomputation needs the parameters.
    """
    names = set()
    for i, (name, block) in enumerate(blocks.items(), start=first):
        if i % every == 0:
            forward = block.forward
            if compile_backend is not None:
                forward = torch.compile(forward, backend=compile_backend, mode=compile_mode, options=compile_options)
            block.forward = functools.partial(_recomputed, forward)
            names.add(name)
    return names
