"""dtensor_mimo: multimodal training where every module has its own DeviceMesh."""

from dtensor_mimo.layout import LANGUAGE, LayoutError, MimoLayout, Parallelism

__all__ = ["LANGUAGE", "LayoutError", "MimoLayout", "Parallelism"]
