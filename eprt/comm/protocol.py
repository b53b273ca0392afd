"""The broadcast protocol of docs/protocol.md: command words, typed commands, the one
encoder and the incremental decoder. The vision rows announced by a PREFILL travel outside
the word stream (``eprt/comm/transport.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from eprt.api import TOKEN_ID_LIMIT

RESERVED_BASE = TOKEN_ID_LIMIT  # every word >= this is a command, so token ids stay below it
DECODE_BATCH = 0xFFFFFFE0
COMPACT = 0xFFFFFFE2
PREFILL_NEXT = 0xFFFFFFE4
OWNER = 0xFFFFFFEA
DECODE_DP = 0xFFFFFFEB
PREFILL = 0xFFFFFFF0
RELEASE = 0xFFFFFFF1
VERIFY_K2 = 0xFFFFFFF2
VERIFY_K3 = 0xFFFFFFF3
VERIFY_K4 = 0xFFFFFFF4
DECODE_CKPT = 0xFFFFFFF8
SHUTDOWN = 0xFFFFFFFF
WORD_MAX = 0xFFFFFFFF

VERIFY_WORDS = {VERIFY_K2: 2, VERIFY_K3: 3, VERIFY_K4: 4}  # command word -> K drafts
NAMES = {
    DECODE_BATCH: "DECODE_BATCH",
    COMPACT: "COMPACT",
    PREFILL_NEXT: "PREFILL_NEXT",
    OWNER: "OWNER",
    DECODE_DP: "DECODE_DP",
    PREFILL: "PREFILL",
    RELEASE: "RELEASE",
    VERIFY_K2: "VERIFY_K2",
    VERIFY_K3: "VERIFY_K3",
    VERIFY_K4: "VERIFY_K4",
    DECODE_CKPT: "DECODE_CKPT",
    SHUTDOWN: "SHUTDOWN",
}


class ProtocolError(ValueError):
    """A word stream that does not follow the protocol (or a command that cannot be encoded)."""


@dataclass(frozen=True)
class Decode1:
    """Append ``token`` to ``slot`` and run one decode step (the preamble's cmd is the token)."""

    slot: int
    token: int


@dataclass(frozen=True)
class DecodeBatch:
    """One batched decode step; row r appends ``tokens[r]`` to ``slots[r]``."""

    slots: tuple[int, ...]
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Compact:
    """Move the sequence in ``slot`` to the empty ``new_slot``."""

    slot: int
    new_slot: int


@dataclass(frozen=True)
class Prefill:
    """Prefill ``tokens[chunk_start : chunk_start + chunk_len]`` of the whole prompt ``tokens``
    into ``slot``; ``vision_rows`` rows (rows x hidden) follow the frame when non-zero."""

    slot: int
    chunk_start: int
    chunk_len: int
    tokens: tuple[int, ...]
    vision_rows: int = 0

    @property
    def full_len(self) -> int:
        return len(self.tokens)

    @property
    def is_last_chunk(self) -> bool:
        return self.chunk_start + self.chunk_len >= self.full_len


@dataclass(frozen=True)
class PrefillNext:
    """Prefill the next chunk of the prompt a PREFILL put into ``slot``: ``tokens`` are the
    prompt's tokens ``[chunk_start, chunk_start + len(tokens))``."""

    slot: int
    chunk_start: int
    tokens: tuple[int, ...]

    @property
    def chunk_len(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Release:
    """Free the sequence in ``slot``."""

    slot: int


@dataclass(frozen=True)
class Verify:
    """Speculative verify of ``len(drafts)`` (2..4) drafts (reserved: workers reject it)."""

    slot: int
    drafts: tuple[int, ...]
    accepted: int


@dataclass(frozen=True)
class DecodeCkpt:
    """Save the slot's recurrent state (hybrid models) as the snapshot of its stored prefix."""

    slot: int
    snapshot_tokens: int
    end_block: int
    session_hash: int  # 64-bit, sent as lo, hi
    adapter_id: int  # 64-bit, sent as lo, hi


@dataclass(frozen=True)
class Owner:
    """dp attention: the sequence the next PREFILL puts into ``slot`` lives on rank ``owner``."""

    slot: int
    owner: int


@dataclass(frozen=True)
class DecodeDp:
    """dp attention: one batched decode step, rows as in DECODE_BATCH; ``counts[r]`` rows are
    owned by rank r (one count per rank of the world)."""

    slots: tuple[int, ...]
    tokens: tuple[int, ...]
    counts: tuple[int, ...]


@dataclass(frozen=True)
class Shutdown:
    """Free every slot and leave the worker loop."""


Command = (
    Decode1
    | DecodeBatch
    | Compact
    | Prefill
    | PrefillNext
    | Release
    | Verify
    | DecodeCkpt
    | Owner
    | DecodeDp
    | Shutdown
)


def validate_vocab_size(vocab_size: int) -> int:
    """Token ids share the word space with command words, so ids must stay below RESERVED_BASE."""
    if not 0 < vocab_size <= RESERVED_BASE:
        raise ProtocolError(
            f"vocabulary size {vocab_size} does not fit the protocol: token ids must be < 0x{RESERVED_BASE:08X}"
        )
    return vocab_size


def encode(cmd: Command) -> np.ndarray:
    """The words of one command, preamble included, as a uint32 array."""
    if isinstance(cmd, Decode1):
        if not 0 <= cmd.token < RESERVED_BASE:
            raise ProtocolError(f"decode token {cmd.token} collides with the reserved command words")
        words = [cmd.slot, cmd.token]
    elif isinstance(cmd, DecodeBatch):
        if len(cmd.slots) != len(cmd.tokens):
            raise ProtocolError(f"DECODE_BATCH has {len(cmd.slots)} slots but {len(cmd.tokens)} tokens")
        words = [0, DECODE_BATCH, len(cmd.slots), *cmd.slots, *cmd.tokens]
    elif isinstance(cmd, Compact):
        words = [cmd.slot, COMPACT, cmd.new_slot]
    elif isinstance(cmd, Prefill):
        words = [cmd.slot, PREFILL, cmd.chunk_len, cmd.chunk_start, cmd.full_len, *cmd.tokens, cmd.vision_rows]
    elif isinstance(cmd, PrefillNext):
        if not cmd.tokens:
            raise ProtocolError("PREFILL_NEXT needs at least one token")
        words = [cmd.slot, PREFILL_NEXT, cmd.chunk_len, cmd.chunk_start, *cmd.tokens]
    elif isinstance(cmd, Release):
        words = [cmd.slot, RELEASE]
    elif isinstance(cmd, Verify):
        k = len(cmd.drafts)
        if k not in VERIFY_WORDS.values():
            raise ProtocolError(f"VERIFY takes 2 to 4 drafts, got {k}")
        words = [cmd.slot, VERIFY_K2 + k - 2, *cmd.drafts, cmd.accepted]
    elif isinstance(cmd, DecodeCkpt):
        words = [
            cmd.slot,
            DECODE_CKPT,
            cmd.snapshot_tokens,
            cmd.end_block,
            cmd.session_hash & WORD_MAX,
            cmd.session_hash >> 32,
            cmd.adapter_id & WORD_MAX,
            cmd.adapter_id >> 32,
        ]
    elif isinstance(cmd, Owner):
        words = [cmd.slot, OWNER, cmd.owner]
    elif isinstance(cmd, DecodeDp):
        if len(cmd.slots) != len(cmd.tokens) or sum(cmd.counts) != len(cmd.slots):
            raise ProtocolError(
                f"DECODE_DP has {len(cmd.slots)} slots, {len(cmd.tokens)} tokens and rows per rank "
                f"{list(cmd.counts)} (summing to {sum(cmd.counts)}): all three must agree"
            )
        words = [0, DECODE_DP, len(cmd.slots), len(cmd.counts), *cmd.counts, *cmd.slots, *cmd.tokens]
    elif isinstance(cmd, Shutdown):
        words = [0, SHUTDOWN]
    else:
        raise ProtocolError(f"not a protocol command: {cmd!r}")
    return as_words(words)


def as_words(values: Iterable[int] | np.ndarray) -> np.ndarray:
    """``values`` as a uint32 array, refusing anything that is not a 32-bit unsigned word."""
    arr = np.asarray(values if isinstance(values, np.ndarray) else list(values))
    if arr.dtype == np.uint32:
        return arr.ravel()
    if arr.size == 0:
        return np.zeros(0, np.uint32)
    if arr.dtype.kind not in "iu":
        raise ProtocolError(f"protocol words must be integers, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() > WORD_MAX:
        bad = int(arr.min()) if arr.min() < 0 else int(arr.max())
        raise ProtocolError(f"{bad} is not an unsigned 32-bit protocol word")
    return arr.astype(np.uint32).ravel()


class Decoder:
    """Incremental decoder: ``feed`` words as they arrive (in any chunking), take commands with
    ``next()`` (None until a whole command has arrived) or by iterating.

    With ``max_slots`` every slot is range-checked; with ``vocab_size`` every token is.
    """

    def __init__(self, max_slots: int | None = None, vocab_size: int | None = None):
        self.max_slots = max_slots
        self.vocab_size = validate_vocab_size(vocab_size) if vocab_size is not None else None
        self._buf = np.zeros(0, np.uint32)
        self._pos = 0

    @property
    def pending(self) -> int:
        """Words received but not yet part of a whole command."""
        return len(self._buf) - self._pos

    def feed(self, words: np.ndarray | Sequence[int]) -> None:
        words = as_words(words)
        rest = self._buf[self._pos :]
        self._buf = words.copy() if len(rest) == 0 else np.concatenate([rest, words])
        self._pos = 0

    def __iter__(self) -> Iterator[Command]:
        while (cmd := self.next()) is not None:
            yield cmd

    def finish(self) -> None:
        """Declare the stream over: leftover words mean a truncated command."""
        if self.pending:
            head = self._buf[self._pos : self._pos + 2].tolist()
            name = _name(head[1]) if len(head) == 2 else "preamble"
            raise ProtocolError(f"truncated {name}: stream ended inside a command ({self.pending} words left over)")

    def next(self) -> Command | None:
        """The next whole command, or None if its words have not all arrived yet."""
        b, p = self._buf, self._pos
        if len(b) - p < 2:
            return None
        seq, cmd = int(b[p]), int(b[p + 1])
        body = p + 2  # first payload word
        if cmd < RESERVED_BASE:
            out, end = Decode1(self._slot(seq, "decode"), self._token(cmd)), body
        elif cmd == DECODE_BATCH:
            if len(b) - body < 1:
                return None
            n = int(b[body])
            if not 1 <= n <= (self.max_slots or n):
                raise ProtocolError(f"DECODE_BATCH of {n} rows (must be 1..{self.max_slots})")
            end = body + 1 + 2 * n
            if len(b) < end:
                return None
            slots = tuple(self._slot(s, "DECODE_BATCH") for s in b[body + 1 : body + 1 + n].tolist())
            out = DecodeBatch(slots, self._tokens(b[body + 1 + n : end]))
        elif cmd == COMPACT:
            end = body + 1
            if len(b) < end:
                return None
            out = Compact(self._slot(seq, "COMPACT"), self._slot(int(b[body]), "COMPACT new_slot"))
        elif cmd == PREFILL:
            if len(b) - body < 3:
                return None
            chunk_len, chunk_start, full_len = (int(x) for x in b[body : body + 3])
            if full_len < 1 or chunk_len < 1 or chunk_start + chunk_len > full_len:
                raise ProtocolError(
                    f"PREFILL chunk (len={chunk_len}, start={chunk_start}) does not fit a prompt of {full_len} tokens"
                )
            end = body + 3 + full_len + 1
            if len(b) < end:
                return None
            tokens = self._tokens(b[body + 3 : end - 1])
            vision_rows = int(b[end - 1])
            if vision_rows > full_len:
                raise ProtocolError(
                    f"PREFILL announces {vision_rows} vision rows for a prompt of "
                    f"{full_len} tokens (at most one row per position)"
                )
            out = Prefill(self._slot(seq, "PREFILL"), chunk_start, chunk_len, tokens, vision_rows)
        elif cmd == PREFILL_NEXT:
            if len(b) - body < 2:
                return None
            chunk_len, chunk_start = int(b[body]), int(b[body + 1])
            if chunk_len < 1:
                raise ProtocolError(f"PREFILL_NEXT chunk of {chunk_len} tokens (must be >= 1)")
            end = body + 2 + chunk_len
            if len(b) < end:
                return None
            out = PrefillNext(self._slot(seq, "PREFILL_NEXT"), chunk_start, self._tokens(b[body + 2 : end]))
        elif cmd == RELEASE:
            out, end = Release(self._slot(seq, "RELEASE")), body
        elif cmd in VERIFY_WORDS:
            end = body + VERIFY_WORDS[cmd] + 1
            if len(b) < end:
                return None
            out = Verify(self._slot(seq, _name(cmd)), self._tokens(b[body : end - 1]), int(b[end - 1]))
        elif cmd == DECODE_CKPT:
            end = body + 6
            if len(b) < end:
                return None
            w = b[body:end].tolist()
            out = DecodeCkpt(self._slot(seq, "DECODE_CKPT"), w[0], w[1], w[2] | w[3] << 32, w[4] | w[5] << 32)
        elif cmd == OWNER:
            end = body + 1
            if len(b) < end:
                return None
            out = Owner(self._slot(seq, "OWNER"), int(b[body]))
        elif cmd == DECODE_DP:
            if len(b) - body < 2:
                return None
            n, ranks = int(b[body]), int(b[body + 1])
            if not 1 <= n <= (self.max_slots or n) or ranks < 1:
                raise ProtocolError(f"DECODE_DP of {n} rows over {ranks} ranks (rows 1..{self.max_slots}, ranks >= 1)")
            head = body + 2 + ranks
            end = head + 2 * n
            if len(b) < end:
                return None
            counts = tuple(b[body + 2 : head].tolist())
            if sum(counts) != n:
                raise ProtocolError(f"DECODE_DP rows per rank {list(counts)} do not sum to its {n} rows")
            slots = tuple(self._slot(s, "DECODE_DP") for s in b[head : head + n].tolist())
            out = DecodeDp(slots, self._tokens(b[head + n : end]), counts)
        elif cmd == SHUTDOWN:
            out, end = Shutdown(), body
        else:
            raise ProtocolError(f"unknown reserved command word 0x{cmd:08X} (slot word {seq})")
        self._pos = end
        return out

    def _slot(self, slot: int, what: str) -> int:
        if self.max_slots is not None and not 0 <= slot < self.max_slots:
            raise ProtocolError(f"{what}: slot {slot} out of range (max_slots={self.max_slots})")
        return slot

    def _token(self, token: int) -> int:
        if self.vocab_size is not None and token >= self.vocab_size:
            raise ProtocolError(f"token {token} out of range (vocab_size={self.vocab_size})")
        return token

    def _tokens(self, words: np.ndarray) -> tuple[int, ...]:
        if len(words):
            self._token(int(words.max()))
        return tuple(words.tolist())


def decode_all(
    words: np.ndarray | Sequence[int], max_slots: int | None = None, vocab_size: int | None = None
) -> list[Command]:
    """Decode a complete stream; a trailing partial command is a ProtocolError."""
    dec = Decoder(max_slots, vocab_size)
    dec.feed(words)
    cmds = list(dec)
    dec.finish()
    return cmds


def _name(cmd: int) -> str:
    return NAMES.get(cmd, "decode" if cmd < RESERVED_BASE else f"0x{cmd:08X}")
