"""How this package drives torch's schedule objects: one step on our own microbatches, and the
per-shape cache of stages and schedules (torch's stage links have static shapes)."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Callable, Hashable, Sequence

import torch

from dtensor_mimo.parallelize import fsdp_units, reshard_fsdp_modules

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
    for stage in stages:
        reshard_fsdp_modules(stage.submod)
    kept = {} if schedule.__dict__.get("_mimo_ran") else {
        p: p.grad for stage in stages for p in _fsdp_params(stage) if p.grad is not None}
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


def _fsdp_params(stage: Any) -> list[torch.nn.Parameter]:
    """The parameters of `stage`'s FSDP2 modules (those torch may drop the gradients of)."""
    return list(dict.fromkeys(p for m in fsdp_units(stage.submod) for p in m.parameters()))
