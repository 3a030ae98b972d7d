"""Training throughput on your data: our trainer against plain transformers, same tiny task.

    python benchmarks/train_llava.py [--steps 80] [--repeats 2] [--out bench_results/train_llava.json]

The task of `examples/make_tiny_llava.py` (a SigLIP tower + a Qwen2 decoder on LLaVA conversations,
written to a temporary directory) is trained for `--steps` steps of 16 samples by:

- ``transformers``: one process, `LlavaForConditionalGeneration` built from the same two
  directories + `torch.optim.AdamW`, the same batches (our rows are LLaVA's: each ``<image>``
  expanded to the tower's tokens), the same token loss; all cores (2 intra-op threads here);
- ``ours heterogeneous``: `python -m dtensor_mimo.train --config examples/llava_tiny.toml`: the
  tower on rank 0, the decoder on rank 1, 2 microbatches overlapping (1 thread per rank);
- ``ours colocated``: both modules on both ranks (dp2 each), one microbatch; with FSDP2 (the
  default) and without it (parameters replicated, gradients all-reduced once per step);
- ``ours one rank`` against ``transformers (1 thread)``: the same work in one process each, the
  library's own overhead (bridge, per-module optimizers, metrics) without any parallelism.

Samples/s counts the steps after the first 10 (slowest rank, as the trainer logs it). Ratios are
against transformers measured in the same run; the machine is noisy, so each configuration runs
`--repeats` times and the best is kept.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CONFIG = os.path.join(ROOT, "examples", "llava_tiny.toml")
BATCH, SKIP = 16, 10
LAYOUTS = {
    "ours heterogeneous (image | language, 2 microbatches)": [],
    "ours one rank (1 thread)": ["--layout.language.offset", "0", "--pipeline.microbatches", "1"],
    "ours colocated (image dp2 + language dp2)": [
        "--layout.image.dp", "2", "--layout.image.offset", "0", "--layout.language.dp", "2",
        "--layout.language.offset", "0", "--pipeline.microbatches", "1"],
}
LAYOUTS["ours colocated, fsdp off (gradients all-reduced)"] = [
    *LAYOUTS["ours colocated (image dp2 + language dp2)"], "--options.image.fsdp", "false",
    "--options.language.fsdp", "false"]


def _make(out: str) -> None:
    spec = importlib.util.spec_from_file_location("make_tiny_llava", os.path.join(ROOT, "examples", "make_tiny_llava.py"))
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    make.write_checkpoints(out)
    make.write_data(out, train=512, val=16)


def ours(cwd: str, layout: list[str], steps: int) -> float:
    """Samples/s of the trainer after its first SKIP steps."""
    jsonl = os.path.join(cwd, "m.jsonl")
    if os.path.exists(jsonl):
        os.remove(jsonl)
    argv = [sys.executable, "-m", "dtensor_mimo.train", "--config", CONFIG, *layout, "--train.steps", str(steps),
            "--metrics.log_every", str(SKIP), "--metrics.jsonl", jsonl, "--metrics.progress", "off",
            "--train.generate", "0", "--checkpoint.export_hf", "none", "--data.heldout_samples", "16"]
    out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=1200)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    with open(jsonl) as f:
        records = [r for r in map(json.loads, f) if "step_s" in r and r["step"] > SKIP]
    mean_step = sum(r["step_s"] for r in records) / len(records)
    return BATCH / mean_step


def transformers_baseline(cwd: str, steps: int, threads: int) -> float:
    """Samples/s of LlavaForConditionalGeneration + AdamW on the trainer's own batches."""
    import torch
    import torch.nn.functional as F
    import transformers

    from dtensor_mimo.data import ResumableBatchSampler
    from dtensor_mimo.train.config import parse_args
    from dtensor_mimo.train.datasets import train_data
    from dtensor_mimo.train.modules import resolve

    torch.set_num_threads(threads)
    here = os.getcwd()
    os.chdir(cwd)
    try:
        config = parse_args(["--config", CONFIG])
        resolved = resolve(config)
        data = train_data(config, resolved)
        vision = transformers.AutoConfig.from_pretrained("ckpt/siglip")
        text = transformers.AutoConfig.from_pretrained("ckpt/lm")
    finally:
        os.chdir(here)
    image_id = resolved.tokenizer.convert_tokens_to_ids("<image>")
    llava = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_id,
                                     vision_feature_layer=-1, vision_feature_select_strategy="full",
                                     projector_hidden_act="gelu")
    model = transformers.LlavaForConditionalGeneration(llava).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    epochs = ResumableBatchSampler(len(data.train), BATCH, seed=0)
    sampler = (indices for _ in iter(int, 1) for indices in epochs)  # epoch after epoch
    start = 0.0
    for step in range(steps):
        if step == SKIP:
            start = time.perf_counter()
        batch = data.train.batch(next(sampler))
        images = batch.modalities["image"]
        logits = model(input_ids=batch.tokens, pixel_values=images.inputs if images.num_items else None).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten(), ignore_index=-100,
                               reduction="sum") / batch.loss_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return BATCH * (steps - SKIP) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="bench_results/train_llava.json")
    args = parser.parse_args()
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        _make(tmp)
        for _ in range(args.repeats):
            for name, run in [("transformers (1 process, 2 threads)", lambda: transformers_baseline(tmp, args.steps, 2)),
                              ("transformers (1 process, 1 thread)", lambda: transformers_baseline(tmp, args.steps, 1)),
                              *[(n, lambda layout=layout: ours(tmp, layout, args.steps)) for n, layout in LAYOUTS.items()]]:
                results[name] = max(results.get(name, 0.0), run())
    base = results["transformers (1 process, 2 threads)"]
    width = max(map(len, results))
    print(f"{'configuration':<{width}}  samples/s  vs transformers")
    for name, value in results.items():
        print(f"{name:<{width}}  {value:9.1f}  {value / base:14.2f}x")
    het, col = results[next(iter(LAYOUTS))], results[list(LAYOUTS)[2]]
    print(f"heterogeneous / colocated: {het / col:.2f}x")
    col_plain = results[list(LAYOUTS)[3]]
    print(f"heterogeneous / colocated without FSDP: {het / col_plain:.2f}x")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"samples_per_s": results, "ratio_vs_transformers": {k: v / base for k, v in results.items()},
                   "heterogeneous_over_colocated": het / col,
                   "heterogeneous_over_colocated_without_fsdp": het / col_plain, "steps": args.steps,
                   "batch": BATCH}, f, indent=2)


if __name__ == "__main__":
    main()
