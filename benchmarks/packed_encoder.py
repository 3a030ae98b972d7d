"""Encoder time per step for images of mixed sizes: packed (one sequence, per-image attention)
against padding every image to the largest.

    python benchmarks/packed_encoder.py [--images 16] [--min-tokens 16] [--max-tokens 256] [--seed 0]
                                        [--dim 384] [--layers 4] [--repeats 5] [--threads 1]
                                        [--out bench_results/packed_encoder.json]

One process, one ViT (SigLIP-style, patch 16, a learned 16x16 grid, `dynamic_resolution=True`),
fp32 on the CPU. Each image gets a token count drawn uniformly from ``min..max`` and an aspect
ratio from a fixed set (1:1, 4:3, 3:4, 16:9, 9:16, 2:1, 1:2); its size is the whole patches that
give about that count. A step is forward + backward of the encoder (loss: sum of the rows).
Variants, timed in the same run on the same images, interleaved, median of `repeats` steps after
one warm-up round:

- packed: the list path, ``ViT(images)`` -> ``[sum tokens, dim]``;
- padded (box): every image zero-padded to the largest height and the largest width of the
  batch, the tensor path ``ViT([N, C, H_max, W_max])``, as a batch of one size must be;
- padded (tokens): a lower bound for padding each image's tokens only to the longest image's
  count (what a padded batch with a key-padding mask computes): the tensor path on N square
  images of ``ceil(sqrt(max tokens))^2`` patches.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch

from dtensor_mimo.models import ViT, ViTConfig

ASPECTS = (1.0, 4 / 3, 3 / 4, 16 / 9, 9 / 16, 2.0, 0.5)


def image_grids(n: int, lo: int, hi: int, seed: int) -> list[tuple[int, int]]:
    """`n` patch grids (rows, columns) with about lo..hi patches each."""
    g = torch.Generator().manual_seed(seed)
    grids = []
    for _ in range(n):
        tokens = int(torch.randint(lo, hi + 1, (1,), generator=g))
        aspect = ASPECTS[int(torch.randint(len(ASPECTS), (1,), generator=g))]
        rows = max(1, round(math.sqrt(tokens / aspect)))
        cols = max(1, min(round(tokens / rows), hi // rows))
        grids.append((rows, cols))
    return grids


def step_seconds(model: ViT, inputs) -> float:
    """Wall time of one forward + backward."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    model(inputs).sum().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on a shared machine, parallel regions that wait for a busy core "
                             "punish the variant with more, smaller kernels)")
    parser.add_argument("--out", default="bench_results/packed_encoder.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    patch = 16
    config = ViTConfig(image_size=16 * patch, patch_size=patch, dim=args.dim, n_layers=args.layers,
                       n_heads=args.dim // 64, activation="gelu_tanh", dynamic_resolution=True)
    model = ViT(config)
    model.init_weights(0)
    grids = image_grids(args.images, args.min_tokens, args.max_tokens, args.seed)
    g = torch.Generator().manual_seed(args.seed + 1)
    images = [torch.randn(3, r * patch, c * patch, generator=g) for r, c in grids]
    h_max, w_max = max(r for r, _ in grids), max(c for _, c in grids)
    box = torch.zeros(len(images), 3, h_max * patch, w_max * patch)
    for i, image in enumerate(images):
        box[i, :, : image.shape[1], : image.shape[2]] = image
    side = math.ceil(math.sqrt(max(r * c for r, c in grids)))
    square = torch.randn(len(images), 3, side * patch, side * patch, generator=g)

    real = sum(r * c for r, c in grids)
    variants = [("packed", images, real), ("padded (box)", box, len(images) * h_max * w_max),
                ("padded (tokens)", square, len(images) * side * side)]
    # Interleaved (one step of each variant per round), so that a change in the machine's load
    # during the run falls on every variant alike; one warm-up round.
    times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    for round_ in range(args.repeats + 1):
        for name, inputs, _ in variants:
            seconds = step_seconds(model, inputs)
            if round_:
                times[name].append(seconds)
    results = [{"variant": name, "tokens": tokens, "padding_fraction": 1 - real / tokens,
                "step_ms": statistics.median(times[name]) * 1e3, "steps_ms": [t * 1e3 for t in times[name]]}
               for name, _, tokens in variants]
    packed_ms = results[0]["step_ms"]
    for row in results:
        row["time_vs_packed"] = row["step_ms"] / packed_ms

    print(f"{args.images} images, tokens per image {sorted(r * c for r, c in grids)}; ViT dim {args.dim}, "
          f"{args.layers} layers, {config.n_heads} heads, patch {patch}; fp32, {torch.get_num_threads()} threads")
    print(f"{'variant':<16} | {'tokens':>6} | {'padding':>7} | {'fwd+bwd ms':>10} | {'x packed':>8}")
    for row in results:
        print(f"{row['variant']:<16} | {row['tokens']:>6} | {row['padding_fraction']:>7.1%} | "
              f"{row['step_ms']:>10.1f} | {row['time_vs_packed']:>8.2f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": vars(args), "grids": grids, "threads": torch.get_num_threads(), "results": results},
                  f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
