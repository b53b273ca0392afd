"""Token sampling on rank 0: greedy, temperature, top-k, top-p, per-request seed.

V vocabulary. Only rank 0 samples; workers never see logits.
"""

from __future__ import annotations

import numpy as np

from eprt.api import SamplingParams


def make_rng(params: SamplingParams, fallback: np.random.Generator) -> np.random.Generator:
    """A request's own generator: seeded from params.seed, else drawn from the engine's."""
    seed = params.seed if params.seed is not None else int(fallback.integers(0, 2**63 - 1))
    return np.random.default_rng(seed)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token from logits[V] (float32)."""
    if params.temperature == 0.0:
        return int(np.argmax(logits))
    x = logits.astype(np.float64)  # [V]
    with np.errstate(over="ignore"):  # max first: a tiny temperature gives -inf, never NaN
        x = (x - x.max()) / params.temperature
    if 0 < params.top_k < x.shape[0]:
        kth = np.partition(x, -params.top_k)[-params.top_k]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x)
    p /= p.sum()
    if params.top_p < 1.0:
        keep = nucleus(p, params.top_p)
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return int(rng.choice(p.shape[0], p=p))


TOP_P_HEADS = (1024, 16384)  # sort only this many of the largest probabilities, when they hold the nucleus


def nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """The smallest prefix of the indices sorted by descending ``p`` (ties by index) whose
    mass reaches ``top_p`` (all of them if rounding keeps it short).

    A full sort of a 150k-word vocabulary costs ~20 ms per row; the nucleus usually lies among
    the largest probabilities, so a head of them is sorted first: every index with p >= the
    m-th largest, in index order, stably sorted, is exactly the full sort's prefix
    (everything left out is smaller), and its cumulative sums are the full ones' (same
    values, same order). Only when no head holds ``top_p`` is the whole vocabulary sorted."""
    V = p.shape[0]
    heads = [m for m in TOP_P_HEADS if V > 4 * m]
    if heads:
        part = np.partition(p, [V - m for m in reversed(heads)])  # one pass: every head's threshold
        for m in heads:
            head = np.flatnonzero(p >= part[V - m])  # ascending index
            if p[head].sum() < top_p * (1 - 1e-9):  # cannot hold the nucleus: no sort
                continue
            order, n = _prefix(p, head, top_p)
            if n < order.shape[0]:
                return order[: n + 1]
    order, n = _prefix(p, np.arange(V), top_p)
    return order[: n + 1]


def _prefix(p: np.ndarray, idx: np.ndarray, top_p: float) -> tuple[np.ndarray, int]:
    """``idx`` (ascending) sorted by descending p, ties by index, and the position where the
    running mass first reaches ``top_p`` (len(idx) if it never does)."""
    order = idx[np.argsort(-p[idx], kind="stable")]
    return order, int(np.searchsorted(np.cumsum(p[order]), top_p))
