"""Run a Python script with cusim standing in for CuPy and the GPU:

    PYTHONPATH=tests python3 -m cusim.run benchmarks/bench_gpu.py --tiny --steps 1
    PYTHONPATH=tests python3 -m cusim.run -m eprt generate --device cuda --prompt hi

Checks that a script meant for a GPU machine runs at all (device time is scarce); its
timings mean nothing here.
"""

import runpy
import sys

from . import fake_cupy

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    fake_cupy.install()
    if sys.argv[1] == "-m":
        sys.argv = sys.argv[2:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
