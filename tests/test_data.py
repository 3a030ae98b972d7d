"""Specification of the data layer, `dtensor_mimo.data` (pure: one process, no process group).

Shards are checked against hand-written sample and item indices, and (property tests) against a
naive reference that assigns every item to its sample and keeps the items whose sample the rank
owns. The generator is checked by its invariants, each recomputed from the raw tensors.

Hand-built batch H: 5 samples, S = 8; "vision" 2 tokens per image, "audio" 1 token per clip;
image i and clip i are constant tensors of value i (so an item's identity is readable):

| sample             |   0   |   1    |  2  |     3     |   4    |
|--------------------|-------|--------|-----|-----------|--------|
| vision images      | 0     | 1, 2   | —   | 3, 4, 5   | 6      |
| audio clips        | —     | 0      | 1   | —         | 2, 3   |
| vision tokens      | 2     | 4      | 0   | 6         | 2      |
| audio tokens       | 0     | 1      | 1   | 0         | 2      |

| dp (or microbatches) | samples per rank            | vision images per rank         | audio clips per rank       |
|----------------------|-----------------------------|--------------------------------|----------------------------|
| 1                    | [0..4]                      | [0..6]                         | [0..3]                     |
| 2                    | [0,1,2] [3,4]               | [0,1,2] [3,4,5,6]              | [0,1] [2,3]                |
| 3                    | [0,1] [2,3] [4]             | [0,1,2] [3,4,5] [6]            | [0] [1] [2,3]              |
| 7 (empty ranks)      | [0] [1] [2] [3] [4] [] []   | [0] [1,2] [] [3,4,5] [6] [] [] | [] [0] [1] [] [2,3] [] []  |

Other cases:

| case                                  | checked against                                           |
|---------------------------------------|-----------------------------------------------------------|
| sample_range == tensor_split          | torch.tensor_split(arange(n), parts), n 0..12, parts 1..8 |
| property: random ragged batch, any dp | item -> owning sample reference; shards concatenate back  |
| microbatches of a shard               | same rule, hand-written items                             |
| packed fields; to()                   | sliced with the rows; every tensor moved                  |
| generator determinism                 | same seed equal on every field; other seeds differ        |
| generator invariants (many seeds,     | special count per row == items x tokens_per_item; blocks  |
|   packed or not, ids in or outside    |   of an item contiguous; text ids in vocab, not special;  |
|   the vocabulary)                     |   labels, loss mask, positions recomputed by a loop       |
| generator raggedness                  | text-only samples >= requested; a sample with max_items   |
| generator -> real encoders            | ViT / AudioEncoder rows == tokens_per_sample sums         |
| `SyntheticSpec.tiny`                  | `ModalitySpec.image/audio` of the tiny ViT / audio config |
| validation errors                     | every BatchError / ValueError message                     |
| a sample the chat template refuses    | DataError naming the file and sample id, not TemplateError |
| an answer starting with a newline     | transformers' assistant mask (Qwen's pre-tokenizer merges |
|   (ChatML, Qwen's pre-tokenizer)      |   it with the prompt's "\\n"); the prompt stops before it  |
| an image its processor sizes unlike   | the file's MediaError on the loading ranks (tolerated and |
|   the others (alone, or batched)      |   agreed), not a DataError / ValueError there alone      |
| a loader worker's batches (`Flat`,    | the tensors put in, by value, dtype and shape; batches    |
|   `Handover`)                         |   the rank holds keep their values; segments come back    |
"""

from __future__ import annotations

import gc
import os
import pickle
import re
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtensor_mimo.data import (
    IGNORE_INDEX,
    BatchError,
    MimoBatch,
    ModalityInputs,
    ModalitySpec,
    SyntheticSpec,
    microbatches,
    sample_range,
    shard,
    synthetic_batch,
)
from dtensor_mimo.models import AudioConfig, AudioEncoder, ViT, ViTConfig

VISION, AUDIO = 100, 101  # special ids outside a vocabulary of 50


# ------------------------------------------------------------------ hand-built batch H

H_IMAGES = [1, 2, 0, 3, 1]
H_CLIPS = [0, 1, 1, 0, 2]


def _row(vision_tokens: int, audio_tokens: int, s: int = 8) -> list[int]:
    text = list(range(1, s - vision_tokens - audio_tokens + 1))
    return [VISION] * vision_tokens + text + [AUDIO] * audio_tokens


def hand_batch(with_packing: bool = False) -> MimoBatch:
    tokens = torch.tensor([_row(2 * v, a) for v, a in zip(H_IMAGES, H_CLIPS)])
    extra = {}
    if with_packing:
        extra = {
            "document_ids": torch.arange(5).unsqueeze(1) * 10 + torch.arange(8) // 4,
            "positions": torch.arange(5).unsqueeze(1) * 100 + torch.arange(8),
        }
    return MimoBatch(
        tokens=tokens,
        labels=tokens + 1000,
        loss_mask=torch.arange(40, dtype=torch.float32).view(5, 8),
        modalities={
            "vision": ModalityInputs(
                inputs=torch.arange(7.0).view(7, 1, 1, 1).expand(7, 3, 4, 4).clone(),
                items_per_sample=H_IMAGES,
                tokens_per_item=2,
                special_token_id=VISION,
            ),
            "audio": ModalityInputs(
                inputs=torch.arange(4.0).view(4, 1, 1).expand(4, 2, 6).clone(),
                items_per_sample=H_CLIPS,
                tokens_per_item=1,
                special_token_id=AUDIO,
            ),
        },
        **extra,
    )


# dp size -> per rank (samples, vision image ids, audio clip ids), written out by hand.
H_SHARDS = {
    1: [([0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3])],
    2: [([0, 1, 2], [0, 1, 2], [0, 1]), ([3, 4], [3, 4, 5, 6], [2, 3])],
    3: [([0, 1], [0, 1, 2], [0]), ([2, 3], [3, 4, 5], [1]), ([4], [6], [2, 3])],
    7: [([0], [0], []), ([1], [1, 2], [0]), ([2], [], [1]), ([3], [3, 4, 5], []),
        ([4], [6], [2, 3]), ([], [], []), ([], [], [])],
}


def _item_ids(inputs: torch.Tensor) -> list[int]:
    """Item identities of H's inputs: every element of item i equals i."""
    flat = inputs.flatten(1)
    assert torch.equal(flat, flat[:, :1].expand_as(flat)), "item mixed with another"
    return [int(v) for v in flat[:, 0]]


@pytest.mark.parametrize("dp", sorted(H_SHARDS))
def test_shard_hand_built(dp):
    batch = hand_batch()
    for rank, (samples, images, clips) in enumerate(H_SHARDS[dp]):
        part = shard(batch, dp, rank)
        assert part.batch_size == len(samples)
        assert torch.equal(part.tokens, batch.tokens[samples])
        assert torch.equal(part.labels, batch.labels[samples])
        assert torch.equal(part.loss_mask, batch.loss_mask[samples])
        assert _item_ids(part.modalities["vision"].inputs) == images
        assert _item_ids(part.modalities["audio"].inputs) == clips
        assert list(part.modalities["vision"].items_per_sample) == [H_IMAGES[s] for s in samples]
        assert part.tokens_per_sample("vision") == [2 * H_IMAGES[s] for s in samples]
        assert part.tokens_per_sample("audio") == [H_CLIPS[s] for s in samples]
        assert part.modalities["vision"].inputs.shape[1:] == (3, 4, 4)
        assert part.special_token_ids == {"vision": VISION, "audio": AUDIO}
        assert part.document_ids is None and part.positions is None


@pytest.mark.parametrize("dp", sorted(H_SHARDS))
def test_microbatches_follow_the_shard_rule(dp):
    batch = hand_batch(with_packing=True)
    for rank, mb in enumerate(microbatches(batch, dp)):
        samples, images, clips = H_SHARDS[dp][rank]
        assert torch.equal(mb.tokens, batch.tokens[samples])
        assert torch.equal(mb.document_ids, batch.document_ids[samples])
        assert torch.equal(mb.positions, batch.positions[samples])
        assert _item_ids(mb.modalities["vision"].inputs) == images
        assert _item_ids(mb.modalities["audio"].inputs) == clips


# Batch H's images at their own size: image i is a [1, i + 1] tensor of value i with V_TOKENS[i] tokens.
V_TOKENS = (1, 2, 3, 4, 5, 6, 7)


def varied_hand_batch() -> MimoBatch:
    per_sample = [sum(V_TOKENS[i] for i in range(a, a + n))
                  for a, n in zip([0, 1, 3, 3, 6], H_IMAGES)]  # images 0 | 1, 2 | - | 3, 4, 5 | 6
    assert per_sample == [1, 5, 0, 15, 7]
    tokens = torch.tensor([[VISION] * n + [7] * (16 - n) for n in per_sample])
    return MimoBatch(tokens=tokens, labels=tokens, loss_mask=torch.ones(5, 16),
                     modalities={"vision": ModalityInputs(
                         inputs=[torch.full((1, i + 1), float(i)) for i in range(7)],
                         items_per_sample=H_IMAGES, tokens_per_item=V_TOKENS, special_token_id=VISION)})


@pytest.mark.parametrize("dp", sorted(H_SHARDS))
def test_shard_of_items_of_their_own_size_keeps_each_items_tokens(dp):
    """Per-item token counts are cut by item, like the inputs: a shard's tokens_per_item are its
    own images' counts (hand-written V_TOKENS of H_SHARDS' image ids), and its tokens per sample
    the sums over each sample's own images, as shard and microbatches give them alike."""
    batch = varied_hand_batch()
    per_sample = [1, 5, 0, 15, 7]
    for parts in (shard(batch, dp, r) for r in range(dp)), microbatches(batch, dp):
        for (samples, images, _), part in zip(H_SHARDS[dp], parts):
            m = part.modalities["vision"]
            assert [int(x[0, 0]) for x in m.inputs] == images
            assert [x.shape[1] for x in m.inputs] == [i + 1 for i in images]
            assert m.tokens_per_item == tuple(V_TOKENS[i] for i in images)
            assert part.tokens_per_sample("vision") == [per_sample[s] for s in samples]


def test_tokens_per_sample_hand_built():
    batch = hand_batch()
    assert batch.tokens_per_sample("vision") == [2, 4, 0, 6, 2]
    assert batch.tokens_per_sample("audio") == [0, 1, 1, 0, 2]
    assert batch.num_tokens("vision") == 14 and batch.num_tokens("audio") == 4
    assert batch.modalities["vision"].num_items == 7


def test_microbatches_of_a_shard():
    # dp 2 rank 0 holds samples [0,1,2]; 2 microbatches of it: [0,1] and [2].
    part = shard(hand_batch(), 2, 0)
    first, second = microbatches(part, 2)
    assert _item_ids(first.modalities["vision"].inputs) == [0, 1, 2]
    assert _item_ids(second.modalities["vision"].inputs) == []
    assert _item_ids(second.modalities["audio"].inputs) == [1]
    assert torch.equal(second.tokens, hand_batch().tokens[[2]])


def test_to_moves_every_tensor():
    batch = hand_batch(with_packing=True).to("meta")
    tensors = [batch.tokens, batch.labels, batch.loss_mask, batch.document_ids, batch.positions,
               *(m.inputs for m in batch.modalities.values())]
    assert all(t.device.type == "meta" for t in tensors)
    host = hand_batch(with_packing=True)
    tokens_only = host.to("meta", encoder_inputs=False)  # what a language rank moves
    assert tokens_only.tokens.device.type == tokens_only.positions.device.type == "meta"
    assert all(tokens_only.modalities[n].inputs is m.inputs for n, m in host.modalities.items())


def _as_is(item):
    """The loader's collate: the worker's item as it is."""
    return item


class _OneFlat(torch.utils.data.Dataset):
    def __init__(self, obj) -> None:
        self.obj = obj

    def __getitem__(self, i):
        from dtensor_mimo.data.transfer import Flat

        return Flat.pack(self.obj)

    def __len__(self) -> int:
        return 1


def test_flat_keeps_tensors_of_any_byte_size_and_dtype():
    """`Flat` round trip of tensors whose byte sizes are not multiples of the next one's element
    size (a bool loss mask of 15 bytes, then int64 ids, bf16, float64, 0-element and 0-d ones):
    each comes back with its dtype, shape and values, as torch holds them (each lies at an
    aligned offset of the one buffer, so a view of any dtype can be taken)."""
    from dtensor_mimo.data.transfer import Flat

    obj = [torch.tensor([[True, False, True]] * 5), torch.arange(6).view(2, 3), torch.tensor([1.5, -2.0]).bfloat16(),
           torch.tensor([7], dtype=torch.uint8), torch.arange(3, dtype=torch.float64), torch.empty(0, 4),
           torch.tensor(3, dtype=torch.int32), torch.tensor([[0.25] * 3])]
    got = pickle.loads(pickle.dumps(Flat.pack(obj))).unpack()
    assert len(got) == len(obj)
    for g, o in zip(got, obj):
        assert g.dtype == o.dtype and g.shape == o.shape and torch.equal(g, o), (g, o)


def test_a_batch_crosses_from_a_loader_worker_as_one_buffer():
    from dtensor_mimo.data.transfer import Flat

    batch = hand_batch(with_packing=True)
    varied = ModalityInputs([torch.full((3, 4, 2 + i), float(i)) for i in range(3)], (1, 2), (2, 3, 1), 7)
    stand_in = torch.zeros(()).expand(5, 3)  # stride 0: pickled as it is, not copied out
    obj = (batch, varied, ["a note"], stand_in, torch.tensor([1.5, -2.0], dtype=torch.bfloat16))
    flat = Flat.pack(obj)
    assert len(flat.layout) == 5 + 2 + 3 + 1  # batch tensors, its two modalities, the list's three, the bf16
    loader = torch.utils.data.DataLoader(_OneFlat(obj), batch_size=None, num_workers=1, collate_fn=_as_is)
    got = next(iter(loader)).unpack()
    b, v, note, zeros, half = got
    for name in ("tokens", "labels", "loss_mask", "document_ids", "positions"):
        assert torch.equal(getattr(b, name), getattr(batch, name)) and getattr(b, name).dtype == getattr(batch, name).dtype
    for name, m in batch.modalities.items():
        assert torch.equal(b.modalities[name].inputs, m.inputs) and b.modalities[name].items_per_sample == m.items_per_sample
    assert all(torch.equal(x, y) for x, y in zip(v.inputs, varied.inputs)) and v.tokens_per_item == (2, 3, 1)
    assert note == ["a note"] and zeros.stride() == (0, 0) and torch.equal(zeros, stand_in)
    assert half.dtype == torch.bfloat16 and half.tolist() == [1.5, -2.0]
    # Each tensor is a view of the one buffer, at an aligned offset.
    assert b.tokens.untyped_storage().data_ptr() == half.untyped_storage().data_ptr()


class _Numbered(torch.utils.data.Dataset):
    """Batch i: int32 values i of a size that varies with i, and a list of i + 1 int64s."""

    def __init__(self, handover) -> None:
        self.handover = handover

    def __getitem__(self, i):
        return self.handover.pack((torch.full((1000 + 700 * (i % 4),), i, dtype=torch.int32), [torch.arange(i + 1)]))

    def __len__(self) -> int:
        return 10_000


def _numbered_right(got, i) -> bool:
    values, (counted,) = got
    return (values.shape == (1000 + 700 * (i % 4),) and bool((values == i).all())
            and counted.tolist() == list(range(i + 1)))


def test_a_loader_worker_reuses_its_segments_and_never_overwrites_a_batch_the_rank_holds(monkeypatch):
    """`Handover`: a worker's batches cross in a few shared segments that the rank frees as it
    drops each batch (each segment crosses once, or again when it grows); batches the rank keeps hold their own
    values while the worker goes on (it takes other segments, then new buffers, never a held
    one); once dropped, their segments are reused again."""
    from dtensor_mimo.data import transfer
    from dtensor_mimo.data.transfer import Handover

    crossed = []  # per batch the rank takes from a segment: whether the segment itself crossed with it
    take = transfer._Receiver.flat
    monkeypatch.setattr(transfer._Receiver, "flat", lambda self, pool, index, segment, *rest: (
        crossed.append(segment is not None), take(self, pool, index, segment, *rest))[1])
    context = "fork" if sys.platform.startswith("linux") else None
    loader = torch.utils.data.DataLoader(_Numbered(Handover(segments=4)), batch_size=None, num_workers=1,
                                         collate_fn=_as_is, multiprocessing_context=context, prefetch_factor=2,
                                         persistent_workers=True)
    stream = iter(loader)
    for i in range(16):  # each batch dropped before the next: segments come back
        got = next(stream).unpack()
        assert _numbered_right(got, i), i
        del got
    # (addresses cannot tell: a new segment is often mapped where the last one was unmapped)
    # 4 segments made, each grown at most twice (8, 12, 16 KiB), every other batch by name
    assert len(crossed) == 16 and sum(crossed) <= 4 * 3, crossed
    held = [(i, next(stream).unpack()) for i in range(16, 32)]  # kept: 4 segments, then buffers of their own
    assert all(_numbered_right(got, i) for i, got in held)
    assert len({got[0].untyped_storage().data_ptr() for _, got in held}) == len(held)
    del held
    gc.collect()
    before = len(crossed)
    for i in range(32, 44):
        got = next(stream).unpack()
        assert _numbered_right(got, i), i
        del got
    # dropped, the segments come back (the first few batches were made while the rank held them all)
    assert len(crossed) - before >= 8, crossed[before:]


def test_a_handover_pickled_into_a_worker_hands_its_batches_back_by_name():
    """A `Handover` travels into spawned workers pickled: it packs there into a pool of its own
    (fork copies share nothing either), and its batches are read back by the process that made
    it, from the segment it names; in the making process, `pack` is `Flat.pack`."""
    import torch.multiprocessing  # noqa: F401 - registers the tensor reductions on ForkingPickler
    from multiprocessing.reduction import ForkingPickler

    from dtensor_mimo.data.transfer import Flat, Handover

    handover = Handover()
    obj = (torch.arange(6).view(2, 3), ["x"])
    assert handover.pack(obj).claim is None
    copy = pickle.loads(pickle.dumps(handover))  # as a spawned worker gets it
    flat = copy.pack(obj)
    assert flat.claim is not None and flat.claim.segment is not None  # a segment that crosses once
    got = pickle.loads(ForkingPickler.dumps(flat))
    assert isinstance(got, Flat) and got.claim is None
    (t, note), = [got.unpack()]
    assert torch.equal(t, obj[0]) and note == ["x"]
    del got, t
    again = copy.pack((torch.arange(6).view(2, 3) * 2, ["y"]))
    assert again.claim.segment is None and again.claim.index == flat.claim.index  # the freed one, by name
    t, note = pickle.loads(ForkingPickler.dumps(again)).unpack()
    assert torch.equal(t, obj[0] * 2) and note == ["y"]
    del handover
    gc.collect()
    with pytest.raises(RuntimeError, match="without its Handover"):
        pickle.loads(ForkingPickler.dumps(copy.pack(obj)))


def test_a_process_forked_from_the_rank_frees_no_segment_the_rank_holds():
    """A process forked from the rank (a new epoch's loader workers, any subprocess) inherits the
    rank's batches and the pools' shared free flags; when it drops its copy of a batch, the
    segment stays the rank's: the worker's next batch must not be written over the batch the rank
    still holds (its values: the ones packed, not the next batch's)."""
    import torch.multiprocessing  # noqa: F401 - registers the tensor reductions on ForkingPickler
    from multiprocessing.reduction import ForkingPickler

    from dtensor_mimo.data.transfer import Handover

    if not hasattr(os, "fork"):
        pytest.skip("needs fork")
    handover = Handover()
    worker = pickle.loads(pickle.dumps(handover))  # as a spawned worker gets it
    obj = torch.arange(6).view(2, 3)
    held = pickle.loads(ForkingPickler.dumps(worker.pack(obj))).unpack()  # the rank keeps this batch
    pid = os.fork()
    if pid == 0:  # the forked process drops its copy of the batch, then ends
        try:
            del held
            gc.collect()
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    nxt = pickle.loads(ForkingPickler.dumps(worker.pack(obj * 10))).unpack()
    assert torch.equal(held, obj), held  # not overwritten by the worker's next batch
    assert torch.equal(nxt, obj * 10)


def test_sample_range_is_tensor_split():
    for n in range(13):
        for parts in range(1, 9):
            expected = [e.tolist() for e in torch.tensor_split(torch.arange(n), parts)]
            assert [list(sample_range(n, parts, i)) for i in range(parts)] == expected, (n, parts)


# ------------------------------------------------------------------ property: any ragged batch


@st.composite
def ragged_batches(draw):
    b = draw(st.integers(0, 9))
    per_item = {"vision": draw(st.integers(0, 3)), "audio": draw(st.integers(1, 2))}
    counts = {name: draw(st.lists(st.integers(0, 3), min_size=b, max_size=b)) for name in per_item}
    s = max([1] + [sum(counts[n][i] * per_item[n] for n in per_item) for i in range(b)]) + 2
    ids = {"vision": VISION, "audio": AUDIO}
    rows = []
    for i in range(b):
        row = []
        for name in per_item:
            row += [ids[name]] * (counts[name][i] * per_item[name])
        rows.append(row + [7] * (s - len(row)))
    modalities = {}
    for name in per_item:
        n = sum(counts[name])
        modalities[name] = ModalityInputs(
            inputs=torch.arange(float(n)).view(n, 1, 1).expand(n, 2, 3).clone(),
            items_per_sample=counts[name],
            tokens_per_item=per_item[name],
            special_token_id=ids[name],
        )
    tokens = torch.tensor(rows, dtype=torch.int64).view(b, s)
    batch = MimoBatch(tokens=tokens, labels=tokens, loss_mask=torch.ones(b, s, dtype=torch.bool),
                      modalities=modalities)
    return batch, counts, draw(st.integers(1, 12))


@settings(max_examples=60, deadline=None)
@given(ragged_batches())
def test_shard_property(case):
    batch, counts, dp = case
    b = batch.batch_size
    owner = {name: [s for s in range(b) for _ in range(c[s])] for name, c in counts.items()}
    expected_samples = torch.tensor_split(torch.arange(b), dp)
    parts = [shard(batch, dp, r) for r in range(dp)]
    for part, samples in zip(parts, expected_samples):
        samples = samples.tolist()
        assert torch.equal(part.tokens, batch.tokens[samples])
        for name in counts:
            items = [j for j, s in enumerate(owner[name]) if s in samples]
            assert _item_ids(part.modalities[name].inputs) == items
            full = batch.tokens_per_sample(name)
            assert part.tokens_per_sample(name) == [full[s] for s in samples]
    for name in counts:
        rejoined = torch.cat([p.modalities[name].inputs for p in parts])
        assert torch.equal(rejoined, batch.modalities[name].inputs)


# ------------------------------------------------------------------ generator


def _runs(row: list[int], token_id: int) -> list[int]:
    """Lengths of the maximal runs of `token_id` in `row`."""
    runs, n = [], 0
    for t in row + [None]:
        if t == token_id:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def check_generated(batch: MimoBatch, spec: SyntheticSpec) -> None:
    """Every documented invariant of `synthetic_batch`, recomputed from the raw tensors."""
    b, s = spec.batch_size, spec.seq_len
    assert batch.tokens.shape == (b, s) and batch.tokens.dtype == torch.int64
    special = {m.special_token_id for m in spec.modalities.values()}
    packed = spec.documents_per_row > 1
    assert (batch.document_ids is not None) == packed and (batch.positions is not None) == packed
    docs = batch.document_ids if packed else torch.zeros(b, s, dtype=torch.int64)
    for name, m in spec.modalities.items():
        got = batch.modalities[name]
        assert got.tokens_per_item == m.tokens_per_item
        assert got.special_token_id == m.special_token_id
        assert got.inputs.shape == (sum(got.items_per_sample), *m.item_shape)
        assert all(0 <= n <= m.max_items for n in got.items_per_sample)
    for i in range(b):
        row = batch.tokens[i].tolist()
        for name, m in spec.modalities.items():
            n_items = batch.modalities[name].items_per_sample[i]
            assert row.count(m.special_token_id) == n_items * m.tokens_per_item
            # Adjacent items merge into one run; an item is never cut by text.
            assert all(r % m.tokens_per_item == 0 for r in _runs(row, m.special_token_id))
        for p, t in enumerate(row):
            if t not in special:
                assert 0 <= t < spec.vocab_size
        doc = docs[i].tolist()
        assert doc[0] == 0 and all(doc[p + 1] - doc[p] in (0, 1) for p in range(s - 1))
        assert max(doc) < spec.documents_per_row
        # A document never starts inside an item: a cut between two equal special ids must
        # fall on an item boundary (the run before the cut is a whole number of items).
        for p in range(1, s):
            if doc[p] != doc[p - 1] and row[p] == row[p - 1] and row[p] in special:
                tpi = next(m.tokens_per_item for m in spec.modalities.values()
                           if m.special_token_id == row[p])
                run = 0
                while p - 1 - run >= 0 and row[p - 1 - run] == row[p]:
                    run += 1
                assert run % tpi == 0
        start = 0
        for p in range(s):
            if p and doc[p] != doc[p - 1]:
                start = p
            if packed:
                assert batch.positions[i, p] == p - start
            nxt_ok = p + 1 < s and doc[p + 1] == doc[p] and row[p + 1] not in special
            assert batch.labels[i, p] == (row[p + 1] if nxt_ok else IGNORE_INDEX)
            mask = float(batch.loss_mask[i, p])
            assert mask in (0.0, 1.0)
            if row[p] in special or not nxt_ok:
                assert mask == 0.0
        # The masked prompt prefix: each document's positions with a target are 0...0 1...1.
        for d in set(doc):
            cols = [p for p in range(s) if doc[p] == d]
            eligible = [float(batch.loss_mask[i, p]) for p in cols
                        if row[p] not in special and batch.labels[i, p] != IGNORE_INDEX]
            assert eligible == sorted(eligible)
            assert eligible.count(0.0) <= len(cols) // 2


SPECS = {
    "tiny": SyntheticSpec.tiny(),
    "tiny packed": SyntheticSpec.tiny(documents_per_row=4, batch_size=7),
    "ids inside vocab": SyntheticSpec(
        batch_size=6, seq_len=40, vocab_size=20,
        modalities={"vision": ModalitySpec(3, (1, 2, 2), 4, max_items=3),
                    "audio": ModalitySpec(19, (2, 5), 3, max_items=2)},
        text_only_samples=2),
    "one modality, 1-token items": SyntheticSpec(
        batch_size=4, seq_len=6, vocab_size=3,
        modalities={"vision": ModalitySpec(1, (1,), 1, max_items=6)}, documents_per_row=3),
    "text only": SyntheticSpec(batch_size=3, seq_len=5, vocab_size=4, text_only_samples=3),
}


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("seed", range(6))
def test_generator_invariants(name, seed):
    check_generated(synthetic_batch(SPECS[name], seed), SPECS[name])


@pytest.mark.parametrize("name", sorted(SPECS))
def test_generator_deterministic(name):
    spec = SPECS[name]

    def fields(batch):
        out = [batch.tokens, batch.labels, batch.loss_mask, batch.document_ids, batch.positions]
        for m in batch.modalities.values():
            out += [m.inputs, torch.tensor(m.items_per_sample)]
        return out

    a, again, other = (fields(synthetic_batch(spec, seed)) for seed in (3, 3, 4))
    for x, y in zip(a, again):
        assert (x is None and y is None) or torch.equal(x, y)
    assert any(x is not None and not torch.equal(x, z) for x, z in zip(a, other))


@pytest.mark.parametrize("seed", range(6))
def test_generator_raggedness(seed):
    spec = SPECS["ids inside vocab"]
    batch = synthetic_batch(spec, seed)
    items = {n: batch.modalities[n].items_per_sample for n in spec.modalities}
    text_only = [i for i in range(spec.batch_size) if all(items[n][i] == 0 for n in items)]
    assert len(text_only) >= spec.text_only_samples
    assert any(all(items[n][i] == spec.modalities[n].max_items for n in items)
               for i in range(spec.batch_size))
    # The loss mask is asymmetric: some text positions with a target are masked (prompts).
    with_target = (batch.labels != IGNORE_INDEX) & ~torch.isin(batch.tokens, torch.tensor([3, 19]))
    assert 0 < batch.loss_mask[with_target].sum() < with_target.sum()


def test_generator_shards_feed_real_encoders():
    """Encoder output rows per shard == the batch's token counts (what the bridge moves)."""
    vit_cfg, audio_cfg = ViTConfig.tiny(n_layers=1), AudioConfig.tiny(n_layers=1)
    spec = SyntheticSpec(
        batch_size=5, seq_len=64, vocab_size=64,
        modalities={"vision": ModalitySpec.image(vit_cfg, 64, max_items=2),
                    "audio": ModalitySpec.audio(audio_cfg, 65, frames=20, max_items=1)})
    batch = synthetic_batch(spec, 0)
    vit, audio = ViT(vit_cfg), AudioEncoder(audio_cfg)
    with torch.no_grad():
        for rank in range(3):
            part = shard(batch, 3, rank)
            rows = vit(part.modalities["vision"].inputs).flatten(0, 1).shape[0]
            assert rows == sum(part.tokens_per_sample("vision"))
            assert rows == int((part.tokens == 64).sum())
            rows = audio(part.modalities["audio"].inputs).flatten(0, 1).shape[0]
            assert rows == sum(part.tokens_per_sample("audio")) == int((part.tokens == 65).sum())


def test_tiny_spec_fits_the_tiny_encoders():
    """`SyntheticSpec.tiny` writes its item shapes out (the data layer imports no model class):
    they are what `ViTConfig.tiny` and `AudioConfig.tiny` take and make."""
    tiny = SyntheticSpec.tiny().modalities
    assert tiny["vision"] == ModalitySpec.image(ViTConfig.tiny(), 64, max_items=2)
    assert tiny["audio"] == ModalitySpec.audio(AudioConfig.tiny(), 65, max_items=1)


# ------------------------------------------------------------------ validation errors


def _modality(**overrides) -> ModalityInputs:
    fields = dict(inputs=torch.zeros(3, 2), items_per_sample=[1, 2], tokens_per_item=2,
                  special_token_id=VISION)
    fields.update(overrides)
    return ModalityInputs(**fields)


def _batch(**overrides) -> MimoBatch:
    tokens = torch.tensor([[VISION, VISION, 1, 2, 3, 4], [VISION] * 4 + [5, 6]])
    fields = dict(tokens=tokens, labels=tokens, loss_mask=torch.ones(2, 6),
                  modalities={"vision": _modality()})
    fields.update(overrides)
    return MimoBatch(**fields)


BATCH_ERRORS = [
    ("tokens dtype", dict(tokens=torch.zeros(2, 6, dtype=torch.int32)),
     "tokens must be [B, S] int64, got [2, 6] torch.int32"),
    ("labels shape", dict(labels=torch.zeros(2, 5, dtype=torch.int64)),
     "labels has shape [2, 5] but tokens have [2, 6]; every per-token field is [B, S]"),
    ("positions shape", dict(positions=torch.zeros(6, 2, dtype=torch.int64)),
     "positions has shape [6, 2] but tokens have [2, 6]"),
    ("labels dtype", dict(labels=torch.zeros(2, 6)), "labels must be int64 like tokens, got torch.float32"),
    ("loss mask dtype", dict(loss_mask=torch.ones(2, 6, dtype=torch.int64)),
     "loss_mask must be float or bool, got torch.int64"),
    ("items_per_sample length", dict(modalities={"vision": _modality(items_per_sample=[3])}),
     "'vision': items_per_sample has 1 entries for a batch of 2 samples"),
    ("negative count", dict(modalities={"vision": _modality(items_per_sample=[4, -1])}),
     "'vision': items_per_sample [4, -1] and tokens_per_item 2 must be >= 0"),
    ("inputs rows", dict(modalities={"vision": _modality(inputs=torch.zeros(4, 2))}),
     "'vision': items_per_sample [1, 2] sum to 3 items but inputs have shape [4, 2]"),
    ("token count", dict(modalities={"vision": _modality(items_per_sample=[2, 1],
                                                         inputs=torch.zeros(3, 2))}),
     "sample 0 has 2 'vision' tokens (id 100) but items_per_sample[0]=2 x tokens_per_item=2 = 4"),
    ("shared id", dict(modalities={"vision": _modality(),
                                   "audio": _modality(inputs=torch.zeros(0, 2),
                                                      items_per_sample=[0, 0])}),
     "modalities 'vision' and 'audio' share special token id 100; each modality needs its own id"),
]


@pytest.mark.parametrize("case, overrides, message", BATCH_ERRORS, ids=[c[0] for c in BATCH_ERRORS])
def test_batch_errors(case, overrides, message):
    with pytest.raises(BatchError, match=re.escape(message)):
        _batch(**overrides)


def test_item_counts_must_be_integers():
    with pytest.raises(BatchError, match=re.escape("items_per_sample [1.7, 1] and tokens_per_item 2 must be integers")):
        _modality(items_per_sample=[1.7, 1])


def test_batch_query_and_split_errors():
    batch = _batch()
    with pytest.raises(KeyError, match=re.escape("the batch has no modality 'audio'; its "
                                                 "modalities are ['vision']")):
        batch.tokens_per_sample("audio")
    with pytest.raises(BatchError, match=re.escape("part index 2 is outside 0..1 (2 parts)")):
        shard(batch, 2, 2)
    with pytest.raises(BatchError, match=re.escape("cannot split a batch into 0 parts")):
        microbatches(batch, 0)
    message = "contiguous range inside 0..2, got range(0, 3)"
    with pytest.raises(BatchError, match=re.escape(message)):
        batch.select_samples(range(3))


SPEC_ERRORS = [
    (dict(modalities={"a": ModalitySpec(70, (1,), 1), "b": ModalitySpec(70, (1,), 1)}),
     "special token ids [70, 70] must be distinct"),
    (dict(vocab_size=1, modalities={"a": ModalitySpec(0, (1,), 1)}),
     "vocab_size=1 leaves no text id besides the special ids [0]"),
    (dict(seq_len=10, modalities={"a": ModalitySpec(70, (1,), 4, max_items=2),
                                  "b": ModalitySpec(71, (1,), 3, max_items=1)}),
     "a sample with max_items of every modality needs 11 special tokens but seq_len is 10"),
    (dict(text_only_samples=6), "text_only_samples=6 must be in 0..batch_size=5"),
    (dict(documents_per_row=0), "documents_per_row=0 must be >= 1"),
    (dict(seq_len=0), "batch_size=5 must be >= 0 and seq_len=0 >= 1"),
]


@pytest.mark.parametrize("overrides, message", SPEC_ERRORS)
def test_spec_errors(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SyntheticSpec.tiny(**overrides)


def _extensible_wav(samples, rate: int, subformat: int = 1) -> bytes:
    """`samples` (int16 [frames, channels]) as a WAVE_FORMAT_EXTENSIBLE file (ffmpeg's and sox's
    form for more than two channels), with a chunk before `fmt ` and one of odd size between it
    and `data`, as other writers leave them."""
    import struct

    frames, channels = samples.shape
    guid = struct.pack("<H", subformat) + bytes.fromhex("0000000010008000" "00aa00389b71")
    fmt = struct.pack("<HHIIHHHHI", 0xFFFE, channels, rate, rate * channels * 2, channels * 2, 16, 22, 16, 0) + guid
    data = samples.astype("<i2").tobytes()
    chunks = b"".join(kind + struct.pack("<I", len(body)) + body + b"\0" * (len(body) % 2)
                      for kind, body in ((b"JUNK", b"\0" * 4), (b"fmt ", fmt), (b"LIST", b"abc"), (b"data", data)))
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


def test_extensible_wav_files_read_as_plain_pcm(tmp_path) -> None:
    """A WAVE_FORMAT_EXTENSIBLE file of PCM samples (which Python's `wave` refuses before 3.12)
    reads as the same samples written as plain PCM, from a path or a file object; a float
    subformat is refused as not PCM."""
    import io
    import wave

    import numpy as np

    from dtensor_mimo.data.conversation import DataError, _read_wav, _wav

    samples = (np.arange(30).reshape(10, 3) * 1000 - 15000).astype(np.int16)
    with wave.open(str(tmp_path / "plain.wav"), "wb") as w:
        w.setnchannels(3)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(samples.tobytes())
    (tmp_path / "ext.wav").write_bytes(_extensible_wav(samples, 16000))
    plain, rate = _read_wav(str(tmp_path / "plain.wav"))
    for source in (str(tmp_path / "ext.wav"), io.BytesIO((tmp_path / "ext.wav").read_bytes())):
        got, got_rate = _read_wav(source)
        assert got_rate == rate == 16000 and torch.equal(got, plain)
    assert _wav(str(tmp_path / "ext.wav"), read=False)[:4] == (16000, 2, 3, 10)
    (tmp_path / "float.wav").write_bytes(_extensible_wav(samples, 16000, subformat=3))
    with pytest.raises(DataError, match=r"float.wav: not a PCM WAV file \(unknown format: 65534 with subformat 0300"):
        _read_wav(str(tmp_path / "float.wav"))


def test_wav_samples_are_mono_floats_worked_out_by_hand(tmp_path) -> None:
    """`_read_wav` gives what a Whisper feature extractor takes: mono float samples in [-1, 1].
    8-bit WAV is unsigned (128 is silence: (v - 128) / 128), 16 and 32-bit signed (v / 2^15,
    v / 2^31); several channels are averaged, not one of them kept."""
    import wave

    import numpy as np

    from dtensor_mimo.data.conversation import _read_wav

    cases = {  # name: (sample width, channels, frames as written, the floats expected)
        "u8": (1, 1, np.array([[0], [64], [128], [255]], dtype=np.uint8), [-1.0, -0.5, 0.0, 127 / 128]),
        "s16 stereo": (2, 2, np.array([[16384, -16384], [32767, 32767], [-32768, 0]], dtype=np.int16),
                       [0.0, 32767 / 32768, -0.5]),
        "s32 three": (4, 3, np.array([[1 << 30, 0, -(1 << 30)], [1 << 30, 1 << 30, 1 << 30]], dtype=np.int32),
                      [0.0, 0.5]),
    }
    for name, (width, channels, frames, expected) in cases.items():
        path = str(tmp_path / f"{name.replace(' ', '_')}.wav")
        with wave.open(path, "wb") as w:
            w.setnchannels(channels)
            w.setsampwidth(width)
            w.setframerate(16000)
            w.writeframes(frames.tobytes())
        samples, rate = _read_wav(path)
        assert rate == 16000 and samples.tolist() == expected, name


def test_non_pcm_extensible_wav_is_named_alike_on_every_python(tmp_path, monkeypatch) -> None:
    """From Python 3.12 on, `wave` reads WAVE_FORMAT_EXTENSIBLE itself and refuses a non-PCM
    subformat with its own words ("unknown extended format: <uuid>"), not the "unknown format:
    65534" of 3.10/3.11: the file is still named with its subformat, as on those. A header of
    zero channels or block align is a DataError too, not a ZeroDivisionError."""
    import struct
    import wave

    import numpy as np

    from dtensor_mimo.data import conversation
    from dtensor_mimo.data.conversation import DataError, _read_wav

    samples = np.zeros((4, 3), dtype=np.int16)
    (tmp_path / "float.wav").write_bytes(_extensible_wav(samples, 16000, subformat=3))
    opened = wave.open

    def wave_of_python_312(path, mode=None):  # what 3.12's wave raises for that file
        with open(path, "rb") as f:
            if b"\xfe\xff" in f.read(64):
                raise wave.Error("unknown extended format: 00000003-0000-0010-8000-00aa00389b71")
        return opened(path, mode)

    monkeypatch.setattr(conversation.wave, "open", wave_of_python_312)
    with pytest.raises(DataError, match=r"float.wav: not a PCM WAV file \(unknown format: 65534 with subformat 0300"):
        _read_wav(str(tmp_path / "float.wav"))
    monkeypatch.undo()
    broken = bytearray(_extensible_wav(samples, 16000))
    at = broken.index(b"fmt ") + 8
    broken[at + 2:at + 4] = struct.pack("<H", 0)  # channels
    broken[at + 12:at + 14] = struct.pack("<H", 0)  # block align
    (tmp_path / "zero.wav").write_bytes(bytes(broken))
    with pytest.raises(DataError, match=r"zero.wav: not a PCM WAV file"):
        _read_wav(str(tmp_path / "zero.wav"))


def test_a_sample_the_chat_template_refuses_is_named(tmp_path) -> None:
    """A chat template may refuse a conversation (Gemma's has no system role, Llama 2's and
    Mistral's want user and assistant turns to alternate: jinja's `raise_exception`, a
    TemplateError). Tokenizing such a sample is a DataError naming the data, the sample id and the
    template's words, as the launcher's checks and a rank's errors expect of bad data; not a bare
    TemplateError that names no sample of a corpus of millions."""
    import json

    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dtensor_mimo.data.conversation import ConversationDataset, DataError

    vocab = {f"t{i}": i for i in range(60)} | {"<unk>": 60}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                               "{{ raise_exception('System role not supported') }}{% endif %}"
                               "{{ m['content'] }} {% endfor %}")
    turns = [{"from": "human", "value": "t1"}, {"from": "gpt", "value": "t2"}]
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"id": "fine", "conversations": turns}) + "\n"
                    + json.dumps({"id": "s-7", "conversations": [{"from": "system", "value": "t3"}, *turns]}) + "\n")
    data = ConversationDataset(str(path), tokenizer, {}, seq_len=8)
    assert data.batch([0]).tokens[0, :2].tolist() == [1, 2]
    with pytest.raises(DataError, match=r"train.jsonl.*sample 's-7'.*System role not supported"):
        data.batch([1])


def test_an_image_its_processor_sizes_unlike_the_others_is_a_media_error(tmp_path) -> None:
    """An image processor that keeps the aspect ratio (CLIP's shortest edge, no crop) passes the
    launcher's probe of a square first image, then turns a wide one into another shape than the
    encoder takes, and fails to batch two images of different shapes. Only the ranks that encode the
    images meet either; a rank that loads no item builds its batch. Each must be the MediaError of
    the file and its sample (`_LoadPlan.tolerant` then builds the row as zeros and the step's
    all-reduce tells every rank, which names or skips it alike), not a DataError or a bare
    ValueError raised on the encoder's ranks alone while the others wait in the step."""
    import json
    import os

    transformers = pytest.importorskip("transformers")
    from PIL import Image
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dtensor_mimo.data.conversation import ConversationDataset, MediaSpec, image_inputs
    from dtensor_mimo.train.trainer import _LoadPlan

    vocab = {f"t{i}": i for i in range(60)} | {"<unk>": 60, "<image>": 61}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                                     additional_special_tokens=["<image>"])
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    Image.new("RGB", (16, 16), (200, 10, 10)).save(tmp_path / "square.png")
    Image.new("RGB", (32, 16), (10, 200, 10)).save(tmp_path / "wide.png")
    with open(tmp_path / "train.jsonl", "w") as f:
        for i, image in enumerate(["square.png", "wide.png"]):
            turns = [{"from": "human", "value": "<image> t1"}, {"from": "gpt", "value": "t2"}]
            f.write(json.dumps({"id": f"s{i}", "image": image, "conversations": turns}) + "\n")
    processor = transformers.CLIPImageProcessor(size={"shortest_edge": 16}, do_center_crop=False)
    spec = MediaSpec("image", 61, 4, (3, 16, 16), image_inputs(processor))
    data = ConversationDataset(str(tmp_path / "train.jsonl"), tokenizer, {"vision": spec}, seq_len=16)
    square = image_inputs(processor)([str(tmp_path / "square.png")])[0]
    assert data.batch([0, 1], load={}).modalities["vision"].inputs.shape == (2, 3, 16, 16)  # a language rank
    for rows in ([1], [0, 1]):  # the encoder's rank(s): the wide image alone, both together
        batch, failed = _LoadPlan({"vision": rows}, 1, {}).tolerant(data.batch, [0, 1])
        assert [(e.row, e.sample_id, os.path.basename(e.path)) for e in failed] == [(1, "s1", "wide.png")]
        assert "[3, 16, 32]" in str(failed[0]) and "s1" in str(failed[0])
        inputs = batch.modalities["vision"].inputs
        assert inputs.shape == (2, 3, 16, 16) and not inputs[1].any()
        assert torch.equal(inputs[0], square if 0 in rows else torch.zeros_like(square))


def test_media_no_sample_could_be_read_with_are_refused_when_the_dataset_is_built(tmp_path) -> None:
    """Two image towers (a SigLIP and a CLIP one, as hybrid-vision models have) given one
    `MediaSpec` each, or a spec whose special_token_id is not the tokenizer's <image>: the dataset
    was built, and every sample with an image then failed as if its own placeholders were wrong
    ("sample 's0': 0 <image> token(s) after tokenization but 1 item(s)"), at the first such sample
    a batch met. Refused when the dataset is built, naming the encoders (or the id) and the fix;
    one spec per modality, each with its placeholder's id, builds the rows as before. So is a
    `MediaSpec` whose items' rows nothing could count (below)."""
    import json

    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dtensor_mimo.data.conversation import ConversationDataset, DataError, MediaSpec

    vocab = {f"t{i}": i for i in range(60)} | {"<unk>": 60, "<image>": 61, "<audio>": 62}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                                     additional_special_tokens=["<image>", "<audio>"])
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"id": "s0", "image": "a.png", "conversations": [
        {"from": "human", "value": "<image> t1"}, {"from": "gpt", "value": "t2"}]}) + "\n")

    def spec(modality: str, token: int) -> MediaSpec:
        return MediaSpec(modality, token, 4, (3, 16, 16), lambda paths: torch.zeros(len(paths), 3, 16, 16))

    with pytest.raises(DataError, match=re.escape("media: encoders ['siglip', 'clip'] all take 'image' items, but "
                                                  "each <image> placeholder")):
        ConversationDataset(str(path), tokenizer, {"siglip": spec("image", 61), "clip": spec("image", 61)}, 16)
    with pytest.raises(DataError, match=re.escape("media['audio']: special_token_id = 61, but the tokenizer makes "
                                                  "<audio> the token(s) [62]")):
        ConversationDataset(str(path), tokenizer, {"vision": spec("image", 61), "audio": spec("audio", 61)}, 16)
    data = ConversationDataset(str(path), tokenizer, {"vision": spec("image", 61), "audio": spec("audio", 62)}, 16)
    assert data[0].tokens == [61] * 4 + [1, 2] and data.batch([0]).modalities["vision"].items_per_sample == (1,)
    # A clip spec whose frame count nothing reads (shape_of): each clip's row got one frame's rows, and every
    # clip was then refused as a broken file; rows without a rule (tokens_for): a bare TypeError.
    with pytest.raises(ValueError, match=r"MediaSpec\('video'\): frames=True needs shape_of"):
        MediaSpec("video", 63, 4, (3, 16, 16), lambda paths: [], frames=True)
    with pytest.raises(ValueError, match=r"MediaSpec\('image'\): shape_of and tokens_for go together"):
        MediaSpec("image", 61, 4, (), lambda paths: [], shape_of=lambda path: (3, 16, 16))


QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
"""Qwen2's pre-tokenizer: a run of whitespace ending in newlines is one piece ("\\n\\n" one token)."""

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' }}{% if message['role'] == 'assistant' %}"
          "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
          "{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
"""Qwen2's ChatML template, each answer in transformers' {% generation %} block (its assistant mask)."""


def test_an_answer_starting_with_a_newline_is_labelled_as_transformers_masks_it(tmp_path) -> None:
    """Qwen's pre-tokenizer makes one token of ChatML's generation prompt's last "\\n" and the
    newline an answer starts with. Such a sample (valid: transformers renders and masks it) was
    refused as a template that "does not render a conversation as its turns one after another".
    Its labels are now transformers' own: `apply_chat_template(return_assistant_tokens_mask=True)`
    marks the answer from the token that reaches into it (the merged "\\n\\n") through <|im_end|>,
    and the held-out prompt stops right before that token."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from dtensor_mimo.data.conversation import ConversationDataset

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    corpus = ["system user assistant You are a helpful assistant.\nWhat is it ?\n\nA red cat .\n \n\n\n"] * 8
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                                     pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    assert tokenizer.tokenize("\n\n") == ["ĊĊ"]
    conversations = [[("human", "What is it ?"), ("gpt", "\nA red cat .")],
                     [("human", "What is it ?"), ("gpt", "A red cat ."), ("human", "What ?"), ("gpt", "\n\nA cat .\n")],
                     [("system", "You are a cat ."), ("human", "What ?"), ("gpt", " \nA cat .")]]
    samples = [{"id": f"s{k}", "conversations": [{"from": f, "value": v} for f, v in turns]}
               for k, turns in enumerate(conversations)]
    data = ConversationDataset(str(tmp_path / "train.jsonl"), tokenizer, {}, seq_len=64, samples=samples)
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    for k, turns in enumerate(conversations):
        reference = tokenizer.apply_chat_template([{"role": roles[f], "content": v} for f, v in turns],
                                                  return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = reference["input_ids"], reference["assistant_masks"]
        assert sum(mask) > 0
        expected = [ids[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]
        batch = data.batch([k])
        assert batch.tokens[0, :len(ids)].tolist() == ids
        assert batch.labels[0].tolist() == expected + [IGNORE_INDEX] * (64 - len(ids))
        first = mask.index(1)
        assert data[k].answers[0][0] == first
        assert (data.prompts([k]).tokens[0, first:] == tokenizer.pad_token_id).all()


def test_an_answer_whose_first_token_resplits_the_prompts_last_is_labelled_as_transformers_masks_it(
        tmp_path) -> None:
    """A template whose generation prompt ends in "\\n\\n" (one token alone) and an answer that
    starts " \\n": the tokenizer's merges ("\\n " before "\\n\\n") split the run "\\n\\n \\n"
    as "\\n" + "\\n " + "\\n", so the conversation's tokens part from the prompt's at a "\\n"
    wholly inside the prompt. The answer starts at the next token, the first to reach into it,
    as transformers' assistant mask has it; its labels and the held-out prompt likewise."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    from dtensor_mimo.data.conversation import ConversationDataset

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate([*specials, *sorted(pre_tokenizers.ByteLevel.alphabet()), "ĊĠ", "ĊĊ"])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("Ċ", "Ġ"), ("Ċ", "Ċ")]))
    backend.add_special_tokens(specials)
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                                     pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML.replace("'\\n' }}{% if message['role'] == 'assistant' %}",
                                             "'\\n' }}{% if message['role'] == 'assistant' %}{{ '\\n' }}"
                                             ).replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n\\n'")
    assert tokenizer.tokenize("a\n\n") == ["a", "ĊĊ"] and tokenizer.tokenize("a\n\n \nb") == ["a", "Ċ", "ĊĠ", "Ċ", "b"]
    turns = [("human", "What ?"), ("gpt", " \nA cat .")]
    data = ConversationDataset(str(tmp_path / "train.jsonl"), tokenizer, {}, seq_len=96,
                               samples=[{"id": "s", "conversations": [{"from": f, "value": v} for f, v in turns]}])
    roles = {"human": "user", "gpt": "assistant"}
    reference = tokenizer.apply_chat_template([{"role": roles[f], "content": v} for f, v in turns],
                                              return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = reference["input_ids"], reference["assistant_masks"]
    first = mask.index(1)
    assert tokenizer.convert_ids_to_tokens(ids[first - 1:first + 1]) == ["Ċ", "ĊĠ"]  # the case at hand
    expected = [ids[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]
    batch = data.batch([0])
    assert batch.tokens[0, :len(ids)].tolist() == ids
    assert batch.labels[0].tolist() == expected + [IGNORE_INDEX] * (96 - len(ids))
    assert data[0].answers[0][0] == first
    assert (data.prompts([0]).tokens[0, first:] == tokenizer.pad_token_id).all()


def test_a_batch_written_in_place_is_read_anew() -> None:
    """A loop that refills its batch's tensors in place (one MimoBatch, new values every step) kept
    what the first step derived from the old values (`MimoBatch.memo`): the loss divided by the old
    loss-token count (a quarter of the tokens taken out of the loss: its value and gradients about 3/4 of
    the truth), and a token id outside the vocabulary written in not refused (the language ranks'
    embedding then raised alone, the encoder ranks waiting for them). What a step reads is the
    batch's current content; what it derived before a write carries over pinning and pickling."""
    from dtensor_mimo.data.batch import step_fingerprint
    from dtensor_mimo.schedule.checks import ids_outside
    from dtensor_mimo.sequence import loss_normalizer

    batch = synthetic_batch(SyntheticSpec.tiny(), seed=3)
    weight = lambda: float(((batch.labels != IGNORE_INDEX) & (batch.loss_mask > 0)).sum())  # noqa: E731
    assert loss_normalizer(batch) == weight() and ids_outside(batch, 64) is None
    before = step_fingerprint(batch)
    counted = (batch.loss_mask > 0).nonzero()
    batch.loss_mask[counted[::4, 0], counted[::4, 1]] = 0.0  # in place: every 4th loss token out
    assert loss_normalizer(batch) == weight() < len(counted)
    assert step_fingerprint(batch) != before
    text = ((batch.tokens < 64) & (batch.labels != IGNORE_INDEX)).nonzero()[0].tolist()
    batch.tokens[text[0], text[1]] = 70
    assert f"sample {text[0]} holds id 70 at position {text[1]}" in ids_outside(batch, 64)
    # Derived from the current values: carried by pickling (a loader process's batch), dropped when stale.
    crossed = pickle.loads(pickle.dumps(batch))
    assert crossed.__dict__["_memo"] == batch.__dict__["_memo"] and loss_normalizer(crossed) == weight()
    batch.labels[0] = IGNORE_INDEX
    assert "_memo" not in pickle.loads(pickle.dumps(batch)).__dict__ and loss_normalizer(batch) == weight()
