"""The step as data (`dtensor_mimo.schedule.program`): pure tests of every rank's program, and one
distributed test that training, ``model(batch)`` and ``predict`` run their programs through the
one executor.

| roles (pure)                                   | modes          | schedules                  |
|------------------------------------------------|----------------|----------------------------|
| pp = 1 encoder on its own ranks, first / later language stage | train | every torch schedule, pp 1-2, M 1-5 |
| encoder pipeline (last and inner stage)        | train          | GPipe order (window M)     |
| colocated (encoder + first stage), encoder-only, language-only, frozen encoder | train | any |
| any rank (encoder stages too)                  | forward, predict | one microbatch            |
"""

from __future__ import annotations

import itertools

import pytest

from dtensor_mimo.schedule import SCHEDULES, V_SCHEDULES, PipelineConfig
from dtensor_mimo.schedule.order import crossing_window, first_stage_actions
from dtensor_mimo.schedule.program import Action, RankRoles, StepShape, format_program, program

ENCODER = RankRoles(encoders=("vision",))
FIRST = RankRoles(language=True, first_stage=True)
LATER = RankRoles(language=True)
COLOCATED = RankRoles(encoders=("vision",), language=True, first_stage=True)


def _posts(actions: list[Action]) -> list[tuple[str, int]]:
    """The crossings a rank posts, flattened in order: ("rows" | "grads", microbatch)."""
    out = []
    for a in actions:
        if a.op in ("rows", "grads"):
            out.append((a.op, a.microbatch))
        out += _posts(list(a.nested))
    return out


def _global_order(m: int, window: int) -> list[tuple[str, int]]:
    """The order every rank must post a step's crossings in, written out from its definition:
    the forwards of the first `window` microbatches, then each backward j followed by the
    forward of j + window."""
    out = [("rows", k) for k in range(min(window, m))]
    for j in range(m):
        out.append(("grads", j))
        if j + window < m:
            out.append(("rows", j + window))
    return out


def _configs():
    for schedule, pp, m in itertools.product(sorted(SCHEDULES), (1, 2), (1, 2, 3, 5)):
        virtual = 2 if schedule in V_SCHEDULES or schedule in ("Interleaved1F1B", "LoopedBFS",
                                                               "InterleavedZeroBubble") else 1
        if schedule in V_SCHEDULES and pp == 1:
            continue
        yield PipelineConfig(microbatches=m, schedule=schedule, virtual_stages=virtual), pp


@pytest.mark.parametrize("config, pp", list(_configs()), ids=lambda x: getattr(x, "schedule", x))
def test_overlapped_encoder_and_first_stage_post_the_global_order(config, pp):
    """A lean step: the encoder rank and the first language stage post the same crossings in the
    global order (NCCL safety: the messages between two ranks are posted in one order on both
    sides), and the first stage's receive of microbatch k is posted before torch runs its
    forward F k (else the feed raises in the step)."""
    m, window = config.microbatches, crossing_window(config, pp, lean=True)
    shape = StepShape("train", ("vision",), ("vision",), m, window, overlapped=True)
    order = first_stage_actions(config, pp)
    encoder, first = program(ENCODER, shape), program(FIRST, shape, order)
    assert _posts(encoder) == _posts(first) == _global_order(m, window)
    # The encoder encodes k before it sends k, and runs backward j only after posting j's receive.
    seen = [str(a) for a in encoder]
    for k in range(m):
        assert seen.index(f"encode vision mb{k}") < seen.index(f"send rows mb{k}")
        assert seen.index(f"recv grads mb{k}") < seen.index(f"backward mb{k}")
    assert seen[-1] == "finish sends"
    # Inside the language action: torch's own computations of stage 0, each forward after its rows.
    (language,) = [a for a in first if a.op == "language"]
    if order is not None:
        assert [(a.op, a.microbatch) for a in language.nested if a.op in "FBIW"] == list(order)
    received = {a.microbatch for a in first if a.op == "rows"}
    for a in language.nested:
        if a.op == "rows":
            received.add(a.microbatch)
        if a.op == "F":
            assert a.microbatch in received, format_program(first)
    # A later stage posts nothing: only torch's own stage links.
    assert program(LATER, shape, None) == [Action("language", module="train")]


def test_program_reads_as_written():
    """What `format_program` prints for a lean 1F1B step over three microbatches at language pp 2."""
    config = PipelineConfig(microbatches=3, schedule="1F1B")
    shape = StepShape("train", ("vision",), ("vision",), 3, crossing_window(config, 2, lean=True), True)
    assert shape.window == 3
    assert format_program(program(ENCODER, shape)) == (
        "encode vision mb0 | send rows mb0 | encode vision mb1 | send rows mb1 | encode vision mb2 | "
        "send rows mb2 | recv grads mb0 | backward mb0 | recv grads mb1 | backward mb1 | recv grads mb2 | "
        "backward mb2 | finish sends")
    assert format_program(program(FIRST, shape, first_stage_actions(config, 2))) == (
        "recv rows mb0 | recv rows mb1 | recv rows mb2 | language train [F0 F1 B0 send grads mb0 F2 B1 "
        "send grads mb1 B2 send grads mb2] | finish sends")


@pytest.mark.parametrize("m", [1, 3])
def test_encoder_pipeline_posts_gpipe_order_on_its_last_stage(m):
    shape = StepShape("train", ("vision",), ("vision",), m, m, overlapped=True)
    last = program(RankRoles(encoder_stages=(("vision", True),)), shape)
    inner = program(RankRoles(encoder_stages=(("vision", False),)), shape)
    assert _posts(last) == _global_order(m, m) == _posts(program(FIRST, shape))
    assert inner == [Action("encoder pipeline", module="vision")]


@pytest.mark.parametrize("trainable", [("vision",), ()])
def test_colocated_three_phases(trainable):
    """Colocated: every microbatch encoded (one encode action per encoder) and its rows posted
    (sends and receives in one batch) before the language schedule; then the gradients, then one
    encoder backward. A frozen encoder gets no gradient crossing."""
    m = 3
    shape = StepShape("train", ("vision",), trainable, m, m, overlapped=False)
    both = program(COLOCATED, shape)
    ops = [a.op for a in both]
    assert ops.index("language") > max(i for i, op in enumerate(ops) if op in ("encode", "rows"))
    assert ops[-1] == "backward" and both[-1].microbatch is None
    assert [str(a) for a in both if a.op == "encode"] == ["encode vision"]  # every microbatch in one call
    assert [str(a) for a in both if a.op == "rows"] == [f"send+recv rows mb{k}" for k in range(m)]
    grads = [str(a) for a in both if a.op == "grads"]
    assert grads == ([f"send+recv grads mb{k}" for k in range(m)] if trainable else [])
    # Encoder-only and language-only ranks of the same step post the same crossings in the same order.
    encoder_only, language_only = program(ENCODER, shape), program(FIRST, shape)
    assert _posts(encoder_only) == _posts(language_only) == _posts(both)
    assert [str(a) for a in language_only if a.op == "grads"] == [g.replace("send+recv", "send") for g in grads]
    # Every send of the step is completed in it: the language-only rank's gradient sends too (after
    # the last one), the colocated rank's by its backward's waits (sends and receives in one batch).
    ops = [a.op for a in language_only]
    last_grads = max((i for i, op in enumerate(ops) if op == "grads"), default=-1)
    assert ops[-1] == "finish sends" and last_grads < len(ops) - 1


@pytest.mark.parametrize("mode", ["forward", "predict"])
def test_forward_and_predict_are_one_microbatch_of_the_same_program(mode):
    shape = StepShape(mode, ("vision", "audio"), ("vision",), check_rows=True)
    assert format_program(program(COLOCATED, shape)) == (
        f"encode vision mb0 | check rows mb0 | cross mb0 | language {mode}")
    assert format_program(program(ENCODER, shape)) == "encode vision mb0 | check rows mb0 | cross mb0"
    # A rank of neither module still joins the world-wide check, and nothing else.
    assert format_program(program(RankRoles(), shape)) == "check rows mb0"
    # An encoder in pipeline stages: each stage runs the microbatch in turn, the last one's rows cross.
    last, inner = RankRoles(encoder_stages=(("vision", True),)), RankRoles(encoder_stages=(("vision", False),))
    assert format_program(program(last, shape)) == "encoder pipeline vision mb0 | check rows mb0 | cross mb0"
    assert format_program(program(inner, shape)) == "encoder pipeline vision mb0 | check rows mb0"
    with pytest.raises(ValueError, match="a forward runs one microbatch"):
        StepShape("forward", (), (), microbatches=2)


# ---------------------------------------------------------------- the one executor, three modes
def _programs_run_by_the_executor():
    """On 2 ranks (vision on rank 0, the language model on rank 1): the actions the executor ran
    for a training step, ``model(batch)`` (then backward) and ``predict`` are the model's programs
    for the three modes; the forward's loss and gradients equal the training step's, which ran on
    what `MimoModel.prepare` derived ahead."""
    import torch

    from dtensor_mimo import MimoLayout, MimoModel, Parallelism
    from dtensor_mimo.data import ModalitySpec, SyntheticSpec, synthetic_batch
    from dtensor_mimo.models import Llama, LlamaConfig, ModalityEncoder, Projection, ViT, ViTConfig
    from dtensor_mimo.schedule import executor

    llama = Llama(LlamaConfig.tiny())
    vit = ViTConfig.tiny()
    model = MimoModel(MimoLayout({"vision": Parallelism(), "language": Parallelism()}), llama,
                      {"vision": ModalityEncoder(ViT(vit), Projection(vit.dim, LlamaConfig.tiny().dim))})
    model.init_weights({"vision": 1, "language": 0})
    batch = synthetic_batch(SyntheticSpec.tiny(batch_size=2, modalities={
        "vision": ModalitySpec.image(vit, special_token_id=64)}), seed=0)
    ran: list[str] = []
    original = executor._Run.__getattribute__

    def recording(self, name):
        if name.startswith("do_"):
            method = original(self, name)
            return lambda action: (ran.append(str(action)), method(action))[1]
        return original(self, name)

    shown, grads = {}, []
    executor._Run.__getattribute__ = recording
    try:
        for mode in ("train", "forward", "predict"):
            shown[mode] = format_program(model.program(batch, mode))
            ran.clear()
            if mode == "train":  # prepared ahead (`MimoModel.prepare`): the step derives no cuts itself
                model.prepare(batch)
                memo = batch.__dict__["_memo"]
                assert "loss normalizer" in memo
                assert sorted(k[0] for k in memo if isinstance(k, tuple)) == ["encoder cuts", "token ids outside"]
                from dtensor_mimo.data import balance

                derive, balance.encoder_cuts = balance.encoder_cuts, None
                try:
                    loss = model.forward_backward(batch)
                finally:
                    balance.encoder_cuts = derive
            elif mode == "forward":
                model.zero_grad()
                loss_f = model(batch)
                loss_f.backward()
            else:
                model.predict(batch)
            assert format_program([_Shown(a) for a in ran]) == shown[mode], (mode, ran, shown[mode])
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            if mode == "train":
                model.zero_grad()
    finally:
        executor._Run.__getattribute__ = original
    # The forward (one microbatch, one stage) is the training step's numbers.
    assert torch.allclose(loss_f.detach(), loss), (loss_f, loss)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert all(torch.allclose(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7) for n in grads[0])
    return shown


class _Shown:
    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


def test_train_forward_and_predict_run_through_one_executor():
    from tests.harness import run_on_ranks

    encoder_rank, language_rank = run_on_ranks(_programs_run_by_the_executor, 2, timeout=90)
    assert encoder_rank == {
        "train": "encode vision mb0 | send rows mb0 | recv grads mb0 | backward mb0 | finish sends",
        "forward": "encode vision mb0 | check rows mb0 | cross mb0",
        "predict": "encode vision mb0 | cross mb0",  # the item size was checked by the forward
    }
    assert language_rank == {
        "train": "recv rows mb0 | language train [F0 B0 send grads mb0] | finish sends",
        "forward": "check rows mb0 | cross mb0 | language forward",
        "predict": "cross mb0 | language predict",
    }
