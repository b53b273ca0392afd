"""The verify lane (speculative decoding): how many drafts each decoding sequence may take, and
one verify step whose emitted tokens go through the same per-token guards as decoded ones
(docs/scenarios.md, "The verify lane")."""

from __future__ import annotations

from eprt.scheduler.effects import AcceptDrafts, Verify


def draft_limit(seq, num_tokens: int, max_model_len: int | None) -> int:
    """Drafts worth proposing: a step emits up to drafts + 1 tokens, none past the token budget
    or the context limit."""
    k = min(num_tokens, seq.params.max_tokens - seq.num_generated - 1)
    if max_model_len is not None:
        k = min(k, max_model_len - len(seq.token_ids) - 1)
    return max(k, 0)


def plan_drafts(sched, rows: list) -> list[tuple]:
    """Each row's drafts, rows in slot order: proposed within ``draft_limit``, then cut so that
    their extra KV blocks fit in the blocks free after the decode step's own (a sequence near
    the end of the pool speculates less; nothing is preempted for drafts)."""
    cfg, model = sched.config, sched.model
    drafts = []
    for seq in rows:
        k = draft_limit(seq, cfg.num_speculative_tokens, cfg.max_model_len)
        drafts.append(tuple(model.propose_drafts(seq, k)[:k]) if k else ())
    bs = cfg.block_size

    def extra(seq, k: int) -> int:  # blocks beyond those a plain decode step of seq takes
        return (seq.len + k + 1) // bs - (seq.len + 1) // bs

    if any(extra(seq, len(d)) for seq, d in zip(rows, drafts)):
        room = model.num_free_blocks() - sum(1 for s in rows if (s.len + 1) % bs == 0)
        for r, seq in enumerate(rows):
            d = drafts[r]
            while d and extra(seq, len(d)) > room:
                d = d[:-1]
            drafts[r] = d
            room -= extra(seq, len(d))
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
    if not all(verifiable(seq.params) for seq in rows):
        return False
    drafts = plan_drafts(sched, rows)
    if not any(drafts):
        return False
    emitted = sched._fx.run(Verify(tuple(rows), tuple(drafts)))
    kept = []
    for seq, tokens in zip(rows, emitted):
        n = 0
        for token in tokens:
            n += 1
            sched._accept(seq, token, checkpoint=False)
            if seq.finished:
                break
        kept.append(n)
    sched._fx.run(AcceptDrafts(tuple(rows), tuple(kept)))
    return True
