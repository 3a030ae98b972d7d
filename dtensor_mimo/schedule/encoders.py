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

from typing import Sequence

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleGPipe

from dtensor_mimo.bridge.exchange import Pending
from dtensor_mimo.schedule.crossing import Crossing


class LocalEncoders(nn.Module):
    """This rank's encoders as one stage module: ``(*inputs) -> (*rows)`` in `names` order,
    rows cast to the dtype that crosses the bridge."""

    def __init__(self, encoders: dict[str, nn.Module], dtype: torch.dtype) -> None:
        super().__init__()
        self.encoders = nn.ModuleDict(encoders)
        self.dtype = dtype

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(enc(x).to(self.dtype) for enc, x in zip(self.encoders.values(), inputs))


def keep_encoder_stage(module: nn.Module, layers: range, first: bool, last: bool) -> None:
    """Keep only one pipeline stage's parts of a `ModalityEncoder` (in place, names unchanged):
    its encoder's `layers`; everything before the blocks (`embed`'s modules and parameters) on
    the first stage; the final norm and the projection on the last."""
    encoder = module.encoder
    for key in [k for k in encoder.layers if int(k) not in layers]:
        del encoder.layers[key]
    if not first:
        for key in [*encoder._modules, *encoder._parameters]:
            if key not in ("layers", "norm"):
                setattr(encoder, key, None)
    if not last:
        encoder.norm = None
        module.projection = None


class EncoderStage(nn.Module):
    """One pipeline stage of a `ModalityEncoder` whose encoder has ``embed``, ``layers`` and
    ``norm`` (the library's `ViT` and `AudioEncoder`): items -> hidden -> ... -> rows."""

    def __init__(self, module: nn.Module, first: bool, last: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.module, self.first, self.last, self.dtype = module, first, last, dtype
        self.expected_tokens = 0  # per item, from the batch metadata (set for each step)
        self.error: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
            return self.module.projection(encoder.norm(x).flatten(0, 1)).to(self.dtype)
        return x.contiguous()  # torch's stage link sends it (residual adds keep embed's strides)


def item_bucket(counts: Sequence[int]) -> int:
    """Items per microbatch of an encoder pipeline's stages: the largest count, rounded up to a
    power of two (at least 1), so a handful of buckets cover every step."""
    return 1 << max(0, (max(counts, default=1) - 1).bit_length())


class _CrossToLanguage(torch.autograd.Function):
    """The encoder stage's "loss": forward posts the rows' crossing and returns a zero;
    backward receives the rows' gradient from the language side."""

    @staticmethod
    def forward(ctx, sender: "EncoderSender", index: int, *rows: torch.Tensor) -> torch.Tensor:
        ctx.sender, ctx.index = sender, index
        ctx.shapes = [r.detach() for r in rows]
        sender.send(index, rows)
        return rows[0].new_zeros(())

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):
        return (None, None, *ctx.sender.receive(ctx.index, ctx.shapes))


class EncoderSender:
    """Posts this rank's encoder rows per microbatch and receives their gradients."""

    def __init__(self, crossings: Sequence[Crossing], names: Sequence[str]) -> None:
        self.crossings, self.names = list(crossings), list(names)
        self.bucket, self.items = 1, None  # encoder pipelines: padded items per microbatch, real counts
        self._sent: list[list[Pending]] = []

    def send(self, index: int, rows: Sequence[torch.Tensor]) -> None:
        self._sent.append(self.crossings[index].forward(dict(zip(self.names, rows)), receives=False))

    def receive(self, index: int, rows: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        crossing = self.crossings[index]
        grads = dict(zip(crossing.backward_names,
                         (p.wait() for p in crossing.backward({}, receives=True))))
        # Rows that disagreed with the plan were sent as zeros: a zero gradient, and the backward
        # still runs, so the encoder's own collectives (FSDP) stay in step with its other ranks.
        return [g if (g := grads.get(n)) is not None and g.shape == r.shape else torch.zeros_like(r)
                for n, r in zip(self.names, rows)]

    def finish(self) -> None:
        for pendings in self._sent:
            for p in pendings:
                p.wait()
        self._sent.clear()


def _loss(sender: EncoderSender, rows: torch.Tensor | tuple[torch.Tensor, ...], index: int,
          items: list[int] | None = None) -> torch.Tensor:
    """The encoder's last stage's "loss": its rows cross; `items`: real items per microbatch when
    they were padded (the padded items' rows, at the end, stay behind)."""
    rows = (rows,) if isinstance(rows, torch.Tensor) else tuple(rows)
    if items is not None:
        (r,) = rows
        rows = (r[: items[index] * (r.shape[0] // sender.bucket)],)
    return _CrossToLanguage.apply(sender, index, *rows)


def run_encoder_schedule(module: nn.Module, names: Sequence[str], inputs: list[tuple[torch.Tensor, ...]],
                         crossings: Sequence[Crossing], pp_group, device: torch.device) -> None:
    """Forward and backward of this rank's encoders (pp = 1: `LocalEncoders`) on every
    microbatch under torch's GPipe."""
    sender = EncoderSender(crossings, names)
    examples = tuple(x.detach() for x in inputs[0])
    outputs = tuple(torch.empty(0, device=device) for _ in names)  # metadata only: no send
    stage = PipelineStage(module, 0, 1, device, input_args=examples, output_args=outputs, group=pp_group)
    _run(ScheduleGPipe(stage, len(inputs), loss_fn=lambda rows, i: _loss(sender, rows, i), scale_grads=False),
         [stage], inputs, sender)


class EncoderPipeline:
    """One encoder's pipeline stage on this rank (encoder pp > 1) and torch's GPipe over its pp
    group, per item bucket."""

    def __init__(self, name: str, stage: EncoderStage, stage_index: int, n_stages: int, pp_group,
                 hidden: int, device: torch.device) -> None:
        self.name, self.stage, self.index, self.n_stages = name, stage, stage_index, n_stages
        self.pp_group, self.hidden, self.device = pp_group, hidden, device
        self._cache: dict[tuple, tuple] = {}

    def run(self, items: list[torch.Tensor], counts: list[int], tokens_per_item: int, out_dim: int,
            crossings: Sequence[Crossing]) -> None:
        """`items`: this rank's dp shard of every microbatch's items (used on the first stage);
        `counts`: their numbers (every stage knows them from the metadata)."""
        bucket, first, last = item_bucket(counts), self.index == 0, self.index == self.n_stages - 1
        key = (bucket, tokens_per_item, tuple(items[0].shape[1:]) if first else None)
        if key not in self._cache:
            dtype = self.stage.dtype
            hidden = (bucket, tokens_per_item, self.hidden)
            x = (torch.zeros(bucket, *items[0].shape[1:], dtype=items[0].dtype, device=self.device) if first
                 else torch.empty(hidden, dtype=dtype, device=self.device, requires_grad=True))
            y = (torch.empty(bucket * tokens_per_item, out_dim, dtype=dtype, device=self.device) if last
                 else torch.empty(hidden, dtype=dtype, device=self.device, requires_grad=True))
            stage = PipelineStage(self.stage, self.index, self.n_stages, self.device, input_args=(x,),
                                  output_args=(y,), group=self.pp_group)
            sender = EncoderSender([], [self.name])
            sender.bucket = bucket
            schedule = ScheduleGPipe(stage, len(counts), scale_grads=False,
                                     loss_fn=lambda rows, i: _loss(sender, rows, i, sender.items))
            self._cache[key] = (stage, schedule, sender)
        stage, schedule, sender = self._cache[key]
        sender.crossings, sender.items = list(crossings), list(counts)
        self.stage.expected_tokens = tokens_per_item
        padded = [(torch.cat([x, x.new_zeros(bucket - x.shape[0], *x.shape[1:])]),) if first else ()
                  for x in items]
        _run(schedule, [stage], padded, sender)


def _run(schedule, stages, inputs, sender: EncoderSender) -> None:
    for stage in stages:  # what `step()` does before `_step_microbatches`
        stage.has_backward = True
        stage.clear_runtime_states()
    schedule._step_microbatches(list(inputs), None, list(range(len(inputs))), None, return_outputs=False)
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
