"""Dynamic resolution against transformers: one varied-size task trained both ways, same batches.

    python benchmarks/variable_resolution.py [--steps 400] [--seeds 0 1 2] [--out bench_results/variable_resolution.json]

The task of `examples/make_tiny_llava.py` (coloured shapes; a SigLIP tower with a learned 4x4
grid of 4x4 patches + a Qwen2 decoder), its images resized to one of six sizes and aspect ratios
(`SIZES`), is trained for `--steps` steps of 16 samples by:

- ``ours``: the trainer (`Trainer`, one process, eager) with
  ``model.encoders.image.dynamic_resolution = true``: each image resized by `fit_image_size` into
  the tower's 256 pixels, aspect kept, giving its own (H/4)·(W/4) rows, the position grid
  interpolated;
- ``transformers``: `LlavaForConditionalGeneration` built from the same two directories, its
  projector given our projection's initial weights, on the trainer's own batches in the same order
  (the same pixels, token ids and labels: each ``<image>`` already expanded to that image's rows),
  one vision-tower call per image size with ``interpolate_pos_encoding=True``; AdamW with the trainer's
  groups (`AdamWConfig.decays`), lr, betas, eps, schedule (`LRSchedule.factor`) and global clip;
- ``ours, one size``: the trainer on the same image files, each resized to the tower's 16x16 (no
  dynamic resolution), the task's score when every image gives the same 16 rows.

Each is scored as the trainer scores: held-out exact match of the answer (teacher-forced argmax,
`exact_match`) and the held-out loss per answer token. ``step-1 loss`` shows that both start from
the same model on the same batch; ``max |loss diff| (first 20)`` how long they stay together.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import tempfile

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CONFIG = os.path.join(ROOT, "examples", "llava_tiny.toml")
SIZES = [(16, 16), (32, 32), (8, 8), (16, 32), (32, 16), (24, 12)]  # (H, W) of the image files
ONE_RANK = ["--layout.language.offset", "0", "--pipeline.microbatches", "1", "--train.threads", "1",
            "--train.eval_every", "0", "--train.generate", "0", "--checkpoint.export_hf", "none",
            "--metrics.progress", "off", "--metrics.log_every", "1", "--data.heldout_samples", "0"]
DYNAMIC = ["--model.encoders.image.dynamic_resolution", "true"]


def _make(out: str, train: int, val: int) -> None:
    spec = importlib.util.spec_from_file_location("make_tiny_llava", os.path.join(ROOT, "examples", "make_tiny_llava.py"))
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    make.write_checkpoints(out)
    make.write_data(out, train=train, val=val, sizes=SIZES)


def _argv(steps: int, seed: int, jsonl: str, extra: list[str]) -> list[str]:
    return ["--config", CONFIG, *ONE_RANK, "--train.steps", str(steps), "--data.seed", str(seed),
            "--model.encoders.image.seed", str(seed), "--metrics.jsonl", jsonl, *extra]


def _in(cwd: str, fn):
    here = os.getcwd()
    os.chdir(cwd)
    try:
        return fn()
    finally:
        os.chdir(here)


def ours(cwd: str, argv: list[str]) -> dict:
    """The trainer in this process (a world of one): held-out scores, per-step losses and the
    projection's initial weights (what the transformers model starts from)."""
    from torch.distributed.tensor import DTensor

    from dtensor_mimo.train.config import parse_args
    from dtensor_mimo.train.trainer import Trainer

    def run() -> dict:
        jsonl = argv[argv.index("--metrics.jsonl") + 1]
        if os.path.exists(jsonl):
            os.remove(jsonl)  # the logger appends
        trainer = Trainer(parse_args(argv))
        projection = {k.removeprefix("projection."): (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                      for k, v in trainer.model.module_parameters("image").items() if k.startswith("projection.")}
        trainer.run()
        with open(jsonl) as f:
            losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
        return {"scores": trainer.heldout_scores, "losses": losses, "projection": projection}

    return _in(cwd, run)


def llava_from(cwd: str, resolved, projection: dict[str, torch.Tensor]):
    """`LlavaForConditionalGeneration` whose tower and decoder are the trainer's directories and
    whose projector holds `projection` (our ``fc1``/``fc2`` = its ``linear_1``/``linear_2``)."""
    import transformers

    tower_dir, lm_dir = resolved.hf_paths["image"], resolved.hf_paths["language"]
    tower = transformers.SiglipVisionModel.from_pretrained(os.path.join(cwd, tower_dir))
    lm = transformers.Qwen2ForCausalLM.from_pretrained(os.path.join(cwd, lm_dir))
    config = transformers.LlavaConfig(vision_config=tower.config, text_config=lm.config,
                                      image_token_index=resolved.tokenizer.convert_tokens_to_ids("<image>"),
                                      vision_feature_layer=-1, vision_feature_select_strategy="full",
                                      projector_hidden_act="gelu")
    model = transformers.LlavaForConditionalGeneration(config)
    model.model.vision_tower.load_state_dict(tower.state_dict())
    model.model.language_model.load_state_dict(lm.model.state_dict())
    model.lm_head.load_state_dict(lm.lm_head.state_dict())
    projector = model.model.multi_modal_projector
    with torch.no_grad():
        for ours_name, theirs in (("fc1", projector.linear_1), ("fc2", projector.linear_2)):
            theirs.weight.copy_(projection[f"{ours_name}.weight"])
            theirs.bias.copy_(projection[f"{ours_name}.bias"])
    return model


def llava_logits(model, batch) -> torch.Tensor:
    """Logits of `batch` (token rows with each image's rows already expanded): the image features
    of one tower call per image (images of their own size), scattered into the token embeddings."""
    image_id = model.config.image_token_index
    embeds = model.get_input_embeddings()(batch.tokens)
    images = batch.modalities["image"]
    if images.num_items:
        by_size: dict[tuple[int, ...], list[int]] = {}  # one tower call per size
        for i, image in enumerate(images.inputs):
            by_size.setdefault(tuple(image.shape), []).append(i)
        rows: list[torch.Tensor] = [torch.empty(0)] * len(images.inputs)
        for members in by_size.values():
            out = model.model.get_image_features(
                pixel_values=torch.stack([images.inputs[i] for i in members]), vision_feature_layer=-1,
                vision_feature_select_strategy="full", interpolate_pos_encoding=True, output_hidden_states=True)
            for i, features in zip(members, out.pooler_output):
                rows[i] = features
        features = torch.cat(rows)
        mask = (batch.tokens == image_id)[..., None]
        if int(mask.sum()) != features.shape[0]:
            raise RuntimeError(f"{int(mask.sum())} image tokens but {features.shape[0]} feature rows")
        embeds = embeds.masked_scatter(mask, features.to(embeds.dtype))
    return model(inputs_embeds=embeds).logits


def _loss_sum(logits: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.nn.functional as F

    from dtensor_mimo.data import IGNORE_INDEX
    from dtensor_mimo.sequence.loss import loss_weights

    weights = loss_weights(batch.labels, batch.loss_mask)
    ce = F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten(), ignore_index=IGNORE_INDEX,
                         reduction="none")
    return (ce * weights.flatten()).sum(), weights.sum()


def transformers_run(cwd: str, argv: list[str], projection: dict[str, torch.Tensor]) -> dict:
    """LlavaForConditionalGeneration trained as the trainer trains, on its batches; scored as it scores."""
    from dtensor_mimo.data import ResumableBatchSampler
    from dtensor_mimo.train.config import parse_args
    from dtensor_mimo.train.datasets import train_data
    from dtensor_mimo.train.modules import resolve

    def load():
        config = parse_args(argv)
        resolved = resolve(config)
        return config, resolved, train_data(config, resolved)

    config, resolved, data = _in(cwd, load)
    model = llava_from(cwd, resolved, projection).train()
    adamw, schedule = config.optimizer.adamw, config.lr_schedule
    groups: dict[bool, list] = {True: [], False: []}
    for name, p in model.named_parameters():
        groups[adamw.decays(name, p)].append(p)
    optimizer = torch.optim.AdamW([{"params": groups[True], "weight_decay": adamw.weight_decay},
                                   {"params": groups[False], "weight_decay": 0.0}],
                                  lr=adamw.lr, betas=adamw.betas, eps=adamw.eps, foreach=True)
    sampler = ResumableBatchSampler(len(data.train), config.data.batch_size, seed=config.data.seed)
    batches = (indices for _ in iter(int, 1) for indices in sampler)  # epoch after epoch, as the trainer
    losses = []
    for step in range(config.train.steps):
        for group in optimizer.param_groups:
            group["lr"] = adamw.lr * schedule.factor(step)
        batch = _in(cwd, lambda: data.train.batch(next(batches)))
        total, weight = _loss_sum(llava_logits(model, batch), batch)
        loss = total / weight.clamp(min=1.0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if adamw.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), adamw.max_grad_norm)
        optimizer.step()
        losses.append(loss.item())
    return {"scores": _in(cwd, lambda: evaluate(model, data, config.data.batch_size)), "losses": losses}


@torch.no_grad()
def evaluate(model, data, batch_size: int) -> dict[str, float]:
    """`Trainer.evaluate` for a transformers model: exact match (the data's `score`) and loss."""
    model.eval()
    right: dict[str, int] = {}
    counted: dict[str, int] = {}
    loss_sum, weight = 0.0, 0.0
    heldout = data.heldout
    for start in range(0, len(heldout), batch_size):
        batch = heldout.batch(list(range(start, min(start + batch_size, len(heldout)))))
        logits = llava_logits(model, batch)
        total, w = _loss_sum(logits, batch)
        loss_sum, weight = loss_sum + float(total), weight + float(w)
        for name, (r, c) in data.score(batch, logits.argmax(-1)).items():
            right[name], counted[name] = right.get(name, 0) + r, counted.get(name, 0) + c
    return {**{k: right[k] / counted[k] for k in right}, "loss": loss_sum / weight}


def main() -> None:
    import torch.distributed as dist

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--train", type=int, default=1024, help="training samples")
    parser.add_argument("--val", type=int, default=256, help="held-out samples")
    parser.add_argument("--skip-one-size", action="store_true", help="leave out the one-size run")
    parser.add_argument("--out", default="bench_results/variable_resolution.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    runs: dict[str, list[dict]] = {"ours (dynamic_resolution)": [], "transformers (interpolate_pos_encoding)": []}
    if not args.skip_one_size:
        runs["ours, one size (16x16)"] = []
    with tempfile.TemporaryDirectory() as tmp:
        _make(tmp, args.train, args.val)
        jsonl = os.path.join(tmp, "m.jsonl")
        for seed in args.seeds:
            argv = _argv(args.steps, seed, jsonl, DYNAMIC)
            mine = ours(tmp, argv)
            theirs = transformers_run(tmp, argv, mine.pop("projection"))
            runs["ours (dynamic_resolution)"].append({"seed": seed, **mine})
            runs["transformers (interpolate_pos_encoding)"].append({"seed": seed, **theirs})
            if not args.skip_one_size:
                fixed = ours(tmp, _argv(args.steps, seed, jsonl, []))
                fixed.pop("projection")
                runs["ours, one size (16x16)"].append({"seed": seed, **fixed})
            for name, rs in runs.items():
                r = rs[-1]
                print(f"seed {seed} {name}: exact match {r['scores']['answer']:.3f} "
                      f"(with image {r['scores']['with image']:.3f}), held-out loss {r['scores']['loss']:.4f}, "
                      f"step-1 loss {r['losses'][0]:.6f}", flush=True)
    dist.destroy_process_group()

    def mean(rs: list[dict], key: str) -> float:
        return statistics.mean(r["scores"][key] for r in rs)

    reference = runs["transformers (interpolate_pos_encoding)"]
    width = max(map(len, runs))
    print(f"\n{args.steps} steps of 16 samples, seeds {args.seeds}, {args.val} held-out samples; images "
          f"{', '.join(f'{h}x{w}' for h, w in SIZES)}")
    print(f"{'run':<{width}}  exact match (per seed)       with image  held-out loss  step-1 loss  "
          "max |loss diff| first 20 / all")
    summary = {}
    for name, rs in runs.items():
        diffs = [max(abs(a - b) for a, b in zip(r["losses"][:n], t["losses"][:n]))
                 for n in (20, args.steps) for r, t in zip(rs, reference)]
        per_seed = " ".join(f"{r['scores']['answer']:.3f}" for r in rs)
        twenty = max(diffs[:len(rs)])
        every = max(diffs[len(rs):])
        summary[name] = {"exact_match": mean(rs, "answer"), "with_image": mean(rs, "with image"),
                         "heldout_loss": mean(rs, "loss"), "step1_loss": rs[0]["losses"][0],
                         "max_loss_diff_vs_transformers_first20": twenty, "max_loss_diff_vs_transformers": every}
        print(f"{name:<{width}}  {mean(rs, 'answer'):.3f} ({per_seed:<20})  {mean(rs, 'with image'):10.3f}  "
              f"{mean(rs, 'loss'):13.4f}  {rs[0]['losses'][0]:11.6f}  {twenty:.2e} / {every:.2e}")
    gap = (summary["ours (dynamic_resolution)"]["exact_match"]
           - summary["transformers (interpolate_pos_encoding)"]["exact_match"])
    print(f"ours - transformers (dynamic resolution): {gap:+.3f} exact match")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"steps": args.steps, "seeds": args.seeds, "sizes": SIZES, "train": args.train, "val": args.val,
                   "summary": summary,
                   "runs": {name: [{"seed": r["seed"], "scores": r["scores"], "losses": r["losses"]} for r in rs]
                            for name, rs in runs.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
