"""Specification of the bridge planner, `dtensor_mimo.bridge.plan` (pure: no process group).

Every plan is checked against an independent reference, and every rank's part computed alone
(`plan_for_rank`, the bridge's O(peers) path) must equal its part of the whole-world `plan`: each side's rank -> global rows is
built naively (itertools.product over mesh coordinates, `torch.chunk` / `torch.tensor_split`),
then the plan is executed on integer "tensors" (source rank r holds the value of each of its
rows, split into partial contributions that sum to the value when the source is Partial), and
every destination rank must end with exactly its rows: written once, or summed from every
Partial contributor once; zeros on non-receiving members of a destination Partial group.

Layouts covered (meshes listed outermost dim first; S = Shard(0), R = Replicate(), P = Partial()):

| case                       | source                  | destination                        | ranks                       | rows                |
|----------------------------|-------------------------|------------------------------------|-----------------------------|---------------------|
| fan-in                     | dp4 (S)                 | dp1 (S)                            | disjoint, colocated         | chunk, 10           |
| fan-out                    | dp1 (S)                 | dp4 (S)                            | disjoint, colocated         | chunk, 10           |
| dp3 -> dp2, hand-computed  | dp3 (S)                 | dp2 (S)                            | disjoint                    | samples [1,2,3,4,5] |
| dp5 -> dp3                 | dp5 (S)                 | dp3 (S)                            | disjoint, overlapping       | chunk, samples      |
| replicas share the sends   | dp2·tp2 (S,R)           | dp1·tp4 (S,R)                      | disjoint, colocated         | chunk, 8            |
| ragged, zero-size samples  | dp3 (S), dp2 (S)        | dp2·tp2 (S,R), dp3 (S)             | disjoint                    | samples with zeros  |
| Partial source             | 2·2 (P,S)               | dp2 (S)                            | disjoint                    | chunk, 7            |
| Partial destination        | dp2 (S)                 | 1·2 (S,P)                          | disjoint                    | chunk, 6            |
| backward, Partial over cp  | dp2 (S)                 | cp2·tp2 (R,R), grad (P,R) / (P,P)  | disjoint                    | chunk, 9            |
| backward, fan-in with cp   | dp4 (S)                 | dp2·cp2·tp2 (S,R,R), grad (S,P,R)  | overlapping                 | samples with zeros  |
| backward, Partial source   | 2·2 (P,S) -> grad (R,S) | dp2 (S), grad (S)                  | disjoint                    | chunk, 6            |
| chunk rule == DTensor      | 1-3 d meshes, nested S  | —                                  | —                           | 0..13               |
| property (hypothesis)      | any ≤16 ranks, S/R/P    | any ≤16 ranks, S/R/P               | disjoint, overlapping, identical, shuffled, idle ranks | chunk or ragged |
| property, backward         | same                    | same, random grad placements       | same                        | same                |
| property, split dims       | same, random split_dims | same, random split_dims            | same                        | same                |
| cache, determinism, idle ranks, validation errors (each message asserted), `replace`, two-hop choice and hop rows             |
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import dataclass
from math import prod

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from dtensor_mimo.bridge import MeshSpec, PlanError, backward_specs, hop_rows, plan, plan_backward, plan_for_rank
from dtensor_mimo.bridge.hops import check_hops, default_hops, wants_two_hops

S, R, P = Shard(0), Replicate(), Partial()


# ------------------------------------------------------------------ reference


@dataclass
class Held:
    rows: list[int]  # global rows, in local order
    part: int  # label of the rank's Partial contribution (0 when no Partial dim)
    needs: bool  # holds the value (not a zero share of a Partial group)
    group: tuple  # ranks with equal group hold identical data (replicas)


def grid(shape, ranks):
    return torch.tensor(list(ranks)).reshape(shape).tolist()


def reference(shape, ranks, placements, extent, sample_sizes=None, split=()) -> dict[int, Held]:
    """rank -> what it holds, built without the planner's code."""
    ranks = list(ranks)
    shard_dims = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    part_dims = [i for i, p in enumerate(placements) if isinstance(p, Partial) and i not in split]
    n_shards = prod(shape[i] for i in shard_dims)
    starts = [sum(sample_sizes[:k]) for k in range(len(sample_sizes) + 1)] if sample_sizes is not None else None
    held = {}
    for r, coord in zip(ranks, itertools.product(*map(range, shape))):
        shard = 0
        for i in shard_dims:
            shard = shard * shape[i] + coord[i]
        part = 0
        for i in part_dims:
            part = part * shape[i] + coord[i]
        if sample_sizes is None:
            rows = torch.arange(extent)
            for i in shard_dims:
                chunks = torch.chunk(rows, shape[i])
                rows = chunks[coord[i]] if coord[i] < len(chunks) else rows[:0]
            rows = rows.tolist()
        else:
            samples = torch.tensor_split(torch.arange(len(sample_sizes)), n_shards)[shard].tolist()
            rows = [g for k in samples for g in range(starts[k], starts[k + 1])]
        for i in sorted(split):  # split dims chunk the shard's rows further, nested in mesh order
            chunks = torch.chunk(torch.tensor(rows, dtype=torch.long), shape[i])
            rows = chunks[coord[i]].tolist() if coord[i] < len(chunks) else []
        needs = all(coord[i] == 0 for i in part_dims)
        held[r] = Held(rows, part, needs, (shard, tuple(coord[i] for i in sorted(split)), part))
    return held


def value(g):
    return 7919 * g + 13


def contribution(g, part, n_parts):
    """Partial shares of row g: distinct, non-trivial, summing to value(g) over the parts."""
    share = [((g * 31 + k * 17) % 97 + 1) * (k + 1) for k in range(n_parts - 1)]
    share.append(-sum(share))
    return share[part] + (value(g) if part == 0 else 0)


def execute(p, src_ref: dict[int, Held], dst_ref: dict[int, Held], world: int):
    """Run the plan on integer tensors; assert every rank ends with exactly its rows."""
    n_parts = len({h.part for h in src_ref.values()})
    views = {r: p.for_rank(r) for r in range(world)}
    for r, v in views.items():  # the incremental path: each rank's part from its peers alone
        assert plan_for_rank(p.src, p.dst, r, world) == v, f"rank {r}: plan_for_rank differs from plan"
    local = {r: [contribution(g, h.part, n_parts) for g in h.rows] for r, h in src_ref.items()}
    sends = {}
    for r, v in views.items():
        assert v.src_rows == len(src_ref[r].rows if r in src_ref else [])
        assert v.dst_rows == len(dst_ref[r].rows if r in dst_ref else [])
        peers = [m.peer for m in v.sends]
        assert len(set(peers)) == len(peers), f"rank {r}: two messages to one peer"
        assert r not in peers
        peers = [m.peer for m in v.recvs]
        assert len(set(peers)) == len(peers), f"rank {r}: two messages from one peer"
        assert peers == sorted(peers) and r not in peers
        for m in v.sends:
            assert 0 <= m.lo < m.hi <= v.src_rows, "empty or out-of-range send"
            sends[(r, m.peer)] = m
        if v.copies:
            assert r in src_ref and r in dst_ref
    recv_pairs = {(m.peer, r) for r, v in views.items() for m in v.recvs}
    assert recv_pairs == set(sends), "sends and receives do not match"

    for d, v in views.items():
        out, count = [0] * v.dst_rows, [0] * v.dst_rows
        for c in v.copies:
            assert 0 <= c.dst_lo < c.dst_hi <= v.dst_rows and c.src_hi - c.src_lo == c.dst_hi - c.dst_lo
            for k in range(c.dst_hi - c.dst_lo):
                out[c.dst_lo + k] += local[d][c.src_lo + k]
                count[c.dst_lo + k] += 1
        for m in v.recvs:
            s = sends[(m.peer, d)]
            assert 0 <= m.lo < m.hi <= v.dst_rows and m.hi - m.lo == s.hi - s.lo
            for k in range(m.hi - m.lo):
                out[m.lo + k] += local[m.peer][s.lo + k]
                count[m.lo + k] += 1
        for lo, hi in v.zero_fill:
            for k in range(lo, hi):
                count[k] += 1
        if v.reduce:  # every row's contributions are added in the source's Partial order, copied or received
            pieces = [(c.dst_lo, c.dst_hi, src_ref[d].part) for c in v.copies]
            pieces += [(m.lo, m.hi, src_ref[m.peer].part) for m in v.recvs]
            assert sorted(v.sum_order) == list(range(len(pieces))), f"rank {d}: sum_order {v.sum_order}"
            parts: dict[int, list[int]] = {}
            for i in v.sum_order:
                lo, hi, part = pieces[i]
                for k in range(lo, hi):
                    parts.setdefault(k, []).append(part)
            assert all(p == sorted(p) for p in parts.values()), f"rank {d} sums out of Partial order: {parts}"
        else:
            assert v.sum_order == ()
        if d not in dst_ref:
            assert not (v.recvs or v.copies or v.zero_fill)
            continue
        h = dst_ref[d]
        if h.needs:
            assert out == [value(g) for g in h.rows], f"rank {d} holds wrong rows"
            assert count == [n_parts] * len(h.rows), f"rank {d}: a row did not arrive once per contributor"
            assert v.reduce == (n_parts > 1) and not v.zero_fill
        else:
            assert not (v.recvs or v.copies) and out == [0] * len(h.rows)
            assert count == [1] * len(h.rows)
    return views


def check_spread(views, src_ref: dict[int, Held], dst_ref: dict[int, Held]):
    """Replicas share the sends (by row position: within 2 pieces per receiver of a destination
    shard of each other) and a receiver that is a replica copies locally."""
    groups: dict[tuple, list[int]] = {}
    for r, h in src_ref.items():
        groups.setdefault(h.group, []).append(r)
    for members in groups.values():
        pieces = [(r, m.hi - m.lo) for r in members for m in views[r].sends]
        if len(members) < 2 or not pieces or any(views[r].copies for r in members):
            continue  # (a replica that copies its rows locally sends less: no bound then)
        load = {r: sum(n for q, n in pieces if q == r) for r in members}
        receivers = max(Counter(h.group for h in dst_ref.values() if h.needs).values())
        assert max(load.values()) - min(load.values()) <= 2 * receivers * max(n for _, n in pieces), load
    for d, h in dst_ref.items():
        copied = sum(c.dst_hi - c.dst_lo for c in views[d].copies)
        own = set(src_ref[d].rows) & set(h.rows) if d in src_ref and h.needs else set()
        assert copied == len(own), f"rank {d} should copy its own {len(own)} rows locally"


def side(shape, ranks, placements, extent=None, sizes=None, name="", split=()):
    spec = MeshSpec(grid(shape, ranks), tuple(placements), extent, None if sizes is None else tuple(sizes), name,
                    split_dims=tuple(split))
    ref = reference(shape, ranks, placements, spec.extent, sizes, split)
    return spec, ref


def run(src, dst, world=None):
    (s, sref), (d, dref) = src, dst
    p = plan(s, d, world)
    views = execute(p, sref, dref, p.world_size)
    check_spread(views, sref, dref)
    return p, views


# --------------------------------------------------------------- named layouts


@pytest.mark.parametrize("dst_ranks", [[4], [0]], ids=["disjoint", "colocated"])
def test_fan_in_dp4_to_dp1(dst_ranks):
    p, v = run(side((4,), range(4), [S], 10), side((1,), dst_ranks, [S], 10))
    d = dst_ranks[0]
    got = [(m.peer, m.lo, m.hi) for m in v[d].recvs] + [("copy", c.dst_lo, c.dst_hi) for c in v[d].copies]
    expected = [(0, 0, 3), (1, 3, 6), (2, 6, 9), (3, 9, 10)]
    if d == 0:
        expected[0] = ("copy", 0, 3)
    assert sorted(got, key=lambda x: x[1]) == expected


@pytest.mark.parametrize("dst_ranks", [[1, 2, 3, 4], [0, 1, 2, 3]], ids=["disjoint", "colocated"])
def test_fan_out_dp1_to_dp4(dst_ranks):
    p, v = run(side((1,), [0], [S], 10), side((4,), dst_ranks, [S], 10))
    assert [(m.peer, m.lo, m.hi) for m in v[0].sends] == [(r, lo, hi) for r, lo, hi in
                                                          zip(dst_ranks, (0, 3, 6, 9), (3, 6, 9, 10)) if r != 0]
    assert v[0].copies == (((0, 3, 0, 3),) if dst_ranks[0] == 0 else ())


def test_dp3_to_dp2_samples_hand_computed():
    # 5 samples of 1..5 rows: dp3 takes samples [0,1] [2,3] [4] = rows [0,3) [3,10) [10,15);
    # dp2 takes samples [0,1,2] [3,4] = rows [0,6) [6,15).
    sizes = [1, 2, 3, 4, 5]
    p, v = run(side((3,), [0, 1, 2], [S], sizes=sizes), side((2,), [3, 4], [S], sizes=sizes))
    assert [v[r].src_rows for r in range(3)] == [3, 7, 5] and [v[r].dst_rows for r in (3, 4)] == [6, 9]
    assert v[0].sends == ((3, 0, 3),)
    assert v[1].sends == ((3, 0, 3), (4, 3, 7))
    assert v[2].sends == ((4, 0, 5),)
    assert v[3].recvs == ((0, 0, 3), (1, 3, 6)) and v[4].recvs == ((1, 0, 4), (2, 4, 9))


@pytest.mark.parametrize("sizes", [None, [3, 0, 1, 4, 2]], ids=["chunk", "samples"])
@pytest.mark.parametrize("offset", [5, 2], ids=["disjoint", "overlapping"])
def test_dp5_to_dp3(sizes, offset):
    run(side((5,), range(5), [S], 10, sizes), side((3,), range(offset, offset + 3), [S], 10, sizes))


def test_replicas_share_the_sends_disjoint():
    # dp2·tp2 -> dp1·tp4: each source shard has 2 tp replicas and 4 receivers: 2 sends each.
    p, v = run(side((2, 2), range(4), [S, R], 8), side((1, 4), range(4, 8), [S, R], 8))
    assert [len(v[r].sends) for r in range(4)] == [2, 2, 2, 2]
    assert {m.peer for m in v[0].sends} | {m.peer for m in v[1].sends} == {4, 5, 6, 7}


def test_replicas_share_the_sends_colocated():
    # Same ranks: each rank copies its own shard; the other shard's 2 receivers are served
    # one by each of its 2 replicas.
    p, v = run(side((2, 2), range(4), [S, R], 8), side((1, 4), range(4), [S, R], 8))
    assert all(len(v[r].copies) == 1 and len(v[r].sends) == 1 and len(v[r].recvs) == 1 for r in range(4))
    assert p.num_copies == 4 and p.num_messages == 4


def test_ragged_with_zero_size_samples():
    sizes = [0, 3, 0, 0, 2, 0, 5]
    p, v = run(side((3,), [0, 1, 2], [S], sizes=sizes), side((2, 2), [3, 4, 5, 6], [S, R], sizes=sizes))
    # dp3 samples [0,1,2] [3,4] [5,6] -> 3, 2, 5 rows; dp2 samples [0..3] [4..6] -> 3, 7 rows
    assert [v[r].src_rows for r in range(3)] == [3, 2, 5] and [v[r].dst_rows for r in (3, 4, 5, 6)] == [3, 3, 7, 7]
    all_zero = side((2,), [0, 1], [S], sizes=[0, 0, 0]), side((3,), [2, 3, 4], [S], sizes=[0, 0, 0])
    assert run(*all_zero)[0].num_messages == 0


def test_partial_source_is_summed_once_per_contributor():
    p, v = run(side((2, 2), range(4), [P, S], 7), side((2,), [4, 5], [S], 7))
    assert p.reduce and v[4].reduce and [m.peer for m in v[4].recvs] == [0, 2]


def test_partial_destination_feeds_coordinate_zero_only():
    p, v = run(side((2,), [0, 1], [S], 6), side((1, 2), [2, 3], [S, P], 6))
    assert v[3].zero_fill == ((0, 6),) and not v[3].recvs and not v[2].zero_fill


@pytest.mark.parametrize("grad", [(P, R), (P, P)], ids=["cp-partial", "cp-tp-partial"])
def test_backward_partial_gradient_over_cp(grad):
    # forward: dp2 -> cp2·tp2 replicated; the gradient is Partial over cp (and tp): every
    # source row receives the sum of one piece per Partial member, from one tp replica each.
    src, sref = side((2,), [0, 1], [S], 9)
    dst, _ = side((2, 2), [2, 3, 4, 5], [R, R], 9)
    gsrc, gdst = backward_specs(src, dst, grad)
    assert gsrc.placements == grad and gdst.placements == (S,)
    p = plan_backward(src, dst, grad)
    views = execute(p, reference((2, 2), [2, 3, 4, 5], grad, 9), sref, 6)
    n_contrib = 2 if grad == (P, R) else 4
    assert all(views[r].reduce and len(views[r].recvs) == n_contrib for r in (0, 1))


def test_backward_fan_in_with_cp_overlapping():
    # forward: dp4 (ranks 0..3) -> dp2·cp2·tp2 (ranks 2..9); the gradient is Shard over dp,
    # Partial over cp, Replicate over tp, and lands on dp4.
    sizes = [2, 0, 3, 1, 4, 1, 2]
    src, sref = side((4,), range(4), [S], sizes=sizes)
    dst, dref = side((2, 2, 2), range(2, 10), [S, R, R], sizes=sizes)
    run((src, sref), (dst, dref))
    grad = (S, P, R)
    gref = reference((2, 2, 2), range(2, 10), grad, sum(sizes), sizes)
    views = execute(plan_backward(src, dst, grad), gref, sref, 10)
    check_spread(views, gref, sref)


def test_backward_of_partial_source_reaches_every_replica():
    src, sref = side((2, 2), range(4), [P, S], 6)
    dst, _ = side((2,), [4, 5], [S], 6)
    _, gdst = backward_specs(src, dst, (S,))
    assert gdst.placements == (R, S)
    views = execute(plan_backward(src, dst, (S,)), reference((2,), [4, 5], (S,), 6),
                    reference((2, 2), range(4), (R, S), 6), 6)
    assert all(views[r].dst_rows == 3 for r in range(4))


# ------------------------------------------------------------ chunk == DTensor


@pytest.mark.parametrize(
    "shape,placements",
    [((4,), [S]), ((3,), [S]), ((2, 3), [S, S]), ((3, 2), [S, R]), ((2, 3), [R, S]),
     ((2, 2, 3), [S, P, S]), ((3, 2, 2), [S, S, S]), ((2, 2), [R, P])],
)
def test_chunk_rule_matches_dtensor_local_shapes(shape, placements):
    ranks = list(range(prod(shape)))
    for extent in range(14):
        spec = MeshSpec(grid(shape, ranks), tuple(placements), extent)
        for r, coord in zip(ranks, itertools.product(*map(range, shape))):
            local, offset = _compute_local_shape_and_global_offset((extent, 3), shape, list(coord), placements)
            lo, hi = spec.local_range(r)
            assert (hi - lo, lo) == (local[0], offset[0]), (shape, placements, extent, coord)


# --------------------------------------------------------------- properties


@st.composite
def mesh_side(draw, shard):
    ndim = draw(st.integers(1, 3))
    shape, budget = [], 16
    for _ in range(ndim):
        n = draw(st.integers(1, min(4, budget)))
        shape.append(n)
        budget //= n
    placements = [draw(st.sampled_from([shard, R, P])) for _ in shape]
    return tuple(shape), placements


@st.composite
def layouts(draw):
    shard = Shard(draw(st.sampled_from([0, 1])))
    (s_shape, s_pl), (d_shape, d_pl) = draw(mesh_side(shard)), draw(mesh_side(shard))
    n_src, n_dst = prod(s_shape), prod(d_shape)
    mode = draw(st.sampled_from(["disjoint", "overlapping", "identical"]))
    src_ranks = list(range(n_src))
    start = {"disjoint": n_src, "overlapping": draw(st.integers(0, n_src)), "identical": 0}[mode]
    dst_ranks = list(range(start, start + n_dst))
    if draw(st.booleans()):
        src_ranks = draw(st.permutations(src_ranks))
    if draw(st.booleans()):
        dst_ranks = draw(st.permutations(dst_ranks))
    if draw(st.booleans()):
        sizes = draw(st.lists(st.integers(0, 4), max_size=12))
        extent = sum(sizes)
        s_sizes = sizes if draw(st.booleans()) else None
        d_sizes = sizes if draw(st.booleans()) else None
    else:
        extent, s_sizes, d_sizes = draw(st.integers(0, 25)), None, None
    idle = draw(st.integers(0, 2))  # world ranks in neither mesh
    world = max(src_ranks + dst_ranks) + 1 + idle
    return (s_shape, src_ranks, s_pl, extent, s_sizes), (d_shape, dst_ranks, d_pl, extent, d_sizes), world


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(layouts())
def test_property_forward_matches_reference(case):
    src, dst, world = case
    p, _ = run(side(*src), side(*dst), world)
    assert p.world_size == world


def split_dims(data, placements):
    """A random subset of the Replicate/Partial mesh dims (the two-hop intermediate layout)."""
    return tuple(i for i, p in enumerate(placements) if not isinstance(p, Shard) and data.draw(st.booleans()))


@SETTINGS
@given(layouts(), st.data())
def test_property_split_dims_match_reference(case, data):
    src, dst, world = case
    s_split, d_split = split_dims(data, src[2]), split_dims(data, dst[2])
    run(side(*src, split=s_split), side(*dst, split=d_split), world)


@SETTINGS
@given(layouts(), st.data())
def test_property_backward_matches_reference(case, data):
    src, dst, world = case
    (s, _), (d, _) = side(*src), side(*dst)
    shard = next((x for x in list(src[2]) + list(dst[2]) if isinstance(x, Shard)), S)
    grad = tuple(data.draw(st.sampled_from([shard, R, P])) for _ in dst[0])
    d_shape, d_ranks, _, extent, d_sizes = dst
    gref = reference(d_shape, d_ranks, grad, extent, d_sizes)
    # the gradient lands on every rank holding a source row: Partial becomes Replicate
    s_shape, s_ranks, s_pl, _, s_sizes = src
    tref = reference(s_shape, s_ranks, [R if isinstance(x, Partial) else x for x in s_pl], extent, s_sizes)
    views = execute(plan_backward(s, d, grad, world), gref, tref, world)
    check_spread(views, gref, tref)


# --------------------------------------------------------- caching, determinism


def test_plan_is_cached_and_deterministic():
    def specs():
        return (MeshSpec(grid((2, 3), range(6)), (S, R), sample_sizes=(1, 0, 4, 2, 2)),
                MeshSpec(grid((3, 2), range(3, 9)), (S, R), sample_sizes=(1, 0, 4, 2, 2)))

    a = plan(*specs())
    assert plan(*specs()) is a
    plan.cache_clear()
    b = plan(*specs())
    assert b is not a and [a.for_rank(r) for r in range(9)] == [b.for_rank(r) for r in range(9)]


def test_ranks_outside_both_meshes_have_empty_plans():
    p = plan(MeshSpec([0, 1], (S,), 4), MeshSpec([3], (S,), 4), world_size=6)
    for r in (2, 4, 5):
        v = p.for_rank(r)
        assert (v.src_rows, v.dst_rows, v.sends, v.recvs, v.copies, v.zero_fill) == (0, 0, (), (), (), ())
    with pytest.raises(PlanError, match="rank 6 is outside the world of 6 ranks"):
        p.for_rank(6)


def test_mesh_accepts_tensors_and_names_are_not_part_of_equality():
    a = MeshSpec(torch.arange(4).reshape(2, 2), [S, R], 8, name="vision")
    b = MeshSpec([[0, 1], [2, 3]], (S, R), 8)
    assert a == b and hash(a) == hash(b) and a.shape == (2, 2) and a.shard_dim == 0


# --------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(mesh=[0, 1], placements=(S,), extent=6, sample_sizes=(2, 3)),
         "mesh 'vision' (shape (2,), ranks [0, 1]): sample_sizes sum to 5 (2 samples) but the global extent is 6"),
        (dict(mesh=[0, 1], placements=(S,), sample_sizes=(2, -1, 3)),
         "sample_sizes[1] = -1 is negative"),
        (dict(mesh=[0, 1], placements=(S,), sample_sizes=(2, 1.5)), "sample_sizes[1] = 1.5 is not an integer"),
        (dict(mesh=[[0, 1], [2, 3]], placements=(S,), extent=4),
         "mesh 'vision' (shape (2, 2), ranks [0, 1, 2, 3]): 1 placement(s) (Shard(dim=0)) for a 2-d mesh; "
         "give exactly one placement per mesh dim"),
        (dict(mesh=[0, 1], placements=(Partial("avg"),), extent=4),
         "placements (Partial(avg)) contain Partial(avg), a placement the plan cannot serve"),
        (dict(mesh=[[0, 1], [2, 3]], placements=(Shard(0), Shard(1)), extent=4),
         "placements (Shard(dim=0), Shard(dim=1)) shard tensor dims [0, 1], a placement the plan cannot serve"),
        (dict(mesh=[[0, 1], [2, 3]], placements=(Shard(0), _StridedShard(0, split_factor=2)), extent=4),
         "a placement the plan cannot serve"),
        (dict(mesh=[0, 1], placements=(S,), extent=-1), "the global extent must be an integer >= 0, got -1"),
        (dict(mesh=[0, 1], placements=(S,)), "give the global extent or the sample_sizes"),
        (dict(mesh=[0, 0], placements=(S,), extent=1), "rank(s) [0] appear more than once in the mesh"),
        (dict(mesh=[[0, 1], [2]], placements=(S, R), extent=1), "the mesh is not rectangular"),
        (dict(mesh=[0, -2], placements=(S,), extent=1), "negative rank(s) [-2]"),
    ],
    ids=["sizes-sum", "negative-size", "non-integer-size", "placements-length", "partial-avg", "two-shard-dims", "strided",
         "negative-extent", "no-extent", "duplicate-rank", "ragged-mesh", "negative-rank"],
)
def test_spec_validation(kwargs, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        MeshSpec(name="vision", **kwargs)


@pytest.mark.parametrize(
    "src,dst,world,message",
    [
        (MeshSpec([0, 1], (S,), 4, name="vision"), MeshSpec([2], (S,), 5, name="language"), None,
         "source mesh 'vision' (Shard(dim=0)) has 4 rows along the bridged dim but destination mesh 'language' "
         "(Shard(dim=0)) has 5"),
        (MeshSpec([0, 1], (S,), sample_sizes=(1, 2, 3)), MeshSpec([2], (S,), sample_sizes=(3, 2, 1)), None,
         "disagree on the samples: 3 vs 3 samples, first difference at sample 0"),
        (MeshSpec([0, 1], (Shard(0),), 4), MeshSpec([2], (Shard(1),), 4), None,
         "shards tensor dim 0 but destination mesh (Shard(dim=1)) shards dim 1: a placement the plan cannot serve"),
        (MeshSpec([0, 1], (S,), 4), MeshSpec([[2, 3], [4, 5]], (S, R), 4, name="language"), 4,
         "destination mesh 'language' of shape (2, 2) holds rank(s) [4, 5] outside the world of 4 ranks (0..3)"),
        (MeshSpec([0, 1], (S,), 4), MeshSpec([2], (S,), 4), 0, "world_size must be an integer >= 1, got 0"),
    ],
    ids=["extent", "samples", "shard-dims", "world-size", "world-size-zero"],
)
def test_plan_validation(src, dst, world, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        plan(src, dst, world)


# ------------------------------------------------------- derived specs, two-hop routes


def test_replace_equals_a_fresh_spec_and_validates_sizes():
    base = MeshSpec(grid((2, 2), range(4)), (S, R), sample_sizes=(1, 2), name="vision")
    new = base.replace(sample_sizes=(3, 0, 4))
    fresh = MeshSpec(grid((2, 2), range(4)), (S, R), sample_sizes=(3, 0, 4))
    assert new == fresh and hash(new) == hash(fresh) and new.extent == 7 and new.name == "vision"
    assert base.replace(placements=(S, P)).placements == (S, P) and base.replace(split_dims=(1,)).split_dims == (1,)
    with pytest.raises(PlanError, match=r"sample_sizes\[1\] = -2 is negative"):
        base.replace(sample_sizes=(1, -2))
    with pytest.raises(PlanError, match=r"sample_sizes sum to 3 \(2 samples\) but the global extent is 5"):
        base.replace(sample_sizes=(1, 2), extent=5)
    with pytest.raises(PlanError, match=r"split_dims \(0,\) name \[0\], which are not Replicate or Partial"):
        base.replace(split_dims=(0,))


def test_two_hops_only_where_one_hop_repeats_rows():
    dp2 = MeshSpec([0, 1], (S,), 8)
    assert wants_two_hops(dp2, MeshSpec([[2, 3, 4, 5]], (S, R), 8))  # replicated destination
    assert wants_two_hops(MeshSpec([0, 1], (P,), 8), MeshSpec([2], (S,), 8))  # Partial source
    assert not wants_two_hops(dp2, MeshSpec([2, 3, 4], (S,), 8))
    assert not wants_two_hops(MeshSpec([[0, 1]], (S, R), 8), MeshSpec([2], (S,), 8))  # one replica sends
    assert not wants_two_hops(dp2, MeshSpec([[1, 2, 3, 4]], (S, R), 8))  # meshes share rank 1


@pytest.mark.parametrize("local_world_size,expected", [(None, 2), ("4", 2), ("8", 1)])
def test_default_route_takes_two_hops_only_across_nodes(monkeypatch, local_world_size, expected):
    """torchrun's LOCAL_WORLD_SIZE covering the world means one node: one hop there."""
    if local_world_size is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    dp2, replicated = MeshSpec([0, 1], (S,), 8), MeshSpec([[2, 3, 4, 5]], (S, R), 8)
    assert default_hops(dp2, replicated, 8) == expected
    assert default_hops(dp2, MeshSpec([2, 3, 4], (S,), 8), 8) == 1  # nothing repeats: one hop anywhere


@pytest.mark.parametrize("bad", [0, 3, True, "2", 2.0])
def test_a_route_choice_other_than_none_1_or_2_is_refused(bad):
    with pytest.raises(ValueError, match=rf"where: hops={bad!r}; use None \(choose per direction\), 1 or 2"):
        check_hops(bad, "where")


def test_hop_rows_hand_computed():
    # dp2 -> dp1·tp4, 8 rows: one-hop delivers all 8 rows to each of 4 replicas (32 between);
    # two-hop sends each row once (8) and each replica gathers the 6 rows it lacks (24 inside).
    src, dst = MeshSpec([0, 1], (S,), 8), MeshSpec([[2, 3, 4, 5]], (S, R), 8)
    assert hop_rows(src, dst, 1) == {"between": 32, "inside": 0}
    assert hop_rows(src, dst, 2) == {"between": 8, "inside": 24}
    # backward of dp2 -> cp2 with a Partial gradient: one-hop sends both partial sums of each row
    # (16); two-hop reduce-scatters first (each cp rank sends its other half: 8) and sends 8.
    grad_src, grad_dst = backward_specs(src, MeshSpec([2, 3], (R,), 8), (P,))
    assert hop_rows(grad_src, grad_dst, 1) == {"between": 16, "inside": 0}
    assert hop_rows(grad_src, grad_dst, 2) == {"between": 8, "inside": 8}
    # cp2·tp2 with a Partial gradient over cp: the tp narrow runs before the reduce-scatter, so each
    # of the 4 members reduce-scatters the 4 rows its tp coordinate keeps (sends 2), not all 8 (4).
    grad_src, grad_dst = backward_specs(src, MeshSpec([[2, 3], [4, 5]], (R, R), 8), (P, R))
    assert hop_rows(grad_src, grad_dst, 1) == {"between": 16, "inside": 0}
    assert hop_rows(grad_src, grad_dst, 2) == {"between": 8, "inside": 8}
