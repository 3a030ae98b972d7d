"""The trainer's metrics helpers (one process, no device needed)."""

from __future__ import annotations

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
    trainer = SimpleNamespace(config=SimpleNamespace(data=SimpleNamespace(batch_size=batch)),
                              modules={"language": llama}, seq_len=seq, resolved=SimpleNamespace(encoders={}),
                              data=SimpleNamespace(tokens_per_item={}, items_per_sample={}))
    assert Trainer._flops(trainer) == expected
