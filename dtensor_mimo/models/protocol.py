"""What a user's own module must offer to take part in a `MimoModel` (torchtitan's "bring your
model and its parallelize function", as a small structural contract).

**Encoder** — any ``nn.Module`` with

- ``forward(items) -> rows``: a modality's items ``[N, ...]`` (this rank's dp shard) to rows
  ``[N * tokens_per_item, out_dim]``, items in order, each item's tokens consecutive. The
  batch's metadata declares the tokens per item (`ModalitySpec`); the first step checks the
  rows against it on every rank.
- ``out_dim: int``: the width of the rows; it must equal the language model's ``dim``.
- optional ``init_weights(seed)``: for `MimoModel.init_weights` (meta-device construction).
- optional ``parallelize(tp_mesh, options)``: its tensor (and sequence) parallel plan, applied
  in place on its ranks when the layout gives it tp > 1 (required then); the output must be
  replicated over tp, plain. The library then applies what is generic: activation checkpointing
  and per-block compile when the module has ``layers`` (an ``nn.ModuleDict`` of blocks; without
  it compile wraps the whole module and checkpointing is refused), FSDP2 over dp (each block,
  then the module) and mixed precision. `ModalityEncoder` (a library tower + `Projection`) meets
  the contract.

**Language model** — the library's `Llama`, or a module with the same parts: ``config`` with
``dim`` and ``n_layers``; ``tok_embeddings``; ``layers`` (an ``nn.ModuleDict`` of blocks called as
``block(h, rope, sequence_index, document_ids)``); ``norm``; ``output``; and
``forward(h=..., positions=..., document_ids=..., sequence_index=...)`` returning logits. With
tp > 1 it needs ``parallelize(tp_mesh, options)`` unless it is a `Llama`; with cp > 1 it needs
``set_attention_fn`` (the context-parallel attention core goes in through it).

`encoder_problems` and `language_problems` list what a module lacks; `MimoModel` raises with
that list before any process group is used.
"""

from __future__ import annotations

from torch import nn

from dtensor_mimo.models.llama import Llama
from dtensor_mimo.models.modality_encoder import ModalityEncoder


def encoder_problems(module: object, *, tp: int, activation_checkpointing: int) -> list[str]:
    """What `module` lacks to serve as an encoder with tensor parallel size `tp` (empty: fine)."""
    if not isinstance(module, nn.Module):
        return [f"to be an nn.Module (it is a {type(module).__name__})"]
    problems = []
    if not isinstance(getattr(module, "out_dim", None), int):
        problems.append("out_dim (an int: the width of its output rows)")
    if isinstance(module, ModalityEncoder):
        return problems
    if tp > 1 and not callable(getattr(module, "parallelize", None)):
        problems.append(f"parallelize(tp_mesh, options) (its tensor parallel plan: the layout gives it tp={tp})")
    if activation_checkpointing and not isinstance(getattr(module, "layers", None), nn.ModuleDict):
        problems.append("layers (an nn.ModuleDict of blocks, for activation_checkpointing)")
    return problems


def language_problems(module: object, *, tp: int, cp: int) -> list[str]:
    """What `module` lacks to serve as the language model with tp and cp sizes (empty: fine)."""
    if not isinstance(module, nn.Module):
        return [f"to be an nn.Module (it is a {type(module).__name__})"]
    config = getattr(module, "config", None)
    problems = [f"config.{f} (an int)" for f in ("dim", "n_layers") if not isinstance(getattr(config, f, None), int)]
    problems += [part for part in ("tok_embeddings", "norm", "output") if not hasattr(module, part)]
    if not isinstance(getattr(module, "layers", None), nn.ModuleDict):
        problems.append("layers (an nn.ModuleDict of blocks)")
    if tp > 1 and not isinstance(module, Llama) and not callable(getattr(module, "parallelize", None)):
        problems.append(f"parallelize(tp_mesh, options) (its tensor parallel plan: the layout gives it tp={tp})")
    if cp > 1 and not callable(getattr(module, "set_attention_fn", None)):
        problems.append(f"set_attention_fn(fn) (the layout gives it cp={cp})")
    return problems
