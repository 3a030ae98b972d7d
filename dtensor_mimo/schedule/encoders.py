"""The encoder side of a pipelined step: each microbatch's rows leave through its `Crossing`.

Encoders on ranks of their own (disjoint from the language model) run as one torch
`PipelineStage` per rank under torch's `ScheduleGPipe`, whose loss function is the bridge:
`_CrossToLanguage` posts microbatch i's rows to the first language stage as soon as they are
computed (so the encoder computes microbatch i+1 while the language model runs microbatch i), and
its backward waits for microbatch i's gradient to come back, after which the schedule runs that
microbatch's encoder backward. GPipe's order (all forwards, then backwards 0..M-1) is the global
crossing order of `dtensor_mimo.schedule.crossing`, whatever schedule the language model runs.

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


def run_encoder_schedule(module: LocalEncoders, inputs: list[tuple[torch.Tensor, ...]],
                         crossings: Sequence[Crossing], pp_group, device: torch.device) -> None:
    """Forward and backward of this rank's encoders on every microbatch under torch's GPipe."""
    names = list(module.encoders)
    sender = EncoderSender(crossings, names)
    n = len(inputs)
    examples = tuple(x.detach() for x in inputs[0])
    with torch.no_grad():
        outputs = tuple(torch.empty(0, device=device) for _ in names)  # metadata only
    stage = PipelineStage(module, 0, 1, device, input_args=examples, output_args=outputs, group=pp_group)
    schedule = ScheduleGPipe(stage, n, loss_fn=lambda rows, i: _CrossToLanguage.apply(sender, i, *rows),
                             scale_grads=False)
    stage.has_backward = True
    schedule._step_microbatches(list(inputs), None, list(range(n)), None, return_outputs=False)
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
