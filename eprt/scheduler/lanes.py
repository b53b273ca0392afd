"""Planning a tick's steps (docs/scenarios.md, "One run"): the prefill lane (unfinished chunked
prefills, then admissions, each prompt's forks after its last chunk), the decode lane (room made
by preemption, then a decode or verify step) and the end of the tick (snapshots, the ACCEPT, the
guards, releases and compaction). Each plan's KV accounting is done here, through the model's
accounting calls, in the order its commands will be sent.
"""

from __future__ import annotations

from collections import deque

from eprt.scheduler import guards, pools, speculation
from eprt.scheduler.sequence import ERROR, GUARD_KV_CAPACITY, LENGTH, SeqState, Sequence
from eprt.scheduler.step import (
    Checkpoint,
    Chunk,
    Compaction,
    Decode,
    Release,
    Rollback,
    Row,
    StepPlan,
    TickStart,
)


def row(seq: Sequence) -> Row:
    return Row(seq, seq.slot, seq.len)


def chunk_len(left: int, budget: int | None) -> int:
    """Prompt tokens of one prefill chunk: what is left of the prompt, within the tick's budget."""
    return left if budget is None else min(left, budget)


# -- prefill lane ------------------------------------------------------------------------------
def plan_prefill(sched, start: TickStart) -> StepPlan:
    """The tick's start and its prefill lane: unfinished chunked prefills first, then queued
    sequences in order while a slot, their blocks and their pool's budget allow (first come first
    served: a head that does not fit waits, and blocks the ones behind it). The budget is one per
    pool: under dp attention each owner rank's chunks take up to the whole of it."""
    budget = pools.PrefillBudget(sched.kv, sched.config.max_prefill_tokens)
    chunks: list = []
    for seq in [s for s in sched._live if s.state is SeqState.PREFILLING]:
        pool = pools.pool_key(sched.kv, seq)
        if budget.left(pool) != 0:
            _chunk(sched, seq, None, budget, pool, chunks)
    while sched._waiting and not budget.exhausted() and len(sched._live) < sched.config.max_batch:
        seq = sched._waiting[0]  # (a fork that found no slot may wait for one)
        if not sched.kv.can_admit(seq):
            if sched._live:
                break  # wait for blocks to come back
            sched._waiting.popleft()  # nothing will ever free enough
            error = f"the prompt ({seq.num_prompt} tokens) needs more KV blocks than the whole pool holds"
            sched._finish(seq, ERROR, error=error)
            continue
        pool = budget.admission(seq)
        if budget.left(pool) == 0:
            break  # its owner has spent this tick's budget: it waits for the next tick
        sched._waiting.popleft()
        _chunk(sched, seq, _admit(sched, seq), budget, pool, chunks)
    return StepPlan(start=start, chunks=tuple(chunks))


def _admit(sched, seq: Sequence):
    adm = sched.kv.admit(seq)
    seq.slot, seq.cached = adm.slot, adm.cached
    seq.len = seq.cached
    if seq.cached_tokens is None:
        seq.cached_tokens = seq.cached
    seq.admit_order = next(sched._admissions)
    seq.state = SeqState.PREFILLING
    sched._live.append(seq)
    return adm


def _chunk(sched, seq: Sequence, admission, budget, pool: int, chunks: list) -> None:
    """Plan one chunk of seq's prompt within ``pool``'s budget (and, after its last one, its forks)."""
    full, start = seq.num_prompt, seq.len
    n = chunk_len(full - start, budget.left(pool))
    budget.spend(pool, n)
    record = sched.kv.plan_chunk(seq, start, n)
    at = row(seq)
    seq.len = start + n
    forks = ()
    if seq.len == full:
        seq.state = SeqState.RUNNING
        forks = _fork(sched, seq)
    chunks.append(Chunk(at, n, full, admission, forks, record))


def _fork(sched, parent: Sequence) -> tuple:
    """The parent's further choices, each forked into a slot of its own (FORK) while there is a
    slot and a block; the rest queue at the front to prefill their prompt themselves."""
    forked, children = [], parent.forks
    parent.forks = []
    for i, child in enumerate(children):
        if len(sched._live) >= sched.config.max_batch or not sched.kv.can_fork(parent):
            sched._waiting.extendleft(reversed(children[i:]))
            break
        fork = sched.kv.fork(parent, child)
        child.slot = fork.slot
        child.len = child.cached = parent.len
        child.cached_tokens = parent.cached_tokens
        child.admit_order = next(sched._admissions)
        child.state = SeqState.RUNNING
        sched._live.append(child)
        forked.append(fork)
    return tuple(forked)


# -- decode lane -------------------------------------------------------------------------------
def plan_decode(sched) -> StepPlan:
    """Room for every decoding row (preemptions), then one verify step when any row has drafts,
    else one decode step; an empty plan when nothing decodes."""
    room: list = []
    running = sorted((s for s in sched._live if s.state is SeqState.RUNNING), key=lambda s: s.slot)
    rows = _make_room(sched, running, room)
    if not rows:
        return StepPlan(room=tuple(room))
    drafting: list = []
    if sched.config.num_speculative_tokens:
        verify = speculation.plan_verify(sched, rows, drafting)
        if verify is not None:
            return StepPlan(room=tuple(room), drafting=tuple(drafting), verify=verify)
    step = Decode(tuple(row(s) for s in rows), tuple(s.token_ids[-1] for s in rows))
    return StepPlan(room=tuple(room), drafting=tuple(drafting), decode=step)


def _make_room(sched, rows: list, room: list) -> list:
    """Preempt until every row that crosses a block boundary can get its new block (within the
    short pool: one per owner rank under dp attention, ``pools.py``)."""
    read = pools.reader(sched.kv, room)
    while rows:
        pool = pools.short_pool(sched.kv, rows, sched.config.block_size, read)
        if pool is None:
            return rows
        holders = [s for s in sched._live if pools.in_pool(sched.kv, s, pool)]
        victim = max((s for s in holders if not s.finished), key=lambda s: s.admit_order)
        if len(holders) == 1:  # it has the whole pool and still cannot grow
            sched._finish(victim, LENGTH, guard=GUARD_KV_CAPACITY)
        else:  # (if alone among finished ones: retry next tick)
            room.append(_preempt(sched, victim))
        rows = [s for s in rows if s is not victim]
    return rows


def _preempt(sched, seq: Sequence) -> Release:
    release = Release(row(seq), finish=False, blocks=sched.kv.release(seq, finish=False))
    sched.preemptions += 1
    sched._live.remove(seq)
    seq.slot, seq.len = -1, 0
    seq.num_prompt = len(seq.token_ids)
    seq.state = SeqState.QUEUED
    sched._waiting.appendleft(seq)
    return release


# -- end of tick -------------------------------------------------------------------------------
def plan_end(sched) -> StepPlan:
    """The decoded rows' snapshots, the ACCEPT of the verify step, the guards (deadlines, cancels),
    the release of every finished sequence in slot order, then compaction."""
    checkpoints = tuple(Checkpoint(row(s), sched.kv.checkpoint(s)) for s in sched._checkpoints)
    sched._checkpoints = []
    accept, sched._acceptance = sched._acceptance, None
    if accept is not None:
        speculation.close_verify(sched, accept)
    rollbacks = []
    for seq in sched._rollbacks:  # (the row's len is back by one: thinking.keep)
        sched.kv.rollback(seq, 1)
        rollbacks.append(Rollback(Row(seq, seq.slot, seq.len + 1)))
    sched._rollbacks = []
    _guards(sched)
    releases = []
    for seq in sorted((s for s in sched._live if s.finished), key=lambda s: s.slot):
        releases.append(Release(row(seq), finish=True, blocks=sched.kv.release(seq, finish=True)))
        sched._live.remove(seq)
        seq.slot = -1
    return StepPlan(
        checkpoints=checkpoints,
        accept=accept,
        rollbacks=tuple(rollbacks),
        releases=tuple(releases),
        compactions=_compact(sched),
    )


def _guards(sched) -> None:
    """End every sequence whose deadline passed or whose client cancelled (queued ones at once)."""
    sched.clock.end_tick()
    now = sched.clock.now()

    def verdict(seq: Sequence):
        return guards.tick_verdict(seq, now, sched._abort)

    for seq in sched._live:
        if not seq.finished and verdict(seq) is not None:
            sched._finish(seq, *verdict(seq))
    queued = [s for s in sched._waiting if verdict(s) is not None]
    sched._waiting = deque(s for s in sched._waiting if s not in queued)
    queued += sched._inbox.remove_if(lambda s: verdict(s) is not None)
    while queued:
        for seq in queued:  # never admitted (or preempted): no slot to free
            sched._finish(seq, *verdict(seq))
        queued = [s for s in sched._waiting if verdict(s) is not None]  # forks those ends let go
        sched._waiting = deque(s for s in sched._waiting if s not in queued)


def _compact(sched) -> tuple:
    survivors = sorted(sched._live, key=lambda s: s.slot)
    n = len(survivors)
    targets = sorted(set(range(n)) - {s.slot for s in survivors})
    moves = []
    for seq in survivors:
        if seq.slot >= n:
            target = targets.pop()
            moves.append(Compaction(row(seq), target))
            sched.kv.compact(seq, target)
            seq.slot = target
    return tuple(moves)
