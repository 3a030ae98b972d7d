"""The chunked head + cross entropy (`linear_token_loss_sum`) against the plain logits path
(`token_loss_sum` of ``hidden @ weight.T``): loss and both gradients, in fp32 and under bf16
autocast, across uneven chunks, ignored labels and fractional loss weights; and through
`MimoModel`, `ParallelOptions(chunked_loss=True)` against ``False`` (tests/test_mimo.py's oracle
compares the default, chunked, with a single-process run of plain logits for every tp = 1 case)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from dtensor_mimo.data import IGNORE_INDEX
from dtensor_mimo.sequence import linear_token_loss_sum, loss
from dtensor_mimo.sequence.loss import token_loss_sum
from tests.harness import run_on_ranks

VOCAB, DIM = 50, 16


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, DIM, generator=g, dtype=dtype)
    weight = torch.randn(VOCAB, DIM, generator=g, dtype=dtype) * 0.3
    labels = torch.randint(0, VOCAB, (2, 7), generator=g)
    labels[0, :2] = IGNORE_INDEX
    mask = torch.rand(2, 7, generator=g)
    mask[1, 3] = 0.0
    return hidden, weight, labels, mask


def _both(hidden, weight, labels, mask, autocast: bool, scale: float = 1.0, compile_backend: str | None = None):
    """(loss, grad of hidden, grad of weight) of the chunked and of the plain path."""
    out = []
    for chunked in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            value = (linear_token_loss_sum(h, w, labels, mask, compile_backend=compile_backend) if chunked
                     else token_loss_sum(h @ w.t(), labels, mask))
        (value * scale).backward()
        out.append((value.detach(), h.grad, w.grad))
    return out


@pytest.mark.parametrize("rows", [3, 5, 13, 14])
def test_chunks_give_the_plain_loss_and_gradients(rows, monkeypatch) -> None:
    monkeypatch.setattr(loss, "LOSS_CHUNK_LOGITS", rows * VOCAB)  # 14 rows in chunks of `rows` (14: one, plain)
    (got, gh, gw), (want, wh, ww) = _both(*_inputs(), autocast=False, scale=0.37)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh, wh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw, ww, rtol=1e-5, atol=1e-7)
    assert gh[0, :2].abs().max() == 0 and gh[1, 3].abs().max() == 0  # ignored label, mask 0: no gradient


def test_under_bf16_autocast_it_computes_as_the_head_would(monkeypatch) -> None:
    """The logits come from a bf16 matmul as under autocast; the gradients keep the inputs' dtypes
    (fp32 master weight) and agree within bf16 rounding."""
    monkeypatch.setattr(loss, "LOSS_CHUNK_LOGITS", 4 * VOCAB)
    (got, gh, gw), (want, wh, ww) = _both(*_inputs(), autocast=True)
    assert gh.dtype == gw.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the same bf16 logits, fp32 sums
    torch.testing.assert_close(gh, wh, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(gw, ww, rtol=2e-2, atol=2e-3)
    assert (got - _both(*_inputs(), autocast=False)[1][0]).abs() > 1e-4  # bf16 logits differ from fp32 ones


def _sums(self, batch1, batch2, out_dtype, *, beta=1, alpha=1, out):
    """CUDA's ``baddbmm(..., out_dtype=, out=)`` (torch 2.11's Blas.cpp), which the CPU lacks: the
    product of the half-precision batches computed in fp32 and added to `out` (``beta = 1``);
    other input dtypes refused, as its checks do."""
    if not (out_dtype == batch1.dtype or (out_dtype == torch.float32 and batch1.dtype in (torch.float16,
                                                                                          torch.bfloat16))):
        raise RuntimeError("out_dtype must be the same as input dtype or fp32 for fp16/bf16 inputs")
    return out.copy_(beta * out + alpha * (batch1.to(out_dtype) @ batch2.to(out_dtype)))


def _overwrites(self, batch1, batch2, out_dtype, *, beta=1, alpha=1, out):
    """A kernel that ignores what `out` held."""
    return out.copy_(batch1.to(out_dtype) @ batch2.to(out_dtype))


@pytest.fixture
def cpu_baddbmm(request, monkeypatch):
    """`request.param` as the CPU kernel of ``baddbmm(..., out_dtype=, out=)`` for the test, with
    `_add_product`'s probe afresh; yields the (input, out) dtypes of its calls."""
    calls = []

    def kernel(*args, **kwargs):
        calls.append((args[1].dtype, kwargs["out"].dtype))
        return request.param(*args, **kwargs)

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("baddbmm.dtype_out", kernel, "CPU")
    monkeypatch.setattr(loss, "_SUMS_IN_MATMUL", {})
    try:
        yield calls
    finally:
        lib._destroy()


@pytest.mark.parametrize("cpu_baddbmm", [_sums], indirect=True)
def test_the_weight_gradient_sums_in_the_matmul_where_the_device_can(cpu_baddbmm, monkeypatch) -> None:
    """Under bf16 autocast each chunk's weight gradient is added to the fp32 sum inside the matmul
    (one probe, then one call a chunk): the sum of the chunks' products computed in fp32, no
    longer rounded to bf16 first; the loss and the hidden gradient as before."""
    monkeypatch.setattr(loss, "LOSS_CHUNK_LOGITS", 4 * VOCAB)  # 14 rows: 4 chunks
    monkeypatch.setattr(loss, "_SUMS_IN_MATMUL", {"cpu": False})
    separate = _both(*_inputs(), autocast=True)[0]
    monkeypatch.setattr(loss, "_SUMS_IN_MATMUL", {})
    (got, gh, gw), (want, wh, ww) = _both(*_inputs(), autocast=True)
    assert loss._SUMS_IN_MATMUL == {"cpu": True} and cpu_baddbmm == [(torch.bfloat16, torch.float32)] * (1 + 4)
    assert torch.equal(got, separate[0]) and torch.equal(gh, separate[1])
    torch.testing.assert_close(gw, ww, rtol=2e-2, atol=2e-3)
    # What it sums: each chunk's bf16 softmax gradient times its bf16 rows, in fp32.
    hidden, weight, labels, mask = _inputs()
    h, w, labels = hidden.flatten(0, 1).bfloat16(), weight.bfloat16(), labels.flatten()
    weights = loss.loss_weights(labels, mask.flatten())
    expected = sum(loss._chunk_terms(h[i:i + 4] @ w.t(), labels[i:i + 4], weights[i:i + 4], True)[1].float().t()
                   @ h[i:i + 4].float() for i in range(0, 14, 4))
    torch.testing.assert_close(gw, expected, rtol=1e-6, atol=1e-6)
    assert not torch.equal(gw, separate[2])  # the separate add summed bf16-rounded products


@pytest.mark.parametrize("cpu_baddbmm", [_sums], indirect=True)
def test_other_dtypes_and_compiled_callers_keep_the_separate_add(cpu_baddbmm, monkeypatch) -> None:
    """float64 rows and head (which that matmul refuses), and a caller under torch.compile (no
    fake kernel for it): the separate add, where the probe said yes."""
    monkeypatch.setattr(loss, "LOSS_CHUNK_LOGITS", 4 * VOCAB)
    hidden, weight, labels, mask = _inputs(torch.float64)
    (got, gh, gw), (want, wh, ww) = _both(hidden, weight, labels, mask, autocast=False)
    torch.testing.assert_close(gw, ww, rtol=1e-5, atol=1e-6)  # the cross entropy in fp32, as the plain path
    assert cpu_baddbmm == []  # not even probed
    monkeypatch.setattr(loss, "_SUMS_IN_MATMUL", {"cpu": True})
    g = torch.Generator().manual_seed(0)
    out, a, b = torch.randn(5, 3, generator=g), torch.randn(5, 4, generator=g).bfloat16(), \
        torch.randn(4, 3, generator=g).bfloat16()

    def add(out, a, b):
        loss._add_product(out, a, b)
        return out

    want = out + (a @ b).float()
    torch.testing.assert_close(torch.compile(add, backend="aot_eager", fullgraph=True)(out.clone(), a, b), want)
    assert cpu_baddbmm == []
    assert torch.equal(add(out.clone(), a, b), out + (a.float() @ b.float()))  # eager: in the matmul
    assert len(cpu_baddbmm) == 1


@pytest.mark.parametrize("cpu_baddbmm", [_overwrites], indirect=True)
def test_a_matmul_that_does_not_sum_as_probed_keeps_the_separate_add(cpu_baddbmm, monkeypatch) -> None:
    monkeypatch.setattr(loss, "LOSS_CHUNK_LOGITS", 4 * VOCAB)
    (got, gh, gw), (want, wh, ww) = _both(*_inputs(), autocast=True)
    assert loss._SUMS_IN_MATMUL == {"cpu": False} and len(cpu_baddbmm) == 1  # the probe only
    torch.testing.assert_close(gw, ww, rtol=2e-2, atol=2e-3)


def test_cpu_has_no_summing_matmul() -> None:
    """The CPU path is the separate add: torch's CPU has no ``baddbmm`` with ``out_dtype``."""
    assert not loss._sums_in_matmul(torch.device("cpu"))


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compiled_chunks_give_the_plain_loss_and_gradients(backend, monkeypatch) -> None:
    """`compile_backend`: each chunk's arithmetic through torch.compile (fused by inductor) gives the
    plain path's numbers in fp32 and under bf16 autocast; chunks of 5 rows leave a last one of 4
    (a second row count: one recompilation, dynamic); a label outside the vocabulary still NaN."""
    monkeypatch.setattr(loss, "LOSS_CHUNK_LOGITS", 5 * VOCAB)
    monkeypatch.setattr(loss, "_COMPILED_TERMS", {})
    torch._dynamo.reset()  # no row count remembered as dynamic from an earlier compilation
    counters.clear()
    (got, gh, gw), (want, wh, ww) = _both(*_inputs(), autocast=False, scale=0.37, compile_backend=backend)
    assert counters["stats"]["unique_graphs"] == 2  # 5 rows, then any count (the last chunk's 4)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh, wh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw, ww, rtol=1e-5, atol=1e-7)
    (got, gh, gw), (want, wh, ww) = _both(*_inputs(), autocast=True, compile_backend=backend)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh, wh, rtol=2e-2, atol=2e-3)
    hidden, weight, labels, mask = _inputs()
    labels[1, 4] = VOCAB
    assert torch.isnan(linear_token_loss_sum(hidden.requires_grad_(), weight, labels, mask, compile_backend=backend))


def test_without_grad_it_only_sums(monkeypatch) -> None:
    """Under no_grad (evaluation) with inputs that require grad: no gradient work at all."""
    monkeypatch.setattr(loss, "LOSS_CHUNK_LOGITS", 3 * VOCAB)
    calls = []
    chunked = loss._chunked_cross_entropy
    monkeypatch.setattr(loss, "_chunked_cross_entropy", lambda *a: calls.append(a[4:6]) or chunked(*a))
    hidden, weight, labels, mask = _inputs()
    hidden.requires_grad_(), weight.requires_grad_()
    with torch.no_grad():
        got = linear_token_loss_sum(hidden, weight, labels, mask)
    assert calls == [(False, False)] and not got.requires_grad
    torch.testing.assert_close(got, token_loss_sum(hidden @ weight.t(), labels, mask), rtol=1e-6, atol=1e-6)
    empty = torch.zeros(0, 5, DIM)
    assert linear_token_loss_sum(empty, weight, torch.zeros(0, 5, dtype=torch.long), torch.zeros(0, 5)) == 0


@pytest.mark.parametrize("extra", [0, 2], ids=["the count", "a count too high"])
@pytest.mark.parametrize("rows", [3, 5, 14])
def test_the_head_runs_on_the_counted_rows_only(rows, extra, monkeypatch) -> None:
    """`counted` (the positions with a loss weight, known from host metadata, or more): the head
    sees only that many rows, in chunks or (few enough) on the plain path, and the loss and both
    gradients are the plain path's over all rows; the uncounted rows get exactly zero gradient."""
    monkeypatch.setattr(loss, "LOSS_CHUNK_LOGITS", rows * VOCAB)
    hidden, weight, labels, mask = _inputs()
    counted = int(torch.count_nonzero(loss.loss_weights(labels, mask))) + extra
    assert counted == 11 + extra  # of 14: two ignored labels, one zero mask
    seen = []
    monkeypatch.setattr(loss, "token_loss_sum",
                        lambda logits, *a: seen.append(logits.shape[0]) or token_loss_sum(logits, *a))
    chunked = loss._chunked_cross_entropy
    monkeypatch.setattr(loss, "_chunked_cross_entropy", lambda h, *a: seen.append(h.shape[0]) or chunked(h, *a))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    got = linear_token_loss_sum(h, w, labels, mask, counted=counted)
    (got * 0.37).backward()
    assert seen == [counted]
    (want, wh, ww), = _both(hidden, weight, labels, mask, autocast=False, scale=0.37)[1:]
    torch.testing.assert_close(got.detach(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h.grad, wh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w.grad, ww, rtol=1e-5, atol=1e-7)
    assert h.grad[0, :2].abs().max() == 0 and h.grad[1, 3].abs().max() == 0
    labels[1, 4] = VOCAB  # a counted label outside the vocabulary: still NaN
    assert torch.isnan(linear_token_loss_sum(hidden, weight, labels, mask, counted=counted))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 logits, as the head under autocast
        got = linear_token_loss_sum(hidden, weight, labels.clamp(max=VOCAB - 1), mask, counted=counted)
        want = linear_token_loss_sum(hidden, weight, labels.clamp(max=VOCAB - 1), mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    none = torch.full_like(labels, IGNORE_INDEX)
    h = hidden.clone().requires_grad_()
    total = linear_token_loss_sum(h, weight, none, mask, counted=0)
    total.backward()
    assert total == 0 and h.grad.abs().max() == 0


@pytest.mark.parametrize("rows", [3, 14], ids=["chunks", "one chunk: the plain path"])
def test_a_count_too_high_adds_nothing_when_the_first_row_carries_a_loss(rows, monkeypatch) -> None:
    """The rows a count too high adds repeat the first row (`first_true`'s fill) at weight 0: with
    the first position weighted (a packed row, a pretraining row) they must not count it again.
    Against the cross entropy written out over every position, and its gradients."""
    monkeypatch.setattr(loss, "LOSS_CHUNK_LOGITS", rows * VOCAB)
    hidden, weight, labels, mask = _inputs()
    labels[0, 0], labels[1, 6] = 3, IGNORE_INDEX  # the first position weighted, three of 14 not
    mask[0, 0] = 0.75
    weights = mask.flatten() * (labels.flatten() != IGNORE_INDEX)
    assert weights[0] != 0 and int(torch.count_nonzero(weights)) == 11

    def by_hand(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        logits = h.reshape(-1, DIM) @ w.t()
        picked = logits.gather(1, labels.clamp(min=0).reshape(-1, 1)).squeeze(1)
        return ((logits.logsumexp(-1) - picked) * weights).sum()

    want_h, want_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    want = by_hand(want_h, want_w)
    want.backward()
    for extra in (1, 2):  # a count below the 14 rows: the head runs on that many
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        got = linear_token_loss_sum(h, w, labels, mask, counted=11 + extra)
        got.backward()
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-6, atol=1e-6, msg=f"count 11 + {extra}")
        torch.testing.assert_close(h.grad, want_h.grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(w.grad, want_w.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("rows", [3, 14], ids=["chunks", "one chunk: the plain path"])
def test_a_label_outside_the_vocabulary_makes_the_loss_nan(rows, monkeypatch) -> None:
    """Not clamped into the vocabulary (a wrong loss), nor an error (a device-side assert on CUDA):
    NaN, which train_step reports as a non-finite step; an uncounted position may hold any id."""
    monkeypatch.setattr(loss, "LOSS_CHUNK_LOGITS", rows * VOCAB)
    hidden, weight, labels, mask = _inputs()
    labels[1, 0] = VOCAB
    assert torch.isnan(linear_token_loss_sum(hidden, weight, labels, mask))
    mask[1, 0] = 0.0
    assert torch.isfinite(linear_token_loss_sum(hidden, weight, labels, mask))


def test_the_plain_logits_path_keeps_the_label_rule() -> None:
    """`token_loss_sum` (the head under tp, a user's decoder, ``chunked_loss=False``, `predict`'s
    loss) follows the chunked loss's rule: a weighted label outside the vocabulary makes the sum
    NaN (``F.cross_entropy`` raised IndexError); one at a position without a loss weight changes
    nothing."""
    hidden, weight, labels, mask = _inputs()
    logits = hidden @ weight.t()
    clean = token_loss_sum(logits, labels, mask)
    unweighted = labels.clone()
    unweighted[1, 3] = VOCAB  # mask 0 there
    assert token_loss_sum(logits, unweighted, mask) == clean
    weighted = labels.clone()
    weighted[1, 0] = VOCAB
    assert torch.isnan(token_loss_sum(logits, weighted, mask))


def _steps_with_a_label_outside_the_vocabulary(language: dict) -> list[tuple[float, float, bool]]:
    """Predictions and training steps of batches holding label 64 (the vocabulary is 0..63) at a
    position with a loss weight, then at one without: (predicted loss, step loss, step skipped)
    of each."""
    import dataclasses

    from dtensor_mimo import MimoLayout, MimoModel, MimoOptimizer, ParallelOptions, Parallelism, train_step
    from tests.test_mimo import OPT, _batches, _modules

    layout = MimoLayout({"vision": Parallelism(), "language": Parallelism(tp=language.get("tp", 1))})
    llama, encoders = _modules(("vision",), custom_language=language.get("custom", False))
    model = MimoModel(layout, llama, encoders, options={"language": ParallelOptions(**language.get("options", {}))})
    optimizer = MimoOptimizer(model, OPT)
    out = []
    for weighted in (True, False):
        batch = _batches(("vision",), packed=False)[0]
        row, col = torch.nonzero(batch.loss_mask > 0 if weighted else batch.loss_mask == 0)[0].tolist()
        labels = batch.labels.clone()
        labels[row, col] = 64
        batch = dataclasses.replace(batch, labels=labels)
        _, predicted = model.predict(batch, with_loss=True)
        metrics = train_step(model, optimizer, batch)
        out.append((predicted, metrics.loss, metrics.skipped))
    return out


LANGUAGE_HEADS = {
    "tp2_loss_parallel": dict(tp=2),  # vocabulary-parallel cross entropy: was a finite, wrong loss
    "tp2_gathered": dict(tp=2, options=dict(loss_parallel=False)),  # was IndexError on the language ranks
    "unchunked": dict(options=dict(chunked_loss=False)),
    "user_decoder": dict(custom=True),
}


@pytest.mark.parametrize("name", list(LANGUAGE_HEADS))
def test_a_label_outside_the_vocabulary_is_the_same_verdict_on_every_rank(name) -> None:
    """Through `MimoModel` (vision on rank 0, the language model on the others), for every head
    but the chunked one (tests above): a weighted label outside the vocabulary gives a NaN loss
    in `predict` and in the step on every rank, as the chunked head does, and the step is skipped;
    before, the language ranks raised alone and the others waited for them (a hang), or tp's
    vocabulary-parallel loss summed a finite one. Unweighted, the label is ignored."""
    language = LANGUAGE_HEADS[name]
    results = run_on_ranks(_steps_with_a_label_outside_the_vocabulary, 1 + language.get("tp", 1), language,
                           timeout=120)
    for (predicted, step_loss, skipped), (clean, clean_step_loss, clean_skipped) in results:
        assert predicted != predicted and step_loss != step_loss and skipped, results  # NaN
        assert clean == pytest.approx(clean_step_loss, rel=1e-5) and not clean_skipped, results


def _user_decoder_keeps_its_head() -> bool:
    """A user's decoder (tests/test_mimo.py's, which may change its logits) at pp = 1: the plain head."""
    from dtensor_mimo import MimoLayout, MimoModel, Parallelism
    from tests.test_mimo import _modules

    layout = MimoLayout({"vision": Parallelism(), "language": Parallelism()}, offsets={"vision": 0, "language": 0})
    layout.init_meshes("cpu")
    llama, encoders = _modules(("vision",), custom_language=True)
    return MimoModel(layout, llama, encoders).language_pipeline.stages[0].chunked_loss


def test_a_user_decoder_keeps_its_own_head() -> None:
    assert run_on_ranks(_user_decoder_keeps_its_head, 1, timeout=120) == [False]


def _rescaled_llama():
    """A user's decoder that subclasses the library's `Llama` and transforms its logits in its own
    forward (a scale and a square: as a logit soft-cap or a learned temperature would), returning
    its hidden states when ``output`` is None as the protocol asks."""
    from dtensor_mimo.models import Llama
    from tests.test_mimo import LLAMA

    class Rescaled(Llama):
        def forward(self, tokens=None, **kwargs):
            out = super().forward(tokens, **kwargs)
            return 3.0 * out + 0.5 * out.square() if self.output is not None else out

    llama = Rescaled(LLAMA)
    llama.init_weights(1)
    return llama


def _rescaled_llama_losses(tp: int, chunk_rows: int | None) -> tuple[float, float]:
    """One batch through `MimoModel` (vision and the `_rescaled_llama` colocated on `tp` ranks, the
    language model at tp): the training step's loss (`forward_backward`, summed over the loss
    shares) and `predict`'s; `chunk_rows`: the chunked head's chunk (its rows picked on the host)."""
    import torch.distributed as dist

    from dtensor_mimo import MimoLayout, MimoModel, Parallelism
    from tests.test_mimo import _batches, _modules

    layout = MimoLayout({"vision": Parallelism(tp=tp), "language": Parallelism(tp=tp)},
                        offsets={"vision": 0, "language": 0})
    model = MimoModel(layout, _rescaled_llama(), _modules(("vision",))[1])
    batch = _batches(("vision",), packed=False, batch_size=4, seq_lens=(64,))[0]
    chunk = loss.LOSS_CHUNK_LOGITS
    if chunk_rows is not None:
        loss.LOSS_CHUNK_LOGITS = chunk_rows * 64
    try:  # the rank's process runs later tests: the library's chunk again after this one
        share = model.forward_backward(batch).double().reshape(1)
        _, predicted = model.predict(batch, with_loss=True)
    finally:
        loss.LOSS_CHUNK_LOGITS = chunk
    if not model.holds_loss_share():
        share.zero_()
    dist.all_reduce(share)
    return share.item(), predicted


@pytest.mark.parametrize("tp, chunk_rows", [(1, None), (1, 16), (2, 16)])
def test_a_llama_subclass_with_its_own_forward_trains_on_its_own_logits(tp, chunk_rows) -> None:
    """A `Llama` subclass whose forward transforms the logits: the training loss (and so every
    gradient) was that of the plain head's logits, its transform dropped without a word (the
    chunked head at tp = 1, the library's default; the head on the loss rows only at tp > 1), while
    `predict` used its forward. Both now give the single-process loss of its own forward."""
    from dtensor_mimo.assemble import assemble, embed_text
    from tests.test_mimo import _batches, _modules

    llama, encoders = _rescaled_llama(), _modules(("vision",))[1]
    batch = _batches(("vision",), packed=False, batch_size=4, seq_lens=(64,))[0]
    ids = batch.special_token_ids
    rows = {"vision": encoders["vision"](batch.modalities["vision"].inputs)}
    h = assemble(embed_text(llama.tok_embeddings, batch.tokens, ids), batch.tokens, rows, ids)
    logits = llama(h=h, positions=batch.positions, document_ids=batch.document_ids)
    want = (token_loss_sum(logits, batch.labels, batch.loss_mask)
            / torch.where(batch.labels == IGNORE_INDEX, 0.0, batch.loss_mask).sum()).item()
    for trained, predicted in run_on_ranks(_rescaled_llama_losses, tp, tp, chunk_rows, timeout=120):
        assert trained == pytest.approx(want, rel=1e-5) and predicted == pytest.approx(want, rel=1e-5), \
            (trained, predicted, want)


def _model_grads(chunked: bool, chunk_rows: int, compile_backend: str | None = None
                 ) -> tuple[float, dict[str, torch.Tensor]]:
    """One text batch through `MimoModel` (world 1, vision colocated): loss and every gradient;
    with `compile_backend`, the language model compiled (its blocks and the chunks' arithmetic)."""
    from dtensor_mimo import MimoLayout, MimoModel, ParallelOptions, Parallelism
    from tests.test_mimo import _batches, _modules

    layout = MimoLayout({"vision": Parallelism(), "language": Parallelism()}, offsets={"vision": 0, "language": 0})
    layout.init_meshes("cpu")
    llama, encoders = _modules(("vision",))
    assert llama.config.vocab_size == 64
    options = ParallelOptions(chunked_loss=chunked, compile=compile_backend is not None,
                              compile_backend=compile_backend or "inductor")
    model = MimoModel(layout, llama, encoders, options={"language": options})
    stage = model.language_pipeline.stages[0]
    assert stage.chunked_loss is chunked and stage.loss_compile_backend == compile_backend
    batch = _batches(("vision",), packed=True)[0]
    chunk, loss.LOSS_CHUNK_LOGITS = loss.LOSS_CHUNK_LOGITS, chunk_rows * 64
    try:  # the rank's process runs later tests: the library's chunk again after this one
        value = model(batch)
        value.backward()
    finally:
        loss.LOSS_CHUNK_LOGITS = chunk
    return float(value), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("compile_backend", [None, "aot_eager"])
def test_mimo_model_chunked_loss_equals_the_plain_head(compile_backend) -> None:
    # the reference: the plain head on every row (logits below the size where rows are picked)
    (got, got_grads), (want, want_grads) = [run_on_ranks(_model_grads, 1, chunked, rows, backend, timeout=180)[0]
                                            for chunked, rows, backend in ((True, 7, compile_backend),
                                                                           (False, 10**6, None))]
    assert got == pytest.approx(want, rel=1e-6)
    assert got_grads.keys() == want_grads.keys() and any("output" in n for n in got_grads)
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_first_true_is_nonzero_static_without_a_sync() -> None:
    """`first_true` (the loss rows' pick, elementwise: no device sync) gives what
    ``torch.nonzero_static(mask, size=count, fill_value=0)`` gives: fewer, as many and more
    True entries than `count`, none, an empty mask."""
    import random

    from dtensor_mimo.sequence.loss import first_true

    rng = random.Random(0)
    for _ in range(500):
        n, p = rng.randint(0, 40), rng.random()
        mask = torch.tensor([rng.random() < p for _ in range(n)], dtype=torch.bool)
        count = rng.randint(1, 50)
        assert torch.equal(first_true(mask, count), torch.nonzero_static(mask, size=count, fill_value=0).squeeze(-1))


def _argmax_of_vocab_shards(full: torch.Tensor) -> torch.Tensor:
    """`vocab_parallel_argmax` of `full` ``[B, S, V]`` sharded over its vocabulary on a 2-rank mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dtensor_mimo.sequence import vocab_parallel_argmax

    mesh = init_device_mesh("cpu", (2,))
    return vocab_parallel_argmax(distribute_tensor(full, mesh, [Shard(2)]))


def test_vocab_parallel_argmax_is_torchs_argmax_on_ties_and_nans() -> None:
    """Under tp the predicted ids (`predict`, greedy generation) come from vocabulary shards:
    they must be ``argmax(-1)`` of the whole logits, with torch's rules, which bf16 logits meet
    often: of equal maxima the first id wins (here across the two shards and within one), and a
    NaN is the maximum (the row's first NaN wins, also against a larger number elsewhere)."""
    full = torch.zeros(1, 6, 8)
    full[0, 0, [1, 6]] = 3.0  # a tie across the shards (ids 0-3 | 4-7)
    full[0, 1, [5, 7]] = 2.0  # a tie within the second shard
    full[0, 2, [2, 3]] = 4.0  # a tie within the first shard
    full[0, 3, 6] = float("nan")  # a NaN in the second shard, a larger number in the first
    full[0, 3, 1] = 9.0
    full[0, 4, [2, 5]] = float("nan")  # NaNs in both shards
    full[0, 5] = torch.arange(8.0)  # no tie: the last id
    want = full.argmax(-1)
    assert want.tolist() == [[1, 5, 2, 6, 2, 7]]  # torch's own rules, as written above
    for got in run_on_ranks(_argmax_of_vocab_shards, 2, full, timeout=120):
        assert torch.equal(got, want)


def _weighted_everywhere(batch):
    """`batch` with a loss mask of 1 on every position, those whose label is IGNORE_INDEX included
    (a user's batch may weight them: `loss_weights` gives them none)."""
    import dataclasses

    return dataclasses.replace(batch, loss_mask=torch.ones_like(batch.loss_mask))


def _loss_and_gradients_of_a_mask_on_ignored_labels(modules, pipeline):
    from dtensor_mimo import AdamWConfig, MimoLayout, MimoModel, MimoOptimizer, train_step
    from tests.test_mimo import _batches, _modules
    from tests.test_pipeline import _gathered_gradients

    layout = MimoLayout(modules, offsets={"vision": 0, "language": 0})
    model = MimoModel(layout, *_modules(("vision",)), pipeline=pipeline)
    optimizer = MimoOptimizer(model, AdamWConfig(lr=0.0, max_grad_norm=None))
    loss = train_step(model, optimizer, _weighted_everywhere(_batches(("vision",), True, 4, (64,))[0])).loss
    return loss, _gathered_gradients(model)


def test_a_loss_mask_on_ignored_labels_weighs_nothing_across_ranks() -> None:
    """A position whose label is IGNORE_INDEX has no loss weight whatever its mask (`loss_weights`):
    the loss over the global batch is divided by the weighted labels, not by the mask's sum, on a
    layout where each rank holds some of the rows (language pp2 x cp2, two microbatches): the loss
    and every gradient are the single-process ones. The synthetic batches mask every unlabelled
    position, so the layouts of tests/test_mimo.py could not tell the two apart."""
    from dtensor_mimo import Parallelism, PipelineConfig
    from tests.test_mimo import _batches
    from tests.test_pipeline import _reference_gradients

    batch = _weighted_everywhere(_batches(("vision",), True, 4, (64,))[0])
    assert bool((batch.labels == IGNORE_INDEX).any())
    want_loss, want = _reference_gradients(batch)
    modules = dict(vision=Parallelism(dp=4), language=Parallelism(pp=2, cp=2))
    per_rank = run_on_ranks(_loss_and_gradients_of_a_mask_on_ignored_labels, 4, modules,
                            PipelineConfig(microbatches=2), timeout=180)
    assert all(loss == pytest.approx(want_loss, rel=1e-5) for loss, _ in per_rank)
    got = {k: v for _, grads in per_rank for k, v in grads.items()}
    assert got.keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=2e-5, atol=2e-6, msg=lambda m: f"{k}: {m}")


def _fraction_of_a_token(batch):
    """`batch` with loss weights of the same proportions as its own, summing to 0.5 over the batch
    (fractional weights, e.g. each sample's weights divided by the tokens of the batch)."""
    import dataclasses

    from dtensor_mimo.sequence import loss_weights

    weights = loss_weights(batch.labels, batch.loss_mask)
    return dataclasses.replace(batch, loss_mask=weights / weights.sum() * 0.5)


def _step_of_fractional_weights(modules):
    from dtensor_mimo import AdamWConfig, MimoLayout, MimoModel, MimoOptimizer, train_step
    from tests.test_mimo import _batches, _modules
    from tests.test_pipeline import _gathered_gradients

    model = MimoModel(MimoLayout(modules), *_modules(("vision",)))
    optimizer = MimoOptimizer(model, AdamWConfig(lr=0.0, max_grad_norm=None))
    loss = train_step(model, optimizer, _fraction_of_a_token(_batches(("vision",), False, 4, (64,))[0])).loss
    return loss, _gathered_gradients(model)


def test_loss_weights_summing_below_one_give_the_weighted_mean() -> None:
    """The loss is the weighted mean over the global batch, sum(w * ce) / sum(w), whatever the
    weights add up to: fractional loss weights whose total is below 1 (here 0.5) are divided by
    that total, as the single-process loss is. Before, the normalizer was max(total, 1) (meant for
    a batch without targets), so such a batch gave a loss and gradients 2x too small, on every
    layout; and the trainer's held-out loss, which weighs each batch's loss by its total weight,
    was off alike. A batch with no loss weight at all still has loss 0."""
    import dataclasses

    from dtensor_mimo import Parallelism
    from dtensor_mimo.sequence import loss_normalizer
    from tests.test_mimo import _batches
    from tests.test_pipeline import _reference_gradients

    batch = _fraction_of_a_token(_batches(("vision",), False, 4, (64,))[0])
    assert loss_normalizer(batch) == pytest.approx(0.5)
    assert loss_normalizer(dataclasses.replace(batch, loss_mask=torch.zeros_like(batch.loss_mask))) == 1.0
    want_loss, want = _reference_gradients(batch)
    modules = dict(vision=Parallelism(), language=Parallelism(dp=2))
    per_rank = run_on_ranks(_step_of_fractional_weights, 3, modules, timeout=180)
    assert all(loss == pytest.approx(want_loss, rel=1e-5) for loss, _ in per_rank), (want_loss, per_rank[0][0])
    got = {k: v for _, grads in per_rank for k, v in grads.items()}
    assert got.keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=2e-5, atol=2e-6, msg=lambda m: f"{k}: {m}")
