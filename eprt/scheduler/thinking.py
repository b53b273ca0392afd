"""Thinking blocks: which generated tokens are inside a sequence's thinking block, how many, and
the per-request budget that forces the block's end (docs/scenarios.md, "Thinking blocks").

A row is inside a block from the block's start token (the last delimiter of the prompt, or a
generated one) until an end token is generated; ``count`` is the generated tokens inside, the
delimiters not counted. Inside a block an EOS is discarded (the real runner masks EOS ids there,
so only a model that ignores that, the recording fake, ever answers one), and once ``count``
reaches the budget the next token is the end token whatever the model answered (the runner
forces it in its sampler, so its logprobs, penalties and grammar see the same token).
"""

from __future__ import annotations

from dataclasses import dataclass

from eprt.api import Thinking

GUARD_THINKING_BUDGET = "thinking_budget"  # the budget forced a block's end (printed as the request's guard)


@dataclass
class ThinkState:
    """One sequence's thinking block, kept by the scheduler and read by the model (its masks)."""

    spec: Thinking
    inside: bool  # the next generated token is inside a block
    count: int = 0  # generated tokens inside blocks
    discarded: int = 0  # EOS answers discarded inside a block (each gave its step's position back)
    forced: int = 0  # blocks the budget ended
    seen: bool = False  # the prompt holds a delimiter (a template that opened or closed the block)

    @property
    def must_end(self) -> bool:
        """Whether the next token is the forced end of the block (the budget is spent)."""
        return self.inside and self.spec.budget is not None and self.count >= self.spec.budget


def begin(spec: Thinking | None, prompt) -> ThinkState | None:
    """The state of a new sequence: inside a block when the prompt's last delimiter starts one
    (a chat template's generation prefix that opens the thinking block)."""
    if spec is None:
        return None
    ends = (spec.end, *spec.also_ends)
    for token in reversed(prompt):
        if token == spec.start or token in ends:
            return ThinkState(spec, inside=token == spec.start, seen=True)
    return ThinkState(spec, inside=False)


def take(state: ThinkState, token: int, eos_ids, ignore_eos: bool = False) -> int | None:
    """The token the sequence keeps for ``token`` answered by the model: the block's end when
    the budget is spent, None (discarded) for an EOS inside a block; updates the state."""
    if state.must_end:
        state.forced += 1
        token = state.spec.end
    elif state.inside and token in eos_ids and not ignore_eos:
        state.discarded += 1
        return None
    if state.inside:
        if token == state.spec.end or token in state.spec.also_ends:
            state.inside = False
        else:
            state.count += 1
    elif token == state.spec.start:
        state.inside = True
    return token


def keep(seq, token: int, eos_ids) -> int | None:
    """The token the scheduler keeps for seq inside or around its thinking block (``take``); None
    for an EOS discarded inside it, whose step gives its position back (``len`` down by one) so the
    next step computes it again. A forced end records the guard ``thinking_budget``."""
    kept = take(seq.think, token, eos_ids, seq.params.ignore_eos)
    if kept is None:
        seq.len -= 1
    elif seq.think.forced and seq.guard is None:
        seq.guard = GUARD_THINKING_BUDGET
    return kept


def constrained(seq) -> bool:
    """Whether the model must constrain seq's next token (EOS masked inside a block, the end
    forced): such a row is sampled with a mask and never rides in a verify step."""
    return seq.think is not None and seq.think.inside
