"""A ViT image encoder: patch embedding, learned positions, pre-norm transformer blocks.

Images `[N_img, C, H, W]` become patch embeddings `[N_img, n_patches, dim]`; a list of images,
each `[C, H_i, W_i]` (at their own size with `dynamic_resolution`), becomes their rows
`[sum_i tokens_i, dim]`, encoded as one packed sequence with per-item attention
(`dtensor_mimo.models.layers.packed_attention`), each item with its own interpolated position
grid (SigLIP's `interpolate_pos_encoding`). By default this is
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
from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_mimo.models.config_json import read_config, warn_dropout, with_defaults
from dtensor_mimo.models.layers import PackedItems, init_weights, packed_attention, pad_empty_packed


TOWERS = ("siglip_vision_model", "clip_vision_model")
"""Hugging Face ``model_type``s of the vision towers `ViTConfig.from_hf` reads."""
HF_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "quick_gelu": "quick_gelu"}
"""Hugging Face ``hidden_act`` -> the ViT's ``activation``."""


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
    # Images at their own size: an image [C, H, W] gives (H // patch) * (W // patch) tokens, its
    # positions interpolated (bicubic) from the learned image_size grid, as transformers' SigLIP /
    # CLIP with interpolate_pos_encoding=True. max_patches: the most tokens one image may give.
    dynamic_resolution: bool = False
    max_patches: int | None = None
    # Video: each item stacks this many consecutive frames of in_channels each along channels
    # (Qwen2-VL's temporal patch): the patch embedding sees them together, so the motion within a
    # stack is in every patch's embedding, and a stack gives one frame's rows.
    temporal_patch: int = 1

    def __post_init__(self) -> None:
        if self.mlp_hidden is None:
            self.mlp_hidden = 4 * self.dim
        if self.patch_size > self.image_size:
            raise ValueError(f"ViTConfig: patch_size={self.patch_size} exceeds image_size={self.image_size}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"ViTConfig: activation={self.activation!r} is not one of {sorted(ACTIVATIONS)}")
        if self.temporal_patch < 1:
            raise ValueError(f"ViTConfig: temporal_patch={self.temporal_patch}: frames per item must be >= 1")
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"ViTConfig: dim={self.dim} must be divisible by n_heads={self.n_heads}"
            )
        if self.max_patches is not None and (not self.dynamic_resolution or self.max_patches < 1):
            raise ValueError(f"ViTConfig: max_patches={self.max_patches} is the patch budget of one image under "
                             f"dynamic_resolution=True (got dynamic_resolution={self.dynamic_resolution}); "
                             "it must be >= 1")

    @property
    def item_channels(self) -> int:
        """Channels of one item: `in_channels` per frame times the frames stacked (`temporal_patch`)."""
        return self.in_channels * self.temporal_patch

    @property
    def num_patches(self) -> int:
        """Tokens per image: the length of the encoder output (pixels beyond the last whole
        patch are dropped, as the patch convolution does)."""
        return (self.image_size // self.patch_size) ** 2

    def item_problem(self, shape: Sequence[int]) -> str | None:
        """Why this ViT cannot encode one image of `shape` ``[C, H, W]`` (None: it can), phrased
        to follow "an image of" / "items of"."""
        shape = list(shape)
        p = self.patch_size
        if not self.dynamic_resolution:
            fixed = [self.item_channels, self.image_size, self.image_size]
            if shape != fixed:
                return (f"shape {shape}, but the ViT takes {fixed} (ViTConfig(dynamic_resolution=True) takes "
                        "images at their own size)")
            return None
        if len(shape) != 3 or shape[0] != self.item_channels:
            return f"shape {shape}, but the ViT takes [{self.item_channels}, H, W] (in_channels={self.in_channels}" + (
                f" x temporal_patch={self.temporal_patch})" if self.temporal_patch > 1 else ")")
        if shape[1] < p or shape[2] < p:
            return f"shape {shape}, smaller than one {p}x{p} patch"
        patches = (shape[1] // p) * (shape[2] // p)
        if self.max_patches is not None and patches > self.max_patches:
            return (f"shape {shape}: {patches} patches ({shape[1] // p} x {shape[2] // p} of {p} px), over the "
                    f"budget max_patches={self.max_patches}; resize it to at most {self.max_patches * p * p} "
                    "pixels (the data layer's job)")
        return None

    def tokens_for(self, shape: Sequence[int]) -> int:
        """Rows the ViT gives for one image of `shape` ``[C, H, W]``: ``(H // patch) * (W //
        patch)`` (`num_patches` without dynamic resolution). Pure: the data and batch layers count
        tokens per item with it before any encoder runs. Raises ValueError for an image the ViT
        cannot encode (`item_problem`)."""
        problem = self.item_problem(shape)
        if problem:
            raise ValueError(f"ViT: an image of {problem}")
        return (shape[1] // self.patch_size) * (shape[2] // self.patch_size)

    @classmethod
    def from_hf(cls, path: str) -> ViTConfig:
        """The config of a Hugging Face SigLIP or CLIP vision tower directory (a vision model,
        or a full SigLIP / CLIP / LLaVA checkpoint: its ``vision_config``; the tower up to the
        ``vision_feature_layer`` of a checkpoint that has one: LLaVA, LLaVA-NeXT, -OneVision, ...)."""
        top = read_config(path)
        c = with_defaults(top.get("vision_config", top))
        tower = c.get("model_type")
        if tower not in TOWERS:
            raise ValueError(f"{path}: model_type {tower!r} is not a vision tower the ViT loads ({', '.join(TOWERS)})")
        warn_dropout(path, c)
        clip = tower == "clip_vision_model"
        if c.get("hidden_act") not in HF_ACTIVATIONS:
            raise ValueError(f"{path}: hidden_act={c.get('hidden_act')!r} is not one of {sorted(HF_ACTIVATIONS)}")
        layers, final_norm = c["num_hidden_layers"], not clip  # CLIP's post_layernorm only norms its pooled output
        # LLaVA and its kin (LLaVA-NeXT, -OneVision, Aya Vision, ...) take the hidden states of an
        # inner block (a field left out: the model type's default, as transformers v4 wrote it).
        top = with_defaults(top)
        if "vision_config" in top and ("vision_feature_layer" in top or "vision_feature_layers" in top):
            layer = top.get("vision_feature_layer", top.get("vision_feature_layers"))
            strategy = top.get("vision_feature_select_strategy", "default")
            if not isinstance(layer, int):
                raise ValueError(f"{path}: vision_feature_layer={layer!r}: features from several layers are not supported")
            if strategy != ("default" if clip else "full"):
                # "default" drops the first token: CLIP's class token, but a patch of a SigLIP tower.
                raise ValueError(f"{path}: vision_feature_select_strategy={strategy!r} with a {tower}: the ViT keeps "
                                 f"exactly the patch tokens ({'default' if clip else 'full'})")
            if not -layers - 1 <= layer <= layers:  # hidden_states: the embeddings, then each block's output
                raise ValueError(f"{path}: vision_feature_layer={layer} is outside the tower's {layers} blocks "
                                 f"(hidden states {-layers - 1}..{layers}: the embeddings, then each block's output)")
            layers, final_norm = (layers + 1 + layer if layer < 0 else layer), False
        # a video tower `save_hf` wrote: num_channels holds `temporal_patch` stacked frames
        frames, channels = c.get("temporal_patch", 1), c.get("num_channels", 3)
        if not isinstance(frames, int) or frames < 1 or channels % frames:
            raise ValueError(f"{path}: temporal_patch={frames!r} does not divide num_channels={channels} into "
                             "frames (it is the frames per item stacked in num_channels, an int >= 1)")
        return cls(image_size=c["image_size"], patch_size=c["patch_size"], in_channels=channels // frames,
                   temporal_patch=frames,
                         dim=c["hidden_size"], n_layers=layers, n_heads=c["num_attention_heads"],
                         mlp_hidden=c["intermediate_size"], norm_eps=c.get("layer_norm_eps", 1e-6),
                         activation=HF_ACTIVATIONS[c["hidden_act"]], class_token=clip, pre_norm=clip,
                         patch_bias=not clip, final_norm=final_norm)

    @classmethod
    def tiny(cls, **overrides) -> ViTConfig:
        """16x16 images in 4x4 patches (16 tokens), dim 32; keyword arguments override fields."""
        config = cls(image_size=16, patch_size=4, dim=32, n_layers=2, n_heads=4, mlp_hidden=64)
        return dataclasses.replace(config, **overrides)


class SelfAttention(nn.Module):
    """Bidirectional multi-head self-attention (every token sees every token of its item);
    `key_bias` False: no bias on `wk` (Whisper; softmax ignores it anyway). Items are the rows of
    `x [N, S, dim]`, or, with `packed`, consecutive runs of `packed.lengths` rows of a packed
    `x [1, S, dim]` (`packed_attention`, or what `packed_attention_fn` is set to: e.g.
    `FlexAttentionCore().packed`)."""

    def __init__(self, dim: int, n_heads: int, key_bias: bool = True) -> None:
        super().__init__()
        self.packed_attention_fn = packed_attention
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, dim, bias=key_bias)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, *, packed: PackedItems | None = None) -> torch.Tensor:
        # -1: the number of heads this rank holds (all of them, or a tensor-parallel shard);
        # unflatten rather than view(b, s, -1, d) so that an empty batch works too.
        q = self.wq(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        k = self.wk(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        v = self.wv(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v) if packed is None else self.packed_attention_fn(q, k, v, packed)
        return self.wo(out.transpose(1, 2).flatten(2))


def self_attentions(module: nn.Module) -> list[SelfAttention]:
    """The library `SelfAttention` layers of `module` (a ViT, an AudioEncoder, a ModalityEncoder)."""
    return [m for m in module.modules() if isinstance(m, SelfAttention)]


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
    """Pre-norm block: h = x + attn(norm1(x)); out = h + mlp(norm2(h)). `packed`: `x` is a
    packed sequence of these items (see `SelfAttention`); a keyword, so that tensor
    parallel input hooks, which handle positional arguments, pass it through untouched."""

    def __init__(self, dim: int, n_heads: int, mlp_hidden: int, norm_eps: float, activation: str = "gelu",
                 key_bias: bool = True) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = SelfAttention(dim, n_heads, key_bias)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = MLP(dim, mlp_hidden, activation)

    def forward(self, x: torch.Tensor, *, packed: PackedItems | None = None) -> torch.Tensor:
        h = x + self.attn(self.norm1(x), packed=packed)
        return h + self.mlp(self.norm2(h))


class ViT(nn.Module):
    """Image encoder: `[N_img, C, H, W]` -> `[N_img, num_patches, dim]`, or a list of images
    `[C, H_i, W_i]` -> their rows `[sum_i tokens_for(image_i), dim]`, items in order (one packed
    sequence with per-item attention; images at their own size need `dynamic_resolution`).

    Call `init_weights(seed)` for weights that depend only on the seed and parameter names.
    """

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        # A stride-p convolution with a p x p kernel is one Linear applied to every patch.
        self.patch_embed = nn.Conv2d(
            config.item_channels, config.dim, kernel_size=config.patch_size, stride=config.patch_size,
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

    def tokens_for(self, shape: Sequence[int]) -> int:
        """Rows this ViT gives for one image of `shape` ``[C, H, W]`` (`ViTConfig.tokens_for`)."""
        return self.config.tokens_for(shape)

    def packed_items(self, shapes: Sequence[Sequence[int]]) -> PackedItems:
        """Rows of each image of `shapes` inside the blocks of a packed call: its tokens, plus
        the class token of a CLIP-style tower (what the blocks and `finish` take as `packed`)."""
        return PackedItems([self.tokens_for(s) + int(self.config.class_token) for s in shapes])

    def positions(self, grid: tuple[int, int]) -> torch.Tensor:
        """Position embeddings of an image of ``grid = (rows, columns)`` patches: `pos_embed`
        itself for the learned square grid, else its patch part resized bicubically as
        transformers' SigLIP / CLIP ``interpolate_pos_encoding`` does (the class token's row, if
        any, first and unchanged): ``[class + rows * columns, dim]``."""
        side = self.config.image_size // self.config.patch_size
        if tuple(grid) == (side, side):  # transformers skips the (identity) resize here too
            return self.pos_embed
        extra = int(self.cls_token is not None)
        dim = self.pos_embed.shape[-1]
        table = self.pos_embed[extra:].reshape(1, side, side, dim).permute(0, 3, 1, 2)
        table = F.interpolate(table, size=tuple(grid), mode="bicubic", align_corners=False)
        table = table.permute(0, 2, 3, 1).reshape(-1, dim)
        return torch.cat([self.pos_embed[:extra], table]) if extra else table

    def embed(self, images: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """Patch and position embeddings (the part before the blocks; a first pipeline stage
        runs it): `[N, C, H, W]` -> `[N, (class +) patches, dim]`; a list of images -> their rows
        packed `[1, sum(packed_items(shapes).lengths), dim]`."""
        if not isinstance(images, torch.Tensor):
            return self._embed_packed(images)
        c = self.config
        problem = c.item_problem(images.shape[1:]) if images.dim() == 4 else "not [N, C, H, W]"
        if problem:
            size = "H, W" if c.dynamic_resolution else f"{c.image_size}, {c.image_size}"
            detail = f" (images of {problem})" if c.dynamic_resolution and images.dim() == 4 else ""
            raise ValueError(f"ViT: expected images [N, {c.item_channels}, {size}], got {list(images.shape)}{detail}")
        if images.shape[0]:
            # In the weight's dtype, as the packed path takes a list: items of another dtype (float64
            # from numpy, uint8 pixels) must not fail on the ranks that hold images only, while
            # their peers wait for the rows.
            x = self.patch_embed(images.to(self.patch_embed.weight.dtype))  # [N, dim, H/p, W/p]
        else:  # no image (a rank or microbatch with none): `_embed_packed`'s Linear over no patches,
            # the same empty rows and zero gradients; torch's compiled convolution backward gives an
            # empty batch's weight gradient other strides than its meta kernel says (inductor's
            # assert_size_stride fails, torch 2.13 CPU), which a whole-module compile would meet.
            weight, p = self.patch_embed.weight, self.config.patch_size
            x = F.linear(images.new_zeros(0, weight[0].numel(), dtype=weight.dtype), weight.flatten(1),
                         self.patch_embed.bias)
            x = x.view(0, weight.shape[0], 1, 1).expand(-1, -1, images.shape[2] // p, images.shape[3] // p)
        grid = tuple(x.shape[2:])
        x = x.flatten(2).transpose(1, 2)  # [N, num_patches, dim], patches in row-major order
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], 1, -1).to(x.dtype), x], dim=1)
        x = x + self.positions(grid)
        return x if self.pre_norm is None else self.pre_norm(x)

    def _embed_packed(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        p, weight = self.config.patch_size, self.patch_embed.weight
        grids = []
        for i, image in enumerate(images):
            problem = (f"a {type(image).__name__}, not a tensor [C, H, W]" if not isinstance(image, torch.Tensor)
                       else self.config.item_problem(image.shape))
            if problem:
                raise ValueError(f"ViT: image {i} of the {len(images)} in the list has {problem}")
            grids.append((image.shape[1] // p, image.shape[2] // p))
        # The patch convolution as one Linear over every image's patches (cut row-major, pixels
        # beyond the last whole patch dropped, as the convolution drops them).
        patches = [image[:, :h * p, :w * p].unflatten(1, (h, p)).unflatten(3, (w, p)).permute(1, 3, 0, 2, 4)
                   .reshape(h * w, -1) for image, (h, w) in zip(images, grids)]
        patches = torch.cat(patches) if patches else weight.new_zeros(0, weight[0].numel())
        x = F.linear(patches.to(weight.dtype), weight.flatten(1), self.patch_embed.bias)  # [patches, dim]
        # No image (a rank whose share is empty) still runs every parameter, on empty slices: each
        # parameter gets a (zero) gradient, as on the ranks with images, so FSDP2 reduces the same
        # gradients everywhere.
        if self.cls_token is not None:  # each image's class token first, as in the batch path
            cls = self.cls_token.to(x.dtype).reshape(1, -1)
            x = torch.cat([part for item in x.split([h * w for h, w in grids]) for part in (cls, item)] or [cls[:0]])
        table = {grid: self.positions(grid) for grid in set(grids)}  # each size resized once
        x = x + torch.cat([table[grid] for grid in grids] or [self.pos_embed[:0]])
        x = x.unsqueeze(0)
        return x if self.pre_norm is None else self.pre_norm(x)

    def finish(self, x: torch.Tensor, packed: PackedItems | None = None) -> torch.Tensor:
        """The part after the blocks (a last pipeline stage runs it): the final norm, if any,
        and the class token dropped: `[N, num_patches, dim]`; for a packed `x [1, S, dim]` of
        the items `packed` (`packed_items`), their rows `[sum tokens, dim]`."""
        if self.norm is not None:
            x = self.norm(x)
        # config, not cls_token: a last pipeline stage does not hold the embeddings
        if packed is None:
            return x[:, 1:] if self.config.class_token else x
        x = x.squeeze(0)
        if self.config.class_token and packed.lengths:
            x = torch.cat([item[1:] for item in x.split(list(packed.lengths))])
        return x

    def forward(self, images: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        x = self.embed(images)  # checks the images
        packed = None if isinstance(images, torch.Tensor) else self.packed_items([i.shape for i in images])
        x, packed, empty = pad_empty_packed(x, packed)
        for layer in self.layers.values():
            x = layer(x, packed=packed)
        x = self.finish(x, packed)
        return x[:0] if empty else x
