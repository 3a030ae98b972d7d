"""A ViT image encoder: patch embedding, learned positions, pre-norm transformer blocks.

Images `[N_img, C, H, W]` become patch embeddings `[N_img, n_patches, dim]`. By default this is
SigLIP's vision tower without its pooling head (no class token: the language model consumes every
patch); CLIP-style towers (a class token that attends but is dropped from the output, a LayerNorm
before the blocks, quick GELU) are config switches. The block class `EncoderBlock` is shared with
the audio encoder. Its Linear layers are named for tensor parallel plans: `attn.wq/wk/wv` and
`mlp.fc1` colwise, `attn.wo` and `mlp.fc2` rowwise; attention counts its heads from the tensor
shapes at run time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_mimo.models.layers import init_weights


@dataclass
class ViTConfig:
    image_size: int = 224  # square images, image_size x image_size pixels
    patch_size: int = 16
    in_channels: int = 3
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    mlp_hidden: int | None = None  # None: 4 * dim
    norm_eps: float = 1e-6
    # Variants (defaults: SigLIP's tower, exact GELU as in the original ViT); see `from_hf`.
    activation: Literal["gelu", "gelu_tanh", "quick_gelu"] = "gelu"  # SigLIP: gelu_tanh, CLIP: quick_gelu
    class_token: bool = False  # CLIP: a learned token first in every item, dropped from the output
    pre_norm: bool = False  # CLIP: LayerNorm on the embeddings before the blocks
    final_norm: bool = True  # LayerNorm after the blocks (LLaVA's CLIP features have none)
    patch_bias: bool = True  # CLIP's patch embedding has none

    def __post_init__(self) -> None:
        if self.mlp_hidden is None:
            self.mlp_hidden = 4 * self.dim
        if self.patch_size > self.image_size:
            raise ValueError(f"ViTConfig: patch_size={self.patch_size} exceeds image_size={self.image_size}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"ViTConfig: activation={self.activation!r} is not one of {sorted(ACTIVATIONS)}")
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"ViTConfig: dim={self.dim} must be divisible by n_heads={self.n_heads}"
            )

    @property
    def num_patches(self) -> int:
        """Tokens per image: the length of the encoder output (pixels beyond the last whole
        patch are dropped, as the patch convolution does)."""
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, path: str) -> ViTConfig:
        """The config of a Hugging Face SigLIP or CLIP vision tower directory (a vision model,
        or a full SigLIP / CLIP / LLaVA checkpoint: its ``vision_config``)."""
        from dtensor_mimo.models.hf.vision import vit_config_from_hf

        return vit_config_from_hf(path)

    @classmethod
    def tiny(cls, **overrides) -> ViTConfig:
        """16x16 images in 4x4 patches (16 tokens), dim 32; keyword arguments override fields."""
        config = cls(image_size=16, patch_size=4, dim=32, n_layers=2, n_heads=4, mlp_hidden=64)
        return dataclasses.replace(config, **overrides)


class SelfAttention(nn.Module):
    """Bidirectional multi-head self-attention (every token sees every token of its item);
    `key_bias` False: no bias on `wk` (Whisper; softmax ignores it anyway)."""

    def __init__(self, dim: int, n_heads: int, key_bias: bool = True) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, dim, bias=key_bias)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # -1: the number of heads this rank holds (all of them, or a tensor-parallel shard);
        # unflatten rather than view(b, s, -1, d) so that an empty batch works too.
        q = self.wq(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        k = self.wk(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        v = self.wv(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.wo(out.transpose(1, 2).flatten(2))


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "quick_gelu": _quick_gelu}


class MLP(nn.Module):
    """fc2(act(fc1 x)), act one of `ACTIVATIONS` (default: exact GELU)."""

    def __init__(self, dim: int, hidden: int, activation: str = "gelu") -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderBlock(nn.Module):
    """Pre-norm block: h = x + attn(norm1(x)); out = h + mlp(norm2(h))."""

    def __init__(self, dim: int, n_heads: int, mlp_hidden: int, norm_eps: float, activation: str = "gelu",
                 key_bias: bool = True) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = SelfAttention(dim, n_heads, key_bias)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = MLP(dim, mlp_hidden, activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.norm1(x))
        return h + self.mlp(self.norm2(h))


class ViT(nn.Module):
    """Image encoder: `[N_img, C, H, W]` -> `[N_img, num_patches, dim]`.

    Call `init_weights(seed)` for weights that depend only on the seed and parameter names.
    """

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        # A stride-p convolution with a p x p kernel is one Linear applied to every patch.
        self.patch_embed = nn.Conv2d(
            config.in_channels, config.dim, kernel_size=config.patch_size, stride=config.patch_size,
            bias=config.patch_bias,
        )
        extra = int(config.class_token)
        self.cls_token = nn.Parameter(torch.zeros(config.dim)) if config.class_token else None
        self.pos_embed = nn.Parameter(torch.zeros(config.num_patches + extra, config.dim))
        self.pre_norm = nn.LayerNorm(config.dim, eps=config.norm_eps) if config.pre_norm else None
        block_args = (config.dim, config.n_heads, config.mlp_hidden, config.norm_eps, config.activation)
        self.layers = nn.ModuleDict(
            {str(i): EncoderBlock(*block_args) for i in range(config.n_layers)}
        )
        self.norm = nn.LayerNorm(config.dim, eps=config.norm_eps) if config.final_norm else None

    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init from `seed`; see `dtensor_mimo.models.layers.init_weights`."""
        init_weights(self, seed)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Patch and position embeddings: `[N, C, H, W]` -> `[N, num_patches, dim]` (the part
        before the blocks; a first pipeline stage runs it)."""
        c = self.config
        expected = (c.in_channels, c.image_size, c.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != expected:
            raise ValueError(
                f"ViT: expected images [N, {c.in_channels}, {c.image_size}, {c.image_size}], "
                f"got {list(images.shape)}"
            )
        x = self.patch_embed(images)  # [N, dim, H/p, W/p]
        x = x.flatten(2).transpose(1, 2)  # [N, num_patches, dim], patches in row-major order
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], 1, -1).to(x.dtype), x], dim=1)
        x = x + self.pos_embed
        return x if self.pre_norm is None else self.pre_norm(x)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The part after the blocks (a last pipeline stage runs it): the final norm, if any,
        and the class token dropped: `[N, num_patches, dim]`."""
        if self.norm is not None:
            x = self.norm(x)
        return x[:, 1:] if self.cls_token is not None else x

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embed(images)
        for layer in self.layers.values():
            x = layer(x)
        return self.finish(x)
