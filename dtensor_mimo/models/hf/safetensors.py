"""Reading and writing Hugging Face checkpoint files (safetensors), slice by slice.

The format is an 8-byte little-endian header length, a JSON header (per tensor: dtype, shape,
byte offsets) and the raw little-endian data. Files are memory-mapped, so reading rows of a
tensor touches only the pages of those rows: a rank that owns a shard reads its shard, not the
checkpoint. A directory holds ``model.safetensors`` or several files listed by
``model.safetensors.index.json`` (read only without a ``model.safetensors``, as transformers
does). Files are written as a stream (`SafetensorsWriter`): the header from names, dtypes and
shapes alone, then one tensor's bytes at a time.
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import struct
from typing import Mapping, Sequence

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
FLOATS = ("F64", "F32", "F16", "BF16")
"""The dtypes of weights that are their values (not quantized codes that need scales)."""
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


class SafetensorsDir:
    """The tensors of a checkpoint directory, read lazily by name and row range."""

    def __init__(self, path: str) -> None:
        self.path = path
        # transformers' order: model.safetensors before an index (its save_pretrained rewriting a
        # sharded directory as one file leaves the index behind, its shards removed)
        if os.path.exists(os.path.join(path, SINGLE)):
            files = [SINGLE]
        elif os.path.exists(os.path.join(path, INDEX)):
            with open(os.path.join(path, INDEX)) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            raise FileNotFoundError(f"{path}: no {SINGLE} or {INDEX}; point at a Hugging Face model directory")
        self._entries: dict[str, tuple[mmap.mmap, int, dict]] = {}
        for name in files:
            with open(os.path.join(path, name), "rb") as f:
                size = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(size))
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # writable view, no copy
            header.pop("__metadata__", None)
            end = 8 + size + max((entry["data_offsets"][1] for entry in header.values()), default=0)
            if len(data) < end:  # every rank opens every file: all refuse it alike, before any read
                raise ValueError(f"{os.path.join(path, name)}: truncated: its header places tensors up to byte "
                                 f"{end}, the file has {len(data)} (an interrupted download or copy?); fetch it again")
            for key, entry in header.items():
                self._entries[key] = (data, 8 + size, entry)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name][2]["shape"])

    def dtype_name(self, name: str) -> str:
        """The safetensors dtype of tensor `name` as its header spells it ("BF16", "F8_E4M3", ...)."""
        return self._entries[name][2]["dtype"]

    def read(self, name: str, rows: slice | None = None, box: Sequence[slice] = ()) -> torch.Tensor:
        """Tensor `name` (rows `rows` of dim 0 only, if given; of those, the slices `box` of
        dims 1, 2, ..., if given) as a fresh tensor holding that block alone: a rank holding some
        columns of a tensor (a row-parallel weight's ``Shard(1)``) never materializes the others."""
        data, start, entry = self._entries[name]
        dtype, shape = DTYPES[entry["dtype"]], entry["shape"]
        begin = entry["data_offsets"][0]
        if not shape:
            return torch.frombuffer(data, dtype=dtype, count=1, offset=start + begin).reshape(()).clone()
        first, last = (0, shape[0]) if rows is None else rows.indices(shape[0])[:2]
        row = math.prod(shape[1:])
        count = (last - first) * row
        if count == 0:
            return torch.empty(0, *shape[1:], dtype=dtype)[(slice(None), *box)]
        offset = start + begin + first * row * torch.empty((), dtype=dtype).element_size()
        view = torch.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(-1, *shape[1:])
        return view[(slice(None), *box)].clone()  # the mapped pages, copied for the block only


class SafetensorsWriter:
    """One safetensors file written as a stream: the header first, from each tensor's name, dtype
    and shape (known without the data, e.g. from a DTensor's metadata), then the tensors' bytes in
    header order, one `write` at a time, so a caller holds one tensor at a time.

    Use as a context manager; leaving it before every tensor was written raises (and a partial
    file is left behind, named by the error).
    """

    def __init__(self, path: str, specs: Sequence[tuple[str, torch.dtype, Sequence[int]]],
                 metadata: Mapping[str, str] | None = None) -> None:
        self.path = path
        self._specs = [(name, dtype, tuple(shape)) for name, dtype, shape in specs]
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        for name, dtype, shape in self._specs:
            if dtype not in NAMES:
                raise ValueError(f"{path}: tensor {name!r} has dtype {dtype}, which safetensors cannot store "
                                 f"(one of {sorted(str(d) for d in NAMES)})")
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        self._header = json.dumps(header, separators=(",", ":")).encode()
        self._header += b" " * (-len(self._header) % 8)
        self._next = 0
        self._file = None

    def __enter__(self) -> SafetensorsWriter:
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(self._header)))
        self._file.write(self._header)
        return self

    def write(self, tensor: torch.Tensor) -> None:
        """The data of the next tensor of the header (its dtype and shape must match)."""
        if self._next >= len(self._specs):
            raise ValueError(f"{self.path}: all {len(self._specs)} tensors are written; no room for another")
        name, dtype, shape = self._specs[self._next]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{self.path}: tensor {name!r} was declared {dtype} {list(shape)}, "
                             f"got {tensor.dtype} {list(tensor.shape)}")
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        if flat.numel():
            self._file.write(ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size()))
        self._next += 1

    def __exit__(self, kind, error, traceback) -> None:
        self._file.close()
        if error is None and self._next != len(self._specs):
            missing = [name for name, _, _ in self._specs[self._next:]]
            raise ValueError(f"{self.path}: closed with {len(missing)} tensors unwritten ({missing[:3]} ...)")

