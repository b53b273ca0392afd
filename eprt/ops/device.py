"""Choosing the backend, binding a rank to its GPU (``local_rank % gpu_count``, before MPI
initialises: docs/gpu.md, "Choosing the backend and the GPU"), and sizing the KV pool on a GPU.
"""

from __future__ import annotations

import os
import socket

from eprt import env
from eprt.ops.base import Ops

# The launchers' own variables (not eprt settings, hence read here rather than in env.py),
# each naming the rank's index among the ranks on its node, in the order they are tried.
LOCAL_RANK_VARS = (
    "OMPI_COMM_WORLD_LOCAL_RANK",  # Open MPI
    "MPI_LOCALRANKID",  # MPICH / Hydra, Intel MPI
    "SLURM_LOCALID",  # Slurm srun
    "MV2_COMM_WORLD_LOCAL_RANK",  # MVAPICH2
)
DEVICES = ("cpu", "cuda", "auto")
_GIB = float(1 << 30)


def local_rank(environ=None) -> int | None:
    """This process's rank among the ranks on its node, or None when no launcher set one."""
    found = env.launcher_int(LOCAL_RANK_VARS, "a local rank", 0, environ)
    return None if found is None else found[1]


def cuda_status() -> tuple[bool, str]:
    """(usable, why): whether CuPy imports and sees a CUDA device, and the reason in words."""
    try:
        import cupy
    except ImportError:
        return False, "CuPy is not installed (pip install 'eprt[cuda12]' or 'eprt[cuda13]': see README)"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        version = cupy.cuda.runtime.runtimeGetVersion()
    except Exception as e:  # no driver, a driver older than the CuPy build's CUDA, no device
        return False, f"CuPy {cupy.__version__} cannot use CUDA here: {type(e).__name__}: {e}"
    if count == 0:
        return False, f"CuPy {cupy.__version__} sees no CUDA device"
    return (
        True,
        f"{count} CUDA device(s), CuPy {cupy.__version__}, CUDA runtime {version // 1000}.{version % 1000 // 10}",
    )


def cuda_usable() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    return cuda_status()[0]


def bind_local_gpu() -> int:
    """Make GPU ``local_rank % gpu_count`` this thread's current device; returns its id.
    Without a launcher (a plain single process) the current device is kept."""
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    if count < 1:
        raise RuntimeError("bind_local_gpu: no CUDA device is visible")
    rank = local_rank()
    if rank is None:
        return cupy.cuda.runtime.getDevice()
    device = rank % count
    cupy.cuda.runtime.setDevice(device)
    return device


def device_choice(device: str | None) -> tuple[str, str]:
    """('cpu' or 'cuda', why): an explicit choice wins, then EPRT_DEVICE, then cuda when usable.
    ``--device cuda`` without a usable GPU is an error saying why."""
    choice = (device or env.DEVICE.get() or "auto").strip().lower()
    if choice not in DEVICES:
        source = "device" if device else "EPRT_DEVICE"
        raise ValueError(f"{source} must be one of {', '.join(DEVICES)}, got {choice!r}")
    if choice == "cpu":
        return "cpu", "asked for"
    usable, why = cuda_status()
    if choice == "cuda" and not usable:
        raise ValueError(f"--device cuda was asked for, but {why} (or use --device cpu)")
    if choice == "cuda":
        return "cuda", f"asked for; {why}"
    return ("cuda", f"auto: {why}") if usable else ("cpu", f"auto: {why}")


def resolve_device(device: str | None) -> str:
    """'cpu' or 'cuda' (see ``device_choice``)."""
    return device_choice(device)[0]


def get_ops(device: str | None = None, cpu_weights: str | None = None, cpu_threads: int | None = None) -> Ops:
    """The ops backend for ``device`` (cpu, cuda, auto or None: see ``resolve_device``); on the CPU
    with weights at ``cpu_weights`` on ``cpu_threads`` threads (None: their EPRT_ variables)."""
    if resolve_device(device) == "cpu":
        from eprt.ops.numpy_ops import NumpyOps

        return NumpyOps(weights=cpu_weights, threads=cpu_threads)
    bind_local_gpu()
    from eprt.ops.cupy_ops import CupyOps

    return CupyOps()


def device_key() -> str:
    """Which GPU this thread's current device is: the host and its PCI bus id, the same text on
    every rank that shares the GPU (whatever CUDA_VISIBLE_DEVICES numbers it)."""
    import cupy

    return f"{socket.gethostname()}:{cupy.cuda.Device().pci_bus_id}"


def compute_identity(ops: Ops) -> tuple[str, str]:
    """(how this rank computes, which device it computes on). Ranks whose first part differs
    may round differently; ranks with equal second parts share one GPU. The first part names
    the backend's versions and ends with an arithmetic fingerprint: the same library build
    can still pick other kernels (OpenBLAS per CPU model) or split sums differently (thread
    counts), which only the bits of an actual product show."""
    import numpy as np

    host = socket.gethostname()
    if ops.name == "cpu":
        try:
            blas = np.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {})
        except TypeError:  # NumPy < 1.26 has no mode=; the fingerprint still tells builds apart
            blas = {}
        what = f"cpu: NumPy {np.__version__}, BLAS {blas.get('name', '?')} {blas.get('version', '?')}, {ops.describe()}"
        where = f"{host}:cpu:{os.getpid()}"
    else:
        import cupy

        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        what = (
            f"cuda: {name} (sm_{props['major']}{props['minor']}, {props['multiProcessorCount']} SMs), "
            f"CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, CuPy {cupy.__version__}"
        )
        where = device_key()
    return f"{what}, arithmetic {arithmetic_fingerprint(ops)}", where


def arithmetic_fingerprint(ops: Ops) -> str:
    """A digest of the bits of ``ops.linear`` on fixed data, at decode (1 row), small and
    prefill-like (7, 64 rows) shapes."""
    import hashlib

    import numpy as np

    rng = np.random.default_rng(20261202)
    w = ops.weight((rng.standard_normal((384, 512)) / 16).astype(np.float32))  # [N, K]
    digest = hashlib.sha256()
    for rows in (1, 7, 64):
        x = ops.activation(rng.standard_normal((rows, 512)).astype(np.float32))  # [T, K]
        digest.update(np.ascontiguousarray(ops.to_host(ops.linear(x, w))).tobytes())
    return digest.hexdigest()[:12]


def pool_blocks(
    available: int, total: int, bytes_per_block: int, gpu_memory_utilization: float, sharers: int = 1
) -> int:
    """KV blocks that fit when the processes on this GPU may use ``gpu_memory_utilization`` of
    ``total`` bytes, ``total - available`` are already taken (weights, other processes), and
    ``sharers`` ranks (this one included) split what is left equally."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    if sharers < 1:
        raise ValueError(f"sharers must be at least 1, got {sharers}")
    used = total - available
    budget = int(total * gpu_memory_utilization) - used
    blocks = budget // sharers // bytes_per_block
    if blocks < 1:
        raise RuntimeError(
            f"no room for a KV pool: {used / _GIB:.2f} GiB of {total / _GIB:.2f} GiB are in use "
            f"(weights, other processes) and gpu_memory_utilization={gpu_memory_utilization} caps "
            f"this GPU at {total * gpu_memory_utilization / _GIB:.2f} GiB"
            f"{f' for {sharers} ranks' if sharers > 1 else ''}; one block needs "
            f"{bytes_per_block / (1 << 20):.2f} MiB. Raise the utilization or spread the experts "
            f"over more ranks."
        )
    return int(blocks)


def kv_pool_blocks(bytes_per_block: int, gpu_memory_utilization: float, sharers: int = 1) -> int:
    """How many KV blocks of ``bytes_per_block`` to allocate on the current GPU, shared by
    ``sharers`` ranks; measure once every rank on it has loaded its weights. Memory CuPy's
    pool holds but does not use counts as free (the device sees it taken until the pool frees
    it, and the KV allocation reuses it first)."""
    import cupy

    cupy.cuda.get_current_stream().synchronize()
    free, total = cupy.cuda.runtime.memGetInfo()
    reusable = cupy.get_default_memory_pool().free_bytes()
    return pool_blocks(free + reusable, total, bytes_per_block, gpu_memory_utilization, sharers)
