"""`Parallelism`: the pp/dp/cp/tp sizes of one module, validated in pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any, Mapping

MESH_DIMS: tuple[str, ...] = ("pp", "dp", "cp", "tp")
"""Mesh dimension names, outermost first: tp varies fastest over consecutive ranks."""


@dataclass(frozen=True)
class Parallelism:
    """Parallel sizes of one module: pipeline, data, context and tensor parallel.

    The module's ranks form a ``pp x dp x cp x tp`` grid with tp varying fastest,
    so consecutive ranks share a tp group (the fastest interconnect), then cp, dp, pp.

    Attributes:
        pp: pipeline stages.
        dp: data-parallel replicas.
        cp: context-parallel ranks (the language model only).
        tp: tensor-parallel ranks.
    """

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for dim in MESH_DIMS:
            value = getattr(self, dim)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"Parallelism.{dim} must be an integer >= 1, got {value!r}"
                )

    @classmethod
    def from_mapping(cls, sizes: Mapping[str, Any], *, module: str = "?") -> "Parallelism":
        """Build from ``{"tp": 2, "dp": 4}``; unknown dims name the module and the allowed ones."""
        unknown = sorted(set(sizes) - set(MESH_DIMS))
        if unknown:
            raise ValueError(
                f"module {module!r}: unknown parallel dim(s) {unknown}; "
                f"allowed dims are {list(MESH_DIMS)}"
            )
        try:
            return cls(**dict(sizes))
        except ValueError as e:
            raise ValueError(f"module {module!r}: {e}") from None

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in ``MESH_DIMS`` order."""
        return tuple(getattr(self, d) for d in MESH_DIMS)

    @property
    def size(self) -> int:
        """Number of ranks the module spans."""
        return prod(self.shape)

    def __str__(self) -> str:
        parts = [f"{d}{getattr(self, d)}" for d in ("tp", "cp", "dp", "pp") if getattr(self, d) > 1]
        return "·".join(parts) if parts else "1"
