"""Speculative decoding on one rank: the ngram drafter, acceptance, rejection sampling, the
verify/accept rollback of the executor, and the sampled-token distribution with speculation
against the one without (chi-square)."""

import json

import numpy as np
import pytest

from eprt.api import GenerationRequest, SamplingParams
from eprt.comm.slots import SlotError
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.engine.executor import ShardExecutor
from eprt.engine.speculative import NgramDrafter, SpeculativeConfig, accepted_run, rejection_sample
from eprt.model.loader import load_model
from eprt.ops.numpy_ops import NumpyOps

# chi-square critical values at p = 0.001 by degrees of freedom (a correct sampler fails 1 in 1000)
CHI2_999 = dict(
    enumerate(
        (10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26, 32.91, 34.53, 36.12, 37.70),
        start=1,
    )
)


def test_ngram_drafter_follows_the_most_recent_longest_match():
    d = NgramDrafter(1, 3)
    assert d.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]  # "1 2 3" last seen before 7 8
    assert d.propose([5, 6, 4, 6], 3) == [4, 6]  # n = 1: "6" followed by 4, 6 (up to the end)
    assert d.propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert NgramDrafter(2, 3).propose([5, 6, 4, 6], 3) == []  # a 1-token match is too short
    assert d.propose([7, 7, 7], 4) == [7]  # the match may run up to the end
    with pytest.raises(ValueError, match="1 <= min <= max, got 3, 2"):
        NgramDrafter(3, 2)
    with pytest.raises(ValueError, match=r"--num-speculative-tokens must be in \[1, 4\], got 5"):
        SpeculativeConfig("ngram", 5)
    with pytest.raises(ValueError, match="--speculative-method must be one of ngram, mtp, got 'eagle'"):
        SpeculativeConfig("eagle", 2)


def test_accepted_run_stops_at_the_first_mismatch():
    assert accepted_run([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted, then the bonus
    assert accepted_run([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the target replaces the wrong draft
    assert accepted_run([5], [4, 1]) == [4]
    assert accepted_run([], [3]) == [3]


def test_rejection_sampling_keeps_the_target_distribution_chi_square():
    rng = np.random.default_rng(7)
    V, draws = 6, 30000
    p = rng.dirichlet(np.ones(V))  # target [V]
    q = rng.dirichlet(np.ones(V) * 0.5)  # a different draft distribution [V]
    counts, accepted = np.zeros(V), 0
    for _ in range(draws):
        draft = int(rng.choice(V, p=q))
        ok, token = rejection_sample(p, q, draft, rng.random(), rng.random())
        counts[token] += 1
        accepted += ok
    want = p * draws
    assert float(((counts - want) ** 2 / want).sum()) < CHI2_999[V - 1], (counts, want)
    assert abs(accepted / draws - np.minimum(p, q).sum()) < 0.02  # acceptance rate sum(min(p, q))


def test_verify_accept_rolls_back_kv_and_blocks(checkpoint):
    """Decoding after a partly accepted verify gives the logits of plain decoding, and the
    rejected drafts' blocks are free again."""
    model = load_model(checkpoint("qwen3_moe"), NumpyOps(), max_len=64).model
    ex_plain, ex_spec = (ShardExecutor(model, 32, 4, 2, prefix_cache=False) for _ in range(2))
    prompt = [5, 77, 3, 9, 11]
    for ex in (ex_plain, ex_spec):
        ex.allocate(0, prompt)
        ex.prefill(0, prompt, 0, len(prompt))
    ex_plain.decode([0], [40])
    ex_plain.decode([0], [41])
    free = ex_spec.blocks.num_free_blocks()
    ex_spec.verify([0], [40], [(41, 42, 43, 44)])  # 5 positions: 10 tokens, 3 blocks
    assert ex_spec.blocks.num_free_blocks() == free - 1
    with pytest.raises(SlotError, match="awaits its ACCEPT"):
        ex_spec.decode([0], [7])
    ex_spec.accept([0], [1])  # keeps 40, 41
    assert ex_spec.slots.get(0).tokens == prompt + [40, 41]
    assert ex_spec.blocks.num_free_blocks() == free
    a, b = ex_plain.decode([0], [50]), ex_spec.decode([0], [50])
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)


def sampled_histogram(path, speculative, seeds, position):
    cfg = EngineConfig(
        model=path,
        device="cpu",
        max_batch=32,
        block_size=4,
        max_model_len=64,
        speculative_method="ngram" if speculative else None,
        num_speculative_tokens=3,
    )
    prompt = [11, 12, 13, 14, 11, 12, 13, 14, 11, 12]
    params = lambda s: SamplingParams(max_tokens=position + 1, temperature=0.8, top_k=6, seed=s, ignore_eos=True)  # noqa: E731
    with launch_engine(cfg) as engine:
        results = engine.generate([GenerationRequest(prompt, params(s)) for s in seeds])
    return [r.token_ids[position] for r in results], sum(r.accepted_tokens or 0 for r in results)


def test_sampled_tokens_with_speculation_follow_the_plain_distribution_chi_square(checkpoint):
    """Disjoint seed sets, so the two samples are independent: a two-sample chi-square over the
    tokens seen at output position 4 (rare tokens pooled)."""
    path = checkpoint("olmoe")
    off, _ = sampled_histogram(path, False, range(0, 300), 4)
    on, accepted = sampled_histogram(path, True, range(1000, 1300), 4)
    assert accepted > 0
    tokens, counts = np.unique(off + on, return_counts=True)
    common = tokens[counts >= 20]
    table = np.array(
        [[sum(t == c for t in side) for c in common] + [sum(t not in common for t in side)] for side in (off, on)]
    )
    table = table[:, table.sum(axis=0) > 0]
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    chi2 = float(((table - expected) ** 2 / expected).sum())
    df = table.shape[1] - 1
    assert 3 <= df <= 15, table  # enough distinct tokens for a real test
    assert chi2 < CHI2_999[df], (chi2, table)


def test_generate_json_reports_accepted_tokens(capsys):
    from eprt import cli

    argv = ["generate", "--prompt-ids", "5,6,7,5,6,7,5,6", "--max-tokens", "12", "--json", "--device", "cpu"]
    assert cli.main([*argv, "--ignore-eos", "--speculative-method", "ngram", "--num-speculative-tokens", "2"]) == 0
    assert cli.main([*argv, "--ignore-eos"]) == 0
    on, off = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert on["token_ids"] == off["token_ids"] and "accepted_tokens" not in off
    assert isinstance(on["accepted_tokens"], int) and 0 <= on["accepted_tokens"] < 12


def test_metrics_show_proposed_and_accepted_drafts():
    from eprt.serve.metrics import EngineCollector

    cfg = EngineConfig(device="cpu", max_batch=4, speculative_method="ngram", num_speculative_tokens=4)
    with launch_engine(cfg) as engine:
        prompt = engine.tokenizer.encode("the string the string the string the")
        engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=40, ignore_eos=True))])
        metrics = {m.name: m.samples[0].value for m in EngineCollector(engine).collect() if m.samples}
    proposed, accepted = metrics["eprt_spec_draft_tokens"], metrics["eprt_spec_accepted_tokens"]
    steps = metrics["eprt_spec_verify_steps"]
    assert 0 < accepted <= proposed and steps > 0
    assert metrics["eprt_spec_mean_accepted_length"] == pytest.approx((steps + accepted) / steps)  # one row a step


def test_rows_with_logprobs_or_penalties_keep_plain_decoding_under_speculation():
    """Penalties and logprobs are applied by the decode sampler only: such rows never verify."""
    prompt = list(b"the string to the string to the string")
    requests = [
        GenerationRequest(prompt, SamplingParams(max_tokens=20, repetition_penalty=1.3)),
        GenerationRequest(prompt, SamplingParams(max_tokens=20, logprobs=2)),
        GenerationRequest(prompt, SamplingParams(max_tokens=20)),
    ]
    with launch_engine(EngineConfig(device="cpu", max_batch=4)) as engine:
        plain = engine.generate(requests)
    cfg = EngineConfig(device="cpu", max_batch=4, speculative_method="ngram", num_speculative_tokens=3)
    with launch_engine(cfg) as engine:
        spec = engine.generate(requests)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert [len(r.logprobs) for r in spec[1:2]] == [len(spec[1].token_ids)]
