"""Each module's DeviceMesh groups contain exactly the ranks the pure layout names.

| layout                                              | world |
|-----------------------------------------------------|-------|
| disjoint: vision tp2·pp2 @0 + language tp2·cp2 @4   | 8     |
| colocated: vision tp2·dp4 + language tp4·dp2        | 8     |

Membership is proven by communication, not by reading mesh metadata: an all-reduce of
``2**rank`` over every group must equal the bitmask of the group the layout names.
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
    }


def _check_groups(kind):
    layout = _layouts()[kind]
    layout.init_meshes("cpu")
    rank = dist.get_rank()
    mismatches = []
    for name in layout.names:
        for dims in DIMS:
            expected = next((g for g in layout.groups(name, dims) if rank in g), None)
            if expected is None:
                assert layout.mesh(name).get_coordinate() is None
                continue
            t = torch.tensor([2 ** rank], dtype=torch.int64)
            dist.all_reduce(t, group=layout.mesh(name, dims).get_group())
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


@pytest.mark.parametrize("kind", ["disjoint", "colocated"])
def test_mesh_groups_match_layout(kind):
    assert run_on_ranks(_check_groups, 8, kind, timeout=90) == [[]] * 8


def test_submesh_on_non_member_raises_clearly():
    assert run_on_ranks(_non_member_submesh_error, 8, timeout=60) == ["raised"] * 4 + [None] * 4


def test_world_size_mismatch_raises_on_every_rank():
    assert run_on_ranks(_world_mismatch_error, 8, timeout=60) == ["raised"] * 8
