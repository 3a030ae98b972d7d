"""Fine-tune a LLaVA-style model from pretrained Hugging Face parts on a heterogeneous layout.

    torchrun --standalone --nproc-per-node=3 examples/llava_from_pretrained.py \\
        --vision DIR --language DIR [--projector DIR] [--steps 20] [--language-tp 2] [--lr 1e-3]

`--vision`: a SigLIP or CLIP vision tower (or a LLaVA checkpoint: its tower); `--language`: a
Llama-family decoder (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3); `--projector`: a LLaVA
checkpoint whose projector to start from (default: a fresh one, as in LLaVA's first stage). Local
directories only, nothing is downloaded. The tower sits on rank 0, frozen (forward only: no
backward crossing); the projector trains with it; the language model trains on the remaining
ranks (tp `--language-tp`, the rest dp, FSDP2). Every module is built on the meta device and each
rank loads only its own shards. The data is synthetic (random images and text, a few batches
cycled), so the loss falls as the model memorizes them: this shows the plumbing, not a recipe.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist

from dtensor_mimo import AdamWConfig, MimoLayout, MimoModel, MimoOptimizer, ParallelOptions, Parallelism, train_step
from dtensor_mimo.data import ModalitySpec, SyntheticSpec, synthetic_batch
from dtensor_mimo.models import Llama, LlamaConfig, ModalityEncoder, Projection, ViT, ViTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vision", required=True, help="Hugging Face SigLIP / CLIP / LLaVA directory")
    parser.add_argument("--language", required=True, help="Hugging Face Llama-family directory")
    parser.add_argument("--projector", help="a LLaVA directory to take the projector from")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--language-tp", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    language_ranks = world - 1
    if language_ranks < 1 or language_ranks % args.language_tp:
        raise SystemExit(f"{world} ranks: rank 0 for the vision tower, the other {language_ranks} must be a "
                         f"multiple of --language-tp={args.language_tp}")
    layout = MimoLayout({"vision": Parallelism(),
                         "language": Parallelism(tp=args.language_tp, dp=language_ranks // args.language_tp)})

    llama_config, vit_config = LlamaConfig.from_hf(args.language), ViTConfig.from_hf(args.vision)
    with torch.device("meta"):  # shapes only: each rank allocates its own shards below
        llama = Llama(llama_config)
        vision = ModalityEncoder(ViT(vit_config), Projection(vit_config.dim, llama_config.dim))
    vision.encoder.requires_grad_(False)  # the tower stays frozen; its projector trains
    model = MimoModel(layout, llama, {"vision": vision},
                      options={"language": ParallelOptions(sp=args.language_tp > 1)})
    model.init_weights({"language": 0, "vision": 1})  # the fresh projector (the rest is loaded)
    if args.projector:  # a LLaVA directory fills the tower too: first, so that --vision's tower is the one kept
        model.load_hf({"vision": args.projector})
    model.load_hf({"language": args.language, "vision": args.vision})
    optimizer = MimoOptimizer(model, AdamWConfig(lr=args.lr, max_grad_norm=1.0))

    vocab = llama_config.vocab_size
    spec = SyntheticSpec(batch_size=2 * layout.parallelism("language").dp, seq_len=args.seq_len, vocab_size=vocab,
                         modalities={"vision": ModalitySpec.image(vit_config, special_token_id=vocab, max_items=1)})
    batches = [synthetic_batch(spec, seed) for seed in range(2)]
    if rank == 0:
        print(layout.describe())
        print(f"chance level ln({vocab}) = {math.log(vocab):.2f}")
    for step in range(args.steps):
        metrics = train_step(model, optimizer, batches[step % len(batches)])
        if rank == 0:
            print(f"step {step:3d}  loss {metrics.loss:.4f}  grad norm {metrics.grad_norm:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    main()
