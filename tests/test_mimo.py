"""The whole MIMO training step on heterogeneous layouts against a single-process reference.

Cases marked "meta" build their modules on the meta device and initialize them after
parallelizing (`MimoModel.init_weights`): each rank only ever holds its own shards.

The reference runs in the pytest process: the same modules from the same seeds, the same three
global batches, plain autograd, `torch.nn.utils.clip_grad_norm_` over every parameter and one
AdamW per module. The distributed run uses `MimoModel` + `train_step` on every rank. Per step we
compare the loss, the global gradient norm, every parameter's (clipped) gradient and every
weight after the step (fp32). Batches: 5 samples with ragged image counts (0-2 per sample), at
least one text-only sample, random prompt masks (asymmetric loss masks); "packed" rows hold
two documents each (positions restart, attention stays inside a document).

| case          | vision (ranks)     | audio (ranks) | language (ranks)        | world | packed | notes                        |
|---------------|--------------------|---------------|-------------------------|-------|--------|------------------------------|
| fan_in        | dp2 (0-1)          | -             | dp1 (2)                 | 3     | no     | vision FSDP2                 |
| fan_out       | dp1 (0)            | -             | dp2 (1-2)               | 3     | no     | LLM without FSDP (all-reduce); head on loss rows only |
| tp_sp         | dp2 (0-1)          | -             | tp2 + sp (2-3)          | 4     | no     | meta; head on loss rows only |
| tp_sp_odd     | dp2 (0-1)          | -             | tp2 + sp (2-3)          | 4     | no     | rows of 63: tp shards the sequence unevenly (torch 2.13; 2.11 refuses it) |
| coloc_fan_in  | dp4 (0-3)          | -             | tp2·dp2 (0-3)           | 4     | no     | colocated, FSDP off (all-reduce) |
| coloc_tp      | tp2·dp2 + sp (0-3) | -             | tp4 (0-3)               | 4     | no     | colocated, tp change, meta, gathered logits; head on loss rows only |
| cp            | dp2 (0-1)          | -             | cp2 (2-3)               | 4     | yes    | meta; head on loss rows only |
| two_hop_cp    | tp2 (0-1)          | -             | cp2 (2-3)               | 4     | yes    | two hops: rows all-gathered over cp, gradient reduce-scattered over cp, all-gathered over vision tp |
| two_encoders  | dp2 (0-1)          | dp2 (0-1)     | dp2 (2-3)               | 4     | no     | shared ranks; audio all-reduce |
| coloc_cp_sp   | dp4 (0-3)          | -             | tp2·cp2 + sp (0-3)      | 4     | yes    | colocated, meta              |
| frozen_vit    | dp2 (0-1), ViT frozen | -          | dp1 (2)                 | 3     | no     | only the projection trains   |
| frozen_vision | dp4 (0-3), frozen  | -             | tp2·dp2 (0-3)           | 4     | no     | colocated; no backward bridge|
| checkpointed  | dp2 (0-1), AC all, compiled | -    | tp2 + sp (2-3), AC 1/2  | 4     | no     | activation checkpointing     |
| checkpointed_compiled_tp | tp2 (0-1), AC all, compiled | - | tp2 + sp (2-3), AC 1/2, compiled | 4 | no | checkpointed blocks compiled inside their checkpoint only, the others outside |
| eight         | dp3 (0-2)          | dp1 (3)       | tp2·dp2 + sp (4-7)      | 8     | yes    | dp3 -> dp2, compiled blocks, meta; head on loss rows only |
| custom_encoder| dp2, FSDP2 (0-1)   | -             | dp1 (2)                 | 3     | no     | a user's encoder (`PatchMLP`), meta |
| custom_enc_tp | tp2, compiled (0-1)| -             | tp2 + sp (2-3)          | 4     | no     | a user's encoder with its own tp plan |
| varied_fan_in | dp2 (0-1)          | dp2 (0-1)     | dp1 (2)                 | 3     | no     | items of own sizes, balanced over dp |
| varied_fan_out| dp1 (0)            | -             | dp2 (1-2)               | 3     | no     | items of own sizes           |
| varied_tp_sp  | tp2·dp2 + sp (0-3) | tp2·dp2 + sp  | tp2·dp2 (0-3)  | 4     | no     | empty dp shares |
| varied_coloc  | dp4 (0-3)          | -             | tp2·dp2 (0-3)           | 4     | no     | colocated, own sizes, balanced, meta |
| varied_cp     | dp2 (0-1)          | -             | cp2 (2-3)               | 4     | yes    | own sizes, by sample (balance=False) |
| balanced_uniform | dp3 (0-2), balance=True | -      | dp1 (3)                 | 4     | no     | one size, items balanced over dp |
| empty_dp_tp   | dp4 (0-3)          | -             | tp2·dp2 + sp (0-3)      | 4     | no     | colocated; one sample: language dp rank 1 holds none (tp: a stand-in row); predict |
| hsdp_cp       | dp4, HSDP 2x2 (0-3)| -             | cp2·dp2, HSDP 2x2 (0-3) | 4     | yes    | colocated; FSDP2's 2-D mesh and its sizes asserted |
| hsdp_tp       | dp8, HSDP 4x2 (0-7)| -             | tp2·dp4 + sp, HSDP 2x2 (0-7) | 8 | no     | colocated; shards, replicas and tp together |

With tp the language model's logits stay sharded over the vocabulary (loss_parallel) unless the
case says "gathered logits". "Head on loss rows only": the chunked head's chunks are made small
(`Case.loss_chunk_rows`), so it runs on the positions with a loss weight only, counted on the host.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dtensor_mimo import (
    AdamWConfig,
    MimoLayout,
    MimoModel,
    MimoOptimizer,
    ParallelOptions,
    Parallelism,
    PipelineConfig,
    train_step,
)
from dtensor_mimo.assemble import assemble, embed_text
from dtensor_mimo.bridge import hops
from dtensor_mimo.data import IGNORE_INDEX, ModalitySpec, SyntheticSpec, microbatches, synthetic_batch
from dtensor_mimo.data.balance import item_cuts, row_bounds
from dtensor_mimo.layout import torch_compat
from dtensor_mimo.models import init_weights
from dtensor_mimo.models.hf import load_hf
from dtensor_mimo.models import (
    AudioConfig,
    AudioEncoder,
    Llama,
    LlamaConfig,
    ModalityEncoder,
    Projection,
    ViT,
    ViTConfig,
)
from dtensor_mimo.sequence import loss as token_loss
from tests.harness import needs_torch, run_on_ranks

FIRST_SEED = 11  # step i's global batch comes from seed FIRST_SEED + i
# Adam's eps bounds how much last-ulp gradient differences (sums reordered by sharding) move a
# weight: update error <= lr * grad error / eps. A small max norm makes clipping engage. Every
# parameter decays (no_decay=None), as in the reference's plain AdamW (tests/test_optimizer.py
# covers the no-decay groups).
OPT = AdamWConfig(lr=1e-2, eps=1e-3, weight_decay=0.1, no_decay=None, max_grad_norm=0.5)
TOL = dict(rtol=2e-5, atol=2e-6)
LLAMA = LlamaConfig.tiny(n_heads=8, n_kv_heads=4)  # tp4 needs kv heads divisible by 4
VISION, AUDIO = ViTConfig.tiny(), AudioConfig.tiny()
MODALITIES = {
    "vision": ModalitySpec.image(VISION, special_token_id=64, max_items=2),
    "audio": ModalitySpec.audio(AUDIO, special_token_id=65, max_items=1),
}
# `Case.varied`: images at their own resolution (16, 12, 18 or 6 patches) and clips at their own
# length (16, 8 or 12 tokens), a list of inputs and a token count per item.
VARIED_VISION = dataclasses.replace(VISION, dynamic_resolution=True)
VARIED_AUDIO = dataclasses.replace(AUDIO, variable_length=True)
VARIED = {
    "vision": ModalitySpec.image(VARIED_VISION, special_token_id=64, max_items=2,
                                 sizes=[(16, 16), (8, 24), (24, 12), (12, 8)]),
    "audio": ModalitySpec.audio(VARIED_AUDIO, special_token_id=65, max_items=1, lengths=[32, 16, 24]),
}


@dataclass(frozen=True)
class Case:
    modules: dict[str, Parallelism]
    offsets: dict[str, int] | None = None
    options: dict[str, ParallelOptions] = field(default_factory=dict)
    packed: bool = False
    frozen: tuple[str, ...] = ()  # parameter-name prefixes that do not train, e.g. "vision.encoder"
    pipeline: PipelineConfig | None = None
    batch_size: int = 5
    n_layers: int = 2  # of the language model
    seq_lens: tuple[int, ...] = (64, 64, 64)  # one batch per step, of these lengths
    meta: bool = False  # modules built on the meta device, then `MimoModel.init_weights`
    distinct_batches: int | None = None  # cycle through this many batches (None: all distinct)
    language_hf: str | None = None  # a Hugging Face checkpoint the language model is loaded from
    custom_vision: bool = False  # vision is `PatchMLP` (a user's module), not the library's ViT
    custom_language: bool = False  # the language model is `UserDecoder` (a user's module), not `Llama`
    predict: bool = False  # after training, `MimoModel.predict` of the first batch == the reference argmax
    bridge_hops: int | None = None  # MimoModel's route across the bridge (None: one hop on one node)
    text_only_steps: tuple[int, ...] = ()  # steps whose batch carries no encoder item at all
    varied: bool = False  # items of different sizes (`VARIED`): dynamic-resolution ViT, variable-length audio
    # The chunked head's chunk in rows (`LOSS_CHUNK_LOGITS` / vocabulary): small enough that it
    # runs on the rows with a loss weight only, counted on the host (None: the library's, one chunk)
    loss_chunk_rows: int | None = None

    @property
    def encoders(self) -> tuple[str, ...]:
        return tuple(n for n in self.modules if n != "language")

    def layout(self) -> MimoLayout:
        return MimoLayout(self.modules, offsets=self.offsets)


P = Parallelism
SP = ParallelOptions(sp=True)
CASES = {
    "fan_in": Case({"vision": P(dp=2), "language": P()}),
    "fan_out": Case({"vision": P(), "language": P(dp=2)},
                    options={"language": ParallelOptions(fsdp=False)}, loss_chunk_rows=16),
    "tp_sp": Case({"vision": P(dp=2), "language": P(tp=2)}, options={"language": SP}, meta=True,
                  loss_chunk_rows=16),
    "tp_sp_odd": Case({"vision": P(dp=2), "language": P(tp=2)}, options={"language": SP}, seq_lens=(63, 63, 63)),
    "coloc_fan_in": Case({"vision": P(dp=4), "language": P(dp=2, tp=2)},
                         offsets={"vision": 0, "language": 0},
                         options={n: ParallelOptions(fsdp=False) for n in ("vision", "language")}),
    "coloc_tp": Case({"vision": P(dp=2, tp=2), "language": P(tp=4)},
                     offsets={"vision": 0, "language": 0}, meta=True,
                     options={"vision": SP, "language": ParallelOptions(loss_parallel=False)}, loss_chunk_rows=16),
    "cp": Case({"vision": P(dp=2), "language": P(cp=2)}, packed=True, meta=True, loss_chunk_rows=16),
    "two_hop_cp": Case({"vision": P(tp=2), "language": P(cp=2)}, packed=True, bridge_hops=2),
    "two_encoders": Case({"vision": P(dp=2), "audio": P(dp=2), "language": P(dp=2)},
                         offsets={"vision": 0, "audio": 0, "language": 2},
                         options={"audio": ParallelOptions(fsdp=False)}),
    "coloc_cp_sp": Case({"vision": P(dp=4), "language": P(cp=2, tp=2)},
                        offsets={"vision": 0, "language": 0}, options={"language": SP}, packed=True,
                        meta=True),
    "frozen_vit": Case({"vision": P(dp=2), "language": P()}, frozen=("vision.encoder",)),
    "frozen_vision": Case({"vision": P(dp=4), "language": P(dp=2, tp=2)}, offsets={"vision": 0, "language": 0},
                          frozen=("vision",)),
    "checkpointed": Case({"vision": P(dp=2), "language": P(tp=2)},
                         options={"vision": ParallelOptions(activation_checkpointing=1, compile=True,
                                                            compile_backend="aot_eager"),
                                  "language": ParallelOptions(sp=True, activation_checkpointing=2)}),
    "checkpointed_compiled_tp": Case({"vision": P(tp=2), "language": P(tp=2)},
                                     options={"vision": ParallelOptions(activation_checkpointing=1, compile=True,
                                                                        compile_backend="aot_eager"),
                                              "language": ParallelOptions(sp=True, activation_checkpointing=2,
                                                                          compile=True, compile_backend="aot_eager")}),
    "custom_encoder": Case({"vision": P(dp=2), "language": P()}, custom_vision=True, meta=True),
    "custom_enc_tp": Case({"vision": P(tp=2), "language": P(tp=2)}, custom_vision=True,
                          options={"vision": ParallelOptions(compile=True, compile_backend="aot_eager"),
                                   "language": SP}),
    # Items of different sizes (`VARIED`), balanced over encoder dp (the default when items vary).
    "varied_fan_in": Case({"vision": P(dp=2), "audio": P(dp=2), "language": P()},
                          offsets={"vision": 0, "audio": 0, "language": 2}, varied=True, batch_size=8,
                          predict=True),
    "varied_fan_out": Case({"vision": P(), "language": P(dp=2)}, varied=True),
    # Items of their own size under tp + sp and FSDP: a dp rank whose share holds no clip (or no
    # image) runs an empty packed sequence, and step 1 carries no item at all.
    "varied_tp_sp": Case({"vision": P(dp=2, tp=2), "audio": P(dp=2, tp=2), "language": P(dp=2, tp=2)},
                         offsets={"vision": 0, "audio": 0, "language": 0}, options={"vision": SP, "audio": SP},
                         varied=True, text_only_steps=(1,)),
    "varied_coloc": Case({"vision": P(dp=4), "language": P(dp=2, tp=2)}, offsets={"vision": 0, "language": 0},
                         varied=True, meta=True, predict=True),
    "varied_cp": Case({"vision": P(dp=2), "language": P(cp=2)}, packed=True, varied=True,
                      options={"vision": ParallelOptions(balance=False)}),
    "balanced_uniform": Case({"vision": P(dp=3), "language": P()}, batch_size=7,
                             options={"vision": ParallelOptions(balance=True)}),
    # A global batch of one sample: language dp rank 1's tp pair holds none (DTensor loops forever
    # viewing an empty batch: the pair runs a stand-in sample without loss weight), in training and predict.
    "empty_dp_tp": Case({"vision": P(dp=4), "language": P(dp=2, tp=2)}, offsets={"vision": 0, "language": 0},
                        options={"language": SP}, batch_size=1, predict=True),
    # HSDP (dp_replicate > 1): FSDP2 shards within replica groups (the language model's: its cp
    # pair; the encoder's: dp pairs) and all-reduces across them; with tp and sp, dp pairs of tp
    # pairs in two replica groups beside an encoder whose four groups of two shard each.
    "hsdp_cp": Case({"vision": P(dp=4, dp_replicate=2), "language": P(dp=2, cp=2, dp_replicate=2)},
                    offsets={"vision": 0, "language": 0}, packed=True),
    "hsdp_tp": Case({"vision": P(dp=8, dp_replicate=4), "language": P(dp=4, tp=2, dp_replicate=2)},
                    offsets={"vision": 0, "language": 0}, options={"language": SP}),
    "eight": Case({"vision": P(dp=3), "audio": P(), "language": P(dp=2, tp=2)},
                  options={"language": ParallelOptions(sp=True, compile=True, compile_backend="aot_eager")},
                  packed=True, meta=True, loss_chunk_rows=16),
}


# ------------------------------------------------------------------ shared by both runs


class PatchMLP(nn.Module):
    """A user's own encoder, not a library module: 4x4 patches of 16x16 images through a
    two-layer MLP straight to the language width (16 rows per image), with its own tp plan."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.out_dim = dim
        self.patch_in = nn.Linear(3 * 4 * 4, 64)
        self.patch_out = nn.Linear(64, dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        patches = images.unfold(2, 4, 4).unfold(3, 4, 4)  # [N, 3, 4, 4, 4, 4]
        x = patches.permute(0, 2, 3, 1, 4, 5).flatten(3).flatten(1, 2)  # [N, 16, 48]
        return self.patch_out(F.gelu(self.patch_in(x))).flatten(0, 1)

    def init_weights(self, seed: int) -> None:
        init_weights(self, seed)

    def parallelize(self, tp_mesh, options: ParallelOptions) -> None:
        parallelize_module(self, tp_mesh, {"patch_in": ColwiseParallel(), "patch_out": RowwiseParallel()})


@dataclass
class UserDecoderConfig:
    dim: int = 32
    n_layers: int = 2
    vocab_size: int = 64
    n_heads: int = 4
    hidden: int = 64


class UserBlock(nn.Module):
    """A user's own decoder block, unlike `Llama`'s: LayerNorm, no rotary embedding, GELU MLP,
    causal attention within documents."""

    def __init__(self, c: UserDecoderConfig) -> None:
        super().__init__()
        self.head_dim = c.dim // c.n_heads
        self.ln1, self.ln2 = nn.LayerNorm(c.dim), nn.LayerNorm(c.dim)
        self.wq, self.wk, self.wv = (nn.Linear(c.dim, c.dim) for _ in range(3))
        self.wo = nn.Linear(c.dim, c.dim, bias=False)
        self.up, self.down = nn.Linear(c.dim, c.hidden), nn.Linear(c.hidden, c.dim, bias=False)

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = self.ln1(h)
        q, k, v = (w(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        h = h + self.wo(attn.transpose(1, 2).flatten(2))
        return h + self.down(F.gelu(self.up(self.ln2(h))))


class UserDecoder(nn.Module):
    """A user's own language model (not a `Llama`): the protocol's parts around its own blocks,
    its own forward (a per-document causal mask built from its arguments), tp plan and init."""

    def __init__(self, config: UserDecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({f"block{i}": UserBlock(config) for i in range(config.n_layers)})
        self.norm = nn.LayerNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, *, h, positions=None, document_ids=None, sequence_index=None) -> torch.Tensor:
        mask = None
        if document_ids is not None:
            s = h.shape[1]
            causal = torch.ones(s, s, dtype=torch.bool, device=h.device).tril()
            mask = (causal & (document_ids[:, :, None] == document_ids[:, None, :]))[:, None]
        for block in self.layers.values():
            h = block(h, mask)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def init_weights(self, seed: int) -> None:
        init_weights(self, seed)

    def parallelize(self, tp_mesh, options: ParallelOptions) -> None:
        plan = {}
        if self.tok_embeddings is not None:  # a pipeline stage holds some parts only
            plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
        if self.output is not None:
            plan["output"] = ColwiseParallel(output_layouts=Replicate())
        parallelize_module(self, tp_mesh, plan)
        for block in self.layers.values():
            parallelize_module(block, tp_mesh, {"wq": ColwiseParallel(), "wk": ColwiseParallel(),
                                                "wv": ColwiseParallel(), "wo": RowwiseParallel(),
                                                "up": ColwiseParallel(), "down": RowwiseParallel()})


def _seeds(encoders: tuple[str, ...]) -> dict[str, int]:
    return {"language": 1, **{name: 100 * (i + 1) for i, name in enumerate(encoders)}}


def _modules(encoders: tuple[str, ...], frozen: tuple[str, ...] = (), n_layers: int = 2,
             meta: bool = False, language_hf: str | None = None,
             custom_vision: bool = False, custom_language: bool = False,
             varied: bool = False) -> tuple[nn.Module, dict[str, nn.Module]]:
    """The modules, initialized from `_seeds` and the language model loaded from `language_hf`
    if given (meta: left uninitialized on the meta device)."""
    seeds = _seeds(encoders)
    config = LlamaConfig.from_hf(language_hf) if language_hf else dataclasses.replace(LLAMA, n_layers=n_layers)
    with torch.device("meta" if meta else "cpu"):
        llama = UserDecoder(UserDecoderConfig(n_layers=n_layers)) if custom_language else Llama(config)
        built = {name: PatchMLP(LLAMA.dim) if name == "vision" and custom_vision else
                 ModalityEncoder(ViT(VARIED_VISION if varied else VISION) if name == "vision"
                                 else AudioEncoder(VARIED_AUDIO if varied else AUDIO),
                                 Projection(32, LLAMA.dim, hidden_dim=64)) for name in encoders}
    for name, module in [("language", llama), *built.items()]:
        if not meta:
            module.init_weights(seeds[name])
        for pname, p in module.named_parameters():
            if f"{name}.{pname}".startswith(frozen):
                p.requires_grad_(False)
    if language_hf and not meta:
        load_hf(llama, language_hf)
    assert not frozen or any(not p.requires_grad for m in built.values() for p in m.parameters()), \
        f"nothing matched the frozen prefixes {frozen}"
    return llama, built


def _batches(encoders: tuple[str, ...], packed: bool, batch_size: int = 5, seq_lens=(64, 64, 64),
             distinct: int | None = None, text_only: tuple[int, ...] = (), varied: bool = False):
    spec = SyntheticSpec.tiny(modalities={n: (VARIED if varied else MODALITIES)[n] for n in encoders},
                              documents_per_row=2 if packed else 1, batch_size=batch_size,
                              text_only_samples=max(1, batch_size // 4))
    return [synthetic_batch(dataclasses.replace(spec, seq_len=s, modalities={} if i in text_only else spec.modalities),
                            FIRST_SEED + i % (distinct or len(seq_lens)))
            for i, s in enumerate(seq_lens)]


# ------------------------------------------------------------------ single-process reference


@functools.lru_cache(maxsize=None)
def _reference(encoders: tuple[str, ...], packed: bool, frozen: tuple[str, ...], batch_size: int = 5,
               n_layers: int = 2, seq_lens: tuple[int, ...] = (64, 64, 64),
               autocast: torch.dtype | None = None, distinct: int | None = None,
               language_hf: str | None = None, custom_vision: bool = False,
               custom_language: bool = False, text_only: tuple[int, ...] = (), varied: bool = False,
               prepare: Callable[[str, nn.Module], object] | None = None) -> list[dict]:
    """The single-process run; `autocast`: its forward under ``torch.autocast("cpu", autocast)``
    (the mixed precision reference), the loss in fp32. Items of different sizes (`varied`) are
    encoded one call per item, not packed. `prepare(name, module)` changes each module in place
    before training (e.g. fp8's Linear layers)."""
    llama, encs = _modules(encoders, frozen, n_layers, language_hf=language_hf, custom_vision=custom_vision,
                           custom_language=custom_language, varied=varied)
    modules = {**encs, "language": llama}
    for name, module in modules.items():
        if prepare is not None:
            prepare(name, module)
    opts = {n: torch.optim.AdamW(m.parameters(), lr=OPT.lr, betas=OPT.betas, eps=OPT.eps,
                                 weight_decay=OPT.weight_decay) for n, m in modules.items()}
    records = []

    def forward(batch):
        ids = batch.special_token_ids
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            rows = {n: encs[n](m.inputs) if not isinstance(m.inputs, list) else
                    torch.cat([encs[n](x[None]) for x in m.inputs]) if m.inputs else encs[n]([])
                    for n, m in batch.modalities.items()}
            h = assemble(embed_text(llama.tok_embeddings, batch.tokens, ids), batch.tokens, rows, ids)
            return llama(h=h, positions=batch.positions, document_ids=batch.document_ids)

    batches = _batches(encoders, packed, batch_size, seq_lens, distinct, text_only, varied)
    for batch in batches:
        logits = forward(batch)
        weight = torch.where(batch.labels == IGNORE_INDEX, 0.0, batch.loss_mask).flatten()
        ce = F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten(),
                             ignore_index=IGNORE_INDEX, reduction="none")
        loss = (ce * weight).sum() / weight.sum()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_([p for m in modules.values() for p in m.parameters()],
                                              OPT.max_grad_norm)
        for opt in opts.values():
            opt.step()
        records.append(_record(loss.item(), norm.item(), {n: dict(m.named_parameters())
                                                          for n, m in modules.items()}))
        for opt in opts.values():
            opt.zero_grad()
    with torch.no_grad():
        records[-1]["logits"] = forward(batches[0]).float()  # of the trained model (`Case.predict`)
    return records


def _record(loss: float, norm: float, params: dict[str, dict[str, torch.Tensor]]) -> dict:
    def full(t):  # a copy: a Replicate DTensor's full_tensor() is a view of the live parameter
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    for m, ps in params.items():  # a rank holds only its shard of a gradient, and AdamW steps it in place
        for n, p in ps.items():
            if isinstance(p.grad, DTensor):
                assert p.grad.placements == p.placements, f"{m}.{n}: grad {p.grad.placements}, weight {p.placements}"

    return {
        "loss": loss,
        "grad_norm": norm,
        "grads": {f"{m}.{n}": None if p.grad is None else full(p.grad)
                  for m, ps in params.items() for n, p in ps.items()},
        "weights": {f"{m}.{n}": full(p) for m, ps in params.items() for n, p in ps.items()},
    }


# ------------------------------------------------------------------ distributed run


def _check_meta_built(model: MimoModel, case: Case) -> None:
    """Every parameter is materialized, and under FSDP2 as a shard smaller than the whole
    (nothing of a module off its mesh: `module_parameters` is empty there); training refuses
    the uninitialized weights on every rank, and `init_weights` fills them."""
    for name in model.module_names:
        par, fsdp = case.modules[name], case.options.get(name, ParallelOptions()).fsdp
        for pname, p in model.module_parameters(name).items():
            assert not p.is_meta, f"{name}.{pname} was left on the meta device"
            shards = par.dp * par.cp // par.dp_replicate  # HSDP: within a replica group
            if fsdp and shards > 1 and p.numel() >= shards:
                assert isinstance(p, DTensor) and p.to_local().numel() < p.numel(), \
                    f"{name}.{pname}: a full copy on an FSDP rank"
    with pytest.raises(RuntimeError, match="meta device"):
        model.forward_backward(_batches(case.encoders, case.packed, case.batch_size, case.seq_lens[:1],
                                        varied=case.varied)[0])
    model.init_weights(_seeds(case.encoders))
    if case.language_hf:
        model.load_hf({"language": case.language_hf})  # each rank reads its own blocks


def _count_calls(module, names: tuple[str, ...]) -> tuple[dict[str, int], Callable[[], None]]:
    """Count calls of `module`'s functions `names` (looked up on the module at call time);
    returns the counts and the undo."""
    counts, originals = dict.fromkeys(names, 0), {n: getattr(module, n) for n in names}

    def counted(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)
        return call

    for n in names:
        setattr(module, n, counted(n))
    return counts, lambda: [setattr(module, n, f) for n, f in originals.items()]


def _distributed(case: Case) -> list[dict] | None:
    counts, undo = _count_calls(hops, ("scatter", "gather"))  # the two-hop route's collectives
    chunk, pick = token_loss.LOSS_CHUNK_LOGITS, token_loss.pick_loss_rows
    if case.loss_chunk_rows is not None:
        token_loss.LOSS_CHUNK_LOGITS = case.loss_chunk_rows * LLAMA.vocab_size
    heads: list[tuple[int | None, int, int]] = []  # (count passed, positions with loss, rows) a call

    def picked(hidden, labels, loss_mask, counted):
        heads.append((counted, int(torch.count_nonzero(token_loss.loss_weights(labels, loss_mask))), labels.numel()))
        return pick(hidden, labels, loss_mask, counted)

    token_loss.pick_loss_rows = picked  # what the head's rows are picked by, chunked or under tp
    try:
        return _train(case, counts, heads)
    finally:
        undo()
        token_loss.LOSS_CHUNK_LOGITS, token_loss.pick_loss_rows = chunk, pick


def _train(case: Case, hop_calls: dict[str, int], heads: list | None = None) -> list[dict]:
    layout = case.layout()
    layout.init_meshes("cpu")
    llama, encs = _modules(case.encoders, case.frozen, case.n_layers, case.meta, case.language_hf,
                           case.custom_vision, case.custom_language, case.varied)
    model = MimoModel(layout, llama, encs, options=case.options, pipeline=case.pipeline,
                      bridge_hops=case.bridge_hops)
    if case.meta:
        _check_meta_built(model, case)
    optimizer = MimoOptimizer(model, OPT)
    rank = dist.get_rank()
    encoded: dict[str, list[int]] = {}  # rows out of each encoder forward on this rank, this step
    for name, encoder in encs.items():
        encoder.register_forward_hook(lambda m, args, out, name=name: encoded.setdefault(name, []).append(len(out)))
    records = []
    for batch in _batches(case.encoders, case.packed, case.batch_size, case.seq_lens, case.distinct_batches,
                          case.text_only_steps, case.varied):
        encoded.clear()
        metrics = train_step(model, optimizer, batch)
        assert not metrics.skipped
        # Every module's ranks gather its full gradients and weights; the first rank of each of
        # its pipeline stages reports them.
        params = {m: model.module_parameters(m) for m in model.module_names}
        record = _record(metrics.loss, metrics.grad_norm, params)
        keep = {m for m in model.module_names
                if (c := layout.coordinate(m, rank)) is not None and c["dp"] == c["cp"] == c["tp"] == 0}
        for kind in ("grads", "weights"):
            record[kind] = {k: v for k, v in record[kind].items() if k.split(".")[0] in keep}
        record["allocations"] = model.buffers.allocations  # receive buffers allocated so far
        record["hop_calls"] = dict(hop_calls)  # two-hop scatters and gathers so far
        record["early_buckets"] = {n: r.early for n, r in model.gradient_reducers.items()}  # dp sums during backward
        record["encoded"] = {n: (layout.coordinate(n, rank)["dp"], rows) for n, rows in encoded.items()}
        # the dims and sizes of the meshes each module's parameters are laid over, on this rank
        record["meshes"] = {m: sorted({tuple(zip(p.device_mesh.mesh_dim_names, p.device_mesh.shape))
                                       for p in ps.values() if isinstance(p, DTensor)}) for m, ps in params.items()}
        records.append(record)
    if case.loss_chunk_rows is not None and model.language_pipeline is not None and model.language_pipeline.holds_loss:
        # the last stage's head ran on its positions with a loss weight only, counted on the host
        # (none counted for a microbatch without such positions, or whose logits fit in one chunk)
        assert all(n == weighted if n is not None else weighted == 0 or rows <= case.loss_chunk_rows
                   for n, weighted, rows in heads), heads
        records[-1]["head_left_rows_out"] = any(n is not None and n < rows for n, _, rows in heads)
    if case.predict:
        encoded.clear()
        records[-1]["predicted"] = model.predict(_batches(case.encoders, case.packed, case.batch_size,
                                                          case.seq_lens[:1], varied=case.varied)[0])
        records[-1]["predict_encoded"] = {n: (layout.coordinate(n, rank)["dp"], rows) for n, rows in encoded.items()}
    return records


@pytest.mark.parametrize("name", list(CASES))
def test_training_matches_single_process(name: str) -> None:
    if name == "tp_sp_odd" and torch_compat.RELEASE < (2, 13):
        pytest.skip("torch before 2.13 refuses a sequence sp splits unevenly (test_mimo_errors)")
    per_rank = check_against_reference(CASES[name])
    check_route(CASES[name], per_rank)
    check_encoded_shares(CASES[name], per_rank)
    check_hsdp_meshes(CASES[name], per_rank)


def check_hsdp_meshes(case: Case, per_rank: list[list[dict]]) -> None:
    """A module with HSDP (``dp_replicate > 1``) has every parameter on FSDP2's 2-D mesh, replica
    groups x shards of the sizes its layout names (under tp's dim, where tp shards it), on every
    rank it runs on."""
    for module, par in case.modules.items():
        if par.hsdp:
            want = (("dp_replicate", par.dp_replicate), ("dp_shard_cp", par.dp * par.cp // par.dp_replicate))
            meshes = [m for r in per_rank for m in r[-1]["meshes"].get(module, [])]
            assert meshes and all(m[:2] == want for m in meshes), (module, meshes)


def check_encoded_shares(case: Case, per_rank: list[list[dict]], chosen: bool = True) -> None:
    """Each encoder dp rank encoded, microbatch by microbatch and in `predict`, the rows its cut
    gives it: balanced by cost where its `ParallelOptions.balance` (None: items of different
    sizes) says so, else by sample; and a balanced case does move items somewhere (its cuts
    differ from by sample). Every rank of an encoder's mesh runs exactly one forward per
    microbatch (recomputed encoders, which train: then each again, in backward), or in the
    colocated three phases one forward on every microbatch's items at once (the library's
    encoders, items of one size, not recomputed, not in float8); encoders with pp > 1 (their stages run, not
    the module) are not looked at. The plan comes from `data.balance`, checked
    against every contiguous split in tests/test_balance.py; this checks the run follows it.
    `chosen`: a case chosen by hand, whose balancing must move items somewhere (a drawn one may
    hold items that balance as they lie)."""
    widths, layout = {"vision": VISION.dim, "audio": AUDIO.dim}, case.layout()
    batches = _batches(case.encoders, case.packed, case.batch_size, case.seq_lens, case.distinct_batches,
                       case.text_only_steps, case.varied)
    runs = [(batch, microbatches(batch, case.pipeline.microbatches if case.pipeline else 1), step, "encoded")
            for step, batch in enumerate(batches)]
    if case.predict:  # one microbatch, after the last step
        first = _batches(case.encoders, case.packed, case.batch_size, case.seq_lens[:1], varied=case.varied)[0]
        runs.append((first, [first], len(batches) - 1, "predict_encoded"))
    moved = False
    language = set(layout.ranks("language"))  # three phases: an encoder frozen whole, or on language ranks
    three_phases = any(n in case.frozen or language & set(layout.ranks(n)) for n in case.encoders)
    for batch, mbs, step, key in runs:
        for name in batch.modalities:
            dp, option = case.modules[name].dp, case.options.get(name, ParallelOptions()).balance
            planned = []
            for mb in mbs:
                m = mb.modalities[name]
                balance = m.varied if option is None else option
                planned.append(row_bounds(m, item_cuts(m, dp, balance, widths[name])))
                moved |= balance and planned[-1] != row_bounds(m, item_cuts(m, dp, False))
            if case.modules[name].pp > 1:
                continue
            # recomputed before its backward: an encoder that trains (one frozen whole keeps no graph)
            again = (key == "encoded" and case.options.get(name, ParallelOptions()).recompute_colocated
                     and name not in case.frozen)
            together = (three_phases and key == "encoded" and len(mbs) > 1 and not again and not case.varied
                        and not (name == "vision" and case.custom_vision)
                        and case.options.get(name, ParallelOptions()).fp8 is None)  # float8: scales per call
            for rank, records in enumerate(per_rank):
                if layout.coordinate(name, rank) is None:
                    continue
                assert name in records[step][key], f"step {step}: rank {rank} recorded no {name} forward"
                k, rows = records[step][key][name]
                want = [b[k + 1] - b[k] for b in planned]
                want = [sum(want)] if together else want * (2 if again else 1)
                opts = case.options.get(name, ParallelOptions())
                if torch_compat.RELEASE < (2, 13) or opts.compile and opts.sp and case.modules[name].tp > 1:
                    # an empty call runs one zero item there, and under compiled sp (`LocalEncoders._rows`)
                    rows = [0 if w == 0 else r for r, w in zip(rows, want)] + rows[len(want):]
                assert rows == want, (step, name, k, rows, planned)
    balanced = [n for n in case.encoders if case.options.get(n, ParallelOptions()).balance
                or (case.varied and case.options.get(n, ParallelOptions()).balance is None)]
    assert moved or not chosen or not balanced or all(case.modules[n].dp == 1 for n in balanced), \
        "a balanced case whose cuts never differ from by sample tests nothing"


def check_route(case: Case, per_rank: list[list[dict]]) -> None:
    """The bridge took the route asked for: two hops (every layout here replicates the rows on
    the receiving side) scatter and gather; the default on one node (the harness sets
    LOCAL_WORLD_SIZE as torchrun does) never does."""
    calls = [records[-1]["hop_calls"] for records in per_rank if records]
    if case.bridge_hops == 2:
        assert sum(c["gather"] for c in calls) > 0 and sum(c["scatter"] for c in calls) > 0, calls
    else:
        assert all(c["gather"] == c["scatter"] == 0 for c in calls), calls


def check_against_reference(case: Case, run: Callable[[Case], list[dict]] = _distributed,
                            chosen: bool = True) -> list[list[dict]]:
    """Train `case` on its ranks with `run` and compare with the single-process run; returns
    every rank's records. `chosen`: a case chosen by hand, which must engage gradient clipping in
    some step (so the global norm's reduction is tested) and, with `Case.loss_chunk_rows`, run
    each last stage's head on fewer rows than it holds somewhere; False where a case is drawn."""
    expected = _reference(case.encoders, case.packed, case.frozen, case.batch_size, case.n_layers,
                          case.seq_lens, distinct=case.distinct_batches, language_hf=case.language_hf,
                          custom_vision=case.custom_vision, custom_language=case.custom_language,
                          text_only=case.text_only_steps, varied=case.varied)
    assert not chosen or any(r["grad_norm"] > OPT.max_grad_norm for r in expected), "clipping never engaged"
    per_rank = run_on_ranks(run, case.layout().world_size, case, timeout=300)
    left_out = [records[-1]["head_left_rows_out"] for records in per_rank
                if records and "head_left_rows_out" in records[-1]]
    assert not chosen or all(left_out), f"a last stage's head ran on every row it holds: {left_out}"
    for step, want in enumerate(expected):
        got = {"grads": {}, "weights": {}}
        for records in per_rank:
            r = records[step]
            assert r["loss"] == pytest.approx(want["loss"], rel=1e-5), f"step {step}: loss"
            assert r["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), f"step {step}: norm"
            for kind in got:
                got[kind].update(r[kind])
        for kind in got:
            assert got[kind].keys() == want[kind].keys(), f"step {step}: {kind} names differ"
            for param, value in want[kind].items():
                if value is None:  # a frozen parameter
                    assert got[kind][param] is None, f"step {step}: frozen {param} got a gradient"
                    continue
                torch.testing.assert_close(got[kind][param], value, **TOL,
                                           msg=lambda m: f"step {step} {kind} {param}: {m}")
    if case.predict:
        _check_predicted([records[-1]["predicted"] for records in per_rank], expected[-1]["logits"])
    return per_rank


def _check_predicted(per_rank: list[torch.Tensor], logits: torch.Tensor) -> None:
    """Every rank got the same ids, the reference's argmax wherever its top two logits are not
    within rounding of each other."""
    top2 = logits.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-4
    for predicted in per_rank:
        assert torch.equal(predicted, per_rank[0]), "ranks disagree on the predicted ids"
        assert torch.equal(predicted[clear], logits.argmax(-1)[clear]), "predict differs from the reference"


# ------------------------------------------------------------------ weights written after predict


def _full_weights(model: MimoModel) -> dict[str, torch.Tensor]:
    """Every parameter of `model` this rank holds, gathered whole (its shards, as the optimizer steps them)."""
    return {f"{m}.{n}": (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for m in model.module_names for n, p in model.module_parameters(m).items()}


def _writes_after_predict(root: str) -> dict[str, object]:
    """vision dp2 and language dp2, both FSDP2 on ranks 0-1. Each weight write follows a
    `predict`, which leaves the FSDP2 roots' parameters gathered; a model that never predicted
    is the reference."""
    from dtensor_mimo.models import save_hf
    from dtensor_mimo.train import checkpoint

    case = Case({"vision": P(dp=2), "language": P(dp=2)}, offsets={"vision": 0, "language": 0}, batch_size=4)
    batches = _batches(case.encoders, case.packed, case.batch_size, case.seq_lens)

    def build() -> tuple[MimoModel, MimoOptimizer]:
        layout = case.layout()
        layout.init_meshes("cpu")
        model = MimoModel(layout, *_modules(case.encoders))
        return model, MimoOptimizer(model, OPT)

    model, optimizer = build()
    train_step(model, optimizer, batches[0])
    shapes = {f"model.{k}": tuple(v.shape) for k, v in _full_weights(model).items()}
    path = checkpoint.save(os.path.join(root, "ckpt"), 1, model, optimizer, {"step": 1, "updates": 1}, keep=1)
    hf = Llama(LLAMA)
    hf.init_weights(7)
    if dist.get_rank() == 0:
        save_hf(hf, os.path.join(root, "hf"))
    dist.barrier()
    out: dict[str, object] = {}
    train_step(model, optimizer, batches[1])
    model.predict(batches[2])
    model.load_hf({"language": os.path.join(root, "hf")})
    out["load_hf"] = [n for n, p in hf.named_parameters()
                      if not torch.equal(_full_weights(model)[f"language.{n}"], p.detach())]
    model.predict(batches[2])
    model.init_weights(_seeds(case.encoders))
    fresh, fresh_optimizer = build()
    reference = _full_weights(fresh)
    out["init_weights"] = [k for k, v in _full_weights(model).items() if not torch.equal(v, reference[k])]
    model.predict(batches[2])
    checkpoint.load(path, model, optimizer, shapes)
    checkpoint.load(path, fresh, fresh_optimizer, shapes)
    out["checkpoint.load"] = [[train_step(m, o, b).loss for b in batches[1:]]
                              for m, o in ((model, optimizer), (fresh, fresh_optimizer))]
    return out


def test_weights_written_after_predict_reach_the_next_forward(tmp_path) -> None:
    """`load_hf`, `init_weights` and `checkpoint.load` after a `predict`: every parameter takes
    the written value (not only the blocks FSDP2 resharded after forward), and the steps after a
    checkpoint load are those of a model that never predicted."""
    for out in run_on_ranks(_writes_after_predict, 2, str(tmp_path), timeout=180):
        assert out["load_hf"] == [], f"left at their former values: {out['load_hf']}"
        assert out["init_weights"] == [], f"left at their former values: {out['init_weights']}"
        after_predict, never_predicted = out["checkpoint.load"]
        assert after_predict == never_predicted


def _gradients_after_a_dropped_forward(set_to_none: bool = True) -> dict[str, torch.Tensor]:
    """vision dp2 and language dp2, both FSDP2 on ranks 0-1: ``model(b0).backward()``, then a
    ``model(b1)`` never backpropagated (what `forward` leaves after its PlanError, dropped as the
    error says: ``model.zero_grad()``), then ``model(b2).backward()`` and `reduce_gradients`: every
    gradient, gathered whole (the dp rank 0's report)."""
    case = Case({"vision": P(dp=2), "language": P(dp=2)}, offsets={"vision": 0, "language": 0}, batch_size=4)
    layout = case.layout()
    layout.init_meshes("cpu")
    model = MimoModel(layout, *_modules(case.encoders))
    batches = _batches(case.encoders, case.packed, case.batch_size, case.seq_lens)
    model(batches[0]).backward()
    model(batches[1])  # dropped: never backpropagated (FSDP2's roots stay gathered)
    model.zero_grad(set_to_none)
    model(batches[2]).backward()
    assert model.reduce_gradients() is None
    return {f"{m}.{n}": (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for m in model.module_names for n, p in model.module_parameters(m).items()}


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_after_a_forward_never_backpropagated_drops_every_gradient(set_to_none: bool) -> None:
    """``model.zero_grad()`` is how a ``model(batch)`` loss that will not be backpropagated is
    dropped (`forward`'s PlanError, CUDA graphs' refusal). Such a forward leaves each FSDP2 root's
    parameters gathered, so torch's ``zero_grad`` walked the gathered copies and left the shards'
    gradients of the earlier backward (embeddings, norms, projection, head) in place: the next
    backward added onto them. The gradients are the single-process ones of the last batch alone,
    also where ``zero_grad(set_to_none=False)`` zeroes them in place."""
    batch = _batches(("vision",), False, 4)[2]
    llama, encoders = _modules(("vision",))
    ids = batch.special_token_ids
    rows = {n: encoders[n](m.inputs) for n, m in batch.modalities.items()}
    logits = llama(h=assemble(embed_text(llama.tok_embeddings, batch.tokens, ids), batch.tokens, rows, ids))
    weight = torch.where(batch.labels == IGNORE_INDEX, 0.0, batch.loss_mask).flatten()
    ce = F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten(), ignore_index=IGNORE_INDEX,
                         reduction="none")
    ((ce * weight).sum() / weight.sum()).backward()
    want = {f"{m}.{n}": p.grad for m, module in (("vision", encoders["vision"]), ("language", llama))
            for n, p in module.named_parameters()}
    for got in run_on_ranks(_gradients_after_a_dropped_forward, 2, set_to_none, timeout=120):
        assert got.keys() == want.keys()
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, **TOL, msg=lambda m: f"{k}: {m}")


# ------------------------------------------------------------------ predict under torch.inference_mode


def _train_after_inference_mode_predict(case: Case) -> list:
    """`predict` (an evaluation) under ``torch.inference_mode()`` before every training step."""
    layout = case.layout()
    layout.init_meshes("cpu")
    model = MimoModel(layout, *_modules(case.encoders), options=case.options)
    optimizer = MimoOptimizer(model, OPT)
    batches = _batches(case.encoders, case.packed)
    out = []
    for batch in batches:
        with torch.inference_mode():
            predicted = model.predict(batch)
        out.append((predicted, train_step(model, optimizer, batch).loss))
    return out


@pytest.mark.parametrize("name", ["fan_in", "coloc"])
def test_training_after_a_predict_under_inference_mode(name: str) -> None:
    """A `predict` under ``torch.inference_mode()`` (how evaluation loops run) made FSDP2's
    gathered parameters and the bridge's pooled receive buffers inference tensors for good: the
    next training step raised "Inference tensors cannot be saved for backward" on the encoder's
    ranks, and the language model's rank (fan_in) waited for their rows. Each prediction is the
    single-process argmax and each step's loss the single-process one."""
    case = {"fan_in": Case({"vision": P(dp=2), "language": P()}),
            "coloc": Case({"vision": P(dp=2), "language": P(dp=2)}, offsets={"vision": 0, "language": 0})}[name]
    expected = _reference(case.encoders, case.packed, case.frozen)
    llama, encoders = _modules(case.encoders)  # the reference's weights before each step: replayed here
    per_rank = run_on_ranks(_train_after_inference_mode_predict, case.layout().world_size, case, timeout=180)
    for step, batch in enumerate(_batches(case.encoders, case.packed)):
        with torch.no_grad():
            ids = batch.special_token_ids
            rows = {n: encoders[n](m.inputs) for n, m in batch.modalities.items()}
            h = assemble(embed_text(llama.tok_embeddings, batch.tokens, ids), batch.tokens, rows, ids)
            logits = llama(h=h)
        _check_predicted([records[step][0] for records in per_rank], logits)
        for records in per_rank:
            assert records[step][1] == pytest.approx(expected[step]["loss"], rel=1e-5), f"step {step}: loss"
        weights = expected[step]["weights"]  # after this step: the next step's prediction
        for module_name, module in (("language", llama), *encoders.items()):
            module.load_state_dict({n[len(module_name) + 1:]: w for n, w in weights.items()
                                    if n.startswith(module_name + ".")})


# ------------------------------------------------------------------ greedy generation


def _generation_batch(case: Case):
    """`_batches`' first batch with each row's items moved to its front (after 0-2 text tokens, in
    their order), and each row's prompt: through its last item and 2-4 text tokens more."""
    batch = _batches(case.encoders, case.packed, case.batch_size, case.seq_lens[:1], varied=case.varied)[0]
    special = torch.zeros_like(batch.tokens, dtype=torch.bool)
    for token_id in batch.special_token_ids.values():
        special |= batch.tokens == token_id
    tokens, prompts = batch.tokens.clone(), []
    for i, row in enumerate(batch.tokens):
        text, items = row[~special[i]], row[special[i]]
        lead = i % 3
        tokens[i] = torch.cat([text[:lead], items, text[lead:]])
        prompts.append(lead + len(items) + 2 + i % 3)
    if not case.packed:
        return dataclasses.replace(batch, tokens=tokens), prompts
    # packed: the prompt one document, the rest of the row another (as the padding after it)
    documents = (torch.arange(batch.seq_len)[None] >= torch.tensor(prompts)[:, None]).long()
    positions = torch.where(documents == 0, torch.arange(batch.seq_len),
                            torch.arange(batch.seq_len) - torch.tensor(prompts)[:, None])
    return dataclasses.replace(batch, tokens=tokens, document_ids=documents, positions=positions), prompts


def _generate_on_ranks(case: Case, counts: list[int], stop: int | None) -> list[list[int]]:
    layout = case.layout()
    layout.init_meshes("cpu")
    model = MimoModel(layout, *_modules(case.encoders, n_layers=case.n_layers, varied=case.varied),
                      options=case.options, pipeline=case.pipeline)
    batch, prompts = _generation_batch(case)
    return model.generate(batch, prompts, counts, stop_token=stop)


def _generate_reference(case: Case, counts: list[int], stop: int | None) -> list[list[int]]:
    """Sample by sample, no padding: the prompt alone (its items), then one token at a time,
    the argmax of the last position of the grown row (None at a near-tie, where it ends)."""
    llama, encs = _modules(case.encoders, n_layers=case.n_layers, varied=case.varied)
    batch, prompts = _generation_batch(case)
    out = []
    for i, (n, count) in enumerate(zip(prompts, counts)):
        one = batch.select_samples(range(i, i + 1))
        row, ids = one.tokens[:, :n], []
        rows = {name: torch.cat([encs[name](x[None]) for x in m.inputs]) if isinstance(m.inputs, list)
                else encs[name](m.inputs) for name, m in one.modalities.items() if m.num_items}
        for _ in range(count):
            with torch.no_grad():
                h = assemble(embed_text(llama.tok_embeddings, row, one.special_token_ids), row, rows,
                             one.special_token_ids)
                logits = llama(h=h)[0, -1]
            top = logits.topk(2).values
            ids.append(int(logits.argmax()) if top[0] - top[1] > 1e-4 else None)
            if ids[-1] is None or ids[-1] == stop:
                break
            row = torch.cat([row, torch.tensor([[ids[-1]]])], dim=1)
        out.append(ids)
    return out


# `MimoModel.generate` (one count of new tokens per sample, a stop id) on these layouts; the
# prompts of different lengths, each holding 0-2 images (and 0-1 clips). (cp 2 alone, packed:
# as coloc_cp_tp, which adds tp, and 11 s more of the suite.)
GENERATE = {
    "tp_sp": Case({"vision": P(dp=2), "language": P(tp=2)}, options={"language": SP}),
    "coloc_cp_tp": Case({"vision": P(dp=4), "language": P(cp=2, tp=2)}, offsets={"vision": 0, "language": 0},
                        options={"language": SP}, packed=True),
    "zbv": Case({"vision": P(), "language": P(pp=2)}, n_layers=4,
                pipeline=PipelineConfig(microbatches=4, schedule="ZBVZeroBubble", virtual_stages=2)),
    "varied": Case({"vision": P(dp=2), "audio": P(dp=2), "language": P(dp=2)}, varied=True, batch_size=8,
                   offsets={"vision": 0, "audio": 0, "language": 2}),
    "one_sample_dp2_cp2": Case({"vision": P(dp=4), "language": P(dp=2, cp=2)}, offsets={"vision": 0, "language": 0},
                               batch_size=1),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_torch((2, 13), "ZBVZeroBubble is refused by name"))
                                  if n == "zbv" else n for n in GENERATE])
def test_generate_matches_a_step_by_step_reference(name: str) -> None:
    """Every rank's ids are the single-process greedy loop's, sample by sample without padding:
    each up to its own count or through the stop id (sample 0's second id), up to a near-tie."""
    case = GENERATE[name]
    counts = [6 - i % 3 for i in range(case.batch_size)]
    stop = _generate_reference(case, counts, None)[0][1]
    want = _generate_reference(case, counts, stop)
    assert stop is not None and want[0][-1] == stop
    for got in run_on_ranks(_generate_on_ranks, case.layout().world_size, case, counts, stop, timeout=300):
        for g, w in zip(got, want):
            k = w.index(None) if None in w else len(w)
            assert g[:k] == w[:k] and (None in w or len(g) == len(w)), (got, want)


def _losses_after_an_update_past_a_dropped_forward() -> list[list[float]]:
    """vision dp2 and language dp2, both FSDP2 on ranks 0-1, two models alike: one runs
    ``model(b0).backward()``, a ``model(b1)`` with gradients on that it never backpropagates (an
    evaluation without ``torch.no_grad()``), the optimizer's update of b0's gradients, then the loss
    of b2; the other the same without the dropped forward."""
    case = Case({"vision": P(dp=2), "language": P(dp=2)}, offsets={"vision": 0, "language": 0}, batch_size=4)
    layout = case.layout()
    layout.init_meshes("cpu")
    batches = _batches(case.encoders, case.packed, case.batch_size, case.seq_lens)
    out = []
    for dropped in (True, False):
        model = MimoModel(layout, *_modules(case.encoders))
        optimizer = MimoOptimizer(model, OPT)
        model(batches[0]).backward()
        if dropped:
            model(batches[1])  # FSDP2's roots stay gathered: the update must not leave this copy in use
        model.reduce_gradients()
        assert optimizer.step(1.0)
        with torch.no_grad():
            out.append([model(batches[2]).item()])
    return out


def test_an_update_after_a_dropped_forward_reaches_the_next_forward() -> None:
    """A forward with gradients on that is never backpropagated leaves FSDP2's roots gathered; the
    optimizer's update, written to the shards, must be what the next forward computes with."""
    for dropped, plain in run_on_ranks(_losses_after_an_update_past_a_dropped_forward, 2, timeout=120):
        assert dropped == plain
