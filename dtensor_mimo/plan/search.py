"""The layouts a job can train on for a given world, and the search for the fastest ones.

The space (`enumerate_layouts`): the modules are split into groups of colocated modules (every
member of a group spans the same ranks, so their sizes are equal); groups take consecutive rank
ranges, ordered by their first module in the job's order, and fill the world. Per module every
``pp x dp x cp x tp`` factorisation of its size that the library and the trainer accept, and every
microbatch count M up to `SearchSpace.max_microbatches` that the batch allows. Which rank range a
group takes is left out: on one node the ranks are interchangeable, so a layout that only swaps
two groups' ranges is the same layout to the cost model (`canonical` maps any layout to the one
enumerated).

Every candidate passes the real validators (`validate`): `MimoLayout` itself, the pipeline's
`check_pipeline_layout` and `check_microbatching`, layers per stage (`stage_layers`), and the
trainer's rules (encoders at pp = 1, the search's own limit, and cp = 1; tp divides the heads and widths the module
cuts; every dp rank of a module gets at least one sample per microbatch), and what the modules'
options refuse on a layout (`ModuleProfile.compiled_whole`, `cuda_graphs`, `colocated_only`; a
compiled encoder at tp > 1 recomputed over microbatches or on items of their own size, by the
library's own `recomputed_compile_problem` and `compiled_varied_problem`; a zero-bubble schedule
with FSDP2 resharding after forward). So every printed candidate trains.

`search` ranks them by `predict`. Small worlds are searched exhaustively; larger ones are pruned
per module first (for each size and M, the few fastest factorisations, and only the sizes at
which the module or group gets faster), then combined, which keeps 64 ranks and three modules to
seconds.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Iterable, Iterator, Sequence

from dtensor_mimo.layout import LayoutError, Parallelism
from dtensor_mimo.parallelize import ParallelOptions
from dtensor_mimo.parallelize.part import check_compile_layout
from dtensor_mimo.plan.candidate import Candidate
from dtensor_mimo.plan.cost import Prediction, module_cost, predict
from dtensor_mimo.plan.profile import DeviceProfile, Job, ModuleProfile
from dtensor_mimo.schedule.checks import compiled_varied_problem, one_rank_stages_problem, recomputed_compile_problem
from dtensor_mimo.schedule.config import (ZERO_BUBBLE_SCHEDULES, PipelineConfig, check_microbatching,
                                          check_pipeline_layout, stage_layers)


@dataclass(frozen=True)
class SearchSpace:
    """Limits of the search.

    Attributes:
        max_microbatches: the largest M tried (every M with a batch that splits, up to this).
        microbatches: exactly these M (None: every valid one up to `max_microbatches`).
        max_tp: the largest tp (None: the device's ranks per node).
        colocated: try modules sharing ranks.
        disjoint: try modules on ranks of their own.
    """

    max_microbatches: int = 16
    microbatches: tuple[int, ...] | None = None
    max_tp: int | None = None
    colocated: bool = True
    disjoint: bool = True


class InvalidCandidate(ValueError):
    """A candidate one of the validators refused (the message says which and why)."""


# ---------------------------------------------------------------------------- validity


def _factorizations(size: int, dims: int) -> Iterator[tuple[int, ...]]:
    """Ordered `dims`-tuples of positive integers whose product is `size`."""
    if dims == 1:
        yield (size,)
        return
    for d in range(1, size + 1):
        if size % d == 0:
            for rest in _factorizations(size // d, dims - 1):
                yield (d, *rest)


def _compile_options(profile: ModuleProfile) -> ParallelOptions:
    """The options a profile's limits stand for (`ModuleProfile.compiled`, `compiled_whole`,
    `cuda_graphs`, `fsdp`, `colocated_only`), as the library's checks read them."""
    return ParallelOptions(fsdp=profile.fsdp,
                           compile=profile.compiled or profile.compiled_whole or profile.cuda_graphs,
                           compile_scope="module" if profile.compiled_whole else "block",
                           compile_mode="reduce-overhead" if profile.cuda_graphs else None,
                           recompute_colocated=profile.colocated_only and not profile.cuda_graphs)


def module_problem(job: Job, profile: ModuleProfile, par: Parallelism, microbatches: int,
                   max_tp: int | None = None) -> str | None:
    """Why `profile` cannot take `par` with `microbatches` (None: it can). Module-level rules only."""
    is_lang = profile.name == job.language
    if max_tp is not None and par.tp > max_tp:
        return f"tp={par.tp} exceeds the search's max_tp={max_tp}"
    if par.tp > 1 and not profile.tensor_parallel:
        return f"tp={par.tp}: {profile.name!r} has no tensor parallel plan (a parallelize(tp_mesh, options))"
    bad = [d for d in profile.tp_divides if d % par.tp]
    if bad:
        return f"tp={par.tp} does not divide {bad}"
    if not is_lang and (par.pp > 1 or par.cp > 1):
        return "the search keeps encoders at pp = 1 and cp = 1 (encoder pipelines are not in its cost model)"
    if par.cp > 1 and not profile.cp:
        return "context parallel applies to the language model only"
    # What the module's options refuse on a layout (`dtensor_mimo.schedule.checks.check_model`):
    # the compile rules are the library's own check, of the options the profile stands for
    options = _compile_options(profile)
    try:
        check_compile_layout(profile.name, options, par)
    except LayoutError as e:
        return str(e)
    if not is_lang:  # the library's own rules of a compiled encoder at tp > 1 (`check_model`, `check_batch`)
        problem = (recomputed_compile_problem(profile.name, options, par.tp, microbatches, profile.blocks_train)
                   or compiled_varied_problem(profile.name, par.tp, profile.varied,
                                              options.compile and profile.blocks_train))
        if problem:
            return problem
    shards = par.dp * par.cp
    stages = par.pp * (job.virtual_stages if is_lang else 1)
    if is_lang and (problem := one_rank_stages_problem(profile.name, par.pp, stages)):
        return problem
    if profile.compiled_whole and stages > 1:
        return f"compiled whole (compile_scope = 'module'), it cannot be cut into {stages} pipeline stages"
    if (is_lang and profile.fsdp and profile.reshard_after_forward and shards > 1
            and job.schedule in ZERO_BUBBLE_SCHEDULES):
        return (f"schedule {job.schedule!r} with FSDP2 resharding after forward over dp·cp = {shards} is refused "
                "(options: reshard_after_forward = false, or fsdp = false)")
    samples, rem = divmod(job.batch_size, microbatches)
    if rem:
        return f"batch {job.batch_size} does not split into {microbatches} microbatches"
    if samples < par.dp:
        return f"dp={par.dp} leaves ranks without a sample of a {samples}-sample microbatch"
    if is_lang:
        try:
            check_microbatching(job.batch_size, microbatches, par.dp, job.language)
            config = PipelineConfig(microbatches=microbatches, schedule=job.schedule,
                                    virtual_stages=job.virtual_stages)
            stage_layers(profile.n_layers, config.num_stages(par.pp), job.split, module=profile.name)
        except ValueError as e:
            return str(e)
    return None


def validate(job: Job, candidate: Candidate, world_size: int, max_tp: int | None = None) -> None:
    """Raise `InvalidCandidate` unless `candidate` passes the library's and the trainer's checks
    for a world of `world_size` ranks."""
    try:
        layout = candidate.layout(world_size)
    except ValueError as e:
        raise InvalidCandidate(f"{candidate.describe()}: {e}") from None
    if layout.names != job.names:
        raise InvalidCandidate(f"{candidate.describe()}: modules {layout.names}, the job has {job.names}")
    for profile in job.modules:
        problem = module_problem(job, profile, layout.parallelism(profile.name), candidate.microbatches, max_tp)
        if problem is None and profile.colocated_only and not candidate.shares_ranks(profile.name, job.language):
            problem = f"recomputed in the colocated three phases, it must share the ranks of {job.language!r}"
        if problem:
            raise InvalidCandidate(f"{candidate.describe()}: {profile.name}: {problem}")
    try:
        check_pipeline_layout(layout, job.language, PipelineConfig(
            microbatches=candidate.microbatches, schedule=job.schedule, virtual_stages=job.virtual_stages))
    except ValueError as e:
        raise InvalidCandidate(f"{candidate.describe()}: {e}") from None


# ---------------------------------------------------------------------------- the space


def set_partitions(items: Sequence[str]) -> Iterator[list[list[str]]]:
    """Every split of `items` into non-empty groups, groups ordered by their first item."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1:]]


def _ordered(groups: list[list[str]], names: Sequence[str]) -> list[list[str]]:
    order = {n: i for i, n in enumerate(names)}
    return sorted(([*sorted(g, key=order.get)] for g in groups), key=lambda g: order[g[0]])


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


def microbatch_counts(job: Job, space: SearchSpace) -> list[int]:
    """The M tried: those given, or every M up to the limit that splits the batch."""
    if space.microbatches is not None:
        return sorted(set(space.microbatches))
    return [m for m in range(1, min(space.max_microbatches, job.batch_size) + 1) if job.batch_size % m == 0]


def module_options(job: Job, profile: ModuleProfile, size: int, microbatches: int,
                   max_tp: int | None, ranks_per_node: int | None = None) -> list[Parallelism]:
    """Every `Parallelism` of `size` ranks the module accepts with `microbatches`; with
    `ranks_per_node`, also each FSDP2 one whose dp·cp·tp ranks span nodes as HSDP (`hsdp`)."""
    out = []
    for pp, dp, cp, tp in _factorizations(size, 4):
        par = Parallelism(pp=pp, dp=dp, cp=cp, tp=tp)
        if module_problem(job, profile, par, microbatches, max_tp) is None:
            out.append(par)
            if profile.fsdp and ranks_per_node is not None and (replicated := hsdp(par, ranks_per_node)):
                out.append(replicated)
    return out


def hsdp(par: Parallelism, ranks_per_node: int) -> Parallelism | None:
    """`par` as HSDP whose replica groups each fill part of one node: the fewest replica groups R
    (dividing dp) whose ``dp / R · cp · tp`` ranks divide `ranks_per_node` (so no group straddles
    two nodes of a node-aligned module); None where the dp·cp·tp ranks fit in a node already, or
    no R does (cp·tp alone spans nodes)."""
    if par.dp * par.cp * par.tp <= ranks_per_node:
        return None
    for r in range(2, par.dp + 1):
        if par.dp % r == 0 and ranks_per_node % (par.dp // r * par.cp * par.tp) == 0:
            return replace(par, dp_replicate=r)
    return None


def _spaces(job: Job, space: SearchSpace) -> list[list[list[str]]]:
    parts = []
    for groups in set_partitions(job.names):
        groups = _ordered(groups, job.names)
        shared = any(len(g) > 1 for g in groups)
        if (shared and not space.colocated) or (len(groups) > 1 and not space.disjoint):
            continue
        parts.append(groups)
    return parts


def enumerate_layouts(job: Job, world_size: int, space: SearchSpace = SearchSpace(),
                      device: DeviceProfile | None = None) -> Iterator[Candidate]:
    """Every valid candidate of the space for `world_size` ranks (no pruning; each passes `validate`)."""
    max_tp = space.max_tp if space.max_tp is not None else (device.ranks_per_node if device else None)
    rpn = device.ranks_per_node if device else None
    for groups in _spaces(job, space):
        for sizes in _compositions(world_size, len(groups)):
            offsets, size_of = _placed(groups, sizes)
            for m in microbatch_counts(job, space):
                options = [module_options(job, job.module(n), size_of[n], m, max_tp, rpn) for n in job.names]
                yield from _valid(job, options, offsets, m, world_size, max_tp)


def _placed(groups: list[list[str]], sizes: tuple[int, ...]) -> tuple[dict[str, int], dict[str, int]]:
    """Each module's first rank and its group's size, groups laid out one after another."""
    offsets, start = {}, 0
    for group, size in zip(groups, sizes):
        for n in group:
            offsets[n] = start
        start += size
    return offsets, {n: s for g, s in zip(groups, sizes) for n in g}


def _valid(job: Job, options: list[list[Parallelism]], offsets: dict[str, int], m: int, world_size: int,
           max_tp: int | None) -> Iterator[Candidate]:
    """Every combination of the per-module `options` that passes `validate`."""
    for pars in itertools.product(*options):
        cand = Candidate.of(dict(zip(job.names, pars)), offsets, m)
        try:
            validate(job, cand, world_size, max_tp)
        except InvalidCandidate:
            continue
        yield cand


def canonical(job: Job, candidate: Candidate) -> Candidate:
    """The same layout with its groups' rank ranges in the enumeration's order."""
    pars, offsets = candidate.parallelisms, candidate.offset_of
    spans: dict[tuple[int, int], list[str]] = {}
    for n in job.names:
        spans.setdefault((offsets[n], pars[n].size), []).append(n)
    groups = _ordered(list(spans.values()), job.names)
    new, start = {}, 0
    for g in groups:
        for n in g:
            new[n] = start
        start += pars[g[0]].size
    return Candidate.of({n: pars[n] for n in job.names}, new, candidate.microbatches)


# ---------------------------------------------------------------------------- search


@dataclass(frozen=True)
class SearchResult:
    """Ranked predictions (fastest first; candidates that do not fit memory last) and counts."""

    ranked: list[Prediction]
    evaluated: int
    exhaustive: bool


def _standalone(job: Job, profile: ModuleProfile, par: Parallelism, m: int, device: DeviceProfile) -> float:
    """A module's own step work on its ranks (for pruning): M microbatches + reduce + optimizer."""
    c = module_cost(profile, par, job.batch_size, m, device, range(par.size), job.schedule, job.virtual_stages,
                    held=m if profile.name != job.language else None,
                    accumulates=None if profile.name == job.language else m > 1,
                    split=job.split if profile.name == job.language else None)
    return m * (c.forward + c.backward) + c.reduce + c.optimizer + c.load


def _pruned(job: Job, world_size: int, device: DeviceProfile, space: SearchSpace, keep: int) -> Iterator[Candidate]:
    max_tp = space.max_tp if space.max_tp is not None else device.ranks_per_node
    for m in microbatch_counts(job, space):
        # per module and size: the `keep` fastest factorisations that fit memory
        best: dict[tuple[str, int], list[tuple[float, Parallelism]]] = {}
        for profile in job.modules:
            for size in range(1, world_size + 1):
                scored = []
                for par in module_options(job, profile, size, m, max_tp, device.ranks_per_node):
                    c = module_cost(profile, par, job.batch_size, m, device, range(size), job.schedule,
                                    job.virtual_stages, held=m if profile.name != job.language else None,
                                    accumulates=None if profile.name == job.language else m > 1,
                                    split=job.split if profile.name == job.language else None)
                    if device.memory_bytes is not None and c.memory > device.memory_bytes:
                        continue
                    scored.append((_standalone(job, profile, par, m, device), par))
                best[(profile.name, size)] = sorted(scored, key=lambda sp: sp[0])[:keep]
        for groups in _spaces(job, space):
            # sizes at which a group gets faster than at every smaller size
            useful: list[list[int]] = []
            for g in groups:
                sizes, record = [], math.inf
                for size in range(1, world_size + 1):
                    if not all(best[(n, size)] for n in g):
                        continue
                    t = sum(best[(n, size)][0][0] for n in g)
                    if t < record * 0.999:
                        sizes.append(size)
                        record = t
                useful.append(sizes)
            for sizes in _fills(useful, world_size, lambda i, size: all(best[(n, size)] for n in groups[i])):
                offsets, size_of = _placed(groups, sizes)
                options = [[p for _, p in best[(n, size_of[n])]] for n in job.names]
                yield from _valid(job, options, offsets, m, world_size, max_tp)


def _fills(useful: list[list[int]], world_size: int, allowed) -> Iterator[tuple[int, ...]]:
    """Group sizes summing to the world: each group at one of its useful sizes, except one group
    (each in turn) that takes the ranks left over, when `allowed(group index, size)`."""
    seen = set()
    for filler in range(len(useful)):
        others = [u if i != filler else [0] for i, u in enumerate(useful)]
        for sizes in itertools.product(*others):
            left = world_size - sum(sizes)
            if left < 1 or not allowed(filler, left):
                continue
            sizes = (*sizes[:filler], left, *sizes[filler + 1:])
            if sizes not in seen:
                seen.add(sizes)
                yield sizes


def search(job: Job, world_size: int, device: DeviceProfile, space: SearchSpace = SearchSpace(),
           exhaustive: bool | None = None, keep: int = 3) -> SearchResult:
    """Every candidate of the space for `world_size` ranks (`exhaustive`; default for worlds up
    to 8 ranks) or the pruned set, predicted and ranked: fastest first, those over the device's
    memory after all that fit."""
    if exhaustive is None:
        exhaustive = world_size <= 8
    cands: Iterable[Candidate] = (enumerate_layouts(job, world_size, space, device) if exhaustive
                                  else _pruned(job, world_size, device, space, keep))
    preds = [predict(job, c, device) for c in cands]
    preds.sort(key=lambda p: (not p.fits, p.step_s, p.peak_bytes))
    return SearchResult(preds, len(preds), exhaustive)


def homogeneous(job: Job, world_size: int, microbatches: int = 1) -> Candidate | None:
    """Every module colocated on every rank, dp = world (the usual single-layout baseline), or
    None when the batch does not split that way."""
    if job.batch_size % (world_size * microbatches):
        return None
    par = Parallelism(dp=world_size)
    return Candidate.of({n: par for n in job.names}, {n: 0 for n in job.names}, microbatches)
