"""The language model as torch pipeline stages over its mesh's pp dim, run by torch's schedules.

The decoder — the library's `Llama` or a user's own module meeting the protocol — is cut into
``pp * virtual_stages`` stages (`stage_layers`), each a `decoder_stage` of it (the user's own class
holding its parts of the decoder, `dtensor_mimo.models.protocol`) parallelized with the same
function as the whole decoder at pp = 1 (`dtensor_mimo.parallelize.parallelize`: a user's
``parallelize`` per part).
Stage s lives on pp rank ``PipelineConfig.stage_rank(s, pp)`` (looped, or V-shaped for the V
schedules) as a `PipelineStage` whose module is a `LanguageStage`:

- the first stage embeds the microbatch's text, takes the encoder rows from the `LanguageFeed`,
  scatters them in at their special tokens (`assemble`) and cuts this rank's cp chunk;
- every stage runs its decoder layers on the cp chunk (rotary positions, causality and documents
  come as per-microbatch keyword arguments, which torch passes to every stage);
- the last stage applies norm and head and returns its loss share: summed token losses over the
  loss tokens of the GLOBAL batch (computed inside the stage, so the logits are freed there and
  never become a stage output), which torch's schedule takes as the microbatch loss; the
  microbatch losses add up to the single-process loss and gradients are sums (``scale_grads=False``).

Each stage module is its own FSDP2 root over dp·cp (its earlier microbatches accumulate, its
last backward reduce-scatters as it goes: `reduce_in_this_backward`; under the zero-bubble
schedules after torch's schedule, as torch does), composed with the decoder's
tp/sp plan and per-block compile exactly as at pp = 1. torch's stages have static shapes: the `PipelineStage`s and
schedule are built per (microbatch rows, sequence length) and cached, so a new length bucket
gets its own stages instead of a gloo abort or a stale buffer.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor import DTensor, Replicate

from dtensor_mimo.assemble import assemble, embed_text
from dtensor_mimo.data import MimoBatch
from dtensor_mimo.layout import MimoLayout
from dtensor_mimo.models import FlexAttentionCore, Llama, causal_attention
from dtensor_mimo.models.llama import head_is_embedding, untie_embeddings
from dtensor_mimo.models.protocol import decoder_stage
from dtensor_mimo.parallelize import ParallelOptions, compute_dtype, parallelize
from dtensor_mimo.parallelize.reducer import StageReductions
from dtensor_mimo.schedule.config import ZERO_BUBBLE_SCHEDULES, PipelineConfig, stage_layers
from dtensor_mimo.schedule.runtime import cached, phase, run_schedule
from dtensor_mimo.sequence import (ContextParallelAttention, linear_token_loss_sum, loss_weights, shard_for_cp,
                                   token_loss_sum, vocab_parallel_argmax, zigzag_shard)
from dtensor_mimo.sequence import loss as token_loss

if TYPE_CHECKING:
    from dtensor_mimo.schedule.feed import LanguageFeed


class LanguageStage(nn.Module):
    """One pipeline stage of the decoder (an FSDP root); `llama` holds only this stage's parts,
    under the whole model's parameter names."""

    keeps_float_inputs = True
    """Under FSDP2's mixed precision its forward inputs keep their dtypes (`precision.FP32_INPUTS`):
    the loss weights (``loss_mask``, fractional) weigh the tokens in fp32, as the normalizer sums
    them; its other float input, a previous stage's hidden states, comes in the compute dtype."""

    def __init__(self, llama: nn.Module, first: bool, last: bool, cp_size: int, cp_rank: int,
                 hidden_dtype: torch.dtype | None = None, chunked_loss: bool = False,
                 loss_compile: Mapping[str, Any] | None = None, whole_compile: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.llama, self.first, self.last = llama, first, last
        # The head runs inside the loss (`linear_token_loss_sum`) for the library's decoder, whose
        # logits are exactly its plain bias-free Linear head of its headless forward (a user's
        # decoder may do more to its logits; a float8 head keeps its own forward).
        head = getattr(llama, "output", None)
        # The library's decoder with its plain head: its loss may run the head on the rows with
        # a loss weight only (`loss_rows`), chunked (tp = 1) or as the decoder's own (tp > 1). Not
        # a subclass with a forward of its own, which may transform its logits (the headless
        # paths below would drop that).
        self.plain_head = (last and isinstance(llama, Llama) and type(llama).forward is Llama.forward
                           and type(head) is nn.Linear and head.bias is None)
        self.chunked_loss = chunked_loss and self.plain_head
        # The chunked loss's arithmetic compiled with `loss_compile`'s "backend" and inductor's
        # "options" (the module's, not its mode); None: eager
        self.loss_compile_backend = (loss_compile or {}).get("backend")
        self.loss_compile_options = (loss_compile or {}).get("options")
        # The decoder compiled whole (`whole_compile`: its torch.compile keywords): where its logits
        # fit in one chunk, the head and the loss join its graph (`_decoder_loss`), one compiled
        # call per forward and backward instead of a dozen eager operations each, on a host-bound
        # step. Only for the library's own forward, whose logits are the plain head's (a subclass
        # may transform them, which the headless path below would not). The function is compiled
        # unbound and takes the stage, so that a copy of the stage runs its own modules.
        self.small_loss = (torch.compile(_decoder_loss, **whole_compile)
                           if whole_compile is not None and self.chunked_loss else None)
        self.cp_size, self.cp_rank = cp_size, cp_rank
        self.hidden_dtype = hidden_dtype  # what a non-last stage sends on (the compute dtype)
        self.predicting = False  # the last stage returns next-token ids instead of a loss share
        self.predicted_loss: torch.Tensor | None = None  # and keeps the loss share here
        self.set_step(None, {}, 1.0)

    def set_step(self, feed: LanguageFeed | Mapping[str, torch.Tensor] | None,
                 special_token_ids: Mapping[str, int], normalizer: float) -> None:
        """What this step's microbatches share: where the first stage's encoder rows come from
        (a `LanguageFeed`, or one microbatch's rows as a mapping), the special token ids, and the
        loss normalizer (the global batch's loss tokens)."""
        self.feed, self.special_token_ids, self.normalizer = feed, dict(special_token_ids), normalizer

    def forward(self, x: torch.Tensor, *, microbatch: int, positions: torch.Tensor | None,
                document_ids: torch.Tensor | None, sequence_index: torch.Tensor | None,
                labels: torch.Tensor, loss_mask: torch.Tensor,
                special_counts: Mapping[str, int] | None = None, loss_rows: int | None = None) -> torch.Tensor:
        """`x`: token ids ``[b, S]`` on the first stage, else the previous stage's hidden states.
        Returns hidden states, or on the last stage this microbatch's loss share (its greedy
        next-token ids ``[b, S / cp]`` while `predicting`). `special_counts`: the microbatch's
        special tokens per modality from its host metadata (`stage_inputs`), so that assembling
        on an accelerator does not count them on the device (a host sync per microbatch).
        `loss_rows`: this chunk's positions with a loss weight, counted on the host
        (`LanguagePipeline`), when the head should run on those rows only (the last stage)."""
        if self.first:
            ids = self.special_token_ids
            text = embed_text(self.llama.tok_embeddings, x, ids)
            if isinstance(text, DTensor):  # vocab-parallel embedding under sp: sequence-sharded
                text = text.full_tensor()
            feed = self.feed
            rows = {} if feed is None else feed if isinstance(feed, Mapping) else feed.rows(microbatch)
            x = assemble(text, x, rows, ids, counts=special_counts)
            if x is text and x._is_view():
                # No rows scattered in (a text-only microbatch): the tp embedding's output as it
                # came, the view its `to_local` returns. A compiled first block that took that view
                # as its input broke the embedding's backward (torch 2.13: its redistribution's
                # backward got a plain tensor, on every tp rank).
                x = x.clone()
            if self.cp_size > 1:
                x = zigzag_shard(x, self.cp_size, self.cp_rank)
        # `loss_rows` reaches every stage of the microbatch (torch passes the keywords to all):
        # only the last one, holding the head, acts on it.
        if (self.chunked_loss or (self.plain_head and loss_rows is not None)) and not self.predicting:
            if self.small_loss is not None and loss_rows is None and (
                    x.shape[:-1].numel() * self.llama.output.out_features <= token_loss.LOSS_CHUNK_LOGITS):
                return self.small_loss(self, x, positions, document_ids, sequence_index, labels, loss_mask) \
                    / self.normalizer
            # The decoder without its head (the protocol's forward with `output` None returns
            # the normalised hidden states: under tp plain, full and replicated, the sequence
            # shards gathered); the head's weight was gathered by FSDP2 in this root module's
            # pre-forward.
            head = self.llama.output
            self.llama._modules["output"] = None
            try:
                h = self.llama(h=x, positions=positions, document_ids=document_ids, sequence_index=sequence_index)
            finally:
                self.llama._modules["output"] = head
            with phase("loss", microbatch):
                if self.chunked_loss:  # tp = 1: the head's weight is plain
                    return linear_token_loss_sum(h, head.weight, labels, loss_mask,
                                                 compile_backend=self.loss_compile_backend,
                                                 compile_options=self.loss_compile_options,
                                                 counted=loss_rows) / self.normalizer
                # The head on the loss rows only, as the decoder applies it: under tp its input a
                # replicated DTensor (its colwise plan then moves nothing), its logits sharded over
                # the vocabulary (loss_parallel) or gathered. Every tp rank picks the same rows.
                h, labels, weights = token_loss.pick_loss_rows(h, labels, loss_mask, loss_rows)
                h = h.unsqueeze(0)
                if isinstance(head.weight, DTensor):
                    h = DTensor.from_local(h, head.weight.device_mesh, [Replicate()], run_check=False)
                return token_loss_sum(head(h), labels, weights) / self.normalizer
        out = self.llama(h=x, positions=positions, document_ids=document_ids, sequence_index=sequence_index)
        if not self.last:
            out = out if self.hidden_dtype is None else out.to(self.hidden_dtype)
            # torch's zero-bubble input pass detaches each stage output in place (`detach_`),
            # which a view refuses: under sp the hidden states are the view `full_tensor` returns.
            return out.clone() if out._is_view() else out
        if self.predicting:  # the ids, and the loss share of the same logits (held-out loss)
            self.predicted_loss = token_loss_sum(out, labels, loss_mask).detach() / self.normalizer
            return vocab_parallel_argmax(out) if isinstance(out, DTensor) else out.argmax(-1)
        with phase("loss", microbatch):  # the head ran in the decoder, on every row
            return token_loss_sum(out, labels, loss_mask) / self.normalizer


def _decoder_loss(stage: LanguageStage, x: torch.Tensor, positions: torch.Tensor | None,
                  document_ids: torch.Tensor | None, sequence_index: torch.Tensor | None, labels: torch.Tensor,
                  loss_mask: torch.Tensor) -> torch.Tensor:
    """The summed token losses of the last `stage`'s logits on every row (`LanguageStage.small_loss`
    compiles it with the decoder, whose own compiled forward it inlines)."""
    logits = stage.llama(h=x, positions=positions, document_ids=document_ids, sequence_index=sequence_index)
    return token_loss.checked_token_loss_sum(logits, labels, loss_mask)


def stage_inputs(mb: MimoBatch, cp_size: int, cp_rank: int,
                 loss_rows: int | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """A language rank's microbatch as `LanguageStage` arguments: the full token rows (the first
    stage embeds them, then cuts its cp chunk) and this cp rank's chunk of everything else.
    Without cp the rows are plain (``sequence_index`` None: a causal kernel, no mask). The
    special-token counts come from the batch metadata (items x tokens per item, which a
    `MimoBatch` checked against its tokens on the host when it was built): no device sync."""
    chunk = mb if cp_size == 1 else shard_for_cp(cp_size, cp_rank, labels=mb.labels, loss_mask=mb.loss_mask,
                                                 positions=mb.positions, document_ids=mb.document_ids)
    return mb.tokens, dict(positions=chunk.positions, document_ids=chunk.document_ids,
                           sequence_index=chunk.sequence_index if cp_size > 1 else None,
                           labels=chunk.labels, loss_mask=chunk.loss_mask,
                           special_counts={n: mb.num_tokens(n) for n in mb.modalities}, loss_rows=loss_rows)


def llama_stage(llama: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    """The stage of decoder `llama` (a `Llama` or a user's decoder meeting the protocol) that holds
    its blocks `layers` (positions in ``llama.layers``), plus the embedding on the first stage,
    norm and head on the last: `dtensor_mimo.models.protocol.decoder_stage`, the decoder's own
    class sharing its modules; parameter names stay those of the whole model."""
    return decoder_stage(llama, layers, first, last)


def untie_for_stages(layout: MimoLayout, language: nn.Module, name: str, config: PipelineConfig | None) -> None:
    """Where the library's tied decoder (`LlamaConfig.tie_embeddings`) is cut into several pipeline
    stages (pp > 1, or virtual stages on one rank: the embedding on the first, the head on the
    last, each stage its own FSDP2 root), give its head its own copy of the embedding, with a
    warning naming the module (`dtensor_mimo.models.llama.untie_embeddings`): the copies train
    apart, as before tied models were supported. A user's tied decoder stays refused by name
    (`check_untied`). After `check_model` (a refused model is left as it was), on every rank alike."""
    if (not isinstance(language, Llama) or not language.config.tie_embeddings or name not in layout.names
            or not head_is_embedding(language)):
        return
    pp = layout.parallelism(name).pp
    stages = config.num_stages(pp) if config is not None else pp
    if stages > 1:
        cut = f"pp={pp}" if stages == pp else f"pp={pp} x virtual_stages={stages // pp} = {stages} pipeline stages"
        untie_embeddings(language, f"language model {name!r} with {cut} (the embedding on the first stage, "
                                   "the head on the last)")


def _stage_loss(loss_share: torch.Tensor, _target: None) -> torch.Tensor:
    """torch's loss function: the last stage already returned its loss share."""
    return loss_share


class LanguagePipeline:
    """The language model's stages on this rank and torch's schedule over its pp group.

    Args:
        layout, name: the layout and the language module's name; this rank must be a member.
        llama: the whole decoder, a `Llama` or a user's module meeting the protocol (its stages'
            modules are taken from it, not copied).
        options: the language module's `ParallelOptions`.
        config: the `PipelineConfig`.
        device: this rank's device.
    """

    def __init__(self, layout: MimoLayout, name: str, llama: nn.Module, options: ParallelOptions,
                 config: PipelineConfig, device: torch.device) -> None:
        par = layout.parallelism(name)
        coord = layout.coordinate(name, torch.distributed.get_rank())
        self.config, self.device, self.par = config, device, par
        self.cp_rank = coord["cp"]
        self.n_stages = config.num_stages(par.pp)
        self.pp_group = layout.mesh(name, "pp").get_group()
        self.dim = llama.config.dim
        self.vocab = getattr(llama.config, "vocab_size", 0)  # of the chunked head (the library's `Llama`)
        self.dtype = compute_dtype(options, llama)  # of the hidden states between stages
        tp_mesh, dp_mesh = layout.mesh(name, "tp"), layout.fsdp_mesh(name)  # 2-D with HSDP
        flex = options.language_flex(device, par.cp, library_decoder=isinstance(llama, Llama))
        inner = FlexAttentionCore() if flex else causal_attention
        if par.cp > 1:
            llama.set_attention_fn(ContextParallelAttention(layout.mesh(name, "cp"), inner))
        elif flex:
            llama.set_attention_fn(inner)
        bounds = stage_layers(len(llama.layers), self.n_stages, config.split, module=name)
        self.stage_indices = config.rank_stages(coord["pp"], par.pp)
        self.stages = nn.ModuleList()
        for s in self.stage_indices:
            part = llama_stage(llama, bounds[s], s == 0, s == self.n_stages - 1)
            module = LanguageStage(part, s == 0, s == self.n_stages - 1, par.cp, self.cp_rank, self.dtype,
                                   chunked_loss=options.chunked_loss and par.tp == 1,
                                   loss_compile={"backend": options.compile_backend,
                                                 "options": options.compile_options} if options.compile else None,
                                   whole_compile=options.compile_kwargs
                                   if options.compile and options.compile_scope == "module" else None)
            self.stages.append(parallelize(module, tp_mesh, dp_mesh, options, parts=[part], name=name,
                                           first_block=bounds[s].start))
        # Each FSDP2 stage reduce-scatters during its last backward of a step, not after torch's
        # schedule; not under a split backward, whose weight half comes after the counted one
        # (torch's reduction after the schedule does it there).
        self.reductions = StageReductions(self.stages, config.schedule not in ZERO_BUBBLE_SCHEDULES)
        self._schedules: OrderedDict = OrderedDict()

    @property
    def first(self) -> LanguageStage | None:
        """The first stage's module if this rank holds it."""
        return self.stages[0] if self.stage_indices[0] == 0 else None

    @property
    def holds_loss(self) -> bool:
        """This rank holds the last stage, whose outputs are the loss shares."""
        return self.stage_indices[-1] == self.n_stages - 1

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters of the decoder, under the whole model's names."""
        return {n: p for stage in self.stages for n, p in stage.llama.named_parameters()}

    def _count_loss_rows(self, mb: MimoBatch) -> int | None:
        """The positions of this rank's cp chunk of `mb` with a loss weight, counted on the host,
        where the last stage here holds the library's plain head and its logits would take more
        than one chunk (`LOSS_CHUNK_LOGITS`): the head then runs on those rows only (chunked at
        tp = 1, `linear_token_loss_sum`'s ``counted``; under the decoder's tp plan at tp > 1).
        The size is the whole vocabulary's, also under tp (a rank's logits are 1/tp of it).
        None where the head is small (the selection's few host operations would cost a
        host-bound step more than they save), where the microbatch has no loss position, or
        where the batch is already on an accelerator (counting there would sync)."""
        stage = self.stages[-1]
        if (not self.holds_loss or not stage.plain_head or mb.labels.device.type != "cpu"
                or mb.batch_size * mb.seq_len // self.par.cp * self.vocab <= token_loss.LOSS_CHUNK_LOGITS):
            return None
        chunk = shard_for_cp(self.par.cp, self.cp_rank, labels=mb.labels, loss_mask=mb.loss_mask) \
            if self.par.cp > 1 else mb
        # None for none at all: the head then runs on every row at weight 0, not on an empty
        # selection (whose vocabulary-parallel all-reduces would carry no elements).
        return int(torch.count_nonzero(loss_weights(chunk.labels, chunk.loss_mask))) or None

    def _schedule(self, rows: int, seq_len: int) -> tuple[Any, list[PipelineStage]]:
        return cached(self._schedules, (rows, seq_len), lambda: self._build(rows, seq_len))

    def _build(self, rows: int, seq_len: int) -> tuple[Any, list[PipelineStage]]:
        """torch's schedule over this rank's `PipelineStage`s with one shape's static metadata, and
        those stages (`run_schedule` prepares them itself)."""
        s_local, dtype = seq_len // self.par.cp, self.dtype
        stages = []
        for s, module in zip(self.stage_indices, self.stages):
            # Examples give torch static metadata (no inference pass); requires_grad marks the
            # activations whose gradients travel between stages.
            x = (torch.zeros(rows, seq_len, dtype=torch.int64, device=self.device) if s == 0 else
                 torch.empty(rows, s_local, self.dim, dtype=dtype, device=self.device, requires_grad=True))
            y = (torch.zeros((), device=self.device, requires_grad=True) if s == self.n_stages - 1 else
                 torch.empty(rows, s_local, self.dim, dtype=dtype, device=self.device, requires_grad=True))
            stages.append(PipelineStage(module, s, self.n_stages, self.device, input_args=(x,),
                                        output_args=(y,), group=self.pp_group))
        cls = get_schedule_class(self.config.schedule)
        single = issubclass(cls, PipelineScheduleSingle)
        return cls(stages[0] if single else stages, self.config.microbatches, loss_fn=_stage_loss,
                   scale_grads=False), stages

    def run(self, microbatches: list[MimoBatch], normalizer: float, feed: LanguageFeed | None) -> torch.Tensor:
        """Forward and backward of this rank's dp shards of the `microbatches` (one per global
        microbatch, equal sizes); returns this rank's loss share (0 off the last stage)."""
        first = microbatches[0]
        schedule, stages = self._schedule(first.batch_size, first.seq_len)
        for stage in self.stages:
            stage.set_step(feed if stage.first else None, first.special_token_ids, normalizer)
        args, kwargs = [], []
        for i, mb in enumerate(microbatches):  # keyword arguments reach every stage
            tokens, kw = stage_inputs(mb.to(self.device, encoder_inputs=False), self.par.cp, self.cp_rank,
                                      self._count_loss_rows(mb))
            args.append((tokens,))
            kwargs.append(dict(microbatch=i, **kw))
        losses: list[torch.Tensor] = []
        with self.reductions.step(len(microbatches)):
            run_schedule(schedule, stages, args, kwargs, [None] * len(args), losses)
        if self.first is not None:
            self.first.set_step(None, {}, 1.0)
        if not self.holds_loss:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach() for loss in losses]).sum()

    def run_once(self, mb: MimoBatch, rows: Mapping[str, torch.Tensor], normalizer: float = 1.0,
                 predicting: bool = False) -> torch.Tensor | None:
        """One forward of this rank's dp shard `mb` (encoder `rows` for the first stage), stage
        after stage, outside torch's schedule; returns the last stage's output on its rank (this cp
        chunk's loss share, or next-token ids while `predicting`, its loss share then in
        ``predicted_loss``), else None. With autograd on,
        the caller runs backward (``model(batch).backward()``: one stage only). Blocking
        point-to-point in stage order (stage s sends to s + 1 before anyone posts s + 1's send;
        consecutive stages on one rank, as in a V, hand over locally), so NCCL cannot deadlock."""
        tokens, kwargs = stage_inputs(mb.to(self.device, encoder_inputs=False), self.par.cp, self.cp_rank,
                                      None if predicting else self._count_loss_rows(mb))
        pp_rank, where = self.pp_group.rank(), lambda stage: self.config.stage_rank(stage, self.par.pp)
        x, out = tokens, None
        self.predicted_loss: torch.Tensor | None = None
        for s in range(self.n_stages):
            if s not in self.stage_indices:
                continue
            module = self.stages[self.stage_indices.index(s)]
            if s > 0 and where(s - 1) != pp_rank:
                x = torch.empty(*tokens.shape[:1], tokens.shape[1] // self.par.cp, self.dim,
                                dtype=self.dtype, device=self.device)
                torch.distributed.recv(x, group=self.pp_group, group_src=where(s - 1))
            module.set_step(rows if module.first else None, mb.special_token_ids, normalizer)
            module.predicting = predicting and module.last
            try:
                x = module(x, microbatch=0, **kwargs)
            finally:
                module.predicting = False
                module.set_step(None, {}, 1.0)
            if s + 1 < self.n_stages and where(s + 1) != pp_rank:
                torch.distributed.send(x.contiguous(), group=self.pp_group, group_dst=where(s + 1))
            out = x if module.last else None
            if module.last and predicting:
                self.predicted_loss, module.predicted_loss = module.predicted_loss, None
        return out
