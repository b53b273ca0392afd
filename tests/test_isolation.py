"""Failure isolation per request (docs/design.md, "Failure isolation"): the sampler's finite check,
``isolation.per_row``, the numeric ranges every entry point shares, and the real engine (the
built-in model, one rank) with a failure planted in one row's stage: that request ends with its
error, every other one gets exactly the tokens it gets without it, and every KV block comes back.
The same at ``mpiexec -n 2`` over HTTP: tests/test_fuzz_sampling.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
from planted_faults import PLANTED_MATCHER, PLANTED_REGEX, PLANTED_SEED, PLANTED_TOKEN, plant

from eprt.api import RANGES, GenerationRequest, Guide, JobFailure, RequestError, SamplingParams
from eprt.engine import sampling
from eprt.engine.choices import token_logprobs
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.engine.isolation import per_row
from eprt.scheduler.interface import RowFailure
from eprt.serve.params import FieldError, parse_options

V = 16


def test_a_row_without_a_finite_token_fails_alone_and_the_others_draw_as_alone():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, V)).astype(np.float32)
    x[1] = -np.inf  # every token masked
    x[3, 7] = np.nan  # a broken row
    params = [SamplingParams(temperature=t, top_p=0.9) for t in (0.0, 1.0, 0.7, 0.0, 1.3)]
    uniforms = rng.random(5)
    tokens = sampling.sample_rows(x, params, uniforms)
    assert tokens[1] == RowFailure(sampling.NO_TOKEN)
    assert isinstance(tokens[3], RowFailure) and "not finite" in tokens[3].reason
    for r in (0, 2, 4):
        assert tokens[r] == sampling.sample_rows(x[r : r + 1], params[r : r + 1], uniforms[r : r + 1])[0]
    masked = sampling.RowMasks(np.array([0], np.int32), sampling.token_bits(np.zeros((1, V), bool)))
    got, records = sampling.sample_processed(
        x[[0, 2]], [SamplingParams(logprobs=2), SamplingParams(logprobs=2)], uniforms[:2], [None, None], (), masked
    )
    assert got[0] == RowFailure(sampling.NO_TOKEN) and records[0] is None and records[1] is not None


def test_per_row_runs_a_failed_batch_row_by_row_and_never_catches_a_job_failure():
    def run(items):
        if 2 in items:
            raise ValueError("bad row")
        return [i * 10 for i in items]

    assert per_row([0, 1, 2, 3], run, "stage") == [0, 10, RowFailure("stage failed: ValueError: bad row"), 30]
    assert per_row([], run, "stage") == []

    def shared(items):
        raise JobFailure("rank 1 died")

    with pytest.raises(JobFailure):
        per_row([0, 1], shared, "stage")


def test_tiny_temperatures_give_finite_logprobs():
    x = np.array([[3.0, 1.0, -2.0, 50.0]], dtype=np.float32)
    assert np.isfinite(token_logprobs(x, np.array([1e-320]), np.array([3]))).all()
    out = sampling._processed(x.copy(), [SamplingParams(temperature=1e-300)])
    assert out[0, 3] == 0.0 and not np.isnan(out).any() and np.isposinf(out).sum() == 0


EDGES = [
    ("repetition_penalty", 1e-320, False),  # issue 35: divided logits to +inf, crashed the job
    ("repetition_penalty", 0.0, False),
    ("repetition_penalty", 1e-6, True),
    ("repetition_penalty", 1e6, True),
    ("repetition_penalty", 1e7, False),
    ("temperature", -0.0, True),
    ("temperature", 5e-324, True),
    ("temperature", 1e4, True),
    ("temperature", 1e308, False),
    ("temperature", 10**400, False),  # was an OverflowError (a 500)
    ("temperature", math.nan, False),
    ("top_p", 5e-324, True),
    ("top_p", 0.0, False),
    ("top_p", -0.0, False),
    ("min_p", 1.0, True),
    ("presence_penalty", 2**70, False),
    ("frequency_penalty", -2.0, True),
]


@pytest.mark.parametrize("name,value,ok", EDGES, ids=[f"{n}={v!r:.12}" for n, v, _ in EDGES])
def test_every_entry_point_takes_the_same_range(name, value, ok):
    try:
        parse_options({name: value}, V, 16)
    except FieldError as e:
        assert not ok and e.param == name and str(RANGES[name]) in str(e) and name in str(e)
    else:
        assert ok
    try:
        SamplingParams(**{name: value}).validate(V)
    except RequestError as e:
        assert not ok and str(RANGES[name]) in str(e)
    else:
        assert ok


@pytest.mark.parametrize("body", [{"timeout": 10**400}, {"logit_bias": {"3": 10**400}}, {"timeout": -0.0}])
def test_huge_integers_and_zero_are_refused_as_fields(body):
    with pytest.raises(FieldError) as e:
        parse_options(body, V, 16)
    assert e.value.param == next(iter(body))


@pytest.fixture(scope="module")
def engine():
    with launch_engine(EngineConfig(device="cpu", max_batch=8, max_model_len=256)) as engine:
        yield engine


def _good(engine) -> list:
    ids = engine.tokenizer.encode("The cat sat")
    return [
        GenerationRequest(ids, SamplingParams(max_tokens=12, temperature=0.8, seed=3, top_p=0.9)),
        GenerationRequest(ids, SamplingParams(max_tokens=12, presence_penalty=0.5, logprobs=2)),
        GenerationRequest(ids, SamplingParams(max_tokens=12)),
        GenerationRequest(ids, SamplingParams(max_tokens=12, temperature=1.0, seed=4, min_p=0.1, best_of=2)),
    ]


PLANTED = {  # what each planted failure's request sends, and the words its error must contain
    "logits processing": (dict(seed=PLANTED_SEED, presence_penalty=0.5, temperature=0.7), "planted failure in the"),
    "structured mask": (dict(guide=Guide("regex", f"({PLANTED_REGEX})+")), "structured-output mask"),
    "grammar matcher": (dict(guide=Guide("regex", f"({PLANTED_MATCHER})+")), "structured-output matcher"),
    "detokenizer": (dict(logit_bias=((PLANTED_TOKEN, 100.0),)), "detokenizing failed"),
    "no token left": (dict(allowed_token_ids=(5,), stop_token_ids=(5,), min_tokens=3), "no token is left"),
}


@pytest.mark.parametrize("what", PLANTED)
def test_a_planted_failure_fails_its_request_alone(engine, monkeypatch, what):
    with monkeypatch.context() as m:
        plant(m)
        fields, words = PLANTED[what]
        ids = engine.tokenizer.encode("aaaa")
        bad = GenerationRequest(ids, SamplingParams(max_tokens=8, **fields))
        with_bad = engine.generate_choices(_good(engine)[:3] + [bad] + _good(engine)[3:])
    alone = engine.generate_choices(_good(engine))
    failed = with_bad.pop(3)[0]
    assert failed.finish_reason == "error" and words in failed.error, failed
    assert [[(r.token_ids, r.finish_reason) for r in c] for c in with_bad] == [
        [(r.token_ids, r.finish_reason) for r in c] for c in alone
    ]
    assert with_bad[1][0].logprobs == alone[1][0].logprobs
    stats = engine.stats()
    assert stats["free_blocks"] == stats["total_blocks"] and stats["running"] == 0


FORKED = {  # n = 3: the prefill's row fails (each row's processing), or its state does before the forks
    "logits processing": dict(temperature=0.9, seed=PLANTED_SEED, presence_penalty=0.2),
    "grammar matcher": dict(guide=Guide("regex", f"({PLANTED_MATCHER})+")),
}


@pytest.mark.parametrize("what", FORKED)
def test_a_failed_row_in_a_prefill_with_forks_fails_that_request(engine, monkeypatch, what):
    with monkeypatch.context() as m:
        plant(m)
        ids = engine.tokenizer.encode("aaaa")
        params = SamplingParams(max_tokens=6, n=3, **FORKED[what])
        out = engine.generate_choices([GenerationRequest(ids, params), *_good(engine)[:1]])
    assert [r.finish_reason for r in out[0]] == ["error"] * 3
    assert out[1][0].finish_reason in ("stop", "length") and out[1][0].error is None  # the other request served
    assert all("planted failure" in r.error for r in out[0]), out[0]
    stats = engine.stats()
    assert stats["free_blocks"] == stats["total_blocks"] and stats["running"] == 0
