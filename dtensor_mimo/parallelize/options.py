"""`ParallelOptions`: how one module is parallelized beyond its meshes (typed, validated)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelOptions:
    """Per-module switches for `parallelize_module_for` and the per-kind functions.

    Attributes:
        sp: sequence parallel on top of tensor parallel: norms and residual adds run on a
            sequence shard (dim 1) of the activations. Ignored without a tp mesh of size > 1.
        fsdp: shard parameters over the dp mesh with FSDP2 (`fully_shard`), gradients *summed*
            over dp. False, no dp mesh, or a dp mesh of size 1: parameters stay replicated over
            dp (plain tensors, or tp DTensors) and the training loop sums gradients itself with
            `allreduce_gradients(module, dp_mesh)` (a no-op for size 1).
        compile: `torch.compile` each transformer block (the whole module for a projection).
        compile_backend: backend for `compile`; "inductor" (default) or e.g. "aot_eager".
        reshard_after_forward: FSDP2 frees the gathered parameters after forward (ZeRO-3) when
            True, keeps them until backward (ZeRO-2-like, more memory, one all-gather less).
            The root module is never resharded after forward (FSDP2's own default).
        activation_checkpointing: recompute block activations in backward instead of keeping
            them: 0 off, 1 every transformer block, n every n-th block (the first, then every
            n-th). Composes with tp/sp, compile and FSDP2; numerics unchanged.
    """

    sp: bool = False
    fsdp: bool = True
    compile: bool = False
    compile_backend: str = "inductor"
    reshard_after_forward: bool = True
    activation_checkpointing: int = 0

    def __post_init__(self) -> None:
        flags = {n: getattr(self, n) for n in ("sp", "fsdp", "compile", "reshard_after_forward")}
        wrong = {n: v for n, v in flags.items() if not isinstance(v, bool)}
        if wrong:
            raise TypeError(f"ParallelOptions: {wrong} must be True or False")
        ac = self.activation_checkpointing
        if isinstance(ac, bool) or not isinstance(ac, int) or ac < 0:
            raise TypeError(f"ParallelOptions: activation_checkpointing={ac!r} must be an integer >= 0 "
                            "(0 off, 1 every block, n every n-th block)")
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise TypeError(f"ParallelOptions: compile_backend={self.compile_backend!r} must be a "
                            "backend name such as 'inductor' or 'aot_eager'")

    def check_for(self, module: str, tp: int) -> None:
        """Raise ValueError for option combinations that cannot run on `module` with tensor
        parallel size `tp` (checked on every rank before any process group is used)."""
        if self.activation_checkpointing and self.compile and tp > 1:
            # torch 2.13: a compiled block whose activations are DTensors fails under
            # torch.utils.checkpoint ("expected all tensors_saved_with_vc_check to be Tensors").
            raise ValueError(
                f"module {module!r}: activation_checkpointing={self.activation_checkpointing} with "
                f"compile=True is not supported at tp={tp} (torch 2.13 cannot checkpoint compiled "
                "blocks with DTensor activations); use compile=False or activation_checkpointing=0 "
                "for this module")

