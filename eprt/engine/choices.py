"""Several choices of one prompt (``n``, ``best_of``): each choice's sampling key, the logprob
of a sampled token for best_of's ranking, and the ranking itself (docs/design.md, "Choices").

m rows, V vocabulary.
"""

from __future__ import annotations

import hashlib

import numpy as np

from eprt.api import GenerationResult

CHOICE_KEY_BITS = 128  # Philox's key size


def choice_seed(seed: int, choice: int) -> int:
    """The sampling key of choice ``choice`` of a request keyed ``seed``: the key itself for
    choice 0 (so n = 1 samples as before), a hash of (seed, choice) for the others."""
    if choice == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{choice}".encode(), digest_size=CHOICE_KEY_BITS // 8).digest()
    return int.from_bytes(digest, "little")


def token_logprobs(logits: np.ndarray, temperatures: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """log softmax(logits[r] / T[r])[tokens[r]] of each row (T = 0: the raw logits), float64 [m]:
    the probability the sampler drew each token with (the maximum subtracted first, so a tiny
    temperature sends the others to -inf, never to +inf)."""
    x = np.asarray(logits, dtype=np.float64)  # [m, V]
    t = np.where(temperatures > 0.0, temperatures, 1.0)[:, None]  # [m, 1]
    with np.errstate(over="ignore"):
        x = (x - x.max(axis=1, keepdims=True)) / t  # [m, V], max 0
    lse = np.log(np.exp(x).sum(axis=1))  # [m]
    return x[np.arange(x.shape[0]), tokens] - lse


def best_choices(results: list, n: int) -> list[GenerationResult]:
    """The ``n`` results with the highest cumulative logprob (ties: lower index first),
    re-indexed 0..n-1 in that order; results without one (errors) rank last."""

    def score(r: GenerationResult) -> float:
        return -np.inf if r.cumulative_logprob is None else r.cumulative_logprob

    ranked = sorted(results, key=lambda r: (-score(r), r.index))[:n]
    for i, r in enumerate(ranked):
        r.index = i
    return ranked


def ranked(pairs: list, params) -> list:
    """(result, companion) pairs of one prompt's choices -> the pairs returned: all of them, or with
    ``params.best_of`` the n most likely (``best_choices``), each result keeping its companion."""
    if params.best_of is None:
        return list(pairs)
    companion = {id(result): other for result, other in pairs}
    return [(result, companion[id(result)]) for result in best_choices([r for r, _ in pairs], params.n)]
