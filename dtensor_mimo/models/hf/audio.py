"""Whisper's encoder <-> the library's `AudioEncoder` (from a Whisper model or encoder checkpoint;
tensors found under whatever prefix they carry). Names map one to one:

    conv1, conv2 <- conv1, conv2            pos_embed <- embed_positions.weight (frozen, as in Whisper)
    layers.{i}.norm1 / attn.wq, wk, wv, wo / norm2 / mlp.fc1, fc2
        <- layers.{i}.self_attn_layer_norm / self_attn.q_proj, k_proj (no bias), v_proj, out_proj / final_layer_norm / fc1, fc2
    norm <- layer_norm
"""

from __future__ import annotations

from dtensor_mimo.models.audio import AudioConfig
from dtensor_mimo.models.hf.convert import Source, table_source
from dtensor_mimo.models.hf.llama import read_config

AUDIO_ANCHOR = "conv1.weight"
_TOP = {"conv1.weight": "conv1.weight", "conv1.bias": "conv1.bias", "conv2.weight": "conv2.weight",
        "conv2.bias": "conv2.bias", "pos_embed": "embed_positions.weight", "norm.weight": "layer_norm.weight",
        "norm.bias": "layer_norm.bias"}
_LAYER = {"norm1": "self_attn_layer_norm", "norm2": "final_layer_norm", "attn.wq": "self_attn.q_proj",
          "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.out_proj",
          "mlp.fc1": "fc1", "mlp.fc2": "fc2"}


def audio_config_from_hf(path: str) -> AudioConfig:
    """See `AudioConfig.from_hf`."""
    c = read_config(path)
    if c.get("model_type") != "whisper":
        raise ValueError(f"{path}: model_type {c.get('model_type')!r} is not 'whisper'")
    if c.get("activation_function", "gelu") != "gelu":
        raise ValueError(f"{path}: activation_function={c['activation_function']!r} (the encoder uses gelu)")
    return AudioConfig(n_mels=c["num_mel_bins"], max_frames=2 * c["max_source_positions"], conv_strides=(1, 2),
                       dim=c["d_model"], n_layers=c["encoder_layers"], n_heads=c["encoder_attention_heads"],
                       mlp_hidden=c["encoder_ffn_dim"], norm_eps=1e-5, key_bias=False, frozen_positions=True)


def audio_source(name: str) -> Source:
    """The checkpoint tensor (relative to the encoder) of the AudioEncoder parameter `name`."""
    return table_source(name, "AudioEncoder", _TOP, _LAYER, "layers")
