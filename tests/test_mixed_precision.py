"""bf16 mixed precision against single-process references (`tests/test_mimo.py`'s oracle).

`ParallelOptions(param_dtype=bf16)`: FSDP2 modules all-gather bf16 parameters (its
`MixedPrecisionPolicy`, gradients reduced in fp32); modules without FSDP2 run their forward under
autocast; fp32 master weights and AdamW state everywhere; encoder rows and pipeline hidden states
cross in bf16. The reference is the same model in one process with its forward under
``torch.autocast("cpu", bfloat16)``.

| case        | vision (ranks)       | language (ranks)              | world | notes                             |
|-------------|----------------------|-------------------------------|-------|-----------------------------------|
| fsdp_tp     | dp2, FSDP2 bf16 (0-1)| tp2 + sp, autocast (2-3)      | 4     | vocab-parallel loss, bf16 bridge, compiled language |
| colocated   | dp2, FSDP2 bf16 (0-1)| dp2, FSDP2 bf16 (0-1)         | 2     | both modules FSDP2 mixed precision|
| pipelined   | dp2, autocast (0-1)  | pp2, autocast (2-3)           | 4     | 1F1B, 4 microbatches, bf16 stage links, compiled vision, all-reduce in fp32 |

Tolerances (bf16 has 8 mantissa bits, 2^-8 = 0.4%; FSDP2 also runs norms in bf16, which autocast
keeps in fp32): loss within 0.1% of the reference, global gradient norm within 1%, every
gradient within 8% of its norm, every post-step weight within 3e-3 (measured: 0.003%, 0.15%,
4.1%, 1.5e-3). Every Linear of every rank computes in bf16. Over 20 steps the bf16 run's loss stays within 2% of the fp32
reference's.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

from dtensor_mimo import ParallelOptions, Parallelism, PipelineConfig
from tests.harness import run_on_ranks
from tests.test_mimo import Case, _distributed, _reference
from tests.test_mimo import _batches as _unweighted_batches

P = Parallelism
BF16 = ParallelOptions(param_dtype="bf16")
CASES = {
    "fsdp_tp": Case({"vision": P(dp=2), "language": P(tp=2)},
                    options={"vision": BF16, "language": ParallelOptions(sp=True, param_dtype=torch.bfloat16,
                                                                         compile=True, compile_backend="aot_eager")}),
    "colocated": Case({"vision": P(dp=2), "language": P(dp=2)}, offsets={"vision": 0, "language": 0},
                      options={"vision": BF16, "language": BF16}),
    "pipelined": Case({"vision": P(dp=2), "language": P(pp=2)},
                      options={"vision": ParallelOptions(param_dtype="bf16", fsdp=False, compile=True,
                                                         compile_backend="aot_eager"), "language": BF16},
                      pipeline=PipelineConfig(microbatches=4), batch_size=8, n_layers=4),
}


def _reference_for(case: Case, autocast: torch.dtype | None) -> list[dict]:
    return _reference(case.encoders, case.packed, case.frozen, case.batch_size, case.n_layers,
                      case.seq_lens, autocast, case.distinct_batches)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Error norm over the reference's norm; a gradient that is zero in exact arithmetic (a key
    bias: softmax ignores it) is measured against a floor of 1e-4 instead of its rounding noise."""
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-4))


def bf16_step_totals(records: list[dict], want: dict, step: int) -> dict[str, dict]:
    """Every rank's loss and grad norm of `step` against the bf16 autocast reference `want` (loss
    0.1%, norm 1%); the ranks' gradients and weights merged by name."""
    got: dict[str, dict] = {"grads": {}, "weights": {}}
    for r in records:
        assert r["loss"] == pytest.approx(want["loss"], rel=1e-3), f"step {step}: loss"
        assert r["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-2), f"step {step}: norm"
        for kind in got:
            got[kind].update(r[kind])
    return got


def _distributed_recording_dtypes(case: Case) -> tuple[list[dict], set[torch.dtype]]:
    """`_distributed`, plus the dtypes every Linear layer on this rank produced."""
    seen: set[torch.dtype] = set()

    def record(module: nn.Module, _args: tuple, output: object) -> None:
        if isinstance(module, nn.Linear):
            seen.add(output.dtype)

    handle = register_module_forward_hook(record)
    try:
        return _distributed(case), seen
    finally:
        handle.remove()


@pytest.mark.parametrize("name", list(CASES))
def test_bf16_matches_autocast_reference(name: str) -> None:
    case = CASES[name]
    expected = _reference_for(case, torch.bfloat16)
    per_rank = run_on_ranks(_distributed_recording_dtypes, case.layout().world_size, case, timeout=300)
    assert [dtypes for _, dtypes in per_rank] == [{torch.bfloat16}] * len(per_rank), "not all matmuls in bf16"
    for step, want in enumerate(expected):
        got = bf16_step_totals([records[step] for records, _ in per_rank], want, step)
        for param, value in want["grads"].items():
            assert got["grads"][param].dtype == torch.float32, f"{param}: gradient not fp32"
            assert _relative(got["grads"][param], value) < 8e-2, f"step {step} grad {param}"
        for param, value in want["weights"].items():
            assert got["weights"][param].dtype == torch.float32, f"{param}: master weight not fp32"
            torch.testing.assert_close(got["weights"][param], value, rtol=0, atol=3e-3,
                                       msg=lambda m: f"step {step} weight {param}: {m}")


def test_bf16_tracks_fp32_loss_over_20_steps() -> None:
    case = dataclasses.replace(CASES["fsdp_tp"], seq_lens=(64,) * 20, distinct_batches=2)
    fp32 = [r["loss"] for r in _reference_for(case, None)]
    per_rank = run_on_ranks(_distributed, case.layout().world_size, case, timeout=300)
    bf16 = [r["loss"] for r in per_rank[0]]
    assert bf16 == pytest.approx(fp32, rel=2e-2)
    assert fp32[-1] < 0.8 * fp32[0]  # it learns the two batches: the curves are not flat lines


def _weighted_batches(*args, **kwargs):
    """`tests.test_mimo._batches` with fractional loss weights: every loss mask divided by 3 (a
    per-sample weighting such as 1 / tokens gives such weights; bf16 rounds 1/3 up by 0.2%)."""
    return [dataclasses.replace(b, loss_mask=b.loss_mask / 3) for b in _unweighted_batches(*args, **kwargs)]


@contextlib.contextmanager
def _weighted():
    """`tests.test_mimo`'s runs on `_weighted_batches` inside the block."""
    import tests.test_mimo as test_mimo

    test_mimo._batches = _weighted_batches
    try:
        yield
    finally:
        test_mimo._batches = _unweighted_batches


def _distributed_weighted(case: Case) -> list[dict]:
    with _weighted():
        return _distributed(case)


@pytest.mark.parametrize("name", ["colocated", "pipelined"])
def test_fractional_loss_weights_keep_their_precision(name: str) -> None:
    """The loss weights (`MimoBatch.loss_mask`, fractional) weigh each token's loss in fp32 under
    FSDP2's bf16 policy too, as under autocast: FSDP2 casts a root's floating forward inputs to
    `param_dtype`, which would round the language stage's loss weights to bf16 while the
    normalizer sums the fp32 ones (a loss and gradients 0.2% too large at weights of 1/3)."""
    case = dataclasses.replace(CASES[name], seq_lens=(64,))
    if name == "pipelined":  # the language stages under FSDP2 (dp2), the encoder on its own ranks
        case = dataclasses.replace(case, modules={"vision": P(dp=2), "language": P(pp=2, dp=2)})
    with _weighted():
        expected = _reference.__wrapped__(case.encoders, case.packed, case.frozen, case.batch_size, case.n_layers,
                                          case.seq_lens, torch.bfloat16)
    for records in run_on_ranks(_distributed_weighted, case.layout().world_size, case, timeout=300):
        if records:
            assert records[0]["loss"] == pytest.approx(expected[0]["loss"], rel=1e-3)


def _fp16_models() -> list[str]:
    """MimoModels on one rank with vision in fp16: frozen (accepted), then trained (refused)."""
    from dtensor_mimo import MimoLayout, MimoModel
    from tests.test_mimo import _modules

    fp16 = {"vision": ParallelOptions(param_dtype="fp16")}
    layout = MimoLayout({"vision": Parallelism(), "language": Parallelism()}, offsets={"vision": 0, "language": 0})
    MimoModel(layout, *_modules(("vision",), frozen=("vision",)), options=fp16)
    try:
        MimoModel(layout, *_modules(("vision",)), options=fp16)
    except ValueError as e:
        return [str(e)]
    return []


def test_fp16_compute_is_refused_for_a_module_that_trains() -> None:
    """fp16 has 5 exponent bits: trained without loss scaling (the library has none), gradients
    below 6e-8 flush to zero. With the loss normalised by a global batch's tokens that is most
    of them: the `colocated` case at 16 x 256 tokens under ``param_dtype=float16`` gave the
    language model's wk / wq gradients 57% / 45% away from fp32's (bf16: at most 1.2%), growing
    with the batch. A module that trains in it is refused by name when the model is built; a
    frozen one (no gradients) computes in fp16."""
    assert ParallelOptions(param_dtype="fp16").param_dtype is torch.float16
    message, = run_on_ranks(_fp16_models, 1, timeout=60)[0]
    assert "ParallelOptions(param_dtype=torch.float16) for ['vision']: trains without loss scaling" in message
    assert "'bf16'" in message

@pytest.mark.parametrize("name", ["param_dtype", "reduce_dtype"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_dtypes_are_refused_by_name(name: str, dtype: torch.dtype) -> None:
    """A float8 dtype is a floating dtype to torch (``is_floating_point``), but neither FSDP2's
    policy nor autocast computes or sums in it: measured on 1-2 gloo ranks, ``param_dtype=
    torch.float8_e4m3fn`` without FSDP2 trained in fp32 (CPU autocast turns itself off for a dtype
    it lacks: the loss was fp32's to the last digit), and with FSDP2 (dp2), as
    ``reduce_dtype=torch.float8_e5m2`` without it, the first step raised "Invalid scalar type",
    naming neither the option nor the module. Refused when the options are made, pointing at the
    float8 training the library does offer (`ParallelOptions.fp8`)."""
    with pytest.raises(TypeError, match=rf"{name}={dtype}.*fp8='tensorwise'"):
        ParallelOptions(**{name: dtype})


def _fp16_language_models() -> list[str]:
    """MimoModels on one rank with a frozen language model in fp16: beside a frozen encoder
    (accepted: no gradient anywhere), then beside one that trains (refused)."""
    from dtensor_mimo import MimoLayout, MimoModel
    from tests.test_mimo import _modules

    fp16 = {"language": ParallelOptions(param_dtype="fp16")}
    layout = MimoLayout({"vision": Parallelism(), "language": Parallelism()}, offsets={"vision": 0, "language": 0})
    MimoModel(layout, *_modules(("vision",), frozen=("vision", "language")), options=fp16)
    llama, encoders = _modules(("vision",))
    llama.requires_grad_(False)
    try:
        MimoModel(layout, llama, encoders, options=fp16)
    except ValueError as e:
        return [str(e)]
    return []


def _encoder_grads_through_frozen_language(autocast: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The vision encoder's gradients (fp32) of a 16 x 256-token batch's loss, the frozen
    language model's forward under ``torch.autocast("cpu", autocast)`` (None: fp32)."""
    import torch.nn.functional as F

    from dtensor_mimo.assemble import assemble, embed_text
    from dtensor_mimo.data import IGNORE_INDEX
    from tests.test_mimo import _modules

    llama, encs = _modules(("vision",))
    llama.requires_grad_(False)
    batch = _unweighted_batches(("vision",), False, 16, (256,))[0]
    ids = batch.special_token_ids
    rows = {n: encs[n](m.inputs) for n, m in batch.modalities.items()}
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        h = assemble(embed_text(llama.tok_embeddings, batch.tokens, ids), batch.tokens, rows, ids)
        logits = llama(h=h, positions=batch.positions, document_ids=batch.document_ids)
    weight = torch.where(batch.labels == IGNORE_INDEX, 0.0, batch.loss_mask).flatten()
    ce = F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten(), ignore_index=IGNORE_INDEX,
                         reduction="none")
    ((ce * weight).sum() / weight.sum()).backward()
    return {n: p.grad for n, p in encs["vision"].named_parameters()}


def test_fp16_is_refused_for_a_frozen_language_model_that_encoders_train_through() -> None:
    """A frozen language model has no gradients of its own, but a trained encoder's gradients run
    through its backward: in fp16 they underflow as a trained module's would. Single process,
    16 x 256 tokens, the vision encoder's gradients against fp32's (parameters whose gradient is
    not zero in exact arithmetic): through a bf16 language model at most 0.8% off, through an
    fp16 one (3 more mantissa bits: 4x closer than bf16 at 5 x 64 tokens) up to 11% (median 5.4%),
    growing with the batch. `MimoModel` refuses it by name, as for a module that trains; a
    frozen language model beside frozen encoders (nothing trains) still computes in fp16."""
    fp32 = _encoder_grads_through_frozen_language(None)
    worst = {}
    for dtype in (torch.bfloat16, torch.float16):
        grads = _encoder_grads_through_frozen_language(dtype)
        worst[dtype] = max(_relative(grads[n], g) for n, g in fp32.items() if g.norm() > 1e-10)
    assert worst[torch.bfloat16] < 0.02 and worst[torch.float16] > 3 * worst[torch.bfloat16], worst
    message, = run_on_ranks(_fp16_language_models, 1, timeout=60)[0]
    assert "ParallelOptions(param_dtype=torch.float16) for ['language']" in message
    assert "gradients of the encoders that train" in message and "'bf16'" in message


def _fsdp_bf16_gradient_sum() -> list[float]:
    """A bias-free Linear(1, 2) under FSDP2 with ``param_dtype=bf16`` on 2 ranks, each rank's
    input bf16-exact: 1 on rank 0, 2**-9 on rank 1. Each weight's gradient is the rank's input
    (exact in bf16), so the dp sum is 1 + 2**-9: exact in fp32, rounded to 1 in bf16."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dtensor_mimo.parallelize.precision import apply_data_parallel

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = nn.Linear(1, 2, bias=False)
    apply_data_parallel(model, mesh, [], BF16)
    x = torch.full((1, 1), 1.0 if dist.get_rank() == 0 else 2.0 ** -9)
    model(x).float().sum().backward()
    grad = model.weight.grad
    return [str(grad.dtype), *grad.full_tensor().flatten().tolist()]


def test_fsdp_sums_bf16_gradients_in_fp32() -> None:
    """`ParallelOptions.reduce_dtype` None with a `param_dtype`: the dp sum runs in fp32 (the
    options' and the module docs' promise). Summed in bf16 instead (FSDP2's default: its
    `param_dtype`), the small rank's gradient is lost: no test over the library's models tells,
    their gradients being compared within 8%."""
    assert BF16.gradient_reduce_dtype is torch.float32
    for got in run_on_ranks(_fsdp_bf16_gradient_sum, 2, timeout=60):
        assert got == ["torch.float32", 1 + 2.0 ** -9, 1 + 2.0 ** -9], got


def _dtypes_that_cross() -> list[str]:
    """One rank, vision beside a language model computing in bf16 (vision in fp32): the dtype of
    every row tensor this rank posts across the bridge in ``model(batch)``."""
    from dtensor_mimo import MimoLayout, MimoModel
    from dtensor_mimo.schedule import crossing
    from tests.test_mimo import _modules

    layout = MimoLayout({"vision": Parallelism(), "language": Parallelism()}, offsets={"vision": 0, "language": 0})
    model = MimoModel(layout, *_modules(("vision",)), options={"language": BF16})
    sent, post = [], crossing.post_together

    def recording(bridges, direction, locals_, **kw):
        sent.extend(str(x.dtype) for x in locals_ if x is not None)
        return post(bridges, direction, locals_, **kw)

    crossing.post_together = recording
    try:
        model(_unweighted_batches(("vision",), False, 2, (64,))[0])
    finally:
        crossing.post_together = post
    return sent


def test_rows_cross_the_bridge_in_the_language_models_compute_dtype() -> None:
    """Encoder rows are cast to the language model's compute dtype (`ParallelOptions.param_dtype`)
    before they cross: bf16, half the bytes of the fp32 encoder's own rows (the module docs'
    promise, and what the planner costs: tests/test_plan.py)."""
    sent, = run_on_ranks(_dtypes_that_cross, 1, timeout=120)
    assert sent and set(sent) == {"torch.bfloat16"}, sent
