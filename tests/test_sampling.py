"""The sampler: greedy, temperature, top-k, top-p and seeds."""

import numpy as np

from eprt.api import SamplingParams
from eprt.engine.sampling import make_rng, sample

LOGITS = np.log(np.array([0.05, 0.4, 0.3, 0.15, 0.1], dtype=np.float32))


def draws(params, n=4000, seed=0):
    rng = np.random.default_rng(seed)
    return np.bincount([sample(LOGITS, params, rng) for _ in range(n)], minlength=5) / n


def test_greedy_and_degenerate_cuts_pick_the_maximum():
    rng = np.random.default_rng(0)
    assert sample(LOGITS, SamplingParams(temperature=0.0), rng) == 1
    assert {sample(LOGITS, SamplingParams(temperature=1.0, top_k=1), rng) for _ in range(50)} == {1}
    assert {sample(LOGITS, SamplingParams(temperature=1.0, top_p=0.01), rng) for _ in range(50)} == {1}


def test_temperature_one_follows_the_softmax():
    np.testing.assert_allclose(draws(SamplingParams(temperature=1.0)), np.exp(LOGITS), atol=0.03)


def test_top_k_and_top_p_keep_only_the_head():
    k2 = draws(SamplingParams(temperature=1.0, top_k=2))
    assert k2[[0, 3, 4]].sum() == 0
    np.testing.assert_allclose(k2[[1, 2]], [0.4 / 0.7, 0.3 / 0.7], atol=0.03)
    p = draws(SamplingParams(temperature=1.0, top_p=0.75))  # 0.4 + 0.3 < 0.75 <= 0.85
    assert p[[0, 4]].sum() == 0 and p[3] > 0


def test_low_temperature_sharpens():
    assert draws(SamplingParams(temperature=0.1))[1] > 0.9


def test_request_seed_fixes_the_stream():
    params = SamplingParams(temperature=1.0, seed=42)
    a, b = make_rng(params, np.random.default_rng(1)), make_rng(params, np.random.default_rng(2))
    assert [sample(LOGITS, params, a) for _ in range(20)] == [sample(LOGITS, params, b) for _ in range(20)]


def test_tiny_temperature_is_greedy_not_nan():
    rng = np.random.default_rng(0)
    for t in (1e-310, 1e-30, 1e-8):
        assert sample(LOGITS, SamplingParams(temperature=t), rng) == 1


def test_infinite_temperature_is_rejected():
    import pytest

    from eprt.api import RequestError

    with pytest.raises(RequestError, match="finite"):
        SamplingParams(temperature=float("inf")).validate(10)


def reference_nucleus(p, top_p):
    """The plain definition: sort everything (descending, ties by index), keep the prefix."""
    order = np.argsort(-p, kind="stable")
    return order[: int(np.searchsorted(np.cumsum(p[order]), top_p) + 1)]


def test_nucleus_equals_the_full_sort():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from eprt.engine.sampling import _nucleus

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(
        V=st.sampled_from([10, 4097, 150_000]),
        temp=st.sampled_from([0.05, 0.7, 1.5, 8.0, 300.0]),  # 300: one bucket holds most
        top_p=st.sampled_from([0.01, 0.5, 0.9, 0.999, 0.99999]),
        ties=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def check(V, temp, top_p, ties, seed):
        rng = np.random.default_rng(seed)
        x = np.round(rng.standard_normal(V)) if ties else rng.standard_normal(V)  # ties straddle the cut
        p = np.exp((x - x.max()) / temp).astype(np.float32)
        want = np.zeros(V, dtype=bool)
        want[reference_nucleus(p.astype(np.float64) / p.sum(dtype=np.float64), top_p)] = True
        nuc = _nucleus(p, top_p)
        got = nuc.high > nuc.edge
        got[nuc.edge_kept] = True
        assert (got != want).sum() == 0, (got.sum(), want.sum())

    check()


def test_sampled_rows_of_a_batch_match_one_by_one(checkpoint):
    # one host copy for all sampled rows gives the tokens of sampling each request alone
    from eprt.api import GenerationRequest
    from eprt.engine.engine import EngineConfig, launch_engine

    cfg = EngineConfig(model=checkpoint("qwen3_moe"), device="cpu", max_batch=4)
    reqs = [
        GenerationRequest([5, 9, i], SamplingParams(max_tokens=8, temperature=0.9 if i % 2 else 0.0, top_p=0.9, seed=i))
        for i in range(4)
    ]
    with launch_engine(cfg) as engine:
        together = [r.token_ids for r in engine.generate(reqs)]
        alone = [engine.generate([r])[0].token_ids for r in reqs]
    assert together == alone


def reference_kept(logits, params):
    """The definition: softmax at the temperature (float64), keep values >= the k-th largest,
    renormalize, keep the smallest descending prefix reaching top_p. Returns the kept indices
    in the order the inverse CDF walks them and their unnormalized probabilities: index order
    with no cut, else by the sampler's value bucket (high 16 bits of its float32 p), highest
    first, then index."""
    p = np.exp((logits.astype(np.float64) - logits.max()) / params.temperature)
    V = p.shape[0]
    if not (0 < params.top_k < V) and params.top_p >= 1.0:
        return np.arange(V), p
    order = np.argsort(-p, kind="stable")
    if 0 < params.top_k < V:
        order = order[p[order] >= p[order][params.top_k - 1]]
    if params.top_p < 1.0:
        q = p[order] / p[order].sum()
        order = order[: int(np.searchsorted(np.cumsum(q), params.top_p)) + 1]
    p32 = np.exp((logits - logits.max()) * np.float32(1.0 / params.temperature))  # as the sampler computes it
    order = np.sort(order)
    order = order[np.argsort(-(p32[order].view(np.int32) >> 16), kind="stable")]
    return order, p[order]


def assert_inverse_cdf(token, logits, params, u):
    """token is the kept one whose CDF interval holds u (up to float32 rounding of the probabilities)."""
    order, p = reference_kept(logits, params)
    where = np.flatnonzero(order == token)
    assert where.size == 1, f"{params}: token {token} is not among the {len(order)} kept"
    c = np.cumsum(p) / p.sum()
    lo, hi = (c[where[0] - 1] if where[0] else 0.0), c[where[0]]
    assert lo - 1e-5 <= u <= hi + 1e-5, (params, token, u, lo, hi)


def test_batched_sampler_picks_the_definitions_token():
    from eprt.engine.sampling import sample_rows

    rng = np.random.default_rng(3)
    V = 40_000
    rows = [
        rng.standard_normal(V) * 3,  # peaked: the nucleus lies in a small head
        rng.standard_normal(V) * 0.2,  # flat: no head holds it, the partition/sort path
        np.round(rng.standard_normal(V)),  # ties straddle every cut
        -1.1 * np.log(rng.permutation(np.arange(1, V + 1))),  # Zipf
    ]
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=50),
        SamplingParams(temperature=1.0, top_k=30_000),  # more than a head: the partition path
        SamplingParams(temperature=0.5, top_k=200, top_p=0.8),
        SamplingParams(temperature=2.0, top_p=0.999),
    ]
    for x in rows:
        logits = x.astype(np.float32)
        for ps in params:
            us = rng.random(6)
            for token, u in zip(sample_rows(np.stack([logits] * 6), [ps] * 6, us), us):
                assert_inverse_cdf(token, logits, ps, u)


def test_batched_sampler_follows_the_distribution_chi_square():
    # 4000 draws of one position over a fixed seed set, against the cut softmax (chi-square,
    # df <= 4: the 0.1% critical value is 18.5)
    from eprt.engine.sampling import sample_rows, token_uniform

    for params, kept in [
        (SamplingParams(temperature=1.0), [0, 1, 2, 3, 4]),
        (SamplingParams(temperature=0.5), [0, 1, 2, 3, 4]),
        (SamplingParams(temperature=1.0, top_k=3), [1, 2, 3]),
        (SamplingParams(temperature=1.0, top_p=0.75), [1, 2, 3]),
    ]:
        n = 4000
        us = np.array([token_uniform(seed, 7) for seed in range(n)])
        got = np.bincount(sample_rows(np.stack([LOGITS] * n), [params] * n, us), minlength=5)
        p = np.exp(LOGITS.astype(np.float64) / params.temperature)[kept]
        want = n * p / p.sum()
        assert got[[i for i in range(5) if i not in kept]].sum() == 0
        chi2 = float(((got[kept] - want) ** 2 / want).sum())
        assert chi2 < 18.5, (params, got, want)


def test_a_draw_depends_only_on_seed_and_position(checkpoint):
    # resuming a request from its own first tokens gives the rest of its stream: the draw of
    # token p is a function of (seed, p), not of the steps or batch-mates before it
    from eprt.api import GenerationRequest
    from eprt.engine.engine import EngineConfig, launch_engine

    cfg = EngineConfig(model=checkpoint("qwen3_moe"), device="cpu", max_batch=4)
    params = SamplingParams(max_tokens=8, temperature=1.5, seed=11, ignore_eos=True)
    prompt = [5, 9, 14]
    with launch_engine(cfg) as engine:
        whole = engine.generate([GenerationRequest(prompt, params)])[0].token_ids
        rest = engine.generate(
            [
                GenerationRequest([7, 7], SamplingParams(max_tokens=3, temperature=1.0, seed=3)),
                GenerationRequest(prompt + whole[:3], SamplingParams(**{**params.__dict__, "max_tokens": 5})),
            ]
        )[1].token_ids
        again = engine.generate([GenerationRequest(prompt, params)])[0].token_ids
    assert rest == whole[3:] and again == whole


def test_any_seed_makes_a_key():
    from eprt.engine.sampling import request_seed, token_uniform

    fallback = np.random.default_rng(0)
    keys = {request_seed(SamplingParams(temperature=1.0, seed=s), fallback) for s in (0, 2**64, 2**128, 2**300)}
    assert len(keys) == 4 and all(0 <= k < 2**128 for k in keys)
    assert all(0.0 <= token_uniform(k, 10**12) < 1.0 for k in keys)


def test_logprob_records_are_ordered_with_ties_by_id_and_rank_the_token():
    from eprt.engine.sampling import log_softmax, rows_logprobs

    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 20000)) * 3).astype(np.float32)
    x[0, 100:400] = x[0].max() + 1.0  # 300 tied maxima: the lowest ids come first
    x[1, ::2] = -np.inf  # masked tokens never appear
    tokens = [150, int(np.argmax(x[1])), 5]
    records = rows_logprobs(x, tokens, [4, 20, 0])
    assert [t for t, _ in records[0].top] == [100, 101, 102, 103] and records[0].rank == 1
    assert all(t % 2 == 1 for t, _ in records[1].top) and records[1].rank == 1
    assert records[2].top == () and records[2].rank == 1 + int(np.sum(x[2] > x[2, 5]))
    lp = log_softmax(x.astype(np.float64))
    for i, rec in enumerate(records):
        assert abs(rec.logprob - lp[i, tokens[i]]) < 1e-5
        values = [v for _, v in rec.top]
        assert values == sorted(values, reverse=True)
        np.testing.assert_allclose(values, [lp[i, t] for t, _ in rec.top], atol=1e-5)


def test_batched_processing_equals_each_row_alone_and_the_token_mask_hook():
    from eprt.engine.sampling import History, RowMasks, process_logits, token_bits

    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 300)).astype(np.float32)
    params = [
        SamplingParams(presence_penalty=1.0, repetition_penalty=1.5, logit_bias=((3, 5.0),)),
        SamplingParams(frequency_penalty=-0.5, bad_words_ids=((7, 8), (9,))),
        SamplingParams(),
        SamplingParams(min_tokens=5, allowed_token_ids=(2, 4, 6, 8)),
    ]
    histories = [History.of([1, 2, 3, 3]).sync([7, 10, 7]) for _ in params]
    fifths = token_bits((np.arange(300) % 5 == 0)[None, :])  # [1, W] a structured-output mask of row 2
    together = process_logits(x.copy(), params, histories, (2,), RowMasks(np.array([2]), fifths))
    for r in range(4):
        mask = RowMasks(np.array([0]), fifths) if r == 2 else None
        alone = process_logits(x[r : r + 1].copy(), params[r : r + 1], histories[r : r + 1], (2,), mask)
        np.testing.assert_array_equal(together[r], alone[0])
    assert np.isneginf(together[1, [8, 9]]).all() and np.isfinite(together[1, 7])
    assert np.isneginf(together[2, np.arange(300) % 5 != 0]).all() and np.isfinite(together[2, ::5]).all()
    assert np.isneginf(together[3, 2]) and np.isfinite(together[3, [4, 6, 8]]).all()
    assert together[0, 3] == np.float32(x[0, 3] + 5.0) / np.float32(1.5) or together[0, 3] == (x[0, 3] + 5.0) * 1.5
    np.testing.assert_array_equal(together[2, ::5], x[2, ::5])


def test_row_masks_and_allowed_token_ids_intersect_and_keep_their_rows():
    from eprt.engine.sampling import RowMasks, allowed_masks, apply_masks, token_bits

    rng = np.random.default_rng(6)
    V = 70  # not a multiple of 32
    grammar = rng.random((2, V)) < 0.5  # structured-output masks of rows 1 and 3
    params = [SamplingParams(), SamplingParams(allowed_token_ids=(1, 2, 3, 40)), SamplingParams()]
    params += [SamplingParams(), SamplingParams(allowed_token_ids=(5, 69))]
    masks = allowed_masks(params, V, RowMasks(np.array([1, 3]), token_bits(grammar)))
    want = np.ones((5, V), dtype=bool)
    want[[1, 3]] = grammar
    want[1] &= np.isin(np.arange(V), [1, 2, 3, 40])
    want[4] = np.isin(np.arange(V), [5, 69])
    assert masks.rows.tolist() == [1, 3, 4]
    x = rng.standard_normal((5, V)).astype(np.float32)
    apply_masks(x, *masks)
    np.testing.assert_array_equal(np.isfinite(x), want)
    assert allowed_masks([SamplingParams()] * 5, V) is None


def test_compiled_bucket_sums_give_the_same_draws(monkeypatch):
    """On the compiled CPU path the nucleus's bucket masses come from cpu_kernels.bucket_sums: the
    sums np.bincount makes (each bucket in index order, float64), so the same tokens either way."""
    import pytest

    pytest.importorskip("numba")
    from eprt.engine.sampling import NUM_BUCKETS, sample_rows
    from eprt.ops import cpu_kernels

    rng = np.random.default_rng(5)
    for V in (1, 1000, 151936):
        p = np.exp(rng.standard_normal(V) * 3).astype(np.float32)
        p /= p.max()
        keys = p.view(np.int32) >> 16
        want = np.bincount(keys, weights=p, minlength=NUM_BUCKETS)
        assert np.array_equal(cpu_kernels.bucket_sums(keys, p, NUM_BUCKETS), want)
    with pytest.raises(ValueError):  # a key outside the buckets: NumPy's error
        cpu_kernels.bucket_sums(np.array([1, -1]), np.ones(2, np.float32), 4)
    logits = np.concatenate([rng.standard_normal((4, 151936)) * 2, np.round(rng.standard_normal((4, 151936)))])
    params = [SamplingParams(temperature=0.7, top_p=0.95), SamplingParams(temperature=300.0, top_p=0.5)] * 4
    uniforms = rng.random(8)
    tokens = {}
    for path in ("numba", "numpy"):
        monkeypatch.setenv("EPRT_CPU_EXPERTS", path)
        tokens[path] = sample_rows(logits.astype(np.float32), params, uniforms)
    assert tokens["numba"] == tokens["numpy"]
