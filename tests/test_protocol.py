"""The broadcast protocol: exact words of every command, round trips, coalesced and
arbitrarily split streams, and the errors a bad stream produces."""

import pathlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eprt.comm import protocol as p
from eprt.comm.protocol import (
    Accept,
    CheckState,
    Compact,
    Decode1,
    DecodeBatch,
    DecodeCkpt,
    Decoder,
    Fork,
    Prefill,
    PrefillNext,
    ProtocolError,
    Release,
    Shutdown,
    Verify,
    VerifyMtp,
    decode_all,
    encode,
)

COMMANDS = [
    Decode1(slot=3, token=42),
    DecodeBatch(slots=(0, 2, 1), tokens=(10, 20, 0xFFFFFFDF)),
    Compact(slot=5, new_slot=0),
    Fork(slot=0, new_slot=3),
    Prefill(slot=1, chunk_start=0, chunk_len=5, tokens=(1, 2, 3, 4, 5)),
    Prefill(slot=2, chunk_start=4, chunk_len=2, tokens=(9, 8, 7, 6, 5, 4, 3), vision_rows=3),
    PrefillNext(slot=2, chunk_start=6, tokens=(3, 4)),
    Release(slot=7),
    Verify(slots=(1,), tokens=(3,), drafts=((4, 5),)),
    Verify(slots=(2, 0, 5), tokens=(3, 9, 1), drafts=((4, 5, 6, 7), (), (8,))),
    VerifyMtp(slots=(2, 0, 5), tokens=(3, 9, 1), counts=(4, 0, 1)),
    Accept(slots=(2, 0, 5), accepted=(4, 0, 1)),
    p.Rollback(slot=3, n=1),
    DecodeCkpt(slot=2, snapshot_tokens=64, end_block=3, session_hash=0x123456789ABCDEF0, adapter_id=2**32 + 7),
    CheckState(step=123456),
    p.EplbPlacement(epoch=2, layers=2, slots=3, table=(0, 1, 2, 2, 1, 0)),
    p.LoraLoad(lora_slot=1, adapter_id=2**40 + 3, path="/adapters/é-α"),
    p.LoraUnload(lora_slot=2),
    p.SlotAdapter(slot=3, lora_slot=1),
    p.Owner(slot=4, owner=2, prompt_hidden=1),
    p.DecodeDp(slots=(0, 4, 1), tokens=(5, 6, 7), counts=(2, 0, 1)),
    Shutdown(),
]
DOCS = pathlib.Path(__file__).parent.parent / "docs" / "protocol.md"


def test_words_match_the_spec():
    # The PREFILL frame of tests/scenarios/request_timeout.trace: seq 0, (5, 0, 5), 5 tokens.
    words = encode(Prefill(0, 0, 5, (0, 2, 3, 4, 5))).tolist()
    assert words == [0, 0xFFFFFFF0, 5, 0, 5, 0, 2, 3, 4, 5, 0]
    assert encode(Decode1(3, 42)).tolist() == [3, 42]
    assert encode(DecodeBatch((0, 1), (10, 20))).tolist() == [0, 0xFFFFFFE0, 2, 0, 1, 10, 20]
    assert encode(Compact(1, 0)).tolist() == [1, 0xFFFFFFE2, 0]
    assert encode(Release(4)).tolist() == [4, 0xFFFFFFF1]
    assert encode(Fork(0, 2)).tolist() == [0, 0xFFFFFFE8, 2]
    assert encode(PrefillNext(1, 64, (7, 8, 9))).tolist() == [1, 0xFFFFFFE4, 3, 64, 7, 8, 9]
    # VERIFY_K3 (the longest draft list has 3): n, slots, tokens, counts, then the drafts row by row
    verify = Verify((1, 0), (30, 40), ((4, 5, 6), (7,)))
    assert encode(verify).tolist() == [0, 0xFFFFFFF3, 2, 1, 0, 30, 40, 3, 1, 4, 5, 6, 7]
    assert encode(Verify((0,), (30,), ((),))).tolist()[:2] == [0, 0xFFFFFFF2]  # K is at least 2
    assert encode(Accept((1, 0), (2, 0))).tolist() == [0, 0xFFFFFFE6, 2, 1, 0, 2, 0]
    # VERIFY_MTP: n, slots, tokens, counts; the drafts are the MTP layer's, computed on every rank
    assert encode(VerifyMtp((1, 0), (30, 40), (3, 0))).tolist() == [0, 0xFFFFFFF5, 2, 1, 0, 30, 40, 3, 0]
    assert encode(DecodeCkpt(2, 64, 3, 0x1_0000_0002, 0x3_0000_0004)).tolist() == [2, 0xFFFFFFF8, 64, 3, 2, 1, 4, 3]
    assert encode(CheckState(9)).tolist() == [0, 0xFFFFFFE3, 9]
    assert encode(Shutdown()).tolist() == [0, 0xFFFFFFFF]
    assert all(encode(c).dtype == np.uint32 for c in COMMANDS)


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: type(c).__name__)
def test_every_command_round_trips(cmd):
    assert decode_all(encode(cmd)) == [cmd]


def test_every_declared_command_is_exercised_and_has_one_declaration():
    declared = [d.cls for d in p.DECLARATIONS]
    assert len(set(declared)) == len(declared) and set(declared) == {type(c) for c in COMMANDS}
    words = [w for d in p.DECLARATIONS for w in d.words]
    assert len(set(words)) == len(words) and all(w >= p.RESERVED_BASE for w in words)
    assert words == sorted(words)  # the table's order


def test_docs_command_table_is_the_declarations():
    """docs/protocol.md's command table is the declarations' (python -m eprt.comm.protocol prints it)."""
    rows = [line for line in DOCS.read_text().splitlines() if line.startswith("| `")]
    assert rows == p.doc_table().splitlines()[2:]


def test_prefill_properties():
    cmd = Prefill(slot=0, chunk_start=4, chunk_len=3, tokens=tuple(range(7)))
    assert cmd.full_len == 7 and cmd.is_last_chunk
    assert not Prefill(0, 0, 4, tuple(range(7))).is_last_chunk


@settings(max_examples=60, deadline=None)
@given(order=st.permutations(range(len(COMMANDS))), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_coalesced_stream_decodes_identically_however_it_is_split(order, cuts):
    cmds = [COMMANDS[i] for i in order]
    stream = np.concatenate([encode(c) for c in cmds])
    dec = Decoder(max_slots=8)
    out = []
    for chunk in np.split(stream, sorted(c % (len(stream) + 1) for c in cuts)):
        dec.feed(chunk)
        out.extend(dec)
    dec.finish()
    assert out == cmds


def test_next_waits_for_a_whole_command_without_consuming():
    words = encode(Prefill(1, 0, 3, (7, 8, 9)))
    dec = Decoder()
    dec.feed(words[:6])
    assert dec.next() is None and dec.pending == 6
    dec.feed(words[6:])
    assert dec.next() == Prefill(1, 0, 3, (7, 8, 9)) and dec.pending == 0


@pytest.mark.parametrize(
    "words, message",
    [
        ([0, 0xFFFFFFE5], "unknown reserved command word 0xFFFFFFE5"),
        ([2, 0xFFFFFFF6], "unknown reserved command word 0xFFFFFFF6"),
        ([8, 42], "decode: slot 8 out of range (max_slots=8)"),
        ([0, p.DECODE_BATCH, 2, 1, 9, 5, 5], "DECODE_BATCH: slot 9 out of range"),
        ([0, p.DECODE_BATCH, 0], "DECODE_BATCH of 0 rows"),
        ([0, p.DECODE_BATCH, 9], "DECODE_BATCH of 9 rows"),
        ([1, p.COMPACT, 12], "COMPACT new_slot: slot 12 out of range"),
        ([1, p.PREFILL, 4, 3, 5], "PREFILL chunk (len=4, start=3) does not fit a prompt of 5 tokens"),
        ([1, p.PREFILL, 0, 0, 5], "PREFILL chunk (len=0, start=0)"),
        ([1, p.PREFILL, 1, 0, 2, 7, 7, 3], "announces 3 vision rows for a prompt of 2 tokens"),
        ([1, 64], "token 64 out of range (vocab_size=64)"),
        ([0, p.DECODE_BATCH, 1, 0, 70], "token 70 out of range"),
    ],
)
def test_bad_streams_name_the_problem(words, message):
    with pytest.raises(ProtocolError) as e:
        decode_all(words, max_slots=8, vocab_size=64)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "cmd, name",
    [
        (Prefill(0, 0, 5, (1, 2, 3, 4, 5)), "PREFILL"),
        (DecodeBatch((0, 1), (3, 4)), "DECODE_BATCH"),
        (Compact(0, 1), "COMPACT"),
        (Fork(0, 1), "FORK"),
        (DecodeCkpt(0, 1, 2, 3, 4), "DECODE_CKPT"),
    ],
)
def test_truncated_payload_is_reported(cmd, name):
    words = encode(cmd)[:-1]
    with pytest.raises(ProtocolError, match=f"truncated {name}"):
        decode_all(words)
    with pytest.raises(ProtocolError, match="truncated preamble"):
        decode_all([3])


def test_vocabulary_must_stay_below_the_command_words():
    assert p.validate_vocab_size(0xFFFFFFE0) == 0xFFFFFFE0  # ids 0..0xFFFFFFDF
    for bad in (0xFFFFFFE1, 0, -1):
        with pytest.raises(ProtocolError, match="vocabulary size"):
            p.validate_vocab_size(bad)
    with pytest.raises(ProtocolError, match="vocabulary size"):
        Decoder(vocab_size=2**32)


def test_encode_refuses_what_cannot_travel():
    with pytest.raises(ProtocolError, match="collides with the reserved command words"):
        encode(Decode1(0, 0xFFFFFFE0))
    with pytest.raises(ProtocolError, match="2 slots but 1 tokens"):
        encode(DecodeBatch((0, 1), (5,)))
    with pytest.raises(ProtocolError, match="at most 4"):
        encode(Verify((0,), (1,), ((1, 2, 3, 4, 5),)))
    with pytest.raises(ProtocolError, match="2 slots, 1 tokens"):
        encode(Verify((0, 1), (1,), ((), ())))
    with pytest.raises(ProtocolError, match="2 slots but 1 counts"):
        encode(Accept((0, 1), (1,)))


def test_verify_rows_are_bounded_by_the_command_word():
    with pytest.raises(ProtocolError, match="VERIFY_K2 row with 3 drafts"):
        decode_all([0, p.VERIFY_K2, 1, 0, 9, 3, 1, 2, 3])
    with pytest.raises(ProtocolError, match="VERIFY_MTP row with 5 drafts"):
        decode_all([0, p.VERIFY_MTP, 1, 0, 9, 5])
    with pytest.raises(ProtocolError, match=r"VERIFY_MTP counts \[5\]: each must be in \[0, 4\]"):
        encode(VerifyMtp((0,), (9,), (5,)))
    with pytest.raises(ProtocolError, match="ACCEPT of 5 drafts"):
        decode_all([0, p.ACCEPT, 1, 0, 5])
    with pytest.raises(ProtocolError, match="ACCEPT of 9 rows"):
        decode_all([0, p.ACCEPT, 9, 0, 5], max_slots=4)
    with pytest.raises(ProtocolError, match="-1 is not an unsigned 32-bit"):
        encode(Compact(-1, 0))
    with pytest.raises(ProtocolError, match=str(2**32)):
        p.as_words([1, 2**32])
    with pytest.raises(ProtocolError, match="must be integers"):
        p.as_words(np.array([1.5]))
    with pytest.raises(ProtocolError, match="not a protocol command"):
        encode("SHUTDOWN")
