"""Execute one rank's part of a `Plan`: one batched point-to-point round plus local copies.

Receive buffers are sized from the plan, never from a shape message. When the bridged
dim is 0 and pieces are written once, each receive lands directly in its rows of the
output (no staging copy); otherwise (another dim, or summing Partial contributions)
pieces land in staging buffers and are added in the plan's fixed order (`RankPlan.sum_order`,
local copies included), so a sum is bitwise the same on every run and on every replica. The
exchange talks to global ranks on the default process group, so the two meshes need not share
any group.
"""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from dtensor_mimo.bridge.plan import RankPlan


STATUS_TAG = 0x5354
"""The point-to-point tag of status words; the data of a batch's i-th transfer uses tag i. gloo's tcp
transport sends a message once the receiver has announced the matching receive, one announcement at
a time per (peer, tag): two messages to one peer on one tag cost an extra round trip and two thread
wake-ups (0.3-0.9 ms measured on this machine, against ~0.04 ms on tags of their own). Matching stays
FIFO per (peer, tag), so batches posted in the same order on both sides still pair up. NCCL ignores
tags (its order is the posting order)."""


def _rows(t: torch.Tensor, dim: int, lo: int, hi: int) -> torch.Tensor:
    return t.narrow(dim, lo, hi - lo)


def _storage_users(t: torch.Tensor) -> int:
    """How many tensors (views included) hold `t`'s storage. torch exposes no public
    spelling of this count; the pool only compares it with the count taken at allocation.
    `use_count_tracks_views` checks (once, at import) that it still means that."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def use_count_tracks_views() -> bool:
    """Whether torch's private storage use count still counts the tensors of a storage: one more
    for a live view (or a tensor autograd saved), back down when it goes. `BufferPool` relies on
    it to know a block is free; where it does not hold, the pool hands out fresh tensors (correct,
    only slower) and tests/test_faults.py fails, naming this function."""
    try:
        block = torch.empty(8)
        alone = _storage_users(block)
        view = block[:4].view(2, 2)
        leaf = torch.ones(2, 2, requires_grad=True)
        saved = (leaf * view).sum()  # autograd saves `view` for the gradient of `leaf`
        held = _storage_users(block)
        del view
        still_saved = _storage_users(block)
        del saved
        return held == alone + 1 and still_saved == alone + 1 and _storage_users(block) == alone
    except (AttributeError, RuntimeError, TypeError):
        return False


def _capacity(numel: int) -> int:
    """`numel` rounded up to 1/8 of its power of two (at most 1/8 spare), so ragged sizes that
    change every step settle on a few capacities."""
    grain = 1 << max(numel.bit_length() - 4, 0)
    return -(-numel // grain) * grain


class BufferPool:
    """Receive and staging buffers recycled across exchanges on CPU: a steady stream of transfers
    (a training loop, a pipeline alternating microbatches) allocates no receive buffer per call
    while at most ``max_blocks`` of them per dtype are alive at once.

    A buffer is handed out as a view of a flat block (so ``torch.save`` of an output writes the
    whole block: ``clone()`` it first), and the block is taken again once no tensor made from it
    is alive: the caller dropped its outputs, autograd saves none of them, no work holds them.
    Blocks are reused best fit, among those at most twice the rounded request (`_capacity`); a
    free block too small is replaced. Past ``max_blocks`` blocks per (dtype, device), a request
    is served by a fresh, unpooled tensor; so is an empty one.

    On an accelerator the pool hands out fresh tensors: the caching allocator already recycles
    memory there, per stream and honouring ``record_stream``, which a pool of views could not.
    """

    reuse = use_count_tracks_views()
    """False where torch's use count no longer means what the pool needs: fresh tensors then."""

    def __init__(self, max_blocks: int = 64) -> None:
        self.max_blocks = max_blocks
        self._blocks: dict[tuple[torch.dtype, torch.device], list[tuple[torch.Tensor, int]]] = {}
        self._lock = threading.Lock()  # a block is checked free and handed out atomically
        self.allocations = 0
        """Blocks allocated so far (a steady state allocates none)."""

    def take(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device, *,
             zero: bool = False) -> torch.Tensor:
        """A contiguous tensor of `shape` (zeros if `zero`, else uninitialised) from a free block."""
        device = torch.device(device)
        numel = math.prod(shape)
        # (a block made under inference mode would stay an inference tensor: a later training
        # exchange that reused it would fail on this rank alone)
        if numel == 0 or device.type != "cpu" or not self.reuse or torch.is_inference_mode_enabled():
            return _fresh(shape, dtype, device, zero=zero)
        with self._lock:
            blocks = self._blocks.setdefault((dtype, device), [])  # ascending capacity
            first = bisect.bisect_left(blocks, numel, key=_numel)
            limit = 2 * _capacity(numel)
            block = next((b for b, users in blocks[first:] if b.numel() <= limit and _storage_users(b) == users),
                         None)  # best fit
            if block is None:
                small = next((i for i in reversed(range(first)) if _storage_users(blocks[i][0]) == blocks[i][1]),
                             None)
                if small is None and len(blocks) >= self.max_blocks:
                    return _fresh(shape, dtype, device, zero=zero)
                if small is not None:  # a free block too small for this request: replaced
                    del blocks[small]
                block = torch.empty(_capacity(numel), dtype=dtype, device=device)
                self.allocations += 1
                bisect.insort(blocks, (block, _storage_users(block)), key=_numel)
            out = block[:numel].view(tuple(shape))
        return out.zero_() if zero else out

    def clear(self) -> None:
        """Drop every block (memory returns once the outputs made from it are gone too)."""
        with self._lock:
            self._blocks.clear()

    @property
    def blocks(self) -> int:
        """Blocks the pool holds (at most ``max_blocks`` per dtype and device)."""
        return sum(len(blocks) for blocks in self._blocks.values())

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds."""
        return sum(b.numel() * b.element_size() for blocks in self._blocks.values() for b, _ in blocks)


def _numel(entry: tuple[torch.Tensor, int]) -> int:
    return entry[0].numel()


def _fresh(shape: Sequence[int], dtype: torch.dtype, device: torch.device, *, zero: bool = False) -> torch.Tensor:
    return (torch.zeros if zero else torch.empty)(tuple(shape), dtype=dtype, device=device)


class _Batch:
    """The works of one batch, shared by its transfers and waited on exactly once, and the status
    words it received (one per peer).

    gloo's send and receive works block on a second ``wait()`` (it waits for another
    completion), so a batch shared by several `Pending`s must not be waited per transfer.
    """

    def __init__(self, works: list, status_peers: Sequence[int] = (), words: torch.Tensor | None = None) -> None:
        self._works = works
        self.status_peers = list(status_peers)
        self.words = words

    def wait(self) -> None:
        works, self._works = self._works, []
        for w in works:
            w.wait()


@dataclass
class Pending:
    """In-flight transfers of one exchange on one rank; `wait()` returns the output (or None).

    With a status word (`start(..., status=...)`), `peer_status` gives, after `wait()`, the
    nonzero words of the peers this rank received from (one word per peer per round)."""

    rank_plan: RankPlan
    dim: int
    batch: _Batch = field(default_factory=lambda: _Batch([]))
    out: torch.Tensor | None = None
    staged: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)  # (lo, hi, buffer)
    """Pieces added or copied into the output rows [lo, hi) in `wait`: the receives not received in
    place and, when summing, first the local copies (the plan's `copies`, then `recvs`)."""
    _done: bool = False

    def peer_status(self) -> dict[int, int]:
        """``{peer: word}`` of the peers that sent a nonzero status word in this round (after `wait()`)."""
        if self.batch.words is None:
            return {}
        words = self.batch.words.tolist()  # one device-to-host copy
        return {peer: w for peer, w in zip(self.batch.status_peers, words) if w}

    def flagged_peers(self) -> torch.Tensor | None:
        """How many peers sent a nonzero status word in this round (after `wait()`), as a 0-d
        int64 tensor on the words' device: no host sync (`peer_status` reads them on the host).
        None without status words."""
        if self.batch.words is None:
            return None
        return (self.batch.words != 0).sum()

    def wait(self) -> torch.Tensor | None:
        if not self._done:
            self.batch.wait()
            if self.out is not None:
                rp = self.rank_plan
                # Summing: copies and receives staged alike, added in the plan's order (every row's
                # contributions in Partial-coordinate order): the same bits on every replica and run.
                for i in (rp.sum_order if rp.reduce else range(len(self.staged))):
                    lo, hi, buf = self.staged[i]
                    target = _rows(self.out, self.dim, lo, hi)
                    target.add_(buf) if rp.reduce else target.copy_(buf)
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
          status: int | torch.Tensor | None = None, pool: BufferPool | None = None) -> list[Pending]:
    """Post every send and/or receive of ``transfers`` in ONE batch, then apply local copies.

    Several tensors (e.g. one per encoder) go in one round, in list order, so the message
    order between any two ranks is the same on both sides whatever order autograd runs
    things in. ``send`` / ``recv`` post one side only (split-phase use by a pipeline
    runtime); local copies happen on the receiving call, which then needs ``src_local``.

    ``status``: a word (int64) posted with this rank's data in the same batch, on `STATUS_TAG`
    (so it does not queue behind the data), one to each peer it sends to: a receiver learns, at
    the cost of one 8-byte message per peer, whether its peers' data can be trusted
    (`Pending.peer_status`). Every rank of one exchange must pass a status or none. A status may
    be a one-element integer tensor on the transfers' device (a flag computed there: no host sync).

    ``pool``: outputs and staging buffers come from it (recycled, see `BufferPool`) instead of
    fresh allocations.
    """
    alloc = _fresh if pool is None else pool.take
    assert len(transfers) < STATUS_TAG, "a transfer's tag would meet the status words'"
    ops: list[dist.P2POp] = []
    copies = []  # (output, transfer, copy): done after posting, while the messages travel
    pendings = [Pending(t.rank_plan, t.dim) for t in transfers]
    words, recv_peers = None, []
    if status is not None:
        send_peers = dict.fromkeys(s.peer for t in transfers if send for s in t.rank_plan.sends)
        recv_peers = list(dict.fromkeys(r.peer for t in transfers if recv and t.out_shape is not None
                                        for r in t.rank_plan.recvs))
        device = next(t.device for t in transfers)
        word = (status.to(torch.int64).reshape(1) if isinstance(status, torch.Tensor)
                else torch.full((1,), status, dtype=torch.int64, device=device))  # no host-to-device copy
        words = torch.empty(len(recv_peers), dtype=torch.int64, device=device)
        ops += [dist.P2POp(dist.isend, word, peer, tag=STATUS_TAG) for peer in send_peers]
        ops += [dist.P2POp(dist.irecv, words[i:i + 1], peer, tag=STATUS_TAG) for i, peer in enumerate(recv_peers)]
    for tag, (t, pending) in enumerate(zip(transfers, pendings)):
        rp, dim = t.rank_plan, t.dim
        if send:
            for s in rp.sends:
                piece = _rows(t.src_local, dim, s.lo, s.hi)
                ops.append(dist.P2POp(dist.isend, piece if piece.is_contiguous() else piece.contiguous(), s.peer,
                                      tag=tag))
        if recv and t.out_shape is not None:
            # The plan covers every output row except zero_fill ones; sums start from zero.
            out = alloc(t.out_shape, t.dtype, t.device, zero=rp.reduce or bool(rp.zero_fill))
            if rp.reduce:  # summed in `wait`, in the plan's order
                pending.staged.extend((c.dst_lo, c.dst_hi, _rows(t.src_local, t.dim, c.src_lo, c.src_hi))
                                      for c in rp.copies)
            else:
                copies.extend((out, t, c) for c in rp.copies)
            direct = dim == 0 and not rp.reduce  # receive straight into the output rows
            for r in rp.recvs:
                if direct:
                    buf = _rows(out, dim, r.lo, r.hi)
                else:
                    shape = list(t.out_shape)
                    shape[dim] = r.hi - r.lo
                    buf = alloc(shape, t.dtype, t.device)
                    pending.staged.append((r.lo, r.hi, buf))
                ops.append(dist.P2POp(dist.irecv, buf, r.peer, tag=tag))
            pending.out = out
    batch = _Batch(dist.batch_isend_irecv(ops) if ops else [], recv_peers, words)
    for out, t, c in copies:  # rows that no message touches
        _rows(out, t.dim, c.dst_lo, c.dst_hi).copy_(_rows(t.src_local, t.dim, c.src_lo, c.src_hi))
    for pending in pendings:
        pending.batch = batch
    return pendings
