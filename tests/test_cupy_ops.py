"""The CuPy backend against the NumPy reference, op by op.

GPU tests (marked ``gpu``) skip cleanly when CuPy cannot use a CUDA device. Inputs are
rounded to bfloat16 on the host first and the reference runs on exactly those values, so
each tolerance below measures only the kernel's own error: bf16 storage of the output
(relative step 2^-8 ~ 4e-3) plus fp32 accumulation order. Tolerances (rtol, atol):
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from eprt.ops import device
from eprt.ops.numpy_ops import NumpyOps

TOL = {
    "rms_norm": (1e-2, 1e-2),  # one bf16 rounding of a ~unit value
    "linear": (2e-2, 2e-2),  # bf16 output, fp32 accumulation over K
    "rope": (1e-2, 1e-2),
    "attention": (2e-2, 2e-2),  # softmax in fp32, bf16 output
    "router": (1e-4, 1e-6),  # fp32 end to end (ids must match exactly)
    "silu_and_mul": (1e-2, 1e-2),
    "moe": (3e-2, 3e-2),  # relative to the output's scale: h is stored as bf16
}

gpu = pytest.mark.skipif(not device.cuda_usable(), reason="CuPy cannot use a CUDA device here")


# ---- host-side pieces of the GPU backend (run everywhere) ------------------------------
def test_local_rank_from_each_launcher():
    assert device.local_rank({}) is None
    assert device.local_rank({"OMPI_COMM_WORLD_LOCAL_RANK": "3"}) == 3
    assert device.local_rank({"MPI_LOCALRANKID": "1"}) == 1
    assert device.local_rank({"SLURM_LOCALID": "2"}) == 2
    assert device.local_rank({"MV2_COMM_WORLD_LOCAL_RANK": "5"}) == 5
    # Open MPI's variable wins over Slurm's when mpirun runs inside an allocation
    assert device.local_rank({"SLURM_LOCALID": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "7"}) == 7
    with pytest.raises(ValueError, match="MPI_LOCALRANKID"):
        device.local_rank({"MPI_LOCALRANKID": "x"})


def test_pool_blocks_counts_what_is_already_used():
    gib = 1 << 30
    # 80 GiB card, 30 GiB taken by weights, 90% utilization -> 42 GiB for KV
    assert device.pool_blocks(50 * gib, 80 * gib, gib, 0.9) == 42
    with pytest.raises(RuntimeError, match="no room for a KV pool"):
        device.pool_blocks(5 * gib, 80 * gib, gib, 0.9)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        device.pool_blocks(50 * gib, 80 * gib, gib, 1.5)
    # two ranks on one GPU, both measured after both loaded their weights: 42 GiB between them
    assert device.pool_blocks(50 * gib, 80 * gib, gib, 0.9, sharers=2) == 21
    with pytest.raises(RuntimeError, match="for 3 ranks"):
        device.pool_blocks(10 * gib, 80 * gib, 4 * gib, 0.9, sharers=3)


def test_compute_identity_ends_with_an_arithmetic_fingerprint():
    ops = NumpyOps()
    what, where = device.compute_identity(ops)
    assert what.startswith("cpu: NumPy") and what == device.compute_identity(NumpyOps())[0]
    # arithmetic that differs in the last bit of one product changes the identity
    real = ops.linear
    ops.linear = lambda x, w, bias=None: np.nextafter(real(x, w, bias), np.inf)
    assert device.compute_identity(ops)[0] != what


def test_backend_choice(monkeypatch):
    monkeypatch.setenv("EPRT_DEVICE", "cpu")
    assert isinstance(device.get_ops(None), NumpyOps)
    assert device.resolve_device("auto") == ("cuda" if device.cuda_usable() else "cpu")
    monkeypatch.setenv("EPRT_DEVICE", "tpu")
    with pytest.raises(ValueError, match="EPRT_DEVICE"):
        device.get_ops(None)
    usable, why = device.cuda_status()
    assert device.device_choice("auto") == ("cuda" if usable else "cpu", f"auto: {why}")
    if not usable:
        with pytest.raises(ValueError, match=f"--device cuda was asked for, but {re.escape(why)}"):
            device.get_ops("cuda")


def test_staging_passes_host_data_through():
    from eprt.comm.cuda_staging import Staging

    host = np.arange(4, dtype=np.float32)
    assert Staging().send_buffer(host) is host


def test_bf16_rounding_is_round_to_nearest_even():
    ops_mod = pytest.importorskip("eprt.ops.cupy_ops")
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -2.5, np.inf, 3.4e38, np.nan], np.float32)
    bits = ops_mod.f32_to_bf16_bits(x)
    assert bits[:6].tolist() == [0x3F80, 0x3F80, 0x3F82, 0xC020, 0x7F80, 0x7F80]
    assert np.isnan(ops_mod.bf16_bits_to_f32(bits)[6])


# ---- helpers for the GPU tests ----------------------------------------------------------
def bf16(a) -> np.ndarray:
    """Round to bfloat16 and back: the values the GPU will actually hold."""
    from eprt.ops.bf16 import bf16_bits_to_f32, f32_to_bf16_bits

    return bf16_bits_to_f32(f32_to_bf16_bits(np.asarray(a, np.float32)))


def close(got, want, op: str, scale: float = 1.0):
    rtol, atol = TOL[op]
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * scale, err_msg=op)


@pytest.fixture(scope="module")
def ops():
    from eprt.ops.cupy_ops import CupyOps

    return CupyOps(), NumpyOps()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def shuffled_tables(rng, lens, bs, spare_blocks):
    """(pool blocks NB, block tables [B, MB]) for sequences of the given lengths in shuffled blocks."""
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + spare_blocks
    order = rng.permutation(nb)
    tables = np.zeros((len(lens), max(need)), np.int32)
    start = 0
    for b, n in enumerate(need):
        tables[b, :n] = order[start : start + n]
        start += n
    return nb, tables


def paged_kv(rng, lens, bs, hk, dh, spare_blocks=3):
    """Caches [NB, BS, Hk, Dh] holding sequences of the given lengths in shuffled blocks."""
    nb, tables = shuffled_tables(rng, lens, bs, spare_blocks)
    k = bf16(rng.standard_normal((nb, bs, hk, dh)))
    v = bf16(rng.standard_normal((nb, bs, hk, dh)))
    return k, v, tables


# ---- the kernels ------------------------------------------------------------------------
@gpu
@pytest.mark.gpu
def test_every_kernel_compiles_with_nvrtc_on_this_device():
    from eprt.ops.kernel_loader import KERNELS, get_kernel

    for file, names in KERNELS.items():
        for name in names:
            assert get_kernel(file, name) is not None


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(7, 1000), (12, 128), (1, 4096)])
def test_rms_norm(ops, rng, shape):
    g, c = ops
    x, w = bf16(rng.standard_normal(shape)), bf16(1 + 0.1 * rng.standard_normal(shape[-1]))
    close(g.to_host(g.rms_norm(g.activation(x), g.weight(w), 1e-6)), c.rms_norm(x, w, 1e-6), "rms_norm")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", ["act", "f32"])
def test_add_rms_norm(ops, rng, x_dtype):
    import cupy

    g, c = ops
    x, r = rng.standard_normal((9, 768)).astype(np.float32), bf16(rng.standard_normal((9, 768)))
    w = bf16(1 + 0.1 * rng.standard_normal(768))
    x = bf16(x) if x_dtype == "act" else x
    xg = g.activation(x) if x_dtype == "act" else cupy.asarray(x)
    normed, s = g.add_rms_norm(xg, g.activation(r), g.weight(w), 1e-5)
    want_normed, want_s = c.add_rms_norm(x, r, w, 1e-5)
    close(g.to_host(s), want_s, "rms_norm")
    close(g.to_host(normed), want_normed, "rms_norm")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear(ops, rng, with_bias):
    g, c = ops
    x, w = bf16(rng.standard_normal((5, 256))), bf16(rng.standard_normal((384, 256)) / 16)
    b = bf16(rng.standard_normal(384)) if with_bias else None
    got = g.linear(g.activation(x), g.weight(w), None if b is None else g.weight(b))
    close(g.to_host(got), c.linear(x, w, b), "linear")


@gpu
@pytest.mark.gpu
def test_rope(ops, rng):
    g, c = ops
    x = bf16(rng.standard_normal((6, 4, 64)))
    pos = rng.integers(0, 100, 6).astype(np.int32)
    freqs = np.arange(100, dtype=np.float32)[:, None] * (1e4 ** (-np.arange(0, 64, 2) / 64))[None, :]
    cos_sin = bf16(np.concatenate([np.cos(freqs), np.sin(freqs)], axis=-1))
    got = g.rope(g.activation(x), g.index(pos), g.activation(cos_sin))
    close(g.to_host(got), c.rope(x, pos, cos_sin), "rope")


@gpu
@pytest.mark.gpu
def test_kv_write_is_an_exact_copy_and_skips_padding(ops, rng):
    g, c = ops
    kc, vc = np.zeros((4, 8, 2, 64), np.float32), np.zeros((4, 8, 2, 64), np.float32)
    k, v = bf16(rng.standard_normal((3, 2, 64))), bf16(rng.standard_normal((3, 2, 64)))
    slots = np.array([5, 17, -1], np.int32)
    kg, vg = g.zeros(kc.shape), g.zeros(vc.shape)
    g.kv_write(kg, vg, g.activation(k), g.activation(v), g.index(slots))
    c.kv_write(kc, vc, k[:2], v[:2], slots[:2])
    np.testing.assert_array_equal(g.to_host(kg), kc)
    np.testing.assert_array_equal(g.to_host(vg), vc)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("split", ["off", "on"])
@pytest.mark.parametrize("group,dh", [(1, 64), (4, 128), (6, 128), (16, 64), (8, 256), (16, 256)])
def test_attention_decode(rng, split, group, dh):
    from eprt.ops.cupy_ops import CupyOps

    # split "on" with 128-key partitions: 3 partitions, the short sequences' later ones empty
    g, c = CupyOps(decode_split=split, split_keys=128), NumpyOps()
    check_attention_decode(g, c, rng, lens=[1, 37, 300], bs=16, hk=2, group=group, dh=dh)  # 300: 3 chunks


def check_attention_decode(g, c, rng, lens, bs, hk, group, dh, spare_blocks=3):
    """attention_decode of backend g against c on random paged caches and queries."""
    kc, vc, tables = paged_kv(rng, lens, bs, hk, dh, spare_blocks)
    q = bf16(rng.standard_normal((len(lens), hk * group, dh)))
    cl = np.array(lens, np.int32)
    got = g.attention_decode(
        g.activation(q), g.activation(kc), g.activation(vc), g.index(tables), g.index(cl), dh**-0.5
    )
    close(g.to_host(got), c.attention_decode(q, kc, vc, tables, cl, dh**-0.5), "attention")


@gpu
@pytest.mark.gpu
def test_decode_partitions():
    from eprt.ops.cupy_ops import CupyOps

    auto, off = CupyOps(split_keys=512), CupyOps(decode_split="off")
    sm = auto.sm_count
    assert auto._decode_partitions(4, 4096) == (8, 512)  # batch 1, 4 KV heads: split
    assert auto._decode_partitions(2 * sm, 4096) == (1, 4096)  # enough blocks already
    assert off._decode_partitions(4, 4096) == (1, 4096)
    assert auto._decode_partitions(4, 300) == (1, 512)  # one partition holds it all
    parts, keys = auto._decode_partitions(4, 1 << 20)  # 1M keys: at most 256 partitions
    assert parts <= 256 and parts * keys >= 1 << 20 and keys % 128 == 0
    with pytest.raises(ValueError, match="split_keys"):
        CupyOps(split_keys=100)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("start_pos,T", [(0, 1), (0, 150), (40, 150), (290, 6)])
@pytest.mark.parametrize("split", ["off", "auto"])
def test_attention_prefill(rng, start_pos, T, split):
    from eprt.ops.cupy_ops import CupyOps

    # auto with 128-key partitions: a few rows over a long context go through split decode
    g, c = CupyOps(decode_split=split, split_keys=128), NumpyOps()
    hk, group, dh, bs = 2, 4, 128, 16
    kc, vc, tables = paged_kv(rng, [start_pos + T], bs, hk, dh)
    q = bf16(rng.standard_normal((T, hk * group, dh)))
    got = g.attention_prefill(
        g.activation(q), g.activation(kc), g.activation(vc), g.index(tables[0]), start_pos, dh**-0.5
    )
    close(g.to_host(got), c.attention_prefill(q, kc, vc, tables[0], start_pos, dh**-0.5), "attention")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("logit_dtype", ["act", "f32"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_router(ops, rng, logit_dtype, renormalize):
    import cupy

    g, c = ops
    logits = bf16(3 * rng.standard_normal((33, 64)))
    logits[5] = 0.25  # all tied: ids 0..k-1
    lg = g.activation(logits) if logit_dtype == "act" else cupy.asarray(logits)
    w, ids = g.router(lg, 8, renormalize)
    want_w, want_ids = c.router(logits, 8, renormalize)
    np.testing.assert_array_equal(g.to_host(ids), want_ids)
    close(g.to_host(w), want_w, "router")


@gpu
@pytest.mark.gpu
def test_silu_and_mul(ops, rng):
    g, c = ops
    x = bf16(3 * rng.standard_normal((7, 2 * 96)))
    close(g.to_host(g.silu_and_mul(g.activation(x))), c.silu_and_mul(x), "silu_and_mul")


@gpu
@pytest.mark.gpu
def test_clip_and_sigmoid_gate_add(ops, rng):
    import cupy

    g, c = ops
    x = bf16(4 * rng.standard_normal((5, 48)))
    x[2, 7], x[3, 0], x[4, 1] = np.nan, np.inf, -np.inf  # NaN stays NaN, as np.clip keeps it
    close(g.to_host(g.clip(g.activation(x), 1.5)), c.clip(x, 1.5), "silu_and_mul")  # bf16 tolerance
    out = rng.standard_normal((5, 48)).astype(np.float32)
    s, gate = bf16(rng.standard_normal((5, 48))), bf16(rng.standard_normal((5, 1)))
    got = g.sigmoid_gate_add(cupy.asarray(out), g.activation(s), g.activation(gate))
    close(g.to_host(got), c.sigmoid_gate_add(out, s, gate), "silu_and_mul")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["grouped", "gathered"])
@pytest.mark.parametrize("T", [1, 5, 40])
def test_moe_experts(rng, impl, T):
    import cupy

    from eprt.ops.cupy_ops import CupyOps

    g, c = CupyOps(moe_impl=impl), NumpyOps()
    E, El, start, k, D, I = 16, 8, 4, 4, 256, 128  # this rank owns global experts 4..11
    x = bf16(rng.standard_normal((T, D)))
    wgu = bf16(rng.standard_normal((El, 2 * I, D)) / 16)
    wd = bf16(rng.standard_normal((El, D, I)) / 11)
    w, ids = c.router(rng.standard_normal((T, E)).astype(np.float32), k, True)
    ids[0] = [0, 1, 12, 15]  # token 0: no local expert -> zero row
    args = (g.activation(x), cupy.asarray(w), g.index(ids), g.weight(wgu), g.weight(wd), start)
    got = g.to_host(g.moe_experts(*args))
    want = c.moe_experts(x, w, ids, wgu, wd, start)
    assert not got[0].any()
    close(got, want, "moe", scale=float(np.abs(want).max()))
    np.testing.assert_array_equal(g.to_host(g.moe_experts(*args)), got)  # reproducible bits


@gpu
@pytest.mark.gpu
def test_moe_experts_without_local_experts_is_zero(rng):
    import cupy

    from eprt.ops.cupy_ops import CupyOps

    g = CupyOps()
    w = cupy.asarray(np.full((3, 2), 0.5, np.float32))
    out = g.moe_experts(
        g.zeros((3, 16)), w, g.index(np.zeros((3, 2), np.int32)), g.zeros((0, 32, 16)), g.zeros((0, 16, 16)), 0
    )
    np.testing.assert_array_equal(g.to_host(out), np.zeros((3, 16), np.float32))


@gpu
@pytest.mark.gpu
def test_moe_experts_many_slots(rng):
    # a prefill-sized routing: 1100 tokens x top-8 = 8800 slots, placed by all 32 warps of
    # moe_permute (ranges of 275 slots: not whole rounds of 32), 20 of 64 experts local
    import cupy

    from eprt.ops.cupy_ops import CupyOps

    g, c = CupyOps(moe_impl="gathered"), NumpyOps()
    T, E, El, start, k, D, I = 1100, 64, 20, 30, 8, 8, 8
    x = bf16(rng.standard_normal((T, D)))
    wgu, wd = bf16(rng.standard_normal((El, 2 * I, D)) / 3), bf16(rng.standard_normal((El, D, I)) / 3)
    w, ids = c.router(rng.standard_normal((T, E)).astype(np.float32), k, True)
    got = g.to_host(g.moe_experts(g.activation(x), cupy.asarray(w), g.index(ids), g.weight(wgu), g.weight(wd), start))
    want = c.moe_experts(x, w, ids, wgu, wd, start)
    close(got, want, "moe", scale=float(np.abs(want).max()))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("logit_dtype", ["act", "f32"])
def test_argmax_first_maximum_wins(ops, rng, logit_dtype):
    import cupy

    g, c = ops
    logits = bf16(rng.standard_normal((3, 50000)))
    logits[1, [7, 900, 40000]] = 9.0  # tie: index 7 wins
    lg = g.activation(logits) if logit_dtype == "act" else cupy.asarray(logits)
    np.testing.assert_array_equal(g.argmax(lg), c.argmax(logits))
    assert g.argmax(lg)[1] == 7


@gpu
@pytest.mark.gpu
def test_count_experts_accumulates_exactly(ops, rng):
    g, c = ops
    ids = rng.integers(0, 12, size=(3000, 4)).astype(np.int32)  # [T, k], more ids than one block covers
    ids[5, 1] = 12  # outside [0, E): not counted
    want = np.full(12, 7, np.int32)  # counts accumulate onto what is there
    c.count_experts(ids, want)
    counts = g.index(np.full(12, 7, np.int32))
    g.count_experts(g.index(ids), counts)
    np.testing.assert_array_equal(g.to_host(counts), want)
    assert want.sum() == 12 * 7 + ids.size - 1


@gpu
@pytest.mark.gpu
def test_embedding_and_round_trip(ops, rng):
    g, c = ops
    table = bf16(rng.standard_normal((50, 32)))
    ids = np.array([3, 0, 49, 3], np.int32)
    np.testing.assert_array_equal(g.to_host(g.embedding(g.weight(table), g.index(ids))), c.embedding(table, ids))


@gpu
@pytest.mark.gpu
def test_bad_arguments_name_the_argument(ops):
    import cupy

    g, _ = ops
    x = g.zeros((4, 64))
    with pytest.raises(TypeError, match="rms_norm: weight must be bf16"):
        g.rms_norm(x, cupy.ones(64, cupy.float32), 1e-6)
    with pytest.raises(ValueError, match="linear: x must be C-contiguous"):
        g.linear(x.T, g.zeros((8, 4)))
    with pytest.raises(ValueError, match=r"linear: x has shape \[4, 64\], expected \[\*, 32\]"):
        g.linear(x, g.zeros((8, 32)))
    with pytest.raises(ValueError, match="query heads 6 must be a multiple of KV heads 4"):
        g.attention_decode(
            g.zeros((1, 6, 64)),
            g.zeros((2, 16, 4, 64)),
            g.zeros((2, 16, 4, 64)),
            g.zeros((1, 2), "i32"),
            g.zeros((1,), "i32"),
            0.125,
        )


@gpu
@pytest.mark.gpu
def test_staging_round_trip_through_pinned_memory():
    import cupy

    from eprt.comm.cuda_staging import Staging

    a = cupy.arange(12, dtype=cupy.float32).reshape(3, 4) * 1.5
    staged = Staging()
    host = staged.send_buffer(a)
    assert isinstance(host, np.ndarray)
    np.testing.assert_array_equal(host, cupy.asnumpy(a))
    np.testing.assert_array_equal(cupy.asnumpy(staged.to_device(host + 1)), cupy.asnumpy(a) + 1)
