"""Data layer: a global MIMO batch, each module's dp shard of it, per-sample modality token counts."""

from dtensor_mimo.data.batch import (
    IGNORE_INDEX,
    BatchError,
    MimoBatch,
    ModalityInputs,
    ModalitySpec,
    SyntheticSpec,
    microbatches,
    sample_range,
    shard,
    synthetic_batch,
)

__all__ = [
    "IGNORE_INDEX",
    "BatchError",
    "MimoBatch",
    "ModalityInputs",
    "ModalitySpec",
    "SyntheticSpec",
    "microbatches",
    "sample_range",
    "shard",
    "synthetic_batch",
]
