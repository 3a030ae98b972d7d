"""Conversation data at scale: time to the first step and memory per rank, 1,000 vs 1,000,000 samples.

    python benchmarks/data_scale.py [--sizes 1000 1000000] [--shards 0] [--steps 4] [--dir /tmp/data_scale]
                                    [--out bench_results/data_scale.json]

Writes the tiny checkpoints of `examples/make_tiny_llava.py` and, per size, a generated LLaVA
JSONL corpus (a quarter text-only samples; the rest reference one of four small shared PNG files;
``--shards K``: also as K JSONL files read through a glob), then runs the README's tiny task
(`examples/llava_tiny.toml`: a SigLIP tower on rank 0, a Qwen2 decoder on rank 1) on each with
``python -m dtensor_mimo.train`` for `--steps` steps. Corpus generation is not timed.

Measured from outside the trainer, per run:

| column              | what                                                                      |
|---------------------|---------------------------------------------------------------------------|
| first step s        | process start to the first step's record in the metrics JSONL (launcher preflight, rank start-up, data indexing, model build, step 1) |
| CPU s               | user + system CPU seconds of the launcher and its ranks until then (less sensitive to a shared machine's load) |
| RSS MiB rank r      | each rank's resident memory (``/proc/PID/status`` VmRSS) once the last step's record is written |
| RSS peak MiB rank r | each rank's VmHWM then                                                     |

Targets (issue 30): first step within 60 s at 1,000,000 samples; memory above the 1,000-sample run
under 500 MiB per rank.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CONFIG = os.path.join(ROOT, "examples", "llava_tiny.toml")
TARGET_FIRST_STEP_S = 60.0
TARGET_EXTRA_MIB = 500.0


def _make_module():
    spec = importlib.util.spec_from_file_location("make_tiny_llava", os.path.join(ROOT, "examples", "make_tiny_llava.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_corpus(data: str, n: int, shards: int, make) -> tuple[str, str | None]:
    """`n` samples as ``data/train-N.jsonl`` (and ``shards`` files ``train-N-K.jsonl``); the paths."""
    rng = random.Random(0)
    images = []
    os.makedirs(os.path.join(data, "images"), exist_ok=True)
    for k, (color, shape) in enumerate([("red", "square"), ("blue", "ring"), ("green", "cross"), ("yellow", "bar")]):
        path = os.path.join("images", f"shared-{k}.png")
        if not os.path.exists(os.path.join(data, path)):
            make.draw_shape(color, shape, rng).save(os.path.join(data, path))
        images.append((path, f"a {color} {shape}"))
    single = os.path.join(data, f"train-{n}.jsonl")
    if not os.path.exists(single):
        with open(single + ".part", "w") as f:
            for i in range(n):
                if i % 4 == 3:
                    line = {"id": f"s{i}", "conversations": [{"from": "human", "value": "repeat : red blue"},
                                                              {"from": "gpt", "value": "red blue"}]}
                else:
                    path, answer = images[i % len(images)]
                    line = {"id": f"s{i}", "image": path,
                            "conversations": [{"from": "human", "value": "<image>\nwhat is in the image ?"},
                                              {"from": "gpt", "value": answer}]}
                f.write(json.dumps(line) + "\n")
        os.replace(single + ".part", single)
    pattern = None
    if shards:
        pattern = os.path.join(data, f"train-{n}-*.jsonl")
        if not os.path.exists(os.path.join(data, f"train-{n}-{shards - 1:04d}.jsonl")):
            per = -(-n // shards)
            with open(single) as f:
                for k in range(shards):
                    with open(os.path.join(data, f"train-{n}-{k:04d}.jsonl"), "w") as out:
                        for _ in range(per):
                            line = f.readline()
                            if not line:
                                break
                            out.write(line)
    return single, pattern


def _rank_pids(launcher: int) -> list[int]:
    """The launcher's spawned rank processes (not its resource tracker), in start order."""
    found = []
    try:
        with open(f"/proc/{launcher}/task/{launcher}/children") as f:
            children = [int(p) for p in f.read().split()]
    except OSError:
        return []
    for pid in children:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    found.append(pid)
        except OSError:
            continue
    return sorted(found)


def _status(pid: int, key: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # kB -> MiB
    return float("nan")


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds the processes `pids` have used so far."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            continue
    return total


def _records(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [r for r in map(json.loads, f.read().splitlines()) if "loss" in r]
    except (OSError, json.JSONDecodeError):
        return []


def run(workdir: str, path: str, steps: int, tag: str) -> dict:
    """One trainer run on `path`: seconds to the first step, each rank's RSS after the last step."""
    metrics = os.path.join(workdir, f"metrics-{tag}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [sys.executable, "-m", "dtensor_mimo.train", "--config", CONFIG, "--data.path", path,
           "--data.heldout", "none", "--train.steps", str(steps), "--metrics.log_every", "1",
           "--metrics.jsonl", metrics, "--metrics.progress", "off", "--train.generate", "0",
           "--checkpoint.export_hf", "none", "--lr_schedule.warmup_steps", "1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = cpu = None
    rss: list[float] = []
    peak: list[float] = []
    while proc.poll() is None:
        records = _records(metrics)
        if records and first is None:
            first = time.perf_counter() - start
            cpu = _cpu_s([proc.pid, *_rank_pids(proc.pid)])
        if len(records) >= steps and not rss:
            pids = _rank_pids(proc.pid)
            try:
                rss = [_status(p, "VmRSS") for p in pids]
                peak = [_status(p, "VmHWM") for p in pids]
            except OSError:
                pass
        time.sleep(0.02)
    output = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"the trainer failed on {path}:\n{output[-4000:]}")
    checked = next((line for line in output.splitlines() if line.startswith("data: ")), "")
    return {"first_step_s": first, "first_step_cpu_s": cpu, "rss_mib": rss, "peak_rss_mib": peak, "total_s": time.perf_counter() - start,
            "losses": [r["loss"] for r in _records(metrics)], "preflight": checked}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 1_000_000])
    parser.add_argument("--shards", type=int, default=0, help="also run each size as this many JSONL files (a glob)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dir", default="/tmp/data_scale")
    parser.add_argument("--out", default="bench_results/data_scale.json")
    args = parser.parse_args()
    make = _make_module()
    os.makedirs(args.dir, exist_ok=True)
    if not os.path.exists(os.path.join(args.dir, "ckpt", "lm", "config.json")):
        make.write_checkpoints(args.dir)
    rows = []
    for n in args.sizes:
        t = time.perf_counter()
        single, pattern = write_corpus(os.path.join(args.dir, "data"), n, args.shards, make)
        generated = time.perf_counter() - t
        inputs = [("JSONL", single)] + ([(f"JSONL x{args.shards} (glob)", pattern)] if pattern else [])
        for kind, path in inputs:
            result = run(args.dir, path, args.steps, f"{n}-{kind.split()[0]}")
            rows.append({"samples": n, "input": kind, "bytes": os.path.getsize(single), "generate_s": generated,
                         **result})
    base = {r["input"]: r for r in rows if r["samples"] == min(args.sizes)}
    header = (f"{'samples':>9} {'input':<18} {'MB':>6} {'first step s':>12} {'CPU s':>6} "
              + " ".join(f"{'RSS MiB r' + str(k):>12}" for k in range(2))
              + " ".join(f"{'+ vs ' + format(min(args.sizes), ',') + ' r' + str(k):>15}" for k in range(2)))
    print(header)
    ok = True
    for r in rows:
        extra = [a - b for a, b in zip(r["rss_mib"], base[r["input"]]["rss_mib"])]
        r["rss_above_smallest_mib"] = extra
        ok &= r["first_step_s"] is not None and r["first_step_s"] <= TARGET_FIRST_STEP_S
        ok &= all(e < TARGET_EXTRA_MIB for e in extra)
        print(f"{r['samples']:>9,} {r['input']:<18} {r['bytes'] / 1e6:>6.0f} {r['first_step_s']:>12.1f} "
              f"{r['first_step_cpu_s']:>6.1f} "
              + " ".join(f"{m:>12.0f}" for m in r["rss_mib"]) + " ".join(f"{e:>15.0f}" for e in extra))
    print(f"targets: first step <= {TARGET_FIRST_STEP_S:.0f} s, RSS above the {min(args.sizes):,}-sample run "
          f"< {TARGET_EXTRA_MIB:.0f} MiB per rank: {'met' if ok else 'NOT met'}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(rows[-1]["preflight"])
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"steps": args.steps, "targets": {"first_step_s": TARGET_FIRST_STEP_S,
                                                    "rss_above_smallest_mib": TARGET_EXTRA_MIB},
                   "met": ok, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
