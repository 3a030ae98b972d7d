"""FP8 training per module through torchao's float8 training (`ParallelOptions.fp8`).

`parallelize` swaps a module's ``nn.Linear`` layers for torchao's ``Float8Linear`` first, before
tensor parallel, checkpointing, compile and FSDP2 (the order torchtitan uses): each converted
layer casts its input, weight and output gradient to float8 (e4m3) with dynamic scales and runs
its three matmuls in float8, keeping fp32 master weights.

- "tensorwise": one scale per tensor. Under FSDP2 the weights are all-gathered in float8
  (``enable_fsdp_float8_all_gather``: half the bytes of bf16; a weight whose rows do not split
  evenly over the FSDP2 shards, which torchao's float8 all-gather cannot take, is gathered in its
  own precision and cast after: `even_rows`; so is a tied weight, which torchao's float8 weight
  parameter would untie), and after each optimizer step
  `refresh_fp8_scales` computes every weight's scale in one all-reduce
  (``precompute_float8_dynamic_scale_for_fsdp``).
- "rowwise": one scale per row (power-of-2 scales), more accurate; FSDP2 gathers in the
  parameters' own precision (torchao's float8 all-gather is tensorwise only).

Which layers convert (`converts_to_fp8`): every plain ``nn.Linear`` (not a subclass: its own
forward would be replaced, and ``nn.MultiheadAttention``'s ``out_proj`` is never called, its owner
reading the weight) whose in and out features are multiples of 16 (what the float8 matmul
kernels take), except the output head (a layer named
one of `KEPT_HEADS`, e.g. the decoder's ``output`` or a user decoder's ``lm_head``): the logits
stay in the compute dtype, as in torchtitan and Megatron-LM. On CUDA also only where float8 pays
(`fp8_pays`): a layer whose matmuls torchao measured slower in float8 than in bf16 on an H100
(its casts cost more than the faster matmul saves: the tables of torchao's float8 README, the
rule of its ``_auto_filter_for_recipe``, torchtitan's ``auto_filter_small_kn``) stays in the
compute dtype; e.g. for the 1B Llama of `benchmarks/gpu.py` (dim 2048, 8 of 32 heads for K/V,
ffn 8192) tensorwise keeps ``wk`` and ``wv`` (2048 -> 512), rowwise converts only ``w1`` and
``w3``. Under tensor parallel both rules read the shape of each rank's shard (`shard_features`:
a column-parallel layer's out features, a row-parallel one's in features divided by tp), which
is what its matmuls run: at tp 2 the 4,304-wide MLP of a SigLIP so400m tower has 2,152 columns a
rank, which ``torch._scaled_mm`` refuses, so it stays in the compute dtype. Emulated (off CUDA)
every eligible layer converts, so that the tests check each layer's float8 numerics at their
small sizes. Tensor parallel keeps its own plan:
torch's Colwise/Rowwise styles shard ``Float8Linear`` like ``nn.Linear`` and the float8 casts
run on each rank's shard (torchtitan's rowwise path; torchao's float8 tp styles would also send
the tp all-gathers in float8, for tensorwise only).

On CUDA float8 needs compute capability 8.9 or newer (Ada, Hopper, Blackwell); elsewhere (the
CPU, gloo tests) torchao emulates the float8 matmuls (``emulate=True``: the same casts and
rounding, the products in high precision). torchao is an optional extra
(``pip install 'dtensor_mimo[fp8]'``), imported only where fp8 is asked for.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections import Counter
from typing import TYPE_CHECKING, Any, Literal, Mapping, get_args

import torch
from torch import nn

if TYPE_CHECKING:
    from torchao.float8 import Float8LinearConfig

FP8Recipe = Literal["tensorwise", "rowwise"]
FP8_RECIPES: tuple[str, ...] = get_args(FP8Recipe)
"""`ParallelOptions.fp8`'s values (torchao's recipe names); None: off."""

KEPT_HEADS = ("output", "lm_head")
"""Linear layers with these names stay in the compute dtype: the vocabulary head."""

FP8_DIM_MULTIPLE = 16
"""A Linear converts only when both its in and out features are multiples of this."""

MIN_CAPABILITY = (8, 9)
"""The CUDA compute capability from which float8 matmuls run in hardware."""


def _torchao_float8(module: str) -> Any:
    """``torchao.float8``, or an ImportError that names `module` and the install command."""
    try:
        return importlib.import_module("torchao.float8")
    except ImportError as e:
        raise ImportError(f"ParallelOptions(fp8=...) for module {module!r} needs torchao's float8 training, "
                          f"which is not installed ({e}); install it with: pip install 'dtensor_mimo[fp8]' "
                          "(torchao>=0.18), or set fp8 off for this module") from None


def check_fp8(module: str, recipe: str | None, device_type: str) -> None:
    """Raise before any process group is used if module `module` asks for fp8 (`recipe`) where
    it cannot run: torchao not installed, or a CUDA device older than compute capability 8.9
    (the current device's capability is named). None: nothing to check."""
    if recipe is None:
        return
    _torchao_float8(module)
    if device_type == "cuda":
        capability = tuple(torch.cuda.get_device_capability())
        if capability < MIN_CAPABILITY:
            name = torch.cuda.get_device_name()
            raise RuntimeError(
                f"ParallelOptions(fp8={recipe!r}) for module {module!r}: {name} has compute capability "
                f"{capability[0]}.{capability[1]}, float8 matmuls need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                "or newer (H100, H200, L4, L40S, B200); set fp8 off for this module (and param_dtype='bf16')")


def fp8_config(module: str, recipe: str, device_type: str, fsdp: bool,
               ragged_rows: bool = False) -> Float8LinearConfig:
    """torchao's `Float8LinearConfig` for `recipe` on `device_type` (emulated off CUDA), with
    float8 all-gathers where the module is FSDP2-sharded (`fsdp`) and the recipe is tensorwise.
    `ragged_rows`: the rows of a call vary (an encoder's items): the weight gradient's float8
    matmul has them as its inner dim, which ``torch._scaled_mm`` takes only in multiples of 16 on
    CUDA, so they are padded with zeros (``pad_inner_dim``; a copy where they are not aligned).
    The language model's rows (samples x sequence) keep torchao's default: no padding copies."""
    check_fp8(module, recipe, device_type)
    config = _torchao_float8(module).Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=device_type != "cuda", pad_inner_dim=ragged_rows,
                               enable_fsdp_float8_all_gather=fsdp and recipe == "tensorwise")


def converts_to_fp8(layer: nn.Module, fqn: str) -> bool:
    """Whether `layer` (named `fqn` inside its stack) becomes a ``Float8Linear``: a plain
    ``nn.Linear`` (not a subclass, e.g. ``nn.MultiheadAttention``'s ``out_proj``) with in and out
    features multiples of `FP8_DIM_MULTIPLE`, not named one of `KEPT_HEADS`."""
    # a plain nn.Linear only: a subclass's own forward would be replaced by Float8Linear's, and
    # nn.MultiheadAttention's out_proj (a subclass) is never called: its owner reads the weight
    return (type(layer) is nn.Linear and fqn.rsplit(".", 1)[-1] not in KEPT_HEADS
            and layer.in_features % FP8_DIM_MULTIPLE == 0 and layer.out_features % FP8_DIM_MULTIPLE == 0)


def fp8_pays(out_features: int, in_features: int, recipe: str) -> bool:
    """Whether a Linear matmul of `out_features` x `in_features` (``N`` x ``K``) runs faster in
    float8 than in bf16 on an H100 under `recipe`, by torchao's measured thresholds: tensorwise
    unless ``K <= 4096`` and ``N <= 1024``; rowwise only if ``N > 2048``, ``K > 1024`` and not both
    ``N <= 4096`` and ``K <= 2048``."""
    n, k = out_features, in_features
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    return n > 2048 and k > 1024 and not (n <= 4096 and k <= 2048)


def shard_features(layer: nn.Linear, fqn: str, tp: int, splits: Mapping[str, int]) -> tuple[int, int]:
    """(out, in) features of the shard of `layer` (named `fqn`) that one of `tp` ranks holds:
    `splits` maps a layer name (the end of `fqn`, e.g. ``attention.wq``) to the weight dim its tp
    plan shards (0: column-parallel, the out features; 1: row-parallel, the in features); a layer
    it does not name is whole on every rank."""
    dim = next((d for name, d in splits.items() if fqn == name or fqn.endswith("." + name)), None)
    out_features, in_features = layer.out_features, layer.in_features
    return (out_features // tp if dim == 0 else out_features, in_features // tp if dim == 1 else in_features)


def convert_to_fp8(stack: nn.Module, config: Float8LinearConfig, module: str, recipe: str,
                   tp: int = 1, splits: Mapping[str, int] | None = None, shards: int = 1) -> None:
    """Swap `stack`'s Linear layers that `converts_to_fp8` selects for torchao's ``Float8Linear``
    (in place; parameters keep their names, dtype and values), each taking inputs without rows
    too (`Float8LinearOrEmpty`). On CUDA (not `config.emulate`) only those whose shard on one of
    `tp` ranks (`shard_features` by `splits`, the stack's tp plan; default: nothing sharded) has
    both dims multiples of `FP8_DIM_MULTIPLE` and `fp8_pays`. With float8 all-gathers (FSDP2 over
    `shards` ranks), a layer whose weight rows do not split evenly over ``shards x tp``
    (`even_rows`), or whose weight is tied (registered under several names in `stack`), is
    all-gathered in its own precision instead."""
    def selected(layer: nn.Module, fqn: str) -> bool:
        if not converts_to_fp8(layer, fqn):
            return False
        if config.emulate:
            return True
        out_features, in_features = shard_features(layer, fqn, tp, splits or {})
        return (out_features % FP8_DIM_MULTIPLE == 0 and in_features % FP8_DIM_MULTIPLE == 0
                and fp8_pays(out_features, in_features, recipe))

    convert = _torchao_float8(module).convert_to_float8_training
    if config.enable_fsdp_float8_all_gather:  # two disjoint sets: a converted layer is not a plain nn.Linear
        # torchao wraps a weight it all-gathers in float8 in a new parameter: one registered
        # under several names (tied) would be untied, so it is gathered in its own precision
        names = Counter(id(p) for _, p in stack.named_parameters(remove_duplicate=False))
        tied = {i for i, n in names.items() if n > 1}

        def in_float8(m: nn.Module) -> bool:
            return even_rows(m, tp, shards) and id(m.weight) not in tied

        uneven = dataclasses.replace(config, enable_fsdp_float8_all_gather=False)
        convert(stack, module_filter_fn=lambda m, fqn: selected(m, fqn) and not in_float8(m), config=uneven)
        convert(stack, module_filter_fn=lambda m, fqn: selected(m, fqn) and in_float8(m), config=config)
    else:
        convert(stack, module_filter_fn=selected, config=config)
    from dtensor_mimo.parallelize.fp8_layer import Float8LinearOrEmpty

    for layer in stack.modules():
        if type(layer) is Float8LinearOrEmpty.__base__:
            layer.__class__ = Float8LinearOrEmpty  # as fully_shard swaps a module's class


def fp8_rows_problem(batch_size: int, seq_len: int, microbatches: int, dp: int, cp: int) -> str | None:
    """Why a float8 language model could not train on a batch of `batch_size` x `seq_len` on CUDA,
    or None. Its weight gradients' float8 matmuls take the rows of a call (a dp rank's samples of
    a microbatch x its cp chunk) as their inner dim, which ``torch._scaled_mm`` takes only in
    multiples of `FP8_DIM_MULTIPLE`; the language model's rows are not padded (that would copy
    aligned ones too), and a dp rank whose count is off would fail alone while its peers wait. The
    same answer on every rank (the global batch's shape); O(1): the samples a call can hold take
    at most four values (an empty shard runs a stand-in sample)."""
    chunk = seq_len // cp
    per_mb = {batch_size // microbatches, -(-batch_size // microbatches)}
    counts = {max(1, n) for b in per_mb for n in (b // dp, -(-b // dp))}
    bad = sorted(n * chunk for n in counts if n * chunk % FP8_DIM_MULTIPLE)
    if not bad:
        return None
    return (f"fp8 on the language model: a batch of {batch_size} x {seq_len} tokens over {microbatches} "
            f"microbatch(es), dp {dp} and cp {cp} gives calls of {bad} rows, and float8 weight gradients on "
            f"CUDA take them in multiples of {FP8_DIM_MULTIPLE}; give seq_len a multiple of "
            f"{FP8_DIM_MULTIPLE * cp} (16 x cp), or fp8 off for the language model")


def even_rows(layer: nn.Linear, tp: int, shards: int) -> bool:
    """Whether `layer`'s weight rows split evenly over `shards` FSDP2 ranks on each of `tp` ranks
    (what torchao's float8 all-gather takes: it sends a shard unpadded, so a short last shard
    would mismatch its peers' in the collective; checked on the whole rows, so for either tp split)."""
    return layer.out_features % (shards * tp) == 0


def fp8_layers(module: nn.Module) -> list[str]:
    """The names of `module`'s float8 Linear layers (torchao's ``Float8Linear``)."""
    float8_linear = sys.modules.get("torchao.float8.float8_linear")  # none converted before torchao's import
    if float8_linear is None:
        return []
    return [name for name, m in module.named_modules() if isinstance(m, float8_linear.Float8Linear)]


@torch.no_grad()
def refresh_fp8_scales(module: nn.Module) -> None:
    """After the weights of `module` changed (an optimizer step, a load): recompute the float8
    scales of its FSDP2 weights that are all-gathered in float8 (tensorwise), every weight in
    one all-reduce, instead of one per weight at the next all-gather. Every rank of the
    module's dp mesh calls it; a module without such weights does nothing (no collective)."""
    if not fp8_layers(module):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(module)
