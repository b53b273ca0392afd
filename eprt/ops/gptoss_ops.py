"""gpt-oss's operations, NumPy reference (mixed into ``NumpyOps``): attention with per-head sinks
and an optional sliding window, the router's softmax over its top-k logits, and the experts with
biases and the clamped SwiGLU, their weights bf16/float32 or MXFP4 (kept MXFP4 in memory and
dequantized expert by expert inside ``moe_experts_swiglu``). Shape legend in ``base.py``; the
contract's docstrings are there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eprt.ops.mxfp4_format import FP4_VALUES, MXFP4_BLOCK

EXPERT_ROWS_AS_GEMV = 16  # an expert with at most this many rows runs a GEMV per row (bits independent of the group)


@dataclass(frozen=True)
class Mxfp4Weight:
    """An MXFP4 expert stack as the checkpoint stores it: ``blocks[El, N, K / 32, 16]`` bytes of two e2m1
    values each (the low nibble first) and ``scales[El, N, K / 32]`` e8m0 exponents (2^(s - 127))."""

    blocks: object
    scales: object

    @property
    def shape(self) -> tuple:
        """[El, N, K] of the weights it holds."""
        El, N, nb, half = self.blocks.shape
        return (El, N, nb * 2 * half)

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes) + int(self.scales.nbytes)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks[.., N, K / 32, 16] uint8, scales[.., N, K / 32] uint8 -> float32 [.., N, K]."""
    blocks, scales = np.asarray(blocks, dtype=np.uint8), np.asarray(scales, dtype=np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] * 2 != MXFP4_BLOCK:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match ([.., N, K/32, 16])")
    values = np.empty((*blocks.shape[:-1], MXFP4_BLOCK), dtype=np.float32)  # [.., N, K/32, 32]
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values *= np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127)[..., None].astype(np.float32)
    return values.reshape(*scales.shape[:-1], -1)


def clamped_swiglu(h: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    """h[T, 2I] (gate | up) -> [T, I]: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    inter = h.shape[-1] // 2
    g = np.minimum(h[:, :inter], np.float32(limit))
    u = np.clip(h[:, inter:], np.float32(-limit), np.float32(limit))
    return (u + np.float32(1.0)) * (g / (np.float32(1.0) + np.exp(-np.float32(alpha) * g)))


def _softmax_with_sink(scores: np.ndarray, sinks: np.ndarray) -> np.ndarray:
    """Softmax over the last axis of scores[.., H?, .., S] with one more logit per query head, the
    head's sink, in the denominator only. ``sinks`` broadcasts against scores[..., :1]."""
    m = np.maximum(scores.max(axis=-1, keepdims=True), sinks)
    p = np.exp(scores - m)
    return p / (p.sum(axis=-1, keepdims=True) + np.exp(sinks - m))


class GptOssOps:
    """The NumPy reference of gpt-oss's ops (a mixin of ``NumpyOps``: ``weight``, ``_float32``)."""

    def mxfp4_expert_weights(self, gate_up_blocks, gate_up_scales, down_blocks, down_scales) -> tuple:
        return (
            Mxfp4Weight(np.ascontiguousarray(gate_up_blocks), np.ascontiguousarray(gate_up_scales)),
            Mxfp4Weight(np.ascontiguousarray(down_blocks), np.ascontiguousarray(down_scales)),
        )

    def swiglu_expert_weights(self, gate_up, down) -> tuple:
        return self.expert_weights(gate_up, down)  # NumpyOps' layout: panels on the compiled path

    # ---- attention with sinks ---------------------------------------------------------
    def attention_sinks_prefill(self, q, k_cache, v_cache, block_table, start_pos, scale, sinks, window):
        T, H, Dh = q.shape
        bs, Hk = k_cache.shape[1], k_cache.shape[2]
        end = start_pos + T
        lo = max(0, start_pos - window + 1) if window else 0  # the first key any row reads
        first = lo // bs
        blocks = block_table[first : -(-end // bs)]
        k = k_cache[blocks].reshape(-1, Hk, Dh)[lo - first * bs : end - first * bs]  # [S, Hk, Dh]
        v = v_cache[blocks].reshape(-1, Hk, Dh)[lo - first * bs : end - first * bs]
        key_pos = np.arange(lo, end)[None, :]  # [1, S]
        query_pos = np.arange(start_pos, end)[:, None]  # [T, 1]
        mask = key_pos <= query_pos
        if window:
            mask &= key_pos > query_pos - window  # [T, S]
        G = H // Hk
        qg = q.reshape(T, Hk, G, Dh).transpose(1, 2, 0, 3) * np.float32(scale)  # [Hk, G, T, Dh]
        scores = np.matmul(qg, k.transpose(1, 2, 0)[:, None])  # [Hk, G, T, S]
        scores = np.where(mask, scores, np.float32(-np.inf))
        probs = _softmax_with_sink(scores, np.asarray(sinks, np.float32).reshape(Hk, G, 1, 1))
        out = np.matmul(probs, v.transpose(1, 0, 2)[:, None])  # [Hk, G, T, Dh]
        return np.ascontiguousarray(out.transpose(2, 0, 1, 3).reshape(T, H, Dh), dtype=np.float32)

    def attention_sinks_decode(self, q, k_cache, v_cache, block_tables, context_lens, scale, sinks, window):
        B, H, Dh = q.shape
        bs, Hk = k_cache.shape[1], k_cache.shape[2]
        if not B:
            return np.empty_like(q)
        lens = np.asarray(context_lens, dtype=np.int64)  # [B]
        lo = np.maximum(0, lens - window) if window else np.zeros_like(lens)  # [B] first key of each row
        first = lo // bs
        nb = int((-(-lens // bs) - first).max())
        cols = first[:, None] + np.arange(nb)[None, :]  # [B, nb] block-table columns read
        tables = np.take_along_axis(block_tables, np.minimum(cols, block_tables.shape[1] - 1), axis=1)
        k = k_cache[tables].reshape(B, nb * bs, Hk, Dh)  # [B, S, Hk, Dh]
        v = v_cache[tables].reshape(B, nb * bs, Hk, Dh)
        pos = (cols[:, :, None] * bs + np.arange(bs)[None, None, :]).reshape(B, -1)  # [B, S]
        valid = (pos < lens[:, None]) & (pos >= lo[:, None])
        G = H // Hk
        qg = q.reshape(B, Hk, G, Dh) * np.float32(scale)  # [B, Hk, G, Dh]
        scores = np.matmul(qg, k.transpose(0, 2, 3, 1))  # [B, Hk, G, S]
        scores = np.where(valid[:, None, None, :], scores, np.float32(-np.inf))
        probs = _softmax_with_sink(scores, np.asarray(sinks, np.float32).reshape(1, Hk, G, 1))
        out = np.matmul(probs, v.transpose(0, 2, 1, 3))  # [B, Hk, G, Dh]
        return np.ascontiguousarray(out.reshape(B, H, Dh), dtype=np.float32)

    # ---- router and experts ---------------------------------------------------------------
    def router_topk_softmax(self, logits, top_k):
        logits = np.asarray(logits, dtype=np.float32)
        ids = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k].astype(np.int32)  # [T, k] ties: lower id
        top = np.take_along_axis(logits, ids, axis=-1)  # [T, k]
        e = np.exp(top - top.max(axis=-1, keepdims=True))
        return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32), ids

    def moe_experts_swiglu(self, x, weights, ids, w_gate_up, w_down, b_gate_up, b_down, expert_start, alpha, limit):
        T, D = x.shape
        k = ids.shape[1]
        local = (ids - expert_start).reshape(-1)  # [T*k] local expert of each (token, choice)
        order = np.argsort(local, kind="stable")  # grouped by expert, tokens in order
        bounds = np.searchsorted(local[order], np.arange(w_gate_up.shape[0] + 1))  # [El+1] group edges
        picks = order[bounds[0] : bounds[-1]]  # (token, choice) slots routed to this rank, by expert
        bounds = bounds - bounds[0]
        expert = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))  # [n] each row's local expert
        ys = np.zeros((T * k, D), dtype=np.float32)  # one row per (token, choice)
        if len(picks):
            h = self._swiglu_products(x[picks // k], w_gate_up, bounds) + b_gate_up[expert]  # [n, 2I]
            ys[picks] = self._swiglu_products(clamped_swiglu(h, alpha, limit), w_down, bounds) + b_down[expert]
        ys *= np.asarray(weights, dtype=np.float32).reshape(-1, 1)
        return ys.reshape(T, k, D).sum(axis=1)  # [T, D]

    def _swiglu_products(self, xs, w, bounds):
        """[n, N]: rows bounds[e] .. bounds[e + 1] of xs [n, K] through expert e of w: MXFP4 decoded as it
        is summed (the compiled path) or one expert at a time into float32; else NumpyOps' products."""
        if not isinstance(w, Mxfp4Weight):
            return self.expert_products(xs, w, bounds)
        if self.experts == "numba":
            from eprt.ops import mxfp4_cpu

            return mxfp4_cpu.expert_rows(xs, w.blocks, w.scales, bounds)
        out = np.empty((len(xs), w.shape[1]), dtype=np.float32)
        for e in np.flatnonzero(np.diff(bounds)).tolist():
            rows = slice(int(bounds[e]), int(bounds[e + 1]))
            out[rows] = _expert_product(xs[rows], dequantize_mxfp4(w.blocks[e], w.scales[e]))
        return out


def _expert_product(xs: np.ndarray, w: np.ndarray) -> np.ndarray:
    """xs[n, K] @ w[N, K].T: a GEMV per row for up to EXPERT_ROWS_AS_GEMV rows (a row's bits do not
    depend on the group), else one GEMM."""
    if len(xs) > EXPERT_ROWS_AS_GEMV:
        return xs @ w.T
    wt = w.T
    return np.concatenate([xs[r : r + 1] @ wt for r in range(len(xs))]) if len(xs) else xs @ wt
