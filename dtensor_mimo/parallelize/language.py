"""The Llama decoder's tensor (+ sequence) parallel plan (compile and FSDP2 over dp·cp: the one
`dtensor_mimo.parallelize.part.parallelize`).

Input and output of the parallelized `Llama` (tp = size of `tp_mesh`):

- `tokens [B, S]`: plain int tensor, replicated over tp. `tok_embeddings` is vocab-sharded
  (`RowwiseParallel`); its output is replicated (no sp) or reduce-scattered onto the sequence
  shard (sp).
- `h [B, S, dim]` (assembled input embeddings, or the hidden states a later pipeline stage
  receives positionally): a plain tensor holding the full sequence, replicated over tp, in both
  modes. Under sp the first block slices its own chunk (no communication), and the gradient that
  flows back into `h` is the full one on every tp rank. A caller that holds only its sequence
  chunk (chunk r of `torch.chunk(h, tp, dim=1)` on tp rank r) passes it as a `Shard(1)` DTensor
  on `tp_mesh` instead (`DTensor.from_local` with the full `shape` and `stride`).
- `positions`, `document_ids`, `sequence_index`: plain `[B, S]` tensors for the full sequence
  over tp (they describe the rows after the all-gather inside attention).
- Output: logits `[B, S, vocab]` as a DTensor sharded over the vocabulary (`Shard(-1)`, the
  colwise `output` layer's own layout: `ParallelOptions.loss_parallel`, the default), which
  `dtensor_mimo.sequence.loss.token_loss_sum` reduces without gathering them; or, with
  `loss_parallel=False`, plain logits replicated over tp (the vocab shards all-gathered) for
  any loss code. Either way every tp rank computes the same loss and backward takes its
  gradient once. A stage without `output` returns its hidden states plain, full, replicated
  over tp.

Parameters the plan leaves whole on every tp rank are the norms (replicated activations: their
gradients agree) and Qwen3's per-head q/k norms (each rank applies them to its own heads: their
gradients are partial sums); `reduce_tp_replicated_gradients` makes both right after backward
(`MimoModel.reduce_gradients` calls it).

Context parallelism changes none of this: cp splits S before the model sees it, and FSDP runs over
the flattened dp·cp mesh so gradients are summed over both.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from dtensor_mimo.models import Llama
from dtensor_mimo.models.llama import head_is_embedding
from dtensor_mimo.parallelize.options import ParallelOptions
from dtensor_mimo.parallelize.tensor_parallel import (
    SEQUENCE_DIM,
    block_plan,
    check_divisible,
    parallelize_blocks,
    replicated_local_output,
)


LLAMA_BLOCK = dict(attention="attention", attention_colwise=("wq", "wk", "wv"), attention_rowwise="wo",
                   attention_extra_args=3,  # rope, sequence_index, document_ids
                   mlp="feed_forward", mlp_colwise=("w1", "w3"), mlp_rowwise="w2",
                   norms=("attention_norm", "ffn_norm"))
"""The names `block_plan` shards in a decoder block."""


def llama_tp_sizes(model: Llama) -> dict[str, int]:
    """The sizes the decoder's tp plan splits over the tp ranks (each must divide by tp)."""
    c = model.config
    return {"n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads, "ffn_hidden": c.ffn_hidden, "vocab_size": c.vocab_size}


def apply_llama_tp(model: Llama, tp_mesh: DeviceMesh, options: ParallelOptions) -> None:
    """Tensor parallel plan of the decoder (in place); see the module docstring for the contract."""
    tp, sp = tp_mesh.size(), options.sp
    check_divisible("Llama", llama_tp_sizes(model), tp)
    activation = Shard(SEQUENCE_DIM) if sp else Replicate()
    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=activation, use_local_output=not sp
        )
    if model.norm is not None and sp:
        plan["norm"] = SequenceParallel(sequence_dim=SEQUENCE_DIM)
    if model.output is not None:
        # loss_parallel: the vocabulary shards stay where they are (a Shard(-1) DTensor that
        # `token_loss_sum` reduces with two small all-reduces); else all-gathered, plain.
        plan["output"] = ColwiseParallel(
            input_layouts=activation,
            output_layouts=Shard(-1) if options.loss_parallel else Replicate(),
            use_local_output=not options.loss_parallel,
        )
    # A tied head (`LlamaConfig.tie_embeddings`): the vocab-parallel embedding and the colwise
    # head both shard the weight over the vocabulary, Shard(0) on the tp mesh, but each style
    # registers its own DTensor; the head takes the embedding's again, one parameter as before.
    tied = head_is_embedding(model)
    parallelize_module(model, tp_mesh, plan)
    if tied:
        model.output.weight = model.tok_embeddings.weight

    layer_plan = block_plan(sp=sp, **LLAMA_BLOCK)
    parallelize_blocks(model.layers.values(), tp_mesh, layer_plan, sp=sp)
    if sp:
        replicated_local_output(model, keep_vocab_shards=options.loss_parallel)
