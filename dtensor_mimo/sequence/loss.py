"""The token loss: per-token cross entropy, normalised by the loss tokens of the WHOLE global batch.

Every rank that holds a piece of the language model computes the summed loss of its tokens (its
dp shard, its cp chunk, its vocabulary shard under loss_parallel) divided by one number that every
rank derives from the global batch's metadata, with no communication: the total loss weight of the
global batch. The shares then add up to the single-process loss, and so do their gradients —
whatever the dp sizes of the encoders and of the language model, which is why the data-parallel
gradient reduction must be a *sum* (see `dtensor_mimo.parallelize.fsdp`). Averaging per rank
instead would weight a token by the size of the shard it landed in, and scale encoder gradients
by the encoder/LLM dp ratio.

Why here, in the sequence layer: the loss is the other half of sharding a sequence. This layer
cuts labels and loss mask into each rank's part (`shard_for_cp`); the loss sums over exactly that
part and the normaliser makes the parts add up. Its callers sit above it — the last pipeline
stage (`dtensor_mimo.schedule.language`) and `MimoModel`, which computes the normaliser once per
step — and it needs only the data layer's batch, so it lives below both. `dtensor_mimo.train`
re-exports these names.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dtensor_mimo.data import IGNORE_INDEX, MimoBatch


def loss_weights(labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Weight of each position in the loss: the mask where a label exists, else 0 (float32)."""
    return torch.where(labels == IGNORE_INDEX, 0.0, loss_mask.float())


def loss_normalizer(batch: MimoBatch) -> float:
    """Total loss weight of the global `batch`, or 1 where it has none (a batch without targets has
    loss 0): the loss is the weighted mean ``sum(w * ce) / sum(w)`` also for fractional weights
    summing to less than 1; once per batch (`MimoBatch.memo`)."""
    return batch.memo("loss normalizer", lambda: _positive_or_one(float(loss_weights(batch.labels,
                                                                                     batch.loss_mask).sum())))


def _positive_or_one(total: float) -> float:
    return total if total > 0 else 1.0


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum over positions of cross entropy (in fp32) times the loss weight; `logits` are
    ``[..., vocab]``: a plain tensor, or a DTensor sharded over the vocabulary on one mesh dim
    (loss_parallel), whose shards are combined by `vocab_parallel_cross_entropy`.

    The chunked loss's label rule (`linear_token_loss_sum`) on every path: positions without a
    loss weight are ignored whatever their id, and a weighted label outside ``0 .. vocab - 1``
    makes the sum NaN (a non-finite loss: `train_step` skips the step on every rank). Plain
    ``F.cross_entropy`` would raise on the ranks holding the head alone, leaving their peers
    waiting for gradients or ids (on CUDA a device-side assert), and the vocab-parallel one
    would sum a finite, wrong loss (no shard owns the label)."""
    labels = labels.flatten()
    weights = loss_weights(labels, loss_mask.flatten())
    counted = weights != 0
    bad = _outside(labels, counted, logits.shape[-1])  # the whole vocabulary's size, also under tp
    labels = torch.where(counted & ~bad, labels, IGNORE_INDEX)
    if isinstance(logits, DTensor):
        per_token = vocab_parallel_cross_entropy(logits, labels)
    else:
        per_token = F.cross_entropy(logits.flatten(0, -2).float(), labels, ignore_index=IGNORE_INDEX,
                                    reduction="none")
    return torch.where(bad.any(), torch.nan, (per_token * weights).sum())


# Logits of `linear_token_loss_sum` that exist at once: rows per chunk = this // vocabulary size
# (256 MB of fp32 logits; at a 32k vocabulary 2,048 rows, a matmul still large enough for a GPU).
LOSS_CHUNK_LOGITS = 1 << 26


def linear_token_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          loss_mask: torch.Tensor, *, compile_backend: str | None = None,
                          counted: int | None = None, compile_options: Mapping[str, Any] | None = None) -> torch.Tensor:
    """`token_loss_sum` of the logits ``hidden @ weight.T`` (the output head, no bias) without
    ever holding them: ``hidden`` ``[..., dim]``, ``weight`` ``[vocab, dim]`` (plain tensors).

    The rows run in chunks of ``LOSS_CHUNK_LOGITS // vocab``: each chunk's logits are computed
    (in the autocast dtype when autocast is on, as the head would), taken to fp32 for the cross
    entropy, and turned into the chunk's gradients right away (``softmax - onehot`` times the loss
    weight, then ``@ weight`` and ``.T @ hidden``), so forward keeps only the gradients of
    `hidden` and `weight` for backward, which scales them by the incoming gradient (the
    Liger-Kernel / torchtune form of a fused linear cross entropy, in plain torch). Memory: one
    chunk of fp32 logits instead of ``[tokens, vocab]`` logits, their fp32 copy and their
    gradient, plus an fp32 ``[vocab, dim]`` gradient of the weight held until backward (per
    microbatch in flight: smaller than the logits when a microbatch has more tokens than `dim`);
    the same three matmuls. Without grad (evaluation) it only sums the losses: one matmul. A
    label outside ``0 .. vocab - 1`` with a nonzero loss weight makes the sum NaN (a non-finite
    loss: `train_step` skips the step), not an error: that would need a device sync. Numerics: those of
    `token_loss_sum` up to the order of the sums (the weight's gradient is summed over chunks in
    fp32). Not twice differentiable. Logits that fit in one chunk take the plain path (the head,
    then `token_loss_sum`): nothing to save there, and fewer host operations for small models.

    `compile_backend` (the language model's `ParallelOptions.compile_backend` when it compiles):
    each chunk's arithmetic after its matmul (`_chunk_terms`: fp32 cast, log-sum-exp, target
    logit, ``softmax - onehot`` times the weight, cast back) runs through ``torch.compile``, which
    fuses it into one or two kernels over the chunk's logits instead of about seven eager passes
    over its fp32 copy (on an H200 those passes were about 7 ms of the 1B LM's 249 ms step; on
    the CPU a chunk of 2,097 x 32,000 bf16 logits takes 93 ms against 364 ms). Training only
    (evaluation's chunks stay eager). Numerics: the eager path's up to the fused kernels' order
    of operations. `compile_options`: inductor's options for that compilation (the language
    model's `ParallelOptions.compile_options`; not its `compile_mode`), None for its defaults.

    `counted`: how many positions carry a nonzero loss weight, or more, when the caller knows it
    from host metadata (the language pipeline counts them on the batch before it reaches the
    device). The head then runs on that many rows only: in supervised fine-tuning the image rows
    and the masked prompt carry no loss (54-58% of the rows of `benchmarks/gpu.py`'s VLM
    batches), and their logits, softmax and gradients are arithmetic that adds exactly 0. The rows
    are picked in order at that size without a device sync (`first_true`); rows beyond the
    weighted ones (a count too high) repeat the first row at weight 0, adding nothing. Numerics:
    those of all rows up to the order of the sums. A count below the weighted positions leaves the
    last ones out of the loss: it must come from these `labels` and `loss_mask`."""
    hidden, labels, weights = pick_loss_rows(hidden, labels, loss_mask, counted)
    if hidden.shape[0] * weight.shape[0] <= LOSS_CHUNK_LOGITS:
        return checked_token_loss_sum(F.linear(hidden, weight), labels, weights)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, labels, weights, compile_backend, compile_options)
    return _chunked_cross_entropy(hidden, weight, labels, weights, False, False, compile_backend)[0]


def checked_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """`token_loss_sum` of plain `logits` ``[..., vocab]`` (the small head's loss, also traced
    with a decoder compiled whole: `schedule.language`), under the same label rule."""
    return token_loss_sum(logits, labels, loss_mask)


def pick_loss_rows(hidden: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                   counted: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden [N, dim], labels [N], weights [N])`` of the positions with a loss weight: the
    first `counted` of them in order (`linear_token_loss_sum`'s rule), or every position when
    `counted` is None; `hidden` ``[..., dim]``, `labels` and `loss_mask` ``[...]``."""
    hidden, labels = hidden.flatten(0, -2), labels.flatten()
    weights = loss_weights(labels, loss_mask.flatten())
    if counted is None or counted >= hidden.shape[0]:
        return hidden, labels, weights
    keep = first_true(weights != 0, counted)
    weighted = (weights != 0).sum()  # on the device: no sync
    hidden, labels, weights = (t.index_select(0, keep) for t in (hidden, labels, weights))
    return hidden, labels, torch.where(torch.arange(counted, device=weights.device) < weighted, weights, 0.0)


def first_true(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The indices of the first `count` True entries of the 1-D `mask`, in order, then 0s
    (``torch.nonzero_static(mask, size=count, fill_value=0)``) without a device sync: the k-th
    True is where the running count first reaches k. (With ``nonzero_static`` the H200 profile
    of the tiny task, torch 2.11, showed an ``aten::nonzero``, a sync, per microbatch: the
    training step's only one.)"""
    running = torch.cumsum(mask, 0)
    at = torch.searchsorted(running, torch.arange(1, count + 1, device=mask.device))
    return torch.where(at < mask.numel(), at, 0)


def _outside(labels: torch.Tensor, counted: torch.Tensor, vocab: int) -> torch.Tensor:
    """The counted positions whose label is no id of the vocabulary (their loss is NaN)."""
    return counted & ((labels < 0) | (labels >= vocab))


def _chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                           want_h: bool, want_w: bool, compile_backend: str | None = None,
                           compile_options: Mapping[str, Any] | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The summed weighted loss and, where wanted, the gradients of `hidden` (in the compute dtype) and
    `weight` (fp32, float64 for a float64 head)."""
    device = hidden.device.type
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    if torch.is_autocast_enabled(device) and dtype != torch.float64:  # autocast leaves float64 alone
        dtype = torch.get_autocast_dtype(device)
    h, w = hidden.to(dtype), weight.to(dtype)
    vocab = w.shape[0]
    grad_h = torch.empty_like(h) if want_h else None
    # fp32 sums (float64 ones for a float64 head)
    grad_w = torch.zeros(w.shape, dtype=torch.promote_types(dtype, torch.float32), device=w.device) if want_w else None
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    rows = max(1, LOSS_CHUNK_LOGITS // max(vocab, 1))
    # Compiled for training only: evaluation's loss-only chunks would add graphs to the same cache.
    compiled = compile_backend is not None and (want_h or want_w)
    terms = _compiled_chunk_terms(compile_backend, compile_options) if compiled else _chunk_terms
    with torch.autocast(device, enabled=False):
        for start in range(0, h.shape[0], rows):
            hc = h[start:start + rows]
            loss, grad = terms(hc @ w.t(), labels[start:start + rows], weights[start:start + rows], want_h or want_w)
            total += loss
            if grad_h is not None:
                torch.mm(grad, w, out=grad_h[start:start + rows])
            if grad_w is not None:
                _add_product(grad_w, grad.t(), hc)
    return total, grad_h, grad_w


# Per device type: whether `_add_product` may add the product inside the matmul (probed once).
_SUMS_IN_MATMUL: dict[str, bool] = {}


def _add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` for an fp32 `out` and `a`, `b` in fp16 or bf16: where the device has a
    matmul that reads and writes an fp32 result from half-precision inputs (CUDA's
    ``baddbmm(..., out_dtype=torch.float32, out=...)``, ``beta = 1``), the sum happens in the
    matmul's epilogue, in fp32: no bf16 product written and read back by a separate add (on an
    H200 that pass took 2 ms of the 1B LM's 237 ms step, eight chunks over a 32,000 x 2,048
    weight), and the product is not rounded to bf16 before it is summed. Elsewhere (CPU: no such
    kernel; other dtypes, which that matmul refuses; under ``torch.compile``, which has no fake
    kernel for it) the product in `a`'s dtype is added to `out`. Which one is probed once per
    device type (`_sums_in_matmul`)."""
    if (out.dtype == torch.float32 and a.dtype in (torch.float16, torch.bfloat16)
            and not torch.compiler.is_compiling() and _sums_in_matmul(out.device)):
        torch.baddbmm(out.unsqueeze(0), a.unsqueeze(0), b.unsqueeze(0), out_dtype=out.dtype, out=out.unsqueeze(0))
    else:  # the product read into the fp32 sum: one pass, no fp32 copy of it
        out.add_(a @ b)


def _sums_in_matmul(device: torch.device) -> bool:
    """Whether ``baddbmm`` with ``out_dtype`` adds a bf16 product into an fp32 `out` on `device`
    (CUDA since torch 2.8), checked on a small product against the plain sum: a device or release
    that lacks the kernel (CPU, meta) or computes it otherwise keeps the separate add, and so does
    one where the check fails (e.g. under ``torch.cuda.set_sync_debug_mode("error")``). One device
    sync, the first time a device type asks; asked during a CUDA graph's capture (no sync
    allowed), the answer is the separate add, not kept."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _SUMS_IN_MATMUL.get(device.type, False)
    if device.type not in _SUMS_IN_MATMUL:
        try:
            g = torch.Generator(device=device).manual_seed(0)
            out = torch.randn(1, 16, 24, generator=g, device=device)
            a, b = (torch.randn(shape, generator=g, device=device).to(torch.bfloat16)
                    for shape in ((1, 16, 32), (1, 32, 24)))
            want = out + a.float() @ b.float()
            torch.baddbmm(out, a, b, out_dtype=torch.float32, out=out)
            _SUMS_IN_MATMUL[device.type] = bool(torch.allclose(out, want, rtol=1e-4, atol=1e-4))
        except (RuntimeError, NotImplementedError, TypeError):  # no kernel, no out_dtype, no sync allowed
            _SUMS_IN_MATMUL[device.type] = False
    return _SUMS_IN_MATMUL[device.type]


def _chunk_terms(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                 want_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's summed weighted cross entropy (fp32) and, if `want_grad`, its gradient by the
    chunk's logits (``softmax - onehot`` times each row's weight, in the logits' dtype). Eager, in
    place on the fp32 copy of the logits, so that it holds one of them; traced
    (`_compiled_chunk_terms`), out of place, which inductor fuses into one or two kernels."""
    vocab = logits.shape[-1]
    x = logits.float()
    lse = x.logsumexp(-1, keepdim=True)
    target = labels.clamp(0, vocab - 1).unsqueeze(-1)
    counted = weights != 0  # ignored rows (weight 0) add exactly 0, whatever their logits
    per_row = (lse.squeeze(-1) - x.gather(-1, target).squeeze(-1)) * weights
    loss = torch.where(_outside(labels, counted, vocab), torch.nan, torch.where(counted, per_row, 0.0)).sum()
    if not want_grad:
        return loss, None
    scale = torch.where(counted, weights, 0.0).unsqueeze(-1)
    if torch.compiler.is_compiling():
        # Out of place and the one-hot as a comparison: one fused kernel (torch 2.11's inductor
        # computes the loss of the in-place form wrong when `x` is the fp32 logits themselves).
        onehot = torch.arange(vocab, device=x.device) == target
        grad = ((x - lse).exp() - onehot.to(x.dtype)) * scale
    else:  # in place: one fp32 chunk, and the one-hot as a scatter of one value a row
        grad = x.sub_(lse).exp_()
        grad.scatter_add_(-1, target, torch.full_like(target, -1, dtype=grad.dtype)).mul_(scale)
    return loss, grad.to(logits.dtype)


_COMPILED_TERMS: dict[tuple[str, str], Callable] = {}


def _compiled_chunk_terms(backend: str, options: Mapping[str, Any] | None = None) -> Callable:
    """`_chunk_terms` through ``torch.compile`` with `backend` and inductor's `options` (one per
    backend and options; the row count becomes dynamic at its second value, the last chunk's, so
    batches of any size reuse it: a few graphs per logits dtype, a one-row chunk its own)."""
    key = (backend, repr(sorted(options.items())) if options else "")
    if key not in _COMPILED_TERMS:
        _COMPILED_TERMS[key] = torch.compile(_chunk_terms, backend=backend, options=dict(options) if options else None)
    return _COMPILED_TERMS[key]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                weights: torch.Tensor, compile_backend: str | None,
                compile_options: Mapping[str, Any] | None = None) -> torch.Tensor:
        total, grad_h, grad_w = _chunked_cross_entropy(hidden, weight, labels, weights, *ctx.needs_input_grad[:2],
                                                       compile_backend, compile_options)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = hidden.dtype, weight.dtype
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        return (None if grad_h is None else (grad_h * grad).to(hidden_dtype),
                None if grad_w is None else (grad_w * grad).to(weight_dtype), None, None, None, None)


def vocab_parallel_cross_entropy(logits: DTensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross entropy ``[N]`` (0 where the label is `IGNORE_INDEX`) of `logits`, a
    ``[..., vocab]`` DTensor sharded over its last dim on one mesh dim (replicated on the others),
    against plain global label ids ``[N]``; the same plain tensor on every rank of that dim.

    Each rank keeps its ``[N, vocab / tp]`` slice in fp32: one MAX all-reduce of ``[N]`` row
    maxima and one SUM all-reduce of ``[2, N]`` (sum of exponentials, target logit) over the
    sharding group, never the ``[N, vocab]`` logits. Backward is local: softmax minus one-hot on
    the own slice, times the incoming gradient (Megatron's vocab-parallel cross entropy).
    """
    local, start, group = _vocab_shards(logits)
    return _VocabParallelCrossEntropy.apply(local, labels, start, group)


def _vocab_shards(logits: DTensor) -> tuple[torch.Tensor, int, dist.ProcessGroup]:
    """This rank's ``[N, vocab / tp]`` logits, its first vocabulary id, and the sharding group."""
    dims = [i for i, p in enumerate(logits.placements) if p.is_shard(logits.ndim - 1) or p.is_shard(-1)]
    others = [p for i, p in enumerate(logits.placements) if i not in dims and not p.is_replicate()]
    if len(dims) != 1 or others:
        raise ValueError(f"vocab-parallel logits: placements {logits.placements} must shard the vocabulary "
                         "(last) dim on exactly one mesh dim and replicate the others")
    _, offset = compute_local_shape_and_global_offset(logits.shape, logits.device_mesh, logits.placements)
    return logits.to_local().flatten(0, -2), offset[-1], logits.device_mesh.get_group(dims[0])


@torch.no_grad()
def vocab_parallel_argmax(logits: DTensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of vocabulary-sharded logits (a plain tensor, the same on every
    rank of the sharding group) without gathering them: two ``[N]`` all-reduces (the maximum,
    then the smallest id holding it, which is torch's first-occurrence rule). A NaN is the
    maximum, as in torch's argmax (a reduction's MAX skips it): the row's first NaN wins."""
    local, start, group = _vocab_shards(logits)
    best, index = local.max(-1)  # a row's first NaN where it holds one
    nan = best.isnan()
    # one MAX of [2, N]: whether any shard's row holds a NaN, and the largest number elsewhere
    top = torch.stack((nan.to(best.dtype), best.masked_fill(nan, float("-inf"))))
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    wins = torch.where(top[0] > 0, nan, ~nan & (best == top[1]))
    ids = torch.where(wins, index + start, torch.iinfo(torch.int64).max)
    dist.all_reduce(ids, op=dist.ReduceOp.MIN, group=group)
    return ids.view(logits.shape[:-1])


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                group: dist.ProcessGroup) -> torch.Tensor:
        logits = local.to(torch.promote_types(local.dtype, torch.float32))
        row_max = logits.detach().amax(-1)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        exp = (logits - row_max.unsqueeze(-1)).exp()
        target = labels - vocab_start
        owned = (target >= 0) & (target < logits.shape[-1])
        target = target.clamp(0, logits.shape[-1] - 1)
        target_logit = (logits.gather(-1, target.unsqueeze(-1)).squeeze(-1) - row_max) * owned
        stats = torch.stack((exp.sum(-1), target_logit))
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        valid = labels != IGNORE_INDEX
        softmax = exp.div_(stats[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, target, owned, valid)
        ctx.dtype = local.dtype
        return torch.where(valid, stats[0].log() - stats[1], 0.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, target, owned, valid = ctx.saved_tensors
        grad_logits = softmax  # in place: the saved softmax is not needed again (one backward)
        rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)
        grad_logits[rows, target] -= owned.to(grad_logits.dtype)
        grad_logits.mul_((grad * valid).unsqueeze(-1))
        return grad_logits.to(ctx.dtype), None, None, None
