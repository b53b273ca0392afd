"""Rank 0's LoRA adapters: names to ids and paths, requests in flight per adapter, and the choice
of the LoRA slot an adapter goes to (LRU among slots no running sequence uses). docs/lora.md.
Every method may be called from any thread (the server registers adapters while the loop runs)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from eprt.api import RequestError


class UnknownAdapter(RequestError):
    """A request names an adapter that is not registered (HTTP 404)."""


@dataclass(frozen=True)
class Adapter:
    name: str
    adapter_id: int  # never reused: the prefix cache keys blocks by it
    path: str


class AdapterRegistry:
    def __init__(self, max_loras: int, validate=lambda path: None):
        self.max_loras = max_loras
        self._validate = validate  # reads the adapter for rank 0 (LoraError when it cannot be served)
        self._lock = threading.Lock()
        self._by_name: dict[str, Adapter] = {}
        self._by_id: dict[int, Adapter] = {}
        self._in_flight: dict[int, int] = {}  # adapter id -> requests submitted and not finished
        self._next_id = 1
        self._slot_ids = [-1] * max_loras  # rank 0's view of each LoRA slot (mirrors LoraSlots.ids)
        self._last_used = [0] * max_loras
        self._clock = 0

    # ---- names (server, CLI) ----------------------------------------------------------------
    def register(self, name: str, path: str, check: bool = True) -> Adapter:
        """Add ``name`` after checking its adapter can be served (LoraError otherwise)."""
        if not name or name in self._by_name:
            raise RequestError(f"LoRA adapter name {name!r} is {'taken' if name else 'empty'}")
        if check:
            self._validate(path)
        with self._lock:
            if name in self._by_name:
                raise RequestError(f"LoRA adapter name {name!r} is taken")
            adapter = Adapter(name, self._next_id, path)
            self._next_id += 1
            self._by_name[name], self._by_id[adapter.adapter_id] = adapter, adapter
        return adapter

    def unregister(self, name: str) -> Adapter:
        """Forget ``name`` (its slot empties at the next scheduling step); refused while requests use it."""
        with self._lock:
            adapter = self._by_name.get(name)
            if adapter is None:
                raise UnknownAdapter(f"no LoRA adapter named {name!r} (loaded: {sorted(self._by_name)})")
            if self._in_flight.get(adapter.adapter_id):
                raise RequestError(
                    f"LoRA adapter {name!r} is in use by {self._in_flight[adapter.adapter_id]} request(s)"
                )
            del self._by_name[name]
        return adapter

    def names(self) -> list[str]:
        with self._lock:
            return list(self._by_name)

    def path_of(self, adapter_id: int) -> str:
        return self._by_id[adapter_id].path

    # ---- requests ------------------------------------------------------------------------------
    def begin(self, name: str, count: int = 1) -> int:
        """The id of adapter ``name`` for a request of ``count`` choices being submitted, held in
        flight once per choice (UnknownAdapter if none)."""
        with self._lock:
            adapter = self._by_name.get(name)
            if adapter is None:
                raise UnknownAdapter(
                    f"model {name!r} is neither the base model nor a loaded LoRA adapter "
                    f"(adapters: {sorted(self._by_name) or 'none'})"
                )
            self._in_flight[adapter.adapter_id] = self._in_flight.get(adapter.adapter_id, 0) + count
            return adapter.adapter_id

    def end(self, adapter_id: int, count: int = 1) -> None:
        with self._lock:
            self._in_flight[adapter_id] -= count

    # ---- slots (the loop thread) ---------------------------------------------------------------
    def orphans(self) -> list[int]:
        """LoRA slots holding an adapter that was unregistered: to be unloaded."""
        with self._lock:
            gone = [
                a for a in self._slot_ids if a >= 0 and self._by_name.get(self._by_id[a].name) is not self._by_id[a]
            ]
            return [s for s, a in enumerate(self._slot_ids) if a in gone]

    def slot_for(self, adapter_id: int, in_use: set) -> tuple[int, bool] | None:
        """(LoRA slot, whether the adapter must be loaded there) for ``adapter_id``: its slot, else
        an empty one, else the least recently used one whose adapter ``in_use`` does not hold;
        None when every slot is in use. Records the use."""
        self._clock += 1
        if adapter_id in self._slot_ids:
            slot, load = self._slot_ids.index(adapter_id), False
        else:
            free = [s for s, a in enumerate(self._slot_ids) if a < 0 or a not in in_use]
            if not free:
                return None
            slot, load = min(free, key=lambda s: (self._slot_ids[s] >= 0, self._last_used[s], s)), True
        return slot, load

    def would_fit(self, adapter_id: int, in_use: set) -> bool:
        return adapter_id in self._slot_ids or any(a < 0 or a not in in_use for a in self._slot_ids)

    def placed(self, slot: int, adapter_id: int) -> None:
        """``slot`` holds ``adapter_id`` now (-1: empty), used at this step."""
        self._slot_ids[slot], self._last_used[slot] = adapter_id, self._clock
