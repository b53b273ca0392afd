"""Decode throughput of eprt vs transformers ``generate`` on the same local MoE checkpoint,
and eprt against this machine's roofline measured in the same run.

    python benchmarks/bench_decode_cpu.py [--dir /tmp/eprt-bench-moe] [--new-tokens 32] [--threads 1] [--repeats 3]

Builds (once) a ~115M-parameter Qwen3-MoE with random weights, then for batch 1 and 32
times prefill (1 new token) and prefill+decode (N new tokens) for both engines in the
same process, and reports decode tokens/s = B * (N - 1) / (t_N - t_1) and the ratio, t_N - t_1
the median of --repeats pairs (the machine is shared: one pair moves by 20%).
Both run greedy with EOS ignored, on the CPU, with the same thread count.

Roofline of a decode step: bytes it must read / single-row GEMV bandwidth at batch 1, and
max(that, FLOPs / GEMM FLOP/s at M = B) at larger batches, both measured here (median
pass of the faster weight layout, passes before each of eprt's pairs and after the last: the
shared machine's load moves both, so they sample the same minutes) on weights larger than the
last-level cache. Bytes: the weights the step touches (attention, router, the experts its B
tokens choose, lm_head) and its KV; FLOPs: 2 per active weight per token, plus attention.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time


def _threads_from_argv() -> int:
    """--threads must take effect before NumPy (OpenBLAS) and torch start their pools."""
    for i, a in enumerate(sys.argv):
        if a == "--threads" and i + 1 < len(sys.argv):
            return int(sys.argv[i + 1])
        if a.startswith("--threads="):
            return int(a.split("=", 1)[1])
    return os.cpu_count() or 1


THREADS = _threads_from_argv()
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = str(THREADS)

import numpy as np  # noqa: E402

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


ROOFLINE_MATRICES = 12  # [4096, 1024] float32 weights, 16 MiB each: 192 MiB, past any L3


def _pass_seconds(fn, reps: int = 4) -> list[float]:
    fn()
    return [timed(fn) for _ in range(reps)]


def measure_machine(batch: int) -> dict:
    """Seconds per pass over 192 MiB of weights (read from memory, not cache) of single-row
    GEMVs and of GEMMs at M = batch, a few passes each, with the weights stored output-major
    ([N, K]) and input-major ([K, N]): OpenBLAS is faster on one or the other by shape."""
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((4096, 1024), dtype=np.float32) for _ in range(ROOFLINE_MATRICES)]  # [N, K]
    wts = [np.ascontiguousarray(w.T) for w in ws]  # [K, N]
    x1 = rng.standard_normal((1, 1024), dtype=np.float32)
    xb = rng.standard_normal((batch, 1024), dtype=np.float32)
    return {
        "gemv [N, K]": _pass_seconds(lambda: [w @ x1.T for w in ws]),
        "gemv [K, N]": _pass_seconds(lambda: [x1 @ w for w in wts]),
        "gemm [N, K]": _pass_seconds(lambda: [w @ xb.T for w in ws]),
        "gemm [K, N]": _pass_seconds(lambda: [xb @ w for w in wts]),
    }


def record(passes: list, batch: int) -> None:
    """Append one measure_machine to ``passes``."""
    passes.append(measure_machine(batch))


def machine_rates(batch: int, passes) -> tuple[float, float]:
    """(bytes/s, FLOP/s) of the faster layout's median pass over ``passes``, pooled: the machine
    is shared, so their median stands for what a run between them could get."""
    median = {key: float(np.median([t for p in passes for t in p[key]])) for key in passes[0]}
    gemv = min(median["gemv [N, K]"], median["gemv [K, N]"])
    gemm = min(median["gemm [N, K]"], median["gemm [K, N]"])
    size = ROOFLINE_MATRICES * 4096 * 1024
    return 4.0 * size / gemv, 2.0 * batch * size / gemm


def roofline(batch: int, cost: tuple[float, float], bandwidth: float, flops: float) -> tuple[float, str]:
    """(tokens/s, bound) of a decode step of ``cost`` (bytes, FLOPs) at the machine's rates."""
    t_mem, t_flop = cost[0] / bandwidth, cost[1] / flops
    t_flop = t_flop if batch > 1 else 0.0  # one row: every GEMM is a GEMV, bandwidth is the bound
    return batch / max(t_mem, t_flop), "memory" if t_mem >= t_flop else "FLOPs"


def step_cost(cfg, batch: int, context: float) -> tuple[float, float]:
    """(bytes, FLOPs) one decode step of ``batch`` rows at mean ``context`` must read/do (float32)."""
    d, dh = cfg.hidden_size, cfg.head_dim
    attn = d * dh * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)  # q, o, k, v
    expert = 3 * d * cfg.moe_intermediate_size
    touched = cfg.num_experts * (1 - (1 - cfg.top_k / cfg.num_experts) ** batch)  # distinct experts hit
    weights_read, active = cfg.vocab_size * d, cfg.vocab_size * d  # lm_head
    for sparse in cfg.sparse_layers:
        mlp_read = d * cfg.num_experts + touched * expert if sparse else 3 * d * cfg.intermediate_size
        mlp_active = d * cfg.num_experts + cfg.top_k * expert if sparse else 3 * d * cfg.intermediate_size
        shared = 3 * d * cfg.shared_expert_intermediate_size
        weights_read += attn + mlp_read + shared
        active += attn + mlp_active + shared
    kv = 2 * cfg.num_layers * batch * context * cfg.num_kv_heads * dh  # K and V elements read
    attn_flops = 4 * cfg.num_layers * batch * context * cfg.num_heads * dh
    return 4.0 * (weights_read + kv), 2.0 * batch * active + attn_flops


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def decode_seconds(run, n: int, repeats: int, between=lambda: None) -> list[float]:
    """(prefill + n tokens) - (prefill + 1 token) of ``repeats`` pairs, each back to back, with
    ``between()`` before each pair."""
    run(2)  # warm-up
    seconds = []
    for _ in range(repeats):
        between()
        first = timed(lambda: run(1))
        seconds.append(timed(lambda: run(n)) - first)
    return seconds


def bench_transformers(path, prompts, n, repeats):
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

    return decode_seconds(run, n, repeats)


def bench_eprt(path, prompts, n, max_batch, repeats, between):
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

        return decode_seconds(run, n, repeats, between)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/eprt-bench-moe")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--threads", type=int, default=THREADS, help="BLAS/torch threads (default: all cores)")
    ap.add_argument("--repeats", type=int, default=3, help="timed pairs per engine and batch; the median counts")
    args = ap.parse_args()
    from checkpoints import build_checkpoint

    from eprt.model.config import load_config

    path = build_checkpoint("qwen3_moe", args.dir, **BENCH_MODEL)
    cfg = load_config(path)
    import torch

    torch.set_num_threads(THREADS)
    print(
        f"model: {path} ({cfg.param_count() / 1e6:.0f}M parameters, {cfg.num_experts} experts, top-{cfg.top_k}); "
        f"torch threads {torch.get_num_threads()}, new tokens {args.new_tokens}"
    )
    rng = np.random.default_rng(0)
    print(
        f"{'batch':>5} {'eprt tok/s':>11} {'hf tok/s':>9} {'eprt/hf':>8} {'GEMV GB/s':>10} {'GEMM GF/s':>10} "
        f"{'bound':>7} {'roof tok/s':>11} {'eprt/roof':>10}"
    )
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = rng.integers(3, cfg.vocab_size, size=(b, args.prompt_len)).tolist()
        n = args.new_tokens
        passes = []  # the machine's passes before each eprt pair and after the last
        eprt_seconds = bench_eprt(path, prompts, n, max(b, 1), args.repeats, functools.partial(record, passes, b))
        passes.append(measure_machine(b))
        hf_seconds = bench_transformers(path, prompts, n, args.repeats)
        cost = step_cost(cfg, b, args.prompt_len + n / 2)
        bw, flops = machine_rates(b, passes)
        roof, bound = roofline(b, cost, bw, flops)
        e_tps, h_tps = b * (n - 1) / np.median(eprt_seconds), b * (n - 1) / np.median(hf_seconds)
        print(
            f"{b:5d} {e_tps:11.1f} {h_tps:9.1f} {e_tps / h_tps:8.2f} {bw / 1e9:10.1f} {flops / 1e9:10.1f} "
            f"{bound:>7} {roof:11.1f} {e_tps / roof:10.0%}",
            flush=True,
        )


if __name__ == "__main__":
    main()
