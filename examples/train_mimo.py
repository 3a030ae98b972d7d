"""Main job: train a small vision + audio + language MIMO model on a heterogeneous layout.

    torchrun --standalone --nproc-per-node=8 examples/train_mimo.py [--steps 30] [--no-compile]
        [--microbatches 4]

Layout on 8 CPU ranks (gloo): a ViT on dp3 (ranks 0-2), an audio encoder on dp1 (rank 3), and a
Llama-style decoder on tp2·dp2 with sequence parallel (ranks 4-7). The vision encoder's dp 3 does
not divide the language model's dp 2, and image counts vary per sample (0-2, text-only samples
included): the bridge handles both. Decoder blocks are compiled with torch.compile (inductor).
Each step runs as 4 microbatches: the encoders, on ranks of their own, compute microbatch i+1
while the language model runs microbatch i (`PipelineConfig`; --microbatches 1 turns it off).
The model cycles over a few fixed synthetic batches, so the loss falls well below ln(vocab).
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist

from dtensor_mimo import (
    AdamWConfig,
    MimoLayout,
    MimoModel,
    MimoOptimizer,
    ParallelOptions,
    Parallelism,
    PipelineConfig,
    train_step,
)
from dtensor_mimo.data import ModalitySpec, SyntheticSpec, synthetic_batch
from dtensor_mimo.models import (
    AudioConfig,
    AudioEncoder,
    Llama,
    LlamaConfig,
    ModalityEncoder,
    Projection,
    ViT,
    ViTConfig,
)

VOCAB = 256
LLAMA = LlamaConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                    max_seq_len=128)
VISION = ViTConfig(image_size=16, patch_size=4, dim=48, n_layers=2, n_heads=4, mlp_hidden=96)
AUDIO = AudioConfig(n_mels=16, max_frames=32, dim=48, n_layers=2, n_heads=4, mlp_hidden=96)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--microbatches", type=int, default=4, help="per step; 1: no overlap")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    layout = MimoLayout({
        "vision": Parallelism(dp=3),
        "audio": Parallelism(dp=1),
        "language": Parallelism(dp=2, tp=2),
    })
    if rank == 0:
        print(layout.describe(), flush=True)

    llama = Llama(LLAMA)
    llama.init_weights(0)
    encoders = {
        "vision": ModalityEncoder(ViT(VISION), Projection(VISION.dim, LLAMA.dim)),
        "audio": ModalityEncoder(AudioEncoder(AUDIO), Projection(AUDIO.dim, LLAMA.dim)),
    }
    for i, encoder in enumerate(encoders.values()):
        encoder.init_weights(10 * (i + 1))
    options = {"language": ParallelOptions(sp=True, compile=args.compile)}
    model = MimoModel(layout, llama, encoders, options=options,
                      pipeline=PipelineConfig(microbatches=args.microbatches))
    optimizer = MimoOptimizer(model, AdamWConfig(lr=1e-2, max_grad_norm=1.0))

    spec = SyntheticSpec(
        batch_size=8, seq_len=128, vocab_size=VOCAB, documents_per_row=2,
        modalities={"vision": ModalitySpec.image(VISION, special_token_id=VOCAB, max_items=2),
                    "audio": ModalitySpec.audio(AUDIO, special_token_id=VOCAB + 1, max_items=1)},
    )
    batches = [synthetic_batch(spec, seed) for seed in range(4)]  # every rank: the same global batches
    if rank == 0:
        print(f"compile={'on' if args.compile else 'off'}; chance level ln({VOCAB}) = {math.log(VOCAB):.2f}")
        print(f"{'step':>4}  {'loss':>7}  {'grad norm':>9}  {'s/step':>7}", flush=True)
    for step in range(args.steps):
        start = time.perf_counter()
        metrics = train_step(model, optimizer, batches[step % len(batches)])
        if rank == 0:
            print(f"{step:>4}  {metrics.loss:7.4f}  {metrics.grad_norm:9.4f}  "
                  f"{time.perf_counter() - start:7.2f}{'  (skipped)' if metrics.skipped else ''}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # 8 ranks share a few cores
    main()
