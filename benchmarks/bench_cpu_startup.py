"""What the compiled CPU kernels (the ``[cpu]`` extra, numba) add to a start of ``eprt generate``.

    python benchmarks/bench_cpu_startup.py [--repeats 5] [--compare /path/to/another/checkout]

Runs ``eprt generate`` on the built-in model (8 new tokens, one thread) with the NumPy path
(EPRT_CPU_EXPERTS=numpy) and the compiled one (numba) in turn, --repeats times each, with numba's
cache warm and the .pyc files written (a first run of each, not timed), and prints the median wall seconds
and the difference. With --compare, the same for another checkout of eprt (its own numba cache),
alternating with this one. Then, in one fresh process each, the parts of the compiled path's
start: importing numba, numba's first call (its registries, loaded even when every kernel comes
from the cache) and the cached kernels of the built-in model's bf16 weights.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PARTS = """
import time
t0 = time.perf_counter()
import numba
t1 = time.perf_counter()
import numpy as np
from eprt.ops import cpu_kernels as k
x = np.ones((5, 7), np.float32)
t2 = time.perf_counter()
k.rms_norm(x, np.ones(7, np.float32), 1e-6)
t3 = time.perf_counter()
k.warm_up()
k.warm_products("bf16")
t4 = time.perf_counter()
print(f"{t1 - t0:.3f} {t3 - t2:.3f} {t4 - t3:.3f}")
"""


def _env(**extra) -> dict:
    """The environment, with bytecode written (an installed package has its .pyc files)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, **extra}


def run_generate(checkout: str, path: str) -> float:
    env = _env(PYTHONPATH=checkout, EPRT_CPU_EXPERTS=path, EPRT_CPU_THREADS="1")
    cmd = [sys.executable, "-m", "eprt.cli", "generate", "--device", "cpu", "--prompt", "Hello, experts"]
    start = time.perf_counter()
    subprocess.run([*cmd, "--max-tokens", "8"], env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--compare", default=None, help="another eprt checkout to time beside this one")
    args = ap.parse_args()
    checkouts = [("this", ROOT)] + ([("compare", args.compare)] if args.compare else [])
    runs = {(name, path): [] for name, _ in checkouts for path in ("numpy", "numba")}
    for _, checkout in checkouts:
        run_generate(checkout, "numba")  # compile, or load, the kernels once
    for _ in range(args.repeats):
        for name, checkout in checkouts:
            for path in ("numpy", "numba"):
                runs[(name, path)].append(run_generate(checkout, path))
    print(f"{'checkout':>9} {'numpy s':>8} {'numba s':>8} {'added s':>8}   (medians of {args.repeats})")
    for name, _ in checkouts:
        plain, compiled = np.median(runs[(name, "numpy")]), np.median(runs[(name, "numba")])
        print(f"{name:>9} {plain:8.2f} {compiled:8.2f} {compiled - plain:8.2f}")
    env = _env(PYTHONPATH=ROOT)
    parts = [
        [
            float(v)
            for v in subprocess.run(
                [sys.executable, "-c", PARTS], env=env, capture_output=True, text=True, check=True
            ).stdout.split()
        ]
        for _ in range(args.repeats)
    ]
    imp, first, kernels = np.median(parts, axis=0)
    print(f"this checkout: import numba {imp:.2f} s, numba's first call {first:.2f} s, cached kernels {kernels:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
