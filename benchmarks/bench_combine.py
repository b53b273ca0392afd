"""The GPU MoE combine per layer: host staging vs NCCL on the device, side by side in one job.

    mpiexec -n 2 python benchmarks/bench_combine.py [--hidden 4096] [--rows 1,32,128] [--reps 50]

Every rank times the combine of a float32 [T, D] partial (one MoE layer's) both ways, the device
path only where the job could use it (``device_combine.choose_combine``: NCCL on every rank and no
two ranks on one GPU, which NCCL refuses); rank 0 prints microseconds per layer. Two ranks may
share one GPU (gpu_session.sh runs it so: host staging only). ``--tiny`` uses small shapes (for the
CPU simulator).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", default="1,32,128")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tiny", action="store_true", help="small shapes and few repetitions")
    args = ap.parse_args()
    if args.tiny:
        args.hidden, args.rows, args.reps = 64, "1,8", 3
    from eprt.ops.device import bind_local_gpu

    bind_local_gpu()  # before MPI and any CUDA work
    import cupy

    from eprt.comm.device_combine import DeviceCombine, HostCombine, choose_combine
    from eprt.comm.mpi_transport import MpiTransport
    from eprt.ops.cupy_ops import CupyOps

    t, ops = MpiTransport(timeout=120), CupyOps()
    chosen, _ = choose_combine(t, ops, "auto")
    combines = {"host": HostCombine(t), "nccl": chosen if isinstance(chosen, DeviceCombine) else None}
    why = "" if combines["nccl"] else "not run: the ranks share a GPU or lack NCCL (see the log line above)"
    rows = []
    for T in (int(r) for r in args.rows.split(",")):
        partial = cupy.asarray(np.random.default_rng(t.rank).standard_normal((T, args.hidden)).astype(np.float32))
        timed = {}
        for name, combine in combines.items():
            if combine is None:
                continue
            combine(partial)  # warm-up
            ops.synchronize()
            start = time.perf_counter()
            for _ in range(args.reps):
                combine(partial)
            ops.synchronize()
            timed[name] = 1e6 * (time.perf_counter() - start) / args.reps
        rows.append((T, timed))
    if t.rank == 0:
        t.shutdown()
    else:
        t.recv_frame()
    t.close()
    if t.rank == 0:
        print(f"MoE combine per layer, {t.size} ranks, hidden {args.hidden}, float32 partials")
        print("| rows | host staging us | NCCL on device us |")
        print("|---|---|---|")
        for T, timed in rows:
            nccl_us = f"{timed['nccl']:.1f}" if "nccl" in timed else why
            print(f"| {T} | {timed['host']:.1f} | {nccl_us} |")


if __name__ == "__main__":
    main()
