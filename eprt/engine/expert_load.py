"""Expert-load statistics: tokens routed to each expert per layer, what they say about balance,
and the file ``eprt run --stats-out`` writes and ``eprt stats`` reads (docs/observability.md)."""

from __future__ import annotations

import json

import numpy as np

from eprt.model.loader import expert_shard


def imbalance(counts: np.ndarray) -> np.ndarray:
    """Max over mean tokens per expert, per layer [L] (1.0: even; 0 for a layer that routed nothing)."""
    counts = np.asarray(counts, np.float64)  # [L, E]
    mean = counts.mean(axis=1)
    return np.divide(counts.max(axis=1), mean, out=np.zeros_like(mean), where=mean > 0)


def rank_load(counts: np.ndarray, world: int) -> np.ndarray:
    """Tokens each rank's experts received, summed over layers [world] (contiguous expert shards)."""
    per_expert = np.asarray(counts).sum(axis=0)  # [E]
    return np.array([per_expert[slice(*expert_shard(len(per_expert), r, world))].sum() for r in range(world)])


def write_stats(path: str, counts: np.ndarray, model: str, world: int) -> None:
    with open(path, "w") as f:
        json.dump({"model": model, "world": world, "counts": np.asarray(counts).tolist()}, f)


def read_stats(path: str) -> tuple[np.ndarray, str, int]:
    """(counts [L, E], model name, world size) of a ``--stats-out`` file; ValueError naming what is wrong."""
    try:
        with open(path) as f:
            data = json.load(f)
        counts = np.asarray(data["counts"], np.int64)
        model, world = str(data["model"]), int(data["world"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path} is not an eprt expert-load statistics file: {e}") from None
    if counts.ndim != 2 or counts.size == 0 or (counts < 0).any() or world < 1:
        raise ValueError(f"{path}: counts must be a non-empty [layers, experts] table of non-negative integers")
    return counts, model, world
