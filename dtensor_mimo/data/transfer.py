"""One buffer per batch between processes, reused: what a DataLoader worker hands its rank.

A worker's result crosses to the rank by pickling, and every tensor in it becomes its own shared
memory segment (a file descriptor sent over a socket, then mapped): a batch of tokens, labels,
masks, positions and media inputs costs several of those per step, about 2 ms on a small VM.
`Flat.pack` copies the batch's contiguous tensors into one byte buffer and pickles the rest with
references to it, so one segment crosses; `unpack` gives the same structure back, each tensor a
view of that buffer (same dtype, shape and values). Tensors that are not contiguous (e.g. the
stride-0 zeros standing for media a rank does not load) keep their ordinary pickling.

Even one new segment a batch costs the rank a round trip to the worker when it takes the batch
(the descriptor is handed over by a thread of the worker, which waits for the worker's GIL while
it decodes the next batch): about 1 ms of each step on a small VM, a step's critical path. A
`Handover` keeps a few segments per worker and reuses them: each crosses once, and a batch then
names its segment (a few bytes). The rank marks a segment free when the last tensor of the batch
it holds is freed (the buffer's storage owns a numpy view with a finalizer), and the worker only
writes into free ones, so a batch the rank keeps is never overwritten: while all of a worker's
segments are held, its batches get new ones, as without a `Handover`.
"""

from __future__ import annotations

import io
import os
import pickle
import secrets
import weakref
from typing import Any

import torch

__all__ = ["Flat", "Handover"]

_ALIGN = 64  # every tensor starts at a multiple of this many bytes: any dtype's view is aligned


class Flat:
    """`obj` (any picklable structure of tensors) as one uint8 buffer plus the pickle of the rest.

    ``Flat.pack(obj).unpack()`` equals `obj`; `pin_memory` pins the one buffer (the DataLoader calls
    it on the rank's side with ``pin_memory=True``)."""

    def __init__(self, buffer: torch.Tensor, skeleton: bytes, layout: list[tuple[int, torch.dtype, tuple[int, ...]]],
                 claim: _Claim | None = None):
        self.buffer, self.skeleton, self.layout = buffer, skeleton, layout
        self.claim = claim
        """The reused segment `buffer` lies in (`Handover`), named instead of sent when pickled."""

    @classmethod
    def pack(cls, obj: Any, pool: _Pool | None = None) -> Flat:
        """`obj` flattened into a new buffer, or into a free segment of `pool` (a worker's)."""
        out = io.BytesIO()
        pickler = _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.dump(obj)
        tensors, pickler.tensors = pickler.tensors, []
        layout, end = [], 0
        for t in tensors:
            layout.append((end, t.dtype, tuple(t.shape)))
            end += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        claim = pool.claim(end) if pool is not None else None
        buffer = claim.buffer if claim is not None else torch.empty(end, dtype=torch.uint8)
        for (start, _, _), t in zip(layout, tensors):
            n = t.numel() * t.element_size()
            buffer[start:start + n].copy_(t.reshape(-1).view(torch.uint8))
        return cls(buffer, out.getvalue(), layout, claim)

    def __reduce__(self) -> tuple:
        if self.claim is None:
            return Flat, (self.buffer, self.skeleton, self.layout)
        c = self.claim
        return _received, (c.pool, c.index, c.segment, c.flags, self.buffer.numel(), self.skeleton, self.layout)

    def unpack(self) -> Any:
        buffer = self.buffer
        views = []
        for start, dtype, shape in self.layout:
            n = torch.Size(shape).numel() * dtype.itemsize
            views.append(buffer[start:start + n].view(dtype).view(shape))
        return _Unpickler(io.BytesIO(self.skeleton), views).load()

    def pin_memory(self) -> Flat:
        return Flat(self.buffer.pin_memory(), self.skeleton, self.layout)


# Module-level (not a class per call: a class is a reference cycle, and the tensors its methods
# saw would live until the next garbage collection, and with them a `Handover`'s segments).
class _Pickler(pickle.Pickler):
    """Pickles `Flat`'s skeleton: contiguous CPU tensors become indices into `tensors`."""

    def __init__(self, file: io.BytesIO, protocol: int) -> None:
        super().__init__(file, protocol=protocol)
        self.tensors: list[torch.Tensor] = []

    def persistent_id(self, o: Any) -> int | None:
        if type(o) is torch.Tensor and o.device.type == "cpu" and not o.requires_grad and o.is_contiguous():
            self.tensors.append(o)
            return len(self.tensors) - 1
        return None


class _Unpickler(pickle.Unpickler):
    """Reads `Flat`'s skeleton back, each index a view of the buffer."""

    def __init__(self, file: io.BytesIO, views: list[torch.Tensor]) -> None:
        super().__init__(file)
        self.views = views

    def persistent_load(self, pid: int) -> torch.Tensor:
        return self.views[pid]


class Handover:
    """Reused shared-memory segments for the `Flat` batches that loader workers hand one rank.

    Made on the rank with the dataset, and travels with it into the workers (forked or pickled);
    `pack` there flattens a batch into a free segment of that worker's pool (at most `segments`
    per worker; a new buffer when all are held). On the rank, `pack` is `Flat.pack`. The rank
    keeps the segments mapped while this object lives."""

    def __init__(self, segments: int = 8) -> None:
        self.token, self.segments = secrets.token_hex(8), segments
        self._receiver: _Receiver | None = _Receiver()
        _RECEIVERS[self.token] = self._receiver
        self._home, self._pool = os.getpid(), None

    def __getstate__(self) -> dict[str, Any]:
        return {"token": self.token, "segments": self.segments}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.token, self.segments = state["token"], state["segments"]
        self._receiver, self._home, self._pool = None, None, None

    def pack(self, obj: Any) -> Flat:
        """`obj` flattened for the trip to the rank (`Flat.pack`), into this worker's segments."""
        if os.getpid() == self._home:  # no trip
            return Flat.pack(obj)
        if self._pool is None or self._pool.pid != os.getpid():  # the first batch of this worker
            self._pool = _Pool(self.token, self.segments)
        return Flat.pack(obj, self._pool)


class _Claim:
    """A batch's place in a worker's pool: `buffer` (a view of segment `index`) and what crosses
    with it the first time (`segment`: the segment, new or grown; `flags`: the pool's free flags)."""

    def __init__(self, pool: tuple[str, str], index: int, buffer: torch.Tensor, segment: torch.Tensor | None,
                 flags: torch.Tensor | None) -> None:
        self.pool, self.index, self.buffer, self.segment, self.flags = pool, index, buffer, segment, flags


class _Pool:
    """A worker's segments, and one shared byte per segment: 1 when the rank has freed it."""

    def __init__(self, token: str, limit: int) -> None:
        self.pid = os.getpid()
        self.key = (token, f"{self.pid}-{secrets.token_hex(4)}")
        self.flags = torch.zeros(limit, dtype=torch.uint8).share_memory_()
        self.segments: list[torch.Tensor] = []
        self._flags_sent = False

    def claim(self, nbytes: int) -> _Claim | None:
        """The smallest free segment of at least `nbytes` (a free one grown, or a new one, when
        none fits); None when the rank holds every segment."""
        free = self.flags.tolist()
        fits = [i for i, s in enumerate(self.segments) if free[i] and s.numel() >= nbytes]
        index, segment = min(fits, key=lambda i: self.segments[i].numel()) if fits else None, None
        if index is None:
            index = next((i for i, s in enumerate(self.segments) if free[i]), len(self.segments))
            if index == len(free):
                return None
            # a quarter to spare, so that batches a little larger than the last reuse it
            segment = torch.empty(max(1, -(-nbytes * 5 // 4 // 4096)) * 4096, dtype=torch.uint8).share_memory_()
            self.segments[index:index + 1] = [segment]
        self.flags[index] = 0
        flags, self._flags_sent = (None if self._flags_sent else self.flags), True
        return _Claim(self.key, index, self.segments[index][:nbytes], segment, flags)


class _Receiver:
    """The rank's side of a `Handover`: every worker pool's segments, mapped once each."""

    def __init__(self) -> None:
        self.pools: dict[str, tuple[torch.Tensor, dict[int, torch.Tensor]]] = {}

    def flat(self, pool: str, index: int, segment: torch.Tensor | None, flags: torch.Tensor | None, nbytes: int,
             skeleton: bytes, layout: list[tuple[int, torch.dtype, tuple[int, ...]]]) -> Flat:
        if flags is not None:  # a worker's first batch
            self.pools[pool] = (flags, {})
        flags, segments = self.pools[pool]
        if segment is not None:
            segments[index] = segment
        # The buffer's storage owns `view`: freeing the batch's last tensor frees the segment.
        view = segments[index][:nbytes].numpy()
        weakref.finalize(view, _free, flags, index, os.getpid()).atexit = False
        return Flat(torch.from_numpy(view), skeleton, layout)


_RECEIVERS: weakref.WeakValueDictionary[str, _Receiver] = weakref.WeakValueDictionary()


def _free(flags: torch.Tensor, index: int, rank: int) -> None:
    if os.getpid() == rank:  # not in a process forked from the rank, which shares the flags but not its batches
        flags[index] = 1


def _received(pool: tuple[str, str], index: int, segment: torch.Tensor | None, flags: torch.Tensor | None,
              nbytes: int, skeleton: bytes, layout: list[tuple[int, torch.dtype, tuple[int, ...]]]) -> Flat:
    """A worker's batch on the rank (`Flat.__reduce__` with a claim)."""
    receiver = _RECEIVERS.get(pool[0])
    if receiver is None:
        raise RuntimeError("a loader worker's batch reached a process without its Handover (the loader's "
                           "dataset was freed, or the batch was pickled to another process): a batch packed by "
                           "Handover.pack is read by the process that made the Handover")
    return receiver.flat(pool[1], index, segment, flags, nbytes, skeleton, layout)
