"""`GradientReducer` on 2 gloo ranks: dp sums launched during backward, against sums computed here.

Each rank trains a small MLP on its own microbatches; the expected gradients are computed in the
test process's rank itself by running BOTH ranks' microbatches through a plain copy of the model
(no collective), so a wrong sum, a bucket reduced before its last accumulation or a lost
presence flag shows as a difference. Buckets of 64 bytes put one or two parameters in each, so
that most of them leave while backward runs. The library-wide checks (every layout and schedule
against the single-process run) are `tests/test_mimo.py` and `tests/test_pipeline.py`, whose
cases without FSDP2 go through the same reducer.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dtensor_mimo.parallelize import GradientReducer
from dtensor_mimo.parallelize.reducer import StageReductions
from tests.harness import run_on_ranks


class _Net(nn.Module):
    """Three Linear layers; `only_rank0` is used on rank 0's data only, `never` by nobody."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # Registered first, so last in launch order: the bucket holding them waits for `finish`
        # (no gradient anywhere, or none on rank 1), the others leave during backward.
        self.only_rank0 = nn.Parameter(torch.randn(3))
        self.never = nn.Parameter(torch.randn(2))
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        y = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return y * self.only_rank0 if rank == 0 else y


def _data(rank: int, mb: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 * rank + mb))


def _expected(net: _Net, microbatches: int) -> dict[str, torch.Tensor | None]:
    """Both ranks' gradients summed, computed here without a collective."""
    ref = copy.deepcopy(net)
    for r in range(2):
        for mb in range(microbatches):
            ref(_data(r, mb), r).square().sum().backward()
    return {n: None if p.grad is None else p.grad.clone() for n, p in ref.named_parameters()}


def _matches(net: nn.Module, expected: dict) -> bool:
    return all((p.grad is None) == (expected[n] is None) and (p.grad is None or torch.allclose(p.grad, expected[n]))
               for n, p in net.named_parameters())


def _armed_last_backward(dtype: str | None) -> dict:
    """Three microbatches, `arm` before the last: buckets leave during its backward; the sums,
    the parameter used on one rank only and the one used nowhere (None) come out right, also
    with the sums in bf16."""
    rank = dist.get_rank()
    net = _Net()
    expected = _expected(net, 3)
    reduce_dtype = getattr(torch, dtype) if dtype else None
    reducer = GradientReducer(dict(net.named_parameters()), dist.new_group([0, 1]), reduce_dtype, bucket_bytes=64)
    launched = []
    for mb in range(3):
        if mb == 2:
            reducer.arm()
        net(_data(rank, mb), rank).square().sum().backward()
        launched.append(reducer._next)
    problem = reducer.finish()
    if reduce_dtype is not None:  # bf16 sums: compare loosely
        ok = all((p.grad is None) == (expected[n] is None) and
                 (p.grad is None or torch.allclose(p.grad, expected[n], rtol=2e-2, atol=1e-2))
                 for n, p in net.named_parameters())
    else:
        ok = _matches(net, expected)
    return {"ok": ok, "problem": problem, "launched": launched, "buckets": len(reducer.buckets),
            "early": reducer.early, "never": net.never.grad is None, "dtype": net.a.weight.grad.dtype}


def test_buckets_leave_during_the_armed_backward() -> None:
    for dtype in (None, "bfloat16"):
        for r in run_on_ranks(_armed_last_backward, 2, dtype, timeout=60):
            assert r["ok"] and r["problem"] is None and r["never"] and r["dtype"] == torch.float32, r
            # nothing before the armed backward; during it, every bucket but the last (`never`
            # and `only_rank0`: no gradient on one rank at least), which `finish` sends
            assert r["launched"] == [0, 0, r["buckets"] - 1] and r["early"] == r["buckets"] - 1 > 3, r


class _Stage(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _pipelined(shared: bool) -> dict:
    """Two stages on this rank, four microbatches in a 1F1B-like order (F0 F1 B0 F2 B1 F3 B2 B3,
    each backward through both stages as a schedule's would be): `StageReductions.step(4)` arms
    each stage at its fourth backward, and its buckets leave then. With `shared`, the two stages
    share their weight: that parameter never leaves early, and the sums stay right."""
    rank = dist.get_rank()
    first, second = _Stage(1), _Stage(2)
    if shared:
        second.lin.weight = first.lin.weight
    model = nn.ModuleDict({"first": first, "second": second})
    params = {n: p for n, p in model.named_parameters()}
    ref = copy.deepcopy(model)
    for r in range(2):
        for mb in range(4):
            ref["second"](ref["first"](_data(r, mb))).sum().backward()
    reducer = GradientReducer(params, dist.new_group([0, 1]), bucket_bytes=64)
    reductions = StageReductions([first, second])
    reductions.attach(reducer)
    outs, order = {}, ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    before_last = None
    with reductions.step(4):
        for action in order:
            mb = int(action[1])
            if action[0] == "F":
                outs[mb] = second(first(_data(rank, mb)))
            else:
                if mb == 3:
                    before_last = reducer._next
                outs.pop(mb).sum().backward()
        after = reducer._next  # before the flush after the schedule
    problem = reducer.finish()
    ok = all(torch.allclose(p.grad, dict(ref.named_parameters())[n].grad) for n, p in params.items())
    return {"ok": ok, "problem": problem, "before_last": before_last, "after": after, "early": reducer.early,
            "buckets": len(reducer.buckets)}


def test_watched_stages_arm_at_their_last_backward() -> None:
    for shared in (False, True):
        for r in run_on_ranks(_pipelined, 2, shared, timeout=60):
            assert r["ok"] and r["problem"] is None and r["before_last"] == 0, r
            if shared:  # the shared weight is the last parameter in launch order: every bucket before it left
                assert 0 < r["after"] < r["buckets"], r
            else:
                assert r["after"] == r["buckets"] == r["early"], r


def _stale_and_by_hand() -> dict:
    """A gradient accumulated after its bucket left makes `finish` say so, through the hook or by
    hand (its version moved; on both ranks, the same collectives issued); `discard` drops a
    step's sums with every bucket still issued once, so the next step's sums are right; gradients
    accumulated by hand before any launch (no hook, as torch's split weight backward does) go in
    `finish`, and their sums are right."""
    rank = dist.get_rank()
    net = _Net()
    reducer = GradientReducer(dict(net.named_parameters()), dist.new_group([0, 1]), bucket_bytes=64)
    reducer.arm()
    net(_data(rank, 0), rank).square().sum().backward()
    net(_data(rank, 1), rank).square().sum().backward()  # after the buckets left
    stale = reducer.finish()
    net.zero_grad()
    reducer.arm()
    net(_data(rank, 0), rank).square().sum().backward()
    net.b.weight.grad += 1  # by hand, after its bucket left
    by_hand_late = reducer.finish()
    net.zero_grad()
    reducer.arm()
    net(_data(rank, 5), rank).square().sum().backward()
    launched_before_discard = reducer._next
    if rank == 0:  # one rank launches the rest itself: the other's discard must still send them
        reducer.flush()
    reducer.discard(in_flight=True)
    net.zero_grad()
    expected = _expected(net, 1)
    local = copy.deepcopy(net)
    local(_data(rank, 0), rank).square().sum().backward()
    reducer.arm()
    for p, q in zip(net.parameters(), local.parameters()):
        if q.grad is not None:
            p.grad = q.grad.clone()  # by hand: no accumulation hook fires
    by_hand = reducer.finish()
    return {"stale": stale, "by_hand_late": by_hand_late, "by_hand": by_hand, "early": reducer.early,
            "ok": _matches(net, expected), "launched_before_discard": launched_before_discard}


def test_stale_accumulation_is_reported_and_hand_accumulation_waits() -> None:
    for r in run_on_ranks(_stale_and_by_hand, 2, timeout=60):
        assert r["stale"] is not None and "c.bias" in r["stale"] and "overlap_grad_reduce=False" in r["stale"], r
        assert r["by_hand_late"] is not None and "'b.weight'" in r["by_hand_late"], r
        assert r["launched_before_discard"] > 0, r
        assert r["by_hand"] is None and r["early"] == 0 and r["ok"], r


def _runs_before_reduce(overlap: bool) -> dict:
    """A colocated `MimoModel` (vision and language dp2, no FSDP2, 2 microbatches): with sums
    during backward, a second training run before `reduce_gradients` is refused on every rank
    (its gradients would land after their buckets left), and ``zero_grad`` drops the sums in
    flight so that the next `train_step` runs; without them the runs accumulate, as before."""
    from dtensor_mimo import MimoLayout, MimoModel, MimoOptimizer, ParallelOptions, Parallelism, PipelineConfig, \
        train_step
    from tests.test_mimo import OPT, _batches, _modules

    llama, encoders = _modules(("vision",))
    layout = MimoLayout.colocated({"vision": Parallelism(dp=2), "language": Parallelism(dp=2)})
    options = ParallelOptions(fsdp=False, overlap_grad_reduce=overlap)
    model = MimoModel(layout, llama, encoders, options={"vision": options, "language": options},
                      pipeline=PipelineConfig(microbatches=2))
    optimizer = MimoOptimizer(model, OPT)
    batch = _batches(("vision",), False, batch_size=4)[0]
    model.forward_backward(batch)
    refused = None
    try:
        model.forward_backward(batch)
    except RuntimeError as e:
        refused = str(e)
    model.predict(batch)  # a prediction in between leaves the sums in flight, and the refusal
    try:
        model.forward_backward(batch)
    except RuntimeError:
        refused_after_predict = True
    else:
        refused_after_predict = False
    model.zero_grad()
    metrics = train_step(model, optimizer, batch)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"refused": refused, "after_predict": refused_after_predict, "loss": metrics.loss,
            "reducers": sorted(model.gradient_reducers), "weights": weights}


def test_training_runs_do_not_accumulate_onto_sums_in_flight() -> None:
    """With sums in flight the second run is refused (also after a prediction) and ``zero_grad``
    drops them; the next step's weights then equal those of the same calls without overlap
    (where the runs accumulate, and ``zero_grad`` drops them as well)."""
    runs = {overlap: run_on_ranks(_runs_before_reduce, 2, overlap, timeout=120) for overlap in (True, False)}
    for overlap, results in runs.items():
        for r in results:
            if overlap:
                assert r["refused"] is not None and "reduce_gradients" in r["refused"] and r["after_predict"], r
                assert r["reducers"] == ["language", "vision"], r
            else:
                assert r["refused"] is None and not r["after_predict"] and r["reducers"] == [], r
    for overlapped, plain in zip(runs[True], runs[False]):
        assert overlapped["loss"] == pytest.approx(plain["loss"], rel=1e-6)
        for name, w in overlapped["weights"].items():
            torch.testing.assert_close(w, plain["weights"][name], rtol=1e-6, atol=1e-7, msg=name)


def _reduced_between_runs(overlap: bool, via_call: bool, disjoint: bool) -> dict:
    """vision dp2 and language dp2 without FSDP2 (colocated on ranks 0-1, or `disjoint`: on ranks
    0-1 and 2-3): two runs accumulating, `reduce_gradients` after each (as the refusal of a run
    with sums in flight advises), and once more after the last; between them a loss evaluated
    with gradients on and never backpropagated. The gradients of dp rank 0 of each module,
    gathered whole. `via_call`: the runs are ``model(batch).backward()``, not `forward_backward`."""
    from dtensor_mimo import MimoLayout, MimoModel, ParallelOptions, Parallelism
    from tests.test_mimo import _batches, _modules
    from tests.test_pipeline import _gathered_gradients

    pars = {"vision": Parallelism(dp=2), "language": Parallelism(dp=2)}
    layout = MimoLayout(pars) if disjoint else MimoLayout.colocated(pars)
    plain = ParallelOptions(fsdp=False, overlap_grad_reduce=overlap)
    model = MimoModel(layout, *_modules(("vision",)), options={"vision": plain, "language": plain})
    batches = _batches(("vision",), False, 4, (64, 64))
    for batch in batches[:2]:
        if via_call:
            model(batch).backward()
        else:
            model.forward_backward(batch)
        assert model.reduce_gradients() is None
        model(batches[0])  # an evaluation with gradients on, no backward: the sums stay
    assert model.reduce_gradients() is None  # nothing ran since: nothing to sum again
    model(batches[1])  # (as before an optimizer step): the gradients stay on their parameters
    return _gathered_gradients(model)


@pytest.mark.parametrize("overlap,via_call,disjoint", [(True, False, False), (False, False, False),
                                                       (True, True, False), (True, True, True)],
                         ids=["overlap", "after_backward", "model_call", "model_call_disjoint"])
def test_runs_accumulate_after_reduce_gradients(overlap: bool, via_call: bool, disjoint: bool) -> None:
    """Runs accumulating with `reduce_gradients` between them sum each run's gradients over dp
    once: a module without FSDP2 summed the whole accumulated gradient again (the first run's
    sum counted dp times; FSDP2 modules accumulated right), and a second `reduce_gradients`
    summed it again; a forward never backpropagated changes nothing. Reference: the
    single-process gradients of both batches, added."""
    from tests.test_mimo import _batches
    from tests.test_pipeline import _reference_gradients

    first, second = (_reference_gradients(b)[1] for b in _batches(("vision",), False, 4, (64, 64))[:2])
    results = run_on_ranks(_reduced_between_runs, 4 if disjoint else 2, overlap, via_call, disjoint, timeout=180)
    got = {**results[0], **results[2]} if disjoint else results[0]
    assert got.keys() == first.keys()
    for k in first:
        torch.testing.assert_close(got[k], first[k] + second[k], rtol=2e-5, atol=2e-6, msg=lambda m: f"{k}: {m}")


def _qk_norm_reduced_between_runs(fsdp: bool) -> dict:
    """Language tp2 (`fsdp`: tp2·dp2 under FSDP2) with Qwen3's per-head q/k norms (their gradient
    a SUM over tp, `replicas.head_local`), vision over every rank, colocated: two runs with
    `reduce_gradients` after each, as in `_reduced_between_runs`. The gradients, gathered whole."""
    import dataclasses

    import tests.test_mimo as test_mimo
    from dtensor_mimo import MimoLayout, MimoModel, ParallelOptions, Parallelism
    from tests.test_pipeline import _gathered_gradients

    plain = test_mimo.LLAMA
    test_mimo.LLAMA = dataclasses.replace(plain, qk_norm=True)
    try:
        dp = 2 if fsdp else 1  # FSDP2 needs dp > 1: language tp2·dp2, vision dp4 on 4 ranks
        layout = MimoLayout.colocated({"vision": Parallelism(dp=2 * dp), "language": Parallelism(tp=2, dp=dp)})
        options = ParallelOptions(fsdp=fsdp)
        model = MimoModel(layout, *test_mimo._modules(("vision",)), options={"vision": options, "language": options})
        for batch in test_mimo._batches(("vision",), False, 4, (64, 64)):
            model.forward_backward(batch)
            assert model.reduce_gradients() is None
        return _gathered_gradients(model)
    finally:
        test_mimo.LLAMA = plain


@pytest.mark.parametrize("fsdp", [False, True], ids=["plain", "fsdp"])
def test_runs_accumulate_after_reduce_gradients_with_tp_summed_gradients(fsdp: bool) -> None:
    """`reduce_gradients` sums the q/k norms' gradients over tp (each tp rank holds a partial sum
    over its heads); a run accumulating after it must not sum the first run's total again.
    Reference: the single-process gradients of both batches, added."""
    import dataclasses

    import tests.test_mimo as test_mimo
    from tests.test_pipeline import _reference_gradients

    plain = test_mimo.LLAMA
    test_mimo.LLAMA = dataclasses.replace(plain, qk_norm=True)
    try:
        first, second = (_reference_gradients(b)[1] for b in test_mimo._batches(("vision",), False, 4, (64, 64)))
    finally:
        test_mimo.LLAMA = plain
    got = run_on_ranks(_qk_norm_reduced_between_runs, 4 if fsdp else 2, fsdp, timeout=180)[0]
    assert any("q_norm" in k for k in first)
    for k in first:
        torch.testing.assert_close(got[k], first[k] + second[k], rtol=2e-5, atol=2e-6, msg=lambda m: f"{k}: {m}")


def _fsdp_reduced_in_last_backward(pp: int) -> list[float]:
    """The share of each FSDP2 pipeline stage's parameters that are sharded again and hold their
    reduced gradient when torch's schedule starts its own reduction after the step (`perform_reduce_grad`),
    on every call of it: the language model's one stage (dp2, colocated with vision, 2
    microbatches), or with `pp` 2 the vision encoder's stages (pp2·dp2, torch's GPipe; the
    language model on a rank of its own, without FSDP2)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import stage as torch_stage
    from torch.distributed.tensor import DTensor

    from dtensor_mimo import MimoLayout, MimoModel, Parallelism, PipelineConfig
    from tests.test_mimo import _batches, _modules

    llama, encoders = _modules(("vision",))
    layout = (MimoLayout.colocated({"vision": Parallelism(dp=2), "language": Parallelism(dp=2)}) if pp == 1 else
              MimoLayout({"vision": Parallelism(pp=2, dp=2), "language": Parallelism()}))
    model = MimoModel(layout, llama, encoders, pipeline=PipelineConfig(microbatches=2))
    shares: list[float] = []
    original = torch_stage._PipelineStageBase.perform_reduce_grad

    def perform_reduce_grad(self, *args, **kwargs):
        if isinstance(self.submod, FSDPModule):
            params = [p for p in self.submod.parameters() if p.requires_grad]  # unsharded ones: not yet reduced
            shares.append(sum(isinstance(p, DTensor) and p.grad is not None for p in params) / len(params))
        return original(self, *args, **kwargs)

    torch_stage._PipelineStageBase.perform_reduce_grad = perform_reduce_grad
    try:
        model.forward_backward(_batches(("vision",), False, batch_size=4)[0])
    finally:
        torch_stage._PipelineStageBase.perform_reduce_grad = original
    return shares


def test_fsdp_stages_reduce_during_their_last_backward() -> None:
    """torch's pipeline stages defer FSDP2's reduce-scatters to after the schedule; the library's
    stages reduce block by block during their last backward instead (`reduce_in_this_backward`):
    every parameter's gradient is already reduced when torch's own reduction comes (the sums
    themselves: `tests/test_pipeline.py`, `tests/test_mimo.py` against the single-process run)."""
    assert run_on_ranks(_fsdp_reduced_in_last_backward, 2, 1, timeout=120) == [[1.0]] * 2
    assert run_on_ranks(_fsdp_reduced_in_last_backward, 5, 2, timeout=120) == [[1.0]] * 4 + [[]]


def _unfrozen_after_build(overlap: bool) -> tuple[str | None, dict]:
    """vision and language dp2 without FSDP2 (colocated on ranks 0-1), vision's second block frozen
    when the model is built and made trainable afterwards; one `forward_backward` and
    `reduce_gradients`. What `reduce_gradients` reported, and the gradients gathered whole."""
    from dtensor_mimo import MimoLayout, MimoModel, ParallelOptions, Parallelism
    from tests.test_mimo import _batches, _modules
    from tests.test_pipeline import _gathered_gradients

    layout = MimoLayout.colocated({"vision": Parallelism(dp=2), "language": Parallelism(dp=2)})
    plain = ParallelOptions(fsdp=False, overlap_grad_reduce=overlap)
    model = MimoModel(layout, *_modules(("vision",), ("vision.encoder.layers.1.",)),
                      options={"vision": plain, "language": plain})
    for p in model.encoders["vision"].parameters():
        p.requires_grad_(True)
    model.forward_backward(_batches(("vision",), False, 4, (64,))[0])
    return model.reduce_gradients(), _gathered_gradients(model)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "after_backward"])
def test_parameters_made_trainable_after_build_are_summed(overlap: bool) -> None:
    """A module's `GradientReducer` fixes its buckets at construction, over the parameters that
    required a gradient then; one made trainable afterwards (unfreezing a block between
    `forward_backward` calls) kept this rank's own gradient without a word, where the sums after
    backward (`overlap_grad_reduce=False`) summed it over dp. Reference: the single-process
    gradients with every parameter trainable."""
    from tests.test_mimo import _batches
    from tests.test_pipeline import _reference_gradients

    want = _reference_gradients(_batches(("vision",), False, 4, (64,))[0])[1]
    problem, got = run_on_ranks(_unfrozen_after_build, 2, overlap, timeout=120)[0]
    assert problem is None and got.keys() == want.keys()
    assert any(k.startswith("vision.encoder.layers.1.") for k in want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=2e-5, atol=2e-6, msg=lambda m: f"{k}: {m}")
