"""The CuPy kernels against the NumPy reference on shapes drawn by hypothesis: odd and tiny
sizes, contexts on either side of the 128-key attention chunk, block size 1, group sizes
that are not powers of two, a single expert, top_k = E, vocabularies of one word.

GPU tests: skipped without a device, run on cusim in CI (tests/cusim). Examples are
derandomized, so a failure reproduces. Tolerances: ``TOL`` of test_cupy_ops.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cupy_ops import bf16, check_attention_decode, close, paged_kv

from eprt.ops import device
from eprt.ops.numpy_ops import NumpyOps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not device.cuda_usable(), reason="CuPy cannot use a CUDA device here"),
]
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)
HEAD_DIMS = st.sampled_from([8, 16, 24, 64, 72, 128, 256])
CONTEXTS = st.one_of(st.integers(1, 300), st.sampled_from([127, 128, 129, 255, 256, 257]))


@pytest.fixture(scope="module")
def ops():
    from eprt.ops.cupy_ops import CupyOps

    return CupyOps(), NumpyOps()


@SETTINGS
@given(
    hk=st.integers(1, 3),
    group=st.integers(1, 16),
    dh=HEAD_DIMS,
    bs=st.sampled_from([1, 3, 16]),
    lens=st.lists(CONTEXTS, min_size=1, max_size=3),
    split=st.sampled_from(["off", "on"]),
    split_keys=st.sampled_from([128, 256]),
    seed=st.integers(0, 2**16),
)
def test_attention_decode_shapes(hk, group, dh, bs, lens, split, split_keys, seed):
    from eprt.ops.cupy_ops import CupyOps

    g, c = CupyOps(decode_split=split, split_keys=split_keys), NumpyOps()
    check_attention_decode(g, c, np.random.default_rng(seed), lens, bs, hk, group, dh, spare_blocks=1)


@SETTINGS
@given(
    hk=st.integers(1, 2),
    group=st.sampled_from([1, 3, 8]),
    dh=HEAD_DIMS,
    bs=st.sampled_from([1, 5, 16]),
    start=st.integers(0, 300),
    T=st.integers(1, 140),
    split=st.sampled_from(["off", "auto"]),
    seed=st.integers(0, 2**16),
)
def test_attention_prefill_shapes(hk, group, dh, bs, start, T, split, seed):
    from eprt.ops.cupy_ops import CupyOps

    g, c = CupyOps(decode_split=split, split_keys=128), NumpyOps()
    rng = np.random.default_rng(seed)
    kc, vc, tables = paged_kv(rng, [start + T], bs, hk, dh, spare_blocks=1)
    q = bf16(rng.standard_normal((T, hk * group, dh)))
    got = g.attention_prefill(g.activation(q), g.activation(kc), g.activation(vc), g.index(tables[0]), start, dh**-0.5)
    close(g.to_host(got), c.attention_prefill(q, kc, vc, tables[0], start, dh**-0.5), "attention")


@SETTINGS
@given(
    T=st.integers(1, 9),
    E=st.integers(1, 160),
    data=st.data(),
    renormalize=st.booleans(),
    ties=st.booleans(),
    f32=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_router_shapes(ops, T, E, data, renormalize, ties, f32, seed):
    import cupy

    g, c = ops
    k = data.draw(st.integers(1, min(E, 32)), label="top_k")
    rng = np.random.default_rng(seed)
    # integer logits tie a lot (ties go to the lower id); normal ones never tie within fp32 error
    logits = (rng.integers(-2, 3, (T, E)) if ties else 3 * rng.standard_normal((T, E))).astype(np.float32)
    logits = bf16(logits)
    w, ids = g.router(cupy.asarray(logits) if f32 else g.activation(logits), k, renormalize)
    want_w, want_ids = c.router(logits, k, renormalize)
    np.testing.assert_array_equal(g.to_host(ids), want_ids)
    close(g.to_host(w), want_w, "router")


@SETTINGS
@given(
    T=st.integers(1, 70),
    El=st.integers(1, 9),
    extra=st.integers(0, 6),
    data=st.data(),
    D=st.sampled_from([8, 24, 256, 264]),
    I=st.sampled_from([8, 40, 128]),
    impl=st.sampled_from(["grouped", "gathered"]),
    seed=st.integers(0, 2**16),
)
def test_moe_experts_shapes(T, El, extra, data, D, I, impl, seed):
    import cupy

    from eprt.ops.cupy_ops import CupyOps

    g, c = CupyOps(moe_impl=impl), NumpyOps()
    E = El + extra
    start = data.draw(st.integers(0, extra), label="expert_start")
    k = data.draw(st.integers(1, min(E, 8)), label="top_k")
    rng = np.random.default_rng(seed)
    x = bf16(rng.standard_normal((T, D)))
    wgu = bf16(rng.standard_normal((El, 2 * I, D)) / np.sqrt(D))
    wd = bf16(rng.standard_normal((El, D, I)) / np.sqrt(I))
    w, ids = c.router(rng.standard_normal((T, E)).astype(np.float32), k, True)
    got = g.to_host(g.moe_experts(g.activation(x), cupy.asarray(w), g.index(ids), g.weight(wgu), g.weight(wd), start))
    want = c.moe_experts(x, w, ids, wgu, wd, start)
    close(got, want, "moe", scale=max(float(np.abs(want).max()), 1e-3))


@SETTINGS
@given(rows=st.integers(1, 5), D=st.integers(1, 1100), seed=st.integers(0, 2**16))
def test_rms_norm_shapes(ops, rows, D, seed):
    g, c = ops
    rng = np.random.default_rng(seed)
    x, w = bf16(rng.standard_normal((rows, D))), bf16(1 + 0.1 * rng.standard_normal(D))
    close(g.to_host(g.rms_norm(g.activation(x), g.weight(w), 1e-6)), c.rms_norm(x, w, 1e-6), "rms_norm")
    r = bf16(rng.standard_normal((rows, D)))
    normed, s = g.add_rms_norm(g.activation(x), g.activation(r), g.weight(w), 1e-6)
    want_normed, want_s = c.add_rms_norm(x, r, w, 1e-6)
    close(g.to_host(s), want_s, "rms_norm")
    close(g.to_host(normed), want_normed, "rms_norm")


@SETTINGS
@given(T=st.integers(1, 6), H=st.integers(1, 9), half=st.integers(1, 128), seed=st.integers(0, 2**16))
def test_rope_shapes(ops, T, H, half, seed):
    g, c = ops
    rng = np.random.default_rng(seed)
    dh = 2 * half
    x = bf16(rng.standard_normal((T, H, dh)))
    pos = rng.integers(0, 64, T).astype(np.int32)
    freqs = np.arange(64, dtype=np.float32)[:, None] * (1e4 ** (-np.arange(0, dh, 2) / dh))[None, :]
    cos_sin = np.concatenate([np.cos(freqs), np.sin(freqs)], axis=-1).astype(np.float32)
    import cupy

    got = g.rope(g.activation(x), g.index(pos), cupy.asarray(cos_sin))
    close(g.to_host(got), c.rope(x, pos, cos_sin), "rope")


@SETTINGS
@given(B=st.integers(1, 4), V=st.integers(1, 3000), ties=st.booleans(), seed=st.integers(0, 2**16))
def test_argmax_shapes(ops, B, V, ties, seed):
    g, c = ops
    rng = np.random.default_rng(seed)
    logits = bf16(rng.integers(-3, 3, (B, V)) if ties else rng.standard_normal((B, V)))
    logits[0, rng.integers(0, V)] = -np.inf
    np.testing.assert_array_equal(g.argmax(g.activation(logits)), c.argmax(logits))


@SETTINGS
@given(T=st.integers(1, 5), I=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_silu_and_mul_shapes(ops, T, I, seed):
    g, c = ops
    x = bf16(3 * np.random.default_rng(seed).standard_normal((T, 2 * I)))
    close(g.to_host(g.silu_and_mul(g.activation(x))), c.silu_and_mul(x), "silu_and_mul")


@SETTINGS
@given(
    T=st.integers(1, 9),
    D=st.one_of(st.integers(1, 300).map(lambda n: 8 * n), st.sampled_from([8, 128, 136, 2048, 2056])),
    I=st.integers(1, 24),
    seed=st.integers(0, 2**16),
)
def test_add_rms_norm_gate_up_silu_shapes(ops, T, D, I, seed):
    """The fused norm at every add_rms_norm block size (1 to 16 warps), bit for bit the two ops."""
    g, c = ops
    rng = np.random.default_rng(seed)
    x, r = bf16(rng.standard_normal((T, D))), bf16(rng.standard_normal((T, D)))
    w, wgu = bf16(1 + 0.1 * rng.standard_normal(D)), bf16(rng.standard_normal((2 * I, D)) / np.sqrt(D))
    dx, dr, dw, dwgu = g.activation(x), g.activation(r), g.weight(w), g.weight(wgu)
    h, s = g.add_rms_norm_gate_up_silu(dx, dr, dw, 1e-6, dwgu)
    normed, want_s = g.add_rms_norm(dx, dr, dw, 1e-6)
    np.testing.assert_array_equal(g.to_host(s), g.to_host(want_s))
    np.testing.assert_array_equal(g.to_host(h), g.to_host(g.gate_up_silu(normed, dwgu)))
    close(g.to_host(s), c.add_rms_norm(x, r, w, 1e-6)[1], "rms_norm")


@SETTINGS
@given(
    T=st.integers(1, 9),
    El=st.integers(1, 9),
    D=st.sampled_from([8, 24, 264]),
    I=st.sampled_from([8, 40]),
    Is=st.sampled_from([8, 40, 80]),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_moe_experts_shared_shapes(T, El, D, I, Is, data, seed):
    import cupy

    from eprt.ops.cupy_ops import CupyOps

    g, c = CupyOps(moe_impl="grouped"), NumpyOps()
    k = data.draw(st.integers(1, min(El + 2, 8)), label="top_k")
    rng = np.random.default_rng(seed)
    x = bf16(rng.standard_normal((T, D)))
    wgu, wd = bf16(rng.standard_normal((El, 2 * I, D)) / np.sqrt(D)), bf16(rng.standard_normal((El, D, I)) / np.sqrt(I))
    sgu, sd = bf16(rng.standard_normal((2 * Is, D)) / np.sqrt(D)), bf16(rng.standard_normal((D, Is)) / np.sqrt(Is))
    w, ids = c.router(rng.standard_normal((T, El + 2)).astype(np.float32), k, True)  # 2 experts not local
    dev = (g.activation(x), cupy.asarray(w), g.index(ids), g.weight(wgu), g.weight(wd), 0, None)
    out, s = g.moe_experts_shared(*dev, g.weight(sgu), g.weight(sd))
    np.testing.assert_array_equal(g.to_host(out), g.to_host(g.moe_experts(*dev)))
    want_out, want_s = c.moe_experts_shared(x, w, ids, wgu, wd, 0, None, sgu, sd)
    close(g.to_host(s), want_s, "moe", scale=max(float(np.abs(want_s).max()), 1e-3))
