"""One ``kill -9`` of a rank of ``eprt serve`` with requests in flight, measured: what each client
got and when, what /health said, how and when the job ended. For tests/test_server_mpi_faults.py
and benchmarks/bench_worker_death.py.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

import httpx
from proc_tree import descendants

RANK_VARIABLES = (b"PMI_RANK", b"OMPI_COMM_WORLD_RANK")  # Hydra's, Open MPI's
OPEN_MPI_RUN = "mpirun.openmpi"  # Debian's openmpi-bin


def launcher_command(launcher: str, ranks: int) -> list:
    """The launcher's part of the command line: ``hydra`` (pip mpich's mpiexec, on PATH) or
    ``openmpi`` (Debian's mpirun.openmpi; its mpi4py must be the python that follows)."""
    if launcher == "hydra":
        return ["mpiexec", "-n", str(ranks)]
    if launcher == "openmpi":
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        forward = [arg for name in ("PYTHONPATH", "EPRT_COLLECTIVE_TIMEOUT", "EPRT_DUMP_DIR") for arg in ("-x", name)]
        return [OPEN_MPI_RUN, *root, "--oversubscribe", "-n", str(ranks), *forward]
    raise ValueError(f"launcher must be hydra or openmpi, got {launcher!r}")


def have_launcher(launcher: str) -> bool:
    return shutil.which("mpiexec" if launcher == "hydra" else OPEN_MPI_RUN) is not None


def job_env(dump_dir: str, collective_timeout: float = 30.0) -> dict:
    """This environment without an enclosing launcher's variables (the job is its own); the
    flight recorders of the failure go to ``dump_dir``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "HYDI_", "OMPI_", "PMIX_"))}
    env.update(EPRT_COLLECTIVE_TIMEOUT=str(collective_timeout), EPRT_DUMP_DIR=dump_dir, PYTHONUNBUFFERED="1")
    return env


def rank_pid(launcher_pid: int, rank: int) -> int:
    """The process of ``rank`` under ``launcher_pid``: under a supervisor (eprt/comm/launcher.py)
    its child, which runs the rank, not the supervisor itself."""
    for pid in descendants(launcher_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            with open(f"/proc/{pid}/comm", "rb") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if comm != b"eprt-supervisor" and any(environ.get(v) == str(rank).encode() for v in RANK_VARIABLES):
            return pid
    raise AssertionError(f"no rank {rank} under launcher {launcher_pid}")


@dataclass
class Client:
    kind: str  # "stream" or "plain"
    outcome: str = "pending"  # "error" (error event or 5xx), "finished", "dropped" (connection lost)
    message: str = ""  # the last event of a stream (before [DONE]), the body of a plain answer
    done: bool = False  # a stream ended with data: [DONE]
    at: float = 0.0  # time.monotonic() of the outcome
    started: threading.Event = field(default_factory=threading.Event)


@dataclass
class Trial:
    victim: int
    clients: list
    killed_at: float
    exit_code: int | None  # None: the job did not end in time (it was killed)
    exited_at: float
    health: list  # (seconds after the kill, status code or "refused")
    log: str

    def after(self, client: Client) -> float:
        return client.at - self.killed_at

    def clients_told(self, within_s: float) -> int:
        """Clients that got an error naming the victim within ``within_s`` of the kill."""
        return sum(
            c.outcome == "error" and f"rank {self.victim}" in c.message and self.after(c) <= within_s
            for c in self.clients
        )

    def named_in_log(self) -> bool:
        """The job's log names the dead rank: rank 0's "eprt serve: rank K ..." for a worker,
        a worker's "eprt: rank K: rank 0 died ..." for rank 0."""
        if self.victim == 0:
            return re.search(r"eprt: rank [1-9]\d*: rank 0 died", self.log) is not None
        return f"eprt serve: rank {self.victim} " in self.log

    def health_failed(self) -> bool:
        """After the kill /health answered 503, or never said 200 again once the clients were told and
        the server went away (on a loaded machine the job can end before a poll gets through)."""
        told = max((self.after(c) for c in self.clients), default=0.0)
        after = [(t, status) for t, status in self.health if t > 0]
        if any(status == 503 for _, status in after):
            return True
        return bool(after) and after[-1][1] == "refused" and all(status != 200 for t, status in after if t > told)

    def summary(self) -> str:
        worst = max((self.after(c) for c in self.clients), default=0.0)
        outcomes = ", ".join(sorted({c.outcome for c in self.clients}))
        return (
            f"{self.clients_told(5.0)}/{len(self.clients)} clients told within 5 s (slowest {worst:.3f} s; "
            f"{outcomes}); /health 503: {'yes' if self.health_failed() else 'no'}; exit "
            f"{self.exit_code} after {self.exited_at - self.killed_at:.2f} s; named in the log: "
            f"{'yes' if self.named_in_log() else 'no'}"
        )


def run_trial(
    command: list,
    victim: int,
    env: dict,
    sig: signal.Signals = signal.SIGKILL,
    streams: int = 2,
    plains: int = 2,
    max_tokens: int = 480,
) -> Trial:
    """Start ``command`` (a launcher running ``eprt serve --port 0``), put ``streams`` streamed and
    ``plains`` non-streamed completions in flight, send ``sig`` to rank ``victim``, then wait for
    every client and the job's end. Nothing of the job survives the call."""
    job = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    log, url = [], _Url()
    threading.Thread(target=_drain, args=(job, log, url), daemon=True).start()
    health, stop = [], threading.Event()
    try:
        base = url.wait(180, log)
        clients = [Client("stream") for _ in range(streams)] + [Client("plain") for _ in range(plains)]
        threads = [threading.Thread(target=_request, args=(base, c, max_tokens), daemon=True) for c in clients]
        for t in threads:
            t.start()
        for c in clients[:streams]:
            assert c.started.wait(60), "a stream did not start:\n" + "".join(log)
        time.sleep(0.2)  # the non-stream requests are running too
        poller = threading.Thread(target=_poll_health, args=(base, health, stop), daemon=True)
        poller.start()  # /health polled from before the kill
        os.kill(rank_pid(job.pid, victim), sig)
        killed_at = time.monotonic()
        for t in threads:
            t.join(60)
        try:
            code = job.wait(60)
        except subprocess.TimeoutExpired:
            code = None
        exited_at = time.monotonic()
        stop.set()
        poller.join(5)  # its last request answered or refused
        time.sleep(0.05)  # the log's last lines
        # an answer's time after the kill: when it came, for a request sent after the kill, else when sent
        health = [(round((got if sent > killed_at else sent) - killed_at, 3), status) for sent, got, status in health]
        return Trial(victim, clients, killed_at, code, exited_at, health, "".join(log))
    finally:
        stop.set()
        _kill_tree(job)


class _Url:
    def __init__(self):
        self.value, self.found = None, threading.Event()

    def wait(self, timeout: float, log: list) -> str:
        assert self.found.wait(timeout), "the server never announced its address:\n" + "".join(log)
        return self.value


def _drain(job: subprocess.Popen, log: list, url: _Url) -> None:
    for line in job.stderr:
        log.append(line)
        m = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)
        if m and not url.found.is_set():
            url.value = m.group(1)
            url.found.set()


def _request(base: str, client: Client, max_tokens: int) -> None:
    body = {"prompt": "the quick brown fox", "max_tokens": max_tokens, "ignore_eos": True}
    try:
        if client.kind == "stream":
            with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
                last = ""
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        client.started.set()
                        client.done = line == "data: [DONE]"
                        last = last if client.done else line
                client.outcome = "error" if '"error"' in last else "finished"
                client.message = last
        else:
            r = httpx.post(base + "/v1/completions", json=body, timeout=120)
            client.outcome = "error" if r.status_code >= 500 else "finished"
            client.message = r.text
    except httpx.HTTPError as e:
        client.outcome, client.message = "dropped", f"{type(e).__name__}: {e}"
    client.at = time.monotonic()
    client.started.set()


def _poll_health(base: str, health: list, stop: threading.Event) -> None:
    """(time.monotonic() when sent, when answered, status) until the server refuses or ``stop``."""
    with httpx.Client(timeout=1) as client:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                status = client.get(base + "/health").status_code
            except httpx.HTTPError:
                status = "refused"
            health.append((sent, time.monotonic(), status))
            if status == "refused":
                return
            time.sleep(0.01)


def _kill_tree(job: subprocess.Popen) -> None:
    """SIGKILL the launcher and everything under it (ranks sit in process groups of their own)."""
    for pid in [*descendants(job.pid), job.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.wait()
