"""The bridge's planner: which rows of a tensor move from which rank to which rank.

Pure index arithmetic over integers: no process group, no tensor. Both sides of a
cross-mesh redistribution are described by a `MeshSpec` (the mesh as nested global ranks,
one DTensor placement per mesh dim, the global extent along the bridged tensor dim and,
for ragged data, the rows of every sample). `plan(src, dst)` intersects the rows each
rank holds on either side and returns a `Plan` that every rank computes identically;
`Plan.for_rank(r)` is rank r's part of it: what to send, receive, copy locally or zero.

How rows are laid out on a side:

- The *shard index* of a rank is its coordinates on the mesh dims placed `Shard(d)`,
  linearised in mesh-dim order (the first Shard dim is the most significant).
- `sample_sizes is None`: DTensor's `torch.chunk` convention, nested when several mesh
  dims shard the same tensor dim, so local sizes equal DTensor's local shapes.
- `sample_sizes` given: samples (not rows) are split over the shard index like
  ``torch.tensor_split(range(n_samples), n_shards)``; a shard holds its samples' rows.
  This is the data layer's rule (dp rank k of every module takes the same samples).
- `Replicate()` dims: every rank of the group holds the same rows. `Partial()` dims:
  every rank holds the same rows as a partial sum; the value is the sum over the dim.

Backward uses the same planner with the specs built by `backward_specs`.
"""

from __future__ import annotations

import functools
import heapq
import operator
from dataclasses import dataclass, field
from itertools import accumulate
from math import prod
from typing import Any, NamedTuple, Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "Copy",
    "MeshSpec",
    "Plan",
    "PlanError",
    "RankPlan",
    "Recv",
    "Send",
    "backward_specs",
    "plan",
    "plan_backward",
]


class PlanError(ValueError):
    """Bridge metadata that no plan can serve (raised before any communication)."""


# --------------------------------------------------------------------------- specs


def _as_int(x: Any) -> int | None:
    """`x` as a Python int (numpy and torch integers included), None if it is not one."""
    if isinstance(x, bool):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def _nested(mesh: Any, where: str) -> Any:
    if isinstance(mesh, (list, tuple)):
        return tuple(_nested(m, where) for m in mesh)
    rank = _as_int(mesh)
    if rank is None:
        raise PlanError(f"{where}: mesh entries must be integer ranks, got {mesh!r}")
    return rank


def _shape_and_flat(mesh: tuple, where: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shape: list[int] = []
    probe: Any = mesh
    while isinstance(probe, tuple):
        shape.append(len(probe))
        if not probe:
            break
        probe = probe[0]
    if not shape or 0 in shape:
        raise PlanError(f"{where}: the mesh must be a non-empty array of ranks with ndim >= 1, got {mesh!r}")
    flat: list[int] = []

    def walk(node: Any, depth: int) -> None:
        if depth == len(shape):
            if isinstance(node, tuple):
                raise PlanError(f"{where}: the mesh is not rectangular (expected shape {tuple(shape)})")
            flat.append(node)
            return
        if not isinstance(node, tuple) or len(node) != shape[depth]:
            raise PlanError(f"{where}: the mesh is not rectangular (expected shape {tuple(shape)})")
        for child in node:
            walk(child, depth + 1)

    walk(mesh, 0)
    return tuple(shape), tuple(flat)


def _ranks_summary(flat: Sequence[int]) -> str:
    if len(flat) <= 8:
        return str(list(flat))
    lo, hi = min(flat), max(flat)
    if len(flat) == hi - lo + 1:
        return f"[{lo}..{hi}]"
    return f"[{', '.join(map(str, flat[:4]))}, ... {len(flat)} ranks]"


def _placements_str(placements: Sequence[Any]) -> str:
    return "(" + ", ".join(repr(p) for p in placements) + ")"


@dataclass(frozen=True, eq=True, repr=False)
class MeshSpec:
    """One side of a redistribution: who holds which rows of the bridged tensor dim.

    Args:
        mesh: global ranks laid out as the mesh (nested lists/tuples, or anything with
            ``.tolist()`` such as ``DeviceMesh.mesh``); shape = mesh shape.
        placements: one DTensor placement per mesh dim: ``Shard(d)`` (all on the same
            tensor dim ``d``), ``Replicate()`` or ``Partial()`` (sum).
        extent: global number of rows along the bridged dim; may be omitted when
            ``sample_sizes`` is given (it is then their sum).
        sample_sizes: rows of each sample (zeros allowed; a sample's rows are contiguous),
            or None for DTensor's chunk rule.
        name: a label for error messages (module name); not part of equality.
    """

    mesh: Any
    placements: tuple[Placement, ...]
    extent: int | None = None
    sample_sizes: tuple[int, ...] | None = None
    name: str = field(default="", compare=False)
    _shape: tuple[int, ...] = field(init=False, compare=False)
    _flat: tuple[int, ...] = field(init=False, compare=False)
    _hash: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        where = self.label
        mesh = self.mesh
        if hasattr(mesh, "tolist") and not isinstance(mesh, (list, tuple)):
            mesh = mesh.tolist()
        mesh = _nested(mesh, where)
        shape, flat = _shape_and_flat(mesh, where)
        where = f"{where} (shape {shape}, ranks {_ranks_summary(flat)})"
        bad = [r for r in flat if r < 0]
        if bad:
            raise PlanError(f"{where}: negative rank(s) {bad[:8]}")
        if len(set(flat)) != len(flat):
            seen: set[int] = set()
            dup = sorted({r for r in flat if r in seen or seen.add(r)})  # type: ignore[func-returns-value]
            raise PlanError(f"{where}: rank(s) {dup[:8]} appear more than once in the mesh")

        placements = tuple(self.placements)
        if len(placements) != len(shape):
            raise PlanError(
                f"{where}: {len(placements)} placement(s) {_placements_str(placements)} for a "
                f"{len(shape)}-d mesh; give exactly one placement per mesh dim"
            )
        for p in placements:
            ok = type(p) in (Shard, Replicate) or (type(p) is Partial and p.reduce_op == "sum")
            if not ok:
                raise PlanError(
                    f"{where}: placements {_placements_str(placements)} contain {p!r}, a placement "
                    "the plan cannot serve; use Shard(d), Replicate() or Partial() (sum)"
                )
        dims = sorted({p.dim for p in placements if type(p) is Shard})
        if len(dims) > 1:
            raise PlanError(
                f"{where}: placements {_placements_str(placements)} shard tensor dims {dims}, a placement "
                "the plan cannot serve; the bridge moves rows of one tensor dim, so every Shard must "
                "name the same dim"
            )

        extent = self.extent
        if extent is not None and (_as_int(extent) is None or extent < 0):
            raise PlanError(f"{where}: the global extent must be an integer >= 0, got {extent!r}")
        sizes = None
        if self.sample_sizes is not None:
            sizes = tuple(_as_int(s) for s in self.sample_sizes)
            for i, (s, raw) in enumerate(zip(sizes, self.sample_sizes)):
                if s is None:
                    raise PlanError(f"{where}: sample_sizes[{i}] = {raw!r} is not an integer")
                if s < 0:
                    raise PlanError(f"{where}: sample_sizes[{i}] = {s} is negative; a sample has >= 0 rows")
            total = sum(sizes)
            if extent is None:
                extent = total
            elif total != extent:
                raise PlanError(
                    f"{where}: sample_sizes sum to {total} ({len(sizes)} samples) but the global extent is "
                    f"{extent}; the per-sample sizes must add up to the rows of the bridged dim"
                )
        if extent is None:
            raise PlanError(f"{where}: give the global extent or the sample_sizes")
        extent = _as_int(extent)

        set_ = object.__setattr__
        set_(self, "mesh", mesh)
        set_(self, "placements", placements)
        set_(self, "extent", extent)
        set_(self, "sample_sizes", sizes)
        set_(self, "_shape", shape)
        set_(self, "_flat", flat)
        # Hash once: meshes of thousands of ranks are hashed on every plan-cache lookup.
        set_(self, "_hash", hash((mesh, placements, extent, sizes)))

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        sizes = "" if self.sample_sizes is None else f", {len(self.sample_sizes)} samples"
        name = f"{self.name!r}, " if self.name else ""
        return (
            f"MeshSpec({name}shape={self._shape}, ranks={_ranks_summary(self._flat)}, "
            f"placements={_placements_str(self.placements)}, extent={self.extent}{sizes})"
        )

    @classmethod
    def from_device_mesh(
        cls,
        device_mesh: Any,
        placements: Sequence[Placement],
        extent: int | None = None,
        sample_sizes: Sequence[int] | None = None,
        name: str = "",
    ) -> "MeshSpec":
        """Describe a side from a `DeviceMesh` (reads only ``device_mesh.mesh``; no communication)."""
        return cls(device_mesh.mesh.tolist(), tuple(placements), extent,
                   None if sample_sizes is None else tuple(sample_sizes), name)

    @property
    def label(self) -> str:
        return f"mesh {self.name!r}" if self.name else "mesh"

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape."""
        return self._shape

    @property
    def ranks(self) -> tuple[int, ...]:
        """Global ranks of the mesh, row-major."""
        return self._flat

    @property
    def shard_dim(self) -> int | None:
        """The tensor dim every `Shard` placement names, or None when nothing is sharded."""
        for p in self.placements:
            if type(p) is Shard:
                return p.dim
        return None

    def local_range(self, rank: int) -> tuple[int, int]:
        """Global rows ``[lo, hi)`` that `rank` holds; ``(0, 0)`` for a rank outside the mesh."""
        lay = _layout(self)
        i = lay.index.get(rank)
        if i is None:
            return (0, 0)
        s = lay.shard[i]
        return (lay.lo[s], lay.hi[s])


# ------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class _Layout:
    """A spec resolved to flat arrays (index = position in the row-major mesh)."""

    ranks: tuple[int, ...]
    shard: list[int]  # shard index per position
    part: list[int]  # linearised coordinate on the Partial dims per position
    n_parts: int
    lo: list[int]  # global rows [lo, hi) per shard index
    hi: list[int]
    groups: list[list[int]]  # group id (shard * n_parts + part) -> ranks, mesh order
    index: dict[int, int]  # rank -> position


def _chunk_bounds(extent: int, splits: Sequence[int]) -> tuple[list[int], list[int]]:
    # torch.chunk nested over the Shard mesh dims, as DTensor does (an empty chunk sits at
    # offset `extent`, like DTensor's global offset of an empty shard).
    lo, hi = [0], [extent]
    for m in splits:
        nlo: list[int] = []
        nhi: list[int] = []
        for a, b in zip(lo, hi):
            n = b - a
            c = -(-n // m)
            for k in range(m):
                s, e = min(c * k, n), min(c * (k + 1), n)
                if s < e:
                    nlo.append(a + s)
                    nhi.append(a + e)
                else:
                    nlo.append(extent)
                    nhi.append(extent)
        lo, hi = nlo, nhi
    return lo, hi


def _sample_bounds(sizes: Sequence[int], n_shards: int) -> tuple[list[int], list[int]]:
    starts = [0, *accumulate(sizes)]
    q, rem = divmod(len(sizes), n_shards)
    lo, hi = [], []
    for k in range(n_shards):
        first = k * q + min(k, rem)
        last = first + q + (1 if k < rem else 0)
        lo.append(starts[first])
        hi.append(starts[last])
    return lo, hi


@functools.lru_cache(maxsize=64)
def _layout(spec: MeshSpec) -> _Layout:
    shape, flat = spec.shape, spec.ranks
    n = len(flat)
    shard = [0] * n
    part = [0] * n
    positions = range(n)
    stride = n
    splits: list[int] = []
    n_parts = 1
    for size, p in zip(shape, spec.placements):
        stride //= size
        if type(p) is Shard:
            shard = [s * size + (i // stride) % size for s, i in zip(shard, positions)]
            splits.append(size)
        elif type(p) is Partial:
            part = [s * size + (i // stride) % size for s, i in zip(part, positions)]
            n_parts *= size
    n_shards = prod(splits)
    if spec.sample_sizes is None:
        lo, hi = _chunk_bounds(spec.extent, splits)
    else:
        lo, hi = _sample_bounds(spec.sample_sizes, n_shards)
    groups: list[list[int]] = [[] for _ in range(n_shards * n_parts)]
    for r, s, q in zip(flat, shard, part):
        groups[s * n_parts + q].append(r)
    return _Layout(flat, shard, part, n_parts, lo, hi, groups, {r: i for i, r in enumerate(flat)})


# --------------------------------------------------------------------------- plan


class Send(NamedTuple):
    """Send rows ``[lo, hi)`` of this rank's local source tensor to `peer`."""

    peer: int
    lo: int
    hi: int


class Recv(NamedTuple):
    """Fill (or, when reducing, add into) rows ``[lo, hi)`` of the local output from `peer`."""

    peer: int
    lo: int
    hi: int


class Copy(NamedTuple):
    """Local source rows ``[src_lo, src_hi)`` go to local output rows ``[dst_lo, dst_hi)``."""

    src_lo: int
    src_hi: int
    dst_lo: int
    dst_hi: int


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of a `Plan`.

    Attributes:
        rank: the global rank.
        src_rows / dst_rows: local rows along the bridged dim of its source tensor / its
            output (0 outside the mesh).
        src_offset / dst_offset: global row of local row 0 on either side (DTensor's global
            offset; 0 outside the mesh).
        sends: to each peer at most one message, sorted by peer.
        recvs: from each peer at most one message, sorted by peer.
        copies: colocated pieces (this rank on both sides), in output-row order.
        reduce: received pieces are summed (the source has Partial contributors), not
            written once. The output starts at zero; add copies first, then recvs in list
            order (ascending peer), so the sum is the same on every run.
        zero_fill: output row ranges that receive nothing and must be zeros (a destination
            `Partial` group delivers the value to its coordinate-0 member only).
    """

    rank: int
    src_rows: int
    dst_rows: int
    src_offset: int
    dst_offset: int
    sends: tuple[Send, ...]
    recvs: tuple[Recv, ...]
    copies: tuple[Copy, ...]
    reduce: bool
    zero_fill: tuple[tuple[int, int], ...]


def _csr(owner: Sequence[int], world: int) -> list[int]:
    counts = [0] * (world + 1)
    for r in owner:
        counts[r + 1] += 1
    return list(accumulate(counts))


class Plan:
    """A redistribution from `src` to `dst`, for every rank of the world.

    Identical on every rank. Rows are assigned so that each destination rank that needs a
    row gets it once (once per Partial contributor when the source is Partial); among
    source replicas of a row, a destination that is itself a replica copies locally, the
    others are served greedily by the least-loaded replica (rows sent so far, ties to the
    first in mesh order). Stored as flat arrays; `for_rank` builds one rank's view.
    """

    def __init__(self, src: MeshSpec, dst: MeshSpec, world_size: int) -> None:
        self.src = src
        self.dst = dst
        self.world_size = world_size
        S, D = _layout(src), _layout(dst)
        W = world_size
        self.reduce = S.n_parts > 1
        """True when the source has several Partial contributors and receivers sum."""

        src_rows = [0] * W
        src_off = [0] * W
        gid_of = [-1] * W
        for r, s, q in zip(S.ranks, S.shard, S.part):
            src_rows[r] = S.hi[s] - S.lo[s]
            src_off[r] = S.lo[s]
            gid_of[r] = s * S.n_parts + q
        dst_rows = [0] * W
        dst_off = [0] * W
        needs = [False] * W
        for r, t, q in zip(D.ranks, D.shard, D.part):
            dst_rows[r] = D.hi[t] - D.lo[t]
            dst_off[r] = D.lo[t]
            needs[r] = q == 0

        # Sweep the two sides' (ordered, contiguous) non-empty shards together.
        ps: list[int] = []  # messages: source rank, destination rank, global rows [lo, hi)
        pd: list[int] = []
        plo: list[int] = []
        phi: list[int] = []
        cr: list[int] = []  # local copies: rank, global rows [lo, hi)
        clo: list[int] = []
        chi: list[int] = []
        heaps: dict[int, list[tuple[int, int]]] = {}  # replica group -> (rows sent, member)
        src_ne = [s for s in range(len(S.lo)) if S.hi[s] > S.lo[s]]
        dst_ne = [t for t in range(len(D.lo)) if D.hi[t] > D.lo[t]]
        P = S.n_parts
        i = j = 0
        while i < len(src_ne) and j < len(dst_ne):
            s, t = src_ne[i], dst_ne[j]
            lo, hi = max(S.lo[s], D.lo[t]), min(S.hi[s], D.hi[t])
            if lo < hi:
                receivers = D.groups[t * D.n_parts]  # Partial coordinate 0 receives the value
                for gid in range(s * P, s * P + P):  # one piece from each Partial contributor
                    replicas = S.groups[gid]
                    heap = heaps.get(gid)
                    if heap is None:
                        heap = heaps[gid] = [(0, k) for k in range(len(replicas))]
                    for d in receivers:
                        if gid_of[d] == gid:  # the receiver holds these rows itself
                            cr.append(d)
                            clo.append(lo)
                            chi.append(hi)
                        else:
                            load, k = heap[0]
                            heapq.heapreplace(heap, (load + hi - lo, k))
                            ps.append(replicas[k])
                            pd.append(d)
                            plo.append(lo)
                            phi.append(hi)
            a_hi, b_hi = S.hi[s], D.hi[t]
            if a_hi <= b_hi:
                i += 1
            if b_hi <= a_hi:
                j += 1

        # Shards are contiguous, so a (source, destination) pair meets in one interval: at
        # most one message per ordered pair, no merging needed.
        n = len(ps)
        order = sorted(range(n), key=[a * W + d for a, d in zip(ps, pd)].__getitem__)
        self._send_start = _csr([ps[k] for k in order], W)
        self._send_peer = [pd[k] for k in order]
        self._send_lo = [plo[k] - src_off[ps[k]] for k in order]
        self._send_hi = [phi[k] - src_off[ps[k]] for k in order]
        order = sorted(range(n), key=[d * W + a for a, d in zip(ps, pd)].__getitem__)
        self._recv_start = _csr([pd[k] for k in order], W)
        self._recv_peer = [ps[k] for k in order]
        self._recv_lo = [plo[k] - dst_off[pd[k]] for k in order]
        self._recv_hi = [phi[k] - dst_off[pd[k]] for k in order]
        order = sorted(range(len(cr)), key=cr.__getitem__)  # stable: row order within a rank
        self._copy_start = _csr([cr[k] for k in order], W)
        self._copy = [
            Copy(clo[k] - src_off[cr[k]], chi[k] - src_off[cr[k]], clo[k] - dst_off[cr[k]], chi[k] - dst_off[cr[k]])
            for k in order
        ]
        self._src_rows, self._src_off = src_rows, src_off
        self._dst_rows, self._dst_off = dst_rows, dst_off
        self._needs = needs
        self._views: dict[int, RankPlan] = {}
        self.num_messages = n
        """Point-to-point messages in the whole plan."""
        self.num_copies = len(cr)
        """Local (same-rank) copies in the whole plan."""

    def for_rank(self, rank: int) -> RankPlan:
        """The sends, receives, copies and sizes of one rank (any rank of the world)."""
        view = self._views.get(rank)
        if view is not None:
            return view
        if not 0 <= rank < self.world_size:
            raise PlanError(f"rank {rank} is outside the world of {self.world_size} ranks")
        a, b = self._send_start[rank], self._send_start[rank + 1]
        sends = tuple(map(Send, self._send_peer[a:b], self._send_lo[a:b], self._send_hi[a:b]))
        a, b = self._recv_start[rank], self._recv_start[rank + 1]
        recvs = tuple(map(Recv, self._recv_peer[a:b], self._recv_lo[a:b], self._recv_hi[a:b]))
        a, b = self._copy_start[rank], self._copy_start[rank + 1]
        copies = tuple(self._copy[a:b])
        rows = self._dst_rows[rank]
        needs = self._needs[rank]
        view = RankPlan(
            rank=rank,
            src_rows=self._src_rows[rank],
            dst_rows=rows,
            src_offset=self._src_off[rank],
            dst_offset=self._dst_off[rank],
            sends=sends,
            recvs=recvs,
            copies=copies,
            reduce=self.reduce and needs,
            zero_fill=((0, rows),) if rows and not needs else (),
        )
        self._views[rank] = view
        return view

    def stats(self) -> dict[str, int]:
        """Totals for benchmarks and logs: messages, copies, rows moved, busiest rank."""
        sent = [b - a for a, b in zip(self._send_lo, self._send_hi)]
        per_rank = [0] * self.world_size
        starts = self._send_start
        for r in range(self.world_size):
            per_rank[r] = sum(sent[starts[r]:starts[r + 1]])
        msgs = [starts[r + 1] - starts[r] for r in range(self.world_size)]
        return {
            "messages": self.num_messages,
            "copies": self.num_copies,
            "rows_sent": sum(sent),
            "rows_copied": sum(c.src_hi - c.src_lo for c in self._copy),
            "max_rows_sent_by_a_rank": max(per_rank, default=0),
            "max_messages_sent_by_a_rank": max(msgs, default=0),
        }

    def __repr__(self) -> str:
        return f"Plan({self.src!r} -> {self.dst!r}, world_size={self.world_size}, messages={self.num_messages}, copies={self.num_copies})"


def _check_pair(src: MeshSpec, dst: MeshSpec, world_size: int | None) -> int:
    def side(role: str, spec: MeshSpec) -> str:
        return f"{role} {spec.label} {_placements_str(spec.placements)}"

    if src.extent != dst.extent:
        raise PlanError(
            f"{side('source', src)} has {src.extent} rows along the bridged dim but "
            f"{side('destination', dst)} has {dst.extent}; both sides describe the same global tensor"
        )
    if src.sample_sizes is not None and dst.sample_sizes is not None and src.sample_sizes != dst.sample_sizes:
        k = next((i for i, (a, b) in enumerate(zip(src.sample_sizes, dst.sample_sizes)) if a != b),
                 min(len(src.sample_sizes), len(dst.sample_sizes)))
        raise PlanError(
            f"{side('source', src)} and {side('destination', dst)} disagree on the samples: "
            f"{len(src.sample_sizes)} vs {len(dst.sample_sizes)} samples, first difference at sample {k}"
        )
    a, b = src.shard_dim, dst.shard_dim
    if a is not None and b is not None and a != b:
        raise PlanError(
            f"{side('source', src)} shards tensor dim {a} but {side('destination', dst)} shards dim {b}: "
            "a placement the plan cannot serve (the bridge moves rows of one tensor dim)"
        )
    top = max(max(src.ranks), max(dst.ranks))
    if world_size is None:
        return top + 1
    if _as_int(world_size) is None or world_size < 1:
        raise PlanError(f"world_size must be an integer >= 1, got {world_size!r}")
    world_size = _as_int(world_size)
    for role, spec in (("source", src), ("destination", dst)):
        out = [r for r in spec.ranks if r >= world_size]
        if out:
            raise PlanError(
                f"{role} {spec.label} of shape {spec.shape} holds rank(s) {out[:8]} outside the world "
                f"of {world_size} ranks (0..{world_size - 1})"
            )
    return world_size


def plan(src: MeshSpec, dst: MeshSpec, world_size: int | None = None) -> Plan:
    """Plan moving the tensor laid out as `src` to the layout `dst` (cached per arguments).

    `world_size` defaults to one more than the largest rank of either mesh; ranks of the
    world in neither mesh get an empty `RankPlan`. Raises `PlanError` on inconsistent specs.
    """
    return _plan(src, dst, _check_pair(src, dst, world_size))


@functools.lru_cache(maxsize=32)
def _plan(src: MeshSpec, dst: MeshSpec, world_size: int) -> Plan:
    return Plan(src, dst, world_size)


def _clear_caches() -> None:
    _plan.cache_clear()
    _layout.cache_clear()
    _cached_backward_specs.cache_clear()


plan.cache_clear = _clear_caches  # type: ignore[attr-defined]  # lru_cache's spelling, for benchmarks


def backward_specs(src: MeshSpec, dst: MeshSpec, grad_placements: Sequence[Placement]) -> tuple[MeshSpec, MeshSpec]:
    """The (source, destination) specs of the gradient's trip back from `dst` to `src`.

    The gradient starts on the destination mesh with `grad_placements` (a `Replicate` dim
    is taken once from one replica, a `Partial` dim is summed over all its members, as in
    DTensor) and ends on the source mesh where every rank holding a source row receives its
    gradient: `src`'s placements with `Partial` turned into `Replicate`.
    """
    grad_src = MeshSpec(dst.mesh, tuple(grad_placements), dst.extent, dst.sample_sizes,
                        name=f"{dst.name or 'destination'} (gradient)")
    grad_dst = MeshSpec(src.mesh, tuple(Replicate() if type(p) is Partial else p for p in src.placements),
                        src.extent, src.sample_sizes, name=f"{src.name or 'source'} (gradient)")
    return grad_src, grad_dst


_cached_backward_specs = functools.lru_cache(maxsize=32)(backward_specs)


def plan_backward(
    src: MeshSpec, dst: MeshSpec, grad_placements: Sequence[Placement], world_size: int | None = None
) -> Plan:
    """`plan` of the gradient of a `src` -> `dst` redistribution (see `backward_specs`; cached)."""
    return plan(*_cached_backward_specs(src, dst, tuple(grad_placements)), world_size)
