"""Throughput of the default trainer job: compiled vs eager, heterogeneous vs homogeneous layout.

    python benchmarks/trainer.py [--steps 200] [--batch-size 48] [--repeats 2] [--out bench_results/trainer.json]

Runs `python -m dtensor_mimo.train` (its own local gloo ranks) for each variant, alternating the
variants `--repeats` times so machine noise hits them alike, and reads the step times from the
JSONL metrics (steps after the first 20% are timed, so compilation is excluded). All variants use
3 ranks and the same global batch (48: divisible by the 4 microbatches and by the homogeneous
layout's dp 3). Reported as ratios against the default job measured in the same run.

| variant | layout (3 ranks) |
|---|---|
| default: heterogeneous, compiled | vision [0], audio [1], language [2]; 4 microbatches overlap |
| heterogeneous, eager | the same, `compile = false` everywhere |
| homogeneous, compiled | vision dp3, audio dp3, language dp3, all on ranks 0-2 (colocated) |
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

EAGER = [f"--options.{m}.compile=false" for m in ("vision", "audio", "language")]
HOMOGENEOUS = ["--pipeline.microbatches", "1",
               *[a for m in ("vision", "audio", "language")
                 for a in (f"--layout.{m}.dp", "3", f"--layout.{m}.offset", "0")]]
VARIANTS = {
    "heterogeneous, compiled (default)": [],
    "heterogeneous, eager": EAGER,
    "homogeneous, compiled": HOMOGENEOUS,
}


def run(extra: list[str], steps: int, batch_size: int) -> list[float]:
    """Step seconds (slowest rank) of the timed steps of one trainer run."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.jsonl")
        cmd = [sys.executable, "-m", "dtensor_mimo.train", "--train.steps", str(steps),
               "--data.batch_size", str(batch_size), "--metrics.log_every", "1", "--metrics.jsonl", path,
               "--metrics.progress", "off", "--data.heldout_samples", "48", "--train.generate", "0", *extra]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            records = [r for r in map(json.loads, f) if "step_s" in r]
    return [r["step_s"] for r in records if r["step"] > steps // 5]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="bench_results/trainer.json")
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, extra in VARIANTS.items():
            times[name].extend(run(extra, args.steps, args.batch_size))
    base = statistics.median(times["heterogeneous, compiled (default)"])
    tokens = args.batch_size * 33  # token rows of the digits task
    rows = []
    print(f"{'variant':<36} {'median step ms':>14} {'p10-p90 ms':>15} {'tokens/s':>9} {'default / this':>15}")
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=10)
        median = statistics.median(ts)
        rows.append({"variant": name, "median_step_s": median, "p10_s": q[0], "p90_s": q[-1],
                     "tokens_per_s": tokens / median, "speed_vs_default": base / median})
        print(f"{name:<36} {median * 1e3:>14.1f} {q[0] * 1e3:>7.1f}-{q[-1] * 1e3:<7.1f} "
              f"{tokens / median:>9,.0f} {base / median:>15.2f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"steps": args.steps, "batch_size": args.batch_size, "repeats": args.repeats, "rows": rows}, f,
                  indent=2)


if __name__ == "__main__":
    main()
