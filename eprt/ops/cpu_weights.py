"""The CPU's resident weight formats (``--cpu-weights``) and their packing at load, in NumPy (no
numba: the compiled kernels that read them are ``cpu_kernels``).

Every matrix that only the compiled products read is stored as panels of 16 output columns
(``panels``: panel c holds w[16 c : 16 c + 16, :] transposed, [K, 16], so its weights stream in
memory order), at one of four precisions:

    f32   float32 panels [.., C, K, 16]
    bf16  bfloat16 bits (uint16) [.., C, K, 16], widened in registers: w = bits << 16, exact;
          each panel's rows paired (``pair_rows``: rows 2i and 2i + 1 interleaved, so a 64-byte
          line holds two k of the 16 columns, one load and a shift or a mask per row; K even,
          an odd K is held as f32)
    fp8   float8_e4m3fn bytes (uint8) [.., C, K, 16] and per-lane block scales [.., C, KB, 16]:
          w = e4m3(byte) * scale in float32, the product the load-time dequantization made
    int8  symmetric int8 [.., C, K' / 4, 16, 4] (four consecutive k of one column together, as
          VNNI's dot product reads them), group scales [.., C, K' / G, 16] float32: groups of G
          (32 or 64) along k, scale = max |w| / 127, K padded to K' (a multiple of G) and N to
          16 with zeros

The first three give every product the bits of today's float32 panels (the kernels widen to the
same float32 weights and sum in the same order); int8 changes the outputs (its activations are
quantized too, per row and group, symmetric int8).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from eprt import env
from eprt.ops.bf16 import bf16_bits_to_f32, f32_to_bf16_bits

log = logging.getLogger("eprt.ops")

LANES = 16  # output columns per panel
PRECISIONS = ("auto", "f32", "bf16", "int8")  # --cpu-weights
INT8_GROUPS = (32, 64)  # EPRT_CPU_INT8_GROUP


def precision_choice(choice: str | None) -> str:
    """The --cpu-weights value (None: EPRT_CPU_WEIGHTS), checked."""
    choice = env.CPU_WEIGHTS.get() if choice is None else choice
    if choice not in PRECISIONS:
        raise ValueError(f"--cpu-weights must be one of {', '.join(PRECISIONS)}, got {choice!r}")
    return choice


def int8_group() -> int:
    """The int8 weights' group along k (EPRT_CPU_INT8_GROUP), checked."""
    group = env.CPU_INT8_GROUP.get()
    if group not in INT8_GROUPS:
        raise ValueError(f"EPRT_CPU_INT8_GROUP must be one of {INT8_GROUPS}, got {group}")
    return group


@dataclass(frozen=True)
class ScaledPanels:
    """Panels that need scales to read: fp8 (``data`` uint8 [.., C, K, 16], ``scales`` [.., C, K /
    block, 16]) or int8 (``data`` int8 [.., C, K' / 4, 16, 4], ``scales`` [.., C, K' / block, 16]).
    ``rows`` is N (the int8 panels' padding past it is zeros); ``cols`` is K."""

    kind: str  # "fp8" | "int8"
    data: np.ndarray
    scales: np.ndarray
    block: int  # k per scale: the FP8 block_k, or the int8 group
    rows: int
    cols: int

    @property
    def shape(self) -> tuple:
        """The logical shape: [.., N, K] (a stack's experts first)."""
        return (*self.data.shape[: -4 if self.kind == "int8" else -3], self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes

    def take(self, source) -> ScaledPanels:
        """The matrices ``source`` of a stack, in that order."""
        data, scales = np.ascontiguousarray(self.data[source]), np.ascontiguousarray(self.scales[source])
        return ScaledPanels(self.kind, data, scales, self.block, self.rows, self.cols)


def panels(w: np.ndarray) -> np.ndarray:
    """[.., N / 16, K, 16]: w[.., N, K] (N a multiple of 16, any dtype) as panels, panel c holding
    w[.., 16 c : 16 c + 16, :] transposed."""
    *lead, N, K = w.shape
    return np.ascontiguousarray(w.reshape(*lead, N // LANES, LANES, K).swapaxes(-1, -2))


def float32(host: np.ndarray) -> np.ndarray:
    """float32 of host float32 or bfloat16 bits (uint16), exact."""
    return bf16_bits_to_f32(host) if host.dtype == np.uint16 else np.asarray(host, dtype=np.float32)


def float_panels(host: np.ndarray, precision: str) -> np.ndarray:
    """Panels of host (float32 or bfloat16 bits) at ``precision``: "f32", "bf16" (a float32
    matrix rounded to nearest even; rows paired, ``pair_rows``) or "auto" (as stored); an odd K
    is held as f32 (the same weights)."""
    if precision == "f32" or (precision == "auto" and host.dtype != np.uint16):
        return panels(float32(host))
    bits = host if host.dtype == np.uint16 else f32_to_bf16_bits(host)
    if not rows_pair(host.shape[-1]):  # the same weights held as float32
        return panels(float32(bits))
    return pair_rows(panels(bits))


def rows_pair(K: int) -> bool:
    """Whether bfloat16 panels of K rows (a matrix's K columns) can pair them (``pair_rows``): K even."""
    return K % 2 == 0


def int8_padded(N: int, K: int, group: int) -> tuple:
    """(N', K') of int8 panels of a [N, K] matrix: N padded to 16, K to the group (``int8_panels``)."""
    return N + -N % LANES, K + -K % group


def pair_rows(p: np.ndarray) -> np.ndarray:
    """bfloat16 panels p [.., C, K, 16] (K even) with each panel's rows 2i and 2i + 1 interleaved:
    element (k, n) of a panel at offset 32 (k // 2) + 2 n + k % 2, so the 64-byte line of rows 2i,
    2i + 1 read as 16 uint32 lanes holds row 2i's bits in the low halves and row 2i + 1's in the
    high ones (``cpu_simd.weight_pair``). The shape stays [.., C, K, 16]; index it with
    ``unpair_rows``."""
    *lead, K, n = p.shape
    return np.ascontiguousarray(p.reshape(*lead, K // 2, 2, n).swapaxes(-1, -2)).reshape(p.shape)


def unpair_rows(p: np.ndarray) -> np.ndarray:
    """The panels ``pair_rows`` paired, rows in order again."""
    *lead, K, n = p.shape
    return np.ascontiguousarray(p.reshape(*lead, K // 2, n, 2).swapaxes(-1, -2)).reshape(p.shape)


def unit_scales(w: np.ndarray) -> np.ndarray:
    """The scales the kernels read beside float32 or bf16 panels w[.., C, K, 16]: ones, one block
    (read-only, no memory: every index reads the same 16 lanes)."""
    return np.broadcast_to(np.ones(LANES, np.float32), (*w.shape[:-2], 1, LANES))


def fp8_panels(raw: np.ndarray, scale: np.ndarray, block_n: int, block_k: int, part_rows: int) -> ScaledPanels:
    """FP8 panels of raw[.., N, K] (float8_e4m3fn bytes) with block scales scale[.., (N / part_rows)
    * ceil(part_rows / block_n), ceil(K / block_k)] (rows [i part_rows, (i + 1) part_rows) blocked on
    their own), N a multiple of 16 and block_k of 4: each lane's scale per k block."""
    *lead, N, K = raw.shape
    row = np.arange(N)
    part, within = row // part_rows, row % part_rows
    scale_row = part * -(-part_rows // block_n) + within // block_n  # [N] each row's block row
    lanes = np.asarray(scale, np.float32)[..., scale_row, :]  # [.., N, KB]
    return ScaledPanels("fp8", panels(raw), panels(lanes), block_k, N, K)


def int8_panels(host: np.ndarray, group: int) -> ScaledPanels:
    """Symmetric int8 of host[.., N, K] (float32 or bfloat16 bits) per row and group of ``group``
    along k: scale = max |w| / 127 (float32), q = rint(w / scale) (0 where the group is all zero)."""
    w = float32(host)
    *lead, N, K = w.shape
    rows, cols = int8_padded(N, K, group)
    w = np.pad(w, [(0, 0)] * len(lead) + [(0, rows - N), (0, cols - K)])
    grouped = w.reshape(*lead, rows, -1, group)  # [.., N', G', group]
    scale = np.abs(grouped).max(axis=-1) / np.float32(127.0)  # [.., N', G']
    safe = np.where(scale > 0, scale, np.float32(1.0))[..., None]
    q = np.clip(np.rint(grouped / safe), -127, 127).astype(np.int8).reshape(w.shape)  # [.., N', K']
    quads = q.reshape(*lead, rows // LANES, LANES, cols // 4, 4).swapaxes(-3, -2)
    return ScaledPanels("int8", np.ascontiguousarray(quads), panels(scale.astype(np.float32)), group, N, K)


def int8_dequantized(p: ScaledPanels) -> np.ndarray:
    """float32 [.., N, K] of int8 panels: q * scale (what the int8 kernel's weights stand for)."""
    *lead, C, Kq, _, _ = p.data.shape
    q = p.data.swapaxes(-3, -2).reshape(*lead, C * LANES, Kq * 4).astype(np.float32)  # [.., N', K']
    scale = p.scales.swapaxes(-1, -2).reshape(*lead, C * LANES, -1)  # [.., N', G']
    return (q * np.repeat(scale, p.block, axis=-1))[..., : p.rows, : p.cols]


class Packer:
    """Packs one backend's weights at ``precision`` (auto: as stored) and notes the kinds it holds,
    calling ``first(kind)`` (compile that kind's products) and logging the first of each kind."""

    def __init__(self, precision: str, first: Callable[[str], None]):
        self.precision, self.first = precision, first
        self.group = int8_group() if precision == "int8" else 0
        self.kinds: set = set()  # the kinds of weights packed so far (f32, bf16, fp8, int8)

    def holds(self, kind: str) -> None:
        if kind not in self.kinds:
            self.kinds.add(kind)
            self.first(kind)
            why = "the checkpoint's" if self.precision == "auto" else "asked for"
            log.info("cpu weights: %s resident (%s)", kind, why)

    def pack(self, host: np.ndarray):
        """host [.., N, K] (float32 or bf16 bits) as panels at this precision (int8: ScaledPanels)."""
        if self.precision == "int8":
            self.holds("int8")
            return int8_panels(host, self.group)
        packed = float_panels(host, self.precision)
        self.holds("bf16" if packed.dtype == np.uint16 else "f32")
        return packed

    def keeps(self, kind: str) -> None:
        """Notes weights held as the checkpoint stores them whatever ``precision`` says (gpt-oss's
        MXFP4 experts: 4.25 bits a weight, below every --cpu-weights choice; f32 or bf16 would widen
        them 4 - 8x with the same values, int8 would round them again), calling ``first(kind)`` and
        logging the first."""
        if kind not in self.kinds:
            self.kinds.add(kind)
            self.first(kind)
            log.info("cpu weights: %s kept as stored (--cpu-weights %s applies to the rest)", kind, self.precision)

    def fp8(self, raw: np.ndarray, scale: np.ndarray, block_n: int, block_k: int, part_rows: int) -> ScaledPanels:
        self.holds("fp8")
        return fp8_panels(raw, scale, block_n, block_k, part_rows)

    def describe(self) -> str:
        return "+".join(sorted(self.kinds)) or self.precision
