"""`parallelize`: the one order every module part is parallelized in, whatever the module and
wherever it runs (a whole module at pp = 1, a pipeline stage, a planner's measurement):

0. fp8 (`ParallelOptions.fp8`): each stack's Linear layers become torchao's ``Float8Linear``
   (`dtensor_mimo.parallelize.fp8`: which layers, and float8 all-gathers where FSDP2 shards);
1. tensor parallel: each stack's own plan (`tp_plan`: the library's Llama, ViT / audio encoder
   and projection plans, or a user module's ``parallelize(tp_mesh, options)``);
2. activation checkpointing of each stack's blocks (``layers``; a stack without, e.g. a
   projection, is not checkpointed);
3. torch.compile per block (`ParallelOptions.compile_scope`: or each stack whole, a
   `ModalityEncoder` without FSDP2 units as one graph; a stack without blocks compiles whole;
   dynamo's recompile limit raised for stacks whose compiled pieces share code, `share_variants`);
4. FSDP2 over dp·cp on the part's root: each block (a stack without blocks is one unit), then
   the root itself, with the mixed precision policy; without FSDP (off, or a dp·cp mesh of
   size 1: no wrapper where nothing is sharded) autocast around the root's forward.

A part is a root module and the stacks it holds (`stacks`): a `ModalityEncoder` holds its tower
and its projection, an `EncoderStage` or a `LanguageStage` the pieces of its module that it
keeps. The schedule layer calls this for every part; torchtitan's ``pipeline_llm`` applies one
``parallelize_fn`` to every part the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from dtensor_mimo.layout import LayoutError, Parallelism
from dtensor_mimo.models import AudioEncoder, Llama, ModalityEncoder, Projection, ViT
from dtensor_mimo.models.llama import head_is_embedding
from dtensor_mimo.parallelize.checkpointing import checkpoint_blocks
from dtensor_mimo.parallelize.compile import compile_blocks, share_variants
from dtensor_mimo.parallelize.encoders import (ENCODER_BLOCK, apply_encoder_tp, apply_projection_tp,
                                               encoder_tp_sizes, projection_plan, projection_tp_sizes)
from dtensor_mimo.parallelize.fp8 import convert_to_fp8, fp8_config, fp8_layers
from dtensor_mimo.parallelize.language import LLAMA_BLOCK, apply_llama_tp, llama_tp_sizes
from dtensor_mimo.parallelize.options import ParallelOptions
from dtensor_mimo.parallelize.precision import apply_data_parallel, uses_fsdp
from dtensor_mimo.parallelize.tensor_parallel import block_plan, check_divisible, tp_size, weight_splits

log = logging.getLogger(__name__)

TpPlan = Callable[[nn.Module, DeviceMesh, ParallelOptions], None]


def user_tp_plan(model: nn.Module, tp_mesh: DeviceMesh, options: ParallelOptions) -> None:
    """A user module's own tensor parallel plan: its ``parallelize(tp_mesh, options)`` method
    (see `dtensor_mimo.models.protocol`)."""
    model.parallelize(tp_mesh, options)


@dataclass(frozen=True)
class LibraryTp:
    """The library's tensor parallel plan of one kind of stack: how it is applied (`plan`), the
    sizes it splits over the tp ranks (`sizes`), and its Linear layers' sharded weight dims (the
    names `block_plan` or the plan shards: `weight_splits`)."""

    plan: TpPlan
    sizes: Callable[[nn.Module], dict[str, int]]
    shards: Callable[[], dict[str, ParallelStyle]]


LIBRARY_TP: tuple[tuple[tuple[type, ...], LibraryTp], ...] = (
    ((Llama,), LibraryTp(apply_llama_tp, llama_tp_sizes, lambda: block_plan(sp=False, **LLAMA_BLOCK))),
    ((ViT, AudioEncoder), LibraryTp(apply_encoder_tp, encoder_tp_sizes, lambda: block_plan(sp=False, **ENCODER_BLOCK))),
    ((Projection,), LibraryTp(apply_projection_tp, projection_tp_sizes, projection_plan)),
)
"""The stacks the library has its own tp plan for; any other is a user module (`user_tp_plan`)."""


def library_tp(module: nn.Module) -> LibraryTp | None:
    """The library's tp plan of `module`'s kind (`LIBRARY_TP`), or None for a user module."""
    return next((tp for kinds, tp in LIBRARY_TP if isinstance(module, kinds)), None)


def tp_plan(module: nn.Module) -> TpPlan:
    """The tensor parallel plan of one stack: the library's for its own modules, else the
    module's own ``parallelize`` (`user_tp_plan`)."""
    tp = library_tp(module)
    return user_tp_plan if tp is None else tp.plan


def tp_weight_splits(module: nn.Module) -> dict[str, int]:
    """The weight dim the library's tp plan of one stack shards in each Linear layer it splits, by
    the layer's name inside a block or the stack (`weight_splits`); {} for a user module (its own
    ``parallelize`` is not read: fp8 on CUDA then judges its layers whole, `convert_to_fp8`)."""
    tp = library_tp(module)
    return {} if tp is None else weight_splits(tp.shards())


def tp_sizes(module: nn.Module) -> dict[str, int]:
    """The sizes the library's tp plan of one stack splits over the tp ranks (`tp_plan`); {} for a
    user module, whose own ``parallelize`` checks what it splits."""
    tp = library_tp(module)
    return {} if tp is None else tp.sizes(module)


def check_tp_sizes(name: str, module: nn.Module, tp: int, parts: Iterable[nn.Module] | None = None) -> None:
    """Refuse (ValueError naming module `name`, the stack and the sizes) a `tp` that the library's
    plan of a stack of `module` (`parts`, default: its `stacks`) cannot split evenly. Pure (configs
    only): `check_model` runs it on every rank before any process group, so that a module's ranks
    do not fail alone in its tp plan while the other modules' ranks go on to wait for them in the
    first collective."""
    if tp <= 1:
        return
    for stack in stacks(module) if parts is None else parts:
        check_divisible(f"module {name!r} ({type(stack).__name__})", tp_sizes(stack), tp)
    check_untied(name, module, f"tp={tp}: the tensor parallel plan registers each layer's own shards",
                 allowed=library_ties(module))


def check_untied(name: str, module: nn.Module, why: str, allowed: Iterable[tuple[str, ...]] = ()) -> None:
    """Refuse (ValueError naming module `name` and the names) parameters of `module` registered
    under several names (tied weights), which `why` (a tp plan, a pipeline split) would untie:
    each copy would then train on its own, where the single process sums their gradients. The
    groups of names in `allowed` are ties that survive it (`library_ties`). Pure."""
    if tied := [group for group in tied_parameters(module) if tuple(group) not in set(allowed)]:
        detail = "; ".join(" = ".join(names) for names in tied)
        raise ValueError(f"module {name!r}: tied parameters ({detail}: one tensor under several names) with "
                         f"{why}, which would untie them and train each on its own; give each name its own copy "
                         "(untie them), or leave that parallelism at 1")


def check_fsdp_ties(name: str, module: nn.Module, shards: int) -> None:
    """Refuse (ValueError naming module `name` and the names) parameters of `module` registered
    under several names in different FSDP2 units (each block of a stack, a projection, the root:
    `parallelize_part`'s), which FSDP2 over `shards` dp·cp ranks would shard apart (torch 2.13
    refuses it inside ``fully_shard``, on the module's ranks alone, the others then waiting). A tie
    within one unit (the library's tied head and embedding, both in the root) stays one tensor. Pure."""
    units = [f"{prefix}layers.{key}." for prefix, stack in _stacks_named(module)
             if (layers := blocks(stack)) is not None for key in layers]
    units += [prefix for prefix, stack in _stacks_named(module) if blocks(stack) is None and prefix]

    def unit(param: str) -> str:
        return max((u for u in units if param.startswith(u)), key=len, default="the root")

    if split := [group for group in tied_parameters(module) if len({unit(n) for n in group}) > 1]:
        detail = "; ".join(" = ".join(f"{n} (in {unit(n).rstrip('.')})" for n in group) for group in split)
        raise ValueError(f"module {name!r}: tied parameters ({detail}: one tensor under several names) in different "
                         f"FSDP2 units with fsdp over dp·cp = {shards}: FSDP2 shards each unit on its own, which would "
                         "untie them; tie only parameters of one block (or of the root), give each name its own copy, "
                         "or set ParallelOptions(fsdp=False) for it")


def _stacks_named(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """`stacks(module)`, each with the prefix of its parameter names in `module` ("" for itself)."""
    prefixes = {id(m): f"{n}." if n else "" for n, m in module.named_modules()}
    return [(prefixes[id(stack)], stack) for stack in stacks(module)]


def tied_parameters(module: nn.Module) -> list[list[str]]:
    """The names of each parameter of `module` registered under more than one name (tied weights)."""
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return [group for group in names.values() if len(group) > 1]


def library_ties(module: nn.Module) -> list[tuple[str, ...]]:
    """The names of the tied head of each library `Llama` in `module` (itself, or the stage that
    holds it) built tied (`LlamaConfig.tie_embeddings`: ``tok_embeddings.weight``,
    ``output.weight`` under its prefix), which its tp plan keeps tied (`apply_llama_tp`), a
    pipeline split unties by name (`untie_for_stages`) and its exports write tied; a user's own
    tied parameters, or a Llama tied by hand against its config, stay refused."""
    return [(f"{prefix}tok_embeddings.weight", f"{prefix}output.weight")
            for prefix, m in ((f"{n}." if n else "", m) for n, m in module.named_modules())
            if isinstance(m, Llama) and m.config.tie_embeddings and head_is_embedding(m)]


def stacks(module: nn.Module) -> list[nn.Module]:
    """The stacks a module holds, each parallelized with its own `tp_plan`: a `ModalityEncoder`'s
    tower and projection (those still there: a pipeline stage keeps its own), else the module."""
    if isinstance(module, ModalityEncoder):
        return [m for m in (module.encoder, module.projection) if m is not None]
    return [module]


def blocks(module: nn.Module) -> nn.ModuleDict | None:
    """A stack's blocks (its ``layers`` ModuleDict), None without."""
    layers = getattr(module, "layers", None)
    return layers if isinstance(layers, nn.ModuleDict) else None


def parallelize(root: nn.Module, tp_mesh: DeviceMesh | None, dp_mesh: DeviceMesh | None,
                options: ParallelOptions = ParallelOptions(), parts: Sequence[nn.Module] | None = None, *,
                wrap_one_rank: bool = False, name: str | None = None, ragged_rows: bool = False,
                first_block: int = 0) -> nn.Module:
    """Parallelize the stacks `parts` held by `root` (default: `stacks(root)`; steps 1-3 each),
    then FSDP2 or autocast on `root` (step 4), in place; returns `root`. `tp_mesh`: the module's
    "tp" sub-mesh (None or size 1: no tensor parallel); `dp_mesh`: its flattened dp·cp sub-mesh,
    sharing one root mesh with `tp_mesh` (as `MimoLayout` builds them). A part without any
    blocks cannot take activation checkpointing (refused by name). `wrap_one_rank`: apply tensor
    parallel and FSDP2 on meshes of one rank too (nothing is sharded; the planner times their
    per-call cost so). `name`: the module's name in errors (default: its class name).
    `ragged_rows`: its rows per call vary (an encoder's items; `fp8_config`). `first_block`: the
    position in the whole module of the first block the parts hold (a pipeline stage's), from
    which `activation_checkpointing` counts its every n-th block."""
    parts = stacks(root) if parts is None else list(parts)
    name = name or type(root).__name__
    check_tp_sizes(name, root, tp_size(tp_mesh), parts)
    if options.activation_checkpointing and all(blocks(stack) is None for stack in parts):
        raise ValueError(f"{name} has no `layers` ModuleDict of blocks to checkpoint; "
                         "set activation_checkpointing=0")
    check_compile_layout(name, options, Parallelism(dp=1 if dp_mesh is None else dp_mesh.size(),
                                                    tp=1 if tp_mesh is None else tp_mesh.size()))
    fp8 = None if options.fp8 is None else fp8_config(
        name, options.fp8, _device_type(root, tp_mesh, dp_mesh), uses_fsdp(options, dp_mesh, wrap_one_rank),
        ragged_rows)
    units: list[nn.Module] = []  # FSDP2's units below the root
    # A ModalityEncoder that no FSDP2 unit cuts compiles whole under compile_scope="module": tower
    # and projection in one graph, one compiled call (a CUDA graph replay) per forward and per
    # backward instead of two.
    one_graph = (options.compile and options.compile_scope == "module" and isinstance(root, ModalityEncoder)
                 and not uses_fsdp(options, dp_mesh, wrap_one_rank))
    # Stacks under tp whose rows per call are fixed (a decoder's: its sequence length) compile
    # static shapes, one variant per length: traced with a symbolic length, a second length's
    # backward recursed without end in torch's tracer (a DTensor `sym_max`), on every tp rank.
    static = {"dynamic": False} if tp_size(tp_mesh) > 1 and not ragged_rows else {}
    for stack in parts:
        if fp8 is not None:
            convert_to_fp8(stack, fp8, name, options.fp8, tp_size(tp_mesh), tp_weight_splits(stack),
                           1 if dp_mesh is None else dp_mesh.shape[-1])  # FSDP2 shards over its last dim
        if tp_size(tp_mesh) > 1 or (wrap_one_rank and tp_mesh is not None):
            frozen = {n for n, p in stack.named_parameters() if not p.requires_grad}
            tp_plan(stack)(stack, tp_mesh, options)
            # torch's SequenceParallel registers each norm parameter anew, requiring a gradient:
            # what the user froze stays frozen (else a frozen block's norms would train under sp)
            for n, p in stack.named_parameters():
                if n in frozen:
                    p.requires_grad_(False)
        layers = blocks(stack)
        whole = layers is None or options.compile_scope == "module"
        if options.compile and whole and not one_graph:
            stack.compile(**options.compile_kwargs, **static)
            share_variants(stack, stack)
        if layers is None:  # one FSDP2 unit (a projection: not checkpointed)
            if stack is not root:
                units.append(stack)
            continue
        compiled = options.compile_kwargs if options.compile else {}
        done = (checkpoint_blocks(layers, options.activation_checkpointing, compiled.get("backend"),
                                  compiled.get("mode"), compiled.get("options"), first=first_block,
                                  dynamic=static.get("dynamic"))
                if options.activation_checkpointing else set())
        if options.compile and not whole:
            compile_blocks(layers, skip=done, **options.compile_kwargs, dynamic=static.get("dynamic"))
            share_variants(stack, *layers.values())
        units.extend(layers.values())
    if fp8 is not None and not fp8.emulate and not fp8_layers(root):
        log.warning("ParallelOptions(fp8=%r) for %s: none of its Linear layers converts (on CUDA only those whose "
                    "float8 matmuls torchao measured faster than bf16, fp8_pays); it trains in the compute dtype",
                    options.fp8, name)
    if one_graph:
        root.compile(**options.compile_kwargs)
        share_variants(root, root)
    apply_data_parallel(root, dp_mesh, units, options, wrap_one_rank)
    return root


def check_compile_layout(name: str, options: ParallelOptions, par: Parallelism) -> None:
    """Refuse (LayoutError) what module `name`'s compile options cannot do on its layout `par`:
    where FSDP2 shards it (dp·cp > 1), a whole-module compile (FSDP2's per-block hooks would sit
    inside the graph) and CUDA graphs (a graph replays at the parameters' recorded addresses;
    FSDP2 allocates the unsharded parameters anew every step); CUDA graphs with tp or cp > 1
    (their collectives would be captured in the graphs: not measured)."""
    shards = par.dp * par.cp
    if options.fsdp and shards > 1 and options.compile and options.compile_scope == "module":
        raise LayoutError(f"{name}: ParallelOptions(compile_scope='module') compiles the module whole, but FSDP2 "
                          f"shards it over its {shards} dp·cp ranks with hooks around every block; use "
                          "compile_scope='block' (each block compiled, FSDP2's hooks left to eager) or fsdp=False")
    if not options.cuda_graphs:
        return
    if par.tp > 1 or par.cp > 1:
        raise LayoutError(f"{name}: ParallelOptions(compile_mode={options.compile_mode!r}) with tp={par.tp}, "
                          f"cp={par.cp}: CUDA graphs would capture the module's tp / cp collectives, which is not "
                          "measured here; use compile_mode=None, or tp = cp = 1 (dp replicas are fine)")
    if options.fsdp and shards > 1:
        raise LayoutError(f"{name}: ParallelOptions(compile_mode={options.compile_mode!r}) replays CUDA graphs, which "
                          f"need parameters that stay put, but FSDP2 shards the module over its {shards} dp·cp "
                          "ranks and allocates the unsharded parameters anew every step; set fsdp=False "
                          "(parameters replicated over dp) or compile_mode=None")


def _device_type(root: nn.Module, *meshes: DeviceMesh | None) -> str:
    """Where `root` will compute: its meshes' device type, else its parameters' ("cpu" on meta)."""
    mesh = next((m for m in meshes if m is not None), None)
    if mesh is not None:
        return mesh.device_type
    device = next((p.device for p in root.parameters()), torch.device("cpu"))
    return "cpu" if device.type == "meta" else device.type


parallelize_llama = parallelize_encoder = parallelize_projection = parallelize
"""`parallelize` under the per-kind names users call (a `Llama` or a user's decoder, a `ViT` or
`AudioEncoder`, a `Projection`): one function."""
