"""Is data off the critical path? The trainer's step fed from files against the same step fed from memory.

    python benchmarks/data_feed.py [--steps 60] [--repeats 3] [--batch-size 16] [--out bench_results/data_feed.json]

The README's tiny LLaVA task (a SigLIP tower and a Qwen2 decoder, written by
`examples/make_tiny_llava.py`), one rank holding both modules, one intra-op thread, eager. Each
step's batch comes from:

| case | how |
|---|---|
| memory | every batch built once beforehand (the same indices, in the same order) and handed over as is |
| files, 1 worker | PNG decoding, the image processor and tokenization in a loader worker process (`data.workers = 1`) |
| files, prefetch | the same work in the trainer's prefetch thread (`data.prefetch = true`), two batches ahead |
| files, inline | the same work between steps, on the step's own thread (`data.prefetch = false`) |
| memory, core busy | as memory, while a second process builds the same batches from files and drops them: |
| | the worker's work without its hand-over, so "files, 1 worker" minus this is what the transfer costs |

Each case runs in a fresh process; the cases alternate `--repeats` times so machine noise hits
them alike. Reported: the median step time (the trainer's ``step_s``: from asking for the batch
to the end of the optimizer step) of the steps after the first 10, and its ratio to memory's.
Issue 29's target: fed from files within 5% of memory.

On a CPU-only machine the prefetch thread needs a core of its own: the step uses one thread, so
this runs one rank on a machine of two or more cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {"memory": ["--data.prefetch", "false"], "files, 1 worker": ["--data.workers", "1"],
         "files, prefetch": ["--data.prefetch", "true"], "files, inline": ["--data.prefetch", "false"],
         "memory, core busy": ["--data.prefetch", "false"]}
WARM = 10
PHASES = ("step_s", "data_s", "forward_backward_s", "optimizer_s")


def _argv(config: str, steps: int, batch_size: int, jsonl: str, case: str) -> list[str]:
    return ["--config", config, "--train.steps", str(steps), "--data.batch_size", str(batch_size),
            "--layout.language.offset", "0", "--pipeline.microbatches", "1", "--metrics.log_every", "1",
            "--metrics.progress", "off", "--metrics.jsonl", jsonl, "--train.generate", "0",
            "--train.eval_every", "0", "--data.heldout", "none", "--checkpoint.export_hf", "none",
            *[f"--options.{m}.compile=false" for m in ("image", "language")], *CASES[case]]


def _one(workdir: str, case: str, steps: int, batch_size: int, jsonl: str) -> None:
    """One trainer run on one rank in this process (`--case`)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29517"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    import torch.distributed as dist

    from dtensor_mimo.train.config import parse_args
    from dtensor_mimo.train.trainer import Trainer

    dist.init_process_group("gloo", rank=0, world_size=1)
    os.chdir(workdir)
    config = os.path.join(ROOT, "examples", "llava_tiny.toml")
    argv = _argv(config, steps, batch_size, jsonl, case)
    trainer = Trainer(parse_args(argv))
    busy = None
    if case == "memory, core busy":  # a loader worker's work, its batches dropped instead of handed over
        import multiprocessing

        busy = multiprocessing.get_context("fork").Process(
            target=_build_forever, args=(trainer.data.train.batch, _sampled(trainer, steps)), daemon=True)
    if case.startswith("memory"):
        # The same batches, built by a first trainer over the same sampler (same seed, same order)
        # before this one starts: its steps then take them from a dict.
        source = trainer.data.train
        build, built = source.batch, {}

        def remembered(indices, load=None):
            key = (tuple(indices), repr(load))
            if key not in built:
                built[key] = build(indices, load=load)
            return built[key]

        plan = trainer._load_plan(batch_size, 1)
        for indices in list(_sampled(trainer, steps)):
            plan.tolerant(remembered, indices)
        source.batch = remembered
    if busy is not None:
        busy.start()
    trainer.run()
    if busy is not None:
        busy.kill()
    dist.destroy_process_group()


def _build_forever(build, batches: list[list[int]]) -> None:
    """Build `batches` from files again and again (a second process: the work of a loader worker)."""
    import torch

    torch.set_num_threads(1)
    while True:
        for indices in batches:
            build(indices)


def _sampled(trainer, steps: int):
    """The index lists the trainer's sampler gives for `steps` steps (on a copy of it)."""
    from dtensor_mimo.data import ResumableBatchSampler

    d = trainer.config.data
    copy = ResumableBatchSampler(len(trainer.data.train), d.batch_size, seed=d.seed)
    copy.load_state_dict(trainer.sampler.state_dict())
    out = []
    while len(out) < steps:
        for indices in copy:
            out.append(list(indices))
            if len(out) == steps:
                break
    return out


def _step_times(workdir: str, case: str, steps: int, batch_size: int) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory() as d:
        jsonl = os.path.join(d, "m.jsonl")
        cmd = [sys.executable, os.path.abspath(__file__), "--case", case, "--dir", workdir, "--steps", str(steps),
               "--batch-size", str(batch_size), "--jsonl", jsonl]
        env = {**os.environ, "PYTHONPATH": ROOT}
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
        with open(jsonl) as f:
            records = [r for r in map(json.loads, f) if "step_s" in r]
    return [{k: r[k] for k in PHASES} for r in records if r["step"] > WARM]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "data_feed"))
    parser.add_argument("--out", default="bench_results/data_feed.json")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES), help="memory is always run")
    parser.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)  # one run, in this process
    parser.add_argument("--jsonl", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps <= WARM:  # before any run: nothing after the warm-up steps would be timed
        parser.error(f"--steps {args.steps}: the first {WARM} steps are warm-up, not timed; give more (e.g. 60)")
    if args.case:
        return _one(args.dir, args.case, args.steps, args.batch_size, args.jsonl)
    if not os.path.exists(os.path.join(args.dir, "data", "train.jsonl")):
        spec = importlib.util.spec_from_file_location("make", os.path.join(ROOT, "examples", "make_tiny_llava.py"))
        make = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(make)
        make.write_checkpoints(args.dir)
        make.write_data(args.dir, train=512, val=16)
    times: dict[str, list[dict[str, float]]] = {case: [] for case in CASES if case in {"memory", *args.cases}}
    for _ in range(args.repeats):
        for case in times:
            times[case] += _step_times(args.dir, case, args.steps, args.batch_size)
    medians = {case: {k: statistics.median(r[k] for r in t) * 1e3 for k in PHASES} for case, t in times.items()}
    base = medians["memory"]["step_s"]
    rows = {case: {**{f"{k[:-2]}_ms": v for k, v in m.items()}, "vs_memory": m["step_s"] / base,
                   "steps": len(times[case])} for case, m in medians.items()}
    print(f"{'fed from':<20} {'step ms':>8} {'vs memory':>10} {'data ms':>8} {'fwd+bwd ms':>11} {'optim ms':>9}  (medians)")
    for case, r in rows.items():
        print(f"{case:<20} {r['step_ms']:>8.1f} {r['vs_memory']:>9.3f}x {r['data_ms']:>8.1f} "
              f"{r['forward_backward_ms']:>11.1f} {r['optimizer_ms']:>9.1f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"steps": args.steps, "repeats": args.repeats, "batch_size": args.batch_size, "cases": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
