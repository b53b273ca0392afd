#!/usr/bin/env bash
# One prepared run for a machine with a GPU (run from the repository root, nothing installed):
# the device name, every GPU kernel test against the NumPy reference, the end-to-end greedy
# check (CuPy tokens follow NumPy's), 2-rank expert parallelism, the MoE combine per layer (host
# staging vs NCCL, 2 ranks on one GPU), then the GPU benchmark. Logs go to ${OUT:-/tmp/eprt-gpu}.
#   bash benchmarks/gpu_session.sh            # at most 520 s (fits one device call)
set -uo pipefail
out=${OUT:-/tmp/eprt-gpu}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 EPRT_TEST_CKPT_DIR="$out/ckpt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/device.txt"
timeout 220 python3 -m pytest -q -p no:cacheprovider -rs tests/test_kernels_compile.py tests/test_cupy_ops.py tests/test_cupy_ops_shapes.py \
    tests/test_gpu_end_to_end.py tests/test_cupy_ops_deepseek.py tests/test_cupy_ops_fp8.py tests/test_gpu_fp8_model.py \
    tests/test_cupy_hybrid_ops.py tests/test_cupy_sampling.py 2>&1 | tee "$out/gpu_tests.log"
tests=${PIPESTATUS[0]}
mpi=0
if command -v mpiexec >/dev/null; then   # expert parallelism on the GPU: 2 ranks share it
  timeout 80 mpiexec -n 2 python3 -m pytest -q -p no:cacheprovider --with-mpi -m gpu \
      tests/mpi/test_gpu_expert_parallel_mpi.py 2>&1 | tee "$out/gpu_mpi.log"
  mpi=${PIPESTATUS[0]}
  timeout 40 mpiexec -n 2 python3 benchmarks/bench_combine.py 2>&1 | tee "$out/bench_combine.log"
fi
timeout 180 python3 benchmarks/bench_gpu.py 2>&1 | tee "$out/bench_gpu.log"
bench=${PIPESTATUS[0]}
echo "gpu tests exit $tests, 2-rank gpu tests exit $mpi, benchmark exit $bench"
[ "$tests" -eq 0 ] && [ "$mpi" -eq 0 ] && [ "$bench" -eq 0 ]
