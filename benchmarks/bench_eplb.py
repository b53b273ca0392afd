"""EPLB on a skewed router: tokens-per-rank imbalance and decode step time, EPLB off vs on.

    python benchmarks/bench_eplb.py [--world 4] [--batch 128] [--steps 16] [--redundant 4] [--repeats 3] [--bias 0.6]

Builds (once) a DeepSeek-V3-style checkpoint (16 experts, top-4, experts ~90% of the weights) whose
router score bias (e_score_correction_bias, selection only) favours 4 hot experts, 3 of them on rank
0 under the contiguous placement: at the default bias they take most of the rows, and at the default
batch a hot expert holds enough rows that its CPU time follows its rows (at batch 32 it is mostly
the read of its matrices, which balancing rows cannot even out). Then ``mpiexec -n WORLD`` runs this
script (``--child``), EPLB off (which also writes the expert-load statistics, --stats-out's file)
and EPLB on (``--num-redundant-experts R --init-expert-placement`` that file), alternating, REPEATS
times each. Every rank records per decode step: its wall time, the experts' wall and CPU time, the
combines' wall time (waiting for the slowest rank included) and the CPU it burned in them, and the
(token, choice) rows its experts computed. Printed per run: the load average before it, rows per
rank, imbalance (max - mean) / mean, rank 0's median decode step, and each rank's medians; then
every run's step per variant. ``--poll-cap S`` adds an EPLB-on variant whose combines sleep up to S
seconds between polls (the transport's default is 1e-4).
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
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "tests")]  # this tree's eprt, its checkpoints

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
    from eprt.comm.transport import Transport
    from eprt.engine.config import EplbConfig
    from eprt.engine.engine import EngineConfig, launch_engine
    from eprt.engine.executor import ShardExecutor
    from eprt.engine.expert_load import write_stats
    from eprt.ops.numpy_ops import NumpyOps

    # one record per decode step on this rank: wall ms of the step, of the experts (and their CPU
    # ms), of the combines (wall: the slowest rank's lateness included; CPU: what waiting burned), rows
    steps, now = [], None

    def timed(inner, *fields):
        def wrapper(*a, **kw):
            if now is None:
                return inner(*a, **kw)
            w0, c0 = time.perf_counter(), time.thread_time()
            out = inner(*a, **kw)
            now[fields[0]] += 1e3 * (time.perf_counter() - w0)
            now[fields[1]] += 1e3 * (time.thread_time() - c0)
            return out

        return wrapper

    experts = NumpyOps.moe_experts

    def counted(self, x, weights, ids, w_gate_up, w_down, expert_start):
        if now is not None:
            now["rows"] += int(((ids >= expert_start) & (ids < expert_start + w_gate_up.shape[0])).sum())
        return experts(self, x, weights, ids, w_gate_up, w_down, expert_start)

    NumpyOps.moe_experts = timed(counted, "experts", "experts_cpu")

    for name in ("allsum", "allgather_rows", "scatter_sum_rows"):  # the combines (dp: the exchange's)
        setattr(Transport, name, timed(getattr(Transport, name), "combine", "combine_cpu"))
    executor = ShardExecutor  # (dp: one step, every rank)
    decode = executor.decode

    def step(self, *a):
        nonlocal now
        now = dict.fromkeys(("experts", "experts_cpu", "combine", "combine_cpu", "rows"), 0)
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return decode(self, *a)
        finally:
            now["step"], now["step_cpu"] = 1e3 * (time.perf_counter() - w0), 1e3 * (time.thread_time() - c0)
            steps.append(now)
            now = None

    executor.decode = step
    if args.poll_cap:
        import eprt.comm.mpi_transport as mt

        mt.BUSY_SLEEP_MAX = args.poll_cap
    eplb = EplbConfig(num_redundant_experts=args.redundant, init_expert_placement=args.placement or None)
    cfg = EngineConfig(
        model=args.dir,
        device="cpu",
        max_batch=args.batch,
        max_model_len=512,
        prefix_cache=False,
        eplb=eplb,
        attention=args.attention,
    )
    prompts = [[3 + (7 * i + j) % 4000 for j in range(16)] for i in range(args.batch)]

    def run(n):
        return engine.generate([GenerationRequest(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts])

    rank, timed_steps = None, None
    try:
        with launch_engine(cfg) as engine:
            rank = 0
            run(3)  # warm-up
            steps.clear()
            run(args.steps + 1)
            timed_steps = len(steps)
            if args.stats_out:
                write_stats(args.stats_out, engine.expert_load(refresh=True), engine.model_name, engine.transport.size)
    except SystemExit:
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.rank
    # rank 0 clears its records before the timed run; the workers record every decode step, and the
    # summary keeps only as many of their last steps as rank 0 timed
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "steps": steps, "timed_steps": timed_steps}, f)


def median(values):
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def summarize(out_dir: str) -> dict:
    ranks = sorted(
        (json.load(open(p)) for p in glob.glob(os.path.join(out_dir, "rank*.json"))), key=lambda r: r["rank"]
    )
    n = ranks[0]["timed_steps"]
    per_rank = [r["steps"][-n:] for r in ranks]
    rows = [sum(s["rows"] for s in steps) for steps in per_rank]
    mean = sum(rows) / len(rows)
    fields = ("step", "step_cpu", "experts", "experts_cpu", "combine", "combine_cpu")
    ms = [{f: median([s[f] for s in steps]) for f in fields} for steps in per_rank]  # per rank, median over steps
    return {"rows": rows, "imbalance": (max(rows) - mean) / mean, "ranks": ms, "step_ms": ms[0]["step"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/eprt-bench-eplb")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--redundant", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved EPLB off / on runs")
    ap.add_argument("--bias", type=float, default=0.6, help="router score bias of the hot experts")
    ap.add_argument("--attention", default="replicated", choices=("replicated", "dp"), help="attention mode")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--placement", default="", help=argparse.SUPPRESS)
    ap.add_argument("--poll-cap", type=float, default=0, help="also run EPLB on, sleeping up to S s between polls")
    ap.add_argument("--stats-out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    build(args.dir, args.bias)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", EPRT_LOG_LEVEL="WARNING")
    work = tempfile.mkdtemp(prefix="bench-eplb-")
    stats = os.path.join(work, "stats.json")
    runs = []  # (name, load average before, summary), interleaved off, on, off, on, ...
    variants = ("off", "on", "on-poll") if args.poll_cap else ("off", "on")
    for rep in range(args.repeats):
        for name in variants:
            extra = ["--redundant", "0", "--stats-out", stats] if name == "off" else ["--placement", stats]
            if name == "on-poll":
                extra += ["--poll-cap", str(args.poll_cap)]
            out = os.path.join(work, f"{name}{rep}")
            os.makedirs(out)
            cmd = ["mpiexec", "-n", str(args.world), sys.executable, os.path.abspath(__file__), "--child"]
            cmd += ["--dir", args.dir, "--batch", str(args.batch), "--steps", str(args.steps), "--out", out]
            cmd += ["--redundant", str(args.redundant), "--attention", args.attention, *extra]
            load = os.getloadavg()[0]
            subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, check=True)
            runs.append((name, load, summarize(out)))
    print(
        f"skewed router: experts {HOT} score bias +{args.bias}; -n {args.world}, {args.attention} attention, "
        f"batch {args.batch}, "
        f"{args.steps} decode steps, 1 BLAS thread per rank, {os.cpu_count()} CPUs; EPLB on: {args.redundant} "
        f"redundant slots, global policy from the EPLB-off run's expert counts; {args.repeats} interleaved repeats"
    )
    print(
        "per rank, median over the decode steps, ms: step (CPU) / experts (CPU) / combine (CPU burned in it); "
        "CPU: the step's CPU summed over the ranks (the work two shared cores share), the busiest rank's"
    )
    for name, load, r in runs:
        ranks = "  ".join(
            f"{m['step']:.0f}({m['step_cpu']:.1f})/{m['experts']:.1f}({m['experts_cpu']:.1f})/{m['combine']:.1f}({m['combine_cpu']:.1f})"
            for m in r["ranks"]
        )
        cpu = [m["step_cpu"] for m in r["ranks"]]
        print(
            f"{name:>7} load {load:4.1f} rows {r['rows']} imbalance {r['imbalance']:.3f} step {r['step_ms']:.1f} ms, "
            f"CPU {sum(cpu):.1f} ms, busiest {max(cpu):.1f} ms"
        )
        print(f"      {ranks}")
    for name in variants:
        times = [r["step_ms"] for n, _, r in runs if n == name]
        print(
            f"EPLB {name:>7}: decode step ms {' '.join(f'{t:.1f}' for t in times)}; "
            f"best {min(times):.1f}, median {median(times):.1f}"
        )


if __name__ == "__main__":
    main()
