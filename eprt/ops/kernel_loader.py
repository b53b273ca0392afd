"""Compile (NVRTC, C++17) and cache per (file, device) the CUDA kernels of ``kernels/*.cu``
(or ``EPRT_KERNEL_DIR``) with ``cupy.RawModule``. ``KERNELS`` lists every entry point each
file exports; ``tests/test_kernels_compile.py`` checks it against the PTX nvcc produces.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from eprt import env

KERNELS: dict[str, tuple[str, ...]] = {
    "rms_norm.cu": ("rms_norm", "add_rms_norm_bf16", "add_rms_norm_f32"),
    "rope.cu": ("rope_cs_bf16", "rope_cs_f32", "qk_norm_rope_kv_bf16", "qk_norm_rope_kv_f32"),
    "kv_write.cu": ("kv_write",),
    "paged_attention.cu": tuple(
        f"attention_{kind}_g{g}" for kind in ("decode", "decode_split", "prefill") for g in (4, 8, 16)
    )
    + ("attention_split_combine",),
    "router.cu": ("router_topk_bf16", "router_topk_f32", "router_grouped_bf16", "router_grouped_f32")
    + tuple(f"route_permute_{kind}_{t}" for kind in ("topk", "grouped") for t in ("bf16", "f32")),
    "moe_permute.cu": ("moe_permute", "moe_gather_rows"),
    "moe_grouped_gemm.cu": (
        "moe_gate_up_silu",
        "moe_down",
        "moe_gate_up_silu_fp8",
        "moe_down_fp8",
        "dense_gate_up_silu",
        "dense_add_norm_gate_up_silu",
        "dense_add_norm_gate_up_silu_fp8",
    ),
    "moe_tc.cu": (
        "moe_tc_gate_up",
        "moe_tc_down",
        "moe_tc_gate_up_fp8",
        "moe_tc_down_fp8",
        "moe_tc_gate_up_w8a8",
        "moe_tc_down_w8a8",
        "fp8_quantize_rows",
        "moe_tc_gate_up_swiglu",
        "moe_tc_down_bias",
    ),
    "flash_attention.cu": ("flash_attention_d64", "flash_attention_d128", "flash_attention_d256", "flash_mla"),
    "fp8_linear.cu": ("fp8_linear", "fp8_dequant"),
    "moe_combine.cu": ("moe_combine",),
    "silu_and_mul.cu": ("silu_and_mul",),
    "elementwise.cu": (
        "clip_bf16",
        "sigmoid_gate_add",
        "add_f32_f32",
        "add_f32_bf16",
        "add_bf16_f32",
        "add_bf16_bf16",
        "rank_sum_f32",
    ),
    "norm_linear.cu": ("rms_norm_linear",),
    "mla_attention.cu": (
        "mla_latent_write",
        "mla_attention",
        "mla_attention_split",
        "mla_attention_uv",
        "mla_split_combine_uv",
        "mla_prologue_bf16",
        "mla_prologue_f32",
    ),
    "argmax.cu": ("argmax_bf16", "argmax_f32"),
    "sampling.cu": ("gather_rows_bf16", "gather_rows_f32", "mask_tokens", "edit_tokens", "sample_tokens"),
    "expert_count.cu": ("count_experts",),
    "lora.cu": ("lora_shrink", "lora_expand"),
    "gptoss.cu": (
        "router_topk_softmax_bf16",
        "router_topk_softmax_f32",
        "attention_sinks",
        "moe_gate_up_swiglu_bf16",
        "moe_gate_up_swiglu_mxfp4",
        "moe_down_bias_bf16",
        "moe_down_bias_mxfp4",
    ),
    "gated_delta.cu": tuple(f"causal_conv1d_k{k}" for k in (2, 3, 4))
    + tuple(f"gated_delta_rule_dk{d}" for d in (32, 64, 128))
    + ("delta_rule_gates", "gated_rms_norm", "sigmoid_mul_bf16"),
}


@dataclass(frozen=True)
class Launch:
    """The largest launch ``CupyOps`` makes of one entry point: ``threads`` per block (its block
    sizes are capped here) and ``smem``, the most dynamic shared memory it asks for (None: up to
    the device's opt-in limit, checked by the host per call). ``tests/test_kernels_compile.py``
    holds every compiled kernel to it (registers x threads within the SM's register file, no
    spills, static shared memory), so host and kernels cannot drift apart; docs/gpu.md has the table."""

    threads: int
    smem: int | None = 0


def _each(names, threads: int, smem: int | None = 0) -> dict[str, Launch]:
    return {name: Launch(threads, smem) for name in names}


OPT_IN = None  # dynamic shared memory up to the device's opt-in limit
# moe_tc.cu: 3 pipeline stages of an A tile [64, 40] bf16 and a B tile [128, 40] bf16 or [128, 48] fp8 bytes
MOE_TC_SMEM = 3 * (64 * 40 * 2 + 128 * 40 * 2)
MOE_TC_SMEM_FP8 = 3 * (64 * 40 * 2 + 128 * 48)
MOE_TC_SMEM_W8A8 = 3 * (64 + 128) * 48  # both tiles fp8 bytes
MOE_TC_BM, MOE_TC_UNITS, MOE_TC_BN = 64, 64, 128  # moe_tc.cu: TC_BM rows, gate_up units and down columns per tile
LAUNCH: dict[str, Launch] = {
    **_each(KERNELS["rms_norm.cu"], 512),
    **_each(("rope_cs_bf16", "rope_cs_f32"), 256),
    **_each(("qk_norm_rope_kv_bf16", "qk_norm_rope_kv_f32"), 128),  # QKR_THREADS
    **_each(KERNELS["kv_write.cu"], 256),
    **_each([k for k in KERNELS["paged_attention.cu"] if k != "attention_split_combine"], 128, OPT_IN),
    "attention_split_combine": Launch(128),
    **_each([k for k in KERNELS["router.cu"] if k.startswith("router_")], 128, OPT_IN),
    **_each([k for k in KERNELS["router.cu"] if k.startswith("route_permute_")], 1024, OPT_IN),  # 32 warps at most
    "moe_permute": Launch(1024, OPT_IN),  # 32 warps at most
    "moe_gather_rows": Launch(256),
    **_each(KERNELS["moe_grouped_gemm.cu"], 128),
    **_each(("dense_add_norm_gate_up_silu", "dense_add_norm_gate_up_silu_fp8"), 128, OPT_IN),  # normed rows [T, D]
    **_each(("moe_tc_gate_up", "moe_tc_down", "moe_tc_gate_up_swiglu", "moe_tc_down_bias"), 128, MOE_TC_SMEM),
    **_each(("moe_tc_gate_up_fp8", "moe_tc_down_fp8"), 128, MOE_TC_SMEM_FP8),
    **_each(("moe_tc_gate_up_w8a8", "moe_tc_down_w8a8"), 128, MOE_TC_SMEM_W8A8),
    "fp8_quantize_rows": Launch(128),
    "fp8_linear": Launch(128),
    "fp8_dequant": Launch(256),
    "moe_combine": Launch(256),
    "silu_and_mul": Launch(256),
    **_each(KERNELS["elementwise.cu"], 256),
    **_each(("flash_attention_d64", "flash_attention_d128", "flash_attention_d256"), 128, OPT_IN),
    "flash_mla": Launch(256, OPT_IN),
    "mla_latent_write": Launch(256),
    "rms_norm_linear": Launch(512, OPT_IN),  # rms_norm's block for the width; the T normed rows in shared memory
    **_each(("mla_prologue_bf16", "mla_prologue_f32"), 512),  # rms_norm's block for the latent width
    "mla_attention": Launch(128, OPT_IN),
    "mla_attention_split": Launch(128, OPT_IN),
    "mla_attention_uv": Launch(128, OPT_IN),
    "mla_split_combine_uv": Launch(128),  # ATTN_THREADS
    **_each(KERNELS["argmax.cu"], 1024),
    "gather_rows_bf16": Launch(1024),
    "gather_rows_f32": Launch(1024),
    "mask_tokens": Launch(1024),
    "edit_tokens": Launch(256),
    "sample_tokens": Launch(256),  # SAMPLE_THREADS
    "count_experts": Launch(256),
    **_each(KERNELS["lora.cu"], 256),
    **_each([f"causal_conv1d_k{k}" for k in (2, 3, 4)], 128),
    "gated_delta_rule_dk32": Launch(128, 2 * 32 * 4),  # DELTA_THREADS; q | k of one token in float32
    "gated_delta_rule_dk64": Launch(128, 2 * 64 * 4),
    "gated_delta_rule_dk128": Launch(256, 2 * 128 * 4),  # two threads per state column
    "delta_rule_gates": Launch(256),
    "gated_rms_norm": Launch(256),
    "sigmoid_mul_bf16": Launch(256),
    "router_topk_softmax_bf16": Launch(128, OPT_IN),  # TS_WARPS warps
    "router_topk_softmax_f32": Launch(128, OPT_IN),
    "attention_sinks": Launch(128, OPT_IN),  # SA_THREADS
    **_each([k for k in KERNELS["gptoss.cu"] if k.startswith("moe_")], 128),  # SW_THREADS
}
SMEM_DEFAULT = 48 * 1024  # dynamic shared memory usable without opting in

COMPILE_OPTIONS = ("--std=c++17",)

_modules: dict[tuple[str, int], object] = {}
_kernels: dict[tuple[str, str, int], object] = {}  # (file, entry point, device) -> its RawKernel, looked up once


def kernel_dir() -> Path:
    """The folder of the ``.cu`` sources: ``EPRT_KERNEL_DIR``, the repository's ``kernels/``,
    or where a wheel installed them."""
    configured = env.KERNEL_DIR.get()
    if configured:
        path = Path(configured)
    else:  # a source checkout or editable install; a wheel installs them to <prefix>/share/eprt
        path = Path(__file__).resolve().parents[2] / "kernels"
        if not path.is_dir():
            path = Path(sys.prefix) / "share" / "eprt" / "kernels"
    if not path.is_dir():
        raise FileNotFoundError(f"kernel directory {path} does not exist (set EPRT_KERNEL_DIR)")
    return path


def compile_options(directory: Path) -> tuple[str, ...]:
    """NVRTC options for the sources in ``directory``."""
    # CuPy's compile cache keys on the source text and the options; the digest of the shared
    # headers goes into the options so an edited common.cuh recompiles every module.
    digest = hashlib.sha256()
    for header in sorted(directory.glob("*.cuh")):
        digest.update(header.read_bytes())
    return COMPILE_OPTIONS + (f"-I{directory}", f"-DEPRT_HEADERS_SHA={digest.hexdigest()[:16]}")


def cuda_include_dir() -> Path | None:
    """A directory holding ``cuda_bf16.h`` for NVRTC: CuPy's CUDA path, the toolkit of the
    nvcc on PATH, /usr/local/cuda, or the headers of an ``nvidia-*`` wheel; None if none has it.
    (CuPy adds its own guess, which can point at a wheel without headers.)"""
    import cupy

    candidates = []
    if cupy.cuda.get_cuda_path():
        candidates.append(Path(cupy.cuda.get_cuda_path()) / "include")
    if shutil.which("nvcc"):
        candidates.append(Path(shutil.which("nvcc")).resolve().parents[1] / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates.extend(sorted(Path(root).glob("*/include")))
    return next((c for c in candidates if (c / "cuda_bf16.h").is_file()), None)


def get_module(filename: str):
    """The compiled module of ``kernels/<filename>`` on the current CUDA device."""
    import cupy

    if filename not in KERNELS:
        raise KeyError(f"unknown kernel file {filename!r}; known: {sorted(KERNELS)}")
    key = (filename, cupy.cuda.Device().id)
    module = _modules.get(key)
    if module is None:
        directory = kernel_dir()
        source = (directory / filename).read_text()
        include = cuda_include_dir()
        options = compile_options(directory) + ((f"-I{include}",) if include else ())
        module = cupy.RawModule(code=source, options=options)
        try:
            module.compile()
        except cupy.cuda.compiler.CompileException as e:
            raise RuntimeError(
                f"compiling {directory / filename} failed (if cuda_bf16.h is not found, "
                f"set CUDA_PATH to the CUDA toolkit):\n{e}"
            ) from None
        _modules[key] = module
    return module


def get_kernel(filename: str, name: str):
    """One ``extern "C"`` entry point of ``kernels/<filename>`` as a ``cupy.RawKernel``, looked up
    in its module once per (file, name, device) and reused by every launch after."""
    import cupy

    key = (filename, name, cupy.cuda.Device().id)
    kernel = _kernels.get(key)
    if kernel is None:
        if name not in KERNELS.get(filename, ()):
            raise KeyError(f"{filename} does not export a kernel named {name!r}")
        kernel = _kernels[key] = get_module(filename).get_function(name)
    return kernel


def launch(file: str, name: str, grid: tuple, block: int, args: tuple, smem: int = 0) -> None:
    """Launch entry point ``name`` of ``kernels/<file>``, held to its ``LAUNCH`` entry."""
    most = LAUNCH[name]
    if block > most.threads or (most.smem is not None and smem > most.smem):
        raise RuntimeError(
            f"{name}: a launch of {block} threads and {smem} bytes of dynamic shared memory exceeds its entry "
            f"in kernel_loader.LAUNCH ({most}), which its compiled resource budget is checked against"
        )
    kernel = get_kernel(file, name)
    if smem > SMEM_DEFAULT and smem > (kernel.max_dynamic_shared_size_bytes or 0):
        kernel.max_dynamic_shared_size_bytes = smem  # opt in to the larger carve-out (sm_80+), once per size
    kernel(grid, (block,), args, shared_mem=smem)
