"""A Whisper-style audio encoder: a 1-D convolution front end over log-mel frames, learned
positions, the ViT's transformer blocks, a final norm.

Clips `[N_clips, n_mels, T]` become `[N_clips, T_out, dim]` with
`T_out = AudioConfig.output_length(T)`, which the data layer uses to count audio tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_mimo.models.layers import init_weights
from dtensor_mimo.models.vit import EncoderBlock

_KERNEL = 3  # both convolutions: kernel 3, padding 1, as in Whisper


@dataclass
class AudioConfig:
    n_mels: int = 80
    max_frames: int = 3000  # longest input clip in frames (Whisper: 30 s at 100 frames/s)
    conv_strides: tuple[int, int] = (1, 2)  # Whisper: the second convolution halves the time axis
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    mlp_hidden: int | None = None  # None: 4 * dim
    norm_eps: float = 1e-5
    # Whisper's variants (defaults: learned positions, a key bias); see `from_hf`.
    key_bias: bool = True
    frozen_positions: bool = False  # the position table does not train (Whisper's sinusoids)

    def __post_init__(self) -> None:
        if self.mlp_hidden is None:
            self.mlp_hidden = 4 * self.dim
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"AudioConfig: dim={self.dim} must be divisible by n_heads={self.n_heads}"
            )
        if len(self.conv_strides) != 2 or any(s < 1 for s in self.conv_strides):
            raise ValueError(
                f"AudioConfig: conv_strides={self.conv_strides} must be two strides >= 1 "
                f"(one per convolution)"
            )

    def output_length(self, num_frames: int) -> int:
        """Encoder output length (audio tokens per clip) for `num_frames` input frames."""
        t = num_frames
        for stride in self.conv_strides:
            t = (t + 2 * (_KERNEL // 2) - _KERNEL) // stride + 1  # Conv1d length formula
        return t

    @classmethod
    def from_hf(cls, path: str) -> AudioConfig:
        """The encoder config of a Hugging Face Whisper checkpoint directory."""
        from dtensor_mimo.models.hf.audio import audio_config_from_hf

        return audio_config_from_hf(path)

    @classmethod
    def tiny(cls, **overrides) -> AudioConfig:
        """8 mel bins, up to 32 frames, dim 32; keyword arguments override fields."""
        config = cls(n_mels=8, max_frames=32, dim=32, n_layers=2, n_heads=4, mlp_hidden=64)
        return dataclasses.replace(config, **overrides)


class AudioEncoder(nn.Module):
    """Audio encoder: `[N_clips, n_mels, T]` -> `[N_clips, config.output_length(T), dim]`.

    Call `init_weights(seed)` for weights that depend only on the seed and parameter names.
    """

    def __init__(self, config: AudioConfig) -> None:
        super().__init__()
        self.config = config
        stride1, stride2 = config.conv_strides
        pad = _KERNEL // 2
        self.conv1 = nn.Conv1d(config.n_mels, config.dim, _KERNEL, stride=stride1, padding=pad)
        self.conv2 = nn.Conv1d(config.dim, config.dim, _KERNEL, stride=stride2, padding=pad)
        max_tokens = config.output_length(config.max_frames)
        self.pos_embed = nn.Parameter(torch.zeros(max_tokens, config.dim), requires_grad=not config.frozen_positions)
        block_args = (config.dim, config.n_heads, config.mlp_hidden, config.norm_eps, "gelu", config.key_bias)
        self.layers = nn.ModuleDict(
            {str(i): EncoderBlock(*block_args) for i in range(config.n_layers)}
        )
        self.norm = nn.LayerNorm(config.dim, eps=config.norm_eps)

    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init from `seed`; see `dtensor_mimo.models.layers.init_weights`."""
        init_weights(self, seed)

    def embed(self, mels: torch.Tensor) -> torch.Tensor:
        """Convolutions and position embeddings: `[N, n_mels, T]` -> `[N, output_length(T), dim]`
        (the part before the blocks; a first pipeline stage runs it)."""
        c = self.config
        if mels.dim() != 3 or mels.shape[1] != c.n_mels or mels.shape[2] > c.max_frames:
            raise ValueError(
                f"AudioEncoder: expected mels [N, n_mels={c.n_mels}, T <= "
                f"max_frames={c.max_frames}], got {list(mels.shape)}"
            )
        x = F.gelu(self.conv1(mels))
        x = F.gelu(self.conv2(x))  # [N, dim, T_out]
        x = x.transpose(1, 2)  # [N, T_out, dim]
        return x + self.pos_embed[: x.shape[1]]

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The part after the blocks (a last pipeline stage runs it): the final norm."""
        return self.norm(x)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        x = self.embed(mels)
        for layer in self.layers.values():
            x = layer(x)
        return self.finish(x)
