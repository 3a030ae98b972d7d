"""The trainer's prefetch thread (`data.prefetch`): order, errors, stopping (one process)."""

from __future__ import annotations

import threading
import time

import pytest

from dtensor_mimo.train.trainer import _prefetched


def test_batches_come_in_order_and_an_error_where_it_is_consumed() -> None:
    def source():
        yield from range(5)
        raise ValueError("sample 5: truncated image")

    got = _prefetched(source(), depth=2, pin=False)
    assert [next(got) for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="sample 5: truncated image"):
        next(got)


def test_the_thread_stops_when_the_consumer_does() -> None:
    made = []

    def endless():
        while True:
            made.append(len(made))
            yield made[-1]

    got = _prefetched(endless(), depth=2, pin=False)
    assert next(got) == 0
    got.close()  # the trainer's loop ends
    time.sleep(0.5)
    assert not any(t.name == "dtensor_mimo-prefetch" and t.is_alive() for t in threading.enumerate())
    assert len(made) <= 4  # at most depth ahead (+ one in hand) was prepared
