"""How encoder rows enter the first language stage per microbatch, and how their gradients leave.

The first stage's module asks the feed for microbatch i's rows when torch's schedule runs its
forward; the rows go through `_Rows`, whose backward (run by the schedule's backward of that
microbatch) hands their gradients back to the feed. The feed posts the crossings the program
nests in the language action (`dtensor_mimo.schedule.program`), in its order: each gradient in
microbatch order as soon as it can go, and after it the rows' receive the crossing window lets
in (encoders on other ranks wait for them, as their own program says); a colocated program nests
none, and the gradients wait in the feed until the schedule is done.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from dtensor_mimo.bridge.hops import Delivery
from dtensor_mimo.schedule.crossing import Crossing
from dtensor_mimo.schedule.program import Action


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
        received: the forward crossings already posted, ``{microbatch: one Delivery per encoder}``
            (the program's ``rows`` actions before the language schedule).
        script: the crossings to post from inside the schedule, in order (the language action's
            nested ``grads`` sends and ``rows`` receives, `dtensor_mimo.schedule.program`): a
            gradient goes once it exists and every one before it in the script has gone. Gradients
            the script does not send are kept for `gradients` (colocated: this process runs the
            encoder backward itself, after the schedule).
    """

    def __init__(self, crossings: Sequence[Crossing], trainable: Sequence[bool],
                 received: Mapping[int, list[Delivery]], script: Sequence[Action] = ()) -> None:
        self.crossings = list(crossings)
        self.names = self.crossings[0].names if self.crossings else []
        self.trainable = list(trainable)
        self._received: dict[int, list[Delivery]] = dict(received)
        self._script = list(script)
        self._grads: dict[int, dict[str, torch.Tensor]] = {}
        self._sent: list[list[Delivery]] = []

    def rows(self, index: int) -> dict[str, torch.Tensor]:
        """Microbatch `index`'s rows on this rank, ``{encoder: [rows, dim]}``, connected to the feed."""
        pending = self._received.pop(index, None)  # waited once
        if pending is None:  # the schedule ran ahead of the program: a bug, not a hang
            raise RuntimeError(f"the language schedule asked for microbatch {index}'s encoder rows before the "
                               "program posted their receive; dtensor_mimo.schedule.order misjudged this schedule")
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
        # The script sends gradients in microbatch order, the global order every rank follows,
        # whatever order the schedule ran the backwards in (LoopedBFS: last microbatch first; the
        # zero-bubble schedules, V-shaped included: the first stage's weight pass, when torch
        # fits it in), so the messages between any two ranks keep one order on both sides (NCCL).
        while self._script:
            action = self._script[0]
            if action.op == "grads":
                if action.microbatch not in self._grads:
                    break
                grads_out = self._grads.pop(action.microbatch)
                self._sent.append(self.crossings[action.microbatch].backward(grads_out, receives=False))
            else:
                self._received[action.microbatch] = self.crossings[action.microbatch].forward({}, receives=True)
            self._script.pop(0)

    def gradients(self, index: int) -> dict[str, torch.Tensor]:
        """The kept gradients of microbatch `index` (those the script did not send)."""
        return self._grads.pop(index, {})

    def finish(self) -> None:
        """Complete the posted gradient sends (each batch waited once)."""
        for pendings in self._sent:
            for p in pendings:
                p.wait()
        self._sent.clear()
