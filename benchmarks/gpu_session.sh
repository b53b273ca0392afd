#!/usr/bin/env bash
# One prepared run on a GPU machine without network (docs/gpu.md, "A GPU machine without network"):
# prepare here with benchmarks/gpu_prepare.sh (checkpoints and wheels into .gpu-carry/), copy the
# repository with .gpu-carry/, then from its root:
#   bash benchmarks/gpu_session.sh            # on the GPU: at most ~400 s of stage timeouts
#   bash benchmarks/gpu_session.sh --cusim    # the CPU dry run (tests/run_all.sh): GPU stages on cusim,
#                                             # in a venv of the GPU image's packages only
# First every import the stages need is checked (what is missing is printed, and a stage that cannot
# run says SKIPPED and fails the session); then the carried wheels install (mpich -> mpiexec, mpi4py,
# pytest-mpi) and the stages run, each under its own timeout (SIGINT first, so pytest still writes
# its summary and junit): device facts, kernel budgets, every GPU test (-n 12 with pytest-xdist; -n 2 on cusim),
# 2-rank expert parallelism and the tensor-core kernels end to end through mpiexec (one GPU: the host
# combine), the combine benchmark, bench_gpu.py at batch 1/32/128 and its prefill / batch-128 table
# beside torch. Under ${OUT:-/tmp/eprt-gpu}: session.log, a junit file per pytest stage (rank 0's for
# MPI) and table.md, the one table for the README. Exit 0 only if all passed.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
cusim=0
[ "${1:-}" = "--cusim" ] && cusim=1
out=${OUT:-/tmp/eprt-gpu}
carry=${EPRT_GPU_CARRY:-$root/.gpu-carry}
mkdir -p "$out"
log="$out/session.log"
[ -n "${EPRT_GPU_VENV:-}" ] || : >"$log"
exec > >(tee -a "$log") 2>&1
t0=$(date +%s)
declare -A rcs=()
elapsed() { echo $(($(date +%s) - t0)); }

if [ "$cusim" = 1 ] && [ -z "${EPRT_GPU_VENV:-}" ]; then
  # A venv holding this machine's installs of the GPU image's packages only (benchmarks/
  # gpu_image_packages.txt, and what they need as installed here): their files are linked in, so
  # every other package is absent, as on the image (a fresh install of torch and transformers would
  # cost minutes of CI for the same files).
  v0=$(date +%s%N)
  venv=$(mktemp -d)/venv
  python3 -m venv --without-pip "$venv" || exit 1
  python3 - "$root/benchmarks/gpu_image_packages.txt" \
    "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" <<'EOF' || exit 1
import importlib.metadata as md
import os
import re
import sys

norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
allowed = {norm(x.strip()) for x in open(sys.argv[1]) if x.strip() and not x.startswith("#")}
dists = {norm(d.metadata["Name"] or ""): d for d in md.distributions()}
todo = [n for n in allowed if n in dists]  # what an image package needs as installed here counts as it
while todo:
    for r in dists[todo.pop()].requires or []:
        dep = norm(re.match(r"[A-Za-z0-9._-]+", r).group())
        if "extra ==" not in r and dep in dists and dep not in allowed:
            allowed.add(dep)
            todo.append(dep)
allowed.discard("eprt")  # the tree under test comes from PYTHONPATH
target, linked = sys.argv[2], set()
for name in sorted(allowed & set(dists)):
    dist = dists[name]
    base = str(dist.locate_file(""))
    for f in dist.files or []:
        first = f.parts[0] if f.parts else ""
        src = os.path.join(base, first)
        if first and first not in ("..", "__pycache__") and first not in linked and os.path.exists(src):
            os.symlink(src, os.path.join(target, first))
            linked.add(first)
print(f"dry-run venv: {len(allowed & set(dists))} of this machine's {len(dists)} packages (the image's and their needs)")
EOF
  echo "== dry-run venv of the GPU image's packages: $(( ($(date +%s%N) - v0) / 1000000 )) ms"
  export EPRT_GPU_VENV=$venv PATH="$venv/bin:$PATH"
fi

echo "== eprt GPU session ($([ "$cusim" = 1 ] && echo "CPU dry run on cusim" || echo GPU)), $(date -u +%FT%TZ), out $out"

# ---- imports: every one a stage needs, before anything else ---------------------------------------
site=/tmp/eprt-site-$$ mpi=/tmp/eprt-mpi-$$
if [ -d "$carry/wheels" ]; then
  py312=$(python3 -c 'import sys; print(int(sys.version_info[:2] == (3, 12)))')
  whls=("$carry"/wheels/pytest_mpi-*.whl)
  if [ "$py312" = 1 ]; then whls+=("$carry"/wheels/mpi4py-*.whl); else
    echo "== the carried mpi4py wheel is for cp312: this Python ($(python3 -V)) keeps its own mpi4py"; fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${whls[@]}" &&
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --ignore-installed --prefix "$mpi" \
      "$carry"/wheels/mpich-*.whl || echo "== the carried wheels did not install"
  export PATH="$mpi/bin:$PATH" LD_LIBRARY_PATH="$mpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" MPI4PY_LIBMPI="$mpi/lib/libmpi.so.12"
else
  echo "== no $carry/wheels (run benchmarks/gpu_prepare.sh first): nothing carried installs"
fi
export PYTHONPATH="$root:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
[ "$cusim" = 1 ] && export PYTHONPATH="$root/tests:$PYTHONPATH"
ckroot=$(mktemp -d)
if [ -f "$carry/ckpt.tar.gz" ]; then tar -C "$ckroot" -xzf "$carry/ckpt.tar.gz"; else mkdir -p "$ckroot/ckpt"; fi
export EPRT_TEST_CKPT_DIR="$ckroot/ckpt"
echo "== carried: $(du -sh "$carry" 2>/dev/null | cut -f1) in $carry ($(ls "$EPRT_TEST_CKPT_DIR" | wc -l) checkpoints); set up at $(elapsed) s"

missing=$(python3 - "$cusim" <<'EOF'
import importlib
import sys

need = ["numpy", "safetensors", "tokenizers", "torch", "transformers", "PIL", "pytest", "hypothesis", "peft",
        "mpi4py.MPI", "pytest_mpi"]
need += ["cusim.plugin"] if sys.argv[1] == "1" else ["cupy", "cupy.cuda.nccl", "xdist", "pytest_timeout"]
gone = []
for name in need:
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - each is reported
        gone.append(name)
        print(f"   missing: {name} ({type(e).__name__}: {e})", file=sys.stderr)
print(" ".join(gone))
EOF
)
command -v mpiexec >/dev/null || missing="$missing mpiexec"
echo "== imports: ${missing:-all there}"
has() { for m in "$@"; do case " $missing " in *" $m "*) return 1 ;; esac; done; }

# On cusim the limits guard against a hang only: the simulator's speed depends on the machine's load
# (tests/run_all.sh runs this beside other tests), so they are EPRT_CUSIM_SLACK (default 3) times longer.
slack=$([ "$cusim" = 1 ] && echo "${EPRT_CUSIM_SLACK:-3}" || echo 1)
stage() { # name timeout_s command...: SIGINT at the timeout, so pytest prints its summary and writes its junit
  local name=$1 limit=$(($2 * slack)) start=$SECONDS
  shift 2
  echo "== stage $name (timeout ${limit} s, at $(elapsed) s)"
  timeout -s INT -k 15 "$limit" "$@"
  rcs[$name]=$?
  echo "== stage $name: exit ${rcs[$name]} after $((SECONDS - start)) s"
}
skipped() { rcs[$1]=SKIPPED; echo "== stage $1: SKIPPED ($2)"; }

pytest_args=(-q -p no:cacheprovider -rs --tb=short)
if [ "$cusim" = 1 ]; then
  gpu_args=(-p cusim.plugin -m "gpu and not slow")  # the slow ones (every architecture) on the GPU only
  run=(python3 -m cusim.run)
else
  pytest_args+=(--timeout 60)  # pytest-timeout: a hung test fails alone
  gpu_args=()
  run=(python3)
fi

# ---- stages --------------------------------------------------------------------------------------
facts=$(mktemp --suffix .py)
cat >"$facts" <<'EOF'
import shutil

import cupy

rt = cupy.cuda.runtime
p = rt.getDeviceProperties(0)
name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
keys = ("major", "minor", "multiProcessorCount", "regsPerBlock", "regsPerMultiprocessor", "sharedMemPerBlock",
        "sharedMemPerBlockOptin", "maxThreadsPerBlock", "l2CacheSize", "totalGlobalMem")
print("device properties:", {k: p.get(k) for k in keys})
print(f"devices {rt.getDeviceCount()}, CuPy {cupy.__version__}, CUDA runtime {rt.runtimeGetVersion()}")
try:
    from cupy.cuda import nccl

    uid = nccl.get_unique_id()  # no communicator here: one from a reused id hangs NCCL
    print(f"NCCL {nccl.get_version()}, unique id {type(uid).__name__} of {len(uid)}")
except Exception as e:  # noqa: BLE001
    print(f"NCCL: {type(e).__name__}: {e}")
from mpi4py import MPI

print(f"mpi4py {__import__('mpi4py').__version__}: {MPI.Get_library_version().splitlines()[0]}; mpiexec {shutil.which('mpiexec')}")
print(f"TABLE device={name} (sm_{p['major']}{p['minor']}, {p['multiProcessorCount']} SMs, "
      f"{p['totalGlobalMem'] / 2**30:.0f} GiB), CuPy {cupy.__version__}, CUDA runtime {rt.runtimeGetVersion()}")
EOF
[ "$cusim" = 1 ] || nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
if has mpi4py.MPI; then stage facts 20 "${run[@]}" "$facts"; else skipped facts "no mpi4py.MPI"; fi

if [ "$cusim" = 1 ]; then  # nvcc and ptxas ran in the suite before this dry run (tests/run_all.sh)
  stage kernels 40 python3 -m pytest "${pytest_args[@]}" tests/test_kernels_compile.py -k catches_each_excess \
    --junitxml="$out/kernels.xml"
elif command -v nvcc >/dev/null; then
  stage kernels 40 python3 -m pytest "${pytest_args[@]}" tests/test_kernels_compile.py --junitxml="$out/kernels.xml"
else skipped kernels "no nvcc"; fi

gpu_files=(tests/test_cupy_*.py tests/test_gpu_*.py)
if [ "$cusim" = 1 ]; then  # on pytest-xdist workers where it is there (the image has it); tests sharing a fixture together
  workers=()
  python3 -c "import xdist" 2>/dev/null && workers=(-n "${EPRT_CUSIM_WORKERS:-2}" --dist loadgroup)
  stage gpu 600 python3 -m pytest "${pytest_args[@]}" "${gpu_args[@]}" "${workers[@]}" "${gpu_files[@]}" \
    --junitxml="$out/gpu.xml"
elif has cupy xdist pytest_timeout; then
  stage gpu 90 python3 -m pytest "${pytest_args[@]}" -n 12 "${gpu_files[@]}" --junitxml="$out/gpu.xml"
else skipped gpu "missing:$missing"; fi
built=$(comm -13 <(sort "$carry/ckpt.list" 2>/dev/null) <(ls "$EPRT_TEST_CKPT_DIR" | sort) | tr '\n' ' ')

# rank 0 writes the junit ($0 of the inner shell); the tensor-core kernels end to end at 2 ranks (at 3 on
# cusim only the expert split: the same kernels, 2 more minutes of simulation)
if has mpi4py.MPI pytest_mpi mpiexec; then
  for n in $([ "$cusim" = 1 ] && echo 2 3 || echo 2); do
    mpi_files="tests/mpi/test_gpu_expert_parallel_mpi.py$([ "$n" = 2 ] && echo " tests/mpi/test_gpu_tensor_cores_mpi.py")"
    mpi_pytest='exec python3 -m pytest "$@" --with-mpi '"$mpi_files"' $([ "${PMI_RANK:-0}" = 0 ] && echo "--junitxml=$0")'
    stage "mpi-$n" $([ "$cusim" = 1 ] && echo 600 || echo 120) \
      mpiexec -n "$n" bash -c "$mpi_pytest" "$out/mpi-$n.xml" "${pytest_args[@]}" "${gpu_args[@]}" -m gpu
  done
  combine_args=$([ "$cusim" = 1 ] && echo --tiny || echo "--hidden 2048 --rows 1,32,128 --reps 50")
  # shellcheck disable=SC2086
  stage combine 20 mpiexec -n 2 "${run[@]}" benchmarks/bench_combine.py $combine_args
else
  skipped mpi-2 "missing:$missing"
  skipped combine "missing:$missing"
fi

bench_args=$([ "$cusim" = 1 ] &&
  echo "--tiny --context 20 --batches 1,3 --steps 1 --attention-contexts 300 --prefill 24" ||
  echo "--layers 16 --batches 1,32,128 --steps 10")
# shellcheck disable=SC2086
stage bench $([ "$cusim" = 1 ] && echo 900 || echo 110) "${run[@]}" benchmarks/bench_gpu.py $bench_args

# ---- the table -----------------------------------------------------------------------------------
total=$(elapsed)
python3 - "$log" "$out" "$total" "$built" "$(declare -p rcs)" >"$out/table.md" <<'EOF'
import glob
import re
import sys
import xml.etree.ElementTree as ET

log, out, total, built, rcs = open(sys.argv[1]).read(), sys.argv[2], sys.argv[3], sys.argv[4].split(), sys.argv[5]
status = dict(re.findall(r"\[([\w-]+)\]=\"?([\w]+)\"?", rcs))
device = re.findall(r"TABLE device=(.*)", log)
rows = [("device", device[-1] if device else "unknown (the facts stage did not run)")]
for stage, what in (("kernels", "kernel budgets (ptxas, sm_80/sm_90)"), ("gpu", "GPU tests (ops, end-to-end, fp8, hybrid, "
                    "sampling, vision, LoRA)"), ("mpi-2", "2-rank expert parallelism and tensor-core prefill vs NumPy (mpiexec -n 2)"),
                    ("mpi-3", "3 ranks")):
    files = glob.glob(f"{out}/{stage}.xml")
    if stage not in status:
        continue
    if not files:
        rows.append((what, f"no result ({'SKIPPED' if status[stage] == 'SKIPPED' else 'exit ' + status[stage]})"))
        continue
    suite = ET.parse(files[0]).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    n, f, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    rows.append((what, f"{n - f - e - s} passed, {f + e} failed, {s} skipped (exit {status[stage]})"))
bench = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+([\d.]+%)", log, re.M)
shape = re.findall(r"(Shape\(layers=\d+, hidden=\d+.*?\)); context (\d+)", log)
for batch, ms, tps, frac in bench:
    rows.append((f"decode batch {batch}", f"{float(tps):,.0f} tok/s, {ms} ms/step, {frac} of HBM peak"))
if shape:
    rows.append(("decode model", f"random bf16 {shape[-1][0]}, context {shape[-1][1]} (benchmarks/bench_gpu.py)"))
torch = re.findall(r"^beside torch (\S+) on (\w+)", log, re.M)
for what, ours, theirs, ratio in re.findall(r"^\| ((?:prefill|decode|MoE|attention|MLA)[^|]*) \| ([\d,]+) \| ([\d,]+) \| ([\d.]+) \|$", log, re.M):
    rows.append((what, f"{ours} tok/s vs torch {theirs} ({ratio}x)"))
if torch:
    rows.append(("torch baseline", f"torch {torch[-1][0]} on {torch[-1][1]}: matmul per expert, scaled_dot_product_attention (bench_gpu.py)"))
combine = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([^|]+) \|$", log, re.M)
if combine:
    host = ", ".join(f"{t} rows {us} us" for t, us, _ in combine)
    rows.append(("MoE combine per layer, 2 ranks", f"host staging: {host}; NCCL: {combine[0][2].strip()}"))
rows.append(("session", f"{total} s" + (f"; checkpoints built here, missing from gpu_prepare.sh: {' '.join(built)}" if built else "")))
print("| what | result |\n|---|---|")
for what, result in rows:
    print(f"| {what} | {result} |")
EOF
echo "== table (also $out/table.md):"
cat "$out/table.md"
bad=()
for s in "${!rcs[@]}"; do [ "${rcs[$s]}" = 0 ] || bad+=("$s=${rcs[$s]}"); done
[ -z "$built" ] || bad+=("checkpoints-built-in-session")
rm -rf "$ckroot" "$site" "$mpi" "$facts"
if [ "${#bad[@]}" -gt 0 ]; then
  echo "== eprt GPU session: NOT PASSED in $total s: ${bad[*]}"
  exit 1
fi
echo "== eprt GPU session: every stage passed in $total s"
