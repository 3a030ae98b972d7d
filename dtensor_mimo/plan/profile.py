"""What the planner knows about a job and a machine: plain dataclasses, no torch.

A `ModuleProfile` holds one module's costs as functions of the rows ("tokens") one rank feeds it
per call: a transformer block's forward and backward seconds (`Affine`: fixed per call + per
token), the rest of the module (embeddings, head, projection) likewise, parameter counts and the
activation bytes a block keeps per token for its backward. Measured profiles come from
`dtensor_mimo.plan.measure` (seconds on this machine), analytic ones from
`dtensor_mimo.plan.paper` (FLOPs over a GPU's throughput); the cost model cannot tell them apart.

A `DeviceProfile` holds the machine: memory per rank, ranks per node, the latency and bandwidth
of a link inside a node and between nodes, the optimizer's seconds per parameter, and — on a CPU
host whose ranks share cores — how many cores they share.

Every class converts to and from JSON-ready dicts (`to_dict` / `from_dict`): profiles are cached
in a file and can be written by hand for a machine the planner cannot measure.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

LANGUAGE = "language"
"""The language module's name, as in the trainer."""


@dataclass(frozen=True)
class Affine:
    """``seconds = fixed + per_token * tokens``: one call's time, fitted to measured points.

    The fixed part is what a call costs whatever its size (kernel launches, Python, dispatch); it
    does not shrink when tp or cp cut the tokens, which is why small models do not speed up.
    """

    fixed: float = 0.0
    per_token: float = 0.0

    def __post_init__(self) -> None:
        for key in ("fixed", "per_token"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Affine: {key}={value!r} must be a finite number of seconds >= 0")

    def __call__(self, tokens: float) -> float:
        return self.fixed + self.per_token * tokens

    def scaled(self, factor: float) -> "Affine":
        return Affine(self.fixed * factor, self.per_token * factor)

    @classmethod
    def fit(cls, points: Sequence[tuple[float, float]]) -> "Affine":
        """Least-squares line through ``(tokens, seconds)`` points, both parts clamped to >= 0."""
        if not points:
            raise ValueError("Affine.fit needs at least one (tokens, seconds) point")
        if len(points) == 1 or len({x for x, _ in points}) == 1:
            x, y = points[0][0], sum(p[1] for p in points) / len(points)
            return cls(0.0, y / x) if x else cls(y, 0.0)
        n = len(points)
        mx = sum(x for x, _ in points) / n
        my = sum(y for _, y in points) / n
        sxx = sum((x - mx) ** 2 for x, _ in points)
        slope = sum((x - mx) * (y - my) for x, y in points) / sxx
        if slope < 0:
            return cls(max(my, 0.0), 0.0)
        fixed = my - slope * mx
        if fixed < 0:  # through the origin instead
            slope = sum(x * y for x, y in points) / sum(x * x for x, _ in points)
            fixed = 0.0
        return cls(fixed, slope)


@dataclass(frozen=True)
class ModuleProfile:
    """One module's costs on one rank at tp = cp = 1.

    Attributes:
        name: the module's name (an encoder's, or "language").
        n_layers: transformer blocks (the pipeline cuts these).
        tokens_per_sample: rows the module processes per sample of the global batch (language: the
            sequence length; an encoder: its mean items per sample x tokens per item).
        block_forward: one block's forward, seconds vs tokens on the rank.
        block_backward: one block's backward (zero for a frozen tower: it runs forward only).
        rest_forward: everything else in forward (embeddings, norm, head and loss; patch embedding
            and projection), seconds vs tokens.
        rest_backward: its backward.
        block_params: parameters of one block.
        rest_params: the other parameters.
        trainable_params: parameters that train (a frozen tower's projection only).
        tied_params: of the rest, those a tied decoder holds under two names (its token embedding,
            which is its output head: `LlamaConfig.tie_embeddings`). Cut into pipeline stages it
            trains the head as a copy (`untie_for_stages`): a rank holding the first and the last
            stage (a V schedule's first pp rank, virtual stages at pp = 1) holds both, with their
            gradients and optimizer state.
        activation_bytes_per_token: bytes one block keeps for backward per token (0 when frozen).
        width: features of the rows the module sends on (encoders: the projection's output, what
            crosses the bridge; language: its hidden size, what crosses between pp stages).
        tp_divides: sizes a tp degree must divide (heads, hidden widths, vocabulary).
        cp: whether context parallel applies (the language model only).
        fsdp: parameters sharded over dp·cp (FSDP2), gathered per forward (and per backward when
            `reshard_after_forward`).
        reshard_after_forward: FSDP2 gathers again for the backward.
        param_bytes: bytes of one parameter (and of its gradient).
        gather_bytes: bytes of one parameter as FSDP2 all-gathers it: its ``param_dtype`` under
            mixed precision (`MixedPrecisionPolicy`); None: `param_bytes`.
        reduce_bytes: bytes of one gradient element as dp reduces it (FSDP2's reduce-scatter or the
            all-reduce without FSDP): `ParallelOptions.gradient_reduce_dtype`'s; None: `param_bytes`.
        hidden: the block's hidden size: tp all-reduces tokens x hidden activations twice per block
            forward and twice backward (Megatron-style), cp gathers keys and values of that width.
        act_bytes: bytes of one activation element (what tp, cp and pp move): the module's
            compute dtype (`ParallelOptions.param_dtype` under mixed precision); the language
            model's is also what crosses the bridge, for every encoder.
        load: preparing the module's inputs on a rank (decoding, feature extraction), seconds vs
            samples whose items the rank prepares.
        fsdp_forward_s, fsdp_backward_s: FSDP2's own cost per block call (hooks, bookkeeping),
            beyond its collectives.
        tp_forward_s, tp_backward_s: DTensor tensor parallel's own cost per block call (dispatch),
            beyond its collectives.
        one_call: an encoder that, in the colocated three phases, runs every microbatch's items
            in one call (`dtensor_mimo.schedule.encoders.LocalEncoders`: the library's encoders,
            not in float8 nor recomputed): its per-call work is paid once a step, not once a
            microbatch.
        compiled_whole: compiled whole (``compile_scope="module"``): the library refuses FSDP2
            sharding it (dp·cp > 1 with `fsdp`) and cutting it into pipeline stages.
        cuda_graphs: replays CUDA graphs (`ParallelOptions.compile_mode`): the library refuses
            FSDP2 sharding it and tp or cp > 1.
        colocated_only: an encoder recomputed in the colocated three phases
            (`ParallelOptions.recompute_colocated`): it must share ranks with the language model.
        compiled: compiled at all (`ParallelOptions.compile`, either scope): the library refuses
            a compiled encoder at tp > 1 recomputed over microbatches (`colocated_only`), and at
            tp > 1 on items of their own size (`varied`).
        varied: an encoder whose items have their own sizes (a list, one tensor per item:
            dynamic resolution, variable-length clips, video).
        tensor_parallel: the module has a tensor parallel plan (the library's, or its own
            ``parallelize``): tp > 1 is possible at all (`dtensor_mimo.models.protocol`).
    """

    name: str
    n_layers: int
    tokens_per_sample: float
    block_forward: Affine
    block_backward: Affine
    rest_forward: Affine
    rest_backward: Affine
    block_params: int
    rest_params: int
    trainable_params: int
    activation_bytes_per_token: float
    width: int
    hidden: int
    tp_divides: tuple[int, ...] = ()
    cp: bool = False
    fsdp: bool = True
    reshard_after_forward: bool = True
    param_bytes: int = 4
    act_bytes: int = 4
    gather_bytes: int | None = None
    reduce_bytes: int | None = None
    load: Affine = field(default_factory=Affine)
    fsdp_forward_s: float = 0.0
    fsdp_backward_s: float = 0.0
    tp_forward_s: float = 0.0
    tp_backward_s: float = 0.0
    one_call: bool = False
    compiled_whole: bool = False
    cuda_graphs: bool = False
    colocated_only: bool = False
    compiled: bool = False
    varied: bool = False
    tensor_parallel: bool = True
    tied_params: int = 0

    @property
    def params(self) -> int:
        return self.block_params * self.n_layers + self.rest_params

    @property
    def trainable(self) -> bool:
        return self.trainable_params > 0

    @property
    def blocks_train(self) -> bool:
        """Whether its blocks take gradients (a frozen tower's do not: its projection alone may train)."""
        return self.trainable_params > self.rest_params

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModuleProfile":
        data = dict(data)
        for key in ("block_forward", "block_backward", "rest_forward", "rest_backward", "load"):
            data[key] = Affine(**data[key])
        data["tp_divides"] = tuple(data.get("tp_divides", ()))
        return cls(**data)


@dataclass(frozen=True)
class Link:
    """A point-to-point link: ``seconds = latency_s + bytes / bandwidth`` per message; each step
    of a collective's ring over it costs `collective_s` more (a rank waiting for its ring
    neighbour, busy computing, to be scheduled on a host with fewer cores than ranks: every step of
    a larger group waits again; 0 on dedicated devices)."""

    latency_s: float
    bandwidth: float
    """bytes per second, one direction"""
    collective_s: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.bandwidth, (int, float)) and math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise ValueError(f"Link: bandwidth={self.bandwidth!r} must be a finite number of bytes per second > 0")
        for key in ("latency_s", "collective_s"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Link: {key}={value!r} must be a finite number of seconds >= 0")

    def time(self, nbytes: float, messages: int = 1) -> float:
        return messages * self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class DeviceProfile:
    """The machine a layout runs on.

    Attributes:
        name: a label ("this CPU", "H100").
        memory_bytes: memory per rank (None: no limit checked).
        ranks_per_node: ranks that share the fast links (a node); groups beyond it use `inter`.
        intra: a link inside a node.
        inter: a link between nodes.
        optimizer: AdamW's seconds vs trainable parameters on a rank (per module).
        cores: ranks share this many cores (a CPU host): a step takes at least the ranks' summed
            busy time over `cores`. None: every rank has its own device.
        peak_flops: a rank's peak FLOP/s (analytic profiles; informational here).
        microbatch_s: the runtime's own busy time per microbatch on each module's ranks (schedule
            bookkeeping, stage and bridge calls, hooks), beyond the blocks' compute.
        step_s: the runtime's own busy time per step on every rank (the step's all-reduces,
            gradient clipping, Python around the step).
    """

    name: str
    intra: Link
    inter: Link
    memory_bytes: float | None = None
    ranks_per_node: int = 8
    optimizer: Affine = field(default_factory=Affine)
    cores: int | None = None
    peak_flops: float = 0.0
    microbatch_s: float = 0.0
    step_s: float = 0.0

    def link(self, ranks: Sequence[int]) -> Link:
        """The slowest link a group of global ranks communicates over."""
        nodes = {r // self.ranks_per_node for r in ranks}
        return self.intra if len(nodes) <= 1 else self.inter

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DeviceProfile":
        data = dict(data)
        data["intra"], data["inter"] = Link(**data["intra"]), Link(**data["inter"])
        data["optimizer"] = Affine(**data.get("optimizer", {}))
        return cls(**data)


@dataclass(frozen=True)
class Job:
    """What is trained: the modules (encoders in the layout's order, then the language model),
    the global batch and the language pipeline's schedule.

    Attributes:
        modules: one profile per module; the language model's name is `language`.
        batch_size: samples per global batch.
        schedule: the language pipeline's torch schedule (`PipelineConfig.schedule`).
        virtual_stages: stages per pp rank (`PipelineConfig.virtual_stages`).
        language: the language module's name.
        rows: building the global batch's token rows on every rank, seconds vs samples.
        split: the language model's layers per stage (`PipelineConfig.split`; None: even): only
            layouts of ``len(split)`` stages take it, costed on its layers.
    """

    modules: tuple[ModuleProfile, ...]
    batch_size: int
    schedule: str = "1F1B"
    virtual_stages: int = 1
    language: str = LANGUAGE
    rows: Affine = field(default_factory=Affine)
    split: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", tuple(self.modules))
        if self.split is not None:
            object.__setattr__(self, "split", tuple(self.split))
        names = [m.name for m in self.modules]
        if self.language not in names:
            raise ValueError(f"Job: no module named {self.language!r} among {names}")
        if len(set(names)) != len(names):
            raise ValueError(f"Job: module names repeat: {names}")
        if not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            raise ValueError(f"Job: batch_size={self.batch_size!r} must be an integer >= 1")
        lang = self.lang
        if not any((lang.block_forward(1), lang.rest_forward(1))):
            raise ValueError(f"Job: the language module {self.language!r} costs nothing (its block_forward and "
                             "rest_forward are both 0): a hand-written profile needs its forward times in seconds")

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.modules]

    @property
    def encoders(self) -> list[ModuleProfile]:
        return [m for m in self.modules if m.name != self.language]

    def module(self, name: str) -> ModuleProfile:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(f"no module {name!r} in the job; modules are {self.names}")

    @property
    def lang(self) -> ModuleProfile:
        return self.module(self.language)

    def to_dict(self) -> dict[str, Any]:
        return {"modules": [m.to_dict() for m in self.modules], "batch_size": self.batch_size,
                "schedule": self.schedule, "virtual_stages": self.virtual_stages, "language": self.language,
                "rows": dataclasses.asdict(self.rows), "split": list(self.split) if self.split else None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Job":
        data = dict(data)
        data["modules"] = tuple(ModuleProfile.from_dict(m) for m in data["modules"])
        data["rows"] = Affine(**data.get("rows", {}))
        return cls(**data)
