"""Decode throughput of eprt vs transformers ``generate`` on the same local MoE checkpoint,
eprt at each CPU weight precision and thread count against today's float32 on one thread, and
each against this machine's roofline measured in the same run.

    python benchmarks/bench_decode_cpu.py [--dir /tmp/eprt-bench-moe] [--new-tokens 32] [--threads 1] [--repeats 3]
        [--variants f32@1,bf16@1,int8@1,f32@2,bf16@2,int8@2] [--no-hf]

Builds (once) a ~115M-parameter Qwen3-MoE with random weights and its bfloat16 copy (the
variants read that one: f32 is today's upcast at load, bf16 keeps it resident, int8 quantizes it
at load; f32 and bf16 must give the same tokens, which is checked), then for batch 1 and 32
times prefill (1 new token) and prefill+decode (N new tokens) and reports decode tokens/s =
B * (N - 1) / (t_N - t_1). The variants' engines are open together and run in turn, a pair of
each per repeat, so the machine's drifts hit them alike; tok/s is the median of --repeats pairs,
the speed-up against f32@1 the median of the per-repeat ratios [min, max]. transformers (float32,
--threads threads) runs after them.

Roofline of a decode step: bytes it must read / single-row GEMV bandwidth at batch 1, and
max(that, FLOPs / GEMM FLOP/s at M = B) at larger batches, both measured here with OpenBLAS on
as many threads as the variant (median pass of the faster weight layout, passes before each
repeat and after the last: the shared machine's load moves both, so they sample the same
minutes) on weights larger than the last-level cache. Bytes: the weights the step touches
(attention, router, the experts its B tokens choose, lm_head) at the variant's bytes per weight
(4, 2, int8 1 + 4 / group) and its float32 KV; FLOPs: 2 per active weight per token, plus
attention (int8's dot products run on integer units: its bound is the bytes alone).
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
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from eprt.ops.cpu_threads import limit_blas_spin  # noqa: E402

limit_blas_spin()  # as the eprt command does, before NumPy loads

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from checkpoints import BENCH_MODEL  # noqa: E402  (the ~115M Qwen3-MoE these benchmarks build)

ROOFLINE_MATRICES = 12  # [4096, 1024] float32 weights, 16 MiB each: 192 MiB, past any L3


def _pass_seconds(fn, reps: int = 4) -> list[float]:
    fn()
    return [timed(fn, VARIANT_CLOCK[0]) for _ in range(reps)]


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


def record(passes: dict, batch: int) -> None:
    """Append one measure_machine to ``passes[t]`` with OpenBLAS on t threads, for each t."""
    from eprt.ops.cpu_threads import set_blas_threads

    for threads, runs in passes.items():
        set_blas_threads(threads)
        runs.append(measure_machine(batch))


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


def step_cost(cfg, batch: int, context: float, weight_bytes: float = 4.0) -> tuple[float, float]:
    """(bytes, FLOPs) one decode step of ``batch`` rows at mean ``context`` must read/do, weights
    of ``weight_bytes`` bytes each, float32 KV."""
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
    return weight_bytes * weights_read + 4.0 * kv, 2.0 * batch * active + attn_flops


def weight_bytes(weights: str) -> float:
    """Bytes per weight resident at ``weights`` (int8: a float32 scale per group)."""
    from eprt.ops.cpu_weights import int8_group

    return {"f32": 4.0, "bf16": 2.0}.get(weights, 1.0 + 4.0 / int8_group())


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
VARIANT_CLOCK = ["wall"]  # --clock: how eprt's variants are timed


def timed(fn, clock: str = "wall") -> float:
    t = CLOCKS[clock]()
    fn()
    return CLOCKS[clock]() - t


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


def timed_both(fn) -> dict:
    """{clock: seconds} of one call of fn, by every clock."""
    start = {c: clock() for c, clock in CLOCKS.items()}
    fn()
    return {c: clock() - start[c] for c, clock in CLOCKS.items()}


def eprt_engine(stack, path, max_batch: int, variant: tuple, max_model_len: int = 256):
    """An engine of ``variant`` (CPU weights, compute threads) on checkpoint ``path``, open on ``stack``."""
    from eprt.engine.engine import EngineConfig, launch_engine

    weights, threads = variant
    cfg = EngineConfig(
        model=path,
        device="cpu",
        max_batch=max_batch,
        max_model_len=max_model_len,
        prefix_cache=False,
        cpu_weights=weights,
        cpu_threads=threads,
    )
    return stack.enter_context(launch_engine(cfg))


def eprt_run(engine, prompts, threads: int, tokens: dict, key):
    """run(k): ``prompts`` through ``engine`` to k greedy tokens each (OpenBLAS on ``threads``
    threads), their ids kept in ``tokens[key]``."""
    from eprt.api import GenerationRequest, SamplingParams
    from eprt.ops.cpu_threads import set_blas_threads

    def run(k):
        set_blas_threads(threads)
        reqs = [GenerationRequest(prompt_ids=p, params=SamplingParams(max_tokens=k, ignore_eos=True)) for p in prompts]
        res = engine.generate(reqs)
        assert all(len(r.token_ids) == k for r in res)
        tokens[key] = [r.token_ids for r in res]

    return run


def decode_timing(n: int):
    """timing(run) -> {clock: (prefill + n tokens) - (prefill + 1 token)}, back to back."""

    def timing(run):
        first = timed_both(lambda: run(1))
        whole = timed_both(lambda: run(n))
        return {c: whole[c] - first[c] for c in CLOCKS}

    return timing


def alternate(runs: dict, repeats: int, between, timing) -> dict:
    """{clock: {key: seconds of each repeat}}: per repeat ``between()``, then ``timing(run)`` of
    each of ``runs`` in turn, so the machine's drifts hit them alike."""
    seconds = {c: {key: [] for key in runs} for c in CLOCKS}
    for _ in range(repeats):
        between()
        for key, run in runs.items():
            for c, s in timing(run).items():
                seconds[c][key].append(s)
    return seconds


def bench_variants(path, prompts, n, max_batch, variants, repeats, between):
    """{clock: {variant: decode seconds of each repeat}}, {variant: token ids}: one engine per
    variant (weights, threads), all open, a pair of each in turn per repeat, timed by both clocks,
    ``between()`` before each repeat."""
    import contextlib

    tokens = {}
    with contextlib.ExitStack() as stack:
        runs = {}
        for v in variants:
            runs[v] = eprt_run(eprt_engine(stack, path, max_batch, v), prompts, v[1], tokens, v)
            runs[v](2)  # warm-up
        seconds = alternate(runs, repeats, between, decode_timing(n))
    return seconds, tokens


def parse_variants(text: str) -> list:
    """ "f32@1,bf16@2" -> [("f32", 1), ("bf16", 2)]; today's float32 on one thread comes first."""
    variants = []
    for part in text.split(","):
        weights, _, threads = part.partition("@")
        if weights not in ("f32", "bf16", "int8") or not threads.isdigit() or int(threads) < 1:
            raise SystemExit(f"--variants: {part!r} is not WEIGHTS@THREADS (f32, bf16 or int8 @ 1, 2, ..)")
        variants.append((weights, int(threads)))
    return [("f32", 1)] + [v for v in variants if v != ("f32", 1)]


def spread(values) -> str:
    """median [min, max] of ratios."""
    return f"{np.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def report_threads(b, variants, wall) -> None:
    """Under --clock cpu: each precision's wall-clock speed-up on more threads than one, per repeat
    (CPU time adds the threads' work up, so only the wall clock shows what they gain)."""
    for weights, threads in variants:
        if threads > 1 and (weights, 1) in wall:
            ratios = [one / more for one, more in zip(wall[(weights, 1)], wall[(weights, threads)])]
            print(f"{b:5d} {weights}@{threads} vs {weights}@1, wall clock: {spread(ratios)}", flush=True)


def report_batch(cfg, b, n, context, variants, seconds, passes) -> None:
    """One table row per variant: tok/s, speed-up against f32@1, roofline and its fraction."""
    base = seconds[("f32", 1)]
    for v in variants:
        weights, threads = v
        bw, flops = machine_rates(b, passes[threads])
        cost = step_cost(cfg, b, context, weight_bytes(weights))
        if weights == "int8":  # integer dot products: the measured float32 FLOP rate is no bound
            roof, bound = b * bw / cost[0], "memory"
        else:
            roof, bound = roofline(b, cost, bw, flops)
        tps = b * (n - 1) / np.median(seconds[v])
        ratios = [f / s for f, s in zip(base, seconds[v])]
        print(
            f"{b:5d} {weights + '@' + str(threads):>8} {tps:9.1f} {spread(ratios):>19} {bw / 1e9:9.1f} "
            f"{flops / 1e9:9.1f} {bound:>7} {roof:10.1f} {tps / roof:8.0%}",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/eprt-bench-moe")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--threads", type=int, default=THREADS, help="transformers' threads (default: all cores)")
    ap.add_argument("--repeats", type=int, default=3, help="timed pairs per variant and batch; the median counts")
    ap.add_argument(
        "--variants",
        default="f32@1,bf16@1,int8@1,f32@2,bf16@2,int8@2",
        help="eprt's CPU weights @ compute threads (f32@1, today's path, is always run and compared with)",
    )
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="time eprt's variants by the wall clock, or by this process's CPU time (all its threads: on a "
        "loaded machine the one-thread variants' work without the waits for a core, the machine's passes too; "
        "not a throughput of several threads: each precision's wall-clock speed-up on more threads is printed "
        "after its table)",
    )
    args = ap.parse_args()
    VARIANT_CLOCK[0] = args.clock
    from checkpoints import build_bf16_copy, build_checkpoint

    from eprt.model.config import load_config

    path = build_checkpoint("qwen3_moe", args.dir, **BENCH_MODEL)
    bf16_path = build_bf16_copy(path, args.dir + "-bf16")
    cfg = load_config(path)
    variants = parse_variants(args.variants)
    import torch

    torch.set_num_threads(THREADS)
    print(
        f"model: {path} ({cfg.param_count() / 1e6:.0f}M parameters, {cfg.num_experts} experts, top-{cfg.top_k}), "
        f"eprt from its bf16 copy; torch threads {torch.get_num_threads()}, new tokens {args.new_tokens}, "
        f"eprt timed by the {args.clock} clock"
    )
    rng = np.random.default_rng(0)
    print(
        f"{'batch':>5} {'eprt':>8} {'tok/s':>9} {'vs f32@1 [min, max]':>19} {'GEMV GB/s':>9} {'GEMM GF/s':>9} "
        f"{'bound':>7} {'roof tok/s':>10} {'of roof':>8}"
    )
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = rng.integers(3, cfg.vocab_size, size=(b, args.prompt_len)).tolist()
        n = args.new_tokens
        passes = {t: [] for t in sorted({v[1] for v in variants})}  # the machine's passes per thread count
        between = functools.partial(record, passes, b)
        seconds, tokens = bench_variants(bf16_path, prompts, n, max(b, 1), variants, args.repeats, between)
        between()
        for v in variants:
            if v[0] != "int8" and tokens[v] != tokens[("f32", 1)]:
                raise SystemExit(f"batch {b}: {v[0]}@{v[1]} gave other tokens than f32@1")
        report_batch(cfg, b, n, args.prompt_len + n / 2, variants, seconds[args.clock], passes)
        if args.clock == "cpu":
            report_threads(b, variants, seconds["wall"])
        if not args.no_hf:
            hf = b * (n - 1) / np.median(bench_transformers(path, prompts, n, args.repeats))
            e_tps = b * (n - 1) / np.median(seconds["wall"][("f32", 1)])
            print(f"{b:5d} {'hf f32':>8} {hf:9.1f}   (eprt f32@1 / transformers {e_tps / hf:.2f})", flush=True)
    print("tokens: f32 and bf16 identical at every thread count (checked)")


if __name__ == "__main__":
    main()
