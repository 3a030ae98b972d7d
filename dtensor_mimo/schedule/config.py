"""`PipelineConfig` and the pure arithmetic of a pipelined step: layers per stage, microbatch sizes.

Nothing here touches torch.distributed, so every rule is checked in one process before any rank
communicates, with messages that name the sizes that would work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dtensor_mimo.layout import LayoutError, MimoLayout

SINGLE_STAGE_SCHEDULES = ("1F1B", "GPipe")
"""torch schedules that run one stage per rank (`PipelineScheduleSingle`)."""
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
"""torch schedules that run `virtual_stages` stages per rank, stage s on pp rank s % pp."""
SCHEDULES = SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble",)
"""Split input/weight backward: torch refuses compiled stage modules for these."""


@dataclass(frozen=True)
class PipelineConfig:
    """How a training step is cut into microbatches and pipelined.

    Attributes:
        microbatches: slices of the GLOBAL batch per step; each module takes its dp shard of
            each slice, so one microbatch crosses the bridge as one contiguous ragged plan.
        schedule: torch's schedule for the language model's pp group: "1F1B", "GPipe",
            "Interleaved1F1B", "LoopedBFS" or "InterleavedZeroBubble" (stages not compiled).
        virtual_stages: stages per pp rank (> 1 needs a multi-stage schedule); the decoder is
            cut into ``pp * virtual_stages`` stages, stage s on pp rank ``s % pp``.
        split: decoder layers per stage (``pp * virtual_stages`` entries, each >= 1, summing to
            ``n_layers``); None: as even as possible, earlier stages taking the remainder.
    """

    microbatches: int = 1
    schedule: str = "1F1B"
    virtual_stages: int = 1
    split: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("microbatches", "virtual_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PipelineConfig.{name} must be an integer >= 1, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"PipelineConfig.schedule={self.schedule!r} is not one of {list(SCHEDULES)}")
        if self.virtual_stages > 1 and self.schedule in SINGLE_STAGE_SCHEDULES:
            raise ValueError(
                f"PipelineConfig: schedule={self.schedule!r} runs one stage per rank but virtual_stages="
                f"{self.virtual_stages}; use one of {list(MULTI_STAGE_SCHEDULES)} or virtual_stages=1"
            )
        if self.split is not None:
            object.__setattr__(self, "split", tuple(self.split))

    def num_stages(self, pp: int) -> int:
        """Stages of a module with pipeline size `pp`."""
        return pp * self.virtual_stages


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
    if len(split) != n_stages or any(not isinstance(n, int) or n < 1 for n in split) or sum(split) != n_layers:
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
            f"samples, microbatches in {ok} work"
        )


def check_pipeline_layout(layout: MimoLayout, language: str, config: PipelineConfig | None = None) -> None:
    """Pipelined layouts that the pipeline runtime serves (pure; encoder stages: `MimoModel`)."""
    pp = layout.parallelism(language).pp
    if config is not None and config.schedule in MULTI_STAGE_SCHEDULES and config.microbatches % pp:
        raise LayoutError(
            f"schedule {config.schedule!r} runs microbatches in rounds of pp={pp}, but microbatches="
            f"{config.microbatches}: use a multiple of {pp}")
    if config is not None and config.schedule == "1F1B" and config.microbatches < pp:
        raise LayoutError(
            f"schedule '1F1B' needs at least as many microbatches as {language!r} has stages (pp={pp}), "
            f"got microbatches={config.microbatches}: use >= {pp}, or schedule='GPipe'")
