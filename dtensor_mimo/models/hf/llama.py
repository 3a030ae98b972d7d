"""Llama-family decoders (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3) <-> the library's `Llama`.

Names: ``model.layers.{i}.self_attn.q_proj`` <-> ``layers.{i}.attention.wq`` and so on (table
below). Rotary layout: Hugging Face rotates element i of a head with element i + head_dim / 2;
the library rotates adjacent pairs (2i, 2i + 1), as Meta's and torchtitan's Llama do. The rows of
``q_proj`` / ``k_proj`` (weights, biases) and Qwen3's ``q_norm`` / ``k_norm`` are therefore
permuted within each head on the way in (and back on the way out); everything else is copied.
"""

from __future__ import annotations

from typing import Any

from dtensor_mimo.models.hf.convert import Source, table_source
from dtensor_mimo.models.llama import LlamaConfig

_LAYER = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_ROTATED = ("attention.wq", "attention.wk", "attention.q_norm", "attention.k_norm")
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


llama_config_from_hf = LlamaConfig.from_hf
"""See `LlamaConfig.from_hf`."""


def llama_config_to_hf(config: LlamaConfig, dtype: str) -> dict[str, Any]:
    """A transformers ``config.json`` for `config` (the family its variants need)."""
    if config.qk_norm and config.qkv_bias:
        raise ValueError("save_hf: no Hugging Face family has both qk_norm and qkv_bias")
    # transformers' Llama requires heads that divide the width; Mistral takes any head_dim (as Mistral-Nemo's)
    plain = "llama" if config.dim % config.n_heads == 0 else "mistral"
    family = "qwen3" if config.qk_norm else "qwen2" if config.qkv_bias else plain
    architecture = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM"}[family]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        s = config.rope_scaling
        rope.update(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_position_embeddings)
    return {
        "architectures": [architecture], "model_type": family, "vocab_size": config.vocab_size,
        "hidden_size": config.dim, "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads, "head_dim": config.head_dim, "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.norm_eps,
        # transformers v5 reads rope_parameters, v4 rope_theta and rope_scaling
        "rope_parameters": rope, "rope_theta": config.rope_theta,
        "rope_scaling": None if config.rope_scaling is None else {k: v for k, v in rope.items() if k != "rope_theta"},
        "attention_bias": False, "mlp_bias": False, "use_sliding_window": False, "sliding_window": None,
        "tie_word_embeddings": config.tie_embeddings, "torch_dtype": dtype, "dtype": dtype,
    }


def llama_source(name: str, config: LlamaConfig, tied: bool) -> Source:
    """Where the library parameter `name` comes from in a Hugging Face Llama-family checkpoint
    (`tied`: the checkpoint has no ``lm_head`` and reuses the token embedding). A tied `Llama`
    (`LlamaConfig.tie_embeddings`) has no ``output.weight`` of its own: its one parameter is
    ``tok_embeddings.weight``, written as ``model.embed_tokens.weight`` and no ``lm_head``."""
    if name == "output.weight" and tied:
        return Source("model.embed_tokens.weight")
    return table_source(name, "Llama", _TOP, _LAYER, "model.layers", {part: config.head_dim for part in _ROTATED})
