"""Schedule layer: the language model's torch pipeline stages, the encoders' parts, and the step
as data (`program`: this rank's actions for a training step, a forward or a prediction) run by
one executor (`execute`)."""

from dtensor_mimo.schedule.config import (
    SCHEDULES,
    V_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    PipelineConfig,
    check_microbatching,
    check_pipeline_layout,
    rank_stages,
    stage_layers,
    stage_rank,
)
from dtensor_mimo.schedule.checks import check_batch, check_model
from dtensor_mimo.schedule.crossing import Crossing
from dtensor_mimo.schedule.encoders import EncoderPipeline, EncoderStage, keep_encoder_stage
from dtensor_mimo.schedule.language import LanguagePipeline, LanguageStage, llama_stage, stage_inputs
from dtensor_mimo.schedule.order import crossing_order, crossing_window
from dtensor_mimo.schedule.executor import RankParts, StepResult, execute
from dtensor_mimo.schedule.program import Action, RankRoles, StepShape, format_program, program

__all__ = [
    "Action",
    "RankParts",
    "RankRoles",
    "StepResult",
    "StepShape",
    "execute",
    "format_program",
    "SCHEDULES",
    "V_SCHEDULES",
    "ZERO_BUBBLE_SCHEDULES",
    "Crossing",
    "EncoderPipeline",
    "EncoderStage",
    "LanguagePipeline",
    "LanguageStage",
    "PipelineConfig",
    "check_batch",
    "check_microbatching",
    "check_model",
    "check_pipeline_layout",
    "crossing_order",
    "crossing_window",
    "keep_encoder_stage",
    "llama_stage",
    "program",
    "rank_stages",
    "stage_inputs",
    "stage_layers",
    "stage_rank",
]
