"""Context-parallel attention core: all-gather K/V over the cp group, then the ordinary mask.

Each cp rank holds some of the sequence's columns (zigzag-sharded, see `sharding.py`; any split
works, since the rows carry their global indices). Every rank all-gathers the keys, values and
their global indices (and document ids) of the whole cp group and calls `causal_attention` with
its own queries against all keys. Because the mask is built from the global indices, the result
is exactly that of single-process attention over the full sequence, including packed documents.

Backward: the gathered K/V receive gradient from this rank's queries only; the gradient of a
rank's own K/V rows is the sum over all cp ranks of their contributions to those rows. The
gather is a functional collective (`functional_all_gather`), whose registered autograd formula is a
sum reduce-scatter: each rank gets back the summed gradient of its own slice. It runs on gloo
(CPU) and NCCL alike.

Trade-offs, and why not ring attention:

- Memory: each rank holds the full K and V of its batch for the kv heads, `2 * B * Hkv * S * D`
  per layer, kept for backward: linear in S. The mask is never `[S / cp, S]` at once:
  `causal_attention` takes this rank's queries in chunks of `ATTENTION_QUERY_CHUNK` rows, each
  with a `[chunk, S]` mask recomputed in backward, so the transient is bounded by
  `B * chunk * S` whatever the length. The attention work itself is split by cp. With
  grouped-query attention (`Hkv` << `Hq`) the gathered K/V are small next to the activations,
  which is why Llama 3 trains long context this way.
- Ring attention passes one K/V chunk at a time and overlaps it with compute, so it needs less
  memory at very long sequence lengths, but PyTorch's public `context_parallel()` fails on CPU
  (no sharding rule for the CPU SDPA kernel) and its ring implementation is private API. The
  all-gather core is exact for any mask (documents included), runs unchanged on CPU and GPU, and
  is a few lines.
- Communication: one all-gather of K/V and one of the integer indices per layer in forward; one
  reduce-scatter of the K/V gradient per layer in backward. Every cp rank must hold the same
  number of rows (zigzag sharding guarantees it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dtensor_mimo.layout.torch_compat import functional_all_gather
from dtensor_mimo.models.layers import AttentionFn, FlexAttentionCore, causal_attention


_Ids = tuple[torch.Tensor, torch.Tensor | None]
"""Global indices and document ids (None: no documents) of key rows."""


class ContextParallelAttention:
    """An `AttentionFn` that is exact across the ranks of `cp_group`.

    Every rank of the cp group calls it with its local rows (same shapes on every rank); the
    keys and values of all cp ranks are gathered and masked by global index and document id
    exactly as `causal_attention` does on the full sequence. Set it on a model with
    `Llama.set_attention_fn(ContextParallelAttention(cp_group))`.

    Args:
        cp_group: the context-parallel `ProcessGroup`, or a 1-D `DeviceMesh` such as
            `mesh["cp"]`.
        inner: the core that attends this rank's queries to the gathered keys under their
            global indices: `causal_attention` (masked SDPA chunks), or a
            `dtensor_mimo.models.FlexAttentionCore` (one FlexAttention kernel over a block mask:
            on GPU, the blocks above the diagonal and outside every document are skipped). With
            a FlexAttentionCore the gathered indices are kept for the same local index tensors
            (every layer of a forward passes the same ones): one index all-gather per forward,
            and the same tensors, so its block mask is built once. The default core stays one
            traceable function (compiled blocks trace through it).
    """

    def __init__(self, cp_group: dist.ProcessGroup | DeviceMesh, inner: AttentionFn = causal_attention) -> None:
        if isinstance(cp_group, DeviceMesh):
            if cp_group.ndim != 1:
                raise ValueError(
                    f"ContextParallelAttention: pass a 1-D mesh (e.g. mesh['cp']), got a mesh with "
                    f"dims {cp_group.mesh_dim_names} of shape {tuple(cp_group.shape)}"
                )
            cp_group = cp_group.get_group()
        self.group = cp_group
        self.cp = dist.get_world_size(cp_group)
        self.inner = inner
        self._keep_ids = isinstance(inner, FlexAttentionCore)  # it runs outside the graph anyway
        self._ids: tuple[_Ids, _Ids] | None = None  # (local, gathered) of the last `_kept_ids` call

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        q_pos: torch.Tensor | None,
        kv_pos: torch.Tensor | None,
        q_doc: torch.Tensor | None = None,
        kv_doc: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if (q_doc is None) != (kv_doc is None):
            # Checked before communicating, so every rank fails the same way instead of hanging.
            raise ValueError("ContextParallelAttention: pass both q_doc and kv_doc, or neither")
        if self.cp > 1 and (q_pos is None or kv_pos is None):
            raise ValueError("ContextParallelAttention: a cp rank holds a subset of the columns; pass "
                             "their global indices (Llama's sequence_index, see shard_for_cp)")
        if self.cp == 1:
            return self.inner(q, k, v, q_pos=q_pos, kv_pos=kv_pos, q_doc=q_doc, kv_doc=kv_doc)

        # One gather for K and V together ([2, B, Hkv, S, D], sequence on dim 3) and one for the
        # integer row metadata; the functional collective carries the reduce-scatter backward.
        kv = functional_all_gather(torch.stack((k, v)), 3, self.group)
        k_all, v_all = kv.unbind(0)
        kv_pos_all, kv_doc_all = (self._kept_ids(kv_pos, kv_doc) if self._keep_ids
                                  else self._gather_ids(kv_pos, kv_doc))
        return self.inner(q, k_all, v_all, q_pos=q_pos, kv_pos=kv_pos_all, q_doc=q_doc, kv_doc=kv_doc_all)

    def _gather_ids(self, kv_pos: torch.Tensor, kv_doc: torch.Tensor | None) -> _Ids:
        """Every cp rank's global indices (and document ids), in the gathered keys' order."""
        if kv_doc is None:
            return functional_all_gather(kv_pos.contiguous(), 1, self.group), None
        ids = torch.stack((kv_pos, kv_doc.to(kv_pos.dtype)))  # [2, B, S]
        kv_pos_all, kv_doc_all = functional_all_gather(ids, 2, self.group).unbind(0)
        return kv_pos_all, kv_doc_all

    @torch.compiler.disable
    def _kept_ids(self, kv_pos: torch.Tensor, kv_doc: torch.Tensor | None) -> _Ids:
        """`_gather_ids`, once for the same local tensors (the cache holds them: no false hit).
        Every rank of the cp group runs the same calls in the same order on local tensors of the
        same provenance (one microbatch's indices through every layer), so all of them take the
        gather or all skip it: the group's collectives stay in one order (NCCL)."""
        if self._ids is None or self._ids[0][0] is not kv_pos or self._ids[0][1] is not kv_doc:
            self._ids = (kv_pos, kv_doc), self._gather_ids(kv_pos, kv_doc)
        return self._ids[1]

    def __repr__(self) -> str:
        return f"ContextParallelAttention(cp={self.cp}, inner={getattr(self.inner, '__name__', self.inner)})"
