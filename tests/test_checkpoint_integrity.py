"""Checkpoints are verified: a damaged newest one is skipped for the previous, never loaded.

| case (ranks)                                              | expected                                          |
|-----------------------------------------------------------|---------------------------------------------------|
| save [2]                                                  | manifest.json: every other file, its size and the |
|                                                           | zlib.crc32 of its bytes                           |
| newest truncated / a byte flipped / a shard deleted /      | `choose_checkpoint` takes the previous one on      |
| .metadata deleted / manifest garbled [2]                  | every rank, its warning names the file            |
| `load` of a damaged checkpoint [2]                        | CheckpointError naming the file, on every rank     |
| a saving process SIGKILLed at random times, 10 trials [1] | the newest verified checkpoint is at least the    |
|                                                           | last one announced, and reads back its own step   |
| trainer, newest shard truncated [2]                       | warning line; resumes from the previous; losses   |
|                                                           | of the steps after == the uninterrupted run's     |
| trainer, `checkpoint.load DIR` [2]                        | each file checksummed once, by one rank (its      |
|                                                           | share), not every file by rank 0 while peers wait |
| `resolve_load` of a directory, newest byte-flipped [2]    | the previous one, warning naming the file; the    |
|                                                           | newest named itself: kept (load refuses it); it   |
|                                                           | without .metadata: "is damaged", names the parent |
| `checkpoint.dir` rank 0 cannot create (under a file) [2]  | CheckpointError naming it on every rank, no wait  |
| rank 1 cannot read its share while the manifest is written | CheckpointError naming rank 1 and the file on     |
| [2]                                                       | every rank, nothing renamed into place            |
| two background saves, the parameters changed while each  | each reads back the values of its step (the       |
| is written, its writer held back [2]                      | first == a synchronous save's); both verify;      |
|                                                           | `writing()` while held                            |
| background save whose rank 1 cannot checksum its share [2] | `finish` raises CheckpointError naming rank 1 on  |
|                                                           | every rank; the previous checkpoint stays newest  |
| trainer, rank 1's writer of step 3 held until step 4 ran  | both finish it at step 5 (the vote), no hang      |
| [2]                                                       |                                                   |
| trainer raising in step 5, step 3's save held on every    | step-000003 complete, verified and logged after   |
| rank [2]                                                  | the error (`Trainer.saved` on both)               |
| `load` into an optimizer that trained the vision tower,   | the tower's AdamW state is fresh (step 0, zero    |
| of a checkpoint saved with it frozen (a rollback) [1]     | moments) and the next step's weights those of an  |
|                                                           | optimizer built anew                              |
| `load` after more random draws than the save saw [2]      | each rank's host generator as it was saved (the   |
|                                                           | draws after the load == the draws after the save) |
| a user's encoder with BatchNorm and a table of its own    | buffers of the save's step, and the eval loss and |
| (non-persistent), saved at step 2, loaded into a fresh    | buffers after two more steps, == the uninterrupted|
| model [2]; and into vision dp2 on ranks 0-1               | run's; the table is not in the checkpoint; dp2:   |
|                                                           | both replicas hold the saved buffers              |
| the same checkpoint without its buffers (an earlier       | a warning naming them, the model's own values     |
| release's) [2]                                            | kept; into a meta-built model: refused by name    |
| `load` into a meta-built model before `init_weights` [2]  | CheckpointError naming its non-persistent buffer, |
|                                                           | on every rank, before DCP's collectives         |
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dtensor_mimo.train import checkpoint
from dtensor_mimo.train.checkpoint import MANIFEST, CheckpointError
from dtensor_mimo.train.config import parse_args
from tests.harness import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Model:
    """What `checkpoint.save` and `load` read of a MimoModel: module names, their parameters and
    buffers (none), that no module is left uninitialized, and which one is the language model."""

    uninitialized: set = set()
    language_name = "language"

    def __init__(self, numel: int) -> None:
        torch.manual_seed(0)
        self.params = {"vision": {"w": torch.nn.Parameter(torch.randn(numel))},
                       "language": {"w": torch.nn.Parameter(torch.randn(numel // 2)),
                                    "b": torch.nn.Parameter(torch.randn(7))}}
        self.module_names = list(self.params)
        self.device = torch.device("cpu")

    def module_parameters(self, name: str) -> dict[str, torch.nn.Parameter]:
        return self.params[name]

    def module_buffers(self, name: str) -> dict[str, torch.Tensor]:
        return {}


class _Optimizer:
    """What `checkpoint.save` reads of a MimoOptimizer: one torch optimizer per module."""

    def __init__(self, model: _Model) -> None:
        self.optimizers = {n: torch.optim.AdamW(ps.values()) for n, ps in model.params.items()}
        self.updates = 0

    def set_updates(self, updates: int) -> None:
        self.updates = updates


def _save(directory: str, steps: list[int], numel: int = 4096) -> None:
    model = _Model(numel)
    optimizer = _Optimizer(model)
    for step in steps:
        checkpoint.save(directory, step, model, optimizer, {"step": step}, keep=2)


def _save_and_list(directory: str) -> dict[str, list[int]]:
    _save(directory, [1])
    path = checkpoint.checkpoint_path(directory, 1)
    with open(os.path.join(path, MANIFEST)) as f:
        return json.load(f)["files"]


def test_manifest_lists_every_file_with_size_and_crc(tmp_path) -> None:
    manifests = run_on_ranks(_save_and_list, 2, str(tmp_path), timeout=120)
    assert manifests[0] == manifests[1]
    path = tmp_path / "step-000001"
    names = sorted(os.listdir(path))
    assert sorted(manifests[0]) == [n for n in names if n != MANIFEST]
    assert ".metadata" in names and sum(n.endswith(".distcp") for n in names) == 2  # one file per rank
    for name, (size, crc) in manifests[0].items():
        data = (path / name).read_bytes()
        assert (size, crc) == (len(data), zlib.crc32(data)), name


def _truncate(path: str) -> str:
    name = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[-1]
    with open(os.path.join(path, name), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(path, name)) // 2)
    return name


def _flip(path: str) -> str:
    # the first shard: index 1 of the manifest's sorted files (after .metadata), rank 1's share of
    # the checksums, so the verdict must travel from a non-zero rank
    name = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[0]
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    return name


def _delete(name: str):
    def damage(path: str) -> str:
        name_ = name if name != "shard" else sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[0]
        os.remove(os.path.join(path, name_))
        return name_
    return damage


def _garble(path: str) -> str:
    with open(os.path.join(path, MANIFEST), "w") as f:
        f.write("{not json")
    return MANIFEST


DAMAGE = {"truncated": _truncate, "flipped": _flip, "shard deleted": _delete("shard"),
          "no metadata": _delete(".metadata"), "manifest garbled": _garble}


def _choose(directory: str, damage: str) -> tuple:
    _save(directory, [1, 2])
    damaged = None
    if dist.get_rank() == 0:
        damaged = DAMAGE[damage](checkpoint.checkpoint_path(directory, 2))
    dist.barrier()
    path, warnings = checkpoint.choose_checkpoint(directory)
    try:
        _model = _Model(4096)
        shapes = {f"model.{m}.{n}": tuple(p.shape) for m, ps in _model.params.items() for n, p in ps.items()}
        checkpoint.load(checkpoint.checkpoint_path(directory, 2), _model, _Optimizer(_model), shapes)
        refused = None
    except CheckpointError as e:
        refused = str(e)
    return damaged, path, warnings, refused


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_newest_checkpoint_is_skipped_for_the_previous(tmp_path, damage) -> None:
    results = run_on_ranks(_choose, 2, str(tmp_path), damage, timeout=120)
    damaged = results[0][0]
    for _, path, warnings, refused in results:
        assert path == checkpoint.checkpoint_path(str(tmp_path), 1)
        assert len(warnings) == 1 and "step-000002" in warnings[0] and damaged in warnings[0], warnings
        assert refused is not None and damaged in refused, refused
    assert results[0][1:] == results[1][1:]  # the same verdict on every rank


SAVER = """
import os, sys, traceback
import torch.distributed as dist
sys.path.insert(0, {repo!r})
from tests.test_checkpoint_integrity import _Model, _Optimizer
from dtensor_mimo.train import checkpoint

# A warm server: torch is imported once; each trial (a line on stdin) is a forked child that
# saves in a loop until the test SIGKILLs it. Only numpy's BLAS pool (which handles fork) has
# started a thread by then; no process group, no torch intra-op pool.
directory = sys.argv[1]
for trial in map(str.strip, sys.stdin):
    pid = os.fork()
    if pid == 0:
        try:
            print(f"child {{os.getpid()}}", flush=True)
            dist.init_process_group("gloo", init_method="file://" + os.path.join(directory, "..", "store-" + trial),
                                    rank=0, world_size=1)
            model = _Model(1 << 20)
            optimizer = _Optimizer(model)
            latest = checkpoint.latest_checkpoint(directory)
            step = int(latest.rsplit("-", 1)[1]) if latest else 0
            while True:
                step += 1
                checkpoint.save(directory, step, model, optimizer, {{"step": step}}, keep=2)
                print(f"saved {{step}}", flush=True)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    print(f"ended {{os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1}}", flush=True)
"""


SAVER_LINE_S = 120.0
"""How long the test waits for each line of the saver server (a save of a 4 MiB model takes well
under a second): a saver stuck before its next line fails the trial with what it said so far
instead of blocking the test until pytest's 600 s timeout."""


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_kill_during_save_never_loses_the_previous_checkpoint(tmp_path) -> None:
    import queue

    script = tmp_path / "saver.py"
    script.write_text(SAVER.format(repo=REPO))
    directory = tmp_path / "ckpt"
    directory.mkdir()
    rng = random.Random(21)
    announced = 0
    # its own session: the finally below kills the server and any child it forked at once
    server = subprocess.Popen([sys.executable, str(script), str(directory)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    said: queue.Queue[str] = queue.Queue()

    def listen() -> None:  # every line the server says, then "" at its end
        for line in iter(server.stdout.readline, ""):
            said.put(line)
        said.put("")

    threading.Thread(target=listen, daemon=True).start()
    heard: list[str] = []

    def readline(trial: int) -> str:
        try:
            heard.append(said.get(timeout=SAVER_LINE_S))
        except queue.Empty:
            raise AssertionError(f"trial {trial}: the saver said nothing for {SAVER_LINE_S:.0f} s after "
                                 f"{heard[-5:]}") from None
        return heard[-1]

    trial: int | None = 0
    try:
        for trial in range(10):
            server.stdin.write(f"{trial}\n")
            server.stdin.flush()
            child = int(readline(trial).split()[1])
            first = readline(trial)  # warm: one save behind it
            assert first.startswith("saved"), f"trial {trial}: the saver said {first!r} (its error is above)"
            time.sleep(rng.uniform(0.0, 0.6))
            os.kill(child, signal.SIGKILL)
            lines = [first]
            while not (line := readline(trial)).startswith("ended"):
                assert line, "the saver server exited"
                lines.append(line)
            assert line.split() == ["ended", str(int(signal.SIGKILL))], f"trial {trial}: the saver {line!r}"
            announced = max([announced, *(int(line.split()[1]) for line in lines)])
            latest = checkpoint.latest_checkpoint(str(directory))
            assert latest is not None, f"trial {trial}: no checkpoint left ({sorted(os.listdir(directory))})"
            assert checkpoint.verify(latest) == [], trial
            step = int(latest.rsplit("-", 1)[1])
            assert step >= announced, (trial, step, announced)
            state = {"trainer": ""}
            dcp.load(state, checkpoint_id=latest)  # no process group here: DCP reads it alone
            assert json.loads(state["trainer"]) == {"step": step, "updates": 0}
        trial = None
    finally:
        server.stdin.close()
        try:
            if trial is None:  # every trial ended: the server ends at the end of its input
                server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:  # a failed trial: the server and its saver, which may still be saving or stuck
                os.killpg(server.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            server.wait()


TINY = ["--train.steps", "8", "--data.batch_size", "8", "--pipeline.microbatches", "2",
        "--data.heldout_samples", "8", "--train.generate", "0", "--metrics.log_every", "1",
        "--lr_schedule.warmup_steps", "2", "--metrics.progress", "off", "--layout.audio.offset", "0",
        "--checkpoint.every", "2",
        *[f"--options.{m}.compile=false" for m in ("vision", "audio", "language")]]


def _train(argv: list[str]) -> float:
    from dtensor_mimo.train.trainer import Trainer

    return Trainer(parse_args(argv)).run()


def _losses(path) -> dict[int, float]:
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def test_trainer_resumes_from_the_previous_checkpoint_when_the_newest_is_truncated(tmp_path) -> None:
    pytest.importorskip("sklearn")
    ckpt = tmp_path / "ckpt"
    run_on_ranks(_train, 2, [*TINY, "--train.steps", "6", "--checkpoint.dir", str(ckpt),
                             "--metrics.jsonl", str(tmp_path / "ref.jsonl")], timeout=300)
    assert sorted(os.listdir(ckpt)) == ["step-000004", "step-000006"]
    name = _truncate(str(ckpt / "step-000006"))
    out = subprocess.run([sys.executable, "-m", "dtensor_mimo.train", *TINY, "--train.steps", "6",
                          "--checkpoint.dir", str(ckpt), "--metrics.jsonl", str(tmp_path / "m.jsonl")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr[-3000:]
    warning = next(line for line in out.stdout.splitlines() if line.startswith("warning:"))
    assert "step-000006" in warning and name in warning and "bytes, the manifest says" in warning
    assert f"resumed from {ckpt / 'step-000004'} at step 4" in out.stdout
    reference, got = _losses(tmp_path / "ref.jsonl"), _losses(tmp_path / "m.jsonl")
    assert sorted(got) == [5, 6]
    assert [got[s] for s in (5, 6)] == [reference[s] for s in (5, 6)]


def _resolve(directory: str) -> tuple:
    _save(directory, [1, 2])
    newest, previous = (checkpoint.checkpoint_path(directory, s) for s in (2, 1))
    flipped = None
    if dist.get_rank() == 0:
        flipped = _flip(newest)  # same size: only a checksum tells
    dist.barrier()
    warnings: list[str] = []
    chosen = checkpoint.resolve_load(directory, warnings.append)
    named = checkpoint.resolve_load(newest)  # named itself: never swapped (load refuses it)
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(os.path.join(newest, ".metadata"))
    dist.barrier()
    try:
        checkpoint.resolve_load(newest)
        lost = None
    except CheckpointError as e:
        lost = str(e)
    return flipped, chosen == previous, warnings, named == newest, lost


def test_load_of_a_directory_takes_the_newest_that_verifies_and_a_named_one_is_never_swapped(tmp_path) -> None:
    """`checkpoint.load DIR` chooses as a resume from `checkpoint.dir` does (checksums included)."""
    (flipped, *first), second = run_on_ranks(_resolve, 2, str(tmp_path), timeout=120)
    newest = checkpoint.checkpoint_path(str(tmp_path), 2)
    for took_previous, warnings, named_kept, lost in (first, second[1:]):
        assert took_previous and named_kept
        assert warnings == [f"skipped checkpoint {newest}: {os.path.join(newest, flipped)} has another checksum "
                            "than the manifest's (corrupt)"]
        assert lost == (f"checkpoint {newest!r} is damaged: {os.path.join(newest, '.metadata')} is missing (DCP's "
                        f"index of the checkpoint); name the directory that holds it ({str(tmp_path)!r}) to load "
                        "the newest complete checkpoint instead")


def _manifest_with_a_failing_rank(directory: str) -> tuple[str | None, float]:
    """Rank 1 cannot read one file of its share while the manifest is written."""
    import errno

    real = checkpoint._entries
    if dist.get_rank() == 1:
        def failing(directory_, names):
            raise OSError(errno.EIO, "Input/output error", os.path.join(directory_, names[0]))
        checkpoint._entries = failing
    start = time.monotonic()
    try:
        _save(directory, [1])
        return None, time.monotonic() - start
    except CheckpointError as e:
        return str(e), time.monotonic() - start
    finally:
        checkpoint._entries = real


def test_a_rank_failing_while_the_manifest_is_written_fails_every_rank(tmp_path) -> None:
    results = run_on_ranks(_manifest_with_a_failing_rank, 2, str(tmp_path), timeout=120)
    tmp = os.path.join(str(tmp_path), ".step-000001.tmp")
    shard = sorted(n for n in os.listdir(tmp) if n != MANIFEST)[1]  # rank 1's share: every other file
    for message, seconds in results:
        assert message == (f"writing the manifest of {tmp}: rank 1 could not checksum {os.path.join(tmp, shard)}: "
                           "Input/output error"), message
        assert seconds < 30
    assert checkpoint.step_checkpoints(str(tmp_path)) == []  # nothing renamed into place


def _save_where_rank_0_cannot(directory: str) -> tuple[str, float]:
    start = time.monotonic()
    try:
        _save(directory, [1])
        return "saved", time.monotonic() - start
    except Exception as e:  # noqa: BLE001 - what each rank got
        return f"{type(e).__name__}: {e}", time.monotonic() - start


def test_a_directory_rank_0_cannot_create_fails_every_rank(tmp_path) -> None:
    """Rank 0 creates the checkpoint's directories; its failure used to be its own (the others
    waited in the barrier after it until the group's timeout): now every rank raises, naming it."""
    (tmp_path / "afile").write_text("")
    directory = str(tmp_path / "afile" / "ckpt")
    results = run_on_ranks(_save_where_rank_0_cannot, 2, directory, timeout=60)
    for message, seconds in results:
        assert message.startswith(f"CheckpointError: saving the checkpoint of step 1 in {directory}: rank 0 could "
                                  f"not create {os.path.join(directory, '.step-000001.tmp')}: "), message
        assert "Not a directory" in message and seconds < 30, message


def _choose_where_rank_0_cannot_list(directory: str) -> str:
    def unreadable(_directory: str) -> list[str]:
        raise PermissionError(13, "Permission denied")

    listed = checkpoint.step_checkpoints
    if dist.get_rank() == 0:
        checkpoint.step_checkpoints = unreadable  # (this rank's process only, while this test runs)
    try:
        checkpoint.choose_checkpoint(directory)
        return "chosen"
    except CheckpointError as e:
        return str(e)
    finally:
        checkpoint.step_checkpoints = listed


def test_a_checkpoint_directory_rank_0_cannot_list_fails_every_rank(tmp_path) -> None:
    results = run_on_ranks(_choose_where_rank_0_cannot_list, 2, str(tmp_path), timeout=60)
    assert results == [f"cannot list the checkpoints of {tmp_path}: Permission denied"] * 2


def _read(path: str, model: _Model) -> dict[str, torch.Tensor]:
    state = {f"model.{m}.{n}": torch.zeros_like(p) for m, ps in model.params.items() for n, p in ps.items()}
    dcp.load(state, checkpoint_id=path)
    return state


def _background(directory: str) -> tuple:
    """Steps 1 and 2 saved in the background, each while the parameters change (step 1 also
    synchronously beside it); then step 3 with rank 1 unable to read a file of its manifest share."""
    import errno

    model = _Model(4096)
    optimizer = _Optimizer(model)

    def values() -> dict[str, torch.Tensor]:
        return {f"model.{m}.{n}": p.detach().clone() for m, ps in model.params.items() for n, p in ps.items()}

    def change() -> None:
        with torch.no_grad():
            for ps in model.params.values():
                for p in ps.values():
                    p.add_(1.0)

    sync = checkpoint.save(os.path.join(directory, "sync"), 1, model, optimizer, {"step": 1}, keep=2)
    saves = checkpoint.BackgroundSaves()
    paths, same, first, running = [], [], values(), []
    gate, real_write = threading.Event(), checkpoint._write

    def gated(*args, **kwargs):
        gate.wait(60)
        return real_write(*args, **kwargs)

    buffers = []
    for step in (1, 2):  # the second copies into the first's host buffers
        before = values()
        checkpoint._write = gated
        try:
            started = saves.start(os.path.join(directory, "async"), step, model, optimizer, {"step": step}, keep=2)
            change()
            running.append(saves.writing())  # the writer waits for the gate: start returned before it
            gate.set()
            paths.append(saves.finish())
        finally:
            checkpoint._write = real_write
            gate.clear()
        buffers.append({k: v.data_ptr() for k, v in saves._host.items() if isinstance(v, torch.Tensor)})
        got = _read(paths[-1], model)
        same.append(started == paths[-1] and all(torch.equal(got[k], before[k]) for k in before))
    reference = _read(sync, model)
    same.append(all(torch.equal(reference[k], first[k]) for k in reference))
    real = checkpoint._entries
    if dist.get_rank() == 1:
        def failing(directory_, names):
            raise OSError(errno.EIO, "Input/output error", os.path.join(directory_, names[0]))
        checkpoint._entries = failing
    try:
        saves.start(os.path.join(directory, "async"), 3, model, optimizer, {"step": 3}, keep=2)
        error = None
        saves.finish()
    except CheckpointError as e:
        error = str(e)
    finally:
        checkpoint._entries = real
    return same + running + [buffers[0] == buffers[1]], [checkpoint.verify(p) for p in paths], error, saves.writing()


def test_background_save_writes_its_step_while_training_changes_it(tmp_path) -> None:
    results = run_on_ranks(_background, 2, str(tmp_path), timeout=120)
    directory = tmp_path / "async"
    tmp = str(directory / ".step-000003.tmp")
    for same, problems, error, writing in results:
        assert same == [True] * 6 and problems == [[], []] and not writing
        assert error is not None and error.startswith(
            f"writing {directory / 'step-000003'} in the background: writing the manifest of {tmp}: "
            f"rank 1 could not checksum {tmp}{os.sep}"), error
    assert checkpoint.step_checkpoints(str(directory)) == [str(directory / f"step-00000{s}") for s in (2, 1)]


def _held_writer(argv: list[str], fail_at: int) -> tuple:
    """The trainer with rank 1's writer of step 3's save held back. ``fail_at`` 0: held after its
    last collective until step 4 has run (rank 0's writer has ended by then: the ranks' own
    verdicts differ in step 4), then released and waited for, so step 5's all-reduce says no
    writer runs. ``fail_at`` 5: held before its first collective (every rank's save pending)
    until every rank raises as step 5 starts. Returns (the error, `Trainer.saved`)."""
    from dtensor_mimo.train.trainer import Trainer

    real_write, real_step = checkpoint._write, Trainer._run_step
    held, release, first = threading.Event(), threading.Event(), [dist.get_rank() == 1]

    def late(*args, **kwargs):
        hold, first[0] = first[0], False
        if hold and fail_at:
            release.wait(60)
        out = real_write(*args, **kwargs)
        if hold and not fail_at:
            held.set()
            release.wait(60)
        return out

    def stepped(self, *args, **kwargs):
        step = self.step + 1
        if step == fail_at:
            release.set()
            raise RuntimeError(f"injected in step {step}")
        if step == 4 and not fail_at:
            if dist.get_rank() == 1:
                held.wait(60)
            else:
                self.background._pending[0].result(60)
        out = real_step(self, *args, **kwargs)
        if step == 4 and not fail_at and dist.get_rank() == 1:
            release.set()
            self.background._pending[0].result(60)
        return out

    checkpoint._write, Trainer._run_step = late, stepped
    trainer = None
    try:
        trainer = Trainer(parse_args(argv))
        trainer.run()
        error = None
    except RuntimeError as e:
        error = str(e)
    finally:
        checkpoint._write, Trainer._run_step = real_write, real_step
        release.set()
    return error, trainer.saved if trainer is not None else None


def _saved_records(path) -> list[tuple[int, int]]:
    with open(path) as f:
        return [(r["checkpoint_step"], r["step"]) for r in map(json.loads, f) if "checkpoint" in r]


def test_background_saves_finish_at_one_step_on_every_rank_and_complete_on_an_error(tmp_path) -> None:
    """Rank 1's writer of step 3's save ends after rank 0's: both finish the save at step 5,
    whose all-reduce says no writer runs (a rank finishing on its own verdict would all-gather
    in step 4 while its peer trains: a hang). Then a run raising in step 5 with step 3's save
    pending on every rank: it completes before the ranks end, logged as any save (that run in
    ``async_with_pinned_mem``, which on CPU pins nothing: the mode reaches `BackgroundSaves`)."""
    pytest.importorskip("sklearn")
    argv = [*TINY, "--train.steps", "9", "--checkpoint.every", "3", "--checkpoint.async_mode", "async"]
    ckpt = tmp_path / "a"
    results = run_on_ranks(_held_writer, 2, [*argv, "--checkpoint.dir", str(ckpt), "--metrics.jsonl",
                                             str(tmp_path / "a.jsonl")], 0, timeout=240)
    assert results == [(None, str(ckpt / "step-000009"))] * 2
    saved = _saved_records(tmp_path / "a.jsonl")
    assert saved[0] == (3, 5) and [s for s, _ in saved] == [3, 6, 9] and saved[-1] == (9, 9), saved
    ckpt = tmp_path / "b"
    pinned = [a if a != "async" else "async_with_pinned_mem" for a in argv]
    results = run_on_ranks(_held_writer, 2, [*pinned, "--checkpoint.dir", str(ckpt), "--metrics.jsonl",
                                             str(tmp_path / "b.jsonl")], 5, timeout=240)
    assert results == [("injected in step 5", str(ckpt / "step-000003"))] * 2
    assert _saved_records(tmp_path / "b.jsonl") == [(3, 4)]
    assert checkpoint.step_checkpoints(str(ckpt)) == [str(ckpt / "step-000003")]
    assert checkpoint.verify(str(ckpt / "step-000003")) == []


def _staged_from_a_gpu_mesh() -> tuple:
    """`BackgroundSaves._stage` of a DTensor whose mesh is a GPU's (the mesh's device type
    patched: this machine has none): the staged shard must be a host tensor, first save and
    reused, holding the values."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    value = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    saves = checkpoint.BackgroundSaves(pin=True)
    real = DeviceMesh.device_type
    DeviceMesh.device_type = property(lambda self: "cuda")
    try:
        out = []
        for _ in range(2):  # allocated, then reused
            staged = saves._stage({"w": value})["w"]
            local = staged.to_local()
            out.append((type(staged) is DTensor, local.device.type, torch.equal(local, value.to_local()),
                        staged.placements == value.placements))
            value.to_local().add_(1.0)
    finally:
        DeviceMesh.device_type = real
    return out


def test_a_gpu_mesh_shard_is_staged_in_host_memory() -> None:
    """A DTensor built by `from_local` on a GPU mesh would move the host buffer to the GPU (a
    second copy of the state in device memory, read by the writing thread): staging keeps it on
    the host."""
    assert run_on_ranks(_staged_from_a_gpu_mesh, 1, timeout=60) == [[(True, "cpu", True, True)] * 2]


# ---------------------------------------------------------------------------- fresh state, device RNG


@pytest.mark.parametrize("fused", [True, False])
def test_a_fresh_adamw_step_count_is_the_one_adamw_creates(fused: bool) -> None:
    """The state a resume creates before DCP fills it (`_fresh_step`): AdamW's own first step's
    count, dtype and device, and for a fused group on the parameter's device (a meta parameter
    here; on a GPU, where the fused kernel reads it), not on the host."""
    param = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([param], fused=fused)
    param.grad = torch.ones(3)
    opt.step()
    want, got = opt.state[param]["step"], checkpoint._fresh_step(param, fused)
    assert (got.dtype, got.device, got.shape, float(got)) == (want.dtype, want.device, want.shape, 0.0)
    meta = torch.nn.Parameter(torch.empty(3, device="meta"))
    assert checkpoint._fresh_step(meta, fused).device.type == ("meta" if fused else "cpu")


def test_an_accelerator_random_state_is_saved_and_put_back(monkeypatch) -> None:
    """On an accelerator the device generator's state is saved beside the host's (dropout on the
    device would otherwise draw other numbers after a resume), and put back."""
    states = {"cuda": torch.tensor([1, 2, 3], dtype=torch.uint8)}

    class Device:  # what `torch.get_device_module` gives for the device's type
        @staticmethod
        def get_rng_state(device):
            return states["cuda"].clone()

        @staticmethod
        def set_rng_state(state, device):
            states["cuda"] = state.clone()

    monkeypatch.setattr(checkpoint.dist, "get_rank", lambda: 3)
    monkeypatch.setattr(torch, "get_device_module", lambda device: Device)
    saved = checkpoint._rng_states(torch.device("cuda", 0))
    assert sorted(saved) == ["rng.3", "rng.cuda.3"] and saved["rng.cuda.3"].tolist() == [1, 2, 3]
    assert sorted(checkpoint._rng_states(torch.device("cpu"))) == ["rng.3"]
    states["cuda"] = torch.tensor([9, 9, 9], dtype=torch.uint8)
    torch.manual_seed(123)
    checkpoint._set_rng_states(saved, torch.device("cuda", 0))
    assert states["cuda"].tolist() == [1, 2, 3] and torch.equal(torch.get_rng_state(), saved["rng.3"])


def test_verify_returns_what_it_cannot_read_instead_of_raising(tmp_path, monkeypatch) -> None:
    """`verify` runs on each rank before the verdicts are pooled in a collective: a malformed
    manifest or a file that cannot be read is a problem it returns (every rank then skips the
    checkpoint together), not an error one rank raises while its peers wait."""
    run_on_ranks(_save, 1, str(tmp_path), [1], timeout=120)
    path = checkpoint.checkpoint_path(str(tmp_path), 1)

    def unreadable(file):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(checkpoint, "file_crc32", unreadable)
    problems = checkpoint.verify(path)
    assert problems and all("cannot be read ([Errno 5] Input/output error)" in p for p in problems), problems
    monkeypatch.undo()
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    manifest["files"] = {name: "big" for name in manifest["files"]}
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(manifest, f)
    (problem,) = checkpoint.verify(path)
    assert problem.startswith(f"{os.path.join(path, MANIFEST)} is malformed (ValueError"), problem
    for content in ([], None, "files"):  # not an object at all
        with open(os.path.join(path, MANIFEST), "w") as f:
            json.dump(content, f)
        (problem,) = checkpoint.verify(path)
        assert problem.startswith(f"{os.path.join(path, MANIFEST)} is malformed (TypeError"), (content, problem)


def _save_past_a_newer_one(directory: str) -> list[str]:
    _save(directory, [1, 2])
    if dist.get_rank() == 0:
        os.makedirs(os.path.join(directory, "step-000009"))  # newer, damaged: resumed past
    dist.barrier()
    _save(directory, [3])
    return sorted(os.listdir(directory))


def test_keep_counts_the_checkpoints_up_to_the_step_saved(tmp_path) -> None:
    """keep = 2 after resuming past a newer damaged checkpoint: saving step 3 keeps steps 2 and 3
    (the damaged step 9 neither counts as one of the two nor is deleted)."""
    (names,) = run_on_ranks(_save_past_a_newer_one, 1, str(tmp_path), timeout=120)
    assert names == ["step-000002", "step-000003", "step-000009"]


def _save_past_a_newer_corrupt_one(directory: str) -> tuple[list[str], str | None]:
    _save(directory, [1, 2, 9])  # keep = 2: steps 2 and 9 stay
    if dist.get_rank() == 0:
        _flip(checkpoint.checkpoint_path(directory, 9))  # every file of its size: only its checksum is wrong
    dist.barrier()
    resumed, _ = checkpoint.choose_checkpoint(directory)
    _save(directory, [3])
    return sorted(os.listdir(directory)), resumed


def test_keep_does_not_count_a_newer_checkpoint_whose_checksum_is_wrong(tmp_path) -> None:
    """keep = 2 after resuming past a newer checkpoint that fails only its checksum (a bit flipped,
    every file of its size): the resumed run starts at step 2, and saving step 3 keeps steps 2 and
    3. The newer step 9, complete to a size check, is not one of the two (counting it deleted step
    2, the only good checkpoint but the new save) and is not deleted either."""
    ((names, resumed),) = run_on_ranks(_save_past_a_newer_corrupt_one, 1, str(tmp_path), timeout=120)
    assert resumed == checkpoint.checkpoint_path(str(tmp_path), 2)
    assert names == ["step-000002", "step-000003", "step-000009"]


def _save_past_an_older_damaged_one(directory: str) -> tuple[list[str], list[str]]:
    _save(directory, [1, 2])
    if dist.get_rank() == 0:
        _truncate(checkpoint.checkpoint_path(directory, 2))  # the run resumes from step 1, past it
    dist.barrier()
    _save(directory, [3])
    names = sorted(os.listdir(directory))
    return names, [n for n in names if checkpoint.verify(os.path.join(directory, n))]


def test_keep_counts_only_complete_checkpoints(tmp_path) -> None:
    """keep = 2, step 2's checkpoint damaged (a shard cut short) and the run resumed from step 1:
    saving step 3 keeps steps 1 and 3, the two newest good ones; the damaged step 2 is not one of
    the two (counting it deleted step 1, the only good one but the new save)."""
    ((names, damaged),) = run_on_ranks(_save_past_an_older_damaged_one, 1, str(tmp_path), timeout=120)
    assert damaged == []
    assert names == ["step-000001", "step-000003"]


def _restore_counting_checksums(argv: list[str]) -> tuple[int, int]:
    """A trainer's `restore` of ``checkpoint.load``: the files this rank checksummed, the step it
    resumed at."""
    from dtensor_mimo.train.trainer import Trainer

    trainer = Trainer(parse_args(argv))
    real, reads = checkpoint.file_crc32, []
    checkpoint.file_crc32 = lambda path: reads.append(path) or real(path)
    try:
        trainer.restore()
    finally:
        checkpoint.file_crc32 = real
    return len(reads), trainer.step


def test_load_of_a_directory_checksums_each_file_once_over_the_ranks(tmp_path) -> None:
    """`checkpoint.load DIR` chooses as a resume from `checkpoint.dir` does, each rank checksumming
    its share of the files (`choose_checkpoint`): rank 0 reading every byte of the checkpoint alone
    (then its share again in `load`) kept every peer waiting in a broadcast bounded by
    `train.timeout_s`, a wait that grows with the checkpoint, not with a rank's share of it."""
    pytest.importorskip("sklearn")
    saved = tmp_path / "saved"
    run_on_ranks(_train, 2, [*TINY, "--train.steps", "2", "--checkpoint.dir", str(saved)], timeout=300)
    with open(saved / "step-000002" / MANIFEST) as f:
        files = len(json.load(f)["files"])
    # (TINY's checkpoint.every, which saves nothing without checkpoint.dir, back at its default)
    results = run_on_ranks(_restore_counting_checksums, 2, [*TINY, "--checkpoint.every", "0", "--checkpoint.load",
                                                            str(saved)], timeout=300)
    reads = [r[0] for r in results]
    assert [r[1] for r in results] == [2, 2]  # both resumed from step 2
    assert sum(reads) == files and max(reads) == -(-files // 2), (reads, files)


def test_a_pruned_checkpoint_cut_short_is_never_chosen(tmp_path, monkeypatch) -> None:
    """Pruning that stops part way (here: after the manifest went, as a kill could leave it)
    leaves no ``step-N`` that has lost its manifest but kept DCP's metadata: such a directory
    would pass for a complete checkpoint of an old, manifest-less kind."""
    old = tmp_path / "step-000001"
    old.mkdir()
    (old / ".metadata").write_text("")
    (old / MANIFEST).write_text("{}")
    (old / "__0_0.distcp").write_text("x")

    def cut_short(path, ignore_errors=False):
        manifest = os.path.join(path, MANIFEST)
        if os.path.exists(manifest):
            os.remove(manifest)
        raise OSError("killed")

    monkeypatch.setattr(checkpoint.shutil, "rmtree", cut_short)
    with pytest.raises(OSError, match="killed"):
        checkpoint._discard(str(old))
    assert checkpoint.step_checkpoints(str(tmp_path)) == []
    assert checkpoint.latest_checkpoint(str(tmp_path)) is None


# ---------------------------------------------------------------------------- a load into a used optimizer


def _rollback_to_a_frozen_tower(root: str) -> dict[str, object]:
    """A checkpoint saved while the vision tower was frozen (no AdamW state of its own), loaded
    into a model and optimizer that trained it for two steps since (a rollback), and into ones
    built anew: the tower's AdamW state after each load, and the weights after one more step."""
    from dtensor_mimo import MimoModel, MimoOptimizer, train_step
    from tests.test_mimo import OPT, P, _batches, _modules

    batches = _batches(("vision",), False, 4, (64, 64, 64, 64))

    def build(frozen: tuple[str, ...]) -> tuple[MimoModel, MimoOptimizer]:
        from dtensor_mimo import MimoLayout

        layout = MimoLayout({"vision": P(), "language": P()}, offsets={"vision": 0, "language": 0})
        layout.init_meshes("cpu")
        model = MimoModel(layout, *_modules(("vision",), frozen))
        return model, MimoOptimizer(model, OPT)

    model, optimizer = build(("vision.encoder",))
    train_step(model, optimizer, batches[0])
    # (no "updates" given: the checkpoint records the optimizer's own count)
    path = checkpoint.save(os.path.join(root, "ckpt"), 1, model, optimizer, {"step": 1}, keep=1)
    language, encoders = _modules(("vision",))
    shapes = checkpoint.expected_shapes({**encoders, "language": language})
    used, used_optimizer = build(())
    for batch in batches[1:3]:
        train_step(used, used_optimizer, batch)
    fresh, fresh_optimizer = build(())
    out: dict[str, object] = {}
    for name, (m, o) in {"used": (used, used_optimizer), "fresh": (fresh, fresh_optimizer)}.items():
        out[f"{name} trainer"] = checkpoint.load(path, m, o, shapes)
        out[f"{name} updates"] = o.updates
        tower = {n: p for n, p in m.module_parameters("vision").items() if n.startswith("encoder.")}
        states = [o.optimizers["vision"].state[p] for p in tower.values()]
        out[f"{name} state"] = sorted({(float(s["step"]), float(s["exp_avg"].abs().max()),
                                        float(s["exp_avg_sq"].abs().max())) for s in states})
        train_step(m, o, batches[3])
        out[f"{name} weights"] = {n: p.detach().clone() for n, p in tower.items()}
    return out


def test_a_load_gives_the_parameters_the_checkpoint_has_no_adamw_state_for_a_fresh_one(tmp_path) -> None:
    """`load` into an optimizer that already stepped (rolling back a run): a parameter the
    checkpoint holds no AdamW state for (it was frozen when saved) starts from AdamW's fresh state
    (step 0, zero moments), as in an optimizer built anew, not from the abandoned run's state."""
    (out,) = run_on_ranks(_rollback_to_a_frozen_tower, 1, str(tmp_path), timeout=180)
    assert out["fresh trainer"] == {"step": 1, "updates": 1} and out["fresh updates"] == out["used updates"] == 1
    assert out["fresh state"] == [(0.0, 0.0, 0.0)]
    assert out["used state"] == [(0.0, 0.0, 0.0)], out["used state"]
    for n, w in out["fresh weights"].items():
        assert torch.equal(out["used weights"][n], w), n


def _random_draws_around_a_load(root: str) -> tuple[list[float], list[float]]:
    """Each rank's host generator seeded on its own, a checkpoint saved, the draws right after the
    save; then more draws (training that goes on), a load of that checkpoint, and the draws after it."""
    from dtensor_mimo import MimoLayout, MimoModel, MimoOptimizer, train_step
    from tests.test_mimo import OPT, P, _batches, _modules

    layout = MimoLayout({"vision": P(dp=2), "language": P(dp=2)}, offsets={"vision": 0, "language": 0})
    layout.init_meshes("cpu")
    encoders_and_language = _modules(("vision",))
    model = MimoModel(layout, *encoders_and_language)
    optimizer = MimoOptimizer(model, OPT)
    train_step(model, optimizer, _batches(("vision",), False, 4, (64,))[0])
    torch.manual_seed(100 + dist.get_rank())
    path = checkpoint.save(os.path.join(root, "ckpt"), 1, model, optimizer, {"step": 1}, keep=1)
    after_save = torch.rand(6).tolist()
    torch.rand(100)  # the run goes on, then rolls back to the checkpoint
    language, encoders = encoders_and_language
    checkpoint.load(path, model, optimizer, checkpoint.expected_shapes({**encoders, "language": language}))
    return after_save, torch.rand(6).tolist()


def test_a_load_puts_back_each_ranks_random_state(tmp_path) -> None:
    """`load` puts back the host generator of each rank as it was saved (dropout in a user's
    module draws the same numbers after a resume as in the run that saved): the draws after the
    load are those right after the save, on each rank its own."""
    per_rank = run_on_ranks(_random_draws_around_a_load, 2, str(tmp_path), timeout=180)
    for after_save, after_load in per_rank:
        assert after_load == after_save
    assert per_rank[0][0] != per_rank[1][0]  # each rank's own state, not one for all


class _LoadableModel(_Model):
    """`_Model` with what `checkpoint.load` calls besides."""

    def reshard(self) -> None:
        pass

    def refresh_fp8_scales(self) -> None:
        pass


def _resume_after_skipped_steps(directory: str) -> tuple[dict, int]:
    """Step 5 saved after 3 applied updates (two steps skipped for a non-finite norm: the
    schedule does not advance on those); loaded into a fresh optimizer."""
    model = _LoadableModel(64)
    optimizer = _Optimizer(model)
    optimizer.updates = 3
    path = checkpoint.save(directory, 5, model, optimizer, {"step": 5}, keep=1)
    shapes = {f"model.{m}.{n}": tuple(p.shape) for m, ps in model.params.items() for n, p in ps.items()}
    fresh_model = _LoadableModel(64)
    fresh = _Optimizer(fresh_model)
    trainer = checkpoint.load(path, fresh_model, fresh, shapes)
    return trainer, fresh.updates


def test_a_load_puts_the_schedule_at_the_updates_applied_not_the_step(tmp_path) -> None:
    """The learning-rate schedule resumes at the updates applied before the save (3), not at the
    step (5): steps skipped for a non-finite norm do not move it, before the save or after."""
    ((trainer, updates),) = run_on_ranks(_resume_after_skipped_steps, 1, str(tmp_path), timeout=120)
    assert trainer == {"step": 5, "updates": 3}
    assert updates == 3


# ---------------------------------------------------------------------------- a module's buffers


class _PatchNorm(torch.nn.Module):
    """A user's own encoder with buffers: `PatchMLP`'s patches through a BatchNorm (running
    statistics, persistent) and a per-channel scale table of its own (non-persistent, rebuilt by
    its ``init_weights``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.out_dim = dim
        self.patch_in = torch.nn.Linear(3 * 4 * 4, 64)
        self.norm = torch.nn.BatchNorm1d(64)
        self.patch_out = torch.nn.Linear(64, dim)
        self.register_buffer("table", self._table(), persistent=False)

    @staticmethod
    def _table() -> torch.Tensor:
        return torch.linspace(0.5, 1.5, 64)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        patches = images.unfold(2, 4, 4).unfold(3, 4, 4)  # [N, 3, 4, 4, 4, 4]
        x = patches.permute(0, 2, 3, 1, 4, 5).flatten(3).flatten(1, 2).flatten(0, 1)  # [N * 16, 48]
        return self.patch_out(torch.nn.functional.gelu(self.norm(self.patch_in(x)) * self.table))

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        from dtensor_mimo.models import init_weights

        init_weights(self, seed)
        self.norm.weight.fill_(1.0)
        self.norm.reset_running_stats()
        self.table.copy_(self._table())


def _norm_model(meta: bool = False, dp: int = 1):
    """vision (`_PatchNorm`) on rank 0, language on rank 1: the buffers are on rank 0 only
    (`dp` = 2: both modules dp2 on ranks 0-1, the buffers on both)."""
    from dtensor_mimo import MimoLayout, MimoModel, MimoOptimizer
    from tests.test_mimo import LLAMA, OPT, P, _modules

    layout = MimoLayout({"vision": P(dp=dp), "language": P(dp=dp)}, offsets={"vision": 0, "language": 2 - dp})
    layout.init_meshes("cpu")
    language, _ = _modules((), meta=meta)
    with torch.device("meta" if meta else "cpu"):
        vision = _PatchNorm(LLAMA.dim)
    if not meta:
        vision.init_weights(10)
    modules = {"vision": vision, "language": language}
    model = MimoModel(layout, language, {"vision": vision})
    return model, MimoOptimizer(model, OPT), checkpoint.expected_shapes(modules)


def _buffers(model) -> dict[str, torch.Tensor]:
    """This rank's BatchNorm statistics of the vision encoder, read off the user's module."""
    held = dict(model.encoders["vision"].norm.named_buffers()) if "vision" in model.encoders else {}
    return {f"norm.{n}": b.detach().clone() for n, b in held.items()}


def _eval_loss(model, batch) -> float:
    model.eval()
    try:
        return model.predict(batch, with_loss=True)[1]
    finally:
        model.train()


def _resume_with_buffers(root: str) -> dict[str, object]:
    """Trained 2 steps and saved, then 2 more (the uninterrupted run); a fresh model loads the
    checkpoint and trains the same 2 steps: the buffers and eval losses of both runs."""
    from dtensor_mimo import train_step
    from tests.test_mimo import _batches

    batches = _batches(("vision",), False, 4, (64,) * 5)
    model, optimizer, shapes = _norm_model()
    for batch in batches[:2]:
        train_step(model, optimizer, batch)
    path = checkpoint.save(os.path.join(root, "ckpt"), 2, model, optimizer, {"step": 2}, keep=1)
    out: dict[str, object] = {"saved": _buffers(model), "saved eval": _eval_loss(model, batches[4])}
    out["keys"] = sorted(k for k in dcp.FileSystemReader(path).read_metadata().state_dict_metadata
                         if k.startswith("buffer."))
    for name, m, o in [("uninterrupted", model, optimizer), ("resumed", *_norm_model()[:2])]:
        if name == "resumed":
            out["fresh"] = _buffers(m)
            checkpoint.load(path, m, o, shapes)
            out["loaded"] = _buffers(m)
            out["loaded eval"] = _eval_loss(m, batches[4])
        out[f"{name} losses"] = [train_step(m, o, b).loss for b in batches[2:4]]
        out[f"{name} buffers"] = _buffers(m)
        out[f"{name} eval"] = _eval_loss(m, batches[4])
    other, other_optimizer, _ = _norm_model(dp=2)  # another layout: every replica reads them
    checkpoint.load(path, other, other_optimizer, shapes)
    out["dp2 loaded"] = _buffers(other)
    return out


def test_a_resume_restores_a_modules_persistent_buffers(tmp_path) -> None:
    """A user's encoder with a BatchNorm: its running statistics and `num_batches_tracked` are in
    the checkpoint (not its non-persistent table); a fresh model that loads it holds the save's
    buffers, evaluates as the saving model did, and after two more steps has the buffers and eval
    loss of the uninterrupted run."""
    rank0, rank1 = run_on_ranks(_resume_with_buffers, 2, str(tmp_path), timeout=300)
    assert rank1["saved"] == {} and rank1["loaded"] == {}  # rank 1 holds no vision buffer
    saved, loaded = rank0["saved"], rank0["loaded"]
    assert int(saved["norm.num_batches_tracked"]) == 2
    assert sorted(saved) == ["norm.num_batches_tracked", "norm.running_mean", "norm.running_var"]
    assert not torch.equal(rank0["fresh"]["norm.running_mean"], saved["norm.running_mean"])
    for n, b in saved.items():
        assert torch.equal(loaded[n], b), n
        assert torch.equal(rank0["dp2 loaded"][n], b) and torch.equal(rank1["dp2 loaded"][n], b), n
    for rank in (rank0, rank1):
        assert rank["loaded eval"] == rank["saved eval"]
        assert rank["resumed losses"] == rank["uninterrupted losses"]
        assert rank["resumed eval"] == rank["uninterrupted eval"]
    for n, b in rank0["uninterrupted buffers"].items():
        assert torch.equal(rank0["resumed buffers"][n], b), n
    assert rank0["keys"] == rank1["keys"] == ["buffer.vision.norm.num_batches_tracked",
                                              "buffer.vision.norm.running_mean", "buffer.vision.norm.running_var"]


def _load_without_buffers(root: str) -> dict[str, object]:
    """A checkpoint as an earlier release wrote it (no ``buffer.`` keys) loaded into a model
    whose buffers were set apart, and into a meta-built one not initialized."""
    from dtensor_mimo import train_step
    from tests.test_mimo import _batches

    model, optimizer, shapes = _norm_model()
    train_step(model, optimizer, _batches(("vision",), False, 4, (64,))[0])
    state = {k: v for k, v in checkpoint._state(model, optimizer, {"step": 1}).items() if not k.startswith("buffer.")}
    directory = os.path.join(root, "old")
    path = checkpoint._write(state, directory, 1, checkpoint._prepare(directory, 1), keep=1)
    fresh, fresh_optimizer, _ = _norm_model()
    with torch.no_grad():
        for b in fresh.module_buffers("vision").values():
            b.fill_(3)
    said: list[str] = []
    checkpoint.load(path, fresh, fresh_optimizer, shapes, warn=said.append)
    out: dict[str, object] = {"said": said, "kept": {n: b.unique().tolist() for n, b in _buffers(fresh).items()},
                              "weights": [n for n, p in model.module_parameters("vision").items()
                                          if not torch.equal(p, fresh.module_parameters("vision")[n])]}
    meta, meta_optimizer, _ = _norm_model(meta=True)
    meta.init_weights({"vision": 10, "language": 0})
    meta.uninitialized.add("vision")  # as if built and never initialized, its table rebuilt: only the stats lack
    meta.buffer_names["vision"] = (meta.buffer_names["vision"][0], ())
    try:
        checkpoint.load(path, meta, meta_optimizer, shapes, warn=said.append)
        out["meta"] = None
    except CheckpointError as e:
        out["meta"] = str(e)
    return out


def test_a_checkpoint_without_buffers_keeps_the_models_with_a_warning(tmp_path) -> None:
    """A checkpoint saved before checkpoints held buffers still loads: the parameters come from
    it, the buffers keep the model's values, and one warning line names them; into a meta-built
    model whose buffers nothing initialized it is refused on every rank, naming them."""
    for out in run_on_ranks(_load_without_buffers, 2, str(tmp_path), timeout=300):
        (said,) = out["said"]
        assert "\n" not in said
        for n in ("buffer.vision.norm.num_batches_tracked", "buffer.vision.norm.running_mean",
                  "buffer.vision.norm.running_var"):
            assert n in said and n in out["meta"], (n, said, out["meta"])
        assert "model.init_weights" in out["meta"]
        assert out["weights"] == []
        assert all(v == [3] for v in out["kept"].values()), out["kept"]


def _load_into_meta(root: str) -> dict[str, object]:
    from dtensor_mimo import train_step
    from tests.test_mimo import _batches

    batches = _batches(("vision",), False, 4, (64, 64))
    model, optimizer, shapes = _norm_model()
    train_step(model, optimizer, batches[0])
    path = checkpoint.save(os.path.join(root, "ckpt"), 1, model, optimizer, {"step": 1}, keep=1)
    meta, meta_optimizer, _ = _norm_model(meta=True)
    out: dict[str, object] = {}
    try:
        checkpoint.load(path, meta, meta_optimizer, shapes)
        out["error"] = None
    except CheckpointError as e:
        out["error"] = str(e)
    meta.init_weights({"vision": 0, "language": 0})
    checkpoint.load(path, meta, meta_optimizer, shapes)  # then it loads
    out["losses"] = [train_step(m, o, batches[1]).loss for m, o in ((model, optimizer), (meta, meta_optimizer))]
    return out


def test_a_load_into_a_meta_built_model_before_init_weights_names_its_non_persistent_buffers(tmp_path) -> None:
    """`load` into a meta-built model before `init_weights`: the encoder's non-persistent table
    (no checkpoint holds it) would stay uninitialized memory while the model counts as
    initialized; refused on every rank naming it. After `init_weights` the load goes through
    and the next step is the saving model's."""
    for out in run_on_ranks(_load_into_meta, 2, str(tmp_path), timeout=300):
        assert out["error"] is not None and "vision.table" in out["error"] and "init_weights" in out["error"]
        saved, loaded = out["losses"]
        assert loaded == saved
