"""The trainer loop of `python -m dtensor_mimo.train`: the config's modules on their layout.

One `Trainer` per rank, all built from the same `TrainerConfig` inside an initialized process
group. What a step does on a rank:

1. data: the sampler's next global batch of indices (the same on every rank); the rank builds the
   batch's token rows and per-sample item counts (metadata, small) and decodes only the encoder
   inputs of the items it encodes (`samples_to_load`; an encoder balanced over its dp ranks: the
   samples holding its cut of the items, from a metadata pass first, `_LoadPlan`): a
   language-only rank synthesizes no tone and reads no scan. Optionally in loader worker processes.
2. `train_step`: forward + backward through encoders, bridge and language model, the global
   norm, clip and AdamW.
3. every `metrics.log_every` steps: one MAX all-reduce of the per-phase times, a log line and a
   JSONL record on rank 0 (with each dp > 1 encoder's `encoder_imbalance`); checkpoints every
   `checkpoint.every` steps (with ``checkpoint.async_mode = "async"`` written by a thread while the
   next steps run, finished at the step whose all-reduce says every rank's writer ended); held-out evaluation every
   `train.eval_every` steps and at the end, which prints ``held-out accuracy: 0.xx``.

SIGTERM / SIGINT / SIGUSR1 (`dtensor_mimo.train.preemption`): a rank that got one says so in the step's
own all-reduce (a vote of `train_step` per stop signal), so every rank learns it in the same step, whichever
rank was signalled; they finish that step, write a checkpoint (as a periodic one: atomic, with
its manifest) and `run` returns with `stopped` set. No collective of its own: a stop waits at
most for the step in flight.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import resource
import os
import pickle
import signal
import sys
import time
from itertools import accumulate
from typing import Any, Callable, Collection, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from dtensor_mimo.data import IGNORE_INDEX, BatchError, MimoBatch, ResumableBatchSampler, microbatches, samples_to_load
from dtensor_mimo.data.balance import CutRule, encoder_cuts
from dtensor_mimo.data.conversation import DataError, MediaError
from dtensor_mimo.data.transfer import Flat, Handover
from dtensor_mimo.mimo import MimoModel, prepare_batch
from dtensor_mimo.models import ModalityEncoder
from dtensor_mimo.train import checkpoint
from dtensor_mimo.train.preemption import STOP_SIGNALS, StopSignals, exit_status, ignore_stop_signals
from dtensor_mimo.train.config import LANGUAGE, ConfigError, TrainerConfig, build_layout
from dtensor_mimo.train.datasets import BatchSource, train_data
from dtensor_mimo.train.metrics import MetricsLogger, StepProfiler, peak_tflops, transformer_flops
from dtensor_mimo.train.modules import build_modules, refuse_nothing_trains, resolve
from dtensor_mimo.optim.optimizer import MimoOptimizer
from dtensor_mimo.optim.step import UnusableBatch, train_step
from dtensor_mimo.schedule.language import untie_for_stages
from dtensor_mimo.sequence.loss import loss_weights


COMPILE_STEPS = 2
"""Steps left out of the throughput when blocks compile (the first forward and backward compile)."""

LOADER_START = "fork" if sys.platform.startswith("linux") else None
"""How `data.workers` loader processes start: forked from their rank on Linux, under either
launcher, as DataLoader does by default in a torchrun worker (elsewhere the platform's default).
A rank of the own launcher is itself spawned, and its children would otherwise be spawned too:
each worker importing torch and transformers again before the first batch (4.5 s of step 1 on 2
CPU cores, tiny LLaVA). The workers use no accelerator and no process group, but they hold copies
of their rank's sockets, so a failing rank joins them before it aborts its groups (`Trainer.run`):
a peer then sees the connection close at once, not when the orphans notice (5 s each)."""

# ---------------------------------------------------------------------------- data


class _LoadPlan:
    """Which samples of a global batch this rank loads the items of, per modality (None: all).

    An encoder split by sample needs its dp shard of every microbatch (`samples_to_load`, fixed).
    An encoder balanced over its dp ranks (`ParallelOptions.balance`) encodes a cut of the items
    that depends on their sizes, so its samples come from the batch's metadata (a first pass
    with ``load={}``, no item decoded): those holding an item of this rank's cut of each
    microbatch (`data.balance.encoder_cuts`, the rule the step applies)."""

    def __init__(self, fixed: dict[str, list[int]] | None, microbatches: int,
                 balanced: dict[str, tuple[int, int, bool | None, int | None]]) -> None:
        self.fixed, self.microbatches = fixed, microbatches
        self.balanced = balanced if fixed is not None else {}
        """``{encoder: (dp, this rank's dp index, its balance option, its width)}``."""

    def __call__(self, make: Callable[..., MimoBatch], indices: Sequence[int],
                 skip: Sequence[int] = ()) -> MimoBatch:
        """``make(indices, load=...)`` with this rank's load, less the rows (positions in the
        batch) in `skip`: their items are zeros of their shapes, as those another rank encodes
        (a row whose media header cannot be read has no shapes: the source builds it empty,
        ``make(..., left_out=skip)``; a source without media never fails so)."""
        if skip:
            make = functools.partial(make, left_out=tuple(skip))
        load = self._load(make, indices)
        if skip:
            if load is None:
                load = {n: range(len(indices)) for n in make(indices, load={}).modalities}
            load = {n: [r for r in rows if r not in skip] for n, rows in load.items()}
        return make(indices, load=load)

    def tolerant(self, make: Callable[..., MimoBatch], indices: Sequence[int],
                 skip: Sequence[int] = ()) -> tuple[MimoBatch, list[MediaError]]:
        """`__call__`, through media that fail to decode: their rows are built as those in
        `skip` (zeros: the shapes every peer expects), and each failure (`MediaError`: the
        batch row, the sample id, the file) is returned for the ranks to agree on."""
        failed: list[MediaError] = []
        skip = set(skip)
        while True:
            try:
                return self(make, indices, sorted(skip)), failed
            except MediaError as e:
                if e.row < 0 or e.row in skip:
                    raise
                failed.append(e)
                skip.add(e.row)

    def _load(self, make: Callable[..., MimoBatch], indices: Sequence[int]) -> dict[str, list[int]] | None:
        if not self.balanced:
            return self.fixed
        meta = make(indices, load={})
        load = dict(self.fixed)
        mbs = microbatches(meta, self.microbatches)
        for name, (dp, k, option, width) in self.balanced.items():
            load[name], start = [], 0
            for mb in mbs:
                if name in mb.modalities:
                    m = mb.modalities[name]
                    cuts, _ = encoder_cuts(m, dp, option, width)
                    first = list(accumulate(m.items_per_sample, initial=0))
                    load[name] += [start + s for s in range(mb.batch_size)
                                   if first[s] < cuts[k + 1] and first[s + 1] > cuts[k]]
                start += mb.batch_size
        return load


class _Batches(Dataset):
    """A dataset whose item at a list of indices is this rank's view of that global batch, with
    what the step derives from all of it derived in the worker (`prepare_batch` for `cuts`: the
    microbatch count and `RankParts.cut_rules`; pickled with it), packed into one buffer for the
    trip from a loader worker (`Flat`), one of the worker's reused segments (`Handover`). `known`:
    rows known unusable when the loader starts (a resumed run's), built left out without decoding
    their media again."""

    def __init__(self, dataset: BatchSource, plan: _LoadPlan, cuts: tuple[int, tuple[CutRule, ...]],
                 known: frozenset[int] = frozenset()) -> None:
        self.dataset, self.plan, self.cuts, self.known = dataset, plan, cuts, known
        self.handover = Handover()

    def __getitem__(self, indices: list[int]) -> Flat | _Failed:
        try:
            batch, failed = self.plan.tolerant(self.dataset.batch, indices, _rows_of(indices, self.known))
            prepare_batch(batch, *self.cuts)
        except (DataError, BatchError) as e:
            if _crosses(e):
                return _Failed(e)
            raise
        return self.handover.pack((batch, failed))

    def __len__(self) -> int:
        return len(self.dataset)


class _Failed:
    """A user error (`DataError`, `BatchError`: its message says what to fix) that a loader worker
    met building a batch, handed to its rank as it is and raised there as the rank's own path
    raises it. Raised in the worker, torch's loader would re-raise on the rank a copy made from
    "Caught DataError in DataLoader worker process 0. Original Traceback ...": its first line
    names nothing, and the launcher shows that text, traceback and all, as the message."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _crosses(e: Exception) -> bool:
    """Whether `e` pickles to an error of its type and message (one that does not is left to
    torch's loader to re-raise)."""
    try:
        copy = pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001 - whatever its reduction raises
        return False
    return type(copy) is type(e) and str(copy) == str(e)


def _unpacked(item: Flat | _Failed) -> Any:
    """A loader worker's batch on the rank, or the user error it met, raised here."""
    if isinstance(item, _Failed):
        raise item.error
    return item.unpack()


def _rows_of(indices: Sequence[int], known: Collection[int]) -> list[int]:
    """Positions in a batch of `indices` whose rows are among `known` (left out: their media fail)."""
    return [r for r, i in enumerate(indices) if i in known]


def _as_is(batch: Any) -> Any:
    """The loader's collate: a batch is already whole (a module-level function: workers pickle it)."""
    return batch


@contextlib.contextmanager
def _evaluating(model: Any) -> Iterator[None]:
    """`model`'s modules in eval mode (a user's dropout off: the scores are the model's own, and an
    evaluation draws nothing from the generators the next training step's dropout draws from),
    each put back in its own mode after (a stand-in that is no module: as it is)."""
    modes = {m: m.training for m in model.modules()} if isinstance(model, torch.nn.Module) else {}
    for m in modes:
        m.training = False
    try:
        yield
    finally:
        for m, training in modes.items():
            m.training = training


def _without_labels(batch: MimoBatch, rows: Sequence[int]) -> MimoBatch:
    """`batch` with no loss (and no score) on `rows`: a row left out, with the shapes unchanged."""
    if not rows:
        return batch
    labels, mask = batch.labels.clone(), batch.loss_mask.clone()
    labels[list(rows)] = IGNORE_INDEX
    mask[list(rows)] = 0
    return dataclasses.replace(batch, labels=labels, loss_mask=mask)


def _media_message(whys: Iterable[str]) -> str:
    whys = list(whys)
    return (f"{len(whys)} sample(s) whose media cannot be decoded: {'; '.join(whys)}; fix or remove them, or "
            "set data.skip_bad_media = true to leave such samples out")


class _Forever:
    """Epoch after epoch of a `ResumableBatchSampler`."""

    def __init__(self, sampler: ResumableBatchSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield from self.sampler


def _prefetched(batches: Iterator[tuple], depth: int, pin: bool,
                prepare: Callable[[MimoBatch], Any] | None = None) -> Iterator[tuple]:
    """`batches` (tuples whose first element is a `MimoBatch`), prepared up to `depth` ahead by a
    background thread (decoding and tensor work release the GIL), each passed to `prepare` (what
    the step derives from the whole global batch, `MimoBatch.memo`), then pinned when `pin`; an
    error preparing one is raised where it is consumed."""
    import queue
    import threading

    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()  # the batches ran out

    def hand(item: Any) -> bool:
        """Queue `item` unless the consumer stopped first (then False: a full queue would block)."""
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for batch in batches:
                if prepare is not None:
                    prepare(batch[0])
                if not hand((batch[0].pin_memory(), *batch[1:]) if pin else batch):
                    return
            hand(end)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            hand(e)

    threading.Thread(target=produce, name="dtensor_mimo-prefetch", daemon=True).start()
    try:
        while (item := ready.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


def _attention_width(config: Any) -> int:
    """The width attention's scores and weighted sums run over per token: ``n_heads * head_dim``
    where the config has both (Qwen3's and Mistral-Nemo's heads are not ``dim / n_heads`` wide),
    else ``dim`` (0: no config, no attention counted)."""
    heads, head_dim = getattr(config, "n_heads", None), getattr(config, "head_dim", None)
    return heads * head_dim if heads and head_dim else getattr(config, "dim", 0)


# ---------------------------------------------------------------------------- the trainer


class Trainer:
    """Builds the model, data, optimizer, metrics and checkpoints of `config` on this rank.

    Call on every rank of an initialized process group whose size is the layout's world size;
    `run` trains and returns the final held-out accuracy (the same on every rank).
    """

    def __init__(self, config: TrainerConfig, signals: StopSignals | None = None) -> None:
        self.config = config
        self.signals = signals  # None: no signal handling (a caller's own process)
        self.stopped: signal.Signals | None = None
        """The signal the run was stopped by (every rank the same), None: it was not."""
        self.saved: str | None = None  # the last checkpoint written
        self._training_batches: Iterator[tuple[list[int], MimoBatch, list[MediaError]]] | None = None
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.layout = build_layout(config, self.world)
        if config.train.threads:
            torch.set_num_threads(config.train.threads)
        self.resolved = resolve(config)
        self.data = train_data(config, self.resolved)
        self.seq_len = self.data.seq_len
        # On the meta device: each rank allocates and initializes only its own shards, below.
        self.modules = build_modules(config, self.resolved, self.seq_len, meta=True)
        refuse_nothing_trains(config, self.modules)  # (every rank alike, before any collective)
        if config.checkpoint.export_hf:  # a factory's module: its kind known now, not after the last step
            from dtensor_mimo.train.export import kind_problem

            if problem := kind_problem(self.modules):
                raise ConfigError(f"checkpoint.export_hf = {config.checkpoint.export_hf!r}: the trained model cannot "
                                  f"be written as Hugging Face directories: {problem}; remove checkpoint.export_hf "
                                  "(and save with checkpoint.dir) or change that module")
        d = config.data
        # The exact sample count (the sampler's shuffle and the checkpoint's data position need it):
        # conversation files are indexed here (JSONL line starts, tar headers, table row counts),
        # no sample parsed or tokenized.
        rows = len(self.data.train)
        if rows < d.batch_size:  # the launcher checked the samples it read; packed rows are known here
            raise ConfigError(f"data.batch_size = {d.batch_size} is more than the {rows} training rows of "
                              f"{d.path}{' (packed with data.pack)' if d.pack else ''}; lower data.batch_size")
        self.sampler = ResumableBatchSampler(rows, d.batch_size, seed=d.seed)
        # A tied decoder cut into pipeline stages trains two copies (MimoModel would untie it): the
        # checkpoint keys are those of the model as it trains
        untie_for_stages(self.layout, self.modules[LANGUAGE], LANGUAGE, config.pipeline)
        self.expected_keys = checkpoint.expected_shapes(self.modules)
        self.flops_per_step = self._flops()

        encoders = {n: m for n, m in self.modules.items() if n != LANGUAGE}
        self.model = MimoModel(
            self.layout, self.modules[LANGUAGE], encoders,
            options={n: config.module_options(n) for n in config.module_names},
            device_type=config.train.device, bridge_hops=config.layout.bridge_hops, pipeline=config.pipeline)
        self.model.init_weights(self.resolved.seeds)  # a checkpoint or resumed run then loads over it
        if self.resolved.hf_paths:
            self.model.load_hf(self.resolved.hf_paths)
        self.optimizer = MimoOptimizer(self.model, config.optimizer.adamw, config.optimizer.per_module(),
                                       config.lr_schedule)
        # Checkpoints written in the background: its gloo group, created here on every rank.
        c = config.checkpoint
        self.background = (checkpoint.BackgroundSaves(pin=c.async_mode == "async_with_pinned_mem")
                           if c.dir and c.async_mode != "disabled" else None)
        self._writing: tuple[int, float] | None = None  # the step being written, what it waited
        m = config.metrics
        self.log = MetricsLogger(self.rank == 0, config.train.steps, m.jsonl, m.tensorboard, m.progress)
        self.peak = peak_tflops(self.model.device, m.peak_tflops)
        self.profiler = (StepProfiler(m.profile, m.profile_at, m.profile_steps, config.train.steps, self.rank,
                                      self.model.device) if m.profile else None)
        self.step = 0
        self.heldout_scores: dict[str, float] = {}  # the last evaluation's
        self.skip_bad_media = getattr(d, "skip_bad_media", False)
        self.left_out: dict[int, str] = {}  # training rows whose media fail to decode: why (every rank)
        self.heldout_left_out: dict[int, str] = {}  # held-out rows, likewise
        self.skipped_samples = 0  # rows left out of steps (data.skip_bad_media), since step 0
        self.evaluation_due = False  # the resumed checkpoint's step was not evaluated (a stop skipped it)

    # ------------------------------------------------------------------ pieces
    def _flops(self) -> float:
        """Model FLOPs of one step: the language model over every token row, each encoder over
        its expected items at their expected rows (the data's mean when items have their own
        sizes; attention then counted at that mean length, an estimate: the cost of one item's
        attention grows with its rows squared) (2·params per token forward, x3 when trained, x2 for
        a frozen decoder, whose attention still x3; attention counted dense)."""
        b = self.config.data.batch_size
        llama = self.modules[LANGUAGE]
        lc = llama.config
        # (every name: a tied head, listed once as the embedding, is a matmul the embedding is not)
        total = transformer_flops(sum(p.numel() for n, p in llama.named_parameters(remove_duplicate=False)
                                      if "embed" not in n),
                                  b * self.seq_len, lc.n_layers, _attention_width(lc), self.seq_len,
                                  not self.config.model.language.frozen, through=True)
        for name, e in self.resolved.encoders.items():
            enc = self.modules[name]
            per_item = self.data.tokens_per_item.get(name, e.tokens_per_item)
            tokens = int(b * self.data.items_per_sample.get(name, 0) * per_item)
            tower, projection = (enc.encoder, enc.projection) if isinstance(enc, ModalityEncoder) else (enc, None)
            tc = getattr(tower, "config", None)
            layers, dim = getattr(tc, "n_layers", 0), _attention_width(tc)
            total += transformer_flops(sum(p.numel() for p in tower.parameters()), tokens, layers, dim,
                                       round(per_item), not e.section.frozen)
            if projection is not None:
                total += transformer_flops(sum(p.numel() for p in projection.parameters()), tokens, 0, 0, 0, True)
        return total

    def _load_plan(self, batch_size: int, microbatches: int) -> _LoadPlan:
        if not self.config.data.per_rank_loading:
            return _LoadPlan(None, microbatches, {})
        fixed = samples_to_load(self.layout, self.rank, batch_size, microbatches, self.model.encoder_names)
        balanced = {}
        for n in fixed:
            par, option = self.layout.parallelism(n), self.model.options[n].balance
            section = self.config.model.encoders[n]
            may_vary = section.dynamic_resolution or section.variable_length
            if par.dp > 1 and (option or (option is None and may_vary)):
                balanced[n] = (par.dp, self.layout.coordinate(n, self.rank)["dp"], option, self.model._widths[n])
        return _LoadPlan(fixed, microbatches, balanced)

    def _batches(self) -> Iterator[tuple[list[int], MimoBatch, list[MediaError]]]:
        """This rank's view of the global batches from the sampler's position on, with their
        indices and the media that failed to decode (`_LoadPlan.tolerant`); the sampler
        advances as batches are consumed (its state is the checkpoint's data position)."""
        d = self.config.data
        plan = self.train_plan = self._load_plan(d.batch_size, self.config.pipeline.microbatches)
        gpu = self.model.device.type == "cuda"
        # a loader process frees a GPU step's thread, unless data.prefetch asks for the thread
        workers = d.workers if d.workers is not None else 0 if d.prefetch else int(gpu)
        prefetch = d.prefetch if d.prefetch is not None else gpu
        if workers == 0 and not prefetch:
            for indices in _Forever(self.sampler):
                yield (list(indices), *plan.tolerant(self.data.train.batch, indices, self._left_out(indices)))
            return
        ahead = ResumableBatchSampler(len(self.data.train), d.batch_size, seed=d.seed)
        ahead.load_state_dict(self.sampler.state_dict())  # the loader's own copy runs ahead
        pin = gpu  # host-to-device copies then overlap the step
        if workers == 0:  # one thread prepares the next batches while the step runs
            # (rows known unusable, read as they are learnt, are built left out: their media not decoded again)
            batches: Iterator[tuple] = _prefetched((plan.tolerant(self.data.train.batch, i, self._left_out(i))
                                                    for i in _Forever(ahead)), depth=2, pin=pin,
                                                   prepare=self.model.prepare)
        else:
            parts = self.model.parts
            loader = DataLoader(_Batches(self.data.train, plan, (parts.pipeline.microbatches, parts.cut_rules),
                                         frozenset(self.left_out)),
                                sampler=_Forever(ahead), batch_size=None,
                                num_workers=workers, collate_fn=_as_is, persistent_workers=True,
                                pin_memory=pin, worker_init_fn=ignore_stop_signals,
                                multiprocessing_context=LOADER_START,
                                # its workers' seed from a generator of its own: drawn from torch's
                                # global one, it would move the state a resumed run restores
                                generator=torch.Generator().manual_seed(d.seed))
            stream = iter(loader)
            batches = (_unpacked(item) for item in stream)
        try:
            for (batch, failed), indices in zip(batches, _Forever(self.sampler)):
                yield list(indices), batch, list(failed)
        finally:
            if workers:  # joined here, also when a worker's error ends the batches: its traceback
                # holds the loader, and with it the processes, for as long as the error lives
                # (torch has no public way to end an iterator's workers; 2.11 and 2.13 have this)
                stream._shutdown_workers()

    def trainer_state(self) -> dict[str, Any]:
        """The loop's position for checkpoints: step, optimizer updates, the sampler's place, and
        the training rows known to be unusable (equal on every rank: agreed when found), so a
        resumed run neither decodes them again nor restarts their count; and whether the step's held-out
        evaluation is still to be made (a stop skips the one due at its step: the resumed run makes it)."""
        return {"step": self.step, "updates": self.optimizer.updates, "sampler": self.sampler.state_dict(),
                "skipped_samples": self.skipped_samples, "left_out": self.left_out,
                "evaluation_due": self.stopped is not None and self._evaluation_due()}

    def _evaluation_due(self) -> bool:
        """Whether `train.eval_every` evaluates this step during the loop (the last step's is the run's end's)."""
        every = self.config.train.eval_every
        return bool(every and self.step % every == 0 and self.step < self.config.train.steps)

    def save(self) -> None:
        """A checkpoint of this step in `checkpoint.dir` (every rank): written now, or, with
        ``checkpoint.async_mode = "async"``, copied now and written in the background (the previous
        one finished first); the run's last save and a stop's are waited for."""
        c = self.config.checkpoint
        t0 = time.perf_counter()
        if self.background is None:
            path = checkpoint.save(c.dir, self.step, self.model, self.optimizer, self.trainer_state(), c.keep)
            self._saved(path, self.step, time.perf_counter() - t0)
            return
        self._finish_save()
        path = self.background.start(c.dir, self.step, self.model, self.optimizer, self.trainer_state(), c.keep)
        if self.step >= self.config.train.steps or self.stopped is not None:  # the run ends here: written now
            self.background.finish()
            self.background.release()
            self._saved(path, self.step, time.perf_counter() - t0)
        else:
            self._writing = (self.step, time.perf_counter() - t0)

    def _finish_save(self) -> None:
        """Wait for the checkpoint being written in the background, if one is (every rank, at the
        same step: when the step's all-reduce says no rank's writer is still running, or before
        the next save)."""
        if self._writing is not None:
            (step, stall), self._writing = self._writing, None
            self._saved(self.background.finish(), step, stall)

    def _settle_save(self) -> None:
        """On the run's error: let a checkpoint still being written complete, with no collective
        (`BackgroundSaves.settle`, at most `train.timeout_s`), and say what became of it."""
        if self._writing is None:
            return
        (step, stall), self._writing = self._writing, None
        path, why = self.background.settle(self.config.train.timeout_s)
        if path is not None:
            self._saved(path, step, stall)
        else:
            print(f"rank {self.rank}: warning: the checkpoint of step {step}: {why}", file=sys.stderr, flush=True)

    def _saved(self, path: str, step: int, stall: float) -> None:
        """Log the checkpoint of `step` at `path`, complete now; `stall`: the seconds its step
        waited for it (the files, or only the copy to host memory when written in the background)."""
        self.saved = path
        background = f" (written in the background since step {step})" if step != self.step else ""
        self.log.log({"step": self.step, "checkpoint": path, "checkpoint_step": step, "checkpoint_stall_s": stall},
                     f"step {self.step}: saved {path}{background}; the step waited {stall * 1e3:.0f} ms for it")

    def restore(self) -> None:
        """Resume from `checkpoint.dir`'s newest checkpoint that verifies (newer damaged ones are
        skipped with a warning naming the file), else start from `checkpoint.load`: all of its
        state, or with `checkpoint.load_model_only` its model's weights alone (step 0, a fresh
        optimizer, the lr schedule and this run's data from the start)."""
        c = self.config.checkpoint
        path, verified = None, False
        if c.dir:
            path, warnings = checkpoint.choose_checkpoint(c.dir)
            for warning in warnings:
                self.log.print(f"warning: {warning}")
            verified = path is not None
            if path is None:  # a mistyped dir would otherwise start over in silence
                what = f"no checkpoint in {c.dir} verifies (each skipped above)" if warnings else \
                    f"no checkpoint in {c.dir}"
                start = "starting from checkpoint.load" + ("'s model weights" if c.load_model_only else "")
                self.log.print(f"{what}: " + (start if c.load else "starting at step 0"))
        if path is None and c.load:
            # Every rank loads the same path or raises together; a directory of checkpoints is
            # chosen from as checkpoint.dir is, each rank checksumming its share.
            path, warnings, verified = checkpoint.choose_load(c.load)
            for warning in warnings:
                self.log.print(f"warning: {warning}")
            if c.load_model_only:  # a requeued run took its own checkpoint above, with its full state
                checkpoint.load_model(path, self.model, self.expected_keys, verified=verified,
                                      warn=lambda w: self.log.print(f"warning: {w}"))
                self.log.print(f"loaded the model's weights from {path} (checkpoint.load_model_only): starting at "
                               "step 0 with a fresh optimizer, the lr schedule and the data from the start")
                return
        if path is None:
            return
        def fits(saved: dict[str, Any]) -> None:  # the same verdict on every rank: one checkpoint, one config
            ours, here = saved["sampler"], self.sampler.state_dict()
            differ = [f"{name} {ours[k]} (this run: {here[k]})" for k, name in
                      (("batch_size", "data.batch_size"), ("seed", "data.seed"), ("num_samples", "training rows"))
                      if k in ours and ours[k] != here[k]]
            if differ:
                raise checkpoint.CheckpointError(
                    f"{path} holds the data position of a run with other data: it was saved with {', '.join(differ)}; "
                    "resume it with the data.batch_size, data.seed and training data it was saved with (with "
                    "data.pack, the rows depend on data.seq_len and data.truncate too)")

        state = checkpoint.load(path, self.model, self.optimizer, self.expected_keys, verified=verified, check=fits,
                                warn=lambda w: self.log.print(f"warning: {w}"))
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        # absent from checkpoints of earlier versions; JSON made the row numbers strings
        self.skipped_samples = state.get("skipped_samples", 0)
        if self.skip_bad_media:  # without it, a known row is named again (its file may have been mended), not dropped
            self.left_out = {int(row): why for row, why in state.get("left_out", {}).items()}
        self.evaluation_due = bool(state.get("evaluation_due", False))
        self.log.print(f"resumed from {path} at step {self.step}")

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, float]:
        """Held-out exact match of every answer ("answer", and the task's parts): teacher-forced
        argmax over the answer tokens, which equals greedy decoding's answer; and the held-out
        loss ("loss": per target token, as the training loss, from the same logits)."""
        with _evaluating(self.model):
            return Trainer._scores(self)

    def _scores(self) -> dict[str, float]:
        heldout, b = self.data.heldout, self.config.data.batch_size
        right: dict[str, int] = {}
        counted: dict[str, int] = {}
        loss_sum, weight = 0.0, 0.0
        for start in range(0, len(heldout), b):
            indices = list(range(start, min(start + b, len(heldout))))
            batch = self._heldout_batch(heldout.batch, indices)
            pred, loss = self.model.predict(batch, with_loss=True)
            pred = pred.cpu()
            tokens = float(loss_weights(batch.labels, batch.loss_mask).sum())
            loss_sum, weight = loss_sum + loss * tokens, weight + tokens
            for name, (r, c) in self.data.score(batch, pred).items():
                right[name] = right.get(name, 0) + r
                counted[name] = counted.get(name, 0) + c
        scores = {k: right[k] / counted[k] if counted[k] else float("nan") for k in right}
        return {**scores, "loss": loss_sum / weight if weight else float("nan")}

    def answers(self, n: int) -> list[tuple[str, str]]:
        """Greedy answers to the first `n` held-out prompts (samples with an answer): (expected,
        generated). Each row starts as its prompt alone, with only the items before the answer."""
        with _evaluating(self.model):
            return Trainer._answers(self, n)

    def _answers(self, n: int) -> list[tuple[str, str]]:
        heldout = self.data.heldout
        # (after an evaluation, which read every held-out sample: the rows left out are known, and
        # tokenizing one whose media header cannot be read would raise)
        chosen = list(itertools.islice((i for i in range(len(heldout)) if i not in self.heldout_left_out
                                        and self.data.prompt(i) is not None), n))
        if not chosen:
            return []
        batch = self._heldout_batch(getattr(heldout, "prompts", heldout.batch), chosen)
        prompts = [self.data.prompt(i) for i in chosen]
        lengths = [p[0] for p in prompts]
        # each prompt with its own row's room (a long prompt of another sample cut the others'
        # answers) and its own stop id (with one for all, samples of other ids ran to their row's end)
        out = self.model.generate(batch, lengths, [self.seq_len - n for n in lengths],
                                  stop_token=[p[2] for p in prompts])
        return [(expected, self.data.decode(ids)) for i, (_, expected, _), ids in zip(chosen, prompts, out)
                if i not in self.heldout_left_out]

    def _heldout_batch(self, make: Callable[..., MimoBatch], indices: Sequence[int]) -> MimoBatch:
        """A held-out batch, its rows whose media fail to decode left out of the scores. Every
        rank learns of a failure on any rank in one all-reduce of the count per batch (the
        evaluation's own; a training step's rides on the step's)."""
        known = self.heldout_left_out
        batch, failed = self._load_plan(len(indices), 1).tolerant(make, indices, self._left_out(indices, known))
        failed = [e for e in failed if indices[e.row] not in known]
        count = torch.tensor([float(len(failed))], device=self.model.device)
        dist.all_reduce(count)
        if count.item():
            self._agree_on_media(failed, indices, known, heldout=True)
        return _without_labels(batch, self._left_out(indices, known))

    # ------------------------------------------------------------------ the loop
    def run(self) -> float | None:
        """Train to `train.steps` (resuming or loading a checkpoint first), evaluate, export and
        answer a few held-out prompts; returns the held-out accuracy (None without held-out data)."""
        try:
            return self._run()
        except BaseException:
            try:
                self._settle_save()
            finally:
                self.log.close()  # what was logged is on disk, however the process ends (the launcher exits at once)
            if self.profiler is not None:
                self.profiler.abandon()
            raise
        finally:
            self._close_batches()

    def _close_batches(self) -> None:
        """End the training batches' generator: its loader workers are joined (on every path, so
        that none outlives the rank or holds its sockets open after an error: `LOADER_START`)."""
        if self._training_batches is not None:
            self._training_batches.close()
            self._training_batches = None

    def _run(self) -> float | None:
        c = self.config
        self.log.print(c.describe())
        self.log.print(self.layout.describe())
        params = {n: sum(p.numel() for p in m.parameters()) for n, m in self.modules.items()}
        self.log.print("parameters: " + ", ".join(f"{n} {v:,}" for n, v in params.items()) +
                       f"; seq_len {self.seq_len}; batch {c.data.batch_size}")
        self.restore()
        if self.model.device.type == "cuda":  # the logged peak is training's, not building's or loading's
            torch.cuda.reset_peak_memory_stats(self.model.device)
        self.log.start_at(self.step)
        if self.evaluation_due and self.step < c.train.steps:  # skipped by the stop the checkpoint was written at
            self._report_eval()
        self.evaluation_due = False
        if self.profiler is not None and self.step >= self.profiler.last:
            self.log.print(f"metrics.profile: this run starts after step {self.step}, past the profiled steps "
                           f"{self.profiler.first}-{self.profiler.last}: nothing is profiled")
        compiled = [n for n in c.module_names if c.module_options(n).compile]
        warm = self.step + (COMPILE_STEPS if compiled else 0)  # steps whose time is compilation
        if compiled:
            self.log.print(f"compiling {', '.join(compiled)} during the first steps; tokens/s and "
                           f"step times leave out the first {COMPILE_STEPS}")
        batches = self._training_batches = self._batches()
        tokens = c.data.batch_size * self.seq_len
        window: list[list[float]] = []
        while self.step < c.train.steps:
            step = self.step + 1
            if self.profiler is not None:
                self.profiler.before(step)
            try:
                window = self._run_step(batches, window, warm, tokens)
            except BaseException as e:
                # Which step, for errors that cannot say (a peer's closed connection, a timeout).
                e.add_note(f"in step {step}")
                raise
            if self.profiler is not None:
                self._profiled(self.profiler.after(self.step))
            if self.stopped is not None:  # `run` joins the loader's workers on the way out
                if self.profiler is not None:  # stopped inside the profiled steps: what they recorded
                    self._profiled(self.profiler.close(self.step))
                self._say_stopped()
                self.log.close()
                return None
        self._close_batches()  # the loader's workers end here, before evaluation and export
        if c.checkpoint.export_hf:  # first: nothing in the held-out data can cost the export
            self.export(c.checkpoint.export_hf)
        accuracy = self._report_eval()
        n = c.train.generate if self.data.heldout is not None else 0
        for expected, got in self.answers(n) if n else ():
            self.log.print(f"  expected: {expected:<28} generated: {got}")
        if accuracy is not None:
            self.log.print(f"held-out accuracy: {accuracy:.2f}")
        self._held_out_errors()
        self.log.close()
        return accuracy

    def _profiled(self, table: str | None) -> None:
        """Say where the profile went, once it is written, or why it was not (`StepProfiler`)."""
        if table is not None:
            self.log.print(f"step {self.step}: profile written: {os.path.dirname(table)}/rank<r>.txt and .json "
                           "(each rank)")
        elif self.profiler is not None and self.profiler.failed:
            print(f"rank {self.rank}: warning: metrics.profile: {self.profiler.failed}; training goes on",
                  file=sys.stderr, flush=True)
            self.profiler.failed = None  # said once

    def _run_step(self, batches: Iterator[MimoBatch], window: list[list[float]], warm: int,
                  tokens: int) -> list[list[float]]:
        """One step of `run`'s loop: the batch, `train_step`, logs, checkpoint, evaluation; returns
        the throughput window (phase times of the steps since the last log line)."""
        c = self.config
        t0 = time.perf_counter()
        indices, batch, failed = next(batches)
        timings: dict[str, float] = {}
        data_s = time.perf_counter() - t0
        lr = self.optimizer.lrs()["language"]  # what this step's update uses
        while True:
            rows = self._left_out(indices)  # known on every rank alike
            failed = [e for e in failed if indices[e.row] not in self.left_out]  # new ones
            try:
                metrics = train_step(self.model, self.optimizer, _without_labels(batch, rows), timings,
                                     votes=self._votes, unusable=bool(failed))
                break
            except UnusableBatch:
                # Some rank could not decode a file: all learn which (raises here unless skipping),
                # then run the step again without those rows. Only then: no per-step cost.
                self._agree_on_media(failed, indices, self.left_out, heldout=False)
                batch, failed = self.train_plan.tolerant(self.data.train.batch, indices, self._left_out(indices))
        self.skipped_samples += len(rows)
        self.step += 1
        self._agree_on_stop(metrics.votes[:len(STOP_SIGNALS)])
        if self._writing is not None and not metrics.votes[len(STOP_SIGNALS)]:
            self._finish_save()  # no rank's writer is running: every rank finishes it here
        times = [data_s, timings["forward_backward"], timings["optimizer"], time.perf_counter() - t0]
        if self.step > warm and not (self.profiler is not None and self.profiler.covers(self.step)):
            window.append(times)
        self.log.tick(self.step, metrics.loss)
        if self.step % c.metrics.log_every == 0 or self.step == c.train.steps:
            profiled = not window and self.profiler is not None and self.profiler.covers(self.step)
            self._log(metrics, lr, window or [times], tokens, self.model.encoder_imbalance(batch), profiled)
            window = []
        if c.checkpoint.dir and ((c.checkpoint.every and self.step % c.checkpoint.every == 0)
                                 or self.step == c.train.steps or self.stopped is not None):
            self.save()
        if self._evaluation_due() and self.stopped is None:  # (a stop's is made by the resumed run)
            self._report_eval()
        return window

    # ------------------------------------------------------------------ media that fail to decode
    def _left_out(self, indices: Sequence[int], left_out: dict[int, str] | None = None) -> list[int]:
        """Positions in a batch of `indices` whose rows are left out (their media fail to decode)."""
        return _rows_of(indices, self.left_out if left_out is None else left_out)

    def _agree_on_media(self, failed: Sequence[MediaError], indices: Sequence[int], known: dict[int, str],
                        heldout: bool) -> None:
        """Every rank's `failed` media (one all-gather, only when some rank has one), added to
        `known` (``{row index: why}``) on every rank; each new one said once (rank 0). Training
        data without ``data.skip_bad_media``: BatchError on every rank naming each sample and file
        (held-out data: left out of the score, the error raised at the end of the run, after the
        export: `_held_out_errors`)."""
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, [(indices[e.row], str(e)) for e in failed])
        found = {i: why for part in everyone for i, why in part if i not in known}
        if not heldout and not self.skip_bad_media:
            raise BatchError(_media_message(found.values()) + "; the step was not applied")
        for index, why in found.items():
            known[index] = why
            what = "scored" if heldout else "trained on"
            self.log.print(f"warning: {why}: the sample is not {what}" +
                           (" (data.skip_bad_media)" if self.skip_bad_media else ""))

    def _held_out_errors(self) -> None:
        """Without ``data.skip_bad_media``, held-out media that failed to decode end the run (after
        the export and the evaluation), naming each sample and file: on every rank alike."""
        if self.heldout_left_out and not self.skip_bad_media:
            raise BatchError(_media_message(self.heldout_left_out.values()) + " (held-out data: those samples were "
                             "left out of the scores; the export was written)")

    # ------------------------------------------------------------------ stopping
    def _votes(self) -> tuple[float, ...]:
        """What this rank says in the step's all-reduce (`train_step`'s votes, asked for after the
        step's backward: a signal during its forward or backward stops the run after it): its votes
        to stop, then, when checkpoints are written in the background, 1.0 while its writer is running
        (the sum is 0 once every rank's has ended: all finish the save at that step)."""
        writing = (float(self.background.writing()),) if self.background is not None else ()
        return (*self._stop_votes(), *writing)

    def _stop_votes(self) -> tuple[float, ...]:
        """This rank's votes to stop, one per `STOP_SIGNALS` (1.0: it got that signal).

        Why in the step's all-reduce rather than a check of its own: the step already waits for
        every rank once, so the verdict costs nothing per step and is the same on every rank at
        the same step, whichever rank was signalled (a signal to one rank only stops them all
        there, never hangs). The price: a stop waits for the step in flight to end."""
        got = self.signals.requested if self.signals is not None else None
        return tuple(float(got == s) for s in STOP_SIGNALS)

    def _agree_on_stop(self, votes: Sequence[float]) -> None:
        """The signal every rank stops for, from the summed `votes`: the first of `STOP_SIGNALS`
        any rank got (SIGTERM before SIGINT: the scheduler's word wins; SIGUSR1 after both)."""
        for sig, count in zip(STOP_SIGNALS, votes):
            if count:
                self.stopped = sig
                return

    def _say_stopped(self) -> None:
        c = self.config
        code = exit_status(self.stopped)
        if c.checkpoint.dir:
            where = f"checkpoint written to {self.saved}; rerun the same command to resume"
        else:
            where = "nothing saved (no checkpoint.dir is set)"
        self.log.print(f"stopped by {self.stopped.name} at step {self.step}: {where} (exit status {code})")

    def _report_eval(self) -> float | None:
        if self.data.heldout is None:
            return None
        acc = self.heldout_scores = self.evaluate()
        parts = ", ".join(f"{k} {v:.3f}" for k, v in acc.items() if k not in ("answer", "loss"))
        # JSONL keys without spaces: a part "with image" is heldout_with_image
        self.log.log({"step": self.step, **{f"heldout_{k.replace(' ', '_')}": v for k, v in acc.items()}},
                     f"step {self.step}: held-out exact match {acc['answer']:.3f}" + (f" ({parts})" if parts else "")
                     + f", loss {acc['loss']:.4f}")
        return acc["answer"]

    def export(self, path: str) -> None:
        """Write the trained model as Hugging Face directories (`dtensor_mimo.train.export`)."""
        from dtensor_mimo.train.export import export_hf

        r = self.resolved
        dtype = getattr(torch, self.config.checkpoint.export_dtype)
        modalities = {n: e.section.modality for n, e in r.encoders.items()}
        try:  # the placeholder ids, from sample 0's row (no media decoded)
            first = self.data.train.batch([0], load={})
        except MediaError:  # a media header of it cannot be read: its row built empty, as a step leaves it out
            first = self.data.train.batch([0], load={}, left_out=(0,))
        ids = {n: b.special_token_id for n, b in first.modalities.items()}
        export_hf(self.model, path, modalities=modalities, special_token_ids=ids, tokenizer=r.tokenizer,
                  processors={n: e.processor for n, e in r.encoders.items() if e.processor is not None}, dtype=dtype)
        self.log.print(f"step {self.step}: exported {path}")

    def _log(self, metrics, lr: float, window: list[list[float]], tokens: int, imbalance: dict[str, float],
             profiled: bool = False) -> None:
        """One MAX all-reduce of this window's mean phase times and peak memory; rank 0 logs, with
        the logged step's encoder `imbalance` (`MimoModel.encoder_imbalance`). `profiled`: the
        times are a profiled step's (every step since the last log line was), marked so."""
        # Phase times of GPU steps are CUDA event pairs: read here, once per log line, not per step.
        mean = torch.tensor([[float(t) for t in row] for row in window], dtype=torch.float64).mean(0)
        memory = (torch.cuda.max_memory_allocated(self.model.device) if self.model.device.type == "cuda"
                  else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        times = torch.cat([mean, torch.tensor([float(memory)], dtype=torch.float64)]).to(self.model.device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        data_s, fb_s, opt_s, step_s, memory = times.tolist()
        tflops = self.flops_per_step / step_s / 1e12
        mfu = tflops / (self.peak * self.world) if self.peak else None
        record = {"step": self.step, "loss": metrics.loss, "grad_norm": metrics.grad_norm,
                  "tokens_per_s": tokens / step_s, "lr": lr,
                  "step_s": step_s, "data_s": data_s, "forward_backward_s": fb_s, "optimizer_s": opt_s,
                  "peak_memory_gib": memory / 2**30, "tflops": tflops, "mfu": mfu,
                  "skipped": metrics.skipped, "skipped_samples": self.skipped_samples,
                  **{f"grad_norm_{n}": v for n, v in metrics.module_grad_norms.items()},
                  **{f"encoder_imbalance_{n}": v for n, v in imbalance.items()},
                  **({"profiled": True} if profiled else {})}
        shares = "".join(f" {n} {v:.2f}" for n, v in imbalance.items())
        self.log.log(record, f"step {self.step:>5} | loss {metrics.loss:.4f} | grad norm {metrics.grad_norm:.3f} | "
                             f"lr {record['lr']:.2e} | {record['tokens_per_s']:,.0f} tok/s | step "
                             f"{step_s * 1e3:.1f} ms (data {data_s * 1e3:.1f}, fwd+bwd {fb_s * 1e3:.1f}, "
                             f"optim {opt_s * 1e3:.1f}) | mem {record['peak_memory_gib']:.2f} GiB | "
                             + (f"MFU {mfu:.1%}" if mfu is not None else f"{tflops * 1e3:.1f} GFLOP/s")
                             + (f" | encoder max/mean{shares}" if shares else "")
                             + (f" | {self.skipped_samples} samples skipped" if self.skipped_samples else "")
                             + (" | profiled" if profiled else ""))
