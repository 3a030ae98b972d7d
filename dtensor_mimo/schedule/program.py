"""The step as data: this rank's ordered actions for a training step, `model(batch)` or `predict`.

A training step, a forward and a prediction are the same thing at different lengths: each rank
encodes its share of each microbatch's items, posts the rows across the bridge, runs the
language stages, posts the rows' gradients back and runs the encoder backward. `program` writes
that down as a list of `Action`s, a pure function of what every rank knows from the config and
the batch metadata (`RankRoles`: which parts this rank holds; `StepShape`: the mode, the
encoders in the batch, the microbatches and the crossing window), so every rank derives the
same program for itself and for its peers, and the crossings between any two ranks are posted
in the same order on both sides (`dtensor_mimo.schedule.order.crossing_order`: NCCL safety).
One executor (`dtensor_mimo.schedule.executor`) runs it.

Where a torch schedule runs the language model, the language action nests what happens inside
it on the first stage: torch's own order of stage 0's computations (its ``pipeline_order``,
`order.first_stage_actions`) with the crossings the first stage posts between them; the executor
posts exactly those, in that order. Printed (`format_program`), a lean 1F1B step over two
microbatches on an encoder rank and a first-stage language rank reads::

    encode vision mb0 | send rows mb0 | encode vision mb1 | send rows mb1 | recv grads mb0 |
    backward mb0 | recv grads mb1 | backward mb1 | finish sends
    recv rows mb0 | recv rows mb1 | language train [F0 F1 B0 send grads mb0 B1 send grads mb1] |
    finish sends
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dtensor_mimo.schedule.order import crossing_order

MODES = ("train", "forward", "predict")
"""train: forward and backward of every microbatch (`MimoModel.forward_backward`); forward: one
microbatch whose loss share the caller runs backward on (`model(batch)`); predict: one
microbatch without autograd, next-token ids (`MimoModel.predict`)."""


@dataclass(frozen=True)
class Action:
    """One thing this rank does. `op`:

    - ``encode``: this rank's share of microbatch `microbatch`'s items through encoder `module`
      (`microbatch` None: every microbatch's, in one call where the encoder allows, the colocated
      phase 1).
    - ``rows`` / ``grads``: post this rank's part of the microbatch's forward (rows) or backward
      (gradients) crossing, its sends (`send`) and receives (`recv`) in one batch.
    - ``cross``: the microbatch's rows across as one autograd node, the gradients coming back when
      the caller runs backward (`model(batch)`, `predict`).
    - ``check rows``: every rank (a world all-reduce) agrees that the encoder rows have the
      planned shapes before they cross.
    - ``backward``: wait for the microbatch's gradients and run the encoder backward (`microbatch`
      None: every microbatch at once, the colocated phase 3).
    - ``encoder pipeline``: torch's GPipe over encoder `module`'s stages; `nested`: the crossings
      its last stage posts (a training step); one microbatch through this rank's stage, blocking
      sends between stages (`microbatch` 0: a forward or a prediction).
    - ``language``: this rank's language stages over every microbatch (`module`: the mode);
      `nested`: on the first stage, torch's computations of stage 0 (``F`` / ``B`` / ``I`` / ``W``
      with their microbatch) and the crossings posted between them.
    - ``finish sends``: complete the sends still in flight.
    """

    op: str
    microbatch: int | None = None
    module: str | None = None
    send: bool = False
    recv: bool = False
    nested: tuple["Action", ...] = ()

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else f" mb{self.microbatch}"
        if self.op in ("rows", "grads"):
            side = "send+recv" if self.send and self.recv else "send" if self.send else "recv"
            return f"{side} {self.op}{mb}"
        if self.op in ("F", "B", "I", "W"):  # torch's computations, nested in a language action
            return f"{self.op}{self.microbatch}"
        head = " ".join(p for p in (self.op, self.module) if p) + mb
        return head + (f" [{' '.join(map(str, self.nested))}]" if self.nested else "")


@dataclass(frozen=True)
class RankRoles:
    """Which parts of the model a rank holds: from the layout alone.

    Attributes:
        encoders: the pp = 1 encoders it holds.
        encoder_stages: the pp > 1 encoders it holds a stage of, with whether that stage is
            their last (whose rows cross).
        language: it holds stages of the language model.
        first_stage: it holds the language model's first stage (where the rows arrive).
    """

    encoders: tuple[str, ...] = ()
    encoder_stages: tuple[tuple[str, bool], ...] = ()
    language: bool = False
    first_stage: bool = False


@dataclass(frozen=True)
class StepShape:
    """What every rank knows of a step from the config and the batch metadata.

    Attributes:
        mode: one of `MODES`.
        encoders: the encoders whose items the batch holds, in the model's order (the crossings'
            order on every rank).
        trainable: those of them whose gradients cross back.
        microbatches: the global batch's microbatches (1 outside training).
        window: forward crossings posted ahead of the backward ones
            (`dtensor_mimo.schedule.order.crossing_window`).
        overlapped: every encoder trains on ranks of its own, so encoder and language microbatches
            overlap (else the colocated three phases: encode all, language, encoder backward).
        check_rows: a forward or prediction first checks, in one world all-reduce, that every
            rank's encoder rows have the planned shapes (`MimoModel` asks for it the first time
            it sees an item size): every rank then raises before any row crosses.
    """

    mode: str
    encoders: tuple[str, ...]
    trainable: tuple[str, ...]
    microbatches: int = 1
    window: int = 1
    overlapped: bool = True
    check_rows: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"StepShape mode {self.mode!r}: one of {MODES}")
        if self.mode != "train" and self.microbatches != 1:
            raise ValueError(f"a {self.mode} runs one microbatch, not {self.microbatches}")


def program(roles: RankRoles, shape: StepShape,
            first_stage_order: Sequence[tuple[str, int]] | None = None) -> list[Action]:
    """This rank's actions for a step of `shape`. `first_stage_order`: stage 0's computations in
    torch's order, (kind, microbatch) (`order.first_stage_actions`; None: not known, or not a
    training step), nested into the language action of the first stage for the reader."""
    local = [n for n in shape.encoders if n in roles.encoders]
    stages = [(n, last) for n, last in roles.encoder_stages if n in shape.encoders]
    if shape.mode != "train":  # one microbatch, stage after stage
        sends = bool(local) or any(last for _, last in stages)
        return [*(Action("encode", 0, n) for n in local),
                *(Action("encoder pipeline", 0, n) for n, _ in stages),
                *([Action("check rows", 0)] if shape.check_rows and shape.encoders else []),
                *([Action("cross", 0)] if shape.encoders and (sends or roles.first_stage) else []),
                *([Action("language", module=shape.mode)] if roles.language else [])]
    m, trains = shape.microbatches, bool(shape.trainable)
    window = shape.window if trains else m  # no gradient paces the forward crossings
    if not shape.overlapped:
        return _colocated(roles, shape, local)
    actions: list[Action] = []
    if local:  # pp = 1 encoders on ranks of their own, in the global crossing order
        last = None  # the microbatch whose gradient receive was posted last
        for kind, i in crossing_order(m, window):
            if kind == "F":
                actions += [*(Action("encode", i, n) for n in local), Action("rows", i, send=True)]
                continue
            if last is not None:
                actions.append(Action("backward", last))
            actions.append(Action("grads", i, recv=True))
            last = i
        if last is not None:
            actions.append(Action("backward", last))
        actions.append(Action("finish sends"))
    for name, is_last in stages:
        nested = ((*(Action("rows", i, send=True) for i in range(m)),
                   *(Action("grads", i, recv=True) for i in range(m))) if is_last else ())
        actions.append(Action("encoder pipeline", module=name, nested=nested))
    if roles.language:
        posted = [Action("rows", k, recv=True) for k in range(min(window, m))] if (
            roles.first_stage and shape.encoders) else []
        nested = _first_stage(shape, window, first_stage_order) if posted else ()
        actions += [*posted, Action("language", module="train", nested=nested)]
        if posted and trains:
            actions.append(Action("finish sends"))
    return actions


def _colocated(roles: RankRoles, shape: StepShape, local: list[str]) -> list[Action]:
    """Three phases on every rank: encode every microbatch (each encoder over all of them at once)
    and post each one's rows (sends and receives in one batch), the language schedule, then every
    gradient crossing and one encoder backward; a first stage without encoders completes its
    gradient sends before the step ends (every send of a step is waited: NCCL keeps a dropped
    send's tensor alive, but nothing would then order its completion)."""
    m, first = shape.microbatches, roles.first_stage and bool(shape.encoders)
    actions = [Action("encode", module=n) for n in local]
    if local or first:
        actions += [Action("rows", i, send=bool(local), recv=first) for i in range(m)]
    if roles.language:
        actions.append(Action("language", module="train"))
    if local or first:
        actions.append(Action("finish sends"))
    if shape.trainable and (first or any(n in shape.trainable for n in local)):
        actions += [Action("grads", i, send=first, recv=bool(local)) for i in range(m)]
        if first and not local:  # (with local encoders their backward waits for each batch, sends included)
            actions.append(Action("finish sends"))
    if local:
        actions.append(Action("backward"))
    return actions


def _first_stage(shape: StepShape, window: int, order: Sequence[tuple[str, int]] | None) -> tuple[Action, ...]:
    """The crossings the first language stage posts from inside the schedule: microbatch j's
    gradient once its last backward ran and every earlier one has gone (microbatch order, the
    global order), then the rows of ``j + window``; between torch's computations when their
    order is known."""
    m = shape.microbatches
    if not shape.trainable:  # no gradient crosses back: every receive was posted before the schedule
        return ()
    posts: list[Action] = []
    for kind, i in crossing_order(m, window):
        if kind == "B":
            posts.append(Action("grads", i, send=True))
        elif i >= min(window, m):
            posts.append(Action("rows", i, recv=True))
    if order is None:
        return tuple(posts)
    last_backward = {j: k for k, (kind, j) in enumerate(order) if kind in ("B", "I", "W")}
    out: list[Action] = []
    done, nxt = set(), 0
    for k, (kind, j) in enumerate(order):
        out.append(Action(kind, j))
        if last_backward.get(j) == k:
            done.add(j)
            while nxt in done:  # this gradient goes, then the rows the window lets in
                out.append(posts.pop(0))
                while posts and posts[0].op == "rows":
                    out.append(posts.pop(0))
                nxt += 1
    return tuple(out + posts)


def crossing_posts(actions: Sequence[Action]) -> list[Action]:
    """The crossings (``rows`` / ``grads``) among `actions`, in order (a nested list's)."""
    return [a for a in actions if a.op in ("rows", "grads")]


def format_program(actions: Sequence[Action]) -> str:
    """One line: the actions in order, separated by `` | ``."""
    return " | ".join(map(str, actions))
