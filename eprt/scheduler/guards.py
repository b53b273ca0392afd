"""Guards: the rules that end a sequence and the finish reason each gives, per generated token
(``is_stop_token``, ``limit_verdict``) and at the end of every tick (``tick_verdict``);
the rules are in docs/scenarios.md ("One run").
"""

from __future__ import annotations

from eprt.scheduler.sequence import GUARD_TIMEOUT, LENGTH, STOP, TIMEOUT, Sequence


def is_stop_token(seq: Sequence, token: int, eos_ids: tuple) -> bool:
    return (token in eos_ids and not seq.params.ignore_eos) or token in seq.params.stop_token_ids


def limit_verdict(seq: Sequence, max_model_len: int | None) -> str | None:
    """``length`` once the budget or the context is used up (after a non-stop token)."""
    if seq.num_generated >= seq.params.max_tokens:
        return LENGTH
    if max_model_len is not None and len(seq.token_ids) >= max_model_len:
        return LENGTH
    return None


def tick_verdict(seq: Sequence, now: float, abort: bool) -> tuple | None:
    """(reason, guard) ending seq at the end of a tick, or None."""
    if seq.deadline is not None and now >= seq.deadline:
        return TIMEOUT, GUARD_TIMEOUT
    if abort or seq.cancel_event.is_set():
        return STOP, None
    return None
