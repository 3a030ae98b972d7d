"""The encoder side of a pipelined step: each microbatch's rows leave through its `Crossing`.

Encoders on ranks of their own (disjoint from the language model) run as torch `PipelineStage`s
under torch's `ScheduleGPipe`, whose loss function (on the encoder's last stage) is the bridge:
`_CrossToLanguage` posts microbatch i's rows to the first language stage as soon as they are
computed (so the encoder computes microbatch i+1 while the language model runs microbatch i), and
its backward waits for microbatch i's gradient to come back, after which the schedule runs that
microbatch's encoder backward. GPipe's order (all forwards, then backwards 0..M-1) is the global
crossing order of `dtensor_mimo.schedule.crossing`, whatever schedule the language model runs.

Encoder pipelines (pp > 1): item counts vary per microbatch (ragged images), but torch's stage
links have static shapes. Each microbatch's items are therefore padded with zero items to a
bucket (the step's largest dp-shard item count over its microbatches, rounded up to a power of
two); every stage computes the bucket from the batch metadata, so no size crosses the wire. An
item is attended to only within itself, so padding changes no real row; the last stage drops the
padded rows before the bridge, so their gradient is zero. Stages and schedule are cached per bucket.

Encoders that share ranks with the language model cannot overlap with it (one process runs
both): they take the colocated three phases instead (`encode_all`, the language schedule,
then `backward_all`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleGPipe

from dtensor_mimo.bridge.hops import Delivery
from dtensor_mimo.schedule.crossing import Crossing
from dtensor_mimo.schedule.runtime import cached, run_schedule


class LocalEncoders(nn.Module):
    """This rank's encoders as one stage module: ``(*inputs) -> (*rows)`` in `names` order,
    rows cast to the dtype that crosses the bridge."""

    def __init__(self, encoders: dict[str, nn.Module], dtype: torch.dtype) -> None:
        super().__init__()
        self.encoders = nn.ModuleDict(encoders)
        self.dtype = dtype

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One input per encoder, in order -> its rows ``[items * tokens, dim]``."""
        return tuple(enc(x).to(self.dtype) for enc, x in zip(self.encoders.values(), inputs))


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


def item_bucket(counts: Sequence[int]) -> int:
    """Items per microbatch of an encoder pipeline's stages: the largest count, rounded up to a
    power of two (at least 1), so a handful of buckets cover every step."""
    return 1 << (max(1, max(counts, default=1)) - 1).bit_length()


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
        self._fsdp: list[FSDPModule] = []

    def start(self, crossings: Sequence[Crossing], items: list[int] | None = None,
              defer_sync: nn.Module | None = None) -> None:
        """Begin a step. `defer_sync`: a module whose FSDP gradient reduction waits for the last
        microbatch's backward (torch's stage does this itself only for an FSDP stage module)."""
        self.crossings, self.items = list(crossings), items
        self._fsdp = [m for m in defer_sync.modules() if isinstance(m, FSDPModule)] if defer_sync else []
        for m in self._fsdp:
            m.set_requires_gradient_sync(False)

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
        if index == len(self.crossings) - 1:  # the last backward reduces the accumulated gradients
            for m in self._fsdp:
                m.set_requires_gradient_sync(True)
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
        for m in self._fsdp:
            m.set_requires_gradient_sync(True)


def run_encoder_schedule(module: LocalEncoders, names: Sequence[str], inputs: list[tuple[torch.Tensor, ...]],
                         crossings: Sequence[Crossing], pp_group: dist.ProcessGroup, device: torch.device) -> None:
    """Forward and backward of this rank's pp = 1 encoders on every microbatch under torch's
    GPipe (one stage: nothing is cached, there is no stage link)."""
    sender = EncoderSender(names)
    examples = tuple(x.detach() for x in inputs[0])
    outputs = tuple(torch.empty(0, device=device) for _ in names)  # metadata only: no send
    stage = PipelineStage(module, 0, 1, device, input_args=examples, output_args=outputs, group=pp_group)
    sender.start(crossings, defer_sync=module)
    run_schedule(ScheduleGPipe(stage, len(inputs), loss_fn=sender.loss, scale_grads=False), [stage],
                 list(inputs), None, list(range(len(inputs))))
    sender.finish()


class EncoderPipeline:
    """One encoder's pipeline stage on this rank (encoder pp > 1) and torch's GPipe over its pp
    group, cached per item bucket and item shape."""

    def __init__(self, name: str, stage: EncoderStage, stage_index: int, n_stages: int,
                 pp_group: dist.ProcessGroup, hidden: int, device: torch.device) -> None:
        self.name, self.stage, self.index, self.n_stages = name, stage, stage_index, n_stages
        self.pp_group, self.hidden, self.device = pp_group, hidden, device
        self._cache: OrderedDict = OrderedDict()

    def _build(self, bucket: int, tokens_per_item: int, item_shape: tuple[int, ...], item_dtype: torch.dtype,
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

    def run(self, items: list[torch.Tensor], counts: list[int], item_shape: tuple[int, ...],
            tokens_per_item: int, out_dim: int, crossings: Sequence[Crossing]) -> None:
        """`items`: this rank's dp shard of every microbatch's items (the first stage uses them);
        `counts`, `item_shape`, `tokens_per_item`: from the batch metadata, the same on every
        stage, which therefore all pick the same bucket and cached stages."""
        bucket, self.microbatches = item_bucket(counts), len(counts)
        key = (bucket, len(counts), tokens_per_item, tuple(item_shape), out_dim)
        schedule, torch_stage, sender = cached(self._cache, key, lambda: self._build(
            bucket, tokens_per_item, tuple(item_shape), items[0].dtype, out_dim))
        self.stage.expected_tokens = tokens_per_item
        padded = [(torch.cat([x, x.new_zeros(bucket - x.shape[0], *x.shape[1:])]),) if self.index == 0 else ()
                  for x in items]
        sender.start(crossings, items=list(counts))
        run_schedule(schedule, [torch_stage], padded, None, list(range(len(counts))))
        sender.finish()


def encode_all(encoders: dict[str, nn.Module], inputs: list[dict[str, torch.Tensor]],
               dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """Colocated phase 1: this rank's encoder rows of every microbatch (graphs kept)."""
    return [{n: encoders[n](x).to(dtype) for n, x in mb.items()} for mb in inputs]


def backward_all(outputs: list[dict[str, torch.Tensor]], grads: list[dict[str, torch.Tensor]]) -> None:
    """Colocated phase 3: one encoder backward over every microbatch's rows (a zero gradient for
    rows that disagreed with the plan, so every rank of an encoder runs the same backward)."""
    pairs = [(out, g if (g := grads[i].get(n)) is not None and g.shape == out.shape else torch.zeros_like(out))
             for i, mb in enumerate(outputs) for n, out in mb.items() if out.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
