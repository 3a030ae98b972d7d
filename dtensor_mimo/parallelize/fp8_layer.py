"""`Float8LinearOrEmpty`: torchao's ``Float8Linear`` that also takes an input without rows.
Imported only where fp8 is asked for (it imports torchao; `dtensor_mimo.parallelize.fp8`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_training_tensor import Float8TrainingTensor

from dtensor_mimo.models.layers import local_part, with_local


class Float8LinearOrEmpty(Float8Linear):
    """torchao's ``Float8Linear``, but an input without rows runs the plain matmul. An encoder's
    dp rank without items in a microbatch still runs forward and backward (FSDP2's collectives
    and the dp sums need every rank), and torchao's dynamic scales take the amax of the input
    (tensorwise: in forward) or of the output gradient (rowwise: in backward), which an empty
    tensor has not. The product is empty either way and the weight's gradient zero."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.numel():
            return super().forward(input)
        # FSDP2's float8 all-gather (tensorwise) gives a float8 weight, under tp inside a DTensor:
        # back to its own dtype, differentiably (the gradient reaches the sharded parameter)
        weight = self.weight
        local = local_part(weight)
        if isinstance(local, Float8TrainingTensor):
            weight = with_local(weight, local.to_original_precision())
        bias = None if self.bias is None else self.bias.to(input.dtype)
        return F.linear(input, weight.to(input.dtype), bias)
