"""Context-parallel attention (`ContextParallelAttention`) is exact: a cp run equals one process.

Every case runs the same data (fp64) once on the full sequence with the single-process
`causal_attention` / `Llama` (the reference, computed on each rank) and once context-parallel,
each cp rank holding its zigzag columns. Expected rows of a rank are selected with an
independent one-line rule (column c is kept by rank r when its chunk c // (S / 2cp) is r or
2cp−1−r), not with the sharding code under test.

| case                     | world | cp groups (ranks) | group given as | data                              |
|--------------------------|-------|-------------------|----------------|-----------------------------------|
| attention core, cp2      | 2     | [0,1]             | ProcessGroup   | GQA 4q/2kv heads, S 16; ± docs    |
| attention core, cp4      | 4     | [0,1,2,3]         | ProcessGroup   | same; ± docs                      |
| attention core, dp2·cp2  | 4     | [0,1], [2,3]      | mesh["cp"]     | other data per dp replica; docs   |
| tiny Llama, cp2          | 2     | [0,1]             | ProcessGroup   | token ids; rotary pos = global    |
| tiny Llama, packed, cp2  | 2     | [0,1]             | ProcessGroup   | embeddings, packed rows (*)       |
| tiny Llama, packed, cp4  | 4     | [0,1,2,3]         | ProcessGroup   | same                              |

| MimoModel, items by hand | 4     | cp2, cp4, tp2·cp2 + sp | the layout     | item spans across cp chunks (**)  |

Attention core cases check the output and dq, dk, dv; Llama cases the local logits, the loss sum
and every parameter gradient. (*) 2-3 documents per row, rotary positions restarting at each,
document_ids, a loss mask on each document's last token. (**) `test_mimo_items_across_cp_chunks`:
the loss and every gradient of a `MimoModel` step against one process (fp32), two modalities of
a user's encoder, packed rows, an item of no tokens and a row of items only.

In the Llama cases each rank's loss is the token sum of cross-entropy over its own rows; the
parameter gradients are all-reduced over the cp group (as FSDP/DDP over dp·cp would) and must
equal the single-process gradients of the summed loss.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from dtensor_mimo.models import Llama, LlamaConfig, causal_attention
from dtensor_mimo.sequence import ContextParallelAttention, shard_for_cp
from tests.harness import run_on_ranks

TIMEOUT = 120
TOL = dict(rtol=1e-10, atol=1e-12)  # fp64: the only differences are summation order


def _kept_columns(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    chunk = seq_len // (2 * cp)
    return torch.tensor([c for c in range(seq_len) if c // chunk in (rank, 2 * cp - 1 - rank)])


def _cp_groups(groups: list[list[int]], as_mesh: bool):
    """(cp group or mesh, cp rank, cp size, index of this rank's group, groups to destroy).

    Every rank builds every group, in the same order (new_group is collective over the world).
    """
    rank = dist.get_rank()
    mine = next(i for i, ranks in enumerate(groups) if rank in ranks)
    cp_rank, cp = groups[mine].index(rank), len(groups[mine])
    if as_mesh:
        mesh = init_device_mesh("cpu", (len(groups), cp), mesh_dim_names=("dp", "cp"))
        return mesh["cp"], cp_rank, cp, mine, []
    created = [dist.new_group(ranks) for ranks in groups]
    return created[mine], cp_rank, cp, mine, created


def _packed_documents(lengths_per_row: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotary positions restarting at each document, document ids), each [B, S]."""
    positions = [torch.cat([torch.arange(n) for n in row]) for row in lengths_per_row]
    docs = [torch.cat([torch.full((n,), d) for d, n in enumerate(row)]) for row in lengths_per_row]
    return torch.stack(positions), torch.stack(docs)


# --------------------------------------------------------------------------------------------
# (a) the attention core on random q, k, v
# --------------------------------------------------------------------------------------------


def _attention_case(groups: list[list[int]], as_mesh: bool, with_docs: bool) -> float:
    group, cp_rank, cp, mine, created = _cp_groups(groups, as_mesh)
    b, hq, hkv, s, d = 2, 4, 2, 16, 8
    gen = torch.Generator().manual_seed(100 + mine)  # same data within a cp group
    q, k, v, grad_out = (
        torch.randn(b, h, s, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv, hq)
    )
    pos = torch.arange(s).expand(b, s)
    docs = _packed_documents([[5, 3, 8], [9, 7]])[1] if with_docs else None

    # Reference: one process, full sequence.
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = causal_attention(*ref, q_pos=pos, kv_pos=pos, q_doc=docs, kv_doc=docs)
    (out_ref * grad_out).sum().backward()

    cols = _kept_columns(s, cp, cp_rank)
    local = [t[:, :, cols].clone().requires_grad_() for t in (q, k, v)]
    local_docs = docs[:, cols] if with_docs else None
    attention = ContextParallelAttention(group)
    out = attention(*local, q_pos=pos[:, cols], kv_pos=pos[:, cols],
                    q_doc=local_docs, kv_doc=local_docs)
    (out * grad_out[:, :, cols]).sum().backward()

    torch.testing.assert_close(out, out_ref[:, :, cols], **TOL)
    for name, mine_t, full in zip("qkv", local, ref):
        torch.testing.assert_close(mine_t.grad, full.grad[:, :, cols], **TOL,
                                   msg=lambda m, name=name: f"d{name}: {m}")
    for g in created:
        dist.destroy_process_group(g)
    return (out - out_ref[:, :, cols]).abs().max().item()


@pytest.mark.parametrize("with_docs", [False, True], ids=["causal", "documents"])
def test_attention_core_cp2(with_docs):
    run_on_ranks(_attention_case, 2, [[0, 1]], False, with_docs, timeout=TIMEOUT)


@pytest.mark.parametrize(
    "groups, as_mesh, with_docs",
    [
        ([[0, 1, 2, 3]], False, False),
        ([[0, 1, 2, 3]], False, True),
        ([[0, 1], [2, 3]], True, True),
    ],
    ids=["cp4", "cp4-documents", "dp2xcp2-mesh-documents"],
)
def test_attention_core_4_ranks(groups, as_mesh, with_docs):
    run_on_ranks(_attention_case, 4, groups, as_mesh, with_docs, timeout=TIMEOUT)


# --------------------------------------------------------------------------------------------
# (b, c) a whole tiny Llama, plain and packed
# --------------------------------------------------------------------------------------------


def _tiny_llama() -> Llama:
    model = Llama(LlamaConfig.tiny())
    model.init_weights(seed=0)  # same weights on every rank and in the reference
    return model.double()


def _token_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None
                ) -> torch.Tensor:
    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    if mask is not None:
        per_token = per_token * mask.flatten().to(per_token.dtype)
    return per_token.sum()


def _llama_case(groups: list[list[int]], packed: bool) -> float:
    group, cp_rank, cp, _, created = _cp_groups(groups, as_mesh=False)
    b, s = 2, 16
    gen = torch.Generator().manual_seed(7)
    stream = torch.randint(0, LlamaConfig.tiny().vocab_size, (b, s + 1), generator=gen)
    tokens, labels = stream[:, :-1], stream[:, 1:]  # shifted on the full row, before sharding
    if packed:
        lengths = [[5, 3, 8], [7, 9]]
        positions, docs = _packed_documents(lengths)
        # A document's last token would predict the next document's first: not a target.
        mask = torch.ones(b, s, dtype=torch.bool)
        for row, row_lengths in enumerate(lengths):
            mask[row, torch.tensor(row_lengths).cumsum(0) - 1] = False
    else:
        positions = docs = mask = None

    reference = _tiny_llama()
    ref_logits = reference(tokens, positions=positions, document_ids=docs)
    ref_loss = _token_loss(ref_logits, labels, mask)
    ref_loss.backward()

    model = _tiny_llama()
    model.set_attention_fn(ContextParallelAttention(group))
    if packed:  # the MIMO path: embeddings assembled on the full row, then sharded
        shard = shard_for_cp(cp, cp_rank, embeddings=model.tok_embeddings(tokens), labels=labels,
                             loss_mask=mask, positions=positions, document_ids=docs)
        logits = model(h=shard.embeddings, positions=shard.positions,
                       document_ids=shard.document_ids, sequence_index=shard.sequence_index)
    else:  # token ids sharded; rotary positions default to the global sequence index
        shard = shard_for_cp(cp, cp_rank, tokens=tokens, labels=labels)
        logits = model(shard.tokens, sequence_index=shard.sequence_index)
    loss = _token_loss(logits, shard.labels, shard.loss_mask)
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, group=group)
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)

    cols = _kept_columns(s, cp, cp_rank)
    torch.testing.assert_close(logits, ref_logits[:, cols], **TOL)
    torch.testing.assert_close(total, ref_loss.detach(), **TOL)
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, **TOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
    for g in created:
        dist.destroy_process_group(g)
    return (total - ref_loss).abs().item()


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_llama_cp2(packed):
    run_on_ranks(_llama_case, 2, [[0, 1]], packed, timeout=TIMEOUT)


def test_llama_packed_cp4():
    run_on_ranks(_llama_case, 4, [[0, 1, 2, 3]], True, timeout=TIMEOUT)


# --------------------------------------------------------------------------------------------
# (d) the whole MimoModel at cp > 1 with items placed by hand against one process
# --------------------------------------------------------------------------------------------
# Rows of 16 (cp2: chunks of 4, rank 0 keeps 0-3 and 12-15; cp4: chunks of 2): per sample its
# items ``(start, length[, modality])`` in row order (length 0: an item with no tokens) and where
# its documents start. Item spans cross chunk boundaries (2-5 over 3|4, 10-13 over 11|12), a row
# is all items, tokens per item differ per sample and per microbatch, audio interleaves vision.
MIMO_IDS = {"vision": 64, "audio": 65}
MIMO_ROWS = [
    ([(2, 4), (None, 0), (10, 4, "audio"), (14, 1)], [8]),
    ([(0, 9), (9, 7, "audio")], []),
    ([(None, 0), (5, 3, "audio"), (8, 1)], [4, 12]),
    ([], [6]),
]


class _RowEncoder(torch.nn.Module):
    """A user's encoder: item ``[tokens_i, 6]`` -> its rows ``[tokens_i, dim]``."""

    def __init__(self) -> None:
        super().__init__()
        self.out_dim = LlamaConfig.tiny().dim
        self.proj = torch.nn.Linear(6, self.out_dim)

    def forward(self, items):
        return torch.cat([self.proj(x) for x in items]) if items else self.proj(self.proj.weight.new_zeros(0, 6))

    def tokens_per_item(self, shape):
        return shape[0]

    def init_weights(self, seed: int) -> None:
        from dtensor_mimo.models import init_weights
        init_weights(self, seed)


def _mimo_modules():
    llama = Llama(LlamaConfig.tiny())
    llama.init_weights(1)
    encoders = {n: _RowEncoder() for n in MIMO_IDS}
    for i, e in enumerate(encoders.values()):
        e.init_weights(5 + i)
    return llama, encoders


def _mimo_batch(seq_len: int = 16):
    from dtensor_mimo.data import IGNORE_INDEX, MimoBatch, ModalityInputs
    g = torch.Generator().manual_seed(3)
    b = len(MIMO_ROWS)
    tokens = torch.randint(0, 64, (b, seq_len), generator=g)
    docs = torch.zeros(b, seq_len, dtype=torch.int64)
    inputs, counts, per_item = ({n: [] for n in MIMO_IDS} for _ in range(3))
    for r, (items, starts) in enumerate(MIMO_ROWS):
        for n in MIMO_IDS:
            counts[n].append(0)
        for start, length, *name in items:
            name = name[0] if name else "vision"
            if length:
                tokens[r, start:start + length] = MIMO_IDS[name]
            inputs[name].append(torch.randn(length, 6, generator=g))
            per_item[name].append(length)
            counts[name][-1] += 1
        for s in starts:
            docs[r, s:] += 1
    column = torch.arange(seq_len).expand(b, seq_len)
    first = torch.where(torch.cat([torch.ones(b, 1, dtype=torch.bool), docs[:, 1:] != docs[:, :-1]], 1), column, 0)
    positions = column - first.cummax(1).values
    labels = torch.full((b, seq_len), IGNORE_INDEX, dtype=torch.int64)  # targets at item positions too
    labels[:, :-1] = torch.where(docs[:, 1:] == docs[:, :-1], torch.randint(0, 64, (b, seq_len - 1), generator=g),
                                 IGNORE_INDEX)
    modalities = {n: ModalityInputs(inputs[n], tuple(counts[n]), tuple(per_item[n]), MIMO_IDS[n]) for n in MIMO_IDS}
    return MimoBatch(tokens, labels, (labels != IGNORE_INDEX).float(), modalities, docs, positions)


def _mimo_reference(batch):
    from dtensor_mimo.assemble import assemble, embed_text
    from dtensor_mimo.data import IGNORE_INDEX
    llama, encoders = _mimo_modules()
    ids = batch.special_token_ids
    rows = {n: encoders[n](m.inputs) for n, m in batch.modalities.items()}
    h = assemble(embed_text(llama.tok_embeddings, batch.tokens, ids), batch.tokens, rows, ids)
    logits = llama(h=h, positions=batch.positions, document_ids=batch.document_ids)
    loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    loss = loss / (batch.labels != IGNORE_INDEX).sum()
    loss.backward()
    grads = {f"language.{n}": p.grad for n, p in llama.named_parameters()}
    grads.update({f"{m}.{n}": p.grad for m, e in encoders.items() for n, p in e.named_parameters()})
    return loss.item(), grads


def _mimo_case(modules, offsets, options, microbatches, batch):
    from torch.distributed.tensor import DTensor

    from dtensor_mimo import MimoLayout, MimoModel, PipelineConfig
    layout = MimoLayout(modules, offsets=offsets)
    layout.init_meshes("cpu")
    llama, encoders = _mimo_modules()
    model = MimoModel(layout, llama, encoders, options=options, pipeline=PipelineConfig(microbatches=microbatches))
    share = model.forward_backward(batch)
    model.reduce_gradients()
    loss = share.double().reshape(1) if model.holds_loss_share() else torch.zeros(1, dtype=torch.float64)
    dist.all_reduce(loss)
    return loss.item(), {f"{m}.{n}": None if p.grad is None else
                         (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                         for m in model.module_names for n, p in model.module_parameters(m).items()}


@pytest.mark.parametrize("case", ["cp2_microbatches_balanced", "cp4_colocated", "cp2_tp2_sp"])
def test_mimo_items_across_cp_chunks(case):
    """Loss and every gradient of a MimoModel step = one process, with item spans across the cp
    chunks (zigzag pairs chunk 0 and 2cp-1 on one rank), packed documents, an item of no tokens,
    a row of items only, tokens per item differing per sample and microbatch, two modalities."""
    from dtensor_mimo import ParallelOptions, Parallelism as P
    modules, offsets, options, microbatches = {
        "cp2_microbatches_balanced": ({"vision": P(dp=2), "audio": P(dp=2), "language": P(cp=2)},
                                      {"vision": 0, "audio": 0, "language": 2},
                                      {"vision": ParallelOptions(balance=True)}, 2),
        "cp4_colocated": ({"vision": P(dp=4), "audio": P(dp=4), "language": P(cp=4)},
                          {"vision": 0, "audio": 0, "language": 0}, {}, 1),
        "cp2_tp2_sp": ({"vision": P(dp=4), "audio": P(dp=4), "language": P(cp=2, tp=2)},
                       {"vision": 0, "audio": 0, "language": 0}, {"language": ParallelOptions(sp=True)}, 2),
    }[case]
    batch = _mimo_batch()
    want_loss, want = _mimo_reference(batch)
    world = max(offsets[n] + modules[n].size for n in modules)
    seen = set()
    for loss, grads in run_on_ranks(_mimo_case, world, modules, offsets, options, microbatches, batch,
                                    timeout=TIMEOUT):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        seen |= grads.keys()  # a rank holds the modules whose mesh it is on
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want[name], rtol=2e-5, atol=2e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert seen == want.keys()
