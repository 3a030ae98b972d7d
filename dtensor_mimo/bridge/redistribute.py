"""`redistribute`: DTensor's redistribute, across meshes, differentiable; and `Bridge`, its split-phase form.

Forward runs the plan from the source layout to the destination layout; backward runs
the plan of the gradient (`plan_backward`), whose source is the destination mesh with
the *gradient's* placements: DTensor's convention, so a `Replicate` gradient is taken
once and a `Partial` one (e.g. over cp ranks that each hold a partial sum) is summed.
"""

from __future__ import annotations

from math import prod
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from dtensor_mimo.bridge import exchange
from dtensor_mimo.bridge.plan import MeshSpec, Plan, PlanError, plan, plan_backward


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
    shape = list(global_shape)
    shape[dim] = rows
    return tuple(shape)


def _spec(mesh: DeviceMesh, placements: Sequence[Placement], extent: int,
          sample_sizes: Sequence[int] | None, name: str) -> MeshSpec:
    return MeshSpec(mesh.mesh.tolist(), tuple(placements), extent,
                    None if sample_sizes is None else tuple(sample_sizes), name=name)


def _wrap(local: torch.Tensor | None, mesh: DeviceMesh, placements: Sequence[Placement],
          global_shape: Sequence[int]) -> DTensor:
    if local is None:  # this rank is not on the mesh: DTensor's empty local shard
        local = torch.empty(0, device=_device(mesh))
    return DTensor.from_local(local, mesh, placements, run_check=False,
                              shape=torch.Size(global_shape), stride=_contiguous_stride(global_shape))


def _check_local_shapes(x_local: torch.Tensor | None, expected: tuple[int, ...] | None, spec: MeshSpec,
                        device: torch.device) -> None:
    """Agree over the whole world that every rank's local shard has the planned shape.

    A wrong shard is visible on its own rank only; raising there alone would leave the
    others waiting in the exchange. One small all-reduce lets every rank raise the same error.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    bad = expected is not None and tuple(x_local.shape) != expected
    flags = torch.zeros(world, dtype=torch.int64, device=device)
    flags[rank] = int(bad)
    dist.all_reduce(flags)
    if flags.any():
        ranks = flags.nonzero().flatten().tolist()
        mine = f" (this rank holds {tuple(x_local.shape)}, the plan expects {expected})" if bad else ""
        raise PlanError(
            f"rank(s) {ranks} hold a local shard whose shape disagrees with the plan for source "
            f"{spec!r}{mine}; the local shards must follow the placements (and sample_sizes, if "
            "given): build the input with distribute_tensor, or DTensor.from_local with the same sizes"
        )


class _RedistributeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: DTensor, src: MeshSpec, dst: MeshSpec, dst_mesh: DeviceMesh,
                dst_placements: tuple[Placement, ...], grad_placements: tuple[Placement, ...],
                dim: int, check: bool) -> DTensor:
        rank, world = dist.get_rank(), dist.get_world_size()
        fwd = plan(src, dst, world)
        rp = fwd.for_rank(rank)
        src_mesh = x.device_mesh
        in_src = src_mesh.get_coordinate() is not None
        in_dst = dst_mesh.get_coordinate() is not None
        x_local = x.to_local() if in_src else None
        device = _device(dst_mesh)
        if check:
            expected = _local_shape(x.shape, dim, rp.src_rows) if in_src else None
            _check_local_shapes(x_local, expected, src, device)
        out_shape = _local_shape(x.shape, dim, rp.dst_rows) if in_dst else None
        y_local = exchange.start(rp, dim, src_local=x_local, out_shape=out_shape,
                                 dtype=x.dtype, device=device).wait()
        ctx.meta = (src, dst, src_mesh, dst_mesh, grad_placements, x.shape, x.dtype, dim)
        return _wrap(y_local, dst_mesh, dst_placements, x.shape)

    @staticmethod
    def backward(ctx, grad: DTensor):
        src, dst, src_mesh, dst_mesh, grad_placements, shape, dtype, dim = ctx.meta
        # Every rank plans with the placements declared at forward time: ranks off the
        # destination mesh never see the real gradient, so they cannot read them off it.
        rank = dist.get_rank()
        rp = plan_backward(src, dst, grad_placements, dist.get_world_size()).for_rank(rank)
        in_dst = dst_mesh.get_coordinate() is not None
        g_local = None
        if in_dst:
            if isinstance(grad, DTensor):
                if tuple(grad.placements) != grad_placements:  # same-mesh collective on its members
                    grad = grad.redistribute(dst_mesh, grad_placements)
                grad = grad.to_local()
            g_local = grad
        in_src = src_mesh.get_coordinate() is not None
        out_shape = _local_shape(shape, dim, rp.dst_rows) if in_src else None
        gx = exchange.start(rp, dim, src_local=g_local, out_shape=out_shape, dtype=dtype,
                            device=_device(src_mesh)).wait()
        x_grad_placements = tuple(Replicate() if isinstance(p, Partial) else p for p in src.placements)
        return _wrap(gx, src_mesh, x_grad_placements, shape), None, None, None, None, None, None, None


def redistribute(
    x: DTensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    sample_sizes: Sequence[int] | None = None,
    grad_placements: Sequence[Placement] | None = None,
    check: bool = True,
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
        grad_placements: placements of ``y``'s gradient on ``device_mesh``, declared up front
            because ranks off that mesh must plan the backward too. Default: ``placements``
            with `Partial` read as `Replicate`. Declare e.g. ``Partial()`` on the cp dim when
            each cp rank's gradient is a partial sum (and use the same ``grad_placements`` in
            ``y.to_local``); a gradient arriving with other placements is first redistributed
            to these on ``device_mesh``.
        check: agree over the world, with one small all-reduce, that every local shard has
            the planned shape, so a wrong shard fails on every rank instead of hanging.

    Errors in the metadata (sizes that do not sum, a placement the plan cannot serve, meshes
    over another world) raise `PlanError` on every rank before any communication.
    """
    if not isinstance(x, DTensor):
        raise TypeError(f"redistribute expects a DTensor, got {type(x).__name__}; wrap it with "
                        "DTensor.from_local or distribute_tensor first")
    placements = tuple(placements)
    if sample_sizes is None and x.device_mesh == device_mesh:
        return x.redistribute(device_mesh, placements)
    dim = _bridged_dim(x.placements, placements)
    extent = x.shape[dim] if x.ndim else 1
    src = _spec(x.device_mesh, x.placements, extent, sample_sizes, "source")
    dst = _spec(device_mesh, placements, extent, sample_sizes, "destination")
    if grad_placements is None:
        grad_placements = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
    grad_placements = tuple(grad_placements)
    if len(grad_placements) != device_mesh.ndim:
        raise PlanError(f"grad_placements {grad_placements} has {len(grad_placements)} entries for a "
                        f"{device_mesh.ndim}-d destination mesh; give one placement per mesh dim")
    return _RedistributeFunction.apply(x, src, dst, device_mesh, placements, grad_placements, dim, check)


class Bridge:
    """Split-phase cross-mesh transfer for a pipeline runtime: the same plans and exchange as
    `redistribute`, on local tensors, with each side posted separately so transfers overlap compute.

    ``send_forward`` runs on ranks of the source mesh, ``recv_forward`` on ranks of the
    destination mesh (a rank on both calls both; its local copies happen on the receiving
    call, which then needs ``src_local``). Each returns an `exchange.Pending`; ``wait()``
    completes it and, on a receiving rank, returns the local output. Backward likewise,
    with the gradient's placements on the destination mesh (default: the destination's).

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
    ) -> None:
        self.dim = _bridged_dim(src_placements, dst_placements)
        self.global_shape = tuple(global_shape)
        self.dtype = dtype
        extent = self.global_shape[self.dim]
        src = _spec(src_mesh, src_placements, extent, sample_sizes, "source")
        dst = _spec(dst_mesh, dst_placements, extent, sample_sizes, "destination")
        world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.forward_plan: Plan = plan(src, dst, world)
        self.backward_plan: Plan = plan_backward(src, dst, grad_placements or dst.placements, world)
        self._src_device, self._dst_device = _device(src_mesh), _device(dst_mesh)
        self._in_src = src_mesh.get_coordinate() is not None
        self._in_dst = dst_mesh.get_coordinate() is not None

    def _start(self, p: Plan, local: torch.Tensor | None, member: bool, device: torch.device,
               send: bool, recv: bool) -> exchange.Pending:
        rp = p.for_rank(self.rank)
        out_shape = _local_shape(self.global_shape, self.dim, rp.dst_rows) if recv and member else None
        return exchange.start(rp, self.dim, src_local=local, out_shape=out_shape, dtype=self.dtype,
                              device=device, send=send, recv=recv)

    def send_forward(self, x_local: torch.Tensor) -> exchange.Pending:
        return self._start(self.forward_plan, x_local, self._in_dst, self._dst_device, send=True, recv=False)

    def recv_forward(self, src_local: torch.Tensor | None = None) -> exchange.Pending:
        return self._start(self.forward_plan, src_local, self._in_dst, self._dst_device, send=False, recv=True)

    def send_backward(self, grad_local: torch.Tensor) -> exchange.Pending:
        return self._start(self.backward_plan, grad_local, self._in_src, self._src_device, send=True, recv=False)

    def recv_backward(self, grad_local: torch.Tensor | None = None) -> exchange.Pending:
        return self._start(self.backward_plan, grad_local, self._in_src, self._src_device, send=False, recv=True)
