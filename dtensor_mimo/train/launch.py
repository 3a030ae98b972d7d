"""What ``python -m dtensor_mimo.train [--config FILE.toml] [--section.key VALUE ...]`` runs.

Without a launcher it starts the layout's world of local ranks itself (gloo on CPU; one process
per rank); under ``torchrun`` it joins the given world (NCCL with ``--train.device cuda``) and
checks that the layout fits it. The config is parsed and checked before any process starts.

SIGTERM / SIGINT / SIGUSR1: every rank handles them (`dtensor_mimo.train.preemption`): the run stops
after the step in flight with a checkpoint and every rank exits with 128 + the signal's number (143,
130, 138), as does the own launcher, which forwards the signals it gets to its ranks (torchrun
forwards them itself; SIGUSR1 only with ``--signals-to-handle`` naming it). A second signal ends the
ranks at once.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Callable, Collection, NoReturn, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtensor_mimo.train.config import (LANGUAGE, ConfigError, TrainerConfig, build_layout, check_config, check_stages,
                                       help_text, parse_args)
from dtensor_mimo.train.preemption import REPEAT_S, STOP_SIGNALS, StopSignals, exit_status, held_stop_signals
from dtensor_mimo.layout.world import abort, hold_store, init_distributed, local_rank_env

if TYPE_CHECKING:
    from dtensor_mimo.train.modules import ResolvedModel


def preflight(config: TrainerConfig) -> None:
    """What can be checked from files before any process starts: Hugging Face directories and
    their architectures (and their blocks against the layout's pipeline stages), the tokenizer
    and its chat template, processors, the data files (they exist; the first `CHECKED_SAMPLES`
    samples' JSON shape, placeholders against items, media files, token lengths: a bounded
    sample, never a pass over the whole corpus; of the held-out data at most the
    `data.heldout_samples` scored), the batch against the data, `checkpoint.load`, that
    `checkpoint.export_hf` can write the model, and
    that the run's outputs (`checkpoint.dir`, `checkpoint.export_hf`, `metrics.jsonl`,
    `metrics.tensorboard`) can be written where they are named (`_check_writable`).
    Prints one line saying what of the data it did not check. Raises ConfigError."""
    from dtensor_mimo.train import checkpoint
    from dtensor_mimo.train.datasets import CHECKED_SAMPLES, train_data
    from dtensor_mimo.train.modules import build_modules, refuse_nothing_trains, resolve

    c, m = config.checkpoint, config.metrics
    for option, path, directory in (("checkpoint.dir", c.dir, True), ("checkpoint.export_hf", c.export_hf, True),
                                    ("metrics.jsonl", m.jsonl, False), ("metrics.tensorboard", m.tensorboard, True)):
        if path:
            _check_writable(option, path, directory)
    resolved = resolve(config)
    if not config.layout.auto:  # (the planner's layout keeps every stage's blocks)
        check_stages(config, build_layout(config), _hf_blocks(config, resolved))
    _check_export(config, resolved)
    data = train_data(config, resolved, ahead=True)
    for dataset in (data.train, data.heldout):  # the checked samples' lengths against seq_len, now
        check = getattr(dataset, "check_lengths", None)
        if check is not None:
            # a media header that cannot be read: a batch leaves its sample out (held-out data, or skipping)
            skip = dataset is data.heldout or config.data.skip_bad_media
            try:
                check(CHECKED_SAMPLES, skip_media=skip)
            except ValueError as e:
                if dataset is data.train or config.data.seq_len:
                    raise ConfigError(str(e)) from None
                raise ConfigError(f"data.heldout: {e} (data.seq_len = 0 took the longest training sample's "
                                  f"length, {data.train.seq_len}; give data.seq_len room for the held-out samples "
                                  "too)") from None
    if data.checked:
        print(f"data: {data.checked}", flush=True)
    if data.known_rows < config.data.batch_size:
        raise ConfigError(f"data.batch_size = {config.data.batch_size} is more than the {data.known_rows} training "
                          f"rows of {config.data.path} (samples, or packed rows with data.pack)")
    _check_export(config, resolved, with_processors=True)
    if config.model.language.frozen and all(e.frozen and e.factory for e in config.model.encoders.values()):
        # (a factory's module is frozen whole unless it is a ModalityEncoder: known once built)
        refuse_nothing_trains(config, build_modules(config, resolved, data.seq_len, meta=True))
    if config.checkpoint.load and not (config.checkpoint.dir and checkpoint.latest_checkpoint(config.checkpoint.dir)):
        try:
            checkpoint.resolve_load(config.checkpoint.load, checksums=False)  # sizes: the ranks checksum
        except checkpoint.CheckpointError as e:
            raise ConfigError(f"checkpoint.load: {e}") from None


def _hf_blocks(config: TrainerConfig, resolved: ResolvedModel) -> dict[str, tuple[int, str, None]]:
    """The blocks of each module built from a Hugging Face directory, as `check_stages` takes them
    (the library's modules are checked by `check_config`; a factory's are known once built)."""
    out: dict[str, tuple[int, str, None]] = {}
    if config.model.language.hf and resolved.language is not None:
        n = resolved.language.n_layers
        out[LANGUAGE] = (n, f"model.{LANGUAGE}.hf = {config.model.language.hf!r} ({n} layers)", None)
    for name, e in resolved.encoders.items():
        if e.section.hf and e.config is not None:
            n = e.config.n_layers
            out[name] = (n, f"model.encoders.{name}.hf = {e.section.hf!r} ({n} blocks to its features)", None)
    return out


def _check_writable(option: str, path: str, directory: bool) -> None:
    """Refuse (ConfigError) an output path the run could not write: rank 0 first writes there
    alone, after the world has formed, and `checkpoint.dir` only at the first save (with
    `checkpoint.every = 0`, after the last step: the whole run lost to a mistyped path). A
    `directory` (or, for a file, its parent) that does not exist yet must be creatable: its
    nearest existing parent a writable directory."""
    full = os.path.abspath(path)
    kind = "a directory" if directory else "a file"
    if os.path.exists(full):
        if os.path.isdir(full) != directory:
            raise ConfigError(f"{option} = {path!r} is {'a file' if directory else 'a directory'}; name {kind}")
        if not os.access(full, os.W_OK):
            raise ConfigError(f"{option} = {path!r} is not writable; name {kind} this user can write")
        return
    parent = os.path.dirname(full)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        why = "is a file" if not os.path.isdir(parent) else "is not writable"
        raise ConfigError(f"{option} = {path!r} cannot be created: {parent!r} {why}; name {kind} under a "
                          "writable directory")


def _check_export(config: TrainerConfig, resolved: ResolvedModel, with_processors: bool = False) -> None:
    """Refuse a `checkpoint.export_hf` whose model no Hugging Face directory can hold now, not
    after the run's last step (a factory's module is judged once built, by every rank before its
    first step: `dtensor_mimo.train.export.kind_problem`)."""
    towers = {n: e.config for n, e in resolved.encoders.items()}
    if not config.checkpoint.export_hf or resolved.language is None or None in towers.values():
        return
    from dtensor_mimo.train.export import config_problem

    modalities = {n: e.section.modality for n, e in resolved.encoders.items()}
    # the processors once the data checks passed: an input size training itself cannot take is
    # named by those, as what the steps would meet
    processors = ({n: e.processor for n, e in resolved.encoders.items() if e.processor is not None}
                  if with_processors else None)
    problem = config_problem(resolved.language, towers, modalities, processors)
    if problem:
        raise ConfigError(f"checkpoint.export_hf = {config.checkpoint.export_hf!r}: the trained model cannot be "
                          f"written as Hugging Face directories: {problem}; remove checkpoint.export_hf (and save "
                          "with checkpoint.dir) or change that module")


def _quiet_known_logs() -> None:
    """torchao, when installed, is imported by transformers' quantizers: it logs the optional
    kernels that do not load on this platform, and torch logs a deprecation in torchao's enum
    registration, on every rank of every run. Neither concerns a trainer's user (an fp8 module
    checks what it needs: `dtensor_mimo.parallelize.fp8.check_fp8`); errors still show."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _run_rank(config: TrainerConfig, on_error: Callable[[BaseException], None] | None = None) -> int:
    """Train on this rank of the world (joined here unless already initialised); returns the exit
    status: 0, or `exit_status` of the signal that stopped the run (the same on every rank). On
    an error, `on_error` hears it first (while the peers still wait), then this rank's groups are
    aborted so the peers fail at once instead of waiting for `train.timeout_s`; the error
    propagates."""
    from dtensor_mimo.train.trainer import Trainer

    _quiet_known_logs()
    signals = StopSignals()
    try:
        if not dist.is_initialized():
            # Until the world has formed a stop signal keeps its own action (nothing is trained
            # yet): a launcher ending this rank while it waits for a peer that failed first (under
            # torchrun, rank 0's preflight) ends it at once, not by SIGKILL 30 s after a SIGTERM
            # taken for a stop. The own launcher's ranks hold the signals blocked until `install`.
            init_distributed(config.train.device, config.train.timeout_s)
        signals.install()  # from here a signal while building is a stop after step 1
        if config.layout.auto:  # torchrun: rank 0 plans for this world, every rank trains its choice
            from dtensor_mimo.train.plan import auto_layout_collective

            config = auto_layout_collective(config)
        trainer = Trainer(config, signals)
        trainer.run()
        # Every rank done with every group before any tears its connections down (a peer still
        # in its last collective could otherwise see the connection close under it).
        dist.barrier()
    except BaseException as e:
        if on_error is not None:
            on_error(e)
        abort()
        raise
    dist.destroy_process_group()
    return exit_status(trainer.stopped) if trainer.stopped is not None else 0


USER_ERRORS = ("ConfigError", "DataError", "BatchError", "CheckpointError", "PlanError", "LayoutError")
"""Errors whose message says what to fix: shown without a traceback."""


def _local_rank(rank: int, world: int, port: int, config: TrainerConfig, errors) -> None:
    local_rank_env(rank, world, port)

    def report(e: BaseException) -> None:
        # Bounded (the launcher reads the reports as they come: `_Reports`). Stamped before this
        # rank's groups close, so the rank that failed first is known even when a peer reports sooner.
        errors.put((time.time(), rank, describe(e)[:4000], type(e).__name__, traceback.format_exc()[-16000:]))

    try:
        status = _run_rank(config, report)
    except BaseException:  # noqa: BLE001 — reported to the launcher, which prints it once
        _exit_now(1)
    _exit_now(status)  # a finished run too: its logs are closed, its loader workers joined


TEARDOWN_ENV = "DTENSOR_MIMO_TEARDOWN"
"""Set to 1 for a rank that ends through the interpreter's normal exit, running exit handlers:
for tools that write their results there (coverage, Nsight Systems, cProfile)."""


def _exit_now(code: int) -> NoReturn:
    """End a rank's process at once: the interpreter's teardown of torch, transformers and a
    model takes seconds of native code (1.4-2.9 s measured on 2 cores for the tiny LLaVA run),
    and a launcher sees the end, or a failure, only when the process ends. Nothing is lost:
    checkpoints are written synchronously, or (``checkpoint.async_mode``) waited for by
    `Trainer.run` (on an error for at most ``train.timeout_s``, a failed write said on stderr),
    which also closes its logger and joins its loader workers on every path, and the output
    streams are flushed here. `TEARDOWN_ENV` = 1 exits normally instead.

    The process's named semaphores are unlinked first, as a normal exit would (their
    multiprocessing finalizers): else, under a spawn or forkserver start, the launcher's resource
    tracker warns at the end of every compiled run of "leaked semaphore objects" (tqdm's lock,
    which inductor's compile progress creates in each rank). Only those: the other finalizers
    include the shutdown of inductor's compile workers, about a second of waiting."""
    _unlink_semaphores()
    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get(TEARDOWN_ENV) == "1":
        sys.exit(code)
    os._exit(code)


def _unlink_semaphores() -> None:
    """Run this process's pending `multiprocessing` semaphore finalizers (``SemLock._cleanup``:
    unlink, and unregister from the resource tracker), none of its others."""
    from multiprocessing import synchronize, util

    for finalizer in list(util._finalizer_registry.values()):
        if getattr(finalizer, "_callback", None) is synchronize.SemLock._cleanup:
            finalizer()


def describe(e: BaseException) -> str:
    """``Type: message (notes)``. An error re-raised with a message that starts blank
    (torch.distributed.pipelining wraps a stage's error as "RuntimeError: \\n failed to run
    forward: args ...") is described by the error it was raised from."""
    notes = "".join(f" ({note})" for note in getattr(e, "__notes__", ()))
    cause = e
    while cause.__cause__ is not None and not str(cause).split("\n", 1)[0].strip():
        cause = cause.__cause__
    if cause is e:
        return f"{type(e).__name__}: {e}{notes}"
    return f"{type(e).__name__} from {type(cause).__name__}: {str(cause).strip()}{notes}"


def _report(errors, failure: Exception, killed: Sequence[tuple[int, str]] = ()) -> None:
    """The rank that failed first, with its traceback, then what the others saw after it.

    The first is a rank that died without a word (killed: out of memory, a signal) when the
    launcher saw one, else the earliest reported error; the peers' later errors (typically
    "Connection closed by peer") are listed once per distinct message, ranks named."""
    reports = []
    while not errors.empty():
        reports.append(errors.get())
    reports.sort()  # by the time each rank failed
    reported = {r[1] for r in reports}
    index, name = getattr(failure, "error_index", None), getattr(failure, "signal_name", None)
    silent = [(r, n) for r, n in killed if r not in reported] or \
        ([(index, name)] if name and index not in reported else [])
    by_message: dict[str, list] = {}  # in the order of each message's first report
    for report in reports:
        by_message.setdefault(report[2], []).append(report)
    groups = list(by_message.values())
    if silent:
        for rank, name in silent:
            print(f"error: rank {rank} was killed by {name} (no Python error: out of memory? a signal "
                  f"from outside?)", file=sys.stderr)
    elif groups:
        first = groups.pop(0)
        if first[0][3] not in USER_ERRORS:
            print(first[0][4].rstrip(), file=sys.stderr)
        print(f"error on {_ranks(first)}: {first[0][2]}", file=sys.stderr)
    else:
        print(f"error: {failure}", file=sys.stderr)
    start = reports[0][0] if reports else 0.0
    for same in groups:
        print(f"then, on {_ranks(same)} (+{same[0][0] - start:.2f} s): {same[0][2]}", file=sys.stderr)


def _ranks(reports: list) -> str:
    ranks = sorted(r[1] for r in reports)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def refuse_auto(config: TrainerConfig, launched: bool) -> None:
    """``--layout.auto`` measures on this machine's CPU (gloo) and, under torchrun, on rank 0's host
    while every peer waits: refused (ConfigError) for a GPU run or a world spanning several nodes,
    where those measurements would not describe the run."""
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    where = ("train.device = 'cuda'" if config.train.device == "cuda" else
             f"a world of {world} ranks over several nodes ({local} here)" if launched and local != world else None)
    if where is not None:
        raise ConfigError(f"layout.auto = true with {where}: the planner measures this host's CPU; run "
                          "`python -m dtensor_mimo.plan --config FILE --world N --json plan.json` and pass the "
                          "chosen entry as --layout.<module>.* and --pipeline.microbatches overrides")


def refuse_srun_tasks() -> None:
    """A process started without torchrun's environment (RANK, WORLD_SIZE) as one of several tasks
    of a Slurm step (``srun -n 8 python -m dtensor_mimo.train``): each would start a whole world of
    its own on its host, all training the same job into one checkpoint directory. Refused
    (ConfigError) on every task alike, before any process starts."""
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS") or 1)
    if tasks > 1 or int(os.environ.get("SLURM_PROCID") or 0) > 0:
        raise ConfigError(f"started as Slurm task {os.environ.get('SLURM_PROCID', '?')} of {tasks} without torchrun's "
                          "environment (RANK, WORLD_SIZE): each task would start a whole world of its own; run one "
                          "task per node that starts torchrun (srun --ntasks-per-node=1 torchrun "
                          "--nnodes=$SLURM_NNODES --nproc-per-node=GPUS --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT "
                          "-m dtensor_mimo.train ...), or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and "
                          "MASTER_PORT for each task (one process alone in a step of several tasks: unset "
                          "SLURM_STEP_NUM_TASKS and SLURM_PROCID for it)")


def command() -> NoReturn:
    """``python -m dtensor_mimo.train``: `main` on the command line's arguments, its status the
    process's. A torchrun worker then ends at once (`_exit_now`), as the own launcher's ranks do;
    the own launcher itself exits normally (its queue's semaphores are unregistered then)."""
    status = main()
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        _exit_now(status)
    sys.exit(status)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    _quiet_known_logs()
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    launched = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    try:
        if not launched:
            refuse_srun_tasks()
        config = parse_args(argv)
        if config.layout.auto:
            refuse_auto(config, launched)
        if config.layout.auto and not launched:  # the planner's first choice for the layout's world
            from dtensor_mimo.train.plan import auto_layout

            config = auto_layout(config, build_layout(config).world_size)
        if launched:
            check_config(config, int(os.environ["WORLD_SIZE"]))
        if not launched or os.environ.get("RANK") == "0":
            # Under torchrun rank 0 checks: on an error it exits with 2 before joining the group,
            # and torchrun ends the other workers waiting in the rendezvous.
            preflight(config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if launched:
        try:
            status = _run_rank(config)
        except BaseException as e:  # noqa: BLE001 — printed here, then out at once (see _local_rank)
            traceback.print_exc()
            print(f"error on rank {os.environ['RANK']}: {describe(e)}", file=sys.stderr)
            _exit_now(1)
        return status
    world = build_layout(config).world_size
    if config.train.device == "cuda" and world > torch.cuda.device_count():
        print(f"config error: the layout needs {world} ranks but this machine has "
              f"{torch.cuda.device_count()} GPUs; use torchrun across machines or train.device = 'cpu'",
              file=sys.stderr)
        return 2
    errors = mp.get_context("spawn").SimpleQueue()
    reports = _Reports(errors)
    store = hold_store(world, config.train.timeout_s)  # held until the ranks end
    # A signal from here on is forwarded; one that reaches a rank before its handlers exist (while it
    # imports) waits for them there: the ranks start with the stop signals blocked.
    with held_stop_signals():
        ranks = mp.start_processes(_local_rank, args=(world, store.port, config, errors), nprocs=world,
                                   start_method="spawn", join=False)
        forward = _Forward(ranks.processes, reports)
    try:
        return _join(ranks)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        if forward.killed is not None and not forward.failed:  # the second signal: the ranks were ended at once
            return exit_status(forward.killed)
        # (a rank had failed before a second signal: a failure, not a stop a scheduler would requeue)
        ended = [*getattr(e, "ended_by_launcher", ()), *forward.ended]
        _report(reports.finish(), e, _killed(ranks.processes, ended))
        return 1
    finally:
        forward.uninstall()


class _Reports:
    """The ranks' error reports (`_local_rank`), read from their queue by a thread as they come.
    A pipe holds 64 KiB: read only once every rank had ended, the reports of a few ranks (up to
    20,000 characters each) filled it, the next ranks blocked in their put until the launcher
    SIGKILLed them 30 s later, their reports lost, and one killed in the middle of its write left
    the launcher waiting for the rest of it for ever. `finish`, once every rank has ended: what
    was read (`empty` / `get`, as the queue's)."""

    def __init__(self, queue) -> None:
        self.queue, self.items, self.read, self.done = queue, [], [], threading.Event()
        self.thread = threading.Thread(target=self._read, name="rank reports", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while not self.done.is_set() or not self.queue.empty():
            if self.queue.empty():
                time.sleep(0.05)
                continue
            try:
                self.items.append(self.queue.get())
            except Exception:  # noqa: BLE001 — a report cut short (its rank killed as it wrote): the rest
                return

    def finish(self, timeout: float = 5.0) -> _Reports:
        """Every complete report (a report cut short, its rank killed as it wrote, is waited for
        at most `timeout` seconds)."""
        self.done.set()
        self.thread.join(timeout)
        self.read = list(self.items)  # the thread may still wait for the rest of a report cut short
        return self

    def empty(self) -> bool:
        return not self.read

    def get(self):
        return self.read.pop(0)


class _Forward:
    """The launcher's SIGTERM / SIGINT / SIGUSR1 handlers: each signal is sent on to every live rank (a
    rank takes one arriving twice within `REPEAT_S`, from a terminal's Ctrl-C and from here, as
    one); a second one, `REPEAT_S` or more after the first, SIGKILLs the ranks: out at once even
    if one is stuck in a collective (where its own handler cannot run). `failed`: a rank had
    failed (an error reported, or an end neither 0 nor a stop's) before that second signal;
    `ended`: the ranks it SIGKILLed."""

    def __init__(self, processes, reports: _Reports) -> None:
        self.processes, self.reports, self.first_at, self.killed = processes, reports, None, None
        self.failed, self.ended = False, []
        self.previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}

    def _handle(self, signum: int, _frame) -> None:
        now = time.monotonic()
        second = self.first_at is not None and now - self.first_at >= REPEAT_S
        self.first_at = now if self.first_at is None else self.first_at
        if second and self.killed is None:
            stops = {0, *(exit_status(s) for s in STOP_SIGNALS)}
            self.ended = [r for r, p in enumerate(self.processes) if p.exitcode is None]
            self.failed = bool(self.reports.items) or any(p.exitcode not in stops for p in self.processes
                                                          if p.exitcode is not None)
        for p in self.processes:
            if p.is_alive():
                try:
                    if second:
                        p.kill()
                    else:
                        os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass
        if second:
            self.killed = signal.Signals(signum)

    def uninstall(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def _join(ranks) -> int:
    """Wait for the ranks: 0 when all end well, the stop status when they stopped for a signal
    (`_run_rank`; every rank exits with it, after rank 0 has said so: the others are waited for,
    not terminated as after a failure); a failure raises as `ProcessContext.join` does."""
    from multiprocessing.connection import wait

    stops = {exit_status(s) for s in STOP_SIGNALS}
    live = {p.sentinel: p for p in ranks.processes}
    while live:
        for sentinel in wait(list(live)):
            live.pop(sentinel).join()  # reaped: its exit code is known
        codes = [p.exitcode for p in ranks.processes if p.exitcode is not None]
        if any(c in stops for c in codes):
            for p in ranks.processes:
                p.join(timeout=120)  # they are past the checkpoint: at most a barrier away
            if all(p.exitcode in stops for p in ranks.processes):
                return ranks.processes[0].exitcode
            break
        if any(c != 0 for c in codes):
            break
    # The ranks still running now are ended by `ProcessContext.join` (SIGTERM, which a rank takes
    # as a stop request, then SIGKILL 30 s later): not a cause of the failure (`_killed`).
    ended = [r for r, p in enumerate(ranks.processes) if p.exitcode is None]
    try:
        while not ranks.join():  # a failure raises here, its peers terminated, as before
            pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        e.ended_by_launcher = ended
        raise
    return 0


def _killed(processes, ended: Collection[int] = ()) -> list[tuple[int, str]]:
    """(rank, signal) of the ranks that a signal other than the launcher's own SIGTERM ended, less
    the ranks in `ended` (still running when the launcher began ending them after a failure)."""
    out = []
    for rank, p in enumerate(processes):
        if rank not in ended and p.exitcode is not None and p.exitcode < 0 and -p.exitcode != signal.SIGTERM:
            out.append((rank, signal.Signals(-p.exitcode).name))
    return out
