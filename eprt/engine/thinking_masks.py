"""The sampler's side of thinking blocks (docs/scenarios.md, "Thinking blocks"): the allowed-token
bits of a row's next token. Inside a block EOS ids are masked (the scheduler would discard one) and,
once the budget is spent, only the end token is left, so the token sampled is the one the scheduler
keeps and logprobs, penalties and grammars see it. A structured-output grammar applies outside
blocks only: suspended inside one, and at the first token of a row whose prompt holds no
delimiter the start token is allowed beside it, so a model may think before its constrained
answer (as vLLM applies a guide after the reasoning). V vocabulary, W = ceil(V / 32) words (``RowMasks``' layout).
"""

from __future__ import annotations

import numpy as np

from eprt.scheduler import thinking


def _bit(bits: np.ndarray, token: int) -> None:
    bits[token // 32] |= np.uint32(1) << np.uint32(token % 32)


def block_bits(seq, vocab_size: int, eos_ids) -> np.ndarray:
    """Bits [W] uint32 of a row inside a thinking block: the end token alone once the budget is
    spent, else every token but the EOS ids (unless the request ignores EOS)."""
    words = -(-vocab_size // 32)
    state = seq.think
    if state.must_end:
        bits = np.zeros(words, dtype=np.uint32)
        _bit(bits, state.spec.end)
        return bits
    allowed = np.ones(vocab_size, dtype=bool)
    if not seq.params.ignore_eos:
        allowed[[t for t in eos_ids if 0 <= t < vocab_size]] = False
    padded = np.zeros(words * 32, dtype=bool)
    padded[:vocab_size] = allowed
    return np.packbits(padded, bitorder="little").view("<u4").copy()


def may_open(seq) -> bool:
    """Whether a guided row may open a thinking block: at its first token, when its prompt holds
    no delimiter (a template that closed the block, thinking off, leaves it none)."""
    return seq.think is not None and not seq.think.seen and seq.num_generated == 0


def grammar_bits(seq, bits: np.ndarray) -> np.ndarray:
    """A grammar's bits [W] for a row outside a block: with the start token too when ``may_open``."""
    if may_open(seq):
        bits = bits.copy()
        _bit(bits, seq.think.spec.start)
    return bits


def skips_grammar(seq, token) -> bool:
    """Whether a guided row's token is no grammar text: it opened a thinking block."""
    return may_open(seq) and token == seq.think.spec.start


def row_bits(seqs: list, guided: list, vocab_size: int, eos_ids) -> dict:
    """{row: bits [W]} of the rows ``seqs`` whose next token is masked: each row of ``guided``
    ((row, grammar bits) pairs, rows outside blocks) and each row inside a thinking block."""
    bits = {i: grammar_bits(seqs[i], a) for i, a in guided}
    for i, seq in enumerate(seqs):
        if thinking.constrained(seq):
            bits[i] = block_bits(seq, vocab_size, eos_ids)
    return bits
