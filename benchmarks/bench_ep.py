"""Expert-parallel decode step time at several world sizes, plus MPI traffic per step.

    python benchmarks/bench_ep.py [--worlds 1,2] [--batch 8] [--steps 24]

Builds (once) a Mixtral-style checkpoint whose experts hold ~95% of the weights, then
for each world size launches ``mpiexec -n N`` on this same script (``--child``), which
times steady-state decode steps on rank 0 and reads the transport's counters: MPI calls,
broadcast bytes and combine bytes per decode step. BLAS runs one thread per rank in
every configuration so the comparison isolates expert parallelism; the table is printed
by the parent, side by side, with the speed-up over the first world size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

EP_MODEL = dict(
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=1024,
    num_local_experts=16,
    num_experts_per_tok=4,
    max_position_embeddings=1024,
)


def child(args) -> None:
    from eprt.api import GenerationRequest, SamplingParams
    from eprt.engine.engine import EngineConfig, launch_engine

    cfg = EngineConfig(model=args.dir, device="cpu", max_batch=args.batch, max_model_len=512, prefix_cache=False)
    prompts = [[3 + (7 * i + j) % 4000 for j in range(16)] for i in range(args.batch)]

    def run(n):
        return engine.generate([GenerationRequest(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts])

    try:
        with launch_engine(cfg) as engine:
            run(2)  # warm-up
            stats0, t0 = engine.transport.stats.copy(), time.perf_counter()
            run(1)
            t1, stats1 = time.perf_counter(), engine.transport.stats.copy()
            run(args.steps + 1)
            t2, stats2 = time.perf_counter(), engine.transport.stats.copy()
    except SystemExit:
        return  # worker ranks
    # decode steps only: the (steps+1)-token run minus the 1-token (prefill) run
    decode = (stats2 - stats1) - (stats1 - stats0)
    step_s = ((t2 - t1) - (t1 - t0)) / args.steps
    print(
        json.dumps(
            {
                "world": engine.transport.size,
                "step_ms": 1e3 * step_s,
                "mpi_calls": decode.mpi_calls / args.steps,
                "bcast_bytes": decode.bcast_bytes / args.steps,
                "combine_bytes": decode.allsum_bytes / args.steps,
            }
        ),
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/eprt-bench-ep")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    from checkpoints import build_checkpoint

    from eprt.model.config import load_config

    build_checkpoint("mixtral", args.dir, **EP_MODEL)
    cfg = load_config(args.dir)
    expert_params = cfg.num_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    expert_share = expert_params / cfg.param_count()
    print(
        f"model {args.dir}: {cfg.param_count() / 1e6:.0f}M parameters, experts {100 * expert_share:.0f}% of them; "
        f"batch {args.batch}, {args.steps} decode steps, 1 BLAS thread per rank"
    )
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", EPRT_LOG_LEVEL="WARNING")
    rows = []
    for n in [int(w) for w in args.worlds.split(",")]:
        cmd = [
            "mpiexec",
            "-n",
            str(n),
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            "--dir",
            args.dir,
            "--batch",
            str(args.batch),
            "--steps",
            str(args.steps),
        ]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=True).stdout
        rows.append(json.loads([line for line in out.splitlines() if line.startswith("{")][-1]))
    print(
        f"{'ranks':>5} {'step ms':>8} {'speed-up':>8} {'MPI calls/step':>14} {'bcast B/step':>12} "
        f"{'combine B/step':>14}"
    )
    for r in rows:
        print(
            f"{r['world']:5d} {r['step_ms']:8.2f} {rows[0]['step_ms'] / r['step_ms']:8.2f} {r['mpi_calls']:14.1f} "
            f"{r['bcast_bytes']:12.0f} {r['combine_bytes']:14.0f}"
        )


if __name__ == "__main__":
    main()
