"""Faults end the job fast and say where they started; what must not drift, doesn't.

| case                                                             | expected                                  |
|------------------------------------------------------------------|-------------------------------------------|
| launcher report: ranks' errors arriving out of order              | the earliest failure first, with its       |
|                                                                  | traceback; later ones as "then, on rank"  |
| own launcher [2], an encoder raises in step 2 on rank 0          | exit 1; rank 0's traceback and error first, |
|                                                                  | "(in step 2)"; rank 1's error after        |
| own launcher [2], rank 1 SIGKILLed as step 2 starts               | exit 1; "rank 1 was killed by SIGKILL"     |
| own launcher [2], rank 1 raises while rank 0 is busy (no          | rank 1's error first; rank 0, ended by the |
| collective) when the launcher ends it                            | launcher, not named as "killed"            |
| torchrun [2], rank 0's preflight refuses the config               | every worker ends at once (SIGTERM), none  |
|                                                                  | SIGKILLed 30 s later                       |
| `train.timeout_s` [2]: rank 1 never joins a collective            | rank 0 fails with a timeout, not a hang    |
| `train.timeout_s` [3]: rank 2 never joins its mesh's dp group      | rank 1 fails after the same timeout        |
| a NaN image [2]                                                  | step skipped, one warning line on rank 0   |
| same seed twice                                                  | tests/test_trainer.py::test_resume_equals_uninterrupted and test_per_rank_loading_gives_the_same_batches compare losses with ``==`` across runs; here: two runs bit-identical |
| torch's storage use count (what `BufferPool` frees blocks by)    | still counts views and saved tensors       |
| `init_distributed("cuda")` (recorded, no GPU)                     | nccl, ``device_id=cuda:LOCAL_RANK``         |
| preflight: checkpoint.dir / export_hf / metrics.jsonl that cannot  | ConfigError naming the option, before any  |
| be written (under a file, a directory for a file)                 | process starts (not rank 0 at the 1st save) |
| state that must agree across ranks: see the table further down     |                                            |
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from dtensor_mimo.bridge.exchange import BufferPool, use_count_tracks_views
from dtensor_mimo.train import launch
from dtensor_mimo.train.config import parse_args
from tests.harness import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--train.steps", "3", "--data.batch_size", "8", "--pipeline.microbatches", "2",
        "--data.heldout_samples", "8", "--train.generate", "0", "--metrics.log_every", "1",
        "--lr_schedule.warmup_steps", "2", "--metrics.progress", "off", "--layout.audio.offset", "0",
        *[f"--options.{m}.compile=false" for m in ("vision", "audio", "language")]]


class _Queue:
    def __init__(self, items: list) -> None:
        self.items = list(items)

    def empty(self) -> bool:
        return not self.items

    def get(self):
        return self.items.pop(0)


def test_report_puts_the_first_failure_first(capsys) -> None:
    peer = "RuntimeError: Connection closed by peer (in step 3)"
    reports = [(105.0, 2, peer, "RuntimeError", "Traceback: rank 2's\n"),  # arrived first, failed later
               (100.0, 0, "ValueError: bad image (in step 3)", "ValueError", "Traceback: rank 0's\n"),
               (105.5, 1, peer, "RuntimeError", "Traceback: rank 1's\n")]
    launch._report(_Queue(reports), RuntimeError("process 2 exited"))
    err = capsys.readouterr().err.splitlines()
    assert err == ["Traceback: rank 0's", "error on rank 0: ValueError: bad image (in step 3)",
                   f"then, on ranks 1, 2 (+5.00 s): {peer}"]


def test_report_names_a_killed_rank_before_the_errors_it_caused(capsys) -> None:
    peer = "RuntimeError: Connection reset by peer (in step 2)"
    launch._report(_Queue([(7.0, 0, peer, "RuntimeError", "Traceback: rank 0's\n")]),
                   RuntimeError("process 0 exited"), killed=[(1, "SIGKILL")])
    err = capsys.readouterr().err
    assert err.index("error: rank 1 was killed by SIGKILL") < err.index(f"then, on rank 0 (+0.00 s): {peer}")
    assert "Traceback" not in err


def _launch(fault: str, tmp_path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.inject_faults", *TINY], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": REPO, "DTENSOR_MIMO_FAULT": fault, **env})


def test_own_launcher_shows_the_failing_ranks_error_first(tmp_path) -> None:
    pytest.importorskip("sklearn")
    out = _launch("encoder:2:0", tmp_path)
    assert out.returncode == 1
    err = out.stderr
    first = "error on rank 0: InjectedFault: DTENSOR_MIMO_FAULT: encoder forward of ModalityEncoder on rank 0 " \
            "(in step 2)"
    assert first in err, err[-3000:]
    assert err.index('trainer.py", line') < err.index(first)  # rank 0's own traceback, before its error
    assert "then, on rank 1" in err.split(first)[1]  # the peer's error, after it


@pytest.mark.parametrize("option, where, message", [
    ("--checkpoint.dir", "afile/ckpt", "checkpoint.dir = '{d}/afile/ckpt' cannot be created: '{d}/afile' is a file"),
    ("--checkpoint.dir", "afile", "checkpoint.dir = '{d}/afile' is a file; name a directory"),
    ("--checkpoint.export_hf", "afile/hf", "checkpoint.export_hf = '{d}/afile/hf' cannot be created"),
    ("--metrics.jsonl", "afile/m.jsonl", "metrics.jsonl = '{d}/afile/m.jsonl' cannot be created: '{d}/afile' is"),
    ("--metrics.jsonl", "adir", "metrics.jsonl = '{d}/adir' is a directory; name a file"),
])
def test_outputs_that_cannot_be_written_are_refused_before_the_run(tmp_path, option, where, message) -> None:
    """Rank 0 alone writes the run's outputs, after the world has formed: `checkpoint.dir` at the
    first save (with `checkpoint.every = 0` after the last step, the whole run lost), the JSONL
    when the trainer is built. Refused by the preflight, naming the option, before any process."""
    pytest.importorskip("sklearn")
    (tmp_path / "afile").write_text("")
    (tmp_path / "adir").mkdir()
    with pytest.raises(launch.ConfigError) as e:
        launch.preflight(parse_args([*TINY, option, str(tmp_path / where)]))
    assert message.format(d=tmp_path) in str(e.value)


def test_a_jsonl_in_a_new_directory_is_written(tmp_path) -> None:
    """A JSONL path whose directories do not exist yet (the preflight lets it pass, as it lets
    `checkpoint.dir`'s): the logger makes them, as the checkpoints' and TensorBoard's are made."""
    from dtensor_mimo.train.metrics import MetricsLogger

    path = tmp_path / "runs" / "one" / "m.jsonl"
    logger = MetricsLogger(True, 1, str(path), None, "off", out=io.StringIO())
    logger.log({"step": 1, "loss": 1.0}, "step 1")
    logger.close()
    assert json.loads(path.read_text()) == {"step": 1, "loss": 1.0}


def test_own_launcher_does_not_blame_a_rank_it_ended_itself(tmp_path) -> None:
    """Rank 1 fails while rank 0 works on its own (no collective: it cannot hear of the failure).
    The launcher ends rank 0 (SIGTERM, which a rank takes as a stop request, then SIGKILL): the
    cause shown is rank 1's error, not "rank 0 was killed by SIGKILL (out of memory?)". Rank 0 takes
    the SIGTERM as a stop request and stays busy: its SIGKILL comes after torch's grace, shortened
    from 30 s to 2 (`inject_faults.GRACE_ENV`: the same SIGTERM, then SIGKILL)."""
    pytest.importorskip("sklearn")
    out = _launch("data:2:1,busy:2:0", tmp_path, DTENSOR_MIMO_TEST_KILL_GRACE_S="2")
    assert out.returncode == 1
    err = out.stderr
    assert "error on rank 1: InjectedFault: DTENSOR_MIMO_FAULT: loading the batch on rank 1 (in step 2)" in err, \
        err[-3000:]
    assert "killed" not in err, err[-3000:]
    assert "forcefully exiting via SIGKILL" in err, err[-3000:]  # torch's log line: rank 0 was SIGKILLed


def test_a_preflight_error_under_torchrun_ends_every_worker_at_once(tmp_path) -> None:
    """Under torchrun rank 0 alone runs the preflight and exits with 2 before joining the world;
    torchrun then SIGTERMs the workers waiting in the rendezvous for it. They end at once (nothing
    is trained yet), not 30 s later by torchrun's SIGKILL after taking the SIGTERM as a stop."""
    pytest.importorskip("sklearn")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = subprocess.run([torchrun, "--standalone", "--nproc-per-node=2", "-m", "dtensor_mimo.train", *TINY,
                          "--checkpoint.load", str(tmp_path / "missing")], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode != 0
    assert f"config error: checkpoint.load: checkpoint '{tmp_path / 'missing'}': no such directory" in out.stderr
    assert "SIGKILL" not in out.stderr and "via 9" not in out.stderr, out.stderr[-3000:]


def test_own_launcher_names_a_killed_rank(tmp_path) -> None:
    pytest.importorskip("sklearn")
    out = _launch("kill:2:1", tmp_path)
    assert out.returncode == 1
    assert "error: rank 1 was killed by SIGKILL" in out.stderr, out.stderr[-3000:]


def _in_a_world_with_timeout(timeout_s: float, body):
    """``body()`` in a new world joined by `init_distributed` with `timeout_s` (through a store
    rank 0 binds first and holds, as the own launcher does: `LAUNCHER_STORE`), then the harness's
    world again (its timeout, its pool's store under a new key prefix) for the next test."""
    from dtensor_mimo.layout.world import LAUNCHER_STORE, hold_store, init_distributed, local_rank_env

    pool_port, rank, world = os.environ["MASTER_PORT"], dist.get_rank(), dist.get_world_size()
    store = hold_store(world) if rank == 0 else None
    port = [store.port if store is not None else None]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    local_rank_env(rank, world, port[0])
    init_distributed("cpu", timeout_s)
    try:
        return body()
    finally:
        dist.destroy_process_group()
        del os.environ[LAUNCHER_STORE]
        os.environ["MASTER_PORT"] = pool_port
        timeout = datetime.timedelta(seconds=120)
        pool = dist.TCPStore("127.0.0.1", int(pool_port), world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"after-{port[0]}", pool), rank=rank,
                                world_size=world, timeout=timeout)


def _wait_for(done: str, seconds: float) -> None:
    """Sleep until the file `done` exists (a peer got its error), at most `seconds`."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.05)


def _wait_for_a_peer_that_never_comes(timeout_s: float, done: str) -> str | None:
    """A world with `timeout_s` where rank 1 skips an all-reduce (it stays in the world until
    rank 0 has its error, file `done`): what rank 0's raises."""
    def body():
        if dist.get_rank() == 0:
            try:
                dist.all_reduce(torch.ones(1))
            except RuntimeError as e:
                return str(e)
            finally:
                open(done, "w").close()
        else:
            _wait_for(done, timeout_s + 60)
        return None

    return _in_a_world_with_timeout(timeout_s, body)


def _mesh_group_waits_for_a_peer(timeout_s: float, done: str) -> tuple[str | None, float]:
    """Vision on rank 0, language dp2 on ranks 1-2: rank 2 skips an all-reduce over language's
    dp group (a mesh subgroup, not the world): what rank 1's raises, and after how long."""
    from dtensor_mimo import MimoLayout, Parallelism

    def body():
        layout = MimoLayout({"vision": Parallelism(), "language": Parallelism(dp=2)})
        layout.init_meshes("cpu")
        rank, start = dist.get_rank(), time.monotonic()
        if rank == 1:
            try:
                dist.all_reduce(torch.ones(1), group=layout.mesh("language", "dp").get_group())
            except RuntimeError as e:
                return str(e), time.monotonic() - start
            finally:
                open(done, "w").close()
        elif rank == 2:
            _wait_for(done, timeout_s + 60)
        return None, 0.0

    return _in_a_world_with_timeout(timeout_s, body)


def test_timeout_s_ends_a_wait_for_a_peer(tmp_path) -> None:
    # 5 s: long enough that both ranks join the new world's store within it on a loaded machine
    message, _ = run_on_ranks(_wait_for_a_peer_that_never_comes, 2, 5.0, str(tmp_path / "done"), timeout=120)
    assert message is not None and "Timed out" in message and "5000ms" in message, message


def test_timeout_s_reaches_the_mesh_groups(tmp_path) -> None:
    _, (message, waited), _ = run_on_ranks(_mesh_group_waits_for_a_peer, 3, 5.0, str(tmp_path / "done"), timeout=120)
    assert message is not None and "Timed out" in message and "5000ms" in message, message
    assert waited < 30, waited  # torch's own default for a new group is 30 minutes


def _nan_step() -> tuple[list[bool], float, list[str]]:
    """A non-finite step first (AdamW's state is created, at zero), then one applied, then another
    non-finite one: each skipped changes no weight, moment, count or lr."""
    from dtensor_mimo import MimoModel, MimoOptimizer, Parallelism
    from dtensor_mimo.optim.step import train_step
    from tests.test_mimo import Case, _batches, _modules
    from tests.test_optimizer import BASE

    case = Case({"vision": Parallelism(), "language": Parallelism()}, offsets={"vision": 0, "language": 1})
    layout = case.layout()
    layout.init_meshes("cpu")
    llama, encoders = _modules(case.encoders)
    model = MimoModel(layout, llama, encoders)
    optimizer = MimoOptimizer(model, BASE)
    good = _batches(case.encoders, packed=False)[0]
    vision = good.modalities["vision"]
    inputs = vision.inputs.clone()
    inputs[0] = float("nan")
    bad = dataclasses.replace(good, modalities={**good.modalities,
                                                "vision": dataclasses.replace(vision, inputs=inputs)})
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("dtensor_mimo.optim.step")
    logger.addHandler(handler)
    skipped = []
    try:
        before = _weights(model)
        metrics = train_step(model, optimizer, bad)
        skipped.append(metrics.skipped)
        assert _unchanged(model, before) and optimizer.updates == 0
        now = _weights(model, optimizer)
        assert all(not now[k].any() for k in now.keys() - before.keys()), "a skipped first step's state is not zero"
        train_step(model, optimizer, good)
        before = _weights(model, optimizer)
        metrics = train_step(model, optimizer, bad)
        skipped.append(metrics.skipped)
        assert _unchanged(model, before, optimizer) and optimizer.updates == 1
    finally:
        logger.removeHandler(handler)
    return skipped, metrics.grad_norm, stream.getvalue().splitlines()


def test_a_skipped_non_finite_step_logs_one_warning() -> None:
    results = run_on_ranks(_nan_step, 2, timeout=120)
    for skipped, norm, _ in results:
        assert skipped == [True, True] and not math.isfinite(norm)
    assert [len(lines) for _, _, lines in results] == [2, 0]  # said once a step, by rank 0
    for updates, line in enumerate(results[0][2]):
        assert f"step skipped after {updates} update(s): the global gradient norm is nan" in line


def _losses(path) -> list[float]:
    with open(path) as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


def _train(argv: list[str]) -> float:
    from dtensor_mimo.train.trainer import Trainer

    return Trainer(parse_args(argv)).run()


def test_same_seed_gives_bit_identical_losses(tmp_path) -> None:
    pytest.importorskip("sklearn")
    for name in ("a", "b"):
        run_on_ranks(_train, 2, [*TINY, "--train.steps", "4", "--metrics.jsonl", str(tmp_path / f"{name}.jsonl")],
                     timeout=300)
    a, b = _losses(tmp_path / "a.jsonl"), _losses(tmp_path / "b.jsonl")
    assert len(a) == 4 and a == b


def test_buffer_pool_can_tell_a_free_block() -> None:
    assert use_count_tracks_views(), (
        "torch's storage use count (torch._C._storage_Use_Count) no longer counts views and saved "
        "tensors: BufferPool now hands out fresh tensors; find the new public or private spelling")
    pool = BufferPool(max_blocks=2)
    first = pool.take((4, 4), torch.float32, torch.device("cpu"))
    ptr = first.data_ptr()
    view = first[1:]
    del first
    kept = pool.take((4, 4), torch.float32, torch.device("cpu"))
    assert kept.data_ptr() != ptr  # a view of the first output is alive: its block is not reused
    del view
    again = pool.take((4, 4), torch.float32, torch.device("cpu"))
    assert again.data_ptr() == ptr  # now it is
    held = [pool.take((4, 4), torch.float32, torch.device("cpu")) for _ in range(5)]
    assert pool.blocks == 2 and len({t.data_ptr() for t in held}) == 5  # bounded; the rest fresh


def test_describe_reaches_through_a_blank_rewrap() -> None:
    """torch.distributed.pipelining re-raises a stage's error as a RuntimeError whose message starts blank."""
    try:
        try:
            raise ValueError("image 3 has 2 channels, the encoder expects 3")
        except ValueError as inner:
            raise RuntimeError("\n    failed to run forward:\n    args: ...") from inner
    except RuntimeError as e:
        e.add_note("in step 4")
        assert launch.describe(e) == ("RuntimeError from ValueError: image 3 has 2 channels, the encoder "
                                      "expects 3 (in step 4)")


def test_private_nccl_abort_we_rely_on_is_still_there() -> None:
    """`dtensor_mimo.layout.world.abort` calls torch's private `_abort_process_group` on NCCL
    (no public spelling in torch 2.13); CI has no GPU, so this pins the name on CPU."""
    import inspect

    import torch.distributed as dist

    fn = getattr(dist.distributed_c10d, "_abort_process_group", None)
    assert callable(fn), "torch.distributed.distributed_c10d._abort_process_group is gone: update abort()"
    assert list(inspect.signature(fn).parameters)[:1] == ["group"], inspect.signature(fn)


# ------------------------------------------------------------------ state that must agree across ranks
# | case (2 ranks)                                                | expected on every rank                  |
# |---------------------------------------------------------------|-----------------------------------------|
# | layout differs; MimoModel builds the meshes, or the user does  | "the layout differs" naming both, before |
# |                                                               | any group is built                      |
# | ParallelOptions / PipelineConfig / frozen set differ          | the same, naming that part              |
# | a batch differs at step 0 (unpipelined and pipelined)         | "fed different batches", before any      |
# |                                                               | exchange                                |
# | a batch differs (same sizes) at a later step                  | the same, weights unchanged             |
# | requires_grad_ after construction (frozen / unfrozen), on the | "requires_grad changed" on both ranks,   |
# | encoder's rank only                                           | weights unchanged; restored: trains on  |

DISJOINT = ({"vision": {"dp": 1}, "language": {"dp": 1}}, {"vision": 0, "language": 1})
COLOCATED = ({"vision": {"dp": 2}, "language": {"dp": 2}}, {"vision": 0, "language": 0})


def _attempt(build) -> str:
    try:
        build()
        return "built"
    except RuntimeError as e:
        return str(e)


def _construction_disagreements() -> dict[str, str]:
    from dtensor_mimo import MimoLayout, MimoModel, ParallelOptions, PipelineConfig
    from tests.test_mimo import _modules

    rank = dist.get_rank()
    out = {}
    modules, offsets = DISJOINT if rank == 0 else COLOCATED
    layout = MimoLayout(modules, offsets=offsets)
    llama, encs = _modules(("vision",))
    out["model builds meshes"] = _attempt(lambda: MimoModel(layout, llama, encs))
    out["user builds meshes"] = _attempt(lambda: layout.init_meshes("cpu"))
    layout = MimoLayout(DISJOINT[0], offsets=DISJOINT[1])
    layout.init_meshes("cpu")
    out["options"] = _attempt(lambda: MimoModel(layout, llama, encs,
                                                options={"language": ParallelOptions(fsdp=rank == 0)}))
    out["pipeline"] = _attempt(lambda: MimoModel(layout, llama, encs, pipeline=PipelineConfig(microbatches=1 + rank)))
    frozen = _modules(("vision",), frozen=("vision.encoder.patch",) if rank == 1 else ())
    out["frozen"] = _attempt(lambda: MimoModel(layout, *frozen))
    dist.barrier()  # the world is still usable: nothing hangs
    return out


def test_state_that_differs_at_construction_raises_on_every_rank() -> None:
    from dtensor_mimo import MimoLayout
    from dtensor_mimo.models import ViT
    from tests.test_mimo import VISION

    results = run_on_ranks(_construction_disagreements, 2, timeout=120)
    assert results[0] == results[1]  # every rank, the same message
    got = results[0]
    layouts = [repr(MimoLayout(m, offsets=o)) for m, o in (DISJOINT, COLOCATED)]
    want = (f"the layout differs between ranks: rank 0: {layouts[0]}; rank 1: {layouts[1]}. Every rank must "
            "build the same layout (the same config file and arguments on every rank)")
    assert got["model builds meshes"] == want and got["user builds meshes"] == want
    assert got["options"].startswith(
        "the ParallelOptions mapping differs between ranks: rank 0: {vision: ParallelOptions(), language: "
        "ParallelOptions()}; rank 1: {vision: ParallelOptions(), language: ParallelOptions(fsdp=False)}."), got
    assert got["pipeline"].startswith("the PipelineConfig differs between ranks: rank 0: PipelineConfig(); "
                                      "rank 1: PipelineConfig(microbatches=2)."), got
    patch = [n for n, _ in ViT(VISION).named_parameters() if n.startswith("patch")]
    assert got["frozen"].startswith(
        "the frozen parameter list differs between ranks: rank 0: {vision: [], language: []}; rank 1: "
        f"{{vision: {['encoder.' + n for n in patch]}, language: []}}."), got


def _model(modules: dict, offsets: dict, frozen: tuple[str, ...] = (), microbatches: int | None = None):
    from dtensor_mimo import MimoLayout, MimoModel, MimoOptimizer, PipelineConfig
    from tests.test_mimo import _modules
    from tests.test_optimizer import BASE

    llama, encs = _modules(("vision",), frozen=frozen)
    model = MimoModel(MimoLayout(modules, offsets=offsets), llama, encs,
                      pipeline=PipelineConfig(microbatches=microbatches) if microbatches else None)
    return model, MimoOptimizer(model, BASE)


def _weights(model, optimizer=None) -> dict[str, torch.Tensor]:
    """Every weight and, with `optimizer` (a `MimoOptimizer`), every AdamW state tensor: the
    moments and step counts a refused step must not change either (its update is queued, on the
    device, before the host knows it is refused)."""
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    for module, opt in (optimizer.optimizers.items() if optimizer is not None else ()):
        for i, state in enumerate(opt.state.values()):
            out.update({f"{module} state {i} {k}": v.detach().clone() for k, v in state.items()})
    return out


def _unchanged(model, before: dict[str, torch.Tensor], optimizer=None) -> bool:
    now = _weights(model, optimizer)
    return now.keys() == before.keys() and all(torch.equal(v, before[k]) for k, v in now.items())


def _different_batches(microbatches: int | None) -> list[str]:
    """Step 0: rank 1 passes another batch (other sizes); step 1: the same; step 2: one token
    id differs on rank 1 (same sizes, so the step runs); step 3: the same again."""
    from dtensor_mimo.optim.step import train_step
    from tests.test_mimo import _batches

    model, optimizer = _model(*COLOCATED if microbatches else DISJOINT, microbatches=microbatches)
    batches = _batches(("vision",), packed=False, batch_size=4)
    rank, out = dist.get_rank(), []
    before = _weights(model, optimizer)
    out.append(_attempt(lambda: train_step(model, optimizer, batches[rank])))
    assert _unchanged(model, before, optimizer)
    train_step(model, optimizer, batches[0])
    changed = dataclasses.replace(batches[0], tokens=batches[0].tokens.clone())
    changed.tokens[0, 1] += rank  # a text token: same sizes everywhere
    before = _weights(model, optimizer)
    out.append(_attempt(lambda: train_step(model, optimizer, changed)))
    assert _unchanged(model, before, optimizer)
    assert not train_step(model, optimizer, batches[0]).skipped
    return out


@pytest.mark.parametrize("microbatches", [None, 2])
def test_different_batches_raise_on_every_rank_before_the_step(microbatches) -> None:
    for messages in zip(*run_on_ranks(_different_batches, 2, microbatches, timeout=120)):
        for message in messages:
            assert message.startswith("the ranks were fed different batches in this step"), message
            assert message.endswith("every rank must pass the same global batch (the same data, seed and "
                                    "position); the step was not applied"), message


def _trainable_changed_after_construction(frozen_at_build: bool) -> list[str]:
    """Rank 0 (vision's) flips vision's patch embedding after the model was built."""
    from dtensor_mimo.optim.step import train_step
    from tests.test_mimo import _batches

    model, optimizer = _model(*DISJOINT, frozen=("vision.encoder.patch",) if frozen_at_build else ())
    batch = _batches(("vision",), packed=False, batch_size=4)[0]
    train_step(model, optimizer, batch)
    flipped = [p for n, p in model.named_parameters() if n.startswith("encoders.vision.encoder.patch")]
    assert bool(flipped) == (dist.get_rank() == 0)
    for p in flipped:
        p.requires_grad_(not p.requires_grad)
    before = _weights(model, optimizer)
    message = _attempt(lambda: train_step(model, optimizer, batch))
    assert _unchanged(model, before, optimizer)
    assert all(p.requires_grad == frozen_at_build and p.grad is None for p in flipped)  # as the user left them
    for p in flipped:  # back as built: the next step trains
        p.requires_grad_(not frozen_at_build)
    assert not train_step(model, optimizer, batch).skipped and not _unchanged(model, before, optimizer)
    return [message]


@pytest.mark.parametrize("frozen_at_build", [False, True])
def test_requires_grad_changed_after_construction_is_refused_on_every_rank(frozen_at_build: bool) -> None:
    (here,), (peer,) = run_on_ranks(_trainable_changed_after_construction, 2, frozen_at_build, timeout=120)
    what = "unfrozen" if frozen_at_build else "frozen"
    tail = ("the schedule (which gradients cross back to which encoder) is fixed at construction; freeze or "
            "unfreeze before building the MimoModel (and its MimoOptimizer). The step was not applied")
    assert here.startswith("requires_grad changed after the MimoModel was built, on 1 rank(s) (here: "
                           "encoders.vision.encoder.patch"), here
    assert f" {what}" in here and here.endswith(tail)
    assert peer == f"requires_grad changed after the MimoModel was built, on 1 rank(s): {tail}"


@pytest.mark.parametrize("device", ["nccl", "gpu", "cuda:0", "CPU"])
def test_init_distributed_refuses_a_device_it_does_not_know(monkeypatch, device: str) -> None:
    """Its device is "cpu" (gloo) or "cuda" (NCCL, docstring and README): another word (a backend's
    name, an indexed device) is refused naming it, before any process group, not joined on gloo."""
    from dtensor_mimo.layout import world as distributed

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    with pytest.raises(ValueError, match=rf"init_distributed: device={device!r} is not 'cpu' \(gloo\) or "
                                         r"'cuda' \(NCCL"):
        distributed.init_distributed(device, 42.0)
    assert calls == []


def test_init_distributed_binds_the_gpu_on_cuda(monkeypatch) -> None:
    """NCCL safety: the default group's communicator is created eagerly for this rank's GPU
    (``device_id``), so DeviceMesh splits its groups from it; checked on CPU by recording the call."""
    from dtensor_mimo.layout import world as distributed

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    distributed.init_distributed("cuda", 42.0)
    assert calls == [("set_device", 3), (("nccl",), {"timeout": datetime.timedelta(seconds=42),
                                                     "device_id": torch.device("cuda", 3)})]
    calls.clear()
    distributed.init_distributed("cpu", 42.0)
    assert calls == [(("gloo",), {"timeout": datetime.timedelta(seconds=42), "device_id": None})]
    # The own launcher's ranks: a client of the store it holds, the same rank and device binding.
    calls.clear()
    stores = []
    monkeypatch.setattr(dist, "TCPStore", lambda *args, **kwargs: stores.append((args, kwargs)) or "client")
    for name, value in {distributed.LAUNCHER_STORE: "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234",
                        "RANK": "2", "WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    distributed.init_distributed("cuda", 42.0)
    assert stores == [(("127.0.0.1", 1234, 4), {"is_master": False, "timeout": datetime.timedelta(seconds=42)})]
    assert calls == [("set_device", 3), (("nccl",), {"store": "client", "rank": 2, "world_size": 4,
                                                     "timeout": datetime.timedelta(seconds=42),
                                                     "device_id": torch.device("cuda", 3)})]


@pytest.mark.parametrize("timeout_s", ["600", None, 0, float("inf")])
def test_init_distributed_names_a_timeout_that_is_no_number_of_seconds(monkeypatch, timeout_s) -> None:
    """A timeout as a string (read from an environment variable) or None raised a TypeError from a
    comparison ("'<' not supported between instances of 'int' and 'str'") that named neither the
    argument nor the value; refused by name like a zero or infinite one, before any process group."""
    from dtensor_mimo.layout import world as distributed

    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    with pytest.raises(ValueError, match=re.escape(f"init_distributed: timeout_s={timeout_s!r}: give a positive, "
                                                   "finite number of seconds")):
        distributed.init_distributed("cpu", timeout_s)
    assert calls == []


# ------------------------------------------------------------------ the own launcher's end, its ranks scripted
# | ranks (each: `_scripted_rank`)                                  | expected                                |
# |----------------------------------------------------------------|-----------------------------------------|
# | one stops (exit 143) while its peer raises, either first        | exit 1 (a failure, not a requeueable     |
# |                                                                | stop); the peer's error shown            |
# | one stops while its peer is SIGKILLed (out of memory)           | exit 1; "rank 1 was killed by SIGKILL"   |
# | 4 ranks each raise with a long report (20,000 characters: > the | exit 1 within seconds, every rank's      |
# | report pipe's 64 KiB together)                                  | report read                              |

SCRIPT_ENV = "DTENSOR_MIMO_TEST_RANKS"


def _scripted_rank(rank: int, world: int, port: int, config, errors) -> None:
    """A rank of the own launcher (`launch._local_rank`, its error report and exit) whose run does
    what `SCRIPT_ENV` (comma-separated, one per rank, each ``WHAT@SECONDS``) says SECONDS after
    every rank has started:
    ``stop`` (returns a SIGTERM stop's status), ``error`` (raises; then file ``failed-RANK``),
    ``long`` (raises with a 20,000-character message, as one holding a tensor's repr), ``kill``
    (SIGKILLs itself), ``hang`` (works on its own for 600 s, deaf to SIGTERM)."""
    import signal as signals

    what, _, after = os.environ[SCRIPT_ENV].split(",")[rank].partition("@")
    ready = os.environ[SCRIPT_ENV + "_READY"]  # a directory: every rank started before any acts

    def run_rank(config, on_error=None) -> int:
        open(os.path.join(ready, str(rank)), "w").close()
        while len(os.listdir(ready)) < world:
            time.sleep(0.05)
        time.sleep(float(after or 0))
        if what == "stop":
            return 128 + signals.SIGTERM
        if what == "kill":
            os.kill(os.getpid(), signals.SIGKILL)
        if what == "hang":  # the stop signals stay blocked (the launcher starts its ranks so)
            time.sleep(600)
        try:
            if what == "long":
                raise RuntimeError(f"rank {rank} failed: " + "x" * 20000)
            raise RuntimeError(f"scripted failure on rank {rank}")
        except BaseException as e:
            if on_error is not None:
                on_error(e)
            open(os.path.join(ready, f"failed-{rank}"), "w").close()
            raise

    launch._run_rank = run_rank
    launch._local_rank(rank, world, port, config, errors)


LAUNCH_SCRIPTED = """
import os, sys, types
from dtensor_mimo.train import launch
from tests.test_faults import SCRIPT_ENV, TINY, _scripted_rank
launch.preflight = lambda config: None
world = len(os.environ[SCRIPT_ENV].split(","))
launch.build_layout = lambda config: types.SimpleNamespace(world_size=world)
launch._local_rank = _scripted_rank
sys.exit(launch.main(TINY))
"""


def _scripted_env(ranks: str, ready) -> dict[str, str]:
    os.makedirs(ready)
    return {**os.environ, "PYTHONPATH": REPO, SCRIPT_ENV: ranks, SCRIPT_ENV + "_READY": str(ready)}


def _launch_scripted(ranks: str, ready, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LAUNCH_SCRIPTED], capture_output=True, text=True, timeout=timeout,
                          env=_scripted_env(ranks, ready))


@pytest.mark.parametrize("ranks", ["stop,error@1", "stop@1,error"])  # the stop first, or the failure
def test_own_launcher_a_stop_beside_a_failure_is_a_failure(ranks: str, tmp_path) -> None:
    """A mixed end: one rank exits with a stop's status (143) while its peer fails. The status a
    scheduler sees must be a failure (1), not the stop's, which it would take for a preemption to
    requeue; the peer's error is shown."""
    out = _launch_scripted(ranks, tmp_path / "ready")
    assert out.returncode == 1, (out.returncode, out.stderr[-3000:])
    failing = ranks.split(",").index(next(r for r in ranks.split(",") if r.startswith("error")))
    assert f"error on rank {failing}: RuntimeError: scripted failure on rank {failing}" in out.stderr, \
        out.stderr[-3000:]


def test_own_launcher_a_stop_beside_a_killed_rank_is_a_failure(tmp_path) -> None:
    out = _launch_scripted("stop,kill@1", tmp_path / "ready")
    assert out.returncode == 1, (out.returncode, out.stderr[-3000:])
    assert "error: rank 1 was killed by SIGKILL" in out.stderr, out.stderr[-3000:]


def test_own_launcher_reads_reports_larger_than_the_pipe(tmp_path) -> None:
    """Each failing rank puts its report (message, traceback: up to 20,000 characters) on a pipe
    that the launcher read only once every rank had ended: with more than the pipe's 64 KiB in
    all, the last ranks blocked in their put, were SIGKILLed 30 s later, their reports lost (and
    one killed in the middle of its write left the launcher reading the rest forever)."""
    out = _launch_scripted("long,long,long,long", tmp_path / "ready", timeout=300)
    assert out.returncode == 1, (out.returncode, out.stderr[-3000:])
    for rank in range(4):
        assert f"rank {rank} failed: xxx" in out.stderr, out.stderr[-3000:]
    assert "SIGKILL" not in out.stderr and "killed" not in out.stderr, out.stderr[-3000:]


def test_own_launcher_a_second_signal_after_a_failure_is_still_a_failure(tmp_path) -> None:
    """Rank 0 fails while rank 1 works on its own (the launcher gives it 30 s after its SIGTERM);
    meanwhile Ctrl-C twice (or SIGUSR1 then the time limit's SIGTERM): the launcher SIGKILLs the
    ranks at the second. It exited with the signal's stop status (130: a scheduler requeues) and
    printed nothing of rank 0's error; the run had failed: 1, rank 0's error, rank 1 not blamed."""
    p = subprocess.Popen([sys.executable, "-c", LAUNCH_SCRIPTED], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=_scripted_env("error,hang", tmp_path / "ready"))
    try:
        _wait_for(str(tmp_path / "ready" / "failed-0"), 240)
        time.sleep(1.0)  # rank 0 out; the launcher waits out rank 1's grace
        p.send_signal(signal.SIGINT)
        time.sleep(2.5)  # a second signal (REPEAT_S = 2 s later)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1, (p.returncode, err[-3000:])
    assert "error on rank 0: RuntimeError: scripted failure on rank 0" in err, err[-3000:]
    assert "rank 1 was killed" not in err, err[-3000:]


def test_init_distributed_on_cuda_refuses_a_world_without_local_rank(monkeypatch) -> None:
    """RANK and WORLD_SIZE set by hand (no torchrun) without LOCAL_RANK: every rank of a node took
    GPU 0 (``LOCAL_RANK`` read as 0) without a word; refused by name before any process group (every
    rank of such a launch lacks it alike) where a rank sees several GPUs. One visible GPU a rank, or a
    world of one, keeps GPU 0."""
    from dtensor_mimo.layout import world as distributed

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(ValueError, match="device='cuda' in a world of 8 ranks without LOCAL_RANK: every rank of a "
                                         "node would take GPU 0; launch with torchrun"):
        distributed.init_distributed("cuda", 42.0)
    assert calls == []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one visible GPU a rank: GPU 0 is its own
    distributed.init_distributed("cuda", 42.0)
    assert calls[0] == ("set_device", 0)
    calls.clear()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("WORLD_SIZE", "1")
    distributed.init_distributed("cuda", 42.0)
    assert calls[0] == ("set_device", 0)


@pytest.mark.parametrize("env", [{"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "8"},
                                 {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "8"}, {"SLURM_PROCID": "2"}])
def test_srun_tasks_without_torchrun_are_refused(env, monkeypatch, capsys) -> None:
    """``srun -n 8 python -m dtensor_mimo.train`` (no torchrun: no RANK / WORLD_SIZE): each task
    started a whole world of its own, eight trainings of one job into one checkpoint directory;
    every task refuses (exit 2) naming torchrun, and starts nothing."""
    from dtensor_mimo.train import launch

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    started = []
    monkeypatch.setattr(launch, "parse_args", lambda argv: started.append(argv))
    assert launch.main(["--train.steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"config error: started as Slurm task {env['SLURM_PROCID']} of " in err
    assert "without torchrun's environment (RANK, WORLD_SIZE): each task would start a whole world" in err
    assert started == []


def test_a_single_slurm_task_runs_as_before(monkeypatch) -> None:
    """The batch script of an allocation (``sbatch``: task 0 of one) runs the own launcher as before."""
    from dtensor_mimo.train import launch

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")
    launch.refuse_srun_tasks()
