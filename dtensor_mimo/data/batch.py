"""The data layer: a global MIMO batch, its dp shards and microbatches, and a synthetic generator.

A `MimoBatch` is one GLOBAL batch: every rank of every module builds (or loads) the same one.
A module's dp rank k takes ``shard(batch, dp_size, k)``: the samples
``torch.tensor_split(range(B), dp_size)[k]`` (uneven allowed: 5 samples over dp 3 -> 2, 2, 1),
with each modality's items cut to exactly the items of those samples. Since every module cuts
the same global batch with the same rule, encoder dp rank k and language dp rank j hold the
samples that the bridge planner (`dtensor_mimo.bridge.plan`, ``sample_sizes`` given) says they
hold: the alignment is true by construction, not a convention between two data loaders.

Per modality the batch carries the encoder inputs of all items in sample order (one tensor, or one
tensor per item when items differ in size: images at their own resolution, clips at their own
length) and two pieces of metadata, ``items_per_sample`` and ``tokens_per_item`` (one count, or
one per item). Their per-sample sums, `MimoBatch.tokens_per_sample(name)`, are the row counts of
the flattened encoder output ``[sum tokens, H]`` (samples contiguous, in sample order): the
ragged sizes the bridge moves, known on every rank without a shape message. The batch checks on construction that its token
ids carry exactly that many special tokens per row, so bridge sizes and the later assembly
(`dtensor_mimo.assemble`) can never disagree.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Any, Callable, Hashable, Mapping, Sequence

import torch

from dtensor_mimo.layout.fingerprint import batch_fingerprint

if TYPE_CHECKING:  # annotations only: the data layer reads these configs' fields, never imports models
    from dtensor_mimo.models.audio import AudioConfig
    from dtensor_mimo.models.vit import ViTConfig

__all__ = [
    "IGNORE_INDEX",
    "BatchError",
    "MimoBatch",
    "ModalityInputs",
    "ModalitySpec",
    "SyntheticSpec",
    "microbatches",
    "sample_range",
    "shard",
    "special_id_clash",
    "synthetic_batch",
]

IGNORE_INDEX = -100
"""Label of a position with no text target (torch's `cross_entropy` default ``ignore_index``)."""


class BatchError(ValueError):
    """A batch whose parts disagree: the message names the field, the modality and the numbers."""


def sample_range(num_samples: int, num_parts: int, index: int) -> range:
    """Samples of part `index` when `num_samples` are split in `num_parts`.

    The rule of ``torch.tensor_split(range(num_samples), num_parts)[index]``: the first
    ``num_samples % num_parts`` parts take one sample more. Parts may be empty.
    """
    if num_parts < 1:
        raise BatchError(f"cannot split a batch into {num_parts} parts; need at least 1")
    if not 0 <= index < num_parts:
        raise BatchError(f"part index {index} is outside 0..{num_parts - 1} ({num_parts} parts)")
    base, extra = divmod(num_samples, num_parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


def special_id_clash(special_token_ids: Mapping[str, int]) -> str | None:
    """The error message when two modalities share a special token id, else None."""
    owner: dict[int, str] = {}
    for name, token_id in special_token_ids.items():
        if token_id in owner:
            return (f"modalities {owner[token_id]!r} and {name!r} share special token id {token_id}; "
                    f"each modality needs its own id")
        owner[token_id] = name
    return None


# ---------------------------------------------------------------------------- the batch


@dataclass(frozen=True, eq=False)  # tensors: compare fields explicitly
class ModalityInputs:
    """One modality's part of a batch.

    Attributes:
        inputs: encoder inputs of all items, samples in order and each sample's items in order:
            one tensor when every item has the same size (images ``[N, C, H, W]``, spectrograms
            ``[N, n_mels, T]``), or a list of ``N`` tensors, one per item, when they differ
            (images ``[C, H_i, W_i]`` at their own resolution, clips ``[n_mels, T_i]`` at their
            own length). ``N = sum(items_per_sample)``.
        items_per_sample: items (images, clips) of each sample; 0 for a sample without any.
        tokens_per_item: encoder output tokens per item: one int for every item (ViT:
            ``num_patches``; audio: ``AudioConfig.output_length(T)``), or one count per item
            (``ViTConfig.tokens_for(shape)`` of each image); also the special tokens of each item
            in the token row.
        special_token_id: the token id that marks this modality's positions in ``tokens``.
    """

    inputs: torch.Tensor | list[torch.Tensor]
    items_per_sample: tuple[int, ...]
    tokens_per_item: int | tuple[int, ...]
    special_token_id: int

    def __post_init__(self) -> None:
        counts = tuple(self.items_per_sample)
        per_item = not _is_int(self.tokens_per_item)
        try:
            tokens = tuple(self.tokens_per_item) if per_item else (self.tokens_per_item,)
        except TypeError:
            tokens = (self.tokens_per_item,)
        if not all(_is_int(n) for n in [*counts, *tokens]):
            raise BatchError(
                f"items_per_sample {list(counts)} and tokens_per_item {self.tokens_per_item!r} must "
                f"be integers (tokens_per_item: one int, or one int per item)"
            )
        object.__setattr__(self, "items_per_sample", tuple(int(n) for n in counts))
        object.__setattr__(self, "tokens_per_item", tuple(int(n) for n in tokens) if per_item else int(tokens[0]))
        if isinstance(self.inputs, tuple):
            object.__setattr__(self, "inputs", list(self.inputs))

    @property
    def num_items(self) -> int:
        return sum(self.items_per_sample)

    @property
    def varied(self) -> bool:
        """Items may differ in size: `inputs` is a per-item list or `tokens_per_item` per item."""
        return isinstance(self.inputs, list) or isinstance(self.tokens_per_item, tuple)

    @property
    def item_tokens(self) -> tuple[int, ...]:
        """Encoder output tokens of each item, in order."""
        t = self.tokens_per_item
        return t if isinstance(t, tuple) else (t,) * self.num_items

    def item_shapes(self) -> list[tuple[int, ...]]:
        """The shape of each item's input, in order."""
        if isinstance(self.inputs, list):
            return [tuple(x.shape) for x in self.inputs]
        return [tuple(self.inputs.shape[1:])] * self.num_items

    def tokens_per_sample(self) -> list[int]:
        """Special tokens (= encoder output rows) of each sample."""
        t = self.tokens_per_item
        if not isinstance(t, tuple):
            return [n * t for n in self.items_per_sample]
        offsets = [0, *accumulate(self.items_per_sample)]
        return [sum(t[a:b]) for a, b in zip(offsets, offsets[1:])]

    def item_kinds(self) -> set[tuple[tuple[int, ...], int]]:
        """The distinct ``(input shape, tokens)`` pairs of the items (what a per-item check needs)."""
        return set(zip(self.item_shapes(), self.item_tokens))

    def select_items(self, items: range) -> ModalityInputs:
        """The contiguous `items` (a range over this modality's items, in order) as the items of
        one sample: an encoder rank's share when items are balanced over ranks (`data.balance`)."""
        t = self.tokens_per_item
        return dataclasses.replace(self, inputs=self.inputs[items.start : items.stop], items_per_sample=(len(items),),
                                   tokens_per_item=t[items.start : items.stop] if isinstance(t, tuple) else t)

    def select_samples(self, samples: range) -> ModalityInputs:
        """The items of the contiguous `samples`, in order."""
        offsets = [0, *accumulate(self.items_per_sample)]
        first, last = offsets[samples.start], offsets[samples.stop]
        t = self.tokens_per_item
        return dataclasses.replace(
            self,
            inputs=self.inputs[first:last],
            items_per_sample=self.items_per_sample[samples.start : samples.stop],
            tokens_per_item=t[first:last] if isinstance(t, tuple) else t,
        )

    def to(self, device: torch.device | str) -> ModalityInputs:
        """These inputs on `device` (non-blocking from host memory, see `MimoBatch.to`)."""
        def move(x: torch.Tensor) -> torch.Tensor:
            return x.to(device, non_blocking=x.is_cpu)
        inputs = [move(x) for x in self.inputs] if isinstance(self.inputs, list) else move(self.inputs)
        return dataclasses.replace(self, inputs=inputs)

    def pin_memory(self) -> ModalityInputs:
        """These inputs in pinned host memory (see `MimoBatch.pin_memory`)."""
        inputs = [_pinned(x) for x in self.inputs] if isinstance(self.inputs, list) else _pinned(self.inputs)
        return dataclasses.replace(self, inputs=inputs)


def _pinned(x: torch.Tensor) -> torch.Tensor:
    """`x` in pinned host memory; a stand-in (zeros expanded from one element: the items a rank does
    not load) as it is: pinning copies into a storage of the tensor's own strides, which ``copy_``
    refuses where elements share memory (a stride 0 over more than one), and it holds no memory."""
    if any(stride == 0 and size > 1 for size, stride in zip(x.shape, x.stride())):
        return x
    return x.pin_memory()


def _is_int(n: object) -> bool:
    """A count: a Python or NumPy integer (`numbers.Integral`, not a bool), or a 0-dim integer tensor."""
    return (isinstance(n, numbers.Integral) and not isinstance(n, bool)) or (
        torch.is_tensor(n) and n.dim() == 0 and not n.is_floating_point())


@dataclass(frozen=True, eq=False)  # tensors: compare fields explicitly
class MimoBatch:
    """A batch of `B` token rows of length `S` and the encoder inputs of their modality items.

    Attributes:
        tokens: ``[B, S]`` int64 token ids; a modality's positions hold its ``special_token_id``
            (which may lie outside the text vocabulary), the item's ``tokens_per_item`` contiguous
            ids per item.
        labels: ``[B, S]`` int64 next-token targets; `IGNORE_INDEX` where there is none.
        loss_mask: ``[B, S]`` float or bool; which positions count in the loss.
        modalities: ``{name: ModalityInputs}``, e.g. ``"vision"``, ``"audio"``.
        document_ids: ``[B, S]`` int64 document of each token of a packed row, or None.
        positions: ``[B, S]`` int64 rotary positions (restarting per document), or None.

    Construction checks shapes, dtypes and that row b holds exactly as many tokens of each
    modality's special id as its items' ``tokens_per_item`` add up to.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    modalities: Mapping[str, ModalityInputs] = field(default_factory=dict)
    document_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "modalities", dict(self.modalities))
        self._validate()

    # -------------------------------------------------------------- queries
    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    @property
    def special_token_ids(self) -> dict[str, int]:
        """``{modality: special token id}``, as `dtensor_mimo.assemble.assemble` takes it."""
        return {name: m.special_token_id for name, m in self.modalities.items()}

    def tokens_per_sample(self, modality: str) -> list[int]:
        """Per-sample token counts of `modality`: the ragged sizes of its encoder output rows."""
        return self._modality(modality).tokens_per_sample()

    def num_tokens(self, modality: str) -> int:
        """Rows of the flattened encoder output of `modality` for this batch."""
        return sum(self.tokens_per_sample(modality))

    def select_samples(self, samples: range) -> MimoBatch:
        """The contiguous `samples` (a ``range`` with step 1) as a batch of their own."""
        if samples.step != 1 or not 0 <= samples.start <= samples.stop <= self.batch_size:
            raise BatchError(
                f"select_samples needs a contiguous range inside 0..{self.batch_size}, "
                f"got {samples}"
            )
        rows = slice(samples.start, samples.stop)
        return self._derive(
            lambda t: t[rows], {n: m.select_samples(samples) for n, m in self.modalities.items()}
        )

    def to(self, device: torch.device | str, *, encoder_inputs: bool = True) -> MimoBatch:
        """The batch with every tensor on `device`. A copy from host memory is non-blocking: the
        host queues it behind the accelerator's work instead of waiting for that work (a sync);
        the source is staged (or, pinned, kept alive) by torch, so it may be dropped at once.
        ``encoder_inputs=False``: the modalities' inputs stay where they are (the language model
        reads only their metadata, so its ranks copy no pixels or audio frames)."""
        non_blocking = self.tokens.is_cpu
        modalities = {n: m.to(device) for n, m in self.modalities.items()} if encoder_inputs else self.modalities
        return self._derive(lambda t: t.to(device, non_blocking=non_blocking), modalities)

    def pin_memory(self) -> MimoBatch:
        """The batch in pinned (page-locked) host memory, so that `to` a GPU copies it
        asynchronously, overlapping the work already queued (a loader's ``pin_memory=True`` calls
        this). Needs an accelerator. Stand-ins for items another rank loads (zeros expanded from one
        element) stay as they are. What `memo` holds carries over (the same values)."""
        pinned = self._derive(_pinned, {n: m.pin_memory() for n, m in self.modalities.items()})
        if self._memo_current():
            pinned.__dict__["_memo"] = dict(self.__dict__["_memo"])
            pinned.__dict__["_memo_versions"] = pinned._versions()
        return pinned

    def memo(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """`compute()` the first time `key` is asked of this batch, its result after: what a step
        derives from the whole global batch (its fingerprint, its loss weight, the encoders' item
        cuts: host work that grows with the batch) is computed once, and before the step where a
        loader thread prepares batches (the trainer's prefetch, `MimoModel.prepare`). `key` names
        the result and everything besides the batch it depends on. A changed batch is a new one
        (``dataclasses.replace``), which computes anew; a per-token tensor written in place (a
        loop that refills its batch's tensors) makes everything computed before it void (their
        version counters moved), so what a step reads is always the batch's current content."""
        memo = self.__dict__.setdefault("_memo", {})
        versions = self._versions()
        if self.__dict__.get("_memo_versions", versions) != versions:
            memo.clear()
        self.__dict__["_memo_versions"] = versions
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    def _versions(self) -> tuple[int, ...] | None:
        """The version counters of the per-token tensors (they move with every in-place write), or
        None for inference tensors, which keep none (taken as unchanged)."""
        try:
            return tuple(t._version for t in (self.tokens, self.labels, self.loss_mask, self.document_ids,
                                               self.positions) if t is not None)
        except RuntimeError:
            return None

    def _memo_current(self) -> bool:
        """Whether `memo` holds results for the per-token tensors as they are now."""
        return "_memo" in self.__dict__ and self.__dict__.get("_memo_versions") == self._versions()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a loader process hands its batch over) with what `memo` holds while current: the
        tensors come back with counters of their own (`__setstate__`)."""
        state = {k: v for k, v in self.__dict__.items() if k != "_memo_versions"}
        if "_memo" in state and not self._memo_current():
            del state["_memo"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if "_memo" in state:
            self.__dict__["_memo_versions"] = self._versions()

    def _derive(self, per_token, modalities: dict[str, ModalityInputs]) -> MimoBatch:
        """A batch of `per_token` applied to every [B, S] field, and `modalities`.

        Not re-validated: slices and copies of a valid batch are valid, and counting special
        tokens again would cost a device sync per shard or microbatch.
        """
        derived = object.__new__(MimoBatch)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "modalities":
                value = modalities
            elif value is not None:
                value = per_token(value)
            object.__setattr__(derived, f.name, value)
        return derived

    # -------------------------------------------------------------- validation
    def _modality(self, name: str) -> ModalityInputs:
        try:
            return self.modalities[name]
        except KeyError:
            raise KeyError(
                f"the batch has no modality {name!r}; its modalities are {list(self.modalities)}"
            ) from None

    def _validate(self) -> None:
        if self.tokens.dim() != 2 or self.tokens.dtype != torch.int64:
            raise BatchError(
                f"tokens must be [B, S] int64, got {list(self.tokens.shape)} {self.tokens.dtype}"
            )
        shape = tuple(self.tokens.shape)
        for name in ("labels", "document_ids", "positions"):
            t = getattr(self, name)
            if t is not None and t.dtype != torch.int64:
                raise BatchError(f"{name} must be int64 like tokens, got {t.dtype}")
        for name in ("labels", "loss_mask", "document_ids", "positions"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape:
                raise BatchError(
                    f"{name} has shape {list(t.shape)} but tokens have {list(shape)}; "
                    f"every per-token field is [B, S]"
                )
        if not (self.loss_mask.dtype == torch.bool or self.loss_mask.is_floating_point()):
            raise BatchError(f"loss_mask must be float or bool, got {self.loss_mask.dtype}")
        b = shape[0]
        clash = special_id_clash(self.special_token_ids)
        if clash:
            raise BatchError(clash)
        for name, m in self.modalities.items():
            if len(m.items_per_sample) != b:
                raise BatchError(
                    f"{name!r}: items_per_sample has {len(m.items_per_sample)} entries for a "
                    f"batch of {b} samples"
                )
            if any(n < 0 for n in m.items_per_sample) or any(t < 0 for t in m.item_tokens[:m.num_items]):
                raise BatchError(
                    f"{name!r}: items_per_sample {list(m.items_per_sample)} and tokens_per_item "
                    f"{_shown(m.tokens_per_item)} must be >= 0"
                )
            if isinstance(m.tokens_per_item, tuple) and len(m.tokens_per_item) != m.num_items:
                raise BatchError(
                    f"{name!r}: tokens_per_item has {len(m.tokens_per_item)} counts but "
                    f"items_per_sample {list(m.items_per_sample)} sum to {m.num_items} items; give one "
                    f"count per item (or one int for all)"
                )
            if isinstance(m.inputs, list):
                if len(m.inputs) != m.num_items:
                    raise BatchError(
                        f"{name!r}: items_per_sample {list(m.items_per_sample)} sum to {m.num_items} items "
                        f"but inputs is a list of {len(m.inputs)} tensors; give one tensor per item"
                    )
                dims = {x.dim() for x in m.inputs if torch.is_tensor(x)}
                if not all(torch.is_tensor(x) for x in m.inputs) or len(dims) > 1:
                    raise BatchError(
                        f"{name!r}: a list of inputs holds one tensor per item, all with the same number "
                        f"of dims (images [C, H_i, W_i], clips [n_mels, T_i]); got "
                        f"{[list(x.shape) if torch.is_tensor(x) else type(x).__name__ for x in m.inputs[:4]]}"
                    )
            elif m.inputs.dim() < 1 or m.inputs.shape[0] != m.num_items:
                raise BatchError(
                    f"{name!r}: items_per_sample {list(m.items_per_sample)} sum to "
                    f"{m.num_items} items but inputs have shape {list(m.inputs.shape)}; "
                    f"inputs hold every item of the batch, samples in order"
                )
        if not self.modalities:
            return
        # One device->host copy for all modalities.
        ids = torch.tensor([m.special_token_id for m in self.modalities.values()],
                           device=self.tokens.device)
        counts = (self.tokens.unsqueeze(-1) == ids).sum(dim=1).T.tolist()  # [modality][sample]
        for (name, m), found in zip(self.modalities.items(), counts):
            for sample, (have, want) in enumerate(zip(found, m.tokens_per_sample())):
                if have != want:
                    per = (f"x tokens_per_item={m.tokens_per_item}" if not isinstance(m.tokens_per_item, tuple)
                           else "with their tokens_per_item")
                    raise BatchError(
                        f"sample {sample} has {have} {name!r} tokens (id {m.special_token_id}) "
                        f"but items_per_sample[{sample}]={m.items_per_sample[sample]} {per} = {want}"
                    )


def _shown(tokens: int | tuple[int, ...]) -> str:
    return str(tokens) if not isinstance(tokens, tuple) or len(tokens) <= 8 else f"{list(tokens[:8])} ..."


def shard(batch: MimoBatch, dp_size: int, dp_rank: int) -> MimoBatch:
    """Data-parallel rank `dp_rank`'s samples of the global `batch` (see `sample_range`)."""
    return batch.select_samples(sample_range(batch.batch_size, dp_size, dp_rank))


def stand_in_sample(batch: MimoBatch) -> MimoBatch:
    """One sample standing in for a dp shard of `batch` that holds none, where a module cannot run
    on an empty batch: `batch`'s first row with no item (its modality positions made a text id no
    modality uses), no label and no loss weight, so it adds nothing to any loss or gradient."""
    one = batch.select_samples(range(1))
    special = set(batch.special_token_ids.values())
    text = next(i for i in range(len(special) + 1) if i not in special)
    tokens = one.tokens.clone()
    for token_id in special:
        tokens[tokens == token_id] = text
    return MimoBatch(tokens, torch.full_like(one.labels, IGNORE_INDEX), torch.zeros_like(one.loss_mask),
                     {n: m.select_items(range(0)) for n, m in one.modalities.items()}, one.document_ids,
                     one.positions)


def microbatches(batch: MimoBatch, num_microbatches: int) -> list[MimoBatch]:
    """`batch` cut into `num_microbatches` consecutive slices by the same rule as `shard`."""
    if num_microbatches < 1:
        raise BatchError(f"cannot split a batch into {num_microbatches} parts; need at least 1")
    return [shard(batch, num_microbatches, i) for i in range(num_microbatches)]


# ---------------------------------------------------------------------------- synthetic data


@dataclass(frozen=True)
class ModalitySpec:
    """How the synthetic generator makes one modality's items.

    Attributes:
        special_token_id: id of the modality's positions in the token rows.
        item_shape: shape of one encoder input, e.g. ``(C, H, W)`` or ``(n_mels, T)``.
        tokens_per_item: encoder output tokens of one item.
        max_items: items per sample are drawn from ``0..max_items``.
        sizes: items of different sizes: ``((shape, tokens), ...)``, one drawn uniformly per item
            (the batch then holds a list of inputs and a count per item); empty: every item is
            `item_shape` with `tokens_per_item`.
    """

    special_token_id: int
    item_shape: tuple[int, ...]
    tokens_per_item: int
    max_items: int = 2
    sizes: tuple[tuple[tuple[int, ...], int], ...] = ()

    @property
    def most_tokens(self) -> int:
        """Tokens of the largest item this spec makes."""
        return max([self.tokens_per_item, *(t for _, t in self.sizes)])

    @classmethod
    def image(cls, config: ViTConfig, special_token_id: int, max_items: int = 2,
              sizes: Sequence[tuple[int, int]] = ()) -> ModalitySpec:
        """Images for a ViT with `config`: one token per patch (reads ``in_channels``,
        ``image_size`` and ``num_patches``, so any config with those fields serves). `sizes`:
        ``(H, W)`` pixel sizes drawn per image, for a ``dynamic_resolution`` config (tokens from
        its ``tokens_for``)."""
        shape = (config.item_channels, config.image_size, config.image_size)
        shapes = [(config.item_channels, h, w) for h, w in sizes]
        return cls(special_token_id, shape, config.num_patches, max_items,
                   tuple((s, config.tokens_for(s)) for s in shapes))

    @classmethod
    def audio(
        cls,
        config: AudioConfig,
        special_token_id: int,
        frames: int | None = None,
        max_items: int = 1,
        lengths: Sequence[int] = (),
    ) -> ModalitySpec:
        """Log-mel clips of `frames` frames (default ``config.max_frames``) for `AudioEncoder`
        (reads ``n_mels``, ``max_frames`` and ``output_length(frames)``). `lengths`: frame
        counts drawn per clip, for a ``variable_length`` config."""
        frames = config.max_frames if frames is None else frames
        shape = (config.n_mels, frames)
        return cls(special_token_id, shape, config.output_length(frames), max_items,
                   tuple(((config.n_mels, t), config.output_length(t)) for t in lengths))


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape of a synthetic global batch.

    Attributes:
        batch_size, seq_len, vocab_size: rows, row length, text vocabulary ``0..vocab_size-1``.
        modalities: ``{name: ModalitySpec}``.
        text_only_samples: at least this many samples carry no item of any modality. Unless every
            sample is text-only, one other sample carries ``max_items`` of every modality.
        documents_per_row: above 1, rows are packed: cut into up to this many documents (never
            inside an item), with ``document_ids`` and ``positions`` filled in.
    """

    batch_size: int
    seq_len: int
    vocab_size: int
    modalities: Mapping[str, ModalitySpec] = field(default_factory=dict)
    text_only_samples: int = 1
    documents_per_row: int = 1

    def __post_init__(self) -> None:
        if self.batch_size < 0 or self.seq_len < 1:
            raise ValueError(
                f"SyntheticSpec: batch_size={self.batch_size} must be >= 0 and "
                f"seq_len={self.seq_len} >= 1"
            )
        ids = [m.special_token_id for m in self.modalities.values()]
        if len(set(ids)) != len(ids):
            raise ValueError(f"SyntheticSpec: special token ids {ids} must be distinct")
        if self.vocab_size - sum(0 <= i < self.vocab_size for i in ids) < 1:
            raise ValueError(
                f"SyntheticSpec: vocab_size={self.vocab_size} leaves no text id besides the "
                f"special ids {ids}"
            )
        negative = {n: m.max_items for n, m in self.modalities.items() if m.max_items < 0}
        if negative:
            raise ValueError(f"SyntheticSpec: max_items must be >= 0, got {negative}")
        longest = sum(m.max_items * m.most_tokens for m in self.modalities.values())
        if longest > self.seq_len:
            raise ValueError(
                f"SyntheticSpec: a sample with max_items of every modality needs {longest} "
                f"special tokens but seq_len is {self.seq_len}"
            )
        if not 0 <= self.text_only_samples <= self.batch_size:
            raise ValueError(
                f"SyntheticSpec: text_only_samples={self.text_only_samples} must be in "
                f"0..batch_size={self.batch_size}"
            )
        if self.documents_per_row < 1:
            raise ValueError(
                f"SyntheticSpec: documents_per_row={self.documents_per_row} must be >= 1"
            )

    @classmethod
    def tiny(cls, **overrides) -> SyntheticSpec:
        """5 rows of 64 tokens over `LlamaConfig.tiny`'s vocabulary (64), with "vision" (id 64,
        up to 2 images of 16 patches for `ViTConfig.tiny`) and "audio" (id 65, up to one clip of
        32 frames = 16 tokens for `AudioConfig.tiny`); keyword arguments override fields."""
        # The numbers of `ModalitySpec.image(ViTConfig.tiny(), 64, 2)` and
        # `ModalitySpec.audio(AudioConfig.tiny(), 65, max_items=1)`, written out so that the data
        # layer needs no model class (tests/test_data.py checks that they agree).
        spec = cls(
            batch_size=5,
            seq_len=64,
            vocab_size=64,
            modalities={
                "vision": ModalitySpec(special_token_id=64, item_shape=(3, 16, 16), tokens_per_item=16,
                                       max_items=2),
                "audio": ModalitySpec(special_token_id=65, item_shape=(8, 32), tokens_per_item=16,
                                      max_items=1),
            },
        )
        return dataclasses.replace(spec, **overrides)


def _randint(high: int, g: torch.Generator) -> int:
    """A uniform integer in ``0..high-1``."""
    return int(torch.randint(high, (), generator=g))


def synthetic_batch(spec: SyntheticSpec, seed: int) -> MimoBatch:
    """A random global batch that depends only on `spec` and `seed` (same on every rank).

    Each row: items of every modality (counts drawn from ``0..max_items``, see `SyntheticSpec`)
    placed at random non-overlapping positions, ``tokens_per_item`` contiguous special ids each,
    in a random order across modalities; random text ids (never a special id) elsewhere.
    Labels are next-token ids where the next token is text in the same document, else
    `IGNORE_INDEX`. The loss mask is 1.0 except on: a masked prompt prefix of random length
    (up to half of each document), special-token positions, and positions without a label.
    Encoder inputs are standard normal.
    """
    g = torch.Generator().manual_seed(seed)
    b, s = spec.batch_size, spec.seq_len
    names = list(spec.modalities)
    specs = [spec.modalities[n] for n in names]
    special_ids = [m.special_token_id for m in specs]

    counts = [torch.randint(m.max_items + 1, (b,), generator=g).tolist() for m in specs]
    order = torch.randperm(b, generator=g).tolist()
    for sample in order[: spec.text_only_samples]:
        for c in counts:
            c[sample] = 0
    if spec.text_only_samples < b:
        for c, m in zip(counts, specs):
            c[order[spec.text_only_samples]] = m.max_items
    # Each item's (shape, tokens): drawn per item where a modality has sizes.
    kinds = [[m.sizes[i] for i in torch.randint(len(m.sizes), (sum(c),), generator=g).tolist()] if m.sizes
             else [(m.item_shape, m.tokens_per_item)] * sum(c) for c, m in zip(counts, specs)]
    firsts = [[0, *accumulate(c)] for c in counts]

    text_ids = torch.tensor([i for i in range(spec.vocab_size) if i not in special_ids],
                            dtype=torch.int64)
    tokens = text_ids[torch.randint(len(text_ids), (b, s), generator=g)]
    is_special = torch.zeros(b, s, dtype=torch.bool)
    document_ids = torch.zeros(b, s, dtype=torch.int64)

    for row in range(b):
        # This row's items, shuffled across modalities: (special id, length).
        items = [(m.special_token_id, k[i][1])
                 for c, m, k, f in zip(counts, specs, kinds, firsts) for i in range(f[row], f[row] + c[row])]
        shuffled = [items[i][0] for i in torch.randperm(len(items), generator=g).tolist()]
        # Modalities interleave at random; each modality's items keep their order (the assembly
        # fills a modality's positions with its items' rows in item order).
        queues = {token_id: iter([it for it in items if it[0] == token_id]) for token_id in special_ids}
        items = [next(queues[token_id]) for token_id in shuffled]
        # Stars and bars: n sorted distinct draws from free + n slots give the text gaps.
        free = s - sum(length for _, length in items)
        slots = torch.randperm(free + len(items), generator=g)[: len(items)].sort().values.tolist()
        inside = torch.zeros(s, dtype=torch.bool)  # a document may not start here
        placed = 0
        for i, ((token_id, length), slot) in enumerate(zip(items, slots)):
            start = slot - i + placed
            tokens[row, start : start + length] = token_id
            is_special[row, start : start + length] = True
            inside[start + 1 : start + length] = True
            placed += length
        if spec.documents_per_row > 1:
            cuts = [p for p in range(1, s) if not inside[p]]
            pick = torch.randperm(len(cuts), generator=g)[: spec.documents_per_row - 1].tolist()
            for p in sorted(cuts[i] for i in pick):
                document_ids[row, p:] += 1

    # Next-token labels inside a document; nothing to predict at a row or document end.
    labels = torch.full((b, s), IGNORE_INDEX, dtype=torch.int64)
    same_doc = document_ids[:, 1:] == document_ids[:, :-1]
    has_target = same_doc & ~is_special[:, 1:]
    labels[:, :-1] = torch.where(has_target, tokens[:, 1:], IGNORE_INDEX)

    # Positions: index within the document.
    index = torch.arange(s).expand(b, s)
    doc_start = torch.zeros(b, s, dtype=torch.int64)
    doc_start[:, 1:] = torch.where(same_doc, 0, index[:, 1:])
    doc_start = doc_start.cummax(dim=1).values
    positions = index - doc_start

    # Masked prompt prefix of each document, random length up to half of it.
    loss_mask = torch.ones(b, s)
    for row in range(b):
        ids, lengths = document_ids[row].unique_consecutive(return_counts=True)
        starts = [0, *accumulate(lengths.tolist())][:-1]
        for start, length in zip(starts, lengths.tolist()):
            prompt = _randint(length // 2 + 1, g)
            loss_mask[row, start : start + prompt] = 0.0
    loss_mask[is_special | (labels == IGNORE_INDEX)] = 0.0

    modalities = {
        name: ModalityInputs(
            inputs=([torch.randn(*shape, generator=g) for shape, _ in k] if m.sizes
                    else torch.randn(sum(c), *m.item_shape, generator=g)),
            items_per_sample=c,
            tokens_per_item=tuple(t for _, t in k) if m.sizes else m.tokens_per_item,
            special_token_id=m.special_token_id,
        )
        for name, m, c, k in zip(names, specs, counts, kinds)
    }
    packed = spec.documents_per_row > 1
    return MimoBatch(
        tokens=tokens,
        labels=labels,
        loss_mask=loss_mask,
        modalities=modalities,
        document_ids=document_ids if packed else None,
        positions=positions if packed else None,
    )


def step_fingerprint(batch: MimoBatch) -> int:
    """`batch_fingerprint` of a global batch: its per-token tensors, a packed row's documents and
    positions among them (when on the host: hashing device memory would sync), and each
    modality's items per sample and tokens per item (they give the tokens per sample; where an
    encoder balances its items over its dp ranks, the rows each rank sends follow the per-item
    counts, which samples of equal sums can still differ in); once per batch (`MimoBatch.memo`)."""
    tensors = tuple(t for t in (batch.tokens, batch.labels, batch.loss_mask, batch.document_ids, batch.positions)
                    if t is not None) if batch.tokens.is_cpu else ()
    return batch.memo("step fingerprint", lambda: batch_fingerprint(
        tensors, {n: (m.items_per_sample, m.item_tokens) for n, m in batch.modalities.items()}))
