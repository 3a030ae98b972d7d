"""One pipelined forward + backward of a global batch on every rank: the module graph's schedule.

The global batch is cut into microbatches (`data.microbatches`); microbatch i's encoder rows cross
to the first language stage through `Crossing` i. What each rank does:

| rank holds                         | what it runs                                                     |
|------------------------------------|------------------------------------------------------------------|
| encoders only (overlapped)         | its encoders in the crossing order (`run_local_encoders`), or torch's GPipe over its encoder's pp group; rows leave per microbatch |
| language only                      | torch's language schedule; the first stage receives per microbatch, sends each gradient as soon as its backward ran |
| encoders + language (colocated)    | three phases: encode every microbatch, language schedule, one encoder backward |

Every rank posts its crossings in the same global order (`dtensor_mimo.schedule.order`: the
forwards of the first `window` microbatches, then the backward of j followed by the forward of
``j + window``), which keeps point-to-point traffic deadlock-free on NCCL by construction. The
window is the first language stage's in-flight bound when every encoder is a pp = 1 encoder on
ranks of its own, else M (all forwards, then all backwards).

A step of an unpipelined model is this same step with one microbatch: pp = 1 is a one-stage
pipeline.
"""

from __future__ import annotations

from typing import Collection, Mapping, Sequence

import torch
from torch import nn

from dtensor_mimo.bridge.exchange import BufferPool
from dtensor_mimo.data import MimoBatch, microbatches, shard
from dtensor_mimo.data.balance import encoder_cuts
from dtensor_mimo.layout import MimoLayout
from dtensor_mimo.schedule.crossing import Crossing
from dtensor_mimo.schedule.encoders import ColocatedEncoders, EncoderPipeline, run_local_encoders
from dtensor_mimo.schedule.feed import LanguageFeed
from dtensor_mimo.schedule.language import LanguagePipeline


def pipelined_step(
    layout: MimoLayout,
    language_name: str,
    batch: MimoBatch,
    *,
    num_microbatches: int,
    window: int,
    encoders: Mapping[str, nn.Module],
    encoder_pipelines: Mapping[str, EncoderPipeline],
    trainable: Mapping[str, bool],
    language: LanguagePipeline | None,
    overlapped: bool,
    normalizer: float,
    dim: int,
    dtype: torch.dtype,
    device: torch.device,
    buffers: BufferPool | None = None,
    hops: int | None = None,
    keep_gathered: Collection[str] = (),
    recompute: Collection[str] = (),
    balance: Mapping[str, bool | None] | None = None,
    widths: Mapping[str, int | None] | None = None,
) -> tuple[torch.Tensor, str | None]:
    """Forward and backward of the global `batch`; returns this rank's loss share and, if this
    rank's encoder rows disagreed with the batch metadata, what went wrong (`Crossing.forward`).

    `window`: the crossing order's (`crossing_window`, the same on every rank); `encoders`: the
    pp = 1 encoders this rank holds; `encoder_pipelines`: this rank's stage of each pp > 1
    encoder (on ranks of its own); `trainable`: every encoder's, known on every rank; `language`:
    this rank's language pipeline or None; `overlapped`: every encoder trains and is on ranks of
    its own; `buffers`: where the crossings receive (recycled across steps); `hops`: the
    crossings' route (`Crossing`'s ``n_hops``); `keep_gathered`: overlapped pp = 1 encoders whose
    FSDP2 parameters stay gathered across the step (`run_local_encoders`); `recompute`: colocated
    encoders that keep no graph through the language schedule (`ColocatedEncoders`); `balance`:
    each encoder's `ParallelOptions.balance` (None: on for a microbatch whose items differ in
    size), its items then cut over its dp ranks by cost (`data.balance`, the encoder's width from
    `widths`), and the crossings planned for those owners.
    """
    rank = torch.distributed.get_rank()
    mbs = microbatches(batch, num_microbatches)
    names = [n for n in trainable if n in batch.modalities]
    flags = [trainable[n] for n in names]
    if not any(flags):  # no gradient crosses back: nothing paces the forward crossings
        window = num_microbatches
    # Which items each encoder dp rank encodes, per microbatch: by sample, or balanced by cost.
    cuts = [{n: encoder_cuts(mb.modalities[n], layout.parallelism(n).dp, (balance or {}).get(n), (widths or {}).get(n))
             for n in names} for mb in mbs]
    crossings = [Crossing(layout, language_name, mb, names, flags, dim, dtype, device, index=i, buffers=buffers,
                          n_hops=hops, bounds={n: b for n, (_, b) in c.items() if b is not None})
                 for i, (mb, c) in enumerate(zip(mbs, cuts))]
    local = [n for n in names if n in encoders or n in encoder_pipelines]
    items = []  # this rank's share of each microbatch's items, per local encoder
    for mb, c in zip(mbs, cuts):
        per = {}
        for n in local:
            k, (starts, _) = layout.coordinate(n, rank)["dp"], c[n]
            per[n] = mb.modalities[n].select_items(range(starts[k], starts[k + 1]))
        items.append(per)
    # Host-to-device copies that do not wait for the device's queue (the inputs are host memory).
    inputs = [{n: m.to(device).inputs for n, m in per.items() if n in encoders} for per in items]
    first = language is not None and language.first is not None
    lang_mbs = []
    if language is not None:
        par = layout.parallelism(language_name)
        dp_rank = layout.coordinate(language_name, rank)["dp"]
        lang_mbs = [shard(mb, par.dp, dp_rank) for mb in mbs]

    errors: list[str | None] = []
    if overlapped:
        flat = [n for n in local if n in encoders]
        if flat:
            run_local_encoders({n: encoders[n] for n in flat}, inputs, crossings, window, dtype,
                               keep_gathered)
        for n, pipeline in encoder_pipelines.items():
            if n in local:
                pipeline.run([per[n].to(device).inputs for per in items],
                             [per[n].num_items for per in items],
                             tuple(batch.modalities[n].inputs.shape[1:]), batch.modalities[n].tokens_per_item,
                             dim, crossings)
                errors.append(pipeline.stage.error)
                pipeline.stage.error = None
        if language is None:
            return torch.zeros((), device=device), _error(crossings, errors)
        feed = LanguageFeed(crossings, flags, post_gradients=True, window=window) if first else None
        share = language.run(lang_mbs, normalizer, feed)
        if feed is not None:
            feed.finish()
        return share, _error(crossings, errors)

    # Colocated: encode everything, run the language schedule, then the encoders' backward.
    colocated = ColocatedEncoders(encoders, inputs, dtype, recompute)
    outputs = colocated.encode()
    received = [c.forward(out, receives=first) for c, out in zip(crossings, outputs)]
    feed = LanguageFeed(crossings, flags, post_gradients=False, received=received) if first else None
    share = language.run(lang_mbs, normalizer, feed) if language is not None else torch.zeros((), device=device)
    for pendings in received:  # sends of ranks that do not receive (each batch waited once)
        for p in pendings:
            p.wait()
    returned = [c.backward(feed.gradients(i) if first else {}, receives=bool(local))
                for i, c in enumerate(crossings)]
    grads = [{n: p.wait() for n, p in zip(c.backward_names, pendings)}
             for c, pendings in zip(crossings, returned)]
    colocated.backward(grads)
    return share, _error(crossings, errors)


def _error(crossings: Sequence[Crossing], errors: Sequence[str | None]) -> str | None:
    return next((e for e in [*errors, *(c.error for c in crossings)] if e), None)
