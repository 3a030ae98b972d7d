"""The one executor: runs a rank's program (`dtensor_mimo.schedule.program`) over its parts.

A training step, `model(batch)` and `predict` all come here: `RankParts` (this rank's modules
and the settings every step shares, built once by `MimoModel`) and the program's actions; the
outcome (the loss share or ids, and what went wrong) is the `StepResult`, nothing is left in
attributes. What each action does:

| action             | what runs                                                                  |
|--------------------|----------------------------------------------------------------------------|
| encode             | this rank's cut of the microbatch's items (or of every microbatch's, at once) through a pp = 1 encoder (`LocalEncoders`) |
| rows / grads       | this rank's part of a crossing, one batch of sends and receives (`Crossing`) |
| cross              | both directions as one autograd node (`Crossing.across`)                  |
| check rows         | one world all-reduce: every rank raises before rows of a wrong shape cross |
| backward           | wait for the gradients, encoder backward (FSDP2 reduces in the last one)   |
| encoder pipeline   | torch's GPipe over a pp > 1 encoder's stages, the bridge as its loss       |
| language           | torch's schedule over this rank's language stages (train: the `LanguageFeed` posts the nested crossings), or the stages once (forward, predict) |
| finish sends       | complete the sends still in flight                                         |
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from torch import nn

from dtensor_mimo.bridge.exchange import BufferPool
from dtensor_mimo.bridge.hops import Delivery
from dtensor_mimo.data import MimoBatch, ModalityInputs, microbatches, shard
from dtensor_mimo.data.batch import stand_in_sample
from dtensor_mimo.data.balance import CutRule, microbatch_cuts
from dtensor_mimo.layout import MimoLayout, Parallelism, torch_compat
from dtensor_mimo.parallelize import GradientReducer, ParallelOptions, reshard_fsdp_modules
from dtensor_mimo.schedule.config import PipelineConfig
from dtensor_mimo.schedule.crossing import Crossing, CrossingSetup
from dtensor_mimo.schedule.encoders import Accumulation, EncoderPipeline, LocalEncoders, independent_rows
from dtensor_mimo.schedule.feed import LanguageFeed
from dtensor_mimo.schedule.language import LanguagePipeline
from dtensor_mimo.schedule.order import first_stage_actions
from dtensor_mimo.schedule.program import Action, RankRoles, StepShape, crossing_posts, program
from dtensor_mimo.schedule.runtime import phase


@dataclass(frozen=True)
class RankParts:
    """This rank's part of a `MimoModel` and what every step shares, built once.

    Attributes:
        layout, language_name: the model's layout and its language module's name.
        rank, device: this process's.
        dim, dtype: the width and dtype of the rows that cross the bridge.
        encoders: the pp = 1 encoders this rank holds (parallelized).
        encoder_pipelines: this rank's stage of each pp > 1 encoder it holds.
        language: this rank's language stages, or None.
        trainable: every encoder's (known on every rank): whether its gradients cross back.
        widths: every encoder's width, for the cost of its items (`data.balance`).
        options: every module's `ParallelOptions` (balance, reshard, recompute).
        pipeline: microbatches and the language schedule.
        window: forward crossings ahead of the backward ones (`order.crossing_window`).
        overlapped: every encoder trains on ranks of its own.
        hops: the crossings' route (None: per direction).
        buffers: where crossings receive (recycled across steps).
        reducers: the `GradientReducer` of each module this rank holds whose dp sums start
            during backward: a pp = 1 encoder's armed before its last backward of a training
            step and flushed after it (pipeline stages: their `StageReductions`).
    """

    layout: MimoLayout
    language_name: str
    rank: int
    device: torch.device
    dim: int
    dtype: torch.dtype
    encoders: Mapping[str, nn.Module]
    encoder_pipelines: Mapping[str, EncoderPipeline]
    language: LanguagePipeline | None
    trainable: Mapping[str, bool]
    widths: Mapping[str, int | None]
    options: Mapping[str, ParallelOptions]
    pipeline: PipelineConfig
    window: int
    overlapped: bool
    hops: int | None = None
    buffers: BufferPool | None = field(default=None, compare=False)
    reducers: Mapping[str, GradientReducer] = field(default_factory=dict, compare=False)

    @functools.cached_property
    def crossing_setup(self) -> CrossingSetup:
        """What this model's crossings share (`Crossing`)."""
        return CrossingSetup(self.layout, self.language_name, self.dim, self.dtype, self.device, self.hops,
                             self.buffers)

    @functools.cached_property
    def cuda_graphs(self) -> bool:
        """Whether a module this rank holds replays CUDA graphs (`ParallelOptions.cuda_graphs`)."""
        held = [*self.encoders, *self.encoder_pipelines, *([self.language_name] if self.language else [])]
        return any(self.options[n].cuda_graphs for n in held)

    @functools.cached_property
    def independent_encoders(self) -> frozenset[str]:
        """This rank's pp = 1 encoders whose rows of an item depend on that item alone
        (`independent_rows`): `LocalEncoders` may pad their calls with zero items and run a
        step's microbatches in one call. Decided once, not per step, the same on every rank of
        an encoder."""
        return frozenset(n for n, m in self.encoders.items() if independent_rows(m, self.options[n]))

    @functools.cached_property
    def empty_padded_encoders(self) -> frozenset[str]:
        """This rank's pp = 1 encoders whose call on no item `LocalEncoders` runs on one zero item
        instead, all its rows dropped: on torch before 2.13 those whose rows of an item depend on
        that item alone (their DTensor cannot view an empty batch under tp), and any encoder
        compiled under tp with sp (dynamo cannot trace the empty sequence shard: "unhashable type:
        non-nested SymInt" on the ranks without items only, their peers left waiting). A call on
        no item keeps no row of the padded one, so no real row can mix with it: this holds for a
        user's encoder that mixes the items of a call too. Its parameters get a zero gradient
        from it (an encoder whose backward is not finite at an all-zero item makes the step's
        gradients non-finite, which `train_step` skips on every rank)."""
        return frozenset(n for n, m in self.encoders.items() if (
            torch_compat.RELEASE < (2, 13) and n in self.independent_encoders
            or self.options[n].compile and self.options[n].sp and self.layout.parallelism(n).tp > 1))

    @functools.cached_property
    def padded_encoders(self) -> frozenset[str]:
        """Those of `independent_encoders` whose items `LocalEncoders` pads to the step's bucket:
        the ones that replay CUDA graphs."""
        return frozenset(n for n in self.independent_encoders if self.options[n].cuda_graphs)

    @property
    def roles(self) -> RankRoles:
        """Which parts this rank holds, for `program`."""
        stages = tuple((n, p.index == p.n_stages - 1) for n, p in self.encoder_pipelines.items())
        first = self.language is not None and self.language.first is not None
        return RankRoles(tuple(self.encoders), stages, self.language is not None, first)

    def shape(self, batch: MimoBatch, mode: str, check_rows: bool = False) -> StepShape:
        """The `StepShape` of a `mode` step over `batch`: the same on every rank."""
        names = tuple(n for n in self.trainable if n in batch.modalities)
        m = self.pipeline.microbatches if mode == "train" else 1
        return StepShape(mode, names, tuple(n for n in names if self.trainable[n]), m,
                         self.window if mode == "train" else 1, self.overlapped, check_rows and mode != "train")

    @functools.cached_property
    def cut_rules(self) -> tuple[CutRule, ...]:
        """Every encoder's ``(name, dp, balance, width)``, in `shape`'s order (`microbatch_cuts`)."""
        return tuple((n, self.layout.parallelism(n).dp, self.options[n].balance, self.widths[n])
                     for n in self.trainable)

    def cuts(self, batch: MimoBatch, shape: StepShape) -> list[dict[str, tuple[Sequence[int], tuple[int, ...] | None]]]:
        """Per microbatch of a `shape` step over `batch`, each crossing encoder's `encoder_cuts`
        (`microbatch_cuts`: derived once per batch, possibly ahead, by `MimoModel.prepare` or
        the trainer's loader)."""
        return microbatch_cuts(batch, shape.microbatches, self.cut_rules)

    def program(self, batch: MimoBatch, mode: str = "train", check_rows: bool = False) -> list[Action]:
        """This rank's actions for a `mode` step over `batch` (cached per step shape: a steady
        training loop derives it once)."""
        pp = self.layout.parallelism(self.language_name).pp
        return list(_program(self.roles, self.shape(batch, mode, check_rows), self.pipeline, pp))


@functools.lru_cache(maxsize=64)
def _program(roles: RankRoles, shape: StepShape, pipeline: PipelineConfig, pp: int) -> tuple[Action, ...]:
    order = first_stage_actions(pipeline, pp) if shape.mode == "train" and roles.first_stage else None
    return tuple(program(roles, shape, order))


@dataclass
class StepResult:
    """What a step left on this rank: its loss share (a training step: detached; a forward: with
    its graph), next-token ids (predict: this rank's chunk on the holders of the loss, else None)
    and the first error its encoder rows met (they crossed as zeros; the caller agrees on it)."""

    loss: torch.Tensor
    ids: torch.Tensor | None = None
    error: str | None = None


def execute(parts: RankParts, actions: Sequence[Action], batch: MimoBatch, shape: StepShape,
            normalizer: float = 1.0) -> StepResult:
    """Run `actions` (this rank's `program` for `shape`) over the global `batch`; `normalizer`:
    the global batch's loss tokens (`sequence.loss_normalizer`)."""
    if parts.cuda_graphs:
        # One generation of torch's cudagraph trees per run: the run's graphs (every piece's
        # forward, then backward, per microbatch) chain as one path, replayed whole by the next
        # run of the same shapes, over this one's memory (`MimoModel.graph_memory` refuses a run
        # while that memory is still needed). torch's own guess (a new generation at each
        # compiled call without a pending backward) would cut a prediction's chain of no-grad
        # graphs after every piece.
        torch.compiler.cudagraph_mark_step_begin()
    run = _Run(parts, batch, shape, normalizer)
    with contextlib.ExitStack() as stack:
        if shape.mode == "train" and shape.overlapped and run.local.encoders:
            # FSDP2 accumulates over the microbatches; the last backward reduces (`Accumulation`).
            keep = [n for n in run.local.encoders if not parts.options[n].reshard_after_forward]
            run.accumulation = stack.enter_context(Accumulation(run.local.encoders, keep))
        for action in actions:
            with phase(action.op, action.microbatch, action.module):
                getattr(run, "do_" + action.op.replace(" ", "_"))(action)
    errors = [*run.errors, *run.local.errors, *(c.error for c in run.crossings)]
    return StepResult(run.loss, run.ids, next((e for e in errors if e), None))


class _Run:
    """One step's state on this rank, one method per action."""

    def __init__(self, parts: RankParts, batch: MimoBatch, shape: StepShape, normalizer: float) -> None:
        self.parts, self.shape, self.normalizer = parts, shape, normalizer
        layout, rank = parts.layout, parts.rank
        self.batch = batch
        self.mbs = microbatches(batch, shape.microbatches) if shape.microbatches > 1 else [batch]
        names = shape.encoders
        cuts = parts.cuts(batch, shape)  # which items each encoder dp rank encodes, per microbatch
        self.crossings = [
            Crossing(parts.crossing_setup, mb, names, [parts.trainable[n] for n in names], index=i,
                     bounds={n: b for n, (_, b) in c.items() if b is not None})
            for i, (mb, c) in enumerate(zip(self.mbs, cuts))]
        held = [n for n in names if n in parts.encoders or n in parts.encoder_pipelines]
        self.items: list[dict[str, ModalityInputs]] = []  # this rank's cut of each microbatch, per encoder
        for mb, c in zip(self.mbs, cuts):
            per = {}
            for n in held:
                k, (starts, _) = layout.coordinate(n, rank)["dp"], c[n]
                per[n] = mb.modalities[n].select_items(range(starts[k], starts[k + 1]))
            self.items.append(per)
        # Host-to-device copies that do not wait for the device's queue (the inputs are host memory).
        inputs = [{n: m.to(parts.device).inputs for n, m in per.items() if n in parts.encoders} for per in self.items]
        recompute = [n for n in parts.encoders  # (a frozen one has no backward to recompute for)
                     if parts.options[n].recompute_colocated and not shape.overlapped and parts.trainable[n]]
        local = {n: parts.encoders[n] for n in held if n in parts.encoders}
        self.local = LocalEncoders(local, inputs, parts.dtype, recompute if shape.mode == "train" else (),
                                   parts.padded_encoders & local.keys(), parts.independent_encoders & local.keys(),
                                   parts.device, parts.empty_padded_encoders & local.keys())
        self.accumulation: Accumulation | None = None
        self.received: dict[int, list[Delivery]] = {}  # forward crossings this rank receives
        self.grads: dict[int, list[Delivery]] = {}  # backward crossings this rank receives
        self.sent: list[list[Delivery]] = []  # sends to complete
        self.rows: dict[str, torch.Tensor] = {}  # a forward's rows on the first language stage
        self.feed: LanguageFeed | None = None
        self.errors: list[str] = []
        # A forward's loss off the language model and the crossings: a zero that backward accepts.
        self.loss = torch.zeros((), device=parts.device, requires_grad=shape.mode == "forward")
        self.ids: torch.Tensor | None = None

    # ------------------------------------------------------------------ encoders
    def do_encode(self, a: Action) -> None:
        self.local.encode(a.microbatch, a.module)
        if (not self.parts.trainable[a.module] and self.shape.mode != "predict"
                and (a.microbatch is None or a.microbatch == len(self.crossings) - 1)):
            # A frozen encoder has no backward, where FSDP2 reshards a root (and, with
            # reshard_after_forward=False, every block): its last forward of the step puts it
            # back on its shards (no communication), or it would stay gathered for good.
            # (A prediction keeps it gathered: `generate` reshards at its end.)
            reshard_fsdp_modules(self.local.encoders[a.module])

    def do_backward(self, a: Action) -> None:
        ks = range(len(self.crossings)) if a.microbatch is None else [a.microbatch]
        grads = {k: {n: p.wait() for n, p in zip(self.crossings[k].backward_names, self.grads.pop(k, []))}
                 for k in ks}
        last = a.microbatch is None or a.microbatch == len(self.crossings) - 1
        if self.accumulation is not None and last:
            for n in self.local.encoders:  # the last backward reduces (and reshards) the accumulated state
                self.accumulation.last(n)
        reducers = self.parts.reducers
        # The step's last backward of each encoder: its dp sums start as its gradients come.
        self.local.backward(grads, arm=(lambda n: reducers[n].arm() if n in reducers else None) if last else None)
        if last:
            for n in self.local.encoders:
                if n in reducers:
                    reducers[n].flush()

    def do_encoder_pipeline(self, a: Action) -> None:
        name, pipeline = a.module, self.parts.encoder_pipelines[a.module]
        modality = self.batch.modalities[name]  # every microbatch's item shape and tokens are the batch's
        if a.microbatch is not None:  # one microbatch, stage after stage
            items = self.items[0][name]
            rows = pipeline.run_once(items.to(self.parts.device).inputs if pipeline.index == 0 else None,
                                     items.num_items, modality.tokens_per_item)
            if rows is not None:
                self.local.outputs.setdefault(0, {})[name] = rows
        else:
            # only the first stage reads the items: later stages copy none to their device
            first = pipeline.index == 0
            pipeline.run([per[name].to(self.parts.device).inputs if first else None for per in self.items],
                         [per[name].num_items for per in self.items], tuple(modality.inputs.shape[1:]),
                         modality.tokens_per_item, modality.inputs.dtype, self.parts.dim, self.crossings)
        if pipeline.stage.error:
            self.errors.append(pipeline.stage.error)
        pipeline.stage.error = None

    # ------------------------------------------------------------------ crossings
    def do_rows(self, a: Action) -> None:
        rows = self.local.outputs.get(a.microbatch, {}) if a.send else {}
        posted = self.crossings[a.microbatch].forward(rows, receives=a.recv)
        (self.received.__setitem__(a.microbatch, posted) if a.recv else self.sent.append(posted))

    def do_grads(self, a: Action) -> None:
        grads = self.feed.gradients(a.microbatch) if a.send and self.feed is not None else {}
        posted = self.crossings[a.microbatch].backward(grads, receives=a.recv)
        (self.grads.__setitem__(a.microbatch, posted) if a.recv else self.sent.append(posted))

    def do_check_rows(self, a: Action) -> None:
        self.crossings[a.microbatch].check_world(self.local.outputs.get(a.microbatch, {}))

    def do_cross(self, a: Action) -> None:
        crossing = self.crossings[a.microbatch]
        first = self.parts.language is not None and self.parts.language.first is not None
        self.rows = crossing.across(self.local.outputs.get(a.microbatch, {}), receives=first)
        if not first and any(r.requires_grad for r in self.rows.values()):
            # the loss of a rank off the language model: zero, its backward joins the crossing's
            self.loss = _ZeroConnectedTo.apply(self.parts.device, *self.rows.values())

    def do_finish_sends(self, _a: Action) -> None:
        for posted in self.sent:  # each batch waited once
            for p in posted:
                p.wait()
        self.sent.clear()
        if self.feed is not None:
            self.feed.finish()

    # ------------------------------------------------------------------ language
    @staticmethod
    def _language_shard(mb: MimoBatch, par: Parallelism, dp_rank: int) -> tuple[MimoBatch, bool]:
        """This rank's language dp shard (`par`, `dp_rank`) of microbatch `mb`, and whether it is a
        stand-in: under tp, a shard of no sample (fewer samples than dp ranks, unpipelined) is
        `stand_in_sample` instead: DTensor cannot run the decoder on an empty batch (torch 2.13's
        sharding rule for the view of ``[0, S, dim]`` in a tp Linear never returns) while the other
        dp ranks wait in FSDP's or the dp sums' collectives. The stand-in adds nothing to the loss
        or a gradient."""
        local = shard(mb, par.dp, dp_rank)
        if par.tp > 1 and local.batch_size == 0 < mb.batch_size:
            return stand_in_sample(mb), True
        return local, False

    def do_language(self, a: Action) -> None:
        parts, language = self.parts, self.parts.language
        par = parts.layout.parallelism(parts.language_name)
        dp_rank = parts.layout.coordinate(parts.language_name, parts.rank)["dp"]
        if a.module == "train":
            if language.first is not None and self.shape.encoders:
                self.feed = LanguageFeed(self.crossings, [parts.trainable[n] for n in self.shape.encoders],
                                         self.received, crossing_posts(a.nested))
                self.received = {}
            self.loss = language.run([self._language_shard(mb, par, dp_rank)[0] for mb in self.mbs],
                                     self.normalizer, self.feed)
            return
        local, stand_in = self._language_shard(self.mbs[0], par, dp_rank)
        out = language.run_once(local, self.rows, self.normalizer, predicting=a.module == "predict")
        if a.module == "predict":
            self.ids = out[:0] if stand_in and out is not None else out  # a stand-in's ids: none of the batch's
            if language.predicted_loss is not None:
                self.loss = language.predicted_loss
        elif out is not None:
            self.loss = out


class _ZeroConnectedTo(torch.autograd.Function):
    """A zero loss whose backward feeds zero gradients to `ys`: off the language model, calling
    backward on it runs this rank's part of the crossings' backward."""

    @staticmethod
    def forward(ctx, device: torch.device, *ys: torch.Tensor) -> torch.Tensor:
        ctx.like = [(y.shape, y.dtype) for y in ys]
        return torch.zeros((), device=device)

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):
        return (None, *(torch.zeros(s, dtype=d, device=_grad.device) for s, d in ctx.like))
