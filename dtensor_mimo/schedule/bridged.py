"""One microbatch through the DTensor bridge, for `model(batch)` and prediction: every encoder's
rows of a batch as a DTensor on its mesh, moved to the language mesh by one `redistribute_many`
(one autograd node, so encoders sharing ranks stay ordered in backward too)."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from dtensor_mimo.bridge import exchange, redistribute_many
from dtensor_mimo.data import MimoBatch
from dtensor_mimo.data.balance import encoder_cuts
from dtensor_mimo.layout import MimoLayout

TOKEN_PLACEMENTS = (Replicate(), Shard(0), Replicate(), Replicate())
"""Encoder output rows on a module mesh (pp, dp, cp, tp): split over dp, whole on every other dim."""


class ZeroConnectedTo(torch.autograd.Function):
    """A zero loss whose backward feeds zero gradients to `ys`: off the language mesh, this runs
    the rank's part of the bridge's backward exchange (DTensor's ``to_local`` cannot be used
    there: its backward rebuilds the gradient with a mismatched stride on non-member ranks)."""

    @staticmethod
    def forward(ctx, device: torch.device, *ys: DTensor) -> torch.Tensor:
        ctx.ys = ys
        return torch.zeros((), device=device)

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):
        return (None, *(torch.zeros_like(y) for y in ctx.ys))


def encode(layout: MimoLayout, name: str, encoder: nn.Module | None, batch: MimoBatch, rank: int, dim: int,
           dtype: torch.dtype, device: torch.device, trainable: bool, cuts: Sequence[int]) -> DTensor:
    """This rank's rows of encoder `name`: the items from ``cuts[k]`` to ``cuts[k + 1]`` for its dp
    index k (`data.balance.encoder_cuts`). `encoder`: None off its mesh, where the shard is empty
    but requires grad when the encoder trains, so that this rank joins the backward exchange.
    In the `dtype` that crosses, as a DTensor on the encoder's mesh."""
    if encoder is not None:
        k = layout.coordinate(name, rank)["dp"]
        items = batch.modalities[name].select_items(range(cuts[k], cuts[k + 1]))
        local = encoder(items.to(device).inputs).to(dtype)
    else:
        local = torch.empty(0, dtype=dtype, device=device, requires_grad=trainable)
    return DTensor.from_local(local, layout.mesh(name), TOKEN_PLACEMENTS, run_check=False,
                              shape=torch.Size((batch.num_tokens(name), dim)), stride=(dim, 1))


def encoder_rows(layout: MimoLayout, language: str, encoders: Mapping[str, nn.Module], names: Sequence[str],
                 trainable: Mapping[str, bool], batch: MimoBatch, rank: int, dim: int, dtype: torch.dtype,
                 device: torch.device, grad_placements: tuple[Placement, ...], check: bool | str,
                 hops: int | None, buffers: exchange.BufferPool | None,
                 balance: Mapping[str, bool | None] | None = None,
                 widths: Mapping[str, int | None] | None = None) -> tuple[DTensor, ...]:
    """The rows of every encoder of `names` (this rank's own in `encoders`, `encode`d here) moved
    to the `language` mesh in one exchange, with the batch's per-sample token counts as ragged
    sizes; each encoder's items cut over its dp ranks by sample or, as its `balance` says, by
    cost (`data.balance.encoder_cuts`, its width from `widths`; the exchange then takes the new
    owners as ``shard_bounds``); `check`, `hops` and `buffers` as `redistribute`'s."""
    cuts = [encoder_cuts(batch.modalities[n], layout.parallelism(n).dp, (balance or {}).get(n), (widths or {}).get(n))
            for n in names]
    xs = [encode(layout, n, encoders[n] if n in encoders else None, batch, rank, dim, dtype, device, trainable[n],
                 starts) for n, (starts, _) in zip(names, cuts)]
    if not xs:
        return ()
    return redistribute_many(
        xs, [layout.mesh(language)] * len(xs), [TOKEN_PLACEMENTS] * len(xs),
        sample_sizes=[batch.tokens_per_sample(n) for n in names], shard_bounds=[bounds for _, bounds in cuts],
        grad_placements=[grad_placements] * len(xs), check=check, names=[(n, language) for n in names],
        hops=[hops] * len(xs), buffers=buffers)
