"""`Parallelism`: the pp/dp/cp/tp sizes of one module, validated in pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any, Mapping

MESH_DIMS: tuple[str, ...] = ("pp", "dp", "cp", "tp")
"""Mesh dimension names, outermost first: tp varies fastest over consecutive ranks."""
FIELDS: tuple[str, ...] = (*MESH_DIMS, "dp_replicate")
"""Every `Parallelism` field: the mesh sizes, then how FSDP2 groups the dp·cp ranks."""
HSDP_DIMS: tuple[str, str] = ("dp_replicate", "dp_shard_cp")
"""The dims of a module's HSDP mesh (``dp_replicate > 1``): replica groups, then the dp·cp ranks
one replica's shards span."""


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
        dp_replicate: HSDP where FSDP2 shards the module: this many replica groups of its dp ranks,
            each sharding the parameters over its dp / dp_replicate · cp ranks, the gradient
            shards all-reduced across the groups. The groups are runs of consecutive dp ranks
            (with their cp ranks): their all-gathers and reduce-scatters stay on one node when
            ``dp / dp_replicate * cp * tp`` ranks fit in it. torchtitan's
            ``data_parallel_replicate_degree``; 1 (default): shard over all dp·cp ranks. Must
            divide dp; the data, the loss and every other dp rule are unchanged (dp is still the
            number of data-parallel ranks). Needs FSDP2 (``ParallelOptions(fsdp=True)``).
    """

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    dp_replicate: int = 1

    def __post_init__(self) -> None:
        for dim in FIELDS:
            value = getattr(self, dim)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"Parallelism.{dim} must be an integer >= 1, got {value!r}"
                )
        if self.dp % self.dp_replicate:
            raise ValueError(f"Parallelism.dp_replicate={self.dp_replicate} must divide dp={self.dp} (HSDP: dp "
                             "ranks in dp_replicate groups of equal size, each sharding the parameters)")

    @classmethod
    def from_mapping(cls, sizes: Mapping[str, Any], *, module: str = "?") -> "Parallelism":
        """Build from ``{"tp": 2, "dp": 4}``; unknown dims name the module and the allowed ones."""
        unknown = sorted(set(sizes) - set(FIELDS))
        if unknown:
            raise ValueError(
                f"module {module!r}: unknown parallel dim(s) {unknown}; "
                f"allowed dims are {list(FIELDS)}"
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

    @property
    def hsdp(self) -> bool:
        """Whether FSDP2 shards within replica groups (`dp_replicate` > 1)."""
        return self.dp_replicate > 1

    def __str__(self) -> str:
        parts = [f"{d}{getattr(self, d)}" + (f"r{self.dp_replicate}" if d == "dp" and self.hsdp else "")
                 for d in ("tp", "cp", "dp", "pp") if getattr(self, d) > 1]
        return "·".join(parts) if parts else "1"
