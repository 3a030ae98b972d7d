"""FP8 training per module (`ParallelOptions(fp8=...)`, torchao's float8 training, emulated on CPU).

The model and batches are `tests/test_mimo.py`'s (tiny ViT + projection, tiny Llama, 3 steps of
AdamW at lr 1e-2 with clipping; 2 steps in the distributed cases). References: the same model trained in one process without fp8
(fp32; and under bf16 autocast, for scale), and the one-process fp8 run for the distributed case.

| case               | vision                 | language                  | world | against                 |
|--------------------|------------------------|---------------------------|-------|-------------------------|
| language tensorwise| fp32                   | fp8 tensorwise            | 1     | fp32 without fp8        |
| language rowwise   | fp32                   | fp8 rowwise               | 1     | fp32 without fp8        |
| vision rowwise     | fp8 rowwise            | fp32                      | 1     | fp32 without fp8        |
| fsdp               | dp2 FSDP2, fp8 rowwise | dp2 FSDP2, fp8 tensorwise (float8 all-gather) | 2 (colocated) | the one-process fp8 run |
| tp                 | dp2 FSDP2, fp8 rowwise | tp2 + sp, fp8 tensorwise, compiled (aot_eager) | 2 (colocated) | the one-process fp8 run |

Tolerances. float8 e4m3 keeps 3 mantissa bits: each cast rounds by up to 2^-4 = 6% of the value
(about 2 significant decimal digits), and e5m2 gradients by 2^-3. Over a dot product of K terms the
rounding errors are independent and mostly cancel, so a layer's output moves by about
6% / sqrt(K) of its size, and the loss by far less: fp8 against fp32 is held to 1% of the loss
per step (2 significant digits; measured: at most 0.02%), and to differ from fp32 at all (the
layers really ran in float8). The dp2 run casts each rank's own activations with its own scale,
so it is not bitwise the one-process fp8 run: its losses are held to 0.2% of them (measured:
at most 0.01%); tp casts the same replicated activations and whole-tensor weight scales as one
process (measured: equal in fp32).

Checkpoints: the fsdp and tp cases saved after their first step, synchronously and in the
background (`checkpoint.BackgroundSaves`, while the run goes on), and after their second in the
background again, each loaded into a model built anew: the losses of the steps after it are the
uninterrupted run's, exactly. Float8 weights under FSDP2 are torchao's weight subclass inside the
DTensor shards; a checkpoint stores their plain tensors (DCP's converter reads it without torchao).
Weights rewritten after a step (`load_hf`, `init_weights`) are cast with their own scales, not the
step's: the model computes what one given those weights anew does, exactly.

Errors: a misspelt recipe (options and trainer config), fp8 without torchao, fp8 on a GPU older
than compute capability 8.9: each names the module and the fix, before any process group.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dtensor_mimo import MimoLayout, MimoModel, ParallelOptions, Parallelism
from dtensor_mimo.models import Llama, ViT, ViTConfig
from dtensor_mimo.parallelize import parallelize
from dtensor_mimo.parallelize.fp8 import check_fp8, fp8_layers
from dtensor_mimo.train.config import ConfigError, parse_args
from tests.harness import run_on_ranks
from tests.test_mimo import LLAMA, Case, _distributed, _modules, _reference

float8 = pytest.importorskip("torchao.float8")

P = Parallelism
FP8_TOL = 1e-2  # relative, fp8 against fp32 (see the module docstring)
DP_TOL = 2e-3  # relative, dp2 fp8 against one-process fp8
RECIPES = {"vision": "rowwise", "language": "tensorwise"}  # of the fsdp and tp cases
STEPS = (64, 64)  # the distributed cases' steps (sequence lengths): the second all-gathers with refreshed scales
DISTRIBUTED = {
    "fsdp": Case({"vision": P(dp=2), "language": P(dp=2)}, offsets={"vision": 0, "language": 0}, seq_lens=STEPS,
                 options={"vision": ParallelOptions(fp8="rowwise"), "language": ParallelOptions(fp8="tensorwise")}),
    "tp": Case({"vision": P(dp=2), "language": P(tp=2)}, offsets={"vision": 0, "language": 0}, seq_lens=STEPS,
               options={"vision": ParallelOptions(fp8="rowwise"),
                        "language": ParallelOptions(fp8="tensorwise", sp=True, compile=True,
                                                    compile_backend="aot_eager")}),
    # HSDP: float8 all-gathers within each replica group (each weight's scale from an all-reduce
    # over its shards), the recipes swapped, the encoder compiled; its dp ranks without items (5
    # samples over 4) run their float8 layers on no rows (under tp:
    # test_a_float8_rank_without_rows_under_tp_and_fsdp)
    "hsdp": Case({"vision": P(dp=4, dp_replicate=2), "language": P(dp=4, dp_replicate=2)},
                 offsets={"vision": 0, "language": 0}, seq_lens=STEPS,
                 options={"vision": ParallelOptions(fp8="tensorwise", compile=True, compile_backend="aot_eager"),
                          "language": ParallelOptions(fp8="rowwise")}),
}


def _fp8(recipes: dict[str, str]):
    """`_reference`'s `prepare`: the library's fp8 conversion of the named modules (one process)."""
    def prepare(name: str, module: nn.Module) -> None:
        if name in recipes:
            parallelize(module, None, None, ParallelOptions(fp8=recipes[name]), name=name)
    return prepare


def _losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def _relative(got: list[float], want: list[float]) -> list[float]:
    return [abs(g - w) / abs(w) for g, w in zip(got, want)]


def _linear_names(module: nn.Module) -> set[str]:
    return {n for n, m in module.named_modules() if isinstance(m, nn.Linear)}


# ------------------------------------------------------------------ which layers convert


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_float8_layer_takes_an_input_without_rows(recipe: str) -> None:
    """An encoder's dp rank without items runs its layers on no rows (FSDP2 and the dp sums need
    its forward and backward): torchao's scales take an amax that an empty tensor has not
    (tensorwise: of the input, rowwise: of the output gradient); the layer gives the plain
    product, empty, and a zero weight gradient. With rows it still runs in float8."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(32, 16))
    plain = nn.Linear(32, 16).requires_grad_(False)
    plain.load_state_dict(layer[0].state_dict())
    parallelize(layer, None, None, ParallelOptions(fp8=recipe), name="vision")
    out = layer(torch.randn(0, 32, requires_grad=True))
    out.sum().backward()
    assert out.shape == (0, 16) and torch.equal(layer[0].weight.grad, torch.zeros(16, 32))
    x = torch.randn(8, 32)
    assert fp8_layers(layer) == ["0"] and not torch.equal(layer(x), plain(x))  # float8 rounding


def test_language_model_linears_convert_except_the_head() -> None:
    llama = Llama(LLAMA)
    linears = _linear_names(llama)
    parallelize(llama, None, None, ParallelOptions(fp8="tensorwise"))
    # every dim of the tiny Llama (32, 16, 64) is a multiple of 16: all but the head convert
    assert set(fp8_layers(llama)) == linears - {"output"}
    assert type(llama.output) is nn.Linear


def test_encoder_layers_whose_dims_are_not_multiples_of_16_stay() -> None:
    vit = ViT(ViTConfig.tiny(mlp_hidden=40))  # fc1 32 -> 40, fc2 40 -> 32: not multiples of 16
    parallelize(vit, None, None, ParallelOptions(fp8="rowwise"))
    converted = set(fp8_layers(vit))
    assert converted == {f"layers.{i}.attn.{w}" for i in ("0", "1") for w in ("wq", "wk", "wv", "wo")}
    assert all(type(vit.layers[i].mlp.fc1) is nn.Linear for i in ("0", "1"))


@pytest.mark.parametrize("recipe, tp, kept", [
    # the 1B Llama's shards at tp 8: wq 2048 -> 256, wk/wv 2048 -> 64, w1/w3 2048 -> 1024 do not pay
    # tensorwise (K <= 4096 and N <= 1024); wo 256 -> 2048 and w2 1024 -> 2048 do
    ("tensorwise", 8, {"wq", "wk", "wv", "w1", "w3"}),
    # rowwise at tp 2: only w1/w3 (2048 -> 4096 a rank: N > 4096 fails, so not even they)
    ("rowwise", 2, {"wq", "wk", "wv", "wo", "w1", "w2", "w3"}),
    # whole (tp 1): tensorwise keeps K/V (2048 -> 512), rowwise all but the 2048 -> 8192 ones
    ("tensorwise", 1, {"wk", "wv"}),
    ("rowwise", 1, {"wq", "wk", "wv", "wo", "w2"}),
])
def test_on_cuda_tensor_parallel_layers_are_judged_by_their_shards(recipe: str, tp: int, kept: set[str]) -> None:
    """Not emulated (CUDA), the 1B Llama of benchmarks/gpu.py keeps in bf16 the layers whose
    float8 matmuls torchao measured slower on an H100, read from each rank's shard of the tp plan
    (what its matmuls run; thresholds applied here by hand). Emulated, every eligible layer
    converts (the other tests)."""
    import dataclasses

    from dtensor_mimo.models import LlamaConfig
    from dtensor_mimo.parallelize.fp8 import convert_to_fp8, fp8_config
    from dtensor_mimo.parallelize.part import tp_weight_splits

    with torch.device("meta"):
        llama = Llama(LlamaConfig(vocab_size=32000, dim=2048, n_layers=2, n_heads=32, n_kv_heads=8, ffn_hidden=8192))
    linears = _linear_names(llama) - {"output"}
    config = dataclasses.replace(fp8_config("language", recipe, "cpu", False), emulate=False)
    convert_to_fp8(llama, config, "language", recipe, tp, tp_weight_splits(llama))
    assert set(fp8_layers(llama)) == {n for n in linears if n.rsplit(".", 1)[-1] not in kept}


def test_on_cuda_a_shard_whose_width_is_not_a_multiple_of_16_stays() -> None:
    """A SigLIP so400m tower (1152 wide, MLP 4304 = 16 x 269) at tp 2: fc1's shard has 2152
    columns and fc2's 2152 in features, which ``torch._scaled_mm`` refuses on CUDA: both stay,
    though tensorwise float8 would pay at their shapes (N > 1024); of the attention, wo's shard
    (576 -> 1152) converts, wq/wk/wv's (1152 -> 576) do not pay. At tp 1 every layer converts."""
    import dataclasses

    from dtensor_mimo.parallelize.fp8 import convert_to_fp8, fp8_config
    from dtensor_mimo.parallelize.part import tp_weight_splits

    every = {f"layers.0.attn.{w}" for w in ("wq", "wk", "wv", "wo")} | {"layers.0.mlp.fc1", "layers.0.mlp.fc2"}
    for tp, expected in ((2, {"layers.0.attn.wo"}), (1, every)):
        with torch.device("meta"):
            vit = ViT(ViTConfig(image_size=384, patch_size=14, dim=1152, n_layers=1, n_heads=16, mlp_hidden=4304))
        config = dataclasses.replace(fp8_config("vision", "tensorwise", "cpu", False), emulate=False)
        convert_to_fp8(vit, config, "vision", "tensorwise", tp, tp_weight_splits(vit))
        assert set(fp8_layers(vit)) == expected, tp


def test_a_module_with_no_layer_worth_float8_says_so(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Not emulated, the tiny Llama's layers are all too small for float8 to pay: fp8 asked for
    and nothing converted is logged, by the module's name."""
    import dataclasses

    from dtensor_mimo.parallelize import fp8, part

    monkeypatch.setattr(part, "fp8_config", lambda *a: dataclasses.replace(fp8.fp8_config(*a), emulate=False))
    llama = Llama(LLAMA)
    with caplog.at_level("WARNING", logger=part.__name__):
        parallelize(llama, None, None, ParallelOptions(fp8="rowwise"), name="language")
    assert fp8_layers(llama) == []
    assert "fp8='rowwise') for language: none of its Linear layers converts" in caplog.text


class ScaledLinear(nn.Linear):
    """A user's Linear subclass with a forward of its own (twice the plain product)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


class TorchEncoder(nn.Module):
    """A user's encoder of torch's own blocks: ``nn.TransformerEncoderLayer`` (whose attention,
    ``nn.MultiheadAttention``, reads its ``out_proj`` Linear's weight itself, never calling the
    layer), then a `ScaledLinear`."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"0": nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)})
        self.scaled = ScaledLinear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = block(x)
        return self.scaled(x)


def _fp8_torch_encoder(dp: int) -> tuple[list[str], float]:
    """`TorchEncoder` in tensorwise float8, FSDP2 over `dp` ranks (float8 all-gathers) or whole:
    the layers converted, and the relative distance of this rank's output from the fp32 module's."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    plain = TorchEncoder()
    module = TorchEncoder()
    module.load_state_dict(plain.state_dict())
    mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",)) if dp > 1 else None
    parallelize(module, None, mesh, ParallelOptions(fp8="tensorwise"), name="vision")
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    out = module(x)
    out.square().mean().backward()
    want = plain(x)
    return fp8_layers(module), float((out - want).norm() / want.norm())


@pytest.mark.parametrize("dp", [1, 2])
def test_only_plain_linear_layers_convert(dp: int) -> None:
    """A Linear that its owner does not call (``nn.MultiheadAttention``'s ``out_proj``, whose
    weight the attention passes to ``F.linear`` itself) would not run in float8, and under
    FSDP2's float8 all-gather its gathered weight would reach ``F.linear`` as a float8 tensor
    (torchao's bare AssertionError); a Linear subclass's own forward would be replaced by
    ``Float8Linear``'s (here: the factor 2 lost). Both stay as they are; the plain Linear layers
    convert, and the module computes what the fp32 one does, to float8's precision."""
    for converted, distance in run_on_ranks(_fp8_torch_encoder, dp, dp, timeout=120):
        assert converted == ["layers.0.linear1", "layers.0.linear2"], converted
        assert 0 < distance < FP8_TOL, distance


class TiedHead(nn.Module):
    """A user's module whose vocabulary head (not named ``output`` / ``lm_head``) is tied to its
    token embedding: one parameter under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(64, 32)
        self.layers = nn.ModuleDict({"0": nn.Sequential(nn.Linear(32, 32))})
        self.unembed = nn.Linear(32, 64, bias=False)
        self.unembed.weight = self.tok_embeddings.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(ids)
        for block in self.layers.values():
            h = block(h)
        return self.unembed(h)


def _tied_steps(dp: int, recipe: str | None = "tensorwise") -> tuple[list[str], list[float], bool]:
    """`TiedHead` in tensorwise float8, FSDP2 over `dp` ranks (each given its own ids) or in one
    process (all of them), 3 SGD steps on predicting each next id: its parameter names, the
    losses (of all the ids), and
    whether embedding and head are still one tensor."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    module = TiedHead()
    with torch.no_grad():
        module.tok_embeddings.weight.mul_(0.1)
    mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",)) if dp > 1 else None
    parallelize(module, None, mesh, ParallelOptions(fp8=recipe), name="language")
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    ids = torch.arange(32).reshape(4, 8).chunk(dp)[dist.get_rank() if dp > 1 else 0]
    losses = []
    for _ in range(3):
        # FSDP2 sums the ranks' gradients (as the library's losses are normalised): each rank's
        # share of the mean over every id
        loss = nn.functional.cross_entropy(module(ids).flatten(0, 1), ((ids + 1) % 64).flatten(), reduction="sum") / 32
        loss.backward()
        if dp > 1:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    full = [w.full_tensor() if isinstance(w, DTensor) else w for w in (module.tok_embeddings.weight,
                                                                         module.unembed.weight)]
    return [n for n, _ in module.named_parameters()], losses, torch.equal(*full)


def test_tied_weights_stay_tied_under_float8_all_gathers() -> None:
    """torchao wraps a weight all-gathered in float8 (tensorwise under FSDP2) in a new parameter:
    a Linear tied to another parameter would be untied (two parameters, each trained on its own),
    which the single process, where the tie holds, does not do. A tied weight is gathered in its
    own precision and cast after: one parameter, and the one-process fp8 run's losses."""
    (names, one_process, tied), = run_on_ranks(_tied_steps, 1, 1, timeout=120)
    assert names == ["tok_embeddings.weight", "layers.0.0.weight", "layers.0.0.bias"] and tied
    for got_names, losses, got_tied in run_on_ranks(_tied_steps, 2, 2, timeout=120):
        assert got_names == names and got_tied, (got_names, got_tied)
        print(f"tied dp2 vs one process: {losses} vs {one_process}, relative {_relative(losses, one_process)}")
        assert max(_relative(losses, one_process)) < DP_TOL, (losses, one_process)


# ------------------------------------------------------------------ numerics


@pytest.fixture(scope="module")
def fp32() -> list[float]:
    return _losses(_reference(("vision",), False, ()))


@pytest.mark.parametrize("recipes", [{"language": "tensorwise"}, {"language": "rowwise"}, {"vision": "rowwise"}],
                         ids=["language-tensorwise", "language-rowwise", "vision-rowwise"])
def test_fp8_losses_follow_fp32(recipes: dict[str, str], fp32: list[float]) -> None:
    fp8 = _losses(_reference(("vision",), False, (), prepare=_fp8(recipes)))
    errors = _relative(fp8, fp32)
    print(f"fp8 {recipes} vs fp32: {fp8} vs {fp32}, relative {errors}")
    assert max(errors) < FP8_TOL, (fp8, fp32)
    assert max(errors) > 0, "the losses are fp32's bit for bit: no layer ran in float8"


@functools.cache
def _one_process_fp8(recipes: tuple[tuple[str, str], ...]) -> list[float]:
    return _losses(_reference(("vision",), False, (), seq_lens=STEPS, prepare=_fp8(dict(recipes))))


def _distributed_recording_fp8(case: Case) -> tuple[list[dict], list[torch.dtype], int]:
    """`_distributed`, plus the dtypes FSDP2 all-gathered float8-cast weights in and how many
    times the float8 scales were precomputed after an optimizer step, on this rank."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    gathered: list[torch.dtype] = []
    refreshed = [0]
    pre_all_gather = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather
    precompute = float8.precompute_float8_dynamic_scale_for_fsdp

    @functools.wraps(pre_all_gather)  # FSDP2 reads its signature
    def recording_pre_all_gather(self, *args, **kwargs):
        out = pre_all_gather(self, *args, **kwargs)
        gathered.append(out[0][0].dtype)
        return out

    def recording_precompute(module: nn.Module) -> None:
        refreshed[0] += 1
        precompute(module)

    WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = recording_pre_all_gather
    float8.precompute_float8_dynamic_scale_for_fsdp = recording_precompute
    try:
        return _distributed(case), gathered, refreshed[0]
    finally:
        WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = pre_all_gather
        float8.precompute_float8_dynamic_scale_for_fsdp = precompute


@pytest.mark.parametrize("name", list(DISTRIBUTED))
def test_distributed_fp8_matches_one_process_fp8(name: str) -> None:
    case = DISTRIBUTED[name]
    one_process_fp8 = _one_process_fp8(tuple((n, o.fp8) for n, o in sorted(case.options.items())))
    per_rank = run_on_ranks(_distributed_recording_fp8, case.layout().world_size, case, timeout=180)
    for records, gathered, refreshed in per_rank:
        losses = _losses(records)
        errors = _relative(losses, one_process_fp8)
        print(f"{name} fp8 vs one-process fp8: {losses} vs {one_process_fp8}, relative {errors}")
        assert max(errors) < DP_TOL, (losses, one_process_fp8)
        steps = len(records)
        assert refreshed == steps  # the tensorwise module, once after each optimizer step
        (tensorwise,) = [n for n, o in case.options.items() if o.fp8 == "tensorwise"]
        if case.layout().parallelism(tensorwise).dp > 1:  # FSDP2: tensorwise weights gathered in float8
            assert gathered and set(gathered) == {torch.float8_e4m3fn}, gathered
        else:
            assert not gathered


def _fp8_checkpoints(root: str, name: str) -> tuple[list[list[float]], list[str]]:
    """Case `name`'s model saved after step 1 both ways and after step 2 in the background (into
    the first background save's host buffers); the losses of the steps after each save, in the
    run and in a model built anew from each checkpoint; the checkpoints' paths."""
    import os

    from dtensor_mimo import MimoOptimizer, train_step
    from dtensor_mimo.train import checkpoint
    from tests.test_mimo import OPT, _batches

    case = DISTRIBUTED[name]

    def build() -> tuple[MimoModel, MimoOptimizer]:
        layout = case.layout()
        layout.init_meshes("cpu")
        llama, encoders = _modules(case.encoders, case.frozen, case.n_layers)
        model = MimoModel(layout, llama, encoders, options=case.options)
        model.init_weights({"language": 0, "vision": 1})
        return model, MimoOptimizer(model, OPT)

    batches = _batches(case.encoders, case.packed, case.batch_size, (64, 64, 64))
    model, optimizer = build()
    saves = checkpoint.BackgroundSaves()
    train_step(model, optimizer, batches[0])
    synchronous = checkpoint.save(os.path.join(root, "sync"), 1, model, optimizer, {"step": 1, "updates": 1}, keep=2)
    saves.start(os.path.join(root, "async"), 1, model, optimizer, {"step": 1, "updates": 1}, keep=2)
    run = [train_step(model, optimizer, batches[1]).loss]
    first = saves.finish()
    saves.start(os.path.join(root, "async"), 2, model, optimizer, {"step": 2, "updates": 2}, keep=2)
    run.append(train_step(model, optimizer, batches[2]).loss)
    second = saves.finish()
    shapes = {f"model.{m}.{n}": tuple(p.shape) for m in model.module_names
              for n, p in model.module_parameters(m).items()}
    losses = [run]
    for path, after in ((synchronous, 1), (first, 1), (second, 2)):
        model, optimizer = build()
        checkpoint.load(path, model, optimizer, shapes)
        losses.append([train_step(model, optimizer, b).loss for b in batches[after:]])
    return losses, [synchronous, second]


# Reads every tensor of a checkpoint into one file without torchao imported (DCP's own converter).
READ_WITHOUT_TORCHAO = """import sys
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
assert not [m for m in sys.modules if m.startswith("torchao")]
"""


@pytest.mark.parametrize("name", ["fsdp", "tp"])
def test_fp8_checkpoints_resume_the_run_exactly(tmp_path, name: str) -> None:
    import subprocess

    for (run, synchronous, first, second), paths in run_on_ranks(_fp8_checkpoints, 2, str(tmp_path), name,
                                                                 timeout=180):
        assert synchronous == run and first == run and second == run[1:], (run, synchronous, first, second)
    for path in paths:  # float8 weights are stored as their plain tensors
        out = subprocess.run([sys.executable, "-c", READ_WITHOUT_TORCHAO, path, str(tmp_path / "all.pt")],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]


def _fp8_weights_rewritten(root: str) -> list[tuple[str, float, float]]:
    """The fsdp case's language model (tensorwise, float8 all-gathers), vision frozen: after a
    step (which precomputes every float8 weight's scale), its weights rewritten by `load_hf` (a
    Llama at 5x the init's scale), then by `init_weights`, then by `checkpoint.load_model` (the
    load_hf weights again); the `predict` loss after each,
    and that of a model built anew and given the same weights without a step before."""
    import os

    import torch.distributed as dist

    from dtensor_mimo import MimoOptimizer, train_step
    from dtensor_mimo.models import save_hf
    from tests.test_mimo import OPT, _batches, _seeds

    case = dataclasses.replace(DISTRIBUTED["fsdp"], frozen=("vision",),
                               options={"language": ParallelOptions(fp8="tensorwise")})
    batches = _batches(case.encoders, case.packed, case.batch_size, case.seq_lens)
    hf = Llama(LLAMA)
    hf.init_weights(7)
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(5.0)
    if dist.get_rank() == 0:
        save_hf(hf, os.path.join(root, "hf"))
    dist.barrier()

    def build() -> MimoModel:
        layout = case.layout()
        layout.init_meshes("cpu")
        return MimoModel(layout, *_modules(case.encoders, case.frozen), options=case.options)

    from dtensor_mimo.train import checkpoint

    # a checkpoint of the load_hf weights (5x the init's scale), read back weights-only last
    donor = build()
    donor.load_hf({"language": os.path.join(root, "hf")})
    saved = checkpoint.save(os.path.join(root, "ckpt"), 1, donor, MimoOptimizer(donor, OPT), {"step": 0}, keep=1)
    language, encoders = _modules(case.encoders, case.frozen)
    shapes = checkpoint.expected_shapes({**encoders, "language": language})
    model = build()
    train_step(model, MimoOptimizer(model, OPT), batches[0])
    out = []
    for what, write in (("load_hf", lambda m: m.load_hf({"language": os.path.join(root, "hf")})),
                        ("init_weights", lambda m: m.init_weights(_seeds(case.encoders))),
                        ("checkpoint.load_model", lambda m: checkpoint.load_model(saved, m, shapes))):
        write(model)
        fresh = build()
        write(fresh)
        out.append((what, model.predict(batches[1], with_loss=True)[1], fresh.predict(batches[1], with_loss=True)[1]))
    return out


def test_weights_rewritten_after_a_step_get_their_own_float8_scales(tmp_path) -> None:
    """A step leaves each float8 weight's precomputed scale (`refresh_fp8_scales`), which the next
    all-gather casts with: `load_hf` and `init_weights` compute the new weights' scales, as
    `checkpoint.load` does and `checkpoint.load_model` (a weights-only start), so the model computes
    what one given those weights anew does."""
    for per_rank in run_on_ranks(_fp8_weights_rewritten, 2, str(tmp_path), timeout=180):
        for what, got, fresh in per_rank:
            assert got == fresh, (what, got, fresh)


class ColwiseLinear(nn.Module):
    """One Linear layer with its own tp plan (column-parallel), as a user's module gives one."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)

    def parallelize(self, tp_mesh, options: ParallelOptions) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        parallelize_module(self, tp_mesh, {"proj": ColwiseParallel()})


def _fp8_rank_without_rows() -> tuple[list[int], float]:
    """A tensorwise float8 layer, tp2 (column-parallel) under FSDP2 over dp2: its weight is
    all-gathered in float8 inside a tp DTensor. Run once with dp rank 1 given no rows, once with
    both dp ranks given dp rank 0's: the first run's output shape on this rank, and the relative
    distance of its summed weight gradient from half the second's (what dp rank 0 adds)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x, grads, shapes = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)), [], []
    for without in (True, False):
        torch.manual_seed(0)
        layer = parallelize(ColwiseLinear(), mesh["tp"], mesh["dp"], ParallelOptions(fp8="tensorwise"))
        out = layer(x[:0] if without and mesh.get_coordinate()[0] == 1 else x)  # this tp rank's columns
        out.square().sum().backward()
        grads.append(layer.proj.weight.grad.full_tensor())
        shapes.append(list(out.shape))
    return shapes[0], float((grads[0] - grads[1] / 2).norm() / grads[0].norm())


def test_a_float8_rank_without_rows_under_tp_and_fsdp() -> None:
    """The weight FSDP2 gathers in float8 comes inside a tp DTensor: a rank without rows takes it
    back to high precision there too, and its gradient adds nothing to dp rank 0's."""
    per_rank = run_on_ranks(_fp8_rank_without_rows, 4, timeout=120)
    assert [shape for shape, _ in per_rank] == [[8, 8], [8, 8], [0, 8], [0, 8]], per_rank
    assert all(distance < 1e-6 for _, distance in per_rank), per_rank


def _pad_inner_dims() -> dict[str, set[bool]]:
    """Each module's float8 layers' ``pad_inner_dim``, as `MimoModel` builds them (one rank)."""
    llama, encoders = _modules(("vision",))
    fp8 = ParallelOptions(fp8="tensorwise")
    model = MimoModel(MimoLayout({"vision": Parallelism(), "language": Parallelism()},
                                 offsets={"vision": 0, "language": 0}),
                      llama, encoders, options={"vision": fp8, "language": fp8})
    pads: dict[str, set[bool]] = {}
    for name, m in model.named_modules():
        if isinstance(m, float8.float8_linear.Float8Linear):
            pads.setdefault("vision" if "vision" in name else "language", set()).add(m.config.pad_inner_dim)
    return pads


def test_an_encoders_float8_matmuls_take_any_number_of_rows() -> None:
    """An encoder's rows per call vary with its items; its weight gradient's float8 matmul has
    them as inner dim, which CUDA's ``torch._scaled_mm`` takes only in multiples of 16 (980 rows
    of 5 images of 196 patches would fail on the ranks holding them, their dp peers waiting): the
    encoder pads them (torchao's ``pad_inner_dim``); the language model's rows keep no padding
    copy. (The shape rule itself needs a GPU: `benchmarks/gpu.py`.)"""
    assert run_on_ranks(_pad_inner_dims, 1, timeout=120) == [{"vision": {True}, "language": {False}}]


# ------------------------------------------------------------------ errors


def test_misspelt_recipe_is_refused() -> None:
    with pytest.raises(ValueError, match=r"fp8='rowwize' must be one of 'tensorwise', 'rowwise'"):
        ParallelOptions(fp8="rowwize")
    with pytest.raises(ConfigError, match=r"options.language.fp8 = 'rowwize': expected one of 'tensorwise', 'rowwise'"):
        parse_args(["--options.language.fp8", "rowwize"])
    config = parse_args(["--options.language.fp8", "rowwise"])  # the language model alone
    assert config.module_options("language").fp8 == "rowwise" and config.module_options("vision").fp8 is None


def _build(device_type: str = "cpu") -> None:
    """A `MimoModel` with fp8 on the language model; every test process lacks a process group,
    so an fp8 error raised here was raised before any collective."""
    llama, encoders = _modules(("vision",))
    layout = MimoLayout({"vision": P(), "language": P()}, offsets={"vision": 0, "language": 0})
    MimoModel(layout, llama, encoders, options={"language": ParallelOptions(fp8="rowwise")}, device_type=device_type)


def test_fp8_without_torchao_names_the_module_and_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.setitem(sys.modules, module, None)  # `import torchao...` now fails
    with pytest.raises(ImportError, match=r"module 'language' needs torchao.*pip install 'dtensor_mimo\[fp8\]'"):
        _build()
    with pytest.raises(ImportError, match=r"module 'Llama' needs torchao"):
        parallelize(Llama(LLAMA), None, None, ParallelOptions(fp8="tensorwise"))


def test_gpu_without_fp8_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(RuntimeError, match=r"fp8='rowwise'\) for module 'language': NVIDIA A100-SXM4-80GB has "
                                           r"compute capability 8.0, float8 matmuls need 8.9"):
        _build("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8("language", "tensorwise", "cuda")  # an H100 passes


def test_float8_all_gathers_take_uneven_fsdp_shards() -> None:
    """dp 3 (the library's own example splits an encoder over 3 ranks): the tiny models' Linear
    rows (16, 32, 64) do not split evenly over 3 FSDP2 shards, which torchao's float8 all-gather
    cannot take (it sends the unpadded shard: a collective size mismatch, gloo aborts the rank
    with the short shard and its peers wait). Such weights are all-gathered in their own precision
    and cast to float8 after: the losses are the one-process fp8 run's."""
    case = Case({"vision": P(dp=3), "language": P(dp=3)}, offsets={"vision": 0, "language": 0}, seq_lens=STEPS,
                options={"vision": ParallelOptions(fp8="tensorwise"), "language": ParallelOptions(fp8="tensorwise")})
    one_process_fp8 = _one_process_fp8((("language", "tensorwise"), ("vision", "tensorwise")))
    for records in run_on_ranks(_distributed, 3, case, timeout=180):
        losses = _losses(records)
        assert max(_relative(losses, one_process_fp8)) < DP_TOL, (losses, one_process_fp8)


@pytest.mark.parametrize("batch_size,seq_len,microbatches,dp,cp,bad", [
    (4, 64, 1, 2, 1, None),          # 2 x 64 = 128 rows a call
    (5, 72, 1, 2, 1, [216]),         # dp shards of 3 and 2: 216 rows (off), 144 (a multiple of 16)
    (4, 72, 2, 1, 1, None),          # 2 x 72 = 144
    (3, 72, 1, 2, 1, [72]),          # 2 x 72 = 144, 1 x 72 = 72 (off)
    (2, 72, 1, 4, 1, [72]),          # empty shards run a stand-in sample: 72 rows
    (4, 72, 1, 2, 2, [72]),          # cp 2: chunks of 36, 2 x 36 = 72 (off)
    (5, 96, 3, 2, 2, None),          # chunks of 48: any count fits
])
def test_float8_language_rows_a_call_on_cuda(batch_size, seq_len, microbatches, dp, cp, bad) -> None:
    """The language model's float8 weight gradients take a call's rows (a dp rank's samples of a
    microbatch x its cp chunk) as their matmuls' inner dim, which CUDA's ``_scaled_mm`` takes
    only in multiples of 16: a batch that gives some dp rank another count is refused (by its
    shape, on every rank alike), naming the counts and the seq_len that fits. Hand-counted rows."""
    from dtensor_mimo.parallelize.fp8 import fp8_rows_problem

    problem = fp8_rows_problem(batch_size, seq_len, microbatches, dp, cp)
    if bad is None:
        assert problem is None
    else:
        assert problem is not None and f"calls of {bad} rows" in problem and f"a multiple of {16 * cp}" in problem


def _fp8_language_rows_on_cuda() -> str:
    """Language dp2 in float8 (emulated here), as on CUDA (`MimoModel._fp8_rows`): a training run on
    3 samples of 72 tokens (dp shards of 2 and 1: 144 and 72 rows) is refused before it starts."""
    fp8 = {"language": ParallelOptions(fp8="tensorwise")}
    layout = MimoLayout.colocated({"vision": Parallelism(dp=2), "language": Parallelism(dp=2)})
    model = MimoModel(layout, *_modules(("vision",)), options=fp8)
    model._fp8_rows = True
    from tests.test_mimo import _batches

    try:
        model.forward_backward(_batches(("vision",), False, 3, (72,))[0])
    except ValueError as e:
        return str(e)
    return ""


def test_float8_language_rows_off_sixteen_are_refused_on_every_rank() -> None:
    pytest.importorskip("torchao")
    messages = run_on_ranks(_fp8_language_rows_on_cuda, 2, timeout=120)
    assert all("calls of [72] rows" in m for m in messages), messages
