"""Host time of a training step on tiny models: this tree against another checkout, same run.

    python benchmarks/host_step.py [--baseline DIR] [--steps 40] [--repeats 3] [--out bench_results/host_step.json]

A tiny model's arithmetic takes a fraction of a millisecond, so its step time on one CPU thread is
the library's own host work: building the step (plans, program, microbatches), the crossings, the
schedules' bookkeeping, the optimizer. Each case runs `train_step` in a fresh process (gloo, one
intra-op thread, eager) and reports the median of `--steps` timed steps after 5 warm-up steps.
With ``--baseline DIR`` (e.g. ``git worktree add /tmp/base <commit>``) every case also runs with
that checkout's library (``PYTHONPATH``), the two alternating `--repeats` times so that machine
noise hits both alike; reported as this tree's time over the baseline's. Only public names are
used (``MimoModel``, ``MimoOptimizer``, ``train_step``, the models, ``synthetic_batch``), so any
checkout that has them can be the baseline.

| case | model | layout |
|---|---|---|
| llama | `Llama` tiny (dim 32, 2 layers), no encoder | world 1 |
| llava | tiny `ViT` + `Projection` + `Llama`, 2 images a sample | world 1, colocated |
| llava, 2 ranks, M=2 | the same | vision on rank 0, language on rank 1, 2 microbatches |
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {"llama": (1, 1), "llava": (1, 1), "llava, 2 ranks, M=2": (2, 2)}


def _worker(case: str, steps: int) -> None:
    """One case in this process (a rank of its world); rank 0 prints the step times as JSON."""
    import time

    import torch
    import torch.distributed as dist

    from dtensor_mimo import MimoLayout, MimoModel, MimoOptimizer, Parallelism, PipelineConfig, train_step
    from dtensor_mimo.data import ModalitySpec, SyntheticSpec, synthetic_batch
    from dtensor_mimo.models import Llama, LlamaConfig, ModalityEncoder, Projection, ViT, ViTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, microbatches = CASES[case]
    llama = Llama(LlamaConfig.tiny())
    vit = ViTConfig.tiny()
    if case == "llama":
        layout, encoders, modalities = MimoLayout({"language": Parallelism()}), {}, {}
    else:
        encoders = {"vision": ModalityEncoder(ViT(vit), Projection(vit.dim, LlamaConfig.tiny().dim))}
        offsets = {"vision": 0, "language": 0} if world == 1 else None
        layout = MimoLayout({"vision": Parallelism(), "language": Parallelism()}, offsets=offsets)
        modalities = {"vision": ModalitySpec.image(vit, special_token_id=64)}
    pipeline = PipelineConfig(microbatches=microbatches) if microbatches > 1 else None
    model = MimoModel(layout, llama, encoders, pipeline=pipeline)
    model.init_weights({"language": 0, **{n: 1 for n in encoders}})
    optimizer = MimoOptimizer(model)
    batches = [synthetic_batch(SyntheticSpec.tiny(batch_size=8, modalities=modalities), seed=s) for s in range(4)]
    times = []
    for i in range(5 + steps):
        t0 = time.perf_counter()
        train_step(model, optimizer, batches[i % 4])
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= 5:
            times.append(elapsed.item())
    if dist.get_rank() == 0:
        print(json.dumps(times))
    dist.destroy_process_group()


def run(tree: str, case: str, steps: int) -> list[float]:
    """Step seconds of one case with the library of `tree`, in fresh processes."""
    world, _ = CASES[case]
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    command = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
               f"--nproc-per-node={world}", os.path.abspath(__file__), "--worker", case, "--steps", str(steps)]
    out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tree, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{case} with {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="another checkout's root, measured in the same run")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=list(CASES))
    parser.add_argument("--out", default="bench_results/host_step.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.steps)
        return
    trees = {"this tree": HERE, **({"baseline": os.path.abspath(args.baseline)} if args.baseline else {})}
    samples: dict[str, dict[str, list[float]]] = {c: {t: [] for t in trees} for c in args.cases}
    for _ in range(args.repeats):  # alternate: noise hits every tree alike
        for case in args.cases:
            for label, tree in trees.items():
                samples[case][label] += run(tree, case, args.steps)
    rows = []
    print(f"{'case':<24}" + "".join(f"{t + ' ms':>16}" for t in trees) + ("   this / baseline" if args.baseline else ""))
    for case in args.cases:
        medians = {t: statistics.median(v) * 1e3 for t, v in samples[case].items()}
        ratio = medians["this tree"] / medians["baseline"] if args.baseline else None
        print(f"{case:<24}" + "".join(f"{m:>16.2f}" for m in medians.values())
              + (f"{ratio:>18.3f}" if ratio is not None else ""))
        rows.append({"case": case, "median_ms": medians, "ratio": ratio})
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"steps": args.steps, "repeats": args.repeats, "trees": trees, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
