"""Each module's DeviceMesh groups contain exactly the ranks the pure layout names.

| layout                                              | world |
|-----------------------------------------------------|-------|
| disjoint: vision tp2·pp2 @0 + language tp2·cp2 @4   | 8     |
| colocated: vision tp2·dp4 + language tp4·dp2        | 8     |
| hsdp: vision tp2·dp4 (4 replica groups) + language cp2·dp4 (2 replica groups), colocated | 8 |

Membership is proven by communication, not by reading mesh metadata: an all-reduce of
``2**rank`` over every group must equal the bitmask of the group the layout names. With HSDP
(``dp_replicate``) also FSDP2's two dims: a replica group's run of consecutive dp·cp ranks
(``dp_shard_cp``) and the ranks at the same place in each run (``dp_replicate``).
"""

import pytest
import torch
import torch.distributed as dist

from dtensor_mimo import MimoLayout, Parallelism
from tests.harness import run_on_ranks

DIMS = ["pp", "dp", "cp", "tp", ("dp", "cp")]


def _layouts():
    return {
        "disjoint": MimoLayout({"vision": Parallelism(tp=2, pp=2), "language": Parallelism(tp=2, cp=2)}),
        "colocated": MimoLayout.colocated({"vision": Parallelism(tp=2, dp=4), "language": Parallelism(tp=4, dp=2)}),
        "hsdp": MimoLayout.colocated({"vision": Parallelism(tp=2, dp=4, dp_replicate=4),
                                      "language": Parallelism(dp=4, cp=2, dp_replicate=2)}),
    }


def _check_groups(kind):
    layout = _layouts()[kind]
    layout.init_meshes("cpu")
    rank = dist.get_rank()
    mismatches = []
    for name in layout.names:
        groups = {dims: (layout.mesh, next((g for g in layout.groups(name, dims) if rank in g), None)) for dims in DIMS}
        replicas = layout.parallelism(name).dp_replicate
        if replicas > 1 and groups[("dp", "cp")][1] is not None:
            flat = groups[("dp", "cp")][1]
            shard = len(flat) // replicas
            runs = [flat[i:i + shard] for i in range(0, len(flat), shard)]
            hsdp = lambda n, dims: layout.fsdp_mesh(n)[dims]  # noqa: E731
            groups["dp_shard_cp"] = (hsdp, next(r for r in runs if rank in r))
            groups["dp_replicate"] = (hsdp, [run[runs[flat.index(rank) // shard].index(rank)] for run in runs])
            assert layout.fsdp_mesh(name).shape == (replicas, shard)
        for dims, (mesh, expected) in groups.items():
            if expected is None:
                assert layout.mesh(name).get_coordinate() is None
                continue
            t = torch.tensor([2 ** rank], dtype=torch.int64)
            dist.all_reduce(t, group=mesh(name, dims).get_group())
            if t.item() != sum(2 ** r for r in expected):
                got = [r for r in range(64) if t.item() >> r & 1]
                mismatches.append((name, dims, expected, got))
        coord = layout.coordinate(name, rank)
        mesh_coord = layout.mesh(name).get_coordinate()
        assert (coord is None and mesh_coord is None) or list(coord.values()) == list(mesh_coord)
    return mismatches


def _non_member_submesh_error():
    layout = _layouts()["disjoint"]
    layout.init_meshes("cpu")
    if layout.is_member("language", dist.get_rank()):
        return None
    for dims in ("tp", ("dp", "cp"), ("cp", "dp")):
        with pytest.raises(RuntimeError, match=r"is not in module 'language' \(ranks 4..7\)"):
            layout.mesh("language", dims)
    return "raised"


def _world_mismatch_error():
    layout = MimoLayout({"vision": Parallelism(dp=2), "language": Parallelism(tp=4)})
    with pytest.raises(RuntimeError, match=r"the layout covers 6 ranks but the job has 8: launch with "
                                           r"torchrun --nproc-per-node=6"):
        layout.init_meshes("cpu")
    return "raised"


@pytest.mark.parametrize("kind", ["disjoint", "colocated", "hsdp"])
def test_mesh_groups_match_layout(kind):
    assert run_on_ranks(_check_groups, 8, kind, timeout=90) == [[]] * 8


def test_submesh_on_non_member_raises_clearly():
    assert run_on_ranks(_non_member_submesh_error, 8, timeout=60) == ["raised"] * 4 + [None] * 4


def test_world_size_mismatch_raises_on_every_rank():
    assert run_on_ranks(_world_mismatch_error, 8, timeout=60) == ["raised"] * 8
