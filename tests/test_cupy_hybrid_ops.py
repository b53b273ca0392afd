"""The CuPy kernels of the hybrid models (kernels/gated_delta.cu) against the NumPy reference:
causal conv1d (prefill and one step, continuing a state), the delta-rule gates, the gated delta
rule (a prefill chunk and batched steps on scattered slots), the gated RMSNorm and the output gate.
Inputs are rounded to bf16 first (as in test_cupy_ops.py); the states stay float32. Run on a GPU,
or on the CPU simulator: ``PYTHONPATH=tests python -m pytest -p cusim.plugin -m gpu <this file>``.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_cupy_ops import bf16, gpu

from eprt.ops.numpy_ops import NumpyOps

pytestmark = [gpu, pytest.mark.gpu]
TOL = (2e-2, 2e-2)  # bf16 outputs (relative step 2^-8) and fp32 accumulation order


@pytest.fixture(scope="module")
def ops():
    from eprt.ops.cupy_ops import CupyOps

    return CupyOps(), NumpyOps()


def close(got, want, scale=1.0):
    np.testing.assert_allclose(got, want, rtol=TOL[0], atol=TOL[1] * scale)


def test_causal_conv1d_prefill_then_steps(ops):
    import cupy

    g, c = ops
    rng = np.random.default_rng(0)
    T, C, K, S = 6, 40, 4, 3
    x, w = bf16(rng.standard_normal((T + 2, C))), bf16(rng.standard_normal((C, K)) / 2)
    state = rng.standard_normal((S, K - 1, C)).astype(np.float32)  # a chunk continuing earlier ones
    dev_state = cupy.asarray(state)
    want_state = state.copy()
    close(
        g.to_host(g.causal_conv1d(g.activation(x[:T]), g.weight(w), dev_state, 1)),
        c.causal_conv1d(x[:T], w, want_state, 1),
    )
    slots = np.asarray([1, 0], np.int32)  # batched steps: slot 1 continues, slot 0 from its own state
    got = g.causal_conv1d_update(g.activation(x[T:]), g.weight(w), dev_state, g.index(slots))
    close(g.to_host(got), c.causal_conv1d_update(x[T:], w, want_state, slots))
    np.testing.assert_allclose(cupy.asnumpy(dev_state), want_state, rtol=1e-6, atol=1e-6)


def test_delta_rule_gates(ops):
    g, c = ops
    rng = np.random.default_rng(1)
    b, a = bf16(3 * rng.standard_normal((7, 4))), bf16(10 * rng.standard_normal((7, 4)))  # softplus past 20 too
    a_log, dt = bf16(rng.uniform(-1, 2, 4)), bf16(rng.standard_normal(4))
    got = g.delta_rule_gates(g.activation(b), g.activation(a), g.weight(a_log), g.weight(dt))
    want = c.delta_rule_gates(b, a, a_log, dt)
    for got_part, want_part in zip(got, want):
        np.testing.assert_allclose(g.to_host(got_part), want_part, rtol=1e-5, atol=1e-5)


# dk 128: two threads per state column (their halves meet by a shuffle); dv 200: two column groups
@pytest.mark.parametrize("T, dk, dv", [(1, 16, 12), (9, 16, 12), (2, 64, 40), (3, 128, 200)])
def test_gated_delta_rule_chunk_and_steps(ops, T, dk, dv):
    import cupy

    g, c = ops
    rng = np.random.default_rng(T)
    Hk, Hv, S = 2, 4, 3
    q, k = (bf16(rng.standard_normal((T, Hk, dk))) for _ in range(2))
    v = bf16(rng.standard_normal((T, Hv, dv)))
    gate = -rng.uniform(0, 0.5, (T, Hv)).astype(np.float32)
    beta = rng.uniform(0, 1, (T, Hv)).astype(np.float32)
    state = (rng.standard_normal((S, Hv, dk, dv)) / 4).astype(np.float32)
    dev_state, want_state = cupy.asarray(state), state.copy()
    act = g.activation
    got = g.gated_delta_rule_chunked(act(q), act(k), act(v), cupy.asarray(gate), cupy.asarray(beta), dev_state, 2)
    close(g.to_host(got), c.gated_delta_rule_chunked(q, k, v, gate, beta, want_state, 2))
    np.testing.assert_allclose(cupy.asnumpy(dev_state), want_state, rtol=1e-4, atol=1e-4)
    # one token for each of two sequences, in slots 2 and 0
    B, slots = 2, np.asarray([2, 0], np.int32)
    q, k = (bf16(rng.standard_normal((B, Hk, dk))) for _ in range(2))
    v = bf16(rng.standard_normal((B, Hv, dv)))
    gate, beta = gate[:1].repeat(B, 0), beta[:1].repeat(B, 0)
    got = g.gated_delta_rule_step(
        act(q), act(k), act(v), cupy.asarray(gate), cupy.asarray(beta), dev_state, g.index(slots)
    )
    close(g.to_host(got), c.gated_delta_rule_step(q, k, v, gate, beta, want_state, slots))
    np.testing.assert_allclose(cupy.asnumpy(dev_state), want_state, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(cupy.asnumpy(dev_state)[1], state[1])  # the slot nobody named


def test_gated_rms_norm_and_sigmoid_mul(ops):
    g, c = ops
    rng = np.random.default_rng(2)
    x, z, w = (
        bf16(rng.standard_normal((10, 12))),
        bf16(rng.standard_normal((10, 12))),
        bf16(1 + rng.standard_normal(12) / 5),
    )
    close(
        g.to_host(g.gated_rms_norm(g.activation(x), g.weight(w), g.activation(z), 1e-6)),
        c.gated_rms_norm(x, w, z, 1e-6),
    )
    close(g.to_host(g.sigmoid_mul(g.activation(x), g.activation(z))), c.sigmoid_mul(x, z))


def test_bad_arguments_name_the_problem(ops):
    import cupy

    g, _ = ops
    x = g.activation(np.zeros((3, 8), np.float32))
    with pytest.raises(ValueError, match="conv_state has shape \\[2, 3, 7\\], expected \\[\\*, 3, 8\\]"):
        g.causal_conv1d(x, g.weight(np.zeros((8, 4), np.float32)), cupy.zeros((2, 3, 7), np.float32), 0)
    with pytest.raises(ValueError, match="conv width 9 is not one of the kernel.s \\(2, 3, 4\\)"):
        g.causal_conv1d(x, g.weight(np.zeros((8, 9), np.float32)), cupy.zeros((2, 8, 8), np.float32), 0)
    q = g.activation(np.zeros((1, 3, 4), np.float32))
    v = g.activation(np.zeros((1, 4, 4), np.float32))
    f = cupy.zeros((1, 4), np.float32)
    with pytest.raises(ValueError, match="value heads 4 are not a multiple of key heads 3"):
        g.gated_delta_rule_step(q, q, v, f, f, cupy.zeros((1, 4, 4, 4), np.float32), g.index([0]))


def forced(path, device, prompt, split):
    """Prefill prompt[:split] in 3-token chunks, then decode the rest one token a step; returns
    (logits of every step [steps, V], expert ids of every MoE call, sorted per row)."""
    from eprt.engine.executor import ShardExecutor
    from eprt.model.loader import load_model
    from eprt.ops.device import get_ops

    ops = get_ops(device)
    routes, route = [], ops.route

    def recording(*args):
        weights, ids, perm = route(*args)
        routes.append(np.sort(ops.to_host(ids), axis=1))
        return weights, ids, perm

    ops.route = recording
    ex = ShardExecutor(load_model(path, ops, max_len=64).model, 16, 4, 2, prefix_cache=False)
    ex.allocate(1, prompt[:split])
    for start in range(0, split, 3):
        last = ex.prefill(1, prompt[:split], start, min(3, split - start))
    rows = [ops.to_host(last)[0]]
    for t in prompt[split:]:
        rows.append(ops.to_host(ex.decode([1], [t]))[0])
    return np.stack(rows), routes


def test_qwen3_next_forward_follows_numpy_where_the_routing_agrees(checkpoint):
    """The whole hybrid forward on the CuPy backend (chunked prefill carrying the state, then decode
    steps): bf16 activations move these tiny models' logits by ~2e-2, but an MoE router turns a
    near-tie into a different expert (test_gpu_end_to_end.py), so prompts are compared only where
    both backends chose the same experts everywhere; at least one must."""
    path = checkpoint("qwen3_next", dtype="bfloat16")
    compared = 0
    for prompt in ([8, 19, 4, 4, 120, 7], [200, 100, 50, 25, 12, 6, 3, 90], [5, 77, 3, 140, 9, 9, 31]):
        want, want_routes = forced(path, "cpu", prompt, 4)
        got, got_routes = forced(path, "cuda", prompt, 4)
        if all(np.array_equal(a, b) for a, b in zip(want_routes, got_routes)):
            np.testing.assert_allclose(got, want, atol=0.1, rtol=0)
            compared += 1
    assert compared >= 1
