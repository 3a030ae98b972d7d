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

Attention core cases check the output and dq, dk, dv; Llama cases the local logits, the loss sum
and every parameter gradient. (*) 2-3 documents per row, rotary positions restarting at each,
document_ids, a loss mask on each document's last token.

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
