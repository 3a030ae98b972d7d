"""`MimoModel`: encoders and a language model, each on its own mesh, joined by the bridge.

With a `PipelineConfig` the step runs per microbatch through `dtensor_mimo.schedule` (torch's
pipeline schedules, encoders overlapping the language model). Without one, one training forward,
on every rank of the world, with the same GLOBAL batch (pp = 1):

1. Each encoder rank encodes its dp shard of the batch's items and projects them to the language
   width: a ``[tokens, dim]`` block of the encoder output, a DTensor on the encoder's mesh
   ``(pp, dp, cp, tp)`` with placements ``(Replicate, Shard(0), Replicate, Replicate)`` and the
   batch's per-sample token counts as ragged sizes.
2. `redistribute_many` moves every encoder's output to the language mesh, same placements, in
   one batched exchange (one autograd node, so several encoders sharing ranks stay ordered).
   The gradient comes back declared `Partial` over cp: each cp rank only sees its positions.
3. Each language rank embeds its dp shard's text, scatters the modality rows in at their
   special-token positions (`assemble`), takes its load-balanced cp chunk, runs the decoder and
   returns its share of the loss: summed token losses over the token count of the global batch
   (a `LanguageStage` that is both first and last, the same module a pipeline stage is).

Ranks outside the language mesh return a zero that is still connected to the bridge, so
``model(batch).backward()`` on every rank completes the backward exchange (DESIGN: "on a rank
outside the target mesh ... backward with zeros").
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from dtensor_mimo.bridge import DeferredCheck, exchange, redistribute_many
from dtensor_mimo.bridge.hops import check_hops
from dtensor_mimo.data import MimoBatch, sample_range, shard
from dtensor_mimo.layout import LANGUAGE, LayoutError, MimoLayout
from dtensor_mimo.models import Llama, ModalityEncoder
from dtensor_mimo.models.protocol import ItemRule, encoder_problems, item_rule, language_problems
from dtensor_mimo.parallelize import (
    ParallelOptions,
    allreduce_gradients,
    apply_data_parallel,
    compute_dtype,
    first_differing_replica,
    parallelize_encoder,
    parallelize_llama,
    parallelize_projection,
    reduce_tp_replicated_gradients,
    tp_replicated,
    uses_fsdp,
)
from dtensor_mimo.parallelize.stack import parallelize_stack, user_tp_plan
from dtensor_mimo.schedule import (
    ZERO_BUBBLE_SCHEDULES,
    EncoderPipeline,
    EncoderStage,
    keep_encoder_stage,
    LanguagePipeline,
    LanguageStage,
    PipelineConfig,
    check_microbatching,
    check_pipeline_layout,
    pipelined_step,
    stage_inputs,
    stage_layers,
)
from dtensor_mimo.sequence import ContextParallelAttention, loss_normalizer

# Encoder output rows on a module mesh (pp, dp, cp, tp): split over dp, whole on every other dim.
TOKEN_PLACEMENTS = (Replicate(), Shard(0), Replicate(), Replicate())


class _ZeroConnectedTo(torch.autograd.Function):
    """A zero loss whose backward feeds zero gradients to `ys`: off the language mesh, this runs
    the rank's part of the bridge's backward exchange (DTensor's ``to_local`` cannot be used
    there: its backward rebuilds the gradient with a mismatched stride on non-member ranks)."""

    @staticmethod
    def forward(ctx, device: torch.device, *ys: DTensor) -> torch.Tensor:
        ctx.ys = ys
        return torch.zeros((), device=device)

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):
        return (None, *(torch.zeros_like(y) for y in ctx.ys))


class MimoModel(nn.Module):
    """Encoders and a Llama-style language model, each parallelized on its own mesh of `layout`.

    Every rank of the world builds it with the same arguments (the full modules, e.g. built
    from a seed); each rank keeps, parallelizes and trains only the modules it is a member of.

    Args:
        layout: per-module `Parallelism` (encoders: pp 1 and cp 1; the language model may
            have pp > 1 with a `pipeline`).
        language: the decoder, the library's `Llama` or any module meeting
            `dtensor_mimo.models.protocol` (with pp > 1 cut into stages of its own class, its
            own forward, tp plan and init; what it lacks for that is named up front); its name
            in the layout is `language_name`.
        encoders: ``{modality: encoder}``: a `ModalityEncoder` (library tower + projection) or
            any module meeting `dtensor_mimo.models.protocol`; each name is a layout module and
            a modality of the batches (its special token id comes with the batch).
        options: ``{module: ParallelOptions}`` (sp, FSDP2, compile); missing: the defaults.
        device_type: "cpu" (gloo) or "cuda" (NCCL).
        pipeline: microbatches and the language model's torch schedule. Needed for language
            pp > 1; with pp = 1 and ``microbatches > 1``, encoders on ranks of their own
            overlap their microbatches with the language model's. None (or one microbatch at
            pp = 1): the unpipelined step.
        bridge_hops: how encoder rows cross to the language model and gradients come back, as
            `redistribute`'s ``hops``, pipelined or not. None (default): per direction, two hops
            where the modules share no rank, the world spans several nodes (torchrun's
            LOCAL_WORLD_SIZE is unset or below the world size) and the receiving ranks replicate
            the rows (language tp, cp; encoder tp) or the gradient is Partial (cp): each row then
            crosses between the modules once and is all-gathered among the replicas; else one.
            1 or 2 forces a route.

    Example::

        layout = MimoLayout({"vision": Parallelism(dp=2), "language": Parallelism(tp=2)})
        model = MimoModel(layout, llama, {"vision": ModalityEncoder(vit, Projection(32, 48))},
                          options={"language": ParallelOptions(sp=True)})
        loss_share = model(global_batch)      # every rank, same global batch
        loss_share.backward()                 # every rank
        model.reduce_gradients()              # dp sums for modules without FSDP

    Pipelined (the step's forward and backward run inside the schedules)::

        model = MimoModel(layout, llama, encoders, pipeline=PipelineConfig(microbatches=4))
        loss_share = model.forward_backward(global_batch)   # every rank; or use train_step
    """

    def __init__(
        self,
        layout: MimoLayout,
        language: Llama,
        encoders: Mapping[str, nn.Module],
        *,
        options: Mapping[str, ParallelOptions] | None = None,
        language_name: str = LANGUAGE,
        device_type: str = "cpu",
        pipeline: PipelineConfig | None = None,
        bridge_hops: int | None = None,
    ) -> None:
        super().__init__()
        _check_model(layout, language, encoders, language_name, options or {}, pipeline)
        check_hops(bridge_hops, "MimoModel bridge_hops")
        if not dist.is_initialized():
            raise RuntimeError("MimoModel needs torch.distributed initialised (torchrun + init_process_group)")
        if not layout.meshes_ready:
            layout.init_meshes(device_type)
        self.layout, self.language_name = layout, language_name
        self.encoder_names = list(encoders)
        self.options = {name: (options or {}).get(name, ParallelOptions())
                        for name in [*self.encoder_names, language_name]}
        self.dim = language.config.dim
        self.device = (torch.device(device_type) if device_type == "cpu"
                       else torch.device(device_type, torch.accelerator.current_device_index()))
        # Every rank must know whether an encoder trains: ranks off its mesh then join its backward.
        self._trainable = {n: any(p.requires_grad for p in e.parameters()) for n, e in encoders.items()}
        self.item_rules = {n: item_rule(e) for n, e in encoders.items()}  # batches checked on every rank
        self._no_init = [n for n, m in [*encoders.items(), (language_name, language)]
                         if not callable(getattr(m, "init_weights", None))]
        self.rank = dist.get_rank()
        self.bridge_hops = bridge_hops
        self._shapes_checked: set[tuple[str, int]] = set()  # (modality, tokens_per_item) checked world-wide
        self.buffers = exchange.BufferPool()
        """The receive buffers of every crossing (recycled on CPU: a steady training loop allocates none)."""
        self.step_error: str | None = None  # this rank's verdict on the last pipelined step
        self.step_status: torch.Tensor | None = None
        """Unpipelined `forward_backward`: this rank's verdict from the bridge's status words, on the
        device (> 0: rows from a wrong shard crossed); `train_step` reads it in its one all-reduce."""
        self._deferred: DeferredCheck | None = None  # set while forward_backward runs unpipelined

        lang = layout.parallelism(language_name)
        pipelined = pipeline is not None and (
            pipeline.microbatches > 1 or any(layout.parallelism(n).pp > 1 for n in layout.names))
        self.pipeline = pipeline if pipelined else None
        # Encoders on ranks of their own overlap their microbatches with the language model's;
        # an encoder sharing ranks with it (or a frozen one) takes the colocated three phases.
        self.overlapped = _overlapped(layout, language_name, encoders)
        # What crosses the bridge: the language model's compute dtype (bf16 under mixed precision).
        self.dtype = compute_dtype(self.options[language_name], language)
        # Modules built on the meta device: parallelized there, then only this rank's shards are
        # allocated (uninitialized until `init_weights` or a checkpoint load).
        self.uninitialized = {n for n, m in [*encoders.items(), (language_name, language)] if _on_meta(m)}
        roots: list[nn.Module] = []  # the FSDP roots of this rank's modules (what `to_empty` needs)

        self.encoders = nn.ModuleDict()
        self.encoder_pipelines: dict[str, EncoderPipeline] = {}  # this rank's stage of pp > 1 encoders
        for name, module in encoders.items():
            if layout.is_member(name, self.rank):
                self.encoders[name], root = self._parallelize_encoder(name, self._to_device(module))
                roots.append(root)
        self.language: LanguageStage | None = None  # unpipelined: one stage, first and last
        self.language_pipeline: LanguagePipeline | None = None
        self.language_stages = nn.ModuleList()  # pipelined: this rank's stages (registered)
        if layout.is_member(language_name, self.rank):
            if self.pipeline is None:
                self.language = self._parallelize_language(self._to_device(language))
                roots.append(self.language)
            else:
                self.language_pipeline = LanguagePipeline(
                    layout, language_name, self._to_device(language), self.options[language_name],
                    self.pipeline, self.device)
                self.language_stages = self.language_pipeline.stages  # registered: .parameters()
                roots.extend(self.language_stages)
        for root in roots:
            if any(p.is_meta for p in root.parameters()):
                root.to_empty(device=self.device)
        self._grad_placements = (Replicate(), Shard(0), Partial() if lang.cp > 1 else Replicate(),
                                 Replicate())

    # ------------------------------------------------------------------ parallelization
    def _meshes(self, name: str):
        return self.layout.mesh(name, "tp"), self.layout.mesh(name, ("dp", "cp"))

    def _to_device(self, module: nn.Module) -> nn.Module:
        """A module on this rank's device; a meta module stays on meta until parallelized."""
        return module if _on_meta(module) else module.to(self.device)

    def _parallelize_encoder(self, name: str, module: nn.Module) -> tuple[nn.Module, nn.Module]:
        """tp/compile on the encoder and projection, then FSDP2 (or autocast) on the pair
        (pp = 1) or on this rank's pipeline stage of it (pp > 1: the stage keeps only its parts,
        names unchanged); a user's own encoder as one stack with its own tp plan. Returns the
        module and the root FSDP2 was applied to."""
        options, pp = self.options[name], self.layout.parallelism(name).pp
        tp_mesh, dp_mesh = self._meshes(name)
        if not isinstance(module, ModalityEncoder):
            return parallelize_stack(module, tp_mesh, dp_mesh, options, user_tp_plan), module
        root: nn.Module = module
        if pp > 1:
            s = self.layout.coordinate(name, self.rank)["pp"]
            keep_encoder_stage(module, stage_layers(len(module.encoder.layers), pp, module=name)[s],
                               s == 0, s == pp - 1)
            root = EncoderStage(module, s == 0, s == pp - 1, self.dtype, compute_dtype(options, module))
            self.encoder_pipelines[name] = EncoderPipeline(
                name, root, s, pp, self.layout.mesh(name, "pp").get_group(), module.encoder.config.dim,
                self.device)
        no_fsdp = options.for_submodules()  # FSDP / mixed precision go on the root, below
        parallelize_encoder(module.encoder, tp_mesh, dp_mesh, no_fsdp)
        if module.projection is not None:
            parallelize_projection(module.projection, tp_mesh, dp_mesh, no_fsdp)
        blocks = [*module.encoder.layers.values(), *([module.projection] if module.projection else [])]
        apply_data_parallel(root, dp_mesh, blocks, options)
        return module, root

    def _parallelize_language(self, llama: Llama) -> LanguageStage:
        name, options = self.language_name, self.options[self.language_name]
        tp_mesh, dp_mesh = self._meshes(name)
        cp = self.layout.parallelism(name).cp
        if cp > 1:
            llama.set_attention_fn(ContextParallelAttention(self.layout.mesh(name, "cp")))
        parallelize_llama(llama, tp_mesh, dp_mesh, options.for_submodules())
        step = LanguageStage(llama, True, True, cp, self.layout.coordinate(name, self.rank)["cp"])
        apply_data_parallel(step, dp_mesh, list(llama.layers.values()), options)
        return step

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
        for name in self.encoders:
            self.encoders[name].init_weights(seeds[name])
        stages = [self.language] if self.language is not None else list(self.language_stages)
        for stage in stages:
            stage.llama.init_weights(seeds[self.language_name])
        self.uninitialized.clear()

    def load_hf(self, paths: Mapping[str, str]) -> None:
        """Fill modules from Hugging Face checkpoint directories, ``{"language": path, ...}``
        (call on every rank with the same mapping). Each rank reads only the checkpoint rows of
        the blocks it holds (its tp / FSDP shards, its pipeline stages); an encoder's path fills
        its tower (`ModalityEncoder.encoder`) and, when the checkpoint holds one (a LLaVA
        directory), its projection; otherwise the projection keeps its initialization. Modules
        not named keep theirs (on a meta-built model call `init_weights` first: a loaded language
        model counts as initialized, an encoder's projection does not).

        Every rank checks what it holds (configs, tensor names and shapes, from ``config.json``
        and the file headers) and one world all-reduce agrees on the verdict before anyone reads
        a weight: a bad checkpoint raises on every rank, naming the problem where it was seen.
        """
        from dtensor_mimo.models import Projection
        from dtensor_mimo.models.hf import has_hf_module, plan_hf

        unknown = [n for n in paths if n not in self.module_names]
        if unknown:
            raise ValueError(f"MimoModel.load_hf: {unknown} are not modules of the model {self.module_names}")
        fills, error = [], None
        try:
            for name, path in paths.items():
                if name == self.language_name:
                    parts = [self.language.llama] if self.language is not None else [s.llama for s in self.language_stages]
                elif name in self.encoders:
                    module = self.encoders[name]
                    if not isinstance(module, ModalityEncoder):
                        raise TypeError(f"MimoModel.load_hf: encoder {name!r} is a {type(module).__name__}; "
                                        "load your own module's weights yourself")
                    parts = [module.encoder] + ([module.projection] if module.projection is not None
                                                and has_hf_module(Projection, path) else [])
                else:
                    parts = []
                fills += [plan_hf(part, path) for part in parts]
        except Exception as caught:  # noqa: BLE001 — any local failure (even a corrupt file) joins the vote
            error = caught
        verdict = torch.tensor([float(error is not None)], device=self.device)
        dist.all_reduce(verdict)
        if error is not None:
            raise error
        if verdict.item():
            raise RuntimeError(f"MimoModel.load_hf: {int(verdict.item())} rank(s) found the checkpoints {dict(paths)} "
                               "unusable (their errors name the problem); nothing was loaded")
        for fill in fills:
            fill()
        if self.language_name in paths:
            self.uninitialized.discard(self.language_name)

    def check_replicas(self) -> None:
        """Debug check (call on every rank): every parameter copy that should be identical — over
        tp for the parameters tp leaves whole, over dp·cp for modules without FSDP2 — is bitwise
        equal; raises on every rank, naming the module and the first parameter that differs.
        Costs two all-reduces of the parameters per mesh, and one world all-reduce."""
        problems = []
        for name in self.module_names:
            params = self.module_parameters(name)
            if not params:
                continue
            tp_mesh, dp_mesh = self._meshes(name)
            checks = [("tp", tp_mesh, {n: p for n, p in params.items() if tp_replicated(p)})]
            if not uses_fsdp(self.options[name], dp_mesh):
                checks.append(("dp·cp", dp_mesh, params))
            for dim, mesh, group in checks:
                if (bad := first_differing_replica(group, mesh)) is not None:
                    problems.append(f"module {name!r}: parameter {bad!r} differs over {dim}")
        verdict = torch.tensor([float(bool(problems))], device=self.device)
        dist.all_reduce(verdict)
        if verdict.item():
            raise RuntimeError("replicas differ: " + ("; ".join(problems) if problems else
                                                      f"on {int(verdict.item())} other rank(s)"))

    # ------------------------------------------------------------------ queries
    @property
    def module_names(self) -> list[str]:
        """Encoders in declaration order, then the language model: the same on every rank."""
        return [*self.encoder_names, self.language_name]

    def module_parameters(self, name: str) -> dict[str, nn.Parameter]:
        """This rank's parameters of module `name`, named as in the user's module ({} off its mesh)."""
        if name == self.language_name:
            if self.language_pipeline is not None:
                return self.language_pipeline.named_parameters()
            return {} if self.language is None else dict(self.language.llama.named_parameters())
        return dict(self.encoders[name].named_parameters()) if name in self.encoders else {}

    def holds_loss_share(self) -> bool:
        """True on the ranks whose loss shares add up to the global loss: tp rank 0 of the pp
        rank holding the language model's last pipeline stage (pp rank pp - 1 for looped
        stages, pp rank 0 for a V schedule's)."""
        coord = self.layout.coordinate(self.language_name, self.rank)
        pp = self.layout.parallelism(self.language_name).pp
        last = 0 if self.pipeline is None else self.pipeline.stage_rank(self.pipeline.num_stages(pp) - 1, pp)
        return coord is not None and coord["tp"] == 0 and coord["pp"] == last

    def forward_backward(self, batch: MimoBatch) -> torch.Tensor:
        """Forward and backward of the global `batch` on every rank; returns this rank's loss
        share (detached). Pipelined models run both inside the schedules; then call
        `reduce_gradients` as after ``model(batch).backward()``.

        Encoder rows whose shape contradicts the batch metadata do not raise here (the other
        ranks would wait for this one): they cross as zeros and `step_error` says what happened
        (unpipelined, `step_status` also holds the verdict of the bridge's status words, on the
        device); `train_step` raises it on every rank before the optimizer steps. No host sync:
        every count comes from the batch metadata, and no status word is read here.
        """
        self.step_error, self.step_status = None, None
        self._check_initialized()
        if self.pipeline is None:
            self._deferred = DeferredCheck()
            try:
                share = self(batch)
                if share.requires_grad:
                    share.backward()
            finally:
                deferred, self._deferred = self._deferred, None
            self.step_error, self.step_status = deferred.error, deferred.flag(self.device)
            return share.detach()
        check_batch(self.layout, self.language_name, self.encoder_names, batch, self.item_rules)
        check_microbatching(batch.batch_size, self.pipeline.microbatches,
                            self.layout.parallelism(self.language_name).dp, self.language_name)
        share, self.step_error = pipelined_step(
            self.layout, self.language_name, batch, num_microbatches=self.pipeline.microbatches,
            encoders={n: e for n, e in self.encoders.items() if n not in self.encoder_pipelines},
            encoder_pipelines=self.encoder_pipelines, trainable=self._trainable,
            language=self.language_pipeline, overlapped=self.overlapped,
            normalizer=loss_normalizer(batch), dim=self.dim, dtype=self.dtype, device=self.device,
            buffers=self.buffers, hops=self.bridge_hops)
        return share

    # ------------------------------------------------------------------ one step
    def forward(self, batch: MimoBatch) -> torch.Tensor:
        """This rank's share of the loss of the global `batch` (call on every rank).

        The shares of the language ranks (one per dp·cp coordinate; tp ranks hold copies) sum
        to the single-process loss. Call ``.backward()`` on it on every rank where it requires
        grad; then `reduce_gradients`.
        """
        if self.pipeline is not None:
            raise RuntimeError("a pipelined MimoModel runs forward and backward together: call "
                               "model.forward_backward(batch) (or train_step) instead of model(batch)")
        self._check_initialized()
        check_batch(self.layout, self.language_name, self.encoder_names, batch, self.item_rules)
        names, ys = self._cross(batch)
        if self.language is None:
            return _ZeroConnectedTo.apply(self.device, *ys)
        embeddings = {n: y.to_local(grad_placements=self._grad_placements) for n, y in zip(names, ys)}
        local = self._language_shard(batch)
        self.language.set_step(embeddings, batch.special_token_ids, loss_normalizer(batch))
        tokens, kwargs = stage_inputs(local, *self._cp())
        share = self.language(tokens, microbatch=0, **kwargs)
        self.language.set_step(None, {}, 1.0)  # drop the references to this step's rows
        return share

    @torch.no_grad()
    def predict(self, batch: MimoBatch) -> torch.Tensor:
        """Greedy next-token ids ``[B, S]`` at every position of the global `batch` (teacher
        forced), the same tensor on every rank; call on every rank.

        Unpipelined even for a pipelined model (one microbatch; a language pipeline passes it
        stage to stage); encoders must have pp = 1. Costs one world all-reduce of ``B x S`` ids.
        """
        self._check_initialized()
        check_batch(self.layout, self.language_name, self.encoder_names, batch, self.item_rules)
        staged = [n for n in self.encoder_pipelines if n in batch.modalities]
        if staged:
            raise NotImplementedError(f"MimoModel.predict: encoders {staged} have pp > 1; prediction "
                                      "runs encoders unpipelined (pp = 1)")
        names, ys = self._cross(batch)
        out = torch.zeros(batch.batch_size, batch.seq_len, dtype=torch.int64, device=self.device)
        if self.layout.is_member(self.language_name, self.rank):
            rows = {n: y.to_local() for n, y in zip(names, ys)}
            local = self._language_shard(batch)
            if self.language is not None:
                self.language.set_step(rows, batch.special_token_ids, 1.0)
                self.language.predicting = True
                try:
                    tokens, kwargs = stage_inputs(local, *self._cp())
                    ids = self.language(tokens, microbatch=0, **kwargs)
                finally:
                    self.language.predicting = False
                    self.language.set_step(None, {}, 1.0)
            else:
                ids = self.language_pipeline.predict(local, rows)
            if self.holds_loss_share():  # one rank per (dp, cp) coordinate writes its positions
                par, coord = self.layout.parallelism(self.language_name), self._coord()
                samples = sample_range(batch.batch_size, par.dp, coord["dp"])
                index = stage_inputs(local, *self._cp())[1]["sequence_index"]  # None: every column
                if index is None:
                    out[samples.start:samples.stop] = ids
                else:
                    out[samples.start:samples.stop].scatter_(1, index.to(self.device), ids)
        dist.all_reduce(out)
        return out

    @torch.no_grad()
    def generate(self, batch: MimoBatch, prompt_lengths: Sequence[int], max_new_tokens: int,
                 stop_token: int | None = None) -> list[list[int]]:
        """Greedy decoding: each sample's `batch` row up to ``prompt_lengths[i]`` tokens is its
        prompt (its encoder items included); returns the generated ids per sample, up to
        `max_new_tokens` or through `stop_token`. Call on every rank with the same arguments;
        every rank returns the same lists. One `predict` per new token (no KV cache).
        """
        if len(prompt_lengths) != batch.batch_size:
            raise ValueError(f"generate: {len(prompt_lengths)} prompt lengths for {batch.batch_size} samples")
        bad = [n for n in prompt_lengths if not 1 <= n <= batch.seq_len - max_new_tokens]
        if bad:
            raise ValueError(f"generate: prompt lengths {bad} leave no room for {max_new_tokens} new "
                             f"tokens in rows of {batch.seq_len}; shorten them or lower max_new_tokens")
        tokens = batch.tokens.clone()
        ends = torch.as_tensor(list(prompt_lengths))
        rows = torch.arange(batch.batch_size)
        done = torch.zeros(batch.batch_size, dtype=torch.bool)
        generated: list[list[int]] = [[] for _ in prompt_lengths]
        for _ in range(max_new_tokens):
            ids = self.predict(dataclasses.replace(batch, tokens=tokens)).cpu()
            new = ids[rows, ends - 1]
            for i in torch.nonzero(~done).flatten().tolist():
                generated[i].append(int(new[i]))
            tokens[rows[~done], ends[~done]] = new[~done]
            ends = ends + (~done).long()
            if stop_token is not None:
                done |= new == stop_token
            if done.all():
                break
        return generated

    def _encode(self, name: str, batch: MimoBatch) -> DTensor:
        """This rank's encoder output rows (empty off the encoder's mesh) as a DTensor."""
        shape = (batch.num_tokens(name), self.dim)
        if name in self.encoders:
            par = self.layout.parallelism(name)
            items = shard(batch, par.dp, self.layout.coordinate(name, self.rank)["dp"]).modalities[name]
            local = self.encoders[name](items.inputs.to(self.device, non_blocking=items.inputs.is_cpu))
            local = local.to(self.dtype)
        else:
            # DTensor's empty shard off the mesh, in the dtype that crosses (the receive buffers are
            # sized from it); it requires grad when the encoder trains, so that this rank's bridge
            # node exists and joins the backward exchange.
            local = torch.empty(0, dtype=self.dtype, device=self.device, requires_grad=self._trainable[name])
        return DTensor.from_local(local, self.layout.mesh(name), TOKEN_PLACEMENTS, run_check=False,
                                  shape=torch.Size(shape), stride=(self.dim, 1))

    def _cross(self, batch: MimoBatch) -> tuple[list[str], tuple[DTensor, ...]]:
        """Every encoder's output rows of `batch`, moved to the language mesh in one exchange."""
        names = [n for n in self.encoder_names if n in batch.modalities]
        xs = [self._encode(name, batch) for name in names]
        if not xs:
            return names, ()
        lang_mesh = self.layout.mesh(self.language_name)
        keys = [(n, batch.modalities[n].tokens_per_item) for n in names]
        ys = redistribute_many(
            xs, [lang_mesh] * len(xs), [TOKEN_PLACEMENTS] * len(xs),
            sample_sizes=[batch.tokens_per_sample(n) for n in names],
            grad_placements=[self._grad_placements] * len(xs),
            # Encoder output rows per item are fixed by each encoder's config: one world-wide
            # shape check the first time a modality is seen with a tokens_per_item catches a
            # mismatch with the batch metadata before any data moves (the keys are the same on
            # every rank, so every rank agrees to check); later, the status word that rides
            # with the messages, read at once (`model(batch)`) or by `train_step` (one sync per step).
            check=("world" if not self._shapes_checked.issuperset(keys) else
                   self._deferred if self._deferred is not None else True),
            names=[(n, self.language_name) for n in names],
            hops=[self.bridge_hops] * len(xs),
            buffers=self.buffers,
        )
        self._shapes_checked.update(keys)
        return names, ys

    def _check_initialized(self) -> None:
        if self.uninitialized:  # the same set on every rank: every rank raises
            raise RuntimeError(f"modules {sorted(self.uninitialized)} were built on the meta device and hold "
                               "uninitialized memory: call model.init_weights({module: seed, ...}) or load a "
                               "checkpoint first")

    def _coord(self) -> dict[str, int]:
        return self.layout.coordinate(self.language_name, self.rank)

    def _cp(self) -> tuple[int, int]:
        return self.layout.parallelism(self.language_name).cp, self._coord()["cp"]

    def _language_shard(self, batch: MimoBatch) -> MimoBatch:
        """This language rank's dp shard of `batch`, on its device."""
        dp = self.layout.parallelism(self.language_name).dp
        return shard(batch, dp, self._coord()["dp"]).to(self.device)

    def reduce_gradients(self) -> None:
        """Finish this rank's gradients after backward (call on every rank).

        Sums over dp (dp·cp) for modules that do not use FSDP (FSDP already did), and reduces
        gradients that tensor parallelism left as pending partial sums (the norm weights under
        sp) to their parameter's placements, so clipping and AdamW see ordinary shards.
        """
        for name in self.module_names:
            params = self.module_parameters(name)
            if not params:
                continue
            tp_mesh, dp_mesh = self._meshes(name)
            options = self.options[name]
            if not uses_fsdp(options, dp_mesh):
                if name != self.language_name:
                    module = self.encoders[name]
                elif self.language_pipeline is not None:
                    module = self.language_pipeline.stages
                else:
                    module = self.language.llama
                allreduce_gradients(module, dp_mesh, options.gradient_reduce_dtype)
            reduce_tp_replicated_gradients(params, tp_mesh)
            for param in params.values():
                grad = param.grad
                if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
                    param.grad = grad.redistribute(grad.device_mesh, param.placements)


def _on_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def _check_model(layout: MimoLayout, language: Llama, encoders: Mapping[str, nn.Module],
                 language_name: str, options: Mapping[str, ParallelOptions],
                 pipeline: PipelineConfig | None) -> None:
    """Pure validation of the model against the layout, before any process group is used."""
    layout.require_mimo(language_name, encoders)
    extra = [n for n in layout.names if n != language_name and n not in encoders]
    if extra:
        raise LayoutError(f"layout modules {extra} are neither the language model nor an encoder "
                          f"(encoders: {list(encoders)}); remove them from the layout")
    unknown = [n for n in options if n not in layout.names]
    if unknown:
        raise LayoutError(f"options given for {unknown}, which are not modules of the layout {layout.names}")
    for name, module in encoders.items():
        par = layout.parallelism(name)
        problems = encoder_problems(module, tp=par.tp,
                                    activation_checkpointing=options.get(name, ParallelOptions()).activation_checkpointing)
        if problems:
            raise TypeError(f"encoder {name!r} ({type(module).__name__}) does not meet the encoder protocol "
                            f"(dtensor_mimo.models.protocol): it needs {'; '.join(problems)}")
    lang = layout.parallelism(language_name)
    problems = language_problems(language, tp=lang.tp, cp=lang.cp, pp=lang.pp)
    if problems:
        raise TypeError(f"the language model ({type(language).__name__}) does not meet the language protocol "
                        f"(dtensor_mimo.models.protocol): it needs {'; '.join(problems)}")
    for name in layout.names:
        par = layout.parallelism(name)
        if name == language_name and par.pp > 1 and pipeline is None:
            raise LayoutError(f"{name!r} has pp={par.pp}: pass pipeline=PipelineConfig(microbatches=...) "
                              "to MimoModel (at least pp microbatches keep every stage busy)")
        if name != language_name and par.cp != 1:
            raise LayoutError(f"encoder {name!r} has cp={par.cp}; context parallelism applies to the "
                              "language model only: use dp for the encoder instead")
    check_pipeline_layout(layout, language_name, pipeline)
    for name, module in encoders.items():
        pp = layout.parallelism(name).pp
        if pp > 1:
            problem = _encoder_pipeline_problem(layout, language_name, encoders, name, options, pipeline)
            if problem:
                raise LayoutError(f"encoder {name!r} has pp={pp}: {problem}")
            stage_layers(len(module.encoder.layers), pp, module=name)
    if pipeline is not None:  # every rank, before any process group: layers per stage
        stage_layers(len(language.layers), pipeline.num_stages(layout.parallelism(language_name).pp),
                     pipeline.split, module=language_name)
    lang_options = options.get(language_name, ParallelOptions())
    if pipeline is not None and pipeline.schedule in ZERO_BUBBLE_SCHEDULES and lang_options.compile:
        # torch 2.13 runs a block compiled in place (`compile_blocks`) and gets the numbers right,
        # but the block's backward is one compiled node: the input pass runs all of it, and the
        # weight pass runs all of it again. Refused rather than silently doubling that compute.
        raise LayoutError(f"schedule {pipeline.schedule!r} splits backward into an input pass and a weight "
                          f"pass, but {language_name!r} has compile=True: torch 2.13 runs a compiled block's "
                          "whole backward in both passes (twice the backward compute, which undoes the "
                          "zero-bubble split): use schedule='Interleaved1F1B' or '1F1B' with compile, or "
                          "compile=False with this schedule")
    for name, module in encoders.items():
        if module.out_dim != language.config.dim:
            raise ValueError(f"encoder {name!r} projects to {module.out_dim} features but the language "
                             f"model's dim is {language.config.dim}; set the projection's out_dim to it")


def _encoder_pipeline_problem(layout: MimoLayout, language_name: str, encoders: Mapping[str, nn.Module],
                              name: str, options: Mapping[str, ParallelOptions],
                              pipeline: PipelineConfig | None) -> str | None:
    """Why encoder `name` (pp > 1) cannot run as a pipeline, or None."""
    if pipeline is None:
        return "pass pipeline=PipelineConfig(microbatches=...)"
    if any(set(layout.ranks(name)) & set(layout.ranks(m)) for m in layout.names if m != name):
        return "its ranks must be its own: disjoint from the language model and every other encoder"
    if not _overlapped(layout, language_name, encoders):
        return ("every encoder must train and sit on ranks of its own (the colocated three-phase path, "
                "taken otherwise, has no encoder stages)")
    if options.get(name, ParallelOptions()).sp:
        return "sequence parallel is not supported on encoder stages: set sp=False"
    if not isinstance(encoders[name], ModalityEncoder):
        return f"encoder stages are cut from a ModalityEncoder, not a {type(encoders[name]).__name__}"
    encoder = encoders[name].encoder
    if getattr(getattr(encoder, "config", None), "class_token", False):
        return "a class token is not supported on encoder stages (stage links carry the patch tokens only)"
    if not (hasattr(encoder, "embed") and hasattr(encoder, "finish") and hasattr(encoder, "layers")
            and hasattr(encoder, "norm") and isinstance(getattr(getattr(encoder, "config", None), "dim", None), int)):
        return (f"its encoder {type(encoder).__name__} needs embed(), layers, finish(), norm and config.dim "
                "(as ViT and AudioEncoder have)")
    return None


def _overlapped(layout: MimoLayout, language_name: str, encoders: Mapping[str, nn.Module]) -> bool:
    """Encoder and language microbatches overlap when every encoder trains (its gradient comes
    back per microbatch) and sits on ranks of its own."""
    lang = set(layout.ranks(language_name))
    return all(any(p.requires_grad for p in e.parameters()) and not lang & set(layout.ranks(n))
               for n, e in encoders.items())


def check_batch(layout: MimoLayout, language_name: str, encoder_names: list[str], batch: MimoBatch,
                item_rules: Mapping[str, ItemRule | None] | None = None) -> None:
    """Pure checks of a global batch against the model: the same verdict on every rank, raised
    before any collective. `item_rules`: each encoder's `item_rule`."""
    unknown = [n for n in batch.modalities if n not in encoder_names]
    if unknown:
        raise ValueError(
            f"the batch carries modalities {unknown} that the model has no encoder for "
            f"(encoders: {encoder_names}); add an encoder or drop them from the batch"
        )
    for name, m in batch.modalities.items():
        rule = (item_rules or {}).get(name)
        problem = rule and m.num_items and rule(tuple(m.inputs.shape[1:]), m.tokens_per_item)
        if problem:
            raise ValueError(f"the batch's {name!r} items do not fit encoder {name!r}: {problem}; build the "
                             "batch's ModalityInputs for this encoder (its inputs and tokens_per_item)")
    cp = layout.parallelism(language_name).cp
    if cp > 1 and batch.seq_len % (2 * cp):
        raise ValueError(
            f"{language_name!r} has cp={cp}: the sequence length {batch.seq_len} must be a "
            f"multiple of 2*cp={2 * cp} (load-balanced sharding); pad the rows"
        )
