"""BlockManager: block accounting, the prefix cache, LRU eviction and determinism."""

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eprt.cache.block_manager import BlockManager, OutOfBlocks

PROMPT40 = list(range(1, 41))


def test_a_sequence_of_length_L_holds_L_div_bs_plus_1_blocks():
    bm = BlockManager(100, 16)
    for key, n in enumerate([1, 15, 16, 17, 31, 32, 40]):
        bm.allocate(key, list(range(n)))
        assert len(bm.block_table(key)) == n // 16 + 1
    assert bm.num_free_blocks() == 100 - sum(n // 16 + 1 for n in [1, 15, 16, 17, 31, 32, 40])


def test_match_prefix_leaves_at_least_one_prompt_token_to_compute():
    bm = BlockManager(100, 16)
    bm.allocate("a", PROMPT40)
    bm.cache("a", PROMPT40)
    assert bm.match_prefix(PROMPT40) == 32  # 40 tokens -> 32
    assert bm.match_prefix(PROMPT40[:32]) == 16  # 32 tokens -> 16
    assert bm.match_prefix(PROMPT40[:33]) == 32
    assert bm.match_prefix(PROMPT40[:16]) == 0
    assert bm.match_prefix(PROMPT40, adapter=3) == 0  # adapters do not share KV
    assert bm.match_prefix([99] + PROMPT40[1:]) == 0  # the chain starts at token 0
    assert bm.match_prefix(PROMPT40[:16] + [0] * 24) == 16


def test_allocate_reuses_the_cached_prefix_and_shares_live_blocks():
    bm = BlockManager(10, 16)
    bm.allocate("a", PROMPT40)
    bm.cache("a", PROMPT40)
    assert bm.num_cached_blocks() == 2
    free = bm.num_free_blocks()
    assert bm.allocate("b", PROMPT40) == 32
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert bm.block_table("b")[2] != bm.block_table("a")[2]
    assert bm.num_free_blocks() == free - 1  # live hits cost nothing
    assert bm.free("a") == 3 and bm.free("b") == 3
    assert bm.num_free_blocks() == 10 and bm.num_cached_blocks() == 2


def test_cached_blocks_count_as_free_and_are_evicted_lru_tail_first():
    bm = BlockManager(4, 4)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]  # 2 full blocks + 1
    bm.allocate("a", prompt)
    bm.cache("a", prompt)
    bm.free("a")
    assert bm.num_free_blocks() == 4 and bm.num_cached_blocks() == 2
    bm.allocate("b", [9, 9, 9])  # takes a plain free block
    bm.allocate("c", [7, 7, 7])  # the last plain one
    assert bm.num_cached_blocks() == 2
    bm.allocate("d", [5, 5, 5])  # must evict: the tail block goes
    assert bm.num_cached_blocks() == 1
    assert bm.match_prefix(prompt + [0]) == 4  # the head block survived
    assert bm.num_free_blocks() == 1


def test_disabled_prefix_cache_neither_matches_nor_inserts():
    bm = BlockManager(10, 4, prefix_cache=False)
    bm.allocate("a", list(range(9)))
    bm.cache("a", list(range(9)))
    assert bm.num_cached_blocks() == 0 and bm.match_prefix(list(range(9))) == 0
    bm.enabled = True
    bm.cache("a", list(range(9)))
    assert bm.match_prefix(list(range(9))) == 8


def test_grow_and_its_limits():
    bm = BlockManager(3, 4)
    bm.allocate("a", [1, 2, 3])  # 1 block
    assert bm.can_grow("a", 7) and not bm.can_grow("a", 12)
    bm.grow("a", 4)
    assert len(bm.block_table("a")) == 2
    bm.grow("a", 5)  # already has room
    assert len(bm.block_table("a")) == 2
    with pytest.raises(OutOfBlocks):
        bm.grow("a", 12)
    assert not bm.can_allocate([1, 2, 3, 4])
    with pytest.raises(OutOfBlocks):
        bm.allocate("b", [1, 2, 3, 4])
    assert "b" not in bm and bm.num_free_blocks() == 1  # a failed allocation takes nothing


def test_bad_calls_name_the_problem():
    bm = BlockManager(4, 4)
    bm.allocate("a", [1])
    with pytest.raises(KeyError, match="already holds"):
        bm.allocate("a", [1])
    with pytest.raises(KeyError, match="holds no blocks"):
        bm.free("nobody")
    with pytest.raises(ValueError, match="empty"):
        bm.allocate("b", [])
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)


_DETERMINISM = """
from eprt.cache.block_manager import BlockManager
bm = BlockManager(12, 4)
for k in range(6):
    p = [k % 3, 1, 2, 3, 4, 5, 6, 7, k]
    if bm.can_allocate(p):
        bm.allocate(k, p)
        print(k, bm.block_table(k))
        bm.cache(k, p)
    if k % 2:
        bm.free(k - 1)
print(bm.num_free_blocks(), bm.num_cached_blocks())
"""


def test_identical_calls_give_identical_tables_whatever_the_hash_seed():
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.append(
            subprocess.run(
                [sys.executable, "-c", _DETERMINISM], env=env, check=True, capture_output=True, text=True
            ).stdout
        )
    assert outs[0] == outs[1] and outs[0].count("[") >= 4


# -- property: eviction never takes a block a live sequence uses ------------------------------
# A shadow "KV pool" records, for every slot of every physical block, which token prefix its
# KV was computed for. If the manager ever handed a referenced block to another sequence
# (or served a wrong prefix-cache hit), a live sequence would find foreign KV in its table.
BS = 4
BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5]]

ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc"] * 3 + ["release"] * 2 + ["grow", "cache", "free"]),
        st.integers(0, 2),  # sequence key
        st.integers(0, len(BASES) - 1),  # which base prompt
        st.integers(1, 12),  # prompt length or growth
        st.sampled_from([-1, -1, -1, 2]),
    ),  # adapter
    min_size=10,
    max_size=50,
)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(3, 14), ops=ops)
def test_eviction_never_takes_a_live_block(num_blocks, ops):
    bm = BlockManager(num_blocks, BS)
    kv: dict = {}  # (block, offset) -> (adapter, prefix tuple)
    live: dict = {}  # key -> (adapter, tokens whose KV exists)

    def write(key, start, end):
        adapter, toks = live[key]
        table = bm.block_table(key)
        for p in range(start, end):
            kv[table[p // BS], p % BS] = (adapter, tuple(toks[: p + 1]))

    for op, key, base, n, adapter in ops:
        if op == "alloc" and key not in live:
            prompt = BASES[base][:n]
            if not bm.can_allocate(prompt, adapter):
                continue
            expect = bm.match_prefix(prompt, adapter)
            assert bm.allocate(key, prompt, adapter) == expect
            live[key] = (adapter, list(prompt))
            write(key, expect, len(prompt))  # the cached part is not recomputed
        elif op == "grow" and key in live:
            adapter, toks = live[key]
            if not bm.can_grow(key, len(toks) + n):
                continue
            bm.grow(key, len(toks) + n)
            toks.extend([7] * n)
            write(key, len(toks) - n, len(toks))
        elif op == "cache":  # every live sequence publishes its blocks
            for k, (_, toks) in live.items():
                bm.cache(k, toks)
        elif op in ("free", "release") and key in live:
            if op == "release":
                bm.cache(key, live[key][1])
            assert bm.free(key) == len(live[key][1]) // BS + 1
            del live[key]
        used = set()
        for k, (adapter, toks) in live.items():
            table = bm.block_table(k)
            assert len(table) == len(toks) // BS + 1
            for p in range(len(toks)):
                assert kv[table[p // BS], p % BS] == (adapter, tuple(toks[: p + 1]))
            used.update(table)
        assert bm.num_free_blocks() == num_blocks - len(used)
    for k in list(live):
        bm.free(k)
    assert bm.num_free_blocks() == num_blocks


def test_shrink_gives_back_private_tail_blocks_only():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", list(range(6)))  # 2 blocks
    bm.grow("a", 13)  # 13 tokens: 4 blocks
    assert len(bm.block_table("a")) == 4 and bm.num_free_blocks() == 4
    tail = bm.block_table("a")[2:]
    assert bm.shrink("a", 7) == 2  # back to 2 blocks (7 // 4 + 1)
    assert bm.num_free_blocks() == 6 and bm.shrink("a", 7) == 0
    bm.grow("a", 13)
    assert bm.block_table("a")[2:] == tail  # the next grow takes the same blocks again
    bm.cache("a", list(range(13)))  # blocks 0..2 now hold prefix-cache entries
    with pytest.raises(ValueError, match="is cached"):
        bm.shrink("a", 3)
    assert len(bm.block_table("a")) == 4  # a refused shrink changes nothing
