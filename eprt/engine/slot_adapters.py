"""LoRA adapters on every rank (a part of the executor; docs/lora.md): the LoRA slots' moves
(LORA_LOAD, LORA_UNLOAD), the adapter a PREFILL's sequence uses (SLOT_ADAPTER), and each forward
pass's rows' adapters."""

from __future__ import annotations

import numpy as np

from eprt.comm.slots import SlotError
from eprt.engine.sequences import ExecutorError


class SlotAdapters:
    def __init__(self, lora, model, seqs):
        self.lora, self.model, self.seqs = lora, model, seqs  # lora: LoraSlots (eprt/model/lora.py) or None

    def rows(self, adapters: list) -> None:
        """The forward pass's rows' adapter slots (None, the base path, when no row has an adapter)."""
        self.model.lora_rows = None if self.lora is None else self.lora.rows(adapters)

    def exchanged(self, adapters: list, repeats=None) -> None:
        """dp attention: the adapters of every row the MoE layers of this pass see (all ranks', global
        order; each of ``adapters`` ``repeats`` times): the experts' LoRA deltas go by them."""
        if self.lora is None:
            self.model.exchange_lora_rows = None
            return
        ids = np.asarray(adapters, dtype=np.int64) if repeats is None else np.repeat(adapters, repeats)
        self.model.exchange_lora_rows = self.lora.rows(ids)

    def _slots(self, what: str):
        if self.lora is None:
            raise ExecutorError(f"{what}: this executor serves no LoRA adapters (--max-loras 0)")
        return self.lora

    def load(self, lora_slot: int, adapter_id: int, path: str) -> None:
        """Read this rank's share of the adapter at ``path`` into ``lora_slot`` (its old adapter out)."""
        lora = self._slots("LORA_LOAD")
        self._check_unused(lora, lora_slot, "LORA_LOAD")
        lora.load(lora_slot, adapter_id, lora.read(path))

    def unload(self, lora_slot: int) -> None:
        lora = self._slots("LORA_UNLOAD")
        self._check_unused(lora, lora_slot, "LORA_UNLOAD")
        lora.unload(lora_slot)

    def _check_unused(self, lora, lora_slot: int, what: str) -> None:
        if not 0 <= lora_slot < lora.max_loras:
            raise SlotError(f"{what}: LoRA slot {lora_slot} out of range [0, {lora.max_loras})")
        held, slots = lora.ids[lora_slot], self.seqs.slots
        users = [i for i in slots.occupied() if held >= 0 and slots.get(i).adapter == held]
        if users:
            raise SlotError(f"{what}: LoRA slot {lora_slot} holds adapter {held}, in use by slot(s) {users}")

    def set_slot(self, slot: int, lora_slot: int) -> None:
        """SLOT_ADAPTER: the next PREFILL into the empty ``slot`` uses the adapter in ``lora_slot``."""
        lora = self._slots("SLOT_ADAPTER")
        if self.seqs.slots.get(slot) is not None:
            raise SlotError(f"SLOT_ADAPTER for occupied slot {slot}")
        if not 0 <= lora_slot < lora.max_loras or lora.ids[lora_slot] < 0:
            raise SlotError(f"SLOT_ADAPTER slot {slot}: LoRA slot {lora_slot} holds no adapter")
        self.seqs.pending_adapter[slot] = lora.ids[lora_slot]
