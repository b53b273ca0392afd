"""Which transport a process gets, from its launcher's variables (no MPI is started here)."""

import pytest

from eprt.comm.transport import LocalTransport
from eprt.comm.world import launcher_world_size, open_transport

LAUNCHER_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("name", LAUNCHER_VARS)
def test_each_launcher_announces_its_world(clean_env, name):
    clean_env.setenv(name, "4")
    assert launcher_world_size() == 4


def test_no_launcher_is_a_world_of_one_without_mpi(clean_env):
    assert launcher_world_size() == 1
    assert isinstance(open_transport(), LocalTransport)


def test_a_batch_script_step_of_one_task_stays_local(clean_env):
    clean_env.setenv("SLURM_STEP_NUM_TASKS", "1")  # `eprt` run in an sbatch script, not under srun
    assert isinstance(open_transport(), LocalTransport)


def test_garbage_is_a_clear_error(clean_env):
    clean_env.setenv("PMI_SIZE", "four")
    with pytest.raises(ValueError, match="PMI_SIZE='four'"):
        launcher_world_size()


@pytest.mark.parametrize("name", LAUNCHER_VARS)
def test_world_size_must_equal_the_launchers_task_count(clean_env, name):
    from eprt.comm.transport import StartupFailed
    from eprt.comm.world import WorldSizeMismatch, check_world_size

    check_world_size(5)  # no launcher: nothing to compare
    clean_env.setenv(name, "4")
    check_world_size(4)
    with pytest.raises(WorldSizeMismatch, match=f"started 4 tasks \\({name}=4\\) but MPI sees a world of 1") as e:
        check_world_size(1)
    assert isinstance(e.value, StartupFailed)  # the CLI reports it without a traceback


def test_the_mpi_launchers_own_count_wins_over_the_slurm_step(clean_env):
    """mpiexec inside a SLURM step: PMI_SIZE counts the ranks, SLURM_STEP_NUM_TASKS the proxies."""
    from eprt.comm.world import check_world_size

    clean_env.setenv("SLURM_STEP_NUM_TASKS", "2")
    clean_env.setenv("PMI_SIZE", "16")
    check_world_size(16)


def test_a_pmi_mismatch_stops_every_task_with_a_clear_error(clean_env, tmp_path):
    """srun --mpi=pmix over an MPI without PMIx: each task is a singleton world of 1 while the step
    has 2 tasks. Was: both ran as rank 0 and appended to one output file."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "OMPI_", "MV2_", "SLURM_", "HYDRA"))}
    env.update(SLURM_STEP_NUM_TASKS="2", SLURM_NTASKS="2")
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt_ids": [1, 2]}\n')
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "eprt",
                "run",
                "--device",
                "cpu",
                "--input",
                str(inp),
                "--output",
                str(tmp_path / "out.jsonl"),
            ],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for proc in procs:
        assert proc.wait(timeout=120) == 2
        err = proc.stderr.read()
        assert "the launcher started 2 tasks (SLURM_STEP_NUM_TASKS=2) but MPI sees a world of 1" in err, err
    assert not (tmp_path / "out.jsonl").exists() or (tmp_path / "out.jsonl").read_text() == ""


def test_bad_counts_are_clear(clean_env):
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "0")
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_SIZE='0' is not a task count"):
        launcher_world_size()
