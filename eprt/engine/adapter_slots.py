"""The runner's LoRA slot moves on rank 0: each runs on rank 0's executor and queues the frame
that makes every worker do the same (LORA_LOAD, LORA_UNLOAD; docs/protocol.md, docs/lora.md)."""

from __future__ import annotations

from eprt.comm import protocol as P


def _in_use(runner) -> set:
    """Adapter ids of the sequences in the slot table (running or being prefilled)."""
    slots = runner.executor.slots
    return {slots.get(i).adapter for i in slots.occupied()}


def can_place(runner, adapter_id: int) -> bool:
    return runner.adapters is not None and runner.adapters.would_fit(adapter_id, _in_use(runner))


def acquire(runner, adapter_id: int) -> int:
    """The LoRA slot holding ``adapter_id``, loading it (evicting the LRU unused adapter) if needed."""
    registry = runner.adapters
    placed = registry.slot_for(adapter_id, _in_use(runner) - {adapter_id})
    if placed is None:
        raise RuntimeError(f"adapter {adapter_id}: every LoRA slot is in use (can_admit should have said so)")
    slot, load = placed
    if load:
        path = registry.path_of(adapter_id)
        runner.executor.load_adapter(slot, adapter_id, path)
        runner.transport.send(P.LoraLoad(slot, adapter_id, path))
    registry.placed(slot, adapter_id)
    return slot


def unload_orphans(runner) -> None:
    """Empty the LoRA slots of adapters unregistered since the last planning step."""
    for slot in runner.adapters.orphans():
        runner.executor.unload_adapter(slot)
        runner.transport.send(P.LoraUnload(slot))
        runner.adapters.placed(slot, -1)
