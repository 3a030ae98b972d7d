"""What the trainer trains and scores on: the digits task or a user's conversation files.

A `TrainData` gives the training and held-out datasets (each turns dataset indices into a global
`MimoBatch`, loading only the media a rank encodes), the row length, how a held-out batch is
scored against the model's greedy predictions, and how a sample is prompted for generation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
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
    video_inputs,
)
from dtensor_mimo.data.sources import SampleSource, open_source
from dtensor_mimo.parallelize.fp8 import FP8_DIM_MULTIPLE
from dtensor_mimo.train.config import LANGUAGE, ConfigError, TrainerConfig
from dtensor_mimo.train.modules import ResolvedModel

TRAIN_SAMPLES = 1_000_000
"""Samples of the digits training split (each drawn from its index alone; an epoch is this many)."""


class BatchSource(Protocol):
    """What the trainer draws global batches from. A source that raises `MediaError` for a row
    is asked again with ``left_out=`` those rows (``data.skip_bad_media``), a keyword it then takes."""

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
            for a sample with no whole answer to generate (truncation cut the first one).
        decode: generated ids -> text.
        items_per_sample: each encoder's expected items per row (for FLOPs and the planner;
            conversations: estimated from the first `CHECKED_SAMPLES` training samples).
        tokens_per_item: each encoder's expected rows per item (for FLOPs and the planner): the
            fixed count, or with items of their own size the mean of the data's (digits: over
            its sizes; conversations: over the first training items, from their headers).
        known_rows: training rows known without indexing the whole corpus (all of them, or at
            least this many): what the launcher checks data.batch_size against.
        checked: one line: what the pre-launch checks read of the data, and what they did not.
    """

    train: BatchSource
    heldout: BatchSource | None
    seq_len: int
    score: Callable[[MimoBatch, torch.Tensor], dict[str, tuple[int, int]]]
    prompt: Callable[[int], tuple[int, str, int | None] | None]
    decode: Callable[[list[int]], str]
    items_per_sample: dict[str, float]
    tokens_per_item: dict[str, float]
    known_rows: int = 0
    checked: str = ""


def round_seq_len(config: TrainerConfig, minimum: int) -> int:
    """`minimum` rounded up so the language model's cp (2·cp chunks) divides it, and tp each cp
    rank's rows (sequence parallel shards them: evenly, as torch before 2.13 needs); for a float8
    language model on CUDA also 16 each cp rank's rows (its weight gradients' matmuls take them
    as their inner dim: `dtensor_mimo.parallelize.fp8.fp8_rows_problem`)."""
    lang = config.module_layout(LANGUAGE)
    multiple = math.lcm(2 * lang.cp if lang.cp > 1 else 1, lang.cp * lang.tp)
    if config.train.device == "cuda" and config.module_options(LANGUAGE).fp8 is not None:
        multiple = math.lcm(multiple, FP8_DIM_MULTIPLE * lang.cp)
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
                     {"vision": train.mean_tokens("vision"), "audio": train.mean_tokens("audio")}, len(train))


# ---------------------------------------------------------------------------- conversations


def media_specs(config: TrainerConfig, resolved: ResolvedModel) -> dict[str, MediaSpec]:
    """Each encoder's placeholder id, rows per item, input shape and preprocessing; for an
    encoder of items at their own size (and of video clips: frames by data.video_fps and
    data.video_max_frames), how an item's shape and rows follow from its file."""
    specs = {}
    vocab = resolved.tokenizer.get_vocab()
    for name, e in resolved.encoders.items():
        modality = e.section.modality
        if modality == "audio":
            prepare = audio_inputs(e.processor, e.clip_samples)
        else:
            fit = (e.config.patch_size, *e.image_pixels) if e.image_pixels else None
            prepare = image_inputs(e.processor, fit)
        if modality == "video":  # a clip of frames through the image tower, its frame count from its header
            k = e.config.temporal_patch
            frame = e.item_shape and (e.item_shape[0] // k, *e.item_shape[1:])
            prepare = video_inputs(prepare, config.data.video_fps, config.data.video_max_frames, frame, k)
        varied = ({"shape_of": prepare.shape, "tokens_for": e.config.tokens_for}
                  if e.varied or modality == "video" else {})
        specs[name] = MediaSpec(modality, vocab[PLACEHOLDERS[modality]], e.tokens_per_item,
                                e.item_shape or (), prepare, frames=modality == "video",
                                frame_text=config.data.video_frame_text if modality == "video" else "", **varied)
    return specs


MEAN_TOKENS_ITEMS = 64
"""Items whose headers estimate an encoder's mean rows per item when items have their own sizes."""

CHECKED_SAMPLES = 256
"""Samples read and checked before training, from the start of each file list (JSON shape,
placeholders against items, media existence; the launcher also tokenizes them): the other samples
are checked when a rank first reads them. Estimates of the whole corpus come from these too."""


def mean_tokens(spec: MediaSpec, source: SampleSource, samples: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    """The expected rows per encoder item of `spec`'s encoder and encoder items per file (a
    video's frames; else 1): fixed, or the means over the first `MEAN_TOKENS_ITEMS` files of
    `samples` (`source`'s first ones; their headers only): an estimate."""
    if not spec.varied:
        return float(spec.tokens_per_item), 1.0
    refs = [r for i, s in enumerate(samples) for r in source.media(i, s, spec.modality)][:MEAN_TOKENS_ITEMS]
    rows, items = [], []
    for ref in refs:
        try:
            shape = spec.shape_of(source.open(ref))
            rows.append(spec.rows_of(shape))
        except ValueError:  # the dataset names the sample when it meets it (DataError: a ValueError)
            continue
        items.append(shape[0] if spec.frames else 1)
    if not sum(items):
        return float(spec.tokens_per_item), 1.0
    return sum(rows) / sum(items), sum(items) / len(items)


def open_checked(config: TrainerConfig, path: str | list[str], key: str, least: int = 0,
                 most: int | None = None) -> tuple[SampleSource, list[dict[str, Any]]]:
    """The `data.format` source of `path` and its first ``max(CHECKED_SAMPLES, least)`` samples
    (``min(CHECKED_SAMPLES, most)`` with `most`: the samples the run uses, e.g. the held-out ones it
    scores), checked (JSON shape, placeholders, media exist); nothing else of the corpus is read."""
    try:
        source = open_source(config.data.format, path, config.data.root, key)
        head = source.head(max(CHECKED_SAMPLES, least) if most is None else min(CHECKED_SAMPLES, most))
        check_samples(source, head, [e.modality for e in config.model.encoders.values()], source.describe())
    except DataError as e:
        raise ConfigError(str(e)) from None
    if not head:
        raise ConfigError(f"{key} = {path!r} holds no samples")
    return source, head


def _decodes(spec: MediaSpec, source: SampleSource, ref: str) -> bool:
    try:
        spec.prepare([source.open(ref)])
    except Exception:  # noqa: BLE001 - whatever the decoder raises; the probe then takes another file
        return False
    return True


def _blank_shape(name: str, spec: MediaSpec) -> tuple[int, ...]:
    """The input shape `spec`'s processor gives an item (a black 16x16 PNG, a second of silence as
    WAV): the size of a factory encoder's items where no checked sample has one to probe."""
    import io
    import wave

    from dtensor_mimo.data.sources import MediaBytes

    data = io.BytesIO()
    if spec.modality == "audio":
        rate = spec.prepare.feature_extractor.sampling_rate
        with wave.open(data, "wb") as f:
            f.setnchannels(1), f.setsampwidth(2), f.setframerate(rate)
            f.writeframes(bytes(2 * rate))
    else:
        from PIL import Image

        Image.new("RGB", (16, 16)).save(data, format="PNG")
    try:
        return tuple(spec.prepare([MediaBytes(data.getvalue(), f"a blank {spec.modality} item")]).shape[1:])
    except Exception as e:  # noqa: BLE001 - what the processor raises
        raise ConfigError(f"model.encoders.{name}: its processor cannot take a blank {spec.modality} item "
                          f"({type(e).__name__}: {e}); check model.encoders.{name}.processor") from None


def _probe_processors(media: dict[str, MediaSpec], source: SampleSource, head: list[dict[str, Any]]) -> None:
    """One item of each encoder through its processor: its shape against the encoder's (fixed
    shapes are then taken from it: `media` is updated; a factory encoder's from a blank item where
    no checked sample has one, else the later items would all be refused as unlike the encoder's)."""
    for name, spec in media.items():
        firsts = [source.media(i, s, spec.modality)[0] for i, s in enumerate(head) if s.get(spec.modality)]
        if not firsts:
            if not spec.varied and not spec.item_shape:  # a factory encoder's input size is its processor's:
                shape = _blank_shape(name, spec)  # from a blank item, as no checked sample has a file
                media[name] = replace(spec, item_shape=shape)
            continue
        # A file that does not decode is the step's to name (or skip), not the config's: probe another.
        ref = next((r for r in firsts[:8] if _decodes(spec, source, r)), None)
        if ref is None:  # none of them: the files, or this processor's reading of them
            try:
                spec.prepare([source.open(firsts[0])])
            except Exception as e:  # noqa: BLE001 - what the decoder raises
                raise ConfigError(f"model.encoders.{name}: none of the first {len(firsts[:8])} {spec.modality} files "
                                  f"decodes through its processor ({firsts[0]}: {type(e).__name__}: {e}); check "
                                  "the files and the processor") from None
            ref = firsts[0]  # it decoded this time
        if spec.varied:  # the processor's output against the header's prediction, and the encoder takes it
            try:
                shape, predicted = tuple(spec.prepare([source.open(ref)])[0].shape), spec.shape_of(source.open(ref))
                spec.rows_of(shape)
            except (DataError, ValueError) as e:
                raise ConfigError(f"model.encoders.{name}: {e}") from None
            if shape != predicted:
                raise ConfigError(f"model.encoders.{name}: its processor turns {ref} into {list(shape)}, not the "
                                  f"{list(predicted)} its header gives (and the token rows count); use a processor "
                                  "that resizes to the size it is given (SigLIP, CLIP) or a Whisper feature extractor")
            continue
        try:
            shape = tuple(spec.prepare([source.open(ref)]).shape[1:])
        except DataError as e:
            raise ConfigError(str(e)) from None
        if spec.item_shape and shape != spec.item_shape:
            raise ConfigError(f"model.encoders.{name}: its processor turns {ref} into {list(shape)} but the "
                              f"encoder takes {list(spec.item_shape)}; give the processor the encoder's input size "
                              "(processor = 'DIR', or the preprocessor_config.json of its hf directory)")
        media[name] = replace(spec, item_shape=shape)


def conversation_data(config: TrainerConfig, resolved: ResolvedModel, ahead: bool = False) -> TrainData:
    """Conversation data of `data.format` (and its held-out data) for the config's encoders.

    Lazy: the sources index their files when a rank first needs them (`len` for the sampler);
    samples are tokenized and media probed when a batch wants them. What the whole corpus would
    give (items per sample, rows per item) is estimated from its first `CHECKED_SAMPLES`.
    `ahead`: for the launcher's checks before the ranks start, which never tokenize the whole
    corpus: ``data.pack`` packs only a corpus its checked samples are all of (each rank packs
    the rest, a pass over every sample)."""
    d = config.data
    media = media_specs(config, resolved)
    train_source, head = open_checked(config, d.path, "data.path", d.batch_size)
    _probe_processors(media, train_source, head)
    # Whether the head is the whole corpus (one sample more read where it holds just as many as asked).
    try:
        whole = len(head) < max(CHECKED_SAMPLES, d.batch_size) or len(train_source.head(len(head) + 1)) == len(head)
    except DataError as e:
        raise ConfigError(str(e)) from None
    try:
        seq_len = round_seq_len(config, d.seq_len) if d.seq_len else 0
        pack_len = d.seq_len  # packed rows take this many tokens of samples whatever the layout rounds rows to
        if not seq_len:  # the longest sample's, rounded for cp / sp: only where that is cheap
            if not whole:
                probe = ConversationDataset(d.path, resolved.tokenizer, media, 1 << 30, truncate=d.truncate,
                                            samples=train_source.first(len(head)))
                raise ConfigError(f"data.seq_len = 0 takes the longest sample's length, which needs every sample of "
                                  f"{train_source.describe()} tokenized; give data.seq_len (the first {len(head)} "
                                  f"samples' longest has {probe.check_lengths(skip_media=True)} tokens)")
            probe = ConversationDataset(d.path, resolved.tokenizer, media, 0, truncate=d.truncate,
                                        samples=train_source)
            seq_len, pack_len = round_seq_len(config, probe.seq_len), probe.seq_len
        train = ConversationDataset(d.path, resolved.tokenizer, media, seq_len, truncate=d.truncate,
                                    samples=train_source, pack=d.pack and (whole or not ahead), seed=d.seed,
                                    pack_len=pack_len)
        heldout = None
        if d.heldout:
            # the samples scored only (data.heldout_samples; 0: all): a sample past them is never read
            held_source, _ = open_checked(config, d.heldout, "data.heldout", most=d.heldout_samples or None)
            if d.heldout_samples:
                held_source = held_source.first(d.heldout_samples)
            heldout = ConversationDataset(d.heldout, resolved.tokenizer, media, train.seq_len, truncate=d.truncate,
                                          samples=held_source)
    except DataError as e:
        raise ConfigError(str(e)) from None
    tokenizer = resolved.tokenizer

    def prompt(index: int) -> tuple[int, str, int | None] | None:
        sample = heldout[index]
        if not sample.answers or sample.answer_cut and len(sample.answers) == 1:  # truncated away, or cut short
            return None  # (a cut answer's text is a fragment, and its last token no end of turn to stop at)
        start, stop = sample.answers[0]
        eos = tokenizer.eos_token_id
        return start, heldout.answer_text(index), eos if eos in sample.tokens[start:stop] else sample.tokens[stop - 1]

    def score(batch: MimoBatch, pred: torch.Tensor) -> dict[str, tuple[int, int]]:
        """Every answer, and the answers of the samples with items of each encoder."""
        parts = {f"with {name}": torch.tensor(m.items_per_sample).gt(0)[:, None].expand_as(batch.labels)
                 for name, m in batch.modalities.items()}
        return exact_match(batch, pred, parts)

    # Estimated from the first samples (FLOPs, the planner's costs): items per sample, times the
    # samples a packed row holds (exact: packing has measured every sample).
    per_row = 1.0 if train.rows is None else len(train.samples) / len(train)
    means = {name: mean_tokens(spec, train_source, head) for name, spec in media.items()}  # per item; items per file
    items = {name: per_row * means[name][1] * sum(len(train_source.media(i, s, spec.modality))
                                                   for i, s in enumerate(head)) / len(head)
             for name, spec in media.items()}
    tokens = {name: mean[0] for name, mean in means.items()}
    what = (f"all {len(head)} samples of {train_source.describe()}" if whole else
            f"the first {len(head)} samples of {train_source.describe()}")
    checked = (f"checked {what} (JSON shape, placeholders, media files exist, token lengths) and one item through "
               f"each processor" + ("" if whole else "; not checked: the other samples (a rank names the first "
                                    "that fails when it reads it); items per sample estimated from these"))
    return TrainData(train, heldout, train.seq_len, score, prompt,
                     lambda ids: tokenizer.decode(ids, skip_special_tokens=True).strip(), items, tokens,
                     len(head) if train.rows is None else len(train), checked)


def train_data(config: TrainerConfig, resolved: ResolvedModel, ahead: bool = False) -> TrainData:
    """The run's data for `config.data.format` (`ahead`: for the launcher's checks,
    `conversation_data`)."""
    if config.data.format == "digits":
        return digits_data(config, resolved)
    return conversation_data(config, resolved, ahead)
