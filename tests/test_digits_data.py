"""Specification of the digits dataset, `dtensor_mimo.data.digits` (one process, no process group).

Samples show 0-3 handwritten digit scans (scikit-learn's `load_digits`) and 0-2 keypad tones; the
text asks what they show. Each property is compared with an independent reference:

| property                             | reference                                            |
|--------------------------------------|------------------------------------------------------|
| determinism                          | same seed: every field equal; other seed: differs    |
| held-out split                       | scan sets disjoint, cover all 1,797, 80/20; samples  |
|                                      |   use only their split's scans; tone seeds even/odd  |
| token rows, labels, loss mask        | rebuilt here from descriptors and sklearn's targets  |
| images (shifted, enlarged, channels) | sklearn's raw scans padded, cropped, kron'd and      |
|                                      |   standardized with statistics computed here         |
| the batch validates                  | `MimoBatch` accepts it; ViT / AudioEncoder output    |
|                                      |   rows == special tokens                             |
| per-range loading (`load`)           | slicing the fully loaded batch; the rest is zeros;   |
|                                      |   metadata-only inputs are stride-0 views            |
| `samples_to_load`                    | hand-written sample lists (table below)              |
| DTMF tone                            | FFT peaks at the keypad table written here           |
| log-mel spectrogram                  | peak bands: the nearest HTK mel centres, computed    |
|                                      |   here                                               |
| sampler                              | state round trip; epochs are permutations            |
| exact match, answer parts            | hand-made logits and labels                          |
| no scikit-learn                      | ImportError naming pip install 'dtensor_mimo[data]'  |
| items at their own size (issue 20)   | rows per item from sizes / frames tabled here; the   |
|                                      |   same scans and tones; pixels: the scan on blank    |
|                                      |   paper at its offset; encoders give those rows      |

`samples_to_load` (v: vision, a: audio; language ranks load nothing):

| layout, global batch                           | rank: samples whose inputs it loads             |
|------------------------------------------------|-------------------------------------------------|
| vision dp3, audio dp1, language tp2·dp2; B=8   | 0: v[0,1,2] 1: v[3,4,5] 2: v[6,7] 3: a[0..7]    |
| same, 2 microbatches of 4                      | 0: v[0,1,4,5] 1: v[2,6] 2: v[3,7] 3: a[0..7]    |
| vision pp2·dp2, audio dp1, language dp1; B=5   | 0: v[0,1,2] 1: v[3,4] 2,3 (pp 1): {} 4: a[0..4] |
"""

from __future__ import annotations

import dataclasses
import math
import sys

import pytest
import torch

from dtensor_mimo.data import (
    AUDIO_TOKEN_ID,
    IGNORE_INDEX,
    IMAGE_TOKEN_ID,
    DigitsDataset,
    DigitsTask,
    MimoBatch,
    ResumableBatchSampler,
    answer_digit_positions,
    decode,
    dtmf_tone,
    encode,
    exact_match,
    exact_match_accuracy,
    log_mel_spectrogram,
    samples_to_load,
)
from dtensor_mimo.data import digits as digits_module
from dtensor_mimo.layout import MimoLayout, Parallelism
from dtensor_mimo.models import AudioConfig, AudioEncoder, ViT, ViTConfig

VIT = ViTConfig(image_size=8, patch_size=4, in_channels=1, dim=16, n_layers=1, n_heads=2)
AUDIO = AudioConfig(n_mels=16, max_frames=16, conv_strides=(2, 2), dim=16, n_layers=1, n_heads=2)

KEYPAD = {  # digit: (row Hz, column Hz), from the ITU-T Q.23 keypad
    1: (697, 1209), 2: (697, 1336), 3: (697, 1477),
    4: (770, 1209), 5: (770, 1336), 6: (770, 1477),
    7: (852, 1209), 8: (852, 1336), 9: (852, 1477),
    0: (941, 1336),
}


@pytest.fixture(scope="module")
def sklearn_digits():
    datasets = pytest.importorskip("sklearn.datasets")
    d = datasets.load_digits()
    return torch.tensor(d.images, dtype=torch.float32), torch.tensor(d.target)


@pytest.fixture(scope="module")
def train(sklearn_digits) -> DigitsDataset:
    return DigitsDataset("train", VIT, AUDIO, num_samples=500, seed=3)


@pytest.fixture(scope="module")
def heldout(sklearn_digits) -> DigitsDataset:
    return DigitsDataset("heldout", VIT, AUDIO, num_samples=500, seed=3)


def assert_batches_equal(a: MimoBatch, b: MimoBatch) -> None:
    for name in ("tokens", "labels", "loss_mask"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.modalities.keys() == b.modalities.keys()
    for name, m in a.modalities.items():
        n = b.modalities[name]
        assert m.items_per_sample == n.items_per_sample, name
        assert (m.tokens_per_item, m.special_token_id) == (n.tokens_per_item, n.special_token_id)
        assert torch.equal(m.inputs, n.inputs), name


# ------------------------------------------------------------------ determinism, split


def test_scans_are_load_digits_own(sklearn_digits):
    """The scans read from scikit-learn's file (without importing it) are `load_digits`' own."""
    from dtensor_mimo.data.digits import _scans

    images, targets = _scans()
    assert torch.equal(images, sklearn_digits[0]) and images.dtype == torch.float32
    assert torch.equal(targets, sklearn_digits[1]) and targets.dtype == torch.int64


def test_same_seed_same_batch_other_seed_differs(train):
    again = DigitsDataset("train", VIT, AUDIO, num_samples=500, seed=3)
    assert_batches_equal(train.batch([5, 0, 17, 4]), again.batch([5, 0, 17, 4]))
    other = DigitsDataset("train", VIT, AUDIO, num_samples=500, seed=4)
    assert [train[i] for i in range(20)] != [other[i] for i in range(20)]


def test_heldout_split_is_disjoint(train, heldout, sklearn_digits):
    train_scans, held_scans = set(train.scans.tolist()), set(heldout.scans.tolist())
    assert not train_scans & held_scans
    assert train_scans | held_scans == set(range(1797))
    assert len(held_scans) == round(0.2 * 1797)
    used = {"train": set(), "heldout": set()}
    for ds in (train, heldout):
        for i in range(len(ds)):
            sample = ds[i]
            used[ds.split].update(sample.scans)
            parity = 0 if ds.split == "train" else 1
            assert all(seed % 2 == parity for seed in sample.tone_seeds)
    assert used["train"] <= train_scans and used["heldout"] <= held_scans
    # The split does not depend on the sample seed.
    assert torch.equal(DigitsDataset("heldout", VIT, AUDIO, 1, seed=99).scans, heldout.scans)


# ------------------------------------------------------------------ rows, labels, inputs


def test_rows_labels_and_images_match_the_descriptors(train, sklearn_digits):
    images, targets = sklearn_digits
    indices = list(range(40))
    batch = train.batch(indices)
    counts = {"images": [], "tones": []}
    for row, i in enumerate(indices):
        sample = train[i]
        digits = [int(targets[s]) for s in sample.scans]
        assert list(sample.image_digits) == digits
        answer = (["images"] + [str(d) for d in digits] + [";", "tones"]
                  + [str(d) for d in sample.tone_digits] + ["<eos>"])
        media = ([IMAGE_TOKEN_ID] * (4 * len(digits))  # 8x8 in 4x4 patches: 4 tokens per image
                 + [AUDIO_TOKEN_ID] * (4 * len(sample.tone_digits)))  # 16 frames / 2 / 2
        prompt = [encode("<bos>")[0], *media, *encode("what ?")]
        expected = prompt + encode(" ".join(answer))
        expected += encode("<pad>") * (train.seq_len - len(expected))
        assert batch.tokens[row].tolist() == expected
        labels = [IGNORE_INDEX] * len(prompt) + [IGNORE_INDEX] * train.seq_len
        labels[len(prompt) - 1 : len(prompt) - 1 + len(answer)] = encode(" ".join(answer))
        assert batch.labels[row].tolist() == labels[: train.seq_len]
        mask = [float(t != IGNORE_INDEX) for t in labels[: train.seq_len]]
        assert batch.loss_mask[row].tolist() == mask
        counts["images"].append(len(digits))
        counts["tones"].append(len(sample.tone_digits))
    assert batch.modalities["vision"].items_per_sample == tuple(counts["images"])
    assert batch.modalities["audio"].items_per_sample == tuple(counts["tones"])
    # Ragged: every count occurs, and some samples are text-only.
    assert set(counts["images"]) == {0, 1, 2, 3} and set(counts["tones"]) == {0, 1, 2}
    assert any(a == b == 0 for a, b in zip(counts["images"], counts["tones"]))
    # Images: the raw scans, standardized with statistics computed here.
    mean, std = images.mean(), images.std()
    scans = [s for i in indices for s in train[i].scans]
    want = ((images[scans] - mean) / std).unsqueeze(1)
    torch.testing.assert_close(batch.modalities["vision"].inputs, want, atol=1e-3, rtol=1e-3)


def test_shift_augmentation_and_enlarged_colour_images(sklearn_digits):
    images, _ = sklearn_digits
    mean, std = images.mean(), images.std()
    vit = ViTConfig(image_size=16, patch_size=4, in_channels=3, dim=16, n_heads=2)
    task = DigitsTask(max_shift=1)
    train = DigitsDataset("train", vit, AUDIO, 200, task=task)
    samples = [train[i] for i in range(200)]
    shifts = {s for sample in samples for s in sample.image_shifts}
    assert shifts == {(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)}
    inputs = train.batch(range(200)).modalities["vision"].inputs
    assert inputs.shape[1:] == (3, 16, 16)
    items = [(scan, shift) for s in samples for scan, shift in zip(s.scans, s.image_shifts)]
    for k, (scan, (dy, dx)) in enumerate(items[:30]):
        padded = torch.nn.functional.pad(images[scan], (1, 1, 1, 1))  # blank paper around
        shifted = padded[1 - dy : 9 - dy, 1 - dx : 9 - dx]
        want = torch.kron((shifted - mean) / std, torch.ones(2, 2)).expand(3, 16, 16)
        torch.testing.assert_close(inputs[k], want, atol=1e-3, rtol=1e-3)
    heldout = DigitsDataset("heldout", vit, AUDIO, 200, task=task)
    assert {s for i in range(200) for s in heldout[i].image_shifts} == {(0, 0)}


def test_batch_feeds_the_real_encoders(train):
    batch = train.batch(range(12))  # MimoBatch's own checks ran on construction
    vit, audio = ViT(VIT), AudioEncoder(AUDIO)
    for name, encoder in (("vision", vit), ("audio", audio)):
        out = encoder(batch.modalities[name].inputs)
        assert out.shape[0] * out.shape[1] == batch.num_tokens(name)
        assert out.shape[1] == batch.modalities[name].tokens_per_item
    assert batch.modalities["audio"].inputs.shape[1:] == (AUDIO.n_mels, AUDIO.max_frames)


def test_seq_len_can_be_padded_and_not_shortened(sklearn_digits):
    longest = DigitsDataset("train", VIT, AUDIO, 10).seq_len
    assert longest == 1 + 3 * 4 + 2 * 4 + 2 + (5 + 3 + 2)
    padded = DigitsDataset("train", VIT, AUDIO, 10, seq_len=40)
    assert padded.batch(range(3)).tokens.shape == (3, 40)
    with pytest.raises(ValueError, match="seq_len=20 is shorter than the longest sample, 33"):
        DigitsDataset("train", VIT, AUDIO, 10, seq_len=20)
    with pytest.raises(ValueError, match="image_size=12 must be a multiple of 8"):
        DigitsDataset("train", ViTConfig(image_size=12, patch_size=4, dim=16, n_heads=2), AUDIO, 10)


# ------------------------------------------------------------------ per-range loading


@pytest.mark.parametrize("samples", [range(0, 3), range(3, 7), range(7, 9), range(5, 5)])
def test_loading_a_range_equals_slicing_the_full_batch(train, samples):
    indices = [11, 3, 40, 7, 0, 25, 9, 31, 2]
    full = train.batch(indices)
    want = full.select_samples(samples)
    for name in ("vision", "audio"):
        partial = train.batch(indices, load={name: samples})
        # Metadata is the full batch's; the loaded samples' items are the full batch's.
        assert torch.equal(partial.tokens, full.tokens) and torch.equal(partial.labels, full.labels)
        assert partial.modalities[name].items_per_sample == full.modalities[name].items_per_sample
        assert torch.equal(partial.select_samples(samples).modalities[name].inputs,
                           want.modalities[name].inputs)
        # Everything else is zeros, including the other modality.
        for other, m in partial.modalities.items():
            mask = torch.ones(m.num_items, dtype=torch.bool)
            if other == name:
                offsets = [0, *torch.tensor(m.items_per_sample).cumsum(0).tolist()]
                mask[offsets[samples.start] : offsets[samples.stop]] = False
            assert not m.inputs[mask].any()


def test_metadata_only_batch_holds_no_inputs(train):
    indices = list(range(16))
    meta, full = train.batch(indices, load={}), train.batch(indices)
    for name, m in meta.modalities.items():
        assert m.inputs.shape == full.modalities[name].inputs.shape
        assert m.inputs.stride() == (0,) * m.inputs.dim()  # a view of one zero: no memory
        assert m.items_per_sample == full.modalities[name].items_per_sample
    assert torch.equal(meta.tokens, full.tokens) and torch.equal(meta.loss_mask, full.loss_mask)


def test_samples_to_load_follows_shard_and_microbatches():
    layout = MimoLayout({"vision": Parallelism(dp=3), "audio": Parallelism(dp=1),
                         "language": Parallelism(dp=2, tp=2)})
    one = {0: {"vision": [0, 1, 2]}, 1: {"vision": [3, 4, 5]}, 2: {"vision": [6, 7]},
           3: {"audio": list(range(8))}, **{r: {} for r in range(4, 8)}}
    two = {0: {"vision": [0, 1, 4, 5]}, 1: {"vision": [2, 6]}, 2: {"vision": [3, 7]},
           3: {"audio": list(range(8))}, **{r: {} for r in range(4, 8)}}
    for rank in range(8):
        assert samples_to_load(layout, rank, 8) == one[rank]
        assert samples_to_load(layout, rank, 8, num_microbatches=2) == two[rank]
    pipelined = MimoLayout({"vision": Parallelism(pp=2, dp=2), "audio": Parallelism(dp=1),
                            "language": Parallelism(dp=1)})
    want = {0: {"vision": [0, 1, 2]}, 1: {"vision": [3, 4]}, 2: {}, 3: {},
            4: {"audio": [0, 1, 2, 3, 4]}, 5: {}}
    for rank, loads in want.items():
        assert samples_to_load(pipelined, rank, 5) == loads


# ------------------------------------------------------------------ tones


def _peak_hz(wave: torch.Tensor, sample_rate: int, lo: float, hi: float) -> float:
    spectrum = torch.fft.rfft(wave.double()).abs()
    freqs = torch.fft.rfftfreq(wave.numel(), 1 / sample_rate)
    band = (freqs >= lo) & (freqs <= hi)
    return float(freqs[band][spectrum[band].argmax()])


@pytest.mark.parametrize("digit", range(10))
def test_dtmf_tone_peaks_at_the_keypad_frequencies(digit):
    task = DigitsTask(noise_std=0.1)  # default jitter, onset, length, amplitude and twist
    num_samples = 960
    resolution = task.sample_rate / num_samples
    row, col = KEYPAD[digit]
    for seed in range(5):
        wave = dtmf_tone(digit, seed, task, num_samples)
        assert wave.shape == (num_samples,)
        for (lo, hi), freq in (((600, 1000), row), ((1150, 1550), col)):
            tolerance = 0.015 * freq + 2 * resolution  # the keypad's error, FFT leakage
            assert abs(_peak_hz(wave, task.sample_rate, lo, hi) - freq) <= tolerance
    # Different seeds: different clips.
    assert not torch.equal(dtmf_tone(digit, 0, task, num_samples),
                           dtmf_tone(digit, 1, task, num_samples))


@pytest.mark.parametrize("digit", range(10))
def test_log_mel_spectrogram_peaks_at_the_bands_of_the_keypad_frequencies(digit):
    task = DigitsTask(noise_std=0.0, frequency_jitter=0.0, min_duration=1.0, twist=(1.0, 1.0))
    n_mels = 16
    # HTK mel centres, equally spaced in mel between f_min and f_max.
    mel = lambda hz: 2595 * math.log10(1 + hz / 700)  # noqa: E731
    lo, hi = mel(task.f_min), mel(task.f_max)
    centres = [700 * (10 ** ((lo + (i + 1) * (hi - lo) / (n_mels + 1)) / 2595) - 1)
               for i in range(n_mels)]
    nearest = [min(range(n_mels), key=lambda i: abs(centres[i] - f)) for f in KEYPAD[digit]]
    spec = log_mel_spectrogram(dtmf_tone(digit, 7, task, 960), task, n_mels)
    assert spec.shape == (n_mels, 16)
    energy = spec.mean(dim=1)
    low, high = energy[: nearest[0] + 3], energy[nearest[0] + 3 :]  # the row / column halves
    assert int(low.argmax()) == nearest[0]
    assert int(high.argmax()) + nearest[0] + 3 == nearest[1]


# ------------------------------------------------------------------ sampler


def test_sampler_epochs_are_permutations_and_differ():
    sampler = ResumableBatchSampler(num_samples=10, batch_size=3, seed=1)
    epochs = [list(sampler), list(sampler)]
    for batches in epochs:
        assert len(batches) == 3 and all(len(b) == 3 for b in batches)
        flat = [i for b in batches for i in b]
        assert len(set(flat)) == 9 and set(flat) <= set(range(10))
    assert epochs[0] != epochs[1]
    assert list(ResumableBatchSampler(10, 3, seed=1)) == epochs[0]
    assert [i for b in ResumableBatchSampler(10, 3, shuffle=False) for i in b] == list(range(9))


def test_sampler_orders_follow_the_seed():
    """data.seed draws the order (documented: shuffled per epoch from (seed, epoch)): two seeds
    give other orders in every epoch, not one order whatever the seed."""
    for epoch in range(3):
        orders = set()
        for seed in range(4):
            sampler = ResumableBatchSampler(num_samples=64, batch_size=8, seed=seed)
            sampler.epoch = epoch
            orders.add(tuple(i for b in sampler for i in b))
        assert len(orders) == 4, epoch


@pytest.mark.parametrize("taken", [0, 2, 3, 5])  # 3 batches per epoch: mid-epoch and at its end
def test_sampler_state_round_trips(taken):
    reference = ResumableBatchSampler(10, 3, seed=5)
    stream = [b for _ in range(3) for b in reference]  # three epochs, in order

    sampler = ResumableBatchSampler(10, 3, seed=5)
    it, got = iter(sampler), []
    while len(got) < taken:
        try:
            got.append(next(it))
        except StopIteration:
            it = iter(sampler)
    state = sampler.state_dict()

    resumed = ResumableBatchSampler(10, 3, seed=5)
    resumed.load_state_dict(state)
    rest = [b for _ in range(3) for b in resumed]
    assert got + rest[: len(stream) - taken] == stream
    with pytest.raises(ValueError, match="the state has seed=5 but this sampler has seed=6"):
        ResumableBatchSampler(10, 3, seed=6).load_state_dict(state)


# ------------------------------------------------------------------ scoring


def test_exact_match_on_hand_made_logits():
    labels = torch.tensor([
        [IGNORE_INDEX, 2, 3, IGNORE_INDEX],
        [IGNORE_INDEX, 1, 4, IGNORE_INDEX],
        [IGNORE_INDEX] * 4,
    ])
    predicted = torch.tensor([[0, 2, 3, 1], [4, 1, 0, 0], [1, 1, 1, 1]])
    logits = torch.nn.functional.one_hot(predicted, 5).float() * 3 - 1
    assert exact_match(logits, labels).tolist() == [True, False, True]
    assert exact_match_accuracy(logits, labels) == 0.5  # row 2 has no answer: not counted
    first = torch.tensor([[False, True, False, False]] * 3)
    assert exact_match(logits, labels, first).tolist() == [True, True, True]
    assert exact_match_accuracy(logits, labels, first) == 1.0
    assert math.isnan(exact_match_accuracy(logits, torch.full_like(labels, IGNORE_INDEX)))


def test_the_trainers_scores_count_each_part_on_its_own_rows_and_positions():
    """`train.datasets.exact_match`, what the trainer's held-out "answer" and per-part scores
    are: (rows right, rows counted). A part counts only the rows holding a scored position of
    it, and is right where its own positions are, whatever the rest of the answer got."""
    from dtensor_mimo.train.datasets import exact_match as scores

    ignore = IGNORE_INDEX
    labels = torch.tensor([[ignore, 5, 6, 7], [ignore, 5, 6, ignore], [ignore] * 4])
    pred = torch.tensor([[0, 5, 6, 0], [0, 5, 6, 0], [0, 0, 0, 0]])  # row 0 misses its last target
    a = torch.tensor([[False, True, True, False]] * 3)
    b = torch.tensor([[False, False, False, True]] * 3)  # a position only row 0 scores
    batch = MimoBatch(torch.ones(3, 4, dtype=torch.int64), labels, (labels != ignore).float())
    assert scores(batch, pred, {"a": a, "b": b}) == {"answer": (1, 2), "a": (2, 2), "b": (0, 1)}


def test_answer_digit_positions_split_images_from_tones():
    ignore = IGNORE_INDEX
    labels = torch.tensor([[ignore, *encode("images 3 7 ; tones 5 <eos>"), ignore],
                           [ignore, *encode("images ; tones 0 9 <eos>"), ignore, ignore]])
    parts = answer_digit_positions(labels)
    assert parts["vision"].nonzero().tolist() == [[0, 2], [0, 3]]
    assert parts["audio"].nonzero().tolist() == [[0, 6], [1, 4], [1, 5]]


def test_tokenizer_round_trip_and_unknown_words():
    text = "<bos> <image> <audio> what ? images 0 9 ; tones 5 <eos> <pad>"
    assert decode(encode(text)) == text
    assert len(set(encode(text))) == len(text.split())  # one id per distinct word
    assert max(encode("what ? images 0 9 ; tones <eos> <pad> <bos>")) < IMAGE_TOKEN_ID
    with pytest.raises(ValueError, match="'seven' is not a word of the digits vocabulary"):
        encode("images seven")


@pytest.mark.parametrize("field, value, message", [
    ("noise_std", math.inf, r"noise_std=inf must be a finite number >= 0"),
    ("noise_std", math.nan, r"noise_std=nan must be a finite number >= 0"),
    ("noise_std", -0.5, r"noise_std=-0.5 must be a finite number >= 0"),
    ("amplitude", (1.0, 0.2), r"amplitude=\(1.0, 0.2\) must be a range \(low, high\)"),
    ("twist", (0.6, math.inf), r"twist=\(0.6, inf\) must be a range \(low, high\)"),
    ("frequency_jitter", -0.1, r"frequency_jitter=-0.1 must be in \[0, 1\)"),
])
def test_tone_settings_out_of_range_are_named(field, value, message):
    """A tone setting that cannot make a keypad tone is refused by name: noise_std = inf (or nan) made
    every clip NaN (the audio encoder's inputs, then the loss), a negative std passed as its opposite."""
    wave = dtmf_tone(3, 0, DigitsTask(noise_std=1e6), 960)  # finite at any finite noise
    assert torch.isfinite(log_mel_spectrogram(wave, DigitsTask(), 16)).all()
    with pytest.raises(ValueError, match=message):
        DigitsTask(**{field: value})


def test_without_scikit_learn_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    cached = digits_module._scans
    monkeypatch.setattr(digits_module, "_scans", cached.__wrapped__)
    with pytest.raises(ImportError, match=r"pip install 'dtensor_mimo\[data\]'"):
        DigitsDataset("train", VIT, AUDIO, 10)


# ------------------------------------------------------------------ items at their own size (issue 20)

# The ViT at dynamic resolution takes 8x8, 8x12, 12x8 and 12x12 images (4x4 patches: 4, 6, 6, 9 rows);
# the audio encoder at variable length takes clips of 8..16 frames (strides 2, 2: 2, 3, 3, 3, 3, 4, 4, 4, 4 rows).
DYNAMIC_VIT = dataclasses.replace(VIT, dynamic_resolution=True, max_patches=9)
VARIABLE_AUDIO = dataclasses.replace(AUDIO, variable_length=True)
PATCH_ROWS = {(8, 8): 4, (8, 12): 6, (12, 8): 6, (12, 12): 9}
CLIP_ROWS = {8: 2, 9: 3, 10: 3, 11: 3, 12: 3, 13: 4, 14: 4, 15: 4, 16: 4}


def test_varied_sizes_give_each_item_its_own_rows(train, sklearn_digits):
    varied = DigitsDataset("train", DYNAMIC_VIT, VARIABLE_AUDIO, num_samples=500, seed=3)
    indices = list(range(40))
    samples = [varied[i] for i in indices]
    assert {size for s in samples for size in s.image_sizes} == set(PATCH_ROWS)
    assert {f for s in samples for f in s.tone_frames} <= set(CLIP_ROWS) and len({f for s in samples for f in s.tone_frames}) > 4
    for s, fixed in zip(samples, (train[i] for i in indices)):  # the same scans, digits and tones
        assert (s.scans, s.image_digits, s.tone_digits, s.tone_seeds) == (fixed.scans, fixed.image_digits,
                                                                        fixed.tone_digits, fixed.tone_seeds)
    assert varied.seq_len == 1 + 3 * 9 + 2 * 4 + 2 + 10  # the largest items: <bos> media "what ?" answer
    batch = varied.batch(indices)
    images, tones = batch.modalities["vision"], batch.modalities["audio"]
    rows = [PATCH_ROWS[size] for s in samples for size in s.image_sizes]
    clips = [CLIP_ROWS[f] for s in samples for f in s.tone_frames]
    assert images.item_tokens == tuple(rows) and tones.item_tokens == tuple(clips)
    for b, s in enumerate(samples):  # placeholders: each item's own rows
        row = batch.tokens[b].tolist()
        assert row.count(IMAGE_TOKEN_ID) == sum(PATCH_ROWS[size] for size in s.image_sizes)
        assert row.count(AUDIO_TOKEN_ID) == sum(CLIP_ROWS[f] for f in s.tone_frames)
    assert [tuple(x.shape) for x in images.inputs] == [(1, *size) for s in samples for size in s.image_sizes]
    assert [tuple(x.shape) for x in tones.inputs] == [(16, f) for s in samples for f in s.tone_frames]
    # Each image is the scan at 8x8, standardized, on blank paper at its patch-aligned offset.
    scans = sklearn_digits[0]
    blank = -digits_module.PIXEL_MEAN / digits_module.PIXEL_STD
    k = 0
    for s in samples:
        for scan, (top, left), (h, w) in zip(s.scans, s.image_offsets, s.image_sizes):
            x = images.inputs[k][0]
            assert top % 4 == 0 and left % 4 == 0 and top + 8 <= h and left + 8 <= w
            expected = torch.full((h, w), blank)
            expected[top:top + 8, left:left + 8] = (scans[scan] - 4.884) / 6.017
            torch.testing.assert_close(x, expected, rtol=0, atol=1e-5)
            k += 1
    # The encoders give exactly those rows (the batch itself checked the placeholders on construction).
    assert ViT(DYNAMIC_VIT)(images.inputs).shape[0] == sum(rows)
    assert AudioEncoder(VARIABLE_AUDIO)(tones.inputs).shape[0] == sum(clips)
    # Per-rank loading: the named samples' items as loaded in full, the others zeros of their own size.
    part = varied.batch(indices, load={"vision": [0, 1, 2], "audio": []})
    first = sum(len(s.scans) for s in samples[:3])
    for k, (x, y) in enumerate(zip(part.modalities["vision"].inputs, images.inputs)):
        assert torch.equal(x, y) if k < first else (x.shape == y.shape and x.stride() == (0, 0, 0))
    assert all(x.stride() == (0, 0) for x in part.modalities["audio"].inputs)
    stretched = DigitsDataset("train", DYNAMIC_VIT, AUDIO, num_samples=500, seed=3,
                              task=DigitsTask(image_fit="stretch"))
    assert [tuple(x.shape[1:]) for x in stretched.batch(indices).modalities["vision"].inputs] == \
        [size for s in samples for size in s.image_sizes]
    assert isinstance(stretched.batch(indices).modalities["audio"].inputs, torch.Tensor)  # clips of one length
    with pytest.raises(ValueError, match="not whole 4x4 patches"):
        DigitsDataset("train", DYNAMIC_VIT, AUDIO, 10, task=DigitsTask(image_scales=((1.0, 1.25),)))


@pytest.mark.parametrize("n_fft", [256, 512, 1024])
def test_variable_clips_are_long_enough_for_the_stft(sklearn_digits, n_fft):
    """Variable-length tone clips of a task whose window is wide for its hop (n_fft = 1024, hop 64): every
    clip drawn has more samples than half a window (the centred STFT's reflection), so the ranks that
    synthesize tones build the batch like the ranks that only read its metadata. The shortest clip was
    8 frames (448 samples): a bare RuntimeError from torch.stft on the loading ranks alone."""
    task = DigitsTask(n_fft=n_fft, hop_length=64)
    data = DigitsDataset("train", VIT, VARIABLE_AUDIO, num_samples=64, seed=3, task=task)
    shortest = min(data.clip_frames)
    assert task.hop_length * (shortest - 1) > n_fft // 2  # the centred STFT's reflection needs more than this
    assert shortest == max(4, math.ceil(task.min_clip_fraction * VARIABLE_AUDIO.max_frames), n_fft // 128 + 2)
    batch = data.batch(range(64))
    tones = batch.modalities["audio"]
    assert [x.shape[1] for x in tones.inputs] == [f for i in range(64) for f in data[i].tone_frames]
    assert min(x.shape[1] for x in tones.inputs) >= shortest
    assert AudioEncoder(VARIABLE_AUDIO)(tones.inputs).shape[0] == sum(tones.item_tokens)
