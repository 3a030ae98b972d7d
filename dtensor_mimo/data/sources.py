"""Where conversation samples come from, read by index, lazily, in whichever process asks.

Three formats hold the same LLaVA-style samples (``conversations``, ``id``, ``image`` / ``audio``):

- ``"llava"``: JSON / JSONL files. A JSONL file is indexed on first use by one scan of its bytes
  for line starts (16 bytes a sample, no JSON parsed); sample i is then one read and one
  ``json.loads``. A JSON list has no lines to index and is parsed whole (use JSONL when large).
- ``"webdataset"``: uncompressed tar shards; the members sharing a key (``KEY.json``,
  ``KEY.png``, ...) are one sample, its ``.json`` the LLaVA sample, whose ``image`` / ``audio``
  values name members of the same sample (``"png"`` or ``"KEY.png"``). A shard's member offsets
  are indexed on first use (its tar headers only, memory-mapped, into arrays: a million samples
  of 1.75 members took 11 s and 63 MiB on a 2-core CPU, against 49 s and 550 MiB through
  `tarfile`'s objects); a member is then one read at its offset. (The `webdataset` package
  streams shards in order, which gives no sample by index and so no exact resume.)
- ``"hf"``: a Hugging Face `datasets` directory written by ``save_to_disk`` (memory-mapped by
  ``datasets.load_from_disk``), or Parquet / Arrow files (pyarrow), with the samples' keys as
  columns; media as paths or bytes (an ``Image()`` column's ``{"bytes", "path"}``). Arrow is
  memory-mapped; Parquet is compressed by row group, so a sample costs decoding its row group
  (each open file's last one kept): for shuffled reads write small row groups or save_to_disk instead.

Several files (a list, or a glob) are one sequence, in the order given (a glob's sorted).
Media are named by references: a file's path, or ``SHARD[MEMBER]`` / ``FILE[row R COLUMN K]``
for bytes inside a shard or a table; `SampleSource.open` gives what Pillow and `wave` read.
Sources pickle without their open handles (loader workers reopen them); a process holds at
most `OPEN_FILES` of a source's files open, the least recently read closed past it.
"""

from __future__ import annotations

import bisect
import copy
import glob
import importlib.util
import io
import json
import mmap
import os
import re
import tarfile
import threading
from typing import Any, BinaryIO, Callable, Mapping, Sequence

import numpy as np

from dtensor_mimo.data.conversation import DataError, MediaError, item_paths
from dtensor_mimo.layout.world import warn_once

__all__ = ["FORMATS", "SampleSource", "JsonSource", "TarSource", "ArrowSource", "MediaBytes", "expand_paths",
           "open_source"]

FORMATS = ("llava", "webdataset", "hf")
LARGE_JSON_LIST = 100_000
"""Samples of a JSON list above which reading it warns (JSONL is indexed, not parsed whole)."""
BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark, which Windows tools put before a file's JSON
OPEN_FILES = 64
"""Files a source holds open at once in a process (a JSONL file's or shard's descriptor, a Parquet
file and its last decoded row group, an Arrow file's map): past it the least recently read is
closed. (Kept open for the source's life, a corpus of thousands of shards read in shuffled order
ran out of the process's open files, often 1024, mid-epoch, and held a row group for each file.)"""


def expand_paths(path: str | Sequence[str], key: str) -> list[str]:
    """`path` (a file, a list of files, a glob) as the files it names, globs sorted. DataError
    names `key`, what was written, and the pattern that matched nothing or the missing file."""
    patterns = [path] if isinstance(path, str) else list(path)
    if not patterns:
        raise DataError(f"{key} = []: give a file, a list of files or a glob such as 'data/train-*.jsonl'")
    files: list[str] = []
    for pattern in patterns:
        if any(c in pattern for c in "*?[") and not os.path.exists(pattern):  # else a file whose name has them
            found = sorted(glob.glob(pattern, recursive=True))
            if not found:
                raise DataError(f"{key} = {path!r}: {pattern!r} matches no file (relative to {os.getcwd()}); "
                                "fix the pattern or the directory you run from")
            files += found
        elif not os.path.exists(pattern):
            raise DataError(f"{key} = {path!r}: {pattern} does not exist (relative to {os.getcwd()})")
        else:
            files.append(pattern)
    return files


class MediaBytes(io.BytesIO):
    """A media item's bytes (a tar member, a table cell), named by its reference in errors."""

    def __init__(self, data: bytes, ref: str) -> None:
        super().__init__(data)
        self.ref = ref

    def __str__(self) -> str:
        return self.ref

    __repr__ = __str__


def _check_sample(sample: Any, where: str) -> dict[str, Any]:
    if not isinstance(sample, dict) or not isinstance(sample.get("conversations"), list):
        raise DataError(f"{where} ({str(sample)[:80]}) has no 'conversations' list")
    return sample


class _OpenFiles:
    """The files one source holds open in this process, least recently used first (at most
    `OPEN_FILES`), and the lock of threads sharing the source (one closes what another reads)."""

    def __init__(self) -> None:
        self.pid, self.lock = os.getpid(), threading.Lock()
        self.handles: dict[int, tuple[Any, Callable[[Any], None]]] = {}

    def get(self, k: int, opener: Callable[[], Any], closer: Callable[[Any], None]) -> Any:
        """File `k`'s handle, opened now if it is not open (the caller holds `lock`)."""
        found = self.handles.pop(k, None)
        handle = opener() if found is None else found[0]
        while len(self.handles) >= OPEN_FILES:
            old = next(iter(self.handles))
            h, close = self.handles.pop(old)
            close(h)
        self.handles[k] = (handle, closer)
        return handle


class SampleSource:
    """A sequence of LLaVA-style samples from files, read by index.

    ``source[i]`` is sample i's dict as written (``id`` set to its index when absent);
    `media` gives a sample's items of one modality as references, `open` a reference as a path
    or a file object, `head` the first samples without indexing the rest of the corpus.
    """

    format = ""

    def __init__(self, files: Sequence[str], root: str, key: str = "data.path",
                 written: str | Sequence[str] | None = None) -> None:
        self.files, self.root, self.key = [os.path.abspath(f) for f in files], os.path.abspath(root), key
        self.written = written if written is not None else (files[0] if len(files) == 1 else list(files))
        self._starts = [0]  # global index of each file indexed so far's first sample, then the next
        self.limit: int | None = None  # `first`: the samples after it are left out

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_h_")}  # handles reopen

    def _open_files(self) -> _OpenFiles:
        """This process's open files of the source (a forked loader worker starts its own)."""
        files = self.__dict__.get("_h_files")
        if files is None or files.pid != os.getpid():
            files = self._h_files = _OpenFiles()
        return files

    def _pread(self, k: int, size: int, offset: int) -> bytes:
        """`size` bytes at `offset` of file `k`."""
        files = self._open_files()
        with files.lock:
            return os.pread(files.get(k, lambda: os.open(self.files[k], os.O_RDONLY), os.close), size, offset)

    def describe(self) -> str:
        """What the user wrote, for messages: ``data.path = 'x-*.jsonl'`` (and the file count)."""
        count = f" ({len(self.files)} files)" if len(self.files) > 1 else ""
        return f"{self.key} = {self.written!r}{count}"

    # -- to implement
    def _count(self, k: int) -> int:
        """Samples in file `k` (indexing it)."""
        raise NotImplementedError

    def _read(self, k: int, j: int) -> dict[str, Any]:
        """Sample `j` of file `k`, as written."""
        raise NotImplementedError

    def _head(self, k: int, n: int) -> list[dict[str, Any]]:
        """Up to `n` first samples of file `k` (default: indexing it)."""
        return [self._read(k, j) for j in range(min(n, self._count(k)))]

    def media(self, index: int, sample: Mapping[str, Any], modality: str) -> list[str]:
        """References of sample `index`'s items of `modality` (default: paths under `root`)."""
        return [os.path.join(self.root, p) for p in item_paths(sample, modality)]

    def open(self, ref: str) -> str | BinaryIO:
        """What Pillow / `wave` read for `ref`: the path itself, or its bytes."""
        return ref

    def exists(self, ref: str) -> bool:
        """Whether `ref` can be opened, checked cheaply (a file's existence)."""
        return os.path.isfile(ref)

    # -- the sequence
    def _files(self) -> dict[str, int]:
        """Each file's index, by path (for media references; a dict built once per process)."""
        where = self.__dict__.get("_h_where")
        if where is None:
            where = self._h_where = {f: k for k, f in enumerate(self.files)}
        return where

    def _bounds(self, upto: int | None = None) -> list[int]:
        """Each file's first global index, then the total, for the files up to the one holding
        sample `upto` (None: every file); each file is indexed once, when first needed."""
        starts = self._starts
        while len(starts) <= len(self.files) and (upto is None or upto >= starts[-1]):
            starts.append(starts[-1] + self._count(len(starts) - 1))
        return starts

    def _locate(self, index: int) -> tuple[int, int]:
        """(file, index in the file) of global sample `index`."""
        starts = self._bounds(index)
        if not 0 <= index < starts[-1] or (self.limit is not None and index >= self.limit):
            raise IndexError(f"{self.describe()}: sample {index} of {starts[-1]}")
        k = bisect.bisect_right(starts, index) - 1
        return k, index - starts[k]

    def __len__(self) -> int:
        if self.limit is not None:
            return min(self.limit, self._bounds(self.limit - 1)[-1])
        return self._bounds()[-1]

    def first(self, n: int) -> SampleSource:
        """The first `n` samples (all if fewer), sharing this source's indexes."""
        view = copy.copy(self)  # (without the handles: `__getstate__`)
        view._h_files = self._open_files()  # one set of open files for both
        view.limit = n if self.limit is None else min(n, self.limit)
        return view

    def __getitem__(self, index: int) -> dict[str, Any]:
        k, j = self._locate(index)
        sample = self._read(k, j)
        sample.setdefault("id", str(index))
        return sample

    def head(self, n: int) -> list[dict[str, Any]]:
        """The first `n` samples (all if fewer), reading only the files they are in."""
        out: list[dict[str, Any]] = []
        for k in range(len(self.files)):
            if len(out) >= n:
                break
            for sample in self._head(k, n - len(out)):
                sample.setdefault("id", str(len(out)))
                out.append(sample)
        return out


# ---------------------------------------------------------------------------- llava: JSON / JSONL

_SCAN = 1 << 24  # bytes per numpy pass when finding line starts


class JsonSource(SampleSource):
    """LLaVA JSON lists and JSONL files (see the module docstring); ``samples``: already in memory."""

    format = "llava"

    def __init__(self, files: Sequence[str], root: str, key: str = "data.path",
                 written: str | Sequence[str] | None = None, samples: list[dict[str, Any]] | None = None) -> None:
        super().__init__(files, root, key, written)
        self._lines: dict[int, np.ndarray | list[dict[str, Any]]] = {}  # per file: line bounds, or its samples
        if samples is not None:
            self._lines[0] = samples

    def _index(self, k: int) -> np.ndarray | list[dict[str, Any]]:
        if k not in self._lines:
            self._lines[k] = self._scan(self.files[k])
        return self._lines[k]

    def _scan(self, path: str) -> np.ndarray | list[dict[str, Any]]:
        """``[2, n]`` int64 starts and ends of the non-blank lines of a JSONL file; a JSON list's samples."""
        if not os.path.isfile(path):
            raise DataError(f"{self.describe()}: {path}: no such data file")
        size = os.path.getsize(path)
        if size == 0:
            return np.zeros((2, 0), dtype=np.int64)
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            start = mm[:4096].removeprefix(BOM).lstrip()
            if start.startswith(b"["):
                try:
                    samples = json.loads(mm[:].decode("utf-8-sig"))
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise DataError(f"{path}: not valid JSON: {e}") from None
                if not isinstance(samples, list):
                    raise DataError(f"{path}: a JSON file holds a list of samples")
                if len(samples) > LARGE_JSON_LIST:
                    warn_once(f"{self.describe()}: {path} is a JSON list of {len(samples):,} samples, parsed "
                              f"whole into Python objects in every rank and loader worker (about 1 GiB a "
                              f"million); write it as JSONL (one sample a line), which is indexed instead",
                              stacklevel=2)
                return samples
            data = np.frombuffer(mm, dtype=np.uint8)
            newlines = [np.flatnonzero(data[s:s + _SCAN] == 10) + s for s in range(0, size, _SCAN)]
            ends = np.concatenate(newlines + [np.array([size], dtype=np.int64)]).astype(np.int64)
            first = len(BOM) if mm[:len(BOM)] == BOM else 0  # the first line starts after a BOM
            starts = np.concatenate([[first], ends[:-1] + 1]).astype(np.int64)
            keep = ends > starts
            # a line starting with whitespace may be blank (skipped, as a JSONL reader does)
            for i in np.flatnonzero(keep & (data[np.minimum(starts, size - 1)] <= 32)):
                keep[i] = bool(mm[starts[i]:ends[i]].strip())
            del data
        return np.stack([starts[keep], ends[keep]])

    def _count(self, k: int) -> int:
        lines = self._index(k)
        return len(lines) if isinstance(lines, list) else lines.shape[1]

    def _parse(self, k: int, j: int, raw: bytes, start: int) -> dict[str, Any]:
        try:
            sample = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{self.files[k]}: the line at byte {start} (sample {j} of the file): "
                            f"not valid JSON: {e}") from None
        return _check_sample(sample, f"{self.files[k]}: sample {j}")

    def _read(self, k: int, j: int) -> dict[str, Any]:
        lines = self._index(k)
        if isinstance(lines, list):
            return dict(_check_sample(lines[j], f"{self.files[k]}: sample {j}"))
        start, end = int(lines[0, j]), int(lines[1, j])
        return self._parse(k, j, self._pread(k, end - start, start), start)

    def _head(self, k: int, n: int) -> list[dict[str, Any]]:
        if k in self._lines:
            return super()._head(k, n)
        path = self.files[k]
        if not os.path.isfile(path):
            raise DataError(f"{self.describe()}: {path}: no such data file")
        with open(path, "rb") as f:
            start = f.read(4096).removeprefix(BOM).lstrip()
            if start.startswith(b"["):
                return super()._head(k, n)  # a JSON list: parsed whole
            f.seek(0)
            out, offset = [], 0
            for line in f:
                text = line.removeprefix(BOM) if offset == 0 else line
                if text.strip():
                    out.append(self._parse(k, len(out), text, offset + len(line) - len(text)))
                    if len(out) >= n:
                        break
                offset += len(line)
        return out


# ---------------------------------------------------------------------------- webdataset: tar shards


def _split_member(name: str) -> tuple[str, str] | None:
    """WebDataset's rule: the key is the path up to the first dot of the base name."""
    directory, _, base = name.rpartition("/")
    stem, dot, suffix = base.partition(".")
    if not dot or not stem:
        return None
    return (f"{directory}/{stem}" if directory else stem), suffix


_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_EXTENDED = (b"L", b"K", b"x", b"g")  # headers describing the next member, not members


def _tar_members(path: str) -> list[tuple[str, int, int]]:
    """(name, data offset, size) of each regular file of an uncompressed tar, from its headers
    alone (memory-mapped: no syscall per member; a few µs a member where `tarfile` takes about
    15): ustar and GNU headers, GNU long names and pax ``path`` / ``size`` records. A header
    whose checksum does not match (a compressed file, say), a file that ends inside a header or
    a member, a malformed pax record or a sparse member raises `tarfile.ReadError`."""
    members, pending = [], {}
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return members
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            pos, end = 0, len(m)
            while pos < end:
                header = m[pos:pos + _BLOCK]
                if len(header) < _BLOCK:
                    raise tarfile.ReadError(f"it ends inside the header at byte {pos}")
                if header == _ZERO_BLOCK:
                    break
                if sum(header) - sum(header[148:156]) + 8 * 32 != _number(header[148:156], pos):
                    raise tarfile.ReadError(f"bad checksum in the header at byte {pos}")
                kind, size = header[156:157], _number(header[124:136], pos)
                if kind not in _EXTENDED:  # a pax size applies to the member, not to another extension
                    size = pending.pop("size", size)
                data = pos + _BLOCK
                if data + size > end:
                    raise tarfile.ReadError(f"it ends inside the member at byte {data}")
                if kind in _EXTENDED:  # a long name / pax records for the next member
                    body = m[data:data + size]
                    if kind == b"L":
                        pending["path"] = body.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                    elif kind == b"x":
                        pending.update(_pax(body))
                    # (K, a GNU long link name, and g, global pax records, change no member's name)
                elif kind == b"S" or "sparse" in pending:
                    raise tarfile.ReadError(f"the member at byte {pos} is a GNU sparse file, which is not read "
                                            "by seeking; write the shard without --sparse")
                elif kind in (b"0", b"\0", b"7"):  # a regular file
                    name = pending.pop("path", None)
                    if name is None:  # ustar's prefix, as `tarfile` reads it
                        name = header[:100].split(b"\0", 1)[0]
                        if header[345] != 0:
                            name = header[345:500].split(b"\0", 1)[0] + b"/" + name
                        name = name.decode("utf-8", "surrogateescape")
                    members.append((name, data, size))
                    pending.clear()
                else:
                    pending.clear()
                pos = data + -(-size // _BLOCK) * _BLOCK
    return members


def _number(field: bytes, pos: int) -> int:
    """A tar header's numeric field: octal digits, or GNU's base-256 (first byte 0x80)."""
    if field[0] & 0x80:
        return int.from_bytes(field[1:], "big")
    digits = field.split(b"\0", 1)[0].strip()
    try:
        return int(digits, 8) if digits else 0
    except ValueError:
        raise tarfile.ReadError(f"the header at byte {pos} is not a tar header") from None


def _pax(body: bytes) -> dict[str, Any]:
    """The ``path`` and ``size`` of pax extended-header records (``LEN key=value\\n``)."""
    out: dict[str, Any] = {}
    pos = 0
    while pos < len(body) and body[pos] != 0:
        space = body.find(b" ", pos)
        length = int(body[pos:space]) if space > pos and body[pos:space].isdigit() else 0
        if length < 5 or pos + length > len(body) or body[pos + length - 1] != 10:
            raise tarfile.ReadError(f"a malformed pax record at byte {pos} of an extended header")
        key, _, value = body[space + 1:pos + length - 1].partition(b"=")
        if key == b"path":
            out["path"] = value.decode("utf-8", "surrogateescape")
        elif key == b"size":
            out["size"] = int(value)
        elif key.startswith(b"GNU.sparse."):
            out["sparse"] = True
        pos += length
    return out


class _TarIndex:
    """One shard's samples in arrays, not Python objects (18 bytes a member, 12 and the shard's
    longest key's length a sample, against 570 bytes a sample as dicts and tuples; arrays also
    stay shared with forked loader workers, whose reference counts would copy objects' pages):
    each sample's key (in shard order), its members' suffixes, offsets and sizes."""

    def __init__(self, members: dict[str, dict[str, tuple[int, int]]]) -> None:
        self.keys = np.array([k.encode("utf-8", "surrogateescape") for k in members], dtype=bytes)
        self.order = np.argsort(self.keys, kind="stable").astype(np.int32)  # for `find`
        self.suffixes = sorted({suffix for found in members.values() for suffix in found})
        code = {suffix: i for i, suffix in enumerate(self.suffixes)}
        rows = [(code[suffix], offset, size) for found in members.values()
                for suffix, (offset, size) in found.items()]
        self.first = np.cumsum([0] + [len(found) for found in members.values()], dtype=np.int64)
        self.suffix = np.array([r[0] for r in rows], dtype=np.int16)
        self.offset = np.array([r[1] for r in rows], dtype=np.int64)
        self.size = np.array([r[2] for r in rows], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.keys)

    def key(self, j: int) -> str:
        return self.keys[j].decode("utf-8", "surrogateescape")

    def members(self, j: int) -> dict[str, tuple[int, int]]:
        """Sample `j`'s ``{suffix: (offset, size)}``."""
        rows = range(int(self.first[j]), int(self.first[j + 1]))
        return {self.suffixes[self.suffix[r]]: (int(self.offset[r]), int(self.size[r])) for r in rows}

    def find(self, key: str) -> int:
        """The sample of `key` (a binary search: no dict of every key)."""
        wanted = key.encode("utf-8", "surrogateescape")
        i = int(np.searchsorted(self.keys, wanted, sorter=self.order))
        if i == len(self.keys) or self.keys[self.order[i]] != wanted:
            raise KeyError(key)
        return int(self.order[i])


class TarSource(SampleSource):
    """WebDataset tar shards (see the module docstring): each shard's index is built when a
    sample of it is first wanted (`head`: the first shards only)."""

    format = "webdataset"

    def __init__(self, files: Sequence[str], root: str, key: str = "data.path",
                 written: str | Sequence[str] | None = None) -> None:
        super().__init__(files, root, key, written)
        self._shards: dict[int, _TarIndex] = {}

    def _index(self, k: int) -> _TarIndex:
        """The shard's samples (`_TarIndex`), from its headers (`_tar_members`)."""
        if k in self._shards:
            return self._shards[k]
        path = self.files[k]
        members: dict[str, dict[str, tuple[int, int]]] = {}
        try:
            for name, offset, size in _tar_members(path):
                split = _split_member(name)
                if split is not None:
                    members.setdefault(split[0], {})[split[1]] = (offset, size)
        except (tarfile.TarError, OSError, ValueError) as e:
            raise DataError(f"{self.describe()}: {path} is not an uncompressed tar file ({e}); webdataset "
                            "shards are read by seeking, so write them uncompressed (tar cf, or "
                            "webdataset.TarWriter on a .tar name)") from None
        for key, found in members.items():
            if "json" not in found:
                raise DataError(f"{self.describe()}: {path}: sample {key!r} has no .json member (it has "
                                f"{', '.join(sorted(key + '.' + s for s in found))}); each sample's conversation "
                                f"goes in {key}.json beside its media (see data.format = 'webdataset')")
        self._shards[k] = _TarIndex(members)
        return self._shards[k]

    def _count(self, k: int) -> int:
        return len(self._index(k))

    def _bytes(self, k: int, offset: int, size: int) -> bytes:
        return self._pread(k, size, offset)

    def _read(self, k: int, j: int) -> dict[str, Any]:
        index = self._index(k)
        key = index.key(j)
        where = f"{self.files[k]}[{key}.json]"
        try:
            sample = json.loads(self._bytes(k, *index.members(j)["json"]))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{where}: not valid JSON: {e}") from None
        sample = _check_sample(sample, where)
        sample.setdefault("id", key)
        return sample

    def media(self, index: int, sample: Mapping[str, Any], modality: str) -> list[str]:
        k, j = self._locate(index)
        shard = self._index(k)
        key, found = shard.key(j), shard.members(j)
        refs = []
        for value in item_paths(sample, modality):
            suffix = value if value in found else value[len(key) + 1:] if value.startswith(key + ".") else None
            if suffix not in found:  # this sample's media (a file missing from a corpus): skip_bad_media applies
                reason = (f"its {modality} {value!r} is no member of the sample (it has "
                          f"{', '.join(sorted(key + '.' + s for s in found))}); name a member as 'png' or '{key}.png'")
                raise MediaError(f"{self.files[k]}: sample {sample.get('id', key)!r}: {reason}",
                                 sample_id=str(sample.get("id", key)), path=f"{self.files[k]}[{value}]", reason=reason)
            refs.append(f"{self.files[k]}[{key}.{suffix}]")
        return refs

    def open(self, ref: str) -> BinaryIO:
        # `media` wrote "{file}[{key}.{suffix}]": file names and keys may both hold brackets, so the
        # file is the first prefix before a "[" that is one of the shards
        files = self._files()
        cut = next(i for i, c in enumerate(ref) if c == "[" and ref[:i] in files)
        k = files[ref[:cut]]
        shard = self._index(k)
        key, suffix = _split_member(ref[cut + 1:-1])
        return MediaBytes(self._bytes(k, *shard.members(shard.find(key))[suffix]), ref)

    def exists(self, ref: str) -> bool:
        return True  # `media` found it in the shard's index


# ---------------------------------------------------------------------------- hf: datasets / Parquet / Arrow


class _Table:
    """One file or directory of rows: its row count and row j as a dict (pyarrow / datasets)."""

    def __init__(self, path: str, describe: str) -> None:
        self.path, self.describe = path, describe
        self.columns, self.rows = self._open()

    def _open(self) -> tuple[list[str], int]:
        if importlib.util.find_spec("pyarrow") is None:
            raise DataError(f"{self.describe}: data.format = 'hf' needs pyarrow and datasets: "
                            "pip install 'dtensor_mimo[datasets]'")
        h = self.handle()
        if self.kind() == "parquet":
            return list(h.schema_arrow.names), h.metadata.num_rows
        return list(h.column_names), h.num_rows

    def kind(self) -> str:
        if os.path.isdir(self.path):
            return "dir"
        return "parquet" if self.path.endswith(".parquet") else "arrow"

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_h_")}

    def handle(self) -> Any:
        h = self.__dict__.get("_h_table")
        if h is not None:
            return h
        kind = self.kind()
        try:
            if kind == "dir":
                import datasets

                if os.path.isfile(os.path.join(self.path, "dataset_dict.json")):
                    splits = sorted(e for e in os.listdir(self.path) if os.path.isdir(os.path.join(self.path, e)))
                    raise DataError(f"{self.describe}: {self.path} holds the splits {splits}; give one, e.g. "
                                    f"{os.path.join(self.path, splits[0] if splits else 'train')!r}")
                h = datasets.load_from_disk(self.path).with_format("arrow")
            elif kind == "parquet":
                import pyarrow.parquet as pq

                h = pq.ParquetFile(self.path)
            else:
                import pyarrow as pa

                source = pa.memory_map(self.path)
                try:
                    h = pa.ipc.open_file(source).read_all()
                except pa.ArrowInvalid:
                    h = pa.ipc.open_stream(pa.memory_map(self.path)).read_all()  # datasets' own files
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - pyarrow / datasets raise many kinds; named here
            raise DataError(f"{self.describe}: {self.path}: not a save_to_disk directory, Parquet or Arrow file "
                            f"({type(e).__name__}: {e})") from None
        self._h_table = h
        return h

    def release(self) -> None:
        """Close the file and drop its decoded row group (`handle` opens it again when wanted)."""
        self.__dict__.pop("_h_group", None)
        close = getattr(self.__dict__.pop("_h_table", None), "close", None)  # a ParquetFile's
        if close is not None:
            close()

    def row(self, j: int) -> dict[str, Any]:
        """Row `j` as a dict; DataError naming the file and the row where pyarrow cannot read it."""
        h = self.handle()
        try:
            return self._row(h, j)
        except Exception as e:  # noqa: BLE001 - pyarrow's (OSError, ArrowInvalid, ...) name neither file nor row
            raise DataError(f"{self.describe}: {self.path}: row {j} cannot be read ({type(e).__name__}: {e}); "
                            "the file is damaged: write it again, or leave it out of the path") from None

    def _row(self, h: Any, j: int) -> dict[str, Any]:
        if self.kind() == "dir":
            return h[j].to_pylist()[0]
        if self.kind() == "parquet":  # one row group at a time, the last one kept
            group, start = self.__dict__.get("_h_group", (None, -1))
            if not (group is not None and start <= j < start + group.num_rows):
                starts = self.__dict__.get("_h_starts")
                if starts is None:  # each row group's first row, read from the metadata once
                    meta = h.metadata
                    starts = self._h_starts = np.cumsum([0] + [meta.row_group(g).num_rows
                                                               for g in range(meta.num_row_groups)])
                g = int(np.searchsorted(starts, j, side="right")) - 1
                group, start = h.read_row_group(g), int(starts[g])
                self._h_group = (group, start)
            return group.slice(j - start, 1).to_pylist()[0]
        return h.slice(j, 1).to_pylist()[0]


class ArrowSource(SampleSource):
    """Hugging Face `datasets` directories, Parquet and Arrow files (see the module docstring)."""

    format = "hf"

    def __init__(self, files: Sequence[str], root: str, key: str = "data.path",
                 written: str | Sequence[str] | None = None) -> None:
        super().__init__(files, root, key, written)
        self._tables: dict[int, _Table] = {}

    def _table(self, k: int) -> _Table:
        if k not in self._tables:
            table = _Table(self.files[k], self.describe())  # (opened to count its rows)
            if "conversations" not in table.columns:
                table.release()
                raise DataError(f"{self.describe()}: {self.files[k]} has the columns {table.columns} but no "
                                "'conversations' column (a list of {'from', 'value'} turns); rename yours, "
                                "e.g. dataset.rename_column('messages', 'conversations'), and save it again")
            self._tables[k] = table
            self._row(k)  # among the files held open
        return self._tables[k]

    def _row(self, k: int, j: int | None = None) -> dict[str, Any] | None:
        """Row `j` of file `k` (None: none), the file among the `OPEN_FILES` held open."""
        table, files = self._table(k), self._open_files()
        with files.lock:
            files.get(k, table.handle, lambda _: table.release())
            return None if j is None else table.row(j)

    def _count(self, k: int) -> int:
        return self._table(k).rows

    def _read(self, k: int, j: int) -> dict[str, Any]:
        row = self._row(k, j)
        if row.get("id") is None:
            row.pop("id", None)
        return _check_sample(row, f"{self.files[k]}: row {j}")

    def media(self, index: int, sample: Mapping[str, Any], modality: str) -> list[str]:
        value = sample.get(modality)
        values = [] if value is None else value if isinstance(value, list) else [value]
        refs = []
        for n, v in enumerate(values):
            if isinstance(v, dict):  # datasets' Image() / Audio(): bytes, else a path
                v = v.get("bytes") if v.get("bytes") is not None else v.get("path")
            if isinstance(v, (bytes, bytearray)):
                k, j = self._locate(index)
                refs.append(f"{self.files[k]}[row {j} {modality} {n}]")
            elif isinstance(v, str):
                refs.append(os.path.join(self.root, v))
            else:
                raise DataError(f"{self.describe()}: sample {sample.get('id', index)!r}: its {modality} column holds "
                                f"{type(v).__name__}; give paths (strings) or bytes")
        return refs

    def open(self, ref: str) -> str | BinaryIO:
        match = re.fullmatch(r"(.*)\[row (\d+) (\w+) (\d+)\]", ref)
        if match is None or match.group(1) not in self._files():
            return ref
        path, j, modality, n = match.group(1), int(match.group(2)), match.group(3), int(match.group(4))
        value = self._row(self._files()[path], j)[modality]
        value = value[n] if isinstance(value, list) else value
        return MediaBytes(value["bytes"] if isinstance(value, dict) else value, ref)

    def exists(self, ref: str) -> bool:
        return re.fullmatch(r".*\[row \d+ \w+ \d+\]", ref) is not None or os.path.isfile(ref)


def open_source(format: str, path: str | Sequence[str], root: str | None, key: str = "data.path") -> SampleSource:
    """The source of `format` for `path` (a file, list of files or glob); media under `root`
    (default: the first file's directory). Nothing is indexed yet. DataError names `key`."""
    files = expand_paths(path, key)
    # the directory holding the first file (a dataset directory's parent, a trailing '/' or not)
    base = root if root is not None else os.path.dirname(os.path.abspath(files[0]))
    cls = {"llava": JsonSource, "webdataset": TarSource, "hf": ArrowSource}[format]
    return cls(files, base, key, path)
