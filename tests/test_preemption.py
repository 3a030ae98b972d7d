"""Nothing lost on preemption: SIGTERM / SIGINT / SIGUSR1 stop the run after the step in flight, with a checkpoint.

| case                                                                  | expected                                   |
|-----------------------------------------------------------------------|--------------------------------------------|
| `train_step` votes [2]: rank 1 votes, rank 0 does not                  | both get the same sums in the same step    |
| `train_step` unusable [2]: rank 1 could not build its part             | `UnusableBatch` on both, weights unchanged  |
| `StopSignals`: a signal, the same again at once, then a second one     | first recorded; the repeat ignored; the    |
|                                                                       | second exits at once with 143              |
| `StopSignals`: SIGUSR1 (Slurm's warning before the time limit)         | recorded as a stop request (status 138)    |
| own launcher [2], SIGUSR1 to the launcher after a logged step         | exit 138; "stopped by SIGUSR1 at step N:    |
|                                                                       | checkpoint written to ckpt/step-N"; verifies |
| torchrun [2], a loader worker per rank, background saves every 3      | "resumed from ... at step N"; workers exit |
| steps, resuming it; SIGTERM to torchrun after a periodic save         | 143; the line; the checkpoint verifies     |
| resumed to the end [2]                                                | every step's loss == the uninterrupted     |
|                                                                       | run's, exactly                              |
| `checkpoint.dir` holding no checkpoint                                | "no checkpoint in DIR: starting at step 0" |
| own launcher [2], SIGTERM while its ranks still import (no handlers)  | exit 143 after step 1, its checkpoint       |
| own launcher [2], no `checkpoint.dir`, SIGTERM after a logged step    | "nothing saved", exit 143                   |
| SIGTERM reaching rank 1 inside step 2's forward [2]                   | both stop after step 2, its checkpoint     |
| the same at an evaluation step (eval_every 2), then resumed [2]        | held-out records of steps 2 and 4, once    |
|                                                                       | each, == the uninterrupted run's           |
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from dtensor_mimo.train.checkpoint import verify
from dtensor_mimo.train.preemption import STOP_SIGNALS
from dtensor_mimo.train.config import parse_args
from tests.harness import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
STEPS = 24
TINY = ["--train.steps", str(STEPS), "--data.batch_size", "8", "--pipeline.microbatches", "2",
        "--data.heldout_samples", "8", "--train.generate", "0", "--metrics.log_every", "1",
        "--lr_schedule.warmup_steps", "2", "--metrics.progress", "off", "--layout.audio.offset", "0",
        *[f"--options.{m}.compile=false" for m in ("vision", "audio", "language")]]
ENV = {**os.environ, "PYTHONPATH": REPO}


# ---------------------------------------------------------------------------- the step's votes


@pytest.mark.parametrize(("votes", "expected"), [
    ((0.0, 1.0, 1.0), signal.SIGINT), ((1.0, 2.0, 1.0), signal.SIGTERM), ((0.0, 0.0, 3.0), signal.SIGUSR1),
    ((0.0, 0.0, 0.0), None)])
def test_the_summed_stop_votes_name_the_first_signal_any_rank_got(votes, expected) -> None:
    """The summed votes (SIGTERM, SIGINT, SIGUSR1: ranks that got each) stop the run for SIGTERM
    when any rank got it, else SIGINT, else SIGUSR1 (the scheduler's word wins: its exit status
    143 is what it requeues on); none: the run goes on."""
    from types import SimpleNamespace

    from dtensor_mimo.train.trainer import Trainer

    assert [s.name for s in STOP_SIGNALS] == ["SIGTERM", "SIGINT", "SIGUSR1"]
    trainer = SimpleNamespace(stopped=None)
    Trainer._agree_on_stop(trainer, votes)
    assert trainer.stopped == expected


def _votes_and_unusable() -> tuple[tuple[float, ...], str]:
    from dtensor_mimo.optim.step import UnusableBatch, train_step
    from tests.test_faults import DISJOINT, _model, _unchanged, _weights
    from tests.test_mimo import _batches

    model, optimizer = _model(*DISJOINT)
    batch = _batches(("vision",), packed=False, batch_size=4)[0]
    rank = dist.get_rank()
    votes = train_step(model, optimizer, batch, votes=(float(rank == 1), 0.0)).votes
    before = _weights(model, optimizer)
    try:
        train_step(model, optimizer, batch, unusable=rank == 1)
        message = "no error"
    except UnusableBatch as e:
        message = str(e)
    assert _unchanged(model, before, optimizer)
    return votes, message


def test_votes_and_an_unusable_batch_reach_every_rank() -> None:
    (votes0, here0), (votes1, here1) = run_on_ranks(_votes_and_unusable, 2, timeout=120)
    assert votes0 == votes1 == (1.0, 0.0)
    tail = "could not build their part of this step's batch"
    assert f"1 rank(s) {tail} (this rank: not it); the step was not applied" == here0
    assert f"1 rank(s) {tail} (this rank: it); the step was not applied" == here1


# ---------------------------------------------------------------------------- StopSignals

SIGNALLED = """
import os, signal, time
from dtensor_mimo.train import preemption
preemption.REPEAT_S = 0.5
s = preemption.StopSignals().install()
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), signal.SIGINT)   # at once: the same request, delivered twice
print("requested", s.requested.name, flush=True)
time.sleep(0.6)
os.kill(os.getpid(), signal.SIGTERM)  # a second one: out at once
time.sleep(5)
print("still here", flush=True)
"""


def test_a_second_signal_exits_at_once() -> None:
    out = subprocess.run([sys.executable, "-c", SIGNALLED], capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == 143, out.stderr
    assert out.stdout == "requested SIGTERM\n"
    assert "SIGTERM again: exiting now, without a checkpoint" in out.stderr


USR1 = """
import os, signal
from dtensor_mimo.train import preemption
s = preemption.StopSignals().install()
os.kill(os.getpid(), signal.SIGUSR1)
print("requested", s.requested.name, preemption.exit_status(s.requested), flush=True)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")
def test_sigusr1_is_a_stop_request() -> None:
    """Slurm's warning before the time limit (``--signal=USR1@60``) is recorded as a stop, not the
    default action of SIGUSR1 (the process ended at once, exit -10)."""
    out = subprocess.run([sys.executable, "-c", USR1], capture_output=True, text=True, timeout=120, env=ENV)
    assert (out.returncode, out.stdout) == (0, "requested SIGUSR1 138\n"), out.stderr


# ---------------------------------------------------------------------------- whole runs


def _train(argv: list[str]) -> float:
    from dtensor_mimo.train.trainer import Trainer

    return Trainer(parse_args(argv)).run()


def _records(path) -> list[tuple[int, float]]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:  # a line being written
                continue
            if "loss" in record:
                out.append((record["step"], record["loss"]))
    return out


def _stop_when_logged(cmd: list[str], cwd, jsonl, after_step: int, timeout: float = 240,
                      sig: signal.Signals = signal.SIGTERM) -> subprocess.CompletedProcess:
    """Start `cmd`, send it `sig` once `jsonl` logs a step past `after_step`, wait for it to end."""
    p = subprocess.Popen(cmd, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    try:
        while not any(s > after_step for s, _ in _records(jsonl)):
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "no step logged"
            time.sleep(0.05)
        p.send_signal(sig)
        stdout, stderr = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
    return subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr)


def _stopped_line(out: subprocess.CompletedProcess, ckpt: str, sig: signal.Signals = signal.SIGTERM) -> int:
    found = re.findall(rf"stopped by {sig.name} at step (\d+): checkpoint written to (\S+); rerun the same command "
                       rf"to resume \(exit status {128 + sig}\)", out.stdout)
    assert len(found) == 1, (out.stdout[-3000:], out.stderr[-3000:])
    step, path = int(found[0][0]), found[0][1]
    assert path == os.path.join(ckpt, f"step-{step:06d}") and 0 < step < STEPS
    return step


def test_a_stop_under_both_launchers_loses_nothing(tmp_path) -> None:
    """SIGUSR1 to the own launcher, then SIGTERM to torchrun resuming its checkpoint, then the rest:
    nothing lost. (The own launcher's leg was `test_sigusr1_stops_with_a_checkpoint`, a run of
    its own before: one launch less, the same assertions.)"""
    pytest.importorskip("sklearn")
    usr1 = getattr(signal, "SIGUSR1", signal.SIGTERM)  # no SIGUSR1 on this platform: SIGTERM, as before
    run_on_ranks(_train, 2, [*TINY, "--metrics.jsonl", str(tmp_path / "ref.jsonl")], timeout=300)
    reference = dict(_records(tmp_path / "ref.jsonl"))
    assert sorted(reference) == list(range(1, STEPS + 1))
    ckpt = "ckpt"
    args = [*TINY, "--checkpoint.dir", ckpt]

    # The own launcher: the launcher gets SIGUSR1 and forwards it to its ranks (Slurm's warning
    # before the time limit, ``sbatch --signal=USR1@60``, Lightning's requeue signal: its default
    # action ended a process at once, the ranks died with no checkpoint, the minute of warning
    # lost). It stops the run as SIGTERM does: after the step in flight, with its checkpoint, exit
    # status 128 + 10. (SIGTERM to the own launcher: `test_sigterm_while_the_ranks_still_import_...`
    # with a checkpoint, `test_sigterm_without_a_checkpoint_dir_...` after a logged step.)
    own = _stop_when_logged([sys.executable, "-m", "dtensor_mimo.train", *args, "--metrics.jsonl", "a.jsonl"],
                            tmp_path, tmp_path / "a.jsonl", 0, sig=usr1)
    assert own.returncode == 128 + usr1, (own.returncode, own.stderr[-3000:])
    assert f"no checkpoint in {ckpt}: starting at step 0" in own.stdout
    first = _stopped_line(own, ckpt, usr1)
    assert verify(str(tmp_path / ckpt / f"step-{first:06d}")) == []

    # torchrun: it gets SIGTERM and forwards it to its workers, which stop together. Each rank
    # loads through a loader worker process (running ahead of the step: the checkpoint's data
    # position must still be the step's), and saves every 3 steps in the background (the stop's
    # save waits for one still written, then for its own).
    tr = _stop_when_logged([TORCHRUN, "--standalone", "--nproc-per-node=2", "-m", "dtensor_mimo.train", *args,
                            "--data.workers", "1", "--checkpoint.async_mode", "async", "--checkpoint.every", "3",
                            "--metrics.jsonl", "b.jsonl"], tmp_path, tmp_path / "b.jsonl", first + 3)
    assert f"resumed from {os.path.join(ckpt, f'step-{first:06d}')} at step {first}" in tr.stdout
    second = _stopped_line(tr, ckpt)
    assert second > first and verify(str(tmp_path / ckpt / f"step-{second:06d}")) == []
    assert tr.returncode != 0  # torchrun's own status after a signal (the workers': 143, as above)

    # Resumed to the end: every step's loss is the uninterrupted run's.
    run_on_ranks(_train, 2, [*TINY, "--checkpoint.dir", str(tmp_path / ckpt), "--metrics.jsonl",
                             str(tmp_path / "c.jsonl")], timeout=300)
    got = [*_records(tmp_path / "a.jsonl"), *_records(tmp_path / "b.jsonl"), *_records(tmp_path / "c.jsonl")]
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    assert [loss for _, loss in got] == [reference[s] for s, _ in got]


def _spawned_ranks(launcher: int) -> list[int]:
    """The own launcher's rank processes (its spawned children), by /proc."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline") as f:
                spawned = "spawn_main" in f.read()
        except (OSError, IndexError, ValueError):
            continue
        if parent == launcher and spawned:
            found.append(int(pid))
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the ranks through /proc")
def test_sigterm_while_the_ranks_still_import_stops_after_step_one(tmp_path) -> None:
    """A rank installs its handlers only once it has imported torch and the library (seconds after
    the launcher starts it): a SIGTERM forwarded before then waits for them (the launcher starts
    its ranks with the stop signals blocked) and stops the run after step 1, with its checkpoint
    and exit status 143, instead of killing the ranks (exit 1, "rank 0 was killed by SIGTERM")."""
    pytest.importorskip("sklearn")
    cmd = [sys.executable, "-m", "dtensor_mimo.train", *TINY, "--checkpoint.dir", "ckpt"]
    p = subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _spawned_ranks(p.pid):
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "no rank started"
            time.sleep(0.01)
        time.sleep(0.1)  # forwarded by the launcher (its handler is in place), long before a rank imports torch
        p.send_signal(signal.SIGTERM)
        stdout, stderr = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, stderr[-3000:]
    out = subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr)
    assert _stopped_line(out, "ckpt") == 1
    assert verify(str(tmp_path / "ckpt" / "step-000001")) == []


def test_sigterm_without_a_checkpoint_dir_says_nothing_was_saved(tmp_path) -> None:
    pytest.importorskip("sklearn")
    out = _stop_when_logged([sys.executable, "-m", "dtensor_mimo.train", *TINY, "--metrics.jsonl", "m.jsonl"],
                            tmp_path, tmp_path / "m.jsonl", 0)
    assert out.returncode == 143, out.stderr[-3000:]
    assert re.search(r"stopped by SIGTERM at step \d+: nothing saved \(no checkpoint.dir is set\) "
                     r"\(exit status 143\)", out.stdout), out.stdout[-2000:]


# ---------------------------------------------------------------------------- a signal in the middle of a step


def _signalled_mid_step(argv: list[str], during: int) -> tuple[int, str | None, str | None]:
    """Train with a `StopSignals` whose SIGTERM reaches rank 1 inside step `during`'s forward (its
    handler's effect, as Python runs it between two bytecodes of the step); (step, signal, checkpoint)."""
    from dtensor_mimo.train.preemption import StopSignals
    from dtensor_mimo.train.trainer import Trainer

    signals = StopSignals()  # not installed: the pool's process keeps its handlers
    trainer = Trainer(parse_args(argv), signals)
    run = trainer.model.run

    def forward(*args, **kwargs):
        if trainer.step + 1 == during and dist.get_rank() == 1:
            signals._handle(signal.SIGTERM, None)
        return run(*args, **kwargs)

    trainer.model.run = forward
    assert trainer.run() is None
    return trainer.step, trainer.stopped and trainer.stopped.name, trainer.saved


def test_a_signal_during_a_step_stops_after_that_step(tmp_path) -> None:
    """SIGTERM arriving while step 2 runs (its forward: where a step spends its time, or the first
    step's compile) stops every rank after step 2, "the step in flight", with step 2's checkpoint:
    not after step 3 (the votes read when the step began; under torchrun's 30 s grace a whole extra
    step can cost the checkpoint)."""
    pytest.importorskip("sklearn")
    argv = [*TINY, "--train.steps", "6", "--checkpoint.dir", str(tmp_path / "ckpt")]
    got = run_on_ranks(_signalled_mid_step, 2, argv, 2, timeout=300)
    assert got == [(2, "SIGTERM", str(tmp_path / "ckpt" / "step-000002"))] * 2


def _heldout_steps(path) -> dict[int, float]:
    with open(path) as f:
        return {r["step"]: r["heldout_loss"] for r in map(json.loads, f) if "heldout_loss" in r}


def test_a_stop_at_an_evaluation_step_is_evaluated_by_the_resumed_run(tmp_path) -> None:
    """A stop at a step whose held-out evaluation is due (train.eval_every) skips it, so that the
    checkpoint is written within the grace; the resumed run started after that step, and so that
    step's evaluation was never made by either run (its record missing from metrics.jsonl). The
    resumed run evaluates it first: the records are the uninterrupted run's, each step once."""
    pytest.importorskip("sklearn")
    argv = [*TINY, "--train.steps", "4", "--train.eval_every", "2", "--checkpoint.dir", str(tmp_path / "ckpt")]
    reference = str(tmp_path / "ref.jsonl")
    run_on_ranks(_train, 2, [*argv, "--checkpoint.dir", str(tmp_path / "ref"), "--metrics.jsonl", reference],
                 timeout=300)
    expected = _heldout_steps(reference)
    assert sorted(expected) == [2, 4]
    jsonl = str(tmp_path / "m.jsonl")
    stopped = run_on_ranks(_signalled_mid_step, 2, [*argv, "--metrics.jsonl", jsonl], 2, timeout=300)
    assert stopped == [(2, "SIGTERM", str(tmp_path / "ckpt" / "step-000002"))] * 2
    run_on_ranks(_train, 2, [*argv, "--metrics.jsonl", jsonl], timeout=300)
    with open(jsonl) as f:
        records = [r for r in map(json.loads, f) if "heldout_loss" in r]
    assert [r["step"] for r in records] == [2, 4]
    assert {r["step"]: r["heldout_loss"] for r in records} == pytest.approx(expected, rel=1e-6)
