"""Host dispatches per training step on tiny models: what a GPU's host launches when kernels are free.

    python benchmarks/step_ops.py [--cases ...] [--out bench_results/step_ops.json]

On a GPU a tiny model's step is bound by its host: every eager aten op is a dispatch (and most a
kernel launch), every compiled region a call with its guards and wrappers (and its kernels'
launches, or one CUDA-graph replay each with ``compile_mode="reduce-overhead"``). This counts
both for one training step (after 8 warm-up steps: compiles and recompiles done), on CPU,
with torch.profiler: the top-level aten ops (those not inside another aten op or a compiled
region) and the compiled calls (forward regions and backward nodes). It is a count of host
work, not a time: the time of each on a GPU is what `benchmarks/gpu.py` measures.

| case | model | step |
|---|---|---|
| llava eager / compiled per block / compiled whole | tiny `ViT` + `Projection` + `Llama` (`ViTConfig.tiny`, `LlamaConfig.tiny`), colocated on one rank, 2 images a sample | `train_step`, 2 microbatches; `ParallelOptions(compile=True)` (inductor) per block, or with ``compile_scope="module"`` |
| llama eager | `Llama` tiny, no encoder | `train_step` |
| transformers llama | `LlamaForCausalLM` of the same sizes (SDPA, no KV cache) | forward, cross entropy, backward, `clip_grad_norm_`, AdamW in the library's form (fused), `zero_grad` (the issue's reference stack) |

The models, batches and steps are `benchmarks/host_step.py`'s (`ours_step`, `transformers_step`).
Each case runs in a fresh process (world 1, gloo, one thread).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("llava eager", "llava compiled per block", "llava compiled whole", "llama eager", "transformers llama")
WARMUP = 8


def _count(step) -> dict:
    """Top-level aten ops (by name) and compiled-region calls of one `step()` under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops: collections.Counter = collections.Counter()
    compiled = 0
    for event in prof.events():
        names, parent = [], event.cpu_parent
        while parent is not None:
            names.append(parent.name)
            parent = parent.cpu_parent
        # a compiled forward (dynamo's region) or backward (AOT autograd's node), outermost only
        kind = next((k for k in ("Torch-Compiled Region", "CompiledFunctionBackward") if k in event.name), None)
        if kind is not None and not any(kind in n for n in names):
            compiled += 1
        elif event.name.startswith("aten::") and not any(n.startswith("aten::") or "Compiled" in n for n in names):
            ops[event.name] += 1
    return {"aten_ops": sum(ops.values()), "compiled_calls": compiled, "top": ops.most_common(8)}


def _step(case: str):
    """The step callable of one case (`host_step`'s models and batches), built in this process."""
    from host_step import ours_step, transformers_step

    if case == "transformers llama":
        return transformers_step()
    import torch.distributed as dist

    from dtensor_mimo import ParallelOptions

    dist.init_process_group("gloo")
    options = ParallelOptions(compile="compiled" in case, compile_scope="module" if case.endswith("whole") else "block")
    llava = case.startswith("llava")
    return ours_step(llava, 1, 2 if llava else 1, options)


def _worker(case: str) -> None:
    step, state = _step(case), {"i": 0}

    def next_step() -> None:
        step(state["i"])
        state["i"] += 1

    for _ in range(WARMUP):
        next_step()
    print(json.dumps(_count(next_step)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES, metavar="CASE")
    parser.add_argument("--out", default="bench_results/step_ops.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker)
        return
    env = {**os.environ, "PYTHONPATH": HERE, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": os.environ.get("MASTER_PORT", "29563"), "RANK": "0", "WORLD_SIZE": "1"}
    rows = {}
    print(f"{'case':<28}{'aten ops':>10}{'compiled calls':>16}  most frequent ops")
    for case in args.cases:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", case], capture_output=True,
                             text=True, env=env, cwd=HERE, timeout=900)
        if out.returncode:
            raise RuntimeError(f"{case} failed:\n{out.stderr[-3000:]}")
        rows[case] = r = json.loads(out.stdout.strip().splitlines()[-1])
        top = ", ".join(f"{name.removeprefix('aten::')} {n}" for name, n in r["top"][:5])
        print(f"{case:<28}{r['aten_ops']:>10}{r['compiled_calls']:>16}  {top}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"warmup": WARMUP, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
