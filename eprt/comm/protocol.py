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
CHECK_STATE = 0xFFFFFFE3
PREFILL_NEXT = 0xFFFFFFE4
ACCEPT = 0xFFFFFFE6
FORK = 0xFFFFFFE8
EPLB_PLACEMENT = 0xFFFFFFEA
LORA_LOAD = 0xFFFFFFEC
LORA_UNLOAD = 0xFFFFFFED
SLOT_ADAPTER = 0xFFFFFFEE
OWNER = 0xFFFFFFEF
DECODE_DP = 0xFFFFFFE1
PREFILL = 0xFFFFFFF0
RELEASE = 0xFFFFFFF1
VERIFY_K2 = 0xFFFFFFF2
VERIFY_K3 = 0xFFFFFFF3
VERIFY_K4 = 0xFFFFFFF4
VERIFY_MTP = 0xFFFFFFF5
DECODE_CKPT = 0xFFFFFFF8
SHUTDOWN = 0xFFFFFFFF
WORD_MAX = 0xFFFFFFFF
MAX_PATH_BYTES = 4096  # a LORA_LOAD's adapter path (UTF-8)

VERIFY_WORDS = {VERIFY_K2: 2, VERIFY_K3: 3, VERIFY_K4: 4}  # command word -> K, the most drafts of a row
MAX_DRAFTS = 4
NAMES = {
    DECODE_BATCH: "DECODE_BATCH",
    COMPACT: "COMPACT",
    CHECK_STATE: "CHECK_STATE",
    PREFILL_NEXT: "PREFILL_NEXT",
    ACCEPT: "ACCEPT",
    FORK: "FORK",
    EPLB_PLACEMENT: "EPLB_PLACEMENT",
    LORA_LOAD: "LORA_LOAD",
    LORA_UNLOAD: "LORA_UNLOAD",
    SLOT_ADAPTER: "SLOT_ADAPTER",
    OWNER: "OWNER",
    DECODE_DP: "DECODE_DP",
    PREFILL: "PREFILL",
    RELEASE: "RELEASE",
    VERIFY_K2: "VERIFY_K2",
    VERIFY_K3: "VERIFY_K3",
    VERIFY_K4: "VERIFY_K4",
    VERIFY_MTP: "VERIFY_MTP",
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
class Fork:
    """Occupy the empty ``new_slot`` with a copy of the prefilled sequence in ``slot`` (one more
    choice of its prompt: full KV blocks shared, the partial last one copied)."""

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
    """One batched verify step: row r appends ``tokens[r]`` then its drafts ``drafts[r]`` (0..4
    tokens) to ``slots[r]``; the drafts stay pending until the ACCEPT that follows."""

    slots: tuple[int, ...]
    tokens: tuple[int, ...]
    drafts: tuple[tuple[int, ...], ...]

    @property
    def k(self) -> int:
        """The K of the command word VERIFY_K2..K4: the most drafts of a row, at least 2."""
        return max(2, *(len(d) for d in self.drafts))


@dataclass(frozen=True)
class VerifyMtp:
    """A verify step whose drafts the MTP layer computes on every rank: row r appends ``tokens[r]``
    and ``counts[r]`` (0..4) drafts to ``slots[r]`` (docs/protocol.md, "VERIFY_MTP")."""

    slots: tuple[int, ...]
    tokens: tuple[int, ...]
    counts: tuple[int, ...]


@dataclass(frozen=True)
class Accept:
    """Close the last VERIFY: row r keeps ``accepted[r]`` of the drafts it sent to ``slots[r]``."""

    slots: tuple[int, ...]
    accepted: tuple[int, ...]


@dataclass(frozen=True)
class DecodeCkpt:
    """Save the slot's recurrent state (hybrid models) as the snapshot of its stored prefix."""

    slot: int
    snapshot_tokens: int
    end_block: int
    session_hash: int  # 64-bit, sent as lo, hi
    adapter_id: int  # 64-bit, sent as lo, hi


EPLB_TABLE_MAX = 1 << 22  # words of one placement table (layers x physical slots)


@dataclass(frozen=True)
class EplbPlacement:
    """From the next forward pass, hold the experts of ``table`` (layers x slots logical expert ids,
    row-major): EPLB's rebalance, numbered by ``epoch``."""

    epoch: int
    layers: int
    slots: int
    table: tuple[int, ...]


@dataclass(frozen=True)
class LoraLoad:
    """Read this rank's share of the LoRA adapter at ``path`` into ``lora_slot`` (replacing its adapter)."""

    lora_slot: int
    adapter_id: int  # 64-bit, sent as lo, hi
    path: str


@dataclass(frozen=True)
class LoraUnload:
    """Empty ``lora_slot``."""

    lora_slot: int


@dataclass(frozen=True)
class SlotAdapter:
    """The next PREFILL into the empty ``slot`` uses the adapter in ``lora_slot``."""

    slot: int
    lora_slot: int


@dataclass(frozen=True)
class Owner:
    """dp attention: the sequence the next PREFILL puts into ``slot`` lives on rank ``owner``;
    ``prompt_hidden`` 1: its prefill returns every prompt position's hidden state to rank 0
    (prompt logprobs), 0: only the last position's."""

    slot: int
    owner: int
    prompt_hidden: int = 0


@dataclass(frozen=True)
class DecodeDp:
    """dp attention: one batched decode step, rows as in DECODE_BATCH; ``counts[r]`` rows are
    owned by rank r (one count per rank of the world)."""

    slots: tuple[int, ...]
    tokens: tuple[int, ...]
    counts: tuple[int, ...]


@dataclass(frozen=True)
class CheckState:
    """``--check-state``: compare every rank's digests of its mirrored state after step ``step``."""

    step: int


@dataclass(frozen=True)
class Shutdown:
    """Free every slot and leave the worker loop."""


Command = (
    Decode1
    | DecodeBatch
    | Compact
    | Fork
    | Prefill
    | PrefillNext
    | Release
    | Verify
    | VerifyMtp
    | Accept
    | DecodeCkpt
    | EplbPlacement
    | LoraLoad
    | LoraUnload
    | SlotAdapter
    | Owner
    | DecodeDp
    | CheckState
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
    elif isinstance(cmd, Fork):
        words = [cmd.slot, FORK, cmd.new_slot]
    elif isinstance(cmd, Prefill):
        words = [cmd.slot, PREFILL, cmd.chunk_len, cmd.chunk_start, cmd.full_len, *cmd.tokens, cmd.vision_rows]
    elif isinstance(cmd, PrefillNext):
        if not cmd.tokens:
            raise ProtocolError("PREFILL_NEXT needs at least one token")
        words = [cmd.slot, PREFILL_NEXT, cmd.chunk_len, cmd.chunk_start, *cmd.tokens]
    elif isinstance(cmd, Release):
        words = [cmd.slot, RELEASE]
    elif isinstance(cmd, Verify):
        n = len(cmd.slots)
        if not n or len(cmd.tokens) != n or len(cmd.drafts) != n:
            raise ProtocolError(
                f"VERIFY needs as many tokens and draft lists as slots (>= 1), got {n} slots, "
                f"{len(cmd.tokens)} tokens, {len(cmd.drafts)} draft lists"
            )
        if cmd.k > MAX_DRAFTS:
            raise ProtocolError(f"VERIFY row with {cmd.k} drafts (at most {MAX_DRAFTS})")
        counts = [len(d) for d in cmd.drafts]
        drafts = [t for d in cmd.drafts for t in d]
        words = [0, VERIFY_K2 + cmd.k - 2, n, *cmd.slots, *cmd.tokens, *counts, *drafts]
    elif isinstance(cmd, VerifyMtp):
        n = len(cmd.slots)
        if not n or len(cmd.tokens) != n or len(cmd.counts) != n:
            raise ProtocolError(
                f"VERIFY_MTP needs as many tokens and counts as slots (>= 1), got {n} slots, "
                f"{len(cmd.tokens)} tokens, {len(cmd.counts)} counts"
            )
        if not all(0 <= c <= MAX_DRAFTS for c in cmd.counts):
            raise ProtocolError(f"VERIFY_MTP counts {list(cmd.counts)}: each must be in [0, {MAX_DRAFTS}]")
        words = [0, VERIFY_MTP, n, *cmd.slots, *cmd.tokens, *cmd.counts]
    elif isinstance(cmd, Accept):
        if len(cmd.slots) != len(cmd.accepted) or not cmd.slots:
            raise ProtocolError(f"ACCEPT has {len(cmd.slots)} slots but {len(cmd.accepted)} counts")
        words = [0, ACCEPT, len(cmd.slots), *cmd.slots, *cmd.accepted]
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
    elif isinstance(cmd, EplbPlacement):
        if cmd.layers * cmd.slots != len(cmd.table) or not 0 < len(cmd.table) <= EPLB_TABLE_MAX:
            raise ProtocolError(
                f"EPLB_PLACEMENT of {cmd.layers} x {cmd.slots} needs that many (1..{EPLB_TABLE_MAX}) expert ids, "
                f"got {len(cmd.table)}"
            )
        words = [0, EPLB_PLACEMENT, cmd.epoch, cmd.layers, cmd.slots, *cmd.table]
    elif isinstance(cmd, LoraLoad):
        raw = cmd.path.encode("utf-8")
        if not 0 < len(raw) <= MAX_PATH_BYTES:
            raise ProtocolError(f"LORA_LOAD path of {len(raw)} bytes (must be 1..{MAX_PATH_BYTES})")
        packed = np.frombuffer(raw + b"\0" * (-len(raw) % 4), dtype="<u4")
        words = [cmd.lora_slot, LORA_LOAD, cmd.adapter_id & WORD_MAX, cmd.adapter_id >> 32, len(raw), *packed.tolist()]
    elif isinstance(cmd, LoraUnload):
        words = [cmd.lora_slot, LORA_UNLOAD]
    elif isinstance(cmd, SlotAdapter):
        words = [cmd.slot, SLOT_ADAPTER, cmd.lora_slot]
    elif isinstance(cmd, Owner):
        words = [cmd.slot, OWNER, cmd.owner, cmd.prompt_hidden]
    elif isinstance(cmd, DecodeDp):
        if len(cmd.slots) != len(cmd.tokens) or sum(cmd.counts) != len(cmd.slots):
            raise ProtocolError(
                f"DECODE_DP has {len(cmd.slots)} slots, {len(cmd.tokens)} tokens and rows per rank "
                f"{list(cmd.counts)} (summing to {sum(cmd.counts)}): all three must agree"
            )
        words = [0, DECODE_DP, len(cmd.slots), len(cmd.counts), *cmd.counts, *cmd.slots, *cmd.tokens]
    elif isinstance(cmd, CheckState):
        words = [0, CHECK_STATE, cmd.step]
    elif isinstance(cmd, Shutdown):
        words = [0, SHUTDOWN]
    else:
        raise ProtocolError(f"not a protocol command: {cmd!r}")
    return as_words(words)


class DecodeBatchWords:
    """The DECODE_BATCH of one slot list encoded ahead of its tokens (rank 0 encodes the next step's
    while a step computes, eprt/engine/overlap.py): ``fill(tokens)`` is ``encode(DecodeBatch(slots, tokens))``."""

    def __init__(self, slots: tuple[int, ...]):
        self.slots = slots
        self._words = encode(DecodeBatch(slots, (0,) * len(slots)))  # the tokens' words are placeholders
        self._start = len(self._words) - len(slots)

    def fill(self, tokens) -> np.ndarray:
        words = self._words.copy()
        words[self._start :] = as_words(tokens)  # ProtocolError for a token that is not a word
        return words


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
        elif cmd == FORK:
            end = body + 1
            if len(b) < end:
                return None
            out = Fork(self._slot(seq, "FORK"), self._slot(int(b[body]), "FORK new_slot"))
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
        elif cmd == CHECK_STATE:
            end = body + 1
            if len(b) < end:
                return None
            out = CheckState(int(b[body]))
        elif cmd in VERIFY_WORDS:
            out, end = self._verify(b, body, VERIFY_WORDS[cmd])
            if out is None:
                return None
        elif cmd == VERIFY_MTP:
            if len(b) - body < 1:
                return None
            n = self._rows(int(b[body]), "VERIFY_MTP")
            end = body + 1 + 3 * n
            if len(b) < end:
                return None
            counts = tuple(b[body + 1 + 2 * n : end].tolist())
            if max(counts) > MAX_DRAFTS:
                raise ProtocolError(f"VERIFY_MTP row with {max(counts)} drafts (at most {MAX_DRAFTS})")
            slots = tuple(self._slot(s, "VERIFY_MTP") for s in b[body + 1 : body + 1 + n].tolist())
            out = VerifyMtp(slots, self._tokens(b[body + 1 + n : body + 1 + 2 * n]), counts)
        elif cmd == ACCEPT:
            if len(b) - body < 1:
                return None
            n = self._rows(int(b[body]), "ACCEPT")
            end = body + 1 + 2 * n
            if len(b) < end:
                return None
            slots = tuple(self._slot(s, "ACCEPT") for s in b[body + 1 : body + 1 + n].tolist())
            accepted = tuple(b[body + 1 + n : end].tolist())
            if max(accepted) > MAX_DRAFTS:
                raise ProtocolError(f"ACCEPT of {max(accepted)} drafts (a row sends at most {MAX_DRAFTS})")
            out = Accept(slots, accepted)
        elif cmd == DECODE_CKPT:
            end = body + 6
            if len(b) < end:
                return None
            w = b[body:end].tolist()
            out = DecodeCkpt(self._slot(seq, "DECODE_CKPT"), w[0], w[1], w[2] | w[3] << 32, w[4] | w[5] << 32)
        elif cmd == EPLB_PLACEMENT:
            if len(b) - body < 3:
                return None
            epoch, layers, slots = (int(x) for x in b[body : body + 3])
            if not 0 < layers * slots <= EPLB_TABLE_MAX:
                raise ProtocolError(f"EPLB_PLACEMENT of {layers} x {slots} slots (must be 1..{EPLB_TABLE_MAX} words)")
            end = body + 3 + layers * slots
            if len(b) < end:
                return None
            out = EplbPlacement(epoch, layers, slots, tuple(b[body + 3 : end].tolist()))
        elif cmd == LORA_LOAD:
            if len(b) - body < 3:
                return None
            nbytes = int(b[body + 2])
            if not 0 < nbytes <= MAX_PATH_BYTES:
                raise ProtocolError(f"LORA_LOAD path of {nbytes} bytes (must be 1..{MAX_PATH_BYTES})")
            end = body + 3 + -(-nbytes // 4)
            if len(b) < end:
                return None
            raw = b[body + 3 : end].astype("<u4").tobytes()[:nbytes]
            try:
                path = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ProtocolError(f"LORA_LOAD path is not UTF-8: {e}") from None
            out = LoraLoad(seq, int(b[body]) | int(b[body + 1]) << 32, path)
        elif cmd == LORA_UNLOAD:
            out, end = LoraUnload(seq), body
        elif cmd == SLOT_ADAPTER:
            end = body + 1
            if len(b) < end:
                return None
            out = SlotAdapter(self._slot(seq, "SLOT_ADAPTER"), int(b[body]))
        elif cmd == OWNER:
            end = body + 2
            if len(b) < end:
                return None
            if int(b[body + 1]) not in (0, 1):
                raise ProtocolError(f"OWNER prompt_hidden {int(b[body + 1])} (must be 0 or 1)")
            out = Owner(self._slot(seq, "OWNER"), int(b[body]), int(b[body + 1]))
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

    def _rows(self, n: int, what: str) -> int:
        if not 1 <= n <= (self.max_slots or n):
            raise ProtocolError(f"{what} of {n} rows (must be 1..{self.max_slots})")
        return n

    def _verify(self, b: np.ndarray, body: int, k: int) -> tuple[Verify | None, int]:
        """VERIFY_Kk: ``n``, ``slots[n]``, ``tokens[n]``, ``counts[n]`` (each 0..k), the drafts."""
        if len(b) - body < 1:
            return None, body
        n = self._rows(int(b[body]), f"VERIFY_K{k}")
        head = body + 1 + 3 * n
        if len(b) < head:
            return None, body
        counts = b[body + 1 + 2 * n : head].tolist()
        if max(counts) > k:
            raise ProtocolError(f"VERIFY_K{k} row with {max(counts)} drafts (at most {k})")
        end = head + sum(counts)
        if len(b) < end:
            return None, body
        slots = tuple(self._slot(s, f"VERIFY_K{k}") for s in b[body + 1 : body + 1 + n].tolist())
        tokens = self._tokens(b[body + 1 + n : body + 1 + 2 * n])
        flat, at, drafts = self._tokens(b[head:end]), 0, []
        for c in counts:
            drafts.append(flat[at : at + c])
            at += c
        return Verify(slots, tokens, tuple(drafts)), end

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
