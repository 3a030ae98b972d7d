"""`parallelize_module_for`: apply one module's layout, whatever kind of module it is."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtensor_mimo.models import AudioEncoder, Llama, Projection, ViT
from dtensor_mimo.parallelize.encoders import parallelize_encoder, parallelize_projection
from dtensor_mimo.parallelize.language import parallelize_llama
from dtensor_mimo.parallelize.options import ParallelOptions


def parallelize_module_for(
    module: nn.Module,
    tp_mesh: DeviceMesh | None,
    dp_mesh: DeviceMesh | None,
    options: ParallelOptions = ParallelOptions(),
) -> nn.Module:
    """Parallelize `module` in place (Llama, ViT, AudioEncoder or Projection); returns it.

    Typical use, per module of a `MimoLayout` on its member ranks::

        parallelize_module_for(model, layout.mesh(name, "tp"), layout.mesh(name, ("dp", "cp")),
                               ParallelOptions(sp=True))

    Order: tensor parallel, then compile per block, then FSDP2 per block and root.
    """
    if isinstance(module, Llama):
        return parallelize_llama(module, tp_mesh, dp_mesh, options)
    if isinstance(module, (ViT, AudioEncoder)):
        return parallelize_encoder(module, tp_mesh, dp_mesh, options)
    if isinstance(module, Projection):
        return parallelize_projection(module, tp_mesh, dp_mesh, options)
    raise TypeError(
        f"parallelize_module_for: no plan for {type(module).__name__}; supported: Llama, ViT, "
        "AudioEncoder, Projection (or call the per-kind function that fits your module)"
    )
