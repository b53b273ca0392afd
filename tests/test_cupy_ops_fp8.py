"""FP8 block-scaled weights resident as FP8 on the GPU backend, dequantized inside the GEMMs
(``linear``: CUDA-core kernel for few rows, dequantized tiles + cuBLAS for many; ``moe_experts``:
grouped kernel and gathered path), against NumPy on the dequantized weights: fixed cases, then
shapes drawn by hypothesis. GPU tests: skipped without a device, run on cusim in CI.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cupy_ops import bf16, close

from eprt.model.safetensors_io import fp8_e4m3_to_f32
from eprt.ops import device
from eprt.ops.numpy_ops import NumpyOps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not device.cuda_usable(), reason="CuPy cannot use a CUDA device here"),
]
SETTINGS = settings(max_examples=10, deadline=None, derandomize=True)


def fp8_bytes(rng, shape) -> np.ndarray:
    """Random float8_e4m3fn bytes, NaN (0x7f, 0xff) excluded."""
    raw = rng.integers(0, 256, shape, dtype=np.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x3C
    return raw


def fp8_weight(rng, lead: tuple, N: int, K: int, block: tuple, parts: int = 1):
    """(raw [*lead, N, K], scale_inv, float32 dequantized): parts of N / parts rows blocked apart."""
    bn, bk = block
    rows = N // parts
    raw = fp8_bytes(rng, (*lead, N, K))
    scale = rng.uniform(0.5, 1.5, (*lead, parts * -(-rows // bn), -(-K // bk))).astype(np.float32) / 64
    per_part = np.repeat(scale.reshape(*lead, parts, -1, scale.shape[-1]), bn, axis=-2)[..., :rows, :]
    full = np.repeat(per_part, bk, axis=-1)[..., :K].reshape(*lead, N, K)
    return raw, scale, fp8_e4m3_to_f32(raw) * full


@pytest.fixture(scope="module")
def ops():
    from eprt.ops.cupy_ops import CupyOps

    return CupyOps(), NumpyOps()


def check_linear(g, c, rng, T, N, K, block, with_bias):
    raw, scale, w = fp8_weight(rng, (), N, K, block)
    x = bf16(rng.standard_normal((T, K)))
    b = bf16(rng.standard_normal(N)) if with_bias else None
    gw = g.weight_fp8(raw, scale, *block, N)
    got = g.to_host(g.linear(g.activation(x), gw, None if b is None else g.weight(b)))
    want = c.linear(x, w, b)
    close(got, want, "linear", scale=float(np.abs(want).max()))
    return gw


@pytest.mark.parametrize("T", [1, 9, 70])
@pytest.mark.parametrize("block", [(16, 16), (128, 128), (8, 24)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_linear(ops, T, block, with_bias):
    from eprt.ops.cupy_ops import Fp8Weight

    g, c = ops
    gw = check_linear(g, c, np.random.default_rng(T), T, 41, 48, block, with_bias)
    assert isinstance(gw, Fp8Weight) and gw.data.dtype == np.uint8  # stays FP8 on the device


def test_fp8_linear_on_many_rows_runs_in_tiles(ops, monkeypatch):
    from eprt.ops import cupy_ops

    monkeypatch.setattr(cupy_ops, "FP8_TILE_ELEMENTS", 10 * 48)  # 10 weight rows per cuBLAS tile
    g, c = ops
    check_linear(g, c, np.random.default_rng(2), 66, 37, 48, (16, 16), True)


def test_fp8_with_an_odd_block_width_falls_back_to_bf16(ops):
    g, c = ops
    rng = np.random.default_rng(4)
    raw, scale, w = fp8_weight(rng, (), 20, 36, (16, 12))
    gw = g.weight_fp8(raw, scale, 16, 12, 20)
    assert gw.dtype == np.uint16 and gw.shape == (20, 36)  # bf16 bits, dequantized on the device
    np.testing.assert_allclose(g.to_host(gw), bf16(w), rtol=0, atol=0)


def check_moe(g, c, rng, T, El, E, k, D, I, block, start):
    raw_gu, s_gu, w_gu = fp8_weight(rng, (El,), 2 * I, D, block, parts=2)
    raw_d, s_d, w_d = fp8_weight(rng, (El,), D, I, block)
    x = bf16(rng.standard_normal((T, D)))
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    weights = rng.uniform(0.1, 1, (T, k)).astype(np.float32)
    gu, dn = g.weight_fp8(raw_gu, s_gu, *block, I), g.weight_fp8(raw_d, s_d, *block, D)
    got = g.to_host(g.moe_experts(g.activation(x), g.xp.asarray(weights), g.index(ids), gu, dn, start))
    want = c.moe_experts(x, weights, ids, w_gu, w_d, start)
    close(got, want, "moe", scale=float(np.abs(want).max()))


def moe_ops(impl: str):
    from eprt.ops.cupy_ops import CupyOps

    return CupyOps(moe_impl=impl)


@pytest.mark.parametrize("impl", ["grouped", "gathered"])
@pytest.mark.parametrize("block", [(16, 16), (128, 128), (24, 8)])
def test_fp8_moe_experts(impl, block):
    check_moe(moe_ops(impl), NumpyOps(), np.random.default_rng(len(impl)), 5, 3, 5, 2, 32, 40, block, 1)


def test_fp8_moe_mixing_formats_is_refused():
    g = moe_ops("grouped")
    rng = np.random.default_rng(0)
    raw, scale, _ = fp8_weight(rng, (2,), 16, 16, (16, 16), parts=2)
    gu = g.weight_fp8(raw, scale, 16, 16, 8)
    with pytest.raises(ValueError, match="both be FP8 or both bf16"):
        g.moe_experts(g.zeros((1, 16)), g.zeros((1, 1), "f32"), g.index([[0]]), gu, g.zeros((2, 16, 8)), 0)


# ---- drawn shapes -------------------------------------------------------------------------
@SETTINGS
@given(
    T=st.integers(1, 80),
    N=st.integers(1, 50),
    K=st.sampled_from([8, 16, 40, 136]),
    bn=st.sampled_from([1, 8, 16, 128]),
    bk=st.sampled_from([8, 16, 128]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fp8_linear_shapes(ops, T, N, K, bn, bk, with_bias, seed):
    g, c = ops
    check_linear(g, c, np.random.default_rng(seed), T, N, K, (bn, bk), with_bias)


@SETTINGS
@given(
    T=st.integers(1, 12),
    El=st.integers(1, 3),
    extra=st.integers(0, 2),
    D=st.sampled_from([8, 24, 40]),
    I=st.sampled_from([8, 16, 24]),
    block=st.sampled_from([(8, 8), (16, 16), (128, 128)]),
    impl=st.sampled_from(["grouped", "gathered"]),
    seed=st.integers(0, 2**16),
)
def test_fp8_moe_experts_shapes(T, El, extra, D, I, block, impl, seed):
    E = El + extra
    check_moe(moe_ops(impl), NumpyOps(), np.random.default_rng(seed), T, El, E, min(2, E), D, I, block, extra // 2)


@pytest.mark.parametrize("T,Is,block", [(1, 40, (16, 16)), (3, 80, (128, 128)), (8, 40, (24, 8))])
def test_fp8_shared_expert_in_the_experts_launches_is_the_unfused_ops_bit_for_bit(T, Is, block):
    """An FP8 shared expert in the grouped FP8 launches (moe_experts_shared): its products are
    fp8_linear's dot products (weight_rows.cuh's dot_two_rows, the same order) and gate_up_silu's
    epilogue is silu_and_mul's, so both the routed output and the shared expert's equal the unfused
    FP8 ops bit for bit; against NumPy the ops' tolerance."""
    from test_cupy_tensor_cores import launched

    g, c, rng = moe_ops("grouped"), NumpyOps(), np.random.default_rng(T * Is)
    El, k, D, I = 6, 2, 32, 40
    raw_gu, s_gu, w_gu = fp8_weight(rng, (El,), 2 * I, D, block, parts=2)
    raw_d, s_d, w_d = fp8_weight(rng, (El,), D, I, block)
    raw_sgu, s_sgu, w_sgu = fp8_weight(rng, (), 2 * Is, D, block, parts=2)
    raw_sd, s_sd, w_sd = fp8_weight(rng, (), D, Is, block)
    x = bf16(rng.standard_normal((T, D)))
    ids = np.stack([rng.permutation(El + 1)[:k] for _ in range(T)]).astype(np.int32)
    weights = rng.uniform(0.1, 1, (T, k)).astype(np.float32)
    gu, dn = g.weight_fp8(raw_gu, s_gu, *block, I), g.weight_fp8(raw_d, s_d, *block, D)
    sgu, sd = g.weight_fp8(raw_sgu, s_sgu, *block, Is), g.weight_fp8(raw_sd, s_sd, *block, D)
    dev = (g.activation(x), g.xp.asarray(weights), g.index(ids), gu, dn, 0, None)
    with pytest.MonkeyPatch.context() as mp:
        names = launched(mp)
        out, s = g.moe_experts_shared(*dev, sgu, sd)
    assert names == ["moe_permute", "moe_gate_up_silu_fp8", "moe_down_fp8", "moe_combine"], names
    np.testing.assert_array_equal(g.to_host(out), g.to_host(g.moe_experts(*dev)))
    np.testing.assert_array_equal(g.to_host(s), g.to_host(g.linear(g.gate_up_silu(dev[0], sgu), sd)))
    want = c.linear(c.gate_up_silu(x, w_sgu), w_sd)
    close(g.to_host(s), want, "moe", scale=float(np.abs(want).max()))


@pytest.mark.parametrize("T,block", [(1, (16, 16)), (5, (128, 128)), (8, (24, 8))])
def test_fp8_dense_norm_and_gate_up_in_one_launch_is_the_unfused_ops_bit_for_bit(T, block):
    """An FP8 dense MLP's post-attention norm fused into its gate_up (dense_add_norm_gate_up_silu_fp8):
    add_rms_norm's bits, then fp8_linear's products and silu_and_mul's epilogue: the bits of
    add_rms_norm, fp8_linear and silu_and_mul."""
    from test_cupy_tensor_cores import launched

    g, rng = moe_ops("grouped"), np.random.default_rng(T)
    D, I = 48, 40
    raw, scale, w = fp8_weight(rng, (), 2 * I, D, block, parts=2)
    gw = g.weight_fp8(raw, scale, *block, I)
    x, r = (g.activation(bf16(rng.standard_normal((T, D)))) for _ in range(2))
    norm = g.weight(bf16(1 + 0.1 * rng.standard_normal(D)))
    with pytest.MonkeyPatch.context() as mp:
        names = launched(mp)
        h, s = g.add_rms_norm_gate_up_silu(x, r, norm, 1e-6, gw)
    assert names == ["dense_add_norm_gate_up_silu_fp8"], names
    n, want_s = g.add_rms_norm(x, r, norm, 1e-6)
    np.testing.assert_array_equal(g.to_host(s), g.to_host(want_s))
    np.testing.assert_array_equal(g.to_host(h), g.to_host(g.gate_up_silu(n, gw)))
    close(g.to_host(h), NumpyOps().gate_up_silu(g.to_host(n), w), "linear", scale=1.0)
