"""Data parallel without FSDP2: each module's gradients summed over dp·cp in buckets, launched
while backward still runs (DDP-style), or all after it.

A `GradientReducer` cuts a module's parameters, in reverse registration order (roughly the order
backward produces their gradients), into buckets of about `ParallelOptions.grad_bucket_mb` of one
dtype, fixed at construction. Every rank of the group issues one all-reduce per bucket, buckets
in order, once per step: the same collectives in the same order on every rank whatever its data
(NCCL's rule), because which bucket goes next never depends on a rank's gradients, only when.

When: a parameter's gradient is final once its module's last backward of the step has
accumulated into it. The step's driver says which backward is the last: `arm` (now: the next
accumulation of these parameters is their last; the executor calls it before an encoder's last
backward) or `arm_module` (a pipeline stage's parameters, from `StageReductions` at the stage's
last backward, which torch's schedules run inside their step). A
bucket whose parameters are all final is launched from the accumulation hook, while backward
goes on, but only after every bucket before it: `flush` launches the rest (the executor calls
it after the module's last backward), `finish` waits for every bucket and puts the sums back.
Nothing armed (``model(batch)`` and a backward of the caller's, gradient accumulation over
such runs): every bucket goes in `finish`, as `allreduce_gradients` does. Where torch's
zero-bubble schedules split a stage's last backward, its weight half accumulates by hand (no
hook fires): those buckets leave at the flush after the schedule. A training run's buckets are
all in flight when it returns, so gradients may not accumulate over training runs:
`MimoModel.run` refuses a second one before `reduce_gradients` (or ``zero_grad``, which
`discard`s the sums).

Each bucket carries one presence flag per parameter: a parameter without a gradient on this
rank (an encoder without items here) sends zeros, and one without a gradient on every rank
keeps None, as the single-process run leaves it (AdamW then skips it). So unused parameters
cost no collective of their own. An accumulation into a parameter whose bucket is already in
flight (a second use after its module's last backward, e.g. a parameter shared with another
module; by the hook, or by hand: the gradient's version counter moved) would make the sum
stale: `finish` reports it, and `train_step` refuses the step on every rank.

The groups are the reducer's own (`MimoLayout.own_dp_group`), used by nothing else: the
buckets' order on them cannot interleave with another module's collectives, even where two
colocated modules' meshes share a process group. Memory: the buckets in flight are copies in
the reduce dtype, at most one copy of the module's gradients while backward runs (torch DDP's
buckets cost the same).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dtensor_mimo.models.layers import local_part
from dtensor_mimo.parallelize.fsdp import reduce_in_this_backward

BUCKET_BYTES = 32 << 20
"""About how many bytes one bucket reduces (`ParallelOptions.grad_bucket_mb`'s default)."""



class LastBackward:
    """Calls ``on_last(module)`` at the start of the `count`-th backward through a `watch`ed
    module's forward output in a step (`expect`): how a driver learns that a pipeline stage's
    last backward has begun, where torch's schedules run the stage's backwards inside their step.

    A hook on the forward output (the first tensor needing a gradient) counts each backward as
    its gradient arrives, which is before that backward accumulates into any parameter behind it.
    torch's stages run every microbatch's forward once with gradients, so the step's `count`-th
    gradient is its last backward's. Where torch splits a backward (the zero-bubble schedules),
    the input half is the one counted and the weight half comes after it: the parameters'
    gradients are not final then (the `GradientReducer`'s version check catches a bucket sent
    too early; FSDP2 stages do not count there). Only forwards while a count is expected are hooked."""

    def __init__(self, on_last: Callable[[nn.Module], None]) -> None:
        self.on_last = on_last
        self._modules: dict[int, nn.Module] = {}
        self._countdown: dict[int, int] = {}

    def watch(self, module: nn.Module) -> None:
        self._modules[id(module)] = module
        module.register_forward_hook(functools.partial(self._forward_done, id(module)))

    def expect(self, count: int) -> None:
        """Each watched module runs `count` backwards this step (a stage: one per microbatch)."""
        self._countdown = {key: count for key in self._modules}

    def reset(self) -> None:
        self._countdown = {}

    def _forward_done(self, key: int, _module: nn.Module, _args: tuple, output: object) -> None:
        if not self._countdown.get(key) or not torch.is_grad_enabled():
            return
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        first = next((o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad), None)
        if first is not None:
            first.register_hook(functools.partial(self._backward_begins, key))

    def _backward_begins(self, key: int, _grad: torch.Tensor) -> None:
        left = self._countdown.get(key)
        if left is None:  # reset since (a step that failed)
            return
        self._countdown[key] = left - 1
        if left == 1:
            self.on_last(self._modules[key])


class GradientReducer:
    """Sums the gradients of `params` (``{name: parameter}`` in registration order) over `group`
    in fixed buckets, in `reduce_dtype` if given (the sums land in the gradients' own dtype).

    `hooks`: launch buckets from the parameters' accumulation hooks once armed (`arm`,
    `arm_module`); False: every bucket in `finish` (`allreduce_gradients`). Every rank of `group`
    builds its reducer from parameters of the same shapes, dtypes and order (replicas of one
    module). DTensor parameters are reduced shard by shard; a gradient whose placements are not
    yet its parameter's (a tp partial sum, put right by `finish_gradients` before `finish`) is
    not final, so its bucket waits for `flush`.
    """

    def __init__(self, params: Mapping[str, nn.Parameter], group: dist.ProcessGroup,
                 reduce_dtype: torch.dtype | None = None, bucket_bytes: int = BUCKET_BYTES,
                 hooks: bool = True) -> None:
        self.names, self.params = list(params), list(params.values())
        self.known = frozenset(self.names)
        self.group, self.reduce_dtype = group, reduce_dtype
        order = list(reversed(range(len(self.params))))
        locals_ = [local_part(self.params[i]) for i in order]
        self.buckets = [[order[j] for j in run] for run in
                        cut([t.numel() * t.element_size() for t in locals_], [t.dtype for t in locals_], bucket_bytes)]
        """Parameter indices per bucket, in launch order (reverse registration order)."""
        self.bucket_of = {i: k for k, bucket in enumerate(self.buckets) for i in bucket}
        self._owners: dict[int, list[int]] = {}  # watched module id -> its parameter indices
        self._shared: set[int] = set()  # parameters of more than one watched module: never early
        self.early = 0
        """Buckets the last step launched from the accumulation hooks, while backward ran."""
        self._reset()
        if hooks:
            for i, p in enumerate(self.params):
                p.register_post_accumulate_grad_hook(functools.partial(self._accumulated, i))

    def _reset(self) -> None:
        self._armed: set[int] = set()
        self._ready = [False] * len(self.params)
        self._next = 0  # the next bucket to launch
        self._pending: list[tuple[int, torch.Tensor, dist.Work]] = []
        self._sent: dict[int, list[tuple[object, int]]] = {}  # per launched bucket: each gradient and its version
        self._stale: list[str] = []
        self._launched_early = 0

    # ------------------------------------------------------------------ when gradients are final
    def arm(self, params: Iterable[int] | None = None) -> None:
        """The next accumulation into each of `params` (indices; None: every parameter) is its
        last of the step."""
        self._armed.update(range(len(self.params)) if params is None else params)
        self._armed -= self._shared

    def watch(self, module: nn.Module) -> None:
        """Know `module`'s parameters, for `arm_module` (a pipeline stage); a parameter of two
        watched modules is never launched early."""
        index = {id(p): i for i, p in enumerate(self.params)}
        mine = [index[id(p)] for p in module.parameters() if id(p) in index]
        for other in self._owners.values():
            self._shared.update(set(mine) & set(other))
        self._owners[id(module)] = mine

    def arm_module(self, module: nn.Module) -> None:
        """`arm` the parameters of watched `module` (its last backward of the step begins)."""
        self.arm(self._owners[id(module)])

    def _accumulated(self, i: int, param: nn.Parameter) -> None:
        """A gradient accumulated into parameter `i` (torch's post-accumulate-grad hook)."""
        if self.bucket_of[i] < self._next:
            self._stale.append(self.names[i])
            return
        if i not in self._armed:
            return
        if _unplaced(param):
            return  # e.g. a partial sum over tp: `finish_gradients` puts it right, then `finish` sends it
        self._armed.discard(i)
        self._ready[i] = True
        while self._next < len(self.buckets) and all(self._ready[j] for j in self.buckets[self._next]):
            self._launch()
            self._launched_early += 1

    # ------------------------------------------------------------------ the reductions
    @torch.no_grad()
    def _launch(self, dropped: bool = False) -> None:
        """Bucket `_next`'s gradients (zeros where this rank has none; every one with `dropped`)
        and presence flags, copied into one flat tensor, all-reduced asynchronously."""
        k = self._next
        self._next += 1
        params = [self.params[i] for i in self.buckets[k]]
        grads = [None if p.grad is None or dropped else local_part(p.grad) for p in params]
        # What went in, to tell in `_land` whether a gradient changed after: an accumulation by hand
        # (torch's split weight backward adds into ``.grad``, with no hook to see it) or a new tensor.
        self._sent[k] = [(p.grad, -1 if g is None else g._version) for p, g in zip(params, grads)]
        like = local_part(params[0])
        dtype = self.reduce_dtype or like.dtype
        sizes = [local_part(p).numel() for p in params]
        flat = torch.empty(sum(sizes) + len(params), dtype=dtype, device=like.device)
        if all(g is not None for g in grads):
            torch.cat([g.reshape(-1) for g in grads], out=flat[: sum(sizes)])
            flat[sum(sizes):].fill_(1)
        else:
            for g, view in zip(grads, flat[: sum(sizes)].split(sizes)):
                view.copy_(g.reshape(-1)) if g is not None else view.zero_()
            flags = torch.tensor([float(g is not None) for g in grads], dtype=dtype)
            flat[sum(sizes):].copy_(flags, non_blocking=True)
        self._pending.append((k, flat, dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)))

    def flush(self, land_behind: bool = False) -> None:
        """Launch the buckets not yet launched, in order (the executor's call after the module's
        last backward: every gradient there is final), up to the first holding a gradient not on
        its parameter's placements (`finish_gradients` puts those right before `finish`).
        `land_behind`: keep at most two in flight (land the oldest first), so the extra memory is
        two buckets, not a copy of every gradient; the executor's call does not, so that the
        reductions overlap what follows."""
        while self._next < len(self.buckets):
            if any(_unplaced(self.params[i]) for i in self.buckets[self._next]):
                return
            if land_behind and len(self._pending) >= 2:
                self._land(*self._pending.pop(0))
            self._launch()

    @torch.no_grad()
    def _land(self, k: int, flat: torch.Tensor, work: dist.Work) -> None:
        """Wait for bucket `k`'s sums and put them into the gradients (a parameter without a
        gradient here gets one where another rank had it; None stays None where no rank had)."""
        work.wait()
        params = [self.params[i] for i in self.buckets[k]]
        for i, p, (grad, version) in zip(self.buckets[k], params, self._sent.pop(k)):
            if p.grad is not grad or (grad is not None and local_part(grad)._version != version):
                self._stale.append(self.names[i])
        sizes = [local_part(p).numel() for p in params]
        views = flat[: sum(sizes)].split(sizes)
        present = None  # read (a host sync) only where this rank lacks a gradient
        if any(p.grad is None for p in params):
            present = flat[sum(sizes):].tolist()
        dst, src = [], []
        for j, (p, view) in enumerate(zip(params, views)):
            if p.grad is None:
                if not present[j]:
                    continue
                p.grad = torch.zeros_like(p)  # a DTensor keeps the parameter's spec
            dst.append(local_part(p.grad))
            src.append(view.view_as(dst[-1]))
        if dst:
            torch._foreach_copy_(dst, src)

    def finish(self) -> str | None:
        """Launch what is left, wait for every bucket and put the sums into the gradients (call
        on every rank of the group after the step's backward). Returns what went wrong, if a
        gradient accumulated after its bucket left (else None); the state is reset either way."""
        self.flush(land_behind=True)
        if self._next < len(self.buckets):
            unplaced = [self.names[i] for i in self.buckets[self._next] if _unplaced(self.params[i])]
            raise RuntimeError(f"GradientReducer.finish: the gradients of {unplaced} are not on their parameters' "
                               "placements; put them there first (finish_gradients does)")
        while self._pending:
            self._land(*self._pending.pop(0))
        stale, self.early = list(dict.fromkeys(self._stale)), self._launched_early
        self._reset()
        if stale:
            return (f"gradients of {stale[:3]}{' and more' if len(stale) > 3 else ''} accumulated after their "
                    "bucket's all-reduce had started (a parameter used again after its module's last backward, "
                    "e.g. shared with another module): its dp sum is stale; set ParallelOptions("
                    "overlap_grad_reduce=False) for the module")
        return None

    @torch.no_grad()
    def discard(self, in_flight: bool) -> None:
        """Drop this step's sums (the gradients are being dropped: ``zero_grad``). `in_flight`: a
        training run launched buckets and `finish` has not run, as every rank of the group knows
        alike (`MimoModel` follows the calls; a rank's own count may differ, e.g. one that stopped
        at a tp partial sum): then the buckets not yet launched here go out as zeros, so that every
        rank still issues each bucket once, in order, and all are waited for. Then start afresh."""
        if in_flight:
            while self._next < len(self.buckets):
                self._launch(dropped=True)
            for _k, _flat, work in self._pending:
                work.wait()
        self.early = 0
        self._reset()


class StageReductions:
    """How a pipeline's stages (torch's `PipelineStage` modules on this rank) reduce their
    gradients over dp in a training step, decided at each stage's last backward (`LastBackward`):
    an FSDP2 stage reduce-scatters from there on (`reduce_in_this_backward`; not where
    `fsdp_in_backward` is False: a split backward, whose weight half comes after the counted
    one), and the stages' `GradientReducer`, if `attach`ed, is armed there and flushed after the
    schedule. The language model's and a pp > 1 encoder's pipelines each hold one."""

    def __init__(self, stages: Sequence[nn.Module], fsdp_in_backward: bool = True) -> None:
        self.stages, self.fsdp_in_backward = list(stages), fsdp_in_backward
        self.reducer: GradientReducer | None = None
        self.last = LastBackward(self._last_backward)
        for stage in self.stages:
            self.last.watch(stage)

    def attach(self, reducer: GradientReducer) -> None:
        """The stages' dp sums without FSDP2 start during their last backward."""
        self.reducer = reducer
        for stage in self.stages:
            reducer.watch(stage)

    def _last_backward(self, stage: nn.Module) -> None:
        if self.fsdp_in_backward:
            reduce_in_this_backward(stage)
        if self.reducer is not None:
            self.reducer.arm_module(stage)

    @contextlib.contextmanager
    def step(self, count: int) -> Iterator[None]:
        """Around torch's schedule of `count` microbatches: each stage's `count`-th backward is
        its last; afterwards the reducer's remaining buckets leave at once (`flush`)."""
        self.last.expect(count)
        try:
            yield
        finally:
            self.last.reset()
        if self.reducer is not None:
            self.reducer.flush()


def _unplaced(p: nn.Parameter) -> bool:
    """Whether `p`'s gradient is a DTensor on other placements than `p` (a tp partial sum, a
    replicated gradient of a sharded parameter), which a bucket cannot take yet."""
    return isinstance(p.grad, DTensor) and p.grad.placements != p.placements


def place_gradients(params: Iterable[nn.Parameter]) -> None:
    """Put each DTensor gradient on its parameter's placements (a tp partial sum reduced, a
    replicated gradient of a sharded parameter sharded), so that it crosses dp 1/tp as large and
    the optimizer steps it in place. Collective over each parameter's mesh where one moves."""
    for param in params:
        if _unplaced(param):
            param.grad = param.grad.redistribute(param.device_mesh, param.placements)


def allreduce_gradients(module: nn.Module, dp_mesh: DeviceMesh | None, reduce_dtype: torch.dtype | None = None,
                        bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum the gradients of `module`'s parameters over `dp_mesh` after backward (the non-FSDP data
    parallel path, nothing overlapped): a `GradientReducer` without hooks, every bucket in
    `finish`, two in flight. Call on every rank of the mesh, before clipping and the optimizer.
    DTensor (tensor-parallel) gradients are put on their parameters' placements first
    (`place_gradients`), then reduced shard by shard: each tp rank sums its own shard with the
    same shard on the other dp replicas. A mesh of size 1 or None does nothing."""
    if dp_mesh is None or dp_mesh.size() == 1:
        return
    sum_gradients({n: p for n, p in module.named_parameters() if p.requires_grad}, dp_mesh.get_group(),
                  reduce_dtype, bucket_bytes)


def sum_gradients(params: Mapping[str, nn.Parameter], group: dist.ProcessGroup, reduce_dtype: torch.dtype | None,
                  bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum the gradients of `params` over `group` now, in buckets (a `GradientReducer` without
    hooks), DTensor gradients put on their parameters' placements first; nothing for none."""
    if params:
        place_gradients(params.values())
        GradientReducer(params, group, reduce_dtype, bucket_bytes, hooks=False).finish()


def cut(nbytes: Sequence[int], kinds: Sequence[object], bucket_bytes: int) -> list[list[int]]:
    """Positions ``0..len(nbytes) - 1`` in order, cut into runs of about `bucket_bytes` bytes
    of one kind (a dtype): a larger item alone."""
    buckets: list[list[int]] = []
    size = 0
    for i, (n, kind) in enumerate(zip(nbytes, kinds)):
        if not buckets or size + n > bucket_bytes or kind != kinds[buckets[-1][0]]:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += n
    return buckets


@torch.no_grad()
def sum_in_place(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup,
                 dtype: torch.dtype | None = None, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Replace each of `tensors` (one dtype) by its sum over `group`, in `dtype` if given (the
    sums land back in the tensors' own dtype).

    In buckets of consecutive tensors of about `bucket_bytes` (`cut`), each one all-reduce of a
    flat copy (a tensor alone in its bucket, contiguous and already in `dtype`, is reduced where
    it lies, no copy), two in flight: one bucket's copies in and out overlap the next one's
    reduction, and the extra memory is two buckets, not a copy of every tensor. Every rank of
    `group` must pass tensors of the same shapes in the same order (the same buckets, so the
    same sequence of collectives: NCCL's rule), as replicas of one module do."""
    pending: list[tuple[list[torch.Tensor], torch.Tensor, dist.Work]] = []
    for positions in cut([t.numel() * t.element_size() for t in tensors], [t.dtype for t in tensors], bucket_bytes):
        bucket = [tensors[i] for i in positions]
        one = bucket[0]
        if len(bucket) == 1 and one.is_contiguous() and one.dtype == (dtype or one.dtype):
            flat = one.view(-1)  # reduced where it is
        else:
            flat = torch.cat([t.reshape(-1) for t in bucket]).to(dtype or one.dtype)
        pending.append((bucket, flat, dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)))
        if len(pending) == 2:
            _put_back(*pending.pop(0))
    for args in pending:
        _put_back(*args)


def _put_back(bucket: list[torch.Tensor], flat: torch.Tensor, work: dist.Work) -> None:
    """Wait for `flat`'s reduction and copy the sums back into `bucket`'s tensors (nothing to
    copy when `flat` is the one tensor's own storage)."""
    work.wait()
    if len(bucket) == 1 and flat.data_ptr() == bucket[0].data_ptr():
        return
    torch._foreach_copy_(bucket, [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in bucket]), bucket)])
