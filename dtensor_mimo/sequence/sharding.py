"""Load-balanced ("zigzag") context-parallel sharding of the sequence dimension.

Pure tensor indexing: no process group. Under causal attention, query column t attends to t + 1
keys, so a plain contiguous split would give the last cp rank most of the work. Instead the
sequence is cut into `2 * cp` equal chunks and cp rank r keeps chunks `r` and `2 * cp - 1 - r`
(in that order, which is also ascending column order). Every rank then holds `seq_len / cp`
columns and the same number of causal (query, key) pairs.

    seq_len 8, cp 2:   chunks [0,1] [2,3] [4,5] [6,7]
                       rank 0 keeps columns [0, 1, 6, 7], rank 1 keeps [2, 3, 4, 5]

Shift labels for next-token prediction *before* sharding (`labels[t] = tokens[t + 1]` on the full
row): after sharding, the neighbour of a chunk's last column lives on another rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def zigzag_index(
    seq_len: int, cp: int, rank: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """The global columns cp rank `rank` keeps, ascending: a LongTensor of `seq_len // cp`.

    `seq_len` must be a multiple of `2 * cp` (any length when `cp == 1`, which keeps everything).
    """
    if cp < 1:
        raise ValueError(f"zigzag sharding: cp={cp} must be at least 1")
    if not 0 <= rank < cp:
        raise ValueError(f"zigzag sharding: rank={rank} is not a cp rank of cp={cp} (0..{cp - 1})")
    if cp == 1:
        return torch.arange(seq_len, device=device)
    chunks = 2 * cp
    if seq_len % chunks != 0:
        padded = -(-seq_len // chunks) * chunks
        raise ValueError(
            f"zigzag sharding: seq_len={seq_len} is not divisible by 2*cp={chunks} (cp={cp}); "
            f"pad the sequence to a multiple of {chunks} (here {padded}) and mask the padding "
            "out of the loss"
        )
    chunk = seq_len // chunks
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    mirror = chunks - 1 - rank
    second = torch.arange(mirror * chunk, (mirror + 1) * chunk, device=device)
    return torch.cat((first, second))


def zigzag_shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """The part of `x` that cp rank `rank` keeps along the sequence dimension `dim`.

    `dim=1` fits batch-first fields (`[B, S, H]` embeddings, `[B, S]` labels, masks, positions,
    document ids); use `dim=2` for `[B, H, S, D]` attention tensors. Differentiable.
    """
    index = zigzag_index(x.shape[dim], cp, rank, device=x.device)
    return x.index_select(dim, index)


@dataclass(frozen=True)
class CPShard:
    """One cp rank's part of a batch; every field is `[B, seq_len // cp, ...]` or None.

    `sequence_index` is the global column of each kept row, the `sequence_index` argument of
    `Llama.forward` (it decides causality; rotary `positions`, when given, are separate).
    """

    sequence_index: torch.Tensor
    tokens: torch.Tensor | None = None
    embeddings: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None


def shard_for_cp(
    cp: int,
    rank: int,
    *,
    tokens: torch.Tensor | None = None,
    embeddings: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> CPShard:
    """Zigzag-shard the full per-sample fields of a batch for cp rank `rank` of `cp`.

    Every given field is batch-first with the sequence on dim 1 (`[B, S]`, or `[B, S, H]` for
    `embeddings`) and all agree on `B` and `S`; a field passed as None stays None. Labels must
    already be shifted for next-token prediction. Returns the sharded fields and the
    `sequence_index` (`[B, S // cp]`, int64) that `Llama.forward` needs.
    """
    fields = {
        "tokens": tokens,
        "embeddings": embeddings,
        "labels": labels,
        "loss_mask": loss_mask,
        "positions": positions,
        "document_ids": document_ids,
    }
    given = {name: t for name, t in fields.items() if t is not None}
    if not given:
        raise ValueError("shard_for_cp: pass at least one of " + ", ".join(fields))
    shapes = {name: tuple(t.shape[:2]) for name, t in given.items()}
    if min(t.dim() for t in given.values()) < 2 or len(set(shapes.values())) != 1:
        raise ValueError(
            "shard_for_cp: every field must be [batch, seq_len, ...] with the same batch and "
            f"seq_len; got {({name: tuple(t.shape) for name, t in given.items()})}"
        )
    first = next(iter(given.values()))
    batch, seq_len = first.shape[:2]
    index = zigzag_index(seq_len, cp, rank, device=first.device)
    sharded = {name: t.index_select(1, index.to(t.device)) for name, t in given.items()}
    return CPShard(sequence_index=index.expand(batch, -1), **sharded)
