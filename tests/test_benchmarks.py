"""The benchmarks' pairs do the same work on both sides.

`benchmarks/host_step.py` and `benchmarks/step_ops.py` time or count the library's step against
transformers' `LlamaForCausalLM` + AdamW + clip, and `benchmarks/gpu.py` its 1B LM and VLM against
transformers' on a GPU: a ratio only says something of the library when the reference runs the
same model on the same tokens with the same optimizer (its form, fused or foreach, its
hyperparameters and its weight-decay groups) and no work of its own that a training step does not
need. These tests build both sides with the benchmarks' own functions and compare them.
"""

from __future__ import annotations

import collections
import inspect
import os
import sys

import torch

from tests.harness import run_on_ranks

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)


def _adamw_settings(optimizers) -> collections.Counter:
    """Per parameter that AdamW steps: (numel, weight decay, lr, betas, eps, fused, foreach)."""
    out: collections.Counter = collections.Counter()
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                out[(p.numel(), group["weight_decay"], group["lr"], tuple(group["betas"]), group["eps"],
                     bool(group.get("fused")), bool(group.get("foreach")) and not group.get("fused"))] += 1
    return out


def _host_step_pair() -> dict:
    import host_step

    from dtensor_mimo.data import SyntheticSpec, synthetic_batch

    theirs, ours = host_step.transformers_step(), host_step.ours_step(False, 1, 1)
    t, o = inspect.getclosurevars(theirs).nonlocals, inspect.getclosurevars(ours).nonlocals
    hf, model = t["model"], o["model"]
    settings = {"theirs": _adamw_settings([t["optimizer"]]),
                "ours": _adamw_settings(o["optimizer"].optimizers.values())}
    # What transformers' forward returned in the timed step, and the loss's gradient on its logits.
    forward, seen = hf.forward, {}

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen["cache"] = [getattr(out, key, None) for key in ("cache", "past_key_values")]
        out.logits.register_hook(lambda g: seen.__setitem__("grad", g.detach().clone()))
        return out

    hf.forward = recording
    theirs(0)
    del hf.forward
    # The same batch built independently: the tokens a loss counts have a label and a loss weight.
    batch = synthetic_batch(SyntheticSpec.tiny(batch_size=8, modalities={}), seed=0)
    counted = (batch.labels != -100) & (batch.loss_mask != 0)
    return {"settings": settings, "cache": any(c is not None for c in seen["cache"]),
            "grad_rows": seen["grad"].abs().sum(-1).ne(0), "counted": counted,
            "params": (sum(p.numel() for p in hf.parameters()), sum(p.numel() for p in model.parameters()))}


def test_host_step_reference_does_the_libraries_work():
    """`host_step.py`'s "transformers llama" (issue 29's reference for the library's host time per
    step, the "llama / transformers llama" ratio) against `ours_step`: the same parameters, AdamW
    in the same form with the same groups and hyperparameters, the loss over the same tokens (those
    with a label and a loss weight: `synthetic_batch` masks a prompt prefix of each document), and
    no KV cache built in a training forward (transformers builds one unless told `use_cache=False`:
    host work the library's step does not do)."""
    (r,) = run_on_ranks(_host_step_pair, 1, timeout=300)
    assert r["params"][0] == r["params"][1]
    assert r["settings"]["theirs"] == r["settings"]["ours"], (
        f"AdamW differs: transformers {sorted(r['settings']['theirs'].items())} against the library's "
        f"{sorted(r['settings']['ours'].items())}")
    assert not r["cache"], "the reference's training forward built a KV cache"
    assert torch.equal(r["grad_rows"], r["counted"]), (
        f"the reference's loss counts {int(r['grad_rows'].sum())} tokens, the batch's loss weights "
        f"{int(r['counted'].sum())}")


def _gpu_pairs() -> dict:
    """`gpu.py`'s AdamW for transformers' LM and VLM against the library's for the same models
    (tiny sizes, CPU)."""
    import gpu
    import transformers

    from dtensor_mimo import AdamWConfig, MimoOptimizer, ParallelOptions

    s = gpu.LM["tiny"]
    config = transformers.LlamaConfig(vocab_size=s["vocab"], hidden_size=s["dim"], intermediate_size=s["ffn"],
                                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                                      num_key_value_heads=s["kv_heads"], max_position_embeddings=s["seq"],
                                      tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(config)
    model, optimizer = gpu._lm_ours_model(s, "cpu", ParallelOptions())
    lm = {"theirs": _adamw_settings([gpu._adamw(hf, "cpu")]), "ours": _adamw_settings(optimizer.optimizers.values())}
    v = gpu.VLM["tiny"]
    llava = gpu._llava(v, "cpu")
    for name, p in llava.named_parameters():  # LLaVA takes the tower's last layer's rows: no gradient here
        p.requires_grad_("post_layernorm" not in name)
    ours = gpu._vlm_ours_model(v, "cpu", "eager", compile_=False)
    vlm = {"theirs": _adamw_settings([gpu._adamw(llava, "cpu")]),
           "ours": _adamw_settings(MimoOptimizer(ours, AdamWConfig(lr=1e-4)).optimizers.values())}
    return {"lm": lm, "vlm": vlm}


def test_gpu_pairs_step_the_same_adamw():
    """`gpu.py`'s transformers cases (the denominators of issue 29's "lm ours" and "vlm ours"
    ratios) step AdamW with the library's hyperparameters and weight-decay groups (no decay on
    norms, biases and embeddings; betas (0.9, 0.95)), in the form the library takes on the device."""
    (r,) = run_on_ranks(_gpu_pairs, 1, timeout=300)
    for pair in ("lm", "vlm"):
        assert r[pair]["theirs"] == r[pair]["ours"], (
            f"{pair}: transformers' AdamW {sorted(r[pair]['theirs'].items())} against the library's "
            f"{sorted(r[pair]['ours'].items())}")


def _pipeline_orders() -> dict:
    """`pipeline.py`'s 2-rank models at tiny sizes: one step each, and the order of the encoder
    rank's encoder forwards and backwards in each one's program."""
    import argparse

    import pipeline

    from dtensor_mimo.data import synthetic_batch

    args = argparse.Namespace(microbatches=4, batch=8, seq_len=64, images=1, dim=32, vision_layers=1,
                              language_layers=1)
    batch = synthetic_batch(pipeline.configs(args)[2], seed=0)
    orders = {}
    for name, model in zip(("unpipelined", "pipelined", "pipelined, window M"), pipeline.two_rank_models(args)):
        model.forward_backward(batch)
        ops = [a.op for a in model.parts.program(batch) if a.op in ("encode", "backward")]
        orders[name] = "".join("F" if op == "encode" else "B" for op in ops)
    return orders


def test_pipeline_window_m_runs_every_encoder_forward_first():
    """`pipeline.py`'s "pipelined, window M" row (the order before lean encoders: every encoder
    forward, then every backward) runs that order on the encoder rank, and "pipelined" the lean
    one (a backward before the last forward): the two rows are different schedules."""
    orders, _ = run_on_ranks(_pipeline_orders, 2, timeout=300)
    assert orders["pipelined, window M"] == "FFFFBBBB", orders
    assert orders["pipelined"] != orders["pipelined, window M"], orders


def test_checkpoint_stall_names_a_run_without_saves():
    """`checkpoint_stall.py` saves every ``--every`` steps before the last: with ``--every`` not
    below ``--steps`` (or 0) a run has no save to time. Said on every rank before the process
    group is made, naming both flags (it ran every repeat, then died on a ZeroDivisionError).
    (Run as one process: the refusal comes before the process group a torchrun world would make.)"""
    import subprocess

    script = os.path.join(BENCHMARKS, "checkpoint_stall.py")
    for every in ("4", "0"):
        out = subprocess.run([sys.executable, script, "--dim", "32", "--layers", "1",
                              "--steps", "4", "--every", every, "--repeats", "1", "--json", os.devnull],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": os.path.dirname(BENCHMARKS)})
        assert out.returncode != 0
        assert "ZeroDivisionError" not in out.stderr, out.stderr[-2000:]
        assert f"--every {every} with --steps 4" in out.stderr, out.stderr[-2000:]
