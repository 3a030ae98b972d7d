"""The two-hop bridge: each row crosses between the meshes once, replicas share it inside a mesh.

One-hop (`plan_for_rank` on the given specs) delivers every row to every destination rank that
holds it: with a destination replicated over tp·cp = 16 ranks, each row crosses 16 times, over
the slowest links of a cluster (modules sit on different nodes). Two-hop routes it as

1. *scatter* on the source mesh: over each `Partial` dim of size > 1 a reduce-scatter, over each
   `Replicate` dim a local narrow (no communication), outer dims first: each source rank now
   holds one distinct ``torch.chunk`` piece of its shard's rows (`MeshSpec.split_dims`);
2. *cross*: the plan between the two split layouts, one batched point-to-point round: each row
   crosses once, and every link of the destination replica group carries a share;
3. *gather* on the destination mesh: an all-gather over each `Replicate` dim of size > 1, inner
   dims first, rebuilding every replica's rows.

The backward is the same route for the gradient (a `Partial` gradient, e.g. over cp, is
reduce-scattered before it crosses). Pieces are padded to the chunk size for the collectives,
whose members all hold the same parent rows, so the padding is known on every rank without
a shape message. A status word (`check`) rides along as one extra element per piece, summed
by the reduce-scatter and gathered by the all-gather, so a wrong shard is reported on every rank
whose rows it touched.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.placement_types import Placement

from dtensor_mimo.bridge import exchange
from dtensor_mimo.bridge.plan import (MeshSpec, RankPlan, _bounds, _Mesh, _static, backward_specs, plan,
                                      plan_for_rank)
from dtensor_mimo.layout.torch_compat import all_gather_single, reduce_scatter_single

Groups = Callable[[int], dist.ProcessGroup]
"""A side's process group along one of its spec's mesh dims (e.g. ``DeviceMesh.get_group``); asked
only on members of that side, for the dims a two-hop route splits."""


def split_dims(spec: MeshSpec, *, source: bool) -> tuple[int, ...]:
    """Mesh dims the two-hop route splits: on a source, its Replicate and Partial dims of size > 1;
    on a destination, its Replicate dims of size > 1 (a Partial destination keeps the value on
    coordinate 0)."""
    kinds = (Replicate, Partial) if source else (Replicate,)
    return tuple(d for d, (n, p) in enumerate(zip(spec.shape, spec.placements)) if n > 1 and type(p) in kinds)


def wants_two_hops(src: MeshSpec, dst: MeshSpec) -> bool:
    """The default route: two hops when the meshes share no rank (two modules on their own
    nodes) and one hop would move a row between them more than once: the destination replicates
    it, or the source holds it as several Partial contributions. Meshes that share ranks
    (colocated, overlapping) keep one hop: there most rows are local copies already."""
    repeats = bool(split_dims(dst, source=False)) or any(
        n > 1 and type(p) is Partial for n, p in zip(src.shape, src.placements))
    return repeats and _disjoint(src._mesh, dst._mesh)


def default_hops(src: MeshSpec, dst: MeshSpec, world_size: int) -> int:
    """The route `redistribute` takes with ``hops=None``: 2 where `wants_two_hops` and the world
    spans several nodes, else 1. On one node (torchrun's LOCAL_WORLD_SIZE covers the world) the
    links are alike and a second hop only adds latency."""
    one_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) >= world_size
    return 2 if wants_two_hops(src, dst) and not one_node else 1


@functools.lru_cache(maxsize=64)
def _disjoint(a: _Mesh, b: _Mesh) -> bool:
    return set(a.flat).isdisjoint(b.flat)


def two_hop_specs(src: MeshSpec, dst: MeshSpec) -> tuple[MeshSpec, MeshSpec]:
    """The specs of the cross hop: `src` and `dst` with their `split_dims` set."""
    return (src.replace(split_dims=split_dims(src, source=True)),
            dst.replace(split_dims=split_dims(dst, source=False)))


@dataclass(frozen=True)
class Level:
    """One split mesh dim of a rank: its process group, size, coordinate and the rows of the
    piece it splits (the same on every member of the group)."""

    group: dist.ProcessGroup
    size: int
    coord: int
    parent_rows: int
    partial: bool
    group_ranks: tuple[int, ...] | None = None
    """The rank in `group` of the member at each coordinate, or None where they are the same: a
    process group orders its members by global rank, a mesh dim by coordinate, and the two differ
    on a mesh built over ranks out of ascending order."""

    def slot(self, coord: int) -> int:
        """The position in the group's collectives of the member at mesh coordinate `coord`."""
        return coord if self.group_ranks is None else self.group_ranks[coord]

    @property
    def chunk(self) -> int:
        return -(-self.parent_rows // self.size)

    def own(self) -> tuple[int, int]:
        return _span(0, self.parent_rows, self.size, self.coord)


def _span(lo: int, hi: int, size: int, j: int) -> tuple[int, int]:
    """Rows of ``torch.chunk``'s piece `j` of `size` of ``[lo, hi)``."""
    n = hi - lo
    c = -(-n // size)
    return lo + min(c * j, n), lo + min(c * (j + 1), n)


def _reduced_spans(parent_rows: int, size: int, narrows: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Rows of its parent that each member of a Partial level keeps once the Replicate levels right
    after it, ``(size, coordinate)`` each and the same on every member, have narrowed its chunk."""
    spans = []
    for j in range(size):
        lo, hi = _span(0, parent_rows, size, j)
        for m, coord in narrows:
            lo, hi = _span(lo, hi, m, coord)
        spans.append((lo, hi))
    return spans


def _narrows_after(partial: Sequence[bool], i: int) -> int:
    """How many levels after level `i` are Replicate ones before the next Partial level (or the end)."""
    n = 0
    while i + 1 + n < len(partial) and not partial[i + 1 + n]:
        n += 1
    return n


def _coords(spec: MeshSpec, rank: int) -> tuple[int, ...] | None:
    i = _static(spec).index.get(rank)
    if i is None:
        return None
    coords = []
    for n in reversed(spec.shape):
        i, c = divmod(i, n)
        coords.append(c)
    return tuple(reversed(coords))


def _split_rows(spec: MeshSpec, split: Sequence[int], rank: int) -> list[tuple[int, int, int]]:
    """``(mesh dim, coordinate, parent rows)`` per split level of `rank`, outer first."""
    coord = _coords(spec, rank)
    if coord is None:
        return []
    lo, hi = _bounds(spec, _static(spec).shard[_static(spec).index[rank]])
    out, rows = [], hi - lo
    for d in split:
        out.append((d, coord[d], rows))
        c = -(-rows // spec.shape[d])
        rows = max(0, min(c * (coord[d] + 1), rows) - min(c * coord[d], rows))
    return out


def _group_ranks(spec: MeshSpec, rank: int, d: int, group: dist.ProcessGroup) -> tuple[int, ...] | None:
    """`Level.group_ranks` of `rank`'s group along mesh dim `d` of `spec`."""
    coord = list(_coords(spec, rank))
    members = []
    for j in range(spec.shape[d]):
        coord[d], node = j, spec.mesh
        for c in coord:
            node = node[c]
        members.append(node)
    ranks = tuple(dist.get_group_rank(group, r) for r in members)
    return None if ranks == tuple(range(len(ranks))) else ranks


def levels(spec: MeshSpec, split: Sequence[int], groups: Groups, rank: int) -> list[Level]:
    """`rank`'s split levels of `spec` (unsplit), outer first; [] off the mesh or with no split."""
    return [Level(group, spec.shape[d], c, rows, type(spec.placements[d]) is Partial,
                  _group_ranks(spec, rank, d, group))
            for d, c, rows in _split_rows(spec, split, rank) for group in (groups(d),)]


@dataclass(frozen=True)
class Route:
    """This rank's part of one direction of one tensor's trip: the cross hop's plan and, two-hop,
    the split levels before it (on the sending side) and after it (on the receiving side)."""

    plan: RankPlan
    scatter: tuple[Level, ...]
    gather: tuple[Level, ...]
    src_rows: int  # local rows on the sending side before the scatter
    dst_rows: int  # local rows on the receiving side after the gather


def check_hops(n_hops: object, where: str) -> None:
    """`n_hops` is a route choice (None, 1 or 2), else a ValueError naming `where`."""
    if not (n_hops is None or (type(n_hops) is int and n_hops in (1, 2))):
        raise ValueError(f"{where}: hops={n_hops!r}; use None (choose per direction), 1 or 2")


def route(src: MeshSpec, dst: MeshSpec, rank: int, world_size: int, n_hops: int | None,
          src_groups: Groups, dst_groups: Groups) -> Route:
    """`rank`'s route from `src` to `dst` in `n_hops` (None: `default_hops`), O(own peers + samples)."""
    check_hops(n_hops, "route")
    if n_hops is None:
        n_hops = default_hops(src, dst, world_size)
    if n_hops == 1:
        rp = plan_for_rank(src, dst, rank, world_size)
        return Route(rp, (), (), rp.src_rows, rp.dst_rows)
    split_src, split_dst = two_hop_specs(src, dst)
    (a, b), (c, d) = src.local_range(rank), dst.local_range(rank)
    return Route(plan_for_rank(split_src, split_dst, rank, world_size),
                 tuple(levels(src, split_src.split_dims, src_groups, rank)),
                 tuple(levels(dst, split_dst.split_dims, dst_groups, rank)), b - a, d - c)


def backward_route(src: MeshSpec, dst: MeshSpec, grad_placements: Sequence[Placement], rank: int,
                   world_size: int, n_hops: int | None, src_groups: Groups, dst_groups: Groups) -> Route:
    """`route` of the gradient of a `src` -> `dst` trip: from `dst` with `grad_placements` back to
    `src` (`backward_specs`); `src_groups` / `dst_groups` are still the forward's sides."""
    grad_src, grad_dst = backward_specs(src, dst, grad_placements)
    return route(grad_src, grad_dst, rank, world_size, n_hops, dst_groups, src_groups)


class Delivery:
    """A route's output on this rank, split-phase (see `post`)."""

    def __init__(self, pending: exchange.Pending, route: Route, dim: int) -> None:
        self.route, self.dim = route, dim
        self._pending: exchange.Pending | None = pending
        self._out: torch.Tensor | None = None

    def wait(self) -> torch.Tensor | None:
        """Complete the cross hop's exchange and, two-hop, run the gather: a collective of the
        receiving side's replicas, so every member waits its deliveries in the same order. Returns
        the output (the same tensor on a second call), or None on a rank that only sends."""
        if self._pending is not None:
            out, self._pending = self._pending.wait(), None  # the cross hop's buffers go with it
            if out is not None and self.route.gather:
                out, _ = gather(out, self.dim, self.route.gather, None)
            self._out = out
        return self._out


def hop_rows(src: MeshSpec, dst: MeshSpec, hops: int) -> dict[str, int]:
    """Rows one redistribution moves per route: ``between`` the ranks of the cross hop (its
    messages; local copies excluded) and ``inside`` the meshes (ring reduce-scatter on the
    source, all-gather on the destination; 0 for one hop). O(world): for benchmarks and logs."""
    if hops == 1:
        return {"between": plan(src, dst).stats()["rows_sent"], "inside": 0}
    split_src, split_dst = two_hop_specs(src, dst)
    inside = 0
    for r in src.ranks:  # a ring reduce-scatter sends (m - 1) / m of its buffer from each member
        levels_ = _split_rows(src, split_src.split_dims, r)
        partial = [type(src.placements[d]) is Partial for d, _, _ in levels_]
        for i, (d, _, rows) in enumerate(levels_):
            if partial[i]:
                narrows = [(src.shape[d_], c_) for d_, c_, _ in levels_[i + 1:i + 1 + _narrows_after(partial, i)]]
                inside += (src.shape[d] - 1) * max(b - a for a, b in _reduced_spans(rows, src.shape[d], narrows))
    for r in dst.ranks:  # an all-gather brings each member the rows it lacks
        levels_ = _split_rows(dst, split_dst.split_dims, r)
        if levels_:
            lo, hi = split_dst.local_range(r)
            inside += levels_[0][2] - (hi - lo)
    return {"between": plan(split_src, split_dst).stats()["rows_sent"], "inside": inside}


def _rows2d(x: torch.Tensor, dim: int) -> torch.Tensor:
    width = math.prod(x.shape) // x.shape[dim] if x.shape[dim] else math.prod(x.shape[:dim] + x.shape[dim + 1:])
    return x.movedim(dim, 0).reshape(x.shape[dim], width)


def _back(rows: torch.Tensor, like: Sequence[int], dim: int) -> torch.Tensor:
    shape = list(like)
    shape.insert(0, shape.pop(dim))
    shape[0] = rows.shape[0]
    return rows.reshape(shape).movedim(0, dim)


def _with_flags(pieces: torch.Tensor, n: int, flag: float | torch.Tensor | None) -> torch.Tensor:
    """`pieces` ([n * chunk, W]) as n flat pieces, each followed by the status flag if given (a
    number, or a one-element tensor on the pieces' device: no host sync)."""
    flat = pieces.reshape(n, -1)
    if flag is None:
        return flat.contiguous()
    if isinstance(flag, torch.Tensor):
        return torch.cat([flat, flag.to(flat.dtype).reshape(1, 1).expand(n, 1)], dim=1)
    return torch.cat([flat, flat.new_full((n, 1), flag)], dim=1)


Status = int | torch.Tensor | None
"""A status word on its way through the hops: a number, or a tensor on the device (summed flags)."""


def scatter(x: torch.Tensor, dim: int, lv: Sequence[Level], status: Status) -> tuple[torch.Tensor, Status]:
    """Hop 1 on a source rank: its piece of `x` (a Partial level reduce-scattered), outer levels first.
    Returns the piece and the status summed over every contribution it holds: after a
    reduce-scatter a 0-d tensor on `x`'s device (never read on the host here: reading it is a
    device sync, left to the caller, once per call)."""
    rows = _rows2d(x, dim)
    i = 0
    while i < len(lv):
        level = lv[i]
        if not level.partial:
            a, b = level.own()
            rows, i = rows[a:b], i + 1
            continue
        # The Replicate levels right after this one narrow alike on every member of its group
        # (they share those coordinates): reduce only the rows each member keeps after them.
        n = _narrows_after([lv_.partial for lv_ in lv], i)
        spans = _reduced_spans(level.parent_rows, level.size, [(lv_.size, lv_.coord) for lv_ in lv[i + 1:i + 1 + n]])
        width, (lo, hi) = max(b - a for a, b in spans), spans[level.coord]
        i += 1 + n
        if width == 0:  # nothing to reduce (the same on every member)
            rows = rows[lo:hi]
            continue
        padded = rows.new_zeros(level.size * width, rows.shape[1])
        for j, (a, b) in enumerate(spans):  # the group's member k receives the k-th piece
            k = level.slot(j)
            padded[k * width: k * width + b - a] = rows[a:b]
        send = _with_flags(padded, level.size, status).reshape(-1)
        out = send.new_empty(send.numel() // level.size)
        reduce_scatter_single(out, send, group=level.group)
        if status is not None:
            status = out[-1].round()
            out = out[:-1]
        rows = out.view(width, -1)[: hi - lo]
    return _back(rows, x.shape, dim), status


def gather(piece: torch.Tensor, dim: int, lv: Sequence[Level], status: Status) -> tuple[torch.Tensor, Status]:
    """Hop 3 on a destination rank: all-gather its piece back to the shard's rows, inner levels
    first. Returns the rows and the status summed over every piece gathered (after a gather, a
    0-d tensor on the piece's device, as in `scatter`)."""
    rows = _rows2d(piece, dim)
    for level in reversed(lv):
        c = level.chunk
        if c == 0:  # an empty parent: nothing to gather (the same on every member)
            continue
        padded = rows.new_zeros(c, rows.shape[1])
        padded[: rows.shape[0]] = rows
        send = _with_flags(padded, 1, status)[0]
        out = send.new_empty(level.size * send.numel())
        all_gather_single(out, send, group=level.group)
        out = out.view(level.size, -1)
        if level.group_ranks is not None:  # the pieces in group order -> in mesh order
            out = out[list(level.group_ranks)]
        if status is not None:
            status = out[:, -1].sum().round()
            out = out[:, :-1]
        rows = out.reshape(level.size * c, -1)[: level.parent_rows]
    return _back(rows, piece.shape, dim), status
