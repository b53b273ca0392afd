#!/usr/bin/env bash
# Run on a CPU machine with network, before benchmarks/gpu_session.sh goes to a GPU machine that has
# none (docs/gpu.md, "A GPU machine without network"). Fills ONE ignored folder, .gpu-carry/ (or $1):
#   ckpt.tar.gz  every test checkpoint the GPU stages read, built here with transformers (the GPU's
#                pytest workers then never race to build one). The "-dequantized" float32 references
#                of the FP8 copies are for the CPU tests: only their config.json is kept (the GPU tests
#                never read them; build_fp8_copy counts the copy as built).
#   wheels/      what the GPU image lacks, for cp312 manylinux x86_64: mpich (mpiexec and libmpi),
#                mpi4py (4.x loads that libmpi at run time; the image's own build is unknown), pytest-mpi.
# Prints the folder's size; the device tool carries at most 64 MiB with the working tree, so the
# folder must stay under 64 MiB less the tracked tree and an 8 MiB margin (~49 MiB today).
#   bash benchmarks/gpu_prepare.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
carry=${1:-.gpu-carry}
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)  # bytes of the tracked tree
limit=$(((64 << 20) - tree - (8 << 20)))
wheels=(mpich==5.0.2 mpi4py==4.1.2 pytest-mpi==0.6)
t0=$(date +%s)
mkdir -p "$carry/wheels"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

for w in "${wheels[@]}"; do
  name=${w%%==*}
  if ! ls "$carry/wheels/" | grep -qi "^${name//-/_}-${w##*==}-"; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$carry/wheels" "$w"
  fi
done

ckpt="$work/ckpt"
PYTHONPATH="$PWD/tests:$PWD" EPRT_TEST_CKPT_DIR="$ckpt" python3 - <<'EOF'
import os

from checkpoints import ARCHS, EXPERT_KEY, VL_VARIANTS, build_checkpoint, build_fp8_copy, build_gptoss_checkpoint, vl_checkpoint
from lora_adapters import peft_adapter, per_expert_adapter

root = os.environ["EPRT_TEST_CKPT_DIR"]
BIGGER = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=512, vocab_size=64)  # test_gpu_fp8_model


def checkpoint(arch, dtype="float32", **overrides):  # the conftest fixture's names
    tag = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    return build_checkpoint(arch, os.path.join(root, f"{arch}-{dtype}{('-' + tag) if tag else ''}"), dtype=dtype, **overrides)


for arch in ARCHS + ("qwen3_next",):
    checkpoint(arch, dtype="bfloat16")  # test_gpu_end_to_end, test_cupy_hybrid_ops, lora bases
checkpoint("qwen3_moe")  # test_cupy_sampling
for arch, block in (("deepseek_v3", (16, 32)), ("qwen3_moe", (128, 128))):  # test_gpu_fp8_model
    source = checkpoint(arch, dtype="bfloat16")
    build_fp8_copy(source, f"{source}-fp8-{block[0]}x{block[1]}", block)
    source = checkpoint(arch, dtype="bfloat16", **BIGGER)
    build_fp8_copy(source, f"{source}-fp8-128x128", (128, 128))
for name in VL_VARIANTS:
    vl_checkpoint(root, name)  # test_gpu_vision
for variant, mxfp4 in (("bf16", False), ("mxfp4", True)):  # test_cupy_gptoss
    build_gptoss_checkpoint(os.path.join(root, f"gpt_oss-{variant}"), dtype="bfloat16", mxfp4=mxfp4)
build_gptoss_checkpoint(os.path.join(root, "gpt_oss-7experts-mxfp4"), "bfloat16", mxfp4=True, num_local_experts=7)
peft_adapter(checkpoint("qwen3_moe", dtype="bfloat16"), os.path.join(root, "lora-qwen3-bf16-attn"), seed=5, r=8,
             lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])  # test_cupy_lora  # fmt: skip
per_expert_adapter(checkpoint("mixtral", dtype="bfloat16"), os.path.join(root, "lora-mixtral-bf16-per-expert"),
                   ("w1", "w3", "w2"))  # fmt: skip
for arch in ("qwen2_moe", "mixtral", "deepseek_v3"):  # tests/mpi/test_gpu_expert_parallel_mpi.py
    n = 9 if arch == "deepseek_v3" else 7
    build_checkpoint(arch, os.path.join(root, f"{arch}-{n}experts-bf16"), dtype="bfloat16",
                     **{EXPERT_KEY.get(arch, "num_experts"): n})  # fmt: skip
EOF
find "$ckpt" -path '*-dequantized/model.safetensors' -delete
tar -C "$work" -czf "$carry/ckpt.tar.gz" ckpt
ls "$ckpt" > "$carry/ckpt.list"
size=$(du -sb "$carry" | cut -f1)
echo "gpu_prepare: $carry holds $(ls "$ckpt" | wc -l) checkpoints ($(du -sh "$ckpt" | cut -f1) unpacked) and" \
  "$(ls "$carry/wheels" | wc -l) wheels: $size bytes ($((size >> 20)) MiB of the $((limit >> 20)) MiB allowed beside a tree of $((tree >> 20)) MiB), in $(($(date +%s) - t0)) s"
[ "$size" -lt "$limit" ] || { echo "gpu_prepare: $carry is over $((limit >> 20)) MiB" >&2; exit 1; }
