"""The cost model of one training step: pure functions of profiles, a layout and the microbatches.

Each function is one effect, in seconds (or bytes), and is unit-tested on hand-computed cases:

- collectives on a `Link` (ring all-reduce, all-gather / reduce-scatter, point-to-point);
- a module's work per microbatch on its busiest rank (`module_microbatch`): blocks and the rest
  of the module at tokens / (dp·cp), the per-token part divided by tp (the fixed per-call part
  is not), tp and cp collectives per block, FSDP2 gathers per microbatch, pp stage sends;
- the language pipeline (`pipeline_time`): ``(M + bubble) x`` the busiest stage's microbatch time,
  with the schedule's bubble (`bubble_units`);
- encoders on ranks of their own overlap the language model (`overlapped_step`: the encoder's
  microbatch i + 1 runs while the language model runs microbatch i); encoders sharing ranks with it,
  or frozen ones, run in three phases (`three_phase_step`);
- bridge crossings from the bridge's own plan (`crossing_time`: the busiest rank's rows and
  messages, `dtensor_mimo.bridge.plan`);
- the dp gradient reduction once per step (`gradient_reduction`), the optimizer, data loading;
- on a CPU host whose ranks share cores, a step lasts at least the time processor sharing takes
  to finish every rank's busy time (`shared_cores`);
- peak memory per rank (`peak_memory`) and each module's idle fraction.

`predict` puts them together for a `Candidate`. Nothing here touches torch.distributed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Sequence

from dtensor_mimo.bridge.hops import hop_rows, wants_two_hops
from dtensor_mimo.bridge.plan import MeshSpec, plan
from dtensor_mimo.layout import Parallelism
from dtensor_mimo.plan.candidate import Candidate
from dtensor_mimo.plan.profile import DeviceProfile, Job, Link, ModuleProfile
from dtensor_mimo.schedule import order
from dtensor_mimo.schedule.config import (LOOPED_SCHEDULES, V_SCHEDULES, ZERO_BUBBLE_SCHEDULES, PipelineConfig,
                                          stage_layers)

ADAM_STATE_BYTES = 8
"""AdamW's two fp32 moments per trainable parameter."""


# ---------------------------------------------------------------------------- collectives


def allreduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of `nbytes` over `n` ranks: 2(n-1) steps of nbytes/n each, each step
    paying the link's latency and its collective wait (`Link.collective_s`)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * (link.latency_s + link.collective_s + nbytes / n / link.bandwidth)


def allgather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather (or reduce-scatter) of a `nbytes` whole over `n` ranks: n-1 steps of
    nbytes/n, each paying the link's latency and its collective wait."""
    if n <= 1:
        return 0.0
    return (n - 1) * (link.latency_s + link.collective_s + nbytes / n / link.bandwidth)


# ---------------------------------------------------------------------------- pipeline


def bubble_units(schedule: str, pp: int, virtual_stages: int = 1) -> float:
    """Idle microbatch-slots of a pp-stage pipeline, in units of one microbatch's full work on a
    rank: ``pp - 1`` for one stage per rank (1F1B, GPipe), ``(pp - 1) / v`` looped with v stages
    per rank, about a third of that for the zero-bubble schedules (their weight passes fill most
    of it: an approximation, not torch's exact schedule)."""
    if pp <= 1:
        return 0.0
    units = (pp - 1) / (virtual_stages if schedule in LOOPED_SCHEDULES + V_SCHEDULES else 1)
    return units / 3 if schedule in ZERO_BUBBLE_SCHEDULES else units


def pipeline_time(per_microbatch: float, microbatches: int, pp: int, schedule: str = "1F1B",
                  virtual_stages: int = 1) -> float:
    """A pipeline's step: ``(M + bubble) x`` the busiest rank's forward+backward of one microbatch."""
    return (microbatches + bubble_units(schedule, pp, virtual_stages)) * per_microbatch


def overlapped_step(enc_fwd: float, enc_bwd: float, lang_step: float, lang_traverse: float, microbatches: int,
                    enc_start: float = 0.0, lang_start: float = 0.0) -> float:
    """Encoders on ranks of their own, overlapping the language pipeline, timed as if the encoder
    ran its forwards of microbatches 0..M-1, then their backwards as gradients come back (the
    crossing order of `dtensor_mimo.schedule.order` interleaves them by its window, with the same
    busy time).

    Args:
        enc_fwd, enc_bwd: the encoders' forward / backward of one microbatch (crossings included).
        lang_step: the language pipeline's whole step once its inputs arrive (`pipeline_time`).
        lang_traverse: one microbatch's forward and backward through every language stage.
        microbatches: M.
        enc_start, lang_start: when each side can start (after its data).

    The step ends with the last of: the language model, started after the first encoder
    microbatch, then the last encoder backward; the last microbatch's encoder forward, its trip
    through the language stages and its encoder backward; the encoder's M forwards (or the
    first gradient's return) and then its M backwards.
    """
    m = microbatches
    first = max(lang_start, enc_start + enc_fwd)
    lang_bound = first + lang_step + enc_bwd
    last_trip = enc_start + m * enc_fwd + lang_traverse + enc_bwd
    enc_bound = max(enc_start + m * enc_fwd, first + lang_traverse) + m * enc_bwd
    return max(lang_bound, last_trip, enc_bound)


def three_phase_step(enc_fwd: float, enc_bwd: float, lang_step: float, microbatches: int,
                     start: float = 0.0) -> float:
    """Encoders sharing ranks with the language model (or frozen): every microbatch's encoder
    forward, the language schedule, then the encoder backwards: no overlap."""
    return start + microbatches * enc_fwd + lang_step + microbatches * enc_bwd


def shared_cores(critical_path: float, busy_per_rank: Sequence[float], cores: int | None) -> float:
    """A step on ranks that share `cores` cores (a CPU host): at least the critical path, and at
    least the time processor sharing — how an OS time-slices busy processes — takes to finish
    every rank's busy time: while k > cores ranks still have work, each advances at cores / k
    of a core. (Equal busy times give their sum over the cores; one rank busier than the others
    finishes later than that sum, slowed while it shares the cores.)"""
    if not cores:
        return critical_path
    elapsed, done, ranks = 0.0, 0.0, len(busy_per_rank)
    for i, work in enumerate(sorted(busy_per_rank)):
        elapsed += (work - done) * max(1.0, (ranks - i) / cores)
        done = work
    return max(critical_path, elapsed)


def idle_fraction(busy: float, step: float) -> float:
    """The share of the step a rank spends waiting."""
    return 0.0 if step <= 0 else min(1.0, max(0.0, 1 - busy / step))


# ---------------------------------------------------------------------------- one module


@dataclass(frozen=True)
class ModuleCost:
    """One module's per-microbatch work on its busiest rank, and its per-step extras.

    Attributes:
        forward, backward: one microbatch on the busiest rank (every stage it holds), seconds.
        stage_trip: one microbatch's forward and backward through every pp stage (the pipeline's
            latency for one microbatch), seconds.
        reduce: the dp gradient reduction once per step, seconds.
        optimizer: AdamW over the rank's trainable parameters, seconds.
        load: preparing the rank's inputs for the step, seconds.
        memory: peak bytes on the busiest rank (parameters, gradients, optimizer state, saved
            activations of the microbatches in flight).
    """

    forward: float
    backward: float
    stage_trip: float
    reduce: float
    optimizer: float
    load: float
    memory: float


def rank_layers(n_layers: int, pp: int, schedule: str = "1F1B", virtual_stages: int = 1,
                split: Sequence[int] | None = None) -> list[tuple[int, bool]]:
    """Per pp rank: (blocks it holds, whether it holds the last stage: head and loss)."""
    config = PipelineConfig(microbatches=max(1, pp), schedule=schedule, virtual_stages=virtual_stages)
    n_stages = config.num_stages(pp)
    bounds = stage_layers(n_layers, n_stages, split)
    out = []
    for r in range(pp):
        stages = config.rank_stages(r, pp)
        out.append((sum(len(bounds[s]) for s in stages), n_stages - 1 in stages))
    return out


def _ends_together(pp: int, schedule: str, virtual_stages: int) -> bool:
    """Whether a pp rank holds both the first and the last of a module's several stages."""
    config = PipelineConfig(microbatches=max(1, pp), schedule=schedule, virtual_stages=virtual_stages)
    n_stages = config.num_stages(pp)
    return n_stages > 1 and config.stage_rank(0, pp) == config.stage_rank(n_stages - 1, pp)


def microbatch_tokens(profile: ModuleProfile, samples: int, par: Parallelism) -> float:
    """Rows one rank of the module processes per microbatch: its dp shard (the largest, when dp
    does not divide the samples), cut by cp."""
    return math.ceil(samples / par.dp) * profile.tokens_per_sample / par.cp


def module_cost(profile: ModuleProfile, par: Parallelism, batch_size: int, microbatches: int,
                device: DeviceProfile, ranks: Sequence[int], schedule: str = "1F1B",
                virtual_stages: int = 1, held: int | None = None, accumulates: bool | None = None,
                split: Sequence[int] | None = None) -> ModuleCost:
    """`ModuleCost` of `profile` laid out as `par` on global `ranks` (mesh order, tp fastest).

    `held`: the microbatches whose activations the module keeps at once (an encoder:
    `encoder_held`); None: the module's own schedule's bound on its first stage
    (`dtensor_mimo.schedule.order.in_flight`: pp under 1F1B, all M under GPipe).
    `accumulates`: FSDP2 accumulates the step's microbatches unreduced (torch's pipeline stages,
    an overlapped encoder's `Accumulation`): every gradient unsharded, and under torch's stages
    every block left gathered after each backward but the last. None: the language model's rule
    (it runs as torch's pipeline stages): more than one microbatch.
    `split`: layers per stage (`PipelineConfig.split`; None: as even as possible).
    """
    m = microbatches
    samples = batch_size // m if batch_size % m == 0 else math.ceil(batch_size / m)
    tokens = microbatch_tokens(profile, samples, par)
    tp, dpcp = par.tp, par.dp * par.cp
    tp_link = device.link(ranks[:tp])
    dp_stride = par.cp * par.tp
    dp_link = device.link(ranks[0:par.dp * dp_stride:par.tp]) if dpcp > 1 else device.intra
    pp_link = device.link([ranks[0], ranks[min(len(ranks) - 1, par.dp * dp_stride)]]) if par.pp > 1 else device.intra
    act = tokens * profile.hidden * profile.act_bytes

    def block(affine) -> float:
        return affine.fixed + affine.per_token * tokens / tp

    fsdp = profile.fsdp and dpcp > 1
    # FSDP2's shards span dp·cp ranks, or with HSDP one replica group's: the slowest link of any
    # group (`shard_link`; a group straddling two nodes is costed across them); the gradient
    # shards are all-reduced across the groups (`replica_link`: across nodes unless every group
    # of the stage shares one)
    shards = dpcp // par.dp_replicate if fsdp else 1
    group = shards * par.tp  # consecutive ranks of one replica group (tp fastest)
    shard_link = (max((device.link(ranks[g:g + group]) for g in range(0, dpcp * par.tp, group)),
                      key=lambda link: link is device.inter) if shards > 1 else device.intra)
    replica_link = device.link(ranks[:dpcp * par.tp]) if par.hsdp else device.intra
    tp_comm = 2 * allreduce_time(act, tp, tp_link) if tp > 1 else 0.0
    cp_comm = allgather_time(2 * act * par.cp, par.cp, dp_link) if par.cp > 1 else 0.0
    # the wrappers' own per-call cost: DTensor dispatch under tp, FSDP2's hooks under dp·cp
    wrap_f = (profile.tp_forward_s if tp > 1 else 0.0) + (profile.fsdp_forward_s if fsdp else 0.0)
    wrap_b = (profile.tp_backward_s if tp > 1 else 0.0) + (profile.fsdp_backward_s if fsdp else 0.0)
    block_f = block(profile.block_forward) + tp_comm + cp_comm + wrap_f
    trains_blocks = profile.block_backward.fixed > 0 or profile.block_backward.per_token > 0
    block_b = (block(profile.block_backward) + tp_comm + cp_comm + wrap_b) if trains_blocks else 0.0
    gather_bytes = profile.gather_bytes or profile.param_bytes  # FSDP2 gathers in param_dtype
    gather_block = allgather_time(profile.block_params * gather_bytes / tp, shards, shard_link)
    gather_rest = allgather_time(profile.rest_params * gather_bytes / tp, shards, shard_link)
    regather = profile.reshard_after_forward and trains_blocks

    per_rank = rank_layers(profile.n_layers, par.pp, schedule, virtual_stages, split) if par.pp > 1 else \
        [(profile.n_layers, True)]
    stage_send = 0.0
    if par.pp > 1:  # a stage receives its input and sends its output, forward and backward
        stage_send = 2 * pp_link.time(tokens * profile.width * profile.act_bytes)

    overhead = device.microbatch_s / 2  # the runtime's own work, forward and backward

    def rank_work(layers: int, last: bool) -> tuple[float, float]:
        f = layers * (block_f + gather_block) + stage_send + overhead
        b = layers * (block_b + (gather_block if regather else 0.0)) + stage_send + overhead
        if last or par.pp == 1:
            f += block(profile.rest_forward) + gather_rest
            b += block(profile.rest_backward)
        return f, b

    works = [rank_work(*lr) for lr in per_rank]
    fwd, bwd = max(works, key=lambda fb: fb[0] + fb[1])
    trip = sum(f + b for f, b in works)

    # Parameters per rank: blocks of its stages (+ the rest, counted whole: conservative, and a tied
    # head's copy where one rank holds the first and the last of several stages) over tp, sharded
    # over dp·cp by FSDP2.
    busiest_layers = max(layers for layers, _ in per_rank)
    params = (profile.block_params * busiest_layers + profile.rest_params
              + (profile.tied_params if _ends_together(par.pp, schedule, virtual_stages) else 0)) / tp
    share = profile.trainable_params / max(1, profile.params)
    state = params * profile.param_bytes + params * share * (profile.param_bytes + ADAM_STATE_BYTES)
    # FSDP2 holds one gathered block at a time (and the root's rest), or, not resharding after
    # forward, every block of the rank's stages from its forward to its backward
    staged = accumulates is None and m > 1  # torch's stages: not resharded after a backward but the last
    accumulating = fsdp and profile.trainable and (staged if accumulates is None else accumulates)
    held_blocks = 1 if profile.reshard_after_forward and not (fsdp and staged) else busiest_layers
    gathered = (profile.block_params * held_blocks + profile.rest_params) / tp * gather_bytes if fsdp else 0.0
    # unreduced, a gradient is whole on every rank (in the reduce dtype), beside its shard
    unsharded_grads = params * share * (profile.reduce_bytes or profile.param_bytes) if accumulating else 0.0
    in_flight = held if held is not None else order.in_flight(
        PipelineConfig(microbatches=m, schedule=schedule, virtual_stages=virtual_stages), par.pp)
    activations = profile.activation_bytes_per_token * tokens / tp * busiest_layers * in_flight
    memory = state / shards + gathered + unsharded_grads + activations
    grad_bytes = params * share * (profile.reduce_bytes or profile.param_bytes)  # in the reduce dtype
    if not profile.trainable:
        reduce = 0.0
    elif profile.fsdp:  # a reduce-scatter over the shards (+ with HSDP an all-reduce of one shard across groups)
        reduce = (allgather_time(grad_bytes, shards, shard_link)
                  + allreduce_time(grad_bytes / shards, par.dp_replicate, replica_link))
    else:
        reduce = allreduce_time(grad_bytes, dpcp, dp_link)
    optimizer = device.optimizer(params * share / shards) if profile.trainable else 0.0
    load = profile.load(math.ceil(batch_size / par.dp)) if profile.load.fixed or profile.load.per_token else 0.0
    return ModuleCost(fwd, bwd, trip, reduce, optimizer, load, memory)


# ---------------------------------------------------------------------------- the bridge


@functools.lru_cache(maxsize=4096)
def _crossing_rows(enc: Parallelism, lang: Parallelism, colocated: bool, samples: int, rows_per_sample: int,
                   two_hops: bool) -> tuple[int, int, int]:
    """(busiest rank's rows between the modules, its messages, its rows inside the destination
    mesh for a two-hop route) of one microbatch, from the bridge's own plan."""
    from torch.distributed.tensor import Replicate, Shard

    placements = (Shard(0), Replicate(), Replicate())
    src_grid = _grid(enc, 0)
    dst_grid = _grid(lang, 0 if colocated else enc.size)
    sizes = (rows_per_sample,) * samples
    src = MeshSpec(src_grid, placements, sample_sizes=sizes, name="encoder")
    dst = MeshSpec(dst_grid, placements, sample_sizes=sizes, name="language")
    world = enc.size if colocated else enc.size + lang.size
    if two_hops and wants_two_hops(src, dst):
        rows = hop_rows(src, dst, 2)
        dst_ranks = lang.dp * lang.cp * lang.tp
        return math.ceil(rows["between"] / max(1, min(src.shape[0] * enc.tp, dst_ranks))), 1, \
            math.ceil(rows["inside"] / dst_ranks)
    p = plan(src, dst, world)
    busiest, messages = 0, 0
    for r in range(world):
        rp = p.for_rank(r)
        sent = sum(s.hi - s.lo for s in rp.sends)
        got = sum(v.hi - v.lo for v in rp.recvs)
        busiest = max(busiest, sent, got)
        messages = max(messages, len(rp.sends), len(rp.recvs))
    return busiest, messages, 0


def _grid(par: Parallelism, offset: int) -> list:
    """The first pp stage's (dp, cp, tp) grid of global ranks."""
    return [[[offset + (d * par.cp + c) * par.tp + t for t in range(par.tp)] for c in range(par.cp)]
            for d in range(par.dp)]


def crossing_time(enc: ModuleProfile, enc_par: Parallelism, lang_par: Parallelism, colocated: bool,
                  samples: int, device: DeviceProfile, enc_ranks: Sequence[int], lang_ranks: Sequence[int],
                  act_bytes: int) -> float:
    """One direction of one microbatch's crossing: the busiest rank's messages and bytes over the
    link between the modules (and, two hops across nodes, the all-gather inside the language mesh).
    `act_bytes`: bytes of one element as rows cross, the language model's compute dtype (the
    bridge's: `MimoModel.dtype`), whatever the encoder computes in."""
    if enc.tokens_per_sample <= 0 or samples == 0:
        return 0.0
    link = device.link([enc_ranks[0], lang_ranks[0]]) if not colocated else device.intra
    two = link is device.inter and device.inter != device.intra
    # Planned once per pair of layouts with one row per sample over lcm(dp, dp) samples (every dp
    # rank of both sides holding whole samples), then scaled: exact when the microbatch's samples
    # are a multiple of it, with uniform rows per sample.
    unit = math.lcm(enc_par.dp, lang_par.dp)
    rows, messages, inside = _crossing_rows(enc_par, lang_par, colocated, unit, 1, two)
    scale = samples / unit * enc.tokens_per_sample
    rows, inside = rows * scale, inside * scale
    row_bytes = enc.width * act_bytes
    t = link.time(rows * row_bytes, messages) if messages else 0.0
    if inside:
        t += allgather_time(inside * row_bytes * lang_par.tp * lang_par.cp, lang_par.tp * lang_par.cp,
                            device.link(lang_ranks[:lang_par.tp * lang_par.cp]))
    return t


# ---------------------------------------------------------------------------- a step


@dataclass(frozen=True)
class Prediction:
    """The cost model's verdict on a candidate.

    Attributes:
        candidate: what was predicted.
        step_s: one training step, seconds.
        tokens_per_s: the language model's tokens per second (batch x sequence / step).
        peak_bytes: the busiest rank's peak memory.
        idle: per module, the share of the step its ranks wait.
        busy: per module, its ranks' busy seconds per step.
        parts: named terms of the step (seconds), for the report.
        fits: whether every rank's peak memory fits the device.
    """

    candidate: Candidate
    step_s: float
    tokens_per_s: float
    peak_bytes: float
    idle: dict[str, float]
    busy: dict[str, float]
    parts: dict[str, float] = field(default_factory=dict)
    fits: bool = True

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / 2**30


def encoder_held(job: Job, language_pp: int, microbatches: int, lean: bool) -> int:
    """Microbatches of activations an encoder keeps at once: the crossing window + 1 when every
    encoder is a pp = 1 encoder on ranks of its own (`dtensor_mimo.schedule.order`), else all of
    them (colocated three phases, encoder pipelines under GPipe)."""
    config = PipelineConfig(microbatches=microbatches, schedule=job.schedule, virtual_stages=job.virtual_stages)
    window = order.crossing_window(config, language_pp, lean)
    return min(microbatches, window + 1) if lean else microbatches


def predict(job: Job, candidate: Candidate, device: DeviceProfile) -> Prediction:
    """One step of `job` on `candidate` (a layout the validators accepted) on `device`."""
    m = candidate.microbatches
    pars, offsets = candidate.parallelisms, candidate.offset_of
    lang_name = job.language
    lang_par = pars[lang_name]
    encoders = [e for e in job.encoders]
    samples = job.batch_size // m

    def ranks(name: str) -> range:
        return range(offsets[name], offsets[name] + pars[name].size)

    colocated = {e.name: candidate.shares_ranks(e.name, lang_name) for e in encoders}
    overlapped = all(e.trainable and not colocated[e.name] for e in encoders)
    lean = overlapped and all(pars[e.name].pp == 1 for e in encoders)
    held = encoder_held(job, lang_par.pp, m, lean)
    costs = {e.name: module_cost(e, pars[e.name], job.batch_size, m, device, ranks(e.name), held=held,
                                 accumulates=overlapped and m > 1) for e in encoders}
    if not overlapped and m > 1:
        # The colocated three phases: an encoder that runs every microbatch's items in one call
        # pays that call's fixed work (launches, FSDP2's gathers, the runtime's) once a step; its
        # one call's time is spread over the M microbatches the step counts.
        for e in encoders:
            if e.one_call and pars[e.name].pp == 1:
                once = module_cost(e, pars[e.name], job.batch_size, 1, device, ranks(e.name), held=1)
                costs[e.name] = replace(costs[e.name], forward=once.forward / m, backward=once.backward / m,
                                        stage_trip=once.stage_trip / m)
    lang = job.lang
    costs[lang_name] = module_cost(lang, lang_par, job.batch_size, m, device, ranks(lang_name), job.schedule,
                                   job.virtual_stages, split=job.split)
    cross_f = {e.name: crossing_time(e, pars[e.name], lang_par, colocated[e.name], samples, device,
                                     ranks(e.name), ranks(lang_name), lang.act_bytes) for e in encoders}
    cross_b = {e.name: cross_f[e.name] if e.trainable else 0.0 for e in encoders}

    # Rank groups: modules sharing a span run one after the other on the same ranks.
    groups: dict[tuple[int, int], list[str]] = {}
    for name in job.names:
        groups.setdefault((offsets[name], pars[name].size), []).append(name)
    rows = job.rows(job.batch_size)
    load = {span: rows + sum(costs[n].load for n in names) for span, names in groups.items()}
    lang_span = (offsets[lang_name], lang_par.size)
    lc = costs[lang_name]
    cross_in = sum(cross_f.values()) + sum(cross_b.values())
    # Overlapped, the first language stage posts each microbatch's crossings inside its schedule;
    # in the three phases they come before and after it (`schedule.program._colocated`), costed
    # once there, with the encoders' phases (on shared ranks they are one exchange, not two).
    lang_cross = cross_in if overlapped else 0.0
    lang_mb = lc.forward + lc.backward + lang_cross
    lang_step = pipeline_time(lang_mb, m, lang_par.pp, job.schedule, job.virtual_stages)
    lang_trip = lc.stage_trip + lang_cross

    enc_spans = [span for span in groups if span != lang_span]
    enc_f = {span: sum(costs[n].forward + cross_f[n] for n in groups[span]) for span in enc_spans}
    enc_b = {span: sum(costs[n].backward + cross_b[n] for n in groups[span]) for span in enc_spans}
    coloc = [n for n in groups[lang_span] if n != lang_name]
    coloc_f = sum(costs[n].forward + cross_f[n] for n in coloc)
    coloc_b = sum(costs[n].backward + cross_b[n] for n in coloc)
    reduce = {span: sum(costs[n].reduce for n in names) for span, names in groups.items()}
    optim = {span: sum(costs[n].optimizer for n in names) for span, names in groups.items()}

    if overlapped and enc_spans:
        ends = []
        for span in enc_spans:
            ends.append(overlapped_step(enc_f[span], enc_b[span], lang_step, lang_trip, m, load[span],
                                        load[lang_span]) + reduce[span] + optim[span])
        lang_end = max(load[lang_span], *(load[s] + enc_f[s] for s in enc_spans)) + lang_step \
            + reduce[lang_span] + optim[lang_span]
        fb_end = max(*ends, lang_end)
    else:
        enc_all_f = coloc_f + max((enc_f[s] for s in enc_spans), default=0.0)
        enc_all_b = coloc_b + max((enc_b[s] for s in enc_spans), default=0.0)
        start = max(load.values())
        fb_end = three_phase_step(enc_all_f, enc_all_b, lang_step, m, start) + \
            max(reduce.values()) + max(optim.values())
    # One small all-reduce over the world (the global gradient norm and the step's verdict).
    world_ranks = range(candidate.world_size)
    critical = fb_end + allreduce_time(16, candidate.world_size, device.link(world_ranks)) + device.step_s

    busy_span = {}
    for span, names in groups.items():
        work = sum(m * (costs[n].forward + costs[n].backward) for n in names)
        work += sum(m * (cross_f.get(n, 0.0) + cross_b.get(n, 0.0)) for n in names)
        busy_span[span] = load[span] + work + reduce[span] + optim[span] + device.step_s
    step = shared_cores(critical, [busy_span[s] for s in groups for _ in range(s[1])], device.cores)
    busy = {n: busy_span[(offsets[n], pars[n].size)] for n in job.names}
    idle = {n: idle_fraction(busy[n], step) for n in job.names}
    peak = max(sum(costs[n].memory for n in names) for names in groups.values())
    fits = device.memory_bytes is None or peak <= device.memory_bytes
    tokens = job.batch_size * lang.tokens_per_sample
    parts = {"language pipeline": lang_step, "bubble": bubble_units(job.schedule, lang_par.pp, job.virtual_stages)
             * lang_mb, "crossings": m * cross_in, "dp reduce": max(reduce.values()),
             "optimizer": max(optim.values()), "data": max(load.values())}
    return Prediction(candidate, step, tokens / step, peak, idle, busy, parts, fits)
