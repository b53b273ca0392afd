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

from eprt.ops import device
from eprt.ops.numpy_ops import NumpyOps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not device.cuda_usable(), reason="CuPy cannot use a CUDA device here"),
]


def launched(monkeypatch) -> list[str]:
    """The names of the kernels CupyOps launches from now on."""
    from eprt.ops import cupy_ops

    names, real = [], cupy_ops._launch

    def launch(file, name, *args, **kwargs):
        names.append(name)
        return real(file, name, *args, **kwargs)

    monkeypatch.setattr(cupy_ops, "_launch", launch)
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


def test_moe_auto_takes_tensor_cores_by_shape():
    from eprt.ops.cupy_ops import CupyOps, Fp8Weight

    auto, w = CupyOps(), np.zeros((8, 64, 32))  # 8 local experts: shape only
    assert auto._moe_choice(31, w) == "grouped"  # decode: a few rows per expert, weight-bandwidth bound
    assert auto._moe_choice(32, w) == "tc"  # 4 slots per local expert
    odd = Fp8Weight(np.zeros((8, 64, 32), np.uint8), None, 128, 16, 32)  # block_k 16: not a whole K step
    assert auto._moe_choice(4096, odd) == "grouped" and CupyOps(moe_impl="tc")._moe_choice(4096, odd) == "grouped"
    assert CupyOps(moe_impl="gathered")._moe_choice(4096, w) == "gathered"
