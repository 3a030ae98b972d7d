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


@dataclass
class Pending:
    """In-flight transfers of one exchange on one rank; `wait()` returns the output (or None)."""

    rank_plan: RankPlan
    dim: int
    works: list = field(default_factory=list)
    out: torch.Tensor | None = None
    staged: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)  # (lo, hi, buffer)
    _done: bool = False

    def wait(self) -> torch.Tensor | None:
        if not self._done:
            for w in self.works:
                w.wait()
            if self.out is not None:
                for lo, hi, buf in self.staged:  # ascending peer order: deterministic sums
                    target = _rows(self.out, self.dim, lo, hi)
                    target.add_(buf) if self.rank_plan.reduce else target.copy_(buf)
            self.staged.clear()
            self._done = True
        return self.out


def start(
    rank_plan: RankPlan,
    dim: int,
    *,
    src_local: torch.Tensor | None,
    out_shape: Sequence[int] | None,
    dtype: torch.dtype,
    device: torch.device,
    send: bool = True,
    recv: bool = True,
) -> Pending:
    """Post this rank's sends and/or receives of ``rank_plan`` in one batch; apply local copies.

    Args:
        src_local: this rank's local source tensor (needed for sends and copies).
        out_shape: local output shape (bridged dim = ``rank_plan.dst_rows``); None: no output.
        send / recv: post only one side (split-phase use by a pipeline runtime). Local
            copies happen on the receiving call, which must then be given ``src_local``.
    """
    pending = Pending(rank_plan, dim)
    ops: list[dist.P2POp] = []
    if send and rank_plan.sends:
        for s in rank_plan.sends:
            piece = _rows(src_local, dim, s.lo, s.hi)
            ops.append(dist.P2POp(dist.isend, piece if piece.is_contiguous() else piece.contiguous(), s.peer))
    if recv and out_shape is not None:
        direct = dim == 0 and not rank_plan.reduce
        # The plan covers every output row except zero_fill ones; sums start from zero.
        alloc = torch.zeros if rank_plan.reduce or rank_plan.zero_fill else torch.empty
        out = alloc(tuple(out_shape), dtype=dtype, device=device)
        for c in rank_plan.copies:
            target = _rows(out, dim, c.dst_lo, c.dst_hi)
            piece = _rows(src_local, dim, c.src_lo, c.src_hi)
            target.add_(piece) if rank_plan.reduce else target.copy_(piece)
        for r in rank_plan.recvs:
            if direct:
                buf = _rows(out, dim, r.lo, r.hi)
            else:
                shape = list(out_shape)
                shape[dim] = r.hi - r.lo
                buf = torch.empty(shape, dtype=dtype, device=device)
                pending.staged.append((r.lo, r.hi, buf))
            ops.append(dist.P2POp(dist.irecv, buf, r.peer))
        pending.out = out
    if ops:
        pending.works = dist.batch_isend_irecv(ops)
    return pending
