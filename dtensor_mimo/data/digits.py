"""Real data that needs every modality: handwritten digit scans and telephone keypad tones.

Each sample shows 0..`DigitsTask.max_images` scans of handwritten digits (scikit-learn's
`load_digits`: 1,797 real 8x8 scans, shipped with the package, nothing downloaded) and
0..`DigitsTask.max_tones` telephone keypad (DTMF) tones, synthesized at load time from a seed
with noise, timing jitter and amplitude variation, and its text asks what they show::

    <bos> <image>x4 <image>x4 <audio>x4 what ? images 3 7 ; tones 5 <eos> <pad> ...
                                             |______ answer ______________|

Only the answer is trained and scored (labels on the answer tokens, `IGNORE_INDEX` elsewhere),
so a model gets a sample right only if the vision encoder reads every scan and the audio
encoder hears every tone. `exact_match` scores a sample right when every answer token is: with
teacher forcing, the argmax at every answer position equals greedy decoding.

At their own sizes: with a ViT of ``dynamic_resolution`` each image is drawn at one of a few
sizes (`DigitsTask.image_scales`: by default the ViT's image size times 1 or 1.5 per side, e.g.
8x8, 8x12, 12x8, 12x12), giving its own patch count: the scan at the ViT's image size on blank
paper of that size, at a random patch-aligned place (`DigitsTask.image_fit` "pad"), or the scan
stretched bilinearly to it ("stretch": every patch then sees the digit at another scale, which the
small digits ViT learns several times slower, see README); with an audio
encoder of ``variable_length`` each tone clip has its own length (`DigitsTask.min_clip_fraction`
up to ``max_frames`` frames). The batch then carries one tensor and one row count per item. The
scans, digits and tones drawn are the same as at one size.

Held out: the scans are split once (`DigitsTask.split_seed`) 80/20, and the two splits draw
their samples from their own scans and their own tone seeds (even for training, odd for held
out), so no held-out scan or tone is ever trained on.

Per-rank loading: a sample is a small descriptor (`DigitsSample`: scan indices, digits, tone
seeds). `DigitsDataset.batch` builds the global `MimoBatch` metadata (token rows, labels, items
per sample) from descriptors, cheap on every rank, and decodes images or synthesizes tones only
for the samples that `load` names per modality: the other items are zeros, so a rank that does
not encode a modality never pays for it. `samples_to_load` says which samples a rank's encoders
read under a `MimoLayout`. `ResumableBatchSampler` draws the global batches, resumable from a
checkpoint.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Sampler

from dtensor_mimo.data.batch import IGNORE_INDEX, MimoBatch, ModalityInputs, sample_range

if TYPE_CHECKING:  # annotations only: the data layer reads these configs' fields, never imports models
    from dtensor_mimo.layout import MimoLayout
    from dtensor_mimo.models.audio import AudioConfig
    from dtensor_mimo.models.vit import ViTConfig

__all__ = [
    "AUDIO_TOKEN_ID",
    "DIGITS_MODALITIES",
    "DTMF_FREQUENCIES",
    "DigitsDataset",
    "DigitsSample",
    "DigitsTask",
    "IMAGE_TOKEN_ID",
    "TEXT_VOCAB",
    "ResumableBatchSampler",
    "answer_digit_positions",
    "decode",
    "dtmf_tone",
    "encode",
    "exact_match",
    "exact_match_accuracy",
    "log_mel_spectrogram",
    "mel_filterbank",
    "samples_to_load",
]

# ---------------------------------------------------------------------------- tokenizer

TEXT_VOCAB: tuple[str, ...] = (
    "<pad>", "<bos>", "<eos>", "what", "?", "images", "tones", ";",
    "0", "1", "2", "3", "4", "5", "6", "7", "8", "9",
)
"""The text vocabulary, one word per id (18 ids): a language model needs ``vocab_size >= 18``."""

IMAGE_TOKEN_ID = len(TEXT_VOCAB)
"""Special id of an image position ("vision"), just past the text vocabulary."""
AUDIO_TOKEN_ID = len(TEXT_VOCAB) + 1
"""Special id of a tone position ("audio")."""

DIGITS_MODALITIES: tuple[str, ...] = ("vision", "audio")
"""The modality names of a digits batch, as `MimoModel` encoders are keyed."""

_WORDS = {w: i for i, w in enumerate(TEXT_VOCAB)}
_WORDS |= {"<image>": IMAGE_TOKEN_ID, "<audio>": AUDIO_TOKEN_ID}
_DIGIT0 = _WORDS["0"]


def encode(text: str) -> list[int]:
    """Token ids of whitespace-separated words of `TEXT_VOCAB` (and ``<image>``, ``<audio>``)."""
    try:
        return [_WORDS[w] for w in text.split()]
    except KeyError as e:
        raise ValueError(f"encode: {e.args[0]!r} is not a word of the digits vocabulary "
                         f"{list(_WORDS)}") from None


def decode(ids: Iterable[int]) -> str:
    """The words of token ids, space-separated; the inverse of `encode`."""
    words = {i: w for w, i in _WORDS.items()}
    return " ".join(words[int(i)] for i in ids)


# ---------------------------------------------------------------------------- the task


DTMF_FREQUENCIES: dict[int, tuple[int, int]] = {
    1: (697, 1209), 2: (697, 1336), 3: (697, 1477),
    4: (770, 1209), 5: (770, 1336), 6: (770, 1477),
    7: (852, 1209), 8: (852, 1336), 9: (852, 1477),
    0: (941, 1336),
}
"""Telephone keypad tones: digit -> (row, column) frequency in Hz (ITU-T Q.23)."""

# Pixel statistics of all 1,797 scans (values 0..16): inputs are standardized with them.
PIXEL_MEAN = 4.884
PIXEL_STD = 6.017


@dataclass(frozen=True)
class DigitsTask:
    """How samples are drawn and how hard the task is.

    Attributes:
        max_images, max_tones: per sample, uniform in ``0..max_images`` scans and
            ``0..max_tones`` tones (some samples are text-only).
        heldout_fraction, split_seed: the share of scans held out, and the seed of that split
            (fixed across runs, independent of the sample seed).
        sample_rate, n_fft, hop_length: tone clips: a clip of ``F`` frames
            (`AudioConfig.max_frames`) has ``hop_length * (F - 1)`` samples, and the centred
            STFT gives ``F`` frames.
        f_min, f_max: the mel filterbank's range in Hz (DTMF tones lie in 697..1477 Hz).
        amplitude: range of a tone's amplitude; noise_std: white noise std (same unit).
        twist: range of the column tone's amplitude relative to the row tone's.
        frequency_jitter: relative frequency error of each tone (keypads may be off by 1.5%).
        min_duration: shortest tone, as a fraction of the clip; onset is random, within the clip.
        max_shift: training scans are shifted by up to this many pixels along each axis
            (augmentation; held-out scans are never shifted). Off by default: on 8x8 scans
            even 1 pixel slows learning several-fold (see examples/train_digits.py).
        image_scales: with a dynamic-resolution ViT, the ``(height, width)`` scales of the ViT's
            image size an image is drawn at (uniformly); each size a multiple of the patch.
        image_fit: how a scan fills an image of another size: "pad" (at the ViT's image size, on
            blank paper, at a random patch-aligned place; scales >= 1) or "stretch" (bilinearly).
        min_clip_fraction: with a variable-length audio encoder, a clip's frames are drawn
            uniformly from this fraction of ``max_frames`` (at least 4 frames, and more than half a
            window of samples, `clip_frames`) up to all of them.
    """

    max_images: int = 3
    max_tones: int = 2
    heldout_fraction: float = 0.2
    split_seed: int = 0
    sample_rate: int = 8000
    n_fft: int = 256
    hop_length: int = 64
    f_min: float = 400.0
    f_max: float = 1800.0
    amplitude: tuple[float, float] = (0.2, 1.0)
    noise_std: float = 0.5
    twist: tuple[float, float] = (0.6, 1.0)
    frequency_jitter: float = 0.015
    min_duration: float = 0.4
    max_shift: int = 0
    image_scales: tuple[tuple[float, float], ...] = ((1.0, 1.0), (1.0, 1.5), (1.5, 1.0), (1.5, 1.5))
    image_fit: str = "pad"
    min_clip_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.max_images < 0 or self.max_tones < 0:
            raise ValueError(f"DigitsTask: max_images={self.max_images} and max_tones="
                             f"{self.max_tones} must be >= 0")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"DigitsTask: heldout_fraction={self.heldout_fraction} must be in "
                             f"(0, 1)")
        if not 0 <= self.f_min < self.f_max <= self.sample_rate / 2:
            raise ValueError(f"DigitsTask: need 0 <= f_min={self.f_min} < f_max={self.f_max} <= "
                             f"sample_rate/2={self.sample_rate / 2}")
        if not 0 <= self.noise_std < math.inf:
            raise ValueError(f"DigitsTask: noise_std={self.noise_std} must be a finite number >= 0 (the tones' "
                             f"white noise std; 0: none)")
        for name in ("amplitude", "twist"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi < math.inf:
                raise ValueError(f"DigitsTask: {name}={getattr(self, name)} must be a range (low, high) of finite "
                                 f"numbers with 0 <= low <= high")
        if not 0 <= self.frequency_jitter < 1:
            raise ValueError(f"DigitsTask: frequency_jitter={self.frequency_jitter} must be in [0, 1) (a relative "
                             f"frequency error)")
        if not 0 <= self.max_shift < 8:
            raise ValueError(f"DigitsTask: max_shift={self.max_shift} must be in 0..7 (scans "
                             f"are 8x8)")
        if not 0 < self.min_duration <= 1:
            raise ValueError(f"DigitsTask: min_duration={self.min_duration} must be in (0, 1]")
        if not self.image_scales or any(len(s) != 2 or min(s) <= 0 for s in self.image_scales):
            raise ValueError(f"DigitsTask: image_scales={self.image_scales} must be (height, width) pairs > 0")
        if self.image_fit not in ("pad", "stretch"):
            raise ValueError(f"DigitsTask: image_fit={self.image_fit!r} must be 'pad' or 'stretch'")
        if self.image_fit == "pad" and min(min(s) for s in self.image_scales) < 1:
            raise ValueError(f"DigitsTask: image_scales={self.image_scales} below 1 cannot hold the scan with "
                             "image_fit='pad'; use scales >= 1 or image_fit='stretch'")
        if not 0 < self.min_clip_fraction <= 1:
            raise ValueError(f"DigitsTask: min_clip_fraction={self.min_clip_fraction} must be in (0, 1]")

    def image_sizes(self, image_size: int, patch_size: int) -> list[tuple[int, int]]:
        """The ``(H, W)`` scans are drawn at under dynamic resolution: `image_scales` times
        `image_size`, each side a multiple of `patch_size` (ValueError names one that is not)."""
        sizes = [(round(image_size * a), round(image_size * b)) for a, b in self.image_scales]
        bad = [f"{h}x{w}" for h, w in sizes if h % patch_size or w % patch_size or min(h, w) < patch_size]
        if bad:
            raise ValueError(f"DigitsTask: image_scales={self.image_scales} of image size {image_size} give "
                             f"{', '.join(bad)} px, not whole {patch_size}x{patch_size} patches")
        return sizes

    def clip_frames(self, max_frames: int) -> range:
        """The frames a variable-length clip is drawn with: 4 or more, and enough that a clip of
        ``hop_length * (F - 1)`` samples is longer than half a window (the centred STFT's reflection)."""
        stft = self.n_fft // 2 // self.hop_length + 2
        return range(min(max_frames, max(4, stft, math.ceil(self.min_clip_fraction * max_frames))), max_frames + 1)


@dataclass(frozen=True)
class DigitsSample:
    """One sample's descriptor: what it shows, not the pixels or the waveform.

    Attributes:
        scans: indices into ``sklearn.datasets.load_digits()`` of the images shown, in order.
        image_digits: the digit of each scan.
        image_shifts: ``(rows, columns)`` each scan is shifted by (augmentation; zeros held out).
        tone_digits: the digit of each tone, in order.
        tone_seeds: the seed each tone is synthesized from (`dtmf_tone`).
        image_sizes: each scan's ``(H, W)`` as the ViT takes it.
        tone_frames: each tone clip's frames.
        image_offsets: each scan's top-left ``(row, column)`` on its image (`DigitsTask.image_fit`
            "pad"; zeros otherwise).
    """

    scans: tuple[int, ...]
    image_digits: tuple[int, ...]
    image_shifts: tuple[tuple[int, int], ...]
    tone_digits: tuple[int, ...]
    tone_seeds: tuple[int, ...]
    image_sizes: tuple[tuple[int, int], ...] = ()
    tone_frames: tuple[int, ...] = ()
    image_offsets: tuple[tuple[int, int], ...] = ()

    def answer(self) -> str:
        """The answer text, e.g. ``"images 3 7 ; tones 5 <eos>"``."""
        return " ".join(["images", *map(str, self.image_digits), ";",
                         "tones", *map(str, self.tone_digits), "<eos>"])


# ---------------------------------------------------------------------------- scans


DIGITS_FILE = ("datasets", "data", "digits.csv.gz")
"""Where scikit-learn keeps the scans, under its package directory (what ``load_digits`` reads)."""


@functools.lru_cache(maxsize=1)
def _scans() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 scans ``[N, 8, 8]`` float32 (values 0..16) and their digits ``[N]`` int64.

    Read from scikit-learn's file as ``sklearn.datasets.load_digits`` reads it (64 pixel values
    and the digit per line), without importing scikit-learn: that import is a second of start-up
    in every process that loads the digits (each rank, each loader worker); ``load_digits``
    itself if the file is not where it has always been."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise ImportError("the digits dataset needs scikit-learn (its scans ship with it): "
                          "pip install 'dtensor_mimo[data]'")
    places = spec.submodule_search_locations or []
    path = os.path.join(places[0], *DIGITS_FILE) if places else ""
    if os.path.exists(path):
        with gzip.open(path, "rt") as f:
            rows = torch.tensor([[float(v) for v in line.split(",")] for line in f if line.strip()],
                                dtype=torch.float32)
        return rows[:, :-1].reshape(-1, 8, 8).contiguous(), rows[:, -1].to(torch.int64)
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (torch.tensor(digits.images, dtype=torch.float32),
            torch.tensor(digits.target, dtype=torch.int64))


def _split_scans(task: DigitsTask) -> dict[str, torch.Tensor]:
    """``{"train": scan indices, "heldout": scan indices}``: a fixed seeded split."""
    n = _scans()[1].numel()
    order = torch.randperm(n, generator=torch.Generator().manual_seed(task.split_seed))
    held = round(n * task.heldout_fraction)
    return {"train": order[held:].sort().values, "heldout": order[:held].sort().values}


def _image(scan: int, shift: tuple[int, int], config: ViTConfig, size: tuple[int, int] | None = None,
           offset: tuple[int, int] | None = None) -> torch.Tensor:
    """Scan `scan` as a ViT input ``[C, H, W]``: shifted by `shift` pixels (blank paper moves
    in), standardized, enlarged by pixel repetition to the ViT's image size; with `size`
    ``(H, W)`` (dynamic resolution) then put on blank paper of that size at `offset`, or
    (no offset) enlarged bilinearly to it."""
    pixels = torch.zeros(8, 8)
    (dy, dx), raw = shift, _scans()[0][scan]
    pixels[max(dy, 0) : 8 + min(dy, 0), max(dx, 0) : 8 + min(dx, 0)] = (
        raw[max(-dy, 0) : 8 + min(-dy, 0), max(-dx, 0) : 8 + min(-dx, 0)])
    pixels = (pixels - PIXEL_MEAN) / PIXEL_STD
    if size is not None and offset is None:
        pixels = F.interpolate(pixels[None, None], size=size, mode="bilinear", align_corners=False)[0, 0]
        return pixels.expand(config.in_channels, -1, -1)
    factor = config.image_size // 8
    pixels = pixels.repeat_interleave(factor, 0).repeat_interleave(factor, 1)
    if size is not None:
        paper = torch.full(size, -PIXEL_MEAN / PIXEL_STD)  # a blank pixel, standardized
        (top, left), n = offset, config.image_size
        paper[top : top + n, left : left + n] = pixels
        pixels = paper
    return pixels.expand(config.in_channels, -1, -1)


# ---------------------------------------------------------------------------- tones


def _hz_to_mel(hz: torch.Tensor) -> torch.Tensor:
    return 2595.0 * torch.log10(1.0 + hz / 700.0)  # HTK mel scale


def _mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)


def mel_filterbank(n_mels: int, n_fft: int, sample_rate: int, f_min: float,
                   f_max: float) -> torch.Tensor:
    """Triangular filters ``[n_mels, n_fft // 2 + 1]`` on the HTK mel scale (peak 1, no
    normalization), centres equally spaced in mel between `f_min` and `f_max`."""
    freqs = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    edges = _mel_to_hz(torch.linspace(_hz_to_mel(torch.tensor(f_min, dtype=torch.float64)),
                                      _hz_to_mel(torch.tensor(f_max, dtype=torch.float64)),
                                      n_mels + 2, dtype=torch.float64))
    lower, centre, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (freqs - lower) / (centre - lower)
    falling = (upper - freqs) / (upper - centre)
    return torch.minimum(rising, falling).clamp(min=0).float()


def dtmf_tone(digit: int, seed: int, task: DigitsTask, num_samples: int) -> torch.Tensor:
    """A noisy keypad tone of `digit`: ``[num_samples]`` float32 at ``task.sample_rate``.

    From `seed` alone: random onset and length (at least ``task.min_duration`` of the clip),
    amplitude, twist (row/column balance), frequency error and phases; silence around the
    tone; white noise everywhere.
    """
    g = torch.Generator().manual_seed(seed)

    def uniform(lo: float, hi: float) -> float:
        return lo + (hi - lo) * float(torch.rand((), generator=g))

    length = max(1, math.ceil(task.min_duration * num_samples))
    length += int(torch.randint(num_samples - length + 1, (), generator=g))
    onset = int(torch.randint(num_samples - length + 1, (), generator=g))
    amplitude = uniform(*task.amplitude)
    gains = (1.0, uniform(*task.twist))
    t = torch.arange(length, dtype=torch.float64) / task.sample_rate
    tone = torch.zeros(length, dtype=torch.float64)
    for freq, gain in zip(DTMF_FREQUENCIES[digit], gains):
        freq *= 1 + uniform(-task.frequency_jitter, task.frequency_jitter)
        tone += gain * torch.sin(2 * math.pi * freq * t + uniform(0, 2 * math.pi))
    wave = torch.zeros(num_samples, dtype=torch.float64)
    wave[onset : onset + length] = amplitude * tone
    wave += task.noise_std * torch.randn(num_samples, generator=g, dtype=torch.float64)
    return wave.float()


@functools.lru_cache(maxsize=8)
def _spectrogram_constants(n_fft: int, n_mels: int, sample_rate: int, f_min: float,
                           f_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The Hann window and mel filters of `log_mel_spectrogram`, built once per setting instead
    of once per clip (a sixth of the digits batch's time; read only, never written to)."""
    return torch.hann_window(n_fft), mel_filterbank(n_mels, n_fft, sample_rate, f_min, f_max)


def log_mel_spectrogram(wave: torch.Tensor, task: DigitsTask, n_mels: int) -> torch.Tensor:
    """Log-mel spectrogram ``[n_mels, 1 + len(wave) // hop_length]`` of a clip, standardized
    per clip (zero mean, unit variance)."""
    window, filters = _spectrogram_constants(task.n_fft, n_mels, task.sample_rate, task.f_min, task.f_max)
    spec = torch.stft(wave, task.n_fft, task.hop_length, window=window,
                      center=True, return_complex=True).abs().square()  # [n_fft/2 + 1, frames]
    mel = filters @ spec
    logmel = torch.log(mel + 1e-6)
    return (logmel - logmel.mean()) / (logmel.std() + 1e-6)


# ---------------------------------------------------------------------------- the dataset


def _mix(*values: int) -> int:
    """A 63-bit hash of integers (splitmix64 steps): seeds that do not collide by accident."""
    h = 0
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) + 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h >> 1


_SPLITS = ("train", "heldout")


class DigitsDataset(Dataset):
    """`num_samples` samples of one split, each drawn from (`seed`, split, index) alone.

    ``dataset[i]`` is a `DigitsSample` (a descriptor, no pixels); `batch` turns a list of
    indices into a `MimoBatch` with modalities "vision" (images for a `ViT` with `vision`) and
    "audio" (log-mel clips of ``audio.max_frames`` frames for an `AudioEncoder` with `audio`).
    With ``vision.dynamic_resolution`` scans come at their own sizes, with
    ``audio.variable_length`` clips at their own lengths (`DigitsTask.image_scales`,
    `DigitsTask.min_clip_fraction`): that modality's inputs are then a list, one tensor per item,
    and its ``tokens_per_item`` one count per item.

    Args:
        split: "train" or "heldout": which scans and which tone seeds samples use.
        vision: the ViT the images are for: ``image_size`` a multiple of 8 (scans are 8x8,
            enlarged by pixel repetition), ``in_channels`` copies of the grey scan.
        audio: the audio encoder the clips are for: ``n_mels`` bins, ``max_frames`` frames.
        num_samples: the dataset's length.
        seed: the samples drawn (the scan split is ``task.split_seed``'s, not this one's).
        task: counts, noise and the tone analysis (`DigitsTask`).
        seq_len: token row length; default the longest sample's (`min_seq_len`). Give more to
            meet a constraint such as context parallel's ``seq_len % (2 * cp) == 0``.

    Raises:
        ImportError: when scikit-learn is missing (``pip install 'dtensor_mimo[data]'``).
    """

    def __init__(self, split: str, vision: ViTConfig, audio: AudioConfig, num_samples: int,
                 seed: int = 0, task: DigitsTask | None = None, seq_len: int | None = None) -> None:
        if split not in _SPLITS:
            raise ValueError(f"DigitsDataset: split={split!r} must be one of {_SPLITS}")
        if vision.image_size % 8:
            raise ValueError(f"DigitsDataset: ViTConfig.image_size={vision.image_size} must be a "
                             f"multiple of 8 (the scans are 8x8)")
        self.split, self.vision, self.audio = split, vision, audio
        self.num_samples, self.seed = num_samples, seed
        self.task = DigitsTask() if task is None else task
        if self.clip_samples <= self.task.n_fft // 2:
            raise ValueError(
                f"DigitsDataset: AudioConfig.max_frames={audio.max_frames} frames of hop "
                f"{self.task.hop_length} make clips of {self.clip_samples} samples, too short for "
                f"n_fft={self.task.n_fft}; raise max_frames or lower DigitsTask.n_fft")
        self.image_sizes = (self.task.image_sizes(vision.image_size, vision.patch_size)
                            if self.varied("vision") else [(vision.image_size, vision.image_size)])
        self.clip_frames = (self.task.clip_frames(audio.max_frames) if self.varied("audio")
                            else range(audio.max_frames, audio.max_frames + 1))
        self.seq_len = self.min_seq_len if seq_len is None else seq_len
        if self.seq_len < self.min_seq_len:
            raise ValueError(f"DigitsDataset: seq_len={seq_len} is shorter than the longest "
                             f"sample, {self.min_seq_len} tokens")
        self.scans = _split_scans(self.task)[split]  # the scan indices this split draws from
        self._split_id = _SPLITS.index(split)

    # -------------------------------------------------------------- sizes
    def varied(self, modality: str) -> bool:
        """Whether `modality`'s items have their own sizes (one tensor and row count per item)."""
        if modality == "vision":
            return bool(getattr(self.vision, "dynamic_resolution", False))
        return bool(getattr(self.audio, "variable_length", False))

    def _image_tokens(self, size: tuple[int, int]) -> int:
        p = self.vision.patch_size
        return (size[0] // p) * (size[1] // p)

    @property
    def tokens_per_image(self) -> int:
        """Rows of an image: the largest size's under dynamic resolution."""
        return max(self._image_tokens(size) for size in self.image_sizes)

    @property
    def tokens_per_clip(self) -> int:
        """Rows of a tone clip: the longest clip's under variable length."""
        return self.audio.output_length(self.audio.max_frames)

    def mean_tokens(self, modality: str) -> float:
        """Expected rows per item of `modality` (sizes are drawn uniformly)."""
        if modality == "vision":
            counts = [self._image_tokens(size) for size in self.image_sizes]
        else:
            counts = [self.audio.output_length(f) for f in self.clip_frames]
        return sum(counts) / len(counts)

    @property
    def clip_samples(self) -> int:
        """Waveform samples of a tone clip: the centred STFT gives ``max_frames`` frames."""
        return self.task.hop_length * (self.audio.max_frames - 1)

    @property
    def min_seq_len(self) -> int:
        """Tokens of the longest sample: ``<bos>``, media, question, answer."""
        t = self.task
        media = t.max_images * self.tokens_per_image + t.max_tones * self.tokens_per_clip
        answer = 5 + t.max_images + t.max_tones  # images ... ; tones ... <eos>
        return 1 + media + 2 + answer

    # -------------------------------------------------------------- samples
    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> DigitsSample:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"DigitsDataset({self.split!r}): index {index} outside "
                             f"0..{self.num_samples - 1}")
        g = torch.Generator().manual_seed(_mix(self.seed, self._split_id, index))
        n_images = int(torch.randint(self.task.max_images + 1, (), generator=g))
        n_tones = int(torch.randint(self.task.max_tones + 1, (), generator=g))
        picks = torch.randint(len(self.scans), (n_images,), generator=g)
        scans = tuple(self.scans[picks].tolist())
        tone_digits = tuple(torch.randint(10, (n_tones,), generator=g).tolist())
        shift = self.task.max_shift if self.split == "train" else 0
        shifts = torch.randint(-shift, shift + 1, (n_images, 2), generator=g).tolist()
        # Even seeds for training tones, odd for held-out ones: never the same tone.
        tone_seeds = tuple(2 * _mix(self.seed, self._split_id, index, k) + self._split_id
                           for k in range(n_tones))
        image_digits = tuple(_scans()[1][list(scans)].tolist())
        # Sizes are drawn last: the scans, digits and tones are those of the one-size dataset.
        sizes = torch.randint(len(self.image_sizes), (n_images,), generator=g).tolist() if self.varied("vision") \
            else [0] * n_images
        frames = torch.randint(len(self.clip_frames), (n_tones,), generator=g).tolist() if self.varied("audio") \
            else [0] * n_tones
        image_sizes = tuple(self.image_sizes[k] for k in sizes)
        offsets = [(0, 0)] * n_images
        if self.varied("vision") and self.task.image_fit == "pad":  # patch-aligned places on the paper
            p, n = self.vision.patch_size, self.vision.image_size
            offsets = [(p * int(torch.randint((h - n) // p + 1, (), generator=g)),
                        p * int(torch.randint((w - n) // p + 1, (), generator=g))) for h, w in image_sizes]
        return DigitsSample(scans, image_digits, tuple(map(tuple, shifts)), tone_digits,
                            tone_seeds, image_sizes, tuple(self.clip_frames[k] for k in frames), tuple(offsets))

    # -------------------------------------------------------------- batches
    def batch(self, indices: Sequence[int],
              load: Mapping[str, Iterable[int]] | None = None) -> MimoBatch:
        """The global batch of samples `indices` (in that order).

        Args:
            indices: dataset indices, one per row.
            load: ``{modality: positions in the batch}`` whose encoder inputs to decode or
                synthesize; every other item's input is zeros (a stride-0 view, no memory,
                when none of a modality's items is loaded). None: load everything. ``{}``:
                metadata only (tokens, labels, items per sample) — what a rank that encodes
                no modality needs. See `samples_to_load`.
        """
        samples = [self[i] for i in indices]
        rows = [self._row(s) for s in samples]
        shape = (len(rows), self.seq_len)  # also for an empty batch
        tokens = torch.tensor([r[0] for r in rows], dtype=torch.int64).reshape(shape)
        labels = torch.tensor([r[1] for r in rows], dtype=torch.int64).reshape(shape)
        modalities = {}
        for name in DIGITS_MODALITIES:
            wanted = set(range(len(samples)) if load is None else load.get(name, ()))
            counts = [len(s.scans) if name == "vision" else len(s.tone_digits) for s in samples]
            if self.varied(name):  # one tensor and one row count per item
                inputs: torch.Tensor | list[torch.Tensor] = [
                    self._item(name, sample, k) if i in wanted else torch.zeros(()).expand(*shape)
                    for i, sample in enumerate(samples) for k, shape in enumerate(self.item_shapes(name, sample))]
                tokens_per_item: int | tuple[int, ...] = tuple(n for s in samples for n in self.item_tokens(name, s))
            else:
                inputs = self._inputs(name, samples, counts, wanted)
                tokens_per_item = self.tokens_per_image if name == "vision" else self.tokens_per_clip
            modalities[name] = ModalityInputs(
                inputs=inputs,
                items_per_sample=tuple(counts),
                tokens_per_item=tokens_per_item,
                special_token_id=IMAGE_TOKEN_ID if name == "vision" else AUDIO_TOKEN_ID,
            )
        return MimoBatch(tokens, labels, (labels != IGNORE_INDEX).float(), modalities)

    def item_shapes(self, modality: str, sample: DigitsSample) -> list[tuple[int, ...]]:
        """The input shape of each of `sample`'s items of `modality`."""
        if modality == "vision":
            return [(self.vision.in_channels, *size) for size in sample.image_sizes]
        return [(self.audio.n_mels, frames) for frames in sample.tone_frames]

    def item_tokens(self, modality: str, sample: DigitsSample) -> list[int]:
        """The encoder rows of each of `sample`'s items of `modality`."""
        if modality == "vision":
            return [self._image_tokens(size) for size in sample.image_sizes]
        return [self.audio.output_length(frames) for frames in sample.tone_frames]

    def item_shape(self, modality: str) -> tuple[int, ...]:
        """Shape of one encoder input: ``(C, H, W)`` for "vision", ``(n_mels, T)`` for "audio"."""
        if modality == "vision":
            return (self.vision.in_channels, self.vision.image_size, self.vision.image_size)
        if modality == "audio":
            return (self.audio.n_mels, self.audio.max_frames)
        raise KeyError(f"the digits dataset has modalities {list(DIGITS_MODALITIES)}, "
                       f"not {modality!r}")

    def _inputs(self, name: str, samples: list[DigitsSample], counts: list[int],
                wanted: set[int]) -> torch.Tensor:
        shape = self.item_shape(name)
        total = sum(counts)
        if not any(counts[i] for i in wanted if 0 <= i < len(samples)):
            return torch.zeros(()).expand(total, *shape)
        out = torch.zeros(total, *shape)
        start = 0
        for i, (sample, count) in enumerate(zip(samples, counts)):
            if i in wanted:
                for k in range(count):
                    out[start + k] = self._item(name, sample, k)
            start += count
        return out

    def _item(self, name: str, sample: DigitsSample, k: int) -> torch.Tensor:
        if name == "vision":
            if not self.varied("vision"):
                return _image(sample.scans[k], sample.image_shifts[k], self.vision)
            offset = sample.image_offsets[k] if self.task.image_fit == "pad" else None
            return _image(sample.scans[k], sample.image_shifts[k], self.vision, sample.image_sizes[k], offset)
        samples = self.task.hop_length * (sample.tone_frames[k] - 1)  # the centred STFT's frames
        wave = dtmf_tone(sample.tone_digits[k], sample.tone_seeds[k], self.task, samples)
        return log_mel_spectrogram(wave, self.task, self.audio.n_mels)

    def _row(self, sample: DigitsSample) -> tuple[list[int], list[int]]:
        """Token ids and labels of one sample, padded to `seq_len`."""
        prompt = ([_WORDS["<bos>"]]
                  + [IMAGE_TOKEN_ID] * sum(self.item_tokens("vision", sample))
                  + [AUDIO_TOKEN_ID] * sum(self.item_tokens("audio", sample))
                  + encode("what ?"))
        answer = encode(sample.answer())
        pad = self.seq_len - len(prompt) - len(answer)
        tokens = prompt + answer + [_WORDS["<pad>"]] * pad
        # Position t predicts token t + 1: targets from the last prompt token ("?") to the one
        # before <eos>.
        labels = [IGNORE_INDEX] * (len(prompt) - 1) + answer + [IGNORE_INDEX] * (pad + 1)
        return tokens, labels


# ---------------------------------------------------------------------------- per-rank loading


def samples_to_load(layout: MimoLayout, rank: int, batch_size: int,
                    num_microbatches: int = 1,
                    modalities: Iterable[str] = DIGITS_MODALITIES) -> dict[str, list[int]]:
    """``{modality: batch positions}`` whose inputs `rank` feeds to an encoder: for each of
    `modalities` whose first pipeline stage has `rank`, its dp shard of every microbatch (the
    rule of `dtensor_mimo.data.shard` over `dtensor_mimo.data.microbatches`). Pass it as
    `DigitsDataset.batch`'s ``load``; a rank that encodes nothing gets ``{}``.
    """
    out: dict[str, list[int]] = {}
    for name in modalities:
        if name not in layout.names or not layout.is_first_stage(name, rank):
            continue
        dp, dp_rank = layout.parallelism(name).dp, layout.coordinate(name, rank)["dp"]
        positions = []
        for m in range(num_microbatches):
            mb = sample_range(batch_size, num_microbatches, m)
            local = sample_range(len(mb), dp, dp_rank)
            positions.extend(range(mb.start + local.start, mb.start + local.stop))
        out[name] = positions
    return out


class ResumableBatchSampler(Sampler[list[int]]):
    """Global batches of `batch_size` dataset indices, shuffled per epoch from (`seed`, epoch);
    the last incomplete batch of an epoch is dropped. Every rank draws the same batches.

    Iterating yields the rest of the current epoch, then moves to the next epoch (iterate
    again for it). `state_dict` after a batch was taken resumes at the next batch.
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int = 0,
                 shuffle: bool = True) -> None:
        if batch_size < 1 or num_samples < batch_size:
            raise ValueError(f"ResumableBatchSampler: need 1 <= batch_size={batch_size} <= "
                             f"num_samples={num_samples}")
        self.num_samples, self.batch_size, self.seed, self.shuffle = (
            num_samples, batch_size, seed, shuffle)
        self.epoch = 0
        self.index = 0  # batches of this epoch already taken

    def __len__(self) -> int:
        return self.num_samples // self.batch_size

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator().manual_seed(_mix(self.seed, epoch))
        return torch.randperm(self.num_samples, generator=g)

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order(self.epoch)
        while self.index < len(self):
            start = self.index * self.batch_size
            self.index += 1
            yield order[start : start + self.batch_size].tolist()
        self.epoch, self.index = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        """The position: ``{"epoch", "index"}`` (plus the settings, checked on load)."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "num_samples": self.num_samples, "batch_size": self.batch_size}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume at the position of `state` (from a sampler with the same settings)."""
        for key in ("seed", "num_samples", "batch_size"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"ResumableBatchSampler: the state has {key}={state[key]} but "
                                 f"this sampler has {key}={getattr(self, key)}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


# ---------------------------------------------------------------------------- scoring


def exact_match(logits: torch.Tensor, labels: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
    """Per row, whether the argmax of `logits` ``[B, S, V]`` equals `labels` ``[B, S]`` at
    every scored position: labels not `IGNORE_INDEX` (and `positions` true, if given).
    ``[B]`` bool; a row with no scored position counts as right.

    With teacher-forced logits and next-token labels this is greedy decoding's exact match:
    greedy decoding reproduces the answer exactly when each answer token is the argmax given
    the right tokens before it.
    """
    scored = labels != IGNORE_INDEX
    if positions is not None:
        scored = scored & positions
    wrong = (logits.argmax(-1) != labels) & scored
    return ~wrong.any(-1)


def exact_match_accuracy(logits: torch.Tensor, labels: torch.Tensor,
                         positions: torch.Tensor | None = None) -> float:
    """Share of rows with at least one scored position that `exact_match` scores right
    (NaN when no row has one)."""
    scored = labels != IGNORE_INDEX
    if positions is not None:
        scored = scored & positions
    counted = scored.any(-1)
    if not counted.any():
        return float("nan")
    return exact_match(logits, labels, positions)[counted].float().mean().item()


def answer_digit_positions(labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"vision": mask, "audio": mask}`` ``[B, S]``: the positions whose target is an image's
    digit (before the answer's ``;``) or a tone's digit (after it). Pass one as `exact_match`'s
    `positions` to score one modality's part of the answer."""
    is_digit = (labels >= _DIGIT0) & (labels < _DIGIT0 + 10)
    after_sep = (labels == _WORDS[";"]).cumsum(-1) > 0
    return {"vision": is_digit & ~after_sep, "audio": is_digit & after_sep}
