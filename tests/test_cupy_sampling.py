"""The device logits processing (kernels/sampling.cu through CupyOps) against the NumPy
reference of eprt/engine/sampling.py: masks and per-token edits bit for bit, and whole
batches of penalized, biased, masked, greedy and sampled rows giving the host's tokens and
logprobs. Runs on a GPU or on cusim (``-p cusim.plugin``)."""

from __future__ import annotations

import numpy as np
import pytest

from eprt.api import SamplingParams
from eprt.engine.sampling import (
    History,
    RowMasks,
    allowed_masks,
    apply_edits,
    apply_masks,
    sample_on_device,
    sample_processed,
    token_bits,
    token_edits,
    token_uniform,
)
from eprt.ops import device
from eprt.scheduler.interface import RowFailure

gpu = pytest.mark.skipif(not device.cuda_usable(), reason="CuPy cannot use a CUDA device here")
pytestmark = [gpu, pytest.mark.gpu]
V = 3000  # not a multiple of 32: the last mask word is partial
EOS = (2,)


@pytest.fixture
def g():
    from eprt.ops.cupy_ops import CupyOps

    return CupyOps()


def bf16(a) -> np.ndarray:
    from eprt.ops.bf16 import bf16_bits_to_f32, f32_to_bf16_bits

    return bf16_bits_to_f32(f32_to_bf16_bits(np.asarray(a, np.float32)))


def batch(rng, n):
    """Params and histories of n rows mixing every processing option, greedy and sampled."""
    params, histories = [], []
    for r in range(n):
        h = History.of(rng.integers(0, V, 40)).sync(rng.integers(0, 50, 30).tolist())
        params.append(
            SamplingParams(
                temperature=0.0 if r % 2 == 0 else 0.8,
                top_k=0 if r % 3 else 40,
                presence_penalty=[0.0, 0.7, -1.5][r % 3],
                frequency_penalty=[0.4, 0.0, 1.1][r % 3],
                repetition_penalty=[1.0, 1.3, 0.7, 2.0][r % 4],
                logit_bias=tuple((int(t), float(b)) for t, b in zip(rng.integers(0, V, 5), rng.uniform(-9, 9, 5))),
                min_tokens=40 if r == 3 else 0,
                bad_words_ids=((int(h.output[-1]), 17), (5,)),
                allowed_token_ids=tuple(range(0, V, 3)) if r == 5 else (),
                min_p=0.05 if r % 4 == 1 else 0.0,
                logprobs=[None, 0, 3][r % 3],
            )
        )
        histories.append(h)
    return params, histories


def test_masks_and_edits_match_the_numpy_reference_bit_for_bit(g):
    import cupy

    rng = np.random.default_rng(5)

    params, histories = batch(rng, 8)
    logits = bf16(rng.standard_normal((8, V)) * 4)
    logits[:, :64] = 0.0  # zeros: the repetition sign test at its edge
    masks = RowMasks(np.array([6]), token_bits((rng.random(V) < 0.5)[None, :]))  # a structured-output mask
    for device_logits in (g.activation(logits), cupy.asarray(logits)):
        want = logits.copy()
        rows, bits = allowed_masks(params, V, masks)
        apply_masks(want, rows, bits)
        stages = token_edits(params, histories, V, EOS)
        apply_edits(want, stages)
        x = g.gather_logits(device_logits, np.arange(8))
        g.mask_logits(x, rows, bits)
        for e in stages:
            g.edit_logits(x, e.rows, e.tokens, e.banned, e.bias, e.scale, e.subtract)
        np.testing.assert_array_equal(g.to_host(x), want)
    assert len(stages) == 4 and np.isneginf(want[3, 2]) and np.isneginf(want[:, 5]).all()


def test_device_batches_sample_the_host_tokens_and_logprobs(g):
    rng = np.random.default_rng(9)
    params, histories = batch(rng, 8)
    logits = bf16(rng.standard_normal((10, V)) * 3)
    rows = [9, 0, 4, 2, 7, 1, 3, 8]  # a subset of the batch's rows, in any order
    for step in range(6):
        uniforms = np.array([token_uniform(1000 + r, step) for r in range(8)])
        want, want_lp = sample_processed(logits[rows], params, uniforms, histories, EOS)
        got, got_lp = sample_on_device(g, g.activation(logits), rows, params, uniforms, histories, EOS)
        assert got == want
        for a, b in zip(got_lp, want_lp):
            assert (a is None) == (b is None)
            if a is not None:
                assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
                assert abs(a.logprob - b.logprob) < 1e-6
        for h, t in zip(histories, got):
            h.sync(h.output + [t])


def test_device_draw_follows_the_softmax_and_the_host_draw(g):
    """The device's inverse-CDF draw (no top-k / top-p cut): the host's token for almost every
    uniform (they differ only where rounding moves a boundary), and a chi-square fit to
    softmax(x / T) with min-p's cut, on fixed seeds."""
    import cupy

    from eprt.engine.sampling import sample_rows

    rng = np.random.default_rng(21)
    vocab, n, temperature, min_p = 40, 3000, 0.8, 0.02
    row = (rng.standard_normal(vocab) * 2).astype(np.float32)
    row[[3, 17]] = -np.inf  # masked tokens are never drawn
    uniforms = np.array([token_uniform(77, k) for k in range(n)])
    x = cupy.asarray(np.tile(row, (n, 1)))
    got = g.sample_logits(x, np.full(n, 1 / temperature), np.full(n, min_p), uniforms)
    want = np.asarray(
        sample_rows(np.tile(row, (n, 1)), [SamplingParams(temperature=temperature, min_p=min_p)] * n, uniforms)
    )
    assert np.mean(got == want) > 0.99
    p = np.exp((row - row.max()) / temperature)
    p[p < min_p] = 0.0
    p /= p.sum()
    counts = np.bincount(got, minlength=vocab)
    assert counts[p == 0].sum() == 0
    live = p > 0
    expected = n * p[live]
    chi2 = float(((counts[live] - expected) ** 2 / expected).sum())
    assert chi2 < 2.0 * live.sum() + 20  # dof = live - 1; this bound is far in the tail


def test_engine_on_the_device_processes_draws_and_reports_logprobs(checkpoint):
    """The runner's device path end to end (bf16 model: outcomes the processing forces, and
    logprobs close to the NumPy engine's)."""
    from eprt.api import GenerationRequest
    from eprt.engine.engine import EngineConfig, launch_engine

    path, prompt = checkpoint("qwen3_moe"), [140, 9, 9, 31, 200, 17, 64, 12, 250, 11]
    requests = [
        SamplingParams(max_tokens=4, logit_bias=((123, 100.0),), logprobs=2, prompt_logprobs=1),
        SamplingParams(max_tokens=4, temperature=0.9, seed=5, min_p=0.1, logit_bias=((77, 100.0),)),
        SamplingParams(max_tokens=6, allowed_token_ids=(2, 5), logit_bias=((2, 50.0),), min_tokens=3),
        SamplingParams(max_tokens=5, temperature=1.0, seed=8, top_k=3, presence_penalty=2.0, logprobs=0),
    ]
    results = {}
    for device_name in ("cuda", "cpu"):
        cfg = EngineConfig(model=path, device=device_name, max_batch=4, block_size=16, max_model_len=128)
        with launch_engine(cfg) as engine:
            results[device_name] = engine.generate([GenerationRequest(prompt, p) for p in requests])
    forced, drawn, held, cut = results["cuda"]
    assert forced.token_ids == [123] * 4 and drawn.token_ids == [77] * 4 and held.token_ids == [5, 5, 5, 2]
    assert len(cut.logprobs) == len(cut.token_ids) and [r.token_id for r in cut.logprobs] == cut.token_ids
    for got, want in zip(forced.logprobs, results["cpu"][0].logprobs):
        assert got.token_id == want.token_id and abs(got.logprob - want.logprob) < 0.1  # bf16 activations
    assert len(forced.prompt_logprobs) == len(prompt) and forced.prompt_logprobs[0] is None
    for got, want in zip(forced.prompt_logprobs[1:], results["cpu"][0].prompt_logprobs[1:]):
        assert got.token_id == want.token_id and abs(got.logprob - want.logprob) < 0.1


def test_device_rows_without_a_finite_token_fail_as_on_the_host(g):
    """Failure isolation (docs/design.md): a row every mask forbids, or with a NaN or +inf logit,
    is the host's RowFailure on the device too, greedy, drawn on the device or cut by top-k, and
    the other rows keep their tokens (a NaN made the device draw's sums garbage: any token, or -1)."""
    rng = np.random.default_rng(3)
    logits = bf16(rng.standard_normal((12, V)) * 3)
    logits[[1, 4, 7], 11] = np.nan
    logits[[2, 5, 8], 12] = np.inf
    lanes = [dict(), dict(temperature=0.8), dict(temperature=0.8, top_k=40)]  # greedy, device draw, cut
    masked = dict(bad_words_ids=((5,),), allowed_token_ids=(5,))  # every token masked
    params = [SamplingParams(**lanes[r // 3], **(masked if r % 3 == 0 else {})) for r in range(9)]
    params += [SamplingParams(**lane) for lane in lanes]  # rows 9-11: nothing wrong
    rows = [9, 0, 1, 10, 2, 3, 4, 11, 5, 6, 7, 8]
    picked = [params[r] for r in rows]
    histories = [History.of([1, 2]) for _ in rows]
    uniforms = np.array([token_uniform(7, r) for r in rows])
    want, _ = sample_processed(logits[rows], picked, uniforms, histories, EOS)
    got, _ = sample_on_device(g, g.activation(logits), rows, picked, uniforms, histories, EOS)
    assert got == want
    assert [isinstance(t, RowFailure) for t in got] == [r < 9 for r in rows]
    assert [t.reason.startswith("no token") for t in got if isinstance(t, RowFailure)] == [
        r % 3 == 0 for r in rows if r < 9
    ]
