"""The runner's adapters (a part of the runner, ``Accounts.adapters``): which LoRA slot holds each
adapter on every rank. Rank 0 decides while a step is planned, runs each move on its own executor
and returns the commands that make every worker do the same when the step's frames go out
(LORA_LOAD, LORA_UNLOAD, SLOT_ADAPTER; docs/protocol.md, docs/lora.md)."""

from __future__ import annotations

from eprt.comm import protocol as P


def _in_use(executor) -> set:
    """Adapter ids of the sequences in the slot table (running or being prefilled)."""
    slots = executor.slots
    return {slots.get(i).adapter for i in slots.occupied()}


class LoraAdapters:
    """Adapters in LoRA slots: ``registry`` (eprt/engine/adapters.py) names them and picks the slots."""

    def __init__(self, registry):
        self.registry = registry

    def can_place(self, executor, adapter_id: int) -> bool:
        return self.registry.would_fit(adapter_id, _in_use(executor))

    def admit(self, executor, slot: int, adapter_id: int) -> list:
        """Put ``adapter_id`` into a LoRA slot (evicting the LRU unused adapter) if no slot holds it;
        the commands ahead of the PREFILL into ``slot``: LORA_LOAD when it was loaded, SLOT_ADAPTER."""
        placed = self.registry.slot_for(adapter_id, _in_use(executor) - {adapter_id})
        if placed is None:
            raise RuntimeError(f"adapter {adapter_id}: every LoRA slot is in use (can_admit should have said so)")
        lora_slot, load = placed
        commands = []
        if load:
            path = self.registry.path_of(adapter_id)
            executor.adapters.load(lora_slot, adapter_id, path)
            commands.append(P.LoraLoad(lora_slot, adapter_id, path))
        self.registry.placed(lora_slot, adapter_id)
        return commands + [P.SlotAdapter(slot, lora_slot)]

    def unload_orphans(self, executor) -> list:
        """Empty the LoRA slots of adapters unregistered since the last planning step; their LORA_UNLOADs."""
        commands = []
        for lora_slot in self.registry.orphans():
            executor.adapters.unload(lora_slot)
            commands.append(P.LoraUnload(lora_slot))
            self.registry.placed(lora_slot, -1)
        return commands
