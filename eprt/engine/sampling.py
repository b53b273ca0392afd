"""Token sampling on rank 0: greedy, temperature, top-k, top-p, per-request seed.

V vocabulary, n rows. Only rank 0 samples; workers never see logits. A sampled token's draw
is one uniform from Philox keyed by the request's seed at the token's position, so it does
not depend on batch-mates, steps or preemption (docs/design.md, "Sampling").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from eprt.api import SamplingParams

F32_MAX = float(np.finfo(np.float32).max)
PHILOX_KEY_BITS = 128


def request_seed(params: SamplingParams, fallback: np.random.Generator) -> int:
    """A request's sampling key (< 2**128, Philox's key size): params.seed, else drawn once from
    the engine's generator; a larger seed is hashed down (NumPy's SeedSequence)."""
    seed = params.seed if params.seed is not None else int(fallback.integers(0, 2**63 - 1))
    if seed < 2**PHILOX_KEY_BITS:
        return seed
    words = np.random.SeedSequence(seed).generate_state(PHILOX_KEY_BITS // 32, np.uint32)
    return sum(int(w) << (32 * i) for i, w in enumerate(words))


def token_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that picks the token at ``position`` of the request keyed ``seed``:
    the first word of Philox block ``position`` under key ``seed`` (counter-based: no state)."""
    word = int(np.random.Philox(key=seed, counter=position).random_raw())
    return (word >> 11) * 2.0**-53


def make_rng(params: SamplingParams, fallback: np.random.Generator) -> np.random.Generator:
    """A generator of uniforms for ``sample`` (tests and benchmarks): seeded like a request."""
    return np.random.default_rng(request_seed(params, fallback))


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token from logits[V] (float32), its uniform drawn from ``rng``."""
    return sample_rows(logits[None, :], [params], np.array([rng.random()]))[0]


def sample_rows(logits: np.ndarray, params: Sequence[SamplingParams], uniforms: np.ndarray) -> list[int]:
    """Tokens of logits[n, V]: row r greedy when params[r].temperature is 0, else drawn with
    uniforms[r] (in [0, 1)) by inverse CDF over the row's kept tokens (order: ``_pick``). Max,
    temperature, exp and sum run over all sampled rows at once; the cuts run per row."""
    temps = np.array([p.temperature for p in params], dtype=np.float64)  # [n]
    out = np.zeros(logits.shape[0], dtype=np.int64)  # [n]
    greedy = np.flatnonzero(temps == 0.0)
    if greedy.size:
        out[greedy] = np.argmax(logits[greedy], axis=1)
    rows = np.flatnonzero(temps != 0.0)
    if rows.size:
        x = np.asarray(logits[rows], dtype=np.float32)  # [m, V]
        with np.errstate(over="ignore", divide="ignore"):  # a tiny temperature sends every non-maximum to -inf
            scale = np.minimum(1.0 / temps[rows], F32_MAX).astype(np.float32)[:, None]  # [m, 1]
            p = np.subtract(x, x.max(axis=1, keepdims=True))  # [m, V] becomes exp((x - max) / T): max 1
            p *= scale
        np.exp(p, out=p)
        mass = p.sum(axis=1)  # [m]
        for i, r in enumerate(rows):
            out[r] = _pick(p[i], float(mass[i]), params[r], float(uniforms[r]))
    return [int(t) for t in out]


def _pick(p: np.ndarray, mass: float, params: SamplingParams, u: float) -> int:
    """One token from p[V] (unnormalized, max 1, sum ``mass``): top-k keeps the values >= the
    k-th largest, top-p then the smallest descending prefix (ties by index) whose mass reaches
    top_p. The draw walks the kept tokens by value bucket (high 16 bits of p), highest first,
    then by index; with no cut, by index."""
    V = p.shape[0]
    top_k = params.top_k if 0 < params.top_k < V else 0
    if not top_k and params.top_p >= 1.0:
        return _inverse_cdf(p, u)
    kept = _head(p, mass, top_k, params.top_p)  # ascending indices holding every kept token, or None
    if kept is None and not top_k:  # a wide nucleus: find its edge by value buckets
        return _draw_wide(p, params.top_p, u)
    if kept is None:
        kept = _top_k(p, top_k)
    elif top_k:  # values >= the k-th largest (ties at the cut stay)
        vals = p[kept]
        kept = kept[vals >= np.partition(vals, vals.shape[0] - top_k)[vals.shape[0] - top_k]]
    if params.top_p < 1.0:
        order = kept[np.argsort(-p[kept], kind="stable")]
        c = np.cumsum(p[order], dtype=np.float64)
        goal = params.top_p * (c[-1] if top_k else mass)
        kept = np.sort(order[: min(int(np.searchsorted(c, goal)), order.shape[0] - 1) + 1])
    kept = _by_bucket(p, kept)
    c = np.cumsum(p[kept], dtype=np.float64)
    return int(kept[_walk_to(c, u * c[-1], p[kept])])


HEAD_THRESHOLDS = (1e-3, 1e-6)  # p / max(p) of the candidate heads tried first (language is peaked)
HEAD_MAX = 8192  # a larger head is not sorted: value buckets are cheaper


def _head(p: np.ndarray, mass: float, top_k: int, top_p: float) -> np.ndarray | None:
    """Indices with p >= a threshold (ascending): the full sort's prefix of that length, so it
    holds every kept token when it has k of them (top-k) or top_p of the mass (top-p alone).
    None when no such head of at most HEAD_MAX does."""
    for threshold in HEAD_THRESHOLDS:
        above = p >= threshold
        if np.count_nonzero(above) > HEAD_MAX:
            return None
        head = np.flatnonzero(above)
        if head.shape[0] >= top_k and (top_k or p[head].sum(dtype=np.float64) >= top_p * mass * (1 + 1e-6)):
            return head
    return None


LOW_BITS = 16  # value buckets of p (>= 0, so its float32 bits order it): the high 16 bits, then the low 16
NUM_BUCKETS = (int(np.float32(1.0).view(np.int32)) >> LOW_BITS) + 1  # p <= 1
LOW_MASK = (1 << LOW_BITS) - 1
SORT_MAX = 8192  # candidates up to this many are sorted / partitioned instead of counted by their low bits


def _top_k(p: np.ndarray, k: int) -> np.ndarray:
    """Ascending indices of the values >= the k-th largest, by counting the high 16 bits of
    every value, then the low 16 bits of the bucket where the k-th lies (a radix select)."""
    bits = p.view(np.int32)
    high = bits >> LOW_BITS
    above = np.cumsum(np.bincount(high, minlength=NUM_BUCKETS)[::-1])  # [NB] count in buckets >= each
    j = int(np.searchsorted(above, k))
    edge, before = NUM_BUCKETS - 1 - j, int(above[j - 1]) if j else 0
    idx = np.flatnonzero(high >= edge)
    if idx.shape[0] <= SORT_MAX:  # few candidates: select the k-th directly
        vals = p[idx]
        return idx[vals >= np.partition(vals, vals.shape[0] - k)[vals.shape[0] - k]]
    low = bits[idx] & LOW_MASK
    on_edge = high[idx] == edge
    counts = np.cumsum(np.bincount(low[on_edge], minlength=LOW_MASK + 1)[::-1]) + before
    edge_low = LOW_MASK - int(np.searchsorted(counts, k))  # the k-th largest's low bits
    return idx[~on_edge | (low >= edge_low)]


class Nucleus(NamedTuple):
    """A wide nucleus by value buckets: every bucket (high 16 bits of p) above ``edge`` whole,
    and ``edge_kept`` (ascending indices) of the edge bucket."""

    high: np.ndarray  # [V] bucket of each p
    above: np.ndarray  # [NB] mass of the buckets >= each, highest bucket first
    edge: int
    edge_kept: np.ndarray


def _nucleus(p: np.ndarray, top_p: float) -> Nucleus:
    """The smallest prefix of p sorted descending (ties by index) whose mass reaches top_p of
    the total (everything if rounding keeps it short). Masses per high 16 bits find the bucket
    where the prefix ends; inside it a sort, or for a crowded bucket masses per low 16 bits
    and its ties in index order (a weighted radix select: no sort of the vocabulary)."""
    bits = p.view(np.int32)
    high = bits >> LOW_BITS
    above = np.cumsum(np.bincount(high, weights=p, minlength=NUM_BUCKETS)[::-1])  # [NB] mass in buckets >= each
    goal = top_p * above[-1]
    j = min(int(np.searchsorted(above, goal)), NUM_BUCKETS - 1)
    edge, before = NUM_BUCKETS - 1 - j, (above[j - 1] if j else 0.0)
    cand = np.flatnonzero(high == edge)  # ascending index
    if cand.shape[0] <= SORT_MAX:  # a small edge bucket: sort it (descending, ties by index)
        order = cand[np.argsort(-p[cand], kind="stable")]
        running = before + np.cumsum(p[order], dtype=np.float64)
        return Nucleus(
            high, above, edge, np.sort(order[: min(int(np.searchsorted(running, goal)), len(order) - 1) + 1])
        )
    low = bits[cand] & LOW_MASK
    inside = before + np.cumsum(np.bincount(low, weights=p[cand], minlength=LOW_MASK + 1)[::-1])
    j2 = min(int(np.searchsorted(inside, goal)), LOW_MASK)
    edge_low = LOW_MASK - j2
    keep = low > edge_low
    ties = np.flatnonzero(low == edge_low)  # one value, ascending index
    if ties.size:
        running = (inside[j2 - 1] if j2 else before) + np.cumsum(np.full(ties.shape[0], p[cand[ties[0]]], np.float64))
        keep[ties[: min(int(np.searchsorted(running, goal)), ties.shape[0] - 1) + 1]] = True
    return Nucleus(high, above, edge, cand[keep])


def _draw_wide(p: np.ndarray, top_p: float, u: float) -> int:
    """A token of a wide nucleus, walking its buckets highest first, each in index order:
    the bucket masses locate the draw, so only one bucket's members are gathered."""
    nuc = _nucleus(p, top_p)
    j = NUM_BUCKETS - 1 - nuc.edge  # buckets before the edge one, highest first
    whole = nuc.above[j - 1] if j else 0.0
    target = u * (whole + float(p[nuc.edge_kept].sum(dtype=np.float64)))
    if target >= whole:
        members, before = nuc.edge_kept, whole
    else:
        b = int(np.searchsorted(nuc.above[:j], target, side="right"))
        members, before = np.flatnonzero(nuc.high == NUM_BUCKETS - 1 - b), (nuc.above[b - 1] if b else 0.0)
    c = before + np.cumsum(p[members], dtype=np.float64)
    return int(members[_walk_to(c, target, p[members])])


def _by_bucket(p: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Kept indices (ascending) in walk order: value bucket (high 16 bits of p) highest first,
    then index."""
    return kept[np.argsort(-(p[kept].view(np.int32) >> LOW_BITS), kind="stable")]


def _walk_to(c: np.ndarray, target: float, p: np.ndarray) -> int:
    """Position i with c[i-1] <= target < c[i] (c: running sums of p), never a zero p."""
    i = min(int(np.searchsorted(c, target, side="right")), c.shape[0] - 1)
    while p[i] == 0.0 and i > 0:  # rounding at the end: step back to a possible token
        i -= 1
    return i


CDF_BLOCK = 4096  # inverse CDF over the whole vocabulary: block sums first, then one block


def _inverse_cdf(p: np.ndarray, u: float) -> int:
    """The index i with cumsum(p)[i-1] <= u * sum(p) < cumsum(p)[i]; one pass over p."""
    V = p.shape[0]
    starts = np.arange(0, V, CDF_BLOCK)
    whole = V // CDF_BLOCK * CDF_BLOCK
    sums = p[:whole].reshape(-1, CDF_BLOCK).sum(axis=1)  # pairwise float32 sums of the full blocks
    if whole < V:
        sums = np.append(sums, p[whole:].sum())
    blocks = np.cumsum(sums, dtype=np.float64)  # [ceil(V / CDF_BLOCK)]
    target = u * blocks[-1]
    b = min(int(np.searchsorted(blocks, target, side="right")), len(blocks) - 1)
    before = blocks[b - 1] if b else 0.0
    inside = before + np.cumsum(p[starts[b] : starts[b] + CDF_BLOCK], dtype=np.float64)
    i = min(int(np.searchsorted(inside, target, side="right")), len(inside) - 1)
    while p[starts[b] + i] == 0.0 and starts[b] + i > 0:  # rounding at a block's end: step back
        i -= 1
    return int(starts[b] + i)
