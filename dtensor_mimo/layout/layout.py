"""`MimoLayout`: which ranks each module spans, as pure rank arithmetic.

Rank order inside a module: dims ``("pp", "dp", "cp", "tp")`` with tp varying fastest,

    rank = offset + ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i

so a tp group is a run of consecutive ranks, then cp, then dp, and pp is outermost
(the torchtitan / Megatron order). Nothing here touches torch.distributed: every
question has an answer for any rank, so layouts of thousands of ranks are validated
and tested in one process. `dtensor_mimo.layout.mesh` turns a layout into DeviceMeshes.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from dtensor_mimo.layout.mesh import build_meshes
from dtensor_mimo.layout.parallelism import MESH_DIMS, Parallelism

if TYPE_CHECKING:
    import torch.distributed as dist

LANGUAGE = "language"
"""Default name of the language module in a MIMO layout."""


class LayoutError(ValueError):
    """A layout that cannot be built: the message names the module and the numbers."""


class MimoLayout:
    """Per-module parallel layouts over one world of ranks.

    Args:
        modules: ``{name: Parallelism or {"tp": 2, ...}}`` in declaration order.
        offsets: first rank of each module. Omitted: modules take consecutive rank
            ranges in declaration order (disjoint). Modules may share ranks only by
            spanning exactly the same ranks (same offset and size).
        world_size: number of ranks of the job; defaults to the end of the last span.

    Example::

        layout = MimoLayout({"vision": Parallelism(dp=4), "language": Parallelism(tp=2, dp=2)})
        layout.ranks("language")        # [4, 5, 6, 7]
        MimoLayout.colocated({"vision": Parallelism(tp=2, dp=4), "language": Parallelism(tp=4, dp=2)})
        MimoLayout({"vision": ..., "audio": ..., "language": ...},
                   offsets={"vision": 0, "audio": 0, "language": 2})   # encoders share ranks
    """

    def __init__(
        self,
        modules: Mapping[str, Parallelism | Mapping[str, int]],
        *,
        offsets: Mapping[str, int] | None = None,
        world_size: int | None = None,
    ) -> None:
        if not modules:
            raise LayoutError("a layout needs at least one module, got none")
        self._par: dict[str, Parallelism] = {}
        for name, par in modules.items():
            if not isinstance(name, str) or not name:
                raise LayoutError(f"module names must be non-empty strings, got {name!r}")
            self._par[name] = (
                par if isinstance(par, Parallelism) else Parallelism.from_mapping(par, module=name)
            )
        self._offsets = self._resolve_offsets(offsets)
        end = max(self._offsets[n] + self._par[n].size for n in self._par)
        self.world_size = end if world_size is None else world_size
        self._validate_spans()
        self._meshes = None  # filled by init_meshes()

    # ------------------------------------------------------------------ construction
    @classmethod
    def colocated(
        cls, modules: Mapping[str, Parallelism | Mapping[str, int]], *, world_size: int | None = None
    ) -> "MimoLayout":
        """Every module spans the same ranks ``0..N-1``; their sizes must all be N."""
        pars = {n: p if isinstance(p, Parallelism) else Parallelism.from_mapping(p, module=n)
                for n, p in modules.items()}
        sizes = {n: p.size for n, p in pars.items()}
        if len(set(sizes.values())) > 1:
            detail = ", ".join(f"{n} {pars[n]} = {s}" for n, s in sizes.items())
            raise LayoutError(
                f"colocated modules must span the same number of ranks, got {detail}; "
                "change their sizes so the products are equal, or place them on disjoint ranks"
            )
        return cls(pars, offsets={n: 0 for n in pars}, world_size=world_size)

    def _resolve_offsets(self, offsets: Mapping[str, int] | None) -> dict[str, int]:
        if offsets is None:
            resolved, nxt = {}, 0
            for name, par in self._par.items():
                resolved[name] = nxt
                nxt += par.size
            return resolved
        missing = [n for n in self._par if n not in offsets]
        extra = [n for n in offsets if n not in self._par]
        if missing or extra:
            raise LayoutError(
                f"offsets must name every module exactly: missing {missing}, unknown {extra}; "
                f"modules are {list(self._par)}"
            )
        for name, off in offsets.items():
            if isinstance(off, bool) or not isinstance(off, int) or off < 0:
                raise LayoutError(f"module {name!r}: offset must be an integer >= 0, got {off!r}")
        return {n: offsets[n] for n in self._par}

    def _validate_spans(self) -> None:
        names = list(self._par)
        for a, b in itertools.combinations(names, 2):
            sa, sb = self._span(a), self._span(b)
            overlap = max(sa[0], sb[0]) < min(sa[1], sb[1])
            if overlap and sa != sb:
                raise LayoutError(
                    f"modules {a!r} ({self._par[a]}, ranks {sa[0]}..{sa[1] - 1}) and {b!r} "
                    f"({self._par[b]}, ranks {sb[0]}..{sb[1] - 1}) partially overlap; modules "
                    "either share exactly the same ranks (colocated) or none"
                )
        end = max(s[1] for s in map(self._span, names))
        if end > self.world_size:
            worst = max(names, key=lambda n: self._span(n)[1])
            s = self._span(worst)
            raise LayoutError(
                f"module {worst!r} ({self._par[worst]} = {self._par[worst].size} ranks at offset "
                f"{s[0]}) needs ranks {s[0]}..{s[1] - 1}, but the world has {self.world_size} "
                f"ranks; the layout needs world_size >= {end}"
            )
        covered = set().union(*(range(*self._span(n)) for n in names))
        gaps = sorted(set(range(self.world_size)) - covered)
        if gaps:
            raise LayoutError(
                f"ranks {_ranges(gaps)} of the {self.world_size}-rank world belong to no module "
                f"(spans: {', '.join(f'{n} {s[0]}..{s[1] - 1}' for n, s in ((n, self._span(n)) for n in names))}); "
                "every rank must run some module: adjust sizes, offsets or the world size"
            )

    def _span(self, name: str) -> tuple[int, int]:
        off = self._offsets[name]
        return off, off + self._par[name].size

    # ------------------------------------------------------------------ pure queries
    @property
    def names(self) -> list[str]:
        """Module names in declaration order."""
        return list(self._par)

    def parallelism(self, name: str) -> Parallelism:
        return self._par[self._check_name(name)]

    def offset(self, name: str) -> int:
        return self._offsets[self._check_name(name)]

    def ranks(self, name: str) -> list[int]:
        """Global ranks of a module, in mesh (row-major, tp fastest) order."""
        return list(range(*self._span(self._check_name(name))))

    def rank_grid(self, name: str) -> list:
        """Nested list of global ranks with shape ``(pp, dp, cp, tp)``: ``DeviceMesh``'s input."""
        par = self.parallelism(name)
        flat = self.ranks(name)
        for size in reversed(par.shape[1:]):
            flat = [flat[i:i + size] for i in range(0, len(flat), size)]
        return flat

    def is_member(self, name: str, rank: int) -> bool:
        lo, hi = self._span(self._check_name(name))
        return lo <= rank < hi

    def coordinate(self, name: str, rank: int) -> dict[str, int] | None:
        """``{"pp": i, "dp": j, "cp": k, "tp": l}`` of ``rank`` in the module, None if not a member."""
        if not self.is_member(name, rank):
            return None
        local = rank - self._offsets[name]
        coord = {}
        for dim, size in reversed(list(zip(MESH_DIMS, self._par[name].shape))):
            local, coord[dim] = divmod(local, size)
        return {d: coord[d] for d in MESH_DIMS}

    def is_first_stage(self, name: str, rank: int) -> bool:
        c = self.coordinate(name, rank)
        return c is not None and c["pp"] == 0

    def groups(self, name: str, dims: str | Iterable[str]) -> list[list[int]]:
        """Rank groups along ``dims`` (one dim or several, e.g. ``("dp", "cp")``).

        Each group varies the named dims and fixes the others; groups are listed in
        mesh order and each group's ranks in mesh order, as DeviceMesh creates them.
        """
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        unknown = [d for d in dims if d not in MESH_DIMS]
        if unknown:
            raise LayoutError(f"unknown mesh dim(s) {unknown}; dims are {list(MESH_DIMS)}")
        par = self.parallelism(name)
        sizes = dict(zip(MESH_DIMS, par.shape))
        fixed = [d for d in MESH_DIMS if d not in dims]
        varied = [d for d in MESH_DIMS if d in dims]
        out = []
        for fixed_idx in itertools.product(*(range(sizes[d]) for d in fixed)):
            group = []
            for var_idx in itertools.product(*(range(sizes[d]) for d in varied)):
                coord = {**dict(zip(fixed, fixed_idx)), **dict(zip(varied, var_idx))}
                group.append(self._rank_of(name, coord))
            out.append(group)
        return out

    def shares_ranks(self, a: str, b: str) -> bool:
        """True when modules ``a`` and ``b`` run on the same ranks (colocated)."""
        return self._span(self._check_name(a)) == self._span(self._check_name(b))

    def require_mimo(self, language: str = LANGUAGE, encoders: Iterable[str] | None = None) -> None:
        """Check the layout can host a MIMO model: a language module plus the given encoders."""
        if language not in self._par:
            raise LayoutError(
                f"a MIMO layout needs a language module named {language!r}; the layout has "
                f"{self.names}: add it, or pass language=<name> for the one you have"
            )
        if encoders is not None:
            missing = [e for e in encoders if e not in self._par]
            if missing:
                raise LayoutError(
                    f"encoder(s) {missing} of the model have no layout; the layout has {self.names}"
                )

    def describe(self) -> str:
        """A table of modules, their sizes and ranks (print it on rank 0 at start-up)."""
        rows = [("module", "pp", "dp", "cp", "tp", "ranks", "placement")]
        for name in self._par:
            par, (lo, hi) = self._par[name], self._span(name)
            shared = [o for o in self._par if o != name and self.shares_ranks(name, o)]
            sizes = [str(n) + (f" ({par.dp_replicate} replica groups)" if d == "dp" and par.hsdp else "")
                     for d, n in zip(MESH_DIMS, par.shape)]
            rows.append((name, *sizes, f"{lo}..{hi - 1}",
                         f"colocated with {', '.join(shared)}" if shared else "own ranks"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return f"MimoLayout over {self.world_size} ranks (mesh dims pp, dp, cp, tp; tp fastest)\n" + "\n".join(lines)

    def __repr__(self) -> str:
        mods = ", ".join(f"{n}: {p} @{self._offsets[n]}" for n, p in self._par.items())
        return f"MimoLayout({{{mods}}}, world_size={self.world_size})"

    # ------------------------------------------------------------------ meshes
    def init_meshes(self, device_type: str = "cpu", agree: Mapping[str, Any] | None = None) -> None:
        """Build one DeviceMesh per module (collective: call on every rank, same layout).

        First, one all-gather checks that every rank holds this layout (and the `agree` parts,
        ``{what: value}``, e.g. options the meshes will serve): if not, every rank raises naming
        the ranks and what each holds, instead of hanging in ``new_group``. The meshes' groups
        wait for a peer as long as the default group does (its ``timeout``)."""
        self._meshes = build_meshes(self, device_type, agree)

    @property
    def meshes_ready(self) -> bool:
        """Whether `init_meshes` has run on this rank."""
        return self._meshes is not None

    @property
    def mesh_device_type(self) -> str | None:
        """The device type `init_meshes` built the meshes for (None before)."""
        return None if self._meshes is None else self._meshes.device_type

    def mesh(self, name: str, dims: str | tuple[str, ...] | None = None):
        """The module's DeviceMesh (dims pp, dp, cp, tp), or a sub-mesh such as ``("dp", "cp")``.

        ``("dp", "cp")`` (or ``"dp_cp"``) is the flattened dp·cp mesh for FSDP, built up front
        by `init_meshes` so that no rank ever creates a group alone; other dims are slices.
        Sub-meshes exist on the module's members only.
        """
        if self._meshes is None:
            raise RuntimeError("call layout.init_meshes(device_type) on every rank before layout.mesh()")
        return self._meshes.get(self._check_name(name), dims)

    def fsdp_mesh(self, name: str):
        """The mesh FSDP2 shards module `name` over (members only): its flat dp·cp mesh, or with
        HSDP (``Parallelism.dp_replicate > 1``) the 2-D ``("dp_replicate", "dp_shard_cp")`` mesh,
        built by `init_meshes` on the same root as the module's tp mesh."""
        if self._meshes is None:
            raise RuntimeError("call layout.init_meshes(device_type) on every rank before layout.fsdp_mesh()")
        return self._meshes.fsdp(self._check_name(name))

    def own_dp_group(self, name: str) -> dist.ProcessGroup | None:
        """A process group of its own over this rank's dp·cp ranks of module `name` (None off
        the module): `ModuleMeshes.own_dp_group`. Collective: call on every rank, for the same
        modules in the same order."""
        if self._meshes is None:
            raise RuntimeError("call layout.init_meshes(device_type) on every rank before layout.own_dp_group()")
        return self._meshes.own_dp_group(self._check_name(name))

    # ------------------------------------------------------------------ internals
    def _rank_of(self, name: str, coord: Mapping[str, int]) -> int:
        local = 0
        for dim, size in zip(MESH_DIMS, self._par[name].shape):
            local = local * size + coord[dim]
        return self._offsets[name] + local

    def _check_name(self, name: str) -> str:
        if name not in self._par:
            raise KeyError(f"no module {name!r} in the layout; modules are {self.names}")
        return name


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0..2, 5'."""
    out, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1 if cur is not None else True:
            out.append(f"{start}..{prev}" if prev != start else f"{start}")
            start = cur
    return ", ".join(out)
