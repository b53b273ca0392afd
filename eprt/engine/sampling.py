"""Token sampling on rank 0: greedy, temperature, top-k, top-p, per-request seed.

V vocabulary. Only rank 0 samples; workers never see logits.
"""
from __future__ import annotations

import numpy as np

from eprt.engine.api import SamplingParams


def make_rng(params: SamplingParams, fallback: np.random.Generator) -> np.random.Generator:
    """A request's own generator: seeded from params.seed, else drawn from the engine's."""
    seed = params.seed if params.seed is not None else int(fallback.integers(0, 2**63 - 1))
    return np.random.default_rng(seed)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token from logits[V] (float32)."""
    if params.temperature == 0.0:
        return int(np.argmax(logits))
    x = logits.astype(np.float64)                                      # [V]
    with np.errstate(over="ignore"):         # max first: a tiny temperature gives -inf, never NaN
        x = (x - x.max()) / params.temperature
    if 0 < params.top_k < x.shape[0]:
        kth = np.partition(x, -params.top_k)[-params.top_k]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x)
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, params.top_p) + 1)]   # smallest set with mass >= top_p
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return int(rng.choice(p.shape[0], p=p))
