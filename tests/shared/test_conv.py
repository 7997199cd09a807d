"""`wan_tpu.layers.conv.Conv` in both kernel layouts against torch's convolutions (float32, ≤ 1e-5 relative)."""

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from wan_tpu.errors import WanInputError
from wan_tpu.layers.conv import (
    Conv,
    default_out_first,
    kernel_layout,
    out_first_kernels,
    spatial_first_shape,
    spatial_to_out_first,
    torch_to_kernel,
)

CASES = [  # kernel, stride, padding
    ((5,), 1, ((2, 2),)),
    ((3, 3), 2, ((1, 1), (1, 1))),
    ((1, 1), 1, ((0, 0), (0, 0))),
    ((3, 1, 1), 1, ((1, 1), (0, 0), (0, 0))),
]
TORCH = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}


@pytest.mark.parametrize("out_first", [False, True])
@pytest.mark.parametrize("kernel, stride, padding", CASES)
def test_conv_matches_torch_in_either_layout(kernel, stride, padding, out_first):
    rng = np.random.default_rng(0)
    cin, cout, n = 6, 10, len(kernel)
    weight = rng.standard_normal((cout, cin, *kernel)).astype(np.float32)
    bias = rng.standard_normal(cout).astype(np.float32)
    x = rng.standard_normal((2, cin, *(9,) * n)).astype(np.float32)
    conv = Conv(cin, cout, kernel, strides=stride, padding=padding, rngs=nnx.Rngs(0), out_first=out_first)
    assert conv.kernel.shape == ((cout, *kernel, cin) if out_first else (*kernel, cin, cout))
    conv.kernel.set_value(torch_to_kernel(weight, out_first))
    conv.bias.set_value(bias)
    ours = np.moveaxis(np.asarray(conv(np.moveaxis(x, 1, -1))), -1, 1)
    ref = TORCH[n](torch.from_numpy(x), torch.from_numpy(weight), torch.from_numpy(bias), stride,
                   [p[0] for p in padding]).numpy()
    assert np.linalg.norm(ours - ref) <= 1e-5 * np.linalg.norm(ref)


def test_layout_follows_the_backend_the_context_and_the_environment(monkeypatch):
    monkeypatch.delenv("WAN_TPU_CONV_KERNEL", raising=False)
    assert default_out_first() is (jax.default_backend() == "gpu")
    with kernel_layout(True):
        assert default_out_first() is True
        convs = nnx.List([Conv(2, 3, (3, 3), rngs=nnx.Rngs(0)), Conv(2, 3, (3, 3), rngs=nnx.Rngs(0), out_first=False)])
    assert out_first_kernels(convs) == {"0.kernel"}
    with kernel_layout(False):
        assert default_out_first() is False
    monkeypatch.setenv("WAN_TPU_CONV_KERNEL", "out_first")
    assert default_out_first() is True
    monkeypatch.setenv("WAN_TPU_CONV_KERNEL", "sideways")
    with pytest.raises(WanInputError, match="use out_first or spatial_first"):
        default_out_first()


def test_layout_moves_are_inverse_views():
    k = np.arange(3 * 5 * 4 * 7).reshape(3, 5, 4, 7)  # (kh, kw, in, out)
    moved = spatial_to_out_first(k)
    assert moved.shape == (7, 3, 5, 4) and spatial_first_shape(moved.shape) == k.shape
    np.testing.assert_array_equal(moved[6, 2, 4, 3], k[2, 4, 3, 6])
