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



def _refused_on_one_rank():
    from dtensor_mimo import MimoModel, ParallelOptions, mimo
    from tests.test_mimo import _modules

    layout = MimoLayout({"vision": Parallelism(), "language": Parallelism()})
    llama, encs = _modules(("vision",))
    rank = dist.get_rank()

    def attempt(options):
        try:
            MimoModel(layout, llama, encs, options=options)
        except (RuntimeError, ValueError) as e:
            return str(e)
        return "built"

    out = {}
    # rank 0 was given options the model checks refuse, rank 1 valid ones (another config file, say)
    out["options"] = attempt({"language": ParallelOptions(balance=True)} if rank == 0 else {})
    # the same options everywhere, refused by rank 0's machine only (here: torchao missing there)
    check_fp8 = mimo.check_fp8

    def no_torchao(module, recipe, device_type):
        raise ImportError(f"ParallelOptions(fp8={recipe!r}) for module {module!r} needs torchao")

    mimo.check_fp8 = no_torchao if rank == 0 else check_fp8
    try:
        out["machine"] = attempt({"vision": ParallelOptions(fp8="tensorwise")})
    finally:
        mimo.check_fp8 = check_fp8
    dist.barrier()  # the world is still usable: no rank waits in a collective its peers left
    return out


def test_a_model_check_that_refuses_on_one_rank_fails_on_every_rank():
    """A model check that refuses on some ranks only (options that differ, or a check that depends
    on the rank's machine: torchao, a GPU's compute capability) fails on every rank, naming the
    refusal and the ranks, instead of leaving the others in the agreement's all-gather (where NCCL
    waits until the timeout) or building meshes without the refusing ranks."""
    results = run_on_ranks(_refused_on_one_rank, 2, timeout=60)
    assert results[0] == results[1], results  # every rank, the same message
    got = results[0]
    assert ("the model check differs between ranks: rank 0: \"LayoutError: ParallelOptions(balance=True) was given "
            "for the language model 'language'; balancing applies to encoders") in got["options"], got
    assert "; rank 1: None." in got["options"] and "the ParallelOptions mapping differs" in got["options"], got
    assert got["machine"].startswith("the model check differs between ranks: rank 0: \"ImportError: ParallelOptions("
                                     "fp8='tensorwise') for module 'vision' needs torchao\"; rank 1: None."), got


def _parts_named_differently():
    from dtensor_mimo.layout.mesh import check_agreement

    layout = MimoLayout({"language": Parallelism(dp=2)})  # the same on both ranks
    parts = {"layout": layout, "model check": None}
    if dist.get_rank() == 1:  # rank 1 compares one more part, and its own check refused
        parts = {"layout": layout, "options": 3, "model check": "ValueError: bad"}
    try:
        check_agreement(parts)
    except RuntimeError as e:
        return str(e)
    return "agreed"


def test_agreement_on_parts_named_differently_names_only_what_differs():
    """Ranks that compare different parts (a rank whose arguments were refused before its options
    could be read compares fewer) get one message on every rank, naming the parts that differ with
    what each rank holds, and not a part that every rank holds alike (the layout here)."""
    results = run_on_ranks(_parts_named_differently, 2, timeout=60)
    assert results[0] == results[1], results
    tail = "Every rank must build the same {} (the same config file and arguments on every rank)"
    assert results[0] == (
        "the model check differs between ranks: rank 0: None; rank 1: 'ValueError: bad'. "
        + tail.format("model check") + " | the options differs between ranks: rank 0: (no such part); rank 1: 3. "
        + tail.format("options")), results[0]


def _long_parts_differ_at_the_end():
    from dtensor_mimo.layout.mesh import check_agreement

    # a vision tower frozen on both ranks; rank 1 also froze the projector (another config file)
    frozen = [f"encoder.blocks.{i}.attn.qkv.weight" for i in range(12)]
    if dist.get_rank() == 1:
        frozen.append("projector.proj.weight")
    try:
        check_agreement({"frozen parameter list": {"vision": frozen, "language": []}})
    except RuntimeError as e:
        return str(e)
    return "agreed"


def test_agreement_shows_where_long_parts_differ():
    """Parts longer than a message's excerpt (a frozen list of a whole tower) that differ past its
    first characters: the message shows each rank's text where it differs, not the same opening
    twice."""
    results = run_on_ranks(_long_parts_differ_at_the_end, 2, timeout=60)
    assert results[0] == results[1], results
    rank0, rank1 = results[0].split("; rank 1: ")
    assert "'encoder.blocks.11.attn.qkv.weight'], language: []}" in rank0, results[0]
    assert "'encoder.blocks.11.attn.qkv.weight', 'projector.proj.weight'], language: []}" in rank1, results[0]


def _meshes_for_device(devices):
    layout = MimoLayout({"language": Parallelism(dp=2)})
    try:
        layout.init_meshes(devices[dist.get_rank()])
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "built"


@pytest.mark.parametrize("word", ["gpu", "nccl", "cuda:0"])
def test_init_meshes_refuses_a_device_word_on_every_rank(word):
    """A device word other than 'cpu' or 'cuda' is refused by name on every rank (it was taken,
    and the model built on the meshes then failed inside FSDP2: "'NoneType' object has no
    attribute 'current_device'")."""
    got = run_on_ranks(_meshes_for_device, 2, [word, word], timeout=60)
    assert got == [f"ValueError: init_meshes: device_type={word!r} is not 'cpu' (gloo) or 'cuda' (NCCL; each "
                   "rank's GPU is its LOCAL_RANK, set as the current device)"] * 2, got


def test_init_meshes_with_device_types_that_differ_fails_on_every_rank():
    """Ranks given different device words (one refused) all raise, naming both: none is left in a
    collective the refusing rank never joins."""
    got = run_on_ranks(_meshes_for_device, 2, ["cpu", "gpu"], timeout=60)
    assert got[0] == got[1], got
    assert got[0].startswith("RuntimeError: the device type differs between ranks: rank 0: 'cpu'; rank 1: 'gpu'."), got


def _model_on_meshes_of_another_device():
    from dtensor_mimo import MimoModel
    from tests.test_mimo import _modules

    layout = MimoLayout({"vision": Parallelism(), "language": Parallelism()})
    layout.init_meshes("cpu")
    layout._meshes.device_type = "cuda"  # as `init_meshes("cuda")` records it (no GPU here to build them)
    llama, encs = _modules(("vision",))
    try:
        MimoModel(layout, llama, encs, device_type="cpu")
    except ValueError as e:
        return str(e)
    return "built"


def test_a_model_of_another_device_type_than_its_meshes_is_refused_on_every_rank():
    """Meshes built for one device type (the README's ``init_meshes("cpu")`` copied into a GPU
    script) and a `MimoModel` of another: refused by name on every rank before its groups are used
    (FSDP2 failed deep inside torch on the meshes' device)."""
    got = run_on_ranks(_model_on_meshes_of_another_device, 2, timeout=60)
    assert got == ["MimoModel(device_type='cpu') on meshes built for 'cuda' (layout.init_meshes('cuda')): build "
                   "both for the same device type"] * 2, got


def _rng_tracker_on_every_rank():
    """`init_meshes`' DTensor RNG tracker (made under NCCL; here with a stand-in tracker class):
    the module meshes it is made with, whether it would sync the RNG state, and the broadcasts."""
    from torch.distributed.tensor import _random

    made, broadcasts = [], []

    class Tracker:
        def __init__(self, mesh, run_state_sync=True):
            made.append((mesh.mesh.flatten().tolist(), run_state_sync))

    layout = MimoLayout({"vision": Parallelism(dp=1), "language": Parallelism(tp=2)})
    layout.init_meshes("cpu")
    saved = _random._rng_tracker, _random.OffsetBasedRNGTracker, dist.broadcast
    _random._rng_tracker, _random.OffsetBasedRNGTracker = None, Tracker
    dist.broadcast = lambda *args, **kwargs: broadcasts.append(args)
    try:
        layout._meshes._rng_tracker()
        layout._meshes._rng_tracker()  # made once
    finally:
        _random._rng_tracker, _random.OffsetBasedRNGTracker, dist.broadcast = saved
    return made, len(broadcasts)


def test_dtensor_rng_tracker_is_made_on_every_rank_without_a_world_broadcast():
    """torch makes DTensor's RNG tracker at the first random op on a DTensor with a broadcast over
    the WORLD group, which only the ranks of the module that draws would join (a hang under NCCL).
    Every rank makes it with its own module's mesh, once, without that broadcast."""
    got = run_on_ranks(_rng_tracker_on_every_rank, 3, timeout=60)
    assert got == [([([0], False)], 0), ([([1, 2], False)], 0), ([([1, 2], False)], 0)], got
