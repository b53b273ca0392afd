"""Guards: the rules that end a sequence, and which finish reason each one gives.

Per generated token, first match wins:
  * an EOS id (unless ``ignore_eos``) or one of the request's ``stop_token_ids``: the
    token is kept in the output but not streamed; reason ``stop``;
  * the token budget (``max_tokens``) spent, or the context limit (``max_model_len``
    tokens, prompt included) reached (``limit_verdict``): reason ``length``.
At the end of every tick (``tick_verdict``), for each sequence not yet finished:
  * its deadline has passed: guard ``request_timeout``, reason ``timeout``;
  * its client cancelled it (or the engine is closing with cancel): reason ``stop``.
Both also apply to queued requests that hold no slot yet: they end without ever being
prefilled (``n=0``). A sequence that alone outgrows the whole KV pool ends with guard
``kv_capacity`` and reason ``length`` (see the decode lane in scheduler.py).
"""
from __future__ import annotations

from typing import Optional

from eprt.scheduler.sequence import GUARD_TIMEOUT, LENGTH, STOP, TIMEOUT, Sequence


def is_stop_token(seq: Sequence, token: int, eos_ids: tuple) -> bool:
    return (token in eos_ids and not seq.params.ignore_eos) or token in seq.params.stop_token_ids


def limit_verdict(seq: Sequence, max_model_len: Optional[int]) -> Optional[str]:
    """``length`` once the budget or the context is used up (after a non-stop token)."""
    if seq.num_generated >= seq.params.max_tokens:
        return LENGTH
    if max_model_len is not None and len(seq.token_ids) >= max_model_len:
        return LENGTH
    return None


def tick_verdict(seq: Sequence, now: float, abort: bool) -> Optional[tuple]:
    """(reason, guard) ending seq at the end of a tick, or None."""
    if seq.deadline is not None and now >= seq.deadline:
        return TIMEOUT, GUARD_TIMEOUT
    if abort or seq.cancel_event.is_set():
        return STOP, None
    return None
