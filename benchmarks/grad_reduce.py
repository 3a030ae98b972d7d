"""Data-parallel gradient reduction started during backward against after it, without FSDP2 and with.

    torchrun --standalone --nproc-per-node=2 benchmarks/grad_reduce.py [--fsdp] [--out bench_results/grad_reduce.json]

A colocated MIMO model (a small ViT encoder + a `Llama` of about 12M parameters, both dp = world,
``ParallelOptions(fsdp=False)``) trains with `PipelineConfig(microbatches=M)` twice, built from
the same weights: with ``overlap_grad_reduce=True`` (the default: `GradientReducer` launches each
bucket once the module's last backward has produced it, on a group of its own) and with
``overlap_grad_reduce=False`` (every bucket after backward, two in flight). The two alternate
every iteration on the same batches, so machine noise hits both alike.

Reported per mode: the step (``forward_backward`` + ``reduce_gradients``), and the part of it
after backward (``reduce_gradients``: what the reduction leaves exposed without FSDP2; with it,
FSDP2's reductions end inside ``forward_backward``); medians over
``--iters``, each the max over ranks; the ratio overlapped / after. The two modes' gradients are
compared (they must agree to the order of float sums).

With ``--fsdp`` both modules are FSDP2-sharded over dp instead, and the two models differ in
when the language model's stage reduce-scatters: during its last backward of the step, block by
block (the library: `reduce_in_this_backward`), or after torch's schedule (torch's own pipeline
stages, which defer every FSDP2 reduction to ``perform_reduce_grad``; the library's hook
switched off). The encoder (pp = 1) reduces in its last backward either way.

On gloo and CPU ranks the reduction runs on gloo's threads, which share the cores with the
backward: a lower bound of what NCCL's own stream gives on GPUs, where the reduction takes no
compute from the backward.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from dtensor_mimo import MimoLayout, MimoModel, ParallelOptions, Parallelism, PipelineConfig
from dtensor_mimo.data import ModalitySpec, SyntheticSpec, synthetic_batch
from dtensor_mimo.models import Llama, LlamaConfig, ModalityEncoder, Projection, ViT, ViTConfig
from dtensor_mimo.parallelize.reducer import local_part


def configs(args: argparse.Namespace) -> tuple[ViTConfig, LlamaConfig, SyntheticSpec]:
    vision = ViTConfig(image_size=32, patch_size=4, dim=192, n_layers=4, n_heads=4, mlp_hidden=768)
    llama = LlamaConfig(vocab_size=4096, dim=384, n_layers=6, n_heads=6, n_kv_heads=2, ffn_hidden=1024,
                        max_seq_len=args.seq)
    spec = SyntheticSpec(batch_size=args.batch, seq_len=args.seq, vocab_size=4096,
                         modalities={"vision": ModalitySpec.image(vision, special_token_id=4096, max_items=2)})
    return vision, llama, spec


MODES = {False: ("overlapped", "after backward"), True: ("during last backward", "after the schedule")}


def build(args: argparse.Namespace, world: int, overlap: bool) -> MimoModel:
    vision, llama_cfg, _ = configs(args)
    llama = Llama(llama_cfg)
    llama.init_weights(0)
    encoder = ModalityEncoder(ViT(vision), Projection(vision.dim, llama_cfg.dim))
    encoder.init_weights(10)
    layout = MimoLayout.colocated({"vision": Parallelism(dp=world), "language": Parallelism(dp=world)})
    options = ParallelOptions(fsdp=args.fsdp, overlap_grad_reduce=overlap, grad_bucket_mb=args.bucket_mb)
    model = MimoModel(layout, llama, {"vision": encoder}, options={"vision": options, "language": options},
                      pipeline=PipelineConfig(microbatches=args.microbatches))
    if args.fsdp and not overlap:  # torch's own stages: every reduce-scatter after the schedule
        model.language_pipeline.reductions.fsdp_in_backward = False
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="samples per global batch")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--bucket-mb", type=float, default=32.0, help="ParallelOptions.grad_bucket_mb")
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 over dp: reduce-scatters in the last backward or after")
    ap.add_argument("--out", default=os.path.join("bench_results", "grad_reduce.json"))
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    early, late = MODES[args.fsdp]
    models = {early: build(args, world, True), late: build(args, world, False)}
    spec = configs(args)[2]
    batches = [synthetic_batch(spec, seed=s) for s in range(4)]
    params = sum(p.numel() for p in models[early].parameters())  # a DTensor counts its global size
    times: dict[str, dict[str, list[float]]] = {m: {"step": [], "exposed": []} for m in models}
    diff = 0.0
    for it in range(args.iters + 2):  # two warm-up iterations
        batch = batches[it % len(batches)]
        grads = {}
        for mode, model in models.items():
            model.zero_grad()
            dist.barrier()
            t0 = time.perf_counter()
            model.forward_backward(batch)
            t1 = time.perf_counter()
            model.reduce_gradients()
            t2 = time.perf_counter()
            spent = torch.tensor([t2 - t0, t2 - t1], dtype=torch.float64)
            dist.all_reduce(spent, op=dist.ReduceOp.MAX)
            if it >= 2:
                times[mode]["step"].append(spent[0].item())
                times[mode]["exposed"].append(spent[1].item())
            grads[mode] = [local_part(p.grad).clone() for p in model.parameters() if p.grad is not None]
        diff = max(diff, max((a - b).abs().max().item() for a, b in zip(*grads.values())))
    if rank == 0:
        med = {m: {k: statistics.median(v) for k, v in t.items()} for m, t in times.items()}
        ratio = med[early]["step"] / med[late]["step"]
        print(f"world {world}, {params / 1e6:.1f}M parameters (fp32 gradients {params * 4 / 2**20:.0f} MiB), "
              f"{'FSDP2' if args.fsdp else f'no FSDP2, buckets {args.bucket_mb} MiB'}, {args.microbatches} "
              f"microbatches, gloo, {os.cpu_count()} cores")
        print(f"{'mode':<22}{'step ms':>10}{'reduce_gradients ms':>22}")
        for mode, m in med.items():
            print(f"{mode:<22}{m['step'] * 1e3:>10.1f}{m['exposed'] * 1e3:>22.1f}")
        print(f"{early} / {late}: {ratio:.3f}x step; largest gradient difference {diff:.2e}")
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"world": world, "fsdp": args.fsdp, "parameters": params, "microbatches": args.microbatches,
                       "bucket_mb": args.bucket_mb, "median_s": med, "ratio": ratio, "max_grad_diff": diff,
                       "times_s": times, "host": platform.node(), "torch": torch.__version__}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
