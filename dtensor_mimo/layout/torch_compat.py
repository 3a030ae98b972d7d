"""What differs between the torch releases this library runs on (2.11 to 2.13), in one place.

torch 2.13 renamed the tensor-to-tensor collectives ``*_single`` and deprecated the old names with a
FutureWarning; torch 2.11 (the version on many clusters, and on the GPU machines this project is
measured on) has only the old ones. Each name below is the new one where torch has it, else the old
one: the same operation either way (2.13's old names call the new ones).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

RELEASE: tuple[int, ...] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
"""This torch's (major, minor) release. Where 2.11 has a bug that 2.13 fixed, the library refuses the
feature by name on older releases (the zero-bubble schedules: `schedule/checks.py`)."""

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``all_gather_single(out, send, group=...)``: every member's ``send`` concatenated into ``out``."""

reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``reduce_scatter_single(out, send, group=...)``: this member's slice of the members' summed ``send``."""

functional_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
"""``functional_all_gather(x, dim, group)``: the functional all-gather along ``dim``, with its
registered autograd formula (a sum reduce-scatter); traceable by torch.compile. ``x`` must be
contiguous (2.11 asserts it)."""
