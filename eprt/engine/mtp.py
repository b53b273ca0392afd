"""DeepSeek's multi-token prediction layer on every rank (a part of the executor; VERIFY_MTP in
docs/protocol.md): the main model's hidden rows it has not consumed yet, held per sequence, its
catch-up and drafting passes over the sequence's MTP KV (one more layer of the paged blocks), and
its drafts, the argmax of its head (identical on every rank). T rows, D hidden.
"""

from __future__ import annotations

import numpy as np

from eprt.engine.sequences import ExecutorError
from eprt.model.moe_model import AttnBatch, PrefillPart


class HeldRows:
    """A sequence's main-model hidden rows [m, D] of positions ``start`` to ``end`` - 1, which the MTP
    layer has not consumed: kept as the forward passes' pieces and joined when read (appending each
    decode step's row to one array would copy all of them every step)."""

    def __init__(self, start: int, chunks: list) -> None:
        self.start, self.chunks = start, chunks
        self.end = start + sum(len(c) for c in chunks)

    def append(self, rows) -> None:
        """The rows [n, D] of positions ``end`` on."""
        self.chunks.append(rows)
        self.end += len(rows)

    def rows(self, ops):
        """[m, D], the pieces joined (once: they are kept joined)."""
        if len(self.chunks) > 1:
            self.chunks = [ops.xp.concatenate(self.chunks, axis=0)]
        return self.chunks[0]

    def truncate(self, end: int) -> None:
        """Drop the rows of positions ``end`` on (an ACCEPT's rejected positions)."""
        keep, at = [], self.start
        for c in self.chunks:
            if at < end:
                keep.append(c[: end - at])
            at += len(c)
        self.chunks, self.end = keep, min(self.end, end)

    def copy(self) -> HeldRows:
        return HeldRows(self.start, list(self.chunks))


class MtpLayer:
    def __init__(self, model, kv, seqs):
        self.model, self.ops, self.kv, self.seqs = model, model.ops, kv, seqs
        # slot key -> the main model's hidden rows the MTP layer has not consumed yet, for want of
        # the token after each position or of a draft to make (docs/protocol.md)
        self.held: dict[int, HeldRows] = {}
        self.step_clock = None  # set (rank 0, step costs measured): VERIFY_MTP times its catch-up pass on it
        self.catch_up_seconds = 0.0  # the last VERIFY_MTP's catch-up pass, on step_clock
        self.caught_up = (0, 0)  # the rows and positions it ran

    def cached_upto(self, key: int) -> int | None:
        """A sequence's tokens whose MTP KV was computed too (None: all): RELEASE caches only those."""
        held = self.held.get(key)
        return None if held is None else held.start

    def forked(self, key: int, new_key: int) -> None:
        if key in self.held:
            self.held[new_key] = self.held[key].copy()

    def accepted(self, key: int, end: int) -> None:
        """An ACCEPT kept the sequence's first ``end`` tokens: the rejected positions' rows go too."""
        held = self.held.get(key)
        if held is not None:
            held.truncate(end)

    def keep(self, states: list, starts, lengths, h) -> None:
        """Hold the main model's hidden rows h [T, D] for the MTP layer: row r's ``lengths[r]`` rows,
        consecutive in h, are positions ``starts[r]`` on of ``states[r]``'s sequence."""
        at = 0
        for st, start, n in zip(states, starts, lengths):
            start, n, rows = int(start), int(n), h[at : at + int(n)]
            at += n
            held = self.held.get(st.key)
            if held is None:
                self.held[st.key] = HeldRows(start, [rows])
            elif held.end != start:
                raise ExecutorError(
                    f"MTP rows of slot key {st.key}: positions {held.start}..{held.end - 1} held, "
                    f"the next rows start at {start}"
                )
            else:
                held.append(rows)

    def _catch_up(self, slots: list, states: list, tokens: list) -> tuple:
        """The MTP layer over each row's held positions ``s .. L - 1``, position p fed the token
        after it (the stored ones, then ``tokens[r]`` after L - 1) and the main model's hidden row
        of p; the held rows are consumed. Returns (output [T, D], PrefillPart per row)."""
        rows = []
        for slot, st, tok in zip(slots, states, tokens):
            held = self.held.pop(st.key, None)
            if held is None or held.end != st.length:
                raise ExecutorError(
                    f"VERIFY_MTP slot {slot}: no hidden rows held up to its {st.length} stored tokens for the MTP layer"
                )
            rows.append((slot, st, held.start, held.rows(self.ops), [*st.tokens[held.start + 1 : st.length], int(tok)]))
        return self._pass(rows)

    def after_prefill(self, slots: list, states: list) -> None:
        """After a prefill chunk: the MTP layer over each sequence's held positions but the last,
        whose next tokens the prompt holds (so the first verify step's catch-up is one row)."""
        rows = []
        for slot, st in zip(slots, states):
            held = self.held[st.key]
            if held.end - held.start > 1:
                hidden = held.rows(self.ops)
                rows.append((slot, st, held.start, hidden[:-1], st.tokens[held.start + 1 : st.length]))
                self.held[st.key] = HeldRows(st.length - 1, [hidden[-1:]])
        if rows:
            self._pass(rows)

    def _pass(self, rows: list) -> tuple:
        """One MTP forward over rows ``(slot, state, first position s, hidden rows [m, D], the m
        tokens after positions s .. s + m - 1)``, each a causal chunk over the slot's MTP KV, which
        it writes. Returns (output [T, D], PrefillPart per row)."""
        ops = self.ops
        self.model.lora_rows = None  # the MTP layer serves no adapter
        ids, prev, positions, maps, parts, offset = [], [], [], [], [], 0
        for slot, st, start, hidden, after in rows:
            table = np.asarray(self.seqs.blocks_of(slot).block_table(st.key), dtype=np.int32)
            pos = np.arange(start, start + len(hidden), dtype=np.int32)  # [m]
            ids.append(np.asarray(after, dtype=np.int32))
            prev.append(hidden)
            positions.append(pos)
            maps.append(self.kv.slots(table, pos))
            parts.append(PrefillPart(offset, len(pos), table, start, slot))
            offset += len(pos)
        batch = AttnBatch(positions=np.concatenate(positions), slot_mapping=np.concatenate(maps), parts=tuple(parts))
        return self.model.mtp_hidden(np.concatenate(ids), ops.xp.concatenate(prev, axis=0), batch, self.kv), parts

    def drafts(self, slots: list, states: list, tokens: list, counts: list) -> list:
        """One catch-up pass of the MTP layer over each drafting row's held positions ``s .. L - 1``
        (L the stored tokens; the token after L - 1 is ``tokens[r]``), whose last row drafts the
        token after ``tokens[r]``; then one pass per further draft at positions L, L + 1, .., each
        fed the previous draft and the MTP's own previous output (as vLLM drafts K > 1 with one
        layer). Drafts are the argmax of the MTP head. Row r's drafts: counts[r] tokens. A row
        without drafts keeps its held rows (a sequence that never drafts again never pays for them)."""
        ops, bs = self.ops, self.seqs.block_size
        rows = [r for r, k in enumerate(counts) if k > 0]
        self.caught_up, self.catch_up_seconds = (0, 0), 0.0
        if not rows:
            return [() for _ in slots]
        if self.step_clock is not None:
            ops.synchronize()
            start = self.step_clock()
        h, parts = self._catch_up([slots[r] for r in rows], [states[r] for r in rows], [tokens[r] for r in rows])
        if self.step_clock is not None:
            ops.synchronize()
            self.catch_up_seconds = self.step_clock() - start
        self.caught_up = (len(rows), int(h.shape[0]))
        last = h[ops.index(np.asarray([p.offset + p.length - 1 for p in parts], dtype=np.int32))]  # [b, D]
        drafts = [[] for _ in slots]
        lengths = np.asarray([st.length for st in states], dtype=np.int64)  # [B]
        for j in range(max(counts)):
            if j:  # position L + j - 1 of each row still drafting: the previous draft, the MTP's own output
                keep = [i for i, r in enumerate(rows) if counts[r] > j]
                rows, last = [rows[i] for i in keep], last[ops.index(np.asarray(keep, dtype=np.int32))]
                pos = lengths[rows] + j - 1  # [b]
                tables = self.seqs.table_rows(slots, rows)
                batch = AttnBatch(
                    positions=pos.astype(np.int32),
                    slot_mapping=tables[np.arange(len(rows)), pos // bs] * bs + (pos % bs).astype(np.int32),
                    block_tables=tables,
                    context_lens=(pos + 1).astype(np.int32),
                )
                step = np.asarray([drafts[r][-1] for r in rows], dtype=np.int32)
                last = self.model.mtp_hidden(step, last, batch, self.kv)  # [b, D]
            for r, t in zip(rows, ops.argmax(self.model.mtp_logits(last))):
                drafts[r].append(int(t))
        return [tuple(d) for d in drafts]
