"""The CuPy backend: raw CUDA kernels from ``kernels/*.cu`` plus cuBLAS for the dense GEMMs.

Shape legend in ``base.py``. Activations, KV and weights are ``uint16`` raw bfloat16 bits
(``act_dtype``; only ``Ops`` methods may do arithmetic on them); router weights and the MoE
output float32, indices int32. Every launch checks its arguments' types, dtypes and shapes,
not index contents (docs/gpu.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from eprt.ops.base import GroupedRouting, Ops, Permutation
from eprt.ops.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from eprt.ops.cupy_flash import flash_gqa, flash_mla
from eprt.ops.cupy_gptoss import GptOssCupy
from eprt.ops.kernel_loader import (
    KERNELS,
    LAUNCH,
    MOE_TC_BM,
    MOE_TC_BN,
    MOE_TC_SMEM,
    MOE_TC_SMEM_FP8,
    MOE_TC_SMEM_W8A8,
    MOE_TC_UNITS,
    get_module,
)
from eprt.ops.kernel_loader import launch as _launch
from eprt.ops.lora_ops import LoraRows

# cuBLAS / CUDA library enum values (stable ABI: cublas_api.h, library_types.h).
_OP_N, _OP_T = 0, 1
_R_32F, _R_16BF = 0, 14
_COMPUTE_32F = 68
_GEMM_DEFAULT = -1

_BF16 = np.dtype(np.uint16)
_F32 = np.dtype(np.float32)
_SAMPLE_THREADS = 256  # SAMPLE_THREADS of kernels/sampling.cu
_I32 = np.dtype(np.int32)
_U8 = np.dtype(np.uint8)
_DTYPE_NAMES = {_BF16: "bf16 (uint16 bits)", _F32: "float32", _I32: "int32", _U8: "float8_e4m3fn (uint8 bytes)"}

_ATTN_THREADS = _ATTN_CHUNK = 128  # paged_attention.cu: ATTN_THREADS, ATTN_CHUNK
_ATTN_GROUP_CAPS = (4, 8, 16)  # attention_*_g{cap} entry points
_ATTN_MAX_SPLITS = 256  # paged_attention.cu: ATTN_MAX_SPLITS
DECODE_SPLITS = ("auto", "on", "off")
_ROUTER_WARPS = 4  # router.cu: ROUTER_WARPS
_GG_WARPS = 4  # moe_grouped_gemm.cu: GG_WARPS
_MLA_THREADS, _MLA_CHUNK = 128, 32  # mla_attention.cu: MLA_THREADS, MLA_CHUNK
_MLA_MAX_HEADS = 16  # query heads per block of mla_attention (fewer when shared memory is short)
_MLA_MAX_UV_C = 1024  # mla_attention.cu: MLA_MAX_UV_C, the latent width mla_split_combine_uv takes


def _mla_smem(L: int, C: int, g: int) -> int:
    """mla_attention.cu's dynamic shared memory for g heads per block, in bytes."""
    return 2 * _MLA_CHUNK * L + 4 * (g * L + g * _MLA_CHUNK + 3 * g + g * C)


MOE_IMPLS = ("auto", "grouped", "tc", "gathered")
FP8_MMAS = ("off", "on")  # FP8 experts on the FP8 tensor cores (W8A8, sm_89+), activations quantized
TC_MIN_SLOTS_PER_EXPERT = 4  # "auto": (token, choice) slots per local expert from which tensor cores win
_CONV_WIDTHS, _DELTA_DK_CAPS = (2, 3, 4), (32, 64, 128)  # gated_delta.cu: causal_conv1d_k*, gated_delta_rule_dk*
MLA_FUSED_MAX_ROWS = 8  # rms_norm_linear, mla_prologue's w_uk and decode's w_uv products: CUDA cores, one GG_MT chunk
DENSE_FUSED_MAX_ROWS = 8  # gate_up_silu: up to one GG_MT chunk of rows (each weight read once) in one launch
# add_rms_norm_gate_up_silu: the normed rows' shared memory per block, at most (4 blocks, 16 warps streaming
# weights, per Hopper SM; DeepSeek-V3's D 7168: up to 3 rows in one launch)
NORM_FUSED_MAX_SMEM = 48 * 1024
ROUTE_FUSED_MAX_TOKENS = 64  # route: up to this many tokens (decode) in one launch with the permutation
FP8_CUBLAS_MIN_ROWS = 64  # FP8 linear: rows from which dequantized tiles + cuBLAS beat the CUDA-core kernel
FP8_TILE_ELEMENTS = 1 << 24  # FP8 linear on many rows: weight elements dequantized per cuBLAS tile (32 MB bf16)
_FL_WARPS = 4  # fp8_linear.cu: FL_WARPS


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 block-scaled weight resident on the GPU (``CupyOps.weight_fp8``): float8_e4m3fn bytes
    ``data[.., N, K]`` (uint8) and float32 ``scale[.., (N / part_rows) * ceil(part_rows / block_n),
    ceil(K / block_k)]``; rows [i * part_rows, (i + 1) * part_rows) are blocked on their own."""

    data: object
    scale: object
    block_n: int
    block_k: int
    part_rows: int

    @property
    def shape(self) -> tuple:
        return tuple(self.data.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes) + int(self.scale.nbytes)


def _check(op: str, name: str, a, dtypes, shape: tuple | None = None, aligned: bool = False):
    """Validate one kernel argument; ``shape`` entries of None match any size."""
    if not isinstance(a, cupy.ndarray):
        raise TypeError(f"{op}: {name} must be a cupy array on the GPU, got {type(a).__name__}")
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    if a.dtype not in dtypes:
        want = " or ".join(_DTYPE_NAMES[d] for d in dtypes)
        raise TypeError(f"{op}: {name} must be {want}, got {a.dtype}")
    if shape is not None and (a.ndim != len(shape) or any(s is not None and s != n for s, n in zip(shape, a.shape))):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{op}: {name} has shape {list(a.shape)}, expected {want}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{op}: {name} must be C-contiguous (use xp.ascontiguousarray)")
    if aligned and a.data.ptr % 16:
        raise ValueError(f"{op}: {name} must start on a 16-byte boundary (a row slice of odd width?)")


def _row_stride(op: str, name: str, a, shape: tuple) -> int:
    """Validate a bf16 array whose rows may be spaced (a column slice of one product: [T, ..] with
    every dim after the first contiguous) and return its row stride in elements."""
    if not isinstance(a, cupy.ndarray):
        raise TypeError(f"{op}: {name} must be a cupy array on the GPU, got {type(a).__name__}")
    _check(op, name, a[:1], _BF16, (None, *shape[1:]))  # one row: its dtype, shape and contiguity
    _require(op, a.ndim == len(shape), f"{name} has shape {list(a.shape)}, expected {len(shape)} dims")
    return a.strides[0] // a.itemsize if a.shape[0] > 1 else int(np.prod(a.shape[1:]))


def _require(op: str, ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"{op}: {message}")


def _threads(n: int, name: str) -> int:
    """A block size for kernel ``name``: n rounded up to whole warps, at least one warp, at most
    its largest launch (``kernel_loader.LAUNCH``, which the kernels' resource budgets are held to)."""
    return max(32, min(LAUNCH[name].threads, (n + 31) // 32 * 32))


def _block(name: str) -> int:
    """The fixed block size of kernel ``name`` (its ``kernel_loader.LAUNCH`` entry)."""
    return LAUNCH[name].threads


def _cublas_handle(cublas) -> int:
    """The device's cuBLAS handle, bound to the calling thread's current stream (the rank's own:
    ``CupyOps.stream``), so a GEMM is ordered with the kernels around it and captured with them."""
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
    return handle


def _gemm_per_head(x, w, out) -> None:
    """out[T, H, N] = x[T, H, K] @ w[H, N, K].T per head h: one strided-batched cuBLAS call (bf16
    in, fp32 compute, bf16 out). x and out may be views (their last dim contiguous): column-major per
    head, out_h.T (ld: out's row stride) = op_T(w_h) @ x_h.T (ld: x's row stride)."""
    from cupy_backends.cuda.libs import cublas

    T, H, K = x.shape
    N = w.shape[1]
    (x_row, x_head), (o_row, o_head) = ((a.strides[0] // 2, a.strides[1] // 2) for a in (x, out))
    if T == 1:  # a one-row view's row stride may be anything; cuBLAS wants ld >= the row's width
        x_row, o_row = max(x_row, H * K), max(o_row, H * N)
    alpha, beta = np.array(1.0, np.float32), np.array(0.0, np.float32)  # host scalars
    cublas.gemmStridedBatchedEx(
        _cublas_handle(cublas),
        _OP_T,
        _OP_N,
        N,
        T,
        K,
        alpha.ctypes.data,
        w.data.ptr,
        _R_16BF,
        K,
        N * K,
        x.data.ptr,
        _R_16BF,
        x_row,
        x_head,
        beta.ctypes.data,
        out.data.ptr,
        _R_16BF,
        o_row,
        o_head,
        H,
        _COMPUTE_32F,
        _GEMM_DEFAULT,
    )


def _gemm(m: int, n: int, k: int, a_ptr: int, b_ptr: int, c_ptr: int, c_dtype, beta: float = 0.0, ldc: int = 0):
    """Row-major c[m, n] = a[m, k] @ b[n, k].T (+ beta * c): bf16 inputs, fp32 accumulation,
    c bf16 or fp32 with row stride ldc (0: n). cuBLAS is column-major: it computes c.T = op_T(b) @ a.T."""
    from cupy_backends.cuda.libs import cublas

    alpha, beta_ = np.array(1.0, np.float32), np.array(beta, np.float32)  # host scalars
    cublas.gemmEx(
        _cublas_handle(cublas),
        _OP_T,
        _OP_N,
        n,
        m,
        k,
        alpha.ctypes.data,
        b_ptr,
        _R_16BF,
        k,
        a_ptr,
        _R_16BF,
        k,
        beta_.ctypes.data,
        c_ptr,
        _R_32F if c_dtype == _F32 else _R_16BF,
        ldc or n,
        _COMPUTE_32F,
        _GEMM_DEFAULT,
    )


class CupyOps(GptOssCupy, Ops):
    name = "cuda"
    act_dtype = np.uint16  # bfloat16 bits
    kv_itemsize = 2  # bytes per KV cache element (bf16)
    fp8_resident = True  # FP8 checkpoints stay FP8 on the device, dequantized inside the GEMMs

    def __init__(self, moe_impl: str = "auto", decode_split: str = "auto", split_keys: int = 512, fp8_mma: str = "off"):
        """``moe_impl``: expert GEMMs (``_moe_choice``: "grouped" CUDA cores, "tc" tensor cores,
        "gathered" cuBLAS per expert after a host sync, "auto" by shape). ``decode_split``: split each decode
        context into partitions of ``split_keys`` keys ("auto": when there are fewer
        (sequence, KV head) blocks than two per SM, the case of small batches). ``fp8_mma`` "on":
        FP8 experts on the tensor-core path run W8A8 on sm_89+ (the activations quantized to e4m3 per
        row and K block, the FP8 tensor cores); "off" (the default) converts the weights to bf16 in
        the tiles and keeps the activations bf16, closer to the reference's numbers."""
        if moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {moe_impl!r}")
        if decode_split not in DECODE_SPLITS:
            raise ValueError(f"decode_split must be one of {DECODE_SPLITS}, got {decode_split!r}")
        if split_keys < 1 or split_keys % _ATTN_CHUNK:
            raise ValueError(f"split_keys must be a positive multiple of {_ATTN_CHUNK}, got {split_keys}")
        if fp8_mma not in FP8_MMAS:
            raise ValueError(f"fp8_mma must be one of {FP8_MMAS}, got {fp8_mma!r}")
        self.xp = cupy
        self.moe_impl, self.decode_split, self.split_keys = moe_impl, decode_split, split_keys
        rt, dev = cupy.cuda.runtime, cupy.cuda.Device().id
        self.device = dev  # the current device of the thread that made the backend
        self._host_waits: list = []  # called before the host waits on the stream (add_host_wait)
        self._graph_launches: list = []  # called after each CUDA graph launch (add_graph_launch)
        # The rank's own stream for every kernel, GEMM, copy and collective: the legacy default
        # stream synchronizes with every other and cannot be captured into a CUDA graph.
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.stream.use()
        self.sm_count = rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, dev)
        self.smem_limit = rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)  # bytes
        major = rt.deviceGetAttribute(rt.cudaDevAttrComputeCapabilityMajor, dev)
        minor = rt.deviceGetAttribute(rt.cudaDevAttrComputeCapabilityMinor, dev)
        self.fp8_mma = fp8_mma == "on" and (major, minor) >= (8, 9)  # FP8 tensor cores exist from sm_89

    # ---- data movement -------------------------------------------------------------
    def weight(self, host: np.ndarray):
        if host.dtype == np.uint16:
            return cupy.asarray(np.ascontiguousarray(host))
        if host.dtype.kind != "f":
            raise TypeError(f"weight: expected float32 or uint16 bfloat16 bits, got {host.dtype}")
        return cupy.asarray(f32_to_bf16_bits(host))

    def weight_fp8(self, raw, scale_inv, block_n, block_k, part_rows):
        op = "weight_fp8"
        raw, scale_inv = np.asarray(raw), np.asarray(scale_inv)
        _require(
            op, raw.dtype == _U8 and raw.ndim in (2, 3), f"raw must be 2-D or 3-D uint8, got {raw.dtype} {raw.ndim}-D"
        )
        N, K = raw.shape[-2:]
        _require(op, block_n >= 1 and block_k >= 1, f"block size must be positive, got [{block_n}, {block_k}]")
        _require(op, part_rows >= 1 and N % part_rows == 0, f"part_rows must divide N={N}, got {part_rows}")
        want = (*raw.shape[:-2], N // part_rows * -(-part_rows // block_n), -(-K // block_k))
        _require(op, scale_inv.shape == want, f"scale_inv has shape {scale_inv.shape}, expected {want}")
        w = Fp8Weight(
            cupy.asarray(np.ascontiguousarray(raw)),
            cupy.asarray(np.ascontiguousarray(scale_inv, dtype=np.float32)),
            block_n,
            block_k,
            part_rows,
        )
        if K % 8 or block_k % 8:  # the GEMM kernels read 8 weights under one scale: keep bf16 instead
            return self._dequantize(w, 0, w.data.size // K).reshape(w.shape)
        return w

    def _dequantize(self, w: Fp8Weight, row0: int, rows: int, out=None):
        """bf16 rows [row0, row0 + rows) of an FP8 weight (its leading dims flattened into rows)."""
        K = w.shape[-1]
        out = cupy.empty((rows, K), dtype=_BF16) if out is None else out  # [rows, K]
        if rows and K:
            _launch(
                "fp8_linear.cu",
                "fp8_dequant",
                (min((rows * K + 255) // 256, 65536),),
                256,
                (
                    w.data,
                    w.scale,
                    out,
                    np.int32(row0),
                    np.int32(rows),
                    np.int32(K),
                    np.int32(w.block_n),
                    np.int32(w.block_k),
                    np.int32(w.part_rows),
                ),
            )
        return out

    def activation(self, host: np.ndarray):
        host = np.asarray(host)
        if host.dtype.kind != "f":
            raise TypeError(f"activation: expected float data, got {host.dtype}")
        return cupy.asarray(f32_to_bf16_bits(host))

    def index(self, host):
        if isinstance(host, cupy.ndarray):
            return cupy.ascontiguousarray(host, dtype=cupy.int32)
        return cupy.asarray(np.ascontiguousarray(host, dtype=np.int32))

    def add_host_wait(self, fn) -> None:
        """Call ``fn()`` before each wait of the host on the stream (the NCCL combine polls its
        last collective there, watching for a hang: eprt/comm/device_combine.py)."""
        self._host_waits.append(fn)

    def _host(self, a) -> np.ndarray:
        """``a`` copied to the host: a wait on the stream."""
        for fn in self._host_waits:
            fn()
        return cupy.asnumpy(a)

    def bind_thread(self) -> None:
        cupy.cuda.runtime.setDevice(self.device)
        self.stream.use()  # CuPy's current stream is per thread too

    def add_graph_launch(self, fn) -> None:
        """Call ``fn(stream)`` after each CUDA graph launch on the rank's stream (the NCCL combine
        records its watchdog event there: a graph's collectives are not issued one by one)."""
        self._graph_launches.append(fn)

    def graph_launched(self) -> None:
        for fn in self._graph_launches:
            fn(self.stream)

    def to_host(self, a) -> np.ndarray:
        h = self._host(a)
        if h.dtype == np.uint16:
            return bf16_bits_to_f32(h)
        return h.astype(np.float32) if h.dtype.kind == "f" else h

    def zeros(self, shape: tuple, dtype: str = "act"):
        dtypes = {"act": _BF16, "f32": _F32, "i32": _I32}
        if dtype not in dtypes:
            raise ValueError(f"zeros: dtype must be 'act', 'f32' or 'i32', got {dtype!r}")
        return cupy.zeros(shape, dtype=dtypes[dtype])

    def synchronize(self) -> None:
        for fn in self._host_waits:
            fn()
        self.stream.synchronize()

    def warm_up(self) -> None:
        """Compile (or load from CuPy's cache) every kernel module now, not in the first
        forward pass: a cold NVRTC cache costs seconds, and a compile error is then a named
        start-up failure."""
        for file in KERNELS:
            get_module(file)

    # ---- norms, linear, rope ---------------------------------------------------------
    def embedding(self, table, ids):
        _check("embedding", "table", table, _BF16, (None, None))
        _check("embedding", "ids", ids, _I32, (None,))
        return cupy.take(table, ids, axis=0)  # [T, D]

    def rms_norm(self, x, weight, eps):
        _check("rms_norm", "x", x, _BF16)
        _require("rms_norm", x.ndim >= 1 and x.shape[-1] > 0, f"x needs a last dim, got shape {x.shape}")
        D = x.shape[-1]
        _check("rms_norm", "weight", weight, _BF16, (D,))
        out = cupy.empty_like(x)
        if x.size:
            _launch(
                "rms_norm.cu",
                "rms_norm",
                (x.size // D,),
                _threads(D // 4, "rms_norm"),
                (x, weight, out, np.int32(D), np.float32(eps)),
            )
        return out

    def add_rms_norm(self, x, residual, weight, eps, extra=None):
        _check("add_rms_norm", "residual", residual, _BF16, (None, None))
        T, D = residual.shape
        _check("add_rms_norm", "x", x, (_BF16, _F32), (T, D))
        _check("add_rms_norm", "weight", weight, _BF16, (D,))
        if extra is not None:
            _check("add_rms_norm", "extra", extra, _BF16, (T, D))
        out, s = cupy.empty_like(residual), cupy.empty_like(residual)
        if T:
            kernel = "add_rms_norm_f32" if x.dtype == _F32 else "add_rms_norm_bf16"
            args = (x, residual, weight, out, s, np.int32(D), np.float32(eps))
            args += (residual if extra is None else extra, np.int32(extra is not None))  # (not read without)
            _launch("rms_norm.cu", kernel, (T,), _threads(D // 4, kernel), args)
        return out, s

    def linear(self, x, w, bias=None):
        if isinstance(w, Fp8Weight):
            return self._linear_fp8(x, w, bias)
        _check("linear", "w", w, _BF16, (None, None))
        N, K = w.shape
        _check("linear", "x", x, _BF16, (None, K))
        out = cupy.empty((x.shape[0], N), dtype=_BF16)  # [T, N]
        if bias is not None:
            _check("linear", "bias", bias, _BF16, (N,))
            out[...] = bias  # accumulated with beta = 1
        if x.shape[0] and N:
            _gemm(x.shape[0], N, K, x.data.ptr, w.data.ptr, out.data.ptr, _BF16, beta=0.0 if bias is None else 1.0)
        return out

    def rms_norm_linear(self, x, norm, eps, w):
        op = "rms_norm_linear"
        T = x.shape[0] if isinstance(x, cupy.ndarray) else 0
        fused = not isinstance(w, Fp8Weight) and 0 < T <= MLA_FUSED_MAX_ROWS and w.ndim == 2 and w.shape[1] % 8 == 0
        if not fused:  # larger batches, prefill: the unfused ops (cuBLAS)
            return self.linear(self.rms_norm(cupy.ascontiguousarray(x), norm, eps), w)
        _check(op, "w", w, _BF16, (None, None), aligned=True)
        N, K = w.shape
        ldx = _row_stride(op, "x", x, (T, K))
        _check(op, "norm", norm, _BF16, (K,))
        smem = 4 * 32 + 2 * T * K  # block_sum's scratch, the normed rows (bf16)
        _require(op, smem <= self.smem_limit, f"x's {T} rows of {K} need {smem} bytes of shared memory")
        y = cupy.empty((T, N), dtype=_BF16)  # [T, N]
        threads, units = _threads(K // 4, "rms_norm"), -(-N // 2)  # rms_norm's block: its summation order
        upw = self._units_per_warp(units, 1)
        args = (x, np.int32(ldx), norm, w, y, np.int32(T), np.int32(K), np.int32(N), np.float32(eps), np.int32(upw))
        _launch("norm_linear.cu", "rms_norm_linear", (-(-units // (threads // 32 * upw)),), threads, args, smem)
        return y

    def _linear_fp8(self, x, w: Fp8Weight, bias):
        op = "linear"
        _check(op, "w", w.data, _U8, (None, None), aligned=True)
        N, K = w.shape
        _check(op, "x", x, _BF16, (None, K), aligned=True)
        T = x.shape[0]
        out = cupy.empty((T, N), dtype=_BF16)  # [T, N]
        if bias is not None:
            _check(op, "bias", bias, _BF16, (N,))
        if not T or not N:
            return out
        blocks = (np.int32(w.block_n), np.int32(w.block_k), np.int32(w.part_rows))
        if T < FP8_CUBLAS_MIN_ROWS:  # weight-bandwidth bound: CUDA cores, FP8 read once per 8 rows
            units = (N + 1) // 2
            upw = self._units_per_warp(units, 1)
            args = (x, w.data, w.scale, out if bias is None else bias, out, np.int32(T), np.int32(N), np.int32(K))
            args += (*blocks, np.int32(bias is not None), np.int32(upw))
            _launch("fp8_linear.cu", "fp8_linear", (-(-units // (_FL_WARPS * upw)),), 32 * _FL_WARPS, args)
            return out
        if bias is not None:
            out[...] = bias  # accumulated with beta = 1
        tile = max(1, min(N, FP8_TILE_ELEMENTS // max(K, 1)))
        scratch = cupy.empty((tile, K), dtype=_BF16)  # [tile, K] dequantized rows
        for n0 in range(0, N, tile):
            rows = min(tile, N - n0)
            self._dequantize(w, n0, rows, scratch)
            beta = 0.0 if bias is None else 1.0
            _gemm(T, rows, K, x.data.ptr, scratch.data.ptr, out.data.ptr + 2 * n0, _BF16, beta=beta, ldc=N)
        return out

    def rope(self, x, positions, cos_sin):
        _check("rope", "x", x, _BF16, (None, None, None))
        T, H, Dh = x.shape
        _require("rope", Dh % 2 == 0, f"head dim must be even, got {Dh}")
        _check("rope", "positions", positions, _I32, (T,))
        _check("rope", "cos_sin", cos_sin, (_BF16, _F32), (None, Dh))
        out = cupy.empty_like(x)
        if T:
            kernel = "rope_cs_f32" if cos_sin.dtype == _F32 else "rope_cs_bf16"
            _launch(
                "rope.cu",
                kernel,
                (T,),
                _threads(H * Dh // 2, kernel),
                (x, positions, cos_sin, out, np.int32(H), np.int32(Dh)),
            )
        return out

    # ---- paged KV and attention ------------------------------------------------------
    def kv_write(self, k_cache, v_cache, k, v, slot_mapping):
        _check("kv_write", "k_cache", k_cache, _BF16, (None, None, None, None), aligned=True)
        NB, BS, Hk, Dh = k_cache.shape
        _check("kv_write", "v_cache", v_cache, _BF16, k_cache.shape, aligned=True)
        _check("kv_write", "k", k, _BF16, (None, Hk, Dh), aligned=True)
        T = k.shape[0]
        _check("kv_write", "v", v, _BF16, (T, Hk, Dh), aligned=True)
        _check("kv_write", "slot_mapping", slot_mapping, _I32, (T,))
        _require("kv_write", (Hk * Dh) % 8 == 0, f"Hk*Dh must be a multiple of 8, got {Hk}*{Dh}")
        if T:
            _launch(
                "kv_write.cu",
                "kv_write",
                (T,),
                _threads(Hk * Dh // 8, "kv_write"),
                (k_cache, v_cache, k, v, slot_mapping, np.int32(Hk * Dh)),
            )

    def qk_rope_kv_write(self, q, k, v, norms, eps, positions, cos_sin, k_cache, v_cache, slot_mapping):
        op = "qk_rope_kv_write"
        _check(op, "k_cache", k_cache, _BF16, (None, None, None, None))
        _, _, Hk, Dh = k_cache.shape
        _check(op, "v_cache", v_cache, _BF16, k_cache.shape)
        sq, sk, sv = (_row_stride(op, n, a, (None, None, Dh)) for n, a in (("q", q), ("k", k), ("v", v)))
        T, H = q.shape[:2]
        _require(op, k.shape == v.shape == (T, Hk, Dh), f"k and v must be [{T}, {Hk}, {Dh}], got {k.shape}, {v.shape}")
        _require(op, Dh <= 256 and Dh % 2 == 0, f"head dim must be even and at most 256, got {Dh}")
        _check(op, "positions", positions, _I32, (T,))
        _check(op, "cos_sin", cos_sin, (_BF16, _F32), (None, None))
        rd = cos_sin.shape[1]
        _require(op, 0 < rd <= Dh and rd % 2 == 0, f"cos_sin's width must be even and in [2, {Dh}], got {rd}")
        _check(op, "slot_mapping", slot_mapping, _I32, (T,))
        if norms is not None:
            for name, w in zip(("q_norm", "k_norm"), norms):
                _check(op, name, w, _BF16, (Dh,))
        q_norm, k_norm = norms if norms is not None else (q, q)  # (not read without norms)
        out = cupy.empty((T, H, Dh), dtype=_BF16)  # [T, H, Dh]
        if T:
            kernel = "qk_norm_rope_kv_f32" if cos_sin.dtype == _F32 else "qk_norm_rope_kv_bf16"
            args = (q, k, v, q_norm, k_norm, positions, cos_sin, out, k_cache, v_cache, slot_mapping)
            dims = (np.int32(H), np.int32(Hk), np.int32(Dh), np.int32(rd), np.int64(sq), np.int64(sk), np.int64(sv))
            nt = np.int32(_threads(Dh // 4, "rms_norm"))  # rms_norm's block per head: the same sum order
            _launch(
                "rope.cu",
                kernel,
                (T,),
                _block(kernel),
                args + dims + (nt, np.int32(norms is not None), np.float32(eps)),
            )
        return out

    def _attention_args(self, op, q, k_cache, v_cache):
        """Shared checks; returns (H, Hk, Dh, BS, cap, shared-memory bytes)."""
        _check(op, "q", q, _BF16, (None, None, None))
        H, Dh = q.shape[1:]
        _check(op, "k_cache", k_cache, _BF16, (None, None, None, Dh), aligned=True)
        _check(op, "v_cache", v_cache, _BF16, k_cache.shape, aligned=True)
        BS, Hk = k_cache.shape[1:3]
        _require(op, Hk > 0 and H % Hk == 0, f"query heads {H} must be a multiple of KV heads {Hk}")
        _require(op, Dh % 8 == 0 and 8 <= Dh <= 256, f"head dim must be a multiple of 8 in [8, 256], got {Dh}")
        G = H // Hk
        caps = [c for c in _ATTN_GROUP_CAPS if c >= G]
        _require(op, bool(caps), f"at most {_ATTN_GROUP_CAPS[-1]} query heads per KV head, got {G}")
        ntg = _ATTN_THREADS // (Dh // 4)
        smem = 4 * (G * Dh + G * _ATTN_CHUNK + 3 * G + ntg * G * Dh)
        _require(op, smem <= self.smem_limit, f"needs {smem} bytes of shared memory (G={G}, Dh={Dh})")
        return H, Hk, Dh, BS, caps[0], smem

    def attention_prefill(self, q, k_cache, v_cache, block_table, start_pos, scale):
        H, Hk, Dh, BS, cap, smem = self._attention_args("attention_prefill", q, k_cache, v_cache)
        T = q.shape[0]
        _check("attention_prefill", "block_table", block_table, _I32, (None,))
        _require(
            "attention_prefill",
            start_pos >= 0 and block_table.shape[0] * BS >= start_pos + T,
            f"block table of {block_table.shape[0]} blocks of {BS} cannot hold positions "
            f"[0, {start_pos + T}) (start_pos={start_pos})",
        )
        split = T and self._decode_partitions(T * Hk, start_pos + T)[0] > 1
        flash = None if split else flash_gqa(q, k_cache, v_cache, block_table, start_pos, scale, self.smem_limit)
        if flash is not None:
            return flash
        if split:
            # few rows over a long context (a new turn after a cached prefix): row t is a
            # decode query over start_pos + t + 1 keys, and the split path fills the GPU
            MB = block_table.shape[0]
            tables = cupy.ascontiguousarray(cupy.broadcast_to(block_table, (T, MB)))  # [T, MB]
            lens = cupy.arange(start_pos + 1, start_pos + T + 1, dtype=_I32)  # [T]
            return self.attention_decode(q, k_cache, v_cache, tables, lens, scale)
        out = cupy.empty_like(q)
        if T:
            _launch(
                "paged_attention.cu",
                f"attention_prefill_g{cap}",
                (T, Hk),
                _ATTN_THREADS,
                (
                    q,
                    k_cache,
                    v_cache,
                    block_table,
                    np.int32(start_pos),
                    out,
                    np.int32(H),
                    np.int32(Hk),
                    np.int32(Dh),
                    np.int32(BS),
                    np.float32(scale),
                ),
                smem,
            )
        return out

    def attention_decode(self, q, k_cache, v_cache, block_tables, context_lens, scale):
        H, Hk, Dh, BS, cap, smem = self._attention_args("attention_decode", q, k_cache, v_cache)
        B = q.shape[0]
        _check("attention_decode", "block_tables", block_tables, _I32, (B, None))
        _check("attention_decode", "context_lens", context_lens, _I32, (B,))
        out = cupy.empty_like(q)
        if not B:
            return out
        MB = block_tables.shape[1]
        splits, split_keys = self._decode_partitions(B * Hk, MB * BS)
        if splits == 1:
            _launch(
                "paged_attention.cu",
                f"attention_decode_g{cap}",
                (B, Hk),
                _ATTN_THREADS,
                (
                    q,
                    k_cache,
                    v_cache,
                    block_tables,
                    context_lens,
                    out,
                    np.int32(H),
                    np.int32(Hk),
                    np.int32(Dh),
                    np.int32(BS),
                    np.int32(MB),
                    np.float32(scale),
                ),
                smem,
            )
            return out
        tensors, dims = (q, k_cache, v_cache, block_tables, context_lens), (H, Hk, Dh, BS, MB, cap, smem)
        self._attention_decode_split(tensors, dims, out, scale, splits, split_keys)
        return out

    @staticmethod
    def _attention_decode_split(tensors, dims, out, scale, splits: int, split_keys: int) -> None:
        """attention_decode with each context's keys in ``splits`` partitions of ``split_keys`` keys:
        the partitions' partial sums, then their combine into ``out`` (``tensors``: q, the caches,
        the block tables and the context lengths, checked; ``dims``: H, Hk, Dh, BS, MB, cap, smem)."""
        q, k_cache, v_cache, block_tables, context_lens = tensors
        (H, Hk, Dh, BS, MB, cap, smem), B = dims, q.shape[0]
        part_acc = cupy.empty((B, splits, H, Dh), dtype=_F32)  # [B, P, H, Dh]
        part_ml = cupy.empty((B, splits, H, 2), dtype=_F32)  # [B, P, H, (max, sum)]
        _launch(
            "paged_attention.cu",
            f"attention_decode_split_g{cap}",
            (B, Hk, splits),
            _ATTN_THREADS,
            (
                q,
                k_cache,
                v_cache,
                block_tables,
                context_lens,
                part_acc,
                part_ml,
                np.int32(H),
                np.int32(Hk),
                np.int32(Dh),
                np.int32(BS),
                np.int32(MB),
                np.int32(split_keys),
                np.float32(scale),
            ),
            smem,
        )
        _launch(
            "paged_attention.cu",
            "attention_split_combine",
            (B, H),
            _ATTN_THREADS,
            (part_acc, part_ml, out, np.int32(H), np.int32(Dh), np.int32(splits)),
        )

    def _decode_partitions(self, blocks: int, max_keys: int) -> tuple[int, int]:
        """(partitions per context, keys per partition) for a decode launch of ``blocks``
        (sequence, KV head) blocks over contexts of at most ``max_keys`` keys (the block
        tables' capacity: no device sync to learn the real lengths; partitions past a
        context return at once)."""
        if self.decode_split == "off" or (self.decode_split == "auto" and blocks >= 2 * self.sm_count):
            return 1, max_keys
        keys = self.split_keys
        if -(-max_keys // keys) > _ATTN_MAX_SPLITS:  # very long tables: bigger partitions
            keys = -(-max_keys // (_ATTN_MAX_SPLITS * _ATTN_CHUNK)) * _ATTN_CHUNK
        return max(1, -(-max_keys // keys)), keys

    # ---- MoE -------------------------------------------------------------------------
    def router(self, logits, top_k, renormalize):
        _check("router", "logits", logits, (_BF16, _F32), (None, None))
        T, E = logits.shape
        _require("router", 1 <= top_k <= min(E, 32), f"top_k must be in [1, min(E={E}, 32)], got {top_k}")
        smem = 4 * _ROUTER_WARPS * E
        _require("router", smem <= self.smem_limit, f"too many experts for one warp per token: {E}")
        weights = cupy.empty((T, top_k), dtype=_F32)  # [T, k]
        ids = cupy.empty((T, top_k), dtype=_I32)  # [T, k]
        if T:
            kernel = "router_topk_f32" if logits.dtype == _F32 else "router_topk_bf16"
            _launch(
                "router.cu",
                kernel,
                ((T + _ROUTER_WARPS - 1) // _ROUTER_WARPS,),
                32 * _ROUTER_WARPS,
                (logits, weights, ids, np.int32(T), np.int32(E), np.int32(top_k), np.int32(bool(renormalize))),
                smem,
            )
        return weights, ids

    def silu_and_mul(self, x):
        _check("silu_and_mul", "x", x, _BF16, (None, None))
        T, I2 = x.shape
        _require("silu_and_mul", I2 % 2 == 0, f"x's last dim must be even (gate | up), got {I2}")
        out = cupy.empty((T, I2 // 2), dtype=_BF16)  # [T, I]
        if out.size:
            _launch(
                "silu_and_mul.cu",
                "silu_and_mul",
                (min((out.size + 255) // 256, 65536),),
                256,
                (x, out, np.int64(out.size), np.int32(I2 // 2)),
            )
        return out

    def gate_up_silu(self, x, w):
        T = x.shape[0] if isinstance(x, cupy.ndarray) else 0
        if isinstance(w, Fp8Weight) or not 0 < T <= DENSE_FUSED_MAX_ROWS:
            return self.silu_and_mul(self.linear(x, w))  # [T, I]
        op = "gate_up_silu"
        I, D = self._gate_up_weight(op, "w", w)
        _check(op, "x", x, _BF16, (None, D), aligned=True)
        h = cupy.empty((T, I), dtype=_BF16)  # [T, I]
        upw = self._units_per_warp(I, 1)
        args = (x, w, h, np.int32(T), np.int32(D), np.int32(I), np.int32(upw))
        _launch("moe_grouped_gemm.cu", "dense_gate_up_silu", (-(-I // (_GG_WARPS * upw)),), 32 * _GG_WARPS, args)
        return h

    @staticmethod
    def _gate_up_weight(op: str, name: str, w, dtype=_BF16) -> tuple[int, int]:
        """(I, D) of a gate | up weight [2I, D] the CUDA-core kernels read (D a multiple of 8): bf16, or
        an Fp8Weight's bytes (dtype uint8)."""
        _check(op, name, w, dtype, (None, None), aligned=True)
        I2, D = w.shape
        _require(op, I2 % 2 == 0 and D % 8 == 0, f"{name} must be [2I, D] with D a multiple of 8, got {list(w.shape)}")
        return I2 // 2, D

    def add_rms_norm_gate_up_silu(self, x, residual, weight, eps, w_gate_up):
        op = "add_rms_norm_gate_up_silu"
        T = residual.shape[0] if isinstance(residual, cupy.ndarray) else 0
        D = residual.shape[-1] if T else 0
        smem = 4 * 32 + 2 * T * D  # dense_add_norm_gate_up_silu: scratch, the normed rows
        fits = isinstance(x, cupy.ndarray) and x.dtype == _BF16 and smem <= min(self.smem_limit, NORM_FUSED_MAX_SMEM)
        if not fits or not 0 < T <= DENSE_FUSED_MAX_ROWS:
            return super().add_rms_norm_gate_up_silu(x, residual, weight, eps, w_gate_up)  # the unfused launches
        _check(op, "residual", residual, _BF16, (None, None))
        _check(op, "x", x, _BF16, (T, D))
        _check(op, "weight", weight, _BF16, (D,))
        fp8 = isinstance(w_gate_up, Fp8Weight)
        I, Dw = self._gate_up_weight(op, "w_gate_up", *((w_gate_up.data, _U8) if fp8 else (w_gate_up,)))
        _require(op, Dw == D, f"w_gate_up has shape {list(w_gate_up.shape)}, expected [2I, {D}]")
        h, s = cupy.empty((T, I), dtype=_BF16), cupy.empty_like(residual)  # [T, I], [T, D]
        upw = self._units_per_warp(I, 1)
        norm_threads = _threads(D // 4, "add_rms_norm_bf16")  # add_rms_norm's block: its summation order
        dims = (np.int32(T), np.int32(D), np.int32(I), np.float32(eps), np.int32(norm_threads), np.int32(upw))
        blocks = (
            (np.int32(w_gate_up.block_n), np.int32(w_gate_up.block_k), np.int32(w_gate_up.part_rows)) if fp8 else ()
        )
        args = (x, residual, weight, s, *self._fp8_parts(w_gate_up)[:2], h, *dims, *blocks)
        name = "dense_add_norm_gate_up_silu" + ("_fp8" if fp8 else "")
        _launch("moe_grouped_gemm.cu", name, (-(-I // (_GG_WARPS * upw)),), 32 * _GG_WARPS, args, smem)
        return h, s

    def clip(self, x, limit):
        _check("clip", "x", x, _BF16)
        out = cupy.empty_like(x)
        if out.size:
            _launch(
                "elementwise.cu",
                "clip_bf16",
                (min((out.size + 255) // 256, 65536),),
                256,
                (x, out, np.int64(out.size), np.float32(limit)),
            )
        return out

    def sigmoid_gate_add(self, out, s, gate):
        _check("sigmoid_gate_add", "out", out, _F32, (None, None))
        T, D = out.shape
        _check("sigmoid_gate_add", "s", s, _BF16, (T, D))
        _check("sigmoid_gate_add", "gate", gate, _BF16, (T, 1))
        out = out.copy()  # the kernel adds in place; the contract returns a new array
        if out.size:
            _launch(
                "elementwise.cu",
                "sigmoid_gate_add",
                (min((out.size + 255) // 256, 65536),),
                256,
                (out, s, gate, np.int64(out.size), np.int32(D)),
            )
        return out

    def count_experts(self, ids, counts):
        _check("count_experts", "ids", ids, (_I32,), (None, None))
        _check("count_experts", "counts", counts, (_I32,), (None,))
        n = ids.shape[0] * ids.shape[1]
        if n:
            blocks = min(1024, -(-n // 256))
            _launch(
                "expert_count.cu",
                "count_experts",
                (blocks,),
                256,
                (ids, np.int32(n), np.int32(counts.shape[0]), counts),
            )

    def add(self, x, y):
        _check("add", "x", x, (_BF16, _F32), (None, None))
        _check("add", "y", y, (_BF16, _F32), x.shape)
        out = cupy.empty_like(x)  # [T, D] of x's dtype
        if out.size:
            name = {_F32: "f32", _BF16: "bf16"}
            _launch(
                "elementwise.cu",
                f"add_{name[x.dtype]}_{name[y.dtype]}",
                (min((out.size + 255) // 256, 65536),),
                256,
                (x, y, out, np.int64(out.size)),
            )
        return out

    def rank_sum(self, parts):
        _check("rank_sum", "parts", parts, _F32, (None, None, None))
        out = cupy.empty(parts.shape[1:], dtype=_F32)  # [T, D]
        if out.size:
            grid = (min((out.size + 255) // 256, 65536),)
            _launch(
                "elementwise.cu", "rank_sum_f32", grid, 256, (parts, out, np.int64(out.size), np.int32(parts.shape[0]))
            )
        return out

    def router_grouped(self, logits, bias, top_k, routing: GroupedRouting):
        T = logits.shape[0] if isinstance(logits, cupy.ndarray) else 0
        bias, scalars = self._grouped_args("router_grouped", logits, bias, top_k, routing, _ROUTER_WARPS)
        weights = cupy.empty((T, top_k), dtype=_F32)  # [T, k]
        ids = cupy.empty((T, top_k), dtype=_I32)  # [T, k]
        if T:
            kernel = "router_grouped_f32" if logits.dtype == _F32 else "router_grouped_bf16"
            args = (logits, bias, weights, ids, np.int32(T), *scalars)
            grid = ((T + _ROUTER_WARPS - 1) // _ROUTER_WARPS,)
            _launch("router.cu", kernel, grid, 32 * _ROUTER_WARPS, args, 4 * _ROUTER_WARPS * 2 * logits.shape[1])
        return weights, ids

    def _grouped_args(self, op, logits, bias, top_k, routing: GroupedRouting, warps: int) -> tuple:
        """router_grouped's checks; (the bias [E] float32, the kernel's scalars after T)."""
        _check(op, "logits", logits, (_BF16, _F32), (None, None))
        E = logits.shape[1]
        _require(op, 1 <= top_k <= min(E, 32), f"top_k must be in [1, min(E={E}, 32)], got {top_k}")
        G = routing.n_group
        _require(op, 1 <= G <= 32 and E % G == 0, f"n_group must divide E={E} and be in [1, 32], got {G}")
        if bias is None:
            bias = cupy.zeros(E, dtype=_F32)
        _check(op, "bias", bias, _F32, (E,))
        _require(op, 4 * warps * 2 * E <= self.smem_limit, f"too many experts for one warp per token: {E}")
        flags = (routing.scoring == "sigmoid", G, routing.topk_group, routing.group_score == "top2_sum")
        scalars = (E, top_k, *flags, bool(routing.renormalize))
        return bias, tuple(np.int32(v) for v in scalars) + (np.float32(routing.scaling),)

    def route(self, logits, top_k, routing, bias, counts, local):
        T = logits.shape[0] if isinstance(logits, cupy.ndarray) else 0
        if local is None or not 0 < T <= ROUTE_FUSED_MAX_TOKENS:  # separate launches; moe_experts permutes
            grouped = isinstance(routing, GroupedRouting)
            weights, ids = (
                self.router_grouped(logits, bias, top_k, routing) if grouped else self.router(logits, top_k, routing)
            )
            if counts is not None:
                self.count_experts(ids, counts)
            return weights, ids, None
        return self._route_permute(logits, top_k, routing, bias, counts, *local)

    def _route_permute(self, logits, top_k, routing, bias, counts, expert_start: int, El: int):
        """route's one launch (router.cu's route_permute_*): one block of W warps, one per token."""
        op = "route"
        T, E = logits.shape
        grouped = isinstance(routing, GroupedRouting)
        if grouped:
            bias, scalars = self._grouped_args(op, logits, bias, top_k, routing, 1)
        else:
            _check(op, "logits", logits, (_BF16, _F32), (None, None))
            _require(op, 1 <= top_k <= min(E, 32), f"top_k must be in [1, min(E={E}, 32)], got {top_k}")
            scalars = (np.int32(E), np.int32(top_k), np.int32(bool(routing)))
        if counts is not None:
            _check(op, "counts", counts, _I32, (None,))
        n, per_warp = T * top_k, (2 if grouped else 1) * E  # routing floats per warp
        warps = max(1, min(32, max(T, -(-n // 256))))
        while warps > 1 and 4 * max(warps * per_warp, (warps + 1) * El) > self.smem_limit:
            warps -= 1
        smem = 4 * max(warps * per_warp, (warps + 1) * El)
        _require(op, smem <= self.smem_limit, f"too many experts for one routing block: E={E}, {El} local")
        weights, ids = cupy.empty((T, top_k), dtype=_F32), cupy.empty((T, top_k), dtype=_I32)  # [T, k]
        perm = Permutation(cupy.empty(El + 1, dtype=_I32), cupy.empty(n, dtype=_I32), cupy.empty(n, dtype=_I32))
        tail = (ids if counts is None else counts, np.int32(0 if counts is None else counts.shape[0]))
        tail += (np.int32(expert_start), np.int32(El), perm.offsets, perm.sorted_slot, perm.slot_pos)
        kind = ("grouped" if grouped else "topk") + ("_f32" if logits.dtype == _F32 else "_bf16")
        head = (logits, bias) if grouped else (logits,)
        args = (*head, weights, ids, np.int32(T), *scalars, *tail)
        _launch("router.cu", f"route_permute_{kind}", (1,), 32 * warps, args, smem)
        return weights, ids, perm

    # ---- MLA: per-head projections and attention over the paged latent cache -------------
    def head_linear(self, x, w):
        _check("head_linear", "w", w, _BF16, (None, None, None))
        H, N, K = w.shape
        _check("head_linear", "x", x, _BF16, (None, H, K))
        out = cupy.empty((x.shape[0], H, N), dtype=_BF16)  # [T, H, N]
        if out.size and K:
            _gemm_per_head(x, w, out)
        elif out.size:
            out.fill(0)
        return out

    def mla_prologue(self, q, compressed, kv_a_norm, eps, positions, cos_sin, w_uk, latent_cache, slot_mapping):
        op = "mla_prologue"
        _check(op, "w_uk", w_uk, _BF16, (None, None, None))
        H, C, Dn = w_uk.shape
        _check(op, "cos_sin", cos_sin, (_BF16, _F32), (None, None))
        R = cos_sin.shape[1]
        _require(op, R % 2 == 0, f"the rope width must be even, got {R}")
        _check(op, "q", q, _BF16, (None, H, Dn + R))
        T = q.shape[0]
        ldc = _row_stride(op, "compressed", compressed, (T, C + R))
        _check(op, "kv_a_norm", kv_a_norm, _BF16, (C,))
        _check(op, "latent_cache", latent_cache, _BF16, (None, None, C + R))
        _check(op, "positions", positions, _I32, (T,))
        _check(op, "slot_mapping", slot_mapping, _I32, (T,))
        q_all = cupy.empty((T, H, C + R), dtype=_BF16)  # [T, H, C+R]
        if not T:
            return q_all
        threads, units = _threads(C // 4, "rms_norm"), H * C // 2  # rms_norm's block for the latent's norm
        fused = T <= MLA_FUSED_MAX_ROWS and C % 2 == 0 and Dn % 8 == 0 and R % 8 == 0 and q.data.ptr % 16 == 0
        upw = self._units_per_warp(units, 1) if fused else 1
        absorb = -(-units // (threads // 32 * upw)) if fused else 0  # blocks of the w_uk product on CUDA cores
        if not fused:
            _gemm_per_head(q[:, :, :Dn], w_uk, q_all[:, :, :C])  # the absorbed query, in place (cuBLAS)
        kernel = "mla_prologue_f32" if cos_sin.dtype == _F32 else "mla_prologue_bf16"
        args = (compressed, np.int32(ldc), kv_a_norm, q, positions, cos_sin, q_all, latent_cache, slot_mapping, w_uk)
        dims = (np.int32(C), np.int32(R), np.int32(H), np.int32(Dn), np.float32(eps))
        dims += (np.int32(T), np.int32(absorb), np.int32(upw))
        _launch("mla_attention.cu", kernel, (absorb + T,), threads, args + dims)
        return q_all

    def latent_write(self, latent_cache, x, slot_mapping):
        _check("latent_write", "latent_cache", latent_cache, _BF16, (None, None, None), aligned=True)
        L = latent_cache.shape[2]
        _require("latent_write", L % 8 == 0, f"latent width must be a multiple of 8, got {L}")
        _check("latent_write", "x", x, _BF16, (None, L), aligned=True)
        T = x.shape[0]
        _check("latent_write", "slot_mapping", slot_mapping, _I32, (T,))
        if T:
            _launch(
                "mla_attention.cu",
                "mla_latent_write",
                (T,),
                _threads(L // 8, "mla_latent_write"),
                (latent_cache, x, slot_mapping, np.int32(L)),
            )

    def _mla_args(self, op, q, latent_cache, value_dim):
        """Shared checks; returns (H, L, C, BS, heads per block, shared-memory bytes)."""
        _check(op, "latent_cache", latent_cache, _BF16, (None, None, None), aligned=True)
        BS, L = latent_cache.shape[1:]
        _require(op, L % 8 == 0, f"latent width must be a multiple of 8, got {L}")
        _check(op, "q", q, _BF16, (None, None, L))
        H, C = q.shape[1], value_dim
        _require(op, 1 <= C <= L, f"value_dim must be in [1, latent width {L}], got {C}")
        heads = min(H, _MLA_MAX_HEADS)
        while heads > 1 and _mla_smem(L, C, heads) > self.smem_limit:
            heads //= 2
        smem = _mla_smem(L, C, max(heads, 1))
        _require(op, smem <= self.smem_limit, f"needs {smem} bytes of shared memory (L={L}, C={C})")
        return H, L, C, BS, max(heads, 1), smem

    def _mla_attend(self, op, q, latent_cache, tables, table_stride, lens, max_keys, scale, value_dim, w_uv=None):
        """Rows of q attend to keys [0, lens[b]) of their table; one pass or split (flash-decoding).
        ``w_uv`` [H, Dv, C] (checked by the caller): the output up-projected in the same launches."""
        H, L, C, BS, heads, smem = self._mla_args(op, q, latent_cache, value_dim)
        B = q.shape[0]
        out = cupy.empty((B, H, C if w_uv is None else w_uv.shape[1]), dtype=_BF16)  # [B, H, C or Dv]
        if not B or not H:
            return out
        splits, split_keys = self._decode_partitions(B * -(-H // heads), max_keys)
        if w_uv is not None and splits == 1:  # w_uv up-projected inside the pass
            heads = self._uv_heads(B, H, heads)
            smem = _mla_smem(L, C, heads)
        head_blocks = -(-H // heads)
        common = (np.int32(H), np.int32(L), np.int32(C), np.int32(BS), np.int32(table_stride), np.int32(heads))
        if splits == 1:
            if w_uv is None:
                args = (q, latent_cache, tables, lens, out, *common, np.float32(scale))
                _launch("mla_attention.cu", "mla_attention", (B, head_blocks), _MLA_THREADS, args, smem)
            else:
                args = (q, latent_cache, tables, lens, w_uv, out, *common, np.float32(scale), np.int32(out.shape[2]))
                _launch("mla_attention.cu", "mla_attention_uv", (B, head_blocks), _MLA_THREADS, args, smem)
            return out
        part_acc = cupy.empty((B, splits, H, C), dtype=_F32)  # [B, P, H, C]
        part_ml = cupy.empty((B, splits, H, 2), dtype=_F32)  # [B, P, H, (max, sum)]
        args = (q, latent_cache, tables, lens, part_acc, part_ml, *common, np.int32(split_keys), np.float32(scale))
        _launch("mla_attention.cu", "mla_attention_split", (B, head_blocks, splits), _MLA_THREADS, args, smem)
        parts = (part_acc, part_ml) if w_uv is None else (part_acc, part_ml, w_uv)
        name = "attention_split_combine" if w_uv is None else "mla_split_combine_uv"
        dims = (np.int32(H), np.int32(C), np.int32(splits)) + (() if w_uv is None else (np.int32(out.shape[2]),))
        file = "paged_attention.cu" if w_uv is None else "mla_attention.cu"
        _launch(file, name, (B, H), _ATTN_THREADS, (*parts, out, *dims))
        return out

    def mla_attention_prefill(self, q, latent_cache, block_table, start_pos, scale, value_dim):
        op = "mla_attention_prefill"
        _check(op, "q", q, _BF16, (None, None, None))
        _check(op, "block_table", block_table, _I32, (None,))
        _check(op, "latent_cache", latent_cache, _BF16, (None, None, None))
        T, BS, MB = q.shape[0], latent_cache.shape[1], block_table.shape[0]
        _require(
            op,
            start_pos >= 0 and MB * BS >= start_pos + T,
            f"block table of {MB} blocks of {BS} cannot hold positions [0, {start_pos + T}) (start_pos={start_pos})",
        )
        H, _, C = self._mla_args(op, q, latent_cache, value_dim)[:3]
        split = T and self._decode_partitions(T * -(-H // _MLA_MAX_HEADS), start_pos + T)[0] > 1
        flash = None if split else flash_mla(q, latent_cache, block_table, start_pos, scale, C, self.smem_limit)
        if flash is not None:
            return flash
        # row t is a query over keys [0, start_pos + t]: every row shares the table (stride 0)
        lens = cupy.arange(start_pos + 1, start_pos + T + 1, dtype=_I32)  # [T]
        return self._mla_attend(op, q, latent_cache, block_table, 0, lens, MB * BS, scale, value_dim)

    def mla_attention_decode(self, q, latent_cache, block_tables, context_lens, scale, value_dim, w_uv=None):
        op = "mla_attention_decode"
        _check(op, "q", q, _BF16, (None, None, None))
        B = q.shape[0]
        _check(op, "block_tables", block_tables, _I32, (B, None))
        _check(op, "context_lens", context_lens, _I32, (B,))
        _check(op, "latent_cache", latent_cache, _BF16, (None, None, None))
        MB, BS = block_tables.shape[1], latent_cache.shape[1]
        fold = w_uv is not None and self._folds_uv(op, q, w_uv, value_dim)
        o = self._mla_attend(
            op, q, latent_cache, block_tables, MB, context_lens, MB * BS, scale, value_dim, w_uv if fold else None
        )
        return self.head_linear(o, w_uv) if w_uv is not None and not fold else o

    def _uv_heads(self, B: int, H: int, heads: int) -> int:
        """Heads per block of a one-pass decode with w_uv folded in: a small batch spread over about one
        block per SM, so w_uv is read by many SMs (a head's arithmetic does not depend on its block-mates;
        each block reads the row's cache, short in a one-pass decode). A split decode keeps its heads (its
        partitions read the cache once per head group; its combine has a block per head already)."""
        while heads > 1 and B * -(-H // heads) < self.sm_count:
            heads //= 2
        return heads

    @staticmethod
    def _folds_uv(op, q, w_uv, C) -> bool:
        """Whether decode's up-projection by w_uv [H, Dv, C] runs inside the attention launches (decode's
        few rows, Dv even, C a multiple of 8 up to MLA_MAX_UV_C) or after them (head_linear: cuBLAS)."""
        _check(op, "w_uv", w_uv, _BF16, (q.shape[1], None, C), aligned=True)
        return 0 < q.shape[0] <= MLA_FUSED_MAX_ROWS and w_uv.shape[1] % 2 == 0 and C % 8 == 0 and C <= _MLA_MAX_UV_C

    def lora_apply(self, y, x, a, b, rows):
        op = "lora_apply"
        T, K = x.shape
        _check(op, "x", x, _BF16, (T, K))
        _check(op, "y", y, _BF16, (T, None))
        N = y.shape[1]
        _check(op, "rows.index", rows.index, _I32, (T,))
        S, R = a.shape[0], a.shape[1]
        _require(op, a.dtype == _F32 and b.dtype == _F32, "a and b must be float32 stacks")
        _require(op, a.shape == (S, R, K) and b.shape == (S, R, N), f"a {a.shape} / b {b.shape} do not fit x / y")
        _require(op, a.strides[1:] == (4 * K, 4) and b.strides[1:] == (4 * N, 4), "a / b rows must be contiguous")
        if T == 0 or R == 0 or N == 0:
            return y
        xa = cupy.empty((T, R), dtype=_F32)  # [T, R]
        args = (x, a, rows.index, xa, np.int32(K), np.int32(R), np.int64(a.strides[0] // 4))
        _launch("lora.cu", "lora_shrink", (T,), _threads(32 * R, "lora_shrink"), args)
        args = (xa, b, rows.index, y, np.int64(T * N), np.int32(N), np.int32(R), np.int64(b.strides[0] // 4))
        _launch("lora.cu", "lora_expand", (min(-(-T * N // 256), 65536),), 256, args)
        return y

    def moe_experts_lora(self, x, weights, ids, w_gate_up, w_down, expert_start, rows, gate_up, down):
        """The tokens without an adapter through ``moe_experts`` (their pairs alone keep a weight);
        each (token, choice) pair of a token with an adapter through its expert with bf16 GEMMs and
        ``lora_apply`` deltas, expert by expert, added in with its routing weight."""
        op = "moe_experts_lora"
        _require(op, not isinstance(w_gate_up, Fp8Weight), "LoRA on FP8 experts is not supported")
        El = w_gate_up.shape[0]
        adapted = np.flatnonzero(rows.slots >= 0)  # [A] tokens with an adapter
        base_weights = weights.copy()
        base_weights[self.index(adapted)] = 0.0  # their pairs come from the loop below
        out = self.moe_experts(x, base_weights, ids, w_gate_up, w_down, expert_start)  # [T, D] f32
        local = self._host(ids)[adapted] - expert_start  # [A, k]
        host_weights = self._host(weights)[adapted]  # [A, k]
        for e in np.unique(local[(local >= 0) & (local < El)]).tolist():
            which, choice = np.nonzero(local == e)  # pairs routed to expert e (a token at most once)
            tokens = adapted[which]
            pair_rows = LoraRows.group(rows.slots[tokens], upload=self.index)  # every pair has a slot
            xs = x[self.index(tokens)]  # [m, D]
            h = self.linear(xs, w_gate_up[e])  # [m, 2I]
            if gate_up is not None:
                self.lora_apply(h, xs, gate_up[0][:, e], gate_up[1][:, e], pair_rows)
            act = self.silu_and_mul(h)  # [m, I]
            y = self.linear(act, w_down[e])  # [m, D]
            if down is not None:
                self.lora_apply(y, act, down[0][:, e], down[1][:, e], pair_rows)
            y32 = (y.astype(cupy.uint32) << 16).view(cupy.float32)  # [m, D] bf16 -> f32
            w = cupy.asarray(np.ascontiguousarray(host_weights[which, choice], dtype=np.float32)).reshape(-1, 1)
            idx = self.index(tokens)
            out[idx] = out[idx] + y32 * w
        return out

    def moe_experts(self, x, weights, ids, w_gate_up, w_down, expert_start, perm=None):
        return self._moe(x, weights, ids, w_gate_up, w_down, expert_start, perm)[0]

    def moe_experts_shared(self, x, weights, ids, w_gate_up, w_down, expert_start, perm, shared_gate_up, shared_down):
        if not self._shared_fusable(x, ids, w_gate_up, w_down, shared_gate_up, shared_down):  # the unfused launches
            return super().moe_experts_shared(
                x, weights, ids, w_gate_up, w_down, expert_start, perm, shared_gate_up, shared_down
            )
        op = "moe_experts_shared"
        fp8 = isinstance(shared_gate_up, Fp8Weight)
        gu, dn, dtype = (shared_gate_up.data, shared_down.data, _U8) if fp8 else (shared_gate_up, shared_down, _BF16)
        D = w_gate_up.shape[2]
        _check(op, "shared_gate_up", gu, dtype, (None, D), aligned=True)
        Is = gu.shape[0] // 2
        _require(
            op,
            gu.shape[0] % 2 == 0 and Is % 8 == 0,
            f"shared_gate_up must be [2Is, {D}], Is a multiple of 8, got {list(gu.shape)}",
        )
        _check(op, "shared_down", dn, dtype, (D, Is), aligned=True)
        return self._moe(x, weights, ids, w_gate_up, w_down, expert_start, perm, (shared_gate_up, shared_down))

    def _shared_fusable(self, x, ids, w_gate_up, w_down, shared_gate_up, shared_down) -> bool:
        """Whether moe_experts_shared runs the shared expert in the grouped kernels' launches: up to
        DENSE_FUSED_MAX_ROWS rows on the CUDA-core path, all weights bf16 or all FP8 with the routed
        weights' blocks (gate_up's for its gate_up, down's for its down)."""
        T = x.shape[0] if isinstance(x, cupy.ndarray) else 0
        k = ids.shape[1] if isinstance(ids, cupy.ndarray) and ids.ndim == 2 else 0
        weights = (w_gate_up, w_down, shared_gate_up, shared_down)
        if all(isinstance(w, Fp8Weight) for w in weights):
            blocks = [(w.block_n, w.block_k) for w in weights]
            same = blocks[0] == blocks[2] and blocks[1] == blocks[3]
        else:
            same = all(isinstance(w, cupy.ndarray) for w in weights)
        shaped = same and len(w_gate_up.shape) == 3 and w_gate_up.shape[0] > 0
        return shaped and 0 < T <= DENSE_FUSED_MAX_ROWS and k > 0 and self._moe_choice(T * k, w_gate_up) == "grouped"

    def _moe(self, x, weights, ids, w_gate_up, w_down, expert_start, perm, shared=None):
        """moe_experts, and with ``shared`` = (shared_gate_up, shared_down) an ungated shared expert in
        the grouped kernels' launches (moe_experts_shared checked it): (out [T, D] float32, the shared
        expert's output [T, D] bf16 or None)."""
        op = "moe_experts"
        fp8 = isinstance(w_gate_up, Fp8Weight)
        _require(op, fp8 == isinstance(w_down, Fp8Weight), "w_gate_up and w_down must both be FP8 or both bf16")
        gu, dn = (w_gate_up.data, w_down.data) if fp8 else (w_gate_up, w_down)
        _check(op, "w_gate_up", gu, _U8 if fp8 else _BF16, (None, None, None), aligned=True)
        El, I2, D = gu.shape
        I = I2 // 2
        _require(op, I2 % 2 == 0 and D % 8 == 0 and I % 8 == 0, f"D and I must be multiples of 8, got D={D}, 2I={I2}")
        _check(op, "w_down", dn, _U8 if fp8 else _BF16, (El, D, I), aligned=True)
        if fp8:
            _require(op, w_gate_up.part_rows == I, f"FP8 w_gate_up must block gate and up apart (part_rows {I})")
            _require(op, w_down.part_rows == D, f"FP8 w_down must have part_rows {D}, got {w_down.part_rows}")
        _check(op, "x", x, _BF16, (None, D), aligned=True)
        T = x.shape[0]
        _check(op, "ids", ids, _I32, (T, None))
        k = ids.shape[1]
        _check(op, "weights", weights, _F32, (T, k))
        _require(op, 2 * 4 * El <= self.smem_limit, f"too many local experts for one permutation block: {El}")
        out = cupy.empty((T, D), dtype=_F32)  # [T, D]
        if T == 0 or k == 0 or El == 0:  # El == 0 would launch a grid with gridDim.y = 0
            out.fill(0)
            return out, None
        n = T * k
        if perm is None:
            perm = self._permute(ids, expert_start, El)
        else:
            _check(op, "perm.offsets", perm.offsets, _I32, (El + 1,))
            _check(op, "perm.slot_pos", perm.slot_pos, _I32, (n,))
        parts = (x, k, perm.offsets, perm.sorted_slot, w_gate_up, w_down)
        choice = self._moe_choice(n, w_gate_up)
        if choice == "grouped":
            y, s = self._experts_grouped(*parts, shared)  # [P, D] fp32, [T, D] bf16 or None
        else:
            y, s = {"tc": self._experts_tc, "gathered": self._experts_gathered}[choice](*parts), None
        args = (y, weights, perm.slot_pos, out, np.int32(D), np.int32(k))
        _launch("moe_combine.cu", "moe_combine", (T,), _threads(D, "moe_combine"), args)
        return out, s

    def _permute(self, ids, expert_start: int, El: int) -> Permutation:
        """moe_permute: one block of W warps, each placing a contiguous range of slots (one warp per
        256 slots); W is capped by the shared memory of its per-warp counts ((W + 1) * El ints)."""
        n = ids.size
        perm_warps = max(1, min(32, -(-n // 256), self.smem_limit // (4 * El) - 1))
        perm = Permutation(cupy.empty(El + 1, dtype=_I32), cupy.empty(n, dtype=_I32), cupy.empty(n, dtype=_I32))
        args = (ids, np.int32(n), np.int32(expert_start), np.int32(El), perm.offsets, perm.sorted_slot, perm.slot_pos)
        _launch("moe_permute.cu", "moe_permute", (1,), 32 * perm_warps, args, 4 * (perm_warps + 1) * El)
        return perm

    def _moe_choice(self, slots: int, w_gate_up) -> str:
        """The expert-GEMM implementation of a call with ``slots`` (token, choice) pairs: "auto" takes
        the tensor-core GEMM from TC_MIN_SLOTS_PER_EXPERT slots per local expert (a prefill, a large
        decode batch), else the CUDA-core kernel (decode's weight-bandwidth-bound products). FP8
        weights take the tensor cores only with block_k a multiple of 32 and D, I multiples of 16."""
        El, I2, D = w_gate_up.shape
        tc_ok = not isinstance(w_gate_up, Fp8Weight) or (w_gate_up.block_k % 32 == 0 and D % 16 == 0 and I2 % 32 == 0)
        if self.moe_impl == "auto":
            return "tc" if tc_ok and slots >= TC_MIN_SLOTS_PER_EXPERT * El else "grouped"
        return "grouped" if self.moe_impl == "tc" and not tc_ok else self.moe_impl

    def _experts_tc(self, x, k, offsets, sorted_slot, w_gate_up, w_down):
        """Both expert GEMMs on tensor cores (moe_tc.cu), one launch each over every local expert."""
        El, I2, D = w_gate_up.shape
        I, n = I2 // 2, x.shape[0] * k
        h = cupy.empty((n, I), dtype=_BF16)  # [P, I] (P <= T*k rows used)
        y = cupy.empty((n, D), dtype=_F32)  # [P, D]
        slots = (n + El * (MOE_TC_BM - 1)) // MOE_TC_BM  # at least the (expert, 64-row tile) pairs
        fp8 = isinstance(w_gate_up, Fp8Weight)
        if fp8 and self._w8a8(w_gate_up, w_down):
            return self._experts_w8a8(x, k, offsets, sorted_slot, w_gate_up, w_down, h, y, slots)
        suffix, smem = ("_fp8", MOE_TC_SMEM_FP8) if fp8 else ("", MOE_TC_SMEM)
        gate_up = (w_gate_up.data, w_gate_up.scale) if fp8 else (w_gate_up,)
        down = (w_down.data, w_down.scale) if fp8 else (w_down,)
        blocks = lambda w: (np.int32(w.block_n), np.int32(w.block_k)) if fp8 else ()  # noqa: E731
        dims = (np.int32(D), np.int32(I))
        args = (x, sorted_slot, offsets, *gate_up, h, *dims, np.int32(k), np.int32(El), *blocks(w_gate_up))
        _launch("moe_tc.cu", "moe_tc_gate_up" + suffix, (slots, -(-I // MOE_TC_UNITS)), 128, args, smem)
        args = (h, offsets, *down, y, *dims, np.int32(El), *blocks(w_down))
        _launch("moe_tc.cu", "moe_tc_down" + suffix, (slots, -(-D // MOE_TC_BN)), 128, args, smem)
        return y

    def _w8a8(self, w_gate_up: Fp8Weight, w_down: Fp8Weight) -> bool:
        """Whether FP8 experts run on the FP8 tensor cores: asked for, sm_89+, and an n8 tile within
        one weight scale row (block_n a multiple of 8) with the same K blocks for both projections."""
        return (
            self.fp8_mma
            and w_gate_up.block_n % 8 == 0
            and w_down.block_n % 8 == 0
            and w_gate_up.block_k == w_down.block_k
        )

    def _quantize_rows(self, a, group: int):
        """a [R, K] bf16 -> (e4m3 bytes [R, K], scales [R, ceil(K / group)] fp32): per row and group of
        columns, q = e4m3(a / s) with s = max |a| / 448."""
        R, K = a.shape
        q = cupy.empty((R, K), dtype=_U8)
        scale = cupy.empty((R, -(-K // group)), dtype=_F32)
        if R:
            items = R * scale.shape[1]
            args = (a, q, scale, np.int32(R), np.int32(K), np.int32(group))
            _launch("moe_tc.cu", "fp8_quantize_rows", (-(-items // 4),), 128, args)
        return q, scale

    def _experts_w8a8(self, x, k, offsets, sorted_slot, w_gate_up, w_down, h, y, slots):
        """Both expert GEMMs as e4m3 x e4m3 on the FP8 tensor cores, each projection's input quantized first."""
        El, I2, D = w_gate_up.shape
        I, group = I2 // 2, w_gate_up.block_k
        dims = (np.int32(D), np.int32(I))
        xq, xs = self._quantize_rows(x, group)
        blocks = (np.int32(w_gate_up.block_n), np.int32(group))
        args = (
            xq,
            xs,
            sorted_slot,
            offsets,
            w_gate_up.data,
            w_gate_up.scale,
            h,
            *dims,
            np.int32(k),
            np.int32(El),
            *blocks,
        )
        _launch("moe_tc.cu", "moe_tc_gate_up_w8a8", (slots, -(-I // MOE_TC_UNITS)), 128, args, MOE_TC_SMEM_W8A8)
        hq, hs = self._quantize_rows(h, group)
        blocks = (np.int32(w_down.block_n), np.int32(group))
        args = (hq, hs, offsets, w_down.data, w_down.scale, y, *dims, np.int32(El), *blocks)
        _launch("moe_tc.cu", "moe_tc_down_w8a8", (slots, -(-D // MOE_TC_BN)), 128, args, MOE_TC_SMEM_W8A8)
        return y

    def _units_per_warp(self, units: int, active_experts: int) -> int:
        """Spread the chosen experts' work over about 32 warps per SM."""
        want = self.sm_count * 32
        return max(1, min(16, -(-units * active_experts // want)))

    def _experts_grouped(self, x, k, offsets, sorted_slot, w_gate_up, w_down, shared=None):
        """Both expert GEMMs on CUDA cores (moe_grouped_gemm.cu), one launch each over every local
        expert; with ``shared`` (the weights' format) the shared expert's blocks join each launch
        (grid rows El ..). Returns (y [P, D] fp32, the shared expert's output [T, D] bf16 or None)."""
        El, I2, D = w_gate_up.shape
        I, n, T = I2 // 2, x.shape[0] * k, x.shape[0]
        active = min(El, n)
        h = cupy.empty((n, I), dtype=_BF16)  # [P, I] (P <= T*k rows used)
        y = cupy.empty((n, D), dtype=_F32)  # [P, D]
        fp8 = isinstance(w_gate_up, Fp8Weight)
        suffix = "_fp8" if fp8 else ""
        gate_up = (w_gate_up.data, w_gate_up.scale) if fp8 else (w_gate_up,)
        down = (w_down.data, w_down.scale) if fp8 else (w_down,)
        blocks = (np.int32(w_gate_up.block_n), np.int32(w_gate_up.block_k)) if fp8 else ()
        sg, sd, hs, ys, Is, Ts = w_gate_up, w_down, h, h, 0, 0  # no shared expert: (not read)
        if shared is not None:
            (sg, sd), Is, Ts = shared, shared[0].shape[0] // 2, T
            hs, ys = cupy.empty((T, Is), dtype=_BF16), cupy.empty((T, D), dtype=_BF16)  # its h and output
        grid, upw = self._grouped_grid(I, active, Is, El)
        tail = (np.int32(El), *self._fp8_parts(sg), hs, np.int32(Ts), np.int32(Is))
        args = (x, sorted_slot, offsets, *gate_up, h, np.int32(D), np.int32(I), np.int32(k), np.int32(upw))
        _launch("moe_grouped_gemm.cu", "moe_gate_up_silu" + suffix, grid, 32 * _GG_WARPS, (*args, *blocks, *tail))
        units = (D + 1) // 2
        grid, upw = self._grouped_grid(units, active, units if shared is not None else 0, El)
        blocks = (np.int32(w_down.block_n), np.int32(w_down.block_k)) if fp8 else ()
        tail = (np.int32(El), hs, *self._fp8_parts(sd), ys, np.int32(Ts), np.int32(Is))
        args = (h, offsets, *down, y, np.int32(D), np.int32(I), np.int32(upw))
        _launch("moe_grouped_gemm.cu", "moe_down" + suffix, grid, 32 * _GG_WARPS, (*args, *blocks, *tail))
        return y, (ys if shared is not None else None)

    @staticmethod
    def _fp8_parts(w) -> tuple:
        """A shared expert's weight as the grouped kernels take it: bf16 rows, or FP8 bytes, their
        scales and the rows of a part."""
        return (w.data, w.scale, np.int32(w.part_rows)) if isinstance(w, Fp8Weight) else (w,)

    def _grouped_grid(self, units: int, active: int, shared_units: int, El: int) -> tuple[tuple, int]:
        """The grouped kernels' grid and units per warp: ``units`` per routed expert (grid x), a row
        per local expert, then the rows the shared expert's ``shared_units`` need (0: none)."""
        upw = self._units_per_warp(units * active + shared_units, 1)
        gx = -(-units // (_GG_WARPS * upw))
        return (gx, El + -(-shared_units // (gx * _GG_WARPS * upw))), upw

    def _experts_gathered(self, x, k, offsets, sorted_slot, w_gate_up, w_down):
        El, I2, D = w_gate_up.shape
        I = I2 // 2
        offs = self._host(offsets)  # host sync: GEMM sizes
        P = int(offs[-1])
        y = cupy.empty((P, D), dtype=_F32)  # [P, D]
        if P == 0:
            return y
        xs = cupy.empty((P, D), dtype=_BF16)  # [P, D] rows by expert
        gate_up = cupy.empty((P, I2), dtype=_BF16)  # [P, 2I]
        _launch(
            "moe_permute.cu",
            "moe_gather_rows",
            (P,),
            _threads(D // 8, "moe_gather_rows"),
            (x, sorted_slot, xs, np.int32(D), np.int32(k)),
        )
        busy = [(e, int(offs[e]), int(offs[e + 1] - offs[e])) for e in range(El) if offs[e + 1] > offs[e]]
        fp8 = isinstance(w_gate_up, Fp8Weight)
        if fp8:  # each busy expert's weights dequantized into one bf16 scratch, then cuBLAS
            scratch_gu, scratch_d = cupy.empty((I2, D), dtype=_BF16), cupy.empty((D, I), dtype=_BF16)
        for e, o, c in busy:
            w = self._dequantize(w_gate_up, e * I2, I2, scratch_gu) if fp8 else w_gate_up[e]
            _gemm(c, I2, D, xs[o].data.ptr, w.data.ptr, gate_up[o].data.ptr, _BF16)
        h = self.silu_and_mul(gate_up)  # [P, I]
        for e, o, c in busy:
            w = self._dequantize(w_down, e * D, D, scratch_d) if fp8 else w_down[e]
            _gemm(c, D, I, h[o].data.ptr, w.data.ptr, y[o].data.ptr, _F32)
        return y

    def argmax(self, logits) -> np.ndarray:
        return self._host(self._argmax(logits)).astype(np.int64)

    def _argmax(self, logits):
        """The argmax of each row of logits [B, V] on the device: [B] int32."""
        _check("argmax", "logits", logits, (_BF16, _F32), (None, None))
        B, V = logits.shape
        _require("argmax", V > 0, "logits have an empty vocabulary")
        out = cupy.empty(B, dtype=_I32)
        if B:
            kernel = "argmax_f32" if logits.dtype == _F32 else "argmax_bf16"
            _launch("argmax.cu", kernel, (B,), 1024, (logits, out, np.int32(V)))
        return out

    def greedy_device(self, logits):
        """The greedy tokens of logits [B, V] and their logits, packed on the device for one read by
        ``argmax_values``: [B * 4 + B * itemsize] bytes (int32 tokens, then the values in the logits' dtype)."""
        B, V = logits.shape
        tokens = self._argmax(logits)  # [B]
        values = logits.reshape(-1)[cupy.arange(B, dtype=_I32) * np.int32(V) + tokens]  # [B]
        return cupy.concatenate([tokens.view(_U8), values.view(_U8)])

    def expect_greedy(self, logits, packed, rows: int) -> None:
        """``packed`` (``greedy_device`` of ``rows`` rows, computed in a CUDA graph) holds the greedy
        tokens of ``logits`` (its first rows): the next ``argmax_values`` of exactly these logits reads
        it instead of launching again."""
        self._greedy = (logits.data.ptr, logits.shape, packed, rows)

    def argmax_values(self, logits):
        memo, self._greedy = getattr(self, "_greedy", None), None
        if memo is None or memo[:2] != (logits.data.ptr, logits.shape):
            memo = (None, None, self.greedy_device(logits), logits.shape[0])
        B, R, packed = logits.shape[0], memo[3], self._host(memo[2])  # one read
        values = packed[4 * R :].view(logits.dtype)[:B]
        tokens = packed[: 4 * R].view(np.int32)[:B].astype(np.int64)
        return tokens, bf16_bits_to_f32(values) if values.dtype == _BF16 else values.astype(np.float32)

    # ---- logits processing (kernels/sampling.cu) ---------------------------------------------
    def gather_logits(self, logits, rows: np.ndarray):
        _check("gather_logits", "logits", logits, (_BF16, _F32), (None, None))
        B, V = logits.shape
        rows = np.asarray(rows, dtype=np.int32)
        _require("gather_logits", bool(((rows >= 0) & (rows < B)).all()), f"rows must be in [0, {B})")
        out = cupy.empty((rows.shape[0], V), dtype=_F32)  # [m, V]
        if rows.size and V:
            kernel = "gather_rows_f32" if logits.dtype == _F32 else "gather_rows_bf16"
            _launch("sampling.cu", kernel, (rows.shape[0],), 1024, (logits, self.index(rows), out, np.int32(V)))
        return out

    def mask_logits(self, x, rows: np.ndarray, bits: np.ndarray) -> None:
        _check("mask_logits", "x", x, _F32, (None, None))
        m, V = x.shape
        W = -(-V // 32)
        bits = np.ascontiguousarray(bits, dtype=np.uint32)
        rows = np.asarray(rows, dtype=np.int32)
        _require("mask_logits", bits.shape == (rows.shape[0], W), f"bits must be [{rows.shape[0]}, {W}]")
        _require("mask_logits", bool(((rows >= 0) & (rows < m)).all()), f"rows must be in [0, {m})")
        if rows.size and V:
            args = (x, self.index(rows), cupy.asarray(bits), np.int32(V), np.int32(W))
            _launch("sampling.cu", "mask_tokens", (rows.shape[0],), 1024, args)

    def edit_logits(self, x, rows, tokens, banned, bias, scale, subtract) -> None:
        _check("edit_logits", "x", x, _F32, (None, None))
        m, V = x.shape
        rows, tokens = np.asarray(rows, dtype=np.int32), np.asarray(tokens, dtype=np.int32)
        P = rows.shape[0]
        _require("edit_logits", bool(((rows >= 0) & (rows < m)).all()), f"rows must be in [0, {m})")
        _require("edit_logits", bool(((tokens >= 0) & (tokens < V)).all()), f"tokens must be in [0, {V})")
        if not P:
            return
        floats = [cupy.asarray(np.ascontiguousarray(a, dtype=np.float32)) for a in (bias, scale, subtract)]
        flags = cupy.asarray(np.ascontiguousarray(banned, dtype=np.uint8))
        args = (x, self.index(rows), self.index(tokens), flags, *floats, np.int32(P), np.int32(V))
        _launch("sampling.cu", "edit_tokens", (-(-P // 256),), 256, args)

    def sample_logits(self, x, inv_temp, min_p, uniforms) -> np.ndarray:
        _check("sample_logits", "x", x, _F32, (None, None))
        m, V = x.shape
        _require("sample_logits", V > 0, "logits have an empty vocabulary")
        out = cupy.empty(m, dtype=_I32)
        if m:
            floats = [cupy.asarray(np.ascontiguousarray(a, dtype=np.float32).reshape(m)) for a in (inv_temp, min_p)]
            u = cupy.asarray(np.ascontiguousarray(uniforms, dtype=np.float64).reshape(m))
            _launch("sampling.cu", "sample_tokens", (m,), _SAMPLE_THREADS, (x, *floats, u, out, np.int32(V)))
        return self._host(out).astype(np.int64)

    # ---- hybrid linear-attention models (kernels/gated_delta.cu) ---------------------------
    def _conv(self, op, x, weight, conv_state, slots, B: int, T: int):
        C = x.shape[-1]
        _check(op, "weight", weight, _BF16, (C, None))
        K = weight.shape[1]
        _require(op, K in _CONV_WIDTHS, f"conv width {K} is not one of the kernel's {_CONV_WIDTHS}")
        _check(op, "conv_state", conv_state, _F32, (None, K - 1, C))
        _check(op, "slots", slots, _I32, (B,))
        out = cupy.empty_like(x)  # [B*T, C]
        if x.size:
            args = (x, weight, conv_state, slots, out, np.int32(T), np.int32(C))
            _launch("gated_delta.cu", f"causal_conv1d_k{K}", (-(-C // 128), B), 128, args)
        return out

    def causal_conv1d(self, x, weight, conv_state, slot):
        _check("causal_conv1d", "x", x, _BF16, (None, None))
        _require("causal_conv1d", 0 <= slot < conv_state.shape[0], f"slot {slot} outside the state's rows")
        return self._conv("causal_conv1d", x, weight, conv_state, self.index([slot]), 1, x.shape[0])

    def causal_conv1d_update(self, x, weight, conv_state, slots):
        _check("causal_conv1d_update", "x", x, _BF16, (None, None))
        return self._conv("causal_conv1d_update", x, weight, conv_state, slots, x.shape[0], 1)

    def delta_rule_gates(self, b, a, a_log, dt_bias):
        op = "delta_rule_gates"
        _check(op, "b", b, _BF16, (None, None))
        N, Hv = b.shape
        _check(op, "a", a, _BF16, (N, Hv))
        _check(op, "a_log", a_log, _BF16, (Hv,))
        _check(op, "dt_bias", dt_bias, _BF16, (Hv,))
        g, beta = cupy.empty((N, Hv), _F32), cupy.empty((N, Hv), _F32)
        if N:
            args = (b, a, a_log, dt_bias, g, beta, np.int64(N * Hv), np.int32(Hv))
            _launch("gated_delta.cu", "delta_rule_gates", (min(-(-N * Hv // 256), 65536),), 256, args)
        return g, beta

    def _delta(self, op, q, k, v, g, beta, delta_state, slots, B: int, T: int):
        _check(op, "q", q, _BF16, (B * T, None, None))
        _, Hk, dk = q.shape
        _check(op, "k", k, _BF16, (B * T, Hk, dk))
        _check(op, "v", v, _BF16, (B * T, None, None))
        Hv, dv = v.shape[1:]
        _require(op, Hv % Hk == 0, f"value heads {Hv} are not a multiple of key heads {Hk}")
        _require(op, dk <= _DELTA_DK_CAPS[-1], f"key head dim dk={dk} exceeds the kernels' {_DELTA_DK_CAPS[-1]}")
        _check(op, "g", g, _F32, (B * T, Hv))
        _check(op, "beta", beta, _F32, (B * T, Hv))
        _check(op, "delta_state", delta_state, _F32, (None, Hv, dk, dv))
        _check(op, "slots", slots, _I32, (B,))
        out = cupy.empty((B * T, Hv, dv), _BF16)
        if out.size:
            args = (q, k, v, g, beta, delta_state, slots, out, *map(np.int32, (T, Hk, Hv, dk, dv)))
            cap = next(c for c in _DELTA_DK_CAPS if dk <= c)
            name, split = f"gated_delta_rule_dk{cap}", 2 if cap > 64 else 1  # DELTA_SPLIT: threads per column
            cols = _block(name) // split  # DELTA_COLS state columns per block
            block = _threads(split * min(dv, cols), name)
            _launch("gated_delta.cu", name, (Hv, B, -(-dv // cols)), block, args, smem=2 * dk * 4)
        return out

    def gated_delta_rule_chunked(self, q, k, v, g, beta, delta_state, slot):
        op = "gated_delta_rule_chunked"
        _require(op, 0 <= slot < delta_state.shape[0], f"slot {slot} outside the state's rows")
        return self._delta(op, q, k, v, g, beta, delta_state, self.index([slot]), 1, q.shape[0])

    def gated_delta_rule_step(self, q, k, v, g, beta, delta_state, slots):
        return self._delta("gated_delta_rule_step", q, k, v, g, beta, delta_state, slots, q.shape[0], 1)

    def gated_rms_norm(self, x, weight, gate, eps):
        _check("gated_rms_norm", "x", x, _BF16, (None, None))
        R, D = x.shape
        _check("gated_rms_norm", "weight", weight, _BF16, (D,))
        _check("gated_rms_norm", "gate", gate, _BF16, (R, D))
        out = cupy.empty_like(x)
        if x.size:
            args = (x, weight, gate, out, np.int32(D), np.float32(eps))
            _launch("gated_delta.cu", "gated_rms_norm", (R,), _threads(D, "gated_rms_norm"), args)
        return out

    def sigmoid_mul(self, x, gate):
        _check("sigmoid_mul", "x", x, _BF16)
        _check("sigmoid_mul", "gate", gate, _BF16, x.shape)
        out = cupy.empty_like(x)
        if x.size:
            args = (x, gate, out, np.int64(x.size))
            _launch("gated_delta.cu", "sigmoid_mul_bf16", (min(-(-x.size // 256), 65536),), 256, args)
        return out
