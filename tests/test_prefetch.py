"""The trainer's prefetch thread (`data.prefetch`): order, errors, stopping, what it derives
ahead of the step (one process)."""

from __future__ import annotations

import threading
import time

import dataclasses

import pytest
import torch

from dtensor_mimo.data import IGNORE_INDEX, MimoBatch
from dtensor_mimo.optim.step import step_fingerprint
from dtensor_mimo.sequence.loss import loss_normalizer
from dtensor_mimo.train.trainer import _prefetched


def _batch(i: int) -> MimoBatch:
    tokens = torch.arange(12).reshape(2, 6) + i
    labels = torch.where(tokens % 3 == 0, IGNORE_INDEX, tokens)
    return MimoBatch(tokens, labels, torch.ones_like(tokens, dtype=torch.bool))


def test_batches_come_in_order_and_an_error_where_it_is_consumed() -> None:
    def source():
        yield from ((_batch(i), i) for i in range(5))
        raise ValueError("sample 5: truncated image")

    got = _prefetched(source(), depth=2, pin=False)
    assert [next(got)[1] for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="sample 5: truncated image"):
        next(got)


def test_the_thread_stops_when_the_consumer_does() -> None:
    made = []

    def endless():
        while True:
            made.append(len(made))
            yield _batch(made[-1]), made[-1]

    got = _prefetched(endless(), depth=2, pin=False)
    assert next(got)[1] == 0
    got.close()  # the trainer's loop ends
    time.sleep(0.5)
    assert not any(t.name == "dtensor_mimo-prefetch" and t.is_alive() for t in threading.enumerate())
    assert len(made) <= 4  # at most depth ahead (+ one in hand) was prepared


def test_the_thread_derives_what_the_step_needs_from_the_global_batch() -> None:
    """`prepare` runs on the thread, once per batch, before the consumer gets it; what it derives
    stays with the batch, equal to what the same batch built anew derives; a changed batch
    derives its own."""
    threads = []

    def prepare(batch: MimoBatch) -> None:
        threads.append(threading.current_thread().name)
        step_fingerprint(batch), loss_normalizer(batch)

    batch, _ = next(_prefetched(((_batch(i), i) for i in range(3)), depth=2, pin=False, prepare=prepare))
    assert threads[0] == "dtensor_mimo-prefetch" and set(batch.__dict__["_memo"]) == {"step fingerprint",
                                                                                        "loss normalizer"}
    fresh = _batch(0)
    assert step_fingerprint(batch) == step_fingerprint(fresh) and loss_normalizer(batch) == loss_normalizer(fresh) == 8
    fewer = dataclasses.replace(batch, loss_mask=torch.zeros_like(batch.loss_mask))
    assert loss_normalizer(fewer) == 1.0 and step_fingerprint(fewer) != step_fingerprint(batch)


def test_what_a_loader_worker_derives_crosses_with_the_batch() -> None:
    """A batch from a loader process (`Flat`, pickled) keeps what the worker derived from it."""
    from dtensor_mimo.data.transfer import Flat

    from dtensor_mimo.data.balance import microbatch_cuts

    batch = _batch(1)
    derived = step_fingerprint(batch), loss_normalizer(batch), microbatch_cuts(batch, 2, (("vision", 4, None, 64),))
    crossed = Flat.pack((batch, [])).unpack()[0]
    assert crossed.__dict__["_memo"] == {"step fingerprint": derived[0], "loss normalizer": derived[1],
                                         ("encoder cuts", 2, ()): derived[2]} and derived[2] == [{}, {}]
    assert torch.equal(crossed.tokens, batch.tokens)
