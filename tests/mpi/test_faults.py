"""Whole jobs under mpiexec (3 ranks, fault_driver.py): every fault ends the job with a
non-zero exit and a message naming it, quickly; an idle server is not a fault.

These launch their own jobs, so they run once, from a plain ``pytest`` (skipped when the
test process is itself one rank of a larger MPI world).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eprt.comm.world import launcher_world_size

DRIVER = Path(__file__).with_name("fault_driver.py")
TIMEOUT = 2  # EPRT_COLLECTIVE_TIMEOUT for the jobs, seconds

pytestmark = [
    pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH"),
    pytest.mark.skipif(launcher_world_size() > 1, reason="launches its own jobs; run once, not per rank"),
]


def launch(mode: str, limit: float = 60.0, dump_dir=None):
    # Drop the variables of an enclosing launcher (mpiexec -n 1 pytest) so the job is its own.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_"))}
    env["EPRT_COLLECTIVE_TIMEOUT"] = str(TIMEOUT)
    if dump_dir is not None:
        env["EPRT_DUMP_DIR"] = str(dump_dir)
    start = time.monotonic()
    out = subprocess.run(
        ["mpiexec", "-n", "3", sys.executable, str(DRIVER), mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=limit,
    )
    return out.returncode, out.stdout + out.stderr, time.monotonic() - start


@pytest.mark.parametrize("mode", ["clean", "idle"])
def test_healthy_runs_exit_zero(mode):
    # "idle": rank 0 sits longer than the collective timeout between steps; workers
    # waiting for their next command must not take that for a fault.
    rc, output, _ = launch(mode)
    assert rc == 0, output
    assert "eprt: rank" not in output and "Abort" not in output, output


def test_worker_exception_is_printed_by_rank0():
    rc, output, elapsed = launch("raise")
    assert rc != 0, output
    assert "eprt: rank 1 failed: RuntimeError: injected failure at decode step 3" in output, output
    # rank 2, waiting in the same combine, leaves on rank 0's notice instead of timing out
    assert "[rank 2] ERROR eprt.comm.worker: rank 2: rank 0 is going down: WorkerFailed" in output, output
    assert elapsed < TIMEOUT + 15, "the failure should end the job without waiting for the watchdog"


def test_killed_worker_ends_the_job_within_60s():
    rc, output, elapsed = launch("kill", limit=60)
    assert rc != 0, output
    assert elapsed < 60


def test_stalled_worker_trips_the_watchdog_with_a_hang_report_and_dumps(tmp_path):
    rc, output, _ = launch("stall", dump_dir=tmp_path)
    assert rc != 0, output
    assert f"the MoE combine did not complete within {TIMEOUT} s (EPRT_COLLECTIVE_TIMEOUT)" in output, output
    # the hang report: one line per rank; the stuck one named, the others with what they wait on
    assert re.search(r"eprt: +1 +\? .* did not answer within 2 s \(stopped, dead, or busy outside eprt\)", output)
    for rank in (0, 2):
        line = re.search(
            rf"eprt: +{rank} +(\S+) +(\d+)  DECODE_BATCH 1 rows +[\d.]+  waiting on the MoE combine", output
        )
        assert line, output
    # every live rank wrote its flight recorder; the stopped one could not
    assert sorted(p.name for p in tmp_path.iterdir()) == ["frames-rank-0.jsonl", "frames-rank-2.jsonl"]
    header = json.loads((tmp_path / "frames-rank-0.jsonl").read_text().splitlines()[0])["header"]
    assert "did not answer" in header["report"] and header["reason"] == "the MoE combine overdue"


def test_rank0_failure_releases_idle_workers():
    rc, output, elapsed = launch("root-raise")
    assert rc != 0, output
    for rank in (1, 2):
        assert (
            f"[rank {rank}] ERROR eprt.comm.worker: rank {rank}: rank 0 is going down: "
            "RuntimeError: injected failure on rank 0"
        ) in output, output
    assert elapsed < TIMEOUT + 15
