"""The projection from an encoder's width to the language model's: Linear, GELU, Linear.

Named `fc1` (colwise under tensor parallel) and `fc2` (rowwise), like the encoder MLPs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_mimo.models.layers import init_weights


class Projection(nn.Module):
    """`[..., in_dim]` -> `[..., out_dim]`; the hidden width defaults to `out_dim`."""

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int | None = None) -> None:
        super().__init__()
        hidden_dim = out_dim if hidden_dim is None else hidden_dim
        self.fc1 = nn.Linear(in_dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, out_dim)

    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init from `seed`; see `dtensor_mimo.models.layers.init_weights`."""
        init_weights(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))
