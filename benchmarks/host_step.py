"""Host time of a training step on tiny models: this tree against another checkout, same run.

    python benchmarks/host_step.py [--baseline DIR] [--steps 40] [--repeats 3] [--out bench_results/host_step.json]

A tiny model's arithmetic takes a fraction of a millisecond, so its step time on one CPU thread is
the library's own host work: building the step (plans, program, microbatches), the crossings, the
schedules' bookkeeping, the optimizer. Each case runs `train_step` in a fresh process (gloo, one
intra-op thread, eager) and reports the median of `--steps` timed steps after 5 warm-up steps.
With ``--baseline DIR`` (e.g. ``git worktree add /tmp/base <commit>``) every case also runs with
that checkout's library (``PYTHONPATH``), the two alternating `--repeats` times so that machine
noise hits both alike; reported as this tree's time over the baseline's. Only public names are
used (``MimoModel``, ``MimoOptimizer``, ``train_step``, the models, ``synthetic_batch``), so any
checkout that has them can be the baseline.

| case | model | layout |
|---|---|---|
| llama | `Llama` tiny (dim 32, 2 layers), no encoder | world 1 |
| llava | tiny `ViT` + `Projection` + `Llama`, 2 images a sample | world 1, colocated |
| llava, 2 ranks, M=2 | the same | vision on rank 0, language on rank 1, 2 microbatches |
| transformers llama | `LlamaForCausalLM` of the same sizes (SDPA, no KV cache), `torch.optim.AdamW` in the library's form on the CPU (fused) with its hyperparameters and weight-decay groups, `clip_grad_norm_`, the same batches, the loss over the same tokens | one process |
| transformers llama, foreach AdamW | the same with `torch.optim.AdamW(foreach=True)` (the reference before 2026-11-29, while the library had already gone fused on CPU) | one process |
| llama / llava, compiled | `llama` or `llava` with every module compiled per block by inductor (`ParallelOptions(compile=True)`) | world 1 |
| llama / llava, compiled, C++ wrapper | the same with inductor's C++ wrapper (`compile_options={"cpp_wrapper": True}`): the compiled code calls its kernels from C++ | world 1 |
| llama / llava, compiled whole | each module compiled whole (`compile_scope="module"`): the encoder with its projection, the decoder with its head and loss, one graph each | world 1 |

The transformers cases are the plain single-model stack the issue-29 target compares against:
"llama / transformers" is the library's host time per step over it (target: at most 1.1). The
compiled cases are left out of the default ``--cases`` (each compiles in each of its processes)
and run with this tree only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Callable

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {"llama": (1, 1), "llava": (1, 1), "llava, 2 ranks, M=2": (2, 2), "transformers llama": (1, 1),
         "transformers llama, foreach AdamW": (1, 1)}
COMPILED = {f"{model}, compiled{wrapper}": {"compile_options": {"cpp_wrapper": True}} if wrapper else {}
            for model in ("llama", "llava") for wrapper in ("", ", C++ wrapper")}
COMPILED.update({f"{model}, compiled whole": {"compile_scope": "module"} for model in ("llama", "llava")})
"""`ParallelOptions(compile=True, **these)` for every module; world 1, one microbatch."""
REFERENCE = "transformers llama"
REFERENCES = {REFERENCE: None, "transformers llama, foreach AdamW": False}
"""The transformers cases and their AdamW form (`transformers_step`'s ``fused``); run once per
repeat whatever the trees (they use no dtensor_mimo step)."""


def transformers_step(fused: bool | None = None) -> Callable[[int], None]:
    """`step(i)`: `LlamaForCausalLM` of `LlamaConfig.tiny`'s sizes + AdamW + clip on `llama`'s
    batch ``i % 4``, one host read of the loss (built here, one thread). The library's step's work:
    AdamW with `AdamWConfig`'s hyperparameters and weight-decay groups (`AdamWConfig.decays`: no
    decay on norms and embeddings) in the form `MimoOptimizer` takes on the CPU (`fused` None:
    fused where torch has the kernel; True / False: fused / foreach), the mean cross entropy
    over the tokens with a label and a loss weight (`synthetic_batch` masks each document's
    prompt: labels set to -100 there, beforehand), no KV cache (transformers builds one in every
    forward unless told ``use_cache=False``: work a training step does not need)."""
    import torch
    import transformers
    from torch.nn import functional as F

    from dtensor_mimo.data import SyntheticSpec, synthetic_batch
    from dtensor_mimo.models import LlamaConfig
    from dtensor_mimo.optim import AdamWConfig
    from dtensor_mimo.optim.optimizer import _implementation

    torch.set_num_threads(1)
    torch.manual_seed(0)
    c, a = LlamaConfig.tiny(), AdamWConfig()
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_hidden, num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, max_position_embeddings=c.max_seq_len,
        rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta, attn_implementation="sdpa"))
    groups: dict[bool, list] = {True: [], False: []}
    for name, p in model.named_parameters():
        groups[a.decays(name, p)].append(p)
    form = _implementation(torch.device("cpu")) if fused is None else {"fused": True} if fused else {"foreach": True}
    optimizer = torch.optim.AdamW([{"params": groups[True], "weight_decay": a.weight_decay},
                                   {"params": groups[False], "weight_decay": 0.0}], lr=a.lr, betas=a.betas, eps=a.eps,
                                  **form)
    batches = []
    for s in range(4):
        b = synthetic_batch(SyntheticSpec.tiny(batch_size=8, modalities={}), seed=s)
        batches.append((b.tokens, b.labels.masked_fill(b.loss_mask == 0, -100)))

    def step(i: int) -> None:
        tokens, labels = batches[i % 4]
        logits = model(input_ids=tokens, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()

    return step


def _transformers_steps(steps: int, fused: bool | None = None) -> list[float]:
    """`transformers_step`'s seconds, after 5 warm-up steps."""
    import time

    step, times = transformers_step(fused), []
    for i in range(5 + steps):
        t0 = time.perf_counter()
        step(i)
        if i >= 5:
            times.append(time.perf_counter() - t0)
    return times


def ours_step(llava: bool, world: int, microbatches: int, options=None) -> Callable[[int], None]:
    """`step(i)`: `train_step` of the tiny `Llama` (with `llava`, a tiny `ViT` + `Projection`
    too, colocated at world 1, else vision on its own rank) on batch ``i % 4``, `microbatches`
    a step, every module with `options` (`ParallelOptions`; default the library's); built here,
    in the process group already initialised, one thread."""
    import torch

    from dtensor_mimo import MimoLayout, MimoModel, MimoOptimizer, Parallelism, PipelineConfig, train_step
    from dtensor_mimo.data import ModalitySpec, SyntheticSpec, synthetic_batch
    from dtensor_mimo.models import Llama, LlamaConfig, ModalityEncoder, Projection, ViT, ViTConfig

    torch.set_num_threads(1)
    llama = Llama(LlamaConfig.tiny())
    vit = ViTConfig.tiny()
    if not llava:
        layout, encoders, modalities = MimoLayout({"language": Parallelism()}), {}, {}
    else:
        encoders = {"vision": ModalityEncoder(ViT(vit), Projection(vit.dim, LlamaConfig.tiny().dim))}
        offsets = {"vision": 0, "language": 0} if world == 1 else None
        layout = MimoLayout({"vision": Parallelism(), "language": Parallelism()}, offsets=offsets)
        modalities = {"vision": ModalitySpec.image(vit, special_token_id=64)}
    pipeline = PipelineConfig(microbatches=microbatches) if microbatches > 1 else None
    model = MimoModel(layout, llama, encoders, pipeline=pipeline,
                      options={n: options for n in layout.names} if options is not None else None)
    model.init_weights({"language": 0, **{n: 1 for n in encoders}})
    optimizer = MimoOptimizer(model)
    batches = [synthetic_batch(SyntheticSpec.tiny(batch_size=8, modalities=modalities), seed=s) for s in range(4)]
    return lambda i: train_step(model, optimizer, batches[i % 4])


def _worker(case: str, steps: int) -> None:
    """One case in this process (a rank of its world); rank 0 prints the step times as JSON."""
    import time

    if case in REFERENCES:
        print(json.dumps(_transformers_steps(steps, fused=REFERENCES[case])))
        return

    import torch
    import torch.distributed as dist

    from dtensor_mimo import ParallelOptions

    dist.init_process_group("gloo")
    world, microbatches = CASES.get(case, (1, 1))
    options = ParallelOptions(compile=True, **COMPILED[case]) if case in COMPILED else None
    step = ours_step(case.startswith("llava"), world, microbatches, options)
    times = []
    for i in range(5 + steps):
        t0 = time.perf_counter()
        step(i)
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= 5:
            times.append(elapsed.item())
    if dist.get_rank() == 0:
        print(json.dumps(times))
    dist.destroy_process_group()


def run(tree: str, case: str, steps: int) -> list[float]:
    """Step seconds of one case with the library of `tree`, in fresh processes."""
    world, _ = CASES.get(case, (1, 1))
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    command = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
               f"--nproc-per-node={world}", os.path.abspath(__file__), "--worker", case, "--steps", str(steps)]
    out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tree, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{case} with {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="another checkout's root, measured in the same run")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=[*CASES, *COMPILED])
    parser.add_argument("--out", default="bench_results/host_step.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.steps)
        return
    trees = {"this tree": HERE, **({"baseline": os.path.abspath(args.baseline)} if args.baseline else {})}
    samples: dict[str, dict[str, list[float]]] = {c: {t: [] for t in trees} for c in args.cases}
    for _ in range(args.repeats):  # alternate: noise hits every tree alike
        for case in args.cases:
            for label, tree in (trees if case not in (*REFERENCES, *COMPILED) else {"this tree": HERE}).items():
                samples[case][label] += run(tree, case, args.steps)
    rows = []
    print(f"{'case':<32}" + "".join(f"{t + ' ms':>16}" for t in trees) + ("   this / baseline" if args.baseline else ""))
    for case in args.cases:
        medians = {t: statistics.median(v) * 1e3 for t, v in samples[case].items() if v}
        ratio = medians["this tree"] / medians["baseline"] if "baseline" in medians else None
        print(f"{case:<32}" + "".join(f"{m:>16.2f}" for m in medians.values())
              + (f"{ratio:>18.3f}" if ratio is not None else ""))
        rows.append({"case": case, "median_ms": medians, "ratio": ratio})
    for reference in REFERENCES:
        if reference in args.cases and "llama" in args.cases:
            over = {t: m / rows[args.cases.index(reference)]["median_ms"]["this tree"]
                    for t, m in rows[args.cases.index("llama")]["median_ms"].items()}
            print(f"llama / {reference} (host time per step): " + ", ".join(f"{t} {v:.3f}" for t, v in over.items()))
            rows.append({"case": f"llama / {reference}", "ratio_by_tree": over})
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"steps": args.steps, "repeats": args.repeats, "trees": trees, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
