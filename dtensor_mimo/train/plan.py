"""``python -m dtensor_mimo.plan``: the layout planner on the trainer's config, and ``--layout.auto``.

    python -m dtensor_mimo.plan [--config FILE.toml] [--world N] [--top K] [--json OUT]
                                [--cache FILE] [--remeasure] [--section.key VALUE ...]

Reads the same model and data config as the trainer (the digits job without ``--config``; any
``--section.key VALUE`` override the trainer takes), measures what it needs on this machine (each
module's blocks forward and backward at a few batch sizes, the data loading, AdamW, a gloo link
and a collective with ``--world`` local processes, the runtime's own cost per microbatch and per
step from two short real runs on 2 ranks, what a collective costs under load from a real run of the
homogeneous layout on ``--world`` ranks; cached under ``~/.cache/dtensor_mimo/`` by a hash of the
model, the data and the machine, or in ``--cache FILE``), searches the layouts of ``--world`` ranks (default:
the configured layout's) and prints them ranked by predicted step time, with tokens/s, peak memory
per rank and each module's idle fraction, the homogeneous layout (every module on every rank,
dp = world) as a last row. ``--json OUT`` writes the ranked list; each entry's ``layout`` and
``microbatches`` are trainer overrides (`overrides_of`).

Why this file is in the trainer's package: the command reads the trainer's config
(`TrainerConfig`, `parse_args`), modules (`build_modules`) and data (`train_data`), which live in
`train`, and the trainer's ``--layout.auto`` runs it; the planner itself (`dtensor_mimo.plan`) sits
below `train` and never imports it. ``python -m dtensor_mimo.train plan ...`` runs `main` here;
``python -m dtensor_mimo.plan ...`` starts that command (a process, not an import).

Each module is measured after the library's one `parallelize` with its ``options.<module>``
(activation checkpointing, mixed precision) but uncompiled (``compile`` is not applied to the timed
blocks), on no mesh, with one intra-op thread per rank as the trainer runs by default; FSDP2's and
tensor parallel's per-call cost through the same `parallelize` on a one-rank mesh; the runtime's
cost from real runs of the trainer (the executor).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from dtensor_mimo.layout import Parallelism
from dtensor_mimo.layout.parallelism import FIELDS
from dtensor_mimo.plan import (Affine, DeviceProfile, Job, Link, ModuleProfile, Prediction,
                               entry, homogeneous, predict, search, table, validate, write_json)
from dtensor_mimo.plan.candidate import Candidate
from dtensor_mimo.plan.search import InvalidCandidate, canonical
from dtensor_mimo.train.config import (LANGUAGE, ConfigError, ModuleLayout, TrainerConfig, build_layout,
                                       check_config, parse_args)

USAGE = ("usage: python -m dtensor_mimo.plan (or: python -m dtensor_mimo.train plan) [--config FILE.toml] "
         "[--world N] [--top K] [--json OUT] [--cache FILE] [--remeasure] [--section.key VALUE ...]")


# ---------------------------------------------------------------------------- profiles


def _description(config: TrainerConfig) -> dict[str, Any]:
    """What the measurements depend on (the cache key)."""
    d = config.data
    return {"model": dataclasses.asdict(config.model),
            "data": {k: getattr(d, k, None) for k in ("format", "path", "seq_len", "pack", "batch_size", "max_images",
                                                     "max_tones", "truncate")},
            "options": {n: {k: str(v) for k, v in dataclasses.asdict(config.module_options(n)).items()}
                        for n in config.module_names},
            "pipeline": {"schedule": config.pipeline.schedule, "virtual_stages": config.pipeline.virtual_stages},
            # a profile of fewer fields (an older library's) is measured again, not read with defaults
            "profile_fields": sorted(f.name for f in dataclasses.fields(ModuleProfile))}


def measure_profiles(config: TrainerConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure every module, the data, AdamW and a gloo link on this machine (a JSON-ready dict:
    ``{"job": Job.to_dict(), "device": DeviceProfile.to_dict()}``)."""
    import time

    import torch

    from dtensor_mimo.plan import measure
    from dtensor_mimo.train.datasets import train_data
    from dtensor_mimo.train.modules import build_modules, refuse_nothing_trains, resolve

    torch.set_num_threads(max(1, config.train.threads))
    torch.manual_seed(0)
    resolved = resolve(config)
    data = train_data(config, resolved)
    seq_len = data.seq_len
    modules = build_modules(config, resolved, seq_len, meta=False)
    refuse_nothing_trains(config, modules)  # (before minutes of measuring a run that would train nothing)
    b = config.data.batch_size
    # The first samples only, read and tokenized now; indices modulo the corpus, which may hold
    # fewer samples than are read here (a small conversation file)
    samples = len(data.train)
    probe = data.train.batch([i % samples for i in range(max(b, 64))], load=None)

    def batch_time(n: int, load: Callable[[list[int]], dict[str, list[int]]]) -> float:
        idx = [i % samples for i in range(1000, 1000 + n)]
        t = []
        for _ in range(5):
            t0 = time.perf_counter()
            data.train.batch(idx, load=load(idx))
            t.append(time.perf_counter() - t0)
        return min(t)

    # A rank builds the global batch's token rows once (`Job.rows`) and reads its encoders' items
    # in the same call: an encoder's load is what reading its items adds to that call.
    rows_points = [(n, batch_time(n, lambda idx: {})) for n in (4, 16, 32)]
    rows = Affine.fit(rows_points)

    def fit_load(load: Callable[[list[int]], dict[str, list[int]]]) -> Affine:
        return Affine.fit([(n, max(0.0, batch_time(n, load) - bare)) for n, bare in rows_points])

    profiles = []
    with measure.one_rank_mesh() as mesh:
        for name in config.module_names:
            profiles.append(_measure_module(config, resolved, data, modules, probe, seq_len, name, mesh,
                                            fit_load, log))
    job = Job(tuple(profiles), b, config.pipeline.schedule, config.pipeline.virtual_stages, LANGUAGE, rows)
    log("measuring AdamW ...")
    optimizer = measure.measure_optimizer()
    return {"job": job.to_dict(), "optimizer": dataclasses.asdict(optimizer), "links": {},
            "description": _description(config)}


def _wrappers(mesh: Any, options: Any) -> dict[str, Callable[[Any], None]]:
    """FSDP2 and tensor parallel as `parallelize` applies them, each alone on the one-rank `mesh`
    (for `wrapper_overhead`)."""
    from dtensor_mimo.parallelize import parallelize

    plain = dataclasses.replace(options, compile=False, activation_checkpointing=0, param_dtype=None,
                                loss_parallel=False)  # the measured output is summed, not a loss
    return {"fsdp": lambda m: parallelize(m, None, mesh, dataclasses.replace(plain, fsdp=True), wrap_one_rank=True),
            "tp": lambda m: parallelize(m, mesh, None, plain, wrap_one_rank=True)}


def _measure_module(config: TrainerConfig, resolved: Any, data: Any, modules: dict[str, Any], probe: Any,
                    seq_len: int, name: str, mesh: Any, fit_load: Callable[..., Affine],
                    log: Callable[[str], None]) -> ModuleProfile:
    """One module's profile: blocks and rest timed at three batch sizes, saved activations, the
    FSDP2 and tensor-parallel wrappers' own cost per block call (on a one-rank `mesh`)."""
    import copy

    import torch

    from dtensor_mimo.models.llama import Llama, head_is_embedding
    from dtensor_mimo.models.protocol import encoder_problems, language_problems
    from dtensor_mimo.parallelize import parallelize
    from dtensor_mimo.parallelize.precision import compute_dtype
    from dtensor_mimo.plan import measure
    from dtensor_mimo.schedule.encoders import independent_rows

    module, options = modules[name], config.module_options(name)
    # as `LocalEncoders` decides (`RankParts.independent_encoders`, not recomputed), before any wrapper
    one_call = name != LANGUAGE and not options.recompute_colocated and independent_rows(module, options)
    log(f"measuring {name} ...")
    params = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    # a tied decoder's embedding, which pipeline stages train twice (`ModuleProfile.tied_params`)
    tied = module.tok_embeddings.weight.numel() if isinstance(module, Llama) and head_is_embedding(module) else 0
    if name == LANGUAGE:
        c = resolved.language
        vocab = c.vocab_size if c is not None else resolved.vocab_size

        def make(n: int) -> tuple[Any, int]:
            return torch.randint(0, vocab, (n, seq_len)), n * seq_len

        sizes = (2, 8, 32)
        tokens_per_sample = float(seq_len)
        width = hidden = getattr(getattr(module, "config", None), "dim", 0)
        divides = (c.n_heads, c.n_kv_heads, c.ffn_hidden, c.vocab_size) if c is not None else ()
        load = Affine()
    else:
        e = resolved.encoders[name]
        m = probe.modalities[name]

        def make(n: int, items=m.inputs, per=m.item_tokens) -> tuple[Any, int]:
            """The probe's first `n` items (repeated), and their rows (each item's own when they vary)."""
            count = len(per)
            reps = -(-n // max(1, count))
            if isinstance(items, list):  # items of their own size: a list, one tensor per item
                return (items * reps)[:n], sum((list(per) * reps)[:n])
            return torch.cat([items] * reps)[:n], n * e.tokens_per_item

        sizes = (4, 16, 48)
        # the data's mean rows per item when items vary (e.tokens_per_item is then an upper bound);
        # conversations: both factors estimated from the first CHECKED_SAMPLES samples (train/datasets.py)
        tokens_per_sample = data.items_per_sample.get(name, 0.0) * data.tokens_per_item.get(name, e.tokens_per_item)
        width = module.out_dim if hasattr(module, "out_dim") else 0
        cfg = e.config
        hidden = getattr(cfg, "dim", width)
        proj = getattr(getattr(module, "projection", None), "fc1", None)
        divides = tuple(x for x in (getattr(cfg, "n_heads", None), getattr(cfg, "mlp_hidden", None),
                                    getattr(proj, "out_features", None)) if x)
        load = fit_load(lambda idx, name=name: {name: idx})
    # What moves: activations (tp, cp, pp sends, the rows crossing) in the compute dtype, FSDP2's
    # gathers in param_dtype (`dtensor_mimo.parallelize.precision`)
    act_bytes = compute_dtype(options, module).itemsize
    gather_bytes = options.param_dtype.itemsize if options.param_dtype is not None else None
    # gradients summed over dp in the reduce dtype (fp32 under param_dtype unless reduce_dtype says)
    reduce_dtype = options.gradient_reduce_dtype
    reduce_bytes = reduce_dtype.itemsize if reduce_dtype is not None else None
    # what the library's protocol lets the module take at all (`check_model` refuses the rest): a
    # tensor parallel plan; context parallel (the language model's attention core)
    if name == LANGUAGE:
        tensor_parallel = not language_problems(module, tp=2, cp=1)
        context_parallel = not language_problems(module, tp=1, cp=2)
    else:
        tensor_parallel = not encoder_problems(module, tp=2, activation_checkpointing=0)
        context_parallel = False
    # A frozen decoder's backward still runs (the rows' gradients to the encoders that train, no
    # weight gradients) and its blocks keep activations for it: measured so, its text embedding's
    # output taking a gradient as the assembled rows do (token ids alone took none: no backward)
    through = name == LANGUAGE and not trainable and any(
        p.requires_grad for n, m in modules.items() if n != LANGUAGE for p in m.parameters())
    if through:
        module.tok_embeddings.register_forward_hook(lambda _m, _args, out: out.detach().requires_grad_())
    pristine = copy.deepcopy(module)  # what the wrappers' cost is measured on, below
    # As the trainer runs it (activation checkpointing, mixed precision), on no mesh and uncompiled
    parallelize(module, None, None, dataclasses.replace(options, compile=False))
    times = measure.time_module(module, make, sizes)
    layers = measure.module_blocks(module)
    n_layers = len(layers)
    block_params = sum(p.numel() for p in next(iter(layers.values())).parameters()) if n_layers else 0
    inputs, tokens = make(sizes[1])
    act = measure.activation_bytes_per_token(module, inputs, tokens)
    frozen_tower = name != LANGUAGE and config.model.encoders[name].frozen
    if frozen_tower:
        times["block_backward"] = Affine()
    wrappers = {}
    if mesh is not None:
        for kind, wrap in _wrappers(mesh, options).items():
            try:
                f, bw = measure.wrapper_overhead(pristine, inputs, wrap)
            except Exception as err:  # noqa: BLE001 - a wrapper this module cannot take: cost unknown, 0
                log(f"  {name}: {kind} wrapper not timed ({type(err).__name__}: {err})")
                continue
            wrappers[f"{kind}_forward_s"], wrappers[f"{kind}_backward_s"] = f, bw
    return ModuleProfile(
        name=name, n_layers=n_layers, tokens_per_sample=tokens_per_sample,
        block_params=block_params, rest_params=params - block_params * n_layers, trainable_params=trainable,
        tied_params=tied,
        activation_bytes_per_token=0.0 if frozen_tower else act, width=width, hidden=hidden,
        tp_divides=divides, cp=context_parallel, tensor_parallel=tensor_parallel, act_bytes=act_bytes,
        gather_bytes=gather_bytes,
        reduce_bytes=reduce_bytes, load=load, one_call=one_call, **option_limits(options), **times,
        varied=name != LANGUAGE and probe.modalities[name].varied, **wrappers)


def option_limits(options: Any) -> dict[str, bool]:
    """The `ModuleProfile` fields that say which layouts a module's `ParallelOptions` allow (the
    library refuses the others: `dtensor_mimo.schedule.checks.check_model`), so that the planner
    proposes only layouts the trainer can build."""
    return {"fsdp": options.fsdp, "reshard_after_forward": options.reshard_after_forward,
            "compiled_whole": options.compile and options.compile_scope == "module",
            "cuda_graphs": options.cuda_graphs, "colocated_only": options.recompute_colocated,
            "compiled": options.compile}


def load_profiles(config: TrainerConfig, world: int, cache: str | None = None, remeasure: bool = False,
                  log: Callable[[str], None] = print) -> tuple[Job, DeviceProfile, str]:
    """The job's profiles and this machine's for `world` local ranks, from the cache or measured
    now (the gloo link is measured with `world` processes at once: on fewer cores than ranks a
    message waits for its peer to be scheduled); (job, device, cache path)."""
    import json

    from dtensor_mimo.plan import measure

    path = Path(cache) if cache else measure.CACHE_DIR / f"plan-{measure.cache_key(_description(config))}.json"
    if remeasure and path.exists():
        path.unlink()
    data, hit = measure.cached(path, lambda: measure_profiles(config, log))
    links = data.setdefault("links", {})
    if str(world) not in links:
        log(f"measuring a gloo link with {world} local processes ...")
        links[str(world)] = dataclasses.asdict(measure.measure_link(world))
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
        hit = False
    job = Job.from_dict(data["job"])

    def device_for(w: int, runtime: dict[str, float]) -> DeviceProfile:
        link = Link(**links[str(w)])
        if f"collective_wait_s_{w}" in runtime:  # fitted to a real run of `w` ranks (`calibrate_collectives`)
            link = dataclasses.replace(link, collective_s=runtime[f"collective_wait_s_{w}"])
        return DeviceProfile(name=f"this machine ({os.cpu_count()} cores, CPU, gloo)", intra=link, inter=link,
                             memory_bytes=None, ranks_per_node=1 << 20, optimizer=Affine(**data["optimizer"]),
                             cores=os.cpu_count(), microbatch_s=runtime.get("microbatch_s", 0.0),
                             step_s=runtime.get("step_s", 0.0))

    if "runtime" not in data:
        if "2" not in links:
            links["2"] = dataclasses.asdict(measure.measure_link(2))
        data["runtime"] = calibrate_runtime(config, job, device_for(2, {}), log)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
        hit = False
    if world > 1 and f"collective_wait_s_{world}" not in data["runtime"]:
        fitted = calibrate_collectives(config, job, device_for(world, data["runtime"]), world, log)
        if fitted is not None:
            data["runtime"][f"collective_wait_s_{world}"] = fitted
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data, indent=1))
            tmp.replace(path)
            hit = False
    log(f"profiles {'read from' if hit else 'measured, cached in'} {path}")
    return job, device_for(world, data["runtime"]), str(path)


# ---------------------------------------------------------------------------- the runtime's overhead


def _calibration_rank(rank: int, world: int, port: int, config: TrainerConfig) -> None:
    import torch.distributed as dist

    from dtensor_mimo.layout.world import init_distributed, local_rank_env
    from dtensor_mimo.train.trainer import Trainer

    local_rank_env(rank, world, port)
    sys.stdout = open(os.devnull, "w")  # the trainer's log lines; the step times go to metrics.jsonl
    init_distributed("cpu")
    try:
        Trainer(config).run()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _train_steps(config: TrainerConfig, layout: dict[str, Any], microbatches: int, steps: int = 30,
                 warmup: int = 10) -> float:
    """Median logged step time (after `warmup`) of a short real run of `config` on `layout`."""
    import json
    import statistics
    import tempfile

    import torch.multiprocessing as mp

    from dtensor_mimo.layout.world import hold_store

    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(tmp, "m.jsonl")
        run = with_candidate(config, {"layout": layout, "microbatches": microbatches})
        run = dataclasses.replace(
            run, train=dataclasses.replace(run.train, steps=steps, generate=0),
            metrics=dataclasses.replace(run.metrics, jsonl=jsonl, log_every=10, progress="off", tensorboard=None),
            data=dataclasses.replace(run.data, heldout_samples=min(run.data.heldout_samples, 8)),
            checkpoint=type(run.checkpoint)(),
            options={n: dataclasses.replace(run.module_options(n), compile=False) for n in run.module_names},
            lr_schedule=dataclasses.replace(run.lr_schedule, warmup_steps=5, total_steps=steps))
        world = build_layout(run).world_size
        store = hold_store(world)  # served until the ranks end
        mp.start_processes(_calibration_rank, args=(world, store.port, run), nprocs=world, start_method="spawn")
        with open(jsonl) as f:
            times = [r["step_s"] for r in map(json.loads, f) if "step_s" in r and r["step"] > warmup]
    return statistics.median(times)


def calibrate_runtime(config: TrainerConfig, job: Job, device: DeviceProfile,
                      log: Callable[[str], None] = print) -> dict[str, float]:
    """The runtime's busy time per microbatch and per step (`DeviceProfile.microbatch_s`,
    `step_s`), from two short real runs on 2 local ranks — the encoders on rank 0, the language
    model on rank 1, with 1 and with M microbatches — minus what the cost model already predicts
    for them. Measured at 2 ranks, used at any world. An encoder whose options keep it on the
    language model's ranks (`ModuleProfile.colocated_only`: recompute_colocated) runs on rank 1
    with it (every encoder such: one rank in all)."""
    m = max(mm for mm in (2, 4, 8) if job.batch_size % mm == 0) if job.batch_size % 2 == 0 else 1
    encoders = [n for n in job.names if n != job.language]
    own = [n for n in encoders if not job.module(n).colocated_only]  # the library refuses the others apart
    lang_at = 1 if own else 0
    layout = {**{n: {"pp": 1, "dp": 1, "cp": 1, "tp": 1, "offset": 0 if n in own else lang_at} for n in encoders},
              job.language: {"pp": 1, "dp": 1, "cp": 1, "tp": 1, "offset": lang_at}}
    log(f"measuring the runtime's overhead: 2 ranks, 1 and {m} microbatches ...")
    measured = {1: _train_steps(config, layout, 1)}
    if m > 1:
        measured[m] = _train_steps(config, layout, m)
    cands = {k: Candidate.of({n: Parallelism() for n in job.names}, {n: v["offset"] for n, v in layout.items()}, k)
             for k in measured}
    per_mb, per_step = 0.0, 0.0
    for _ in range(20):  # both terms enter the prediction through maxima: a few fixed-point rounds
        dev = dataclasses.replace(device, microbatch_s=per_mb, step_s=per_step)
        pred = {k: predict(job, c, dev).step_s for k, c in cands.items()}
        if m > 1:
            per_mb = max(0.0, per_mb + ((measured[m] - pred[m]) - (measured[1] - pred[1])) / (m - 1))
        per_step = max(0.0, per_step + measured[1] - pred[1])
    return {"microbatch_s": per_mb, "step_s": per_step, **{f"measured_m{k}_s": v for k, v in measured.items()}}


def calibrate_collectives(config: TrainerConfig, job: Job, device: DeviceProfile, world: int,
                          log: Callable[[str], None] = print) -> float | None:
    """`Link.collective_s`, the wait per ring step of a collective, for `world` local ranks: fitted
    to a short real run of the homogeneous layout (every module on every rank, dp = world: FSDP2
    gathers and reduce-scatters every block, the collectives every other layout has too) so that
    its prediction is the measured step. A ping-pong between idle processes misses what a
    collective costs when its peers are busy computing on shared cores (each waits to be
    scheduled); None when the batch does not split over `world` ranks, or the library refuses
    that layout with the modules' options (e.g. a zero-bubble schedule with FSDP2 resharding
    after forward): then the idle ping-pong's wait stands."""
    base = homogeneous(job, world)
    if base is None:
        return None
    uncompiled = dataclasses.replace(job, modules=tuple(  # as `_train_steps` runs it
        dataclasses.replace(p, compiled_whole=False, cuda_graphs=False, compiled=False) for p in job.modules))
    try:
        validate(uncompiled, base, world)
    except InvalidCandidate as e:
        log(f"the collectives' cost under load is not measured: the homogeneous layout does not train ({e})")
        return None
    log(f"measuring the collectives' cost under load: the homogeneous layout on {world} ranks ...")
    measured = _train_steps(config, {n: {"pp": 1, "dp": world, "cp": 1, "tp": 1, "offset": 0} for n in job.names},
                            base.microbatches)

    def predicted(collective_s: float) -> float:
        link = dataclasses.replace(device.intra, collective_s=collective_s)
        return predict(job, base, dataclasses.replace(device, intra=link, inter=link)).step_s

    low, high = 0.0, 1.0  # the prediction grows with collective_s: bisect
    if predicted(low) >= measured:
        return 0.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if predicted(mid) < measured else (low, mid)
    return low


# ---------------------------------------------------------------------------- the config's layouts


def configured_candidate(config: TrainerConfig, world: int) -> Candidate | None:
    """The config's own layout as a candidate (None if it does not fill `world`)."""
    try:
        layout = build_layout(config, world)
    except ConfigError:
        return None
    return Candidate.of({n: layout.parallelism(n) for n in layout.names}, {n: layout.offset(n) for n in layout.names},
                        config.pipeline.microbatches)


def with_candidate(config: TrainerConfig, chosen: dict[str, Any]) -> TrainerConfig:
    """`config` with the layout and microbatches of a ``--json`` entry (auto off)."""
    # (an entry written before HSDP has no dp_replicate)
    modules = {n: ModuleLayout(**{k: v[k] for k in (*FIELDS, "offset") if k in v})
               for n, v in chosen["layout"].items()}
    layout = dataclasses.replace(config.layout, modules=modules, auto=False)
    pipeline = dataclasses.replace(config.pipeline, microbatches=chosen["microbatches"])
    return dataclasses.replace(config, layout=layout, pipeline=pipeline)


def trainer_problem(config: TrainerConfig, candidate: Candidate, world: int) -> str | None:
    """Why the trainer's config check (`check_config`) refuses `config` on `candidate`'s layout
    and microbatches for `world` ranks, as ``layout.auto`` and a ``--json`` entry would train it
    (None: it accepts)."""
    try:
        check_config(with_candidate(config, candidate.as_json()), world)
    except ConfigError as e:
        return str(e)
    return None


def plan(config: TrainerConfig, world: int, top: int = 10, cache: str | None = None, remeasure: bool = False,
         log: Callable[[str], None] = print) -> list[Prediction]:
    """Rank the layouts of `world` ranks for `config`'s job; print the table's `top` rows."""
    job, device, _ = load_profiles(config, world, cache, remeasure, log)
    # the user's layers per stage: only layouts of that many language stages, costed on them
    job = dataclasses.replace(job, split=config.pipeline.split)
    result = search(job, world, device)
    # the trainer's own config check of each candidate (`check_config`: e.g. an encoder's options
    # against its layout, `check_module_options`): the run trains on none that it refuses
    refused: list[str] = []
    ranked = []
    for pred in result.ranked:
        problem = trainer_problem(config, pred.candidate, world)
        if problem is None:
            ranked.append(pred)
        else:
            refused.append(problem)
    result = dataclasses.replace(result, ranked=ranked)
    if not result.ranked:
        raise ConfigError(f"no layout of {world} ranks trains this job (modules {job.names}, batch "
                          f"{job.batch_size}"
                          + (f", pipeline.split = {list(job.split)}: {len(job.split)} language stages"
                             if job.split else "")
                          + (f"; the trainer's config check refused all {len(refused)} others, the first: "
                             f"{refused[0]}" if refused else "")
                          + "); try another world size or data.batch_size"
                          + (", or leave pipeline.split out" if job.split else ""))
    base = homogeneous(job, world)
    try:
        if base is not None:
            validate(job, base, world)
    except InvalidCandidate:
        base = None
    baseline = predict(job, base, device) if base is not None else None
    log(f"{result.evaluated} layouts of {world} ranks ({'all' if result.exhaustive else 'pruned search'}"
        + (f"; {len(refused)} refused by the trainer's config check" if refused else "") + "); "
        f"predicted on {device.name}, blocks measured uncompiled; '!': over memory")
    log(table(result.ranked, job.names, top, baseline))
    own = configured_candidate(config, world)
    if own is not None:
        try:
            validate(job, own, world)
            p = predict(job, own, device)
            same = canonical(job, own)  # the search's form: which group takes which ranks left out
            rank = next((i for i, q in enumerate(result.ranked, 1) if q.candidate == same), None)
            log(f"the configured layout ({own.describe()}, M={own.microbatches}): {p.step_s * 1e3:.1f} ms predicted"
                + (f", rank {rank}" if rank else ""))
        except InvalidCandidate:
            pass
    return result.ranked


def auto_layout(config: TrainerConfig, world: int, top: int = 5, log: Callable[[str], None] = print) -> TrainerConfig:
    """`config` on the planner's first choice for `world` ranks (``--layout.auto true``), after
    printing the table's top rows."""
    ranked = plan(config, world, top, log=log)
    chosen = entry(ranked[0])
    log(f"layout.auto: training on {ranked[0].candidate.describe()}, {chosen['microbatches']} microbatches")
    return with_candidate(config, chosen)


def auto_layout_collective(config: TrainerConfig, log: Callable[[str], None] = print) -> TrainerConfig:
    """``--layout.auto`` inside an initialized process group (torchrun): rank 0 plans for the
    group's world size and prints the table, every rank trains on its first choice (one
    broadcast), so all ranks agree whatever their own measurements would say."""
    import torch.distributed as dist

    chosen: list[Any] = [None, None]
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            chosen[0] = entry(plan(config, dist.get_world_size(), 5, log=log)[0])
        except Exception as e:  # noqa: BLE001 — any failure reaches the peers waiting below, not a hang
            error, chosen[1] = e, f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(chosen, src=0)
    if error is not None:
        raise error
    if chosen[1] is not None:
        raise ConfigError(f"layout.auto: rank 0 could not plan: {chosen[1]}")
    return with_candidate(config, chosen[0])


# ---------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(USAGE + "\n\n" + (__doc__ or "").split("\n\n", 2)[2])
        return 0
    own: dict[str, str | None] = {"world": None, "top": "10", "json": None, "cache": None}
    remeasure, rest, i = False, [], 0
    while i < len(argv):
        key, eq, value = argv[i][2:].partition("=") if argv[i].startswith("--") else ("", "", "")
        if key == "remeasure":
            remeasure, i = True, i + 1
            continue
        if key in own:
            if not eq:
                if i + 1 >= len(argv):
                    print(f"error: --{key} needs a value\n{USAGE}", file=sys.stderr)
                    return 2
                value, i = argv[i + 1], i + 1
            own[key] = value
        else:
            rest.append(argv[i])
        i += 1
    try:
        config = parse_args(rest)
        world = int(own["world"]) if own["world"] else build_layout(config).world_size
        top = int(own["top"])
        if world < 1 or top < 1:
            raise ValueError
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except ValueError:
        print(f"error: --world and --top take integers >= 1, got {own['world']!r}, {own['top']!r}\n{USAGE}",
              file=sys.stderr)
        return 2
    try:
        ranked = plan(config, world, top, own["cache"], remeasure)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if own["json"]:
        write_json(own["json"], ranked)
        print(f"wrote {len(ranked)} ranked layouts to {own['json']}")
    return 0
