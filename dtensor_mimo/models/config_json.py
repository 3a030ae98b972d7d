"""``config.json`` of a Hugging Face model directory: what each model config's ``from_hf`` reads."""

from __future__ import annotations

import json
import os
from typing import Any

from dtensor_mimo.layout.world import warn_once

_LLAMA_SIZES = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, hidden_act="silu",
                    rms_norm_eps=1e-6, rope_theta=10000.0)
_QWEN = dict(_LLAMA_SIZES, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32,
             max_position_embeddings=32768)
_TOWER = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=224,
              num_channels=3)
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(_LLAMA_SIZES, vocab_size=32000, intermediate_size=11008, max_position_embeddings=2048),
    "mistral": dict(_LLAMA_SIZES, vocab_size=32000, intermediate_size=14336, num_key_value_heads=8,
                    max_position_embeddings=131072, sliding_window=4096),
    "qwen2": _QWEN,
    "qwen3": dict(_QWEN, head_dim=128),
    "siglip_vision_model": dict(_TOWER, patch_size=16, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6),
    "clip_vision_model": dict(_TOWER, patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5),
    # the vision-language models whose image features are an inner block's hidden states
    "llava": dict(vision_feature_layer=-2, vision_feature_select_strategy="default"),
    "llava_next": dict(vision_feature_layer=-2, vision_feature_select_strategy="default"),
    "llava_next_video": dict(vision_feature_layer=-2, vision_feature_select_strategy="default"),
    "video_llava": dict(vision_feature_layer=-2, vision_feature_select_strategy="default"),
    "llava_onevision": dict(vision_feature_layer=-1, vision_feature_select_strategy="full"),
}
"""transformers' config class defaults, by ``model_type``, of the fields the library reads.
transformers v4 wrote a nested config (a LLaVA's ``text_config`` / ``vision_config``, a SigLIP or
CLIP model's ``vision_config``) without the fields equal to its class's defaults — e.g.
llava-1.5's CLIP tower has no ``hidden_act`` or ``layer_norm_eps`` — and reads them back as those
defaults; a field left out must mean the same here."""


def read_config(path: str) -> dict[str, Any]:
    """``config.json`` of a Hugging Face model directory."""
    file = os.path.join(path, "config.json")
    if not os.path.exists(file):
        raise FileNotFoundError(f"{path}: no config.json; point at a Hugging Face model directory")
    with open(file) as f:
        return json.load(f)


def with_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """`config` (one model's, e.g. a nested ``vision_config``) with each field it leaves out at
    the default transformers gives it (`DEFAULTS` of its ``model_type``)."""
    return {**DEFAULTS.get(config.get("model_type"), {}), **config}


DROPOUTS = ("attention_dropout", "dropout", "hidden_dropout", "activation_dropout", "encoder_layerdrop")
"""The ``config.json`` fields of transformers' dropouts (attention, residual, MLP, layer drop)."""


def warn_dropout(path: str, c: dict[str, Any]) -> None:
    """Warn (naming each field) of a ``config.json`` `c` that trains with dropout: the library's
    models have none, and train such a checkpoint without it (a prediction, an evaluation or a
    frozen tower are the same either way: a warning, not a refusal), once on rank 0 (every rank
    reads the config)."""
    if on := [f"{k}={c[k]}" for k in DROPOUTS if c.get(k)]:
        warn_once(f"{path}: {', '.join(on)}: the library's models have no dropout and train this checkpoint "
                  f"without it (transformers would train it with); set "
                  f"{' and '.join(k.split('=')[0] for k in on)} to 0.0 in config.json to silence this",
                  stacklevel=3)
