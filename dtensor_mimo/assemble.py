"""Assembly: modality embeddings scattered into the token sequence at their special-token positions.

The language model's input is ``[B, S, H]``: the text embedding at every text position, and at the
positions of a modality's special token id the rows of that modality's flattened, projected
encoder output ``[N_tokens, H]`` (batch-major: samples in order, each sample's items in order,
each item's tokens in order), consumed in row-major order of the positions.

Everything the assembly needs is checked before anything is computed, and a modality whose
special tokens are present but whose embeddings are missing is an error, never zeros.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch

from dtensor_mimo.data.batch import special_id_clash

__all__ = ["AssemblyError", "assemble", "embed_text", "mask_special_tokens", "special_id_clash"]


class AssemblyError(ValueError):
    """Embeddings and tokens that cannot be assembled: names the modality and the numbers."""


def mask_special_tokens(
    tokens: torch.Tensor, special_token_ids: Mapping[str, int] | Iterable[int], fill: int = 0
) -> torch.Tensor:
    """`tokens` with every special id replaced by `fill` (a valid text id), out of place.

    Special ids may lie outside the text vocabulary; this makes the text lookup safe. The
    embeddings looked up at those positions are replaced by `assemble`, which also stops their
    gradient, so the `fill` row of the embedding table receives nothing from them.
    """
    ids = list(special_token_ids.values() if isinstance(special_token_ids, Mapping)
               else special_token_ids)
    if not ids:
        return tokens
    special = tokens == ids[0]  # compared with Python ids: no host-to-device copy of the ids
    for token_id in ids[1:]:
        special |= tokens == token_id
    return tokens.masked_fill(special, fill)


def embed_text(
    embedding: Callable[[torch.Tensor], torch.Tensor],
    tokens: torch.Tensor,
    special_token_ids: Mapping[str, int] | Iterable[int],
) -> torch.Tensor:
    """Text embeddings ``[B, S, H]`` of `tokens` through `embedding` (e.g.
    ``llama.tok_embeddings``), with special ids looked up as id 0 (see `mask_special_tokens`)."""
    return embedding(mask_special_tokens(tokens, special_token_ids))


def _check(
    text_embeddings: torch.Tensor,
    tokens: torch.Tensor,
    modality_embeddings: Mapping[str, torch.Tensor],
    special_token_ids: Mapping[str, int],
    counts: Mapping[str, int] | None = None,
) -> None:
    if text_embeddings.dim() != 3 or tokens.dim() != 2 or text_embeddings.shape[:2] != tokens.shape:
        raise AssemblyError(
            f"text embeddings {list(text_embeddings.shape)} and tokens {list(tokens.shape)} "
            f"must be [B, S, H] and [B, S] with the same B and S"
        )
    hidden = text_embeddings.shape[-1]
    clash = special_id_clash(special_token_ids)
    if clash:
        raise AssemblyError(clash)
    for name, emb in modality_embeddings.items():
        if name not in special_token_ids:
            raise AssemblyError(
                f"embeddings were given for modality {name!r} but special_token_ids has no id "
                f"for it (ids given: {dict(special_token_ids)})"
            )
        if emb.dim() != 2:
            raise AssemblyError(
                f"{name!r} embeddings must be 2-D [tokens, hidden], got {list(emb.shape)}; "
                f"flatten the encoder output batch-major, e.g. out.flatten(0, 1)"
            )
        if emb.shape[1] != hidden:
            raise AssemblyError(
                f"{name!r} embeddings have hidden size {emb.shape[1]} but the text embeddings "
                f"have {hidden}; project the encoder output to the language model width"
            )
    if not special_token_ids:
        return
    names = list(special_token_ids)
    if counts is None:
        ids = torch.tensor([special_token_ids[n] for n in names], device=tokens.device)
        found = (tokens.reshape(-1, 1) == ids).sum(dim=0).tolist()  # one host sync for all
    else:  # from host metadata: no device sync
        missing = [n for n in names if n not in counts]
        if missing:
            raise AssemblyError(f"counts gives no special-token count for {missing} "
                                f"(counts given: {dict(counts)})")
        found = [counts[n] for n in names]
    for name, count in zip(names, found):
        token_id = special_token_ids[name]
        if name not in modality_embeddings:
            if count:
                raise AssemblyError(
                    f"batch has {count} {name!r} tokens (id {token_id}) but no {name!r} "
                    f"embeddings were given; pass the {name!r} encoder output (refusing to "
                    f"fill its positions with zeros)"
                )
            continue
        rows = modality_embeddings[name].shape[0]
        if rows != count:
            raise AssemblyError(
                f"batch has {count} {name!r} tokens (id {token_id}) but the {name!r} encoder "
                f"produced {rows} rows; the flattened encoder output needs one row per special "
                f"token (items_per_sample x tokens_per_item), samples in batch order"
            )


def assemble(
    text_embeddings: torch.Tensor,
    tokens: torch.Tensor,
    modality_embeddings: Mapping[str, torch.Tensor],
    special_token_ids: Mapping[str, int],
    *,
    counts: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """The language model input ``[B, S, H]``: text embeddings with modality rows scattered in.

    Args:
        text_embeddings: ``[B, S, H]``; used at every position that holds no special id.
        tokens: ``[B, S]`` token ids.
        modality_embeddings: ``{name: [N_tokens, H]}``; row i of modality m goes to the i-th
            position (row-major over ``[B, S]``) holding ``special_token_ids[m]``. Cast to the
            dtype of `text_embeddings`.
        special_token_ids: ``{name: id}`` of every modality the model knows; a modality listed
            here without embeddings must have no tokens in the batch.
        counts: ``{name: special tokens of that id in tokens}`` when the caller already knows
            them from host metadata (a validated `MimoBatch`'s ``num_tokens``): the checks then
            use them instead of counting `tokens`, which on an accelerator is a device-to-host
            sync. None (default): count `tokens` (one sync for all modalities).

    Differentiable w.r.t. `text_embeddings` (zero gradient at special positions) and every
    modality embedding (row i receives the output gradient at its position). Out of place.

    Raises:
        AssemblyError: before computing, if counts, names, ids or hidden sizes disagree.
    """
    _check(text_embeddings, tokens, modality_embeddings, special_token_ids, counts)
    out = text_embeddings
    for name, emb in modality_embeddings.items():
        positions = (tokens == special_token_ids[name]).unsqueeze(-1)  # [B, S, 1]
        # masked_scatter fills the selected [B, S, H] elements in row-major order from the
        # flat source: exactly row i of emb into the i-th selected position.
        out = out.masked_scatter(positions, emb.to(out.dtype))
    return out
