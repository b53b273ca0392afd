"""The GPU MoE combine per layer: host staging vs NCCL on the device, side by side in one job.

    mpiexec -n 2 python benchmarks/bench_combine.py [--hidden 4096] [--rows 1,32,128] [--reps 50]

Every rank times the combine of a float32 [T, D] partial (one MoE layer's) both ways, the
device path only where every rank's CuPy has NCCL; rank 0 prints ms per layer. Two ranks may
share one GPU (gpu_session.sh runs it so). ``--tiny`` uses small shapes (for the CPU simulator).
"""

from __future__ import annotations

import argparse
import json
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
    import cupy

    from eprt.comm.cuda_staging import Staging
    from eprt.comm.device_combine import DeviceCombine, nccl_communicator
    from eprt.comm.mpi_transport import MpiTransport
    from eprt.engine.startup import _nccl_importable
    from eprt.ops.cupy_ops import CupyOps
    from eprt.ops.device import bind_local_gpu

    bind_local_gpu()
    t, ops, staging = MpiTransport(timeout=120), CupyOps(), Staging()
    nccl = all(json.loads(x) for x in t.allgather_text(json.dumps(_nccl_importable())))
    device = DeviceCombine(t, ops, nccl_communicator(t)) if nccl else None

    def host(partial):
        return staging.to_device(t.allsum(staging.send_buffer(partial)))

    rows = []
    for T in (int(r) for r in args.rows.split(",")):
        partial = cupy.asarray(np.random.default_rng(t.rank).standard_normal((T, args.hidden)).astype(np.float32))
        timed = {}
        for name, combine in (("host", host), ("nccl", device)):
            if combine is None:
                continue
            combine(partial)  # warm-up
            cupy.cuda.get_current_stream().synchronize()
            start = time.perf_counter()
            for _ in range(args.reps):
                combine(partial)
            cupy.cuda.get_current_stream().synchronize()
            timed[name] = 1e3 * (time.perf_counter() - start) / args.reps
        rows.append((T, timed))
    if t.rank == 0:
        t.shutdown()
    else:
        t.recv_frame()
    t.close()
    if t.rank == 0:
        print(f"MoE combine per layer, {t.size} ranks, hidden {args.hidden}, float32 partials")
        print("| rows | host staging ms | NCCL on device ms |")
        print("|---|---|---|")
        for T, timed in rows:
            nccl_ms = f"{timed['nccl']:.3f}" if "nccl" in timed else "NCCL unavailable"
            print(f"| {T} | {timed['host']:.3f} | {nccl_ms} |")


if __name__ == "__main__":
    main()
