"""Hugging Face checkpoints in and out: ``config.json`` + safetensors directories.

- `load_hf(module, path)` fills a library module from a checkpoint: a plain module, or one that
  is already parallelized (tp / FSDP2 DTensors, a pipeline stage), in which case each rank reads
  only the checkpoint rows of the blocks it holds.
- `save_hf(module, path)` writes a module as a directory that `transformers` loads: a plain one,
  or a parallelized one (a collective over its ranks: parameters gathered one at a time, one
  writer per file), or one pipeline stage of it (the stages together write one directory).
- `save_llava_hf(vision, projection, language, path, ...)` writes the three as one directory that
  ``LlavaForConditionalGeneration`` and ``AutoProcessor`` load.

Families: Llama-family decoders into `Llama` (`LlamaConfig.from_hf`), SigLIP / CLIP vision towers
into `ViT` (`ViTConfig.from_hf`), Whisper's encoder into `AudioEncoder` (`AudioConfig.from_hf`),
LLaVA's projector into `Projection`. A checkpoint may hold
several (a LLaVA directory: tower, projector and language model); each module finds its tensors
under whatever prefix they carry. The module's config must be the checkpoint's (build it with
e.g. ``Llama(LlamaConfig.from_hf(path))``); a mismatch is named.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from dtensor_mimo.models.audio import AudioEncoder
from dtensor_mimo.models.config_json import read_config
from dtensor_mimo.models.hf.audio import AUDIO_ANCHOR, audio_config_from_hf, audio_source
from dtensor_mimo.models.hf.convert import Source
from dtensor_mimo.models.hf.llama import llama_config_from_hf, llama_source
from dtensor_mimo.models.hf.directory import DEFAULT_SHARD_BYTES, write_directory
from dtensor_mimo.models.hf.export import config_to_hf, holder, module_part, module_spec
from dtensor_mimo.models.hf.llava import save_llava_hf
from dtensor_mimo.models.hf.safetensors import FLOATS, SafetensorsDir
from dtensor_mimo.models.hf.vision import (
    PROJECTOR_ANCHOR,
    VIT_ANCHOR,
    check_projector,
    projection_source,
    vit_config_from_hf,
    vit_source,
)
from dtensor_mimo.models.layers import local_box, local_part, plain_name
from dtensor_mimo.models.llama import Llama
from dtensor_mimo.models.modality_encoder import ModalityEncoder
from dtensor_mimo.models.projection import Projection
from dtensor_mimo.models.vit import ViT, ViTConfig

__all__ = ["has_hf_module", "load_hf", "plan_hf", "save_hf", "save_llava_hf"]

# Fields that only bound what the data layer may build, or how inputs are taken: not part of the
# weights' meaning.
_FREE_FIELDS = {"max_seq_len", "multiple_of", "dynamic_resolution", "max_patches", "variable_length", "temporal_patch"}


@dataclass(frozen=True)
class _Family:
    """How one library module kind is read from Hugging Face: its config (None: no config of its
    own), the `Source` of each parameter relative to the module's tensors in the checkpoint
    (`has` tells which relative names exist), and an `anchor` tensor whose full name reveals that
    prefix. (Writing: `dtensor_mimo.models.hf.export`.)"""

    config_from_hf: Callable[[str], Any]  # None returned: no config of its own (only checked)
    source: Callable[[str, Any, Callable[[str], bool] | None], Source]
    anchor: str


_FAMILIES: dict[type, _Family] = {
    Llama: _Family(llama_config_from_hf,
                   lambda name, config, has: llama_source(name, config, tied=has is not None and not has("lm_head.weight")),
                   "model.embed_tokens.weight"),
    ViT: _Family(vit_config_from_hf, lambda name, config, has: vit_source(name, config), VIT_ANCHOR),
    Projection: _Family(check_projector, lambda name, config, has: projection_source(name), PROJECTOR_ANCHOR),
    AudioEncoder: _Family(audio_config_from_hf, lambda name, config, has: audio_source(name), AUDIO_ANCHOR),
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


def hf_parts(module: nn.Module, path: str, name: str = "encoder") -> list[nn.Module]:
    """The parts of encoder `module` (named `name` in messages) that the checkpoint at `path`
    fills: a `ModalityEncoder`'s tower, and its projection when the checkpoint holds one (a
    LLaVA directory's projector). A user's own encoder is refused: it loads its own weights."""
    if not isinstance(module, ModalityEncoder):
        raise TypeError(f"load_hf: encoder {name!r} is a {type(module).__name__}; load your own module's "
                        "weights yourself")
    projection = module.projection
    return [module.encoder] + ([projection] if projection is not None and has_hf_module(Projection, path) else [])


def plan_hf(module: nn.Module, path: str) -> Callable[[], None]:
    """`load_hf` in two steps: every check now (reading only ``config.json`` and the safetensors
    headers), the weights when the returned function is called — so that ranks can agree that
    every check passed before any of them reads."""
    family = _family(module)
    config = getattr(module, "config", None)
    expected = family.config_from_hf(path)
    if (isinstance(expected, ViTConfig) and isinstance(config, ViTConfig) and not config.final_norm
            and config.n_layers <= expected.n_layers):
        # The features of an inner block (LLaVA's vision_feature_layer): the tower's first blocks.
        expected = dataclasses.replace(expected, n_layers=config.n_layers, final_norm=False)
    if expected is not None:
        differ = [f"{f.name}: module {getattr(config, f.name)!r}, checkpoint {getattr(expected, f.name)!r}"
                  for f in dataclasses.fields(expected)
                  if f.name not in _FREE_FIELDS and getattr(config, f.name) != getattr(expected, f.name)
                  # an untied module takes a tied checkpoint: its head a copy of the embedding
                  and not (f.name == "tie_embeddings" and getattr(expected, f.name))]
        if differ:
            raise ValueError(f"load_hf({path!r}): the {type(module).__name__} config differs from the checkpoint's "
                             f"({'; '.join(differ)}); build the module from {type(expected).__name__}.from_hf(path)")
    quantization = read_config(path).get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise ValueError(f"load_hf({path!r}): a quantized checkpoint (quantization_config (quant_method {method!r}) "
                         "in config.json): its weights mean something only with their scales; load the "
                         "unquantized model's checkpoint, or dequantize it first")
    files = SafetensorsDir(path)
    prefix = _prefix(files, family.anchor, path)
    params = {plain_name(n): p for n, p in module.named_parameters()}
    relative = {n: family.source(n, config, lambda name: prefix + name in files) for n in params}
    sources = {n: dataclasses.replace(s, name=prefix + s.name) for n, s in relative.items()}
    missing = sorted(s.name for s in sources.values() if s.name not in files)
    shapes = [f"{s.name}: checkpoint {files.shape(s.name)}, module {tuple(params[n].shape)}"
              for n, s in sources.items() if s.name in files and s.module_shape(files.shape(s.name)) != tuple(params[n].shape)]
    dtypes = [f"{s.name}: {files.dtype_name(s.name)}" for s in sources.values()
              if s.name in files and files.dtype_name(s.name) not in FLOATS]
    if missing or shapes or dtypes:
        raise ValueError(f"load_hf({path!r}): " + "; ".join(
            ([f"missing tensors {missing}"] if missing else []) + ([f"shapes differ: {shapes}"] if shapes else [])
            + ([f"tensors not stored as floating-point values ({', '.join(FLOATS)}), as a quantized "
                f"checkpoint's: {dtypes[:4]}"] if dtypes else [])))

    @torch.no_grad()
    def fill() -> None:
        for name, param in params.items():
            offset, shape = local_box(param)
            local_part(param).copy_(sources[name].read(files, offset, shape))

    return fill


@torch.no_grad()
def save_hf(module: nn.Module, path: str, max_shard_bytes: int = DEFAULT_SHARD_BYTES, *,
            dtype: torch.dtype | None = None, layer_split: Sequence[int] | None = None,
            writer: bool | None = None) -> None:
    """Write `module` to the directory `path` (created) as ``config.json`` and safetensors files
    of at most `max_shard_bytes` each (an index when there are several), in `dtype` (None: its
    parameters' dtype); `transformers` loads it back with the same outputs: a `Llama` as its
    Llama-family ``*ForCausalLM``, a SigLIP-style `ViT` as ``SiglipVisionModel``, an
    `AudioEncoder` as ``WhisperEncoder``, a `Projection` as LLaVA's projector tensors
    (``multi_modal_projector.linear_1/2``) with a small ``config.json`` describing it.

    A parallelized module (tp / FSDP2 DTensor parameters) is written by a collective: every rank
    that holds it calls `save_hf`; the parameters are gathered one at a time over their own mesh
    and the `writer` rank (None: the first rank of every parameter's mesh; pass it explicitly
    where plain parameters are replicated on several ranks) writes each and drops it, so no rank
    holds the whole model. With `writer` None only the first rank of each mesh makes a whole
    tensor (the others send it their shards); an explicit `writer`, which the other ranks cannot
    name, makes every rank gather each tensor whole. The directory is complete when the writer returns. After a forward
    without backward with gradients on (which leaves FSDP2 roots gathered, their parameters the
    copies in ``param_dtype``), call `MimoModel.reshard` first (`export_hf` does): a submodule
    cannot reach its FSDP2 root to do it.

    A pipeline stage (a module holding some ``layers`` of the whole module under the whole
    module's names, see `dtensor_mimo.models.protocol.decoder_stage`): pass `layer_split`, the
    blocks per stage of the whole module (e.g. ``[len(r) for r in stage_layers(...)]``); every
    stage's ranks call `save_hf` on the same `path`, each stage writes its own files, and the
    writer of the first stage writes ``config.json`` and the index (the file of every tensor
    follows from the config and the split, so the stages never communicate).
    """
    spec = module_spec(module, dtype)
    config = config_to_hf(spec)  # refuses what the Hugging Face family cannot express, before any gather
    part = module_part(spec, "module", layer_split=layer_split)
    held = holder([module], part, writer)
    write_directory(path, [part], {"module": held}, max_shard_bytes=max_shard_bytes,
                    metadata_writer=held.writer and 0 in held.stages, config=config)
