"""This process's world: the launcher's task count and the transport that fits it."""

from __future__ import annotations

from eprt.comm.launcher import launcher_task_count, launcher_world_size
from eprt.comm.transport import DEFAULT_FRAME_WORDS, LocalTransport, StartupFailed, Transport

__all__ = ["WorldSizeMismatch", "check_world_size", "launcher_task_count", "launcher_world_size", "open_transport"]


class WorldSizeMismatch(StartupFailed):
    """MPI's world is not the one the launcher started (a PMI mismatch): every task would be
    its own rank 0, racing for the port or appending to one output file."""

    def __init__(self, message: str):
        RuntimeError.__init__(self, message)
        self.failures = []


def check_world_size(mpi_size: int) -> None:
    """WorldSizeMismatch unless MPI's COMM_WORLD has as many ranks as the launcher started tasks."""
    found = launcher_task_count()
    if found is None or found[1] == mpi_size:
        return
    name, count = found
    raise WorldSizeMismatch(
        f"the launcher started {count} tasks ({name}={count}) but MPI sees a world of {mpi_size}: this MPI "
        f"library did not connect to the launcher's process manager (a PMI mismatch, e.g. srun --mpi=pmix "
        f"with an MPI built without PMIx, or an mpiexec from another MPI than mpi4py's), so every task would "
        f"run as its own rank 0. Start eprt with the launcher of mpi4py's MPI (python -c 'from mpi4py import MPI; "
        f"print(MPI.Get_library_version())'), or give srun the --mpi= plugin that MPI supports (docs/launch.md)"
    )


def open_transport(frame_words: int = DEFAULT_FRAME_WORDS) -> Transport:
    """The transport for this process: ``LocalTransport`` in a world of one, else an
    ``MpiTransport`` on COMM_WORLD."""
    if launcher_world_size() == 1:
        return LocalTransport(frame_words)
    from mpi4py import MPI

    from eprt.comm.mpi_transport import MpiTransport

    check_world_size(MPI.COMM_WORLD.Get_size())
    return MpiTransport(frame_words=frame_words)
