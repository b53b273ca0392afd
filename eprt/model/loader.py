"""Open a checkpoint directory (or the built-in default model) as a ready ``MoEModel``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from eprt.model.config import ModelConfig, load_config
from eprt.model.moe_model import MoEModel
from eprt.model.placement import ExpertSlots, Placement
from eprt.model.safetensors_io import CheckpointError, SafetensorsCheckpoint
from eprt.model.tokenizer import load_tokenizer
from eprt.model.weights import load_expert_stack, load_mtp_weights, load_weights


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    model: MoEModel
    tokenizer: object  # eprt.model.tokenizer.Tokenizer or None
    tensors_read: int = 0
    bytes_read: int = 0


def _read_experts(model_dir: str | None, cfg: ModelConfig, ops, layer: int, ids) -> tuple:
    """An EPLB rebalance's read of experts ``ids`` of ``layer`` from this rank's checkpoint files."""
    source = _open_source(model_dir)
    try:
        return load_expert_stack(source, cfg, ops, layer, ids)
    finally:
        if hasattr(source, "close") and ops.name != "cpu":
            source.close()


class LanguageModelSource:
    """qwen3_vl_moe's tensors: its language model lives under ``model.language_model.``
    (``model.X`` is read from there); the vision tower, ``model.visual.``, is rank 0's (vision.py)."""

    def __init__(self, source):
        self.source = source

    @staticmethod
    def _name(name: str) -> str:
        return "model.language_model." + name[len("model.") :] if name.startswith("model.") else name

    def __contains__(self, name: str) -> bool:
        return self._name(name) in self.source

    def read(self, name: str):
        return self.source.read(self._name(name))

    def __getattr__(self, attr: str):  # tensors_read, bytes_read, close, ...
        return getattr(self.source, attr)


def expert_shard(num_experts: int, rank: int, world: int) -> tuple[int, int]:
    """Contiguous expert range of ``rank``: the first ``E % world`` ranks get one extra."""
    if world > num_experts:
        raise ValueError(
            f"{world} ranks but the model has only {num_experts} experts: run with at most {num_experts} ranks"
        )
    base, extra = divmod(num_experts, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _mtp_weights(source, cfg: ModelConfig, ops, weights, placement):
    """The MTP layer, or a start-up error naming the flag and what the checkpoint lacks."""
    if cfg.mtp_layers < 1:
        raise ValueError(
            f"--speculative-method mtp: this {cfg.model_type} checkpoint has no multi-token prediction layers "
            f"(config.json num_nextn_predict_layers is {cfg.mtp_layers}, needs >= 1)"
        )
    if placement is not None:
        raise ValueError("--speculative-method mtp with EPLB: the MTP layer's experts have no EPLB placement")
    try:
        return load_mtp_weights(source, cfg, ops, weights)
    except CheckpointError as e:
        raise CheckpointError(
            f"--speculative-method mtp: config.json num_nextn_predict_layers is {cfg.mtp_layers}, "
            f"but the MTP layer model.layers.{cfg.num_layers} is not in the checkpoint: {e}"
        ) from e


def _open_source(model_dir: str | None):
    if model_dir is None:
        from eprt.model.default import default_checkpoint

        return default_checkpoint()[1]
    return SafetensorsCheckpoint(model_dir)


def load_model(
    model_dir: str | None,
    ops,
    max_len: int | None,
    rank: int = 0,
    world: int = 1,
    combine: Callable = lambda p: p,
    placement_for: Callable[[ModelConfig], Placement | None] = lambda cfg: None,
    gather_rows: Callable | None = None,
    mtp: bool = False,
) -> LoadedModel:
    """Load config, tokenizer and this rank's weights. ``model_dir=None`` is the default model.
    ``placement_for(config)``: an EPLB placement of the experts on physical slots, or None (contiguous);
    ``gather_rows(rows, counts)``: EPLB's combine, every rank's rows in rank order (one rank: rows);
    ``mtp``: also the first multi-token prediction layer (``--speculative-method mtp``)."""
    if model_dir is None:
        from eprt.model.default import default_checkpoint

        cfg, source, tokenizer, name = default_checkpoint()
    else:
        cfg = load_config(model_dir)
        source = SafetensorsCheckpoint(model_dir)
        if cfg.model_type == "qwen3_vl_moe":
            source = LanguageModelSource(source)
        tokenizer = load_tokenizer(model_dir, cfg)
        name = model_dir.rstrip("/").split("/")[-1]
    placement = placement_for(cfg)
    if placement is not None and cfg.swiglu is not None:
        raise ValueError(
            f"EPLB (--num-redundant-experts, --init-expert-placement, --enable-eplb) is not supported for "
            f"{cfg.model_type} yet: its experts run without EPLB's physical slots"
        )
    start, end = expert_shard(cfg.num_experts, rank, world) if placement is None else (0, 0)
    local = None if placement is None else placement.local_experts(rank)
    weights = load_weights(source, cfg, ops, start, end, local_experts=local)
    if mtp:
        weights.mtp = _mtp_weights(source, cfg, ops, weights, placement)
    max_len = cfg.max_position_embeddings if max_len is None else min(max_len, cfg.max_position_embeddings)
    model = MoEModel(cfg, weights, ops, max_len=max_len, combine=combine)
    if placement is not None:  # expert_start/end: this rank's physical slots
        weights.expert_start, weights.expert_end = placement.rank_range(rank)
        read = lambda layer, ids: _read_experts(model_dir, cfg, ops, layer, ids)  # noqa: E731
        model.slots = ExpertSlots(placement, rank, read, gather_rows)
    loaded = LoadedModel(
        name, cfg, model, tokenizer, getattr(source, "tensors_read", 0), getattr(source, "bytes_read", 0)
    )
    if hasattr(source, "close") and ops.name != "cpu":
        source.close()  # device copies made; the CPU backend may still view the mapped file
    return loaded
