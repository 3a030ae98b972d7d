"""`PipelineConfig` and the pure arithmetic of a pipelined step: layers per stage, microbatch sizes.

Nothing here touches torch.distributed, so every rule is checked in one process before any rank
communicates, with messages that name the sizes that would work.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Sequence

from dtensor_mimo.layout import LayoutError, MimoLayout

SINGLE_STAGE_SCHEDULES = ("1F1B", "GPipe")
"""torch schedules that run one stage per rank (`PipelineScheduleSingle`)."""
LOOPED_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
"""torch schedules that run `virtual_stages` stages per rank, looped: stage s on pp rank s % pp."""
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
"""torch schedules that run exactly two stages per rank in a V: pp rank r holds stages r and
2 * pp - 1 - r, so the first and the last stage share pp rank 0."""
MULTI_STAGE_SCHEDULES = LOOPED_SCHEDULES + V_SCHEDULES
SCHEDULES = SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES
"""Every schedule torch's `get_schedule_class` names that runs a training step."""
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""Split backward into an input pass and a weight pass: torch 2.13 would run a compiled block's
whole backward in both (refused with compile, `MimoModel`)."""


def stage_rank(stage: int, n_stages: int, pp: int, placement: str = "loop") -> int:
    """The pp rank that holds `stage` of `n_stages`: looped (``stage % pp``) or V-shaped (down
    the ranks, then back up: ``stage`` for the first pp stages, ``2 * pp - 1 - stage`` for the
    next pp, and so on), as torch's ``generate_stage_to_rank_mapping`` places them."""
    if placement == "loop":
        return stage % pp
    if placement != "v":
        raise ValueError(f"stage placement {placement!r} is not 'loop' or 'v'")
    lap, offset = divmod(stage, pp)
    return offset if lap % 2 == 0 else pp - 1 - offset


def rank_stages(pp_rank: int, n_stages: int, pp: int, placement: str = "loop") -> list[int]:
    """The stages pp rank `pp_rank` holds, in increasing order (`stage_rank` inverted)."""
    return [s for s in range(n_stages) if stage_rank(s, n_stages, pp, placement) == pp_rank]


@dataclass(frozen=True)
class PipelineConfig:
    """How a training step is cut into microbatches and pipelined.

    Attributes:
        microbatches: slices of the GLOBAL batch per step; each module takes its dp shard of
            each slice, so one microbatch crosses the bridge as one contiguous ragged plan.
        schedule: torch's schedule for the language model's pp group, any that
            ``torch.distributed.pipelining`` offers: "1F1B", "GPipe" (one stage per rank);
            "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble" (`virtual_stages` per rank,
            looped); "ZBVZeroBubble", "DualPipeV" (two stages per rank in a V; DualPipeV needs
            at least ``2 * pp`` microbatches). The zero-bubble ones ("InterleavedZeroBubble",
            "ZBVZeroBubble", "DualPipeV") need stages that are not compiled (torch would run a
            compiled block's whole backward in both the input and the weight pass) and torch
            >= 2.13 (2.11's pipelining fails on them).
        virtual_stages: stages per pp rank (> 1 needs a multi-stage schedule, exactly 2 for the
            V schedules); the decoder is cut into ``pp * virtual_stages`` stages.
        split: decoder layers per stage (``pp * virtual_stages`` entries, each >= 1, summing to
            ``n_layers``); None: as even as possible, earlier stages taking the remainder.

    Stage s lives on pp rank `stage_rank` (`placement`): ``s % pp`` (looped), or in a V — pp
    rank r holds stages r and ``2 * pp - 1 - r`` — for the V schedules. Stage 0, which takes the
    encoders' rows, is on pp rank 0 either way; the last stage, which holds the loss, is on pp
    rank ``pp - 1`` looped and on pp rank 0 in a V.
    """

    microbatches: int = 1
    schedule: str = "1F1B"
    virtual_stages: int = 1
    split: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("microbatches", "virtual_stages"):
            value = getattr(self, name)
            if not _layer_count(value):
                raise ValueError(f"PipelineConfig.{name} must be an integer >= 1, got {value!r}")
            object.__setattr__(self, name, int(value))  # (a NumPy integer too)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"PipelineConfig.schedule={self.schedule!r} is not one of {list(SCHEDULES)}")
        if self.virtual_stages > 1 and self.schedule in SINGLE_STAGE_SCHEDULES:
            raise ValueError(
                f"PipelineConfig: schedule={self.schedule!r} runs one stage per rank but virtual_stages="
                f"{self.virtual_stages}; use one of {list(MULTI_STAGE_SCHEDULES)} or virtual_stages=1"
            )
        if self.schedule in V_SCHEDULES and self.virtual_stages != 2:
            raise ValueError(
                f"PipelineConfig: schedule={self.schedule!r} runs exactly two stages per rank (a V: pp "
                f"rank r holds stages r and 2*pp-1-r) but virtual_stages={self.virtual_stages}; set "
                "virtual_stages=2"
            )
        if self.split is not None:
            split = self.split
            counts = () if isinstance(split, (str, bytes)) or not hasattr(split, "__iter__") else tuple(split)
            if not counts or not all(_layer_count(n) for n in counts):
                raise ValueError(
                    f"PipelineConfig.split={split!r}: give decoder layers per stage, integers >= 1, one per "
                    "stage (pp x virtual_stages of them), e.g. split=(3, 1); or None for an even split")
            object.__setattr__(self, "split", tuple(int(n) for n in counts))

    def num_stages(self, pp: int) -> int:
        """Stages of a module with pipeline size `pp`."""
        return pp * self.virtual_stages

    @property
    def placement(self) -> str:
        """How stages sit on the pp ranks: "v" for the V schedules, else "loop"."""
        return "v" if self.schedule in V_SCHEDULES else "loop"

    def stage_rank(self, stage: int, pp: int) -> int:
        """The pp rank that holds `stage` of a module with pipeline size `pp`."""
        return stage_rank(stage, self.num_stages(pp), pp, self.placement)

    def rank_stages(self, pp_rank: int, pp: int) -> list[int]:
        """The stages pp rank `pp_rank` holds, in increasing order."""
        return rank_stages(pp_rank, self.num_stages(pp), pp, self.placement)


def _layer_count(n: object) -> bool:
    """Whether `n` is a stage's count of layers: an integer >= 1, a NumPy one too (a bool is no count)."""
    return isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 1


def stage_layers(n_layers: int, n_stages: int, split: Sequence[int] | None = None,
                 module: str = "language") -> list[range]:
    """Layer indices of each stage of `module`: `split` if given, else as even as possible."""
    if split is None:
        if n_layers < n_stages:
            raise LayoutError(
                f"{module!r} has {n_layers} layers for {n_stages} pipeline stages; every stage needs at "
                f"least one layer: lower its pp (or virtual_stages), or use a deeper model"
            )
        base, extra = divmod(n_layers, n_stages)
        split = [base + (1 if s < extra else 0) for s in range(n_stages)]
    split = list(split)
    if len(split) != n_stages or not all(_layer_count(n) for n in split) or sum(split) != n_layers:
        raise LayoutError(
            f"PipelineConfig.split={tuple(split)} must give {n_stages} stages (pp x virtual_stages) "
            f"at least one layer each, {n_layers} layers in all"
        )
    bounds, start = [], 0
    for n in split:
        bounds.append(range(start, start + n))
        start += n
    return bounds


def check_microbatching(batch_size: int, microbatches: int, language_dp: int, language: str = "language") -> None:
    """The language pipeline's stages have static shapes: every microbatch must give every
    language dp rank the same number of samples."""
    unit = microbatches * language_dp
    if batch_size % unit:
        lo, hi = (batch_size // unit) * unit, -(-batch_size // unit) * unit
        ok = [m for m in range(1, batch_size + 1) if batch_size % (m * language_dp) == 0]
        raise ValueError(
            f"a global batch of {batch_size} samples cannot be cut into {microbatches} microbatches "
            f"x {language!r} dp={language_dp}: the batch size must be a multiple of "
            f"{microbatches}x{language_dp}={unit} (e.g. {lo or unit} or {hi}); with {batch_size} "
            f"samples, these microbatch counts work: {', '.join(map(str, ok))}"
        )


def check_pipeline_layout(layout: MimoLayout, language: str, config: PipelineConfig | None = None) -> None:
    """Pipelined layouts that the pipeline runtime serves (pure; encoder stages: `MimoModel`)."""
    pp = layout.parallelism(language).pp
    if config is not None and config.schedule in LOOPED_SCHEDULES and config.microbatches % pp:
        raise LayoutError(
            f"schedule {config.schedule!r} runs microbatches in rounds of pp={pp}, but microbatches="
            f"{config.microbatches}: use a multiple of {pp}")
    if config is not None and config.schedule == "1F1B" and config.microbatches < pp:
        raise LayoutError(
            f"schedule '1F1B' needs at least as many microbatches as {language!r} has stages (pp={pp}), "
            f"got microbatches={config.microbatches}: use >= {pp}, or schedule='GPipe'")
    if config is not None and config.schedule == "DualPipeV" and config.microbatches < config.num_stages(pp):
        raise LayoutError(
            f"schedule 'DualPipeV' needs at least as many microbatches as {language!r} has stages "
            f"(pp={pp} x 2 = {config.num_stages(pp)}), got microbatches={config.microbatches}: use >= "
            f"{config.num_stages(pp)}, or schedule='ZBVZeroBubble'")
