"""Failure isolation per request (docs/design.md, "Failure isolation"): a stage that computes
something for each row of a step (its sampling, logprobs, grammar mask) fails the request whose
row made it fail, and only that one. ``per_row`` runs a stage for the whole batch and, when it
raises, for each row alone; ``one_by_one`` runs a stage with effects (a grammar taking its token)
row by row. A failed row's result is a ``RowFailure`` naming the stage and the error. A
``JobFailure`` (shared state: a rank, the transport, the KV pool) is never caught.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from eprt.api import JobFailure
from eprt.scheduler.interface import RowFailure

log = logging.getLogger("eprt.engine")


def one_by_one(items: list, run: Callable, stage: str) -> list:
    """``run(item)`` for each item; an item whose run raises gets a RowFailure instead."""
    out = []
    for item in items:
        try:
            out.append(run(item))
        except JobFailure:
            raise
        except Exception as e:
            log.warning("%s failed for one request: %s: %s", stage, type(e).__name__, e, exc_info=True)
            out.append(RowFailure(f"{stage} failed: {type(e).__name__}: {e}"))
    return out


def per_row(items: list, run: Callable, stage: str) -> list:
    """``run(items)``, one result per item; if it raises, ``run([item])`` for each item alone
    (``run`` must have no effects, so that it can run again), a failing one getting a RowFailure."""
    if len(items) != 1:
        try:
            return list(run(items))
        except JobFailure:
            raise
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
            log.info("%s failed for a batch of %d rows (%s): each row alone", stage, len(items), why)
    return one_by_one(items, lambda item: run([item])[0], stage)
