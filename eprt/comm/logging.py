"""Rank-aware logging for the ``eprt`` logger tree.

By default only rank 0 logs (at EPRT_LOG_LEVEL); the other ranks log errors only, so a
failing worker's traceback is never lost but N ranks do not print N copies of every line.
``all_ranks`` (or EPRT_LOG_ALL_RANKS=1) lets every rank log at the chosen level. Every
record is prefixed with its rank: ``[rank 1] WARNING eprt.comm.worker: ...``.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from eprt import env

ROOT_LOGGER = "eprt"
FORMAT = "[rank %(rank)d] %(levelname)s %(name)s: %(message)s"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


class _RankHandler(logging.StreamHandler):
    """The handler this module installs (so a second setup replaces it, not duplicates it)."""


def setup_logging(
    rank: int, all_ranks: bool | None = None, level: str | int | None = None, stream: TextIO | None = None
) -> logging.Logger:
    """Configure the ``eprt`` logger for this rank and return it.

    ``all_ranks`` and ``level`` default to EPRT_LOG_ALL_RANKS and EPRT_LOG_LEVEL; records
    go to ``stream`` (stderr by default). Calling it again reconfigures.
    """
    all_ranks = env.LOG_ALL_RANKS.get() if all_ranks is None else all_ranks
    level = env.LOG_LEVEL.get() if level is None else level
    if isinstance(level, str):
        name = level.strip().upper()
        if not isinstance(logging.getLevelName(name), int):
            raise ValueError(f"unknown log level {level!r} (DEBUG, INFO, WARNING, ERROR, CRITICAL)")
        level = logging.getLevelName(name)
    if rank != 0 and not all_ranks:
        level = max(level, logging.ERROR)

    logger = logging.getLogger(ROOT_LOGGER)
    for h in [h for h in logger.handlers if isinstance(h, _RankHandler)]:
        logger.removeHandler(h)
    handler = _RankHandler(sys.stderr if stream is None else stream)
    handler.addFilter(_RankFilter(rank))
    handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return logger
