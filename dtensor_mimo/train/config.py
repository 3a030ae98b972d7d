"""The trainer's typed configuration: dataclasses, TOML files, dotted command-line overrides.

Pure logic, no process group: a config is parsed and checked (keys, types, accepted values, that
the layout is valid and fits the world, that batch sizes divide) before any process starts.

    python -m dtensor_mimo.train --config examples/digits.toml --train.steps 40 \
        --layout.language.tp 2 --checkpoint.dir ckpt --checkpoint.every 20 --metrics.jsonl m.jsonl

An override's value is read as a TOML value (``40``, ``1e-3``, ``true``, ``"cosine"``,
``[1, 2]``, ``{vision = 1e-4}``); a bare word that is not valid TOML is taken as a string.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

MODULES = ("vision", "audio", "language")
"""The digits model's modules, in the order their ranks are laid out by default."""


class ConfigError(ValueError):
    """A config key or value the trainer cannot use; the message names the key and the fix."""


@dataclass
class ModuleLayout:
    """One module's parallel sizes and its first rank.

    Attributes:
        pp, dp, cp, tp: pipeline, data, context and tensor parallel sizes (encoders: pp and cp 1
            are the tested ones; cp is for the language model).
        offset: the module's first rank; None: after the previous module's ranks (disjoint). Give
            two modules the same offset and size to colocate them.
    """

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    offset: int | None = None


@dataclass
class LayoutConfig:
    """Where each module runs. The default is heterogeneous: each encoder on a rank of its own,
    the language model on a third."""

    vision: ModuleLayout = field(default_factory=ModuleLayout)
    audio: ModuleLayout = field(default_factory=ModuleLayout)
    language: ModuleLayout = field(default_factory=ModuleLayout)
    bridge_hops: Literal[1, 2] | None = None
    """How encoder rows cross to the language model and gradients back (`MimoModel`'s
    ``bridge_hops``): none chooses per direction (two hops across nodes where the receiving ranks
    replicate the rows or the gradient is Partial), 1 or 2 forces."""


@dataclass
class ModuleOptions:
    """`dtensor_mimo.ParallelOptions` of one module (see there)."""

    sp: bool = False
    fsdp: bool = True
    compile: bool = True
    compile_backend: str = "inductor"
    reshard_after_forward: bool = True
    activation_checkpointing: int = 0
    param_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    reduce_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    loss_parallel: bool = True


@dataclass
class OptionsConfig:
    vision: ModuleOptions = field(default_factory=ModuleOptions)
    audio: ModuleOptions = field(default_factory=ModuleOptions)
    language: ModuleOptions = field(default_factory=ModuleOptions)


@dataclass
class PipelineSection:
    """`dtensor_mimo.PipelineConfig`: microbatches of the global batch per step and the language
    model's schedule. One microbatch and pp 1 everywhere: the unpipelined step."""

    microbatches: int = 4
    schedule: Literal["1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"] = "1F1B"
    virtual_stages: int = 1
    split: list[int] | None = None


@dataclass
class ModelConfig:
    """The digits model: a Llama-style decoder, a ViT over the scans, an audio encoder over the
    tones' log-mel spectrograms, each encoder with a projection to the decoder's width.

    Attributes:
        frozen: modules whose weights do not train (forward only), e.g. ``["vision"]``.
        seeds: each module's init seed (`init_weights`); the weights depend on nothing else.
    """

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 128
    encoder_dim: int = 48
    encoder_layers: int = 2
    encoder_heads: int = 4
    encoder_mlp: int = 96
    frozen: list[str] = field(default_factory=list)
    seeds: dict[str, int] = field(default_factory=lambda: {"language": 0, "vision": 10, "audio": 20})


@dataclass
class OptimizerSection:
    """AdamW for every module (`AdamWConfig`), one global clip, warmup + decay (`LRSchedule`).

    Attributes:
        module_lr: per-module peak learning rates replacing `lr`, e.g. ``{vision = 1e-4}``.
        decay: the schedule's shape after warmup, down to ``min_lr_ratio * lr`` at the last step.
        warmup_steps: linear warmup; a run shorter than that warms up for half its steps.
    """

    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    warmup_steps: int = 50
    decay: Literal["constant", "linear", "cosine"] = "cosine"
    min_lr_ratio: float = 0.1
    module_lr: dict[str, float] = field(default_factory=dict)


@dataclass
class DataSection:
    """The digits data (`dtensor_mimo.data.DigitsDataset`).

    Attributes:
        batch_size: samples per global batch (every module takes its dp shard of it).
        heldout_samples: held-out samples scored at each evaluation.
        seed: which samples are drawn, and the sampler's shuffle.
        max_images, max_tones, noise_std: `DigitsTask` fields: how hard the task is.
        workers: loader worker processes per rank decoding this rank's encoder inputs (0: in the
            training process).
        per_rank_loading: a rank decodes only the encoder inputs it encodes (False: every rank
            loads the whole global batch; the same batches, for checking).
    """

    batch_size: int = 32
    heldout_samples: int = 512
    seed: int = 0
    max_images: int = 3
    max_tones: int = 2
    noise_std: float = 0.5
    workers: int = 0
    per_rank_loading: bool = True


@dataclass
class TrainSection:
    """Attributes:
        steps: optimizer steps of the whole run (a resumed run stops at the same step).
        eval_every: steps between held-out evaluations (0: only at the end).
        device: "cpu" (gloo) or "cuda" (NCCL, one GPU per rank).
        threads: torch intra-op threads per rank (0: torch's default); local ranks share the cores.
        generate: held-out samples captioned with greedy decoding at the end.
    """

    steps: int = 1500
    eval_every: int = 0
    device: Literal["cpu", "cuda"] = "cpu"
    threads: int = 1
    generate: int = 3


@dataclass
class CheckpointSection:
    """Attributes:
        dir: where checkpoints go (``DIR/step-000020``); one already there is resumed from its
            latest step. None: no checkpoints.
        every: steps between saves (0: only at the end of the run).
        keep: the most recent checkpoints kept; older ones are deleted after a save.
        load: a checkpoint directory to start from (weights, optimizer, position) when `dir`
            holds none, e.g. one saved under another layout.
    """

    dir: str | None = None
    every: int = 0
    keep: int = 2
    load: str | None = None


@dataclass
class MetricsSection:
    """Attributes:
        jsonl: a file getting one JSON object per logged step (step, loss, grad_norm,
            tokens_per_s, lr, ...). None: no file.
        tensorboard: a TensorBoard log directory (needs the `tensorboard` package). None: off.
        log_every: steps between log lines (and JSONL records).
        progress: a progress bar: "auto" shows one on an interactive terminal.
        peak_tflops: the accelerator's peak dense TFLOP/s per rank for MFU; 0: a known GPU's
            (H100/H200/A100 bf16) or none on CPU (MFU then not reported).
    """

    jsonl: str | None = None
    tensorboard: str | None = None
    log_every: int = 50
    progress: Literal["auto", "on", "off"] = "auto"
    peak_tflops: float = 0.0


@dataclass
class TrainerConfig:
    """Everything `python -m dtensor_mimo.train` reads; see the section classes."""

    layout: LayoutConfig = field(default_factory=LayoutConfig)
    options: OptionsConfig = field(default_factory=OptionsConfig)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)

    def describe(self) -> str:
        """The resolved config, one line per section (printed at start)."""
        lines = []

        def walk(obj: Any, prefix: str) -> None:
            scalars = []
            for f in dataclasses.fields(obj):
                value = getattr(obj, f.name)
                if dataclasses.is_dataclass(value):
                    walk(value, f"{prefix}{f.name}.")
                else:
                    scalars.append(f"{f.name}={value!r}")
            if scalars:
                lines.append(f"  {prefix.rstrip('.')}: " + " ".join(scalars))

        walk(self, "")
        return "config:\n" + "\n".join(lines)


# ---------------------------------------------------------------------------- reading values


def _describe(tp: Any) -> str:
    """How a field's accepted values read in an error."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("none (leave the key out)" if a is type(None) else _describe(a) for a in args)
    if origin is list:
        return f"a list of {_describe(args[0])}"
    if origin is dict:
        return f"a table of {_describe(args[1])} by name"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """`value` as the field type `tp`, or a ConfigError naming `key` and what it accepts."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = ConfigError(f"{key} = {value!r}: expected {_describe(tp)}")
    if origin is Literal:
        if not any(value == a and type(value) is type(a) for a in args):  # True is not 1
            raise bad
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, value, a)
            except ConfigError:
                pass
        raise bad
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise bad
        return [_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise bad
        return {str(k): _coerce(f"{key}.{k}", v, args[1]) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    raise TypeError(f"config field {key} has a type the reader does not know: {tp}")


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _merge(obj: Any, data: Mapping[str, Any], prefix: str) -> None:
    """Set `obj`'s fields (a dataclass tree) from nested `data`, checking every key and value."""
    known = _fields(type(obj))
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(f"unknown key {path!r}; {prefix.rstrip('.') or 'the config'} has "
                              f"{', '.join(known)}")
        tp = known[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{path} is a section ({', '.join(_fields(tp))}), got {value!r}")
            _merge(getattr(obj, key), value, f"{path}.")
        else:
            setattr(obj, key, _coerce(path, value, tp))


def _toml_value(text: str) -> Any:
    """A command-line value read as TOML (``40``, ``true``, ``[1, 2]``), else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


def parse_args(argv: Sequence[str]) -> TrainerConfig:
    """The config from ``--config FILE.toml`` (optional) and ``--section.key value`` overrides,
    applied in order; then `check_config`. Raises ConfigError (unknown key, bad value)."""
    config = TrainerConfig()
    args = list(argv)
    overrides: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: options are --config FILE.toml and "
                              "--section.key VALUE (see --help)")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"{arg} needs a value")
            value, i = args[i + 1], i + 1
        i += 1
        if name == "config":
            try:
                with open(value, "rb") as f:
                    _merge(config, tomllib.load(f), "")
            except OSError as e:
                raise ConfigError(f"--config {value}: {e.strerror}") from None
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"--config {value}: not valid TOML: {e}") from None
        else:
            overrides.append((name, value))
    for name, value in overrides:  # after the file, whatever the order on the line
        _merge(config, _nest(name, _toml_value(value)), "")
    check_config(config)
    return config


def help_text() -> str:
    """Every key with its default and accepted values, for ``--help``."""
    lines = ["usage: python -m dtensor_mimo.train [--config FILE.toml] [--section.key VALUE ...]",
             "", "Trains the digits MIMO model; prints the held-out accuracy. Keys (default):"]

    def walk(obj: Any, prefix: str) -> None:
        for name, tp in _fields(type(obj)).items():
            value = getattr(obj, name)
            if dataclasses.is_dataclass(tp):
                walk(value, f"{prefix}{name}.")
            else:
                lines.append(f"  --{prefix}{name:<28} {value!r:<22} {_describe(tp)}")

    walk(TrainerConfig(), "")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- checks


def build_layout(config: TrainerConfig, world_size: int | None = None):
    """The `MimoLayout` of `config.layout` (a ConfigError names the problem)."""
    from dtensor_mimo.layout import MimoLayout, Parallelism

    sections = {n: getattr(config.layout, n) for n in MODULES}
    try:
        pars = {n: Parallelism(pp=s.pp, dp=s.dp, cp=s.cp, tp=s.tp) for n, s in sections.items()}
        offsets = None
        if any(s.offset is not None for s in sections.values()):
            offsets, nxt = {}, 0
            for n, s in sections.items():
                offsets[n] = nxt if s.offset is None else s.offset
                nxt = offsets[n] + pars[n].size
        return MimoLayout(pars, offsets=offsets, world_size=world_size)
    except ValueError as e:
        raise ConfigError(f"layout: {e}") from None


def check_config(config: TrainerConfig, world_size: int | None = None) -> None:
    """Everything that can be checked without processes: values in range, module names, the
    layout and its fit to `world_size` (when given), batch divisibility, sequence length."""
    def positive(key: str, value: int | float, minimum: int = 1) -> None:
        if value < minimum:
            raise ConfigError(f"{key} = {value!r}: must be >= {minimum}")

    for key in ("model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.ffn_hidden",
                "model.encoder_dim", "model.encoder_layers", "model.encoder_heads", "model.encoder_mlp",
                "data.batch_size", "data.heldout_samples", "train.steps", "metrics.log_every",
                "checkpoint.keep", "pipeline.microbatches", "pipeline.virtual_stages"):
        section, name = key.split(".")
        positive(key, getattr(getattr(config, section), name))
    for key in ("train.eval_every", "train.threads", "train.generate", "checkpoint.every", "data.workers",
                "data.max_images", "data.max_tones", "optimizer.warmup_steps"):
        section, name = key.split(".")
        positive(key, getattr(getattr(config, section), name), 0)
    if config.model.n_heads % config.model.n_kv_heads or config.model.dim % config.model.n_heads:
        raise ConfigError(f"model: dim={config.model.dim}, n_heads={config.model.n_heads}, n_kv_heads="
                          f"{config.model.n_kv_heads}: n_heads must divide dim and be a multiple of n_kv_heads")
    if config.model.encoder_dim % config.model.encoder_heads:
        raise ConfigError(f"model.encoder_heads = {config.model.encoder_heads} must divide "
                          f"model.encoder_dim = {config.model.encoder_dim}")
    for key, names in (("model.frozen", config.model.frozen), ("model.seeds", list(config.model.seeds)),
                       ("optimizer.module_lr", list(config.optimizer.module_lr))):
        unknown = [n for n in names if n not in MODULES]
        if unknown:
            raise ConfigError(f"{key} names {unknown}: the modules are {list(MODULES)}")
    if "language" in config.model.frozen:
        raise ConfigError("model.frozen = ['language']: the language model always trains; freeze "
                          "encoders only")
    if len(config.optimizer.betas) != 2 or not all(0 <= b < 1 for b in config.optimizer.betas):
        raise ConfigError(f"optimizer.betas = {config.optimizer.betas}: expected two numbers in [0, 1)")

    layout = build_layout(config, world_size)  # with world_size: no rank left over, none missing
    from dtensor_mimo.parallelize import ParallelOptions

    for name in MODULES:
        par = layout.parallelism(name)
        try:
            ParallelOptions(**dataclasses.asdict(getattr(config.options, name))).check_for(name, par.tp)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"options.{name}: {e}") from None
        if name != "language" and (par.cp > 1 or par.pp > 1):
            raise ConfigError(f"layout.{name}: pp={par.pp}, cp={par.cp}: encoders take pp = 1 and cp = 1 "
                              "in the trainer (their evaluation runs unpipelined)")
    pipe, lang = config.pipeline, layout.parallelism("language")
    if lang.pp > 1 and config.pipeline.microbatches < lang.pp:
        raise ConfigError(f"pipeline.microbatches = {pipe.microbatches} is below layout.language.pp = "
                          f"{lang.pp}; give at least as many microbatches as stages")
    per_mb, rem = divmod(config.data.batch_size, pipe.microbatches)
    if rem or per_mb % lang.dp:
        raise ConfigError(f"data.batch_size = {config.data.batch_size} must split into pipeline.microbatches "
                          f"= {pipe.microbatches} microbatches of a multiple of layout.language.dp = {lang.dp} "
                          f"samples; e.g. data.batch_size = {pipe.microbatches * lang.dp * max(1, per_mb // lang.dp)}")
    try:
        from dtensor_mimo.schedule import PipelineConfig

        PipelineConfig(microbatches=pipe.microbatches, schedule=pipe.schedule,
                       virtual_stages=pipe.virtual_stages,
                       split=tuple(pipe.split) if pipe.split is not None else None)
    except ValueError as e:
        raise ConfigError(f"pipeline: {e}") from None
