"""Encoder time per dp rank for images of mixed sizes: items split by sample against balanced by cost.

    torchrun --standalone --nproc-per-node=2 benchmarks/balance.py [--samples 16] [--dp 2 4 8] [--repeats 4]
        [--dim 384] [--layers 4] [--iters 4] [--seed 0] [--skip-model] [--out bench_results/balance.json]

Target (issue 20): balancing brings an encoder's max/mean time across dp ranks within 1.15 on a
mix where it is above 1.5 by sample.

A global batch of --samples samples, 1 or 2 images each, at their own resolution (patch 16, an
aspect ratio drawn from 1:1, 4:3, 3:4, 16:9, 9:16, 2:1, 1:2), in one of three mixes:

- uniform: every image 16..576 patches;
- long tail: 85% small (16..64 patches), 15% large (400..1024): screenshots and documents among photos;
- grouped: the first half of the samples hold large images (256..576), the second half small ones
  (16..64), as a length-grouped or source-ordered sampler gives them: splitting by sample is worst.

Part A, the encoder alone (a dynamic-resolution ViT, SigLIP-like, fp32, one thread per rank).
For each virtual encoder dp size D, the items are cut into D parts two ways, as
`dtensor_mimo.data.balance.item_cuts` does: by sample (the data layer's rule) and balanced (the
contiguous runs whose largest `item_cost` sum is least). Part k is encoded (forward + backward) on rank k % world, so
the two ranks time their parts side by side, one core each; rounds interleave the two cuts, one
warm-up round is dropped, and each part's time is the median of --repeats. Columns:

- tokens: each part's tokens, by sample / balanced (the line under each row);
- max/mean pred: the cost model's max part cost over the mean part cost (`item_cost` sums);
- max/mean meas: the same ratio of the measured part times (the step waits for the max);
- floor: the largest item's cost over the mean part cost, which no split into whole items can
  go below (one large item can keep every split above 1.15);
- wait: the balanced cut's slowest part over the by-sample cut's slowest part (pred and meas):
  the encoder time a step waits for, balanced against by sample.

Part B, the library's own path: `MimoModel` with vision dp2 colocated with a small Llama dp2 on
ranks 0-1, ``ParallelOptions(balance=True)`` against ``balance=False`` on the grouped mix. Columns:
each rank's items and tokens under either cut (`item_cuts`, `row_bounds`), and the step time
(`forward_backward`, max over ranks, median of --iters after one warm-up, the two models
interleaved) with its ratio balanced / by sample.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import time
from itertools import accumulate, pairwise
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from dtensor_mimo import MimoLayout, MimoModel, ParallelOptions, Parallelism
from dtensor_mimo.data import IGNORE_INDEX, MimoBatch, ModalityInputs
from dtensor_mimo.data.balance import item_cost, item_cuts, max_over_mean, row_bounds
from dtensor_mimo.models import Llama, LlamaConfig, ModalityEncoder, Projection, ViT, ViTConfig

PATCH = 16
LANGUAGE_DIM = 128  # small: the encoder dominates part B's step
ASPECTS = (1.0, 4 / 3, 3 / 4, 16 / 9, 9 / 16, 2.0, 0.5)
Grid = tuple[int, int]  # an image's patches: (rows, columns)


# ------------------------------------------------------------------ the mixes


def grid(tokens: int, aspect: float) -> Grid:
    """The patch grid of about `tokens` patches with width / height about `aspect`."""
    rows = max(1, round(math.sqrt(tokens / aspect)))
    return rows, max(1, round(tokens / rows))


def draw(lo: int, hi: int, g: torch.Generator) -> Grid:
    """An image of lo..hi patches (about) at a random aspect ratio."""
    tokens = int(torch.randint(lo, hi + 1, (1,), generator=g))
    return grid(tokens, ASPECTS[int(torch.randint(len(ASPECTS), (1,), generator=g))])


def mix(name: str, samples: int, seed: int) -> list[list[Grid]]:
    """`samples` samples of 1 or 2 images each, sized as the mix `name` says (see the docstring)."""
    g = torch.Generator().manual_seed(seed)
    small, large = (16, 64), (400, 1024)
    pick: dict[str, Callable[[int], Grid]] = {
        "uniform": lambda s: draw(16, 576, g),
        "long tail": lambda s: draw(*(large if float(torch.rand(1, generator=g)) < 0.15 else small), g),
        "grouped": lambda s: draw(*((256, 576) if s < samples // 2 else small), g),
    }
    return [[pick[name](s) for _ in range(1 + int(torch.randint(2, (1,), generator=g)))] for s in range(samples)]


MIXES = ("uniform", "long tail", "grouped")


def images(samples: Sequence[Sequence[Grid]], seed: int) -> list[torch.Tensor]:
    """One random image ``[3, rows * 16, cols * 16]`` per grid, samples in order."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, r * PATCH, c * PATCH, generator=g) for grids in samples for r, c in grids]


def vision_inputs(samples: Sequence[Sequence[Grid]], seed: int, special_token_id: int) -> ModalityInputs:
    """The samples' images as a batch's vision modality."""
    return ModalityInputs(images(samples, seed), tuple(len(s) for s in samples),
                          tuple(r * c for s in samples for r, c in s), special_token_id)


# ------------------------------------------------------------------ cost arithmetic


def part_sums(values: Sequence[float], cuts: Sequence[int]) -> list[float]:
    """Sum of `values` over each part of `cuts` (item indices)."""
    prefix = [0, *accumulate(values)]
    return [prefix[b] - prefix[a] for a, b in pairwise(cuts)]


def slowest_over_mean(values: Sequence[float]) -> float:
    """The slowest measured part over the mean part: 1.0 is a perfect split."""
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0


# ------------------------------------------------------------------ part A: the encoder alone


def encode_seconds(model: ViT, inputs: list[torch.Tensor]) -> float:
    """Wall time of one forward + backward of `inputs` (0.0 for an empty part)."""
    if not inputs:
        return 0.0
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    model(inputs).sum().backward()
    return time.perf_counter() - start


def encoder_row(model: ViT, name: str, samples: list[list[Grid]], parts: int, repeats: int, seed: int) -> dict:
    """Part A's row for one mix and one virtual dp size: cuts, predicted and measured part times."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m = vision_inputs(samples, seed, special_token_id=0)
    width = model.config.dim
    costs = [item_cost(t, width) for t in m.item_tokens]
    cuts = {"by sample": item_cuts(m, parts, balance=False), "balanced": item_cuts(m, parts, True, width)}
    mine = [k for k in range(parts) if k % world == rank]
    times: dict[str, dict[int, list[float]]] = {v: {k: [] for k in mine} for v in cuts}
    for round_ in range(repeats + 1):  # the cuts interleaved; round 0 is a warm-up
        for variant, c in cuts.items():
            dist.barrier()  # both ranks time the same cut at once: one core each
            for k in mine:
                seconds = encode_seconds(model, m.inputs[c[k] : c[k + 1]])
                if round_:
                    times[variant][k].append(seconds)
    medians = {v: {k: statistics.median(ts) for k, ts in per.items()} for v, per in times.items()}
    gathered: list[dict] = [{}] * world
    dist.all_gather_object(gathered, medians)
    row: dict = {"mix": name, "dp": parts, "images": m.num_items, "tokens": sum(m.item_tokens)}
    for variant, c in cuts.items():
        measured = [next(g[variant][k] for g in gathered if k in g[variant]) for k in range(parts)]
        row[variant] = {"cuts": list(c), "tokens": [int(t) for t in part_sums(m.item_tokens, c)],
                        "cost": [int(x) for x in part_sums(costs, c)], "seconds": measured}
        row[variant]["pred"] = max_over_mean(m, c, width)  # the library's own figure (the trainer logs it)
        row[variant]["meas"] = slowest_over_mean(measured)
    before, after = row["by sample"], row["balanced"]
    row["floor"] = max(costs) / (sum(costs) / parts)
    row["wait_pred"] = max(after["cost"]) / max(before["cost"])
    row["wait_meas"] = max(after["seconds"]) / max(before["seconds"])
    return row


def print_encoder(rows: list[dict], config: ViTConfig) -> None:
    print(f"\nPart A: encoder parts, forward + backward (ViT dim {config.dim}, {config.n_layers} layers, "
          f"{config.n_heads} heads, patch {config.patch_size}; fp32, 1 thread per rank)")
    print(f"{'mix':<9} {'D':>2} {'images':>6} {'tokens':>6} | {'by sample max/mean':>18} | "
          f"{'balanced max/mean':>17} {'floor':>5} | {'wait bal/by sample':>18}")
    print(f"{'':<9} {'':>2} {'':>6} {'':>6} | {'pred':>8} {'meas':>9} | {'pred':>7} {'meas':>9} {'pred':>5} | "
          f"{'pred':>8} {'meas':>9}")
    for r in rows:
        print(f"{r['mix']:<9} {r['dp']:>2} {r['images']:>6} {r['tokens']:>6} | {r['by sample']['pred']:>8.2f} "
              f"{r['by sample']['meas']:>9.2f} | {r['balanced']['pred']:>7.2f} {r['balanced']['meas']:>9.2f} "
              f"{r['floor']:>5.2f} | {r['wait_pred']:>8.2f} {r['wait_meas']:>9.2f}")
        print(f"{'':<13}tokens by sample {r['by sample']['tokens']}, balanced {r['balanced']['tokens']}")


# ------------------------------------------------------------------ part B: the model's step


def mimo_batch(samples: Sequence[Sequence[Grid]], seq_len: int, vocab_size: int, seed: int) -> MimoBatch:
    """A batch whose row b holds a short prompt, sample b's image tokens (special id
    ``vocab_size - 1``), then text to the end; the loss on every text token with a text target."""
    g = torch.Generator().manual_seed(seed)
    special = vocab_size - 1
    tokens = torch.randint(special, (len(samples), seq_len), generator=g)
    for row, grids in enumerate(samples):
        tokens[row, 8 : 8 + sum(r * c for r, c in grids)] = special
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[:, :-1] = torch.where(tokens[:, 1:] == special, IGNORE_INDEX, tokens[:, 1:])
    loss_mask = ((labels != IGNORE_INDEX) & (tokens != special)).float()
    return MimoBatch(tokens, labels, loss_mask, {"vision": vision_inputs(samples, seed, special)})


def model_rows(vision: ViTConfig, samples: list[list[Grid]], iters: int, seed: int) -> list[dict]:
    """Part B: vision dp2 colocated with a Llama dp2; per rank the items, tokens and step time
    with the items balanced and by sample."""
    world = dist.get_world_size()
    seq_len = 8 + max(sum(r * c for r, c in s) for s in samples) + 56
    llama_cfg = LlamaConfig(vocab_size=256, dim=LANGUAGE_DIM, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=seq_len)
    layout = MimoLayout({"vision": Parallelism(dp=world), "language": Parallelism(dp=world)},
                        offsets={"vision": 0, "language": 0})
    batch = mimo_batch(samples, seq_len, llama_cfg.vocab_size, seed)
    models = {}
    for variant, balance in (("by sample", False), ("balanced", True)):
        llama = Llama(llama_cfg)
        llama.init_weights(0)
        encoder = ModalityEncoder(ViT(vision), Projection(vision.dim, llama_cfg.dim))
        encoder.init_weights(10)
        models[variant] = MimoModel(layout, llama, {"vision": encoder},
                                    options={"vision": ParallelOptions(balance=balance)})
    times: dict[str, list[float]] = {v: [] for v in models}
    for i in range(iters + 1):  # interleaved; the first step builds plans and is dropped
        for variant, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            model.forward_backward(batch)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i:
                times[variant].append(elapsed.item())
            model.zero_grad(set_to_none=True)
    m = batch.modalities["vision"]
    rows = []
    for variant, balance in (("by sample", False), ("balanced", True)):
        cuts = item_cuts(m, world, balance, vision.dim)
        rows.append({"variant": variant, "seq_len": seq_len, "items": [b - a for a, b in pairwise(cuts)],
                     "tokens": [b - a for a, b in pairwise(row_bounds(m, cuts))],
                     "step_s": statistics.median(times[variant]), "steps_s": times[variant]})
    for row in rows:
        row["vs_by_sample"] = row["step_s"] / rows[0]["step_s"]
    return rows


def print_model(rows: list[dict], samples: int) -> None:
    world = len(rows[0]["items"])
    print(f"\nPart B: MimoModel step, vision dp{world} + language dp{world} colocated on ranks 0-{world - 1}, "
          f"grouped mix ({samples} samples, Llama dim {LANGUAGE_DIM} 2 layers, seq_len {rows[0]['seq_len']})")
    print(f"{'variant':<9} | {'items per rank':>14} | {'tokens per rank':>15} | {'step s':>7} | {'vs by sample':>12}")
    for r in rows:
        print(f"{r['variant']:<9} | {r['items']!s:>14} | {r['tokens']!s:>15} | {r['step_s']:>7.3f} | "
              f"{r['vs_by_sample']:>12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-model", action="store_true", help="Part A only")
    parser.add_argument("--out", default="bench_results/balance.json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # two ranks on two cores: never oversubscribe
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    vision = ViTConfig(image_size=16 * PATCH, patch_size=PATCH, dim=args.dim, n_layers=args.layers,
                       n_heads=max(1, args.dim // 64), activation="gelu_tanh", dynamic_resolution=True)
    vit = ViT(vision)
    vit.init_weights(0)
    start = time.perf_counter()
    mixes = {name: mix(name, args.samples, args.seed) for name in MIXES}
    encoder = [encoder_row(vit, name, samples, d, args.repeats, args.seed)
               for name, samples in mixes.items() for d in args.dp]
    if rank == 0:
        print_encoder(encoder, vision)
    model = [] if args.skip_model else model_rows(vision, mixes["grouped"], args.iters, args.seed)
    if rank == 0 and model:
        print_model(model, args.samples)
    if rank == 0:
        print(f"\n{time.perf_counter() - start:.0f} s")
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "machine": platform.platform(),
                       "cpus": os.cpu_count(), "load_average": os.getloadavg(), "world": world,
                       "threads": torch.get_num_threads(),
                       "config": {**vars(args), "vit": vars(vision)}, "mixes": mixes,
                       "encoder": encoder, "model": model}, f, indent=1)
        print(f"wrote {args.out}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
