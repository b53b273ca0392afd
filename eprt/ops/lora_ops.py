"""Batched multi-LoRA ops (rows of several adapters in one call, Punica/S-LoRA style): the row
grouping ``LoraRows`` and the NumPy reference of ``Ops.lora_apply`` / ``Ops.moe_experts_lora``.

S adapter slots, R rank (zero-padded), T rows, K in / N out features (legend: ``base.py``).
Each row r of slot s gets ``b[s] @ (a[s] @ x[r])``; rows of slot -1 (no adapter) get nothing.
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
    """In place and returned: y[T, N] += b[s] @ (a[s] @ x[t]) for each row t of slot s;
    x[T, K], a[S, R, K], b[S, N, R] (float32 accumulation)."""
    for s, lo, hi in rows.segments:
        idx = rows.order[lo:hi]
        if hi - lo == len(rows.slots):  # every row of one slot: no gather
            y += (x @ a[s].T) @ b[s].T  # [T, R] -> [T, N]
        else:
            y[idx] += (x[idx] @ a[s].T) @ b[s].T
    return y


def moe_experts_lora(ops, x, weights, ids, w_gate_up, w_down, expert_start, rows: LoraRows, gate_up, down):
    """``Ops.moe_experts`` with each (token, choice) pair's expert projections carrying the LoRA
    delta of its token's slot: gate_up / down are (a[S, El, R, K], b[S, El, N, R]) or None."""
    T, D = x.shape
    k = ids.shape[1]
    local = (ids - expert_start).reshape(-1)  # [T*k]
    order = np.argsort(local, kind="stable")
    experts = local[order]
    bounds = np.searchsorted(experts, np.arange(w_gate_up.shape[0] + 1))  # [El+1]
    start = int(bounds[0])
    picks = order[start : int(bounds[-1])]  # (token, choice) pairs routed here, by expert
    xs = x[picks // k]  # [n, D]
    pair_slots = rows.slots[picks // k]  # [n]
    ys = np.zeros((T * k, D), dtype=np.float32)
    for e in np.flatnonzero(np.diff(bounds)):
        lo, hi = int(bounds[e]) - start, int(bounds[e + 1]) - start
        h = xs[lo:hi] @ w_gate_up[e].T  # [t, 2I]
        _add_segments(h, xs[lo:hi], pair_slots[lo:hi], gate_up, e)
        act = ops.silu_and_mul(h)  # [t, I]
        out = act @ w_down[e].T  # [t, D]
        _add_segments(out, act, pair_slots[lo:hi], down, e)
        ys[picks[lo:hi]] = out
    ys *= weights.reshape(-1, 1)
    return ys.reshape(T, k, D).sum(axis=1)  # [T, D]


def _add_segments(y: np.ndarray, x: np.ndarray, slots: np.ndarray, factors, e: int) -> None:
    """y[t] += b[s, e] @ (a[s, e] @ x[t]) for the rows of each slot s >= 0."""
    if factors is None:
        return
    a, b = factors
    for s in np.unique(slots[slots >= 0]):
        m = slots == s
        y[m] += (x[m] @ a[s, e].T) @ b[s, e].T
