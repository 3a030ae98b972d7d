"""Time the bridge planner (`dtensor_mimo.bridge.plan`) on 16,384-rank layouts, and count the
rows that one-hop and two-hop routes move between and inside the modules.

Plain script, one process, no process group: the planner is pure Python.

    python benchmarks/bridge_plan.py [--out bench_results/bridge_plan.json] [--steps 20] [--repeats 3]

Layouts (meshes outermost dim first, S = Shard(0), R = Replicate(), P = Partial()): encoder
dp4096·tp4 (S,R) -> language dp1024·cp2·tp8 (S,R,R), colocated on ranks 0..16383, halved on
the two disjoint halves of a 16,384-rank world, and full-size on disjoint 16,384-rank sides
(a 32,768-rank world); ragged per-sample rows (8,192 samples) and uniform rows (chunk rule).

1. Per-step re-plan (the bridge's hot path; target <= 2 ms per encoder per step). The specs are
   validated once; every step draws new ragged sizes, derives both sides with
   `MeshSpec.replace` and asks `plan_for_rank` for the forward and `plan_backward_for_rank` for the
   backward (gradient Partial over cp), one-hop and two-hop, on an encoder rank and a language
   rank. Median and max over --steps after a first step (shown apart: it also resolves the
   split meshes, once per run), beside the whole-world `plan()` the bridge used before
   (median of --repeats, a fresh plan each time).
2. Whole-world plan (`plan()`, O(world): statistics and tests): spec validation, a cold plan,
   one rank's view and every rank's view; best of --repeats.
3. Rows moved per step, one-hop vs two-hop (`hop_rows`): between the modules (the cross hop's
   messages) and inside each (reduce-scatter on the source, all-gather on the destination),
   for a few cluster layouts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from math import prod

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from dtensor_mimo.bridge import (MeshSpec, backward_specs, hop_rows, plan, plan_backward, plan_backward_for_rank,
                                 plan_for_rank)
from dtensor_mimo.bridge.hops import two_hop_specs

S, R, P = Shard(0), Replicate(), Partial()
TOKENS_PER_SAMPLE = 256
N_SAMPLES = 8192
GRAD = (S, P, R)  # the language model's gradient: Partial over cp


def mesh(shape: tuple[int, ...], first_rank: int) -> list:
    return torch.arange(first_rank, first_rank + prod(shape)).reshape(shape).tolist()


def ragged(rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randint(0, 2 * TOKENS_PER_SAMPLE) for _ in range(N_SAMPLES))


LAYOUTS = {  # name: (source shape, placements, first rank), (destination ...)
    "colocated": (((4096, 4), (S, R), 0), ((1024, 2, 8), (S, R, R), 0)),
    "disjoint halves": (((2048, 4), (S, R), 0), ((512, 2, 8), (S, R, R), 8192)),
    "disjoint 2x16384": (((4096, 4), (S, R), 0), ((1024, 2, 8), (S, R, R), 16384)),
}


def base_specs(layout: str) -> tuple[MeshSpec, MeshSpec]:
    (s_shape, s_pl, s_first), (d_shape, d_pl, d_first) = LAYOUTS[layout]
    return (MeshSpec(mesh(s_shape, s_first), s_pl, 0, name="encoder"),
            MeshSpec(mesh(d_shape, d_first), d_pl, 0, name="language"))


def replan(src: MeshSpec, dst: MeshSpec, rank: int, world: int, two_hop: bool) -> None:
    """What one rank does per step and encoder: forward and backward parts of the plan."""
    if two_hop:
        plan_for_rank(*two_hop_specs(src, dst), rank, world)
        plan_for_rank(*two_hop_specs(*backward_specs(src, dst, GRAD)), rank, world)
    else:
        plan_for_rank(src, dst, rank, world)
        plan_backward_for_rank(src, dst, GRAD, rank, world)


def per_step(steps: int, repeats: int) -> list[dict]:
    rng = random.Random(0)
    rows = []
    header = (f"{'layout':18} {'world':>6} {'route':>7} {'rank':>12} {'first ms':>8} {'median ms':>9} {'max ms':>7} "
              f"{'whole-world plan ms':>19} {'x faster':>8}")
    print("per-step re-plan, new ragged sizes every step (forward + backward, one encoder, one rank)")
    print(header)
    print("-" * len(header))
    for layout in LAYOUTS:
        src0, dst0 = base_specs(layout)
        world = max(max(src0.ranks), max(dst0.ranks)) + 1
        whole = []
        for _ in range(repeats):  # the old hot path: the whole world's plan, forward and backward
            sizes = ragged(rng)
            src, dst = src0.replace(sample_sizes=sizes), dst0.replace(sample_sizes=sizes)
            t = time.perf_counter()
            plan(src, dst, world)
            plan_backward(src, dst, GRAD, world)
            whole.append(time.perf_counter() - t)
        whole_ms = statistics.median(whole) * 1e3
        plan.cache_clear()  # drop the whole-world plans: a rank of a real run never holds one
        gc.collect()
        for role, rank in (("encoder", src0.ranks[len(src0.ranks) // 2]),
                           ("language", dst0.ranks[len(dst0.ranks) // 2])):
            for two_hop in (False, True):
                times = []
                for _ in range(steps + 1):  # the first step also resolves the split meshes (once per run)
                    sizes = ragged(rng)
                    t = time.perf_counter()
                    src, dst = src0.replace(sample_sizes=sizes), dst0.replace(sample_sizes=sizes)
                    replan(src, dst, rank, world, two_hop)
                    times.append(time.perf_counter() - t)
                first, times = times[0] * 1e3, times[1:]
                med, worst = statistics.median(times) * 1e3, max(times) * 1e3
                route = "two-hop" if two_hop else "one-hop"
                rows.append(dict(layout=layout, world_size=world, route=route, role=role, rank=rank,
                                 first_step_ms=first, median_ms=med, max_ms=worst, whole_world_plan_ms=whole_ms,
                                 steps=steps))
                print(f"{layout:18} {world:>6} {route:>7} {role + ' ' + str(rank):>12} {first:>8.1f} {med:>9.3f} "
                      f"{worst:>7.3f} {whole_ms:>19.1f} {whole_ms / med:>8.0f}")
    return rows


def whole_world(repeats: int) -> list[dict]:
    rng = random.Random(1)
    rows = []
    header = (f"{'case':26} {'world':>6} {'msgs':>7} {'copies':>6} {'spec s':>7} {'cold s':>7} "
              f"{'for_rank ms':>11} {'all ranks s':>11}")
    print("\nwhole-world plan() (statistics, tests)")
    print(header)
    print("-" * len(header))
    for layout in LAYOUTS:
        (s_shape, s_pl, s_first), (d_shape, d_pl, d_first) = LAYOUTS[layout]
        for kind, sizes in (("uniform", None), ("ragged", ragged(rng))):
            extent = prod(s_shape[:1]) * TOKENS_PER_SAMPLE if sizes is None else sum(sizes)
            s_mesh, d_mesh = mesh(s_shape, s_first), mesh(d_shape, d_first)
            t = time.perf_counter()
            src, dst = MeshSpec(s_mesh, s_pl, extent, sizes), MeshSpec(d_mesh, d_pl, extent, sizes)
            t_spec = time.perf_counter() - t
            t_cold = t_one = t_all = float("inf")
            for _ in range(repeats):
                plan.cache_clear()
                t0 = time.perf_counter()
                p = plan(src, dst)
                t1 = time.perf_counter()
                p.for_rank(p.world_size // 2)
                t2 = time.perf_counter()
                for r in range(p.world_size):
                    p.for_rank(r)
                t3 = time.perf_counter()
                t_cold, t_one, t_all = min(t_cold, t1 - t0), min(t_one, t2 - t1), min(t_all, t3 - t2)
            stats = p.stats()
            name = f"{layout}, {kind}"
            rows.append(dict(case=name, world_size=p.world_size, spec_s=t_spec, plan_cold_s=t_cold,
                             for_rank_s=t_one, for_rank_all_s=t_all, **stats))
            print(f"{name:26} {p.world_size:>6} {stats['messages']:>7} {stats['copies']:>6} {t_spec:>7.3f} "
                  f"{t_cold:>7.3f} {t_one * 1e3:>11.3f} {t_all:>11.3f}")
    return rows


HOP_LAYOUTS = {  # (source shape, placements), (destination shape, placements); disjoint ranks
    "enc dp256 -> lang dp64·cp2·tp8": (((256,), (S,)), ((64, 2, 8), (S, R, R))),
    "enc dp64·tp4 -> lang dp64·tp8": (((64, 4), (S, R)), ((64, 8), (S, R))),
    "enc dp512 -> lang dp128·cp4·tp8": (((512,), (S,)), ((128, 4, 8), (S, R, R))),
    "enc dp4096·tp4 -> lang dp1024·cp2·tp8": (((4096, 4), (S, R)), ((1024, 2, 8), (S, R, R))),
}


def hops_table() -> list[dict]:
    rng = random.Random(2)
    rows = []
    header = (f"{'layout':40} {'route':>7} {'dir':>4} {'rows between':>13} {'rows inside':>12} "
              f"{'between / distinct':>18}")
    print("\nrows moved per step, one-hop vs two-hop (ragged, 32 samples per encoder dp rank)")
    print(header)
    print("-" * len(header))
    for name, ((s_shape, s_pl), (d_shape, d_pl)) in HOP_LAYOUTS.items():
        sizes = tuple(rng.randint(0, 2 * TOKENS_PER_SAMPLE) for _ in range(32 * s_shape[0]))
        src = MeshSpec(mesh(s_shape, 0), s_pl, sample_sizes=sizes, name="encoder")
        dst = MeshSpec(mesh(d_shape, prod(s_shape)), d_pl, sample_sizes=sizes, name="language")
        grad = GRAD if len(d_shape) == 3 else (S, R)
        for direction, (a, b) in (("fwd", (src, dst)), ("bwd", backward_specs(src, dst, grad))):
            for n_hops in (1, 2):
                moved = hop_rows(a, b, n_hops)
                route = "one-hop" if n_hops == 1 else "two-hop"
                rows.append(dict(layout=name, route=route, direction=direction, distinct_rows=sum(sizes), **moved))
                print(f"{name:40} {route:>7} {direction:>4} {moved['between']:>13,} {moved['inside']:>12,} "
                      f"{moved['between'] / sum(sizes):>18.1f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_results/bridge_plan.json")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    results = dict(per_step=per_step(args.steps, args.repeats), whole_world=whole_world(args.repeats),
                   hops=hops_table())
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    env = dict(python=sys.version.split()[0], torch=torch.__version__, platform=platform.platform(),
               cpus=os.cpu_count(), steps=args.steps, repeats=args.repeats)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "bridge_plan", "env": env, "results": results}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
