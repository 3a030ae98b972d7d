"""`train_step`: forward, backward, gradient reduction, global norm and clipped step, on every rank."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from dtensor_mimo.bridge import PlanError
from dtensor_mimo.data import BatchError, MimoBatch
from dtensor_mimo.data.batch import step_fingerprint
from dtensor_mimo.layout.fingerprint import agreed, agreed_sums, agreement_terms
from dtensor_mimo.mimo import MimoModel
from dtensor_mimo.optim.optimizer import MimoOptimizer, grad_sumsq_shares
from dtensor_mimo.schedule.runtime import phase

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepMetrics:
    """The same numbers on every rank: global loss, global and per-module gradient norms."""

    loss: float
    grad_norm: float
    module_grad_norms: dict[str, float]
    skipped: bool
    votes: tuple[float, ...] = ()
    """`train_step`'s ``votes``, summed over the world."""


class UnusableBatch(BatchError):
    """Some rank could not build its part of the step's batch (it passed ``unusable`` to
    `train_step`): raised on every rank, the step not applied. What went wrong is that rank's to
    say (the caller gathers its reasons, e.g. the file that failed to decode)."""


class Elapsed:
    """A phase's seconds between two CUDA events, read when first used as a number (``float(e)``,
    arithmetic, formatting): the phase timing adds no device sync to the step; reading it waits
    for the phase's end (``json.dumps`` needs ``float(e)``)."""

    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self.start, self.end = start, end
        self._seconds: float | None = None

    def __float__(self) -> float:
        if self._seconds is None:
            self.end.synchronize()
            self._seconds = self.start.elapsed_time(self.end) / 1e3
        return self._seconds

    def __add__(self, other: float) -> float:
        return float(self) + float(other)

    __radd__ = __add__

    def __sub__(self, other: float) -> float:
        return float(self) - float(other)

    def __mul__(self, other: float) -> float:
        return float(self) * float(other)

    __rmul__ = __mul__

    def __truediv__(self, other: float) -> float:
        return float(self) / float(other)

    def __format__(self, spec: str) -> str:
        return format(float(self), spec)

    def __repr__(self) -> str:
        return f"Elapsed({float(self)!r})"


def _mark(device: torch.device) -> float | torch.cuda.Event:
    """Now: the host clock on CPU, a CUDA event recorded on the current stream on GPUs."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _between(start: float | torch.cuda.Event, end: float | torch.cuda.Event) -> float | Elapsed:
    return Elapsed(start, end) if isinstance(start, torch.cuda.Event) else end - start


class _Readback:
    """`values` on their way to the host, not waited for: on CUDA a non-blocking copy into pinned
    memory and an event after it, so that the work queued after the copy (the step's update) runs
    while the host waits for the copy alone (`read_totals`)."""

    def __init__(self, values: torch.Tensor) -> None:
        self.done: torch.cuda.Event | None = None
        self.host = values
        if values.is_cuda:
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record(torch.cuda.current_stream(values.device))  # the stream the copy went on


def read_totals(readback: _Readback) -> list[float]:
    """The step's all-reduced totals and its verdict on the host: its ONE device-to-host sync,
    which the metrics and the raise decision need (every other count of a step comes from host
    metadata). It waits for the totals only: the update queued after them keeps the device busy."""
    if readback.done is not None:
        readback.done.synchronize()
    return readback.host.tolist()


def train_step(model: MimoModel, optimizer: MimoOptimizer, batch: MimoBatch,
               timings: dict[str, float] | None = None, *,
               votes: Sequence[float] | Callable[[], Sequence[float]] = (), unusable: bool = False) -> StepMetrics:
    """One optimizer step on the global `batch`; call on every rank with the same batch.

    One small all-reduce over the world carries the loss, every module's squared gradient norm,
    three status words and the batch's fingerprint, so every rank reports the same loss, takes the
    same clip and skip decision, and raises together, before any weight changes, when:

    - the ranks were fed different batches (`batch_fingerprint` of the token ids, labels, loss
      mask and each modality's items per sample and tokens per item; `agreed`);
    - a parameter's ``requires_grad`` changed after the model was built (the step runs with the
      trainable set as built, so the crossings match on every rank, then is refused);
    - the step found encoder rows that contradict the batch metadata (`MimoModel.run`'s result),
      or a gradient accumulated after its dp sum had started (`MimoModel.reduce_gradients`);
    - a rank passed ``unusable``: it could not build its part of `batch` (a media file that does
      not decode) and ran the step on stand-ins of the same shapes (zeros) so that no peer waits
      for it: `UnusableBatch` on every rank.

    `votes` are numbers of this rank's that ride in the same all-reduce and come back summed over
    the world in `StepMetrics.votes` (the same on every rank): a decision every rank must take at
    the same step (e.g. stop after it, `dtensor_mimo.train.preemption`) costs no collective of
    its own. A callable is asked for them after the backward, just before that all-reduce: what
    happened during the step's forward and backward (a stop signal, a compile) counts in this step.

    A model's first step also compares the batch fingerprints before its first exchange (one more
    all-reduce, once): ranks fed different data from the start fail there, every rank with the
    same message. Later batches whose exchange sizes differ between ranks cannot be told before
    the exchange: gloo then aborts the receiving process ("Received data size doesn't match
    expected size") and its peers fail at once, their errors noting their batch fingerprints.
    NCCL checks no sizes: such an exchange waits until the process group's timeout (NCCL's
    watchdog then ends the ranks), or completes with rows misplaced, which the fingerprint in
    this step's all-reduce then refuses on every rank.

    `timings`, if given, receives this rank's seconds in "forward_backward" (bridge included) and
    "optimizer" (gradient reduction, the norm's all-reduce, clip, AdamW): floats on CPU, `Elapsed`
    between CUDA events on GPUs (no sync of their own: ``float()`` them later, e.g. when logging).

    Host syncs: one per step (`read_totals`), whatever the number of microbatches (two on a
    model's first step). The clipped update is queued before it, its verdict (refuse, skip)
    computed on the device from the same totals (`MimoOptimizer.launch`): the read waits for the
    totals, not for the update, and the device goes from backward to the update without waiting
    for the host.
    """
    if optimizer.model is not model:  # every rank makes the same call: all refuse
        raise ValueError("train_step: the optimizer was built for another MimoModel (MimoOptimizer(model, ...)), so "
                         "this model's gradients would update nothing; build the optimizer from this model")
    start = _mark(model.device) if timings is not None else 0.0
    optimizer.zero_grad()
    fp = step_fingerprint(batch)
    if not model.batches_compared:  # before any exchange: sizes that differ would kill gloo
        _check_same_batch(fp, model.device)
        model.batches_compared = True
    changed = trainable_changes(model)
    try:
        with _as_built(model, changed):
            result = model.run(batch)
            if timings is not None:
                middle = _mark(model.device)
                timings["forward_backward"] = _between(start, middle)
            with phase("reduce gradients"):
                stale = model.reduce_gradients()
        loss_part = result.loss.detach().double().reshape(1) if model.holds_loss_share() else \
            torch.zeros(1, dtype=torch.float64, device=model.device)
        # The status words: ranks whose encoder rows contradicted the batch metadata (the result's
        # error), ranks whose trainable set changed, ranks that could not build their part; then
        # the batch fingerprint's agreement terms, the votes; and, not all-reduced, what the status
        # words and the terms sum to in a step every rank may apply.
        world = dist.get_world_size()
        error = result.error or stale
        votes = tuple(votes() if callable(votes) else votes)  # read now: after the forward and backward
        words = torch.tensor([float(error is not None), float(bool(changed)), float(unusable),
                              *agreement_terms(fp, world), *map(float, votes), 0.0, 0.0, 0.0, *agreed_sums(fp, world)],
                             dtype=torch.float64).to(model.device, non_blocking=True)
        totals = torch.cat([loss_part, words[:-5], grad_sumsq_shares(model)])
        dist.all_reduce(totals)
    except RuntimeError as e:
        if _from_the_transport(e):  # a peer's closed connection or a timeout says nothing of why
            e.add_note(f"this rank's batch fingerprint is {fp} (different ones on other ranks: they were fed "
                       "different batches)")
        raise
    # The verdict on the device, from the same totals as the host's below: the update is queued
    # before the host reads anything, and changes nothing in a step refused or skipped.
    # A non-finite norm, or loss (a weighted label outside the vocabulary: the loss's NaN, whose
    # microbatch then has no gradient), skips the step: their sum is finite only if both are.
    norm = totals[6 + len(votes):].sum().sqrt()
    skip = (totals[1:6] != words[-5:]).any() | ~(norm + totals[0]).isfinite()
    readback = _Readback(torch.cat([totals, skip.reshape(1)]))
    with phase("optimizer"):
        optimizer.launch(norm, skip)
    with phase("read totals"):
        loss, bad, frozen, unusable_ranks, sum_fp, sum_sq, *rest, skipped_on_device = read_totals(readback)
    summed_votes, sumsq = tuple(rest[:len(votes)]), rest[len(votes):]
    if unusable_ranks:  # before the fingerprint: a rank's stand-ins may not hash like its peers' inputs
        optimizer.zero_grad()
        raise UnusableBatch(f"{int(unusable_ranks)} rank(s) could not build their part of this step's batch "
                            f"(this rank: {'it' if unusable else 'not it'}); the step was not applied")
    if not agreed(fp, sum_fp, sum_sq, world):
        optimizer.zero_grad()
        raise RuntimeError(_different_batches(fp))
    if frozen:
        optimizer.zero_grad()
        here = (f" (here: {_shown(changed)})" if changed else "")
        raise RuntimeError(
            f"requires_grad changed after the MimoModel was built, on {int(frozen)} rank(s){here}: the schedule "
            "(which gradients cross back to which encoder) is fixed at construction; freeze or unfreeze before "
            "building the MimoModel (and its MimoOptimizer). The step was not applied")
    if bad:
        optimizer.zero_grad()
        raise PlanError(error or (
            f"{int(bad)} rank(s) produced encoder rows that disagree with the batch metadata, or gradients "
            "summed before their last accumulation (their error names which); the step was not applied"))
    grad_norm = math.sqrt(sum(sumsq))
    skipped = not optimizer.settle(not skipped_on_device)  # the device's verdict: a non-finite norm or loss
    if skipped and dist.get_rank() == 0:  # the same verdict on every rank: said once
        log.warning("step skipped after %d update(s): the global gradient norm is %s, the loss %s; weights and "
                    "optimizer moments are unchanged (a non-finite input, a too high lr, or a label outside "
                    "the vocabulary?)",
                    optimizer.updates, grad_norm, loss)
    if timings is not None:
        timings["optimizer"] = _between(middle, _mark(model.device))
    return StepMetrics(loss, grad_norm, {n: math.sqrt(s) for n, s in zip(model.module_names, sumsq)},
                       skipped, summed_votes)


def _check_same_batch(fp: int, device: torch.device) -> None:
    """One all-reduce of `fp`'s agreement terms; raises on every rank if any rank's differs."""
    terms = torch.tensor(agreement_terms(fp, dist.get_world_size()), dtype=torch.float64).to(device)
    dist.all_reduce(terms)
    if not agreed(fp, *terms.tolist(), dist.get_world_size()):
        raise RuntimeError(_different_batches(fp))


def _different_batches(fp: int) -> str:
    return ("the ranks were fed different batches in this step (their batch fingerprints differ: token ids, "
            f"labels, loss mask or a modality's items per sample / tokens per item; this rank's is {fp}): every rank "
            "must pass the same global batch (the same data, seed and position); the step was not applied")


def _from_the_transport(e: BaseException | None) -> bool:
    """Whether `e` (or what it wraps) is the process group's own error: gloo's, NCCL's, a timeout."""
    while e is not None:
        if isinstance(e, dist.DistError) or (type(e) is RuntimeError and any(
                w in str(e) for w in ("gloo", "NCCL", "Timed out", "Connection"))):
            return True
        e = e.__cause__
    return False


def trainable_changes(model: MimoModel) -> dict[str, bool]:
    """This rank's parameters whose ``requires_grad`` differs from when `model` was built:
    ``{name: requires_grad as built}``."""
    built = model._requires_grad
    return {n: built[n] for n, p in model._named_parameters.items() if p.requires_grad != built[n]}


@contextlib.contextmanager
def _as_built(model: MimoModel, changed: dict[str, bool]) -> Iterator[None]:
    """`changed` parameters trainable as built for the duration (the peers' crossings expect it)."""
    if not changed:
        yield
        return
    params = dict(model.named_parameters())
    try:
        for name, flag in changed.items():
            params[name].requires_grad_(flag)
        yield
    finally:
        for name, flag in changed.items():
            params[name].requires_grad_(not flag)
            params[name].grad = None


def _shown(changed: dict[str, bool]) -> str:
    names = sorted(changed)
    verb = lambda n: "frozen" if changed[n] else "unfrozen"  # noqa: E731
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(f"{n} {verb(n)}" for n in names[:3]) + more
