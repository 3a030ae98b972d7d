"""The order in which a step's crossings are posted: forwards and backwards interleaved as the
first language stage consumes them, so encoder ranks hold only a window of microbatches.

The first language stage (stage 0, on pp rank 0 under every placement) runs the forward of
microbatch k once the backwards of some earlier microbatches are done: under 1F1B at most
``pp`` microbatches are in flight there, under GPipe all M. `crossing_window` reads that bound
from torch's own order of the schedule (its ``pipeline_order``) and every rank posts the step's
crossings in the one order it implies (`crossing_order`):

    F0 .. F(w-1), B0, Fw, B1, F(w+1), ..., B(M-1)

— the forward crossing of microbatch ``j + w`` right after the backward crossing of ``j``, ``w``
being that bound plus one microbatch of slack. An encoder rank then encodes microbatch ``j + w``
while the language model runs backward ``j`` and keeps at most ``w + 1`` microbatches of
activations; the first language stage posts the receive of ``j + w`` after sending the gradient
of ``j``, which it does before its forward of ``j + w`` needs the rows (that is what the bound
guarantees). Every rank derives the same order from the same config, so the messages between
any two ranks are posted in the same order on both sides (NCCL safety).
"""

from __future__ import annotations

import functools
from typing import Iterator

from torch import nn
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from dtensor_mimo.schedule.config import PipelineConfig


class _StageShape:
    """What torch's schedule constructors read of a stage to lay out their order: its index, the
    number of stages, the pp group's size and rank (no module, no process group)."""

    def __init__(self, index: int, n_stages: int, pp: int) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, n_stages, pp, 0
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.stage_index_to_group_rank: dict[int, int] | None = None
        self.submod = nn.Identity()


def first_stage_actions(config: PipelineConfig, pp: int) -> list[tuple[str, int]] | None:
    """Stage 0's computations in torch's order for `config` with `pp` ranks, as (kind, microbatch)
    with kind one of "F", "B" (full backward), "I", "W"; None when the order is not known: pp rank
    0's actions hold other kinds (DualPipeV's overlapped forward-backward), stage 0's forwards are
    not all there, or torch's constructor no longer takes the stand-in stages. From the schedule's
    ``pipeline_order``, built on stand-in stages. Every pipelined oracle case of
    tests/test_pipeline.py runs with this order: had torch run stage 0 otherwise, its
    `LanguageFeed` would raise."""
    cls = get_schedule_class(config.schedule)
    n_stages, m = config.num_stages(pp), config.microbatches
    if issubclass(cls, PipelineScheduleSingle):
        # torch runs these from `_step_microbatches`, not from their order table (which is off by
        # one microbatch at pp = 1): stage 0 runs min(M, stages) forwards, then one backward and
        # one forward in turn (1F1B), or every forward first (GPipe).
        warmup = m if config.schedule == "GPipe" else min(m, n_stages)
        steady = [a for j in range(m) for a in (("B", j), ("F", j + warmup))]
        return [("F", k) for k in range(warmup)] + [a for a in steady if a[0] == "B" or a[1] < m]
    stages = [_StageShape(s, n_stages, pp) for s in config.rank_stages(0, pp)]
    try:
        order = cls(stages, m, loss_fn=lambda out, _target: out, scale_grads=False).pipeline_order[0]
    except Exception:  # noqa: BLE001 — a torch that reads more of a stage: fall back to every microbatch
        return None
    if any(a is not None and str(a.computation_type.value) not in ("F", "B", "I", "W", "REDUCE_GRAD")
           for a in order):
        return None
    actions = [(str(a.computation_type.value), a.microbatch_index) for a in order
               if a is not None and a.stage_index == 0 and str(a.computation_type.value) != "REDUCE_GRAD"]
    if sorted(j for kind, j in actions if kind == "F") != list(range(m)):
        return None
    return actions


@functools.lru_cache(maxsize=64)
def in_flight(config: PipelineConfig, pp: int) -> int:
    """The most microbatches stage 0 has run forward but whose gradient has not yet left, when
    gradients leave in microbatch order (`LanguageFeed`) once a microbatch's last backward pass
    (B, or W after I) ran; `config.microbatches` when the order is not known."""
    m = config.microbatches
    actions = first_stage_actions(config, pp)
    if actions is None:
        return m
    last_backward = {j: i for i, (kind, j) in enumerate(actions) if kind in ("B", "I", "W")}
    if sorted(last_backward) != list(range(m)):
        return m
    left, most, done = 0, 0, [False] * m  # `left`: gradients gone, in microbatch order
    for i, (kind, j) in enumerate(actions):
        if kind == "F":
            most = max(most, j + 1 - left)
        elif last_backward[j] == i:
            done[j] = True
            while left < m and done[left]:
                left += 1
    return min(m, max(1, most))


def crossing_window(config: PipelineConfig, pp: int, lean: bool) -> int:
    """How many forward crossings run ahead of the backward ones: when the encoders follow the
    language model (`lean`: every encoder on ranks of its own, pp = 1), the first stage's
    `in_flight` bound plus one microbatch of slack (with none, the encoder computes microbatch
    j + w only once j's gradient has come back, and any jitter stalls the language model:
    benchmarks/pipeline.py measured 0.627 against 0.586 with every forward first, and 0.594
    against 0.591 with the slack), else every microbatch (``config.microbatches``:
    all forwards, then all backwards)."""
    return min(config.microbatches, in_flight(config, pp) + 1) if lean else config.microbatches


def crossing_order(microbatches: int, window: int) -> Iterator[tuple[str, int]]:
    """The global order of a step's crossings: ("F", k) forward, ("B", j) backward."""
    yield from (("F", k) for k in range(min(window, microbatches)))
    for j in range(microbatches):
        yield "B", j
        if j + window < microbatches:
            yield "F", j + window

