"""`MimoModel`: encoders and a language model, each on its own mesh, joined by the bridge.

Composition only: the checks (`schedule.checks`), each encoder's part (`schedule.encoders`),
the language model's stages (`schedule.language`: pp = 1 is a one-stage pipeline) and the step
as data (`schedule.program`, run by `schedule.executor`) live in the schedule layer; this class
builds this rank's parts once (`RankParts`) and gives them one face: `run` (a training step,
``model(batch)`` or a prediction, as the same program at different lengths), `forward_backward`,
`model(batch)`, `predict`/`generate`, weights and gradients.
"""

from __future__ import annotations

import numbers
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from dtensor_mimo.bridge import PlanError, exchange
from dtensor_mimo.bridge.hops import check_hops
from dtensor_mimo.data import MimoBatch, microbatches, sample_range, shard
from dtensor_mimo.data.batch import step_fingerprint
from dtensor_mimo.data.balance import CutRule, encoder_cuts, max_over_mean, microbatch_cuts
from dtensor_mimo.layout import LANGUAGE, MimoLayout
from dtensor_mimo.layout.world import check_device_type
from dtensor_mimo.layout.mesh import check_agreement
from dtensor_mimo.models import Llama, ModalityEncoder
from dtensor_mimo.models.layers import flex_backward_problem, named_buffers
from dtensor_mimo.models.hf import hf_parts, plan_hf
from dtensor_mimo.models.protocol import encoder_width, item_rule
from dtensor_mimo.parallelize import (GradientReducer, ParallelOptions, compute_dtype, finish_gradients,
                                      replica_problems, reshard_fsdp_modules)
from dtensor_mimo.parallelize.fp8 import check_fp8, fp8_rows_problem, refresh_fp8_scales
from dtensor_mimo.parallelize.replicas import head_local
from dtensor_mimo.schedule import (EncoderPipeline, LanguagePipeline, LanguageStage, PipelineConfig,
                                   check_microbatching, stage_inputs)
from dtensor_mimo.schedule.checks import bad_loss_weights, check_batch, check_model, ids_outside, overlapped
from dtensor_mimo.schedule.encoders import build_encoder_part, independent_items
from dtensor_mimo.schedule.executor import RankParts, StepResult, execute
from dtensor_mimo.schedule.language import untie_for_stages
from dtensor_mimo.schedule.order import crossing_window
from dtensor_mimo.schedule.program import Action
from dtensor_mimo.sequence import greedy_generate, loss_normalizer

__all__ = ["MimoModel", "StepResult", "check_batch"]


def prepare_batch(batch: MimoBatch, count: int, rules: Sequence[CutRule]) -> None:
    """Derive now, kept with `batch` (`MimoBatch.memo`), what a training step over it derives
    from the whole global batch: its fingerprint, its loss weight and, for `count` microbatches
    and the encoders' cut `rules` (`RankParts.cut_rules`), their item cuts per microbatch. Pure (no
    message, no device), so any thread or loader process can do it ahead of the step
    (`MimoModel.prepare` for a model's own rules)."""
    step_fingerprint(batch)
    loss_normalizer(batch)
    microbatch_cuts(batch, count, rules)


def _to_device(root: nn.Module, device: torch.device) -> None:
    """Move `root` to `device` (a meta module's tensors allocated, uninitialized), keeping each
    parameter registered under several names one parameter: `to_empty` of a plain meta tensor
    makes a new parameter per name (a tied head would then train apart from its embedding)."""
    names: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in root.modules():
        for name, p in module._parameters.items():
            if p is not None:
                names.setdefault(id(p), []).append((module, name))
    if any(p.is_meta for p in root.parameters()):
        root.to_empty(device=device)
    else:
        root.to(device)
    for (first, first_name), *others in (group for group in names.values() if len(group) > 1):
        for module, name in others:
            if module._parameters[name] is not first._parameters[first_name]:
                setattr(module, name, first._parameters[first_name])


class MimoModel(nn.Module):
    """Encoders and a Llama-style language model, each parallelized on its own mesh of `layout`.

    Every rank of the world builds it with the same arguments (the full modules, e.g. built
    from a seed, or on the meta device); each rank keeps, parallelizes and trains only the
    modules it is a member of.

    Args:
        layout: per-module `Parallelism` (encoders: cp 1; pp > 1 on ranks of their own).
        language: the decoder, the library's `Llama` or any module meeting
            `dtensor_mimo.models.protocol` (with pp > 1 cut into stages of its own class, its
            own forward, tp plan and init; what it lacks for that is named up front); its name
            in the layout is `language_name`.
        encoders: ``{modality: encoder}``: a `ModalityEncoder` (library tower + projection) or
            any module meeting `dtensor_mimo.models.protocol`; each name is a layout module and
            a modality of the batches (its special token id comes with the batch).
        options: ``{module: ParallelOptions}`` (sp, FSDP2, compile, ...); missing: the defaults.
        device_type: "cpu" (gloo) or "cuda" (NCCL).
        pipeline: microbatches and the language model's torch schedule (needed for pp > 1).
            None: one microbatch, a one-stage pipeline at pp = 1. Encoders on ranks of their own
            overlap their microbatches with the language model's and keep only the microbatches
            the first language stage has in flight (`dtensor_mimo.schedule.order`).
        bridge_hops: how encoder rows cross and gradients come back, as `redistribute`'s
            ``hops``: None (default) picks per direction (`dtensor_mimo.bridge.hops`: two hops
            across nodes where the receivers replicate the rows), 1 or 2 forces a route.

    Example::

        layout = MimoLayout({"vision": Parallelism(dp=2), "language": Parallelism(tp=2)})
        model = MimoModel(layout, llama, {"vision": ModalityEncoder(vit, Projection(32, 48))},
                          options={"language": ParallelOptions(sp=True)})
        loss_share = model.forward_backward(global_batch)   # every rank, same global batch
        model.reduce_gradients()                            # dp sums without FSDP (returns a problem, if any)
        # or: model(global_batch).backward() at pp = 1 with one microbatch; or use train_step

    The language shares (one per dp·cp coordinate of the last stage; tp ranks hold copies) sum
    to the single-process loss: summed token losses over the global batch's loss tokens.
    """

    def __init__(
        self,
        layout: MimoLayout,
        language: nn.Module,
        encoders: Mapping[str, nn.Module],
        *,
        options: Mapping[str, ParallelOptions] | None = None,
        language_name: str = LANGUAGE,
        device_type: str = "cpu",
        pipeline: PipelineConfig | None = None,
        bridge_hops: int | None = None,
    ) -> None:
        super().__init__()
        refused: Exception | None = None
        try:
            check_model(layout, language, encoders, language_name, options or {}, pipeline)
            check_hops(bridge_hops, "MimoModel bridge_hops")
            check_device_type(device_type, "MimoModel device_type")
            if layout.meshes_ready and layout.mesh_device_type != device_type:  # agreed on every rank
                raise ValueError(f"MimoModel(device_type={device_type!r}) on meshes built for "
                                 f"{layout.mesh_device_type!r} (layout.init_meshes({layout.mesh_device_type!r})): "
                                 "build both for the same device type")
            for name, opts in (options or {}).items():  # torchao and the GPU, before any group is made
                check_fp8(name, opts.fp8, device_type)
        except Exception as e:  # noqa: BLE001 — raised below, on every rank alike
            refused = e
        if not dist.is_initialized():
            if refused is not None:
                raise refused
            raise RuntimeError("MimoModel needs torch.distributed initialised (torchrun + init_process_group)")
        # What every rank must build alike, compared in one all-gather before the first group is
        # made: a rank that differs would wait in another new_group or exchange than its peers. The
        # checks' verdict is one of them: a check that refuses on some ranks only (options that
        # differ, torchao or a GPU's capability on one machine) then fails on every rank, naming
        # them, instead of leaving the others in a collective it never joins.
        try:
            agree = _agreement_parts(language, encoders, options or {}, language_name, device_type, pipeline,
                                     bridge_hops)
        except Exception:  # noqa: BLE001 — arguments the checks refused: their verdict is compared
            if refused is None:
                raise
            agree = {}
        agree["model check"] = None if refused is None else f"{type(refused).__name__}: {refused}"
        if refused is not None or layout.meshes_ready:
            check_agreement({"layout": layout, **agree})
            if refused is not None:
                raise refused
        else:
            layout.init_meshes(device_type, agree)
        untie_for_stages(layout, language, language_name, pipeline)  # (checked and agreed: the model is kept)
        self.layout, self.language_name, self.encoder_names = layout, language_name, list(encoders)
        self.options = {name: (options or {}).get(name, ParallelOptions()) for name in self.module_names}
        self.dim = language.config.dim
        embedding = getattr(language, "tok_embeddings", None)
        self.vocab_size: int | None = getattr(embedding, "num_embeddings", None) or getattr(
            language.config, "vocab_size", None)
        """The rows of the language model's token embedding: every batch's text ids index them."""
        self.device = (torch.device(device_type) if device_type == "cpu"
                       else torch.device(device_type, torch.accelerator.current_device_index()))
        self.rank, self.bridge_hops = dist.get_rank(), bridge_hops
        self.pipeline = pipeline if pipeline is not None else PipelineConfig()
        # Known on every rank: whether each encoder trains (ranks off its mesh join its backward),
        # its item rule (batches are checked everywhere), and which modules lack init_weights.
        self._trainable = {n: any(p.requires_grad for p in e.parameters()) for n, e in encoders.items()}
        trainable = {**self._trainable, language_name: any(p.requires_grad for p in language.parameters())}
        # A frozen language model's backward still carries the gradients of the encoders that train
        # (the encoder rows carry gradients into it)
        backward_through_language = any(trainable.values())
        carries = {**trainable, language_name: backward_through_language}
        trains_fp16 = [n for n in self.module_names if self.options[n].param_dtype == torch.float16 and carries[n]]
        if trains_fp16:
            # fp16 keeps 5 exponent bits: without loss scaling (which nothing here does) gradients
            # below 6e-8 flush to zero, and a loss normalised by the global batch's token count
            # has them in every layer (the tiny test model at 4,096 tokens: 57% off; an encoder's
            # through a frozen fp16 language model: 11%); a frozen module nothing trains through
            # has no gradients
            raise ValueError(f"ParallelOptions(param_dtype=torch.float16) for {trains_fp16}: trains without loss "
                             "scaling here (a frozen language model too: its backward carries the gradients of the "
                             "encoders that train), so its gradients underflow (more of them the more tokens a "
                             "batch holds); use param_dtype='bf16' (fp32's exponent range), or freeze the module "
                             "(the language model: and every encoder)")
        # Modules whose attention runs through FlexAttention with gradients on a device where torch's
        # FlexAttention has no backward (the CPU): a training run is refused on every rank (`run`),
        # instead of failing in the forward on their ranks alone while the other modules' ranks wait.
        flex_problem = flex_backward_problem(self.device) if any(o.flex_attention for o in self.options.values()) \
            else None
        takes_grad = {n: any(p.requires_grad for p in (e.encoder if isinstance(e, ModalityEncoder) else e).parameters())
                      for n, e in encoders.items()}
        self._tower_trains = dict(takes_grad)  # (the encoders' own; a frozen tower's projection may train)
        # rows each item carries through the blocks beyond its tokens: a CLIP-style tower's class token
        self._class_rows = {n: int(bool(getattr(getattr(e.encoder if isinstance(e, ModalityEncoder) else e, "config",
                                                        None), "class_token", False))) for n, e in encoders.items()}
        takes_grad[language_name] = backward_through_language
        flexed = [n for n in self.module_names if takes_grad[n] and (
            self.options[n].language_flex(self.device, layout.parallelism(n).cp, isinstance(language, Llama))
            if n == language_name else self.options[n].flex_attention)]
        self._flex_without_backward = (flexed, flex_problem) if flex_problem and flexed else None
        """(modules, torch's reason) where a training run through FlexAttention cannot take gradients here."""
        self.item_rules = {n: item_rule(e) for n, e in encoders.items()}
        self._rows_agreed = not all(independent_items(e) for e in encoders.values())
        """Whether `forward_backward` and ``model(batch)`` agree on their rows' errors (`agree_on_rows`):
        with a user's encoder, whose rows may change shape for an item size already seen. The
        library's encoders make rows of a shape their items fix (`item_rules`, checked before any
        collective), so their calls add no collective. From the modules' types: alike on every rank."""
        self._widths = {n: encoder_width(e) for n, e in encoders.items()}  # what an item costs (balancing)
        modules = {**encoders, language_name: language}
        self._no_init = [n for n, m in modules.items() if not callable(getattr(m, "init_weights", None))]
        # Read before the modules are split, sharded or converted: the same on every rank.
        self.buffer_names = {n: (tuple(named_buffers(m, True)), tuple(named_buffers(m, False)))
                             for n, m in modules.items()}
        """Per module, the names of the user's whole module's persistent buffers (checkpoints hold
        them: `module_buffers`) and of its other buffers (rebuilt by its ``init_weights``, not saved)."""
        self.dtype = compute_dtype(self.options[language_name], language)  # what crosses the bridge
        # Modules built on the meta device: only this rank's shards get allocated, uninitialized
        # until `init_weights` or a checkpoint load.
        self.uninitialized = {n for n, m in modules.items() if _on_meta(m)}
        self._shapes_checked: set[tuple] = set()  # (modality, item shape, tokens) seen world-wide
        graphs = [n for n, o in self.options.items() if o.cuda_graphs]
        trains = any(trainable.values())
        self.graph_memory = _GraphMemory(graphs, trains) if graphs else None
        """With CUDA graphs (`ParallelOptions.cuda_graphs`): what the last run left in their memory."""
        self.batches_compared = False
        """Whether a `train_step` compared the ranks' batch fingerprints before its first exchange."""
        self.buffers = exchange.BufferPool()
        """The receive buffers of every crossing (recycled on CPU: a steady training loop allocates none)."""

        # Read before the encoders are built: a pp > 1 encoder's stage keeps only its own parts of
        # the module (in place), so a stage of frozen blocks alone would read as frozen on its rank only.
        overlaps = overlapped(layout, language_name, encoders)
        roots: list[nn.Module] = []  # this rank's FSDP roots (what `to_empty` needs)
        self.encoders = nn.ModuleDict()
        self.encoder_pipelines: dict[str, EncoderPipeline] = {}  # this rank's stage of pp > 1 encoders
        for name, module in encoders.items():
            if layout.is_member(name, self.rank):
                self.encoders[name], root, stages = build_encoder_part(
                    layout, name, module, self.options[name], self.rank, self.dtype, self.device)
                roots.append(root)
                if stages is not None:
                    self.encoder_pipelines[name] = stages
        self._fp8_rows = (self.device.type == "cuda" and self.options[language_name].fp8 is not None
                          and backward_through_language)
        """A float8 language model that runs a backward on CUDA (it trains, or carries gradients to the
        encoders: torchao's float8 backward computes the weight gradients of a frozen weight too):
        each batch's rows a call are checked (`fp8_rows_problem`)."""
        self.language_pipeline: LanguagePipeline | None = None
        self.language_stages = nn.ModuleList()  # this rank's stages (registered: .parameters())
        if layout.is_member(language_name, self.rank):
            self.language_pipeline = LanguagePipeline(layout, language_name, language,
                                                      self.options[language_name], self.pipeline, self.device)
            self.language_stages = self.language_pipeline.stages
            roots.extend(self.language_stages)
        # On the device only now, split and sharded: a rank moves the parts it keeps (tp and FSDP2
        # move each parameter as they shard it), never a whole module (its other stages stay on the
        # host with the caller's module); a meta module's shards are allocated, uninitialized.
        for root in roots:
            _to_device(root, self.device)
        self._overlapped = [n for n in self.module_names if trainable[n] and self._sums_during_backward(n)]
        """The modules whose dp sums start during backward, known on every rank."""
        self._sums_pending = False
        """A training run's sums are in flight: `reduce_gradients` (or ``zero_grad``) comes next."""
        self._dp_summed = [n for n in self.module_names
                           if not self.options[n].fsdp and layout.parallelism(n).dp * layout.parallelism(n).cp > 1]
        """The modules whose gradients `reduce_gradients` sums over dp·cp itself (no FSDP2), on every rank."""
        self._tp_summed = [n for n in self.module_names if layout.parallelism(n).tp > 1 and n not in self._dp_summed]
        """The other modules whose head-local gradients `reduce_gradients` sums over tp (`replicas.head_local`)."""
        self._grads_summed = False
        """`reduce_gradients` summed the gradients present: a run that accumulates onto them sets them aside."""
        self._trains = trains
        self.gradients_unfinished = False
        """A run with gradients (a training run, a forward with autograd) since the last
        `reduce_gradients` or ``zero_grad``: the same on every rank (`grad_sumsq_shares` refuses it)."""
        self._summed_grads: dict[nn.Parameter, torch.Tensor] = {}
        """Gradients already summed over dp·cp, set aside while a run accumulates (`_set_aside_summed`)."""
        self._generating = False
        self.gathered_by_forward = False
        """A forward with autograd whose backward has not started (``model(batch)`` not
        backpropagated, e.g. an evaluation without ``torch.no_grad()``) left FSDP2's roots gathered:
        `MimoOptimizer` reshards before its update, else the next forward would use the stale copy."""
        """Inside `generate`: its predictions keep the FSDP2 roots gathered, resharded once at its end."""
        self.gradient_reducers = self._reducers(self._overlapped)
        """Per module of `_overlapped`, on its members: its `GradientReducer`."""
        lean = overlaps and all(layout.parallelism(n).pp == 1 for n in encoders)
        self.parts = RankParts(
            layout, language_name, self.rank, self.device, self.dim, self.dtype,
            encoders={n: e for n, e in self.encoders.items() if n not in self.encoder_pipelines},
            encoder_pipelines=self.encoder_pipelines, language=self.language_pipeline, trainable=self._trainable,
            widths=self._widths, options=self.options, pipeline=self.pipeline,
            window=crossing_window(self.pipeline, layout.parallelism(language_name).pp, lean),
            overlapped=overlaps, hops=bridge_hops, buffers=self.buffers,
            reducers=self.gradient_reducers)
        """This rank's parts and what every step shares, for the executor (`schedule.executor`)."""
        self._named_parameters = dict(self.named_parameters())
        self._requires_grad = {n: p.requires_grad for n, p in self._named_parameters.items()}
        """This rank's trainable set as built: the schedule's crossings follow it (`train_step` refuses a change)."""
        self._module_parameters = {n: self._collect_parameters(n) for n in self.module_names}
        """Per module, walked once (every step reads them: gradient reduction, norms)."""

    def _sums_during_backward(self, name: str) -> bool:
        """Whether module `name` sums its gradients over dp·cp while backward runs: without FSDP2,
        at dp·cp > 1, with `overlap_grad_reduce` (from the options and layout: alike on every rank)."""
        opts, par = self.options[name], self.layout.parallelism(name)
        return opts.overlap_grad_reduce and not opts.fsdp and par.dp * par.cp > 1

    def _reducers(self, names: Sequence[str]) -> dict[str, GradientReducer]:
        """The `GradientReducer` of each of modules `names` this rank holds, over a process group
        of its own (made on every rank, module by module: `MimoLayout.own_dp_group` is
        collective). A pipeline's stages arm it at their last backward (`StageReductions.attach`:
        torch's schedules run their backwards); the executor arms a pp = 1 encoder itself."""
        reducers = {}
        for name in names:
            group = self.layout.own_dp_group(name)
            params = {n: p for n, p in self._collect_parameters(name).items() if p.requires_grad}
            if group is None or not params:
                continue
            opts = self.options[name]
            reducer = reducers[name] = GradientReducer(params, group, opts.gradient_reduce_dtype,
                                                       opts.grad_bucket_bytes)
            pipeline = (self.language_pipeline if name == self.language_name else self.encoder_pipelines.get(name))
            if pipeline is not None:
                pipeline.reductions.attach(reducer)
        return reducers

    # ------------------------------------------------------------------ queries
    @property
    def module_names(self) -> list[str]:
        """Encoders in declaration order, then the language model: the same on every rank."""
        return [*self.encoder_names, self.language_name]

    @property
    def language(self) -> LanguageStage | None:
        """The language model's only stage (first and last), on its ranks at pp = 1; else None."""
        stages = self.language_stages
        return stages[0] if len(stages) == 1 and stages[0].first and stages[0].last else None

    @property
    def pipelined(self) -> bool:
        """More than one microbatch or stage: forward and backward run together (`forward_backward`)."""
        return self.pipeline.microbatches > 1 or any(self.layout.parallelism(n).pp > 1 for n in self.layout.names)

    def module_parameters(self, name: str) -> dict[str, nn.Parameter]:
        """This rank's parameters of module `name`, named as in the user's module ({} off its mesh)."""
        return self._module_parameters[name]

    def module_buffers(self, name: str) -> dict[str, torch.Tensor]:
        """This rank's persistent buffers of module `name` (a BatchNorm's running statistics),
        named as in the user's module ({} off its mesh): what a checkpoint holds besides the
        parameters. Read anew at each call (a module may replace a buffer)."""
        if name == self.language_name:
            parts = [s.llama for s in self.language_stages] if self.language_pipeline is not None else []
        else:
            parts = [self.encoders[name]] if name in self.encoders else []
        kept = set(self.buffer_names[name][0])  # not what the library added (a float8 layer's, say)
        return {n: b for part in parts for n, b in named_buffers(part, True).items() if n in kept}

    def _collect_parameters(self, name: str) -> dict[str, nn.Parameter]:
        if name == self.language_name:
            return {} if self.language_pipeline is None else self.language_pipeline.named_parameters()
        return dict(self.encoders[name].named_parameters()) if name in self.encoders else {}

    def holds_loss_share(self) -> bool:
        """True on the ranks whose loss shares add up to the global loss: tp rank 0 of the pp
        rank holding the language model's last stage (pp - 1 looped, 0 in a V)."""
        coord = self.layout.coordinate(self.language_name, self.rank)
        pp = self.layout.parallelism(self.language_name).pp
        last = self.pipeline.stage_rank(self.pipeline.num_stages(pp) - 1, pp)
        return coord is not None and coord["tp"] == 0 and coord["pp"] == last

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def init_weights(self, seeds: Mapping[str, int]) -> None:
        """Initialize each module from its seed, ``{"language": 0, "vision": 10, ...}`` (every
        module of the model; call on every rank). Each rank fills only its own shards, with the
        values the module's own ``init_weights(seed)`` gives the full single-process module
        (`dtensor_mimo.models.init_weights`), so a meta-built model matches the reference."""
        missing = [n for n in self.module_names if n not in seeds]
        unknown = [n for n in seeds if n not in self.module_names]
        if missing or unknown:
            raise ValueError(f"MimoModel.init_weights: seeds for {list(seeds)}; the model's modules are "
                             f"{self.module_names} (missing {missing}, unknown {unknown})")
        if self._no_init:  # the same list on every rank: every rank raises
            raise TypeError(f"MimoModel.init_weights: modules {self._no_init} have no init_weights(seed) "
                            "method; initialize them yourself before building the model")
        # Checked here for every module, on every rank: a module's own init would raise on its
        # ranks alone (a string, a float), or overflow on a NumPy integer, while the others go on
        # to their first collective and wait for them.
        wrong = {n: s for n, s in seeds.items() if isinstance(s, bool) or not isinstance(s, numbers.Integral)}
        if wrong:
            raise TypeError("MimoModel.init_weights: " + ", ".join(f"seeds[{n!r}]={s!r}" for n, s in wrong.items())
                            + ": each seed must be an integer, e.g. {'language': 0, 'vision': 10}")
        seeds = {n: int(s) for n, s in seeds.items()}
        self.reshard()  # fill the shards, not what a predict left gathered
        for name in self.encoders:
            self.encoders[name].init_weights(seeds[name])
        for stage in self.language_stages:
            stage.llama.init_weights(seeds[self.language_name])
        self.refresh_fp8_scales()  # float8 scales a step precomputed are of the former weights
        self.uninitialized.clear()

    def load_hf(self, paths: Mapping[str, str]) -> None:
        """Fill modules from Hugging Face checkpoint directories, ``{"language": path, ...}``
        (call on every rank with the same mapping). Each rank reads only the checkpoint rows of
        the blocks it holds (its tp / FSDP shards, its pipeline stages); an encoder's path fills
        its tower and, when the checkpoint holds one (a LLaVA directory), its projection
        (`dtensor_mimo.models.hf.hf_parts`; an "anyres" directory, LLaVA-NeXT / -OneVision, whose
        model tiles each image and adds an ``image_newline``, is refused). On a meta-built model
        call `init_weights` first: a loaded language model counts as initialized, an encoder's
        projection does not.

        Every rank checks what it holds (configs, tensor names and shapes) and the world agrees
        on the verdict before anyone reads a weight: a bad checkpoint raises on every rank."""
        unknown = [n for n in paths if n not in self.module_names]
        if unknown:
            raise ValueError(f"MimoModel.load_hf: {unknown} are not modules of the model {self.module_names}")
        self.reshard()  # plan the reads into the shards, not into what a predict left gathered
        fills, error = [], None
        try:
            for name, path in paths.items():
                parts = ([s.llama for s in self.language_stages] if name == self.language_name else
                         hf_parts(self.encoders[name], path, name) if name in self.encoders else [])
                fills += [plan_hf(part, path) for part in parts]
        except Exception as caught:  # noqa: BLE001 — any local failure (even a corrupt file) joins the vote
            error = caught
        self._agree(error, f"MimoModel.load_hf: {{n}} rank(s) found the checkpoints {dict(paths)} unusable "
                           "(their errors name the problem); nothing was loaded")
        for fill in fills:
            fill()
        self.refresh_fp8_scales()  # float8 scales a step precomputed are of the former weights
        if self.language_name in paths:
            self.uninitialized.discard(self.language_name)

    def reshard(self) -> None:
        """Put this rank's FSDP2 modules back on their parameter shards (no communication). A
        forward without backward (`predict`, `generate`) leaves a root module's parameters
        gathered, and the next forward would use that copy, not the shards: `init_weights`,
        `load_hf` and `dtensor_mimo.train.checkpoint.load` call it before writing weights, and
        `run` after a forward without backward; call it before writing this rank's parameters
        yourself. An encoder pipeline's stage (the FSDP2 root of a pp > 1 encoder, holding its
        embedding or projection) is not a submodule of the model: resharded by name too."""
        reshard_fsdp_modules(self)
        for pipeline in self.encoder_pipelines.values():
            reshard_fsdp_modules(pipeline.stage)
        self.gathered_by_forward = False

    def refresh_fp8_scales(self) -> None:
        """After the weights changed (`MimoOptimizer` calls it after each applied update; a checkpoint
        load, `load_hf` and `init_weights` too): modules with ``ParallelOptions(fp8="tensorwise")``
        under FSDP2 recompute their weights' float8 scales in one all-reduce each
        (`dtensor_mimo.parallelize.fp8.refresh_fp8_scales`). Call on every rank; modules without
        fp8 do nothing."""
        for name in self.module_names:
            if self.options[name].fp8 == "tensorwise":
                for root in ([self.encoders[name]] if name in self.encoders else
                             self.language_stages if name == self.language_name else []):
                    refresh_fp8_scales(root)

    def check_replicas(self) -> None:
        """Debug check (call on every rank): every parameter copy that should be identical — over
        tp for the parameters tp leaves whole, over dp·cp for modules without FSDP2, each shard
        over the replica groups of a module with HSDP — is bitwise equal; raises on every rank,
        naming the module and the first parameter that differs. Costs two all-reduces of the
        parameters per mesh, and one world all-reduce."""
        problems = [p for name in self.module_names if (params := self.module_parameters(name))
                    for p in replica_problems(name, params, *self._meshes(name), self.options[name])]
        self._agree(RuntimeError("replicas differ: " + "; ".join(problems)) if problems else None,
                    "replicas differ: on {n} other rank(s)")

    def _agree(self, error: Exception | None, elsewhere: str) -> None:
        """One world all-reduce of every rank's verdict: raises `error` here, else `elsewhere`
        (its ``{n}``: how many ranks failed) when another rank failed."""
        verdict = torch.tensor([float(error is not None)], device=self.device)
        dist.all_reduce(verdict)
        if error is not None:
            raise error
        if verdict.item():
            raise RuntimeError(elsewhere.replace("{n}", str(int(verdict.item()))))

    # ------------------------------------------------------------------ one step
    def program(self, batch: MimoBatch, mode: str = "train") -> list[Action]:
        """This rank's actions for a `mode` step over the global `batch` ("train": a training
        step, "forward": ``model(batch)``, "predict"): what the one executor runs
        (`dtensor_mimo.schedule.program`; ``format_program`` prints it). Pure: no message."""
        return self.parts.program(batch, mode, mode != "train" and self._new_item_kinds(batch))

    def prepare(self, batch: MimoBatch, mode: str = "train") -> None:
        """Derive now, on any thread, what a `mode` step over the global `batch` derives from all
        of it: its fingerprint, its loss weight and each encoder's item cuts per microbatch (host
        work that grows with the batch, and with an encoder's dp size where its items are
        balanced), kept with the batch (`prepare_batch`). Optional: the step derives
        what is missing. The trainer's prefetch thread prepares the next batch while the step
        runs. Pure: no message, no device."""
        prepare_batch(batch, self.parts.shape(batch, mode).microbatches, self.parts.cut_rules)
        if self.vocab_size is not None and batch.tokens.is_cpu:  # (read on the host only: no sync)
            ids_outside(batch, self.vocab_size)
        if batch.loss_mask.is_cpu:
            bad_loss_weights(batch)

    def run(self, batch: MimoBatch, mode: str = "train") -> StepResult:
        """One `mode` step over the global `batch` on this rank (call on every rank): its program
        (`program`) run by the executor. Returns the `StepResult`: the loss share (train: after
        forward and backward, detached; forward: with its graph), the ids (predict) and the error
        its encoder rows met, if any (they crossed as zeros; `train_step` agrees on it in its one
        all-reduce and raises on every rank)."""
        if mode != "train" and torch.is_inference_mode_enabled():
            # What a run makes under inference mode stays an inference tensor for good: FSDP2's
            # gathered parameters (its gather buffers are made once), the bridge's pooled receive
            # buffers. A later training run that met them would fail on the ranks holding them
            # ("Inference tensors cannot be saved for backward") while their peers wait for them.
            with torch.inference_mode(False), torch.no_grad():
                return self.run(batch, mode)
        if mode == "train" and not torch.is_grad_enabled():  # every rank in the same context: all refuse
            raise RuntimeError("MimoModel: a training run (train_step, forward_backward) under torch.no_grad() or "
                               "torch.inference_mode() has no backward to run; call it outside them (model.predict "
                               "is the forward without backward)")
        if self._flex_without_backward is not None and mode != "predict" and torch.is_grad_enabled():
            flexed, why = self._flex_without_backward  # from the options and the device type: alike on every rank
            raise ValueError(f"ParallelOptions(flex_attention=True) for {flexed} on device {self.device.type!r}: "
                             f"torch's FlexAttention has no backward there ({why}), so this training run would fail "
                             "in their forward on their ranks alone; set flex_attention=False (or None) for them to "
                             f"train on {self.device.type!r}, or train on CUDA (predict and forwards under "
                             "torch.no_grad() may keep it)")
        if mode == "forward" and self.pipelined and torch.is_grad_enabled():
            # Without autograd (an evaluation's loss) the forward runs one microbatch stage after
            # stage, as `predict` does; a backward could not follow it through the stages.
            raise RuntimeError("a pipelined MimoModel runs forward and backward together: call "
                               "model.forward_backward(batch) (or train_step) instead of model(batch), or run "
                               "model(batch) under torch.no_grad() for the loss alone")
        self._check_initialized()
        traced = mode != "predict" and torch.is_grad_enabled()  # the same on every rank
        check_batch(self.layout, self.language_name, self.encoder_names, batch, self.item_rules, self.vocab_size,
                    self.options[self.language_name].sp,
                    {n for n in self.encoder_names if traced and self.options[n].compile and self._tower_trains[n]},
                    {n: self._class_rows[n] for n in self.encoder_names
                     if traced and self.options[n].sp and self._tower_trains[n]})
        if self._fp8_rows and mode != "predict" and torch.is_grad_enabled():  # every rank alike
            par = self.layout.parallelism(self.language_name)
            problem = fp8_rows_problem(batch.batch_size, batch.seq_len,
                                       self.pipeline.microbatches if mode == "train" else 1, par.dp, par.cp)
            if problem is not None:
                raise ValueError(problem)
        if mode == "train" and self.pipelined:
            check_microbatching(batch.batch_size, self.pipeline.microbatches,
                                self.layout.parallelism(self.language_name).dp, self.language_name)
        if self._sums_pending and mode != "predict" and torch.is_grad_enabled():
            # Every rank makes the same calls, so every rank refuses here alike, before any collective.
            raise RuntimeError(
                f"MimoModel: the last training run's gradient sums over dp are in flight (modules {self._overlapped} "
                "sum them during backward: ParallelOptions.overlap_grad_reduce), so this run's gradients cannot "
                "accumulate onto them; call model.reduce_gradients() (or zero_grad()) first, accumulate over "
                "microbatches (PipelineConfig.microbatches), or set overlap_grad_reduce=False for those modules")
        check = mode != "train" and self._new_item_kinds(batch)
        actions = self.parts.program(batch, mode, check)
        if self.graph_memory is not None:
            self.graph_memory.check()
        if self._grads_summed and mode == "train":
            self._set_aside_summed()
        result = execute(self.parts, actions, batch, self.parts.shape(batch, mode, check), loss_normalizer(batch))
        if mode == "forward" and result.loss.requires_grad:
            self.gathered_by_forward = True  # until its backward starts (which reshards as it ends)
            result.loss.register_hook(lambda grad: setattr(self, "gathered_by_forward", False))
        if self._grads_summed and mode == "forward" and result.loss.requires_grad:
            # set aside when its backward starts (the loss's hook runs before any parameter's
            # gradient accumulates): a forward never backpropagated leaves the sums in place
            result.loss.register_hook(lambda grad: self._set_aside_summed() if self._grads_summed else None)
        if self.graph_memory is not None:
            self.graph_memory.ran(mode, result.loss)
        if mode in ("train", "forward") and torch.is_grad_enabled() and self._trains:  # alike on every rank
            self.gradients_unfinished = True
        if mode == "train" and self._overlapped:  # a forward or a prediction since does not change it
            self._sums_pending = True
        if mode != "train":
            self._shapes_checked.update(_item_kinds(batch, self.encoder_names))
        if (mode == "predict" or not torch.is_grad_enabled()) and not self._generating:
            # A forward without backward leaves FSDP2 roots gathered: an update written to the
            # shards since (a predict between backward and the optimizer step) would be missed by
            # the next forward, which would find them gathered and use the stale copy.
            self.reshard()
        return result

    def forward_backward(self, batch: MimoBatch) -> torch.Tensor:
        """Forward and backward of the global `batch` on every rank (`run` in "train" mode);
        returns this rank's loss share (detached). Then call `reduce_gradients` (`train_step`
        does both). Encoder rows whose shape contradicts the batch metadata cross as zeros, so
        that no peer waits. With a user's encoder (whose rows may change shape for an item size
        already seen) the ranks then agree on that in one small all-reduce (`agree_on_rows`, the
        call's one host sync; `train_step` carries it in its own) and every rank raises the same
        `PlanError`, the lowest failing rank's, naming the encoder and the shapes. The library's
        encoders make rows of the shape their items fix, checked before any collective: no sync."""
        result = self.run(batch, "train")
        self._raise_row_error(result.error)
        return result.loss

    def forward(self, batch: MimoBatch) -> torch.Tensor:
        """This rank's share of the loss of the global `batch` (call on every rank, then
        ``.backward()``, then `reduce_gradients`). One stage, one microbatch: a pipelined model
        runs `forward_backward` instead, or ``model(batch)`` under ``torch.no_grad()`` for the
        loss alone (one microbatch, stage after stage, as `predict`). The first time an item
        size is seen, every rank agrees in one all-reduce that the encoder rows have their
        planned shapes before they cross (else all raise). Rows of a wrong shape later (a
        user's encoder whose output changed for a size already seen) cross as zeros, and the ranks
        agree on them after the forward in one small all-reduce (`agree_on_rows`, only with such
        an encoder): every rank raises the same `PlanError`, naming the encoder and the shapes,
        and none calls backward."""
        result = self.run(batch, "forward")
        self._raise_row_error(result.error)
        return result.loss

    @torch.no_grad()
    def predict(self, batch: MimoBatch, with_loss: bool = False) -> torch.Tensor | tuple[torch.Tensor, float]:
        """Greedy next-token ids ``[B, S]`` at every position of the global `batch` (teacher
        forced), the same tensor on every rank; call on every rank. One microbatch, stage after
        stage (encoders and the language model). Costs one world all-reduce of ``B x S`` ids.
        `with_loss`: also the batch's loss from the same logits (as `train_step` reports it),
        ``(ids, loss)``, for one more all-reduce of one number."""
        result = self.run(batch, "predict")
        # The ids, and in the same all-reduce the ranks whose encoder rows went wrong.
        out = torch.zeros(batch.batch_size * batch.seq_len + 1, dtype=torch.int64, device=self.device)
        ids = out[:-1].view(batch.batch_size, batch.seq_len)
        out[-1] = int(result.error is not None)
        if result.ids is not None and self.holds_loss_share():  # one rank per (dp, cp) coordinate writes
            par, coord = self.layout.parallelism(self.language_name), self._coord()
            samples = sample_range(batch.batch_size, par.dp, coord["dp"])
            local = shard(batch, par.dp, coord["dp"])
            index = stage_inputs(local, par.cp, coord["cp"])[1]["sequence_index"]  # None: every column
            if index is None:
                ids[samples.start:samples.stop] = result.ids
            else:
                ids[samples.start:samples.stop].scatter_(1, index.to(self.device), result.ids)
        dist.all_reduce(out)
        if result.error is not None or out[-1].item():
            raise PlanError(result.error or f"{out[-1].item()} rank(s) produced encoder rows that disagree with "
                                            "the batch metadata (their error names the encoder and the shapes)")
        if not with_loss:
            return ids
        share = result.loss.detach().double().reshape(1) if self.holds_loss_share() and result.ids is not None \
            else torch.zeros(1, dtype=torch.float64, device=self.device)
        dist.all_reduce(share)
        return ids, share.item()

    def generate(self, batch: MimoBatch, prompt_lengths: Sequence[int], max_new_tokens: int | Sequence[int],
                 stop_token: int | None | Sequence[int | None] = None) -> list[list[int]]:
        """Greedy decoding (`dtensor_mimo.sequence.greedy_generate` over `predict`): each
        sample's `batch` row up to ``prompt_lengths[i]`` tokens is its prompt (its encoder items
        included); returns the generated ids per sample, up to `max_new_tokens` (one count, or
        one per sample) or through `stop_token` (one id, or one per sample) or through a
        modality's special id. Call on
        every rank with the same arguments; every rank returns the same. Its predictions keep
        the FSDP2 roots gathered (no weight changes between them), resharded once at the end."""
        self._generating = True
        try:
            return greedy_generate(self.predict, batch, prompt_lengths, max_new_tokens, stop_token)
        finally:
            self._generating = False
            self.reshard()

    def _raise_row_error(self, error: str | None) -> None:
        """Raise the error a call's encoder rows met (`StepResult.error`) on every rank alike: agreed
        in one small all-reduce with a user's encoder (`_rows_agreed`); else only a rank's own, which
        the item rules leave impossible."""
        if self._rows_agreed:
            agree_on_rows(error, self.device)
        elif error is not None:
            raise PlanError(error)

    def _new_item_kinds(self, batch: MimoBatch) -> bool:
        """Whether `batch` holds an item size not yet seen by a forward or a prediction (the
        same answer on every rank): their rows are then checked world-wide before they cross."""
        return not self._shapes_checked.issuperset(_item_kinds(batch, self.encoder_names))

    def encoder_imbalance(self, batch: MimoBatch) -> dict[str, float]:
        """Each encoder with dp > 1: its costliest dp rank's share of `batch` over the mean share
        (`data.balance.max_over_mean` of the cuts the step makes, by sample or balanced as its
        `ParallelOptions.balance` says), averaged over the microbatches that hold its items.
        1.0 is even; the slowest rank sets the pace. Host metadata only: no message, no sync."""
        mbs = microbatches(batch, self.pipeline.microbatches) if self.pipelined else [batch]
        out = {}
        for n in self.encoder_names:
            dp = self.layout.parallelism(n).dp
            if dp == 1 or n not in batch.modalities:
                continue
            ratios = []
            for mb in mbs:
                m = mb.modalities.get(n)
                if m is not None:
                    cuts, _ = encoder_cuts(m, dp, self.options[n].balance, self._widths[n])
                    if (r := max_over_mean(m, cuts, self._widths[n])) is not None:
                        ratios.append(r)
            if ratios:
                out[n] = sum(ratios) / len(ratios)
        return out

    def _check_initialized(self) -> None:
        if self.uninitialized:  # the same set on every rank: every rank raises
            raise RuntimeError(f"modules {sorted(self.uninitialized)} were built on the meta device and hold "
                               "uninitialized memory: call model.init_weights({module: seed, ...}) or load a "
                               "checkpoint first")

    def _meshes(self, name: str):
        return self.layout.mesh(name, "tp"), self.layout.mesh(name, ("dp", "cp"))

    def _coord(self) -> dict[str, int]:
        return self.layout.coordinate(self.language_name, self.rank)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """`nn.Module.zero_grad`; with CUDA graphs, ``set_to_none`` releases the gradients for the
        next run (see `_GraphMemory`). Every parameter as built (FSDP2's shards, which hold the
        gradients): a forward not backpropagated leaves a root's gathered copies registered."""
        super().zero_grad(set_to_none)
        for p in self._named_parameters.values():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().requires_grad_(False).zero_()
        if set_to_none and self.graph_memory is not None:
            self.graph_memory.release()
        self.drop_pending_sums()

    def drop_pending_sums(self) -> None:
        """Drop the dp sums a training run left in flight (`GradientReducer.discard`: every rank
        still issues each bucket once), for gradients being dropped; ``zero_grad`` and
        `MimoOptimizer.zero_grad` call it. Call on every rank."""
        for reducer in self.gradient_reducers.values():
            reducer.discard(self._sums_pending)
        self._sums_pending = False
        self._grads_summed, self._summed_grads = False, {}
        self.gradients_unfinished = False

    def _set_aside_summed(self) -> None:
        """Before the backward of a run that accumulates onto gradients `reduce_gradients` already
        summed over dp·cp without FSDP2, and the head-local ones it summed over tp (any module with
        tp > 1): take those off their parameters (a sum over dp of a sum would count them dp·cp
        times, over tp tp times; FSDP2 accumulates its reduced shards itself) until the next
        `reduce_gradients` has summed the run's own and adds them back. The same calls on every
        rank: no message."""
        for name in (*self._dp_summed, *self._tp_summed):
            for pname, p in self.module_parameters(name).items():
                # a sum over tp of a sum would count a head-local gradient tp times too
                if p.grad is not None and (name in self._dp_summed or head_local(pname)):
                    self._summed_grads[p] = p.grad
                    p.grad = None
        self._grads_summed = False

    def reduce_gradients(self) -> str | None:
        """Finish this rank's gradients after backward (call on every rank): dp (dp·cp) sums for
        modules without FSDP (FSDP already did; those with a `GradientReducer` had their
        buckets launched during backward), and every tp gradient put on its parameter's
        placements (pending partial sums reduced, a replicated one sharded:
        `dtensor_mimo.parallelize.finish_gradients`), so that clipping and AdamW see ordinary
        shards. Returns what went wrong on this rank, if anything (a gradient that accumulated
        after its bucket left, `GradientReducer.finish`): `train_step` agrees on it with the
        other ranks and refuses the step on every one.

        Runs may accumulate after it: a training run (or ``model(batch)`` with gradients) that
        follows sets the gradients summed here aside and the next call adds them to the run's
        own sums, so ``forward_backward``, `reduce_gradients`, ``forward_backward``,
        `reduce_gradients` gives the single-process sum of both runs' gradients on every layout
        (a second call without a run between sums nothing again)."""
        problems = []
        self._sums_pending = self.gradients_unfinished = False
        if self._grads_summed:  # no run since the last call: its sums are final
            self._set_aside_summed()
        for name in self.module_names:
            params = self.module_parameters(name)
            if params:
                module = (self.language_stages if name == self.language_name else self.encoders[name])
                problems.append(finish_gradients(module, params, *self._meshes(name), self.options[name],
                                                 self.gradient_reducers.get(name)))
        with torch.no_grad():  # what earlier runs summed, set aside while the last one ran
            for p, grad in self._summed_grads.items():
                if p.grad is None:
                    p.grad = grad
                else:
                    p.grad += grad
        self._summed_grads, self._grads_summed = {}, bool(self._dp_summed or self._tp_summed)
        return next((p for p in problems if p), None)


class _GraphMemory:
    """The one-run lifetime of CUDA graphs' memory (`ParallelOptions.cuda_graphs`): every run is
    one generation of torch's cudagraph trees (`schedule.executor.execute`), whose graphs replay
    into the memory of the run before. So a run is refused (RuntimeError) while the run before
    still needs it: a ``model(batch)`` loss with a graph, not yet backpropagated (its saved
    activations), or gradients not yet released (autograd keeps the graphs' outputs as
    ``.grad``; a `MimoOptimizer` step and ``zero_grad`` release them). The state follows the calls
    and what every rank knows alike (the mode, grad mode, whether any module trains), never
    this rank's tensors, so every rank refuses alike, before any collective, those that hold no
    CUDA-graph module included. The same rules hold on CPU, where inductor skips the graphs: a
    CPU run refuses what a GPU run would."""

    def __init__(self, modules: Sequence[str], trains: bool) -> None:
        self.modules, self.trains = list(modules), trains
        self.gradients = False  # a run's backward made gradients that are not yet released
        self.pending: object | None = None  # the token of a ``model(batch)`` loss awaiting its backward

    def check(self) -> None:
        what = f"MimoModel with CUDA graphs in {self.modules} (ParallelOptions compile_mode)"
        if self.pending is not None:
            raise RuntimeError(f"{what}: the loss of the last model(batch) has not been backpropagated, and this run "
                               "would replay the graphs over its saved activations; call .backward() on it first "
                               "(a forward that needs no gradients runs under torch.no_grad()), or model.zero_grad() "
                               "to drop it")
        if self.gradients:
            raise RuntimeError(f"{what}: the gradients of the last run live in the graphs' memory, which this run "
                               "would replay over; step the MimoOptimizer or call MimoOptimizer.zero_grad() or "
                               "model.zero_grad() first (a torch optimizer's zero_grad does not tell the model), and "
                               "accumulate over microbatches (PipelineConfig) rather than over runs")

    def ran(self, mode: str, loss: torch.Tensor) -> None:
        if mode == "train":
            self.gradients = True
        elif mode == "forward" and torch.is_grad_enabled() and self.trains:
            token = self.pending = object()
            if loss.requires_grad:
                loss.register_hook(lambda grad: self._backpropagated(token))

    def _backpropagated(self, token: object) -> None:
        if self.pending is token:  # not an older loss's second backward
            self.pending = None
        self.gradients = True

    def release(self) -> None:
        """The gradients were set to None (`zero_grad`): nothing of the last run is needed."""
        self.gradients, self.pending = False, None


def _agreement_parts(language: nn.Module, encoders: Mapping[str, nn.Module], options: Mapping[str, ParallelOptions],
                     language_name: str, device_type: str, pipeline: PipelineConfig | None,
                     bridge_hops: int | None) -> dict[str, object]:
    """The constructor's arguments that every rank must give alike (`check_agreement`)."""
    modules = {**encoders, language_name: language}
    return {
        "module list": [f"{n}: {type(m).__name__}" for n, m in modules.items()],
        "ParallelOptions mapping": {n: options.get(n, ParallelOptions()) for n in modules},
        "PipelineConfig": pipeline if pipeline is not None else PipelineConfig(),
        "bridge_hops setting": bridge_hops,
        "device type": device_type,
        "frozen parameter list": {n: [p for p, w in m.named_parameters() if not w.requires_grad]
                                  for n, m in modules.items()},
    }


_ERROR_WORDS = 128
"""Words of an error message `agree_on_rows` carries, 5 bytes each (640 bytes; longer is cut)."""
_RANK_SHIFT = 40  # a word: (world - 1 - rank) above 40 bits of the message's bytes


def agree_on_rows(error: str | None, device: torch.device) -> None:
    """Agree over the world on the error a step's encoder rows met (`StepResult.error`: rows of a
    wrong shape, which crossed as zeros so that no peer waits), in one all-reduce (MAX) of 130
    int64 words: the highest failing rank, the lowest, and the lowest one's message, each word
    tagged with ``world - 1 - rank`` above its bytes, so that MAX takes every word from that same
    rank. Every rank then raises the same `PlanError`: that rank's message, naming the encoder
    and the shapes, and which ranks failed. Call on every rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    words = torch.full((2 + _ERROR_WORDS,), -1, dtype=torch.int64)
    if error is not None:
        data = error.encode()[:5 * _ERROR_WORDS].ljust(5 * _ERROR_WORDS, b"\0")
        tag = (world - 1 - rank) << _RANK_SHIFT
        words[0], words[1] = rank, world - 1 - rank
        words[2:] = torch.tensor([tag | int.from_bytes(data[5 * i:5 * i + 5], "big") for i in range(_ERROR_WORDS)])
    words = words.to(device)
    dist.all_reduce(words, op=dist.ReduceOp.MAX)
    high, low, *chunks = words.tolist()  # the one device-to-host read
    if high < 0:
        return
    low, mask = world - 1 - low, (1 << _RANK_SHIFT) - 1
    text = b"".join((w & mask).to_bytes(5, "big") for w in chunks).rstrip(b"\0").decode(errors="ignore")
    ranks = f"rank {low}" if low == high else f"ranks {low} to {high} (the lowest and the highest; rank {low}'s error)"
    raise PlanError(f"{text} [the step failed on {ranks}; every rank raises this error, and the step's "
                    "gradients, computed on zeros for those rows, are to be dropped: model.zero_grad()]")


def _item_kinds(batch: MimoBatch, names: Sequence[str]) -> set[tuple]:
    return {(n, shape, tokens) for n in names if n in batch.modalities
            for shape, tokens in batch.modalities[n].item_kinds()}


def _on_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())
