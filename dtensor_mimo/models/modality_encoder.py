"""`ModalityEncoder`: an encoder and its projection into the language model's width, as one module."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from dtensor_mimo.models.projection import Projection


class ModalityEncoder(nn.Module):
    """``inputs [N, ...]`` -> ``[N * tokens_per_item, out_dim]``: encode each item, project each
    token, flatten items batch-major (the row order of `dtensor_mimo.assemble.assemble`). A list
    of items (one tensor each, sizes of their own) goes to the encoder as it is, and its rows
    ``[sum_i tokens_for(item_i), in_dim]`` are projected: ``[sum_i tokens_i, out_dim]``.

    Args:
        encoder: maps ``[N, ...]`` to ``[N, tokens_per_item, in_dim]`` (`ViT`, `AudioEncoder`),
            and a list of items to their rows.
        projection: maps ``in_dim`` to the language model's ``dim``.
    """

    def __init__(self, encoder: nn.Module, projection: Projection) -> None:
        super().__init__()
        self.encoder = encoder
        self.projection = projection

    @property
    def out_dim(self) -> int:
        return self.projection.fc2.out_features

    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init of both parts from `seed` (see `models.layers.init_weights`); a
        pipeline stage that dropped the projection initializes what it holds."""
        self.encoder.init_weights(seed)
        if self.projection is not None:
            self.projection.init_weights(seed + 1)

    def tokens_for(self, shape: Sequence[int]) -> int:
        """Rows for one item of `shape` (the encoder's own `tokens_for`: pure, no forward)."""
        return self.encoder.tokens_for(shape)

    def forward(self, inputs: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        if not isinstance(inputs, torch.Tensor):
            return self.projection(self.encoder(inputs))  # already rows [sum tokens, in_dim]
        # Flatten before projecting: the result is then a fresh tensor, not a view (FSDP2 warns on views).
        return self.projection(self.encoder(inputs).flatten(0, 1))
