"""`ParallelOptions`: how one module is parallelized beyond its meshes (typed, validated)."""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from dtensor_mimo.parallelize.fp8 import FP8_RECIPES, FP8Recipe

# The spellings a config file may use for a dtype (`ParallelOptions(param_dtype="bf16")`).
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""torch.compile's documented modes (`ParallelOptions.compile_mode`)."""
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""The modes that replay compiled code as CUDA graphs (torch's cudagraph trees)."""
GRAPHS_OPTIONS = "triton.cudagraph"
"""The prefix of inductor's CUDA-graph options: graphs are asked for through `ParallelOptions.compile_mode`
only (the layout checks and the graphs' memory rules assume its cudagraph trees)."""
PLAIN = (bool, int, float, str)
"""What a `ParallelOptions.compile_options` value may be (or a list of them): every rank can check that
its peers were given the same (`dtensor_mimo.layout.fingerprint`), and a config file can spell it."""
COMPILE_SCOPES = ("block", "module")
"""What `ParallelOptions.compile` compiles: each transformer block, or each stack whole."""

FLEX_MIN_CAPABILITY = (9, 0)
"""CUDA compute capability from which `ParallelOptions.flex_attention`'s default turns FlexAttention on."""


@dataclass(frozen=True)
class ParallelOptions:
    """Per-module switches for `dtensor_mimo.parallelize.parallelize` (every part of the module).

    Attributes:
        sp: sequence parallel on top of tensor parallel: norms and residual adds run on a
            sequence shard (dim 1) of the activations. Ignored without a tp mesh of size > 1.
        fsdp: shard parameters over the dp mesh with FSDP2 (`fully_shard`), gradients *summed*
            over dp. False, no dp mesh, or a dp mesh of size 1: parameters stay replicated over
            dp (plain tensors, or tp DTensors) and their gradients are summed over dp by a
            `GradientReducer` (during backward with `overlap_grad_reduce`; a loop of one's own
            can call `allreduce_gradients(module, dp_mesh)` after it; nothing for size 1).
        compile: `torch.compile` the module's pieces (`compile_scope`; a projection whole).
        compile_options: inductor's options for the module's compiled pieces, the chunked loss's
            arithmetic included (torch.compile's ``options``; e.g. ``{"cpp_wrapper": True}``,
            compiled code that calls its kernels from C++ instead of Python, or
            ``{"coordinate_descent_tuning": True}``; in a config file a table, ``cpp_wrapper =
            true``), laid over `compile_mode`'s own
            (``torch._inductor.list_mode_options``). Names, and value types where torch's check
            can, are checked against inductor's config when the options are made; values are
            plain (bool, int, float, str, or lists of them). Inductor only; CUDA graphs are asked
            for through `compile_mode`, not ``triton.cudagraph*`` options, and not with
            ``cpp_wrapper``, whose code inductor runs without graphs. None: inductor's defaults.
            (On one CPU thread the C++ wrapper left the tiny models' compiled steps as fast as
            before, `benchmarks/host_step.py`; `benchmarks/gpu.py` measures it on CUDA.)
        compile_scope: what `compile` compiles: "block" (default: each transformer block, the
            form torchtitan uses, which composes with FSDP2's per-block units and activation
            checkpointing) or "module" (each stack whole: a ViT's patch embedding, blocks and
            final norm, a decoder's rotary tables, blocks and final norm, in one graph; an
            encoder's tower and projection in one graph; the library's decoder with its head and
            loss where its logits fit in one loss chunk; one compiled call per forward and per
            backward instead of one per block, for modules
            whose per-call host work outweighs their kernels; refused where FSDP2 shards the
            module, with activation checkpointing, for an encoder with pp > 1, whose stages run
            their blocks themselves, for an encoder with items of their own sizes (a list per
            call: a variant per count), and for a decoder cut into pipeline stages, whose pieces
            would each compile variants of one forward).
        compile_backend: backend for `compile`; "inductor" (default) or e.g. "aot_eager".
        compile_mode: torch.compile's ``mode`` for the module's compiled pieces (inductor only;
            not the chunked loss's arithmetic): None (torch's default), "reduce-overhead" (CUDA
            graphs through torch's cudagraph trees: each piece's forward and backward replay as
            one graph each, for modules whose launches outrun their kernels, e.g. small
            encoders; `cuda_graphs`), "max-autotune" (autotuned kernels and CUDA graphs) or
            "max-autotune-no-cudagraphs". With CUDA graphs every run of the model (a step,
            ``model(batch)``, ``predict``) is one tree generation, whose graphs' memory the next
            run reuses: a ``model(batch)`` loss must be backpropagated before the next run, and
            gradients live from one run to the optimizer step (`MimoOptimizer` releases them
            after it; accumulate over microbatches, not over runs); both are refused otherwise.
            Refused where FSDP2 shards the module (its unsharded parameters are allocated anew
            every step), with tp or cp > 1 (collectives inside graphs: not measured), with
            activation checkpointing (a recomputation replays a block's forward graph inside
            backward) and, until measured, with `recompute_colocated`. Each distinct shape of a
            piece's input records its own graphs (and each distinct sequence of shapes in a
            step a path of its own), so the library's encoders at pp = 1 (not in float8) run
            each call of a step (every microbatch, or in the colocated three phases all of them
            at once) on one of at most four item counts per power of two
            (zero items after the real ones, their rows dropped:
            `dtensor_mimo.schedule.encoders.LocalEncoders`); items of their own sizes still
            record several; dynamo compiles at most 8 variants of a piece before it falls back
            to eager. On CPU inductor takes the mode and skips the CUDA graphs; the refusals
            hold there too.
        reshard_after_forward: FSDP2 frees the gathered parameters after forward (ZeRO-3) when
            True, keeps them until backward (ZeRO-2-like, more memory, one all-gather less);
            with False an encoder on ranks of its own keeps them gathered across the step's
            microbatches (one all-gather per step).
            The root module is never resharded after forward (FSDP2's own default).
        activation_checkpointing: recompute block activations in backward instead of keeping
            them: 0 off, 1 every transformer block, n every n-th block (the first, then every
            n-th). The blocks are counted over the whole module, wherever pipeline stages cut
            it. Composes with tp/sp, compile (a checkpointed block is compiled inside its
            checkpoint) and FSDP2; numerics unchanged. Under the zero-bubble schedules (a backward
            split in two: torch's ``stage_backward_input`` and ``stage_backward_weight``) a
            checkpointed block is recomputed in each half, two recomputations per microbatch.
        param_dtype: mixed precision (FSDP2's `MixedPrecisionPolicy` words): compute in this
            dtype (e.g. ``torch.bfloat16`` or "bf16") while the parameters, their gradients and
            the optimizer state stay in the parameters' own dtype (fp32 master weights). With
            FSDP2 the parameters are all-gathered in it; without FSDP the module's forward runs
            under `torch.autocast`. None: compute in the parameters' dtype. float16 only for a
            frozen module: training in it needs loss scaling, which the library does not do
            (its gradients would underflow); `MimoModel` refuses it for a module that trains,
            and for a frozen language model beside encoders that train (their gradients run
            through its backward). Not a float8 dtype (`fp8` trains Linear layers in float8).
        reduce_dtype: dtype of the data-parallel gradient reduction (FSDP2's reduce-scatter or
            the all-reduce without FSDP). None: float32 when `param_dtype` is set (fp32 gradient
            sums), else the gradients' dtype.
        chunked_loss: the library's `Llama` with tp = 1 (with tp > 1 see loss_parallel): the
            output head and the cross entropy run together over chunks of rows
            (`dtensor_mimo.sequence.linear_token_loss_sum`), each chunk's gradients computed at
            once, so no ``[tokens, vocab]`` logits (nor their fp32 copy or gradient) ever exist:
            about 10 bytes per logit less at the loss's peak, the same matmuls; an fp32
            ``[vocab, dim]`` weight gradient is held per microbatch in flight instead (more than
            the logits only for microbatches of fewer tokens than ``dim``). Used by training and
            `model(batch)`; `predict` takes the logits' argmax and keeps the plain head, and so
            do a user's decoder (which may change its logits; a `Llama` subclass with a forward
            of its own too) and a head that is not a bias-free ``nn.Linear``. Numerics unchanged
            up to the order of sums. Chunked or not, and at any tp, the library's decoder runs its
            head on the positions with a loss weight only where the logits would take more than
            one chunk, counted on the batch while it is in host memory (as a loader gives it,
            pinned or not; no device sync): the image
            rows and masked prompts of fine-tuning data cost it nothing. A batch already on the
            accelerator runs the head on every row.
        flex_attention: language model: rows with documents (packed samples, e.g. the trainer's
            ``data.pack``) and, under cp, every rank's queries against the gathered keys attend
            through torch's FlexAttention over a block mask of the rule (causal by global index,
            same document; `dtensor_mimo.models.FlexAttentionCore`: blocks outside it skipped, one
            compiled kernel) instead of chunked masked SDPA; plain rows at cp = 1 keep SDPA's
            causal kernel. An encoder (the library's ViT / AudioEncoder, pp = 1: stages carry one
            item shape): items of their own size packed into one sequence attend through one
            FlexAttention kernel over the block-diagonal mask of the items
            (`FlexAttentionCore.packed`) instead of one SDPA call per span of items. Needs CUDA to
            train (torch's FlexAttention has no CPU backward: `MimoModel` refuses a training run
            through it there on every rank; predict runs). Numerics unchanged. None (default): on for
            the library's decoder at cp = 1 on CUDA devices of compute capability 9.0+ (on an
            H200 the packed 1B LM step took 234 ms against 360 ms through the masked chunks,
            `benchmarks/RESULTS.md`; torch's compiled FlexAttention backward runs out of shared
            memory on some smaller cards), off elsewhere: on the CPU, under cp (not yet
            measured on GPUs), for encoders, and for a user's decoder (whose own attention
            may follow another rule).
        recompute_colocated: an encoder sharing ranks with the language model (the colocated
            three phases): keep no graph while the language model runs its microbatches; each
            microbatch is encoded again right before its backward (one more encoder forward per
            step, RNG replayed; numerics unchanged). False: every microbatch's graph is kept.
        loss_parallel: language model with tp > 1: the head's logits stay sharded over the
            vocabulary (a ``Shard(-1)`` DTensor) and the cross entropy combines the shards with
            two small tp all-reduces per microbatch instead of all-gathering ``[tokens, vocab]``
            logits. False: logits all-gathered (replicated over tp). Either way, for the library's
            decoder, the head runs on the positions with a loss weight only where its logits
            would be large (as with `chunked_loss`). Numerics unchanged.
        balance: an encoder with dp > 1 (and pp = 1): its items are split over its dp ranks in
            the contiguous runs whose costliest is least (`dtensor_mimo.data.balance`) instead of
            by sample; the bridge plan takes the new owners directly (no extra hop). None
            (default): on for a (micro)batch whose items differ in size, off otherwise. Numerics
            unchanged. Every path balances: training steps, `model(batch)` and `predict`.
        fp8: float8 training of the module's Linear layers through torchao (`dtensor_mimo.parallelize.fp8`):
            "tensorwise" (one scale per tensor; FSDP2 all-gathers the weights in float8) or
            "rowwise" (one scale per row, more accurate); None: off. Layers whose dims are not
            multiples of 16 and the output head stay in the compute dtype (`param_dtype`, e.g.
            bf16). Composes with tp/sp, compile and FSDP2; needs ``pip install 'dtensor_mimo[fp8]'``
            and, on CUDA, compute capability 8.9+ (emulated on the CPU). On CUDA also layers
            whose float8 matmuls torchao measured slower than bf16 stay in the compute dtype
            (`dtensor_mimo.parallelize.fp8.fp8_pays`), both rules read on each rank's tp shard.
        overlap_grad_reduce: without FSDP2 at dp·cp > 1: the gradients are summed over dp·cp in
            buckets launched while backward still runs, each as soon as the module's last
            backward of the step has produced all of its gradients (DDP-style;
            `dtensor_mimo.parallelize.reducer`), on a process group of the module's own. Costs
            up to one copy of the module's gradients in the reduce dtype while the sums are in
            flight, and gradients do not accumulate over training runs (a second
            ``forward_backward`` before ``reduce_gradients`` is refused; accumulate over
            microbatches). False: every bucket after backward, two in flight
            (`allreduce_gradients`). Numerics unchanged.
        grad_bucket_mb: about how many MiB one gradient all-reduce carries without FSDP2 (the
            buckets of `overlap_grad_reduce`, and of the sums after backward).
    """

    sp: bool = False
    fsdp: bool = True
    compile: bool = False
    compile_backend: str = "inductor"
    compile_mode: str | None = None
    compile_scope: str = "block"
    reshard_after_forward: bool = True
    activation_checkpointing: int = 0
    param_dtype: torch.dtype | str | None = None
    reduce_dtype: torch.dtype | str | None = None
    loss_parallel: bool = True
    chunked_loss: bool = True
    flex_attention: bool | None = None
    recompute_colocated: bool = False
    balance: bool | None = None
    fp8: FP8Recipe | None = None
    compile_options: dict[str, Any] | None = field(default=None, hash=False)  # it and those after: positions kept
    overlap_grad_reduce: bool = True
    grad_bucket_mb: float = 32.0

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if isinstance(value, str) and value.removeprefix("torch.") in DTYPES:  # "torch.bfloat16" as written in code
                object.__setattr__(self, name, DTYPES[value.removeprefix("torch.")])
            elif value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(f"ParallelOptions: {name}={value!r} must be a floating dtype such as "
                                f"torch.bfloat16, one of {sorted(DTYPES)}, or None")
            elif value is not None and value.itemsize == 1:
                # torch counts float8 as floating, but FSDP2 cannot gather or sum in it ("Invalid
                # scalar type") and CPU autocast turns itself off for it (fp32 compute, silently)
                raise TypeError(f"ParallelOptions: {name}={value!r}: a float8 dtype is neither a compute nor a "
                                f"reduce dtype; use one of {sorted(DTYPES)}, and for float8 matmuls "
                                "fp8='tensorwise' or fp8='rowwise' (torchao's float8 training)")
        flags = {n: getattr(self, n) for n in ("sp", "fsdp", "compile", "reshard_after_forward",
                                               "loss_parallel", "chunked_loss", "recompute_colocated",
                                               "overlap_grad_reduce")}
        wrong = {n: v for n, v in flags.items() if not isinstance(v, bool)}
        if wrong:
            raise TypeError(f"ParallelOptions: {wrong} must be True or False")
        mb = self.grad_bucket_mb
        if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not 0 < mb < math.inf:
            raise TypeError(f"ParallelOptions: grad_bucket_mb={mb!r} must be a finite number of MiB > 0 (e.g. 32)")
        if self.flex_attention not in (None, True, False):
            raise TypeError(f"ParallelOptions: flex_attention={self.flex_attention!r} must be True, False or None "
                            "(None: on for the library's decoder at cp = 1 on CUDA of compute capability 9.0+)")
        if self.balance not in (None, True, False):
            raise TypeError(f"ParallelOptions: balance={self.balance!r} must be True, False or None (on when "
                            "a batch's items differ in size)")
        ac = self.activation_checkpointing
        if isinstance(ac, bool) or not isinstance(ac, int) or ac < 0:
            raise TypeError(f"ParallelOptions: activation_checkpointing={ac!r} must be an integer >= 0 "
                            "(0 off, 1 every block, n every n-th block)")
        if self.fp8 is not None and self.fp8 not in FP8_RECIPES:
            raise ValueError(f"ParallelOptions: fp8={self.fp8!r} must be one of {', '.join(map(repr, FP8_RECIPES))} "
                             "(torchao's float8 recipes) or None (off)")
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise TypeError(f"ParallelOptions: compile_backend={self.compile_backend!r} must be a "
                            "backend name such as 'inductor' or 'aot_eager'")
        if self.compile_backend != "inductor":
            # torch.compile looks the name up only when it compiles, on the module's ranks alone:
            # an unknown one would raise there while the other ranks wait for them in a collective.
            from torch._dynamo.backends.registry import list_backends, lookup_backend

            try:
                lookup_backend(self.compile_backend)
            except RuntimeError:
                known = list_backends(exclude_tags=())
                near = difflib.get_close_matches(self.compile_backend, known, n=3)
                raise ValueError(f"ParallelOptions: compile_backend={self.compile_backend!r} is not a torch.compile "
                                 "backend" + (f" (did you mean {' or '.join(map(repr, near))}?)" if near else "")
                                 + f"; the backends are {', '.join(known)} (torch._dynamo.list_backends) and any "
                                 "registered with torch._dynamo.register_backend before the options are made") from None
        if self.compile_mode is not None and self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"ParallelOptions: compile_mode={self.compile_mode!r} must be one of "
                             f"{', '.join(map(repr, COMPILE_MODES))} (torch.compile's modes) or None")
        if self.compile_mode is not None and self.compile_backend != "inductor":
            # torch.compile would drop the mode without a word for any other backend
            raise ValueError(f"ParallelOptions: compile_mode={self.compile_mode!r} is an inductor mode but "
                             f"compile_backend={self.compile_backend!r}; use compile_backend='inductor' or "
                             "compile_mode=None")
        if self.compile_options is not None:
            object.__setattr__(self, "compile_options", self._checked_compile_options())
        if self.compile_scope not in COMPILE_SCOPES:
            raise ValueError(f"ParallelOptions: compile_scope={self.compile_scope!r} must be one of "
                             f"{', '.join(map(repr, COMPILE_SCOPES))}")
        if self.compile and self.compile_scope == "module" and ac:
            raise ValueError(f"ParallelOptions: compile_scope='module' with activation_checkpointing={ac}: a "
                             "checkpoint wraps each block, which a whole-module graph would trace through; use "
                             "compile_scope='block' (each block compiled inside its checkpoint)")
        if self.cuda_graphs and ac:
            raise ValueError(f"ParallelOptions: compile_mode={self.compile_mode!r} (CUDA graphs) with "
                             f"activation_checkpointing={ac}: a recomputation would replay a block's forward graph "
                             "inside backward; use one of the two")
        if self.cuda_graphs and self.compile_options and self.compile_options.get("cpp_wrapper"):
            raise ValueError(f"ParallelOptions: compile_mode={self.compile_mode!r} (CUDA graphs) with compile_options="
                             f"{self.compile_options!r}: inductor runs C++-wrapped code without CUDA graphs (torch "
                             "2.11: 'cpp wrapper enabled'; 2.13: 'cpp-wrapper does not support graph partition yet'); "
                             "use compile_mode=None with the C++ wrapper, or drop cpp_wrapper for the graphs")
        if self.cuda_graphs and self.recompute_colocated:
            raise ValueError(f"ParallelOptions: compile_mode={self.compile_mode!r} (CUDA graphs) with "
                             "recompute_colocated=True: each microbatch would be encoded in no-grad graphs and again "
                             "in training ones, which no GPU run has checked yet; use one of the two")

    def _checked_compile_options(self) -> dict[str, Any] | None:
        """`compile_options` as torch.compile would take them (its own check, run now: before any
        process group or model exists), in one spelling: names with ``_`` for ``-`` (as torch
        reads them), nested tables flattened to dotted names (``{"triton": {"max_tiles": 2}}``, as
        a config file's ``[options.<module>.compile_options.triton]`` gives them), sorted; empty
        as None. Else a TypeError / ValueError naming what to change."""
        given = self.compile_options
        if not isinstance(given, dict) or not all(isinstance(k, str) for k in given):
            raise TypeError(f"ParallelOptions: compile_options={given!r} must be a dict of inductor option names "
                            "to values, e.g. {'cpp_wrapper': True} (a config file: cpp_wrapper = true), or None")
        flat: dict[str, Any] = {}

        def walk(table: dict, prefix: str) -> None:
            for key, value in table.items():
                if isinstance(value, dict):
                    walk(value, f"{prefix}{key}.")
                else:
                    flat[f"{prefix}{key}".replace("-", "_")] = value

        walk(given, "")
        if not flat:
            return None
        if self.compile_backend != "inductor":
            raise ValueError(f"ParallelOptions: compile_options={given!r} are inductor's options but "
                             f"compile_backend={self.compile_backend!r}; use compile_backend='inductor' or "
                             "compile_options=None")
        graphs = [name for name in flat if name.startswith(GRAPHS_OPTIONS)]
        if graphs:
            raise ValueError(f"ParallelOptions: compile_options sets {', '.join(map(repr, graphs))}; ask for CUDA "
                             "graphs with compile_mode='reduce-overhead' (or 'max-autotune'), whose cudagraph trees "
                             "the layout checks and the graphs' memory rules know, and leave those options out")
        odd = {name: value for name, value in flat.items()
               if not (isinstance(value, PLAIN) or (isinstance(value, (list, tuple))
                                                   and all(isinstance(v, PLAIN) for v in value)))}
        if odd:
            raise TypeError(f"ParallelOptions: compile_options {odd!r}: each value must be a bool, int, float, str or "
                            "a list of them, so that every rank can check its peers were given the same; set "
                            "others (e.g. custom passes) on torch._inductor.config in the training script")
        from torch._inductor import config

        known = config.get_config_copy()
        for name in flat:
            if name not in known:
                near = difflib.get_close_matches(name, known, n=3)
                raise ValueError(f"ParallelOptions: compile_options names {name!r}, which is not an inductor option"
                                 + (f" (did you mean {' or '.join(map(repr, near))}?)" if near else "")
                                 + "; the names are torch._inductor.config's (in a config file, a dotted name "
                                 "such as triton.max_tiles is a table: [options.<module>.compile_options.triton])")
        try:  # the class torch.compile builds from `options`: its check of the values' types (where it can)
            torch._TorchCompileInductorWrapper(None, flat, None)
        except RuntimeError as e:
            raise ValueError(f"ParallelOptions: compile_options={given!r}: {e}") from None
        return dict(sorted(flat.items()))

    @property
    def cuda_graphs(self) -> bool:
        """Whether the module's compiled pieces replay as CUDA graphs on CUDA (`compile_mode`)."""
        return self.compile and self.compile_mode in CUDA_GRAPH_MODES

    @property
    def compile_kwargs(self) -> dict[str, Any]:
        """``torch.compile``'s keyword arguments for this module's compiled pieces (it takes a
        ``mode`` or ``options``, not both: with `compile_options` the mode's options lie under them)."""
        if self.compile_options is None:
            return {"backend": self.compile_backend, "mode": self.compile_mode, "options": None}
        from torch._inductor import list_mode_options

        return {"backend": self.compile_backend, "mode": None,
                "options": {**list_mode_options(self.compile_mode or "default"), **self.compile_options}}

    def language_flex(self, device: torch.device, cp: int, library_decoder: bool = True) -> bool:
        """Whether the language model's attention runs through FlexAttention on `device` at `cp`
        (`flex_attention`, its None resolved: the library's decoder on a CUDA device of compute
        capability 9.0+, as measured, at cp = 1)."""
        if self.flex_attention is not None:
            return self.flex_attention
        return (library_decoder and device.type == "cuda" and cp == 1
                and torch.cuda.get_device_capability(device) >= FLEX_MIN_CAPABILITY)

    @property
    def grad_bucket_bytes(self) -> int:
        """`grad_bucket_mb` in bytes."""
        return max(1, int(self.grad_bucket_mb * 2**20))

    @property
    def gradient_reduce_dtype(self) -> torch.dtype | None:
        """The dtype gradients are summed over dp in (None: their own)."""
        if self.reduce_dtype is not None:
            return self.reduce_dtype
        return torch.float32 if self.param_dtype is not None else None

