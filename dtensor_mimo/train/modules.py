"""The trainer's modules from its config: Hugging Face directories, the library's models, or a
user's factory; and the tokenizer and processors that go with them.

Resolving reads only small files (``config.json``, tokenizer and processor configs), so the
launcher runs it before any process starts (`resolve`); each rank then builds the modules on the
meta device (`build_modules`) and `MimoModel` allocates only its shards, which `MimoModel.load_hf`
fills from the directories (`ResolvedModel.hf_paths`) and `init_weights` initializes otherwise.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from dtensor_mimo.models import (
    AudioConfig,
    AudioEncoder,
    Llama,
    LlamaConfig,
    ModalityEncoder,
    Projection,
    ViT,
    ViTConfig,
)
from dtensor_mimo.models.config_json import read_config, with_defaults
from dtensor_mimo.models.hf.vision import anyres_problem, check_projector
from dtensor_mimo.train.config import LANGUAGE, ConfigError, EncoderSection, TrainerConfig

_TOWERS = {"siglip_vision_model": -1, "clip_vision_model": -2, "siglip": -1, "clip": -2}
"""Vision towers by model_type, with LLaVA's usual feature layer for each (no final norm)."""


@dataclass
class ResolvedEncoder:
    """One encoder as the config describes it: its library config (None for a factory's), rows per
    item, and its items' preprocessing (a transformers processor; None for the digits data).

    Attributes:
        tokens_per_item: the rows every item gives; for items of their own size (`varied`) an
            upper bound, the most one item may give (``max_patches``; the longest clip's rows),
            not what an item gives: the data counts each item's (`ViTConfig.tokens_for`).
        image_pixels: ``(min, max)`` pixels images are resized into (dynamic resolution on
            conversation data; else None).
        clip_samples: the most samples of a clip kept (variable-length audio on conversation
            data; else None).
    """

    name: str
    section: EncoderSection
    config: ViTConfig | AudioConfig | None
    tokens_per_item: int
    processor: Any = None
    image_pixels: tuple[int, int] | None = None
    clip_samples: int | None = None

    @property
    def varied(self) -> bool:
        """Whether items have their own sizes (dynamic resolution, variable-length clips)."""
        return bool(getattr(self.config, "dynamic_resolution", False) or getattr(self.config, "variable_length", False))

    @property
    def item_shape(self) -> tuple[int, ...] | None:
        """One encoder input's shape, when the library config fixes it (None when items vary)."""
        if self.varied:
            return None
        if isinstance(self.config, ViTConfig):
            return (self.config.item_channels, self.config.image_size, self.config.image_size)
        if isinstance(self.config, AudioConfig):
            return (self.config.n_mels, self.config.max_frames)
        return None


@dataclass
class ResolvedModel:
    """What every rank builds: language config (None for a factory's), encoders, tokenizer, and the
    vocabulary the data uses (the tokenizer's with its placeholders, or the digits task's)."""

    language: LlamaConfig | None
    encoders: dict[str, ResolvedEncoder]
    vocab_size: int
    tokenizer: Any = None
    hf_paths: dict[str, str] = field(default_factory=dict)
    seeds: dict[str, int] = field(default_factory=dict)


def _directory(key: str, path: str) -> str:
    if not os.path.isdir(path):
        raise ConfigError(f"{key} = {path!r}: no such directory")
    if not os.path.exists(os.path.join(path, "config.json")) and key.endswith(".hf"):
        raise ConfigError(f"{key} = {path!r}: no config.json there; point at a Hugging Face model directory")
    return path


def vision_config(key: str, path: str, feature_layer: int | None) -> ViTConfig:
    """The ViT of a SigLIP / CLIP / LLaVA directory (a LLaVA directory's own feature layer). A
    plain tower gives the features after `feature_layer` blocks (default: LLaVA's for the tower),
    without its final norm, as LLaVA takes them."""
    top = read_config(path)
    kind = top.get("model_type")
    try:
        config = ViTConfig.from_hf(path)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{key}: {e}") from None
    if kind == "llava":
        if feature_layer is not None:
            raise ConfigError(f"{key}: a LLaVA directory fixes its feature layer "
                              f"(vision_feature_layer); leave feature_layer out")
        return config
    layer = _TOWERS.get(kind, -1) if feature_layer is None else feature_layer
    n = config.n_layers + 1 + layer if layer < 0 else layer
    if not 1 <= n <= config.n_layers:
        raise ConfigError(f"{key}: feature_layer = {layer} leaves {n} of the tower's {config.n_layers} blocks")
    return dataclasses.replace(config, n_layers=n, final_norm=False)


def dynamic_vit(config: TrainerConfig, name: str, vit: ViTConfig) -> tuple[ViTConfig, tuple[int, int]]:
    """`vit` taking images at their own size (``[model.encoders.<name>] dynamic_resolution``) on
    conversation data, and the ``(min, max)`` pixels images are resized into: data.image_max_pixels
    (default: max_patches patches, else the tower's own image_size squared) and image_min_pixels
    (default: one patch). max_patches defaults to what image_max_pixels allows and may not be less."""
    key, section, data = f"model.encoders.{name}", config.model.encoders[name], config.data
    p = vit.patch_size
    most = data.image_max_pixels or (section.max_patches * p * p if section.max_patches else vit.image_size ** 2)
    least = data.image_min_pixels or p * p
    if most < p * p:
        raise ConfigError(f"data.image_max_pixels = {most} is less than one {p}x{p} patch of {key}")
    if least > most:
        raise ConfigError(f"data.image_min_pixels = {least} is above the {most} pixels an image of {key} may have "
                          f"(data.image_max_pixels, or {key}.max_patches x {p}x{p}); lower it or raise those")
    patches = most // (p * p)
    if section.max_patches and section.max_patches < patches:
        raise ConfigError(f"{key}.max_patches = {section.max_patches}: images of up to data.image_max_pixels = {most} "
                          f"pixels give up to {patches} patches of {p}x{p}; raise max_patches to {patches} or lower "
                          "data.image_max_pixels")
    vit = dataclasses.replace(vit, dynamic_resolution=True, max_patches=section.max_patches or patches)
    return vit, (least, most)


def variable_audio(config: TrainerConfig, name: str, audio: AudioConfig, fe: Any) -> tuple[AudioConfig, int]:
    """`audio` taking clips at their own length (``[model.encoders.<name>] variable_length``) on
    conversation data, and the most samples of a clip kept: data.audio_max_seconds (default: the
    longest clip the encoder takes, at the feature extractor's rate and hop)."""
    key, rate, hop = f"model.encoders.{name}", fe.sampling_rate, fe.hop_length
    longest = audio.max_frames * hop / rate
    seconds = config.data.audio_max_seconds or longest
    # whole samples, the float product's rounding error dropped first: 8.03 s * 16000 Hz gives
    # 128479.99999999999, which int() would cut to a sample (and a frame) short of the clip's
    samples = math.floor(round(seconds * rate, 6))
    shortest = max(hop, fe.n_fft // 2 + 1)
    if samples // hop > audio.max_frames:
        raise ConfigError(f"data.audio_max_seconds = {seconds:g}: {samples // hop} frames of {hop} samples at "
                          f"{rate} Hz, more than {key} takes ({audio.max_frames} frames, {longest:g} s); lower it")
    if samples < shortest:
        raise ConfigError(f"data.audio_max_seconds = {seconds:g}: {samples} samples, less than the feature "
                          f"extractor's window of {shortest} samples at {rate} Hz; raise it")
    return dataclasses.replace(audio, variable_length=True), samples


def _nested_image_processor(path: str, modality: str) -> bool:
    """Whether `path` holds an image processor inside ``processor_config.json`` (where transformers 5
    saves a LLaVA processor's, e.g. the trainer's own LLaVA export), which AutoImageProcessor loads."""
    try:
        with open(os.path.join(path, "processor_config.json")) as f:
            return modality != "audio" and isinstance(json.load(f).get("image_processor"), dict)
    except (OSError, ValueError, AttributeError):
        return False


def _processor(key: str, path: str, modality: str) -> Any:
    """The transformers image processor / feature extractor saved in `path`."""
    import transformers
    # From its module: transformers 5.17 without torchvision gives a placeholder that raises at the top
    # level, although the class itself falls back to its PIL processors.
    from transformers.models.auto.image_processing_auto import AutoImageProcessor

    file = "preprocessor_config.json"
    if not os.path.exists(os.path.join(path, file)) and not _nested_image_processor(path, modality):
        raise ConfigError(f"{key}: {path} has no {file} (the {modality} processor); set "
                          f"processor = 'DIR' to a directory that has one")
    try:
        if modality == "audio":
            return transformers.WhisperFeatureExtractor.from_pretrained(path)
        return AutoImageProcessor.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 — transformers raises many kinds
        raise ConfigError(f"{key}: cannot load the {modality} processor of {path}: {e}") from None


def resolve_encoder(config: TrainerConfig, name: str, section: EncoderSection) -> ResolvedEncoder:
    """Encoder `name`'s config, tokens per item and processor (reads small files only)."""
    key = f"model.encoders.{name}"
    if section.factory:
        proc = section.processor and _processor(f"{key}.processor", _directory(f"{key}.processor", section.processor),
                                                section.modality)
        return ResolvedEncoder(name, section, None, section.tokens_per_item, proc)
    if section.hf:
        path = _directory(f"{key}.hf", section.hf)
        kind = read_config(path).get("model_type")
        if section.modality == "audio":
            if kind != "whisper":
                raise ConfigError(f"{key}.hf = {path!r}: model_type {kind!r} is not an audio encoder the "
                                  "library loads (whisper)")
            try:
                audio = AudioConfig.from_hf(path)
            except (ValueError, KeyError) as e:
                raise ConfigError(f"{key}: {e}") from None
            proc = _processor(key, section.processor or path, "audio")
            if proc.feature_size != audio.n_mels:
                raise ConfigError(f"{key}: the feature extractor makes {proc.feature_size} mel bins but the encoder "
                                  f"takes {audio.n_mels}; point {key}.processor at a feature extractor of "
                                  f"{audio.n_mels}")
            if section.variable_length:
                audio, samples = variable_audio(config, name, audio, proc)
                longest = audio.output_length(samples // proc.hop_length)
                return ResolvedEncoder(name, section, audio, longest, proc, clip_samples=samples)
            frames = proc.nb_max_frames
            if frames != audio.max_frames:
                raise ConfigError(f"{key}: the feature extractor gives {frames} frames per clip but the encoder "
                                  f"takes {audio.max_frames}")
            return ResolvedEncoder(name, section, audio, audio.output_length(frames), proc)
        if problem := anyres_problem(path):  # LLaVA-NeXT, -OneVision: not the model the encoder would be
            raise ConfigError(f"{key}.hf = {path!r}: {problem}; here: set {key}.hf to the tower's own SigLIP / "
                              "CLIP directory")
        if kind not in (*_TOWERS, "llava"):
            raise ConfigError(f"{key}.hf = {path!r}: model_type {kind!r} is not a vision tower the library loads "
                              f"(siglip, clip, their vision models, llava); for audio set modality = 'audio'")
        vit = dataclasses.replace(vision_config(f"{key}.hf", path, section.feature_layer),
                                  temporal_patch=section.temporal_patch)
        if kind == "llava":  # its projector loads into the Projection: what load_hf refuses, named now
            try:
                check_projector(path)
            except ValueError as e:
                raise ConfigError(f"{key}.hf: {e}; the library cannot load that projector: use a SigLIP / CLIP "
                                  "directory of the tower (its projection then starts from its seed)") from None
        proc = _processor(key, section.processor or path, "image")
        if section.dynamic_resolution:
            vit, pixels = dynamic_vit(config, name, vit)
            return ResolvedEncoder(name, section, vit, vit.max_patches, proc, image_pixels=pixels)
        _check_image_processor(key, proc, vit)
        return ResolvedEncoder(name, section, vit, vit.num_patches, proc)
    # the library's own encoder
    digits = config.data.format == "digits"
    if section.modality in ("image", "video"):  # a video's frames go through an image tower
        size = section.image_size or (8 if digits else 0)
        if not size:
            raise ConfigError(f"{key}.image_size: a library ViT on conversation data needs its image size")
        if digits:
            _check_digits_vit(key, size, section.patch_size)
        vit = ViTConfig(image_size=size, patch_size=section.patch_size, in_channels=1 if digits else 3,
                        dim=section.dim, n_layers=section.n_layers, n_heads=section.n_heads,
                        mlp_hidden=section.mlp_hidden, temporal_patch=section.temporal_patch)
        if digits:
            if section.dynamic_resolution:
                vit = _digits_dynamic(key, section, vit)
                return ResolvedEncoder(name, section, vit, vit.max_patches)
            return ResolvedEncoder(name, section, vit, vit.num_patches)
        proc = (_processor(key, section.processor, "image") if section.processor
                else _library_image_processor(size))
        if section.dynamic_resolution:
            vit, pixels = dynamic_vit(config, name, vit)
            return ResolvedEncoder(name, section, vit, vit.max_patches, proc, image_pixels=pixels)
        _check_image_processor(key, proc, vit)
        return ResolvedEncoder(name, section, vit, vit.num_patches, proc)
    if digits:
        audio = AudioConfig(n_mels=16, max_frames=16, conv_strides=(2, 2), dim=section.dim, n_layers=section.n_layers,
                            n_heads=section.n_heads, mlp_hidden=section.mlp_hidden,
                            variable_length=section.variable_length)
        return ResolvedEncoder(name, section, audio, audio.output_length(audio.max_frames))
    if not section.processor:
        raise ConfigError(f"{key}: a library audio encoder on conversation data needs processor = 'DIR' (a "
                          "Whisper feature extractor config: mel bins and frames per clip)")
    proc = _processor(key, _directory(f"{key}.processor", section.processor), "audio")
    audio = AudioConfig(n_mels=proc.feature_size, max_frames=proc.nb_max_frames, dim=section.dim,
                        n_layers=section.n_layers, n_heads=section.n_heads, mlp_hidden=section.mlp_hidden)
    if section.variable_length:
        audio, samples = variable_audio(config, name, audio, proc)
        longest = audio.output_length(samples // proc.hop_length)
        return ResolvedEncoder(name, section, audio, longest, proc, clip_samples=samples)
    return ResolvedEncoder(name, section, audio, audio.output_length(audio.max_frames), proc)


def _check_image_processor(key: str, processor: Any, vit: ViTConfig) -> None:
    """Refuse an image processor that does not make every image the tower's size (one resizing
    the shortest edge without a crop, or not resizing: each image its own shape). The launcher's
    probe of one file would pass it where that file is square, and every other image would then
    fail its step."""
    from dtensor_mimo.models.hf.export import image_shape_problem

    if problem := image_shape_problem(processor, vit.image_size):
        raise ConfigError(f"{key}: {problem} (its processor, {key}.processor or the preprocessor_config.json of "
                          f"its hf directory; or set {key}.dynamic_resolution = true to keep each image's shape)")


def _check_digits_vit(key: str, size: int, patch: int) -> None:
    """The digits ViT sees every pixel of a scan: its image (the 8x8 scan enlarged by pixel
    repetition) a multiple of 8, cut into whole patches (a patch convolution drops the pixels past
    the last whole patch)."""
    if size % 8:
        raise ConfigError(f"{key}.image_size = {size}: the digits scans are 8x8, enlarged by pixel repetition; "
                          f"give a multiple of 8 (e.g. {max(8, size // 8 * 8)})")
    if size % patch:
        divisors = [p for p in range(1, size + 1) if size % p == 0 and p <= patch] or [size]
        raise ConfigError(f"{key}.patch_size = {patch} does not divide the scans' image size {size} "
                          f"({key}.image_size): the last {size % patch} pixel rows and columns of every scan would "
                          f"never be seen; give a divisor of {size} (e.g. {divisors[-1]})")


def _digits_dynamic(key: str, section: EncoderSection, vit: ViTConfig) -> ViTConfig:
    """The digits ViT taking scans at their own sizes (`DigitsTask.image_sizes`); max_patches
    defaults to the largest scan's patches and may not be less."""
    from dtensor_mimo.data import DigitsTask

    p = vit.patch_size
    try:
        sizes = DigitsTask().image_sizes(vit.image_size, p)
    except ValueError as e:
        raise ConfigError(f"{key}.dynamic_resolution: {e}") from None
    largest = max((h // p) * (w // p) for h, w in sizes)
    if section.max_patches and section.max_patches < largest:
        raise ConfigError(f"{key}.max_patches = {section.max_patches}: the digits scans at dynamic resolution "
                          f"({', '.join(f'{h}x{w}' for h, w in sizes)} px) give up to {largest} patches of {p}x{p}; "
                          f"raise it to {largest}")
    return dataclasses.replace(vit, dynamic_resolution=True, max_patches=section.max_patches or largest)


def _library_image_processor(size: int) -> Any:
    """A SigLIP-style image processor (resize to `size`, scale to [-1, 1]) for a library ViT."""
    import transformers

    cls = getattr(transformers, "SiglipImageProcessorPil", None) or transformers.SiglipImageProcessor
    return cls(size={"height": size, "width": size})


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
"""A tokenizer directory holds at least one of these (what transformers' tokenizers read)."""


def load_tokenizer(config: TrainerConfig) -> Any:
    """The language model's tokenizer (`data.tokenizer` or `model.language.hf`) with a placeholder
    token for each encoder's modality added (``<image>``, ``<audio>``) when it lacks one."""
    import transformers

    from dtensor_mimo.data.conversation import PLACEHOLDERS

    key = "data.tokenizer" if config.data.tokenizer else f"model.{LANGUAGE}.hf"
    path = _directory(key, config.data.tokenizer or config.model.language.hf)
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ConfigError(f"{key} = {path!r}: no tokenizer files there (none of {', '.join(TOKENIZER_FILES)}); "
                          "point data.tokenizer at the directory that has them (e.g. the instruct model's)")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{key} = {path!r}: no tokenizer transformers can load there ({e})") from None
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{key} = {path!r}: the tokenizer has no chat_template; use a chat (instruct) "
                          "tokenizer, or add a chat template to its tokenizer_config.json")
    wanted = [PLACEHOLDERS[e.modality] for e in config.model.encoders.values()]
    missing = [p for p in wanted if p not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
    return tokenizer


def resolve(config: TrainerConfig) -> ResolvedModel:
    """Every module's config, the tokenizer and the processors, from small files only; a
    ConfigError names the key and the directory."""
    encoders = {n: resolve_encoder(config, n, s) for n, s in config.model.encoders.items()}
    tokenizer = None if config.data.format == "digits" else load_tokenizer(config)
    if config.data.format == "digits":
        from dtensor_mimo.data import TEXT_VOCAB

        vocab = len(TEXT_VOCAB)
    else:
        vocab = len(tokenizer)  # placeholders included: ids past the text's are never looked up
    lang = config.model.language
    language: LlamaConfig | None = None
    hf_paths: dict[str, str] = {}
    if lang.hf:
        path = _directory(f"model.{LANGUAGE}.hf", lang.hf)
        try:
            language = LlamaConfig.from_hf(path)
        except (ValueError, KeyError) as e:
            raise ConfigError(f"model.{LANGUAGE}.hf: {e}") from None
        if lang.untie_embeddings:  # (its head then loads a copy of the embedding: `llama_source`)
            language = dataclasses.replace(language, tie_embeddings=False)
        hf_paths[LANGUAGE] = path
        if tokenizer is not None:
            _check_vocab(config, tokenizer, language.vocab_size)
    elif not lang.factory:
        language = LlamaConfig(vocab_size=vocab, dim=lang.dim, n_layers=lang.n_layers, n_heads=lang.n_heads,
                               n_kv_heads=lang.n_kv_heads, ffn_hidden=lang.ffn_hidden)
    for name, e in encoders.items():
        if e.section.hf:
            hf_paths[name] = e.section.hf
            if language is not None:
                _check_projector_width(name, e.section.hf, language.dim)
    seeds = {LANGUAGE: lang.seed, **{n: config.encoder_seed(n) for n in config.model.encoders}}
    return ResolvedModel(language, encoders, vocab, tokenizer, hf_paths, seeds)


def _check_vocab(config: TrainerConfig, tokenizer: Any, vocab_size: int) -> None:
    """Refuse a language model whose embedding cannot take every text id of the tokenizer (the
    modalities' placeholders aside: their rows come from the encoders): the ranks would find
    such an id only in a batch holding it, after building and loading every module."""
    from dtensor_mimo.data.conversation import PLACEHOLDERS

    # Text ids, and of the added tokens pad, bos and eos: another added token past the embedding
    # (one the chat template writes included) is named by `check_batch` in the first batch holding it
    placeholders, added = set(PLACEHOLDERS.values()), tokenizer.get_added_vocab()
    used = {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id} - {None}
    past = sorted((i, t) for t, i in tokenizer.get_vocab().items()
                  if i >= vocab_size and t not in placeholders and (t not in added or i in used))
    if past:
        key = "data.tokenizer" if config.data.tokenizer else f"model.{LANGUAGE}.hf"
        path = config.data.tokenizer or config.model.language.hf
        shown = ", ".join(f"{t!r} = {i}" for i, t in past[:3])
        raise ConfigError(f"model.{LANGUAGE}.hf = {config.model.language.hf!r}: its vocab_size = {vocab_size} is less "
                          f"than the {past[-1][0] + 1} token ids of the tokenizer ({key} = {path!r}): {len(past)} "
                          f"text token(s) ({shown}, ...) would index past its embedding; use this model's own "
                          f"tokenizer, or a model whose vocab_size is at least {past[-1][0] + 1}")


def _check_projector_width(name: str, path: str, language_dim: int) -> None:
    """Refuse a LLaVA directory whose projector (loaded into the encoder's Projection) does not
    project to the language model's width: `load_hf` would refuse it only inside the ranks."""
    top = read_config(path)
    if top.get("model_type") != "llava":
        return
    width = with_defaults(top.get("text_config") or {"model_type": "llama"}).get("hidden_size")
    if width != language_dim:
        raise ConfigError(f"model.encoders.{name}.hf = {path!r}: its projector projects to its own language "
                          f"model's width, {width}, but model.{LANGUAGE} is {language_dim} wide; use the LLaVA "
                          f"directory's language model (model.{LANGUAGE}.hf = {path!r}), or a tower without a "
                          "projector (a SigLIP / CLIP directory: the projection then starts from its seed)")


def _call_factory(key: str, spec: str, args: dict[str, Any], offered: dict[str, Any]) -> nn.Module:
    """``package.module:function`` called with `args` and whichever `offered` names it accepts."""
    module_name, function_name = spec.split(":")
    try:
        function: Callable[..., Any] = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key}.factory = {spec!r}: {e}") from None
    params = inspect.signature(function).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    extra = {k: v for k, v in offered.items() if (takes_all or k in params) and k not in args}
    module = function(**args, **extra)
    if not isinstance(module, nn.Module):
        raise ConfigError(f"{key}.factory = {spec!r} returned a {type(module).__name__}, not an nn.Module")
    return module


def build_modules(config: TrainerConfig, resolved: ResolvedModel, seq_len: int,
                  meta: bool = True) -> dict[str, nn.Module]:
    """The full modules ``{encoder names..., "language"}`` (on the meta device with `meta`: no
    memory; else initialized from their seeds), frozen towers (and a frozen decoder) marked."""
    lang = config.model.language
    language_dim = resolved.language.dim if resolved.language is not None else None
    modules: dict[str, nn.Module] = {}
    with torch.device("meta" if meta else "cpu"):
        if lang.factory:
            language = _call_factory(f"model.{LANGUAGE}", lang.factory, lang.factory_args,
                                     {"vocab_size": resolved.vocab_size, "seq_len": seq_len})
            language_dim = language.config.dim
        else:
            cfg = resolved.language
            language = Llama(dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, seq_len)))
        for name, e in resolved.encoders.items():
            key = f"model.encoders.{name}"
            if e.section.factory:
                modules[name] = _call_factory(key, e.section.factory, e.section.factory_args,
                                              {"language_dim": language_dim})
                continue
            tower = ViT(e.config) if isinstance(e.config, ViTConfig) else AudioEncoder(e.config)
            modules[name] = ModalityEncoder(tower, Projection(e.config.dim, language_dim))
        modules[LANGUAGE] = language
    if not meta:
        for name, module in modules.items():
            if callable(getattr(module, "init_weights", None)):
                module.init_weights(resolved.seeds[name])
    if lang.frozen:
        modules[LANGUAGE].requires_grad_(False)
    for name, e in resolved.encoders.items():
        if e.section.frozen:  # the tower; its projection to the language width trains
            module = modules[name]
            (module.encoder if isinstance(module, ModalityEncoder) else module).requires_grad_(False)
    return modules


def refuse_nothing_trains(config: TrainerConfig, modules: dict[str, nn.Module]) -> None:
    """Refuse (ConfigError) `modules` (`build_modules`') of which no parameter takes a gradient:
    the run would step an optimizer over nothing, every step, its loss never moving. The same
    verdict on every rank (the same modules), before any collective."""
    if any(p.requires_grad for module in modules.values() for p in module.parameters()):
        return
    frozen = [f"model.{LANGUAGE}.frozen"] if config.model.language.frozen else []
    frozen += [f"model.encoders.{n}.frozen" for n, e in config.model.encoders.items() if e.frozen]
    raise ConfigError(f"no parameter of any module trains ({', '.join(frozen) or 'the modules hold none that does'}"
                      "; a factory's encoder that is not a ModalityEncoder is frozen whole): the run would train "
                      "nothing; unfreeze a module (e.g. drop model.language.frozen), or give the encoder a projection "
                      "that trains (a ModalityEncoder: its tower frozen, its projection trained)")
