"""How this package drives torch's schedule objects: one step on our own microbatches, and the
per-shape cache of stages and schedules (torch's stage links have static shapes)."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Callable, Hashable, Sequence

import torch
from torch.distributed.fsdp import FSDPModule

CACHED_SHAPES = 4
"""Stages + schedule kept per module for this many shapes (sequence lengths, item buckets);
each holds receive buffers for every microbatch, so the least recently used beyond it are dropped."""


_NOTHING = contextlib.nullcontext()


def phase(*words: object) -> contextlib.AbstractContextManager:
    """A range named ``"mimo."`` + `words` (those not None, space-separated) in the trace of a
    running torch.profiler, e.g. ``mimo.encode 0 vision``: the host ops inside it, and the device
    work they launch, are attributed to it (`benchmarks/gpu.py --profile` reports device time and
    idle time by these ranges). Without a profiler running, nothing: a step pays one check."""
    if not torch._C._autograd._profiler_enabled():
        return _NOTHING
    return torch.profiler.record_function("mimo." + " ".join(str(w) for w in words if w is not None))


def cached(cache: OrderedDict, key: Hashable, build: Callable[[], Any]) -> Any:
    """`cache[key]`, built on first use; keeps the `CACHED_SHAPES` most recently used.

    Every rank of a pp group asks for the same keys in the same order (keys come from the batch
    metadata that all of them hold), so they build, and warm up, the same stages together."""
    if key in cache:
        cache.move_to_end(key)
    else:
        cache[key] = build()
        while len(cache) > CACHED_SHAPES:
            cache.popitem(last=False)
    return cache[key]


def run_schedule(schedule: Any, stages: Sequence[Any], args: list[tuple], kwargs: list[dict] | None,
                 targets: list | None, losses: list | None = None) -> None:
    """One forward + backward of `schedule` (over this rank's `stages`, the `PipelineStage`s it was
    built with) on per-microbatch `args` / `kwargs` / `targets`.

    What torch's public ``step()`` does, minus its split of one batch into chunks: a microbatch
    here is a slice of the GLOBAL batch, dp-sharded afterwards, which is not a chunk of this
    rank's shard (and an encoder's microbatches hold ragged item counts, which torch's even
    chunking cannot express), so the lists are built by the caller. torch 2.13 has no public
    entry point for that: ``_step_microbatches`` is private, pinned by
    tests/test_schedule_config.py::test_private_torch_pipelining_api_we_rely_on.
    """
    # torch reshards every FSDP2 module of a stage, and drops its gradients, when it first runs a
    # schedule (`_post_metadata_inference_cleanup`): on the ranks that built a new one only (an
    # encoder pipeline's item bucket, a dp shard's rows at pp = 1 differ between dp ranks). So the
    # stages start resharded on every rank (a forward without backward, `predict`, leaves a root
    # gathered: a rank that kept it would skip the all-gather its dp peers make), and the
    # gradients of runs before this one (``forward_backward`` twice, accumulating) are kept, read
    # on this schedule's first run only (torch initializes its stages once): a later step does no
    # work per parameter.
    held = [_fsdp_held(stage) for stage in stages]
    for modules, _ in held:
        for m in modules:
            m.reshard()
    kept = {} if schedule.__dict__.get("_mimo_ran") else {
        p: p.grad for _, params in held for p in params if p.grad is not None}
    for stage in stages:  # what step() does to each stage before running the microbatches
        stage.has_backward = True
        stage.clear_runtime_states()
    schedule._step_microbatches(args, kwargs, targets, losses, return_outputs=False)
    schedule.__dict__["_mimo_ran"] = True
    for p, grad in kept.items():  # FSDP2 accumulates into the gradient it finds, in place
        if p.grad is None:
            p.grad = grad
        elif p.grad is not grad:
            p.grad += grad


def fsdp_units(module: torch.nn.Module) -> list[FSDPModule]:
    """`module`'s FSDP2 modules (itself included), found once per module: a walk of every
    submodule each step would be host work that grows with the model."""
    found = module.__dict__.get("_mimo_fsdp_units")
    if found is None:
        found = module.__dict__["_mimo_fsdp_units"] = [m for m in module.modules() if isinstance(m, FSDPModule)]
    return found


def _fsdp_held(stage: Any) -> tuple[list[FSDPModule], list[torch.nn.Parameter]]:
    """`stage`'s FSDP2 modules and their parameters, found once per stage (the step's host path)."""
    found = stage.__dict__.get("_mimo_fsdp_held")
    if found is None:
        modules = fsdp_units(stage.submod)
        params = list(dict.fromkeys(p for m in modules for p in m.parameters()))
        found = stage.__dict__["_mimo_fsdp_held"] = (modules, params)
    return found
