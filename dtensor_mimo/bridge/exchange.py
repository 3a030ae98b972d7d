"""Execute one rank's part of a `Plan`: one batched point-to-point round plus local copies.

Receive buffers are sized from the plan, never from a shape message. When the bridged
dim is 0 and pieces are written once, each receive lands directly in its rows of the
output (no staging copy); otherwise (another dim, or summing Partial contributions)
pieces land in staging buffers and are added in the plan's fixed order, so a sum is
bitwise the same on every run. The exchange talks to global ranks on the default
process group, so the two meshes need not share any group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from dtensor_mimo.bridge.plan import RankPlan


def _rows(t: torch.Tensor, dim: int, lo: int, hi: int) -> torch.Tensor:
    return t.narrow(dim, lo, hi - lo)


class _Works:
    """The works of one batch, shared by its transfers, waited on exactly once.

    gloo's send and receive works block on a second ``wait()`` (it waits for another
    completion), so a batch shared by several `Pending`s must not be waited per transfer.
    """

    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self) -> None:
        works, self._works = self._works, []
        for w in works:
            w.wait()


@dataclass
class Pending:
    """In-flight transfers of one exchange on one rank; `wait()` returns the output (or None).

    With a status word (`start(..., status=...)`), `peer_status` holds, after `wait()`, the word
    each peer this rank received from sent with its message."""

    rank_plan: RankPlan
    dim: int
    works: _Works = field(default_factory=lambda: _Works([]))
    out: torch.Tensor | None = None
    staged: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)  # (lo, hi, buffer)
    statuses: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (peer, received word)
    _done: bool = False

    def peer_status(self) -> dict[int, int]:
        """``{peer: word}`` of the peers that sent a nonzero status word (after `wait()`)."""
        if not self.statuses:
            return {}
        words = torch.cat([w for _, w in self.statuses]).tolist()  # one device-to-host copy
        return {peer: w for (peer, _), w in zip(self.statuses, words) if w}

    def wait(self) -> torch.Tensor | None:
        if not self._done:
            self.works.wait()
            if self.out is not None:
                for lo, hi, buf in self.staged:  # ascending peer order: deterministic sums
                    target = _rows(self.out, self.dim, lo, hi)
                    target.add_(buf) if self.rank_plan.reduce else target.copy_(buf)
            self.staged.clear()
            self._done = True
        return self.out


def as_planned(local: torch.Tensor, shape: Sequence[int]) -> tuple[torch.Tensor, bool]:
    """`local` if it has the planned `shape`, else zeros of that shape and True: a rank whose
    rows are wrong still sends exactly the planned messages, so no peer waits for one that never
    comes; the caller reports the mismatch (status word, or the training step's all-reduce)."""
    if tuple(local.shape) == tuple(shape):
        return local, False
    return local.new_zeros(tuple(shape)), True


@dataclass
class Transfer:
    """One tensor's part of an exchange on this rank.

    Attributes:
        rank_plan: this rank's part of the tensor's plan.
        dim: the bridged tensor dim.
        src_local: this rank's local source tensor (for sends and local copies), or None.
        out_shape: local output shape (bridged dim = ``rank_plan.dst_rows``); None: no output here.
    """

    rank_plan: RankPlan
    dim: int
    src_local: torch.Tensor | None
    out_shape: Sequence[int] | None
    dtype: torch.dtype
    device: torch.device


def start(transfers: Sequence[Transfer], *, send: bool = True, recv: bool = True,
          status: int | None = None) -> list[Pending]:
    """Post every send and/or receive of ``transfers`` in ONE batch, then apply local copies.

    Several tensors (e.g. one per encoder) go in one round, in list order, so the message
    order between any two ranks is the same on both sides whatever order autograd runs
    things in. ``send`` / ``recv`` post one side only (split-phase use by a pipeline
    runtime); local copies happen on the receiving call, which then needs ``src_local``.

    ``status``: a word (int64) that rides with every message, right behind it, in the same
    batch: a receiver learns, at the cost of one 8-byte message per data message, whether its
    peer's data can be trusted (`Pending.peer_status`). Every rank of one exchange must pass
    a status or none.
    """
    ops: list[dist.P2POp] = []
    copies = []  # (output, transfer, copy): done after posting, while the messages travel
    pendings = [Pending(t.rank_plan, t.dim) for t in transfers]
    device = next((t.device for t in transfers), None)
    word = None if status is None else torch.tensor([status], dtype=torch.int64, device=device)
    for t, pending in zip(transfers, pendings):
        rp, dim = t.rank_plan, t.dim
        if send:
            for s in rp.sends:
                piece = _rows(t.src_local, dim, s.lo, s.hi)
                ops.append(dist.P2POp(dist.isend, piece if piece.is_contiguous() else piece.contiguous(), s.peer))
                if word is not None:
                    ops.append(dist.P2POp(dist.isend, word, s.peer))
        if recv and t.out_shape is not None:
            # The plan covers every output row except zero_fill ones; sums start from zero.
            alloc = torch.zeros if rp.reduce or rp.zero_fill else torch.empty
            out = alloc(tuple(t.out_shape), dtype=t.dtype, device=t.device)
            copies.extend((out, t, c) for c in rp.copies)
            direct = dim == 0 and not rp.reduce  # receive straight into the output rows
            for r in rp.recvs:
                if direct:
                    buf = _rows(out, dim, r.lo, r.hi)
                else:
                    shape = list(t.out_shape)
                    shape[dim] = r.hi - r.lo
                    buf = torch.empty(shape, dtype=t.dtype, device=t.device)
                    pending.staged.append((r.lo, r.hi, buf))
                ops.append(dist.P2POp(dist.irecv, buf, r.peer))
                if word is not None:
                    received = torch.empty(1, dtype=torch.int64, device=t.device)
                    pending.statuses.append((r.peer, received))
                    ops.append(dist.P2POp(dist.irecv, received, r.peer))
            pending.out = out
    works = _Works(dist.batch_isend_irecv(ops) if ops else [])
    for out, t, c in copies:  # rows that no message touches
        target = _rows(out, t.dim, c.dst_lo, c.dst_hi)
        piece = _rows(t.src_local, t.dim, c.src_lo, c.src_hi)
        target.add_(piece) if t.rank_plan.reduce else target.copy_(piece)
    for pending in pendings:
        pending.works = works
    return pendings
