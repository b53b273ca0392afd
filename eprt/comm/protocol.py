"""The broadcast protocol of docs/protocol.md: one declaration per command (its command word, its
words in wire order with their checks, its worker action and its line of docs/protocol.md's
table), from which the encoder, the incremental decoder and the worker's dispatch
(``eprt/comm/worker.py``) are derived; ``tests/test_protocol.py`` checks docs/protocol.md against
the declarations. The vision rows announced by a PREFILL travel outside the word stream
(``eprt/comm/transport.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields

import numpy as np

from eprt.api import TOKEN_ID_LIMIT

RESERVED_BASE = TOKEN_ID_LIMIT  # every word >= this is a command, so token ids stay below it
DECODE_BATCH = 0xFFFFFFE0
DECODE_DP = 0xFFFFFFE1
COMPACT = 0xFFFFFFE2
CHECK_STATE = 0xFFFFFFE3
PREFILL_NEXT = 0xFFFFFFE4
ACCEPT = 0xFFFFFFE6
ROLLBACK = 0xFFFFFFE7
FORK = 0xFFFFFFE8
EPLB_PLACEMENT = 0xFFFFFFEA
LORA_LOAD = 0xFFFFFFEC
LORA_UNLOAD = 0xFFFFFFED
SLOT_ADAPTER = 0xFFFFFFEE
OWNER = 0xFFFFFFEF
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
EPLB_TABLE_MAX = 1 << 22  # words of one placement table (layers x physical slots)

VERIFY_WORDS = {VERIFY_K2: 2, VERIFY_K3: 3, VERIFY_K4: 4}  # command word -> K, the most drafts of a row
MAX_DRAFTS = 4


class ProtocolError(ValueError):
    """A word stream that does not follow the protocol (or a command that cannot be encoded)."""


# ---- the typed commands ------------------------------------------------------------------
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
class Rollback:
    """Drop the last ``n`` stored tokens of the sequence in ``slot`` (a token the scheduler discarded:
    the step that stored its input runs again)."""

    slot: int
    n: int


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

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(len(d) for d in self.drafts)


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
    | Rollback
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


# ---- the words of a command, part by part --------------------------------------------------
class _Short(Exception):
    """A command's words have not all arrived yet."""


class _Reader:
    """Words of one command as they are decoded; ``take`` raises _Short past the end."""

    def __init__(self, buf: np.ndarray, pos: int, decoder: Decoder, name: str, word: int):
        self.buf, self.pos, self.decoder, self.name, self.word = buf, pos, decoder, name, word

    def take(self, n: int) -> np.ndarray:
        if len(self.buf) - self.pos < n:
            raise _Short
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out


Check = Callable[[dict, "_Reader"], str | None]  # the values so far -> an error text, or None


@dataclass(frozen=True)
class Part:
    """One field of a command's payload: ``size`` words (a count: a name decoded before, or a
    function of the values so far), put from / decoded into the command attribute ``name``.
    ``kind``: word | slot | count (an array's length) | rows (a count of rows, 1..max_slots) | tokens
    | slots | words | u64 | text | drafts.
    ``check`` runs as soon as the part is decoded (so a bad count is named before its array)."""

    name: str
    kind: str = "word"
    size: object = 1
    doc: str = ""
    check: Check | None = None
    attr: str | None = None  # the command attribute the part encodes, when not ``name``

    def put(self, cmd, out: list) -> None:
        value = getattr(cmd, self.attr or self.name)
        if self.kind in ("word", "slot"):
            out.append(value)
        elif self.kind in ("count", "rows"):
            out.append(len(value))
        elif self.kind == "u64":
            out += [value & WORD_MAX, value >> 32]
        elif self.kind == "text":
            raw = value.encode("utf-8")
            out += [len(raw), *np.frombuffer(raw + b"\0" * (-len(raw) % 4), dtype="<u4").tolist()]
        elif self.kind == "drafts":
            out += [t for d in value for t in d]
        else:  # an array
            out += list(value)

    def get(self, r: _Reader, values: dict) -> None:
        dec, what = r.decoder, self._what(r)
        if self.kind in ("word", "slot", "count", "rows"):
            v = int(r.take(1)[0])
            values[self.name] = dec.slot(v, what) if self.kind == "slot" else v
            if self.kind == "rows":
                dec.rows(v, r.name)
        elif self.kind == "u64":
            lo, hi = r.take(2).tolist()
            values[self.name] = lo | hi << 32
        elif self.kind == "text":
            values[self.name] = _text(r)
        elif self.kind == "drafts":
            flat, at, drafts = dec.tokens(r.take(sum(values["counts"]))), 0, []
            for c in values["counts"]:
                drafts.append(flat[at : at + c])
                at += c
            values[self.name] = tuple(drafts)
        else:
            n = values[self.size] if isinstance(self.size, str) else self.size(values)
            words = r.take(n)
            if self.kind == "tokens":
                values[self.name] = dec.tokens(words)
            elif self.kind == "slots":
                values[self.name] = tuple(dec.slot(s, what) for s in words.tolist())
            else:
                values[self.name] = tuple(words.tolist())
        error = None if self.check is None else self.check(values, r)
        if error is not None:
            raise ProtocolError(error)

    def _what(self, r: _Reader) -> str:
        """How a range error names this field: the command's name, and for a second slot its field."""
        return r.name if self.kind == "slots" else f"{r.name} {self.name}"


def _text(r: _Reader) -> str:
    nbytes = int(r.take(1)[0])
    if not 0 < nbytes <= MAX_PATH_BYTES:
        raise ProtocolError(f"{r.name} path of {nbytes} bytes (must be 1..{MAX_PATH_BYTES})")
    raw = r.take(-(-nbytes // 4)).astype("<u4").tobytes()[:nbytes]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"{r.name} path is not UTF-8: {e}") from None


@dataclass(frozen=True)
class Declaration:
    """One command: its type, name and command word(s), ``seq`` (what the preamble's first word
    holds: the attribute ``slot`` (range-checked), ``lora_slot``, or None for 0), its payload
    ``parts`` in wire order, ``refuse`` (why a command cannot be encoded, or None), the worker's
    ``action`` on its executor, and its row of docs/protocol.md's table (``doc``: payload
    remarks after the parts, when rank 0 sends it, what the worker does)."""

    cls: type
    name: str
    words: tuple[int, ...]
    parts: tuple[Part, ...]
    action: Callable
    when: str
    does: str
    seq: str | None = "slot"
    note: str = ""
    refuse: Callable[[object], str | None] | None = None
    word_of: Callable[[object], int] | None = None  # the command word of a command (VERIFY: by K)
    dp_only: bool = False  # refused by a worker running replicated attention

    def encode(self, cmd) -> list:
        error = None if self.refuse is None else self.refuse(cmd)
        if error is not None:
            raise ProtocolError(error)
        seq = 0 if self.seq is None else getattr(cmd, self.seq)
        out = [seq, self.words[0] if self.word_of is None else self.word_of(cmd)]
        for part in self.parts:
            part.put(cmd, out)
        return out

    def decode(self, r: _Reader, seq: int):
        values: dict = {}
        if self.seq == "slot":
            values["slot"] = r.decoder.slot(seq, self.name)
        elif self.seq is not None:
            values[self.seq] = seq
        for part in self.parts:
            part.get(r, values)
        return self.cls(**{f.name: values[f.name] for f in fields(self.cls)})

    def payload_doc(self) -> str:
        """The table's payload column: the parts' words, then the remarks."""
        words = ", ".join(p.doc or f"`{p.name}`" for p in self.parts) or ("" if self.note else "none")
        seq = {None: "`seq` is 0", "slot": "", "lora_slot": "`seq` is the LoRA slot"}[self.seq]
        return "; ".join(x for x in (words, self.note, seq) if x)

    def doc_row(self) -> str:
        if self.name == "decode one token":
            word = f"`< 0x{RESERVED_BASE:08X}`"
        elif len(self.words) > 1:
            word = f"`0x{self.words[0]:08X}..{self.words[-1] & 0xFF:02X}`"
        else:
            word = f"`0x{self.words[0]:08X}`"
        return f"| {word} | {self.name} | {self.payload_doc()} | {self.when} | {self.does} |"


# ---- the declarations -----------------------------------------------------------------------
def _rows_match(*names: str, what: str) -> Callable:
    """A refusal unless the arrays ``names`` of a batched command are as long as its first."""

    def refuse(cmd) -> str | None:
        n = len(getattr(cmd, names[0]))
        lengths = [len(getattr(cmd, x)) for x in names[1:]]
        if n and all(m == n for m in lengths):
            return None
        listed = ", ".join(f"{len(getattr(cmd, x))} {x}" for x in names[1:])
        return f"{what} needs as many {' and '.join(names[1:])} as {names[0]} (>= 1), got {n} {names[0]}, {listed}"

    return refuse


def _refuse_decode_batch(cmd) -> str | None:
    if len(cmd.slots) != len(cmd.tokens):
        return f"DECODE_BATCH has {len(cmd.slots)} slots but {len(cmd.tokens)} tokens"
    return None


def _refuse_verify(cmd) -> str | None:
    n = len(cmd.slots)
    if not n or len(cmd.tokens) != n or len(cmd.drafts) != n:
        return (
            f"VERIFY needs as many tokens and draft lists as slots (>= 1), got {n} slots, "
            f"{len(cmd.tokens)} tokens, {len(cmd.drafts)} draft lists"
        )
    return f"VERIFY row with {cmd.k} drafts (at most {MAX_DRAFTS})" if cmd.k > MAX_DRAFTS else None


def _refuse_verify_mtp(cmd) -> str | None:
    error = _rows_match("slots", "tokens", "counts", what="VERIFY_MTP")(cmd)
    if error is None and not all(0 <= c <= MAX_DRAFTS for c in cmd.counts):
        return f"VERIFY_MTP counts {list(cmd.counts)}: each must be in [0, {MAX_DRAFTS}]"
    return error


def _refuse_accept(cmd) -> str | None:
    if len(cmd.slots) != len(cmd.accepted) or not cmd.slots:
        return f"ACCEPT has {len(cmd.slots)} slots but {len(cmd.accepted)} counts"
    return None


def _refuse_decode_dp(cmd) -> str | None:
    if len(cmd.slots) != len(cmd.tokens) or sum(cmd.counts) != len(cmd.slots):
        return (
            f"DECODE_DP has {len(cmd.slots)} slots, {len(cmd.tokens)} tokens and rows per rank "
            f"{list(cmd.counts)} (summing to {sum(cmd.counts)}): all three must agree"
        )
    return None


def _refuse_eplb(cmd) -> str | None:
    if cmd.layers * cmd.slots != len(cmd.table) or not 0 < len(cmd.table) <= EPLB_TABLE_MAX:
        return (
            f"EPLB_PLACEMENT of {cmd.layers} x {cmd.slots} needs that many (1..{EPLB_TABLE_MAX}) expert ids, "
            f"got {len(cmd.table)}"
        )
    return None


def _refuse_lora_load(cmd) -> str | None:
    nbytes = len(cmd.path.encode("utf-8"))
    return None if 0 < nbytes <= MAX_PATH_BYTES else f"LORA_LOAD path of {nbytes} bytes (must be 1..{MAX_PATH_BYTES})"


def _prefill_fits(v: dict, r: _Reader) -> str | None:
    if v["full_len"] < 1 or v["chunk_len"] < 1 or v["chunk_start"] + v["chunk_len"] > v["full_len"]:
        return (
            f"PREFILL chunk (len={v['chunk_len']}, start={v['chunk_start']}) "
            f"does not fit a prompt of {v['full_len']} tokens"
        )
    return None


def _vision_fits(v: dict, r: _Reader) -> str | None:
    if v["vision_rows"] > v["full_len"]:
        return (
            f"PREFILL announces {v['vision_rows']} vision rows for a prompt of "
            f"{v['full_len']} tokens (at most one row per position)"
        )
    return None


def _at_most(name: str, limit: Callable[[_Reader], int], text: str) -> Check:
    """A check that every value of the array ``name`` is at most ``limit``: ``text`` names the problem
    (formatted with ``name``, the command's ``what``, the largest value ``v`` and the limit ``k``)."""

    def check(values: dict, r: _Reader) -> str | None:
        got, k = max(values[name], default=0), limit(r)
        return text.format(what=r.name, v=got, k=k) if got > k else None

    return check


def _drafts_of_word(r: _Reader) -> int:
    return VERIFY_WORDS[r.word]


def _counts_sum(v: dict, r: _Reader) -> str | None:
    if sum(v["counts"]) != v["n"]:
        return f"DECODE_DP rows per rank {list(v['counts'])} do not sum to its {v['n']} rows"
    return None


def _dp_rows(v: dict, r: _Reader) -> str | None:
    n, ranks, most = v["n"], v["ranks"], r.decoder.max_slots
    if not 1 <= n <= (most or n) or ranks < 1:
        return f"DECODE_DP of {n} rows over {ranks} ranks (rows 1..{most}, ranks >= 1)"
    return None


def _prefill_next_len(v: dict, r: _Reader) -> str | None:
    return None if v["chunk_len"] >= 1 else f"PREFILL_NEXT chunk of {v['chunk_len']} tokens (must be >= 1)"


def _rollback_n(v: dict, r: _Reader) -> str | None:
    return None if v["n"] >= 1 else f"ROLLBACK of {v['n']} tokens (must be >= 1)"


def _eplb_size(v: dict, r: _Reader) -> str | None:
    if not 0 < v["layers"] * v["slots"] <= EPLB_TABLE_MAX:
        return f"EPLB_PLACEMENT of {v['layers']} x {v['slots']} slots (must be 1..{EPLB_TABLE_MAX} words)"
    return None


def _flag(v: dict, r: _Reader) -> str | None:
    return None if v["prompt_hidden"] in (0, 1) else f"OWNER prompt_hidden {v['prompt_hidden']} (must be 0 or 1)"


_ROWS = Part("n", "rows", doc="`n`", attr="slots")
_SLOTS = Part("slots", "slots", "n", "`slots[n]`")
_TOKENS = Part("tokens", "tokens", "n", "`tokens[n]`")


def _draft_counts(doc: str, limit: Callable[[_Reader], int]) -> Part:
    """A verify command's drafts per row, each at most ``limit``."""
    return Part("counts", "words", "n", doc, _at_most("counts", limit, "{what} row with {v} drafts (at most {k})"))


DECLARATIONS: tuple[Declaration, ...] = (
    Declaration(
        Decode1,
        "decode one token",
        (),
        (),
        lambda ex, c, t: ex.decode([c.slot], [c.token]),
        "(accepted, never sent by eprt)",
        "append the token to slot `seq` and run one decode step",
        note="none: the word is the token id",
    ),
    Declaration(
        DecodeBatch,
        "DECODE_BATCH",
        (DECODE_BATCH,),
        (_ROWS, _SLOTS, _TOKENS),
        lambda ex, c, t: ex.decode(list(c.slots), list(c.tokens)),
        "every decode step",
        "one batched decode step; row r appends `tokens[r]` to `slots[r]`, rows in the order given",
        seq=None,
        refuse=_refuse_decode_batch,
    ),
    Declaration(
        DecodeDp,
        "DECODE_DP",
        (DECODE_DP,),
        (
            Part("n", "count", doc="`n`", attr="slots"),
            Part("ranks", "count", doc="`P`", attr="counts", check=_dp_rows),
            Part("counts", "words", "ranks", "`counts[P]`", _counts_sum),
            _SLOTS,
            _TOKENS,
        ),
        lambda ex, c, t: ex.decode(list(c.slots), list(c.tokens), list(c.counts)),
        "dp attention: every decode step, in place of DECODE_BATCH",
        "as DECODE_BATCH; `counts[r]` of the rows are owned by rank r, and must match the owners the worker "
        "recorded (below)",
        seq=None,
        refuse=_refuse_decode_dp,
        dp_only=True,
    ),
    Declaration(
        Compact,
        "COMPACT",
        (COMPACT,),
        (Part("new_slot", "slot"),),
        lambda ex, c, t: ex.compact(c.slot, c.new_slot),
        "end of tick, a survivor moves to a lower slot",
        "move the sequence in `seq` to the empty `new_slot` (KV stays in its blocks)",
    ),
    Declaration(
        CheckState,
        "CHECK_STATE",
        (CHECK_STATE,),
        (Part("step", doc="`step` (the scheduler's tick, mod 2^32)"),),
        lambda ex, c, t: ex.check_state(c.step, t),
        "`--check-state` (`EPRT_CHECK_STATE=1`): after every step that sent a frame, as the last command of that step",
        "hash every structure this rank mirrors and compare the digests with every rank's in one all-gather "
        "(below); a difference ends the job on every rank",
        seq=None,
    ),
    Declaration(
        PrefillNext,
        "PREFILL_NEXT",
        (PREFILL_NEXT,),
        (
            Part("chunk_len", check=_prefill_next_len),
            Part("chunk_start"),
            Part("tokens", "tokens", "chunk_len", "`tokens[chunk_len]` (this chunk's tokens only)"),
        ),
        None,  # a run of prefills: eprt/comm/worker.py
        "every later chunk of a chunked prefill",
        "prefill the next chunk of the prompt (and vision rows) the slot's PREFILL brought; the tokens must be the "
        "prompt's `[chunk_start, chunk_start + chunk_len)` and `chunk_start` where the stored tokens end",
        refuse=lambda c: None if c.tokens else "PREFILL_NEXT needs at least one token",
    ),
    Declaration(
        Accept,
        "ACCEPT",
        (ACCEPT,),
        (
            _ROWS,
            _SLOTS,
            Part(
                "accepted",
                "words",
                "n",
                "`accepted[n]`",
                _at_most("accepted", lambda r: MAX_DRAFTS, "ACCEPT of {v} drafts (a row sends at most {k})"),
            ),
        ),
        lambda ex, c, t: ex.accept(list(c.slots), list(c.accepted)),
        "right after the forward pass of every VERIFY (it travels in the next frame)",
        "close that VERIFY: row r keeps the first `accepted[r]` drafts it sent to `slots[r]`; the rest roll back "
        "(below)",
        seq=None,
        refuse=_refuse_accept,
    ),
    Declaration(
        Rollback,
        "ROLLBACK",
        (ROLLBACK,),
        (Part("n", check=_rollback_n),),
        lambda ex, c, t: ex.rollback(c.slot, c.n),
        "a row's generated token was discarded (an EOS inside its thinking block, which the sampler masks: a "
        "model that ignores the mask), at the end of the tick",
        "drop the last `n` tokens the slot stored (generated ones only) and the tail blocks beyond what the "
        "kept length needs; the next step stores and computes them again",
    ),
    Declaration(
        Fork,
        "FORK",
        (FORK,),
        (Part("new_slot", "slot"),),
        lambda ex, c, t: ex.fork(c.slot, c.new_slot),
        "a prompt asked for several choices (`n`, `best_of`) finished its prefill: once per further choice, before "
        "the next decode step",
        "occupy the empty `new_slot` with a copy of the prefilled sequence in `seq`: its full KV blocks shared (one "
        "more reference each), the block the next token goes to a new one, into which the partial last block's KV "
        "is copied (below)",
    ),
    Declaration(
        EplbPlacement,
        "EPLB_PLACEMENT",
        (EPLB_PLACEMENT,),
        (
            Part("epoch"),
            Part("layers", doc="`layers` L"),
            Part("slots", doc="`slots` P", check=_eplb_size),
            Part(
                "table",
                "words",
                lambda v: v["layers"] * v["slots"],
                "`table[L*P]` (row-major: the logical expert of each physical slot, per layer)",
            ),
        ),
        lambda ex, c, t: ex.switch_placement(c.epoch, np.asarray(c.table, np.int64).reshape(c.layers, c.slots)),
        "EPLB rebalancing while serving (`--eplb-interval`), between two engine steps",
        "from the next forward pass hold the experts of `table` (docs/eplb.md): keep the rows already held, read the "
        "others from the local checkpoint files; refused without EPLB, for an epoch other than the previous one + 1, "
        "a table of another shape or one leaving an expert on no slot",
        seq=None,
        refuse=_refuse_eplb,
    ),
    Declaration(
        LoraLoad,
        "LORA_LOAD",
        (LORA_LOAD,),
        (
            Part("adapter_id", "u64", doc="`adapter_id` lo, hi"),
            Part(
                "path",
                "text",
                doc="`nbytes`, the adapter directory's path: `nbytes` UTF-8 bytes packed little-endian into "
                "`ceil(nbytes / 4)` words (zero-padded)",
            ),
        ),
        lambda ex, c, t: ex.adapters.load(c.lora_slot, c.adapter_id, c.path),
        "a sequence is admitted whose adapter is in no LoRA slot (below)",
        "read this rank's share of the adapter into LoRA slot `seq`, replacing the adapter there",
        seq="lora_slot",
        refuse=_refuse_lora_load,
    ),
    Declaration(
        LoraUnload,
        "LORA_UNLOAD",
        (LORA_UNLOAD,),
        (),
        lambda ex, c, t: ex.adapters.unload(c.lora_slot),
        "the adapter in it was unloaded (server)",
        "empty LoRA slot `seq`",
        seq="lora_slot",
    ),
    Declaration(
        SlotAdapter,
        "SLOT_ADAPTER",
        (SLOT_ADAPTER,),
        (Part("lora_slot"),),
        lambda ex, c, t: ex.adapters.set_slot(c.slot, c.lora_slot),
        "right before the PREFILL that puts a sequence with an adapter into slot `seq`",
        "the next PREFILL into the empty slot `seq` uses the adapter in `lora_slot`",
    ),
    Declaration(
        Owner,
        "OWNER",
        (OWNER,),
        (Part("owner", doc="`owner` (a rank)"), Part("prompt_hidden", doc="`prompt_hidden` (0 or 1)", check=_flag)),
        lambda ex, c, t: ex.assign_owner(c.slot, c.owner, bool(c.prompt_hidden)),
        "dp attention: ahead of the PREFILL that admits a sequence into `seq`",
        "the next PREFILL into the empty slot `seq` puts its sequence on rank `owner`; with `prompt_hidden` 1 its "
        "prefill chunks return every prompt position's hidden state to rank 0 (below)",
        dp_only=True,
    ),
    Declaration(
        Prefill,
        "PREFILL",
        (PREFILL,),
        (
            Part("chunk_len"),
            Part("chunk_start"),
            Part("full_len", check=_prefill_fits),
            Part("tokens", "tokens", "full_len", "`tokens[full_len]` (the whole prompt)"),
            Part("vision_rows", check=_vision_fits),
        ),
        None,  # a run of prefills: eprt/comm/worker.py
        "the first chunk of a sequence in its slot (the whole prompt when not chunked)",
        "occupy the empty slot `seq` with the prompt; prefill `tokens[chunk_start : chunk_start + chunk_len]`; the "
        "last chunk when `chunk_start + chunk_len == full_len`; then the vision rows (below)",
    ),
    Declaration(
        Release,
        "RELEASE",
        (RELEASE,),
        (),
        lambda ex, c, t: ex.release(c.slot),
        "a sequence finishes or is preempted",
        "insert the slot's full KV blocks into the prefix cache, free its blocks, empty the slot",
    ),
    Declaration(
        Verify,
        "VERIFY_K2..K4",
        (VERIFY_K2, VERIFY_K3, VERIFY_K4),
        (
            _ROWS,
            _SLOTS,
            _TOKENS,
            _draft_counts("`counts[n]` (each 0..K)", _drafts_of_word),
            Part("drafts", "drafts", doc="then the drafts row by row (`sum(counts)` words)"),
        ),
        lambda ex, c, t: ex.verify(list(c.slots), list(c.tokens), list(c.drafts)),
        "a decode step in which at least one row has drafts (speculative decoding)",
        "one forward pass; row r appends `tokens[r]` and its `counts[r]` drafts to `slots[r]`; the drafts stay "
        "pending until the ACCEPT (below)",
        seq=None,
        refuse=_refuse_verify,
        word_of=lambda c: VERIFY_K2 + c.k - 2,
    ),
    Declaration(
        VerifyMtp,
        "VERIFY_MTP",
        (VERIFY_MTP,),
        (
            _ROWS,
            _SLOTS,
            _TOKENS,
            _draft_counts("`counts[n]` (each 0..4)", lambda r: MAX_DRAFTS),
        ),
        lambda ex, c, t: ex.verify_mtp(list(c.slots), list(c.tokens), list(c.counts)),
        "a verify step under `--speculative-method mtp`",
        "every rank runs the MTP layer to draft `counts[r]` tokens for row r, then the VERIFY of `tokens` and those "
        "drafts; the drafts stay pending until the ACCEPT (below)",
        seq=None,
        refuse=_refuse_verify_mtp,
    ),
    Declaration(
        DecodeCkpt,
        "DECODE_CKPT",
        (DECODE_CKPT,),
        (
            Part("snapshot_tokens", doc="6 words: snapshot tokens"),
            Part("end_block", doc="end block"),
            Part("session_hash", "u64", doc="session hash lo/hi"),
            Part("adapter_id", "u64", doc="adapter id lo/hi"),
        ),
        lambda ex, c, t: ex.checkpoint(c.slot, c.snapshot_tokens, c.end_block, c.session_hash, c.adapter_id),
        "a hybrid model (prefix cache on) reaches a block boundary rank 0 chose for a snapshot (below)",
        "save the slot's recurrent state as the snapshot of its stored prefix",
    ),
    Declaration(
        Shutdown,
        "SHUTDOWN",
        (SHUTDOWN,),
        (),
        lambda ex, c, t: ex.shutdown(),
        "the last command of every run",
        "free every slot, leave the loop, exit 0",
        seq=None,
    ),
)

_BY_TYPE = {d.cls: d for d in DECLARATIONS}
_BY_WORD = {w: d for d in DECLARATIONS for w in d.words}
NAMES = {w: (f"VERIFY_K{VERIFY_WORDS[w]}" if w in VERIFY_WORDS else d.name) for w, d in _BY_WORD.items()}


def declaration(cmd) -> Declaration:
    """The declaration of a typed command (ProtocolError for anything else)."""
    try:
        return _BY_TYPE[type(cmd)]
    except KeyError:
        raise ProtocolError(f"not a protocol command: {cmd!r}") from None


def doc_table() -> str:
    """docs/protocol.md's command table, as the declarations give it (ascending command words)."""
    head = "| cmd | name | payload after the preamble | sent by rank 0 when | worker action |\n|---|---|---|---|---|\n"
    return head + "".join(d.doc_row() + "\n" for d in DECLARATIONS)


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
        return as_words([cmd.slot, cmd.token])
    return as_words(declaration(cmd).encode(cmd))


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
        seq, word = int(b[p]), int(b[p + 1])
        if word < RESERVED_BASE:
            out, end = Decode1(self.slot(seq, "decode"), self.token(word)), p + 2
        else:
            spec = _BY_WORD.get(word)
            if spec is None:
                raise ProtocolError(f"unknown reserved command word 0x{word:08X} (slot word {seq})")
            reader = _Reader(b, p + 2, self, NAMES[word], word)
            try:
                out = spec.decode(reader, seq)
            except _Short:
                return None
            end = reader.pos
        self._pos = end
        return out

    def rows(self, n: int, what: str) -> int:
        if not 1 <= n <= (self.max_slots or n):
            raise ProtocolError(f"{what} of {n} rows (must be 1..{self.max_slots})")
        return n

    def slot(self, slot: int, what: str) -> int:
        if self.max_slots is not None and not 0 <= slot < self.max_slots:
            raise ProtocolError(f"{what}: slot {slot} out of range (max_slots={self.max_slots})")
        return slot

    def token(self, token: int) -> int:
        if self.vocab_size is not None and token >= self.vocab_size:
            raise ProtocolError(f"token {token} out of range (vocab_size={self.vocab_size})")
        return token

    def tokens(self, words: np.ndarray) -> tuple[int, ...]:
        if len(words):
            self.token(int(words.max()))
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


if __name__ == "__main__":  # docs/protocol.md's command table
    print(doc_table(), end="")
