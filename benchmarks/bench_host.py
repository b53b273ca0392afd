"""Host overhead per decode step at batch 256 on a model whose compute is negligible (one
layer, hidden 16, vocabulary 512): scheduler, runner, executor bookkeeping and frame
encoding on rank 0 (one rank, so no MPI wait), with and without ``--overlap``.

    python benchmarks/bench_host.py [--batch 256] [--new-tokens 64] [--rounds 5] [--device cpu|cuda] [--profile]

Step time = (t_N - t_1) / (N - 1) of one engine.generate of B requests (greedy, then sampled
with a seed per request), the overlap off and on in turn on one engine, best and median of
``--rounds``; "forward" is the time inside the model's forward pass (every op, attention and
the MoE included; with the overlap on it runs on the helper thread), "host" the rest of the
step: the host time the forward pass did not hide (on a GPU "forward" is the time to launch it).
"cpu ms" is the process's CPU time per step (both threads), median: on a shared machine it
moves less with the other processes' load than the wall-clock columns do.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one BLAS thread: this measures the host, not the BLAS pool

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import numpy as np  # noqa: E402

TINY_MODEL = dict(
    vocab_size=512,
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=8,
    intermediate_size=16,
    mlp_only_layers=[],
    max_position_embeddings=1024,
)


def timed(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of fn()."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


class ForwardClock:
    """Accumulates the seconds spent in the model's forward (hidden states and logits)."""

    def __init__(self, model):
        self.seconds = 0.0
        for name in ("hidden_states", "logits"):
            setattr(model, name, self._timed(getattr(model, name)))

    def _timed(self, fn):
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t

        return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="runs of each variant, interleaved")
    ap.add_argument("--dir", default="/tmp/eprt-bench-tiny")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--profile", action="store_true", help="print the top functions of one timed run per variant")
    args = ap.parse_args()
    from checkpoints import build_checkpoint

    from eprt.api import GenerationRequest, SamplingParams
    from eprt.engine.engine import EngineConfig, launch_engine

    path = build_checkpoint("qwen3_moe", args.dir, **TINY_MODEL)
    b, n = args.batch, args.new_tokens
    prompts = np.random.default_rng(0).integers(3, TINY_MODEL["vocab_size"], size=(b, 8)).tolist()
    sampling = {
        "greedy": lambda i, k: SamplingParams(max_tokens=k, ignore_eos=True),
        "sampled": lambda i, k: SamplingParams(max_tokens=k, ignore_eos=True, temperature=0.8, top_p=0.95, seed=i),
    }
    cfg = EngineConfig(model=path, device=args.device, max_batch=b, max_model_len=128, prefix_cache=False, overlap=True)
    times: dict = {}  # (sampling, overlap) -> [(step s, forward s, cpu s)]
    with launch_engine(cfg) as engine:
        clock = ForwardClock(engine.runner.executor.model)
        overlap = engine.runner.overlap

        def run(kind, k):
            reqs = [GenerationRequest(p, sampling[kind](i, k)) for i, p in enumerate(prompts)]
            assert all(len(r.token_ids) == k for r in engine.generate(reqs))

        for kind in sampling:
            run(kind, 2)
            for _ in range(args.rounds):
                for on in (False, True):
                    engine.runner.overlap = overlap if on else None
                    clock.seconds = 0.0
                    (t1, c1) = timed(lambda: run(kind, 1))  # noqa: B023
                    f1, clock.seconds = clock.seconds, 0.0
                    (tn, cn) = timed(lambda: run(kind, n))  # noqa: B023
                    step, forward, cpu = (tn - t1) / (n - 1), (clock.seconds - f1) / (n - 1), (cn - c1) / (n - 1)
                    times.setdefault((kind, on), []).append((step, forward, cpu))
        if args.profile:
            for on in (False, True):
                engine.runner.overlap = overlap if on else None
                print(f"--- profile, greedy, overlap {'on' if on else 'off'}")
                prof = cProfile.Profile()
                prof.runcall(run, "greedy", n)
                pstats.Stats(prof).sort_stats("tottime").print_stats(15)
        engine.runner.overlap = overlap
    print(f"model {path}: batch {b}, {n} new tokens, one rank; {args.rounds} rounds of off/on interleaved")
    print(
        f"{'sampling':>8} {'overlap':>7} {'step ms':>8} {'forward ms':>11} {'host ms':>8} {'host ms median':>15} "
        f"{'cpu ms median':>14}"
    )
    for (kind, on), runs in times.items():
        step, forward, _ = min(runs)
        host = float(np.median([s - f for s, f, _ in runs]))
        cpu = float(np.median([c for _, _, c in runs]))
        print(
            f"{kind:>8} {'on' if on else 'off':>7} {step * 1e3:8.2f} {forward * 1e3:11.2f} "
            f"{(step - forward) * 1e3:8.2f} {host * 1e3:15.2f} {cpu * 1e3:14.2f}"
        )


if __name__ == "__main__":
    main()
