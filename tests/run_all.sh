#!/usr/bin/env bash
# The whole test suite; README ("Tests") and .ci/run call this. In order:
#  1. what the tests need, into the active Python environment (a venv is best), only where missing:
#     torch 2.13.0 first (a CPU build), then eprt editable with its [test] extra. When every
#     requirement is met and `eprt` imports from this tree, pip is not run at all (about a second).
#     The linter for launch/ (tests/test_launch.py) comes from apt-get only when running as
#     root with apt-get there, and says so; else that one check is skipped, and this says so.
#  2. the layer and style checks (lint-imports, ruff), before anything slow;
#  3. two lanes at once, each phase's output printed whole when it ends, then a table of the phases:
#     A: the single-process suite on pytest-xdist workers (tests that share a module's server or
#        engine stay on one worker), then the CPU experts on the NumPy path, then tests/mpi at
#        mpiexec -n 1;
#     B: the GPU session's dry run on cusim (benchmarks/gpu_prepare.sh + gpu_session.sh --cusim),
#        then tests/mpi at mpiexec -n 2 and 3. tests/mpi runs with the ranks' state digests compared.
#     Every phase runs even when one fails; the exit status is 0 only if all passed.
# EPRT_TEST_WORKERS: the xdist workers of lane A (default: the cores, 2 to 8).
# shellcheck disable=SC2317  # (the phases are functions that phase() calls)
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS

# ---- 1. install what is missing ------------------------------------------------------------------
if python3 tests/deps_ready.py; then
  echo "== test dependencies: all installed, eprt from $PWD (pip not run)"
else
  echo "== installing the test dependencies into $(python3 -c 'import sys; print(sys.prefix)'):" \
    "torch 2.13.0 (CPU), then -e '.[test]' (minutes the first time)"
  # torch first and pinned (a CPU build); an unpinned torch would pull a CUDA build.
  python3 -m pip install -q torch==2.13.0
  python3 -m pip install -q -e '.[test]'
fi
if command -v shellcheck >/dev/null; then
  :
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "== installing shellcheck with apt-get (tests/test_launch.py lints launch/ with it)"
  (apt-get install -y -q shellcheck || { apt-get update -q && apt-get install -y -q shellcheck; }) >/dev/null 2>&1 ||
    echo "   apt-get could not install it: tests/test_launch.py skips its shellcheck lint"
else
  echo "== no shellcheck (and no apt-get as root to install it): tests/test_launch.py skips its lint of launch/"
fi
echo "== set up in $((SECONDS - t0)) s"

# ---- 2. the layers (docs/design.md) and the code style ---------------------------------------------
lint-imports
ruff check .
ruff format --check .

# ---- 3. the tests, in two lanes ------------------------------------------------------------------
export EPRT_TEST_CKPT_DIR="${EPRT_TEST_CKPT_DIR:-$(mktemp -d)/ckpt}"  # shared; tests/checkpoints.py builds each once
cores=$(nproc 2>/dev/null || echo 2)
workers=${EPRT_TEST_WORKERS:-$((cores < 2 ? 2 : cores > 8 ? 8 : cores))}
logs=$(mktemp -d)
pytest=(python3 -m pytest -q -p no:cacheprovider)

phase() { # id label command...: runs it into $logs/id.log, then prints that log whole (one at a time)
  local id=$1 label=$2 start=$SECONDS rc=0
  shift 2
  "$@" >"$logs/$id.log" 2>&1 || rc=$?
  echo "$rc $((SECONDS - start)) $label" >"$logs/$id.rc"
  {
    flock 9 2>/dev/null || true
    echo "== $label: $([ "$rc" = 0 ] && echo passed || echo "FAILED (exit $rc)") in $((SECONDS - start)) s (at $((SECONDS - t0)) s)"
    cat "$logs/$id.log"
  } 9>"$logs/print.lock"
}

# loadgroup: the tests sharing a module's server, engine or compile stay together (tests/conftest.py)
single() { "${pytest[@]}" -n "$workers" --dist loadgroup --ignore=tests/mpi tests; }
# The CPU experts without the compiled kernel (the [test] extra brings numba, so the run above used it);
# not the CUDA backend's test on cusim, which never takes the CPU experts' path.
numpy_path() {
  EPRT_CPU_EXPERTS=numpy "${pytest[@]}" tests/test_model_parity.py tests/test_eplb.py tests/test_lora.py \
    --deselect tests/test_eplb.py::test_cuda_backend_on_cusim_gives_the_same_tokens_across_live_rebalances
}
# The GPU stages once more, on cusim (tests/cusim: the real kernels/*.cu and CupyOps on the CPU), as the
# dry run of the prepared GPU session itself: benchmarks/gpu_prepare.sh carries the checkpoints and wheels
# (printing the folder's size), benchmarks/gpu_session.sh --cusim runs every GPU test, expert parallelism
# at 2 and 3 ranks, the combine and decode benchmarks, in a venv that refuses what the GPU image lacks.
# Where a GPU is usable lane A already ran the GPU tests on it.
cusim() { bash benchmarks/gpu_prepare.sh && OUT="$(mktemp -d)" bash benchmarks/gpu_session.sh --cusim; }
# The MPI tests: written once, run at several world sizes, with the ranks' state digests compared
# after every step (--check-state; docs/design.md, "State digests").
mpi() { EPRT_CHECK_STATE=1 mpiexec -n "$1" "${pytest[@]}" --with-mpi tests/mpi; }

echo "== lane A: the single-process tests on $workers xdist workers, then the NumPy path," \
  "then tests/mpi at mpiexec -n 1; lane B: the GPU session's dry run on cusim, then tests/mpi at -n 2 and 3 (${cores} cores)"
{
  phase a1 "single-process tests (-n $workers)" single
  phase a2 "CPU experts on the NumPy path (EPRT_CPU_EXPERTS=numpy)" numpy_path
  phase a3 "tests/mpi at mpiexec -n 1" mpi 1
} &
lane_a=$!
{
  if command -v g++ >/dev/null; then
    phase b1 "the GPU session's dry run on cusim" cusim
  else
    echo "== skipped: GPU tests on cusim (no g++ here)"
  fi
  for n in 2 3; do phase "b$n" "tests/mpi at mpiexec -n $n" mpi "$n"; done
} &
lane_b=$!
wait "$lane_a" "$lane_b" || true

echo "== phases (seconds; the lanes ran at once, on $cores cores):"
failed=0
for f in "$logs"/*.rc; do
  read -r rc took label <"$f"
  printf '   %5s s  %-6s %s\n' "$took" "$([ "$rc" = 0 ] && echo ok || echo FAILED)" "$label"
  [ "$rc" = 0 ] || failed=1
done
echo "== tests/run_all.sh: $([ "$failed" = 0 ] && echo "all passed" || echo FAILED) in $((SECONDS - t0)) s"
exit "$failed"
