"""The CuPy ops of DeepSeek-class models against the NumPy reference: grouped routing, the
shared-expert add, per-head projections, and MLA over the paged latent cache (fixed cases,
then shapes drawn by hypothesis). GPU tests: skipped without a device, run on cusim in CI.
Inputs are rounded to bf16 first; tolerances are ``TOL`` of test_cupy_ops.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cupy_ops import bf16, close, shuffled_tables

from eprt.ops import device
from eprt.ops.base import GroupedRouting
from eprt.ops.numpy_ops import NumpyOps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not device.cuda_usable(), reason="CuPy cannot use a CUDA device here"),
]
SETTINGS = settings(max_examples=10, deadline=None, derandomize=True)


@pytest.fixture(scope="module")
def ops():
    from eprt.ops.cupy_ops import CupyOps

    return CupyOps(), NumpyOps()


def check_router_grouped(g, c, rng, T, E, top_k, routing, logit_dtype="f32", with_bias=True):
    import cupy

    logits = rng.standard_normal((T, E)).astype(np.float32)
    if logit_dtype == "act":
        logits = bf16(logits)
    bias = (0.1 * rng.standard_normal(E)).astype(np.float32) if with_bias else None
    lg = g.activation(logits) if logit_dtype == "act" else cupy.asarray(logits)
    w, ids = g.router_grouped(lg, None if bias is None else cupy.asarray(bias), top_k, routing)
    want_w, want_ids = c.router_grouped(logits, bias, top_k, routing)
    np.testing.assert_array_equal(g.to_host(ids), want_ids)
    close(g.to_host(w), want_w, "router")


# deepseek_v3 / glm4_moe (sigmoid, top2_sum, bias), deepseek_v2 (softmax, max), ungrouped
ROUTINGS = {
    "v3": GroupedRouting("sigmoid", 4, 2, "top2_sum", True, 2.5),
    "v2": GroupedRouting("softmax", 8, 3, "max", False, 16.0),
    "ungrouped": GroupedRouting("sigmoid", 1, 1, "max", True, 1.0),
}


@pytest.mark.parametrize("name", sorted(ROUTINGS))
@pytest.mark.parametrize("logit_dtype", ["act", "f32"])
def test_router_grouped(ops, name, logit_dtype):
    g, c = ops
    check_router_grouped(g, c, np.random.default_rng(7), 9, 64, 6, ROUTINGS[name], logit_dtype, name != "v2")


def test_router_grouped_takes_excluded_experts_last_in_id_order(ops):
    """top_k beyond the kept groups' experts: the rest are excluded ones, lowest id first (as NumPy)."""
    g, c = ops
    check_router_grouped(g, c, np.random.default_rng(3), 5, 16, 10, GroupedRouting("sigmoid", 4, 2, "max", True, 1.0))


@pytest.mark.parametrize("dtypes", [("f32", "act"), ("act", "act"), ("f32", "f32"), ("act", "f32")])
def test_add(ops, dtypes):
    import cupy

    g, c = ops
    rng = np.random.default_rng(5)
    up = lambda a, d: g.activation(a) if d == "act" else cupy.asarray(a)  # noqa: E731
    x, y = bf16(rng.standard_normal((7, 40))), bf16(rng.standard_normal((7, 40)))
    got = g.add(up(x, dtypes[0]), up(y, dtypes[1]))
    assert got.dtype == (np.float32 if dtypes[0] == "f32" else np.uint16)
    close(g.to_host(got), c.add(x, y), "rms_norm")  # one bf16 rounding at most


@pytest.mark.parametrize("T,H,N,K", [(1, 1, 8, 8), (5, 3, 24, 16), (2, 20, 16, 40)])
def test_head_linear(ops, T, H, N, K):
    g, c = ops
    rng = np.random.default_rng(T * H)
    x, w = bf16(rng.standard_normal((T, H, K))), bf16(rng.standard_normal((H, N, K)) / 4)
    close(g.to_host(g.head_linear(g.activation(x), g.weight(w))), c.head_linear(x, w), "linear")


def test_latent_write_is_an_exact_copy_and_skips_padding(ops):
    g, c = ops
    rng = np.random.default_rng(11)
    cache = bf16(rng.standard_normal((3, 4, 24)))
    x, slots = bf16(rng.standard_normal((4, 24))), np.array([5, -1, 0, 11], np.int32)
    gc = g.activation(cache)
    g.latent_write(gc, g.activation(x), g.index(slots))
    c.latent_write(cache, x, slots)
    np.testing.assert_array_equal(g.to_host(gc), cache)


def paged_latent(rng, lens, bs, L, spare_blocks=2):
    """A latent cache [NB, BS, L] holding sequences of the given lengths in shuffled blocks."""
    nb, tables = shuffled_tables(rng, lens, bs, spare_blocks)
    return bf16(rng.standard_normal((nb, bs, L))), tables


def check_mla_decode(g, c, rng, lens, bs, H, C, R):
    cache, tables = paged_latent(rng, lens, bs, C + R)
    q = bf16(rng.standard_normal((len(lens), H, C + R)))
    scale, lens = (C + R) ** -0.5, np.array(lens, np.int32)
    got = g.mla_attention_decode(g.activation(q), g.activation(cache), g.index(tables), g.index(lens), scale, C)
    close(g.to_host(got), c.mla_attention_decode(q, cache, tables, lens, scale, C), "attention")


def check_mla_prefill(g, c, rng, start, T, bs, H, C, R):
    cache, tables = paged_latent(rng, [start + T], bs, C + R)
    q = bf16(rng.standard_normal((T, H, C + R)))
    scale = (C + R) ** -0.5
    got = g.mla_attention_prefill(g.activation(q), g.activation(cache), g.index(tables[0]), start, scale, C)
    close(g.to_host(got), c.mla_attention_prefill(q, cache, tables[0], start, scale, C), "attention")


@pytest.mark.parametrize("split", ["off", "on"])
@pytest.mark.parametrize("H,C,R", [(1, 16, 8), (3, 32, 8), (20, 16, 16)])
def test_mla_attention_decode(split, H, C, R):
    from eprt.ops.cupy_ops import CupyOps

    g = CupyOps(decode_split=split, split_keys=128)
    check_mla_decode(g, NumpyOps(), np.random.default_rng(H), [1, 33, 200], 16, H, C, R)


@pytest.mark.parametrize("split", ["off", "auto"])
@pytest.mark.parametrize("start,T", [(0, 1), (0, 40), (150, 5)])
def test_mla_attention_prefill(split, start, T):
    from eprt.ops.cupy_ops import CupyOps

    g = CupyOps(decode_split=split, split_keys=128)
    check_mla_prefill(g, NumpyOps(), np.random.default_rng(start + T), start, T, 4, 3, 16, 8)


def test_mla_bad_arguments_name_the_argument(ops):
    g, _ = ops
    cache = g.zeros((2, 4, 20))
    with pytest.raises(ValueError, match="latent width must be a multiple of 8, got 20"):
        g.mla_attention_decode(g.zeros((1, 2, 20)), cache, g.index([[0]]), g.index([1]), 1.0, 16)
    with pytest.raises(ValueError, match=r"mla_attention_prefill: block table of 1 blocks of 4 cannot hold"):
        g.mla_attention_prefill(g.zeros((5, 2, 24)), g.zeros((2, 4, 24)), g.index([0]), 0, 1.0, 16)
    with pytest.raises(ValueError, match="n_group must divide E=10"):
        g.router_grouped(g.zeros((1, 10)), None, 2, GroupedRouting("sigmoid", 4, 2, "max", True, 1.0))


# ---- drawn shapes -------------------------------------------------------------------------
@SETTINGS
@given(
    T=st.integers(1, 6),
    groups=st.integers(1, 8),
    per_group=st.integers(1, 9),
    data=st.data(),
    scoring=st.sampled_from(["softmax", "sigmoid"]),
    group_score=st.sampled_from(["max", "top2_sum"]),
    renormalize=st.booleans(),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_router_grouped_shapes(ops, T, groups, per_group, data, scoring, group_score, renormalize, with_bias, seed):
    g, c = ops
    E = groups * per_group
    top_k = data.draw(st.integers(1, min(E, 32)))
    routing = GroupedRouting(scoring, groups, data.draw(st.integers(1, groups)), group_score, renormalize, 1.5)
    check_router_grouped(g, c, np.random.default_rng(seed), T, E, top_k, routing, "f32", with_bias)


@SETTINGS
@given(
    H=st.integers(1, 18),
    C=st.sampled_from([8, 16, 40]),
    R=st.sampled_from([8, 16]),
    bs=st.sampled_from([1, 3, 16]),
    lens=st.lists(st.one_of(st.integers(1, 150), st.sampled_from([31, 32, 33, 128, 129])), min_size=1, max_size=3),
    split=st.sampled_from(["off", "on"]),
    seed=st.integers(0, 2**16),
)
def test_mla_attention_decode_shapes(H, C, R, bs, lens, split, seed):
    from eprt.ops.cupy_ops import CupyOps

    check_mla_decode(
        CupyOps(decode_split=split, split_keys=128), NumpyOps(), np.random.default_rng(seed), lens, bs, H, C, R
    )


@SETTINGS
@given(
    H=st.integers(1, 17),
    C=st.sampled_from([8, 24]),
    bs=st.sampled_from([1, 5, 16]),
    start=st.integers(0, 140),
    T=st.integers(1, 40),
    split=st.sampled_from(["off", "auto"]),
    seed=st.integers(0, 2**16),
)
def test_mla_attention_prefill_shapes(H, C, bs, start, T, split, seed):
    from eprt.ops.cupy_ops import CupyOps

    g = CupyOps(decode_split=split, split_keys=128)
    check_mla_prefill(g, NumpyOps(), np.random.default_rng(seed), start, T, bs, H, C, 8)


def test_the_cupy_backend_implements_every_op():
    """No architecture is refused on the GPU at start-up (model._check_backend)."""
    from eprt.ops.base import Ops
    from eprt.ops.cupy_ops import CupyOps

    ops = [n for n, f in vars(Ops).items() if callable(f) and not n.startswith("_")]
    # the base's own bodies serve: no work, "", one decode row per verify position, weight's layout,
    # EPLB's splits in parts of any size, FP8 kept wherever fp8_resident says, a tied head is the table,
    # a decode layer's attention, the routing with its product and a whole plain decode layer as the
    # ops they compose (the CPU's compiled path runs each as one or two calls; the GPU launches the
    # ops: docs/gpu.md)
    optional = (
        "synchronize",
        "warm_up",
        "describe",
        "attention_verify",
        "mla_attention_verify",
        "linear_weight",
        "expert_weights",
        "take_experts",
        "moe_split_rows",
        "keeps_fp8",
        "tied_head",
        "attention_sinks_verify",
        "attention_decode_block",
        "route_rows",
        "decode_layer_weights",
        "decode_layer",
    )
    missing = [n for n in ops if getattr(CupyOps, n) is getattr(Ops, n) and n not in optional]
    assert missing == []


@SETTINGS
@given(
    H=st.integers(1, 20),
    C=st.sampled_from([8, 16, 40, 12]),  # 12: not a multiple of 8, head_linear after the attention
    Dv=st.sampled_from([2, 6, 16, 5]),  # 5: odd, head_linear after the attention
    lens=st.lists(st.one_of(st.integers(1, 150), st.sampled_from([31, 32, 33, 128, 129])), min_size=1, max_size=9),
    split=st.sampled_from(["off", "on"]),
    seed=st.integers(0, 2**16),
)
def test_mla_attention_decode_with_w_uv_shapes(H, C, Dv, lens, split, seed):
    """w_uv's up-projection folded into the decode (up to 8 rows, C a multiple of 8, Dv even) or after it."""
    from eprt.ops.cupy_ops import CupyOps

    g, c, rng, R, bs = CupyOps(decode_split=split, split_keys=128), NumpyOps(), np.random.default_rng(seed), 8, 16
    cache, tables = paged_latent(rng, lens, bs, C + R)
    q, w_uv = bf16(rng.standard_normal((len(lens), H, C + R))), bf16(rng.standard_normal((H, Dv, C)) / np.sqrt(C))
    scale, lens = (C + R) ** -0.5, np.array(lens, np.int32)
    args = (g.activation(q), g.activation(cache), g.index(tables), g.index(lens), scale, C, g.weight(w_uv))
    close(
        g.to_host(g.mla_attention_decode(*args)),
        c.mla_attention_decode(q, cache, tables, lens, scale, C, w_uv),
        "linear",
    )


@SETTINGS
@given(
    T=st.integers(1, 10),
    K=st.sampled_from([8, 24, 64, 200, 12]),  # 12: not a multiple of 8, rms_norm then linear
    N=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_linear_shapes(ops, T, K, N, seed):
    g, c = ops
    rng = np.random.default_rng(seed)
    wide = bf16(rng.standard_normal((T, K + 3)))  # x: a column slice [T, K]
    norm, w = bf16(1 + 0.2 * rng.standard_normal(K)), bf16(rng.standard_normal((N, K)) / np.sqrt(K))
    got = g.rms_norm_linear(g.activation(wide)[:, :K], g.weight(norm), 1e-6, g.weight(w))
    close(g.to_host(got), c.rms_norm_linear(wide[:, :K], norm, 1e-6, w), "linear", scale=1.5)
