"""RecordingModel: a fake model that prints every interface call, and the frames the real
runner would send, in the trace format; it answers from per-request scripts and raises
FakeModelError for a call a real runner could not serve (docs/scenarios.md, "The fake model").
"""

from __future__ import annotations

from collections.abc import Callable

from eprt.cache.block_manager import BlockManager
from eprt.cache.snapshots import WORD64, SnapshotIndex, prefill_points, prefix_hash64
from eprt.comm.protocol import DECODE_CKPT, FORK, PREFILL, PREFILL_NEXT, RELEASE, SHUTDOWN, WORD_MAX
from eprt.scheduler.interface import RowFailure, TraceCalls


class FakeModelError(RuntimeError):
    """The scheduler asked the fake for something a real model could not do."""


def seq_name(seq, length: int | None = None) -> str:
    return f"s{seq.seq_id}@{seq.slot}:len={seq.len if length is None else length}"


class RecordingModel(TraceCalls):
    def __init__(
        self,
        emit: Callable[[str], None],
        scripts: dict,
        *,
        num_slots: int = 8,
        num_blocks: int = 1000,
        block_size: int = 16,
        prefix_cache: bool = True,
        snapshots: int = 0,
        drafts: dict | None = None,
        failures: dict | None = None,
    ):
        """``scripts`` maps seq_id to (original prompt length, script tokens). ``snapshots`` > 0
        (with the prefix cache): a hybrid model keeping that many recurrent-state snapshots, saved
        by DECODE_CKPT where the real runner saves them (docs/scenarios.md, "The fake model").
        ``failures`` maps seq_id to the output index whose token is a RowFailure instead."""
        self.emit = emit
        self.failures = dict(failures or {})
        self.drafts = {k: list(v) for k, v in (drafts or {}).items()}  # seq_id -> draft script
        self._verify: list = []  # per row of the last verify_batch: (drafts, targets)
        self.scripts = {k: (int(n), list(s)) for k, (n, s) in scripts.items()}
        self.blocks = BlockManager(num_blocks, block_size, prefix_cache=prefix_cache)
        self.snapshots = SnapshotIndex(snapshots) if snapshots and prefix_cache else None
        if self.snapshots is not None:
            self.blocks.hit_filter = self.snapshots.usable_blocks
        self._points: dict = {}  # seq_id -> token counts where its prompt's prefill snapshots
        self.slots: list = [None] * num_slots  # the seq_id occupying each slot
        self._next_token = None  # from the last prefill's final chunk
        self._batch_out: list = []  # from the last decode_batch

    # -- script lookup ---------------------------------------------------------------------
    def _answer(self, seq, last_pos: int) -> int:
        prompt_len, script = self.scripts[seq.seq_id]
        i = last_pos + 1 - prompt_len
        if seq.think is not None:  # a discarded EOS took its entry: the step again answers the next one
            i += seq.think.discarded
        if i < 0:
            raise FakeModelError(f"s{seq.seq_id}: asked for a token inside the prompt (position {last_pos})")
        if self.failures.get(seq.seq_id) == i:
            return RowFailure(f"planted failure of s{seq.seq_id} at output {i}")
        return script[min(i, len(script) - 1)]

    def _check_slot(self, seq) -> None:
        if not 0 <= seq.slot < len(self.slots) or self.slots[seq.slot] != seq.seq_id:
            raise FakeModelError(f"s{seq.seq_id} does not occupy slot {seq.slot}")

    # -- start-up ----------------------------------------------------------------------------
    def bind_gpu_to_thread(self) -> None:
        self.emit("bind_gpu_to_thread()")

    def create_stream(self) -> int:
        self.emit("create_stream() -> 1")
        return 1

    def create_event(self) -> int:
        self.emit("create_event() -> 2")
        return 2

    # -- adapters --------------------------------------------------------------------------
    def adapter_id_for(self, adapter: int) -> int:
        self.emit(f"adapter_id_for({adapter})")
        return adapter

    def acquire_adapter_slot(self, adapter: int) -> None:
        self.emit(f"acquire_adapter_slot({adapter})")

    # -- KV memory -------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        n = self.blocks.num_free_blocks()
        self.emit(f"num_free_blocks() -> {n}")
        return n

    def can_admit(self, seq) -> bool:
        return self.blocks.can_allocate(seq.token_ids[: seq.num_prompt], seq.adapter)

    def alloc_sequence(self, seq) -> int:
        if None not in self.slots:
            raise FakeModelError(f"alloc_sequence for s{seq.seq_id} with every slot occupied")
        slot = self.slots.index(None)
        prompt = seq.token_ids[: seq.num_prompt]
        seq.cached = self.blocks.allocate(seq.seq_id, prompt, seq.adapter)
        if self.snapshots is not None:
            if seq.cached:  # the hit ends at a snapshot, which it restores
                self.snapshots.lookup(self.blocks.chain_hashes(prompt[: seq.cached], seq.adapter)[-1])
            branch = self.blocks.cached_prefix_blocks(prompt, seq.adapter) * self.blocks.block_size
            self._points[seq.seq_id] = prefill_points(seq.cached, len(prompt), branch, self.blocks.block_size)
        self.slots[slot] = seq.seq_id
        self.emit(f"alloc_sequence() -> slot {slot}")
        return slot

    def cache_sequence(self, seq) -> None:
        self._check_slot(seq)
        self.blocks.cache(seq.seq_id, seq.token_ids[: seq.len])
        self.emit(f"cache_sequence({seq_name(seq)})")

    def free_sequence(self, seq) -> int:
        self._check_slot(seq)
        n = self.blocks.free(seq.seq_id)
        if self.snapshots is not None:
            self.snapshots.forget(seq.seq_id)
        self.slots[seq.slot] = None
        self.emit(f"free_sequence({seq_name(seq)}, blocks={n})")
        self._frame(seq.slot, RELEASE)
        return n

    def can_fork(self, seq) -> bool:
        return None in self.slots and self.blocks.can_fork()

    def fork_sequence(self, seq, child) -> int:
        self._check_slot(seq)
        if seq.len != seq.num_prompt or not self.can_fork(seq):
            raise FakeModelError(f"fork of {seq_name(seq)}: not just prefilled, or no free slot / block")
        if self._next_token is not None:  # the first fork: the prompt's row joins the batch
            self._batch_out, self._next_token = [self._next_token], None
        slot = self.slots.index(None)
        self.blocks.fork(seq.seq_id, child.seq_id, seq.len)
        self.slots[slot] = child.seq_id
        self._batch_out.append(self._answer(child, seq.len - 1))
        self.emit(f"fork_sequence({seq_name(seq)}, s{child.seq_id}) -> slot {slot}")
        self._frame(seq.slot, FORK, slot)
        return slot

    def compact_sequence(self, seq, new_slot: int) -> None:
        self._check_slot(seq)
        if not 0 <= new_slot < len(self.slots) or self.slots[new_slot] is not None:
            raise FakeModelError(f"compact s{seq.seq_id} onto slot {new_slot}: out of range or occupied")
        self.slots[new_slot], self.slots[seq.slot] = seq.seq_id, None
        self.emit(f"compact_sequence({seq_name(seq)}, new_slot={new_slot})")

    # -- the frames the real runner sends, printed as the spec's broadcast calls --------------
    def _frame(self, slot: int, cmd: int, *words: int) -> None:
        self.emit(f"ep_broadcast_cmd_for_seq(seq={slot}, cmd={cmd:#x})")
        for word in words:
            self.emit(f"ep_broadcast_cmd({word:#x})")

    # -- compute -----------------------------------------------------------------------------
    def prefill(self, seq, start: int, n: int, stream: int) -> None:
        self._check_slot(seq)
        if start != seq.len or n < 1 or start + n > seq.num_prompt:
            raise FakeModelError(f"bad prefill chunk for {seq_name(seq)}: start={start} n={n} prompt={seq.num_prompt}")
        end = start + n
        self._next_token = self._answer(seq, end - 1) if end == seq.num_prompt else None
        points = self._points.get(seq.seq_id, ())
        piece = start
        for stop in sorted({p for p in points if start < p <= end} | {end}):  # split where a snapshot is due
            if stop > piece:
                self._prefill_frame(seq, piece, stop - piece)
            if stop in points:
                self._checkpoint(seq, stop)
            piece = stop
        self.emit(f"prefill(n={n}, {seq_name(seq, end)}, stream={stream})")

    def _prefill_frame(self, seq, start: int, n: int) -> None:
        if start == seq.cached:  # the slot's first chunk: PREFILL with the whole prompt
            self._frame(seq.slot, PREFILL, n, start, seq.num_prompt)
            self.emit(f"ep_broadcast_tokens(n={seq.num_prompt})")
            self.emit(f"ep_sync_vision_embeds(n={seq.num_prompt})")
        else:  # a later chunk: PREFILL_NEXT with that chunk's tokens
            self._frame(seq.slot, PREFILL_NEXT, n, start)
            self.emit(f"ep_broadcast_tokens(n={n})")

    def _checkpoint(self, seq, length: int) -> None:
        """The DECODE_CKPT frame of a snapshot of seq's first ``length`` tokens, and its saving."""
        bs = self.blocks.block_size
        prefix = self.blocks.chain_hashes(seq.token_ids[:length], seq.adapter)[-1]
        turn = length >= seq.num_prompt // bs * bs  # the prompt's end or decoded tokens
        self.snapshots.save(prefix, owner=seq.seq_id if turn else None)
        session, adapter = prefix_hash64(prefix), seq.adapter & WORD64
        self._frame(
            seq.slot,
            DECODE_CKPT,
            length,
            length // bs,
            session & WORD_MAX,
            session >> 32,
            adapter & WORD_MAX,
            adapter >> 32,
        )

    def argmax_on_device(self, row: int, stream: int) -> int:
        if self._next_token is None:
            raise FakeModelError("argmax_on_device without a completed prefill")
        token, self._next_token = self._next_token, None
        self.emit(f"argmax_on_device(row={row}, stream={stream}) -> {token}")
        return token

    def decode_batch(self, tokens, seqs: list, stream: int) -> None:
        if len(tokens) != len(seqs) or not seqs:
            raise FakeModelError(f"decode_batch with {len(tokens)} tokens for {len(seqs)} sequences")
        for seq in seqs:
            self._check_slot(seq)
            if seq.len != len(seq.token_ids) - 1:
                raise FakeModelError(f"decode of {seq_name(seq)} whose KV is not up to date")
            self.blocks.grow(seq.seq_id, seq.len + 1)
        self._batch_out = [self._answer(seq, seq.len) for seq in seqs]
        names = ", ".join(f'"{seq_name(s)}"' for s in seqs)
        self.emit(f"decode_batch(tokens=[{', '.join(map(str, tokens))}], seqs=[{names}], stream={stream})")

    # -- speculative decoding (the verify lane) -----------------------------------------------
    def _pool(self, seq) -> BlockManager:
        """The block manager holding seq's blocks (dp attention: its owner's)."""
        return self.blocks

    def propose_drafts(self, seq, k: int) -> list[int]:
        """From the request's draft script, aligned like its script: the drafts for the next
        output tokens."""
        prompt_len, _ = self.scripts[seq.seq_id]
        i = len(seq.token_ids) - prompt_len
        out = self.drafts.get(seq.seq_id, [])[i : i + k]
        self.emit(f"propose_drafts({seq_name(seq)}, k={k}) -> [{', '.join(map(str, out))}]")
        return out

    def verify_batch(self, tokens, seqs: list, drafts: list, stream: int) -> None:
        if len(tokens) != len(seqs) or len(drafts) != len(seqs) or not seqs:
            raise FakeModelError(f"verify_batch with {len(tokens)} tokens, {len(drafts)} drafts, {len(seqs)} rows")
        for seq, d in zip(seqs, drafts):
            self._check_slot(seq)
            if seq.len != len(seq.token_ids) - 1:
                raise FakeModelError(f"verify of {seq_name(seq)} whose KV is not up to date")
            self._pool(seq).grow(seq.seq_id, seq.len + len(d) + 1)
        self._verify = [
            (list(d), [self._answer(seq, seq.len + i) for i in range(len(d) + 1)]) for seq, d in zip(seqs, drafts)
        ]
        names = ", ".join(f'"{seq_name(s)}"' for s in seqs)
        shown = ", ".join(f"[{', '.join(map(str, d))}]" for d in drafts)
        self.emit(
            f"verify_batch(tokens=[{', '.join(map(str, tokens))}], drafts=[{shown}], seqs=[{names}], stream={stream})"
        )

    def verify_readback(self, stream: int) -> list[list[int]]:
        out = []
        for drafts, targets in self._verify:
            n = next((i for i, (d, t) in enumerate(zip(drafts, targets)) if d != t), len(drafts))
            out.append(targets[: n + 1])
        shown = ", ".join("[" + ", ".join(map(str, o)) + "]" for o in out)
        self.emit(f"verify_readback(stream={stream}) -> [{shown}]")
        return out

    def accept_drafts(self, seqs: list, accepted: list) -> None:
        for seq, (drafts, _), a in zip(seqs, self._verify, accepted):
            if not 0 <= a <= len(drafts):
                raise FakeModelError(f"{seq_name(seq)}: {a} drafts accepted of {len(drafts)}")
            self._pool(seq).shrink(seq.seq_id, seq.len)
        names = ", ".join(f'"{seq_name(s)}"' for s in seqs)
        self.emit(f"accept_drafts(seqs=[{names}], accepted=[{', '.join(map(str, accepted))}])")

    def commit_ctx(self, seq, n: int, base: int, row: int) -> None:
        self.emit(f"commit_ctx({seq_name(seq)}, n={n}, base={base}, row={row})")

    def argmax_batch(self, row: int, n: int, stream: int) -> list[int]:
        out = self._batch_out[row : row + n]
        self.emit(f"argmax_batch(row={row}, n={n}, stream={stream}) -> [{', '.join(map(str, out))}]")
        return out

    def decode_marconi_checkpoint(self, seq) -> None:
        self.emit(f"decode_marconi_checkpoint({seq_name(seq)})")
        if self.snapshots is not None and seq.len % self.blocks.block_size == 0:
            self._checkpoint(seq, seq.len)

    # -- shutdown ----------------------------------------------------------------------------
    def ep_shutdown(self) -> None:
        self._frame(0, SHUTDOWN)

    def synchronize(self, stream: int) -> None:
        self.emit(f"synchronize(stream={stream})")

    def teardown(self) -> None:
        self.emit("teardown()")
