"""The planner on paper: analytic profiles for a GPU cluster, and a realistic pairing.

    python -m dtensor_mimo.plan.paper [--world 64] [--top 5]

No measurement: a block's time is its FLOPs over the device's peak times an assumed efficiency
(`GpuSpec.efficiency`), plus a fixed launch cost per call; activation bytes per token follow the
block's stored tensors in bf16 (no recomputation, flash attention: no score matrix kept). The
device is an H100 SXM node as published (989 dense bf16 TFLOP/s, 80 GB HBM, NVLink 450 GB/s per
direction, 8 GPUs a node, InfiniBand 50 GB/s per GPU); link latencies and the efficiency are
assumptions, stated in `H100`. Everything the table says is a model's prediction.

The pairing: a 400M-parameter ViT (SigLIP-so400m: width 1152, 27 blocks, 729 patches per 384 px
image) and an 8B decoder (Llama 3 8B: width 4096, 32 blocks, GQA 32/8, SwiGLU 14336, vocabulary
128256), one image per sample, 2048-token rows, a global batch of 512 samples, 64 GPUs.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass

from dtensor_mimo.layout import Parallelism
from dtensor_mimo.plan.candidate import Candidate
from dtensor_mimo.plan.cost import Prediction, predict
from dtensor_mimo.plan.profile import Affine, DeviceProfile, Job, Link, ModuleProfile
from dtensor_mimo.plan.report import table
from dtensor_mimo.plan.search import InvalidCandidate, SearchSpace, hsdp, microbatch_counts, search, validate


@dataclass(frozen=True)
class GpuSpec:
    """A GPU for analytic profiles.

    Attributes:
        name: label.
        peak_flops: dense bf16 FLOP/s.
        efficiency: the share of peak a transformer block's matmuls reach (an assumption).
        launch_s: fixed seconds per block call, forward or backward (kernel launches).
        memory_bytes: HBM per GPU.
        ranks_per_node: GPUs sharing NVLink.
        nvlink: bytes/s per direction inside a node; nvlink_latency_s its per-message latency.
        network: bytes/s per GPU between nodes; network_latency_s its latency.
        hbm_bandwidth: bytes/s of HBM (the optimizer is memory-bound).
    """

    name: str
    peak_flops: float
    efficiency: float
    launch_s: float
    memory_bytes: float
    ranks_per_node: int
    nvlink: float
    nvlink_latency_s: float
    network: float
    network_latency_s: float
    hbm_bandwidth: float

    def device(self) -> DeviceProfile:
        # fused AdamW reads and writes parameter, gradient and two moments: ~32 bytes a parameter
        return DeviceProfile(name=self.name, intra=Link(self.nvlink_latency_s, self.nvlink),
                             inter=Link(self.network_latency_s, self.network), memory_bytes=self.memory_bytes,
                             ranks_per_node=self.ranks_per_node,
                             optimizer=Affine(self.launch_s, 32 / self.hbm_bandwidth), cores=None,
                             peak_flops=self.peak_flops)


H100 = GpuSpec(name="H100 SXM (analytic)", peak_flops=989e12, efficiency=0.45, launch_s=30e-6, memory_bytes=80e9,
               ranks_per_node=8, nvlink=450e9, nvlink_latency_s=10e-6, network=50e9, network_latency_s=20e-6,
               hbm_bandwidth=3.35e12)
"""H100 SXM: published peak, HBM, NVLink and InfiniBand figures; efficiency 0.45 of peak, 30 us
launch cost per block call, 10 / 20 us link latencies: assumptions."""


def transformer_profile(name: str, gpu: GpuSpec, *, dim: int, n_layers: int, n_heads: int, n_kv_heads: int,
                        ffn: int, gated: bool, context: int, causal: bool, tokens_per_sample: float,
                        rest_params: int, rest_flops_per_token: float, width: int, tp_divides: tuple[int, ...],
                        cp: bool, trainable: bool = True) -> ModuleProfile:
    """A module of `n_layers` transformer blocks with analytic FLOPs per token:
    ``2 x block params`` for the matmuls plus attention ``4 x context x dim`` (half when causal);
    backward twice forward. `rest_*`: the module's other parameters and their FLOPs per token."""
    head_dim = dim // n_heads
    attn_params = dim * dim * 2 + 2 * dim * n_kv_heads * head_dim
    mlp_params = (3 if gated else 2) * dim * ffn
    block_params = attn_params + mlp_params
    attn_flops = 4 * context * dim * (0.5 if causal else 1.0)
    per_token = (2 * block_params + attn_flops) / (gpu.peak_flops * gpu.efficiency)
    rest = rest_flops_per_token / (gpu.peak_flops * gpu.efficiency)
    # bf16 tensors a block keeps per token: norms' inputs, q/k/v, attention output, the MLP's
    # inputs and hidden activations (flash attention keeps no score matrix)
    kv = n_kv_heads * head_dim
    act = 2 * (4 * dim + dim + 2 * kv + (3 if gated else 2) * ffn)
    return ModuleProfile(
        name=name, n_layers=n_layers, tokens_per_sample=tokens_per_sample,
        block_forward=Affine(gpu.launch_s, per_token), block_backward=Affine(2 * gpu.launch_s, 2 * per_token)
        if trainable else Affine(), rest_forward=Affine(gpu.launch_s, rest),
        rest_backward=Affine(gpu.launch_s, 2 * rest), block_params=block_params, rest_params=rest_params,
        trainable_params=block_params * n_layers + rest_params if trainable else rest_params,
        activation_bytes_per_token=act if trainable else 0.0, width=width, hidden=dim, tp_divides=tp_divides, cp=cp,
        fsdp=True, param_bytes=4, act_bytes=2, one_call=not cp)  # an encoder: the library's, one call a colocated step


def paper_job(gpu: GpuSpec = H100, batch_size: int = 512, seq_len: int = 2048, images_per_sample: float = 1.0,
              clips_per_sample: float = 0.0) -> Job:
    """SigLIP-so400m-sized ViT + Llama-3-8B-sized decoder (see the module docstring); with
    `clips_per_sample` > 0 also a Whisper-large-sized audio encoder (width 1280, 32 blocks, 1500
    frames per 30 s clip) between them: three modules."""
    patches, vdim, ldim, vocab = 729, 1152, 4096, 128256
    projection = vdim * ldim + ldim * ldim  # LLaVA's two-layer MLP projector
    vision = transformer_profile(
        "vision", gpu, dim=vdim, n_layers=27, n_heads=16, n_kv_heads=16, ffn=4304, gated=False, context=patches,
        causal=False, tokens_per_sample=images_per_sample * patches, rest_params=3 * 14 * 14 * vdim + projection,
        rest_flops_per_token=2 * (3 * 14 * 14 * vdim + projection), width=ldim, tp_divides=(16, 4304, ldim), cp=False)
    language = transformer_profile(
        "language", gpu, dim=ldim, n_layers=32, n_heads=32, n_kv_heads=8, ffn=14336, gated=True, context=seq_len,
        causal=True, tokens_per_sample=seq_len, rest_params=2 * vocab * ldim, rest_flops_per_token=2 * vocab * ldim,
        width=ldim, tp_divides=(32, 8, 14336, vocab), cp=True)
    modules = [vision]
    if clips_per_sample > 0:
        adim, frames = 1280, 1500
        audio_projection = adim * ldim + ldim * ldim
        modules.append(transformer_profile(
            "audio", gpu, dim=adim, n_layers=32, n_heads=20, n_kv_heads=20, ffn=5120, gated=False, context=frames,
            causal=False, tokens_per_sample=clips_per_sample * frames,
            rest_params=2 * 3 * 128 * adim + audio_projection, rest_flops_per_token=2 * audio_projection,
            width=ldim, tp_divides=(20, 5120, ldim), cp=False))
    return Job((*modules, language), batch_size=batch_size)


def uniform_layouts(job: Job, world: int, space: SearchSpace = SearchSpace(),
                    ranks_per_node: int | None = None) -> list[Candidate]:
    """The homogeneous layouts: every module on every rank with one and the same (dp, tp), pp = cp = 1;
    with `ranks_per_node`, each also as HSDP (`hsdp`) where every module shards with FSDP2."""
    out = []
    for tp in range(1, world + 1):
        if world % tp:
            continue
        par = Parallelism(dp=world // tp, tp=tp)
        hybrid = hsdp(par, ranks_per_node) if ranks_per_node and all(p.fsdp for p in job.modules) else None
        for par, m in itertools.product([par, *([hybrid] if hybrid else [])], microbatch_counts(job, space)):
            cand = Candidate.of({n: par for n in job.names}, {n: 0 for n in job.names}, m)
            try:
                validate(job, cand, world)
            except InvalidCandidate:
                continue
            out.append(cand)
    return out


def best_uniform(job: Job, world: int, device: DeviceProfile) -> Prediction | None:
    """The fastest homogeneous layout that fits memory (the baseline a planner is compared with)."""
    preds = [p for p in (predict(job, c, device) for c in uniform_layouts(job, world, ranks_per_node=device.ranks_per_node))
             if p.fits]
    return min(preds, key=lambda p: p.step_s, default=None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=64)
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args(argv)
    import time

    job, device = paper_job(), H100.device()
    t0 = time.perf_counter()
    result = search(job, args.world, device)
    took = time.perf_counter() - t0
    base = best_uniform(job, args.world, device)
    print(f"{job.names} on {args.world} x {device.name}: {result.evaluated} layouts "
          f"({'all' if result.exhaustive else 'pruned'}) in {took:.1f} s; prediction, not measurement")
    print(table(result.ranked, job.names, args.top, base))
    own = [p for p in result.ranked if p.fits and not any(
        p.candidate.shares_ranks(e.name, job.language) for e in job.encoders)]
    if own:
        print("fastest with every encoder on ranks of its own:")
        print(table(own, job.names, 1))
    if base is not None and result.ranked:
        print(f"first choice / best homogeneous step time: {result.ranked[0].step_s / base.step_s:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
