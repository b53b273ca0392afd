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

    from eprt.engine.sampling import TOP_P_HEADS, nucleus

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(
        V=st.sampled_from([10, 4 * TOP_P_HEADS[0] + 1, 4 * TOP_P_HEADS[1] + 1, 150_000]),
        temp=st.sampled_from([0.05, 0.7, 1.5, 8.0]),
        top_p=st.sampled_from([0.01, 0.5, 0.9, 0.999, 0.99999]),
        ties=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def check(V, temp, top_p, ties, seed):
        rng = np.random.default_rng(seed)
        x = np.round(rng.standard_normal(V)) if ties else rng.standard_normal(V)  # ties straddle the cut
        p = np.exp((x - x.max()) / temp)
        p /= p.sum()
        np.testing.assert_array_equal(nucleus(p, top_p), reference_nucleus(p, top_p))

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
