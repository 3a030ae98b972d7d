"""Greedy decoding over a teacher-forced predictor (no KV cache): one full forward per new token."""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Sequence

import torch

from dtensor_mimo.data import MimoBatch


def greedy_generate(predict: Callable[[MimoBatch], torch.Tensor], batch: MimoBatch, prompt_lengths: Sequence[int],
                    max_new_tokens: int | Sequence[int],
                    stop_token: int | None | Sequence[int | None] = None) -> list[list[int]]:
    """Each sample's `batch` row up to ``prompt_lengths[i]`` tokens is its prompt (its encoder
    items included); returns the ids `predict` (next-token ids ``[B, S]`` at every position)
    generates per sample, up to `max_new_tokens` (one count for every sample, or one per
    sample) or through `stop_token` (one id, or one per sample; None: none) or through a
    modality's special id (which the row cannot take as text), writing each new id into the row
    after the prompt before the next call. On
    packed rows (``document_ids`` / ``positions``) each new id continues its prompt's document
    at the next position (the columns after a prompt belong to another document: the padding,
    or the next one packed)."""
    given, per_sample = _each(max_new_tokens, batch.batch_size)
    counts = [_count(n) for n in given]
    if None in counts:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens!r}; give the number of tokens to generate "
                         "per sample, an integer >= 0" + (" for each sample" if per_sample else ""))
    stop_ids, _ = _each(stop_token, batch.batch_size)
    if len(stop_ids) != batch.batch_size or any(s is not None and _count(s) is None for s in stop_ids):
        raise ValueError(f"generate: stop_token={stop_token!r}; give a token id (an integer >= 0) or None, once or "
                         f"one per sample ({batch.batch_size})")
    if len(prompt_lengths) != batch.batch_size:
        raise ValueError(f"generate: {len(prompt_lengths)} prompt lengths for {batch.batch_size} samples")
    if len(counts) != batch.batch_size:
        raise ValueError(f"generate: {len(counts)} counts of new tokens (max_new_tokens) for {batch.batch_size} "
                         "samples; give one count, or one per sample")
    bad = [i for i, (n, k) in enumerate(zip(prompt_lengths, counts)) if not 1 <= n <= batch.seq_len - k]
    if bad:
        wanted = [counts[i] for i in bad] if per_sample else counts[0]
        raise ValueError(f"generate: prompt lengths {[prompt_lengths[i] for i in bad]} leave no room for {wanted} new "
                         f"tokens in rows of {batch.seq_len}; shorten them or lower max_new_tokens")
    ends = torch.as_tensor(list(prompt_lengths))
    # The new ids overwrite the row after each prompt: an item's special tokens there (an image
    # after the prompt) would no longer match its items, and the batch check on the first rewritten
    # row would name the batch's counts, not these prompt lengths.
    columns = torch.arange(batch.seq_len)
    rewritten = (columns >= ends[:, None]) & (columns < ends[:, None] + torch.tensor(counts)[:, None])
    for name, token_id in batch.special_token_ids.items():
        hit = torch.nonzero(((batch.tokens.cpu() == token_id) & rewritten).any(1)).flatten().tolist()
        if hit:
            within = [counts[i] for i in hit] if per_sample else counts[0]
            raise ValueError(
                f"generate: samples {hit} hold {name!r} tokens (id {token_id}) within the {within} "
                f"positions after their prompts (prompt lengths {[prompt_lengths[i] for i in hit]}), which the new "
                "tokens would overwrite; give each row only its prompt's items, or lower max_new_tokens")
    tokens = batch.tokens.clone()
    documents = None if batch.document_ids is None else batch.document_ids.clone()
    positions = None if batch.positions is None else batch.positions.clone()
    rows = torch.arange(batch.batch_size)
    placeholders = torch.tensor(list(batch.special_token_ids.values()), dtype=torch.int64)
    limits = torch.tensor(counts)
    stops = torch.tensor([-1 if i is None else _count(i) for i in stop_ids])  # -1: no id is negative
    done = limits == 0
    generated: list[list[int]] = [[] for _ in prompt_lengths]
    for step in range(max(counts, default=0)):
        # fresh tensors every call: an attention core may key what it derives from them (its
        # block mask) by the tensor objects, which the updates below would change in place
        ids = predict(dataclasses.replace(batch, tokens=tokens, document_ids=_copy(documents),
                                          positions=_copy(positions))).cpu()
        new = ids[rows, ends - 1]
        for i in torch.nonzero(~done).flatten().tolist():
            generated[i].append(int(new[i]))
        # A modality's placeholder id (in the vocabulary where the tokenizer added it) ends its
        # sample: written into the row it would mark an item position no item fills.
        done |= torch.isin(new, placeholders) | (limits == step + 1)
        write = ~done
        live, at = rows[write], ends[write]
        tokens[live, at] = new[write].to(tokens.device)  # (a batch already on an accelerator)
        if documents is not None:  # the new token continues its prompt's document ...
            documents[live, at] = documents[live, at - 1]
        if positions is not None:  # ... at the position after the prompt's last token
            positions[live, at] = positions[live, at - 1] + 1
        ends = ends + write.long()
        done |= new == stops
        if done.all():
            break
    return generated


def _each(value: object, n: int) -> tuple[list, bool]:
    """`value` for each of `n` samples: given one per sample (any sequence but a string, or a 1-D
    array / tensor), or once for all; and whether it was given per sample."""
    per_sample = not isinstance(value, (str, bytes)) and (isinstance(value, Sequence) or getattr(value, "ndim", 0) == 1)
    return (list(value) if per_sample else [value] * n), per_sample


def _count(value: object) -> int | None:
    """`value` as a count of new tokens: an integer of any kind (numpy's, a 0-d tensor's), not a
    bool, >= 0; else None."""
    try:
        count = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        return None
    return count if count is not None and count >= 0 else None


def _copy(value: torch.Tensor | None) -> torch.Tensor | None:
    return None if value is None else value.clone()
