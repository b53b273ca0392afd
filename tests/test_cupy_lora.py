"""The CuPy multi-LoRA kernel (kernels/lora.cu) against the NumPy reference, on a GPU or cusim:

PYTHONPATH=tests python -m pytest -p cusim.plugin -m gpu tests/test_cupy_lora.py
"""

import numpy as np
import pytest
from test_cupy_ops import bf16, gpu

from eprt.ops import lora_ops


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("R_used", [8, 5])
def test_lora_apply_matches_numpy_with_mixed_slots(R_used):
    """Rows of three adapters and of none in one call, on the rank prefix of a zero-padded stack."""
    import cupy

    from eprt.ops.cupy_ops import CupyOps

    g = CupyOps()
    rng = np.random.default_rng(7)
    S, R, K, N, T = 3, 8, 48, 40, 11
    a = rng.normal(size=(S, R, K)).astype(np.float32) * 0.2
    b = rng.normal(size=(S, R, N)).astype(np.float32) * 0.2
    x, y = bf16(rng.normal(size=(T, K))), bf16(rng.normal(size=(T, N)))
    slots = np.array([2, -1, 0, 2, 1, -1, 0, 0, 2, 1, -1], np.int32)
    want = lora_ops.lora_apply(y.copy(), x, a[:, :R_used], b[:, :R_used], lora_ops.LoraRows.group(slots))
    ga, gb = cupy.asarray(a), cupy.asarray(b)
    rows = lora_ops.LoraRows.group(slots, g.index)
    got = g.to_host(g.lora_apply(g.activation(y), g.activation(x), ga[:, :R_used], gb[:, :R_used], rows))
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=2e-2)  # one bf16 rounding of y
    np.testing.assert_array_equal(got[slots < 0], y[slots < 0])  # rows without an adapter untouched
