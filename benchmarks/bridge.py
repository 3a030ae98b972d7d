"""Time the bridge's cross-mesh `redistribute` against two baselines, on 8 ranks (or 2).

    torchrun --standalone --nproc-per-node=8 benchmarks/bridge.py [--out bench_results/bridge.json]
        [--sizes-mib 0.25 4 64] [--iters N] [--warmup N] [--hidden 4096] [--cases NAME ...] [--quick] [--profile]

Target (issue 8): `redistribute` with its default arguments within 1.1x of the one-hop point-to-point
floor at 4 and 64 MiB, forward and backward, and faster than all-gather.

Cases: a [T, H] fp32 tensor, Shard(0) on dp and Replicate() on tp on both sides (meshes are
(dp, tp), ranks row-major from the first rank given). T is chosen so that one destination
rank holds `size` MiB (the payload per destination replica):

| case      | source                   | destination              |
|-----------|--------------------------|--------------------------|
| fan-in    | dp4 (ranks 0-3)          | tp2·dp1 (ranks 4-5)      |
| fan-out   | dp1 (rank 0)             | dp4 (ranks 4-7)          |
| tp change | tp2·dp2 (ranks 0-3)      | tp4·dp1 (ranks 4-7)      |
| colocated | tp2·dp4 (ranks 0-7)      | tp4·dp2 (ranks 0-7)      |
| pair      | dp1 (rank 0)             | dp1 (rank 1)             |

With --nproc-per-node=2 only "pair" runs: on a 2-core machine that is the one layout where every
rank has a core of its own, so the per-call Python of each rank does not queue behind the others'.

Methods, interleaved within every iteration (the order rotates each iteration):

- redistribute / redistribute hops=1 / redistribute check=False: `dtensor_mimo.bridge.redistribute`
  forward with its default arguments (the shape check is a status word riding with the
  messages, no collective; one hop on one node, two hops across nodes where the destination
  replicates), forced one-hop, and with no check; backward is the `torch.autograd.backward` call (destination
  ranks pass their gradient rows, other ranks zeros, as the API asks).
- floor: the plan's own messages (`plan(...).for_rank`, `plan_backward(...)`) posted with one
  `dist.batch_isend_irecv` into preallocated buffers, the plan's local copies done while they
  fly; no DTensor, no allocation, no validation. Nothing correct can move fewer bytes.
- all-gather: no planner. Forward: every rank pads its source rows to the largest source
  shard, `all_gather_single` over the world, and each destination rank copies its rows out.
  Where that buffer would exceed --ag-cap-mib per rank (fan-out at 64 MiB: 8 x 256 MiB), one
  `broadcast` per distinct source shard replaces it (an all-gather-v, labelled
  "all-gather(bcast)"; it moves fewer bytes). Backward: one replica of each destination shard
  writes its gradient rows into a zeroed [T, H] buffer, `all_reduce` (sum) over the world,
  source ranks copy their rows out.
- with --profile, also floor+alloc: the floor with a freshly allocated output and freshly
  built ops on every call, as `redistribute` must do; and the wall time of `redistribute`'s
  phases (prepared-call lookup, shape check, exchange start and wait, DTensor wrapping, the rest).

Timing: a barrier before every timed op; an op's time is the max over ranks of its wall time;
table times are medians over --iters. "x floor" / "x all-gather" are medians of per-iteration
ratios against the baseline timed in the same iteration and direction (the machine may be
shared, so only same-iteration ratios compare). "moved" is the sum over ranks of bytes sent:
exact for the plan's messages (local copies excluded), the ring algorithm's count for
all-gather and all-reduce, (W-1) x shard for a broadcast. "p10-p90" is the spread of the
per-iteration times. "CPU ms" is the main-thread CPU time of the op summed over all ranks
(median): where ranks outnumber cores (8 ranks on 2 CPU cores), every rank's per-call Python
runs on the same cores as the transfers, so the wall-time ratio follows this sum (on GPU it
misses the autograd device thread's share of a backward). Every method's values are checked
once, after warm-up.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from dtensor_mimo.bridge import (MeshSpec, RankPlan, backward_specs, exchange, hop_rows, plan, plan_backward,
                                 redistribute)
from dtensor_mimo.bridge.hops import default_hops
from dtensor_mimo.layout.torch_compat import all_gather_single

# The package re-exports the function `redistribute` under the submodule's name: fetch the module itself.
redistribute_module = importlib.import_module("dtensor_mimo.bridge.redistribute")

PLACEMENTS = (Shard(0), Replicate())  # on (dp, tp)
TARGET_FLOOR_RATIO = 1.1
TARGET_SIZE_MIB = 4
METHODS = ("redistribute", "redistribute hops=1", "redistribute check=False", "floor", "all-gather")


@dataclass(frozen=True)
class Side:
    first_rank: int
    dp: int
    tp: int

    def mesh(self, device_type: str) -> DeviceMesh:
        ranks = torch.arange(self.first_rank, self.first_rank + self.dp * self.tp).reshape(self.dp, self.tp)
        return DeviceMesh(device_type, ranks, mesh_dim_names=("dp", "tp"))

    def __str__(self) -> str:
        last = self.first_rank + self.dp * self.tp - 1
        where = f"rank {last}" if last == self.first_rank else f"ranks {self.first_rank}-{last}"
        return f"{f'dp{self.dp}' if self.tp == 1 else f'tp{self.tp}·dp{self.dp}'} ({where})"


@dataclass(frozen=True)
class Case:
    name: str
    src: Side
    dst: Side


CASES = (
    Case("fan-in", Side(0, 4, 1), Side(4, 1, 2)),
    Case("fan-out", Side(0, 1, 1), Side(4, 4, 1)),
    Case("tp change", Side(0, 2, 2), Side(4, 1, 4)),
    Case("colocated", Side(0, 4, 2), Side(0, 2, 4)),
    Case("pair", Side(0, 1, 1), Side(1, 1, 1)),
)


def sync() -> None:
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


CPU_LOG: list[float] = []
"""Main-thread CPU seconds of each `timed` call on this rank, in call order (`run_case` drains it)."""


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """Barrier, then this rank's wall time of `fn()` (device-synchronised) and its result; its
    main-thread CPU time goes to `CPU_LOG`."""
    sync()
    dist.barrier()
    sync()
    c0, t0 = time.thread_time(), time.perf_counter()
    out = fn()
    sync()
    wall = time.perf_counter() - t0
    CPU_LOG.append(time.thread_time() - c0)
    return wall, out


def rows(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return t.narrow(0, lo, hi - lo)


def fill_rows(lo: int, hi: int, hidden: int, device: torch.device, sign: float = 1.0) -> torch.Tensor:
    """Row r of the global tensor is sign * (r + 1): checkable without building the whole tensor."""
    v = torch.arange(lo + 1, hi + 1, dtype=torch.float32, device=device) * sign
    return v.unsqueeze(1).expand(hi - lo, hidden).contiguous()


def first_holders(spec: MeshSpec) -> dict[int, tuple[int, int]]:
    """The first rank (mesh order) holding each distinct non-empty row range of a side -> its rows."""
    out: dict[int, tuple[int, int]] = {}
    for r in spec.ranks:
        lo, hi = spec.local_range(r)
        if hi > lo and (lo, hi) not in out.values():
            out[r] = (lo, hi)
    return out


def p2p(rp: RankPlan, src: torch.Tensor | None, out: torch.Tensor | None):
    """A rank plan's messages as P2POps and its local copies as (target, piece) pairs."""
    ops = [dist.P2POp(dist.isend, rows(src, s.lo, s.hi), s.peer) for s in rp.sends]
    ops += [dist.P2POp(dist.irecv, rows(out, r.lo, r.hi), r.peer) for r in rp.recvs]
    return ops, [(rows(out, c.dst_lo, c.dst_hi), rows(src, c.src_lo, c.src_hi)) for c in rp.copies]


def run_p2p(ops: list[dist.P2POp], copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    works = dist.batch_isend_irecv(ops) if ops else []
    for target, piece in copies:
        target.copy_(piece)
    for w in works:
        w.wait()  # once: on gloo a second wait blocks


class Phases:
    """Wall time of `redistribute`'s phases on this rank, by wrapping the library's functions at
    run time (the library is not edited). "other" is the op's time minus the phases: argument
    handling, MeshSpec building, autograd and DTensor dispatch."""

    WRAPPED = ((redistribute_module, "_prepare", "prepare (cached)"),
               (redistribute_module, "_raise_bad_shards", "shape check"),
               (redistribute_module._hops, "scatter", "two-hop scatter"),
               (redistribute_module._hops, "gather", "two-hop gather"),
               (exchange, "start", "exchange start (alloc, copies, post)"),
               (exchange.Pending, "wait", "exchange wait"), (redistribute_module._Trip, "wrap", "DTensor wrap"))

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self.direction: str | None = None  # set while a redistribute forward / backward is timed
        for owner, name, phase in self.WRAPPED:
            setattr(owner, name, self._timing(getattr(owner, name), phase))

    def _timing(self, fn: Callable, phase: str) -> Callable:
        def wrapper(*args, **kwargs):
            if self.direction is None:
                return fn(*args, **kwargs)
            sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            self.acc[f"{self.direction} {phase}"] += time.perf_counter() - t0
            return out
        return wrapper

    def take(self, tf: float, tb: float) -> dict[str, float]:
        out, self.acc = dict(self.acc), defaultdict(float)
        for d, total in (("fwd", tf), ("bwd", tb)):
            out[f"{d} other"] = total - sum(v for k, v in out.items() if k.startswith(d + " "))
        return out


class Bench:
    """Every method of one case at one size, set up on this rank."""

    def __init__(self, case: Case, size_mib: float, hidden: int, device: torch.device, ag_cap_mib: float) -> None:
        self.rank, W = dist.get_rank(), dist.get_world_size()
        self.case, self.hidden, self.device = case, hidden, device
        self.row_bytes = hidden * 4
        self.T = T = max(1, round(size_mib * 2**20 / self.row_bytes)) * case.dst.dp
        self.src_mesh, self.dst_mesh = case.src.mesh(device.type), case.dst.mesh(device.type)
        self.in_src = self.src_mesh.get_coordinate() is not None
        self.in_dst = self.dst_mesh.get_coordinate() is not None
        src = MeshSpec.from_device_mesh(self.src_mesh, PLACEMENTS, T, name="encoder")
        dst = MeshSpec.from_device_mesh(self.dst_mesh, PLACEMENTS, T, name="llm")
        self.fwd_plan, self.bwd_plan = plan(src, dst, W), plan_backward(src, dst, PLACEMENTS, W)
        # The default route's rows (two-hop where the destination replicates), between and inside the meshes
        self.default_rows = {d: sum(hop_rows(a, b, default_hops(a, b, W)).values())
                             for d, (a, b) in (("fwd", (src, dst)), ("bwd", backward_specs(src, dst, PLACEMENTS)))}
        self.src_lo, self.src_hi = src.local_range(self.rank)
        self.dst_lo, self.dst_hi = dst.local_range(self.rank)

        # Fixed inputs: the source rows and, on the destination, the gradient rows. Off the source
        # mesh, DTensor's empty local shard torch.empty(0): the bridge's backward returns that shape there.
        self.x_local = fill_rows(self.src_lo, self.src_hi, hidden, device) if self.in_src else \
            torch.empty(0, device=device)
        self.g_local = fill_rows(self.dst_lo, self.dst_hi, hidden, device, -1.0) if self.in_dst else None

        # floor: preallocated (and first-touched) buffers, prebuilt ops
        self.floor_out, self.floor_gx = self.out_buffers(torch.zeros)
        self.floor_fwd = p2p(self.fwd_plan.for_rank(self.rank), self.x_local, self.floor_out)
        self.floor_bwd = p2p(self.bwd_plan.for_rank(self.rank), self.g_local, self.floor_gx)

        # all-gather: one replica of each distinct source shard contributes its rows
        holders = first_holders(src)
        block = max(hi - lo for lo, hi in holders.values())
        self.ag_padded = W * block * self.row_bytes <= ag_cap_mib * 2**20
        self.ag_label = "all-gather" if self.ag_padded else "all-gather(bcast)"
        self.ag_out, self.ag_gx = self.out_buffers(torch.zeros)
        self.ag_full = torch.zeros(T, hidden, device=device)  # bcast target; the backward's all-reduce buffer
        self.ag_pieces = []  # (rows of ag_out, rows of the gathered buffer)
        if self.ag_padded:
            self.ag_gathered = torch.zeros(W * block, hidden, device=device)
            local = self.src_hi - self.src_lo
            self.ag_send = self.x_local if local == block else torch.zeros(block, hidden, device=device)
            self.ag_pad = self.in_src and 0 < local < block
            for r, (lo, hi) in holders.items():
                a, b = max(lo, self.dst_lo), min(hi, self.dst_hi)
                if self.in_dst and a < b:
                    self.ag_pieces.append((rows(self.ag_out, a - self.dst_lo, b - self.dst_lo),
                                           rows(self.ag_gathered, r * block + a - lo, r * block + b - lo)))
            self.ag_fwd_bytes = W * (W - 1) * block * self.row_bytes
        else:
            self.ag_shards = sorted((lo, hi, r) for r, (lo, hi) in holders.items())
            if self.in_dst:
                self.ag_pieces.append((self.ag_out, rows(self.ag_full, self.dst_lo, self.dst_hi)))
            self.ag_fwd_bytes = sum((W - 1) * (hi - lo) for lo, hi, _ in self.ag_shards) * self.row_bytes
        self.ag_contributes = self.rank in first_holders(dst)
        self.ag_bwd_bytes = 2 * (W - 1) * T * self.row_bytes

    def out_buffers(self, alloc: Callable) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(forward output on a destination rank, source gradient on a source rank), else None."""
        H, dev = self.hidden, self.device
        return (alloc(self.dst_hi - self.dst_lo, H, device=dev) if self.in_dst else None,
                alloc(self.src_hi - self.src_lo, H, device=dev) if self.in_src else None)

    def _ag_forward(self) -> None:
        if self.ag_padded:
            if self.ag_pad:
                rows(self.ag_send, 0, self.src_hi - self.src_lo).copy_(self.x_local)
            all_gather_single(self.ag_gathered, self.ag_send)
        else:
            for lo, hi, root in self.ag_shards:
                if root == self.rank:
                    rows(self.ag_full, lo, hi).copy_(self.x_local)
                dist.broadcast(rows(self.ag_full, lo, hi), src=root)
        for target, piece in self.ag_pieces:
            target.copy_(piece)

    def _ag_backward(self) -> None:
        self.ag_full.zero_()
        if self.ag_contributes:
            rows(self.ag_full, self.dst_lo, self.dst_hi).copy_(self.g_local)
        dist.all_reduce(self.ag_full)
        if self.in_src:
            self.ag_gx.copy_(rows(self.ag_full, self.src_lo, self.src_hi))

    def _floor_fresh(self, p, src: torch.Tensor | None, fwd: bool) -> torch.Tensor | None:
        out = self.out_buffers(torch.empty)[0 if fwd else 1]
        run_p2p(*p2p(p.for_rank(self.rank), src, out))
        return out

    def run(self, method: str, phases: Phases | None = None):
        """Time `method` forward then backward: (fwd s, bwd s, output rows here, source-gradient rows here)."""
        if method == "floor":
            tf, _ = timed(lambda: run_p2p(*self.floor_fwd))
            tb, _ = timed(lambda: run_p2p(*self.floor_bwd))
            return tf, tb, self.floor_out, self.floor_gx
        if method == "floor+alloc":
            tf, y = timed(lambda: self._floor_fresh(self.fwd_plan, self.x_local, True))
            tb, gx = timed(lambda: self._floor_fresh(self.bwd_plan, self.g_local, False))
            return tf, tb, y, gx
        if method == "all-gather":
            tf, _ = timed(self._ag_forward)
            tb, _ = timed(self._ag_backward)
            return tf, tb, self.ag_out, self.ag_gx
        x_leaf = self.x_local.detach().requires_grad_()
        x = DTensor.from_local(x_leaf, self.src_mesh, PLACEMENTS, run_check=False,
                               shape=(self.T, self.hidden), stride=(self.hidden, 1))
        if phases:
            phases.direction = "fwd"
        tf, y = timed(lambda: redistribute(x, self.dst_mesh, PLACEMENTS, check=method != "redistribute check=False",
                                           hops=1 if method == "redistribute hops=1" else None))
        y_local = y.to_local() if self.in_dst else y
        grad = self.g_local if self.in_dst else torch.zeros_like(y)
        if phases:
            phases.direction = "bwd"
        tb, _ = timed(lambda: torch.autograd.backward([y_local], [grad]))
        if phases:
            phases.direction = None
        return tf, tb, y_local.detach() if self.in_dst else None, x_leaf.grad if self.in_src else None

    def check(self, method: str, y: torch.Tensor | None, gx: torch.Tensor | None) -> None:
        """Every rank agrees whether `method` produced the expected output rows and gradient rows."""
        H, dev, ok = self.hidden, self.device, True
        if self.in_dst:
            ok &= y is not None and torch.equal(y, fill_rows(self.dst_lo, self.dst_hi, H, dev))
        if self.in_src and self.src_hi > self.src_lo:
            ok &= gx is not None and torch.equal(gx, fill_rows(self.src_lo, self.src_hi, H, dev, -1.0))
        bad = torch.tensor([int(not ok)], device=self.device)
        dist.all_reduce(bad)
        if bad.item():
            raise AssertionError(f"{self.case.name}: method {method!r} gave wrong values on {bad.item()} rank(s)")

    def bytes_moved(self, method: str, direction: str) -> int:
        if method == "all-gather":
            return self.ag_fwd_bytes if direction == "fwd" else self.ag_bwd_bytes
        if method in ("redistribute", "redistribute check=False"):
            return self.default_rows[direction] * self.row_bytes
        p = self.fwd_plan if direction == "fwd" else self.bwd_plan
        return p.stats()["rows_sent"] * self.row_bytes


def quantile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def over_ranks(series: dict, device: torch.device, op=dist.ReduceOp.MAX) -> dict:
    """{key: [seconds per iteration]} -> the same with each value reduced over ranks (max, or sum)."""
    keys = sorted(series)
    flat = torch.tensor([v for k in keys for v in series[k]], dtype=torch.float64, device=device)
    dist.all_reduce(flat, op=op)
    n = len(flat) // max(1, len(keys))
    return {k: flat[i * n:(i + 1) * n].tolist() for i, k in enumerate(keys)}


def run_case(case: Case, size_mib: float, args, methods: tuple[str, ...], device: torch.device,
             iters: int, warmup: int, phases: Phases | None) -> dict:
    bench = Bench(case, size_mib, args.hidden, device, args.ag_cap_mib)
    local: dict[tuple[str, str], list[float]] = defaultdict(list)
    cpu: dict[tuple[str, str], list[float]] = defaultdict(list)
    prof: dict[str, list[float]] = defaultdict(list)
    for it in range(warmup + iters):
        k = it % len(methods)
        for method in methods[k:] + methods[:k]:
            CPU_LOG.clear()
            tf, tb, y, gx = bench.run(method, phases if method == "redistribute" else None)
            cf, cb = CPU_LOG
            if it == max(warmup - 1, 0):
                bench.check(method, y, gx)
            del y, gx
            if phases is not None and method == "redistribute":
                for phase, s in phases.take(tf, tb).items():
                    if it >= warmup:
                        prof[phase].append(s)
            if it >= warmup:
                local[(method, "fwd")].append(tf)
                local[(method, "bwd")].append(tb)
                cpu[(method, "fwd")].append(cf)
                cpu[(method, "bwd")].append(cb)

    times = over_ranks(local, device)
    cpu_sums = over_ranks(cpu, device, dist.ReduceOp.SUM)
    table = []
    for direction in ("fwd", "bwd"):
        for method in methods:
            ts = times[(method, direction)]
            med, moved = statistics.median(ts), bench.bytes_moved(method, direction)
            ratio = {base: statistics.median(a / b for a, b in zip(ts, times[(base, direction)]))
                     for base in ("floor", "all-gather")}
            table.append(dict(method=bench.ag_label if method == "all-gather" else method, direction=direction,
                              time_ms=med * 1e3, times_ms=[t * 1e3 for t in ts], bytes_moved=moved,
                              p10_ms=quantile(ts, 0.1) * 1e3, p90_ms=quantile(ts, 0.9) * 1e3,
                              cpu_ms_all_ranks=statistics.median(cpu_sums[(method, direction)]) * 1e3,
                              gb_per_s=moved / med / 1e9, x_floor=ratio["floor"], x_all_gather=ratio["all-gather"]))
    result = dict(case=case.name, src=str(case.src), dst=str(case.dst), size_mib=size_mib, T=bench.T,
                  hidden=args.hidden, payload_bytes_per_dst_rank=(bench.T // case.dst.dp) * bench.row_bytes,
                  iters=iters, warmup=warmup, plan_fwd=bench.fwd_plan.stats(), plan_bwd=bench.bwd_plan.stats(),
                  rows=table)
    if phases is not None:
        phase_times = over_ranks(prof, device)  # fwd phases first
        result["profile_ms"] = {k: statistics.median(phase_times[k]) * 1e3
                                for k in sorted(phase_times, key=lambda k: (k.startswith("bwd"), k))}
    del bench
    gc.collect()
    return result


def print_case(r: dict) -> None:
    pf, pb = r["plan_fwd"], r["plan_bwd"]
    print(f"\n== {r['case']}: {r['src']} -> {r['dst']}, {r['payload_bytes_per_dst_rank'] / 2**20:g} MiB per "
          f"destination rank ([{r['T']}, {r['hidden']}] fp32; plan: {pf['messages']} msgs + {pf['copies']} copies "
          f"fwd, {pb['messages']} msgs + {pb['copies']} copies bwd; median of {r['iters']})")
    head = (f"{'method':26} {'dir':>3} {'time ms':>9} {'p10-p90 ms':>12} {'CPU ms':>7} {'MiB moved':>10} "
            f"{'GB/s':>6} {'x floor':>8} {'x all-gather':>12}")
    print(head + "\n" + "-" * len(head))
    for row in r["rows"]:
        spread = f"{row['p10_ms']:.2f}-{row['p90_ms']:.2f}"
        print(f"{row['method']:26} {row['direction']:>3} {row['time_ms']:>9.2f} {spread:>12} "
              f"{row['cpu_ms_all_ranks']:>7.2f} {row['bytes_moved'] / 2**20:>10.1f} "
              f"{row['gb_per_s']:>6.2f} {row['x_floor']:>8.2f} {row['x_all_gather']:>12.2f}")
    for row in r["rows"]:
        if row["method"] == "redistribute":
            ok = row["x_floor"] <= TARGET_FLOOR_RATIO and row["x_all_gather"] < 1.0
            scope = "" if r["size_mib"] >= TARGET_SIZE_MIB else f" (target applies at {TARGET_SIZE_MIB} MiB)"
            print(f"   redistribute {row['direction']}: {row['x_floor']:.2f}x floor, {row['x_all_gather']:.2f}x "
                  f"all-gather -> {'MEETS' if ok else 'MISSES'} target{scope}")
    if "profile_ms" in r:
        print("   redistribute phases (median ms of the max over ranks):")
        for k, v in r["profile_ms"].items():
            print(f"     {k:50} {v:9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_results/bridge.json")
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=None, help="payload per destination rank")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations (default 15, 7 above 16 MiB)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed iterations first (default 2, 1 above 16 MiB)")
    ap.add_argument("--hidden", type=int, default=4096, help="H: row length (fp32)")
    ap.add_argument("--ag-cap-mib", type=float, default=512,
                    help="largest padded all-gather buffer per rank; above it all-gather uses broadcasts")
    ap.add_argument("--cases", nargs="+", default=None, choices=[c.name for c in CASES], metavar="CASE",
                    help="subset of: " + ", ".join(c.name for c in CASES))
    ap.add_argument("--quick", action="store_true", help="smoke check: 0.25 and 1 MiB, 2 iterations")
    ap.add_argument("--profile", action="store_true", help="also time floor+alloc and redistribute's phases")
    args = ap.parse_args()
    if args.quick:
        args.sizes_mib = args.sizes_mib or [0.25, 1]
        args.iters = args.iters or 2
        args.warmup = 1 if args.warmup is None else args.warmup
    sizes = args.sizes_mib or [0.25, 4, 64]

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device, backend = torch.device("cuda", torch.cuda.current_device()), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(1)  # eight ranks share the cores
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=1800))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world not in (2, 8):
        raise SystemExit(f"benchmarks/bridge.py lays out its meshes on 8 ranks (or 2 for the pair case); "
                         f"run it with --nproc-per-node=8 (got {world})")
    phases = Phases() if args.profile else None
    methods = METHODS + ("floor+alloc",) if args.profile else METHODS
    cases = [c for c in CASES if (args.cases is None or c.name in args.cases) and (c.name == "pair") == (world == 2)]

    if rank == 0:
        print(f"bridge benchmark: torch {torch.__version__}, backend {backend}, device {device.type}, world {world}")
        print(f"target: redistribute within {TARGET_FLOOR_RATIO}x of the point-to-point floor at "
              f"{TARGET_SIZE_MIB} MiB per destination rank, and faster than all-gather")
        print("times: median over iterations of the max over ranks; ratios: median of same-iteration ratios")
    t_start = time.perf_counter()
    results = []
    for size in sizes:
        iters = args.iters or (7 if size > 16 else 15)
        warmup = args.warmup if args.warmup is not None else (1 if size > 16 else 2)
        for case in cases:
            results.append(run_case(case, size, args, methods, device, iters, warmup, phases))
            if rank == 0:
                print_case(results[-1])
                sys.stdout.flush()

    if rank == 0:
        elapsed = time.perf_counter() - t_start
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        meta = dict(benchmark="bridge", torch=torch.__version__, backend=backend, device=device.type,
                    world_size=world, python=sys.version.split()[0], platform=platform.platform(),
                    cpus=os.cpu_count(), sizes_mib=sizes, hidden=args.hidden, ag_cap_mib=args.ag_cap_mib,
                    elapsed_s=elapsed, argv=sys.argv[1:], glibc_tunables=os.environ.get("GLIBC_TUNABLES"),
                    target=f"redistribute <= {TARGET_FLOOR_RATIO}x floor at {TARGET_SIZE_MIB} MiB, < 1x all-gather")
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
        print(f"\nbenchmark took {elapsed:.0f} s; wrote {args.out}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
