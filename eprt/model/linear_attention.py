"""Qwen3-Next's Gated DeltaNet mixer, written once against the ops interface (docs/hybrid.md).

T tokens, D hidden, Hk/Hv key/value heads, dk/dv their dims, C = 2*Hk*dk + Hv*dv conv channels.
A prefill chunk is one sequence continuing from its slot's state; a decode step is one token for
each of B sequences. The state rows of the slots are updated in place.
"""

from __future__ import annotations

from eprt.model.config import ModelConfig
from eprt.model.recurrent_state import RecurrentState
from eprt.model.weights import GatedDeltaNetWeights


def gated_delta_net(
    ops, cfg: ModelConfig, w: GatedDeltaNetWeights, x, state: RecurrentState, layer: int, slots, prefill: bool
):
    """x[T, D] -> [T, D]. ``slots``: host int32, the state slot of the one sequence (prefill, [1]) or of
    each row (decode, [B])."""
    la, xp = cfg.linear_attention, ops.xp
    T, C = x.shape[0], la.conv_dim
    projected = ops.linear(x, w.in_proj)  # [T, C + Hv*dv]: q | k | v | z
    ba = ops.linear(x, w.in_proj_ba)  # [T, 2*Hv]: b | a
    mixed = xp.ascontiguousarray(projected[:, :C])  # [T, C]
    slot, rows = int(slots[0]), ops.index(slots)
    if prefill:
        mixed = ops.causal_conv1d(mixed, w.conv, state.conv[layer], slot)
    else:
        mixed = ops.causal_conv1d_update(mixed, w.conv, state.conv[layer], rows)
    part = lambda a, b, heads, dim: xp.ascontiguousarray(mixed[:, a:b]).reshape(T, heads, dim)  # noqa: E731
    q = part(0, la.key_dim, la.num_key_heads, la.key_head_dim)  # [T, Hk, dk]
    k = part(la.key_dim, 2 * la.key_dim, la.num_key_heads, la.key_head_dim)
    v = part(2 * la.key_dim, C, la.num_value_heads, la.value_head_dim)  # [T, Hv, dv]
    Hv = la.num_value_heads
    g, beta = ops.delta_rule_gates(
        xp.ascontiguousarray(ba[:, :Hv]), xp.ascontiguousarray(ba[:, Hv:]), w.a_log, w.dt_bias
    )  # [T, Hv]
    if prefill:
        o = ops.gated_delta_rule_chunked(q, k, v, g, beta, state.delta[layer], slot)
    else:
        o = ops.gated_delta_rule_step(q, k, v, g, beta, state.delta[layer], rows)  # [T, Hv, dv]
    z = xp.ascontiguousarray(projected[:, C:]).reshape(T * Hv, la.value_head_dim)
    o = ops.gated_rms_norm(o.reshape(T * Hv, la.value_head_dim), w.norm, z, cfg.rms_norm_eps)  # [T*Hv, dv]
    return ops.linear(o.reshape(T, la.value_dim), w.out)  # [T, D]
