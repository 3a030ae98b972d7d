"""The trainer loop of `python -m dtensor_mimo.train`: the digits MIMO model on its layout.

One `Trainer` per rank, all built from the same `TrainerConfig` inside an initialized process
group. What a step does on a rank:

1. data: the sampler's next global batch of indices (the same on every rank); the rank builds the
   batch's token rows and per-sample item counts (metadata, small) and decodes only the encoder
   inputs of the items it encodes (`samples_to_load`): a language-only rank synthesizes no tone
   and reads no scan. Optionally in loader worker processes.
2. `train_step`: forward + backward through encoders, bridge and language model, the global
   norm, clip and AdamW.
3. every `metrics.log_every` steps: one MAX all-reduce of the per-phase times, a log line and a
   JSONL record on rank 0; checkpoints every `checkpoint.every` steps; held-out evaluation every
   `train.eval_every` steps and at the end, which prints ``held-out accuracy: 0.xx``.
"""

from __future__ import annotations

import dataclasses
import math
import resource
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from dtensor_mimo.data import (
    IGNORE_INDEX,
    TEXT_VOCAB,
    DigitsDataset,
    DigitsTask,
    MimoBatch,
    ResumableBatchSampler,
    answer_digit_positions,
    decode,
    encode,
    samples_to_load,
)
from dtensor_mimo.mimo import MimoModel
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
from dtensor_mimo.parallelize import ParallelOptions
from dtensor_mimo.schedule import PipelineConfig
from dtensor_mimo.train import checkpoint
from dtensor_mimo.train.config import MODULES, TrainerConfig, build_layout
from dtensor_mimo.train.metrics import MetricsLogger, peak_tflops, transformer_flops
from dtensor_mimo.train.optimizer import AdamWConfig, LRSchedule, MimoOptimizer
from dtensor_mimo.train.step import train_step

TRAIN_SAMPLES = 1_000_000
"""Samples of the training split (each drawn from its index alone; an epoch is this many)."""


# ---------------------------------------------------------------------------- the model


def model_configs(config: TrainerConfig, seq_len: int) -> tuple[LlamaConfig, ViTConfig, AudioConfig]:
    """The three modules' configs: 8x8 scans in 4x4 patches, 16-mel tone clips of 16 frames."""
    m = config.model
    llama = LlamaConfig(vocab_size=len(TEXT_VOCAB), dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads,
                        n_kv_heads=m.n_kv_heads, ffn_hidden=m.ffn_hidden, max_seq_len=seq_len)
    vision = ViTConfig(image_size=8, patch_size=4, in_channels=1, dim=m.encoder_dim,
                       n_layers=m.encoder_layers, n_heads=m.encoder_heads, mlp_hidden=m.encoder_mlp)
    audio = AudioConfig(n_mels=16, max_frames=16, conv_strides=(2, 2), dim=m.encoder_dim,
                        n_layers=m.encoder_layers, n_heads=m.encoder_heads, mlp_hidden=m.encoder_mlp)
    return llama, vision, audio


def module_seeds(config: TrainerConfig) -> dict[str, int]:
    """Each module's init seed (`model.seeds` over the defaults)."""
    return {"language": 0, "vision": 10, "audio": 20} | config.model.seeds


def build_modules(config: TrainerConfig, seq_len: int, meta: bool = False) -> dict[str, torch.nn.Module]:
    """The full modules, frozen towers marked: ``{"vision": ModalityEncoder, "audio":
    ModalityEncoder, "language": Llama}``, initialized from `module_seeds` (the same on every
    rank), or with `meta` left on the meta device for `MimoModel.init_weights` (no memory)."""
    llama_cfg, vision_cfg, audio_cfg = model_configs(config, seq_len)
    with torch.device("meta" if meta else "cpu"):
        modules: dict[str, torch.nn.Module] = {
            "vision": ModalityEncoder(ViT(vision_cfg), Projection(vision_cfg.dim, llama_cfg.dim)),
            "audio": ModalityEncoder(AudioEncoder(audio_cfg), Projection(audio_cfg.dim, llama_cfg.dim)),
            "language": Llama(llama_cfg),
        }
    for name, module in modules.items():
        if not meta:
            module.init_weights(module_seeds(config)[name])
    for name in config.model.frozen:  # the tower; its projection to the language width trains
        modules[name].encoder.requires_grad_(False)
    return modules


def sequence_length(config: TrainerConfig, minimum: int) -> int:
    """`minimum` rounded up so cp (2·cp chunks) and sp (tp shards) divide it."""
    lang = config.layout.language
    multiple = math.lcm(2 * lang.cp if lang.cp > 1 else 1, lang.tp)
    return -(-minimum // multiple) * multiple


# ---------------------------------------------------------------------------- data


class _Batches(Dataset):
    """A dataset whose item at a list of indices is this rank's view of that global batch."""

    def __init__(self, dataset: DigitsDataset, load: dict[str, list[int]] | None) -> None:
        self.dataset, self.load = dataset, load

    def __getitem__(self, indices: list[int]) -> MimoBatch:
        return self.dataset.batch(indices, load=self.load)

    def __len__(self) -> int:
        return len(self.dataset)


class _Forever:
    """Epoch after epoch of a `ResumableBatchSampler`."""

    def __init__(self, sampler: ResumableBatchSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield from self.sampler


# ---------------------------------------------------------------------------- the trainer


class Trainer:
    """Builds the model, data, optimizer, metrics and checkpoints of `config` on this rank.

    Call on every rank of an initialized process group whose size is the layout's world size;
    `run` trains and returns the final held-out accuracy (the same on every rank).
    """

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.layout = build_layout(config, self.world)
        if config.train.threads:
            torch.set_num_threads(config.train.threads)
        d = config.data
        task = DigitsTask(max_images=d.max_images, max_tones=d.max_tones, noise_std=d.noise_std)
        probe = DigitsDataset("train", *model_configs(config, 64)[1:], num_samples=1, task=task)
        self.seq_len = sequence_length(config, probe.min_seq_len)
        # On the meta device: each rank allocates and initializes only its own shards, below.
        self.modules = build_modules(config, self.seq_len, meta=True)
        llama_cfg, vision_cfg, audio_cfg = model_configs(config, self.seq_len)
        self.train_set = DigitsDataset("train", vision_cfg, audio_cfg, TRAIN_SAMPLES, seed=d.seed,
                                       task=task, seq_len=self.seq_len)
        self.heldout = DigitsDataset("heldout", vision_cfg, audio_cfg, d.heldout_samples, seed=d.seed,
                                     task=task, seq_len=self.seq_len)
        self.sampler = ResumableBatchSampler(TRAIN_SAMPLES, d.batch_size, seed=d.seed)
        self.expected_keys = checkpoint.expected_shapes(self.modules)
        self.flops_per_step = self._flops()

        p = config.pipeline
        self.model = MimoModel(
            self.layout, self.modules["language"],
            {n: self.modules[n] for n in ("vision", "audio")},
            options={n: ParallelOptions(**dataclasses.asdict(getattr(config.options, n))) for n in MODULES},
            device_type=config.train.device, bridge_hops=config.layout.bridge_hops,
            pipeline=PipelineConfig(microbatches=p.microbatches, schedule=p.schedule,
                                    virtual_stages=p.virtual_stages,
                                    split=tuple(p.split) if p.split is not None else None))
        self.model.init_weights(module_seeds(config))  # a resumed run then loads over it
        o = config.optimizer
        self.warmup = o.warmup_steps if o.warmup_steps < config.train.steps else config.train.steps // 2
        adamw = AdamWConfig(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                            max_grad_norm=o.max_grad_norm)
        self.optimizer = MimoOptimizer(
            self.model, adamw, per_module={n: dataclasses.replace(adamw, lr=lr) for n, lr in o.module_lr.items()},
            schedule=LRSchedule(warmup_steps=self.warmup, decay=o.decay, total_steps=config.train.steps,
                                min_lr_ratio=o.min_lr_ratio))
        m = config.metrics
        self.log = MetricsLogger(self.rank == 0, config.train.steps, m.jsonl, m.tensorboard, m.progress)
        self.peak = peak_tflops(self.model.device, m.peak_tflops)
        self.step = 0

    # ------------------------------------------------------------------ pieces
    def _flops(self) -> float:
        """Model FLOPs of one step: the language model over every token row, each encoder over
        its items (2·params per token forward, x3 when trained; attention counted dense)."""
        c, b = self.config, self.config.data.batch_size
        expected_items = {"vision": c.data.max_images / 2, "audio": c.data.max_tones / 2}
        llama = self.modules["language"]
        total = transformer_flops(sum(p.numel() for n, p in llama.named_parameters() if "embed" not in n),
                                  b * self.seq_len, c.model.n_layers, c.model.dim, self.seq_len, True)
        for name in ("vision", "audio"):
            enc = self.modules[name]
            tokens_per_item = (self.train_set.tokens_per_image if name == "vision"
                               else self.train_set.tokens_per_clip)
            tokens = int(b * expected_items[name] * tokens_per_item)
            tower_trains = name not in c.model.frozen
            total += transformer_flops(sum(p.numel() for p in enc.encoder.parameters()), tokens,
                                       c.model.encoder_layers, c.model.encoder_dim, tokens_per_item, tower_trains)
            total += transformer_flops(sum(p.numel() for p in enc.projection.parameters()), tokens, 0, 0, 0, True)
        return total

    def _load_plan(self, batch_size: int, microbatches: int) -> dict[str, list[int]] | None:
        if not self.config.data.per_rank_loading:
            return None
        return samples_to_load(self.layout, self.rank, batch_size, microbatches)

    def _batches(self) -> Iterator[MimoBatch]:
        """This rank's view of the global batches from the sampler's position on; the sampler
        advances as batches are consumed (its state is the checkpoint's data position)."""
        load = self._load_plan(self.config.data.batch_size, self.config.pipeline.microbatches)
        workers = self.config.data.workers
        if workers == 0:
            for indices in _Forever(self.sampler):
                yield self.train_set.batch(indices, load=load)
            return
        ahead = ResumableBatchSampler(TRAIN_SAMPLES, self.config.data.batch_size, seed=self.config.data.seed)
        ahead.load_state_dict(self.sampler.state_dict())  # the loader's own copy runs ahead
        loader = DataLoader(_Batches(self.train_set, load), sampler=_Forever(ahead), batch_size=None,
                            num_workers=workers, collate_fn=lambda b: b, persistent_workers=True)
        for batch, _ in zip(loader, _Forever(self.sampler)):
            yield batch

    def trainer_state(self) -> dict[str, Any]:
        return {"step": self.step, "updates": self.optimizer.updates, "sampler": self.sampler.state_dict()}

    def save(self) -> None:
        c = self.config.checkpoint
        path = checkpoint.save(c.dir, self.step, self.model, self.optimizer, self.trainer_state(), c.keep)
        self.log.print(f"step {self.step}: saved {path}")

    def restore(self) -> None:
        """Resume from `checkpoint.dir`'s latest checkpoint, else start from `checkpoint.load`."""
        c = self.config.checkpoint
        # Rank 0 picks; every rank then loads the same path or raises together (`checkpoint.load`).
        chosen = [((checkpoint.latest_checkpoint(c.dir) if c.dir else None) or c.load) if self.rank == 0 else None]
        dist.broadcast_object_list(chosen, src=0)
        path = chosen[0]
        if path is None:
            return
        state = checkpoint.load(path, self.model, self.optimizer, self.expected_keys)
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        self.log.print(f"resumed from {path} at step {self.step}")

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, float]:
        """Held-out exact match of the whole answer and of each modality's digits (teacher-forced
        argmax over the answer tokens, which equals greedy decoding's answer)."""
        b = self.config.data.batch_size
        right = {"answer": 0, "vision": 0, "audio": 0}
        counted = dict.fromkeys(right, 0)
        for start in range(0, len(self.heldout), b):
            indices = list(range(start, min(start + b, len(self.heldout))))
            batch = self.heldout.batch(indices, load=self._load_plan(len(indices), 1))
            pred = self.model.predict(batch).cpu()
            scored = batch.labels != IGNORE_INDEX
            wrong = (pred != batch.labels) & scored
            masks = {"answer": scored, **answer_digit_positions(batch.labels)}
            for name, mask in masks.items():
                rows = (scored & mask).any(-1)
                counted[name] += int(rows.sum())
                right[name] += int((~(wrong & mask).any(-1) & rows).sum())
        return {k: right[k] / counted[k] if counted[k] else float("nan") for k in right}

    def captions(self, n: int) -> list[tuple[str, str]]:
        """Greedy captions of the first `n` held-out samples: (expected answer, generated)."""
        batch = self.heldout.batch(range(n), load=self._load_plan(n, 1))
        question, eos = encode("?")[0], encode("<eos>")[0]
        prompts = [int((row == question).nonzero()[0]) + 1 for row in batch.tokens]
        out = self.model.generate(batch, prompts, self.seq_len - max(prompts), stop_token=eos)
        return [(self.heldout[i].answer(), decode(ids)) for i, ids in enumerate(out)]

    # ------------------------------------------------------------------ the loop
    def run(self) -> float:
        c = self.config
        self.log.print(c.describe())
        self.log.print(self.layout.describe())
        params = {n: sum(p.numel() for p in m.parameters()) for n, m in self.modules.items()}
        self.log.print("parameters: " + ", ".join(f"{n} {v:,}" for n, v in params.items()) +
                       f"; seq_len {self.seq_len}; batch {c.data.batch_size}")
        if self.warmup != c.optimizer.warmup_steps:
            self.log.print(f"optimizer.warmup_steps = {c.optimizer.warmup_steps} is not below train.steps = "
                           f"{c.train.steps}: warming up for {self.warmup} steps")
        self.restore()
        self.log.start_at(self.step)
        batches = self._batches()
        tokens = c.data.batch_size * self.seq_len
        window: list[list[float]] = []
        while self.step < c.train.steps:
            t0 = time.perf_counter()
            batch = next(batches)
            timings: dict[str, float] = {}
            data_s = time.perf_counter() - t0
            lr = self.optimizer.lrs()["language"]  # what this step's update uses
            metrics = train_step(self.model, self.optimizer, batch, timings)
            self.step += 1
            window.append([data_s, timings["forward_backward"], timings["optimizer"], time.perf_counter() - t0])
            self.log.tick(self.step, metrics.loss)
            if self.step % c.metrics.log_every == 0 or self.step == c.train.steps:
                self._log(metrics, lr, window, tokens)
                window = []
            if c.checkpoint.dir and ((c.checkpoint.every and self.step % c.checkpoint.every == 0)
                                     or self.step == c.train.steps):
                self.save()
            if c.train.eval_every and self.step % c.train.eval_every == 0 and self.step < c.train.steps:
                self._report_eval()
        accuracy = self._report_eval()
        for expected, got in self.captions(min(c.train.generate, len(self.heldout))) if c.train.generate else ():
            self.log.print(f"  expected: {expected:<28} generated: {got}")
        self.log.print(f"held-out accuracy: {accuracy:.2f}")
        self.log.close()
        return accuracy

    def _report_eval(self) -> float:
        acc = self.evaluate()
        self.log.log({"step": self.step, **{f"heldout_{k}": v for k, v in acc.items()}},
                     f"step {self.step}: held-out exact match {acc['answer']:.3f} "
                     f"(image digits {acc['vision']:.3f}, tone digits {acc['audio']:.3f})")
        return acc["answer"]

    def _log(self, metrics, lr: float, window: list[list[float]], tokens: int) -> None:
        """One MAX all-reduce of this window's mean phase times and peak memory; rank 0 logs."""
        mean = torch.tensor(window, dtype=torch.float64).mean(0)
        memory = (torch.cuda.max_memory_allocated(self.model.device) if self.model.device.type == "cuda"
                  else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        times = torch.cat([mean, torch.tensor([float(memory)], dtype=torch.float64)]).to(self.model.device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        data_s, fb_s, opt_s, step_s, memory = times.tolist()
        tflops = self.flops_per_step / step_s / 1e12
        mfu = tflops / (self.peak * self.world) if self.peak else None
        record = {"step": self.step, "loss": metrics.loss, "grad_norm": metrics.grad_norm,
                  "tokens_per_s": tokens / step_s, "lr": lr,
                  "step_s": step_s, "data_s": data_s, "forward_backward_s": fb_s, "optimizer_s": opt_s,
                  "peak_memory_gib": memory / 2**30, "tflops": tflops, "mfu": mfu,
                  "skipped": metrics.skipped,
                  **{f"grad_norm_{n}": v for n, v in metrics.module_grad_norms.items()}}
        self.log.log(record, f"step {self.step:>5} | loss {metrics.loss:.4f} | grad norm {metrics.grad_norm:.3f} | "
                             f"lr {record['lr']:.2e} | {record['tokens_per_s']:,.0f} tok/s | step "
                             f"{step_s * 1e3:.1f} ms (data {data_s * 1e3:.1f}, fwd+bwd {fb_s * 1e3:.1f}, "
                             f"optim {opt_s * 1e3:.1f}) | mem {record['peak_memory_gib']:.2f} GiB | "
                             + (f"MFU {mfu:.1%}" if mfu is not None else f"{tflops * 1e3:.1f} GFLOP/s"))
