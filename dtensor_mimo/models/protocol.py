"""What a user's own module must offer to take part in a `MimoModel` (torchtitan's "bring your
model and its parallelize function", as a small structural contract).

**Encoder** — any ``nn.Module`` with

- ``forward(items) -> rows``: a modality's items ``[N, ...]`` (this rank's dp shard) to rows
  ``[N * tokens_per_item, out_dim]``, items in order, each item's tokens consecutive. The
  batch's metadata declares the tokens per item (`ModalitySpec`); the first step checks the
  rows against it on every rank. A dp rank without items in a microbatch calls it on ``N = 0``
  items (FSDP2's and the dp reductions' collectives need every rank's forward and backward):
  its rows ``[0, out_dim]`` must still come from every trainable parameter, as with items
  (plain ``nn.Linear`` / convolution layers do; a branch that skips a layer on empty input would
  leave that rank's gradient set unlike its peers', and their reductions would not match).
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
``dim`` and ``n_layers``; ``tok_embeddings``; ``layers`` (an ``nn.ModuleDict`` of blocks); ``norm``;
``output``; and ``forward(h=..., positions=..., document_ids=..., sequence_index=...)`` returning
logits (the library embeds the text with ``tok_embeddings`` and assembles the modality rows into
``h`` first). With tp > 1 it needs ``parallelize(tp_mesh, options)`` unless it is a `Llama`; with
cp > 1 it needs ``set_attention_fn`` (the context-parallel attention core goes in through it).

**Language pipeline stages** (pp > 1) are cut from the user's own module (torchtitan's
``pipeline_llm``): `decoder_stage` gives a shallow copy of it — its own class, so its own
``forward``, ``parallelize`` and ``init_weights`` — holding a contiguous run of its ``layers``
(keys unchanged), ``tok_embeddings`` on the first stage only and ``norm`` and ``output`` on the last
only; the parts a stage does not hold are None, parameter names stay those of the whole model.
So, to be split, the decoder needs

- ``tok_embeddings``, ``norm`` and ``output`` as submodules, and no parameter outside them and
  ``layers`` (a stage would not know whether it holds it);
- a ``forward(h=...)`` that runs the parts it holds: its ``layers`` in order, then ``norm`` and
  ``output`` when they are not None, returning the hidden states ``[b, s, dim]`` otherwise.
  What it computes from its arguments between the parts (rotary angles, masks) every stage
  recomputes; it must not change the hidden states outside its parts. Checked on the meta
  device, as a middle stage, before any process group is used;
- with tp > 1, a ``parallelize`` that leaves the None parts alone (it runs on each stage);
- ``init_weights(seed)`` giving each parameter a value that depends on the seed and its name
  only (`dtensor_mimo.models.init_weights` does), run on each stage.

`encoder_problems` and `language_problems` list what a module lacks; `MimoModel` raises with
that list before any process group is used.
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
from torch import nn

from dtensor_mimo.models.audio import AudioEncoder
from dtensor_mimo.models.llama import Llama
from dtensor_mimo.models.modality_encoder import ModalityEncoder
from dtensor_mimo.models.projection import Projection
from dtensor_mimo.models.vit import ViT


ItemRule = Callable[[tuple[int, ...], int], "str | None"]


def item_rule(encoder: nn.Module) -> ItemRule | None:
    """What an encoder takes per item, as a pure check ``(item shape, tokens of that item) ->
    problem or None``, so every rank can check a batch against an encoder it does not hold (call
    it once per item when items differ in size). Known for a `ModalityEncoder` over a `ViT` or
    `AudioEncoder` (their configs' `item_problem` and `tokens_for`), and for a user's encoder
    that has ``tokens_per_item(item_shape) -> int``; None otherwise (the first crossing checks
    the rows)."""
    tower = encoder.encoder if isinstance(encoder, ModalityEncoder) else encoder
    config = getattr(tower, "config", None)
    if isinstance(tower, (ViT, AudioEncoder)):
        # Per item, so a count of its own for each item (dynamic resolution, variable length).
        vit = isinstance(tower, ViT)

        def library(item: tuple[int, ...], tokens: int) -> str | None:
            problem = config.item_problem(item)
            if problem:
                return f"items of {problem}"
            want = config.tokens_for(item)
            if tokens == want:
                return None
            if vit:
                size = f" of {item[1]}x{item[2]} px" if config.dynamic_resolution else ""
                return f"tokens_per_item={tokens}, but the ViT gives {want} rows per image{size}"
            return f"tokens_per_item={tokens}, but the audio encoder gives {want} rows per clip of {item[1]} frames"

        return library
    count = getattr(encoder, "tokens_per_item", None)
    if callable(count):
        def user(item: tuple[int, ...], tokens: int) -> str | None:
            want = count(item)
            return None if want == tokens else f"tokens_per_item={tokens}, but the encoder gives {want} rows per item"

        return user
    return None


def encoder_width(encoder: nn.Module) -> int | None:
    """The width of an encoder's transformer (its tower's ``config.dim``: `ViT`, `AudioEncoder`,
    or a user's encoder with such a config), which sets what an item costs (`data.balance`);
    None when unknown."""
    tower = encoder.encoder if isinstance(encoder, ModalityEncoder) else encoder
    dim = getattr(getattr(tower, "config", None), "dim", None)
    return dim if isinstance(dim, int) and not isinstance(dim, bool) else None


def encoder_problems(module: object, *, tp: int, activation_checkpointing: int) -> list[str]:
    """What `module` lacks to serve as an encoder with tensor parallel size `tp` (empty: fine)."""
    if not isinstance(module, nn.Module):
        return [f"to be an nn.Module (it is a {type(module).__name__})"]
    problems = []
    if not isinstance(getattr(module, "out_dim", None), int):
        problems.append("out_dim (an int: the width of its output rows)")
    # A ModalityEncoder is parallelized part by part (its tower, its projection): a part that is
    # not one of the library's own needs its own tp plan, as a user's encoder does.
    parts = ({"encoder": module.encoder, "projection": module.projection} if isinstance(module, ModalityEncoder)
             else {"": module})
    parts = {n: p for n, p in parts.items() if p is not None}
    for part_name, part in parts.items():
        if tp > 1 and not isinstance(part, (ViT, AudioEncoder, Projection)) and not callable(
                getattr(part, "parallelize", None)):
            whose = f"its {part_name} ({type(part).__name__}) to have " if part_name else ""
            problems.append(f"{whose}parallelize(tp_mesh, options) (its tensor parallel plan: the layout gives it "
                            f"tp={tp})")
    if activation_checkpointing and not any(isinstance(getattr(p, "layers", None), nn.ModuleDict)
                                            for p in parts.values()):
        where = "its encoder or projection to have " if isinstance(module, ModalityEncoder) else ""
        problems.append(f"{where}layers (an nn.ModuleDict of blocks, for activation_checkpointing)")
    return problems


def language_problems(module: object, *, tp: int, cp: int, pp: int = 1, stages: int | None = None) -> list[str]:
    """What `module` lacks to serve as the language model with tp, cp and pp sizes (empty: fine).
    `stages`: the pipeline stages it is cut into (``pp * virtual_stages``; None: pp), also on one
    pp rank (pp = 1 with virtual stages), where a stage holds only its parts of it as well."""
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
    stages = pp if stages is None else stages
    if stages > 1 and not problems:
        problems += split_problems(module, pp, stages)
    return problems


STAGE_PARTS = ("tok_embeddings", "layers", "norm", "output")
"""The parts of a decoder that pipeline stages divide among themselves."""


def split_problems(decoder: nn.Module, pp: int, stages: int | None = None) -> list[str]:
    """What `decoder` (meeting the rest of the language protocol) lacks to be cut into pipeline
    stages by `decoder_stage` (pure: its forward runs once on the meta device); `stages`: how
    many (None: pp)."""
    stages = pp if stages is None else stages
    cut = (f"the layout gives it pp={pp}" if stages == pp else
           f"the pipeline cuts it into {stages} stages, pp={pp} x virtual_stages={stages // pp}")
    parts = [p for p in ("tok_embeddings", "norm", "output") if not isinstance(getattr(decoder, p), nn.Module)]
    if parts:
        return [f"{', '.join(parts)} as submodules ({cut}: each stage holds some "
                "parts and sets the others to None)"]
    outside = [n for n, _ in decoder.named_parameters() if n.split(".")[0] not in STAGE_PARTS]
    if outside:
        return [f"no parameters outside {', '.join(STAGE_PARTS)} ({cut}; a stage holds "
                f"only those parts, and {outside[:4]}{' ...' if len(outside) > 4 else ''} are in none of them)"]
    if len(decoder.layers) < 1 or type(decoder) is Llama:
        return []  # `stage_layers` names the layer count; the library's Llama is known to split
    problem = _middle_stage_problem(decoder)
    return [problem] if problem else []


def decoder_stage(decoder: nn.Module, layers: Sequence[int], first: bool, last: bool) -> nn.Module:
    """One pipeline stage of `decoder`: a shallow copy of it (its class, attributes and methods)
    holding its blocks at positions `layers` (keys unchanged), ``tok_embeddings`` if `first`,
    ``norm`` and ``output`` if `last`, the other parts None; it shares those modules with
    `decoder` (nothing is copied), so parameter names are the whole model's. `decoder` itself is
    left whole: the copy has registries (submodules, parameters, buffers, hooks) of its own."""
    stage = copy.copy(decoder)
    for key, value in vars(decoder).items():
        if isinstance(value, (dict, set)):  # nn.Module's registries, shared by a plain shallow copy
            stage.__dict__[key] = copy.copy(value)
    blocks = list(decoder.layers.items())
    stage.tok_embeddings = decoder.tok_embeddings if first else None
    stage.layers = nn.ModuleDict({key: block for key, block in (blocks[i] for i in layers)})
    stage.norm = decoder.norm if last else None
    stage.output = decoder.output if last else None
    return stage


def _middle_stage_problem(decoder: nn.Module) -> str | None:
    """Run `decoder`'s forward as a middle stage (one block, no embeddings, norm or head) on the
    meta device: None if it returns hidden states ``[1, 4, dim]``, else what went wrong."""
    dim = decoder.config.dim
    stage = decoder_stage(decoder, [0], first=False, last=False)
    tensors = {n: t for n, t in (*stage.named_parameters(), *stage.named_buffers())}
    dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.get_default_dtype())
    meta = {n: torch.empty_like(t, device="meta") for n, t in tensors.items()}
    h = torch.zeros(1, 4, dim, dtype=dtype, device="meta")
    positions = torch.zeros(1, 4, dtype=torch.int64, device="meta")
    what = ("a forward that runs the parts a pipeline stage holds (its layers, then norm and output only "
            "when they are not None)")
    try:
        with torch.no_grad():
            out = torch.func.functional_call(stage, meta, (), dict(h=h, positions=positions, document_ids=None,
                                                                    sequence_index=None))
    except Exception as error:  # noqa: BLE001 - reported as what the module lacks
        return (f"{what}: as a middle stage (norm and output None) on the meta device, forward(h=[1, 4, {dim}]) "
                f"raised {type(error).__name__}: {error}")
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (1, 4, dim):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return (f"{what}: as a middle stage (norm and output None) forward(h=[1, 4, {dim}]) must return the "
                f"hidden states [1, 4, {dim}], got {got}")
    return None
