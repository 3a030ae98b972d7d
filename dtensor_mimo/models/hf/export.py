"""From library modules to the `Part`s and ``config.json`` of a Hugging Face directory.

A module is described by a `ModuleSpec` (its kind, config and dtype: small, picklable, the same
on every rank that knows it), from which every checkpoint name, shape and file follows without
the weights — so ranks that hold other stages or other modules compute the same directory plan.
`module_part` lists the checkpoint tensors of a module (its pipeline stages' groups given the
layers per stage); `holder` says what this rank holds of it.

Stages: a module's blocks live in ``layers.{i}``; parameters before the first block (embeddings)
belong to the first stage, those after the last block (final norm, head) to the last, as
`dtensor_mimo.models.protocol.decoder_stage` and the encoder stages cut them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dtensor_mimo.models.audio import AudioEncoder
from dtensor_mimo.models.hf.audio import audio_skipped, audio_source, whisper_config_to_hf
from dtensor_mimo.models.hf.convert import Source
from dtensor_mimo.models.hf.directory import FIRST, Entry, Holder, Part
from dtensor_mimo.models.hf.llama import llama_config_to_hf, llama_source
from dtensor_mimo.models.hf.vision import (
    ProjectionShape,
    projection_source,
    projector_config_to_hf,
    vit_config_to_hf,
    vit_source,
)
from dtensor_mimo.models.layers import plain_name
from dtensor_mimo.models.llama import Llama
from dtensor_mimo.models.projection import Projection
from dtensor_mimo.models.vit import ViT

EXPORTED = (Llama, ViT, AudioEncoder, Projection)


@dataclass(frozen=True)
class ModuleSpec:
    """What exporting a module needs besides its weights: its kind (`Llama`, `ViT`,
    `AudioEncoder`, `Projection`), its config (for a `Projection`: its `ProjectionShape`) and the
    dtype its tensors are written in."""

    kind: type
    config: Any
    dtype: torch.dtype

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def module_spec(module: nn.Module, dtype: torch.dtype | None = None) -> ModuleSpec:
    """The `ModuleSpec` of `module` (plain, parallelized or a pipeline stage: the config is the
    whole module's); `dtype` None: its parameters' dtype."""
    kind = next((k for k in EXPORTED if isinstance(module, k)), None)
    if kind is None:
        raise TypeError(f"no Hugging Face export for {type(module).__name__}; supported: "
                        + ", ".join(k.__name__ for k in EXPORTED))
    if dtype is None:
        dtypes = {p.dtype for p in module.parameters()}
        if len(dtypes) != 1:
            raise ValueError(f"the {kind.__name__}'s parameters have dtypes {sorted(map(str, dtypes))}; pass "
                             "dtype= to write them in one (unless a forward without backward left an FSDP2 root "
                             "gathered, its parameters then the copies in param_dtype: call MimoModel.reshard(), "
                             "or reshard() on the root, first)")
        dtype = dtypes.pop()
    if kind is Projection:
        config: Any = ProjectionShape(module.fc1.in_features, module.fc1.out_features, module.fc2.out_features)
    else:
        config = module.config
    return ModuleSpec(kind, config, dtype)


def whole_module(spec: ModuleSpec) -> nn.Module:
    """The whole module of `spec` on the meta device (its parameter names and shapes)."""
    with torch.device("meta"):
        if spec.kind is Projection:
            c = spec.config
            return Projection(c.in_dim, c.out_dim, c.hidden_dim)
        return spec.kind(spec.config)


def _source_of(spec: ModuleSpec) -> Callable[[str], Source]:
    if spec.kind is Llama:
        return lambda name: llama_source(name, spec.config, tied=False)
    if spec.kind is ViT:
        return vit_source
    if spec.kind is AudioEncoder:
        return audio_source
    return projection_source


def config_to_hf(spec: ModuleSpec) -> dict[str, Any]:
    """The ``config.json`` of a directory holding the module of `spec` alone."""
    if spec.kind is Llama:
        return llama_config_to_hf(spec.config, spec.dtype_name)
    if spec.kind is ViT:
        return vit_config_to_hf(spec.config, spec.dtype_name)
    if spec.kind is AudioEncoder:
        return whisper_config_to_hf(spec.config, spec.dtype_name)
    return projector_config_to_hf(spec.config, spec.dtype_name)


def stage_of_names(names: Sequence[str], layer_split: Sequence[int] | None, module: str) -> list[int]:
    """The pipeline stage of each parameter name of a whole module (`layer_split`: blocks per
    stage, None: one stage)."""
    layer = [re.match(r"layers\.(\d+)\.", n) for n in names]
    n_layers = len({m.group(1) for m in layer if m})
    if layer_split is None:
        return [0] * len(names)
    if sum(layer_split) != n_layers or any(n < 1 for n in layer_split):
        raise ValueError(f"layer_split={tuple(layer_split)} does not cut the {module}'s {n_layers} layers into "
                         "stages of at least one layer each")
    first_stage, bound = [], 0
    for s, n in enumerate(layer_split):
        first_stage += [s] * n
        bound += n
    stages, seen_layer = [], False
    for m in layer:
        if m:
            seen_layer = True
            stages.append(first_stage[int(m.group(1))])
        else:
            stages.append(len(layer_split) - 1 if seen_layer else 0)
    return stages


def module_part(spec: ModuleSpec, key: str, *, prefix: str = "", layer_split: Sequence[int] | None = None,
                extra_rows: Mapping[str, int] | None = None,
                constants: Sequence[tuple[str, tuple[int, ...], float]] = (), module: str | None = None) -> Part:
    """The checkpoint tensors of the module of `spec`, names under `prefix`, in one group per
    stage (`layer_split`: blocks per stage; None: the module is whole). `extra_rows`: zero rows
    appended to these parameters; `constants`: tensors ``(name, shape, value)`` the module does
    not have, added to its last stage."""
    module = module or spec.kind.__name__
    whole = dict(whole_module(spec).named_parameters())
    source = _source_of(spec)
    skipped = {n for n in whole if spec.kind is AudioEncoder and audio_skipped(n, spec.config)}
    names = [n for n in whole if n not in skipped]
    stages = stage_of_names(names, layer_split, module)
    n_stages = 1 if layer_split is None else len(layer_split)
    groups: list[list[Entry]] = [[] for _ in range(n_stages)]
    extra_rows = extra_rows or {}
    for name, stage in zip(names, stages):
        src = source(name)
        shape = tuple(whole[name].shape)
        extra = extra_rows.get(name, 0)
        if extra:
            shape = (shape[0] + extra, *shape[1:])
        groups[stage].append(Entry(Source(prefix + src.name, src.rotary_head_dim), shape, name, extra))
    for name, shape, value in constants:
        groups[-1].append(Entry(Source(prefix + name), tuple(shape), None, fill=value))
    return Part(key, tuple(tuple(g) for g in groups), spec.dtype, module, frozenset(skipped))


def held_stages(part: Part, params: Mapping[str, torch.Tensor]) -> list[int]:
    """The stages whose parameters are all in `params` (which `check_holder` then requires to be
    exactly theirs)."""
    held = set(params)
    stages = [s for s, group in enumerate(part.groups)
              if all(e.param in held for e in group if e.param is not None)]
    covered = {e.param for s in stages for e in part.groups[s]} | part.skipped
    if not stages or held - covered:
        whole = {e.param for g in part.groups for e in g if e.param is not None}
        hint = ("it holds part of the module (a pipeline stage?): pass layer_split (blocks per stage) so that the "
                "stages write one directory together" if len(part.groups) == 1 else
                "its parameters are not whole stages of that split")
        raise ValueError(f"the {part.module} holds {len(held & whole)} of the {len(whole)} parameters of the "
                         f"whole module; {hint}")
    return stages


def first_of_meshes(params: Sequence[torch.Tensor]) -> bool:
    """Whether this rank is the first (coordinate 0 on every dim) of the mesh of every DTensor
    in `params` (True for plain tensors only): the default writer."""
    for param in params:
        if isinstance(param, DTensor):
            coordinate = param.device_mesh.get_coordinate()
            if coordinate is None or any(coordinate):
                return False
    return True


def holder(modules: Sequence[nn.Module], part: Part, writer: bool | None = None,
           writer_rank: int | None = None) -> Holder:
    """What this rank holds of `part` in `modules` (one module, or a rank's several pipeline
    stages of it); `writer` None: `first_of_meshes`. `writer_rank`: the global rank that writes
    these stages, where each tensor is gathered (the other ranks send their shards); None: the
    first rank of each tensor's mesh when `writer` is None, else every rank gathers it."""
    params = {plain_name(n): p for m in modules for n, p in m.named_parameters()}
    stages = held_stages(part, params)
    if writer is None:
        return Holder(params, stages, first_of_meshes(list(params.values())),
                      FIRST if writer_rank is None else writer_rank)
    return Holder(params, stages, writer, writer_rank)


def _sides(size: Any) -> set[Any]:
    return {size.get(k) if isinstance(size, Mapping) else getattr(size, k, None) for k in ("height", "width")}


def image_processor_problem(processor: Any, image_size: int) -> str | None:
    """Why `processor` (a transformers image processor) does not make every image
    `image_size` x `image_size` pixels, as far as its attributes tell (its crop, else its resize),
    or None."""
    crop = getattr(processor, "crop_size", None) if getattr(processor, "do_center_crop", False) else None
    made = crop or (getattr(processor, "size", None) if getattr(processor, "do_resize", True) else None)
    sides = _sides(made) - {None}
    if sides and sides != {image_size}:
        return (f"the image processor makes {dict(height=min(sides), width=max(sides))} images but the ViT takes "
                f"{image_size}x{image_size}: set its size (and crop_size, if it crops) to "
                f"{{'height': {image_size}, 'width': {image_size}}}")
    return image_shape_problem(processor, image_size)


def image_shape_problem(processor: Any, image_size: int) -> str | None:
    """Why `processor` (a transformers image processor) makes images of their own shapes rather
    than one size (a resize to a shortest / longest edge without a center crop, or none), said
    for a ViT of `image_size`, or None."""
    crop = getattr(processor, "crop_size", None) if getattr(processor, "do_center_crop", False) else None
    resize, size = getattr(processor, "do_resize", True), getattr(processor, "size", None)
    if crop is not None or not hasattr(processor, "size") or resize and (size is None or _sides(size) - {None}):
        return None
    square = f"{{'height': {image_size}, 'width': {image_size}}}"
    keys = ("height", "width", "shortest_edge", "longest_edge")
    given = size.items() if isinstance(size, Mapping) else ((k, getattr(size, k, None)) for k in keys)
    how = (f"resizes to size={ {k: v for k, v in given if v is not None} }" if resize
           else "does not resize (do_resize=False)")
    return (f"the image processor {how} and does not center crop: each image keeps its own aspect ratio or size "
            f"(a 16x40 image does not become square), but the ViT takes {image_size}x{image_size}: set its size "
            f"to {square} (or do_center_crop=True with crop_size={square})")


def processor_problem(processor: Any, spec: ModuleSpec) -> str | None:
    """Why `processor` (a transformers image processor / feature extractor) cannot feed the tower
    of `spec`, as far as its attributes tell (an image size other than the ViT's, or none: each
    image its own shape; a mel count other than the audio encoder's), or None."""
    if spec.kind is ViT:
        return image_processor_problem(processor, spec.config.image_size)
    if spec.kind is AudioEncoder:
        mels = getattr(processor, "feature_size", None)
        if mels is not None and mels != spec.config.n_mels:
            return (f"the feature extractor makes {mels} mel bins but the AudioEncoder takes {spec.config.n_mels}; "
                    f"give it feature_size={spec.config.n_mels}")
        # The exported WhisperEncoder takes clips of exactly 2 * max_source_positions frames.
        frames = getattr(processor, "nb_max_frames", None)
        wanted = 2 * spec.config.output_length(spec.config.max_frames)
        if frames is not None and frames != wanted:
            return (f"the feature extractor makes clips of {frames} frames but the AudioEncoder's Whisper encoder "
                    f"takes {wanted} (max_frames={spec.config.max_frames}); give it chunk_length, sampling_rate and "
                    f"hop_length with chunk_length * sampling_rate // hop_length = {wanted}")
    return None
