"""The fused kernels of issue 39's launch budget (docs/gpu.md, "Launches per layer"), on the GPU or
cusim: each against the NumPy reference (``NumpyOps``, the ops contract) and bit for bit against
the unfused GPU ops it replaces, so fusing changed no float result."""

from __future__ import annotations

import numpy as np
import pytest
from test_cupy_tensor_cores import launched

from eprt.ops.device import cuda_usable
from eprt.ops.numpy_ops import NumpyOps

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_usable(), reason="no usable CUDA device")]


@pytest.fixture(scope="module")
def g():
    from eprt.ops.cupy_ops import CupyOps

    return CupyOps()


def bf16(a):
    from eprt.ops.bf16 import bf16_bits_to_f32, f32_to_bf16_bits

    return bf16_bits_to_f32(f32_to_bf16_bits(np.asarray(a, np.float32)))


def cos_sin_table(positions: int, rd: int) -> np.ndarray:
    freqs = np.arange(positions, dtype=np.float32)[:, None] * (1e4 ** (-np.arange(0, rd, 2) / rd))[None, :]
    return np.concatenate([np.cos(freqs), np.sin(freqs)], axis=-1).astype(np.float32)  # [P, rd]


def unfused(g, q, k, v, norms, eps, pos, table, kc, vc, slots):
    """Today's sequence of GPU ops: per-head rms_norm, rope (partial: the first rd columns), kv_write."""
    xp = g.xp
    q, k, v = (xp.ascontiguousarray(a) for a in (q, k, v))
    if norms is not None:
        q, k = (g.rms_norm(a.reshape(-1, a.shape[-1]), w, eps).reshape(a.shape) for a, w in zip((q, k), norms))
    rd = table.shape[1]

    def rope(x):
        if rd == x.shape[-1]:
            return g.rope(x, pos, table)
        return xp.concatenate([g.rope(xp.ascontiguousarray(x[..., :rd]), pos, table), x[..., rd:]], axis=-1)

    q, k = rope(q), rope(k)
    g.kv_write(kc, vc, k, v, slots)
    return q


@pytest.mark.parametrize(
    "dh,rd,norm,table_dtype",
    [
        (64, 64, True, "f32"),
        (128, 128, True, "bf16"),
        (256, 256, True, "f32"),
        (96, 48, False, "bf16"),
        (64, 32, True, "bf16"),
    ],
)
def test_qk_rope_kv_write_is_the_unfused_ops_bit_for_bit(g, dh, rd, norm, table_dtype):
    import cupy

    rng = np.random.default_rng(dh + rd)
    T, H, Hk, NB, BS = 5, 6, 2, 4, 8
    qkv = bf16(rng.standard_normal((T, (H + 2 * Hk) * dh)) * 3)  # one product's rows: q | k | v
    norms_host = [bf16(1 + 0.2 * rng.standard_normal(dh)) for _ in range(2)]
    pos = rng.integers(0, 60, T).astype(np.int32)
    slots = np.array([3, 17, -1, 30, 8], np.int32)  # -1: padding, not written
    table = cos_sin_table(64, rd)
    eps = 1e-6
    dq = g.activation(qkv)
    views = (dq[:, : H * dh], dq[:, H * dh : (H + Hk) * dh], dq[:, (H + Hk) * dh :])
    q, k, v = (a.reshape(T, n, dh) for a, n in zip(views, (H, Hk, Hk)))
    norms = tuple(g.weight(w) for w in norms_host) if norm else None
    dtable = cupy.asarray(table) if table_dtype == "f32" else g.activation(table)
    caches = [g.zeros((NB, BS, Hk, dh)) for _ in range(4)]
    got = g.qk_rope_kv_write(q, k, v, norms, eps, g.index(pos), dtable, caches[0], caches[1], g.index(slots))
    want = unfused(g, q, k, v, norms, eps, g.index(pos), dtable, caches[2], caches[3], g.index(slots))
    np.testing.assert_array_equal(g.to_host(got), g.to_host(want))
    for a, b in ((caches[0], caches[2]), (caches[1], caches[3])):
        np.testing.assert_array_equal(g.to_host(a), g.to_host(b))

    c = NumpyOps()  # the ops contract's reference, in float32
    host = [qkv[:, : H * dh], qkv[:, H * dh : (H + Hk) * dh], qkv[:, (H + Hk) * dh :]]
    hq, hk, hv = (a.reshape(T, n, dh) for a, n in zip(host, (H, Hk, Hk)))
    kc, vc = np.zeros((NB, BS, Hk, dh), np.float32), np.zeros((NB, BS, Hk, dh), np.float32)
    ref_table = table if table_dtype == "f32" else bf16(table)
    ref = c.qk_rope_kv_write(hq, hk, hv, norms_host if norm else None, eps, pos, ref_table, kc, vc, slots)
    np.testing.assert_allclose(g.to_host(got), ref, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(g.to_host(caches[0]), kc, rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(g.to_host(caches[1]), vc)  # v: a copy


def test_qk_rope_kv_write_refuses_what_it_cannot_take(g):
    T, H, Hk, dh = 2, 4, 2, 64
    q, k, v = g.zeros((T, H, dh)), g.zeros((T, Hk, dh)), g.zeros((T, Hk, dh))
    kc, vc = g.zeros((2, 4, Hk, dh)), g.zeros((2, 4, Hk, dh))
    pos, slots, table = g.index(np.zeros(T, np.int32)), g.index(np.zeros(T, np.int32)), g.zeros((8, dh))
    with pytest.raises(ValueError, match="cos_sin's width must be even and in"):
        g.qk_rope_kv_write(q, k, v, None, 1e-6, pos, g.zeros((8, 3)), kc, vc, slots)
    with pytest.raises(ValueError, match=r"k and v must be \[2, 2, 64\]"):
        g.qk_rope_kv_write(q, g.zeros((T, 1, dh)), v, None, 1e-6, pos, table, kc, vc, slots)
    with pytest.raises(ValueError, match="q_norm has shape"):
        g.qk_rope_kv_write(q, k, v, (g.zeros((32,)), g.zeros((dh,))), 1e-6, pos, table, kc, vc, slots)


def unfused_route(g, logits, top_k, routing, bias, counts, expert_start, El):
    """Today's launches: router or router_grouped, count_experts, moe_permute."""
    from eprt.ops.base import GroupedRouting

    if isinstance(routing, GroupedRouting):
        weights, ids = g.router_grouped(logits, bias, top_k, routing)
    else:
        weights, ids = g.router(logits, top_k, routing)
    g.count_experts(ids, counts)
    return weights, ids, g._permute(ids, expert_start, El)


ROUTINGS = {
    "softmax": True,
    "softmax-raw": False,
    "deepseek_v3": ("sigmoid", 4, 2, "top2_sum", True, 2.5),
    "deepseek_v2": ("softmax", 4, 3, "max", False, 1.0),
}


@pytest.mark.parametrize("T", [1, 5, 40])
@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_route_is_the_unfused_launches_bit_for_bit(g, T, name):
    import cupy

    from eprt.ops.base import GroupedRouting
    from eprt.ops.numpy_ops import expert_permutation

    rng = np.random.default_rng(T)
    E, top_k, expert_start, El = 32, 4, 8, 12  # this rank: experts [8, 20)
    routing = ROUTINGS[name] if isinstance(ROUTINGS[name], bool) else GroupedRouting(*ROUTINGS[name])
    logits = bf16(rng.standard_normal((T, E)))
    logits[0, 3] = logits[0, 5]  # a tie: the lower id wins in both
    bias = cupy.asarray((0.1 * rng.standard_normal(E)).astype(np.float32))
    dl = g.activation(logits)
    counts = [cupy.asarray(np.arange(E, dtype=np.int32)) for _ in range(2)]
    got = g.route(dl, top_k, routing, bias, counts[0], (expert_start, El))
    want = unfused_route(g, dl, top_k, routing, bias, counts[1], expert_start, El)
    for a, b in zip(got[:2], want[:2]):
        np.testing.assert_array_equal(g.to_host(a), g.to_host(b))
    np.testing.assert_array_equal(g.to_host(counts[0]), g.to_host(counts[1]))
    ref = expert_permutation(g.to_host(got[1]), expert_start, El)
    P = int(ref.offsets[-1])
    for perm in (got[2], want[2]):
        np.testing.assert_array_equal(g.to_host(perm.offsets), ref.offsets)
        np.testing.assert_array_equal(g.to_host(perm.sorted_slot)[:P], ref.sorted_slot)
        np.testing.assert_array_equal(g.to_host(perm.slot_pos), ref.slot_pos)


def test_route_without_counts_or_local_experts(g):
    rng = np.random.default_rng(3)
    logits = g.activation(bf16(rng.standard_normal((3, 16))))
    w, ids, perm = g.route(logits, 2, True, None, None, None)  # no permutation asked: moe_experts permutes
    assert perm is None and ids.shape == (3, 2)
    w2, ids2, perm2 = g.route(logits, 2, True, None, None, (0, 16))
    np.testing.assert_array_equal(g.to_host(ids), g.to_host(ids2))
    assert int(g.to_host(perm2.offsets)[-1]) == 6
    with pytest.raises(ValueError, match="top_k must be in"):
        g.route(logits, 0, True, None, None, (0, 16))


@pytest.mark.parametrize("T", [1, 3, 8, 9])
def test_gate_up_silu_is_silu_and_mul_of_the_product(g, T):
    """Up to DENSE_FUSED_MAX_ROWS rows one launch (dense_gate_up_silu), beyond it the product and
    silu_and_mul. The fused kernel rounds g and up to bf16 as the product's output is rounded, so it
    differs from the two launches only by the f32 dot products' summation order (cuBLAS's own is
    unspecified): at most one bf16 step of an element here, and against NumPy the ops' tolerance."""
    rng = np.random.default_rng(T)
    D, I = 192, 136
    x, w = bf16(rng.standard_normal((T, D))), bf16(rng.standard_normal((2 * I, D)) / np.sqrt(D))
    got = g.to_host(g.gate_up_silu(g.activation(x), g.weight(w)))
    want = g.to_host(g.silu_and_mul(g.linear(g.activation(x), g.weight(w))))
    step = np.abs(want) * 2.0**-7 + 1e-30  # one bf16 step at want's magnitude (and under)
    assert np.all(np.abs(got - want) <= step), np.max(np.abs(got - want) / step)
    assert np.mean(got == want) > 0.95
    np.testing.assert_allclose(got, NumpyOps().gate_up_silu(x, w), rtol=2e-2, atol=2e-2)


def test_gate_up_silu_refuses_an_odd_weight(g):
    x = g.zeros((1, 64))
    with pytest.raises(ValueError, match=r"w must be \[2I, D\]"):
        g.gate_up_silu(x, g.zeros((7, 64)))
    with pytest.raises(ValueError, match="x has shape"):
        g.gate_up_silu(g.zeros((1, 32)), g.zeros((8, 64)))


def assert_within_one_bf16_step(got, want):
    """A product computed on CUDA cores instead of cuBLAS: the f32 sums' order differs (cuBLAS's own is
    unspecified), so an element may round to the neighbouring bf16 value, no further; most do not."""
    step = np.abs(want) * 2.0**-7 + 1e-30  # one bf16 step at want's magnitude (and under)
    assert np.all(np.abs(got - want) <= step), np.max(np.abs(got - want) / step)
    assert np.mean(got == want) > 0.9


@pytest.mark.parametrize("T,Qr,N", [(1, 48, 24), (3, 384, 96), (8, 1536, 70), (9, 64, 32)])
def test_rms_norm_linear_is_the_norm_then_the_product(g, T, Qr, N):
    """Up to MLA_FUSED_MAX_ROWS rows one launch (rms_norm_linear) reading x as a column slice of a wider
    product (MLA's q_a | kv_a); beyond it rms_norm then cuBLAS, bit for bit. The normed rows are
    rms_norm's bits (its block size and summation order), so the fused launch differs from the two only
    by the product's summation order: at most one bf16 step."""
    from eprt.ops.cupy_ops import MLA_FUSED_MAX_ROWS

    rng = np.random.default_rng(T * Qr + N)
    wide = bf16(rng.standard_normal((T, Qr + 40)) * 3)  # q_a | 40 more columns
    norm, w = bf16(1 + 0.2 * rng.standard_normal(Qr)), bf16(rng.standard_normal((N, Qr)) / np.sqrt(Qr))
    dwide, dn, dw = g.activation(wide), g.weight(norm), g.weight(w)
    got = g.to_host(g.rms_norm_linear(dwide[:, :Qr], dn, 1e-6, dw))
    want = g.to_host(g.linear(g.rms_norm(g.xp.ascontiguousarray(dwide[:, :Qr]), dn, 1e-6), dw))
    if T > MLA_FUSED_MAX_ROWS:
        np.testing.assert_array_equal(got, want)
    else:
        assert_within_one_bf16_step(got, want)
    ref = NumpyOps().rms_norm_linear(wide[:, :Qr], norm, 1e-6, w)
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=3e-2)


def test_rms_norm_linear_refuses_a_mismatched_norm(g):
    with pytest.raises(ValueError, match=r"rms_norm_linear: norm has shape \[32\], expected \[64\]"):
        g.rms_norm_linear(g.zeros((1, 64)), g.zeros((32,)), 1e-6, g.zeros((16, 64)))
    with pytest.raises(ValueError, match=r"rms_norm_linear: x has shape"):
        g.rms_norm_linear(g.zeros((1, 32)), g.zeros((64,)), 1e-6, g.zeros((16, 64)))


@pytest.mark.parametrize(
    "T,C,table_dtype,spaced",
    [(1, 64, "f32", True), (4, 512, "bf16", False), (3, 96, "bf16", True), (9, 32, "f32", True)],
)
def test_mla_prologue_is_the_unfused_ops(g, T, C, table_dtype, spaced):
    """The cache row and the roped query bit for bit; the absorbed query (w_uk's product) bit for bit
    beyond MLA_FUSED_MAX_ROWS rows (cuBLAS), up to them on CUDA cores inside the launch: one bf16 step.
    ``spaced``: compressed is a column slice of the q_a | kv_a product."""
    import cupy

    from eprt.ops.cupy_ops import MLA_FUSED_MAX_ROWS

    rng = np.random.default_rng(T * C)
    H, Dn, R, NB, BS = 4, 16, 8, 3, 4
    q = bf16(rng.standard_normal((T, H, Dn + R)))
    wide = bf16(rng.standard_normal((T, 24 + C + R)) * 2)  # [q_a (24) | compressed]
    compressed = wide[:, 24:]
    norm, w_uk = bf16(1 + 0.2 * rng.standard_normal(C)), bf16(rng.standard_normal((H, C, Dn)) / 4)
    pos = rng.integers(0, 30, T).astype(np.int32)
    slots = np.arange(T, dtype=np.int32) * 3 - (T > 2)  # the first row padding when T > 2
    slots[slots >= NB * BS] = -1
    table = cos_sin_table(32, R)
    dtable = cupy.asarray(table) if table_dtype == "f32" else g.activation(table)
    dq, dn, dw = g.activation(q), g.weight(norm), g.weight(w_uk)
    dc = g.activation(wide)[:, 24:] if spaced else g.activation(compressed)
    dpos, dslots = g.index(pos), g.index(slots)
    caches = [g.zeros((NB, BS, C + R)) for _ in range(2)]
    got = g.to_host(g.mla_prologue(dq, dc, dn, 1e-6, dpos, dtable, dw, caches[0], dslots))
    xp = g.xp  # today's ops, as the model ran them
    latent = g.rms_norm(xp.ascontiguousarray(dc[:, :C]), dn, 1e-6)
    k_rope = g.rope(xp.ascontiguousarray(dc[:, None, C:]), dpos, dtable)
    q_rope = g.rope(xp.ascontiguousarray(dq[:, :, Dn:]), dpos, dtable)
    q_latent = g.head_linear(xp.ascontiguousarray(dq[:, :, :Dn]), dw)
    g.latent_write(caches[1], xp.concatenate([latent, k_rope[:, 0]], axis=-1), dslots)
    want = g.to_host(xp.concatenate([q_latent, q_rope], axis=-1))
    np.testing.assert_array_equal(got[..., C:], want[..., C:])
    if T > MLA_FUSED_MAX_ROWS:
        np.testing.assert_array_equal(got, want)
    else:
        assert_within_one_bf16_step(got[..., :C], want[..., :C])
    np.testing.assert_array_equal(g.to_host(caches[0]), g.to_host(caches[1]))

    cache = np.zeros((NB, BS, C + R), np.float32)
    ref_table = table if table_dtype == "f32" else bf16(table)
    ref = NumpyOps().mla_prologue(q, compressed, norm, 1e-6, pos, ref_table, w_uk, cache, slots)
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(g.to_host(caches[0]), cache, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("P", [2, 3, 5])
def test_rank_sum_is_the_rank_ordered_adds_bit_for_bit(g, P):
    import cupy

    rng = np.random.default_rng(P)
    parts = (rng.standard_normal((P, 7, 40)) * 10.0 ** rng.integers(-3, 4, (P, 7, 40))).astype(np.float32)
    dparts = cupy.asarray(parts)
    want = dparts[0]
    for r in range(1, P):  # the device combine's P - 1 adds before rank_sum
        want = g.add(want, dparts[r])
    got = g.rank_sum(dparts)
    np.testing.assert_array_equal(g.to_host(got), g.to_host(want))
    np.testing.assert_array_equal(g.to_host(got), NumpyOps().rank_sum(parts))


@pytest.mark.parametrize("x_dtype", ["f32", "bf16"])
def test_add_rms_norm_with_extra_is_add_then_add_rms_norm_bit_for_bit(g, x_dtype):
    import cupy

    rng = np.random.default_rng(7)
    T, D = 3, 256
    x = rng.standard_normal((T, D)).astype(np.float32) * 3
    dx = cupy.asarray(x) if x_dtype == "f32" else g.activation(x)
    extra, residual, w = (g.activation(rng.standard_normal((T, D))) for _ in range(3))
    got = g.add_rms_norm(dx, residual, w[0], 1e-6, extra)
    want = g.add_rms_norm(g.add(dx, extra), residual, w[0], 1e-6)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(g.to_host(a), g.to_host(b))
    with pytest.raises(ValueError, match="extra has shape"):
        g.add_rms_norm(dx, residual, w[0], 1e-6, g.activation(np.zeros((T, 8))))


@pytest.mark.parametrize("split", ["off", "on"])
@pytest.mark.parametrize("lens", [[7], [1, 33, 200], [5] * 9])
def test_mla_attention_decode_with_w_uv_is_attention_then_head_linear(split, lens):
    """Up to MLA_FUSED_MAX_ROWS rows the value up-projection runs inside the attention launch (one pass)
    or the split combine (split): the attention output is rounded to bf16 as before, so only w_uv's
    product differs from head_linear's (cuBLAS), by one bf16 step at most; beyond them, bit for bit."""
    from test_cupy_ops import shuffled_tables

    from eprt.ops.cupy_ops import MLA_FUSED_MAX_ROWS, CupyOps

    g = CupyOps(decode_split=split, split_keys=128)
    rng = np.random.default_rng(len(lens))
    H, C, R, Dv, bs = 20, 32, 8, 24, 16
    nb, tables = shuffled_tables(rng, lens, bs, 2)
    cache, q = bf16(rng.standard_normal((nb, bs, C + R))), bf16(rng.standard_normal((len(lens), H, C + R)))
    w_uv, scale, lens = bf16(rng.standard_normal((H, Dv, C)) / 4), (C + R) ** -0.5, np.array(lens, np.int32)
    args = (g.activation(q), g.activation(cache), g.index(tables), g.index(lens), scale, C)
    got = g.to_host(g.mla_attention_decode(*args, g.weight(w_uv)))
    want = g.to_host(g.head_linear(g.mla_attention_decode(*args), g.weight(w_uv)))
    if len(lens) > MLA_FUSED_MAX_ROWS:
        np.testing.assert_array_equal(got, want)
    else:
        assert_within_one_bf16_step(got, want)
    ref = NumpyOps().mla_attention_decode(q, cache, tables, lens, scale, C, w_uv)
    np.testing.assert_allclose(got, ref, rtol=3e-2, atol=3e-2)
    # an identity up-projection is exact in any summation order: the fused launches' attention output
    # (their own heads per block) is the unfused one bit for bit
    eye = g.weight(np.broadcast_to(np.eye(C, dtype=np.float32), (H, C, C)).copy())
    np.testing.assert_array_equal(
        g.to_host(g.mla_attention_decode(*args, eye)), g.to_host(g.mla_attention_decode(*args))
    )
    with pytest.raises(
        ValueError, match=r"mla_attention_decode: w_uv has shape \[20, 24, 16\], expected \[20, \*, 32\]"
    ):
        g.mla_attention_decode(*args, g.weight(w_uv[:, :, :16]))


def test_mla_attention_verify_with_w_uv_is_verify_then_head_linear():
    """A verify step (2 sequences of 3 and 2 positions) takes the decode's fused launches: one bf16 step
    from verify + head_linear, and the NumPy reference's verify + head_linear within the ops' tolerance."""
    from test_cupy_ops import shuffled_tables

    from eprt.ops.cupy_ops import CupyOps

    g, rng = CupyOps(), np.random.default_rng(17)
    H, C, R, Dv, bs, query_lens = 6, 32, 8, 16, 8, np.array([3, 2])
    nb, seq_tables = shuffled_tables(rng, [20, 9], bs, 2)
    tables = np.repeat(seq_tables, query_lens, axis=0)  # [N, MB]: each row its sequence's table
    lens = np.array([18, 19, 20, 8, 9], np.int32)
    cache, q = bf16(rng.standard_normal((nb, bs, C + R))), bf16(rng.standard_normal((5, H, C + R)))
    w_uv, scale = bf16(rng.standard_normal((H, Dv, C)) / 4), (C + R) ** -0.5
    args = (g.activation(q), g.activation(cache), g.index(tables), g.index(lens), query_lens, scale, C)
    got = g.to_host(g.mla_attention_verify(*args, g.weight(w_uv)))
    want = g.to_host(g.head_linear(g.mla_attention_verify(*args), g.weight(w_uv)))
    assert_within_one_bf16_step(got, want)
    ref = NumpyOps().mla_attention_verify(q, cache, tables, lens, query_lens, scale, C, w_uv)
    np.testing.assert_allclose(got, ref, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("T,D", [(1, 64), (3, 520), (8, 2056), (9, 64)])
def test_add_rms_norm_gate_up_silu_is_the_unfused_ops_bit_for_bit(g, monkeypatch, T, D):
    """The post-attention add_rms_norm fused into dense_gate_up_silu: every block normalises the rows
    itself at add_rms_norm's block size and summation order (D 64: one warp of it; 520: 5 warps, more
    than the fused block's 4; 2056: its cap of 512 threads, 4 of them per fused thread), so the
    residual and h equal add_rms_norm then gate_up_silu bit for bit; 9 rows take those two launches."""
    rng = np.random.default_rng(T * D)
    I = 40
    x, res = bf16(rng.standard_normal((T, D)) * 3), bf16(rng.standard_normal((T, D)))
    norm, w = bf16(1 + 0.2 * rng.standard_normal(D)), bf16(rng.standard_normal((2 * I, D)) / np.sqrt(D))
    dx, dres, dnorm, dw = g.activation(x), g.activation(res), g.weight(norm), g.weight(w)
    names = launched(monkeypatch)
    h, s = g.add_rms_norm_gate_up_silu(dx, dres, dnorm, 1e-6, dw)
    assert names == (["dense_add_norm_gate_up_silu"] if T <= 8 else ["add_rms_norm_bf16", "silu_and_mul"])
    n, want_s = g.add_rms_norm(dx, dres, dnorm, 1e-6)
    np.testing.assert_array_equal(g.to_host(s), g.to_host(want_s))
    np.testing.assert_array_equal(g.to_host(h), g.to_host(g.gate_up_silu(n, dw)))
    ref_h, ref_s = NumpyOps().add_rms_norm_gate_up_silu(x, res, norm, 1e-6, w)
    np.testing.assert_allclose(g.to_host(s), ref_s, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(g.to_host(h), ref_h, rtol=5e-2, atol=5e-2)


def test_add_rms_norm_gate_up_silu_leaves_wide_rows_to_the_two_launches(g, monkeypatch):
    """Past NORM_FUSED_MAX_SMEM of normed rows per block (4 rows of DeepSeek-V3's 7168) the fused
    kernel would run too few blocks per SM to stream the weights: add_rms_norm and gate_up_silu."""
    from eprt.ops.cupy_ops import NORM_FUSED_MAX_SMEM

    D = 7168
    assert 128 + 2 * 3 * D <= NORM_FUSED_MAX_SMEM < 128 + 2 * 4 * D
    x, w = g.activation(np.ones((4, D), np.float32)), g.zeros((16, D))
    for T, kernels in ((3, ["dense_add_norm_gate_up_silu"]), (4, ["add_rms_norm_bf16", "dense_gate_up_silu"])):
        names = launched(monkeypatch)
        g.add_rms_norm_gate_up_silu(x[:T], x[:T], x[0], 1e-6, w)
        assert names == kernels
        monkeypatch.undo()


def test_add_rms_norm_gate_up_silu_refuses_what_it_cannot_take(g):
    x = g.zeros((1, 64))
    with pytest.raises(ValueError, match=r"w_gate_up has shape \[16, 32\], expected \[2I, 64\]"):
        g.add_rms_norm_gate_up_silu(x, x, g.zeros((64,)), 1e-6, g.zeros((16, 32)))
    with pytest.raises(ValueError, match=r"weight has shape \[8\]"):
        g.add_rms_norm_gate_up_silu(x, x, g.zeros((8,)), 1e-6, g.zeros((16, 64)))
    with pytest.raises(ValueError, match="x has shape"):
        g.add_rms_norm_gate_up_silu(g.zeros((1, 32)), x, g.zeros((64,)), 1e-6, g.zeros((16, 64)))


def moe_case(g, T: int, El: int, k: int, D: int, I: int, Is: int, seed: int):
    """Random routed and shared expert weights (host and device) and a routing of T rows."""
    rng = np.random.default_rng(seed)
    x = bf16(rng.standard_normal((T, D)))
    wgu, wd = bf16(rng.standard_normal((El, 2 * I, D)) / np.sqrt(D)), bf16(rng.standard_normal((El, D, I)) / np.sqrt(I))
    sgu, sd = bf16(rng.standard_normal((2 * Is, D)) / np.sqrt(D)), bf16(rng.standard_normal((D, Is)) / np.sqrt(Is))
    ids = np.stack([rng.choice(El + 2, k, replace=False) for _ in range(T)]).astype(np.int32)  # some not local
    weights = rng.random((T, k)).astype(np.float32)
    host = (x, weights, ids, wgu, wd, 0, None, sgu, sd)
    dev = (g.activation(x), g.xp.asarray(weights), g.index(ids), g.weight(wgu), g.weight(wd), 0, None)
    return host, (*dev, g.weight(sgu), g.weight(sd))


@pytest.mark.parametrize("T,Is", [(1, 48), (3, 96), (8, 48), (9, 48)])
def test_moe_experts_shared_runs_the_shared_expert_in_the_experts_launches(g, monkeypatch, T, Is):
    """The routed output equals moe_experts bit for bit; the shared expert's h is dense_gate_up_silu's
    arithmetic, its down product on CUDA cores instead of cuBLAS: the f32 sums' order differs, at most
    one bf16 step of an element (Is 96: DeepSeek-V2's 2 shared experts, one MLP of twice I); 9 rows take
    the unfused launches."""
    host, dev = moe_case(g, T, El=16, k=3, D=64, I=48, Is=Is, seed=T * Is)  # grouped: T * k < 4 * El
    names = launched(monkeypatch)
    out, s = g.moe_experts_shared(*dev)
    experts = ["moe_permute", "moe_gate_up_silu", "moe_down", "moe_combine"]
    assert names == (experts if T <= 8 else [*experts, "silu_and_mul"]), names
    np.testing.assert_array_equal(g.to_host(out), g.to_host(g.moe_experts(*dev[:7])))
    want = g.to_host(g.linear(g.gate_up_silu(dev[0], dev[7]), dev[8]))
    got = g.to_host(s)
    step = np.abs(want) * 2.0**-7 + 1e-30  # one bf16 step at want's magnitude (and under)
    assert np.all(np.abs(got - want) <= step), np.max(np.abs(got - want) / step)
    assert np.mean(got == want) > 0.9
    ref_out, ref_s = NumpyOps().moe_experts_shared(*host)
    np.testing.assert_allclose(g.to_host(out), ref_out, rtol=5e-2, atol=5e-2)
    np.testing.assert_allclose(got, ref_s, rtol=5e-2, atol=5e-2)


def test_moe_experts_shared_on_tensor_cores_takes_the_separate_launches(g, monkeypatch):
    """From TC_MIN_SLOTS_PER_EXPERT slots per local expert the experts run on tensor cores: the shared
    expert then keeps its own launches, the bits of the unfused ops."""
    _, dev = moe_case(g, 8, El=4, k=3, D=64, I=48, Is=48, seed=5)  # 24 slots >= 4 * 4
    names = launched(monkeypatch)
    out, s = g.moe_experts_shared(*dev)
    assert names == ["moe_permute", "moe_tc_gate_up", "moe_tc_down", "moe_combine", "dense_gate_up_silu"], names
    np.testing.assert_array_equal(g.to_host(out), g.to_host(g.moe_experts(*dev[:7])))
    np.testing.assert_array_equal(g.to_host(s), g.to_host(g.linear(g.gate_up_silu(dev[0], dev[7]), dev[8])))


def test_moe_experts_shared_refuses_an_odd_shared_expert(g):
    _, dev = moe_case(g, 2, El=4, k=2, D=64, I=16, Is=16, seed=1)
    with pytest.raises(ValueError, match=r"shared_down has shape \[64, 24\], expected \[64, 16\]"):
        g.moe_experts_shared(*dev[:7], dev[7], g.zeros((64, 24)))
    with pytest.raises(ValueError, match=r"shared_gate_up must be \[2Is, 64\], Is a multiple of 8, got \[24, 64\]"):
        g.moe_experts_shared(*dev[:7], g.zeros((24, 64)), g.zeros((64, 12)))
