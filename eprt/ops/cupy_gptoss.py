"""gpt-oss's operations on the GPU (mixed into ``CupyOps``), on ``kernels/gptoss.cu``: the router's
softmax over its top-k logits, attention with sinks and a window (prefill from 16 rows on the tensor
cores' ``flash_attention.cu``: cupy_flash.py), and the experts with biases and the clamped SwiGLU,
bf16 or MXFP4 (kept MXFP4 in device memory, dequantized in the GEMM kernels; bf16 on the tensor
cores' ``moe_tc.cu`` tiles where ``CupyOps.moe_experts`` takes them).
The expert rows are grouped and combined by ``moe_permute.cu`` and ``moe_combine.cu`` as in
``CupyOps.moe_experts``. The NumPy reference and the contract: ``gptoss_ops.py``, ``base.py``.
"""

from __future__ import annotations

import cupy
import numpy as np

from eprt.ops.cupy_flash import flash_gqa
from eprt.ops.gptoss_ops import MXFP4_BLOCK, Mxfp4Weight
from eprt.ops.kernel_loader import LAUNCH, MOE_TC_BM, MOE_TC_BN, MOE_TC_SMEM, MOE_TC_UNITS, launch

FILE = "gptoss.cu"
_BF16, _F32, _I32, _U8 = (np.dtype(t) for t in (np.uint16, np.float32, np.int32, np.uint8))
TS_WARPS = 4  # gptoss.cu: TS_WARPS
SA_THREADS, SA_CHUNK, SA_OUT = 128, 128, 16  # gptoss.cu: attention_sinks' block, keys per pass, outputs per thread
SW_WARPS = 4  # gptoss.cu: SW_THREADS / 32
MAX_TOP_K = 32  # one warp's lanes


def _arg(op: str, name: str, a, dtype, shape: tuple) -> None:
    """``a`` is a C-contiguous cupy array of ``dtype`` whose shape matches ``shape`` (None: any size)."""
    ok = isinstance(a, cupy.ndarray) and a.dtype == dtype and a.flags.c_contiguous and a.ndim == len(shape)
    if not ok or any(want is not None and want != got for want, got in zip(shape, a.shape)):
        got = f"{type(a).__name__} {getattr(a, 'dtype', '')} {list(getattr(a, 'shape', []))}"
        want = "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"
        raise ValueError(f"{op}: {name} must be a C-contiguous cupy {dtype} array of shape {want}, got {got}")


def _check(op: str, ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"{op}: {message}")


def _per_warp(units: int, active: int, sm_count: int) -> int:
    """Output units per warp: about 32 warps per SM over the active experts' work."""
    return max(1, min(16, -(-units * active // (sm_count * 32))))


class GptOssCupy:
    """gpt-oss's ops of ``CupyOps`` (uses its ``weight``, ``sm_count``, ``smem_limit`` and ``_moe_choice``:
    bf16 experts take the tensor cores where CupyOps' would, MXFP4 ones the CUDA cores)."""

    def mxfp4_expert_weights(self, gate_up_blocks, gate_up_scales, down_blocks, down_scales) -> tuple:
        up = lambda a: cupy.asarray(np.ascontiguousarray(a, dtype=np.uint8))  # noqa: E731
        return (
            Mxfp4Weight(up(gate_up_blocks), up(gate_up_scales)),
            Mxfp4Weight(up(down_blocks), up(down_scales)),
        )

    def swiglu_expert_weights(self, gate_up, down) -> tuple:
        return self.weight(gate_up), self.weight(down)

    # ---- router -------------------------------------------------------------------------
    def router_topk_softmax(self, logits, top_k):
        op = "router_topk_softmax"
        _check(op, isinstance(logits, cupy.ndarray) and logits.dtype in (_BF16, _F32), "logits must be bf16 or fp32")
        _arg(op, "logits", logits, logits.dtype, (None, None))
        T, E = logits.shape
        _check(op, 1 <= top_k <= min(E, MAX_TOP_K), f"top_k must be in [1, min(E={E}, {MAX_TOP_K})], got {top_k}")
        smem = 4 * TS_WARPS * E
        _check(op, smem <= self.smem_limit, f"too many experts for one warp per token: {E}")
        weights, ids = cupy.empty((T, top_k), dtype=_F32), cupy.empty((T, top_k), dtype=_I32)  # [T, k]
        if T:
            name = "router_topk_softmax_" + ("f32" if logits.dtype == _F32 else "bf16")
            args = (logits, weights, ids, np.int32(T), np.int32(E), np.int32(top_k))
            launch(FILE, name, (-(-T // TS_WARPS),), 32 * TS_WARPS, args, smem)
        return weights, ids

    # ---- attention ------------------------------------------------------------------------
    def attention_sinks_prefill(self, q, k_cache, v_cache, block_table, start_pos, scale, sinks, window):
        """On tensor cores (flash_attention.cu, with the sinks and the window) from FLASH_MIN_ROWS rows of
        (token, query head of a KV head), else attention_sinks, one block per row."""
        op = "attention_sinks_prefill"
        T = q.shape[0]
        _arg(op, "block_table", block_table, _I32, (None,))
        _check(
            op,
            start_pos >= 0 and block_table.shape[0] * k_cache.shape[1] >= start_pos + T,
            f"block table of {block_table.shape[0]} blocks cannot hold positions [0, {start_pos + T})",
        )
        self._sinks_args(op, q, k_cache, v_cache, sinks, window)
        flash = flash_gqa(q, k_cache, v_cache, block_table, start_pos, scale, self.smem_limit, window, sinks)
        if flash is not None:
            return flash
        lens = cupy.arange(start_pos + 1, start_pos + T + 1, dtype=_I32)  # row t reads keys up to start_pos + t
        return self._attend_sinks(op, q, k_cache, v_cache, block_table, 0, lens, scale, sinks, window)

    def attention_sinks_decode(self, q, k_cache, v_cache, block_tables, context_lens, scale, sinks, window):
        B = q.shape[0]
        _arg("attention_sinks_decode", "block_tables", block_tables, _I32, (B, None))
        _arg("attention_sinks_decode", "context_lens", context_lens, _I32, (B,))
        stride = block_tables.shape[1]
        return self._attend_sinks(
            "attention_sinks_decode", q, k_cache, v_cache, block_tables, stride, context_lens, scale, sinks, window
        )

    def _sinks_args(self, op, q, k_cache, v_cache, sinks, window) -> int:
        """Check attention_sinks' q [R, H, Dh], caches [NB, BS, Hk, Dh], sinks [H] and window; its shared memory."""
        _arg(op, "q", q, _BF16, (None, None, None))
        H, Dh = q.shape[1:]
        _arg(op, "k_cache", k_cache, _BF16, (None, None, None, Dh))
        _arg(op, "v_cache", v_cache, _BF16, k_cache.shape)
        _arg(op, "sinks", sinks, _F32, (H,))
        Hk = k_cache.shape[2]
        _check(op, Hk > 0 and H % Hk == 0, f"query heads {H} must be a multiple of KV heads {Hk}")
        G = H // Hk
        _check(op, Dh % 8 == 0, f"head dim must be a multiple of 8, got {Dh}")
        _check(op, G * Dh <= SA_THREADS * SA_OUT, f"{G} query heads of {Dh} per KV head exceed {SA_THREADS * SA_OUT}")
        _check(op, window >= 0, f"window must be >= 0, got {window}")
        smem = 4 * (G * Dh + G * SA_CHUNK + 3 * G + (G & 1)) + 8 * SA_CHUNK
        _check(op, smem <= self.smem_limit, f"needs {smem} bytes of shared memory (G={G}, Dh={Dh})")
        return smem

    def _attend_sinks(self, op, q, k_cache, v_cache, tables, stride, lens, scale, sinks, window):
        """One attention_sinks launch: row r of q [R, H, Dh] over keys [max(0, lens[r] - window), lens[r])."""
        smem = self._sinks_args(op, q, k_cache, v_cache, sinks, window)
        R, H, Dh = q.shape
        BS, Hk = k_cache.shape[1:3]
        out = cupy.empty_like(q)  # [R, H, Dh]
        if R:
            args = (q, k_cache, v_cache, tables, np.int32(stride), lens, sinks, out)
            args += (np.int32(H), np.int32(Hk), np.int32(Dh), np.int32(BS), np.int32(window), np.float32(scale))
            launch(FILE, "attention_sinks", (R, Hk), SA_THREADS, args, smem)
        return out

    # ---- experts ------------------------------------------------------------------------------
    def moe_experts_swiglu(self, x, weights, ids, w_gate_up, w_down, b_gate_up, b_down, expert_start, alpha, limit):
        op = "moe_experts_swiglu"
        mx = isinstance(w_gate_up, Mxfp4Weight)
        _check(op, mx == isinstance(w_down, Mxfp4Weight), "w_gate_up and w_down must both be MXFP4 or both bf16")
        El, I2, D = w_gate_up.shape
        I = I2 // 2
        if mx:
            _check(op, D % MXFP4_BLOCK == 0 and I % MXFP4_BLOCK == 0, f"D={D}, I={I} must be multiples of 32")
            for name, w, shape in (("w_gate_up", w_gate_up, (El, I2, D)), ("w_down", w_down, (El, D, I))):
                _arg(op, name + ".blocks", w.blocks, _U8, (*shape[:2], shape[2] // MXFP4_BLOCK, MXFP4_BLOCK // 2))
                _arg(op, name + ".scales", w.scales, _U8, (*shape[:2], shape[2] // MXFP4_BLOCK))
        else:
            _check(op, D % 8 == 0 and I % 8 == 0, f"D and I must be multiples of 8, got D={D}, I={I}")
            _arg(op, "w_gate_up", w_gate_up, _BF16, (El, I2, D))
            _arg(op, "w_down", w_down, _BF16, (El, D, I))
        _arg(op, "b_gate_up", b_gate_up, _F32, (El, I2))
        _arg(op, "b_down", b_down, _F32, (El, D))
        _arg(op, "x", x, _BF16, (None, D))
        T = x.shape[0]
        _arg(op, "ids", ids, _I32, (T, None))
        k = ids.shape[1]
        _arg(op, "weights", weights, _F32, (T, k))
        _check(op, 8 * El <= self.smem_limit, f"too many local experts for one permutation block: {El}")
        out = cupy.zeros((T, D), dtype=_F32)  # [T, D]
        if T == 0 or k == 0 or El == 0:
            return out
        offsets, sorted_slot, slot_pos = self._permute_slots(ids, T * k, expert_start, El)
        h = cupy.empty((T * k, I), dtype=_BF16)  # [P, I] (P <= T*k rows used)
        y = cupy.empty((T * k, D), dtype=_F32)  # [P, D]
        rows = (x, k, offsets, sorted_slot, h, y)
        act = (np.float32(alpha), np.float32(limit))
        if not mx and self._moe_choice(T * k, w_gate_up) == "tc":
            self._swiglu_tc(rows, w_gate_up, w_down, b_gate_up, b_down, act)
        else:
            self._swiglu_cuda_cores(rows, w_gate_up, w_down, b_gate_up, b_down, act)
        block = min(LAUNCH["moe_combine"].threads, max(32, (D + 31) // 32 * 32))
        launch("moe_combine.cu", "moe_combine", (T,), block, (y, weights, slot_pos, out, np.int32(D), np.int32(k)))
        return out

    def _swiglu_cuda_cores(self, rows, w_gate_up, w_down, b_gate_up, b_down, act) -> None:
        """h, then y ([P, D] fp32, sorted rows) on gptoss.cu's grouped CUDA-core kernels, bf16 or MXFP4."""
        x, k, offsets, sorted_slot, h, y = rows
        El, I2, D = w_gate_up.shape
        I, mx = I2 // 2, isinstance(w_gate_up, Mxfp4Weight)
        suffix = "mxfp4" if mx else "bf16"
        gate_up = (w_gate_up.blocks, w_gate_up.scales) if mx else (w_gate_up,)
        down = (w_down.blocks, w_down.scales) if mx else (w_down,)
        active = min(El, sorted_slot.shape[0])
        upw = _per_warp(I, active, self.sm_count)
        args = (x, sorted_slot, offsets, *gate_up, b_gate_up, h, np.int32(D), np.int32(I), np.int32(k), np.int32(upw))
        launch(FILE, "moe_gate_up_swiglu_" + suffix, (-(-I // (SW_WARPS * upw)), El), 32 * SW_WARPS, (*args, *act))
        units = (D + 1) // 2
        upw = _per_warp(units, active, self.sm_count)
        args = (h, offsets, *down, b_down, y, np.int32(D), np.int32(I), np.int32(upw))
        launch(FILE, "moe_down_bias_" + suffix, (-(-units // (SW_WARPS * upw)), El), 32 * SW_WARPS, args)

    def _swiglu_tc(self, rows, w_gate_up, w_down, b_gate_up, b_down, act) -> None:
        """h, then y on moe_tc.cu's tensor-core tiles (bf16 experts), one launch per projection over every
        local expert, as CupyOps._experts_tc with the biases and the clamped SwiGLU."""
        x, k, offsets, sorted_slot, h, y = rows
        El, I2, D = w_gate_up.shape
        I, n = I2 // 2, sorted_slot.shape[0]
        slots = (n + El * (MOE_TC_BM - 1)) // MOE_TC_BM  # at least the (expert, 64-row tile) pairs
        dims = (np.int32(D), np.int32(I))
        args = (x, sorted_slot, offsets, w_gate_up, b_gate_up, h, *dims, np.int32(k), np.int32(El), *act)
        launch("moe_tc.cu", "moe_tc_gate_up_swiglu", (slots, -(-I // MOE_TC_UNITS)), 128, args, MOE_TC_SMEM)
        args = (h, offsets, w_down, b_down, y, *dims, np.int32(El))
        launch("moe_tc.cu", "moe_tc_down_bias", (slots, -(-D // MOE_TC_BN)), 128, args, MOE_TC_SMEM)

    def _permute_slots(self, ids, n: int, expert_start: int, El: int) -> tuple:
        """moe_permute.cu's grouping of the n (token, choice) slots by local expert: (offsets [El + 1],
        sorted_slot [<= n], slot_pos [n]); one block of up to 32 warps, one per 256 slots."""
        warps = max(1, min(32, -(-n // 256), self.smem_limit // (4 * El) - 1))
        offsets, sorted_slot, slot_pos = cupy.empty(El + 1, _I32), cupy.empty(n, _I32), cupy.empty(n, _I32)
        args = (ids, np.int32(n), np.int32(expert_start), np.int32(El), offsets, sorted_slot, slot_pos)
        launch("moe_permute.cu", "moe_permute", (1,), 32 * warps, args, 4 * (warps + 1) * El)
        return offsets, sorted_slot, slot_pos
