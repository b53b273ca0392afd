"""Batched multi-LoRA ops (rows of several adapters in one call, Punica/S-LoRA style): the row
grouping ``LoraRows`` and the NumPy reference of ``Ops.lora_apply`` / ``Ops.moe_experts_lora``.

S adapter slots, R rank (zero-padded), T rows, K in / N out features (legend: ``base.py``).
Each row r of slot s gets ``(x[r] @ a[s].T) @ b[s]`` (a [S, R, K], b [S, R, N]: B transposed, so
a rank prefix of both is contiguous); rows of slot -1 (no adapter) get nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LoraRows:
    """The adapter slot of each row of one forward pass, grouped: ``slots[T]`` int32 (-1 none),
    ``order`` the rows with an adapter sorted by slot, ``segments`` (slot, lo, hi) into ``order``,
    ``index`` the backend's copy of ``slots`` (device kernels read it)."""

    slots: np.ndarray
    order: np.ndarray
    segments: tuple
    index: object

    @staticmethod
    def group(slots: np.ndarray, upload=lambda a: a) -> LoraRows | None:
        """None when no row has an adapter: the base path then pays nothing."""
        slots = np.asarray(slots, dtype=np.int32)  # [T]
        if not (slots >= 0).any():
            return None
        order = np.argsort(slots, kind="stable")
        order = order[slots[order] >= 0]
        ss = slots[order]
        cuts = np.flatnonzero(np.diff(ss)) + 1
        bounds = [0, *cuts.tolist(), len(order)]
        segments = tuple((int(ss[lo]), lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]))
        return LoraRows(slots, order, segments, upload(slots))


def lora_apply(y: np.ndarray, x: np.ndarray, a: np.ndarray, b: np.ndarray, rows: LoraRows) -> np.ndarray:
    """In place and returned: y[T, N] += (x[t] @ a[s].T) @ b[s] for each row t of slot s;
    x[T, K], a[S, R, K], b[S, R, N] (float32 accumulation)."""
    for s, lo, hi in rows.segments:
        idx = rows.order[lo:hi]
        if hi - lo == len(rows.slots):  # every row of one slot: no gather
            y += (x @ a[s].T) @ b[s]  # [T, R] -> [T, N]
        else:
            y[idx] += (x[idx] @ a[s].T) @ b[s]
    return y


def moe_experts_lora(ops, x, weights, ids, w_gate_up, w_down, expert_start, rows: LoraRows, gate_up, down):
    """``Ops.moe_experts`` with each (token, choice) pair's expert projections carrying the LoRA
    delta of its token's slot: gate_up / down are (a[S, El, R, K], b[S, El, R, N]) or None. The
    base products are ``ops.expert_products`` (those of ``moe_experts``; on the compiled path its
    fused kernel's SiLU is its own); the deltas then go by segments of pairs sharing (slot, expert)."""
    T, D = x.shape
    k = ids.shape[1]
    local = (ids - expert_start).reshape(-1)  # [T*k]
    order = np.argsort(local, kind="stable")
    experts = local[order]
    bounds = np.searchsorted(experts, np.arange(w_gate_up.shape[0] + 1))  # [El+1]
    start = int(bounds[0])
    picks = order[start : int(bounds[-1])]  # (token, choice) pairs routed here, by expert
    ys = np.zeros((T * k, D), dtype=np.float32)
    if len(picks) == 0:
        return ys.reshape(T, k, D).sum(axis=1)
    xs = x[picks // k]  # [n, D]
    segments = _pair_segments(rows.slots[picks // k], experts[start : int(bounds[-1])])
    h = ops.expert_products(xs, w_gate_up, bounds - start)  # [n, 2I]
    _add_pairs(h, xs, segments, gate_up)
    act = ops.silu_and_mul(h)  # [n, I]
    out = ops.expert_products(act, w_down, bounds - start)  # [n, D]
    _add_pairs(out, act, segments, down)
    ys[picks] = out
    ys *= weights.reshape(-1, 1)
    return ys.reshape(T, k, D).sum(axis=1)  # [T, D]


def _pair_segments(slots: np.ndarray, experts: np.ndarray) -> list:
    """(slot, expert, pair indices) of the pairs with an adapter, one entry per (slot, expert)."""
    has = np.flatnonzero(slots >= 0)
    if len(has) == 0:
        return []
    key = slots[has].astype(np.int64) * (int(experts.max()) + 1) + experts[has]
    order = np.argsort(key, kind="stable")
    cuts = np.flatnonzero(np.diff(key[order])) + 1
    return [(int(slots[has[g[0]]]), int(experts[has[g[0]]]), has[g]) for g in np.split(order, cuts)]


def _add_pairs(y: np.ndarray, x: np.ndarray, segments: list, factors) -> None:
    """y[p] += (x[p] @ a[s, e].T) @ b[s, e] for the pairs p of each (slot s, expert e)."""
    if factors is None:
        return
    a, b = factors
    for s, e, idx in segments:
        y[idx] += (x[idx] @ a[s, e].T) @ b[s, e]
