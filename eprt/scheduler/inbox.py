"""The thread-safe inbox between clients (any thread) and the scheduler thread."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from eprt.api import EngineClosed


class Inbox:
    """Arrival-ordered queue of submitted sequences; closing it refuses new ones."""

    def __init__(self) -> None:
        self._items: deque = deque()
        self._cv = threading.Condition()
        self._closed = False

    def put(self, item) -> None:
        with self._cv:
            if self._closed:
                raise EngineClosed("the engine is shutting down and accepts no new requests")
            self._items.append(item)
            self._cv.notify_all()

    def drain(self, n: int) -> list:
        """Take up to n items, oldest first."""
        with self._cv:
            return [self._items.popleft() for _ in range(min(n, len(self._items)))]

    def remove_if(self, pred: Callable[[object], bool]) -> list:
        """Take every item for which pred holds (keeping the others in order)."""
        with self._cv:
            taken, kept = [], deque()
            for x in self._items:
                (taken if pred(x) else kept).append(x)
            self._items = kept
            return taken

    def snapshot(self) -> list:
        with self._cv:
            return list(self._items)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    @property
    def closed(self) -> bool:
        with self._cv:
            return self._closed

    def __len__(self) -> int:
        with self._cv:
            return len(self._items)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until an item is waiting or the inbox is closed; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: bool(self._items) or self._closed, timeout)
