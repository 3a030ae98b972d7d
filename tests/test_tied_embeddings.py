"""Tied input/output embeddings (`LlamaConfig.tie_embeddings`, transformers' tie_word_embeddings:
Qwen2 0.5B, Qwen2.5 0.5B-3B, Llama 3.2 1B / 3B) train as one parameter, as transformers trains
them. The checkpoint is a tiny random transformers Llama with tied embeddings (tests/test_hf.py's
``llama3.2_tied``).

| test_...                                 | layout (ranks)                                   | against  |
|------------------------------------------|--------------------------------------------------|----------|
| one_step_matches_transformers_tied       | language alone (1)                               | HF       |
| tied_trains_like_one_process[tp_sp]      | vision dp2 (0-1), language tp2 + sp (2-3), meta  | oracle   |
| tied_trains_like_one_process[fsdp_dp2]   | vision (0), language dp2 FSDP2 (1-2)             | oracle   |
| ...[coloc_tp_compiled]                   | vision dp2, language tp2 + sp compiled (0-1)     | oracle   |
| ...[meta_one_rank]                       | vision and language (0), meta, plain tensors     | oracle   |
| ...[hsdp]                                | vision dp4, language dp4 HSDP 2x2 (0-3)          | oracle   |
| trained_tied_export_loads_in_transformers | language alone (1), one step, `save_hf`         | HF       |
| float8_keeps_the_tie                     | language dp2 FSDP2, fp8 tensorwise (emulated)    | fp32 run |
| pipeline_stages_keep_two_copies          | language pp2 (0-1), meta, `MimoModel.load_hf`    | untied   |
| tp_keeps_a_user_modules_tie_refused      | (pure)                                           | refusal  |
| fsdp2_keeps_ties_within_one_unit         | (pure)                                           | refusal  |
| a_head_untied_for_stages_starts_as_...   | (pure)                                           | seeds    |
| a_frozen_tied_head_untied_for_stages_... | (pure)                                           | frozen   |
| the_trainer_trains_a_tied_directory_tied | the tiny LLaVA task, its decoder made tied (1)   | HF       |
| a_tied_checkpoint_resumes_at_pp2_as_...  | saved tied (1), resumed at language pp2 (0-1)    | oracle1  |
| a_pp2_checkpoint_of_equal_copies_...     | saved at pp2 (0-1), resumed tied at dp2 (0-1)    | oracle1  |
| a_tied_checkpoint_resumes_in_two_stages_... | saved tied (1), resumed pp1 x virtual 2 (1)   | oracle1  |
| a_frozen_tied_embeddings_checkpoint_...  | saved tied, embedding frozen (1), pp1 x v2 (1)   | oracle1  |

HF: transformers' tied model (one step: loss, grad norm, every gradient, the tied one the sum of
both uses, the weights after AdamW given the library's no-decay rule; an export: loaded tied, no
lm_head tensor, the same logits and greedy tokens; the trainer: one DCP key, a tied LLaVA export).
oracle: the single-process tied model (tests/test_mimo.py's `check_against_reference`); tp_sp's
vocab-parallel loss and fsdp_dp2's chunked head run on the loss rows only, both predict;
coloc_tp_compiled gathers its logits. fp32 run: one parameter still, the loss within 2%.
untied: a warning naming the module, and an untied one-process model whose head is the
checkpoint's embedding (loss, both gradients). refusal: a user's tie stays refused under tp.
seeds: the head's copy draws the embedding's seed. frozen: the head's copy of a frozen tie is frozen.
oracle1: one process, plain torch AdamW: the tied model's steps, then (at pp2) the head and its
AdamW state made copies of the embedding's: each step's loss and the weights after; copies that
trained apart are refused tied on every rank, by name.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor

from dtensor_mimo import (AdamWConfig, MimoLayout, MimoModel, MimoOptimizer, ParallelOptions, Parallelism,
                          PipelineConfig, train_step)
from dtensor_mimo.data import IGNORE_INDEX, SyntheticSpec, synthetic_batch
from dtensor_mimo.models import Llama, LlamaConfig, load_hf, save_hf
from dtensor_mimo.models.hf.safetensors import SafetensorsDir
from tests.harness import needs_torch, run_on_ranks
from tests.test_hf import _write
from tests.test_mimo import Case, check_against_reference

transformers = pytest.importorskip("transformers")

P = Parallelism
# The library's default no-decay rule (embeddings, norms): the tied weight takes no decay
ADAMW = AdamWConfig(lr=1e-2, eps=1e-3, weight_decay=0.1, max_grad_norm=None)
BATCH = SyntheticSpec.tiny(modalities={}, batch_size=4, seq_len=32)
PROMPT, NEW_TOKENS = 8, 4  # generation: each row's first 8 tokens, 4 new ones


def _batch(seed: int = 3):
    return synthetic_batch(BATCH, seed)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _language_step(path: str, par: Parallelism, microbatches: int | None = None,
                   options: ParallelOptions = ParallelOptions(), meta: bool = False) -> dict:
    """One `train_step` of a language-only `MimoModel` built from the checkpoint at `path` on
    layout `par` (`meta`: built on the meta device, then `MimoModel.load_hf`): the loss, grad
    norm, this rank's gradients and weights (full), whether its stages hold the head as the
    embedding, the warnings the build gave, and `PROMPT`'s greedy continuation by the trained
    model (`MimoModel.generate`)."""
    layout = MimoLayout({"language": par})
    layout.init_meshes("cpu")
    with torch.device("meta" if meta else "cpu"):
        llama = Llama(LlamaConfig.from_hf(path))
    if not meta:
        load_hf(llama, path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = MimoModel(layout, llama, {}, options={"language": options},
                          pipeline=None if microbatches is None else PipelineConfig(microbatches=microbatches))
    if meta:
        model.init_weights({"language": 0})
        model.load_hf({"language": path})
    optimizer = MimoOptimizer(model, ADAMW)
    metrics = train_step(model, optimizer, _batch())
    params = model.module_parameters("language")
    return dict(loss=metrics.loss, grad_norm=metrics.grad_norm, grads={n: _full(p.grad) for n, p in params.items()},
                weights={n: _full(p) for n, p in params.items()},
                tied=[s.llama.output.weight is s.llama.tok_embeddings.weight for s in model.language_stages
                      if s.llama.output is not None and s.llama.tok_embeddings is not None],
                warnings=[str(w.message) for w in caught], world=dist.get_world_size(),
                generated=model.generate(_batch(), [PROMPT] * BATCH.batch_size, NEW_TOKENS))


def _hf_loss(hf: torch.nn.Module, batch) -> torch.Tensor:
    """The library's loss (token-weighted over the batch's loss tokens) on transformers' logits."""
    logits = hf(input_ids=batch.tokens, position_ids=batch.positions).logits
    weight = torch.where(batch.labels == IGNORE_INDEX, 0.0, batch.loss_mask).flatten()
    ce = F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten(), ignore_index=IGNORE_INDEX,
                         reduction="none")
    return (ce * weight).sum() / weight.sum()


def _as_library(hf: torch.nn.Module, tensors: dict[str, torch.Tensor], path: str) -> dict[str, torch.Tensor]:
    """`tensors` (a value per transformers parameter) in the library's names and layout: written
    as a transformers checkpoint and read by `load_hf` (the rotary permutation included)."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(tensors[name])
    hf.save_pretrained(path)
    llama = Llama(LlamaConfig.from_hf(path))
    load_hf(llama, path)
    return {n: p.detach().clone() for n, p in llama.named_parameters()}


def test_one_step_matches_transformers_tied(tmp_path) -> None:
    path = str(tmp_path / "hf")
    hf = _write(path, "llama3.2_tied")
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    (got,) = run_on_ranks(_language_step, 1, path, P(), timeout=120)
    assert got["tied"] == [True] and got["warnings"] == []
    assert "output.weight" not in got["grads"]  # one parameter, under its first name

    hf.train()
    batch = _batch()
    loss = _hf_loss(hf, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in hf.named_parameters()}
    norm = torch.nn.utils.get_total_norm(list(grads.values()))
    # transformers' AdamW, given the library's rule: no decay for embeddings and 1-d parameters
    decay = [p for n, p in hf.named_parameters() if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in hf.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    assert any(p is hf.model.embed_tokens.weight for p in rest)
    torch.optim.AdamW([{"params": decay, "weight_decay": ADAMW.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                      lr=ADAMW.lr, betas=ADAMW.betas, eps=ADAMW.eps).step()
    stepped = {n: p.detach().clone() for n, p in hf.named_parameters()}

    assert got["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert got["grad_norm"] == pytest.approx(norm.item(), rel=1e-5)
    want_grads = _as_library(hf, grads, str(tmp_path / "grads"))
    want_weights = _as_library(hf, stepped, str(tmp_path / "stepped"))
    assert want_grads.keys() == got["grads"].keys()
    for name, want in want_grads.items():
        torch.testing.assert_close(got["grads"][name], want, rtol=1e-4, atol=1e-6, msg=lambda m: f"grad {name}: {m}")
        torch.testing.assert_close(got["weights"][name], want_weights[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"weight {name}: {m}")


TIED_CASES = {
    "tp_sp": lambda path: Case({"vision": P(dp=2), "language": P(tp=2)}, options={"language": ParallelOptions(sp=True)},
                               meta=True, language_hf=path, loss_chunk_rows=16, predict=True),
    "fsdp_dp2": lambda path: Case({"vision": P(), "language": P(dp=2)}, language_hf=path, loss_chunk_rows=16,
                                  predict=True),
    "coloc_tp_compiled": lambda path: Case(
        {"vision": P(dp=2), "language": P(tp=2)}, offsets={"vision": 0, "language": 0},
        options={"language": ParallelOptions(sp=True, compile=True, loss_parallel=False)}, language_hf=path),
    "meta_one_rank": lambda path: Case({"vision": P(), "language": P()}, offsets={"vision": 0, "language": 0},
                                       meta=True, language_hf=path),
    "hsdp": lambda path: Case({"vision": P(dp=4), "language": P(dp=4, dp_replicate=2)},
                              offsets={"vision": 0, "language": 0}, meta=True, language_hf=path),
}


@pytest.mark.parametrize("name", list(TIED_CASES))
def test_tied_trains_like_one_process(name: str, tmp_path) -> None:
    """The tied weight's gradient is both uses' summed over the layout (tp: vocab shards of one
    DTensor; FSDP2: one shared parameter of the root), as in the single-process tied model."""
    path = str(tmp_path / "hf")
    _write(path, "llama3.2_tied", num_attention_heads=8, num_key_value_heads=4)
    check_against_reference(TIED_CASES[name](path))


def test_trained_tied_export_loads_in_transformers(tmp_path) -> None:
    path, out = str(tmp_path / "hf"), str(tmp_path / "out")
    _write(path, "llama3.2_tied")
    (got,) = run_on_ranks(_language_step, 1, path, P(), timeout=120)
    llama = Llama(LlamaConfig.from_hf(path))
    with torch.no_grad():
        for n, p in llama.named_parameters():
            p.copy_(got["weights"][n])
    save_hf(llama, out)
    assert "lm_head.weight" not in SafetensorsDir(out).names()
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert back.config.tie_word_embeddings and back.lm_head.weight is back.model.embed_tokens.weight
    tokens = _batch().tokens
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, llama(tokens), rtol=0, atol=1e-5)
        ids = tokens[:, :PROMPT]
        for _ in range(NEW_TOKENS):  # transformers' greedy decoding of the exported model
            ids = torch.cat([ids, back(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert got["generated"] == ids[:, PROMPT:].tolist()
    assert LlamaConfig.from_hf(out).tie_embeddings


def test_float8_keeps_the_tie(tmp_path) -> None:
    """fp8 (tensorwise, emulated on the CPU) with FSDP2's float8 all-gathers over dp2: the head
    stays in the compute dtype (`KEPT_HEADS`), so the tied weight is gathered in its own
    precision and stays one parameter; the blocks' float8 matmuls move the loss a little."""
    path = str(tmp_path / "hf")
    _write(path, "llama3.2_tied")
    (one,) = run_on_ranks(_language_step, 1, path, P(), timeout=120)
    for got in run_on_ranks(_language_step, 2, path, P(dp=2), None, ParallelOptions(fp8="tensorwise"), timeout=180):
        assert got["tied"] == [True] and "output.weight" not in got["grads"]
        assert got["loss"] == pytest.approx(one["loss"], rel=2e-2)


def test_pipeline_stages_keep_two_copies(tmp_path) -> None:
    """pp2: the embedding on the first stage, the head on the last; the head becomes a copy of the
    embedding (read from the checkpoint's embedding) that trains on its own, said by name once in
    the world (rank 0), not once per rank."""
    path = str(tmp_path / "hf")
    _write(path, "llama3.2_tied")
    per_rank = run_on_ranks(_language_step, 2, path, P(pp=2), 2, ParallelOptions(), True, timeout=180)
    said = [[w for w in r["warnings"] if "language model 'language' with pp=2" in w] for r in per_rank]
    assert [len(s) for s in said] == [1, 0], said  # once in the world: rank 0's
    for r in per_rank:
        assert r["tied"] == []
    grads = {n: g for r in per_rank for n, g in r["grads"].items()}
    assert {"tok_embeddings.weight", "output.weight"} <= grads.keys()

    untied = Llama(dataclasses.replace(LlamaConfig.from_hf(path), tie_embeddings=False))
    load_hf(untied, path)  # both from the checkpoint's embedding
    torch.testing.assert_close(untied.output.weight, untied.tok_embeddings.weight, rtol=0, atol=0)
    batch = _batch()
    logits = untied(batch.tokens, positions=batch.positions)
    weight = torch.where(batch.labels == IGNORE_INDEX, 0.0, batch.loss_mask).flatten()
    loss = (F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX,
                            reduction="none") * weight).sum() / weight.sum()
    loss.backward()
    assert per_rank[0]["loss"] == pytest.approx(loss.item(), rel=1e-5)
    for name, p in untied.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"grad {name}: {m}")


def test_tp_keeps_a_user_modules_tie_refused() -> None:
    """The library's tied Llama passes the tp check (its plan re-ties the head); any other tie of
    a module is refused by name, as before (tests/test_parallelize.py runs it on ranks)."""
    from dtensor_mimo.parallelize.part import check_tp_sizes

    check_tp_sizes("language", Llama(LlamaConfig.tiny(tie_embeddings=True)), 2)
    other = Llama(LlamaConfig.tiny())
    other.layers["1"].attention.wk.weight = other.layers["0"].attention.wk.weight
    with pytest.raises(ValueError, match=r"tied parameters \(layers.0.attention.wk.weight = "
                                         r"layers.1.attention.wk.weight"):
        check_tp_sizes("language", other, 2)


def test_fsdp2_keeps_ties_within_one_unit() -> None:
    """FSDP2 shards each block (and the root) on its own: a parameter tied across two blocks, or
    a block and the root, is refused by name before any process group wherever FSDP2 shards the
    module (torch 2.13 raised it inside fully_shard, on the language ranks alone); a tie within
    one block, the library's tied head (both in the root), and fsdp=False pass."""
    from dtensor_mimo.schedule.checks import check_model

    layout = MimoLayout({"language": Parallelism(dp=2)})
    check_model(layout, Llama(LlamaConfig.tiny(tie_embeddings=True)), {}, "language", {}, None)
    across = Llama(LlamaConfig.tiny())
    across.layers["1"].attention.wk.weight = across.layers["0"].attention.wk.weight
    with pytest.raises(ValueError, match=r"tied parameters \(layers.0.attention.wk.weight \(in layers.0\) = "
                                         r"layers.1.attention.wk.weight \(in layers.1\).* different FSDP2 units with "
                                         r"fsdp over dp·cp = 2"):
        check_model(layout, across, {}, "language", {}, None)
    check_model(layout, across, {}, "language", {"language": ParallelOptions(fsdp=False)}, None)
    check_model(MimoLayout({"language": Parallelism()}), across, {}, "language", {}, None)
    root = Llama(LlamaConfig.tiny())
    root.layers["1"].ffn_norm.weight = root.norm.weight
    with pytest.raises(ValueError, match=r"\(layers.1.ffn_norm.weight \(in layers.1\) = norm.weight \(in the root\)"):
        check_model(layout, root, {}, "language", {}, None)
    within = Llama(LlamaConfig.tiny())
    within.layers["0"].attention.wk.weight = within.layers["0"].attention.wv.weight
    check_model(layout, within, {}, "language", {}, None)


ONE_RANK_STAGES = needs_torch((2, 13), "two language stages on one rank are refused by name (gloo refuses the "
                                        "stage set-up's send to itself)")


def _tied_copy(tiny: str) -> str:
    """The tiny LLaVA task's Qwen2 decoder as a tied checkpoint (tie_word_embeddings, no lm_head
    tensor: as Qwen2.5-0.5B's directory), beside it."""
    from safetensors.torch import load_file, save_file

    src, dst = os.path.join(tiny, "ckpt", "lm"), os.path.join(tiny, "ckpt", "lm_tied")
    shutil.copytree(src, dst)
    config = json.load(open(os.path.join(dst, "config.json")))
    json.dump({**config, "tie_word_embeddings": True}, open(os.path.join(dst, "config.json"), "w"))
    (file,) = glob.glob(os.path.join(dst, "*.safetensors"))
    tensors = load_file(file)
    del tensors["lm_head.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    return "ckpt/lm_tied"


def test_the_trainer_trains_a_tied_directory_tied(tmp_path) -> None:
    """``model.language.hf`` of a tied directory: the trainer's decoder is tied, its DCP checkpoint
    holds the one tensor, and its LLaVA export is tied (no lm_head tensor) and loads in
    transformers with the head as the embedding."""
    pytest.importorskip("PIL")
    from tests.harness import DistributedTestFailure
    from tests.test_train_llava import ORACLE, _run, make

    tiny = str(tmp_path / "tiny")
    make.write_checkpoints(tiny)
    make.write_data(tiny, train=64, val=16, audio_train=8, audio_val=8)
    lm = _tied_copy(tiny)
    out, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    _run(tiny, [*ORACLE, "--train.steps", "2", "--layout.language.offset", "0", "--model.language.hf", lm,
                "--checkpoint.export_hf", out, "--checkpoint.dir", ckpt, "--checkpoint.every", "2"])
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["tie_word_embeddings"] and config["text_config"]["tie_word_embeddings"]
    assert not [n for n in SafetensorsDir(out).names() if n.endswith("lm_head.weight")]
    llava = transformers.LlavaForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
    assert llava.lm_head.weight is llava.get_input_embeddings().weight
    (step,) = glob.glob(os.path.join(ckpt, "step*"))
    keys = FileSystemReader(step).read_metadata().state_dict_metadata
    assert "model.language.tok_embeddings.weight" in keys and "model.language.output.weight" not in keys
    # `model.language.untie_embeddings`: two copies (as runs before tied training, whose checkpoints
    # hold both); the tied run's checkpoint resumes so, both copies from its one tensor
    untied = [*ORACLE, "--train.steps", "3", "--layout.language.offset", "0", "--model.language.hf", lm,
              "--checkpoint.export_hf", "none", "--model.language.untie_embeddings", "true"]
    _run(tiny, [*untied, "--checkpoint.dir", ckpt, "--checkpoint.every", "1"])
    step = os.path.join(ckpt, "step-000003")
    keys = FileSystemReader(step).read_metadata().state_dict_metadata
    assert "model.language.tok_embeddings.weight" in keys and "model.language.output.weight" in keys
    # the copies trained apart: resuming them tied is refused by name
    with pytest.raises(DistributedTestFailure, match=r"holds model.language.output.weight apart from "
                                                     r"model.language.tok_embeddings.weight and they differ"):
        _run(tiny, [*ORACLE, "--train.steps", "4", "--layout.language.offset", "0", "--model.language.hf", lm,
                    "--checkpoint.export_hf", "none", "--checkpoint.dir", ckpt])


def test_a_head_untied_for_stages_starts_as_the_embedding() -> None:
    """`untie_embeddings` (the pipeline split): the head's copy is drawn from the embedding's seed,
    so a seeded pp run starts from the single-process tied model's weights; a tied model draws
    its one parameter once."""
    from dtensor_mimo.models.llama import untie_embeddings

    tied = Llama(LlamaConfig.tiny(tie_embeddings=True))
    tied.init_weights(0)
    with pytest.warns(UserWarning, match="a pipeline split: the tied output head"):
        untie_embeddings(tied, "a pipeline split")
    assert tied.output.weight is not tied.tok_embeddings.weight and not tied.config.tie_embeddings
    tied.init_weights(3)
    torch.testing.assert_close(tied.output.weight, tied.tok_embeddings.weight, rtol=0, atol=0)
    plain = Llama(LlamaConfig.tiny())
    plain.init_weights(3)
    torch.testing.assert_close(plain.tok_embeddings.weight, tied.tok_embeddings.weight, rtol=0, atol=0)


def test_a_frozen_tied_head_untied_for_stages_stays_frozen() -> None:
    """A frozen tied decoder (``requires_grad_(False)``: model.language.frozen) cut into stages: the
    head's copy is frozen too, as the one tied parameter was; a trainable one stays trainable."""
    from dtensor_mimo.models.llama import untie_embeddings

    for trains in (False, True):
        llama = Llama(LlamaConfig.tiny(tie_embeddings=True)).requires_grad_(trains)
        with pytest.warns(UserWarning, match="a pipeline split"):
            untie_embeddings(llama, "a pipeline split")
        assert llama.output.weight.requires_grad is trains and llama.tok_embeddings.weight.requires_grad is trains


# ---------------------------------------------------------------------------- a checkpoint's tie across layouts


def _checkpoint_step(path: str, par: Parallelism, microbatches: int | None, ckpt: str, load: str | None,
                     steps: int, model_only: bool = False, virtual_stages: int = 1, frozen: bool = False) -> dict:
    """A language-only `MimoModel` of the tied checkpoint at `path` on layout `par` (`virtual_stages`
    > 1: an Interleaved1F1B schedule of that many stages a pp rank; `frozen`: the tied embedding
    frozen, so trained without AdamW state): loads the DCP checkpoint `load`
    (all of it, or with `model_only` its weights alone: `load_model`) and reports the weights it got;
    then `steps` steps on `_batch(4 + i)` (i counted from the loaded step), saving the checkpoint of
    the last one to `ckpt`, the loss of each step and the weights after (full)."""
    from dtensor_mimo.train import checkpoint

    layout = MimoLayout({"language": par})
    layout.init_meshes("cpu")
    llama = Llama(LlamaConfig.from_hf(path))
    load_hf(llama, path)
    llama.tok_embeddings.weight.requires_grad_(not frozen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = MimoModel(layout, llama, {}, pipeline=None if microbatches is None else PipelineConfig(
            microbatches=microbatches, schedule="1F1B" if virtual_stages == 1 else "Interleaved1F1B",
            virtual_stages=virtual_stages))
    optimizer = MimoOptimizer(model, ADAMW)
    expected = checkpoint.expected_shapes({"language": llama})  # of the model as it trains (two keys at pp2)

    def weights() -> dict:
        return {n: _full(p) for n, p in model.module_parameters("language").items()}

    loaded, done = None, 0
    if load is not None:
        if model_only:
            checkpoint.load_model(load, model, expected)
        else:
            done = checkpoint.load(load, model, optimizer, expected)["step"]
        loaded = weights()
    losses = [train_step(model, optimizer, _batch(4 + done + i)).loss for i in range(steps)]
    checkpoint.save(ckpt, done + steps, model, optimizer, {"step": done + steps}, keep=1)
    return dict(loaded=loaded, losses=losses, weights=weights(), keys=sorted(expected))


def _ref_loss(llama: Llama, batch) -> torch.Tensor:
    logits = llama(batch.tokens, positions=batch.positions)
    weight = torch.where(batch.labels == IGNORE_INDEX, 0.0, batch.loss_mask).flatten()
    return (F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX,
                            reduction="none") * weight).sum() / weight.sum()


def _reference(path: str, tied_steps: int, untied_steps: int, frozen: bool = False) -> tuple[list[float], dict]:
    """One process, plain torch: the tied model of `path` trained `tied_steps` steps with AdamW
    (the library's no-decay rule; `frozen`: its embedding frozen, no AdamW state), then its head made
    a copy of the embedding, its AdamW state a copy of the embedding's (both trainable), and
    `untied_steps` more: each step's loss and the weights after."""
    llama = Llama(LlamaConfig.from_hf(path))
    load_hf(llama, path)
    llama.tok_embeddings.weight.requires_grad_(not frozen)
    named = dict(llama.named_parameters())
    decay = [p for n, p in named.items() if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in named.items() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": ADAMW.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=ADAMW.lr, betas=ADAMW.betas, eps=ADAMW.eps)
    losses = []
    for i in range(tied_steps + untied_steps):
        if i == tied_steps and untied_steps:
            embedding = llama.tok_embeddings.weight.requires_grad_(True)
            llama.output.weight = head = torch.nn.Parameter(embedding.detach().clone())
            opt.param_groups[0]["params"].append(head)  # output.weight decays
            opt.state[head] = {k: v.clone() for k, v in opt.state[embedding].items()}
        opt.zero_grad()
        loss = _ref_loss(llama, _batch(4 + i))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in llama.named_parameters()}


def test_a_tied_checkpoint_resumes_at_pp2_as_two_copies(tmp_path) -> None:
    """Saved tied (pp1: one key), resumed at pp2 (the head a copy on the last stage: two keys):
    both copies and their AdamW state come from the one saved tensor, and the next step is the
    one-process run's that unties there; `load_model` likewise gives both the saved weight."""
    path, tied, untied = str(tmp_path / "hf"), str(tmp_path / "tied"), str(tmp_path / "untied")
    _write(path, "llama3.2_tied")
    (one,) = run_on_ranks(_checkpoint_step, 1, path, P(), None, tied, None, 1, timeout=120)
    assert "model.language.output.weight" not in one["keys"]
    (step,) = glob.glob(os.path.join(tied, "step*"))
    per_rank = run_on_ranks(_checkpoint_step, 2, path, P(pp=2), 2, untied, step, 1, timeout=180)
    losses, want = _reference(path, 1, 1)
    assert one["losses"][0] == pytest.approx(losses[0], rel=1e-5)
    saved = one["weights"]["tok_embeddings.weight"]
    loaded = {n: w for r in per_rank for n, w in r["loaded"].items()}
    torch.testing.assert_close(loaded["output.weight"], saved, rtol=0, atol=0)
    torch.testing.assert_close(loaded["tok_embeddings.weight"], saved, rtol=0, atol=0)
    assert per_rank[0]["losses"][0] == pytest.approx(losses[1], rel=1e-5)
    got = {n: w for r in per_rank for n, w in r["weights"].items()}
    assert got.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"weight {name}: {m}")
    for r in run_on_ranks(_checkpoint_step, 2, path, P(pp=2), 2, str(tmp_path / "w"), step, 0, True, timeout=180):
        for name, w in r["loaded"].items():
            torch.testing.assert_close(w, saved if name == "output.weight" else one["weights"][name], rtol=0, atol=0)


def _refused_load(path: str, par: Parallelism, load: str) -> str:
    from dtensor_mimo.train import checkpoint

    try:
        _checkpoint_step(path, par, None, load + ".out", load, 0)
    except checkpoint.CheckpointError as e:
        return str(e)
    return "loaded"


def test_a_pp2_checkpoint_of_equal_copies_resumes_tied(tmp_path) -> None:
    """Saved at pp2 before the copies trained apart (two equal keys), resumed tied at dp2: the next
    step is the uninterrupted one-process tied run's; saved after a pp2 step (the copies differ),
    refused on every rank naming the head and how to load it."""
    path, before, after = str(tmp_path / "hf"), str(tmp_path / "before"), str(tmp_path / "after")
    _write(path, "llama3.2_tied")
    for r in run_on_ranks(_checkpoint_step, 2, path, P(pp=2), 2, before, None, 0, timeout=180):
        assert "model.language.output.weight" in r["keys"]
    (step,) = glob.glob(os.path.join(before, "step*"))
    per_rank = run_on_ranks(_checkpoint_step, 2, path, P(dp=2), None, str(tmp_path / "dp2"), step, 1, timeout=180)
    losses, want = _reference(path, 1, 0)
    for r in per_rank:
        assert r["losses"][0] == pytest.approx(losses[0], rel=1e-5)
        assert r["weights"].keys() == want.keys()
        for name, w in want.items():
            torch.testing.assert_close(r["weights"][name], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    run_on_ranks(_checkpoint_step, 2, path, P(pp=2), 2, after, None, 1, timeout=180)
    (step,) = glob.glob(os.path.join(after, "step*"))
    for said in run_on_ranks(_refused_load, 2, path, P(dp=2), step, timeout=180):
        assert "holds model.language.output.weight apart from model.language.tok_embeddings.weight and they " \
               "differ" in said and "untie_embeddings = true" in said, said


@ONE_RANK_STAGES
def test_a_tied_checkpoint_resumes_in_two_stages_on_one_rank(tmp_path) -> None:
    """Saved tied (one key), resumed at pp = 1 x virtual_stages = 2 on one rank: the split unties the
    head, and this rank holds both copies, so the one saved tensor fills both (and both AdamW
    states), as at pp2 where each rank holds one; the next step is the one-process run's that
    unties there. `load_model` likewise gives both the saved weight, not the head's own from the
    hf directory."""
    path, tied, untied = str(tmp_path / "hf"), str(tmp_path / "tied"), str(tmp_path / "untied")
    _write(path, "llama3.2_tied")
    (one,) = run_on_ranks(_checkpoint_step, 1, path, P(), None, tied, None, 1, timeout=120)
    (step,) = glob.glob(os.path.join(tied, "step*"))
    saved = one["weights"]["tok_embeddings.weight"]
    (got,) = run_on_ranks(_checkpoint_step, 1, path, P(), 2, untied, step, 1, False, 2, timeout=180)
    assert "model.language.output.weight" in got["keys"]  # two copies
    torch.testing.assert_close(got["loaded"]["output.weight"], saved, rtol=0, atol=0)
    torch.testing.assert_close(got["loaded"]["tok_embeddings.weight"], saved, rtol=0, atol=0)
    losses, want = _reference(path, 1, 1)
    assert got["losses"][0] == pytest.approx(losses[1], rel=1e-5)
    assert got["weights"].keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got["weights"][name], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"weight {name}: {m}")
    (got,) = run_on_ranks(_checkpoint_step, 1, path, P(), 2, str(tmp_path / "w"), step, 0, True, 2, timeout=180)
    for name, w in got["loaded"].items():
        torch.testing.assert_close(w, saved if name == "output.weight" else one["weights"][name], rtol=0, atol=0)


@ONE_RANK_STAGES
def test_a_frozen_tied_embeddings_checkpoint_resumes_in_two_stages_on_one_rank(tmp_path) -> None:
    """Saved tied with the embedding (so the head) frozen: the checkpoint holds no AdamW state for it.
    Resumed trainable at pp = 1 x virtual_stages = 2 on one rank (both copies there): both copies
    start with fresh AdamW state, as any parameter saved frozen does (`load`), and the step is the
    one-process run's; it raised a KeyError of the embedding's optimizer key on that rank alone."""
    path, tied, untied = str(tmp_path / "hf"), str(tmp_path / "tied"), str(tmp_path / "untied")
    _write(path, "llama3.2_tied")
    (one,) = run_on_ranks(_checkpoint_step, 1, path, P(), None, tied, None, 1, frozen=True, timeout=120)
    (step,) = glob.glob(os.path.join(tied, "step*"))
    keys = FileSystemReader(step).read_metadata().state_dict_metadata
    assert "model.language.tok_embeddings.weight" in keys
    assert not [k for k in keys if k.startswith("optim.language.tok_embeddings.weight")]
    (got,) = run_on_ranks(_checkpoint_step, 1, path, P(), 2, untied, step, 1, False, 2, timeout=180)
    losses, want = _reference(path, 1, 1, frozen=True)
    assert one["losses"][0] == pytest.approx(losses[0], rel=1e-5)
    assert got["losses"][0] == pytest.approx(losses[1], rel=1e-5)
    assert got["weights"].keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got["weights"][name], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"weight {name}: {m}")
