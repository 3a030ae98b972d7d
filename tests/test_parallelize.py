"""Per-module parallel application (tp/sp plans, FSDP2 summed over dp, compile) against one process.

Every case builds the same model from the same seed twice in each rank process: a single-process
reference run on the whole batch, and the parallelized copy run on this rank's dp share. Both take
two AdamW steps; the loss, every parameter's gradient (DTensors gathered with `full_tensor()`), the
gradient of the model input and the weights after the last step must match (fp32).

The loss is normalised by the GLOBAL number of loss elements (sum over the whole batch / count),
never averaged per rank, so data-parallel gradients must be summed over dp: FSDP2's default mean
would be off by the factor dp.

| case                  | module              | ranks | pp dp cp tp | sp | dp sync                | input                               |
|-----------------------|---------------------|-------|-------------|----|------------------------|-------------------------------------|
| llama_tp2_sp          | Llama               | 2     | 1  1  1  2  | on | -                      | tokens, S=7 (uneven sequence split) |
| llama_dp2_fsdp        | Llama               | 2     | 1  2  1  1  | -  | FSDP2, factor 1        | embeddings h, plain                 |
| llama_dp2_allreduce   | Llama               | 2     | 1  2  1  1  | -  | allreduce_gradients    | embeddings h, plain                 |
| llama_dp2_tp2_sp_fsdp | Llama               | 4     | 1  2  1  2  | on | FSDP2 (2-D), factor 1  | h sequence chunk (Shard(1) DTensor) |
| llama_tp2_sp_compiled | Llama, aot_eager    | 2     | 1  1  1  2  | on | -                      | embeddings h, plain                 |
| vit_tp2               | ViT + Projection    | 2     | 1  1  1  2  | -  | -                      | images                              |
| audio_tp2_sp          | Audio + Projection  | 2     | 1  1  1  2  | on | -                      | mels, 15 tokens (uneven over tp)    |

Encoder outputs are also checked to be plain tensors equal to the reference output (replicated
over tp, the form the bridge takes).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from dtensor_mimo import MimoLayout, MimoModel, Parallelism
from dtensor_mimo.data import IGNORE_INDEX
from dtensor_mimo.models import layers
from dtensor_mimo.models import (
    AudioConfig,
    AudioEncoder,
    Llama,
    LlamaConfig,
    ModalityEncoder,
    Projection,
    ViT,
    ViTConfig,
)
from dtensor_mimo.parallelize import (
    ParallelOptions,
    allreduce_gradients,
    compile_blocks,
    parallelize_encoder,
    parallelize_llama,
    parallelize_projection,
)
from dtensor_mimo.sequence.loss import vocab_parallel_argmax, vocab_parallel_cross_entropy
from tests.harness import needs_torch, run_on_ranks

SEED = 1234
STEPS = 2
BATCH = 4
SEQ = 7
LR = 1e-2
# Adam divides each gradient by its own magnitude, so with the default eps=1e-8 a gradient element
# near zero turns its last-ulp rounding (sums reordered by sharding) into an O(LR) weight change.
# eps=1e-3 bounds that amplification (update error <= LR * grad error / eps) and keeps the check
# tight; the optimizer still runs AdamW on the sharded parameters and states.
ADAM_EPS = 1e-3
# fp32 with sums reordered by sharding: errors are a few ulps of the values compared.
TOL = dict(rtol=1e-5, atol=1e-6)


@dataclass(frozen=True)
class Case:
    module: str  # "llama", "vit" or "audio"
    par: Parallelism
    options: ParallelOptions
    input: str = "tokens"  # llama only: "tokens", "h" or "h_chunk"

    @property
    def world(self) -> int:
        return self.par.size


CASES = {
    "llama_tp2_sp": Case("llama", Parallelism(tp=2), ParallelOptions(sp=True)),
    "llama_dp2_fsdp": Case("llama", Parallelism(dp=2), ParallelOptions(), input="h"),
    "llama_dp2_allreduce": Case("llama", Parallelism(dp=2), ParallelOptions(fsdp=False), input="h"),
    "llama_dp2_tp2_sp_fsdp": Case(
        "llama", Parallelism(dp=2, tp=2), ParallelOptions(sp=True, reshard_after_forward=False),
        input="h_chunk",
    ),
    "llama_tp2_sp_compiled": Case(
        "llama", Parallelism(tp=2),
        ParallelOptions(sp=True, compile=True, compile_backend="aot_eager"), input="h",
    ),
    "vit_tp2": Case("vit", Parallelism(tp=2), ParallelOptions()),
    "audio_tp2_sp": Case("audio", Parallelism(tp=2), ParallelOptions(sp=True)),
}


# --------------------------------------------------------------------------------------------
# Models, data and loss, identical in the reference and the parallel run
# --------------------------------------------------------------------------------------------


def _build(module: str) -> dict[str, torch.nn.Module]:
    """Fresh modules from SEED; the encoder cases add a projection into a 48-wide LLM."""
    if module == "llama":
        modules = {"model": Llama(LlamaConfig.tiny())}
    elif module == "vit":
        modules = {"model": ViT(ViTConfig.tiny()), "proj": Projection(32, 48, hidden_dim=64)}
    else:
        modules = {"model": AudioEncoder(AudioConfig.tiny()), "proj": Projection(32, 48, hidden_dim=64)}
    for i, m in enumerate(modules.values()):
        m.init_weights(SEED + i)
    return modules


def _batch(module: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    if module == "llama":
        vocab, dim = LlamaConfig.tiny().vocab_size, LlamaConfig.tiny().dim
        return {
            "tokens": torch.randint(vocab, (BATCH, SEQ), generator=g),
            "h": torch.randn(BATCH, SEQ, dim, generator=g),
            "labels": torch.randint(vocab, (BATCH, SEQ), generator=g),
        }
    if module == "vit":
        c = ViTConfig.tiny()
        x = torch.randn(BATCH, c.in_channels, c.image_size, c.image_size, generator=g)
        n_tok = c.num_patches
    else:
        c = AudioConfig.tiny()
        x = torch.randn(BATCH, c.n_mels, 30, generator=g)
        n_tok = c.output_length(30)  # 15: uneven over tp=2
    return {"x": x, "target": torch.randn(BATCH, n_tok, 48, generator=g)}


def _loss(out: torch.Tensor, batch: dict[str, torch.Tensor], rows: slice, global_count: int):
    """Sum over this rank's rows, divided by the global count (a share of the global mean)."""
    if "labels" in batch and isinstance(out, DTensor):  # tp: vocab-sharded logits (loss_parallel)
        per_elem = vocab_parallel_cross_entropy(out, batch["labels"][rows].flatten())
    elif "labels" in batch:
        per_elem = F.cross_entropy(out.flatten(0, 1), batch["labels"][rows].flatten(), reduction="none")
    else:
        per_elem = (out - batch["target"][rows]).pow(2)
    return per_elem.sum() / global_count


def _global_count(batch: dict[str, torch.Tensor]) -> int:
    return batch["labels"].numel() if "labels" in batch else batch["target"].numel()


# --------------------------------------------------------------------------------------------
# One training run: reference (whole batch, one process) or parallel (this rank's share)
# --------------------------------------------------------------------------------------------


def _parallelize(module: torch.nn.Module, tp_mesh, dp_mesh, options: ParallelOptions) -> None:
    """The library's function for each kind of module in the cases."""
    if isinstance(module, Llama):
        parallelize_llama(module, tp_mesh, dp_mesh, options)
    elif isinstance(module, Projection):
        parallelize_projection(module, tp_mesh, dp_mesh, options)
    else:
        parallelize_encoder(module, tp_mesh, dp_mesh, options)


@torch.no_grad()
def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    if isinstance(t, DTensor):
        return t.full_tensor()
    return None if t is None else t.detach().clone()


def _train(case: Case, modules, batch, *, rows: slice, ctx=None) -> list[dict]:
    """Two AdamW steps; per step the loss, input grad and full parameter gradients."""
    params = [p for m in modules.values() for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.1, eps=ADAM_EPS)
    count = _global_count(batch)
    records = []
    for _ in range(STEPS):
        record = {}
        if case.module == "llama":
            model = modules["model"]
            if case.input == "tokens":
                out = model(batch["tokens"][rows])
                leaf, leaf_full_index = None, None
            else:
                h = batch["h"][rows]
                leaf_full_index = (rows, slice(None))
                if case.input == "h_chunk" and ctx is not None:
                    tp, tp_rank = ctx["tp_mesh"].size(), ctx["tp_mesh"].get_local_rank()
                    chunk = -(-SEQ // tp)
                    seq = slice(tp_rank * chunk, min(SEQ, (tp_rank + 1) * chunk))
                    leaf = h[:, seq].clone().requires_grad_()
                    leaf_full_index = (rows, seq)
                    # This rank's torch.chunk piece of the sequence as a Shard(1) DTensor of [b, SEQ, dim].
                    shape = (leaf.shape[0], SEQ, leaf.shape[2])
                    model_in = DTensor.from_local(leaf, ctx["tp_mesh"], [Shard(1)], run_check=False, shape=shape,
                                                  stride=torch.empty(shape, device="meta").stride())
                else:
                    leaf = h.clone().requires_grad_()
                    model_in = leaf
                out = model(h=model_in)
        else:
            leaf, leaf_full_index = None, None
            feats = modules["model"](batch["x"][rows])
            record["encoder_out"] = (rows, feats.detach().clone())
            record["encoder_out_is_dtensor"] = isinstance(feats, DTensor)
            out = modules["proj"](feats)
        loss = _loss(out, batch, rows, count)
        loss.backward()
        if ctx is not None and not case.options.fsdp:
            for m in modules.values():
                allreduce_gradients(m, ctx["dp_mesh"])
        if ctx is not None:  # the full loss is the sum of the dp shares
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=ctx["dp_mesh"].get_group())
        record["loss"] = loss.detach().clone()
        record["input_grad"] = (leaf_full_index, None if leaf is None else leaf.grad.clone())
        record["grads"] = {
            f"{k}.{n}": _full(p.grad) for k, m in modules.items() for n, p in m.named_parameters()
        }
        opt.step()
        opt.zero_grad()
        records.append(record)
    records.append({"weights": {f"{k}.{n}": _full(p)
                                for k, m in modules.items() for n, p in m.named_parameters()}})
    return records


def _check_case(name: str) -> dict[str, float]:
    """Runs on every rank: reference and parallel training, compared; returns the worst errors."""
    case = CASES[name]
    batch = _batch(case.module)
    reference = _train(case, _build(case.module), batch, rows=slice(None))

    layout = MimoLayout({"m": case.par})
    layout.init_meshes("cpu")
    tp_mesh, dp_mesh = layout.mesh("m", "tp"), layout.mesh("m", ("dp", "cp"))
    dp_rank, dp = layout.coordinate("m", dist.get_rank())["dp"], case.par.dp
    per_rank = BATCH // dp
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)

    modules = _build(case.module)
    for m in modules.values():
        _parallelize(m, tp_mesh, dp_mesh, case.options)
    if case.options.fsdp and dp > 1:  # every parameter is now dp-sharded (a DTensor)
        assert all(isinstance(p, DTensor) for m in modules.values() for p in m.parameters())
    parallel = _train(case, modules, batch, rows=rows, ctx={"tp_mesh": tp_mesh, "dp_mesh": dp_mesh})

    worst: dict[str, float] = {}

    def close(what: str, actual, expected) -> None:
        assert (actual is None) == (expected is None), f"{name}: {what}: gradient presence differs"
        if actual is None:
            return
        torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{name}: {what}: {m}")
        worst[what.split(" ")[0]] = max(worst.get(what.split(" ")[0], 0.0),
                                         (actual - expected).abs().max().item())

    for step, (p, r) in enumerate(zip(parallel[:STEPS], reference[:STEPS])):
        close(f"loss step {step}", p["loss"], r["loss"])
        index, grad = p["input_grad"]
        if grad is not None:
            close(f"input_grad step {step}", grad, r["input_grad"][1][index])
        if "encoder_out" in p:
            assert not p["encoder_out_is_dtensor"], f"{name}: encoder output must be a plain tensor"
            rows, out = p["encoder_out"]
            close(f"encoder_out step {step}", out, r["encoder_out"][1][rows])
        assert p["grads"].keys() == r["grads"].keys(), f"{name}: parameter names differ"
        for param, g in p["grads"].items():
            close(f"grad step {step} {param}", g, r["grads"][param])
    for param, w in parallel[-1]["weights"].items():
        close(f"weight {param}", w, reference[-1]["weights"][param])
    return worst


SP_2_11 = needs_torch((2, 13), "sequence parallel over a sequence tp does not divide: a view of the "
                               "gathered rows fails")


@pytest.mark.parametrize("name", [pytest.param(n, marks=SP_2_11) if c.options.sp else n for n, c in CASES.items()])
def test_matches_single_process(name: str) -> None:
    run_on_ranks(_check_case, CASES[name].world, name, timeout=120)


def test_mixed_precision_without_fsdp_autocasts_even_a_compiled_module():
    """`param_dtype` on a module without FSDP2: its forward under autocast (hooks that stay eager
    when the module is compiled as a whole), fp32 parameters and gradients, no autocast after."""
    reference, model = Projection(8, 16), Projection(8, 16)
    reference.init_weights(0)
    model.init_weights(0)
    parallelize_projection(model, None, None, ParallelOptions(compile=True, compile_backend="aot_eager",
                                                              param_dtype="bf16"))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(x)
    for _ in range(2):  # the compiled call and a cached one
        out = model(x)
        assert out.dtype == torch.bfloat16 and not torch.is_autocast_enabled("cpu")
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.float().sum().backward()
    expected.float().sum().backward()
    assert model.fc1.weight.dtype == model.fc1.weight.grad.dtype == torch.float32
    torch.testing.assert_close(model.fc1.weight.grad, reference.fc1.weight.grad)


def test_options_are_validated():
    with pytest.raises(TypeError, match=r"\{'sp': 'yes'\} must be True or False"):
        ParallelOptions(sp="yes")
    with pytest.raises(TypeError, match=r"param_dtype='half' must be a floating dtype such as torch.bfloat16"):
        ParallelOptions(param_dtype="half")
    with pytest.raises(TypeError, match=r"reduce_dtype=torch.int32 must be a floating dtype"):
        ParallelOptions(reduce_dtype=torch.int32)
    assert ParallelOptions(param_dtype="bf16").param_dtype is torch.bfloat16
    assert ParallelOptions(param_dtype="torch.bfloat16").param_dtype is torch.bfloat16  # the spelling --help shows
    assert ParallelOptions(param_dtype="bf16").gradient_reduce_dtype is torch.float32  # fp32 sums by default
    assert ParallelOptions(param_dtype="bf16", reduce_dtype="bf16").gradient_reduce_dtype is torch.bfloat16
    assert ParallelOptions().gradient_reduce_dtype is None
    with pytest.raises(TypeError, match=r"compile_backend=None must be a backend name"):
        ParallelOptions(compile_backend=None)


# --------------------------------------------------------------------------------------------
# init_weights on an already parallelized model: each shard gets its part of the full value
# --------------------------------------------------------------------------------------------


def _init_after_parallelize(par: Parallelism, meta: bool, block: int) -> bool:
    default, layers.INIT_BLOCK_ELEMENTS = layers.INIT_BLOCK_ELEMENTS, block  # rows in blocks of `block`
    try:
        return _init_and_compare(par, meta)
    finally:
        layers.INIT_BLOCK_ELEMENTS = default  # the worker process serves later tests


def _init_and_compare(par: Parallelism, meta: bool) -> bool:
    reference = Llama(LlamaConfig.tiny())
    reference.init_weights(SEED)
    layout = MimoLayout({"m": par})
    layout.init_meshes("cpu")
    with torch.device("meta" if meta else "cpu"):
        model = Llama(LlamaConfig.tiny())  # PyTorch's default init: different from the reference
    parallelize_llama(model, layout.mesh("m", "tp"), layout.mesh("m", ("dp", "cp")))
    if meta:
        model.to_empty(device="cpu")  # only this rank's shards are allocated
    model.init_weights(SEED)
    expected = dict(reference.named_parameters())
    sharded = 0
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        sharded += isinstance(param, DTensor)
        torch.testing.assert_close(full, expected[name], rtol=0, atol=0, msg=name)
    return sharded > 0


@pytest.mark.parametrize("par,meta,block", [(Parallelism(tp=2), False, 1 << 20), (Parallelism(dp=2), True, 1 << 20),
                                            (Parallelism(dp=2, tp=2), True, 96), (Parallelism(tp=2), True, 40)],
                         ids=["tp2", "meta_fsdp_dp2", "meta_fsdp_dp2_tp2_blocks", "meta_tp2_blocks"])
def test_init_weights_after_parallelize_matches_single_process(par: Parallelism, meta: bool, block: int) -> None:
    """Each shard holds its slice of the full value: after parallelizing a built module, and on a
    module built on the meta device (only shards allocated), with parameters drawn in one block
    or in many row blocks (small `INIT_BLOCK_ELEMENTS`, so shards start and end inside blocks)."""
    assert run_on_ranks(_init_after_parallelize, par.size, par, meta, block, timeout=120) == [True] * par.size


def test_sizes_tensor_parallel_cannot_split_are_named():
    from dtensor_mimo.parallelize.tensor_parallel import check_divisible

    with pytest.raises(ValueError, match=r"Llama: tensor parallel over tp=4 needs these sizes divisible "
                                         r"by 4: n_kv_heads=2, vocab_size=66; choose a tp that divides them"):
        check_divisible("Llama", {"n_heads": 8, "n_kv_heads": 2, "vocab_size": 66}, 4)


# --------------------------------------------------------------------------------------------
# vocab-parallel cross entropy (loss_parallel) against F.cross_entropy on the whole vocabulary
# --------------------------------------------------------------------------------------------


def _vocab_parallel_matches_full(tp: int) -> None:
    rank = dist.get_rank()
    mesh = MimoLayout({"m": Parallelism(tp=tp)})
    mesh.init_meshes("cpu")
    tp_mesh = mesh.mesh("m", "tp")
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 7, 64, generator=g, dtype=torch.float64) * 4
    labels = torch.randint(0, 64, (3, 7), generator=g)
    labels[0, :3] = IGNORE_INDEX
    labels[1, 0], labels[1, 1] = 0, 63  # the first and last id of the vocabulary (first and last shard)
    weights = torch.rand(21, generator=g, dtype=torch.float64)
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    (want * weights).sum().backward()
    local = logits.chunk(tp, -1)[rank].clone().requires_grad_()
    got = vocab_parallel_cross_entropy(DTensor.from_local(local, tp_mesh, [Shard(2)]), labels.flatten())
    (got * weights).sum().backward()
    torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(local.grad, full.grad.chunk(tp, -1)[rank], rtol=1e-12, atol=1e-12)
    tied = logits.clone()
    tied[0, 0, 5] = tied[0, 0, 40] = tied[1, 2, 63] = 100.0  # a tie across shards: the first id wins
    shard = DTensor.from_local(tied.chunk(tp, -1)[rank], tp_mesh, [Shard(2)])
    assert torch.equal(vocab_parallel_argmax(shard), tied.argmax(-1))
    assert vocab_parallel_argmax(shard)[0, 0] == 5


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_cross_entropy_and_argmax_match_full_vocabulary(tp: int) -> None:
    run_on_ranks(_vocab_parallel_matches_full, tp, tp, timeout=60)


def _vocab_parallel_argmax_nan(tp: int) -> list[int]:
    mesh = MimoLayout({"m": Parallelism(tp=tp)})
    mesh.init_meshes("cpu")
    tp_mesh = mesh.mesh("m", "tp")
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    logits[0, 13] = float("nan")  # a NaN in the last shard beats every number, as in torch.argmax
    logits[1, 2] = logits[1, 9] = float("nan")  # the first NaN wins
    logits[2, 1], logits[2, 14] = float("inf"), float("nan")  # a NaN beats +inf
    logits[3] = float("-inf")  # every logit -inf: id 0
    want = logits.argmax(-1)
    shard = DTensor.from_local(logits.chunk(tp, -1)[dist.get_rank()], tp_mesh, [Shard(1)])
    got = vocab_parallel_argmax(shard)
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    return got.tolist()


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_argmax_takes_torchs_nan_rule(tp: int) -> None:
    """`vocab_parallel_argmax` is ``logits.argmax(-1)``, NaN included (torch's argmax takes the
    first NaN of a row, as the max): logits that went NaN on one vocabulary shard gave the id
    2**63 - 1 under tp, where one process gives an id of the vocabulary."""
    assert run_on_ranks(_vocab_parallel_argmax_nan, tp, tp, timeout=60) == [[13, 2, 14, 0]] * tp


# --------------------------------------------------------------------------------------------
# parameters tp leaves whole: gradients averaged over tp; a debug check names a drifted replica
# --------------------------------------------------------------------------------------------


def _tiny_model(layout: MimoLayout) -> MimoModel:
    """The tiny Llama and ViT on `layout` (its meshes built here), default options."""
    layout.init_meshes("cpu")
    llama = Llama(LlamaConfig.tiny())
    llama.init_weights(1)
    vision = ModalityEncoder(ViT(ViTConfig.tiny()), Projection(32, 32))
    vision.init_weights(2)
    return MimoModel(layout, llama, {"vision": vision})


def _replica_error(model: MimoModel) -> str | None:
    """What `check_replicas` raises on this rank, or None."""
    try:
        model.check_replicas()
    except RuntimeError as error:
        return str(error)
    return None


def _replicas(drift: bool) -> str | None:
    layout = MimoLayout({"vision": Parallelism(), "language": Parallelism(tp=2)})
    model = _tiny_model(layout)  # no sp: the norms stay plain tensors
    params = model.module_parameters("language")
    norm = "layers.1.ffn_norm.weight"
    if norm in params:  # the tp ranks: gradients that differ (as GPU kernels may make them)
        tp_rank = layout.coordinate("language", dist.get_rank())["tp"]
        for p in params.values():
            p.grad = torch.zeros_like(p)
        params[norm].grad = torch.full_like(params[norm], float(tp_rank + 1))
        model.reduce_gradients()
        torch.testing.assert_close(params[norm].grad, torch.full_like(params[norm], 1.5))  # the mean
        if drift and tp_rank == 1:
            with torch.no_grad():
                params[norm][3] += 1e-6
    return _replica_error(model)


def test_tp_replicated_gradients_are_averaged_and_drift_is_named() -> None:
    assert run_on_ranks(_replicas, 3, False, timeout=60) == [None] * 3
    errors = run_on_ranks(_replicas, 3, True, timeout=60)
    assert errors[0] == "replicas differ: on 2 other rank(s)"  # the vision rank raises too
    for error in errors[1:]:
        assert error == "replicas differ: module 'language': parameter 'layers.1.ffn_norm.weight' differs over tp"


def _sp_replicas(fsdp: bool, drift: bool) -> str | None:
    """Language tp2 with sp (`fsdp`: tp2·dp2 under FSDP2, colocated with vision): the norms are
    DTensors replicated over tp (FSDP2's 2-D ones: dp shards, replicated over tp), one copy per tp
    rank; with `drift` tp rank 1's copy of one of them moves."""
    pars = {"vision": Parallelism(dp=4 if fsdp else 1), "language": Parallelism(tp=2, dp=2 if fsdp else 1)}
    layout = MimoLayout(pars, offsets={"vision": 0, "language": 0} if fsdp else None)
    layout.init_meshes("cpu")
    llama = Llama(LlamaConfig.tiny())
    llama.init_weights(1)
    vision = ModalityEncoder(ViT(ViTConfig.tiny()), Projection(32, 32))
    vision.init_weights(2)
    model = MimoModel(layout, llama, {"vision": vision}, options={"language": ParallelOptions(sp=True, fsdp=fsdp)})
    params = model.module_parameters("language")
    norm = "layers.1.ffn_norm.weight"
    if drift and norm in params and layout.coordinate("language", dist.get_rank())["tp"] == 1:
        with torch.no_grad():
            params[norm].to_local()[3] += 1e-6
    return _replica_error(model)


@pytest.mark.parametrize("fsdp", [False, True], ids=["plain", "fsdp"])
def test_drift_of_norms_replicated_over_tp_under_sp_is_named(fsdp: bool) -> None:
    """Under sp the block norms are DTensors replicated over tp (each tp rank holds the whole
    weight), copies `check_replicas` must compare over tp as it does the plain ones: it compared
    only plain tensors there, and a drifted norm under sp passed the check on every rank."""
    world = 4 if fsdp else 3
    assert run_on_ranks(_sp_replicas, world, fsdp, False, timeout=60) == [None] * world
    errors = run_on_ranks(_sp_replicas, world, fsdp, True, timeout=60)
    named = "replicas differ: module 'language': parameter 'layers.1.ffn_norm.weight' differs over tp"
    if fsdp:
        assert errors == [named] * 4, errors
    else:
        assert errors == ["replicas differ: on 2 other rank(s)", named, named], errors


def _hsdp_replicas(drift: bool) -> str | None:
    layout = MimoLayout({"vision": Parallelism(dp=4), "language": Parallelism(dp=4, dp_replicate=2)},
                        offsets={"vision": 0, "language": 0})
    model = _tiny_model(layout)
    if drift and layout.coordinate("language", dist.get_rank())["dp"] == 3:  # replica group 1's second shard
        with torch.no_grad():
            model.module_parameters("language")["layers.0.attention.wq.weight"].to_local()[0, 0] += 1e-6
    return _replica_error(model)


def test_hsdp_replicas_drift_is_named() -> None:
    """With HSDP each shard lives in every replica group: `check_replicas` compares them."""
    assert run_on_ranks(_hsdp_replicas, 4, False, timeout=60) == [None] * 4
    errors = run_on_ranks(_hsdp_replicas, 4, True, timeout=60)
    named = "replicas differ: module 'language': parameter 'layers.0.attention.wq.weight' differs over dp_replicate"
    assert errors == ["replicas differ: on 2 other rank(s)", named, "replicas differ: on 2 other rank(s)", named]


def _gathered_after_forward(reshard_after_forward: bool) -> tuple[bool, list[bool]]:
    """Whether the FSDP2 root's parameters, and each block's, are gathered right after forward."""
    layout = MimoLayout({"language": Parallelism(dp=2)})
    layout.init_meshes("cpu")
    llama = Llama(LlamaConfig.tiny())
    llama.init_weights(seed=0)
    parallelize_llama(llama, None, layout.mesh("language", ("dp", "cp")),
                      ParallelOptions(reshard_after_forward=reshard_after_forward))
    out = llama(torch.randint(0, 64, (1, 8)))
    root = llama._get_fsdp_state()._fsdp_param_group.is_unsharded
    blocks = [block._get_fsdp_state()._fsdp_param_group.is_unsharded for block in llama.layers.values()]
    out.sum().backward()
    return root, blocks


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_root_stays_gathered_from_forward_to_backward(reshard: bool) -> None:
    """`ParallelOptions.reshard_after_forward` frees the blocks' gathered parameters after forward
    (ZeRO-3) or keeps them; the root's (the decoder's embeddings, final norm and output head) are
    never freed there, FSDP2's own default for a root: its backward starts at once and would only
    all-gather them again (torch >= 2.11 keeps that default only where `fully_shard` is not told
    `reshard_after_forward` explicitly)."""
    for root, blocks in run_on_ranks(_gathered_after_forward, 2, reshard, timeout=60):
        assert root, "the FSDP2 root was resharded after forward: its backward all-gathers it again"
        assert blocks == [not reshard] * 2


def test_checkpointed_blocks_are_compiled_once_inside_their_checkpoint() -> None:
    """`compile_blocks` skips the blocks `checkpoint_blocks` compiled inside their checkpoint:
    compiled again from outside, dynamo would trace the checkpoint itself, which fails on DTensor
    activations (the cause of the old checkpointing + compile + tp refusal; the oracle case
    `checkpointed_compiled_tp` in tests/test_mimo.py runs it)."""
    from dtensor_mimo.parallelize import checkpoint_blocks, compile_blocks

    blocks = torch.nn.ModuleDict({str(i): torch.nn.Linear(4, 4) for i in range(3)})
    done = checkpoint_blocks(blocks, every=2, compile_backend="aot_eager")
    compile_blocks(blocks, "aot_eager", skip=done)
    assert done == {"0", "2"}
    assert [blocks[n]._compiled_call_impl is None for n in ("0", "1", "2")] == [True, False, True]
    x = torch.randn(2, 4, requires_grad=True)
    blocks["0"](x).sum().backward()  # runs the compiled forward inside the checkpoint
    assert x.grad is not None


def test_checkpointed_blocks_replay_their_dropout_in_the_recomputation() -> None:
    """A checkpointed block (a user's, with dropout) recomputes its forward in backward under the
    RNG state its forward drew from: the same dropout masks, so the gradients are those of the
    block run without checkpointing (same seed, one process). Recomputed from the generator's
    state at backward (moved on by the later blocks' dropout), the masks differ and so do the
    gradients: the library's own models have no dropout, so no oracle case tells."""
    import copy

    from dtensor_mimo.parallelize import checkpoint_blocks

    torch.manual_seed(0)
    blocks = torch.nn.ModuleDict({str(i): torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5),
                                                               torch.nn.Tanh()) for i in range(3)})
    reference = copy.deepcopy(blocks)
    checkpoint_blocks(blocks, every=1)
    x = torch.randn(4, 8)
    for model in (reference, blocks):
        torch.manual_seed(1)
        h = x
        for block in model.values():
            h = block(h)
        h.square().sum().backward()
    for (name, want), got in zip(reference.named_parameters(), blocks.parameters()):
        assert torch.equal(got.grad, want.grad), name


def _checkpointed_block_keys(every: int) -> dict[str, list[int]]:
    """The keys of the blocks this rank's stages checkpoint, per module: vision pp2 (ranks 0-1)
    and language pp2 (ranks 2-3), six blocks each, cut 3 | 3."""
    import functools

    from dtensor_mimo import PipelineConfig
    from dtensor_mimo.models.llama import TransformerBlock
    from dtensor_mimo.models.vit import EncoderBlock

    layout = MimoLayout({"vision": Parallelism(pp=2), "language": Parallelism(pp=2)})
    layout.init_meshes("cpu")
    llama = Llama(LlamaConfig.tiny(n_layers=6))
    vision = ModalityEncoder(ViT(ViTConfig.tiny(n_layers=6)), Projection(32, 32))
    options = {n: ParallelOptions(activation_checkpointing=every) for n in ("vision", "language")}
    model = MimoModel(layout, llama, {"vision": vision}, options=options, pipeline=PipelineConfig(microbatches=2))
    keys: dict[str, list[int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, (TransformerBlock, EncoderBlock)) and isinstance(module.__dict__.get("forward"),
                                                                               functools.partial):
            kind = "language" if isinstance(module, TransformerBlock) else "vision"
            keys.setdefault(kind, []).append(int(name.rsplit(".", 1)[-1]))
    return {kind: sorted(set(k)) for kind, k in keys.items()}


def test_checkpointing_every_n_counts_the_whole_modules_blocks_under_pp() -> None:
    """`activation_checkpointing=2` on a six-block module checkpoints blocks 0, 2 and 4 whatever
    the pipeline cut ("the first, then every n-th" of the module's blocks), for the language
    model's stages and an encoder's. Counted per stage, the stage holding blocks 3-5 checkpointed
    3 and 5: four blocks of six, and with one block per (virtual) stage every block."""
    per_rank = run_on_ranks(_checkpointed_block_keys, 4, 2, timeout=120)
    got: dict[str, set[int]] = {}
    for keys in per_rank:
        for kind, k in keys.items():
            got.setdefault(kind, set()).update(k)
    assert got == {"vision": {0, 2, 4}, "language": {0, 2, 4}}


def test_inductor_compiled_blocks_match_eager() -> None:
    """The main job's compile (inductor, per block: `compile_blocks`) gives the eager loss and
    gradients; the suite's other compiled cases use "aot_eager", which shares everything but
    inductor's code generation (one tiny decoder here, in one process)."""
    import copy

    torch.manual_seed(0)
    eager = Llama(LlamaConfig.tiny(n_layers=1))
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled.layers, "inductor")
    tokens = torch.randint(0, 64, (2, 16))
    outs = [model(tokens) for model in (eager, compiled)]
    for out in outs:
        F.cross_entropy(out.flatten(0, 1), tokens.flatten()).backward()
    assert torch.allclose(outs[1], outs[0], rtol=1e-4, atol=1e-5)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6), name


def test_sums_in_place_in_buckets() -> None:
    """`sum_in_place` over 2 ranks in buckets of 64 bytes (two in flight): tensors that share a
    bucket go through one flat copy, a tensor alone in its bucket is reduced where it lies (no
    copy), and sums in bf16 land back in fp32; every tensor equals the sum of the ranks' values,
    computed here."""
    assert run_on_ranks(_bucketed_sums, 2, timeout=60) == [True, True]


def _bucketed_sums() -> bool:
    from dtensor_mimo.parallelize.reducer import cut, sum_in_place

    rank, group = dist.get_rank(), dist.group.WORLD
    shapes = [(3,), (2, 5), (40,), (4,), (7, 3), (1,)]  # fp32: 12, 40, 160, 16, 84, 4 bytes

    def values(r: int) -> list[torch.Tensor]:
        return [torch.arange(torch.Size(s).numel(), dtype=torch.float32).view(s) * (r + 1) + i
                for i, s in enumerate(shapes)]

    nbytes = [t.numel() * 4 for t in values(0)]
    assert cut(nbytes, [torch.float32] * 6, 64) == [[0, 1], [2], [3], [4], [5]]
    assert cut([0, 12], [torch.float32] * 2, 64) == [[0, 1]]  # an empty shard first
    assert cut([4, 4, 4], [torch.float32, torch.bfloat16, torch.bfloat16], 64) == [[0], [1, 2]]  # one dtype a bucket
    expected = [a + b for a, b in zip(values(0), values(1))]
    mine = values(rank)
    reduced, all_reduce = [], dist.all_reduce
    dist.all_reduce = lambda t, *args, **kwargs: (reduced.append(t.data_ptr()), all_reduce(t, *args, **kwargs))[1]
    try:
        sum_in_place(mine, group, bucket_bytes=64)
    finally:
        dist.all_reduce = all_reduce
    in_bf16 = values(rank)
    sum_in_place(in_bf16, group, torch.bfloat16, bucket_bytes=64)
    return (all(torch.equal(m, e) for m, e in zip(mine, expected))
            # the first bucket (two tensors) through a flat copy; each tensor alone in its bucket where it lies
            and reduced[1:] == [t.data_ptr() for t in mine[2:]] and reduced[0] not in [t.data_ptr() for t in mine]
            and all(t.dtype == torch.float32 and torch.allclose(t, e, rtol=1e-2) for t, e in zip(in_bf16, expected)))


def _frozen_stay_frozen(sp: bool, fsdp: bool) -> dict[str, list[str]]:
    """A decoder with its first block and final norm frozen and a ViT frozen whole, tp2 (and sp)
    on 2 ranks (dp2 of the ViT with FSDP2 on 4): which parameters require a gradient after
    `parallelize`, and which got one from a backward, against the user's own choice."""
    from dtensor_mimo.layout import MimoLayout

    layout = MimoLayout({"m": Parallelism(dp=dist.get_world_size() // 2, tp=2)})
    layout.init_meshes("cpu")
    tp_mesh, dp_mesh = layout.mesh("m", "tp"), layout.mesh("m", ("dp", "cp"))
    llama, vit = Llama(LlamaConfig.tiny()), ViT(ViTConfig.tiny())
    llama.init_weights(0)
    vit.init_weights(1)
    for name, p in llama.named_parameters():
        if name.startswith(("layers.0.", "norm.")):
            p.requires_grad_(False)
    vit.requires_grad_(False)
    wanted = {f"{k}.{n}" for k, m in (("llama", llama), ("vit", vit)) for n, p in m.named_parameters()
              if p.requires_grad}
    options = ParallelOptions(sp=sp, fsdp=fsdp)
    parallelize_llama(llama, tp_mesh, dp_mesh, options)
    parallelize_encoder(vit, tp_mesh, dp_mesh, options)
    trainable = {f"{k}.{n}" for k, m in (("llama", llama), ("vit", vit)) for n, p in m.named_parameters()
                 if p.requires_grad}
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    h = vit(images)[:, :8]  # [2, 8, 32]: the frozen tower's rows as the decoder's input (tp divides 8)
    logits = llama(h=h)
    (logits.full_tensor() if isinstance(logits, DTensor) else logits).square().sum().backward()
    graded = {f"{k}.{n}" for k, m in (("llama", llama), ("vit", vit)) for n, p in m.named_parameters()
              if p.grad is not None}
    return {"unfrozen": sorted(trainable - wanted), "refrozen": sorted(wanted - trainable),
            "frozen_with_grad": sorted(graded - wanted)}


@pytest.mark.parametrize("sp,fsdp,world", [(True, False, 2), (False, False, 2), (True, True, 4)])
def test_parallelize_keeps_frozen_parameters_frozen(sp: bool, fsdp: bool, world: int) -> None:
    """Parameters the user froze (``requires_grad_(False)``) stay frozen through the tp plan:
    torch's `SequenceParallel` registers each norm weight anew as a Parameter that requires a
    gradient, which (under sp) would train a frozen block's and a frozen tower's norms."""
    for r in run_on_ranks(_frozen_stay_frozen, world, sp, fsdp, timeout=120):
        assert r == {"unfrozen": [], "refrozen": [], "frozen_with_grad": []}, r


def _tied_under_tp() -> dict[str, str]:
    """A decoder whose output head is tied to its token embedding, on tp2 or pp2 (rank 0-1) beside
    a ViT (rank 2), or cut into two stages on one rank (pp1 x virtual_stages 2, rank 2, beside a
    ViT on dp2, ranks 0-1): what `MimoModel` and `parallelize_llama` raise on each rank."""
    from dtensor_mimo import PipelineConfig

    out = {}
    llama = Llama(LlamaConfig.tiny())
    llama.output.weight = llama.tok_embeddings.weight
    vision = ModalityEncoder(ViT(ViTConfig.tiny()), Projection(32, 32))
    for dim in ("tp", "pp"):
        layout = MimoLayout({"vision": Parallelism(), "language": Parallelism(**{dim: 2})})
        try:
            MimoModel(layout, llama, {"vision": vision}, pipeline=PipelineConfig(microbatches=2))
        except ValueError as error:
            out[dim] = str(error)
    layout = MimoLayout({"vision": Parallelism(dp=2), "language": Parallelism()})
    try:
        MimoModel(layout, llama, {"vision": vision},
                  pipeline=PipelineConfig(microbatches=2, schedule="Interleaved1F1B", virtual_stages=2))
    except ValueError as error:
        out["stages"] = str(error)
    layout = MimoLayout({"vision": Parallelism(), "language": Parallelism(tp=2)})
    layout.init_meshes("cpu")
    if layout.is_member("language", dist.get_rank()):
        try:
            parallelize_llama(llama, layout.mesh("language", "tp"), None, ParallelOptions())
        except ValueError as error:
            out["parallelize"] = str(error)
    return out


def test_tied_parameters_under_tp_or_pp_are_refused_by_name() -> None:
    """Tensor parallel registers each layer's own shards, and the pipeline split gives each stage
    its own pieces, so two names of one tensor (an output head tied to the token embedding) would
    become two parameters training apart, against the single-process run's one (whose gradient is
    their sum): refused by name, on every rank, before any collective, and by `parallelize` itself.
    Also at pp = 1 with virtual stages, whose two stages on one rank are two FSDP2 roots: that split
    trained the two names apart (the losses of later steps drifted from the single process's by
    0.2-0.7%, with or without FSDP2)."""
    want = "module 'language': tied parameters (tok_embeddings.weight = output.weight: one tensor under several names)"
    results = run_on_ranks(_tied_under_tp, 3, timeout=60)
    for r in results:
        assert r["tp"].startswith(f"{want} with tp=2"), r
        assert r["pp"].startswith(f"{want} with pp=2"), r
        assert r.get("stages", "").startswith(f"{want} with pp=1 x virtual_stages=2 = 2 pipeline stages"), r
    for r in results[1:]:
        assert r["parallelize"].startswith(f"{want.replace('language', 'Llama')} with tp=2"), r


def _tower_shared_by_two_encoders() -> dict[str, str | None]:
    """One ViT given to two encoders ("vision", "frames"), each with its own projection: what
    `MimoModel` raises on each rank, trainable on disjoint ranks (0, 1; language 2), frozen on
    shared ranks (0-1), and frozen on disjoint ranks (accepted: None)."""
    out: dict[str, str | None] = {}
    cases = {"trainable": (True, None), "frozen_colocated": (False, {"vision": 0, "frames": 0, "language": 2}),
             "frozen_disjoint": (False, None)}
    for what, (trains, offsets) in cases.items():
        dp = 2 if offsets else 1
        layout = MimoLayout({"vision": Parallelism(dp=dp), "frames": Parallelism(dp=dp), "language": Parallelism()},
                            offsets=offsets)
        vit = ViT(ViTConfig.tiny()).requires_grad_(trains)
        encoders = {n: ModalityEncoder(vit, Projection(32, 32)) for n in ("vision", "frames")}
        try:
            MimoModel(layout, Llama(LlamaConfig.tiny()), encoders)
            out[what] = None
        except ValueError as error:
            out[what] = str(error)
    return out


def test_parameters_shared_by_two_modules_are_refused_by_name() -> None:
    """Each module is parallelized and trained on its own ranks with its own optimizer: a tower
    two encoders share would train as two copies apart (the single process sums both encoders'
    gradients into one), and a rank holding both would parallelize it twice (FSDP2 raised there
    alone, the language rank left waiting). Refused on every rank before any collective; a frozen
    tower on disjoint ranks stays one tensor everywhere and is accepted."""
    share = "modules 'vision' and 'frames' share parameters (vision.encoder.pos_embed is frames.encoder.pos_embed): "
    for r in run_on_ranks(_tower_shared_by_two_encoders, 3, timeout=60):
        assert r["trainable"].startswith(share + "each module trains on its own ranks"), r
        assert r["frozen_colocated"].startswith(share + "they share ranks"), r
        assert r["frozen_disjoint"] is None, r


def _frozen_tower_held(frozen: bool, reshard_after_forward: bool) -> list[tuple[int, int]]:
    """vision dp2 under FSDP2 (ranks 0-1), frozen whole or not, and the language model (rank 2): after
    each of two training steps, on a vision rank, (elements of its parameters held whole, elements
    of the tower)."""
    from torch.distributed.tensor import DTensor

    from dtensor_mimo import AdamWConfig, MimoModel, MimoOptimizer, train_step
    from tests.test_mimo import _batches, _modules

    model = MimoModel(MimoLayout({"vision": Parallelism(dp=2), "language": Parallelism()}),
                      *_modules(("vision",), frozen=("vision",) if frozen else ()),
                      options={"vision": ParallelOptions(reshard_after_forward=reshard_after_forward)})
    optimizer = MimoOptimizer(model, AdamWConfig(lr=1e-3))
    held = []
    for batch in _batches(("vision",), False, 4, (64, 64)):
        train_step(model, optimizer, batch)
        if "vision" in model.encoders:
            params = list(model.encoders["vision"].parameters())
            held.append((sum(p.numel() for p in params if not isinstance(p, DTensor)),
                         sum(p.numel() for p in params)))
    return held


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("frozen", [False, True], ids=["trains", "frozen"])
def test_frozen_fsdp_tower_keeps_no_full_copy_after_a_step(frozen: bool, reshard: bool) -> None:
    """FSDP2 reshards a root (and, with reshard_after_forward=False, every block) in its backward: a
    tower frozen whole has none, so after a training step its root's parameters (embeddings,
    final norm, projection) stayed gathered on every dp rank for good, and with
    reshard_after_forward=False the whole tower (a full copy of a sharded module on each rank). A
    trainable tower holds none of them whole after a step; a frozen one neither."""
    vision = run_on_ranks(_frozen_tower_held, 3, frozen, reshard, timeout=120)[:2]
    for held in vision:
        assert len(held) == 2 and all(whole == 0 < total for whole, total in held), held
