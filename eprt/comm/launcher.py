"""What the MPI launcher tells this process (its task count and rank, read without importing
MPI or NumPy), and the rank supervisor: under a multi-rank launcher every rank is two
processes, the one the launcher started, which only waits, and its child, the rank itself
(docs/design.md, "Failure handling").

Why: MPICH's Hydra SIGKILLs every rank's process group as soon as it reaps a rank that died of
a signal (src/pm/hydra/proxy/pmip.c), and with auto-cleanup as soon as a rank's PMI socket
closes; Open MPI's mpirun ends the job on any abnormal exit. Either way rank 0 was gone before
it could answer its clients. The supervisor holds the launcher's view of the rank (its pid, its
PMI socket, its stdout and stderr, all inherited): when the rank dies of a signal the launcher
sees nothing until the supervisor has said so on stderr and waited ``RANK_LOST_GRACE_S`` for the
other ranks to report the death and end the job themselves; then it exits with 128 + the
signal's number, a normal exit. Every other signal and exit passes as before: the two share a
process group, so a signal sent to the group (the launchers forward Ctrl-C and SIGTERM that
way, srun to every process of the step) reaches the rank itself, and the supervisor ignores the
ones the rank handles; a SIGKILL of the group ends both; a rank never outlives its supervisor
(PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

from eprt import env

LAUNCHER_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")
LAUNCHER_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")
RANK_LOST_GRACE_S = 15.0  # a rank killed by a signal: how long its supervisor hides that from the launcher
SUPERVISOR_NAME = b"eprt-supervisor"  # the supervisor's /proc/PID/comm (ps -o comm), at most 15 bytes
# What the rank handles or ignores itself (drain, dump frames, a launcher's "a rank died" notice);
# they reach it through the process group, so the supervisor must not die of them.
RANK_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE)
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15


def launcher_task_count() -> tuple[str, int] | None:
    """(variable, task count) the MPI launcher announced, None when not launched by one. These
    are the launchers' own variables, not eprt settings: MPICH/Hydra and Intel MPI (and Slurm's
    PMI-2) set PMI_SIZE, Open MPI OMPI_COMM_WORLD_SIZE, MVAPICH2 MV2_COMM_WORLD_SIZE, and
    ``srun`` the step's task count (with ``--mpi=pmix`` it is the only one set). The first set
    one wins: an mpiexec inside a SLURM step sets PMI_SIZE, while SLURM_STEP_NUM_TASKS there
    counts the step's tasks (mpiexec's proxies), not the MPI ranks."""
    return env.launcher_int(LAUNCHER_SIZE_VARIABLES, "a task count", 1)


def launcher_world_size() -> int:
    """The world size the MPI launcher announced (1 when not launched by one), read without
    importing mpi4py so a single-rank run never loads MPI. In a batch script outside ``srun``
    the step has one task, so a plain ``eprt`` there runs as a world of one."""
    found = launcher_task_count()
    return 1 if found is None else found[1]


def launcher_rank() -> str:
    """This task's rank as the launcher announced it, for the supervisor's line ("?" if none did)."""
    found = env.launcher_int(LAUNCHER_RANK_VARIABLES, "a rank", 0)
    return "?" if found is None else str(found[1])


def supervise() -> None:
    """Split this process into the supervisor and the rank (see the module's docstring) when a
    launcher started more than one rank and EPRT_SUPERVISOR is on; returns in the rank (at once
    otherwise), never in the supervisor. Call it before MPI, CUDA or any thread starts."""
    if launcher_world_size() < 2 or not env.SUPERVISOR.get():
        return
    supervisor = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != supervisor:  # it died before the prctl
            os._exit(1)
        return
    _supervise(child)


def _supervise(child: int) -> None:
    """The supervisor's whole life: wait for the rank, then leave as it did (a death by a signal
    said on stderr, hidden from the launcher for RANK_LOST_GRACE_S, then a normal exit)."""
    _libc().prctl(_PR_SET_NAME, ctypes.c_char_p(SUPERVISOR_NAME))
    for sig in RANK_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    try:
        _, status = os.waitpid(child, 0)  # (retried on EINTR, PEP 475)
    except ChildProcessError:  # cannot happen: the child is ours
        os._exit(1)
    if not os.WIFSIGNALED(status):
        os._exit(os.waitstatus_to_exitcode(status))
    sig = os.WTERMSIG(status)
    _say(
        f"eprt: rank {launcher_rank()} (pid {child}) was killed by {_signal_name(sig)}; its launcher process "
        f"waits up to {RANK_LOST_GRACE_S:g} s for the other ranks to report it and end the job"
    )
    time.sleep(RANK_LOST_GRACE_S)
    os._exit(128 + sig)


def _say(text: str) -> None:
    try:
        os.write(2, (text + "\n").encode())
    except OSError:  # stderr closed: the launcher is gone
        pass


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _libc():
    return ctypes.CDLL(None, use_errno=True)
