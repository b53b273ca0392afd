"""Decode throughput of eprt vs transformers ``generate`` on the same local MoE checkpoint.

    python benchmarks/bench_decode_cpu.py [--dir /tmp/eprt-bench-moe] [--new-tokens 32]

Builds (once) a ~115M-parameter Qwen3-MoE with random weights, then for batch 1 and 32
times prefill (1 new token) and prefill+decode (N new tokens) for both engines in the
same process, and reports decode tokens/s = B * (N - 1) / (t_N - t_1) and the ratio.
Both run greedy with EOS ignored, on the CPU, with the same thread count.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

BENCH_MODEL = dict(
    vocab_size=8192,
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=512,
    mlp_only_layers=[],
    tie_word_embeddings=False,
    max_position_embeddings=1024,
)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_transformers(path, prompts, n):
    import torch
    from checkpoints import load_reference

    model = load_reference(path)
    ids = torch.tensor(prompts)

    def run(k):
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=k,
                min_new_tokens=k,
                pad_token_id=0,
            )
        assert out.shape[1] == ids.shape[1] + k

    run(2)  # warm-up
    return timed(lambda: run(1)), timed(lambda: run(n))


def bench_eprt(path, prompts, n, max_batch):
    from eprt.api import GenerationRequest, SamplingParams
    from eprt.engine.engine import EngineConfig, launch_engine

    cfg = EngineConfig(model=path, device="cpu", max_batch=max_batch, max_model_len=256, prefix_cache=False)
    with launch_engine(cfg) as engine:

        def run(k):
            reqs = [
                GenerationRequest(prompt_ids=p, params=SamplingParams(max_tokens=k, ignore_eos=True)) for p in prompts
            ]
            res = engine.generate(reqs)
            assert all(len(r.token_ids) == k for r in res)

        run(2)
        return timed(lambda: run(1)), timed(lambda: run(n))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/eprt-bench-moe")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--batches", default="1,32")
    args = ap.parse_args()
    from checkpoints import build_checkpoint

    from eprt.model.config import load_config

    path = build_checkpoint("qwen3_moe", args.dir, **BENCH_MODEL)
    cfg = load_config(path)
    import torch

    print(
        f"model: {path} ({cfg.param_count() / 1e6:.0f}M parameters, {cfg.num_experts} experts, top-{cfg.top_k}); "
        f"torch threads {torch.get_num_threads()}, new tokens {args.new_tokens}"
    )
    rng = np.random.default_rng(0)
    print(f"{'batch':>5} {'eprt tok/s':>11} {'hf tok/s':>9} {'eprt/hf':>8}")
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = rng.integers(3, cfg.vocab_size, size=(b, args.prompt_len)).tolist()
        n = args.new_tokens
        e1, en = bench_eprt(path, prompts, n, max_batch=max(b, 1))
        h1, hn = bench_transformers(path, prompts, n)
        e_tps, h_tps = b * (n - 1) / (en - e1), b * (n - 1) / (hn - h1)
        print(f"{b:5d} {e_tps:11.1f} {h_tps:9.1f} {e_tps / h_tps:8.2f}", flush=True)


if __name__ == "__main__":
    main()
