"""Joining and leaving the process group: a timeout, restarts under torchrun, failing fast.

`init_distributed` is what the trainer calls, and what a user of the library calls in place of
``dist.init_process_group()``:

- **Restarts.** ``torchrun --max-restarts=N`` keeps one TCPStore (its rendezvous store) for every
  round of workers, and ``init_process_group("env://")`` connects to it without a per-round
  prefix (torch's ``_create_c10d_store``: "We create a new TCPStore for every retry", which is no
  longer true since the rendezvous store is shared). gloo's full-mesh connect then reads the
  previous round's addresses and fails ("connectFullMesh failed ... Connection refused") or
  hangs. Prefixing the store with ``TORCHELASTIC_RESTART_COUNT`` gives each round its own keys.
- **Local ranks started by a process of the library** (the own launcher, the planner's measuring
  runs): that process binds the world's store before starting them and serves it until they end
  (`hold_store`); they connect as clients (`local_rank_env`). A free port chosen for rank 0 to
  bind seconds later could be taken meanwhile, and env:// under a torchrun worker would make
  every one of them a client of torchrun's store.
- **Timeout.** ``timeout_s`` bounds how long a rank waits for a peer in the default group (the
  bridge's exchanges and the step's all-reduce run there) and in the modules' mesh groups (FSDP,
  tp, cp, pp): ``new_group`` would take torch's own default (30 minutes), so
  `dtensor_mimo.layout.mesh` builds each mesh with a ``backend_override`` carrying the default
  group's timeout (measured, torch 2.13: tests/test_faults.py).
- **NCCL.** ``device_id`` binds this rank's GPU at init: the world's communicator is created
  eagerly and DeviceMesh splits its groups from it (``ncclCommSplit``); see
  `dtensor_mimo.layout.mesh.ModuleMeshes._first_collectives` for torch's rule on a group's first
  batched point-to-point.
- **Failing fast.** `abort` after an exception: NCCL communicators are aborted (a peer's pending
  collective errors at once instead of waiting for the timeout); gloo's connections close, which
  a peer's next wait sees as "Connection closed by peer".
"""

from __future__ import annotations

import datetime
import math
import os
import warnings

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0


def warn_once(message: str, category: type[Warning] = UserWarning, stacklevel: int = 2) -> None:
    """`warnings.warn` of what every rank finds alike (a config read, a model cut into stages), on
    one rank: rank 0 of the default process group, or before one is joined of a torchrun world
    (``RANK``); a single process warns. At 1,000 ranks the log holds it once, not 1,000 times."""
    first = dist.get_rank() == 0 if dist.is_available() and dist.is_initialized() else \
        os.environ.get("RANK", "0") == "0"
    if first:
        warnings.warn(message, category, stacklevel=stacklevel + 1)


def check_device_type(device: str, where: str) -> None:
    """Refuse (ValueError naming `where`) a device word other than "cpu" (gloo) or "cuda" (NCCL):
    a typo ("nccl", "cuda:0", "gpu") would otherwise run on gloo, or fail inside torch."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"{where}={device!r} is not 'cpu' (gloo) or 'cuda' (NCCL; each rank's GPU is its "
                         "LOCAL_RANK, set as the current device)")


def init_distributed(device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Initialise the default process group from torchrun's (or the own launcher's) environment.

    ``device``: "cpu" (gloo) or "cuda" (NCCL; this rank's GPU is ``LOCAL_RANK``, bound eagerly).
    ``timeout_s``: seconds a collective waits for a peer before it fails.
    Under ``torchrun --max-restarts=N`` each round of workers gets its own keys in the shared
    rendezvous store, so a restarted world connects instead of finding the dead round's ranks.
    """
    check_device_type(device, "init_distributed: device")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        # a string (a config's, an environment variable's) or None: named, not a comparison's TypeError
        raise ValueError(f"init_distributed: timeout_s={timeout_s!r}: give a positive, finite number of seconds "
                         "(e.g. 600)")
    timeout = datetime.timedelta(seconds=timeout_s)
    backend, device_id = "gloo", None
    if device == "cuda":
        if ("LOCAL_RANK" not in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
                and torch.cuda.device_count() > 1):
            # (one visible GPU a rank, e.g. srun --gpus-per-task=1: GPU 0 is its own) every rank of
            # such a launch lacks it alike: all refuse, none joins a group
            raise ValueError(f"init_distributed: device='cuda' in a world of {os.environ['WORLD_SIZE']} ranks without "
                             "LOCAL_RANK: every rank of a node would take GPU 0; launch with torchrun (it sets "
                             "LOCAL_RANK) or set LOCAL_RANK to each rank's GPU on its node")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        backend, device_id = "nccl", torch.device("cuda", local)
    store = held_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
    else:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout, device_id=device_id)


LAUNCHER_STORE = "DTENSOR_MIMO_LAUNCHER_STORE"
"""Set to 1 (`local_rank_env`) for ranks that a process of this library starts on its host (the
own launcher's, the planner's): the store at MASTER_ADDR:MASTER_PORT is that process's
(`hold_store`), bound before any rank started; each rank connects to it as a client."""


def hold_store(world: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """The rendezvous store of `world` local ranks this process is about to start: bound now on a
    free port (its ``.port``) and served for as long as the returned object lives, so keep it
    until the ranks end. A port only chosen here and bound by rank 0 seconds later (after its
    imports) could be taken by another process meanwhile. Each rank then calls `local_rank_env`
    and `init_distributed`."""
    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def local_rank_env(rank: int, world: int, port: int) -> None:
    """This process's environment as rank `rank` of `world` local ranks whose store (`hold_store`)
    listens on `port`: what `init_distributed` reads."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), **{LAUNCHER_STORE: "1"})


def held_store(timeout: datetime.timedelta) -> dist.Store | None:
    """A client of the rendezvous store that another process holds: the one of the process that
    started this rank (`LAUNCHER_STORE`; first, so that ranks a torchrun worker starts do not take
    torchrun's), or torchrun's shared agent store (with this restart round's key prefix);
    otherwise None (``env://`` is then right: rank 0 makes a fresh store)."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    own = os.environ.get(LAUNCHER_STORE) == "1"
    agent = not own and restart is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    if not own and not agent:
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"dtensor_mimo/restart_{restart}", client) if agent else client


def abort() -> None:
    """Tear this rank's process groups down after an error, without waiting for peers: NCCL
    aborts its communicators (peers' collectives fail instead of hanging); gloo closes its
    connections (peers' next wait fails). Safe to call when nothing is initialised."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        # Experimental in torch 2.13 (no public spelling); destroy alone could block on a hung kernel.
        dist.distributed_c10d._abort_process_group()
        return
    dist.destroy_process_group()
