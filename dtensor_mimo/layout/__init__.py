"""Layout layer: per-module parallel sizes, rank maps, and DeviceMeshes."""

from dtensor_mimo.layout.layout import LANGUAGE, LayoutError, MimoLayout
from dtensor_mimo.layout.parallelism import MESH_DIMS, Parallelism

__all__ = ["LANGUAGE", "MESH_DIMS", "LayoutError", "MimoLayout", "Parallelism"]
