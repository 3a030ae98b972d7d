"""Run a function on N gloo ranks on CPU, for tests.

    from tests.harness import run_on_ranks
    results = run_on_ranks(check_something, 4, arg1, arg2, timeout=60)   # one result per rank

``fn`` must be a module-level function (it is pickled by reference). Every rank runs
``fn(*args, **kwargs)`` with the default gloo process group initialised and one
intra-op thread. Rank processes are spawned once per world size and reused across
calls (spawning costs seconds on 2 cores), so ``fn`` must leave the default group
usable. A failure on any rank raises `DistributedTestFailure` carrying that rank's
traceback; a rank that does not finish within ``timeout`` seconds fails the test
with the list of ranks still running. After a failure or a timeout the pool is
killed (ranks may be stuck in a collective) and the next call spawns a fresh one.
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable

DEFAULT_TIMEOUT = float(os.environ.get("DTENSOR_MIMO_TEST_TIMEOUT", "120"))
STARTUP_TIMEOUT = 120.0  # spawning + importing torch, not counted in a call's timeout
FAILURE_GRACE_S = 3.0  # after the first failing rank, how long the others get to report
MAX_POOLS = 3  # live pools kept (each rank is a process holding torch, ~0.3 GB: 8 + 7 + 6 ranks at most)


class DistributedTestFailure(AssertionError):
    """One or more ranks raised, or did not finish in time."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT))
    results.put((0, rank, True, None))  # ready: the per-call timeout starts after start-up
    while True:
        item = tasks.get()
        if item is None:
            break
        job, fn, args, kwargs = item
        try:
            payload, ok = pickle.dumps(fn(*args, **kwargs)), True
        except BaseException:  # noqa: BLE001 - reported to the parent, which re-raises
            payload, ok = traceback.format_exc(), False
        results.put((job, rank, ok, payload))
    dist.destroy_process_group()


class _RankPool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results),
                        daemon=True, name=f"rank{r}of{world_size}")
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.job = 0
        ready, deadline = 0, time.monotonic() + STARTUP_TIMEOUT
        while ready < world_size:
            try:
                self.results.get(timeout=max(deadline - time.monotonic(), 0.1))
                ready += 1
            except queue.Empty:
                self.close(kill=True)
                raise DistributedTestFailure(
                    f"{world_size} ranks did not start within {STARTUP_TIMEOUT:.0f} s "
                    f"(exit codes {[p.exitcode for p in self.procs]})") from None

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        self.job += 1
        for q in self.tasks:
            q.put((self.job, fn, args, kwargs))
        done: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(done) + len(failures) < self.world_size:
            wait = deadline - time.monotonic()
            if wait <= 0:
                break
            try:
                job, rank, ok, payload = self.results.get(timeout=min(wait, 1.0))
            except queue.Empty:
                dead = [p.name for p in self.procs if not p.is_alive()]
                if dead:
                    failures.setdefault(-1, f"rank process(es) {dead} died (exit codes "
                                        f"{[p.exitcode for p in self.procs]})")
                    break
                continue
            if job != self.job:
                continue
            if ok:
                done[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        if failures or len(done) < self.world_size:
            self.close(kill=True)
            name = getattr(fn, "__qualname__", repr(fn))
            hung = sorted(set(range(self.world_size)) - set(done) - set(failures))
            parts = [f"{name} on {self.world_size} ranks:"]
            for rank in sorted(failures):
                parts.append(f"--- rank {rank} raised:\n{failures[rank]}" if rank >= 0 else failures[rank])
            if hung:
                why = "after another rank failed" if failures else f"within {timeout:.0f} s"
                parts.append(f"--- ranks {hung} did not finish {why} (hang or deadlock)")
            raise DistributedTestFailure("\n".join(parts))
        return [done[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        for p, q in zip(self.procs, self.tasks):
            if kill:
                p.kill()
            elif p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


_pools: dict[int, _RankPool] = {}


def run_on_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT,
                 **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result."""
    pool = _pools.pop(world_size, None)
    if pool is not None and not pool.alive():
        pool.close(kill=True)
        pool = None
    if pool is None:
        while len(_pools) >= MAX_POOLS:  # evict the least recently used
            _pools.pop(next(iter(_pools))).close()
        pool = _RankPool(world_size)
    _pools[world_size] = pool  # most recently used last
    try:
        return pool.run(fn, args, kwargs, timeout)
    except BaseException:  # a failure, or the call cut short (pytest-timeout, ^C): ranks may be mid-job
        _pools.pop(world_size, None)
        pool.close(kill=True)
        raise


@atexit.register
def _shutdown() -> None:
    for pool in _pools.values():
        pool.close()
    _pools.clear()
