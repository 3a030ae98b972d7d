"""Run a function on N gloo ranks on CPU, for tests.

    from tests.harness import run_on_ranks
    results = run_on_ranks(check_something, 4, arg1, arg2, timeout=60)   # one result per rank

``fn`` must be a module-level function (it is pickled by reference). Every rank runs
``fn(*args, **kwargs)`` with the default gloo process group initialised and one
intra-op thread. Rank processes are started once and reused by every call (forked from a server
that has imported torch and the library: `PRELOAD`): a call on N ranks runs on the pool's
processes 0..N-1, starting the ones missing, and when N differs from the previous call's world
those processes leave the old default group and form a new one of N ranks (milliseconds). After
each call the ranks destroy the other groups it made (`_release_groups`). So ``fn`` must leave the
default group usable. A failure on any rank raises
`DistributedTestFailure` carrying that rank's traceback; a rank that does not finish within
``timeout`` seconds fails the test with the list of ranks still running. After a failure or a
timeout every rank process is killed (ranks may be stuck in a collective, and a group with
collectives left pending cannot be left cleanly), the results queue replaced, and the next call
starts fresh ones.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
from typing import Any, Callable

DEFAULT_TIMEOUT = float(os.environ.get("DTENSOR_MIMO_TEST_TIMEOUT", "120"))
STARTUP_TIMEOUT = 120.0  # spawning + importing torch, not counted in a call's timeout
FAILURE_GRACE_S = 3.0  # after the first failing rank, how long the others get to report


class DistributedTestFailure(AssertionError):
    """One or more ranks raised, or did not finish in time."""


def needs_torch(release: tuple[int, int], why: str) -> Any:
    """A pytest mark: skip on torch releases older than `release`, whose bug `why` the test meets.
    The suite's torch is 2.13 (what `make` installs); the GPU machines lent to this project carry 2.11,
    on which the rest of the suite passes (docs/testing.md)."""
    import pytest
    import torch

    from dtensor_mimo.layout.torch_compat import RELEASE

    return pytest.mark.skipif(RELEASE < release, reason=f"torch {torch.__version__}: {why} (needs "
                                                        f"{release[0]}.{release[1]})")


def _join(rank: int, group: tuple[int, int], current: tuple[int, int] | None) -> None:
    """Make ``group`` (world size, port) this process's default group, leaving ``current``.

    Leaving is safe: a process only ever leaves a group after a call in which every rank of it
    finished (a failed call kills its processes instead)."""
    import torch.distributed as dist

    from dtensor_mimo.layout.world import init_distributed, local_rank_env

    if current is not None:
        dist.destroy_process_group()
    world_size, port = group
    local_rank_env(rank, world_size, port)  # a client of the pool's store (`_RankPool.run`)
    init_distributed("cpu", DEFAULT_TIMEOUT)


def _release_groups() -> None:
    """Destroy every process group but the default one, after a call in which every rank finished.

    A call's meshes make groups that nothing uses afterwards, and each gloo group keeps a thread
    that wakes every 10 ms (epoll): left alone, a few hundred of them in each long-lived rank
    process took both cores of a 2-core machine by the end of the suite. Caches keyed by mesh
    contents, not identity, would then hand a new mesh of the same ranks a destroyed group's name:
    DTensor's sharding propagation (its output specs hold the mesh; torch's own C++ cache) and
    compiled graphs (traced with the names), so those are cleared too (`_clear_mesh_caches`)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    dist.barrier()  # no peer is still reading what this rank sent (every rank: members differ by group)
    extra = [pg for pg in list(_world.pg_map) if pg is not _world.default_pg]
    for pg in extra:
        dist.destroy_process_group(pg)
    if extra:
        _clear_mesh_caches()
        _collect()  # the groups' threads stop when their last reference goes


def _collect() -> None:
    """Collect the cyclic garbage made since the previous collection, then freeze what is left
    (`gc.freeze`), so that the next collection only scans the objects made after it. A plain full
    collection scans every object of torch, dynamo and transformers in the process (0.15 s at
    start-up, more as compiled graphs accumulate) after every call on every rank: it was 17% of
    the rank processes' samples in test_mimo, which now takes 0.82x the time. The groups a call
    makes are destroyed before the call ends and collected then. Garbage that was alive at a
    freeze (objects a cleared cache held) is collected by every `FULL_EVERY`-th collection,
    which scans everything: memory stays bounded."""
    import gc

    global _collections
    _collections += 1
    if _collections % FULL_EVERY == 0:
        gc.unfreeze()
    gc.collect()
    gc.freeze()


FULL_EVERY = 50
_collections = 0


def _clear_mesh_caches() -> None:
    """Empty the caches that hold meshes (so their groups) or are keyed by their contents: torch's
    C++ and Python DTensor sharding propagation, its redistribute planners, dynamo's compiled
    graphs, and the ``lru_cache``s of torch.distributed and of this library (keyed by meshes,
    plans and specs)."""
    import torch
    from torch.distributed.tensor import DTensor, _redistribute

    torch._C._clear_DTensor_sharding_propagator_cache()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _redistribute.clear_redistribute_planner_cache()  # weak keys, but values that hold the mesh
    torch._dynamo.reset()
    for name, module in list(sys.modules.items()):
        if not name.startswith(("dtensor_mimo", "torch.distributed")):
            continue
        for value in list(vars(module).values()):  # type(): some module attributes warn when read
            found = list(vars(value).values()) if issubclass(type(value), type) else [value]
            for v in found:
                v = v.__func__ if type(v) is staticmethod else v
                if type(v) is functools._lru_cache_wrapper:
                    v.cache_clear()


def _worker(rank: int, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _collect()  # start-up's objects (torch's modules) are never garbage: left out of every collection
    results.put((0, rank, True, None))  # ready: the per-call timeout starts after start-up
    current = None
    while True:
        item = tasks.get()
        if item is None:
            break
        job, group, fn, args, kwargs = item
        try:
            if group != current:
                _join(rank, group, current)
                current = group
            payload, ok = pickle.dumps(fn(*args, **kwargs)), True
        except BaseException:  # noqa: BLE001 - reported to the parent, which re-raises
            payload, ok = traceback.format_exc(), False
        results.put((job, rank, ok, payload))
        if ok:  # after reporting: a peer that hangs is then the only rank named in the failure
            _release_groups()
    if current is not None:
        dist.destroy_process_group()


PRELOAD = ["torch", "torch.distributed.tensor", "torch._dynamo", "dtensor_mimo", "dtensor_mimo.train.trainer",
           "transformers.modeling_utils", "tests.harness"]
"""What the fork server imports once, so that each rank process it forks starts with it: a spawned
rank imported torch and the library itself (2.6 s of CPU each on 2 cores, 8 of them at once for
the first 8-rank call, and again after every failed call). The server runs no tensor operation,
opens no group and holds no socket of a rank; the one idle native thread that importing torch and
transformers each start is not copied into a forked child."""


RECYCLE_THREADS = 400
"""Threads of a rank process beyond which the pool replaces its ranks after a call. torch 2.13's
ranks keep about 80 through test_mimo and test_pipeline (38 of them gloo's); torch 2.11's gloo
keeps each destroyed group's ``pt_gloo_runloop`` thread, which wakes every 10 ms: 238 of them
after 19 calls of test_mimo, 2,000 in a rank by the end of the suite, whose 1,000 runnable
threads on 2 cores left it unfinished after 50 minutes (2026-11-29)."""


def _threads(pid: int) -> int:
    """Threads of process `pid` (0 where /proc does not say: not Linux, or the process is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


class _RankPool:
    """Rank processes by position; a call on N ranks uses positions 0..N-1."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(PRELOAD)
        self.results = self.ctx.Queue()
        self.procs: list[Any] = []  # a process, or None where one was killed
        self.tasks: list[Any] = []
        self.group: tuple[int, int] | None = None  # (world size, port) that positions 0..N-1 share
        self.store: Any = None  # the group's rendezvous store (a TCPStore server on that port)
        self.job = 0

    def _spawn(self, world_size: int) -> None:
        self.procs += [None] * (world_size - len(self.procs))
        self.tasks += [None] * (world_size - len(self.tasks))
        new = [r for r in range(world_size) if self.procs[r] is None or not self.procs[r].is_alive()]
        if not new:
            return
        for r in new:
            if self.procs[r] is not None:  # died between calls: its peers' group is gone with it
                self._kill()
                return self._spawn(world_size)
            self.tasks[r] = self.ctx.Queue()
            self.procs[r] = self.ctx.Process(target=_worker, args=(r, self.tasks[r], self.results),
                                             daemon=True, name=f"rank{r}")
            self.procs[r].start()
        ready, deadline = set(), time.monotonic() + STARTUP_TIMEOUT
        while len(ready) < len(new):
            try:
                job, rank, _, _ = self.results.get(timeout=max(deadline - time.monotonic(), 0.1))
                if job == 0:
                    ready.add(rank)
            except queue.Empty:
                codes = [self.procs[r].exitcode for r in new]
                self._kill()
                raise DistributedTestFailure(
                    f"rank processes {new} did not start within {STARTUP_TIMEOUT:.0f} s (exit codes {codes})") from None

    def _kill(self) -> None:
        """Every rank, and a new results queue (the two go together: a rank left alive would still
        write to the old queue). Python's documentation warns that a process killed while it uses
        a queue may corrupt it for every other process; with only the failed call's ranks killed
        and the queue kept, a failed tp + sp call on torch 2.11 left the next calls waiting out
        `STARTUP_TIMEOUT` for ranks that had started, for the rest of the run."""
        for r, p in enumerate(self.procs):
            if p is not None:
                p.kill()
                p.join(timeout=5)
                self.procs[r] = self.tasks[r] = None
        self.results = self.ctx.Queue()
        self.group = None

    def run(self, fn: Callable, world_size: int, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        self._spawn(world_size)
        if self.group is None or self.group[0] != world_size:
            from dtensor_mimo.layout.world import hold_store

            self.store = hold_store(world_size, DEFAULT_TIMEOUT)  # held while the group lives
            self.group = (world_size, self.store.port)
        self.job += 1
        for q in self.tasks[:world_size]:
            q.put((self.job, self.group, fn, args, kwargs))
        done: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        procs = self.procs[:world_size]
        while len(done) + len(failures) < world_size:
            wait = deadline - time.monotonic()
            if wait <= 0:
                break
            try:
                job, rank, ok, payload = self.results.get(timeout=min(wait, 1.0))
            except queue.Empty:
                dead = [p.name for p in procs if not p.is_alive()]
                if dead:
                    failures.setdefault(-1, f"rank process(es) {dead} died (exit codes "
                                        f"{[p.exitcode for p in procs]})")
                    break
                continue
            if job != self.job:
                continue
            if ok:
                done[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        if failures or len(done) < world_size:
            self._kill()
            name = getattr(fn, "__qualname__", repr(fn))
            hung = sorted(set(range(world_size)) - set(done) - set(failures))
            parts = [f"{name} on {world_size} ranks:"]
            for rank in sorted(failures):
                parts.append(f"--- rank {rank} raised:\n{failures[rank]}" if rank >= 0 else failures[rank])
            if hung:
                why = "after another rank failed" if failures else f"within {timeout:.0f} s"
                parts.append(f"--- ranks {hung} did not finish {why} (hang or deadlock)")
            raise DistributedTestFailure("\n".join(parts))
        if any(_threads(p.pid) > RECYCLE_THREADS for p in procs):
            self.close()  # the next call starts fresh ranks (from the fork server: a second)
        return [done[r] for r in range(world_size)]

    def close(self) -> None:
        for p, q in zip(self.procs, self.tasks):
            if p is not None and p.is_alive():
                q.put(None)
        for p in self.procs:
            if p is not None:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
        self.procs, self.tasks, self.group = [], [], None


_pool: _RankPool | None = None
"""Made at the first call, not at import: a process that only imports this module (the fork
server, a trainer rank whose test factory lives in a test file) makes no queue, whose semaphores
it would leave behind (the resource tracker's "leaked semaphore objects" warning)."""


def run_on_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT,
                 **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result."""
    global _pool
    if _pool is None:
        _pool = _RankPool()
        atexit.register(_pool.close)
    try:
        return _pool.run(fn, world_size, args, kwargs, timeout)
    except DistributedTestFailure:
        raise
    except BaseException:  # the call cut short (pytest-timeout, ^C): ranks may be mid-job
        _pool._kill()
        raise
