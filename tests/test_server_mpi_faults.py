"""``eprt serve`` at ``mpiexec -n 2`` when rank 1 is killed (SIGKILL) or stopped (SIGSTOP)
while a stream and a non-stream request are in flight: the stream ends with an error event
then ``[DONE]``, the other request gets a 5xx OpenAI error body, and the job exits non-zero
with rank 0 naming rank 1. A stopped rank is found by the collective watchdog
(EPRT_COLLECTIVE_TIMEOUT, set low here). Hydra runs with ``-disable-auto-cleanup``: it then
sends rank 0 SIGUSR1, but its proxy also SIGKILLs rank 0 in some runs (seen with strace);
such a run is skipped as the launcher's doing, see docs/serving.md.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time

import httpx
import pytest
from proc_tree import descendants
from test_server import ServerProcess, events
from test_server_mpi_real import ENGINE_FLAGS, _with_id_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")]

WATCHDOG_S = 4


def _rank_pid(launcher_pid: int, rank: int) -> int:
    for pid in descendants(launcher_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if env.get(b"PMI_RANK") == str(rank).encode() and b"python" in open(f"/proc/{pid}/cmdline", "rb").read():
            return pid
    raise AssertionError(f"no rank {rank} under launcher {launcher_pid}")


@pytest.fixture(scope="module")
def model_dir(checkpoint, tmp_path_factory):
    return _with_id_tokenizer(os.path.abspath(checkpoint("qwen3_moe")), str(tmp_path_factory.mktemp("idtok")))


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["kill-9", "sigstop"])
def test_a_lost_worker_ends_every_request_with_an_error_and_the_job_names_it(model_dir, fault):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_"))}
    env["EPRT_COLLECTIVE_TIMEOUT"] = str(WATCHDOG_S)
    server = ServerProcess(
        [
            "mpiexec",
            "-disable-auto-cleanup",
            "-n",
            "2",
            sys.executable,
            "-m",
            "eprt.cli",
            "serve",
            "--model",
            model_dir,
            "--port",
            "0",
            *ENGINE_FLAGS,
        ],
        env=env,
    )
    worker = None
    try:
        url = server.wait_url(120)
        worker = _rank_pid(server.proc.pid, 1)
        other = {}

        def non_stream():
            other["r"] = httpx.post(
                url + "/v1/completions", json={"prompt": [100, 101, 102], "max_tokens": 500}, timeout=120
            )

        body = {"prompt": [9, 8, 7], "max_tokens": 500, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            t = threading.Thread(target=non_stream)
            t.start()
            time.sleep(0.5)  # the second request is in flight too
            os.kill(worker, fault)
            t0 = time.monotonic()
            rest = []
            try:
                rest.extend(lines)
            except httpx.RemoteProtocolError:
                code = server.proc.wait(timeout=60)
                if fault == signal.SIGKILL and code == 9 and "eprt serve: rank" not in "".join(server.log):
                    pytest.skip("hydra's proxy SIGKILLed rank 0 along with rank 1 (the launcher's race)")
                raise
            took = time.monotonic() - t0
        t.join(60)
        evs = events_of([first, *rest])
        assert evs[-1] == "[DONE]", evs[-3:]
        assert "error" in evs[-2] and "rank 1" in evs[-2]["error"]["message"], evs[-2]
        r = other["r"]
        assert r.status_code == 503 and "rank 1" in r.json()["error"]["message"], r.text
        code = server.proc.wait(timeout=60)
        log = "".join(server.log)
        assert code != 0, log
        assert "eprt serve: rank 1 " in log, log
        print(f"{signal.Signals(fault).name}: error event {took:.1f}s after the fault; exit {code}")
    finally:
        if worker is not None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(worker, sig)
                except ProcessLookupError:
                    pass
        server.stop()


def events_of(lines: list) -> list:
    class _Lines:
        def iter_lines(self):
            return iter(lines)

    return events(_Lines())
