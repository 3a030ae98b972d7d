"""One buffer per batch between processes: what a DataLoader worker hands its rank.

A worker's result crosses to the rank by pickling, and every tensor in it becomes its own shared
memory segment (a file descriptor sent over a socket, then mapped): a batch of tokens, labels,
masks, positions and media inputs costs several of those per step, about 2 ms on a small VM.
`Flat.pack` copies the batch's contiguous tensors into one byte buffer and pickles the rest with
references to it, so one segment crosses; `unpack` gives the same structure back, each tensor a
view of that buffer (same dtype, shape and values). Tensors that are not contiguous (e.g. the
stride-0 zeros standing for media a rank does not load) keep their ordinary pickling.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

__all__ = ["Flat"]

_ALIGN = 64  # every tensor starts at a multiple of this many bytes: any dtype's view is aligned


class Flat:
    """`obj` (any picklable structure of tensors) as one uint8 buffer plus the pickle of the rest.

    ``Flat.pack(obj).unpack()`` equals `obj`; `pin_memory` pins the one buffer (the DataLoader calls
    it on the rank's side with ``pin_memory=True``)."""

    def __init__(self, buffer: torch.Tensor, skeleton: bytes, layout: list[tuple[int, torch.dtype, tuple[int, ...]]]):
        self.buffer, self.skeleton, self.layout = buffer, skeleton, layout

    @classmethod
    def pack(cls, obj: Any) -> Flat:
        tensors: list[torch.Tensor] = []

        class _Pickler(pickle.Pickler):
            def persistent_id(self, o: Any) -> int | None:
                if type(o) is torch.Tensor and o.device.type == "cpu" and not o.requires_grad and o.is_contiguous():
                    tensors.append(o)
                    return len(tensors) - 1
                return None

        out = io.BytesIO()
        _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        layout, end = [], 0
        for t in tensors:
            layout.append((end, t.dtype, tuple(t.shape)))
            end += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        buffer = torch.empty(end, dtype=torch.uint8)
        for (start, _, _), t in zip(layout, tensors):
            n = t.numel() * t.element_size()
            buffer[start:start + n].copy_(t.reshape(-1).view(torch.uint8))
        return cls(buffer, out.getvalue(), layout)

    def unpack(self) -> Any:
        buffer = self.buffer
        views = []
        for start, dtype, shape in self.layout:
            n = torch.Size(shape).numel() * dtype.itemsize
            views.append(buffer[start:start + n].view(dtype).view(shape))

        class _Unpickler(pickle.Unpickler):
            def persistent_load(self, pid: int) -> torch.Tensor:
                return views[pid]

        return _Unpickler(io.BytesIO(self.skeleton)).load()

    def pin_memory(self) -> Flat:
        return Flat(self.buffer.pin_memory(), self.skeleton, self.layout)
