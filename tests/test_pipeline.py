"""Pipelined MIMO training against the single-process reference (`tests/test_mimo.py`'s oracle).

Every case: 8 samples per global batch with ragged image counts (0-2) and text-only samples,
4 microbatches (unless noted), 3 steps; loss, grad norm, every gradient and every post-step weight compared.
The language model has 4 layers (so 2 x 2 virtual stages fit).

| case            | vision (ranks)   | language (ranks)          | world | schedule             | notes                         |
|-----------------|------------------|---------------------------|-------|----------------------|-------------------------------|
| pp2             | dp1 (0)          | pp2 (1-2)                 | 3     | 1F1B                 | overlapped; predict; head on loss rows only |
| dp2_pp2         | dp2 (0-1)        | pp2 (2-3)                 | 4     | 1F1B                 | overlapped, FSDP2 vision      |
| varied_pp2      | dp2 (0-1)        | pp2 (2-3)                 | 4     | 1F1B                 | images of own sizes, balanced per microbatch, lean window |
| tp_sp_pp2       | dp2 (0-1)        | tp2·pp2 + sp (2-5)        | 6     | 1F1B                 | overlapped, meta; head on loss rows only |
| fan_in_pp2_dp2  | dp3 (0-2)        | pp2·dp2 (3-6)             | 7     | GPipe                | dp 3 -> 2 per microbatch; no FSDP2: dp sums during backward |
| interleaved     | dp2 (0-1)        | pp2, 2 virtual (2-3)      | 4     | Interleaved1F1B      | compiled stages, meta; head on loss rows only |
| interleaved_dp2 | dp1 (0)          | pp2·dp2, 2 virtual (1-4)  | 5     | Interleaved1F1B      | two FSDP2 stages a rank, each reduce-scattering in its last backward |
| coloc_pp2_dp2   | dp4 (0-3)        | pp2·dp2 (0-3)             | 4     | 1F1B                 | colocated three phases; no FSDP2: dp sums during backward |
| coloc_hsdp      | dp4 HSDP 2x2 (0-3) | pp2·dp2 HSDP 2x1 (0-3)  | 4     | 1F1B                 | colocated; FSDP2 shards within replica groups, all-reduces across them in each stage's last backward |
| coloc_recompute | dp4 (0-3)        | pp2·dp2 (0-3)             | 4     | 1F1B                 | colocated, vision graphs freed (`recompute_colocated`), FSDP2 |
| coloc_pp1_recompute | dp2 (0-1)    | dp2 (0-1)                 | 2     | one stage, 4 mb      | colocated at pp = 1, graphs freed |
| coloc_recompute_varied | dp2 (0-1) | dp2 (0-1)                 | 2     | one stage, 4 mb      | colocated at pp = 1, graphs freed, images of own sizes (a list per microbatch) |
| coloc_two_recompute | dp2 (0-1) + audio dp2 (0-1) | dp2 (0-1)  | 2     | one stage, 4 mb      | two recomputed encoders: vision reduced once (FSDP2), audio summed during its last backward |
| cp_pp2          | dp2 (0-1)        | cp2·pp2 (2-5)             | 6     | 1F1B                 | packed rows, Partial gradient, meta |
| two_hop_cp_pp2  | tp2 (0-1)        | cp2·pp2 (2-5)             | 6     | 1F1B                 | two hops per crossing: cp all-gather, cp reduce-scatter, vision tp all-gather |
| tp_enc_pp2      | tp2 (0-1)        | pp2 (2-3)                 | 4     | 1F1B                 | the tp encoder per microbatch, some of them without images (zero items) |
| overlap_pp1     | dp2 (0-1)        | dp2 (2-3)                 | 4     | 1F1B (one stage)     | pp = 1, microbatches overlap; step 1 text only; no FSDP2: dp sums during backward |
| frozen_vision   | dp2 (0-1), frozen| pp2 (2-3)                 | 4     | 1F1B                 | three phases, no backward crossing |
| vision_pp2      | pp2 (0-1)        | pp2 (2-3)                 | 4     | 1F1B (vision GPipe)  | encoder stages, items padded  |
| vision_pp2_dp2  | pp2·dp2 (0-3)    | dp1 (4)                   | 5     | 1F1B (one stage)     | encoder stages + FSDP, fan-in, meta |
| vision_pp2_dp2_summed | pp2·dp2 (0-3) | dp1 (4)                | 5     | 1F1B (one stage)     | the same without FSDP2: dp sums during the stages' backward |
| vision_pp2_1mb  | pp2 (0-1)        | dp1 (2)                   | 3     | GPipe, 1 microbatch  | encoder stages without overlap|
| vision_pp2_frozen_vit | pp2 (0-1), ViT frozen | pp2 (2-3)      | 4     | 1F1B (vision GPipe)  | stage 0: frozen blocks only |
| looped_bfs      | dp2 (0-1)        | pp2, 2 virtual (2-3)      | 4     | LoopedBFS            | backwards last microbatch first|
| zero_bubble     | dp1 (0)          | pp2, 2 virtual (1-2)      | 3     | InterleavedZeroBubble| split backward, eager; 8 microbatches (crossing window 4) |
| zero_bubble_fsdp | dp1 (0)         | pp2·dp2, 2 virtual (1-4)  | 5     | InterleavedZeroBubble| the same at dp2 with FSDP2, parameters kept gathered from forward to backward (resharded after forward: refused) |
| zero_bubble_summed | dp1 (0)       | pp2·dp2, 2 virtual (1-4)  | 5     | InterleavedZeroBubble| the same at dp2 without FSDP2: split weight backward, dp sums after it |
| length_buckets  | dp2 (0-1)        | pp2 (2-3)                 | 4     | 1F1B                 | sequence 64, 32, 64 per step  |
| zbv             | dp1 (0)          | pp2, 2 virtual, V (1-2)   | 3     | ZBVZeroBubble        | stages 0,3 / 1,2: crossings and loss on pp rank 0; predict; 8 microbatches (window 4); head on loss rows only |
| dualpipev       | dp2 (0-1)        | pp2, 2 virtual, V (2-3)   | 4     | DualPipeV            | V placement, fan-in per microbatch |
| zbv_tp_sp       | dp4 (0-3)        | pp2·tp2 + sp, 2 virtual, V (0-3) | 4 | ZBVZeroBubble   | colocated; each stage's output a view (sp's gather), which torch's input pass detaches in place |
| user_decoder_pp2| dp1 (0)          | pp2 (1-2), `UserDecoder`  | 3     | 1F1B                 | a user's decoder split into its own stages, meta; predict |
| user_decoder_tp2| dp4 (0-3)        | pp2·tp2 (0-3), `UserDecoder` | 4  | GPipe                | colocated; the user's tp plan on each stage |
"""

from __future__ import annotations

import dataclasses

import pytest

from dtensor_mimo import ParallelOptions, Parallelism, PipelineConfig
from dtensor_mimo.schedule.config import ZERO_BUBBLE_SCHEDULES
from tests.harness import needs_torch
from tests.test_mimo import Case, check_against_reference, check_encoded_shares, check_hsdp_meshes, check_route

P = Parallelism
MB4 = PipelineConfig(microbatches=4)
# Without FSDP2: dp sums by `GradientReducer`, in buckets of about 1 KiB (a parameter or two
# each), most of them launched while the module's last backward runs.
NO_FSDP = dict(fsdp=False, grad_bucket_mb=1 / 1024)
SUMMED = {n: ParallelOptions(**NO_FSDP) for n in ("vision", "language")}


def _case(vision: Parallelism, language: Parallelism, pipeline: PipelineConfig = MB4, **kw) -> Case:
    return Case({"vision": vision, "language": language}, pipeline=pipeline, batch_size=8, n_layers=4, **kw)


CASES = {
    "pp2": _case(P(), P(pp=2), predict=True, loss_chunk_rows=16),
    "dp2_pp2": _case(P(dp=2), P(pp=2)),
    "varied_pp2": _case(P(dp=2), P(pp=2), varied=True),
    "tp_sp_pp2": _case(P(dp=2), P(pp=2, tp=2), options={"language": ParallelOptions(sp=True)}, meta=True,
                       loss_chunk_rows=16),
    "fan_in_pp2_dp2": _case(P(dp=3), P(pp=2, dp=2), PipelineConfig(microbatches=4, schedule="GPipe"),
                            options=SUMMED),
    "interleaved": _case(P(dp=2), P(pp=2), PipelineConfig(microbatches=4, schedule="Interleaved1F1B",
                                                          virtual_stages=2),
                         options={"language": ParallelOptions(compile=True, compile_backend="aot_eager")},
                         meta=True, loss_chunk_rows=16),
    "interleaved_dp2": _case(P(), P(pp=2, dp=2), PipelineConfig(microbatches=4, schedule="Interleaved1F1B",
                                                                virtual_stages=2)),
    "coloc_pp2_dp2": _case(P(dp=4), P(pp=2, dp=2), offsets={"vision": 0, "language": 0}, options=SUMMED),
    "coloc_hsdp": _case(P(dp=4, dp_replicate=2), P(pp=2, dp=2, dp_replicate=2), offsets={"vision": 0, "language": 0}),
    "coloc_recompute": _case(P(dp=4), P(pp=2, dp=2), offsets={"vision": 0, "language": 0},
                             options={"vision": ParallelOptions(recompute_colocated=True)}),
    "coloc_pp1_recompute": _case(P(dp=2), P(dp=2), offsets={"vision": 0, "language": 0},
                                 options={"vision": ParallelOptions(recompute_colocated=True)}),
    # items of their own sizes come as a list per microbatch: the recomputation once read the RNG
    # state of `list.device` (AttributeError on every rank)
    "coloc_recompute_varied": _case(P(dp=2), P(dp=2), offsets={"vision": 0, "language": 0}, varied=True,
                                    options={"vision": ParallelOptions(recompute_colocated=True)}),
    "coloc_two_recompute": Case({"vision": P(dp=2), "audio": P(dp=2), "language": P(dp=2)},
                                offsets={"vision": 0, "audio": 0, "language": 0}, pipeline=MB4, batch_size=8,
                                n_layers=4, options={"vision": ParallelOptions(recompute_colocated=True),
                                                     "audio": ParallelOptions(recompute_colocated=True, **NO_FSDP)}),
    "cp_pp2": _case(P(dp=2), P(pp=2, cp=2), packed=True, meta=True),
    "two_hop_cp_pp2": _case(P(tp=2), P(pp=2, cp=2), packed=True, bridge_hops=2),
    "tp_enc_pp2": _case(P(tp=2), P(pp=2)),
    "overlap_pp1": _case(P(dp=2), P(dp=2), text_only_steps=(1,), options=SUMMED),
    "frozen_vision": _case(P(dp=2), P(pp=2), frozen=("vision",)),
    "vision_pp2": _case(P(pp=2), P(pp=2)),
    "vision_pp2_dp2": _case(P(pp=2, dp=2), P(), meta=True),
    "vision_pp2_dp2_summed": _case(P(pp=2, dp=2), P(), options=SUMMED),
    "vision_pp2_1mb": _case(P(pp=2), P(), PipelineConfig(microbatches=1, schedule="GPipe")),
    # the LLaVA recipe on encoder stages: stage 0 holds frozen blocks alone (its rank once read the
    # encoder as frozen after its stage was cut, took the three phases and left its pp peer waiting)
    "vision_pp2_frozen_vit": _case(P(pp=2), P(pp=2), frozen=("vision.encoder",)),
    "looped_bfs": _case(P(dp=2), P(pp=2), PipelineConfig(microbatches=4, schedule="LoopedBFS", virtual_stages=2)),
    "zero_bubble": _case(P(), P(pp=2), PipelineConfig(microbatches=8, schedule="InterleavedZeroBubble",
                                                      virtual_stages=2)),
    "zero_bubble_fsdp": _case(P(), P(pp=2, dp=2), PipelineConfig(microbatches=4, schedule="InterleavedZeroBubble",
                                                                 virtual_stages=2),
                              options={"language": ParallelOptions(reshard_after_forward=False)}),
    "zero_bubble_summed": _case(P(), P(pp=2, dp=2), PipelineConfig(microbatches=4, schedule="InterleavedZeroBubble",
                                                                   virtual_stages=2), options=SUMMED),
    "length_buckets": _case(P(dp=2), P(pp=2), seq_lens=(64, 32, 64)),
    "zbv": _case(P(), P(pp=2), PipelineConfig(microbatches=8, schedule="ZBVZeroBubble", virtual_stages=2),
                 predict=True, loss_chunk_rows=16),
    "dualpipev": _case(P(dp=2), P(pp=2), PipelineConfig(microbatches=4, schedule="DualPipeV", virtual_stages=2)),
    # the stages' hidden states under sp are `full_tensor`'s view, which torch's zero-bubble input
    # pass once failed to detach in place (RuntimeError on the pp ranks of the middle stages)
    "zbv_tp_sp": _case(P(dp=4), P(pp=2, tp=2), PipelineConfig(microbatches=4, schedule="ZBVZeroBubble",
                                                                virtual_stages=2),
                       offsets={"vision": 0, "language": 0}, options={"language": ParallelOptions(sp=True)}),
    "user_decoder_pp2": _case(P(), P(pp=2), custom_language=True, meta=True, predict=True),
    "user_decoder_tp2": _case(P(dp=4), P(pp=2, tp=2), PipelineConfig(microbatches=4, schedule="GPipe"),
                              offsets={"vision": 0, "language": 0}, custom_language=True),
}


OLD_TORCH = {  # the cases that meet a bug of torch 2.11 (the GPU machines' release), fixed by 2.13
    **dict.fromkeys(("zero_bubble", "zero_bubble_fsdp", "zero_bubble_summed"), needs_torch(
        (2, 13), "refused by name (2.11's stage_backward_input reads requires_grad of a stage's non-tensor inputs)")),
    **dict.fromkeys(("zbv", "dualpipev", "zbv_tp_sp"), needs_torch(
        (2, 13), "refused by name (a V schedule's stage set-up sends fail under gloo: Pair is not connected)")),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=OLD_TORCH[n]) if n in OLD_TORCH else n for n in CASES])
def test_pipelined_training_matches_single_process(name: str) -> None:
    per_rank = check_against_reference(CASES[name])
    check_route(CASES[name], per_rank)
    check_encoded_shares(CASES[name], per_rank)
    check_sums_overlapped(CASES[name], per_rank)
    check_hsdp_meshes(CASES[name], per_rank)


def check_sums_overlapped(case, per_rank: list[list[dict]]) -> None:
    """Modules without FSDP2 at dp > 1 launched dp sums while backward ran (`GradientReducer`): the
    language model on each of its ranks every step (not under a zero-bubble schedule), an encoder
    on some rank in some step (a rank without items in its last microbatch has nothing to send
    early)."""
    early: dict[str, list[int]] = {}
    # torch's zero-bubble schedules split a stage's backward: the weight half accumulates by hand
    # (no hook), so those buckets, and the ones after them, leave at the flush after the schedule.
    zero_bubble = case.pipeline is not None and case.pipeline.schedule in ZERO_BUBBLE_SCHEDULES
    for records in per_rank:
        for step, r in enumerate(records):
            for name, n in r["early_buckets"].items():
                early.setdefault(name, []).append(n)
                if name == "language" and not zero_bubble:
                    assert n > 0, f"rank's language reducer launched nothing early in step {step}"
    expected = {n for n, o in case.options.items() if not o.fsdp and case.modules[n].dp > 1}
    assert early.keys() == expected, (early, expected)
    assert all(sum(v) > 0 for name, v in early.items() if not (zero_bubble and name == "language")), early


def test_crossings_recycle_their_receive_buffers() -> None:
    """The same batch shape every step: after the first step no crossing allocates a receive
    buffer (`MimoModel.buffers`), and training still matches the reference."""
    case = dataclasses.replace(CASES["dp2_pp2"], seq_lens=(64,) * 3, distinct_batches=1)
    per_rank = check_against_reference(case)
    allocations = [[r["allocations"] for r in records] for records in per_rank]
    assert sum(a[0] for a in allocations) > 0, allocations
    assert all(a[0] == a[-1] for a in allocations), allocations


def test_recomputed_colocated_encoder_replays_its_dropout() -> None:
    """`LocalEncoders` with `recompute`: no graph kept after ``encode``, and the forward recomputed
    before ``backward`` draws the same dropout masks, so the gradients equal those of the kept graph."""
    import torch
    from torch import nn

    from dtensor_mimo.schedule.encoders import LocalEncoders

    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 4))
    inputs = [{"vision": torch.randn(5, 6)}, {"vision": torch.randn(3, 6)}]
    grads = [{"vision": torch.randn(5, 4)}, {"vision": torch.randn(3, 4)}]
    results = []
    for recompute in ((), ("vision",)):
        encoder.zero_grad()
        torch.manual_seed(1)
        local = LocalEncoders({"vision": encoder}, inputs, torch.float32, recompute)
        for k in range(len(inputs)):
            local.encode(k, "vision")
        rows = [local.outputs[k]["vision"] for k in range(len(inputs))]
        assert all(r.requires_grad == (not recompute) for r in rows)  # no graph kept
        after = torch.rand(1)  # the step's RNG stream goes on as without recompute
        local.backward(dict(enumerate(grads)))
        results.append(([r.detach() for r in rows], [p.grad.clone() for p in encoder.parameters()], after))
    (rows_kept, grads_kept, after_kept), (rows_re, grads_re, after_re) = results
    assert all(torch.equal(a, b) for a, b in zip(rows_kept, rows_re))
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(grads_kept, grads_re))
    assert torch.equal(after_kept, after_re)


def test_recomputed_colocated_encoder_counts_each_microbatch_once_in_its_batchnorm() -> None:
    """A user's encoder with a BatchNorm under `recompute_colocated` ("numerics unchanged"): its
    running statistics and `num_batches_tracked` take each microbatch once, as a plain BatchNorm
    run once per microbatch has them. The recomputed forward before the backward updated them a
    second time (num_batches_tracked 4 for 2 microbatches, the running mean moved twice)."""
    import copy

    import torch
    from torch import nn

    from dtensor_mimo.schedule.encoders import LocalEncoders

    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    reference = copy.deepcopy(encoder[:2])
    inputs = [{"vision": torch.randn(5, 6)}, {"vision": torch.randn(3, 6) + 2}]
    grads = [{"vision": torch.randn(5, 4)}, {"vision": torch.randn(3, 4)}]
    local = LocalEncoders({"vision": encoder}, inputs, torch.float32, ("vision",))
    for k in range(len(inputs)):
        local.encode(k, "vision")
    local.backward(dict(enumerate(grads)))
    with torch.no_grad():
        for x in inputs:
            reference(x["vision"])
    for name, want in reference[1].named_buffers():
        assert torch.allclose(getattr(encoder[1], name), want, rtol=1e-6, atol=1e-7), name
    assert int(encoder[1].num_batches_tracked) == 2


def test_checkpointed_block_counts_a_forward_once_in_its_batchnorm() -> None:
    """`activation_checkpointing` on a user's block with a BatchNorm: the recomputation in
    backward does not update its running statistics again (torch's checkpoint reruns the block's
    forward in training mode: num_batches_tracked 2 after one forward, the running mean moved
    twice); they are those of the block run once without checkpointing."""
    import copy

    import torch
    from torch import nn

    from dtensor_mimo.parallelize.checkpointing import checkpoint_blocks

    torch.manual_seed(0)
    blocks = nn.ModuleDict({"0": nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.GELU())})
    reference = copy.deepcopy(blocks["0"])
    assert checkpoint_blocks(blocks, 1) == {"0"}
    x = torch.randn(7, 6) + 1
    out = blocks["0"](x)
    want = reference(x)
    out.square().sum().backward()
    want.square().sum().backward()
    for name, value in reference[1].named_buffers():
        assert torch.allclose(getattr(blocks["0"][1], name), value, rtol=1e-6, atol=1e-7), name
    for p, q in zip(blocks.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- schedules new on some ranks only
def _reference_gradients(batch, seeds: dict[str, int] | None = None) -> tuple[float, dict]:
    """The single-process loss and every parameter's gradient (`tests/test_mimo.py`'s modules and
    seeds, or each module initialized from `seeds`) of one forward and backward over `batch`."""
    import torch
    import torch.nn.functional as F

    from dtensor_mimo.assemble import assemble, embed_text
    from dtensor_mimo.data import IGNORE_INDEX
    from tests.test_mimo import _modules

    llama, encoders = _modules(("vision",))
    for name, module in {"language": llama, **encoders}.items():
        if seeds is not None:
            module.init_weights(seeds[name])
    ids = batch.special_token_ids
    rows = {n: encoders[n](m.inputs) for n, m in batch.modalities.items()}
    h = assemble(embed_text(llama.tok_embeddings, batch.tokens, ids), batch.tokens, rows, ids)
    logits = llama(h=h, positions=batch.positions, document_ids=batch.document_ids).float()
    weight = torch.where(batch.labels == IGNORE_INDEX, 0.0, batch.loss_mask).flatten()
    ce = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    loss = (ce * weight).sum() / weight.sum()
    loss.backward()
    modules = {"language": llama, **encoders}
    return loss.item(), {f"{m}.{n}": p.grad for m, module in modules.items() for n, p in module.named_parameters()}


def _gathered_gradients(model) -> dict:
    """Every gradient this rank's parameters hold, gathered whole (those of dp rank 0 of each module)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    out = {}
    for name in model.module_names:
        coord = model.layout.coordinate(name, dist.get_rank())
        for n, p in model.module_parameters(name).items():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            if coord["dp"] == 0 and coord["tp"] == 0:
                out[f"{name}.{n}"] = None if g is None else g.clone()
    return out


NEW_ON_SOME_RANKS = {
    # vision pp2·dp2: each dp rank pads its microbatches' items to its own bucket (step 2: 1 item on dp
    # rank 0, 2 on dp rank 1), so only dp rank 0's stages build a new schedule
    "encoder_buckets": (dict(vision=P(pp=2, dp=2), language=P()), PipelineConfig(microbatches=2), (4, 4)),
    # language dp2 at pp = 1: 6 samples give each dp rank 3 rows, 5 give dp rank 1 two (a new schedule there)
    "language_rows": (dict(vision=P(), language=P(dp=2)), None, (6, 5)),
}


def _steps_after_predicts(modules, pipeline, sizes):
    """A `predict` before each of two training steps (lr 0: the weights stay those of the
    reference), the second step's batch building a new torch schedule on some ranks only: each
    step's loss and gradients."""
    from dtensor_mimo import AdamWConfig, MimoLayout, MimoModel, MimoOptimizer, train_step
    from tests.test_mimo import _batches, _modules

    model = MimoModel(MimoLayout(modules), *_modules(("vision",)), pipeline=pipeline)
    optimizer = MimoOptimizer(model, AdamWConfig(lr=0.0, max_grad_norm=None))
    out = []
    for i, size in enumerate(sizes):
        batch = _batches(("vision",), False, size, (64, 64))[i]
        model.predict(batch)  # leaves the FSDP2 roots' parameters gathered
        loss = train_step(model, optimizer, batch).loss
        out.append((loss, _gathered_gradients(model)))
    return out


@pytest.mark.parametrize("name", list(NEW_ON_SOME_RANKS))
def test_training_after_predict_when_some_ranks_build_a_new_schedule(name):
    """torch reshards a stage's FSDP2 modules when it first runs a schedule, on the ranks that
    build one; a `predict` before left the roots gathered everywhere, so the ranks that reused
    their schedule skipped the root's all-gather their dp peers made: gloo aborted ("Received data
    size doesn't match expected size"; NCCL would hang or mix the tensors). Each step's loss and
    gradients are the single-process ones."""
    import torch

    from dtensor_mimo import MimoLayout
    from dtensor_mimo.schedule.encoders import item_bucket
    from tests.harness import run_on_ranks
    from tests.test_mimo import _batches

    modules, pipeline, sizes = NEW_ON_SOME_RANKS[name]
    batches = [_batches(("vision",), False, size, (64, 64))[i] for i, size in enumerate(sizes)]
    if name == "encoder_buckets":  # what makes the second step new on dp rank 0 only
        buckets = [[item_bucket([b.modalities["vision"].items_per_sample[j] for j in (k, k + 2)]) for k in (0, 1)]
                   for b in batches]
        assert buckets[0][0] == buckets[0][1] == buckets[1][1] != buckets[1][0], buckets
    per_rank = run_on_ranks(_steps_after_predicts, MimoLayout(modules).world_size, modules, pipeline, sizes,
                            timeout=120)
    for step, batch in enumerate(batches):
        loss, want = _reference_gradients(batch)
        got = {k: v for records in per_rank for k, v in records[step][1].items()}
        assert all(records[step][0] == pytest.approx(loss, rel=1e-5) for records in per_rank), step
        assert got.keys() == want.keys()
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=2e-5, atol=2e-6, msg=lambda m: f"step {step} {k}: {m}")


RESEEDED = {"language": 5, "vision": 700}


def _reinitialized_after_predict():
    """vision pp2·dp2 (FSDP2 stages, ranks 0-3), language on rank 4: a `predict`, then
    `init_weights` from `RESEEDED`, then one forward and backward: its loss share and gradients."""
    from dtensor_mimo import MimoLayout, MimoModel
    from tests.test_mimo import _batches, _modules

    model = MimoModel(MimoLayout(dict(vision=P(pp=2, dp=2), language=P())), *_modules(("vision",)),
                      pipeline=PipelineConfig(microbatches=2))
    batch = _batches(("vision",), False, 4, (64,))[0]
    model.predict(batch)  # leaves each FSDP2 root gathered until `reshard`
    model.init_weights(RESEEDED)
    loss = model.forward_backward(batch).item()
    assert model.reduce_gradients() is None
    return loss if model.holds_loss_share() else None, _gathered_gradients(model)


def test_weights_written_after_predict_reach_encoder_stages():
    """`init_weights` (like `load_hf` and a checkpoint load) calls `MimoModel.reshard` first, so
    that it writes the shards and not what a `predict` left gathered. An encoder pipeline's stage
    (the FSDP2 root of a pp > 1 encoder: patch embedding on stage 0, norm and projection on the
    last) is no submodule of the model, and stayed gathered: the new weights went into that copy,
    which the next training run dropped, training on the old embedding and projection. The loss
    and gradients are those of the single-process model initialized from the new seeds."""
    import torch

    from tests.harness import run_on_ranks
    from tests.test_mimo import _batches

    want_loss, want = _reference_gradients(_batches(("vision",), False, 4, (64,))[0], RESEEDED)
    per_rank = run_on_ranks(_reinitialized_after_predict, 5, timeout=120)
    assert [loss for loss, _ in per_rank if loss is not None] == [pytest.approx(want_loss, rel=1e-5)]
    got = {k: v for _, grads in per_rank for k, v in grads.items()}
    assert got.keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=2e-5, atol=2e-6, msg=lambda m: f"{k}: {m}")


def _two_runs(seq_lens):
    """Two `forward_backward` runs accumulating (vision dp2 and language dp2, FSDP2, on ranks 0-1),
    the second of another sequence length (a new torch schedule for the language stage)."""
    from dtensor_mimo import MimoLayout, MimoModel
    from tests.test_mimo import _batches, _modules

    layout = MimoLayout(dict(vision=P(dp=2), language=P(dp=2)), offsets={"vision": 0, "language": 0})
    model = MimoModel(layout, *_modules(("vision",)))
    for batch in _batches(("vision",), False, 4, seq_lens)[:2]:
        model.forward_backward(batch)
    assert model.reduce_gradients() is None
    return _gathered_gradients(model)


@pytest.mark.parametrize("seq_lens", [(64, 64), (64, 32)], ids=["same_length", "new_length"])
def test_runs_accumulate_when_a_run_builds_a_new_schedule(seq_lens):
    """Runs may accumulate (docs/library.md): two `forward_backward` calls sum their gradients.
    torch drops a stage's FSDP2 gradients when it first runs a schedule, so a second run of a new
    sequence length lost the first run's language gradients."""
    import torch

    from tests.harness import run_on_ranks
    from tests.test_mimo import _batches

    first, second = (_reference_gradients(b)[1] for b in _batches(("vision",), False, 4, seq_lens)[:2])
    for got in run_on_ranks(_two_runs, 2, seq_lens, timeout=120)[:1]:
        assert got.keys() == first.keys()
        for k in first:
            torch.testing.assert_close(got[k], first[k] + second[k], rtol=2e-5, atol=2e-6, msg=lambda m: f"{k}: {m}")


def test_run_schedule_reads_the_gradients_only_when_torch_may_drop_them(monkeypatch):
    """torch drops a stage's FSDP2 gradients only on the first run of a schedule (its cleanup after
    the stages' first initialization), so `run_schedule` keeps them then only: a later step of the
    same schedule does no work per parameter (the step's host time)."""
    import torch

    from dtensor_mimo.schedule import runtime

    class Counted(list):
        walks = 0

        def __iter__(self):
            Counted.walks += 1
            return super().__iter__()

    params = Counted(torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    grad = torch.ones(2)
    params[0].grad = grad

    class Stage:
        has_backward, submod = False, None

        def clear_runtime_states(self):
            pass

    class Schedule:
        def _step_microbatches(self, *args, **kwargs):
            params[0].grad = None  # what torch's `_post_metadata_inference_cleanup` does on a first run

    monkeypatch.setattr(runtime, "_fsdp_params", lambda stage: params)
    monkeypatch.setattr(runtime, "reshard_fsdp_modules", lambda module: None)
    schedule, stages = Schedule(), [Stage()]
    runtime.run_schedule(schedule, stages, [()], None, [None])
    assert params[0].grad is grad  # kept across the first run
    walks = Counted.walks
    schedule._step_microbatches = lambda *a, **k: None  # later runs: torch keeps what it finds
    for _ in range(3):
        runtime.run_schedule(schedule, stages, [()], None, [None])
    assert Counted.walks == walks, "a later run walked every parameter"
    assert params[0].grad is grad


def _item_copies() -> tuple[int, list[float]]:
    """vision pp2 (ranks 0-1) and the language model (rank 2): how many times this rank copied a
    modality's items to its device in two training steps (and the steps' losses)."""
    from dtensor_mimo import AdamWConfig, MimoLayout, MimoModel, MimoOptimizer, train_step
    from dtensor_mimo.data import ModalityInputs
    from tests.test_mimo import _batches, _modules

    model = MimoModel(MimoLayout(dict(vision=P(pp=2), language=P())), *_modules(("vision",)), pipeline=MB4)
    optimizer = MimoOptimizer(model, AdamWConfig(lr=0.0, max_grad_norm=None))
    copies, to = [0], ModalityInputs.to

    def counted(self, device):
        copies[0] += 1
        return to(self, device)

    ModalityInputs.to = counted
    try:
        losses = [train_step(model, optimizer, batch).loss for batch in _batches(("vision",), False, 8, (64, 64))]
    finally:
        ModalityInputs.to = to
    return copies[0], losses


def test_later_encoder_stages_copy_no_items():
    """Only an encoder pipeline's first stage reads the items; a later stage takes their counts from
    the batch metadata, so it copies none of them to its device (on a GPU a later stage copied its
    dp rank's every image, each step, and never read them; `run_once` already copied on the first
    stage only)."""
    from tests.harness import run_on_ranks

    (first, losses), (later, _), _ = run_on_ranks(_item_copies, 3, timeout=120)
    assert first > 0 and later == 0, (first, later)
    assert all(loss > 0 for loss in losses)


# ---------------------------------------------------------------- model(batch) without autograd
NO_GRAD_FORWARD = {"language_pp2": "pp2", "vision_pp2": "vision_pp2_1mb", "one_stage_4mb": "coloc_pp1_recompute"}


def _loss_without_autograd(case):
    """``model(batch)`` under ``torch.no_grad()`` (an evaluation's loss) on a pipelined model:
    the sum of the ranks' loss shares."""
    import torch
    import torch.distributed as dist

    from dtensor_mimo import MimoModel
    from tests.test_mimo import _batches, _modules

    model = MimoModel(case.layout(), *_modules(case.encoders, n_layers=case.n_layers), options=case.options,
                      pipeline=case.pipeline)
    with torch.no_grad():
        loss = model(_batches(case.encoders, case.packed, case.batch_size, case.seq_lens)[0])
    share = loss.double().reshape(1) if model.holds_loss_share() else torch.zeros(1, dtype=torch.float64)
    dist.all_reduce(share)
    return share.item()


@pytest.mark.parametrize("name", list(NO_GRAD_FORWARD))
def test_pipelined_forward_without_autograd_gives_the_loss(name):
    """``model(batch)`` under ``torch.no_grad()`` on a pipelined model (pp > 1, an encoder in
    stages, or several microbatches) was refused, telling the caller to use `forward_backward`,
    which refuses under ``torch.no_grad()`` in turn: an evaluation had no way to a loss through
    ``model(batch)``. It runs one microbatch stage after stage, as `predict`, and its shares sum
    to the single-process loss of the untrained model."""
    from tests.harness import run_on_ranks
    from tests.test_mimo import _reference

    case = CASES[NO_GRAD_FORWARD[name]]
    want = _reference(case.encoders, case.packed, case.frozen, case.batch_size, case.n_layers, case.seq_lens)[0]
    for loss in run_on_ranks(_loss_without_autograd, case.layout().world_size, case, timeout=120):
        assert loss == pytest.approx(want["loss"], rel=1e-5)


def _items_change_dtype(debug: bool) -> list[float]:
    """vision pp2 (ranks 0-1) and the language model (rank 2), lr 0: the same batch's training
    step on float32 pixels, then on float64 pixels, then on float32 again (whole numbers: the
    same values in both dtypes), under torch's DETAIL debug level if `debug` (which makes its
    pipeline stages check their inputs against the shapes and dtypes they were built for)."""
    import torch
    import torch.distributed as dist

    from dtensor_mimo import AdamWConfig, MimoLayout, MimoModel, MimoOptimizer, train_step
    from tests.test_mimo import _batches, _modules

    level = dist.get_debug_level()
    if debug:
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        model = MimoModel(MimoLayout(dict(vision=P(pp=2), language=P())), *_modules(("vision",)), pipeline=MB4)
        optimizer = MimoOptimizer(model, AdamWConfig(lr=0.0, max_grad_norm=None))
        batch = _batches(("vision",), False, 8, (64,))[0]
        m = batch.modalities["vision"]
        whole = m.inputs.mul(50).round()
        losses = []
        for dtype in (torch.float32, torch.float64, torch.float32):
            items = dataclasses.replace(m, inputs=whole.to(dtype))
            losses.append(train_step(model, optimizer, dataclasses.replace(batch, modalities={"vision": items})).loss)
        return losses
    finally:
        dist.set_debug_level(level)


@pytest.mark.parametrize("debug", [False, True], ids=["default", "detail"])
def test_encoder_stages_take_items_of_a_new_dtype(debug):
    """An encoder pipeline's stages were cached per (bucket, microbatches, tokens per item, item
    shape, width), not per the items' dtype: a later step on items of another dtype (float64 from
    numpy after float32) reused the first stage built for the old one, whose inputs torch checks
    under TORCH_DISTRIBUTED_DEBUG=DETAIL: stage 0 alone raised, the other ranks waited in the
    pipeline and the bridge (a hang). The three steps (lr 0) must give one loss, on every rank."""
    from tests.harness import run_on_ranks

    for losses in run_on_ranks(_items_change_dtype, 3, debug, timeout=120):
        assert losses[1] == pytest.approx(losses[0], rel=1e-6) and losses[2] == pytest.approx(losses[0], rel=1e-6)


# ---------------------------------------------------------------- what a rank moves to its device
def _moved_and_held(modules: dict, offsets: dict | None) -> tuple[int, int]:
    """Build a `MimoModel` of `modules` (each module's Parallelism, the language model 4 blocks)
    from full modules built on the host, counting the parameter bytes of every module that
    ``nn.Module.to`` moves to the rank's device meanwhile (a DTensor's local shard); and the
    parameter bytes this rank holds once built."""
    from torch import nn

    from dtensor_mimo import MimoLayout, MimoModel
    from dtensor_mimo.models.layers import local_part
    from tests.test_mimo import _modules

    llama, encoders = _modules(tuple(n for n in modules if n != "language"), n_layers=4)
    moved, to = [0], nn.Module.to

    def counted(self, *args, **kwargs):
        moved[0] += sum(local_part(p).numel() * local_part(p).element_size() for p in self.parameters())
        return to(self, *args, **kwargs)

    nn.Module.to = counted
    try:
        model = MimoModel(MimoLayout(modules, offsets=offsets), llama, encoders, pipeline=MB4)
    finally:
        nn.Module.to = to
    held = sum(local_part(p).numel() * local_part(p).element_size() for p in model.parameters())
    return moved[0], held


@pytest.mark.parametrize("name", ["stages", "shards"])
def test_a_rank_moves_only_what_it_keeps_to_its_device(name):
    """Full modules built on the host (docs/library.md's example, built from seeds) go to each
    rank's device as the parts it keeps: its pipeline stages ("stages": vision pp2 on ranks 0-1,
    language pp2 on ranks 2-3), FSDP2's shards ("shards": colocated, vision dp4 and language
    pp2·dp2 on ranks 0-3). On a GPU the whole module went to every member's device before it was
    split and sharded: every language rank held all stages' blocks (kept there for as long as the
    caller's module lives), each FSDP2 rank the unsharded module (its peak: the full model)."""
    from tests.harness import run_on_ranks

    modules = {"vision": P(pp=2), "language": P(pp=2)} if name == "stages" else \
        {"vision": P(dp=4), "language": P(pp=2, dp=2)}
    offsets = None if name == "stages" else {"vision": 0, "language": 0}
    for rank, (moved, held) in enumerate(run_on_ranks(_moved_and_held, 4, modules, offsets, timeout=120)):
        assert 0 < moved <= held, f"rank {rank} moved {moved} parameter bytes to its device, holds {held}"
