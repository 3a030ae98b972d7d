"""The trainer's metrics helpers (one process, no device needed)."""

from __future__ import annotations

import io
import json
import os

import pytest
import torch

from dtensor_mimo.train import metrics


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0),   # SXM
    ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0),
    ("NVIDIA H200 NVL", 835.0),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA GeForce RTX 4090", None),   # unknown: MFU not reported unless metrics.peak_tflops is set
])
def test_peak_tflops_of_each_board(monkeypatch, name: str, peak: float | None) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert metrics.peak_tflops(torch.device("cuda", 0), 0.0) == peak
    assert metrics.peak_tflops(torch.device("cuda", 0), 500.0) == 500.0  # configured wins
    assert metrics.peak_tflops(torch.device("cpu"), 0.0) is None


def test_transformer_flops_by_hand() -> None:
    # 2 params/token forward + 4 * layers * seq * dim per token; x3 when trained
    assert metrics.transformer_flops(100, 10, 2, 8, 5, False) == 2 * 100 * 10 + 4 * 2 * 5 * 8 * 10
    assert metrics.transformer_flops(100, 10, 2, 8, 5, True) == 3 * (2 * 100 * 10 + 4 * 2 * 5 * 8 * 10)
    assert metrics.transformer_flops(100, 10, 2, 8, 5, False, through=True) == 2 * 2 * 100 * 10 + 3 * 4 * 2 * 5 * 8 * 10


def test_phase_times_between_cuda_events_are_read_once_when_used() -> None:
    """`train_step`'s GPU phase timings (`Elapsed`) wait for their end event only when used, once."""
    from dtensor_mimo.optim.step import Elapsed

    class Event:  # the two calls Elapsed makes of a torch.cuda.Event
        waits = 0

        def __init__(self, t: float) -> None:
            self.t = t

        def synchronize(self) -> None:
            Event.waits += 1

        def elapsed_time(self, end: "Event") -> float:  # milliseconds, as CUDA's
            return (end.t - self.t) * 1e3

    phase = Elapsed(Event(1.0), Event(1.25))
    assert Event.waits == 0  # recording a phase waits for nothing
    assert float(phase) == 0.25 and phase * 1e3 == 250.0 and f"{phase:.1f}" == "0.2" and sum([phase, phase]) == 0.5
    assert Event.waits == 1


def test_logger_writes_to_the_stdout_it_was_built_under(monkeypatch) -> None:
    """The planner's calibration ranks point sys.stdout at /dev/null before they build a trainer;
    its log lines then go there, not to the stdout of the logger module's import."""
    import io
    import sys

    from dtensor_mimo.train.metrics import MetricsLogger

    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    MetricsLogger(True, 10, None, None, "off").print("held-out accuracy: 1.00")
    assert out.getvalue() == "held-out accuracy: 1.00\n"


def test_step_profiler_window(tmp_path) -> None:
    """`StepProfiler` records from the first step of its window that runs (a run resumed inside it
    starts there), to the window's end or the run's last step, whichever comes first; `abandon`
    (a run's error) writes nothing."""
    from dtensor_mimo.train.metrics import StepProfiler

    def run(first: int, count: int, last_step: int, steps: range) -> list[str | None]:
        profiler = StepProfiler(str(tmp_path / f"{first}-{count}-{steps.start}"), first, count, last_step, 0,
                                torch.device("cpu"))
        written = []
        for step in steps:
            profiler.before(step)
            torch.ones(4).sum()
            written.append(profiler.after(step))
        return written

    written = run(3, 2, 10, range(1, 7))
    assert written[:3] == [None] * 3 and written[4:] == [None, None] and written[3].endswith("rank0.txt")
    assert open(written[3]).read().startswith("rank 0, steps 3-4, by self_cpu_time_total")
    last = run(6, 2, 6, range(1, 7))[-1]  # the window's end past the run's last step
    assert open(last).read().startswith("rank 0, steps 6-6")
    resumed = run(3, 3, 10, range(4, 7))[1]  # resumed at step 4: steps 4-5
    assert open(resumed).read().startswith("rank 0, steps 4-5")
    assert run(3, 2, 10, range(5, 8)) == [None] * 3  # resumed past the window
    profiler = StepProfiler(str(tmp_path / "abandoned"), 1, 2, 10, 0, torch.device("cpu"))
    profiler.before(1)
    profiler.abandon()
    assert profiler.after(1) is None and not (tmp_path / "abandoned").exists()


def test_step_profiler_failing_never_costs_the_run(tmp_path, monkeypatch) -> None:
    """A profiler that cannot start, or a profile that cannot be written, leaves `failed` saying
    why and the steps running."""
    import torch.profiler

    from dtensor_mimo.train.metrics import StepProfiler

    (tmp_path / "file").write_text("")
    unwritable = StepProfiler(str(tmp_path / "file"), 1, 1, 5, 0, torch.device("cpu"))  # a file, not a directory
    unwritable.before(1)
    assert unwritable.after(1) is None and unwritable.failed.startswith("the profile of steps 1-1 was not written")

    class Broken:
        def __init__(self, **kwargs) -> None:
            pass

        def __enter__(self) -> None:
            raise RuntimeError("CUPTI is busy")

    monkeypatch.setattr(torch.profiler, "profile", Broken)
    broken = StepProfiler(str(tmp_path / "p"), 1, 2, 5, 0, torch.device("cpu"))
    for step in (1, 2, 3):
        broken.before(step)
        assert broken.after(step) is None
    assert broken.failed == "torch.profiler did not start: RuntimeError: CUPTI is busy"


def test_a_resumed_run_replaces_the_tensorboard_steps_it_logs_again(tmp_path) -> None:
    """A run stopped after logging steps 1-5 from a checkpoint of step 3 resumes at step 4: its
    records of steps 4 and 5 replace the first run's, not stand beside them."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = metrics.MetricsLogger(True, 5, None, str(tmp_path), "off", out=open(os.devnull, "w"))
    for step in range(1, 6):
        first.log({"step": step, "loss": float(step)}, "")
    first.close()
    resumed = metrics.MetricsLogger(True, 5, None, str(tmp_path), "off", out=open(os.devnull, "w"))
    for step in (4, 5):
        resumed.log({"step": step, "loss": 10.0 * step}, "")
    resumed.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]


def test_a_rerun_at_the_last_step_writes_each_tensorboard_scalar_once(tmp_path) -> None:
    """A finished run (steps 1-2 and its final evaluation at step 2) given again resumes at step 2,
    trains nothing and evaluates step 2 again: its held-out scalars stood twice at step 2 in the
    event files (metrics.jsonl keeps them once). A run stopped during its last step (no evaluation)
    and rerun gets them once too, and the steps' losses stay either way."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    quiet = open(os.devnull, "w")
    for evaluated in (True, False):
        tb = tmp_path / str(evaluated)
        first = metrics.MetricsLogger(True, 2, None, str(tb), "off", out=quiet)
        first.start_at(0)
        for step in (1, 2):
            first.log({"step": step, "loss": float(step)}, "")
        if evaluated:
            first.log({"step": 2, "heldout_answer": 0.5, "heldout_loss": 1.5}, "")
        first.close()
        rerun = metrics.MetricsLogger(True, 2, None, str(tb), "off", out=quiet)
        rerun.start_at(2)
        rerun.log({"step": 2, "heldout_answer": 0.5, "heldout_loss": 1.5}, "")
        rerun.close()
        events = EventAccumulator(str(tb))
        events.Reload()
        assert [(e.step, e.value) for e in events.Scalars("heldout_answer")] == [(2, 0.5)], evaluated
        assert [(e.step, e.value) for e in events.Scalars("heldout_loss")] == [(2, 1.5)], evaluated
        assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 2.0)], evaluated


def test_step_flops_count_attention_at_the_heads_width() -> None:
    """A decoder whose heads are not dim wide in all (Qwen3, Mistral-Nemo: head_dim != dim /
    n_heads): attention's scores and weighted sums run over n_heads * head_dim per token (PaLM's
    12 * layers * heads * head_dim * seq per trained token), not over dim."""
    from types import SimpleNamespace

    from dtensor_mimo.models.llama import Llama, LlamaConfig
    from dtensor_mimo.train.trainer import Trainer

    vocab, dim, layers, heads, kv_heads, head_dim, ffn, batch, seq = 100, 32, 2, 4, 2, 16, 64, 2, 8
    with torch.device("meta"):
        llama = Llama(LlamaConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
                                  head_dim=head_dim, ffn_hidden=ffn))
    per_layer = (dim * heads * head_dim * 2 + 2 * dim * kv_heads * head_dim  # wq, wo, wk, wv
                 + 3 * dim * ffn + 2 * dim)  # w1, w2, w3, two norms
    params = layers * per_layer + dim + vocab * dim  # the final norm, the output head (embeddings: no FLOPs)
    tokens = batch * seq
    expected = 3 * (2 * params * tokens + 4 * layers * seq * heads * head_dim * tokens)
    language = SimpleNamespace(frozen=False)
    trainer = SimpleNamespace(config=SimpleNamespace(data=SimpleNamespace(batch_size=batch),
                                                     model=SimpleNamespace(language=language)),
                              modules={"language": llama}, seq_len=seq, resolved=SimpleNamespace(encoders={}),
                              data=SimpleNamespace(tokens_per_item={}, items_per_sample={}))
    assert Trainer._flops(trainer) == expected
    language.frozen = True  # forward, and the backward through it to the projections' rows (no weight gradients)
    assert Trainer._flops(trainer) == 2 * 2 * params * tokens + 3 * 4 * layers * seq * heads * head_dim * tokens
    language.frozen = False  # a tied head (one parameter, listed once as the embedding) is still a matmul
    with torch.device("meta"):
        trainer.modules["language"] = Llama(LlamaConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads,
                                                        n_kv_heads=kv_heads, head_dim=head_dim, ffn_hidden=ffn,
                                                        tie_embeddings=True))
    assert Trainer._flops(trainer) == expected


def test_step_flops_count_each_encoder_at_its_items_and_training() -> None:
    """An encoder's FLOPs per step: its tower over batch x (mean items per sample) x (rows per
    item) rows, attention at the item's rows; forward only when the tower is frozen (no backward
    runs through it: nothing before it trains), x3 when it trains; its projection always trained."""
    from types import SimpleNamespace

    from dtensor_mimo.models.llama import Llama, LlamaConfig
    from dtensor_mimo.models.modality_encoder import ModalityEncoder
    from dtensor_mimo.models.projection import Projection
    from dtensor_mimo.models.vit import ViT, ViTConfig
    from dtensor_mimo.train.trainer import Trainer

    batch, seq, items, rows, vdim, vlayers = 2, 8, 1.5, 4, 16, 2
    with torch.device("meta"):
        llama = Llama(LlamaConfig(vocab_size=50, dim=32, n_layers=1, n_heads=4, n_kv_heads=4, ffn_hidden=64))
        tower = ViT(ViTConfig(image_size=8, patch_size=4, dim=vdim, n_layers=vlayers, n_heads=2))
        vision = ModalityEncoder(tower, Projection(vdim, 32))
    section = SimpleNamespace(frozen=True)
    trainer = SimpleNamespace(
        config=SimpleNamespace(data=SimpleNamespace(batch_size=batch), model=SimpleNamespace(
            language=SimpleNamespace(frozen=False))),
        modules={"language": llama, "vision": vision}, seq_len=seq,
        resolved=SimpleNamespace(encoders={"vision": SimpleNamespace(tokens_per_item=99, section=section)}),
        data=SimpleNamespace(tokens_per_item={"vision": float(rows)}, items_per_sample={"vision": items}))
    language_only = dict(trainer.modules)
    del language_only["vision"]
    alone = SimpleNamespace(**{**vars(trainer), "modules": language_only, "resolved": SimpleNamespace(encoders={})})
    language = Trainer._flops(alone)
    t = int(batch * items * rows)  # 12 rows of the tower per step
    tower_params = sum(p.numel() for p in tower.parameters())
    projection_params = 16 * 32 + 32 + 32 * 32 + 32  # fc1, fc2 with their biases
    tower_pass = 2 * tower_params * t + 4 * vlayers * rows * vdim * t
    projection = 3 * 2 * projection_params * t
    assert Trainer._flops(trainer) == language + tower_pass + projection  # frozen tower: its forward alone
    section.frozen = False
    assert Trainer._flops(trainer) == language + 3 * tower_pass + projection


def _stopped_at_the_last_step_then_rerun(argv: list[str]) -> str | None:
    """The run of `argv` stopped by SIGTERM during its last step (its checkpoint then holds that
    step, and no evaluation ran), then the requeued command, which resumes there and evaluates."""
    import signal

    from dtensor_mimo.train.config import parse_args
    from dtensor_mimo.train.trainer import Trainer

    config = parse_args(argv)

    class LastStepSignal:  # what `StopSignals` says once SIGTERM came during the last step
        def __init__(self, trainer: Trainer) -> None:
            self.trainer = trainer

        @property
        def requested(self) -> signal.Signals | None:
            return signal.SIGTERM if self.trainer.step == config.train.steps - 1 else None

    first = Trainer(config)
    first.signals = LastStepSignal(first)
    assert first.run() is None and first.stopped == signal.SIGTERM and first.step == config.train.steps
    again = Trainer(parse_args(argv))
    again.run()
    return again.saved


def _logged_digits_run(steps: int, tmp_path) -> list[str]:
    """The digits job for `steps` steps on one rank, eager, every step logged to ``m.jsonl`` and
    TensorBoard's ``tb``, checkpoints in ``ckpt`` (under `tmp_path`)."""
    return ["--train.steps", str(steps), "--data.batch_size", "4", "--pipeline.microbatches", "1",
            "--data.heldout_samples", "4", "--train.generate", "0", "--metrics.log_every", "1",
            "--metrics.progress", "off", "--layout.audio.offset", "0", "--layout.language.offset", "0",
            "--checkpoint.dir", str(tmp_path / "ckpt"), "--metrics.tensorboard", str(tmp_path / "tb"),
            "--metrics.jsonl", str(tmp_path / "m.jsonl"),
            *[f"--options.{m}.compile=false" for m in ("vision", "audio", "language")]]


def test_a_run_resumed_at_its_last_step_keeps_that_steps_tensorboard_scalars(tmp_path) -> None:
    """A run stopped by SIGTERM during its last step writes that step's checkpoint and skips the
    final evaluation; the requeued command resumes at the last step, trains nothing and evaluates.
    Its first record (the held-out scores, at the last step) opened TensorBoard purging from that
    step: the stopped run's loss, grad norm, lr, ... of the last step were dropped from the
    event files (the JSONL still had them). Only the steps the resumed run trains are logged
    again, so only those may be purged."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("sklearn")  # the digits data
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.harness import run_on_ranks

    steps = 3
    argv = _logged_digits_run(steps, tmp_path)
    run_on_ranks(_stopped_at_the_last_step_then_rerun, 1, argv, timeout=300)
    with open(tmp_path / "m.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]  # the stopped run logged every step
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("heldout_answer")] == [steps]  # the rerun's evaluation
    for key in ("loss", "grad_norm", "lr"):
        assert [e.step for e in events.Scalars(key)] == [1, 2, 3], key


def test_a_resumed_run_replaces_the_jsonl_records_it_logs_again(tmp_path) -> None:
    """A run that logged steps 1-5 (the last one cut short by a kill while it was written) and
    resumes from its checkpoint of step 3 logs steps 4 and 5 again: the JSONL holds each step once,
    the resumed run's records after the stopped run's of steps 1-3 (as TensorBoard purges them),
    not steps 4, 5 twice, nor the resumed run's first record glued to the cut line."""
    path = tmp_path / "m.jsonl"
    first = metrics.MetricsLogger(True, 5, str(path), None, "off", out=open(os.devnull, "w"))
    first.start_at(0)
    for step in range(1, 6):
        first.log({"step": step, "loss": float(step)}, "")
    first.log({"step": 3, "heldout_answer": 0.5}, "")  # logged late: a step before the resume's, kept
    first.log({"step": 4, "checkpoint": "c3", "checkpoint_step": 3}, "")  # the one resumed from: kept
    first.log({"step": 5, "checkpoint": "c4", "checkpoint_step": 4}, "")  # written after it: dropped
    first.close()
    with open(path, "a") as f:
        f.write('{"step": 6, "lo')  # killed while writing
    out = io.StringIO()
    resumed = metrics.MetricsLogger(True, 5, str(path), None, "off", out=out)
    resumed.start_at(3)
    for step in (4, 5):
        resumed.log({"step": step, "loss": 10.0 * step}, "")
    resumed.close()
    with open(path) as f:
        records = [json.loads(line) for line in f]
    assert [(r["step"], r.get("loss")) for r in records] == [(1, 1.0), (2, 2.0), (3, 3.0), (3, None), (4, None),
                                                              (4, 40.0), (5, 50.0)]
    assert records[4]["checkpoint_step"] == 3
    assert f"{path}: dropped 3 record(s) of steps after 3 written by an earlier run" in out.getvalue()


def test_a_run_from_step_0_or_into_no_regular_file_appends_to_the_jsonl(tmp_path) -> None:
    """Only a resumed run drops records: one from step 0 appends to a file that holds another run's
    (nothing of it lost), and so does a resumed one whose JSONL is not a regular file (a FIFO here,
    ``/dev/stdout`` piped to ``tee`` in use: reading it would block), which says so."""
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 7, "loss": 1.0}\n')
    fresh = metrics.MetricsLogger(True, 5, str(path), None, "off", out=open(os.devnull, "w"))
    fresh.start_at(0)
    fresh.log({"step": 1, "loss": 2.0}, "")
    fresh.close()
    assert [json.loads(line)["step"] for line in open(path)] == [7, 1]
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the other end, as tee's
    out = io.StringIO()
    resumed = metrics.MetricsLogger(True, 5, str(fifo), None, "off", out=out)
    resumed.start_at(3)  # returns: the file is not read
    resumed.log({"step": 4, "loss": 3.0}, "")
    resumed.close()
    assert json.loads(os.read(reader, 1000).decode()) == {"step": 4, "loss": 3.0}
    os.close(reader)
    assert f"{fifo} is not a regular file: records an earlier run wrote of steps after 3 stay in it" in out.getvalue()


def _train(argv: list[str]) -> None:
    from dtensor_mimo.train.config import parse_args
    from dtensor_mimo.train.trainer import Trainer

    Trainer(parse_args(argv)).run()


def _interrupted_then_resumed(argv: list[str], checkpoint_dir: str) -> None:
    """The run of `argv` to its end, its last checkpoint then removed (the run killed after it had
    logged its last steps, before that checkpoint was written), then the same command again: it
    resumes from the checkpoint before and trains the last steps again."""
    import shutil

    from dtensor_mimo.train.config import parse_args
    from dtensor_mimo.train.trainer import Trainer

    Trainer(parse_args(argv)).run()
    shutil.rmtree(os.path.join(checkpoint_dir, max(n for n in os.listdir(checkpoint_dir) if n.startswith("step-"))))
    again = Trainer(parse_args(argv))
    again.run()
    assert again.step == parse_args(argv).train.steps


def test_a_resumed_trainer_logs_each_step_once_in_the_jsonl(tmp_path) -> None:
    """The trainer resumed at step 3 of a run that had logged steps 1-5: the JSONL has steps 1-5
    once each, with the losses of an uninterrupted run (the stopped run's 1-3, the resumed
    run's 4-5), not steps 4 and 5 twice."""
    pytest.importorskip("sklearn")  # the digits data
    from tests.harness import run_on_ranks

    def digits(steps: int) -> list[str]:
        return ["--train.steps", str(steps), "--data.batch_size", "4", "--pipeline.microbatches", "1",
                "--data.heldout_samples", "4", "--train.generate", "0", "--train.eval_every", "0",
                "--metrics.log_every", "1", "--metrics.progress", "off", "--lr_schedule.warmup_steps", "2",
                "--layout.audio.offset", "0",
                "--layout.language.offset", "0",
                *[f"--options.{m}.compile=false" for m in ("vision", "audio", "language")]]

    run_on_ranks(_train, 1, [*digits(5), "--metrics.jsonl", str(tmp_path / "ref.jsonl")], timeout=300)  # uninterrupted
    with open(tmp_path / "ref.jsonl") as f:
        reference = [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]
    ckpt = str(tmp_path / "ckpt")
    run_on_ranks(_interrupted_then_resumed, 1, [*digits(5), "--checkpoint.dir", ckpt, "--checkpoint.every", "3",
                                                "--metrics.jsonl", str(tmp_path / "m.jsonl")], ckpt, timeout=300)
    with open(tmp_path / "m.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [(r["step"], r["loss"]) for r in records if "loss" in r] == reference
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]
    assert [r["checkpoint_step"] for r in records if "checkpoint" in r] == [3, 5]  # the stopped run's of 5: dropped


def test_a_finished_run_rerun_logs_its_last_evaluation_once(tmp_path) -> None:
    """The command of a finished run given again (a requeued job that had completed): it resumes
    at its last step, trains nothing and evaluates that step again. The JSONL holds that step's
    held-out scores once (the rerun's, equal to the first run's: the same weights), not twice; so
    do TensorBoard's event files."""
    pytest.importorskip("sklearn")  # the digits data
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.harness import run_on_ranks

    argv = _logged_digits_run(2, tmp_path)
    run_on_ranks(_train, 1, argv, timeout=300)
    with open(tmp_path / "m.jsonl") as f:
        first = [json.loads(line) for line in f]
    run_on_ranks(_train, 1, argv, timeout=300)  # the same command: resumes at step 2, trains nothing
    with open(tmp_path / "m.jsonl") as f:
        records = [json.loads(line) for line in f]
    evaluations = [r for r in records if "heldout_answer" in r]
    assert [r["step"] for r in evaluations] == [2]
    assert evaluations[0]["heldout_loss"] == [r for r in first if "heldout_answer" in r][0]["heldout_loss"]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert [r["checkpoint_step"] for r in records if "checkpoint" in r] == [2]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for key, steps in (("heldout_answer", [2]), ("heldout_loss", [2]), ("loss", [1, 2]), ("grad_norm", [1, 2])):
        assert [e.step for e in events.Scalars(key)] == steps, key
