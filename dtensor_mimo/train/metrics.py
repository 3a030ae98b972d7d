"""What the trainer reports: JSONL records, log lines, a progress bar, TensorBoard, FLOPs and MFU.

Only rank 0 writes. Step times come per rank (data loading, forward + backward including the
bridge, gradient reduction + optimizer); the trainer reduces them with one small MAX all-reduce
at logged steps, so a line shows the slowest rank of each phase.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Mapping, TextIO

import torch

# Peak dense bf16 TFLOP/s per GPU, for MFU when `metrics.peak_tflops` is not given; the first entry
# whose words are all in the device's name (the PCIe and NVL boards before the SXM ones).
_PEAK_TFLOPS = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0), ("H200", 989.0),
                ("H100", 989.0), ("A100", 312.0)]


def peak_tflops(device: torch.device, configured: float) -> float | None:
    """The peak TFLOP/s per rank that MFU divides by: `configured` if > 0, a known GPU's, else None."""
    if configured > 0:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in _PEAK_TFLOPS if all(w in name for w in k.split())), None)
    return None


def transformer_flops(params: int, tokens: int, layers: int, dim: int, seq: int, trained: bool,
                      through: bool = False) -> float:
    """FLOPs of one pass of a transformer over `tokens` tokens in sequences of `seq`: 2 per
    parameter per token plus attention's ``4 * layers * seq * dim`` per token (causal or not,
    counted dense; `dim`: the width attention runs over, ``n_heads * head_dim``) for forward;
    backward doubles both when the module trains; when it is frozen but `through` (its inputs'
    gradients only: a frozen decoder behind trained projections) it adds one forward's worth of the
    parameters' term (no weight gradients) and still doubles attention's (which has no weights)."""
    weights, attention = 2.0 * params * tokens, 4.0 * layers * seq * dim * tokens
    return weights * (3 if trained else 2 if through else 1) + attention * (3 if trained or through else 1)


def profile_tables(prof: Any, cuda: bool, rows: int = 40, host_rows: int = 20) -> str:
    """torch.profiler `prof`'s ops by their own device time (`cuda`) or CPU time, `rows` of them,
    then (`host_rows` > 0) by their own host time: what `StepProfiler` and `benchmarks/gpu.py`
    write."""
    averages = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    text = f"by {key}\n" + averages.table(sort_by=key, row_limit=rows, max_name_column_width=70) + "\n"
    if host_rows:
        text += "by host time\n" + averages.table(sort_by="self_cpu_time_total", row_limit=host_rows,
                                                max_name_column_width=70) + "\n"
    return text


class StepProfiler:
    """torch.profiler over steps ``first .. first + count - 1`` of a run (``metrics.profile``),
    the run's last step at most.

    `before` starts it ahead of the first of them that runs (a run resumed inside the window
    records the rest of it), `after` stops it after the last and writes ``rank{rank}.json`` (the
    trace) and ``rank{rank}.txt`` (the tables) into `directory`: every rank its own, with no
    collective, so ranks that run different modules each show their own work. The library's
    ``mimo.*`` ranges (`dtensor_mimo.schedule.runtime.phase`) are recorded only while a profiler
    runs, so the other steps pay nothing for them. The profiler failing (to start, or to write)
    never costs the run: `failed` says why, and the run goes on unprofiled."""

    def __init__(self, directory: str, first: int, count: int, last_step: int, rank: int,
                 device: torch.device) -> None:
        self.directory, self.rank, self.device = directory, rank, device
        self.first, self.last = first, min(first + count - 1, last_step)
        self._prof: Any = None
        self._started = 0  # the first step recorded
        self.failed: str | None = None
        """Why the profile was not written (the profiler's own error), once it failed."""

    def covers(self, step: int) -> bool:
        """Whether `step` is profiled (its time is then left out of the logged step times)."""
        return self.first <= step <= self.last

    def before(self, step: int) -> None:
        """Called before `step` runs."""
        if not self._started and self.covers(step):
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])]
            self._started = step
            try:
                prof = profile(activities=activities)
                prof.__enter__()
            except Exception as e:  # noqa: BLE001 - a profile must not cost the run
                self.failed = f"torch.profiler did not start: {type(e).__name__}: {e}"
            else:
                self._prof = prof

    def after(self, step: int) -> str | None:
        """Called after `step` ran; after the last profiled one, writes the files and returns the
        table's path."""
        return self.close(step) if step == self.last and self._prof is not None else None

    def close(self, step: int) -> str | None:
        """Stop after `step` (a run stopped inside the window, too) and write what was recorded;
        the table's path (None: nothing was recorded)."""
        prof, self._prof = self._prof, None
        if prof is None:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the device work of the last step is in the record
        base = os.path.join(self.directory, f"rank{self.rank}")
        try:
            prof.__exit__(None, None, None)
            os.makedirs(self.directory, exist_ok=True)
            prof.export_chrome_trace(base + ".json")
            cuda = self.device.type == "cuda"
            with open(base + ".txt", "w") as f:
                f.write(f"rank {self.rank}, steps {self._started}-{step}, "
                        + profile_tables(prof, cuda, host_rows=20 if cuda else 0))
        except Exception as e:  # noqa: BLE001 - a profile must not cost the run
            self.failed = f"the profile of steps {self._started}-{step} was not written: {type(e).__name__}: {e}"
            return None
        return base + ".txt"

    def abandon(self) -> None:
        """Stop without writing, on a run's error: no device sync (a failed device or a peer's
        collective left pending would raise or wait there) and nothing that could raise over the
        run's own error."""
        prof, self._prof = self._prof, None
        if prof is not None:
            try:
                prof.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - the run's error is the one to report
                pass


class MetricsLogger:
    """Rank 0's reporting: `log` writes a JSONL record, TensorBoard scalars and a log line; `tick`
    moves the progress bar. Other ranks get a logger that does nothing."""

    def __init__(self, enabled: bool, total_steps: int, jsonl: str | None, tensorboard: str | None,
                 progress: str, out: TextIO | None = None) -> None:
        # sys.stdout as it is now (a default argument would keep the one at import: the planner's
        # calibration ranks point sys.stdout at /dev/null before they build a trainer)
        self.enabled, self.out, self.total = enabled, sys.stdout if out is None else out, total_steps
        if enabled and jsonl:  # its directory created as checkpoint.dir's and TensorBoard's are
            os.makedirs(os.path.dirname(os.path.abspath(jsonl)), exist_ok=True)
        self._jsonl_path = jsonl if enabled and jsonl else None
        self._jsonl = open(jsonl, "a") if self._jsonl_path else None
        self._tb, self._tb_dir = None, None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print("metrics.tensorboard: the tensorboard package is not installed; "
                      "pip install tensorboard (TensorBoard logging off)", file=self.out)
            else:  # opened at the first record
                self._tb_dir, self._tb_writer = tensorboard, SummaryWriter
        show = progress == "on" or (progress == "auto" and self.out.isatty())
        self._bar = _bar(total_steps) if enabled and show else None
        self._started = time.perf_counter()
        self._purge: int | None = None  # TensorBoard's purge step (`start_at`)
        self._tb_kept: tuple[int, set[str]] = (0, set())  # (step, its scalars the event files hold: `start_at`)

    def start_at(self, step: int) -> None:
        """The run starts after `step` (a resumed run: its checkpoint's): the steps from ``step + 1``
        on are the ones it logs again. A resumed run's JSONL file drops the records an earlier run
        wrote of them (as TensorBoard purges its events from ``step + 1``), so that each step is
        there once; a last line cut short (a process killed while writing it) goes too. A run
        from step 0 appends (the file may hold other runs), as does one whose file is not a
        regular file (``/dev/stdout``: read, a pipe would block).

        TensorBoard purges by step, every tag alike: a run resumed at its last step (a finished
        run's command given again) logs that step's held-out scores again, but the step's other
        scalars only the earlier run has. Its scalars of that step that the event files already
        hold (an earlier run evaluated it) are not written again."""
        self._purge = step + 1
        if self._tb_dir is not None and step > 0 and step >= self.total:
            self._tb_kept = (step, _tensorboard_tags_at(self._tb_dir, step))
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
        if self._jsonl is not None and step > 0:
            if not os.path.isfile(os.path.realpath(self._jsonl_path)):
                self.print(f"metrics.jsonl: {self._jsonl_path} is not a regular file: records an earlier run "
                           f"wrote of steps after {step} stay in it")
                return
            self._jsonl.close()
            # A run resumed at its last step trains nothing but evaluates that step again: an
            # earlier run's evaluation of it goes too (that run ended there, evaluated).
            again = step >= self.total
            dropped = _drop_records_after(self._jsonl_path, step, evaluation_of_step=again)
            self._jsonl = open(self._jsonl_path, "a")
            if dropped:
                what = f"steps after {step}" + (f" and the held-out scores of step {step}" if again else "")
                self.print(f"metrics.jsonl: {self._jsonl_path}: dropped {dropped} record(s) of {what} "
                           "written by an earlier run (this run logs them again)")

    def tick(self, step: int, loss: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self._bar.update(step - self._bar.n)

    def log(self, record: Mapping[str, Any], line: str) -> None:
        if not self.enabled:
            return
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(_json_values(record), allow_nan=False) + "\n")
            self._jsonl.flush()
        if self._tb is None and self._tb_dir is not None:
            # A resumed run logs again the steps after its checkpoint that the stopped run had
            # logged: TensorBoard drops those earlier events (from the first step it trains on)
            # instead of drawing both. Not from this record's step: a run resumed at its last step
            # (stopped during it) trains nothing, and its evaluation's record at that step dropped
            # the stopped run's scalars of it.
            purge = self._purge if self._purge is not None else record["step"]
            self._tb = self._tb_writer(self._tb_dir, purge_step=purge)
        if self._tb is not None:
            kept = self._tb_kept[1] if record["step"] == self._tb_kept[0] else set()
            for key, value in record.items():
                if key != "step" and key not in kept and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, record["step"])
        self.print(line)

    def print(self, line: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, file=self.out, flush=True)

    def close(self) -> None:
        for handle in (self._jsonl, self._tb, self._bar):
            if handle is not None:
                handle.close()


def _tensorboard_tags_at(directory: str, step: int) -> set[str]:
    """The scalar tags that the event files in `directory` hold at `step`, as TensorBoard reads them
    (purged events left out); none when there are no event files, or they cannot be read."""
    if not os.path.isdir(directory):
        return set()
    try:
        from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

        events = EventAccumulator(directory, size_guidance={SCALARS: 0})  # 0: every event, none sampled away
        events.Reload()
        return {tag for tag in events.Tags()["scalars"] if any(e.step == step for e in events.Scalars(tag))}
    except Exception:  # noqa: BLE001 - unreadable event files: the scalars are written (twice at worst)
        return set()


def _json_values(record: Mapping[str, Any]) -> dict[str, Any]:
    """`record` as JSON can hold it: a number that is not finite (a held-out part no sample counts
    in, a skipped step's gradient norm) is null; Python's NaN / Infinity literals are no JSON, and
    other readers (JavaScript's JSON.parse, Go, strict parsers) refuse the whole line."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


def _drop_records_after(path: str, step: int, evaluation_of_step: bool = False) -> int:
    """Rewrite the JSONL file `path` without its records of steps after `step` (with
    `evaluation_of_step`, also its held-out evaluation records of `step`) and without a last line
    cut short (no newline, not JSON); how many lines went. Other lines are kept as they are."""
    kept, dropped, cut = [], 0, False
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                if not line.endswith("\n"):  # the last line, its write cut short
                    dropped, cut = dropped + 1, True
                    continue
                record = None
            # a checkpoint's record: by the step it holds (one written in the background is
            # logged at a later step; the checkpoint a run resumes from stays)
            of = record.get("checkpoint_step", record.get("step")) if isinstance(record, dict) else None
            if isinstance(of, int) and (of > step or (evaluation_of_step and of == step
                                                      and any(k.startswith("heldout_") for k in record))):
                dropped += 1
            else:
                kept.append(line)
    if dropped:
        path = os.path.realpath(path)  # a link keeps pointing at the file rewritten
        temporary = f"{path}.tmp{os.getpid()}"
        with open(temporary, "w") as f:
            f.writelines(kept)
        os.replace(temporary, path)
    return dropped - cut


def _bar(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainBar(total)
    return tqdm(total=total, unit="step", dynamic_ncols=True)


class _PlainBar:
    """A one-line progress bar when tqdm is not installed."""

    def __init__(self, total: int) -> None:
        self.n, self.total, self._postfix = 0, total, ""

    def update(self, k: int) -> None:
        self.n += k
        width = 30
        done = int(width * self.n / max(1, self.total))
        sys.stdout.write(f"\r[{'#' * done}{'.' * (width - done)}] {self.n}/{self.total} {self._postfix}")
        sys.stdout.flush()

    def set_postfix(self, loss: str, refresh: bool = False) -> None:
        self._postfix = f"loss {loss}"

    def write(self, line: str) -> None:
        sys.stdout.write("\r" + " " * 80 + "\r" + line + "\n")
        self.update(0)

    def close(self) -> None:
        sys.stdout.write("\n")
