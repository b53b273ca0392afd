"""The flight recorder: every rank's last frames, vision rows and combines in a ring, dumped as
one JSONL file per rank; with payloads, every entry and its data go to disk as they happen, so
``eprt replay`` can rerun the stream on one CPU (docs/observability.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from collections import deque
from pathlib import Path

import numpy as np

from eprt.comm.protocol import ACCEPT, DECODE_BATCH, NAMES, RESERVED_BASE, VERIFY_WORDS

DEFAULT_CAPACITY = 2048  # entries kept in the ring


def digest(data: np.ndarray) -> str:
    """A short content hash of an array's bytes (16 hex digits)."""
    return hashlib.blake2b(np.ascontiguousarray(data).tobytes(), digest_size=8).hexdigest()


def frame_head(words: np.ndarray) -> str:
    """The first command of a frame, e.g. ``PREFILL slot 3`` (``decode slot 1`` for a token)."""
    if len(words) < 2:
        return "partial"
    cmd = int(words[1])
    if cmd == DECODE_BATCH or cmd == ACCEPT or cmd in VERIFY_WORDS:  # batched: seq is 0, the rows follow
        return f"{NAMES[cmd]} {int(words[2]) if len(words) > 2 else '?'} rows"
    return f"{NAMES.get(cmd, 'decode') if cmd >= RESERVED_BASE else 'decode'} slot {int(words[0])}"


class Recorder:
    """``frame``/``rows``/``combine`` are called by the transport; ``dump`` writes the ring.
    ``payload_dir``: record every entry with its data there (``rank-K.jsonl`` + ``rank-K.bin``)."""

    def __init__(self, rank: int, size: int, capacity: int = DEFAULT_CAPACITY, payload_dir: str | None = None):
        self.rank, self.size = rank, size
        self.ring: deque = deque(maxlen=capacity)
        self.meta: dict = {}  # what a replay needs to rebuild this rank (set by the engine)
        self.entries = 0
        self.last_progress = time.monotonic()  # when the last entry was recorded
        self._payloads = None
        if payload_dir is not None:
            Path(payload_dir).mkdir(parents=True, exist_ok=True)
            self._log = open(Path(payload_dir) / f"rank-{rank}.jsonl", "w")  # noqa: SIM115 - open for the run
            self._payloads = open(Path(payload_dir) / f"rank-{rank}.bin", "wb")  # noqa: SIM115

    @property
    def payloads(self) -> bool:
        return self._payloads is not None

    def frame(self, words: np.ndarray, collective: int, sent: bool) -> None:
        entry = {"kind": "frame", "sent": sent, "words": len(words), "head": frame_head(words), "hash": digest(words)}
        self._add(entry, collective, words)

    def rows(self, rows: np.ndarray, collective: int, sent: bool) -> None:
        self._add({"kind": "rows", "sent": sent, "shape": list(rows.shape), "hash": digest(rows)}, collective, rows)

    def words(self, words: np.ndarray, labels: list | None, collective: int) -> None:
        """An all-gather of small words (``--check-state``'s digests, named by ``labels``): this rank's."""
        entry = {"kind": "words", "values": [f"{int(v):016x}" for v in words.ravel()]}
        if labels is not None:
            entry["labels"] = list(labels)
        self._add(entry, collective, words)

    def combine(self, partial: np.ndarray, result: np.ndarray, collective: int) -> None:
        """A MoE combine; the partial's hash and the result only with payloads (hashing every
        combine would cost more than the recorder may)."""
        entry = {"kind": "combine", "shape": list(partial.shape)}
        if self.payloads:
            entry["hash"] = digest(partial)
        self._add(entry, collective, result)

    def alltoall(self, send: list, recv: list, width: int, seconds: float, collective: int) -> None:
        """A MoE all-to-all (--moe-exchange alltoall): rows sent to and received from each rank, the
        bytes a row, and the time it took (no payload: eprt replay rebuilds the all-gather only)."""
        entry = {"kind": "alltoall", "send": send, "recv": recv, "row_bytes": width, "ms": round(1e3 * seconds, 3)}
        self._add(entry, collective, np.zeros(0, np.uint8))

    def _add(self, entry: dict, collective: int, data: np.ndarray) -> None:
        entry.update(i=self.entries, t=round(time.time(), 6), collective=collective)
        self.entries += 1
        self.last_progress = time.monotonic()
        if self._payloads is not None:
            data = np.ascontiguousarray(data)
            entry.update(offset=self._payloads.tell(), dtype=data.dtype.str, data_shape=list(data.shape))
            self._payloads.write(data.tobytes())
            self._log.write(json.dumps(entry) + "\n")
        self.ring.append(entry)

    def dump(self, directory: str, reason: str, report: str = "") -> Path:
        """Write the ring to ``directory/frames-rank-K.jsonl``: a header line, then the entries."""
        Path(directory).mkdir(parents=True, exist_ok=True)
        path = Path(directory) / f"frames-rank-{self.rank}.jsonl"
        header = dict(
            self.meta,
            rank=self.rank,
            size=self.size,
            host=socket.gethostname(),
            pid=os.getpid(),
            reason=reason,
            entries=self.entries,
            kept=len(self.ring),
            report=report,
        )
        with open(path, "w") as f:
            f.write(json.dumps({"header": header}) + "\n")
            for entry in self.ring:
                f.write(json.dumps(entry) + "\n")
        if self._payloads is not None:
            self._log.flush()
            self._payloads.flush()
            with open(Path(self._log.name).with_suffix(".header.json"), "w") as f:
                json.dump(header, f)
        return path

    def close(self) -> None:
        if self._payloads is not None:
            self._log.close()
            self._payloads.close()
            self._payloads = None
