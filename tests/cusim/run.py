"""Run a Python script with cusim standing in for CuPy and the GPU:

    PYTHONPATH=tests python3 -m cusim.run benchmarks/bench_gpu.py --tiny --steps 1

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
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
