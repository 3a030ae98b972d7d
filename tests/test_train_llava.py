"""Train on your data: Hugging Face checkpoints and LLaVA conversations through the trainer.

Tiny random checkpoints (Qwen2 + byte-level BPE tokenizer with a ChatML template, SigLIP, Whisper)
and a dataset of coloured-shape images, text-only samples and tones are written with transformers
by `examples/make_tiny_llava.py` (no download).

| test                                        | what                                                        |
|---------------------------------------------|-------------------------------------------------------------|
| test_rows_label_the_assistant_tokens_only   | placeholders expanded to the tower's tokens; labels decode to each answer + end of turn |
| test_prompts_stop_at_the_first_answer_with_their_items | generation prompts: cut at the first answer, only earlier items; a truncated answer is not prompted |
| test_a_heldout_answer_cut_by_truncation_is_not_prompted | nor is one cut short (a fragment, no end of turn) |
| test_long_samples_refused_or_truncated      | a sample over seq_len names its id; truncation drops a cut item whole |
| test_packed_rows_equal_their_samples_alone  | data.pack: every sample once; a packed row's logits and labels == each sample's alone; the launcher's checks pack nothing |
| test_packed_rows_do_not_depend_on_the_layout | data.pack: the same rows whatever the layout rounds seq_len to |
| test_bad_input_fails_before_any_process     | missing dirs/files, unsupported architecture, placeholder count, tokenizer without template, processor size, checkpoint.load without checkpoints |
| test_placeholders_unlike_the_items_past_the_checked_samples_name_the_file_and_sample |     |
|                                             | image + audio encoders: a placeholder count unlike the items, |
|                                             | launcher or rank, names data.path, the sample, the fix |
| test_heldout_scores_of_an_encoder_no_heldout_sample_has_are_json_null | held-out data without audio:   |
|                                             | heldout_with_audio is JSON null in metrics.jsonl, not NaN |
| test_a_decoder_smaller_than_its_tokenizer_fails_before_any_process | vocab < tokenizer: launcher |
| test_a_llava_projector_that_cannot_load_fails_before_any_process | LLaVA projector misfit: launcher |
| test_an_error_inside_the_ranks_is_printed_once | a factory raising on every rank: one traceback, the ranks named |
| test_layouts_give_one_process_numbers       | image dp1 / language dp1 [2], colocated dp2 [2]: losses and grad norms == one process [1]; loader workers; resume == uninterrupted; load under another layout |
| test_factories_build_the_modules            | model.language.factory / model.encoders.<name>.factory: your functions' modules, with the offered arguments, train |
| test_a_factory_encoder_takes_images_that_come_after_the_checked_samples | no checked sample has an image: the size from a blank one |
| test_an_evaluation_leaves_a_dropout_encoders_training_as_it_was | a factory encoder with dropout: |
|                                             | losses and held-out scores with eval_every 1 == without |
| test_learns_heterogeneous (`make learn`)    | the README's file, 600 steps: held-out accuracy well above chance |
| test_export_answers_like_the_trainer        | 150 steps: the export loads in transformers and its greedy answers are ours |
| test_whisper_encoder_learns_audio           | a Whisper directory's encoder on tone conversations          |
| test_a_second_stage_starts_from_the_first_stages_llava_export | stage 1 (tower and decoder frozen: `model.language.frozen`) moves the projector alone and exports LLaVA; stage 2 with both `hf` = that export starts from its tensors, bit for bit |
| test_fit_image_size_keeps_the_aspect_within_the_budget | dynamic resolution's resize: sizes worked out by hand |
| test_dynamic_resolution_expands_each_image_to_its_own_rows | SigLIP dynamic_resolution: each placeholder -> (H/4)(W/4) rows; per-item inputs == PIL bicubic resize; per-rank loading; one-process forward |
| test_truncation_cuts_at_item_boundaries_of_their_own_sizes | truncation inside the second (24-row) / first image drops it whole |
| test_variable_length_clips_keep_their_own_length | Whisper variable_length: frames = samples // hop, features == the extractor on the clip alone; audio_max_seconds, max_patches checked |
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from dtensor_mimo.train.config import ConfigError, parse_args
from tests.harness import run_on_ranks

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

ROOT = os.path.join(os.path.dirname(__file__), "..")
CONFIG = os.path.abspath(os.path.join(ROOT, "examples", "llava_tiny.toml"))
_spec = importlib.util.spec_from_file_location("make_tiny_llava", os.path.join(ROOT, "examples", "make_tiny_llava.py"))
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)

QUICK = ["--metrics.progress", "off", "--train.generate", "0", "--metrics.log_every", "1",
         "--lr_schedule.warmup_steps", "2"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("tiny_llava"))
    make.write_checkpoints(out)
    make.write_data(out, train=512, val=48, audio_train=128, audio_val=32)
    return out


def _train(cwd: str, argv: list[str], config: str = CONFIG) -> dict:
    """One trainer run on this rank (called on every rank by `run_on_ranks`): held-out accuracy
    and the greedy answers it printed."""
    from dtensor_mimo.train.trainer import Trainer

    here = os.getcwd()
    os.chdir(cwd)
    try:
        trainer = Trainer(parse_args(["--config", config, *argv]))
        trainer.run()
        n = trainer.config.train.generate
        return {**trainer.heldout_scores, "answers": trainer.answers(n) if n else []}
    finally:
        os.chdir(here)


def _run(cwd: str, argv: list[str], config: str = CONFIG) -> dict:
    from dtensor_mimo.train.config import build_layout

    world = build_layout(parse_args(["--config", config, *argv])).world_size
    results = run_on_ranks(_train, world, cwd, argv, config, timeout=300)
    assert all(r == results[0] for r in results)  # every rank reports the same
    return results[0]


def _records(path: str) -> dict[int, dict]:
    with open(path) as f:
        return {r["step"]: r for r in map(json.loads, f) if "loss" in r}


# ---------------------------------------------------------------------------- rows


def _dataset(tiny: str, *argv: str, config: str = CONFIG, ahead: bool = False):
    from dtensor_mimo.train.datasets import train_data
    from dtensor_mimo.train.modules import resolve

    cwd = os.getcwd()
    os.chdir(tiny)
    try:
        config = parse_args(["--config", config, *argv])
        resolved = resolve(config)
        return train_data(config, resolved, ahead), resolved.tokenizer
    finally:
        os.chdir(cwd)


def test_rows_label_the_assistant_tokens_only(tiny: str) -> None:
    data, tokenizer = _dataset(tiny)
    samples = [json.loads(line) for line in open(os.path.join(tiny, "data", "train.jsonl"))]
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    for index in range(12):
        sample, row = samples[index], data.train[index]
        images = sample.get("image", [])
        images = [images] if isinstance(images, str) else images
        assert row.tokens.count(image_id) == 16 * len(images)  # 16 patches per 16x16 image
        answer_ids = [t for t in row.labels if t != -100]
        assert tokenizer.decode(answer_ids) == sample["conversations"][1]["value"] + "<|im_end|>"  # not the "\n" after
        for t, label in enumerate(row.labels):  # next-token targets, on assistant tokens only
            assert label == -100 or label == row.tokens[t + 1]
        prompt = tokenizer.decode(row.tokens[:row.answers[0][0]]).replace("<image>" * 16, "<image>")
        question = sample["conversations"][0]["value"]
        assert prompt == f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    batch = data.train.batch(list(range(12)))
    assert batch.tokens.shape == (12, 96) and batch.modalities["image"].tokens_per_item == 16
    assert batch.modalities["image"].inputs.shape[1:] == (3, 16, 16)
    # A rank that encodes no image reads none: zeros without memory.
    assert batch.modalities["image"].inputs.abs().sum() > 0
    assert data.train.batch(list(range(12)), load={}).modalities["image"].inputs.stride()[0] == 0


def test_long_samples_refused_or_truncated(tiny: str) -> None:
    data, tokenizer = _dataset(tiny, "--data.seq_len", "40")
    two = next(i for i, s in enumerate(data.train.samples) if isinstance(s.get("image"), list))
    with pytest.raises(Exception, match=f"sample 'train-{two}' has \\d+ tokens, more than data.seq_len = 40"):
        data.train[two]
    data, _ = _dataset(tiny, "--data.seq_len", "28", "--data.truncate", "true")
    row = data.train[two]  # the second image's 16 tokens would cross position 28: dropped whole
    assert len(row.tokens) <= 28 and len(row.items["image"]) == 1
    assert row.tokens.count(tokenizer.convert_tokens_to_ids("<image>")) == 16
    batch = data.train.batch([two])
    assert batch.modalities["image"].items_per_sample == (1,)


def test_a_malformed_turn_past_the_checked_samples_names_its_sample(tiny: str) -> None:
    """The launcher checks the first 256 samples; a bad turn further on is a DataError naming the
    file and the sample when a rank reads it (it was a bare KeyError or TypeError)."""
    from dtensor_mimo.data.conversation import DataError

    good = {"conversations": [{"from": "human", "value": "repeat : red"}, {"from": "gpt", "value": "red"}]}
    bad = {"t-300": [{"from": "bot", "value": "hi"}, {"from": "gpt", "value": "red"}],
           "t-301": [{"from": "human", "text": "hi"}, {"from": "gpt", "value": "red"}],
           "t-302": ["hi", {"from": "gpt", "value": "red"}],
           "t-303": [{"from": "human", "value": "hi"}]}
    path = os.path.join(tiny, "data", "late_bad.jsonl")
    with open(path, "w") as f:
        for k in range(300):
            f.write(json.dumps({"id": f"t-{k}", **good}) + "\n")
        for sid, turns in bad.items():
            f.write(json.dumps({"id": sid, "conversations": turns}) + "\n")
    data, _ = _dataset(tiny, "--data.path", "data/late_bad.jsonl", "--data.heldout", "none")
    assert len(data.train.batch(range(8)).tokens) == 8
    for index, sid in enumerate(bad, start=300):
        with pytest.raises(DataError, match=f"data.path = 'data/late_bad.jsonl': sample '{sid}'"):
            data.train.batch([index])


def test_items_no_encoder_takes_past_the_checked_samples_are_refused(tiny: str) -> None:
    """The launcher refuses a sample with items (or a placeholder) of a modality no encoder takes
    among the first 256; one further on is a DataError naming the sample when a rank reads it
    (its clip was silently left out and its "<audio>" trained on as text)."""
    from dtensor_mimo.data.conversation import DataError

    good = {"conversations": [{"from": "human", "value": "repeat : red"}, {"from": "gpt", "value": "red"}]}
    tone = next(os.path.join("audio", f) for f in sorted(os.listdir(os.path.join(tiny, "data", "audio"))))
    bad = {"t-300": {"audio": tone, "conversations": [{"from": "human", "value": "<audio>\nhow does it sound ?"},
                                                      {"from": "gpt", "value": "low"}]},
           "t-301": {"conversations": [{"from": "human", "value": "<audio>\nhow does it sound ?"},
                                       {"from": "gpt", "value": "low"}]}}
    with open(os.path.join(tiny, "data", "late_audio.jsonl"), "w") as f:
        for k in range(300):
            f.write(json.dumps({"id": f"t-{k}", **good}) + "\n")
        for sid, sample in bad.items():
            f.write(json.dumps({"id": sid, **sample}) + "\n")
    data, _ = _dataset(tiny, "--data.path", "data/late_audio.jsonl", "--data.heldout", "none")  # image encoder only
    assert len(data.train.batch(range(8)).tokens) == 8
    for index, sid in enumerate(bad, start=300):
        with pytest.raises(DataError, match=f"data.path = 'data/late_audio.jsonl': sample '{sid}' has audio items "
                                            r"but no encoder takes 'audio' \(model.encoders.<name>.modality\)"):
            data.train.batch([index])


def test_placeholders_unlike_the_items_past_the_checked_samples_name_the_file_and_sample(tiny: str) -> None:
    """An image and an audio encoder: the launcher refuses a sample whose placeholders of a
    modality are not as many as its items among the first 256 (naming data.path, the sample and the
    fix); one further on, with its placeholders in a later turn, is refused by a rank in the same
    words (counted as the chat template renders its turns). It was "sample 't-300': 1 <image>
    token(s) after tokenization but 2 item(s)": no file (data.path or data.heldout?), no fix."""
    from dtensor_mimo.data.conversation import DataError

    good = {"conversations": [{"from": "human", "value": "repeat : red"}, {"from": "gpt", "value": "red"}]}
    data_dir = os.path.join(tiny, "data")
    tone = next(os.path.join("audio", f) for f in sorted(os.listdir(os.path.join(data_dir, "audio"))))
    images = [os.path.join("images", f) for f in sorted(os.listdir(os.path.join(data_dir, "images")))[:2]]
    turns = [{"from": "human", "value": "repeat : red"}, {"from": "gpt", "value": "red"}]
    bad = {"t-300": {"image": images, "audio": tone, "conversations": [
               *turns, {"from": "human", "value": "<audio> and <image> ?"}, {"from": "gpt", "value": "low"}]},
           "t-301": {"audio": [tone], "image": images[0], "conversations": [
               *turns, {"from": "human", "value": "<image> <audio> <audio> ?"}, {"from": "gpt", "value": "low"}]}}
    expected = {"t-300": ("1 <image> placeholder(s)", "but 2 image item(s); put one <image> in the text"),
                "t-301": ("2 <audio> placeholder(s)", "but 1 audio item(s); put one <audio> in the text")}
    rendered = " (in its turns as the chat template renders them) "
    audio = ["--model.encoders.audio.hf", "ckpt/whisper", "--model.encoders.audio.modality", "audio"]
    for late in (False, True):
        path = os.path.join(data_dir, f"count_{late}.jsonl")
        with open(path, "w") as f:
            for k in range(300 if late else 0):
                f.write(json.dumps({"id": f"t-{k}", **good}) + "\n")
            for sid, sample in bad.items():
                f.write(json.dumps({"id": sid, **sample}) + "\n")
            f.write(json.dumps({"id": "fine", **good}) + "\n")
        argv = ["--data.path", f"data/count_{late}.jsonl", "--data.heldout", "none", "--data.batch_size", "2", *audio]
        if not late:  # the launcher's check names the first
            with pytest.raises(ConfigError, match=re.escape(f"data.path = 'data/count_{late}.jsonl': sample 't-300' "
                                                            f"has {' '.join(expected['t-300'])}")):
                _dataset(tiny, *argv)
            continue
        data, _ = _dataset(tiny, *argv)
        assert data.train.batch([0, 302]).modalities["audio"].items_per_sample == (0, 0)
        for index, sid in enumerate(bad, start=300):
            with pytest.raises(DataError, match=re.escape(f"data.path = 'data/count_{late}.jsonl': sample {sid!r} "
                                                          f"has {rendered.join(expected[sid])}")):
                data.train.batch([index])


def _strict_json(line: str) -> dict:
    """A JSON line as RFC 8259 has it (JavaScript's JSON.parse, Go's encoding/json): no NaN / Infinity."""
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON: {line.strip()}")
    return json.loads(line, parse_constant=refuse)


def test_heldout_scores_of_an_encoder_no_heldout_sample_has_are_json_null(tiny: str, tmp_path) -> None:
    """An image and an audio encoder, held-out samples with images only: the part "with audio"
    counts no answer. metrics.jsonl (one JSON object per record, as the docs say) wrote it as
    ``"heldout_with_audio": NaN``, which no JSON parser but Python's reads (every record after it
    unreadable to JSON.parse, Go, jq streams...); it is null, as an MFU the run cannot know is."""
    argv = [*ORACLE, "--train.steps", "1", "--lr_schedule.warmup_steps", "0", "--data.heldout_samples", "4",
            "--metrics.jsonl", str(tmp_path / "m.jsonl"),
            "--data.path", "data/mixed_audio.jsonl", "--model.encoders.audio.hf", "ckpt/whisper",
            "--model.encoders.audio.modality", "audio", "--layout.image.offset", "0", "--layout.audio.offset", "0",
            "--layout.language.offset", "0"]
    images = [json.loads(line) for line in open(os.path.join(tiny, "data", "train.jsonl"))][:8]
    tones = [json.loads(line) for line in open(os.path.join(tiny, "data", "audio_train.jsonl"))][:8]
    with open(os.path.join(tiny, "data", "mixed_audio.jsonl"), "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in images + tones)
    result = _run(tiny, argv)
    assert result["with image"] >= 0 and result["with audio"] != result["with audio"]  # NaN: nothing counted
    records = [_strict_json(line) for line in open(tmp_path / "m.jsonl")]
    scores = next(r for r in records if "heldout_answer" in r)
    assert scores["heldout_with_audio"] is None and isinstance(scores["heldout_with_image"], float)
    assert isinstance(records[0]["loss"], float) and records[0]["mfu"] is None


def test_answers_end_at_the_end_of_turn_token_when_eos_is_another(tiny: str, tmp_path) -> None:
    """A base tokenizer whose eos is not the template's end of turn (Qwen2 / Qwen2.5 / Qwen3 base:
    eos <|endoftext|>, ChatML turns ending "<|im_end|>\\n"): labels stop at <|im_end|> as with the
    instruct tokenizer, not at the "\\n" after it, and generation stops at <|im_end|> (it stopped
    at the first "\\n", cutting a multi-line answer)."""
    base = transformers.AutoTokenizer.from_pretrained(os.path.join(tiny, "ckpt", "lm"))
    base.eos_token = "<|endoftext|>"
    base.save_pretrained(str(tmp_path / "base"))
    data, tokenizer = _dataset(tiny, "--data.tokenizer", str(tmp_path / "base"))
    assert tokenizer.eos_token == "<|endoftext|>"
    samples = [json.loads(line) for line in open(os.path.join(tiny, "data", "train.jsonl"))]
    for index in range(8):
        row = data.train[index]
        answer_ids = [t for t in row.labels if t != -100]
        assert tokenizer.decode(answer_ids) == samples[index]["conversations"][1]["value"] + "<|im_end|>"
    _, _, stop = data.prompt(0)
    assert stop == tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("samples", [256, 257])
def test_seq_len_zero_takes_the_longest_of_a_corpus_of_the_checked_size(tiny: str, samples: int) -> None:
    """data.seq_len = 0 needs the whole corpus tokenized: taken for one of exactly the checked
    samples (256), refused past them."""
    conv = {"conversations": [{"from": "human", "value": "repeat : red"}, {"from": "gpt", "value": "red"}]}
    with open(os.path.join(tiny, "data", f"n{samples}.jsonl"), "w") as f:
        f.writelines(json.dumps({"id": f"t-{k}", **conv}) + "\n" for k in range(samples))
    argv = ["--data.path", f"data/n{samples}.jsonl", "--data.heldout", "none", "--data.seq_len", "0"]
    if samples == 256:
        assert len(_dataset(tiny, *argv)[0].train) == 256
    else:
        with pytest.raises(ConfigError, match="data.seq_len = 0 takes the longest sample's length"):
            _dataset(tiny, *argv)


def test_a_malformed_sample_right_after_the_checked_ones_is_a_config_error(tiny: str) -> None:
    """Whether the checked head is the whole corpus reads one sample more: one that is no JSON is
    the launcher's ConfigError naming it, not a DataError traceback."""
    conv = {"conversations": [{"from": "human", "value": "repeat : red"}, {"from": "gpt", "value": "red"}]}
    with open(os.path.join(tiny, "data", "n256bad.jsonl"), "w") as f:
        f.writelines(json.dumps({"id": f"t-{k}", **conv}) + "\n" for k in range(256))
        f.write("{not json\n")
    with pytest.raises(ConfigError, match=r"n256bad.jsonl: the line at byte \d+ \(sample 256 of the file\)"):
        _dataset(tiny, "--data.path", "data/n256bad.jsonl", "--data.heldout", "none")


def test_images_none_of_which_decode_are_a_config_error(tiny: str, tmp_path) -> None:
    """The launcher probes each encoder's processor on a file that decodes; when none of the first
    8 does, a ConfigError naming the encoder and the first file (was the decoder's traceback)."""
    shutil.copytree(tiny, tmp_path / "t")
    for root, _, files in os.walk(tmp_path / "t" / "data"):
        for name in files:
            if name.endswith(".png"):
                with open(os.path.join(root, name), "wb") as f:
                    f.write(b"not a png")
    with pytest.raises(ConfigError, match=r"model.encoders.image: none of the first 8 image files decodes through its "
                                          r"processor \(.*\.png: UnidentifiedImageError"):
        _dataset(str(tmp_path / "t"))


def test_prompts_stop_at_the_first_answer_with_their_items(tiny: str, tmp_path) -> None:
    """Generation starts from the prompt alone: a later turn's image goes with its tokens, and a
    sample whose answer was truncated away is not prompted."""
    turns = [{"from": "human", "value": "<image>\nwhat is in the image ?"}, {"from": "gpt", "value": "a red bar"},
             {"from": "human", "value": "<image>\nand this ?"}, {"from": "gpt", "value": "a blue ring"}]
    path = tmp_path / "two.jsonl"
    path.write_text(json.dumps({"id": "two-turns", "image": ["images/train-0-0.png", "images/train-0-1.png"],
                                "conversations": turns}) + "\n")
    data, tokenizer = _dataset(tiny, "--data.heldout", str(path), "--data.root", "data")
    whole, prompt = data.heldout.batch([0]), data.heldout.prompts([0])
    start = data.heldout[0].answers[0][0]
    assert whole.modalities["image"].items_per_sample == (2,) and prompt.modalities["image"].items_per_sample == (1,)
    assert torch.equal(prompt.tokens[0, :start], whole.tokens[0, :start])
    assert (prompt.tokens[0, start:] == tokenizer.pad_token_id).all()
    assert torch.equal(prompt.modalities["image"].inputs[0], whole.modalities["image"].inputs[0])
    assert data.prompt(0)[1] == "a red bar"
    assert len(data.heldout[0].answers) == 2  # both answers are scored
    short, _ = _dataset(tiny, "--data.heldout", str(path), "--data.root", "data", "--data.seq_len", "24",
                        "--data.truncate", "true")
    assert not short.heldout[0].answers and short.prompt(0) is None


def test_a_heldout_sample_longer_than_the_training_ones_at_seq_len_0_is_named_as_such(tiny: str, tmp_path) -> None:
    """data.seq_len = 0 takes the training samples' longest length: a longer held-out sample is
    refused naming data.heldout and where the length came from, not a data.seq_len nobody wrote."""
    small, long = tmp_path / "small.jsonl", tmp_path / "long.jsonl"
    small.write_text("".join(open(os.path.join(tiny, "data", "train.jsonl")).readlines()[:4]))
    long.write_text(json.dumps({"id": "long", "conversations": [
        {"from": "human", "value": "what is this ? " * 40}, {"from": "gpt", "value": "a red bar"}]}) + "\n")
    _preflight(tiny, ["--data.path", str(small), "--data.heldout", str(long), "--data.root", "data",
                      "--data.seq_len", "0"], " (data.seq_len = 0 took the longest training sample's length, ")


def _logits(modules: dict, batch) -> torch.Tensor:
    """A one-process forward of the trainer's modules on a fully loaded batch."""
    from dtensor_mimo.assemble import assemble, embed_text

    ids = batch.special_token_ids
    llama = modules["language"]
    with torch.no_grad():
        rows = {n: modules[n](m.inputs) for n, m in batch.modalities.items()}
        h = assemble(embed_text(llama.tok_embeddings, batch.tokens, ids), batch.tokens, rows, ids)
        return llama(h=h, positions=batch.positions, document_ids=batch.document_ids)


def test_packed_rows_equal_their_samples_alone(tiny: str) -> None:
    from dtensor_mimo.train.modules import build_modules, resolve

    packed, _ = _dataset(tiny, "--data.pack", "true")
    alone, _ = _dataset(tiny)
    assert len(packed.train) < len(alone.train) and sorted(sum(packed.train.rows, [])) == list(range(512))
    # The launcher's checks before the ranks start tokenize only the checked samples, not the corpus.
    launcher, _ = _dataset(tiny, "--data.pack", "true", ahead=True)
    assert launcher.train.rows is None and len(launcher.train._cache) <= 256
    # So a batch of more rows than packing makes is refused by the ranks, each naming the count.
    from tests.harness import DistributedTestFailure

    with pytest.raises(DistributedTestFailure) as refused:
        _run(tiny, ["--data.pack", "true", "--data.batch_size", str(len(packed.train) + 1)])
    message = f"data.batch_size = {len(packed.train) + 1} is more than the {len(packed.train)} training rows"
    assert str(refused.value).count(message) == 2, str(refused.value)[-2000:]
    config = parse_args(["--config", CONFIG])
    cwd = os.getcwd()
    os.chdir(tiny)
    try:
        modules = build_modules(config, resolve(config), 96, meta=False)
    finally:
        os.chdir(cwd)
    rows = [r for r in range(len(packed.train)) if len(packed.train.rows[r]) > 1][:3]
    batch = packed.train.batch(rows)
    got = _logits(modules, batch)
    for b, row in enumerate(rows):
        start = 0
        for index in packed.train.rows[row]:
            one = alone.train.batch([index])
            n = len(alone.train[index].tokens)
            assert torch.equal(batch.labels[b, start:start + n], one.labels[0, :n])
            # each document's positions from 0 (documented): with rotary embeddings alone a document's
            # constant offset changes no logit, so the logits below cannot tell (a user decoder's
            # absolute positions would)
            assert batch.positions[b, start:start + n].tolist() == list(range(n)), (row, index)
            torch.testing.assert_close(got[b, start:start + n], _logits(modules, one)[0, :n], rtol=1e-5, atol=1e-5)
            start += n


def test_packed_rows_do_not_depend_on_the_layout(tiny: str) -> None:
    """data.pack's rows are the same whatever the layout rounds data.seq_len to (language tp 2
    pads rows of 149 to 150): a checkpoint loaded under another layout (checkpoint.load) resumes
    at its sampler position over the same rows. Packed to the rounded length, the rows differed
    while their count stayed 192, so the check of the data position let the resume through and
    the rest of the epoch drew other samples (some twice, some never)."""
    one, _ = _dataset(tiny, "--data.pack", "true", "--data.seq_len", "149")
    tp2, _ = _dataset(tiny, "--data.pack", "true", "--data.seq_len", "149", "--layout.language.tp", "2")
    assert (one.seq_len, tp2.seq_len) == (149, 150)  # the rows are padded to the layout's multiple
    assert len(tp2.train) == len(one.train)  # what the checkpoint's data position is checked by
    assert tp2.train.rows == one.train.rows
    assert sorted(sum(tp2.train.rows, [])) == list(range(512))


def _preflight(tiny: str, argv: list[str], message: str) -> None:
    from dtensor_mimo.train.launch import preflight

    cwd = os.getcwd()
    os.chdir(tiny)
    try:
        with pytest.raises(ConfigError) as e:
            preflight(parse_args(["--config", CONFIG, *argv]))
        assert message in str(e.value), str(e.value)
    finally:
        os.chdir(cwd)


def test_bad_input_fails_before_any_process(tiny: str, tmp_path) -> None:
    _preflight(tiny, ["--model.language.hf", "ckpt/nope"], "model.language.hf = 'ckpt/nope': no such directory")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    _preflight(tiny, ["--model.encoders.image.hf", str(gpt2)], "model_type 'gpt2' is not a vision tower")
    _preflight(tiny, ["--model.language.hf", str(gpt2), "--data.tokenizer", "ckpt/lm"],
               "model_type 'gpt2' is not a Llama-family decoder")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "two-for-one", "image": ["images/train-0-0.png", "images/train-0-1.png"],
                               "conversations": [{"from": "human", "value": "<image> what ?"},
                                                 {"from": "gpt", "value": "a red bar"}]}) + "\n")
    _preflight(tiny, ["--data.path", str(bad)], "sample 'two-for-one' has 1 <image> placeholder(s) but 2 image item(s)")
    bad.write_text(json.dumps({"id": "lost", "image": "images/missing.png", "conversations": [
        {"from": "human", "value": "<image> what ?"}, {"from": "gpt", "value": "a red bar"}]}) + "\n")
    _preflight(tiny, ["--data.path", str(bad)], "images/missing.png does not exist")
    plain = tmp_path / "plain"
    shutil.copytree(os.path.join(tiny, "ckpt", "lm"), plain)
    os.remove(plain / "chat_template.jinja")
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    _preflight(tiny, ["--data.tokenizer", str(plain)], "the tokenizer has no chat_template")
    big = tmp_path / "big"
    shutil.copytree(os.path.join(tiny, "ckpt", "siglip"), big)
    proc = json.loads((big / "preprocessor_config.json").read_text())
    proc["size"] = {"height": 32, "width": 32}
    (big / "preprocessor_config.json").write_text(json.dumps(proc))
    _preflight(tiny, ["--model.encoders.image.processor", str(big)],
               "images/train-0-0.png into [3, 32, 32] but the encoder takes [3, 16, 16]")
    _preflight(tiny, ["--checkpoint.load", str(tmp_path)], "is neither a checkpoint (no .metadata) nor a directory")
    # The command prints the error once and starts no process.
    out = subprocess.run([sys.executable, "-m", "dtensor_mimo.train", "--config", CONFIG, "--data.path", str(bad)],
                         capture_output=True, text=True, timeout=120, cwd=tiny)
    assert out.returncode == 2 and out.stderr.count("does not exist") == 1 and "Traceback" not in out.stderr


def _qwen2(path, vocab_size: int, hidden_size: int = 64) -> None:
    config = transformers.Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)


def test_a_decoder_smaller_than_its_tokenizer_fails_before_any_process(tiny: str, tmp_path) -> None:
    """A decoder whose vocab_size is less than the tokenizer's text ids passed the launcher's checks:
    every rank built and loaded its modules, then refused the first batch holding such an id (any
    step: a rare token's sample may come late)."""
    from dtensor_mimo.train.launch import preflight

    tokens = len(transformers.AutoTokenizer.from_pretrained(os.path.join(tiny, "ckpt", "lm")))  # no <image> yet
    assert tokens > 128
    _qwen2(tmp_path / "small", 128)
    _preflight(tiny, ["--model.language.hf", str(tmp_path / "small"), "--data.tokenizer", "ckpt/lm"],
               f"vocab_size = 128 is less than the {tokens} token ids of the tokenizer")
    # Exactly the text's ids: the <image> placeholder the trainer adds lies past them, which is fine.
    _qwen2(tmp_path / "exact", tokens)
    cwd = os.getcwd()
    os.chdir(tiny)
    try:
        preflight(parse_args(["--config", CONFIG, "--model.language.hf", str(tmp_path / "exact"),
                              "--data.tokenizer", "ckpt/lm", "--checkpoint.export_hf", "none"]))
    finally:
        os.chdir(cwd)


def test_pipeline_stages_past_a_directorys_layers_fail_before_any_process(tiny: str) -> None:
    """More pipeline stages than a Hugging Face directory's blocks (the tiny decoder and SigLIP tower
    have 2) passed the launcher's checks: every rank started and built its meshes, then MimoModel
    refused the layout on each of them."""
    _preflight(tiny, ["--layout.language.pp", "4", "--pipeline.microbatches", "4"], "layout.language.pp = 4 cuts "
               "the language model into 4 pipeline stages, but model.language.hf = 'ckpt/lm' (2 layers) gives it "
               "2 block(s)")
    _preflight(tiny, ["--layout.image.pp", "3"], "layout.image.pp = 3 cuts encoder 'image' into 3 pipeline stages, "
               "but model.encoders.image.hf = 'ckpt/siglip' (2 blocks to its features) gives it 2 block(s)")
    _preflight(tiny, ["--layout.language.pp", "2", "--pipeline.split", "[2, 1]"], "pipeline.split = [2, 1]: give the "
               "layers of each of the language model's 2 pipeline stages (layout.language.pp = 2), each >= 1, 2 in all")


def test_heldout_samples_past_those_scored_are_not_checked(tiny: str, tmp_path) -> None:
    """The launcher checked the first 256 held-out samples whatever data.heldout_samples said: a
    sample the run never scores (the 9th of 8 scored) refused the run. Only the scored ones are
    checked; all of them with data.heldout_samples = 0 (every sample) or more than are good."""
    from dtensor_mimo.train.launch import preflight

    with open(os.path.join(tiny, "data", "val.jsonl")) as f:
        good = [json.loads(line) for line in f][:8]
    bad = {"id": "two-for-one", "image": [good[0]["image"], good[1]["image"]],
           "conversations": [{"from": "human", "value": "<image> what ?"}, {"from": "gpt", "value": "a red bar"}]}
    path = tmp_path / "heldout.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in [*good, bad]))
    argv = ["--data.heldout", str(path), "--checkpoint.export_hf", "none"]
    cwd = os.getcwd()
    os.chdir(tiny)
    try:
        preflight(parse_args(["--config", CONFIG, *argv, "--data.heldout_samples", "8"]))
    finally:
        os.chdir(cwd)
    for scored in ("9", "0"):
        _preflight(tiny, [*argv, "--data.heldout_samples", scored],
                   "sample 'two-for-one' has 1 <image> placeholder(s) but 2 image item(s)")


def test_two_library_encoders_of_one_size_start_apart(tiny: str) -> None:
    """An image and a video ViT of one size, built from scratch: both took the default seed 10 and
    started with the same weights (two copies of one encoder). The default is 10 times the
    encoder's place in model.encoders: the first encoder starts as before (seed 10), the second
    otherwise (seed 20)."""
    from dtensor_mimo.models import ModalityEncoder, Projection, ViT
    from dtensor_mimo.train.modules import build_modules, resolve

    argv = ["--config", CONFIG, "--model.encoders.image.hf", "none", "--model.encoders.image.image_size", "16",
            "--model.encoders.video.modality", "video", "--model.encoders.video.image_size", "16",
            "--checkpoint.export_hf", "none"]
    cwd = os.getcwd()
    os.chdir(tiny)
    try:
        resolved = resolve(parse_args(argv))
    finally:
        os.chdir(cwd)
    modules = build_modules(parse_args(argv), resolved, 96, meta=False)
    image, video = (dict(modules[n].named_parameters()) for n in ("image", "video"))
    assert image.keys() == video.keys()
    assert all(not torch.equal(image[k], video[k]) for k in image if "norm" not in k and not k.endswith("bias"))
    dim = resolved.language.dim
    for name, seed in (("image", 10), ("video", 20)):  # each as a module initialized alone from that seed
        alone = ModalityEncoder(ViT(resolved.encoders[name].config), Projection(48, dim))
        alone.init_weights(seed)
        assert all(torch.equal(p, dict(modules[name].named_parameters())[k]) for k, p in alone.named_parameters())


def _llava(path, tiny: str, text_width: int, act: str = "gelu") -> None:
    vision = transformers.SiglipVisionConfig(image_size=16, patch_size=4, hidden_size=48, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=96)
    text = transformers.Qwen2Config(vocab_size=384, hidden_size=text_width, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=256, tie_word_embeddings=False)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=383,
                                      projector_hidden_act=act, vision_feature_layer=-1,
                                      vision_feature_select_strategy="full")
    transformers.LlavaForConditionalGeneration(config).save_pretrained(path)
    shutil.copy(os.path.join(tiny, "ckpt", "siglip", "preprocessor_config.json"), path)


def test_a_llava_projector_that_cannot_load_fails_before_any_process(tiny: str, tmp_path) -> None:
    """A LLaVA directory as an encoder brings its projector: one of another language model's width
    (the tiny decoder is 64 wide), or not Linear-GELU-Linear, passed the launcher's checks and was
    refused by load_hf on the ranks, after the meshes and modules were built."""
    from dtensor_mimo.train.launch import preflight

    _llava(tmp_path / "narrow", tiny, 32)
    _preflight(tiny, ["--model.encoders.image.hf", str(tmp_path / "narrow")],
               "its projector projects to its own language model's width, 32, but model.language is 64 wide")
    _llava(tmp_path / "relu", tiny, 64, act="relu")
    _preflight(tiny, ["--model.encoders.image.hf", str(tmp_path / "relu")], "projector_hidden_act='relu'")
    _llava(tmp_path / "fits", tiny, 64)
    cwd = os.getcwd()
    os.chdir(tiny)
    try:
        preflight(parse_args(["--config", CONFIG, "--model.encoders.image.hf", str(tmp_path / "fits"),
                              "--checkpoint.export_hf", "none"]))
    finally:
        os.chdir(cwd)


def failing_decoder(**_) -> torch.nn.Module:
    """A factory that fails inside every rank (after every check the launcher can make)."""
    raise ValueError("no decoder today")


def test_an_error_inside_the_ranks_is_printed_once(tiny: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(ROOT)}
    out = subprocess.run([sys.executable, "-m", "dtensor_mimo.train", "--config", CONFIG, "--model.language.hf",
                          "none", "--data.tokenizer", "ckpt/lm", "--model.language.factory",
                          "tests.test_train_llava:failing_decoder"],
                         capture_output=True, text=True, timeout=300, cwd=tiny, env=env)
    assert out.returncode == 1
    assert out.stderr.count("ValueError: no decoder today") == 2  # the traceback's last line, and the summary
    assert re.search(r"error on ranks? [0-9, ]+: ValueError: no decoder today", out.stderr), out.stderr[-2000:]
    assert out.stderr.count("Traceback") == 1


_SEMAPHORE_CHILD = """
import multiprocessing as mp, sys
from dtensor_mimo.train.launch import _exit_now

def rank():
    held = mp.RLock()  # as tqdm's lock, which inductor's compile progress creates in a rank
    _exit_now(0)

if __name__ == "__main__":
    child = mp.get_context("spawn").Process(target=rank)
    child.start()
    child.join()
    sys.exit(child.exitcode)
"""


def test_a_rank_ending_at_once_leaves_no_semaphore_behind(tmp_path) -> None:
    # A rank ends with os._exit; the launcher's resource tracker then warned, at the end of every
    # compiled run, of "leaked semaphore objects" until `_exit_now` ran its semaphore finalizers.
    script = tmp_path / "child.py"
    script.write_text(_SEMAPHORE_CHILD)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.path.abspath(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "leaked semaphore" not in out.stderr, out.stderr[-2000:]


# ---------------------------------------------------------------------------- training


ORACLE = [*QUICK, "--train.steps", "6", "--data.batch_size", "8", "--pipeline.microbatches", "2",
          "--checkpoint.export_hf", "none", "--data.heldout_samples", "8"]
COLOCATED = ["--layout.image.dp", "2", "--layout.image.offset", "0", "--layout.language.dp", "2",
             "--layout.language.offset", "0"]


def test_layouts_give_one_process_numbers(tiny: str, tmp_path) -> None:
    runs = {"one": ["--layout.language.offset", "0"], "heterogeneous": [], "colocated": COLOCATED}
    got = {}
    for name, layout in runs.items():
        argv = [*ORACLE, *layout, "--metrics.jsonl", str(tmp_path / f"{name}.jsonl"),
                "--checkpoint.dir", str(tmp_path / name), "--checkpoint.every", "3"]
        _run(tiny, argv)
        got[name] = _records(str(tmp_path / f"{name}.jsonl"))
    one = got["one"]
    assert sorted(one) == [1, 2, 3, 4, 5, 6]
    # The command itself (own launcher), with loader worker processes: the same losses, and no
    # process of the run left once the command has returned (its ranks end without teardown).
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    out = subprocess.run([sys.executable, "-m", "dtensor_mimo.train", "--config", CONFIG, *ORACLE, "--data.workers",
                          "1", "--metrics.jsonl", str(tmp_path / "w.jsonl")],
                         capture_output=True, text=True, timeout=300, cwd=tiny, env={**os.environ, "RUN_MARK": mark})
    assert out.returncode == 0, out.stderr[-3000:]
    assert _processes_marked(mark) == []
    workers = _records(str(tmp_path / "w.jsonl"))
    assert all(workers[s]["loss"] == got["heterogeneous"][s]["loss"] for s in one)
    for name in ("heterogeneous", "colocated"):
        for step, record in one.items():
            assert got[name][step]["loss"] == pytest.approx(record["loss"], rel=1e-5), (name, step)
            assert got[name][step]["grad_norm"] == pytest.approx(record["grad_norm"], rel=1e-4), (name, step)
    # Resume the heterogeneous run from its step 3: the same steps 4-6, exactly (batches prepared
    # ahead by the prefetch thread: the same batches, from the checkpoint's data position).
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "heterogeneous" / "step-000003", resumed / "step-000003")
    _run(tiny, [*ORACLE, "--checkpoint.dir", str(resumed), "--metrics.jsonl", str(tmp_path / "r.jsonl"),
                "--data.prefetch", "true"])
    again = _records(str(tmp_path / "r.jsonl"))
    assert sorted(again) == [4, 5, 6] and all(again[s]["loss"] == got["heterogeneous"][s]["loss"] for s in again)
    # Step 3 under the colocated layout (user module names in the checkpoint: model.image.*).
    _run(tiny, [*ORACLE, *COLOCATED, "--checkpoint.load", str(resumed / "step-000003"),
                  "--metrics.jsonl", str(tmp_path / "l.jsonl")])
    loaded = _records(str(tmp_path / "l.jsonl"))
    assert sorted(loaded) == [4, 5, 6]
    assert all(loaded[s]["loss"] == pytest.approx(one[s]["loss"], rel=1e-5) for s in loaded)
    from dtensor_mimo.train.checkpoint import resolve_load

    assert resolve_load(str(resumed)) == str(resumed / "step-000006")  # a directory of them: its latest


def _processes_marked(mark: str) -> list[int]:
    """The live processes whose environment has ``RUN_MARK=mark`` (Linux's /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"RUN_MARK={mark}".encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:  # ended meanwhile, or not ours to read
            pass
    return found


def _hf_answers(export: str, tiny: str, count: int) -> list[str]:
    """Greedy answers of the exported directory, in transformers, to the first held-out prompts."""
    model = transformers.LlavaForConditionalGeneration.from_pretrained(export, dtype=torch.float32).eval()
    processor = transformers.AutoProcessor.from_pretrained(export)
    from PIL import Image

    answers = []
    for line in open(os.path.join(tiny, "data", "val.jsonl")).readlines()[:count]:
        sample = json.loads(line)
        paths = sample.get("image", [])
        paths = [paths] if isinstance(paths, str) else paths
        images = [Image.open(os.path.join(tiny, "data", p)).convert("RGB") for p in paths] or None
        messages = [{"role": "user", "content": sample["conversations"][0]["value"]}]
        text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = processor(text=text, images=images, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
        new = out[0, inputs["input_ids"].shape[1]:]
        answers.append(processor.tokenizer.decode(new, skip_special_tokens=True).strip())
    return answers


def tiny_decoder(vocab_size: int, seq_len: int, dim: int = 32) -> torch.nn.Module:
    """A factory for the language model: the library's Llama, sized by the trainer's offer."""
    from dtensor_mimo.models import Llama, LlamaConfig

    assert seq_len == 96
    return Llama(LlamaConfig(vocab_size=vocab_size, dim=dim, n_layers=1, n_heads=2, ffn_hidden=64))


def tiny_vision(language_dim: int) -> torch.nn.Module:
    """A factory for an encoder: 16x16 images in 4x4 patches, projected to the decoder's width."""
    from dtensor_mimo.models import ModalityEncoder, Projection, ViT, ViTConfig

    vit = ViTConfig(image_size=16, patch_size=4, dim=24, n_layers=1, n_heads=2, mlp_hidden=48)
    return ModalityEncoder(ViT(vit), Projection(vit.dim, language_dim))


def _factory_run(cwd: str, argv: list[str]) -> tuple[str, str, list[float]]:
    from dtensor_mimo.train.trainer import Trainer

    here = os.getcwd()
    os.chdir(cwd)
    try:
        trainer = Trainer(parse_args(["--config", CONFIG, *argv]))
        trainer.run()
    finally:
        os.chdir(here)
    losses = []
    if dist.get_rank() == 0:  # the file rank 0 writes (another rank may finish before its last lines)
        with open(argv[argv.index("--metrics.jsonl") + 1]) as f:
            losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    return type(trainer.modules["language"]).__name__, str(trainer.modules["language"].config.dim), losses


def test_factories_build_the_modules(tiny: str, tmp_path) -> None:
    argv = [*ORACLE, "--train.steps", "8", "--optimizer.lr", "3e-3", "--metrics.jsonl", str(tmp_path / "f.jsonl"),
            "--model.language.hf", "none", "--data.tokenizer", "ckpt/lm",
            "--model.language.factory", "tests.test_train_llava:tiny_decoder",
            "--model.language.factory_args", "{dim = 48}",
            "--model.encoders.image.hf", "none", "--model.encoders.image.factory", "tests.test_train_llava:tiny_vision",
            "--model.encoders.image.processor", "ckpt/siglip", "--model.encoders.image.tokens_per_item", "16"]
    results = run_on_ranks(_factory_run, 2, tiny, argv, timeout=300)
    kind, dim, losses = results[0]
    assert (kind, dim) == ("Llama", "48") and len(losses) == 8
    assert losses[-1] < losses[0]



def dropout_vision(language_dim: int) -> torch.nn.Module:
    """`tiny_vision` whose projected rows go through dropout (p = 0.5) while the module trains."""
    from dtensor_mimo.models import ModalityEncoder, Projection, ViT, ViTConfig

    class DroppedProjection(Projection):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.dropout(super().forward(x), 0.5, self.training)

    vit = ViTConfig(image_size=16, patch_size=4, dim=24, n_layers=1, n_heads=2, mlp_hidden=48)
    return ModalityEncoder(ViT(vit), DroppedProjection(vit.dim, language_dim))


def _seeded_factory_run(cwd: str, argv: list[str]) -> tuple[list[float], dict]:
    """`_factory_run` from torch's seed of a fresh process (the harness reuses its rank processes)."""
    torch.manual_seed(67280421310721)
    losses = _factory_run(cwd, argv)[2]
    if dist.get_rank():
        return losses, {}  # (rank 0's file: `_factory_run`)
    with open(argv[argv.index("--metrics.jsonl") + 1]) as f:
        return losses, [r for r in map(json.loads, f) if "heldout_loss" in r][-1]


def test_an_evaluation_leaves_a_dropout_encoders_training_as_it_was(tiny: str, tmp_path) -> None:
    """A factory encoder with dropout: the held-out evaluation after each step ran it in training
    mode (dropout on: a noisy score, not the model's), drawing from torch's generator, so every
    step after the first evaluation trained on other dropout masks than a run without evaluations
    (train.eval_every = 0). Evaluating must change no training number, and the last held-out
    scores are the same either way."""
    got = {}
    for every in ("1", "0"):
        argv = [*ORACLE, "--train.steps", "3", "--train.eval_every", every, "--model.encoders.image.hf", "none",
                "--model.encoders.image.factory", "tests.test_train_llava:dropout_vision",
                "--model.encoders.image.processor", "ckpt/siglip", "--model.encoders.image.tokens_per_item", "16",
                "--metrics.jsonl", str(tmp_path / f"every{every}.jsonl")]
        got[every] = run_on_ranks(_seeded_factory_run, 2, tiny, argv, timeout=300)[0]
    (losses, last), (plain, plain_last) = got["1"], got["0"]
    assert len(losses) == 3 and losses == plain
    assert last["step"] == plain_last["step"] == 3 and last == plain_last


def test_a_factory_encoder_takes_images_that_come_after_the_checked_samples(tiny: str) -> None:
    """A factory encoder's input size is its processor's, probed on the first checked sample with an
    item; when none of the first 256 has one, the images after them were each refused as "unlike
    the encoder's []" (with data.skip_bad_media: every one left out)."""
    from PIL import Image

    samples = [json.loads(line) for line in open(os.path.join(tiny, "data", "train.jsonl"))]
    image = next(s for s in samples if isinstance(s.get("image"), str))
    text = {"conversations": [{"from": "human", "value": "repeat : red"}, {"from": "gpt", "value": "red"}]}
    with open(os.path.join(tiny, "data", "late_image.jsonl"), "w") as f:
        f.writelines(json.dumps({"id": f"t-{k}", **text}) + "\n" for k in range(300))
        f.write(json.dumps({**image, "id": "late"}) + "\n")
    data, _ = _dataset(tiny, "--data.path", "data/late_image.jsonl", "--data.heldout", "none",
                       "--model.encoders.image.hf", "none",
                       "--model.encoders.image.factory", "tests.test_train_llava:tiny_vision",
                       "--model.encoders.image.processor", "ckpt/siglip",
                       "--model.encoders.image.tokens_per_item", "16")
    processor = transformers.SiglipImageProcessor.from_pretrained(os.path.join(tiny, "ckpt", "siglip"))
    with Image.open(os.path.join(tiny, "data", image["image"])) as pil:
        want = processor(images=[pil.convert("RGB")], return_tensors="pt")["pixel_values"]
    batch = data.train.batch([0, 300])
    assert batch.modalities["image"].items_per_sample == (0, 1)
    torch.testing.assert_close(batch.modalities["image"].inputs, want)
    assert data.train.batch([0, 300], load={}).modalities["image"].inputs.shape == (1, 3, 16, 16)

LEARN = ["--train.steps", "600", "--metrics.log_every", "100", "--metrics.progress", "off"]


@pytest.mark.learn  # 50 s on 2 cores: `make learn`, not the suite
def test_learns_heterogeneous(tiny: str) -> None:
    result = _run(tiny, [*LEARN, "--train.generate", "8", "--checkpoint.export_hf", "none"])
    # Chance on the image samples: 1/16 for one image, 1/256 for two.
    assert result["with image"] >= 0.5 and result["answer"] >= 0.5, result
    assert sum(e == g for e, g in result["answers"]) >= 3


def test_export_answers_like_the_trainer(tiny: str) -> None:
    """The README's file, a short run: the export loads in transformers and its greedy answers are
    ours, token for token (trained enough that no answer hinges on a near tie)."""
    result = _run(tiny, ["--train.steps", "150", "--metrics.log_every", "50", "--metrics.progress", "off",
                         "--train.generate", "8", "--checkpoint.export_hf", "out/hf"])
    theirs = _hf_answers(os.path.join(tiny, "out", "hf"), tiny, 8)
    assert theirs == [generated for _, generated in result["answers"]]


# The colocated layout learns too: `test_layouts_give_one_process_numbers` shows it gives the
# one-process run's losses and gradient norms over 6 steps, as the heterogeneous layout that
# learns above does (with FSDP2; colocated without FSDP, the setting docs/testing.md suggests
# for small modules, is the oracle's `coloc_fan_in` in tests/test_mimo.py).


AUDIO_CONFIG = """
[model.language]
hf = "ckpt/lm"
[model.encoders.audio]
hf = "ckpt/whisper"
modality = "audio"
[data]
format = "llava"
path = "data/audio_train.jsonl"
heldout = "data/audio_val.jsonl"
batch_size = 16
[optimizer]
lr = 2e-3
betas = [0.9, 0.999]
weight_decay = 0.01
[lr_schedule]
warmup_steps = 50
decay = "cosine"
min_lr_ratio = 0.1
"""


def test_whisper_encoder_learns_audio(tiny: str, tmp_path) -> None:
    config = tmp_path / "audio.toml"
    config.write_text(AUDIO_CONFIG)
    result = _run(tiny, ["--train.steps", "150", "--metrics.log_every", "50", "--metrics.progress", "off",
                         "--train.generate", "0"], config=str(config))
    assert result["answer"] >= 0.6, result  # chance: 1/4


# ---------------------------------------------------------------------------- items of their own size


# (height, width) of a source image -> the size it is resized to, for 4x4 patches and 128..512 pixels:
# aspect ratio kept, sides whole patches; worked out by hand from the rule (Qwen2-VL's).
FITS = [
    ((16, 16), (16, 16)),    # inside the budget: unchanged
    ((16, 24), (16, 24)),
    ((15, 25), (16, 24)),    # sides rounded to patches: 3.75 -> 4, 6.25 -> 6
    ((40, 40), (20, 20)),    # 1600 px: scaled by sqrt(512 / 1600) = 0.566 -> 22.6 -> floored to 20
    ((8, 8), (12, 12)),      # 64 px: scaled by sqrt(2) -> 11.3 -> ceiled to 12 (144 >= 128)
    ((64, 8), (64, 8)),      # exactly 512
    ((200, 8), (112, 4)),    # 113.1 -> 112; 4.5 -> one patch
    ((6, 300), (4, 128)),    # one patch high; 160 wide would make 640 px: the long side gives way
]


@pytest.mark.parametrize("source, fitted", FITS)
def test_fit_image_size_keeps_the_aspect_within_the_budget(source, fitted) -> None:
    from dtensor_mimo.data.conversation import fit_image_size

    assert fit_image_size(*source, patch=4, min_pixels=128, max_pixels=512) == fitted


def test_fit_image_size_is_qwen2_vls_smart_resize() -> None:
    """Where Qwen2-VL's own rule (transformers' `smart_resize`) gives sides of at least one patch
    within the budget, `fit_image_size` is it, for every source size up to 96 x 96 (e.g. 8 x 12,
    96 px under the 128 minimum: scaled by 1.155 to 9.2 x 13.9, each side rounded up to 12 x 16;
    rounded to the nearest patch it would be 8 x 12 again, under the minimum)."""
    qwen = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    from dtensor_mimo.data.conversation import fit_image_size

    compared = 0
    for height in range(3, 97):
        for width in range(3, 97):
            expected = qwen.smart_resize(height, width, factor=4, min_pixels=128, max_pixels=512)
            if min(expected) < 4 or expected[0] * expected[1] > 512:  # outside the rule's own bounds
                continue
            assert fit_image_size(height, width, 4, 128, 512) == expected, (height, width)
            compared += 1
    assert compared > 8000 and fit_image_size(8, 12, 4, 128, 512) == (12, 16)


# The varied data set: sample id -> its images' source sizes (h, w); -> sizes and 4x4-patch rows after fitting.
VARIED = {"square": [(16, 16)], "wide": [(16, 24)], "big": [(40, 40)], "small": [(8, 8)],
          "pair": [(16, 16), (16, 24)], "text": []}
FITTED = {"square": [(16, 16)], "wide": [(16, 24)], "big": [(20, 20)], "small": [(12, 12)],
          "pair": [(16, 16), (16, 24)], "text": []}
ROWS = {name: [h // 4 * (w // 4) for h, w in sizes] for name, sizes in FITTED.items()}  # 16, 24, 25, 9, ...
DYNAMIC = ["--data.path", "data/varied.jsonl", "--data.heldout", "none", "--model.encoders.image.dynamic_resolution",
           "true", "--data.image_max_pixels", "512", "--data.image_min_pixels", "128"]
# clip samples at 16 kHz (Whisper hop 500, window 1024): frames = samples // 500, a short clip padded to 513
# samples, a long one cut at audio_max_seconds (default: the encoder's 32 frames, 1 s); rows: (frames - 1) // 2 + 1.
CLIPS = [16000, 8000, 12345, 300, 20000]
FRAMES = [32, 16, 24, 1, 32]
CLIP_ROWS = [16, 8, 12, 1, 16]


@pytest.fixture(scope="module")
def varied(tiny: str) -> str:
    """Images of several sizes and clips of several lengths beside the tiny setup's data."""
    import random
    import wave

    rng = random.Random(1)
    os.makedirs(os.path.join(tiny, "data", "varied"), exist_ok=True)
    with open(os.path.join(tiny, "data", "varied.jsonl"), "w") as f:
        for sid, sizes in VARIED.items():
            paths = []
            for k, (h, w) in enumerate(sizes):
                path = f"varied/{sid}-{k}.png"
                make.draw_shape("red", "cross", rng).resize((w, h)).save(os.path.join(tiny, "data", path))
                paths.append(path)
            question = " ".join(["<image>"] * len(paths)) + "\nwhat is in the image ?" if paths else "repeat : red"
            sample = {"id": sid, "conversations": [{"from": "human", "value": question},
                                                   {"from": "gpt", "value": "a red cross" if paths else "red"}]}
            if paths:
                sample["image"] = paths
            f.write(json.dumps(sample) + "\n")
    with open(os.path.join(tiny, "data", "varied_audio.jsonl"), "w") as f:
        for k, n in enumerate(CLIPS):
            path = f"varied/clip-{k}.wav"
            samples = (torch.randn(n, generator=torch.Generator().manual_seed(k)) * 3000).to(torch.int16)
            with wave.open(os.path.join(tiny, "data", path), "wb") as w:
                w.setnchannels(1)
                w.setsampwidth(2)
                w.setframerate(16000)
                w.writeframes(samples.numpy().tobytes())
            f.write(json.dumps({"id": f"clip-{k}", "audio": path, "conversations": [
                {"from": "human", "value": "<audio>\nhow does it sound ?"}, {"from": "gpt", "value": "low"}]}) + "\n")
    return tiny


def _runs(row: list[int], token: int) -> list[int]:
    """Lengths of the runs of `token` in `row`."""
    runs, previous = [], None
    for t in row:
        if t == token:
            runs[-1:] = [runs[-1] + 1] if previous == token else [*runs[-1:], 1]
        previous = t
    return runs


def test_dynamic_resolution_expands_each_image_to_its_own_rows(varied: str) -> None:
    import numpy as np
    from PIL import Image

    data, tokenizer = _dataset(varied, *DYNAMIC)
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    ids = [data.train[i].id for i in range(len(data.train))]
    for i, sid in enumerate(ids):
        assert _runs(data.train[i].tokens, image_id) == ROWS[sid], sid
    batch = data.train.batch(range(len(ids)))
    m = batch.modalities["image"]
    assert m.items_per_sample == tuple(len(VARIED[s]) for s in ids)
    assert m.item_tokens == tuple(n for s in ids for n in ROWS[s])
    fitted = [size for s in ids for size in FITTED[s]]
    assert [tuple(x.shape) for x in m.inputs] == [(3, h, w) for h, w in fitted]
    # Pixels: PIL's bicubic resize to the fitted size, scaled to [-1, 1] (SigLIP's mean and std 0.5).
    paths = [p for s in ids for p in data.train.samples[ids.index(s)].get("image", [])]
    for x, path, (h, w) in zip(m.inputs, paths, fitted):
        image = Image.open(os.path.join(varied, "data", path)).convert("RGB").resize((w, h), Image.BICUBIC)
        expected = (torch.tensor(np.asarray(image), dtype=torch.float32).permute(2, 0, 1) / 255 - 0.5) / 0.5
        torch.testing.assert_close(x, expected, rtol=0, atol=1e-5)
    # A rank that encodes only sample 1 reads only its image; the others are zeros of their own size.
    partial = data.train.batch(range(len(ids)), load={"image": [1]}).modalities["image"]
    first = sum(len(VARIED[s]) for s in ids[:1])
    for k, (x, y) in enumerate(zip(partial.inputs, m.inputs)):
        if k == first:
            assert torch.equal(x, y)
        else:
            assert x.shape == y.shape and x.stride() == (0, 0, 0)
    # The trainer's modules on one process take the batch: the tower's rows fill the placeholders.
    from dtensor_mimo.train.modules import build_modules, resolve

    cwd = os.getcwd()
    os.chdir(varied)
    try:
        config = parse_args(["--config", CONFIG, *DYNAMIC])
        resolved = resolve(config)
    finally:
        os.chdir(cwd)
    assert resolved.encoders["image"].config.max_patches == 32  # 512 px / 4x4
    logits = _logits(build_modules(config, resolved, 96, meta=False), batch)
    assert logits.shape[:2] == batch.tokens.shape and torch.isfinite(logits).all()
    assert data.tokens_per_item["image"] == pytest.approx(sum(m.item_tokens) / m.num_items)


def test_an_image_over_pillows_pixel_limit_names_its_sample(varied: str) -> None:
    """Images of their own size have their headers read when a sample is tokenized (and by the
    launcher's estimate): one Pillow refuses as a decompression bomb (over 179M pixels) is a
    DataError naming the sample, the file and the fix (it was Pillow's bare DecompressionBombError
    at launch, naming neither)."""
    import io
    import struct
    import zlib

    from PIL import Image

    from dtensor_mimo.data.conversation import DataError

    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, "PNG")
    png = bytearray(buffer.getvalue())
    header = struct.pack(">II", 20000, 20000) + bytes(png[24:29])  # IHDR: a 20000 x 20000 image, no pixels
    png[16:33] = header + struct.pack(">I", zlib.crc32(b"IHDR" + header))
    with open(os.path.join(varied, "data", "varied", "huge.png"), "wb") as f:
        f.write(bytes(png))
    with open(os.path.join(varied, "data", "huge.jsonl"), "w") as f:
        for sid, path in [("square", "varied/square-0.png"), ("huge", "varied/huge.png")]:
            f.write(json.dumps({"id": sid, "image": path, "conversations": [
                {"from": "human", "value": "<image>\nwhat is in the image ?"}, {"from": "gpt", "value": "red"}]}) + "\n")
    data, _ = _dataset(varied, *DYNAMIC, "--data.path", "data/huge.jsonl", "--data.seq_len", "96")
    assert data.train.batch([0]).modalities["image"].item_tokens == (16,)
    with pytest.raises(DataError, match=r"sample 'huge': .*varied/huge\.png: Pillow refuses to open it \(Image size "
                                        r"\(400000000 pixels\) exceeds limit .*raise PIL\.Image\.MAX_IMAGE_PIXELS"):
        data.train[1]


def test_truncation_cuts_at_item_boundaries_of_their_own_sizes(varied: str) -> None:
    whole, tokenizer = _dataset(varied, *DYNAMIC)
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    pair = next(i for i in range(len(whole.train)) if whole.train[i].id == "pair")
    row = whole.train[pair].tokens
    first = row.index(image_id)
    second = first + 16 + row[first + 16:].index(image_id)  # 16 rows of the 16x16 image, then the 16x24 one's 24
    assert whole.train.prompts([pair]).modalities["image"].item_tokens == (16, 24)  # both before the answer
    # (seq_len, rows of the images kept, where the row is cut: before an image cut in two, also one
    # that lacks its last row only)
    for limit, kept, cut in ((second + 5, [16], second), (second + 24, [16, 24], second + 24), (first + 3, [], first),
                             (second + 23, [16], second), (first + 15, [], first)):
        data, _ = _dataset(varied, *DYNAMIC, "--data.seq_len", str(limit), "--data.truncate", "true")
        sample = data.train[pair]
        assert sample.item_tokens["image"] == kept and len(sample.items["image"]) == len(kept), limit
        assert _runs(sample.tokens, image_id) == kept and sample.tokens == row[:cut]
        assert data.train.batch([pair]).modalities["image"].item_tokens == tuple(kept)


def test_variable_length_clips_keep_their_own_length(varied: str, tmp_path) -> None:
    import numpy as np
    import wave

    config = tmp_path / "audio.toml"
    config.write_text(AUDIO_CONFIG)
    argv = ["--data.path", "data/varied_audio.jsonl", "--data.heldout", "none", "--data.root", "data",
            "--model.encoders.audio.variable_length", "true"]
    data, tokenizer = _dataset(varied, *argv, config=str(config))
    audio_id = tokenizer.convert_tokens_to_ids("<audio>")
    assert [_runs(data.train[i].tokens, audio_id) for i in range(len(CLIPS))] == [[n] for n in CLIP_ROWS]
    m = data.train.batch(range(len(CLIPS))).modalities["audio"]
    assert m.item_tokens == tuple(CLIP_ROWS) and [x.shape[1] for x in m.inputs] == FRAMES
    fe = transformers.WhisperFeatureExtractor.from_pretrained(os.path.join(varied, "ckpt", "whisper"))
    for k, x in enumerate(m.inputs):  # the extractor on the clip alone: cut to 1 s, or padded to one window
        with wave.open(os.path.join(varied, "data", f"varied/clip-{k}.wav")) as w:
            clip = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.float32) / 32768
        clip = np.pad(clip[:16000], (0, max(0, 513 - len(clip))))
        expected = fe(clip, sampling_rate=16000, padding="longest", return_tensors="pt")["input_features"][0]
        torch.testing.assert_close(x, expected)
    half, _ = _dataset(varied, *argv, "--data.audio_max_seconds", "0.5", config=str(config))
    assert half.train.batch(range(len(CLIPS))).modalities["audio"].item_tokens == (8, 8, 8, 1, 8)  # 16 frames at most
    with pytest.raises(ConfigError, match=r"data.audio_max_seconds = 2: 64 frames of 500 samples at 16000 Hz, more "
                                          r"than model.encoders.audio takes \(32 frames, 1 s\)"):
        _dataset(varied, *argv, "--data.audio_max_seconds", "2", config=str(config))
    with pytest.raises(ConfigError, match=r"model.encoders.image.max_patches = 16: images of up to "
                                          r"data.image_max_pixels = 512 pixels give up to 32 patches of 4x4"):
        _dataset(varied, *DYNAMIC, "--model.encoders.image.max_patches", "16")


def test_a_truncated_clip_is_a_media_error_naming_the_sample(varied: str, tmp_path) -> None:
    """A WAV cut short (its header's frame count intact, from which the token row was counted):
    a MediaError naming the sample and the file, which data.skip_bad_media skips and the ranks
    agree on; it was a DataError telling the user to fix the processor config."""
    from dtensor_mimo.data.conversation import MediaError

    config = tmp_path / "audio.toml"
    config.write_text(AUDIO_CONFIG)
    data, _ = _dataset(varied, "--data.path", "data/varied_audio.jsonl", "--data.heldout", "none", "--data.root",
                       "data", "--model.encoders.audio.variable_length", "true", config=str(config))
    path = os.path.join(varied, "data", "varied", "clip-0.wav")
    with open(path, "rb") as f:
        whole = f.read()
    try:
        with open(path, "wb") as f:
            f.write(whole[:len(whole) // 2])
        with pytest.raises(MediaError, match=r"sample 'clip-0': cannot decode its audio file .*clip-0\.wav "
                                             r"\(the processor turns it into \[16, 15\] but its header gave "
                                             r"\[16, 32\], which the token row counts its rows from: a truncated") as e:
            data.train.batch(range(len(CLIPS)))
        assert e.value.sample_id == "clip-0" and e.value.row == 0
    finally:
        with open(path, "wb") as f:
            f.write(whole)


def test_a_missing_clip_past_the_checked_samples_names_its_sample(varied: str, tmp_path) -> None:
    """Clips of their own length have their headers read when a sample is tokenized; a missing
    file past the launcher's checked samples is a DataError naming the sample and the file (it was
    a bare FileNotFoundError, where a missing image is named)."""
    from dtensor_mimo.data.conversation import DataError

    conv = [{"from": "human", "value": "<audio>\nhow does it sound ?"}, {"from": "gpt", "value": "low"}]
    with open(os.path.join(varied, "data", "late_missing_audio.jsonl"), "w") as f:
        for k in range(300):
            f.write(json.dumps({"id": f"a-{k}", "audio": "varied/clip-1.wav", "conversations": conv}) + "\n")
        f.write(json.dumps({"id": "a-300", "audio": "varied/gone.wav", "conversations": conv}) + "\n")
    config = tmp_path / "audio.toml"
    config.write_text(AUDIO_CONFIG)
    data, _ = _dataset(varied, "--data.path", "data/late_missing_audio.jsonl", "--data.heldout", "none",
                       "--data.root", "data", "--data.seq_len", "64", "--model.encoders.audio.variable_length", "true",
                       config=str(config))
    assert data.train.batch([0, 1]).modalities["audio"].item_tokens == (8, 8)
    with pytest.raises(DataError, match=r"sample 'a-300': .*varied/gone\.wav: not a PCM WAV file \(\[Errno 2\]"):
        data.train.batch([300])


def test_an_empty_clip_is_silence(varied: str, tmp_path) -> None:
    """A WAV of no samples (a valid file): one window of silence under variable_length (its header
    gives [16, 1]: 1 row), the extractor's chunk of silence otherwise; it was a MediaError
    ("both buffer length (0) and count (-1) must not be 0"), or, skipped, a sample lost."""
    import wave

    import numpy as np

    with wave.open(os.path.join(varied, "data", "varied", "empty.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
    with open(os.path.join(varied, "data", "empty_audio.jsonl"), "w") as f:
        for k, path in enumerate(["varied/clip-1.wav", "varied/empty.wav"]):
            f.write(json.dumps({"id": f"e-{k}", "audio": path, "conversations": [
                {"from": "human", "value": "<audio>\nhow does it sound ?"}, {"from": "gpt", "value": "low"}]}) + "\n")
    config = tmp_path / "audio.toml"
    config.write_text(AUDIO_CONFIG)
    argv = ["--data.path", "data/empty_audio.jsonl", "--data.heldout", "none", "--data.root", "data"]
    fe = transformers.WhisperFeatureExtractor.from_pretrained(os.path.join(varied, "ckpt", "whisper"))
    data, _ = _dataset(varied, *argv, "--model.encoders.audio.variable_length", "true", config=str(config))
    m = data.train.batch([0, 1]).modalities["audio"]
    assert m.item_tokens == (8, 1) and [x.shape[1] for x in m.inputs] == [16, 1]
    silence = fe(np.zeros(513, dtype=np.float32), sampling_rate=16000, padding="longest", return_tensors="pt")
    torch.testing.assert_close(m.inputs[1], silence["input_features"][0])
    data, _ = _dataset(varied, *argv, config=str(config))
    m = data.train.batch([0, 1]).modalities["audio"]
    chunk = fe(np.zeros(0, dtype=np.float32), sampling_rate=16000, return_tensors="pt")["input_features"][0]
    torch.testing.assert_close(m.inputs[1], chunk)


def test_a_heldout_answer_cut_by_truncation_is_not_prompted(tiny: str, tmp_path) -> None:
    """A held-out sample truncated inside its first answer has lost that answer's end of turn:
    its expected text is a fragment and its last kept token an ordinary word. It is not prompted
    (as one truncated away is not): before, its stop token was that word, which also made the
    stop tokens of the prompts differ, so every prompt generated to the end of the row."""
    turns = [{"from": "human", "value": "what is in the image ?"},
             {"from": "gpt", "value": "a red bar and a blue ring"}]
    path = tmp_path / "cut.jsonl"
    path.write_text(json.dumps({"id": "cut", "conversations": turns}) + "\n")
    whole, tokenizer = _dataset(tiny, "--data.heldout", str(path), "--data.root", "data")
    start, stop = whole.heldout[0].answers[0]
    assert whole.prompt(0) == (start, "a red bar and a blue ring", tokenizer.convert_tokens_to_ids("<|im_end|>"))
    cut, _ = _dataset(tiny, "--data.heldout", str(path), "--data.root", "data", "--data.seq_len", str(start + 3),
                      "--data.truncate", "true")
    assert cut.heldout[0].answers == [(start, start + 3)]  # trained on, as far as it goes
    assert cut.prompt(0) is None
    # cut right after the answer's end of turn (the template's "\n" after it gone): the answer is whole
    assert len(whole.heldout[0].tokens) > stop
    kept, _ = _dataset(tiny, "--data.heldout", str(path), "--data.root", "data", "--data.seq_len", str(stop),
                       "--data.truncate", "true")
    assert kept.heldout[0].answers == [(start, stop)] and not kept.heldout[0].answer_cut
    assert kept.prompt(0) == whole.prompt(0)


def test_a_system_prompt_is_not_trained_on(tiny: str, tmp_path) -> None:
    """A conversation that opens with a system turn: the loss counts the assistant's answers only
    (each through its end of turn), never the system prompt, whatever role is not the user's."""
    turns = [{"from": "system", "value": "you describe images"},
             {"from": "human", "value": "what is in the image ?"},
             {"from": "gpt", "value": "a red bar"},
             {"from": "human", "value": "and then ?"},
             {"from": "gpt", "value": "a blue ring"}]
    path = tmp_path / "system.jsonl"
    path.write_text(json.dumps({"id": "system", "conversations": turns}) + "\n")
    data, tokenizer = _dataset(tiny, "--data.heldout", str(path), "--data.root", "data")
    row = data.heldout[0]
    assert tokenizer.decode(row.tokens[:row.answers[0][0]]).startswith("<|im_start|>system\nyou describe images")
    assert [tokenizer.decode(row.tokens[a:b]) for a, b in row.answers] == ["a red bar<|im_end|>",
                                                                         "a blue ring<|im_end|>"]
    assert tokenizer.decode([t for t in row.labels if t != -100]) == "a red bar<|im_end|>a blue ring<|im_end|>"


def test_an_export_its_processor_would_refuse_fails_before_any_process(tiny: str, tmp_path) -> None:
    """Under dynamic_resolution the processor's own size is never used for training (each image is
    resized to its own fit), so a processor of 32 px beside the 16 px tower trains; but
    `export_hf` refuses it (the exported tower takes 16 px images): named by the launch check,
    not after the run's last step."""
    big = tmp_path / "big"
    shutil.copytree(os.path.join(tiny, "ckpt", "siglip"), big)
    proc = json.loads((big / "preprocessor_config.json").read_text())
    proc["size"] = {"height": 32, "width": 32}
    (big / "preprocessor_config.json").write_text(json.dumps(proc))
    _preflight(tiny, ["--model.encoders.image.processor", str(big), "--model.encoders.image.dynamic_resolution",
                      "true"], "the image processor makes {'height': 32, 'width': 32} images but the ViT takes 16x16")


def _start_from_export(cwd: str, argv: list[str], export: str) -> None:
    """A trainer built on this rank (the model initialized from its config's directories),
    exported at once: the weights it starts from."""
    from dtensor_mimo.train.trainer import Trainer

    here = os.getcwd()
    os.chdir(cwd)
    try:
        Trainer(parse_args(["--config", CONFIG, *argv])).export(export)
    finally:
        os.chdir(here)


def test_a_second_stage_starts_from_the_first_stages_llava_export(tiny: str) -> None:
    """LLaVA's second stage from the first's weights alone (not its optimizer or data position):
    stage 1 trains the projection (tower frozen) and exports a LLaVA directory; stage 2 names that
    directory as both the encoder's and the language model's `hf`. Its image processor is in
    ``processor_config.json`` (where transformers 5 saves a LLaVA processor's; AutoImageProcessor
    loads it), which the trainer once refused, asking for ``processor = DIR``. Stage 2 starts
    from stage 1's tensors, every one of them bit for bit."""
    from safetensors.torch import load_file

    quick = [*QUICK, "--data.heldout_samples", "4", "--train.eval_every", "0", "--data.batch_size", "8"]
    run_on_ranks(_train, 2, tiny, [*quick, "--train.steps", "2", "--model.encoders.image.frozen", "true",
                                   "--model.language.frozen", "true", "--checkpoint.export_hf", "out/stage1"],
                 CONFIG, timeout=300)
    stage1 = os.path.join(tiny, "out", "stage1")
    run_on_ranks(_start_from_export, 2, tiny, [*quick, "--model.encoders.image.hf", "out/stage1",
                                               "--model.language.hf", "out/stage1"],
                 os.path.join(tiny, "out", "stage2"), timeout=300)

    def tensors(directory: str) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted(glob.glob(os.path.join(directory, "*.safetensors")))
                for k, v in load_file(f).items()}

    want, got = tensors(stage1), tensors(os.path.join(tiny, "out", "stage2"))
    assert want and got.keys() == want.keys(), sorted(set(got) ^ set(want))
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    # Stage 1 (`model.language.frozen` with the tower frozen): the projector alone moved; the
    # decoder and the tower are the pretrained directories' tensors, bit for bit.
    lm, siglip = (tensors(os.path.join(tiny, "ckpt", d)) for d in ("lm", "siglip"))
    source = {**{"language_model." + k: v for k, v in lm.items()},
              **{"vision_tower." + k: v for k, v in siglip.items()}}
    projector = [k for k in want if k.startswith("multi_modal_projector.")]
    assert projector and all(k in source or k in projector for k in want), sorted(set(want) - set(source))
    assert [k for k in want if k in source and not torch.equal(want[k], source[k].to(want[k].dtype))] == []


class _Whole(torch.nn.Module):
    """A user's encoder that is not a ModalityEncoder (`model.encoders.<name>.frozen` freezes it whole)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.out_dim = inner, inner.out_dim

    def init_weights(self, seed: int) -> None:
        self.inner.init_weights(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def whole_vision(language_dim: int) -> torch.nn.Module:
    return _Whole(tiny_vision(language_dim))


def test_a_run_where_nothing_trains_is_refused_before_any_process(tiny: str, tmp_path) -> None:
    """`model.language.frozen` with a factory encoder frozen whole (not a ModalityEncoder, so no
    projection trains): no parameter takes a gradient. The run trained to its end in silence,
    every step `grad norm 0.000`, its weights those it started from. Refused by name, by the
    launcher before any process starts, and by every rank alike before any collective."""
    from tests.harness import DistributedTestFailure

    argv = [*QUICK, "--train.steps", "2", "--data.heldout_samples", "4", "--train.eval_every", "0",
            "--data.batch_size", "8", "--model.encoders.image.hf", "none", "--checkpoint.export_hf", "none",
            "--model.encoders.image.factory", "tests.test_train_llava:whole_vision",
            "--model.encoders.image.processor", "ckpt/siglip", "--model.encoders.image.tokens_per_item", "16",
            "--model.encoders.image.frozen", "true", "--model.language.frozen", "true",
            "--metrics.jsonl", str(tmp_path / "m.jsonl")]
    message = ("no parameter of any module trains (model.language.frozen, model.encoders.image.frozen; a factory's "
               "encoder that is not a ModalityEncoder is frozen whole): the run would train nothing")
    _preflight(tiny, argv, message)
    with pytest.raises(DistributedTestFailure) as refused:
        run_on_ranks(_train, 2, tiny, argv, timeout=300)
    assert str(refused.value).count(message) == 2, str(refused.value)[-3000:]
    assert not os.path.exists(tmp_path / "m.jsonl")  # no step ran
    # A factory's module no Hugging Face directory holds, with checkpoint.export_hf: the run trained
    # to its end, then failed in the export (TypeError); refused by every rank before any step.
    export = [*argv, "--model.language.frozen", "false", "--checkpoint.export_hf", "out/hf"]
    with pytest.raises(DistributedTestFailure) as refused:
        run_on_ranks(_train, 2, tiny, export, timeout=300)
    assert str(refused.value).count("checkpoint.export_hf = 'out/hf': the trained model cannot be written as Hugging "
                                    "Face directories: module 'image': no Hugging Face export for") == 2
    assert not os.path.exists(tmp_path / "m.jsonl")
    # the encoder's projection trains when it is a ModalityEncoder: accepted
    cwd = os.getcwd()
    os.chdir(tiny)
    try:
        from dtensor_mimo.train.launch import preflight

        preflight(parse_args(["--config", CONFIG, *argv, "--model.encoders.image.factory",
                              "tests.test_train_llava:tiny_vision"]))
    finally:
        os.chdir(cwd)
