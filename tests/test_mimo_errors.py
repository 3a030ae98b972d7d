"""`MimoModel` refuses what it cannot run, in pure Python, naming the module and the numbers."""

import contextlib
import math
import re
from typing import Any

import pytest
import torch

from dtensor_mimo import LayoutError, MimoLayout, MimoModel, ParallelOptions, Parallelism
from dtensor_mimo.data import SyntheticSpec, synthetic_batch
from dtensor_mimo.mimo import check_batch
from dtensor_mimo.models import Llama, LlamaConfig, ModalityEncoder, Projection, ViT, ViTConfig

P = Parallelism


def _model_args(out_dim: int = 32):
    llama = Llama(LlamaConfig.tiny())
    return llama, {"vision": ModalityEncoder(ViT(ViTConfig.tiny()), Projection(32, out_dim))}


@pytest.mark.parametrize("modules, options, match", [
    ({"vision": P(dp=2), "language": P(pp=2)}, {}, r"'language' has pp=2: pass pipeline=PipelineConfig"),
    ({"vision": P(cp=2), "language": P()}, {}, r"encoder 'vision' has cp=2; context parallelism"),
    ({"vision": P(), "audio": P(), "language": P()}, {},
     r"layout modules \['audio'\] are neither the language model nor an encoder"),
    ({"vision": P(), "language": P()}, {"lang": ParallelOptions()},
     r"options given for \['lang'\], which are not modules"),
    ({"vision": P()}, {}, r"needs a language module named 'language'"),
])
def test_layout_and_model_disagree(modules, options, match):
    llama, encoders = _model_args()
    with pytest.raises(LayoutError, match=match):
        MimoModel(MimoLayout(modules), llama, encoders, options=options)


class _Decoder(torch.nn.Module):
    """A user's decoder with the protocol's parts; `scale` (a parameter outside them) and a
    forward that always applies norm and output are what a pipeline cannot split."""

    def __init__(self, scale: bool = False, skips_missing_parts: bool = True) -> None:
        super().__init__()
        self.config = LlamaConfig.tiny()
        self.tok_embeddings = torch.nn.Embedding(64, 32)
        self.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(32, 32) for i in range(2)})
        self.norm, self.output = torch.nn.LayerNorm(32), torch.nn.Linear(32, 64)
        if scale:
            self.scale = torch.nn.Parameter(torch.ones(()))
        self.skips_missing_parts = skips_missing_parts

    def forward(self, *, h, positions=None, document_ids=None, sequence_index=None):
        for layer in self.layers.values():
            h = layer(h)
        if self.skips_missing_parts and self.norm is None:
            return h
        return self.output(self.norm(h))


@pytest.mark.parametrize("language, virtual_stages, cut", [
    (P(pp=2), 1, "the layout gives it pp=2"),
    # two stages on one rank: cut just the same (before, accepted: the first stage's forward raised on
    # the language rank alone, in the schedule, and the encoder rank waited for its gradients)
    (P(), 2, r"the pipeline cuts it into 2 stages, pp=1 x virtual_stages=2"),
], ids=["pp2", "pp1_two_stages"])
@pytest.mark.parametrize("decoder, match", [
    (_Decoder(scale=True), r"it needs no parameters outside tok_embeddings, layers, norm, output \({cut}; "
                           r".* \['scale'\] are in none of them\)"),
    (_Decoder(skips_missing_parts=False),
     r"it needs a forward that runs the parts a pipeline stage holds \(its layers, then norm and output only when "
     r"they are not None\): as a middle stage .* raised TypeError: 'NoneType' object is not callable"),
], ids=["parameter_outside_the_parts", "forward_needs_every_part"])
def test_user_decoder_that_cannot_be_split_into_stages_is_named(decoder, match, language, virtual_stages, cut):
    from dtensor_mimo import PipelineConfig

    _, encoders = _model_args()
    layout = MimoLayout({"vision": P(), "language": language})
    schedule = "1F1B" if virtual_stages == 1 else "Interleaved1F1B"
    with pytest.raises(TypeError, match=r"the language model \(_Decoder\) does not meet the language protocol .*"
                                        + match.replace("{cut}", cut)):
        MimoModel(layout, decoder, encoders,
                  pipeline=PipelineConfig(microbatches=2, schedule=schedule, virtual_stages=virtual_stages))
    from dtensor_mimo.schedule.checks import check_model as _check_model

    _check_model(  # at pp = 1 the same decoder is fine: nothing is split
        MimoLayout({"vision": P(), "language": P()}), decoder, encoders, "language", {}, None)


def test_user_decoder_split_keeps_its_class_and_leaves_it_whole():
    from dtensor_mimo.models.protocol import decoder_stage

    decoder = _Decoder()
    stage = decoder_stage(decoder, [1], first=False, last=True)
    assert type(stage) is _Decoder and stage.layers["1"] is decoder.layers["1"] and stage.tok_embeddings is None
    assert [n for n, _ in stage.named_parameters()] == ["layers.1.weight", "layers.1.bias", "norm.weight",
                                                       "norm.bias", "output.weight", "output.bias"]
    assert list(decoder.layers) == ["0", "1"] and decoder.tok_embeddings is not None  # the whole decoder is intact
    stage.register_forward_hook(lambda *_: None)
    assert not decoder._forward_hooks


def test_projection_width_must_match_language_model():
    llama, encoders = _model_args(out_dim=48)
    with pytest.raises(ValueError, match=r"encoder 'vision' projects to 48 features but the language "
                                         r"model's dim is 32"):
        MimoModel(MimoLayout({"vision": P(), "language": P()}), llama, encoders)


@pytest.mark.parametrize("device", ["nccl", "cuda:0", "gpu"])
def test_a_device_word_other_than_cpu_or_cuda_is_refused_by_name(device):
    llama, encoders = _model_args()
    with pytest.raises(ValueError, match=rf"MimoModel device_type={device!r} is not 'cpu' \(gloo\) or 'cuda'"):
        MimoModel(MimoLayout({"vision": P(), "language": P()}), llama, encoders, device_type=device)


TP_SPLITS = [  # (layout, language config, encoder configs, what the error names)
    ({"vision": P(), "language": P(tp=2)}, dict(vocab_size=67), {},
     r"module 'language' \(Llama\): tensor parallel over tp=2 needs these sizes divisible by 2: vocab_size=67"),
    ({"vision": P(tp=2), "language": P()}, {}, dict(n_heads=3),
     r"module 'vision' \(ViT\): tensor parallel over tp=2 needs these sizes divisible by 2: n_heads=3"),
]


def _tp_split_error(modules, language, vision, match) -> str:
    """Build the model with `modules`; the error every rank raises."""
    vit = ViT(ViTConfig.tiny(dim=48, **vision)) if vision else ViT(ViTConfig.tiny())
    encoders = {"vision": ModalityEncoder(vit, Projection(vit.config.dim, 32))}
    try:
        MimoModel(MimoLayout(modules), Llama(LlamaConfig.tiny(**language)), encoders)
    except ValueError as e:
        return str(e)
    return "built"


@pytest.mark.parametrize("modules, language, vision, match", TP_SPLITS, ids=["language_vocab", "vision_heads"])
def test_sizes_tp_cannot_split_fail_every_rank_before_any_process_group(modules, language, vision, match):
    """A module's tp plan that cannot split its sizes is refused by name in pure Python, before any
    process group: raised only on that module's ranks (inside its plan) it left the other modules'
    ranks building their parts and waiting for them in the first collective."""
    import re

    from tests.harness import run_on_ranks

    assert re.search(match, _tp_split_error(modules, language, vision, match))  # no process group here
    errors = run_on_ranks(_tp_split_error, MimoLayout(modules).world_size, modules, language, vision, match,
                          timeout=60)
    assert all(re.search(match, e) for e in errors), errors


class _UserTower(torch.nn.Module):
    """A user's own tower inside a library `ModalityEncoder`: no tp plan, no blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = torch.nn.Linear(48, 32)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # [N, 3, 16, 16] -> [N, 16, 32]
        return self.patch(images.unfold(2, 4, 4).unfold(3, 4, 4).permute(0, 2, 3, 1, 4, 5).flatten(3).flatten(1, 2))


def _user_tower_error(vision: Parallelism, options: ParallelOptions) -> str:
    """Build a model whose vision encoder is ModalityEncoder(a user's tower, Projection); the error raised here."""
    encoders = {"vision": ModalityEncoder(_UserTower(), Projection(32, 32))}
    try:
        MimoModel(MimoLayout({"vision": vision, "language": P()}), Llama(LlamaConfig.tiny()), encoders,
                  options={"vision": options})
    except (TypeError, ValueError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"
    return "built"


@pytest.mark.parametrize("vision, options, match", [
    (P(tp=2), ParallelOptions(), r"TypeError: encoder 'vision' \(ModalityEncoder\) does not meet the encoder protocol "
                                 r".*: it needs its encoder \(_UserTower\) to have parallelize\(tp_mesh, options\) "
                                 r"\(its tensor parallel plan: the layout gives it tp=2\)"),
    (P(), ParallelOptions(activation_checkpointing=1),
     r"TypeError: encoder 'vision' \(ModalityEncoder\) does not meet the encoder protocol .*: it needs its encoder "
     r"or projection to have layers \(an nn.ModuleDict of blocks, for activation_checkpointing\)"),
], ids=["tp_without_a_plan", "checkpointing_without_blocks"])
def test_modality_encoder_of_a_user_tower_is_checked_on_every_rank_before_any_process_group(vision, options, match):
    """A `ModalityEncoder` around a user's tower is parallelized part by part, the tower through its own
    ``parallelize``: at tp 2 without one, it raised a bare AttributeError (and with activation checkpointing
    over no blocks a ValueError) on the encoder's ranks alone, inside its tp plan after the meshes were made,
    while the language rank built its part and went on to wait for them. Refused by name in pure Python."""
    import re

    from tests.harness import run_on_ranks

    assert re.search(match, _user_tower_error(vision, options))  # no process group here
    world = MimoLayout({"vision": vision, "language": P()}).world_size
    errors = run_on_ranks(_user_tower_error, world, vision, options, timeout=60)
    assert all(re.search(match, e) for e in errors), errors


def test_batch_with_a_modality_the_model_lacks():
    batch = synthetic_batch(SyntheticSpec.tiny(), seed=0)  # vision and audio
    layout = MimoLayout({"vision": P(), "language": P()})
    with pytest.raises(ValueError, match=r"modalities \['audio'\] that the model has no encoder for"):
        check_batch(layout, "language", ["vision"], batch)


def test_cp_needs_sequence_multiple_of_two_cp():
    batch = synthetic_batch(SyntheticSpec.tiny(seq_len=62, modalities={}), seed=0)
    layout = MimoLayout({"vision": P(), "language": P(cp=2)})
    with pytest.raises(ValueError, match=r"cp=2: the sequence length 62 must be a multiple of 2\*cp=4"):
        check_batch(layout, "language", ["vision"], batch)


@pytest.mark.parametrize("weight", [float("nan"), -0.5, float("inf")])
def test_loss_weights_that_are_negative_or_not_finite_are_refused_by_name(weight):
    """A NaN loss weight made every step's gradients non-finite (each step skipped, the warning
    blaming the lr or the labels); a negative one trained away from its target. Refused where the
    batch is checked (every rank, before any exchange), naming the sample and position; a weight
    on an IGNORE label counts nothing and stays allowed."""
    from dtensor_mimo.data import IGNORE_INDEX

    batch = synthetic_batch(SyntheticSpec.tiny(modalities={}), seed=0)
    layout = MimoLayout({"vision": P(), "language": P()})
    target = int((batch.labels[1] != IGNORE_INDEX).nonzero()[0])
    batch.loss_mask[1, target] = weight
    with pytest.raises(ValueError, match=rf"weighs its target at position {target} by {weight}"):
        check_batch(layout, "language", ["vision"], batch)
    ignored = synthetic_batch(SyntheticSpec.tiny(modalities={}), seed=0)
    ignored.labels[1, target] = IGNORE_INDEX
    ignored.loss_mask[1, target] = weight
    check_batch(layout, "language", ["vision"], ignored)


def test_sequence_parallel_rows_that_tp_does_not_divide_on_torch_before_2_13(monkeypatch):
    """torch 2.11's DTensor backward fails on a sequence sharded unevenly over tp (2.13 trains it:
    test_mimo's tp_sp_odd): there the batch is refused by name, on every rank before any collective."""
    from dtensor_mimo.layout import torch_compat

    odd = synthetic_batch(SyntheticSpec.tiny(seq_len=63, modalities={}), seed=0)
    even = synthetic_batch(SyntheticSpec.tiny(seq_len=64, modalities={}), seed=0)
    layout = MimoLayout({"vision": P(), "language": P(tp=2)})
    monkeypatch.setattr(torch_compat, "RELEASE", (2, 11))
    with pytest.raises(ValueError, match=r"'language' has tp=2 with sequence parallel \(sp\): on torch .* a rank "
                                         r"holds 63 rows of the sequence length 63; pad the rows to a multiple of 2"):
        check_batch(layout, "language", ["vision"], odd, sequence_parallel=True)
    check_batch(layout, "language", ["vision"], even, sequence_parallel=True)
    check_batch(layout, "language", ["vision"], odd)  # without sp: nothing to split
    monkeypatch.setattr(torch_compat, "RELEASE", (2, 13))
    check_batch(layout, "language", ["vision"], odd, sequence_parallel=True)


def _token_outside_vocabulary(mode: str, token: int) -> str | None:
    """vision dp2 on ranks 0-1, the language model (vocabulary 64) on rank 2; a batch whose
    sample 1 holds text id `token` at position 2: what a `mode` step raises on this rank."""
    import dataclasses

    from dtensor_mimo import MimoOptimizer, train_step
    from tests.test_mimo import _batches, _modules

    model = MimoModel(MimoLayout({"vision": P(dp=2), "language": P()}), *_modules(("vision",)))
    optimizer = MimoOptimizer(model)
    good = _batches(("vision",), packed=False, batch_size=4)[0]
    tokens = good.tokens.clone()
    tokens[1, 2] = token
    bad = dataclasses.replace(good, tokens=tokens)
    run = {"train": lambda b: train_step(model, optimizer, b), "predict": model.predict, "forward": model}[mode]
    return _refused_then_trains(run, bad, lambda: train_step(model, optimizer, good))  # (64: vision's special id)


@pytest.mark.parametrize("token", [70, -1])
@pytest.mark.parametrize("mode", ["train", "predict", "forward"])
def test_token_ids_outside_the_vocabulary_fail_every_rank_by_name(mode, token):
    """A text id the language model's embedding cannot look up (past its vocabulary, or a negative
    pad id) raised an IndexError on the language ranks alone, in their embedding, while the
    encoder ranks waited for their rows' gradients (or the ids' all-reduce): a hang. Refused on
    every rank before any exchange, naming the sample, the position, the id and the vocabulary."""
    from tests.harness import run_on_ranks

    errors = run_on_ranks(_token_outside_vocabulary, 3, mode, token, timeout=90)
    assert all(e is not None and e == errors[0] for e in errors), errors
    assert (f"the batch's token ids must index the vocabulary of 'language' (vocab_size=64) or be the special "
            f"token id of one of its modalities {{'vision': 64}}: sample 1 holds id {token} at position 2 "
            f"(1 such token in the batch)") in errors[0]


def _empty_batch(kind: str, mode: str) -> str | None:
    """vision dp2 on ranks 0-1, the language model at tp2 on ranks 2-3; a global batch of no
    samples, or of rows of no positions: what a `mode` run raises on this rank."""
    from dtensor_mimo import MimoOptimizer, train_step
    from dtensor_mimo.data import MimoBatch
    from tests.test_mimo import _batches, _modules

    model = MimoModel(MimoLayout({"vision": P(dp=2), "language": P(tp=2)}), *_modules(("vision",)))
    optimizer = MimoOptimizer(model)
    good = _batches(("vision",), packed=False, batch_size=4)[0]
    bad = (good.select_samples(range(0)) if kind == "no samples" else
           MimoBatch(good.tokens[:, :0], good.labels[:, :0], good.loss_mask[:, :0]))
    run = {"train": lambda b: train_step(model, optimizer, b), "predict": model.predict}[mode]
    return _refused_then_trains(run, bad, lambda: train_step(model, optimizer, good))


def _refused_then_trains(run, bad, train) -> str | None:
    """The ValueError `run` raises on `bad` on this rank (None: none), once every rank is past it
    (a barrier: every rank raised before any exchange, none is left waiting inside one); then
    `train` (a good step: the model still trains)."""
    import torch.distributed as dist

    try:
        run(bad)
        error = None
    except ValueError as e:
        error = str(e)
    dist.barrier()
    train()
    return error


@pytest.mark.parametrize("mode", ["train", "predict"])
@pytest.mark.parametrize("kind, shape", [("no samples", "[0, 64]"), ("no positions", "[4, 0]")])
def test_a_batch_of_no_samples_or_no_positions_fails_every_rank_by_name(kind, shape, mode):
    """A global batch of no samples (``select_samples(range(0))``, a loader's empty last batch) or
    of rows of no positions: the language ranks failed alone inside DTensor's sharding propagation
    under tp ("integer modulo by zero"), or every rank hung, while the encoder ranks waited for them;
    on other layouts a training step over nothing was applied (AdamW's momentum and weight decay
    moved the weights, the lr schedule advanced). Refused on every rank before any exchange,
    naming the tokens' shape."""
    from tests.harness import run_on_ranks

    errors = run_on_ranks(_empty_batch, 4, kind, mode, timeout=120)
    assert all(e is not None and e == errors[0] for e in errors), errors
    assert f"the batch has {kind} (tokens of shape {shape})" in errors[0], errors[0]


def _train_without_grad(context: str) -> list[str | float]:
    """vision on rank 0, language on rank 1: a train_step under `context` (refused on every rank),
    then one outside it (trains: the refusal left nothing half done)."""
    from dtensor_mimo import MimoOptimizer, train_step
    from tests.test_mimo import _batches, _modules

    model = MimoModel(MimoLayout({"vision": P(), "language": P()}), *_modules(("vision",)))
    optimizer = MimoOptimizer(model)
    batch = _batches(("vision",), packed=False, batch_size=4)[0]
    out: list[str | float] = []
    with {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[context]():
        try:
            train_step(model, optimizer, batch)
        except RuntimeError as e:
            out.append(str(e))
    out.append(float(train_step(model, optimizer, batch).loss))
    return out


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_a_training_step_without_grad_is_refused_on_every_rank(context):
    """A train_step under no_grad / inference_mode has no backward: refused by name on every rank
    before any exchange (the language ranks' backward would have failed alone, the encoder ranks
    waiting for their rows' gradients)."""
    from tests.harness import run_on_ranks

    outs = run_on_ranks(_train_without_grad, 2, context, timeout=90)
    assert all(len(o) == 2 and "under torch.no_grad() or torch.inference_mode() has no backward" in o[0]
               for o in outs), outs
    assert outs[0][1] == outs[1][1] and math.isfinite(outs[0][1])


def _encoder_disagrees_with_metadata():
    import torch.distributed as dist

    from dtensor_mimo.bridge import PlanError
    from dtensor_mimo.data import ModalitySpec

    llama, encoders = _model_args()
    model = MimoModel(MimoLayout({"vision": P(dp=2), "language": P()}), llama, encoders)
    model.item_rules = {}  # as for an encoder with no item rule: the rows' own check catches it
    wrong = ModalitySpec(64, (ViTConfig.tiny().in_channels, 16, 16), tokens_per_item=8,
                         max_items=2)  # the ViT makes 16 tokens per image
    batch = synthetic_batch(SyntheticSpec.tiny(modalities={"vision": wrong}), seed=0)
    with pytest.raises(PlanError, match=r"rank\(s\) \[0\] hold a local shard whose shape disagrees with the plan for "
                                        r"MeshSpec\('vision'"):
        model(batch)
    dist.barrier()  # every rank raised; none is left inside the exchange
    return True


def test_encoder_output_length_disagreeing_with_batch_fails_on_every_rank():
    from tests.harness import run_on_ranks

    assert run_on_ranks(_encoder_disagrees_with_metadata, 3, timeout=60) == [True] * 3


def _items_of_another_dtype(dtype, varied):
    """A training step (vision on rank 0, the language model on rank 1) on images in `dtype`, one
    tensor of them or a list (`varied`), and the same step on them in float32: the two losses."""
    import dataclasses

    from dtensor_mimo import MimoOptimizer, train_step
    from tests.test_mimo import OPT, _batches, _modules

    def step(to):
        llama, encoders = _modules(("vision",), varied=varied)
        model = MimoModel(MimoLayout({"vision": P(), "language": P()}), llama, encoders)
        batch = _batches(("vision",), packed=False, varied=varied)[0]
        m = batch.modalities["vision"]
        pixels = lambda x: x.mul(50).round().abs().to(to)  # noqa: E731 — whole numbers: exact in every dtype
        inputs = [pixels(x) for x in m.inputs] if varied else pixels(m.inputs)
        batch = dataclasses.replace(batch, modalities={"vision": dataclasses.replace(m, inputs=inputs)})
        return train_step(model, MimoOptimizer(model, OPT), batch).loss

    return step(dtype), step(torch.float32)


@pytest.mark.parametrize("varied", [False, True], ids=["one tensor", "a list"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.uint8])
def test_items_of_another_dtype_train_on_every_rank(dtype, varied):
    """The library's encoders take items in another dtype than their weights (float64 from numpy,
    uint8 pixels) as the float32 items they equal, whether the batch holds one tensor of them or a
    list: the list path cast them, the one-tensor path raised on the vision rank alone while the
    language rank waited for its rows (a hang)."""
    from tests.harness import run_on_ranks

    for got, want in run_on_ranks(_items_of_another_dtype, 2, dtype, varied, timeout=60):
        assert got == pytest.approx(want, rel=1e-6)


def _batch_disagrees_with_encoder_config(spec):
    import torch.distributed as dist

    from dtensor_mimo.data import ModalitySpec

    llama, encoders = _model_args()
    model = MimoModel(MimoLayout({"vision": P(dp=2), "language": P()}), llama, encoders)
    batch = synthetic_batch(SyntheticSpec.tiny(modalities={"vision": ModalitySpec(64, *spec, max_items=2)}), seed=0)
    try:
        model(batch)
    except ValueError as e:
        dist.barrier()  # raised on every rank, before any exchange
        return str(e)
    return None


@pytest.mark.parametrize("spec, message", [
    (((3, 16, 16), 8), "tokens_per_item=8, but the ViT gives 16 rows per image"),
    (((3, 20, 20), 16), "items of shape [3, 20, 20], but the ViT takes [3, 16, 16]"),
])
def test_batch_disagreeing_with_encoder_config_fails_on_every_rank_by_name(spec, message):
    from tests.harness import run_on_ranks

    for error in run_on_ranks(_batch_disagrees_with_encoder_config, 3, spec, timeout=60):
        assert error is not None and "the batch's 'vision' items do not fit encoder 'vision'" in error
        assert message in error


OWN_ERROR = (r"encoder 'vision' produced rows of shape \(\d+, 32\) for microbatch \d, but the batch "
             r"metadata plans \(\d+, 32\)|encoder stage 0 made 16 tokens per item but the batch metadata "
             r"says tokens_per_item=8")
OTHERS_ERROR = r"\d rank\(s\) produced encoder rows that disagree with the batch metadata"


def _wrong_rows_fail_the_step(model, error_pattern: str) -> str:
    """One `train_step` on a batch whose metadata plans 8 rows per image where the ViT makes 16:
    it raises `error_pattern` (on every rank), no weight changes, and the next step runs."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from dtensor_mimo import MimoOptimizer, train_step
    from dtensor_mimo.bridge import PlanError
    from dtensor_mimo.data import ModalitySpec

    model.item_rules = {}  # as for an encoder with no item rule: the rows' own check catches it
    optimizer = MimoOptimizer(model)
    wrong = ModalitySpec(64, (ViTConfig.tiny().in_channels, 16, 16), tokens_per_item=8, max_items=2)
    batch = synthetic_batch(SyntheticSpec.tiny(batch_size=4, modalities={"vision": wrong}), seed=0)
    local = lambda p: p.to_local() if isinstance(p, DTensor) else p  # noqa: E731  (no collective)
    before = {n: local(p).detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(PlanError, match=error_pattern) as error:
        train_step(model, optimizer, batch)
    assert all(torch.equal(local(p), before[n]) for n, p in model.named_parameters()), "a weight changed"
    good = synthetic_batch(SyntheticSpec.tiny(batch_size=4, modalities={"vision": ModalitySpec.image(
        ViTConfig.tiny(), special_token_id=64)}), seed=0)
    train_step(model, optimizer, good)  # nobody was left inside an exchange
    dist.barrier()
    return str(error.value)


def _pipelined_encoder_disagrees_with_metadata(modules, offsets):
    from dtensor_mimo import PipelineConfig

    llama, encoders = _model_args()
    model = MimoModel(MimoLayout(modules, offsets=offsets), llama, encoders, pipeline=PipelineConfig(microbatches=2))
    return _wrong_rows_fail_the_step(model, rf"{OWN_ERROR}|{OTHERS_ERROR}")


@pytest.mark.parametrize("modules, offsets", [
    ({"vision": P(dp=2), "language": P(pp=2)}, None),
    ({"vision": P(dp=2), "language": P(pp=2)}, {"vision": 0, "language": 0}),
    ({"vision": P(pp=2), "language": P()}, None),
], ids=["overlapped", "colocated", "encoder_stages"])
def test_pipelined_encoder_output_disagreeing_with_batch_fails_on_every_rank(modules, offsets):
    from tests.harness import run_on_ranks

    import re

    world = MimoLayout(modules, offsets=offsets).world_size
    messages = run_on_ranks(_pipelined_encoder_disagrees_with_metadata, world, modules, offsets, timeout=60)
    # Every rank raised; the ranks whose encoder made the wrong rows say which and how.
    assert any(re.search(OWN_ERROR, m) for m in messages), messages
    assert all(re.search(f"{OWN_ERROR}|{OTHERS_ERROR}", m) for m in messages), messages


class _BareEncoder(torch.nn.Module):
    """A module that maps items to rows but declares nothing else."""

    def forward(self, x):
        return x


@pytest.mark.parametrize("modules, options, encoder, match", [
    ({"vision": P(), "language": P()}, {}, _BareEncoder(),
     r"encoder 'vision' \(_BareEncoder\) does not meet the encoder protocol \(dtensor_mimo.models.protocol\): "
     r"it needs out_dim \(an int: the width of its output rows\)$"),
    ({"vision": P(tp=2), "language": P()}, {"vision": ParallelOptions(activation_checkpointing=1)}, _BareEncoder(),
     r"it needs out_dim .*; parallelize\(tp_mesh, options\) \(its tensor parallel plan: the layout gives it tp=2\); "
     r"layers \(an nn.ModuleDict of blocks, for activation_checkpointing\)"),
    ({"vision": P(), "language": P()}, {}, "not a module", r"it needs to be an nn.Module \(it is a str\)"),
])
def test_user_encoders_missing_the_protocol_are_named(modules, options, encoder, match):
    llama, _ = _model_args()
    with pytest.raises(TypeError, match=match):
        MimoModel(MimoLayout(modules), llama, {"vision": encoder}, options=options)


def test_user_language_model_missing_the_protocol_is_named():
    _, encoders = _model_args()

    class Decoder(torch.nn.Module):
        config = LlamaConfig.tiny()
        layers = torch.nn.ModuleDict()

    with pytest.raises(TypeError, match=r"the language model \(Decoder\) does not meet the language protocol "
                                         r"\(dtensor_mimo.models.protocol\): it needs tok_embeddings; norm; output; "
                                         r"parallelize\(tp_mesh, options\) .*tp=2\); set_attention_fn\(fn\) "
                                         r"\(the layout gives it cp=2\)"):
        MimoModel(MimoLayout({"vision": P(), "language": P(tp=2, cp=2)}), Decoder(), encoders)


def _unpipelined_rows_disagree(language, hops):
    """The step without a `pipeline` (a one-stage pipeline, one microbatch): a wrong shard crosses
    as zeros, its rank records the error on the host, and `train_step`'s one all-reduce fails the
    step on every rank."""
    llama, encoders = _model_args()
    model = MimoModel(MimoLayout({"vision": P(dp=2), "language": language}), llama, encoders, bridge_hops=hops)
    return _wrong_rows_fail_the_step(model, rf"{OWN_ERROR}|{OTHERS_ERROR}")


@pytest.mark.parametrize("language, hops", [(P(), None), (P(tp=2), 2)], ids=["one_hop", "two_hop_tp2"])
def test_unpipelined_encoder_output_disagreeing_with_batch_fails_the_step_on_every_rank(language, hops):
    from tests.harness import run_on_ranks

    import re

    world = MimoLayout({"vision": P(dp=2), "language": language}).world_size
    messages = run_on_ranks(_unpipelined_rows_disagree, world, language, hops, timeout=60)
    assert sum(bool(re.search(OWN_ERROR, m)) for m in messages) == 2, messages  # the vision ranks
    assert all(re.search(f"{OWN_ERROR}|{OTHERS_ERROR}", m) for m in messages), messages


def test_generate_refuses_prompts_whose_new_tokens_would_overwrite_items():
    """`generate` writes each new id into the row after its prompt: an item's special tokens there
    (an image after the prompt) are refused up front, naming the samples and their prompt lengths,
    not by the batch check on the first rewritten row ("sample 0 has 12 'vision' tokens ...")."""
    from dtensor_mimo.sequence import greedy_generate

    batch = synthetic_batch(SyntheticSpec.tiny(batch_size=3, text_only_samples=1, modalities={
        "vision": SyntheticSpec.tiny().modalities["vision"]}), seed=0)
    special = batch.tokens == 64
    calls = []

    def predict(b):
        calls.append(b)
        return torch.zeros(b.batch_size, b.seq_len, dtype=torch.int64)

    has = [r for r in range(3) if special[r].any()]
    first = {r: int(torch.nonzero(special[r])[0]) for r in has}  # where each row's first item starts
    past = [int(special[i].nonzero().max()) + 1 if special[i].any() else 1 for i in range(3)]  # every item in
    r, lengths = has[0], list(past)
    lengths[r] = max(1, first[r] - 2)  # this prompt ends two tokens before the row's first item
    with pytest.raises(ValueError, match=rf"generate: samples \[{r}\] hold 'vision' tokens \(id 64\) within the 4 "
                                         rf"positions after their prompts \(prompt lengths \[{lengths[r]}\]\)"):
        greedy_generate(predict, batch, lengths, 4)
    assert not calls  # refused before any prediction
    room = batch.seq_len - max(past)  # prompts past every item: generated as before
    assert room >= 1 and greedy_generate(predict, batch, past, room) == [[0] * room] * 3 and len(calls) == room


def _sharded_rows_from_a_user_tp_plan() -> str:
    """A user's encoder (`PatchMLP`) whose tp plan leaves its rows sharded over tp (its last layer a
    ColwiseParallel: each rank returns half the width) trains one step."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from dtensor_mimo import AdamWConfig, MimoOptimizer, train_step
    from tests.test_mimo import LLAMA, PatchMLP, _batches, _modules

    class HalfWidth(PatchMLP):
        def parallelize(self, tp_mesh, options) -> None:
            parallelize_module(self, tp_mesh, {"patch_in": ColwiseParallel(),
                                               "patch_out": ColwiseParallel(input_layouts=Shard(-1))})

    model = MimoModel(MimoLayout({"vision": P(tp=2), "language": P()}), _modules(("vision",))[0],
                      {"vision": HalfWidth(LLAMA.dim)})
    try:
        train_step(model, MimoOptimizer(model, AdamWConfig()), _batches(("vision",), False, 4, (64,))[0])
    except Exception as e:  # noqa: BLE001 - the message is the result
        return str(e)
    return ""


def test_encoder_rows_of_another_width_name_the_width_not_tokens_per_item():
    """Rows of the right count but another width than the language model's (a user's tp plan that
    leaves them sharded) fail the step on every rank with a message about the width and tp, not
    one telling the user to change the batch's tokens_per_item (which is right)."""
    from tests.harness import run_on_ranks

    messages = run_on_ranks(_sharded_rows_from_a_user_tp_plan, 3, timeout=60)
    own = [m for m in messages if "produced rows" in m]
    assert len(own) == 2 and all(m for m in messages), messages
    for m in own:
        assert "16 wide" in m and "dim is 32" in m and "replicated over its tp ranks" in m, m
        assert "tokens_per_item match" not in m, m


@pytest.mark.parametrize("max_new_tokens", [-2, 1.5, True])
def test_generate_refuses_a_max_new_tokens_that_is_no_count(max_new_tokens):
    """A negative `max_new_tokens` passed every check (a prompt of n tokens "fits" in a row of S
    when n <= S - max_new_tokens) and `generate` returned an empty answer for every sample,
    silently; it is refused by name before any prediction, as a non-integer one (1.5 raised
    Python's "'float' object cannot be interpreted as an integer", True ran one token)."""
    from dtensor_mimo.sequence import greedy_generate

    batch = synthetic_batch(SyntheticSpec.tiny(batch_size=2, modalities={}), seed=0)
    calls = []

    def predict(b):
        calls.append(b)
        return torch.zeros(b.batch_size, b.seq_len, dtype=torch.int64)

    with pytest.raises(ValueError, match=rf"generate: max_new_tokens={max_new_tokens!r}; .* an integer >= 0"):
        greedy_generate(predict, batch, [3, 4], max_new_tokens)
    assert not calls
    assert greedy_generate(predict, batch, [3, 4], 0) == [[], []] and not calls  # zero: nothing to generate


@pytest.mark.parametrize("counts", [range(1, 3), torch.tensor([1, 2])], ids=["range", "tensor"])
def test_generate_takes_any_sequence_of_counts_per_sample(counts):
    """`MimoModel.generate` / `greedy_generate` take ``max_new_tokens: int | Sequence[int]``
    ("one count, or one per sample"), but only a list or a tuple was read as per-sample counts: a
    range (a Sequence[int]) or a 1-D tensor was refused with "give the number of tokens to generate
    per sample, an integer >= 0". Each is read as a list of the same counts."""
    from dtensor_mimo.sequence import greedy_generate

    batch = synthetic_batch(SyntheticSpec.tiny(batch_size=2, modalities={}), seed=0)

    def predict(b):
        return torch.full((b.batch_size, b.seq_len), 7, dtype=torch.int64)

    assert greedy_generate(predict, batch, [3, 4], counts) == [[7], [7, 7]]  # 1 and 2 new ids, as [1, 2]


def test_generate_ends_a_sample_at_a_modality_placeholder_it_generates():
    """A model whose vocabulary holds a modality's placeholder id (the trainer's does: the
    tokenizer's added ``<image>`` has a head row) may pick it greedily. Written into the row, it
    marked one more item position than the sample's items fill, and the next prediction's batch
    check raised ``BatchError: sample 0 has 17 'vision' tokens (id 5) but items_per_sample[0]=1 ...``
    from arguments that were right (the trainer's held-out answers at the end of a run among
    them). The placeholder ends its sample instead, as its last id; the other samples go on."""
    from dtensor_mimo.data import ModalitySpec
    from dtensor_mimo.sequence import greedy_generate

    spec = SyntheticSpec.tiny(batch_size=3, text_only_samples=1, modalities={
        "vision": ModalitySpec.image(ViTConfig.tiny(), special_token_id=5, max_items=1)})
    batch = synthetic_batch(spec, seed=4)
    assert batch.modalities["vision"].items_per_sample == (1, 0, 0) and (batch.tokens[0, 18:] != 5).all()
    prompts = [20, 3, 5]

    def predict(b):  # 7 everywhere, but the placeholder after sample 0's first new id and as sample 1's first
        ids = torch.full((b.batch_size, b.seq_len), 7)
        ids[0, prompts[0]] = ids[1, prompts[1] - 1] = 5
        return ids

    assert greedy_generate(predict, batch, prompts, 4) == [[7, 5], [5], [7, 7, 7, 7]]


def _two_images(swapped: bool):
    """One sample holding two images of 16 and 4 patches (the tiny dynamic-resolution ViT, patch 4),
    or the same two in the other order: the same token ids, items and tokens per sample."""
    from dtensor_mimo.data import MimoBatch, ModalityInputs

    g = torch.Generator().manual_seed(0)
    shapes = [(3, 16, 16), (3, 8, 8)][::-1 if swapped else 1]
    inputs = [torch.randn(*s, generator=g) for s in shapes]
    tokens = torch.randint(0, 60, (1, 48), generator=g)
    tokens[0, 4:24] = 64
    labels = torch.roll(tokens, -1, 1)
    labels[0, -1] = -100
    per_item = tuple((h // 4) * (w // 4) for _, h, w in shapes)
    return MimoBatch(tokens, labels, (tokens != 64).float(), {"vision": ModalityInputs(inputs, (2,), per_item, 64)})


def _items_swapped_on_one_rank():
    """A first step whose language rank (2) was fed the batch with its two images in the other
    order: this rank's error, or None."""
    import torch.distributed as dist

    from dtensor_mimo import MimoOptimizer, train_step
    from tests.test_mimo import OPT, _modules

    llama, encoders = _modules(("vision",), varied=True)
    model = MimoModel(MimoLayout({"vision": P(dp=2), "language": P()}), llama, encoders)
    try:
        train_step(model, MimoOptimizer(model, OPT), _two_images(swapped=dist.get_rank() == 2))
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return f"{type(e).__name__}: {e}"
    return None


def test_ranks_fed_items_in_another_order_fail_every_rank_before_the_exchange():
    """Ranks whose batches differ only in how a sample's tokens split among its items (the same token
    ids and tokens per sample) derive other balanced encoder shares, so other exchange sizes: the
    first step's batch comparison must tell them apart. It compared the tokens per sample alone:
    gloo aborted the language rank ("Received data size doesn't match") and the encoder ranks died."""
    from tests.harness import run_on_ranks

    # Independent of the library's cuts: by item cost the 16-patch image and the 4-patch one go to
    # vision dp ranks 0 and 1, so the rows of dp rank 0 are 16 in one order and 4 in the other.
    errors = run_on_ranks(_items_swapped_on_one_rank, 3, timeout=90)
    for rank, error in enumerate(errors):
        assert error is not None and "the ranks were fed different batches" in error, f"rank {rank}: {error}"


def _rows_as_a_dtensor(layouts) -> list[float]:
    """A user's encoder (`PatchMLP`, vision tp2 on ranks 0-1, the language model on rank 2) whose tp
    plan keeps its output a DTensor, replicated or sharded by width (`layouts`): three training
    steps' losses."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from dtensor_mimo import MimoOptimizer, train_step
    from tests.test_mimo import LLAMA, OPT, PatchMLP, _batches, _modules

    class DTensorRows(PatchMLP):
        def parallelize(self, tp_mesh, options) -> None:
            replicate = layouts == "replicate"
            parallelize_module(self, tp_mesh, {
                "patch_in": ColwiseParallel() if replicate else ColwiseParallel(output_layouts=Replicate()),
                "patch_out": (RowwiseParallel if replicate else ColwiseParallel)(use_local_output=False)})

    llama, encoders = _modules(("vision",), custom_vision=True)
    vision = DTensorRows(LLAMA.dim)
    vision.load_state_dict(encoders["vision"].state_dict())
    model = MimoModel(MimoLayout({"vision": P(tp=2), "language": P()}), llama, {"vision": vision})
    optimizer = MimoOptimizer(model, OPT)
    return [train_step(model, optimizer, batch).loss for batch in _batches(("vision",), False)]


@pytest.mark.parametrize("layouts", ["replicate", "width"])
def test_encoder_rows_as_a_dtensor_train_like_the_single_process_model(layouts):
    """An encoder whose tp plan keeps its rows a DTensor (Replicate, or sharded over tp by width)
    trains as the single-process model: its rows are made whole on each tp rank before
    they cross. They were sent as DTensors: the send failed on one tp rank ("c10d.send.default
    does not have a sharding strategy registered", naming nothing of the encoder) while the other
    and the language rank waited for each other (a hang)."""
    from tests.harness import run_on_ranks
    from tests.test_mimo import _reference

    want = [r["loss"] for r in _reference(("vision",), False, (), custom_vision=True)]
    for losses in run_on_ranks(_rows_as_a_dtensor, 3, layouts, timeout=90):
        assert losses == pytest.approx(want, rel=2e-5), (losses, want)


def _rows_change_after_the_first_step(call: str, wrong: str) -> str:
    """A user's encoder whose rows change shape after a first step with the same items went
    through: on rank 0 only (`wrong` "count": one row fewer, "width": one feature fewer), or on
    both vision ranks ("two ranks": rank 0 one row fewer, rank 1 two fewer). The error each rank
    raises from `call` ("forward_backward", or ``model(batch).backward()``)."""
    import torch.distributed as dist

    from tests.test_mimo import LLAMA, PatchMLP, _batches, _modules

    class Changing(PatchMLP):
        fewer = 0  # rows (or, for "width", features) left out once the first step went through

        def forward(self, images):
            rows = super().forward(images)
            if not self.fewer:
                return rows
            return (rows[:, :-1] if wrong == "width" else rows[:rows.shape[0] - self.fewer]).clone()

    model = MimoModel(MimoLayout({"vision": P(dp=2), "language": P()}), _modules(("vision",))[0],
                      {"vision": Changing(LLAMA.dim)})
    batch = _batches(("vision",), False, 4, (64,))[0]

    def step():
        if call == "forward_backward":
            model.forward_backward(batch)
        else:
            model(batch).backward()
        model.reduce_gradients()
        model.zero_grad()

    step()  # the item size is seen: a later call adds no world check of its own
    if dist.get_rank() == 0 or (wrong == "two ranks" and dist.get_rank() == 1):
        model.encoders["vision"].fewer = dist.get_rank() + 1
    return _plan_error_of(step)


@pytest.mark.parametrize("call, wrong", [("forward_backward", "count"), ("forward_backward", "width"),
                                         ("forward", "count")])
def test_encoder_rows_that_change_shape_after_the_first_step_fail_every_rank_alike(call, wrong):
    """`forward_backward` and ``model(batch)`` (not `train_step`, which agrees in its own
    all-reduce): rows of a wrong shape made on one rank after the item size was first seen raised
    on that rank only; its vision dp peer and the language rank went on (the language rank's loss
    computed on zero rows) and waited for it at their next collective. Every rank now raises the
    same `PlanError`, naming the encoder, the shape made and the shape planned."""
    from tests.harness import run_on_ranks

    messages = run_on_ranks(_rows_change_after_the_first_step, 3, call, wrong, timeout=60)
    assert all(messages) and len(set(messages)) == 1, messages
    made = r"\(\d+, 32\)" if wrong == "count" else r"\(\d+, 31\)"
    assert re.search(rf"encoder 'vision' produced rows of shape {made} for microbatch 0, but the batch metadata "
                     r"plans \(\d+, 32\)", messages[0]), messages[0]


@pytest.mark.parametrize("call", ["forward_backward", "forward"])
def test_encoder_rows_wrong_on_two_ranks_raise_the_lowest_ranks_error_everywhere(call):
    """Two vision ranks make rows of a wrong shape, each its own: every rank raises rank 0's error
    (its rows one fewer than planned, not rank 1's two fewer) and names ranks 0 to 1 as failed
    (`agree_on_rows`: each word of the all-reduce from the same, lowest failing rank)."""
    from tests.harness import run_on_ranks

    messages = run_on_ranks(_rows_change_after_the_first_step, 3, call, "two ranks", timeout=60)
    assert all(messages) and len(set(messages)) == 1, messages
    found = re.search(r"encoder 'vision' produced rows of shape \((\d+), 32\) for microbatch 0, but the batch "
                      r"metadata plans \((\d+), 32\)", messages[0])
    assert found and int(found[1]) == int(found[2]) - 1, messages[0]  # rank 0's rows: one fewer
    assert "the step failed on ranks 0 to 1 (the lowest and the highest; rank 0's error)" in messages[0], messages[0]


class _OwnForward(ModalityEncoder):
    """A user's encoder: the library's parts under a forward of its own (it might mix items), so
    the library does not pad its calls."""

    def forward(self, inputs):
        return super().forward(inputs)


def _own_encoder_compiled_under_sp(vision) -> list:
    """One `train_step` of a user's encoder compiled under tp with sp on a batch whose first
    microbatch holds no image: the loss and every encoder gradient, or the error."""
    from torch.distributed.tensor import DTensor

    from dtensor_mimo import AdamWConfig, MimoOptimizer, PipelineConfig, train_step
    from tests.test_mimo import _batches, _modules

    llama, built = _modules(("vision",))
    encoder = _OwnForward(built["vision"].encoder, built["vision"].projection)
    model = MimoModel(MimoLayout({"vision": vision, "language": P()}), llama, {"vision": encoder},
                      options={"vision": ParallelOptions(sp=True, compile=True, compile_backend="aot_eager")},
                      pipeline=PipelineConfig(microbatches=2))
    batch = _batches(("vision",), False, 2, (32,))[0]
    assert not batch.modalities["vision"].select_samples(range(1)).num_items  # microbatch 0: no image
    try:
        loss = train_step(model, MimoOptimizer(model, AdamWConfig(lr=0.0)), batch).loss
    except Exception as e:  # noqa: BLE001 - the message is the result
        return [f"{type(e).__name__}: {e}"]
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for n, p in model.module_parameters("vision").items()}
    return [loss, grads]


@pytest.mark.parametrize("vision", [P(tp=2)], ids=["tp2"])
def test_own_encoder_compiled_under_sp_trains_a_microbatch_without_items(vision):
    """A user's encoder (not the library's ViT, which the library pads with one zero item) compiled
    under tp with sp, on a microbatch where its dp rank has no item: dynamo failed to trace its
    empty sequence shard ("unhashable type: non-nested SymInt") on the encoder's ranks alone, the
    language rank left waiting. It trains, with the single-process run's loss and gradients."""
    from tests.harness import run_on_ranks
    from tests.test_mimo import _reference

    want = _reference(("vision",), False, (), 2, seq_lens=(32,))[0]
    for out in run_on_ranks(_own_encoder_compiled_under_sp, vision.size + 1, vision, timeout=90):
        assert len(out) == 2, out[0]
        loss, grads = out
        assert loss == pytest.approx(want["loss"], rel=1e-5)
        for n, g in grads.items():
            torch.testing.assert_close(g, want["grads"][f"vision.{n}"], rtol=1e-4, atol=1e-6)


def _init_weights_seeds(vision_seed):
    """vision on rank 0, language on rank 1, built on the meta device: init_weights with
    `vision_seed` for the encoder. Returns the error (None) and, when it initialized, the
    encoder's weights on its rank and the language model's on its own."""
    import torch.distributed as dist

    from tests.test_mimo import _modules

    model = MimoModel(MimoLayout({"vision": P(), "language": P()}), *_modules(("vision",), meta=True))
    try:
        model.init_weights({"language": 0, "vision": vision_seed})
        error = None
    except TypeError as e:
        error = str(e)
    dist.barrier()  # every rank raised (or none did) before any collective: none is left waiting
    weights = None if error else {n: p.detach().clone() for n, p in model.named_parameters()}
    return error, weights


@pytest.mark.parametrize("seed", ["10", 10.0, None], ids=["str", "float", "none"])
def test_init_weights_refuses_a_seed_that_is_no_integer_on_every_rank(seed):
    """A seed that is no integer (a config file's string, a float) raised inside the module's own
    init (TypeError "can only concatenate str", RuntimeError "manual_seed expected a long") on
    that module's ranks only: the other modules' ranks went on to their first collective and
    waited for them. Refused on every rank before any weight is drawn, naming the module and the seed."""
    from tests.harness import run_on_ranks

    outs = run_on_ranks(_init_weights_seeds, 2, seed, timeout=60)
    errors = [e for e, _ in outs]
    assert all(e is not None and e == errors[0] for e in errors), errors
    assert f"seeds['vision']={seed!r}" in errors[0] and "an integer" in errors[0], errors[0]


def test_init_weights_takes_a_numpy_integer_seed():
    """A NumPy integer seed (what a NumPy generator or array gives) failed with an OverflowError
    naming nothing ("Python int too large to convert to C long"), on the encoder's rank alone; it
    gives the weights the same int seed gives (the single-process module's own init)."""
    import numpy as np

    from tests.harness import run_on_ranks
    from tests.test_mimo import _modules

    outs = run_on_ranks(_init_weights_seeds, 2, np.int64(10), timeout=60)
    assert [e for e, _ in outs] == [None, None], outs
    _, reference = _modules(("vision",), meta=True)
    reference = reference["vision"].to_empty(device="cpu")
    reference.init_weights(10)
    vision = {n.removeprefix("encoders.vision."): p for n, p in outs[0][1].items()}
    assert vision.keys() == dict(reference.named_parameters()).keys()
    for name, p in reference.named_parameters():
        assert torch.equal(vision[name], p.detach()), name


def _encoder_returning(kind: str, call: str) -> str:
    """A user's encoder (`PatchMLP`, vision dp2 with FSDP2 on ranks 0-1, the language model on rank 2)
    whose forward returns its rows inside a tuple or a dict, as many towers do: the error each rank
    raises from `call` (a training step, or `forward_backward`)."""
    from dtensor_mimo import MimoOptimizer, train_step
    from tests.test_mimo import LLAMA, OPT, PatchMLP, _batches, _modules

    class Wrapped(PatchMLP):
        def forward(self, images):
            rows = super().forward(images)
            return (rows, rows.mean()) if kind == "tuple" else {"last_hidden_state": rows}

    model = MimoModel(MimoLayout({"vision": P(dp=2), "language": P()}), _modules(("vision",))[0],
                      {"vision": Wrapped(LLAMA.dim)})
    batch = _batches(("vision",), False, 4, (64,))[0]
    return _plan_error_of(lambda: train_step(model, MimoOptimizer(model, OPT), batch) if call == "train_step"
                          else model.forward_backward(batch))


def _plan_error_of(run) -> str:
    """The PlanError `run` raised on this rank ("" for none), once every rank is past it (a barrier:
    nobody is left inside an exchange)."""
    import torch.distributed as dist

    from dtensor_mimo.bridge import PlanError

    try:
        run()
    except PlanError as e:
        message = str(e)
    else:
        message = ""
    dist.barrier()
    return message


@pytest.mark.parametrize("kind, call", [("tuple", "train_step"), ("dict", "forward_backward")])
def test_encoder_returning_no_tensor_fails_every_rank_by_name(kind, call):
    """An encoder whose forward returns a tuple or a dict (not the protocol's one tensor of rows)
    raised AttributeError ("'tuple' object has no attribute 'to'") on its own ranks alone, naming
    nothing of the protocol, while the language rank waited for its rows in the exchange for good.
    Every rank now raises a `PlanError`, the encoder's ranks (`forward_backward`: every rank) naming
    the encoder and what it returned."""
    from tests.harness import run_on_ranks

    messages = run_on_ranks(_encoder_returning, 3, kind, call, timeout=90)
    assert all(messages), messages  # every rank raised (a training step: the others say how many failed)
    named = rf"encoder 'vision' returned a {kind}, not a tensor: an encoder's forward returns its rows as one tensor"
    assert all(re.search(named, m) for m in (messages if call == "forward_backward" else messages[:2])), messages


@contextlib.contextmanager
def _release_read_as(release: tuple[int, int]):
    """torch's release read as `release` by the library (`torch_compat.RELEASE`) in this rank's
    process, put back after: the harness reuses its rank processes for later tests."""
    from dtensor_mimo.layout import torch_compat

    before, torch_compat.RELEASE = torch_compat.RELEASE, release
    try:
        yield
    finally:
        torch_compat.RELEASE = before


def _sp_encoder(name: str, tower: torch.nn.Module) -> tuple[MimoModel, Any]:
    """`tower` (32 wide) and a projection as encoder `name` at tp2 with sp on ranks 0-1, a tiny
    Llama on rank 2; the model and its optimizer."""
    from dtensor_mimo import MimoOptimizer

    llama = Llama(LlamaConfig.tiny())
    llama.init_weights(0)
    encoder = ModalityEncoder(tower, Projection(32, llama.config.dim, hidden_dim=64))
    encoder.init_weights(1)
    model = MimoModel(MimoLayout({name: P(tp=2), "language": P()}), llama, {name: encoder},
                      options={name: ParallelOptions(sp=True)})
    return model, MimoOptimizer(model)


def _encoder_sp_odd_tokens(release: tuple[int, int]) -> str | None:
    """audio tp2 with sp on ranks 0-1 (Whisper-style clips of 30 frames: 15 tokens each, or 32: 16), the
    language model on rank 2, torch's release read as `release`: what a step on the 15-token clips raises
    on this rank (then a step on 16-token clips trains)."""
    from dtensor_mimo import train_step
    from dtensor_mimo.data import ModalitySpec
    from dtensor_mimo.models import AudioConfig, AudioEncoder

    config = AudioConfig.tiny(variable_length=True)

    def batch(frames: int):
        spec = ModalitySpec.audio(config, special_token_id=65, max_items=1, lengths=[frames])
        return synthetic_batch(SyntheticSpec.tiny(modalities={"audio": spec}, batch_size=4), seed=0)

    with _release_read_as(release):
        model, optimizer = _sp_encoder("audio", AudioEncoder(config))
        odd, even = batch(30), batch(32)
        assert {t for t in odd.modalities["audio"].item_tokens} == {15}
        return _refused_then_trains(lambda b: train_step(model, optimizer, b), odd,
                                    lambda: train_step(model, optimizer, even))


def test_encoder_sequence_parallel_on_tokens_tp_does_not_divide_on_torch_before_2_13():
    """An encoder at tp2 with sp on items of 15 tokens: torch 2.11's DTensor backward failed inside the
    encoder's blocks ("view size is not compatible with input tensor's size and stride", naming nothing)
    on the encoder's ranks alone, while the language rank waited for them: a hang on the GPU machines'
    torch. There the batch is refused by name on every rank before any exchange (the language model's
    own rows already were); torch 2.13 trains it."""
    from dtensor_mimo.layout import torch_compat
    from tests.harness import run_on_ranks

    errors = run_on_ranks(_encoder_sp_odd_tokens, 3, (2, 11), timeout=180)
    assert all(e is not None and e == errors[0] for e in errors), errors
    assert re.search(r"encoder 'audio' has tp=2 with sequence parallel \(sp\): on torch .* the batch's 'audio' items "
                     r"have 15 tokens; set sp=False for 'audio', give its items a multiple of 2 tokens, or use "
                     r"torch 2.13", errors[0]), errors[0]
    if torch_compat.RELEASE >= (2, 13):
        assert run_on_ranks(_encoder_sp_odd_tokens, 3, (2, 13), timeout=180) == [None] * 3


def _class_token_sp(image_size: int) -> str | None:
    """A CLIP-style ViT (a class token first in every item's rows through the blocks) at tp2 with
    sp on ranks 0-1, the language model on rank 2, torch's release read as 2.11: what a step on
    images of `image_size` pixels (4-pixel patches) raises on this rank (None: it trained)."""
    with _release_read_as((2, 11)):
        return _class_token_step(image_size)


def _class_token_step(image_size: int) -> str | None:
    from dtensor_mimo import train_step
    from dtensor_mimo.data import ModalitySpec

    config = ViTConfig.tiny(image_size=image_size, class_token=True)
    model, optimizer = _sp_encoder("vision", ViT(config))
    spec = ModalitySpec.image(config, special_token_id=65, max_items=1)
    batch = synthetic_batch(SyntheticSpec.tiny(modalities={"vision": spec}, batch_size=4), seed=0)
    assert set(batch.modalities["vision"].item_tokens) == {(image_size // 4) ** 2}
    try:
        train_step(model, optimizer, batch)
    except ValueError as e:
        return str(e)
    return None


def test_encoder_sequence_parallel_counts_a_class_token_on_torch_before_2_13():
    """A CLIP-style tower runs each item's tokens and its class token through the blocks, so sp
    at tp2 shards tokens + 1 rows. On torch 2.11 (run there: `make test-torch2.11`) a step on
    16-token images (17 rows) failed in DTensor's backward on the vision ranks while the language
    rank waited (a hang), yet passed the check, and 9-token images (10 rows, which 2.11 trains)
    were refused. With the release read as 2.11: the 17 rows are refused by name on every rank,
    the 10 train."""
    from tests.harness import run_on_ranks

    errors = run_on_ranks(_class_token_sp, 3, 16, timeout=180)
    assert all(e is not None and e == errors[0] for e in errors), errors
    assert re.search(r"encoder 'vision' has tp=2 with sequence parallel \(sp\): .* the batch's 'vision' items have "
                     r"17 tokens with the class token its tower adds; set sp=False for 'vision', give its items a "
                     r"multiple of 2 tokens \(the class token included\)", errors[0]), errors[0]
    assert run_on_ranks(_class_token_sp, 3, 12, timeout=180) == [None] * 3
