"""`export_hf`: a trained `MimoModel` back to Hugging Face ``transformers`` directories.

Collective: every rank of the world calls it with the same arguments, after training. Each rank
describes what it holds (module kinds, configs, pipeline splits: one small ``all_gather_object``,
the only world collective besides the closing barrier), so every rank computes the same
directories, files and index. Then each module stage's writer (its first dp, cp, tp rank)
gathers its parameters one at a time, the other ranks of the stage sending it their shards (point
to point, never a world collective; dp replicas of a module without FSDP2 send nothing), streams
them into that stage's files, and rank 0 writes ``config.json``, the indexes, the tokenizer and
the processors. Only a writer holds a whole tensor, one at a time; a rank writes only what it holds.

What is written:

- **LLaVA-shaped** models — one image encoder, a `ModalityEncoder` of a `ViT` and a `Projection`,
  and a `Llama` — as one LLaVA directory at `path` (`dtensor_mimo.models.hf.llava`):
  ``LlavaForConditionalGeneration`` and ``AutoProcessor`` load it; the tower, projector and
  language model may sit on disjoint ranks or the same ones, the language model may be cut into
  pipeline stages.
- anything else (or ``llava=False``): one directory per module under ``path/<module>/``: the
  language model as its Llama-family directory with the tokenizer; an image tower as a SigLIP
  vision model, an audio tower as a ``WhisperEncoder``, each with its processor (image processor
  / feature extractor), and its projection in ``path/<module>/projector/`` (LLaVA's projector
  names, a small ``config.json`` with the widths, the modality and its special token id).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from dtensor_mimo.models import (AudioConfig, AudioEncoder, Llama, LlamaConfig, ModalityEncoder, Projection, ViT,
                                 ViTConfig)
from dtensor_mimo.models.hf.directory import DEFAULT_SHARD_BYTES, Holder, Part, write_directory
from dtensor_mimo.models.hf.export import (
    ModuleSpec,
    config_to_hf,
    holder,
    module_part,
    module_spec,
    processor_problem,
)
from dtensor_mimo.models.hf.llava import (
    LANGUAGE,
    PROJECTOR,
    VISION,
    image_token,
    llava_directory,
    write_processors,
)
from dtensor_mimo.models.hf.vision import ProjectionShape
from dtensor_mimo.schedule.config import stage_layers

if TYPE_CHECKING:
    from dtensor_mimo.mimo import MimoModel

MODALITIES = {"image": ViT, "audio": AudioEncoder, "video": ViT}
"""The modality names `export_hf` takes, and the tower each needs."""


@dataclass(frozen=True)
class _Described:
    """What a rank holding a module says about it (picklable): the tower's or language model's
    spec, the projection's (if this rank holds it), blocks per pipeline stage (None: whole), or
    why the module has no Hugging Face form."""

    main: ModuleSpec | None = None
    projection: ModuleSpec | None = None
    split: tuple[int, ...] | None = None
    unsupported: str | None = None


@dataclass
class _Directory:
    """One directory to write: its parts, ``config.json``, extra files, and this rank's holders."""

    path: str
    parts: list[Part]
    config: dict[str, Any]
    holders: dict[str, Holder]
    extras: Callable[[str], None] | None = None


def export_hf(model: MimoModel, path: str, *, modalities: Mapping[str, str], special_token_ids: Mapping[str, int],
              tokenizer: Any = None, processors: Mapping[str, object] | None = None,
              dtype: torch.dtype | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
              llava: bool | None = None) -> None:
    """Write `model` as Hugging Face directories under `path` (see the module docstring).

    Args:
        model: the trained `MimoModel` (any layout: tp, FSDP2, pipeline stages, colocated or
            disjoint modules, frozen towers).
        path: the output directory (shared by every rank's filesystem).
        modalities: ``{encoder name: "image" | "audio" | "video"}``, every encoder of the model.
        special_token_ids: ``{encoder name: id}``: the placeholder ids the model was trained with
            (the LLaVA image token; recorded next to a projector otherwise).
        tokenizer: a transformers tokenizer, saved with the language model (for LLaVA it needs a
            token with the image token id).
        processors: ``{encoder name: transformers image processor / feature extractor}``.
        dtype: what the tensors are written in; None: each module's parameters' dtype.
        max_shard_bytes: the largest safetensors file (a file never mixes pipeline stages).
        llava: None: a LLaVA directory when the model is LLaVA-shaped, else one per module; True:
            require LLaVA (raise naming why not); False: one directory per module.

    Raises before anything is written, on every rank, naming the module: encoders or language
    models without a Hugging Face form, a modality that does not match its tower, what LLaVA
    or a family cannot express. Returns when the whole directory is written (a closing barrier).
    """
    rank = dist.get_rank()
    processors = dict(processors or {})
    _check_arguments(model, modalities, special_token_ids, processors, llava)
    if model.uninitialized:  # the same set on every rank
        raise RuntimeError(f"export_hf: modules {sorted(model.uninitialized)} were built on the meta device and never "
                           "initialized; call model.init_weights / model.load_hf (or train) before exporting")
    # A forward without backward leaves FSDP2 roots gathered: their registered parameters are then
    # the gathered copies, in the compute dtype (param_dtype), not the fp32 shards (no communication).
    model.reshard()
    try:
        local, problem = _describe(model, rank, dtype), None
    except Exception as error:  # noqa: BLE001 - reported on every rank below
        local, problem = {}, f"rank {rank}: {error}"
    described: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(described, (local, problem))
    problems = [p for _, p in described if p]
    if problems:
        raise ValueError("export_hf: " + "; ".join(problems))
    merged = _merge(model.module_names, [d for d, _ in described])
    unsupported = {n: d.unsupported for n, d in merged.items() if d.unsupported}
    if unsupported:
        raise TypeError("export_hf: " + "; ".join(f"module {n!r} is {why}" for n, why in unsupported.items())
                        + "; Hugging Face export knows ModalityEncoder(ViT | AudioEncoder, Projection) encoders and "
                        "Llama language models: save the others' weights yourself")
    wrong = [f"{n!r} is {modalities[n]!r} but its tower is a {merged[n].main.kind.__name__}"
             for n in model.encoder_names if merged[n].main.kind is not MODALITIES[modalities[n]]]
    if wrong:
        raise ValueError("export_hf: modalities " + "; ".join(wrong) + " (image, video: ViT; audio: AudioEncoder)")
    bad = [f"{n!r}: {problem}" for n, p in processors.items() if (problem := processor_problem(p, merged[n].main))]
    if bad:
        raise ValueError("export_hf: processors " + "; ".join(bad))
    shaped = _llava_shape_problem(model.encoder_names, modalities, merged)
    if llava and shaped:
        raise ValueError(f"export_hf(llava=True): the model is not LLaVA-shaped: {shaped}")
    if llava is False or shaped:
        directories = _module_directories(model, path, rank, merged, modalities, special_token_ids, tokenizer,
                                          processors)
    else:
        directories = [_llava_directory(model, path, rank, merged, special_token_ids, tokenizer, processors)]
    error = None
    for d in directories:  # every directory, even after a failure: its gathers are collectives
        try:
            write_directory(d.path, d.parts, d.holders, max_shard_bytes=max_shard_bytes, metadata_writer=rank == 0,
                            config=d.config, extras=d.extras)
        except Exception as caught:  # noqa: BLE001 - every rank learns of it at the barrier
            error = error or caught
    verdict = torch.tensor([float(error is not None)], device=model.device)
    dist.all_reduce(verdict)  # also the barrier: the directory is complete when any rank returns
    if error is not None:
        raise error
    if verdict.item():
        raise RuntimeError(f"export_hf: {int(verdict.item())} rank(s) failed writing {path!r} (their errors name "
                           "the problem); the directory is incomplete")


def kind_problem(modules: Mapping[str, nn.Module]) -> str | None:
    """Why `modules` (the trainer's, built on the meta device) could not be exported, or None: a
    module, or a `ModalityEncoder`'s tower or projection, of a kind no Hugging Face directory
    holds (a factory's). Known once they are built, before the first step: not after the last."""
    for name, module in modules.items():
        parts = [module.encoder, module.projection] if isinstance(module, ModalityEncoder) else [module]
        for part in filter(None, parts):  # (a ModalityEncoder without a projection exports its tower)
            try:
                module_spec(part, torch.float32)
            except TypeError as e:
                return f"module {name!r}: {e}"
    return None


def config_problem(language: LlamaConfig, towers: Mapping[str, ViTConfig | AudioConfig],
                   modalities: Mapping[str, str], processors: Mapping[str, object] | None = None) -> str | None:
    """Why `export_hf` would refuse a model of a `Llama` of config `language` and an encoder per
    `towers` entry (its tower's config, then a `Projection` to the language width, as the
    trainer builds them), with `processors` (``{encoder name: processor}``, as the trainer passes
    them), or None. Pure, from the configs alone: a run that ends with an export learns before
    its first step, not after its last, that the export cannot be written."""
    dtype = torch.float32  # what a family cannot express does not depend on it
    language_spec = ModuleSpec(Llama, language, dtype)
    merged = {name: _Described(ModuleSpec(ViT if isinstance(c, ViTConfig) else AudioEncoder, c, dtype),
                               ModuleSpec(Projection, ProjectionShape(c.dim, language.dim, language.dim), dtype))
              for name, c in towers.items()}
    bad = [f"{n!r}: {problem}" for n, p in (processors or {}).items()
           if n in merged and (problem := processor_problem(p, merged[n].main))]
    if bad:
        return "processors " + "; ".join(bad)
    try:
        if _llava_shape_problem(list(towers), modalities, merged) is None:
            (vision,) = merged.values()
            llava_directory(vision.main, vision.projection, language_spec, image_token_id=language.vocab_size)
        else:
            for spec in (language_spec, *(s for d in merged.values() for s in (d.main, d.projection))):
                config_to_hf(spec)
    except (TypeError, ValueError) as error:
        return str(error)
    return None


def _check_arguments(model: MimoModel, modalities: Mapping[str, str], special_token_ids: Mapping[str, int],
                     processors: Mapping[str, object], llava: bool | None) -> None:
    """Pure checks of the arguments against the model (the same verdict on every rank)."""
    encoders = list(model.encoder_names)
    problems = []
    if set(modalities) != set(encoders):
        problems.append(f"modalities names {sorted(modalities)}, the model's encoders are {encoders}")
    bad = {n: m for n, m in modalities.items() if m not in MODALITIES}
    if bad:
        problems.append(f"modalities {bad} are not one of {sorted(MODALITIES)}")
    missing = [n for n in encoders if n not in special_token_ids]
    if missing:
        problems.append(f"special_token_ids has no id for {missing}")
    unknown = [n for n in processors if n not in encoders]
    if unknown:
        problems.append(f"processors given for {unknown}, which are not encoders of the model ({encoders})")
    if llava not in (None, True, False):
        problems.append(f"llava={llava!r} must be None, True or False")
    if problems:
        raise ValueError("export_hf: " + "; ".join(problems))


def _language_modules(model: MimoModel) -> list[nn.Module]:
    """This rank's modules of the language model: its pipeline stages (the whole decoder at pp = 1), or none."""
    return [stage.llama for stage in model.language_stages]


def _split(model: MimoModel, name: str, n_layers: int, stages: int) -> tuple[int, ...] | None:
    """Blocks per pipeline stage of module `name` (None: one stage)."""
    if stages == 1:
        return None
    split = model.pipeline.split if name == model.language_name else None
    return tuple(len(r) for r in stage_layers(n_layers, stages, split, module=name))


def _describe(model: MimoModel, rank: int, dtype: torch.dtype | None) -> dict[str, _Described]:
    """What this rank holds of each module."""
    out: dict[str, _Described] = {}
    layout = model.layout
    for name in model.module_names:
        if not layout.is_member(name, rank):
            continue
        pp = layout.parallelism(name).pp
        if name == model.language_name:
            modules = _language_modules(model)
            if not isinstance(modules[0], Llama):
                out[name] = _Described(unsupported=f"a {type(modules[0]).__name__}, not a Llama")
                continue
            spec = module_spec(modules[0], dtype)
            stages = model.pipeline.num_stages(pp)
            out[name] = _Described(spec, None, _split(model, name, spec.config.n_layers, stages))
            _check_held(modules, spec, out[name].split, name)
            continue
        encoder = model.encoders[name]
        if not (isinstance(encoder, ModalityEncoder) and isinstance(encoder.encoder, (ViT, AudioEncoder))
                and isinstance(encoder.projection, (Projection, type(None)))):
            kind = (f"a ModalityEncoder({type(encoder.encoder).__name__}, {type(encoder.projection).__name__})"
                    if isinstance(encoder, ModalityEncoder) else f"a {type(encoder).__name__}")
            out[name] = _Described(unsupported=kind)
            continue
        tower = module_spec(encoder.encoder, dtype)
        projection = None if encoder.projection is None else module_spec(encoder.projection, dtype)
        out[name] = _Described(tower, projection, _split(model, name, tower.config.n_layers, pp))
        _check_held([encoder.encoder], tower, out[name].split, name)
        if projection is not None:
            _check_held([encoder.projection], projection, None, name)
    return out


def _check_held(modules: list[nn.Module], spec: ModuleSpec, split: tuple[int, ...] | None, name: str) -> None:
    """Raise unless `modules` hold whole pipeline stages of the module of `spec` (a rank-local
    verdict: `export_hf` gathers it before any rank writes)."""
    holder(modules, module_part(spec, name, layer_split=split, module=f"{name!r} {spec.kind.__name__}"), False)


def _merge(names: list[str], described: list[dict[str, _Described]]) -> dict[str, _Described]:
    """One description per module from every rank's (a projection is known to the ranks of the
    encoder's last stage only)."""
    merged: dict[str, _Described] = {}
    for name in names:
        found = [d[name] for d in described if name in d]
        why = next((d.unsupported for d in found if d.unsupported), None)
        if why:
            merged[name] = _Described(unsupported=why)
            continue
        projection = next((d.projection for d in found if d.projection is not None), None)
        merged[name] = dataclasses.replace(found[0], projection=projection)
    return merged


def _llava_shape_problem(encoder_names: list[str], modalities: Mapping[str, str],
                         merged: Mapping[str, _Described]) -> str | None:
    """Why the model of these encoders is not LLaVA-shaped, or None."""
    if len(encoder_names) != 1:
        return f"it has {len(encoder_names)} encoders ({encoder_names}), LLaVA one image encoder"
    name = encoder_names[0]
    if modalities[name] != "image":
        return f"its encoder {name!r} is {modalities[name]!r}, LLaVA's is an image encoder"
    if merged[name].projection is None:
        return f"its encoder {name!r} has no Projection"
    return None


def _writer(model: MimoModel, name: str, rank: int) -> bool:
    """This rank writes module `name`'s files of its pipeline stage: the first of its dp, cp, tp."""
    c = model.layout.coordinate(name, rank)
    return c is not None and c["dp"] == c["cp"] == c["tp"] == 0


def _holder(model: MimoModel, name: str, rank: int, modules: list[nn.Module], part: Part) -> Holder:
    """This rank's `Holder` of `part` of module `name`: its stage's writer (`_writer`) gathers
    each tensor, the other ranks send it their shards."""
    stage = model.layout.coordinate(name, rank)["pp"]
    writer_rank = model.layout.groups(name, ("dp", "cp", "tp"))[stage][0]
    return holder(modules, part, _writer(model, name, rank), writer_rank)


def _held(model: MimoModel, name: str, rank: int, part: str) -> list[nn.Module]:
    """This rank's modules of `part` ("tower", "projection", "language") of module `name`."""
    if not model.layout.is_member(name, rank):
        return []
    if name == model.language_name:
        return _language_modules(model)
    encoder = model.encoders[name]
    module = encoder.encoder if part == "tower" else encoder.projection
    return [] if module is None else [module]


def _llava_directory(model: MimoModel, path: str, rank: int, merged: Mapping[str, _Described],
                     special_token_ids: Mapping[str, int], tokenizer: Any,
                     processors: Mapping[str, object]) -> _Directory:
    name, lang = model.encoder_names[0], model.language_name
    vision, language = merged[name], merged[lang]
    llava = llava_directory(vision.main, vision.projection, language.main,
                            image_token_id=special_token_ids[name], vision_split=vision.split,
                            language_split=language.split)
    if tokenizer is not None:
        image_token(tokenizer, special_token_ids[name])  # every rank refuses before anything is written
    modules = {VISION: (name, "tower"), PROJECTOR: (name, "projection"), LANGUAGE: (lang, "language")}
    parts = {part.key: part for part in llava.parts}
    holders = {}
    for key, (module, what) in modules.items():
        held = _held(model, module, rank, what)
        if held:
            holders[key] = _holder(model, module, rank, held, parts[key])
    image_processor = processors.get(name)
    return _Directory(path, llava.parts, llava.config, holders,
                      lambda p: write_processors(p, llava, tokenizer, image_processor))


def _module_directories(model: MimoModel, path: str, rank: int, merged: Mapping[str, _Described],
                        modalities: Mapping[str, str], special_token_ids: Mapping[str, int], tokenizer: Any,
                        processors: Mapping[str, object]) -> list[_Directory]:
    """One directory per module (and one per projection), every config computed (and refused)
    before any is written."""
    directories = []
    for name in model.module_names:
        d = merged[name]
        main = "language" if name == model.language_name else "tower"
        part = module_part(d.main, "module", layer_split=d.split, module=f"{name!r} {d.main.kind.__name__}")
        held = _held(model, name, rank, main)
        holders = {"module": _holder(model, name, rank, held, part)} if held else {}
        extra = tokenizer if name == model.language_name else processors.get(name)
        config = config_to_hf(d.main)
        if name == model.language_name and tokenizer is not None:  # transformers' generate stops at its eos
            config |= {f: getattr(tokenizer, f) for f in ("bos_token_id", "eos_token_id", "pad_token_id")
                       if getattr(tokenizer, f, None) is not None}
        directories.append(_Directory(os.path.join(path, name), [part], config, holders,
                                      None if extra is None else extra.save_pretrained))
        if name == model.language_name or d.projection is None:
            continue
        part = module_part(d.projection, "module", module=f"{name!r} Projection")
        held = _held(model, name, rank, "projection")
        holders = {"module": _holder(model, name, rank, held, part)} if held else {}
        config = {**config_to_hf(d.projection), "modality": modalities[name],
                  "special_token_id": special_token_ids[name]}
        directories.append(_Directory(os.path.join(path, name, "projector"), [part], config, holders))
    return directories
