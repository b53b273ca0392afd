"""Per-sequence recurrent state of a hybrid model's linear-attention layers, in fixed slots beside
the paged KV: per linear layer ``conv[S, K-1, C]`` and ``delta[S, Hv, dk, dv]`` (float32), one row
per sequence slot, and as many snapshot rows of the same shapes (states saved at block boundaries
for the prefix cache). The executor zeroes a slot's rows when a sequence takes it (or restores a
snapshot), moves them on COMPACT; a re-prefill after preemption rebuilds them (docs/hybrid.md).
"""

from __future__ import annotations

from eprt.model.config import ModelConfig

STATE_ITEMSIZE = 4  # float32 on every backend: the recurrence accumulates over the whole sequence


class RecurrentState:
    def __init__(self, ops, cfg: ModelConfig, max_slots: int, snapshot_rows: int = 0):
        if cfg.linear_attention is None:
            raise ValueError(f"model_type {cfg.model_type!r} has no linear-attention layers to keep state for")
        if max_slots < 1:
            raise ValueError(f"recurrent state needs max_slots >= 1, got {max_slots}")
        la, self.ops, self.max_slots = cfg.linear_attention, ops, max_slots
        linear = [cfg.is_linear_layer(i) for i in range(cfg.num_layers)]
        conv_shape = (max_slots, la.conv_kernel - 1, la.conv_dim)
        delta_shape = (max_slots, la.num_value_heads, la.key_head_dim, la.value_head_dim)
        self.conv = [ops.zeros(conv_shape, "f32") if is_linear else None for is_linear in linear]
        self.delta = [ops.zeros(delta_shape, "f32") if is_linear else None for is_linear in linear]
        self.snapshot_rows = snapshot_rows
        snap = lambda shape: ops.zeros((snapshot_rows, *shape[1:]), "f32")  # noqa: E731
        self.conv_snapshots = [snap(conv_shape) if is_linear else None for is_linear in linear]
        self.delta_snapshots = [snap(delta_shape) if is_linear else None for is_linear in linear]

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig) -> int:
        """What one sequence's state takes over all linear layers."""
        return cfg.recurrent_state_values() * STATE_ITEMSIZE

    def _arrays(self):
        return [a for a in (*self.conv, *self.delta) if a is not None]

    def reset(self, slot: int) -> None:
        """Zero the slot's rows: a sequence starts from no history."""
        for a in self._arrays():
            a[slot] = 0

    def _pairs(self):
        """(live array, snapshot array) of every linear layer."""
        live, snaps = (*self.conv, *self.delta), (*self.conv_snapshots, *self.delta_snapshots)
        return [(a, s) for a, s in zip(live, snaps) if a is not None]

    def save(self, slot: int, row: int) -> None:
        """Copy the slot's state into snapshot ``row``."""
        for live, snapshot in self._pairs():
            snapshot[row] = live[slot]

    def restore(self, row: int, slot: int) -> None:
        """Start the slot from snapshot ``row`` (a prefix-cache hit)."""
        for live, snapshot in self._pairs():
            live[slot] = snapshot[row]

    def move(self, slot: int, new_slot: int) -> None:
        """Copy the slot's rows to ``new_slot`` (COMPACT); the old rows are left as they are."""
        for a in self._arrays():
            a[new_slot] = a[slot]
