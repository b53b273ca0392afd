"""The verify lane (speculative decoding): how many drafts each decoding sequence may take, and
one verify step whose emitted tokens go through the same per-token guards as decoded ones
(docs/scenarios.md, "The verify lane")."""

from __future__ import annotations

from dataclasses import dataclass

from eprt.scheduler import pools, thinking
from eprt.scheduler.effects import AcceptDrafts, Verify

DRAFT_COST = 0.3  # a draft position's cost in decode rows (a decode step / its rows) until measured, and its prior
PRIOR_SPREAD = 1.0  # the prior draft cost weighs as much as steps whose draft counts spread by this x the batch
PRIOR = (0.9, 1.0)  # the lane's acceptance before any verify: hits, trials (optimistic: the first rows draft at once)
PRIOR_KEEP = 0.9  # weight of the past in the lane's acceptance, per verified row: every row's prior
KEEP = 0.5  # weight of the past in a sequence's acceptance estimate, per verify step
COST_KEEP = 0.95  # weight of the past in the verify cost fit, per verify step
FRESH_STEPS = 4  # a verify step is timed against a decode step of its rows at most this many steps before
MAX_PERIOD = 32  # steps between probes of a sequence whose drafts do not pay (unless probe_period is longer)
PROBE_SHARE = 0.02  # a declining sequence's probes after its first cost at most this share of its steps
LONGEST_PERIOD = 1024  # probe_period where even that share cannot pay for them (an MTP layer's catch-up)
MIN_GAIN = 1.10  # drafting must promise this many times a decode step's tokens per unit of time


@dataclass
class DraftStats:
    """Acceptance counts, exponentially weighted: accepted drafts (hits) and drafts tested (trials:
    each accepted draft, and the rejected one where a row stopped short). A sequence's estimate
    adds one trial at the lane's acceptance (its prior) to its own. Also the steps between its
    probes while it declines to draft (period, kept while it drafts: a decline after drafting goes
    on where the last one was), and the period after a probe that fails (backoff)."""

    hits: float = PRIOR[0]
    trials: float = PRIOR[1]
    period: int = 2
    backoff: int = 2
    choice: tuple | None = (
        None  # ((cost, overhead, limit, prior), k): best_draft_count's answer until hits/trials change
    )
    probe: bool = False  # this step's draft is a probe's

    def acceptance(self, prior: float | None = None) -> float:
        """hits / trials; with ``prior`` (the lane's acceptance), one more trial at that rate."""
        return self.hits / self.trials if prior is None else (self.hits + prior) / (self.trials + 1.0)

    def expected_tokens(self, k: int, prior: float) -> float:
        """Tokens a step with k drafts is expected to emit: 1 + a + .. + a^k."""
        a = self.acceptance(prior)
        return sum(a**i for i in range(k + 1))

    def verified(self, proposed: int, accepted: int, keep: float = KEEP) -> None:
        self.hits = keep * self.hits + accepted
        self.trials = keep * self.trials + accepted + (accepted < proposed)
        self.choice = None

    def best(self, cost: float, overhead: float, limit: int, prior: float) -> int:
        if self.choice is None or self.choice[0] != (cost, overhead, limit, prior):
            a = self.acceptance(prior)
            self.choice = ((cost, overhead, limit, prior), best_draft_count(a, cost, limit, overhead))
        return self.choice[1]


def best_draft_count(alpha: float, cost: float, limit: int, overhead: float = 0.0) -> int:
    """The drafts k in 0..limit that emit the most tokens per unit of time: k drafts each accepted
    with probability alpha emit 1 + alpha + .. + alpha^k tokens in a step that costs
    1 + overhead + cost * k decode rows (overhead: the row's share of what a verify step costs
    whatever its drafts); 0 when no k beats a decode step by MIN_GAIN (alpha and the costs are
    noisy estimates: near the break-even point a wrong guess costs more than a right one gains)."""
    best, value, tokens, term = 0, MIN_GAIN, 1.0, 1.0
    for k in range(1, limit + 1):
        term *= alpha
        tokens += term
        v = tokens / (1.0 + overhead + cost * k)
        if v > value:
            best, value = k, v
    return best


def probe_period(cost: float, overhead: float, catch_up: float = 0.0) -> int:
    """The least steps between a declining row's probes after its first: the power of two (so that
    rows' probes share steps) at which a probe every ``p`` steps, ``overhead + cost + catch_up p``
    decode rows (its share of a verify step's overhead, its one draft, and an MTP layer's catch-up
    over the p positions decoded since), costs at most PROBE_SHARE of the row's steps; at most
    LONGEST_PERIOD (a catch-up near that share leaves probes mostly to a sequence's start)."""
    room = PROBE_SHARE - catch_up
    period = 2
    while period < LONGEST_PERIOD and period * room < overhead + cost:
        period *= 2
    return period


class DraftPolicy:
    """Adaptive speculation (the one place it is decided): a sequence drafts the k that its
    acceptance estimate and the measured cost of a draft position pay for, and none when no k
    does. A sequence that declines probes with one draft on the next step that is a multiple of
    its period: 2 (what a new row knows least), then ``probe_period``, doubled after each probe
    that fails up to MAX_PERIOD or ``probe_period`` if that is longer, halved after each that
    passes (steps of the whole lane, so the probes of a batch's rows share one verify step), which
    keeps its estimate fresh and catches a stretch where lookup pays again. A passing probe counts
    without decay: a few passes in a row turn a row to drafting, where one lucky pass does not.
    Whichever it chooses, a row emits the target's tokens (the drafter is deterministic: a draft
    is kept iff it is the token the target emits at its position; docs/design.md, "Speculative
    decoding")."""

    def __init__(self) -> None:
        self.steps = 0  # decode-lane steps so far
        self.lane = DraftStats()  # every row's verifies, decayed by PRIOR_KEEP: a new sequence's prior

    def step(self) -> None:
        self.steps += 1

    def drafts(self, seq, limit: int, cost: float, overhead: float = 0.0, catch_up: float = 0.0) -> int:
        """How many drafts ``seq`` proposes this step (at most ``limit``); ``overhead``: the row's
        share of a verify step's cost whatever its drafts, in decode rows; ``catch_up``: decode rows
        an MTP layer's catch-up costs per position (probe_period)."""
        stats = self._stats(seq)
        k = stats.best(cost, overhead, limit, self.lane.acceptance())
        stats.probe = False
        if k:
            return k
        if self.steps % stats.period:
            return 0
        least = probe_period(cost, overhead, catch_up)  # the next probe, if this one fails, waits longer
        stats.backoff = min(max(2 * stats.period, least), max(MAX_PERIOD, least))
        stats.probe = True
        return min(limit, 1)

    def worth_a_verify(self, rows: list, ks: list, cost: float, overhead: float) -> list:
        """The batch's drafts ``ks`` (one per row, from ``drafts``), or only its probes' when the
        verify step they make does not pay as a whole: B rows emitting B + (expected accepted
        drafts) tokens in a step that costs B + overhead + cost * sum(ks) decode rows must beat a
        decode step by MIN_GAIN. (Each row weighed its drafts against its share of the overhead,
        overhead / B; where only some rows draft, the step still pays all of it.)"""
        if not overhead or not any(ks):
            return ks
        B = len(rows)
        prior = self.lane.acceptance()
        gain = sum(self._stats(seq).expected_tokens(k, prior) - 1.0 for seq, k in zip(rows, ks) if k)
        if (B + gain) / (B + overhead + cost * sum(ks)) >= MIN_GAIN:
            return ks
        return [k if k and self._stats(seq).probe else 0 for seq, k in zip(rows, ks)]

    def verified(self, seq, proposed: int, accepted: int) -> None:
        """``seq`` had ``proposed`` drafts verified, of which the first ``accepted`` passed."""
        stats = self._stats(seq)
        passed = stats.probe and accepted > 0
        stats.verified(proposed, accepted, 1.0 if passed else KEEP)  # passing probes add up
        if stats.probe:  # one that passes halves the wait for the next (lookup may pay again)
            stats.period = max(stats.period // 2, 2) if passed else stats.backoff
        self.lane.verified(proposed, accepted, PRIOR_KEEP)

    def _stats(self, seq) -> DraftStats:
        if seq.draft_stats is None:  # a new sequence: its estimate is the lane's until it is verified
            seq.draft_stats = DraftStats(hits=0.0, trials=0.0)
        return seq.draft_stats


class StepCosts:
    """What a verify step costs, measured: decode and verify steps' times on rank 0 (the runner's
    clock) per batch size. A verify of B rows and P drafts that takes t, where the latest decode
    step of B rows, at most FRESH_STEPS steps before, took d, costs e = (t - d) / (d / B) decode
    rows more (an older decode step is no baseline: its contexts were other lengths, or its
    sequences others; a new batch's first step is a verify, the prior drafts at once). Over recent
    verify steps (decayed, COST_KEEP per step) e is fitted as overhead + cost * P by least squares
    with the cost pulled toward DRAFT_COST (ridge, weight (PRIOR_SPREAD B)^2): the overhead of a
    verify step whatever its drafts, and a draft's cost. Few timed steps, or steps of about the same
    P, cannot tell the two apart, and their noise (a decode step's time moves by 10 - 20% on a
    shared machine) fitted freely made drafts look free, so that rows drafting a third of the time
    drafted K; steps whose P spread more than B outweigh the prior. A fit with a negative overhead
    puts all of e on the drafts (overhead 0). An MTP drafter's catch-up pass is timed apart: its
    positions beyond one per row (owed by the decode steps since each row's last verify) are left
    out of t and measured per position against the same baseline."""

    def __init__(self) -> None:
        self.steps = 0  # decode and verify steps timed so far
        self.decode: dict[int, tuple[float, int]] = {}  # rows -> (seconds, step) of the latest decode step
        self.sums: dict[int, tuple[float, ...]] = {}  # rows -> decayed sums of 1, P, P^2, e, P e
        self.catch_ups: dict[int, tuple[float, float]] = {}  # rows -> decayed sums of catch-up decode rows, positions

    def decode_step(self, rows: int, seconds: float) -> None:
        self.steps += 1
        self.decode[rows] = (seconds, self.steps)

    def _row_seconds(self, rows: int) -> float:
        """A decode row's seconds at this batch size: the latest decode step of ``rows`` rows over
        its rows, if at most FRESH_STEPS steps ago, else 0 (no baseline)."""
        d, at = self.decode.get(rows, (0.0, 0))
        return d / rows if self.steps - at <= FRESH_STEPS else 0.0

    def verify_step(self, rows: int, drafts: int, seconds: float) -> None:
        self.steps += 1
        row = self._row_seconds(rows)
        if row and drafts:
            e = seconds / row - rows  # (t - d) / (d / B); negative from noise: unclamped, so the fit is unbiased
            new = (1.0, drafts, drafts * drafts, e, drafts * e)
            old = self.sums.get(rows, (0.0,) * 5)
            self.sums[rows] = tuple(COST_KEEP * o + n for o, n in zip(old, new))

    def _fit(self, rows: int) -> tuple[float, float] | None:
        """(overhead, cost) in decode rows; None until measured."""
        if rows not in self.sums:
            return None
        n, p, pp, e, pe = self.sums[rows]
        ridge = (PRIOR_SPREAD * rows) ** 2  # the prior's weight, in drafts^2
        cost = (pe - p * e / n + ridge * DRAFT_COST) / (pp - p * p / n + ridge)  # slope of the centred P
        if e - cost * p < 0.0:  # no overhead: the line through 0, all on the drafts
            return 0.0, max((pe + ridge * DRAFT_COST) / (pp + ridge), 0.0)
        if cost < 0.0:  # drafts that cost nothing: all on the overhead
            return max(e / n, 0.0), 0.0
        return (e - cost * p) / n, cost

    def catch_up_step(self, rows: int, positions: int, seconds: float) -> None:
        """The verify step just timed (``verify_step``, which left this out) had its MTP layer catch
        up on ``positions`` positions beyond one per row, their share of the pass ``seconds``:
        decode rows per position against the same baseline, decayed as the fit is."""
        row = self._row_seconds(rows)
        if row and positions:
            old = self.catch_ups.get(rows, (0.0, 0.0))
            self.catch_ups[rows] = (COST_KEEP * old[0] + seconds / row, COST_KEEP * old[1] + positions)

    def catch_up_cost(self, rows: int) -> float:
        """Decode rows an MTP layer's catch-up costs per position at this batch size; 0 until measured."""
        rows_time, positions = self.catch_ups.get(rows, (0.0, 0.0))
        return rows_time / positions if positions else 0.0

    def draft_cost(self, rows: int) -> float | None:
        """Decode rows per draft position at this batch size; None until measured."""
        fit = self._fit(rows)
        return None if fit is None else fit[1]

    def verify_overhead(self, rows: int) -> float:
        """Decode rows a verify step costs at this batch size whatever its drafts; 0 until measured."""
        fit = self._fit(rows)
        return 0.0 if fit is None else fit[0]


def draft_limit(seq, num_tokens: int, max_model_len: int | None) -> int:
    """Drafts worth proposing: a step emits up to drafts + 1 tokens, none past the token budget
    or the context limit."""
    k = min(num_tokens, seq.params.max_tokens - seq.num_generated - 1)
    if max_model_len is not None:
        k = min(k, max_model_len - len(seq.token_ids) - 1)
    return max(k, 0)


def plan_drafts(sched, rows: list) -> list[tuple]:
    """Each row's drafts, rows in slot order: as many as ``DraftPolicy`` finds worth it within
    ``draft_limit``, then cut so that their extra KV blocks fit in the blocks free after the
    decode step's own, in each row's pool under dp attention (a sequence near the end of its pool
    speculates less; nothing is preempted for drafts)."""
    cfg, model = sched.config, sched.model
    cost = model.draft_cost(len(rows))
    cost = DRAFT_COST if cost is None else cost
    sched.drafting.step()
    overhead, catch_up = model.verify_overhead(len(rows)), model.catch_up_cost(len(rows))
    ks = []
    for seq in rows:
        k = draft_limit(seq, cfg.num_speculative_tokens, cfg.max_model_len)
        ks.append(sched.drafting.drafts(seq, k, cost, overhead / len(rows), catch_up) if k else 0)
    ks = sched.drafting.worth_a_verify(rows, ks, cost, overhead)
    drafts = [tuple(model.propose_drafts(seq, k)[:k]) if k else () for seq, k in zip(rows, ks)]
    bs = cfg.block_size

    def extra(seq, k: int) -> int:  # blocks beyond those a plain decode step of seq takes
        return (seq.len + k + 1) // bs - (seq.len + 1) // bs

    if any(drafts) and any(extra(seq, len(d)) for seq, d in zip(rows, drafts)):
        room = pools.free_after_decode(model, rows, bs)  # pool -> blocks free after the decode step's own
        for r, seq in enumerate(rows):
            d, pool = drafts[r], pools.pool_key(model, seq)
            while d and extra(seq, len(d)) > room[pool]:
                d = d[:-1]
            drafts[r] = d
            room[pool] -= extra(seq, len(d))
    return drafts


def verifiable(params) -> bool:
    """Whether a row may ride in a VERIFY: rows whose tokens need more than the verify readback
    computes (a grammar mask, best_of's cumulative logprob, logprobs, penalties, biases and the
    other logits processing) keep the whole step a decode step."""
    return params.guide is None and params.best_of is None and params.logprobs is None and not params.processes_logits


def verify_lane(sched, rows: list) -> bool:
    """Run the step as a verify step when any row has drafts (True), else leave it to the decode
    lane (False). Each row's emitted tokens are taken one by one, exactly as decoded tokens, until
    one finishes the sequence; the rest are dropped and their KV rolled back."""
    if not all(verifiable(seq.params) and not thinking.constrained(seq) for seq in rows):
        return False
    drafts = plan_drafts(sched, rows)
    if not any(drafts):
        return False
    emitted = sched._fx.run(Verify(tuple(rows), tuple(drafts)))
    kept = []
    for seq, d, tokens in zip(rows, drafts, emitted):
        if d:
            sched.drafting.verified(seq, len(d), len(tokens) - 1)
        n = 0
        for token in tokens:
            n += 1
            sched._accept(seq, token, checkpoint=False)
            if seq.finished or thinking.constrained(seq):  # (a block opened: its tokens need masks)
                break
        kept.append(n)
    sched._fx.run(AcceptDrafts(tuple(rows), tuple(kept)))
    return True
