"""Distributed checkpoints of a `MimoModel` run with `torch.distributed.checkpoint` (DCP).

What a checkpoint holds, under layout-independent keys:

- ``model.<module>.<param>``: every parameter under the name it has in the user's module (a
  DTensor shard on FSDP/tp ranks, a plain tensor elsewhere; a float8 weight's plain tensor,
  not torchao's wrapper, `_plain`). DCP writes each distinct element once
  (replicas deduplicated) and reads any slice back, so a checkpoint saved under one layout loads
  under another (other dp/tp/pp sizes, colocated or not, another world size);
- ``buffer.<module>.<buffer>``: every persistent buffer (a BatchNorm's running statistics and
  ``num_batches_tracked``, a module's ``register_buffer(..., persistent=True)``) under the name it
  has in the user's module, as the module holds it (a DTensor's shards; a plain tensor from the
  first dp·cp replica, ``dp = cp = 0``, and read back into every replica: one value for all of
  them). Non-persistent buffers are not saved (the module's ``init_weights`` rebuilds them). A
  checkpoint without them (saved before checkpoints held buffers) loads with the model's own
  values kept and a warning naming them (refused into a meta-built model not yet initialized);
- ``optim.<module>.<param>.<exp_avg|exp_avg_sq|step>``: AdamW's state, sharded like the parameter;
- ``trainer``: step, optimizer updates, data position (the same on every rank);
- ``rng.<rank>``, ``rng.<device type>.<rank>``: each rank's torch RNG states, the host's and on an
  accelerator its device's (restored when the world size is unchanged).

Saves are atomic: every rank writes into ``DIR/.step-000020.tmp``, and after a barrier rank 0
renames it to ``DIR/step-000020`` (one rename, atomic on a POSIX file system). A save killed
midway leaves only the ``.tmp`` directory, which is never taken for a checkpoint and is removed
by the next save. The last `keep` checkpoints are kept.

Saves are verified: before the rename, ``manifest.json`` records every file's size and CRC-32
(each rank checksums a share of the files; rank 0 writes the manifest). Resuming takes the newest
checkpoint that still matches its manifest (each rank checks the sizes and checksums of its share)
and says which file made it skip a newer one (`choose_checkpoint`); a checkpoint named by
``checkpoint.load`` is verified the same way and refused when it does not match.

A decoder's tied head (`tied_copies`) is saved as the model holds it: one key (the embedding's)
where it is tied, two where pipeline stages (or an untied config) train it as a copy. Either form
loads into the other: a tied checkpoint into two copies, both (and their AdamW state) from the one
tensor; two copies into a tied model where they are equal (saved before they trained apart),
taking the embedding's, else refused on every rank naming the head (`stored_as`).

`load` restores all of it (a resume); `load_model` reads only the ``model.`` and ``buffer.`` keys
(a weights-only start: ``checkpoint.load_model_only``), leaving the optimizer, the trainer state
and the RNG states to the run that loads them.

Saves can be written in the background (`BackgroundSaves`, the trainer's
``checkpoint.async_mode = "async"``): the step waits for a copy of the state in host memory; a
thread writes the same files, manifest and rename on a gloo group of its own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import zlib
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from dtensor_mimo.layout.world import warn_once
from dtensor_mimo.mimo import MimoModel
from dtensor_mimo.models.layers import local_part, named_buffers, with_local
from dtensor_mimo.optim.optimizer import MimoOptimizer

_STEP_DIR = re.compile(r"^step-(\d+)$")
_ADAM_KEYS = ("exp_avg", "exp_avg_sq")
MANIFEST = "manifest.json"
"""Every file of a checkpoint with its size and CRC-32: ``{"files": {name: [bytes, crc32]}}``."""
_CHUNK = 8 << 20  # bytes read at a time while checksumming


class CheckpointError(RuntimeError):
    """A checkpoint that does not match the model (names the keys and shapes)."""


def checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:06d}")


def step_checkpoints(directory: str) -> list[str]:
    """The checkpoints (renamed ``step-N`` directories) of `directory`, newest first."""
    if not os.path.isdir(directory):
        return []
    steps = sorted(((int(m.group(1)), name) for name in os.listdir(directory) if (m := _STEP_DIR.match(name))),
                   reverse=True)
    return [os.path.join(directory, name) for _, name in steps]


def latest_checkpoint(directory: str, warn: Callable[[str], None] | None = None,
                      checksums: bool = False) -> str | None:
    """The newest checkpoint in `directory` that is complete: DCP's metadata present and every
    file of its manifest there with its recorded size (and, with `checksums`, its CRC-32: `verify`,
    every file read in this process). None: there is none. Each newer one passed over is reported
    to `warn` (naming the file that is wrong)."""
    for path in step_checkpoints(directory):
        problems = verify(path, checksums=checksums)
        if not problems:
            return path
        if warn is not None:
            warn(f"skipped checkpoint {path}: {'; '.join(problems)}")
    return None


def file_crc32(path: str) -> int:
    """CRC-32 of the file at `path`, read in chunks (memory stays flat whatever the size)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _entries(directory: str, names: Sequence[str]) -> dict[str, list[int]]:
    return {n: [os.path.getsize(os.path.join(directory, n)), file_crc32(os.path.join(directory, n))] for n in names}


def verify(path: str, share: tuple[int, int] = (0, 1), checksums: bool = True) -> list[str]:
    """What is wrong with the checkpoint at `path` (empty: nothing), each problem naming its file:
    no ``.metadata``, a file of the manifest missing or of another size, and (with `checksums`)
    another CRC-32, for this rank's `share` = (rank, world) of the manifest's files, so the ranks
    of a world look at each file once between them (one process: every file). A checkpoint without a manifest (saved before manifests
    existed) is checked for ``.metadata`` only."""
    if not os.path.exists(os.path.join(path, ".metadata")):
        return [f"{os.path.join(path, '.metadata')} is missing (DCP's index of the checkpoint)"]
    manifest = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest):
        return []
    try:
        with open(manifest) as f:
            files = json.load(f)
    except (OSError, ValueError) as e:
        return [f"{manifest} is unreadable ({e})"]
    try:
        entries = [(name, int(size), int(crc)) for name, (size, crc) in sorted(files["files"].items())]
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        return [f"{manifest} is malformed ({type(e).__name__}: {e})"]
    # Every problem is returned, not raised: the callers pool the ranks' verdicts in a collective,
    # which a rank raising on its own would leave its peers waiting in.
    problems = []
    rank, world = share
    for i, (name, size, crc) in enumerate(entries):
        if i % world != rank:  # each file is looked at by one rank: O(files / world) per rank
            continue
        file = os.path.join(path, name)
        try:
            if not os.path.exists(file):
                problems.append(f"{file} is missing")
            elif (actual := os.path.getsize(file)) != size:
                problems.append(f"{file} has {actual} bytes, the manifest says {size}")
            elif checksums and file_crc32(file) != crc:
                problems.append(f"{file} has another checksum than the manifest's (corrupt)")
        except OSError as e:
            problems.append(f"{file} cannot be read ({e})")
    return problems


def choose_checkpoint(directory: str) -> tuple[str | None, list[str]]:
    """The newest checkpoint of `directory` that verifies on every rank, and a warning for each
    newer one skipped (naming the file). Collective: call on every rank; each checksums its share
    of a candidate's files and one all-gather pools the verdicts, so every rank returns the same."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # rank 0 lists: one view of a shared directory
    candidates = _from_rank_0(lambda: step_checkpoints(directory), f"cannot list the checkpoints of {directory}")
    warnings = []
    for path in candidates:
        problems = verify(path, (rank, world))
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, problems)
        found = list(dict.fromkeys(p for ps in everyone for p in ps))
        if not found:
            return path, warnings
        warnings.append(f"skipped checkpoint {path}: {'; '.join(found)}; trying an older one")
    return None, warnings


def resolve_load(path: str, warn: Callable[[str], None] | None = None, checksums: bool = True) -> str:
    """The checkpoint `path` names: itself when it is one, else the newest checkpoint of the
    directory of them it is that verifies (`latest_checkpoint` with `checksums`, as a resume from
    ``checkpoint.dir`` chooses; newer damaged ones reported to `warn`); CheckpointError says what
    is there otherwise. A checkpoint named itself is never swapped for another: `load` refuses it
    when damaged, and one that lost its ``.metadata`` is named as damaged here. One process reads
    every file it checksums: a world chooses with `choose_load`."""
    if _names_one(path):
        return path
    latest = latest_checkpoint(path, warn, checksums)
    if latest is None:
        raise CheckpointError(_none_in(path))
    return latest


def _names_one(path: str) -> bool:
    """Whether `path` names a checkpoint itself (True) or a directory of them (False); raises
    CheckpointError for neither: no such directory, or a checkpoint that lost its ``.metadata``."""
    if os.path.exists(os.path.join(path, ".metadata")):
        return True
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r}: no such directory")
    if _STEP_DIR.match(os.path.basename(os.path.normpath(path))) or os.path.exists(os.path.join(path, MANIFEST)):
        raise CheckpointError(f"checkpoint {path!r} is damaged: {'; '.join(verify(path, checksums=False))}; name "
                              f"the directory that holds it ({os.path.dirname(os.path.normpath(path)) or '.'!r}) "
                              "to load the newest complete checkpoint instead")
    return False


def _none_in(path: str) -> str:
    entries = sorted(os.listdir(path))[:8]
    return (f"checkpoint {path!r} is neither a checkpoint (no .metadata) nor a directory of "
            f"complete step-N checkpoints (it holds {entries or 'nothing'})")


def choose_load(path: str) -> tuple[str, list[str], bool]:
    """`resolve_load` for a world (collective: call on every rank): rank 0 says what `path`
    names (no file read), and a directory of checkpoints is chosen from as a resume from
    ``checkpoint.dir`` is (`choose_checkpoint`: each rank checksums its share of the files, not
    rank 0 all of them while its peers wait). Returns (the checkpoint, a warning for each newer
    one skipped, whether it was verified); CheckpointError on every rank alike."""
    if _from_rank_0(lambda: _names_one(path)):
        return path, [], False
    chosen, warnings = choose_checkpoint(path)
    if chosen is None:
        raise CheckpointError("; ".join([_from_rank_0(lambda: _none_in(path), f"cannot list {path}"), *warnings]))
    return chosen, warnings, True


def _from_rank_0(compute: Callable[[], Any], what: str = "") -> Any:
    """`compute()` on rank 0, its result on every rank (collective: one broadcast); its failure
    (CheckpointError, or an OSError named after `what`) raised on every rank alike, none left
    waiting for rank 0."""
    said: list[Any] = [None, None]
    if dist.get_rank() == 0:
        try:
            said[0] = compute()
        except CheckpointError as e:
            said[1] = str(e)
        except OSError as e:
            said[1] = f"{what}: {e.strerror or e}"
    dist.broadcast_object_list(said, src=0)
    if said[1] is not None:
        raise CheckpointError(said[1])
    return said[0]


def expected_shapes(modules: Mapping[str, torch.nn.Module]) -> dict[str, tuple[int, ...]]:
    """The global shape of every parameter and persistent buffer key of full (unparallelized,
    possibly meta) `modules`: what every rank of any layout agrees a checkpoint must hold (its
    buffers may be missing: `load` keeps the model's own values)."""
    return {**{f"model.{m}.{n}": tuple(p.shape) for m, module in modules.items()
               for n, p in module.named_parameters()},
            **{f"buffer.{m}.{n}": tuple(b.shape) for m, module in modules.items()
               for n, b in named_buffers(module, True).items()}}


def _optimizer_keys(model: MimoModel, optimizer: MimoOptimizer, init: bool) -> dict[str, Any]:
    """This rank's AdamW state under checkpoint keys; with `init`, state AdamW has not created yet
    (a parameter that never had a gradient) is created as AdamW would: zeros, step 0."""
    out: dict[str, Any] = {}
    for module, opt in optimizer.optimizers.items():
        on_device = {id(p) for g in opt.param_groups if g.get("fused") or g.get("capturable") for p in g["params"]}
        for name, param in model.module_parameters(module).items():
            if not param.requires_grad:
                continue
            state = opt.state[param]
            if not state and init:
                state["step"] = _fresh_step(param, id(param) in on_device)
                for key in _ADAM_KEYS:
                    state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
            for key in ("step", *_ADAM_KEYS):
                if key in state:
                    out[f"optim.{module}.{name}.{key}"] = state[key]
    return out


def _fresh_step(param: torch.Tensor, on_device: bool) -> torch.Tensor:
    """A step count of 0 as AdamW's first step creates it for `param`: `on_device` (a fused or
    capturable group, whose kernel reads it there) on the parameter's device in float32, else a
    float32 (or the default float64) host scalar. A host count under a fused CUDA AdamW would
    reach its kernel on the wrong device after a resume (DCP loads into the tensor it is given)."""
    if on_device:
        return torch.zeros((), dtype=torch.float32, device=param.device)
    return torch.tensor(0.0, dtype=torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32)


def _plain(param: torch.Tensor) -> torch.Tensor:
    """`param` as the checkpoint stores it: a weight whose (local) tensor is a wrapper subclass
    holding one tensor of its own shape and dtype (torchao's float8 weight under FSDP2) is stored
    as that inner tensor, in the same DTensor placement, so that reading a checkpoint never needs
    the wrapper's class (DCP loads it into the wrapper in place)."""
    local = local_part(param)
    if type(local) in (torch.Tensor, nn.Parameter) or not hasattr(local, "__tensor_flatten__"):
        return param
    names, _ = local.__tensor_flatten__()
    inner = getattr(local, names[0]) if len(names) == 1 else None
    if inner is None or inner.shape != local.shape or inner.dtype != local.dtype:
        return param
    return with_local(param, inner)


def _parameter_keys(model: MimoModel) -> dict[str, Any]:
    """This rank's parameters under checkpoint keys (``model.<module>.<name>``, `_plain`)."""
    return {f"model.{m}.{n}": _plain(p) for m in model.module_names for n, p in model.module_parameters(m).items()}


def _state(model: MimoModel, optimizer: MimoOptimizer, trainer: dict[str, Any]) -> dict[str, Any]:
    state = _parameter_keys(model)
    state.update(_buffer_keys(model, saving=True))
    state.update(_optimizer_keys(model, optimizer, init=True))
    # one leaf: DCP stores it once (equal on every rank); with the optimizer's update count (the
    # learning-rate schedule's position), whatever the caller's trainer state holds
    state["trainer"] = json.dumps(trainer | {"updates": optimizer.updates})
    state.update(_rng_states(model.device))
    return state


def _buffer_keys(model: MimoModel, saving: bool) -> dict[str, torch.Tensor]:
    """This rank's persistent buffers under checkpoint keys. `saving`: a plain tensor only from
    the first dp·cp replica of its module (FSDP2 and dp leave buffers whole on every replica, and
    a BatchNorm's statistics differ between replicas: one replica's, the same whichever world
    saves); a DTensor's shards from every rank (DCP writes each element once)."""
    out: dict[str, torch.Tensor] = {}
    for m in model.module_names:
        held = model.module_buffers(m)
        coord = model.layout.coordinate(m, model.rank) if held else None
        first = coord is not None and coord["dp"] == 0 and coord["cp"] == 0
        out.update({f"buffer.{m}.{n}": b.detach() for n, b in held.items()
                    if not saving or first or isinstance(b, DTensor)})
    return out


def _rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's random states under checkpoint keys: the host generator's, and on an
    accelerator its device's (``rng.<type>.<rank>``: dropout and other draws on the device)."""
    rank = dist.get_rank()
    out = {f"rng.{rank}": torch.get_rng_state()}
    if device.type != "cpu":
        out[f"rng.{device.type}.{rank}"] = torch.get_device_module(device).get_rng_state(device)
    return out


def _set_rng_states(states: Mapping[str, torch.Tensor], device: torch.device) -> None:
    """Put back the states of `_rng_states` that `states` holds."""
    rank = dist.get_rank()
    if f"rng.{rank}" in states:
        torch.set_rng_state(states[f"rng.{rank}"])
    if f"rng.{device.type}.{rank}" in states:
        torch.get_device_module(device).set_rng_state(states[f"rng.{device.type}.{rank}"], device)


def save(directory: str, step: int, model: MimoModel, optimizer: MimoOptimizer,
         trainer: dict[str, Any], keep: int) -> str:
    """Write the checkpoint of `step` (every rank), atomically; keep the last `keep`."""
    tmp = _prepare(directory, step)
    return _write(_state(model, optimizer, trainer), directory, step, tmp, keep)


def _prepare(directory: str, step: int) -> str:
    """The temporary directory of `step`'s checkpoint, emptied and created by rank 0 (every rank
    returns after it, or raises CheckpointError with rank 0's reason: an all-gather in place of
    a barrier, so that no rank waits for one that gave up)."""
    tmp = os.path.join(directory, f".step-{step:06d}.tmp")
    error = None
    if dist.get_rank() == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = f"rank 0 could not create {tmp}: {e.strerror or e}"
    _every_rank_raises([error], f"saving the checkpoint of step {step} in {directory}")
    return tmp


def _write(state: dict[str, Any], directory: str, step: int, tmp: str, keep: int,
           group: dist.ProcessGroup | None = None) -> str:
    """DCP's save of `state` into `tmp`, its manifest, the rename to ``step-N`` and the pruning
    of older checkpoints; every collective on `group` (None: the default group, and `state`
    where training holds it; a group of its own: `state` in host memory, written without
    DCP's copy-ahead of device tensors, which would use the thread's current CUDA stream)."""
    final = checkpoint_path(directory, step)
    writer = None if group is None else FileSystemWriter(tmp, per_thread_copy_ahead=0)
    dcp.save(state, checkpoint_id=tmp, storage_writer=writer, process_group=group)
    dist.barrier(group=group)  # every rank's files and the metadata are written
    write_manifest(tmp, group)
    error = None
    if dist.get_rank() == 0:
        try:
            _discard(final)
            os.replace(tmp, final)
            kept = _newest(directory, keep, step)
            for name in os.listdir(directory):  # older checkpoints beyond `keep`, stale partial saves
                m = _STEP_DIR.match(name)
                if (m and int(m.group(1)) < step and name not in kept) or \
                        (name.startswith(".step-") and name.endswith(".tmp")):
                    _discard(os.path.join(directory, name))
        except OSError as e:
            error = f"rank 0 could not rename {tmp} to {final}: {e}"
    _every_rank_raises([error], f"saving {final}", group)  # in place of a barrier: rank 0's verdict too
    return final


def _discard(path: str) -> None:
    """Remove the checkpoint directory `path`: first renamed out of the ``step-N`` names (one
    atomic step), then deleted, so that a removal cut short (a kill, a full quota) never leaves a
    ``step-N`` missing some files but not its metadata, which a later run could choose."""
    if not os.path.exists(path):
        return
    name = os.path.basename(os.path.normpath(path))
    trash = os.path.join(os.path.dirname(os.path.normpath(path)), f".{name}.removed.tmp" if not
                         name.startswith(".") else name)
    if trash != path:
        if os.path.exists(trash):  # an earlier removal's, cut short
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _same_layout(buffer: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether `value` copies into `buffer` element for element: the same tensor type, global
    and local shape, dtype, and (DTensors) mesh and placements."""
    if type(buffer) is not type(value) or buffer.shape != value.shape or buffer.dtype != value.dtype:
        return False
    if isinstance(value, DTensor):
        return (buffer.placements == value.placements and buffer.device_mesh == value.device_mesh
                and local_part(buffer).shape == local_part(value).shape)
    return True


class BackgroundSaves:
    """Checkpoints written while training goes on (``checkpoint.async_mode = "async"`` or
    ``"async_with_pinned_mem"``).

    `start` copies this rank's shards of the model and optimizer state to host memory (`_stage`:
    the only part the training step waits for, with one barrier) and hands the copy to a
    thread of its own, which writes it as `save` does: DCP's files, the manifest, the rename to
    ``step-N``, the pruning. The checkpoint is as atomic and as verified as a synchronous one: a
    process killed while it is written leaves only the ``.tmp`` directory.

    Every collective of the writing thread runs on a gloo group of the whole world created here
    (once, on every rank, at the same point), never on a group training uses: two threads never
    interleave collectives on one group, and NCCL's groups carry only training's (torchtitan's
    asynchronous checkpoints do the same), with the default group's timeout. The copy of a CUDA
    tensor is in host memory, and DCP writes it without its copy-ahead of device tensors (which
    would synchronize the thread's current CUDA stream): the writing thread touches no device.

    `writing` is this rank's answer only; the caller finishes a save at a step every rank agrees
    on (the trainer sums every rank's `writing` in the step's own all-reduce), and `finish` waits
    for the writer, if it has not ended, and raises `CheckpointError` on every rank when any
    rank's writer failed (one all-gather). A run that ends on an error first waits, for at most
    a given time, for its own writer (`settle`: no collective of the caller's): the peers' writers
    go on while their training waits, so the save in flight completes (or `settle` says why
    not). The writing thread is a daemon: a process that ends anyway does not wait for it, and
    its half-written ``.tmp`` directory is never loaded. Host memory: one copy of this rank's
    shards, kept from the first save until `release`, page-locked with `pin` for the shards on an
    accelerator (``"async_with_pinned_mem"``, as torchtitan names it; torch's caching host
    allocator rounds each buffer up to a power of two: up to twice the shards' bytes locked).
    """

    def __init__(self, pin: bool = False) -> None:
        """`pin`: the host buffers of tensors on an accelerator are pinned (page-locked; the
        trainer's ``checkpoint.async_mode = "async_with_pinned_mem"``)."""
        from dtensor_mimo.layout.mesh import default_timeout

        self.pin = pin

        self.group = dist.new_group(backend="gloo", timeout=default_timeout())
        self._pending: tuple[Future, str] | None = None
        self._host: dict[str, Any] | None = None  # the staged copy's buffers (`_stage`)
        self._settled = False  # `settle` ran: a writer it stopped waiting for may still read `_host`

    def start(self, directory: str, step: int, model: MimoModel, optimizer: MimoOptimizer,
              trainer: dict[str, Any], keep: int) -> str:
        """Copy the state of `step` and start writing it (every rank); the checkpoint's path.
        The previous save must be finished first (`finish`)."""
        if self._pending is not None:
            raise RuntimeError("BackgroundSaves.start: the previous save is not finished; call finish() first")
        if self._settled:  # the same on every rank that settled: no rank-local verdict before the barrier
            raise RuntimeError("BackgroundSaves.start: settle() ended this object (a run's error path); "
                               "make a new BackgroundSaves")
        tmp = _prepare(directory, step)
        staged = self._stage(_state(model, optimizer, trainer))
        future: Future = Future()

        def write() -> None:
            try:
                future.set_result(_write(staged, directory, step, tmp, keep, self.group))
            except BaseException as e:  # noqa: BLE001 - `finish` raises it on the caller's thread
                future.set_exception(e)

        threading.Thread(target=write, name=f"checkpoint step {step}", daemon=True).start()
        self._pending = (future, checkpoint_path(directory, step))
        return self._pending[1]

    def _stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """`state` copied into host buffers kept from one save to the next: the first save
        allocates them (`_buffer`), later ones copy into them; a tensor whose type, shape, dtype
        or placement changed gets a new buffer (a staged copy is never written twice at once:
        `start` refuses while a save is pending). Values that are not tensors are taken as they
        are. Pinned buffers are filled by asynchronous copies, waited for here, once per device."""
        host = self._host if self._host is not None and self._host.keys() == state.keys() else {}
        devices = set()
        for k, v in state.items():
            if not isinstance(v, torch.Tensor):
                host[k] = v
                continue
            v = v.detach()  # a Parameter: its plain tensor (a DTensor stays one)
            if not (k in host and _same_layout(host[k], v)):
                host[k] = self._buffer(v)
            source, buffer = local_part(v), local_part(host[k])
            buffer.copy_(source, non_blocking=buffer.is_pinned())
            if buffer.is_pinned():
                devices.add(source.device)
        for device in devices:  # the copies ran on the device's current stream: the writer reads them
            torch.get_device_module(device).synchronize(device)
        self._host = host
        return dict(host)

    def _buffer(self, value: torch.Tensor) -> torch.Tensor:
        """An empty host tensor in `value`'s place (a DTensor's local shard, with its mesh and
        placements), pinned when `pin` and `value` is on an accelerator: torch's caching host
        allocator, as DCP's own stager pins, so that the copy runs at the link's speed and
        asynchronously (pageable memory: a staged, blocking copy at a fraction of it)."""
        local = local_part(value)
        pin = self.pin and local.device.type != "cpu"
        buffer = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin)
        if not isinstance(value, DTensor):
            return buffer
        # What ``DTensor.to("cpu")`` makes: the spec of `value` around a host shard (`from_local`
        # would move the shard to its mesh's device, a second copy of the state on the GPU).
        return DTensor(buffer, value._spec, requires_grad=False)

    def release(self) -> None:
        """Drop the host buffers (after the run's last save; the next save allocates them anew),
        and with `pin` return their page-locked memory (torch's host cache keeps freed blocks)."""
        pinned = self._host is not None and any(isinstance(v, torch.Tensor) and local_part(v).is_pinned()
                                                for v in self._host.values())
        self._host = None
        if pinned:
            torch._C._host_emptyCache()

    def writing(self) -> bool:
        """Whether this rank's writer of the pending save is still running."""
        return self._pending is not None and not self._pending[0].done()

    def settle(self, timeout_s: float) -> tuple[str | None, str | None]:
        """On a run's error: wait up to `timeout_s` for this rank's writer of the pending save,
        with no collective of the caller's (the peers' writers go on while their training waits,
        or fail at once if a peer died). Returns (the checkpoint's path, None) if it was written
        (complete and renamed), else (None, why not); (None, None) when none was pending. A
        writer still running after `timeout_s` is abandoned; `start` refuses from now on."""
        self._settled = True
        if self._pending is None:
            return None, None
        (future, final), self._pending = self._pending, None
        try:
            future.result(timeout=timeout_s)
        except FutureTimeout:  # (not the builtin TimeoutError before Python 3.11)
            self._host = None  # the abandoned writer may still read the buffers
            return None, f"{final} was still being written after {timeout_s:g} s; abandoned"
        except BaseException as e:  # noqa: BLE001 - the run's own error is the one raised
            return None, f"{final} was not written: {type(e).__name__}: {e}"
        return final, None

    def finish(self) -> str | None:
        """Wait for the pending save and return its path (None: none was pending). Call on every
        rank at the same step: a writer's error raises `CheckpointError` on every rank."""
        if self._pending is None:
            return None
        (future, final), self._pending = self._pending, None
        error = None
        try:
            future.result()
        except Exception as e:  # noqa: BLE001 - every rank raises below, with each rank's reason
            # A CheckpointError names its ranks and is the same on each (raised on all of them)
            error = str(e) if isinstance(e, CheckpointError) else f"rank {dist.get_rank()}: {type(e).__name__}: {e}"
        _every_rank_raises([error], f"writing {final} in the background")
        return final


def _every_rank_raises(errors: list[str | None], what: str, group: dist.ProcessGroup | None = None) -> None:
    """One all-gather of each rank's `errors` (its verdicts, None: fine) over `group` (None: the
    default group); raises CheckpointError on every rank when any rank's is not None, so no rank
    waits for one that gave up."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, errors, group=group)
    found = list(dict.fromkeys(e for part in everyone for e in part if e is not None))
    if found:
        raise CheckpointError(f"{what}: {'; '.join(found)}")


def write_manifest(directory: str, group: dist.ProcessGroup | None = None) -> None:
    """Write `MANIFEST` for the saved files in `directory` (collective over the whole world, on
    `group` or the default group: each rank checksums its share of them; rank 0 writes the file,
    flushed to disk before the checkpoint is renamed).
    A rank that cannot read its share, or rank 0 failing to list or write, makes every rank raise
    CheckpointError naming the rank and the file (all-gathers, not a gather to rank 0 alone)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shares: list[Any] = [None]
    if rank == 0:  # one listing of the (shared) directory, each rank sent only its share
        try:
            names = sorted(n for n in os.listdir(directory) if n != MANIFEST)
            parts: list[Any] = [names[r::world] for r in range(world)]
        except OSError as e:
            parts = [f"rank 0 could not list {directory}: {e}"] * world
        dist.scatter_object_list(shares, parts, src=0, group=group)
    else:
        dist.scatter_object_list(shares, None, src=0, group=group)
    mine, error = {}, None
    if isinstance(shares[0], str):  # rank 0's listing failed: every rank knows it now
        error = shares[0]
    else:
        try:
            mine = _entries(directory, shares[0])
        except OSError as e:
            error = f"rank {rank} could not checksum {e.filename or directory}: {e.strerror or e}"
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (mine, error), group=group)
    errors = list(dict.fromkeys(e for _, e in everyone if e is not None))
    if errors:
        raise CheckpointError(f"writing the manifest of {directory}: {'; '.join(errors)}")
    error = None
    if rank == 0:
        try:
            files = {n: e for part, _ in everyone for n, e in part.items()}
            with open(os.path.join(directory, MANIFEST), "w") as f:
                json.dump({"files": files}, f, indent=0, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            error = f"rank 0 could not write {os.path.join(directory, MANIFEST)}: {e}"
    _every_rank_raises([error], f"writing the manifest of {directory}", group)


def _newest(directory: str, keep: int, upto: int) -> set[str]:
    """The `keep` newest complete checkpoints of `directory` up to step `upto`: one newer than the
    step just saved (a damaged one the run resumed past) neither counts nor goes, and a damaged one
    older than it (a file missing or cut short: `verify` without checksums, a stat per file) does
    not count as one of the `keep`, so it never costs a good one its place."""
    steps = sorted(((int(m.group(1)), n) for n in os.listdir(directory) if (m := _STEP_DIR.match(n))
                    and int(m.group(1)) <= upto), reverse=True)
    kept: set[str] = set()
    for _, name in steps:
        if len(kept) == keep:
            break
        if not verify(os.path.join(directory, name), checksums=False):
            kept.add(name)
    return kept


def tied_copies(language: str) -> dict[str, str]:
    """{the checkpoint key of decoder `language`'s output head: its token embedding's}. A tied decoder
    (`LlamaConfig.tie_embeddings`) holds them as one parameter (one key, the embedding's); cut into
    pipeline stages, or untied by its config, as two (two keys). A checkpoint of either form loads
    into the other (`stored_as`)."""
    return {f"model.{language}.output.weight": f"model.{language}.tok_embeddings.weight"}


def stored_as(expected: Mapping[str, tuple[int, ...]], saved: Mapping[str, tuple[int, ...]],
              copies: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """How the checkpoint keys `saved` (shapes) hold the model's `expected` ones where a head of
    `copies` (`tied_copies`) is saved in the other form: (read: {a head key of a model of two copies:
    the embedding key of the tied checkpoint it is read from, its optimizer state likewise}, merged:
    the head keys a checkpoint of two copies holds beside the embedding of a tied model, which reads
    the embedding alone, where the two are equal: `load` checks it). Pure."""
    read, merged = {}, []
    for head, embedding in copies.items():
        if embedding not in saved or saved[embedding] != expected.get(embedding, expected.get(head)):
            continue
        if head in expected and embedding in expected and head not in saved:
            read[head] = embedding
        elif head in saved and head not in expected and saved[head] == saved[embedding]:
            merged.append(head)
    return read, merged


def check_checkpoint(path: str, expected: Mapping[str, tuple[int, ...]],
                     copies: Mapping[str, str] | None = None) -> None:
    """Raise CheckpointError naming the modules and the parameter keys missing from the checkpoint
    at `path`, the checkpoint's parameter and buffer keys the model does not have, and shapes that
    differ (a buffer the checkpoint lacks is not refused: `load` keeps the model's value; nor a tied
    head of `copies` saved in the other form: `stored_as`). Reads only the metadata; every rank
    reaches the same verdict without communicating."""
    try:
        meta = FileSystemReader(path).read_metadata().state_dict_metadata
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable checkpoint: {e}") from None
    saved = {k: tuple(v.size) for k, v in meta.items()
             if k.startswith(("model.", "buffer.")) and isinstance(v, TensorStorageMetadata)}
    read, merged = stored_as(expected, saved, copies or {})
    missing = sorted(k for k in set(expected) - set(saved) - set(read)
                     if not k.startswith("buffer."))  # `load` keeps them
    unexpected = sorted(set(saved) - set(expected) - set(merged))
    shapes = [f"{k}: checkpoint {saved[k]}, model {expected[k]}" for k in sorted(set(saved) & set(expected))
              if saved[k] != expected[k]]
    if missing or unexpected or shapes:
        parts = []
        held = sorted({k.split(".")[1] for k in saved if k.startswith("model.")})
        lacking = sorted({k.split(".")[1] for k in missing} - set(held))
        if lacking:  # a whole module: said first, by name (its many keys would hide it)
            parts.append(f"module{'s' * (len(lacking) > 1)} {', '.join(map(repr, lacking))} "
                         f"{'are' if len(lacking) > 1 else 'is'} not in it (it holds {', '.join(map(repr, held))})")
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


def _agree_to_load(path: str, model: MimoModel, expected: Mapping[str, tuple[int, ...]],
                   verified: bool) -> tuple[Mapping[str, Any], list[str], dict[str, str]]:
    """The checks `load` and `load_model` make before DCP's collectives, agreed by every rank in
    one small all-gather (see `load`), then the tied heads a checkpoint of two copies holds (equal
    to its embedding, or refused on every rank: `_check_merged`); returns the checkpoint's metadata,
    the buffer keys of `expected` it lacks and the keys read from others (`stored_as`)."""
    problem, absent, meta, read, merged = None, [], {}, {}, []
    try:
        problems = [] if verified else verify(path, (dist.get_rank(), dist.get_world_size()))
        if problems:
            raise CheckpointError(f"checkpoint {path} is damaged: {'; '.join(problems)}")
        check_checkpoint(path, expected, tied_copies(model.language_name))
        unbuilt = [f"{m}.{b}" for m in sorted(model.uninitialized) for b in model.buffer_names[m][1]]
        if unbuilt:
            raise CheckpointError(f"checkpoint.load into modules {sorted(model.uninitialized)} built on the meta "
                                  f"device: their non-persistent buffers {_short(unbuilt)} are in no checkpoint "
                                  "and would stay uninitialized memory; call model.init_weights({module: seed, "
                                  "...}) first (it rebuilds them), then load")
        meta = FileSystemReader(path).read_metadata().state_dict_metadata
        read, merged = stored_as(expected, {k: tuple(v.size) for k, v in meta.items()
                                            if isinstance(v, TensorStorageMetadata)}, tied_copies(model.language_name))
        absent = sorted(k for k in expected if k.startswith("buffer.") and k not in meta)
        blank = [k for k in absent if k.split(".")[1] in model.uninitialized]
        if blank:
            raise CheckpointError(f"checkpoint {path} holds no {_short(blank)} (saved before checkpoints held "
                                  "buffers), which would stay uninitialized memory in a model built on the meta "
                                  "device: call model.init_weights({module: seed, ...}) first, then load")
    except CheckpointError as e:
        problem = e
    verdicts: list[Any] = [None] * dist.get_world_size()  # small: a path and at most one message per rank
    dist.all_gather_object(verdicts, (os.path.abspath(path), None if problem is None else str(problem)))
    if problem is not None:
        raise problem
    others = list(dict.fromkeys(m for _, m in verdicts if m is not None))
    if others:  # what the other ranks found (a checksum only one rank read, say)
        raise CheckpointError("; ".join(others))
    if len({p for p, _ in verdicts}) > 1:
        raise CheckpointError(f"loading {path}: the ranks chose different checkpoint paths; put "
                              "checkpoint.dir on a file system every rank sees")
    _check_merged(path, model, merged)
    return meta, absent, read


def _check_merged(path: str, model: MimoModel, heads: list[str]) -> None:
    """Refuse, on every rank, a checkpoint of two copies whose `heads` differ from their embeddings
    (`stored_as`'s merged: the run trained them apart) where the model ties them (collective: one
    DCP read of both into scratch shards where this rank holds the embedding, one all-gather)."""
    if not heads:
        return
    copies = tied_copies(model.language_name)
    params = {f"model.{m}.{n}": p for m in model.module_names for n, p in model.module_parameters(m).items()}
    scratch = {}
    for head in heads:
        if copies[head] in params:
            like = _plain(params[copies[head]]).detach()
            scratch[head], scratch[copies[head]] = torch.zeros_like(like), torch.zeros_like(like)
    dcp.load(scratch, checkpoint_id=path)
    differ = {h: float((local_part(scratch[h]).float() - local_part(scratch[copies[h]]).float()).abs().max())
              for h in heads if h in scratch and local_part(scratch[h]).numel()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {h: d for h, d in differ.items() if d > 0})
    found = {h: max(part[h] for part in everyone if h in part) for h in heads if any(h in part for part in everyone)}
    if found:
        raise CheckpointError("; ".join(
            f"checkpoint {path} holds {h} apart from {copies[h]} and they differ (by up to {d:.3g}): it trained "
            "the head as a copy of its own (pipeline stages, or model.language.untie_embeddings), and this model "
            "ties them (one parameter); load it where the head is a copy: the language model at pp > 1 (or "
            "virtual_stages > 1), or with model.language.untie_embeddings = true (model.language.hf's decoder)"
            for h, d in found.items()))


def _read_copies(state: dict[str, Any], read: Mapping[str, str]) -> list[tuple[torch.Tensor, str]]:
    """Move `state`'s keys that the checkpoint holds under others (`read`, `stored_as`: a head of
    two copies from a tied checkpoint's embedding; its AdamW state likewise) onto those keys. Where
    this rank holds both (their stages on one rank) the second is filled after the load: returns
    (its tensor, the key it copies)."""
    keys = dict(read)
    for head, embedding in read.items():
        keys.update({f"optim.{head[6:]}.{k}": f"optim.{embedding[6:]}.{k}" for k in ("step", *_ADAM_KEYS)})
    after = []
    for key, source in keys.items():
        if key in state:
            value = state.pop(key)
            if source in state:
                after.append((value, source))
            else:
                state[source] = value
    return after


def _copy_after(state: Mapping[str, Any], after: list[tuple[torch.Tensor, str]]) -> None:
    """Fill each of `_read_copies`' `after` from its source, loaded; a source `load` left out (AdamW
    state the checkpoint lacks: a parameter saved frozen, zeroed as fresh) leaves its copy fresh too."""
    with torch.no_grad():
        for value, source in after:
            if source in state:
                value.copy_(state[source])
            else:
                value.zero_()


def load(path: str, model: MimoModel, optimizer: MimoOptimizer,
         expected: Mapping[str, tuple[int, ...]], verified: bool = False,
         check: Callable[[dict[str, Any]], None] | None = None,
         warn: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Load the checkpoint at `path` into this rank's shards of `model` and `optimizer`, whatever
    layout it was saved under; returns the trainer state. Call on every rank.

    Before DCP's collectives, one small all-gather makes every rank agree: if any rank cannot
    read the checkpoint, finds it mismatched or corrupt (`verify`, skipped when `verified`), or
    chose another path (e.g. a file system that is not shared), all of them raise instead of
    leaving the others waiting in `dcp.load`. `check`: called with the saved trainer state,
    read alone before the weights and optimizer state are, to refuse it early (it must reach the
    same verdict on every rank). `warn` (default `warn_once`: rank 0's): told, in one line, the
    persistent buffers of `expected` the checkpoint lacks (saved before checkpoints held
    buffers), which keep the model's values.

    A module built on the meta device and not initialized since (``model.uninitialized``) is
    refused, on every rank before DCP's collectives, when it has buffers no checkpoint holds (its
    non-persistent ones, or persistent ones this checkpoint lacks): they would stay uninitialized
    memory; call ``model.init_weights`` first (the module's own rebuilds them)."""
    meta, absent, read = _agree_to_load(path, model, expected, verified)
    saved = {"trainer": ""}
    dcp.load(saved, checkpoint_id=path)  # one small object, read alike on every rank before the state
    trainer = json.loads(saved["trainer"])
    if "updates" not in trainer:
        raise CheckpointError(f"checkpoint {path} holds no optimizer update count (written by an earlier release "
                              "through checkpoint.save without trainer['updates']): the learning-rate schedule's "
                              "position is unknown; save it with trainer={'updates': n, ...}, n the updates "
                              "applied before it")
    if check is not None:
        check(trainer)
    state = _model_keys(path, model, meta, absent, warn)
    state.update(_optimizer_keys(model, optimizer, init=True))
    after = _read_copies(state, read)
    state.update(_rng_states(model.device))
    world = dist.get_world_size()
    for rng in _rng_states(model.device):
        if rng not in meta or f"rng.{world - 1}" not in meta or f"rng.{world}" in meta:
            del state[rng]  # saved under another world size or on another device: keep this rank's own
    missing_optim = [k for k in state if k.startswith("optim.") and k not in meta]
    for k in missing_optim:  # saved before that parameter trained (e.g. frozen then): fresh state,
        state.pop(k).zero_()  # also where this optimizer already stepped it (step 0, zero moments)
    dcp.load(state, checkpoint_id=path)  # in place: parameters, AdamW state; the rest replaced
    _copy_after(state, after)
    _loaded(model)
    _set_rng_states(state, model.device)
    optimizer.set_updates(trainer["updates"])
    return trainer


def _model_keys(path: str, model: MimoModel, meta: Mapping[str, Any], absent: list[str],
                warn: Callable[[str], None] | None) -> dict[str, Any]:
    """What a load reads of `model`, this rank's shards resharded first (the next forward gathers
    the loaded shards, not what a predict left gathered): its parameters, and the buffers it holds
    that the checkpoint has (every replica reads its own; those in `absent` keep their values,
    told to `warn` in one line)."""
    if absent:
        (warn or warn_once)(f"checkpoint {path} holds no {_short(absent)} (saved before checkpoints held "
                                "buffers): they keep the model's current values")
    model.reshard()
    state = _parameter_keys(model)
    state.update({k: v for k, v in _buffer_keys(model, saving=False).items() if k in meta})
    return state


def _loaded(model: MimoModel) -> None:
    """After DCP wrote a load's parameters and buffers in place."""
    model.uninitialized.clear()  # every parameter and buffer came from the checkpoint (`unbuilt`, `blank`)
    model.refresh_fp8_scales()


def load_model(path: str, model: MimoModel, expected: Mapping[str, tuple[int, ...]], verified: bool = False,
               warn: Callable[[str], None] | None = None) -> None:
    """Load only the model's parameters and persistent buffers of the checkpoint at `path` into
    this rank's shards of `model`, whatever layout it was saved under (the trainer's
    ``checkpoint.load_model_only``: a weights-only start, torchtitan's ``initial_load_model_only``).
    The optimizer's state, the trainer state (step, updates, data position) and the RNG states
    are not read: they stay this run's own, so a checkpoint of other data, another optimizer or
    other frozen modules loads. Call on every rank; the same checks as `load` (a module the
    checkpoint lacks is named), agreed by every rank before DCP's collective."""
    meta, absent, read = _agree_to_load(path, model, expected, verified)
    state = _model_keys(path, model, meta, absent, warn)
    after = _read_copies(state, read)
    dcp.load(state, checkpoint_id=path)  # in place, each rank its slices
    _copy_after(state, after)
    _loaded(model)
