"""The layout planner against reality: predicted vs measured step time of layouts at world 4.

    python benchmarks/planner.py [--world 4] [--steps 24] [--warmup 8] [--repeats 2]
                                 [--top 3] [--more 4] [--bottom 0] [--out bench_results/planner.json]

issue 31's check: ``--top 3 --more 0 --bottom 3`` (the planner's three first and three last
choices, Spearman over them >= 0.8).

1. Runs the planner (`dtensor_mimo.train.plan`) on the default digits job for `--world` ranks:
   profiles measured on this machine (or read from the cache), every valid layout ranked.
2. Picks layouts to train for real: the planner's top 3, a few from the middle and the bottom of
   the ranking (spread evenly), its last `--bottom`, and the homogeneous layout (every module on every rank, dp =
   world); at least 6.
3. Trains each with ``python -m dtensor_mimo.train --train.steps N`` and the layout's overrides
   (compile off for every module, as the planner measures blocks uncompiled; held-out scoring and
   generation cut to a minimum), `--repeats` times in rotating order; a run's step time is the
   median of the trainer's logged step times (`metrics.jsonl`: the slowest rank's mean over each
   window of 4 steps) after `--warmup` steps; a layout's is the median over its runs.
4. Reports predicted vs measured per layout, the Spearman rank correlation, the planner's first
   choice vs the best measured, and vs the homogeneous layout; prints a table, writes JSON.

On a 2-core machine the 4 ranks share the cores (the planner's device profile says so), and other
processes on the machine add noise: read the spread column.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dtensor_mimo.plan import entry, homogeneous, overrides_of, predict, search  # noqa: E402
from dtensor_mimo.train.config import parse_args  # noqa: E402
from dtensor_mimo.train.plan import load_profiles  # noqa: E402

NO_COMPILE = [arg for n in ("vision", "audio", "language") for arg in (f"--options.{n}.compile", "false")]
QUIET = ["--data.heldout_samples", "8", "--train.generate", "0", "--metrics.progress", "off",
         "--metrics.log_every", "4"]


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def choose(ranked: list, n_top: int, n_more: int, n_bottom: int = 0) -> list[int]:
    """Indices into the ranking: the top `n_top`, `n_more` spread evenly down to the last, and
    the last `n_bottom`."""
    picked = list(range(min(n_top, len(ranked))))
    rest = len(ranked) - n_top
    for k in range(1, n_more + 1):
        i = n_top + round(k * (rest - 1) / n_more)
        if i not in picked and i < len(ranked):
            picked.append(i)
    for i in range(max(0, len(ranked) - n_bottom), len(ranked)):
        if i not in picked:
            picked.append(i)
    return picked


def train(overrides: list[str], steps: int, warmup: int) -> tuple[float | None, str]:
    """Median logged step time after `warmup` steps of a real run, and how it ended."""
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(tmp, "m.jsonl")
        cmd = [sys.executable, "-m", "dtensor_mimo.train", "--train.steps", str(steps), "--lr_schedule.warmup_steps",
               "5", "--metrics.jsonl", jsonl, *NO_COMPILE, *QUIET, *overrides]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        if proc.returncode:
            return None, (proc.stderr or proc.stdout).strip().splitlines()[-1][:300]
        with open(jsonl) as f:
            records = [json.loads(line) for line in f]
        times = [r["step_s"] for r in records if "step_s" in r and r["step"] > warmup]
        return (statistics.median(times) if times else None), "ok"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--top", type=int, default=3, help="the planner's first choices trained")
    ap.add_argument("--more", type=int, default=4, help="further layouts, spread down the ranking")
    ap.add_argument("--bottom", type=int, default=0, help="the planner's last choices trained")
    ap.add_argument("--cache", default=None, help="profile cache file (default: ~/.cache/dtensor_mimo/)")
    ap.add_argument("--remeasure", action="store_true")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results", "planner.json"))
    args = ap.parse_args()

    # The search's speed at cluster scale: 64 ranks, three modules (analytic H100 profiles).
    from dtensor_mimo.plan.paper import H100, paper_job

    t0 = time.perf_counter()
    big = search(paper_job(clips_per_sample=0.5), 64, H100.device())
    t_search_64 = time.perf_counter() - t0
    print(f"search at 64 ranks, 3 modules (vision, audio, language; H100 profiles): {big.evaluated} layouts "
          f"predicted in {t_search_64:.2f} s ({'all' if big.exhaustive else 'pruned'})")

    config = parse_args([])
    t0 = time.perf_counter()
    job, device, cache = load_profiles(config, args.world, args.cache, args.remeasure)
    t_profile = time.perf_counter() - t0
    t0 = time.perf_counter()
    result = search(job, args.world, device)
    t_search = time.perf_counter() - t0
    ranked = result.ranked
    picks = choose(ranked, args.top, args.more, args.bottom)
    chosen = [(i + 1, ranked[i]) for i in picks]
    n_picked = len(chosen)  # the Spearman correlation is over these (the homogeneous layout may follow)
    base = homogeneous(job, args.world)
    if base is not None and all(p.candidate != base for _, p in chosen):
        rank = next((i + 1 for i, p in enumerate(ranked) if p.candidate == base), None)
        chosen.append((rank, predict(job, base, device)))
    print(f"planner: {len(ranked)} layouts of {args.world} ranks ranked in {t_search:.2f} s "
          f"(profiles {t_profile:.1f} s, {cache}); training {len(chosen)} of them, {args.repeats}x each")

    measured: dict[int, list[float]] = {k: [] for k in range(len(chosen))}
    status: dict[int, str] = {}
    for rep in range(args.repeats):
        order = list(range(len(chosen)))
        order = order[rep % len(order):] + order[:rep % len(order)]
        for k in order:
            rank, pred = chosen[k]
            step, how = train(overrides_of(entry(pred)), args.steps, args.warmup)
            status[k] = how
            if step is not None:
                measured[k].append(step)
            print(f"  run {rep + 1}: #{rank} {pred.candidate.describe()} M={pred.candidate.microbatches}: "
                  + (f"{step * 1e3:.1f} ms" if step is not None else f"FAILED: {how}"), flush=True)

    rows = []
    for k, (rank, pred) in enumerate(chosen):
        times = measured[k]
        rows.append({"planner_rank": rank, **entry(pred), "layout_text": pred.candidate.describe(),
                     "homogeneous": base is not None and pred.candidate == base,
                     "predicted_idle": pred.idle,
                     "measured_step_s": statistics.median(times) if times else None,
                     "measured_runs_s": times, "status": status.get(k)})
    ok = [r for r in rows if r["measured_step_s"] is not None]
    ranked_ok = [r for r in rows[:n_picked] if r["measured_step_s"] is not None]
    rho = (spearman([r["predicted_step_s"] for r in ranked_ok], [r["measured_step_s"] for r in ranked_ok])
           if len(ranked_ok) > 2 else None)
    rho_all = spearman([r["predicted_step_s"] for r in ok], [r["measured_step_s"] for r in ok]) if len(ok) > 2 else None
    first = next((r for r in ok if r["planner_rank"] == 1), None)
    best = min(ok, key=lambda r: r["measured_step_s"]) if ok else None
    homo = next((r for r in ok if r["homogeneous"]), None)
    summary = {
        "spearman": rho, "spearman_with_homogeneous": rho_all, "layouts_measured": len(ok),
        "first_over_best_measured": first["measured_step_s"] / best["measured_step_s"] if first and best else None,
        "best_measured": best["layout_text"] if best else None,
        "homogeneous_over_first": homo["measured_step_s"] / first["measured_step_s"] if homo and first else None,
        "homogeneous_over_first_predicted": homo["predicted_step_s"] / first["predicted_step_s"]
        if homo and first else None,
        "search_s": t_search, "layouts_ranked": len(ranked),
        "search_64_ranks_3_modules_s": t_search_64, "layouts_64_ranks_3_modules": big.evaluated,
    }

    print(f"\nworld {args.world}, digits job (batch {job.batch_size}), {args.steps} steps, median after "
          f"{args.warmup}; compile off")
    head = f"{'rank':>5}  {'layout':<50}{'M':>3}{'predicted ms':>14}{'measured ms':>13}{'runs':>16}"
    print(head)
    print("-" * len(head))
    for r in sorted(rows, key=lambda r: r["predicted_step_s"]):
        runs = "/".join(f"{t * 1e3:.0f}" for t in r["measured_runs_s"])
        meas = f"{r['measured_step_s'] * 1e3:.1f}" if r["measured_step_s"] else "failed"
        tag = " (homogeneous)" if r["homogeneous"] else ""
        print(f"{r['planner_rank'] or '-':>5}  {(r['layout_text'] + tag):<50}{r['microbatches']:>3}"
              f"{r['predicted_step_s'] * 1e3:>14.1f}{meas:>13}{runs:>16}")
    if rho is not None:
        print(f"Spearman rank correlation (predicted vs measured step time, the {len(ranked_ok)} layouts picked "
              f"from the ranking): {rho:.3f}" + (f"; {rho_all:.3f} with the homogeneous layout" if len(ok) >
                                                 len(ranked_ok) else ""))
    if summary["first_over_best_measured"] is not None:
        print(f"planner's first choice / best measured step time: {summary['first_over_best_measured']:.3f} "
              f"(best measured: {summary['best_measured']})")
    if summary["homogeneous_over_first"] is not None:
        print(f"homogeneous / first choice step time: measured {summary['homogeneous_over_first']:.3f}, "
              f"predicted {summary['homogeneous_over_first_predicted']:.3f}")
    out = {"rows": rows, "summary": summary, "args": vars(args), "device": device.to_dict(),
           "torch": __import__("torch").__version__, "host": platform.node(),
           "date": datetime.date.today().isoformat()}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
