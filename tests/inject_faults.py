"""Run the trainer with a fault injected: ``python -m tests.inject_faults [trainer args]`` (or as
torchrun's module) with ``DTENSOR_MIMO_FAULT=WHAT:STEP:RANK`` makes rank RANK fail in step STEP
(1-based) of a run's first round (never after a torchrun restart, so the restarted world can
resume); several, comma-separated, for different ranks. WHAT: ``kill`` (SIGKILL at the step's
start, after step STEP-1 and its checkpoint), ``data`` (the batch's loading raises), ``encoder``
/ ``language`` (the forward of any of this rank's encoder or language modules raises; the rank
must hold one), ``busy`` (the rank works on its own for `BUSY_S` seconds at the step's start,
in no collective: as one compiling, or tokenizing a corpus, does).

A test fixture, not a branch of the library's step: importing this module wraps `Trainer`'s
construction and its step. The trainer's own launcher spawns its ranks, which import the main
module again (as ``__mp_main__``), so they get the same wrapping.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import torch

from dtensor_mimo.train import trainer as _trainer

FAULT_ENV = "DTENSOR_MIMO_FAULT"
FAULTS = ("kill", "data", "encoder", "language", "busy")
BUSY_S = 120
GRACE_ENV = "DTENSOR_MIMO_TEST_KILL_GRACE_S"  # torch's 30 s between SIGTERM and SIGKILL, shortened for a test


class InjectedFault(RuntimeError):
    """The failure `FAULT_ENV` asked for."""


def _fire(message: str) -> None:
    """Say when the fault fires (what `benchmarks/faults.py` measures detection from)."""
    print(f"{message} (at {time.time():.3f})", file=sys.stderr, flush=True)


def fault(rank: int) -> tuple[str, int] | None:
    """(what, step) of `FAULT_ENV` on this rank, None when it names another rank or a restart runs."""
    specs = os.environ.get(FAULT_ENV)
    if not specs or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    for spec in specs.split(","):
        parts = spec.split(":")
        if len(parts) != 3 or parts[0] not in FAULTS or not parts[1].isdigit() or not parts[2].isdigit():
            raise ValueError(f"{FAULT_ENV}={specs!r}: expected WHAT:STEP:RANK with WHAT one of {FAULTS}, e.g. "
                             "kill:5:1 (several: comma-separated)")
        if int(parts[2]) == rank:
            return parts[0], int(parts[1])
    return None


def _arm(trainer: Any, what: str, step: int) -> None:
    """A raise in the forward of this rank's `what` modules, in step `step`."""
    model = trainer.model
    parts = list(model.encoders.values()) if what == "encoder" else list(model.language_stages)
    if not parts:
        raise ValueError(f"{FAULT_ENV}: rank {trainer.rank} holds no {what} module to fail in")

    def hook(module: torch.nn.Module, _args: Any) -> None:
        if trainer.step + 1 == step:
            message = f"{FAULT_ENV}: {what} forward of {type(module).__name__} on rank {trainer.rank}"
            _fire(message)
            raise InjectedFault(message)

    for part in parts:
        for module in part.modules():
            module.register_forward_pre_hook(hook)


def install() -> None:
    """Wrap `Trainer.__init__` (arm the module hooks) and `Trainer._run_step` (kill or fail the
    batch's loading) with the fault `FAULT_ENV` names for each rank."""
    cls = _trainer.Trainer
    if getattr(cls, "_faults_installed", False):
        return
    init, run_step = cls.__init__, cls._run_step

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._fault = fault(self.rank)
        if self._fault and self._fault[0] in ("encoder", "language"):
            _arm(self, self._fault[0], self._fault[1])

    def _run_step(self, *args: Any, **kwargs: Any):
        f = self._fault
        if f and f[1] == self.step + 1 and f[0] in ("kill", "data", "busy"):
            if f[0] == "busy":
                _fire(f"{FAULT_ENV}: rank {self.rank} busy for {BUSY_S} s")
                time.sleep(BUSY_S)
                return run_step(self, *args, **kwargs)
            if f[0] == "kill":
                _fire(f"{FAULT_ENV}: killing rank {self.rank}")
                os.kill(os.getpid(), signal.SIGKILL)
            message = f"{FAULT_ENV}: loading the batch on rank {self.rank}"
            _fire(message)
            raise InjectedFault(message)
        return run_step(self, *args, **kwargs)

    cls.__init__, cls._run_step, cls._faults_installed = __init__, _run_step, True


def shorten_kill_grace() -> None:
    """With `GRACE_ENV` set, the own launcher's wait between the SIGTERM that ends the ranks still
    running after a failure and their SIGKILL (torch's `ProcessContext.join`: 30 s) lasts at most
    that many seconds: a test of a rank that ignores the SIGTERM (``busy``) need not wait out 30 s
    for the same SIGTERM, then SIGKILL."""
    from torch.multiprocessing.spawn import ProcessContext

    grace = os.environ.get(GRACE_ENV)
    join_procs = getattr(ProcessContext, "_join_procs_with_timeout", None)  # (torch's private wait)
    if not grace or join_procs is None:
        return
    ProcessContext._join_procs_with_timeout = lambda self, timeout: join_procs(self, min(timeout, float(grace)))


install()
shorten_kill_grace()

if __name__ == "__main__":
    from dtensor_mimo.train.launch import command

    command()
