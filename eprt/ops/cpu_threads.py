"""How many threads a rank computes with on the CPU (``--cpu-threads``), and OpenBLAS's threads.

A rank owns the cores of its node divided among the node's ranks: with no binding (its affinity
mask is the whole node) that is cores // ranks on the node (the launcher's local size); when the
launcher bound it to some cores (srun --cpus-per-task, mpirun --map-by ...:PE=n), the cores of its
mask. OMP_NUM_THREADS, where a job script sets it, is the count asked for. The compiled kernels
split panels and rows over that many threads (never k, so a row's bits do not depend on it) and
OpenBLAS, which runs the few NumPy products left, is set to match.
"""

from __future__ import annotations

import ctypes
import os

from eprt import env

# The launchers' own variables naming how many ranks run on this node, in the order they are tried.
LOCAL_SIZE_VARS = (
    "OMPI_COMM_WORLD_LOCAL_SIZE",  # Open MPI
    "MPI_LOCALNRANKS",  # MPICH / Hydra, Intel MPI
    "SLURM_NTASKS_PER_NODE",  # Slurm (when given)
    "MV2_COMM_WORLD_LOCAL_SIZE",  # MVAPICH2
)
# OpenBLAS's thread setter under the names its builds export (NumPy's wheels: scipy_openblas64_).
BLAS_SETTERS = ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_")


def node_cores() -> int:
    return os.cpu_count() or 1


def default_threads(environ=None) -> tuple[int, str]:
    """(threads, why) for a rank that was not told (``--cpu-threads`` / EPRT_CPU_THREADS)."""
    cores = node_cores()
    owned = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    if owned < cores:
        return owned, f"the {owned} core(s) this rank is bound to"
    found = env.launcher_int(LOCAL_SIZE_VARS, "a rank count", 1, environ)
    ranks = found[1] if found else 1
    return max(1, cores // ranks), f"{cores} core(s) / {ranks} rank(s) on this node"


def resolve_threads(requested: int | None, environ=None) -> tuple[int, str]:
    """(threads, why): ``requested`` (None: EPRT_CPU_THREADS; 0: the default), checked."""
    requested = env.CPU_THREADS.get() if requested is None else requested
    cores = node_cores()
    if requested == 0:
        omp = env.launcher_int(("OMP_NUM_THREADS",), "a thread count", 1, environ)
        if omp is not None:
            return min(omp[1], cores), "OMP_NUM_THREADS"
        return default_threads(environ)
    if not 1 <= requested <= cores:
        raise ValueError(f"--cpu-threads must be in [1, {cores}] (this node's cores; 0: the default), got {requested}")
    return requested, "asked for"


BLAS_SPIN_VAR = "OPENBLAS_THREAD_TIMEOUT"  # how long OpenBLAS's idle threads spin: 2^N cycles (default 28)
BLAS_SPIN = "20"  # ~0.3 ms: hot within a burst of products, then the core is the compiled kernels' again


def limit_blas_spin(environ=None) -> bool:
    """Before NumPy loads OpenBLAS, shorten how long its idle threads spin after a product (by
    default 2^28 cycles, about 0.1 s, holding a core the compiled kernels' pool threads then wait
    for: a 512-token prefill on 2 threads ran at the speed of one) to 2^BLAS_SPIN cycles, unless
    the variable is set or the NumPy expert path is chosen (OpenBLAS's threads are its parallel
    work: its decode ran ~10% slower with a short spin). Returns whether it set it."""
    import importlib.util
    import sys

    environ = os.environ if environ is None else environ
    if BLAS_SPIN_VAR in environ or "numpy" in sys.modules:  # (once loaded, OpenBLAS has read it)
        return False
    if (environ.get(env.CPU_EXPERTS.name) or "auto") == "numpy" or importlib.util.find_spec("numba") is None:
        return False
    environ[BLAS_SPIN_VAR] = BLAS_SPIN
    return True


def _openblas_libraries() -> list:
    """The loaded shared libraries whose names say OpenBLAS (NumPy's own copy among them)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and line.split()[-1].startswith("/")}
    except OSError:
        return []
    return sorted(paths)


def set_blas_threads(threads: int) -> str:
    """Set OpenBLAS's threads in this process; returns what was done, in words."""
    import numpy  # noqa: F401  (loads NumPy's OpenBLAS)

    done = []
    for path in _openblas_libraries():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in BLAS_SETTERS:
            setter = getattr(lib, name, None)
            if setter is not None:
                setter(ctypes.c_int(threads))
                done.append(os.path.basename(path))
                break
    return f"OpenBLAS threads {threads}" if done else "no OpenBLAS found to set (BLAS threads as its own settings)"
