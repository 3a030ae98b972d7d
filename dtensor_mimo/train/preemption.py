"""SIGTERM, SIGINT and SIGUSR1 on a rank: stop after the step in flight, with a checkpoint, not at once.

A cluster scheduler sends SIGTERM before it takes the nodes (Slurm at the time limit or on
preemption, Kubernetes on eviction), a user Ctrl-C (SIGINT); Slurm sends SIGUSR1 ahead of the
time limit when asked to (``sbatch --signal=USR1@60``, the requeue signal Lightning waits for),
and its default action would end the rank at once, without a checkpoint. `StopSignals` records
the first one;
the trainer folds "this rank was signalled" into the step's own all-reduce
(`dtensor_mimo.optim.step.train_step`'s ``votes``), so every rank learns at the same step that
some rank was asked to stop, finishes that step, writes a checkpoint and exits with
`exit_status` (128 + the signal's number, what a shell reports for a process the signal ended:
143 for SIGTERM, 130 for SIGINT, 138 for SIGUSR1), so a scheduler that requeues on it resumes the run.

A second signal ends the process at once (same status). The same signal arriving again within
`REPEAT_S` seconds is the same request: Ctrl-C reaches every process of the terminal's process
group, and a launcher (ours, torchrun) forwards what it got to its ranks too, so a rank often
hears one request twice within milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Callable, Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, *([signal.SIGUSR1] if hasattr(signal, "SIGUSR1") else []))
REPEAT_S = 2.0
"""A signal within this many seconds of the first is the first one again (see the module's doc)."""


def ignore_stop_signals(_worker_id: int = 0) -> None:
    """In a helper process of a rank (a DataLoader worker: its ``worker_init_fn``): leave the stop
    signals to the rank. A launcher's signal reaches the rank's whole process group (torchrun
    signals each worker's group), and a loader worker ended by it would end the rank's step
    with "DataLoader worker exited unexpectedly" instead of letting it finish and save."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def held_stop_signals() -> Iterator[None]:
    """`STOP_SIGNALS` blocked in this thread for the duration (delivered, if they came, when it
    ends), and in every process started meanwhile until it installs `StopSignals`: a launcher
    starts its ranks inside it, so a signal that reaches a rank while it is still importing (seconds
    before its handlers exist) waits for them and stops the run after step 1, as one a moment later
    does, instead of killing the rank with no checkpoint and no stop status."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def exit_status(sig: int) -> int:
    """The exit status of a run stopped by `sig`: 128 + its number (143 SIGTERM, 130 SIGINT, 138 SIGUSR1)."""
    return 128 + int(sig)


class StopSignals:
    """Handlers of `STOP_SIGNALS` in this process (install from the main thread).

    `requested` is the first signal received (None: none); a second one, `REPEAT_S` or more
    later, exits at once with its `exit_status`. `uninstall` restores the previous handlers.
    `install` also unblocks the signals a launcher held for its ranks (`held_stop_signals`): one
    that arrived before is delivered to the handlers then."""

    def __init__(self, on_second: Callable[[int], None] | None = None) -> None:
        self.requested: signal.Signals | None = None
        self._first_at = 0.0
        self._previous: dict[int, object] = {}
        self._on_second = on_second

    def install(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            if hasattr(signal, "pthread_sigmask"):
                signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.requested is None:
            self.requested, self._first_at = signal.Signals(signum), now
            return
        if now - self._first_at < REPEAT_S:
            return  # the same request, delivered twice (terminal + launcher)
        if self._on_second is not None:
            self._on_second(signum)
        print(f"{signal.Signals(signum).name} again: exiting now, without a checkpoint", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(exit_status(signum))

