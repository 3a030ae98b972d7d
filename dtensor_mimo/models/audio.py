"""A Whisper-style audio encoder: a 1-D convolution front end over log-mel frames, learned
positions, the ViT's transformer blocks, a final norm.

Clips `[N_clips, n_mels, T]` become `[N_clips, T_out, dim]` with
`T_out = AudioConfig.output_length(T)`, which the data layer uses to count audio tokens. A list
of clips, each `[n_mels, T_i]` (of their own lengths with `variable_length`), becomes their rows
`[sum_i output_length(T_i), dim]`, encoded as one packed sequence: the convolutions as one
matmul over every clip's windows (zero outside its clip, as the convolution's padding), positions
from 0 in every clip, attention within each clip (`dtensor_mimo.models.layers.packed_attention`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_mimo.models.config_json import read_config, warn_dropout
from dtensor_mimo.models.layers import PackedItems, init_weights, pad_empty_packed
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
    # Clips of a list may differ in length (each up to max_frames, none padded); else a list's
    # clips share one length, as the rows of a tensor do.
    variable_length: bool = False

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

    def item_problem(self, shape: Sequence[int]) -> str | None:
        """Why the encoder cannot encode one clip of `shape` ``[n_mels, T]`` (None: it can),
        phrased to follow "a clip of" / "items of"."""
        shape = list(shape)
        if len(shape) != 2 or shape[0] != self.n_mels or not 0 < shape[1] <= self.max_frames:
            return f"shape {shape}, but the audio encoder takes [{self.n_mels}, frames <= {self.max_frames}]"
        return None

    def tokens_for(self, shape: Sequence[int]) -> int:
        """Rows the encoder gives for one clip of `shape` ``[n_mels, T]``: `output_length(T)`.
        Pure: the data and batch layers count tokens per item with it before any encoder runs.
        Raises ValueError for a clip the encoder cannot encode (`item_problem`)."""
        problem = self.item_problem(shape)
        if problem:
            raise ValueError(f"AudioEncoder: a clip of {problem}")
        return self.output_length(shape[1])

    @classmethod
    def from_hf(cls, path: str) -> AudioConfig:
        """The encoder config of a Hugging Face Whisper checkpoint directory."""
        c = read_config(path)
        if c.get("model_type") != "whisper":
            raise ValueError(f"{path}: model_type {c.get('model_type')!r} is not 'whisper'")
        if c.get("activation_function", "gelu") != "gelu":
            raise ValueError(f"{path}: activation_function={c['activation_function']!r} (the encoder uses gelu)")
        warn_dropout(path, c)
        return cls(n_mels=c["num_mel_bins"], max_frames=2 * c["max_source_positions"], conv_strides=(1, 2),
                           dim=c["d_model"], n_layers=c["encoder_layers"], n_heads=c["encoder_attention_heads"],
                           mlp_hidden=c["encoder_ffn_dim"], norm_eps=1e-5, key_bias=False, frozen_positions=True)

    @classmethod
    def tiny(cls, **overrides) -> AudioConfig:
        """8 mel bins, up to 32 frames, dim 32; keyword arguments override fields."""
        config = cls(n_mels=8, max_frames=32, dim=32, n_layers=2, n_heads=4, mlp_hidden=64)
        return dataclasses.replace(config, **overrides)


class AudioEncoder(nn.Module):
    """Audio encoder: `[N_clips, n_mels, T]` -> `[N_clips, config.output_length(T), dim]`, or a
    list of clips `[n_mels, T_i]` -> their rows `[sum_i output_length(T_i), dim]`, items in order
    (one packed sequence with per-clip attention).

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

    def tokens_for(self, shape: Sequence[int]) -> int:
        """Rows this encoder gives for one clip of `shape` ``[n_mels, T]`` (`AudioConfig.tokens_for`)."""
        return self.config.tokens_for(shape)

    def packed_items(self, shapes: Sequence[Sequence[int]]) -> PackedItems:
        """Rows of each clip of `shapes` inside the blocks of a packed call (what the blocks and
        `finish` take as `packed`)."""
        return PackedItems([self.tokens_for(s) for s in shapes])

    def embed(self, mels: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """Convolutions and position embeddings (the part before the blocks; a first pipeline
        stage runs it): `[N, n_mels, T]` -> `[N, output_length(T), dim]`; a list of clips ->
        their rows packed `[1, sum(packed_items(shapes).lengths), dim]`."""
        if not isinstance(mels, torch.Tensor):
            return self._embed_packed(mels)
        c = self.config
        if mels.dim() != 3 or mels.shape[1] != c.n_mels or mels.shape[2] > c.max_frames:
            raise ValueError(
                f"AudioEncoder: expected mels [N, n_mels={c.n_mels}, T <= "
                f"max_frames={c.max_frames}], got {list(mels.shape)}"
            )
        x = F.gelu(self.conv1(mels.to(self.conv1.weight.dtype)))  # the packed path's dtype rule (ViT.embed)
        x = F.gelu(self.conv2(x))  # [N, dim, T_out]
        x = x.transpose(1, 2)  # [N, T_out, dim]
        return x + self.pos_embed[: x.shape[1]]

    def _embed_packed(self, mels: Sequence[torch.Tensor]) -> torch.Tensor:
        frames = []
        for i, clip in enumerate(mels):
            problem = (f"a {type(clip).__name__}, not a tensor [n_mels, T]" if not isinstance(clip, torch.Tensor)
                       else self.config.item_problem(clip.shape))
            if problem:
                raise ValueError(f"AudioEncoder: clip {i} of the {len(mels)} in the list has {problem}")
            frames.append(clip.shape[1])
        if not self.config.variable_length and len(set(frames)) > 1:
            raise ValueError(f"AudioEncoder: the clips of the list have lengths {frames} frames; clips of their "
                             "own length need AudioConfig(variable_length=True)")
        weight = self.conv1.weight
        x = torch.cat([clip.t() for clip in mels]) if mels else weight.new_zeros(0, self.config.n_mels)
        x, frames = _packed_conv(x.to(weight.dtype), frames, self.conv1)
        x, frames = _packed_conv(F.gelu(x), frames, self.conv2)
        positions = torch.cat([torch.arange(n) for n in frames] or [torch.zeros(0, dtype=torch.long)])
        # every clip's positions from 0
        return (F.gelu(x) + self.pos_embed[positions.to(x.device, non_blocking=True)]).unsqueeze(0)

    def finish(self, x: torch.Tensor, packed: PackedItems | None = None) -> torch.Tensor:
        """The part after the blocks (a last pipeline stage runs it): the final norm; a packed
        `x [1, S, dim]` (`packed` given) comes out as rows `[S, dim]`."""
        x = self.norm(x)
        return x if packed is None else x.squeeze(0)

    def forward(self, mels: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        x = self.embed(mels)  # checks the clips
        packed = None if isinstance(mels, torch.Tensor) else self.packed_items([m.shape for m in mels])
        x, packed, empty = pad_empty_packed(x, packed)
        for layer in self.layers.values():
            x = layer(x, packed=packed)
        x = self.finish(x, packed)
        return x[:0] if empty else x


def _packed_conv(x: torch.Tensor, frames: Sequence[int], conv: nn.Conv1d) -> tuple[torch.Tensor, list[int]]:
    """`conv` (kernel 3, padding 1) applied to each clip of the packed frames `x [sum(frames),
    C_in]` on its own: ``([sum(out_frames), C_out], out_frames)``. Every output frame's window of
    input rows is gathered (a row index past the end: the zero row standing for the padding, so
    no window reaches into a neighbouring clip) and all windows go through one matmul."""
    stride, pad = conv.stride[0], conv.padding[0]
    out_frames = [(n + 2 * pad - _KERNEL) // stride + 1 for n in frames]
    zero = x.shape[0]  # the index of the zero row appended below
    index, start = [torch.zeros(0, _KERNEL, dtype=torch.long)], 0
    for n, m in zip(frames, out_frames):  # on the host (sizes are ints), then one copy to the device
        taps = torch.arange(m).unsqueeze(1) * stride - pad + torch.arange(_KERNEL)
        index.append(torch.where((taps >= 0) & (taps < n), taps + start, zero))  # [m, kernel]
        start += n
    index = torch.cat(index).to(x.device, non_blocking=True)
    windows = torch.cat([x, x.new_zeros(1, x.shape[1])])[index]  # [out, kernel, C_in]
    out = F.linear(windows.transpose(1, 2).flatten(1), conv.weight.flatten(1), conv.bias)  # weight [C_out, C_in, k]
    return out, out_frames
