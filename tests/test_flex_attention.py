"""`FlexAttentionCore` (`ParallelOptions(flex_attention=True)`) against `causal_attention`: the same
outputs and gradients for packed documents, subsets of rows with their global indices, grouped
heads and lengths that are not multiples of the 128-row blocks; one block mask per set of index
tensors; and through `MimoModel` (dp 2 with packed rows, cp 2 with plain and packed rows, vision
dp 2 with images of their own size) the single-process oracle of tests/test_mimo.py. torch's
FlexAttention refuses backward on the CPU (its compiled CPU kernel has none); its eager path, the
reference math the compiled kernels are tested against in torch, does have one, so these tests
lift that device check (`_cpu_backward`). On CUDA the library runs
the compiled kernel (`benchmarks/gpu.py` compares it with this path's numbers there)."""

from __future__ import annotations

import pytest
import torch

from dtensor_mimo import MimoModel, ParallelOptions, Parallelism
from dtensor_mimo.layout import LayoutError
from dtensor_mimo.models import FlexAttentionCore, causal_attention
from dtensor_mimo.models.layers import PackedItems, packed_attention
from tests.harness import run_on_ranks
from tests.test_mimo import Case, _distributed, _modules, check_against_reference


def _cpu_backward(monkeypatch=None) -> None:
    """Let torch's eager FlexAttention run backward on the CPU (see the module docstring)."""
    import torch.nn.attention.flex_attention as flex

    if not hasattr(flex, "_torch_validate_device"):  # torch's own check, for `_torch_flex_check`
        flex._torch_validate_device = flex._validate_device
    if monkeypatch is not None:
        monkeypatch.setattr(flex, "_validate_device", lambda *args, **kwargs: None)
    else:
        flex._validate_device = lambda *args, **kwargs: None


def _torch_flex_check() -> None:
    """Put torch's device check of FlexAttention back in this (reused) rank process."""
    import torch.nn.attention.flex_attention as flex

    flex._validate_device = getattr(flex, "_torch_validate_device", flex._validate_device)


def _qkv(batch: int, rows: int, keys: int, heads: int = 4, kv_heads: int = 2, dim: int = 8):
    g = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    return make(batch, heads, rows, dim), make(batch, kv_heads, keys, dim), make(batch, kv_heads, keys, dim)


def _compare(q, k, v, **index) -> None:
    got = FlexAttentionCore()(q, k, v, **index)
    want = causal_attention(q, k, v, **index)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    upstream = torch.randn_like(want)
    got_grads = torch.autograd.grad(got, (q, k, v), upstream)
    want_grads = torch.autograd.grad(want, (q, k, v), upstream)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _documents(batch: int, rows: int, lengths: list[int]) -> torch.Tensor:
    ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
    assert len(ids) == rows
    return torch.stack([ids, ids.flip(0)])[:batch]  # another order of documents in row 1


def test_packed_documents_and_plain_rows_give_causal_attentions_numbers(monkeypatch) -> None:
    _cpu_backward(monkeypatch)
    q, k, v = _qkv(2, 200, 200)  # 200 rows: a partial second block
    doc = _documents(2, 200, [70, 3, 127])
    _compare(q, k, v, q_pos=None, kv_pos=None, q_doc=doc, kv_doc=doc)
    _compare(q, k, v, q_pos=None, kv_pos=None)  # plain rows: SDPA's causal kernel


def test_a_subset_of_rows_with_global_indices(monkeypatch) -> None:
    """A context-parallel-like chunk: 96 query rows (two zigzag pieces) against all 192 keys."""
    _cpu_backward(monkeypatch)
    q, k, v = _qkv(2, 96, 192)
    q_pos = torch.cat([torch.arange(0, 48), torch.arange(144, 192)]).expand(2, -1)
    kv_pos = torch.arange(192).expand(2, -1)
    doc = _documents(2, 192, [100, 92])
    _compare(q, k, v, q_pos=q_pos, kv_pos=kv_pos, q_doc=doc[:, q_pos[0]], kv_doc=doc)
    _compare(q, k, v, q_pos=q_pos, kv_pos=kv_pos)


def test_one_block_mask_per_set_of_index_tensors(monkeypatch) -> None:
    import torch.nn.attention.flex_attention as flex

    _cpu_backward(monkeypatch)
    built = []
    create = flex.create_block_mask
    monkeypatch.setattr(flex, "create_block_mask", lambda *a, **kw: built.append(a[3:5]) or create(*a, **kw))
    core = FlexAttentionCore()
    q, k, v = _qkv(2, 64, 64)
    doc = _documents(2, 64, [30, 34])
    for _ in range(3):  # the layers of one forward: the same tensors
        core(q, k, v, q_pos=None, kv_pos=None, q_doc=doc, kv_doc=doc)
    assert len(built) == 1
    other = doc.clone()  # a new batch: its own mask, even with equal values
    core(q, k, v, q_pos=None, kv_pos=None, q_doc=other, kv_doc=other)
    core(q, k, v, q_pos=None, kv_pos=None, q_doc=doc, kv_doc=doc)  # still kept
    assert len(built) == 2
    with pytest.raises(ValueError, match="pass both q_doc and kv_doc"):
        core(q, k, v, q_pos=None, kv_pos=None, q_doc=doc)


def test_packed_items_give_packed_attentions_numbers(monkeypatch) -> None:
    """Encoders' items of their own size (bidirectional, each within itself): one kernel over the
    block-diagonal mask, including empty items and items longer than a block; the mask is built
    once per `PackedItems` object."""
    import torch.nn.attention.flex_attention as flex

    _cpu_backward(monkeypatch)
    built = []
    create = flex.create_block_mask
    monkeypatch.setattr(flex, "create_block_mask", lambda *a, **kw: built.append(a[3]) or create(*a, **kw))
    core = FlexAttentionCore()
    items = PackedItems([16, 0, 150, 4, 30])
    q, k, v = _qkv(1, 200, 200)
    upstream = torch.randn(1, 4, 200, 8, dtype=torch.float64)
    got = [core.packed(q, k, v, items) for _ in range(2)][0]
    want = packed_attention(q, k, v, items)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), upstream), torch.autograd.grad(want, (q, k, v), upstream)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert built == [200]
    one = _qkv(1, 40, 40)
    torch.testing.assert_close(core.packed(*one, PackedItems([40])), packed_attention(*one, [40]))  # one item: SDPA
    with pytest.raises(ValueError, match="do not sum to the 200 rows"):
        core.packed(q, k, v, [16, 150])


def _flex_distributed(case: Case) -> list[dict]:
    """`_distributed` through torch's eager FlexAttention; asserts that the flex modules' ranks
    attended through it, and that a mask served every layer of a forward (under cp too: the
    gathered indices are kept for the same local ones)."""
    import torch.nn.attention.flex_attention as flex

    _cpu_backward()
    calls, builds = [], []
    lookup, create = FlexAttentionCore._block_mask, flex.create_block_mask
    FlexAttentionCore._block_mask = lambda self, *args: calls.append(1) or lookup(self, *args)
    flex.create_block_mask = lambda *args, **kwargs: builds.append(1) or create(*args, **kwargs)
    try:
        records = _distributed(case)
    finally:
        FlexAttentionCore._block_mask, flex.create_block_mask = lookup, create
    flexed = [n for n, o in case.options.items() if o.flex_attention]
    on_flex = any(torch.distributed.get_rank() in case.layout().ranks(n) for n in flexed)
    assert bool(calls) == on_flex, len(calls)  # those modules' attention went through flex
    assert len(builds) * case.n_layers <= len(calls), (len(builds), len(calls))
    return records


FLEX = {"language": ParallelOptions(flex_attention=True)}


@pytest.mark.parametrize("case", [
    Case({"vision": Parallelism(), "language": Parallelism(dp=2)}, packed=True, options=FLEX),
    Case({"vision": Parallelism(), "language": Parallelism(cp=2)}, options=FLEX),
    Case({"vision": Parallelism(), "language": Parallelism(cp=2)}, packed=True, options=FLEX),
    Case({"vision": Parallelism(dp=2), "language": Parallelism()}, varied=True,
         options={"vision": ParallelOptions(flex_attention=True)}),
], ids=["dp2_packed", "cp2", "cp2_packed", "vision_dp2_items_of_their_own_size"])
def test_flex_attention_matches_the_single_process_run(case) -> None:
    """Flex attention against one process without it (losses, every gradient, the weights after
    each step): the language model at dp 2 (FSDP2) over packed documents and at cp 2 (each rank's
    zigzag rows against the gathered keys, by global index) over plain and packed rows; the
    vision tower at dp 2 over images of their own size packed into one sequence."""
    check_against_reference(case, run=_flex_distributed)


def _train_on_cpu_with_flex() -> list[str]:
    """A training run, a forward with grad and a prediction of a model whose language model (cp 2,
    on ranks of its own) attends through FlexAttention on the CPU, torch's check in place."""
    from torch.distributed.tensor import DTensor

    from dtensor_mimo import MimoLayout
    from tests.test_context_parallel import _mimo_batch, _mimo_modules

    _torch_flex_check()
    layout = MimoLayout({"vision": Parallelism(dp=2), "audio": Parallelism(dp=2), "language": Parallelism(cp=2)},
                        offsets={"vision": 0, "audio": 0, "language": 2})
    layout.init_meshes("cpu")
    llama, encoders = _mimo_modules()
    model = MimoModel(layout, llama, encoders, options={"language": ParallelOptions(flex_attention=True)})
    batch, out = _mimo_batch(), []
    for run in (model.forward_backward, model):
        try:
            run(batch)
            out.append("ran")
        except ValueError as e:
            out.append(str(e))
    out.append(str(model.predict(batch).shape))  # no gradients: FlexAttention runs on the CPU
    assert all(p.grad is None or not (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).any()
               for p in model.parameters())
    return out


def test_training_through_flex_on_the_cpu_is_refused_on_every_rank() -> None:
    """torch's FlexAttention has no backward on the CPU: a training run through it once failed in
    the language ranks' forward alone while the encoder ranks waited for gradients (a hang); it is
    refused on every rank before any exchange, naming the module and the fix; predict still runs."""
    for out in run_on_ranks(_train_on_cpu_with_flex, 4, timeout=60):
        assert len(out) == 3 and out[2] == "torch.Size([4, 16])", out
        for message in out[:2]:
            assert "flex_attention=True) for ['language'] on device 'cpu'" in message, message
            assert "set flex_attention=False" in message and "no backward" in message, message


def test_refused_for_a_users_encoder_before_any_group() -> None:
    from dtensor_mimo import MimoLayout

    llama, encoders = _modules(("vision",), custom_vision=True)
    with pytest.raises(LayoutError, match=r"given for encoders \['vision'\], which hold no library SelfAttention"):
        MimoModel(MimoLayout({"vision": Parallelism(), "language": Parallelism()}), llama, encoders,
                  options={"vision": ParallelOptions(flex_attention=True)})
    assert not torch.distributed.is_initialized()


def test_the_default_is_flex_for_the_library_decoder_on_hopper_at_cp_1_only(monkeypatch) -> None:
    """``flex_attention=None`` resolves to on where it was measured faster (the library's decoder
    on CUDA of compute capability 9.0+ at cp = 1, benchmarks/RESULTS.md), off on the CPU, on
    older cards, under cp and for a user's decoder; an explicit value wins; anything else is
    refused by name."""
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    default = ParallelOptions()
    assert default.flex_attention is None
    assert default.language_flex(cuda, 1)
    assert not default.language_flex(cuda, 2) and not default.language_flex(cpu, 1)
    assert not default.language_flex(cuda, 1, library_decoder=False)
    capability[0] = (8, 6)
    assert not default.language_flex(cuda, 1)
    assert ParallelOptions(flex_attention=True).language_flex(cpu, 2, library_decoder=False)
    assert not ParallelOptions(flex_attention=False).language_flex(cuda, 1)
    with pytest.raises(TypeError, match=r"flex_attention='yes' must be True, False or None"):
        ParallelOptions(flex_attention="yes")


def _attention_cores(custom: bool) -> str:
    """The attention core the language model was given when the default resolves to on."""
    from dtensor_mimo import MimoLayout

    resolve = ParallelOptions.language_flex  # the rank process serves later tests: restored
    ParallelOptions.language_flex = lambda self, device, cp, library_decoder=True: library_decoder
    try:
        layout = MimoLayout({"vision": Parallelism(), "language": Parallelism()}, offsets={"vision": 0, "language": 0})
        layout.init_meshes("cpu")
        llama, encoders = _modules(("vision",), custom_language=custom)
        given = []
        llama.set_attention_fn = lambda fn: given.append(type(fn).__name__)
        MimoModel(layout, llama, encoders)
    finally:
        ParallelOptions.language_flex = resolve
    return given


@pytest.mark.parametrize("custom", [False, True], ids=["library_decoder", "user_decoder"])
def test_the_default_gives_flex_to_the_library_decoder_only(custom: bool) -> None:
    assert run_on_ranks(_attention_cores, 1, custom, timeout=120) == [[] if custom else ["FlexAttentionCore"]]
