"""``kill -9`` of one rank of ``eprt serve`` (the built-in model, CPU) with requests in flight,
N times per launcher and world size: how many clients got an error naming the rank within 5 s,
how fast, whether /health turned 503, and how the job ended.

    PYTHONPATH=$PWD python benchmarks/bench_worker_death.py [--launcher hydra openmpi] [--ranks 2 3]
        [--trials 10] [--victim -1] [--openmpi-python /work/venv-ompi/bin/python]

``--victim``: the rank killed (-1: the last one; 0: rank 0, named by a worker). Open MPI needs
its own mpi4py (built against it, e.g. in a venv: docs/launch.md, "Failure handling");
``--openmpi-python`` is that venv's python.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from rank_death import have_launcher, job_env, launcher_command, run_trial  # noqa: E402

SERVE = ["-m", "eprt", "serve", "--device", "cpu", "--port", "0", "--max-batch", "8"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launcher", nargs="+", default=["hydra", "openmpi"], choices=["hydra", "openmpi"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 3])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--victim", type=int, default=-1, help="rank to kill (-1: the last)")
    ap.add_argument("--openmpi-python", default="/work/venv-ompi/bin/python")
    args = ap.parse_args()
    failed = False
    for launcher in args.launcher:
        if not have_launcher(launcher):
            print(f"{launcher}: not installed, skipped")
            continue
        python = args.openmpi_python if launcher == "openmpi" else sys.executable
        for ranks in args.ranks:
            victim = ranks - 1 if args.victim < 0 else args.victim
            trials = []
            for i in range(args.trials):
                with tempfile.TemporaryDirectory() as dumps:
                    trial = run_trial([*launcher_command(launcher, ranks), python, *SERVE], victim, job_env(dumps))
                trials.append(trial)
                print(f"{launcher} -n {ranks}, kill -9 rank {victim}, trial {i + 1}: {trial.summary()}", flush=True)
            failed |= not report(launcher, ranks, victim, trials)
    return 1 if failed else 0


def report(launcher: str, ranks: int, victim: int, trials: list) -> bool:
    """Print the figures of one launcher and world size; whether every trial met the bar."""
    told = [t.clients_told(5.0) == len(t.clients) for t in trials]
    exits = [t.exit_code not in (0, None) and t.named_in_log() for t in trials]
    latencies = [t.after(c) for t in trials for c in t.clients]
    exit_s = [t.exited_at - t.killed_at for t in trials]
    clients_bar = victim != 0  # rank 0 is the server: its clients lose their connection
    print(
        f"== {launcher} -n {ranks}, kill -9 rank {victim}: "
        + (f"every client told within 5 s in {sum(told)}/{len(trials)} trials; " if clients_bar else "")
        + f"client outcome after {statistics.median(latencies):.3f} s median, {max(latencies):.3f} s max; "
        f"/health 503 seen in {sum(t.health_failed() for t in trials)}/{len(trials)}; "
        f"non-zero exit naming the rank in {sum(exits)}/{len(trials)}, "
        f"{statistics.median(exit_s):.2f} s median after the kill ({max(exit_s):.2f} max)",
        flush=True,
    )
    return all(exits) and (all(told) or not clients_bar)


if __name__ == "__main__":
    sys.exit(main())
