"""Pieces shared by every reference model: RMSNorm, rotary embeddings, the causal attention core,
the encoders' packed (block-diagonal) attention core, and deterministic weight initialisation.

Each lives here once; `llama.py`, `vit.py`, `audio.py` and `projection.py` import them.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import zlib
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

# --------------------------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in at least float32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = _as(x, _at_least_fp32(x.dtype))
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return _as(normed, x.dtype) * self.weight


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """``torch.promote_types(dtype, torch.float32)`` for real dtypes, without an operator call."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in `dtype`; no operator call when it already is (an eager step's host time is its
    operator calls: a tiny model's step is hundreds of them)."""
    return x if x.dtype == dtype else x.to(dtype)


# --------------------------------------------------------------------------------------------
# Rotary position embedding (RoPE)
# --------------------------------------------------------------------------------------------
#
# The angles are computed from explicit per-token positions, not from the row index of the
# tensor: under context parallelism a rank holds a non-contiguous subset of the sequence, and in a
# packed row the positions restart at every document. Computing cos/sin directly from the
# positions (instead of gathering rows of a precomputed table) gives the same numbers and needs no
# buffer, so meta-device init, checkpoints and pipeline stages have nothing to recompute.


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's long-context frequency scaling (Hugging Face ``rope_type="llama3"``): pairs
    whose wavelength exceeds ``original_max_position_embeddings / low_freq_factor`` turn
    `factor` times slower, those below ``... / high_freq_factor`` keep their frequency, and the
    band between is interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The scaled inverse frequencies."""
        low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = ((self.original_max_position_embeddings / wavelen - self.low_freq_factor)
                  / (self.high_freq_factor - self.low_freq_factor))
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each `[*positions.shape, head_dim // 2]`.

    Pair i of a head (elements 2i, 2i+1) is rotated by `position * theta ** (-2i / head_dim)`
    (frequencies then adjusted by `scaling`, if given). `dtype` is promoted to at least float32
    so that large positions keep their precision.
    """
    dtype = _at_least_fp32(dtype)
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=dtype) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is not None:
        inv_freq = scaling.apply(inv_freq)
    angles = positions.to(dtype).unsqueeze(-1) * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [B, S, H, D]` by the angles of `cos, sin [B, S, D // 2]`.

    Adjacent elements (2i, 2i+1) form one complex number, as in the original Llama. The number of
    heads H is whatever the tensor holds, so a tensor-parallel shard of the heads works unchanged.
    (`apply_rope_tables` with `rope_tables`, which a model computes once for all its layers.)
    """
    return apply_rope_tables(x, rope_tables(cos, sin))


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`cos, sin [B, S, D // 2]` laid out for `apply_rope_tables`: each angle's cos twice, and its
    sin as (-sin, sin), per element, `[B, S, 1, D]` (broadcast over heads)."""
    return (torch.stack((cos, cos), -1).flatten(-2).unsqueeze(2),
            torch.stack((-sin, sin), -1).flatten(-2).unsqueeze(2))


def apply_rope_tables(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`x [B, S, H, D]` rotated by the angles of `rope_tables`: element 2i becomes
    ``x[2i] cos - x[2i+1] sin`` and 2i+1 ``x[2i+1] cos + x[2i] sin``, the same products and sums,
    to the bit, as the complex rotation written out (6 operators a call instead of 15)."""
    cos, sin = tables
    xf = _as(x, cos.dtype)
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x[2i+1], x[2i]) in each pair
    return _as(xf * cos + swapped * sin, x.dtype)


# --------------------------------------------------------------------------------------------
# Attention core
# --------------------------------------------------------------------------------------------


class AttentionFn(Protocol):
    """The contract every attention core (the default below, a context-parallel one, ...) meets.

    Arguments:
        q: `[B, Hq, Sq, D]` queries, rotary embedding already applied.
        k, v: `[B, Hkv, Skv, D]`; `Hq` is a multiple of `Hkv` (grouped-query attention: query head
            h reads key/value head `h // (Hq // Hkv)`). The core does the head repetition, so a
            context-parallel core gathers only the `Hkv` heads.
        q_pos: `[B, Sq]` integer *global sequence index* of each query row (its column in the
            full, unsharded sequence; not the rotary position, which restarts per document).
            None (with `kv_pos` None): plain rows, queries and keys are columns ``0..S-1`` in
            order, so a core may use a causal kernel without building a mask.
        kv_pos: `[B, Skv]` the same for each key/value row.
        q_doc, kv_doc: optional `[B, Sq]` / `[B, Skv]` document ids of packed sequences; either
            both or neither.

    Returns `[B, Hq, Sq, D]`: query row i attends to key row j exactly when
    `kv_pos[j] <= q_pos[i]` and (if documents are given) `kv_doc[j] == q_doc[i]`, with scale
    `1 / sqrt(D)`. Every query must be allowed at least one key (it always sees itself when its
    own row is among the keys).

    The Llama model calls the core with `kv_pos = q_pos` and `kv_doc = q_doc` (its local rows). A
    context-parallel core all-gathers k, v, kv_pos and kv_doc over the cp group and then applies
    exactly this rule.
    """

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        q_pos: torch.Tensor | None,
        kv_pos: torch.Tensor | None,
        q_doc: torch.Tensor | None = None,
        kv_doc: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_pos: torch.Tensor | None,
    kv_pos: torch.Tensor | None,
    q_doc: torch.Tensor | None = None,
    kv_doc: torch.Tensor | None = None,
) -> torch.Tensor:
    """The default attention core; see `AttentionFn` for the contract.

    Plain rows (no positions, no documents): SDPA's causal kernel, no mask in memory (flash /
    memory-efficient attention on GPU). Otherwise (packed documents, a context-parallel subset
    of rows) the queries are taken in chunks of `ATTENTION_QUERY_CHUNK` rows, each with its own
    boolean ``[B, chunk, Skv]`` mask built from the indices, exact for any index sets; each
    chunk is recomputed in backward (`torch.utils.checkpoint`), so neither an ``Sq x Skv`` mask
    nor ``Sq x Skv`` scores are ever held: memory grows linearly with the sequence. Grouped-query
    heads are never repeated here (SDPA's ``enable_gqa``).
    """
    if (q_doc is None) != (kv_doc is None):
        raise ValueError("causal_attention: pass both q_doc and kv_doc, or neither")
    if (q_pos is None) != (kv_pos is None):
        raise ValueError("causal_attention: pass both q_pos and kv_pos, or neither")
    if q_pos is None and q_doc is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    if q_pos is None:
        q_pos = kv_pos = torch.arange(q.shape[2], device=q.device).expand(q.shape[0], -1)
    rows = q.shape[2]
    if rows <= ATTENTION_QUERY_CHUNK:
        return _masked_attention(q, k, v, q_pos, kv_pos, q_doc, kv_doc)
    chunks = []
    for start in range(0, rows, ATTENTION_QUERY_CHUNK):
        end = min(start + ATTENTION_QUERY_CHUNK, rows)
        chunks.append(checkpoint(
            _masked_attention, q[:, :, start:end], k, v, q_pos[:, start:end], kv_pos,
            None if q_doc is None else q_doc[:, start:end], kv_doc, use_reentrant=False))
    return torch.cat(chunks, dim=2)


class FlexAttentionCore:
    """An attention core (`AttentionFn`) through torch's FlexAttention for rows with documents or
    global indices (packed documents): one fused kernel over a block mask of the rule of
    `AttentionFn` (``kv_pos <= q_pos`` and, with documents, the same document), whose 128 x 128
    blocks outside every document are skipped, instead of `causal_attention`'s masked SDPA
    chunks, which work through every key of every query. Plain rows go to SDPA's causal kernel
    (flash / cuDNN) as in `causal_attention`. Set it with
    ``decoder.set_attention_fn(FlexAttentionCore())``, or under cp as
    ``ContextParallelAttention(group, inner=FlexAttentionCore())`` (both what
    `ParallelOptions(flex_attention=True)` does).

    On CUDA the kernel is ``torch.compile(flex_attention)`` (FlexAttention is a compiled kernel;
    eager is torch's reference math). The block mask is built once for a set of index tensors and
    reused while the same tensor objects come back (every layer of a forward passes the same
    ones; a few recent sets are kept for pipeline stages that interleave microbatches). The flex
    call runs outside a compiled block (as `packed_attention`): a block mask is no graph input
    dynamo can guard cheaply; plain rows stay in the block's graph. torch's FlexAttention has no
    backward on the CPU: training with it needs CUDA.
    """

    KEEP = 4  # recent index sets whose block masks are kept

    def __init__(self) -> None:
        self._masks: list[tuple[tuple[object, ...], object]] = []
        self._compiled: tuple[Callable, Callable] | None = None  # (flex_attention, create_block_mask) on CUDA

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_pos: torch.Tensor | None,
                 kv_pos: torch.Tensor | None, q_doc: torch.Tensor | None = None,
                 kv_doc: torch.Tensor | None = None) -> torch.Tensor:
        if (q_doc is None) != (kv_doc is None) or (q_pos is None) != (kv_pos is None):
            raise ValueError("FlexAttentionCore: pass both q_doc and kv_doc (q_pos and kv_pos), or neither")
        if q_pos is None and q_doc is None:  # traced with the compiled block, as in causal_attention
            return causal_attention(q, k, v, q_pos=None, kv_pos=None)
        return self._flex(q, k, v, q_pos, kv_pos, q_doc, kv_doc)

    @torch.compiler.disable
    def _flex(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor | None,
              kv_pos: torch.Tensor | None, q_doc: torch.Tensor | None, kv_doc: torch.Tensor | None) -> torch.Tensor:
        kernel, build = self._functions(q.is_cuda)

        def allowed():
            def mask_mod(b, h, qi, ki):
                seen = (ki <= qi) if q_pos is None else (kv_pos[b, ki] <= q_pos[b, qi])
                return seen if q_doc is None else seen & (kv_doc[b, ki] == q_doc[b, qi])
            return mask_mod

        mask = self._block_mask(build, (q_pos, kv_pos, q_doc, kv_doc), allowed, q.shape[0], q.shape[2], k.shape[2],
                                q.device)
        return kernel(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

    @torch.compiler.disable
    def packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               items: PackedItems | Sequence[int]) -> torch.Tensor:
        """`packed_attention`'s contract (items packed along the sequence, each attending to
        itself only) as one FlexAttention kernel over the block-diagonal mask of the items,
        instead of one SDPA call per span of items; the mask is built once per list of lengths
        (every block of an encoder's forward passes the same). One item (or none):
        `packed_attention` (an unmasked SDPA call)."""
        lengths = item_lengths(items, q.shape[2])
        if sum(1 for n in lengths if n) <= 1:
            return packed_attention(q, k, v, items)
        kernel, build = self._functions(q.is_cuda)

        def same_item():
            # on the host, then copied without waiting for the device's queue (no host sync)
            item = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
            item = item.to(q.device, non_blocking=True)
            return lambda b, h, qi, ki: item[ki] == item[qi]

        mask = self._block_mask(build, (lengths,), same_item, q.shape[0], q.shape[2], k.shape[2], q.device)
        return kernel(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

    def _functions(self, cuda: bool) -> tuple[Callable, Callable]:
        """flex_attention and create_block_mask: compiled on CUDA (the fused kernel, and a mask
        built block by block instead of through a ``[B, S, S]`` dense one), torch's eager
        reference elsewhere. Shapes are dynamic after a first recompilation, so length buckets do
        not run into dynamo's recompile limit (past it torch would fall back to eager math)."""
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if not cuda:
            return flex_attention, create_block_mask
        if self._compiled is None:
            self._compiled = torch.compile(flex_attention), torch.compile(create_block_mask)
        return self._compiled

    def _block_mask(self, build: Callable, key: tuple[object, ...], make_mask_mod: Callable[[], Callable], batch: int,
                    rows: int, keys: int, device: torch.device):
        """The block mask of ``make_mask_mod()`` for `key`: tensors compared by identity (the same
        objects, which the cache keeps alive: the same mask), anything else by value."""
        key = (*key, batch, rows, keys, device)
        for known, mask in self._masks:
            if len(known) == len(key) and all(a is b if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor)
                                              else a == b for a, b in zip(known, key)):
                return mask
        mask = build(make_mask_mod(), batch, None, rows, keys, device=device)
        self._masks = [(key, mask), *self._masks[:self.KEEP - 1]]
        return mask

    def __repr__(self) -> str:
        return "FlexAttentionCore()"


def flex_backward_problem(device: torch.device) -> str | None:
    """Why torch's FlexAttention cannot take gradients on `device` (its own message: no backward
    on the CPU or MPS), or None where it can. Asks torch's device check of `flex_attention` on an
    empty query that requires grad (no kernel runs): a training step through it would otherwise
    fail inside the forward, on the ranks of the modules that attend through it only."""
    from torch.nn.attention import flex_attention as flex

    check = getattr(flex, "_validate_device", None)
    if device.type == "cuda" or check is None:
        return None
    q = torch.zeros(1, 1, 0, 8, device=device, requires_grad=True)
    try:
        check(q, q, q)
    except (NotImplementedError, ValueError) as e:
        return str(e)
    return None


# Query rows per chunk of the masked attention path: its transient memory is about
# chunk x Skv (mask and, without a fused kernel, scores per head) whatever the sequence length.
ATTENTION_QUERY_CHUNK = 1024


class PackedItems:
    """The item lengths of a packed sequence (rows per item, in order), as one object for the
    encoder blocks' ``packed`` argument. `packed_attention` runs outside the compiled graph, so a
    compiled block only passes the object on and never reads the lengths: a new mix of item
    sizes does not recompile it (a list of ints would be guarded value by value)."""

    __slots__ = ("lengths",)

    def __init__(self, lengths: Sequence[int]) -> None:
        self.lengths = tuple(int(n) for n in lengths)

    def __repr__(self) -> str:
        return f"PackedItems({list(self.lengths)})"


def pad_empty_packed(x: torch.Tensor, packed: PackedItems | None) -> tuple[torch.Tensor, PackedItems | None, bool]:
    """``(x, packed, empty)`` for the blocks of an encoder: a packed sequence of no rows
    (``x [1, 0, dim]``, a list of no items: a dp rank whose share is empty) gets one zero row, an
    item of its own, which the caller drops after the blocks (``empty``). Under sequence
    parallelism a sequence of length 0 sharded over tp cannot pass the blocks (DTensor refuses to
    view it, in FSDP's hooks), while the other dp ranks wait in the blocks' collectives; the row
    keeps every parameter in the graph (zero gradients), as the empty sequence did."""
    if packed is None or sum(packed.lengths) or x.shape[1]:
        return x, packed, False
    return torch.cat([x, x.new_zeros(x.shape[0], 1, x.shape[2])], dim=1), PackedItems([1]), True


@torch.compiler.disable  # see PackedItems; the spans are planned from Python ints anyway
def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     items: PackedItems | Sequence[int]) -> torch.Tensor:
    """Bidirectional attention over items packed along the sequence (the encoders' core for items
    of different sizes): ``q, k, v [B, H, S, D]`` with ``S = sum(lengths)`` (`items`: the
    lengths, or `PackedItems` of them), item i the rows ``sum(lengths[:i]) .. + lengths[i]``; a
    row attends to every row of its own item and to no other (a block-diagonal mask), scale
    ``1 / sqrt(D)``. Returns ``[B, H, S, D]``.

    The lengths are Python ints (from the items' shapes), so the blocks are planned on the host
    without a device sync: consecutive items are grouped into spans of at most
    `PACKED_SPAN_ROWS` rows (a longer item is a span of its own) and each span is one SDPA call
    over its own rows only — unmasked (the fused kernel) when it holds one item, with the
    document rule of `causal_attention` minus causality (a boolean mask of the span) when it
    holds several small ones, which then share one call. Work is that of the items plus at most
    ``S x PACKED_SPAN_ROWS`` for the shared spans, never ``S x S``, and no item is padded.
    """
    lengths = item_lengths(items, q.shape[2])
    spans = _spans(lengths, PACKED_SPAN_ROWS)
    if not spans:  # no rows: still through q, k and v (every weight of the block gets its zero gradient)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])
    sizes = [sum(span) for span in spans]
    gqa = q.shape[1] != k.shape[1]
    outputs = []
    # split, not slicing: its backward is one concatenation, not a zero-filled full-size gradient per span
    for span, qs, ks, vs in zip(spans, q.split(sizes, dim=2), k.split(sizes, dim=2), v.split(sizes, dim=2)):
        mask = None
        if len(span) > 1:
            # made on the host and copied without waiting for the device's queue (`torch.tensor(...,
            # device=)` copies blocking: a host sync per span, block and microbatch)
            item = torch.tensor([i for i, n in enumerate(span) for _ in range(n)]).to(q.device, non_blocking=True)
            mask = item.unsqueeze(0) == item.unsqueeze(1)  # [span, span]: same item
        outputs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=gqa))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def item_lengths(items: PackedItems | Sequence[int], rows: int) -> tuple[int, ...]:
    """The lengths of packed `items`, checked to cover the `rows` rows of the packed sequence."""
    lengths = items.lengths if isinstance(items, PackedItems) else tuple(items)
    if sum(lengths) != rows or any(n < 0 for n in lengths):
        raise ValueError(f"packed_attention: item lengths {list(lengths)} do not sum to the {rows} rows")
    return lengths


# Rows up to which consecutive small items share one masked SDPA call in `packed_attention`
# (fewer calls) at the price of attention work between them (at most this many keys per row).
PACKED_SPAN_ROWS = 128


def _spans(lengths: Sequence[int], limit: int) -> list[list[int]]:
    """Consecutive items grouped greedily into spans of at most `limit` rows (an item longer than
    `limit` alone): the lengths of each span's items; empty items are skipped."""
    spans: list[list[int]] = []
    rows = 0  # of the last span
    for n in lengths:
        if n and spans and rows + n <= limit:
            spans[-1].append(n)
            rows += n
        elif n:
            spans.append([n])
            rows = n
    return spans


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                      kv_pos: torch.Tensor, q_doc: torch.Tensor | None, kv_doc: torch.Tensor | None) -> torch.Tensor:
    """SDPA of these query rows against every key under the index rule of `AttentionFn`."""
    mask = kv_pos.unsqueeze(1) <= q_pos.unsqueeze(2)  # [B, Sq, Skv]
    if q_doc is not None:
        mask = mask & (kv_doc.unsqueeze(1) == q_doc.unsqueeze(2))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), enable_gqa=q.shape[1] != k.shape[1])


# --------------------------------------------------------------------------------------------
# Deterministic initialisation
# --------------------------------------------------------------------------------------------

# Wrappers that torch.compile and activation checkpointing insert into parameter names; dropped so
# that a wrapped block draws the same values as a plain one.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.")


def _parameter_seed(seed: int, fqn: str) -> int:
    # zlib.crc32 is stable across processes (Python's hash() of a str is not).
    return (seed * 1_000_003 + zlib.crc32(fqn.encode())) % 2**63


# Rows of a parameter are drawn in blocks of about this many elements, each block from its own
# generator, so that a rank fills its shard by drawing only the blocks its rows fall in.
INIT_BLOCK_ELEMENTS = 1 << 20


def init_weights(module: nn.Module, seed: int, std: float = 0.02, same_as: Mapping[str, str] | None = None) -> None:
    """Initialise every parameter of `module` in place, deterministically, from `seed`.

    - weight and bias of a norm layer (RMSNorm, LayerNorm): ones and zeros;
    - any other bias: zeros;
    - every other parameter (Linear, Embedding, Conv weights, position embeddings): normal with
      mean 0 and `std`, drawn in float32 on the CPU, rows in blocks of about
      `INIT_BLOCK_ELEMENTS` elements, block b from a generator seeded by `(seed, name, b)`.

    A parameter's value depends only on `seed` and its name relative to `module`, so a pipeline
    stage that deleted some layers, a tensor- or FSDP-sharded copy, a float64 copy and the whole
    single-process model all start from the same weights, on any device. A DTensor parameter (tp,
    FSDP2, both, built on the meta device and materialized with `to_empty`) gets its own shard
    only, drawing the row blocks its shard touches: no rank ever materializes the full parameter,
    and the work is that of the local rows (full rows: a shard of columns draws its rows whole).
    The blocks are independent, so they are drawn on `init_threads()` threads at once (torch's
    CPU generator draws on one core; a 1B model is seconds of drawing per core). Call it on the
    model the names are relative to (e.g. `vit.init_weights`, not a parent that renames it).
    A parameter registered under several names (tied) is drawn once, under its first name;
    `same_as` draws a parameter as another name's (a copy that must start equal to it).
    """
    norm_types = (RMSNorm, nn.LayerNorm)
    draws, seen = [], set()
    with torch.no_grad():
        for module_name, mod in module.named_modules():
            for param_name, param in mod.named_parameters(recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                if isinstance(mod, norm_types) or param_name == "bias":
                    fill = 1.0 if isinstance(mod, norm_types) and param_name == "weight" else 0.0
                    local_part(param).fill_(fill)
                    continue
                fqn = plain_name(f"{module_name}.{param_name}" if module_name else param_name)
                fqn = (same_as or {}).get(fqn, fqn)
                offset, shape = local_box(param)
                draws += _normal_blocks(_parameter_seed(seed, fqn), tuple(param.shape), offset, shape,
                                        local_part(param), std)
        threads = min(init_threads(), len(draws))
        if threads <= 1:
            for draw in draws:
                draw()
        else:
            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                for done in [pool.submit(draw) for draw in draws]:
                    done.result()


def init_threads() -> int:
    """Threads `init_weights` draws on: this process's share of the host's cores (the cores it
    may run on over the ranks of this host, ``LOCAL_WORLD_SIZE``)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def plain_name(name: str) -> str:
    """A parameter name without the wrappers compile and activation checkpointing insert."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def named_buffers(module: nn.Module, persistent: bool) -> dict[str, torch.Tensor]:
    """The buffers of `module` under their names relative to it (`plain_name`), the persistent ones
    (in its ``state_dict``: a BatchNorm's running statistics) or the others (tables the module
    rebuilds itself, not saved)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, mod in module.named_modules():
        for name, buffer in mod._buffers.items():
            if buffer is not None and (name not in mod._non_persistent_buffers_set) == persistent:
                out.setdefault(plain_name(f"{prefix}.{name}" if prefix else name), buffer)
    return out


def local_part(param: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of `param` (a DTensor's local shard, else `param` itself)."""
    return param.to_local() if isinstance(param, DTensor) else param


def with_local(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` in `like`'s place: a DTensor of `like`'s mesh, placements, shape and stride whose
    local shard is `local` (differentiably, no communication), else `local` itself."""
    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def local_box(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Global offset and shape of the block of `param` this rank holds (all of it if plain)."""
    if not isinstance(param, DTensor):
        return (0,) * param.ndim, tuple(param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if math.prod(shape) != param.to_local().numel():
        raise NotImplementedError(f"cannot locate the local shard {tuple(param.to_local().shape)} "
                                  f"of a {tuple(param.shape)} parameter with placements {param.placements}")
    return tuple(offset), tuple(shape)


def _normal_blocks(seed: int, shape: tuple[int, ...], offset: tuple[int, ...], size: tuple[int, ...],
                   out: torch.Tensor, std: float) -> list[Callable[[], None]]:
    """Calls that together fill `out` (``size``) with `std` times the block ``offset .. offset +
    size`` of the standard normal parameter value of `shape` drawn from `seed`: one call per row
    block the box touches, each drawing its block and keeping only its part (memory: one row
    block per thread). Block 0 uses `seed` itself, so a parameter of at most one block equals
    ``std * torch.randn(shape, generator=manual_seed(seed))``."""
    if not shape:
        return [torch.no_grad()(lambda: out.copy_(torch.randn((), generator=torch.Generator().manual_seed(seed)) * std))]
    rows, row_size = shape[0], math.prod(shape[1:])
    per_block = max(1, INIT_BLOCK_ELEMENTS // max(row_size, 1))
    first, last = offset[0], offset[0] + size[0]
    columns = tuple(slice(o, o + n) for o, n in zip(offset[1:], size[1:]))

    @torch.no_grad()  # grad mode is per thread: a pool's threads start with grad on
    def draw(block: int) -> None:
        lo = block * per_block
        n = min(per_block, rows - lo)
        block_seed = seed if block == 0 else (seed * 1_000_003 + block) % 2**63
        drawn = torch.randn((n, *shape[1:]), generator=torch.Generator().manual_seed(block_seed))
        start, stop = max(first - lo, 0), min(last - lo, n)
        out[lo + start - first:lo + stop - first].copy_(drawn[(slice(start, stop), *columns)].mul_(std))

    return [functools.partial(draw, block) for block in range(first // per_block, -(-last // per_block))]
