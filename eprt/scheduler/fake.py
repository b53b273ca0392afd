"""RecordingModel: a fake model that accounts KV blocks as the real runner does, answers each
row's token from per-request scripts and returns the frames the real runner would send; it
raises FakeModelError for a call a real runner could not serve (docs/scenarios.md, "The fake model").
"""

from __future__ import annotations

from eprt.cache.block_manager import BlockManager
from eprt.cache.snapshots import WORD64, SnapshotIndex, prefill_points, prefix_hash64
from eprt.comm import protocol as P
from eprt.scheduler.interface import RowFailure
from eprt.scheduler.step import Admission, ForkRow, StepPlan, StepResult


class FakeModelError(RuntimeError):
    """The scheduler asked the fake for something a real model could not do."""


def seq_name(seq, length: int | None = None) -> str:
    return f"s{seq.seq_id}@{seq.slot}:len={seq.len if length is None else length}"


class RecordingModel:
    pooled = False  # one KV pool

    def __init__(
        self,
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
        self.failures = dict(failures or {})
        self.draft_scripts = {k: list(v) for k, v in (drafts or {}).items()}  # seq_id -> draft script
        self.scripts = {k: (int(n), list(s)) for k, (n, s) in scripts.items()}
        self.blocks = BlockManager(num_blocks, block_size, prefix_cache=prefix_cache)
        self.snapshots = SnapshotIndex(snapshots) if snapshots and prefix_cache else None
        if self.snapshots is not None:
            self.blocks.hit_filter = self.snapshots.usable_blocks
        self._points: dict = {}  # seq_id -> token counts where its prompt's prefill snapshots
        self.slots: list = [None] * num_slots  # the seq_id occupying each slot
        self.kv = self.drafts = self  # the fake answers the accounting calls and the verify lane's queries

    # -- script lookup ---------------------------------------------------------------------
    def _answer(self, seq, last_pos: int):
        prompt_len, script = self.scripts[seq.seq_id]
        i = last_pos + 1 - prompt_len
        if i < 0:
            raise FakeModelError(f"s{seq.seq_id}: asked for a token inside the prompt (position {last_pos})")
        if self.failures.get(seq.seq_id) == i:
            return RowFailure(f"planted failure of s{seq.seq_id} at output {i}")
        return script[min(i, len(script) - 1)]

    def _check_slot(self, seq, slot: int | None = None) -> None:
        slot = seq.slot if slot is None else slot
        if not 0 <= slot < len(self.slots) or self.slots[slot] != seq.seq_id:
            raise FakeModelError(f"s{seq.seq_id} does not occupy slot {slot}")

    def _pool(self, seq) -> BlockManager:
        """The block manager holding seq's blocks (dp attention: its owner's)."""
        return self.blocks

    # -- KV accounting -----------------------------------------------------------------------
    def refresh_adapters(self):
        return None

    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks()

    def can_admit(self, seq) -> bool:
        return None in self.slots and self.blocks.can_allocate(seq.token_ids[: seq.num_prompt], seq.adapter)

    def _take_slot(self, seq) -> int:
        if None not in self.slots:
            raise FakeModelError(f"admission of s{seq.seq_id} with every slot occupied")
        slot = self.slots.index(None)
        self.slots[slot] = seq.seq_id
        return slot

    def admit(self, seq) -> Admission:
        slot = self._take_slot(seq)
        prompt = seq.token_ids[: seq.num_prompt]
        cached = self.blocks.allocate(seq.seq_id, prompt, seq.adapter)
        if self.snapshots is not None:
            if cached:  # the hit ends at a snapshot, which it restores
                self.snapshots.lookup(self.blocks.chain_hashes(prompt[:cached], seq.adapter)[-1])
            branch = self.blocks.cached_prefix_blocks(prompt, seq.adapter) * self.blocks.block_size
            self._points[seq.seq_id] = prefill_points(cached, len(prompt), branch, self.blocks.block_size)
        return Admission(slot, cached)

    def plan_chunk(self, seq, start: int, n: int) -> tuple:
        """The chunk's pieces: (start, n) of each PREFILL / PREFILL_NEXT, or a DECODE_CKPT where a
        snapshot is due (saved now, as the real executor saves it)."""
        self._check_slot(seq)
        if start != seq.len or n < 1 or start + n > seq.num_prompt:
            raise FakeModelError(f"bad prefill chunk for {seq_name(seq)}: start={start} n={n} prompt={seq.num_prompt}")
        end, points, piece, out = start + n, self._points.get(seq.seq_id, ()), start, []
        for stop in sorted({p for p in points if start < p <= end} | {end}):  # split where a snapshot is due
            if stop > piece:
                out.append((piece, stop - piece))
            if stop in points:
                out.append(self._checkpoint(seq, stop))
            piece = stop
        return tuple(out)

    def _checkpoint(self, seq, length: int) -> P.DecodeCkpt:
        """The DECODE_CKPT of a snapshot of seq's first ``length`` tokens, saved now."""
        bs = self.blocks.block_size
        prefix = self.blocks.chain_hashes(seq.token_ids[:length], seq.adapter)[-1]
        turn = length >= seq.num_prompt // bs * bs  # the prompt's end or decoded tokens
        self.snapshots.save(prefix, owner=seq.seq_id if turn else None)
        return P.DecodeCkpt(seq.slot, length, length // bs, prefix_hash64(prefix), seq.adapter & WORD64)

    def checkpoint(self, seq):
        self._check_slot(seq)
        if self.snapshots is not None and seq.len % self.blocks.block_size == 0:
            return self._checkpoint(seq, seq.len)
        return None

    def release(self, seq, finish: bool) -> int:
        self._check_slot(seq)
        self._pool(seq).cache(seq.seq_id, seq.token_ids[: seq.len])
        n = self._free(seq)
        if self.snapshots is not None:
            self.snapshots.forget(seq.seq_id)
        self.slots[seq.slot] = None
        return n

    def _free(self, seq) -> int:
        return self.blocks.free(seq.seq_id)

    def can_fork(self, seq) -> bool:
        return None in self.slots and self._pool(seq).can_fork()

    def fork(self, seq, child) -> ForkRow:
        self._check_slot(seq)
        if seq.len != seq.num_prompt or not self.can_fork(seq):
            raise FakeModelError(f"fork of {seq_name(seq)}: not just prefilled, or no free slot / block")
        slot = self._take_slot(child)
        self._pool(seq).fork(seq.seq_id, child.seq_id, seq.len)
        self._fork_owner(seq, child)
        return ForkRow(child, slot)

    def _fork_owner(self, seq, child) -> None:
        pass

    def compact(self, seq, new_slot: int) -> None:
        self._check_slot(seq)
        if not 0 <= new_slot < len(self.slots) or self.slots[new_slot] is not None:
            raise FakeModelError(f"compact s{seq.seq_id} onto slot {new_slot}: out of range or occupied")
        self.slots[new_slot], self.slots[seq.slot] = seq.seq_id, None

    def accept(self, step) -> None:
        for row, n in zip(step.rows, step.kept):
            if not 1 <= n <= self._verified.get(row.seq.seq_id, 0) + 1:
                raise FakeModelError(f"{seq_name(row.seq)}: {n} tokens kept of a verify step")
            self._pool(row.seq).shrink(row.seq.seq_id, row.length + n)

    # -- speculative decoding (the verify lane) -----------------------------------------------
    def propose_drafts(self, seq, k: int) -> list[int]:
        """From the request's draft script, aligned like its script: the drafts for the next output tokens."""
        prompt_len, _ = self.scripts[seq.seq_id]
        i = len(seq.token_ids) - prompt_len
        return self.draft_scripts.get(seq.seq_id, [])[i : i + k]

    def draft_cost(self, rows: int) -> float | None:
        return None

    def verify_overhead(self, rows: int) -> float:
        return 0.0

    def catch_up_cost(self, rows: int) -> float:
        return 0.0

    # -- execution ---------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        out = StepResult()
        for item in plan.checkpoints:
            if item.record is not None:
                out.frames.append((item, item.record))
        for item in plan.all_releases():
            out.frames.append((item, P.Release(item.row.slot)))
        for i, chunk in enumerate(plan.chunks):
            self._prefill(chunk, i, out)
        if plan.decode is not None:
            out.tokens = self._decode(plan.decode, out)
        if plan.verify is not None:
            out.emitted = self._verify(plan.verify)
        if plan.shutdown:
            out.frames.append((plan, P.Shutdown()))
        return out

    def _prefill(self, chunk, i: int, out: StepResult) -> None:
        seq, slot = chunk.row.seq, chunk.row.slot
        self._admission_frames(chunk, out)
        prompt = tuple(seq.token_ids[: chunk.prompt_len])
        for piece in chunk.record:
            if isinstance(piece, P.DecodeCkpt):
                out.frames.append((chunk, piece))
            elif piece[0] == seq.cached:  # the slot's first chunk: PREFILL with the whole prompt
                out.frames.append((chunk, P.Prefill(slot, piece[0], piece[1], prompt)))
            else:
                out.frames.append((chunk, P.PrefillNext(slot, piece[0], prompt[piece[0] : sum(piece)])))
        for fork in chunk.forks:
            out.frames.append((fork, P.Fork(slot, fork.slot)))
        if chunk.last:
            rows = [seq] + [f.child for f in chunk.forks]
            out.first[i] = [self._answer(s, chunk.end - 1) for s in rows]

    def _admission_frames(self, chunk, out: StepResult) -> None:
        pass

    def _decode(self, step, out: StepResult) -> list:
        for row in step.rows:
            self._check_slot(row.seq, row.slot)
            if row.length != len(row.seq.token_ids) - 1:
                raise FakeModelError(f"decode of {seq_name(row.seq)} whose KV is not up to date")
            self._pool(row.seq).grow(row.seq.seq_id, row.length + 1)
        return [self._answer(row.seq, row.length) for row in step.rows]

    def _verify(self, step) -> list:
        self._verified = {}
        out = []
        for row, d in zip(step.rows, step.drafts):
            self._check_slot(row.seq, row.slot)
            self._pool(row.seq).grow(row.seq.seq_id, row.length + len(d) + 1)
            targets = [self._answer(row.seq, row.length + i) for i in range(len(d) + 1)]
            n = next((i for i, (a, t) in enumerate(zip(d, targets)) if a != t), len(d))
            out.append(targets[: n + 1])
            self._verified[row.seq.seq_id] = len(d)
        return out
