"""`ParallelOptions.compile_mode` and `compile_scope`: torch.compile's mode for a module's compiled
pieces (CUDA graphs), and whether those pieces are its blocks or its stacks whole.

CUDA graphs themselves need a GPU (`benchmarks/gpu.py` times them and checks their losses against
the same model without them); on CPU inductor takes the mode and skips the graphs, so these
check what holds everywhere: the options' validation, that the mode reaches every compiled
piece and the scope picks them, the refusals where FSDP2 shards the module (before any process
group), one cudagraph-tree generation per executor run, and the numbers of a world-1 colocated
model compiled by inductor in that mode, per block and whole, against the same model in eager
(two training steps of two microbatches, then a prediction).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from dtensor_mimo import (AdamWConfig, LayoutError, MimoLayout, MimoModel, MimoOptimizer, ParallelOptions, Parallelism,
                          PipelineConfig, train_step)
from dtensor_mimo.models import Llama, LlamaConfig, ModalityEncoder, Projection, ViT, ViTConfig
from dtensor_mimo.parallelize import parallelize
from dtensor_mimo.schedule.checks import check_model
from tests.harness import run_on_ranks
from tests.test_mimo import _batches, _modules

GRAPHS = ParallelOptions(compile=True, compile_mode="reduce-overhead")
WHOLE = dataclasses.replace(GRAPHS, compile_scope="module")


def test_compile_mode_is_validated() -> None:
    assert GRAPHS.cuda_graphs and GRAPHS.compile_kwargs == {"backend": "inductor", "mode": "reduce-overhead"}
    assert not ParallelOptions(compile_mode="reduce-overhead").cuda_graphs  # compile off: nothing replays
    assert not ParallelOptions(compile=True, compile_mode="max-autotune-no-cudagraphs").cuda_graphs
    assert ParallelOptions(compile=True).compile_kwargs == {"backend": "inductor"}
    with pytest.raises(ValueError, match=r"compile_mode='fast' must be one of 'default', 'reduce-overhead'"):
        ParallelOptions(compile_mode="fast")
    with pytest.raises(ValueError, match=r"inductor mode but compile_backend='aot_eager'"):
        ParallelOptions(compile=True, compile_backend="aot_eager", compile_mode="reduce-overhead")
    with pytest.raises(ValueError, match=r"\(CUDA graphs\) with activation_checkpointing=1: a recomputation"):
        ParallelOptions(compile=True, compile_mode="max-autotune", activation_checkpointing=1)
    with pytest.raises(ValueError, match=r"\(CUDA graphs\) with recompute_colocated=True: a recomputation"):
        ParallelOptions(compile=True, compile_mode="reduce-overhead", recompute_colocated=True)
    with pytest.raises(ValueError, match=r"compile_scope='layer' must be one of 'block', 'module'"):
        ParallelOptions(compile_scope="layer")
    with pytest.raises(ValueError, match=r"compile_scope='module' with activation_checkpointing=2: a checkpoint"):
        ParallelOptions(compile=True, compile_scope="module", activation_checkpointing=2)


@pytest.mark.parametrize("scope", ["block", "module"])
def test_mode_reaches_every_compiled_piece(monkeypatch: pytest.MonkeyPatch, scope: str) -> None:
    """Each block (or each stack whole) and a stack without blocks (the projection) compile with
    the module's mode."""
    calls: list[tuple[str, dict]] = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: calls.append((type(self).__name__, kw)))
    vit = ViTConfig.tiny()
    encoder = ModalityEncoder(ViT(vit), Projection(vit.dim, 32))
    options = dataclasses.replace(GRAPHS, compile_scope=scope)
    parallelize(encoder, None, None, options)
    parallelize(Llama(LlamaConfig.tiny(n_layers=2)), None, None, options)
    want = {"backend": "inductor", "mode": "reduce-overhead"}
    assert [name for name, _ in calls] == (["EncoderBlock"] * vit.n_layers + ["Projection"] + ["TransformerBlock"] * 2
                                           if scope == "block" else ["ViT", "Projection", "Llama"])
    assert all(kw == want for _, kw in calls)


def test_cuda_graphs_refused_where_fsdp_shards() -> None:
    """Every rank refuses from the layout alone: the module's dp·cp mesh, FSDP2 on."""
    llama, encoders = Llama(LlamaConfig.tiny()), {"vision": ModalityEncoder(ViT(ViTConfig.tiny()), Projection(16, 32))}
    layout = MimoLayout({"vision": Parallelism(dp=2), "language": Parallelism()})
    with pytest.raises(ValueError, match=r"vision: .*'reduce-overhead'.* FSDP2 shards the module over its 2 dp·cp "
                                         r"ranks .* set fsdp=False"):
        check_model(layout, llama, encoders, "language", {"vision": GRAPHS}, None)
    check_model(layout, llama, encoders, "language", {"vision": dataclasses.replace(GRAPHS, fsdp=False)}, None)
    whole = ParallelOptions(compile=True, compile_scope="module")
    with pytest.raises(ValueError, match=r"vision: .*compile_scope='module'.* FSDP2 shards it over its 2 dp·cp ranks"):
        check_model(layout, llama, encoders, "language", {"vision": whole}, None)
    check_model(layout, llama, encoders, "language", {"vision": dataclasses.replace(whole, fsdp=False)}, None)
    assert issubclass(LayoutError, ValueError)


def _compiled_against_eager() -> dict:
    """World 1, vision and language colocated, 2 microbatches: the model with both modules
    compiled by inductor in "reduce-overhead" mode (per block, and whole) against the same model
    in eager."""
    marks = []
    original = torch.compiler.cudagraph_mark_step_begin
    torch.compiler.cudagraph_mark_step_begin = lambda: (marks.append(1), original())[1]
    try:
        out = {}
        for name, options in (("eager", ParallelOptions()), ("graphs", GRAPHS), ("whole", WHOLE)):
            marks.clear()
            llama, encoders = _modules(("vision",), n_layers=1)
            layout = MimoLayout({"vision": Parallelism(), "language": Parallelism()},
                                offsets={"vision": 0, "language": 0})
            model = MimoModel(layout, llama, encoders, options={"vision": options, "language": options},
                              pipeline=PipelineConfig(microbatches=2))
            optimizer = MimoOptimizer(model, AdamWConfig(lr=1e-2, eps=1e-3))
            batches = _batches(("vision",), packed=False, batch_size=4, seq_lens=(32, 32))
            losses = [train_step(model, optimizer, b).loss for b in batches]
            ids = model.predict(batches[0])
            out[name] = {"losses": losses, "ids": ids, "marks": len(marks),
                         "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}
        return out
    finally:
        torch.compiler.cudagraph_mark_step_begin = original


@pytest.mark.timeout(300)
def test_inductor_mode_matches_eager() -> None:
    [out] = run_on_ranks(_compiled_against_eager, 1)
    eager = out.pop("eager")
    assert eager["marks"] == 0
    for how, got in out.items():
        assert got["marks"] == 3, how  # one generation per run: 2 steps, 1 prediction
        assert got["losses"] == pytest.approx(eager["losses"], rel=1e-5), how
        assert torch.equal(got["ids"], eager["ids"]), how
        for name, want in eager["weights"].items():
            assert torch.allclose(got["weights"][name], want, rtol=1e-4, atol=1e-5), (how, name)


def test_whole_vit_compiles_empty_batches() -> None:
    """A ViT compiled whole by inductor takes microbatches of no image between others (a rank's
    empty share), with eager's outputs and gradients (zeros for no image): its patch embedding
    then runs as a Linear over no patches, since torch's compiled convolution backward mis-strides
    an empty batch's weight gradient."""
    import copy

    torch.manual_seed(0)
    eager = ViT(ViTConfig.tiny())
    compiled = copy.deepcopy(eager)
    compiled.compile()
    for n in (2, 0, 3):
        images = torch.randn(n, 3, 16, 16)
        outs = [model(images) for model in (eager, compiled)]
        assert outs[0].shape == (n, 16, 32) and torch.allclose(outs[1], outs[0], rtol=1e-4, atol=1e-5)
        for model, out in zip((eager, compiled), outs):
            model.zero_grad(set_to_none=True)
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
            assert torch.allclose(b.grad, a.grad, rtol=1e-4, atol=1e-6), (n, name)
            assert n or not a.grad.any(), name
