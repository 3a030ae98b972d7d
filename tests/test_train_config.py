"""The trainer's config: TOML files, dotted overrides, and errors that name the key (one process)."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from dtensor_mimo.train.config import ConfigError, TrainerConfig, build_layout, check_config, help_text, parse_args

IMAGE = ["--model.encoders.image.image_size", "16"]
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def test_defaults_are_a_heterogeneous_three_rank_layout() -> None:
    config = parse_args([])
    layout = build_layout(config)
    assert layout.world_size == 3
    assert [layout.ranks(n) for n in ("vision", "audio", "language")] == [[0], [1], [2]]
    assert config.options["language"].compile and config.pipeline.microbatches == 4


def test_file_then_overrides_in_any_order(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[train]\nsteps = 7\n[layout.language]\ntp = 2\n[lr_schedule]\ndecay = "linear"\n')
    config = parse_args(["--train.steps", "40", "--config", str(path), "--optimizer.lr=5e-4",
                         "--optimizer.module_lr", "{vision = 1e-4}", "--model.encoders.vision.frozen", "true",
                         "--checkpoint.dir", "ckpt/run 1"])
    assert config.train.steps == 40  # the command line wins over the file, wherever it stands
    assert config.module_layout("language").tp == 2 and config.lr_schedule.decay == "linear"
    assert config.lr_schedule.total_steps == 40  # the run's steps unless given
    assert config.optimizer.lr == 5e-4 and config.optimizer.module_lr == {"vision": 1e-4}
    assert config.model.encoders["vision"].frozen and config.checkpoint.dir == "ckpt/run 1"
    assert config.model.encoders["vision"].seed == 10  # the digits defaults under the override
    assert parse_args(["--checkpoint.dir", "20240101"]).checkpoint.dir == "20240101"  # a number-like name
    mixed = parse_args(["--options.vision.param_dtype", "bfloat16"])
    assert mixed.options["vision"].param_dtype == torch.bfloat16 and mixed.options["language"].param_dtype is None
    assert mixed.options["vision"].compile  # the digits job's compile stays under the override
    assert build_layout(config).ranks("language") == [2, 3]


def test_total_steps_none_is_the_runs_steps(tmp_path) -> None:
    """--help: "lr_schedule.total_steps: where the decay ends (none: train.steps)", and `none` on the
    command line unsets a key: a file's total_steps unset there decays over the run's steps (the
    digits job's cosine decay needs one), warmup cut to half a run it does not fit, as unset."""
    path = tmp_path / "c.toml"
    path.write_text("[lr_schedule]\ntotal_steps = 1000\n")
    config = parse_args(["--config", str(path), "--lr_schedule.total_steps", "none", "--train.steps", "40"])
    assert config.lr_schedule.total_steps == 40
    short = parse_args(["--lr_schedule.total_steps", "none", "--train.steps", "30"])  # warmup 50 of the digits job
    assert (short.lr_schedule.total_steps, short.lr_schedule.warmup_steps) == (30, 15)


def test_a_string_key_on_the_command_line_keeps_the_word_as_written() -> None:
    """A value on the command line is read as TOML, but a key that takes a string gets the word the
    user wrote: numbers are not respelled (``1e3`` was the directory "1000.0", ``1.10`` the tokenizer
    "1.1", ``0x10`` "16") and dates or times are names like any other word (``2024-06-01`` was
    refused as a date); keys that take numbers still read them as numbers."""
    for word in ("1e3", "1.10", "0x10", "1_000", "+5", "2024-06-01", "2024-06-01T12:00:00", "12:30:00"):
        assert parse_args(["--checkpoint.dir", word]).checkpoint.dir == word
        assert parse_args(["--data.format", "llava", "--data.path", word, "--data.tokenizer", word,
                           *IMAGE]).data.tokenizer == word
    config = parse_args(["--train.steps", "1_000", "--optimizer.lr", "1e-3", "--layout.bridge_hops", "2",
                         "--model.language.factory_args.n", "0x10", "--model.language.factory", "m:f",
                         "--data.format", "llava", "--data.path", "x", "--data.tokenizer", "t", *IMAGE])
    assert (config.train.steps, config.optimizer.lr, config.layout.bridge_hops) == (1000, 1e-3, 2)
    assert type(config.train.steps) is int and type(config.optimizer.lr) is float
    assert config.model.language.factory_args == {"n": 16} and type(config.model.language.factory_args["n"]) is int
    with pytest.raises(ConfigError, match=r"train.steps = '2024-06-01': expected an integer"):
        parse_args(["--train.steps", "2024-06-01"])


def test_compile_options_read_as_tables(tmp_path) -> None:
    """`ParallelOptions.compile_options` from a file's table (a dotted inductor name as a nested
    table or a quoted key) and from the command line (a key each, or an inline table)."""
    path = tmp_path / "c.toml"
    path.write_text('[options.language.compile_options]\ncpp_wrapper = true\n"triton.max_tiles" = 2\n'
                    '[options.vision.compile_options.triton]\nmax_tiles = 3\n')
    config = parse_args(["--config", str(path), "--options.vision.compile_options.cpp_wrapper", "true",
                         "--options.audio.compile_options", "{coordinate_descent_tuning = true}"])
    assert config.options["language"].compile_options == {"cpp_wrapper": True, "triton.max_tiles": 2}
    assert config.options["vision"].compile_options == {"cpp_wrapper": True, "triton.max_tiles": 3}
    assert config.options["audio"].compile_options == {"coordinate_descent_tuning": True}
    with pytest.raises(ConfigError, match=r"options.language: ParallelOptions: compile_options names 'cpp_wraper', "
                                          r"which is not an inductor option \(did you mean 'cpp_wrapper'"):
        parse_args(["--options.language.compile_options.cpp_wraper", "true"])


def test_sections_are_the_library_dataclasses_and_moved_keys_still_read() -> None:
    from dtensor_mimo.layout import Parallelism
    from dtensor_mimo.optim import AdamWConfig, LRSchedule

    config = parse_args(["--data.format", "llava", "--data.path", "x", "--data.tokenizer", "t", *IMAGE])
    # one set of defaults: the library's (the digits job sets its own, written in DIGITS)
    assert config.optimizer.adamw == AdamWConfig() and config.lr_schedule == LRSchedule(total_steps=1500)
    assert isinstance(config.module_layout("image"), Parallelism)
    digits = parse_args(["--train.steps", "20"])
    assert (digits.optimizer.lr, digits.lr_schedule.decay, digits.lr_schedule.warmup_steps) == (1e-3, "cosine", 10)
    with pytest.warns(FutureWarning, match="optimizer.warmup_steps is now lr_schedule.warmup_steps"):
        moved = parse_args(["--optimizer.warmup_steps", "3", "--optimizer.decay", "linear"])
    assert (moved.lr_schedule.warmup_steps, moved.lr_schedule.decay) == (3, "linear")
    assert moved.optimizer.per_module() == {} and parse_args(
        ["--optimizer.module_lr", "{audio = 2e-3}"]).optimizer.per_module()["audio"].lr == 2e-3


@pytest.mark.parametrize("rank", ["0", "2"])
def test_a_config_warning_is_given_once_in_a_torchrun_world(rank: str, monkeypatch) -> None:
    """Every torchrun rank parses the config before joining a group: a warning about it (a moved key)
    is given by rank 0 (``RANK``) alone, not once a rank."""
    import warnings

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        moved = parse_args(["--optimizer.warmup_steps", "3"])
    assert moved.lr_schedule.warmup_steps == 3
    said = [str(w.message) for w in caught if "optimizer.warmup_steps is now" in str(w.message)]
    assert len(said) == (rank == "0"), said


@pytest.mark.parametrize("argv, message", [
    (["--train.stepz", "3"], "unknown key 'train.stepz'; train has steps, eval_every"),
    (["--trian.steps", "3"], "unknown key 'trian'; the config has model, layout, options"),
    (["--train.steps", "forty"], "train.steps = 'forty': expected an integer"),
    (["--options.language.param_dtype", "half"],
     "options.language: ParallelOptions: param_dtype='half' must be a floating dtype"),
    (["--options.language.sp", "1"], "options.language.sp = 1: expected true or false"),
    (["--train.steps", "2.5"], "train.steps = 2.5: expected an integer"),
    (["--optimizer.lr", "fast"], "optimizer.lr = 'fast': expected a number"),
    (["--optimizer.lr", "-1e-3"], "optimizer: AdamWConfig.lr=-0.001: lr, eps and weight_decay must be numbers >= 0"),
    (["--optimizer.lr", "nan"], "optimizer: AdamWConfig.lr=nan"),
    (["--optimizer.weight_decay", "-0.1"], "optimizer: AdamWConfig.weight_decay=-0.1"),
    (["--optimizer.module_lr", "{vision = -1e-4}"], "optimizer.module_lr = {'vision': -0.0001}: a learning rate is"),
    (["--options.language.compile", "yes"], "options.language.compile = 'yes': expected true or false"),
    (["--pipeline.schedule", "1f1b"], "pipeline: PipelineConfig.schedule='1f1b' is not one of ['1F1B', 'GPipe'"),
    (["--layout", "3"], "layout is a section (bridge_hops, auto, <module>), got 3"),
    (["--layout.image", "3"], "layout.image is a section (pp, dp, cp, tp, dp_replicate, offset), got 3"),
    (["--layout.bridge_hops", "3"], "layout.bridge_hops = 3: expected one of 1, 2 or none"),
    (["--layout.text.dp", "2"], "layout names ['text']: the modules are ['vision', 'audio', 'language']"),
    (["--options.text.sp", "true"], "options names ['text']"),
    (["--model.encoders.text.modality", "image"], "data.format = 'digits' trains the library's image encoder 'vision'"),
    (["--data.heldout_samples", "0"], "data.heldout_samples = 0: must be >= 1"),
    # the tones' noise: inf or nan made every tone NaN (a NaN loss naming nothing), -0.5 passed as 0.5
    (["--data.noise_std", "nan"], "data.noise_std = nan: the tones' noise std must be a finite number >= 0"),
    (["--data.noise_std", "inf"], "data.noise_std = inf: the tones' noise std must be a finite number >= 0"),
    (["--data.noise_std", "-0.5"], "data.noise_std = -0.5: the tones' noise std must be a finite number >= 0"),
    (["--data.pack", "true"], "data.pack is a key of data.format = 'llava'; this config has data.format = "
     "'digits': remove it"),
    (["--model.encoders.vision.feature_layer", "-1"], "model.encoders.vision.feature_layer: not used"),
    (["--options.vision.compile", "false", "--options.vision.compile_mode", "max-autotune-no-cudagraphs"],
     "options.vision.compile_mode: not used by this config"),
    (["--model.language.hf", "lm", "--model.language.dim", "32", "--data.format", "llava", "--data.path", "x",
      *IMAGE], "model.language.dim: not used by this config"),
    (["--data.format", "llava", "--data.path", "x", "--data.tokenizer", "t", *IMAGE, "--data.max_images", "2"],
     "data.max_images is a key of data.format = 'digits'"),
    (["--data.format", "csv"], "data.format = 'csv': expected one of 'digits', 'llava'"),
    (["--optimizer.warmup_steps", "3", "--lr_schedule.warmup_steps", "4"],
     "optimizer.warmup_steps and lr_schedule.warmup_steps are both set"),
    (["--lr_schedule.min_lr_ratio", "2"], "lr_schedule: LRSchedule.min_lr_ratio is a fraction of the peak lr"),
    (["--layout.vision.offset", "-1"], "layout.vision: offset must be a rank >= 0, got -1"),
    (["--model.language.freeze", "true"], "unknown key 'model.language.freeze'"),
    (["--model.language.untie_embeddings", "true"], "model.language.untie_embeddings: not used by this config"),
    (["--model.language.hf", "a", "--model.language.factory", "b:c"], "model.language: give hf or factory, not both"),
    (["--model.encoders.vision.factory", "nodots"], "expected 'package.module:function'"),
    # a module named like a key of [layout] could not be laid out (its table read as that key's value)
    (["--data.format", "llava", "--data.path", "x", "--data.tokenizer", "t", "--model.encoders.auto.image_size", "16"],
     "model.encoders.auto: 'auto' is a key of [layout] (layout.auto), so the encoder could not be given a layout"),
    (["--data.format", "llava", "--data.path", "x", "--data.tokenizer", "t", "--model.encoders.auto.image_size", "16",
      "--layout.auto.dp", "2"], "layout.auto = {'dp': 2}: 'auto' is a key of layout itself (true or false), so it "
     "cannot name a module's table there; give the module another name"),
    (["--data.format", "llava"], "model.encoders is empty: declare at least one"),
    (["--data.format", "llava", *IMAGE], "data.format = 'llava' needs data.path"),
    (["--data.format", "llava", "--data.path", "x.jsonl", *IMAGE], "needs a tokenizer"),
    (["--data.format", "llava", "--data.path", "x.jsonl", "--data.tokenizer", "t", *IMAGE,
      "--model.encoders.v2.image_size", "8"], "model.encoders.image, model.encoders.v2 all take 'image' items"),
    (["--optimizer.module_lr", "{video = 1e-4}"], "optimizer.module_lr names ['video']"),
    (["--train.steps", "0"], "train.steps = 0: must be >= 1"),
    (["--data.batch_size", "30"], "data.batch_size = 30 must split into pipeline.microbatches = 4"),
    (["--layout.language.dp", "3"], "multiple of layout.language.dp = 3"),
    (["--layout.vision.cp", "2"], "layout.vision: cp=2: encoders take cp = 1"),
    (["--layout.language.dp_replicate", "2"], "layout.language: Parallelism.dp_replicate=2 must divide dp=1"),
    (["--layout.vision.dp", "2", "--layout.vision.dp_replicate", "2", "--options.vision.fsdp", "false"],
     "layout.vision.dp_replicate = 2 (HSDP) needs FSDP2, but options.vision.fsdp = false"),
    (["--layout.language.pp", "2", "--pipeline.microbatches", "1", "--data.batch_size", "8"],
     "pipeline.microbatches = 1, pipeline.schedule = '1F1B', layout.language.pp = 2: schedule '1F1B' needs at least "
     "as many microbatches as 'language' has stages (pp=2), got microbatches=1: use >= 2, or schedule='GPipe'"),
    # the library's rules of each schedule (accepted here before, refused by MimoModel on every rank after start)
    (["--layout.language.pp", "2", "--pipeline.schedule", "Interleaved1F1B", "--pipeline.virtual_stages", "2",
      "--pipeline.microbatches", "3", "--data.batch_size", "6"], "pipeline.microbatches = 3, pipeline.schedule = "
     "'Interleaved1F1B', layout.language.pp = 2: schedule 'Interleaved1F1B' runs microbatches in rounds of pp=2"),
    (["--layout.language.pp", "2", "--pipeline.schedule", "DualPipeV", "--pipeline.virtual_stages", "2",
      "--pipeline.microbatches", "2", "--data.batch_size", "8"], "schedule 'DualPipeV' needs at least as many "
     "microbatches as 'language' has stages (pp=2 x 2 = 4), got microbatches=2"),
    (["--layout.language.offset", "0", "--layout.language.dp", "2"], "partially overlap"),
    (["--layout.audio.offset", "5"], "belong to no module"),
    (["--pipeline.schedule", "GPipe", "--pipeline.virtual_stages", "2"], "pipeline: PipelineConfig: schedule='GPipe'"),
    (["--model.language.n_heads", "3"], "n_heads must divide dim"),
    (["--options.vision.activation_checkpointing", "-1"], "activation_checkpointing=-1 must be an integer >= 0"),
    (["--config", "/nonexistent.toml"], "--config /nonexistent.toml: No such file"),
    (["--train.steps"], "--train.steps needs a value"),
    (["steps=3"], "unexpected argument 'steps=3'"),
    (["--metrics.profile", "p", "--train.steps", "10", "--metrics.profile_at", "11"],
     "metrics.profile_at = 11 is after the last step (train.steps = 10)"),
    (["--metrics.profile_steps", "0"], "metrics.profile_steps = 0: must be >= 1"),
    # items at their own size (issue 20)
    (["--data.image_max_pixels", "256"], "data.image_max_pixels is a key of data.format = 'llava'"),  # digits
    (["--model.encoders.vision.max_patches", "9"], "model.encoders.vision.max_patches: not used by this config"),
    (["--model.encoders.vision.dynamic_resolution", "true", "--model.encoders.vision.max_patches", "-1"],
     "model.encoders.vision.max_patches = -1: must be >= 0"),
    (["--model.encoders.audio.dynamic_resolution", "true"],
     "model.encoders.audio.dynamic_resolution is for image encoders; an audio encoder takes clips at their own "
     "length with model.encoders.audio.variable_length = true"),
    (["--model.encoders.vision.variable_length", "true"], "model.encoders.vision.variable_length is for audio"),
    (["--data.format", "llava", "--data.path", "x", "--data.tokenizer", "t", *IMAGE, "--data.image_min_pixels", "64"],
     "data.image_min_pixels: not used by this config"),  # no encoder at dynamic resolution
    (["--data.format", "llava", "--data.path", "x", "--data.tokenizer", "t", *IMAGE,
      "--model.encoders.image.dynamic_resolution", "true", "--data.audio_max_seconds", "2"],
     "data.audio_max_seconds: not used by this config"),
    (["--data.format", "llava", "--data.path", "x", "--data.tokenizer", "t", *IMAGE,
      "--model.encoders.image.dynamic_resolution", "true", "--data.image_min_pixels", "512",
      "--data.image_max_pixels", "256"], "data.image_min_pixels = 512 is above data.image_max_pixels = 256"),
    (["--data.format", "llava", "--data.path", "x", "--data.tokenizer", "t", "--model.encoders.image.factory",
      "m:f", "--model.encoders.image.processor", "p", "--model.encoders.image.tokens_per_item", "4",
      "--model.encoders.image.dynamic_resolution", "true"],
     "model.encoders.image.dynamic_resolution: items of their own size need an encoder the library configures"),
    # accepted before, then failing later: torch.compile looks a backend up on the module's ranks
    # only (the others waited for them in a collective); timedelta and the bucket size overflow
    (["--options.vision.compile_backend", "inductr"], "options.vision: ParallelOptions: "
     "compile_backend='inductr' is not a torch.compile backend (did you mean 'inductor'"),
    (["--options.language.grad_bucket_mb", "inf"], "options.language: ParallelOptions: grad_bucket_mb=inf must be "
     "a finite number of MiB > 0"),
    (["--train.timeout_s", "inf"], "train.timeout_s = inf: give a positive, finite number of seconds"),
    (["--metrics.peak_tflops", "-989"], "metrics.peak_tflops = -989.0: give the accelerator\'s peak dense TFLOP/s"),
    # the key the user wrote, with the value written (not a warmup derived from it)
    (["--lr_schedule.total_steps", "-5"], "lr_schedule.total_steps = -5: must be >= 1"),
    (["--lr_schedule.total_steps", "-1", "--lr_schedule.decay", "constant"], "lr_schedule.total_steps = -1: must be"),
    # an lr, eps or decay of inf cannot train (every update after the first is non-finite, skipped)
    (["--optimizer.lr", "inf"], "optimizer: AdamWConfig.lr=inf"),
    (["--optimizer.eps", "inf"], "optimizer: AdamWConfig.eps=inf"),
    (["--optimizer.weight_decay", "inf"], "optimizer: AdamWConfig.weight_decay=inf"),
    (["--optimizer.module_lr", "{vision = inf}"], "optimizer.module_lr = {'vision': inf}: a learning rate is"),
    # an empty path (--checkpoint.dir="$UNSET") is not "none": no checkpoint would be saved or loaded
    (["--checkpoint.dir", "''"], "checkpoint.dir = '': an empty path"),
    (["--checkpoint.dir="], "checkpoint.dir = '': an empty path"),
    (["--checkpoint.load", "''"], "checkpoint.load = '': an empty path"),
    # a weights-only start needs the checkpoint to take the weights from
    (["--checkpoint.load_model_only", "true"], "checkpoint.load_model_only = true without checkpoint.load"),
    (["--checkpoint.load_model_only", "true", "--checkpoint.load", "runs/a/step-000020", "--checkpoint.dir",
      "runs/a"], "checkpoint.load = 'runs/a/step-000020' inside checkpoint.dir = 'runs/a': a checkpoint in dir is "
                 "resumed with its full state"),
    (["--checkpoint.export_hf", "''"], "checkpoint.export_hf = '': an empty path"),
    (["--metrics.jsonl", "''"], "metrics.jsonl = '': an empty path"),
    # a misspelt encoder is a new one (modality "image"): named, not "several encoders take ['image'] items"
    (["--data.format", "llava", "--data.path", "x", "--data.tokenizer", "t", *IMAGE, "--model.encoders.imag.frozen",
      "true"], "model.encoders.image, model.encoders.imag all take 'image' items"),
    # the language model's head and loss options do nothing for an encoder, an encoder's for the decoder
    (["--options.vision.chunked_loss", "false"], "options.vision.chunked_loss: not used by this config"),
    (["--options.audio.loss_parallel", "false"], "options.audio.loss_parallel: not used by this config"),
    (["--options.language.recompute_colocated", "true"], "options.language.recompute_colocated: not used by this"),
    # refused by MimoModel on every rank, but only after the ranks had started and built their meshes
    (["--layout.language.pp", "4"], "layout.language.pp = 4 cuts the language model into 4 pipeline stages, but "
     "model.language.n_layers = 2 gives it 2 block(s): every stage needs at least one; lower layout.language.pp, or "
     "raise model.language.n_layers"),
    (["--layout.language.pp", "2", "--pipeline.schedule", "Interleaved1F1B", "--pipeline.virtual_stages", "2"],
     "layout.language.pp = 2 x pipeline.virtual_stages = 2 cuts the language model into 4 pipeline stages"),
    (["--layout.language.pp", "2", "--pipeline.split", "[1, 2]"], "pipeline.split = [1, 2]: give the layers of each "
     "of the language model's 2 pipeline stages (layout.language.pp = 2), each >= 1, 2 in all (model.language.n_layers"
     " = 2)"),
    (["--layout.vision.pp", "3"], "layout.vision.pp = 3 cuts encoder 'vision' into 3 pipeline stages, but "
     "model.encoders.vision.n_layers = 2 gives it 2 block(s)"),
    (["--options.language.balance", "true"], "options.language.balance: not used by this config"),
    (["--options.vision.recompute_colocated", "true"], "options.vision.recompute_colocated = true, but encoder "
     "'vision' (ranks 0) shares no rank with the language model (ranks 2)"),
    # accepted, and did nothing: one dp rank encodes every item
    (["--options.vision.balance", "true"], "options.vision.balance = true, but layout.vision.dp = 1: balancing "
     "splits the encoder's items over its dp ranks"),
    (["--layout.vision.pp", "2", "--layout.vision.dp", "2", "--options.vision.balance", "true"],
     "options.vision.balance = true with layout.vision.pp = 2"),
    # torch's compiler fails on every vision rank at the second microbatch (tests/test_fuzz.py RECOMPUTED_COMPILED_TP)
    (["--layout.vision.offset", "0", "--layout.audio.offset", "0", "--layout.language.offset", "0",
      "--layout.vision.tp", "2", "--layout.language.dp", "2", "--layout.audio.dp", "2",
      "--options.vision.recompute_colocated", "true", "--options.vision.compile", "true",
      "--pipeline.microbatches", "2"], "options.vision.recompute_colocated = true with options.vision.compile = true"),
    # torch's tracer recursion at the second step (tests/test_fuzz.py VARIED_COMPILED_TP)
    (["--model.encoders.vision.dynamic_resolution", "true", "--options.vision.compile", "true",
      "--layout.vision.tp", "2"], "model.encoders.vision.dynamic_resolution = true with options.vision.compile"),
])
def test_bad_input_names_the_key(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert message in str(e.value)


@pytest.mark.parametrize("argv, message", [
    (["--model.encoders.vision.max_patches", "4"], "model.encoders.vision.max_patches = 4: the digits scans at "
     "dynamic resolution (8x8, 8x12, 12x8, 12x12 px) give up to 9 patches of 4x4; raise it to 9"),
    (["--model.encoders.vision.patch_size", "8"], "model.encoders.vision.dynamic_resolution: DigitsTask: "
     "image_scales=((1.0, 1.0), (1.0, 1.5), (1.5, 1.0), (1.5, 1.5)) of image size 8 give 8x12, 12x8, 12x12 px, "
     "not whole 8x8 patches"),
])
def test_digits_dynamic_resolution_checks_its_sizes(argv: list[str], message: str) -> None:
    """Scans at 8x8, 8x12, 12x8, 12x12 (the library ViT's 4x4 patches): up to 3 x 3 = 9 patches."""
    from dtensor_mimo.train.modules import resolve

    on = ["--model.encoders.vision.dynamic_resolution", "true", "--model.encoders.audio.variable_length", "true"]
    resolved = resolve(parse_args(on))
    vision, audio = resolved.encoders["vision"], resolved.encoders["audio"]
    assert vision.config.dynamic_resolution and vision.config.max_patches == 9 == vision.tokens_per_item
    assert audio.config.variable_length and audio.tokens_per_item == 4  # 16 frames, strides 2, 2: 16 -> 8 -> 4
    with pytest.raises(ConfigError) as e:
        resolve(parse_args([*on, *argv]))
    assert message in str(e.value)


@pytest.mark.parametrize("argv, message", [
    (["--model.encoders.vision.image_size", "12"], "model.encoders.vision.image_size = 12: the digits scans are 8x8"),
    # 8x8 images in 3x3 patches: 2 x 2 patches cover pixels 0..5; rows and columns 6 and 7 were dropped
    (["--model.encoders.vision.patch_size", "3"], "model.encoders.vision.patch_size = 3 does not divide the scans' "
     "image size 8 (model.encoders.vision.image_size): the last 2 pixel rows and columns"),
    (["--model.encoders.vision.image_size", "16", "--model.encoders.vision.patch_size", "5"],
     "model.encoders.vision.patch_size = 5 does not divide the scans' image size 16"),
])
def test_digits_vit_sees_the_whole_scan(argv: list[str], message: str) -> None:
    """The digits ViT at one size: an image size that is not a multiple of the 8x8 scans was a bare
    ValueError naming ViTConfig (a traceback from the launcher), and patches that do not tile the image
    silently dropped the scans' last pixel rows and columns (3x3 patches of 8x8 images: a quarter of
    every scan's pixels never seen). Both are named as config keys, before any process starts."""
    from dtensor_mimo.train.modules import resolve

    assert resolve(parse_args(["--model.encoders.vision.image_size", "16"])).encoders["vision"].tokens_per_item == 16
    with pytest.raises(ConfigError) as e:
        resolve(parse_args(argv))
    assert message in str(e.value)


def test_options_the_layout_gives_a_use_are_accepted() -> None:
    """The other side of the refusals above: a colocated encoder recomputes, one of dp 2 balances, and
    stages of one block each are cut."""
    colocated = ["--layout.vision.offset", "0", "--layout.audio.offset", "0", "--layout.language.offset", "0"]
    parse_args([*colocated, "--options.vision.recompute_colocated", "true"])
    parse_args(["--layout.vision.dp", "2", "--options.vision.balance", "true", "--options.audio.balance", "false"])
    parse_args(["--layout.language.pp", "2", "--layout.vision.pp", "2", "--pipeline.split", "[1, 1]"])
    # a frozen tower compiled at tp 2 traces no backward: own-size items train (LLaVA's usual setup)
    parse_args(["--model.encoders.vision.frozen", "true", "--model.encoders.vision.dynamic_resolution", "true",
                "--options.vision.compile", "true", "--layout.vision.tp", "2"])


def test_bad_toml_file_names_the_file(tmp_path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[train\nsteps = 3\n")
    with pytest.raises(ConfigError, match="bad.toml: not valid TOML"):
        parse_args(["--config", str(path)])
    path.write_text("[train]\nsteps = 'many'\n")
    with pytest.raises(ConfigError, match="train.steps = 'many': expected an integer"):
        parse_args(["--config", str(path)])


def test_prefetch_with_loader_processes_is_refused() -> None:
    """data.prefetch's thread runs with workers = 0 only: both asked for is named, not one ignored."""
    args = ["--config", os.path.join(EXAMPLES, "llava_tiny.toml")]
    check_config(parse_args([*args, "--data.prefetch", "true", "--data.workers", "0"]), 2)
    check_config(parse_args([*args, "--data.workers", "2"]), 2)
    with pytest.raises(ConfigError, match="data.prefetch = true with data.workers = 2: the prefetch thread runs with "
                                          "workers = 0 only"):
        check_config(parse_args([*args, "--data.prefetch", "true", "--data.workers", "2"]), 2)


def test_layout_must_fit_the_launched_world() -> None:
    config = parse_args(["--layout.language.tp", "2"])
    check_config(config, 4)
    with pytest.raises(ConfigError, match="ranks 4..7 of the 8-rank world belong to no module"):
        check_config(config, 8)
    with pytest.raises(ConfigError, match="needs ranks 2..3, but the world has 3 ranks"):
        check_config(config, 3)


def test_pipeline_rules_are_the_librarys() -> None:
    """Fewer microbatches than stages is 1F1B's (and DualPipeV's) limit, not every schedule's: GPipe
    runs one microbatch through two language stages (the library accepts it, and its run matches a
    single process'), which the trainer refused by a rule of its own."""
    config = parse_args(["--layout.language.pp", "2", "--pipeline.schedule", "GPipe", "--pipeline.microbatches", "1",
                         "--data.batch_size", "8"])
    assert (config.pipeline.schedule, config.pipeline.microbatches) == ("GPipe", 1)
    assert build_layout(config).parallelism("language").pp == 2


def test_help_lists_every_key_with_its_default() -> None:
    text = help_text()
    for line in ("--train.steps", "--layout.<module>.tp", "--checkpoint.dir", "--checkpoint.every",
                 "--metrics.jsonl", "--pipeline.schedule", "--model.encoders.<name>.hf", "--options.<module>.sp",
                 "--data.format", "--checkpoint.export_hf"):
        assert line in text
    assert "'1F1B'" in text and "1500" in text


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(EXAMPLES, "*.toml"))),
                         ids=os.path.basename)
def test_example_configs_parse_and_check(path: str) -> None:
    config = parse_args(["--config", path])
    assert isinstance(config, TrainerConfig)
    check_config(config, build_layout(config).world_size)


def test_a_directory_without_tokenizer_files_is_named_as_such(tmp_path) -> None:
    pytest.importorskip("transformers")
    from dtensor_mimo.train.modules import load_tokenizer

    (tmp_path / "config.json").write_text("{}")  # a model directory, its tokenizer elsewhere
    config = parse_args(["--data.format", "llava", "--data.path", "x", "--data.tokenizer", str(tmp_path), *IMAGE])
    with pytest.raises(ConfigError, match="no tokenizer files there .*tokenizer.json.*point data.tokenizer"):
        load_tokenizer(config)


def test_an_export_the_model_cannot_take_is_refused_before_any_process(tmp_path) -> None:
    """The digits model's audio encoder (convolution strides 2, 2) has no Whisper form: a run that
    would end with `checkpoint.export_hf` is refused by the launcher's checks, not after its last
    step."""
    from dtensor_mimo.train.launch import preflight

    with pytest.raises(ConfigError, match=r"checkpoint.export_hf = '.*out': the trained model cannot be written as "
                                          r"Hugging Face directories: .*conv_strides=\(2, 2\).*remove "
                                          r"checkpoint.export_hf"):
        preflight(parse_args(["--checkpoint.export_hf", str(tmp_path / "out")]))
    preflight(parse_args([]))  # no export: nothing refused


@pytest.mark.parametrize("cp, tp, minimum, rounded", [(1, 1, 9, 9), (1, 2, 9, 10), (2, 1, 9, 12), (2, 4, 9, 16),
                                                      (3, 2, 7, 12), (2, 2, 9, 12)])
def test_seq_len_is_rounded_for_cp_chunks_and_each_cp_ranks_sp_shards(cp: int, tp: int, minimum: int,
                                                                        rounded: int) -> None:
    """2·cp load-balanced chunks divide the row, and tp divides each cp rank's rows (sequence
    parallel's shards, even: torch before 2.13 refuses uneven ones) -- at cp 2, tp 4: a multiple of 8."""
    from dtensor_mimo.train.datasets import round_seq_len

    config = parse_args(["--layout.language.cp", str(cp), "--layout.language.tp", str(tp)])
    got = round_seq_len(config, minimum)
    assert got == rounded and got % (2 * cp if cp > 1 else 1) == 0 and (got // cp) % tp == 0


@pytest.mark.parametrize("cp, minimum, rounded", [(1, 72, 80), (2, 72, 96), (1, 64, 64)])
def test_seq_len_is_rounded_for_a_float8_language_model_on_cuda(cp: int, minimum: int, rounded: int) -> None:
    """On CUDA a float8 language model's weight gradients take each cp rank's rows in multiples of
    16 (`fp8_rows_problem`, which a step would refuse): seq_len rounds to 16·cp there (72 -> 80,
    at cp 2 -> 96); on the CPU (emulated float8) as without fp8."""
    from dtensor_mimo.parallelize.fp8 import fp8_rows_problem
    from dtensor_mimo.train.datasets import round_seq_len

    argv = ["--layout.language.cp", str(cp), "--options.language.fp8", "tensorwise"]
    got = round_seq_len(parse_args([*argv, "--train.device", "cuda"]), minimum)
    assert got == rounded and fp8_rows_problem(5, got, 1, 2, cp) is None
    assert round_seq_len(parse_args(argv), minimum) == round_seq_len(parse_args(argv[:2]), minimum)


@pytest.mark.parametrize("seconds", [1.0, 2.01, 4.06, 8.03, 16.06, 29.99])
def test_audio_max_seconds_keeps_a_clip_of_exactly_that_length_whole(seconds: float) -> None:
    """data.audio_max_seconds = 8.03 at Whisper's 16 kHz is 128480 samples (803 frames of 160): a clip
    of exactly 8.03 s keeps every sample and frame. The float product 8.03 * 16000 = 128479.99999999999
    was cut to 128479 samples, 802 frames: the clip's last sample and frame lost."""
    from fractions import Fraction

    from dtensor_mimo.models import AudioConfig
    from dtensor_mimo.train.config import ConversationData
    from dtensor_mimo.train.modules import variable_audio

    transformers = pytest.importorskip("transformers")
    fe = transformers.WhisperFeatureExtractor()  # 16 kHz, hop 160, 3000 frames (30 s)
    config = TrainerConfig(data=ConversationData(audio_max_seconds=seconds))
    audio, samples = variable_audio(config, "audio", AudioConfig(n_layers=1), fe)
    exact = Fraction(str(seconds)) * 16000  # whole samples: 16000 * a number of hundredths
    assert exact.denominator == 1 and samples == exact and audio.variable_length
    assert samples // fe.hop_length == exact // 160


@pytest.mark.parametrize("variable_length", [False, True])
def test_a_feature_extractor_of_other_mel_bins_than_the_whisper_encoder_is_refused(tmp_path, variable_length) -> None:
    """model.encoders.audio.hf = a Whisper directory of 8 mel bins with processor = a directory whose
    feature extractor makes 16: refused when the config resolves, naming both counts (as a frame
    count other than the encoder's is). It was accepted, and then every clip failed at its batch
    ([16, T] features for an encoder of [8, T]): a MediaError per file, or, with
    data.skip_bad_media, every audio sample skipped."""
    from dtensor_mimo.train.config import ConversationData, EncoderSection
    from dtensor_mimo.train.modules import resolve_encoder
    from tests.test_hf import tiny_whisper

    transformers = pytest.importorskip("transformers")
    whisper, other = str(tmp_path / "whisper"), str(tmp_path / "other")
    tiny_whisper().save_pretrained(whisper)  # 8 mel bins, 16 positions: 32 frames
    for path, mels in ((whisper, 8), (other, 16)):  # 1 s chunks of hop 500: 32 frames
        transformers.WhisperFeatureExtractor(feature_size=mels, chunk_length=1, hop_length=500,
                                             n_fft=1024).save_pretrained(path)
    config = TrainerConfig(data=ConversationData())
    section = EncoderSection(hf=whisper, modality="audio", variable_length=variable_length)
    same = resolve_encoder(config, "audio", section)
    assert same.config.n_mels == same.processor.feature_size == 8
    section = EncoderSection(hf=whisper, modality="audio", processor=other, variable_length=variable_length)
    with pytest.raises(ConfigError, match=r"model.encoders.audio: the feature extractor makes 16 mel bins but the "
                                          r"encoder takes 8"):
        resolve_encoder(config, "audio", section)


@pytest.mark.parametrize("modality", ["image", "video"])
def test_an_image_processor_that_keeps_each_images_shape_is_refused_for_a_fixed_size_tower(tmp_path, modality) -> None:
    """model.encoders.image.processor = a CLIP processor that resizes the shortest edge to the
    tower's 16 pixels without a center crop: a square image becomes 16x16, a 16x40 one 16x40.
    The launcher's probe of the first file passed it where that file was square, and every
    other image then failed its step (MediaError; with data.skip_bad_media, left out). Refused
    when the config resolves, naming the key and the fix; with a crop to 16x16 it resolves."""
    import numpy as np
    from PIL import Image

    from dtensor_mimo.train.config import ConversationData, EncoderSection
    from dtensor_mimo.train.modules import resolve_encoder

    transformers = pytest.importorskip("transformers")
    path = str(tmp_path / "clip")
    processor = transformers.CLIPImageProcessor(size={"shortest_edge": 16}, do_center_crop=False)
    processor.save_pretrained(path)
    wide = Image.fromarray(np.zeros((16, 40, 3), dtype=np.uint8))
    assert tuple(processor(images=wide, return_tensors="pt")["pixel_values"].shape) == (1, 3, 16, 40)
    config = TrainerConfig(data=ConversationData())
    section = EncoderSection(modality=modality, image_size=16, patch_size=4, processor=path)
    with pytest.raises(ConfigError, match=rf"model.encoders.{modality}: the image processor resizes to size="
                                          r"\{'shortest_edge': 16\} and does not center crop: .*16x16.*"
                                          r"\{'height': 16, 'width': 16\}"):
        resolve_encoder(config, modality, section)
    transformers.CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}) \
        .save_pretrained(path)
    assert resolve_encoder(config, modality, section).item_shape == (3, 16, 16)


@pytest.mark.parametrize("key, value", [("image_size", "16"), ("patch_size", "2")])
def test_an_audio_encoders_image_sizes_are_refused(key: str, value: str) -> None:
    """--help: image_size is "the library ViT's square input", patch_size "the library ViT's
    patches". The library's audio encoder takes mel frames (digits: 16 bins x 16 frames; on
    conversations its feature extractor's): it read neither, and a run given either trained the
    same model as without it, in silence. Refused by name, as the library sizes of an hf encoder."""
    from dtensor_mimo.train.modules import resolve

    plain = resolve(parse_args([])).encoders["audio"].config
    with pytest.raises(ConfigError, match=rf"model.encoders.audio.{key}: not used by this config"):
        parse_args([f"--model.encoders.audio.{key}", value])
    with pytest.raises(ConfigError, match=rf"model.encoders.sound.{key}: not used by this config"):
        parse_args(["--data.format", "llava", "--data.path", "x", "--data.tokenizer", "t", *IMAGE,
                    "--model.encoders.sound.modality", "audio", "--model.encoders.sound.processor", "p",
                    f"--model.encoders.sound.{key}", value])
    # the image encoder's are its ViT's: its rows follow them
    vision = resolve(parse_args([f"--model.encoders.vision.{key}", value])).encoders["vision"]
    assert vision.tokens_per_item == {"image_size": 16, "patch_size": 16}[key] != 4
    assert plain.n_mels == 16 and plain.max_frames == 16


@pytest.mark.parametrize("argv, main", [
    (["--checkpoint.every", "20"], "checkpoint.dir"),
    (["--checkpoint.keep", "5"], "checkpoint.dir"),
    (["--checkpoint.async_mode", "async"], "checkpoint.dir"),
    (["--metrics.profile_at", "3"], "metrics.profile"),
    (["--metrics.profile_steps", "4"], "metrics.profile"),
])
def test_a_setting_of_an_output_that_is_not_written_is_refused(tmp_path, argv: list[str], main: str) -> None:
    """--help: checkpoint.every "steps between saves", keep "the most recent checkpoints kept",
    async_mode how each save is written, profile_at / profile_steps which steps are profiled.
    Without checkpoint.dir no save is made (checkpoint.dir: "None: no checkpoints"), without
    metrics.profile no profile (export_dtype stays: `Trainer.export(path)` reads it): a run
    given `--checkpoint.every 20` and no directory trained to its end with no checkpoint at all, in
    silence. Refused by name before any process starts, as the config's other unused keys; with
    the output named they are accepted."""
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    key = argv[0][2:]
    assert f"{key}: not used by this config" in str(e.value) and main in str(e.value)
    config = parse_args([*argv, f"--{main}", str(tmp_path / "out")])
    assert str(getattr(getattr(config, key.split(".")[0]), key.split(".")[1])) == argv[1]


@pytest.mark.parametrize("argv, message", [
    # accepted, then refused by MimoModel on every rank once they had started (LayoutError: "set sp=False",
    # "use compile_scope='block'"), in the library's words, not the config's keys
    (["--layout.vision.pp", "2", "--layout.vision.tp", "2", "--options.vision.sp", "true"],
     "options.vision.sp = true with layout.vision.pp = 2"),
    (["--layout.vision.pp", "2", "--options.vision.compile_scope", "module"],
     "options.vision.compile_scope = 'module' with layout.vision.pp = 2"),
    (["--model.encoders.vision.dynamic_resolution", "true", "--options.vision.compile_scope", "module"],
     "options.vision.compile_scope = 'module' with model.encoders.vision.dynamic_resolution = true"),
    (["--layout.language.pp", "2", "--options.language.compile_scope", "module"],
     "options.language.compile_scope = 'module' with 2 pipeline stages of the language model"),
    (["--layout.vision.dp", "2", "--options.vision.compile_scope", "module"],
     "options.vision with layout.vision (dp = 2, cp = 1, tp = 1): vision: ParallelOptions(compile_scope='module') "
     "compiles the module whole, but FSDP2 shards it"),
])
def test_options_the_layout_cannot_take_are_named_before_any_process(argv: list[str], message: str) -> None:
    """--help: compile_scope 'module' is "refused where FSDP2 shards the module, ..., for an encoder
    with pp > 1, ..., for an encoder with items of their own sizes, and for a decoder cut into
    pipeline stages" -- refused by the library inside the ranks (a 4-rank digits run: 34 s to
    "error on ranks 0, 1, 2, 3: LayoutError: encoder 'vision' has pp=2: sequence parallel is not
    supported on encoder stages: set sp=False"). Named by key before any process starts; the same
    options on a layout that gives them a use pass, and sp at tp = 1 (the library's "ignored
    without a tp mesh of size > 1": the planner's candidates at tp = 1 keep it)."""
    from dtensor_mimo.layout import LayoutError, Parallelism
    from dtensor_mimo.parallelize.options import ParallelOptions
    from dtensor_mimo.parallelize.part import check_compile_layout

    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert message in str(e.value)
    parse_args(["--layout.vision.tp", "2", "--options.vision.sp", "true", "--layout.language.tp", "2",
                "--options.language.sp", "true"])
    parse_args(["--options.vision.sp", "true", "--options.language.sp", "true"])
    parse_args(["--options.vision.compile_scope", "module", "--options.language.compile_scope", "module",
                "--layout.language.dp", "2", "--options.language.fsdp", "false"])
    with pytest.raises(LayoutError):  # the library's own verdict on the last one above
        check_compile_layout("vision", ParallelOptions(compile=True, compile_scope="module"), Parallelism(dp=2))
