"""The forward passes of one rank (a part of the executor): each pass's batch built from the
sequence state (``sequences.py``), the model run over it, the tokens it computed stored, its
output. ``Passes`` runs replicated attention; ``DpPasses`` runs dp attention's (docs/design.md,
"dp attention"): each owner its own rows (through a ``Passes``), every rank joining each MoE layer
over all of them, and the output of every row gathered on rank 0.
B rows in a decode batch, T tokens in a prefill pass, N positions in a verify pass, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eprt.engine.sequences import ExecutorError
from eprt.engine.window_tables import prefill_window
from eprt.model.moe_model import AttnBatch, PrefillPart


@dataclass(frozen=True)
class DpOutput:
    """A forward pass's rows on rank 0, in the pass's row order."""

    tokens: np.ndarray  # [N] int64: each row's greedy token, from its owner's LM head
    hidden: np.ndarray  # [N, D] float32: each row's final hidden state (the sampled rows' logits come from it)

    def __getitem__(self, rows: slice) -> DpOutput:
        return DpOutput(self.tokens[rows], self.hidden[rows])


class Passes:
    """Replicated attention: every rank runs every row. ``output(h)``: what a pass returns for its
    last hidden rows h [n, D] (default: the logits [n, V], None when the executor computes none)."""

    def __init__(self, ex, output=None):
        self.ex = ex
        self.output = self._logits if output is None else output
        self.graphs = None  # on a GPU: eprt.engine.cuda_graphs.DecodeGraphs (one metadata copy, graph replays)

    def _logits(self, h):
        return self.ex.model.logits(h) if self.ex.compute_logits else None

    def prefill(self, chunks: list, accounted: list, keep_hidden: bool = False):
        """One forward over the chunks' tokens (``accounted``: each chunk's state and new tokens), each
        sequence at its own positions attending causally to its own paged KV. Returns the output of
        each chunk's last token; ``keep_hidden`` keeps the hidden states [T, D] of all the chunks'
        tokens, in order, in the executor's ``prefill_hidden``."""
        ex = self.ex
        named = [c.slot for c in chunks]
        ids, positions, maps, parts, rows, masks, offset = [], [], [], [], [], [], 0
        for c, (st, new) in zip(chunks, accounted):
            end = c.chunk_start + c.chunk_len
            pos = np.arange(c.chunk_start, end, dtype=np.int32)  # [T_i]
            table = np.asarray(ex.seqs.blocks_of(c.slot).block_table(st.key), dtype=np.int32)
            ids.append(np.asarray(new, dtype=np.int32))
            positions.append(pos)
            maps.append(ex.kv.slots(table, pos))
            parts.append(PrefillPart(offset, c.chunk_len, table, c.chunk_start, c.slot))
            r, m = ex.vision.chunk([int(t) for t in c.tokens], c.chunk_start, end, c.vision_rows)
            rows.append(r)
            masks.append(np.zeros(c.chunk_len, dtype=bool) if m is None else m)
            offset += c.chunk_len
        if ex.hybrid is not None:
            ex.hybrid.start(named)
        batch = AttnBatch(
            positions=np.concatenate(positions),  # [T]
            slot_mapping=np.concatenate(maps),
            state_slots=np.asarray(named, dtype=np.int32),
            parts=tuple(parts),
            window=prefill_window(ex.blocks.window, ex.kv, [st.key for st, _ in accounted], parts),
        )
        ex.adapters.rows([st.adapter for st, new in accounted for _ in new])  # each token's adapter
        h = self._prefill_forward(ids, batch, rows, masks, chunks[0], accounted[0][0])  # [T, D]
        self._keep(accounted, [c.chunk_start for c in chunks], [c.chunk_len for c in chunks], h)
        for st, new in accounted:
            st.tokens.extend(new)
        if ex.mtp_layer is not None:
            ex.mtp_layer.after_prefill(named, [st for st, _ in accounted])
        ex.prefill_hidden = h if keep_hidden else None
        last = np.asarray([p.offset + p.length - 1 for p in parts], dtype=np.int32)  # [G]
        return self.output(h[ex.ops.index(last)])

    def _prefill_forward(self, ids: list, batch, rows: list, masks: list, first, st):
        """The prefill pass itself: the embedding (the vision rows at their placeholders; an MRoPE
        model's 3-D positions and deepstack rows, one sequence a pass), then the layers."""
        ex = self.ex
        seen, deepstack = [r for r in rows if r is not None], None
        if ex.cfg.mrope_section:  # 3-D positions and deepstack rows: one sequence per pass (prefill_group)
            mask = masks[0] if rows[0] is not None else None
            end = first.chunk_start + first.chunk_len
            main, deepstack, batch.rope_cos_sin = ex.vision.mrope_chunk(st.key, first.chunk_start, end, rows[0], mask)
            seen = [] if main is None else [main]  # the main rows replace the vision rows
        embedded = ex.model.embed(
            np.concatenate(ids), np.concatenate(seen) if seen else None, np.concatenate(masks) if seen else None
        )  # [T, D]
        return ex.model.hidden_states(embedded, batch, ex.kv, ex.state, deepstack)  # [T, D]

    def _keep(self, accounted: list, starts, lengths, h) -> None:
        """The MTP layer's share of a pass: the main model's hidden rows of its positions."""
        if self.ex.mtp_layer is not None:
            self.ex.mtp_layer.keep([st for st, _ in accounted], starts, lengths, h)

    def decode(self, slots: list, tokens: list):
        return self.decode_forward(self.decode_inputs(slots, tokens))

    def decode_inputs(self, slots: list, tokens: list) -> tuple:
        """The host half of a decode step: check the rows, build the step's batch, store each token
        in its slot; returns what ``decode_forward`` runs (rank 0 may run that on another thread)."""
        ex = self.ex
        states = ex.slots.check_decode(slots, tokens, "decode")
        B, bs = len(states), ex.block_size
        lengths = np.fromiter((st.length for st in states), dtype=np.int64, count=B)  # [B] new tokens' positions
        block_tables = ex.seqs.tables(slots, states, (lengths + 1) // bs + 1)  # [B, MB] room for one more token
        slot_mapping = block_tables[np.arange(B), lengths // bs] * bs + (lengths % bs).astype(np.int32)  # [B]
        positions = lengths.astype(np.int32)
        batch = AttnBatch(
            positions=positions + ex.vision.rope_deltas(states) if ex.cfg.mrope_section else positions,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            context_lens=positions + 1,
            state_slots=np.asarray(slots, dtype=np.int32),
        )
        if ex.seqs.wtables is not None:  # the sliding layers' tables (windowed KV)
            batch.window = ex.seqs.wtables.decode(batch, slots, lengths, bs)
        ids = np.asarray(tokens, dtype=np.int32)
        ex.adapters.rows([st.adapter for st in states])
        for st, tok in zip(states, tokens):  # the token's KV is stored by the forward pass
            st.tokens.append(int(tok))
        return ids, batch, states, lengths

    def decode_forward(self, inputs: tuple):
        """The device half of a decode step: the forward pass of ``decode_inputs``'s batch."""
        ex = self.ex
        ids, batch, states, lengths = inputs
        out = self._graphed(ids, batch)
        if out is not NotImplemented:
            return out
        h = ex.model.hidden_states(ex.model.embed(ids), batch, ex.kv, ex.state)  # [B, D]
        if ex.mtp_layer is not None:
            ex.mtp_layer.keep(states, lengths, [1] * len(states), h)
        return self.output(h)

    def _graphed(self, ids, batch):
        """The pass's output replayed from a CUDA graph (``graphs``, on a GPU), or ``NotImplemented``
        where it runs eagerly (no graphs, another output, a batch the graphs do not take)."""
        if self.graphs is None or self.output != self._logits:
            return NotImplemented
        return self.graphs.forward(ids, batch)

    def verify(self, slots: list, tokens: list, drafts: list):
        """VERIFY: row r appends tokens[r] and its drafts[r] (0..4) to slots[r] in one forward pass.
        Each of the sum(1 + k_r) positions attends like a decode row over its own sequence up to
        itself (ops.attention_verify: a backend may gather each sequence's KV once). The drafts' KV
        stays pending until the ACCEPT. Returns the output of every position, row r's consecutive."""
        ex = self.ex
        states = ex.slots.check_verify(slots, tokens, drafts)
        if ex.state is not None:
            raise ExecutorError(
                f"VERIFY on {ex.cfg.model_type}: a model with recurrent state cannot roll back rejected drafts"
            )
        counts = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=len(slots))  # [B]
        lengths = np.fromiter((st.length for st in states), dtype=np.int64, count=len(slots))  # [B]
        ex.seqs.tables(slots, states, (lengths + counts + 1) // ex.block_size + 1)  # blocks for all its positions
        batch = self._verify_batch(slots, counts, lengths)
        ids = np.asarray([t for tok, d in zip(tokens, drafts) for t in (tok, *d)], dtype=np.int32)  # [N]
        ex.adapters.rows([st.adapter for st, d in zip(states, drafts) for _ in range(1 + len(d))])
        out = NotImplemented if batch.query_lens is None else self._graphed(ids, batch)  # rows as decode rows
        if out is NotImplemented:
            h = ex.model.hidden_states(ex.model.embed(ids), batch, ex.kv, ex.state)  # [N, D]
            if ex.mtp_layer is not None:
                ex.mtp_layer.keep(states, lengths, counts + 1, h)
            out = self.output(h)
        for st, tok, d in zip(states, tokens, drafts):
            st.tokens.extend((int(tok), *(int(t) for t in d)))
        ex.slots.open(slots, drafts)
        return out

    def _verify_batch(self, slots: list, counts: np.ndarray, lengths: np.ndarray) -> AttnBatch:
        """A verify pass's positions as decode rows (with windowed KV, the sliding layers' too)."""
        seqs = self.ex.seqs
        rows = np.repeat(np.arange(len(slots)), counts + 1)  # [N] the batch row of each position
        starts = np.cumsum(counts + 1) - counts - 1  # [B] where each row's positions begin
        positions = lengths[rows] + np.arange(len(rows)) - starts[rows]  # [N]
        batch = self._verify_rows(seqs.table_rows(slots, rows), positions, lengths, counts)
        if seqs.wtables is not None:
            batch.window = self._verify_rows(seqs.window_rows(slots, rows), positions, lengths, counts)
        return batch

    def _verify_rows(self, block_tables, positions, lengths, counts) -> AttnBatch:
        """A verify batch over ``block_tables`` [N, MB] (a row per position; the one sequence's as a
        causal chunk at its end)."""
        bs = self.ex.block_size
        slot_mapping = block_tables[np.arange(len(positions)), positions // bs] * bs + (positions % bs).astype(np.int32)
        if len(counts) == 1:  # one sequence: a causal chunk at its end, its KV gathered once (a prefill's pass)
            table = block_tables[0]
            return AttnBatch(positions.astype(np.int32), slot_mapping, block_table=table, start_pos=int(lengths[0]))
        return AttnBatch(
            positions=positions.astype(np.int32),
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            context_lens=(positions + 1).astype(np.int32),
            query_lens=counts + 1,  # each sequence's KV gathered once for its positions
        )


class DpPasses:
    """dp attention: each rank runs the rows it owns (``local``, whose output is each row's greedy token
    and hidden state) and joins every MoE layer over every rank's rows; rank 0 gathers every row's
    output. The other owners' rows are mirrored: their tokens stored, their blocks grown in their
    owners' pools."""

    def __init__(self, ex, exchange):
        self.ex, self.exchange = ex, exchange
        self.rank = exchange.transport.rank
        self.local = Passes(ex, output=self._output)

    def prefill(self, chunks: list, accounted: list, keep_hidden: bool = False):
        """A prefill pass (one PREFILL / PREFILL_NEXT or a batched run of them): each owner runs its own
        chunks as one forward, and every rank joins each MoE layer over all the chunks' tokens, in the
        run's order. Returns a DpOutput of each chunk's last token on rank 0, in the run's order
        (None elsewhere). The chunks of slots whose OWNER asked for prompt hidden states return every
        position's in a second gather: rank 0 keeps them in ``prefill_hidden`` [T, D], the run's
        tokens in order (``keep_hidden``, rank 0's request for them, must match)."""
        ex = self.ex
        named = [c.slot for c in chunks]
        owners = ex.owners[np.asarray(named, dtype=np.int64)]  # [G] each chunk's owner
        lengths = [c.chunk_len for c in chunks]
        self.exchange.begin(np.repeat(owners, lengths))  # [N] each token's owner
        ex.adapters.exchanged([st.adapter for st, _ in accounted], lengths)
        kept = np.fromiter((ex.prompt_hidden.get(s, False) for s in named), dtype=bool, count=len(chunks))
        if self.rank == 0 and keep_hidden != bool(kept.any()):
            raise ExecutorError(
                f"prefill of slots {named}: prompt hidden states asked for {keep_hidden}, but OWNER named "
                f"{[s for s, k in zip(named, kept) if k]}"
            )
        mine = [i for i, owner in enumerate(owners) if owner == self.rank]
        hidden = None  # [T_mine, D] this rank's chunks' hidden states, when some are kept
        if mine:
            out = self.local.prefill([chunks[i] for i in mine], [accounted[i] for i in mine], bool(kept[mine].any()))
            hidden, ex.prefill_hidden = ex.prefill_hidden, None
        else:
            ex.model.idle_pass()
            out = self._no_rows()
        for i in (i for i in range(len(chunks)) if owners[i] != self.rank):  # their KV is their owners'
            st, new = accounted[i]
            st.tokens.extend(new)
        every = self.exchange.collect(out, np.bincount(owners, minlength=len(ex.pools)).tolist())
        if kept.any():
            ex.prefill_hidden = self._prompt_hidden(chunks, owners, kept, hidden)
        if every is None:
            return None
        ordered = np.empty_like(every)  # rank-major (each rank's chunks in run order) -> run order
        ordered[np.argsort(owners, kind="stable")] = every
        return DpOutput(ordered[:, 0].astype(np.int64), np.ascontiguousarray(ordered[:, 1:]).view(np.float32))

    def _prompt_hidden(self, chunks: list, owners: np.ndarray, kept: np.ndarray, hidden):
        """The kept chunks' hidden states [T, D] on rank 0, the run's tokens in order (rows of the
        other chunks stay zero); None elsewhere. One gather: each rank sends its kept chunks' rows."""
        ex = self.ex
        lengths = np.array([c.chunk_len for c in chunks], dtype=np.int64)  # [G]
        mine = owners == self.rank
        starts = np.cumsum(lengths[mine]) - lengths[mine]  # [mine] each chunk's first row in ``hidden``
        rows = [
            ex.ops.to_host(hidden[int(start) : int(start + n)])
            for start, n, k in zip(starts, lengths[mine], kept[mine])
            if k
        ]
        D = ex.cfg.hidden_size
        rows = np.concatenate(rows).astype(np.float32) if rows else np.zeros((0, D), np.float32)  # [n_mine, D]
        counts = np.bincount(owners[kept], weights=lengths[kept], minlength=len(ex.pools)).astype(int).tolist()
        every = self.exchange.collect(rows, counts)  # [sum counts, D] rank-major on rank 0
        if every is None:
            return None
        out = np.zeros((int(lengths.sum()), D), dtype=np.float32)  # [T, D] in the run's order
        offsets = np.cumsum(lengths) - lengths  # [G]
        at = 0
        for rank in range(len(ex.pools)):
            for g in np.flatnonzero((owners == rank) & kept):
                out[offsets[g] : offsets[g] + lengths[g]] = every[at : at + lengths[g]]
                at += int(lengths[g])
        return out

    def decode(self, slots: list, tokens: list, counts: list | None = None):
        """One step: row r appends tokens[r] to slots[r]; this rank runs the rows it owns. ``counts``:
        DECODE_DP's rows per rank, checked against this rank's owners. Returns a DpOutput on rank 0."""
        ex = self.ex
        states = ex.slots.check_decode(slots, tokens, "DECODE_DP")
        owners = ex.owners[np.asarray(slots, dtype=np.int64)]  # [N]
        self.exchange.begin(owners)
        ex.adapters.exchanged([st.adapter for st in states])
        if counts is not None and list(counts) != self.exchange.counts:
            raise ExecutorError(
                f"DECODE_DP rows per rank {list(counts)}, but the owners of slots {list(slots)} on this rank "
                f"give {self.exchange.counts}"
            )
        mine = np.flatnonzero(owners == self.rank)
        self._mirror(states, slots, owners, [(int(t),) for t in tokens])
        if len(mine):
            out = self.local.decode([slots[r] for r in mine], [tokens[r] for r in mine])
        else:
            ex.model.idle_pass()
            out = self._no_rows()
        return self._collect(out)

    def verify(self, slots: list, tokens: list, drafts: list):
        """VERIFY under dp: each owner runs its rows' positions (the verify of their own rank) and every
        rank joins the MoE layers over all positions, rows in order, each row's consecutive; the other
        owners' rows are mirrored (tokens, blocks in their pools) and pending as on their owner.
        Returns a DpOutput of every position on rank 0."""
        ex = self.ex
        states = ex.slots.check_verify(slots, tokens, drafts)
        counts = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=len(slots))  # [B]
        owners = ex.owners[np.asarray(slots, dtype=np.int64)]  # [B]
        self.exchange.begin(np.repeat(owners, counts + 1))  # [N] each position's owner
        ex.adapters.exchanged([st.adapter for st in states], counts + 1)
        mine = np.flatnonzero(owners == self.rank).tolist()
        if mine:
            out = self.local.verify([slots[r] for r in mine], [tokens[r] for r in mine], [drafts[r] for r in mine])
        else:
            ex.model.idle_pass()
            out = self._no_rows()
        self._mirror(states, slots, owners, [(int(tok), *(int(t) for t in d)) for tok, d in zip(tokens, drafts)])
        ex.slots.open(slots, drafts)  # every row pending, in the frame's order
        return self._collect(out)

    def _mirror(self, states: list, slots: list, owners: np.ndarray, appended: list) -> None:
        """The other owners' rows of a step, as on their owner (``Sequences.mirror``)."""
        others = np.flatnonzero(owners != self.rank).tolist()
        self.ex.seqs.mirror([states[r] for r in others], [slots[r] for r in others], [appended[r] for r in others])

    def _output(self, h):
        """This rank's rows of a pass as uint32 [n, 1 + D]: the greedy token, then the hidden state's bits."""
        ex = self.ex
        tokens = np.asarray(ex.ops.to_host(ex.ops.argmax(ex.model.logits(h))), dtype=np.uint32)  # [n]
        hidden = np.ascontiguousarray(ex.ops.to_host(h), dtype=np.float32)  # [n, D]
        return np.concatenate([tokens[:, None], hidden.view(np.uint32)], axis=1)

    def _no_rows(self) -> np.ndarray:
        return np.zeros((0, 1 + self.ex.cfg.hidden_size), dtype=np.uint32)

    def _collect(self, rows: np.ndarray) -> DpOutput | None:
        every = self.exchange.collect(rows)  # [N, 1 + D] on rank 0
        if every is None:
            return None
        return DpOutput(every[:, 0].astype(np.int64), np.ascontiguousarray(every[:, 1:]).view(np.float32))
