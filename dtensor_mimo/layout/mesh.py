"""Turn a `MimoLayout` into one DeviceMesh per module (the only collective part of the layout).

Every rank builds every module's mesh, in declaration order: DeviceMesh creates its
process groups with world-collective calls (``new_group`` / ``split_group``), so a rank
that skipped a mesh would hang the others (see TORCH_NOTES). Sub-meshes are then
sliced locally on members.

Each module is built as a 3-D root mesh ``("pp", "dp_cp", "tp")`` unflattened to
``("pp", "dp", "cp", "tp")``. Building the flattened dp·cp dim up front (instead of
``mesh["dp", "cp"]._flatten()`` later) matters twice: ``_flatten`` on members only
hangs, and FSDP over dp·cp with TP requires both meshes to share one root.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dtensor_mimo.layout.parallelism import MESH_DIMS

if TYPE_CHECKING:
    from dtensor_mimo.layout.layout import MimoLayout


class ModuleMeshes:
    """The DeviceMeshes of every module of a layout, on this rank."""

    def __init__(self, layout: "MimoLayout", device_type: str) -> None:
        if not dist.is_initialized():
            raise RuntimeError("init_meshes needs torch.distributed initialised (torchrun + init_process_group)")
        world = dist.get_world_size()
        if world != layout.world_size:
            raise RuntimeError(
                f"the layout covers {layout.world_size} ranks but the job has {world}: launch with "
                f"torchrun --nproc-per-node={layout.world_size}, or change the layout ({layout!r})"
            )
        self._layout = layout
        self._roots: dict[str, DeviceMesh] = {}
        self._meshes: dict[str, DeviceMesh] = {}
        for name in layout.names:  # same order on every rank
            par = layout.parallelism(name)
            grid = torch.tensor(layout.ranks(name), dtype=torch.int).reshape(par.pp, par.dp * par.cp, par.tp)
            root = DeviceMesh(device_type, grid, mesh_dim_names=("pp", "dp_cp", "tp"))
            self._roots[name] = root
            self._meshes[name] = root._unflatten("dp_cp", (par.dp, par.cp), ("dp", "cp"))

    def get(self, name: str, dims: str | tuple[str, ...] | None = None) -> DeviceMesh:
        mesh = self._meshes[name]
        if dims is None:
            return mesh
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        unknown = [d for d in dims if d not in (*MESH_DIMS, "dp_cp")]
        if unknown:
            raise KeyError(f"unknown mesh dim(s) {unknown} for module {name!r}; dims are {list(MESH_DIMS)} or 'dp_cp'")
        if mesh.get_coordinate() is None:
            rank, ranks = dist.get_rank(), self._layout.ranks(name)
            raise RuntimeError(
                f"rank {rank} is not in module {name!r} (ranks {ranks[0]}..{ranks[-1]}): sub-meshes "
                f"{dims} exist only on its members; check layout.is_member({name!r}, rank) first"
            )
        if set(dims) in ({"dp_cp"}, {"dp", "cp"}):  # flat dp·cp (FSDP), in either order
            return self._roots[name]["dp_cp"]
        return mesh[dims]


def build_meshes(layout: "MimoLayout", device_type: str = "cpu") -> ModuleMeshes:
    """Build the meshes of ``layout`` (collective over the world)."""
    return ModuleMeshes(layout, device_type)
