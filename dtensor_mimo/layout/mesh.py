"""Turn a `MimoLayout` into one DeviceMesh per module (the only collective part of the layout).

Every rank builds every module's mesh, in declaration order: DeviceMesh creates its
process groups with world-collective calls (``new_group`` / ``split_group``), so a rank
that skipped a mesh would hang the others (see TORCH_NOTES). Sub-meshes are then
sliced locally on members.

Each module is built as a 3-D root mesh ``("pp", "dp_cp", "tp")`` unflattened to
``("pp", "dp", "cp", "tp")``. Building the flattened dp·cp dim up front (instead of
``mesh["dp", "cp"]._flatten()`` later) matters twice: ``_flatten`` on members only
hangs, and FSDP over dp·cp with TP requires both meshes to share one root. A module with HSDP
(``Parallelism.dp_replicate > 1``) also gets the same dim unflattened to ``("dp_replicate",
"dp_shard_cp")``: FSDP2's 2-D mesh, on the same root.

Two guards come first. The layout must be the same on every rank: a rank with another layout
would sit in another ``new_group`` than its peers, forever, so one all-gather of its fingerprint
(`check_agreement`) raises on every rank before any group is built. And the groups get the
default group's timeout (``init_process_group(timeout=...)``, the trainer's ``train.timeout_s``):
``new_group`` otherwise takes torch's 30-minute default, whatever the default group has.
"""

from __future__ import annotations

import datetime
from typing import Any, Mapping, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dtensor_mimo.layout.fingerprint import disagreement, fingerprint, summary
from dtensor_mimo.layout.parallelism import HSDP_DIMS, MESH_DIMS, Parallelism


class Layout(Protocol):
    """What the meshes read of a `MimoLayout` (which builds them: this module does not import it)."""

    world_size: int

    @property
    def names(self) -> list[str]: ...

    def parallelism(self, name: str) -> Parallelism: ...

    def ranks(self, name: str) -> list[int]: ...


class ModuleMeshes:
    """The DeviceMeshes of every module of a layout, on this rank."""

    def __init__(self, layout: Layout, device_type: str, agree: Mapping[str, Any] | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("init_meshes needs torch.distributed initialised (torchrun + init_process_group)")
        check_agreement({"layout": layout, **(agree or {})})  # before the first new_group
        world = dist.get_world_size()
        if world != layout.world_size:
            raise RuntimeError(
                f"the layout covers {layout.world_size} ranks but the job has {world}: launch with "
                f"torchrun --nproc-per-node={layout.world_size}, or change the layout ({layout!r})"
            )
        self._layout = layout
        self._roots: dict[str, DeviceMesh] = {}
        self._meshes: dict[str, DeviceMesh] = {}
        self._slices: dict[tuple[str, tuple[str, ...]], DeviceMesh] = {}  # torch builds a new one per slicing
        self._hsdp: dict[str, DeviceMesh] = {}
        timeout = default_timeout()
        for name in layout.names:  # same order on every rank
            par = layout.parallelism(name)
            grid = torch.tensor(layout.ranks(name), dtype=torch.int).reshape(par.pp, par.dp * par.cp, par.tp)
            root = DeviceMesh(device_type, grid, mesh_dim_names=("pp", "dp_cp", "tp"),
                              backend_override=tuple(_with_timeout(n, world, timeout) for n in grid.shape))
            self._roots[name] = root
            # The dim by index: torch 2.11's _unflatten rejects every dim name (its check is inverted).
            self._meshes[name] = root._unflatten(
                1, (par.dp, par.cp), ("dp", "cp"),
                backend_override={d: o for d, n in (("dp", par.dp), ("cp", par.cp))
                                  if (o := _with_timeout(n, world, timeout)) != (None, None)})
            if par.hsdp:  # same order on every rank, like every group above
                sizes = (par.dp_replicate, par.dp * par.cp // par.dp_replicate)
                self._hsdp[name] = root._unflatten(
                    1, sizes, HSDP_DIMS, backend_override={d: o for d, n in zip(HSDP_DIMS, sizes)
                                                           if (o := _with_timeout(n, world, timeout)) != (None, None)})
        if dist.get_backend() == "nccl":
            self._first_collectives()

    def _first_collectives(self) -> None:
        """NCCL safety: torch requires that a group's FIRST ``batch_isend_irecv`` involve every
        rank of the group (a subset may hang while the communicator is created). So each mesh
        group's first operation is made an all-reduce of all its members, here, in the same order
        (modules in declaration order, then dims) on every rank, so no two ranks wait on two
        groups in opposite orders. The default group, where the bridge's exchanges run, needs no
        such step: ``init_process_group(device_id=...)`` (`dtensor_mimo.layout.world`)
        creates its communicator eagerly, and its first operation is `check_agreement`'s
        all-gather of every rank, before any exchange."""
        device = torch.device("cuda", torch.cuda.current_device())
        for name in self._layout.names:
            if self._meshes[name].get_coordinate() is None:
                continue
            for dims in ("pp", "dp_cp", "dp", "cp", "tp", *(HSDP_DIMS if name in self._hsdp else ())):
                group = self.get(name, dims).get_group()
                if group.size() > 1:
                    dist.all_reduce(torch.zeros(1, device=device), group=group)

    def own_dp_group(self, name: str) -> dist.ProcessGroup | None:
        """A new process group over this rank's dp·cp ranks of module `name`, which nothing else
        uses (None off the module). DeviceMesh shares one group among meshes of the same ranks (a
        colocated encoder's dp and the language model's cp, say), so collectives whose order is
        decided per rank at run time (`GradientReducer`'s buckets) get their own. Collective over
        the world: every rank calls it for the same modules in the same order, and makes every
        one of the module's dp·cp groups, one per (pp, tp) coordinate."""
        par = self._layout.parallelism(name)
        grid = torch.tensor(self._layout.ranks(name)).reshape(par.pp, par.dp * par.cp, par.tp)
        rank, mine = dist.get_rank(), None
        for pp in range(par.pp):
            for tp in range(par.tp):
                ranks = grid[pp, :, tp].tolist()
                group = dist.new_group(ranks, timeout=default_timeout())
                if rank in ranks:
                    mine = group
        if mine is not None and dist.get_backend() == "nccl":
            # Its communicator made now, by all its members (`_first_collectives`' rule), not by
            # the first bucket from the autograd thread in the middle of a backward.
            dist.all_reduce(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())), group=mine)
        return mine

    def fsdp(self, name: str) -> DeviceMesh:
        """The mesh FSDP2 shards module `name` over: its flat dp·cp mesh, or with HSDP
        (``dp_replicate > 1``) the 2-D ``("dp_replicate", "dp_shard_cp")`` one (members only)."""
        return self.get(name, HSDP_DIMS if name in self._hsdp else ("dp", "cp"))

    def get(self, name: str, dims: str | tuple[str, ...] | None = None) -> DeviceMesh:
        mesh = self._meshes[name]
        if dims is None:
            return mesh
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        if (name, dims) in self._slices:  # the step's path: no dispatch (get_coordinate runs tensor ops)
            return self._slices[name, dims]
        hsdp = name in self._hsdp and set(dims) <= set(HSDP_DIMS)
        unknown = [d for d in dims if d not in (*MESH_DIMS, "dp_cp") and not hsdp]
        if unknown:
            raise KeyError(f"unknown mesh dim(s) {unknown} for module {name!r}; dims are {list(MESH_DIMS)} or 'dp_cp'"
                           + (f" or {HSDP_DIMS} (it has dp_replicate > 1)" if name in self._hsdp else ""))
        if mesh.get_coordinate() is None:
            rank, ranks = dist.get_rank(), self._layout.ranks(name)
            raise RuntimeError(
                f"rank {rank} is not in module {name!r} (ranks {ranks[0]}..{ranks[-1]}): sub-meshes "
                f"{dims} exist only on its members; check layout.is_member({name!r}, rank) first"
            )
        flat = set(dims) in ({"dp_cp"}, {"dp", "cp"})  # flat dp·cp (FSDP), in either order
        # A slice reuses the root's groups: no collective.
        self._slices[name, dims] = (self._hsdp[name][dims] if hsdp else self._roots[name]["dp_cp"] if flat
                                    else mesh[dims])
        return self._slices[name, dims]


def build_meshes(layout: Layout, device_type: str = "cpu",
                 agree: Mapping[str, Any] | None = None) -> ModuleMeshes:
    """Build the meshes of ``layout`` (collective over the world), after checking that every
    rank has the same layout and the same `agree` parts (`check_agreement`)."""
    return ModuleMeshes(layout, device_type, agree)


def check_agreement(parts: Mapping[str, Any]) -> None:
    """Raise on every rank, with `disagreement`'s message, unless every rank holds the same
    `parts` (``{what: value}``, the same keys everywhere: a layout, options, a config).

    Collective over the world: one all-gather of the parts' fingerprints; only when some differ
    (every rank sees it in the gathered fingerprints) a second one of their `summary` texts, for
    the message. Call it before any collective that a disagreement would hang."""
    names = list(parts)
    mine = [fingerprint(parts[n]) for n in names]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (names, mine))
    if all(g == gathered[0] for g in gathered):
        return
    texts: list[Any] = [None] * len(gathered)
    dist.all_gather_object(texts, [summary(parts[n]) for n in names])
    problems = []
    for i, name in enumerate(names):
        per_rank = [(fps[i] if names_r == names else -1, texts[r][i] if names_r == names else
                     f"other parts {names_r}") for r, (names_r, fps) in enumerate(gathered)]
        if (problem := disagreement(per_rank, name)) is not None:
            problems.append(problem)
    raise RuntimeError(" | ".join(problems) or f"ranks disagree on which state to compare: {names}")


def default_timeout() -> datetime.timedelta | None:
    """The default process group's timeout (what ``init_process_group(timeout=...)`` set), or
    None where the backend does not say."""
    group = dist.distributed_c10d._get_default_group()
    for device in group._device_types:
        options = getattr(group._get_backend(device), "options", None)
        if options is not None and getattr(options, "_timeout", None) is not None:
            return options._timeout
    return None


def _with_timeout(size: int, world: int, timeout: datetime.timedelta | None) -> tuple[Any, Any]:
    """A mesh dim's ``backend_override``: options carrying `timeout` (DeviceMesh passes their
    ``_timeout`` to ``new_group`` / ``split_group``); ``(None, None)`` for a dim spanning the
    world, which DeviceMesh serves with the default group itself (already bound by `timeout`)."""
    if timeout is None or (size == world and not torch.cuda.is_available()):
        return (None, None)  # (with CUDA present DeviceMesh makes a new group even of the world)
    backend = dist.get_backend()
    options = (dist.ProcessGroupNCCL.Options() if backend == "nccl" else
               dist.ProcessGroupGloo._Options())
    options._timeout = timeout
    return (None, options)
