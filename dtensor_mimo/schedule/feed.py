"""How encoder rows enter the first language stage per microbatch, and how their gradients leave.

The first stage's module asks the feed for microbatch i's rows when torch's schedule runs its
forward; the rows go through `_Rows`, whose backward (run by the schedule's backward of that
microbatch) hands their gradients back to the feed. The feed then either posts the backward
crossings in microbatch order as soon as they can go (encoders on other ranks: they wait for
them and run each microbatch's backward when it arrives) or keeps the gradients until the
schedule is done (colocated: this process runs the encoder backward itself, afterwards).

Forward receives follow the step's crossing order (`dtensor_mimo.schedule.order`): the first
`window` at once, then microbatch ``j + window``'s right after the gradient of ``j`` has been
posted, as the encoder ranks post their sends.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dtensor_mimo.bridge.hops import Delivery
from dtensor_mimo.schedule.crossing import Crossing


class _Rows(torch.autograd.Function):
    """Identity on one microbatch's rows; backward gives their gradients to the feed."""

    @staticmethod
    def forward(ctx, feed: "LanguageFeed", index: int, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.feed, ctx.index = feed, index
        return tuple(r.view_as(r) for r in rows)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        ctx.feed.gradient(ctx.index, grads)
        return (None, None, *([None] * len(grads)))


class LanguageFeed:
    """Encoder rows for the first language stage, one microbatch at a time (on first-stage ranks).

    Args:
        crossings: one per microbatch.
        trainable: per encoder name (same order as the crossings' names), whether gradients go back.
        post_gradients: True: post each microbatch's backward crossing as soon as its gradients
            exist; False: keep them for `gradients()` (colocated encoders).
        window: forward receives posted ahead of the gradients (`crossing_window`), when the feed
            posts them itself.
        received: per microbatch, the forward exchange already posted (one `Delivery` per
            encoder): the colocated path posts every forward before the language schedule.
    """

    def __init__(self, crossings: Sequence[Crossing], trainable: Sequence[bool], post_gradients: bool,
                 window: int | None = None, received: Sequence[list[Delivery]] | None = None) -> None:
        self.crossings = list(crossings)
        self.names = self.crossings[0].names if self.crossings else []
        self.trainable = list(trainable)
        self.post_gradients = post_gradients
        self.window = len(self.crossings) if window is None else window
        self._received: list[list[Delivery] | None] = (
            list(received) if received is not None else [None] * len(self.crossings))
        for k in range(min(self.window, len(self.crossings))):
            self._receive(k)
        self._grads: dict[int, dict[str, torch.Tensor]] = {}
        self._sent: list[list[Delivery]] = []
        self._next_post = 0

    def _receive(self, index: int) -> None:
        if self._received[index] is None:
            self._received[index] = self.crossings[index].forward({}, receives=True)

    def rows(self, index: int) -> dict[str, torch.Tensor]:
        """Microbatch `index`'s rows on this rank, ``{encoder: [rows, dim]}``, connected to the feed."""
        pending = self._received[index]
        if pending is None:  # the schedule ran ahead of `crossing_window`: a bug, not a hang
            raise RuntimeError(f"the language schedule asked for microbatch {index}'s encoder rows before the "
                               f"gradients of microbatch {index - self.window} left (crossing window "
                               f"{self.window}); dtensor_mimo.schedule.order misjudged this schedule")
        self._received[index] = []  # waited once
        outs = [p.wait() for p in pending]
        for out, trains in zip(outs, self.trainable):
            out.requires_grad_(trains)
        if not any(self.trainable):
            return dict(zip(self.names, outs))
        return dict(zip(self.names, _Rows.apply(self, index, *outs)))

    def gradient(self, index: int, grads: Sequence[torch.Tensor]) -> None:
        """Called by `_Rows.backward` for microbatch `index` (autograd gives zeros for rows that
        got no gradient)."""
        self._grads[index] = {n: g for n, g, t in zip(self.names, grads, self.trainable) if t}
        # Backward crossings go out in microbatch order, the global order every rank follows,
        # whatever order the schedule ran the backwards in (LoopedBFS: last microbatch first; the
        # zero-bubble schedules, V-shaped included: the first stage's weight pass, when torch
        # fits it in), so the messages between any two ranks keep one order on both sides (NCCL).
        while self.post_gradients and self._next_post in self._grads:
            grads_out = self._grads.pop(self._next_post)
            self._sent.append(self.crossings[self._next_post].backward(grads_out, receives=False))
            if self._next_post + self.window < len(self.crossings):
                self._receive(self._next_post + self.window)
            self._next_post += 1

    def gradients(self, index: int) -> dict[str, torch.Tensor]:
        """The kept gradients of microbatch `index` (``post_gradients=False``)."""
        return self._grads.pop(index, {})

    def finish(self) -> None:
        """Complete the posted gradient sends (each batch waited once)."""
        for pendings in self._sent:
            for p in pendings:
                p.wait()
        self._sent.clear()
