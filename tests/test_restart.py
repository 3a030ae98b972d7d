"""Elastic restarts: ``torchrun --max-restarts=1`` survives a killed worker and loses nothing.

| run (2 ranks: vision + audio @0, language @1; 8 steps, checkpoints every 2) | checked                        |
|-----------------------------------------------------------------------------|--------------------------------|
| uninterrupted (the harness's ranks)                                         | the reference losses           |
| torchrun, rank 1 SIGKILLed as step 6 starts (`DTENSOR_MIMO_FAULT=kill:6:1`)   | one restart; resumed at step 4; |
|                                                                             | steps 1-5, then 5-8 again ==    |
|                                                                             | the reference, bit for bit      |

The restarted round joins a new world through `init_distributed` (the trainer's): without its
per-round store prefix that world fails in ``init_process_group`` (the previous round's
addresses, "Connection refused") or hangs there, and this test with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dtensor_mimo.train.config import parse_args
from tests.harness import run_on_ranks

pytest.importorskip("sklearn")

TINY = ["--train.steps", "8", "--data.batch_size", "8", "--pipeline.microbatches", "2",
        "--data.heldout_samples", "8", "--train.generate", "0", "--metrics.log_every", "1",
        "--lr_schedule.warmup_steps", "2", "--metrics.progress", "off", "--layout.audio.offset", "0",
        "--checkpoint.every", "2",
        *[f"--options.{m}.compile=false" for m in ("vision", "audio", "language")]]
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(argv: list[str]) -> float:
    from dtensor_mimo.train.trainer import Trainer

    return Trainer(parse_args(argv)).run()


def _records(path) -> list[tuple[int, float]]:
    with open(path) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


def _torchrun(args: list[str], cwd, env: dict[str, str], timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO, **env}
    return subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=1", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def test_killed_worker_restarts_and_resumes_with_the_same_losses(tmp_path) -> None:
    run_on_ranks(_train, 2, [*TINY, "--checkpoint.dir", str(tmp_path / "ref"),
                             "--metrics.jsonl", str(tmp_path / "ref.jsonl")], timeout=300)
    reference = dict(_records(tmp_path / "ref.jsonl"))
    assert sorted(reference) == list(range(1, 9))

    out = _torchrun(["-m", "tests.inject_faults", *TINY, "--checkpoint.dir", "ckpt", "--metrics.jsonl", "m.jsonl"],
                    tmp_path, {"DTENSOR_MIMO_FAULT": "kill:6:1"})
    assert out.returncode == 0, out.stderr[-4000:]
    assert "DTENSOR_MIMO_FAULT: killing rank 1" in out.stderr
    # One round lost, one restart: torchrun names whichever worker it saw end first (the killed one,
    # exit -9, or its peer, which fails fast on the lost connection, exit 1).
    assert out.stderr.count("failed (exitcode:") == 1, out.stderr[-4000:]
    assert f"resumed from {os.path.join('ckpt', 'step-000004')} at step 4" in out.stdout
    # the first round's steps to its checkpoint's, then the second round's: its step 5 replaced the first's
    got = _records(tmp_path / "m.jsonl")
    assert [s for s, _ in got] == list(range(1, 9))
    assert [loss for _, loss in got] == [reference[s] for s, _ in got]
