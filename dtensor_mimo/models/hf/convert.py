"""Moving parameters between a Hugging Face checkpoint and a module, shard by shard.

A `Source` names the checkpoint tensor a parameter comes from and how its rows are ordered.
`read_local` gives this rank's block of a parameter (all of a plain tensor; the block a DTensor
holds: tensor or FSDP shard), reading only that block (rows, and columns of a column shard).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

import torch

from dtensor_mimo.models.hf.safetensors import SafetensorsDir


@dataclass(frozen=True)
class Source:
    """Checkpoint tensor `name`; `rotary_head_dim`: its rows are heads of that size in Hugging
    Face's rotary order (element i paired with i + head_dim / 2), which the library keeps as
    adjacent pairs (2i, 2i + 1)."""

    name: str
    rotary_head_dim: int | None = None

    def read(self, files: SafetensorsDir, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The block ``offset .. offset + shape`` of the parameter, in the library's order."""
        if not shape:
            return files.read(self.name)
        first, last = offset[0], offset[0] + shape[0]
        hd = self.rotary_head_dim
        box = tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:]))  # read alone: no whole rows
        if hd is None:
            return files.read(self.name, slice(first, last), box)
        # whole heads around the block, reordered, then the block's rows
        lo, hi = first // hd * hd, -(-last // hd) * hd
        return to_adjacent_pairs(files.read(self.name, slice(lo, hi), box), hd)[first - lo:last - lo]

    def module_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The module parameter's shape for a checkpoint tensor of `shape`."""
        return shape

    def write(self, value: torch.Tensor) -> torch.Tensor:
        """The full parameter `value` in the checkpoint's order."""
        return value if self.rotary_head_dim is None else to_half_split(value, self.rotary_head_dim)


def table_source(name: str, module: str, top: Mapping[str, str], layer: Mapping[str, str], layer_prefix: str,
                 rotated: Mapping[str, int] = {}) -> Source:
    """The `Source` of parameter `name` of a transformer stack from name tables: `top` maps whole
    names (embeddings, final norm), `layer` maps the part of ``layers.{i}.<part>.{weight|bias}``
    to the checkpoint's part under ``{layer_prefix}.{i}.``; parts in `rotated` carry rotary rows of
    that head size."""
    if name in top:
        return Source(top[name])
    match = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", name)
    if match is None or match.group(2) not in layer:
        raise KeyError(f"no Hugging Face name for the {module} parameter {name!r}")
    index, part, kind = match.groups()
    return Source(f"{layer_prefix}.{index}.{layer[part]}.{kind}", rotary_head_dim=rotated.get(part))


def to_adjacent_pairs(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Hugging Face rotary rows -> the library's: per head, element j of the first half and
    element j of the second half become elements 2j and 2j + 1."""
    heads = rows.reshape(-1, 2, head_dim // 2, *rows.shape[1:])
    return heads.transpose(1, 2).reshape(rows.shape)


def to_half_split(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of `to_adjacent_pairs`."""
    heads = rows.reshape(-1, head_dim // 2, 2, *rows.shape[1:])
    return heads.transpose(1, 2).reshape(rows.shape)
