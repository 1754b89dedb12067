"""The decoder's linear layers on a CPU: HF's weights, plus a copy oneDNN reordered once.

A decode step multiplies a few rows (one per running request) by every weight matrix of the
model. For such thin products the math library's plain GEMM, reading the weight in HF's
``[out, in]`` row-major layout, runs far below what the core can do; oneDNN runs them faster
from a copy of the weight laid out in its own blocked format, made once at load time
("prepacking": what inductor's ``freezing`` pass and vLLM's CPU backend do). For a prefill of
hundreds of rows the plain GEMM is already compute-bound, and for fp32 products of one to
three rows its matrix-vector path is faster than the packed one, so those keep HF's weight.
Which rows take the packed path is :data:`PACKED_ROWS`, per dtype, measured on a 2-core Xeon
with avx512_bf16 (docs/benchmarks.md). A packed call also costs about 13 us more to set up,
which only a matrix too large to stay in the core's cache repays: smaller ones
(:data:`MIN_PACKED_ELEMENTS`; all of the shipped tiny model's) are never packed.

The packed copy is made when the engine is built: it costs one more copy of the text model's
weights in memory (``PagedDecoder(prepack=False)`` or ``EngineConfig(prepack_weights=False)``
skips it), and it does not follow later in-place edits of the module's weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MIN_PACKED_ELEMENTS", "PACKED_ROWS", "Linear", "can_prepack"]

# Rows (tokens in the step) that go through the packed weight, per dtype.
PACKED_ROWS: dict[torch.dtype, range] = {
    torch.float32: range(4, 33),
    torch.bfloat16: range(1, 65),
}
MIN_PACKED_ELEMENTS = 2**17  # smaller weight matrices stay as they are


def can_prepack(weight: torch.Tensor) -> bool:
    """True when oneDNN can prepack this weight here and it pays: a CPU matrix of at least
    :data:`MIN_PACKED_ELEMENTS` in a dtype of :data:`PACKED_ROWS` (bf16 only where the CPU
    computes bf16 natively)."""
    if weight.device.type != "cpu" or weight.dtype not in PACKED_ROWS:
        return False
    if weight.numel() < MIN_PACKED_ELEMENTS:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Linear:
    """``y = x W^T + b`` for an ``nn.Linear`` of HF's model.

    Args:
        layer: the module; its weight and bias are used as they are (never copied) for the
            rows outside :data:`PACKED_ROWS`.
        prepack: also keep a oneDNN-packed copy of the weight for the rows in
            :data:`PACKED_ROWS`, where :func:`can_prepack` allows it.
    """

    def __init__(self, layer: nn.Linear, prepack: bool = True) -> None:
        self.weight, self.bias = layer.weight, layer.bias
        self.packed, self.packed_rows = None, range(0)
        if prepack and can_prepack(layer.weight):
            with torch.no_grad():
                # oneDNN picks the blocked layout for a batch of 8 rows (a decode step of 8
                # requests); any row count may use the result.
                self.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), 8)
            self.packed_rows = PACKED_ROWS[layer.weight.dtype]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, in_features]`` -> ``[T, out_features]``."""
        if x.shape[0] in self.packed_rows:
            # "none", [], "": no activation fused after the product (oneDNN's post-op).
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
