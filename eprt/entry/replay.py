"""``eprt replay DUMP_DIR --model DIR [--rank K]``: rerun rank K's recorded command stream
(``--record-payloads``) on one CPU and report the first entry where its slot state or its
output diverges from the recording, or the error it raises (docs/observability.md).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from eprt.comm.recorder import digest
from eprt.comm.worker import run_worker
from eprt.engine.executor import ShardExecutor
from eprt.model.loader import load_model
from eprt.ops.numpy_ops import NumpyOps


class Divergence(RuntimeError):
    """The replayed rank computed something other than what it recorded."""


class RecordedStream:
    """Rank K's recorded entries with their payloads, served in order to the worker loop (as its
    transport) and to the model's combine."""

    rank = 0

    def __init__(self, directory: Path, rank: int):
        self.rank = rank
        self.header = json.loads((directory / f"rank-{rank}.header.json").read_text())
        self.entries = [json.loads(line) for line in (directory / f"rank-{rank}.jsonl").read_text().splitlines()]
        self.payloads = (directory / f"rank-{rank}.bin").read_bytes()
        self.next = 0
        self.compare_outputs = self.header.get("backend") == "cpu"  # other backends round differently
        self.errors: list[str] = []
        self.divergence: str | None = None

    def _take(self, kind: str) -> tuple[dict, np.ndarray]:
        if self.next >= len(self.entries):
            raise self._diverged(
                f"the replay wants a {kind} after the last of the {len(self.entries)} recorded entries"
            )
        entry = self.entries[self.next]
        if entry["kind"] != kind:
            raise self._diverged(
                f"entry {entry['i']}: the replay wants a {kind}, the recording has a {entry['kind']} "
                f"({entry.get('head', '')})"
            )
        self.next += 1
        count = int(np.prod(entry["data_shape"]))
        data = np.frombuffer(self.payloads, np.dtype(entry["dtype"]), count, entry["offset"])
        return entry, data.reshape(entry["data_shape"])

    # -- the worker loop's transport ------------------------------------------------------------
    def recv_frame(self) -> np.ndarray:
        return self._take("frame")[1]

    def recv_rows(self, n: int, width: int) -> np.ndarray:
        entry, rows = self._take("rows")
        if rows.shape != (n, width):
            raise self._diverged(
                f"entry {entry['i']}: the replay wants {n} x {width} vision rows, recorded {rows.shape}"
            )
        return rows

    def report_error(self, text: str) -> None:
        self.errors.append(text)

    # -- the model's combine --------------------------------------------------------------------
    def combine(self, partial: np.ndarray) -> np.ndarray:
        entry, result = self._take("combine")
        if list(partial.shape) != entry["shape"]:
            raise self._diverged(
                f"entry {entry['i']}: partial of shape {list(partial.shape)}, recorded {entry['shape']}"
            )
        if self.compare_outputs and digest(np.ascontiguousarray(partial, np.float32)) != entry["hash"]:
            raise self._diverged(
                f"entry {entry['i']} (collective #{entry['collective']}): this rank's MoE partial "
                f"differs from the recorded one: {self._context(entry['i'])}"
            )
        return result.copy()

    def allgather_words(self, words: np.ndarray, labels: list | None = None) -> np.ndarray:
        """--check-state's digests: this rank's as recorded (every rank's row is taken to be the same)."""
        entry, recorded = self._take("words")
        mine = np.ascontiguousarray(words, np.uint64)
        if recorded.shape != mine.shape or not np.array_equal(recorded, mine):
            names = labels or [str(k) for k in range(len(mine))]
            differ = [n for n, a, b in zip(names, mine.tolist(), recorded.tolist()) if a != b] or names
            raise self._diverged(
                f"entry {entry['i']}: the state digests of {', '.join(differ)} differ from the recording"
            )
        return np.tile(mine, (self.header["size"], 1))

    def _diverged(self, message: str) -> Divergence:
        self.divergence = message
        return Divergence(message)

    def _context(self, index: int) -> str:
        frame = next((e for e in reversed(self.entries[:index]) if e["kind"] == "frame"), None)
        return "before any frame" if frame is None else f"in the pass of frame entry {frame['i']} ({frame['head']})"


def replay(directory: str, model_dir: str | None, rank: int) -> tuple[str, int]:
    """(report, exit status): 0 when the replay matched the whole recording, 1 otherwise."""
    stream = RecordedStream(Path(directory) / "payloads", rank)
    h = stream.header
    if (model_dir or None) != (h.get("model") or None):
        print(f"eprt replay: note: recorded with --model {h.get('model')}, replaying with {model_dir}")
    world = h["size"]
    loaded = load_model(
        model_dir,
        NumpyOps(),
        h["rope_len"],
        rank=rank,
        world=world,
        combine=stream.combine if world > 1 else (lambda p: p),
        mtp=h.get("mtp", False),
    )
    executor = ShardExecutor(
        loaded.model,
        h["num_blocks"],
        h["block_size"],
        h["max_slots"],
        prefix_cache=h["prefix_cache"],
        image_token_id=h["image_token_id"],
        prefill_tokens=h.get("prefill_tokens", 0),
    )
    executor.compute_logits = False
    logging.getLogger("eprt.comm.worker").setLevel(logging.CRITICAL)  # the report below says it once
    code = run_worker(stream, executor, h["max_slots"], h["vocab_size"])
    if stream.divergence is not None:
        return f"rank {rank}: diverged at {stream.divergence}", 1
    if stream.errors:
        return f"rank {rank}: the replay raised at entry {stream.next - 1}: {stream.errors[0]}", 1
    left = len(stream.entries) - stream.next
    if code != 0 or left:
        return f"rank {rank}: the stream ended early ({left} recorded entries not replayed)", 1
    what = "outputs and slot state" if stream.compare_outputs else f"slot state (outputs not compared: {h['backend']})"
    return f"rank {rank}: replayed {len(stream.entries)} entries; {what} match the recording", 0


def add_arguments(parser) -> None:
    parser.add_argument("dump_dir", help="the --dump-dir of a run made with --record-payloads")
    parser.add_argument("--model", default=None, help="the checkpoint the run used (default: the built-in model)")
    parser.add_argument("--rank", type=int, default=1, help="the rank to replay (default 1: the first worker)")


def main(args) -> int:
    report, code = replay(args.dump_dir, args.model, args.rank)
    print(report)
    return code
