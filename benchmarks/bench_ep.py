"""Expert-parallel decode step time at several world sizes and attention modes, plus MPI traffic per step.

    python benchmarks/bench_ep.py [--configs 1:replicated,2:replicated,2:dp] [--workloads expert,long]
    python benchmarks/bench_ep.py --configs 2:replicated:check,2:dp:check --workloads expert   # --check-state's cost
    python benchmarks/bench_ep.py --configs 2:replicated,2:dp,2:replicated,2:dp --workloads expert,chunked
    python benchmarks/bench_ep.py --configs 2:dp,3:dp,4:dp --workloads expert --exchange both   # the MoE exchanges

Builds (once) a Mixtral-style checkpoint whose experts hold ~95% of the weights, then for each
workload (expert: batch 32 of 16-token prompts; long: batch 16 of 1,024-token prompts, attention-
heavy, each prompt whole in the first tick; chunked: batch 16 of 768-token prompts under the
default prefill budget, 512 tokens per step on a CPU, so the prefill takes several ticks) and each
configuration (ranks:attention; list one twice to alternate sides on a noisy machine) launches
``mpiexec -n N`` on this same script
(``--child``), which times on rank 0 the batch end to end (submit to the last token), the ticks
until the last prompt's first token (prefill) and each decode tick (the median step of the best
of --repeats runs) and
reads the transport's counters: MPI calls, broadcast bytes and combine bytes per decode step. BLAS
runs one thread per rank in every configuration so the comparison isolates the parallelism; the
tables are printed by the parent, with the decode speed-up over the first configuration. A
configuration ending in ``:check`` runs with ``--check-state``; its "check ms" column is the time rank 0
spends per decode step in the state check (hashing, the all-gather and the comparison).
``--exchange both`` runs each configuration with ``--moe-exchange allgather`` and ``alltoall`` and
adds a table of the MoE exchange's bytes per rank per decode step (rank 0's, counted by the
transport: sent to and received from other ranks), its time, and alltoall's bytes over allgather's
beside the target k / P.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
    max_position_embeddings=2048,
)
WORKLOADS = {  # chunk: the prefill budget (None: the default, by device; 0: whole prompts)
    "expert": dict(batch=32, prompt_len=16, steps=24, chunk=0),
    "long": dict(batch=16, prompt_len=1024, steps=16, chunk=0),
    "chunked": dict(batch=16, prompt_len=768, steps=24, chunk=None),
}


def child(args) -> None:
    from eprt.api import GenerationRequest, SamplingParams
    from eprt.engine.engine import EngineConfig, launch_engine
    from eprt.engine.executor import ShardExecutor

    cfg = EngineConfig(
        model=args.dir,
        device="cpu",
        max_batch=args.batch,
        max_model_len=args.prompt_len + args.steps + 16,
        max_prefill_tokens=None if args.chunk < 0 else args.chunk,  # 0: whole prompts, all in the first tick
        prefix_cache=False,
        attention=args.attention,
        check_state=args.check,
        moe_exchange=args.exchange,
    )
    prompts = [[3 + (7 * i + j) % 4000 for j in range(args.prompt_len)] for i in range(args.batch)]

    def measure():
        """One batch to the end: (end to end s, the ticks until every prompt has its first token s,
        [decode step s]: the ticks after those, the transport's counters of the first of them, the
        state check's mean s per decode step)."""
        params = SamplingParams(max_tokens=args.steps + 1, ignore_eos=True)
        started: set = set()  # the prompts with a first token
        handles = [
            engine.submit(GenerationRequest(p, params, stream=True, on_token=lambda t, i=i: started.add(i)))
            for i, p in enumerate(prompts)
        ]
        ticks, counters, checks, prefill = [], [], [], 0
        while not all(h.done() for h in handles):
            stats, t, checked[0] = engine.transport.stats.copy(), time.perf_counter(), 0.0
            engine.step()
            ticks.append(time.perf_counter() - t)
            counters.append(engine.transport.stats - stats)
            checks.append(checked[0])
            prefill = prefill or (len(ticks) if len(started) == len(prompts) else 0)
        decode = slice(prefill, -1)  # (the last tick releases all)
        return sum(ticks), sum(ticks[:prefill]), ticks[decode], counters[prefill], statistics.mean(checks[decode])

    checked = [0.0]

    def timed_check(step, transport, real=ShardExecutor.check_state):
        t = time.perf_counter()
        real(engine.runner.executor, step, transport)
        checked[0] += time.perf_counter() - t

    try:
        with launch_engine(cfg) as engine:
            engine.runner.executor.check_state = timed_check
            runs = [measure() for _ in range(args.repeats + 1)][1:]  # the first warms up
    except SystemExit:
        return  # worker ranks
    decode = runs[0][3]
    step_s = min(statistics.median(r[2]) for r in runs)  # each run's median step, the best run's
    print(
        json.dumps(
            {
                "world": engine.transport.size,
                "attention": args.attention,
                "step_ms": 1e3 * step_s,
                "e2e_ms": 1e3 * min(r[0] for r in runs),
                "prefill_ms": 1e3 * min(r[1] for r in runs),
                "mpi_calls": decode.mpi_calls,
                "bcast_bytes": decode.bcast_bytes,
                "combine_bytes": decode.allsum_bytes,
                "check_ms": 1e3 * min(r[4] for r in runs) if args.check else None,
                **exchange_figures(engine, decode),
            }
        ),
        flush=True,
    )


def exchange_figures(engine, decode) -> dict:
    """The MoE exchange of one decode step on rank 0: bytes sent and received (counted by the
    transport), the exchange's milliseconds and the model's k."""
    model = engine.runner.executor.model
    return {
        "exchange": "alltoall" if model.alltoall is not None else "allgather",
        "sent_bytes": decode.moe_sent_bytes,
        "recv_bytes": decode.moe_recv_bytes,
        "exchange_ms": 1e3 * decode.moe_exchange_s,
        "top_k": model.cfg.top_k,
    }


def print_exchange(rows: list) -> None:
    """Bytes per rank per decode step, each exchange beside the all-gather at the same ranks and attention:
    the target is alltoall <= (k / P) x allgather."""
    print(
        f"{'ranks':>5} {'attention':>10} {'exchange':>9} {'sent B/step':>11} {'recv B/step':>11} {'exch ms':>7} "
        f"{'vs allgather':>12} {'k/P':>5}"
    )
    for r in rows:
        base = next(
            (
                b
                for b in rows
                if (b["world"], b["attention"], b["exchange"]) == (r["world"], r["attention"], "allgather")
            ),
            None,
        )
        both = r["sent_bytes"] + r["recv_bytes"]
        ratio = (
            "-" if base is None or not base["sent_bytes"] else f"{both / (base['sent_bytes'] + base['recv_bytes']):.3f}"
        )
        print(
            f"{r['world']:5d} {r['attention']:>10} {r['exchange']:>9} {r['sent_bytes']:11d} {r['recv_bytes']:11d} "
            f"{r['exchange_ms']:7.2f} {ratio:>12} {r['top_k'] / r['world']:5.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/eprt-bench-ep2048")
    ap.add_argument("--configs", default="1:replicated,2:replicated,2:dp", help="ranks:attention, comma-separated")
    ap.add_argument("--workloads", default="expert,long", help=f"of {', '.join(WORKLOADS)}")
    ap.add_argument("--steps", type=int, default=None, help="decode steps timed (default: the workload's)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up; the fastest counts")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--prompt-len", type=int, default=16, help=argparse.SUPPRESS)
    ap.add_argument("--attention", default="replicated", help=argparse.SUPPRESS)
    ap.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument(
        "--exchange", default="allgather", help="the MoE exchange: allgather, alltoall or both (each config twice)"
    )
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
        f"1 BLAS thread per rank"
    )
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", EPRT_LOG_LEVEL="WARNING")
    configs = [c.split(":") for c in args.configs.split(",")]
    for name in args.workloads.split(","):
        w = dict(WORKLOADS[name], **({} if args.steps is None else {"steps": args.steps}))
        rows = []
        exchanges = ["allgather", "alltoall"] if args.exchange == "both" else [args.exchange]
        for (n, attention, *check), exchange in [(c, x) for c in configs for x in exchanges]:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--dir", args.dir, "--attention", attention]
            cmd += ["--exchange", exchange]
            cmd += ["--check"] if check == ["check"] else []
            cmd += ["--batch", str(w["batch"]), "--prompt-len", str(w["prompt_len"]), "--steps", str(w["steps"])]
            cmd += ["--repeats", str(args.repeats), "--chunk", str(-1 if w["chunk"] is None else w["chunk"])]
            out = subprocess.run(
                ["mpiexec", "-n", str(n), *cmd], env=env, capture_output=True, text=True, timeout=900, check=True
            ).stdout
            rows.append(json.loads([line for line in out.splitlines() if line.startswith("{")][-1]))
        budget = "whole prompts" if w["chunk"] == 0 else "the default prefill budget"
        print(
            f"\n{name}: batch {w['batch']}, prompts of {w['prompt_len']} tokens ({budget}), {w['steps']} decode steps"
        )
        print(
            f"{'ranks':>5} {'attention':>10} {'e2e ms':>8} {'e2e x':>6} {'step ms':>8} {'speed-up':>8} "
            f"{'prefill ms':>10} {'MPI calls/step':>14} {'bcast B/step':>12} {'combine B/step':>14} "
            f"{'check ms':>8} exchange"
        )
        for r in rows:
            print(
                f"{r['world']:5d} {r['attention']:>10} {r['e2e_ms']:8.0f} {rows[0]['e2e_ms'] / r['e2e_ms']:6.2f} "
                f"{r['step_ms']:8.2f} {rows[0]['step_ms'] / r['step_ms']:8.2f} "
                f"{r['prefill_ms']:10.0f} {r['mpi_calls']:14.1f} {r['bcast_bytes']:12.0f} {r['combine_bytes']:14.0f} "
                f"{'-' if r['check_ms'] is None else format(r['check_ms'], '8.3f'):>8} {r['exchange']}"
            )
        print_exchange(rows)


if __name__ == "__main__":
    main()
