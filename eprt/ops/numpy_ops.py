"""The NumPy reference backend (float32 everywhere). Shape legend in ``base.py``."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging

import numpy as np

from eprt import env
from eprt.ops import cpu_pool, cpu_threads, cpu_weights, lora_ops
from eprt.ops.base import GroupedRouting, Ops, Permutation
from eprt.ops.cpu_weights import ScaledPanels
from eprt.ops.gptoss_ops import GptOssOps

log = logging.getLogger("eprt.ops")


def _softmax_last(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True)
    return x


FEW_QUERY_ROWS = 16  # query rows per kv head (a verify step's) up to which attention scores run as K @ q^T
DECODE_GATHER_BYTES = 64 << 20  # padded K+V copy of one decode attention gather
EXPERT_ROWS_AS_GEMV = 16  # NumPy's products: an expert with at most this many rows runs a GEMV per row
UNSPLIT = 1 << 62  # moe_split_rows that no expert's row count reaches
MOE_TOKENS_ONE_BY_ONE = 5  # up to this many tokens, moe_experts may run them one by one
EXPERT_PATHS = ("auto", "numba", "numpy")  # EPRT_CPU_EXPERTS


def _edges(bounds: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """[lo0, hi0, lo1, hi1, ..]: the row range of each of ``experts`` in groups ``bounds`` [El+1]."""
    edges = np.empty(2 * len(experts), dtype=np.int64)
    edges[0::2], edges[1::2] = bounds[experts], bounds[experts + 1]
    return edges


def numba_available() -> bool:
    """Whether the numba expert path can run (the cpu extra is installed), without importing it."""
    return importlib.util.find_spec("numba") is not None


def cpu_path(choice: str | None = None) -> str:
    """The CPU path ``choice`` (None: EPRT_CPU_EXPERTS) resolves to: "numba" (cpu_kernels, the
    compiled products, attention and sampling helpers) or "numpy"; "auto" is numba when it is
    installed."""
    choice = env.CPU_EXPERTS.get() if choice is None else choice
    if choice not in EXPERT_PATHS:
        raise ValueError(f"expert path must be one of {EXPERT_PATHS}, got {choice!r}")
    if choice == "numba" and not numba_available():
        raise ValueError("expert path 'numba' was asked for, but numba is not installed (pip install 'eprt[cpu]')")
    return "numba" if choice == "numba" or (choice == "auto" and numba_available()) else "numpy"


def _panelled(w, ndim: int) -> bool:
    """Whether w, a matrix (``ndim`` 2) or a stack of them (3), is held as the compiled products'
    panels (``cpu_weights``: float32 / bf16 panels have one more dimension, or ScaledPanels)."""
    return isinstance(w, ScaledPanels) or w.ndim == ndim + 1


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt((x * x).sum(axis=-1, keepdims=True) + np.float32(eps))


def _delta_inputs(q: np.ndarray, k: np.ndarray, heads: int):
    """q, k [.., Hk, dk] -> per value head [.., Hv, dk]: L2-normalized, q scaled by dk**-0.5."""
    r = heads // q.shape[-2]
    q, k = np.repeat(q, r, axis=-2), np.repeat(k, r, axis=-2)
    return _l2norm(q) * np.float32(q.shape[-1] ** -0.5), _l2norm(k)


def _solve_unit_lower(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """X with (I + strictly_lower(a)) X = b: forward substitution over the rows. a[.., c, c], b[.., c, d]."""
    x = b.copy()
    for i in range(1, a.shape[-1]):
        x[..., i, :] -= np.einsum("...j,...jd->...d", a[..., i, :i], x[..., :i, :])
    return x


def _compiled_counts(counts) -> bool:
    """Whether the compiled router's pick can count into ``counts``: none, or int32 [E]."""
    return counts is None or (counts.dtype == np.int32 and counts.ndim == 1)


def expert_permutation(ids: np.ndarray, expert_start: int, El: int) -> Permutation:
    """The reference Permutation (base.py) of the slots of ids[T, k] to local experts
    [expert_start, expert_start + El)."""
    local = ids.reshape(-1).astype(np.int64) - expert_start  # [T*k]
    slots = np.flatnonzero((local >= 0) & (local < El))
    order = slots[np.argsort(local[slots], kind="stable")]  # ascending slots within an expert
    offsets = np.concatenate([[0], np.cumsum(np.bincount(local[slots], minlength=El))])
    slot_pos = np.full(local.size, -1, np.int32)
    slot_pos[order] = np.arange(order.size)
    return Permutation(offsets.astype(np.int32), order.astype(np.int32), slot_pos)


class NumpyOps(GptOssOps, Ops):
    name = "cpu"
    xp = np
    act_dtype = np.float32
    kv_itemsize = 4  # bytes per KV cache element (float32)
    joins_mla_products = False  # linear's bits depend on the rows (panels at multiples of 16, else OpenBLAS)

    def __init__(self, experts: str | None = None, weights: str | None = None, threads: int | None = None):
        """``experts``: how small expert groups run: "numba" (cpu_kernels, each expert's weights
        streamed once for all its rows), "numpy" (a GEMV per row) or "auto" (numba when it
        imports); None reads EPRT_CPU_EXPERTS. ``weights``: the resident precision of the matrices
        the compiled products read (``cpu_weights.PRECISIONS``; None: EPRT_CPU_WEIGHTS; the NumPy
        path keeps float32). ``threads``: compute threads (None: EPRT_CPU_THREADS; 0: this rank's
        share of the node's cores, ``cpu_threads``); OpenBLAS is set to as many."""
        self.experts = cpu_path(experts)
        self.precision = cpu_weights.precision_choice(weights)
        if self.precision in ("bf16", "int8") and self.experts != "numba":
            raise ValueError(
                f"--cpu-weights {self.precision} needs the compiled kernels (pip install 'eprt[cpu]', "
                f"EPRT_CPU_EXPERTS auto or numba); the NumPy path holds float32 weights"
            )
        self.fp8_resident = self.precision == "auto" and self.experts == "numba"
        self.threads, why = cpu_threads.resolve_threads(threads)
        self.threads_text = f"{self.threads} thread(s) ({why}), {cpu_threads.set_blas_threads(self.threads)}"
        compiled = self.experts == "numba"  # compile each kind's products as its first weights load
        warm = (lambda kind: self.kernels.warm_products(kind, self.threads)) if compiled else (lambda kind: None)
        self.packer = cpu_weights.Packer(self.precision, warm)

    @functools.cached_property
    def kernels(self):
        """eprt.ops.cpu_kernels, imported at the first use (importing numba takes about a second),
        then a plain attribute (a decode step reads it about 80 times)."""
        from eprt.ops import cpu_kernels

        return cpu_kernels

    def describe(self) -> str:
        """The expert path and the weights' precision, for the start-up log and the ranks' compute
        identity (the thread count is not part of it: it never changes a bit)."""
        if self.experts != "numba":
            return "experts NumPy, weights f32" + ("+mxfp4" if "mxfp4" in self.packer.kinds else "")
        return f"experts numba {self.kernels.VERSION}, weights {self.packer.describe()}"

    def warm_up(self) -> None:
        log.info("cpu compute: %s", self.threads_text)
        if self.experts == "numba":
            self.kernels.warm_up(self.threads)

    # ---- data movement -------------------------------------------------------------
    _float32 = staticmethod(cpu_weights.float32)

    def weight(self, host: np.ndarray) -> np.ndarray:
        """Same shape and values; a matrix (or stack of them) is stored input-major ([.., K, N]
        in memory, a transposed view): OpenBLAS streams ``x @ w.T`` for one row about twice as
        fast from that layout as from [N, K] on this project's machines."""
        w = self._float32(host)
        if w.ndim < 2:
            return np.ascontiguousarray(w)
        return np.ascontiguousarray(np.swapaxes(w, -1, -2)).swapaxes(-1, -2)

    def activation(self, host: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(host, dtype=np.float32)

    def index(self, host) -> np.ndarray:
        return np.ascontiguousarray(host, dtype=np.int32)

    def to_host(self, a) -> np.ndarray:
        return np.asarray(a)

    def zeros(self, shape, dtype="act") -> np.ndarray:
        return np.zeros(shape, dtype=np.int32 if dtype == "i32" else np.float32)

    # ---- compute -------------------------------------------------------------------
    def embedding(self, table, ids):
        return table[ids]  # [T, D]

    def rms_norm(self, x, weight, eps):
        if self._compiled_rows(x, weight, ndim=2):  # the same bits in one call (NumPy's pairwise sum)
            return self.kernels.rms_norm(x, weight, eps)  # [T, D]
        var = np.add.reduce(x * x, axis=-1, keepdims=True)  # [T, 1]: np.mean's sum and division, without its wrapper
        var /= x.shape[-1]
        return (x / np.sqrt(var + eps)) * weight

    def add_rms_norm(self, x, residual, weight, eps, extra=None):
        x = x if extra is None else self.add(x, extra)  # [T, D]
        if self._compiled_rows(x, weight, ndim=2) and residual.dtype == np.float32:  # the same bits, one call
            return self.kernels.add_rms_norm(x, residual, weight, eps)  # ([T, D], [T, D])
        s = x + residual  # [T, D]
        return self.rms_norm(s, weight, eps), s

    def linear_weight(self, host: np.ndarray) -> np.ndarray:
        """On the compiled path a matrix [N, K] with N a multiple of 16 is stored as panels
        [N / 16, K, 16] at the resident precision (``cpu_weights``; int8: any N, padded), as expert
        stacks are (``expert_weights``): ``linear`` runs every row count through
        cpu_kernels.product, one summation order, so a row's bits do not depend on its batch-mates;
        from memory it streams one row near the machine's read rate and ran 32 rows 1.4 - 1.5x
        faster than OpenBLAS's GEMM here. Other matrices are stored as ``weight`` does (float32)."""
        if self.experts == "numba" and host.ndim == 2 and (host.shape[0] % 16 == 0 or self.precision == "int8"):
            return self.packer.pack(host)
        return self.weight(host)

    def tied_head(self, embed):
        """int8: a quantized copy of the table, the head being a linear layer like the others (the
        lookups keep the float32 table); otherwise the table, as today (float32, OpenBLAS)."""
        return self.packer.pack(np.asarray(embed)) if self.precision == "int8" and self.experts == "numba" else embed

    def keeps_fp8(self, shape: tuple, block_k: int) -> bool:
        """FP8 panels need 16-row panels and k blocks of whole fours (the products' order)."""
        return self.fp8_resident and shape[0] % 16 == 0 and block_k % 4 == 0

    def weight_fp8(self, raw, scale_inv, block_n, block_k, part_rows):
        """FP8 panels (``cpu_weights.fp8_panels``): each product decodes a weight and multiplies it by
        its block's scale in registers, the float32 weight of the load-time dequantization."""
        return self.packer.fp8(raw, scale_inv, block_n, block_k, part_rows)

    def linear(self, x, w, bias=None):
        if _panelled(w, 2):  # [T, N]: panels, or OpenBLAS
            y = self.kernels.product(x, w, self.threads)
        else:
            y = x @ w.T
        if bias is not None:
            y += bias
        return y

    def rms_norm_linear(self, x, norm, eps, w):
        return self.linear(self.rms_norm(np.ascontiguousarray(x), norm, eps), w)  # [T, N]

    def _compiled_rows(self, x, table, ndim: int) -> bool:
        """Whether the compiled path's row-wise kernels (rms_norm, rope) take x (float32, ``ndim``
        dimensions) with its float32 weight or table: at 1 - 512 rows 1.1 - 36x faster than the
        NumPy expressions, which spend a decode step's few rows in call overhead."""
        return self.experts == "numba" and x.ndim == ndim and x.dtype == table.dtype == np.float32

    def rope(self, x, positions, cos_sin):
        if self._compiled_rows(x, cos_sin, ndim=3):  # the same bits in one call
            return self.kernels.rope(x, positions, cos_sin)  # [T, H, Dh]
        half = x.shape[-1] // 2
        cs = cos_sin[positions]  # [T, Dh]
        cos, sin = cs[:, None, :half], cs[:, None, half:]  # [T, 1, Dh/2]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def kv_write(self, k_cache, v_cache, k, v, slot_mapping):
        if self.experts == "numba" and k_cache.dtype == v_cache.dtype == k.dtype == v.dtype == np.float32:
            return self.kernels.kv_write(k_cache, v_cache, k, v, slot_mapping)  # the same copies, one call
        nb, bs = k_cache.shape[:2]
        keep = slot_mapping >= 0  # negative: padding, skipped
        k_cache.reshape(nb * bs, *k_cache.shape[2:])[slot_mapping[keep]] = k[keep]
        v_cache.reshape(nb * bs, *v_cache.shape[2:])[slot_mapping[keep]] = v[keep]

    def qk_rope_kv_write(self, q, k, v, norms, eps, positions, cos_sin, k_cache, v_cache, slot_mapping):
        if self._compiled_prologue(q, k, v, norms, cos_sin, k_cache, v_cache):  # one call, the same bits
            q_norm, k_norm = (None, None) if norms is None else norms
            return self.kernels.qk_rope_kv_write(
                q, k, v, q_norm, k_norm, eps, positions, cos_sin, k_cache, v_cache, slot_mapping, self.threads
            )
        q, k, v = (np.ascontiguousarray(a) for a in (q, k, v))  # [T, H|Hk, Dh]
        if norms is not None:
            q, k = (self.rms_norm(a.reshape(-1, a.shape[-1]), w, eps).reshape(a.shape) for a, w in zip((q, k), norms))
        q, k = (self._rope_head_start(a, positions, cos_sin) for a in (q, k))
        self.kv_write(k_cache, v_cache, k, v, slot_mapping)
        return q

    def attention_decode_block(
        self, x, qkv, o, heads, norms, eps, positions, cos_sin, k_cache, v_cache, slots, tables, lens, scale
    ):
        if self._compiled_block(x, qkv, o, norms, cos_sin, k_cache, v_cache):  # one call, the same bits
            q_norm, k_norm = (None, None) if norms is None else norms
            args = (eps, positions, cos_sin, (k_cache, v_cache), slots, tables, lens, scale)
            return self.kernels.attention_block(x, qkv, o, heads, q_norm, k_norm, *args, self.threads)  # [T, D]
        args = (norms, eps, positions, cos_sin, k_cache, v_cache, slots, tables, lens, scale)
        return super().attention_decode_block(x, qkv, o, heads, *args)

    def _compiled_block(self, x, qkv, o, norms, cos_sin, k_cache, v_cache) -> bool:
        """Whether ``attention_decode_block`` runs cpu_kernels.attention_block (its five calls as one:
        at batch 1 a call's dispatch and wrappers cost as much as its work): what the compiled
        prologue and decode attention take, both matrices panels, every step on one thread (one
        compute thread, or one row whose products are too small to share out) or rows enough to
        share out whole (cpu_kernels.ROWS_PER_THREAD a thread: each thread's rows read every weight)."""
        Dh, f32 = k_cache.shape[-1], all(a.dtype == np.float32 for a in (x, cos_sin, *(norms or ())))
        one_thread = self.threads == 1 or (x.shape[0] == 1 and self._one_thread(qkv) and self._one_thread(o))
        rows_shared = x.shape[0] >= self.kernels.ROWS_PER_THREAD * self.threads  # each thread's rows whole
        fits = self.experts == "numba" and f32 and x.ndim == 2 and Dh % 16 == 0 and cos_sin.shape[1] == Dh
        fits = fits and _panelled(qkv, 2) and _panelled(o, 2) and self._compiled_caches(k_cache, v_cache)
        return fits and (one_thread or rows_shared)

    def decode_layer_weights(self, *weights, **constants):
        """On the compiled path with resident panels, the layer notes cpu_kernels.layer_parts (its
        static arguments: a decode step then runs each such layer in two compiled calls)."""
        layer = super().decode_layer_weights(*weights, **constants)
        panels = all(_panelled(w, 2) for w in (layer.qkv, layer.o, layer.router))
        if self.experts != "numba" or not (panels and _panelled(layer.w_gate_up, 3) and _panelled(layer.w_down, 3)):
            return layer
        return dataclasses.replace(layer, compiled=self.kernels.layer_parts(layer))

    def decode_layer(self, h, residual, layer, k_cache, v_cache, meta, counts):
        """cpu_kernels.decode_layer (two calls, the same bits) where the layer's panels allow it, the
        rows, caches and table are those its kernels take and its attention runs on one thread; else
        the ops apart."""
        cos_sin, Dh = meta[1], k_cache.shape[-1]
        fits = layer.compiled is not None and h.ndim == 2 and h.shape[0] > 0 and self._layer_alone(layer, h.shape[0])
        fits = fits and h.dtype == cos_sin.dtype == np.float32 and Dh % 16 == 0 and cos_sin.shape[1] == Dh
        if fits and self._compiled_caches(k_cache, v_cache) and _compiled_counts(counts):
            return self.kernels.decode_layer(h, residual, layer, (k_cache, v_cache), meta, counts, self.threads)
        return super().decode_layer(h, residual, layer, k_cache, v_cache, meta, counts)

    def _layer_alone(self, layer, rows: int) -> bool:
        """Whether a decode layer's attention and router run on this thread: one compute thread, or
        fewer rows than the attention block shares out and weights that are not worth sharing
        (cpu_kernels.LAYER_ALONE_BYTES)."""
        if self.threads == 1:
            return True
        weight_bytes = layer.qkv.nbytes + layer.o.nbytes + layer.router.nbytes
        return rows < self.kernels.ROWS_PER_THREAD * self.threads and weight_bytes <= self.kernels.LAYER_ALONE_BYTES

    def _compiled_prologue(self, q, k, v, norms, cos_sin, k_cache, v_cache) -> bool:
        """Whether ``qk_rope_kv_write`` runs cpu_kernels.qk_rope_kv_write: the compiled path, float32
        throughout, every dim of a head rotated, caches written in place (a decode step of the
        benchmark model made 4 - 6 calls of the ops apart per layer)."""
        f32 = all(a.dtype == np.float32 for a in (q, k, v, *(norms or ())))
        full = cos_sin.shape[1] == q.shape[-1]
        return f32 and full and self._compiled_rows(q, cos_sin, ndim=3) and self._compiled_caches(k_cache, v_cache)

    def _rope_head_start(self, x, positions, cos_sin):
        """x[T, H, Dh] rotated over the first R = cos_sin.shape[1] columns of each head."""
        rd = cos_sin.shape[1]
        if rd == x.shape[-1]:
            return self.rope(x, positions, cos_sin)
        return np.concatenate([self.rope(np.ascontiguousarray(x[..., :rd]), positions, cos_sin), x[..., rd:]], axis=-1)

    def _gather_kv(self, cache, block_table, n):
        bs = cache.shape[1]
        nblocks = (n + bs - 1) // bs
        return cache[block_table[:nblocks]].reshape(nblocks * bs, *cache.shape[2:])[:n]  # [n, Hk, Dh]

    def _attend(self, q, k, v, scale, mask=None):
        # q [T, H, Dh]; k, v [S, Hk, Dh]; GQA: query head h reads kv head h // (H // Hk)
        T, H, Dh = q.shape
        Hk = k.shape[1]
        G = H // Hk
        if G * T <= FEW_QUERY_ROWS:  # K @ q^T: the keys are the GEMM's long side, not packed as its B
            qg = q.reshape(T, Hk, G, Dh).transpose(1, 3, 2, 0).reshape(Hk, Dh, G * T) * np.float32(scale)
            scores = np.matmul(k.transpose(1, 0, 2), qg).transpose(0, 2, 1).reshape(Hk, G, T, -1)  # [Hk, G, T, S]
        else:
            qg = q.reshape(T, Hk, G, Dh).transpose(1, 2, 0, 3).reshape(Hk, G * T, Dh) * np.float32(scale)
            scores = np.matmul(qg, k.transpose(1, 2, 0)).reshape(Hk, G, T, -1)  # [Hk, G, T, S]
        if mask is not None:
            scores = np.where(mask, scores, -np.inf)
        probs = _softmax_last(scores).reshape(Hk, G * T, -1)
        out = np.matmul(probs, v.transpose(1, 0, 2)).reshape(Hk, G, T, Dh)  # [Hk, G, T, Dh]
        return out.transpose(2, 0, 1, 3).reshape(T, H, Dh)

    def attention_prefill(self, q, k_cache, v_cache, block_table, start_pos, scale):
        T = q.shape[0]
        S = start_pos + T
        k = self._gather_kv(k_cache, block_table, S)
        v = self._gather_kv(v_cache, block_table, S)
        mask = np.arange(S)[None, :] <= (start_pos + np.arange(T))[:, None]  # [T, S]
        return self._attend(q, k, v, scale, mask)

    def attention_decode(self, q, k_cache, v_cache, block_tables, context_lens, scale):
        B, H, Dh = q.shape
        if self._compiled_attention(q, k_cache, v_cache):  # in place, through the block tables
            return self.kernels.decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, self.threads)
        out = np.empty_like(q)  # [B, H, Dh]
        lens = np.asarray(context_lens)
        bs = k_cache.shape[1]
        row_bytes = 2 * k_cache[0].nbytes * max(1, -(-int(lens.max()) // bs)) if B else 1
        step = max(1, DECODE_GATHER_BYTES // row_bytes)  # rows per gather: bounds the padded copy
        for b0 in range(0, B, step):
            rows = slice(b0, min(B, b0 + step))
            out[rows] = self._attend_padded(q[rows], k_cache, v_cache, block_tables[rows], lens[rows], scale)
        return out

    def _compiled_attention(self, q, k_cache, v_cache) -> bool:
        """Whether decode attention runs cpu_kernels.decode_attention: the compiled path, float32,
        head dim a multiple of 16, C-ordered caches. It reads each row's keys and values where they
        are; the NumPy path gathers them padded and spent 0.75 ms per layer at batch 32 of the
        benchmark model (contexts of 16 - 48), most of a decode step's attention."""
        return (
            self.experts == "numba"
            and q.shape[-1] % 16 == 0
            and q.dtype == np.float32
            and (self._compiled_caches(k_cache, v_cache))
        )

    @staticmethod
    def _compiled_caches(k_cache, v_cache) -> bool:
        """Whether the compiled kernels read and write these KV caches in place: float32, C order."""
        return (
            k_cache.dtype == v_cache.dtype == np.float32 and k_cache.flags.c_contiguous and v_cache.flags.c_contiguous
        )

    def _attend_padded(self, q, k_cache, v_cache, block_tables, lens, scale):
        """Decode attention of rows q[B, H, Dh] over their paged KV, gathered padded to the
        longest context and masked past each row's length."""
        B, H, Dh = q.shape
        bs, Hk = k_cache.shape[1], k_cache.shape[2]
        nblocks = -(-int(lens.max()) // bs)
        S = nblocks * bs
        tables = block_tables[:, :nblocks]  # [B, nb]
        k = k_cache[tables].reshape(B, S, Hk, Dh).transpose(0, 2, 3, 1)  # [B, Hk, Dh, S]
        v = v_cache[tables].reshape(B, S, Hk, Dh).transpose(0, 2, 1, 3)  # [B, Hk, S, Dh]
        qg = q.reshape(B, Hk, H // Hk, Dh) * np.float32(scale)  # [B, Hk, G, Dh]
        scores = np.matmul(qg, k)  # [B, Hk, G, S]
        scores += np.where(np.arange(S)[None, :] < lens[:, None], np.float32(0), np.float32(-np.inf))[:, None, None, :]
        probs = _softmax_last(scores)
        return np.matmul(probs, v).reshape(B, H, Dh)  # [B, Hk, G, Dh] -> [B, H, Dh]

    def attention_verify(self, q, k_cache, v_cache, block_tables, context_lens, query_lens, scale):
        """Sequences of one row (no drafts) attend as decode rows; the others' KV is gathered once
        for their rows (queries padded to the longest row count, each row masked past its own
        length)."""
        qlens = np.asarray(query_lens, dtype=np.int64)  # [B]
        lens = np.asarray(context_lens)  # [N]
        starts = np.cumsum(qlens) - qlens  # [B] each sequence's first row
        single = qlens == 1  # [B]
        if not single.any():
            return self._attend_sequences(q, k_cache, v_cache, block_tables, lens, qlens, starts, scale)
        out = np.empty_like(q)  # [N, H, Dh]
        rows = starts[single]  # [b] the one row of each sequence without drafts
        out[rows] = self.attention_decode(q[rows], k_cache, v_cache, block_tables[rows], lens[rows], scale)
        if not single.all():
            many = np.concatenate([np.arange(a, a + n) for a, n in zip(starts[~single], qlens[~single])])  # [n]
            qlens = qlens[~single]
            starts = np.cumsum(qlens) - qlens
            out[many] = self._attend_sequences(
                q[many], k_cache, v_cache, block_tables[many], lens[many], qlens, starts, scale
            )
        return out

    def _attend_sequences(self, q, k_cache, v_cache, block_tables, lens, qlens, starts, scale):
        """attention_verify of sequences of qlens[B] rows starting at starts[B] of q[N, H, Dh]."""
        N, H, Dh = q.shape
        bs, Hk = k_cache.shape[1], k_cache.shape[2]
        width = int(qlens.max())  # W: rows per sequence, padded
        take = starts[:, None] + np.minimum(np.arange(width)[None, :], qlens[:, None] - 1)  # [B, W] pads repeat
        row_bytes = 2 * k_cache[0].nbytes * max(1, -(-int(lens.max()) // bs))
        step = max(1, DECODE_GATHER_BYTES // row_bytes)  # sequences per gather: bounds the padded copy
        out = np.empty_like(q)  # [N, H, Dh]
        for b0 in range(0, len(qlens), step):
            idx = take[b0 : b0 + step]  # [b, W]
            b = idx.shape[0]
            limit = lens[idx]  # [b, W] each row's context length
            nblocks = -(-int(limit.max()) // bs)
            S = nblocks * bs
            tables = block_tables[idx[:, 0], :nblocks]  # [b, nb]
            k = k_cache[tables].reshape(b, S, Hk, Dh).transpose(0, 2, 3, 1)  # [b, Hk, Dh, S]
            v = v_cache[tables].reshape(b, S, Hk, Dh).transpose(0, 2, 1, 3)  # [b, Hk, S, Dh]
            G = H // Hk
            qg = q[idx].reshape(b, width, Hk, G, Dh).transpose(0, 2, 3, 1, 4) * np.float32(scale)  # [b, Hk, G, W, Dh]
            scores = np.matmul(qg.reshape(b, Hk, G * width, Dh), k).reshape(b, Hk, G, width, S)
            scores += np.where(np.arange(S) < limit[:, :, None], np.float32(0), np.float32(-np.inf))[:, None, None]
            probs = _softmax_last(scores).reshape(b, Hk, G * width, S)
            o = np.matmul(probs, v).reshape(b, Hk, G, width, Dh).transpose(0, 3, 1, 2, 4)  # [b, W, Hk, G, Dh]
            real = np.arange(width)[None, :] < qlens[b0 : b0 + b, None]  # [b, W] rows that are not padding
            out[idx[real]] = o.reshape(b, width, H, Dh)[real]
        return out

    def router(self, logits, top_k, renormalize):
        if self._compiled_router(logits, top_k):  # the same bits, 3 calls
            return self.kernels.router(logits, top_k, renormalize)
        probs = _softmax_last(logits.astype(np.float32, copy=True))  # [T, E]
        # stable sort on -p: ties go to the lower expert id, as torch.topk does on CPU
        ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k].astype(np.int32)  # [T, k]
        weights = probs[np.arange(len(ids))[:, None], ids]  # [T, k] (take_along_axis, without its checks)
        if renormalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return weights.astype(np.float32), ids

    def mla_attention_verify(
        self, q, latent_cache, block_tables, context_lens, query_lens, scale, value_dim, w_uv=None
    ):
        """Each sequence's latent rows gathered once: its rows are a causal chunk at its end."""
        outs, n = [], 0
        for t in np.asarray(query_lens).tolist():
            end = int(context_lens[n + t - 1])
            table = block_tables[n]
            outs.append(self.mla_attention_prefill(q[n : n + t], latent_cache, table, end - t, scale, value_dim))
            n += t
        out = np.concatenate(outs, axis=0)  # [N, H, C]
        return out if w_uv is None else self.head_linear(out, w_uv)  # [N, H, C] or [N, H, Dv]

    def silu_and_mul(self, x):
        inter = x.shape[-1] // 2
        g, u = x[:, :inter], x[:, inter:]
        return g / (1.0 + np.exp(-g)) * u  # [T, I]

    def gate_up_silu(self, x, w):
        return self.silu_and_mul(self.linear(x, w))  # [T, I]

    def clip(self, x, limit):
        return np.clip(x, -limit, limit)

    def sigmoid_gate_add(self, out, s, gate):
        return out + s / (1.0 + np.exp(-gate))  # [T, D]

    def count_experts(self, ids, counts):
        if self.experts == "numba" and ids.ndim == 2:
            return self.kernels.count_experts(ids, counts)  # the same counts, one call
        flat = ids.reshape(-1)  # [T*k]
        counts += np.bincount(flat[(flat >= 0) & (flat < len(counts))], minlength=len(counts)).astype(counts.dtype)

    def route(self, logits, top_k, routing, bias, counts, local):
        """No permutation (``local`` unused): ``moe_experts`` groups its rows itself."""
        grouped = isinstance(routing, GroupedRouting)
        if not grouped and self._compiled_router(logits, top_k, counts):  # the pick counts too: one call fewer
            return (*self.kernels.router(logits, top_k, routing, counts), None)
        weights, ids = (
            self.router_grouped(logits, bias, top_k, routing) if grouped else self.router(logits, top_k, routing)
        )
        if counts is not None:
            self.count_experts(ids, counts)
        return weights, ids, None

    def route_rows(self, x, router, logit_bias, top_k, routing, bias, counts, local):
        """The router's product and its shift in one compiled call where ``route`` would take the
        compiled router anyway (panels with no padding, no logit bias, one thread: the same bits)."""
        fits = logit_bias is None and not isinstance(routing, GroupedRouting) and x.ndim == 2 and x.dtype == np.float32
        panels = fits and self.experts == "numba" and _panelled(router, 2) and _compiled_counts(counts)
        if panels and self.kernels.exact_columns(router) >= top_k and self._one_thread(router):
            return (*self.kernels.route_rows(x, router, top_k, routing, counts), None)
        return super().route_rows(x, router, logit_bias, top_k, routing, bias, counts, local)

    def _one_thread(self, w) -> bool:
        """Whether a product through w runs on this thread alone (``cpu_kernels.product``)."""
        return self.threads == 1 or cpu_pool.threads_for(self.threads, w.nbytes) == 1

    def _compiled_router(self, logits, top_k, counts=None) -> bool:
        """Whether ``router`` (and ``route``'s count) run cpu_kernels.router: the compiled path, [T, E]
        logits with at least top_k experts, int32 counts [E] if any."""
        fits = self.experts == "numba" and logits.ndim == 2 and logits.shape[1] >= top_k
        return fits and _compiled_counts(counts)

    def moe_experts(self, x, weights, ids, w_gate_up, w_down, expert_start, perm=None):
        """(``perm`` is not needed here: the experts group their rows themselves.)"""
        T, D = x.shape
        k = ids.shape[1]
        if _panelled(w_gate_up, 3):  # panels (expert_weights): grouping, every group's FFN and the sum, one call
            return self.kernels.moe(x, ids - expert_start, weights, w_gate_up, w_down, self.threads)  # [T, D]
        if T == 1:  # one token (decode at batch 1): its k experts in choice order, no grouping
            return self._moe_one_token(x, weights[0], ids[0] - expert_start, w_gate_up, w_down)
        if T <= MOE_TOKENS_ONE_BY_ONE and np.bincount(ids.ravel()).max() <= EXPERT_ROWS_AS_GEMV:
            # a few tokens (a verify step's at batch 1), no expert with more rows than run as GEMVs:
            # token by token is cheaper than grouping them, and the same bits (one GEMV per row)
            local = ids - expert_start  # [T, k]
            return np.concatenate(
                [self._moe_one_token(x[t : t + 1], weights[t], local[t], w_gate_up, w_down) for t in range(T)]
            )  # [T, D]
        local = (ids - expert_start).reshape(-1)  # [T*k] local expert of each (token, choice)
        order = np.argsort(local, kind="stable")  # grouped by expert, tokens in order
        experts = local[order]
        bounds = np.searchsorted(experts, np.arange(w_gate_up.shape[0] + 1))  # [El+1] group edges
        start, stop = int(bounds[0]), int(bounds[-1])
        picks = order[start:stop]  # (token, choice) pairs routed to this rank, by expert
        ys = np.zeros((T * k, D), dtype=np.float32)  # [T*k, D] one row per (token, choice)
        if stop > start:
            xs = x[picks // k]  # [n, D] gathered once
            h = self.expert_products(xs, w_gate_up, bounds - start)  # [n, 2I]
            ys[picks] = self.expert_products(self.silu_and_mul(h), w_down, bounds - start)  # [n, D]
        ys *= weights.reshape(-1, 1)
        return ys.reshape(T, k, D).sum(axis=1)  # [T, D]

    def expert_weights(self, gate_up, down):
        """On the compiled path, stacks whose outputs (2I, D) are multiples of 16 are stored as
        panels [El, N / 16, K, 16] (cpu_kernels.panels): the kernels read each 16 columns' weights
        in memory order and keep four rows' sums in registers, every row in the same order whatever
        its group (a row's bits do not depend on its batch-mates). Other stacks are stored as
        ``weight`` stores them and run NumPy's products."""
        fits = gate_up.shape[1] % 16 == 0 and down.shape[1] % 16 == 0  # [El, 2I, D], [El, D, I]
        if self.experts == "numba" and (fits or self.precision == "int8"):
            return self.packer.pack(gate_up), self.packer.pack(down)
        return self.weight(gate_up), self.weight(down)

    def moe_split_rows(self, w_gate_up):
        """Panels (the compiled kernel) give a row the same bits in a group of any size; NumPy's products
        do not (GEMV up to EXPERT_ROWS_AS_GEMV rows, then a GEMM whose row bits depend on the group's size
        and a row's place in it), so their groups are never split."""
        return 1 if _panelled(w_gate_up, 3) else UNSPLIT

    def take_experts(self, gate_up, down, source):
        if isinstance(gate_up, ScaledPanels):
            return gate_up.take(source), down.take(source)
        if gate_up.ndim == 4:  # panels: indexing keeps their layout
            return np.ascontiguousarray(gate_up[source]), np.ascontiguousarray(down[source])
        return self.weight(gate_up[source]), self.weight(down[source])  # restores the input-major layout

    def expert_products(self, xs, w, bounds):
        """[n, N]: rows bounds[e]..bounds[e+1] of xs[n, K] through expert e of w[El, N, K] (or its
        panels: cpu_kernels.expert_rows, every group). Otherwise each row of an expert with at most
        EXPERT_ROWS_AS_GEMV rows runs a GEMV (the same bits whatever the group's size); more, one GEMM."""
        sizes = np.diff(bounds)  # [El]
        if _panelled(w, 3):
            chosen = np.flatnonzero(sizes)
            return self.kernels.expert_rows(xs, w, chosen, _edges(bounds, chosen), self.threads)  # [n, N]
        y = np.empty((len(xs), w.shape[1]), dtype=np.float32)  # [n, N]
        for e in np.flatnonzero((sizes > 0) & (sizes <= EXPERT_ROWS_AS_GEMV)).tolist():
            wt = w[e].T  # [K, N]
            for r in range(int(bounds[e]), int(bounds[e + 1])):
                y[r : r + 1] = xs[r : r + 1] @ wt  # [1, N]
        for e in np.flatnonzero(sizes > EXPERT_ROWS_AS_GEMV).tolist():
            lo, hi = int(bounds[e]), int(bounds[e + 1])
            y[lo:hi] = xs[lo:hi] @ w[e].T  # [t, N]
        return y

    def _moe_one_token(self, x, weights, local, w_gate_up, w_down):
        """moe_experts for x[1, D]: the same float operations (one-row groups: a GEMV; weighted rows
        summed in choice order), without the sort and scatter that group many tokens."""
        out = None
        for j, e in enumerate(local.tolist()):
            if 0 <= e < w_gate_up.shape[0]:
                y = self.silu_and_mul(x @ w_gate_up[e].T) @ w_down[e].T  # [1, D]
                y *= weights[j]
            else:  # another rank's expert
                y = np.zeros_like(x)
            out = y if out is None else out + y
        return out  # [1, D]

    def lora_apply(self, y, x, a, b, rows):
        return lora_ops.lora_apply(y, x, a, b, rows)

    def moe_experts_lora(self, x, weights, ids, w_gate_up, w_down, expert_start, rows, gate_up, down):
        args = (w_gate_up, w_down, expert_start, rows, gate_up, down)
        return lora_ops.moe_experts_lora(self, x, weights, ids, *args)

    # ---- hybrid linear-attention models (Gated DeltaNet) --------------------------------
    DELTA_CHUNK = 64  # tokens per chunk of the chunked delta rule (transformers' and FLA's default)

    def causal_conv1d(self, x, weight, conv_state, slot):
        K = weight.shape[1]
        xs = np.concatenate([conv_state[slot], x], axis=0)  # [K-1+T, C]
        T = x.shape[0]
        y = sum(xs[j : j + T] * weight[:, j] for j in range(K))  # [T, C]
        conv_state[slot] = xs[T:]
        return _silu(y)

    def causal_conv1d_update(self, x, weight, conv_state, slots):
        xs = np.concatenate([conv_state[slots], x[:, None, :]], axis=1)  # [B, K, C]
        conv_state[slots] = xs[:, 1:]
        return _silu(np.einsum("bkc,ck->bc", xs, weight))  # [B, C]

    def delta_rule_gates(self, b, a, a_log, dt_bias):
        z = a.astype(np.float32) + dt_bias  # [T, Hv]
        softplus = np.where(z > 20.0, z, np.log1p(np.exp(np.minimum(z, 20.0))))  # torch's threshold 20
        g = -np.exp(a_log.astype(np.float32)) * softplus
        return g.astype(np.float32), (1.0 / (1.0 + np.exp(-b))).astype(np.float32)

    def gated_delta_rule_chunked(self, q, k, v, g, beta, delta_state, slot):
        T, Hv, dv = v.shape
        q, k = _delta_inputs(q, k, Hv)  # [T, Hv, dk]
        c = min(self.DELTA_CHUNK, T)
        n = -(-T // c)
        pad = n * c - T
        per_head = lambda a: np.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).swapaxes(0, 1)  # noqa: E731
        q, k, v, g, beta = (per_head(a.astype(np.float32)) for a in (q, k, v, g, beta))  # [Hv, n*c, ..]
        q, k = q.reshape(Hv, n, c, -1), k.reshape(Hv, n, c, -1)  # [Hv, n, c, dk]
        v_beta = (v * beta[..., None]).reshape(Hv, n, c, dv)
        k_beta = k * beta.reshape(Hv, n, c, 1)
        cum = g.reshape(Hv, n, c).cumsum(axis=-1)  # [Hv, n, c] log decay since the chunk start
        causal = np.tril(np.ones((c, c), dtype=bool))
        pair = np.exp(np.where(causal, cum[..., :, None] - cum[..., None, :], -np.inf))  # [Hv, n, c, c]
        ut = (k_beta @ k.swapaxes(-1, -2)) * pair
        intra = (q @ k.swapaxes(-1, -2)) * pair
        new_values = _solve_unit_lower(ut, v_beta)  # [Hv, n, c, dv]
        k_cumdecay = _solve_unit_lower(ut, k_beta * np.exp(cum)[..., None])  # [Hv, n, c, dk]
        q = q * np.exp(cum)[..., None]
        k = k * np.exp(cum[..., -1:] - cum)[..., None]
        chunk_decay = np.exp(cum[..., -1])  # [Hv, n]
        S = delta_state[slot].astype(np.float32)  # [Hv, dk, dv]
        out = np.empty((Hv, n, c, dv), dtype=np.float32)
        for i in range(n):
            v_new = new_values[:, i] - k_cumdecay[:, i] @ S  # [Hv, c, dv]
            out[:, i] = q[:, i] @ S + intra[:, i] @ v_new
            S = S * chunk_decay[:, i, None, None] + k[:, i].swapaxes(-1, -2) @ v_new
        delta_state[slot] = S
        return np.ascontiguousarray(out.reshape(Hv, n * c, dv)[:, :T].swapaxes(0, 1))  # [T, Hv, dv]

    def gated_delta_rule_step(self, q, k, v, g, beta, delta_state, slots):
        q, k = _delta_inputs(q, k, v.shape[1])  # [B, Hv, dk]
        S = delta_state[slots] * np.exp(g)[..., None, None]  # [B, Hv, dk, dv]
        kv_mem = np.einsum("bhkv,bhk->bhv", S, k)
        delta = (v - kv_mem) * beta[..., None]  # [B, Hv, dv]
        S += k[..., :, None] * delta[..., None, :]
        delta_state[slots] = S
        return np.einsum("bhkv,bhk->bhv", S, q).astype(np.float32)  # [B, Hv, dv]

    def gated_rms_norm(self, x, weight, gate, eps):
        return self.rms_norm(x, weight, eps) * _silu(gate)  # [N, dv]

    def sigmoid_mul(self, x, gate):
        return x / (1.0 + np.exp(-gate))  # [T, N]

    def argmax(self, logits):
        return np.argmax(np.asarray(logits), axis=-1).astype(np.int64)

    # ---- DeepSeek-class models: grouped routing, shared experts, MLA ------------------
    def router_grouped(self, logits, bias, top_k, routing):
        logits = logits.astype(np.float32, copy=True)  # [T, E]
        scores = _softmax_last(logits) if routing.scoring == "softmax" else 1.0 / (1.0 + np.exp(-logits))
        choice = scores if bias is None else scores + bias  # [T, E]
        T, E = choice.shape
        if routing.n_group > 1:
            groups = choice.reshape(T, routing.n_group, E // routing.n_group)  # [T, G, E/G]
            if routing.group_score == "max":
                group_scores = groups.max(axis=-1)  # [T, G]
            else:
                group_scores = np.sort(groups, axis=-1)[..., -2:].sum(axis=-1)
            best = np.argsort(-group_scores, axis=-1, kind="stable")[:, : routing.topk_group]
            keep = np.zeros(group_scores.shape, dtype=bool)
            np.put_along_axis(keep, best, True, axis=-1)
            choice = np.where(np.repeat(keep, E // routing.n_group, axis=1), choice, -np.inf)
        ids = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k].astype(np.int32)  # [T, k]
        weights = np.take_along_axis(scores, ids, axis=-1)  # [T, k]
        if routing.renormalize:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return (weights * np.float32(routing.scaling)).astype(np.float32), ids

    def add(self, x, y):
        return x + y  # [T, D]

    def rank_sum(self, parts):
        out = parts[0].copy()
        for part in parts[1:]:  # in rank order
            out += part
        return out  # [T, D]

    def head_linear(self, x, w):
        return np.matmul(x.transpose(1, 0, 2), w.transpose(0, 2, 1)).transpose(1, 0, 2)  # [T, H, N]

    def mla_prologue(self, q, compressed, kv_a_norm, eps, positions, cos_sin, w_uk, latent_cache, slot_mapping):
        C, Dn = w_uk.shape[1:]
        latent = self.rms_norm(np.ascontiguousarray(compressed[:, :C]), kv_a_norm, eps)  # [T, C]
        k_rope = self.rope(np.ascontiguousarray(compressed[:, None, C:]), positions, cos_sin)  # [T, 1, R]
        q_rope = self.rope(np.ascontiguousarray(q[:, :, Dn:]), positions, cos_sin)  # [T, H, R]
        q_latent = self.head_linear(np.ascontiguousarray(q[:, :, :Dn]), w_uk)  # [T, H, C]
        self.latent_write(latent_cache, np.concatenate([latent, k_rope[:, 0]], axis=-1), slot_mapping)
        return np.concatenate([q_latent, q_rope], axis=-1)  # [T, H, C+R]

    def latent_write(self, latent_cache, x, slot_mapping):
        nb, bs, width = latent_cache.shape
        keep = slot_mapping >= 0  # negative: padding, skipped
        latent_cache.reshape(nb * bs, width)[slot_mapping[keep]] = x[keep]

    @staticmethod
    def _latent_rows(latent_cache, block_table, n):
        bs, width = latent_cache.shape[1:]
        nblocks = (n + bs - 1) // bs
        return latent_cache[block_table[:nblocks]].reshape(nblocks * bs, width)[:n]  # [n, L]

    @staticmethod
    def _attend_latent(q, rows, scale, value_dim, mask=None):
        # q [T, H, L]; rows [S, L]: every head reads the one latent row per position (MQA-like)
        T, H, L = q.shape
        scores = (q.reshape(T * H, L) @ rows.T).reshape(T, H, -1) * scale  # [T, H, S]
        if mask is not None:
            scores = np.where(mask[:, None, :], scores, -np.inf)
        probs = _softmax_last(scores)
        return (probs.reshape(T * H, -1) @ rows[:, :value_dim]).reshape(T, H, value_dim)  # [T, H, C]

    def mla_attention_prefill(self, q, latent_cache, block_table, start_pos, scale, value_dim):
        T = q.shape[0]
        S = start_pos + T
        rows = self._latent_rows(latent_cache, block_table, S)
        mask = np.arange(S)[None, :] <= (start_pos + np.arange(T))[:, None]  # [T, S]
        return self._attend_latent(q, rows, scale, value_dim, mask)

    def mla_attention_decode(self, q, latent_cache, block_tables, context_lens, scale, value_dim, w_uv=None):
        """Rows gathered padded to the longest context, in batches bounded as attention_decode's; then
        w_uv's head_linear when given."""
        B, H, _ = q.shape
        out = np.empty((B, H, value_dim), dtype=np.float32)  # [B, H, C]
        lens = np.asarray(context_lens)
        bs = latent_cache.shape[1]
        row_bytes = latent_cache[0].nbytes * max(1, -(-int(lens.max()) // bs)) if B else 1
        step = max(1, DECODE_GATHER_BYTES // row_bytes)  # rows per gather: bounds the padded copy
        for b0 in range(0, B, step):
            rows = slice(b0, min(B, b0 + step))
            out[rows] = self._attend_latent_padded(
                q[rows], latent_cache, block_tables[rows], lens[rows], scale, value_dim
            )
        return out if w_uv is None else self.head_linear(out, w_uv)  # [B, H, C] or [B, H, Dv]

    @staticmethod
    def _attend_latent_padded(q, latent_cache, block_tables, lens, scale, value_dim):
        """Decode MLA of rows q[B, H, L] over their paged latent rows, masked past each row's length."""
        B = q.shape[0]
        bs, width = latent_cache.shape[1:]
        nblocks = -(-int(lens.max()) // bs)
        S = nblocks * bs
        rows = latent_cache[block_tables[:, :nblocks]].reshape(B, S, width)  # [B, S, L]
        scores = np.matmul(q, rows.transpose(0, 2, 1)) * scale  # [B, H, S]
        scores += np.where(np.arange(S)[None, :] < lens[:, None], np.float32(0), np.float32(-np.inf))[:, None, :]
        probs = _softmax_last(scores)
        return np.matmul(probs, rows[:, :, :value_dim])  # [B, H, C]
