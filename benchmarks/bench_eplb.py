"""EPLB on a skewed router: tokens-per-rank imbalance and decode step time, EPLB off vs on.

    python benchmarks/bench_eplb.py [--world 4] [--batch 32] [--steps 16] [--redundant 4]

Builds (once) a DeepSeek-V3-style checkpoint (16 experts, top-4, experts ~90% of the weights)
whose router score bias (e_score_correction_bias, selection only) favours 4 hot experts, 3 of
them on rank 0 under the contiguous placement. Then ``mpiexec -n WORLD`` runs this script
(``--child``) twice: EPLB off, which also writes the expert-load statistics (--stats-out's
file), and EPLB on: ``--num-redundant-experts R --init-expert-placement`` that file. Each rank
counts the (token, choice) rows its experts compute in decode steps and the CPU time it spends
in them; rank 0 times each decode forward pass (combines included: it waits for the slowest
rank). Printed: rows per rank, imbalance (max - mean) / mean, the busiest rank's expert CPU ms
per step, and the median decode step.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

HOT = (0, 1, 2, 5)  # contiguous over 4 ranks: 0, 1, 2 on rank 0, 5 on rank 1
MODEL = dict(
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=512,
    n_routed_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=768,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=0,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    num_nextn_predict_layers=0,
    max_position_embeddings=1024,
)


def build(path: str, bias: float) -> str:
    """The checkpoint, its router score bias raised by ``bias`` for the HOT experts of every layer."""
    from checkpoints import build_checkpoint
    from safetensors.numpy import load_file, save_file

    marker = os.path.join(path, f"skew-{bias}")
    if os.path.isfile(marker):
        return path
    build_checkpoint("deepseek_v3", path, **MODEL)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name in tensors:
        if name.endswith("e_score_correction_bias"):
            tensors[name][list(HOT)] += bias
    save_file(tensors, file, metadata={"format": "pt"})
    open(marker, "w").close()
    return path


def child(args) -> None:
    from eprt.api import GenerationRequest, SamplingParams
    from eprt.engine.config import EplbConfig
    from eprt.engine.engine import EngineConfig, launch_engine
    from eprt.engine.executor import ShardExecutor
    from eprt.engine.expert_load import write_stats
    from eprt.ops.numpy_ops import NumpyOps

    calls = []  # (rows in the call, rows this rank computed, thread CPU seconds), decode-sized calls only
    decode_rows = {args.batch, args.batch * MODEL["num_experts_per_tok"]}  # EPLB off: [B, k] ids; on: [B*k, 1]
    inner = NumpyOps.moe_experts

    def counted(self, x, weights, ids, w_gate_up, w_down, expert_start):
        t0 = time.thread_time()
        out = inner(self, x, weights, ids, w_gate_up, w_down, expert_start)
        if x.shape[0] in decode_rows:
            local = ((ids >= expert_start) & (ids < expert_start + w_gate_up.shape[0])).sum()
            calls.append((x.shape[0], int(local), time.thread_time() - t0))
        return out

    NumpyOps.moe_experts = counted
    steps, decode = [], ShardExecutor.decode

    def timed(self, slots, tokens):
        t0 = time.perf_counter()
        out = decode(self, slots, tokens)
        steps.append(time.perf_counter() - t0)
        return out

    ShardExecutor.decode = timed
    eplb = EplbConfig(num_redundant_experts=args.redundant, init_expert_placement=args.placement or None)
    cfg = EngineConfig(
        model=args.dir, device="cpu", max_batch=args.batch, max_model_len=512, prefix_cache=False, eplb=eplb
    )
    prompts = [[3 + (7 * i + j) % 4000 for j in range(16)] for i in range(args.batch)]

    def run(n):
        return engine.generate([GenerationRequest(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts])

    rank, result = None, None
    try:
        with launch_engine(cfg) as engine:
            rank = 0
            run(2)  # warm-up
            calls.clear()
            steps.clear()
            run(args.steps + 1)
            if args.stats_out:
                write_stats(args.stats_out, engine.expert_load(refresh=True), engine.model_name, engine.transport.size)
            result = {"step_ms": 1e3 * sorted(steps)[len(steps) // 2]}  # the median decode forward pass
    except SystemExit:
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.rank
    # rank 0 clears its counts before the timed run; workers count every decode-sized call, so they
    # keep only as many of their last calls as rank 0 made
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "calls": calls, **(result or {})}, f)


def summarize(out_dir: str) -> dict:
    ranks = sorted(
        (json.load(open(p)) for p in glob.glob(os.path.join(out_dir, "rank*.json"))), key=lambda r: r["rank"]
    )
    n = len(ranks[0]["calls"])
    rows = [sum(c[1] for c in r["calls"][-n:]) for r in ranks]
    cpu = [sum(c[2] for c in r["calls"][-n:]) for r in ranks]
    mean = sum(rows) / len(rows)
    return {"rows": rows, "imbalance": (max(rows) - mean) / mean, "cpu": cpu, "step_ms": ranks[0]["step_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/eprt-bench-eplb")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--redundant", type=int, default=4)
    ap.add_argument("--bias", type=float, default=0.2, help="router score bias of the hot experts")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--placement", default="", help=argparse.SUPPRESS)
    ap.add_argument("--stats-out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    build(args.dir, args.bias)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", EPRT_LOG_LEVEL="WARNING")
    work = tempfile.mkdtemp(prefix="bench-eplb-")
    stats = os.path.join(work, "stats.json")
    results = {}
    for name, extra in (("off", ["--redundant", "0", "--stats-out", stats]), ("on", ["--placement", stats])):
        out = os.path.join(work, name)
        os.makedirs(out)
        cmd = ["mpiexec", "-n", str(args.world), sys.executable, os.path.abspath(__file__), "--child"]
        cmd += ["--dir", args.dir, "--batch", str(args.batch), "--steps", str(args.steps), "--out", out]
        cmd += ["--redundant", str(args.redundant), *extra]
        subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, check=True)
        results[name] = summarize(out)
    print(
        f"skewed router: experts {HOT} score bias +{args.bias}; -n {args.world}, batch {args.batch}, "
        f"{args.steps} decode steps, 1 BLAS thread per rank; EPLB on: {args.redundant} redundant slots, "
        f"global policy from the EPLB-off run's expert counts"
    )
    head = f"{'EPLB':>4} {'(token, choice) rows per rank':>34} {'imbalance':>9} {'busiest expert CPU ms/step':>27}"
    print(f"{head} {'step ms':>8}")
    for name, r in results.items():
        busiest = 1e3 * max(r["cpu"]) / args.steps
        print(f"{name:>4} {str(r['rows']):>34} {r['imbalance']:9.3f} {busiest:27.2f} {r['step_ms']:8.2f}")


if __name__ == "__main__":
    main()
