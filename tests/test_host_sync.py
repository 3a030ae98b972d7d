"""No device-to-host sync per microbatch: a training step's syncs do not grow with the microbatches.

On an accelerator a host sync (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``, ``nonzero``,
boolean-mask indexing...) stalls the stream and eats the overlap the pipeline exists for. Counts
the step needs come from host metadata every rank holds (the batch's items and tokens per item).

On CPU there is no device, so `DeviceSyncCounter` simulates one: the batch's tensors are host
metadata; so is whatever is computed from host tensors alone (or made by a factory without a
``device=``); everything else is "on the device": parameters, gradients, communication buffers,
``.to(device)`` copies (cloned, as a copy to an accelerator would be) and everything computed from
them. Every sync entry point called on a device tensor is counted, by call site, and so is every
blocking copy of host data to the device (``torch.tensor(..., device=)``, ``.to(device)`` without
``non_blocking``), which waits for the device's queue as well.

| case         | vision (ranks) | language (ranks) | microbatches      | world |
|--------------|----------------|------------------|-------------------|-------|
| pipelined    | dp1 (0)        | pp2 (1-2)        | 2, then 4 (1F1B)  | 3     |
| unpipelined  | dp1 (0)        | dp2 (1-2)        | none (batch 4, 8) | 3     |
| two-hop      | dp1 (0)        | tp2 (1-2)        | none (batch 4, 8) | 3     |

(Unpipelined: the same step with one microbatch and one stage.)

Each run takes two steps on the same model; the second step (no warm-up: the schedules, plans and
first-seen shape checks are cached) is counted. Expected, per rank and step: only syncs of
`ALLOWED`, each once (and `HOST_ONLY`'s reads of host tensors), the same counts whatever the
number of microbatches.

The GPU variant runs the pipelined step on 3 GPUs (NCCL) under
``torch.cuda.set_sync_debug_mode("error")`` and is skipped with fewer.
"""

from __future__ import annotations

import collections
import gc
import os
import sys
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from dtensor_mimo import MimoModel, MimoOptimizer, ParallelOptions, Parallelism, PipelineConfig, train_step
from tests.harness import run_on_ranks
from tests.test_mimo import OPT, Case, _batches, _modules

P = Parallelism

ALLOWED = {
    # train_step: the loss, the status word and every module's squared gradient norm, read once
    # after their one all-reduce (the step's metrics and its raise decision; the clip and the skip
    # are taken on the device, the update queued before this read).
    ("dtensor_mimo/optim/step.py", None): "the step's one read of its all-reduced totals",
}
"""(innermost library file, innermost torch file or None) of each sync expected once per step, and why."""

HOST_ONLY: dict[tuple[str, str | None], str] = {
    # None: `MimoOptimizer` takes AdamW's fused path on CPU as on CUDA, which reads no step counter
    # (the foreach path read each parameter's, a host tensor; the GPU variant below checks the
    # fused path under the sync debug mode).
}
"""Sites that read host tensors whatever the device (any count, the same whatever the microbatches)."""

_SYNCS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
    torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy,
    torch.Tensor.nonzero, torch.nonzero, torch.Tensor.masked_select, torch.masked_select,
    torch.Tensor.unique, torch.unique, torch.equal, torch.Tensor.__repr__, torch.Tensor.__format__,
    torch.Tensor.argwhere, torch.argwhere, torch.Tensor.allclose, torch.allclose,
}
_HOST = "_dtensor_mimo_host"  # attribute marking a host-metadata tensor


def _is_host(t) -> bool:
    return getattr(t, _HOST, False)


def mark_host(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            setattr(t, _HOST, True)


def mark_batch(batch) -> None:
    """The global batch is host metadata (the data loader's CPU tensors)."""
    mark_host(batch.tokens, batch.labels, batch.loss_mask, batch.document_ids, batch.positions,
              *(x for m in batch.modalities.values() for x in (m.inputs if isinstance(m.inputs, list) else [m.inputs])))


def _blocking_host_to_device(func, args, kwargs) -> bool:
    """A copy of host data to the device that the host waits for (``set_sync_debug_mode`` flags
    it): ``torch.tensor(data, device=...)``, ``.to(device)`` / ``copy_`` without ``non_blocking``."""
    if func in (torch.tensor, torch.as_tensor):
        return kwargs.get("device") is not None
    non_blocking = kwargs.get("non_blocking", False)
    if func in (torch.Tensor.to, torch.Tensor.cuda):
        to_device = "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args[1:])
        return to_device and _is_host(args[0]) and not non_blocking
    if func is torch.Tensor.copy_:
        return not _is_host(args[0]) and _is_host(args[1]) and not non_blocking and not (
            len(args) > 2 and args[2])
    return False


def _allowed(site: str, sites=ALLOWED) -> bool:
    lib, _, inner = site.partition(" <- ")
    return any(lib.split(":")[0] == a and (b is None and not inner or b is not None and inner.startswith(b))
               for a, b in sites)


def _in_device_mesh() -> bool:
    """Called from DeviceMesh's own code: its rank grids are CPU tensors on every device."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename.replace(os.sep, "/")
        if not name.endswith(("torch/overrides.py", "torch/_tensor.py")):
            return name.endswith("torch/distributed/device_mesh.py")
        frame = frame.f_back
    return False


def _site() -> str:
    """The innermost frame of the library, after the innermost frame of torch if that is nearer
    (``dtensor_mimo/x.py:N <- torch/y.py:M``)."""
    frame = sys._getframe(2)
    torch_site = None
    while frame is not None:
        name = frame.f_code.co_filename.replace(os.sep, "/")
        if "/dtensor_mimo/" in name:
            site = name[name.rindex("/dtensor_mimo/") + 1:] + f":{frame.f_lineno}"
            return site if torch_site is None else f"{site} <- {torch_site}"
        if torch_site is None and "/torch/" in name and not name.endswith(("torch/overrides.py", "torch/_tensor.py")):
            torch_site = name[name.rindex("/torch/") + 1:] + f":{frame.f_lineno}"
        frame = frame.f_back
    return torch_site or "?"


def mark_host_state(optimizer) -> None:
    """Tensors that live on the host on every device: each DeviceMesh's rank grid and AdamW's
    step counters (CPU tensors unless ``capturable``/``fused``)."""
    for obj in gc.get_objects():
        # a weakref proxy answers isinstance through its referent, which may be gone (ReferenceError)
        if type(obj) not in (weakref.ProxyType, weakref.CallableProxyType) and isinstance(obj, DeviceMesh):
            mark_host(*(t for t in vars(obj).values() if isinstance(t, torch.Tensor)))
    for opt in optimizer.optimizers.values():
        for state in opt.state.values():
            mark_host(state.get("step"))


class DeviceSyncCounter(TorchFunctionMode):
    """Counts, by call site, the sync entry points called on tensors that would be on the device."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _in_device_mesh():
            out = func(*args, **kwargs)
            mark_host(*(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)))
            return out
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        device_in = any(not _is_host(t) for t in tensors)
        mask_index = func is torch.Tensor.__getitem__ and any(  # boolean-mask indexing: data-dependent shape
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_flatten(args[1:])[0])
        if (func in _SYNCS or mask_index) and device_in:
            self.counts[_site()] += 1
        if func is torch.Tensor.copy_ and _is_host(args[0]) and device_in:
            self.counts[_site()] += 1  # a device-to-host copy
        if _blocking_host_to_device(func, args, kwargs):
            self.counts[_site()] += 1  # a blocking host-to-device copy waits for the device's queue
        out = func(*args, **kwargs)
        to_device = "device" in kwargs or (func in (torch.Tensor.to, torch.Tensor.cuda) and any(
            isinstance(a, (torch.device, str)) for a in args[1:]))
        if func in (torch.Tensor.to, torch.Tensor.cuda) and to_device and out is args[0]:
            out = out.clone()  # a copy to an accelerator is a new tensor
        if func in _SYNCS:
            return out
        host = not device_in and not to_device
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and (host or _is_host(t)):
                setattr(t, _HOST, host)
        return out


def _model(modules: dict[str, Parallelism], pipeline: PipelineConfig | None, hops: int | None,
           options: dict[str, ParallelOptions] | None = None, varied: bool = False) -> MimoModel:
    case = Case(modules, pipeline=pipeline)
    layout = case.layout()
    layout.init_meshes("cpu")
    llama, encs = _modules(case.encoders, n_layers=2, varied=varied)
    return MimoModel(layout, llama, encs, pipeline=pipeline, bridge_hops=hops, options=options)


def _counted_step(modules: dict[str, Parallelism], pipeline: PipelineConfig | None,
                  batch_size: int, hops: int | None = None,
                  options: dict[str, ParallelOptions] | None = None, varied: bool = False) -> dict[str, int]:
    model = _model(modules, pipeline, hops, options, varied)
    optimizer = MimoOptimizer(model, OPT)
    warm, counted = _batches(("vision",), False, batch_size=batch_size, seq_lens=(64, 64), varied=varied)
    train_step(model, optimizer, warm)  # builds schedules, plans; the first-seen shape check
    mark_batch(counted)
    mark_host_state(optimizer)
    counter = DeviceSyncCounter()
    with counter:
        train_step(model, optimizer, counted)
    dist.barrier()
    return dict(counter.counts)


def _per_rank(modules, pipeline, batch_size, hops=None, options=None, varied=False) -> list[dict[str, int]]:
    return run_on_ranks(_counted_step, 3, modules, pipeline, batch_size, hops, options, varied)


def _check(small: list[dict[str, int]], large: list[dict[str, int]]) -> None:
    for rank, (a, b) in enumerate(zip(small, large)):
        assert a == b, f"rank {rank}: syncs depend on the microbatches: {a} vs {b}"
        for site, n in a.items():
            if _allowed(site, HOST_ONLY):
                continue
            assert _allowed(site), f"rank {rank}: unexpected device sync at {site} ({n}x): {a}"
            assert n == 1, f"rank {rank}: {n} syncs at {site}, expected one per step: {a}"


def test_pipelined_step_syncs_do_not_grow_with_microbatches() -> None:
    modules = {"vision": P(), "language": P(pp=2)}
    two = _per_rank(modules, PipelineConfig(microbatches=2), 8)
    four = _per_rank(modules, PipelineConfig(microbatches=4), 8)
    _check(two, four)
    assert all(any(s.startswith("dtensor_mimo/optim/step.py") for s in r) for r in four), four


@pytest.mark.parametrize("language, hops, fsdp", [(P(dp=2), None, True), (P(dp=2), None, False), (P(tp=2), 2, True)],
                         ids=["dp2", "dp2_allreduce", "tp2_two_hop"])
def test_unpipelined_step_syncs_are_fixed(language: Parallelism, hops: int | None, fsdp: bool) -> None:
    """Without a pipeline (one stage, one microbatch) the step's only sync is train_step's (nor,
    two-hop, one per scatter / gather level; nor, without FSDP2, the dp sums' presence flags, which
    ride in each bucket and which a rank holding every gradient need not read)."""
    modules, options = {"vision": P(), "language": language}, {"language": ParallelOptions(fsdp=fsdp)}
    _check(_per_rank(modules, None, 4, hops, options), _per_rank(modules, None, 8, hops, options))


def test_items_of_their_own_sizes_make_no_sync() -> None:
    """Images at their own resolution (a list per microbatch, encoded as one packed sequence with
    per-item attention, `models.layers.packed_attention`): a span of several small items is
    masked by each row's item index, made on the host and copied without waiting for the device
    (made with ``torch.tensor(..., device=)``, a blocking copy, it waited for the device's queue
    once per span, block and microbatch)."""
    modules = {"vision": P(), "language": P(dp=2)}
    _check(_per_rank(modules, PipelineConfig(microbatches=2), 8, varied=True),
           _per_rank(modules, PipelineConfig(microbatches=4), 8, varied=True))


def test_flex_attention_of_packed_items_makes_no_sync() -> None:
    """`FlexAttentionCore.packed` (``flex_attention=True``: items of their own sizes in one
    FlexAttention kernel) builds each new list of item lengths' block mask from every row's item
    index, made on the host and copied without waiting for the device (a blocking ``.to(device)``
    waited for the device's queue once per encoder call with new sizes: each microbatch of a step).
    The mask alone here: torch's FlexAttention kernel runs through dynamo, which the counter's
    mode cannot follow."""
    from torch.nn.attention.flex_attention import create_block_mask

    from dtensor_mimo.models.layers import FlexAttentionCore

    core = FlexAttentionCore()
    core._functions = lambda cuda: ((lambda q, k, v, **kwargs: q), create_block_mask)
    q = torch.randn(1, 2, 30, 8)  # made without the counter: "on the device"
    counter = DeviceSyncCounter()
    with counter:
        core.packed(q, q, q, [10, 12, 8])
    assert not counter.counts, dict(counter.counts)


def _colocated(pipeline: PipelineConfig) -> MimoModel:
    """A vision encoder and the language model on one rank (world 1)."""
    from dtensor_mimo.layout import MimoLayout

    layout = MimoLayout({"vision": P(), "language": P()}, offsets={"vision": 0, "language": 0})
    layout.init_meshes("cpu")
    llama, encoders = _modules(("vision",), n_layers=2)
    return MimoModel(layout, llama, encoders, pipeline=pipeline)


def _encoder_input_copies(pipeline: PipelineConfig) -> list[str]:
    """The files that move a modality's inputs to the device in a colocated world-1 step."""
    from dtensor_mimo.data.batch import ModalityInputs

    model = _colocated(pipeline)
    optimizer = MimoOptimizer(model, OPT)
    batch = _batches(("vision",), False, batch_size=4, seq_lens=(64,))[0]
    sites, move = [], ModalityInputs.to
    ModalityInputs.to = lambda self, device: sites.append(sys._getframe(1).f_code.co_filename) or move(self, device)
    try:
        train_step(model, optimizer, batch)
    finally:
        ModalityInputs.to = move
    return [s[s.rindex("dtensor_mimo/"):] for s in sites]


@pytest.mark.parametrize("microbatches", [1, 2])
def test_the_language_model_copies_no_encoder_inputs(microbatches: int) -> None:
    """An image crosses to the device once, for its encoder (the language model reads only the
    modality's metadata; it copied every microbatch's pixels again, an extra 19 MB a step for the
    VLM of benchmarks/gpu.py)."""
    sites = run_on_ranks(_encoder_input_copies, 1, PipelineConfig(microbatches=microbatches))[0]
    assert sites == ["dtensor_mimo/schedule/executor.py"] * microbatches, sites


def _updated_at_the_read() -> list[bool]:
    """Whether the weights had moved when train_step's host read began, in a world-1 step."""
    import dtensor_mimo.optim.step as step_module

    model = _colocated(PipelineConfig(microbatches=2))
    optimizer = MimoOptimizer(model, OPT)
    batch = _batches(("vision",), False, batch_size=4, seq_lens=(64,))[0]
    train_step(model, optimizer, batch)
    before = [p.detach().clone() for p in model.parameters()]
    seen, read = [], step_module.read_totals
    step_module.read_totals = lambda *a: seen.append(any(
        not torch.equal(p, q) for p, q in zip(model.parameters(), before))) or read(*a)
    try:
        train_step(model, optimizer, batch)
    finally:
        step_module.read_totals = read
    return seen


def test_the_update_is_queued_before_the_host_read() -> None:
    """The step's update (clip and AdamW, refused or skipped on the device) is queued before its one
    host read, so on a GPU the device goes from backward to the update without waiting for the
    host. On CPU queued is done: the weights have moved when the read begins."""
    assert run_on_ranks(_updated_at_the_read, 1)[0] == [True]


def _profiled_phases() -> tuple[list[str], bool]:
    """The `phase` ranges of a profiled world-1 step (2 microbatches), and whether `phase` is the
    do-nothing context without a profiler."""
    from torch.profiler import ProfilerActivity, profile

    from dtensor_mimo.schedule import runtime

    model = _colocated(PipelineConfig(microbatches=2))
    optimizer = MimoOptimizer(model, OPT)
    batch = _batches(("vision",), False, batch_size=4, seq_lens=(64,))[0]
    train_step(model, optimizer, batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(model, optimizer, batch)
    names = sorted({e.name for e in prof.events() if e.name.startswith("mimo.")})
    return names, runtime.phase("encode") is runtime._NOTHING


def test_a_profiled_step_names_its_phases() -> None:
    """Under torch.profiler each action of the step's program, the loss, the gradient reduction,
    the update and the read are named ranges (`benchmarks/gpu.py --profile` reports device time
    and idle time by them); without a profiler `phase` does nothing."""
    names, idle = run_on_ranks(_profiled_phases, 1)[0]
    assert idle
    for want in ("mimo.encode vision", "mimo.language train", "mimo.loss 0",
                 "mimo.loss 1", "mimo.backward", "mimo.reduce gradients", "mimo.optimizer", "mimo.read totals"):
        assert want in names, (want, names)


def test_counter_sees_a_device_sync_but_not_host_metadata() -> None:
    host, device = torch.ones(3), torch.ones(3)
    mark_host(host)
    counter = DeviceSyncCounter()
    with counter:
        host.sum().item()  # host metadata: free
        (host + 1).tolist()  # free
        copied = host.to("cpu")  # 1: a blocking copy to the device
        host.to("cpu", non_blocking=True)  # free
        copied.sum().item()  # 2
        bool(device.any())  # 3
        device[device > 0]  # 4: a boolean mask's result size is read back
        torch.tensor([1, 2]).tolist()  # made on the host: free
        torch.zeros(2, device="cpu").tolist()  # 5: made on the device
    assert sum(counter.counts.values()) == 5, counter.counts


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 3,
                    reason="needs 3 CUDA devices (NCCL, torch.cuda.set_sync_debug_mode)")
def test_gpu_pipelined_step_makes_no_sync_but_the_allowed_ones() -> None:
    """The pipelined case on GPUs under ``set_sync_debug_mode("error")``: any sync but `ALLOWED`'s
    (train_step's read of its totals; torch's warm-up vote of a fresh schedule) raises."""
    import torch.multiprocessing as tmp

    from dtensor_mimo.layout.world import hold_store

    store = hold_store(3)  # served here until the ranks end
    tmp.spawn(_gpu_worker, args=(3, store.port), nprocs=3, join=True)


def _gpu_worker(rank: int, world: int, port: int) -> None:
    from dtensor_mimo.layout.world import init_distributed, local_rank_env

    local_rank_env(rank, world, port)
    init_distributed("cuda")  # NCCL, this rank's device set and named as the group's device_id
    try:
        _gpu_step()
    finally:
        dist.destroy_process_group()


def _unchecked(fn):
    """`fn` with the sync debug mode off while it runs (an allowed sync)."""
    def call(*args, **kwargs):
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(mode)
    return call


def _gpu_step() -> None:
    """Two steps on this rank's GPU; the second raises on any sync but the allowed ones."""
    import dtensor_mimo.optim.step as step_module
    from torch.distributed.pipelining import schedules

    case = Case({"vision": P(), "language": P(pp=2)}, pipeline=PipelineConfig(microbatches=4))
    llama, encs = _modules(case.encoders, n_layers=2)
    model = MimoModel(case.layout(), llama, encs, pipeline=case.pipeline, device_type="cuda")
    optimizer = MimoOptimizer(model, OPT)
    warm, counted = _batches(("vision",), False, batch_size=8, seq_lens=(64, 64))
    train_step(model, optimizer, warm)
    torch.cuda.synchronize()
    patched = [(step_module, "read_totals"), (schedules._PipelineSchedule, "_warmup_p2p")]
    originals = [getattr(owner, name) for owner, name in patched]
    for (owner, name), fn in zip(patched, originals):
        setattr(owner, name, _unchecked(fn))
    torch.cuda.set_sync_debug_mode("error")
    try:
        train_step(model, optimizer, counted)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        for (owner, name), fn in zip(patched, originals):
            setattr(owner, name, fn)
    dist.barrier()
