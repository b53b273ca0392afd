"""Expert-parallel load balancing on rank 0 (docs/eplb.md): the start-up placement, rebalancing while
serving from a window of measured expert load, and the rank-imbalance figures of the log line and
/metrics. Every rank builds the same start-up placement; a live one goes out as EPLB_PLACEMENT.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import numpy as np

from eprt.engine.config import EplbConfig
from eprt.engine.expert_load import read_stats
from eprt.model.config import ModelConfig
from eprt.model.placement import Placement, choose_policy, contiguous, imbalance_ratio, make_placement

log = logging.getLogger("eprt.engine")


def count_nodes(transport, eplb: EplbConfig) -> int:
    """Nodes of the job for the hierarchical policy: ``--eplb-nodes``, else the distinct host names.
    Rank 0 logs when its node's ranks outnumber the cores it may run on (docs/eplb.md, "Measured")."""
    hosts = transport.allgather_text(socket.gethostname())
    ranks, cores = hosts.count(hosts[0]), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    if transport.rank == 0 and cores and ranks > cores:
        log.info(
            "EPLB: %d ranks share this node's %d CPU cores: on the CPU a step then follows the ranks' total "
            "work, which balancing does not reduce",
            ranks,
            cores,
        )
    return eplb.nodes or len(set(hosts))


def num_slots(eplb: EplbConfig, model_cfg: ModelConfig) -> int:
    return model_cfg.num_experts + eplb.num_redundant_experts


def policy_for(eplb: EplbConfig, model_cfg: ModelConfig, world: int, nodes: int) -> str:
    groups = model_cfg.routing.n_group if model_cfg.routing is not None else 1
    return choose_policy(eplb.policy, groups, nodes, world, model_cfg.num_experts, num_slots(eplb, model_cfg))


def _make(eplb: EplbConfig, model_cfg: ModelConfig, counts, world: int, nodes: int) -> Placement:
    groups = model_cfg.routing.n_group if model_cfg.routing is not None else 1
    policy = policy_for(eplb, model_cfg, world, nodes)
    L, E = model_cfg.num_layers, model_cfg.num_experts
    return make_placement(policy, counts, L, E, num_slots(eplb, model_cfg), world, groups, nodes)


def initial_placement(eplb: EplbConfig, model_cfg: ModelConfig, world: int, nodes: int) -> Placement | None:
    """The start-up placement (None without EPLB): balanced from ``--init-expert-placement``, else contiguous."""
    if not eplb.active:
        return None
    if world > num_slots(eplb, model_cfg):
        raise ValueError(f"{world} ranks but only {num_slots(eplb, model_cfg)} expert slots: add redundant experts")
    counts = None
    if eplb.init_expert_placement:
        counts, _, _ = read_stats(eplb.init_expert_placement)
        want = (model_cfg.num_layers, model_cfg.num_experts)
        if counts.shape != want:
            raise ValueError(
                f"--init-expert-placement {eplb.init_expert_placement}: counts of shape {list(counts.shape)}, "
                f"this model has [{want[0]}, {want[1]}] (layers, experts)"
            )
    return _make(eplb, model_cfg, counts, world, nodes)


def check_same_placement(transport, placement: Placement) -> None:
    """Every rank must have built the same placement (same file, same code): compared by hash."""
    every = transport.allgather_text(placement.digest())
    if len(set(every)) > 1:
        raise ValueError(f"the ranks built different expert placements (hashes {every}): give every rank the same file")


def rank_imbalance(placement: Placement, counts: np.ndarray, sparse: list) -> np.ndarray:
    """(max - mean) / mean tokens per rank of each MoE layer [L_moe] for expert counts [L, E]."""
    return imbalance_ratio(placement.rank_tokens(counts))[sparse]


class Rebalancer:
    """Rank 0's EPLB loop: every ``interval`` steps the counts of the last ``window`` steps pick a new
    placement, sent to every rank through ``runner.switch_placement``."""

    def __init__(self, runner, eplb: EplbConfig, model_cfg: ModelConfig, world: int, nodes: int):
        self.runner, self.eplb, self.model_cfg, self.world, self.nodes = runner, eplb, model_cfg, world, nodes
        self.model = runner.executor.model
        self.sparse = [i for i, s in enumerate(model_cfg.sparse_layers) if s]
        self.window = eplb.window or eplb.interval
        self.steps = 0
        self.rebalances = 0
        self.experts_read = 0
        self._marks: dict[int, np.ndarray] = {0: self._counts()}  # step -> cumulative counts then
        self._since = self._marks[0]  # cumulative counts when the current placement took effect
        self.last: tuple[np.ndarray, np.ndarray] | None = None  # the last rebalance's (before, after) [L_moe]

    def _counts(self) -> np.ndarray:
        return self.model.expert_load()

    @property
    def placement(self) -> Placement:
        return self.model.slots.placement

    def after_step(self) -> None:
        """Count a step; take the window's first counts and rebalance when due."""
        self.steps += 1
        interval = self.eplb.interval
        if interval <= 0:
            return
        if (self.steps + self.window) % interval == 0:
            self._marks[self.steps] = self._counts()
        if self.steps % interval == 0:
            start = max((s for s in self._marks if s <= self.steps - self.window), default=min(self._marks))
            now = self._counts()
            self.rebalance(now - self._marks[start], now)
            self._marks = {s: c for s, c in self._marks.items() if s > self.steps - self.window}

    def rebalance(self, window: np.ndarray, now: np.ndarray | None = None) -> bool:
        """Switch every rank to the placement the policy gives for ``window`` [L, E], in the layers where it
        beats the current one on that load; False when no layer does."""
        if window.sum() == 0:
            return False
        now_placed = self.placement
        proposed = _make(self.eplb, self.model_cfg, window, self.world, self.nodes)
        better = imbalance_ratio(proposed.rank_tokens(window)) < imbalance_ratio(now_placed.rank_tokens(window)) - 1e-9
        new = Placement(np.where(better[:, None], proposed.table, now_placed.table), now_placed.num_experts, self.world)
        if np.array_equal(new.table, now_placed.table):
            return False  # no layer improves on the window's load
        before = rank_imbalance(now_placed, window, self.sparse)
        after = rank_imbalance(new, window, self.sparse)
        t0 = time.perf_counter()
        read = self.runner.switch_placement(self.model.slots.epoch + 1, new.table)
        self.rebalances += 1
        self.experts_read += read
        self.last = (before, after)
        self._since = self._counts() if now is None else now
        log.info(
            "EPLB epoch %d: rank imbalance over the last %d steps %.3f -> %.3f (worst layer), rank 0 read %d "
            "experts in %.1f ms",
            self.model.slots.epoch,
            self.window,
            before.max(initial=0.0),
            after.max(initial=0.0),
            read,
            1e3 * (time.perf_counter() - t0),
        )
        return True

    def figures(self, counts: np.ndarray) -> dict:
        """Per MoE layer: rank imbalance of counts [L, E] since the current placement took effect, as the
        contiguous placement without redundant slots would have it and as the current one has it."""
        since = np.maximum(np.asarray(counts) - self._since, 0)  # counts may be older than the switch
        E = self.model_cfg.num_experts
        plain = contiguous(self.model_cfg.num_layers, E, E, self.world)  # eprt without EPLB
        return {
            "epoch": self.model.slots.epoch,
            "layers": self.sparse,
            "contiguous": rank_imbalance(plain, since, self.sparse),
            "eplb": rank_imbalance(self.placement, since, self.sparse),
        }

    def summary(self, counts: np.ndarray) -> str:
        f = self.figures(counts)
        return (
            f"EPLB epoch {self.model.slots.epoch}: rank imbalance contiguous {_layers(f['contiguous'])} "
            f"-> placed {_layers(f['eplb'])}"
        )


def _layers(values: np.ndarray) -> str:
    return "/".join(f"{v:.2f}" for v in values) if len(values) <= 8 else f"max {values.max():.2f}"
