"""`Candidate`: one layout the planner considers — each module's `Parallelism` and first rank, and
the number of microbatches — with its forms for the library (`MimoLayout`, `PipelineConfig`) and
for the trainer (``--layout.<module>.<key>`` overrides, the ``--json`` entry)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from dtensor_mimo.layout import MimoLayout, Parallelism
from dtensor_mimo.layout.parallelism import FIELDS


@dataclass(frozen=True)
class Candidate:
    """A layout and a microbatch count.

    Attributes:
        modules: ``((name, Parallelism), ...)`` in the job's module order.
        offsets: ``((name, first rank), ...)`` in the same order.
        microbatches: `PipelineConfig.microbatches`.
    """

    modules: tuple[tuple[str, Parallelism], ...]
    offsets: tuple[tuple[str, int], ...]
    microbatches: int

    @classmethod
    def of(cls, modules: Mapping[str, Parallelism], offsets: Mapping[str, int], microbatches: int) -> "Candidate":
        return cls(tuple(modules.items()), tuple((n, offsets[n]) for n in modules), microbatches)

    @property
    def parallelisms(self) -> dict[str, Parallelism]:
        return dict(self.modules)

    @property
    def offset_of(self) -> dict[str, int]:
        return dict(self.offsets)

    @property
    def world_size(self) -> int:
        return max(o + p.size for (_, p), (_, o) in zip(self.modules, self.offsets))

    def layout(self, world_size: int | None = None) -> MimoLayout:
        """The `MimoLayout` (validated by its own constructor)."""
        return MimoLayout(self.parallelisms, offsets=self.offset_of, world_size=world_size)

    def shares_ranks(self, a: str, b: str) -> bool:
        pa, pb, o = self.parallelisms[a], self.parallelisms[b], self.offset_of
        return o[a] == o[b] and pa.size == pb.size

    def describe(self) -> str:
        """``vision dp2 @0 | audio dp2 @0 | language tp2·dp2 @2``: sizes and first ranks."""
        return " | ".join(f"{n} {p} @{o}" for (n, p), (_, o) in zip(self.modules, self.offsets))

    def as_json(self) -> dict[str, Any]:
        """The ``--json`` entry's layout and microbatches (trainer keys)."""
        layout = {n: {**{d: getattr(p, d) for d in FIELDS}, "offset": o}
                  for (n, p), (_, o) in zip(self.modules, self.offsets)}
        return {"layout": layout, "microbatches": self.microbatches}

    def overrides(self) -> list[str]:
        """The trainer's command-line overrides for this candidate."""
        return overrides_of(self.as_json())


def overrides_of(entry: Mapping[str, Any]) -> list[str]:
    """``--layout.<module>.<key> VALUE ... --pipeline.microbatches M`` from a ``--json`` entry."""
    out: list[str] = []
    for name, keys in entry["layout"].items():
        for key in (*FIELDS, "offset"):  # (an entry written before HSDP has no dp_replicate: 1)
            out += [f"--layout.{name}.{key}", str(keys.get(key, 1) if key == "dp_replicate" else keys[key])]
    return out + ["--pipeline.microbatches", str(entry["microbatches"])]
