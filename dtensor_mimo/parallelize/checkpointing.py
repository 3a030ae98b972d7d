"""Activation checkpointing per transformer block, keeping parameter names unchanged."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


@contextlib.contextmanager
def buffers_set_aside(module: nn.Module) -> Iterator[None]:
    """While a forward of `module` is recomputed (activation checkpointing, an encoder's
    ``recompute_colocated``): each of its buffers replaced by a copy, the module's own put back
    after. A BatchNorm's running statistics and `num_batches_tracked`, updated in place by every
    forward in training mode, took the batch in the first forward already; without this they
    counted it twice (the copies also keep what the recomputed graph saved). A module without
    buffers (the library's blocks): nothing."""
    held = [(m, name, b) for m in module.modules() for name, b in m._buffers.items() if b is not None]
    for m, name, b in held:
        m._buffers[name] = b.detach().clone()
    try:
        yield
    finally:
        for m, name, b in held:
            m._buffers[name] = b


def _recomputed(block: nn.Module, forward, *args, **kwargs):
    if next(block.buffers(), None) is not None:  # (the library's blocks hold none)
        kwargs["context_fn"] = lambda: (contextlib.nullcontext(), buffers_set_aside(block))
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(blocks: nn.ModuleDict, every: int, compile_backend: str | None = None,
                      compile_mode: str | None = None, compile_options: Mapping[str, Any] | None = None,
                      first: int = 0, dynamic: bool | None = None) -> set[str]:
    """Recompute the activations of every `every`-th block (the first, then every n-th) in
    backward instead of keeping them; returns the names of those blocks. `first`: the position
    of the first of `blocks` in the whole stack (a pipeline stage's blocks are counted as the
    whole module's: with `every` 2 the stage holding blocks 3-5 checkpoints block 4 alone).

    The block's own ``forward`` is wrapped in place (non-reentrant `torch.utils.checkpoint`),
    not the block in a wrapper module, so parameter names and checkpoints stay those of the
    eager model. With `compile_backend` (and torch.compile's `compile_mode` or `compile_options`), the block's
    forward is compiled *inside* the checkpoint (torch 2.13's traced checkpoint region fails on
    DTensor activations: "expected all tensors_saved_with_vc_check to be Tensors");
    recomputation reruns the compiled code; `dynamic`: torch.compile's (`compile_blocks`).
    Applied before FSDP2, whose hooks sit outside ``forward``: its pre-backward unshard runs
    before the recomputation needs the parameters.
    """
    names = set()
    for i, (name, block) in enumerate(blocks.items(), start=first):
        if i % every == 0:
            forward = block.forward
            if compile_backend is not None:
                forward = torch.compile(forward, backend=compile_backend, mode=compile_mode, options=compile_options,
                                        dynamic=dynamic)
            block.forward = functools.partial(_recomputed, block, forward)
            names.add(name)
    return names
