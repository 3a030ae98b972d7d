"""Fingerprints of state that every rank must hold alike (pure: no process group here).

A layout, the modules' options and the pipeline config must be the same on every rank at
construction, and the global batch's metadata and the set of trainable parameters the same at
every step; a rank that differs otherwise hangs its peers in an exchange or silently trains on
other data. Each rank reduces such state to a small integer, and the ranks compare integers inside
a collective they already make:

- at construction, an all-gather of each part's fingerprint, then — only when they differ, which
  every rank then knows — of each part's `summary` (`disagreement` names the ranks that differ
  and shows what each has; `dtensor_mimo.layout.mesh.check_agreement` runs both);
- at a step, two more float64 terms of a SUM all-reduce the step already makes:
  ``agreement_terms(fp, n)`` = (fp, fp²) of the fingerprint's low `step_bits` (n) bits; every rank
  agrees iff the sums are (n·fp, n·fp²) for its own fp (`agreed`). The variance of the ranks'
  fingerprints is zero exactly then. Every partial sum of n such terms, in any order a reduction
  takes (a ring adds them one by one), is an integer below 2**53, so exact in float64: `STEP_BITS`
  bits up to 8,192 ranks, one bit fewer for each doubling beyond (16 bits at 2**21 ranks).
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from typing import Any, Iterable, Mapping, Sequence

STEP_BITS = 20
"""Bits of a per-step fingerprint; the ranks compare the low `step_bits` of them."""


def _canonical(value: Any) -> Any:
    """A JSON-able form that is the same in every process (no ids, no hash seeds)."""
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a tensor: its dtype, shape and bytes
        array = value.detach().cpu().contiguous().numpy()
        return ["tensor", str(array.dtype), list(array.shape), zlib.crc32(array)]  # its buffer: no copy
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_canonical(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)  # dataclasses (layouts, options, configs) print their fields


def fingerprint(*values: Any, bits: int = 32) -> int:
    """A `bits`-bit integer of `values` (tensors by content; dicts by sorted key), equal in every
    process for equal values."""
    text = json.dumps([_canonical(v) for v in values], sort_keys=True, separators=(",", ":"))
    return zlib.crc32(text.encode()) & ((1 << bits) - 1)


def summary(value: Any, limit: int | None = 300) -> str:
    """A short text of `value` for an error message: a dataclass shows only its fields that
    differ from their defaults (``ParallelOptions(sp=True)``); a mapping, its entries so shown.
    At most `limit` characters (None: the whole text, for `excerpt`)."""
    if isinstance(value, Mapping):
        text = "{" + ", ".join(f"{k}: {summary(v, limit)}" for k, v in value.items()) + "}"
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = [f"{f.name}={getattr(value, f.name)!r}" for f in dataclasses.fields(value)
                   if f.repr and getattr(value, f.name) != _default(f)]
        text = f"{type(value).__name__}({', '.join(changed)})"
    else:
        text = repr(value)
    return text if limit is None or len(text) <= limit else text[:limit - 3] + "..."


def common_prefix(a: str, b: str) -> int:
    """How many leading characters `a` and `b` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def excerpt(text: str, at: int, limit: int = 300) -> str:
    """At most about `limit` characters of `text` around position `at` (where it first differs from
    another rank's): the whole of a short text, else from a little before `at`, elisions marked."""
    if len(text) <= limit:
        return text
    start = max(0, min(at - limit // 3, len(text) - limit))
    end = start + limit
    return ("..." if start else "") + text[start:end] + ("..." if end < len(text) else "")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING  # required: always shown


def batch_fingerprint(tokens: Any, items: Mapping[str, tuple[Sequence[int], Sequence[int]]]) -> int:
    """The step fingerprint of a global batch's metadata: its token ids (a tensor, or a tuple of
    the per-token tensors) and, per modality, the items per sample and the tokens per item (what
    every rank derives its exchange sizes from)."""
    return fingerprint(tokens, {k: [list(a), list(b)] for k, (a, b) in items.items()}, bits=STEP_BITS)


def trainable_fingerprint(names: Iterable[tuple[str, bool]]) -> int:
    """The step fingerprint of which parameters train: ``(module.param name, requires_grad)`` pairs
    of every module (every rank lists all modules' names, not only its own shards)."""
    return fingerprint(sorted(names), bits=STEP_BITS)


def step_bits(world: int) -> int:
    """How many low bits of a step fingerprint `world` ranks compare: the most (up to
    `STEP_BITS`) whose squares, summed over `world` ranks, stay below 2**53 (exact in float64)."""
    return min(STEP_BITS, (53 - (world - 1).bit_length()) // 2)


def agreement_terms(fp: int, world: int) -> tuple[float, float]:
    """This rank's two terms for a SUM all-reduce over `world` ranks: (fp, fp²) of `fp`'s low
    `step_bits`."""
    fp &= (1 << step_bits(world)) - 1
    return float(fp), float(fp) * float(fp)


def agreed_sums(fp: int, world: int) -> tuple[float, float]:
    """The all-reduced sums of `agreement_terms` when every one of `world` ranks had `fp`."""
    one, square = agreement_terms(fp, world)
    return world * one, world * square


def agreed(fp: int, sum_fp: float, sum_sq: float, world: int) -> bool:
    """Whether every one of `world` ranks had `fp`, from the all-reduced sums of `agreement_terms`."""
    return (sum_fp, sum_sq) == agreed_sums(fp, world)


def disagreement(per_rank: Sequence[tuple[int, str]], what: str) -> str | None:
    """An error message naming the ranks whose ``(fingerprint, summary)`` differs from rank 0's and
    what each holds, or None when all agree. The same message on every rank."""
    first, summary = per_rank[0]
    others = [r for r, (fp, _) in enumerate(per_rank) if fp != first]
    if not others:
        return None
    shown = "; ".join(f"rank {r}: {per_rank[r][1]}" for r in others[:4])
    more = f" (+{len(others) - 4} more ranks)" if len(others) > 4 else ""
    return (f"the {what} differs between ranks: rank 0: {summary}; {shown}{more}. Every rank must build the "
            f"same {what} (the same config file and arguments on every rank)")
