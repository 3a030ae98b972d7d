"""What the trainer trains and scores on: the digits task or a user's conversation files.

A `TrainData` gives the training and held-out datasets (each turns dataset indices into a global
`MimoBatch`, loading only the media a rank encodes), the row length, how a held-out batch is
scored against the model's greedy predictions, and how a sample is prompted for generation.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import torch

from dtensor_mimo.data import (
    IGNORE_INDEX,
    DigitsDataset,
    DigitsTask,
    MimoBatch,
    answer_digit_positions,
    decode,
    encode,
)
from dtensor_mimo.data.conversation import (
    ConversationDataset,
    DataError,
    MediaSpec,
    PLACEHOLDERS,
    audio_inputs,
    check_samples,
    image_inputs,
    item_paths,
    read_samples,
)
from dtensor_mimo.train.config import LANGUAGE, ConfigError, TrainerConfig
from dtensor_mimo.train.modules import ResolvedModel

TRAIN_SAMPLES = 1_000_000
"""Samples of the digits training split (each drawn from its index alone; an epoch is this many)."""


class BatchSource(Protocol):
    seq_len: int

    def __len__(self) -> int: ...

    def batch(self, indices: Sequence[int], load: Mapping[str, Iterable[int]] | None = None) -> MimoBatch: ...


@dataclass
class TrainData:
    """The datasets of a run and how they are scored.

    Attributes:
        train: the training samples.
        heldout: the held-out samples (None: no evaluation).
        seq_len: token row length (cp / sp rounding applied).
        score: ``(batch, predicted ids) -> {name: (right, counted)}``: exact match of every
            answer ("answer") and of any parts the task reports.
        prompt: held-out index -> (prompt length, expected answer text, stop token id), or None
            for a sample with no answer to generate.
        decode: generated ids -> text.
        items_per_sample: each encoder's expected items per sample (for FLOPs).
        tokens_per_item: each encoder's expected rows per item (for FLOPs and the planner): the
            fixed count, or with items of their own size the mean of the data's (digits: over
            its sizes; conversations: over the first training items, from their headers).
    """

    train: BatchSource
    heldout: BatchSource | None
    seq_len: int
    score: Callable[[MimoBatch, torch.Tensor], dict[str, tuple[int, int]]]
    prompt: Callable[[int], tuple[int, str, int | None] | None]
    decode: Callable[[list[int]], str]
    items_per_sample: dict[str, float]
    tokens_per_item: dict[str, float]


def round_seq_len(config: TrainerConfig, minimum: int) -> int:
    """`minimum` rounded up so the language model's cp (2·cp chunks) and sp (tp shards) divide it."""
    lang = config.module_layout(LANGUAGE)
    multiple = math.lcm(2 * lang.cp if lang.cp > 1 else 1, lang.tp)
    return -(-minimum // multiple) * multiple


def exact_match(batch: MimoBatch, pred: torch.Tensor, parts: Mapping[str, torch.Tensor] = {}) -> dict[str, tuple[int, int]]:
    """Rows whose every scored position (and every position of each part) `pred` gets right."""
    scored = batch.labels != IGNORE_INDEX
    wrong = (pred != batch.labels) & scored
    out = {}
    for name, mask in {"answer": scored, **parts}.items():
        rows = (scored & mask).any(-1)
        out[name] = (int((~(wrong & mask).any(-1) & rows).sum()), int(rows.sum()))
    return out


# ---------------------------------------------------------------------------- digits


def digits_data(config: TrainerConfig, resolved: ResolvedModel) -> TrainData:
    """The bundled digits task for the digits model's image and audio encoders."""
    d = config.data
    vision, audio = resolved.encoders["vision"].config, resolved.encoders["audio"].config
    task = DigitsTask(max_images=d.max_images, max_tones=d.max_tones, noise_std=d.noise_std)
    probe = DigitsDataset("train", vision, audio, num_samples=1, task=task)
    seq_len = round_seq_len(config, max(probe.min_seq_len, d.seq_len))
    train = DigitsDataset("train", vision, audio, TRAIN_SAMPLES, seed=d.seed, task=task, seq_len=seq_len)
    heldout = DigitsDataset("heldout", vision, audio, d.heldout_samples, seed=d.seed, task=task, seq_len=seq_len)
    question, eos = encode("?")[0], encode("<eos>")[0]

    def prompt(index: int) -> tuple[int, str, int | None]:
        row = heldout.batch([index], load={}).tokens[0]
        return int((row == question).nonzero()[0]) + 1, heldout[index].answer(), eos

    def score(batch: MimoBatch, pred: torch.Tensor) -> dict[str, tuple[int, int]]:
        return exact_match(batch, pred, answer_digit_positions(batch.labels))

    return TrainData(train, heldout, seq_len, score, prompt, decode,
                     {"vision": d.max_images / 2, "audio": d.max_tones / 2},
                     {"vision": train.mean_tokens("vision"), "audio": train.mean_tokens("audio")})


# ---------------------------------------------------------------------------- conversations


def media_specs(resolved: ResolvedModel) -> dict[str, MediaSpec]:
    """Each encoder's placeholder id, rows per item, input shape and preprocessing; for an
    encoder of items at their own size, how an item's shape and rows follow from its file."""
    specs = {}
    vocab = resolved.tokenizer.get_vocab()
    for name, e in resolved.encoders.items():
        modality = e.section.modality
        if modality == "audio":
            prepare = audio_inputs(e.processor, e.clip_samples)
        else:
            fit = (e.config.patch_size, *e.image_pixels) if e.image_pixels else None
            prepare = image_inputs(e.processor, fit)
        varied = {"shape_of": prepare.shape, "tokens_for": e.config.tokens_for} if e.varied else {}
        specs[name] = MediaSpec(modality, vocab[PLACEHOLDERS[modality]], e.tokens_per_item,
                                e.item_shape or (), prepare, **varied)
    return specs


MEAN_TOKENS_ITEMS = 64
"""Items whose headers estimate an encoder's mean rows per item when items have their own sizes."""


def mean_tokens(spec: MediaSpec, samples: Sequence[Mapping[str, Any]], root: str) -> float:
    """The expected rows per item of `spec`'s encoder: fixed, or the mean over the first
    `MEAN_TOKENS_ITEMS` items of `samples` (their headers only)."""
    if not spec.varied:
        return float(spec.tokens_per_item)
    paths = [p for s in samples for p in item_paths(s, spec.modality)][:MEAN_TOKENS_ITEMS]
    counts = []
    for p in paths:
        try:
            counts.append(spec.tokens_for(spec.shape_of(os.path.join(root, p))))
        except ValueError:  # the dataset names the sample when it meets it
            continue
    return sum(counts) / len(counts) if counts else float(spec.tokens_per_item)


def read_checked(config: TrainerConfig, path: str, key: str) -> tuple[list[dict[str, Any]], str]:
    """A conversation file's samples, checked (placeholders, media files), and its media root."""
    try:
        samples = read_samples(path)
        root = os.path.abspath(config.data.root or os.path.dirname(path))
        check_samples(samples, [e.modality for e in config.model.encoders.values()], root, f"{key} = {path!r}")
    except DataError as e:
        raise ConfigError(str(e)) from None
    if not samples:
        raise ConfigError(f"{key} = {path!r} holds no samples")
    return samples, root


def _decodes(spec: MediaSpec, path: str) -> bool:
    try:
        spec.prepare([path])
    except Exception:  # noqa: BLE001 - whatever the decoder raises; the probe then takes another file
        return False
    return True


def conversation_data(config: TrainerConfig, resolved: ResolvedModel) -> TrainData:
    """A LLaVA conversation file (and its held-out file) for the config's encoders."""
    d = config.data
    media = media_specs(resolved)
    train_samples, root = read_checked(config, d.path, "data.path")
    for name, spec in media.items():  # one item through the processor: its shape against the encoder's
        firsts = [os.path.join(root, item_paths(s, spec.modality)[0]) for s in train_samples if s.get(spec.modality)]
        if not firsts:
            continue
        # A file that does not decode is the step's to name (or skip), not the config's: probe another.
        path = next((p for p in firsts[:8] if _decodes(spec, p)), firsts[0])
        if spec.varied:  # the processor's output against the header's prediction, and the encoder takes it
            try:
                shape, predicted = tuple(spec.prepare([path])[0].shape), spec.shape_of(path)
                spec.tokens_for(shape)
            except (DataError, ValueError) as e:
                raise ConfigError(f"model.encoders.{name}: {e}") from None
            if shape != predicted:
                raise ConfigError(f"model.encoders.{name}: its processor turns {path} into {list(shape)}, not the "
                                  f"{list(predicted)} its header gives (and the token rows count); use a processor "
                                  "that resizes to the size it is given (SigLIP, CLIP) or a Whisper feature extractor")
            continue
        try:
            shape = tuple(spec.prepare([path]).shape[1:])
        except DataError as e:
            raise ConfigError(str(e)) from None
        if spec.item_shape and shape != spec.item_shape:
            raise ConfigError(f"model.encoders.{name}: its processor turns {path} into {list(shape)} but the "
                              f"encoder takes {list(spec.item_shape)}; give the processor the encoder's input size "
                              "(processor = 'DIR', or the preprocessor_config.json of its hf directory)")
        media[name] = MediaSpec(spec.modality, spec.special_token_id, spec.tokens_per_item, shape, spec.prepare)
    try:
        seq_len = round_seq_len(config, d.seq_len) if d.seq_len else 0
        if not seq_len:  # the longest sample's, rounded for cp / sp
            probe = ConversationDataset(d.path, resolved.tokenizer, media, 0, root, d.truncate, train_samples)
            seq_len = round_seq_len(config, probe.seq_len)
        train = ConversationDataset(d.path, resolved.tokenizer, media, seq_len, root, d.truncate, train_samples,
                                    pack=d.pack, seed=d.seed)
        heldout = None
        if d.heldout:
            held_samples, held_root = read_checked(config, d.heldout, "data.heldout")
            if d.heldout_samples:
                held_samples = held_samples[:d.heldout_samples]
            heldout = ConversationDataset(d.heldout, resolved.tokenizer, media, train.seq_len, held_root,
                                          d.truncate, held_samples)
    except DataError as e:
        raise ConfigError(str(e)) from None
    tokenizer = resolved.tokenizer

    def prompt(index: int) -> tuple[int, str, int | None] | None:
        sample = heldout[index]
        if not sample.answers:  # truncated away
            return None
        start, stop = sample.answers[0]
        eos = tokenizer.eos_token_id
        return start, heldout.answer_text(index), eos if eos in sample.tokens[start:stop] else sample.tokens[stop - 1]

    def score(batch: MimoBatch, pred: torch.Tensor) -> dict[str, tuple[int, int]]:
        """Every answer, and the answers of the samples with items of each encoder."""
        parts = {f"with {name}": torch.tensor(m.items_per_sample).gt(0)[:, None].expand_as(batch.labels)
                 for name, m in batch.modalities.items()}
        return exact_match(batch, pred, parts)

    rows = len(train)  # items per row: several samples' when packed
    items = {name: sum(len(item_paths(s, spec.modality)) for s in train_samples) / rows
             for name, spec in media.items()}
    tokens = {name: mean_tokens(spec, train_samples, root) for name, spec in media.items()}
    return TrainData(train, heldout, train.seq_len, score, prompt,
                     lambda ids: tokenizer.decode(ids, skip_special_tokens=True).strip(), items, tokens)


def train_data(config: TrainerConfig, resolved: ResolvedModel) -> TrainData:
    """The run's data for `config.data.format`."""
    if config.data.format == "digits":
        return digits_data(config, resolved)
    return conversation_data(config, resolved)
