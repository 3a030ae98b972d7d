"""What ``python -m dtensor_mimo.train [--config FILE.toml] [--section.key VALUE ...]`` runs.

Without a launcher it starts the layout's world of local ranks itself (gloo on CPU; one process
per rank); under ``torchrun`` it joins the given world (NCCL with ``--train.device cuda``) and
checks that the layout fits it. The config is parsed and checked before any process starts.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from typing import Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtensor_mimo.train.config import ConfigError, TrainerConfig, build_layout, check_config, help_text, parse_args


def preflight(config: TrainerConfig) -> None:
    """What can be checked from files before any process starts: Hugging Face directories and
    their architectures, the tokenizer and its chat template, processors, the data files (every
    sample's placeholders against its items, every media file's existence, lengths when
    data.seq_len is 0), the batch against the data, and `checkpoint.load`. Raises ConfigError."""
    from dtensor_mimo.train import checkpoint
    from dtensor_mimo.train.datasets import train_data
    from dtensor_mimo.train.modules import resolve

    data = train_data(config, resolve(config))
    for dataset in (data.train, data.heldout):  # every sample's length against seq_len, now
        check = getattr(dataset, "check_lengths", None)
        if check is not None:
            try:
                check()
            except ValueError as e:
                raise ConfigError(str(e)) from None
    if len(data.train) < config.data.batch_size:
        raise ConfigError(f"data.batch_size = {config.data.batch_size} is more than the {len(data.train)} training "
                          f"rows of {config.data.path} (samples, or packed rows with data.pack)")
    if config.checkpoint.load and not (config.checkpoint.dir and checkpoint.latest_checkpoint(config.checkpoint.dir)):
        try:
            checkpoint.resolve_load(config.checkpoint.load)
        except checkpoint.CheckpointError as e:
            raise ConfigError(f"checkpoint.load: {e}") from None


def _run_rank(config: TrainerConfig) -> float | None:
    from dtensor_mimo.train.trainer import Trainer

    device = config.train.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0)))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        accuracy = Trainer(config).run()
        # Every rank done with every group before any tears its connections down (a peer still
        # in its last collective could otherwise see the connection close under it).
        dist.barrier()
        return accuracy
    finally:
        dist.destroy_process_group()


USER_ERRORS = ("ConfigError", "DataError", "BatchError", "CheckpointError", "PlanError", "LayoutError")
"""Errors whose message says what to fix: shown without a traceback."""


def _local_rank(rank: int, world: int, port: int, config: TrainerConfig, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        _run_rank(config)
    except BaseException as e:  # noqa: BLE001 — reported to the launcher, which prints it once
        # Bounded: a put larger than the pipe's buffer would block until the launcher reads,
        # which it does only once every rank has ended.
        errors.put((rank, f"{type(e).__name__}: {e}"[:4000], type(e).__name__, traceback.format_exc()[-16000:]))
        sys.exit(1)


def _report(errors, failure: Exception) -> None:
    """What the ranks reported, once per distinct error (ranks named), or how a rank died."""
    reports = []
    while not errors.empty():
        reports.append(errors.get())
    if not reports:
        print(f"error: {failure}", file=sys.stderr)
        return
    by_message: dict[str, list] = {}
    for report in sorted(reports):
        by_message.setdefault(report[1], []).append(report)
    for message, same in by_message.items():
        ranks = ", ".join(str(r[0]) for r in same)
        if same[0][2] not in USER_ERRORS:
            print(same[0][3].rstrip(), file=sys.stderr)
        print(f"error on rank{'s' if len(same) > 1 else ''} {ranks}: {message}", file=sys.stderr)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    launched = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    try:
        config = parse_args(argv)
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
        _run_rank(config)
        return 0
    world = build_layout(config).world_size
    if config.train.device == "cuda" and world > torch.cuda.device_count():
        print(f"config error: the layout needs {world} ranks but this machine has "
              f"{torch.cuda.device_count()} GPUs; use torchrun across machines or train.device = 'cpu'",
              file=sys.stderr)
        return 2
    errors = mp.get_context("spawn").SimpleQueue()
    try:
        mp.start_processes(_local_rank, args=(world, _free_port(), config, errors), nprocs=world,
                           start_method="spawn")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        _report(errors, e)
        return 1
    return 0
