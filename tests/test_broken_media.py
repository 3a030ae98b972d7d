"""Broken media never costs a run: a file that fails to decode is named on every rank, or skipped.

Tiny LLaVA data (`examples/make_tiny_llava.py`: 32 training samples, 8 held-out), image / language
on ranks 0 / 1 (the image is decoded on rank 0 only), 4 steps of 8: every training sample once.

| case                                                       | expected                                        |
|------------------------------------------------------------|-------------------------------------------------|
| a training sample's PNG truncated                          | exit 1, within the timeout; every rank's error: |
|                                                            | BatchError naming the sample id and the file    |
| the same, data.skip_bad_media = true, a held-out PNG too,  | one warning line per sample; trains to step 4;  |
| export_hf set; then resumed to step 8 (the broken          | skipped_samples counted; the export written;    |
| sample's second epoch); then without skipping to step 12  | resumed: the sample named no more, counted 2x;  |
|                                                            | without skipping: exit 1 naming it again        |
| a held-out PNG truncated (no skipping), export_hf set      | the export written; then exit 1 naming it       |
| zero-byte PNGs (no header) under dynamic_resolution: the   | passed, left to the steps (skipping, held-out); |
| launcher's checks                                          | a training one not skipped: named now           |
| the same, a held-out one, skipping, train.generate = 3     | evaluated and answered without it               |
| the same, training sample 0's, skipping, export_hf set     | the export written                              |
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "llava_tiny.toml")
ARGS = ["--config", CONFIG, "--train.steps", "4", "--data.batch_size", "8", "--metrics.progress", "off",
        "--train.generate", "0", "--metrics.log_every", "1", "--lr_schedule.warmup_steps", "2",
        "--metrics.jsonl", "m.jsonl", "--checkpoint.export_hf", "out/hf"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    spec = importlib.util.spec_from_file_location("make_tiny_llava", os.path.join(ROOT, "examples",
                                                                                  "make_tiny_llava.py"))
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    out = str(tmp_path_factory.mktemp("broken_media"))
    make.write_checkpoints(out)
    make.write_data(out, train=32, val=8)
    return out


def _first_image(sample: dict) -> str:
    return sample["image"] if isinstance(sample["image"], str) else sample["image"][0]


def _copy_with_a_truncated_image(tiny: str, dest, splits: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """`tiny` copied to `dest` with the first image of the first imaged sample of each of `splits`
    cut to half its bytes: ``{split: (sample id, file)}``."""
    shutil.copytree(tiny, dest)
    broken = {}
    for split in splits:
        with open(os.path.join(dest, "data", f"{split}.jsonl")) as f:
            sample = next(s for s in map(json.loads, f) if "image" in s)
        path = os.path.join(dest, "data", _first_image(sample))
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data[:len(data) // 2])
        broken[split] = (sample["id"], path)
    return broken


def _train(cwd, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtensor_mimo.train", *ARGS, *argv], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={**os.environ, "PYTHONPATH": ROOT})


def test_a_truncated_training_image_is_named_on_every_rank(tiny: str, tmp_path) -> None:
    (sid, path), = _copy_with_a_truncated_image(tiny, tmp_path / "run", ("train",)).values()
    out = _train(tmp_path / "run")
    assert out.returncode == 1, out.stderr[-3000:]
    named = f"sample {sid!r}: cannot decode its image file {path}"
    assert "error on ranks 0, 1: BatchError: 1 sample(s) whose media cannot be decoded: " in out.stderr, \
        out.stderr[-3000:]
    assert named in out.stderr and "data.skip_bad_media = true" in out.stderr
    assert "fed different batches" not in out.stderr and "Traceback" not in out.stderr
    assert not os.path.exists(tmp_path / "run" / "out" / "hf")


def test_skip_bad_media_trains_to_the_end_and_exports(tiny: str, tmp_path) -> None:
    broken = _copy_with_a_truncated_image(tiny, tmp_path / "run", ("train", "val"))
    out = _train(tmp_path / "run", "--data.skip_bad_media", "true", "--checkpoint.dir", "ckpt")
    assert out.returncode == 0, out.stderr[-3000:]
    for split, (sid, path) in broken.items():
        lines = [line for line in out.stdout.splitlines() if f"sample {sid!r}: cannot decode its image file {path}"
                 in line]
        what = "trained on" if split == "train" else "scored"
        assert len(lines) == 1 and lines[0].startswith("warning: ") and \
            lines[0].endswith(f"the sample is not {what} (data.skip_bad_media)"), out.stdout[-3000:]
    with open(tmp_path / "run" / "m.jsonl") as f:
        records = [r for r in map(json.loads, f) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["skipped_samples"] == 1
    assert os.path.exists(tmp_path / "run" / "out" / "hf" / "config.json")
    # resumed to step 8, the broken sample's second epoch: named no more, counted twice
    (sid, path) = broken["train"]
    resumed = _train(tmp_path / "run", "--data.skip_bad_media", "true", "--checkpoint.dir", "ckpt",
                     "--checkpoint.export_hf", "none", "--train.steps", "8")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and f"{path}" not in resumed.stdout.replace(broken["val"][1], ""), \
        resumed.stdout[-3000:]
    with open(tmp_path / "run" / "m.jsonl") as f:
        records = [r for r in map(json.loads, f) if "loss" in r]
    assert (records[-1]["step"], records[-1]["skipped_samples"]) == (8, 2)
    # resumed again without skipping: the known sample is named again in its third epoch, not left out
    strict = _train(tmp_path / "run", "--checkpoint.dir", "ckpt", "--checkpoint.export_hf", "none",
                    "--train.steps", "12")
    assert strict.returncode == 1 and f"sample {sid!r}: cannot decode its image file {path}" in strict.stderr, \
        strict.stderr[-3000:]


def test_a_truncated_heldout_image_does_not_cost_the_export(tiny: str, tmp_path) -> None:
    (sid, path), = _copy_with_a_truncated_image(tiny, tmp_path / "run", ("val",)).values()
    out = _train(tmp_path / "run")
    assert os.path.exists(tmp_path / "run" / "out" / "hf" / "config.json"), out.stderr[-3000:]
    assert out.returncode == 1
    assert f"sample {sid!r}: cannot decode its image file {path}" in out.stderr
    assert "the export was written" in out.stderr


def _emptied_image(data: str, sample: dict) -> str:
    """`sample`'s first image under `data`, made zero bytes (a failed download: no header)."""
    image = _first_image(sample)
    open(os.path.join(data, image), "wb").close()
    return image


def test_the_launchers_checks_leave_unreadable_media_headers_to_the_steps(tiny: str, tmp_path, monkeypatch) -> None:
    """Images at their own size (dynamic_resolution) have their headers read when a sample is
    tokenized, as the launcher's checks do for the first samples. A zero-byte image there was a
    config error before any rank started, with data.skip_bad_media (which leaves such a sample
    out) and for held-out data (left out of the scores, named after the export) alike."""
    from dtensor_mimo.train.config import ConfigError, parse_args
    from dtensor_mimo.train.launch import preflight

    shutil.copytree(tiny, tmp_path / "run")
    monkeypatch.chdir(tmp_path / "run")
    emptied = {}
    for split in ("train", "val"):
        with open(os.path.join("data", f"{split}.jsonl")) as f:
            sample = next(s for s in map(json.loads, f) if "image" in s)
        emptied[split] = (sample["id"], _emptied_image("data", sample))
    with open(os.path.join("data", "train.jsonl")) as f, open(os.path.join("data", "sound.jsonl"), "w") as out:
        out.writelines(line for line in f if json.loads(line)["id"] != emptied["train"][0])
    argv = ["--config", CONFIG, "--model.encoders.image.dynamic_resolution", "true", "--checkpoint.export_hf", "none"]
    preflight(parse_args([*argv, "--data.skip_bad_media", "true"]))  # both left to the steps
    preflight(parse_args([*argv, "--data.path", "data/sound.jsonl"]))  # a held-out image, not skipping
    sid, image = emptied["train"]  # a training image, not skipping: named now, as the first step would
    with pytest.raises(ConfigError, match=rf"sample {sid!r}: .*{image}: not an image Pillow reads"):
        preflight(parse_args(argv))


def _run_in(cwd: str, argv: list[str]) -> float | None:
    from dtensor_mimo.train.config import parse_args
    from dtensor_mimo.train.trainer import Trainer

    os.chdir(cwd)
    return Trainer(parse_args(argv)).run()


def test_an_unreadable_heldout_header_is_left_out_of_the_generated_answers(tiny: str, tmp_path) -> None:
    """A held-out image whose header cannot be read (dynamic_resolution reads it to count its
    rows) is left out of the scores with data.skip_bad_media; the greedy answers at the end then
    tokenized every held-out sample for its prompt, met it again and ended the run with its
    MediaError (after the export: exit 1 for a run asked to skip)."""
    from tests.harness import run_on_ranks

    shutil.copytree(tiny, tmp_path / "run")
    with open(tmp_path / "run" / "data" / "val.jsonl") as f:
        sample = [s for s in map(json.loads, f) if "image" in s][0]
    _emptied_image(str(tmp_path / "run" / "data"), sample)
    argv = [*ARGS, "--train.steps", "1", "--train.generate", "3", "--data.skip_bad_media", "true",
            "--model.encoders.image.dynamic_resolution", "true", "--checkpoint.export_hf", "none",
            "--layout.language.offset", "0", "--pipeline.microbatches", "1"]
    accuracy = run_on_ranks(_run_in, 1, str(tmp_path / "run"), argv, timeout=300)[0]
    assert accuracy is not None
    with open(tmp_path / "run" / "m.jsonl") as f:
        evaluated = [r for r in map(json.loads, f) if "heldout_answer" in r]
    assert len(evaluated) == 1


def test_an_unreadable_header_in_the_first_training_sample_does_not_cost_the_export(tiny: str, tmp_path) -> None:
    """The export reads the placeholder ids from training sample 0's row: where that sample's
    image header cannot be read (dynamic_resolution) and data.skip_bad_media leaves it out of
    every step, the export raised its MediaError after the last step and wrote nothing."""
    from tests.harness import run_on_ranks

    shutil.copytree(tiny, tmp_path / "run")
    train = tmp_path / "run" / "data" / "train.jsonl"
    samples = [json.loads(line) for line in open(train)]
    first = next(s for s in samples if "image" in s)
    with open(train, "w") as f:  # the imaged sample first: dataset index 0
        f.writelines(json.dumps(s) + "\n" for s in [first] + [s for s in samples if s is not first])
    _emptied_image(str(tmp_path / "run" / "data"), first)
    argv = [*ARGS, "--train.steps", "1", "--data.heldout", "none", "--data.skip_bad_media", "true",
            "--model.encoders.image.dynamic_resolution", "true", "--layout.language.offset", "0",
            "--pipeline.microbatches", "1", "--checkpoint.export_dtype", "bfloat16"]
    run_on_ranks(_run_in, 1, str(tmp_path / "run"), argv, timeout=300)
    assert os.path.exists(tmp_path / "run" / "out" / "hf" / "config.json")
    # every tensor written in checkpoint.export_dtype (the run trains in float32)
    from safetensors import safe_open

    shards = [n for n in os.listdir(tmp_path / "run" / "out" / "hf") if n.endswith(".safetensors")]
    dtypes = set()
    for name in shards:
        with safe_open(str(tmp_path / "run" / "out" / "hf" / name), "pt") as f:
            dtypes |= {f.get_slice(k).get_dtype() for k in f.keys()}
    assert shards and dtypes == {"BF16"}, (shards, dtypes)


def _row_weights_per_step(cwd: str, argv: list[str]) -> list[list[float]]:
    """`_run_in`, recording the loss weight of each row of every batch a step trained on (what
    `train_step` was handed and returned from): ``[step][row]``."""
    from dtensor_mimo.data import IGNORE_INDEX
    from dtensor_mimo.train import trainer

    step = trainer.train_step
    seen = []

    def recording(model, optimizer, batch, *args, **kwargs):
        metrics = step(model, optimizer, batch, *args, **kwargs)
        weights = torch.where(batch.labels == IGNORE_INDEX, 0.0, batch.loss_mask.float()).sum(1)
        seen.append(weights.tolist())
        return metrics

    trainer.train_step = recording
    try:
        _run_in(cwd, argv)
    finally:
        trainer.train_step = step
    return seen


def test_a_skipped_sample_has_no_loss_weight_in_its_step(tiny: str, tmp_path) -> None:
    """data.skip_bad_media leaves a sample whose image fails to decode out of its step: its row
    (tokens and labels intact, its image zeros) has no loss weight, every other row the weight
    it has when nothing is broken. Counting the skipped samples did not show a step that trained
    the row on a zero image."""
    from dtensor_mimo.data import ResumableBatchSampler
    from dtensor_mimo.train.config import parse_args
    from tests.harness import run_on_ranks

    shutil.copytree(tiny, tmp_path / "intact")
    (sid, _), = _copy_with_a_truncated_image(tiny, tmp_path / "broken", ("train",)).values()
    argv = [*ARGS, "--data.skip_bad_media", "true", "--data.heldout", "none", "--checkpoint.export_hf", "none",
            "--layout.language.offset", "0", "--pipeline.microbatches", "1"]
    intact = run_on_ranks(_row_weights_per_step, 1, str(tmp_path / "intact"), argv, timeout=300)[0]
    broken = run_on_ranks(_row_weights_per_step, 1, str(tmp_path / "broken"), argv, timeout=300)[0]
    with open(tmp_path / "broken" / "data" / "train.jsonl") as f:
        index = [json.loads(line)["id"] for line in f].index(sid)
    seed = parse_args(argv).data.seed
    order = [b for _, b in zip(range(4), ResumableBatchSampler(32, 8, seed=seed))]
    step, row = next((s, b.index(index)) for s, b in enumerate(order) if index in b)
    assert len(intact) == len(broken) == 4 and intact[step][row] > 0
    expected = [list(w) for w in intact]
    expected[step][row] = 0.0
    assert broken == expected, f"sample {sid!r} (step {step + 1}, row {row}) trained on while skipped"
