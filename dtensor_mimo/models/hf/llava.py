"""LLaVA directories: a vision tower, its projector and a Llama-family decoder as one checkpoint
that ``transformers.LlavaForConditionalGeneration`` and ``transformers.AutoProcessor`` load.

Tensor names are those transformers 5 itself writes for LLaVA (and `load_hf` reads back):
``vision_tower.*`` (the SigLIP / CLIP vision model's names), ``multi_modal_projector.linear_{1,2}.*``,
``language_model.*`` (the Llama family's ``model.*`` and ``lm_head.weight``).

Image features. LLaVA runs the tower and takes ``hidden_states[vision_feature_layer]`` — after a
block, before ``post_layernorm`` — dropping the first token under the "default" select strategy.
The ViT's output is the hidden states after its last block when it has no final norm, so the
tower is exported with exactly the ViT's blocks and ``vision_feature_layer`` -1; its
``post_layernorm``, which LLaVA never applies, is written as the identity (ones, zeros). A SigLIP
tower keeps every token ("full"), a CLIP tower drops its class token ("default"). A ViT with a
final norm has no LLaVA form (refused by name).

The image placeholder. The library never looks up the embedding of a modality's special token;
it may lie outside the text vocabulary. LLaVA looks it up (then overwrites it), so when the image
token id is >= the decoder's vocab_size the embedding and head are extended with zero rows up to
it, and ``generation_config.json`` lists every added id in ``suppress_tokens``: their logits
(zero) can then never win greedy decoding, which equals the library's over the real vocabulary.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from dtensor_mimo.models.hf.directory import DEFAULT_SHARD_BYTES, Part, write_directory
from dtensor_mimo.models.hf.export import ModuleSpec, holder, module_part, module_spec, processor_problem
from dtensor_mimo.models.hf.llama import llama_config_to_hf
from dtensor_mimo.models.hf.vision import llava_tower_config
from dtensor_mimo.models.llama import Llama
from dtensor_mimo.models.projection import Projection
from dtensor_mimo.models.vit import ViT

VISION, PROJECTOR, LANGUAGE = "vision", "projector", "language"
"""The part keys of a LLaVA directory."""


@dataclass(frozen=True)
class LlavaDirectory:
    """Everything a LLaVA directory holds besides the weights' values: its parts, ``config.json``,
    ``generation_config.json`` and what the processor needs."""

    parts: list[Part]
    config: dict[str, Any]
    generation_config: dict[str, Any]
    image_token_id: int
    patch_size: int
    select_strategy: str
    additional_image_tokens: int


def llava_directory(vision: ModuleSpec, projection: ModuleSpec, language: ModuleSpec, *, image_token_id: int,
                    vision_split: Sequence[int] | None = None,
                    language_split: Sequence[int] | None = None) -> LlavaDirectory:
    """The LLaVA directory of a tower, projector and decoder given by their specs (`*_split`:
    blocks per pipeline stage of the tower / decoder, None: whole). Raises, naming the field,
    what LLaVA cannot express."""
    kinds = [(vision, ViT, "vision"), (projection, Projection, "projection"), (language, Llama, "language")]
    wrong = [f"{what} is a {spec.kind.__name__}, not a {kind.__name__}" for spec, kind, what in kinds
             if spec.kind is not kind]
    if wrong:
        raise TypeError("save_llava_hf: " + "; ".join(wrong))
    vit, shape, llama = vision.config, projection.config, language.config
    if isinstance(image_token_id, bool) or not isinstance(image_token_id, int) or image_token_id < 0:
        raise ValueError(f"save_llava_hf: image_token_id={image_token_id!r} must be a token id >= 0")
    if (shape.in_dim, shape.hidden_dim, shape.out_dim) != (vit.dim, llama.dim, llama.dim):
        raise ValueError(
            f"save_llava_hf: LLaVA's projector is Linear(vision {vit.dim} -> text {llama.dim}), GELU, Linear(text "
            f"{llama.dim} -> text {llama.dim}), but the Projection is {shape.in_dim} -> {shape.hidden_dim} -> "
            f"{shape.out_dim}; build it as Projection({vit.dim}, {llama.dim}) (hidden_dim = out_dim)")
    tower, strategy, additional = llava_tower_config(vit, vision.dtype_name)
    vocab = max(llama.vocab_size, image_token_id + 1)
    added = list(range(llama.vocab_size, vocab))
    text = llama_config_to_hf(llama, language.dtype_name)
    del text["architectures"]
    text["vocab_size"] = vocab
    rows = {"tok_embeddings.weight": len(added), "output.weight": len(added)}
    norm = (("post_layernorm.weight", (vit.dim,), 1.0), ("post_layernorm.bias", (vit.dim,), 0.0))
    parts = [module_part(vision, VISION, prefix="vision_tower.", layer_split=vision_split, constants=norm,
                         module="vision tower (ViT)"),
             module_part(projection, PROJECTOR, module="projector (Projection)"),
             module_part(language, LANGUAGE, prefix="language_model.", layer_split=language_split,
                         extra_rows=rows, module="language model (Llama)")]
    config = {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
        "vision_config": tower, "text_config": text,
        "image_token_index": image_token_id, "image_seq_length": vit.num_patches,
        "projector_hidden_act": "gelu", "multimodal_projector_bias": True,
        "vision_feature_layer": -1, "vision_feature_select_strategy": strategy,
        "tie_word_embeddings": llama.tie_embeddings, "torch_dtype": language.dtype_name, "dtype": language.dtype_name,
    }
    generation = {"suppress_tokens": added} if added else {}
    return LlavaDirectory(parts, config, generation, image_token_id, vit.patch_size, strategy, additional)


def image_token(tokenizer: Any, image_token_id: int) -> str:
    """The token string `tokenizer` gives `image_token_id` (LlavaProcessor expands it into the
    image's placeholders); raises when the tokenizer has no token with that id."""
    try:
        token = tokenizer.convert_ids_to_tokens(image_token_id)
    except (IndexError, KeyError, OverflowError):
        token = None
    if not token or token == tokenizer.unk_token or tokenizer.convert_tokens_to_ids(token) != image_token_id:
        raise ValueError(
            f"the tokenizer has no token with the image token id {image_token_id} (it has {len(tokenizer)} tokens), "
            "so a processor could not write the image placeholders: add one (e.g. tokenizer.add_special_tokens("
            "{'additional_special_tokens': ['<image>']}) gives id len(tokenizer)) and train with its id")
    return token


def write_processors(path: str, llava: LlavaDirectory, tokenizer: Any = None, image_processor: Any = None) -> None:
    """``generation_config.json`` (with the tokenizer's bos / eos / pad ids), and the tokenizer and
    image processor: both as one ``LlavaProcessor`` (``processor_config.json`` with the patch
    size, select strategy, image token and additional tokens, so ``AutoProcessor`` expands
    ``<image>`` into as many placeholders as the ViT gives), or whichever is given."""
    generation = dict(llava.generation_config)
    if tokenizer is not None:
        for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(tokenizer, field, None) is not None:
                generation[field] = getattr(tokenizer, field)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2)
    if tokenizer is not None and image_processor is not None:
        from transformers import LlavaProcessor  # the caller's objects are transformers' already

        LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=llava.patch_size,
                       vision_feature_select_strategy=llava.select_strategy,
                       image_token=image_token(tokenizer, llava.image_token_id),
                       num_additional_image_tokens=llava.additional_image_tokens,
                       chat_template=getattr(tokenizer, "chat_template", None)).save_pretrained(path)
    elif tokenizer is not None:
        tokenizer.save_pretrained(path)
    elif image_processor is not None:
        image_processor.save_pretrained(path)


@torch.no_grad()
def save_llava_hf(vision: ViT, projection: Projection, language: Llama, path: str, *, image_token_id: int,
                  tokenizer: Any = None, image_processor: Any = None, dtype: torch.dtype | None = None,
                  max_shard_bytes: int = DEFAULT_SHARD_BYTES, vision_split: Sequence[int] | None = None,
                  language_split: Sequence[int] | None = None) -> None:
    """Write a vision tower, its projector and a decoder as one LLaVA directory `path`:
    ``LlavaForConditionalGeneration.from_pretrained(path)`` gives the library model's logits
    (image features: `vision` then `projection`, scattered in at the `image_token_id`
    placeholders, then `language`), and with a `tokenizer` (a transformers tokenizer that has a
    token of id `image_token_id`, e.g. ``<image>``) and an `image_processor` (resizing to the
    ViT's image size) ``AutoProcessor.from_pretrained(path)`` gives a ``LlavaProcessor`` whose
    ``<image>`` expansion matches the ViT's tokens per image. `dtype` None: each module's own.

    The ViT must have no final norm and be SigLIP- or CLIP-style; the projection must be
    ``Projection(vit.dim, language.dim)``; see the module docstring for the placeholder id.

    Parallelized modules (all three held by every calling rank, e.g. colocated on one mesh)
    are written by a collective, as `save_hf`: every rank calls it, parameters are gathered one
    at a time, each module's first rank writes its files; `*_split` when a module is a pipeline
    stage. Modules on different ranks: `dtensor_mimo.train.export.export_hf`.
    """
    specs = [module_spec(m, dtype) for m in (vision, projection, language)]
    llava = llava_directory(*specs, image_token_id=image_token_id, vision_split=vision_split,
                            language_split=language_split)
    if tokenizer is not None:
        image_token(tokenizer, image_token_id)  # refuse before anything is written
    if image_processor is not None and (problem := processor_problem(image_processor, specs[0])):
        raise ValueError(f"save_llava_hf: {problem}")
    holders = {part.key: holder([module], part) for part, module in zip(llava.parts, (vision, projection, language))}
    lang = holders[LANGUAGE]
    write_directory(path, llava.parts, holders, max_shard_bytes=max_shard_bytes,
                    metadata_writer=lang.writer and 0 in lang.stages, config=llava.config,
                    extras=lambda p: write_processors(p, llava, tokenizer, image_processor))

