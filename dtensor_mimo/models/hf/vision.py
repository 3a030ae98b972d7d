"""SigLIP and CLIP vision towers <-> the library's `ViT`; LLaVA's projector <-> `Projection`.

A tower is read from a vision-model directory or from a full checkpoint that holds one (SigLIP,
CLIP, LLaVA: its ``vision_config``, tensors found under whatever prefix they carry). Inside a
LLaVA checkpoint the features are the hidden states after ``vision_feature_layer`` blocks
(default -2: all but the last) with no final norm and the class token dropped, so the `ViT`
built from that config keeps only those blocks. Names map one to one; nothing is permuted:

    patch_embed <- embeddings.patch_embedding      pos_embed <- embeddings.position_embedding.weight
    cls_token   <- embeddings.class_embedding      pre_norm  <- pre_layrnorm
    layers.{i}.norm1 / attn.wq, wk, wv, wo / norm2 / mlp.fc1, fc2
                <- encoder.layers.{i}.layer_norm1 / self_attn.q_proj, k_proj, v_proj, out_proj / layer_norm2 / mlp.fc1, fc2
    norm        <- post_layernorm                  Projection.fc1, fc2 <- multi_modal_projector.linear_1, linear_2

Out: a SigLIP-style tower with a final norm as a SigLIP vision model (`vit_config_to_hf`); inside a
LLaVA directory a SigLIP- or CLIP-style tower without one (`llava_tower_config`: the features
are the last block's hidden states, ``vision_feature_layer`` -1); a projector as its own small
directory (`projector_config_to_hf`) or inside a LLaVA one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from dtensor_mimo.models.hf.convert import Source, table_source
from dtensor_mimo.models.hf.safetensors import SafetensorsDir
from dtensor_mimo.models.config_json import read_config
from dtensor_mimo.models.vit import HF_ACTIVATIONS, ViTConfig

_TOP = {"patch_embed.weight": "embeddings.patch_embedding.weight", "patch_embed.bias": "embeddings.patch_embedding.bias",
        "pos_embed": "embeddings.position_embedding.weight", "cls_token": "embeddings.class_embedding",
        "pre_norm.weight": "pre_layrnorm.weight", "pre_norm.bias": "pre_layrnorm.bias",
        "norm.weight": "post_layernorm.weight", "norm.bias": "post_layernorm.bias"}
_LAYER = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj",
          "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.out_proj", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
VIT_ANCHOR = "embeddings.patch_embedding.weight"
PROJECTOR_ANCHOR = "multi_modal_projector.linear_1.weight"


vit_config_from_hf = ViTConfig.from_hf
"""See `ViTConfig.from_hf`."""


def _tower_style(config: ViTConfig) -> str | None:
    """"siglip" or "clip" when the ViT is such a tower (up to its final norm), else None."""
    if not config.class_token and not config.pre_norm and config.patch_bias:
        return "siglip"
    if config.class_token and config.pre_norm and not config.patch_bias:
        return "clip"
    return None


def _tower_fields(config: ViTConfig, dtype: str) -> dict[str, Any]:
    act = {v: k for k, v in HF_ACTIVATIONS.items()}[config.activation]
    return {"image_size": config.image_size, "patch_size": config.patch_size, "num_channels": config.item_channels,
            "hidden_size": config.dim, "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads, "intermediate_size": config.mlp_hidden,
            "layer_norm_eps": config.norm_eps, "hidden_act": act, "torch_dtype": dtype, "dtype": dtype,
            # the frames stacked in num_channels (the library's own field; transformers keeps it as is):
            # `ViTConfig.from_hf` reads the tower back as `in_channels` per frame, not one wide frame
            **({"temporal_patch": config.temporal_patch} if config.temporal_patch > 1 else {})}


def vit_config_to_hf(config: ViTConfig, dtype: str) -> dict[str, Any]:
    """A SigLIP vision model ``config.json`` for `config` (CLIP-style towers are not exported)."""
    if _tower_style(config) != "siglip" or not config.final_norm:
        raise ValueError("save_hf: only SigLIP-style towers (no class token or pre-norm, a final norm, patch "
                         f"bias) are exported; this ViT has class_token={config.class_token}, pre_norm="
                         f"{config.pre_norm}, final_norm={config.final_norm}, patch_bias={config.patch_bias} "
                         "(a tower without a final norm exports inside a LLaVA directory: save_llava_hf)")
    return {"architectures": ["SiglipVisionModel"], "model_type": "siglip_vision_model",
            **_tower_fields(config, dtype), "vision_use_head": False}


def llava_tower_config(config: ViTConfig, dtype: str) -> tuple[dict[str, Any], str, int]:
    """The ``vision_config`` of a LLaVA directory whose image features are the ViT's output,
    with LLaVA's ``vision_feature_select_strategy`` and the processor's
    ``num_additional_image_tokens``: a SigLIP tower keeps every token ("full", 0), a CLIP tower
    drops its class token ("default", 1). LLaVA reads the hidden states after the last block,
    before ``post_layernorm`` (``vision_feature_layer`` -1), so the ViT must have no final norm."""
    style = _tower_style(config)
    if config.final_norm:
        raise ValueError("save_llava_hf: the ViT has a final norm (final_norm=True), but LLaVA takes the tower's "
                         "hidden states before its post_layernorm, so no LLaVA directory gives this ViT's "
                         "features; build the ViT with final_norm=False (as ViTConfig.from_hf of a LLaVA "
                         "directory does), or export the modules as separate directories")
    if style is None:
        raise ValueError("save_llava_hf: the ViT is neither a SigLIP-style tower (no class token or pre-norm, "
                         "patch bias) nor a CLIP-style one (class token, pre-norm, no patch bias): class_token="
                         f"{config.class_token}, pre_norm={config.pre_norm}, patch_bias={config.patch_bias}")
    if style == "siglip":
        return ({"model_type": "siglip_vision_model", **_tower_fields(config, dtype), "vision_use_head": False},
                "full", 0)
    return {"model_type": "clip_vision_model", **_tower_fields(config, dtype)}, "default", 1


@dataclass(frozen=True)
class _StackedFrames(Source):
    """The patch embedding of a tower taking `frames` frames stacked along channels (a video
    tower's temporal patch) from an image tower's: its kernel repeated over the frames and divided
    by their number (Qwen2-VL's inflation of a 2-D patch embedding), so a stack of one frame
    repeated embeds as that frame alone. A checkpoint whose kernel already takes the stack (a
    video tower `save_hf` wrote: `channels` x `frames` channels) is read as it is."""

    frames: int = 1
    channels: int | None = None  # per frame; None: any checkpoint kernel is one frame's

    def _inflates(self, files: SafetensorsDir) -> bool:
        return self.channels is None or files.shape(self.name)[1] == self.channels

    def read(self, files: SafetensorsDir, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        if not self._inflates(files):
            return super().read(files, offset, shape)
        rows = files.read(self.name, slice(offset[0], offset[0] + shape[0]))
        rows = rows.repeat(1, self.frames, 1, 1) / self.frames
        return rows[(slice(None), *(slice(o, o + n) for o, n in zip(offset[1:], shape[1:])))]

    def module_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.channels is not None and shape[1] != self.channels:
            return shape
        return (shape[0], shape[1] * self.frames, *shape[2:])


def vit_source(name: str, config: ViTConfig | None = None) -> Source:
    """The checkpoint tensor (relative to the tower) of the ViT parameter `name` (of a ViT with
    `config`: a temporal patch's embedding comes from an image tower's, `_StackedFrames`)."""
    source = table_source(name, "ViT", _TOP, _LAYER, "encoder.layers")
    if name == "patch_embed.weight" and config is not None and config.temporal_patch > 1:
        return _StackedFrames(source.name, frames=config.temporal_patch, channels=config.in_channels)
    return source


ANYRES = ("llava_next", "llava_next_video", "llava_onevision")
"""The LLaVA-family model types whose images are "anyres" tiles joined by a learned ``image_newline``."""


def anyres_problem(path: str) -> str | None:
    """Why the LLaVA-family directory `path` is not a model the library's encoder is (its images
    "anyres": LLaVA-NeXT, -NeXT-Video, -OneVision, or any ``image_grid_pinpoints``), or None."""
    c = read_config(path)
    kind = c.get("model_type")
    if kind not in ANYRES and "image_grid_pinpoints" not in c:
        return None
    return (f"{path}: model_type {kind!r} is an \"anyres\" LLaVA (image_grid_pinpoints): its model cuts each image "
            "into a base image and grid tiles, unpads the tiles' features to the image's aspect ratio and appends "
            "its learned image_newline after each row, so its projector's features mean something only in that "
            "arrangement; the library's encoder gives one image's patch rows (no tiles, no image_newline, other "
            "image-token counts) and would train another model than this checkpoint's. Load its tower alone "
            "(ViTConfig.from_hf and load_hf on the ViT, or the tower's own SigLIP / CLIP directory) with a fresh "
            "projection, or use a LLaVA-1.5 directory (model_type 'llava')")


def check_projector(path: str) -> None:
    """Refuse a LLaVA projector the library's `Projection` (Linear, GELU, Linear, biases) is not,
    or one of an "anyres" directory (`anyres_problem`)."""
    if problem := anyres_problem(path):
        raise ValueError(problem)
    c = read_config(path)
    act, bias = c.get("projector_hidden_act", "gelu"), c.get("multimodal_projector_bias", True)
    if act != "gelu" or not bias:
        raise ValueError(f"{path}: projector_hidden_act={act!r}, multimodal_projector_bias={bias}: the Projection "
                         "is Linear, exact GELU, Linear, with biases")


def projection_source(name: str) -> Source:
    """The checkpoint tensor of the `Projection` parameter `name` (LLaVA's projector)."""
    match = re.fullmatch(r"fc([12])\.(weight|bias)", name)
    if match is None:
        raise KeyError(f"no Hugging Face name for the Projection parameter {name!r}")
    return Source(f"multi_modal_projector.linear_{match.group(1)}.{match.group(2)}")


@dataclass(frozen=True)
class ProjectionShape:
    """The widths of a `Projection` (Linear in -> hidden, GELU, Linear hidden -> out, biases)."""

    in_dim: int
    hidden_dim: int
    out_dim: int


def projector_config_to_hf(shape: ProjectionShape, dtype: str) -> dict[str, Any]:
    """The small ``config.json`` of a projector directory: LLaVA's projector fields (what
    `check_projector` reads back) and the widths."""
    return {"architectures": ["LlavaMultiModalProjector"], "projector_hidden_act": "gelu",
            "multimodal_projector_bias": True, "in_features": shape.in_dim, "hidden_features": shape.hidden_dim,
            "out_features": shape.out_dim, "torch_dtype": dtype, "dtype": dtype,
            "description": "multi_modal_projector.linear_2(gelu(multi_modal_projector.linear_1(x))), exact GELU, "
                           "as LLaVA's LlavaMultiModalProjector"}
