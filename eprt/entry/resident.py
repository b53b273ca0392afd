"""What a rank holds of the tensors the loader reads, by precision, as each backend holds them
(docs/plan.md, "Weights per rank").

The GPU backend (``--dtype bf16``) holds every weight in bf16 but gpt-oss's MXFP4 experts (as
stored) and its sinks and expert biases (float32). The CPU backend (``--dtype fp32``, its compiled
path: the ``[cpu]`` extra) holds what ``NumpyOps`` packs at ``--cpu-weights``
(eprt/ops/cpu_weights.py, eprt/model/weights.py): each matrix the loader hands to
``linear_weight`` or ``expert_weights`` as panels when its rows are a multiple of 16 (int8: every
one, padded), FP8 ones that ``weights._resident_fp8`` keeps as FP8 with per-lane block scales,
and float32 for the rest (embeddings, norms, biases, MLA's W_UK / W_UV, other row counts).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from eprt.model.config import ModelConfig
from eprt.ops.cpu_weights import LANES, int8_padded, rows_pair

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
_MLA_HOST = ("kv_a_proj_with_mqa.weight", "q_b_proj.weight")  # read as host matrices: never FP8-resident


@dataclass(frozen=True)
class Tensor:
    """One tensor the loader reads: ``read`` bytes counted by the loader, ``resident`` elements kept."""

    name: str
    shape: tuple
    read: int
    resident: int

    def resident_bytes(self, itemsize: int) -> int:
        """Bytes kept on a backend of ``itemsize``: MXFP4 blocks and scales stay bytes, gpt-oss's sinks
        and expert biases float32, the rest as the backend holds weights."""
        if self.name.endswith(("_blocks", "_scales")):
            return self.resident
        return self.resident * (4 if self.name.endswith((".sinks", "proj_bias")) else itemsize)

    def kind(self, itemsize: int) -> str:
        """The precision ``resident_bytes`` holds it at."""
        if self.name.endswith(("_blocks", "_scales")):
            return "mxfp4"
        return "f32" if itemsize == 4 or self.name.endswith((".sinks", "proj_bias")) else "bf16"

    @property
    def params(self) -> int:
        """Parameters it holds (an MXFP4 byte holds two, its scales none)."""
        return (
            2 * self.resident
            if self.name.endswith("_blocks")
            else 0
            if self.name.endswith("_scales")
            else self.resident
        )


@dataclass(frozen=True)
class Held:
    """One rank's resident weights: bytes by precision (f32, bf16, fp8, int8, mxfp4)."""

    replicated: dict
    experts: dict
    embed: int  # of replicated: the embedding table
    head: int  # of replicated: a head apart from the table (untied, or int8's copy of a tied one); 0: the table


def _by_kind(pairs) -> dict:
    out: dict = {}
    for kind, n in pairs:
        out[kind] = out.get(kind, 0) + n
    return out


def gpu_held(replicated: list, experts: list, itemsize: int) -> Held:
    """The GPU backend's: every tensor its own array (``Tensor.resident_bytes``)."""
    bytes_of = lambda ts: _by_kind((t.kind(itemsize), t.resident_bytes(itemsize)) for t in ts)  # noqa: E731
    return Held(
        replicated=bytes_of(replicated),
        experts=bytes_of(experts),
        embed=sum(t.resident_bytes(itemsize) for t in replicated if t.name == EMBED),
        head=sum(t.resident_bytes(itemsize) for t in replicated if t.name == HEAD),
    )


@dataclass(frozen=True)
class Unit:
    """One array NumpyOps holds: ``lead`` matrices of [rows, cols] made of the tensors ``names`` (their
    rows concatenated, a layer's experts stacked), handed over ``via`` "f32" (``ops.weight``: float32,
    ``rows`` elements), "linear" (``weights._weight``: may stay FP8), "host" (``linear_weight`` of a host
    matrix: FP8 is dequantized first), "experts" (``expert_weights``: may stay FP8), "fused" (a fused
    checkpoint tensor's rows, never FP8) or "stored" (MXFP4: ``stored`` bytes). ``packs``: its panels'
    rows fit (a multiple of 16; experts: gate_up's and down's both)."""

    names: tuple
    via: str
    rows: int
    cols: int = 1
    lead: int = 1
    packs: bool = False
    stored: int = 0


@dataclass(frozen=True)
class CpuWeights:
    """The CPU backend at ``precision`` (auto, f32, bf16, int8; int8 in k groups of ``group``);
    ``bf16(name)``, ``fp8(name)``: whether the checkpoint stores the tensor as bf16, or as FP8 with
    block scales (then ``block_k`` columns a scale)."""

    precision: str
    group: int
    bf16: Callable[[str], bool]
    fp8: Callable[[str], bool]
    block_k: int = 0

    def stays_fp8(self, u: Unit) -> bool:
        """``NumpyOps.keeps_fp8`` of a tensor group the loader offers as FP8 (all of it FP8)."""
        return (
            self.precision == "auto"
            and u.via in ("linear", "experts")
            and u.packs
            and self.block_k % 4 == 0
            and all(map(self.fp8, u.names))
        )

    def held(self, u: Unit) -> tuple[str, int]:
        """(precision, bytes) of the array ``u`` becomes."""
        n = u.lead * u.rows * u.cols
        if u.via in ("stored", "f32"):
            return ("mxfp4", u.stored) if u.via == "stored" else ("f32", 4 * n)
        if self.stays_fp8(u):  # bytes, and a float32 scale per lane and k block (cpu_weights.fp8_panels)
            return "fp8", n + 4 * u.lead * u.rows * -(-u.cols // self.block_k)
        if self.precision == "int8":  # N padded to 16, K to the group, a float32 scale per (row, group)
            rows, cols = int8_padded(u.rows, u.cols, self.group)
            return "int8", u.lead * rows * (cols + 4 * (cols // self.group))
        if not u.packs:
            return "f32", 4 * n
        as_stored = self.precision == "auto" and all(map(self.bf16, u.names))  # bf16 bits kept, FP8 dequantized
        bf16 = (self.precision == "bf16" or as_stored) and rows_pair(u.cols)  # (an odd K is held as float32)
        return ("bf16", 2 * n) if bf16 else ("f32", 4 * n)


def cpu_held(cfg: ModelConfig, replicated: list, experts: list, local: int, cpu: CpuWeights) -> Held:
    """The CPU backend's, a rank holding ``local`` experts a layer."""
    units = replicated_units(cfg, replicated, cpu.stays_fp8)
    head = next((u for u in units if u.names == (HEAD,)), None)
    if head is None and cpu.precision == "int8":  # NumpyOps.tied_head: an int8 copy of the table
        head = Unit((EMBED,), "host", cfg.vocab_size, cfg.hidden_size)
        units.append(head)
    return Held(
        replicated=_by_kind(map(cpu.held, units)),
        experts=_by_kind(map(cpu.held, expert_units(cfg, experts, local))),
        embed=4 * cfg.vocab_size * cfg.hidden_size,
        head=0 if head is None else cpu.held(head)[1],
    )


def replicated_units(cfg: ModelConfig, tensors: list, stays_fp8: Callable[[Unit], bool]) -> list[Unit]:
    """The arrays the replicated tensors become (weights.py): q, k and v one matrix unless one of them
    stays FP8 (``_fused_qkv``), a dense MLP's or shared expert's gate and up one (``_gate_up``)."""
    shapes = {t.name: t.shape for t in tensors}
    units, taken = [], set()
    for t in tensors:
        if t.name in taken:
            continue
        names = (t.name,)
        if t.name.endswith("gate_proj.weight"):
            names = (t.name, t.name.replace("gate_proj.weight", "up_proj.weight"))
        elif t.name.endswith("self_attn.q_proj.weight") and t.name.replace("q_proj", "k_proj") in shapes:
            qkv = tuple(t.name.replace("q_proj", p) for p in ("q_proj", "k_proj", "v_proj"))
            names = names if any(stays_fp8(_unit(cfg, (n,), shapes)) for n in qkv) else qkv
        taken.update(names)
        units.append(_unit(cfg, names, shapes))
    return units


def _unit(cfg: ModelConfig, names: tuple, shapes: dict) -> Unit:
    shape = shapes[names[0]]
    if len(shape) != 2 or names[0] == EMBED or names[0].endswith("kv_b_proj.weight"):  # MLA's W_UK / W_UV
        return Unit(names, "f32", math.prod(shape))
    rows = sum(shapes[n][0] for n in names)
    host = names[0].endswith(_MLA_HOST) or (cfg.mla is not None and names[0].endswith("q_proj.weight"))
    return Unit(names, "host" if host else "linear", rows, shape[1], packs=rows % LANES == 0)


def expert_units(cfg: ModelConfig, tensors: list, local: int) -> list[Unit]:
    """The arrays a rank's expert tensors become, layer by layer: gate_up [El, 2I, D] and down
    [El, D, I] stacks (``expert_weights``; per-expert tensors may stay FP8, ``_resident_fp8_experts``),
    gpt-oss's biases float32 and MXFP4 blocks and scales as stored."""
    I, D = cfg.moe_intermediate_size, cfg.hidden_size
    packs = (2 * I) % LANES == 0 and D % LANES == 0
    layers: dict = {}
    for t in tensors:
        layers.setdefault(t.name.split(".experts.")[0], []).append(t)
    units = []
    for ts in layers.values():
        apart = []  # per-expert tensors, stacked by the loader
        for t in ts:
            if t.name.endswith(("_blocks", "_scales")):
                units.append(Unit((t.name,), "stored", t.resident, stored=t.resident))
            elif t.name.endswith("_bias"):
                units.append(Unit((t.name,), "f32", t.resident))
            elif t.name.endswith(("gate_up_proj", "down_proj")):
                rows, cols = (2 * I, D) if t.name.endswith("gate_up_proj") else (D, I)
                units.append(Unit((t.name,), "fused", rows, cols, local, packs))
            else:
                apart.append(t.name)
        if apart:  # one dtype for the layer's stacks: bf16 only when all of them are (weights._same_dtype)
            units += [Unit(tuple(apart), "experts", n, k, local, packs) for n, k in ((2 * I, D), (D, I))]
    return units
