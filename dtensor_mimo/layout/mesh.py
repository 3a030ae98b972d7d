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

from dtensor_mimo.layout.fingerprint import common_prefix, disagreement, excerpt, fingerprint, summary
from dtensor_mimo.layout.parallelism import HSDP_DIMS, MESH_DIMS, Parallelism
from dtensor_mimo.layout.world import check_device_type


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
        # before the first new_group; the device type too: agreed, its check refuses on every rank
        check_agreement({"layout": layout, "device type": device_type, **(agree or {})})
        check_device_type(device_type, "init_meshes: device_type")  # a typo ("gpu") failed inside FSDP2
        world = dist.get_world_size()
        if world != layout.world_size:
            raise RuntimeError(
                f"the layout covers {layout.world_size} ranks but the job has {world}: launch with "
                f"torchrun --nproc-per-node={layout.world_size}, or change the layout ({layout!r})"
            )
        self._layout, self.device_type = layout, device_type
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
        all-gather of every rank, before any exchange. DTensor's RNG tracker is made here too,
        without the world broadcast torch would make with it later on some ranks only."""
        device = torch.device("cuda", torch.cuda.current_device())
        self._rng_tracker()
        for name in self._layout.names:
            if self._meshes[name].get_coordinate() is None:
                continue
            for dims in ("pp", "dp_cp", "dp", "cp", "tp", *(HSDP_DIMS if name in self._hsdp else ())):
                group = self.get(name, dims).get_group()
                if group.size() > 1:
                    dist.all_reduce(torch.zeros(1, device=device), group=group)

    def _rng_tracker(self) -> None:
        """DTensor's RNG tracker, made on every rank now (torch 2.11 to 2.13's private
        ``_random``). torch makes it at the first random op on a DTensor (dropout in a user's tp
        module) with a broadcast of rank 0's RNG state over the WORLD group, which only that
        module's ranks would join: the others never do (a hang). Made here without that broadcast
        (torchtitan's choice): DTensor random ops draw from each rank's own generator, which torch
        asks users to seed alike on a module's tp ranks."""
        from torch.distributed.tensor import _random

        mine = next((m for n in self._layout.names if (m := self._meshes[n]).get_coordinate() is not None), None)
        if not _random._rng_tracker and mine is not None:
            _random._rng_tracker = _random.OffsetBasedRNGTracker(mine, run_state_sync=False)

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
    (every rank sees it in the gathered fingerprints) a broadcast of rank 0's `summary` texts of
    them and an all-gather of each rank's own `excerpt` where it first differs, for the message.
    Parts are matched by name (a part some rank lacks is named so). Call it before any collective
    that a disagreement would hang."""
    names = list(parts)
    mine = [fingerprint(parts[n]) for n in names]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (names, mine))
    if all(g == gathered[0] for g in gathered):
        return
    # Parts by name, in an order every rank derives alike (rank 0's, then each rank's new ones): a
    # part a rank lacks shows as such, and a part every rank holds alike is not named.
    held = [dict(zip(names_r, fps)) for names_r, fps in gathered]
    differ = [n for n in dict.fromkeys(n for names_r, _ in gathered for n in names_r)
              if len({h.get(n, -1) for h in held}) > 1]
    # A part's text may differ only past a message's excerpt (a whole tower's frozen list): rank 0's
    # whole texts go to every rank, and each rank shows its own where it first differs from them.
    texts = {n: summary(parts[n], limit=None) for n in differ if n in parts}
    reference: list[Any] = [texts if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(reference, src=0)
    at = {n: common_prefix(t, reference[0].get(n, "")) for n, t in texts.items()}
    shown: list[Any] = [None] * len(gathered)
    dist.all_gather_object(shown, {n: (at[n], excerpt(t, at[n])) for n, t in texts.items()})
    problems = []
    for name in differ:
        per_rank = [(h.get(name, -1), shown[r][name][1] if name in shown[r] else "(no such part)")
                    for r, h in enumerate(held)]
        first = next(r for r, (fp, _) in enumerate(per_rank) if fp != per_rank[0][0])
        if name in reference[0] and name in shown[first]:  # rank 0's text where the first other's differs
            per_rank[0] = (per_rank[0][0], excerpt(reference[0][name], shown[first][name][0]))
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
