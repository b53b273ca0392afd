"""Token sampling on rank 0: greedy, temperature, top-k, top-p, min-p, per-request seed; the
logits processing of vLLM before it (penalties, biases, masks) and log-probabilities.

V vocabulary, n rows. Only rank 0 samples; workers never see logits. A sampled token's draw
is one uniform from Philox keyed by the request's seed at the token's position, so it does
not depend on batch-mates, steps or preemption (docs/design.md, "Sampling"; docs/serving.md).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from eprt.api import SamplingParams, TokenLogprobs
from eprt.ops.numpy_ops import cpu_path
from eprt.scheduler.interface import RowFailure

F32_MAX = float(np.finfo(np.float32).max)
PHILOX_KEY_BITS = 128
NO_TOKEN = (
    "no token is left to sample: the masks (allowed_token_ids, bad_words, min_tokens, the structured-output "
    "grammar) forbid every one"
)


def unusable(top: float) -> RowFailure:
    """Why a row whose largest processed logit (or picked one) ``top`` is not finite has no token."""
    if top == -np.inf:
        return RowFailure(NO_TOKEN)
    return RowFailure(f"the logits are not finite after the logits processing ({float(top)})")


def checked(tokens: list, rows: Sequence[int], picked: np.ndarray) -> list:
    """``tokens`` with tokens[rows[i]] a RowFailure where ``picked[i]``, its argmax's logit or
    its row's maximum, is not finite (a NaN row's argmax is a NaN, as its maximum; a row every
    mask forbids has -inf)."""
    for r, v in zip(rows, picked.tolist()):
        if not np.isfinite(v):
            tokens[r] = unusable(v)
    return tokens


def request_seed(params: SamplingParams, fallback: np.random.Generator) -> int:
    """A request's sampling key (< 2**128, Philox's key size): params.seed, else drawn once from
    the engine's generator; a larger seed is hashed down (NumPy's SeedSequence)."""
    seed = params.seed if params.seed is not None else int(fallback.integers(0, 2**63 - 1))
    if seed < 2**PHILOX_KEY_BITS:
        return seed
    words = np.random.SeedSequence(seed).generate_state(PHILOX_KEY_BITS // 32, np.uint32)
    return sum(int(w) << (32 * i) for i, w in enumerate(words))


def token_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that picks the token at ``position`` of the request keyed ``seed``:
    the first word of Philox block ``position`` under key ``seed`` (counter-based: no state)."""
    word = int(np.random.Philox(key=seed, counter=position).random_raw())
    return (word >> 11) * 2.0**-53


def make_rng(params: SamplingParams, fallback: np.random.Generator) -> np.random.Generator:
    """A generator of uniforms for ``sample`` (tests and benchmarks): seeded like a request."""
    return np.random.default_rng(request_seed(params, fallback))


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token from logits[V] (float32), its uniform drawn from ``rng``."""
    return sample_rows(logits[None, :], [params], np.array([rng.random()]))[0]


def sample_rows(logits: np.ndarray, params: Sequence[SamplingParams], uniforms: np.ndarray) -> list:
    """Tokens of logits[n, V]: row r greedy when params[r].temperature is 0, else drawn with
    uniforms[r] (in [0, 1)) by inverse CDF over the row's kept tokens (order: ``_pick``); a
    RowFailure for a row whose logits are not finite (``checked``, ``unusable``). A sampled
    row runs all its passes (max, temperature, exp, sum, the cuts) before the next starts: at
    V = 151936 a row (600 KB) stays in L2 through them, where [n, V] at once went to memory for each."""
    temps = np.array([p.temperature for p in params], dtype=np.float64)  # [n]
    out = np.zeros(logits.shape[0], dtype=np.int64)  # [n]
    greedy = np.flatnonzero(temps == 0.0)
    if greedy.size == logits.shape[0]:  # no row gathered: a copy of [n, V] costs more than the argmax
        out[:] = np.argmax(logits, axis=1)
    elif greedy.size:
        out[greedy] = np.argmax(logits[greedy], axis=1)
    rows = np.flatnonzero(temps != 0.0)
    with np.errstate(over="ignore", divide="ignore"):  # a tiny temperature sends every non-maximum to -inf
        scales = np.minimum(1.0 / temps[rows], F32_MAX).astype(np.float32)  # [m]
    tokens = checked([int(t) for t in out], greedy, logits[greedy, out[greedy]])
    for i, r in enumerate(rows.tolist()):  # a row at a time: its [V] stays in cache through every pass
        p = np.array(logits[r], dtype=np.float32)  # [V] becomes exp((x - max) / T): max 1
        top = p.max()
        if not np.isfinite(top):
            tokens[r] = unusable(top)
            continue
        with np.errstate(over="ignore"):
            p -= top
            p *= scales[i]
        np.exp(p, out=p)
        if params[r].min_p > 0.0:  # min-p: probability below min_p * the top one (p's max is 1)
            p[p < np.float32(params[r].min_p)] = 0.0
        tokens[r] = _pick(p, float(p.sum()), params[r], float(uniforms[r]))
    return tokens


def _pick(p: np.ndarray, mass: float, params: SamplingParams, u: float) -> int:
    """One token from p[V] (unnormalized, max 1, sum ``mass``): top-k keeps the values >= the
    k-th largest, top-p then the smallest descending prefix (ties by index) whose mass reaches
    top_p. The draw walks the kept tokens by value bucket (high 16 bits of p), highest first,
    then by index; with no cut, by index."""
    V = p.shape[0]
    top_k = params.top_k if 0 < params.top_k < V else 0
    if not top_k and params.top_p >= 1.0:
        return _inverse_cdf(p, u)
    kept = _head(p, mass, top_k, params.top_p)  # ascending indices holding every kept token, or None
    if kept is None and not top_k:  # a wide nucleus: find its edge by value buckets
        return _draw_wide(p, params.top_p, u)
    if kept is None:
        kept = _top_k(p, top_k)
    elif top_k:  # values >= the k-th largest (ties at the cut stay)
        vals = p[kept]
        kept = kept[vals >= np.partition(vals, vals.shape[0] - top_k)[vals.shape[0] - top_k]]
    if params.top_p < 1.0:
        order = kept[np.argsort(-p[kept], kind="stable")]
        c = np.cumsum(p[order], dtype=np.float64)
        goal = params.top_p * (c[-1] if top_k else mass)
        kept = np.sort(order[: min(int(np.searchsorted(c, goal)), order.shape[0] - 1) + 1])
    kept = _by_bucket(p, kept)
    c = np.cumsum(p[kept], dtype=np.float64)
    return int(kept[_walk_to(c, u * c[-1], p[kept])])


HEAD_THRESHOLDS = (1e-3, 1e-6)  # p / max(p) of the candidate heads tried first (language is peaked)
HEAD_MAX = 8192  # a larger head is not sorted: value buckets are cheaper


def _head(p: np.ndarray, mass: float, top_k: int, top_p: float) -> np.ndarray | None:
    """Indices with p >= a threshold (ascending): the full sort's prefix of that length, so it
    holds every kept token when it has k of them (top-k) or top_p of the mass (top-p alone).
    None when no such head of at most HEAD_MAX does."""
    for threshold in HEAD_THRESHOLDS:
        above = p >= threshold
        if np.count_nonzero(above) > HEAD_MAX:
            return None
        head = np.flatnonzero(above)
        if head.shape[0] >= top_k and (top_k or p[head].sum(dtype=np.float64) >= top_p * mass * (1 + 1e-6)):
            return head
    return None


LOW_BITS = 16  # value buckets of p (>= 0, so its float32 bits order it): the high 16 bits, then the low 16
NUM_BUCKETS = (int(np.float32(1.0).view(np.int32)) >> LOW_BITS) + 1  # p <= 1
LOW_MASK = (1 << LOW_BITS) - 1
SORT_MAX = 8192  # candidates up to this many are sorted / partitioned instead of counted by their low bits


def _top_k(p: np.ndarray, k: int) -> np.ndarray:
    """Ascending indices of the values >= the k-th largest, by counting the high 16 bits of
    every value, then the low 16 bits of the bucket where the k-th lies (a radix select)."""
    bits = p.view(np.int32)
    high = bits >> LOW_BITS
    above = np.cumsum(np.bincount(high, minlength=NUM_BUCKETS)[::-1])  # [NB] count in buckets >= each
    j = int(np.searchsorted(above, k))
    edge, before = NUM_BUCKETS - 1 - j, int(above[j - 1]) if j else 0
    idx = np.flatnonzero(high >= edge)
    if idx.shape[0] <= SORT_MAX:  # few candidates: select the k-th directly
        vals = p[idx]
        return idx[vals >= np.partition(vals, vals.shape[0] - k)[vals.shape[0] - k]]
    low = bits[idx] & LOW_MASK
    on_edge = high[idx] == edge
    counts = np.cumsum(np.bincount(low[on_edge], minlength=LOW_MASK + 1)[::-1]) + before
    edge_low = LOW_MASK - int(np.searchsorted(counts, k))  # the k-th largest's low bits
    return idx[~on_edge | (low >= edge_low)]


class Nucleus(NamedTuple):
    """A wide nucleus by value buckets: every bucket (high 16 bits of p) above ``edge`` whole,
    and ``edge_kept`` (ascending indices) of the edge bucket."""

    high: np.ndarray  # [V] bucket of each p
    above: np.ndarray  # [NB] mass of the buckets >= each, highest bucket first
    edge: int
    edge_kept: np.ndarray


@functools.cache
def _kernels():
    from eprt.ops import cpu_kernels

    return cpu_kernels


def _bucket_sums(keys: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """np.bincount(keys, weights=values, minlength=n); on the compiled CPU path (``cpu_path``)
    cpu_kernels.bucket_sums, the same sums 8 - 10x faster."""
    if cpu_path() == "numba":
        return _kernels().bucket_sums(keys, values, n)
    return np.bincount(keys, weights=values, minlength=n)


def _nucleus(p: np.ndarray, top_p: float) -> Nucleus:
    """The smallest prefix of p sorted descending (ties by index) whose mass reaches top_p of
    the total (everything if rounding keeps it short). Masses per high 16 bits find the bucket
    where the prefix ends; inside it a sort, or for a crowded bucket masses per low 16 bits
    and its ties in index order (a weighted radix select: no sort of the vocabulary)."""
    bits = p.view(np.int32)
    high = bits >> LOW_BITS
    above = np.cumsum(_bucket_sums(high, p, NUM_BUCKETS)[::-1])  # [NB] mass in buckets >= each
    goal = top_p * above[-1]
    j = min(int(np.searchsorted(above, goal)), NUM_BUCKETS - 1)
    edge, before = NUM_BUCKETS - 1 - j, (above[j - 1] if j else 0.0)
    cand = np.flatnonzero(high == edge)  # ascending index
    if cand.shape[0] <= SORT_MAX:  # a small edge bucket: sort it (descending, ties by index)
        order = cand[np.argsort(-p[cand], kind="stable")]
        running = before + np.cumsum(p[order], dtype=np.float64)
        return Nucleus(
            high, above, edge, np.sort(order[: min(int(np.searchsorted(running, goal)), len(order) - 1) + 1])
        )
    low = bits[cand] & LOW_MASK
    inside = before + np.cumsum(_bucket_sums(low, p[cand], LOW_MASK + 1)[::-1])
    j2 = min(int(np.searchsorted(inside, goal)), LOW_MASK)
    edge_low = LOW_MASK - j2
    keep = low > edge_low
    ties = np.flatnonzero(low == edge_low)  # one value, ascending index
    if ties.size:
        running = (inside[j2 - 1] if j2 else before) + np.cumsum(np.full(ties.shape[0], p[cand[ties[0]]], np.float64))
        keep[ties[: min(int(np.searchsorted(running, goal)), ties.shape[0] - 1) + 1]] = True
    return Nucleus(high, above, edge, cand[keep])


def _draw_wide(p: np.ndarray, top_p: float, u: float) -> int:
    """A token of a wide nucleus, walking its buckets highest first, each in index order:
    the bucket masses locate the draw, so only one bucket's members are gathered."""
    nuc = _nucleus(p, top_p)
    j = NUM_BUCKETS - 1 - nuc.edge  # buckets before the edge one, highest first
    whole = nuc.above[j - 1] if j else 0.0
    target = u * (whole + float(p[nuc.edge_kept].sum(dtype=np.float64)))
    if target >= whole:
        members, before = nuc.edge_kept, whole
    else:
        b = int(np.searchsorted(nuc.above[:j], target, side="right"))
        members, before = np.flatnonzero(nuc.high == NUM_BUCKETS - 1 - b), (nuc.above[b - 1] if b else 0.0)
    c = before + np.cumsum(p[members], dtype=np.float64)
    return int(members[_walk_to(c, target, p[members])])


def _by_bucket(p: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Kept indices (ascending) in walk order: value bucket (high 16 bits of p) highest first,
    then index."""
    return kept[np.argsort(-(p[kept].view(np.int32) >> LOW_BITS), kind="stable")]


def _walk_to(c: np.ndarray, target: float, p: np.ndarray) -> int:
    """Position i with c[i-1] <= target < c[i] (c: running sums of p), never a zero p."""
    i = min(int(np.searchsorted(c, target, side="right")), c.shape[0] - 1)
    while p[i] == 0.0 and i > 0:  # rounding at the end: step back to a possible token
        i -= 1
    return i


CDF_BLOCK = 4096  # inverse CDF over the whole vocabulary: block sums first, then one block


def _inverse_cdf(p: np.ndarray, u: float) -> int:
    """The index i with cumsum(p)[i-1] <= u * sum(p) < cumsum(p)[i]; one pass over p."""
    V = p.shape[0]
    starts = np.arange(0, V, CDF_BLOCK)
    whole = V // CDF_BLOCK * CDF_BLOCK
    sums = p[:whole].reshape(-1, CDF_BLOCK).sum(axis=1)  # pairwise float32 sums of the full blocks
    if whole < V:
        sums = np.append(sums, p[whole:].sum())
    blocks = np.cumsum(sums, dtype=np.float64)  # [ceil(V / CDF_BLOCK)]
    target = u * blocks[-1]
    b = min(int(np.searchsorted(blocks, target, side="right")), len(blocks) - 1)
    before = blocks[b - 1] if b else 0.0
    inside = before + np.cumsum(p[starts[b] : starts[b] + CDF_BLOCK], dtype=np.float64)
    i = min(int(np.searchsorted(inside, target, side="right")), len(inside) - 1)
    while p[starts[b] + i] == 0.0 and starts[b] + i > 0:  # rounding at a block's end: step back
        i -= 1
    return int(starts[b] + i)


# ---- logits processing (vLLM's order and formulas) ------------------------------------------
LOGPROB_MODES = ("raw", "processed")  # docs/serving.md, "Log-probabilities"
LOGSOFTMAX_BLOCK = 64  # rows of log-probabilities made at once (a [64, V] float32 buffer)


@dataclass
class History:
    """A row's token history for penalties and bad words, kept up to date incrementally:
    ``sync`` takes the generated ids so far and counts only the new ones."""

    prompt: np.ndarray  # unique prompt ids (int64)
    output: list = field(default_factory=list)  # generated ids
    counts: dict = field(default_factory=dict)  # generated id -> occurrences
    _seen: set = field(default_factory=set)  # prompt and generated ids
    _cache: dict = field(default_factory=dict)  # arrays made from the above since the last new token

    @classmethod
    def of(cls, prompt_ids) -> History:
        prompt = np.unique(np.asarray(prompt_ids, dtype=np.int64))
        return cls(prompt, _seen=set(prompt.tolist()))

    def sync(self, output_ids) -> History:
        for t in output_ids[len(self.output) :]:
            self.output.append(int(t))
            self.counts[int(t)] = self.counts.get(int(t), 0) + 1
            self._seen.add(int(t))
            self._cache.clear()
        return self

    def seen_ids(self) -> np.ndarray:
        """The prompt's and generated ids, each once (repetition penalty)."""
        if "seen" not in self._cache:
            self._cache["seen"] = np.fromiter(self._seen, dtype=np.int64, count=len(self._seen))
        return self._cache["seen"]

    def count_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(generated ids, their counts as float32), each id once."""
        if "counts" not in self._cache:
            n = len(self.counts)
            ids = np.fromiter(self.counts, dtype=np.int64, count=n)
            self._cache["counts"] = (ids, np.fromiter(self.counts.values(), dtype=np.float32, count=n))
        return self._cache["counts"]


def stop_ids(params: SamplingParams, eos_ids) -> tuple:
    """The ids min_tokens holds back: EOS (unless ignore_eos) and the request's stop ids."""
    return tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(eos_ids))


@dataclass(frozen=True)
class TokenEdits:
    """One stage of vLLM's per-token processing of a batch as (row, token) pairs, unique within
    the stage, each applied as ``v = -inf if banned else ((v + bias) / or * scale) - subtract``
    (float32; the repetition ``scale`` divides a positive value, multiplies the others). The
    stages, in order: banned ids, logit_bias, repetition, frequency + presence. P pairs."""

    rows: np.ndarray  # [P] int32 row in the batch
    tokens: np.ndarray  # [P] int32
    banned: np.ndarray  # [P] uint8: bad word, or a stop id under min_tokens
    bias: np.ndarray  # [P] float32 logit_bias
    scale: np.ndarray  # [P] float32 repetition_penalty (1: none)
    subtract: np.ndarray  # [P] float32 frequency_penalty * count + presence_penalty

    @property
    def size(self) -> int:
        return int(self.rows.shape[0])

    @classmethod
    def stage(cls, rows: list, tokens: list, **values) -> TokenEdits:
        """The pairs of rows[i] x tokens[i] (per-row id arrays), ``values`` per row (scalars or
        arrays like tokens[i]) for the named columns, the others neutral."""
        sizes = [len(t) for t in tokens]
        out = {"rows": np.repeat(np.asarray(rows, dtype=np.int32), sizes)}
        out["tokens"] = np.concatenate([np.asarray(t, dtype=np.int64) for t in tokens]).astype(np.int32)
        P = out["tokens"].shape[0]
        for name, (dtype, neutral) in _COLUMNS.items():
            given = values.get(name)
            if given is None:
                out[name] = np.full(P, neutral, dtype=dtype)
            else:
                out[name] = np.concatenate([np.broadcast_to(np.asarray(v, dtype), (n,)) for v, n in zip(given, sizes)])
        return cls(**out)


_COLUMNS = {
    "banned": (np.uint8, 0),
    "bias": (np.float32, 0.0),
    "scale": (np.float32, 1.0),
    "subtract": (np.float32, 0.0),
}


def token_edits(
    params: Sequence[SamplingParams], histories: Sequence[History | None], vocab_size: int, eos_ids=()
) -> list[TokenEdits]:
    """The non-empty TokenEdits stages of rows ``params`` (a row's ``histories`` entry: None when
    it has no history)."""
    banned, bias, rep, sub = ([], [], []), ([], [], []), ([], [], []), ([], [], [])
    for r, (p, h) in enumerate(zip(params, histories)):
        out = _banned(p, h, eos_ids)
        if out:
            _add(banned, r, np.unique(np.asarray(out, dtype=np.int64)), 1)
        if p.logit_bias:
            _add(bias, r, [t for t, _ in p.logit_bias], np.asarray([b for _, b in p.logit_bias], np.float32))
        if h is None:
            continue
        if p.repetition_penalty != 1.0:
            _add(rep, r, h.seen_ids(), p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and h.counts:
            ids, counts = h.count_arrays()
            _add(sub, r, ids, np.float32(p.frequency_penalty) * counts + np.float32(p.presence_penalty))
    stages = [(banned, "banned"), (bias, "bias"), (rep, "scale"), (sub, "subtract")]
    return [TokenEdits.stage(s[0], s[1], **{name: s[2]}) for s, name in stages if s[0]]


def _add(stage: tuple, row: int, tokens, values) -> None:
    for column, v in zip(stage, (row, tokens, values)):
        column.append(v)


def apply_edits(x: np.ndarray, stages: Sequence[TokenEdits]) -> None:
    """TokenEdits stages on logits x[n, V] (float32, in place): the reference of kernels/sampling.cu."""
    for e in stages:
        v = x[e.rows, e.tokens] + e.bias
        v = np.where(v > 0, v / e.scale, v * e.scale) - e.subtract
        x[e.rows, e.tokens] = np.where(e.banned != 0, np.float32(-np.inf), v)


class RowMasks(NamedTuple):
    """Allowed-token bitmasks of some rows: bits [R, ceil(V / 32)] uint32 (bit t % 32 of word
    t // 32 set: token t allowed; xgrammar's and llguidance's layout) of rows ``rows`` [R]."""

    rows: np.ndarray
    bits: np.ndarray

    def take(self, positions: Sequence[int]) -> RowMasks | None:
        """The masks of rows ``positions`` (of the rows these masks index), renumbered 0, 1, ...
        in that order; None when none of them has a mask."""
        at = {int(r): k for k, r in enumerate(self.rows)}
        keep = [(j, at[p]) for j, p in enumerate(positions) if p in at]
        if not keep:
            return None
        return RowMasks(np.asarray([j for j, _ in keep], dtype=np.int32), self.bits[[k for _, k in keep]])


def token_bits(allowed: np.ndarray) -> np.ndarray:
    """Allowed tokens allowed[R, V] (bool) as bits [R, ceil(V / 32)] uint32 (``RowMasks``)."""
    R, V = allowed.shape
    padded = np.zeros((R, -(-V // 32) * 32), dtype=bool)
    padded[:, :V] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view("<u4")


def allowed_masks(
    params: Sequence[SamplingParams], vocab_size: int, token_masks: RowMasks | None = None
) -> RowMasks | None:
    """The masks of the rows with one: ``token_masks`` (structured outputs' grammars) and each
    row's allowed_token_ids (a row with both: their intersection); None when no row has one."""
    listed = [r for r, p in enumerate(params) if p.allowed_token_ids]
    if not listed:
        return token_masks
    keep = np.zeros((len(listed), vocab_size), dtype=bool)  # [L, V]
    for k, r in enumerate(listed):
        keep[k, list(params[r].allowed_token_ids)] = True
    own = token_bits(keep)  # [L, W]
    if token_masks is None:
        return RowMasks(np.asarray(listed, dtype=np.int32), own)
    rows = sorted(set(listed) | {int(r) for r in token_masks.rows})
    at = {r: k for k, r in enumerate(rows)}
    bits = np.full((len(rows), own.shape[1]), 0xFFFFFFFF, dtype=np.uint32)  # [R, W]
    bits[[at[r] for r in listed]] &= own
    bits[[at[int(r)] for r in token_masks.rows]] &= token_masks.bits
    return RowMasks(np.asarray(rows, dtype=np.int32), bits)


def apply_masks(x: np.ndarray, rows: np.ndarray, bits: np.ndarray) -> None:
    """Bit masks [R, W] (``RowMasks``) on rows of logits x[n, V]: disallowed tokens to -inf."""
    words = np.ascontiguousarray(bits, dtype=np.uint32).view(np.uint8)  # [R, 4W]
    keep = np.unpackbits(words, axis=1, count=x.shape[1], bitorder="little").view(bool)  # [R, V]
    sub = x[rows]
    sub[~keep] = -np.inf
    x[rows] = sub


def process_logits(
    x: np.ndarray,
    params: Sequence[SamplingParams],
    histories: Sequence[History | None],
    eos_ids=(),
    token_masks: RowMasks | None = None,
) -> np.ndarray:
    """vLLM's processing of logits x[n, V] (float32, changed in place and returned), in its order:
    ``token_masks`` (structured outputs), allowed_token_ids, bad words, min_tokens, logit_bias,
    then repetition, frequency and presence penalties. Penalties and biases are gathered over
    all rows at once as (row, token) pairs."""
    masks = allowed_masks(params, x.shape[1], token_masks)
    if masks is not None:
        apply_masks(x, *masks)
    if any(p.processes_logits for p in params):
        apply_edits(x, token_edits(params, histories, x.shape[1], eos_ids))
    return x


def _banned(params: SamplingParams, history: History | None, eos_ids) -> list:
    """Token ids this row may not produce now: bad words whose prefix ends the output, and the
    stop ids while fewer than min_tokens have been generated."""
    out = [] if history is None else history.output
    banned = []
    for word in params.bad_words_ids:
        head = list(word[:-1])
        if not head or (len(out) >= len(head) and out[len(out) - len(head) :] == head):
            banned.append(word[-1])
    if len(out) < params.min_tokens:
        banned.extend(stop_ids(params, eos_ids))
    return banned


def log_softmax(x: np.ndarray) -> np.ndarray:
    """log_softmax over the last axis of x[m, V] (float32 out, float64 sums); -inf stays -inf."""
    top = x.max(axis=-1, keepdims=True)  # [m, 1]
    shifted = x - top
    lse = np.log(np.exp(shifted).sum(axis=-1, keepdims=True, dtype=np.float64)).astype(np.float32)
    return shifted - lse


def token_logprobs(lp: np.ndarray, token: int, top_n: int) -> TokenLogprobs:
    """The record of ``token`` in one row of log-probabilities lp[V]: its value, rank (1 + how many
    are strictly more likely) and the top_n most likely (descending, ties by id)."""
    return _record(lp, 0.0, token, top_n)


TOP_CHUNK = 128  # top-N candidates: the chunks of the row whose maximum is among the N largest chunk maxima


def _record(x: np.ndarray, lse: float, token: int, top_n: int, floor: float | None = None) -> TokenLogprobs:
    """``token_logprobs`` of the row log_softmax(x) = x - lse, without making that row; ``floor``:
    a value the top_n largest are all >= (``_top_floors``), else a partition finds them."""
    V = x.shape[0]
    rank = 1 + int(np.count_nonzero(x > x[token]))
    top = ()
    if top_n:
        if floor is None:  # the n-th largest value itself (ties at it go by id below)
            floor = np.partition(x, V - top_n)[V - top_n] if top_n < V else -np.inf
        head = np.flatnonzero(x >= floor)
        head = head[np.lexsort((head, -x[head]))][:top_n]
        top = tuple((int(t), float(x[t]) - lse) for t in head)
    return TokenLogprobs(int(token), float(x[token]) - lse, rank, top)


def rows_logprobs(x: np.ndarray, tokens, top_ns) -> list:
    """TokenLogprobs of tokens[i] in row i of logits x[m, V]: each row's logsumexp (float64 sums),
    LOGSOFTMAX_BLOCK rows at a time, then the token, its rank and the top N read off the logits."""
    out = []
    for start in range(0, x.shape[0], LOGSOFTMAX_BLOCK):
        block = np.asarray(x[start : start + LOGSOFTMAX_BLOCK], dtype=np.float32)  # [b, V]
        top = block.max(axis=1, keepdims=True)  # [b, 1]
        shifted = np.subtract(block, top)
        np.exp(shifted, out=shifted)
        lse = top[:, 0].astype(np.float64) + np.log(shifted.sum(axis=1, dtype=np.float64))  # [b]
        ns = top_ns[start : start + block.shape[0]]
        floors = _top_floors(block, max(ns))
        for i in range(block.shape[0]):
            floor = None if floors is None else float(floors[i])
            out.append(_record(block[i], float(lse[i]), int(tokens[start + i]), ns[i], floor))
    return out


def _top_floors(x: np.ndarray, n: int) -> np.ndarray | None:
    """Per row of x[b, V], the n-th largest maximum of its TOP_CHUNK-wide chunks: n chunks reach
    it, so the row's n largest values are all >= it (a few candidates instead of a partition of
    V). None when the rows have fewer than 2n chunks or n is 0."""
    b, V = x.shape
    whole = V // TOP_CHUNK * TOP_CHUNK
    if n == 0 or V // TOP_CHUNK < 2 * n:
        return None
    maxima = x[:, :whole].reshape(b, -1, TOP_CHUNK).max(axis=2)  # [b, C]
    if whole < V:
        maxima = np.concatenate([maxima, x[:, whole:].max(axis=1, keepdims=True)], axis=1)
    C = maxima.shape[1]
    return np.partition(maxima, C - n, axis=1)[:, C - n]


def sample_processed(
    logits: np.ndarray,
    params: Sequence[SamplingParams],
    uniforms: np.ndarray,
    histories: Sequence[History | None],
    eos_ids=(),
    token_masks: RowMasks | None = None,
    logprobs_mode: str = "raw",
) -> tuple[list[int], list]:
    """Tokens of host logits[n, V] after ``process_logits`` (greedy rows: argmax of the processed
    logits; sampled ones: ``sample_rows``, which applies temperature, min-p, top-k and top-p),
    and the TokenLogprobs of each row whose params ask for logprobs (else None): "raw" from
    the model's logits, "processed" after the processing, temperature and min-p (none for a row
    whose token is a RowFailure)."""
    x = np.array(logits, dtype=np.float32)  # [n, V] a copy: the caller's rows stay raw
    if token_masks is not None or any(p.processes_logits for p in params):
        process_logits(x, params, histories, eos_ids, token_masks)
    tokens = sample_rows(x, params, uniforms)
    raw = [r for r, p in enumerate(params) if p.logprobs is not None and not isinstance(tokens[r], RowFailure)]
    if not raw:
        return tokens, [None] * len(params)
    source = logits[raw] if logprobs_mode == "raw" else _processed(x[raw], [params[r] for r in raw])
    records = rows_logprobs(source, [tokens[r] for r in raw], [params[r].logprobs for r in raw])
    out = [None] * len(params)
    for r, rec in zip(raw, records):
        out[r] = rec
    return tokens, out


def _processed(x: np.ndarray, params: Sequence[SamplingParams]) -> np.ndarray:
    """Processed logits x[m, V] of sampled rows, their maximum subtracted (a tiny temperature
    cannot overflow them to +inf), divided by their temperature, min-p cut to -inf."""
    for i, p in enumerate(params):
        if p.temperature == 0.0:
            continue
        x[i] -= x[i].max()
        with np.errstate(over="ignore"):  # a tiny temperature: every non-maximum to -inf
            x[i] /= np.float32(max(p.temperature, 1.0 / F32_MAX))
        if p.min_p > 0.0:
            probs = np.exp(x[i] - x[i].max())
            x[i][probs < np.float32(p.min_p)] = -np.inf
    return x


def sample_on_device(
    ops,
    logits,
    rows: Sequence[int],
    params: Sequence[SamplingParams],
    uniforms: np.ndarray,
    histories: Sequence[History | None],
    eos_ids=(),
    token_masks: RowMasks | None = None,
    logprobs_mode: str = "raw",
) -> tuple[list[int], list]:
    """``sample_processed`` of rows ``rows`` of device logits[B, V] with the processing on the
    device (``ops.gather_logits`` / ``mask_logits`` / ``edit_logits``: kernels/sampling.cu, the
    same float32 operations as the host's): greedy rows take the device argmax of the processed
    rows and sampled rows without a top-k / top-p cut the device's draw (``ops.sample_logits``),
    so only rows with such a cut and rows asking for logprobs come to the host. ``params`` etc.
    are per entry of ``rows``."""
    V = logits.shape[1]
    x = ops.gather_logits(logits, np.asarray(rows))  # [m, V] float32
    masks = allowed_masks(params, V, token_masks)
    if masks is not None:
        ops.mask_logits(x, *masks)
    for e in token_edits(params, histories, V, eos_ids):
        ops.edit_logits(x, e.rows, e.tokens, e.banned, e.bias, e.scale, e.subtract)
    tokens = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    sampled = [i for i, p in enumerate(params) if p.temperature != 0.0]
    if greedy:
        picked = ops.argmax(x if len(greedy) == len(params) else ops.gather_logits(x, np.asarray(greedy)))
        for i, t in zip(greedy, picked):
            tokens[i] = int(t)
    uncut = [i for i in sampled if not (0 < params[i].top_k < V) and params[i].top_p >= 1.0]
    if uncut:  # drawn on the device: only the ids come back
        temps = np.array([params[i].temperature for i in uncut], dtype=np.float64)
        with np.errstate(over="ignore", divide="ignore"):
            inv_temp = np.minimum(1.0 / temps, F32_MAX).astype(np.float32)
        min_p = np.array([params[i].min_p for i in uncut], dtype=np.float32)
        drawn = ops.sample_logits(ops.gather_logits(x, np.asarray(uncut)), inv_temp, min_p, uniforms[uncut])
        for i, t in zip(uncut, drawn):
            tokens[i] = int(t)
    on_device = greedy + uncut  # their processed rows must be finite (a NaN would make the draw garbage)
    if on_device:
        checked(tokens, on_device, ops.to_host(x[ops.index(np.asarray(on_device))].max(axis=1)))
    cut = [i for i in sampled if i not in uncut]
    if cut:  # top-k / top-p: the host's sampler
        host = ops.to_host(ops.gather_logits(x, np.asarray(cut)))  # [s, V]
        for i, t in zip(cut, sample_rows(host, [params[i] for i in cut], uniforms[cut])):
            tokens[i] = t
    asked = [i for i, p in enumerate(params) if p.logprobs is not None and not isinstance(tokens[i], RowFailure)]
    records = [None] * len(params)
    if asked:
        if logprobs_mode == "raw":
            source = ops.to_host(ops.gather_logits(logits, np.asarray([rows[i] for i in asked])))
        else:
            source = _processed(ops.to_host(ops.gather_logits(x, np.asarray(asked))), [params[i] for i in asked])
        for i, rec in zip(
            asked, rows_logprobs(source, [tokens[i] for i in asked], [params[i].logprobs for i in asked])
        ):
            records[i] = rec
    return tokens, records
