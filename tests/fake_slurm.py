"""A fake ``srun`` and ``scancel`` that honour SLURM's signal semantics, for tests/test_launch.py.

    fake_slurm.py srun [--option ...] COMMAND [ARGS ...]
    fake_slurm.py scancel --signal=SIG JOBID

srun starts SLURM_NTASKS tasks of COMMAND (through MPICH's mpiexec when there are several, so
they get PMI) and plays slurmctld/slurmstepd's part of the job's life, on a clock compressed by
FAKE_SLURM_SCALE (test seconds per SLURM second):
- at FAKE_SLURM_LIMIT - sig_time of the job's ``--signal=[B:]SIG@sig_time`` (FAKE_SLURM_SIGNAL),
  SIG goes to every task; with ``B:`` it goes to the batch shell only (FAKE_SLURM_BATCH_PID),
  which is srun itself when the script exec'd it;
- at the time limit, SIGTERM to every process of the job (tasks, batch shell, srun), and
  SIGKILL to all of them KillWait (FAKE_SLURM_KILL_WAIT SLURM seconds, default 30) later;
- srun's own answer to SIGTERM or SIGHUP is SIGKILL to every task ("forcing job termination"),
  as src/srun/srun_job.c does; SIGINT only prints the tasks' status.
scancel --signal=SIG JOBID signals the tasks of the job's steps, not the batch shell.
Events go to stderr as ``fake-slurm: ...``; task pids to FAKE_SLURM_TASKS_FILE.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from proc_tree import cmdline, descendants


def say(text: str) -> None:
    print(f"fake-slurm: {text}", file=sys.stderr, flush=True)


def _signal_spec(spec: str) -> tuple:
    """'B:TERM@120' -> (True, SIGTERM, 120)."""
    batch = spec.startswith("B:")
    name, _, at = spec.removeprefix("B:").partition("@")
    return batch, signal.Signals["SIG" + name.removeprefix("SIG")], int(at or 60)


class Step:
    def __init__(self, command: list, ntasks: int):
        env = {**os.environ, "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_NTASKS": str(ntasks)}
        argv = command if ntasks == 1 else ["mpiexec", "-n", str(ntasks), *command]
        self.proc = subprocess.Popen(argv, env=env)
        self.ntasks = ntasks
        self.tasks = [self.proc.pid] if ntasks == 1 else self._find_tasks()
        with open(os.environ["FAKE_SLURM_TASKS_FILE"], "w") as f:
            f.write(" ".join(map(str, self.tasks)))
        say(f"started {ntasks} tasks: pids {self.tasks}")

    def _find_tasks(self) -> list:
        """The processes the launcher started (the proxy's children; a task may start more)."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            proxies = [p for p in descendants(self.proc.pid) if "hydra_pmi_proxy" in cmdline(p)]
            found = [p for proxy in proxies for p in descendants(proxy) if _parent(p) == proxy]
            if len(found) >= self.ntasks:
                return found[: self.ntasks]
            time.sleep(0.05)
        raise SystemExit("fake-slurm: the tasks did not start")

    def signal_tasks(self, sig: signal.Signals, why: str) -> None:
        """``sig`` to every process of the step, as slurmstepd does (proctrack/cgroup: every pid
        of the step; proctrack/pgid: each task's process group): here each task's group."""
        say(f"{why}: {sig.name} to the tasks")
        for pid in self.tasks:
            _signal_group(pid, sig)


def srun(argv: list) -> int:
    while argv and argv[0].startswith("--"):
        argv = argv[1:]
    step = Step(argv, int(os.environ.get("SLURM_NTASKS", "1")))
    scale = float(os.environ["FAKE_SLURM_SCALE"])
    limit = float(os.environ["FAKE_SLURM_LIMIT"])
    kill_wait = float(os.environ.get("FAKE_SLURM_KILL_WAIT", "30")) * scale
    batch_only, sig, sig_time = _signal_spec(os.environ["FAKE_SLURM_SIGNAL"])
    batch_pid = int(os.environ["FAKE_SLURM_BATCH_PID"])

    def on_term(signum, frame):  # srun's own answer to SIGTERM/SIGHUP
        say(f"srun got {signal.Signals(signum).name}: forcing job termination")
        step.signal_tasks(signal.SIGKILL, "srun")

    def on_int(signum, frame):
        say("srun got SIGINT: interrupt (one more within 1 sec to abort)")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    signal.signal(signal.SIGINT, on_int)

    def clock():
        start = time.monotonic()

        def sleep_until(t):
            while step.proc.poll() is None and time.monotonic() - start < t:
                time.sleep(0.02)
            return step.proc.poll() is None

        if not sleep_until(limit - sig_time * scale):
            return
        if batch_only:
            say(f"--signal=B:{sig.name}: {sig.name} to the batch shell (pid {batch_pid})")
            os.kill(batch_pid, sig)
        else:
            step.signal_tasks(sig, f"--signal={sig.name}@{sig_time}")
        if not sleep_until(limit):
            return
        say("time limit: SIGTERM to every process of the job")
        step.signal_tasks(signal.SIGTERM, "time limit")
        for pid in {batch_pid, os.getpid()}:
            os.kill(pid, signal.SIGTERM)
        if sleep_until(limit + kill_wait):
            step.signal_tasks(signal.SIGKILL, "KillWait over")

    threading.Thread(target=clock, daemon=True).start()
    while True:
        try:
            code = step.proc.wait()
            break
        except InterruptedError:
            continue
    status = 128 - code if code < 0 else code
    say(f"step ended: status {code}" + (f" (killed by {signal.Signals(-code).name})" if code < 0 else ""))
    return status


def scancel(argv: list) -> int:
    sig = next((a.split("=", 1)[1] for a in argv if a.startswith("--signal=")), None)
    if sig is None or any(a in ("-b", "--batch", "-f", "--full") for a in argv):
        say(f"scancel {' '.join(argv)}: not simulated")
        return 1
    with open(os.environ["FAKE_SLURM_TASKS_FILE"]) as f:
        tasks = [int(p) for p in f.read().split()]
    signum = signal.Signals["SIG" + sig.removeprefix("SIG")]
    say(f"scancel --signal={sig}: {signum.name} to the tasks {tasks} (not the batch step)")
    for pid in tasks:
        _signal_group(pid, signum)
    return 0


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """``sig`` to the process group ``pid`` leads (as mpiexec's tasks do), else to ``pid`` alone."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


if __name__ == "__main__":
    tool, args = sys.argv[1], sys.argv[2:]
    sys.exit(srun(args) if tool == "srun" else scancel(args))
