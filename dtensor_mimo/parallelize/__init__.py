"""Per-module parallel application (torchtitan style): tensor/sequence parallel plans, FSDP2 over
dp with gradients summed, optional per-block torch.compile.

| file                | concern                                                          |
|---------------------|------------------------------------------------------------------|
| options.py          | `ParallelOptions` (sp, fsdp, compile, backend, reshard)          |
| tensor_parallel.py  | the shared block plan, sp entry/exit                             |
| part.py             | `parallelize`: the one order (tp, checkpointing, compile, FSDP2) |
| language.py         | the Llama decoder's tensor parallel plan                         |
| encoders.py         | ViT / audio and projection tensor parallel plans                 |
| fsdp.py             | `apply_fsdp` (sum over dp), `reduce_in_this_backward` (pipeline stages), `reshard_fsdp_modules`, `fsdp_units` |
| reducer.py          | without FSDP2: `GradientReducer` (buckets during backward), `allreduce_gradients` |
| precision.py        | mixed precision: FSDP2 policy or autocast, `compute_dtype`       |
| replicas.py         | tp-replicated gradients made identical, replica comparison       |
| checkpointing.py    | `checkpoint_blocks`: activation checkpointing per block          |
| compile.py          | `compile_blocks`                                                 |
| fp8.py              | fp8 per module: torchao's `Float8Linear`, which layers, checks   |
"""

from dtensor_mimo.parallelize.checkpointing import checkpoint_blocks
from dtensor_mimo.parallelize.compile import compile_blocks
from dtensor_mimo.parallelize.fsdp import apply_fsdp, fsdp_units, reshard_fsdp_modules
from dtensor_mimo.parallelize.options import ParallelOptions
from dtensor_mimo.parallelize.part import (
    parallelize,
    parallelize_encoder,
    parallelize_llama,
    parallelize_projection,
    stacks,
)
from dtensor_mimo.parallelize.reducer import GradientReducer, allreduce_gradients
from dtensor_mimo.parallelize.precision import apply_data_parallel, autocast_forward, compute_dtype, uses_fsdp
from dtensor_mimo.parallelize.replicas import (
    finish_gradients,
    first_differing_replica,
    reduce_tp_replicated_gradients,
    replica_problems,
    tp_replicated,
)

__all__ = [
    "GradientReducer",
    "ParallelOptions",
    "allreduce_gradients",
    "apply_data_parallel",
    "apply_fsdp",
    "autocast_forward",
    "checkpoint_blocks",
    "compile_blocks",
    "compute_dtype",
    "finish_gradients",
    "first_differing_replica",
    "fsdp_units",
    "parallelize",
    "parallelize_encoder",
    "parallelize_llama",
    "parallelize_projection",
    "reduce_tp_replicated_gradients",
    "replica_problems",
    "reshard_fsdp_modules",
    "stacks",
    "tp_replicated",
    "uses_fsdp",
]
