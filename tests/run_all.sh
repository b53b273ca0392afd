#!/usr/bin/env bash
# The whole test suite: installs what the tests need, then runs the single-process
# suite and the MPI suite at world sizes 1, 2 and 3. README and .ci/run call this.
set -euo pipefail
cd "$(dirname "$0")/.."

# torch first and pinned (a CPU build); an unpinned torch would pull a CUDA build.
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test]'
# The linter for launch/ (tests/test_launch.py skips that check where it cannot be installed).
command -v shellcheck >/dev/null || { (apt-get update -q && apt-get install -y -q shellcheck) >/dev/null 2>&1 || true; }

# The layers (docs/design.md) and the code style, before anything slow.
lint-imports
ruff check .
ruff format --check .
export EPRT_TEST_CKPT_DIR="${EPRT_TEST_CKPT_DIR:-$(mktemp -d)/ckpt}"
python3 -m pytest -q -p no:cacheprovider --ignore=tests/mpi tests
# The CPU experts without the compiled kernel (the [test] extra brings numba, so the run above used it).
echo "== CPU experts on the NumPy path (EPRT_CPU_EXPERTS=numpy)"
EPRT_CPU_EXPERTS=numpy python3 -m pytest -q -p no:cacheprovider tests/test_model_parity.py tests/test_eplb.py tests/test_lora.py

# The GPU stages once more, on cusim (tests/cusim: the real kernels/*.cu and CupyOps on the CPU), as the
# dry run of the prepared GPU session itself: benchmarks/gpu_prepare.sh carries the checkpoints and wheels
# (printing the folder's size), benchmarks/gpu_session.sh --cusim runs every GPU test, expert parallelism
# at 2 and 3 ranks, the combine and decode benchmarks, in a venv that refuses what the GPU image lacks.
# Where a GPU is usable the run above already ran the GPU tests on it.
if command -v g++ >/dev/null; then
  echo "== the GPU session's dry run on the CPU CUDA simulator (cusim)"
  bash benchmarks/gpu_prepare.sh
  OUT="$(mktemp -d)" bash benchmarks/gpu_session.sh --cusim
else
  echo "== skipped: GPU tests on cusim (no g++ here)"
fi

# The MPI tests: written once, run at several world sizes, with the ranks' state digests compared
# after every step (--check-state; docs/design.md, "State digests").
for n in 1 2 3; do
  echo "== tests/mpi at mpiexec -n $n"
  EPRT_CHECK_STATE=1 mpiexec -n "$n" python3 -m pytest -q -p no:cacheprovider --with-mpi tests/mpi
done
