"""Pure checks of a `MimoModel`'s parts against its layout and of a global batch against the model:
the same verdict on every rank, raised before any process group is used."""

from __future__ import annotations

from typing import AbstractSet, Mapping

import torch
from torch import nn

from dtensor_mimo.data import IGNORE_INDEX, MimoBatch
from dtensor_mimo.layout import LayoutError, MimoLayout, torch_compat
from dtensor_mimo.models import Llama, ModalityEncoder
from dtensor_mimo.models.protocol import ItemRule, encoder_problems, language_problems
from dtensor_mimo.models.vit import self_attentions
from dtensor_mimo.parallelize import ParallelOptions
from dtensor_mimo.parallelize.part import (check_compile_layout, check_fsdp_ties, check_tp_sizes, check_untied,
                                           library_ties)
from dtensor_mimo.schedule.config import (ZERO_BUBBLE_SCHEDULES, PipelineConfig, check_pipeline_layout,
                                          stage_layers)


def check_unshared(layout: MimoLayout, modules: Mapping[str, nn.Module]) -> None:
    """Refuse (ValueError naming both modules and a parameter) a parameter held by two of `modules`
    (an image tower given to two encoders, say) where it trains, or where the two modules share
    ranks. Each module is parallelized and trained on its own ranks with its own optimizer, so the
    one tensor of the single-process model would become copies that train apart (or one tensor
    stepped by two optimizers); and a rank holding both would parallelize it twice (FSDP2 refuses
    that on those ranks only). Frozen, on disjoint ranks, each copy stays the tensor it was. Pure."""
    owner: dict[int, tuple[str, str]] = {}
    for name, module in modules.items():
        for pname, p in module.named_parameters():
            first = owner.setdefault(id(p), (name, pname))
            other = first[0]
            if other == name:
                continue
            if p.requires_grad:
                why = "each module trains on its own ranks with its own optimizer, so the copies would train apart"
            elif set(layout.ranks(other)) & set(layout.ranks(name)):
                why = "they share ranks, which would parallelize the shared part twice"
            else:
                continue
            raise ValueError(f"modules {other!r} and {name!r} share parameters ({other}.{first[1]} is "
                             f"{name}.{pname}): {why}; give each module its own copy of the shared part")


def check_model(layout: MimoLayout, language: nn.Module, encoders: Mapping[str, nn.Module],
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
    check_unshared(layout, {language_name: language, **encoders})
    lang = layout.parallelism(language_name)
    # The language model's pipeline stages: pp x virtual_stages, more than one also at pp = 1 (two
    # stages on one rank), where each stage holds only its parts of the decoder just the same.
    lang_stages = pipeline.num_stages(lang.pp) if pipeline is not None else lang.pp
    problems = language_problems(language, tp=lang.tp, cp=lang.cp, pp=lang.pp, stages=lang_stages)
    if problems:
        raise TypeError(f"the language model ({type(language).__name__}) does not meet the language protocol "
                        f"(dtensor_mimo.models.protocol): it needs {'; '.join(problems)}")
    flex = [n for n, o in options.items() if o.flex_attention and n in encoders and not self_attentions(encoders[n])]
    if flex:
        raise LayoutError(f"ParallelOptions(flex_attention=True) was given for encoders {flex}, which hold no library "
                          "SelfAttention (ViT, AudioEncoder) whose packed items it would take; drop the option there")
    if options.get(language_name, ParallelOptions()).flex_attention and not callable(
            getattr(language, "set_attention_fn", None)):
        raise LayoutError(f"ParallelOptions(flex_attention=True) for {language_name!r} needs a decoder with "
                          "set_attention_fn(fn) (the attention core goes in through it)")
    if options.get(language_name, ParallelOptions()).balance:
        raise LayoutError(f"ParallelOptions(balance=True) was given for the language model {language_name!r}; "
                          "balancing applies to encoders (their items over their dp ranks)")
    for name in layout.names:
        par = layout.parallelism(name)
        check_tp_sizes(name, language if name == language_name else encoders[name], par.tp)
        stages = lang_stages if name == language_name else par.pp
        if stages > 1:
            cut = f"pp={par.pp}" if stages == par.pp else \
                f"pp={par.pp} x virtual_stages={stages // par.pp} = {stages} pipeline stages"
            module = language if name == language_name else encoders[name]
            check_untied(name, module, f"{cut}: the pipeline split gives each stage its own pieces",
                         # the library's tied decoder itself: `untie_for_stages` unties it after the checks
                         allowed=library_ties(module) if name == language_name and isinstance(module, Llama) else ())
        if options.get(name, ParallelOptions()).fsdp and par.dp * par.cp > 1:
            check_fsdp_ties(name, language if name == language_name else encoders[name], par.dp * par.cp)
        check_compile_layout(name, options.get(name, ParallelOptions()), par)
        if par.hsdp and not options.get(name, ParallelOptions()).fsdp:
            raise LayoutError(f"{name!r} has dp_replicate={par.dp_replicate} (HSDP: FSDP2 shards within replica "
                              "groups) but ParallelOptions(fsdp=False) keeps its parameters whole on every dp rank; "
                              "set fsdp=True, or dp_replicate=1")
        if name == language_name and par.pp > 1 and pipeline is None:
            raise LayoutError(f"{name!r} has pp={par.pp}: pass pipeline=PipelineConfig(microbatches=...) "
                              "to MimoModel (at least pp microbatches keep every stage busy)")
        if name != language_name and par.cp != 1:
            raise LayoutError(f"encoder {name!r} has cp={par.cp}; context parallelism applies to the "
                              "language model only: use dp for the encoder instead")
    check_pipeline_layout(layout, language_name, pipeline)
    for name, module in encoders.items():
        pp = layout.parallelism(name).pp
        mine = options.get(name, ParallelOptions())
        config = getattr(module.encoder if isinstance(module, ModalityEncoder) else module, "config", None)
        if (mine.compile and mine.compile_scope == "module"
                and (getattr(config, "dynamic_resolution", False) or getattr(config, "variable_length", False))):
            raise LayoutError(f"encoder {name!r} takes items of their own sizes (a list of them per call), and "
                              "compile_scope='module' would compile its whole forward once per count of items "
                              "(dynamo stops at 8 and runs the rest eager); use compile_scope='block' (the "
                              "blocks take the items packed as one sequence)")
        if mine.recompute_colocated and not (
                set(layout.ranks(name)) & set(layout.ranks(language_name))):
            raise LayoutError(f"encoder {name!r} has ParallelOptions(recompute_colocated=True) but shares no rank "
                              f"with {language_name!r}: only a colocated encoder keeps its graph through the "
                              "language schedule (one on ranks of its own already holds only its crossing window)")
        tower = module.encoder if isinstance(module, ModalityEncoder) else module
        problem = recomputed_compile_problem(name, mine, layout.parallelism(name).tp,
                                             pipeline.microbatches if pipeline is not None else 1,
                                             any(p.requires_grad for p in tower.parameters()))
        if problem:
            raise LayoutError(problem)
        if options.get(name, ParallelOptions()).balance and pp > 1:
            raise LayoutError(f"encoder {name!r} has pp={pp} and ParallelOptions(balance=True): balancing "
                              "moves items between the dp ranks of a pp = 1 encoder; drop balance, or use pp = 1")
        if pp > 1:
            problem = encoder_pipeline_problem(layout, language_name, encoders, name, options, pipeline)
            if problem:
                raise LayoutError(f"encoder {name!r} has pp={pp}: {problem}")
            stage_layers(len(module.encoder.layers), pp, module=name)
    lang_options = options.get(language_name, ParallelOptions())
    stages = pipeline.num_stages(layout.parallelism(language_name).pp) if pipeline is not None else 1
    if lang_options.compile and lang_options.compile_scope == "module" and stages > 1:
        raise LayoutError(f"{language_name!r} runs as {stages} pipeline stages, whose pieces of the decoder share one "
                          "forward that compile_scope='module' would compile in a variant per stage, mode and shape "
                          "(dynamo stops at 8 and runs the rest eager); use compile_scope='block'")
    if pipeline is not None:  # every rank, before any process group: layers per stage
        stage_layers(len(language.layers), stages, pipeline.split, module=language_name)
    if pipeline is not None and pipeline.schedule in ZERO_BUBBLE_SCHEDULES and torch_compat.RELEASE < (2, 13):
        # Measured on torch 2.11 (docs/testing.md): InterleavedZeroBubble's input pass reads
        # requires_grad of a stage's non-tensor inputs; the V schedules' stage set-up sends fail.
        raise LayoutError(f"schedule {pipeline.schedule!r} needs torch >= 2.13 (this is {torch.__version__}, whose "
                          "pipelining fails on this library's stages under the zero-bubble schedules): use "
                          "schedule='Interleaved1F1B' or '1F1B', or torch 2.13")
    lang = layout.parallelism(language_name)
    if pipeline is not None and (problem := one_rank_stages_problem(language_name, lang.pp, stages)):
        raise LayoutError(problem)
    if (pipeline is not None and pipeline.schedule in ZERO_BUBBLE_SCHEDULES and lang_options.fsdp
            and lang_options.reshard_after_forward and lang.dp * lang.cp > 1):
        # Measured on torch 2.13 at pp2·dp2 against the single-process run (2026-11-28): with the
        # parameters resharded after each forward, FSDP2's gradients under InterleavedZeroBubble came
        # out wrong and the V schedules' weight pass raised KeyError (an AccumulateGrad node): torch's
        # input pass groups the stage's parameters as they are then, sharded, which are not the ones
        # in the graph. Kept unsharded from forward to backward, all three are right.
        raise LayoutError(f"schedule {pipeline.schedule!r} splits backward into an input pass and a weight pass, "
                          f"which fails with FSDP2 resharding {language_name!r}'s parameters after each forward "
                          f"over dp·cp = {lang.dp * lang.cp} (wrong gradients against a single process under "
                          "InterleavedZeroBubble, a KeyError in torch's weight pass under the V schedules): use "
                          "ParallelOptions(reshard_after_forward=False) (the parameters stay gathered from forward "
                          "to backward), or fsdp=False, or schedule='Interleaved1F1B' or '1F1B'")
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


def one_rank_stages_problem(name: str, pp: int, stages: int) -> str | None:
    """Why the language model `name` cannot run `stages` pipeline stages over `pp` ranks on this
    torch, or None. Measured on torch 2.11 (2026-11-29, test_fuzz): at pp = 1 the schedule's stage
    set-up sends each stage's shapes to the next one, on the same rank, which gloo refuses ("Pair
    is not connected") on the language ranks alone while the encoders' ranks wait. Pure."""
    if stages > 1 and pp == 1 and torch_compat.RELEASE < (2, 13):
        return (f"{name!r} runs {stages} pipeline stages on each of its ranks (pp=1, virtual_stages={stages}), "
                f"which needs torch >= 2.13 (this is {torch.__version__}, whose pipelining sends a stage's set-up to "
                "the next stage on the same rank, and gloo refuses a send to itself): use virtual_stages=1, pp > 1, "
                "or torch 2.13")
    return None


def recomputed_compile_problem(name: str, options: ParallelOptions, tp: int, microbatches: int,
                               trains: bool) -> str | None:
    """Why encoder `name` with `options` cannot train at `tp` over `microbatches` (None: it can):
    compiled and recomputed in the colocated three phases (`ParallelOptions.recompute_colocated`)
    at tp > 1 over more than one microbatch, where it `trains` (its tower: a frozen tower's
    projection alone leaves no tp weight gradient in the blocks). `check_model` refuses it; the
    planner (`dtensor_mimo.plan.search`) skips such layouts by this same rule."""
    if not (options.recompute_colocated and options.compile and tp > 1 and microbatches > 1 and trains):
        return None
    # torch 2.13: the tp weight gradients a compiled block's backward leaves (DTensors whose
    # _StridedShard placement `__tensor_unflatten__` cannot rebuild) fail dynamo's next trace
    # of the block, a recomputed microbatch's forward holding the gradients of the one before
    return (f"encoder {name!r} is compiled (ParallelOptions.compile) at tp={tp} with "
            f"recompute_colocated=True and {microbatches} microbatches: torch's compiler "
            "fails on the second microbatch's recomputed forward (the first one's tensor-parallel "
            f"weight gradients); set recompute_colocated=False or compile=False for {name!r}, "
            "give it tp = 1, or use one microbatch")


def compiled_varied_problem(name: str, tp: int, varied: bool, compiled: bool) -> str | None:
    """Why encoder `name` at `tp` cannot train on a batch whose items of its modality differ in
    size (`varied`) where it is `compiled` and its tower's backward traced (None: it can; a frozen
    tower traces none). `check_batch` refuses such a batch; the planner (`dtensor_mimo.plan.search`)
    skips such layouts by this same rule."""
    if not (varied and compiled and tp > 1):
        return None
    # torch 2.13's tracer of the joint graph recurses without end on the tp blocks' packed
    # row count (a lazy SymInt proxy of sym_max(rows, 1) that refers to itself): RecursionError
    return (f"the batch's {name!r} items differ in size, but encoder {name!r} is compiled "
            f"(ParallelOptions.compile) at tp={tp}: torch's compiler "
            "cannot trace the backward of its packed items under tensor parallel; set "
            f"compile=False for {name!r}, give it tp = 1 (dp instead), or items of one size")


def encoder_pipeline_problem(layout: MimoLayout, language_name: str, encoders: Mapping[str, nn.Module],
                             name: str, options: Mapping[str, ParallelOptions],
                             pipeline: PipelineConfig | None) -> str | None:
    """Why encoder `name` (pp > 1) cannot run as a pipeline, or None."""
    if pipeline is None:
        return "pass pipeline=PipelineConfig(microbatches=...)"
    if any(set(layout.ranks(name)) & set(layout.ranks(m)) for m in layout.names if m != name):
        return "its ranks must be its own: disjoint from the language model and every other encoder"
    if not overlapped(layout, language_name, encoders):
        return ("every encoder must train and sit on ranks of its own (the colocated three-phase path, "
                "taken otherwise, has no encoder stages)")
    if options.get(name, ParallelOptions()).sp:
        return "sequence parallel is not supported on encoder stages: set sp=False"
    if (mine := options.get(name, ParallelOptions())).compile and mine.compile_scope == "module":
        return ("compile_scope='module' does not reach encoder stages (a stage runs its blocks itself): "
                "use compile_scope='block'")
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


def overlapped(layout: MimoLayout, language_name: str, encoders: Mapping[str, nn.Module]) -> bool:
    """Encoder and language microbatches overlap when every encoder trains (its gradient comes
    back per microbatch) and sits on ranks of its own."""
    lang = set(layout.ranks(language_name))
    return all(any(p.requires_grad for p in e.parameters()) and not lang & set(layout.ranks(n))
               for n, e in encoders.items())


def check_batch(layout: MimoLayout, language_name: str, encoder_names: list[str], batch: MimoBatch,
                item_rules: Mapping[str, ItemRule | None] | None = None, vocab_size: int | None = None,
                sequence_parallel: bool = False, compiled: AbstractSet[str] = frozenset(),
                sequence_parallel_encoders: Mapping[str, int] | None = None) -> None:
    """Pure checks of a global batch against the model: the same verdict on every rank, raised
    before any collective. `item_rules`: each encoder's `item_rule`. `vocab_size`: the language
    model's embedding rows, which every token id that is not a modality's special id must index
    (checked once per batch, in host memory: a batch already on an accelerator is not read).
    `sequence_parallel`: the language model's `ParallelOptions.sp`. `compiled`: the encoders
    compiled (`ParallelOptions.compile`) whose backward this call traces.
    `sequence_parallel_encoders`: the encoders with `ParallelOptions.sp` whose backward it traces,
    each with the rows an item carries through its blocks beyond its tokens (1: a CLIP-style
    tower's class token, `ViTConfig.class_token`; else 0)."""
    for empty, what in ((batch.batch_size == 0, "no samples"), (batch.seq_len == 0, "no positions")):
        if empty:  # the language ranks would fail alone (DTensor under tp) or a step would train on nothing
            raise ValueError(f"the batch has {what} (tokens of shape {list(batch.tokens.shape)}): a run needs at "
                             "least one sample of at least one position; leave an empty batch out (a loader's "
                             "last one: drop_last)")
    unknown = [n for n in batch.modalities if n not in encoder_names]
    if unknown:
        raise ValueError(
            f"the batch carries modalities {unknown} that the model has no encoder for "
            f"(encoders: {encoder_names}); add an encoder or drop them from the batch"
        )
    for name, m in batch.modalities.items():
        rule = (item_rules or {}).get(name)
        kinds = sorted(m.item_kinds()) if rule and m.num_items else []
        problem = next((p for shape, tokens in kinds if (p := rule(shape, tokens))), None)
        if problem:
            raise ValueError(f"the batch's {name!r} items do not fit encoder {name!r}: {problem}; build the "
                             "batch's ModalityInputs for this encoder (its inputs and tokens_per_item)")
        if m.varied and layout.parallelism(name).pp > 1:
            raise ValueError(f"the batch's {name!r} items differ in size, but encoder {name!r} has pp="
                             f"{layout.parallelism(name).pp}: an encoder pipeline's stage links have one "
                             "shape per item; give it pp = 1 (dp or tp instead), or items of one size")
        if problem := compiled_varied_problem(name, layout.parallelism(name).tp, m.varied, name in compiled):
            raise ValueError(problem)
        tp = layout.parallelism(name).tp
        extra = (sequence_parallel_encoders or {}).get(name)
        if extra is not None and tp > 1 and torch_compat.RELEASE < (2, 13):
            if odd := sorted({t + extra for t in m.item_tokens if (t + extra) % tp}):
                # torch 2.11's DTensor leaves the rows an uneven Shard(1) gathers non-contiguous, and
                # the block's backward then fails viewing them ("view size is not compatible"), on
                # the encoder's ranks alone while the others wait for its gradients: a hang.
                raise ValueError(
                    f"encoder {name!r} has tp={tp} with sequence parallel (sp): on torch {torch.__version__} "
                    f"the tokens of each of its items must split evenly over tp (a sequence tp does not divide "
                    f"fails in DTensor's backward before torch 2.13), but the batch's {name!r} items have "
                    f"{', '.join(map(str, odd))} tokens{' with the class token its tower adds' if extra else ''}; "
                    f"set sp=False for {name!r}, give its items a multiple of {tp} tokens"
                    f"{' (the class token included)' if extra else ''}, or use torch 2.13")
    if vocab_size is not None and batch.tokens.is_cpu:
        problem = ids_outside(batch, vocab_size)
        if problem:
            raise ValueError(f"the batch's token ids must index the vocabulary of {language_name!r} (vocab_size="
                             f"{vocab_size}) or be the special token id of one of its modalities "
                             f"{batch.special_token_ids}: {problem}; fix the tokenizer / pad id, or the "
                             "modalities' special token ids")
    if batch.loss_mask.is_cpu and (problem := bad_loss_weights(batch)):
        raise ValueError(f"the batch's loss_mask must weigh each target token by a finite number >= 0: {problem}; "
                         "fix the weights (0 leaves a token out of the loss)")
    cp = layout.parallelism(language_name).cp
    if cp > 1 and batch.seq_len % (2 * cp):
        raise ValueError(
            f"{language_name!r} has cp={cp}: the sequence length {batch.seq_len} must be a "
            f"multiple of 2*cp={2 * cp} (load-balanced sharding); pad the rows"
        )
    tp, rows = layout.parallelism(language_name).tp, batch.seq_len // cp
    if sequence_parallel and tp > 1 and rows % tp and torch_compat.RELEASE < (2, 13):
        raise ValueError(
            f"{language_name!r} has tp={tp} with sequence parallel (sp): on torch {torch.__version__} its rows "
            f"must split evenly over tp (a sequence tp does not divide fails in DTensor's backward before torch "
            f"2.13), but a rank holds {rows} rows of the sequence length {batch.seq_len}"
            + (f" over cp={cp}" if cp > 1 else "") + f"; pad the rows to a multiple of {tp * cp} (the trainer "
            "does), or use torch 2.13"
        )


def bad_loss_weights(batch: MimoBatch) -> str | None:
    """Where `batch`'s loss weights of its target tokens (labels not IGNORE) are negative or not
    finite, or None: a NaN would make every step's gradients non-finite (each skipped, the cause
    named nowhere), a negative weight would train away from its target. Once per batch
    (`MimoBatch.memo`: `MimoModel.prepare` finds it ahead of the step)."""
    return batch.memo("bad loss weights", lambda: _bad_loss_weights(batch))


def _bad_loss_weights(batch: MimoBatch) -> str | None:
    weights = batch.loss_mask
    bad = ((weights < 0) | ~torch.isfinite(weights)) & (batch.labels != IGNORE_INDEX)
    return _first_marked(bad, "weight", lambda row, column: f"sample {row} weighs its target at position {column} "
                                                            f"by {float(weights[row, column])}")


def ids_outside(batch: MimoBatch, vocab_size: int) -> str | None:
    """Where `batch`'s token ids fall outside ``0 .. vocab_size - 1`` and are no special id of its
    modalities (the embedding lookup of the language model's first stage would raise there, on
    its ranks alone, leaving the encoder ranks waiting for gradients), or None. Once per batch
    (`MimoBatch.memo`: `MimoModel.prepare` finds it ahead of the step)."""
    return batch.memo(("token ids outside", vocab_size), lambda: _ids_outside(batch, vocab_size))


def _ids_outside(batch: MimoBatch, vocab_size: int) -> str | None:
    tokens = batch.tokens
    outside = (tokens < 0) | (tokens >= vocab_size)
    for token_id in batch.special_token_ids.values():
        outside &= tokens != token_id
    return _first_marked(outside, "token", lambda row, column: f"sample {row} holds id {int(tokens[row, column])} "
                                                                f"at position {column}")


def _first_marked(marked: torch.Tensor, noun: str, describe) -> str | None:
    """None where `marked` (``[B, S]`` bools) marks nothing, else `describe` of its first marked
    (row, column) and how many `noun`s of the batch are marked."""
    count = int(marked.sum())
    if not count:
        return None
    row, column = (int(i) for i in marked.nonzero()[0])
    return f"{describe(row, column)} ({count} such {noun}{'s' if count > 1 else ''} in the batch)"
