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


def test_batches_that_run_out_end_the_stream_and_a_late_error_does_not_keep_the_thread() -> None:
    got = _prefetched(((_batch(i), i) for i in range(3)), depth=2, pin=False)
    assert [i for _, i in got] == [0, 1, 2]  # it ends (before: the consumer waited forever)

    def failing_late():
        yield from ((_batch(i), i) for i in range(4))
        raise ValueError("sample 4: truncated image")

    got = _prefetched(failing_late(), depth=1, pin=False)
    assert next(got)[1] == 0
    got.close()  # the consumer stops while the thread holds batches and then the error: it must not block
    time.sleep(0.5)
    assert not any(t.name == "dtensor_mimo-prefetch" and t.is_alive() for t in threading.enumerate())


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


def test_the_fingerprint_covers_a_packed_rows_documents() -> None:
    """Ranks fed the same tokens cut into other documents (another packing) attend and rotate
    otherwise: their step fingerprints differ, as do those of other rotary positions."""
    s = _batch(0).seq_len
    documents = torch.arange(s).div(4, rounding_mode="floor").expand(_batch(0).batch_size, s).contiguous()
    packed = dataclasses.replace(_batch(0), document_ids=documents, positions=torch.arange(s).remainder(4).expand_as(
        documents).contiguous())
    same = dataclasses.replace(_batch(0), document_ids=documents.clone(), positions=packed.positions.clone())
    halves = dataclasses.replace(same, document_ids=documents.div(2, rounding_mode="floor"))
    shifted = dataclasses.replace(same, positions=packed.positions + 1)
    assert step_fingerprint(same) == step_fingerprint(packed)
    assert len({step_fingerprint(b) for b in (packed, halves, shifted, _batch(0))}) == 4


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


def _pin_as_aten(self: torch.Tensor) -> torch.Tensor:
    """`Tensor.pin_memory` as ATen's `_pin_memory` makes it (aten/src/ATen/native/Memory.cpp), on the
    CPU (a CPU build cannot pin): a new storage of the tensor's extent (`computeStorageNbytes`), set
    with the tensor's own sizes and strides, then ``copy_`` from the tensor."""
    extent = 0 if self.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride()))
    storage = torch.UntypedStorage(extent * self.element_size())
    out = torch.empty(0, dtype=self.dtype).set_(storage, 0, self.shape, self.stride())
    out.copy_(self)
    return out


@pytest.mark.parametrize("pin", ["as ATen pins", "cuda"])
def test_a_rank_that_loads_only_some_items_gets_its_batches_pinned(pin, monkeypatch) -> None:
    """With per-rank loading the items a rank does not encode are stand-ins: zeros expanded from one
    element (stride 0, no memory). Pinning copies a tensor into a storage of its own strides, and
    ``copy_`` refuses a stride-0 destination; the prefetch thread pins every batch on GPUs
    (``data.workers = 0``), so a rank holding a stand-in must still get its batch, pinned where
    it holds memory, each tensor equal to the one it was made from. Digits batches of a language
    rank (no item loaded), an encoder rank loading rows 0 and 2, and one of images of their own
    sizes (one stand-in tensor per item)."""
    from dtensor_mimo.data import DigitsDataset
    from dtensor_mimo.models import AudioConfig, ViTConfig

    pytest.importorskip("sklearn")
    if pin == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU to pin host memory")
    if pin != "cuda":
        monkeypatch.setattr(torch.Tensor, "pin_memory", _pin_as_aten)
    vit = ViTConfig(image_size=8, patch_size=4, in_channels=1, dim=16, n_layers=1, n_heads=2)
    audio = AudioConfig(n_mels=16, max_frames=16, conv_strides=(2, 2), dim=16, n_layers=1, n_heads=2)
    data = DigitsDataset("train", vit, audio, num_samples=50, seed=3)
    varied = DigitsDataset("train", dataclasses.replace(vit, dynamic_resolution=True, max_patches=16), audio,
                           num_samples=50, seed=3)
    indices = list(range(4))
    batches = [data.batch(indices, load={}), data.batch(indices, load={"vision": [0, 2], "audio": [0, 2]}),
               varied.batch(indices, load={"vision": [1]})]
    assert any(0 in m.inputs.stride() for b in batches[:2] for m in b.modalities.values())
    stream = _prefetched(((b, i) for i, b in enumerate(batches)), depth=2, pin=True)
    got = [next(stream)[0] for _ in batches]
    for made, pinned in zip(batches, got):
        for name in ("tokens", "labels", "loss_mask"):
            assert torch.equal(getattr(pinned, name), getattr(made, name))
        for name, m in made.modalities.items():
            inputs, theirs = m.inputs, pinned.modalities[name].inputs
            pairs = zip(inputs, theirs) if isinstance(inputs, list) else [(inputs, theirs)]
            for x, y in pairs:
                assert torch.equal(x, y) and x.shape == y.shape
                if 0 not in x.stride():  # memory of its own: pinned (a copy)
                    assert y.data_ptr() != x.data_ptr() and (pin != "cuda" or y.is_pinned())


def test_a_loader_process_does_not_decode_rows_known_unusable_again() -> None:
    """A resumed run that skips bad media (``data.skip_bad_media``) knows its unusable rows from
    the checkpoint: the loader processes (`data.workers`) build them left out without decoding
    their media again, as the step's own path does; a row not known is still tried (and fails)."""
    from dtensor_mimo.data.conversation import MediaError
    from dtensor_mimo.train.trainer import _Batches, _LoadPlan

    decoded: list[int] = []

    class Source:
        def __len__(self) -> int:
            return 10

        def batch(self, indices, load=None, left_out=()):
            for row, i in enumerate(indices):  # (a source decodes every row not left out)
                if row not in left_out:
                    decoded.append(i)
                    if i in (7, 8):
                        raise MediaError(f"sample {i}: cannot decode", row=row)
            return _batch(0)

    loader = _Batches(Source(), _LoadPlan(None, 1, {}), (1, ()), known=frozenset({7}))
    batch, failed = loader[[3, 7]].unpack()
    assert set(decoded) == {3} and failed == []
    decoded.clear()
    batch, failed = loader[[8, 7]].unpack()
    assert [(e.row, str(e)) for e in failed] == [(0, "sample 8: cannot decode")] and 7 not in decoded


class _BreaksAt:
    """A training source of 40 rows whose batch holding row `broken` raises (in the process that builds it)."""

    def __init__(self, broken: int) -> None:
        self.broken = broken

    def __len__(self) -> int:
        return 40

    def batch(self, indices, load=None, left_out=()):
        import os

        if self.broken in indices:
            raise ValueError(f"row {self.broken}: not a conversation (process {os.getpid()})")
        return _batch(indices[0])


def _trainer_batches(source, workers: int):
    """`Trainer._batches` of a trainer of `source` (batches of 4, seed 0) on the CPU, with `workers`
    loader processes: the attributes it reads, and no process group."""
    from types import SimpleNamespace

    from dtensor_mimo.data import ResumableBatchSampler
    from dtensor_mimo.train.trainer import Trainer, _LoadPlan

    data = SimpleNamespace(workers=workers, prefetch=None, batch_size=4, seed=0, per_rank_loading=False)
    trainer = SimpleNamespace(
        config=SimpleNamespace(data=data, pipeline=SimpleNamespace(microbatches=1)),
        model=SimpleNamespace(device=torch.device("cpu"), parts=SimpleNamespace(pipeline=SimpleNamespace(
            microbatches=1), cut_rules=())),
        data=SimpleNamespace(train=source), sampler=ResumableBatchSampler(40, 4, seed=0), left_out={},
        _load_plan=lambda batch_size, microbatches: _LoadPlan(None, microbatches, {}))
    return Trainer._batches(trainer), trainer.sampler


def test_a_loader_worker_error_ends_the_loader_workers_with_the_run() -> None:
    """`data.workers`: an error a loader process raises (a row it cannot build) reaches the step
    with the loader's processes already ended, as any other error of the run leaves them
    (`Trainer.run` joins them before the launcher aborts the rank's groups: a process forked from
    the rank holds its sockets open, and a peer would wait until it noticed its parent's end). The
    error still held, as the launcher holds it while it aborts the groups."""
    import multiprocessing
    import re

    from dtensor_mimo.data import ResumableBatchSampler

    order = [b for _, b in zip(range(6), ResumableBatchSampler(40, 4, seed=0))]
    batches, _ = _trainer_batches(_BreaksAt(order[2][1]), workers=2)
    assert [next(batches)[0] for _ in range(2)] == order[:2]
    with pytest.raises(ValueError, match=f"row {order[2][1]}: not a conversation") as failed:
        next(batches)
    worker = int(re.search(r"process (\d+)\)", str(failed.value)).group(1))
    assert worker not in [p.pid for p in multiprocessing.active_children()]


def test_taking_batches_draws_nothing_from_the_global_generator() -> None:
    """A resumed run restores torch's global random state, then starts its loader: a loader that
    drew its workers' seed from that state (torch's DataLoader does, without a generator of its
    own) would give a user module's dropout other masks than the uninterrupted run, which drew
    before its first step, ahead of the saved state. The loader's generator is its own, seeded
    by ``data.seed``."""
    from dtensor_mimo.data import ResumableBatchSampler

    order = [b for _, b in zip(range(3), ResumableBatchSampler(40, 4, seed=0))]
    torch.manual_seed(123)
    before = torch.get_rng_state()
    batches, _ = _trainer_batches(_BreaksAt(-1), workers=1)
    assert [next(batches)[0] for _ in range(3)] == order
    batches.close()
    assert torch.equal(torch.get_rng_state(), before)


class _BadLineAt(_BreaksAt):
    """A training source whose batch holding row `broken` meets a malformed sample (a `DataError`,
    as a JSONL line past the checked ones raises when a rank first reads it)."""

    MESSAGE = "data/train.jsonl: the line at byte 4711 (sample 17 of the file): not valid JSON: Expecting value"

    def batch(self, indices, load=None, left_out=()):
        from dtensor_mimo.data.conversation import DataError

        if self.broken in indices:
            raise DataError(self.MESSAGE)
        return _batch(indices[0])


def test_a_loader_workers_data_error_reaches_the_rank_as_the_step_path_raises_it() -> None:
    """`data.workers`: a sample a loader process cannot build (a `DataError`, a user error the
    launcher shows as its message alone, `USER_ERRORS`) is raised on the rank as it is, its
    message the source's: not torch's re-raised copy ("Caught DataError in DataLoader worker
    process 0. Original Traceback ..."), whose first line names nothing and which the launcher
    would show, traceback and all, as the message (cut at 4000 characters)."""
    from dtensor_mimo.data import ResumableBatchSampler
    from dtensor_mimo.data.conversation import DataError
    from dtensor_mimo.train.launch import describe

    order = [b for _, b in zip(range(3), ResumableBatchSampler(40, 4, seed=0))]
    batches, sampler = _trainer_batches(_BadLineAt(order[1][0]), workers=1)
    assert next(batches)[0] == order[0]
    with pytest.raises(DataError) as failed:
        next(batches)
    assert str(failed.value) == _BadLineAt.MESSAGE
    assert describe(failed.value) == f"DataError: {_BadLineAt.MESSAGE}"
    assert sampler.state_dict()["index"] == 1  # the failed batch was not taken
