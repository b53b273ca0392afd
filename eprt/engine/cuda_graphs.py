"""CUDA graphs for the decode step on a GPU (``--cuda-graphs on``, the default with ``--device cuda``):
docs/gpu.md, "CUDA graphs".

A decode step's metadata (tokens, positions, slot mapping, context lengths, the rows' mask and
block tables) goes to the device in ONE host-to-device copy, from a pinned host buffer into a
persistent device buffer (``StepMetadata``). Its forward pass (every layer, the MoE combine, the
logits) is captured once per batch-size bucket (``batch_buckets``: 1, 2, 4, 8, 16, 32, then steps of
32 up to max-batch) reading those buffers, and replayed every step: one graph launch. A batch of B
rows runs in the smallest bucket >= B; the padded rows are masked (token 0, KV slot -1: not
written, context 1, not counted in the expert load) and their outputs dropped. Every rank captures
the same buckets in the same order at start-up, so expert parallelism stays in lock step.

Steps the graphs do not cover run eagerly, with the same one metadata copy where the batch allows
(``eligible``): a batch over the largest bucket, LoRA rows, hybrid recurrent
state, DeepSeek's MTP layer, EPLB's expert slots, dp attention and the host combine (pinned host
memory: a host wait per layer). B rows in the step, R rows of its bucket, W block-table width, V vocab.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("eprt.engine")

SMALL_BUCKETS = (1, 2, 4, 8, 16, 32)
BUCKET_STEP = 32
CUDA_GRAPHS = ("on", "off")
_FIELDS = ("ids", "positions", "slot_mapping", "context_lens", "valid")  # [R] int32 each, then tables [R, W]
_WINDOW_FIELDS = ("window_slot_mapping",)  # windowed KV: the sliding layers' slots, then their tables [R, W]


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The decode batch sizes captured: 1, 2, 4, 8, 16, 32, then every 32 up to ``max_batch``
    (the last bucket is ``max_batch`` itself)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    steps = range(2 * BUCKET_STEP, max_batch, BUCKET_STEP)
    return tuple(sorted({b for b in (*SMALL_BUCKETS, *steps) if b < max_batch} | {max_batch}))


def bucket_of(buckets: tuple[int, ...], rows: int) -> int | None:
    """The smallest bucket holding ``rows`` rows (None: more than the largest)."""
    return next((b for b in buckets if b >= rows), None)


class StepMetadata:
    """A step's int32 metadata in one persistent device buffer, written by one host-to-device copy
    per step from one of two pinned host buffers (the other may still be in flight on a worker,
    which never waits for its step: each is reused only once its copy is done)."""

    def __init__(self, ops, rows: int, width: int, windowed: bool = False):
        xp = ops.xp
        self.ops, self.rows, self.width = ops, rows, width
        self.fields = _FIELDS + (_WINDOW_FIELDS if windowed else ())
        self.tables = ("block_tables", "window_tables") if windowed else ("block_tables",)
        n = self._size(rows)
        self.device = xp.zeros(n, dtype=xp.int32)  # persistent: every graph reads its views
        self._host = [np.frombuffer(xp.cuda.alloc_pinned_memory(4 * n), np.int32, n) for _ in range(2)]
        self._copied = [None, None]  # the event after each host buffer's last copy
        self._turn = 0

    def _size(self, rows: int) -> int:
        return rows * (len(self.fields) + len(self.tables) * self.width)

    def _split(self, flat, rows: int) -> dict:
        """``flat`` (the device buffer or a host one) as the fields [rows] and tables [rows, W] of a step."""
        out = {name: flat[i * rows : (i + 1) * rows] for i, name in enumerate(self.fields)}
        start, size = len(self.fields) * rows, rows * self.width
        for i, name in enumerate(self.tables):
            out[name] = flat[start + i * size : start + (i + 1) * size].reshape(rows, self.width)
        return out

    def views(self, rows: int) -> dict:
        """The device views of a step of ``rows`` rows: each field [rows], the tables [rows, W]."""
        return self._split(self.device, rows)

    def upload(self, ids, batch, rows: int) -> dict:
        """The step's ``ids`` [B] and decode ``batch`` padded to ``rows`` rows, copied in one go;
        returns the device views."""
        B, n = len(ids), self._size(rows)
        host = self._next_host()
        host[:n] = 0
        f = self._split(host, rows)
        f["ids"][:B], f["positions"][:B], f["valid"][:B] = ids, batch.positions, 1
        f["slot_mapping"][:B], f["slot_mapping"][B:] = batch.slot_mapping, -1  # padded rows: no KV written
        f["context_lens"][:B], f["context_lens"][B:] = batch.context_lens, 1
        f["block_tables"][:B, : batch.block_tables.shape[1]] = batch.block_tables
        if batch.window is not None:
            f["window_slot_mapping"][:B], f["window_slot_mapping"][B:] = batch.window.slot_mapping, -1
            f["window_tables"][:B, : batch.window.block_tables.shape[1]] = batch.window.block_tables
        xp = self.ops.xp
        stream = self.ops.stream
        xp.cuda.runtime.memcpyAsync(
            self.device.data.ptr, host.ctypes.data, 4 * n, xp.cuda.runtime.memcpyHostToDevice, stream.ptr
        )
        self._copied[self._turn] = stream.record()
        return self.views(rows)

    def _next_host(self) -> np.ndarray:
        self._turn ^= 1
        event = self._copied[self._turn]
        while event is not None and not event.done:  # a query, not a host synchronisation
            time.sleep(0)
        return self._host[self._turn]


@dataclass
class _Captured:
    graph: object
    output: object  # the captured pass's output buffer ([R, V] logits or [R, D] hidden), or None
    greedy: object  # the greedy tokens and their logits of ``output``, packed (CupyOps.greedy_device), or None
    seconds: float
    nbytes: int
    stats: dict  # the transport's counters a replay adds (the combine's, counted at capture)


class DecodeGraphs:
    """The decode steps of one executor on the GPU: one metadata copy, and graph replays per bucket."""

    def __init__(self, ex, max_batch: int, enabled: bool, recorded: bool = False):
        """``max_batch``: the most rows of a step (a verify step's positions); ``enabled``: --cuda-graphs;
        ``recorded``: --record-payloads (the recorder reads every combine's partial: no graphs)."""
        self.ex, self.ops = ex, ex.ops
        self.unable = self._unable(recorded)  # why this job's steps cannot run from the metadata buffer
        self.enabled = enabled and self.unable is None
        self.buckets = batch_buckets(max_batch)
        width = -(-ex.model.max_len // ex.block_size) + 1  # every block a sequence can hold
        self.meta = StepMetadata(ex.ops, self.buckets[-1], width, ex.seqs.wtables is not None)
        self.graphs: dict[tuple[int, bool], _Captured] = {}
        self.pool = None  # the graphs' own memory pool
        self.check = getattr(ex.ops.xp, "__cusim__", False)  # cusim: every replay checked against a fresh capture
        self.replays = self.verify_replays = 0  # graph launches: every step's, verify steps'

    def _unable(self, recorded: bool) -> str | None:
        """Why no step of this job can run from the metadata buffer and graphs (None: they can)."""
        ex, model = self.ex, self.ex.model
        reasons = (
            (ex.state is not None, "a hybrid model's recurrent state"),
            (ex.mtp_layer is not None, "the MTP layer keeps hidden rows"),
            (model.slots is not None, "EPLB's expert slots"),
            (model.alltoall is not None, "the all-to-all MoE exchange reads its routing on the host"),
            (getattr(model.combine, "blocks_host", False), "the host combine waits for each layer"),
            (recorded, "--record-payloads reads every combine"),
        )
        return next((why for bad, why in reasons if bad), None)

    def eligible(self, batch) -> str | None:
        """Why this step cannot use the metadata buffer and graphs (None: it can)."""
        reasons = (
            (self.unable is not None, self.unable),
            (self.ex.model.lora_rows is not None, "LoRA rows"),
            (batch.rope_cos_sin is not None, "per-token rope rows"),
            (len(batch.positions) > self.buckets[-1], "more rows than the largest bucket"),
        )
        return next((why for bad, why in reasons if bad), None)

    def forward(self, ids, batch):
        """The step's output (logits [B, V] or, on workers, None); ``NotImplemented`` when the step
        cannot use the metadata buffer (``eligible``): the caller runs its eager pass then."""
        if self.eligible(batch) is not None:
            return NotImplemented
        B = len(ids)
        if not self.enabled:  # eager, from the one metadata copy
            return self._pass(self.meta.upload(ids, batch, B), B, masked=False)
        rows = bucket_of(self.buckets, B)
        views = self.meta.upload(ids, batch, rows)
        captured = self.capture(rows, self.ex.compute_logits)
        captured.graph.launch(self.ops.stream)
        self.ops.graph_launched()
        self._add_stats(captured.stats)
        self.replays += 1
        self.verify_replays += batch.query_lens is not None
        if self.check:  # cusim: the same step captured now must issue what the graph replays
            stats = self._stats()
            fresh = self._capture(rows, views)[0]
            self._add_stats({k: stats[k] - v for k, v in self._stats().items()})
            captured.graph.check_replay(fresh)
        if captured.output is None:
            return None
        logits = captured.output[:B]
        self.ops.expect_greedy(logits, captured.greedy, rows)
        return logits

    def _pass(self, views: dict, rows: int, masked: bool = True):
        """The decode forward over the device views of ``rows`` rows (``masked``: some may be padding,
        kept out of the expert load)."""
        from eprt.model.moe_model import AttnBatch

        ex, model = self.ex, self.ex.model
        batch = AttnBatch(
            positions=views["positions"],
            slot_mapping=views["slot_mapping"],
            block_tables=views["block_tables"],
            context_lens=views["context_lens"],
        )
        if "window_tables" in views:  # the sliding layers' own slots and tables (windowed KV)
            batch.window = AttnBatch(
                positions=batch.positions,
                slot_mapping=views["window_slot_mapping"],
                block_tables=views["window_tables"],
                context_lens=batch.context_lens,
            )
        model.row_mask = views["valid"].reshape(rows, 1) if masked else None
        try:
            h = model.hidden_states(model.embed(views["ids"]), batch, ex.kv, ex.state)  # [R, D]
            return model.logits(h) if ex.compute_logits else None  # [R, V]
        finally:
            model.row_mask = None

    def capture_all(self) -> None:
        """Capture every bucket (largest first, as every rank does), logging the time and memory."""
        if not self.enabled:
            return
        t0, before = time.perf_counter(), self._pool_bytes()
        for rows in reversed(self.buckets):
            self.capture(rows, self.ex.compute_logits)
        log.info(
            "CUDA graphs: %d decode buckets (%s rows) captured in %.2f s, %.1f MiB of graph memory",
            len(self.buckets),
            ",".join(map(str, self.buckets)),
            time.perf_counter() - t0,
            (self._pool_bytes() - before) / 2**20,
        )

    def capture(self, rows: int, logits: bool) -> _Captured:
        key = (rows, logits)
        if key not in self.graphs:
            stats = self._stats()
            t0 = time.perf_counter()
            graph, (output, greedy) = self._capture(rows, self.meta.views(rows))
            took = time.perf_counter() - t0
            delta = {k: v - stats[k] for k, v in self._stats().items()}
            self._add_stats({k: -v for k, v in delta.items()})  # nothing ran yet
            nbytes = getattr(graph, "nbytes", 0)
            self.graphs[key] = _Captured(graph, output, greedy, took, nbytes, delta)
        return self.graphs[key]

    def _capture(self, rows: int, views: dict):
        """(graph, (output, its greedy tokens packed or None)) of the decode pass over ``rows`` rows,
        captured on the rank's stream."""
        xp, stream = self.ops.xp, self.ops.stream
        if self.pool is None:
            self.pool = xp.cuda.MemoryPool()
        with xp.cuda.using_allocator(self.pool.malloc):
            stream.begin_capture()
            try:
                output = self._pass(views, rows)
                greedy = None if output is None else self.ops.greedy_device(output)  # [R * (4 + itemsize)]
            finally:
                graph = stream.end_capture()
        return graph, (output, greedy)

    def _pool_bytes(self) -> int:
        if self.pool is None or self.check:  # cusim keeps one account per device: the graphs' own
            return sum(c.nbytes for c in self.graphs.values())
        return self.pool.total_bytes()

    def _counted(self) -> list:
        """The counters a capture moves once and each replay must move again: (object, names)."""
        stats = getattr(getattr(self.ex.model.combine, "transport", None), "stats", None)
        names = ("allsums", "allsum_bytes", "moe_sent_bytes", "moe_recv_bytes")
        return [(self.ex.model, ("moe_layers_run",))] + ([] if stats is None else [(stats, names)])

    def _stats(self) -> dict:
        return {(i, k): getattr(obj, k) for i, (obj, names) in enumerate(self._counted()) for k in names}

    def _add_stats(self, delta: dict) -> None:
        counted = self._counted()
        for (i, k), v in delta.items():
            setattr(counted[i][0], k, getattr(counted[i][0], k) + v)
