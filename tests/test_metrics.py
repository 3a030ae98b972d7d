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
