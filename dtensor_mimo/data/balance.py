"""Which items each of an encoder's dp ranks encodes: by sample (the data layer's rule) or balanced.

By sample, encoder dp rank k encodes the items of the samples that every module's dp rank k
holds (`sample_range`). When items differ in size (images at their own resolution, clips at
their own length) or samples carry different numbers of items, those shares differ in cost, and
the slowest encoder rank sets the pace of the step. Balanced, the modality's items, in batch
order, are cut into dp contiguous runs of about equal cost; the bridge's plan takes the new
owners directly (`MeshSpec.shard_bounds`: a ragged split of the rows, not of the samples), so
the rows still cross in one hop and land where the language model's dp ranks expect them.
Every rank derives the cuts from the batch metadata alone (pure, no message), and the same cuts
on every rank are what keep the plan's two sides in agreement.

The cost of an item of ``t`` tokens through a transformer of width ``w`` (MLP ``4w``): per layer
and token, the linear layers take ``12 w^2`` multiply-adds (q, k, v and the output ``4 w^2``, the
MLP ``8 w^2``) and attention ``2 t w`` (scores and values), so the item costs ``t (6 w + t)`` up
to a constant factor (`item_cost`): tokens for small items, tokens squared once ``t`` nears
``6 w``. Measured (`benchmarks/balance.py`, a ViT of width 384 on a CPU), the cost model's
max/mean over the parts of a batch is within 0.13 of the measured encoder times'.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate
from typing import Sequence

import numpy as np

from dtensor_mimo.data.batch import BatchError, MimoBatch, ModalityInputs, microbatches, sample_range

__all__ = ["SampleCuts", "balanced_cuts", "encoder_cuts", "item_cost", "item_cuts", "max_over_mean",
           "microbatch_cuts", "row_bounds", "sample_cuts"]


def item_cost(tokens: int, width: int | None) -> int:
    """Relative cost of encoding an item of `tokens` tokens with a transformer of `width`
    (None: unknown, the cost is the token count)."""
    return tokens if width is None else tokens * (6 * width + tokens)


def balanced_cuts(costs: Sequence[int], parts: int) -> tuple[int, ...]:
    """Cut items with `costs` (in order) into `parts` contiguous runs: ``parts + 1`` item indices
    from 0 to ``len(costs)``. The largest run costs the least any contiguous split allows (the
    slowest rank sets the step's pace); within that bound, each cut in turn, given the ones
    before it, sits as near as it can to the item boundary whose cost prefix is ``k / parts`` of
    the total, which keeps the other runs near even (not always the most even: a large item can
    leave a run short or empty). O(n log n log total + parts) for n items (a part costs a lookup:
    encoders may have thousands of dp ranks); exact integers."""
    if parts < 1:
        raise BatchError(f"cannot split items into {parts} parts; need at least 1")
    prefix = [0, *accumulate(costs)]
    n, total = len(costs), prefix[-1]
    bound = _least_largest_run(prefix, parts)
    # Every item boundary's answers at once (numpy; Python ints where int64 could overflow), so
    # that the loops over the parts below are a lookup a part: `parts` may be thousands.
    p = np.array(prefix, dtype=np.int64 if (total + bound) * parts < 1 << 62 else object)
    fit = np.searchsorted(p, p - bound, side="left").tolist()  # the earliest start of a run ending here
    last = (np.searchsorted(p, p + bound, side="right") - 1).tolist()  # the latest end of a run from here
    # first[j]: the first item from which the rest fits in j runs of at most `bound` (packed
    # greedily from the end); a cut k must leave the rest a fit in parts - k runs.
    first = [n] * (parts + 1)
    for j in range(1, parts + 1):
        first[j] = fit[first[j - 1]]
        if first[j] == 0:  # and so every later one
            first[j:] = [0] * (parts + 1 - j)
            break
    # The item boundary whose cost prefix is nearest k / parts of the total (compared as prefix
    # * parts against total * k: no rounding), the earlier one on a tie.
    scaled, targets = p * parts, total * np.arange(1, parts, dtype=p.dtype)
    i = np.searchsorted(scaled, targets, side="left")
    below, at = np.clip(i - 1, 0, n), np.clip(i, 0, n)
    near = (i - ((i > 0) & ((i > n) | (targets - scaled[below] <= scaled[at] - targets)))).tolist()
    cuts = [0]
    for k in range(1, parts):
        c = cuts[-1]
        cuts.append(min(max(near[k - 1], first[parts - k], c), last[c]))  # this run within the bound
    return (*cuts, n)


def _least_largest_run(prefix: Sequence[int], parts: int) -> int:
    """The least cost bound that `parts` contiguous runs of the items (cost `prefix` sums) can
    keep to: a binary search over the bound, each checked by packing runs greedily."""
    def fits(bound: int) -> bool:
        start, runs = 0, 0
        while start < len(prefix) - 1:
            end = bisect_right(prefix, prefix[start] + bound) - 1
            if end == start:  # one item over the bound
                return False
            start, runs = end, runs + 1
            if runs > parts:
                return False
        return True

    lo = max((b - a for a, b in zip(prefix, prefix[1:])), default=0)
    hi = prefix[-1]
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


class SampleCuts(Sequence[int]):
    """`sample_cuts`: ``parts + 1`` item indices, each computed when it is read (O(1)), so that
    a rank reading its own two cuts each step does no work per encoder dp rank (thousands at
    cluster scale); equal to the tuple of them."""

    def __init__(self, items_per_sample: Sequence[int], parts: int) -> None:
        sample_range(len(items_per_sample), parts, 0)  # the rule's own checks
        self._offsets = [0, *accumulate(items_per_sample)]
        self._parts = parts

    def __len__(self) -> int:
        return self._parts + 1

    def __getitem__(self, k):  # an int, or a slice (a tuple)
        if isinstance(k, slice):
            return tuple(self[i] for i in range(*k.indices(len(self))))
        if not -len(self) <= k < len(self):
            raise IndexError(f"cut {k} of {len(self)}")
        k %= len(self)
        samples = len(self._offsets) - 1
        return self._offsets[samples if k == self._parts else sample_range(samples, self._parts, k).start]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))


def sample_cuts(items_per_sample: Sequence[int], parts: int) -> SampleCuts:
    """The data layer's rule in item indices: part k holds the items of its samples
    (`sample_range`); ``parts + 1`` cuts from 0 to the item count, each computed when read."""
    return SampleCuts(items_per_sample, parts)


def item_cuts(m: ModalityInputs, parts: int, balance: bool, width: int | None = None) -> Sequence[int]:
    """Item indices where each of `parts` encoder dp ranks starts, then the item count:
    `balanced_cuts` of the items' `item_cost` when `balance`, else `sample_cuts`."""
    if not balance:
        return sample_cuts(m.items_per_sample, parts)
    return balanced_cuts([item_cost(t, width) for t in m.item_tokens], parts)


def row_bounds(m: ModalityInputs, cuts: Sequence[int]) -> tuple[int, ...]:
    """The encoder output rows where each part of `cuts` starts, then the row count: the
    bridge's ``shard_bounds``."""
    prefix = [0, *accumulate(m.item_tokens)]
    return tuple(prefix[c] for c in cuts)


def encoder_cuts(m: ModalityInputs, parts: int, balance: bool | None,
                 width: int | None = None) -> tuple[Sequence[int], tuple[int, ...] | None]:
    """Where each of an encoder's `parts` dp ranks starts in `m`'s items, and (balanced only) in
    its rows: ``(item cuts, row bounds or None)``. Balanced by cost when `balance` (an encoder's
    `ParallelOptions.balance`; None: when the items differ in size), the row bounds then being
    the bridge's ``shard_bounds``; else by sample (None: the bridge's own sample split)."""
    balanced = m.varied if balance is None else balance
    cuts = item_cuts(m, parts, balanced, width)
    return cuts, (row_bounds(m, cuts) if balanced else None)


def max_over_mean(m: ModalityInputs, cuts: Sequence[int], width: int | None = None) -> float | None:
    """The costliest part of `cuts` over the mean part (`item_cost` sums): how long the slowest
    encoder dp rank works against the average, 1.0 when even; None when `m` costs nothing."""
    costs = [item_cost(t, width) for t in m.item_tokens]
    prefix = [0, *accumulate(costs)]
    parts = len(cuts) - 1
    if prefix[-1] == 0:
        return None
    return max(prefix[b] - prefix[a] for a, b in zip(cuts, cuts[1:])) * parts / prefix[-1]


CutRule = tuple[str, int, "bool | None", "int | None"]
"""An encoder's cut rule: ``(name, dp, balance, width)`` (`encoder_cuts`' arguments)."""


def microbatch_cuts(batch: MimoBatch, count: int, rules: Sequence[CutRule]
                    ) -> list[dict[str, tuple[Sequence[int], tuple[int, ...] | None]]]:
    """Per microbatch of `batch` cut in `count`, the `encoder_cuts` of each encoder of `rules`
    whose modality the batch has (which items each of its dp ranks encodes). Pure, from the
    batch metadata alone; once per batch, count and rules (`MimoBatch.memo`, which pickles with
    the batch), so that a loader thread or process can derive it ahead of the step: the
    balanced rule's work grows with the encoder's dp size."""
    rules = tuple(r for r in rules if r[0] in batch.modalities)

    def derive() -> list[dict[str, tuple[Sequence[int], tuple[int, ...] | None]]]:
        mbs = microbatches(batch, count) if count > 1 else [batch]
        return [{n: encoder_cuts(mb.modalities[n], dp, balance, width) for n, dp, balance, width in rules}
                for mb in mbs]

    return batch.memo(("encoder cuts", count, rules), derive)
