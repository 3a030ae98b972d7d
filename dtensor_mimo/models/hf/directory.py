"""Writing one Hugging Face checkpoint directory from modules that may be spread over ranks.

A directory is a list of `Part`s, each one module's tensors (a LLaVA directory has three: the
vision tower, the projector, the language model), each cut into groups, one per pipeline stage of
that module (one group when the module is whole). Which tensor goes to which file, every file's
header and the index follow from the parts alone, and parts are built from the modules' configs
(`dtensor_mimo.models.hf.export`), so every rank computes the same plan without asking another
rank anything. Then:

- the ranks that hold a group gather its parameters one at a time to the group's writer (each
  sends its shard of a DTensor to the rank `Holder.gather_to` names, among the holders of that
  group, never the world), and the writer streams each into its file and drops it, so only a
  writer holds a whole tensor, and one at a time;
- a file never mixes groups, so each file has exactly one writer;
- one rank (the caller says which) writes ``config.json`` and the index.

Every rank that holds a group must call `write_directory` with the same parts: it takes part in
that group's gathers, in the plan's order, which is the same on every rank.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from dtensor_mimo.models.hf.convert import Source
from dtensor_mimo.models.hf.safetensors import INDEX, SINGLE, SafetensorsWriter

DEFAULT_SHARD_BYTES = 5 * 2**30


@dataclass(frozen=True)
class Entry:
    """One checkpoint tensor: `source` names it (and its rotary row order), `shape` is its shape
    in the checkpoint. It is made from the module parameter `param` (its full value; `extra_rows`
    zero rows appended, e.g. a vocabulary extended to hold a placeholder id), or, when `param` is
    None, it is the constant `fill` (a part the module does not have, e.g. a norm LLaVA never
    applies)."""

    source: Source
    shape: tuple[int, ...]
    param: str | None
    extra_rows: int = 0
    fill: float = 0.0

    @property
    def name(self) -> str:
        return self.source.name

    def value(self, full: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """The checkpoint tensor, from the parameter's full value `full`."""
        if self.param is None:
            return torch.full(self.shape, self.fill, dtype=dtype)
        value = self.source.write(full.detach())
        if self.extra_rows:
            value = torch.cat([value, value.new_zeros(self.extra_rows, *value.shape[1:])])
        return value.to(dtype)


@dataclass(frozen=True)
class Part:
    """One module's tensors in a directory. `groups[s]`: the entries of pipeline stage s of the
    module (in file order); `dtype`: what they are written as; `skipped`: parameters the module
    has that the checkpoint does not store (e.g. a key bias softmax ignores); `module`: a name
    for error messages."""

    key: str
    groups: tuple[tuple[Entry, ...], ...]
    dtype: torch.dtype
    module: str
    skipped: frozenset[str] = frozenset()


FIRST = "first"
"""`Holder.gather_to`: each DTensor goes to the first rank of its own mesh."""


@dataclass
class Holder:
    """What this rank holds of a part: its parameters (plain names, DTensors or plain tensors),
    the stages (group indices) they make up, and whether this rank writes those groups' files.

    `gather_to` says where a DTensor parameter is made whole (the same on every rank of its
    mesh): the global rank of the writer of these stages (the other ranks of a mesh holding it
    send it their shards; a mesh without it, e.g. a dp replica of a tp group, sends nothing);
    `FIRST`: the first rank of each parameter's mesh (the writer `first_of_meshes` picks); None:
    every rank (``full_tensor``), for a writer the other ranks cannot name."""

    params: Mapping[str, torch.Tensor]
    stages: list[int]
    writer: bool
    gather_to: int | str | None = None


@dataclass(frozen=True)
class FilePlan:
    """The files of a directory: `files[i]` holds the entries `entries[i]` of group
    ``groups[i] = (part key, stage)``."""

    files: list[str]
    groups: list[tuple[str, int]]
    entries: list[tuple[Entry, ...]]
    dtypes: dict[str, torch.dtype]  # of each part key

    def weight_map(self) -> dict[str, str]:
        return {e.name: file for file, entries in zip(self.files, self.entries) for e in entries}

    def total_size(self) -> int:
        return sum(math.prod(e.shape) * _element_size(self.dtypes[key])
                   for (key, _), entries in zip(self.groups, self.entries) for e in entries)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def plan_files(parts: list[Part], max_shard_bytes: int) -> FilePlan:
    """Cut every group into files of at most `max_shard_bytes` (a tensor larger than that gets a
    file of its own); one file in all is ``model.safetensors``, else ``model-0000i-of-0000n``."""
    groups, entries = [], []
    for part in parts:
        size_of = _element_size(part.dtype)
        for stage, group in enumerate(part.groups):
            current: list[Entry] = []
            size = 0
            for entry in group:
                nbytes = math.prod(entry.shape) * size_of
                if current and size + nbytes > max_shard_bytes:
                    groups.append((part.key, stage))
                    entries.append(tuple(current))
                    current, size = [], 0
                current.append(entry)
                size += nbytes
            if current:
                groups.append((part.key, stage))
                entries.append(tuple(current))
    n = len(entries)
    files = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    return FilePlan(files, groups, entries, {part.key: part.dtype for part in parts})


def check_holder(part: Part, holder: Holder) -> None:
    """Raise, naming the parameters, unless `holder` holds exactly the parameters of its stages."""
    expected = {e.param for s in holder.stages for e in part.groups[s] if e.param is not None}
    held = set(holder.params) - part.skipped
    missing, extra = sorted(expected - held), sorted(held - expected)
    if missing or extra:
        raise ValueError(f"the {part.module} should hold the parameters of its stages {holder.stages} of "
                         f"{len(part.groups)}; missing {missing[:4]}, not in those stages {extra[:4]}")


def full_value(param: torch.Tensor, gather_to: int | str | None = None) -> torch.Tensor | None:
    """The whole parameter on the rank that gathers it (`Holder.gather_to`), None on the others:
    a plain tensor as it is; a DTensor gathered over its mesh (among the ranks of that mesh,
    never the world), by ``full_tensor`` when `gather_to` is None, else each shard sent to the
    gathering rank once (one replica of it), so no other rank makes the whole tensor."""
    if not isinstance(param, DTensor):
        return param
    mesh, local = param.device_mesh, _plain(param.to_local())
    placements = param.placements
    if gather_to is None or local is None or not all(
            isinstance(p, (Replicate, Shard, _StridedShard)) for p in placements):
        return param.full_tensor()
    ranks = mesh.mesh
    target = int(ranks.flatten()[0]) if gather_to == FIRST else gather_to
    found = (ranks == target).nonzero()
    if len(found) == 0:
        return None  # a replica of the writer's mesh: the writer has its own copy
    at = tuple(found[0].tolist())
    me = dist.get_rank()
    # One copy of each shard: the ranks at the target's coordinates on Replicate dims.
    senders = [c for c in itertools.product(*(range(n) for n in ranks.shape))
               if all(c[i] == at[i] for i, p in enumerate(placements) if isinstance(p, Replicate))]
    # One batch of point-to-point operations per tensor on each side (`batch_isend_irecv`): NCCL
    # runs a batch on the default group's communicator, where single sends would each make a
    # communicator of their own for every (writer, sender) pair.
    if me != target:
        if tuple(mesh.get_coordinate()) in senders:
            _wait(dist.batch_isend_irecv([dist.P2POp(dist.isend, local.detach().contiguous(), target)]))
        return None
    full = torch.empty(param.shape, dtype=local.dtype, device=local.device)
    blocks, ops = [], []
    for c in senders:
        where = _indices(param.shape, placements, ranks.shape, c)
        if c == at:
            blocks.append((where, local.detach()))
        else:
            block = torch.empty(tuple(len(w) for w in where), dtype=local.dtype, device=local.device)
            blocks.append((where, block))
            ops.append(dist.P2POp(dist.irecv, block, int(ranks[c])))
    if ops:
        _wait(dist.batch_isend_irecv(ops))
    for where, block in blocks:
        full[_index(where)] = block
    return full


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _plain(local: torch.Tensor) -> torch.Tensor | None:
    """A shard as a plain tensor: itself, or the one inner tensor of its shape and dtype of a
    tensor subclass (torchao's float8 all-gather weight wraps its high-precision shard); None if
    there is none (the same verdict on every rank of the mesh)."""
    if type(local) is torch.Tensor:
        return local
    names = local.__tensor_flatten__()[0] if hasattr(local, "__tensor_flatten__") else []
    inner = [t for t in (getattr(local, n) for n in names)
             if type(t) is torch.Tensor and t.shape == local.shape and t.dtype == local.dtype]
    return inner[0] if len(inner) == 1 else None


def _indices(shape: torch.Size, placements, mesh_shape: torch.Size, coordinate: tuple[int, ...]) -> list[torch.Tensor]:
    """Per dim of a tensor of `shape`, the global indices of the block the rank at `coordinate`
    of a mesh of `mesh_shape` holds under `placements` (DTensor's own split, dim by dim: a shard
    along one dim takes those indices of that dim alone)."""
    where = [torch.arange(n) for n in shape]
    for i, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        one_dim = _StridedShard(0, split_factor=p.split_factor) if isinstance(p, _StridedShard) else Shard(0)
        where[p.dim] = one_dim._select_split_tensor(where[p.dim], mesh_shape[i], coordinate[i], with_padding=False,
                                                    contiguous=False, clone=False)
    return where


def _index(where: list[torch.Tensor]) -> tuple:
    """`where` as an index: slices where each dim's indices run in order, else broadcast index tensors."""
    runs = [len(w) == 0 or bool((w == torch.arange(int(w[0]), int(w[0]) + len(w))).all()) for w in where]
    if all(runs):
        return tuple(slice(int(w[0]), int(w[0]) + len(w)) if len(w) else slice(0, 0) for w in where)
    n = len(where)
    return tuple(w.view(*([1] * d), -1, *([1] * (n - d - 1))) for d, w in enumerate(where))


@torch.no_grad()
def write_directory(path: str, parts: list[Part], holders: Mapping[str, Holder], *,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES, metadata_writer: bool = False,
                    config: Mapping[str, Any] | None = None,
                    extras: Callable[[str], None] | None = None) -> FilePlan:
    """Write this rank's share of the directory `path` (created): the files of the groups it
    holds (`holders`: part key -> `Holder`) when it is their writer, gathering them in any case;
    if `metadata_writer`, also `config` as ``config.json``, the index (several files) and
    `extras(path)` (tokenizer, processors, ...). Returns the file plan (the same on every rank)."""
    plan = plan_files(parts, max_shard_bytes)
    by_key = {part.key: part for part in parts}
    for key, holder in holders.items():
        check_holder(by_key[key], holder)
    # A write that fails (a full disk, a permission) must not skip the gathers: the other members
    # of the tensor's mesh are waiting in them. The first failure stops the writing, the gathers
    # go on, and it is raised once this rank has joined every one of them.
    errors: list[Exception] = []

    def attempt(action: Callable[[], Any]) -> Any:
        if errors:
            return None
        try:
            return action()
        except Exception as caught:  # noqa: BLE001 - raised below, after the gathers
            errors.append(caught)
            return None

    if metadata_writer or any(h.writer for h in holders.values()):
        attempt(lambda: os.makedirs(path, exist_ok=True))
    if metadata_writer:  # an earlier write's weights must not outlive it (see `_remove_stale`)
        attempt(lambda: _remove_stale(path, plan.files))
    for file, (key, stage), entries in zip(plan.files, plan.groups, plan.entries):
        holder = holders.get(key)
        if holder is None or stage not in holder.stages:
            continue
        dtype = by_key[key].dtype
        out = attempt(lambda: SafetensorsWriter(os.path.join(path, file),  # noqa: B023 - called at once
                                                [(e.name, dtype, e.shape) for e in entries]).__enter__()) \
            if holder.writer else None
        for entry in entries:
            full = None if entry.param is None else full_value(holder.params[entry.param], holder.gather_to)
            if out is not None and not errors:
                try:
                    out.write(entry.value(full, dtype))
                except Exception as caught:  # noqa: BLE001 - raised below, after the gathers
                    errors.append(caught)
            del full  # one whole tensor at a time
        if out is not None:  # closed in any case; unwritten tensors are an error only without an earlier one
            out.__exit__(type(errors[0]), errors[0], None) if errors else attempt(lambda: out.__exit__(None, None, None))
    if metadata_writer:
        if config is not None:
            attempt(lambda: _write_json(os.path.join(path, "config.json"), config))
        if len(plan.files) > 1:
            attempt(lambda: _write_json(os.path.join(path, INDEX), {"metadata": {"total_size": plan.total_size()},
                                                                    "weight_map": plan.weight_map()}))
        if extras is not None:
            attempt(lambda: extras(path))
    if errors:
        raise errors[0]
    return plan


_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _remove_stale(path: str, files: list[str]) -> None:
    """Remove the weight files of an earlier write into `path` that this one does not write
    (``files``, and the index when there are several): left there, a reader would take them for
    the model's — transformers and `SafetensorsDir` read a ``model.safetensors`` before an index,
    so a directory rewritten from one file to sharded would give both the earlier weights. Only
    files of this naming are touched; the plan's own are not."""
    keep = {*files, *([INDEX] if len(files) > 1 else [])}
    for name in os.listdir(path):
        if name not in keep and (name in (SINGLE, INDEX) or _SHARD.fullmatch(name)):
            os.remove(os.path.join(path, name))


def _write_json(path: str, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2)
