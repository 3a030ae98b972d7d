"""Conversation data in LLaVA's format, tokenized with the language model's own chat template.

A file holds one sample per line (JSONL) or a JSON list of samples::

    {"id": "s1", "image": "imgs/a.png" | [paths], "audio": "clips/a.wav" | [paths],
     "video": "clips/a.mp4" | [paths],
     "conversations": [{"from": "human", "value": "<image>\\nWhat is it?"},
                       {"from": "gpt", "value": "A cat."}]}

``<image>`` / ``<audio>`` / ``<video>`` in a turn's text marks where one item's tokens go (LLaVA's convention),
items in the order of the sample's list; a sample may have none, one or several. Turns are
rendered with the tokenizer's ``chat_template`` (``human`` -> user, ``gpt`` -> assistant,
``system`` -> system) and the loss counts the assistant tokens only (each answer through its
end-of-turn token). Each placeholder token becomes ``tokens_per_item`` copies of its id: the rows
the encoder gives for the item. Media go through the encoder's own transformers processor
(image processor, Whisper feature extractor), and only on the ranks that encode them.

Items of their own size (`MediaSpec.shape_of`): each image is resized to its own size
(`fit_image_size`: aspect ratio kept, sides multiples of the patch, pixels within a budget), each
clip keeps its own length; a placeholder then expands to that item's own row count, read from the
file's header on every rank (no pixels decoded), and a batch carries one tensor per item.

Video (`video_inputs`, PyAV): a clip is one item of the sample (one ``<video>``) whose shape is
``(frames, C, H, W)``: its frames are sampled at ``fps`` up to ``max_frames`` (`sample_frames`),
the count known from the container's header (frame count and rate, nothing decoded), and each
frame is one encoder item through the image tower (`MediaSpec.frames`): the placeholder expands
to frames x rows per frame, and the batch carries one encoder item per frame, so packing, encoder
dp balancing and the bridge's ragged plans take frames as they take images.

Needs ``transformers`` (the tokenizer and processors are its objects), Pillow for images and
PyAV (``av``) for video.
"""

from __future__ import annotations

import math
import os
import struct
import wave
from dataclasses import dataclass, field
from fractions import Fraction
from itertools import accumulate
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Collection, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from dtensor_mimo.data.batch import IGNORE_INDEX, MimoBatch, ModalityInputs

if TYPE_CHECKING:
    from dtensor_mimo.data.sources import SampleSource

__all__ = ["Conversation", "ConversationDataset", "DataError", "MediaError", "MediaSpec", "read_samples", "check_samples",
           "check_modalities", "image_inputs", "audio_inputs", "video_inputs", "item_paths", "fit_image_size",
           "sample_frames"]

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
PLACEHOLDERS = {"image": "<image>", "audio": "<audio>", "video": "<video>"}
"""The text that marks an item of each modality (also the JSON key of its paths)."""


class DataError(ValueError):
    """A sample, file or tokenizer the data cannot be built from; names the sample id or path."""


class MediaError(DataError):
    """A media file of a batch that its preparation (decoding) failed on: names the sample id and
    the path. `row`: the row of the batch holding the sample; `sample_id`, `path`, `reason`."""

    def __init__(self, message: str, row: int = -1, sample_id: str = "", path: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.row, self.sample_id, self.path, self.reason = row, sample_id, path, reason

    def __reduce__(self):  # loader workers pickle it with its fields
        return type(self), (str(self), self.row, self.sample_id, self.path, self.reason)


def frame_text_problem(text: str) -> str | None:
    """What is wrong with a clip's per-frame text `text` (`MediaSpec.frame_text`,
    ``data.video_frame_text``), said after it; None: nothing."""
    if "{frame}" not in text:
        return "has no {frame}: every frame would get the same text; put {frame} where its number goes"
    try:
        text.format(frame=1)
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as e:
        return (f"holds more than {{frame}} ({type(e).__name__}: {e}): {{frame}} is the only field it may hold; "
                "write a brace of the text as {{ or }}")
    return None


@dataclass(frozen=True)
class MediaSpec:
    """How one encoder's items enter the rows.

    Attributes:
        modality: "image", "audio" or "video": the sample's key holding its paths and the placeholder.
        special_token_id: the tokenizer's id of the placeholder (an added special token): the id
            of every row position the encoder fills.
        tokens_per_item: encoder rows per item (items of their own size: the most one item gives).
        item_shape: shape of one encoder input (``(C, H, W)``, ``(n_mels, frames)``); items of
            their own size: unused.
        prepare: paths -> encoder inputs ``[N, *item_shape]`` (the encoder's processor); items of
            their own size: a list with one tensor per path.
        shape_of: items of their own size: a media file -> its encoder input's shape, from the
            file's header (`image_inputs.shape`, `audio_inputs.shape`); None: every item has
            `item_shape`.
        tokens_for: with `shape_of`: an input shape -> the encoder's rows for it (the encoder
            config's ``tokens_for``; ValueError for an item it cannot take); with `frames`, of
            one frame.
        frames: each item is a clip of shape ``(frames, *frame shape)`` (`video_inputs`) whose
            frames are the encoder's items: its placeholder expands to the frames' rows, and the
            batch holds one encoder item per frame. `tokens_per_item` and `item_shape` are then
            a frame's (`item_shape` ``()``: frames of their own size, one tensor per frame).
        frame_text: with `frames`, text put before each frame's rows (each item's: a stack of
            frames under a temporal patch), ``{frame}`` replaced by its number in the clip from 1:
            e.g. ``"Frame{frame}: "`` (InternVL's video prompt). It tells the language model which
            frame a row belongs to, and so their order, from its tokens rather than only from the
            rows' positions. "": the rows alone.
    """

    modality: str
    special_token_id: int
    tokens_per_item: int
    item_shape: tuple[int, ...]
    prepare: Callable[[list[str]], torch.Tensor | list[torch.Tensor]]
    shape_of: Callable[[str], tuple[int, ...]] | None = None
    tokens_for: Callable[[Sequence[int]], int] | None = None
    frames: bool = False
    frame_text: str = ""

    def __post_init__(self) -> None:
        if self.frame_text and not self.frames:
            raise ValueError(f"MediaSpec({self.modality!r}): frame_text={self.frame_text!r} is for clips of "
                             "frames (frames=True)")
        if self.frame_text and (problem := frame_text_problem(self.frame_text)):
            raise ValueError(f"MediaSpec({self.modality!r}): frame_text={self.frame_text!r} {problem}")
        # Without them an item's rows would be tokens_per_item whatever its file: a clip's frames (or an
        # item of its own size) then unlike its row, every file refused as broken; or a bare TypeError.
        if self.frames and self.shape_of is None:
            raise ValueError(f"MediaSpec({self.modality!r}): frames=True needs shape_of, a clip's input shape "
                             "(frames, C, H, W) from its header (e.g. video_inputs(...).shape): its placeholder "
                             "expands to every frame's rows")
        if (self.shape_of is None) != (self.tokens_for is None):
            raise ValueError(f"MediaSpec({self.modality!r}): shape_of and tokens_for go together (an item's input "
                             "shape from its file, and the encoder's rows for that shape, e.g. "
                             "ViTConfig.tokens_for); give both or neither")

    @property
    def varied(self) -> bool:
        """Whether items have their own sizes (one tensor and one row count per item)."""
        return self.shape_of is not None

    def rows_of(self, shape: Sequence[int]) -> int:
        """The encoder's rows for an item of input `shape` (with `frames`: every frame's);
        ValueError for an item the encoder cannot take."""
        if self.frames:
            return shape[0] * self.tokens_for(shape[1:])
        return self.tokens_for(shape)


@dataclass(frozen=True)
class Conversation:
    """One tokenized sample: the row before padding, its labels, its items per modality (paths),
    where each assistant answer starts and ends (``answers``: ``(start, stop)`` token spans), each
    item's encoder input shape and rows (``item_shapes``, ``item_tokens``, per modality), and
    whether truncation cut the last answer short (``answer_cut``: it lost its end of turn)."""

    id: str
    tokens: list[int]
    labels: list[int]
    items: dict[str, list[str]]
    answers: list[tuple[int, int]]
    item_shapes: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)
    item_tokens: dict[str, list[int]] = field(default_factory=dict)
    answer_cut: bool = False


CACHE_SAMPLES = 65_536
"""Tokenized samples a dataset keeps (the first met): a small corpus is tokenized once, a large
one's memory stays bounded (each later epoch tokenizes again what did not fit)."""


@dataclass(frozen=True)
class _Tokenized:
    """A sample as the cache keeps it: int32 tokens, the answer spans (the labels follow from
    them), its items' references, shapes and rows, whether truncation cut the last answer short."""

    id: str
    tokens: np.ndarray
    answers: tuple[tuple[int, int], ...]
    items: dict[str, tuple[str, ...]]
    item_shapes: dict[str, list[tuple[int, ...]]]
    item_tokens: dict[str, list[int]]
    answer_cut: bool = False

    @property
    def labels(self) -> np.ndarray:
        """The next token at each position followed by an answer token, else IGNORE_INDEX."""
        labels = np.full(len(self.tokens), IGNORE_INDEX, dtype=np.int64)
        for start, stop in self.answers:
            first = max(start, 1)
            labels[first - 1:stop - 1] = self.tokens[first:stop]
        return labels

    def conversation(self) -> Conversation:
        return Conversation(self.id, self.tokens.tolist(), self.labels.tolist(),
                            {n: list(p) for n, p in self.items.items()}, list(self.answers),
                            self.item_shapes, self.item_tokens, self.answer_cut)


# ---------------------------------------------------------------------------- reading


def read_samples(path: str) -> list[dict[str, Any]]:
    """The samples of a LLaVA JSON list or JSONL file (DataError names the file and line)."""
    from dtensor_mimo.data.sources import JsonSource

    source = JsonSource([path], os.path.dirname(path))
    return [source[i] for i in range(len(source))]


def item_paths(sample: Mapping[str, Any], modality: str) -> list[str]:
    """The paths of a sample's items of `modality` (one path or a list in the JSON; none: [])."""
    value = sample.get(modality)
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def check_samples(source: SampleSource, samples: Sequence[Mapping[str, Any]], modalities: Iterable[str],
                  where: str) -> None:
    """Without tokenizing or opening media: every turn has a known role and text, each sample's
    placeholders match its items, every media item exists, and no sample carries a modality no
    encoder takes. `samples` are `source`'s first ones (`SampleSource.head`). DataError names
    `where`, the sample id (and the item)."""
    modalities = set(modalities)
    for index, sample in enumerate(samples):
        sid = sample["id"]
        check_turns(sample, where)
        text = "".join(t["value"] for t in sample["conversations"])
        check_modalities(source, index, sample, modalities, where)
        for modality, placeholder in PLACEHOLDERS.items():
            refs = source.media(index, sample, modality)
            if text.count(placeholder) != len(refs):
                raise DataError(f"{where}: sample {sid!r} has {text.count(placeholder)} {placeholder} "
                                f"placeholder(s) but {len(refs)} {modality} item(s); put one {placeholder} "
                                "in the text where each item goes")
            for ref in refs:
                if not source.exists(ref):
                    raise DataError(f"{where}: sample {sid!r}: {modality} file {ref} does not exist")


def check_modalities(source: SampleSource, index: int, sample: Mapping[str, Any], modalities: Iterable[str],
                     where: str) -> None:
    """DataError naming `where` and the sample id if sample `index` of `source` has items or a
    placeholder of a modality none of `modalities` is (no encoder would take them: its items would
    be left out and its placeholder trained on as text)."""
    text = "".join(t["value"] for t in sample["conversations"])
    for modality, placeholder in PLACEHOLDERS.items():
        if modality not in modalities and (placeholder in text or source.media(index, sample, modality)):
            raise DataError(f"{where}: sample {sample['id']!r} has {modality} items but no encoder takes "
                            f"{modality!r} (model.encoders.<name>.modality)")


def check_turns(sample: Mapping[str, Any], where: str) -> None:
    """DataError naming `where` and the sample id unless each turn has a known role and a text,
    and one is the assistant's (`check_samples` on a corpus's first samples; tokenizing, on
    every other as it is read)."""
    sid = sample["id"]
    for turn in sample["conversations"]:
        if not isinstance(turn, dict) or turn.get("from") not in ROLES or not isinstance(turn.get("value"), str):
            raise DataError(f"{where}: sample {sid!r}: a turn {str(turn)[:80]} needs 'from' (one of "
                            f"{sorted(ROLES)}) and a 'value' string")
    if not any(ROLES[t["from"]] == "assistant" for t in sample["conversations"]):
        raise DataError(f"{where}: sample {sid!r} has no 'gpt' turn: nothing to learn from it")


# ---------------------------------------------------------------------------- media


def fit_image_size(height: int, width: int, patch: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The ``(H, W)`` an image of `height` x `width` pixels is resized to for an encoder of
    `patch`-pixel patches: its aspect ratio kept, each side a whole number of patches (at least
    one), ``H * W <= max_pixels``, and ``H * W >= min_pixels`` where rounding to patches allows
    (Qwen2-VL's rule; an image already inside the budget only has its sides rounded).
    ``max_pixels`` must hold one patch."""
    if max_pixels < patch * patch:
        raise ValueError(f"fit_image_size: max_pixels={max_pixels} holds no {patch}x{patch} patch")

    def side(length: int, scale: float, rounding: Callable[[float], int]) -> int:
        return max(patch, rounding(length * scale / patch) * patch)

    h, w = side(height, 1.0, round), side(width, 1.0, round)
    if h * w > max_pixels:
        scale = math.sqrt(max_pixels / (height * width))
        h, w = side(height, scale, math.floor), side(width, scale, math.floor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h, w = side(height, scale, math.ceil), side(width, scale, math.ceil)
    while h * w > max_pixels:  # a side held at one patch, or rounded up: the longer side gives way
        if h >= w:
            h -= patch
        else:
            w -= patch
    return h, w


_TRANSPOSE = {2: 0, 3: 3, 4: 1, 5: 5, 6: 4, 7: 6, 8: 2}
"""EXIF orientation -> the `PIL.Image.Transpose` that shows the image (as `ImageOps.exif_transpose`)."""


def _orientation(image: Any) -> int:
    """An opened image's EXIF orientation (1: as stored), read from its header: a PNG whose EXIF
    comes after its pixels (where Pillow decodes them to find it) counts as 1, read or not; a TIFF
    is turned by Pillow itself as it opens it."""
    if image.format == "TIFF" or image.format == "PNG" and "exif" not in image.info:
        return 1
    try:
        orientation = image.getexif().get(0x0112, 1)
    except Exception:  # noqa: BLE001 - a malformed EXIF block: the image as stored
        return 1
    return orientation if orientation in _TRANSPOSE else 1


def _shown_rgb(image: Any) -> Any:
    """An opened image as RGB, as a viewer shows it: turned by its EXIF orientation, transparency
    over white (as transformers' processors composite it), and 16-bit grey (mode I;16, which
    Pillow's RGB conversion clips at 255: white above 255 / 65535) scaled to 8 bits."""
    orientation = _orientation(image)  # before the pixels are loaded (as `image_inputs.shape` reads it)
    if image.mode.startswith("I;16"):
        from PIL import Image

        grey = np.asarray(image).astype(np.float64) / 257.0
        image = Image.fromarray(np.rint(grey).astype(np.uint8))
    if orientation != 1:
        image = image.transpose(_TRANSPOSE[orientation])
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        # Transparency composited onto white, as transformers' processors do (`convert_to_rgb`): Pillow's
        # RGB conversion drops the alpha band, baring whatever colour transparent pixels store (often black).
        from PIL import Image

        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


class image_inputs:  # noqa: N801 - used as a function; a class so that loader workers can pickle it
    """Image files -> ``pixel_values`` with a transformers image processor (RGB, as a viewer shows
    the file: turned by its EXIF orientation, transparency over white, 16-bit grey scaled to 8 bits).

    Args:
        processor: the encoder's image processor: it resizes, rescales and normalizes.
        fit: ``(patch, min_pixels, max_pixels)``: each image at its own size (`fit_image_size`),
            the processor resizing it to that size instead of its configured square (no crop, no
            padding to a square);
            the call then returns one ``[3, H_i, W_i]`` tensor per path. None: one size for all.
    """

    def __init__(self, processor: Any, fit: tuple[int, int, int] | None = None) -> None:
        self.processor, self.fit = processor, fit

    def shape(self, path: str) -> tuple[int, int, int]:
        """The input shape of image `path` under `fit`, from its header (no pixels decoded)."""
        from PIL import Image

        try:
            with Image.open(path) as image:
                width, height = image.size
                if _orientation(image) >= 5:  # shown turned a quarter: its sides swap
                    width, height = height, width
        except OSError as e:
            raise DataError(f"{path}: not an image Pillow reads ({e})") from None
        except Image.DecompressionBombError as e:  # not an OSError: it would name neither sample nor file
            raise DataError(f"{path}: Pillow refuses to open it ({e}); downscale the image, or raise "
                            "PIL.Image.MAX_IMAGE_PIXELS (None: no limit) in the process that reads the data") from None
        return (3, *fit_image_size(height, width, *self.fit))

    def __call__(self, paths: list[str]) -> torch.Tensor | list[torch.Tensor]:
        from PIL import Image

        images = []
        for path in paths:
            with Image.open(path) as image:
                images.append(_shown_rgb(image))
        return self.pixels(images)

    def pixels(self, images: list[Any]) -> torch.Tensor | list[torch.Tensor]:
        """RGB PIL images -> ``[N, 3, H, W]``, or with `fit` one ``[3, H_i, W_i]`` per image."""
        if self.fit is None:
            return self.processor(images=images, return_tensors="pt")["pixel_values"].float()
        out = []
        # nor padded (LlavaImageProcessor pads to a square first: the image would be squeezed into its size)
        unpadded = {"do_pad": False} if getattr(self.processor, "do_pad", False) else {}
        for image in images:
            h, w = fit_image_size(image.height, image.width, *self.fit)
            pixels = self.processor(images=[image], size={"height": h, "width": w}, do_resize=True,
                                    do_center_crop=False, return_tensors="pt", **unpadded)["pixel_values"]
            out.append(pixels[0].float())
        return out


def sample_frames(num_frames: int, rate: float, fps: float, max_frames: int) -> list[int]:
    """Indices of the frames taken from a clip of `num_frames` frames at `rate` frames a second:
    one every ``1 / fps`` seconds from the first (``k * rate / fps``, rounded down), as many as
    start within the clip; when that is more than `max_frames`, `max_frames` spread uniformly over
    the clip instead (``k * num_frames / max_frames``). Never a frame twice (an `fps` above
    `rate` takes every frame). Exact (rational) arithmetic: a 2 s clip at 25 fps sampled at 2 fps
    gives frames 0, 12, 25, 37 (12.5 rounded down)."""
    if num_frames < 1:
        return []
    # (a rate below 2^-21 would round to 0: kept exact)
    rate_q, fps_q = (Fraction(x).limit_denominator(1 << 20) or Fraction(x) for x in (rate, fps))
    step = max(rate_q / fps_q, Fraction(num_frames, max_frames), Fraction(1))
    count = min(max_frames, math.ceil(num_frames / step))
    return [math.floor(k * step) for k in range(count)]


def _duration_tag(metadata: Mapping[str, str]) -> float | None:
    """Seconds in a stream's ``DURATION`` tag (``HH:MM:SS.fraction``: Matroska, WebM), else None."""
    for key, value in metadata.items():
        if key.upper().split("-")[0] == "DURATION":
            parts = str(value).strip().split(":")
            try:
                seconds = sum(float(p) * 60 ** i for i, p in enumerate(reversed(parts))) if len(parts) <= 3 else -1
            except ValueError:
                continue
            if seconds > 0:
                return seconds
    return None


_TURNS = {1: 2, 2: 3, 3: 4}
"""Quarter turns counter-clockwise -> the `PIL.Image.Transpose` (ROTATE_90, _180, _270) that makes them."""


def _turns(frame: Any) -> int:
    """Quarter turns counter-clockwise a player gives a decoded video frame: its stream's display
    matrix (a phone's portrait clip is stored landscape with one), as PyAV reads it."""
    return round(getattr(frame, "rotation", 0) / 90) % 4


def _shown_frame(frame: Any) -> Any:
    """A decoded video frame as an RGB PIL image, turned as a player shows it (`_turns`)."""
    image, turns = frame.to_image(), _turns(frame)
    return image.transpose(_TURNS[turns]) if turns else image


class video_inputs:  # noqa: N801 - used as a function; a class so that loader workers can pickle it
    """Video files -> each clip's sampled frames ``[F, 3, H, W]`` through an image processor, with
    PyAV: frames at `fps` up to `max_frames` (`sample_frames`), their count from the container's
    header (the video stream's frame count and average rate; a container that records no frame
    count, or fewer frames in its duration than it counts, as an edit list hiding the frames
    before a cut does: the video stream's duration times the rate, read from the Matroska / WebM
    tag of that stream where the stream records none, the container's last), so `shape` decodes
    nothing (under ``images.fit``, a first frame: its display matrix). With
    `temporal_patch` k > 1, every k consecutive frames are stacked along channels into one item:
    ``[ceil(F / k), 3k, H, W]``, the clip's last frame repeated to fill its last stack (as
    Qwen2-VL pads).

    Args:
        images: how a frame becomes pixels (`image_inputs`: the tower's image processor, with its
            `fit` for frames at their own size).
        fps: frames taken per second of video.
        max_frames: the most frames taken from one clip (spread over the clip when more).
        frame_shape: a frame's input shape when the tower takes one size (``(3, S, S)``); None:
            frames at their own size under ``images.fit``.
        temporal_patch: frames per item (a tower with `ViTConfig.temporal_patch`).

    Frames are taken by index at the stream's average rate (a variable-rate clip is sampled as
    if constant), turned as a player shows them (the stream's display matrix, as a phone records
    a portrait clip: its sides swap in `shape` under ``images.fit``).
    A clip that decodes fewer frames than its header counts is broken (an error); when the count
    was estimated from the duration, the last frame decoded stands in.
    """

    def __init__(self, images: image_inputs, fps: float, max_frames: int,
                 frame_shape: tuple[int, ...] | None = None, temporal_patch: int = 1) -> None:
        if not (fps > 0 and math.isfinite(fps)) or max_frames < 1 or temporal_patch < 1:
            raise ValueError(f"video_inputs: fps={fps} must be a finite number > 0, max_frames={max_frames} and "
                             f"temporal_patch={temporal_patch} >= 1")
        self.images, self.fps, self.max_frames, self.frame_shape = images, fps, max_frames, frame_shape
        self.temporal_patch = temporal_patch

    @staticmethod
    def _header(container: Any, path: Any) -> tuple[Any, int, float, bool]:
        """(the video stream, its frames, frames a second, whether the count is exact)."""
        if not container.streams.video:
            raise DataError(f"{path}: holds no video stream")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        if not rate:
            raise DataError(f"{path}: its video stream records no frame rate")
        if stream.frames:
            # A clip cut without re-encoding (ffmpeg -ss ... -c copy) holds the frames before the cut its
            # first frame is decoded from, hidden by an edit list: the frame count holds them, the
            # duration (and the decoder's output) does not. Fewer frames in the duration: those are shown.
            if stream.duration is not None and stream.time_base:
                shown = round(float(stream.duration * stream.time_base) * float(rate))
                if 0 < shown < stream.frames:
                    return stream, shown, float(rate), False
            return stream, int(stream.frames), float(rate), True
        if stream.duration is not None and stream.time_base:
            seconds = float(stream.duration * stream.time_base)
        elif (tagged := _duration_tag(stream.metadata)) is not None:
            # Matroska / WebM record no stream duration, but each stream's own in a tag; the
            # container's is its longest stream's (an audio track outlasting the video).
            seconds = tagged
        elif container.duration is not None:
            seconds = container.duration / 1_000_000  # av.time_base
        else:
            raise DataError(f"{path}: its header records neither a frame count nor a duration")
        return stream, max(1, round(seconds * float(rate))), float(rate), False

    def indices(self, path: Any) -> list[int]:
        """The frames of `path` taken (`sample_frames`), from its header."""
        import av

        try:
            with av.open(path) as container:
                _, frames, rate, _ = self._header(container, path)
        except av.FFmpegError as e:
            raise DataError(f"{path}: not a video PyAV reads ({e})") from None
        return sample_frames(frames, rate, self.fps, self.max_frames)

    def shape(self, path: Any) -> tuple[int, ...]:
        """The input shape ``(F, 3, H, W)`` of clip `path`, from its header (nothing decoded)."""
        import av

        try:
            with av.open(path) as container:
                stream, frames, rate, _ = self._header(container, path)
                height, width = stream.codec_context.height, stream.codec_context.width
                if self.frame_shape is None and self._quarter_turned(container, stream):
                    height, width = width, height  # shown turned a quarter: its sides swap
        except av.FFmpegError as e:
            raise DataError(f"{path}: not a video PyAV reads ({e})") from None
        k = self.temporal_patch
        items = -(-len(sample_frames(frames, rate, self.fps, self.max_frames)) // k)
        if self.frame_shape is not None:
            return (items, self.frame_shape[0] * k, *self.frame_shape[1:])
        return (items, 3 * k, *fit_image_size(height, width, *self.images.fit))

    @staticmethod
    def _quarter_turned(container: Any, stream: Any) -> bool:
        """Whether a player shows the clip turned a quarter (its display matrix, which PyAV gives
        on decoded frames only: the first frame decoded; a clip that does not decode fails later,
        where its frames are decoded, and counts as not turned here)."""
        try:
            first = next(container.decode(stream), None)
        except Exception:  # noqa: BLE001 - named where the frames are decoded
            return False
        return first is not None and _turns(first) % 2 == 1

    def frames(self, path: Any) -> list[Any]:
        """The sampled frames of `path` as RGB PIL images, turned as a player shows them (the
        stream's display matrix: a phone's portrait clip)."""
        import av

        with av.open(path) as container:
            stream, frames, rate, exact = self._header(container, path)
            wanted = sample_frames(frames, rate, self.fps, self.max_frames)
            taken: dict[int, Any] = {}
            last = None
            for i, frame in enumerate(container.decode(stream)):
                last = frame
                if i in wanted:
                    taken[i] = _shown_frame(frame)
                if i >= wanted[-1]:
                    break
        missing = [i for i in wanted if i not in taken]
        if missing and (exact or last is None):
            raise DataError(f"{path}: decoded {i + 1 if last is not None else 0} frames but its header counts "
                            f"{frames} (frame {missing[0]} is missing): a truncated or broken clip")
        return [taken[i] if i in taken else _shown_frame(last) for i in wanted]

    def __call__(self, paths: list[Any]) -> list[torch.Tensor]:
        out, k = [], self.temporal_patch
        for path in paths:
            pixels = self.images.pixels(self.frames(path))
            pixels = torch.stack(pixels) if isinstance(pixels, list) else pixels  # [F, C, H, W]
            if k > 1:
                pad = -len(pixels) % k
                pixels = torch.cat([pixels, pixels[-1:].expand(pad, *pixels.shape[1:])])
                pixels = pixels.reshape(len(pixels) // k, k * pixels.shape[1], *pixels.shape[2:])
            out.append(pixels)
        return out


_PCM_SUBFORMAT = bytes.fromhex("0100" "0000000010008000" "00aa00389b71")  # KSDATAFORMAT_SUBTYPE_PCM


def _wav(path: str | BinaryIO, read: bool) -> tuple[int, int, int, int, bytes]:
    """A PCM WAV file's (sample rate, bytes a sample, channels, frames, and, when `read`, the
    sample bytes). DataError when it is none (or missing). Python's `wave` reads it, but before
    Python 3.12 it refuses WAVE_FORMAT_EXTENSIBLE, which ffmpeg and sox write for more than two
    channels or more than 16 bits even when the samples are plain PCM: those `_extensible_wav` reads."""
    try:
        try:
            with wave.open(path, "rb") as f:
                frames = f.getnframes()
                return (f.getframerate(), f.getsampwidth(), f.getnchannels(), frames,
                        f.readframes(frames) if read else b"")
        except wave.Error as e:
            # WAVE_FORMAT_EXTENSIBLE: its tag before Python 3.12; from 3.12 on, the PCM ones read and
            # the others raise "unknown extended format", read here too so that every Python names them alike
            if "65534" not in str(e) and "extended format" not in str(e):
                raise
            return _extensible_wav(path, read)
    except (wave.Error, EOFError, OSError, struct.error) as e:  # OSError: a file missing
        raise DataError(f"{path}: not a PCM WAV file ({e})") from None


def _extensible_wav(path: str | BinaryIO, read: bool) -> tuple[int, int, int, int, bytes]:
    """`_wav` of a WAVE_FORMAT_EXTENSIBLE file, from its RIFF chunks: its subformat must be PCM."""
    f = open(path, "rb") if isinstance(path, (str, os.PathLike)) else path
    try:
        f.seek(0)
        head = f.read(12)
        if head[:4] != b"RIFF" or head[8:] != b"WAVE":
            raise wave.Error("no RIFF WAVE header")
        fmt = None
        while True:
            chunk = f.read(8)
            if len(chunk) < 8:
                raise wave.Error("no data chunk")
            kind, size = chunk[:4], int.from_bytes(chunk[4:], "little")
            if kind == b"data" and fmt is not None:
                break
            if kind == b"fmt ":
                fmt = f.read(size)
            else:
                f.seek(size, os.SEEK_CUR)
            f.seek(size % 2, os.SEEK_CUR)  # chunks are padded to an even size
        channels, rate, _, align, bits = struct.unpack("<HIIHH", fmt[2:16])
        if len(fmt) < 40 or fmt[24:40] != _PCM_SUBFORMAT:
            raise wave.Error(f"unknown format: 65534 with subformat {fmt[24:26].hex()} (not PCM)")
        if not channels or not align:  # `wave`'s own check: no frames to count
            raise wave.Error(f"bad # of channels ({channels}) or block align ({align})")
        frames = size // align
        return rate, (bits + 7) // 8, channels, frames, f.read(frames * align) if read else b""
    finally:
        if f is not path:
            f.close()


def _read_wav(path: str | BinaryIO) -> tuple[torch.Tensor, int]:
    """A PCM WAV file as mono float samples in [-1, 1] and its sample rate."""
    rate, width, channels, frames, raw = _wav(path, read=True)
    dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}.get(width)
    if dtype is None:
        raise DataError(f"{path}: {8 * width}-bit samples; use 8, 16 or 32-bit PCM")
    # A WAV of no samples is a valid (empty) clip, which torch.frombuffer refuses as a buffer.
    samples = torch.frombuffer(bytearray(raw), dtype=dtype).float() if raw else torch.zeros(0)
    if width == 1:
        samples = samples - 128.0
    samples = samples / float(2 ** (8 * width - 1))
    return samples.reshape(-1, channels).mean(1), rate


class audio_inputs:  # noqa: N801 - used as a function; a class so that loader workers can pickle it
    """WAV files -> log-mel ``input_features`` with a transformers (Whisper) feature extractor;
    a file at another sample rate than the extractor's is refused by name.

    Args:
        feature_extractor: the encoder's feature extractor (padding every clip to its chunk).
        max_samples: each clip at its own length, cut after this many samples (and a clip
            shorter than the extractor's window zero-padded to it), ``hop_length`` samples a
            frame; the call then returns one ``[n_mels, T_i]`` tensor per path. None: every clip
            padded to the extractor's chunk.
    """

    def __init__(self, feature_extractor: Any, max_samples: int | None = None) -> None:
        self.feature_extractor, self.max_samples = feature_extractor, max_samples

    def _span(self, num_samples: int) -> int:
        """Samples of a clip of `num_samples` once cut to `max_samples` and padded to one window."""
        fe = self.feature_extractor
        shortest = max(fe.hop_length, fe.n_fft // 2 + 1)  # the centred STFT's reflection needs this much
        return max(shortest, min(num_samples, self.max_samples))

    def _check_rate(self, path: str, rate: int) -> None:
        if rate != self.feature_extractor.sampling_rate:
            raise DataError(f"{path}: sampled at {rate} Hz but the feature extractor takes "
                            f"{self.feature_extractor.sampling_rate} Hz; resample the file")

    def shape(self, path: str) -> tuple[int, int]:
        """The input shape of clip `path` under `max_samples`, from its header (no samples read)."""
        rate, _, _, frames, _ = _wav(path, read=False)
        self._check_rate(path, rate)
        fe = self.feature_extractor
        return (fe.feature_size, self._span(frames) // fe.hop_length)

    def __call__(self, paths: list[str]) -> torch.Tensor | list[torch.Tensor]:
        fe = self.feature_extractor
        clips = []
        for path in paths:
            samples, rate = _read_wav(path)
            self._check_rate(path, rate)
            clips.append(samples)
        if self.max_samples is None:
            return fe([c.numpy() for c in clips], sampling_rate=fe.sampling_rate,
                      return_tensors="pt")["input_features"].float()
        out = []
        for clip in clips:
            span = self._span(len(clip))
            clip = torch.nn.functional.pad(clip[:span], (0, span - min(span, len(clip))))
            features = fe(clip.numpy(), sampling_rate=fe.sampling_rate, padding="longest", truncation=False,
                          return_tensors="pt")["input_features"]
            out.append(features[0].float())
        return out


# ---------------------------------------------------------------------------- the dataset


def shared_modalities(modalities: Mapping[str, str]) -> dict[str, list[str]]:
    """Each modality that several encoders take, with their names (`modalities`: encoder name ->
    modality): a sample's placeholders of a modality, and its items, go to one encoder."""
    by_modality: dict[str, list[str]] = {}
    for name, modality in modalities.items():
        by_modality.setdefault(modality, []).append(name)
    return {m: names for m, names in sorted(by_modality.items()) if len(names) > 1}


def _check_media(media: Mapping[str, MediaSpec], tokenizer: Any) -> None:
    """DataError, when a dataset is built, for `media` no sample could be read with: a modality
    of no placeholder, two encoders of one modality (a sample's <image> placeholders, and its
    "image" items, go to one encoder), or a spec whose special_token_id is none of the tokens the
    tokenizer makes of its placeholder, alone or within text (each sample's count of it is
    checked as it is read). Each would otherwise be found only in the first sample
    holding such an item, and named as that sample's fault (its placeholders "not" its items)."""
    for name, spec in media.items():
        if spec.modality not in PLACEHOLDERS:
            raise DataError(f"media[{name!r}]: modality {spec.modality!r} is none of {sorted(PLACEHOLDERS)} (the "
                            "samples' keys of item paths, and the placeholders <image>, <audio>, <video>)")
    if shared := shared_modalities({n: spec.modality for n, spec in media.items()}):
        modality, names = next(iter(shared.items()))
        raise DataError(f"media: encoders {names} all take {modality!r} items, but each {PLACEHOLDERS[modality]} "
                        f"placeholder of a sample (and each path of its {modality!r} list) goes to one encoder; "
                        "give each modality one MediaSpec")
    for name, spec in media.items():
        placeholder = PLACEHOLDERS[spec.modality]
        ids = tokenizer(placeholder, add_special_tokens=False)["input_ids"]
        # also within text: a vocabulary may hold the placeholder only with its leading space
        within = tokenizer(f"a {placeholder} a", add_special_tokens=False)["input_ids"]
        if spec.special_token_id not in (*ids, *within):
            raise DataError(f"media[{name!r}]: special_token_id = {spec.special_token_id}, but the tokenizer makes "
                            f"{placeholder} the token(s) {ids}: the samples' {placeholder} would never be found; "
                            f"add {placeholder} to the tokenizer as a special token and give its id "
                            f"(tokenizer.convert_tokens_to_ids({placeholder!r}))")


class ConversationDataset(Dataset):
    """The samples of a LLaVA conversation file as `MimoBatch` rows of `seq_len` tokens.

    Args:
        path: the JSON / JSONL file (a list of them or a glob) when `samples` is not given.
        tokenizer: a transformers tokenizer with a ``chat_template``, whose vocabulary holds the
            placeholders of `media` as single (added) tokens.
        media: ``{encoder name: MediaSpec}``; the batch's modality names are the encoder names.
        seq_len: row length; 0: the longest sample's (tokenizes every sample once).
        root: media paths are relative to it (default: the first file's directory).
        truncate: cut longer samples at `seq_len` (an item that would be cut is dropped whole)
            instead of raising DataError with the sample id.
        samples: already read samples (`read_samples`), or a `SampleSource` of any format
            (`dtensor_mimo.data.sources.open_source`): read by index when a batch wants them.
        pack: rows hold several samples each (greedy, in an order drawn from `seed`), as
            documents: ``document_ids`` and per-document ``positions`` keep them apart. The
            dataset's indices (`__len__`, `batch`) are then rows; ``dataset[i]`` stays sample i.
        pack_len: the tokens a packed row takes in samples (default `seq_len`): the trainer's
            ``data.seq_len`` before the layout rounds the rows up (cp / tp multiples), so that
            the rows, and a checkpoint's position in them, are the same under every layout.
        cache_samples: tokenized samples kept (the first met; int32 tokens): the rest are
            tokenized again when met again.

    Samples are tokenized (and their media headers read) when a batch first wants them, in the
    process that builds the batch; nothing is read up front but the files' indexes, except with
    `seq_len` 0 or `pack`, which need every sample's length.
    """

    def __init__(self, path: str | Sequence[str], tokenizer: Any, media: Mapping[str, MediaSpec], seq_len: int = 0,
                 root: str | None = None, truncate: bool = False,
                 samples: Sequence[dict[str, Any]] | SampleSource | None = None, pack: bool = False, seed: int = 0,
                 cache_samples: int = CACHE_SAMPLES, pack_len: int | None = None) -> None:
        from dtensor_mimo.data.sources import JsonSource, SampleSource, open_source

        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"the tokenizer ({getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)}) has no "
                            "chat_template; use a chat (instruct) tokenizer or set tokenizer.chat_template")
        self.path, self.tokenizer, self.media = path, tokenizer, dict(media)
        if isinstance(samples, SampleSource):
            self.source = samples
        elif samples is not None:
            first = path if isinstance(path, str) else path[0]
            self.source = JsonSource([first], root if root is not None else os.path.dirname(first), samples=list(samples))
        else:
            self.source = open_source("llava", path, root)
        self.samples = self.source  # sample i's dict as written: self.samples[i]
        self.root = self.source.root
        self.truncate = truncate
        _check_media(self.media, tokenizer)
        self.by_modality = {spec.modality: name for name, spec in self.media.items()}
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = 0 if pad is None else pad
        self.cache_samples = cache_samples
        self._cache: dict[int, _Tokenized] = {}
        self._frame_texts: dict[tuple[str, int], list[int]] = {}
        # The special tokens a template may end a turn with (`_answer_end`): not the placeholders.
        added = getattr(tokenizer, "added_tokens_decoder", {})
        special = {i for i, t in added.items() if getattr(t, "special", False)} | set(tokenizer.all_special_ids)
        self._turn_ends = special - {spec.special_token_id for spec in self.media.values()}
        # (a sample whose media header cannot be read has no length: a batch names or leaves it out)
        self.seq_len = seq_len or max((n for i in range(len(self.samples)) if (n := self._length(i)) is not None),
                                      default=0)
        self.pack = pack
        self.pack_len = min(pack_len or self.seq_len, self.seq_len)
        self.rows = self._pack(seed) if pack else None

    def __len__(self) -> int:
        """Rows: samples, or packed rows of several samples."""
        return len(self.samples) if self.rows is None else len(self.rows)

    def check_lengths(self, limit: int | None = None, skip_media: bool = False) -> int:
        """Tokenize the first `limit` samples (None: all) now: DataError names the first over
        `seq_len` (unless truncating), a placeholder without its item, an unreadable media header
        (`skip_media`: such a sample is passed over, as a batch leaves it out: ``data.skip_bad_media``,
        held-out data). Returns the longest one's token count."""
        count = len(self.samples) if limit is None else min(limit, len(self.samples))
        lengths = (self._length(index) if skip_media else len(self._record(index).tokens) for index in range(count))
        return max((n for n in lengths if n is not None), default=0)

    def _pack(self, seed: int) -> list[list[int]]:
        """Samples in an order drawn from `seed`, each appended to the current row while it fits.
        Every sample's length is needed up front: this tokenizes the whole corpus (in each rank,
        lengths kept as int32), the one whole-corpus pass left (windowed packing would remove it).
        A sample a media header of which cannot be read has no length: it gets a row of its own
        (after the others), which a batch then names or leaves out (``data.skip_bad_media``) as
        it would unpacked, costing no other sample its row."""
        order = torch.randperm(len(self.samples), generator=torch.Generator().manual_seed(seed)).tolist()
        rows: list[list[int]] = []
        alone: list[list[int]] = []
        used = 0
        for index in order:
            n = self._length(index)
            if n is None:
                alone.append([index])
                continue
            if not rows or used + n > self.pack_len:  # (longer than pack_len, up to seq_len: a row of its own)
                rows.append([])
                used = 0
            rows[-1].append(index)
            used += n
        return rows + alone

    def _length(self, index: int) -> int | None:
        """Sample `index`'s token count; None where a media header of it cannot be read (MediaError)."""
        try:
            return len(self._record(index).tokens)
        except MediaError:
            return None

    def _record(self, index: int, blank: bool = False) -> _Tokenized:
        """Sample `index` tokenized: from the cache (the first `cache_samples` met are kept, int32
        tokens, labels rebuilt from the answer spans), else tokenized now. `blank`: a sample a
        media header of which cannot be read (MediaError otherwise) as no tokens and no items: a
        row left out (``data.skip_bad_media``) whose items have no shape to stand in for."""
        record = self._cache.get(index)
        if record is None:
            try:
                record = self._tokenize(index)
            except MediaError:
                if not blank:
                    raise
                return _Tokenized(str(self.samples[index]["id"]), np.zeros(0, dtype=np.int32), (),
                                  {name: () for name in self.media}, {name: [] for name in self.media},
                                  {name: [] for name in self.media})
            if len(self._cache) < self.cache_samples:
                self._cache[index] = record
        return record

    def __getitem__(self, index: int) -> Conversation:
        return self._record(index).conversation()

    # -------------------------------------------------------------- tokenization
    def _render(self, messages: list[dict[str, str]], generation_prompt: bool, sid: str) -> str:
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template's refusal (jinja's raise_exception: a TemplateError)
            raise DataError(f"{self.source.describe()}: sample {sid!r}: the tokenizer's chat template refuses it "
                            f"({type(e).__name__}: {e}); give the sample turns the template takes (roles, their "
                            "order) or use another template") from None
        return text

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _answer_start(self, prompt: list[int], upto: list[int]) -> int:
        """Where the answer begins in `upto`, the tokens of the conversation through it, whose text
        continues `prompt`'s (the generation prompt's): at `prompt`'s end, unless the tokenizer
        merges the prompt's last characters with the answer's first (Qwen's pre-tokenizer makes one
        token of ChatML's "\\n" and an answer's leading "\\n"): then at the first token that
        reaches into the answer, as transformers' assistant mask has it."""
        start = next((j for j, (a, b) in enumerate(zip(prompt, upto)) if a != b), len(prompt))
        if start < len(prompt):
            shown = self.tokenizer.decode(prompt)
            while start < len(upto) and shown.startswith(self.tokenizer.decode(upto[:start + 1])):
                start += 1
        return start

    def _tokenize(self, index: int) -> _Tokenized:
        """Token ids with each placeholder expanded, labels on the assistant tokens."""
        sample = self.samples[index]
        sid = str(sample["id"])
        # Checked ahead for the first samples only (`check_samples`); an encoder's own items are counted below.
        check_turns(sample, self.source.describe())
        check_modalities(self.source, index, sample, self.by_modality, self.source.describe())
        messages = [{"role": ROLES[t["from"]], "content": t["value"]} for t in sample["conversations"]]
        text = self._render(messages, False, sid)
        ids = self._ids(text)
        assistant = [False] * len(ids)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, through = self._render(messages[:i], True, sid), self._render(messages[:i + 1], False, sid)
            prompt, upto = self._ids(before), self._ids(through)
            if not through.startswith(before) or not text.startswith(through) or ids[:len(upto)] != upto:
                raise DataError(f"{self.source.describe()}: sample {sid!r}: the chat template does not render a "
                                "conversation as its turns one after another (a prefix renders otherwise, e.g. a "
                                "template that renders the last assistant turn unlike earlier ones), so the "
                                "assistant tokens cannot be found")
            start = self._answer_start(prompt, upto)
            end = self._answer_end(upto, start)
            for t in range(start, end):
                assistant[t] = True
        items = {name: self.source.media(index, sample, self.media[name].modality) for name in self.media}
        shapes: dict[str, list[tuple[int, ...]]] = {name: [] for name in items}
        for name, paths in items.items():
            for path in paths:
                try:
                    shapes[name].append(self._item_shape(name, path))
                except DataError as e:  # a header that cannot be read: every rank tokenizes, every rank meets it
                    raise MediaError(f"sample {sid!r}: {e}", sample_id=sid, path=path, reason=str(e)) from None
        sizes = {name: [self._item_tokens(sid, name, shape) for shape in found] for name, found in shapes.items()}
        # Expand placeholders: item k's token -> as many copies of the encoder's id as it gives rows
        # (a clip's: each frame's rows after its frame_text).
        tokens: list[int] = []
        is_answer: list[bool] = []
        starts: dict[str, list[int]] = {name: [] for name in self.media}
        spans: dict[str, list[int]] = {name: [] for name in self.media}  # tokens from an item's start
        ids_of = {spec.special_token_id: name for name, spec in self.media.items()}
        for token, answer in zip(ids, assistant):
            name = ids_of.get(token)
            if name is None:
                tokens.append(token)
                is_answer.append(answer)
                continue
            k = len(starts[name])
            starts[name].append(len(tokens))
            n = sizes[name][k] if k < len(sizes[name]) else 1  # too many placeholders: refused below
            if self.media[name].frame_text and k < len(shapes[name]):
                frames = shapes[name][k][0]
                for f in range(frames):
                    tokens += self._frame_text(name, f) + [token] * (n // frames)
            else:
                tokens += [token] * n
            spans[name].append(len(tokens) - starts[name][-1])
            is_answer += [False] * spans[name][-1]
        for name, found in starts.items():
            if len(found) != len(items[name]):  # (the launcher checks only the first samples: `check_samples`)
                modality = self.media[name].modality
                placeholder = PLACEHOLDERS[modality]
                raise DataError(f"{self.source.describe()}: sample {sid!r} has {len(found)} {placeholder} "
                                f"placeholder(s) (in its turns as the chat template renders them) but "
                                f"{len(items[name])} {modality} item(s); put one {placeholder} in the text where "
                                "each item goes")
        limit = getattr(self, "seq_len", 0)
        answer_cut = False
        if limit and len(tokens) > limit:
            if not self.truncate:
                raise DataError(f"sample {sid!r} has {len(tokens)} tokens, more than data.seq_len = {limit}; "
                                "raise data.seq_len, or set data.truncate = true to cut it")
            cut = limit  # an item cut in two is dropped whole (items never overlap: one can be)
            for name, found in starts.items():
                cut = min([cut] + [s for s, n in zip(found, spans[name]) if s < cut < s + n])
            for name, found in starts.items():
                kept = sum(1 for s, n in zip(found, spans[name]) if s + n <= cut)
                items[name], shapes[name], sizes[name] = items[name][:kept], shapes[name][:kept], sizes[name][:kept]
            answer_cut = cut > 0 and is_answer[cut - 1] and is_answer[cut]  # its end of turn is gone
            tokens, is_answer = tokens[:cut], is_answer[:cut]
        answers, t = [], 0
        while t < len(is_answer):
            if is_answer[t]:
                start = t
                while t < len(is_answer) and is_answer[t]:
                    t += 1
                answers.append((start, t))
            else:
                t += 1
        return _Tokenized(sid, np.asarray(tokens, dtype=np.int32), tuple(answers),
                          {n: tuple(ps) for n, ps in items.items()}, shapes, sizes, answer_cut)

    def _answer_end(self, upto: list[int], start: int) -> int:
        """Where the answer rendered as ``upto[start:]`` ends: through its end-of-turn token, not the
        separator the template puts after it. That token is the eos where the answer holds it;
        else a special token the whitespace at the end follows (a base tokenizer's eos is not the
        template's: Qwen's <|endoftext|> against ChatML's "<|im_end|>\\n"); else the whole of it."""
        eos = self.tokenizer.eos_token_id
        if eos is not None and eos in upto[start:]:
            return len(upto) - upto[::-1].index(eos)
        end = len(upto)
        while (end > start and upto[end - 1] not in self._turn_ends
               and not self.tokenizer.decode(upto[end - 1:end]).strip()):
            end -= 1  # whitespace after the answer's last special token
        return end if end > start and upto[end - 1] in self._turn_ends else len(upto)

    def _frame_text(self, name: str, frame: int) -> list[int]:
        """The token ids of encoder `name`'s frame_text for frame `frame` (from 0), cached."""
        if (name, frame) not in self._frame_texts:
            text = self.media[name].frame_text.format(frame=frame + 1)
            self._frame_texts[name, frame] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._frame_texts[name, frame]

    def _item_shape(self, name: str, path: str) -> tuple[int, ...]:
        """Encoder input shape of one item (its file's header when items have their own sizes)."""
        spec = self.media[name]
        return spec.shape_of(self.source.open(path)) if spec.varied else spec.item_shape

    def _item_tokens(self, sid: str, name: str, shape: tuple[int, ...]) -> int:
        spec = self.media[name]
        if not spec.varied:
            return spec.tokens_per_item
        try:
            return spec.rows_of(shape)
        except ValueError as e:
            raise DataError(f"sample {sid!r}: {name!r}: {e}") from None

    # -------------------------------------------------------------- batches
    def batch(self, indices: Sequence[int], load: Mapping[str, Iterable[int]] | None = None,
              left_out: Collection[int] = ()) -> MimoBatch:
        """The global batch of samples `indices`, rows padded to `seq_len`.

        Args:
            load: ``{encoder name: positions in the batch}`` whose media to read and preprocess;
                every other item's input is zeros (a stride-0 view, no memory, when none is
                read). None: everything. ``{}``: token rows and item counts only.
            left_out: positions in the batch left out of the step (``data.skip_bad_media``): a
                sample there whose media header cannot be read is built as no tokens, no items
                (elsewhere MediaError names it, with its position as ``row``).
        """
        members = [[i] for i in indices] if self.rows is None else [self.rows[i] for i in indices]
        return self._batch(self._records(members, left_out), load, packed=self.rows is not None)

    def _records(self, members: list[list[int]], left_out: Collection[int]) -> list[list[_Tokenized]]:
        """Each row's samples tokenized (`_record`); MediaError of a row not `left_out` carries its position."""
        rows = []
        for row, indices in enumerate(members):
            try:
                rows.append([self._record(i, blank=row in left_out) for i in indices])
            except MediaError as e:
                raise MediaError(str(e), row, e.sample_id, e.path, e.reason) from None
        return rows

    def prompts(self, indices: Sequence[int], load: Mapping[str, Iterable[int]] | None = None,
                left_out: Collection[int] = ()) -> MimoBatch:
        """Samples `indices` cut where their first answer starts, with only the items before it:
        what greedy generation starts from (a later turn's items go with its tokens). `left_out`:
        as for `batch`."""
        cut = []
        for [s] in self._records([[i] for i in indices], left_out):
            stop = s.answers[0][0] if s.answers else len(s.tokens)
            kept = {}
            for name, spec in self.media.items():  # whole items only: an answer never starts inside one
                before = sum(1 for t in s.tokens[:stop] if t == spec.special_token_id)
                kept[name] = sum(1 for end in accumulate(s.item_tokens[name]) if end <= before)
            cut.append([Conversation(s.id, s.tokens[:stop], [IGNORE_INDEX] * stop,
                                     {n: s.items[n][:k] for n, k in kept.items()}, [],
                                     {n: s.item_shapes[n][:k] for n, k in kept.items()},
                                     {n: s.item_tokens[n][:k] for n, k in kept.items()})])
        return self._batch(cut, load, packed=False)

    def _batch(self, rows: list[list[Conversation | _Tokenized]], load: Mapping[str, Iterable[int]] | None,
               packed: bool) -> MimoBatch:
        """Rows of one or more conversations each (documents), padded to `seq_len`."""
        shape = (len(rows), self.seq_len)
        tokens = torch.full(shape, self.pad_id, dtype=torch.int64)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.int64)
        documents = torch.zeros(shape, dtype=torch.int64)
        positions = torch.zeros(shape, dtype=torch.int64)
        samples = []  # per row: its conversations' items, in row order
        for row, members in enumerate(rows):
            start = 0
            for doc, s in enumerate(members):
                end = start + len(s.tokens)
                tokens[row, start:end] = torch.as_tensor(np.asarray(s.tokens, dtype=np.int64))
                labels[row, start:end] = torch.as_tensor(np.asarray(s.labels, dtype=np.int64))
                documents[row, start:end] = doc
                positions[row, start:end] = torch.arange(len(s.tokens))
                start = end
            documents[row, start:] = len(members)  # the padding: a document of its own
            positions[row, start:] = torch.arange(self.seq_len - start)
            samples.append({name: [p for s in members for p in s.items[name]] for name in self.media})
        modalities = {}
        for name, spec in self.media.items():
            counts = [len(items[name]) for items in samples]
            wanted = set(range(len(rows)) if load is None else load.get(name, ()))
            try:
                if spec.frames:  # each clip's frames are the encoder's items
                    inputs, tokens_per_item, counts = self._frame_inputs(name, samples, rows, wanted)
                elif spec.varied:  # one tensor and one row count per item
                    shapes = [[shape for s in members for shape in s.item_shapes[name]] for members in rows]
                    inputs: torch.Tensor | list[torch.Tensor] = self._varied_inputs(name, samples, shapes, wanted)
                    tokens_per_item: int | tuple[int, ...] = tuple(n for members in rows for s in members
                                                                   for n in s.item_tokens[name])
                else:
                    inputs, tokens_per_item = self._inputs(name, samples, counts, wanted), spec.tokens_per_item
            except MediaError as e:  # which sample: the first wanted row holding the file
                row = next(i for i in sorted(wanted) if e.path in samples[i][name])
                sid = next(c.id for c in rows[row] if e.path in c.items[name])
                raise MediaError(f"{self.path}: sample {sid!r}: cannot decode its {spec.modality} file {e.path} "
                                 f"({e.reason})", row, sid, e.path, e.reason) from e.__cause__
            modalities[name] = ModalityInputs(inputs=inputs, items_per_sample=tuple(counts),
                                              tokens_per_item=tokens_per_item,
                                              special_token_id=spec.special_token_id)
        return MimoBatch(tokens, labels, labels != IGNORE_INDEX, modalities,
                         document_ids=documents if packed else None, positions=positions if packed else None)

    def _frame_inputs(self, name: str, samples: list[dict[str, list[str]]], rows: list[list[Conversation | _Tokenized]],
                      wanted: set[int]) -> tuple[torch.Tensor | list[torch.Tensor], int | tuple[int, ...], list[int]]:
        """A frames spec's encoder items: every clip's frames in order (the wanted rows' decoded,
        the others zeros), their rows and each row's frame count. A tower of one frame size gets
        one ``[frames, C, H, W]`` tensor and one row count, else one tensor and count per frame."""
        spec = self.media[name]
        shapes = [[shape for s in members for shape in s.item_shapes[name]] for members in rows]
        counts = [sum(shape[0] for shape in row) for row in shapes]
        if spec.item_shape:  # frames of one size
            if not any(samples[i][name] for i in wanted):
                return torch.zeros(()).expand(sum(counts), *spec.item_shape), spec.tokens_per_item, counts
            clips = self._varied_inputs(name, samples, shapes, wanted)
            inputs = torch.cat(clips) if clips else torch.zeros(0, *spec.item_shape)
            return inputs, spec.tokens_per_item, counts
        clips = self._varied_inputs(name, samples, shapes, wanted)
        frames = [frame for clip in clips for frame in clip.unbind(0)]
        tokens = tuple(spec.tokens_for(shape[1:]) for row in shapes for shape in row for _ in range(shape[0]))
        return frames, tokens, counts

    def _varied_inputs(self, name: str, rows: list[dict[str, list[str]]], shapes: list[list[tuple[int, ...]]],
                       wanted: set[int]) -> list[torch.Tensor]:
        """One tensor per item, rows in order: the wanted rows' loaded, the others zeros of their
        item's shape (stride-0 views, no memory)."""
        spec = self.media[name]
        paths = [p for i, items in enumerate(rows) if i in wanted for p in items[name]]
        loaded = iter(self._prepare(spec, paths) if paths else [])
        out = []
        for i, items in enumerate(rows):
            for path, shape in zip(items[name], shapes[i]):
                if i not in wanted:
                    out.append(torch.zeros(()).expand(*shape))
                    continue
                item = next(loaded)
                if tuple(item.shape) != tuple(shape):  # the file (data.skip_bad_media applies), or the config
                    reason = (f"the processor turns it into {list(item.shape)} but its header gave {list(shape)}, "
                              "which the token row counts its rows from: a truncated or inconsistent file (or, "
                              "if every file does this, the processor config)")
                    raise MediaError(f"{name!r}: {path}: {reason}", path=path, reason=reason)
                out.append(item)
        return out

    def _prepare(self, spec: MediaSpec, paths: list[str]) -> torch.Tensor | list[torch.Tensor]:
        """``spec.prepare`` of the files at `paths`; when it fails, each path alone finds the file it
        failed on: MediaError with its path and the reason (`_batch` adds the sample). Where each
        decodes alone (a processor whose outputs differ in shape cannot batch them), one input per
        path, a list: the caller judges each item's shape."""
        try:
            return spec.prepare([self.source.open(p) for p in paths])
        except Exception:  # noqa: BLE001 - a decoder raises what it likes (OSError, SyntaxError, ...)
            alone = []
            for path in paths:
                try:
                    alone.append(spec.prepare([self.source.open(path)])[0])
                except Exception as e:  # noqa: BLE001
                    raise MediaError(f"cannot decode {path} ({e})", path=path,
                                     reason=f"{type(e).__name__}: {e}") from e
            return alone

    def _inputs(self, name: str, rows: list[dict[str, list[str]]], counts: list[int], wanted: set[int]) -> torch.Tensor:
        spec = self.media[name]
        total = sum(counts)
        paths = [p for i, items in enumerate(rows) if i in wanted for p in items[name]]
        if not paths:
            return torch.zeros(()).expand(total, *spec.item_shape)
        loaded = self._prepare(spec, paths)
        for path, item in zip(paths, loaded):  # a file's (data.skip_bad_media applies, every rank learns of it)
            if tuple(item.shape) != spec.item_shape:
                reason = (f"the processor turns it into {list(item.shape)} but the encoder takes "
                          f"{list(spec.item_shape)}: a file unlike the others (or, if every file does this, the "
                          "processor config: give it the encoder's input size)")
                raise MediaError(f"{name!r}: {path}: {reason}", path=path, reason=reason)
        if isinstance(loaded, list):
            loaded = torch.stack(loaded)
        if len(paths) == total:
            return loaded
        out = torch.zeros(total, *spec.item_shape)
        start, taken = 0, 0
        for i, count in enumerate(counts):
            if i in wanted:
                out[start:start + count] = loaded[taken:taken + count]
                taken += count
            start += count
        return out

    # -------------------------------------------------------------- evaluation
    def answer_text(self, index: int) -> str:
        """The first answer of sample `index`, as text (special tokens dropped)."""
        start, stop = self[index].answers[0]
        return self.tokenizer.decode(self[index].tokens[start:stop], skip_special_tokens=True).strip()
