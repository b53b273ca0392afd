"""Speculative decoding on rank 0: drafters, acceptance, and the runner's VERIFY / ACCEPT calls
(docs/protocol.md, "VERIFY and ACCEPT"; the verify lane: docs/scenarios.md).

N positions of a verify step (sum over rows of 1 + drafts), V vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from eprt.comm import protocol as P
from eprt.scheduler.interface import RowFailure
from eprt.scheduler.speculation import StepCosts

METHODS = ("ngram", "mtp")  # --speculative-method


class Drafter(Protocol):
    in_pass: bool  # True: the model drafts inside the verify step on every rank (VERIFY_MTP)

    def draft(self, seq, k: int) -> list[int]:
        """Up to ``k`` tokens likely to follow ``seq.token_ids`` (prompt and output so far); may be
        fewer. A drafter ``in_pass`` returns ``k`` placeholders (IN_PASS): how many the step drafts."""


IN_PASS = -1  # a draft the verify step itself computes (VERIFY_MTP), not yet known on rank 0


@dataclass(frozen=True)
class NgramDrafter:
    """Prompt lookup: the longest suffix of ``min_n..max_n`` tokens that occurred before, most
    recent occurrence first; the drafts are the tokens that followed it."""

    min_n: int = 1
    max_n: int = 4
    in_pass = False

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(
                f"--prompt-lookup-min/--prompt-lookup-max must satisfy 1 <= min <= max, got {self.min_n}, {self.max_n}"
            )

    def draft(self, seq, k: int) -> list[int]:
        return self.propose(seq.token_ids, k)

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent, longest earlier match of the suffix."""
        ids = np.asarray(token_ids, dtype=np.int64)  # [L]
        L = len(ids)
        # match[e]: the n tokens ending at e (e < L - 1) equal the last n, for n = 1, 2, ... in turn
        match = ids[: L - 1] == ids[L - 1]  # [L - 1]
        best = None
        for n in range(1, min(self.max_n, L - 1) + 1):
            if n > 1:
                match[n - 1 :] &= ids[: L - n] == ids[L - n]
                match[: n - 1] = False
            hits = np.flatnonzero(match)
            if not hits.size:
                break
            if n >= self.min_n:
                best = int(hits[-1]) + 1  # where the continuation of the most recent, longest match starts
        return [] if best is None else [int(t) for t in ids[best : best + k]]


@dataclass(frozen=True)
class MtpDrafter:
    """DeepSeek's multi-token prediction layer: every rank runs it inside the VERIFY_MTP step
    (``ShardExecutor.verify_mtp``), so here it only takes all ``k`` drafts offered."""

    in_pass = True

    def draft(self, seq, k: int) -> list[int]:
        return [IN_PASS] * k


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_tokens: int = 3  # K: drafts per sequence and step, 1..protocol.MAX_DRAFTS
    lookup_min: int = 1
    lookup_max: int = 4

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--speculative-method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not 1 <= self.num_tokens <= P.MAX_DRAFTS:
            raise ValueError(f"--num-speculative-tokens must be in [1, {P.MAX_DRAFTS}], got {self.num_tokens}")

    def drafter(self) -> Drafter:
        return MtpDrafter() if self.method == "mtp" else NgramDrafter(self.lookup_min, self.lookup_max)


def accepted_run(drafts: Sequence[int], targets: Sequence) -> list:
    """The tokens a verified row emits: drafts while each equals the target sampled at its
    position, then the target at the first mismatch (or the bonus after the last draft); a
    RowFailure target (which no draft equals) is the row's last. ``targets`` has one more entry
    than ``drafts``."""
    out = []
    for d, t in zip(drafts, targets):
        out.append(_token(t))
        if d != t:
            return out
    out.append(_token(targets[len(drafts)]))
    return out


def _token(t):
    return t if isinstance(t, RowFailure) else int(t)


def rejection_sample(p: np.ndarray, q: np.ndarray, draft: int, u_accept: float, u_resample: float) -> tuple[bool, int]:
    """Standard speculative rejection sampling of one draft drawn from q[V]: accept with
    probability min(1, p/q) at the draft, else draw from the residual max(0, p - q) renormalized,
    so the token's distribution is exactly p[V]. Returns (accepted, token)."""
    if u_accept * q[draft] < p[draft]:
        return True, int(draft)
    residual = np.maximum(p.astype(np.float64) - q, 0.0)  # [V]
    c = np.cumsum(residual)
    return False, int(min(np.searchsorted(c, u_resample * c[-1], side="right"), len(p) - 1))


class Speculation:
    """The runner's speculative decoding (a part of the runner, ``ModelRunner.drafts``): the drafts
    and measured costs the scheduler asks for while planning, and a verify step's execution: one
    VERIFY (or VERIFY_MTP) forward over every row's token and drafts, then each row's emitted tokens.

    A deterministic drafter proposes a point mass q = 1 at the draft, for which rejection
    sampling reduces to: draw the target token at the draft's position with that position's
    uniform (as plain decoding would) and accept iff it equals the draft. So a sampled request
    emits exactly the tokens it would without speculation, with the same seed."""

    def __init__(self, executor, sampler, drafter: Drafter | None = None):
        self.executor, self.sampler = executor, sampler  # sampler: the runner's token source
        self.drafter = drafter  # None: speculation off
        self.step_costs = None if drafter is None else StepCosts()  # what a draft position costs here
        if drafter is not None and drafter.in_pass:
            executor.mtp_layer.step_clock = self.clock  # the MTP layer's catch-up, timed apart
        self.proposed_tokens = self.verify_steps = self.verify_rows = 0

    # ---- planning (the scheduler's queries) ---------------------------------------------------
    def propose_drafts(self, seq, k: int) -> list[int]:
        """Up to ``k`` drafts (how many: the scheduler's speculation.DraftPolicy)."""
        if self.drafter is None or k < 1:
            return []
        return self.drafter.draft(seq, k)[:k]

    def draft_cost(self, rows: int) -> float | None:
        return None if self.step_costs is None else self.step_costs.draft_cost(rows)

    def verify_overhead(self, rows: int) -> float:
        return 0.0 if self.step_costs is None else self.step_costs.verify_overhead(rows)

    def catch_up_cost(self, rows: int) -> float:
        return 0.0 if self.step_costs is None else self.step_costs.catch_up_cost(rows)

    def clock(self) -> float:
        """What steps are timed on: on the CPU this process's CPU time (a step's compute, what other
        work on a shared machine disturbs least), else the wall clock (the readback waits for the
        device)."""
        return time.process_time() if self.executor.ops.name == "cpu" else time.perf_counter()

    # ---- execution ----------------------------------------------------------------------------
    def verify(self, step, frames) -> list[list]:
        """Run the verify step (its frame through ``frames``); per row the tokens it emits."""
        slots, tokens = [r.slot for r in step.rows], [int(t) for t in step.tokens]
        drafts = [tuple(int(t) for t in d) for d in step.drafts]
        started = self.clock()
        catch_up = (0, 0.0)  # positions beyond one per row of an MTP catch-up pass, their seconds
        if self.drafter is not None and self.drafter.in_pass:  # the MTP layer drafts on every rank
            counts = tuple(len(d) for d in drafts)
            frames.send(step, P.VerifyMtp(tuple(slots), tuple(tokens), counts))
            frames.flush()
            drafts, out = self.executor.verify_mtp(slots, tokens, list(counts))  # [N, V]
            (rows, positions), seconds = self.executor.mtp_layer.caught_up, self.executor.mtp_layer.catch_up_seconds
            # a row's first position is its first draft's pass, what a row drafting every step pays;
            # the rest are owed by the decode steps since its last verify (their share of the pass)
            beyond = positions - rows
            catch_up = (beyond, seconds * beyond / positions if positions else 0.0)
        else:
            frames.send(step, P.Verify(tuple(slots), tuple(tokens), tuple(drafts)))
            frames.flush()
            out = self.executor.verify(slots, tokens, drafts)  # [N, V]
        self.verify_steps += 1
        self.verify_rows += sum(1 for d in drafts if d)
        self.proposed_tokens += sum(len(d) for d in drafts)
        targets = self.sampler.targets(list(step.rows), drafts, out)
        emitted = [accepted_run(d, t) for d, t in zip(drafts, targets)]
        if self.step_costs is not None:
            positions, seconds = catch_up  # a cost of the decode steps before, not of the drafts
            self.step_costs.verify_step(len(slots), sum(len(d) for d in drafts), self.clock() - started - seconds)
            self.step_costs.catch_up_step(len(slots), positions, seconds)
        return emitted
