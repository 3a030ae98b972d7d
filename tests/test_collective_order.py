"""NCCL safety by construction, checked on gloo: every rank makes the same process groups in the same
order, the members of each group issue the same collectives in the same order, and point-to-point
messages pair up in the same order on both sides.

gloo forgives what NCCL does not: it matches point-to-point messages by tag, and a collective of
another shape or dtype may pass or fail differently. On NCCL (which this machine cannot run) a rank
that issues one collective more, one fewer, another shape or another order than its peers of a
group hangs them. So this test records, per rank, what the library hands to torch.distributed
during a step, and compares the ranks' records (`check_order`):

(a) every rank's sequence of group creations (``new_group``, ``split_group``: collective over the
    world, or over the parent group) is identical, members and ``use_local_synchronization`` alike;
(b) for every group, its members' sequences of collectives on it are identical: the op, and the
    shapes and dtypes of its tensors (the part of them every rank must agree on: an all-to-all's
    own split sizes, a scatter's or gather's list on the root, are left out);
(c) the sends from one rank to another on a group, in order, pair up with the receiving rank's
    receives from it on that group (one message each, the same numel and dtype): NCCL pairs by
    posting order, whatever the tags;
(d) no two ranks meet in two events (a group's k-th collective, a message, one `batch_isend_irecv`)
    in opposite orders (`_check_no_cycle`): NCCL runs each rank's operations in its own order.

What the recorder sees (`Recorder`): group creations by wrapping torch.distributed's Python
functions (`_new_group_with_tag`, under ``new_group`` and ``new_subgroups_by_enumeration``, and
``split_group``); collectives and point-to-point ops by a TorchDispatchMode on the calling thread, at
the dispatcher, where every c10d op passes: ``dist.*`` (``torch.ops.c10d.*``: all_reduce,
all_gather(_into_tensor), reduce_scatter(_tensor), broadcast, the object collectives' tensors,
barrier, send / recv under ``batch_isend_irecv``, all_to_all), the functional collectives that
DTensor's redistributions run (``torch.ops._c10d_functional.*``, the mode lets DTensor desugar
first) and FSDP2's. It does not see collectives issued from other threads (a background
checkpoint's writer, on its own group). No case here is compiled (their graphs' collectives run
through the same ops, but dynamo under a dispatch mode is not what a run traces).

Covered (`LAYOUTS`, 1-2 steps each): disjoint fan-in + `predict`; items of their own sizes with
empty encoder dp shares and a text-only step; colocated tp change with sp; cp; HSDP with a
checkpoint saved and loaded; dp sums overlapped with backward (`GradientReducer`); language pp2
1F1B + `predict`; encoder pp2. Beyond the suite (checked once, not kept: too slow), every case of
tests/test_mimo.py and tests/test_pipeline.py (compiled ones included) for 2 steps, and trainer runs
(layouts A and B of tests/test_trainer.py, encoder pp2, items of their own sizes: evaluation,
generation, checkpoints every 2 steps, then a resumed run with background saves) met (a)-(d).
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from dtensor_mimo import MimoModel, MimoOptimizer, ParallelOptions, Parallelism, PipelineConfig, train_step
from tests.harness import run_on_ranks
from tests.test_mimo import OPT, Case, _batches, _modules, _seeds

P = Parallelism
NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional")
NOT_COMMUNICATION = ("wait_tensor", "_wrap_tensor_autograd", "monitored_barrier_")  # (the last: gloo only)
PER_RANK_SHAPES = ("alltoall_", "alltoall_base_", "all_to_all_single")  # each rank its own split sizes
ROOTED_LISTS = ("scatter_", "gather_")  # the list of tensors only on the root (empty on the others)


def _group_of(value: Any) -> Any:
    """The ProcessGroup an op argument names (a boxed ProcessGroup, or a functional collective's
    group name), or None."""
    if isinstance(value, torch.ScriptObject):
        try:
            return dist.ProcessGroup.unbox(value)
        except (RuntimeError, TypeError):
            return None
    if isinstance(value, str):
        try:
            return c10d._resolve_process_group(value)
        except (RuntimeError, ValueError, KeyError):
            return None
    return None


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class Recorder(TorchDispatchMode):
    """Records this rank's communication ops, in order: ("op", group name, group's global ranks,
    op, signature) for collectives and ("send" / "recv", group name, group's global ranks, op,
    (global peer, numel, dtype)) per tensor of a point-to-point op. Use as a context manager;
    `groups` are the group creations seen meanwhile (world-collective calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self.groups: list[tuple] = []
        self.batch: int | None = None  # the `batch_isend_irecv` call under way (its index), else None
        self.batches = 0
        self._undo: list[tuple[Any, str, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is DTensor or issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor desugars into plain-tensor ops first, with this mode still on
        namespace = getattr(func, "namespace", None)
        if namespace in NAMESPACES and not isinstance(func, torch._ops.HigherOrderOperator):
            self._record(func, list(args) + list(kwargs.values()))
        return func(*args, **kwargs)

    def _record(self, func, args: list) -> None:
        name = func._schema.name.split("::")[-1]
        if name in NOT_COMMUNICATION:
            return
        group = next((g for g in map(_group_of, args) if g is not None), None)
        if group is None:
            raise AssertionError(f"{func}: no process group among its arguments")
        ranks = tuple(dist.get_process_group_ranks(group))
        key = (group.group_name, ranks)
        if name in ("send", "recv_", "recv_any_source_"):
            peer = next(a for a in args if isinstance(a, int) and not isinstance(a, bool))  # dstRank / srcRank
            for t in _tensors(args[0]):
                self.ops.append(("send" if name == "send" else "recv", *key, name,
                                 (ranks[peer], t.numel(), str(t.dtype)), self.batch))
            return
        if name in PER_RANK_SHAPES:
            signature = tuple(str(t.dtype) for t in _tensors(args[:2]))
        elif name in ROOTED_LISTS:  # the single-tensor side: (outputs, inputs) of scatter, (...) of gather
            single = args[0] if name == "scatter_" else args[1]
            signature = (tuple((tuple(t.shape), str(t.dtype)) for t in _tensors(single)),
                         tuple(a for a in args if isinstance(a, int) and not isinstance(a, bool))[:1])
        else:  # tensors, then scalars (root, group size, reduce op's name; not the group's name)
            signature = (tuple((tuple(t.shape), str(t.dtype)) for t in _tensors(args)),
                         tuple(a for a in args if isinstance(a, (int, str)) and not isinstance(a, bool)
                               and _group_of(a) is None))
        self.ops.append(("op", *key, name, signature, None))

    # group creations: wrap torch.distributed's functions wherever a module holds them by name
    def _wrap(self, name: str, describe) -> None:
        original = getattr(c10d, name)
        groups = self.groups

        def wrapped(*args, **kwargs):
            groups.append((name, *describe(*args, **kwargs)))
            return original(*args, **kwargs)

        for module in sys_modules():
            if getattr(module, name, None) is original:
                self._undo.append((module, name, original))
                setattr(module, name, wrapped)

    def __enter__(self):
        def new_group(ranks=None, timeout=None, backend=None, backend_options=None, pg_tag=None,
                      use_local_synchronization=False, *args, **kwargs):
            return (tuple(sorted(ranks)) if ranks else None, bool(use_local_synchronization))

        def split_group(parent_pg=None, split_ranks=None, *args, **kwargs):
            parent = tuple(dist.get_process_group_ranks(parent_pg)) if parent_pg is not None else None
            return (parent, tuple(tuple(r) for r in split_ranks or ()))

        self._wrap("_new_group_with_tag", new_group)
        self._wrap("split_group", split_group)
        original, recorder = c10d.batch_isend_irecv, self

        def batch_isend_irecv(p2p_op_list):  # its ops start together (one NCCL group): one event
            recorder.batch, recorder.batches = recorder.batches, recorder.batches + 1
            try:
                return original(p2p_op_list)
            finally:
                recorder.batch = None

        for module in sys_modules():
            if getattr(module, "batch_isend_irecv", None) is original:
                self._undo.append((module, "batch_isend_irecv", original))
                setattr(module, "batch_isend_irecv", batch_isend_irecv)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for module, name, original in reversed(self._undo):
                setattr(module, name, original)
            self._undo.clear()


def sys_modules():
    import sys

    return [m for n, m in list(sys.modules.items()) if m is not None
            and n.startswith(("torch.distributed", "dtensor_mimo", "tests"))]


def check_order(per_rank: list[dict]) -> None:
    """Assert (a), (b) and (c) of the module's docstring over every rank's records."""
    groups = [r["groups"] for r in per_rank]
    for rank, mine in enumerate(groups):
        assert mine == groups[0], f"(a) rank {rank} made groups {mine}, rank 0 {groups[0]}"
    by_group: dict[str, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    members: dict[str, set] = defaultdict(set)
    sends: dict[tuple, list] = defaultdict(list)
    recvs: dict[tuple, list] = defaultdict(list)
    for rank, record in enumerate(per_rank):
        for kind, name, ranks, op, signature, _ in record["ops"]:
            members[name].add(ranks)
            if kind == "op":
                by_group[name][rank].append((op, signature))
            elif kind == "send":
                sends[name, rank, signature[0]].append(signature[1:])
            else:
                recvs[name, signature[0], rank].append(signature[1:])
    for name, seen in members.items():
        assert len(seen) == 1, f"group {name!r} has other members on other ranks: {seen}"
    for name, per_member in by_group.items():
        (ranks,) = members[name]
        sequences = {r: per_member.get(r, []) for r in ranks}
        first = sequences[ranks[0]]
        for r, seq in sequences.items():
            if seq != first:
                at = next((i for i, (x, y) in enumerate(zip(seq, first)) if x != y), min(len(seq), len(first)))
                raise AssertionError(
                    f"(b) group {name!r} {ranks}: rank {r} issued {len(seq)} collectives, rank {ranks[0]} "
                    f"{len(first)}; first difference at #{at}: rank {r} {seq[at:at + 2]}, rank {ranks[0]} "
                    f"{first[at:at + 2]}")
    for key in sends.keys() | recvs.keys():
        name, src, dst = key
        sent, received = sends.get(key, []), recvs.get(key, [])
        assert sent == received, f"(c) group {name!r}: rank {src} sent {sent} to rank {dst}, which received {received}"
    _check_no_cycle(per_rank)


def _check_no_cycle(per_rank: list[dict]) -> None:
    """(d) The events (a group's k-th collective, joining its members; the i-th message from one
    rank to another on a group, joining the two; a `batch_isend_irecv`'s messages, one event on its
    rank) ordered by each rank's program order form no cycle: NCCL runs each rank's operations in
    its order (a blocking operation, or the compute stream waiting on one), so two ranks that meet
    in two events in opposite orders wait on each other for good, though each group's own order
    agrees ((b), (c)); gloo's threads may get through it."""
    parent: dict[tuple, tuple] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    programs = []
    for rank, record in enumerate(per_rank):
        counts: dict[tuple, int] = defaultdict(int)
        events, batches = [], {}
        for kind, name, ranks, op, signature, batch in record["ops"]:
            key = (name,) if kind == "op" else (name, rank, signature[0]) if kind == "send" else \
                (name, signature[0], rank)
            event = (kind == "op", *key, counts[key])
            counts[key] += 1
            if batch is not None:
                if batch in batches:
                    parent[find(event)] = find(batches[batch])
                    continue
                batches[batch] = event
            events.append(event)
        programs.append(events)
    edges: dict[tuple, set] = defaultdict(set)
    for events in programs:
        nodes = [find(e) for e in events]
        for a, b in zip(nodes, nodes[1:]):
            if a != b:
                edges[a].add(b)
    state: dict[tuple, int] = {}  # 1: on the path, 2: done
    for start in list(edges):
        if start in state:
            continue
        stack, path = [(start, iter(edges[start]))], [start]
        state[start] = 1
        while stack:
            node, successors = stack[-1]
            nxt = next(successors, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError(f"(d) ranks wait on each other in a cycle of events: {cycle}")
            elif nxt not in state:
                state[nxt] = 1
                stack.append((nxt, iter(edges[nxt])))
                path.append(nxt)


# ------------------------------------------------------------------ the runs


def _run(case: Case, steps: int, root: str | None, predict: bool) -> dict:
    """`steps` training steps of `case` from its meshes on, then a checkpoint saved and loaded
    (`root`) and a `predict`; this rank's records. The recorder is undone on the way out (the
    harness reuses rank processes)."""
    recorder = Recorder()
    with recorder:
        layout = case.layout()
        layout.init_meshes("cpu")
        llama, encs = _modules(case.encoders, case.frozen, case.n_layers, case.meta, None, case.custom_vision,
                               case.custom_language, case.varied)
        model = MimoModel(layout, llama, encs, options=case.options, pipeline=case.pipeline,
                          bridge_hops=case.bridge_hops)
        if case.meta:
            model.init_weights(_seeds(case.encoders))
        optimizer = MimoOptimizer(model, OPT)
        batches = _batches(case.encoders, case.packed, case.batch_size, case.seq_lens[:steps],
                           text_only=case.text_only_steps, varied=case.varied)
        for batch in batches:
            train_step(model, optimizer, batch)
        if root is not None:
            from dtensor_mimo.train import checkpoint

            shapes = {f"model.{m}.{n}": tuple(p.shape) for m in model.module_names
                      for n, p in model.module_parameters(m).items()}
            path = checkpoint.save(os.path.join(root, "ckpt"), 1, model, optimizer, {"step": 1}, keep=1)
            checkpoint.load(path, model, optimizer, shapes)
        if predict:
            model.predict(batches[0])
    return {"ops": recorder.ops, "groups": recorder.groups}


MB2 = PipelineConfig(microbatches=2)
SHORT = dict(batch_size=4, seq_lens=(32, 32))
NO_FSDP = {n: ParallelOptions(fsdp=False, grad_bucket_mb=1 / 1024) for n in ("vision", "language")}
LAYOUTS = {  # (case, steps, checkpoint saved and loaded, predict)
    "fan_in": (Case({"vision": P(dp=2), "language": P()}, **SHORT), 1, False, True),
    # items of their own sizes: encoder dp ranks with items and without; step 1 carries none
    "varied_fan_in": (Case({"vision": P(dp=2), "audio": P(dp=2), "language": P()},
                           offsets={"vision": 0, "audio": 0, "language": 2}, varied=True, text_only_steps=(1,),
                           batch_size=4, seq_lens=(64, 64)), 2, False, False),
    "coloc_tp": (Case({"vision": P(dp=2, tp=2), "language": P(tp=4)}, offsets={"vision": 0, "language": 0},
                      options={"vision": ParallelOptions(sp=True)}, **SHORT), 1, False, False),
    "cp": (Case({"vision": P(dp=2), "language": P(cp=2)}, packed=True, **SHORT), 1, False, False),
    "hsdp": (Case({"vision": P(dp=4, dp_replicate=2), "language": P(dp=2, cp=2, dp_replicate=2)},
                  offsets={"vision": 0, "language": 0}, packed=True, **SHORT), 1, True, False),
    # dp sums in buckets launched while backward runs (`GradientReducer`), on both sides of the bridge
    "overlap_grad_reduce": (Case({"vision": P(dp=2), "language": P(dp=2)}, options=NO_FSDP, **SHORT),
                            2, False, False),
    "pp2": (Case({"vision": P(), "language": P(pp=2)}, pipeline=MB2, **SHORT), 1, False, True),
    "vision_pp2": (Case({"vision": P(pp=2), "language": P(pp=2)}, pipeline=MB2, **SHORT), 1, False, False),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_rank_issues_the_same_collectives_in_the_same_order(name: str, tmp_path) -> None:
    """The layouts of `LAYOUTS` (disjoint fan-in, items of their own sizes, colocated tp, cp, HSDP
    with a checkpoint saved and loaded, dp sums overlapped with backward, language pp2 1F1B,
    encoder pp2; `predict` after two of them): meshes, steps and the rest recorded from the
    meshes' creation on, (a)-(d) hold."""
    case, steps, ckpt, predict = LAYOUTS[name]
    per_rank = run_on_ranks(_run, case.layout().world_size, case, steps, str(tmp_path) if ckpt else None,
                            predict, timeout=180)
    kinds = {kind for r in per_rank for kind, *_ in r["ops"]}
    assert kinds == {"op", "send", "recv"} and all(r["groups"] for r in per_rank), kinds  # the recorder saw them
    check_order(per_rank)


# ------------------------------------------------------------------ the checks catch what gloo lets through


def _what_gloo_lets_through(which: str) -> dict:
    """On 2 ranks, a pattern gloo completes and NCCL does not, recorded."""
    rank, recorder = dist.get_rank(), Recorder()
    with recorder:
        if which == "tags":  # rank 1 posts its receives in another order; gloo pairs them by tag
            a, b = torch.ones(3), torch.ones(5)
            ops = ([dist.P2POp(dist.isend, a, 1, tag=1), dist.P2POp(dist.isend, b, 1, tag=2)] if rank == 0 else
                   [dist.P2POp(dist.irecv, b, 0, tag=2), dist.P2POp(dist.irecv, a, 0, tag=1)])
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        else:  # two groups of the same ranks, entered in opposite orders
            one, two = dist.new_group([0, 1]), dist.new_group([0, 1])
            works = [dist.all_reduce(torch.ones(2), group=g, async_op=True)
                     for g in ((one, two) if rank == 0 else (two, one))]
            for work in works:
                work.wait()
    return {"ops": recorder.ops, "groups": recorder.groups}


@pytest.mark.parametrize("which, message", [("tags", r"\(c\) .* rank 0 sent \[\(3, .*\(5, .*received \[\(5"),
                                            ("groups", r"\(d\) ranks wait on each other in a cycle")])
def test_the_checks_catch_what_gloo_lets_through(which: str, message: str) -> None:
    """Messages that gloo pairs by tag but NCCL by posting order, and two groups that two ranks
    enter in opposite orders: each completes on gloo and is refused here."""
    per_rank = run_on_ranks(_what_gloo_lets_through, 2, which, timeout=60)
    with pytest.raises(AssertionError, match=message):
        check_order(per_rank)


def test_the_checks_catch_divergent_groups_and_collectives() -> None:
    """(a) and (b) on hand-made records (a real divergence would hang gloo too)."""
    def op(name, shape, group="1", ranks=(0, 1)):
        return ("op", group, ranks, name, (((shape, "torch.float32"),), ()), None)

    same = [("_new_group_with_tag", (0, 1), False)]
    with pytest.raises(AssertionError, match=r"\(a\) rank 1 made groups"):
        check_order([{"groups": same, "ops": []}, {"groups": [("_new_group_with_tag", (0, 1), True)], "ops": []}])
    with pytest.raises(AssertionError, match=r"\(b\) group '1' \(0, 1\): rank 1 .*first difference at #1"):
        check_order([{"groups": same, "ops": [op("allreduce_", (2,)), op("allreduce_", (3,))]},
                     {"groups": same, "ops": [op("allreduce_", (2,)), op("allreduce_", (4,))]}])
    with pytest.raises(AssertionError, match=r"\(b\) group '1' \(0, 1\): rank 1 issued 1 collectives, rank 0 2"):
        check_order([{"groups": same, "ops": [op("allreduce_", (2,)), op("barrier", ())]},
                     {"groups": same, "ops": [op("allreduce_", (2,))]}])
