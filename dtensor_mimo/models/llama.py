"""A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query causal attention, SwiGLU.

Written to be parallelised from outside (torchtitan style), so the module itself stays plain:

- tensor parallel: `wq, wk, wv, w1, w3` colwise and `wo, w2` rowwise; attention counts its heads
  from the tensor shapes at run time, so a shard holding fewer heads needs no other change;
- pipeline parallel: `layers` is an `nn.ModuleDict` keyed "0", "1", ...; a stage deletes the
  layers it does not run and sets `tok_embeddings`, `norm` or `output` to None, and parameter
  names stay those of the whole model;
- context parallel and packed sequences: `forward` takes explicit rotary `positions`, the global
  `sequence_index` of each row and `document_ids`, and the attention core (`attention_fn`) can be
  swapped for one that gathers K/V across ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_mimo.layout.world import warn_once
from dtensor_mimo.models.config_json import read_config, warn_dropout, with_defaults
from dtensor_mimo.models.layers import (
    AttentionFn,
    RMSNorm,
    RopeScaling,
    apply_rope_tables,
    causal_attention,
    init_weights,
    rope_cos_sin,
    rope_tables,
)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""Hugging Face ``model_type``s that `LlamaConfig.from_hf` reads."""


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: same as n_heads (plain multi-head attention)
    ffn_hidden: int | None = None  # None: Llama's 2/3 * 4 * dim, rounded up to multiple_of
    multiple_of: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048  # longest sequence the data layer may build; no buffer depends on it
    # Variants of the Llama family (defaults: the original Llama); see `from_hf`.
    # None: dim // n_heads, filled in at construction (so `dataclasses.replace(config, n_heads=...)`
    # keeps the old head_dim, as it keeps ffn_hidden: build a new config instead). Qwen3 and
    # Mistral-Nemo set their own.
    head_dim: int | None = None
    qkv_bias: bool = False  # biases on wq, wk, wv (Qwen2 / Qwen2.5)
    qk_norm: bool = False  # RMSNorm over each query and key head before the rotation (Qwen3)
    rope_scaling: RopeScaling | None = None  # Llama 3.1 / 3.2 long-context frequencies
    # The output head is the token embedding: one parameter under both names (transformers'
    # tie_word_embeddings: Qwen2 0.5B, Qwen2.5 0.5B-3B, Llama 3.2 1B / 3B), trained as one
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.ffn_hidden is None:
            hidden = int(2 * 4 * self.dim / 3)
            self.ffn_hidden = -(-hidden // self.multiple_of) * self.multiple_of
        if self.head_dim is None:
            if self.dim % self.n_heads != 0:
                raise ValueError(f"LlamaConfig: dim={self.dim} must be divisible by n_heads={self.n_heads} "
                                 "(or give head_dim)")
            self.head_dim = self.dim // self.n_heads
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"LlamaConfig: n_heads={self.n_heads} must be a multiple of "
                f"n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"LlamaConfig: head_dim={self.head_dim} must be even for RoPE")

    @classmethod
    def tiny(cls, **overrides) -> LlamaConfig:
        """A few-thousand-parameter model for tests; keyword arguments override fields."""
        fields = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=64)
        return cls(**(fields | overrides))

    @classmethod
    def from_hf(cls, path: str) -> LlamaConfig:
        """The config of a Hugging Face Llama-family checkpoint directory (its ``config.json``:
        Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3; transformers v4 or v5 layout). What the
        model cannot express (sliding windows, other rope types, MLP or output biases, ...) is
        refused by name; a dropout is warned of (the model trains without)."""
        c = read_config(path)
        c = with_defaults(c.get("text_config", c))  # a LLaVA checkpoint's language model
        family = c.get("model_type")
        if family not in FAMILIES:
            raise ValueError(f"{path}: model_type {family!r} is not a Llama-family decoder ({', '.join(FAMILIES)})")
        warn_dropout(path, c)
        refused = []
        if c.get("hidden_act", "silu") != "silu":
            refused.append(f"hidden_act={c['hidden_act']!r} (the MLP is SwiGLU with silu)")
        if c.get("mlp_bias"):
            refused.append("mlp_bias=true")
        if c.get("attention_bias") and family != "qwen2":
            refused.append("attention_bias=true (an o_proj bias)")
        if c.get("use_sliding_window") or (family == "mistral" and c.get("sliding_window")):
            refused.append(f"sliding_window={c.get('sliding_window')} (attention is full causal)")
        # transformers' fallbacks: rope_theta beside the rope fields (v4) or in them (v5), a llama3
        # rope's original context the model's max_position_embeddings
        rope = {"rope_theta": c.get("rope_theta", 10000.0), **(c.get("rope_parameters") or c.get("rope_scaling") or {})}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            refused.append(f"rope_type={rope_type!r} (supported: 'default', 'llama3')")
        if refused:
            raise ValueError(f"{path}: the library's Llama cannot express " + "; ".join(refused))
        scaling = None if rope_type == "default" else RopeScaling(
            factor=rope["factor"], low_freq_factor=rope["low_freq_factor"], high_freq_factor=rope["high_freq_factor"],
            original_max_position_embeddings=rope.get("original_max_position_embeddings",
                                                      c.get("max_position_embeddings", 2048)))
        return cls(
            vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"],
            n_heads=c["num_attention_heads"], n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
            ffn_hidden=c["intermediate_size"], norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=rope["rope_theta"],
            max_seq_len=c.get("max_position_embeddings", 2048), head_dim=c.get("head_dim"),
            qkv_bias=family == "qwen2" or bool(c.get("attention_bias")), qk_norm=family == "qwen3",
            rope_scaling=scaling, tie_embeddings=bool(c.get("tie_word_embeddings", False)))


class Attention(nn.Module):
    """Grouped-query causal self-attention with rotary embeddings.

    `attention_fn` is the swappable core (see `dtensor_mimo.models.layers.AttentionFn`). Its
    forward's `rope` is `rope_tables(*rope_cos_sin(...))` (`[B, S, 1, head_dim]` each), which
    `Llama.forward` computes once for all layers.
    """

    def __init__(self, config: LlamaConfig, attention_fn: AttentionFn | None = None) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=config.qkv_bias)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None
        self.attention_fn = attention_fn or causal_attention

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        sequence_index: torch.Tensor | None,
        document_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        # -1: the number of heads this rank holds (all of them, or a tensor-parallel shard);
        # unflatten rather than view(b, s, -1, d) so that an empty batch works too.
        q = self.wq(x).unflatten(-1, (-1, self.head_dim))
        k = self.wk(x).unflatten(-1, (-1, self.head_dim))
        v = self.wv(x).unflatten(-1, (-1, self.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope_tables(q, rope), apply_rope_tables(k, rope)
        out = self.attention_fn(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            q_pos=sequence_index,
            kv_pos=sequence_index,
            q_doc=document_ids,
            kv_doc=document_ids,
        )
        return self.wo(out.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attention(norm(x)); out = h + feed_forward(norm(h))."""

    def __init__(self, config: LlamaConfig, attention_fn: AttentionFn | None = None) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, attention_fn)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        sequence_index: torch.Tensor | None,
        document_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, sequence_index, document_ids)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Decoder-only language model. With `LlamaConfig.tie_embeddings` the output head's weight is
    the token embedding's (one parameter, ``output.weight is tok_embeddings.weight``; its
    gradient sums both uses), else a parameter of its own.

    Weights: the constructor uses PyTorch's default init (global RNG); call `init_weights(seed)`
    for weights that depend only on the seed and each parameter's name, identical in a
    single-process run and in any parallel layout of the same model.
    """

    def __init__(self, config: LlamaConfig, attention_fn: AttentionFn | None = None) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(config, attention_fn) for i in range(config.n_layers)}
        )
        self.norm: RMSNorm | None = RMSNorm(config.dim, config.norm_eps)
        self.output: nn.Linear | None = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # The head is a copy of a tied embedding (`untie_embeddings`: a pipeline split): drawn as it
        self.head_copies_embedding = False

    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init from `seed`; see `dtensor_mimo.models.layers.init_weights`. A head
        untied from its embedding by `untie_embeddings` starts as the embedding does."""
        init_weights(self, seed, same_as={"output.weight": "tok_embeddings.weight"} if self.head_copies_embedding
                     else None)

    def set_attention_fn(self, attention_fn: AttentionFn) -> None:
        """Use `attention_fn` as the attention core of every layer this module holds."""
        for layer in self.layers.values():
            layer.attention.attention_fn = attention_fn

    def forward(
        self,
        tokens: torch.Tensor | None = None,
        *,
        h: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        sequence_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the decoder on one batch of rows.

        Args:
            tokens: `[B, S]` token ids. On a pipeline stage without `tok_embeddings`, the hidden
                states `[B, S, dim]` arriving from the previous stage (passed positionally by
                `torch.distributed.pipelining`).
            h: `[B, S, dim]` input embeddings instead of tokens (the MIMO model assembles text
                embeddings from `self.tok_embeddings` and modality embeddings itself).
            positions: `[B, S]` integer rotary positions. Default: `sequence_index`. Give them for
                packed rows, where they restart at every document.
            document_ids: `[B, S]` document id of each token of a packed row; attention is then
                causal within a document and blind across documents. Default: one document.
            sequence_index: `[B, S]` each row's column in the full, unsharded sequence; it decides
                causality. Default: `0..S-1` (plain rows: the attention core may use a causal
                kernel with no mask). Under context parallelism a rank holds a subset of the
                columns and passes their global indices here.

        Returns:
            `[B, S, vocab_size]` logits, or hidden states `[B, S, dim]` when `output` is None
            (normalised unless `norm` is None too).
        """
        if h is not None and tokens is not None:
            raise ValueError("Llama.forward: pass token ids `tokens` or embeddings `h`, not both")
        if h is None:
            if tokens is None:
                raise ValueError("Llama.forward: pass token ids `tokens` or embeddings `h`")
            h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        b, s = h.shape[0], h.shape[1]
        if positions is None:
            positions = (torch.arange(s, device=h.device).expand(b, s) if sequence_index is None
                         else sequence_index)
        # One set of angles for all layers.
        rope = rope_tables(*rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, h.dtype,
                                         self.config.rope_scaling))

        for layer in self.layers.values():
            h = layer(h, rope, sequence_index, document_ids)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def head_is_embedding(llama: Llama) -> bool:
    """Whether `llama` (a whole model or a pipeline stage's) holds both its token embedding and its
    output head as one parameter (`LlamaConfig.tie_embeddings`)."""
    return (llama.tok_embeddings is not None and llama.output is not None
            and llama.output.weight is llama.tok_embeddings.weight)


def untie_embeddings(llama: Llama, why: str) -> None:
    """Give a tied `llama`'s head a parameter of its own, a copy of the token embedding, in place
    (the whole model's config then says untied: its checkpoints and exports hold both), and warn
    naming `why` (a pipeline split, which puts the embedding and the head in different stages),
    once on rank 0 (every rank unties its copy alike): from then on the two train apart, where
    transformers' tied model sums their gradients."""
    weight = llama.tok_embeddings.weight
    llama.output.weight = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
    llama.config = dataclasses.replace(llama.config, tie_embeddings=False)
    llama.head_copies_embedding = True
    warn_once(f"{why}: the tied output head (output.weight = tok_embeddings.weight, tie_word_embeddings) "
              "becomes a copy of the token embedding that trains on its own (two parameters, as an untied "
              "model: gradients and updates differ from the tied model's, and it exports untied); use pp = 1 "
              "and one stage per rank to train it tied", stacklevel=3)
