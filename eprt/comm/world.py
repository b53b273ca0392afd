"""This process's world: the launcher's task count and the transport that fits it."""
from __future__ import annotations

import os

from eprt.comm.transport import DEFAULT_FRAME_WORDS, LocalTransport, Transport


def launcher_world_size() -> int:
    """The world size the MPI launcher announced (1 when not launched by one), read without
    importing mpi4py so a single-rank run never loads MPI. These are the launchers' own
    variables, not eprt settings: MPICH/Hydra and Intel MPI (and Slurm's PMI-2) set PMI_SIZE,
    Open MPI OMPI_COMM_WORLD_SIZE, MVAPICH2 MV2_COMM_WORLD_SIZE, and ``srun`` the step's task
    count (with ``--mpi=pmix`` it is the only one set). In a batch script outside ``srun``
    the step has one task, so a plain ``eprt`` there runs as a world of one."""
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS"):
        value = os.environ.get(name)
        if value:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"launcher variable {name}={value!r} is not a task count") from None
    return 1


def open_transport(frame_words: int = DEFAULT_FRAME_WORDS) -> Transport:
    """The transport for this process: ``LocalTransport`` in a world of one, else an
    ``MpiTransport`` on COMM_WORLD."""
    if launcher_world_size() == 1:
        return LocalTransport(frame_words)
    from eprt.comm.mpi_transport import MpiTransport
    return MpiTransport(frame_words=frame_words)
