"""The trainer's typed configuration: dataclasses, TOML files, dotted command-line overrides.

Pure logic, no process group: a config is parsed and checked (keys, types, accepted values, that
the layout is valid and fits the world, that batch sizes divide) before any process starts.

    python -m dtensor_mimo.train --config examples/llava_tiny.toml --train.steps 40 \
        --layout.language.tp 2 --checkpoint.dir ckpt --checkpoint.every 20 --metrics.jsonl m.jsonl

Modules have the names the user gives them: ``[model.encoders.<name>]`` declares an encoder,
``[layout.<name>]`` and ``[options.<name>]`` set its layout and `ParallelOptions`; the decoder is
always ``language``. The sections ``options.<module>`` and ``pipeline`` are the library's own
`ParallelOptions` and `PipelineConfig`, not copies of them.

An override's value is read as a TOML value (``40``, ``1e-3``, ``true``, ``"cosine"``,
``[1, 2]``, ``{vision = 1e-4}``); a bare word that is not valid TOML is taken as a string.
With ``data.format = "digits"`` (the default) the digits model and its defaults (`DIGITS`) lie
under whatever the file and the command line set.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

from dtensor_mimo.layout.parallelism import FIELDS, Parallelism
from dtensor_mimo.layout.world import warn_once
from dtensor_mimo.optim.optimizer import AdamWConfig, LRSchedule
from dtensor_mimo.parallelize.options import ParallelOptions
from dtensor_mimo.schedule.config import PipelineConfig, check_pipeline_layout, stage_layers

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

LANGUAGE = "language"
"""The decoder's module name (layout, options, checkpoints)."""


class ConfigError(ValueError):
    """A config key or value the trainer cannot use; the message names the key and the fix."""


# ---------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class ModuleLayout(Parallelism):
    """One module's `Parallelism` (pp, dp, cp, tp) and its first rank.

    Attributes:
        offset: the module's first rank; none: after the previous module's ranks (disjoint).
            Give two modules the same offset and size to colocate them.
    """

    offset: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.offset is not None and (isinstance(self.offset, bool) or self.offset < 0):
            raise ValueError(f"offset must be a rank >= 0, got {self.offset!r}")

    @property
    def parallelism(self) -> Parallelism:
        """The sizes alone (what `MimoLayout` takes)."""
        return Parallelism(**{d: getattr(self, d) for d in FIELDS})


@dataclass
class LayoutConfig:
    """Where each module runs: ``[layout.<module>]`` per module (`ModuleLayout`); a module left out
    gets one rank after the previous module's. Modules are laid out encoders first, in the order
    of ``model.encoders``, then the language model.

    Attributes:
        bridge_hops: how encoder rows cross to the language model and gradients back: none
            chooses per direction (two hops across nodes where the receiving ranks replicate the
            rows), 1 or 2 forces.
        auto: train on the layout planner's first choice (`python -m dtensor_mimo.plan`) for the
            world (under torchrun its size; else the configured layout's), replacing every
            module's layout and pipeline.microbatches; CPU runs on one node (it measures this host).
    """

    modules: dict[str, ModuleLayout] = field(default_factory=dict, metadata={"open": True})
    bridge_hops: Literal[1, 2] | None = None
    auto: bool = False


@dataclass
class LanguageSection:
    """The decoder: a Hugging Face directory, a factory, or the library's `Llama` of these sizes.

    Attributes:
        hf: a Llama-family directory (config.json, safetensors, tokenizer files): built on the
            meta device, each rank reading only its shards.
        factory: "package.module:function" returning a module that follows
            `dtensor_mimo.models.protocol`; called with `factory_args` and whichever of vocab_size,
            seq_len it accepts.
        factory_args: keyword arguments for `factory`.
        dim: the library Llama's width (no hf, no factory).
        n_layers: the library Llama's blocks.
        n_heads: attention heads.
        n_kv_heads: key/value heads (grouped-query attention).
        ffn_hidden: the SwiGLU hidden width.
        seed: init seed of whatever the checkpoint does not fill.
        frozen: the decoder does not train (LLaVA's first stage: only the projections do; its
            backward still carries the rows' gradients to them).
        untie_embeddings: train a tied hf directory's output head (tie_word_embeddings) as a copy
            of the token embedding of its own, as pipeline stages do and runs before 2026-11-29
            did (their checkpoints hold both); default: tied, as transformers trains it.
    """

    hf: str | None = None
    factory: str | None = None
    factory_args: dict[str, Any] = field(default_factory=dict)
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 128
    seed: int = 0
    frozen: bool = False
    untie_embeddings: bool = False


@dataclass
class EncoderSection:
    """One encoder (the table's name is the module's name) and its projection to the decoder.

    Attributes:
        modality: "image", "audio" or "video": which placeholder (<image>, <audio>, <video>) and
            preprocessing its items take; "video": an image tower (SigLIP / CLIP hf or the
            library ViT) run on each sampled frame (data.video_fps, data.video_max_frames).
        hf: a SigLIP / CLIP vision directory, a LLaVA directory (its tower and projector), or a
            Whisper directory (its encoder); its processor config preprocesses the items.
        factory: "package.module:function" returning an encoder that follows
            `dtensor_mimo.models.protocol` (needs `processor` and `tokens_per_item` for data).
        factory_args: keyword arguments for `factory` (also offered: language_dim).
        processor: a directory whose image processor / feature extractor preprocesses the items
            (default: `hf`'s; a library ViT gets a SigLIP-style one for its size, a library audio
            encoder needs one).
        tokens_per_item: rows a factory encoder gives per item.
        feature_layer: a SigLIP / CLIP tower's features come after this many blocks, negative
            from the end (LLaVA's vision_feature_layer); none: -1 for SigLIP, -2 for CLIP.
        frozen: the tower does not train (its projection does; a factory's module is frozen whole
            unless it is a ModalityEncoder, whose encoder is the tower).
        seed: init seed of what the checkpoint does not fill (e.g. a new projection); none: 10 times
            the encoder's place in model.encoders (10, 20, 30 and on), so that no two encoders start
            alike. Two encoders given one seed start with the same weights where their parameters
            are alike (two library ViTs of one size).
        dim: the library tower's width (no hf, no factory).
        n_layers: the library tower's blocks.
        n_heads: attention heads.
        mlp_hidden: the MLP hidden width.
        image_size: the library ViT's square input, pixels (needed on conversation data; digits: 8).
        patch_size: the library ViT's patches, pixels.
        dynamic_resolution: images at their own size (aspect ratio kept; conversation data: resized
            into data.image_min_pixels..image_max_pixels; digits: scans at 8x8, 8x12, 12x8, 12x12),
            each giving (H // patch) * (W // patch) rows, positions interpolated from the tower's
            grid; an image encoder from a SigLIP / CLIP directory or the library ViT.
        max_patches: with dynamic_resolution, the most rows one image may give (0: what
            data.image_max_pixels allows; digits: the largest scan's).
        variable_length: clips at their own length (up to data.audio_max_seconds), each giving
            its own rows, no padding; an audio encoder from a Whisper directory or the library's.
        temporal_patch: a video encoder's frames per item (Qwen2-VL's temporal patch): 2 stacks
            each pair of consecutive frames along channels, so the tower's patch embedding sees
            the motion between them in every patch (a SigLIP / CLIP tower's kernel is repeated
            over the pair and halved: a still pair embeds as one frame) and a pair gives one
            frame's rows; a clip's last frame fills its last pair.
    """

    modality: Literal["image", "audio", "video"] = "image"
    hf: str | None = None
    factory: str | None = None
    factory_args: dict[str, Any] = field(default_factory=dict)
    processor: str | None = None
    tokens_per_item: int = 0
    feature_layer: int | None = None
    frozen: bool = False
    seed: int | None = None
    dim: int = 48
    n_layers: int = 2
    n_heads: int = 4
    mlp_hidden: int = 96
    image_size: int = 0
    patch_size: int = 4
    dynamic_resolution: bool = False
    max_patches: int = 0
    variable_length: bool = False
    temporal_patch: int = 1


@dataclass
class ModelConfig:
    """The modules: ``[model.language]`` and ``[model.encoders.<name>]`` (any number, any names).

    Attributes:
        language: the decoder (`LanguageSection`).
        encoders: the encoders by module name (`EncoderSection`).
    """

    language: LanguageSection = field(default_factory=LanguageSection)
    encoders: dict[str, EncoderSection] = field(default_factory=dict)


@dataclass(frozen=True)
class OptimizerSection(AdamWConfig):
    """The library's `AdamWConfig` for every module (its defaults: lr 3e-4, betas (0.9, 0.95),
    weight decay 0.1 except embeddings, one global clip at 1.0), and per-module learning rates.

    Attributes:
        lr: peak learning rate.
        betas: AdamW's two moment coefficients.
        eps: AdamW's epsilon.
        weight_decay: AdamW's decoupled weight decay.
        no_decay: parameters whose name holds one of these (and every vector) take no weight decay.
        max_grad_norm: clip the global gradient norm to this (none: no clipping).
        module_lr: per-module peak learning rates replacing lr, e.g. {vision = 1e-4}.
    """

    module_lr: dict[str, float] = field(default_factory=dict)

    @property
    def adamw(self) -> AdamWConfig:
        """The config every module without its own lr takes."""
        return AdamWConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(AdamWConfig)})

    def per_module(self) -> dict[str, AdamWConfig]:
        """`MimoOptimizer`'s per_module: the modules of module_lr with their own peak lr."""
        return {name: dataclasses.replace(self.adamw, lr=lr) for name, lr in self.module_lr.items()}


SCHEDULE_HELP = {
    "warmup_steps": "linear warmup; a schedule (total_steps) not longer than that warms up for half of it",
    "warmup_start": ("where the linear warmup starts, over the peak: update n of warmup_steps takes "
                     "warmup_start + (1 - warmup_start) * n / warmup_steps"),
    "decay": "the schedule's shape after warmup, down to min_lr_ratio * lr at total_steps",
    "total_steps": "where the decay ends (none: train.steps)",
    "min_lr_ratio": "the last step's learning rate over the peak",
}
"""``--help`` lines of `LRSchedule`'s keys (the library's docstring is prose)."""


@dataclass
class DataSection:
    """What the model trains on, whatever the source; ``data.format`` chooses the source's own
    section (`DigitsData`, `ConversationData`), whose keys are also under ``[data]``.

    Attributes:
        format: "digits" (the bundled digits task), "llava" (LLaVA conversation JSON / JSONL),
            "webdataset" (tar shards of LLaVA samples and their media) or "hf" (a Hugging Face
            datasets directory, Parquet or Arrow files).
        seq_len: token row length (0: the longest sample's, for conversations only when the corpus
            has at most 256 samples; digits: at least the longest sample's, a shorter one is raised
            to it; rounded up for cp / sp, and to 16·cp for a float8 language model on CUDA).
        batch_size: rows per global batch (every module takes its dp shard of it).
        heldout_samples: held-out samples scored at each evaluation (conversations: 0 is all;
            digits: >= 1).
        seed: which samples are drawn, and the sampler's shuffle.
        workers: loader processes per rank preparing this rank's batches (0: in the training
            process; none: 1 on GPUs, whose step's thread launches the kernels: the tiny LLaVA
            task in CUDA graphs took 20.6 ms a step against 26.0 with the prefetch thread's
            Python beside it, H200; 0 on CPU, where the ranks already share the cores, and
            wherever prefetch = true asks for the thread).
        per_rank_loading: a rank prepares only the encoder inputs it encodes (false: every rank
            loads the whole global batch; the same batches, for checking).
        prefetch: with workers = 0, a thread prepares the next two batches while the step runs
            (none: on GPUs; off on CPU, where the ranks already share the cores); batches are
            pinned on GPUs either way.
    """

    format: str = "digits"
    seq_len: int = 0
    batch_size: int = 32
    heldout_samples: int = 512
    seed: int = 0
    workers: int | None = None
    per_rank_loading: bool = True
    prefetch: bool | None = None


@dataclass
class DigitsData(DataSection):
    """``data.format = "digits"``: the bundled digits task (`dtensor_mimo.data.DigitsTask`).

    Attributes:
        max_images: scans per sample, up to.
        max_tones: tones per sample, up to.
        noise_std: noise of the tones.
    """

    format: Literal["digits"] = "digits"
    max_images: int = 3
    max_tones: int = 2
    noise_std: float = 0.5


@dataclass
class ConversationData(DataSection):
    """``data.format = "llava"``: LLaVA conversations (JSON / JSONL) and their media. The other
    conversation formats (`WebDatasetData`, `HFData`) hold the same samples and take the same keys.

    Attributes:
        path: the training data: a file, a list of files or a glob (one sequence, in that order).
        heldout: the held-out data scored at evaluations, as path (none: no evaluation).
        root: media paths are relative to it (none: the directory of the first file of path, and
            of heldout for its samples; webdataset: unused, media are members of the shards).
        tokenizer: a tokenizer directory (none: model.language.hf).
        truncate: cut samples longer than seq_len (whole items only) instead of refusing them.
        pack: pack several samples into one row (document masks, per-document positions); needs
            every sample's length, so each rank tokenizes the whole corpus once at the start.
        image_max_pixels: images of a dynamic_resolution encoder are resized, aspect ratio kept and
            each side a multiple of the patch, to at most this many pixels (0: the encoder's
            max_patches patches when it sets max_patches, else the tower's image_size squared).
        image_min_pixels: and to at least this many where image_max_pixels allows (0: one patch).
        audio_max_seconds: clips of a variable_length encoder keep their own length up to this
            (longer ones are cut; 0: the longest the encoder takes).
        skip_bad_media: a sample whose media file fails to decode (or whose header cannot be
            read) is left out (on every rank, one warning line, counted as skipped_samples in the
            log) instead of stopping the run with an error naming the sample and the file.
        video_fps: frames taken per second of a video clip (a video encoder's items; PyAV).
        video_max_frames: the most frames taken from one clip; a longer clip's are spread
            uniformly over it.
        video_frame_text: text put before each frame's rows, ``{frame}`` its number in the clip
            from 1 (e.g. ``"Frame{frame}: "``, InternVL's video prompt): which frame a row is of
            is then in the language model's tokens, not only in the rows' positions. "": none.
    """

    format: Literal["llava"] = "llava"
    path: str | list[str] | None = None
    heldout: str | list[str] | None = None
    root: str | None = None
    tokenizer: str | None = None
    truncate: bool = False
    pack: bool = False
    image_max_pixels: int = 0
    image_min_pixels: int = 0
    audio_max_seconds: float = 0.0
    skip_bad_media: bool = False
    video_fps: float = 2.0
    video_max_frames: int = 16
    video_frame_text: str = ""


@dataclass
class WebDatasetData(ConversationData):
    """``data.format = "webdataset"``: uncompressed tar shards; the members sharing a key
    (``KEY.json``, ``KEY.png``) are one sample, ``KEY.json`` its LLaVA sample whose ``image`` /
    ``audio`` name members of the same sample (``"png"`` or ``"KEY.png"``). The keys of
    `ConversationData`; `root` is unused (media are members)."""

    format: Literal["webdataset"] = "webdataset"


@dataclass
class HFData(ConversationData):
    """``data.format = "hf"``: a Hugging Face datasets directory (``save_to_disk``) or Parquet /
    Arrow files with the samples' keys as columns (``conversations``, ``id``, ``image`` /
    ``audio`` as paths under `root` or bytes). The keys of `ConversationData`."""

    format: Literal["hf"] = "hf"


@dataclass
class TrainSection:
    """Attributes:
        steps: optimizer steps of the whole run (a resumed run stops at the same step).
        eval_every: steps between held-out evaluations (exact match and loss; 0: only at the end).
        device: "cpu" (gloo) or "cuda" (NCCL, one GPU per rank).
        threads: torch intra-op threads per rank (0: torch's default); local ranks share cores.
        generate: held-out samples answered with greedy decoding at the end.
        timeout_s: seconds a rank waits for a peer in a collective before it fails (the process
            group timeout; also bounds a restarted world's wait for its peers).
    """

    steps: int = 1500
    eval_every: int = 500
    device: Literal["cpu", "cuda"] = "cpu"
    threads: int = 1
    generate: int = 3
    timeout_s: float = 600


@dataclass
class CheckpointSection:
    """Attributes:
        dir: where checkpoints go (DIR/step-000020); one already there is resumed from its latest
            step. None: no checkpoints.
        every: steps between saves (0: only at the end of the run).
        keep: the most recent checkpoints kept; older ones are deleted after a save.
        load: a checkpoint to start from when dir holds none (a step directory, or a directory of
            them: its latest), e.g. one saved under another layout.
        load_model_only: take only the model's parameters and persistent buffers from load (any
            layout, any data; torchtitan's initial_load_model_only): the run starts at step 0 with
            a fresh optimizer, its lr schedule from the start and its own data from the start
            (LLaVA's second stage, a fine-tune on other data); a checkpoint in dir still resumes
            with its full state.
        export_hf: after the last step, a Hugging Face directory (LLaVA-shaped models) or one per
            module under it.
        export_dtype: the exported weights' dtype.
        async_mode: "async": each save copies the state to host memory and writes it while
            training goes on (`checkpoint.BackgroundSaves`: the step waits for the copy, not the
            files; the checkpoint counts once every rank has written it, a step or more later;
            the run's last save and a save on a stop signal are waited for);
            "async_with_pinned_mem": the same into page-locked host memory where the model is on
            GPUs (a faster, asynchronous copy; the buffers stay allocated from the first save to
            the last); "disabled": the step waits for the files (torchtitan's names).
    """

    dir: str | None = None
    every: int = 0
    keep: int = 2
    load: str | None = None
    load_model_only: bool = False
    export_hf: str | None = None
    export_dtype: Literal["float32", "bfloat16"] = "float32"
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"


@dataclass
class MetricsSection:
    """Attributes:
        jsonl: a file getting one JSON object per logged step (step, loss, grad_norm,
            tokens_per_s, lr, ...), held-out evaluation and checkpoint. None: no file.
        tensorboard: a TensorBoard log directory (needs the tensorboard package). None: off.
        log_every: steps between log lines (and JSONL records of steps).
        progress: a progress bar: "auto" shows one on an interactive terminal.
        peak_tflops: the accelerator's peak dense TFLOP/s per rank for MFU; 0: a known GPU's
            (H100/H200/A100 bf16) or none on CPU (MFU then not reported).
        profile: a directory for torch.profiler's record of steps `profile_at` to
            ``profile_at + profile_steps - 1``: each rank writes ``rank{r}.json`` (a trace for
            Perfetto or chrome://tracing) and ``rank{r}.txt`` (its ops by device time on a GPU,
            by CPU time on the CPU, then by host time; the library's ``mimo.*`` ranges name each
            action of the step). None: off. The logged step times leave the profiled steps out
            (a log line whose steps were all profiled shows theirs, marked ``profiled``).
        profile_at: the first profiled step (after compilation and warm-up by default).
        profile_steps: how many steps are profiled (the run's last step at most).
    """

    jsonl: str | None = None
    tensorboard: str | None = None
    log_every: int = 50
    progress: Literal["auto", "on", "off"] = "auto"
    peak_tflops: float = 0.0
    profile: str | None = None
    profile_at: int = 20
    profile_steps: int = 2


@dataclass
class TrainerConfig:
    """Everything `python -m dtensor_mimo.train` reads; see the section classes.

    Attributes:
        options: `ParallelOptions` by module name (a module left out: the library's defaults).
        lr_schedule: the library's `LRSchedule` for every module; its total_steps defaults to
            train.steps.
        data: the source's own section, chosen by data.format.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    options: dict[str, ParallelOptions] = field(default_factory=dict)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)
    data: DigitsData | ConversationData | WebDatasetData | HFData = field(default_factory=DigitsData)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)

    @property
    def module_names(self) -> list[str]:
        """The encoders in declaration order, then the language model: the layout's order."""
        return [*self.model.encoders, LANGUAGE]

    def module_layout(self, name: str) -> ModuleLayout:
        return self.layout.modules.get(name, ModuleLayout())

    def module_options(self, name: str) -> ParallelOptions:
        return self.options.get(name, ParallelOptions())

    def encoder_seed(self, name: str) -> int:
        """Encoder `name`'s init seed: its own, else 10 times its place in model.encoders (10, 20, ...;
        the digits job's vision 10 and audio 20)."""
        seed = self.model.encoders[name].seed
        return 10 * (list(self.model.encoders).index(name) + 1) if seed is None else seed

    def describe(self) -> str:
        """The resolved config, one line per section (printed at start)."""
        lines = []

        def walk(obj: Any, prefix: str) -> None:
            scalars = []
            hints = typing.get_type_hints(type(obj))
            for f in dataclasses.fields(obj):
                value, tp = getattr(obj, f.name), hints[f.name]
                path = prefix if f.metadata.get("open") else f"{prefix}{f.name}."
                if dataclasses.is_dataclass(value):
                    walk(value, path)
                elif typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
                    for key, item in value.items():
                        walk(item, f"{path}{key}.")
                else:
                    scalars.append(f"{f.name}={value!r}")
            if scalars:
                lines.append(f"  {prefix.rstrip('.')}: " + " ".join(scalars))

        walk(self, "")
        return "config:\n" + "\n".join(lines)


DIGITS: dict[str, Any] = {
    "model": {"encoders": {"vision": {"modality": "image", "seed": 10},
                           "audio": {"modality": "audio", "seed": 20}}},
    "options": {name: {"compile": True} for name in ("vision", "audio", LANGUAGE)},
    "pipeline": {"microbatches": 4},
    "optimizer": {"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.01},
    "lr_schedule": {"warmup_steps": 50, "decay": "cosine", "min_lr_ratio": 0.1},
}
"""The digits job's model and settings (`data.format = "digits"`): a ViT over the scans, an audio
encoder over the tones, the library Llama; compiled blocks; encoders overlapping the language
model's 4 microbatches; the optimizer and schedule this small task learns fastest with. A config's
own values lie over these."""

MOVED: dict[str, str] = {
    "optimizer.warmup_steps": "lr_schedule.warmup_steps",
    "optimizer.decay": "lr_schedule.decay",
    "optimizer.min_lr_ratio": "lr_schedule.min_lr_ratio",
}
"""Keys that moved (old -> new): still read, with a warning naming the new key."""


# ---------------------------------------------------------------------------- reading values


def _describe(tp: Any) -> str:
    """How a field's accepted values read in an error."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        known = [a for a in args if _known(a)]
        return " or ".join("none (leave the key out)" if a is type(None) else _describe(a) for a in known)
    if origin in (list, tuple):
        return f"a list of {_describe(args[0])}"
    if origin is dict:
        return f"a table of {_describe(args[1])} by name"
    if dataclasses.is_dataclass(tp):
        return f"a table ({', '.join(_fields(tp))})"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            Any: "any value"}.get(tp, str(tp))


def _known(tp: Any) -> bool:
    """Whether values of `tp` can come from a config file (a torch.dtype cannot: it is spelled)."""
    return tp in (int, float, bool, str, type(None), Any) or typing.get_origin(tp) is not None \
        or dataclasses.is_dataclass(tp)


def _coerce(key: str, value: Any, tp: Any, current: Any = None) -> Any:
    """`value` as the field type `tp` (`current`: the field's value, merged into for tables),
    or a ConfigError naming `key` and what it accepts."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if isinstance(value, (_WrittenInt, _WrittenFloat)):  # a number from the command line
        if tp is str:
            return value.text  # the word as written
        if origin not in (typing.Union, types.UnionType):  # (each type of a union decides)
            value = int(value) if isinstance(value, int) else float(value)
    bad = ConfigError(f"{key} = {value!r}: expected {_describe(tp)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            keys = [*_fields(tp), *(["<module>"] if _open_field(tp) else [])]
            raise ConfigError(f"{key} is a section ({', '.join(keys)}), got {value!r}")
        return _merge(current if current is not None else tp(), value, f"{key}.")
    if origin is Literal:
        if not any(value == a and type(value) is type(a) for a in args):  # True is not 1
            raise bad
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if _is_sources(tp):
            return _coerce_source(key, value, args, current)
        for a in args:
            if a is type(None) or not _known(a):
                continue
            try:
                return _coerce(key, value, a, current)
            except ConfigError:
                pass
        raise bad
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise bad
        items = [_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise bad
        out = dict(current or {})
        for k, v in value.items():
            out[str(k)] = _coerce(f"{key}.{k}", v, args[1], out.get(str(k)))
        return out
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # a directory named 20240101 reads as a number on the command line
        if not isinstance(value, str):
            raise bad
        return value
    raise TypeError(f"config field {key} has a type the reader does not know: {tp}")


def _is_sources(tp: Any) -> bool:
    """Whether `tp` is a union of sections, one chosen by its ``format`` (``data``)."""
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and \
        all(dataclasses.is_dataclass(a) for a in typing.get_args(tp))


def _coerce_source(key: str, value: Any, sections: Sequence[type], current: Any) -> Any:
    """One of `sections` (each with a Literal ``format``), the one that `value`'s format (else
    `current`'s) names, merged with `value`; a key of another section is refused by name."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key} is a section, got {value!r}")
    formats = {typing.get_args(_fields(cls)["format"])[0]: cls for cls in sections}
    chosen = value.get("format", getattr(current, "format", None))
    if chosen not in formats:
        raise ConfigError(f"{key}.format = {chosen!r}: expected one of {', '.join(map(repr, formats))}")
    cls = formats[chosen]
    for name in value:
        if name not in _fields(cls):
            others = [f for f, c in formats.items() if name in _fields(c)]
            if others:
                raise ConfigError(f"{key}.{name} is a key of {key}.format = {others[0]!r}; this config has "
                                  f"{key}.format = {chosen!r}: remove it")
    base = current if type(current) is cls else cls()
    return _merge(base, value, f"{key}.")


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if not f.metadata.get("open")}


def _takes_table(tp: Any) -> bool:
    """Whether a field of type `tp` may be given a table (a section, a dict, a union with one)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_takes_table(a) for a in typing.get_args(tp))
    return dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict or tp is Any


def _open_field(cls: type) -> dataclasses.Field | None:
    """The field that takes a section's other keys by name (``[layout.<module>]``), if any."""
    return next((f for f in dataclasses.fields(cls) if f.metadata.get("open")), None)


def _merge(obj: Any, data: Mapping[str, Any], prefix: str) -> Any:
    """`obj` (a dataclass) with the fields of nested `data` merged in, every key and value
    checked; a new object (the library's dataclasses are frozen and check themselves)."""
    cls = type(obj)
    known, rest = _fields(cls), _open_field(cls)
    changes: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key in known:
            if rest is not None and isinstance(value, Mapping) and not _takes_table(known[key]):
                raise ConfigError(f"{path} = {value!r}: {key!r} is a key of {prefix.rstrip('.')} itself "
                                  f"({_describe(known[key])}), so it cannot name a module's table there; give the "
                                  "module another name")
            current = changes.get(key, getattr(obj, key))
            changes[key] = _coerce(path, value, known[key], current)
        elif rest is not None:
            tp = typing.get_type_hints(cls)[rest.name]
            current = changes.get(rest.name, getattr(obj, rest.name))
            changes[rest.name] = _coerce(prefix.rstrip("."), {key: value}, tp, current)
        else:
            raise ConfigError(f"unknown key {path!r}; {prefix.rstrip('.') or 'the config'} has "
                              f"{', '.join(known)}")
    try:
        return dataclasses.replace(obj, **changes)
    except (TypeError, ValueError) as e:  # the library dataclass's own check
        raise ConfigError(f"{prefix.rstrip('.')}: {e}") from None


class _WrittenInt(int):
    """An integer from the command line that keeps its spelling (`_toml_value`)."""

    text: str


class _WrittenFloat(float):
    """A number from the command line that keeps its spelling (`_toml_value`)."""

    text: str


def _toml_value(text: str) -> Any:
    """A command-line value read as TOML (``40``, ``true``, ``[1, 2]``), else the bare string;
    ``none`` unsets a key that may be none. A number keeps the word as written for a key that
    takes a string (``--checkpoint.dir 1e3`` is "1e3", not "1000.0"), and a TOML date or time is
    that word (no key takes a date: ``--checkpoint.dir 2024-06-01``)."""
    if text == "none":
        return None
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    if isinstance(value, (datetime.date, datetime.time)):  # (a datetime is a date)
        return text
    if type(value) in (int, float):
        value = (_WrittenInt if type(value) is int else _WrittenFloat)(value)
        value.text = text
    return value


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


def _deep_update(base: dict[str, Any], data: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with the tables of `data` merged in key by key (values replaced)."""
    out = dict(base)
    for key, value in data.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_update(out[key], value)
        else:
            out[key] = value
    return out


def parse_args(argv: Sequence[str]) -> TrainerConfig:
    """The config from ``--config FILE.toml`` (optional) and ``--section.key value`` overrides,
    applied in order over the format's defaults; then `check_config`. Raises ConfigError
    (unknown key, bad value)."""
    raw: dict[str, Any] = {}
    args = list(argv)
    overrides: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: options are --config FILE.toml and "
                              "--section.key VALUE (see --help)")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"{arg} needs a value")
            value, i = args[i + 1], i + 1
        i += 1
        if name == "config":
            try:
                with open(value, "rb") as f:
                    raw = _deep_update(raw, tomllib.load(f))
            except OSError as e:
                raise ConfigError(f"--config {value}: {e.strerror}") from None
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"--config {value}: not valid TOML: {e}") from None
        else:
            overrides.append((name, value))
    for name, value in overrides:  # after the file, whatever the order on the line
        raw = _deep_update(raw, _nest(name, _toml_value(value)))
    raw = _read_moved(raw)
    data = raw.get("data")
    digits = not isinstance(data, Mapping) or data.get("format", "digits") == "digits"
    raw = _with_schedule_steps(_deep_update(DIGITS, raw) if digits else raw)
    config = _merge(TrainerConfig(), raw, "")
    check_config(config)
    return config


def _read_moved(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with each `MOVED` key at its new place, and a warning (rank 0) naming it."""
    for old, new in MOVED.items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        section = raw.get(old_section)
        if not isinstance(section, Mapping) or old_key not in section:
            continue
        target = raw.get(new_section)
        if isinstance(target, Mapping) and new_key in target:
            raise ConfigError(f"{old} and {new} are both set; {old} is the old name of {new}: keep {new}")
        raw = {**raw, old_section: {k: v for k, v in section.items() if k != old_key}}
        raw = _deep_update(raw, {new_section: {new_key: section[old_key]}})
        _tell(f"{old} is now {new}; {old} will stop being read in a later release", FutureWarning)
    return raw


def _tell(message: str, category: type[Warning]) -> None:
    """A warning about the config, once (rank 0 of a torchrun world, where every rank parses it)."""
    warn_once(message, category, stacklevel=4)


def _with_schedule_steps(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with lr_schedule.total_steps (unless given) at train.steps, and a warmup not shorter
    than the schedule (total_steps) cut to half of it (the library's `LRSchedule` takes neither)."""
    train, schedule = raw.get("train", {}), raw.get("lr_schedule", {})
    if not isinstance(train, Mapping) or not isinstance(schedule, Mapping):
        return raw  # the merge names the bad section
    steps = train.get("steps", TrainSection.steps)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        return {k: v for k, v in raw.items() if k != "lr_schedule"}  # train.steps is refused by name first
    schedule = dict(schedule)
    if schedule.get("total_steps") is None:  # unset, or `none` on the command line: the run's steps
        schedule["total_steps"] = steps
    total = schedule["total_steps"]
    if isinstance(total, int) and not isinstance(total, bool) and total < 1:  # named before a warmup cut from it
        raise ConfigError(f"lr_schedule.total_steps = {total}: must be >= 1 (the update where the decay ends; none: "
                          "train.steps)")
    warmup = schedule.get("warmup_steps", LRSchedule.warmup_steps)
    if isinstance(warmup, int) and isinstance(schedule["total_steps"], int) and warmup >= schedule["total_steps"]:
        schedule["warmup_steps"] = schedule["total_steps"] // 2
        _tell(f"lr_schedule.warmup_steps = {warmup} is not below the schedule's {schedule['total_steps']} steps: "
              f"warming up for {schedule['warmup_steps']} steps", UserWarning)
    # merged last: a bad train.steps is then named before the schedule that depends on it
    return {**{k: v for k, v in raw.items() if k != "lr_schedule"}, "lr_schedule": schedule}


# ---------------------------------------------------------------------------- --help


def _attribute_help(cls: type) -> dict[str, str]:
    """The first sentence of each entry of the ``Attributes:`` lists of `cls`'s docstring and its
    bases' (`SCHEDULE_HELP` for `LRSchedule`)."""
    out: dict[str, str] = dict(SCHEDULE_HELP) if cls is LRSchedule else {}
    for klass in reversed(cls.__mro__):
        out.update(_own_attribute_help(klass))
    return out


def _own_attribute_help(cls: type) -> dict[str, str]:
    if "Attributes:" not in (cls.__doc__ or ""):
        return {}
    lines = (cls.__doc__ or "").split("Attributes:", 1)[-1].splitlines()
    entries: dict[str, str] = {}
    indent, current = None, None
    for line in lines:
        if not line.strip():
            if entries:
                break
            continue
        depth = len(line) - len(line.lstrip())
        indent = depth if indent is None else indent
        match = re.fullmatch(r"(\w+(?:, \w+)*): (.*)", line.strip())
        if depth == indent and match:
            current = match.group(1)
            entries[current] = match.group(2)
        elif depth > indent and current is not None:
            entries[current] += " " + line.strip()
        else:
            break
    out = {}
    for names, text in entries.items():
        sentence = re.split(r"(?<!e\.g)(?<!i\.e)[.]\s", text + " ", maxsplit=1)[0].rstrip(".;")
        out.update(dict.fromkeys(names.split(", "), sentence))
    return out


def help_text() -> str:
    """Every key with its default and meaning, for ``--help``."""
    rows: list[tuple[str, str, str]] = []

    def walk(cls: type, obj: Any, prefix: str, only: set[str] | None = None, note: str = "") -> None:
        meaning = _attribute_help(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if only is not None and f.name not in only:
                continue
            tp, value = hints[f.name], getattr(obj, f.name)
            if f.metadata.get("open"):
                walk(typing.get_args(tp)[1], typing.get_args(tp)[1](), f"{prefix}<module>.")
            elif _is_sources(tp):  # sections chosen by format
                sources = typing.get_args(tp)
                common = set.intersection(*(set(_fields(c)) for c in sources))
                walk(type(value), value, f"{prefix}{f.name}.", common)
                shown: set[str] = set(common)
                for source in sources:  # each key once, noting the formats that take it
                    own = set(_fields(source)) - shown
                    takes = [c.format for c in sources if own <= set(_fields(c))]
                    walk(source, source(), f"{prefix}{f.name}.", own, f"{', '.join(takes)}: ")
                    shown |= own
            elif dataclasses.is_dataclass(tp):
                walk(tp, value, f"{prefix}{f.name}.")
            elif typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
                item = typing.get_args(tp)[1]
                walk(item, item(), f"{prefix}{f.name}.<{'module' if f.name == 'options' else 'name'}>.")
            else:
                if isinstance(value, (list, dict)) and not value:
                    shown = "[]" if isinstance(value, list) else "{}"
                else:
                    shown = "none" if value is None else repr(value)
                rows.append((f"--{prefix}{f.name}", shown, note + meaning.get(f.name, _describe(tp))))

    walk(TrainerConfig, TrainerConfig(), "")
    width = max(len(r[0]) for r in rows) + 2
    shown = min(max(len(r[1]) for r in rows), 14) + 2
    lines = ["usage: python -m dtensor_mimo.train [--config FILE.toml] [--section.key VALUE ...]", "",
             "Trains a MIMO model (the digits model by default); prints the held-out accuracy.",
             "<name>: an encoder's name (model.encoders); <module>: an encoder's or 'language'.",
             "Defaults are the library's; data.format = 'digits' also sets "
             + ", ".join(_flat(DIGITS)) + ".", ""]
    lines += [f"  {key:<{width}}{value:<{shown}}{meaning}" for key, value, meaning in rows]
    return "\n".join(lines)


def _flat(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out += _flat(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={value!r}")
    return out


# ---------------------------------------------------------------------------- checks


def build_layout(config: TrainerConfig, world_size: int | None = None):
    """The `MimoLayout` of `config.layout` (a ConfigError names the problem)."""
    from dtensor_mimo.layout import MimoLayout

    names = config.module_names
    sections = {n: config.module_layout(n) for n in names}
    try:
        pars = {n: s.parallelism for n, s in sections.items()}
        offsets = None
        if any(s.offset is not None for s in sections.values()):
            offsets, nxt = {}, 0
            for n, s in sections.items():
                offsets[n] = nxt if s.offset is None else s.offset
                nxt = offsets[n] + pars[n].size
        return MimoLayout(pars, offsets=offsets, world_size=world_size)
    except ValueError as e:
        raise ConfigError(f"layout: {e}") from None


def check_config(config: TrainerConfig, world_size: int | None = None) -> None:
    """Everything that can be checked without processes or files: values in range, module names,
    the layout and its fit to `world_size` (when given), the library modules' blocks against their
    pipeline stages, the encoders' options against the layout, batch divisibility. (Files and
    directories, and a Hugging Face directory's blocks: `dtensor_mimo.train.preflight`.)"""
    def positive(key: str, value: int | float, minimum: int = 1) -> None:
        if value < minimum:
            raise ConfigError(f"{key} = {value!r}: must be >= {minimum}")

    for key in ("data.batch_size", "train.steps", "metrics.log_every", "metrics.profile_at", "metrics.profile_steps",
                "checkpoint.keep"):
        section, name = key.split(".")
        positive(key, getattr(getattr(config, section), name))
    for key in ("train.eval_every", "train.threads", "train.generate", "checkpoint.every", "data.workers",
                "data.max_images", "data.max_tones", "data.heldout_samples", "data.seq_len",
                "data.image_max_pixels", "data.image_min_pixels", "data.audio_max_seconds"):
        section, name = key.split(".")
        if getattr(getattr(config, section), name, None) is not None:  # data: the source's own keys
            positive(key, getattr(getattr(config, section), name), 0)
    if getattr(config.data, "prefetch", None) and getattr(config.data, "workers", None):
        raise ConfigError(f"data.prefetch = true with data.workers = {config.data.workers}: the prefetch thread runs "
                          "with workers = 0 only (loader processes already prepare batches ahead); drop one of them")
    m = config.metrics
    if m.profile and m.profile_at > config.train.steps:
        raise ConfigError(f"metrics.profile_at = {m.profile_at} is after the last step (train.steps = "
                          f"{config.train.steps}): nothing would be profiled; choose a step <= {config.train.steps}")
    if not 0 <= m.peak_tflops < math.inf:
        raise ConfigError(f"metrics.peak_tflops = {m.peak_tflops!r}: give the accelerator's peak dense TFLOP/s per "
                          "rank (e.g. 989 for an H100 SXM in bf16), or 0 for a known GPU's")
    for key in ("checkpoint.dir", "checkpoint.load", "checkpoint.export_hf", "metrics.jsonl", "metrics.tensorboard",
                "metrics.profile"):
        section, name = key.split(".")
        if getattr(getattr(config, section), name) == "":  # e.g. --checkpoint.dir="$UNSET": not none
            raise ConfigError(f"{key} = '': an empty path; name one, or leave the key out (none) for no {key}")
    c = config.checkpoint
    if c.load_model_only and not c.load:
        raise ConfigError("checkpoint.load_model_only = true without checkpoint.load: name the checkpoint whose "
                          "model weights the run starts from (checkpoint.load = 'DIR'), or drop load_model_only")
    if c.load_model_only and c.dir and os.path.abspath(c.dir) in (os.path.abspath(c.load),
                                                                  os.path.dirname(os.path.abspath(c.load))):
        # the run would resume that checkpoint (dir's step-N directories), all of it, as its own
        raise ConfigError(f"checkpoint.load_model_only = true with checkpoint.load = {c.load!r} inside "
                          f"checkpoint.dir = {c.dir!r}: a checkpoint in dir is resumed with its full state (optimizer, "
                          "step, data), not its weights alone; give the new run a checkpoint.dir of its own")
    if not 0 < config.train.timeout_s < math.inf:
        raise ConfigError(f"train.timeout_s = {config.train.timeout_s!r}: give a positive, finite number of seconds "
                          "(e.g. 600)")
    lang = config.model.language
    _check_source(f"model.{LANGUAGE}", lang.hf, lang.factory)
    if not lang.hf and not lang.factory:
        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden"):
            positive(f"model.{LANGUAGE}.{key}", getattr(lang, key))
        if lang.n_heads % lang.n_kv_heads or lang.dim % lang.n_heads:
            raise ConfigError(f"model.{LANGUAGE}: dim={lang.dim}, n_heads={lang.n_heads}, n_kv_heads="
                              f"{lang.n_kv_heads}: n_heads must divide dim and be a multiple of n_kv_heads")
    if not config.model.encoders:
        raise ConfigError("model.encoders is empty: declare at least one, e.g. [model.encoders.image] "
                          "with hf = 'DIR' and modality = 'image'")
    if LANGUAGE in config.model.encoders:
        raise ConfigError(f"model.encoders.{LANGUAGE}: {LANGUAGE!r} is the decoder's name; name the encoder "
                          "otherwise")
    for name, enc in config.model.encoders.items():
        key = f"model.encoders.{name}"
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ConfigError(f"{key}: an encoder's name is a plain identifier (letters, digits, _)")
        if name in _fields(LayoutConfig):  # [layout.<module>] would be that key
            raise ConfigError(f"{key}: {name!r} is a key of [layout] (layout.{name}), so the encoder could not be "
                              "given a layout; name it otherwise")
        _check_source(key, enc.hf, enc.factory)
        if not enc.hf and not enc.factory:
            for field_name in ("dim", "n_layers", "n_heads", "mlp_hidden", "patch_size"):
                positive(f"{key}.{field_name}", getattr(enc, field_name))
            if enc.dim % enc.n_heads:
                raise ConfigError(f"{key}.n_heads = {enc.n_heads} must divide {key}.dim = {enc.dim}")
        positive(f"{key}.max_patches", enc.max_patches, 0)
        if enc.modality == "audio" and enc.dynamic_resolution:
            raise ConfigError(f"{key}.dynamic_resolution is for image encoders; an audio encoder takes clips at "
                              f"their own length with {key}.variable_length = true")
        if enc.modality in ("image", "video") and enc.variable_length:
            raise ConfigError(f"{key}.variable_length is for audio encoders; an image encoder takes images at "
                              f"their own size with {key}.dynamic_resolution = true")
        if enc.factory and (enc.dynamic_resolution or enc.variable_length):
            which = "dynamic_resolution" if enc.dynamic_resolution else "variable_length"
            raise ConfigError(f"{key}.{which}: items of their own size need an encoder the library configures (a "
                              "SigLIP / CLIP / Whisper directory or the library's); a factory encoder gives "
                              "tokens_per_item rows per item")
        positive(f"{key}.temporal_patch", enc.temporal_patch)
        if enc.temporal_patch != 1 and enc.modality != "video":
            raise ConfigError(f"{key}.temporal_patch = {enc.temporal_patch}: frames per item is for video encoders "
                              f"(modality = 'video'); this one's modality is {enc.modality!r}")
        if enc.factory and enc.modality == "video":
            raise ConfigError(f"{key}: a video encoder runs an image tower on each frame: give hf = a SigLIP / CLIP "
                              "directory (or the library ViT's sizes), not a factory")
        if enc.factory and config.data.format != "digits" and (not enc.processor or enc.tokens_per_item < 1):
            raise ConfigError(f"{key}: a factory encoder needs processor = 'DIR' (its items' preprocessing) "
                              "and tokens_per_item (its rows per item) for the data")
    names = config.module_names
    for key, given in (("layout", list(config.layout.modules)), ("options", list(config.options)),
                       ("optimizer.module_lr", list(config.optimizer.module_lr))):
        unknown = [n for n in given if n not in names]
        if unknown:
            raise ConfigError(f"{key} names {unknown}: the modules are {names}")
    wrong_lr = {n: lr for n, lr in config.optimizer.module_lr.items() if not 0 <= lr < math.inf}
    if wrong_lr:
        raise ConfigError(f"optimizer.module_lr = {wrong_lr}: a learning rate is a finite number >= 0")
    data = config.data
    _refuse_unused(config)
    if data.format == "digits":
        kinds = {n: e.modality for n, e in config.model.encoders.items()}
        if kinds != {"vision": "image", "audio": "audio"} or any(e.hf or e.factory for e in config.model.encoders.values()):
            raise ConfigError(f"data.format = 'digits' trains the library's image encoder 'vision' and audio encoder "
                              f"'audio' (model.encoders: {kinds}); for your own modules and data use "
                              "data.format = 'llava' (or 'webdataset', 'hf')")
        positive("data.heldout_samples", data.heldout_samples)
        if not 0 <= data.noise_std < math.inf:  # inf / nan: every tone's input NaN, a NaN loss naming nothing
            raise ConfigError(f"data.noise_std = {data.noise_std!r}: the tones' noise std must be a finite number "
                              ">= 0 (0: no noise; default 0.5)")
    else:
        if not data.path:
            what = {"llava": "LLaVA conversation JSON / JSONL files", "webdataset": "tar shards",
                    "hf": "a save_to_disk directory, Parquet or Arrow files"}[data.format]
            raise ConfigError(f"data.format = {data.format!r} needs data.path ({what}: a path, a list or a glob)")
        if not data.tokenizer and not lang.hf:
            raise ConfigError(f"data.format = {data.format!r} needs a tokenizer: data.tokenizer = 'DIR' or "
                              "model.language.hf = 'DIR' (a directory with tokenizer files)")
        if not (data.video_fps > 0 and math.isfinite(data.video_fps)):
            raise ConfigError(f"data.video_fps = {data.video_fps!r}: frames taken per second of video must be a finite "
                              "number > 0 (one above a clip's own rate takes its every frame)")
        positive("data.video_max_frames", data.video_max_frames)
        if data.video_frame_text:
            from dtensor_mimo.data.conversation import frame_text_problem

            if problem := frame_text_problem(data.video_frame_text):
                raise ConfigError(f"data.video_frame_text = {data.video_frame_text!r} {problem}")
        if data.image_min_pixels and data.image_max_pixels and data.image_min_pixels > data.image_max_pixels:
            raise ConfigError(f"data.image_min_pixels = {data.image_min_pixels} is above data.image_max_pixels = "
                              f"{data.image_max_pixels}; images are resized to a pixel count between the two")
        from dtensor_mimo.data.conversation import shared_modalities

        shared = shared_modalities({n: enc.modality for n, enc in config.model.encoders.items()})
        twice = "; ".join(f"{', '.join(f'model.encoders.{n}' for n in names)} all take {kind!r} items"
                          for kind, names in shared.items())
        if twice:
            raise ConfigError(f"{twice}: conversation data gives each <image> / <audio> / <video> placeholder to "
                              "one encoder; remove the others (a misspelt name declares a new encoder, of modality "
                              "'image' unless it says otherwise)")

    # With layout.auto the planner replaces the layout for the world: it need not fit it yet.
    layout = build_layout(config, None if config.layout.auto else world_size)  # no rank left over, none missing
    if config.layout.auto:
        # ... nor the rules below, of each module's layout and pipeline.microbatches: the planner
        # replaces both with a choice that passes them (none: it says so, naming the batch)
        return
    for name in names:
        par = layout.parallelism(name)
        if name != LANGUAGE and par.cp > 1:
            raise ConfigError(f"layout.{name}: cp={par.cp}: encoders take cp = 1 (context parallelism is the "
                              "language model's)")
        if par.hsdp and not config.options.get(name, ParallelOptions()).fsdp:
            raise ConfigError(f"layout.{name}.dp_replicate = {par.dp_replicate} (HSDP) needs FSDP2, but "
                              f"options.{name}.fsdp = false; set it true, or dp_replicate = 1")
    pipe, lang_par = config.pipeline, layout.parallelism(LANGUAGE)
    try:  # the library's own rules of a schedule's microbatches (MimoModel checks them again)
        check_pipeline_layout(layout, LANGUAGE, pipe)
    except ValueError as e:
        raise ConfigError(f"pipeline.microbatches = {pipe.microbatches}, pipeline.schedule = {pipe.schedule!r}, "
                          f"layout.{LANGUAGE}.pp = {lang_par.pp}: {e}") from None
    check_module_options(config, layout)
    check_stages(config, layout, library_blocks(config))
    per_mb, rem = divmod(data.batch_size, pipe.microbatches)
    if rem or per_mb % lang_par.dp:
        raise ConfigError(f"data.batch_size = {data.batch_size} must split into pipeline.microbatches "
                          f"= {pipe.microbatches} microbatches of a multiple of layout.{LANGUAGE}.dp = "
                          f"{lang_par.dp} samples; e.g. data.batch_size = "
                          f"{pipe.microbatches * lang_par.dp * max(1, per_mb // lang_par.dp)}")


def check_module_options(config: TrainerConfig, layout: Any) -> None:
    """The encoders' `ParallelOptions` that the layout makes meaningless or that the library would
    refuse inside the ranks (after their meshes are built): named here, before any process starts."""
    from dtensor_mimo.schedule.checks import compiled_varied_problem, recomputed_compile_problem

    for name in config.model.encoders:
        options, par = config.module_options(name), layout.parallelism(name)
        ranks, lang = layout.ranks(name), layout.ranks(LANGUAGE)
        if options.recompute_colocated and not set(ranks) & set(lang):
            raise ConfigError(f"options.{name}.recompute_colocated = true, but encoder {name!r} (ranks {_span(ranks)}) "
                              f"shares no rank with the language model (ranks {_span(lang)}): only an encoder on the "
                              "language model's ranks keeps its graph through the language model's microbatches (one "
                              f"on ranks of its own already holds only its crossing window); remove it, or colocate "
                              f"the encoder (layout.{name} of the language model's size and offset)")
        tower_trains = not config.model.encoders[name].frozen
        if recomputed_compile_problem(name, options, par.tp, config.pipeline.microbatches, tower_trains):
            # (the library's rule: its check_model refuses it inside the ranks, where the encoder trains)
            raise ConfigError(f"options.{name}.recompute_colocated = true with options.{name}.compile = true, "
                              f"layout.{name}.tp = {par.tp} and pipeline.microbatches = "
                              f"{config.pipeline.microbatches}: "
                              "torch's compiler fails on the second microbatch's recomputed forward (the first one's "
                              f"tensor-parallel weight gradients); set one of them false, layout.{name}.tp = 1, or "
                              "pipeline.microbatches = 1")
        own_size = config.model.encoders[name].dynamic_resolution or config.model.encoders[name].variable_length
        # (the library's rule: check_batch's, at the first batch)
        if compiled_varied_problem(name, par.tp, own_size, options.compile and tower_trains):
            which = "dynamic_resolution" if config.model.encoders[name].dynamic_resolution else "variable_length"
            raise ConfigError(f"model.encoders.{name}.{which} = true with options.{name}.compile = true and "
                              f"layout.{name}.tp = {par.tp}: torch's compiler cannot trace the backward of items of "
                              f"their own size under tensor parallel; set options.{name}.compile = false, "
                              f"layout.{name}.tp = 1 (dp instead), or items of one size")
        if options.balance and par.dp == 1:
            raise ConfigError(f"options.{name}.balance = true, but layout.{name}.dp = 1: balancing splits the "
                              f"encoder's items over its dp ranks, and one rank encodes them all; remove it, or give "
                              f"layout.{name}.dp > 1")
        if options.balance and par.pp > 1:
            raise ConfigError(f"options.{name}.balance = true with layout.{name}.pp = {par.pp}: balancing moves "
                              f"items between the dp ranks of an encoder of pp = 1; remove it, or use "
                              f"layout.{name}.pp = 1")
        # (the library's rules of encoder stages: `encoder_pipeline_problem`, inside the ranks)
        if options.sp and par.pp > 1:
            raise ConfigError(f"options.{name}.sp = true with layout.{name}.pp = {par.pp}: sequence parallel does "
                              f"not run on an encoder's pipeline stages; remove it, or use layout.{name}.pp = 1")
        if options.compile and options.compile_scope == "module" and par.pp > 1:
            raise ConfigError(f"options.{name}.compile_scope = 'module' with layout.{name}.pp = {par.pp}: an "
                              "encoder's pipeline stages run their blocks themselves, which a whole-module graph "
                              f"would not reach; use options.{name}.compile_scope = 'block', or layout.{name}.pp = 1")
        section = config.model.encoders[name]
        if options.compile and options.compile_scope == "module" and (section.dynamic_resolution
                                                                       or section.variable_length):
            which = "dynamic_resolution" if section.dynamic_resolution else "variable_length"
            raise ConfigError(f"options.{name}.compile_scope = 'module' with model.encoders.{name}.{which} = true: "
                              "items of their own sizes come as a list per call, and the whole forward would compile "
                              f"once per count of items; use options.{name}.compile_scope = 'block'")
    from dtensor_mimo.layout import LayoutError
    from dtensor_mimo.parallelize.part import check_compile_layout

    for name in config.module_names:
        options, par = config.module_options(name), layout.parallelism(name)
        try:  # the library's rules of compile options on a layout (`check_model`, inside the ranks)
            check_compile_layout(name, options, par)
        except LayoutError as e:
            raise ConfigError(f"options.{name} with layout.{name} (dp = {par.dp}, cp = {par.cp}, tp = {par.tp}): "
                              f"{e}") from None
    stages = config.pipeline.num_stages(layout.parallelism(LANGUAGE).pp)
    lang = config.module_options(LANGUAGE)
    if lang.compile and lang.compile_scope == "module" and stages > 1:
        raise ConfigError(f"options.{LANGUAGE}.compile_scope = 'module' with {stages} pipeline stages of the "
                          f"language model (layout.{LANGUAGE}.pp x pipeline.virtual_stages): the stages' pieces of "
                          f"one forward would each compile variants of it; use options.{LANGUAGE}.compile_scope = "
                          "'block'")


def _span(ranks: Sequence[int]) -> str:
    return f"{ranks[0]}..{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def library_blocks(config: TrainerConfig) -> dict[str, tuple[int, str, str | None]]:
    """The blocks of each library module the config sizes (no hf, no factory), as `check_stages`
    takes them."""
    lang = config.model.language
    keys = {} if lang.hf or lang.factory else {LANGUAGE: (lang.n_layers, f"model.{LANGUAGE}.n_layers")}
    for name, enc in config.model.encoders.items():
        if not enc.hf and not enc.factory:
            keys[name] = (enc.n_layers, f"model.encoders.{name}.n_layers")
    return {name: (n, f"{key} = {n}", key) for name, (n, key) in keys.items()}


def check_stages(config: TrainerConfig, layout: Any, blocks: Mapping[str, tuple[int, str, str | None]]) -> None:
    """Every pipeline stage of the modules in `blocks` (``{module: (blocks, what gives them, the key
    that sizes them or None)}``) holds at least one block, and pipeline.split cuts the language model's layers (the
    library's `stage_layers`, which `MimoModel` applies inside the ranks): a ConfigError naming
    the keys, before any process starts."""
    pipe = config.pipeline
    for name, (n, where, key) in blocks.items():
        pp = layout.parallelism(name).pp
        if name == LANGUAGE:
            stages, split = pipe.num_stages(pp), pipe.split
            cut = f"layout.{LANGUAGE}.pp = {pp}" + (f" x pipeline.virtual_stages = {pipe.virtual_stages}"
                                                     if pipe.virtual_stages > 1 else "")
        else:
            stages, split, cut = pp, None, f"layout.{name}.pp = {pp}"
        if stages == 1 and split is None:
            continue
        try:
            stage_layers(n, stages, split, module=name)
        except ValueError:
            if split is not None:
                raise ConfigError(f"pipeline.split = {list(split)}: give the layers of each of the language model's "
                                  f"{stages} pipeline stages ({cut}), each >= 1, {n} in all ({where}); or leave "
                                  "pipeline.split out for an even split") from None
            fix = (f"lower layout.{name}.pp" + (" or pipeline.virtual_stages" if name == LANGUAGE and
                                                pipe.virtual_stages > 1 else "")
                   + (f", or raise {key}" if key else ""))
            raise ConfigError(f"{cut} cuts {'the language model' if name == LANGUAGE else f'encoder {name!r}'} "
                              f"into {stages} pipeline stages, but {where} gives it {n} block(s): every stage needs "
                              f"at least one; {fix}") from None


def _changed(obj: Any, names: Sequence[str]) -> list[str]:
    """Which of `names` differ from their dataclass defaults in `obj` (i.e. were set)."""
    default = type(obj)()
    return [n for n in names if getattr(obj, n) != getattr(default, n)]


def _refuse_unused(config: TrainerConfig) -> None:
    """A key that this config would ignore is refused by name, never silently dropped."""
    digits = config.data.format == "digits"
    unused: list[str] = []
    encoders = config.model.encoders.values()
    # Conversation media are resized / cut to these (a key of digits data is refused when read).
    if not digits and not any(e.dynamic_resolution for e in encoders):
        unused += [f"data.{n}" for n in _changed(config.data, ("image_max_pixels", "image_min_pixels"))]
    if not digits and not any(e.variable_length for e in encoders):
        unused += [f"data.{n}" for n in _changed(config.data, ("audio_max_seconds",))]
    if not digits and not any(e.modality == "video" for e in encoders):
        unused += [f"data.{n}" for n in _changed(config.data, ("video_fps", "video_max_frames", "video_frame_text"))]
    if config.data.format == "webdataset":  # media are members of the shards
        unused += [f"data.{n}" for n in _changed(config.data, ("root",))]
    library = ("dim", "n_layers", "n_heads", "mlp_hidden", "image_size", "patch_size")
    for name, enc in config.model.encoders.items():
        key = f"model.encoders.{name}"
        if not enc.dynamic_resolution:
            unused += [f"{key}.{n}" for n in _changed(enc, ("max_patches",))]
        if enc.hf or enc.factory:
            unused += [f"{key}.{n}" for n in _changed(enc, library)]
        elif enc.modality == "audio":  # the library's audio encoder: mel frames, no image, no patches
            unused += [f"{key}.{n}" for n in _changed(enc, ("image_size", "patch_size"))]
        if not enc.factory:
            unused += [f"{key}.{n}" for n in _changed(enc, ("tokens_per_item", "factory_args"))]
        if not enc.hf or enc.modality not in ("image", "video"):
            unused += [f"{key}.{n}" for n in _changed(enc, ("feature_layer",))]
        if digits:
            unused += [f"{key}.{n}" for n in _changed(enc, ("processor",))]
    for name, options in config.options.items():  # compile's own settings do nothing without it
        if not options.compile:
            unused += [f"options.{name}.{n}" for n in _changed(options, ("compile_mode", "compile_options",
                                                                         "compile_scope", "compile_backend"))]
        # the language model's head and loss; an encoder's schedule beside the language model
        only = ("loss_parallel", "chunked_loss") if name != LANGUAGE else ("recompute_colocated", "balance")
        unused += [f"options.{name}.{n}" for n in _changed(options, only)]
    # checkpoints are written only to checkpoint.dir, an export only to export_hf, a profile only to profile
    if not config.checkpoint.dir:
        unused += [f"checkpoint.{n}" for n in _changed(config.checkpoint, ("every", "keep", "async_mode"))]
    if not config.metrics.profile:
        unused += [f"metrics.{n}" for n in _changed(config.metrics, ("profile_at", "profile_steps"))]
    lang = config.model.language
    if lang.hf or lang.factory:
        unused += [f"model.{LANGUAGE}.{n}" for n in _changed(lang, ("dim", "n_layers", "n_heads", "n_kv_heads",
                                                                      "ffn_hidden"))]
    if not lang.factory:
        unused += [f"model.{LANGUAGE}.{n}" for n in _changed(lang, ("factory_args",))]
    if not lang.hf:
        unused += [f"model.{LANGUAGE}.{n}" for n in _changed(lang, ("untie_embeddings",))]
    if unused:
        raise ConfigError(f"{', '.join(unused)}: not used by this config (the library model's sizes apply without "
                          "hf or factory, image_size and patch_size to an image or video encoder's ViT; "
                          "tokens_per_item and factory_args with a factory; feature_layer with an image tower's hf, "
                          f"untie_embeddings with model.{LANGUAGE}.hf; "
                          "max_patches with dynamic_resolution; data.image_max_pixels, image_min_pixels "
                          "(audio_max_seconds) with an encoder's dynamic_resolution (variable_length); "
                          "data.video_fps, video_max_frames, video_frame_text with a video encoder; data.root with "
                          "files, not webdataset shards; options.<module>.compile_mode, compile_options, "
                          "compile_scope, compile_backend with options.<module>.compile = true; loss_parallel, "
                          f"chunked_loss for options.{LANGUAGE}, recompute_colocated and balance for an encoder's; "
                          "checkpoint.every, keep, async_mode with checkpoint.dir; metrics.profile_at, profile_steps "
                          "with metrics.profile); remove them")


def _check_source(key: str, hf: str | None, factory: str | None) -> None:
    if hf and factory:
        raise ConfigError(f"{key}: give hf or factory, not both")
    if factory and not re.fullmatch(r"[\w.]+:\w+", factory):
        raise ConfigError(f"{key}.factory = {factory!r}: expected 'package.module:function'")
