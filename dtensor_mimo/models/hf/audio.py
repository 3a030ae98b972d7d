"""Whisper's encoder <-> the library's `AudioEncoder` (from a Whisper model or encoder checkpoint;
tensors found under whatever prefix they carry). Names map one to one:

    conv1, conv2 <- conv1, conv2            pos_embed <- embed_positions.weight (frozen, as in Whisper)
    layers.{i}.norm1 / attn.wq, wk, wv, wo / norm2 / mlp.fc1, fc2
        <- layers.{i}.self_attn_layer_norm / self_attn.q_proj, k_proj (no bias), v_proj, out_proj / final_layer_norm / fc1, fc2
    norm <- layer_norm

Out (`whisper_config_to_hf`): a directory that
``transformers.models.whisper.modeling_whisper.WhisperEncoder.from_pretrained`` loads
(``config.json`` of a Whisper model, tensors under the encoder's own names; the decoder fields are
placeholders that mirror the encoder's, and no decoder weights are written). A key bias is
dropped: softmax is invariant to it (it adds q . b to every score of a query).
"""

from __future__ import annotations

from typing import Any

from dtensor_mimo.models.audio import AudioConfig
from dtensor_mimo.models.hf.convert import Source, table_source

AUDIO_ANCHOR = "conv1.weight"
_TOP = {"conv1.weight": "conv1.weight", "conv1.bias": "conv1.bias", "conv2.weight": "conv2.weight",
        "conv2.bias": "conv2.bias", "pos_embed": "embed_positions.weight", "norm.weight": "layer_norm.weight",
        "norm.bias": "layer_norm.bias"}
_LAYER = {"norm1": "self_attn_layer_norm", "norm2": "final_layer_norm", "attn.wq": "self_attn.q_proj",
          "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.out_proj",
          "mlp.fc1": "fc1", "mlp.fc2": "fc2"}


audio_config_from_hf = AudioConfig.from_hf
"""See `AudioConfig.from_hf`."""


def whisper_config_to_hf(config: AudioConfig, dtype: str) -> dict[str, Any]:
    """A Whisper ``config.json`` whose encoder is `config` (refusing what Whisper cannot express)."""
    refused = []
    if tuple(config.conv_strides) != (1, 2):
        refused.append(f"conv_strides={tuple(config.conv_strides)} (Whisper's convolutions have strides (1, 2))")
    if config.norm_eps != 1e-5:
        refused.append(f"norm_eps={config.norm_eps} (Whisper's LayerNorms use 1e-5)")
    if refused:
        raise ValueError("save_hf: a Whisper encoder cannot express the AudioEncoder's " + "; ".join(refused))
    return {"architectures": ["WhisperEncoder"], "model_type": "whisper", "num_mel_bins": config.n_mels,
            "d_model": config.dim, "encoder_layers": config.n_layers, "encoder_attention_heads": config.n_heads,
            "encoder_ffn_dim": config.mlp_hidden, "max_source_positions": config.output_length(config.max_frames),
            "activation_function": "gelu", "scale_embedding": False,
            # Placeholders (the directory holds the encoder only), valid for a WhisperConfig.
            "decoder_layers": config.n_layers, "decoder_attention_heads": config.n_heads,
            "decoder_ffn_dim": config.mlp_hidden, "torch_dtype": dtype, "dtype": dtype}


def audio_skipped(name: str, config: AudioConfig) -> bool:
    """Whether the AudioEncoder parameter `name` has no place in a Whisper checkpoint (a key bias)."""
    return name.endswith(".attn.wk.bias")


def audio_source(name: str) -> Source:
    """The checkpoint tensor (relative to the encoder) of the AudioEncoder parameter `name`."""
    return table_source(name, "AudioEncoder", _TOP, _LAYER, "layers")
