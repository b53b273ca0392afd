"""The sampler: greedy, temperature, top-k, top-p and seeds."""
import numpy as np

from eprt.engine.api import SamplingParams
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
    p = draws(SamplingParams(temperature=1.0, top_p=0.75))        # 0.4 + 0.3 < 0.75 <= 0.85
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
    from eprt.engine.api import RequestError
    with pytest.raises(RequestError, match="finite"):
        SamplingParams(temperature=float("inf")).validate(10)
