"""Encoder-rank activation memory vs microbatches: lean encoders against all-forwards-first.

    torchrun --standalone --nproc-per-node=3 benchmarks/encoder_memory.py [--out bench_results/encoder_memory.json]

Vision encoder (dp1) on rank 0, language model pp2 (1F1B) on ranks 1-2 (with 2 ranks: pp1). For
each number of microbatches M, the same global batch (M x 2 samples, 0-2 images each) two ways:

- before: the encoder runs every forward first, then every backward (a crossing window of M:
  what encoder ranks did before they followed the first language stage);
- lean: the window the first language stage needs (`MimoModel.window`: pp under 1F1B), so the
  encoder computes microbatch j + window while the language model runs backward j.

Colocated: vision and language dp3 on every rank (three phases): every microbatch's encoder graph
kept through the language schedule, against `ParallelOptions(recompute_colocated=True)` (no graph
kept; each microbatch encoded again before its backward).

Peak memory: the bytes autograd saves for backward on rank 0 (every tensor a graph keeps alive,
counted by `torch.autograd.graph.saved_tensors_hooks` while it lives), the part of an encoder
rank's memory that grows with M. Step time: median of --iters, max over ranks, same run.
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

from dtensor_mimo import MimoLayout, MimoModel, ParallelOptions, Parallelism, PipelineConfig
from dtensor_mimo.data import MimoBatch, ModalitySpec, SyntheticSpec, synthetic_batch
from dtensor_mimo.models import Llama, LlamaConfig, ModalityEncoder, Projection, ViT, ViTConfig

P = Parallelism


def repeated(mb: MimoBatch, times: int) -> MimoBatch:
    """`mb` (one microbatch) `times` over: every microbatch of the step costs the same."""
    cat = lambda t: torch.cat([t] * times)  # noqa: E731
    modalities = {n: dataclasses.replace(m, inputs=cat(m.inputs), items_per_sample=m.items_per_sample * times)
                  for n, m in mb.modalities.items()}
    return MimoBatch(tokens=cat(mb.tokens), labels=cat(mb.labels), loss_mask=cat(mb.loss_mask), modalities=modalities)


class SavedBytes:
    """Bytes of the tensors autograd keeps for backward, live and at peak (while installed)."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def _pack(self, t: torch.Tensor):
        return _Held(self, t)

    @staticmethod
    def _unpack(held: "_Held") -> torch.Tensor:
        return held.tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


class _Held:
    def __init__(self, counter: SavedBytes, tensor: torch.Tensor) -> None:
        self.counter, self.tensor = counter, tensor
        self.bytes = tensor.numel() * tensor.element_size()
        counter.live += self.bytes
        counter.peak = max(counter.peak, counter.live)

    def __del__(self) -> None:
        self.counter.live -= self.bytes


def measure(layout: MimoLayout, m: int, options: dict, window: int | None, vision: ViTConfig,
            llama_cfg: LlamaConfig, iters: int) -> tuple[float, float]:
    """(rank 0's peak saved MiB, median step seconds) of `m` microbatches of one repeated microbatch."""
    llama = Llama(llama_cfg)
    llama.init_weights(0)
    encoder = ModalityEncoder(ViT(vision), Projection(vision.dim, llama_cfg.dim))
    encoder.init_weights(10)
    model = MimoModel(layout, llama, {"vision": encoder}, options=options, pipeline=PipelineConfig(microbatches=m))
    if window is not None:
        model.parts = dataclasses.replace(model.parts, window=window)  # every rank: the same crossing order
    spec = SyntheticSpec(vocab_size=256, seq_len=160, batch_size=dist.get_world_size(), text_only_samples=0,
                         modalities={"vision": ModalitySpec.image(vision, special_token_id=255, max_items=2)})
    batch = repeated(synthetic_batch(spec, seed=0), m)
    counter, times = SavedBytes(), []
    for i in range(iters + 1):
        dist.barrier()
        t0 = time.perf_counter()
        with counter.hooks():
            model.forward_backward(batch)
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i:  # the first step builds schedules and plans
            times.append(elapsed.item())
        model.zero_grad(set_to_none=True)
    peak = torch.tensor([counter.peak], dtype=torch.float64)
    dist.broadcast(peak, src=0)  # rank 0 holds the encoder in both layouts
    return peak.item() / 2**20, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pp = world - 1
    vision = ViTConfig(image_size=32, patch_size=4, dim=96, n_layers=4, n_heads=4)
    llama_cfg = LlamaConfig(vocab_size=256, dim=96, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=512)
    disjoint = MimoLayout({"vision": P(), "language": P(pp=pp)})
    colocated = MimoLayout({"vision": P(dp=world), "language": P(dp=world)}, offsets={"vision": 0, "language": 0})
    recompute = {"vision": ParallelOptions(recompute_colocated=True)}
    sections = {
        f"disjoint: vision dp1 (rank 0) | language pp{pp} 1F1B": (
            "before", lambda m: measure(disjoint, m, {}, m, vision, llama_cfg, args.iters),
            "lean", lambda m: measure(disjoint, m, {}, None, vision, llama_cfg, args.iters)),
        f"colocated: vision dp{world} + language dp{world} on every rank": (
            "keep", lambda m: measure(colocated, m, {}, None, vision, llama_cfg, args.iters),
            "recompute", lambda m: measure(colocated, m, recompute, None, vision, llama_cfg, args.iters)),
    }
    results = {}
    for title, (base, run_base, new, run_new) in sections.items():
        rows = []
        for m in args.microbatches:
            (base_mib, base_s), (new_mib, new_s) = run_base(m), run_new(m)
            rows.append({"microbatches": m, f"{base}_peak_mib": base_mib, f"{new}_peak_mib": new_mib,
                         f"{base}_step_s": base_s, f"{new}_step_s": new_s, "peak_ratio": new_mib / base_mib,
                         "time_ratio": new_s / base_s})
        results[title] = rows
        if rank == 0:
            print(f"\n{title}: rank 0's saved activation MiB, step seconds")
            print(f"{'M':>3} {base + ' MiB':>14} {new + ' MiB':>14} {'ratio':>6} {base + ' s':>12} {new + ' s':>12} "
                  f"{'ratio':>6}")
            for r in rows:
                print(f"{r['microbatches']:>3} {r[base + '_peak_mib']:>14.1f} {r[new + '_peak_mib']:>14.1f} "
                      f"{r['peak_ratio']:>6.2f} {r[base + '_step_s']:>12.3f} {r[new + '_step_s']:>12.3f} "
                      f"{r['time_ratio']:>6.2f}")
    if rank == 0 and args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "machine": platform.platform(), "world": world,
                       "sections": results}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
