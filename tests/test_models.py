"""Specification of the reference models, checked in one process.

Each property is compared with an independent reference, never with the code under test:

| property                                   | reference                                          |
|--------------------------------------------|----------------------------------------------------|
| attention core: causal, documents, any     | a per-query softmax loop over the allowed keys     |
|   q/kv index sets, grouped-query heads     |                                                    |
| RoPE                                       | Llama's complex-number rotation; relative property |
| grouped-query attention in the model       | the same model with KV heads repeated into MHA     |
| causality                                  | prefix logits unchanged when a later token changes |
| packed documents                           | each document run alone                            |
| context-parallel contract (all-gather K/V, | the full-sequence run (logits and gradients), for  |
|   zigzag and random row splits)            |   plain and packed rows                            |
| tensor parallel by heads (Llama, ViT)      | the unsharded module                               |
| pipeline stages (layers deleted, None ends)| the whole model                                    |
| init_weights                               | the whole model, another dtype, Llama-7B's sizes   |
| ViT patch order, per-item independence     | unfold + matmul by hand; each item alone           |
| audio T_out function                       | the real encoder output length                     |
| gradients                                  | every parameter receives a nonzero gradient        |
| greedy generate on packed rows             | a greedy loop over the prompt's document alone     |
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dtensor_mimo.models import (
    AudioConfig,
    AudioEncoder,
    Llama,
    LlamaConfig,
    Projection,
    ViT,
    ViTConfig,
    apply_rope,
    apply_rope_tables,
    causal_attention,
    rope_cos_sin,
    rope_tables,
)

# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def randomize(model: nn.Module, seed: int, std: float = 0.3) -> nn.Module:
    """Large random weights (norm weights too) so that attention is far from uniform and every
    property below is tested with sharp contrast. Independent of `init_weights`."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * std)
            if p.dim() == 1:
                p.add_(1.0)  # norm weights near 1, biases near 1: no parameter is zero
    return model


def llama64(seed: int = 0, **overrides) -> Llama:
    return randomize(Llama(LlamaConfig.tiny(**overrides)).double(), seed)


def tokens_for(b: int, s: int, seed: int = 0, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def naive_attention(q, k, v, q_pos, kv_pos, q_doc=None, kv_doc=None):
    """softmax(q.k / sqrt(D)) v over the allowed keys, one query at a time."""
    b_size, hq, sq, d = q.shape
    group = hq // k.shape[1]
    out = torch.zeros_like(q)
    for b in range(b_size):
        for h in range(hq):
            for i in range(sq):
                allowed = [
                    j
                    for j in range(k.shape[2])
                    if kv_pos[b, j] <= q_pos[b, i]
                    and (q_doc is None or kv_doc[b, j] == q_doc[b, i])
                ]
                kh, vh = k[b, h // group], v[b, h // group]
                scores = torch.stack([q[b, h, i] @ kh[j] for j in allowed]) / math.sqrt(d)
                weights = torch.softmax(scores, dim=0)
                out[b, h, i] = sum(w * vh[j] for w, j in zip(weights, allowed))
    return out


def packed_positions(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary positions restarting per document, and document ids, for one packed row."""
    positions = torch.cat([torch.arange(n) for n in lengths])
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return positions, docs


# ---------------------------------------------------------------------------------------------
# attention core
# ---------------------------------------------------------------------------------------------


def test_attention_core_causal_matches_naive_loop():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 6, 8, generator=g, dtype=torch.float64)  # GQA: 2 KV heads for 4 q heads
    v = torch.randn(2, 2, 6, 8, generator=g, dtype=torch.float64)
    pos = torch.arange(6).expand(2, 6)
    out = causal_attention(q, k, v, q_pos=pos, kv_pos=pos)
    torch.testing.assert_close(out, naive_attention(q, k, v, pos, pos))


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_attention_core_any_index_sets_and_documents(data):
    """Queries on an arbitrary subset of rows (in any order), keys on another arrangement."""
    s = data.draw(st.integers(1, 7), label="seq")
    n_docs = data.draw(st.integers(1, 3), label="docs")
    doc_of_col = sorted(data.draw(st.lists(st.integers(0, n_docs - 1), min_size=s, max_size=s)))
    kv_cols = data.draw(st.permutations(range(s)), label="kv order")
    q_cols = data.draw(st.lists(st.sampled_from(range(s)), min_size=1, max_size=s, unique=True))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000), label="seed"))
    q = torch.randn(1, 2, len(q_cols), 4, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, s, 4, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, s, 4, generator=g, dtype=torch.float64)
    q_pos, kv_pos = torch.tensor([q_cols]), torch.tensor([kv_cols])
    docs = torch.tensor(doc_of_col)
    q_doc, kv_doc = docs[q_pos], docs[kv_pos]
    out = causal_attention(q, k, v, q_pos=q_pos, kv_pos=kv_pos, q_doc=q_doc, kv_doc=kv_doc)
    torch.testing.assert_close(out, naive_attention(q, k, v, q_pos, kv_pos, q_doc, kv_doc))


def test_attention_core_query_subset_equals_rows_of_full_run():
    """What context parallel relies on: q on some rows, K/V on all rows, explicit indices."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g, dtype=torch.float64) for _ in range(3))
    full_pos = torch.arange(8)[None]
    rows = torch.tensor([6, 1, 7, 0])
    out = causal_attention(q[:, :, rows], k, v, q_pos=rows[None], kv_pos=full_pos)
    full = naive_attention(q, k, v, full_pos, full_pos)
    torch.testing.assert_close(out, full[:, :, rows])


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------


def test_rope_matches_complex_rotation():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 8, generator=g, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 3, 0, 100, 2]])
    theta = 10000.0
    # Llama's precompute_freqs_cis + apply_rotary_emb, written with complex numbers.
    freqs = 1.0 / theta ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    angles = positions[..., None].double() * freqs
    rotation = torch.polar(torch.ones_like(angles), angles)[:, :, None]  # [B, S, 1, D/2]
    expected = torch.view_as_real(torch.view_as_complex(x.reshape(2, 5, 3, 4, 2)) * rotation)
    out = apply_rope(x, *rope_cos_sin(positions, 8, theta, torch.float64))
    torch.testing.assert_close(out, expected.flatten(-2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_is_the_written_out_rotation_to_the_bit(dtype):
    """`apply_rope_tables` (a model's layers) and `apply_rope` give the pairwise products and sums
    written out, bit for bit, in the output and in the input's gradient."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 16, generator=g).to(dtype)
    cos, sin = rope_cos_sin(torch.tensor([[0, 1, 2, 3, 4], [9, 3, 0, 700, 2]]), 16, 10000.0, dtype)
    upstream = torch.randn(2, 5, 3, 16, generator=g).to(dtype)

    def written_out(x):
        xf = x.float().unflatten(-1, (-1, 2))
        even, odd, c, s = xf[..., 0], xf[..., 1], cos.unsqueeze(2), sin.unsqueeze(2)
        return torch.stack((even * c - odd * s, even * s + odd * c), -1).flatten(-2).to(dtype)

    outputs, grads = [], []
    tables = rope_tables(cos, sin)
    for fn in (written_out, lambda x: apply_rope_tables(x, tables), lambda x: apply_rope(x, cos, sin)):
        leaf = x.clone().requires_grad_()
        out = fn(leaf)
        out.backward(upstream)
        outputs.append(out)
        grads.append(leaf.grad)
    assert all(o.dtype == dtype for o in outputs)
    for out, grad in zip(outputs[1:], grads[1:]):
        assert torch.equal(out, outputs[0]) and torch.equal(grad, grads[0])


def test_rope_scores_depend_only_on_relative_position():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, 16, generator=g, dtype=torch.float64)

    def score(pq: int, pk: int) -> torch.Tensor:
        cq = rope_cos_sin(torch.tensor([[pq]]), 16, 10000.0, torch.float64)
        ck = rope_cos_sin(torch.tensor([[pk]]), 16, 10000.0, torch.float64)
        return (apply_rope(q, *cq) * apply_rope(k, *ck)).sum()

    torch.testing.assert_close(score(5, 2), score(103, 100))
    assert not torch.allclose(score(5, 2), score(5, 3))


# ---------------------------------------------------------------------------------------------
# Llama
# ---------------------------------------------------------------------------------------------


def test_llama_config_defaults_and_errors():
    assert LlamaConfig(dim=4096).ffn_hidden == 11008  # Llama-7B's FFN width
    assert LlamaConfig(n_heads=8, dim=64).n_kv_heads == 8
    with pytest.raises(ValueError, match="n_heads=4 must be a multiple of n_kv_heads=3"):
        LlamaConfig.tiny(n_kv_heads=3)
    with pytest.raises(ValueError, match="dim=30 must be divisible by n_heads=4"):
        LlamaConfig.tiny(dim=30)


def test_llama_gqa_equals_repeated_kv_heads():
    gqa = llama64(n_kv_heads=2)  # 4 query heads share 2 KV heads
    mha = Llama(LlamaConfig.tiny(n_kv_heads=4)).double()
    hd = gqa.config.head_dim
    state = gqa.state_dict()
    for name, value in list(state.items()):
        if name.endswith(("attention.wk.weight", "attention.wv.weight")):
            # KV head j serves query heads 2j and 2j+1.
            state[name] = value.view(2, hd, -1).repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(state)
    tokens = tokens_for(2, 9)
    torch.testing.assert_close(gqa(tokens), mha(tokens))


def test_llama_is_causal():
    model = llama64()
    tokens = tokens_for(2, 10)
    changed = tokens.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 64
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :6], after[:, :6])
    assert (before[:, 6:] - after[:, 6:]).abs().amax(-1).min() > 1e-3


def test_llama_packed_documents_equal_separate_runs():
    model = llama64()
    rows = [[3, 5, 2], [10]]  # document lengths of each packed row
    docs = [[tokens_for(1, n, seed=len(row) + n) for n in row] for row in rows]
    tokens = torch.cat([torch.cat(row_docs, dim=1) for row_docs in docs])
    positions = torch.stack([packed_positions(row)[0] for row in rows])
    document_ids = torch.stack([packed_positions(row)[1] for row in rows])
    packed = model(tokens, positions=positions, document_ids=document_ids)
    for r, row_docs in enumerate(docs):
        start = 0
        for doc in row_docs:
            n = doc.shape[1]
            torch.testing.assert_close(packed[r, start : start + n], model(doc)[0])
            start += n


def test_llama_rotary_positions_come_from_the_positions_argument():
    """RoPE is relative, so a constant offset is invisible (the packed test cannot see positions
    being ignored); gaps are not. Tokens at positions [0, 1, 5] equal columns 0, 1, 5 of a longer
    row in which columns 2..4 belong to another document."""
    model = llama64()
    short = tokens_for(1, 3)
    filler = tokens_for(1, 3, seed=1)
    long = torch.cat([short[:, :2], filler, short[:, 2:]], dim=1)
    long_docs = torch.tensor([[0, 0, 1, 1, 1, 0]])
    expected = model(long, document_ids=long_docs)[:, [0, 1, 5]]
    torch.testing.assert_close(model(short, positions=torch.tensor([[0, 1, 5]])), expected)


def test_llama_embeddings_input_equals_tokens_input():
    model = llama64()
    tokens = tokens_for(2, 7)
    h = model.tok_embeddings.weight[tokens]  # the embedding lookup done by hand
    torch.testing.assert_close(model(h=h), model(tokens))


def make_all_gather_kv_attention(cp: int):
    """A context-parallel attention core simulated in one process: the batch holds the cp ranks'
    shards stacked (rows r*B..(r+1)*B-1 are rank r), and "all-gather" concatenates the ranks' K/V
    along the sequence and gives every rank the result."""

    def gather(t: torch.Tensor, seq_dim: int) -> torch.Tensor:
        full = torch.cat(t.chunk(cp, dim=0), dim=seq_dim)
        return full.repeat(cp, *([1] * (t.dim() - 1)))

    def attention(q, k, v, *, q_pos, kv_pos, q_doc=None, kv_doc=None):
        return causal_attention(
            q,
            gather(k, 2),
            gather(v, 2),
            q_pos=q_pos,
            kv_pos=gather(kv_pos, 1),
            q_doc=q_doc,
            kv_doc=None if kv_doc is None else gather(kv_doc, 1),
        )

    return attention


@pytest.mark.parametrize("split", ["zigzag", "random"])
@pytest.mark.parametrize("packed", [False, True])
def test_llama_context_parallel_contract(split, packed):
    """Each simulated cp rank holds a non-contiguous subset of the columns and gives their rotary
    positions and global sequence indices; with K/V gathered from all ranks, logits and
    parameter gradients equal those of the full-sequence run."""
    cp, b, s = 2, 2, 8
    model = llama64()
    tokens = tokens_for(b, s)
    if packed:
        positions, document_ids = packed_positions([3, 5])
        positions, document_ids = positions.expand(b, s), document_ids.expand(b, s)
    else:
        positions, document_ids = torch.arange(s).expand(b, s), None
    if split == "zigzag":  # rank 0: chunks 0 and 3, rank 1: chunks 1 and 2
        columns = [torch.tensor([0, 1, 6, 7]), torch.tensor([2, 3, 4, 5])]
    else:
        perm = torch.randperm(s, generator=torch.Generator().manual_seed(3))
        columns = [perm[:4], perm[4:]]
    weights = torch.randn(b, s, 64, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    full = model(tokens, positions=positions, document_ids=document_ids)
    (full * weights).sum().backward()
    full_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    def shard(t: torch.Tensor) -> torch.Tensor:  # [B, S, ...] -> [cp * B, S / cp, ...]
        return torch.cat([t[:, cols] for cols in columns], dim=0)

    sharded_model = copy.deepcopy(model)
    sharded_model.set_attention_fn(make_all_gather_kv_attention(cp))
    out = sharded_model(
        shard(tokens),
        positions=shard(positions),
        document_ids=None if document_ids is None else shard(document_ids),
        sequence_index=shard(torch.arange(s).expand(b, s)),
    )
    torch.testing.assert_close(out, shard(full))
    (out * shard(weights)).sum().backward()
    for name, p in sharded_model.named_parameters():
        torch.testing.assert_close(p.grad, full_grads[name], msg=name)


def test_llama_attention_fn_receives_the_documented_arguments():
    calls = []

    def recording(q, k, v, *, q_pos, kv_pos, q_doc=None, kv_doc=None):
        calls.append((q.shape, k.shape, v.shape, q_pos, kv_pos, q_doc))
        return causal_attention(q, k, v, q_pos=q_pos, kv_pos=kv_pos, q_doc=q_doc, kv_doc=kv_doc)

    model = Llama(LlamaConfig.tiny(), attention_fn=recording)
    model(tokens_for(3, 5))
    assert len(calls) == 2  # one per layer
    for q_shape, k_shape, v_shape, q_pos, kv_pos, q_doc in calls:
        assert q_shape == (3, 4, 5, 8) and k_shape == v_shape == (3, 2, 5, 8)
        assert q_pos is None and kv_pos is None and q_doc is None  # plain rows: no index tensors
    calls.clear()
    index = torch.tensor([[0, 1, 2, 7, 9]] * 3)
    model(tokens_for(3, 5), sequence_index=index)
    for _, _, _, q_pos, kv_pos, _ in calls:
        assert q_pos.tolist() == kv_pos.tolist() == index.tolist()


def test_plain_rows_take_the_causal_kernel_with_the_masked_result():
    """No positions: SDPA's causal kernel, grouped heads not repeated; equal to the explicit mask
    over repeated heads, written out here."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g)
    k, v = torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / 8 ** 0.5
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    expected = scores.softmax(-1) @ v.repeat_interleave(2, dim=1)
    got = causal_attention(q, k, v, q_pos=None, kv_pos=None)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    pos = torch.arange(6).expand(2, -1)
    torch.testing.assert_close(causal_attention(q, k, v, q_pos=pos, kv_pos=pos), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="pass both q_pos and kv_pos, or neither"):
        causal_attention(q, k, v, q_pos=pos, kv_pos=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["causal", "packed", "cp_chunk", "gqa_packed_cp"])
def test_chunked_masked_attention_matches_explicit_mask(monkeypatch, kind: str, dtype: torch.dtype):
    """The masked path in query chunks of 5 rows (recomputed in backward) against one explicit
    [Sq, Skv] mask over repeated heads, written out here: output and every input gradient."""
    from dtensor_mimo.models import layers

    monkeypatch.setattr(layers, "ATTENTION_QUERY_CHUNK", 5)
    g = torch.Generator().manual_seed(1)
    s, hq, hkv = 16, 4, (2 if kind.startswith("gqa") else 4)
    kv_pos = torch.arange(s).expand(2, s)
    docs = torch.cat([torch.zeros(7, dtype=torch.long), torch.ones(9, dtype=torch.long)]).expand(2, s)
    # cp: this rank's zigzag chunk of the queries (columns 0-3 and 12-15) against every key
    cols = torch.cat([torch.arange(4), torch.arange(12, 16)]) if "cp" in kind else torch.arange(s)
    q_pos = kv_pos[:, cols]
    q_doc, kv_doc = (docs[:, cols], docs) if "packed" in kind else (None, None)
    q = torch.randn(2, hq, len(cols), 8, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(2, hkv, s, 8, generator=g).to(dtype).requires_grad_() for _ in range(2))
    out = causal_attention(q, k, v, q_pos=q_pos, kv_pos=kv_pos, q_doc=q_doc, kv_doc=kv_doc)
    grad = torch.randn(out.shape, generator=g).to(dtype)
    out.backward(grad)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    mask = kv_pos.unsqueeze(1) <= q_pos.unsqueeze(2)
    if q_doc is not None:
        mask &= kv_doc.unsqueeze(1) == q_doc.unsqueeze(2)
    scores = q64 @ k64.repeat_interleave(hq // hkv, 1).transpose(-1, -2) / 8 ** 0.5
    expected = scores.masked_fill(~mask.unsqueeze(1), float("-inf")).softmax(-1) @ v64.repeat_interleave(hq // hkv, 1)
    expected.backward(grad.double())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=3e-2)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **tol)
    for name, got, want in (("q", q, q64), ("k", k, k64), ("v", v, v64)):
        torch.testing.assert_close(got.grad.double(), want.grad, **tol, msg=lambda m: f"grad {name}: {m}")


def shard_heads(attn: nn.Module, rank: int, tp: int) -> nn.Module:
    """The module a tensor-parallel rank holds: wq/wk/wv colwise (whole heads), wo rowwise,
    wo's bias left to be added once after the sum over ranks."""
    shard = copy.deepcopy(attn)
    for name in ("wq", "wk", "wv"):
        linear = getattr(shard, name)
        linear.weight = nn.Parameter(linear.weight.chunk(tp, dim=0)[rank])
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias.chunk(tp)[rank])
    shard.wo.weight = nn.Parameter(shard.wo.weight.chunk(tp, dim=1)[rank])
    shard.wo.bias = None
    return shard


def test_llama_attention_runs_on_a_head_shard():
    model = llama64()
    attn = model.layers["0"].attention
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    index = torch.arange(6).expand(2, 6)
    rope = rope_tables(*rope_cos_sin(index, model.config.head_dim, model.config.rope_theta, torch.float64))
    summed = sum(shard_heads(attn, r, 2)(x, rope, index, None) for r in range(2))
    torch.testing.assert_close(summed, attn(x, rope, index, None))


def test_llama_pipeline_stages_equal_whole_model():
    model = llama64(n_layers=3)
    stage0, stage1 = copy.deepcopy(model), copy.deepcopy(model)
    del stage0.layers["2"]
    stage0.norm, stage0.output = None, None
    del stage1.layers["0"], stage1.layers["1"]
    stage1.tok_embeddings = None
    assert list(stage1.state_dict())[0].startswith("layers.2.")  # names of the whole model kept

    tokens = tokens_for(2, 8)
    positions, document_ids = packed_positions([5, 3])
    kwargs = dict(positions=positions.expand(2, 8), document_ids=document_ids.expand(2, 8))
    hidden = stage0(tokens, **kwargs)
    assert hidden.shape == (2, 8, 32)
    torch.testing.assert_close(stage1(hidden, **kwargs), model(tokens, **kwargs))


def test_init_weights_depends_only_on_seed_and_names():
    torch.manual_seed(0)
    whole = Llama(LlamaConfig.tiny(n_layers=3))
    whole.init_weights(seed=7)
    torch.manual_seed(1)  # different default init; init_weights must overwrite all of it
    stage = Llama(LlamaConfig.tiny(n_layers=3)).double()
    del stage.layers["0"]
    stage.tok_embeddings = None
    stage.init_weights(seed=7)
    reference = dict(whole.named_parameters())
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p, reference[name].double(), msg=name)

    other = Llama(LlamaConfig.tiny(n_layers=3))
    other.init_weights(seed=8)
    assert not torch.equal(other.output.weight, whole.output.weight)
    assert torch.equal(whole.norm.weight, torch.ones(32))
    assert torch.equal(whole.layers["0"].ffn_norm.weight, torch.ones(32))
    assert abs(whole.output.weight.std().item() - 0.02) < 0.002  # 2048 samples


def test_init_weights_draws_rows_in_independent_blocks(monkeypatch):
    """With row blocks (small `INIT_BLOCK_ELEMENTS`), each block is its own draw — the weights
    still look like one normal sample — and a parameter of one block is the same as before."""
    from dtensor_mimo.models import layers

    one_block = Llama(LlamaConfig.tiny())
    one_block.init_weights(seed=3)
    monkeypatch.setattr(layers, "INIT_BLOCK_ELEMENTS", 64)  # 2 rows of 32 per block
    blocks = Llama(LlamaConfig.tiny())
    blocks.init_weights(seed=3)
    w = blocks.tok_embeddings.weight  # [64, 32]: 32 blocks
    assert torch.equal(w[:2], one_block.tok_embeddings.weight[:2])  # block 0: the same generator
    assert not torch.equal(w[2:], one_block.tok_embeddings.weight[2:])
    assert not any(torch.equal(w[2 * i:2 * i + 2], w[2 * i + 2:2 * i + 4]) for i in range(31))
    assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002


def test_init_weights_is_the_same_drawn_on_one_thread_or_many(monkeypatch):
    """The row blocks are drawn on `init_threads()` threads at once: the values do not depend on
    how many, and block b of a parameter is the documented draw of its own generator."""
    from dtensor_mimo.models import layers

    monkeypatch.setattr(layers, "INIT_BLOCK_ELEMENTS", 64)  # 2 rows of 32 per block
    built = {}
    for threads in (1, 4):
        monkeypatch.setattr(layers, "init_threads", lambda: threads)
        built[threads] = Llama(LlamaConfig.tiny())
        built[threads].init_weights(seed=3)
    many = dict(built[4].named_parameters())
    for name, p in built[1].named_parameters():
        assert torch.equal(p, many[name]), name
    seed = layers._parameter_seed(3, "tok_embeddings.weight")
    block_1 = torch.randn((2, 32), generator=torch.Generator().manual_seed((seed * 1_000_003 + 1) % 2**63))
    assert torch.equal(many["tok_embeddings.weight"][2:4], block_1 * 0.02)


# ---------------------------------------------------------------------------------------------
# ViT, audio, projection
# ---------------------------------------------------------------------------------------------


def vit64(seed: int = 0, **overrides) -> ViT:
    return randomize(ViT(ViTConfig.tiny(**overrides)).double(), seed)


def audio64(seed: int = 0, **overrides) -> AudioEncoder:
    return randomize(AudioEncoder(AudioConfig.tiny(**overrides)).double(), seed)


def random_images(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, 16, 16, generator=g, dtype=torch.float64)


def test_vit_shapes_and_patch_order():
    model = vit64(n_layers=0)  # patch embedding + positions + final norm only
    images = random_images(3)
    out = model(images)
    assert out.shape == (3, model.config.num_patches, 32) == (3, 16, 32)
    # Reference: cut the 4x4 patches by hand, row-major over the 4x4 grid of patches.
    grid = [(i, j) for i in range(4) for j in range(4)]
    patches = torch.stack(
        [images[:, :, 4 * i : 4 * i + 4, 4 * j : 4 * j + 4].flatten(1) for i, j in grid], dim=1
    )  # [N, 16, C*4*4]
    conv = model.patch_embed
    x = patches @ conv.weight.flatten(1).T + conv.bias + model.pos_embed
    expected = F.layer_norm(x, (32,), model.norm.weight, model.norm.bias, model.config.norm_eps)
    torch.testing.assert_close(out, expected)


def test_vit_items_are_independent_and_attention_is_bidirectional():
    model = vit64()
    images = random_images(3)
    out = model(images)
    for i in range(3):
        torch.testing.assert_close(out[i], model(images[i : i + 1])[0])
    assert model(images[:0]).shape == (0, 16, 32)  # a data-parallel rank with no images
    changed = images.clone()
    changed[:, :, -4:, -4:] += 1.0  # the last patch
    assert not torch.allclose(model(changed)[:, 0], out[:, 0])


def test_vit_attention_runs_on_a_head_shard():
    attn = vit64().layers["0"].attn
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    summed = sum(shard_heads(attn, r, 2)(x) for r in range(2)) + attn.wo.bias
    torch.testing.assert_close(summed, attn(x))


@pytest.mark.parametrize("strides", [(1, 2), (2, 2)])
def test_audio_output_length_matches_encoder(strides):
    model = audio64(conv_strides=strides)
    for t in [1, 2, 7, 8, 31, 32]:
        mels = torch.randn(2, 8, t, dtype=torch.float64)
        assert model(mels).shape == (2, model.config.output_length(t), 32)
    assert AudioConfig(conv_strides=(1, 2)).output_length(3000) == 1500  # Whisper's 1500 tokens
    with pytest.raises(ValueError, match=r"conv_strides=\(2,\) must be two strides >= 1"):
        AudioConfig(conv_strides=(2,))
    with pytest.raises(ValueError, match="max_frames=32"):
        model(torch.randn(1, 8, 33, dtype=torch.float64))


def test_audio_clips_are_independent():
    model = audio64()
    mels = torch.randn(3, 8, 20, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = model(mels)
    for i in range(3):
        torch.testing.assert_close(out[i], model(mels[i : i + 1])[0])
    assert model(mels[:0]).shape == (0, 10, 32)


@pytest.mark.parametrize("make, items", [(vit64, lambda: random_images(3)),
                                         (audio64, lambda: torch.randn(3, 8, 20, dtype=torch.float64))],
                         ids=["vit", "audio"])
def test_items_of_another_dtype_are_taken_in_the_weights_dtype(make, items):
    """One tensor of items in another dtype than the weights (float32 items, float64 weights here;
    float64 from numpy or uint8 pixels for a float32 model) gives the rows of the items cast, as a
    list of them (the packed path) always did; it raised before, on the ranks holding items only."""
    model, x = make(), items().float()
    torch.testing.assert_close(model(x), model(x.double()))
    torch.testing.assert_close(model(x).flatten(0, 1), model(list(x)))


def test_projection_is_linear_gelu_linear():
    proj = randomize(Projection(16, 32, hidden_dim=24).double(), 0)
    x = torch.randn(5, 16, dtype=torch.float64)
    hidden = x @ proj.fc1.weight.T + proj.fc1.bias
    expected = 0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2)))  # exact GELU
    torch.testing.assert_close(proj(x), expected @ proj.fc2.weight.T + proj.fc2.bias)
    assert Projection(16, 32).fc1.out_features == 32


@pytest.mark.parametrize(
    "name, model, inputs",
    [
        ("llama", lambda: llama64(), lambda: (tokens_for(2, 6),)),
        ("vit", lambda: vit64(), lambda: (torch.randn(2, 3, 16, 16, dtype=torch.float64),)),
        ("audio", lambda: audio64(), lambda: (torch.randn(2, 8, 12, dtype=torch.float64),)),
        ("projection", lambda: Projection(8, 16).double(), lambda: (torch.randn(3, 8).double(),)),
    ],
)
def test_gradients_reach_every_parameter(name, model, inputs):
    module = model()
    module.init_weights(seed=0)  # the realistic init, not the randomized one
    out = module(*inputs())
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    (out * weights).sum().backward()
    for pname, p in module.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}: no gradient for {pname}"


def test_greedy_generate_on_packed_rows_continues_the_prompts_document():
    """`greedy_generate` on a packed batch (document ids and per-document positions, the
    padding a document of its own, as the conversation packer lays rows out): each new token
    continues its prompt's document at the next position, so the ids equal a greedy loop over
    the prompt's own document alone (the model fed the growing document, nothing packed)."""
    from dtensor_mimo.data import MimoBatch
    from dtensor_mimo.sequence import greedy_generate

    model = llama64()
    seq, new = 16, 4
    # row 0: one prompt of 5 tokens, then padding; row 1: a 4-token document, then a 6-token prompt
    layouts, prompts = [[5], [4, 6]], [5, 10]
    tokens = tokens_for(2, seq, seed=3)
    documents, positions = torch.zeros(2, seq, dtype=torch.int64), torch.zeros(2, seq, dtype=torch.int64)
    for row, lengths in enumerate(layouts):
        pos, doc = packed_positions(lengths + [seq - sum(lengths)])  # the padding: a document of its own
        positions[row], documents[row] = pos, doc
    batch = MimoBatch(tokens, torch.full((2, seq), -100), torch.zeros(2, seq), document_ids=documents,
                      positions=positions)

    def predict(b: MimoBatch) -> torch.Tensor:
        with torch.no_grad():
            return model(b.tokens, positions=b.positions, document_ids=b.document_ids).argmax(-1)

    want = []
    for row, lengths in enumerate(layouts):
        doc = tokens[row:row + 1, prompts[row] - lengths[-1]:prompts[row]]  # the prompt's own document
        ids = []
        for _ in range(new):
            with torch.no_grad():
                ids.append(int(model(doc)[0, -1].argmax()))
            doc = torch.cat([doc, torch.tensor([[ids[-1]]])], dim=1)
        want.append(ids)
    assert greedy_generate(predict, batch, prompts, new) == want
