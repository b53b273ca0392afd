"""Expert-parallel load balancing (EPLB): logical experts on physical slots, the contiguous and the
balanced (DeepSeek EPLB) placement policies, the deterministic token-to-replica choice and the MoE
layer whose result does not depend on the placement (docs/eplb.md).

L layers, E logical experts, P physical slots (E + redundant), W ranks, T tokens, k choices, D hidden.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

POLICIES = ("contiguous", "global", "hierarchical")


def slot_ranges(num_slots: int, world: int) -> list[tuple[int, int]]:
    """Each rank's contiguous physical slots [start, end): the first ``num_slots % world`` ranks get one extra."""
    base, extra = divmod(num_slots, world)
    starts = [r * base + min(r, extra) for r in range(world + 1)]
    return [(starts[r], starts[r + 1]) for r in range(world)]


@dataclass(frozen=True)
class Placement:
    """Which logical expert each physical slot holds, per layer; rank r holds the slots slot_ranges(P, W)[r]."""

    table: np.ndarray  # [L, P] int32 logical expert of each physical slot
    num_experts: int
    world: int

    def __post_init__(self) -> None:
        t = self.table
        if t.ndim != 2 or t.shape[1] < max(self.num_experts, self.world):
            raise ValueError(
                f"placement table of shape {list(t.shape)}: needs [layers, slots] with at least "
                f"{max(self.num_experts, self.world)} slots (experts {self.num_experts}, ranks {self.world})"
            )
        if t.size and (t.min() < 0 or t.max() >= self.num_experts):
            raise ValueError(
                f"placement names expert {int(t.min() if t.min() < 0 else t.max())}: outside [0, {self.num_experts})"
            )
        held = np.zeros((t.shape[0], self.num_experts), bool)
        held[np.arange(t.shape[0])[:, None], t] = True
        if not held.all():
            layer, expert = (int(v[0]) for v in np.nonzero(~held))
            raise ValueError(f"placement leaves expert {expert} of layer {layer} on no slot")

    @property
    def num_slots(self) -> int:
        return self.table.shape[1]

    def rank_range(self, rank: int) -> tuple[int, int]:
        return slot_ranges(self.num_slots, self.world)[rank]

    @cached_property
    def slot_rank(self) -> np.ndarray:
        """[P] the rank holding each slot."""
        return np.repeat(np.arange(self.world), [b - a for a, b in slot_ranges(self.num_slots, self.world)])

    def local_experts(self, rank: int) -> np.ndarray:
        """[L, S] logical experts of ``rank``'s slots, per layer."""
        return self.table[:, slice(*self.rank_range(rank))]

    def replica_counts(self) -> np.ndarray:
        """[L, E] slots holding each logical expert."""
        out = np.zeros((self.table.shape[0], self.num_experts), np.int64)
        np.add.at(out, (np.arange(self.table.shape[0])[:, None], self.table), 1)
        return out

    def rank_tokens(self, counts: np.ndarray) -> np.ndarray:
        """[L, W] tokens each rank computes for expert counts [L, E], each expert's tokens spread evenly
        over its replicas (the balancing model of DeepSeek's EPLB)."""
        per_slot = np.asarray(counts, np.float64)[np.arange(self.table.shape[0])[:, None], self.table]  # [L, P]
        per_slot /= self.replica_counts()[np.arange(self.table.shape[0])[:, None], self.table]
        return np.stack([per_slot[:, a:b].sum(axis=1) for a, b in slot_ranges(self.num_slots, self.world)], axis=1)

    def digest(self) -> str:
        """A short hash every rank compares: they must hold the same placement."""
        return hashlib.blake2b(np.ascontiguousarray(self.table, np.int32).tobytes(), digest_size=8).hexdigest()


def imbalance_ratio(rank_tokens: np.ndarray) -> np.ndarray:
    """(max - mean) / mean tokens per rank, per layer [L] (0: even, and for a layer that routed nothing)."""
    t = np.asarray(rank_tokens, np.float64)
    mean = t.mean(axis=1)
    return np.divide(t.max(axis=1) - mean, mean, out=np.zeros_like(mean), where=mean > 0)


# ---- policies -------------------------------------------------------------------------------
def contiguous(num_layers: int, num_experts: int, num_slots: int, world: int) -> Placement:
    """Today's placement: experts 0..E-1 in slot order, then the redundant slots repeat experts 0, 1, ..."""
    row = np.arange(num_slots, dtype=np.int32) % num_experts
    return Placement(np.tile(row, (num_layers, 1)), num_experts, world)


def balanced_packing(weight: np.ndarray, capacities: Sequence[int]) -> np.ndarray:
    """Pack the n items of each row of weight [X, n] into len(capacities) packs of exactly those many
    items, heaviest first into the lightest pack with room (ties: the lower pack). Returns the pack of
    each item [X, n]."""
    X, n = weight.shape
    if sum(capacities) != n:
        raise ValueError(f"{n} items do not fill packs of {list(capacities)}")
    pack = np.zeros((X, n), np.int64)
    for x in range(X):
        loads, room = np.zeros(len(capacities)), np.asarray(capacities, np.int64).copy()
        for item in np.argsort(-weight[x], kind="stable"):
            p = int(np.argmin(np.where(room > 0, loads, np.inf)))
            pack[x, item], loads[p], room[p] = p, loads[p] + weight[x, item], room[p] - 1
    return pack


def replicate_experts(weight: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """One slot per expert, then each extra slot to the expert with the most tokens per replica
    (ties: the lower expert). weight [X, n] -> (slot's expert [X, num_slots], replicas per expert [X, n])."""
    X, n = weight.shape
    slot_expert = np.zeros((X, num_slots), np.int64)
    slot_expert[:, :n] = np.arange(n)
    count = np.ones((X, n), np.int64)
    for s in range(n, num_slots):
        best = np.argmax(weight / count, axis=1)  # [X]
        slot_expert[:, s] = best
        count[np.arange(X), best] += 1
    return slot_expert, count


def _pack_slots(weight: np.ndarray, slot_expert: np.ndarray, count: np.ndarray, capacities: Sequence[int]):
    """Order slots [X, S] (each holding slot_expert) by the pack balanced_packing puts them in."""
    per_slot = np.take_along_axis(weight / count, slot_expert, axis=1)  # [X, S] tokens per replica
    pack = balanced_packing(per_slot, capacities)
    order = np.lexsort((np.arange(pack.shape[1])[None, :].repeat(len(pack), 0), pack), axis=1)  # by pack, stable
    return np.take_along_axis(slot_expert, order, axis=1)


def balanced(counts: np.ndarray, num_slots: int, world: int, groups: int = 1, nodes: int = 1) -> Placement:
    """DeepSeek's EPLB from expert loads counts [L, E]: hierarchical with ``groups`` expert groups over
    ``nodes`` nodes (groups packed onto nodes, replicas made within each node, then packed onto its
    ranks), global with groups = nodes = 1 (replicas over the whole job, packed onto every rank)."""
    weight = np.asarray(counts, np.float64)
    L, E = weight.shape
    if E % groups or groups % nodes or world % nodes or num_slots % nodes:
        raise ValueError(
            f"hierarchical placement needs experts ({E}) divisible by groups ({groups}), groups by nodes "
            f"({nodes}), and ranks ({world}) and slots ({num_slots}) divisible by nodes"
        )
    group_size, node_experts, node_slots, node_ranks = E // groups, E // nodes, num_slots // nodes, world // nodes
    if node_slots < node_experts:
        raise ValueError(f"{num_slots} slots cannot hold {E} experts")
    # 1: groups onto nodes; node-major logical order mlog -> expert
    group_load = weight.reshape(L, groups, group_size).sum(axis=2)
    group_node = balanced_packing(group_load, [groups // nodes] * nodes)  # [L, groups]
    group_order = np.lexsort((np.arange(groups)[None, :].repeat(L, 0), group_node), axis=1)  # [L, groups]
    node_expert = (group_order[:, :, None] * group_size + np.arange(group_size)).reshape(L, E)  # [L, E]
    # 2: replicas within each node; 3: the node's slots onto its ranks
    capacities = [b - a for a, b in slot_ranges(node_slots, node_ranks)]
    table = np.zeros((L, num_slots), np.int32)
    for node in range(nodes):
        experts = node_expert[:, node * node_experts : (node + 1) * node_experts]  # [L, node_experts]
        w = np.take_along_axis(weight, experts, axis=1)
        slot_local, count = replicate_experts(w, node_slots)
        ordered = _pack_slots(w, slot_local, count, capacities)  # [L, node_slots] local expert index
        table[:, node * node_slots : (node + 1) * node_slots] = np.take_along_axis(experts, ordered, axis=1)
    return Placement(table, E, world)


def choose_policy(policy: str, groups: int, nodes: int, world: int, num_experts: int, num_slots: int) -> str:
    """``auto``: hierarchical when experts come in groups and the job spans nodes (and they divide
    evenly), global otherwise; any other policy as given."""
    if policy != "auto":
        return policy
    divides = groups > 1 and nodes > 1 and not (num_experts % groups or groups % nodes or world % nodes)
    return "hierarchical" if divides and num_slots % nodes == 0 else "global"


def make_placement(
    policy: str,
    counts: np.ndarray | None,
    num_layers: int,
    num_experts: int,
    num_slots: int,
    world: int,
    groups: int = 1,
    nodes: int = 1,
) -> Placement:
    """The placement a policy gives for load estimate ``counts`` [L, E] (None: contiguous)."""
    if policy == "contiguous" or counts is None:
        return contiguous(num_layers, num_experts, num_slots, world)
    if counts.shape != (num_layers, num_experts):
        raise ValueError(
            f"expert-load counts of shape {list(counts.shape)}, the model has [{num_layers}, {num_experts}]"
        )
    if policy == "hierarchical":
        return balanced(counts, num_slots, world, groups, nodes)
    if policy == "global":
        return balanced(counts, num_slots, world)
    raise ValueError(f"EPLB policy must be one of auto, {', '.join(POLICIES)}; got {policy!r}")


# ---- the forward pass ----------------------------------------------------------------------------
def choose_slots(placement: Placement, replicas: np.ndarray, layer: int, ids: np.ndarray, min_rows: int) -> np.ndarray:
    """Physical slot of every (token, choice) of ids [T, k] (logical experts), the same on every rank
    (only the ids decide). Experts with one slot load their ranks first; then each replicated expert,
    most rows first (ties: the lower expert), goes in u contiguous parts (row order) to u of its
    replicas, each part to the replica whose rank has the fewest rows so far (ties: the lower replica),
    u = min(replicas, n // min_rows, ceil(n / mean rows per rank)), at least 1: an expert is split only
    when it holds more than a rank's share, so each split costs one more read of its matrices, and only
    into parts of at least ``min_rows`` rows (ops.moe_split_rows: a backend whose row bits depend on the
    group never splits), so every row gets the bits of one copy of the expert. replicas [L, E, M]: slots, -1 pads."""
    flat = ids.reshape(-1).astype(np.int64)  # [N = T*k]
    table = replicas[layer]  # [E, M]
    count = np.bincount(flat, minlength=placement.num_experts)  # [E] rows of each expert
    held = (table >= 0).sum(axis=1)  # [E] replicas of each expert
    slot_rank, world = placement.slot_rank, placement.world  # [P] rank of each slot
    load = np.bincount(slot_rank[table[:, 0]], np.where(held == 1, count, 0), world).astype(np.int64).tolist()
    order = np.argsort(flat, kind="stable")  # [N] grouped by expert, rows in order
    first = np.concatenate([[0], np.cumsum(count)]).tolist()  # [E+1] where each expert's group begins in order
    chosen = table[flat[order], 0]  # [N] slot of each sorted entry: the first replica, refined below
    rows = count.tolist()
    for e in sorted(np.flatnonzero((held > 1) & (count > 0)).tolist(), key=lambda e: (-rows[e], e)):
        n, slots = rows[e], table[e, : held[e]].tolist()
        parts = max(1, min(len(slots), n // max(1, min_rows), -(-n * world // len(flat))))  # ceil(n / mean)
        free = list(range(len(slots)))
        for i in range(parts):
            j = min(free, key=lambda j: (load[slot_rank[slots[j]]], j))
            free.remove(j)
            lo, hi = first[e] + n * i // parts, first[e] + n * (i + 1) // parts
            chosen[lo:hi] = slots[j]
            load[slot_rank[slots[j]]] += hi - lo
    out = np.empty(len(flat), np.int32)
    out[order] = chosen
    return out.reshape(ids.shape)


def replica_table(placement: Placement) -> np.ndarray:
    """[L, E, M] physical slots of each logical expert, ascending, -1 padded (M: the most replicas)."""
    counts = placement.replica_counts()
    L, E = counts.shape
    out = np.full((L, E, int(counts.max())), -1, np.int32)
    for layer in range(L):
        order = np.argsort(placement.table[layer], kind="stable")
        experts = placement.table[layer][order]
        rank_in = np.arange(len(order)) - np.searchsorted(experts, experts, side="left")
        out[layer, experts, rank_in] = order
    return out


class ExpertSlots:
    """This rank's share of a placement in the forward pass, and the switch to a new one."""

    def __init__(self, placement: Placement, rank: int, read: Callable | None = None, gather: Callable | None = None):
        self.placement, self.rank = placement, rank
        self.read = read  # (layer, expert ids) -> (gate_up, down) from this rank's checkpoint files
        # (rows [n, D], counts [W]) -> every rank's rows in rank order [sum(counts), D] (the EPLB combine)
        self.gather = gather if gather is not None else lambda rows, counts: rows
        self.epoch = 0  # placements switched to so far
        self.replicas = replica_table(placement)
        self.start = placement.rank_range(rank)[0]

    def moe(self, ops, x, weights, ids, w_gate_up, w_down, layer: int):
        """The MoE layer's routed output [T, D], bit for bit what one rank holding every expert computes
        whatever the placement: every rank computes the (token, choice) rows its slots were chosen for,
        the ranks all-gather them (variable length, rank by rank), every rank puts each row back at its
        (token, choice) and adds a token's k rows in choice order, as ``moe_experts`` does."""
        T, k = ids.shape
        slots = self.choose(ops, ids, layer, w_gate_up)
        owner = self.placement.slot_rank[slots.reshape(-1)]  # [T*k] the rank computing each (token, choice)
        order = np.argsort(owner, kind="stable")  # [T*k] rank by rank, each in (token, choice) order
        counts = np.bincount(owner, minlength=self.placement.world)  # [W] rows each rank computes
        lo = int(counts[: self.rank].sum())
        picks = order[lo : lo + int(counts[self.rank])]  # [n] this rank's (token, choice) rows
        if len(picks):
            rows, chosen = ops.index(picks // k), ops.index(picks)
            mine_weights = ops.xp.ascontiguousarray(weights.reshape(T * k, 1)[chosen])  # [n, 1]
            mine_slots = ops.index(slots.reshape(-1)[picks].reshape(-1, 1))  # [n, 1]
            mine = ops.moe_experts(x[rows], mine_weights, mine_slots, w_gate_up, w_down, self.start)  # [n, D]
        else:
            mine = ops.xp.zeros((0, x.shape[1]), ops.xp.float32)  # [0, D]
        every = self.gather(mine, counts.tolist())  # [T*k, D] rank by rank
        every = every[ops.index(np.argsort(order))].reshape(T, k, -1)  # [T, k, D]
        out = every[:, 0]
        for j in range(1, k):
            out = out + every[:, j]
        return ops.xp.ascontiguousarray(out)  # [T, D]

    def choose(self, ops, ids, layer: int, w_gate_up) -> np.ndarray:
        """The physical slot [T, k] of every (token, choice) of ids [T, k], the same on every rank."""
        return choose_slots(
            self.placement, self.replicas, layer, np.asarray(ops.to_host(ids)), ops.moe_split_rows(w_gate_up)
        )

    def switch(self, ops, new: Placement, layers) -> int:
        """Hold ``new`` from the next forward pass: each sparse layer keeps the experts it already holds
        (copied on the device) and reads the others with ``self.read``. Returns how many experts were read."""
        if (new.num_slots, new.world, new.num_experts) != (
            self.placement.num_slots,
            self.placement.world,
            self.placement.num_experts,
        ) or new.table.shape != self.placement.table.shape:
            raise ValueError(
                f"new placement of shape {list(new.table.shape)} over {new.world} ranks; this job has "
                f"{list(self.placement.table.shape)} over {self.placement.world}"
            )
        old_local, new_local, fresh = self.placement.local_experts(self.rank), new.local_experts(self.rank), 0
        for i, lw in enumerate(layers):
            if lw.w_gate_up is None:
                continue
            (lw.w_gate_up, lw.w_down), n = _restack(ops, lw, old_local[i].tolist(), new_local[i].tolist(), i, self.read)
            fresh += n
        self.placement, self.replicas = new, replica_table(new)
        self.start = new.rank_range(self.rank)[0]
        return fresh


def switch_model_placement(model, epoch: int, table: np.ndarray) -> int:
    """Switch ``model`` (a MoEModel under EPLB) to placement ``table`` [L, P], the ``epoch``-th switch."""
    slots = model.slots
    if slots is None:
        raise ValueError("EPLB_PLACEMENT but this job runs without EPLB (start it with --enable-eplb)")
    if epoch != slots.epoch + 1:
        raise ValueError(f"EPLB_PLACEMENT epoch {epoch} after epoch {slots.epoch} (must be {slots.epoch + 1})")
    now = slots.placement
    fresh = slots.switch(model.ops, Placement(np.asarray(table, np.int32), now.num_experts, now.world), model.w.layers)
    slots.epoch = epoch
    return fresh


def _restack(ops, lw, old: list, want: list, layer: int, read: Callable) -> tuple[tuple, int]:
    """(gate_up, down) holding experts ``want`` in slot order, and how many were read: rows of experts
    in ``old`` are gathered from the current arrays (FP8 blocks, which cannot be, are read again)."""
    if not hasattr(lw.w_gate_up, "ndim") or old == want:
        return ((lw.w_gate_up, lw.w_down), 0) if old == want else (read(layer, want), len(want))
    missing = [e for e in dict.fromkeys(want) if e not in old]
    source = [old.index(e) if e in old else len(old) + missing.index(e) for e in want]
    gate_up, down = lw.w_gate_up, lw.w_down
    if missing:
        new_gate_up, new_down = read(layer, missing)
        gate_up, down = ops.xp.concatenate([gate_up, new_gate_up]), ops.xp.concatenate([down, new_down])
    return ops.take_experts(gate_up, down, source), len(missing)
