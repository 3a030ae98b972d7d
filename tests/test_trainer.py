"""The trainer (`python -m dtensor_mimo.train`) end to end on gloo ranks.

| layout (ranks)                                          | what is checked                                   |
|---------------------------------------------------------|---------------------------------------------------|
| A: vision dp2 + audio dp2 @0, language tp2 @2 [4],      | 6 steps; checkpoints at 3 and 6 (3 complete at   |
| checkpoints written in the background                   | step 4 or later, 6 at 6); JSONL fields            |
| A resumed from step 3 (a stale partial save beside it)   | steps 4-6 losses == uninterrupted A               |
| A with every rank loading the whole batch [4]            | losses == A's (per-rank loading loads the same)   |
| B: colocated vision dp4, audio dp4, language dp2·tp2 [4], vision and language HSDP (2 replica groups) | loads A's step 3, steps 4-6 == A's |
| C: everything on one rank [1]                            | loads B's step 5 (saved from HSDP), step 6 == A's |
| A, cp2 language, pp2 language (1F1B)                     | `MimoModel.predict` == argmax of a one-process model |
| D: vision + audio @0, language @1 [2], items at their own size | losses and grad norms == C's on the same data   |
| E: vision + audio @0, language @1 [2]                   | 3 steps, a checkpoint at the end                  |
| F: colocated vision dp2, audio dp2, language tp2 [2],   | E's weights alone (load_model_only): first loss   |
| other data seed, lr, frozen vision                      | == a one-process forward of E's checkpoint; step  |
|                                                         | 0, fresh AdamW, warmup and data from the start;   |
|                                                         | requeued, F resumes its own checkpoint            |

Losses under other layouts agree to float rounding (other reduction orders); a resumed run under
the same layout reproduces them exactly.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from dtensor_mimo.assemble import assemble, embed_text
from dtensor_mimo.train.checkpoint import CheckpointError, check_checkpoint, expected_shapes, latest_checkpoint
from dtensor_mimo.train.config import parse_args
from tests.harness import run_on_ranks

if importlib.util.find_spec("sklearn") is None:  # looked up, not imported: every rank imports this module
    pytest.skip("the digits data needs scikit-learn", allow_module_level=True)

LAYOUT_A = ["--layout.vision.dp", "2", "--layout.audio.dp", "2", "--layout.audio.offset", "0",
            "--layout.language.tp", "2"]
LAYOUT_B = ["--layout.vision.dp", "4", "--layout.audio.dp", "4", "--layout.audio.offset", "0",
            "--layout.language.dp", "2", "--layout.language.tp", "2", "--layout.language.offset", "0",
            "--layout.vision.dp_replicate", "2", "--layout.language.dp_replicate", "2"]
LAYOUT_C = ["--layout.audio.offset", "0", "--layout.language.offset", "0"]
SHORT = ["--train.steps", "6", "--data.batch_size", "8", "--pipeline.microbatches", "2",
         "--data.heldout_samples", "8", "--train.generate", "0", "--metrics.log_every", "1",
         "--lr_schedule.warmup_steps", "2", "--metrics.progress", "off",
         *[f"--options.{m}.compile=false" for m in ("vision", "audio", "language")]]


def _train(argv: list[str]) -> float:
    from dtensor_mimo.train.trainer import Trainer

    return Trainer(parse_args(argv)).run()


def _losses(path: str) -> dict[int, float]:
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """Layout A, 6 steps, checkpoints at steps 3 and 6, written in the background."""
    d = tmp_path_factory.mktemp("a")
    argv = [*SHORT, *LAYOUT_A, "--checkpoint.dir", str(d / "ckpt"), "--checkpoint.every", "3",
            "--checkpoint.async_mode", "async", "--metrics.jsonl", str(d / "m.jsonl"), "--metrics.peak_tflops", "2"]
    run_on_ranks(_train, 4, argv, timeout=300)
    return d, argv


def test_metrics_jsonl_fields(run_a) -> None:
    d, _ = run_a
    with open(d / "m.jsonl") as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for r in steps:
        for key in ("loss", "grad_norm", "tokens_per_s", "lr", "step_s", "forward_backward_s"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (key, r)
        assert r["tokens_per_s"] > 0 and r["lr"] > 0
        # MFU: the step's model FLOPs/s (the whole world's) over the peak of the 4 ranks (2 TFLOP/s each)
        assert r["mfu"] == pytest.approx(r["tflops"] / (2.0 * 4)), r
    assert steps[0]["lr"] == pytest.approx(1e-3 * 0.5)  # warmup 2 steps: half the peak at step 1
    assert "heldout_answer" in records[-1]
    assert math.isfinite(records[-1]["heldout_loss"]) and records[-1]["heldout_loss"] > 0
    assert not [k for r in records for k in r if " " in k]  # metric keys without spaces


def test_checkpoints_kept_and_complete(run_a) -> None:
    d, _ = run_a
    assert sorted(os.listdir(d / "ckpt")) == ["step-000003", "step-000006"]
    assert latest_checkpoint(str(d / "ckpt")).endswith("step-000006")
    with open(d / "m.jsonl") as f:
        saved = [r for r in map(json.loads, f) if "checkpoint" in r]
    # step 3's is written while steps 4.. run and counts from a later step; the run's last is waited for
    assert [(r["checkpoint_step"], r["checkpoint"]) for r in saved] == [
        (3, str(d / "ckpt" / "step-000003")), (6, str(d / "ckpt" / "step-000006"))]
    assert 3 < saved[0]["step"] <= 6 and saved[1]["step"] == 6


def test_resume_equals_uninterrupted(run_a, tmp_path) -> None:
    d, argv = run_a
    resume = tmp_path / "ckpt"
    shutil.copytree(d / "ckpt" / "step-000003", resume / "step-000003")
    # A save killed midway: its directory keeps the temporary name and is never taken.
    (resume / ".step-000005.tmp").mkdir()
    (resume / ".step-000005.tmp" / "__0_0.distcp").write_bytes(b"partial")
    assert latest_checkpoint(str(resume)).endswith("step-000003")
    argv2 = [*argv, "--checkpoint.dir", str(resume), "--metrics.jsonl", str(tmp_path / "m.jsonl")]
    run_on_ranks(_train, 4, argv2, timeout=300)
    expected, got = _losses(str(d / "m.jsonl")), _losses(str(tmp_path / "m.jsonl"))
    assert sorted(got) == [4, 5, 6]
    assert [got[s] for s in (4, 5, 6)] == [expected[s] for s in (4, 5, 6)]
    assert not (resume / ".step-000005.tmp").exists()  # cleaned up by the next save


def test_per_rank_loading_gives_the_same_batches(run_a, tmp_path) -> None:
    """... with steps 2-3 profiled (`metrics.profile`), which changes no number: each rank writes
    its own trace and table, in which the ranges name its own module's actions."""
    d, argv = run_a
    argv2 = [*argv, "--checkpoint.dir", str(tmp_path / "ckpt"), "--checkpoint.every", "0",
             "--data.per_rank_loading", "false", "--metrics.jsonl", str(tmp_path / "m.jsonl"),
             "--metrics.profile", str(tmp_path / "profile"), "--metrics.profile_at", "2"]
    run_on_ranks(_train, 4, argv2, timeout=300)
    assert _losses(str(tmp_path / "m.jsonl")) == _losses(str(d / "m.jsonl"))
    assert sorted(os.listdir(tmp_path / "profile")) == sorted(f"rank{r}.{x}" for r in range(4) for x in ("json", "txt"))
    for r in range(4):  # layout A: vision and audio on ranks 0-1, language on 2-3
        assert (tmp_path / "profile" / f"rank{r}.txt").read_text().startswith(f"rank {r}, steps 2-3")
        trace = json.loads((tmp_path / "profile" / f"rank{r}.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any(n.startswith("mimo.encode 0 vision") for n in names) == (r < 2), r
        assert ("mimo.language train" in names) == (r >= 2), r
    with open(tmp_path / "m.jsonl") as f:  # a line every step: steps 2 and 3 log their own, profiled, times
        assert [r["step"] for r in map(json.loads, f) if r.get("profiled")] == [2, 3]


def test_reload_under_other_layouts_continues(run_a, tmp_path) -> None:
    d, argv = run_a
    expected = _losses(str(d / "m.jsonl"))
    b = [*SHORT, *LAYOUT_B, "--checkpoint.load", str(d / "ckpt" / "step-000003"),
         "--checkpoint.dir", str(tmp_path / "b"), "--checkpoint.every", "1",
         "--metrics.jsonl", str(tmp_path / "b.jsonl")]
    run_on_ranks(_train, 4, b, timeout=300)
    got_b = _losses(str(tmp_path / "b.jsonl"))
    assert sorted(got_b) == [4, 5, 6]
    for s in (4, 5, 6):
        assert got_b[s] == pytest.approx(expected[s], rel=1e-5), s
    c = [*SHORT, *LAYOUT_C, "--checkpoint.load", str(tmp_path / "b" / "step-000005"),
         "--metrics.jsonl", str(tmp_path / "c.jsonl")]
    run_on_ranks(_train, 1, c, timeout=300)
    got_c = _losses(str(tmp_path / "c.jsonl"))
    assert sorted(got_c) == [6]
    assert got_c[6] == pytest.approx(expected[6], rel=1e-5)


def _refusal(argv: list[str]) -> tuple[str | None, list[list[str]]]:
    """The run's CheckpointError, and the keys of each DCP load it made."""
    from dtensor_mimo.train import checkpoint
    from dtensor_mimo.train.trainer import Trainer

    loads, load = [], checkpoint.dcp.load

    def recorded(state, **kwargs):
        loads.append(sorted(state))
        return load(state, **kwargs)

    checkpoint.dcp.load = recorded
    try:
        Trainer(parse_args(argv)).run()
    except CheckpointError as e:
        return str(e), loads
    finally:
        checkpoint.dcp.load = load
    return None, loads


def test_a_checkpoint_of_other_data_settings_is_refused_naming_them(run_a) -> None:
    """The data position of a run with another batch size cannot continue: a CheckpointError (no
    traceback from the launcher) naming the setting, on every rank, not the sampler's ValueError;
    before the weights and optimizer state are read (the trainer state alone was)."""
    d, _ = run_a
    argv = [*SHORT, *LAYOUT_C, "--data.batch_size", "4", "--checkpoint.load", str(d / "ckpt" / "step-000003")]
    ((message, loads),) = run_on_ranks(_refusal, 1, argv, timeout=300)
    assert "it was saved with data.batch_size 8 (this run: 4);" in message, message
    assert loads == [["trainer"]]


def _shapes(config) -> dict:
    from dtensor_mimo.train.modules import build_modules, resolve

    return expected_shapes(build_modules(config, resolve(config), 33))


def test_mismatched_checkpoint_names_keys_and_shapes(run_a) -> None:
    d, argv = run_a
    config = parse_args([*argv, "--model.language.dim", "32", "--model.language.n_layers", "3"])
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(str(d / "ckpt" / "step-000003"), _shapes(config))
    msg = str(e.value)
    assert "missing from the checkpoint: model.language.layers.2." in msg
    assert "different shapes: model.audio.projection" in msg and "(64, 48)" in msg and "(32, 48)" in msg
    check_checkpoint(str(d / "ckpt" / "step-000003"), _shapes(parse_args(argv)))


# ---------------------------------------------------------------------------- predict


def _predict(argv: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    from dtensor_mimo.train.trainer import Trainer

    trainer = Trainer(parse_args(argv))
    batch = trainer._load_plan(8, 1)(trainer.data.heldout.batch, list(range(8)))
    return trainer.model.predict(batch), batch.tokens


def _reference_logits(argv: list[str]) -> torch.Tensor:
    """A one-process forward of the same modules on the fully loaded batch."""
    from dtensor_mimo.train.datasets import train_data
    from dtensor_mimo.train.modules import build_modules, resolve

    config = parse_args(argv)
    resolved = resolve(config)
    modules = build_modules(config, resolved, 40, meta=False)
    batch = train_data(config, resolved).heldout.batch(range(8))
    ids = batch.special_token_ids
    with torch.no_grad():
        rows = {n: modules[n](m.inputs) for n, m in batch.modalities.items()}
        llama = modules["language"]
        return llama(h=assemble(embed_text(llama.tok_embeddings, batch.tokens, ids), batch.tokens, rows, ids))


@pytest.mark.parametrize("layout", [
    pytest.param(LAYOUT_A, id="tp2"),
    pytest.param(["--layout.language.cp", "2", "--layout.vision.dp", "2"], id="cp2"),
    pytest.param(["--layout.language.pp", "2", "--model.language.n_layers", "3"], id="pp2"),
    pytest.param(["--layout.vision.pp", "2"], id="vision_pp2"),
])
def test_predict_matches_one_process(layout: list[str]) -> None:
    argv = [*SHORT, *layout, "--data.heldout_samples", "8", "--data.seq_len", "40"]
    from dtensor_mimo.train.config import build_layout

    world = build_layout(parse_args(argv)).world_size
    results = run_on_ranks(_predict, world, argv, timeout=300)
    reference = _reference_logits(argv)
    top2 = reference.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-4  # positions whose argmax is not a near-tie
    for pred, _ in results:
        assert torch.equal(pred, results[0][0])  # the same on every rank
        assert torch.equal(pred[clear], reference.argmax(-1)[clear])
    assert clear.float().mean() > 0.9


def _answering(prompts: list[int], answers: list[list[int]], stops: list[int], seq: int, fill: int, calls: list):
    """A stand-in of what `Trainer.answers` reads: held-out prompts of `prompts` tokens with stop
    ids `stops`, and a "model" that answers `answers[i]` at the positions after prompt i (`fill`
    elsewhere), counting its calls in `calls`."""
    from types import SimpleNamespace

    from dtensor_mimo.data import IGNORE_INDEX, MimoBatch
    from dtensor_mimo.sequence import greedy_generate

    def predict(b: MimoBatch) -> torch.Tensor:
        calls.append(1)
        ids = torch.full((b.batch_size, b.seq_len), fill, dtype=torch.int64)
        for row, (n, answer) in enumerate(zip(prompts, answers)):
            ids[row, n - 1:n - 1 + len(answer)] = torch.tensor(answer)
        return ids

    class Heldout:
        def __len__(self) -> int:
            return len(prompts)

        def batch(self, indices):
            return MimoBatch(torch.ones(len(indices), seq, dtype=torch.int64),
                             torch.full((len(indices), seq), IGNORE_INDEX), torch.zeros(len(indices), seq))

    data = SimpleNamespace(heldout=Heldout(), prompt=lambda i: (prompts[i], f"expected {i}", stops[i]),
                           decode=lambda ids: " ".join(map(str, ids)))
    model = SimpleNamespace(generate=lambda batch, lengths, new, stop_token: greedy_generate(
        predict, batch, lengths, new, stop_token))
    return SimpleNamespace(data=data, model=model, seq_len=seq, heldout_left_out={},
                           _heldout_batch=lambda make, indices: make(indices))


def test_answers_are_not_cut_short_by_another_samples_longer_prompt() -> None:
    """`Trainer.answers` generated every held-out answer with the room the longest prompt left
    (``seq_len - max(prompt lengths)`` new tokens for all), so a short prompt's longer answer was
    printed cut off, beside its expected text, whenever another prompt was long; each answer now
    has its own row's room. The "model" answers by hand-written ids at the positions after each prompt."""
    from dtensor_mimo.train.trainer import Trainer

    stop = 9  # sample 0's prompt leaves 3 positions; sample 1's answer is 5 tokens
    trainer = _answering([13, 4], [[3, stop], [5, 6, 7, 8, stop]], [stop, stop], seq=16, fill=0, calls=[])
    assert Trainer.answers(trainer, 2) == [("expected 0", "3 9"), ("expected 1", "5 6 7 8 9")]


def test_answers_stop_each_at_its_own_stop_id() -> None:
    """Prompts whose stop ids differ (an answer without the end-of-sequence token stops at its own
    last token): each sample stops at its own; with one stop id for all, or none where they
    differed, the others ran to their row's end (a forward of the whole model per token)."""
    from dtensor_mimo.train.trainer import Trainer

    calls: list = []  # sample 1 passes sample 0's stop id first
    trainer = _answering([3, 5], [[5, 9, 8, 4], [6, 9, 8, 4]], [9, 8], seq=12, fill=4, calls=calls)
    assert Trainer.answers(trainer, 2) == [("expected 0", "5 9"), ("expected 1", "6 9 8")]
    assert len(calls) == 3  # the last sample's third token ends the loop


def test_heldout_loss_is_per_target_token_over_every_batch() -> None:
    """`Trainer.evaluate`'s "loss" is documented "per target token, as the training loss": the
    held-out batches' losses weighted by their target tokens, not the mean of the batches' means
    (the last batch is short). A stand-in model whose token losses are known by hand: a token's
    loss is its label, so the reference is the mean of every held-out target label."""
    from types import SimpleNamespace

    from dtensor_mimo.data import IGNORE_INDEX, MimoBatch
    from dtensor_mimo.train.trainer import Trainer

    seq = 6
    targets = [[3, 5, 7, 9], [1], [2, 2], [8, 6, 4], [10]]  # each sample's target labels (5 samples)

    def batch(indices):
        labels = torch.full((len(indices), seq), IGNORE_INDEX)
        for row, i in enumerate(indices):
            labels[row, :len(targets[i])] = torch.tensor(targets[i])
        return MimoBatch(torch.ones(len(indices), seq, dtype=torch.int64), labels,
                         (labels != IGNORE_INDEX).float())

    def predict(b: MimoBatch, with_loss: bool):  # the batch's loss per target token, as the model's
        counted = b.labels != IGNORE_INDEX
        return torch.zeros_like(b.tokens), float(b.labels[counted].float().sum() / counted.sum())

    class Heldout:
        def __len__(self) -> int:
            return len(targets)

    heldout = Heldout()
    heldout.batch = batch
    trainer = SimpleNamespace(data=SimpleNamespace(heldout=heldout, score=lambda b, pred: {"answer": (0, 1)}),
                              config=SimpleNamespace(data=SimpleNamespace(batch_size=2)),
                              model=SimpleNamespace(predict=predict),
                              _heldout_batch=lambda make, indices: make(indices))
    every = [t for ts in targets for t in ts]
    assert Trainer.evaluate(trainer)["loss"] == pytest.approx(sum(every) / len(every))  # 57 / 11


VARIED = ["--model.encoders.vision.dynamic_resolution", "true", "--model.encoders.audio.variable_length", "true"]


def _records(path: str) -> dict[int, tuple[float, float]]:
    with open(path) as f:
        return {r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, f) if "loss" in r}


def test_items_of_their_own_size_give_one_process_numbers(tmp_path) -> None:
    """Scans at 8x8..12x12 and clips of 8..16 frames (the digits data at varied resolution): both
    encoders dp2 on ranks 0-1, balanced (the default) and by sample, the language model on rank
    2 (per-rank loading: each encoder rank loads its share's samples, rank 2 no item), give the
    one-rank run's losses and gradient norms; the logged encoder imbalance is never worse
    balanced than by sample."""
    base = [*SHORT, *VARIED, "--train.steps", "3", "--data.heldout_samples", "8"]
    dp2 = ["--layout.vision.dp", "2", "--layout.audio.dp", "2", "--layout.audio.offset", "0"]
    runs = {"one": (1, LAYOUT_C), "balanced": (3, dp2),
            "by_sample": (3, [*dp2, "--options.vision.balance", "false", "--options.audio.balance", "false"])}
    for name, (world, layout) in runs.items():
        run_on_ranks(_train, world, [*base, *layout, "--metrics.jsonl", str(tmp_path / f"{name}.jsonl")], timeout=300)
    expected = _records(str(tmp_path / "one.jsonl"))
    assert sorted(expected) == [1, 2, 3]
    for name in ("balanced", "by_sample"):
        got = _records(str(tmp_path / f"{name}.jsonl"))
        assert sorted(got) == [1, 2, 3], name
        for step, (loss, norm) in expected.items():
            assert got[step][0] == pytest.approx(loss, rel=1e-5) and got[step][1] == pytest.approx(norm, rel=1e-5), \
                (name, step)
    logged = {name: [r for r in map(json.loads, open(tmp_path / f"{name}.jsonl")) if "loss" in r]
              for name in ("balanced", "by_sample")}
    for balanced, by_sample in zip(*logged.values()):
        for encoder in ("vision", "audio"):
            key = f"encoder_imbalance_{encoder}"
            assert 1.0 <= balanced[key] <= by_sample[key], (balanced["step"], key, balanced[key], by_sample[key])
    assert any(b["encoder_imbalance_vision"] < s["encoder_imbalance_vision"] for b, s in zip(*logged.values()))


def test_encoder_pipeline_gives_one_process_numbers(tmp_path) -> None:
    """The vision encoder in two pipeline stages (ranks 0-1), audio on rank 2, the language model
    on rank 3: the one-rank run's losses and gradient norms, and its held-out score (the
    evaluation runs the encoder's stages one after the other, `MimoModel.predict`)."""
    base = [*SHORT, "--train.steps", "3", "--data.heldout_samples", "8"]
    runs = {"one": (1, LAYOUT_C), "vision_pp2": (4, ["--layout.vision.pp", "2"])}
    scores = {}
    for name, (world, layout) in runs.items():
        scores[name] = run_on_ranks(_train, world, [*base, *layout, "--metrics.jsonl", str(tmp_path / f"{name}.jsonl")],
                                    timeout=300)[0]
    expected, got = _records(str(tmp_path / "one.jsonl")), _records(str(tmp_path / "vision_pp2.jsonl"))
    assert sorted(got) == sorted(expected) == [1, 2, 3]
    for step, (loss, norm) in expected.items():
        assert got[step][0] == pytest.approx(loss, rel=1e-5) and got[step][1] == pytest.approx(norm, rel=1e-5), step
    assert scores["vision_pp2"] == scores["one"]


# ---------------------------------------------------------------------------- weights-only start

LAYOUT_E = ["--layout.audio.offset", "0"]  # vision + audio @0, language @1
LAYOUT_F = ["--layout.vision.dp", "2", "--layout.audio.dp", "2", "--layout.audio.offset", "0",
            "--layout.language.offset", "0", "--layout.language.tp", "2"]  # all colocated, FSDP2 over dp2
# Other data, another peak lr (no weight decay: AdamW's first update is then lr * g / (|g| + eps)),
# another frozen setting (the vision tower: its weights are A's, bit for bit, after B's steps).
OTHER_RUN = ["--data.seed", "1", "--optimizer.lr", "2e-3", "--optimizer.weight_decay", "0",
             "--model.encoders.vision.frozen", "true", "--lr_schedule.total_steps", "100"]


def _read(path: str, keys) -> dict:
    """The checkpoint's entries `keys`, read in this process (DCP without a process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) if hasattr(meta[k], "size") else ""
             for k in keys}
    dcp.load(state, checkpoint_id=path)
    return {k: json.loads(v) if isinstance(v, (str, bytes)) else v for k, v in state.items()}


def _entries(path: str) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return sorted(FileSystemReader(path).read_metadata().state_dict_metadata)


@pytest.fixture(scope="module")
def model_only_runs(tmp_path_factory):
    """A: layout E, 3 steps, checkpointed at the end. B: layout F, other data, lr and frozen
    tower, 2 steps from A's weights alone (checkpoints at steps 1 and 2)."""
    d = tmp_path_factory.mktemp("model_only")
    a = [*SHORT, *LAYOUT_E, "--train.steps", "3", "--checkpoint.dir", str(d / "a")]
    run_on_ranks(_train, 2, a, timeout=300)
    b = [*SHORT, *LAYOUT_F, *OTHER_RUN, "--train.steps", "2", "--checkpoint.load", str(d / "a"),
         "--checkpoint.load_model_only", "true", "--checkpoint.dir", str(d / "b"), "--checkpoint.every", "1",
         "--metrics.jsonl", str(d / "b.jsonl")]
    run_on_ranks(_train, 2, b, timeout=300)
    return d, a, b


def _first_batch_loss(argv: list[str], weights: str | None) -> float:
    """The loss of the run `argv`'s first batch in one process, with the library's plain modules
    holding the checkpoint `weights`' parameters and buffers (None: their init)."""
    import torch.nn.functional as F

    from dtensor_mimo.data import IGNORE_INDEX, ResumableBatchSampler
    from dtensor_mimo.train.datasets import train_data
    from dtensor_mimo.train.modules import build_modules, resolve

    config = parse_args(argv)
    resolved = resolve(config)
    data = train_data(config, resolved)
    modules = build_modules(config, resolved, data.seq_len, meta=False)
    if weights is not None:
        saved = _read(weights, expected_shapes(modules))
        for name, module in modules.items():
            module.load_state_dict({k.split(".", 2)[2]: v for k, v in saved.items() if k.split(".")[1] == name})
    indices = next(iter(ResumableBatchSampler(len(data.train), config.data.batch_size, seed=config.data.seed)))
    batch = data.train.batch(indices)
    ids = batch.special_token_ids
    with torch.no_grad():
        rows = {n: modules[n](m.inputs) for n, m in batch.modalities.items()}
        llama = modules["language"]
        h = assemble(embed_text(llama.tok_embeddings, batch.tokens, ids), batch.tokens, rows, ids)
        logits = llama(h=h, positions=batch.positions, document_ids=batch.document_ids)
    weight = torch.where(batch.labels == IGNORE_INDEX, 0.0, batch.loss_mask).flatten()
    ce = F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten(), ignore_index=IGNORE_INDEX,
                         reduction="none")
    return ((ce * weight).sum() / weight.sum()).item()


def test_load_model_only_takes_the_weights_alone(model_only_runs) -> None:
    """B's first loss is A's weights' on B's own first batch (a one-process forward of A's
    checkpointed weights), and nothing but the weights came from A: step 0, AdamW's first update
    (state step 1, every element moved by at most lr and most by lr itself, as from zero moments),
    the warmup from its start, B's own data from its start (A's seed differs: a full load refuses)."""
    d, a, b = model_only_runs
    logged = [r for r in map(json.loads, open(d / "b.jsonl")) if "loss" in r]
    assert [r["step"] for r in logged] == [1, 2]
    assert [r["lr"] for r in logged] == pytest.approx([1e-3, 2e-3])  # warmup 2 steps from update 1: 2e-3 / 2
    reference = _first_batch_loss(b, str(d / "a" / "step-000003"))
    assert logged[0]["loss"] == pytest.approx(reference, rel=1e-5)
    assert abs(_first_batch_loss(b, None) - reference) > 1e-3  # A's 3 steps show in B's first loss

    a3, b1 = str(d / "a" / "step-000003"), str(d / "b" / "step-000001")
    saved = _read(b1, [k for k in _entries(b1) if k.startswith(("optim.", "trainer"))])
    trainer = saved.pop("trainer")
    assert (trainer["step"], trainer["updates"]) == (1, 1)
    from dtensor_mimo.data import ResumableBatchSampler

    sampler = ResumableBatchSampler(trainer["sampler"]["num_samples"], 8, seed=1)
    next(iter(sampler))
    assert trainer["sampler"] == json.loads(json.dumps(sampler.state_dict()))
    steps = {k: v for k, v in saved.items() if k.endswith(".step")}
    assert steps and all(float(v) == 1.0 for v in steps.values()), steps  # A's state was at 3
    weights = [k for k in _entries(a3) if k.startswith("model.")]
    before, after = _read(a3, weights), _read(b1, weights)
    trained = {k for k in weights if f"optim.{k[len('model.'):]}.step" in steps}
    frozen = [k for k in weights if k not in trained]
    assert frozen and all(k.startswith("model.vision.") for k in frozen)
    for k in frozen:  # B's vision tower: A's weights, bit for bit
        assert torch.equal(before[k], after[k]), k
    moved = torch.cat([(after[k] - before[k]).abs().flatten() for k in sorted(trained)]) / logged[0]["lr"]
    # AdamW's first update is lr * g / (|g| + eps): lr itself wherever the gradient is not ~0; one
    # that resumed A's moments (state step 4) moved 1 % of these elements by lr, half by < 0.53 lr
    assert moved.max() < 1.01
    nonzero = moved[moved > 0]
    assert (nonzero > 0.99).float().mean() > 0.95, nonzero.quantile(torch.tensor([0.01, 0.05, 0.5]))


def test_a_requeued_load_model_only_run_resumes_its_own_checkpoint(model_only_runs, tmp_path) -> None:
    """B's command again with B's step-1 checkpoint in its checkpoint.dir (a requeue): it resumes
    its own full state, not A's weights again, and its step 2 is B's, exactly."""
    d, _, b = model_only_runs
    shutil.copytree(d / "b" / "step-000001", tmp_path / "ckpt" / "step-000001")
    run_on_ranks(_train, 2, [*b, "--checkpoint.dir", str(tmp_path / "ckpt"), "--metrics.jsonl",
                             str(tmp_path / "m.jsonl")], timeout=300)
    got, expected = _losses(str(tmp_path / "m.jsonl")), _losses(str(d / "b.jsonl"))
    assert sorted(got) == [2]
    assert got[2] == expected[2]


def test_load_model_only_names_a_module_the_checkpoint_lacks(model_only_runs) -> None:
    d, a, _ = model_only_runs
    expected = {**_shapes(parse_args(a)), "model.extra.weight": (4, 4)}
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(str(d / "a" / "step-000003"), expected)
    assert "module 'extra' is not in it (it holds 'audio', 'language', 'vision')" in str(e.value)


# ---------------------------------------------------------------------------- the command


def test_main_command_short_run(tmp_path) -> None:
    """The README's main command, shortened: local ranks, compiled blocks, held-out accuracy. The
    blocks compile through dynamo and AOT autograd with the "aot_eager" backend: inductor's cold
    code generation of every block on 3 ranks sharing 2 cores took 2.5 of the suite's minutes
    (`make demo` runs it with inductor)."""
    out = subprocess.run(
        [sys.executable, "-m", "dtensor_mimo.train", "--train.steps", "6", "--data.heldout_samples", "8",
         "--lr_schedule.warmup_steps", "2", "--metrics.jsonl", str(tmp_path / "m.jsonl"),
         "--metrics.log_every", "4",
         *[f"--options.{m}.compile_backend=aot_eager" for m in ("vision", "audio", "language")]],
        capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held-out accuracy: 0." in out.stdout or "held-out accuracy: 1.00" in out.stdout
    assert "language  1   1   1   1   2..2   own ranks" in out.stdout
    assert sorted(_losses(str(tmp_path / "m.jsonl"))) == [4, 6]  # every log_every-th step, and the last


def test_main_command_rejects_bad_config_before_starting(tmp_path) -> None:
    # The limit bounds a hang, not speed: importing torch 2.11 and transformers took over 60 s on
    # 2 loaded cores once (9 s alone).
    out = subprocess.run([sys.executable, "-m", "dtensor_mimo.train", "--layout.language.tp", "two"],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 2
    assert "layout.language.tp = 'two': expected an integer" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("rank", ["0", "3"])
def test_torchrun_rank_refuses_a_layout_that_does_not_fit_its_world(rank, monkeypatch, capsys) -> None:
    """Under torchrun (its environment) each rank checks the config against the world's size and
    exits with 2 before joining any group: the default 3-rank layout does not fit 4 ranks."""
    from dtensor_mimo.train import launch

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", rank)
    assert launch.main(SHORT) == 2
    assert "config error: layout: ranks 3 of the 4-rank world belong to no module" in capsys.readouterr().err
    assert not torch.distributed.is_initialized()
