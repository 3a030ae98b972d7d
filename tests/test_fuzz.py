"""Random layouts x random ragged batches against the single-process oracle; random malformed
input that must fail on every rank, never hang (hypothesis).

| drawn                                                        | expected                               |
|--------------------------------------------------------------|----------------------------------------|
| placement: disjoint / colocated / encoders sharing ranks;     | loss, grad norm, every gradient and     |
| vision pp·dp·tp (pp on ranks of its own), audio dp·tp on      | post-step weight == the single-process  |
| vision's ranks, language dp·tp·cp·pp (world <= 4), HSDP where | run's (`tests.test_mimo`'s oracle, its  |
| dp is even; per module sp (tp > 1), FSDP2 or not, dp sums     | tolerance); every encoder rank encoded  |
| during backward or after, in one bucket or many, resharding,  | its planned share; HSDP on FSDP2's 2-D  |
| activation checkpointing, an encoder's `balance` and          | mesh; one hop never scatters or         |
| (colocated) recomputation, logits sharded or gathered, head   | gathers; the head on the rows with a    |
| chunked or not; microbatches and every schedule (virtual      | loss weight only (none counted where a  |
| stages: a deeper model); one or two bridge hops; packed rows; | microbatch has none)                   |
| a frozen ViT, audio tower or whole vision; batch size (fewer  |                                        |
| samples than language dp ranks unpipelined), two steps'       |                                        |
| lengths, a step with no item at all; items of their own size; |                                        |
| meta init; predict; the head's chunk small                    |                                        |
| a valid layout + one malformation: microbatches that do not   | every rank raises, the error naming     |
| cut the batch, tokens_per_item or image size the encoder does | what is wrong (no rank left waiting:    |
| not make / take, a modality the model lacks, one rank fed     | the harness times out otherwise)       |
| another batch                                                 |                                        |

The suite runs a few derandomized examples (two drawn from `SUITE_SEED`, plus `RICH`; about 30 s
on 2 cores);
``make fuzz`` runs
``DTENSOR_MIMO_FUZZ_EXAMPLES`` (default there: 40) random ones. Layouts the library refuses by
design (checked in this process with its own pure checks) are skipped, not drawn around.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, assume, example, given, seed, settings
from hypothesis import strategies as st

from dtensor_mimo import LayoutError, ParallelOptions, Parallelism, PipelineConfig
from dtensor_mimo.schedule import check_microbatching
from dtensor_mimo.schedule.checks import check_batch, check_model
from dtensor_mimo.schedule.config import MULTI_STAGE_SCHEDULES, SCHEDULES, check_pipeline_layout
from tests.harness import run_on_ranks
from tests.test_mimo import (Case, _batches, _modules, check_against_reference, check_encoded_shares, check_hsdp_meshes,
                             check_route)

EXAMPLES = int(os.environ.get("DTENSOR_MIMO_FUZZ_EXAMPLES", "0"))
"""0: the suite's few derandomized examples; N: N random ones (``make fuzz``)."""
FUZZ = settings(max_examples=EXAMPLES or 2, derandomize=not EXAMPLES, deadline=None, database=None,
                suppress_health_check=list(HealthCheck), print_blob=True)
SUITE_SEED = seed(31) if not EXAMPLES else (lambda test: test)
"""The suite's draws: the simplest case, then one of a bit of everything at 2 layers and no pipeline
(colocated tp·dp HSDP vision with sp, recomputed, beside cp·dp language, items of their own size,
two hops, predict), whatever the test's source (a derandomized draw follows its hash otherwise)."""
WORLD = 4


def _parallelism(draw, dp: int, tp: int, **sizes: int) -> Parallelism:
    """`dp` x `tp` (and `sizes`), HSDP (two replica groups) drawn where dp allows."""
    return Parallelism(dp=dp, tp=tp, dp_replicate=draw(st.sampled_from([1, 2])) if dp % 2 == 0 else 1, **sizes)


def _options(draw, par: Parallelism, encoder: bool, colocated: bool) -> ParallelOptions:
    """One module's options: sp where tp > 1, FSDP2 or not (HSDP needs it), the dp sums during or
    after backward (in buckets of 32 MiB or of a few parameters), resharding, activation
    checkpointing; an encoder's balance and, colocated, its recomputation; the language model's
    logits sharded or gathered over tp, its head chunked or not."""
    return ParallelOptions(sp=par.tp > 1 and draw(st.booleans()), fsdp=par.hsdp or draw(st.booleans()),
                           overlap_grad_reduce=draw(st.booleans()), grad_bucket_mb=draw(st.sampled_from([32.0, 1e-3])),
                           reshard_after_forward=draw(st.booleans()),
                           activation_checkpointing=draw(st.sampled_from([0, 1, 2])),
                           balance=draw(st.sampled_from([None, True, False])) if encoder and par.pp == 1 else None,
                           recompute_colocated=encoder and colocated and draw(st.booleans()),
                           loss_parallel=encoder or draw(st.booleans()), chunked_loss=encoder or draw(st.booleans()))


@st.composite
def cases(draw) -> Case:
    placement = draw(st.sampled_from(["disjoint", "colocated", "shared"]))
    tp = st.sampled_from([1, 2])
    if placement == "colocated":  # vision and language over the same ranks
        world = draw(st.sampled_from([2, 4]))
        v_tp = draw(tp)
        l_tp, l_cp = draw(tp), draw(st.sampled_from([1, 2]))
        l_pp = draw(st.sampled_from([1, 2]))
        l_dp = world // (l_tp * l_cp * l_pp)
        assume(l_dp >= 1 and world % (l_tp * l_cp * l_pp) == 0)
        modules = {"vision": _parallelism(draw, world // v_tp, v_tp),
                   "language": _parallelism(draw, l_dp, l_tp, cp=l_cp, pp=l_pp)}
        offsets = {"vision": 0, "language": 0}
    else:
        v_dp, v_tp = draw(st.sampled_from([1, 2, 3])), draw(tp)
        v_pp = draw(st.sampled_from([1, 2])) if placement == "disjoint" else 1  # encoder stages: ranks of its own
        language = _parallelism(draw, draw(st.sampled_from([1, 2])), draw(tp), cp=draw(st.sampled_from([1, 2])),
                                pp=draw(st.sampled_from([1, 2])))
        vision = _parallelism(draw, v_dp, v_tp, pp=v_pp)
        assume(vision.size + language.size <= WORLD)
        if placement == "shared":  # audio on vision's ranks, its own dp x tp of them
            a_tp = draw(st.sampled_from([t for t in (1, 2) if vision.size % t == 0]))
            modules = {"vision": vision, "audio": _parallelism(draw, vision.size // a_tp, a_tp), "language": language}
            offsets = {"vision": 0, "audio": 0, "language": vision.size}
        else:
            modules, offsets = {"vision": vision, "language": language}, None
    lang = modules["language"]
    microbatches = draw(st.sampled_from([1, 2, 4]))
    # a static-shape pipeline: even microbatches and dp shards
    pipelined = microbatches > 1 or any(p.pp > 1 for p in modules.values())
    schedule = draw(st.sampled_from(SCHEDULES)) if pipelined else "1F1B"
    virtual_stages = 2 if schedule in MULTI_STAGE_SCHEDULES else 1
    batch_size = draw(st.integers(1, 3)) * microbatches * lang.dp if pipelined else draw(st.integers(1, 6))
    assume(batch_size <= 8)
    varied = draw(st.booleans())  # items of their own size (images, clips)
    lengths = [64, 96] if "audio" in modules or varied else [32, 48, 64]  # room for every item of a sample
    seq_lens = tuple(draw(st.sampled_from(lengths)) for _ in range(2))
    frozen = draw(st.sampled_from([(), ("vision.encoder",), ("vision",)]
                                  + ([("audio.encoder",), ("vision.encoder", "audio.encoder")]
                                     if "audio" in modules else [])))
    return Case(modules, offsets=offsets,
                options={n: _options(draw, par, n != "language", placement == "colocated")
                         for n, par in modules.items()},
                varied=varied, packed=draw(st.booleans()), batch_size=batch_size, seq_lens=seq_lens,
                n_layers=max(2, lang.pp * virtual_stages), frozen=frozen,
                pipeline=PipelineConfig(microbatches=microbatches, schedule=schedule,
                                        virtual_stages=virtual_stages) if pipelined else None,
                bridge_hops=draw(st.sampled_from([None, 1, 2])),
                text_only_steps=(1,) if draw(st.booleans()) else (), meta=draw(st.booleans()),
                predict=draw(st.booleans()), loss_chunk_rows=draw(st.sampled_from([None, 16])))


def _refused(case: Case) -> str | None:
    """The library's own pure verdict on `case` (None: it trains)."""
    try:
        layout = case.layout()
        llama, encoders = _modules(case.encoders, case.frozen, case.n_layers, meta=True, varied=case.varied)
        check_model(layout, llama, encoders, "language", case.options, case.pipeline)
        check_pipeline_layout(layout, "language", case.pipeline)
        for batch in _batches(case.encoders, case.packed, case.batch_size, case.seq_lens,
                              text_only=case.text_only_steps, varied=case.varied):
            check_batch(layout, "language", list(case.encoders), batch)  # e.g. varied items at encoder pp > 1
        if case.pipeline is not None:  # unpipelined, dp shards may be uneven (a language rank without samples)
            check_microbatching(case.batch_size, case.pipeline.microbatches, layout.parallelism("language").dp)
    except (LayoutError, ValueError, TypeError) as e:
        return str(e)
    return None


# Hypothesis starts from the simplest draw; this one has a bit of everything (shared encoder
# ranks, language pp2 with two microbatches, packed rows, a frozen ViT, a text-only step).
RICH = Case({"vision": Parallelism(), "audio": Parallelism(), "language": Parallelism(pp=2)},
            offsets={"vision": 0, "audio": 0, "language": 1}, packed=True, batch_size=4, seq_lens=(48, 64),
            frozen=("vision.encoder",), pipeline=PipelineConfig(microbatches=2), text_only_steps=(1,))


@FUZZ
@SUITE_SEED
@example(case=RICH)
@given(case=cases())
def test_random_layouts_and_batches_match_the_single_process_run(case: Case) -> None:
    assume(_refused(case) is None)
    per_rank = check_against_reference(case, chosen=False)
    check_encoded_shares(case, per_rank, chosen=False)
    check_hsdp_meshes(case, per_rank)
    if case.bridge_hops != 2:  # two hops scatter and gather only where the receiving side replicates rows
        check_route(case, per_rank)


# ------------------------------------------------------------------ malformed input


MALFORMED = {
    "microbatches": "cannot be cut into",
    "tokens_per_item": "the batch's 'vision' items do not fit encoder 'vision'",
    "image_size": "the batch's 'vision' items do not fit encoder 'vision'",
    "unknown_modality": "audio",
    "different_batch": "the ranks were fed different batches",
}


def _malformed_step(case: Case, malformation: str) -> str | None:
    """One step of `case` with `malformation`: this rank's error, or None."""
    from dtensor_mimo import MimoModel, MimoOptimizer
    from dtensor_mimo.data import ModalitySpec, SyntheticSpec, synthetic_batch
    from dtensor_mimo.optim.step import train_step
    from tests.test_mimo import MODALITIES, OPT, _batches

    llama, encoders = _modules(case.encoders)
    model = MimoModel(case.layout(), llama, encoders, options=case.options, pipeline=case.pipeline)
    optimizer = MimoOptimizer(model, OPT)
    batch = _batches(case.encoders, case.packed, case.batch_size, case.seq_lens[:1])[0]
    vision = MODALITIES["vision"]
    if malformation == "microbatches":
        batch = _batches(case.encoders, case.packed, case.batch_size + 1, case.seq_lens[:1])[0]
    elif malformation in ("tokens_per_item", "image_size"):
        wrong = (ModalitySpec(vision.special_token_id, vision.item_shape, tokens_per_item=8, max_items=2)
                 if malformation == "tokens_per_item" else
                 ModalitySpec(vision.special_token_id, (3, 20, 20), tokens_per_item=16, max_items=2))
        spec = SyntheticSpec.tiny(modalities={"vision": wrong}, batch_size=case.batch_size)
        batch = synthetic_batch(dataclasses.replace(spec, seq_len=case.seq_lens[0]), seed=0)
    elif malformation == "unknown_modality":
        spec = SyntheticSpec.tiny(modalities={"vision": vision, "audio": MODALITIES["audio"]},
                                  batch_size=case.batch_size)
        batch = synthetic_batch(dataclasses.replace(spec, seq_len=case.seq_lens[0]), seed=0)
    elif malformation == "different_batch" and dist.get_rank() == dist.get_world_size() - 1:
        batch = _batches(case.encoders, case.packed, case.batch_size, case.seq_lens[1:])[0]
    try:
        train_step(model, optimizer, batch)
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return f"{type(e).__name__}: {e}"
    return None


@st.composite
def malformed(draw) -> tuple[Case, str]:
    vision = Parallelism(dp=draw(st.sampled_from([1, 2])))
    language = Parallelism(dp=draw(st.sampled_from([1, 2])))
    colocated = draw(st.booleans())
    if colocated:
        vision = language = Parallelism(dp=2)
    mb = draw(st.sampled_from([1, 2]))
    case = Case({"vision": vision, "language": language}, offsets={"vision": 0, "language": 0} if colocated else None,
                batch_size=2 * mb * language.dp, seq_lens=(48, 64),
                pipeline=PipelineConfig(microbatches=mb) if mb > 1 else None)
    kinds = [k for k in MALFORMED if k != "microbatches" or mb > 1]  # unpipelined, dp shards may be uneven
    return case, draw(st.sampled_from(kinds))


@FUZZ
@given(drawn=malformed())
def test_malformed_input_fails_on_every_rank(drawn: tuple[Case, str]) -> None:
    case, malformation = drawn
    errors = run_on_ranks(_malformed_step, case.layout().world_size, case, malformation, timeout=120)
    for rank, error in enumerate(errors):
        assert error is not None, f"rank {rank} took a {malformation} step without an error"
        assert MALFORMED[malformation] in error, f"rank {rank}: {error}"


@pytest.mark.skipif(not EXAMPLES, reason="a spot check of the strategy, for `make fuzz`")
def test_strategy_draws_every_placement() -> None:
    seen = set()

    @settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=cases())
    def draw(case: Case) -> None:
        seen.add("shared" if "audio" in case.modules else "colocated" if case.offsets else "disjoint")

    draw()
    assert seen == {"disjoint", "colocated", "shared"}
