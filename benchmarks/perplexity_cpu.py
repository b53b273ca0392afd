"""Held-out perplexity of the built-in model at each CPU weight precision (``--cpu-weights``).

    python benchmarks/perplexity_cpu.py [--weights f32,bf16,int8] [--groups 32,64] [--windows 0]

The held-out text is scripts/train_default_model.py's (every tenth standard-library module's
docstrings, as bytes), cut into the same non-overlapping windows of its context (256 bytes);
each window is prefilled through eprt (NumpyOps, the compiled kernels) and every position's
next-byte cross entropy is averaged, as the script's ``--check`` does with transformers. bf16
(the shipped weights held as they are) must equal f32 (their float32 upcast) exactly; int8 (per
group of 32 or 64 along k, activations too) is compared with f32: perplexity exp(loss) and its
relative difference.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))


def held_out_windows(limit: int) -> tuple[np.ndarray, int]:
    """([N, context + 1] windows of the held-out ids, context), the training script's split."""
    import train_default_model as train

    _, held_out, _ = train.corpus(sysconfig.get_paths()["stdlib"])
    context = train.TrainSettings().context
    n = (len(held_out) - 1) // context
    if limit:
        n = min(n, limit)
    ids = np.asarray(held_out[: n * context + 1], dtype=np.int64)
    windows = np.stack([ids[i * context : (i + 1) * context + 1] for i in range(n)])
    return windows, context


def mean_loss(weights: str, windows: np.ndarray, threads: int) -> float:
    """Mean next-byte cross entropy (nats) over every position of every window, eprt's logits."""
    from eprt.engine.executor import ShardExecutor
    from eprt.model.loader import load_model
    from eprt.ops.numpy_ops import NumpyOps

    lm = load_model(None, NumpyOps("numba", weights=weights, threads=threads), max_len=windows.shape[1])
    ex = ShardExecutor(lm.model, 2 * windows.shape[1] // 16 + 2, 16, 1, prefix_cache=False)
    total = 0.0
    for w in windows:
        prompt = w[:-1].tolist()
        ex.allocate(0, prompt)
        ex.prefill(0, prompt, 0, len(prompt), keep_hidden=True)
        logits = np.asarray(lm.model.logits(ex.prefill_hidden), dtype=np.float64)  # [T, V]
        top = logits.max(axis=1, keepdims=True)
        log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
        total += float((log_z - logits[np.arange(len(prompt)), w[1:]]).sum())
        ex.free(0)
    return total / windows[:, 1:].size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="f32,bf16,int8", help="precisions to evaluate (f32 first: the reference)")
    ap.add_argument("--groups", default="32,64", help="int8 groups along k")
    ap.add_argument("--windows", type=int, default=0, help="evaluate only the first N windows (0: all)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    windows, context = held_out_windows(args.windows)
    print(f"held-out: {windows.shape[0]} windows of {context} bytes ({windows[:, 1:].size} predicted bytes)")
    runs = []
    for weights in args.weights.split(","):
        for group in args.groups.split(",") if weights == "int8" else [None]:
            if group is not None:
                os.environ["EPRT_CPU_INT8_GROUP"] = group
            start = time.perf_counter()
            loss = mean_loss(weights, windows, args.threads)
            label = weights if group is None else f"int8 g{group}"
            runs.append((label, loss))
            seconds = time.perf_counter() - start
            print(f"{label}: {loss:.5f} nats/byte, perplexity {math.exp(loss):.4f} ({seconds:.0f} s)", flush=True)
    reference = dict(runs).get("f32")
    if reference is not None:
        print(f"{'weights':>10} {'nats/byte':>10} {'perplexity':>11} {'vs f32':>8}")
        for label, loss in runs:
            print(f"{label:>10} {loss:10.5f} {math.exp(loss):11.4f} {math.exp(loss - reference) - 1:+8.3%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
