"""minirad.models.linear: the prepacked weight gives F.linear's result for every row count."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minirad.models.linear import MIN_PACKED_ELEMENTS, PACKED_ROWS, Linear, can_prepack

IN, OUT = 512, 256  # MIN_PACKED_ELEMENTS: the smallest matrix that is packed


def _layer(dtype, bias=True, seed=0):
    torch.manual_seed(seed)
    assert IN * OUT == MIN_PACKED_ELEMENTS
    return nn.Linear(IN, OUT, bias=bias).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_every_row_count_matches_f_linear(dtype, bias):
    if not can_prepack(torch.empty(OUT, IN, dtype=dtype)):
        pytest.skip(f"oneDNN cannot prepack {dtype} on this CPU")
    layer = _layer(dtype, bias)
    lin = Linear(layer)
    assert lin.packed is not None and lin.packed_rows == PACKED_ROWS[dtype]
    # bf16 products are rounded to bf16 from different accumulation orders: a few ulps.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    with torch.inference_mode():
        for rows in range(1, max(PACKED_ROWS[dtype]) + 3):
            x = torch.randn(rows, IN).to(dtype)
            torch.testing.assert_close(lin(x), F.linear(x, layer.weight, layer.bias), **tol)


def test_small_matrices_are_not_packed():
    """Below MIN_PACKED_ELEMENTS a packed call's set-up costs more than it saves."""
    small = nn.Linear(IN, OUT - 1)
    assert not can_prepack(small.weight) and Linear(small).packed is None


def test_prepack_off_and_unsupported_dtypes_use_the_module_weight():
    layer = _layer(torch.float32)
    off = Linear(layer, prepack=False)
    assert off.packed is None and off.weight is layer.weight
    half = Linear(_layer(torch.float16))
    assert half.packed is None  # oneDNN's packed linear is for fp32 and bf16 here
    x = torch.randn(4, IN, dtype=torch.float16)
    torch.testing.assert_close(half(x), F.linear(x, half.weight, half.bias))


def test_the_packed_path_is_the_one_taken():
    """A packed copy that is used: zeroing the module's weight after packing changes the
    result only for row counts outside PACKED_ROWS."""
    if not can_prepack(torch.empty(OUT, IN)):
        pytest.skip("oneDNN unavailable")
    layer = _layer(torch.float32, bias=False)
    lin = Linear(layer)
    with torch.no_grad():
        layer.weight.zero_()
    for rows in (1, 3, 4, 32, 33):
        out = lin(torch.randn(rows, IN))
        assert bool(out.abs().sum() > 0) == (rows in PACKED_ROWS[torch.float32]), rows
