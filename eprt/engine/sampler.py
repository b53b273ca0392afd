"""Rank 0's sampling of a pass's rows, the runner's token source (a part of the runner;
docs/design.md, "Sampling" and "Failure isolation"): ``draw`` gives a pass's rows' tokens,
``targets`` a verify step's token at each position. Plain greedy rows take one device argmax
together; the others (sampled, processed, masked or asking for logprobs) come to the host in one
copy and are sampled together, each with the uniform of its request's seed at the token's
position. A row whose stage failed for its request alone answers a RowFailure; the others are
what they would be without it. What the rows' requests get besides their tokens (logprobs,
best_of's cumulative logprob) goes into the step's result.

B rows, V vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from eprt.engine.choices import token_logprobs
from eprt.engine.isolation import one_by_one, per_row
from eprt.engine.sampling import (
    History,
    RowMasks,
    checked,
    sample_on_device,
    sample_processed,
    sample_rows,
    token_uniform,
)
from eprt.engine.thinking_masks import row_bits, skips_grammar
from eprt.scheduler import thinking
from eprt.scheduler.interface import RowFailure


class SamplingPlan(NamedTuple):
    """What sampling rows takes before their logits (``RowSampler.plan``)."""

    guided: list  # rows whose grammar masks them (each host-sampled)
    masks: RowMasks | None  # their grammars' bitmasks, over positions in ``slow``
    slow: list  # host-sampled rows
    uniforms: np.ndarray  # [len(slow)] each request's seed at the row's position
    failed: dict  # row -> RowFailure: a stage before the logits failed for that request


def host_sampled(seq) -> bool:
    """Whether a row goes to the host sampler: ``needs_host_sampler``, masked by its grammar, or inside a
    thinking block (its EOS masked, its end forced: eprt/engine/thinking_masks.py)."""
    return needs_host_sampler(seq.params) or seq.model_state.matcher is not None or thinking.constrained(seq)


def needs_host_sampler(params) -> bool:
    """Whether a row needs the host sampler: sampled, processed logits or logprobs."""
    return params.temperature != 0.0 or params.logprobs is not None or params.processes_logits


class RowSampler:
    def __init__(self, ops, pools, vocab_size: int):
        self.ops, self.pools = ops, pools  # pools: where a pass's rows come back (eprt/engine/pools.py)
        self.vocab_size = vocab_size
        self.guides = None  # structured outputs: eprt.engine.structured.GuidedRows (set by the engine)
        self.eos_token_ids: tuple = ()  # min_tokens holds these back (the engine sets the model's)
        self.logprobs_mode = "raw"  # raw | processed (eprt.engine.sampling.LOGPROB_MODES)

    # ---- the token source ---------------------------------------------------------------------
    def draw(self, seqs: list, out, index, positions: list, result, plan: SamplingPlan | None = None) -> list:
        """The tokens of rows ``seqs``: rows ``index`` of a pass's output ``out`` (greedy rows under dp
        attention take their owners' tokens); each row's token is at ``positions``."""
        plain = self.pools.plain_tokens(out, index, seqs)
        if plain is not None:
            return plain
        return self.sample(seqs, self.pools.logits(out, index), positions, result, plan)

    def targets(self, rows: list, drafts: list, out) -> list[list]:
        """A verify step's token at each position of each row (``rows``: the step's plan rows; a row's
        positions follow its stored tokens): greedy rows' argmax (under dp attention, the owners'),
        sampled rows drawn with the uniform of each position, as plain decoding draws them; a row
        whose sampling failed has its RowFailure at every position (``isolation.per_row``)."""
        seqs = [r.seq for r in rows]
        starts = np.cumsum([0] + [len(d) + 1 for d in drafts])  # [B + 1] first position of each row
        sampled = [r for r, s in enumerate(seqs) if s.params.temperature != 0.0]
        flat = [0] * int(starts[-1])  # [N] the token each position emits if reached
        if len(sampled) < len(seqs):
            flat = self.pools.plain_tokens(out, slice(None), [])
            if flat is None:
                flat = self.greedy(self.pools.logits(out, slice(None)), list(range(int(starts[-1]))))

        def draw(picked: list) -> list:  # each row's tokens at its positions
            positions = [p for r in picked for p in range(starts[r], starts[r + 1])]
            logits = self.ops.to_host(self.pools.logits(out, positions))  # [n, V]
            params, uniforms = [], []
            for r in picked:
                for i in range(len(drafts[r]) + 1):
                    params.append(seqs[r].params)
                    uniforms.append(token_uniform(seqs[r].model_state.seed, rows[r].length + 1 + i))
            got = sample_rows(logits, params, np.asarray(uniforms))  # [n]
            ends = np.cumsum([0] + [len(drafts[r]) + 1 for r in picked])
            return [got[ends[i] : ends[i + 1]] for i in range(len(picked))]

        for r, got in zip(sampled, per_row(sampled, draw, "sampling") if sampled else ()):
            flat[starts[r] : starts[r + 1]] = [got] * (len(drafts[r]) + 1) if isinstance(got, RowFailure) else got
        return [flat[starts[r] : starts[r + 1]] for r in range(len(rows))]

    # ---- sampling -------------------------------------------------------------------------------
    def sample(self, seqs: list, logits, positions: list, result, plan: SamplingPlan | None = None) -> list:
        """The tokens of rows ``seqs`` from their logits [B, V]; each row's token is at ``positions``
        (its uniform's counter). Logprobs and best_of's logprob go into ``result``."""
        plan = self.plan(seqs, positions) if plan is None else plan
        tokens = self.greedy(logits, [i for i in range(len(seqs)) if i not in plan.slow and i not in plan.failed])
        if plan.slow:
            picked = [seqs[i] for i in plan.slow]
            drawn = self._sample_slow(logits, plan.slow, picked, plan.masks, plan.uniforms, result)
            for i, t in zip(plan.slow, drawn):
                tokens[i] = t
        tokens = [plan.failed.get(i, t) for i, t in enumerate(tokens)]
        self._rank_tokens(seqs, logits, tokens, result)
        self._advance_grammars(seqs, plan.guided, tokens)
        return tokens

    def plan(self, seqs: list, positions: list, slow: list | None = None) -> SamplingPlan:
        """What sampling rows ``seqs`` takes before their logits (``SamplingPlan``; the host-sampled
        rows are ``slow`` when given); a row whose grammar's mask fails, or whose prompt logprobs
        did, is failed here and sampled no further."""
        if slow is None:
            slow = [i for i, s in enumerate(seqs) if host_sampled(s)]
        failed = {i: s.model_state.failure for i, s in enumerate(seqs) if s.model_state.failure is not None}
        guided = [i for i, s in enumerate(seqs) if s.model_state.matcher is not None and i not in failed]
        guided = [i for i in guided if not thinking.constrained(seqs[i])]  # (suspended inside a thinking block)
        kept = []
        if guided:  # every guided row is host-sampled
            matchers = [seqs[i].model_state.matcher for i in guided]
            allowed = per_row(matchers, self.guides.allowed, "the structured-output grammar")  # bits [W] each
            failed.update((i, a) for i, a in zip(guided, allowed) if isinstance(a, RowFailure))
            kept = [(i, a) for i, a in zip(guided, allowed) if not isinstance(a, RowFailure)]
            guided = [i for i, _ in kept]
        slow = [i for i in slow if i not in failed]
        bits = row_bits(seqs, kept, self.vocab_size, self.eos_token_ids)  # grammars, thinking blocks
        masked = [i for i in slow if i in bits]
        masks = None
        if masked:
            at = np.asarray([slow.index(i) for i in masked], dtype=np.int32)
            masks = RowMasks(at, np.stack([bits[i] for i in masked]))
        uniforms = np.array([token_uniform(seqs[i].model_state.seed, positions[i]) for i in slow])
        return SamplingPlan(guided, masks, slow, uniforms, failed)

    def greedy(self, logits, rows: list) -> list:
        """Tokens [n] of logits [n, V]: the argmax of each row in ``rows`` (one device argmax of
        every row), a RowFailure where its logit is not finite (``sampling.checked``), 0 elsewhere."""
        tokens = [0] * logits.shape[0]
        if rows:
            greedy, values = self.ops.argmax_values(logits)  # on a GPU's graph step: one read, computed in the graph
            for i in rows:
                tokens[i] = int(greedy[i])
            checked(tokens, rows, values[np.asarray(rows)])
        return tokens

    def _advance_grammars(self, seqs: list, guided: list, tokens: list) -> None:
        """The grammars of rows ``guided`` take their tokens; one that fails fails its row."""
        rows = [i for i in guided if not isinstance(tokens[i], RowFailure) and not skips_grammar(seqs[i], tokens[i])]
        done = one_by_one(
            rows,
            lambda i: self.guides.advance([seqs[i].model_state.matcher], [tokens[i]]),
            "the structured-output grammar",
        )
        for i, d in zip(rows, done):
            if isinstance(d, RowFailure):
                tokens[i] = d

    def _rank_tokens(self, seqs: list, logits, tokens: list, result) -> None:
        """best_of: each sampled token's logprob, to add to its sequence's cumulative logprob."""
        ranked = [i for i, s in enumerate(seqs) if s.params.best_of is not None]
        ranked = [i for i in ranked if not isinstance(tokens[i], RowFailure)]

        def logprobs(rows: list) -> np.ndarray:
            host = self.ops.to_host(logits[rows])  # [m, V]
            temps = np.array([seqs[i].params.temperature for i in rows], dtype=np.float64)
            return token_logprobs(host, temps, np.array([tokens[i] for i in rows]))

        for i, lp in zip(ranked, per_row(ranked, logprobs, "best_of's logprob") if ranked else ()):
            if isinstance(lp, RowFailure):
                tokens[i] = lp
            else:
                result.cumulative[seqs[i].seq_id] = float(lp)

    def _sample_slow(self, logits, rows: list, seqs: list, masks, uniforms: np.ndarray, result) -> list:
        """Tokens of logits rows ``rows`` (sequences ``seqs``), sampled together (``_draw``); if that
        raises, row by row, a row whose sampling raises answering a RowFailure."""

        def draw(picked: list) -> list:
            sub = None if masks is None else masks.take(picked)
            return self._draw(logits, [rows[k] for k in picked], [seqs[k] for k in picked], sub, uniforms[picked])

        tokens = []
        for s, out in zip(seqs, per_row(list(range(len(rows))), draw, "sampling")):
            token, rec = (out, None) if isinstance(out, RowFailure) else out
            if rec is not None:
                result.logprobs.setdefault(s.seq_id, []).append(rec)
            tokens.append(token)
        return tokens

    def _draw(self, logits, rows: list, seqs: list, masks, uniforms: np.ndarray) -> list:
        """(token, TokenLogprobs or None) of each of logits rows ``rows`` (sequences ``seqs``): on the
        host, or with the logits processing and the draw on the device (GPU backends: only rows
        with a top-k / top-p cut and rows asking for logprobs come to the host). No effects on the
        sequences (``per_row`` may run it again)."""
        ops, params = self.ops, [s.params for s in seqs]
        whole = rows if len(rows) < logits.shape[0] else slice(None)
        plain = masks is None and all(p.logprobs is None and not p.processes_logits for p in params)
        if plain and ops.name == "cpu":  # temperature / top-k / top-p only
            return [(t, None) for t in sample_rows(ops.to_host(logits[whole]), params, uniforms)]
        histories = [self._history(s) if s.params.processes_logits else None for s in seqs]
        if ops.name == "cpu":
            tokens, records = sample_processed(
                ops.to_host(logits[whole]), params, uniforms, histories, self.eos_token_ids, masks, self.logprobs_mode
            )
        else:
            tokens, records = sample_on_device(
                ops, logits, rows, params, uniforms, histories, self.eos_token_ids, masks, self.logprobs_mode
            )
        return list(zip(tokens, records))

    @staticmethod
    def _history(seq) -> History:
        state = seq.model_state
        if state.history is None:
            state.history = History.of(seq.prompt_ids)
        return state.history.sync(seq.output_ids)
