"""`ModalityEncoder`: an encoder and its projection into the language model's width, as one module."""

from __future__ import annotations

import torch
from torch import nn

from dtensor_mimo.models.projection import Projection


class ModalityEncoder(nn.Module):
    """``inputs [N, ...]`` -> ``[N * tokens_per_item, out_dim]``: encode each item, project each
    token, flatten items batch-major (the row order of `dtensor_mimo.assemble.assemble`).

    Args:
        encoder: maps ``[N, ...]`` to ``[N, tokens_per_item, in_dim]`` (`ViT`, `AudioEncoder`).
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

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        # Flatten before projecting: the result is then a fresh tensor, not a view (FSDP2 warns on views).
        return self.projection(self.encoder(inputs).flatten(0, 1))
