"""`redistribute`: DTensor's redistribute, across meshes, differentiable; and `Bridge`, its split-phase form.

Forward runs the plan from the source layout to the destination layout; backward runs
the plan of the gradient (`plan_backward`), whose source is the destination mesh with
the *gradient's* placements: DTensor's convention, so a `Replicate` gradient is taken
once and a `Partial` one (e.g. over cp ranks that each hold a partial sum) is summed.
"""

from __future__ import annotations

import copy
import functools
import os
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from dtensor_mimo.bridge import exchange
from dtensor_mimo.bridge import hops as _hops
from dtensor_mimo.bridge.plan import MeshSpec, PlanError, summed_placements


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


def _bridged_dim(*placement_lists: Sequence[Placement]) -> int:
    for placements in placement_lists:
        for p in placements:
            if isinstance(p, Shard):
                return p.dim
    return 0


def _local_shape(global_shape: Sequence[int], dim: int, rows: int) -> tuple[int, ...]:
    """The local shape holding `rows` rows along `dim`; a 0-d tensor travels as its one row, shape [1]."""
    shape = list(global_shape) or [1]
    shape[dim] = rows
    return tuple(shape)


def _normalized(placements: Sequence[Placement], ndim: int) -> tuple[Placement, ...]:
    """`placements` with a negative `Shard` dim counted from the end of an `ndim`-d tensor, as DTensor does."""
    return tuple(Shard(p.dim + ndim) if type(p) is Shard and p.dim < 0 else p for p in placements)


def _as_rows(t: torch.Tensor | None) -> torch.Tensor | None:
    """A 0-d local as the one row it travels as (`_local_shape`); other tensors as they are."""
    return t.reshape(1) if t is not None and t.dim() == 0 else t


@functools.lru_cache(maxsize=64)
def _mesh_spec(mesh: DeviceMesh, placements: tuple[Placement, ...], name: str) -> MeshSpec:
    return MeshSpec(mesh.mesh.tolist(), placements, 0, name=name)  # validates the mesh: O(ranks), once


def _spec(mesh: DeviceMesh, placements: Sequence[Placement], extent: int,
          sample_sizes: Sequence[int] | None, name: str) -> MeshSpec:
    """The side's spec for this call: the mesh validated once, the sizes at O(samples)."""
    return _mesh_spec(mesh, tuple(placements), name).replace(
        extent=extent, sample_sizes=None if sample_sizes is None else tuple(sample_sizes))


def check_local_shapes(locals_: Sequence[torch.Tensor | None], expected: Sequence[tuple[int, ...] | None],
                       specs: Sequence[MeshSpec], device: torch.device) -> None:
    """Agree over the whole world that every rank's local shards have the planned shapes.

    A wrong shard is visible on its own rank only; raising there alone would leave the
    others waiting in the exchange. One small all-reduce (MAX of three words per spec, whatever
    the world's size) lets every rank raise the same error, naming the lowest and the highest
    rank with a wrong shard.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    bad = [e is not None and tuple(x.shape) != e for x, e in zip(locals_, expected)]
    # per spec: any wrong shard, the highest such rank, and world - 1 - the lowest (MAX of each)
    words = torch.tensor([[1, rank, world - 1 - rank] if b else [0, -1, -1] for b in bad], dtype=torch.int64)
    words = words.to(device)
    dist.all_reduce(words, op=dist.ReduceOp.MAX)
    for i, (any_bad, high, low) in enumerate(words.tolist()):  # one device-to-host copy
        if any_bad:
            spec, low = specs[i], world - 1 - low
            ranks = f"[{low}]" if low == high else f"[{low}, ..., {high}] (the lowest and the highest)"
            mine = (f" (this rank holds {tuple(locals_[i].shape)}, the plan expects {expected[i]})"
                    if bad[i] else "")
            raise PlanError(
                f"rank(s) {ranks} hold a local shard whose shape disagrees with the plan for "
                f"{spec!r}{mine}; the local shards must follow the placements (and sample_sizes, if "
                "given): build the input with distribute_tensor, or DTensor.from_local with the same sizes"
            )


def _raise_bad_shards(mine: str | None, bad_peers: Sequence[int], relayed: bool, legs: Sequence["_Leg"]) -> None:
    """After a status-word exchange: raise on the rank with a wrong shard, on every rank that
    received from one (their outputs hold zeros there) and, two-hop, on every rank that gathered
    such rows from a replica (`relayed`), with the plan's numbers."""
    if mine is None and not bad_peers and not relayed:
        return
    fix = ("the local shards must follow the placements (and sample_sizes, if given): build the input "
           "with distribute_tensor, or DTensor.from_local with the same sizes")
    if mine is not None:
        raise PlanError(f"{mine}; {fix}")
    who = f"rank(s) {sorted(bad_peers)}" if bad_peers else "a rank"
    raise PlanError(f"{who} sent rows of a local shard whose shape disagrees with the plan "
                    f"for {', '.join(repr(leg.src) for leg in legs)}; this rank's output is not valid; {fix}")


@dataclass(frozen=True)
class _Leg:
    """Static description of one tensor's trip, shared by forward and backward."""

    src: MeshSpec
    dst: MeshSpec
    src_mesh: DeviceMesh
    dst_mesh: DeviceMesh
    dst_placements: tuple[Placement, ...]
    grad_placements: tuple[Placement, ...]
    shape: torch.Size
    dtype: torch.dtype
    dim: int
    hops: int | None

    def route(self, forward: bool) -> _hops.Route:
        rank, world = dist.get_rank(), dist.get_world_size()
        if forward:
            return _hops.route(self.src, self.dst, rank, world, self.hops, self.src_mesh.get_group,
                               self.dst_mesh.get_group)
        return _hops.backward_route(self.src, self.dst, self.grad_placements, rank, world, self.hops,
                                    self.src_mesh.get_group, self.dst_mesh.get_group)


class _Trip:
    """One direction of a prepared call on this rank, per leg: the route, the local shape the
    sending side must hold, the output's local shape and the DTensor spec that wraps it."""

    def __init__(self, legs: Sequence[_Leg], forward: bool) -> None:
        self.routes = [leg.route(forward) for leg in legs]
        self.in_shapes: list[tuple[int, ...] | None] = []
        self.out_shapes: list[tuple[int, ...] | None] = []
        self.cross_shapes: list[tuple[int, ...] | None] = []  # the cross hop's local output
        self.devices: list[torch.device] = []  # of the output
        self.in_devices: list[torch.device] = []  # of the input
        self.specs: list[DTensorSpec] = []
        for leg, route in zip(legs, self.routes):
            send_mesh, recv_mesh = (leg.src_mesh, leg.dst_mesh) if forward else (leg.dst_mesh, leg.src_mesh)
            placements = leg.dst_placements if forward else summed_placements(leg.src.placements)
            self.in_shapes.append(_local_shape(leg.shape, leg.dim, route.src_rows)
                                  if send_mesh.get_coordinate() is not None else None)
            on_recv_mesh = recv_mesh.get_coordinate() is not None
            self.out_shapes.append(_local_shape(leg.shape, leg.dim, route.dst_rows) if on_recv_mesh else None)
            self.cross_shapes.append(_local_shape(leg.shape, leg.dim, route.plan.dst_rows) if on_recv_mesh else None)
            self.devices.append(_device(recv_mesh))
            self.in_devices.append(_device(send_mesh))
            self.specs.append(DTensorSpec(recv_mesh, placements, tensor_meta=TensorMeta(
                leg.shape, _contiguous_stride(leg.shape), leg.dtype)))
        self.idle = all(a is None and b is None for a, b in zip(self.in_shapes, self.out_shapes))
        """This rank is on neither mesh of any leg: nothing to send, receive or check."""

    def wrap(self, outs: Sequence[torch.Tensor | None]) -> tuple[DTensor, ...]:
        """The outputs as DTensors; a rank off the receiving mesh holds DTensor's empty local shard.
        Each gets its own copy of the spec, as DTensor's own wrappers do (sharding propagation
        may update a spec in place)."""
        return tuple(DTensor(torch.empty(0, dtype=spec.tensor_meta.dtype, device=device) if o is None
                             else o.reshape(()) if not spec.tensor_meta.shape else o,  # a 0-d tensor's one row
                             copy.copy(spec), requires_grad=False)
                     for o, spec, device in zip(outs, self.specs, self.devices))


class _Call:
    """A redistribution prepared for this rank, once per signature (`_prepare`): its legs, the
    forward trip and, when a gradient comes back, the backward trip."""

    def __init__(self, legs: tuple[_Leg, ...]) -> None:
        self.legs = legs
        self.forward = _Trip(legs, True)

    @functools.cached_property
    def backward(self) -> _Trip:
        return _Trip(self.legs, False)


@functools.lru_cache(maxsize=64)
def _prepare(signature: tuple, context: tuple) -> _Call:
    """The cached `_Call` of a signature (per leg: `_leg`'s arguments) in a `_context`: a repeated
    call costs a hash, however many ranks and samples; new ragged sizes cost O(own peers + samples)."""
    return _Call(tuple(_leg(*args) for args in signature))


def _context(meshes: Sequence[DeviceMesh]) -> tuple:
    """What else a prepared call depends on: the meshes' identities (meshes equal by content may
    hold other process groups, e.g. after the world was re-initialised), the current device (for
    accelerator meshes) and LOCAL_WORLD_SIZE (the default route)."""
    device = (torch.accelerator.current_device_index()
              if any(m.device_type != "cpu" for m in meshes) else None)
    return (*map(id, meshes), device, os.environ.get("LOCAL_WORLD_SIZE"))


def _exchange(legs: Sequence[_Leg], trip: _Trip, locals_: Sequence[torch.Tensor | None], status: int | None,
              pool: exchange.BufferPool | None
              ) -> tuple[list[torch.Tensor | None], exchange.Pending | None, torch.Tensor | None]:
    """Run the routes of several tensors: every scatter, ONE batched cross round, every gather, each
    phase in list order on every rank. Returns the outputs, the round's first pending (its status
    words: `Pending.peer_status`) and, with a `status`, the verdict on this rank's outputs as a 0-d
    int64 tensor on the device, > 0 where a peer flagged the data it sent or a gathered piece came
    from a flagged one. Nothing here reads a status on the host (a device sync): the caller reads
    the verdict once (`_RedistributeFunction`)."""
    routes, pieces, bad = trip.routes, [], status
    for leg, route, x in zip(legs, routes, locals_):
        if x is not None and route.scatter:
            x, summed = _hops.scatter(x, leg.dim, route.scatter, status)
            if status is not None:
                bad = _positive(summed) | bad
        pieces.append(x)
    transfers = [exchange.Transfer(route.plan, leg.dim, x, shape, leg.dtype, device)
                 for leg, route, x, shape, device in zip(legs, routes, pieces, trip.cross_shapes, trip.devices)]
    pendings = exchange.start(transfers, status=bad, pool=pool)
    outs = [p.wait() for p in pendings]
    first = pendings[0] if pendings else None  # one round: the pendings share its status words
    received = None if status is None or first is None else first.flagged_peers()
    verdict = received
    for i, (leg, route) in enumerate(zip(legs, routes)):
        if outs[i] is not None and route.gather:
            flag = None if status is None else (received > 0).long() | bad
            outs[i], flagged = _hops.gather(outs[i], leg.dim, route.gather, flag)
            if status is not None:
                verdict = verdict + _positive(flagged)  # a replica relayed flagged rows
    return outs, first, verdict


def _positive(status: int | torch.Tensor) -> int | torch.Tensor:
    """1 where a summed status word is nonzero (a device tensor stays on the device)."""
    return (status > 0.5).long() if isinstance(status, torch.Tensor) else int(status > 0)


class _RedistributeFunction(torch.autograd.Function):
    """Many tensors, one autograd node: forward and backward are one batched round each (plus,
    two-hop, the scatter and gather collectives inside each mesh)."""

    @staticmethod
    def forward(ctx, call: _Call, check: bool | str, pool: exchange.BufferPool | None,
                *xs: DTensor) -> tuple[DTensor, ...]:
        legs, trip = call.legs, call.forward
        ctx.call, ctx.pool = call, pool
        if trip.idle and check != "world":
            return trip.wrap([None] * len(legs))
        x_locals = [None if e is None else _as_rows(x.to_local()) for x, e in zip(xs, trip.in_shapes)]
        if check == "world":
            check_local_shapes(x_locals, trip.in_shapes, [leg.src for leg in legs], trip.devices[0])
        mine = None  # this rank's wrong shard: its planned rows go out as zeros, flagged
        if check is True:
            for i, (xl, e) in enumerate(zip(x_locals, trip.in_shapes)):
                if xl is not None:
                    x_locals[i], bad = exchange.as_planned(xl, e)
                    if bad:
                        mine = mine or (f"rank {dist.get_rank()} holds a local shard of shape {tuple(xl.shape)} "
                                        f"but the plan for {legs[i].src!r} expects {e}")
        status = None if check is False or check == "world" else int(mine is not None)
        outs, first, verdict = _exchange(legs, trip, x_locals, status, pool)
        if check is True and (mine is not None or (verdict is not None and verdict.item())):  # the call's one sync
            bad_peers = [] if first is None else sorted(first.peer_status())
            _raise_bad_shards(mine, bad_peers, not bad_peers, legs)
        return trip.wrap(outs)

    @staticmethod
    def backward(ctx, *grads: DTensor):
        legs, trip = ctx.call.legs, ctx.call.backward
        if trip.idle:
            return (None, None, None, *trip.wrap([None] * len(legs)))
        g_locals = []
        for leg, shape, device, grad in zip(legs, trip.in_shapes, trip.in_devices, grads):
            # Every rank plans with the placements declared at forward time: ranks off the
            # destination mesh never see the real gradient, so they cannot read them off it.
            g_local = None
            if shape is not None and grad is not None:
                if isinstance(grad, DTensor):
                    grad = _declared_local(grad, leg.dst_mesh, leg.grad_placements)
                g_local = _as_rows(grad)
            elif shape is not None:  # output unused: a zero gradient
                g_local = torch.zeros(shape, dtype=leg.dtype, device=device)
            g_locals.append(g_local)
        outs, _, _ = _exchange(legs, trip, g_locals, None, ctx.pool)
        return (None, None, None, *trip.wrap(outs))


def _declared_local(grad: DTensor, mesh: DeviceMesh, declared: tuple[Placement, ...]) -> torch.Tensor:
    """The local shard of `grad` (on `mesh`, the destination) under the `declared` gradient
    placements: a same-mesh redistribution on the destination's members only. DTensor cannot
    redistribute to `Partial`, so a dim declared `Partial` where the gradient arrives otherwise
    is made whole there (`Replicate`: the gradient counts once, DTensor's convention) and kept by
    its coordinate 0 alone, zeros on the other members: the same sum, with no collective on the
    ranks off the mesh, which could not join one."""
    current = tuple(grad.placements)
    if current == declared:
        return grad.to_local()
    target = tuple(Replicate() if type(p) is Partial and c != p else p for p, c in zip(declared, current))
    if target != current:
        grad = grad.redistribute(mesh, target)
    coord = mesh.get_coordinate()
    held = all(c == 0 for p, t, c in zip(declared, target, coord) if type(p) is Partial and t != p)
    return grad.to_local() if held else torch.zeros_like(grad.to_local())


class Side(NamedTuple):
    """One side of a `Bridge`: who holds which rows (`MeshSpec`), its process group along each
    spec dim (for two hops), and the device its rows live on."""

    spec: MeshSpec
    groups: _hops.Groups
    device: torch.device


class _Rows(NamedTuple):
    global_shape: tuple[int, ...]
    dim: int
    dtype: torch.dtype


DEFAULT_BUFFERS = exchange.BufferPool()
"""The buffers `redistribute` recycles by default (``buffers=True``); ``DEFAULT_BUFFERS.clear()``
drops them."""


def _leg(src_mesh: DeviceMesh, src_placements: tuple[Placement, ...], shape: torch.Size, dtype: torch.dtype,
         device_mesh: DeviceMesh, placements: tuple[Placement, ...], sample_sizes: tuple[int, ...] | None,
         shard_bounds: tuple[int, ...] | None, grad_placements: tuple[Placement, ...] | None,
         names: tuple[str, str], n_hops: int | None) -> _Leg:
    _hops.check_hops(n_hops, "redistribute")
    dim = _bridged_dim(src_placements, placements)
    extent = shape[dim] if len(shape) else 1
    if grad_placements is None:
        grad_placements = summed_placements(placements)
    if len(grad_placements) != device_mesh.ndim:
        raise PlanError(f"grad_placements {grad_placements} has {len(grad_placements)} entries for a "
                        f"{device_mesh.ndim}-d destination mesh; give one placement per mesh dim")
    src = _spec(src_mesh, src_placements, extent, sample_sizes, names[0])
    return _Leg(src if shard_bounds is None else src.replace(shard_bounds=shard_bounds),
                _spec(device_mesh, placements, extent, sample_sizes, names[1]),
                src_mesh, device_mesh, placements, grad_placements, shape, dtype, dim, n_hops)


def _signature(x: DTensor, device_mesh: DeviceMesh, placements: Sequence[Placement],
               sample_sizes: Sequence[int] | None, shard_bounds: Sequence[int] | None,
               grad_placements: Sequence[Placement] | None, names: tuple[str, str], n_hops: int | None) -> tuple:
    """`_leg`'s arguments for one tensor, hashable: the key of the prepared call."""
    if not isinstance(x, DTensor):
        raise TypeError(f"redistribute expects a DTensor, got {type(x).__name__}; wrap it with "
                        "DTensor.from_local or distribute_tensor first")
    return (x.device_mesh, tuple(x.placements), x.shape, x.dtype, device_mesh, _normalized(placements, x.ndim),
            None if sample_sizes is None else tuple(sample_sizes),
            None if shard_bounds is None else tuple(shard_bounds),
            None if grad_placements is None else _normalized(grad_placements, x.ndim), tuple(names), n_hops)


def redistribute(
    x: DTensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    sample_sizes: Sequence[int] | None = None,
    shard_bounds: Sequence[int] | None = None,
    grad_placements: Sequence[Placement] | None = None,
    check: bool | str = True,
    hops: int | None = None,
    buffers: exchange.BufferPool | bool = True,
) -> DTensor:
    """Redistribute ``x`` to ``placements`` on ``device_mesh``, which may differ from ``x.device_mesh``.

    SPMD: every rank of the world calls it. Mirrors `DTensor.redistribute`, but the target
    mesh may be disjoint from, overlap, or equal the source mesh. Differentiable, with
    DTensor's gradient convention: the gradient of a `Replicate` output is taken once, a
    `Partial` one is summed. On a rank outside the target mesh, complete the backward
    exchange with ``torch.autograd.backward([y], [torch.zeros_like(y)])``.

    Args:
        x: a DTensor (``distribute_tensor`` / ``DTensor.from_local``); ranks outside its
            mesh hold empty local shards, as DTensor does.
        device_mesh, placements: the target layout. Every `Shard` on either side names the
            same tensor dim (the batch or flat-token dim); other dims are whole on both sides.
        sample_sizes: ragged data: rows of each sample along the sharded dim (zeros allowed).
            Both sides then split *samples* like ``torch.tensor_split`` (the data layer's rule)
            instead of rows like ``torch.chunk``. Every rank derives them from batch metadata,
            so no sizes cross the wire. For ragged inputs, build ``x`` with
            ``DTensor.from_local(local, mesh, placements, shape=global_shape, stride=...)``.
        shard_bounds: the source's own ragged split, when it is not `sample_sizes`': the first
            row of each shard index of its Shard dims, then the extent (e.g. an encoder's items
            balanced over its dp ranks, `dtensor_mimo.data.balance`); the destination still
            splits by `sample_sizes`. Rows keep their global order, so they cross in one hop.
        grad_placements: placements of ``y``'s gradient on ``device_mesh``, declared up front
            because ranks off that mesh must plan the backward too. Default: ``placements``
            with `Partial` read as `Replicate`. Declare e.g. ``Partial()`` on the cp dim when
            each cp rank's gradient is a partial sum (and use the same ``grad_placements`` in
            ``y.to_local``); a gradient arriving with other placements is first redistributed
            to these on ``device_mesh`` (to a declared `Partial` dim: made whole there, then held
            by its coordinate 0, zeros on the other members, as DTensor counts a `Replicate` one).
        check: what guards against a local shard whose shape disagrees with the plan.
            True (default): a status word rides ahead of the data in the same batch (one 8-byte
            message to each peer, no collective): the rank holding the wrong shard sends
            zeros of the planned sizes and raises, and every rank that received from it
            raises too; the exchange never hangs (ranks that did not exchange with it go on,
            so the caller's next collective is where they learn of it). "world": one small
            all-reduce over the world first, so every rank raises before any data moves
            (MimoModel uses it the first time it sees a modality). False: no check (a wrong
            shard can hang or corrupt).
            Host syncs: True reads the verdict once per call (however many two-hop levels).
        hops: how rows travel. 1: every destination rank that holds a row receives it from a
            source rank (a row crosses once per destination replica). 2: each row crosses once,
            its pieces spread over the destination replicas, then an all-gather over the
            destination's Replicate dims; a Partial source is reduce-scattered first (see
            `dtensor_mimo.bridge.hops`). None (default): across nodes, 2 for a direction between
            meshes that share no rank where 1 would move a row more than once (replicated
            destination, Partial source), else 1; on one node (torchrun's LOCAL_WORLD_SIZE equals
            the world size) always 1, as its links are alike.
        buffers: where outputs (and backward's gradients) are received on CPU. True (default):
            `DEFAULT_BUFFERS`, blocks the library recycles (`BufferPool`): a block is reused once
            every tensor made from it has been dropped, so a training loop allocates no receive
            buffer per call; outputs are views of those blocks. A `BufferPool` of the caller's:
            the same, from that pool. False: fresh tensors. On accelerators every choice gives
            fresh tensors from the caching allocator.

    Errors in the metadata (sizes that do not sum, a placement the plan cannot serve, meshes
    over another world) raise `PlanError` on every rank before any communication.
    """
    if sample_sizes is None and shard_bounds is None and isinstance(x, DTensor) and x.device_mesh == device_mesh:
        return x.redistribute(device_mesh, tuple(placements))
    (y,) = redistribute_many([x], [device_mesh], [placements], sample_sizes=[sample_sizes],
                             shard_bounds=[shard_bounds], grad_placements=[grad_placements], check=check,
                             hops=[hops], buffers=buffers)
    return y


def redistribute_many(
    xs: Sequence[DTensor],
    device_meshes: Sequence[DeviceMesh],
    placements: Sequence[Sequence[Placement]],
    *,
    sample_sizes: Sequence[Sequence[int] | None] | None = None,
    shard_bounds: Sequence[Sequence[int] | None] | None = None,
    grad_placements: Sequence[Sequence[Placement] | None] | None = None,
    check: bool | str = True,
    names: Sequence[tuple[str, str]] | None = None,
    hops: Sequence[int | None] | None = None,
    buffers: exchange.BufferPool | bool = True,
) -> tuple[DTensor, ...]:
    """`redistribute` of several tensors (e.g. one per encoder) as ONE autograd node.

    Forward and backward each run as one batched point-to-point round, in list order on
    every rank (two-hop legs add their scatter before it and their gather after it, in list
    order too). Separate `redistribute` calls would leave the order of their backward
    exchanges to the autograd engine, which need not agree across ranks that share two
    bridges. Arguments are per-tensor lists with `redistribute`'s meaning; ``names`` labels
    each tensor's (source, destination) meshes in error messages, e.g. ``("vision", "language")``;
    ``hops`` chooses one-hop or two-hop per tensor; ``buffers`` is `redistribute`'s, for all.
    ``check`` is `redistribute`'s.

    Host syncs: ``check=True`` reads the status words' verdict once per call (one sync, whatever
    the number of tensors and two-hop levels); False reads none; "world" reads its all-reduce once.

    A call is prepared once per signature (meshes, placements, shapes, sizes, options) and
    cached, so a repeated call costs a dictionary lookup before its messages are posted.
    """
    n = len(xs)
    if check not in (True, False, "world"):
        raise ValueError(f"redistribute: check={check!r}; use True (status word), 'world' or False")
    if not (len(device_meshes) == len(placements) == n):
        raise ValueError(f"redistribute_many: {n} tensors, {len(device_meshes)} meshes and "
                         f"{len(placements)} placement lists; give one of each per tensor")
    sample_sizes = [None] * n if sample_sizes is None else list(sample_sizes)
    shard_bounds = [None] * n if shard_bounds is None else list(shard_bounds)
    grad_placements = [None] * n if grad_placements is None else list(grad_placements)
    names = [("source", "destination")] * n if names is None else list(names)
    hops = [None] * n if hops is None else list(hops)
    per_tensor = {"sample_sizes": sample_sizes, "shard_bounds": shard_bounds, "grad_placements": grad_placements,
                  "names": names, "hops": hops}
    if wrong := [f"{k} has {len(v)}" for k, v in per_tensor.items() if len(v) != n]:
        raise ValueError(f"redistribute_many: {n} tensors, but {', '.join(wrong)} entries; give one per tensor")
    pool = DEFAULT_BUFFERS if buffers is True else (buffers or None)
    signature = tuple(_signature(*args) for args in zip(xs, device_meshes, placements, sample_sizes,
                                                        shard_bounds, grad_placements, names, hops))
    call = _prepare(signature, _context([m for leg in signature for m in (leg[0], leg[4])]))
    return _RedistributeFunction.apply(call, check, pool, *xs)


class Bridge:
    """Split-phase cross-mesh transfer for a pipeline runtime: the same plans and exchange as
    `redistribute`, on local tensors, with each side posted separately so transfers overlap compute.

    ``send_forward`` runs on ranks of the source mesh, ``recv_forward`` on ranks of the
    destination mesh. Each returns a `hops.Delivery`; ``wait()`` completes it and, on a
    receiving rank, returns the local output. Backward likewise, with the gradient's placements
    on the destination mesh (default: the destination's). ``hops`` is `redistribute`'s: two
    hops scatter on the sending side when it posts (a Partial gradient is reduce-scattered
    there) and all-gather on the receiving side in ``wait()``; every member of a side calls
    its half of each direction in the same order.

    NCCL safety: a rank posts ALL of its operations of one exchange in ONE batch. On a rank that
    is on both meshes (colocated or overlapping), the first of its two calls of a direction posts
    its sends and receives together and both calls return that same handle; that first call
    needs the rank's local source (``send_forward(x)``, or ``recv_forward(src_local=x)``). Two
    ranks that each send to the other can therefore never block on each other's unposted receive.
    Several bridges whose transfers must go in one batch (one per encoder of a microbatch, as
    `MimoModel`'s crossings) are posted together with `post_together`; `Bridge.between` builds a
    bridge between two sides given as `MeshSpec`s (e.g. one pipeline stage's slice of a mesh).

    Example::

        bridge = Bridge(vision_mesh, [Replicate(), Shard(0), Replicate(), Replicate()],
                        language_mesh, [Replicate(), Shard(0), Replicate(), Replicate()],
                        global_shape=(n_tokens, hidden), dtype=torch.float32, sample_sizes=tokens_per_sample)
        pending = bridge.send_forward(encoder_out)            # on vision ranks
        h = bridge.recv_forward().wait()                       # on language ranks
    """

    def __init__(
        self,
        src_mesh: DeviceMesh,
        src_placements: Sequence[Placement],
        dst_mesh: DeviceMesh,
        dst_placements: Sequence[Placement],
        *,
        global_shape: Sequence[int],
        dtype: torch.dtype,
        sample_sizes: Sequence[int] | None = None,
        grad_placements: Sequence[Placement] | None = None,
        buffers: exchange.BufferPool | None = None,
        hops: int | None = None,
    ) -> None:
        _hops.check_hops(hops, "Bridge")
        ndim = len(global_shape)
        src_placements, dst_placements = _normalized(src_placements, ndim), _normalized(dst_placements, ndim)
        grad_placements = None if grad_placements is None else _normalized(grad_placements, ndim)
        dim = _bridged_dim(src_placements, dst_placements)
        extent = tuple(global_shape)[dim]
        src = Side(_spec(src_mesh, src_placements, extent, sample_sizes, "source"), src_mesh.get_group,
                   _device(src_mesh))
        dst = Side(_spec(dst_mesh, dst_placements, extent, sample_sizes, "destination"), dst_mesh.get_group,
                   _device(dst_mesh))
        self._setup(src, dst, _Rows(tuple(global_shape), dim, dtype), grad_placements or dst.spec.placements, hops,
                    buffers)

    @classmethod
    def between(cls, src: Side, dst: Side, *, width: int, dtype: torch.dtype,
                grad_placements: Sequence[Placement] | None, hops: int | None = None,
                buffers: exchange.BufferPool | None = None) -> "Bridge":
        """A bridge of rows ``[extent, width]`` between two `Side`s (e.g. a pipeline stage's slice
        of a module mesh, ragged sizes and shard bounds included); without `grad_placements` no
        gradient comes back (``send_backward`` / ``recv_backward`` refused)."""
        bridge = cls.__new__(cls)
        bridge._setup(src, dst, _Rows((src.spec.extent, width), 0, dtype), grad_placements, hops, buffers)
        return bridge

    def _setup(self, src: Side, dst: Side, rows: _Rows, grad_placements: Sequence[Placement] | None,
               hops: int | None, buffers: exchange.BufferPool | None) -> None:
        self.global_shape, self.dim, self.dtype = rows
        self.buffers = buffers
        """Where outputs are received: a `BufferPool` (recycled) or None (fresh tensors)."""
        self.src, self.dst = src.spec, dst.spec
        world, self.rank = dist.get_world_size(), dist.get_rank()
        self.forward_route = _hops.route(src.spec, dst.spec, self.rank, world, hops, src.groups, dst.groups)
        """This rank's part of the forward trip."""
        self.backward_route = None if grad_placements is None else _hops.backward_route(
            src.spec, dst.spec, grad_placements, self.rank, world, hops, src.groups, dst.groups)
        """This rank's part of the backward trip (None: no gradient comes back)."""
        self._src_device, self._dst_device = src.device, dst.device
        self._in_src, self._in_dst = src.spec.is_member(self.rank), dst.spec.is_member(self.rank)
        self._posted: dict[str, tuple[str, _hops.Delivery]] = {}  # both-sides rank: (half, handle)

    def route(self, direction: str) -> _hops.Route:
        """This rank's route of "forward" or "backward"."""
        route = self.forward_route if direction == "forward" else self.backward_route
        if route is None:
            raise RuntimeError("Bridge: built without grad_placements, so no gradient comes back")
        return route

    def out_shape(self, direction: str) -> tuple[int, ...]:
        """The local shape this rank receives in `direction` (before a two-hop gather)."""
        return _local_shape(self.global_shape, self.dim, self.route(direction).plan.dst_rows)

    def _post(self, direction: str, half: str, local: torch.Tensor | None) -> _hops.Delivery:
        posted = self._posted.get(direction)
        if posted is not None:
            other, pending = posted
            if other != half:  # this rank's other half already posted both sides
                del self._posted[direction]
                return pending
            raise RuntimeError(
                f"Bridge: {half}_{direction} called twice on rank {self.rank}, which is on both meshes, "
                f"before the {direction} exchange it already posted was received; call the other half "
                "for it first (one exchange per direction in flight on such a rank)")
        forward = direction == "forward"
        sends = self._in_src if forward else self._in_dst
        receives = self._in_dst if forward else self._in_src
        route = self.route(direction)
        if local is None and (route.plan.sends or route.plan.copies or (sends and route.scatter)):
            raise ValueError(
                f"Bridge: rank {self.rank} holds rows to send or copy in the {direction} exchange but "
                f"{half}_{direction} got no local tensor; pass it (on a rank on both meshes, to "
                "whichever half it calls first)")
        (delivery,) = post_together([self], direction, [local], send=sends, recv=receives)
        if sends and receives:
            self._posted[direction] = (half, delivery)
        return delivery

    def send_forward(self, x_local: torch.Tensor) -> _hops.Delivery:
        return self._post("forward", "send", x_local)

    def recv_forward(self, src_local: torch.Tensor | None = None) -> _hops.Delivery:
        return self._post("forward", "recv", src_local)

    def send_backward(self, grad_local: torch.Tensor) -> _hops.Delivery:
        return self._post("backward", "send", grad_local)

    def recv_backward(self, grad_local: torch.Tensor | None = None) -> _hops.Delivery:
        return self._post("backward", "recv", grad_local)


def post_together(bridges: Sequence[Bridge], direction: str, locals_: Sequence[torch.Tensor | None], *,
                  send: bool, recv: bool) -> list[_hops.Delivery]:
    """Post this rank's part of one direction ("forward" / "backward") of several bridges as ONE
    batch, in list order: each local is scattered first (two hops; a Partial level
    reduce-scatters, so every member of the sending side posts the same bridges in the same
    order), then one `exchange.start` of every cross hop's messages. What every rank sharing the
    bridges must do in the same order (NCCL safety). `send` / `recv`: which sides this rank posts;
    the bridges share a dim, dtype and buffers (the first's). A local of another dtype (an fp32
    gradient of bf16 rows) is cast to the bridges' dtype first, as autograd casts a gradient to its
    tensor's: the receivers' buffers hold that dtype, and a message of another size would abort
    them. Returns one `Delivery` per bridge."""
    if not bridges:
        return []
    first, forward = bridges[0], direction == "forward"
    device, dim = (first._dst_device if forward else first._src_device), first.dim
    transfers, routes = [], [b.route(direction) for b in bridges]
    for bridge, route, local in zip(bridges, routes, locals_):
        if local is not None and local.dtype != first.dtype:
            local = local.to(first.dtype)
        if send and route.scatter:
            if local is None:
                raise ValueError(f"rank {dist.get_rank()} scatters rows over its replicas before they "
                                 "cross but got no local tensor; pass its rows (or its gradient)")
            local, _ = _hops.scatter(local, dim, route.scatter, None)
        transfers.append(exchange.Transfer(route.plan, dim, local, bridge.out_shape(direction) if recv else None,
                                           first.dtype, device))
    pendings = exchange.start(transfers, send=send, recv=recv, pool=first.buffers)
    return [_hops.Delivery(p, route, dim) for p, route in zip(pendings, routes)]
