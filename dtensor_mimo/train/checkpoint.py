"""Distributed checkpoints of a `MimoModel` run with `torch.distributed.checkpoint` (DCP).

What a checkpoint holds, under layout-independent keys:

- ``model.<module>.<param>``: every parameter under the name it has in the user's module (a
  DTensor shard on FSDP/tp ranks, a plain tensor elsewhere). DCP writes each distinct element once
  (replicas deduplicated) and reads any slice back, so a checkpoint saved under one layout loads
  under another (other dp/tp/pp sizes, colocated or not, another world size);
- ``optim.<module>.<param>.<exp_avg|exp_avg_sq|step>``: AdamW's state, sharded like the parameter;
- ``trainer``: step, optimizer updates, data position (the same on every rank);
- ``rng.<rank>``: each rank's torch RNG state (restored when the world size is unchanged).

Saves are atomic: every rank writes into ``DIR/.step-000020.tmp``, and after a barrier rank 0
renames it to ``DIR/step-000020`` (one rename, atomic on a POSIX file system). A save killed
midway leaves only the ``.tmp`` directory, which is never taken for a checkpoint and is removed
by the next save. The last `keep` checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dtensor_mimo.mimo import MimoModel
from dtensor_mimo.train.optimizer import MimoOptimizer

_STEP_DIR = re.compile(r"^step-(\d+)$")
_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


class CheckpointError(RuntimeError):
    """A checkpoint that does not match the model (names the keys and shapes)."""


def checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:06d}")


def latest_checkpoint(directory: str) -> str | None:
    """The complete checkpoint with the highest step in `directory` (None: there is none).
    A directory is complete once renamed from its ``.tmp`` name and holding DCP's metadata."""
    if not os.path.isdir(directory):
        return None
    steps = [(int(m.group(1)), name) for name in os.listdir(directory)
             if (m := _STEP_DIR.match(name)) and os.path.exists(os.path.join(directory, name, ".metadata"))]
    return os.path.join(directory, max(steps)[1]) if steps else None


def resolve_load(path: str) -> str:
    """The checkpoint `path` names: itself when it is one, else the latest complete checkpoint
    of the directory of them it is; CheckpointError says what is there otherwise."""
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r}: no such directory")
    latest = latest_checkpoint(path)
    if latest is None:
        entries = sorted(os.listdir(path))[:8]
        raise CheckpointError(f"checkpoint {path!r} is neither a checkpoint (no .metadata) nor a directory of "
                              f"complete step-N checkpoints (it holds {entries or 'nothing'})")
    return latest


def expected_shapes(modules: Mapping[str, torch.nn.Module]) -> dict[str, tuple[int, ...]]:
    """The global shape of every model key of full (unparallelized, possibly meta) `modules`:
    what every rank of any layout agrees a checkpoint must hold."""
    return {f"model.{m}.{n}": tuple(p.shape) for m, module in modules.items()
            for n, p in module.named_parameters()}


def _optimizer_keys(model: MimoModel, optimizer: MimoOptimizer, init: bool) -> dict[str, Any]:
    """This rank's AdamW state under checkpoint keys; with `init`, state AdamW has not created yet
    (a parameter that never had a gradient) is created as AdamW would: zeros, step 0."""
    out: dict[str, Any] = {}
    for module, opt in optimizer.optimizers.items():
        for name, param in model.module_parameters(module).items():
            if not param.requires_grad:
                continue
            state = opt.state[param]
            if not state and init:
                state["step"] = torch.tensor(0.0)
                for key in _ADAM_KEYS:
                    state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
            for key in ("step", *_ADAM_KEYS):
                if key in state:
                    out[f"optim.{module}.{name}.{key}"] = state[key]
    return out


def _state(model: MimoModel, optimizer: MimoOptimizer, trainer: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, Any] = {f"model.{m}.{n}": p for m in model.module_names
                             for n, p in model.module_parameters(m).items()}
    state.update(_optimizer_keys(model, optimizer, init=True))
    state["trainer"] = json.dumps(trainer)  # one leaf: DCP stores it once (equal on every rank)
    state[f"rng.{dist.get_rank()}"] = torch.get_rng_state()
    return state


def save(directory: str, step: int, model: MimoModel, optimizer: MimoOptimizer,
         trainer: dict[str, Any], keep: int) -> str:
    """Write the checkpoint of `step` (every rank), atomically; keep the last `keep`."""
    final = checkpoint_path(directory, step)
    tmp = os.path.join(directory, f".step-{step:06d}.tmp")
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    dcp.save(_state(model, optimizer, trainer), checkpoint_id=tmp)
    dist.barrier()  # every rank's files and the metadata are written
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for name in os.listdir(directory):  # older checkpoints beyond `keep`, stale partial saves
            m = _STEP_DIR.match(name)
            if (m and int(m.group(1)) < step and name not in _newest(directory, keep)) or \
                    (name.startswith(".step-") and name.endswith(".tmp")):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    dist.barrier()
    return final


def _newest(directory: str, keep: int) -> set[str]:
    steps = sorted((int(m.group(1)), n) for n in os.listdir(directory) if (m := _STEP_DIR.match(n)))
    return {n for _, n in steps[-keep:]}


def check_checkpoint(path: str, expected: Mapping[str, tuple[int, ...]]) -> None:
    """Raise CheckpointError naming the model keys missing from the checkpoint at `path`, the
    checkpoint's model keys the model does not have, and shapes that differ. Reads only the
    metadata; every rank reaches the same verdict without communicating."""
    try:
        meta = FileSystemReader(path).read_metadata().state_dict_metadata
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable checkpoint: {e}") from None
    saved = {k: tuple(v.size) for k, v in meta.items()
             if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    shapes = [f"{k}: checkpoint {saved[k]}, model {expected[k]}" for k in sorted(set(saved) & set(expected))
              if saved[k] != expected[k]]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {_short(missing)}")
        if unexpected:
            parts.append(f"not in the model: {_short(unexpected)}")
        if shapes:
            parts.append(f"different shapes: {_short(shapes)}")
        raise CheckpointError(f"checkpoint {path} does not match the model: " + "; ".join(parts) +
                              ". Build the model with the config the checkpoint was saved with.")


def _short(items: list[str], limit: int = 8) -> str:
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def load(path: str, model: MimoModel, optimizer: MimoOptimizer,
         expected: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """Load the checkpoint at `path` into this rank's shards of `model` and `optimizer`, whatever
    layout it was saved under; returns the trainer state. Call on every rank.

    Before DCP's collectives, one small all-reduce makes every rank agree: if any rank cannot
    read the checkpoint, finds it mismatched, or chose another path (e.g. a file system that is
    not shared), all of them raise instead of leaving the others waiting in `dcp.load`."""
    problem = None
    try:
        check_checkpoint(path, expected)
    except CheckpointError as e:
        problem = e
    name = zlib.crc32(os.path.abspath(path).encode())
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    votes = torch.tensor([float(problem is not None), name, -name], dtype=torch.float64, device=device)
    dist.all_reduce(votes, op=dist.ReduceOp.MAX)
    votes = votes.tolist()
    if problem is not None:
        raise problem
    if votes[0]:
        raise CheckpointError(f"loading {path}: another rank could not use its checkpoint (its error says why)")
    if votes[1] != -votes[2]:
        raise CheckpointError(f"loading {path}: the ranks chose different checkpoint paths; put "
                              "checkpoint.dir on a file system every rank sees")
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    state = _state(model, optimizer, {})
    rng, world = f"rng.{dist.get_rank()}", dist.get_world_size()
    if f"rng.{world - 1}" not in meta or f"rng.{world}" in meta:
        del state[rng]  # saved under another world size: keep this rank's own
    missing_optim = [k for k in state if k.startswith("optim.") and k not in meta]
    for k in missing_optim:  # saved before that parameter trained (e.g. frozen then): fresh state
        del state[k]
    dcp.load(state, checkpoint_id=path)  # in place: parameters, AdamW state; the rest replaced
    model.uninitialized.clear()  # every parameter came from the checkpoint
    if rng in state:
        torch.set_rng_state(state[rng])
    trainer = json.loads(state["trainer"])
    optimizer.set_updates(trainer["updates"])
    return trainer


