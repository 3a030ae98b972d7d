"""The trainer's metrics helpers (one process, no device needed)."""

from __future__ import annotations

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
