"""LoRA adapters in PEFT format, loaded for one rank's experts, and the device slots that hold them.

An adapter's deltas are what ``peft``'s ``merge_and_unload()`` adds to the base weights; eprt keeps
them factored (A, then B with the scale folded in) and adds ``B (A x)`` per row of its adapter.
Rationale, formats and the slot protocol: docs/lora.md.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np

from eprt.model.config import ModelConfig
from eprt.model.safetensors_io import CheckpointError, SafetensorsCheckpoint
from eprt.ops.bf16 import bf16_bits_to_f32

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# targets of a layer: attention projections, the dense MLP, the shared expert and the routed experts
LINEAR_TARGETS = ("q", "k", "v", "o", "mlp_gate_up", "mlp_down", "shared_gate_up", "shared_down")
EXPERT_TARGETS = ("experts_gate_up", "experts_down")
GATE_UP_TARGETS = ("mlp_gate_up", "shared_gate_up", "experts_gate_up")  # two projections: rank up to 2x


class LoraError(CheckpointError):
    """An adapter eprt cannot serve (format, target, rank); the message names the field and value."""


@dataclass(frozen=True)
class Factors:
    """One target's delta ``b @ a``: a [.., R, in], b [.., out, R] (scale folded in), float32 host."""

    a: np.ndarray
    b: np.ndarray

    @property
    def rank(self) -> int:
        return self.a.shape[-2]


@dataclass
class LoraAdapter:
    """An adapter's factors for one rank: ``targets[(layer, target)]``; expert targets hold only
    the local experts [expert_start, expert_end) as a [El, R, in] / b [El, out, R]."""

    path: str
    rank: int  # the largest rank of any projection (gate and up counted apart)
    targets: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _Options:
    r: int
    alpha: float
    rank_pattern: dict
    alpha_pattern: dict
    rslora: bool

    def scale(self, key: str, rank: int) -> float:
        """peft's scaling for the module ``key``: alpha / r (alpha / sqrt(r) with rsLoRA), each from its pattern."""
        r = self.rank_pattern.get(_pattern_key(self.rank_pattern, key), self.r)
        if r != rank:
            raise LoraError(f"adapter tensor for {key!r} has rank {rank} but adapter_config.json gives r={r}")
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, key), self.alpha)
        return alpha / math.sqrt(r) if self.rslora else alpha / r


def _pattern_key(patterns: dict, key: str) -> str:
    """The first pattern matching the end of ``key`` at a dot boundary (peft's get_pattern_key)."""
    return next((p for p in patterns if re.match(rf"(.*\.)?({p})$", key)), key)


def read_options(path: str) -> _Options:
    """adapter_config.json, refusing what a merged peft adapter would not be (DoRA, biases, ...)."""
    cfg_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(cfg_path):
        raise LoraError(f"LoRA adapter {path!r}: no {ADAPTER_CONFIG} (a PEFT adapter directory is needed)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            c = json.load(f)
    except ValueError as e:
        raise LoraError(f"{cfg_path}: not valid JSON: {e}") from None
    if not isinstance(c, dict) or c.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{cfg_path}: peft_type must be 'LORA', got {c.get('peft_type')!r}")
    for name, allowed in (("use_dora", False), ("fan_in_fan_out", False), ("lora_bias", False)):
        if bool(c.get(name) or False) != allowed:
            raise LoraError(f"{cfg_path}: {name}={c.get(name)!r} is not supported (only {allowed})")
    if c.get("bias", "none") != "none" or c.get("modules_to_save"):
        raise LoraError(f"{cfg_path}: bias / modules_to_save adapters are not supported (trained full weights)")
    r, alpha = c.get("r", 8), c.get("lora_alpha", 8)
    if not isinstance(r, int) or r < 1:
        raise LoraError(f"{cfg_path}: r must be a positive integer, got {r!r}")
    return _Options(r, float(alpha), dict(c.get("rank_pattern") or {}), dict(c.get("alpha_pattern") or {}),
                    bool(c.get("use_rslora")))  # fmt: skip


def _f32(a: np.ndarray) -> np.ndarray:
    """A float32 copy (never a view of the mapped file, which is closed after reading)."""
    return bf16_bits_to_f32(a) if a.dtype == np.uint16 else np.array(a, dtype=np.float32)


def _patterns(cfg: ModelConfig) -> list:
    moe, shared = re.escape(cfg.moe_prefix), re.escape(cfg.shared_expert_prefix)
    names = "|".join(re.escape(n) for n in cfg.expert_names)
    return [
        ("attention", re.compile(r"model\.layers\.(\d+)\.self_attn\.(q|k|v|o)_proj$")),
        ("shared", re.compile(rf"model\.layers\.(\d+)\.{moe}\.{shared}\.(gate|up|down)_proj$")),
        ("expert", re.compile(rf"model\.layers\.(\d+)\.{moe}\.experts\.(\d+)\.({names})$")),
        ("fused", re.compile(rf"model\.layers\.(\d+)\.{moe}\.experts((?:\.base_layer)*)$")),
        ("dense", re.compile(rf"model\.layers\.(\d+)\.{moe}\.(gate|up|down)_proj$")),
    ]


SUPPORTED = (
    "self_attn.{q,k,v,o}_proj, the dense MLP's and shared expert's {gate,up,down}_proj, "
    "experts.{i}.<expert projection> and target_parameters experts.gate_up_proj / experts.down_proj"
)


def load_lora(path: str, cfg: ModelConfig, expert_start: int, expert_end: int, max_rank: int) -> LoraAdapter:
    """The adapter at ``path`` for this rank: every replicated target, and the experts in
    [expert_start, expert_end) only (no other expert's factors are kept)."""
    opts = read_options(path)
    if not os.path.isfile(os.path.join(path, ADAPTER_WEIGHTS)):
        raise LoraError(f"LoRA adapter {path!r}: no {ADAPTER_WEIGHTS}")
    src = SafetensorsCheckpoint(path)
    modules: dict[str, dict] = {}
    for name in src.keys():
        stem = name[len(PEFT_PREFIX) :] if name.startswith(PEFT_PREFIX) else name
        m = re.match(r"(.*)\.lora_([AB])\.weight$", stem)
        if m is None:
            raise LoraError(f"adapter tensor {name!r} is not a LoRA factor (lora_A / lora_B weight)")
        modules.setdefault(m.group(1), {})[m.group(2)] = name
    if not modules:
        raise LoraError(f"LoRA adapter {path!r}: {ADAPTER_WEIGHTS} holds no LoRA factors")
    adapter = LoraAdapter(path, 0)
    parts: dict = {}  # (layer, target) -> {part: Factors}; gate / up merged below
    patterns = _patterns(cfg)
    for key, ab in sorted(modules.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"adapter module {key!r} has lora_{''.join(ab)} but not both lora_A and lora_B")
        kind, m = next(((k, p.match(key)) for k, p in patterns if p.match(key)), (None, None))
        if kind is None:
            raise LoraError(f"adapter module {key!r}: eprt applies LoRA to {SUPPORTED} only")
        layer = int(m.group(1))
        if layer >= cfg.num_layers:
            raise LoraError(f"adapter module {key!r}: layer {layer} outside the model's {cfg.num_layers} layers")
        _check_target(cfg, key, kind, layer)
        if kind == "fused":
            target, f = _fused(cfg, key, src, ab, opts, expert_start, expert_end)
            parts.setdefault((layer, target), {})["fused"] = f
        elif kind == "expert":
            e, proj = int(m.group(2)), cfg.expert_names.index(m.group(3))
            if not 0 <= e < cfg.num_experts:
                raise LoraError(f"adapter module {key!r}: expert {e} outside [0, {cfg.num_experts})")
            if expert_start <= e < expert_end:
                a, b = _copy(src, ab["A"]), _copy(src, ab["B"])
                _check_ab(key, a, b)
                target = "experts_down" if proj == 2 else "experts_gate_up"
                f = Factors(a, b * np.float32(opts.scale(key, a.shape[0])))
                parts.setdefault((layer, target), {})[(e, ("gate", "up", "down")[proj])] = f
            else:  # another rank's expert: never read, its rank checked from the header
                opts.scale(key, src.info(ab["A"]).shape[0])
        else:
            a, b = _copy(src, ab["A"]), _copy(src, ab["B"])
            _check_ab(key, a, b)
            proj = m.group(2)
            f = Factors(a, b * np.float32(opts.scale(key, a.shape[0])))
            if kind == "attention":
                parts.setdefault((layer, proj), {})[proj] = f
            else:
                prefix = "mlp" if kind == "dense" else "shared"
                target = f"{prefix}_down" if proj == "down" else f"{prefix}_gate_up"
                parts.setdefault((layer, target), {})[proj] = f
    for (layer, target), got in parts.items():
        f = _assemble(cfg, target, got, expert_start, expert_end)
        limit = max_rank * (2 if target in GATE_UP_TARGETS else 1)
        if f.rank > limit:
            raise LoraError(
                f"LoRA adapter {path!r}: layer {layer} {target} has rank {f.rank}, above --max-lora-rank {max_rank}"
                + (" (x2 for a gate+up pair)" if target in GATE_UP_TARGETS else "")
            )
        adapter.targets[(layer, target)] = f
        adapter.rank = max(adapter.rank, f.rank)
    src.close()
    return adapter


def _check_target(cfg: ModelConfig, key: str, kind: str, layer: int) -> None:
    sparse = cfg.sparse_layers[layer]
    if kind == "attention" and (cfg.mla is not None or cfg.attention_output_gate or cfg.is_linear_layer(layer)):
        raise LoraError(f"adapter module {key!r}: LoRA on {cfg.model_type}'s attention is not supported")
    if kind == "dense" and sparse or kind in ("expert", "fused") and not sparse:
        raise LoraError(f"adapter module {key!r}: layer {layer} is {'a MoE' if sparse else 'a dense'} layer")
    if kind == "shared" and not cfg.has_shared_expert:
        raise LoraError(f"adapter module {key!r}: {cfg.model_type} has no shared expert")


def _check_ab(key: str, a: np.ndarray, b: np.ndarray) -> None:
    if a.ndim != 2 or b.ndim != 2 or b.shape[1] != a.shape[0]:
        raise LoraError(f"adapter module {key!r}: lora_A {a.shape} and lora_B {b.shape} do not chain")


def _copy(src, name: str, cut=lambda view: view) -> np.ndarray:
    """A float32 copy of ``cut`` of the tensor's mapped view: only the part ``cut`` keeps is read."""
    return _f32(cut(src.read(name)))


def _fused(cfg: ModelConfig, key: str, src, ab: dict, opts: _Options, start: int, end: int):
    """peft's ParamWrapper on experts.gate_up_proj [E, 2I, D] or down_proj [E, D, I]: lora_A
    [r*E, in] (expert-major rows), lora_B [out, r*E] (rank-major columns); which parameter a
    (possibly nested) wrapper holds follows from its shapes, the two never being alike. Only the
    local experts' rows of lora_A and columns of lora_B are copied."""
    E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    a, b = (np.broadcast_to(np.uint8(0), src.info(ab[p]).shape) for p in "AB")  # shapes only: nothing read
    _check_ab(key, a, b)
    if a.shape[0] % E:
        raise LoraError(f"adapter module {key!r}: lora_A rows {a.shape[0]} are not rank x {E} experts")
    r = a.shape[0] // E
    shapes = {(D, 2 * I): ("experts_gate_up", "gate_up_proj"), (I, D): ("experts_down", "down_proj")}
    if (a.shape[1], b.shape[0]) not in shapes:
        raise LoraError(
            f"adapter module {key!r}: lora_A {a.shape} / lora_B {b.shape} fit neither experts.gate_up_proj "
            f"[{E}, {2 * I}, {D}] nor experts.down_proj [{E}, {D}, {I}]"
        )
    target, param = shapes[(a.shape[1], b.shape[0])]
    parent = re.sub(r"(\.base_layer)+$", "", key)
    scale = np.float32(opts.scale(f"{parent}.{param}", r))
    la = _copy(src, ab["A"], lambda v: v.reshape(E, r, -1)[start:end])  # [El, r, in]
    lb = _copy(src, ab["B"], lambda v: v.reshape(v.shape[0], r, E)[:, :, start:end].transpose(2, 0, 1))  # [El, out, r]
    return target, Factors(la, lb * scale)


def _assemble(cfg: ModelConfig, target: str, got: dict, start: int, end: int) -> Factors:
    """One target's factors: gate and up side by side in rank (b block-diagonal) for a gate_up target."""
    if target in ("q", "k", "v", "o"):
        return got[target]
    if target in ("mlp_down", "shared_down"):
        return got["down"]
    if target in ("mlp_gate_up", "shared_gate_up"):
        return _pair([got.get("gate"), got.get("up")])
    if "fused" in got:
        if len(got) > 1:
            raise LoraError(f"{target}: both per-expert modules and target_parameters in one adapter")
        return got["fused"]
    El, out = end - start, (2 * cfg.moe_intermediate_size if target == "experts_gate_up" else cfg.hidden_size)
    per = [
        [got.get((e, p)) for p in (("gate", "up") if target == "experts_gate_up" else ("down",))]
        for e in range(start, end)
    ]
    stacked = [_pair(p) if any(p) else None for p in per]
    R = max((f.rank for f in stacked if f is not None), default=1)
    width = stacked[0].a.shape[1] if stacked[0] is not None else next(f.a.shape[1] for f in stacked if f)
    a, b = np.zeros((El, R, width), np.float32), np.zeros((El, out, R), np.float32)
    for i, f in enumerate(stacked):
        if f is not None:
            a[i, : f.rank], b[i, :, : f.rank] = f.a, f.b
    return Factors(a, b)


def _pair(gate_up: list) -> Factors:
    """gate (and up) factors as one [R, in] / [out, R] pair; one part alone leaves the other zero."""
    if len(gate_up) == 1:
        return gate_up[0]
    g, u = gate_up
    rows = (g or u).b.shape[0]
    a = np.concatenate([f.a for f in (g, u) if f is not None])
    b = np.zeros((2 * rows, a.shape[0]), np.float32)
    if g is not None:
        b[:rows, : g.rank] = g.b
    if u is not None:
        b[rows:, a.shape[0] - u.rank :] = u.b
    return Factors(a, b)


class LoraSlots:
    """``max_loras`` adapter slots on this rank, as per-target stacks zero-padded to the rank limit:
    a [S, R, in] / b [S, R, out], B transposed (experts: [S, El, R, in] / [S, El, R, out]), made on
    first use; a pass reads only the rank prefix its loaded adapters use.
    Which adapter a slot holds is rank 0's choice, mirrored through LORA_LOAD / LORA_UNLOAD."""

    def __init__(
        self,
        ops,
        cfg: ModelConfig,
        max_loras: int,
        max_rank: int,
        expert_start: int,
        expert_end: int,
        routed_experts: bool = True,
    ):
        """``routed_experts`` False: this rank's experts sit on EPLB's physical slots, which expert
        LoRA does not follow, so an adapter on the routed experts is refused at load."""
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and {max_rank}")
        self.ops, self.cfg = ops, cfg
        self.max_loras, self.max_rank = max_loras, max_rank
        self.expert_start, self.expert_end = expert_start, expert_end
        self.routed_experts = routed_experts
        self.ids = [-1] * max_loras  # adapter id held by each slot (-1: empty)
        self.paths = [""] * max_loras
        self._stacks: dict = {}  # (layer, target) -> (a, b) backend arrays
        self._held: dict = {}  # (layer, target) -> set of slots with factors there
        self._ranks: dict = {}  # (layer, target) -> {slot: rank}
        self._used: dict = {}  # (layer, target) -> (a, b) views of the used rank prefix, or None

    def slot_of(self, adapter_id: int) -> int | None:
        return self.ids.index(adapter_id) if adapter_id in self.ids else None

    def read(self, path: str) -> LoraAdapter:
        """The adapter at ``path`` for this rank's experts (checked: LoraError)."""
        adapter = load_lora(path, self.cfg, self.expert_start, self.expert_end, self.max_rank)
        from eprt.ops.base import Ops

        experts = any(t in EXPERT_TARGETS for _, t in adapter.targets)
        if experts and self.cfg.swiglu is not None:
            raise LoraError(
                f"LoRA adapter {path!r} targets the routed experts of {self.cfg.model_type}, whose experts (biases, "
                "the clamped SwiGLU, MXFP4) take no LoRA deltas yet: use an adapter of the attention projections"
            )
        if experts and not self.routed_experts:
            raise LoraError(
                f"LoRA adapter {path!r} targets the routed experts, which EPLB places on physical slots "
                "(--num-redundant-experts / --enable-eplb): not supported together"
            )
        for op, needed in (("lora_apply", True), ("moe_experts_lora", experts)):
            if needed and getattr(type(self.ops), op) is getattr(Ops, op):
                raise LoraError(f"LoRA adapter {path!r}: the {self.ops.name} backend has no {op}")
        return adapter

    def load(self, slot: int, adapter_id: int, adapter: LoraAdapter) -> None:
        """Put ``adapter`` into ``slot`` (replacing whatever it held)."""
        self.unload(slot)
        for key, f in adapter.targets.items():
            a, b = self._stack(key, f)
            a[slot, ..., : f.rank, :] = self.ops.xp.asarray(f.a)
            b[slot, ..., : f.rank, :] = self.ops.xp.asarray(np.swapaxes(f.b, -1, -2))
            self._held.setdefault(key, set()).add(slot)
            self._ranks.setdefault(key, {})[slot] = f.rank
            self._use(key)
        self.ids[slot], self.paths[slot] = adapter_id, adapter.path

    def unload(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot {slot} out of range [0, {self.max_loras})")
        for key, held in self._held.items():
            if slot in held:
                a, b = self._stacks[key]
                a[slot] = 0
                b[slot] = 0
                held.discard(slot)
                del self._ranks[key][slot]
                self._use(key)
        self.ids[slot], self.paths[slot] = -1, ""

    def _use(self, key: tuple) -> None:
        """The views a pass reads: the rank prefix the loaded adapters use (None when none holds the target)."""
        rank = max(self._ranks[key].values(), default=0)
        a, b = self._stacks[key]
        self._used[key] = (a[..., :rank, :], b[..., :rank, :]) if rank else None

    def _stack(self, key: tuple, f: Factors):
        if key not in self._stacks:
            S, R = self.max_loras, self.max_rank * (2 if key[1] in GATE_UP_TARGETS else 1)
            lead = f.a.shape[:-2]  # () or (El,)
            a = self.ops.zeros((S, *lead, R, f.a.shape[-1]), "f32")
            b = self.ops.zeros((S, *lead, R, f.b.shape[-2]), "f32")
            self._stacks[key] = (a, b)
        return self._stacks[key]

    def rows(self, adapter_ids) -> object:
        """The rows' LoraRows (``eprt.ops.lora_ops``) for their adapter ids, or None when none has one."""
        from eprt.ops.lora_ops import LoraRows

        ids = np.asarray(adapter_ids, dtype=np.int64)
        if not (ids >= 0).any():
            return None
        lookup = {a: s for s, a in enumerate(self.ids) if a >= 0}
        slots = np.fromiter((lookup.get(int(a), -1) if a >= 0 else -1 for a in ids), np.int32, len(ids))
        missing = [int(a) for a, s in zip(ids, slots) if a >= 0 and s < 0]
        if missing:
            raise ValueError(f"adapter {missing[0]} is in no LoRA slot on this rank (slots hold {self.ids})")
        return LoraRows.group(slots, self.ops.index)

    def apply(self, y, x, rows, layer: int, target: str):
        """y[T, N] plus the LoRA delta of every row's adapter for this layer's ``target``."""
        used = self._used.get((layer, target))
        return y if used is None else self.ops.lora_apply(y, x, used[0], used[1], rows)

    def experts(self, layer: int) -> tuple:
        """(gate_up, down) expert stacks of the layer, each (a, b) or None."""
        return tuple(self._used.get((layer, t)) for t in EXPERT_TARGETS)
