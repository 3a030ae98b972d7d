"""`redistribute` across meshes on 8 gloo ranks: content, gradients and adjointness.

| case                   | source (ranks)               | destination (ranks)              | tensor            | ragged |
|------------------------|------------------------------|----------------------------------|-------------------|--------|
| fan_in                 | dp4 (0-3)                    | dp1 (4)                          | [T, H], dim 0     | yes, 0-row samples |
| fan_out                | dp1 (0)                      | dp4 (1-4)                        | [T, H], dim 0     | yes    |
| dp3_to_dp2             | dp3 (0-2)                    | dp2 (3-4)                        | [B, H], dim 0     | no (5 samples)     |
| tp_dp_to_tp4           | tp2·dp2 (0-3)                | tp4·dp1 (4-7)                    | [S, B, H], dim 1  | no     |
| tp4_to_tp_dp           | tp4·dp1 (0-3)                | tp2·dp2 (4-7)                    | [S, B, H], dim 1  | no     |
| equal                  | tp2·dp2 (0-3)                | tp2·dp2 (4-7)                    | [T, H], dim 0     | yes    |
| cp_partial_grad        | dp2 (0-1)                    | tp2·cp2 (2-5), grad Partial(cp)  | [T, H], dim 0     | yes    |
| partial_source         | tp2 Partial (0-1)            | dp2 (2-3)                        | [B, H], dim 0     | no     |
| colocated_fan_in       | tp2·dp4 (0-7)                | tp4·dp2 (0-7)                    | [T, H], dim 0     | yes    |
| colocated_fan_out      | tp4·dp2 (0-7)                | tp2·dp4 (0-7)                    | [T, H], dim 0     | yes    |
| colocated_equal        | tp2·dp4 (0-7)                | tp2·dp4 (0-7), another mesh obj  | [T, H], dim 0     | yes    |
| fan_in_bounds          | dp4 (0-3), shard_bounds      | dp2 (4-5)                        | [T, H], dim 0     | yes, source split its own way |
| colocated_bounds       | tp2·dp4 (0-7), shard_bounds  | tp4·dp2 (0-7)                    | [T, H], dim 0     | yes, source split its own way |

Reference: the full tensor X (float64, same seed on every rank) sliced by hand with
``torch.tensor_split`` over samples (ragged) or ``torch.chunk`` over rows (DTensor's rule).
The loss is <y, G>; single-process autograd gives dL/dX = G (summed over cp replicas when
the gradient is declared Partial there), which every source rank compares with its x.grad.
Every case runs one-hop and two-hop (`hops=1`, `hops=2`: each row crosses once, then an
all-gather over the destination's Replicate dims; a Partial source or gradient is
reduce-scattered before it crosses).
Adjoint: <y, g> summed once per distinct destination value equals <x, x.grad> summed once
per distinct source row.
"""

import math
import re
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from dtensor_mimo.bridge import Bridge, BufferPool, MeshSpec, PlanError, plan, redistribute, redistribute_many
from tests.harness import run_on_ranks

WORLD = 8
H = 3


@dataclass(frozen=True)
class Side:
    offset: int
    shape: tuple[int, ...]
    names: tuple[str, ...]
    placements: tuple


@dataclass(frozen=True)
class Case:
    src: Side
    dst: Side
    shape: tuple[int, ...]
    dim: int
    sample_sizes: tuple[int, ...] | None = None
    grad: tuple | None = None  # gradient placements on the destination; default = its placements
    src_bounds: tuple[int, ...] | None = None  # the source's own ragged split (`shard_bounds`)


RAGGED = (3, 0, 5, 2, 0, 4, 1, 6)  # 21 rows, two text-only samples
CASES = {
    "fan_in": Case(Side(0, (4,), ("dp",), (Shard(0),)), Side(4, (1,), ("dp",), (Shard(0),)),
                   (21, H), 0, RAGGED),
    "fan_out": Case(Side(0, (1,), ("dp",), (Shard(0),)), Side(1, (4,), ("dp",), (Shard(0),)),
                    (21, H), 0, RAGGED),
    "dp3_to_dp2": Case(Side(0, (3,), ("dp",), (Shard(0),)), Side(3, (2,), ("dp",), (Shard(0),)),
                       (5, H), 0, (1,) * 5),
    "tp_dp_to_tp4": Case(Side(0, (2, 2), ("dp", "tp"), (Shard(1), Replicate())),
                         Side(4, (1, 4), ("dp", "tp"), (Shard(1), Replicate())), (4, 6, H), 1),
    "tp4_to_tp_dp": Case(Side(0, (1, 4), ("dp", "tp"), (Shard(1), Replicate())),
                         Side(4, (2, 2), ("dp", "tp"), (Shard(1), Replicate())), (4, 6, H), 1),
    "equal": Case(Side(0, (2, 2), ("dp", "tp"), (Shard(0), Replicate())),
                  Side(4, (2, 2), ("dp", "tp"), (Shard(0), Replicate())), (21, H), 0, RAGGED),
    "cp_partial_grad": Case(Side(0, (2,), ("dp",), (Shard(0),)),
                            Side(2, (2, 2), ("cp", "tp"), (Replicate(), Replicate())), (21, H), 0, RAGGED,
                            grad=(Partial(), Replicate())),
    "partial_source": Case(Side(0, (2,), ("tp",), (Partial(),)), Side(2, (2,), ("dp",), (Shard(0),)),
                           (6, H), 0),
    "colocated_fan_in": Case(Side(0, (4, 2), ("dp", "tp"), (Shard(0), Replicate())),
                             Side(0, (2, 4), ("dp", "tp"), (Shard(0), Replicate())), (21, H), 0, RAGGED),
    "colocated_fan_out": Case(Side(0, (2, 4), ("dp", "tp"), (Shard(0), Replicate())),
                              Side(0, (4, 2), ("dp", "tp"), (Shard(0), Replicate())), (21, H), 0, RAGGED),
    # The source split its own way (encoder dp balancing): rows [b_k, b_k+1) on shard k, one empty.
    "fan_in_bounds": Case(Side(0, (4,), ("dp",), (Shard(0),)), Side(4, (2,), ("dp",), (Shard(0),)),
                          (21, H), 0, RAGGED, src_bounds=(0, 2, 2, 14, 21)),
    "colocated_bounds": Case(Side(0, (4, 2), ("dp", "tp"), (Shard(0), Replicate())),
                             Side(0, (2, 4), ("dp", "tp"), (Shard(0), Replicate())), (21, H), 0, RAGGED,
                             src_bounds=(0, 9, 10, 19, 21)),
    "colocated_equal": Case(Side(0, (4, 2), ("dp", "tp"), (Shard(0), Replicate())),
                            Side(0, (4, 2), ("dp", "tp"), (Shard(0), Replicate())), (21, H), 0, RAGGED),
}


def _mesh(side: Side) -> DeviceMesh:
    n = 1
    for s in side.shape:
        n *= s
    ranks = torch.arange(side.offset, side.offset + n).reshape(side.shape)
    return DeviceMesh("cpu", ranks, mesh_dim_names=side.names)


def _expected_rows(side: Side, coord, extent, sample_sizes, bounds=None) -> torch.Tensor:
    """Global row ids a rank holds, written from the placements' definition (not the planner)."""
    shard_dims = [i for i, p in enumerate(side.placements) if isinstance(p, Shard)]
    n, idx = 1, 0
    for i in shard_dims:
        n, idx = n * side.shape[i], idx * side.shape[i] + coord[i]
    if bounds is not None:
        return torch.arange(bounds[idx], bounds[idx + 1])
    if sample_sizes is None:
        chunks = torch.chunk(torch.arange(extent), n)
        return chunks[idx] if idx < len(chunks) else torch.arange(0)
    starts = torch.tensor([0, *sample_sizes]).cumsum(0)
    mine = torch.tensor_split(torch.arange(len(sample_sizes)), n)[idx]
    return torch.cat([torch.arange(starts[s], starts[s + 1]) for s in mine.tolist()] + [torch.arange(0)])


def _coord(mesh: DeviceMesh):
    c = mesh.get_coordinate()
    return None if c is None else tuple(c)


def _distinct(side: Side, coord, placements) -> bool:
    """Count a rank's value once: coordinate 0 on every Replicate dim (all members on Partial)."""
    return all(c == 0 for c, p in zip(coord, placements) if isinstance(p, Replicate))


def _run_case(name):
    """Both routes in one spawn: one-hop, then two-hop (scatter, cross, gather)."""
    return all(_run_route(name, n_hops) for n_hops in (1, 2))


def _run_route(name, n_hops, buffers=True, seed=1234, keep=None):
    """One redistribution of case `name`, checked; `keep` (a list) collects (y's local rows, the
    expected values) so a caller can check later calls do not overwrite a live output."""
    case = CASES[name]
    src_mesh, dst_mesh = _mesh(case.src), _mesh(case.dst)
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(case.shape, generator=gen, dtype=torch.float64)
    G_full = torch.randn(case.shape, generator=gen, dtype=torch.float64)
    dim, extent = case.dim, case.shape[case.dim]

    # ---- source: local rows of X (Partial: split X into per-member pieces that sum to X)
    sc = _coord(src_mesh)
    if sc is None:
        x_local = torch.empty(0, dtype=torch.float64, requires_grad=True)
    else:
        rows = _expected_rows(case.src, sc, extent, case.sample_sizes, case.src_bounds)
        x_local = X.index_select(dim, rows)
        for i, p in enumerate(case.src.placements):
            if isinstance(p, Partial):  # member k holds (k+1)/sum(1..n) of the value
                n = case.src.shape[i]
                x_local = x_local * (sc[i] + 1) / (n * (n + 1) / 2)
        x_local = x_local.detach().requires_grad_()
    x = DTensor.from_local(x_local, src_mesh, case.src.placements, run_check=False,
                           shape=X.shape, stride=X.stride())

    grad_placements = case.grad or tuple(Replicate() if isinstance(p, Partial) else p for p in case.dst.placements)
    y = redistribute(x, dst_mesh, case.dst.placements, sample_sizes=case.sample_sizes, shard_bounds=case.src_bounds,
                     grad_placements=case.grad, hops=n_hops, buffers=buffers)
    assert y.device_mesh is dst_mesh and tuple(y.placements) == case.dst.placements
    assert tuple(y.shape) == tuple(X.shape)

    # ---- forward content and the loss <y, g>
    dc = _coord(dst_mesh)
    y_dot_g = torch.zeros((), dtype=torch.float64)
    if dc is None:
        torch.autograd.backward([y], [torch.zeros_like(y)])
    else:
        rows = _expected_rows(case.dst, dc, extent, case.sample_sizes)
        torch.testing.assert_close(y.to_local(), X.index_select(dim, rows), rtol=1e-12, atol=1e-12)
        if keep is not None:
            keep.append((y.to_local(), X.index_select(dim, rows)))
        g_local = G_full.index_select(dim, rows)
        for i, p in enumerate(grad_placements):
            if isinstance(p, Partial):  # each member contributes a different part of G
                n = case.dst.shape[i]
                g_local = g_local * (dc[i] + 1) / (n * (n + 1) / 2)
        if _distinct(case.dst, dc, grad_placements):
            y_dot_g = (y.to_local() * g_local).sum()
        y_local = y.to_local(grad_placements=grad_placements)
        torch.autograd.backward([y_local], [g_local])

    # ---- gradient vs single-process autograd: d<X, G>/dX = G (Partial pieces sum to G)
    x_dot_gx = torch.zeros((), dtype=torch.float64)
    if sc is not None:
        rows = _expected_rows(case.src, sc, extent, case.sample_sizes, case.src_bounds)
        expected = G_full.index_select(dim, rows)
        torch.testing.assert_close(x_local.grad, expected, rtol=1e-12, atol=1e-12)
        if _distinct(case.src, sc, case.src.placements):
            x_dot_gx = (x_local.detach() * x_local.grad).sum()
    sums = torch.stack([y_dot_g, x_dot_gx])
    dist.all_reduce(sums)
    torch.testing.assert_close(sums[0], sums[1], rtol=1e-12, atol=0)
    return True


@pytest.mark.parametrize("name", list(CASES))
def test_redistribute(name):
    assert run_on_ranks(_run_case, WORLD, name, timeout=120) == [True] * WORLD


def _recycled(name):
    """Repeated calls with one `BufferPool`: exact every time, an output kept alive is never
    overwritten, and once every output is dropped the steady state allocates nothing; a
    call with ``buffers=False`` (fresh tensors) is exact too."""
    pool, kept, allocations = BufferPool(), [], []
    for seed in range(4):
        assert _run_route(name, 1, buffers=pool, seed=seed, keep=kept if seed == 0 else None)
        allocations.append(pool.allocations)
    for y_local, expected in kept:  # the first output, alive through three more calls
        torch.testing.assert_close(y_local, expected, rtol=0, atol=0)
    kept.clear()
    assert _run_route(name, 1, buffers=pool, seed=9)
    assert allocations[1] == allocations[2] == allocations[3] == pool.allocations, allocations
    assert _run_route(name, 1, buffers=False, seed=10)
    return True


@pytest.mark.parametrize("name", ["fan_in", "tp_dp_to_tp4", "cp_partial_grad", "colocated_fan_in"])
def test_recycled_buffers(name):
    """Direct receives, staged receives (dim 1), summed Partial gradients, local copies."""
    assert run_on_ranks(_recycled, WORLD, name, timeout=120) == [True] * WORLD


def test_buffer_pool_reuses_a_block_once_no_tensor_holds_it():
    pool = BufferPool(max_blocks=3)
    a = pool.take((3, 5), torch.float32, "cpu")
    assert pool.allocations == 1 and a.shape == (3, 5) and a.is_contiguous()
    b = pool.take((3, 5), torch.float32, "cpu")  # `a` is alive: a second block
    assert pool.allocations == 2 and b.data_ptr() != a.data_ptr()
    view = a[1:]
    del a
    c = pool.take((2, 5), torch.float32, "cpu")  # `view` still holds the first block
    assert pool.allocations == 3
    c_ptr = c.data_ptr()
    del view, b, c
    d = pool.take((5, 2), torch.float32, "cpu", zero=True)  # best fit: the 10-element block
    assert pool.allocations == 3 and d.data_ptr() == c_ptr and torch.equal(d, torch.zeros(5, 2))
    e = pool.take((1000,), torch.float32, "cpu")  # no free block is large enough: one is replaced
    assert pool.allocations == 4 and e.numel() == 1000 and pool.nbytes == 4 * (15 + 1024 + 10)
    assert pool.take((7,), torch.float64, "cpu").dtype == torch.float64  # its own blocks per dtype
    f = pool.take((1000,), torch.float32, "cpu")  # the free 15-element block is replaced
    g = pool.take((3,), torch.float32, "cpu")  # all three in use, max_blocks reached: unpooled
    assert pool.allocations == 6 and f.data_ptr() != e.data_ptr() and g.numel() == 3
    assert pool.nbytes == 4 * (1024 + 1024 + 10) + 8 * 7
    del d, e, f
    h = pool.take((3,), torch.float32, "cpu")  # every free block is over twice the request, the pool is full
    assert pool.allocations == 6 and h.data_ptr() != c_ptr
    assert pool.take((0, 4), torch.float32, "cpu").shape == (0, 4) and pool.allocations == 6  # empty: unpooled
    pool.clear()
    assert pool.nbytes == 0


def test_buffer_pool_keeps_no_block_made_under_inference_mode():
    """A tensor made under ``torch.inference_mode()`` stays an inference tensor: a pooled block
    made by a `redistribute` there would be handed to a later training exchange, which fails on
    the ranks that reuse it (in-place updates of an inference tensor) while their peers wait.
    Under inference mode the pool hands out fresh tensors and keeps none."""
    pool = BufferPool()
    with torch.inference_mode():
        a = pool.take((3, 5), torch.float32, "cpu")
    assert a.is_inference() and pool.allocations == 0
    del a
    b = pool.take((3, 5), torch.float32, "cpu")
    assert not b.is_inference() and pool.allocations == 1


# ---------------------------------------------------------------- errors before communication

def _bad_sample_sizes():
    case = CASES["fan_in"]
    src_mesh, dst_mesh = _mesh(case.src), _mesh(case.dst)
    x = DTensor.from_local(torch.zeros(0, H), src_mesh, case.src.placements, run_check=False,
                           shape=(21, H), stride=(H, 1))
    with pytest.raises(PlanError, match=r"sample_sizes sum to 20 \(8 samples\) but the global extent is 21"):
        redistribute(x, dst_mesh, case.dst.placements, sample_sizes=(3, 0, 5, 2, 0, 4, 1, 5))
    with pytest.raises(PlanError, match=r"sample_sizes\[1\] = -1 is negative"):
        redistribute(x, dst_mesh, case.dst.placements, sample_sizes=(3, -1, 6, 2, 0, 4, 1, 6))
    with pytest.raises(PlanError, match=r"a placement the plan cannot serve"):
        redistribute(x, dst_mesh, (Shard(1),), sample_sizes=RAGGED)
    with pytest.raises(PlanError, match=r"shard_bounds \[0, 9, 5, 21\] must be 5 nondecreasing"):
        redistribute(x, dst_mesh, case.dst.placements, sample_sizes=RAGGED, shard_bounds=(0, 9, 5, 21))
    with pytest.raises(ValueError, match=r"1 tensors, but shard_bounds has 2 entries; give one per tensor"):
        redistribute_many([x], [dst_mesh], [case.dst.placements], shard_bounds=[None, (0, 21)])
    return True


def _bad_local_shape_on_one_rank(check, name="fan_in", n_hops=None, bad=(2,)):
    case = CASES[name]
    src_mesh, dst_mesh = _mesh(case.src), _mesh(case.dst)
    sc = _coord(src_mesh)
    rows = 0 if sc is None else len(_expected_rows(case.src, sc, 21, RAGGED))
    if dist.get_rank() in bad:
        rows += 1  # only these ranks are wrong: nobody may hang
    local = torch.zeros(rows, H) if sc is not None else torch.empty(0)
    x = DTensor.from_local(local, src_mesh, case.src.placements, run_check=False, shape=(21, H), stride=(H, 1))
    try:
        redistribute(x, dst_mesh, case.dst.placements, sample_sizes=RAGGED, check=check, hops=n_hops)
    except PlanError as e:
        return str(e)
    return None


def test_bad_metadata_raises_before_communication():
    assert run_on_ranks(_bad_sample_sizes, WORLD, timeout=60) == [True] * WORLD


def test_wrong_local_shape_fails_on_every_rank_with_a_world_check():
    messages = run_on_ranks(_bad_local_shape_on_one_rank, WORLD, "world", timeout=60)
    assert all(re.search(r"rank\(s\) \[2\] hold a local shard whose shape disagrees with the plan", m or "")
               for m in messages), messages
    # the source's first and last ranks wrong: one all-reduce of three words a spec names both
    messages = run_on_ranks(_bad_local_shape_on_one_rank, WORLD, "world", "fan_in", None, (0, 3), timeout=60)
    assert all(re.search(r"rank\(s\) \[0, \.\.\., 3\] \(the lowest and the highest\) hold a local shard", m or "")
               for m in messages), messages


def test_wrong_local_shape_fails_on_its_rank_and_every_rank_it_sends_to():
    """The default status word: no collective; the ranks that exchange with rank 2 raise."""
    messages = run_on_ranks(_bad_local_shape_on_one_rank, WORLD, True, timeout=60)
    def spec(side: Side) -> MeshSpec:
        ranks = torch.arange(side.offset, side.offset + math.prod(side.shape)).reshape(side.shape).tolist()
        return MeshSpec(ranks, side.placements, sample_sizes=RAGGED)

    case = CASES["fan_in"]
    receivers = {s.peer for s in plan(spec(case.src), spec(case.dst), WORLD).for_rank(2).sends}
    assert receivers, "rank 2 must send to somebody for this test to mean anything"
    for rank, message in enumerate(messages):
        if rank == 2:
            assert re.search(r"rank 2 holds a local shard of shape \(\d+, \d+\) but the plan for "
                             r"MeshSpec\(.*\) expects \(\d+, \d+\)", message or ""), message
        elif rank in receivers:
            assert re.search(r"rank\(s\) \[2\] sent rows of a local shard whose shape disagrees", message or ""), message
        else:
            assert message is None, (rank, message)


def test_wrong_local_shape_two_hop_fails_on_the_replicas_that_gather_its_rows():
    """equal (tp2·dp2 -> tp2·dp2, disjoint), two-hop: rank 2 = (dp1, tp0) sends the first tp-half
    of dp shard 1 to rank 6 = (dp1, tp0) only; rank 7 gathers that half from rank 6."""
    messages = run_on_ranks(_bad_local_shape_on_one_rank, WORLD, True, "equal", 2, timeout=60)
    assert re.search(r"rank 2 holds a local shard of shape", messages[2] or ""), messages[2]
    assert re.search(r"rank\(s\) \[2\] sent rows of a local shard", messages[6] or ""), messages[6]
    assert re.search(r"a rank sent rows of a local shard whose shape disagrees", messages[7] or ""), messages[7]
    assert [messages[r] for r in (0, 1, 3, 4, 5)] == [None] * 5, messages


# ---------------------------------------------------------------- several bridges, one node

AUDIO_SIZES = (2, 2, 0, 2, 2, 0, 2, 2)  # 12 rows


def _two_encoders_share_ranks():
    """vision and audio dp2 on ranks 0-1 both feed a language tp2·dp2 mesh on ranks 2-5.

    Both backward exchanges run between the same rank pairs; one autograd node orders them.
    """
    enc = DeviceMesh("cpu", torch.arange(0, 2), mesh_dim_names=("dp",))
    lang = DeviceMesh("cpu", torch.arange(2, 6).reshape(2, 2), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(7)
    full = {"vision": torch.randn(21, H, generator=gen, dtype=torch.float64),
            "audio": torch.randn(12, H, generator=gen, dtype=torch.float64)}
    grads = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in full.items()}
    sizes = {"vision": RAGGED, "audio": AUDIO_SIZES}
    enc_side = Side(0, (2,), ("dp",), (Shard(0),))
    lang_side = Side(2, (2, 2), ("dp", "tp"), (Shard(0), Replicate()))
    xs, x_locals = [], {}
    for k in ("vision", "audio"):
        ec = _coord(enc)
        if ec is None:
            local = torch.empty(0, dtype=torch.float64)
        else:
            local = full[k].index_select(0, _expected_rows(enc_side, ec, len(full[k]), sizes[k]))
        x_locals[k] = local.detach().requires_grad_()
        xs.append(DTensor.from_local(x_locals[k], enc, (Shard(0),), run_check=False,
                                     shape=full[k].shape, stride=full[k].stride()))
    ys = redistribute_many(xs, [lang, lang], [(Shard(0), Replicate())] * 2,
                           sample_sizes=[sizes["vision"], sizes["audio"]])
    lc = _coord(lang)
    if lc is None:
        torch.autograd.backward(list(ys), [torch.zeros_like(y) for y in ys])
    else:
        locals_, gs = [], []
        for k, y in zip(("vision", "audio"), ys):
            rows = _expected_rows(lang_side, lc, len(full[k]), sizes[k])
            torch.testing.assert_close(y.to_local(), full[k].index_select(0, rows), rtol=0, atol=0)
            locals_.append(y.to_local())
            gs.append(grads[k].index_select(0, rows))
        torch.autograd.backward(locals_, gs)
    if _coord(enc) is not None:
        for k in ("vision", "audio"):
            rows = _expected_rows(enc_side, _coord(enc), len(full[k]), sizes[k])
            torch.testing.assert_close(x_locals[k].grad, grads[k].index_select(0, rows), rtol=0, atol=0)
    return True


def test_two_bridges_sharing_ranks_in_one_node():
    assert run_on_ranks(_two_encoders_share_ranks, 6, timeout=60) == [True] * 6


# ---------------------------------------------------------------- split-phase Bridge (pipeline runtime)

def _run_bridge(name, n_hops=None):
    """`Bridge` on local tensors: each side posts its half; same content and gradients as above."""
    case = CASES[name]
    src_mesh, dst_mesh = _mesh(case.src), _mesh(case.dst)
    gen = torch.Generator().manual_seed(99)
    X = torch.randn(case.shape, generator=gen, dtype=torch.float64)
    G = torch.randn(case.shape, generator=gen, dtype=torch.float64)
    dim, extent = case.dim, case.shape[case.dim]
    bridge = Bridge(src_mesh, case.src.placements, dst_mesh, case.dst.placements, global_shape=X.shape,
                    dtype=X.dtype, sample_sizes=case.sample_sizes, grad_placements=case.grad, hops=n_hops)
    if n_hops == 2:  # replicated destinations (and a Partial gradient): the route splits, as asked
        assert bool(bridge.forward_route.gather) == (_coord(dst_mesh) is not None)
        partial = any(isinstance(p, Partial) for p in case.grad or ())
        reduces = any(level.partial for level in bridge.backward_route.scatter)  # a reduce-scatter
        assert reduces == (partial and _coord(dst_mesh) is not None)
    sc, dc = _coord(src_mesh), _coord(dst_mesh)
    src_rows = None if sc is None else _expected_rows(case.src, sc, extent, case.sample_sizes)
    dst_rows = None if dc is None else _expected_rows(case.dst, dc, extent, case.sample_sizes)
    x_local = None if sc is None else X.index_select(dim, src_rows)

    sent = bridge.send_forward(x_local) if sc is not None else None
    if sc is not None and dc is not None:  # on both meshes: a second exchange before this one's receive
        with pytest.raises(RuntimeError, match="send_forward called twice on rank"):
            bridge.send_forward(x_local)
    received = bridge.recv_forward(x_local) if dc is not None else None
    if sent is not None and received is not None:  # on both meshes: one batch, one handle
        assert sent is received
    y_local = received.wait() if received is not None else None
    if sent is not None and received is None:
        assert sent.wait() is None  # a send-only handle has no output
    if dc is not None:
        torch.testing.assert_close(y_local, X.index_select(dim, dst_rows), rtol=0, atol=0)

    g_local = None
    if dc is not None:
        g_local = G.index_select(dim, dst_rows)
        for i, p in enumerate(case.grad or ()):
            if isinstance(p, Partial):  # member k holds (k+1)/sum(1..n) of the gradient
                n = case.dst.shape[i]
                g_local = g_local * (dc[i] + 1) / (n * (n + 1) / 2)
    sent = bridge.send_backward(g_local) if dc is not None else None
    received = bridge.recv_backward(g_local) if sc is not None else None
    if sent is not None and received is not None:
        assert sent is received
    gx = received.wait() if received is not None else None
    if sent is not None:
        sent.wait()
    if sc is not None:
        torch.testing.assert_close(gx, G.index_select(dim, src_rows), rtol=1e-12, atol=1e-12)
    return True


@pytest.mark.parametrize("name,n_hops", [("fan_in", None), ("tp_dp_to_tp4", None), ("cp_partial_grad", None),
                                         ("colocated_fan_in", None), ("tp_dp_to_tp4", 2), ("cp_partial_grad", 2)])
def test_bridge_split_phase(name, n_hops):
    assert run_on_ranks(_run_bridge, WORLD, name, n_hops, timeout=120) == [True] * WORLD


# ---------------------------------------------------------------- summed Partial pieces: replicas agree

def _partial_sums_agree_on_every_replica(n_hops):
    """A Partial source of 4 contributors summed onto replicas that hold some of the pieces themselves
    (colocated): every replica must hold the same bits, as DTensor's all-reduce gives; forward (a
    Partial source) and backward (a gradient declared Partial) alike. float32 sums depend on their
    order, so a replica adding its own piece first and the others after would hold other bits."""
    parts_mesh = DeviceMesh("cpu", torch.arange(4), mesh_dim_names=("cp",))
    rep_mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(3)
    scale = 10.0 ** torch.randint(-3, 4, (4, 256, 1), generator=gen)
    parts, grads = torch.randn(4, 256, 2, generator=gen) * scale, torch.randn(4, 256, 2, generator=gen) * scale
    rank = dist.get_rank()
    x_local = parts[rank].clone().requires_grad_()
    x = DTensor.from_local(x_local, parts_mesh, (Partial(),), run_check=False, shape=(256, 2), stride=(2, 1))
    y = redistribute(x, rep_mesh, (Replicate(), Replicate()), grad_placements=(Partial(), Partial()), hops=n_hops)
    y_local = y.to_local(grad_placements=(Partial(), Partial()))
    torch.autograd.backward([y_local], [grads[rank]])
    values = [torch.empty(256, 2) for _ in range(4)]
    dist.all_gather(values, y_local.detach().contiguous())
    gathered = [torch.empty(256, 2) for _ in range(4)]
    dist.all_gather(gathered, x_local.grad.contiguous())
    torch.testing.assert_close(values[0], parts.double().sum(0).float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gathered[0], grads.double().sum(0).float(), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(values[0], v) for v in values), "replicas of a Replicate output differ"
    assert all(torch.equal(gathered[0], g) for g in gathered), "replicas of a Replicate gradient differ"
    return True


@pytest.mark.parametrize("n_hops", [1, 2])
def test_partial_sums_agree_on_every_replica(n_hops):
    assert run_on_ranks(_partial_sums_agree_on_every_replica, 4, n_hops, timeout=60) == [True] * 4


# ---------------------------------------------------------------- a 0-d tensor (a loss, a scale)

def _scalar_crosses(n_hops):
    """A 0-d DTensor crosses to another mesh, as DTensor's own redistribute allows on one mesh: the
    value arrives on every rank of the destination, the gradient comes back to every source replica.
    (`distribute_tensor`: `from_local` on a rank off the mesh ignores ``shape=()``.)"""
    src = DeviceMesh("cpu", torch.arange(0, 2), mesh_dim_names=("tp",))
    dst = DeviceMesh("cpu", torch.arange(2, 6).reshape(2, 2), mesh_dim_names=("dp", "tp"))
    x = distribute_tensor(torch.tensor(1.25, dtype=torch.float64, requires_grad=True), src, (Replicate(),))
    y = redistribute(x, dst, (Replicate(), Replicate()), hops=n_hops)
    assert y.shape == () and tuple(y.placements) == (Replicate(), Replicate())
    if dist.get_rank() < 2:
        torch.autograd.backward([y], [torch.zeros_like(y)])
        assert x.grad.shape == () and x.grad.to_local().item() == 3.0, x.grad
    else:
        assert y.to_local().shape == () and y.to_local().item() == 1.25, y.to_local()
        torch.autograd.backward([y.to_local()], [torch.tensor(3.0, dtype=torch.float64)])
    return True


@pytest.mark.parametrize("n_hops", [1, 2])
def test_scalar_crosses_meshes(n_hops):
    assert run_on_ranks(_scalar_crosses, 6, n_hops, timeout=60) == [True] * 6


# ---------------------------------------------------------------- a Shard dim counted from the end

def _negative_shard_dim():
    """``Shard(-1)`` names the last dim, as in `DTensor.redistribute`: rows of dim 1 of a [3, 8] tensor."""
    src = DeviceMesh("cpu", torch.arange(0, 2), mesh_dim_names=("dp",))
    dst = DeviceMesh("cpu", torch.arange(2, 6), mesh_dim_names=("dp",))
    X = torch.arange(24, dtype=torch.float64).reshape(3, 8)
    x = distribute_tensor(X.clone().requires_grad_(), src, (Shard(1),))
    y = redistribute(x, dst, (Shard(-1),), grad_placements=(Shard(-1),))
    assert tuple(y.placements) == (Shard(1),), y.placements
    rank = dist.get_rank()
    if rank < 2:
        torch.autograd.backward([y], [torch.zeros_like(y)])
        torch.testing.assert_close(x.grad.to_local(), 2 * X[:, 4 * rank:4 * rank + 4], rtol=0, atol=0)
    else:
        k = rank - 2
        torch.testing.assert_close(y.to_local(), X[:, 2 * k:2 * k + 2], rtol=0, atol=0)
        torch.autograd.backward([y.to_local()], [2 * X[:, 2 * k:2 * k + 2]])
    return True


def test_negative_shard_dim():
    assert run_on_ranks(_negative_shard_dim, 6, timeout=60) == [True] * 6


# ---------------------------------------------------------------- a gradient arriving in other placements

def _gradient_arrives_replicated_where_partial_is_declared(n_hops):
    """``grad_placements=(Partial(),)`` declared over cp, but the gradient arrives as a DTensor with
    y's own placements (``y.to_local()`` without ``grad_placements``): "a gradient arriving with other
    placements is first redistributed to these". A replicated gradient is the whole gradient on
    every replica, so it counts once (DTensor's convention for Replicate): x.grad == G, on every
    rank, and no rank is left waiting in the exchange."""
    src = DeviceMesh("cpu", torch.arange(0, 1), mesh_dim_names=("dp",))
    dst = DeviceMesh("cpu", torch.arange(1, 3), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(5)
    X = torch.randn(5, H, generator=gen, dtype=torch.float64)
    G = torch.randn(5, H, generator=gen, dtype=torch.float64)
    x_local = X.clone().requires_grad_() if dist.get_rank() == 0 else torch.empty(0, dtype=torch.float64,
                                                                                  requires_grad=True)
    x = DTensor.from_local(x_local, src, (Shard(0),), run_check=False, shape=X.shape, stride=X.stride())
    y = redistribute(x, dst, (Replicate(),), grad_placements=(Partial(),), hops=n_hops)
    if dist.get_rank() == 0:
        torch.autograd.backward([y], [torch.zeros_like(y)])
        torch.testing.assert_close(x_local.grad, G, rtol=1e-12, atol=1e-12)
    else:
        torch.testing.assert_close(y.to_local(), X, rtol=0, atol=0)
        torch.autograd.backward([y.to_local()], [G])  # y's own placements: Replicate
    return True


@pytest.mark.parametrize("n_hops", [1, 2])
def test_a_replicated_gradient_where_partial_is_declared_counts_once(n_hops):
    assert run_on_ranks(_gradient_arrives_replicated_where_partial_is_declared, 3, n_hops,
                        timeout=40) == [True] * 3


# ---------------------------------------------------------------- meshes whose ranks are not in ascending order

def _shuffled_meshes(n_hops):
    """Meshes built over ranks in another order than ascending (``DeviceMesh("cpu", [2, 3, 1])``):
    the mesh coordinate, not the process group's rank order, says which rows a rank holds. A
    Partial source (reduce-scattered before it crosses, two-hop) and a Replicate destination
    (all-gathered after it crosses): values and gradients against the full tensors."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(3)
    X = torch.randn(10, H, generator=gen, dtype=torch.float64)
    G = torch.randn(10, H, generator=gen, dtype=torch.float64)
    # Partial over [2, 3, 1] (member k holds (k + 1) / 6 of X) -> rank 0
    src = DeviceMesh("cpu", torch.tensor([2, 3, 1]), mesh_dim_names=("tp",))
    one = DeviceMesh("cpu", torch.tensor([0]), mesh_dim_names=("dp",))
    c = src.get_coordinate()
    x_local = (X * (c[0] + 1) / 6 if c is not None else torch.empty(0, dtype=torch.float64)).requires_grad_()
    x = DTensor.from_local(x_local, src, (Partial(),), run_check=False, shape=X.shape, stride=X.stride())
    y = redistribute(x, one, (Shard(0),), hops=n_hops)
    if rank == 0:
        torch.testing.assert_close(y.to_local(), X, rtol=1e-12, atol=1e-12)
        torch.autograd.backward([y.to_local()], [G])
    else:
        torch.autograd.backward([y], [torch.zeros_like(y)])
        torch.testing.assert_close(x_local.grad, G, rtol=1e-12, atol=1e-12)  # Partial: each member's is G
    # rank 0 -> Replicate over [3, 1, 2]: every member holds X; the gradient counts once
    rep = DeviceMesh("cpu", torch.tensor([3, 1, 2]), mesh_dim_names=("cp",))
    x_local = (X.clone() if rank == 0 else torch.empty(0, dtype=torch.float64)).requires_grad_()
    x = DTensor.from_local(x_local, one, (Shard(0),), run_check=False, shape=X.shape, stride=X.stride())
    y = redistribute(x, rep, (Replicate(),), grad_placements=(Partial(),), hops=n_hops)
    if rank == 0:
        torch.autograd.backward([y], [torch.zeros_like(y)])
        torch.testing.assert_close(x_local.grad, G, rtol=1e-12, atol=1e-12)
    else:
        torch.testing.assert_close(y.to_local(), X, rtol=0, atol=0)
        k = rep.get_coordinate()[0]  # Partial gradient: member k holds (k + 1) / 6 of G
        torch.autograd.backward([y.to_local(grad_placements=(Partial(),))], [G * (k + 1) / 6])
    return True


@pytest.mark.parametrize("n_hops", [1, 2])
def test_meshes_over_ranks_out_of_order(n_hops):
    assert run_on_ranks(_shuffled_meshes, 4, n_hops, timeout=60) == [True] * 4


def _bridge_casts_locals_to_its_dtype(n_hops):
    """A bf16 `Bridge` given fp32 locals (rows, and the gradient the destination computed in fp32):
    they cross as bf16, as autograd casts a gradient to its tensor's dtype. Before, the receivers
    got a message twice the size of their buffers and gloo aborted them (naming nothing)."""
    rank = dist.get_rank()
    X = torch.arange(12, dtype=torch.float32).reshape(4, H)  # exact in bf16
    G = -2 * X
    src = DeviceMesh("cpu", torch.tensor([1, 0]), mesh_dim_names=("dp",))
    dst = DeviceMesh("cpu", torch.tensor([[3, 2]]), mesh_dim_names=("dp", "tp"))  # replicated: two hops split
    bridge = Bridge(src, (Shard(0),), dst, (Shard(0), Replicate()), global_shape=X.shape, dtype=torch.bfloat16,
                    hops=n_hops)
    sc = _coord(src)
    if sc is not None:
        rows = X[2 * sc[0]: 2 * sc[0] + 2]
        assert bridge.send_forward(rows).wait() is None
        gx = bridge.recv_backward().wait()
        assert gx.dtype == torch.bfloat16
        torch.testing.assert_close(gx, G[2 * sc[0]: 2 * sc[0] + 2].bfloat16(), rtol=0, atol=0)
    else:
        y = bridge.recv_forward().wait()
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y, X.bfloat16(), rtol=0, atol=0)
        bridge.send_backward(G.clone()).wait()  # an fp32 gradient of the bf16 rows
    return rank


@pytest.mark.parametrize("n_hops", [1, 2])
def test_bridge_casts_fp32_locals_to_its_dtype(n_hops):
    assert run_on_ranks(_bridge_casts_locals_to_its_dtype, 4, n_hops, timeout=60) == [0, 1, 2, 3]
