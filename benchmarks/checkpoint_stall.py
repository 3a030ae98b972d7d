"""What a checkpoint costs the training loop: synchronous saves against saves written in the background.

    torchrun --standalone --nproc-per-node 2 benchmarks/checkpoint_stall.py \
        [--dim 512] [--layers 8] [--steps 16] [--every 4] [--repeats 3] [--json bench_results/checkpoint_stall.json]

A `Llama` (vocabulary 8192, `--dim`, `--layers`) at dp = world size (FSDP2: every rank saves its
shards of the parameters and of AdamW's two moments) trains `--steps` steps on synthetic batches,
three ways in the same processes, alternating `--repeats` times so that machine noise hits each
alike:

- none: no checkpoint, the baseline;
- sync: `checkpoint.save` every `--every` steps (the step waits for DCP's files, the manifest,
  the rename);
- async: `checkpoint.BackgroundSaves` (``checkpoint.async_mode = "async"``): the step waits for a
  copy to host memory; a thread writes the files while the next steps run; the save is finished
  at the first step after which no rank's writer runs, or before the next save.

Saves are periodic only (none at the last step, which a trainer waits for in both modes). Reported
(medians over the repeats, max over ranks): the run's wall time, its excess over `none` per save,
and the time the step that saved waited for its save (the stall). Unlike the trainer, which sums
the ranks' "still writing" in the step's own all-reduce, the loop here adds a one-float all-reduce
per step while a save is written (a small cost counted against async).

The stall is the robust figure; the excess is within this 2-core machine's noise (and here the
writer competes with the training ranks for the cores). On a GPU host the copy is a
device-to-host transfer, and the writer's Python (DCP's planning, pickling) competes for the GIL
with the Python that launches the step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from dtensor_mimo import MimoLayout, MimoModel, MimoOptimizer, Parallelism, train_step
from dtensor_mimo.data import SyntheticSpec, synthetic_batch
from dtensor_mimo.models import Llama, LlamaConfig
from dtensor_mimo.train import checkpoint

MODES = ("none", "sync", "async")


def run(mode: str, model: MimoModel, optimizer: MimoOptimizer, batches: list, steps: int, every: int,
        saves: checkpoint.BackgroundSaves, directory: str) -> dict:
    """`steps` steps with `mode`'s saves every `every` steps; wall seconds and each save's stall."""
    stalls = []
    dist.barrier()
    start = time.perf_counter()
    writing = None
    for step in range(1, steps + 1):
        train_step(model, optimizer, batches[step % len(batches)])
        if writing is not None:  # the trainer folds this into the step's all-reduce
            running = torch.tensor([float(saves.writing())])
            dist.all_reduce(running)
            if not running.item():
                saves.finish()
                writing = None
        if mode != "none" and step % every == 0 and step < steps:  # periodic saves only
            t0 = time.perf_counter()
            if mode == "sync":
                checkpoint.save(directory, step, model, optimizer, {"step": step}, keep=2)
            else:
                saves.finish()
                saves.start(directory, step, model, optimizer, {"step": step}, keep=2)
                writing = step
            stalls.append(time.perf_counter() - t0)
    saves.finish()  # the last periodic save, long written by now (counted if not)
    wall = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    stall = torch.tensor(stalls or [0.0])
    dist.all_reduce(stall, op=dist.ReduceOp.MAX)
    return {"wall_s": wall.item(), "stall_s": stall.tolist() if stalls else []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--json", default="bench_results/checkpoint_stall.json")
    args = parser.parse_args()
    if not 1 <= args.every < args.steps:  # every rank, before any collective: no saves, no figures
        parser.error(f"--every {args.every} with --steps {args.steps}: a run saves every --every steps before its "
                     f"last (none at the last step), so give --every at least 1 and below --steps "
                     f"(e.g. --steps 16 --every 4)")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    config = LlamaConfig(vocab_size=8192, dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=4,
                         max_seq_len=args.seq)
    model = MimoModel(MimoLayout({"language": Parallelism(dp=world)}), Llama(config), {})
    model.init_weights({"language": 0})
    optimizer = MimoOptimizer(model)
    batches = [synthetic_batch(SyntheticSpec(batch_size=args.batch, seq_len=args.seq, vocab_size=8192), seed=s)
               for s in range(4)]
    saves = checkpoint.BackgroundSaves()
    root = tempfile.mkdtemp(prefix="checkpoint_stall_") if rank == 0 else None
    shared: list = [root]
    dist.broadcast_object_list(shared, src=0)
    root = shared[0]
    run("none", model, optimizer, batches, 2, args.every, saves, os.path.join(root, "warm"))  # warm-up
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        for mode in MODES:
            directory = os.path.join(root, f"{mode}{r}")
            results[mode].append(run(mode, model, optimizer, batches, args.steps, args.every, saves, directory))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(directory, ignore_errors=True)
    params = sum(p.numel() for p in model.module_parameters("language").values())  # global sizes
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        wall = {m: statistics.median(x["wall_s"] for x in results[m]) for m in MODES}
        saves_per_run = (args.steps - 1) // args.every
        excess = {m: (wall[m] - wall["none"]) / saves_per_run for m in ("sync", "async")}
        stall = {m: statistics.median(s for x in results[m] for s in x["stall_s"]) for m in ("sync", "async")}
        print(f"Llama {params / 1e6:.1f}M (dim {args.dim} x {args.layers} layers), dp {world}, {args.steps} steps, "
              f"a save every {args.every} ({saves_per_run} a run), medians of {args.repeats} alternating repeats\n")
        print("| mode | run s | excess per save s | step's stall per save s |\n|---|---|---|---|")
        print(f"| none | {wall['none']:.3f} | - | - |")
        for m in ("sync", "async"):
            print(f"| {m} | {wall[m]:.3f} | {excess[m]:.3f} | {stall[m]:.3f} |")
        excess_ratio = (f"{excess['async'] / excess['sync']:.3f}x" if excess["sync"] > 0 else
                        "n/a (the synchronous saves' excess is within this machine's noise)")
        print(f"\nasync / sync: stall {stall['async'] / stall['sync']:.3f}x, excess per save {excess_ratio}")
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "world": world, "parameters": params, "results": results,
                       "wall_s": wall, "excess_per_save_s": excess, "stall_s": stall}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
