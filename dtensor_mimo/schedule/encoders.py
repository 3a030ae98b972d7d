"""The encoder side of a step: this rank's encoders, driven by the program's actions
(`dtensor_mimo.schedule.program`), each microbatch's rows leaving through its `Crossing`.

Encoders at pp = 1 (`LocalEncoders`) encode a microbatch per ``encode`` action and run its
backward per ``backward`` action. On ranks of their own they follow the step's crossing order
(`dtensor_mimo.schedule.order`): an encoder rank holds at most ``window + 1`` microbatches of
activations (``pp + 2`` under 1F1B), not M, and still computes microbatch i+1 while the language
model runs i. FSDP2 encoders accumulate unsharded gradients over the microbatches and reduce in
the last backward (`Accumulation`); with ``reshard_after_forward=False`` they also keep their
gathered parameters across the step (one all-gather per step instead of two per microbatch).

Encoder pipelines (pp > 1) run as torch `PipelineStage`s under torch's `ScheduleGPipe`, whose
loss function (on the encoder's last stage) is the bridge: `_CrossToLanguage` posts microbatch
i's rows as soon as they are computed, and its backward waits for microbatch i's gradient to come
back. GPipe's order (all forwards, then backwards 0..M-1) is the crossing order with a window of
M, which every rank then follows. Item counts vary per microbatch (ragged images), but torch's
stage links have static shapes. Each microbatch's items are therefore padded with zero items to a
bucket (the step's largest dp-shard item count over its microbatches, rounded up to a power of
two); every stage computes the bucket from the batch metadata, so no size crosses the wire. An
item is attended to only within itself, so padding changes no real row; the last stage drops the
padded rows before the bridge, so their gradient is zero. Stages and schedule are cached per bucket.

Encoders that share ranks with the language model cannot overlap with it (one process runs
both): their program takes the colocated three phases instead (encode, the language schedule,
backward), the library's encoders in one call on every microbatch's items, or optionally
recomputing each microbatch before its backward.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Callable, Collection, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleGPipe
from torch.distributed.tensor import DTensor, Replicate

from dtensor_mimo.bridge.hops import Delivery
from dtensor_mimo.layout import MimoLayout
from dtensor_mimo.models import FlexAttentionCore
from dtensor_mimo.models.vit import self_attentions
from dtensor_mimo.parallelize import ParallelOptions, compute_dtype, fsdp_units, parallelize, stacks
from dtensor_mimo.parallelize.checkpointing import buffers_set_aside
from dtensor_mimo.parallelize.reducer import StageReductions
from dtensor_mimo.schedule.config import stage_layers
from dtensor_mimo.schedule.crossing import Crossing
from dtensor_mimo.schedule.runtime import cached, run_schedule


def keep_encoder_stage(module: nn.Module, layers: range, first: bool, last: bool) -> None:
    """Keep only one pipeline stage's parts of a `ModalityEncoder` (in place, names unchanged):
    its encoder's `layers`; everything before the blocks (`embed`'s modules and parameters) on
    the first stage; the final norm and the projection on the last."""
    encoder = module.encoder
    for key in [k for k in encoder.layers if int(k) not in layers]:
        del encoder.layers[key]
    if not first:
        children = [name for name, _ in encoder.named_children()]
        params = [name for name, _ in encoder.named_parameters(recurse=False, remove_duplicate=False)]
        for key in [*children, *params]:
            if key not in ("layers", "norm"):
                setattr(encoder, key, None)
    if not last:
        encoder.norm = None
        module.projection = None


class EncoderStage(nn.Module):
    """One pipeline stage of a `ModalityEncoder` whose encoder has ``embed``, ``layers`` and
    ``norm`` (the library's `ViT` and `AudioEncoder`): items -> hidden -> ... -> rows."""

    def __init__(self, module: nn.Module, first: bool, last: bool, dtype: torch.dtype,
                 hidden_dtype: torch.dtype) -> None:
        super().__init__()
        self.module, self.first, self.last, self.dtype = module, first, last, dtype
        self.hidden_dtype = hidden_dtype  # between stages: the encoder's compute dtype
        self.expected_tokens = 0  # per item, from the batch metadata (set for each step)
        self.error: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Items (first stage) or hidden states ``[items, tokens, hidden]`` -> hidden states, or
        rows ``[items * tokens, dim]`` on the last stage."""
        encoder = self.module.encoder
        if self.first:
            x = encoder.embed(x)
            if x.shape[1] != self.expected_tokens:  # the stage link's shape comes from the metadata
                self.error = self.error or (
                    f"rank {torch.distributed.get_rank()}: encoder stage 0 made {x.shape[1]} tokens per "
                    f"item but the batch metadata says tokens_per_item={self.expected_tokens}: make the "
                    "batch's tokens_per_item match the encoder's output length")
                x = x.new_zeros(x.shape[0], self.expected_tokens, x.shape[2]) + 0 * x.sum()
        for layer in encoder.layers.values():
            x = layer(x)
        if self.last:
            return self.module.projection(encoder.finish(x).flatten(0, 1)).to(self.dtype)
        # torch's stage link sends it (residual adds keep embed's strides)
        return x.to(self.hidden_dtype).contiguous()


def item_bucket(counts: Sequence[int], per_octave: int = 1) -> int:
    """Items per microbatch of an encoder's step: the largest of `counts` (at least 1) rounded up
    to one of `per_octave` evenly spaced sizes in its power-of-two interval, so that a few sizes
    cover every step: powers of two for 1 (an encoder pipeline's stages, built per size), at
    most 1 / per_octave of the items padding for more."""
    n = max(1, max(counts, default=1))
    granule = max(1, (1 << (n - 1).bit_length()) // (2 * per_octave))
    return -(-n // granule) * granule


GRAPH_SIZES_PER_OCTAVE = 4
"""`item_bucket`'s sizes per power of two for an encoder that replays CUDA graphs at pp = 1
(`LocalEncoders`): torch's cudagraph trees record graphs for every new input size of a piece and
every new sequence of sizes in a run, so ragged item counts kept recording (the tiny LLaVA task
on an H200: ten-step windows of 24 to 195 ms); padded, a step's microbatches share one of at
most four sizes per octave, less than a quarter of each bucket zero items."""


def independent_items(module: nn.Module) -> bool:
    """Whether `module` encodes each item by itself, so that zero items beside the real ones,
    or other microbatches' items, change none of their rows: the library's `ModalityEncoder` of a
    `ViT` or `AudioEncoder` and a `Projection` (attention within an item, per-token layers; FSDP2's
    wrapper classes included, a subclass with a forward of its own not). A user's own encoder may
    mix items (batch statistics, say): never padded, and its microbatches run one by one."""
    from dtensor_mimo.models import AudioEncoder, ModalityEncoder, Projection, ViT

    def plain(part: nn.Module, *kinds: type) -> bool:
        return any(isinstance(part, kind) and type(part).forward is kind.forward for kind in kinds)

    return (plain(module, ModalityEncoder) and plain(module.encoder, ViT, AudioEncoder)
            and plain(module.projection, Projection))


def independent_rows(module: nn.Module, options: ParallelOptions) -> bool:
    """Whether each item's rows of encoder `module` under `options` depend on that item alone:
    it encodes items independently (`independent_items`) and is not in float8 (whose tensorwise
    scales span every item of a call). Such an encoder may be padded with zero items and run a
    colocated step's microbatches in one call (`LocalEncoders`; the planner's
    `ModuleProfile.one_call`)."""
    return options.fp8 is None and independent_items(module)


class _CrossToLanguage(torch.autograd.Function):
    """The encoder stage's "loss": forward posts the rows' crossing and returns a zero;
    backward receives the rows' gradient from the language side."""

    @staticmethod
    def forward(ctx, sender: "EncoderSender", index: int, *rows: torch.Tensor) -> torch.Tensor:
        ctx.sender, ctx.index = sender, index
        ctx.like = [(r.shape, r.dtype, r.device) for r in rows]
        sender.send(index, rows)
        return rows[0].new_zeros(())

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):
        return (None, None, *ctx.sender.receive(ctx.index, ctx.like))


class EncoderSender:
    """Posts this rank's encoder rows per microbatch and receives their gradients.

    `items` (encoder pipelines): real items per microbatch; the last stage's rows of the
    padded items (at the end, `bucket` items in all) stay behind."""

    def __init__(self, names: Sequence[str], bucket: int = 1) -> None:
        self.names, self.bucket = list(names), bucket
        self.crossings: list[Crossing] = []
        self.items: list[int] | None = None
        self._sent: list[list[Delivery]] = []

    def start(self, crossings: Sequence[Crossing], items: list[int] | None = None) -> None:
        """Begin a step (an FSDP2 stage reduces in its last backward: `EncoderPipeline.run`)."""
        self.crossings, self.items = list(crossings), items

    def loss(self, rows: torch.Tensor | tuple[torch.Tensor, ...], index: int) -> torch.Tensor:
        """torch's loss function on the encoder's last stage: the rows cross to the language model."""
        rows = (rows,) if isinstance(rows, torch.Tensor) else tuple(rows)
        if self.items is not None:
            (r,) = rows
            rows = (r[: self.items[index] * (r.shape[0] // self.bucket)],)
        return _CrossToLanguage.apply(self, index, *rows)

    def send(self, index: int, rows: Sequence[torch.Tensor]) -> None:
        self._sent.append(self.crossings[index].forward(dict(zip(self.names, rows)), receives=False))

    def receive(self, index: int, like: Sequence[tuple]) -> list[torch.Tensor]:
        """Microbatch `index`'s gradient of each encoder's rows (`like`: their shapes)."""
        crossing = self.crossings[index]
        grads = dict(zip(crossing.backward_names,
                         (p.wait() for p in crossing.backward({}, receives=True))))
        # Rows that disagreed with the plan were sent as zeros: a zero gradient, and the backward
        # still runs, so the encoder's own collectives (FSDP) stay in step with its other ranks.
        return [g if (g := grads.get(n)) is not None and g.shape == shape
                else torch.zeros(shape, dtype=dtype, device=device)
                for n, (shape, dtype, device) in zip(self.names, like)]

    def finish(self) -> None:
        """Complete this step's row sends (each batch waited once)."""
        for pendings in self._sent:
            for p in pendings:
                p.wait()
        self._sent.clear()


class Accumulation:
    """FSDP2 across a step's microbatches of some encoders (a context): each microbatch's backward
    accumulates unsharded gradients (no reduce-scatter, and not FSDP's last backward, so its
    prefetching state survives) and, for the encoders in `keep_gathered`, keeps the parameters
    gathered; `last(name)` before an encoder's last backward, which reduces and reshards. On
    exit (an exception too) every module gets FSDP2's defaults back."""

    def __init__(self, encoders: Mapping[str, nn.Module], keep_gathered: Collection[str] = ()) -> None:
        self.modules = {n: fsdp_units(e) for n, e in encoders.items()}
        self.keep_gathered = set(keep_gathered)

    def _set(self, name: str, accumulate: bool) -> None:
        for m in self.modules[name]:
            m.set_requires_gradient_sync(not accumulate, recurse=False)
            m.set_is_last_backward(not accumulate)
            if name in self.keep_gathered:
                m.set_reshard_after_backward(not accumulate, recurse=False)

    def __enter__(self) -> "Accumulation":
        for name in self.modules:
            self._set(name, True)
        return self

    def last(self, name: str) -> None:
        self._set(name, False)

    def __exit__(self, *_exc) -> None:
        for name in self.modules:
            self._set(name, False)


class EncoderPipeline:
    """One encoder's pipeline stage on this rank (encoder pp > 1) and torch's GPipe over its pp
    group, cached per item bucket, item shape and item dtype."""

    def __init__(self, name: str, stage: EncoderStage, stage_index: int, n_stages: int,
                 pp_group: dist.ProcessGroup, hidden: int, device: torch.device) -> None:
        self.name, self.stage, self.index, self.n_stages = name, stage, stage_index, n_stages
        self.pp_group, self.hidden, self.device = pp_group, hidden, device
        self._cache: OrderedDict = OrderedDict()
        self.reductions = StageReductions([stage])  # dp: reduce during the stage's last backward

    def _build(self, bucket: int, tokens_per_item: int, item_shape: tuple[int, ...], item_dtype: torch.dtype | None,
               out_dim: int) -> tuple[ScheduleGPipe, PipelineStage, EncoderSender]:
        first, last = self.index == 0, self.index == self.n_stages - 1
        dtype, hidden_dtype = self.stage.dtype, self.stage.hidden_dtype
        hidden = (bucket, tokens_per_item, self.hidden)
        x = (torch.zeros(bucket, *item_shape, dtype=item_dtype, device=self.device) if first
             else torch.empty(hidden, dtype=hidden_dtype, device=self.device, requires_grad=True))
        y = (torch.empty(bucket * tokens_per_item, out_dim, dtype=dtype, device=self.device) if last
             else torch.empty(hidden, dtype=hidden_dtype, device=self.device, requires_grad=True))
        stage = PipelineStage(self.stage, self.index, self.n_stages, self.device, input_args=(x,),
                              output_args=(y,), group=self.pp_group)
        sender = EncoderSender([self.name], bucket)
        return ScheduleGPipe(stage, self.microbatches, loss_fn=sender.loss, scale_grads=False), stage, sender

    def run(self, items: list[torch.Tensor | None], counts: list[int], item_shape: tuple[int, ...],
            tokens_per_item: int, item_dtype: torch.dtype, out_dim: int, crossings: Sequence[Crossing]) -> None:
        """`items`: this rank's dp shard of every microbatch's items on the first stage (None on
        the others, which copy no item to their device);
        `counts`, `item_shape`, `tokens_per_item`, `item_dtype`: from the batch metadata, the same
        on every stage, which therefore all pick the same bucket and cached stages (the first stage
        is built for the items' dtype, which torch checks under TORCH_DISTRIBUTED_DEBUG=DETAIL: a
        stage built for another dtype would fail there alone)."""
        bucket, self.microbatches = item_bucket(counts), len(counts)
        key = (bucket, len(counts), tokens_per_item, tuple(item_shape), item_dtype, out_dim)
        schedule, torch_stage, sender = cached(self._cache, key, lambda: self._build(
            bucket, tokens_per_item, tuple(item_shape), item_dtype if self.index == 0 else None, out_dim))
        self.stage.expected_tokens = tokens_per_item
        padded = [(torch.cat([x, x.new_zeros(bucket - x.shape[0], *x.shape[1:])]),) if self.index == 0 else ()
                  for x in items]
        sender.start(crossings, items=list(counts))
        with self.reductions.step(len(counts)):
            run_schedule(schedule, [torch_stage], padded, None, list(range(len(counts))))
        sender.finish()

    def run_once(self, items: torch.Tensor | None, count: int, tokens_per_item: int) -> torch.Tensor | None:
        """One microbatch forward through every stage, outside torch's schedule (a forward or a
        prediction): `items` (the first stage's: this dp rank's items) or the previous stage's
        hidden states ``[count, tokens_per_item, hidden]``, sized from the batch metadata, go in;
        returns the rows on the last stage, else None. Blocking point-to-point in stage order
        (stage s sends to s + 1 before anyone posts s + 1's send), so NCCL cannot deadlock."""
        self.stage.expected_tokens = tokens_per_item
        if self.index == 0:
            x = items
        else:
            x = torch.empty(count, tokens_per_item, self.hidden, dtype=self.stage.hidden_dtype, device=self.device)
            dist.recv(x, group=self.pp_group, group_src=self.index - 1)
        y = self.stage(x)
        if self.index == self.n_stages - 1:
            return y
        dist.send(y.contiguous(), group=self.pp_group, group_dst=self.index + 1)
        return None


class LocalEncoders:
    """This rank's pp = 1 encoders over a step's microbatches, driven by the program's ``encode``
    and ``backward`` actions: each microbatch's rows are kept (with their graph) until their
    gradients come back.

    An encoder named in `recompute` keeps no graph between its ``encode`` and its ``backward``:
    it encodes without autograd (saving the RNG state) and recomputes the microbatch right before
    its backward (same RNG state, so dropout masks repeat; its buffers put back after, so a
    BatchNorm's running statistics take each microbatch once), freeing the graph before the next
    microbatch's. Costs one more encoder forward per step; what colocated encoders hold while the
    language schedule runs drops from M microbatches' activations to none.

    ``encode`` of every microbatch at once (the colocated phase 1) runs an encoder named in
    `independent` (each item's rows depend on that item alone) once on all the step's items,
    microbatch after microbatch, and cuts its rows per microbatch (views of one output, so the
    backward is one call too): one encoder call a step, not one a microbatch (fewer launches,
    CUDA-graph replays and FSDP2 all-gathers; larger matmuls; the same rows up to the matmuls'
    order of sums). Its transient memory in forward, and in a checkpointed block's
    recomputation, is then that of the step's items at once; what it keeps for backward is
    what the microbatches kept together before. Others run microbatch by microbatch: a user's
    own encoder (which may mix items), one in float8 (whose scales span a call's items), one in
    `recompute` (recomputed microbatch by microbatch: the colocated phases' memory saver), and
    one with items of their own sizes (a list per microbatch).

    An encoder named in `padded` (one of `independent` that replays CUDA graphs) runs each of
    its calls on a bucket of items, `item_bucket` of the step's largest call at
    `GRAPH_SIZES_PER_OCTAVE`: zero items after the real ones, whose rows are dropped before they
    leave (their gradient zero), so that a few input sizes cover every step.

    Args:
        encoders: this rank's pp = 1 encoders, by name.
        inputs: per microbatch, each encoder's dp-shard items on the device.
        dtype: what crosses the bridge.
        recompute: names of the encoders recomputed before their backward (trainable ones).
        padded: names of the encoders whose items are padded to the step's bucket.
        independent: names of the encoders whose rows of an item depend on that item alone (the
            same on every rank of an encoder: the calls, and so FSDP2's collectives, match).
        pad_empty: names of the encoders whose call on no item runs on one zero item instead, its
            rows dropped (`RankParts.empty_padded_encoders`: where torch cannot run the empty call,
            e.g. dynamo tracing the sequence shard of compiled blocks under tp with sp, "unhashable
            type: non-nested SymInt" on the encoder's ranks only, the language ranks left waiting).
        device: the device the encoders and their items are on: whose random state a
            recomputation replays (items of their own sizes come as a list, possibly empty).
    """

    def __init__(self, encoders: Mapping[str, nn.Module], inputs: Sequence[Mapping[str, torch.Tensor]],
                 dtype: torch.dtype, recompute: Collection[str] = (), padded: Collection[str] = (),
                 independent: Collection[str] = (), device: torch.device = torch.device("cpu"),
                 pad_empty: Collection[str] = ()) -> None:
        self.encoders, self.inputs, self.dtype, self.device = encoders, inputs, dtype, device
        self.pad_empty = set(pad_empty)
        self.recompute = set(recompute)
        self.padded, self.independent = set(padded), set(independent)
        self.buckets: dict[str, int] = {}
        """Items each call of an encoder in `padded` runs on (items of their own size: none), set
        by the step's first ``encode``: for each microbatch, or for all of them at once."""
        self.outputs: dict[int, dict[str, torch.Tensor]] = {}
        """Rows per microbatch and encoder, until their backward."""
        self.errors: list[str] = []
        """Encoder outputs that were no tensor of rows (`_as_rows`: they cross as zeros, the step agrees)."""
        self._rng: dict[tuple[int, str], tuple] = {}

    def encode(self, k: int | None, name: str) -> None:
        """Encode microbatch `k`'s items with encoder `name` (without a graph if it is
        recomputed), or every microbatch's (`k` None), into `outputs`."""
        every = [j for j, per in enumerate(self.inputs) if name in per]
        xs = [self.inputs[j][name] for j in every]
        tensors = all(isinstance(x, torch.Tensor) for x in xs)
        at_once = k is None and len(xs) > 1 and tensors and name in self.independent and name not in self.recompute
        if name in self.padded and tensors and name not in self.buckets:
            self.buckets[name] = item_bucket([sum(map(len, xs))] if at_once else list(map(len, xs)),
                                             GRAPH_SIZES_PER_OCTAVE)
        if not at_once:
            for j in every if k is None else [k]:
                self._encode_one(j, name)
            return
        rows = self._rows(name, torch.cat(xs))
        per_item = len(rows) // max(1, sum(map(len, xs)))  # the same for every item (`independent_items`)
        for j, part in zip(every, rows.split([len(x) * per_item for x in xs])):
            self.outputs.setdefault(j, {})[name] = part

    def _encode_one(self, k: int, name: str) -> None:
        x = self.inputs[k][name]
        if name in self.recompute:
            self._rng[k, name] = _rng_state(self.device)
            with torch.no_grad():
                rows = self._rows(name, x)
        else:
            rows = self._rows(name, x)
        self.outputs.setdefault(k, {})[name] = rows

    def _rows(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Encoder `name`'s rows of items `x`, in the bridge's dtype; run on the step's bucket of
        items when it pads them, the rows of the padding dropped."""
        bucket = self.buckets.get(name)
        if bucket is None and isinstance(x, torch.Tensor) and len(x) == 0 and name in self.pad_empty:
            # torch 2.11's DTensor cannot view an empty batch [0, tokens, dim] (its view rule
            # raises IndexError), which a tp encoder meets on a microbatch without items, nor can
            # 2.13's dynamo trace one under sp: one zero item instead, its rows dropped (no rows,
            # every parameter a zero gradient)
            bucket = 1
        if bucket is None or len(x) == bucket:
            return _plain(self._as_rows(name, self.encoders[name](x))).to(self.dtype)
        rows = _plain(self._as_rows(name, self.encoders[name](torch.cat([x, x.new_zeros(bucket - len(x),
                                                                                            *x.shape[1:])]))))
        return rows[: len(rows) // bucket * len(x)].to(self.dtype)

    def _as_rows(self, name: str, out: object) -> torch.Tensor:
        """Encoder `name`'s output `out` if it is a tensor (the protocol's rows). Anything else (a
        tuple, a dict, a model-output object) raised on the encoder's ranks alone, while the
        language ranks waited for its rows in the exchange: it is recorded in `errors` (the step
        agrees on it, every rank raises) and stands in as a scalar of its tensors times zero, which
        the crossing sends as zeros of the planned shape and whose backward still reaches the
        parameters those tensors came from (a zero gradient each: the dp peers' reductions match)."""
        if isinstance(out, torch.Tensor):
            return out
        kind = type(out).__name__
        self.errors.append(f"rank {dist.get_rank()}: encoder {name!r} returned a {kind}, not a tensor: "
                           "an encoder's forward returns its rows as one tensor [items * tokens_per_item, out_dim] "
                           f"(return the rows from the {kind}, e.g. in a wrapper module's forward)")
        floats = [(t.to_local() if isinstance(t, DTensor) else t).float().sum() for t in _tensors(out)
                  if t.is_floating_point()]
        return (sum(floats) * 0 if floats else torch.zeros((), device=self.device)).reshape(1)

    def backward(self, grads: Mapping[int, Mapping[str, torch.Tensor]],
                 arm: Callable[[str], None] | None = None) -> None:
        """The backward of the microbatches in `grads` (``{k: {encoder: gradient of its rows}}``):
        the kept graphs in one call, then each recomputed microbatch's forward and backward in
        turn, each recomputed encoder reducing once, in its last one (a zero gradient for rows that
        disagreed with the plan, so every rank of an encoder runs the same backward). `arm`: this
        is the step's last backward, and `arm(name)` comes right before each encoder's last
        backward call (its dp sums then start as its gradients come)."""
        outputs = {k: self.outputs.pop(k, {}) for k in grads}
        if arm is not None:
            for n in {n for out in outputs.values() for n in out if n not in self.recompute}:
                arm(n)
        _backward([{n: o for n, o in out.items() if n not in self.recompute} for out in outputs.values()],
                  list(grads.values()))
        steps = [(k, n) for k, out in outputs.items() for n in out if n in self.recompute]
        last = {n: i for i, (_, n) in enumerate(steps)}
        with Accumulation({n: self.encoders[n] for n in last}) as accumulation:
            for i, (k, n) in enumerate(steps):
                if last[n] == i:
                    accumulation.last(n)
                    if arm is not None:
                        arm(n)
                x = self.inputs[k][n]
                with _replayed(self._rng.pop((k, n)), self.device), buffers_set_aside(self.encoders[n]):
                    rows = self._rows(n, x)
                _backward([{n: rows}], [grads[k]])


def _tensors(out: object) -> list[torch.Tensor]:
    """The tensors inside an encoder's output of another kind than a tensor (tuples, lists, dicts)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Mapping):
        out = list(out.values())
    return [t for x in out for t in _tensors(x)] if isinstance(out, (list, tuple)) else []


def _plain(rows: torch.Tensor) -> torch.Tensor:
    """An encoder's rows as the plain tensor the bridge sends: a DTensor (a user's tp plan that
    keeps its output one, e.g. ``RowwiseParallel(use_local_output=False)``) made whole on every
    rank of its mesh (the same collective on each, differentiable), then its local tensor. Sent
    as it was, it failed in the bridge's send on some tp ranks only ("c10d.send.default does not
    have a sharding strategy"), the language ranks waiting for its rows."""
    if isinstance(rows, DTensor):
        if any(not p.is_replicate() for p in rows.placements):
            rows = rows.redistribute(rows.device_mesh, [Replicate()] * rows.device_mesh.ndim)
        rows = rows.to_local()
    return rows


def _backward(outputs: Sequence[Mapping[str, torch.Tensor]], grads: Sequence[Mapping[str, torch.Tensor]]) -> None:
    """One backward over `outputs` (rows per microbatch and encoder) with the received `grads`."""
    pairs = [(out, g if (g := grads[i].get(n)) is not None and g.shape == out.shape else torch.zeros_like(out))
             for i, mb in enumerate(outputs) for n, out in mb.items() if out.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _rng_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextlib.contextmanager
def _replayed(state: tuple, device: torch.device) -> Iterator[None]:
    """Run with the RNG state `state` (`_rng_state`), leaving the current state as it was."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def build_encoder_part(layout: MimoLayout, name: str, module: nn.Module, options: ParallelOptions,
                       rank: int, dtype: torch.dtype, device: torch.device
                       ) -> tuple[nn.Module, nn.Module, EncoderPipeline | None]:
    """Encoder `name`'s part on this rank, parallelized (`parallelize`: tp, checkpointing and
    compile on each of its stacks, the tower and the projection, or a user's own encoder with its
    own tp plan; then FSDP2 or autocast on the part: the module at pp = 1, this rank's pipeline
    stage of it at pp > 1). `dtype`: what crosses the bridge. Returns the module, the root FSDP2
    was applied to, and the stage's `EncoderPipeline` (pp > 1)."""
    pp = layout.parallelism(name).pp
    tp_mesh, dp_mesh = layout.mesh(name, "tp"), layout.fsdp_mesh(name)  # 2-D with HSDP
    if options.flex_attention:  # items of their own size: one FlexAttention kernel a block
        core = FlexAttentionCore()
        for attention in self_attentions(module):
            attention.packed_attention_fn = core.packed
    root: nn.Module = module
    pipeline, first_block = None, 0
    if pp > 1:  # the stage keeps only its parts of the encoder (names unchanged); FSDP2 on the stage
        s = layout.coordinate(name, rank)["pp"]
        layers = stage_layers(len(module.encoder.layers), pp, module=name)[s]
        first_block = layers.start  # activation checkpointing counts the whole tower's blocks
        keep_encoder_stage(module, layers, s == 0, s == pp - 1)
        root = EncoderStage(module, s == 0, s == pp - 1, dtype, compute_dtype(options, module))
        pipeline = EncoderPipeline(name, root, s, pp, layout.mesh(name, "pp").get_group(),
                                   module.encoder.config.dim, device)
    parallelize(root, tp_mesh, dp_mesh, options, parts=stacks(module), name=name, ragged_rows=True,
                first_block=first_block)
    return module, root, pipeline
