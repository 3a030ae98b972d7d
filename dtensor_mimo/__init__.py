"""dtensor_mimo: multimodal training where every module has its own DeviceMesh."""

from dtensor_mimo.bridge import Bridge, redistribute, redistribute_many
from dtensor_mimo.layout import LANGUAGE, LayoutError, MimoLayout, Parallelism
from dtensor_mimo.mimo import MimoModel
from dtensor_mimo.parallelize import ParallelOptions
from dtensor_mimo.schedule import PipelineConfig
from dtensor_mimo.layout.world import init_distributed
from dtensor_mimo.optim import AdamWConfig, LRSchedule, MimoOptimizer, StepMetrics, train_step

__all__ = [
    "LANGUAGE",
    "AdamWConfig",
    "Bridge",
    "LRSchedule",
    "LayoutError",
    "MimoLayout",
    "MimoModel",
    "MimoOptimizer",
    "ParallelOptions",
    "Parallelism",
    "PipelineConfig",
    "StepMetrics",
    "init_distributed",
    "redistribute",
    "redistribute_many",
    "train_step",
]
