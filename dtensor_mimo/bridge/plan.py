"""The bridge's planner: which rows of a tensor move from which rank to which rank.

Pure index arithmetic over integers: no process group, no tensor. Both sides of a
cross-mesh redistribution are described by a `MeshSpec` (the mesh as nested global ranks,
one DTensor placement per mesh dim, the global extent along the bridged tensor dim and,
for ragged data, the rows of every sample). `plan_for_rank(src, dst, r)` is rank r's part of
the redistribution: what to send, receive, copy locally or zero, computed from r's peers
alone (O(peers), not O(world)); `plan(src, dst)` is the whole world's (O(world): tests,
statistics). Both follow the same rules, so every rank's part agrees with its peers'.

How rows are laid out on a side:

- The *shard index* of a rank is its coordinates on the mesh dims placed `Shard(d)`,
  linearised in mesh-dim order (the first Shard dim is the most significant).
- `sample_sizes is None`: DTensor's `torch.chunk` convention, nested when several mesh
  dims shard the same tensor dim, so local sizes equal DTensor's local shapes.
- `sample_sizes` given: samples (not rows) are split over the shard index like
  ``torch.tensor_split(range(n_samples), n_shards)``; a shard holds its samples' rows.
  This is the data layer's rule (dp rank k of every module takes the same samples).
- `shard_bounds` given: shard k holds rows ``[bounds[k], bounds[k+1])``, any ragged split (an
  encoder's items balanced over its dp ranks by cost, `dtensor_mimo.data.balance`).
- `Replicate()` dims: every rank of the group holds the same rows. `Partial()` dims:
  every rank holds the same rows as a partial sum; the value is the sum over the dim.
- `split_dims`: those Replicate/Partial dims instead chunk their shard's rows further
  (``torch.chunk``, nested in mesh order): the two-hop bridge's intermediate layout.

Backward uses the same planner with the specs built by `backward_specs`.
"""

from __future__ import annotations

import functools
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
    "plan_backward_for_rank",
    "plan_for_rank",
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


@dataclass(frozen=True)
class _Mesh:
    """A validated mesh: checked once (O(ranks)), then shared by every spec derived from it."""

    nested: tuple
    shape: tuple[int, ...]
    flat: tuple[int, ...]
    top: int
    hash: int

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, _Mesh) and self.hash == other.hash and self.nested == other.nested)


def _validate_mesh(mesh: Any, where: str) -> _Mesh:
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
    # Hash once: meshes of thousands of ranks are hashed on every plan-cache lookup.
    return _Mesh(mesh, shape, flat, max(flat), hash(mesh))


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
        split_dims: mesh dims (placed `Replicate` or `Partial`) whose ranks each hold one
            ``torch.chunk`` piece of their shard's rows instead of all of them, nested in
            mesh-dim order after the Shard dims' rule: the two-hop bridge's intermediate layout
            (a `Partial` dim split this way holds reduce-scattered sums). Default: none.
        shard_bounds: the first row of each shard index of the Shard dims, then the extent
            (``n_shards + 1`` nondecreasing rows from 0): an explicit ragged split that replaces
            the chunk and sample rules. None (default): those rules.

    Validating a mesh costs O(ranks); `replace` derives specs (new sample sizes every step,
    other placements) from a validated one at O(samples), as the bridge does on its hot path.
    """

    mesh: Any
    placements: tuple[Placement, ...]
    extent: int | None = None
    sample_sizes: tuple[int, ...] | None = None
    name: str = field(default="", compare=False)
    split_dims: tuple[int, ...] = ()
    shard_bounds: tuple[int, ...] | None = None
    _mesh: _Mesh = field(init=False, compare=False)
    _hash: int = field(init=False, compare=False)
    _sizes_hash: int = field(init=False, compare=False)
    _starts: list[int] | None = field(init=False, compare=False)

    def __post_init__(self) -> None:
        self._finish(_validate_mesh(self.mesh, self.label))

    def _finish(self, mesh: _Mesh, sizes_from: "MeshSpec | None" = None) -> None:
        """Check everything but the mesh and set the derived fields: O(samples), or O(mesh ndim)
        when `sizes_from` already checked these same sizes."""
        def where() -> str:  # built only for an error: summarising the ranks is O(ranks)
            return f"{self.label} (shape {mesh.shape}, ranks {_ranks_summary(mesh.flat)})"

        placements = tuple(self.placements)
        if len(placements) != len(mesh.shape):
            raise PlanError(
                f"{where()}: {len(placements)} placement(s) {_placements_str(placements)} for a "
                f"{len(mesh.shape)}-d mesh; give exactly one placement per mesh dim"
            )
        for p in placements:
            ok = type(p) in (Shard, Replicate) or (type(p) is Partial and p.reduce_op == "sum")
            if not ok:
                raise PlanError(
                    f"{where()}: placements {_placements_str(placements)} contain {p!r}, a placement "
                    "the plan cannot serve; use Shard(d), Replicate() or Partial() (sum)"
                )
        dims = sorted({p.dim for p in placements if type(p) is Shard})
        if len(dims) > 1:
            raise PlanError(
                f"{where()}: placements {_placements_str(placements)} shard tensor dims {dims}, a placement "
                "the plan cannot serve; the bridge moves rows of one tensor dim, so every Shard must "
                "name the same dim"
            )
        split = tuple(sorted(set(self.split_dims)))
        bad_split = [d for d in split if not (0 <= d < len(placements)) or type(placements[d]) is Shard]
        if bad_split:
            raise PlanError(f"{where()}: split_dims {self.split_dims} name {bad_split}, which are not "
                            "Replicate or Partial mesh dims")

        if sizes_from is not None:
            extent, sizes, starts, sizes_hash = (sizes_from.extent, sizes_from.sample_sizes, sizes_from._starts,
                                                 sizes_from._sizes_hash)
        else:
            extent, sizes, starts = self._check_sizes(where)
            sizes_hash = hash((extent, sizes))
        bounds = self.shard_bounds
        if bounds is not None:
            bounds = tuple(map(operator.index, bounds))
            n_outer = prod(_resolve(mesh, placements, split).outer)
            if (len(bounds) != n_outer + 1 or bounds[0] != 0 or bounds[-1] != extent
                    or any(a > b for a, b in zip(bounds, bounds[1:]))):
                raise PlanError(f"{where()}: shard_bounds {list(bounds[:9])} must be {n_outer + 1} nondecreasing "
                                f"rows from 0 to the extent {extent} (one start per shard, then the end)")
        set_ = object.__setattr__
        set_(self, "shard_bounds", bounds)
        set_(self, "mesh", mesh.nested)
        set_(self, "placements", placements)
        set_(self, "extent", extent)
        set_(self, "sample_sizes", sizes)
        set_(self, "split_dims", split)
        set_(self, "_mesh", mesh)
        set_(self, "_starts", starts)
        set_(self, "_sizes_hash", sizes_hash)
        set_(self, "_hash", hash((mesh.hash, placements, sizes_hash, split, bounds)))

    def _check_sizes(self, where) -> tuple[int, tuple[int, ...] | None, list[int] | None]:
        extent = self.extent
        if extent is not None and (_as_int(extent) is None or extent < 0):
            raise PlanError(f"{where()}: the global extent must be an integer >= 0, got {extent!r}")
        if self.sample_sizes is None:
            if extent is None:
                raise PlanError(f"{where()}: give the global extent or the sample_sizes")
            return _as_int(extent), None, None
        try:  # C speed for the common case: integers (numpy's and torch's too), none negative
            sizes = tuple(map(operator.index, self.sample_sizes))
        except TypeError:
            sizes = None
        if sizes is None or (sizes and min(sizes) < 0):
            for i, raw in enumerate(self.sample_sizes):
                s = _as_int(raw)
                if s is None:
                    raise PlanError(f"{where()}: sample_sizes[{i}] = {raw!r} is not an integer")
                if s < 0:
                    raise PlanError(f"{where()}: sample_sizes[{i}] = {s} is negative; a sample has >= 0 rows")
        starts = [0, *accumulate(sizes)]
        if extent is not None and starts[-1] != extent:
            raise PlanError(
                f"{where()}: sample_sizes sum to {starts[-1]} ({len(sizes)} samples) but the global extent is "
                f"{extent}; the per-sample sizes must add up to the rows of the bridged dim"
            )
        return starts[-1], sizes, starts

    def replace(self, **changes: Any) -> "MeshSpec":
        """This spec with some of `placements`, `extent`, `sample_sizes`, `name`, `split_dims`,
        `shard_bounds` changed, without validating the mesh again (O(samples) for new sizes, O(mesh
        ndim) otherwise; not O(ranks)). New `sample_sizes` alone drop the old extent (they define
        it); new sizes drop the old `shard_bounds` unless given."""
        fields = ("placements", "extent", "sample_sizes", "name", "split_dims", "shard_bounds")
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"MeshSpec.replace: unknown field(s) {sorted(unknown)}")
        same_sizes = "sample_sizes" not in changes and "extent" not in changes
        if "sample_sizes" in changes and "extent" not in changes:
            changes["extent"] = None
        if not same_sizes and "shard_bounds" not in changes:
            changes["shard_bounds"] = None
        spec = object.__new__(MeshSpec)
        for f in fields:
            object.__setattr__(spec, f, changes.get(f, getattr(self, f)))
        spec._finish(self._mesh, self if same_sizes else None)
        return spec

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        sizes = "" if self.sample_sizes is None else f", {len(self.sample_sizes)} samples"
        name = f"{self.name!r}, " if self.name else ""
        split = f", split_dims={self.split_dims}" if self.split_dims else ""
        bounds = "" if self.shard_bounds is None else f", shard_bounds={list(self.shard_bounds[:9])}"
        return (
            f"MeshSpec({name}shape={self.shape}, ranks={_ranks_summary(self.ranks)}, "
            f"placements={_placements_str(self.placements)}, extent={self.extent}{sizes}{split}{bounds})"
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
        return self._mesh.shape

    @property
    def ranks(self) -> tuple[int, ...]:
        """Global ranks of the mesh, row-major."""
        return self._mesh.flat

    @property
    def shard_dim(self) -> int | None:
        """The tensor dim every `Shard` placement names, or None when nothing is sharded."""
        for p in self.placements:
            if type(p) is Shard:
                return p.dim
        return None

    def is_member(self, rank: int) -> bool:
        """Whether `rank` is on this side's mesh (O(1))."""
        return rank in _static(self).index

    def local_range(self, rank: int) -> tuple[int, int]:
        """Global rows ``[lo, hi)`` that `rank` holds; ``(0, 0)`` for a rank outside the mesh."""
        i = _static(self).index.get(rank)
        if i is None:
            return (0, 0)
        lo, hi = _bounds(self, _static(self).shard[i])
        return (_offset(self, lo, hi), _offset(self, lo, hi) + hi - lo)


# ------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class _Static:
    """A mesh and placements resolved to flat per-position arrays (position = row-major index)."""

    index: dict[int, int]  # rank -> position
    shard: list[int]  # shard index per position: outer (Shard dims) * n_inner + inner (split dims)
    part: list[int]  # linearised coordinate on the (unsplit) Partial dims per position
    member: list[int]  # position of the rank within its group, mesh order
    groups: list[list[int]]  # group id (shard * n_parts + part) -> ranks holding the same data
    outer: tuple[int, ...]  # sizes of the Shard dims, mesh order
    inner: tuple[int, ...]  # sizes of the split dims, mesh order
    n_parts: int

    @property
    def n_inner(self) -> int:
        return prod(self.inner)

    @property
    def n_shards(self) -> int:
        return prod(self.outer) * prod(self.inner)

    def group(self, rank: int) -> int:
        """Group id of `rank`, -1 off the mesh."""
        i = self.index.get(rank)
        return -1 if i is None else self.shard[i] * self.n_parts + self.part[i]


@functools.lru_cache(maxsize=64)
def _resolve(mesh: _Mesh, placements: tuple[Placement, ...], split: tuple[int, ...]) -> _Static:
    n = len(mesh.flat)
    outer, inner, part = [0] * n, [0] * n, [0] * n
    positions = range(n)
    stride = n
    outer_sizes, inner_sizes, n_parts = [], [], 1
    for d, (size, p) in enumerate(zip(mesh.shape, placements)):
        stride //= size
        coord = [(i // stride) % size for i in positions]
        if d in split:
            inner = [s * size + c for s, c in zip(inner, coord)]
            inner_sizes.append(size)
        elif type(p) is Shard:
            outer = [s * size + c for s, c in zip(outer, coord)]
            outer_sizes.append(size)
        elif type(p) is Partial:
            part = [s * size + c for s, c in zip(part, coord)]
            n_parts *= size
    n_inner = prod(inner_sizes)
    shard = [o * n_inner + i for o, i in zip(outer, inner)]
    groups: list[list[int]] = [[] for _ in range(prod(outer_sizes) * n_inner * n_parts)]
    member = [0] * n
    for i, (r, s, q) in enumerate(zip(mesh.flat, shard, part)):
        g = groups[s * n_parts + q]
        member[i] = len(g)
        g.append(r)
    return _Static({r: i for i, r in enumerate(mesh.flat)}, shard, part, member, groups,
                   tuple(outer_sizes), tuple(inner_sizes), n_parts)


def _static(spec: MeshSpec) -> _Static:
    return _resolve(spec._mesh, spec.placements, spec.split_dims)


def _chunk(lo: int, hi: int, splits: Sequence[int], index: int) -> tuple[int, int]:
    """Rows of chunk `index` (linearised over `splits`, first most significant) of ``[lo, hi)``
    under ``torch.chunk`` nested over `splits`. An empty chunk sits at its boundary, so bounds
    are nondecreasing in `index`."""
    digits = []
    for m in reversed(splits):
        index, d = divmod(index, m)
        digits.append(d)
    for m, d in zip(splits, reversed(digits)):
        n = hi - lo
        c = -(-n // m)
        lo, hi = lo + min(c * d, n), lo + min(c * (d + 1), n)
    return lo, hi


def _bounds(spec: MeshSpec, shard: int) -> tuple[int, int]:
    """Global rows ``[lo, hi)`` of a shard index, O(mesh ndim); nondecreasing in `shard`."""
    st = _static(spec)
    outer, inner = divmod(shard, st.n_inner)
    if spec.shard_bounds is not None:
        lo, hi = spec.shard_bounds[outer], spec.shard_bounds[outer + 1]
    elif spec._starts is None:
        lo, hi = _chunk(0, spec.extent, st.outer, outer)
    else:  # samples split like torch.tensor_split(range(n_samples), n_outer)
        q, rem = divmod(len(spec._starts) - 1, prod(st.outer))
        first = outer * q + min(outer, rem)
        lo, hi = spec._starts[first], spec._starts[first + q + (outer < rem)]
    return _chunk(lo, hi, st.inner, inner)


def _offset(spec: MeshSpec, lo: int, hi: int) -> int:
    """DTensor's global offset of a shard: an empty chunk-rule shard sits at the extent."""
    return spec.extent if lo == hi and spec.sample_sizes is None and spec.shard_bounds is None else lo


def _overlaps(spec: MeshSpec, lo: int, hi: int):
    """``(shard, lo', hi')`` for every shard of `spec` meeting rows ``[lo, hi)``, in order:
    a binary search, then only the shards met (O(log shards + met))."""
    if lo >= hi:
        return
    n = _static(spec).n_shards
    a, b = 0, n
    while a < b:  # first shard ending after `lo`
        mid = (a + b) // 2
        if _bounds(spec, mid)[1] > lo:
            b = mid
        else:
            a = mid + 1
    for k in range(a, n):
        s_lo, s_hi = _bounds(spec, k)
        if s_lo >= hi:
            return
        if s_lo < s_hi:
            yield k, max(s_lo, lo), min(s_hi, hi)


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
            written once. The output starts at zero; add the pieces in `sum_order`.
        zero_fill: output row ranges that receive nothing and must be zeros (a destination
            `Partial` group delivers the value to its coordinate-0 member only).
        sum_order: when reducing, the order to add the pieces in: index i < len(copies) is
            ``copies[i]``, the others ``recvs[i - len(copies)]``. Each row's contributions come in
            the source's Partial-coordinate order, whichever of them this rank copies or from
            which replica it receives them, so every replica of the destination holds the same
            bits, on every run. Empty when not reducing.
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
    sum_order: tuple[int, ...] = ()


def _csr(owner: Sequence[int], world: int) -> list[int]:
    counts = [0] * (world + 1)
    for r in owner:
        counts[r + 1] += 1
    return list(accumulate(counts))


def _first_replica(n_replicas: int, shard_lo: int, shard_hi: int, lo: int, hi: int) -> int:
    """Which of a source shard's `n_replicas` replicas serves receiver slot 0 of the piece
    ``[lo, hi)`` of its rows ``[shard_lo, shard_hi)``; slot j gets the next j-th, round-robin.

    Replica k serves the pieces centred in the k-th of `n_replicas` equal row ranges of the
    shard, so every replica sends about as many rows as the others, and a pure function of
    these numbers lets each rank compute its own messages without anyone else's.
    """
    return (lo + hi - 2 * shard_lo) * n_replicas // (2 * (shard_hi - shard_lo))


class Plan:
    """A redistribution from `src` to `dst`, for every rank of the world.

    Identical on every rank; O(world) to build (a sweep over both sides' shards). The bridge
    itself asks `plan_for_rank`, which computes one rank's part from the same rules in
    O(that rank's peers), and which this class checks in the tests. Each destination rank
    that needs a row gets it once (once per Partial contributor when the source is
    Partial); among source replicas of a row, a destination that is itself a replica copies
    locally, the others are dealt over the replicas by row position (`_first_replica`).
    """

    def __init__(self, src: MeshSpec, dst: MeshSpec, world_size: int) -> None:
        self.src = src
        self.dst = dst
        self.world_size = world_size
        S, D = _static(src), _static(dst)
        W = world_size
        self.reduce = S.n_parts > 1
        """True when the source has several Partial contributors and receivers sum."""
        src_bounds = [_bounds(src, k) for k in range(S.n_shards)]
        dst_bounds = [_bounds(dst, k) for k in range(D.n_shards)]

        src_rows, src_off, dst_rows, dst_off = [0] * W, [0] * W, [0] * W, [0] * W
        gid_of = [-1] * W
        for r, i in S.index.items():
            lo, hi = src_bounds[S.shard[i]]
            src_rows[r], src_off[r] = hi - lo, lo
            gid_of[r] = S.shard[i] * S.n_parts + S.part[i]
        needs = [False] * W
        for r, i in D.index.items():
            lo, hi = dst_bounds[D.shard[i]]
            dst_rows[r], dst_off[r] = hi - lo, lo
            needs[r] = D.part[i] == 0

        # Sweep the two sides' (ordered, contiguous) non-empty shards together.
        ps: list[int] = []  # messages: source rank, destination rank, global rows [lo, hi)
        pd: list[int] = []
        plo: list[int] = []
        phi: list[int] = []
        cr: list[int] = []  # local copies: rank, global rows [lo, hi)
        clo: list[int] = []
        chi: list[int] = []
        pseq: list[int] = []  # when each message / copy was made: a receiver's pieces in sum order
        cseq: list[int] = []
        src_ne = [s for s, (lo, hi) in enumerate(src_bounds) if hi > lo]
        dst_ne = [t for t, (lo, hi) in enumerate(dst_bounds) if hi > lo]
        P = S.n_parts
        i = j = 0
        while i < len(src_ne) and j < len(dst_ne):
            s, t = src_ne[i], dst_ne[j]
            (s_lo, s_hi), (t_lo, t_hi) = src_bounds[s], dst_bounds[t]
            lo, hi = max(s_lo, t_lo), min(s_hi, t_hi)
            if lo < hi:
                receivers = D.groups[t * D.n_parts]  # Partial coordinate 0 receives the value
                for gid in range(s * P, s * P + P):  # one piece from each Partial contributor
                    replicas = S.groups[gid]
                    first = _first_replica(len(replicas), s_lo, s_hi, lo, hi)
                    for slot, d in enumerate(receivers):
                        if gid_of[d] == gid:  # the receiver holds these rows itself
                            cr.append(d)
                            clo.append(lo)
                            chi.append(hi)
                            cseq.append(len(pseq) + len(cseq))
                        else:
                            ps.append(replicas[(first + slot) % len(replicas)])
                            pd.append(d)
                            plo.append(lo)
                            phi.append(hi)
                            pseq.append(len(pseq) + len(cseq))
            if s_hi <= t_hi:
                i += 1
            if t_hi <= s_hi:
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
        self._recv_seq = [pseq[k] for k in order]
        order = sorted(range(len(cr)), key=cr.__getitem__)  # stable: row order within a rank
        self._copy_start = _csr([cr[k] for k in order], W)
        self._copy = [
            Copy(clo[k] - src_off[cr[k]], chi[k] - src_off[cr[k]], clo[k] - dst_off[cr[k]], chi[k] - dst_off[cr[k]])
            for k in order
        ]
        self._copy_seq = [cseq[k] for k in order]
        self._src_rows, self._dst_rows, self._needs = src_rows, dst_rows, needs
        for r in S.index:  # DTensor's offset of an empty shard; 0 off the mesh
            src_off[r] = _offset(src, src_off[r], src_off[r] + src_rows[r])
        for r in D.index:
            dst_off[r] = _offset(dst, dst_off[r], dst_off[r] + dst_rows[r])
        self._src_off, self._dst_off = src_off, dst_off
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
        seq = self._recv_seq[a:b]
        a, b = self._copy_start[rank], self._copy_start[rank + 1]
        rows, needs = self._dst_rows[rank], self._needs[rank]
        order: tuple[int, ...] = ()
        if self.reduce and needs:
            seq = self._copy_seq[a:b] + seq
            order = tuple(sorted(range(len(seq)), key=seq.__getitem__))
        view = RankPlan(rank, self._src_rows[rank], rows, self._src_off[rank], self._dst_off[rank],
                        sends, recvs, tuple(self._copy[a:b]), self.reduce and needs,
                        ((0, rows),) if rows and not needs else (), order)
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


def _rank_plan(src: MeshSpec, dst: MeshSpec, rank: int) -> RankPlan:
    """`rank`'s part of the plan from the rules alone: O(log shards + the rank's peers)."""
    S, D = _static(src), _static(dst)
    P = S.n_parts
    sends: list[Send] = []
    recvs: list[Recv] = []
    copies: list[Copy] = []
    src_rows = src_off = dst_rows = dst_off = 0
    needs = False
    order: tuple[int, ...] = ()
    mine = S.group(rank)
    if mine >= 0:  # as a sender: every receiver dealt to this replica, on each shard it meets
        i = S.index[rank]
        a, b = _bounds(src, S.shard[i])
        src_rows, src_off = b - a, _offset(src, a, b)
        n, k = len(S.groups[mine]), S.member[i]
        for t, lo, hi in _overlaps(dst, a, b):
            receivers = D.groups[t * D.n_parts]
            for slot in range((k - _first_replica(n, a, b, lo, hi)) % n, len(receivers), n):
                d = receivers[slot]
                if S.group(d) != mine:  # a receiver holding the rows copies them itself
                    sends.append(Send(d, lo - a, hi - a))
        sends.sort()
    j = D.index.get(rank)
    if j is not None:  # as a receiver: from one replica of each source group it meets
        t = D.shard[j]
        a, b = _bounds(dst, t)
        dst_rows, dst_off, needs = b - a, _offset(dst, a, b), D.part[j] == 0
        if needs:
            made: list[int] = []  # the pieces in the order made (rows, then Partial coordinate): -1 - copy, or peer
            for s, lo, hi in _overlaps(src, a, b):
                s_lo, s_hi = _bounds(src, s)
                for gid in range(s * P, s * P + P):
                    if gid == mine:
                        made.append(-1 - len(copies))
                        copies.append(Copy(lo - s_lo, hi - s_lo, lo - a, hi - a))
                    else:
                        replicas = S.groups[gid]
                        first = _first_replica(len(replicas), s_lo, s_hi, lo, hi)
                        recvs.append(Recv(replicas[(first + D.member[j]) % len(replicas)], lo - a, hi - a))
                        made.append(recvs[-1].peer)
            recvs.sort()
            if P > 1:  # at most one message per peer: a peer names its piece
                at = {r.peer: len(copies) + i for i, r in enumerate(recvs)}
                order = tuple(-1 - m if m < 0 else at[m] for m in made)
    return RankPlan(rank, src_rows, dst_rows, src_off, dst_off, tuple(sends), tuple(recvs), tuple(copies),
                    P > 1 and needs, ((0, dst_rows),) if dst_rows and not needs else (), order)


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
    top = max(src._mesh.top, dst._mesh.top)
    if world_size is None:
        return top + 1
    if _as_int(world_size) is None or world_size < 1:
        raise PlanError(f"world_size must be an integer >= 1, got {world_size!r}")
    world_size = _as_int(world_size)
    if top >= world_size:
        for role, spec in (("source", src), ("destination", dst)):
            out = [r for r in spec.ranks if r >= world_size]
            if out:
                raise PlanError(
                    f"{role} {spec.label} of shape {spec.shape} holds rank(s) {out[:8]} outside the world "
                    f"of {world_size} ranks (0..{world_size - 1})"
                )
    return world_size


def plan(src: MeshSpec, dst: MeshSpec, world_size: int | None = None) -> Plan:
    """Plan moving the tensor laid out as `src` to the layout `dst`, for every rank (cached).

    O(world): for tests, statistics and benchmarks; a rank that only needs its own part asks
    `plan_for_rank`. `world_size` defaults to one more than the largest rank of either mesh;
    ranks of the world in neither mesh get an empty `RankPlan`. Raises `PlanError` on
    inconsistent specs.
    """
    return _plan(src, dst, _check_pair(src, dst, world_size))


@functools.lru_cache(maxsize=32)
def _plan(src: MeshSpec, dst: MeshSpec, world_size: int) -> Plan:
    return Plan(src, dst, world_size)


def plan_for_rank(src: MeshSpec, dst: MeshSpec, rank: int, world_size: int | None = None) -> RankPlan:
    """`plan(src, dst, world_size).for_rank(rank)`, computed from `rank`'s peers alone (cached).

    The bridge's hot path: with new ragged sizes every step (`MeshSpec.replace`), the cost is
    O(samples) for the prefix sums plus O(log shards + peers) for the messages, not O(world).
    """
    world_size = _check_pair(src, dst, world_size)
    if not 0 <= rank < world_size:
        raise PlanError(f"rank {rank} is outside the world of {world_size} ranks")
    return _plan_for_rank(src, dst, rank)


@functools.lru_cache(maxsize=64)
def _plan_for_rank(src: MeshSpec, dst: MeshSpec, rank: int) -> RankPlan:
    return _rank_plan(src, dst, rank)


def _clear_caches() -> None:
    _plan.cache_clear()
    _plan_for_rank.cache_clear()
    _resolve.cache_clear()
    _cached_backward_specs.cache_clear()


plan.cache_clear = _clear_caches  # type: ignore[attr-defined]  # lru_cache's spelling, for benchmarks


def summed_placements(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """`placements` with `Partial` read as `Replicate`: DTensor's default gradient placements, and
    where a redistribution's gradient lands on its source mesh."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def backward_specs(src: MeshSpec, dst: MeshSpec, grad_placements: Sequence[Placement]) -> tuple[MeshSpec, MeshSpec]:
    """The (source, destination) specs of the gradient's trip back from `dst` to `src`.

    The gradient starts on the destination mesh with `grad_placements` (a `Replicate` dim
    is taken once from one replica, a `Partial` dim is summed over all its members, as in
    DTensor) and ends on the source mesh where every rank holding a source row receives its
    gradient: `src`'s placements with `Partial` turned into `Replicate`.
    """
    grad_src = dst.replace(placements=tuple(grad_placements), split_dims=(),
                           name=f"{dst.name or 'destination'} (gradient)")
    grad_dst = src.replace(placements=summed_placements(src.placements),
                           split_dims=(), name=f"{src.name or 'source'} (gradient)")
    return grad_src, grad_dst


_cached_backward_specs = functools.lru_cache(maxsize=32)(backward_specs)


def plan_backward(
    src: MeshSpec, dst: MeshSpec, grad_placements: Sequence[Placement], world_size: int | None = None
) -> Plan:
    """`plan` of the gradient of a `src` -> `dst` redistribution (see `backward_specs`; cached)."""
    return plan(*_cached_backward_specs(src, dst, tuple(grad_placements)), world_size)


def plan_backward_for_rank(
    src: MeshSpec, dst: MeshSpec, grad_placements: Sequence[Placement], rank: int, world_size: int | None = None
) -> RankPlan:
    """`plan_for_rank` of the gradient of a `src` -> `dst` redistribution (cached)."""
    return plan_for_rank(*_cached_backward_specs(src, dst, tuple(grad_placements)), rank, world_size)
