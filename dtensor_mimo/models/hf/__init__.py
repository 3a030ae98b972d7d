"""Hugging Face checkpoints in and out: ``config.json`` + safetensors directories.

- `load_hf(module, path)` fills a library module from a checkpoint: a plain module, or one that
  is already parallelized (tp / FSDP2 DTensors, a pipeline stage), in which case each rank reads
  only the checkpoint rows of the blocks it holds.
- `save_hf(module, path)` writes a plain module as a directory that `transformers` loads.

Families: Llama-family decoders into `Llama` (`LlamaConfig.from_hf`). The module's config must
be the checkpoint's (build it with ``Llama(LlamaConfig.from_hf(path))``); a mismatch is named.
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

from dtensor_mimo.models.hf.convert import Source
from dtensor_mimo.models.hf.llama import llama_config_from_hf, llama_config_to_hf, llama_source
from dtensor_mimo.models.hf.safetensors import INDEX, SafetensorsDir, save_file
from dtensor_mimo.models.layers import local_box, local_part, plain_name
from dtensor_mimo.models.llama import Llama

__all__ = ["load_hf", "save_hf"]

# Fields that only bound what the data layer may build: not part of the weights' meaning.
_FREE_FIELDS = {"max_seq_len", "multiple_of"}


@dataclass(frozen=True)
class _Family:
    """How one library module kind maps to Hugging Face: its config both ways, and the `Source`
    of each parameter given the checkpoint's tensors (None when exporting)."""

    config_from_hf: Callable[[str], Any]
    config_to_hf: Callable[[Any, str], dict[str, Any]]
    source: Callable[[str, Any, SafetensorsDir | None], Source]


_FAMILIES: dict[type, _Family] = {
    Llama: _Family(llama_config_from_hf, llama_config_to_hf,
                   lambda name, config, files: llama_source(
                       name, config, tied=files is not None and "lm_head.weight" not in files)),
}


def _family(module: nn.Module) -> _Family:
    for cls, family in _FAMILIES.items():
        if isinstance(module, cls):
            return family
    raise TypeError(f"no Hugging Face conversion for {type(module).__name__}; supported: "
                    + ", ".join(c.__name__ for c in _FAMILIES))


@torch.no_grad()
def load_hf(module: nn.Module, path: str) -> None:
    """Fill `module`'s parameters (this rank's blocks of them) from the checkpoint at `path`.

    Raises before reading any weight when the module's config differs from the checkpoint's
    (naming the fields) or the checkpoint lacks a tensor or has another shape (naming them).
    """
    family = _family(module)
    expected = family.config_from_hf(path)
    differ = [f"{f.name}: module {getattr(module.config, f.name)!r}, checkpoint {getattr(expected, f.name)!r}"
              for f in dataclasses.fields(expected)
              if f.name not in _FREE_FIELDS and getattr(module.config, f.name) != getattr(expected, f.name)]
    if differ:
        raise ValueError(f"load_hf({path!r}): the {type(module).__name__} config differs from the checkpoint's "
                         f"({'; '.join(differ)}); build the module from {type(expected).__name__}.from_hf(path)")
    files = SafetensorsDir(path)
    params = {plain_name(n): p for n, p in module.named_parameters()}
    sources = {n: family.source(n, module.config, files) for n in params}
    missing = sorted(s.name for s in sources.values() if s.name not in files)
    shapes = [f"{s.name}: checkpoint {files.shape(s.name)}, module {tuple(params[n].shape)}"
              for n, s in sources.items() if s.name in files and files.shape(s.name) != tuple(params[n].shape)]
    if missing or shapes:
        raise ValueError(f"load_hf({path!r}): " + "; ".join(
            ([f"missing tensors {missing}"] if missing else []) + ([f"shapes differ: {shapes}"] if shapes else [])))
    for name, param in params.items():
        offset, shape = local_box(param)
        local_part(param).copy_(sources[name].read(files, offset, shape))


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
