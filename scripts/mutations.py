"""Run one-line mutations of the package against the tests meant to catch them (run by hand).

    python scripts/mutations.py            # every mutation, then a table
    python scripts/mutations.py --list     # the mutations and the tests expected to catch each
    python scripts/mutations.py -k sum     # those whose name contains "sum"

Each mutation replaces one exact line fragment of one file (it must occur exactly once) in a copy of
the tracked tree, runs its tests there (pytest, or pytest under ``mpiexec -n N``), and counts as caught
when they fail. The clean tree must pass the same tests first, or the result means nothing. The last
result is in docs/design.md ("Mutations").
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    old: str
    new: str
    tests: tuple  # pytest arguments
    ranks: int = 0  # > 0: under mpiexec -n ranks (with --with-mpi)


MUTATIONS = (
    Mutation(
        "dp mirror grows a token late",
        "eprt/engine/sequences.py",
        "self.grow(slot, st, st.length + len(new), st.length)",
        "self.grow(slot, st, st.length + len(new) - 1, st.length)",
        ("tests/mpi/test_dp_attention_mpi.py",),
        ranks=2,
    ),
    Mutation(
        "EPLB replicas by weight, not weight per replica",
        "eprt/model/placement.py",
        "best = np.argmax(weight / count, axis=1)",
        "best = np.argmax(weight, axis=1)",
        ("tests/test_eplb.py",),
    ),
    Mutation(
        "host combine sums ranks in reverse",
        "eprt/comm/mpi_transport.py",
        "        out = gathered[0].copy()\n        for r in range(1, self.size):",
        "        out = gathered[self.size - 1].copy()\n        for r in range(self.size - 2, -1, -1):",
        ("tests/mpi/test_transport_mpi.py",),
        ranks=3,
    ),
    Mutation(
        "packing ignores a full pack",
        "eprt/model/placement.py",
        "p = int(np.argmin(np.where(room > 0, loads, np.inf)))",
        "p = int(np.argmin(loads))",
        ("tests/test_eplb.py",),
    ),
    Mutation(
        "dp reduce-scatter sums ranks in reverse",
        "eprt/comm/mpi_transport.py",
        "        out = parts[0].copy()\n        for r in range(1, self.size):  # rank order",
        "        out = parts[self.size - 1].copy()\n        for r in range(self.size - 2, -1, -1):  # rank order",
        ("tests/mpi/test_transport_mpi.py",),
        ranks=3,
    ),
    Mutation(
        "alltoall owner sums ranks in reverse",
        "eprt/comm/alltoall.py",
        "        for r in range(self.transport.size):",
        "        for r in reversed(range(self.transport.size)):",
        ("tests/mpi/test_alltoall_mpi.py", "-k", "replicated and not four"),
        ranks=3,
    ),
    Mutation(
        "alltoall EPLB owner sums choices in reverse",
        "eprt/comm/alltoall.py",
        "            for j in range(1, k):\n                out = out + every[:, j]",
        "            for j in reversed(range(1, k)):\n                out = out + every[:, j]",
        ("tests/mpi/test_alltoall_mpi.py", "-k", "replicated and not four"),
        ranks=3,
    ),
)


def copy_tree(dest: Path) -> None:
    """The tracked files (as they are in the working tree) into dest."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in files.decode().split("\0"):
        if name and (ROOT / name).is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target)


def apply(tree: Path, m: Mutation) -> None:
    path = tree / m.file
    text = path.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"{m.name}: {m.file} holds the mutated fragment {text.count(m.old)} times, expected once")
    path.write_text(text.replace(m.old, m.new))


def run_tests(tree: Path, m: Mutation, timeout: float) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m.tests]
    if m.ranks:
        cmd = ["mpiexec", "-n", str(m.ranks), *cmd, "--with-mpi"]
    env = {**os.environ, "PYTHONPATH": f"{tree}:{tree / 'tests'}", "EPRT_CHECK_STATE": "1"}
    start = time.monotonic()
    try:
        out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, "timed out", time.monotonic() - start
    failed = sorted({line.split()[1] for line in out.stdout.splitlines() if line.startswith("FAILED ")})
    return out.returncode, ", ".join(failed) or out.stdout.strip().splitlines()[-1:][0], time.monotonic() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-k", default="", help="only mutations whose name contains this")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per test run")
    args = p.parse_args()
    chosen = [m for m in MUTATIONS if args.k in m.name]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.file}: {m.old.strip()!r} -> {m.new.strip()!r}; {' '.join(m.tests)} (ranks {m.ranks})")
        return 0
    rows, missed = [], 0
    with tempfile.TemporaryDirectory(prefix="eprt-mutations-") as tmp:
        clean = Path(tmp) / "clean"
        copy_tree(clean)
        for m in chosen:
            code, detail, took = run_tests(clean, m, args.timeout)
            if code != 0:
                print(f"{m.name}: the clean tree fails its tests ({detail}); fix that first", file=sys.stderr)
                return 2
            tree = Path(tmp) / "mutant"
            shutil.rmtree(tree, ignore_errors=True)
            shutil.copytree(clean, tree)
            apply(tree, m)
            code, detail, took = run_tests(tree, m, args.timeout)
            caught = code != 0
            missed += not caught
            rows.append((m.name, "caught" if caught else "MISSED", detail if caught else "", took))
            print(f"{m.name}: {rows[-1][1]} in {took:.0f} s {detail if caught else ''}", flush=True)
    print("\n| mutation | result | failing tests | s |\n|---|---|---|---|")
    for name, result, detail, took in rows:
        print(f"| {name} | {result} | {detail} | {took:.0f} |")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
