"""Reference models: a Llama-style decoder, a ViT, a Whisper-style audio encoder, a projection.

Plain single-device modules; parallel layouts are applied to them from outside. `protocol` says
what a user's own encoder or decoder must offer; `load_hf` / `save_hf` (`hf/`) move Hugging Face
checkpoints in and out.
"""

from dtensor_mimo.models.audio import AudioConfig, AudioEncoder
from dtensor_mimo.models.layers import (
    AttentionFn,
    FlexAttentionCore,
    RMSNorm,
    RopeScaling,
    apply_rope,
    apply_rope_tables,
    causal_attention,
    init_weights,
    rope_cos_sin,
    rope_tables,
)
from dtensor_mimo.models.llama import Llama, LlamaConfig
from dtensor_mimo.models.modality_encoder import ModalityEncoder
from dtensor_mimo.models.projection import Projection
from dtensor_mimo.models.vit import EncoderBlock, ViT, ViTConfig
from dtensor_mimo.models.hf import load_hf, save_hf, save_llava_hf  # noqa: E402 (after the modules it converts)

__all__ = [
    "AttentionFn",
    "AudioConfig",
    "AudioEncoder",
    "EncoderBlock",
    "FlexAttentionCore",
    "Llama",
    "LlamaConfig",
    "ModalityEncoder",
    "Projection",
    "RMSNorm",
    "RopeScaling",
    "ViT",
    "ViTConfig",
    "apply_rope",
    "apply_rope_tables",
    "causal_attention",
    "init_weights",
    "load_hf",
    "rope_cos_sin",
    "rope_tables",
    "save_hf",
    "save_llava_hf",
]
