"""The tensor-core kernels (kernels/moe_tc.cu, kernels/flash_attention.cu) against the NumPy
reference on ragged shapes: experts with no rows, one row, row counts and widths that are not
multiples of the tiles (64 rows, 64 / 128 columns, 32-wide K steps; 64-row query tiles, 32- and
64-key tiles), prompts crossing key tiles and KV blocks, chunked prefill (start_pos > 0), GQA
groups packed into the rows of a tile, and MLA's latent attention. Which kernel a call takes is
checked too, so a test cannot pass on the old CUDA-core path by accident.

GPU tests: skipped without a device, run on cusim in CI (mma.sync, ldmatrix and cp.async with the
PTX ISA's fragment layouts: tests/cusim/include/cusim_ptx.h). Tolerances: ``TOL`` of
test_cupy_ops.py (bf16 inputs and outputs, fp32 accumulation).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_cupy_ops import bf16, close, paged_kv
from test_cupy_ops_fp8 import fp8_weight

from eprt.model.safetensors_io import fp8_e4m3_to_f32
from eprt.ops import device
from eprt.ops.numpy_ops import NumpyOps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not device.cuda_usable(), reason="CuPy cannot use a CUDA device here"),
]


def launched(monkeypatch) -> list[str]:
    """The names of the kernels CupyOps launches from now on (its own, flash attention's, gpt-oss's)."""
    from eprt.ops import cupy_flash, cupy_gptoss, cupy_ops, kernel_loader

    names, real = [], kernel_loader.launch

    def launch(file, name, *args, **kwargs):
        names.append(name)
        return real(file, name, *args, **kwargs)

    monkeypatch.setattr(cupy_ops, "_launch", launch)
    for module in (cupy_flash, cupy_gptoss):
        monkeypatch.setattr(module, "launch", launch)
    return names


def routing(rng, T, E, k, counts=None):
    """(weights [T, k], ids [T, k]): random distinct experts per token, or, with ``counts`` (slots
    per global expert, summing to T * k), the experts in order dealt column by column."""
    if counts is None:
        ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    else:
        pool = np.concatenate([np.full(c, e, np.int32) for e, c in enumerate(counts)])
        assert pool.size == T * k
        ids = pool.reshape(k, T).T.copy()  # expert e's slots spread over distinct tokens
    return rng.uniform(0.1, 1, (T, k)).astype(np.float32), ids


# ---- grouped expert GEMM ------------------------------------------------------------------------
MOE_CASES = {
    # T, E, El, start, k, D, I, counts per global expert (None: random)
    "one row": (1, 4, 4, 0, 1, 64, 32, None),
    "empty groups and a 65-row tail": (70, 6, 4, 1, 2, 136, 72, [1, 65, 0, 0, 70, 4]),
    "K, N tails (D 200, I 40)": (33, 5, 5, 0, 3, 200, 40, None),
    "no local expert chosen": (9, 8, 2, 6, 2, 64, 32, [9, 9, 0, 0, 0, 0, 0, 0]),
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_tc_against_numpy(monkeypatch, case):
    import cupy

    from eprt.ops.cupy_ops import CupyOps

    T, E, El, start, k, D, I, counts = MOE_CASES[case]
    rng = np.random.default_rng(len(case))
    g, c = CupyOps(moe_impl="tc"), NumpyOps()
    x = bf16(rng.standard_normal((T, D)))
    wgu, wd = bf16(rng.standard_normal((El, 2 * I, D)) / D**0.5), bf16(rng.standard_normal((El, D, I)) / I**0.5)
    w, ids = routing(rng, T, E, k, counts)
    names = launched(monkeypatch)
    args = (g.activation(x), cupy.asarray(w), g.index(ids), g.weight(wgu), g.weight(wd), start)
    got = g.to_host(g.moe_experts(*args))
    assert {"moe_tc_gate_up", "moe_tc_down"} <= set(names)
    want = c.moe_experts(x, w, ids, wgu, wd, start)
    close(got, want, "moe", scale=float(np.abs(want).max()) or 1.0)
    np.testing.assert_array_equal(g.to_host(g.moe_experts(*args)), got)  # reproducible bits


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_tc_swiglu_with_biases_against_numpy(monkeypatch, case):
    """gpt-oss's bf16 experts on the tensor-core tiles: biases, the clamped SwiGLU (limit 0.5: both
    clamps reached), expert_start > 0 and experts with no rows as in test_moe_tc_against_numpy."""
    import cupy

    from eprt.ops.cupy_ops import CupyOps

    T, E, El, start, k, D, I, counts = MOE_CASES[case]
    rng = np.random.default_rng(len(case) + 1)
    g, c = CupyOps(moe_impl="tc"), NumpyOps()
    x = bf16(rng.standard_normal((T, D)))
    gu, down = bf16(rng.standard_normal((El, 2 * I, D)) / D**0.5), bf16(rng.standard_normal((El, D, I)) / I**0.5)
    b_gu, b_d = (rng.standard_normal(shape).astype(np.float32) * 0.3 for shape in ((El, 2 * I), (El, D)))
    w, ids = routing(rng, T, E, k, counts)
    names = launched(monkeypatch)
    act = (cupy.asarray(b_gu), cupy.asarray(b_d), start, 1.702, 0.5)
    args = (g.activation(x), cupy.asarray(w), g.index(ids), *g.swiglu_expert_weights(gu, down), *act)
    got = g.to_host(g.moe_experts_swiglu(*args))
    assert names == ["moe_permute", "moe_tc_gate_up_swiglu", "moe_tc_down_bias", "moe_combine"]
    want = c.moe_experts_swiglu(x, w, ids, *c.swiglu_expert_weights(gu, down), b_gu, b_d, start, 1.702, 0.5)
    close(got, want, "moe", scale=float(np.abs(want).max()) or 1.0)
    names.clear()
    auto = CupyOps().moe_experts_swiglu(*args)  # auto: the same choice as moe_experts (_moe_choice)
    assert ("moe_tc_down_bias" in names) == (T * k >= 4 * El)
    close(g.to_host(auto), want, "moe", scale=float(np.abs(want).max()) or 1.0)


@pytest.mark.parametrize("block", [(128, 128), (24, 32)])
def test_moe_tc_fp8_against_numpy(monkeypatch, block):
    import cupy

    from eprt.ops.cupy_ops import CupyOps

    rng = np.random.default_rng(block[0])
    T, E, El, start, k, D, I = 40, 5, 3, 1, 2, 208, 48  # D: 6.5 K steps of 32; I: 48 units of a 64-unit tile
    g, c = CupyOps(moe_impl="tc"), NumpyOps()
    raw_gu, s_gu, w_gu = fp8_weight(rng, (El,), 2 * I, D, block, parts=2)
    raw_d, s_d, w_d = fp8_weight(rng, (El,), D, I, block)
    x = bf16(rng.standard_normal((T, D)))
    w, ids = routing(rng, T, E, k)
    names = launched(monkeypatch)
    gu, dn = g.weight_fp8(raw_gu, s_gu, *block, I), g.weight_fp8(raw_d, s_d, *block, D)
    got = g.to_host(g.moe_experts(g.activation(x), cupy.asarray(w), g.index(ids), gu, dn, start))
    assert {"moe_tc_gate_up_fp8", "moe_tc_down_fp8"} <= set(names)
    want = c.moe_experts(x, w, ids, w_gu, w_d, start)
    close(got, want, "moe", scale=float(np.abs(want).max()))


# ---- W8A8: FP8 activations on the FP8 tensor cores (opt-in, sm_89+) --------------------------------
E4M3 = fp8_e4m3_to_f32(np.arange(127, dtype=np.uint8))  # the non-negative finite codes, increasing


def e4m3_round(a: np.ndarray) -> np.ndarray:
    """float32 onto e4m3 values, round to nearest even, saturating at 448 (the device's conversion)."""
    mag = np.minimum(np.abs(a), np.float32(448))
    i = np.clip(np.searchsorted(E4M3, mag), 1, 126)
    lo, hi = E4M3[i - 1], E4M3[i]
    up = (hi - mag < mag - lo) | ((hi - mag == mag - lo) & (i % 2 == 0))  # a tie goes to the even code
    return np.sign(a) * np.where(up, hi, lo)


def quantized(a: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 values [R, K], scales [R, groups]): per row and group, s = max |a| / 448 (1 when 0)."""
    R, K = a.shape
    a = a.astype(np.float32)
    s = np.stack([np.abs(a[:, c : c + group]).max(axis=1) for c in range(0, K, group)], 1) / np.float32(448)
    s = np.where(s > 0, s, np.float32(1)).astype(np.float32)
    return e4m3_round(a / np.repeat(s, group, axis=1)[:, :K]), s


def w8a8_reference(x, weights, ids, w_gu, w_d, start, group):
    """moe_experts with each projection's input quantized as the device does (h rounded to bf16 first)."""
    q, s = quantized(x, group)
    xd = q * np.repeat(s, group, axis=1)[:, : x.shape[1]]
    out = np.zeros(x.shape, np.float64)
    I = w_d.shape[2]
    for t, j in zip(*np.nonzero((ids >= start) & (ids < start + w_d.shape[0]))):
        e = ids[t, j] - start
        gu = w_gu[e].astype(np.float64) @ xd[t]
        h = bf16(gu[:I] / (1 + np.exp(-gu[:I])) * gu[I:])[None]
        hq, hs = quantized(h, group)
        out[t] += weights[t, j] * (w_d[e].astype(np.float64) @ (hq * np.repeat(hs, group, axis=1)[:, :I])[0])
    return out


@pytest.mark.parametrize("block", [(128, 128), (16, 32)])
def test_moe_w8a8_against_a_quantized_reference(monkeypatch, block):
    import cupy

    from eprt.ops.cupy_ops import CupyOps

    rng = np.random.default_rng(block[1])
    T, E, El, start, k, D, I = 40, 5, 3, 1, 2, 256, 96  # down's K = 96: one partial K block of 128
    g, c = CupyOps(moe_impl="tc", fp8_mma="on"), NumpyOps()
    raw_gu, s_gu, w_gu = fp8_weight(rng, (El,), 2 * I, D, block, parts=2)
    raw_d, s_d, w_d = fp8_weight(rng, (El,), D, I, block)
    x = bf16(rng.standard_normal((T, D)) / 32)  # gate values of a few units (the weights reach +-7)
    w, ids = routing(rng, T, E, k)
    names = launched(monkeypatch)
    gu, dn = g.weight_fp8(raw_gu, s_gu, *block, I), g.weight_fp8(raw_d, s_d, *block, D)
    got = g.to_host(g.moe_experts(g.activation(x), cupy.asarray(w), g.index(ids), gu, dn, start))
    assert {"fp8_quantize_rows", "moe_tc_gate_up_w8a8", "moe_tc_down_w8a8"} <= set(names)
    want = w8a8_reference(x, w, ids, w_gu, w_d, start, block[1])
    close(got, want, "moe", scale=float(np.abs(want).max()))
    exact = c.moe_experts(x, w, ids, w_gu, w_d, start)  # no activation quantization: ~3% of the scale apart
    assert np.abs(got - exact).max() < 0.1 * np.abs(exact).max()


def test_fp8_quantize_rows_rounds_as_documented():
    from eprt.ops.cupy_ops import CupyOps

    g = CupyOps()
    x = bf16(np.random.default_rng(9).standard_normal((5, 200)) * np.array([[1e-3], [1], [30], [0], [500]]))
    q, s = g._quantize_rows(g.activation(x), 64)  # 200 columns: groups of 64, 64, 64, 8
    want_q, want_s = quantized(x, 64)
    np.testing.assert_array_equal(g.to_host(s), want_s)
    np.testing.assert_array_equal(fp8_e4m3_to_f32(g.to_host(q)), want_q)


def test_w8a8_is_opt_in_and_needs_sm_89(monkeypatch):
    from eprt.ops import cupy_ops

    assert not cupy_ops.CupyOps().fp8_mma and cupy_ops.CupyOps(fp8_mma="on").fp8_mma  # cusim: sm_90
    with pytest.raises(ValueError, match="fp8_mma must be one of"):
        cupy_ops.CupyOps(fp8_mma="yes")
    rt = cupy_ops.cupy.cuda.runtime
    monkeypatch.setattr(rt, "deviceGetAttribute", lambda attr, dev: {75: 8, 76: 0}.get(attr, 132))  # an A100
    assert not cupy_ops.CupyOps(fp8_mma="on").fp8_mma


def test_moe_auto_takes_tensor_cores_by_shape():
    from eprt.ops.cupy_ops import CupyOps, Fp8Weight

    auto, w = CupyOps(), np.zeros((8, 64, 32))  # 8 local experts: shape only
    assert auto._moe_choice(31, w) == "grouped"  # decode: a few rows per expert, weight-bandwidth bound
    assert auto._moe_choice(32, w) == "tc"  # 4 slots per local expert
    odd = Fp8Weight(np.zeros((8, 64, 32), np.uint8), None, 128, 16, 32)  # block_k 16: not a whole K step
    assert auto._moe_choice(4096, odd) == "grouped" and CupyOps(moe_impl="tc")._moe_choice(4096, odd) == "grouped"
    assert CupyOps(moe_impl="gathered")._moe_choice(4096, w) == "gathered"


# ---- flash attention over the paged cache ---------------------------------------------------
GQA_CASES = {
    # Hk, G, Dh, BS, start_pos, T
    "G 1: one row tile of 16 rows": (1, 1, 16, 16, 0, 16),
    "150 keys over 3 key tiles, 600 rows, 10 row tiles": (2, 4, 128, 16, 0, 150),
    "G 3, Dh 72 (padded to 80), blocks of 5, chunk at 37": (2, 3, 72, 5, 37, 33),
    "Dh 256: 32-key tiles": (1, 8, 256, 16, 0, 40),
    "Dh 64, blocks of 3, chunk at 100": (2, 6, 64, 3, 100, 20),
}


@pytest.mark.parametrize("case", list(GQA_CASES))
def test_flash_attention_prefill_against_numpy(monkeypatch, case):
    from eprt.ops.cupy_ops import CupyOps

    hk, group, dh, bs, start, T = GQA_CASES[case]
    rng = np.random.default_rng(dh + T)
    g, c = CupyOps(decode_split="off"), NumpyOps()
    kc, vc, tables = paged_kv(rng, [start + T], bs, hk, dh, spare_blocks=2)
    q = bf16(rng.standard_normal((T, hk * group, dh)))
    names = launched(monkeypatch)
    got = g.attention_prefill(g.activation(q), g.activation(kc), g.activation(vc), g.index(tables[0]), start, dh**-0.5)
    assert names == [f"flash_attention_d{next(d for d in (64, 128, 256) if dh <= d)}"]
    close(g.to_host(got), c.attention_prefill(q, kc, vc, tables[0], start, dh**-0.5), "attention")


def test_flash_attention_sliding_window():
    # the kernel's window without sinks (attention_prefill has none): row t sees positions (qpos - 7, qpos]
    from eprt.ops.cupy_flash import flash_gqa
    from eprt.ops.cupy_ops import CupyOps

    rng = np.random.default_rng(7)
    hk, group, dh, bs, start, T, window = 2, 2, 32, 4, 30, 40, 7
    g = CupyOps(decode_split="off")
    kc, vc, tables = paged_kv(rng, [start + T], bs, hk, dh, spare_blocks=1)
    q = bf16(rng.standard_normal((T, hk * group, dh)))
    kg, vg = g.activation(kc), g.activation(vc)
    got = flash_gqa(g.activation(q), kg, vg, g.index(tables[0]), start, 0.2, g.smem_limit, window)
    pos = np.arange(start + T)
    keys = kc[tables[0][pos // bs], pos % bs]  # [P, Hk, Dh] in position order
    values = vc[tables[0][pos // bs], pos % bs]
    want = np.empty_like(q)
    for t in range(T):
        qpos = start + t
        seen = slice(max(0, qpos - window + 1), qpos + 1)
        for h in range(hk * group):
            s = keys[seen, h // group] @ q[t, h] * 0.2
            p = np.exp(s - s.max())
            want[t, h] = p @ values[seen, h // group] / p.sum()
    close(g.to_host(got), want, "attention")


SINK_CASES = {
    # Hk, G, Dh, BS, start_pos, T, window
    "gpt-oss's G 8 and Dh 64, window 16, chunk at 40 over blocks of 4": (2, 8, 64, 4, 40, 37, 16),
    "full layer (window 0), 9 tokens x G 2: 18 rows": (2, 2, 16, 4, 0, 9, 0),
    "window beyond the context, Dh 72 padded to 80": (1, 4, 72, 16, 5, 25, 128),
    "150-token prompt, window 8: 5 row tiles, each from its own first key": (2, 2, 32, 4, 0, 150, 8),
}


def windowed_kv(rng, end, bs, hk, dh, lo):
    """Caches and a windowed table for positions [0, end) (tests/cusim's pool): the blocks before
    lo's are ones the window has left, table entries 0 (as eprt/cache/window.py gives kernels), and
    block 0 holds NaN, so a kernel that reads one of them fails."""
    need = -(-end // bs)
    k, v = (bf16(rng.standard_normal((need + 1, bs, hk, dh))) for _ in range(2))
    k[0] = v[0] = np.nan
    table = (1 + rng.permutation(need)).astype(np.int32)
    table[: lo // bs] = 0
    return k, v, table


@pytest.mark.parametrize("case", list(SINK_CASES))
def test_flash_attention_with_sinks_and_a_window_against_numpy(monkeypatch, case):
    """gpt-oss's attention_sinks_prefill takes flash_attention from FLASH_MIN_ROWS rows: the sinks in the
    denominator (one head's sink above every score, one at -inf), keys before a window never read."""
    from eprt.ops.cupy_ops import CupyOps

    hk, group, dh, bs, start, T, window = SINK_CASES[case]
    rng = np.random.default_rng(dh + T + window)
    g, c = CupyOps(), NumpyOps()
    lo = max(0, start - window + 1) if window else 0
    kc, vc, table = windowed_kv(rng, start + T, bs, hk, dh, lo)
    q = bf16(rng.standard_normal((T, hk * group, dh)))
    sinks = (2 * rng.standard_normal(hk * group)).astype(np.float32)
    sinks[0], sinks[-1] = 40.0, -np.inf
    names = launched(monkeypatch)
    dev = [g.activation(a) for a in (q, kc, vc)]
    got = g.attention_sinks_prefill(*dev, g.index(table), start, dh**-0.5, g.xp.asarray(sinks), window)
    assert names == [f"flash_attention_d{next(d for d in (64, 128, 256) if dh <= d)}"]
    close(g.to_host(got), c.attention_sinks_prefill(q, kc, vc, table, start, dh**-0.5, sinks, window), "attention")
    few = g.attention_sinks_prefill(dev[0][:1], *dev[1:], g.index(table), start, dh**-0.5, g.xp.asarray(sinks), window)
    assert names[1:] == ["attention_sinks"] or group >= 16, "below FLASH_MIN_ROWS rows: one block per row"
    close(g.to_host(few), c.attention_sinks_prefill(q[:1], kc, vc, table, start, dh**-0.5, sinks, window), "attention")


MLA_CASES = {
    # H, C, R (L = C + R), BS, start_pos, T
    "tiny model's dims (L 40, C 32), 4 heads": (4, 32, 8, 16, 0, 20),
    "16 heads, C 64 split over two warps, chunk at 50": (16, 64, 8, 16, 50, 30),
    "C 128, L 144, blocks of 7, 9 rows of 8 heads": (8, 128, 16, 7, 3, 9),
}


@pytest.mark.parametrize("case", list(MLA_CASES))
def test_flash_mla_prefill_against_numpy(monkeypatch, case):
    from eprt.ops.cupy_ops import CupyOps

    H, C, R, bs, start, T = MLA_CASES[case]
    L = C + R
    rng = np.random.default_rng(L + T)
    g, c = CupyOps(decode_split="off"), NumpyOps()
    nb = -(-(start + T) // bs) + 2
    cache = bf16(rng.standard_normal((nb, bs, L)))
    table = rng.permutation(nb).astype(np.int32)
    q = bf16(rng.standard_normal((T, H, L)))
    names = launched(monkeypatch)
    got = g.mla_attention_prefill(g.activation(q), g.activation(cache), g.index(table), start, L**-0.5, C)
    assert names == ["flash_mla"]
    close(g.to_host(got), c.mla_attention_prefill(q, cache, table, start, L**-0.5, C), "attention")


def test_few_rows_over_a_long_context_keep_the_split_decode_path(monkeypatch):
    from eprt.ops.cupy_ops import CupyOps

    rng = np.random.default_rng(3)
    g = CupyOps(split_keys=128)  # auto: 4 rows x 2 KV heads cannot fill the GPU, 300 keys split in 3
    kc, vc, tables = paged_kv(rng, [300], 16, 2, 16, spare_blocks=1)
    q = bf16(rng.standard_normal((4, 16, 16)))
    names = launched(monkeypatch)
    g.attention_prefill(g.activation(q), g.activation(kc), g.activation(vc), g.index(tables[0]), 296, 0.25)
    assert names == ["attention_decode_split_g8", "attention_split_combine"]
