"""The runner's LoRA slot moves on rank 0, done while a step is planned: each runs on rank 0's
executor and returns the command that makes every worker do the same when the step's frames go
out (LORA_LOAD, LORA_UNLOAD; docs/protocol.md, docs/lora.md)."""

from __future__ import annotations

from eprt.comm import protocol as P


def _in_use(executor) -> set:
    """Adapter ids of the sequences in the slot table (running or being prefilled)."""
    slots = executor.slots
    return {slots.get(i).adapter for i in slots.occupied()}


def can_place(registry, executor, adapter_id: int) -> bool:
    return registry is not None and registry.would_fit(adapter_id, _in_use(executor))


def acquire(registry, executor, adapter_id: int) -> P.LoraLoad | None:
    """Put ``adapter_id`` into a LoRA slot (evicting the LRU unused adapter) if no slot holds it; the
    LORA_LOAD that does the same on every worker, or None when it was in a slot already."""
    placed = registry.slot_for(adapter_id, _in_use(executor) - {adapter_id})
    if placed is None:
        raise RuntimeError(f"adapter {adapter_id}: every LoRA slot is in use (can_admit should have said so)")
    slot, load = placed
    command = None
    if load:
        path = registry.path_of(adapter_id)
        executor.load_adapter(slot, adapter_id, path)
        command = P.LoraLoad(slot, adapter_id, path)
    registry.placed(slot, adapter_id)
    return command


def unload_orphans(registry, executor) -> list:
    """Empty the LoRA slots of adapters unregistered since the last planning step; their LORA_UNLOADs."""
    commands = []
    for slot in registry.orphans():
        executor.unload_adapter(slot)
        commands.append(P.LoraUnload(slot))
        registry.placed(slot, -1)
    return commands
