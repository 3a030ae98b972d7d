"""Profiles measured on this machine: module forward/backward times, activation bytes, a gloo link,
AdamW; cached in a JSON file keyed by what was measured.

Modules are timed as the trainer runs them, after `dtensor_mimo.parallelize.parallelize` (activation
checkpointing, mixed precision) on no mesh, but eagerly (uncompiled), with one intra-op thread (the trainer's `train.threads`
default): a compiled block is faster per call, which the profile does not see. Every compute time
is the fastest of a few repetitions after a warm-up (other processes' load only adds), at a few
token counts, fitted by `Affine.fit`; link times are medians (waiting for a peer is the point).

- `time_module`: the whole module's forward and backward at a few batch sizes, then the same
  with its blocks removed (``layers`` emptied): the rest (embeddings, head and loss, patch
  embedding, projection); a block is the difference over the number of blocks.
- `saved_bytes`: bytes autograd keeps for backward (`torch.autograd.graph.saved_tensors_hooks`),
  each storage counted once.
- `measure_link`: a gloo send/recv ping-pong between two local processes, fitted to
  ``latency + bytes / bandwidth``.
- `measure_optimizer`: AdamW's step over n parameters (foreach), fitted to ``fixed + per param``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from dtensor_mimo.parallelize.part import blocks, stacks
from dtensor_mimo.plan.profile import Affine, Link

CACHE_DIR = Path(os.environ.get("DTENSOR_MIMO_CACHE", Path.home() / ".cache" / "dtensor_mimo"))
"""Where measured profiles are cached (``DTENSOR_MIMO_CACHE`` overrides)."""


# ---------------------------------------------------------------------------- cache


def cache_key(description: Any) -> str:
    """A short hash of a JSON-able description of what is measured (and of the machine)."""
    machine = {"torch": torch.__version__, "host": socket.gethostname(), "threads": torch.get_num_threads(),
               "cpus": os.cpu_count(), "version": 3}
    text = json.dumps({"what": description, "machine": machine}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached(path: str | Path, compute: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], bool]:
    """The JSON at `path` if it exists, else `compute()` written there; (data, came from cache)."""
    path = Path(path)
    if path.exists():
        with open(path) as f:
            return json.load(f), True
    data = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    tmp.replace(path)
    return data, False


# ---------------------------------------------------------------------------- timing


def _fastest_time(fn: Callable[[], Any], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def block_stack(module: nn.Module) -> nn.Module | None:
    """The stack of `module` that holds its blocks (`dtensor_mimo.parallelize.part.stacks`): the
    tower of an encoder, the decoder itself; None without blocks."""
    return next((stack for stack in stacks(module) if blocks(stack) is not None), None)


def module_blocks(module: nn.Module) -> nn.ModuleDict:
    """The blocks of `module` (empty without)."""
    stack = block_stack(module)
    return blocks(stack) if stack is not None else nn.ModuleDict()


@contextlib.contextmanager
def _blocks_removed(module: nn.Module):
    """`module` with its block stack's ``layers`` emptied for the duration."""
    owner = block_stack(module)
    if owner is None:
        yield
        return
    layers = owner.layers
    owner.layers = nn.ModuleDict()
    try:
        yield
    finally:
        owner.layers = layers


def _forward_backward(module: nn.Module, inputs: torch.Tensor) -> tuple[float, float]:
    """One forward and one backward (of the output's sum), seconds each."""
    t0 = time.perf_counter()
    out = module(inputs)
    t1 = time.perf_counter()
    if out.requires_grad:
        out.float().sum().backward()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def time_module(module: nn.Module, make_inputs: Callable[[int], tuple[torch.Tensor, int]],
                sizes: Sequence[int], reps: int = 9) -> dict[str, Affine]:
    """Fitted ``block_forward``, ``block_backward``, ``rest_forward``, ``rest_backward``.

    `make_inputs(n)` gives an input of n samples (rows or items) and the tokens it holds. The
    whole module and the module without blocks are timed alternately, and each point is the
    fastest of `reps`: on a machine other processes load, the fastest run is the module's own
    cost, the others carry someone else's.
    """
    n_layers = len(module_blocks(module))
    points: dict[str, list[tuple[float, float]]] = {k: [] for k in ("full_f", "full_b", "rest_f", "rest_b")}
    for n in sizes:
        inputs, tokens = make_inputs(n)
        samples: dict[str, list[tuple[float, float]]] = {"full": [], "rest": []}
        for i in range(reps + 1):
            for tag in ("full", "rest"):
                with (contextlib.nullcontext() if tag == "full" else _blocks_removed(module)):
                    t = _forward_backward(module, inputs)
                    module.zero_grad(set_to_none=True)
                if i:  # the first is a warm-up
                    samples[tag].append(t)
        for tag in ("full", "rest"):
            points[f"{tag}_f"].append((tokens, min(s[0] for s in samples[tag])))
            points[f"{tag}_b"].append((tokens, min(s[1] for s in samples[tag])))
    rest_f, rest_b = Affine.fit(points["rest_f"]), Affine.fit(points["rest_b"])
    out = {"rest_forward": rest_f, "rest_backward": rest_b}
    for kind, rest in (("f", points["rest_f"]), ("b", points["rest_b"])):
        diff = [(t, max(0.0, full - r) / max(1, n_layers))
                for (t, full), (_, r) in zip(points[f"full_{kind}"], rest)]
        out["block_forward" if kind == "f" else "block_backward"] = Affine.fit(diff)
    return out


def saved_bytes(module: nn.Module, inputs: torch.Tensor) -> int:
    """Bytes autograd saves for backward in one forward of `module` (each storage once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
            try:
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):
                pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(inputs)
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    del out
    return sum(b for ptr, b in seen.items() if ptr not in params)


def activation_bytes_per_token(module: nn.Module, inputs: torch.Tensor, tokens: int) -> float:
    """Bytes one block keeps for backward per token: (whole - without blocks) / blocks / tokens."""
    n_layers = len(module_blocks(module))
    full = saved_bytes(module, inputs)
    with _blocks_removed(module):
        rest = saved_bytes(module, inputs)
    return max(0, full - rest) / max(1, n_layers) / max(1, tokens)


# ---------------------------------------------------------------------------- wrappers


@contextlib.contextmanager
def one_rank_mesh():
    """A one-rank gloo process group and its DeviceMesh (for timing FSDP2 and DTensor wrappers in
    this process); None when a process group already exists (then nothing is timed)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if dist.is_initialized():
        yield None
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no port: one rank
    try:
        yield DeviceMesh("cpu", [0])
    finally:
        dist.destroy_process_group()


def wrapper_overhead(module: nn.Module, inputs: torch.Tensor, wrap: Callable[[nn.Module], None],
                     reps: int = 7) -> tuple[float, float]:
    """Extra seconds per block call, forward and backward, that `wrap` (FSDP2, or DTensor tensor
    parallel, on a one-rank mesh: the per-call Python and dispatch cost, no communication) adds
    to a copy of `module`, spread over its blocks."""
    import copy

    wrapped = copy.deepcopy(module)
    wrap(wrapped)
    n_layers = max(1, len(module_blocks(module)))
    best = {}
    for name, m in (("plain", module), ("wrapped", wrapped)):
        _forward_backward(m, inputs)
        runs = [_forward_backward(m, inputs) for _ in range(reps)]
        m.zero_grad(set_to_none=True)
        best[name] = (min(r[0] for r in runs), min(r[1] for r in runs))
    return (max(0.0, best["wrapped"][0] - best["plain"][0]) / n_layers,
            max(0.0, best["wrapped"][1] - best["plain"][1]) / n_layers)


# ---------------------------------------------------------------------------- optimizer


def measure_optimizer(sizes: Sequence[int] = (10_000, 100_000, 1_000_000), reps: int = 5) -> Affine:
    """AdamW's step (foreach, as `MimoOptimizer` uses it) vs parameters, 8 tensors each."""
    points = []
    for n in sizes:
        params = [nn.Parameter(torch.randn(n // 8)) for _ in range(8)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
        points.append((n, _fastest_time(opt.step, reps, warmup=2)))
    return Affine.fit(points)


# ---------------------------------------------------------------------------- link


def _link_rank(rank: int, world: int, port: int, sizes: Sequence[int], reps: int, out) -> None:
    import torch.distributed as dist

    from dtensor_mimo.layout.world import init_distributed, local_rank_env

    torch.set_num_threads(1)
    local_rank_env(rank, world, port)
    init_distributed("cpu")
    peer = rank ^ 1  # pairs (0, 1), (2, 3), ... ping-pong at the same time
    results = []
    for n in sizes:
        buf = torch.zeros(max(1, n // 4), dtype=torch.float32)
        times = []
        for i in range(reps + 2):
            dist.barrier()
            t0 = time.perf_counter()
            if peer < world:
                if rank % 2 == 0:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
            if i >= 2:
                times.append((time.perf_counter() - t0) / 2)  # one way
        results.append((buf.numel() * 4, statistics.median(times)))
    one = torch.zeros(1)
    collective = []
    for i in range(reps + 2):  # a one-element all-reduce over every process
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(one)
        if i >= 2:
            collective.append(time.perf_counter() - t0)
    if rank == 0:
        out.put((results, statistics.median(collective)))
    dist.barrier()
    dist.destroy_process_group()


def measure_link(world: int = 2, sizes: Sequence[int] = (4, 65_536, 1 << 20, 4 << 20), reps: int = 20) -> Link:
    """One-way gloo send/recv between local processes: latency and bandwidth (bytes/s), and the
    extra cost of each step of a collective over all of them (`Link.collective_s`).

    `world` processes run at once, ping-ponging in pairs, so that on a host with fewer cores than
    ranks the latency includes waiting for the peer to be scheduled, as in a real step.
    """
    import torch.multiprocessing as mp

    from dtensor_mimo.layout.world import hold_store

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    world = max(2, world)
    store = hold_store(world)  # served until the ranks end
    mp.start_processes(_link_rank, args=(world, store.port, list(sizes), reps, queue), nprocs=world,
                       start_method="spawn")
    results, allreduce = queue.get()
    points = sorted(results)
    # The smallest message is the latency; the bandwidth is the slope between the smallest and the
    # largest (a least-squares line through all of them can cross zero under noise). What a tiny
    # all-reduce over `world` processes takes beyond its ring's 2(world-1) latencies, per step, is
    # the collective wait (idle peers here; the planner fits it under load, `calibrate_collectives`).
    (n0, t0), (n1, t1) = points[0], points[-1]
    return Link(latency_s=t0, bandwidth=(n1 - n0) / (t1 - t0) if t1 > t0 else 1e12,
                collective_s=max(0.0, allreduce / (2 * (world - 1)) - t0))
