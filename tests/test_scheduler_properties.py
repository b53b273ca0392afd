"""Scheduler properties over random scenarios (arrivals, scripts, limits, cancels, deadlines,
small KV pools that force preemption, chunked prefill, prefix caching, dp attention's pools and
prefill budgets per owner rank), checked on the trace the fake model records and on what each
client saw."""

import dataclasses
import math
import re
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from eprt.entry.scenario import EngineSpec, RequestSpec, Scenario, run

EOS = 63
STOP_ID = 40
SHARED_PROMPT = list(range(1, 25))  # requests may share prefixes of it (prefix-cache hits)
SEQ_NAME = re.compile(r"s(\d+)@(\d+):len=\d+")
CHOICE_IDS = 10  # request i is s{10 i}; its forks take the ids after it


@st.composite
def scenarios(draw, with_guards: bool):
    bs = draw(st.sampled_from([2, 4, 4, 16]))
    requests = []
    scripts = st.lists(st.sampled_from([10, 11, 12, 13, STOP_ID, EOS]), min_size=1, max_size=8)
    for i in range(1, draw(st.integers(1, 6)) + 1):
        n = draw(st.integers(1, 20))
        prompt = SHARED_PROMPT[:n] if draw(st.booleans()) else [i] + list(range(2, n + 1))
        arrive = draw(st.integers(1, 4))
        choices = draw(st.lists(scripts, max_size=2))  # further choices (n = 1 + len), forked after the prompt
        spec = RequestSpec(
            id=CHOICE_IDS * i,  # room for the forks' ids after it
            prompt=prompt,
            arrive_at_tick=arrive,
            script=draw(scripts),
            max_tokens=draw(st.integers(1, 12)),
            mode="blocking" if choices else draw(st.sampled_from(["stream", "blocking"])),
            choices=choices,
        )
        if with_guards:
            spec.timeout_ticks = draw(st.none() | st.integers(1, 12))
            spec.cancel_at_tick = draw(st.none() | st.integers(arrive, arrive + 12))
            spec.stop_token_ids = draw(st.sampled_from([[], [STOP_ID]]))
            spec.ignore_eos = draw(st.booleans())
        requests.append(spec)
    # every request fits the pool on its own (its last token's KV is never computed)
    fits_alone = max((len(r.prompt) + r.max_tokens - 1) // bs + 1 for r in requests)
    engine = EngineSpec(
        num_blocks=draw(st.integers(fits_alone, fits_alone + 3)),
        block_size=bs,
        max_batch=draw(st.integers(1, 4)),
        max_prefill_tokens=draw(st.sampled_from([0, 0, 1, 3, 8])),
        prefix_cache=draw(st.booleans()),
    )
    if with_guards:
        engine.max_model_len = draw(st.none() | st.integers(4, 24))
    return Scenario("random", engine, requests)


def is_stop(r: RequestSpec, tok: int) -> bool:
    return (tok == EOS and not r.ignore_eos) or tok in r.stop_token_ids


def expected_output(r: RequestSpec, max_model_len=None) -> list:
    """The tokens the script yields with no guard interfering."""
    room = r.max_tokens if max_model_len is None else min(r.max_tokens, max_model_len - len(r.prompt))
    out = []
    for k in range(room):
        tok = r.script[min(k, len(r.script) - 1)]
        out.append(tok)
        if is_stop(r, tok):
            break
    return out


def tick_of_line(lines: list, index: int) -> int:
    return max(int(l.split()[2]) for l in lines[:index] if l.startswith("-- tick "))


def check_slots(lines: list) -> None:
    """Every slot: alloc, then only its own sequence, then exactly one RELEASE before reuse."""
    occupant: dict = {}  # slot -> seq id (None until named)
    allocs = releases = 0
    for line in lines:
        fork = re.fullmatch(r"fork_sequence\(s(\d+)@(\d+):len=\d+, s(\d+)\) -> slot (\d+)", line)
        if fork:
            assert occupant.get(int(fork[2])) == int(fork[1]), f"{line!r}: the parent does not hold its slot"
            slot = int(fork[4])
            assert slot not in occupant and slot == min(set(range(len(occupant) + 1)) - set(occupant))
            occupant[slot] = int(fork[3])
            allocs += 1
        elif m := re.fullmatch(r"alloc_sequence\(\) -> slot (\d+)", line):
            slot = int(m[1])
            assert slot not in occupant, f"slot {slot} reused before its RELEASE"
            assert slot == min(set(range(len(occupant) + 1)) - set(occupant)), "not the lowest free slot"
            occupant[slot] = None
            allocs += 1
        elif m := re.fullmatch(r"ep_broadcast_cmd_for_seq\(seq=(\d+), cmd=0xfffffff1\)", line):
            assert int(m[1]) in occupant, f"RELEASE of empty slot {m[1]}"
            del occupant[int(m[1])]
            releases += 1
        elif m := re.fullmatch(r"compact_sequence\(s(\d+)@(\d+):len=\d+, new_slot=(\d+)\)", line):
            src, dst = int(m[2]), int(m[3])
            assert occupant.get(src) == int(m[1]) and dst not in occupant and dst < src
            occupant[dst] = occupant.pop(src)
        else:
            for sid, slot in SEQ_NAME.findall(line):
                assert int(slot) in occupant, f"{line!r} names an empty slot"
                if occupant[int(slot)] is None:
                    occupant[int(slot)] = int(sid)
                assert occupant[int(slot)] == int(sid), f"{line!r}: slot {slot} holds s{occupant[int(slot)]}"
    assert not occupant and allocs == releases


def check_preempted_go_first(lines: list, forks: set) -> None:
    """A preempted sequence goes back to the front of the queue: while any is waiting, the
    next admission is one of them, or a choice that found no slot to fork into (it queues at
    the front too); valid without guards, which could end it while queued."""
    preempted: set = set()
    admitting = False
    for prev, line in zip(lines, lines[1:]):
        if prev == "fx apply ReleaseSeq{cache=true, preempt}":
            preempted.add(SEQ_NAME.search(line)[1])
        elif line.startswith("alloc_sequence()"):
            admitting = True
        elif admitting and line.startswith("prefill("):
            sid = SEQ_NAME.search(line)[1]
            assert not preempted or sid in preempted or sid in forks, f"s{sid} admitted before preempted {preempted}"
            preempted.discard(sid)
            admitting = False


def check_run(sc: Scenario, with_guards: bool) -> None:
    result = run(sc)
    lines = result.lines
    check_slots(lines)
    if not with_guards:
        forks = {str(f.handle.seq_id) for out in result.outcomes for f in out.forks if f.handle is not None}
        check_preempted_go_first(lines, forks)
    executor = result.runner.executor
    assert executor.blocks.num_free_blocks() == sc.engine.num_blocks  # cached blocks allowed
    assert executor.slots.occupied() == []
    limit = sc.engine.max_model_len
    every = [
        (out, fork) for parent in result.outcomes for out, fork in [(parent, False)] + [(f, True) for f in parent.forks]
    ]
    for out, is_fork in every:
        if is_fork and out.handle is None:
            continue  # a further choice of a request refused at submit
        r = dataclasses.replace(out.spec, id=out.handle.seq_id) if is_fork else out.spec
        if limit is not None and len(r.prompt) >= limit:  # refused at submit, never scheduled
            assert out.rejected and not out.results and not any(f"s{r.id}@" in line for line in lines)
            continue
        assert len(out.results) == 1, f"s{r.id} ended {len(out.results)} times"
        res, want = out.results[0], expected_output(r, limit)
        got = res.token_ids
        # never decoded (or named at all) after it ended
        assert not any(f"s{r.id}@" in line for line in lines[out.finished_at_line :])
        # the client saw each token once, in order; a stop token is kept but never streamed
        streamed = [t for t in got if not is_stop(r, t)]
        assert out.streamed == (streamed if r.mode == "stream" else [])
        assert res.cached_tokens % sc.engine.block_size == 0 and res.cached_tokens < len(r.prompt)
        natural = "stop" if is_stop(r, want[-1]) else "length"
        if not with_guards:
            assert got == want and res.finish_reason == natural and out.handle.guard is None
            continue
        assert got == want[: len(got)]
        end = tick_of_line(lines, out.finished_at_line)
        deadline = math.inf if r.timeout_ticks is None else r.arrive_at_tick + r.timeout_ticks - 1
        cancel = math.inf if r.cancel_at_tick is None else r.cancel_at_tick
        assert end <= min(deadline, cancel)
        if got == want and res.finish_reason == natural:
            continue  # ended on its own, in time
        if res.finish_reason == "timeout":
            assert out.handle.guard == "request_timeout" and end == deadline <= cancel
        else:
            assert (res.finish_reason, out.handle.guard) == ("stop", None) and end == cancel < deadline


@settings(max_examples=250, deadline=None)
@given(scenarios(with_guards=False))
def test_without_guards_every_output_is_its_script(sc):
    check_run(sc, with_guards=False)


@settings(max_examples=250, deadline=None)
@given(scenarios(with_guards=True))
def test_guards_end_each_request_once_for_the_right_reason(sc):
    check_run(sc, with_guards=True)


@st.composite
def dp_scenarios(draw):
    """A random scenario under dp attention: 2 or 3 owner pools, each at least as large as the
    largest request needs alone, and a prefill budget per owner."""
    sc = draw(scenarios(with_guards=False))
    bs = sc.engine.block_size
    fits_alone = max((len(r.prompt) + r.max_tokens - 1) // bs + 1 for r in sc.requests)
    ranks = draw(st.lists(st.integers(fits_alone, fits_alone + 3), min_size=2, max_size=3))
    engine = dataclasses.replace(sc.engine, rank_blocks=ranks, max_prefill_tokens=draw(st.sampled_from([1, 3, 8])))
    return Scenario("random dp", engine, sc.requests)


@st.composite
def dp_ample_scenarios(draw):
    """dp scenarios where every pool has room for every request at once (no preemption), no prefix
    cache (no affinity) and no choices: there, a head waits only for its owner's budget."""
    sc = draw(dp_scenarios())
    requests = [dataclasses.replace(r, choices=[], mode="stream") for r in sc.requests]
    bs = sc.engine.block_size
    room = sum((len(r.prompt) + r.max_tokens - 1) // bs + 1 for r in requests)
    ranks = [room] * len(sc.engine.rank_blocks)
    return Scenario("random dp", dataclasses.replace(sc.engine, rank_blocks=ranks, prefix_cache=False), requests)


@dataclasses.dataclass
class DpTick:
    held: int  # slots held at its start
    prefilling: set  # owner ranks holding an unfinished prefill at its start
    admitted: int = 0
    spent: Counter = dataclasses.field(default_factory=Counter)  # prompt tokens of its chunks per owner rank


def dp_ticks(lines: list) -> tuple[dict, dict]:
    """The trace of a dp scenario, per tick ({tick: DpTick}), and the tick each sequence's first
    chunk ran in ({seq id: tick})."""
    owner, full, mid = {}, {}, set()  # slot -> owner rank, its prompt's length; slots mid-prefill
    ticks, first, tick = {}, {}, 0
    for i, line in enumerate(lines):
        if line.startswith("-- tick "):
            tick = int(line.split()[2])
            ticks[tick] = DpTick(len(owner), {owner[s] for s in mid})
        elif m := re.fullmatch(r"alloc_sequence\(\) -> slot (\d+) on rank (\d+)", line):
            owner[int(m[1])] = int(m[2])
            ticks[tick].admitted += 1
        elif m := re.fullmatch(r"fork_sequence\(s\d+@(\d+):len=\d+, s\d+\) -> slot (\d+)", line):
            owner[int(m[2])] = owner[int(m[1])]
        elif m := re.fullmatch(r"compact_sequence\(s\d+@(\d+):len=\d+, new_slot=(\d+)\)", line):
            src, dst = int(m[1]), int(m[2])
            owner[dst], full[dst] = owner.pop(src), full.pop(src, 0)  # (a fork's slot had no PREFILL)
            if src in mid:
                mid.remove(src)
                mid.add(dst)
        elif m := re.fullmatch(r"ep_broadcast_cmd_for_seq\(seq=(\d+), cmd=0x(fffffff0|fffffff1)\)", line):
            slot = int(m[1])
            if m[2] == "fffffff0":  # PREFILL: chunk_len, chunk_start, full_len
                full[slot] = int(lines[i + 3].removeprefix("ep_broadcast_cmd(").rstrip(")"), 16)
            else:  # RELEASE
                mid.discard(slot)
                del owner[slot]
        elif m := re.fullmatch(r"prefill\(n=(\d+), s(\d+)@(\d+):len=(\d+), stream=0\)", line):
            slot = int(m[3])
            ticks[tick].spent[owner[slot]] += int(m[1])
            first.setdefault(int(m[2]), tick)
            (mid.add if int(m[4]) < full[slot] else mid.discard)(slot)
    assert not mid and not owner
    return ticks, first


def check_owner_budgets(lines: list, budget: int) -> None:
    """Per tick, each owner rank's chunks take at most ``budget`` prompt tokens, and every owner
    holding an unfinished prefill when the tick starts prefills some of it in that tick (no owner's
    attention idles in a prefill step while it has prompt left)."""
    for k, t in dp_ticks(lines)[0].items():
        assert all(n <= budget for n in t.spent.values()), f"tick {k}: a rank's chunks exceed {budget}: {t.spent}"
        assert t.prefilling <= set(t.spent), f"tick {k}: ranks {t.prefilling} hold prompts left, prefilled {t.spent}"


def check_owners_busy_while_a_head_waits(lines: list, sc: Scenario) -> None:
    """In a tick whose prefill lane leaves a slot free while an arrived request is still not
    admitted (so it waited at the queue's head), every owner rank spent its whole budget."""
    ticks, first = dp_ticks(lines)
    for k, t in ticks.items():
        waiting = [r.id for r in sc.requests if r.arrive_at_tick <= k and first.get(r.id, math.inf) > k]
        if waiting and t.held + t.admitted < sc.engine.max_batch:
            every = all(t.spent[r] == sc.engine.max_prefill_tokens for r in range(len(sc.engine.rank_blocks)))
            assert every, f"tick {k}: {waiting} wait with a slot free while an owner had budget left: {t.spent}"


@settings(max_examples=60, deadline=None)
@given(dp_scenarios())
def test_dp_prefill_budget_is_per_owner_and_no_owner_with_prompt_left_idles(sc):
    result = run(sc)
    check_slots([re.sub(r" on rank \d+$", "", line) for line in result.lines])
    check_owner_budgets(result.lines, sc.engine.max_prefill_tokens)
    pools = result.runner.executor.pools.pools  # every rank's mirrored pool, on rank 0
    assert [p.num_free_blocks() for p in pools] == sc.engine.rank_blocks  # cached blocks allowed
    for out in result.outcomes:
        if out.spec.choices or out.rejected:
            continue  # (forks: their outputs are checked by the replicated properties)
        assert out.results[0].token_ids == expected_output(out.spec)


@settings(max_examples=60, deadline=None)
@given(dp_ample_scenarios())
def test_dp_a_head_waits_only_while_every_owner_spends_its_budget(sc):
    result = run(sc)
    check_owner_budgets(result.lines, sc.engine.max_prefill_tokens)
    check_owners_busy_while_a_head_waits(result.lines, sc)
    assert all(out.results[0].token_ids == expected_output(out.spec) for out in result.outcomes)
