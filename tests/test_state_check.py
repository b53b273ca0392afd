"""--check-state's digests (eprt/engine/state_check.py): what they cover and how a drift is named.
The ranks comparing them under mpiexec: tests/mpi/test_engine_faults.py."""

import numpy as np

from eprt.cache.block_manager import BlockManager
from eprt.comm.slots import SlotTable
from eprt.engine.state_check import digest, drift_message


def test_digest_sees_order_values_and_types():
    assert digest((np.arange(4), 1)) == digest((np.arange(4), 1))
    assert digest((np.arange(4), 1)) != digest((np.arange(4)[::-1], 1))
    assert digest(np.arange(4, dtype=np.int64)) != digest(np.arange(4, dtype=np.int32))
    assert digest(((1, 2), 3)) != digest((1, (2, 3)))  # nesting is part of the hash
    assert digest(b"ab") != digest("ab")


def test_block_manager_state_changes_with_each_decision():
    def manager_after(steps):
        bm = BlockManager(8, 4)
        for step in steps:
            step(bm)
        return {name: digest(state) for name, state in bm.mirrored_state().items()}

    base = manager_after([lambda b: b.allocate(0, list(range(6)))])
    assert manager_after([lambda b: b.allocate(0, list(range(6)))]) == base
    grown = manager_after([lambda b: b.allocate(0, list(range(6))), lambda b: b.grow(0, 8)])
    assert grown["blocks"] != base["blocks"] and grown["prefix cache"] == base["prefix cache"]
    cached = manager_after([lambda b: b.allocate(0, list(range(6))), lambda b: b.cache(0, list(range(6)))])
    assert cached["prefix cache"] != base["prefix cache"]


def test_slot_table_state_holds_every_slot_field():
    a, b = SlotTable(4), SlotTable(4)
    for t in (a, b):
        t.occupy(1, (5, 6, 7), 0)
    assert digest(a.mirrored_state()) == digest(b.mirrored_state())
    b.get(1).tokens.append(9)
    assert digest(a.mirrored_state()) != digest(b.mirrored_state())


def test_drift_names_each_structure_and_groups_the_ranks():
    table = np.array([[1, 7, 3], [1, 8, 3], [1, 7, 4]], np.uint64)
    message = drift_message(12, ["blocks", "prefix cache", "slots"], table)
    assert message.startswith("the ranks' mirrored state differs after step 12: ")
    assert "prefix cache (ranks 0, 2 0000000000000007; rank 1 0000000000000008)" in message
    assert "slots (ranks 0-1 0000000000000003; rank 2 0000000000000004)" in message
    assert "blocks" not in message
    assert drift_message(1, ["blocks"], np.ones((3, 1), np.uint64)) is None
