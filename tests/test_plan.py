"""The layout planner (`dtensor_mimo.plan`): cost model, search space, trainer-ready output.

| what                               | cases                                                              |
|------------------------------------|--------------------------------------------------------------------|
| collectives, bubble, pipeline      | ring all-reduce / all-gather, 1F1B / interleaved / zero-bubble     |
| overlap and three phases           | language-bound and encoder-bound overlap; colocated sum; 2 cores   |
| one module                         | dp / tp / FSDP / pp stage layers (loop and V) / memory, by hand    |
| wrappers' own cost                 | FSDP2 and DTensor tp per block call, only where they run           |
| crossings                          | fan-in 2 -> 1 disjoint (2 messages), colocated equal dp (0)        |
| the search space                   | world 4 vision + language, world 3 with audio: brute force         |
| trainer output                     | every ``--json`` entry of world 4 parses as trainer overrides      |
| items of their own size            | the measured job's encoder rows per sample == the digits data's    |
|                                    | mean over 256 drawn samples (not one item's count)                 |

Everything but the last row is pure (synthetic profiles, no measurement, no process group); the
last measures the digits job's modules in this process (a few seconds). No timing assertions.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest

from dtensor_mimo.data import TEXT_VOCAB
from dtensor_mimo.layout import LayoutError, MimoLayout, Parallelism
from dtensor_mimo.parallelize import ParallelOptions
from dtensor_mimo.plan import (Affine, DeviceProfile, Job, Link, ModuleProfile, SearchSpace, entry,
                               enumerate_layouts, homogeneous, overrides_of, predict, search, write_json)
from dtensor_mimo.plan.cost import (allgather_time, allreduce_time, bubble_units, crossing_time, module_cost,
                                    overlapped_step, pipeline_time, rank_layers, shared_cores, three_phase_step)
from dtensor_mimo.train.config import build_layout, check_config, parse_args

P = Parallelism
LINK = Link(latency_s=1e-5, bandwidth=1e6)
FAST = DeviceProfile("test", intra=LINK, inter=LINK, ranks_per_node=64, optimizer=Affine(1e-4, 1e-8))


def profile(name: str, *, layers: int = 2, tokens: float = 10.0, divides: tuple[int, ...] = (4,),
            cp: bool = False, fsdp: bool = False, frozen: bool = False) -> ModuleProfile:
    block_params, rest_params = 1000, 500
    return ModuleProfile(
        name=name, n_layers=layers, tokens_per_sample=tokens,
        block_forward=Affine(1e-3, 1e-6), block_backward=Affine() if frozen else Affine(2e-3, 2e-6),
        rest_forward=Affine(), rest_backward=Affine(), block_params=block_params, rest_params=rest_params,
        trainable_params=rest_params if frozen else block_params * layers + rest_params,
        activation_bytes_per_token=0.0 if frozen else 100.0, width=8, hidden=8, tp_divides=divides, cp=cp,
        fsdp=fsdp)


# ---------------------------------------------------------------------------- the cost model


def test_collectives_by_hand() -> None:
    # ring all-reduce of 1000 bytes over 4 ranks: 6 steps of (10 us + 250 B / 1 MB/s)
    assert allreduce_time(1000, 4, LINK) == pytest.approx(6 * (1e-5 + 250e-6))
    assert allgather_time(1000, 4, LINK) == pytest.approx(3 * (1e-5 + 250e-6))
    assert allreduce_time(1000, 1, LINK) == allgather_time(1000, 1, LINK) == 0.0
    assert LINK.time(2000, messages=3) == pytest.approx(3e-5 + 2e-3)
    shared = Link(latency_s=1e-5, bandwidth=1e6, collective_s=1e-3)  # ranks waiting for cores, every step
    assert allreduce_time(1000, 4, shared) == pytest.approx(6 * (1e-3 + 1e-5 + 250e-6))
    assert allgather_time(1000, 4, shared) == pytest.approx(3 * (1e-3 + 1e-5 + 250e-6))
    assert shared.time(1000) == LINK.time(1000)  # a point-to-point message does not wait so


def test_affine_fit() -> None:
    line = Affine.fit([(10, 0.5 + 10 * 0.01), (20, 0.5 + 20 * 0.01), (40, 0.5 + 40 * 0.01)])
    assert line.fixed == pytest.approx(0.5) and line.per_token == pytest.approx(0.01)
    # a negative intercept is refitted through the origin
    through = Affine.fit([(10, 0.05), (20, 0.2)])
    assert through.fixed == 0.0 and through.per_token == pytest.approx((10 * 0.05 + 20 * 0.2) / (100 + 400))


def test_a_hand_written_profile_is_refused_where_it_cannot_describe_a_machine() -> None:
    # profiles are JSON a user may write by hand: a negative time, a zero bandwidth or a language
    # model that costs nothing would make every prediction meaningless (or divide by a zero step)
    with pytest.raises(ValueError, match="per_token=-1e-06 must be a finite number"):
        Affine(0.0, -1e-6)
    with pytest.raises(ValueError, match="fixed=nan"):
        Affine(float("nan"))
    with pytest.raises(ValueError, match="bandwidth=0 must be"):
        Link(latency_s=1e-5, bandwidth=0)
    free = dataclasses.replace(profile("language"), block_forward=Affine(), block_backward=Affine())
    with pytest.raises(ValueError, match="'language' costs nothing"):
        Job((profile("vision"), free), batch_size=4)
    with pytest.raises(ValueError, match="batch_size=0"):
        Job((profile("language"),), batch_size=0)
    data = Job((profile("vision"), profile("language")), batch_size=4).to_dict()
    data["modules"][1]["block_forward"] = {"fixed": 0.0, "per_token": 0.0}
    with pytest.raises(ValueError, match="costs nothing"):
        Job.from_dict(data)


def test_bubble_and_pipeline_by_hand() -> None:
    assert bubble_units("1F1B", 1) == 0
    assert bubble_units("1F1B", 4) == 3
    assert bubble_units("GPipe", 4) == 3
    assert bubble_units("Interleaved1F1B", 4, 2) == 1.5
    assert bubble_units("ZBVZeroBubble", 4, 2) == pytest.approx(0.5)
    assert pipeline_time(0.1, 8, 4) == pytest.approx(1.1)  # (M + pp - 1) x 0.1


def test_overlap_by_hand() -> None:
    # language-bound: the language model (4 x 2 s) starts after the first encoder forward (1 s)
    # and the last encoder backward (1 s) follows it
    assert overlapped_step(1, 1, lang_step=8, lang_traverse=2, microbatches=4) == 10
    # encoder-bound: 4 forwards and 4 backwards of 3 s each, nothing hides them
    assert overlapped_step(3, 3, lang_step=4, lang_traverse=1, microbatches=4) == 24
    # the last microbatch's trip: 4 forwards of 3 s, 10 s through the language stages, 1 s back
    assert overlapped_step(3, 1, lang_step=12, lang_traverse=10, microbatches=4) == 23
    # data first: the encoder starts at 2 s
    assert overlapped_step(1, 1, 8, 2, 4, enc_start=2) == 12
    assert three_phase_step(1, 1, 8, 4) == 16
    assert three_phase_step(1, 1, 8, 4, start=0.5) == 16.5


def test_shared_cores() -> None:
    assert shared_cores(10, [6, 6, 6, 6], 2) == 12  # 24 busy seconds on 2 cores
    assert shared_cores(10, [6, 6, 6, 6], 4) == 10
    assert shared_cores(10, [6, 6, 6, 6], None) == 10
    # the busiest rank shares the 2 cores with 3, then 2 others: 2 x 4/2 + 2 x 3/2 + 4 x 1, not 18 / 2
    assert shared_cores(0, [2, 4, 4, 8], 2) == 11


def test_stage_layers_loop_and_v() -> None:
    assert rank_layers(5, 2) == [(3, False), (2, True)]
    assert rank_layers(4, 2, "ZBVZeroBubble", 2) == [(2, True), (2, False)]  # rank 0: stages 0 and 3
    assert rank_layers(8, 2, "Interleaved1F1B", 2) == [(4, False), (4, True)]


def test_module_cost_dp_by_hand() -> None:
    p = profile("language", fsdp=False)
    # batch 8, 2 microbatches: 4 samples; dp 2: 2 samples x 10 rows = 20 tokens per rank
    c = module_cost(p, P(dp=2), 8, 2, FAST, range(2))
    assert c.forward == pytest.approx(2 * (1e-3 + 20e-6))
    assert c.backward == pytest.approx(2 * (2e-3 + 40e-6))
    params = 2 * 1000 + 500
    assert c.reduce == pytest.approx(allreduce_time(params * 4, 2, LINK))  # all-reduce without FSDP
    assert c.optimizer == pytest.approx(1e-4 + 1e-8 * params)
    # fp32 parameters + gradients + two AdamW moments; 1F1B on one stage keeps one microbatch
    assert c.memory == pytest.approx(params * (4 + 4 + 8) + 100 * 20 * 2)


def test_module_cost_tp_and_fsdp_by_hand() -> None:
    p = profile("language", fsdp=True)
    c = module_cost(p, P(tp=2), 8, 1, FAST, range(2))
    tokens = 8 * 10
    comm = 2 * allreduce_time(tokens * 8 * 4, 2, LINK)  # two all-reduces of [tokens, hidden] per block
    assert c.forward == pytest.approx(2 * (1e-3 + 1e-6 * tokens / 2 + comm))
    # FSDP over dp = 2: one all-gather of each block forward and again in backward (reshard)
    f = module_cost(p, P(dp=2), 8, 1, FAST, range(2))
    gather = allgather_time(1000 * 4, 2, LINK)
    assert f.forward == pytest.approx(2 * (1e-3 + 40e-6 + gather) + allgather_time(500 * 4, 2, LINK))
    assert f.backward == pytest.approx(2 * (2e-3 + 80e-6 + gather))
    params = 2 * 1000 + 500
    # state sharded over dp; one gathered block and the unsharded rest at a time; activations
    assert f.memory == pytest.approx(params * 16 / 2 + (1000 + 500) * 4 + 100 * 40 * 2)


def test_module_cost_hsdp_by_hand() -> None:
    """HSDP over two nodes of two ranks: FSDP2's gathers and reduce-scatters over one node's two
    ranks (the fast link), one all-reduce of a gradient shard between the nodes (the slow one),
    and the state sharded over two ranks instead of four."""
    slow = Link(latency_s=1e-4, bandwidth=1e4)
    nodes = DeviceProfile("two nodes", intra=LINK, inter=slow, ranks_per_node=2, optimizer=Affine(1e-4, 1e-8))
    p = profile("language", fsdp=True)
    full, hybrid = (module_cost(p, P(dp=4, dp_replicate=r), 8, 1, nodes, range(4)) for r in (1, 2))
    params, tokens = 2 * 1000 + 500, 2 * 10
    assert full.forward == pytest.approx(2 * (1e-3 + 1e-6 * tokens + allgather_time(1000 * 4, 4, slow))
                                         + allgather_time(500 * 4, 4, slow))
    assert hybrid.forward == pytest.approx(2 * (1e-3 + 1e-6 * tokens + allgather_time(1000 * 4, 2, LINK))
                                           + allgather_time(500 * 4, 2, LINK))
    assert full.reduce == pytest.approx(allgather_time(params * 4, 4, slow))
    assert hybrid.reduce == pytest.approx(allgather_time(params * 4, 2, LINK) + allreduce_time(params * 4 / 2, 2, slow))
    assert hybrid.memory - full.memory == pytest.approx(params * 16 / 2 - params * 16 / 4)
    assert hybrid.optimizer == pytest.approx(1e-4 + 1e-8 * params / 2)
    # tp2·dp6 in two replica groups of six ranks on nodes of eight: ranks 6-11 straddle two nodes,
    # so its gathers are costed on the slow link (the search never offers it: `hsdp` below)
    wide = DeviceProfile("two nodes", intra=LINK, inter=slow, ranks_per_node=8)
    straddling = module_cost(p, P(dp=6, tp=2, dp_replicate=2), 12, 1, wide, range(12))
    assert straddling.forward == pytest.approx(
        2 * (1e-3 + 1e-6 * 2 * 10 / 2 + 2 * allreduce_time(2 * 10 * 8 * 4, 2, LINK) + allgather_time(1000 * 2, 3, slow))
        + allgather_time(500 * 2, 3, slow))


@pytest.mark.parametrize("par, per_node, replicas", [
    (P(dp=12), 8, 3),  # groups of 4 (of 6, two would straddle nodes)
    (P(dp=8, tp=2), 8, 2), (P(dp=4, cp=2, tp=2), 4, 4), (P(dp=16), 8, 2),
    (P(dp=4, tp=2), 8, 1), (P(dp=2, cp=4, tp=4), 8, 1),  # within one node; cp·tp alone spans nodes
])
def test_hsdp_groups_fill_part_of_one_node(par, per_node: int, replicas: int) -> None:
    from dtensor_mimo.plan.search import hsdp

    got = hsdp(par, per_node)
    assert (got.dp_replicate if got else 1) == replicas


def test_search_offers_hsdp_where_fsdp_spans_nodes() -> None:
    """With four ranks a node, an FSDP2 module on eight dp ranks is also offered as HSDP with two
    replica groups (one a node); a module within a node, or without FSDP2, is not. Under a slow
    link between the nodes the HSDP layout is predicted faster than the same layout unreplicated."""
    slow = Link(latency_s=1e-3, bandwidth=1e3)
    nodes = DeviceProfile("two nodes", intra=LINK, inter=slow, ranks_per_node=4, optimizer=Affine(1e-4, 1e-8))
    job = Job((profile("vision", tokens=6, divides=(4, 96, 64)),
               profile("language", tokens=33, divides=(4, 2, 128, len(TEXT_VOCAB)), fsdp=True)), batch_size=16)
    ranked = search(job, 8, nodes).ranked
    by_layout = {(c.candidate.describe(), c.candidate.microbatches): c for c in ranked}
    for m in (1, 2):
        hybrid, full = (by_layout[f"vision dp8 @0 | language dp8{r} @0", m] for r in ("r2", ""))
        assert hybrid.step_s < full.step_s
    assert not any(c.candidate.parallelisms["vision"].hsdp for c in ranked)  # no FSDP2 there
    assert not any(p.hsdp for c in ranked for p in c.candidate.parallelisms.values() if p.dp * p.cp * p.tp <= 4)
    entries = [entry(c) for c in ranked if c.candidate.parallelisms["language"].hsdp][:1]
    audio = ["--layout.audio.dp", "8", "--layout.audio.offset", "0"]  # the trainer's digits job has one more
    config = parse_args([*overrides_of(json.loads(json.dumps(entries[0]))), *audio])
    assert build_layout(config, 8).parallelism("language").dp_replicate == 2
    from dtensor_mimo.train.plan import with_candidate  # layout.auto takes the entry's HSDP too

    assert with_candidate(parse_args([]), entries[0]).module_layout("language").dp_replicate == 2


def test_wrapper_costs_apply_only_where_the_wrapper_runs() -> None:
    p = dataclasses.replace(profile("language", fsdp=True), fsdp_forward_s=1e-3, fsdp_backward_s=2e-3,
                            tp_forward_s=3e-3, tp_backward_s=4e-3)
    plain = module_cost(p, P(), 8, 1, FAST, range(1))
    assert plain.forward == pytest.approx(2 * (1e-3 + 80e-6))  # dp = tp = 1: neither wrapper
    tp = module_cost(p, P(tp=2), 8, 1, FAST, range(2))
    comm = 2 * allreduce_time(80 * 8 * 4, 2, LINK)
    assert tp.forward == pytest.approx(2 * (1e-3 + 40e-6 + comm + 3e-3))
    assert tp.backward == pytest.approx(2 * (2e-3 + 80e-6 + comm + 4e-3))
    dp = module_cost(p, P(dp=2), 8, 1, FAST, range(2))
    gather = allgather_time(1000 * 4, 2, LINK)
    assert dp.backward == pytest.approx(2 * (2e-3 + 80e-6 + 2e-3 + gather))


def test_module_cost_pipeline_and_frozen() -> None:
    p = profile("language", layers=3)
    c = module_cost(p, P(pp=2), 8, 4, FAST, range(2))
    tokens = 2 * 10
    send = 2 * LINK.time(tokens * 8 * 4)
    # rank 0 holds 2 blocks (the busiest), rank 1 one block and the (empty) rest
    assert c.forward == pytest.approx(2 * (1e-3 + 1e-6 * tokens) + send)
    assert c.stage_trip == pytest.approx(3 * (3e-3 + 3e-6 * tokens) + 2 * 2 * send)
    frozen = module_cost(profile("vision", frozen=True), P(dp=2), 8, 1, FAST, range(2), held=1)
    assert frozen.backward == 0.0 and frozen.reduce > 0  # the projection still trains


def test_crossing_from_the_bridge_plan() -> None:
    enc = profile("vision", tokens=3)
    # fan-in: vision dp2 (ranks 0-1) -> language dp1 (rank 2); 4 samples x 3 rows; the language
    # rank receives 12 rows of 8 fp32 features in 2 messages
    t = crossing_time(enc, P(dp=2), P(), False, 4, FAST, range(0, 2), range(2, 3), 4)
    assert t == pytest.approx(LINK.time(12 * 8 * 4, messages=2))
    # colocated with the same dp: every row is a local copy
    assert crossing_time(enc, P(dp=2), P(dp=2), True, 4, FAST, range(2), range(2), 4) == 0.0


def test_encoders_hold_the_crossing_window_plus_one_when_lean() -> None:
    """Disjoint pp = 1 encoders keep window + 1 microbatches of activations (1F1B at language pp2:
    stage 0 has 2 in flight, the window adds one of slack: 4), else all M (colocated, or a GPipe
    language model)."""
    from dtensor_mimo.plan.cost import encoder_held

    job = Job((profile("vision", tokens=4), profile("language", tokens=32)), batch_size=8)
    assert encoder_held(job, 2, 8, lean=True) == 4
    assert encoder_held(job, 2, 8, lean=False) == 8
    assert encoder_held(job, 1, 8, lean=True) == 3
    assert encoder_held(job, 2, 2, lean=True) == 2
    assert encoder_held(dataclasses.replace(job, schedule="GPipe"), 2, 8, lean=True) == 8


def test_predict_is_consistent() -> None:
    job = Job((profile("vision", tokens=4), profile("language", tokens=32, cp=True)), batch_size=8)
    base = homogeneous(job, 2)
    pred = predict(job, base, FAST)
    assert pred.tokens_per_s == pytest.approx(8 * 32 / pred.step_s)
    assert all(0 <= v <= 1 for v in pred.idle.values())
    assert pred.idle["vision"] == pred.idle["language"]  # colocated: the same ranks


def test_colocated_crossings_are_costed_once_per_direction() -> None:
    """In the colocated three phases the rows cross before the language schedule and the
    gradients after it (`dtensor_mimo.schedule.program._colocated`): each crossing is one exchange
    on the shared ranks, in the step once. Vision dp2 and the language model tp2 on the same two
    ranks, batch 8 in 2 microbatches of 4 samples x 10 rows: each rank holds 20 rows and needs
    the other rank's 20 (the language ranks replicate them over tp), forward and backward. Only
    the crossings depend on the rows' width: 8 fp32 features add 20 x 8 x 4 bytes at 1 MB/s per
    direction and microbatch, 2 x 2 x 0.64 ms in the step."""
    from dtensor_mimo.plan.candidate import Candidate

    def step(width: int) -> float:
        vision = dataclasses.replace(profile("vision", tokens=10), width=width)
        job = Job((vision, profile("language", tokens=32)), batch_size=8)
        cand = Candidate.of({"vision": P(dp=2), "language": P(tp=2)}, {"vision": 0, "language": 0}, 2)
        return predict(job, cand, FAST).step_s

    assert step(8) - step(0) == pytest.approx(2 * 2 * 20 * 8 * 4 / 1e6)


def test_rows_cross_in_the_language_models_compute_dtype() -> None:
    """The bridge carries rows in the language model's compute dtype (`MimoModel.dtype`), whatever
    the encoder's: an fp32 tower (4-byte activations) into a bf16 decoder moves 2-byte rows. The
    layout of the test above: 2 x 2 x 20 rows x 8 features x 2 bytes at 1 MB/s in the step."""
    from dtensor_mimo.plan.candidate import Candidate

    def step(width: int) -> float:
        vision = dataclasses.replace(profile("vision", tokens=10), width=width, act_bytes=4)
        language = dataclasses.replace(profile("language", tokens=32), act_bytes=2)
        cand = Candidate.of({"vision": P(dp=2), "language": P(tp=2)}, {"vision": 0, "language": 0}, 2)
        return predict(Job((vision, language), batch_size=8), cand, FAST).step_s

    assert step(8) - step(0) == pytest.approx(2 * 2 * 20 * 8 * 2 / 1e6)


def test_a_frozen_encoders_rows_cross_one_way() -> None:
    """A frozen encoder (no parameter trains) gets no gradient back (`Crossing.backward_names`):
    its rows cross forward only. The layout of the two tests above, vision frozen: 2 microbatches
    x 20 rows x 8 fp32 features at 1 MB/s in the step, once per microbatch."""
    from dtensor_mimo.plan.candidate import Candidate

    def step(width: int) -> float:
        vision = dataclasses.replace(profile("vision", tokens=10, frozen=True), width=width, trainable_params=0)
        cand = Candidate.of({"vision": P(dp=2), "language": P(tp=2)}, {"vision": 0, "language": 0}, 2)
        return predict(Job((vision, profile("language", tokens=32)), batch_size=8), cand, FAST).step_s

    assert step(8) - step(0) == pytest.approx(2 * 20 * 8 * 4 / 1e6)


@pytest.mark.parametrize("pp, schedule, virtual", [(2, "ZBVZeroBubble", 2), (1, "Interleaved1F1B", 2),
                                                   (2, "1F1B", 1), (1, "1F1B", 1)])
def test_a_tied_decoders_head_copy_is_counted_where_one_rank_holds_both(pp: int, schedule: str,
                                                                         virtual: int) -> None:
    """A tied decoder cut into stages trains its head as a copy of the embedding (`untie_for_stages`):
    the rank holding the first and the last stage (a V's first pp rank; virtual stages at pp = 1)
    holds both with their gradients and AdamW state; one stage (pp = 1) holds the one tied parameter
    once. The planner's parameters on the busiest rank (no activations, no FSDP: memory / 16 bytes)
    against the real count of that rank's stages."""
    from dtensor_mimo.models import Llama, LlamaConfig
    from dtensor_mimo.models.llama import untie_embeddings
    from dtensor_mimo.models.protocol import decoder_stage
    from dtensor_mimo.schedule.config import PipelineConfig, stage_layers

    llama = Llama(LlamaConfig.tiny(tie_embeddings=True, n_layers=4))
    blocks = sum(p.numel() for p in llama.layers["0"].parameters())
    params = sum(p.numel() for p in llama.parameters())  # the tied one once, as measured
    tied = dataclasses.replace(profile("language", layers=4), block_params=blocks, rest_params=params - 4 * blocks,
                               trainable_params=params, activation_bytes_per_token=0.0,
                               tied_params=llama.tok_embeddings.weight.numel())
    cost = module_cost(tied, P(pp=pp), 8, 2 * pp, FAST, range(pp), schedule, virtual)
    config = PipelineConfig(microbatches=2 * pp, schedule=schedule, virtual_stages=virtual)
    if config.num_stages(pp) > 1:  # one stage (pp = 1, no virtual stages): the model stays tied, one parameter
        with pytest.warns(UserWarning):
            untie_embeddings(llama, "a test")
    bounds = stage_layers(4, config.num_stages(pp))
    busiest = 0
    for r in range(pp):
        stages = [decoder_stage(llama, bounds[s], s == 0, s == len(bounds) - 1) for s in config.rank_stages(r, pp)]
        busiest = max(busiest, sum({id(p): p.numel() for m in stages for p in m.parameters()}.values()))
    if schedule == "1F1B" and pp > 1:  # one copy a rank; the rest counted whole (embedding and norm): not below
        assert cost.memory / 16 >= busiest
    else:
        assert cost.memory / 16 == busiest


def test_module_cost_of_an_uneven_dp_shard_is_its_largest() -> None:
    """dp that does not divide a microbatch's samples: the busiest rank holds the larger shard
    (`microbatch_tokens`: 5 samples over dp 2, 3 on dp rank 0: 30 tokens), not the smaller."""
    c = module_cost(profile("language"), P(dp=2), 5, 1, FAST, range(2))
    assert c.forward == pytest.approx(2 * (1e-3 + 30e-6))
    assert c.backward == pytest.approx(2 * (2e-3 + 60e-6))


def test_a_colocated_one_call_encoder_pays_its_call_once_a_step() -> None:
    """In the colocated three phases an encoder that runs every microbatch's items in one call
    (`ModuleProfile.one_call`: the library's) pays its per-call work once a step: the step is
    M - 1 times its blocks' fixed forward and backward work shorter, the per-token work the same.
    An encoder on ranks of its own runs microbatch by microbatch either way."""
    from dtensor_mimo.plan.candidate import Candidate

    vision, language = profile("vision", tokens=4), profile("language", tokens=32, cp=True)
    m = 4

    def step(one_call: bool, candidate: Candidate) -> float:
        job = Job((dataclasses.replace(vision, one_call=one_call), language), batch_size=8)
        return predict(job, candidate, FAST).step_s

    colocated = homogeneous(Job((vision, language), batch_size=8), 2, m)
    fixed = vision.n_layers * (vision.block_forward.fixed + vision.block_backward.fixed)
    assert step(False, colocated) - step(True, colocated) == pytest.approx((m - 1) * fixed)
    disjoint = Candidate.of({"vision": P(dp=2), "language": P(dp=2)}, {"vision": 0, "language": 2}, m)
    assert step(True, disjoint) == step(False, disjoint)


# ---------------------------------------------------------------------------- the search space


def digits_job(batch_size: int = 8, audio: bool = True) -> Job:
    """Synthetic profiles with the digits model's names and the sizes tp must divide."""
    encoders = [profile("vision", tokens=6, divides=(4, 96, 64))]
    if audio:
        encoders.append(profile("audio", tokens=4, divides=(4, 96, 64)))
    language = profile("language", tokens=33, cp=True, divides=(4, 2, 128, len(TEXT_VOCAB)))
    return Job((*encoders, language), batch_size=batch_size)


def brute_force(job: Job, world: int, max_microbatches: int) -> set:
    """Every (sizes, offsets, M) that `MimoLayout` builds for `world` and that the library and the
    trainer accept, written out independently; offsets renumbered so that rank groups come in the
    order of their first module (the planner leaves out which group takes which ranks)."""
    dims = [(pp, dp, cp, tp) for pp, dp, cp, tp in itertools.product(range(1, world + 1), repeat=4)
            if pp * dp * cp * tp <= world]
    names = job.names
    found = set()
    for shapes in itertools.product(dims, repeat=len(names)):
        for offsets in itertools.product(range(world), repeat=len(names)):
            if any(o + math.prod(s) > world for o, s in zip(offsets, shapes)):
                continue
            pars = {n: P(*s) for n, s in zip(names, shapes)}
            try:
                MimoLayout(pars, offsets=dict(zip(names, offsets)), world_size=world)
            except LayoutError:
                continue
            for m in range(1, max_microbatches + 1):
                if job.batch_size % m or not _accepted(job, pars, m):
                    continue
                found.add(_renumbered(names, pars, dict(zip(names, offsets)), m))
    return found


def _accepted(job: Job, pars: dict, m: int) -> bool:
    lang = pars["language"]
    for p in job.modules:
        par = pars[p.name]
        if any(d % par.tp for d in p.tp_divides) or job.batch_size // m < par.dp:
            return False
        if p.name != "language" and (par.pp > 1 or par.cp > 1):
            return False
    if job.batch_size % (m * lang.dp) or lang.pp > job.lang.n_layers or m < lang.pp:  # 1F1B
        return False
    return True


def _renumbered(names, pars, offsets, m) -> tuple:
    spans = sorted({(offsets[n], pars[n].size) for n in names},
                   key=lambda s: min(i for i, n in enumerate(names) if (offsets[n], pars[n].size) == s))
    start, new = 0, {}
    for span in spans:
        new[span] = start
        start += span[1]
    return tuple((n, pars[n].shape, new[(offsets[n], pars[n].size)]) for n in names) + (m,)


def _key(cand) -> tuple:
    return tuple((n, p.shape, o) for (n, p), (_, o) in zip(cand.modules, cand.offsets)) + (cand.microbatches,)


@pytest.mark.parametrize("world,audio", [(4, False), (3, True)])
def test_search_enumerates_exactly_the_valid_layouts(world: int, audio: bool) -> None:
    job = digits_job(batch_size=8, audio=audio)
    space = SearchSpace(max_microbatches=8)
    mine = [_key(c) for c in enumerate_layouts(job, world, space)]
    assert len(mine) == len(set(mine)), "a layout enumerated twice"
    expected = brute_force(job, world, 8)
    assert set(mine) == expected
    assert len(expected) > 50


def test_search_ranks_everything_it_enumerates() -> None:
    job = digits_job()
    result = search(job, 4, FAST)
    assert result.exhaustive
    assert result.evaluated == sum(1 for _ in enumerate_layouts(job, 4))
    steps = [p.step_s for p in result.ranked]
    assert steps == sorted(steps)


def test_pruned_search_finds_layouts_of_a_large_world() -> None:
    job = digits_job(batch_size=64)
    result = search(job, 64, FAST, exhaustive=False)
    assert result.ranked and not result.exhaustive
    for p in result.ranked[:20]:
        assert p.candidate.layout(64).world_size == 64


# ---------------------------------------------------------------------------- trainer output


def test_json_entries_are_trainer_overrides(tmp_path) -> None:
    job = digits_job(batch_size=32)  # the digits job's batch
    ranked = search(job, 4, FAST).ranked
    path = tmp_path / "plan.json"
    write_json(str(path), ranked)
    entries = json.loads(path.read_text())
    assert len(entries) == len(ranked)
    assert set(entries[0]) == {"layout", "microbatches", "predicted_step_s", "predicted_peak_gib"}
    for e, pred in zip(entries, ranked):
        assert set(e["layout"]) == {"vision", "audio", "language"}
        assert all(set(v) == {"pp", "dp", "cp", "tp", "dp_replicate", "offset"} for v in e["layout"].values())
        config = parse_args(overrides_of(e))
        check_config(config, 4)
        layout = build_layout(config, 4)
        for name, keys in e["layout"].items():
            par = layout.parallelism(name)
            assert (par.pp, par.dp, par.cp, par.tp, par.dp_replicate, layout.offset(name)) == \
                (keys["pp"], keys["dp"], keys["cp"], keys["tp"], keys["dp_replicate"], keys["offset"])
        assert config.pipeline.microbatches == e["microbatches"] == pred.candidate.microbatches
        assert e == json.loads(json.dumps(entry(pred)))


def test_the_configured_layout_is_found_in_the_ranking_whatever_ranks_its_modules_take(monkeypatch) -> None:
    """The command prints the configured layout's rank among the ranked ones. A config that puts
    the language model first (ranks 0-1) and the encoders after it is the same layout as the
    enumerated one with the encoders first (the search leaves out which group takes which
    ranks): it has that one's rank."""
    from dtensor_mimo.train import plan as trainer_plan

    job = digits_job(batch_size=32)
    monkeypatch.setattr(trainer_plan, "load_profiles", lambda *args, **kwargs: (job, FAST, "cache"))
    config = parse_args(["--layout.language.offset", "0", "--layout.language.dp", "2",
                         "--layout.vision.offset", "2", "--layout.audio.offset", "3"])
    lines: list[str] = []
    ranked = trainer_plan.plan(config, 4, top=1, log=lines.append)
    rank = next(i for i, p in enumerate(ranked, 1) if p.candidate.describe() ==
                "vision 1 @0 | audio 1 @1 | language dp2 @2" and p.candidate.microbatches == 4)
    assert lines[-1].startswith("the configured layout (vision 1 @2 | audio 1 @3 | language dp2 @0, M=4)")
    assert lines[-1].endswith(f", rank {rank}"), lines[-1]


def test_layout_auto_config() -> None:
    from dtensor_mimo.train.plan import with_candidate

    config = parse_args(["--layout.auto", "true"])
    assert config.layout.auto
    check_config(config, 5)  # the planner replaces the layout: any world passes the config check
    chosen = entry(search(digits_job(batch_size=32), 4, FAST).ranked[0])
    planned = with_candidate(config, chosen)
    assert not planned.layout.auto
    check_config(planned, 4)
    assert build_layout(planned, 4).world_size == 4


@pytest.mark.parametrize("argv", [
    ["--data.batch_size", "6"],  # the configured 4 microbatches do not split it; 1, 2, 3 and 6 do
    ["--layout.language.pp", "2", "--pipeline.microbatches", "1"],  # 1F1B: fewer microbatches than stages
])
def test_layout_auto_is_not_refused_for_the_layout_it_replaces(monkeypatch, argv: list[str]) -> None:
    """``layout.auto`` replaces every module's layout and pipeline.microbatches: a config is not
    refused for the configured ones (it was, by the rules of a layout the run never trains on),
    and the layout it trains on passes every rule of the config check."""
    from dtensor_mimo.train import plan as trainer_plan

    config = parse_args(["--layout.auto", "true", *argv])
    world = build_layout(config).world_size  # the own launcher's world: the configured layout's
    job = digits_job(batch_size=config.data.batch_size)
    monkeypatch.setattr(trainer_plan, "load_profiles", lambda *args, **kwargs: (job, FAST, "cache"))
    planned = trainer_plan.auto_layout(config, world, log=lambda _: None)
    check_config(planned, world)
    language = build_layout(planned, world).parallelism("language")
    assert config.data.batch_size % (planned.pipeline.microbatches * language.dp) == 0
    assert planned.pipeline.microbatches >= language.pp


OPTION_LIMITS = {  # (options per module, the language pipeline's schedule): what each refuses on some layouts
    "language_compiled_whole": ({"language": ParallelOptions(compile=True, compile_scope="module")}, "1F1B"),
    # two stages on every pp rank: no layout compiles the decoder whole
    "language_compiled_whole_looped": ({"language": ParallelOptions(compile=True, compile_scope="module")},
                                       "Interleaved1F1B"),
    "vision_cuda_graphs": ({"vision": ParallelOptions(compile=True, compile_mode="reduce-overhead")}, "1F1B"),
    "vision_recomputed": ({"vision": ParallelOptions(recompute_colocated=True)}, "1F1B"),
    # compiled (by blocks) and recomputed: no tp > 1 over more than one microbatch
    "vision_recomputed_compiled": ({"vision": ParallelOptions(recompute_colocated=True, compile=True)}, "1F1B"),
    "zero_bubble_fsdp": ({}, "InterleavedZeroBubble"),
}


@pytest.mark.parametrize("name", list(OPTION_LIMITS))
def test_every_candidate_is_a_layout_the_library_builds_with_the_modules_options(name: str, monkeypatch) -> None:
    """The planner's profiles carry what the modules' options refuse on a layout (a whole-module
    compile or CUDA graphs where FSDP2 shards, CUDA graphs with tp, an encoder recomputed in the
    colocated phases off the language ranks, a zero-bubble schedule with FSDP2 resharding after
    forward): every candidate it ranks passes the library's own `check_model` with those options,
    for the real modules the profiles describe; without them it proposed layouts the trainer
    then refused."""
    from dtensor_mimo.layout import torch_compat
    from dtensor_mimo.models import Llama, LlamaConfig, ModalityEncoder, Projection, ViT, ViTConfig
    from dtensor_mimo.schedule.checks import check_model

    monkeypatch.setattr(torch_compat, "RELEASE", (2, 13))  # the layout rules alone (torch 2.11 refuses zero bubble)
    from dtensor_mimo.schedule.config import PipelineConfig
    from dtensor_mimo.train.plan import option_limits

    options, schedule = OPTION_LIMITS[name]
    llama = Llama(LlamaConfig.tiny(n_layers=4))
    encoders = {"vision": ModalityEncoder(ViT(ViTConfig.tiny()), Projection(32, 32))}
    limits = {n: option_limits(options.get(n, ParallelOptions())) for n in ("vision", "language")}
    job = Job((dataclasses.replace(profile("vision", divides=(4, 64, 32)), **limits["vision"]),
               dataclasses.replace(profile("language", layers=4, tokens=32, cp=True, divides=(4, 2, 64, 64)),
                                   **limits["language"])),
              batch_size=8, schedule=schedule, virtual_stages=2 if schedule != "1F1B" else 1)
    ranked = search(job, 4, FAST).ranked
    assert bool(ranked) == (name != "language_compiled_whole_looped")
    for pred in ranked:
        cand = pred.candidate
        config = PipelineConfig(microbatches=cand.microbatches, schedule=schedule, virtual_stages=job.virtual_stages)
        try:
            check_model(cand.layout(4), llama, encoders, "language", options, config)
        except (LayoutError, ValueError) as e:
            pytest.fail(f"the planner proposed {cand.describe()} (M={cand.microbatches}), which the library "
                        f"refuses: {e}")


def test_before_torch_2_13_no_candidate_runs_two_language_stages_on_one_rank(monkeypatch) -> None:
    """torch 2.11 cannot run two stages of the language model on one rank (pp = 1 with virtual
    stages: `check_model` refuses it): the planner does not propose it there; on 2.13 it does."""
    from dtensor_mimo.layout import torch_compat
    from dtensor_mimo.models import Llama, LlamaConfig, ModalityEncoder, Projection, ViT, ViTConfig
    from dtensor_mimo.schedule.checks import check_model
    from dtensor_mimo.schedule.config import PipelineConfig

    llama = Llama(LlamaConfig.tiny(n_layers=4))
    encoders = {"vision": ModalityEncoder(ViT(ViTConfig.tiny()), Projection(32, 32))}
    job = Job((profile("vision", divides=(4, 64, 32)), profile("language", layers=4, tokens=32, cp=True,
                                                                divides=(4, 2, 64, 64))),
              batch_size=8, schedule="Interleaved1F1B", virtual_stages=2)
    pps = {}
    for release in ((2, 11), (2, 13)):
        monkeypatch.setattr(torch_compat, "RELEASE", release)
        ranked = search(job, 4, FAST).ranked
        pps[release] = {p.candidate.layout(4).parallelism("language").pp for p in ranked}
        for pred in ranked:
            cand = pred.candidate
            check_model(cand.layout(4), llama, encoders, "language", {},
                        PipelineConfig(microbatches=cand.microbatches, schedule="Interleaved1F1B", virtual_stages=2))
    assert 1 not in pps[(2, 11)] and pps[(2, 11)] and 1 in pps[(2, 13)]


@pytest.mark.parametrize("env, argv, match", [
    ({}, ["--train.device", "cuda"], "train.device = 'cuda'"),
    ({"WORLD_SIZE": "16", "RANK": "0", "LOCAL_WORLD_SIZE": "8"}, [], "a world of 16 ranks over several nodes"),
])
def test_layout_auto_refused_where_its_measurements_do_not_describe_the_run(monkeypatch, capsys, env, argv, match):
    from dtensor_mimo.train import launch

    for key in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert launch.main(["--layout.auto", "true", *argv]) == 2
    err = capsys.readouterr().err
    assert match in err and "python -m dtensor_mimo.plan" in err, err


def test_mixed_precision_moves_half_the_bytes() -> None:
    """Under ``param_dtype = 'bf16'`` a module's activations (tp all-reduces, cp gathers, pp sends,
    the rows crossing) are bf16 and FSDP2 all-gathers its parameters in bf16
    (`dtensor_mimo.parallelize.precision`): the measured profile says 2 bytes for both, and an
    FSDP2 block's gather over dp = 2 moves its 1000 parameters x 2 bytes. A module left in fp32
    keeps 4 bytes."""
    pytest.importorskip("sklearn")
    from dtensor_mimo.train.plan import measure_profiles

    config = parse_args(["--options.language.param_dtype", "bf16"])
    profiles = {m["name"]: m for m in measure_profiles(config, log=lambda _: None)["job"]["modules"]}
    assert (profiles["language"]["act_bytes"], profiles["language"]["gather_bytes"]) == (2, 2)
    assert (profiles["vision"]["act_bytes"], profiles["vision"]["gather_bytes"]) == (4, None)
    p = dataclasses.replace(profile("language", fsdp=True), gather_bytes=2)
    f = module_cost(p, P(dp=2), 8, 1, FAST, range(2))
    gather = 2 * allgather_time(1000 * 2, 2, LINK) + allgather_time(500 * 2, 2, LINK)
    assert f.forward == pytest.approx(2 * (1e-3 + 40e-6) + gather)
    params = 2 * 1000 + 500  # fp32 state sharded over dp; one bf16 block and the bf16 rest gathered
    assert f.memory == pytest.approx(params * 16 / 2 + (1000 + 500) * 2 + 100 * 40 * 2)


def test_measured_job_of_items_of_their_own_size_parallelized_as_trained() -> None:
    """The modules are measured after the trainer's own `parallelize`: vision's checkpointed
    blocks keep a fraction of what audio's (the same blocks, the same width) keep."""
    pytest.importorskip("sklearn")
    from dtensor_mimo.train.datasets import train_data
    from dtensor_mimo.train.modules import resolve
    from dtensor_mimo.train.plan import measure_profiles

    config = parse_args(["--model.encoders.vision.dynamic_resolution", "true",
                         "--model.encoders.audio.variable_length", "true",
                         "--options.vision.activation_checkpointing", "1"])
    profiles = {m["name"]: m for m in measure_profiles(config, log=lambda _: None)["job"]["modules"]}
    assert profiles["vision"]["activation_bytes_per_token"] < profiles["audio"]["activation_bytes_per_token"] / 4
    batch = train_data(config, resolve(config)).train.batch(list(range(256)), load=None)
    for name in ("vision", "audio"):
        m = batch.modalities[name]
        assert m.varied
        drawn = sum(m.item_tokens) / batch.batch_size
        assert profiles[name]["tokens_per_sample"] == pytest.approx(drawn, rel=0.15), name


def test_a_conversation_corpus_smaller_than_the_measured_batches_is_measured(tmp_path, monkeypatch) -> None:
    """The README's planner command on the README's own LLaVA setup (`examples/llava_tiny.toml`,
    `make_tiny_llava.py`'s 512 samples; here 48, fewer than the 64 the probe reads too): the rows'
    timing read samples 1000.. of the corpus and raised IndexError ("sample 1000 of 512") before
    anything was measured. It reads them modulo the corpus."""
    pytest.importorskip("sklearn")
    import importlib.util
    import os

    from dtensor_mimo.train.plan import measure_profiles

    root = os.path.join(os.path.dirname(__file__), "..")
    spec = importlib.util.spec_from_file_location("make_tiny_llava", os.path.join(root, "examples",
                                                                                  "make_tiny_llava.py"))
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    make.write_checkpoints(str(tmp_path))
    make.write_data(str(tmp_path), train=48, val=16)
    monkeypatch.chdir(tmp_path)
    config = parse_args(["--config", os.path.abspath(os.path.join(root, "examples", "llava_tiny.toml"))])
    job = Job.from_dict(measure_profiles(config, log=lambda _: None)["job"])
    assert {m.name for m in job.modules} == {"image", "language"}
    assert job.rows(16) > 0


@pytest.mark.parametrize("command", [["dtensor_mimo.plan"], ["dtensor_mimo.train", "plan"]])
def test_planner_command_both_ways(command: list[str]) -> None:
    """``python -m dtensor_mimo.plan`` is ``python -m dtensor_mimo.train plan`` (the planner's
    package starts the application's command, it does not import it)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", *command, "--world", "0"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "--world and --top take integers >= 1, got '0'" in out.stderr, out.stderr


def test_paper_cluster_homogeneous_layouts_include_hsdp() -> None:
    """On the paper's 64 H100s (8 a node) the homogeneous layouts include each one's HSDP form,
    and the fastest is one: FSDP2 within a node, one all-reduce of a shard between nodes, ahead of
    every homogeneous layout sharding across all 64 (README's "At cluster scale" table)."""
    from dtensor_mimo.plan.paper import H100, best_uniform, paper_job, uniform_layouts

    job, device = paper_job(), H100.device()
    best = best_uniform(job, 64, device)
    plain = min((p for p in (predict(job, c, device) for c in uniform_layouts(job, 64)) if p.fits),
                key=lambda p: p.step_s)
    pars = best.candidate.parallelisms
    assert pars["language"].hsdp and pars["language"].dp // pars["language"].dp_replicate * pars["language"].tp == 8
    assert not any(p.hsdp for p in plain.candidate.parallelisms.values())
    assert best.step_s < 0.9 * plain.step_s


def test_gradients_are_reduced_in_the_reduce_dtype() -> None:
    """dp sums gradients in `ParallelOptions.gradient_reduce_dtype` (FSDP2's reduce-scatter, or the
    all-reduce without FSDP2): ``reduce_dtype = 'bf16'`` moves 2 bytes a gradient, ``param_dtype =
    'bf16'`` alone still 4 (fp32 sums). The measured profile says so, and the reduction is costed
    on it: 2500 parameters x 2 bytes over dp = 2."""
    pytest.importorskip("sklearn")
    from dtensor_mimo.train.plan import measure_profiles

    config = parse_args(["--options.vision.reduce_dtype", "bf16", "--options.language.param_dtype", "bf16"])
    profiles = {m["name"]: m for m in measure_profiles(config, log=lambda _: None)["job"]["modules"]}
    assert profiles["vision"]["reduce_bytes"] == 2
    assert profiles["language"]["reduce_bytes"] == 4 and profiles["audio"]["reduce_bytes"] is None
    params = 2 * 1000 + 500
    for fsdp in (True, False):
        p = dataclasses.replace(profile("language", fsdp=fsdp), reduce_bytes=2)
        c = module_cost(p, P(dp=2), 8, 1, FAST, range(2))
        expected = allgather_time(params * 2, 2, LINK) if fsdp else allreduce_time(params * 2, 2, LINK)
        assert c.reduce == pytest.approx(expected), fsdp


def test_an_encoders_load_is_its_items_not_the_rows_again(monkeypatch) -> None:
    """A rank builds the global batch's token rows once (`Job.rows`) and reads its encoders'
    items in the same call; `predict` adds each encoder's load to the rows. Token rows made slow
    (4 ms a sample) and items free: the rows cost 4 ms a sample, an encoder's load next to
    nothing (it was measured with the rows in it, counted again per encoder)."""
    pytest.importorskip("sklearn")
    import time

    from dtensor_mimo.train import datasets
    from dtensor_mimo.train.plan import measure_profiles

    real = datasets.train_data

    class SlowRows:
        def __init__(self, source):
            self.source = source

        def __getattr__(self, name):
            return getattr(self.source, name)

        def __len__(self):
            return len(self.source)

        def batch(self, indices, load=None, **kwargs):
            time.sleep(4e-3 * len(indices))
            return self.source.batch(indices, load=load, **kwargs)

    def slow(*args, **kwargs):
        data = real(*args, **kwargs)
        return dataclasses.replace(data, train=SlowRows(data.train))

    monkeypatch.setattr(datasets, "train_data", slow)
    job = Job.from_dict(measure_profiles(parse_args([]), log=lambda _: None)["job"])
    assert job.rows.per_token >= 4e-3
    for name in ("vision", "audio"):
        load = job.module(name).load
        assert load(32) < 0.25 * job.rows(32), (name, load, job.rows)


def test_fsdp_without_reshard_after_forward_holds_every_gathered_block() -> None:
    """``reshard_after_forward = False`` keeps each block's gathered parameters from its forward
    to its backward (`ParallelOptions`: "more memory, one all-gather less"): at the end of a
    forward every block of the rank is gathered at once, not one at a time. Two blocks of 1000
    fp32 parameters and the rest's 500, dp = 2 (the sharded state and the activations as in
    `test_module_cost_tp_and_fsdp_by_hand`)."""
    p = dataclasses.replace(profile("language", fsdp=True), reshard_after_forward=False)
    f = module_cost(p, P(dp=2), 8, 1, FAST, range(2))
    params = 2 * 1000 + 500
    assert f.memory == pytest.approx(params * 16 / 2 + (2 * 1000 + 500) * 4 + 100 * 40 * 2)
    # an encoder keeping its blocks gathered over the step's microbatches (`Accumulation`)
    kept = module_cost(dataclasses.replace(p, name="vision"), P(dp=2), 8, 2, FAST, range(2), held=2,
                       accumulates=True)
    assert kept.memory == pytest.approx(params * 16 / 2 + params * 4 + params * 4 + 100 * 20 * 2 * 2)


def test_fsdp_accumulating_microbatches_holds_whole_gradients_and_gathered_blocks() -> None:
    """The language model runs as torch's pipeline stages, which turn FSDP2's reduction and its
    reshard after backward off for every backward of a step but the last (`PipelineStage.
    backward_one_chunk`): from the first microbatch's backward on, every gradient is whole on
    each rank and every block of the stage stays gathered (checked on two gloo ranks: each of four
    FSDP2 Linear blocks holds its whole weight and a whole accumulated gradient at microbatches
    1-3 of a 1F1B step). Two blocks of 1000 fp32 parameters and a rest of 500, dp = 2, M = 2:
    the sharded state, all 2500 parameters gathered, 2500 whole fp32 gradients, activations.
    At M = 1 the one backward reduces as it goes: one block gathered, no whole gradients."""
    p = profile("language", fsdp=True)
    params = 2 * 1000 + 500
    two = module_cost(p, P(dp=2), 8, 2, FAST, range(2))
    assert two.memory == pytest.approx(params * 16 / 2 + params * 4 + params * 4 + 100 * 20 * 2)
    one = module_cost(p, P(dp=2), 8, 1, FAST, range(2))
    assert one.memory == pytest.approx(params * 16 / 2 + (1000 + 500) * 4 + 100 * 40 * 2)
    # an overlapped encoder's `Accumulation`: whole gradients, its blocks resharded after forward
    enc = module_cost(profile("vision", fsdp=True), P(dp=2), 8, 2, FAST, range(2), held=2, accumulates=True)
    assert enc.memory == pytest.approx(params * 16 / 2 + (1000 + 500) * 4 + params * 4 + 100 * 20 * 2 * 2)


def test_layout_auto_keeps_the_configured_pipeline_split(monkeypatch) -> None:
    """``pipeline.split`` (layers per decoder stage) is the user's, and ``layout.auto`` replaces
    only the layout and the microbatches (docs/trainer.md): the layout it chooses must have the
    stages the split gives, ``pp · virtual_stages = len(split)``, and the split's layers. A
    4-layer language model split (3, 1) over pp = 2: every ranked layout has language pp = 2
    (the planner proposed pp = 1 or 4 and the trainer then refused the split at build time,
    after the measurements), and its busiest stage holds 3 blocks, not the even split's 2."""
    from dtensor_mimo.schedule.config import stage_layers as layers_of
    from dtensor_mimo.train import plan as trainer_plan

    job = digits_job(batch_size=32)
    lang = dataclasses.replace(job.lang, n_layers=4)
    job = dataclasses.replace(job, modules=(*job.encoders, lang))
    monkeypatch.setattr(trainer_plan, "load_profiles", lambda *args, **kwargs: (job, FAST, "cache"))
    config = parse_args(["--layout.auto", "true", "--layout.language.pp", "2", "--pipeline.split", "[3, 1]",
                         "--model.language.n_layers", "4"])  # the profile's 4 blocks
    ranked = trainer_plan.plan(config, 4, top=1, log=lambda _: None)
    assert ranked
    for pred in ranked:
        par = pred.candidate.parallelisms["language"]
        assert par.pp == 2, pred.candidate.describe()
    planned = trainer_plan.auto_layout(config, 4, log=lambda _: None)
    pp = build_layout(planned, 4).parallelism("language").pp
    assert [len(r) for r in layers_of(4, pp, planned.pipeline.split)] == [3, 1]
    # costed on the split: the busiest stage runs 3 blocks, one more than the even split's 2, in
    # every slot of the pipeline (M microbatches + the 1F1B bubble of pp - 1), by hand
    pred = next(p for p in ranked if p.candidate.parallelisms["language"] in (P(pp=2), P(pp=2, dp=2)))
    cand, par = pred.candidate, pred.candidate.parallelisms["language"]
    m = cand.microbatches
    tokens = 32 // m / par.dp * lang.tokens_per_sample
    one_block = lang.block_forward(tokens) + lang.block_backward(tokens)
    even = predict(job, cand, FAST)
    assert pred.parts["language pipeline"] - even.parts["language pipeline"] == pytest.approx((m + 1) * one_block)


@pytest.mark.parametrize("name", ["vision_recomputed", "zero_bubble_fsdp"])
def test_the_planners_calibration_runs_are_layouts_the_library_builds(name: str, monkeypatch) -> None:
    """The planner measures the runtime's overhead and the collectives' cost from short real runs
    of the trainer (`calibrate_runtime`: encoders on rank 0, the language model on rank 1;
    `calibrate_collectives`: every module on every rank, dp = world). With options that refuse
    those layouts — an encoder recomputed in the colocated three phases (it must share the
    language model's ranks), a zero-bubble schedule with FSDP2 resharding after forward over
    dp > 1 — each run died in the spawned ranks on the library's LayoutError, and so did
    ``python -m dtensor_mimo.plan`` and ``layout.auto`` for every such config. Every run the
    calibration starts must pass the library's own `check_model` with the modules' options (as
    the calibration runs them: uncompiled)."""
    from dtensor_mimo.layout import torch_compat
    from dtensor_mimo.models import Llama, LlamaConfig, ModalityEncoder, Projection, ViT, ViTConfig
    from dtensor_mimo.schedule.checks import check_model
    from dtensor_mimo.schedule.config import PipelineConfig
    from dtensor_mimo.train import plan as trainer_plan

    monkeypatch.setattr(torch_compat, "RELEASE", (2, 13))
    options, schedule = OPTION_LIMITS[name]
    virtual = 2 if schedule != "1F1B" else 1
    limits = {n: trainer_plan.option_limits(options.get(n, ParallelOptions())) for n in ("vision", "language")}
    job = Job((dataclasses.replace(profile("vision", divides=(4, 64, 32)), **limits["vision"]),
               dataclasses.replace(profile("language", layers=4, tokens=32, cp=True, divides=(4, 2, 64, 64)),
                                   **limits["language"])),
              batch_size=8, schedule=schedule, virtual_stages=virtual)
    runs: list[tuple[dict, int]] = []

    def fake_run(config, layout, microbatches, *args, **kwargs) -> float:
        runs.append((layout, microbatches))
        return 0.5

    monkeypatch.setattr(trainer_plan, "_train_steps", fake_run)
    trainer_plan.calibrate_runtime(None, job, FAST, log=lambda _: None)
    trainer_plan.calibrate_collectives(None, job, FAST, 2, log=lambda _: None)
    assert runs
    llama = Llama(LlamaConfig.tiny(n_layers=4))
    encoders = {"vision": ModalityEncoder(ViT(ViTConfig.tiny()), Projection(32, 32))}
    for layout, m in runs:
        mimo = MimoLayout({n: P(**{k: v for k, v in keys.items() if k != "offset"}) for n, keys in layout.items()},
                          offsets={n: keys["offset"] for n, keys in layout.items()})
        try:
            check_model(mimo, llama, encoders, "language", options,
                        PipelineConfig(microbatches=m, schedule=schedule, virtual_stages=virtual))
        except (LayoutError, ValueError) as e:
            pytest.fail(f"the planner's calibration runs {layout} (M={m}), which the library refuses: {e}")


def test_a_compiled_encoder_of_items_of_their_own_size_is_planned_where_its_batches_train(monkeypatch) -> None:
    """An encoder of items of their own size compiled (``options.vision.compile``, by blocks) cannot
    train at tp > 1: the library refuses every training batch there (`check_batch`, torch's tracer
    of the packed items' backward). The measured profile says the items vary and the encoder is
    compiled, and every layout the planner ranks (``layout.auto`` trains the first) passes the
    library's own `check_batch` on a real batch of the run's data and the trainer's config check;
    the planner proposed vision at tp = 2 and the run failed at its first step, after planning."""
    pytest.importorskip("sklearn")
    from dtensor_mimo.schedule.checks import check_batch
    from dtensor_mimo.train import plan as trainer_plan
    from dtensor_mimo.train.datasets import train_data
    from dtensor_mimo.train.modules import resolve

    config = parse_args(["--layout.auto", "true", "--model.encoders.vision.dynamic_resolution", "true",
                         "--options.vision.compile", "true", "--data.batch_size", "8"])
    job = Job.from_dict(trainer_plan.measure_profiles(config, log=lambda _: None)["job"])
    monkeypatch.setattr(trainer_plan, "load_profiles", lambda *args, **kwargs: (job, FAST, "cache"))
    ranked = trainer_plan.plan(config, 4, top=1, log=lambda _: None)
    assert ranked
    batch = train_data(config, resolve(config)).train.batch(list(range(8)), load=None)
    assert batch.modalities["vision"].varied
    for pred in ranked:
        cand = pred.candidate
        try:
            check_batch(cand.layout(4), "language", ["vision", "audio"], batch, compiled={"vision", "audio"})
        except ValueError as e:
            pytest.fail(f"the planner proposed {cand.describe()} (M={cand.microbatches}), whose batches the "
                        f"library refuses: {e}")
        check_config(trainer_plan.with_candidate(config, entry(pred)), 4)


@pytest.mark.parametrize("argv", [
    ["--options.vision.balance", "true"],  # balance needs dp > 1 (the trainer's check_module_options)
    ["--options.vision.recompute_colocated", "true", "--options.vision.compile", "true"],  # tp 1 or M = 1
])
def test_every_layout_the_planner_ranks_passes_the_trainers_config_check(monkeypatch, argv: list[str]) -> None:
    """``layout.auto`` trains the planner's first choice and ``--json`` writes the ranked list as
    trainer overrides: each must pass the trainer's own config check (`check_config`, whose
    `check_module_options` refuses an encoder balanced at dp = 1, a compiled tp encoder recomputed
    over microbatches). The planner proposed such layouts (the first choice, for balance), and the
    run with them was refused, or trained against the trainer's rules, after planning."""
    from dtensor_mimo.train import plan as trainer_plan
    from dtensor_mimo.train.config import ConfigError

    config = parse_args(["--layout.auto", "true", *argv])
    job = digits_job(batch_size=config.data.batch_size)
    monkeypatch.setattr(trainer_plan, "load_profiles", lambda *args, **kwargs: (job, FAST, "cache"))
    ranked = trainer_plan.plan(config, 4, top=1, log=lambda _: None)
    assert ranked
    for pred in ranked:
        try:
            check_config(trainer_plan.with_candidate(config, entry(pred)), 4)
        except ConfigError as e:
            pytest.fail(f"the planner proposed {pred.candidate.describe()} (M={pred.candidate.microbatches}), "
                        f"which the trainer refuses: {e}")
    check_config(trainer_plan.auto_layout(config, 4, log=lambda _: None), 4)


def plain_decoder(vocab_size: int, seq_len: int):
    """A factory's decoder (``model.language.factory = 'tests.test_plan:plain_decoder'``): the
    library's tiny Llama as a class of the user's, which meets the language protocol but has no
    tensor parallel plan (no ``parallelize``) nor an attention core to swap (no ``set_attention_fn``)."""
    from torch import nn

    from dtensor_mimo.models import Llama, LlamaConfig

    plain = type("PlainDecoder", (nn.Module,), {k: v for k, v in vars(Llama).items()
                                                if k not in ("__dict__", "__weakref__", "__init__", "parallelize",
                                                             "set_attention_fn")})
    module = Llama(LlamaConfig.tiny(vocab_size=vocab_size, max_seq_len=seq_len))
    module.__class__ = plain
    return module


def test_a_decoder_without_a_tensor_parallel_plan_is_planned_without_tp_or_cp(monkeypatch) -> None:
    """A factory decoder with no ``parallelize`` (tensor parallel plan) nor ``set_attention_fn``
    (context parallel) is refused by the library at tp > 1 or cp > 1 (`check_model`, the language
    protocol). Every layout the planner ranks for it, from its measured profile, passes the
    library's own `check_model` with the real modules; the planner proposed language tp = 2 and
    cp = 2 (two thirds of the layouts of 4 ranks), each failing in the ranks after planning."""
    pytest.importorskip("sklearn")
    from dtensor_mimo.schedule.checks import check_model
    from dtensor_mimo.schedule.config import PipelineConfig
    from dtensor_mimo.train import plan as trainer_plan
    from dtensor_mimo.train.datasets import train_data
    from dtensor_mimo.train.modules import build_modules, resolve

    config = parse_args(["--layout.auto", "true", "--model.language.factory", "tests.test_plan:plain_decoder",
                         "--data.batch_size", "8"])
    job = Job.from_dict(trainer_plan.measure_profiles(config, log=lambda _: None)["job"])
    monkeypatch.setattr(trainer_plan, "load_profiles", lambda *args, **kwargs: (job, FAST, "cache"))
    ranked = trainer_plan.plan(config, 4, top=1, log=lambda _: None)
    assert ranked
    resolved = resolve(config)
    modules = build_modules(config, resolved, train_data(config, resolved).seq_len)
    language = modules.pop("language")
    options = {n: config.module_options(n) for n in config.module_names}
    for pred in ranked:
        cand = pred.candidate
        try:
            check_model(cand.layout(4), language, modules, "language", options,
                        PipelineConfig(microbatches=cand.microbatches, schedule=config.pipeline.schedule,
                                       virtual_stages=config.pipeline.virtual_stages))
        except (LayoutError, TypeError, ValueError) as e:
            pytest.fail(f"the planner proposed {cand.describe()} (M={cand.microbatches}), which the library "
                        f"refuses: {e}")


def test_only_a_tied_decoder_is_measured_with_a_head_copy() -> None:
    """`ModuleProfile.tied_params`, which the planner adds where one rank holds a tied decoder's first
    and last stages (`module_cost`): the embedding's size for a decoder whose head is its embedding
    (counted once in its parameters), none for an untied one (the default), whose head is a
    parameter of its own already counted."""
    pytest.importorskip("sklearn")
    import torch

    from dtensor_mimo.models import Llama
    from dtensor_mimo.train import plan as trainer_plan
    from dtensor_mimo.train.datasets import train_data
    from dtensor_mimo.train.modules import build_modules, resolve

    config = parse_args(["--options.language.compile", "false"])
    resolved = resolve(config)
    data = train_data(config, resolved)
    torch.manual_seed(0)
    modules = build_modules(config, resolved, data.seq_len, meta=False)
    probe = data.train.batch(list(range(8)), load=None)
    untied = modules["language"]
    assert not untied.config.tie_embeddings and untied.output.weight is not untied.tok_embeddings.weight
    tied = Llama(dataclasses.replace(untied.config, tie_embeddings=True))
    embedding = untied.tok_embeddings.weight.numel()
    for llama, want in ((untied, 0), (tied, embedding)):
        profile = trainer_plan._measure_module(config, resolved, data, {**modules, "language": llama}, probe,
                                               data.seq_len, "language", None, lambda load: Affine(),
                                               lambda _: None)
        assert profile.tied_params == want
        assert profile.params == sum(p.numel() for p in llama.parameters())  # the tied one once


def test_a_frozen_decoder_is_measured_with_the_backward_through_it() -> None:
    """``model.language.frozen``: the decoder takes no weight gradients, but its backward still
    runs, carrying the loss's gradients to the projections' rows (the trainer's FLOPs count it),
    and its blocks keep their activations for it. The planner measured the
    frozen decoder on token ids alone: no gradient anywhere, so no backward (block_backward ~0,
    a third of a nanosecond a token) and no activations (0 bytes a token): every layout's language
    time and memory came out too low. Reference: the bytes autograd keeps for one block of the
    frozen decoder whose input takes a gradient (as the assembled rows do), counted here (no timing:
    before, 0 bytes were kept, as no backward ran)."""
    pytest.importorskip("sklearn")
    import torch

    from dtensor_mimo.train import plan as trainer_plan
    from dtensor_mimo.train.datasets import train_data
    from dtensor_mimo.train.modules import build_modules, resolve

    config = parse_args(["--model.language.frozen", "true", "--options.language.compile", "false"])
    resolved = resolve(config)
    data = train_data(config, resolved)
    torch.manual_seed(0)
    modules = build_modules(config, resolved, data.seq_len, meta=False)
    probe = data.train.batch(list(range(64)), load=None)
    profile = trainer_plan._measure_module(config, resolved, data, modules, probe, data.seq_len, "language", None,
                                           lambda load: Affine(), lambda _: None)
    assert profile.trainable_params == 0  # no weight gradients, no optimizer state
    llama = build_modules(config, resolved, data.seq_len, meta=False)["language"]
    tokens = 8 * data.seq_len
    h = llama.tok_embeddings(torch.randint(0, llama.config.vocab_size, (8, data.seq_len))).detach().requires_grad_()

    weights = {p.untyped_storage().data_ptr() for p in llama.parameters()}  # (a weight is no activation)

    def kept_bytes() -> int:
        kept: dict[int, int] = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            assert llama(h=h).requires_grad
        return sum(kept.values())

    full = kept_bytes()
    blocks, llama.layers = llama.layers, torch.nn.ModuleDict()
    rest = kept_bytes()
    llama.layers = blocks
    per_block = (full - rest) / len(blocks) / tokens
    assert per_block > 0
    assert profile.activation_bytes_per_token == pytest.approx(per_block, rel=0.05)
