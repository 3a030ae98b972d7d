"""One GPU: the library against plain transformers, same batches, same run — the project's own GPU benchmark.

    python benchmarks/gpu.py [--budget 540] [--cases ...] [--steps 10] [--warmup 5] [--record]
    python benchmarks/gpu.py --tiny          # the CPU check: tiny sizes, aot_eager, no record

On a lent machine without network (torch and transformers there; torchao carried as a wheel in
`.whl/`, which `.git/info/exclude` ignores; the device README says how to fetch it), one call:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site; PYTHONUNBUFFERED=1 python3 benchmarks/gpu.py --record --profile --budget 540 \
      --out $OUT/gpu.json 2>&1 | tee $OUT/log; cp benchmarks/RESULTS.md $OUT/   # + $OUT/gpu.profile.txt

Each case runs in a fresh process (its own compile caches and memory) on the same batches (in
pinned host memory on CUDA, as the trainer's loader gives them; transformers' LM takes its
batches already on the device); the cases run in priority order (`CASES`) until `--budget`
seconds are spent, the JSON rewritten after each, so a short lease still leaves the most
important figures:

| section | case | what |
|---|---|---|
| lm | ours | `Llama` through `MimoModel` (world 1) + `MimoOptimizer` + `train_step`: bf16 compute (`ParallelOptions(param_dtype="bf16")`, fp32 master weights), per-block compile, fused AdamW; first checks the chunked loss's compiled arithmetic against its eager form on the GPU, and its head's weight gradient summed inside the matmul (`loss_sums_in_matmul`: CUDA's `baddbmm` with `out_dtype`) against the separate add of each chunk's bf16 product, both against fp32 sums |
| lm | ours fp8 tensorwise / rowwise | the same with `ParallelOptions(fp8=...)`: torchao float8 training of the Linear layers where it pays on CUDA (`fp8_pays`), not the output head; `tuned`: with inductor's coordinate-descent tuning of its kernels' launch configs (`compile_options={"coordinate_descent_tuning": True}`): the float8 casts' amax reductions and transposing casts took 34 of the 2026-11-28 tensorwise step's 197 ms of device work, two of them several times slower than their bytes take at the card's bandwidth (an estimate); `tuned nd`: also inductor's n-d tilings of pointwise and reduction kernels (`triton.prefer_nd_tiling`, `triton.tile_reductions`), for the casts that write a tensor and its transpose (pytorch/pytorch#130015) |
| lm | ours packed (flex) | the same on rows packed with documents of 64-1024 tokens (document ids and positions): attention through the masked SDPA chunks, or with `ParallelOptions(flex_attention=True)` through FlexAttention over a block mask; the flex case first checks its outputs and gradients against the masked path on the GPU (fp32) |
| lm | ours 8b blocks / ours fp8 tensorwise 8b blocks | `lm ours` and its fp8 tensorwise form on four blocks of Llama 3 8B's shape (dim 4096, 32 / 8 heads, ffn 14,336; vocab 32,000), batch 2 x 4096: float8 where its matmuls are large (at 1B, 4 x 4096, torchao's casts hold fp8 to about 1.16x) |
| lm | ours fsdp2 bf16 | the same with FSDP2's `MixedPrecisionPolicy` on its mesh of one rank instead of autocast (which mixed-precision form is faster at dp = 1; at dp > 1 the library uses FSDP2's) |
| lm | ours unchunked loss | the same with `ParallelOptions(chunked_loss=False)`: plain `[tokens, vocab]` logits (time and peak memory of the chunked head + loss) |
| lm | ours checkpoint | `lm ours` saving its parameters and AdamW state (12 GiB at 1B) into a temporary directory (under `$CHECKPOINT_DIR` if set): what the step that saves waits for synchronously (`checkpoint.save`) and in the background (`BackgroundSaves`) into pageable and into pinned host buffers (`checkpoint.async_mode = "async"` / `"async_with_pinned_mem"`), each twice (the first save allocates); how long each write takes, the steps timed while the second is written, and that the copy holds the device's values |
| lm | transformers (compiled) | `LlamaForCausalLM` of the same sizes (SDPA), fp32 weights under bf16 autocast, fused AdamW with ours' hyperparameters and weight-decay groups (`_adamw`), clip 1.0; eager, or each decoder layer compiled (as ours) |
| vlm | ours | a SigLIP tower + LLaVA projector (`ModalityEncoder(ViT, Projection)`) and a Qwen2 decoder (`Llama`) colocated on the one rank, both bf16 + per-block compile, through `MimoModel` + `train_step` |
| vlm | transformers (compiled) | `LlavaForConditionalGeneration` of the same config (SDPA, fp32 weights under bf16 autocast, fused AdamW as ours, clip 1.0); eager, or each tower layer, each decoder layer and the projector compiled |
| vlm | ours whole | each stack compiled whole (`compile_scope="module"`) without CUDA graphs: what the scope alone gives |
| vlm | ours cpp wrapper | `vlm ours` with inductor's C++ wrapper (`ParallelOptions(compile_options={"cpp_wrapper": True})`): each compiled graph calls its kernels from C++, not Python (on one CPU thread, `benchmarks/host_step.py`'s compiled cases measure it). It builds its wrappers with the CUDA headers of a CUDA toolkit, or else of the `nvidia` wheels that torch's CUDA build installs (`_wrapper_toolkit`) |
| vlm | ours fp8 | `vlm ours` with `ParallelOptions(fp8="tensorwise")` on both modules: the encoder's float8 layers take any number of image rows (196 an image; torchao's `pad_inner_dim` for the weight gradient's matmul, which takes multiples of 16 on CUDA); compared with `vlm ours` (no target: the tower's and decoder's layers at these widths are mostly where float8 does not pay) |
| vlm | ours all rows | `vlm ours` with the chunked head on every row, as before 2026-11-27 (8): what running it on the loss rows only gives |
| lm, vlm | ours cudagraphs | the same with `ParallelOptions(compile_mode="reduce-overhead")`: each compiled piece's forward and backward replay as CUDA graphs (torch's cudagraph trees); the LM's pieces are its blocks, the VLM's its modules whole (`compile_scope="module"`: the ViT with its projection, the decoder with its head and loss); first checks its first 5 steps' losses and gradient norms against the same model in eager on the GPU (`_graphs_check`), and reports inductor's reasons for any piece it ran without graphs (`cudagraph_skips`); also the LM in fp8 tensorwise (its 2026-11-27 step left the device idle 40 ms of 217: float8's casts double each compiled backward's launches) |
| tiny | trainer | the README's tiny LLaVA task (`examples/make_tiny_llava.py`, `examples/llava_tiny.toml`, eager) through `python -m dtensor_mimo.train` on the device, world 1: its logged step time (issue 29 asks for < 15 ms); also with per-block compile (on CPU it cuts the top-level aten ops of a step from 1,894 to 826: the host's launch work on a GPU), with each module compiled whole (`compile_scope = "module"`), the same in CUDA graphs (`compile_mode = "reduce-overhead"`), and with the prefetch thread (`data.workers = 0`, `thread`) instead of the default loader process on GPUs; with `--profile`, the trainer's own record of two steps mid-run (`metrics.profile`) |

Sizes (default, issue 29's): LM Llama 1.04B (dim 2048, 16 layers, 32 / 8 heads, ffn 8192, vocab
32000), batch 4 x 4096 tokens. VLM: SigLIP-base tower (768 x 12, 224 px / 16: 196 rows an image)
and a Qwen2 0.4B decoder (896 x 24, 14 / 2 heads, ffn 4864, vocab 32000), 32 samples x 512 tokens
with 0-2 images each (`synthetic_batch`: 1 on average). Both sides build the VLM from one
``LlavaConfig`` (ours through `ViTConfig.from_hf` / `LlamaConfig.from_hf` of it); `--tiny` also
checks that ours, loaded from transformers' weights (`MimoModel.load_hf`), gives transformers'
loss on the same batch, so the two run the same model. 42-46% of the VLM's positions carry a loss
weight (the rest are image rows and masked prompts): transformers' head computes logits for every
row, ours for those (`linear_token_loss_sum`'s ``counted``), with the same loss and gradients.

A case's step time is the mean over `--steps` steps (twice as many for the VLM, whose rounds
varied by 11% on the H200 at 10: 143-160 ms) timed between two device syncs (after `--warmup`
steps: compilation), three times, the median kept; work the host queues ahead counts as it runs. MFU is model FLOPs (the trainer's formula, `dtensor_mimo.train.metrics.transformer_flops`:
6 x the non-embedding parameters x tokens + attention, per module) over the step time over the
card's dense bf16 peak (`peak_tflops`). `--record` appends the rows to `benchmarks/RESULTS.md`, under a
heading with the date, the card and the versions of torch, transformers and torchao (the JSON
has them too). Runs on torch 2.11 and 2.13 with transformers 5.x (`make test-torch2.11` checks
the library on the GPU machines' torch 2.11 and transformers 5.17 on CPU), nothing else; the fp8
cases need torchao (`pip install 'dtensor_mimo[fp8]'`, a 3.4 MB wheel to carry) and a GPU of
compute capability 8.9+, else they fail alone, by name.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

LM = {"default": dict(vocab=32000, dim=2048, layers=16, heads=32, kv_heads=8, ffn=8192, batch=4, seq=4096),
      "wide": dict(vocab=32000, dim=4096, layers=4, heads=32, kv_heads=8, ffn=14336, batch=2, seq=4096),
      "tiny": dict(vocab=256, dim=64, layers=2, heads=4, kv_heads=2, ffn=128, batch=2, seq=64)}
VLM = {"default": dict(image=224, patch=16, vdim=768, vlayers=12, vheads=12, vmlp=3072,
                       vocab=32000, dim=896, layers=24, heads=14, kv_heads=2, ffn=4864, batch=32, seq=512),
       "tiny": dict(image=32, patch=8, vdim=32, vlayers=2, vheads=2, vmlp=64,
                    vocab=256, dim=64, layers=2, heads=4, kv_heads=2, ffn=128, batch=4, seq=64)}
# Priority order: what issue 29's "Done when" needs first, so that a short lease measures it.
# First the tiny task in CUDA graphs (the target still open that changed most since its last
# lease: 6 graph replays a step instead of 12, the loss in the decoder's graph), then the pairs
# the ratios need, then fp8 where its casts weigh less (blocks of Llama 3 8B's shape) or
# may cost less (inductor's n-d tilings), then the cases no lease has measured yet: FSDP2's
# mixed precision against autocast at dp = 1 (the "which form is fastest"), each VLM
# stack compiled whole without graphs and the VLM per block with the C++ wrapper (its
# per-block step was host-bound: idle 32 of 140 ms, mostly around the ViT's blocks, each 0.3-0.8
# ms of device work after 1.3-1.8 ms of host), the VLM in fp8 (the encoder's ragged rows in float8
# on CUDA: never run on a GPU yet), then what a save of the 1B LM's state costs its
# step in each checkpoint mode (pinned host buffers: `checkpoint.async_mode = "async_with_pinned_mem"`).
CASES = ("tiny trainer cudagraphs", "lm ours", "lm transformers compiled", "vlm ours", "vlm transformers compiled",
         "lm ours fp8 tensorwise", "lm ours 8b blocks", "lm ours fp8 tensorwise 8b blocks",
         "lm ours fp8 tensorwise tuned nd", "lm ours fsdp2 bf16", "vlm ours whole", "vlm ours cpp wrapper",
         "vlm ours fp8",
         "tiny trainer cudagraphs thread", "lm ours fp8 tensorwise tuned", "vlm ours cudagraphs", "lm ours checkpoint",
         "tiny trainer", "tiny trainer whole", "lm ours cudagraphs", "lm ours fp8 tensorwise cudagraphs",
         "lm ours unchunked loss", "lm ours packed", "lm ours packed flex", "lm ours fp8 rowwise",
         "tiny trainer compiled", "tiny trainer thread", "vlm ours all rows", "vlm transformers", "lm transformers")
TINY = {"tiny trainer": [], "tiny trainer thread": ["--data.workers", "0"],
        "tiny trainer compiled": [f"--options.{m}.compile=true" for m in ("image", "language")],
        "tiny trainer whole": [f"--options.{m}.{o}" for m in ("image", "language")
                               for o in ("compile=true", "compile_scope=module")],
        "tiny trainer cudagraphs": [f"--options.{m}.{o}" for m in ("image", "language")
                                    for o in ("compile=true", "compile_scope=module", "compile_mode=reduce-overhead")]}
# The loader on a thread of the rank (`data.workers = 0`) instead of the default loader process on
# GPUs: its Python (about 5 ms a batch on CPU: tokens, decode, collate) takes the GIL from a
# host-bound step's main thread (the H200's tiny step in CUDA graphs: 26.0 ms against 20.6).
TINY["tiny trainer cudagraphs thread"] = [*TINY["tiny trainer cudagraphs"], "--data.workers", "0"]
GRAPHS = " cudagraphs"  # the CUDA-graph cases' suffix: ParallelOptions(compile_mode="reduce-overhead")
WRAPPER = " cpp wrapper"  # ParallelOptions(compile_options={"cpp_wrapper": True}): inductor's C++ wrapper
FP8 = "lm ours fp8 "  # the fp8 cases' prefix; the recipe follows
TUNED = " tuned"  # ParallelOptions(compile_options={"coordinate_descent_tuning": True})
ND = " nd"  # and {"triton.prefer_nd_tiling": True, "triton.tile_reductions": True}
WIDE = " 8b blocks"  # LM["wide"]: blocks of Llama 3 8B's shape
CHECKPOINT = "lm ours checkpoint"  # `lm ours` saving its state: the step's stall per checkpoint mode


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


# --profile: each timed case then runs two more steps under torch.profiler; its table (kernels by
# device time on a GPU, ops by CPU time on the CPU) and, on a GPU, where the device waited
# (`_device_gaps`), device work by the library's phase (`_phase_work`) and what each compiled graph
# launched (`_graph_work`) land here and in the case's JSON.
PROFILE: dict[str, str | bool | float | None] = {"on": False, "table": "", "idle_ms": None}


def _timed(step, device: str, warmup: int, steps: int) -> list[float]:
    """Per-step seconds: warm-up, then `steps` steps between two syncs (their mean), three times."""
    for i in range(warmup):
        step(i)
    rounds = []
    for r in range(3):
        _sync(device)
        t0 = time.perf_counter()
        for i in range(steps):
            step(i)
        _sync(device)
        rounds.append((time.perf_counter() - t0) / steps)
    if PROFILE["on"]:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device == "cuda" else [])]
        with profile(activities=activities) as prof:
            for i in range(2):
                step(i)
            _sync(device)
        from dtensor_mimo.train.metrics import profile_tables

        PROFILE["table"] = profile_tables(prof, device == "cuda", rows=30, host_rows=12)
        if device == "cuda":
            try:
                _link_device_events(prof)
            except Exception as e:  # noqa: BLE001 - a report must not cost the case its timings
                PROFILE["table"] += f"\ndevice events not linked to their launches ({type(e).__name__}: {e})\n"
            gaps, PROFILE["idle_ms"] = _device_gaps(prof.events(), 2)
            PROFILE["table"] += gaps + _phase_work(prof.events(), 2) + _graph_work(prof.events(), 2)
    return rounds


def _link_device_events(prof) -> None:
    """Give each device event of `prof` the id of the host op that launched it
    (``linked_correlation_id``), which torch 2.13's events carry and 2.11's lack: there, from the
    kineto records they were made of (each event's ``id`` is its record's correlation id).
    Without it the reports below, which find a kernel's launcher by that id, failed on the
    2026-11-28 H200 run (torch 2.11)."""
    from torch.autograd import DeviceType

    events = prof.events()
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    if not device or hasattr(device[0], "linked_correlation_id"):
        return
    links = {k.correlation_id(): k.linked_correlation_id()  # a kernel's id is its launch's (CUPTI's)
             for k in prof.profiler.kineto_results.events() if k.device_type() == DeviceType.CUDA}
    for e in device:  # torch 2.11 made each event's id its record's correlation id
        e.linked_correlation_id = links.get(e.id, 0)


CUPTI_OVERHEAD = ("Command Buffer Full", "Activity Buffer Request")
"""Device-side records of the profiler's own, not the device's work: the host blocked on a full
launch queue; CUPTI's buffers. (The tables count them in "Self CUDA": the H200's 2026-11-27 profile
of the fp8 LM step has 60 ms of "Command Buffer Full" in 415.)"""


def _device_gaps(events, steps: int, top: int = 10) -> tuple[str, float | None]:
    """Where the device waited in `steps` profiled steps: the union of its work's intervals (kernels,
    copies) against their span, and the gaps between them, each named by the host op that launched
    the work after it (outermost < ... < innermost: what the host was doing while the device
    waited); and the idle ms per step. A report, not a check: any error in it is printed in its
    place."""
    try:
        from torch.autograd import DeviceType

        work = sorted((e for e in events if e.device_type == DeviceType.CUDA and e.name not in CUPTI_OVERHEAD),
                      key=lambda e: e.time_range.start)
        if not work:
            return "\nno device work profiled\n", None
        host = {e.id: e for e in events if e.device_type == DeviceType.CPU}

        def launcher(e) -> str:
            names, op = [], host.get(e.linked_correlation_id)
            while op is not None:
                names.append(op.name[:40])
                op = op.cpu_parent
            return " < ".join([*names[:0:-1][:2], names[0]] if len(names) > 2 else names[::-1]) or "?"

        gaps, end = [], work[0].time_range.end
        for e in work[1:]:
            if e.time_range.start > end:
                gaps.append((e.time_range.start - end, e))
            end = max(end, e.time_range.end)
        span, idle = end - work[0].time_range.start, sum(g for g, _ in gaps)
        by_launcher: dict[str, list[float]] = {}
        for g, e in gaps:
            by_launcher.setdefault(launcher(e), []).append(g)
        lines = [f"\ndevice busy {100 * (1 - idle / span):.1f}% of {span / 1e3:.1f} ms ({steps} steps): idle "
                 f"{idle / 1e3 / steps:.2f} ms a step in {len(gaps)} gaps",
                 "largest gaps (ms, the work after it, its launcher):"]
        largest = sorted(gaps, key=lambda x: -x[0])[:top]
        lines += [f"{g / 1e3:9.3f}  {e.name[:45]:<45}  {launcher(e)}" for g, e in largest]
        lines.append("idle by launcher of the work after the gap (ms over the steps, gaps):")
        lines += [f"{sum(gs) / 1e3:9.3f}  {len(gs):5d}  {name}"
                  for name, gs in sorted(by_launcher.items(), key=lambda x: -sum(x[1]))[:top]]
        return "\n".join(lines) + "\n", idle / 1e3 / steps
    except Exception as e:  # noqa: BLE001 - a report must not cost the case its timings
        return f"\ndevice gaps: not computed ({type(e).__name__}: {e})\n", None


COMPILED_CALL = "## Call CompiledFxGraph"  # inductor's record of one call of one compiled graph


def _launch_chain(e, host: dict) -> list:
    """The host ops above device event `e`'s launch, innermost first."""
    ops, op = [], host.get(e.linked_correlation_id)
    while op is not None:
        ops.append(op)
        op = op.cpu_parent
    return ops


def _phase_work(events, steps: int) -> str:
    """Device ms a step by the library's phase that launched it (the innermost ``mimo.*`` range,
    `dtensor_mimo.schedule.runtime.phase`: each action of the step's program, the loss, the
    gradient reduction, the update, the read); work launched outside them (transformers' cases)
    is "(outside)". A report, not a check: any error in it is printed in its place."""
    try:
        from torch.autograd import DeviceType

        host = {e.id: e for e in events if e.device_type == DeviceType.CPU}
        per: dict[str, float] = {}
        for e in events:
            if e.device_type == DeviceType.CUDA and e.name not in CUPTI_OVERHEAD:
                op = next((op for op in _launch_chain(e, host) if op.name.startswith("mimo.")), None)
                name = "(outside)" if op is None else op.name
                per[name] = per.get(name, 0.0) + e.time_range.end - e.time_range.start
        lines = ["device work by phase (ms a step):"]
        lines += [f"{us / 1e3 / steps:9.3f}  {name}" for name, us in sorted(per.items(), key=lambda x: -x[1])]
        return "\n".join(lines) + "\n"
    except Exception as e:  # noqa: BLE001 - a report must not cost the case its timings
        return f"device work by phase: not computed ({type(e).__name__}: {e})\n"


def _graph_work(events, steps: int, graphs: int = 8, kernels: int = 6) -> str:
    """What each compiled graph launched in `steps` profiled steps: per graph (the outermost
    compiled call above the launch), its calls a step, host and device ms a call, and its costliest
    kernels (calls and device ms a graph call). The 2026-11-27 tables had only the twelve graphs
    costliest in host time, as totals, and transformers' blocks compile to several graphs each
    (graph breaks), so a block's work could not be compared with ours from them. A report, not a
    check: any error in it is printed in its place."""
    try:
        from torch.autograd import DeviceType

        host = {e.id: e for e in events if e.device_type == DeviceType.CPU}

        per: dict[str, dict] = {}
        for e in events:
            if e.device_type != DeviceType.CUDA or e.name in CUPTI_OVERHEAD:
                continue
            above = [op for op in _launch_chain(e, host) if op.name.startswith(COMPILED_CALL)]
            if not above:
                continue
            g = above[-1]  # the outermost
            d = per.setdefault(g.name, {"calls": {}, "device": 0.0, "kernels": {}})
            d["calls"][g.id] = g.cpu_time_total
            us = e.time_range.end - e.time_range.start
            d["device"] += us
            k = d["kernels"].setdefault(e.name, [0, 0.0])
            k[0], k[1] = k[0] + 1, k[1] + us
        if not per:
            return "no compiled graph launched device work\n"
        lines = ["compiled graphs (by device ms over the steps): calls a step, host ms a call, device ms a call; "
                 "then their costliest kernels (calls and device ms a graph call):"]
        for name, d in sorted(per.items(), key=lambda x: -x[1]["device"])[:graphs]:
            calls = len(d["calls"])
            lines.append(f"{name[len(COMPILED_CALL):].strip()[:16]:<18}{calls / steps:6.0f}"
                         f"{sum(d['calls'].values()) / 1e3 / calls:9.3f}{d['device'] / 1e3 / calls:9.3f}")
            lines += [f"    {n[:60]:<60}{c / calls:6.1f}{us / 1e3 / calls:9.3f}"
                      for n, (c, us) in sorted(d["kernels"].items(), key=lambda x: -x[1][1])[:kernels]]
        return "\n".join(lines) + "\n"
    except Exception as e:  # noqa: BLE001 - a report must not cost the case its timings
        return f"compiled graphs: not computed ({type(e).__name__}: {e})\n"


def _world_of_one(device: str) -> None:
    from dtensor_mimo import init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29561"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    init_distributed(device)


def _no_embed(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if "embed" not in n)


# ---------------------------------------------------------------------------------------- LM


def _lm_batches(s: dict, count: int = 4) -> list:
    """Fixed random token batches on the host: (tokens, next-token labels)."""
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        t = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1), generator=g)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def _lm_ours(s: dict, device: str, backend: str, warmup: int, steps: int, fp8: str | None = None,
             chunked_loss: bool = True, fsdp_one_rank: bool = False, packed: bool = False,
             flex: bool = False, graphs: bool = False, tuned: bool = False, nd: bool = False) -> dict:
    import torch

    from dtensor_mimo import ParallelOptions, train_step
    from dtensor_mimo.data import MimoBatch

    _world_of_one(device)
    if fsdp_one_rank:  # a measurement only: FSDP2 (and its mixed precision) on the dp mesh of one rank
        from dtensor_mimo.parallelize import part, precision, replicas

        def always(options, dp_mesh, one_rank=False):
            return options.fsdp and dp_mesh is not None

        precision.uses_fsdp = part.uses_fsdp = replicas.uses_fsdp = always
    options = ParallelOptions(compile=True, compile_backend=backend, param_dtype="bf16", fp8=fp8,
                              chunked_loss=chunked_loss, flex_attention=flex,
                              compile_mode=_graphs_mode(graphs, backend),
                              compile_options={"coordinate_descent_tuning": True, **(
                                  {"triton.prefer_nd_tiling": True, "triton.tile_reductions": True} if nd else {})}
                              if tuned else None)
    model, optimizer = _lm_ours_model(s, device, options)
    if fsdp_one_rank:
        from torch.distributed.tensor import DTensor

        assert all(isinstance(p, DTensor) for p in model.parameters()), "FSDP2 did not wrap the one-rank mesh"
    batches = _pinned([MimoBatch(t, l, loss_mask=torch.ones_like(l, dtype=torch.bool),
                                 **(_documents(s, i) if packed else {})) for i, (t, l) in enumerate(_lm_batches(s))],
                      device)
    check = _flex_check(batches[0], device) if flex else {}
    if chunked_loss:
        check.update(_loss_check(s, device, backend))
    if graphs:
        eager = ParallelOptions(param_dtype="bf16", fp8=fp8, chunked_loss=chunked_loss, flex_attention=flex)
        check.update(_graphs_check(lambda: _lm_ours_model(s, device, eager), model, optimizer, batches))
    rounds = _timed(lambda i: train_step(model, optimizer, batches[i % len(batches)]), device, warmup, steps)
    return {"step_s": rounds, "params_no_embed": _no_embed(model), **check}


def _lm_checkpoint(s: dict, device: str, backend: str, warmup: int, steps: int) -> dict:
    """`lm ours` saving its parameters and AdamW state (12 GiB at 1B, into a temporary
    directory): how long the step that saves waits, synchronously (`checkpoint.save`) and in the
    background (`BackgroundSaves.start`) into pageable and into pinned host buffers, each
    background mode twice (the first save allocates its buffers, the second reuses them); the
    training steps timed while the second one is written, against those without a save; and
    that the pinned copy holds the device's values when `start` returns."""
    import torch

    from dtensor_mimo import ParallelOptions, train_step
    from dtensor_mimo.data import MimoBatch
    from dtensor_mimo.models.layers import local_part
    from dtensor_mimo.train import checkpoint

    _world_of_one(device)
    options = ParallelOptions(compile=True, compile_backend=backend, param_dtype="bf16")
    model, optimizer = _lm_ours_model(s, device, options)
    batches = _pinned([MimoBatch(t, l, loss_mask=torch.ones_like(l, dtype=torch.bool)) for t, l in _lm_batches(s)],
                      device)

    def step(i: int) -> None:
        train_step(model, optimizer, batches[i % len(batches)])

    rounds = _timed(step, device, warmup, steps)
    out: dict = {"step_s": rounds, "params_no_embed": _no_embed(model)}
    with tempfile.TemporaryDirectory(dir=os.environ.get("CHECKPOINT_DIR")) as root:
        _sync(device)
        t0 = time.perf_counter()
        checkpoint.save(root, 1, model, optimizer, {"step": 1}, keep=1)
        out["sync_save_s"] = time.perf_counter() - t0
        for mode, pin in (("async", False), ("async_with_pinned_mem", True)):
            saves = checkpoint.BackgroundSaves(pin=pin)
            stalls, writes, during = [], [], []
            for n in (2, 3):
                _sync(device)
                t0 = time.perf_counter()
                saves.start(root, n, model, optimizer, {"step": n}, keep=1)
                stalls.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                if n == 3:  # the copy holds the values of when it was made; then the steps the writer overlaps
                    staged, live = saves._host, checkpoint._state(model, optimizer, {})
                    tensors = [k for k, v in staged.items() if isinstance(v, torch.Tensor)]
                    out[f"{mode}_copy_equal"] = all(torch.equal(local_part(staged[k]), local_part(live[k]).cpu())
                                                    for k in tensors[:8])
                    out[f"{mode}_pinned"] = [local_part(staged[k]).is_pinned() for k in tensors].count(True)
                    while saves.writing():
                        t1 = time.perf_counter()
                        step(len(during))
                        _sync(device)
                        during.append(time.perf_counter() - t1)
                saves.finish()
                writes.append(time.perf_counter() - t0)
            saves.release()
            out.update({f"{mode}_stall_s": stalls, f"{mode}_write_s": writes, f"{mode}_steps_while_writing_s": during})
    out["checkpoint_gib"] = sum(local_part(v).numel() * local_part(v).element_size()
                                for v in checkpoint._state(model, optimizer, {}).values()
                                if isinstance(v, torch.Tensor)) / 2**30
    return out


def _lm_ours_model(s: dict, device: str, options):
    """The LM through `MimoModel` (world 1) with `options`, its weights from seed 0, and its optimizer."""
    import torch

    from dtensor_mimo import AdamWConfig, MimoLayout, MimoModel, MimoOptimizer, Parallelism
    from dtensor_mimo.models import Llama, LlamaConfig

    with torch.device("meta"):
        llama = Llama(LlamaConfig(vocab_size=s["vocab"], dim=s["dim"], n_layers=s["layers"], n_heads=s["heads"],
                                  n_kv_heads=s["kv_heads"], ffn_hidden=s["ffn"], max_seq_len=s["seq"]))
    model = MimoModel(MimoLayout({"language": Parallelism()}), llama, {}, options={"language": options},
                      device_type=device)
    model.init_weights({"language": 0})
    return model, MimoOptimizer(model, AdamWConfig(lr=1e-4))


def _graphs_mode(graphs: bool, backend: str) -> str | None:
    """The CUDA-graph cases' `compile_mode` (inductor's; the CPU check's aot_eager takes none)."""
    return "reduce-overhead" if graphs and backend == "inductor" else None


def _graphs_check(reference, model, optimizer, batches, steps: int = 5) -> dict:
    """The CUDA-graph model's first `steps` training steps (warm-up, recording, then replays,
    cycling through `batches`) against the same model in eager (`reference()`: a fresh (model,
    optimizer) from the same seeds, freed afterwards): the largest relative difference of their
    losses and gradient norms (raises above 2e-2, bf16 rounding). A check for gross errors (a
    replay into memory still in use, gradients overwritten, NaN), not a fine one: on random
    tokens every batch's loss is about ln(vocab), so a replay of the wrong batch's inputs would
    pass; `tests/test_compile_mode.py` checks the numbers of the same options on the CPU."""
    import torch

    from dtensor_mimo import train_step

    ref_model, ref_optimizer = reference()
    want = [train_step(ref_model, ref_optimizer, batches[i % len(batches)]) for i in range(steps)]
    del ref_model, ref_optimizer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    got = [train_step(model, optimizer, batches[i % len(batches)]) for i in range(steps)]
    diffs = {f"graphs_rel_diff_{k}": max(abs(getattr(g, k) - getattr(w, k)) / abs(getattr(w, k))
                                         for g, w in zip(got, want)) for k in ("loss", "grad_norm")}
    if max(diffs.values()) > 2e-2:
        raise RuntimeError(f"the CUDA-graph model's steps differ from eager: {diffs}; losses "
                           f"{[g.loss for g in got]} against {[w.loss for w in want]}")
    return diffs


def _wrapper_toolkit() -> None:
    """Headers and libraries for inductor's C++ wrappers of CUDA code (`WRAPPER` cases): torch's
    own lookup (``CUDA_HOME``, ``nvcc`` on the path, /usr/local/cuda) if it finds a toolkit, else
    the `nvidia` wheels that torch's CUDA build installed (``cuda.h`` and ``libcudart_static.a``)
    and the driver's ``libcuda.so.1`` under the name the linker asks for (``-lcuda``)."""
    import glob
    import site

    import torch
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is not None:
        return
    sites = [os.path.dirname(os.path.dirname(torch.__file__)), *site.getsitepackages()]  # torch's first
    homes = [os.path.dirname(os.path.dirname(h)) for d in sites
             for h in sorted(glob.glob(os.path.join(d, "nvidia", "*", "include", "cuda.h")))]
    if not homes:
        raise RuntimeError("inductor's C++ wrapper needs CUDA's headers: no CUDA toolkit (CUDA_HOME, nvcc, "
                           "/usr/local/cuda) and no nvidia wheel with include/cuda.h")
    os.environ["CUDA_HOME"] = cpp_extension.CUDA_HOME = homes[0]
    torch.cuda.init()  # the driver library is loaded now: its path, for the linker
    with open("/proc/self/maps") as maps:
        driver = next((line.split()[-1] for line in maps if "/libcuda.so" in line), None)
    if driver is not None:
        links = tempfile.mkdtemp(prefix="libcuda_")
        os.symlink(driver, os.path.join(links, "libcuda.so"))
        os.environ["LIBRARY_PATH"] = os.pathsep.join(filter(None, [links, os.environ.get("LIBRARY_PATH")]))


SKIP = "skipping cudagraphs"  # how inductor's message of a piece run without CUDA graphs begins
GRAPH_SKIPS: list[str] = []
"""Inductor's reasons for running a compiled piece without CUDA graphs, in this case's process."""


def _record_graph_skips() -> None:
    """Keep inductor's "skipping cudagraphs due to ..." messages (its ``cudagraphs`` log) in
    `GRAPH_SKIPS`: a CUDA-graph case that ran without graphs says why."""
    import logging

    import torch

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if SKIP in message and message not in GRAPH_SKIPS:
                GRAPH_SKIPS.append(message[:300])

    torch._logging.set_logs(cudagraphs=True)
    logging.getLogger("torch._inductor.cudagraph_utils").addHandler(Keep())


def _pinned(batches: list, device: str) -> list:
    """`MimoBatch`es in pinned host memory on CUDA, as the trainer's loader gives them
    (``pin_memory=True``): their copies to the device do not wait for its queue."""
    return [b.pin_memory() for b in batches] if device == "cuda" else batches


def _documents(s: dict, seed: int) -> dict:
    """Each row cut into documents of 64-1024 tokens: their ids and rotary positions."""
    import torch

    g = torch.Generator().manual_seed(100 + seed)
    ids, positions = torch.zeros(s["batch"], s["seq"], dtype=torch.long), torch.zeros(s["batch"], s["seq"], dtype=torch.long)
    for row in range(s["batch"]):
        start, doc = 0, 0
        while start < s["seq"]:
            n = min(int(torch.randint(64, 1025, (1,), generator=g)), s["seq"] - start)
            ids[row, start:start + n], positions[row, start:start + n] = doc, torch.arange(n)
            start, doc = start + n, doc + 1
    return {"document_ids": ids, "positions": positions}


def _flex_check(batch, device: str) -> dict:
    """FlexAttention's compiled kernel against the masked SDPA path on this device, fp32, one
    layer's shapes at 8 heads: the largest output and gradient differences (raises above 1e-3)."""
    import torch

    from dtensor_mimo.models import FlexAttentionCore, causal_attention
    from dtensor_mimo.models.layers import PackedItems, packed_attention

    g = torch.Generator(device=device).manual_seed(0)
    shape = (batch.tokens.shape[0], 8, batch.tokens.shape[1], 64)
    q, k, v = (torch.randn(shape, generator=g, device=device).requires_grad_() for _ in range(3))
    doc = batch.document_ids.to(device)
    diffs = {}
    outs = [fn(q, k, v, q_pos=None, kv_pos=None, q_doc=doc, kv_doc=doc) for fn in (FlexAttentionCore(), causal_attention)]
    up = torch.randn(shape, generator=g, device=device)
    grads = [torch.autograd.grad(o, (q, k, v), up) for o in outs]
    diffs["flex_max_abs_diff_out"] = float((outs[0] - outs[1]).abs().max())
    diffs["flex_max_abs_diff_grad"] = max(float((a - b).abs().max()) for a, b in zip(*grads))
    # An encoder's items of their own size (bidirectional, block-diagonal): FlexAttentionCore.packed.
    lengths, left = [], shape[2]
    while left:  # image-like items of several sizes (an empty one too), cut to the rows
        lengths.append(min([196, 0, 64, 576, 1, 256][len(lengths) % 6], left))
        left -= lengths[-1]
    items = PackedItems(lengths)
    one = (q[:1], k[:1], v[:1])
    outs = [FlexAttentionCore().packed(*one, items), packed_attention(*one, items)]
    grads = [torch.autograd.grad(o, one, up[:1]) for o in outs]
    diffs["flex_packed_max_abs_diff_out"] = float((outs[0] - outs[1]).abs().max())
    diffs["flex_packed_max_abs_diff_grad"] = max(float((a - b).abs().max()) for a, b in zip(*grads))
    if max(diffs.values()) > 1e-3:
        raise RuntimeError(f"FlexAttention differs from the masked SDPA path on {device}: {diffs}")
    return diffs


def _loss_check(s: dict, device: str, backend: str) -> dict:
    """The chunked loss's compiled arithmetic (`linear_token_loss_sum`'s ``compile_backend``, as
    ``compile=True`` runs it) against its eager form on this device: one chunk of bf16 and one of
    fp32 logits at the LM's vocabulary, a few rows ignored; the loss's relative and the
    gradient's largest absolute difference (raises above 1e-4 and 1e-2: bf16 rounding)."""
    import torch

    from dtensor_mimo.sequence.loss import LOSS_CHUNK_LOGITS, _chunk_terms, _compiled_chunk_terms

    g = torch.Generator(device=device).manual_seed(0)
    rows = LOSS_CHUNK_LOGITS // s["vocab"]
    labels = torch.randint(0, s["vocab"], (rows,), generator=g, device=device)
    weights = torch.rand(rows, generator=g, device=device)
    weights[:7] = 0.0
    labels[:3] = -100
    diffs = {}
    for dtype in (torch.bfloat16, torch.float32):  # fp32: the logits themselves are the fp32 copy
        logits = (torch.randn(rows, s["vocab"], generator=g, device=device) * 3).to(dtype)
        (want, want_grad), (got, got_grad) = (fn(logits.clone(), labels, weights, True)
                                              for fn in (_chunk_terms, _compiled_chunk_terms(backend)))
        name = str(dtype).removeprefix("torch.")
        diffs[f"loss_compiled_rel_diff_{name}"] = float((got - want).abs() / want.abs())
        diffs[f"loss_compiled_max_abs_diff_grad_{name}"] = float((got_grad.float() - want_grad.float()).abs().max())
    if not all(v <= (1e-4 if "rel" in k else 1e-2) for k, v in diffs.items()):
        raise RuntimeError(f"the compiled chunk loss differs from its eager form on {device}: {diffs}")
    return {**diffs, **_weight_sum_check(s, device)}


def _weight_sum_check(s: dict, device: str) -> dict:
    """The chunked loss's weight gradient over two chunks of the LM's sizes (bf16 rows and head),
    summed inside the matmul where `_add_product`'s probe allows it (`loss_sums_in_matmul`) and by
    the separate add of each bf16 product, each against the fp32 sum of fp32 products: the largest
    absolute error of each (raises if the matmul's sum is the worse: it should skip a rounding)."""
    import torch

    from dtensor_mimo.sequence import loss

    g = torch.Generator(device=device).manual_seed(1)
    rows = 2 * (loss.LOSS_CHUNK_LOGITS // s["vocab"])
    hidden = torch.randn(rows, s["dim"], generator=g, device=device).bfloat16()
    weight = (torch.randn(s["vocab"], s["dim"], generator=g, device=device) * 0.02).bfloat16()
    labels = torch.randint(0, s["vocab"], (rows,), generator=g, device=device)
    weights = torch.ones(rows, device=device)
    sums = loss._sums_in_matmul(torch.device(device))
    grads = {}
    for fused in (True, False):
        saved, loss._SUMS_IN_MATMUL = loss._SUMS_IN_MATMUL, {torch.device(device).type: sums and fused}
        try:
            grads[fused] = loss._chunked_cross_entropy(hidden, weight, labels, weights, False, True)[2]
        finally:
            loss._SUMS_IN_MATMUL = saved
    step = loss.LOSS_CHUNK_LOGITS // s["vocab"]
    want = sum(loss._chunk_terms(hidden[i:i + step] @ weight.t(), labels[i:i + step], weights[i:i + step],
                                 True)[1].float().t() @ hidden[i:i + step].float() for i in range(0, rows, step))
    out = {"loss_sums_in_matmul": sums, "loss_weight_grad_err_matmul_sum": float((grads[True] - want).abs().max()),
           "loss_weight_grad_err_separate_add": float((grads[False] - want).abs().max())}
    if out["loss_weight_grad_err_matmul_sum"] > out["loss_weight_grad_err_separate_add"] + 1e-6:
        raise RuntimeError(f"the weight gradient summed in the matmul is less exact than the separate add: {out}")
    return out


def _lm_transformers(s: dict, device: str, backend: str, warmup: int, steps: int, compiled: bool) -> dict:
    import torch
    import torch.nn.functional as F
    import transformers

    config = transformers.LlamaConfig(vocab_size=s["vocab"], hidden_size=s["dim"], intermediate_size=s["ffn"],
                                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                                      num_key_value_heads=s["kv_heads"], max_position_embeddings=s["seq"],
                                      rms_norm_eps=1e-5, tie_word_embeddings=False)
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.train()
    if compiled:
        for layer in model.model.layers:
            layer.compile(backend=backend)
    optimizer = _adamw(model, device)
    batches = [(t.to(device), l.to(device)) for t, l in _lm_batches(s)]

    def step(i: int) -> None:
        tokens, labels = batches[i % len(batches)]
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(input_ids=tokens, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        _finish(model, optimizer, loss)

    return {"step_s": _timed(step, device, warmup, steps), "params_no_embed": _no_embed(model)}


def _adamw(model, device: str):
    """transformers' AdamW, as `MimoOptimizer(model, AdamWConfig(lr=1e-4))` steps ours: its
    hyperparameters (betas (0.9, 0.95)), its weight-decay groups (`AdamWConfig.decays`: none on
    norms, biases and embeddings; transformers' names say "embed" where ours do) and its form on
    `device` (fused where torch has the kernel); parameters that require no gradient left out."""
    import torch

    from dtensor_mimo import AdamWConfig
    from dtensor_mimo.optim.optimizer import _implementation

    a = AdamWConfig(lr=1e-4)
    groups: dict[bool, list] = {True: [], False: []}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups[a.decays(name, p)].append(p)
    return torch.optim.AdamW([{"params": groups[True], "weight_decay": a.weight_decay},
                              {"params": groups[False], "weight_decay": 0.0}], lr=a.lr, betas=a.betas, eps=a.eps,
                             **_implementation(torch.device(device)))


def _finish(model, optimizer, loss) -> None:
    """transformers' side of a step after the loss: backward, clip 1.0, AdamW, one host read (as train_step)."""
    import torch

    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss.item()


def _lm_flops(s: dict, r: dict) -> float:
    from dtensor_mimo.train.metrics import transformer_flops

    return transformer_flops(r["params_no_embed"], s["batch"] * s["seq"], s["layers"], s["dim"], s["seq"], True)


# ---------------------------------------------------------------------------------------- VLM


def _llava_config(s: dict):
    """The VLM both sides build: SigLIP tower (no pooling head, last layer's rows, all of them),
    GELU projector, Qwen2 decoder; the image placeholder is the vocabulary's last id."""
    import transformers

    vision = transformers.SiglipVisionConfig(image_size=s["image"], patch_size=s["patch"], hidden_size=s["vdim"],
                                             num_hidden_layers=s["vlayers"], num_attention_heads=s["vheads"],
                                             intermediate_size=s["vmlp"], vision_use_head=False)
    text = transformers.Qwen2Config(vocab_size=s["vocab"], hidden_size=s["dim"], intermediate_size=s["ffn"],
                                    num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                                    num_key_value_heads=s["kv_heads"], max_position_embeddings=max(4096, s["seq"]),
                                    tie_word_embeddings=False)
    return transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=s["vocab"] - 1,
                                    vision_feature_layer=-1, vision_feature_select_strategy="full",
                                    projector_hidden_act="gelu")


def _vlm_batches(s: dict, count: int = 4) -> list:
    """Fixed synthetic batches (`MimoBatch`, host): 0-2 images per sample at random positions,
    text ids below the placeholder id, next-token labels on text, a masked prompt prefix."""
    from dtensor_mimo.data import ModalitySpec, SyntheticSpec, synthetic_batch

    tokens = (s["image"] // s["patch"]) ** 2
    image = ModalitySpec(special_token_id=s["vocab"] - 1, item_shape=(3, s["image"], s["image"]),
                         tokens_per_item=tokens, max_items=2)
    spec = SyntheticSpec(batch_size=s["batch"], seq_len=s["seq"], vocab_size=s["vocab"] - 1,
                         modalities={"vision": image}, text_only_samples=0)
    return [synthetic_batch(spec, seed) for seed in range(count)]


def _vlm_ours_model(s: dict, device: str, backend: str, compile_: bool, weights: str | None = None,
                    mode: str | None = None, scope: str = "block", compile_options: dict | None = None,
                    fp8: str | None = None):
    import torch

    from dtensor_mimo import MimoLayout, MimoModel, ParallelOptions, Parallelism
    from dtensor_mimo.models import Llama, LlamaConfig, ModalityEncoder, Projection, ViT, ViTConfig

    with tempfile.TemporaryDirectory() as config_dir:
        _llava_config(s).save_pretrained(config_dir)
        vit_config, llama_config = ViTConfig.from_hf(config_dir), LlamaConfig.from_hf(config_dir)
    with torch.device("meta"):
        llama = Llama(llama_config)
        vision = ModalityEncoder(ViT(vit_config), Projection(vit_config.dim, llama_config.dim))
    layout = MimoLayout({"vision": Parallelism(), "language": Parallelism()}, offsets={"vision": 0, "language": 0})
    options = ParallelOptions(compile=compile_, compile_backend=backend, compile_mode=mode, compile_scope=scope,
                              param_dtype="bf16" if device == "cuda" else None, compile_options=compile_options,
                              fp8=fp8)
    model = MimoModel(layout, llama, {"vision": vision}, options={"vision": options, "language": options},
                      device_type=device)
    model.init_weights({"language": 0, "vision": 1})
    if weights:
        model.load_hf({"language": weights, "vision": weights})
    return model


def _vlm_ours(s: dict, device: str, backend: str, warmup: int, steps: int, graphs: bool = False,
              whole: bool = False, wrapper: bool = False, fp8: str | None = None) -> dict:
    from dtensor_mimo import AdamWConfig, MimoOptimizer, train_step

    _world_of_one(device)
    options = {"cpp_wrapper": True} if wrapper and backend == "inductor" else None  # aot_eager takes none
    if options and device == "cuda":
        _wrapper_toolkit()

    def build(compile_: bool, mode: str | None = None, scope: str = "block"):
        model = _vlm_ours_model(s, device, backend, compile_, mode=mode, scope=scope,
                                compile_options=options if compile_ else None, fp8=fp8)
        return model, MimoOptimizer(model, AdamWConfig(lr=1e-4))

    model, optimizer = build(True, _graphs_mode(graphs, backend), "module" if graphs or whole else "block")
    batches = _pinned(_vlm_batches(s), device)
    check = _graphs_check(lambda: build(False), model, optimizer, batches) if graphs else {}
    rounds = _timed(lambda i: train_step(model, optimizer, batches[i % len(batches)]), device, warmup, steps)
    return {"step_s": rounds, **_vlm_params(s), "images": [b.modalities["vision"].num_items for b in batches], **check}


def _llava(s: dict, device: str):
    import torch
    import transformers

    with torch.device(device):
        model = transformers.LlavaForConditionalGeneration._from_config(_llava_config(s), attn_implementation="sdpa",
                                                                        dtype=torch.float32)
    return model.train()


def _llava_loss(model, batch, device: str):
    """transformers' loss of a `MimoBatch`: summed token cross entropy over the batch's loss weights."""
    import torch
    import torch.nn.functional as F

    from dtensor_mimo.sequence.loss import loss_weights

    vision = batch.modalities["vision"]
    pixels = vision.inputs.to(device, non_blocking=True) if vision.num_items else None
    tokens, labels = batch.tokens.to(device, non_blocking=True), batch.labels.to(device, non_blocking=True)
    weights = loss_weights(batch.labels, batch.loss_mask).to(device, non_blocking=True)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        logits = model(input_ids=tokens, pixel_values=pixels, use_cache=False).logits
    per_token = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="none")
    return (per_token * weights.flatten()).sum() / weights.sum().clamp(min=1.0)


def _vlm_transformers(s: dict, device: str, backend: str, warmup: int, steps: int, compiled: bool) -> dict:
    model = _llava(s, device)
    if compiled:  # the same per-block compile as ours (a whole-model compile breaks at masked_scatter)
        tower = model.model.vision_tower
        for layer in [*model.model.language_model.layers, *getattr(tower, "vision_model", tower).encoder.layers]:
            layer.compile(backend=backend)
        model.model.multi_modal_projector.compile(backend=backend)
    optimizer = _adamw(model, device)
    batches = _pinned(_vlm_batches(s), device)
    rounds = _timed(lambda i: _finish(model, optimizer, _llava_loss(model, batches[i % len(batches)], device)),
                    device, warmup, steps)
    return {"step_s": rounds, **_vlm_params(s), "images": [b.modalities["vision"].num_items for b in batches]}


def _vlm_params(s: dict) -> dict:
    """Parameters each module runs, counted on the meta device: the decoder's without embeddings,
    the tower's embeddings and blocks (no post-layernorm: LLaVA takes the last layer's rows)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.LlavaForConditionalGeneration(_llava_config(s))
    inner = model.model
    return {"params_language": _no_embed(inner.language_model) + model.lm_head.weight.numel(),
            "params_tower": sum(p.numel() for n, p in inner.vision_tower.named_parameters() if "post_layernorm" not in n),
            "params_projection": sum(p.numel() for p in inner.multi_modal_projector.parameters())}


def _vlm_flops(s: dict, r: dict) -> float:
    """Model FLOPs of an average timed step (the batches' own image counts)."""
    from dtensor_mimo.train.metrics import transformer_flops

    per_item = (s["image"] // s["patch"]) ** 2
    images = statistics.mean(r["images"])
    return (transformer_flops(r["params_language"], s["batch"] * s["seq"], s["layers"], s["dim"], s["seq"], True)
            + transformer_flops(r["params_tower"], images * per_item, s["vlayers"], s["vdim"], per_item, True)
            + transformer_flops(r["params_projection"], images * per_item, 0, 0, 0, True))


def _vlm_same_model(s: dict) -> dict:
    """(--tiny) ours loaded from transformers' LLaVA weights gives transformers' loss on a batch."""
    import torch

    _world_of_one("cpu")
    torch.manual_seed(0)
    llava = _llava(s, "cpu")
    batch = _vlm_batches(s, 1)[0]
    with tempfile.TemporaryDirectory() as weights:
        llava.save_pretrained(weights)
        model = _vlm_ours_model(s, "cpu", "eager", compile_=False, weights=weights)
    with torch.no_grad():
        theirs = float(_llava_loss(llava, batch, "cpu"))
        ours = float(model(batch))
    return {"ours": ours, "transformers": theirs}


# ---------------------------------------------------------------------------------------- tiny task


def _tiny_trainer(device: str, steps: int, extra: list[str], profile: bool = False) -> dict:
    """The README's tiny LLaVA task through the trainer on `device`, world 1 (`extra` overrides
    after its config): its logged step times; with `profile`, the trainer's own profile of two
    steps in the middle of the run (``metrics.profile``, which the logged times leave out)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as root:
        subprocess.run([sys.executable, os.path.join(ROOT, "examples", "make_tiny_llava.py"), "--out", root,
                        "--audio", "0"], check=True, capture_output=True, text=True, env=env)
        jsonl = os.path.join(root, "m.jsonl")
        argv = [sys.executable, "-m", "dtensor_mimo.train", "--config", os.path.join(ROOT, "examples", "llava_tiny.toml"),
                "--layout.language.offset", "0", "--train.device", device, "--train.steps", str(steps),
                "--train.generate", "0", "--checkpoint.export_hf", "none", "--data.heldout_samples", "8", "--metrics.log_every", "10", "--metrics.jsonl", jsonl,
                "--metrics.progress", "off", *extra]
        if profile:
            argv += ["--metrics.profile", os.path.join(root, "profile"), "--metrics.profile_at", str(steps // 2)]
        graphs = any("reduce-overhead" in a for a in extra)
        out = subprocess.run(argv, capture_output=True, text=True, cwd=root,
                             env={**env, "TORCH_LOGS": "cudagraphs"} if graphs else env)
        if out.returncode:
            raise RuntimeError(f"the trainer exited with {out.returncode}: " + (out.stderr or out.stdout)[-2000:])
        records = [json.loads(line) for line in open(jsonl)]
        written = os.path.join(root, "profile", "rank0.txt")
        table = open(written).read() if profile and os.path.exists(written) else None  # else: stderr says why
    timed = [r for r in records if "step_s" in r and r["step"] > steps // 4]  # after compile and warm-up
    # The last logged loss: the cases train the same model on the same batches, so their losses
    # agree to rounding (a CUDA-graph case that replayed stale inputs would not).
    skips = sorted({line[line.index(SKIP):][:300] for line in out.stderr.splitlines() if SKIP in line})
    # torch's cudagraph trees record a graph for each new input size of a piece, and again for each
    # new sequence of pieces in a run (a path): the tiny task's items vary in count, and its
    # 2026-11-28 H200 windows of ten steps took 24 to 195 ms in CUDA graphs. How often it recorded:
    recorded = {f"cudagraph_{key}": sum(mark in line for line in out.stderr.splitlines())
                for key, mark in (("recordings", "Recording function="), ("trees", "Recording cudagraph tree for"))
                } if graphs else {}
    return {"step_s": [r["step_s"] for r in timed], "data_s": [r.get("data_s", 0.0) for r in timed],
            "final_loss": timed[-1]["loss"], **({"cudagraph_skips": skips} if skips else {}), **recorded,
            **({"profile": table} if table else {})}


# ---------------------------------------------------------------------------------------- driver


def _case(args: argparse.Namespace) -> None:
    """One case in this process; its result as JSON on the last line."""
    import torch

    size = "tiny" if args.tiny else "default"
    device = "cpu" if args.tiny else "cuda"
    backend = "aot_eager" if args.tiny else "inductor"
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.cuda.reset_peak_memory_stats()
    case = args.case
    PROFILE["on"] = args.profile
    if GRAPHS in case:
        _record_graph_skips()
    if case == "vlm same model":
        out = _vlm_same_model(VLM[size])
    elif case == CHECKPOINT:
        out = _lm_checkpoint(LM[size], device, backend, args.warmup, args.steps)
    elif case.startswith("lm ours"):
        if device == "cpu" and case.endswith("flex"):  # torch's FlexAttention has no CPU backward; the CPU check
            import torch.nn.attention.flex_attention as flex  # runs its eager path (as tests/test_flex_attention.py)

            flex._validate_device = lambda *args, **kwargs: None
        fp8 = (case[len(FP8):].removesuffix(WIDE).removesuffix(ND).removesuffix(GRAPHS).removesuffix(TUNED)
               if case.startswith(FP8) else None)
        out = _lm_ours(LM[_lm_size(case, args.tiny)], device, backend, args.warmup, args.steps, fp8,
                       chunked_loss=case != "lm ours unchunked loss", fsdp_one_rank=case == "lm ours fsdp2 bf16",
                       packed="packed" in case, flex=case.endswith("flex"), graphs=case.endswith(GRAPHS),
                       tuned=TUNED in case and backend == "inductor", nd=case.endswith(ND))
    elif case.startswith("lm transformers"):
        out = _lm_transformers(LM[size], device, backend, args.warmup, args.steps, compiled=case.endswith("compiled"))
    elif case.startswith("vlm ours"):
        if case.endswith("all rows"):  # the host count of loss rows not passed on: the head on every row
            from dtensor_mimo.schedule.language import LanguagePipeline

            LanguagePipeline._count_loss_rows = lambda self, mb: None
        out = _vlm_ours(VLM[size], device, backend, args.warmup, 2 * args.steps, graphs=case.endswith(GRAPHS),
                        whole=case.endswith("whole"), wrapper=case.endswith(WRAPPER),
                        fp8="tensorwise" if case.endswith(" fp8") else None)
    elif case.startswith("vlm transformers"):
        out = _vlm_transformers(VLM[size], device, backend, args.warmup, 2 * args.steps,
                                compiled=case.endswith("compiled"))
    elif case.startswith("tiny trainer"):
        backend_args = [f"--options.{m}.compile_backend={backend}" for m in ("image", "language")
                        if "--options.image.compile=true" in TINY[case]]  # unused, and refused, when eager
        extra = [a for a in TINY[case] if backend == "inductor" or "compile_mode" not in a]  # inductor's modes only
        out = _tiny_trainer(device, 60 if args.tiny else 300, [*extra, *backend_args], profile=args.profile)
    else:
        raise SystemExit(f"unknown case {case!r}; one of {', '.join(CASES)}")
    out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    if GRAPH_SKIPS:
        out["cudagraph_skips"] = [*out.get("cudagraph_skips", []), *GRAPH_SKIPS]
    if PROFILE["table"]:
        out["profile"] = PROFILE["table"]
        out["device_idle_ms"] = PROFILE["idle_ms"]
    print(json.dumps(out))


def _lm_size(case: str, tiny: bool) -> str:
    return "tiny" if tiny else "wide" if case.endswith(WIDE) else "default"


def _run_case(case: str, args: argparse.Namespace, seconds: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--case", case, "--steps", str(args.steps),
           "--warmup", str(args.warmup), *(["--tiny"] if args.tiny else []), *(["--profile"] if args.profile else [])]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=seconds)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after {seconds:.0f} s (the budget left)"}
    if out.returncode:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1][:300]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _summarize(case: str, r: dict, peak: float | None) -> None:
    """Median step, tokens or samples per second, MFU, in place."""
    section = case.split()[0]
    size = "tiny" if r.get("tiny") else "default"
    r["median_step_s"] = statistics.median(r["step_s"])
    if section == "lm":
        s = LM[_lm_size(case, r.get("tiny"))]
        r["tokens_per_s"] = s["batch"] * s["seq"] / r["median_step_s"]
        flops = None if "packed" in case else _lm_flops(s, r)  # documents: less attention than the formula's
    elif section == "vlm":
        s = VLM[size]
        r["samples_per_s"] = s["batch"] / r["median_step_s"]
        flops = _vlm_flops(s, r)
    else:
        flops = None
    r["mfu"] = flops / r["median_step_s"] / (peak * 1e12) if flops and peak else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU check: tiny sizes, aot_eager compile, no record")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES, metavar="CASE",
                    help=f"which cases, run in the order of CASES ({', '.join(CASES)})")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for all cases; the rest are skipped")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results", "gpu.json"))
    ap.add_argument("--record", action="store_true", help="append the rows to benchmarks/RESULTS.md")
    ap.add_argument("--profile", action="store_true",
                    help="two more steps of each case under torch.profiler; the tables and the device's idle "
                         "gaps go to OUT's .profile.txt")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        _case(args)
        return

    import torch

    from dtensor_mimo.train.metrics import peak_tflops

    start = time.monotonic()
    device = torch.device("cpu") if args.tiny else torch.device("cuda", 0)
    card = "CPU" if args.tiny else torch.cuda.get_device_name(0)
    peak = peak_tflops(device, 0.0) or None
    result = {"card": card, "torch": torch.__version__, **_versions(), "date": datetime.date.today().isoformat(),
              "sizes": {"lm": LM["tiny" if args.tiny else "default"], "vlm": VLM["tiny" if args.tiny else "default"],
                        "lm 8b blocks": LM["tiny" if args.tiny else "wide"]},
              "rows": {}}
    rows = result["rows"]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    if args.profile:
        open(os.path.splitext(args.out)[0] + ".profile.txt", "w").close()
    if args.tiny:  # the check that both VLM sides run one model
        result["vlm_same_model"] = same = _run_case("vlm same model", args, 600)
        print(f"vlm same model: {same}", flush=True)
        if "error" in same or abs(same["ours"] - same["transformers"]) > 1e-5 * abs(same["transformers"]):
            raise SystemExit(f"the two VLMs differ: {same}")
    for case in [c for c in CASES if c in args.cases]:
        left = args.budget - (time.monotonic() - start)
        if left < 20:
            rows[case] = {"error": "skipped: the budget is spent"}
            continue
        r = _run_case(case, args, left)
        if "error" not in r:
            r["tiny"] = args.tiny
            _summarize(case, r, peak)
        rows[case] = r
        print(f"{case}: " + (f"FAILED: {r['error']}" if "error" in r else f"{r['median_step_s'] * 1e3:.1f} ms"), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        if "profile" in r:
            with open(os.path.splitext(args.out)[0] + ".profile.txt", "a") as f:
                f.write(f"\n===== {case}: {r['median_step_s'] * 1e3:.1f} ms a step\n{r['profile']}\n")
    lines = _report(result, args.tiny)
    if args.record and not args.tiny:
        path = os.path.join(HERE, "RESULTS.md")
        new = not os.path.exists(path)
        with open(path, "a") as f:
            if new:
                f.write("# GPU results (`benchmarks/gpu.py --record`)\n")
            f.write(f"\n## {result['date']}, {card}: {_packages(result)}\n\n"
                    "| date | card | torch | case | step ms | tokens or samples/s | MFU | peak GiB | ratio "
                    "| against |\n"
                    "|---|---|---|---|---|---|---|---|---|---|\n")
            f.write("\n".join(lines) + "\n")


def _versions() -> dict[str, str | None]:
    """The versions of the packages besides torch that the figures depend on (None: not installed)."""
    from importlib import metadata

    found = {}
    for name in ("transformers", "torchao"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def _packages(result: dict) -> str:
    return ", ".join(f"{name} {result.get(name) or '(none)'}" for name in ("torch", "transformers", "torchao"))


# What each case is compared with (same run, same card), and what issue 29 asks of the ratio.
BASELINES = {"lm ours": ("lm transformers compiled", 1.0), "lm transformers": ("lm transformers compiled", None),
             "lm ours fp8 tensorwise": ("lm ours", 1.25), "lm ours fp8 rowwise": ("lm ours", 1.25),
             "lm ours fp8 tensorwise cudagraphs": ("lm ours cudagraphs", 1.25),  # its own bf16: graphs too
             "lm ours fp8 tensorwise tuned": ("lm ours", 1.25), "lm ours fp8 tensorwise tuned nd": ("lm ours", 1.25),
             "lm ours fp8 tensorwise 8b blocks": ("lm ours 8b blocks", None),
             "lm ours unchunked loss": ("lm ours", None), "lm ours fsdp2 bf16": ("lm ours", None),
             "lm ours packed flex": ("lm ours packed", None), "lm ours cudagraphs": ("lm transformers compiled", 1.0),
             "vlm ours cudagraphs": ("vlm transformers compiled", 1.1), "vlm ours whole": ("vlm ours", None),
             "vlm ours all rows": ("vlm ours", None), "vlm ours cpp wrapper": ("vlm ours", None),
             "vlm ours fp8": ("vlm ours", None),
             "vlm ours": ("vlm transformers compiled", 1.1), "vlm transformers": ("vlm transformers compiled", None)}


def _report(result: dict, tiny: bool) -> list[str]:
    """Print the table; the RESULTS.md rows."""
    import torch

    rows, card = result["rows"], result["card"]
    lm, vlm = result["sizes"]["lm"], result["sizes"]["vlm"]
    print(f"\n{card}, {_packages(result)}, bf16{' (tiny sizes, CPU)' if tiny else ''}\n"
          f"lm: Llama {lm['dim']} x {lm['layers']}, batch {lm['batch']} x {lm['seq']}; vlm: SigLIP {vlm['vdim']} x "
          f"{vlm['vlayers']} @ {vlm['image']} px / {vlm['patch']} + Qwen2 {vlm['dim']} x {vlm['layers']}, "
          f"{vlm['batch']} samples x {vlm['seq']}")
    print(f"{'case':<36}{'step ms':>10}{'per s':>12}{'MFU':>8}{'peak GiB':>10}{'ratio':>9}  against (issue 29 asks)")
    lines = []
    for case, r in rows.items():
        if "error" in r:
            print(f"{case:<36}  {r['error']}")
            continue
        base, target = BASELINES.get(case, (None, None))
        base_s = rows.get(base, {}).get("median_step_s")
        ratio = base_s / r["median_step_s"] if base_s else None
        per_s = r.get("tokens_per_s") or r.get("samples_per_s")
        per = f"{per_s:,.0f}" if per_s else "-"
        mfu = f"{r['mfu'] * 100:.1f}%" if r.get("mfu") else "-"
        against = f"{base}" + (f" (>= {target}x)" if target else "") if base_s else ("< 15 ms" if case.startswith("tiny") else "")
        ratio_text = f"{ratio:.3f}x" if ratio else "-"
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "-"
        print(f"{case:<36}{r['median_step_s'] * 1e3:>10.1f}{per:>12}{mfu:>8}{peak:>10}{ratio_text:>9}  {against}")
        lines.append(f"| {result['date']} | {card} | {torch.__version__} | {case} | {r['median_step_s'] * 1e3:.1f} | "
                     f"{per} | {mfu} | {peak} | {ratio_text} | {against or '-'} |")
    idle = {case: r["device_idle_ms"] for case, r in rows.items() if r.get("device_idle_ms") is not None}
    if idle:  # --profile: the device's idle time per step in the profiled steps (the gaps are in the profile text)
        print("device idle a step (profiled): " + ", ".join(f"{case} {v:.1f} ms" for case, v in idle.items()))
    for case, r in rows.items():  # a CUDA-graph case that ran pieces without graphs: inductor's reasons
        for reason in r.get("cudagraph_skips", []):
            print(f"{case}: {reason}")
    for case, r in rows.items():
        if "loss_sums_in_matmul" in r:  # the chunked loss's weight-gradient sums (`_weight_sum_check`)
            print(f"{case}: the head's weight gradient summed "
                  f"{'inside the matmul' if r['loss_sums_in_matmul'] else 'by a separate add (no summing matmul here)'}"
                  f"; largest error against fp32 sums {r['loss_weight_grad_err_matmul_sum']:.2e}, "
                  f"separate add {r['loss_weight_grad_err_separate_add']:.2e}")
        if "cudagraph_recordings" in r:
            print(f"{case}: {r['cudagraph_recordings']} CUDA graphs recorded over the run, in "
                  f"{r['cudagraph_trees']} cudagraph trees (one per compiled function and input size)")
    r = rows.get(CHECKPOINT, {})
    if "sync_save_s" in r:  # the step that saves: what it waits for, per mode
        ms = lambda xs: "/".join(f"{x * 1e3:,.0f}" for x in xs)  # noqa: E731
        print(f"{CHECKPOINT} ({r['checkpoint_gib']:.1f} GiB a save): the step waits, in ms: synchronous "
              f"{r['sync_save_s'] * 1e3:,.0f}; " + "; ".join(
                  f"{mode} {ms(r[f'{mode}_stall_s'])} (first/second save; written in {ms(r[f'{mode}_write_s'])}, "
                  f"{len(r[f'{mode}_steps_while_writing_s'])} steps meanwhile, median "
                  f"{statistics.median(r[f'{mode}_steps_while_writing_s'] or [0]) * 1e3:,.1f}; "
                  f"copy equal {r[f'{mode}_copy_equal']}, "
                  f"{r[f'{mode}_pinned']} buffers pinned)" for mode in ("async", "async_with_pinned_mem")))
    losses = {case: r["final_loss"] for case, r in rows.items() if "final_loss" in r}
    if losses:  # the same model on the same batches: equal to rounding, whatever the case
        print("tiny trainer, last logged loss: " + ", ".join(f"{case} {v:.4f}" for case, v in losses.items()))
    return lines


if __name__ == "__main__":
    main()
