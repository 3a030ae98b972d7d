"""One microbatch's crossing from the encoders' meshes to the first language stage, and back.

A crossing moves every encoder's output rows of ONE microbatch (a slice of the global batch,
dp-sharded per module) in one exchange: one public `Bridge` per encoder (the bridge's pure
planner over the microbatch's ragged sizes), posted together (`post_together`: one
`batch_isend_irecv` per rank per direction). Source: the last pipeline stage
of each encoder's mesh, ``(dp, cp, tp)`` with the rows split over dp. Destination: the first
stage of the language mesh, rows split over dp and whole on every cp and tp rank; the gradient
comes back `Partial` over cp (each cp rank only sees its positions) and replicated over tp.

Each direction of each encoder takes the bridge's route (`dtensor_mimo.bridge.hops`): one hop,
or two where the receiving stage replicates the rows over tp·cp (or the gradient is Partial over
cp) and the modules sit on nodes of their own: each row then crosses once, spread over the
replicas, and the receiving stage all-gathers it inside its tp and cp groups when it waits for
it (the backward first reduce-scatters the Partial gradient over the language cp group).

Where the first language stage is: stage 0 sits on pp rank 0 under every placement
(`PipelineConfig.stage_rank`: looped, or V-shaped, where pp rank 0 also holds the last stage),
so the destination is the pp-rank-0 slice of the language mesh (`_stage_spec(..., 0)`) whatever
the schedule.

NCCL safety by construction: a rank posts ALL of its sends and receives of one crossing in
ONE batch, and every rank runs the crossings of a step in the same global order,
`dtensor_mimo.schedule.order.crossing_order`: the forward crossings of the first `window`
microbatches, then the backward crossing of j followed by the forward crossing of j + window (a
window of M: every forward, then every backward); the first language stage may run its backwards
in another order, e.g. LoopedBFS last microbatch first, and `LanguageFeed` then holds a gradient
until the earlier ones have gone. So the messages between any two ranks
are posted in the same order on both sides, whatever runs between them. The two-hop collectives
run inside one stage's tp / cp groups, whose members run the same schedule: they post and wait
the same crossings in the same order, each a collective issued at the same point on every member.
A V placement changes none of this: the rank holding stage 0 and the last stage posts its
crossings in the same global order (the zero-bubble schedules run the first stage's backward in
their weight pass, at a point torch picks; `LanguageFeed` posts the gradients in microbatch order
whatever that point is), and torch's own stage-to-stage messages travel on the pp group, which
no crossing uses.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

from dtensor_mimo.bridge import Bridge, MeshSpec, Side, exchange, hops
from dtensor_mimo.bridge.redistribute import check_local_shapes, post_together
from dtensor_mimo.data import MimoBatch
from dtensor_mimo.layout import MimoLayout

ROWS = (Shard(0), Replicate(), Replicate())
"""Encoder output rows on a pipeline stage's ``(dp, cp, tp)`` slice: split over dp."""
STAGE_DIMS = ("dp", "cp", "tp")


@functools.lru_cache(maxsize=16)
def _stage_spec(layout: MimoLayout, name: str, stage: int) -> MeshSpec:
    """One pipeline stage's ``(dp, cp, tp)`` slice of module `name`'s mesh, rows split over dp:
    validated once (O(ranks)); each microbatch derives its ragged sizes from it in O(samples)."""
    return MeshSpec(layout.rank_grid(name)[stage], ROWS, 0, name=name)


@dataclass(frozen=True)
class CrossingSetup:
    """What every crossing of a model shares, known on every rank.

    Attributes:
        layout, language: the MIMO layout and its language module's name.
        dim, dtype, device: width, dtype and device of the rows that cross.
        hops: the route of every direction: 1, 2 or None (`hops.default_hops`: two hops across
            nodes where the receiving stage replicates the rows or the gradient is Partial).
        buffers: where outputs are received (recycled across microbatches and steps), or None
            (fresh tensors).
    """

    layout: MimoLayout
    language: str
    dim: int
    dtype: torch.dtype
    device: torch.device
    hops: int | None = None
    buffers: exchange.BufferPool | None = field(default=None, compare=False)


class Crossing:
    """The forward and backward exchanges of one microbatch, planned for this rank.

    Args:
        setup: what every crossing of the model shares (`CrossingSetup`).
        microbatch: the microbatch (a global-batch slice) whose rows cross.
        names: encoders whose rows cross, in the same order on every rank.
        trainable: per name, whether its gradient crosses back (frozen encoders: no backward).
        index: the microbatch's index (for error messages).
        bounds: per encoder whose items are balanced over its dp ranks, the rows where each dp
            rank's share starts, then the row count (`data.balance.row_bounds`); the others'
            dp ranks hold their samples' rows.
    """

    def __init__(self, setup: CrossingSetup, microbatch: MimoBatch, names: Sequence[str], trainable: Sequence[bool],
                 index: int = 0, bounds: Mapping[str, Sequence[int]] | None = None) -> None:
        layout, language = setup.layout, setup.language
        self.rank = dist.get_rank()
        lang = layout.parallelism(language)
        grad = (Shard(0), Partial() if lang.cp > 1 else Replicate(), Replicate())
        self.names = list(names)
        self.backward_names = [n for n, t in zip(names, trainable) if t]
        self.dim, self.dtype, self.device, self.index = setup.dim, setup.dtype, setup.device, index
        self.error: str | None = None  # rows that disagreed with the plan (see `forward`)
        dst = Side(_stage_spec(layout, language, 0), _groups(layout, language), setup.device)
        self.bridges: dict[str, Bridge] = {}
        """One `Bridge` per encoder: its last stage's slice of its mesh to the first language stage's."""
        for name in self.names:
            sizes = tuple(microbatch.tokens_per_sample(name))
            src = _stage_spec(layout, name, -1).replace(sample_sizes=sizes, shard_bounds=(bounds or {}).get(name))
            self.bridges[name] = Bridge.between(
                Side(src, _groups(layout, name), setup.device), dst._replace(spec=dst.spec.replace(sample_sizes=sizes)),
                width=setup.dim, dtype=setup.dtype, grad_placements=grad if name in self.backward_names else None,
                hops=setup.hops, buffers=setup.buffers)

    def _start(self, names: Sequence[str], direction: str, locals_: Mapping[str, torch.Tensor | None],
               receives: bool) -> list[hops.Delivery]:
        # Detached: what arrives is a new leaf on the other side, also for local copies.
        locals_ = [None if (x := locals_.get(n)) is None else x.detach() for n in names]
        return post_together([self.bridges[n] for n in names], direction, locals_, send=True, recv=receives)

    def forward(self, rows: Mapping[str, torch.Tensor | None], receives: bool) -> list[hops.Delivery]:
        """Post this rank's part of the forward exchange (its sends and receives in one batch).

        `rows`: this rank's encoder output rows per encoder name (on encoder ranks).
        `receives`: this rank is on the first language stage; ``wait()`` the results for its rows.

        Rows whose shape disagrees with the plan (an encoder output length that contradicts the
        batch's ``tokens_per_item``) are replaced by zeros of the planned shape, so that no peer
        waits for a message that never comes, and `error` says what happened; `train_step`
        carries that verdict in its one all-reduce and raises on every rank.
        """
        rows = dict(rows)
        for name in self.names:
            x, route = rows.get(name), self.bridges[name].forward_route
            if x is None:
                continue
            rows[name], bad = exchange.as_planned(x, (route.src_rows, self.dim))
            if bad:
                fix = ("make the batch's tokens_per_item match the encoder's output length"
                       if x.ndim != 2 or x.shape[-1] == self.dim else
                       f"its rows are {x.shape[-1]} wide but the language model's dim is {self.dim}: an encoder "
                       "returns whole rows, replicated over its tp ranks (a tp plan's last layer a "
                       "RowwiseParallel, or a ColwiseParallel with output_layouts=Replicate())")
                self.error = self.error or (
                    f"rank {self.rank}: encoder {name!r} produced rows of shape {tuple(x.shape)} for "
                    f"microbatch {self.index}, but the batch metadata plans ({route.src_rows}, {self.dim}) "
                    f"(its dp shard's items x tokens_per_item, by the language model's width): {fix}")
        return self._start(self.names, "forward", rows, receives)

    def check_world(self, rows: Mapping[str, torch.Tensor]) -> None:
        """One world all-reduce of whether this rank's `rows` have the planned shapes: every rank
        raises `PlanError` before any row moves if one rank's do not (a check for the first
        microbatch of a new item size; `forward` alone tells only the step's result)."""
        bridges = [self.bridges[n] for n in self.names]
        check_local_shapes([rows.get(n) for n in self.names],
                           [(b.forward_route.src_rows, self.dim) if n in rows else None for n, b in zip(self.names, bridges)],
                           [b.src for b in bridges], self.device)

    def across(self, rows: Mapping[str, torch.Tensor], receives: bool) -> dict[str, torch.Tensor]:
        """Both directions as one autograd node: the rows cross now (this rank's sends and
        receives in one batch) and their gradients come back when the caller runs backward (again
        one batch, so a rank on both sides never waits for its own unposted message). Returns the
        received rows on first-stage ranks, else empty ``[0, dim]`` tensors connected to `rows`.
        Ranks without rows pass none; where an encoder trains they still join the backward."""
        held = [rows.get(n) for n in self.names]
        # A rank without rows of a trainable encoder holds an empty leaf, so that the node is
        # recorded and its backward posts this rank's part of the gradients' exchange.
        trains = bool(self.backward_names)
        inputs = [x if x is not None else torch.empty(0, device=self.device, requires_grad=trains) for x in held]
        return dict(zip(self.names, _Across.apply(self, receives, [x is not None for x in held], *inputs)))

    def backward(self, grads: Mapping[str, torch.Tensor | None], receives: bool) -> list[hops.Delivery]:
        """Post this rank's part of the backward exchange; `grads` on first-stage language ranks
        (two hops with cp > 1: a reduce-scatter over cp first, on every cp rank), `receives` on
        encoder ranks (``wait()`` gives the gradient of their rows). Trainable encoders only
        (`backward_names`)."""
        return self._start(self.backward_names, "backward", grads, receives)


class _Across(torch.autograd.Function):
    """`Crossing.across`: forward posts and waits the rows' exchange, backward the gradients'."""

    @staticmethod
    def forward(ctx, crossing: Crossing, receives: bool, held: list[bool], *rows: torch.Tensor):
        ctx.crossing, ctx.held, ctx.receives = crossing, held, receives
        ctx.like = [(r.shape, r.dtype) for r in rows]
        sent = {n: r for n, r, h in zip(crossing.names, rows, held) if h}
        outs = [d.wait() for d in crossing.forward(sent, receives)]
        ctx.out_shapes = [None if o is None else o.shape for o in outs]
        empty = lambda: torch.empty(0, crossing.dim, dtype=crossing.dtype, device=crossing.device)  # noqa: E731
        return tuple(o if o is not None else empty() for o in outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        crossing, device = ctx.crossing, ctx.crossing.device
        # A first-stage rank sends the gradient of every row it received (zeros where autograd
        # gave none); the others send nothing.
        sent = {} if not ctx.receives else {
            n: g if g is not None else torch.zeros(shape, dtype=crossing.dtype, device=device)
            for n, g, shape in zip(crossing.names, grads, ctx.out_shapes)}
        back = dict(zip(crossing.backward_names,
                        (d.wait() for d in crossing.backward(sent, receives=any(ctx.held)))))
        # Rows that disagreed with the plan crossed as zeros: a zero gradient (same backward on every rank).
        out = [None if not h else g if (g := back.get(n)) is not None and g.shape == shape
               else torch.zeros(shape, dtype=dtype, device=device)
               for n, h, (shape, dtype) in zip(crossing.names, ctx.held, ctx.like)]
        return (None, None, None, *out)


def _groups(layout: MimoLayout, name: str) -> hops.Groups:
    """Module `name`'s process group along a `_stage_spec` dim (dp, cp, tp), on its members."""
    return lambda d: layout.mesh(name).get_group(STAGE_DIMS[d])
