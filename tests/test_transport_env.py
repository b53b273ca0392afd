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
    clean_env.setenv("SLURM_STEP_NUM_TASKS", "1")      # `eprt` run in an sbatch script, not under srun
    assert isinstance(open_transport(), LocalTransport)


def test_garbage_is_a_clear_error(clean_env):
    clean_env.setenv("PMI_SIZE", "four")
    with pytest.raises(ValueError, match="PMI_SIZE='four'"):
        launcher_world_size()
