"""Host-side top-p sampling cost per row at a real vocabulary size: a full sort of the
vocabulary vs eprt's nucleus (sorts only a head of the largest probabilities when it holds
the nucleus), same process, same logits, same seeds; the sampled tokens must be identical.

    python benchmarks/bench_sampling.py                 # V = 151936 (Qwen3), 64 rows
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from eprt.api import SamplingParams
from eprt.engine import sampling


def full_sort_nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    order = np.argsort(-p, kind="stable")
    return order[: int(np.searchsorted(np.cumsum(p[order]), top_p) + 1)]


def run(logits: np.ndarray, params: SamplingParams) -> tuple[float, list[int]]:
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    tokens = [sampling.sample(row, params, rng) for row in logits]
    return (time.perf_counter() - t0) / len(logits) * 1e3, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", type=int, default=64)
    args = ap.parse_args()
    # Zipf-shaped next-token distributions (rank r has logit -1.1 ln r, ranks shuffled), as
    # language is; "flat" adds a wide random tail that holds most of the mass (worst case)
    rng = np.random.default_rng(1)
    ranks = np.arange(1, args.vocab + 1, dtype=np.float64)
    cases = {}
    zipf = np.stack([rng.permutation(-1.1 * np.log(ranks)) for _ in range(args.rows)]).astype(np.float32)
    cases["zipf"] = zipf
    cases["flat"] = (rng.standard_normal((args.rows, args.vocab)) * 2.0).astype(np.float32)
    print(f"V={args.vocab}, {args.rows} rows; ms per row")
    print(f"{'logits':>7} {'params':>20} {'full sort':>10} {'eprt':>8} {'speed-up':>9}")
    for name, logits in cases.items():
        for params in (SamplingParams(temperature=0.7, top_p=0.95), SamplingParams(temperature=1.0, top_p=0.9)):
            new_ms, new_tokens = run(logits, params)
            real = sampling.nucleus
            sampling.nucleus = full_sort_nucleus
            try:
                old_ms, old_tokens = run(logits, params)
            finally:
                sampling.nucleus = real
            assert new_tokens == old_tokens, "the nucleus changed a sampled token"
            label = f"T={params.temperature} top_p={params.top_p}"
            print(f"{name:>7} {label:>20} {old_ms:10.2f} {new_ms:8.2f} {old_ms / new_ms:9.2f}")


if __name__ == "__main__":
    main()
