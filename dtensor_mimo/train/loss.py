"""The training loss: per-token cross entropy, normalised by the loss tokens of the WHOLE global batch.

Every rank that holds a piece of the language model computes the summed loss of its tokens (its
dp shard, its cp chunk) divided by one number that every rank derives from the global batch's
metadata, with no communication: the total loss weight of the global batch. The shares then add
up to the single-process loss, and so do their gradients — whatever the dp sizes of the encoders
and of the language model, which is why the data-parallel gradient reduction must be a *sum*
(see `dtensor_mimo.parallelize.fsdp`). Averaging per rank instead would weight a token by the
size of the shard it landed in, and scale encoder gradients by the encoder/LLM dp ratio.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtensor_mimo.data import IGNORE_INDEX, MimoBatch


def loss_weights(labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Weight of each position in the loss: the mask where a label exists, else 0 (float32)."""
    return torch.where(labels == IGNORE_INDEX, 0.0, loss_mask.float())


def loss_normalizer(batch: MimoBatch) -> float:
    """Total loss weight of the global `batch` (at least 1, so a batch without targets has loss 0)."""
    return max(float(loss_weights(batch.labels, batch.loss_mask).sum()), 1.0)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum over positions of cross entropy times the loss weight; `logits` are ``[..., vocab]``."""
    per_token = F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return (per_token * loss_weights(labels, loss_mask).flatten()).sum()
