"""Memory over a long run: every rank's RSS and its receive-buffer pool, every 100 steps.

    python benchmarks/soak.py [--steps 2000] [--every 100] [--json soak.json] [-- --section.key VALUE ...]

Runs the default digits job (`python -m dtensor_mimo.train`'s 3-rank layout and model, compiled
blocks) on local gloo ranks for `--steps` steps, no evaluation until the end. Each rank samples its
resident set (VmRSS) and the blocks and bytes of its `BufferPool`s (the model's crossings and the
bridge's default pool) after every `--every` steps. The table shows the per-rank RSS curve; the
summary the growth after warm-up (from the first sample at or after 20% of the steps to the last),
which should stay under 5%, and the largest block count seen (bounded by the pool's max_blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch.multiprocessing as mp


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _rank(rank: int, world: int, port: int, argv: list[str], every: int, out_dir: str) -> None:
    import torch.distributed as dist

    from dtensor_mimo.bridge import DEFAULT_BUFFERS
    from dtensor_mimo.layout.world import init_distributed, local_rank_env
    from dtensor_mimo.train.config import parse_args
    from dtensor_mimo.train.trainer import Trainer

    local_rank_env(rank, world, port)
    config = parse_args(argv)
    init_distributed("cpu", config.train.timeout_s)
    trainer = Trainer(config)
    samples = []
    step_once = trainer._run_step

    def sampled(*args, **kwargs):
        window = step_once(*args, **kwargs)
        if trainer.step % every == 0:
            pools = (trainer.model.buffers, DEFAULT_BUFFERS)
            samples.append({"step": trainer.step, "rss_mib": _rss_mib(), "blocks": sum(p.blocks for p in pools),
                            "pool_mib": sum(p.nbytes for p in pools) / 2**20,
                            "allocations": sum(p.allocations for p in pools)})
        return window

    trainer._run_step = sampled
    trainer.run()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(samples, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--json", default="soak.json")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    argv = ["--train.steps", str(args.steps), "--train.generate", "0", "--data.heldout_samples", "16",
            "--metrics.log_every", str(args.every), "--metrics.progress", "off", *extra]
    from dtensor_mimo.layout.world import hold_store
    from dtensor_mimo.train.config import build_layout, parse_args

    config = parse_args(argv)
    world = build_layout(config).world_size
    store = hold_store(world, config.train.timeout_s)  # served here until the ranks end
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank, args=(world, store.port, argv, args.every, out_dir), nprocs=world,
                           start_method="spawn")
        per_rank = []
        for r in range(world):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                per_rank.append(json.load(f))
    print(f"{'step':>6} " + " ".join(f"{'rss r' + str(r) + ' MiB':>12} {'blocks':>6}" for r in range(world)))
    for i, sample in enumerate(per_rank[0]):
        cells = " ".join(f"{per_rank[r][i]['rss_mib']:>12.1f} {per_rank[r][i]['blocks']:>6}" for r in range(world))
        print(f"{sample['step']:>6} {cells}")
    summary = []
    for r, samples in enumerate(per_rank):
        warm = next(s for s in samples if s["step"] >= 0.2 * args.steps)
        last = samples[-1]
        growth = (last["rss_mib"] - warm["rss_mib"]) / warm["rss_mib"]
        summary.append({"rank": r, "warm_step": warm["step"], "warm_rss_mib": warm["rss_mib"],
                        "last_rss_mib": last["rss_mib"], "growth": growth,
                        "max_blocks": max(s["blocks"] for s in samples),
                        "allocations_after_warmup": last["allocations"] - warm["allocations"]})
        print(f"rank {r}: RSS {warm['rss_mib']:.1f} MiB at step {warm['step']} -> {last['rss_mib']:.1f} MiB at "
              f"step {last['step']} ({growth:+.1%}); pool blocks at most {summary[-1]['max_blocks']}, "
              f"{summary[-1]['allocations_after_warmup']} block allocations after warm-up")
    with open(args.json, "w") as f:
        json.dump({"steps": args.steps, "every": args.every, "argv": argv, "per_rank": per_rank,
                   "summary": summary}, f, indent=1)
    sys.exit(0 if all(s["growth"] < 0.05 for s in summary) else 1)


if __name__ == "__main__":
    main()
