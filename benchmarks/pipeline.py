"""Pipelined MIMO step vs the modules taking turns, and heterogeneous vs homogeneous layouts.

    torchrun --standalone --nproc-per-node=2 benchmarks/pipeline.py [--out bench_results/pipeline_2.json]
    torchrun --standalone --nproc-per-node=4 benchmarks/pipeline.py [--out bench_results/pipeline_4.json]

2 ranks: vision encoder on rank 0, language model on rank 1, sized so both take about the same
time. Timed in the same run, interleaved every iteration:

- encoder alone: rank 0's encoder forward + backward on the whole global batch (no
  communication); language alone: rank 1's language forward + backward on the whole batch with
  the encoder rows already there. Their sum is what a step costs when the modules take turns.
- unpipelined: `MimoModel.forward_backward` with pp = 1 and one microbatch (the modules do take turns).
- pipelined: the same layout with `PipelineConfig(microbatches=M)` (pp = 1 per module): encoder
  microbatch i+1 runs while the language model runs microbatch i, the encoder holding only the
  crossing window's microbatches (`dtensor_mimo.schedule.order`).
- pipelined, window M: the same with every encoder forward first (the order before lean encoders).

Reported: pipelined / (encoder alone + language alone) (target <= 0.65 at M = 8), each rank's
measured bubble (1 - its module-alone time / pipelined step) beside the two-stage schedule's
theoretical one, 1/(M+1).

4 ranks: the same global batch on the homogeneous layout (vision and language colocated on all
4 ranks, dp4 each) and on heterogeneous candidates (encoder on its own ranks, pipelined; one with
an encoder pipeline); tokens/s of each, and the best heterogeneous / homogeneous ratio.

Timing: a barrier before each timed op; the op's time is the max over ranks; medians over --iters.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from dtensor_mimo import MimoLayout, MimoModel, Parallelism, PipelineConfig
from dtensor_mimo.data import ModalitySpec, SyntheticSpec, synthetic_batch
from dtensor_mimo.models import Llama, LlamaConfig, ModalityEncoder, Projection, ViT, ViTConfig
from dtensor_mimo.schedule import stage_inputs
from dtensor_mimo.sequence.loss import loss_normalizer

P = Parallelism


def build(layout: MimoLayout, args, pipeline: PipelineConfig | None, vision: ViTConfig, llama_cfg: LlamaConfig,
          offsets=None) -> MimoModel:
    llama = Llama(llama_cfg)
    llama.init_weights(0)
    encoder = ModalityEncoder(ViT(vision), Projection(vision.dim, llama_cfg.dim))
    encoder.init_weights(10)
    return MimoModel(layout, llama, {"vision": encoder}, pipeline=pipeline)


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    mine = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return mine.item()


def measure(fns: dict, iters: int, warmup: int) -> dict[str, list[float]]:
    """Every fn once per iteration, order rotating; returns the timed values."""
    names, out = list(fns), {n: [] for n in fns}
    for it in range(warmup + iters):
        order = names[it % len(names):] + names[:it % len(names)]
        for n in order:
            t = timed(fns[n])
            if it >= warmup:
                out[n].append(t)
    return out


def configs(args):
    vision = ViTConfig(image_size=32, patch_size=4, dim=args.dim, n_layers=args.vision_layers,
                       n_heads=4, mlp_hidden=4 * args.dim)
    llama = LlamaConfig(vocab_size=512, dim=args.dim, n_layers=args.language_layers, n_heads=4,
                        n_kv_heads=2, ffn_hidden=4 * args.dim, max_seq_len=args.seq_len)
    spec = SyntheticSpec(batch_size=args.batch, seq_len=args.seq_len, vocab_size=512,
                         modalities={"vision": ModalitySpec.image(vision, special_token_id=512,
                                                                  max_items=args.images)})
    return vision, llama, spec


def two_rank_models(args) -> tuple[MimoModel, MimoModel, MimoModel]:
    """The 2-rank layout's models: unpipelined, pipelined (lean encoders), and pipelined with
    the crossing window at M (every encoder forward first: the order before lean encoders)."""
    vision, llama_cfg, _ = configs(args)
    layout = MimoLayout({"vision": P(), "language": P()})
    layout.init_meshes("cpu")
    plain = build(layout, args, None, vision, llama_cfg)
    piped = build(layout, args, PipelineConfig(microbatches=args.microbatches), vision, llama_cfg)
    gpipe_order = build(layout, args, PipelineConfig(microbatches=args.microbatches), vision, llama_cfg)
    # Every rank: the encoder's forwards all first. The executor reads the window from the
    # model's `RankParts` (an attribute set on the model itself is never read).
    gpipe_order.parts = dataclasses.replace(gpipe_order.parts, window=args.microbatches)
    return plain, piped, gpipe_order


def two_ranks(args) -> dict:
    vision, llama_cfg, spec = configs(args)
    batch = synthetic_batch(spec, seed=0)
    plain, piped, gpipe_order = two_rank_models(args)
    rank = dist.get_rank()
    items = batch.modalities["vision"].inputs
    rows = torch.randn(batch.num_tokens("vision"), llama_cfg.dim)

    def alone():  # each rank its own module, on the whole batch, no communication
        if rank == 0:
            out = plain.encoders["vision"](items)
            out.backward(torch.ones_like(out))
        else:
            plain.language.set_step({"vision": rows.requires_grad_()}, batch.special_token_ids,
                                    loss_normalizer(batch))
            tokens, kwargs = stage_inputs(batch, 1, 0)
            plain.language(tokens, microbatch=0, **kwargs).backward()

    def own_time(fn):  # this rank's own wall time (not the max over ranks)
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    times = {"encoder alone": [], "language alone": []}
    fns = {"unpipelined": lambda: plain.forward_backward(batch),
           "pipelined": lambda: piped.forward_backward(batch),
           "pipelined, window M": lambda: gpipe_order.forward_backward(batch)}
    measured = {n: [] for n in fns}
    for it in range(args.warmup + args.iters):
        dist.barrier()
        t = torch.zeros(2, dtype=torch.float64)
        t[rank] = own_time(alone)
        dist.all_reduce(t)
        for n, v in measure(fns, 1, 0).items():
            if it >= args.warmup:
                measured[n].append(v[0])
        if it >= args.warmup:
            times["encoder alone"].append(t[0].item())
            times["language alone"].append(t[1].item())
        for model in (plain, piped, gpipe_order):
            model.zero_grad(set_to_none=True)
    med = {n: statistics.median(v) for n, v in {**times, **measured}.items()}
    turns = [e + l for e, l in zip(times["encoder alone"], times["language alone"])]
    ratio = [p / s for p, s in zip(measured["pipelined"], turns)]
    M = args.microbatches
    return {
        "median_s": med,
        "spread_s": {n: [min(v), max(v)] for n, v in {**times, **measured}.items()},
        "pipelined_over_sum_alone": statistics.median(ratio),
        "pipelined_over_sum_alone_range": [min(ratio), max(ratio)],
        "unpipelined_over_sum_alone": statistics.median(
            [u / s for u, s in zip(measured["unpipelined"], turns)]),
        "window_m_over_sum_alone": statistics.median(
            [u / s for u, s in zip(measured["pipelined, window M"], turns)]),
        "bubble_measured": {"encoder rank": 1 - med["encoder alone"] / med["pipelined"],
                            "language rank": 1 - med["language alone"] / med["pipelined"]},
        "bubble_theoretical": 1 / (M + 1),
        "microbatches": M,
    }


def four_ranks(args) -> dict:
    vision, llama_cfg, spec = configs(args)
    batch = synthetic_batch(spec, seed=0)
    tokens = batch.batch_size * batch.seq_len
    candidates = {
        "homogeneous: vision dp4 + language dp4 colocated":
            (MimoLayout({"vision": P(dp=4), "language": P(dp=4)}, offsets={"vision": 0, "language": 0}), None),
        "vision dp1 | language dp3, 4 microbatches":
            (MimoLayout({"vision": P(), "language": P(dp=3)}), PipelineConfig(microbatches=4)),
        "vision dp2 | language dp2, 4 microbatches":
            (MimoLayout({"vision": P(dp=2), "language": P(dp=2)}), PipelineConfig(microbatches=4)),
        "vision dp1 | language pp3, 6 microbatches":
            (MimoLayout({"vision": P(), "language": P(pp=3)}), PipelineConfig(microbatches=6)),
        "vision pp2 | language dp2, 4 microbatches":
            (MimoLayout({"vision": P(pp=2), "language": P(dp=2)}), PipelineConfig(microbatches=4)),
    }
    models = {}
    for name, (layout, pipeline) in candidates.items():
        layout.init_meshes("cpu")
        models[name] = build(layout, args, pipeline, vision, llama_cfg)
    times = measure({n: (lambda m=m: m.forward_backward(batch)) for n, m in models.items()},
                    args.iters, args.warmup)
    med = {n: statistics.median(v) for n, v in times.items()}
    tps = {n: tokens / t for n, t in med.items()}
    homo = next(n for n in tps if n.startswith("homogeneous"))
    best = max((n for n in tps if n != homo), key=tps.get)
    return {"median_s": med, "tokens_per_s": tps, "best_heterogeneous": best,
            "best_heterogeneous_over_homogeneous": tps[best] / tps[homo], "tokens_per_step": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--images", type=int, default=3, help="most images per sample (64 tokens each)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--vision-layers", type=int, default=16)
    ap.add_argument("--language-layers", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1800))
    world = dist.get_world_size()
    if world not in (2, 4):
        raise SystemExit(f"run with --nproc-per-node=2 or 4 (got {world})")
    result = two_ranks(args) if world == 2 else four_ranks(args)
    if dist.get_rank() == 0:
        result.update(args=vars(args), world=world, torch=torch.__version__, host=platform.node(),
                      date=datetime.date.today().isoformat())
        if world == 2:
            print(f"\n2 ranks (vision | language), {args.microbatches} microbatches, batch {args.batch} x {args.seq_len}")
            print(f"{'step':<22}{'median s':>10}{'min':>9}{'max':>9}")
            for n, t in result["median_s"].items():
                lo, hi = result["spread_s"][n]
                print(f"{n:<22}{t:>10.3f}{lo:>9.3f}{hi:>9.3f}")
            print(f"pipelined / (encoder alone + language alone) = {result['pipelined_over_sum_alone']:.3f} "
                  f"(range {result['pipelined_over_sum_alone_range'][0]:.3f}-"
                  f"{result['pipelined_over_sum_alone_range'][1]:.3f}); unpipelined: "
                  f"{result['unpipelined_over_sum_alone']:.3f}; pipelined with every encoder forward first "
                  f"(window M): {result['window_m_over_sum_alone']:.3f}")
            b = result["bubble_measured"]
            print(f"bubble: encoder rank {b['encoder rank']:.3f}, language rank {b['language rank']:.3f}, "
                  f"theoretical 1/(M+1) = {result['bubble_theoretical']:.3f}")
        else:
            print(f"\n4 ranks, batch {args.batch} x {args.seq_len} = {result['tokens_per_step']} tokens per step")
            print(f"{'layout':<52}{'median s':>10}{'tokens/s':>10}")
            for n, t in result["median_s"].items():
                print(f"{n:<52}{t:>10.3f}{result['tokens_per_s'][n]:>10.0f}")
            print(f"best heterogeneous / homogeneous tokens/s = {result['best_heterogeneous_over_homogeneous']:.3f} "
                  f"({result['best_heterogeneous']})")
        out = args.out or f"bench_results/pipeline_{world}.json"
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
