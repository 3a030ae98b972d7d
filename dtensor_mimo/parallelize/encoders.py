"""Tensor parallel plans of the modality encoders (ViT, audio) and the projection into the LLM width
(the rest of their parallelization is `dtensor_mimo.parallelize.part.parallelize`).

Input and output (tp = size of `tp_mesh`):

- `ViT`: images `[N, C, H, W]`, `AudioEncoder`: mels `[N, n_mels, T]`, `Projection`: `[..., in]`
  — plain tensors, replicated over tp (every tp rank of a dp replica holds the same items).
- Output: a plain tensor `[N, n_tok, dim]` (projection: `[..., out]`), replicated over tp — the
  form the bridge takes. Under sp the blocks run on sequence chunks (S need not divide tp) and
  the final norm's output is all-gathered.

The patch embedding / convolutions, position embeddings and the final norm (without sp) stay
replicated over tp; their gradients are identical on every tp rank.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from dtensor_mimo.models import AudioEncoder, Projection, ViT
from dtensor_mimo.parallelize.options import ParallelOptions
from dtensor_mimo.parallelize.tensor_parallel import (
    SEQUENCE_DIM,
    block_plan,
    check_divisible,
    parallelize_blocks,
    replicated_local_output,
)


ENCODER_BLOCK = dict(attention="attn", attention_colwise=("wq", "wk", "wv"), attention_rowwise="wo",
                     attention_extra_args=0, mlp="mlp", mlp_colwise=("fc1",), mlp_rowwise="fc2",
                     norms=("norm1", "norm2"))
"""The names `block_plan` shards in a ViT or audio encoder block."""


def projection_plan() -> dict[str, ParallelStyle]:
    """The projection's tp plan: fc1 column-parallel, fc2 row-parallel (output replicated)."""
    return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


def encoder_tp_sizes(model: ViT | AudioEncoder) -> dict[str, int]:
    """The sizes the encoder's tp plan splits over the tp ranks (each must divide by tp)."""
    return {"n_heads": model.config.n_heads, "mlp_hidden": model.config.mlp_hidden}


def projection_tp_sizes(model: Projection) -> dict[str, int]:
    """The size the projection's tp plan splits over the tp ranks (it must divide by tp)."""
    return {"hidden_dim": model.fc1.out_features}


def apply_encoder_tp(model: ViT | AudioEncoder, tp_mesh: DeviceMesh, options: ParallelOptions) -> None:
    """Tensor parallel plan of the encoder blocks (in place); output replicated and plain."""
    sp = options.sp
    check_divisible(type(model).__name__, encoder_tp_sizes(model), tp_mesh.size())
    layer_plan = block_plan(sp=sp, **ENCODER_BLOCK)
    parallelize_blocks(model.layers.values(), tp_mesh, layer_plan, sp=sp)
    if sp:
        if model.norm is not None:
            parallelize_module(model, tp_mesh, {"norm": SequenceParallel(sequence_dim=SEQUENCE_DIM)})
        replicated_local_output(model)


def apply_projection_tp(model: Projection, tp_mesh: DeviceMesh, options: ParallelOptions) -> None:
    """fc1 colwise, fc2 rowwise (output replicated, plain); `options.sp` does not apply (no norm,
    and the output must be replicated anyway)."""
    check_divisible("Projection", projection_tp_sizes(model), tp_mesh.size())
    parallelize_module(model, tp_mesh, projection_plan())
