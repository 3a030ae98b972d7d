"""Specification of `dtensor_mimo.assemble` (pure: one process).

Reference: a plain Python loop over rows and positions that keeps one cursor per modality and
copies the next row of that modality's embedding at each of its special tokens, text elsewhere.
Gradients: with a random upstream gradient G, the loop says text position (b, s) receives
G[b, s] unless it holds a special id (then 0), and row i of modality m receives G at the i-th
position of m's id.

| case                               | tokens (B x S)                   | modalities                         |
|------------------------------------|----------------------------------|------------------------------------|
| one modality                       | 3 x 10: 2 adjacent items, text-  | vision (id 100, 2 tokens per item) |
|                                    |   only row, 1 item at row end    |                                    |
| two modalities, ids >= vocab       | 4 x 12, interleaved items        | vision 100, audio 101              |
| ids inside the vocabulary          | 3 x 8                            | vision 2, audio 5 (vocab 8)        |
| listed modality absent             | no audio tokens                  | audio id given, no audio embedding |
| modality with 0 tokens, 0 rows     | no audio tokens                  | audio embedding [0, H]             |
| text only                          | no special ids                   | {} (and ids listed, no embeddings) |
| bf16 modality, fp32 text           | two modalities                   | cast to the text dtype             |
| generated batches, dp shards       | synthetic_batch, plain + packed  | vision + audio, shards of dp 1..3  |
| gradients                          | all of the above                 | loop reference                     |
| embed_text                         | special ids >= vocab             | lookup == table[id or 0]; row 0 of |
|                                    |                                  |   the table gets no special grad   |
| real encoders end to end           | generated, dp 2 shard            | ViT/Audio -> Projection -> Llama   |
| errors                             | each AssemblyError message       |                                    |
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from dtensor_mimo.assemble import AssemblyError, assemble, embed_text, mask_special_tokens
from dtensor_mimo.data import ModalitySpec, SyntheticSpec, shard, synthetic_batch
from dtensor_mimo.models import (
    AudioConfig,
    AudioEncoder,
    Llama,
    LlamaConfig,
    Projection,
    ViT,
    ViTConfig,
)

HID = 6


# ------------------------------------------------------------------ reference


def positions_of(tokens: torch.Tensor, token_id: int) -> list[tuple[int, int]]:
    """Positions of `token_id`, rows first, by a loop."""
    b, s = tokens.shape
    return [(i, j) for i in range(b) for j in range(s) if int(tokens[i, j]) == token_id]


def reference_assemble(text, tokens, embeddings, ids):
    out = text.detach().clone()
    name_of = {ids[n]: n for n in embeddings}
    cursor = {n: 0 for n in embeddings}
    for i in range(tokens.shape[0]):
        for j in range(tokens.shape[1]):
            name = name_of.get(int(tokens[i, j]))
            if name is not None:
                out[i, j] = embeddings[name][cursor[name]].to(out.dtype)
                cursor[name] += 1
    return out


def reference_grads(grad, tokens, embeddings, ids):
    text_grad = grad.clone()
    for token_id in ids.values():
        for i, j in positions_of(tokens, token_id):
            text_grad[i, j] = 0
    emb_grads = {}
    for name, emb in embeddings.items():
        rows = [grad[i, j] for i, j in positions_of(tokens, ids[name])]
        stacked = torch.stack(rows) if rows else grad.new_zeros(0, grad.shape[-1])
        emb_grads[name] = stacked.to(emb.dtype)
    return text_grad, emb_grads


def check(text, tokens, embeddings, ids, seed=0):
    """assemble == loop reference, values and gradients."""
    text = text.detach().requires_grad_()
    embeddings = {n: e.detach().requires_grad_() for n, e in embeddings.items()}
    out = assemble(text, tokens, embeddings, ids)
    assert out.dtype == text.dtype
    expected = reference_assemble(text, tokens, embeddings, ids)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    out.backward(grad)
    text_grad, emb_grads = reference_grads(grad, tokens, embeddings, ids)
    torch.testing.assert_close(text.grad, text_grad, rtol=0, atol=0)
    for name, emb in embeddings.items():
        torch.testing.assert_close(emb.grad, emb_grads[name], rtol=0, atol=0)


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


T, V, A = 7, 100, 101  # a text id, the vision id, the audio id

ONE_MODALITY = torch.tensor([
    [T, V, V, V, V, T, T, T, T, T],   # two adjacent images
    [T, T, T, T, T, T, T, T, T, T],   # text only
    [T, T, T, T, T, T, T, T, V, V],   # one image at the end
])
TWO_MODALITIES = torch.tensor([
    [V, V, T, A, A, A, T, V, V, T, T, T],
    [T, T, T, T, T, T, T, T, T, T, T, T],
    [A, A, A, A, A, A, V, V, T, T, T, T],
    [T, T, T, T, T, V, V, A, A, A, T, T],
])
IN_VOCAB = torch.tensor([
    [1, 2, 2, 3, 5, 4, 2, 2],
    [5, 0, 1, 3, 4, 6, 7, 0],
    [2, 2, 5, 5, 1, 1, 1, 1],
])


def _count(tokens, token_id):
    return int((tokens == token_id).sum())


def test_one_modality():
    tokens = ONE_MODALITY
    check(rand(3, 10, HID), tokens, {"vision": rand(_count(tokens, V), HID, seed=1)}, {"vision": V})


def test_two_modalities():
    tokens = TWO_MODALITIES
    embeddings = {"vision": rand(_count(tokens, V), HID, seed=1),
                  "audio": rand(_count(tokens, A), HID, seed=2)}
    check(rand(4, 12, HID), tokens, embeddings, {"vision": V, "audio": A})


def test_ids_inside_the_vocabulary():
    tokens = IN_VOCAB
    embeddings = {"vision": rand(_count(tokens, 2), HID, seed=1),
                  "audio": rand(_count(tokens, 5), HID, seed=2)}
    check(rand(3, 8, HID), tokens, embeddings, {"vision": 2, "audio": 5})


def test_listed_modality_without_tokens_or_embeddings():
    tokens = ONE_MODALITY
    embeddings = {"vision": rand(_count(tokens, V), HID)}
    check(rand(3, 10, HID), tokens, embeddings, {"vision": V, "audio": A})


def test_modality_with_zero_rows():
    tokens = ONE_MODALITY
    embeddings = {"vision": rand(_count(tokens, V), HID), "audio": rand(0, HID)}
    check(rand(3, 10, HID), tokens, embeddings, {"vision": V, "audio": A})


def test_text_only():
    tokens = torch.full((2, 5), T)
    text = rand(2, 5, HID)
    check(text, tokens, {}, {})
    check(text, tokens, {}, {"vision": V, "audio": A})
    assert torch.equal(assemble(text, tokens, {}, {"vision": V}), text)


def test_modality_embeddings_are_cast_to_the_text_dtype():
    tokens = TWO_MODALITIES
    embeddings = {"vision": rand(_count(tokens, V), HID, dtype=torch.bfloat16),
                  "audio": rand(_count(tokens, A), HID, dtype=torch.bfloat16)}
    check(rand(4, 12, HID), tokens, embeddings, {"vision": V, "audio": A})


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dp", [1, 2, 3])
def test_generated_batch_shards(packed, dp):
    batch = synthetic_batch(SyntheticSpec.tiny(documents_per_row=3 if packed else 1), seed=dp)
    for rank in range(dp):
        part = shard(batch, dp, rank)
        embeddings = {n: rand(part.num_tokens(n), HID, seed=10 + i)
                      for i, n in enumerate(part.modalities)}
        check(rand(part.batch_size, part.seq_len, HID), part.tokens, embeddings,
              part.special_token_ids, seed=rank)


# ------------------------------------------------------------------ text lookup


def test_embed_text_with_special_ids_outside_the_vocabulary():
    vocab = 10
    table = nn.Embedding(vocab, HID)
    tokens = torch.tensor([[3, V, V, 0, 9], [A, 4, 4, A, 0]])
    ids = {"vision": V, "audio": A}
    assert mask_special_tokens(tokens, ids).tolist() == [[3, 0, 0, 0, 9], [0, 4, 4, 0, 0]]
    assert mask_special_tokens(tokens, [V], fill=5).tolist() == [[3, 5, 5, 0, 9], [A, 4, 4, A, 0]]
    text = embed_text(table, tokens, ids)
    for i in range(2):
        for j in range(5):
            t = int(tokens[i, j])
            assert torch.equal(text[i, j], table.weight[t if t < vocab else 0])

    # After assembly, only the real id-0 text positions feed row 0 of the table.
    embeddings = {"vision": rand(2, HID, seed=1).requires_grad_(), "audio": rand(2, HID, seed=2)}
    out = assemble(text, tokens, embeddings, ids)
    grad = rand(*out.shape, seed=3)
    out.backward(grad)
    expected = torch.zeros(vocab, HID)
    for i in range(2):
        for j in range(5):
            t = int(tokens[i, j])
            if t < vocab:
                expected[t] += grad[i, j]
    torch.testing.assert_close(table.weight.grad, expected)


def test_real_encoders_end_to_end():
    """Generated batch -> ViT / audio encoder -> projection -> assemble -> Llama, on a dp shard."""
    torch.manual_seed(0)
    llm_cfg = LlamaConfig.tiny(n_layers=1)
    vit_cfg, audio_cfg = ViTConfig.tiny(n_layers=1), AudioConfig.tiny(n_layers=1)
    spec = SyntheticSpec(batch_size=4, seq_len=64, vocab_size=llm_cfg.vocab_size,
                         modalities={"vision": ModalitySpec.image(vit_cfg, 64),
                                     "audio": ModalitySpec.audio(audio_cfg, 65, max_items=1)})
    part = shard(synthetic_batch(spec, seed=0), 2, 1)
    llm, vit, audio = Llama(llm_cfg), ViT(vit_cfg), AudioEncoder(audio_cfg)
    vit_proj = Projection(vit_cfg.dim, llm_cfg.dim)
    audio_proj = Projection(audio_cfg.dim, llm_cfg.dim)
    embeddings = {
        "vision": vit_proj(vit(part.modalities["vision"].inputs).flatten(0, 1)),
        "audio": audio_proj(audio(part.modalities["audio"].inputs).flatten(0, 1)),
    }
    text = embed_text(llm.tok_embeddings, part.tokens, part.special_token_ids)
    h = assemble(text, part.tokens, embeddings, part.special_token_ids)
    expected = reference_assemble(text, part.tokens, embeddings, part.special_token_ids)
    torch.testing.assert_close(h, expected)
    logits = llm(h=h)
    loss = (torch.nn.functional.cross_entropy(logits.flatten(0, 1), part.labels.flatten(),
                                              reduction="none") * part.loss_mask.flatten()).sum()
    loss.backward()
    assert vit.patch_embed.weight.grad.abs().sum() > 0
    assert audio.conv1.weight.grad.abs().sum() > 0


# ------------------------------------------------------------------ errors

ERRORS = [
    ("count mismatch",
     dict(embeddings={"vision": rand(40, HID)}),
     "batch has 6 'vision' tokens (id 100) but the 'vision' encoder produced 40 rows; the "
     "flattened encoder output needs one row per special token"),
    ("embedding rows for a batch without tokens",
     dict(embeddings={"vision": rand(6, HID), "audio": rand(3, HID)}),
     "batch has 0 'audio' tokens (id 101) but the 'audio' encoder produced 3 rows"),
    ("missing modality input",
     dict(embeddings={}),
     "batch has 6 'vision' tokens (id 100) but no 'vision' embeddings were given; pass the "
     "'vision' encoder output (refusing to fill its positions with zeros)"),
    ("no special token id",
     dict(embeddings={"vision": rand(6, HID), "speech": rand(2, HID)}),
     "embeddings were given for modality 'speech' but special_token_ids has no id for it "
     "(ids given: {'vision': 100, 'audio': 101})"),
    ("shared id",
     dict(ids={"vision": V, "audio": V}),
     "modalities 'vision' and 'audio' share special token id 100; each modality needs its own id"),
    ("hidden size",
     dict(embeddings={"vision": rand(6, HID + 2)}),
     "'vision' embeddings have hidden size 8 but the text embeddings have 6; project the "
     "encoder output to the language model width"),
    ("not flattened",
     dict(embeddings={"vision": rand(3, 2, HID)}),
     "'vision' embeddings must be 2-D [tokens, hidden], got [3, 2, 6]; flatten the encoder "
     "output batch-major"),
    ("text / tokens shape",
     dict(text=rand(3, 9, HID)),
     "text embeddings [3, 9, 6] and tokens [3, 10] must be [B, S, H] and [B, S] with the same "
     "B and S"),
]


@pytest.mark.parametrize("case, args, message", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors(case, args, message):
    text = args.get("text", rand(3, 10, HID))
    embeddings = args.get("embeddings", {"vision": rand(6, HID)})
    ids = args.get("ids", {"vision": V, "audio": A})
    with pytest.raises(AssemblyError, match=re.escape(message)):
        assemble(text, ONE_MODALITY, embeddings, ids)


def test_counts_from_metadata_replace_counting_the_tokens():
    """`counts` (from host metadata, e.g. `MimoBatch.num_tokens`) are used instead of counting
    `tokens` on the device: the same output, and the same errors when they disagree with the rows."""
    tokens, ids = TWO_MODALITIES, {"vision": V, "audio": A}
    text = rand(4, 12, HID)
    embeddings = {"vision": rand(_count(tokens, V), HID, seed=1), "audio": rand(_count(tokens, A), HID, seed=2)}
    counts = {"vision": _count(tokens, V), "audio": _count(tokens, A)}
    torch.testing.assert_close(assemble(text, tokens, embeddings, ids, counts=counts),
                               reference_assemble(text, tokens, embeddings, ids), rtol=0, atol=0)
    with pytest.raises(AssemblyError, match=re.escape(f"batch has {counts['vision'] + 1} 'vision' tokens")):
        assemble(text, tokens, embeddings, ids, counts={**counts, "vision": counts["vision"] + 1})
    with pytest.raises(AssemblyError, match=re.escape("counts gives no special-token count for ['audio']")):
        assemble(text, tokens, embeddings, ids, counts={"vision": counts["vision"]})
