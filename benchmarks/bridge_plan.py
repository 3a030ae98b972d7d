"""Time the bridge planner (`dtensor_mimo.bridge.plan`) on 16,384-rank layouts.

Plain script, one process, no process group: the planner is pure Python.

    python benchmarks/bridge_plan.py [--out bench_results/bridge_plan.json] [--repeats 3]

Cases (meshes outermost dim first, S = Shard(0), R = Replicate(), P = Partial()):
  source dp4096·tp4 (S,R) -> destination dp1024·cp2·tp8 (S,R,R), colocated on ranks 0..16383;
  the same sizes halved on disjoint halves of a 16,384-rank world; full sizes on disjoint
  16,384-rank sides (32,768-rank world); uniform rows (chunk rule) and ragged per-sample rows;
  the backward plan with a gradient Partial over cp.

Columns: spec = building both MeshSpecs from nested rank lists (as from DeviceMesh.mesh.tolist());
cold = plan() with empty caches; cached = plan() again with equal specs built anew (a cache hit);
for_rank = one rank's view (first query); all ranks = every rank's view. Best of --repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from math import prod

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from dtensor_mimo.bridge import MeshSpec, plan, plan_backward

S, R, P = Shard(0), Replicate(), Partial()
TOKENS_PER_SAMPLE = 256


def mesh(shape: tuple[int, ...], first_rank: int) -> list:
    return torch.arange(first_rank, first_rank + prod(shape)).reshape(shape).tolist()


def cases(seed: int = 0):
    rng = random.Random(seed)
    ragged = tuple(rng.randint(0, 2 * TOKENS_PER_SAMPLE) for _ in range(8192))
    src_full, dst_full = ((4096, 4), (S, R)), ((1024, 2, 8), (S, R, R))
    src_half, dst_half = ((2048, 4), (S, R)), ((512, 2, 8), (S, R, R))
    for rows, sizes in (("uniform", None), ("ragged", ragged)):
        extent = 4096 * TOKENS_PER_SAMPLE if sizes is None else sum(sizes)
        yield f"colocated, {rows}", src_full, 0, dst_full, 0, extent, sizes, None
        yield f"disjoint halves, {rows}", src_half, 0, dst_half, 8192, extent, sizes, None
        yield f"disjoint 2x16384, {rows}", src_full, 0, dst_full, 16384, extent, sizes, None
    yield "backward colocated, grad (S,P,R)", src_full, 0, dst_full, 0, 4096 * TOKENS_PER_SAMPLE, None, (S, P, R)


def best(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_results/bridge_plan.json")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    results = []
    header = f"{'case':36} {'world':>6} {'msgs':>7} {'copies':>6} {'spec s':>7} {'cold s':>7} {'cached ms':>9} {'for_rank ms':>11} {'all ranks s':>11}"
    print(header)
    print("-" * len(header))
    for name, (s_shape, s_pl), s_first, (d_shape, d_pl), d_first, extent, sizes, grad in cases():
        s_mesh, d_mesh = mesh(s_shape, s_first), mesh(d_shape, d_first)

        def specs():
            return (MeshSpec(s_mesh, s_pl, extent, sizes, name="encoder"),
                    MeshSpec(d_mesh, d_pl, extent, sizes, name="language"))

        def make(src, dst):
            return plan(src, dst) if grad is None else plan_backward(src, dst, grad)

        t_spec, (src, dst) = best(specs, args.repeats)

        t_cold = t_one = t_all = float("inf")
        for _ in range(args.repeats):  # each repeat: a fresh plan, so every view is a first query
            plan.cache_clear()
            t0 = time.perf_counter()
            p = make(src, dst)
            t1 = time.perf_counter()
            p.for_rank(p.world_size // 2)
            t2 = time.perf_counter()
            for r in range(p.world_size):
                p.for_rank(r)
            t3 = time.perf_counter()
            t_cold, t_one, t_all = min(t_cold, t1 - t0), min(t_one, t2 - t1), min(t_all, t3 - t2)
        equal = specs()  # equal to (src, dst) but other objects, as on a later step
        t_cached, _ = best(lambda: make(*equal), args.repeats)
        stats = p.stats()
        row = dict(case=name, world_size=p.world_size, extent=extent, samples=None if sizes is None else len(sizes),
                   src_shape=s_shape, src_placements=[repr(x) for x in s_pl], src_first_rank=s_first,
                   dst_shape=d_shape, dst_placements=[repr(x) for x in d_pl], dst_first_rank=d_first,
                   grad_placements=None if grad is None else [repr(x) for x in grad],
                   spec_s=t_spec, plan_cold_s=t_cold, plan_cached_s=t_cached, for_rank_s=t_one,
                   for_rank_all_s=t_all, **stats)
        results.append(row)
        print(f"{name:36} {p.world_size:>6} {stats['messages']:>7} {stats['copies']:>6} {t_spec:>7.3f} "
              f"{t_cold:>7.3f} {t_cached * 1e3:>9.2f} {t_one * 1e3:>11.3f} {t_all:>11.3f}")

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    env = dict(python=sys.version.split()[0], torch=torch.__version__, platform=platform.platform(),
               cpus=os.cpu_count(), repeats=args.repeats)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "bridge_plan", "env": env, "results": results}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
