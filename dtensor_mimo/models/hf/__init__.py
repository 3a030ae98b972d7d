"""Hugging Face checkpoints in and out: ``config.json`` + safetensors directories.

- `load_hf(module, path)` fills a library module from a checkpoint: a plain module, or one that
  is already parallelized (tp / FSDP2 DTensors, a pipeline stage), in which case each rank reads
  only the checkpoint rows of the blocks it holds.
- `save_hf(module, path)` writes a plain module as a directory that `transformers` loads.

Families: Llama-family decoders into `Llama` (`LlamaConfig.from_hf`), SigLIP / CLIP vision towers
into `ViT` (`ViTConfig.from_hf`), Whisper's encoder into `AudioEncoder` (`AudioConfig.from_hf`),
LLaVA's projector into `Projection`. A checkpoint may hold
several (a LLaVA directory: tower, projector and language model); each module finds its tensors
under whatever prefix they carry. The module's config must be the checkpoint's (build it with
e.g. ``Llama(LlamaConfig.from_hf(path))``); a mismatch is named.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dtensor_mimo.models.audio import AudioEncoder
from dtensor_mimo.models.hf.audio import AUDIO_ANCHOR, audio_config_from_hf, audio_source
from dtensor_mimo.models.hf.convert import Source
from dtensor_mimo.models.hf.llama import llama_config_from_hf, llama_config_to_hf, llama_source
from dtensor_mimo.models.hf.safetensors import INDEX, SafetensorsDir, save_file
from dtensor_mimo.models.hf.vision import (
    PROJECTOR_ANCHOR,
    VIT_ANCHOR,
    check_projector,
    projection_source,
    vit_config_from_hf,
    vit_config_to_hf,
    vit_source,
)
from dtensor_mimo.models.layers import local_box, local_part, plain_name
from dtensor_mimo.models.llama import Llama
from dtensor_mimo.models.projection import Projection
from dtensor_mimo.models.vit import ViT

__all__ = ["has_hf_module", "load_hf", "plan_hf", "save_hf"]

# Fields that only bound what the data layer may build: not part of the weights' meaning.
_FREE_FIELDS = {"max_seq_len", "multiple_of"}


@dataclass(frozen=True)
class _Family:
    """How one library module kind maps to Hugging Face: its config both ways (None: no config
    of its own), the `Source` of each parameter relative to the module's tensors in the
    checkpoint (`has` tells which relative names exist; None when exporting), and an `anchor`
    tensor whose full name reveals that prefix."""

    config_from_hf: Callable[[str], Any]  # None returned: no config of its own (only checked)
    config_to_hf: Callable[[Any, str], dict[str, Any]] | None
    source: Callable[[str, Any, Callable[[str], bool] | None], Source]
    anchor: str


_FAMILIES: dict[type, _Family] = {
    Llama: _Family(llama_config_from_hf, llama_config_to_hf,
                   lambda name, config, has: llama_source(name, config, tied=has is not None and not has("lm_head.weight")),
                   "model.embed_tokens.weight"),
    ViT: _Family(vit_config_from_hf, vit_config_to_hf, lambda name, config, has: vit_source(name), VIT_ANCHOR),
    Projection: _Family(check_projector, None, lambda name, config, has: projection_source(name), PROJECTOR_ANCHOR),
    AudioEncoder: _Family(audio_config_from_hf, None, lambda name, config, has: audio_source(name), AUDIO_ANCHOR),
}


def _family(module: nn.Module) -> _Family:
    for cls, family in _FAMILIES.items():
        if isinstance(module, cls):
            return family
    raise TypeError(f"no Hugging Face conversion for {type(module).__name__}; supported: "
                    + ", ".join(c.__name__ for c in _FAMILIES))


def _prefix(files: SafetensorsDir, anchor: str, path: str) -> str:
    """The prefix the checkpoint puts before a module's tensor names ("" for a plain model)."""
    found = [n[:-len(anchor)] for n in files.names() if n == anchor or n.endswith("." + anchor)]
    if len(found) != 1:
        raise ValueError(f"load_hf({path!r}): {'no' if not found else 'several'} tensors named *{anchor} "
                         f"({found}); the checkpoint does not hold exactly one such module")
    return found[0]


def has_hf_module(module_type: type, path: str) -> bool:
    """Whether the checkpoint directory `path` holds tensors of a `module_type` (e.g. whether a
    vision checkpoint also holds LLaVA's projector)."""
    anchor = _FAMILIES[module_type].anchor
    return any(n == anchor or n.endswith("." + anchor) for n in SafetensorsDir(path).names())


@torch.no_grad()
def load_hf(module: nn.Module, path: str) -> None:
    """Fill `module`'s parameters (this rank's blocks of them) from the checkpoint at `path`.

    Raises before reading any weight when the module's config differs from the checkpoint's
    (naming the fields) or the checkpoint lacks a tensor or has another shape (naming them).
    """
    plan_hf(module, path)()


def plan_hf(module: nn.Module, path: str) -> Callable[[], None]:
    """`load_hf` in two steps: every check now (reading only ``config.json`` and the safetensors
    headers), the weights when the returned function is called — so that ranks can agree that
    every check passed before any of them reads."""
    family = _family(module)
    config = getattr(module, "config", None)
    expected = family.config_from_hf(path)
    if expected is not None:
        differ = [f"{f.name}: module {getattr(config, f.name)!r}, checkpoint {getattr(expected, f.name)!r}"
                  for f in dataclasses.fields(expected)
                  if f.name not in _FREE_FIELDS and getattr(config, f.name) != getattr(expected, f.name)]
        if differ:
            raise ValueError(f"load_hf({path!r}): the {type(module).__name__} config differs from the checkpoint's "
                             f"({'; '.join(differ)}); build the module from {type(expected).__name__}.from_hf(path)")
    files = SafetensorsDir(path)
    prefix = _prefix(files, family.anchor, path)
    params = {plain_name(n): p for n, p in module.named_parameters()}
    relative = {n: family.source(n, config, lambda name: prefix + name in files) for n in params}
    sources = {n: dataclasses.replace(s, name=prefix + s.name) for n, s in relative.items()}
    missing = sorted(s.name for s in sources.values() if s.name not in files)
    shapes = [f"{s.name}: checkpoint {files.shape(s.name)}, module {tuple(params[n].shape)}"
              for n, s in sources.items() if s.name in files and files.shape(s.name) != tuple(params[n].shape)]
    if missing or shapes:
        raise ValueError(f"load_hf({path!r}): " + "; ".join(
            ([f"missing tensors {missing}"] if missing else []) + ([f"shapes differ: {shapes}"] if shapes else [])))

    @torch.no_grad()
    def fill() -> None:
        for name, param in params.items():
            offset, shape = local_box(param)
            local_part(param).copy_(sources[name].read(files, offset, shape))

    return fill


@torch.no_grad()
def save_hf(module: nn.Module, path: str, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write the plain `module` to the directory `path` (created) as ``config.json`` and
    safetensors files of at most `max_shard_bytes` each (an index when there are several), in
    its parameters' dtype; `transformers` loads it back with the same outputs."""
    params = {plain_name(n): p for n, p in module.named_parameters()}
    sharded = [n for n, p in params.items() if isinstance(p, DTensor)]
    if sharded:
        raise ValueError(f"save_hf takes a plain module; {sharded[:3]} are DTensors (save the single-process "
                         "module, or the training checkpoint with dtensor_mimo.train.checkpoint)")
    family = _family(module)
    if family.config_to_hf is None:
        raise ValueError(f"save_hf: exporting a {type(module).__name__} is not supported (a projector lives "
                         "inside a multimodal checkpoint; a Whisper encoder inside its encoder-decoder)")
    tensors = {}
    for name, param in params.items():
        source = family.source(name, module.config, None)
        tensors[source.name] = source.write(param.detach())
    dtype = str(next(iter(params.values())).dtype).removeprefix("torch.")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(family.config_to_hf(module.config, dtype), f, indent=2)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"))
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, file))
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
