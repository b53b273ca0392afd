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
from eprt.scheduler import speculation
from eprt.scheduler.speculation import DraftPolicy, DraftStats, StepCosts, best_draft_count


@pytest.fixture(autouse=True)
def drafts_cost_nothing(monkeypatch):
    """The verify path under test whenever the drafter proposes: a draft's cost pinned to 0 (the
    adaptive policy's choices, driven by measured step times, are tested on their own)."""
    monkeypatch.setattr(StepCosts, "draft_cost", lambda self, rows: 0.0)
    monkeypatch.setattr(StepCosts, "verify_overhead", lambda self, rows: 0.0)


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


def test_best_draft_count_weighs_expected_tokens_against_the_verify_cost():
    assert best_draft_count(0.0, 0.3, 4) == 0  # nothing is ever accepted: a decode step is better
    assert best_draft_count(0.2, 0.3, 4) == 0  # (1 + 0.2) / 1.3 < 1
    assert best_draft_count(0.5, 0.3, 4) == 1  # 1.5 / 1.3 beats 1.75 / 1.6
    assert best_draft_count(0.35, 0.3, 4) == 0  # 1.35 / 1.3 beats a decode step by less than MIN_GAIN
    assert best_draft_count(0.5, 0.1, 4) == 2  # 1.75 / 1.2 beats 1.5 / 1.1 and 1.875 / 1.3
    assert best_draft_count(0.5, 0.1, 4, overhead=0.4) == 3  # a verify's overhead: longer drafts pay it off
    assert best_draft_count(0.3, 0.1, 4, overhead=0.2) == 0  # 1.3 / 1.3: the overhead eats the gain
    assert best_draft_count(0.9, 0.1, 4) == 4
    assert best_draft_count(0.9, 0.1, 2) == 2  # never past the limit
    assert best_draft_count(0.99, 2.0, 4) == 0  # drafts that cost two rows each never pay
    assert best_draft_count(0.5, 0.0, 3) == 3  # free drafts: as many as allowed


def test_draft_stats_track_acceptance_with_decay():
    stats = DraftStats()
    assert stats.acceptance() == pytest.approx(0.9)  # the prior drafts at once
    stats.verified(proposed=3, accepted=0)  # one trial, no hit
    assert (stats.hits, stats.trials) == pytest.approx((0.45, 1.5))
    stats.verified(proposed=2, accepted=2)  # two hits, no rejected draft
    assert (stats.hits, stats.trials) == pytest.approx((2.225, 2.75))


class _Row:
    draft_stats = None


def test_probe_period_keeps_the_probes_within_their_share():
    assert speculation.probe_period(0.01, 0.0) == 2  # a cheap draft: probes as often as a row may
    assert speculation.probe_period(0.3, 0.1) == 32  # 0.4 / 0.02 = 20
    assert speculation.probe_period(0.5, 0.8) == 128  # MAX_PERIOD gives way to the share
    policy, row = DraftPolicy(), _Row()
    row.draft_stats = DraftStats(hits=0.0, trials=1.0)
    probes = []
    for step in range(1, 400):
        policy.step()
        if policy.drafts(row, 4, 0.5, 0.8):
            probes.append(step)
            policy.verified(row, 1, 0)
    assert probes == [2, 128, 256, 384]


def test_draft_policy_declines_then_probes_on_shared_steps():
    """Two rows whose drafts never pass: after one verify each declines, and both probe with one
    draft on the same steps: the first soon, then at probe_period (the probes' share of the steps
    within PROBE_SHARE), doubling after each failed probe up to MAX_PERIOD; a row whose probe
    passes drafts again."""
    policy, rows, probes = DraftPolicy(), [_Row(), _Row()], []
    for step in range(1, 100):
        policy.step()
        ks = [policy.drafts(r, 4, speculation.DRAFT_COST) for r in rows]
        assert ks[0] == ks[1]
        if step == 1:
            assert ks == [4, 4]  # the prior: draft K at once
        elif ks[0]:
            assert ks == [1, 1]
            probes.append(step)
        for r, k in zip(rows, ks):
            if k:
                policy.verified(r, k, 0)
    assert speculation.probe_period(speculation.DRAFT_COST, 0.0) == 16  # 0.3 / 0.02 = 15: the next power of two
    assert probes == [2, 16, 32, 64, 96]
    policy.step()  # step 100
    policy.verified(rows[0], 1, 1)  # (as if its last probe had passed)
    policy.verified(rows[0], 1, 1)
    assert policy.drafts(rows[0], 4, speculation.DRAFT_COST) >= 1  # drafting again
    policy.step()  # step 101 (odd: no probe due)
    late = _Row()  # a new sequence's estimate is the lane's recent acceptance: after all those failures, it declines
    assert policy.drafts(late, 4, speculation.DRAFT_COST) == 0
    prior = policy.lane.acceptance()
    assert late.draft_stats.acceptance(prior) == pytest.approx(prior) and prior < 0.3
    lucky = DraftStats(hits=0.0, trials=0.0)  # one passed draft moves a row's estimate halfway from the lane's
    lucky.verified(1, 1)
    assert lucky.acceptance(prior) == pytest.approx((1.0 + prior) / 2.0)
    good = _Row()  # drafts that pass bring a row to K and keep it there, whatever the lane's
    good.draft_stats = DraftStats()  # (hits 0.9, trials 1.0: with the lane's trial, a = 0.58)
    ks = []
    for _ in range(5):
        policy.step()
        ks.append(policy.drafts(good, 4, 0.2))
        policy.verified(good, ks[-1], ks[-1])
    assert 1 <= ks[0] < 4 and ks[1:] == [4, 4, 4, 4]
    assert policy.lane.acceptance() > 0.8  # the lane has seen drafts pass again


def test_step_costs_measure_an_mtp_layers_catch_up_per_position(monkeypatch):
    monkeypatch.undo()  # the real StepCosts
    costs = StepCosts()
    assert costs.catch_up_cost(2) == 0.0
    costs.decode_step(2, 1.0)  # a decode row: 0.5 s
    costs.verify_step(2, 2, 1.5)
    costs.catch_up_step(2, 10, 0.5)  # 1 decode row over 10 positions
    assert costs.catch_up_cost(2) == pytest.approx(0.1)
    for _ in range(4):  # no fresh decode step of 2 rows: not counted
        costs.verify_step(2, 2, 1.5)
    costs.catch_up_step(2, 10, 5.0)
    assert costs.catch_up_cost(2) == pytest.approx(0.1)
    assert speculation.probe_period(0.3, 0.1, costs.catch_up_cost(2)) == speculation.LONGEST_PERIOD


def _ridge_fit(rows: int, P: list, e: list) -> tuple:
    """Weighted least squares of e = overhead + cost P over steps decayed by COST_KEEP, with one
    more equation pulling the cost to DRAFT_COST at weight (PRIOR_SPREAD rows)^2."""
    w = speculation.COST_KEEP ** np.arange(len(P) - 1.0, -1, -1)
    ridge = speculation.PRIOR_SPREAD * rows
    A = np.vstack([np.stack([np.ones(len(P)), P], axis=1) * np.sqrt(w)[:, None], [0.0, ridge]])
    b = np.append(np.asarray(e) * np.sqrt(w), ridge * speculation.DRAFT_COST)
    return tuple(np.linalg.lstsq(A, b, rcond=None)[0])


def test_step_costs_fit_a_verify_overhead_and_a_draft_cost(monkeypatch):
    monkeypatch.undo()  # the real draft_cost and verify_overhead
    costs = StepCosts()
    costs.verify_step(2, 2, 1.5)
    assert costs.draft_cost(2) is None and costs.verify_overhead(2) == 0.0  # no decode step of 2 rows yet
    costs.decode_step(2, 1.0)
    costs.verify_step(2, 2, 1.5)  # 0.5 s more for 2 drafts, a decode row being 0.5 s: 1 row
    # one P cannot tell a draft's cost from the overhead: the prior cost, the rest on the overhead
    assert costs.draft_cost(2) == pytest.approx(speculation.DRAFT_COST)
    assert costs.verify_overhead(2) == pytest.approx(1.0 - 2 * speculation.DRAFT_COST)
    assert costs.draft_cost(1) is None
    costs.verify_step(2, 4, 2.0)  # 2 rows for 4 drafts: the same line through 0
    overhead, cost = _ridge_fit(2, [2, 4], [1.0, 2.0])
    assert costs.verify_overhead(2) == pytest.approx(overhead) and costs.draft_cost(2) == pytest.approx(cost)
    assert 0.3 < cost < 0.5 and overhead > 0.0  # pulled from 0.5 toward the prior
    costs.verify_step(2, 1, 2.0)  # 2 rows for 1 draft: a fixed part appears
    overhead, cost = _ridge_fit(2, [2, 4, 1], [1.0, 2.0, 2.0])
    assert costs.verify_overhead(2) == pytest.approx(overhead) and costs.draft_cost(2) == pytest.approx(cost)
    assert overhead > 1.0 and cost < 0.3
    costs.decode_step(1, 0.1)  # (another batch size)
    costs.verify_step(2, 4, 0.5)  # 5 steps after the decode step of 2 rows: no baseline, not counted
    assert costs.verify_overhead(2) == pytest.approx(overhead) and costs.draft_cost(2) == pytest.approx(cost)


def test_step_costs_fit_through_zero_when_the_overhead_would_be_negative(monkeypatch):
    monkeypatch.undo()
    costs = StepCosts()
    for p, e in ((1, 0.2), (3, 1.8)):  # a line of slope 0.8 that crosses 0 at P = 0.75
        costs.decode_step(1, 1.0)
        costs.verify_step(1, p, 1.0 + e)
    pp, pe = speculation.COST_KEEP * 1.0 + 9.0, speculation.COST_KEEP * 0.2 + 5.4  # decayed sums of P^2, P e
    assert costs.verify_overhead(1) == 0.0
    assert costs.draft_cost(1) == pytest.approx((pe + speculation.DRAFT_COST) / (pp + 1.0))  # ridge weight 1^2


def test_step_costs_are_not_fooled_by_a_few_noisy_steps_but_follow_many(monkeypatch):
    """Timed verify steps of a batch of 8 on the copy checkpoint's MTP drafter, sampled text (a
    decode step's time moves by 10 - 20% on a shared machine): fitted freely, their drafts
    cost 0.07 decode rows and rows drafting a third of the time drafted 4 a step. Many steps
    whose draft counts spread widely are fitted as themselves."""
    monkeypatch.undo()
    costs = StepCosts()
    for p, e in ((6, 1.08), (1, 2.67), (7, 2.84), (1, 0.76)):
        costs.decode_step(8, 1.0)
        costs.verify_step(8, p, 1.0 + e / 8)
    assert 0.2 < costs.draft_cost(8) < speculation.DRAFT_COST
    assert best_draft_count(0.35, costs.draft_cost(8), 4, costs.verify_overhead(8) / 8) == 0
    costs = StepCosts()
    for i in range(60):
        p = 8 if i % 2 else 32
        costs.decode_step(8, 1.0)
        costs.verify_step(8, p, 1.0 + (2.0 + 0.1 * p) / 8)  # overhead 2 rows, 0.1 a draft
    assert costs.draft_cost(8) == pytest.approx(0.1, rel=0.1)
    assert costs.verify_overhead(8) == pytest.approx(2.0, rel=0.1)


def test_a_verify_step_that_does_not_pay_as_a_whole_keeps_only_its_probes():
    policy = DraftPolicy()
    policy.lane = DraftStats(hits=0.45, trials=1.0)  # the lane's acceptance, every row's prior: 0.45
    rows = [_Row() for _ in range(4)]
    for seq in rows[:2]:
        seq.draft_stats = DraftStats(hits=0.45, trials=1.0)  # a = 0.45: drafts pay at cost 0.1 and a 0.25 share
    policy.step()  # step 1: no probe due yet
    ks = [policy.drafts(seq, 4, 0.1, 0.25) for seq in rows[:2]]
    assert ks == [2, 2]  # (1 + 0.45 + 0.2025) / 1.45 beats 1.45 / 1.35 and MIN_GAIN
    rows[2].draft_stats = DraftStats(hits=0.0, trials=1.0, period=1)  # declining, its probe due (any step)
    rows[3].draft_stats = DraftStats(hits=0.0, trials=1.0, period=2)  # declining, no probe this step
    ks += [policy.drafts(seq, 4, 0.1, 0.25) for seq in rows[2:]]
    assert ks == [2, 2, 1, 0] and rows[2].draft_stats.probe
    assert policy.worth_a_verify(rows, ks, 0.1, 0.0) == ks  # no overhead measured: as the rows chose
    assert policy.worth_a_verify(rows, ks, 0.1, 0.2) == ks  # (4 + 1.305) / (4 + 0.2 + 0.5) > MIN_GAIN
    assert policy.worth_a_verify(rows, ks, 0.1, 1.0) == [0, 0, 1, 0]  # (5.305 / 5.5): only the probe rides


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
    assert_same_distribution(off, on)


def assert_same_distribution(off: list, on: list) -> None:
    """A two-sample chi-square test of two token samples (tokens seen fewer than 20 times pooled)."""
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


def test_sampled_batch_with_speculation_equals_plain_sampling():
    """Sampled rows of a batched verify take each position's token with that position's seeded
    uniform (one sample_rows call for the batch), so every row is plain decoding's, token for token."""
    requests = [
        GenerationRequest(
            list(b"the string to the string to the string"),
            SamplingParams(max_tokens=24, temperature=t, seed=s, ignore_eos=True),
        )
        for s, t in ((1, 0.3), (2, 0.0), (3, 1.0), (4, 0.3))
    ]
    with launch_engine(EngineConfig(device="cpu", max_batch=4)) as engine:
        plain = engine.generate(requests)
    cfg = EngineConfig(device="cpu", max_batch=4, speculative_method="ngram", num_speculative_tokens=3)
    with launch_engine(cfg) as engine:
        spec = engine.generate(requests)
        verify_rows = engine.runner.drafts.verify_rows
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert verify_rows > 0 and sum(r.accepted_tokens for r in spec) > 0


@pytest.fixture(scope="module")
def copy_checkpoint(tmp_path_factory):
    """tests/checkpoints.py's copy checkpoint with its MTP layer, small."""
    from checkpoints import build_copy_checkpoint

    dims = dict(hidden_size=256, num_hidden_layers=2, num_experts=4, moe_intermediate_size=32, vocab_size=512)
    return build_copy_checkpoint(str(tmp_path_factory.mktemp("copy")), max_position_embeddings=1024, mtp=True, **dims)


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_greedy_rewrite_on_a_copying_checkpoint_accepts_long_drafts(copy_checkpoint, method):
    """On tests/checkpoints.py's copy checkpoint (an induction head: it continues a text it has
    seen; its MTP layer too), a rewrite prompt is copied, prompt lookup or the MTP layer drafts
    it and most drafts are accepted, and the tokens are plain decoding's."""
    path = copy_checkpoint
    text = b"Return a new list containing all items from the iterable in ascending order. "
    prompt = [3 + c for c in text + b"\n\n" + text + b"\n\n" + text[:20]]
    request = GenerationRequest(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    with launch_engine(EngineConfig(model=path, device="cpu")) as engine:
        plain = engine.generate([request])[0]
    assert bytes(t - 3 for t in plain.token_ids[:30]) == text[20:50]
    cfg = EngineConfig(model=path, device="cpu", speculative_method=method, num_speculative_tokens=4)
    with launch_engine(cfg) as engine:
        spec = engine.generate([request])[0]
        rows = engine.runner.drafts.verify_rows
    assert spec.token_ids == plain.token_ids
    assert (rows + spec.accepted_tokens) / rows >= 3.0  # mean accepted length: most of the 4 drafts


def test_adaptive_speculation_measures_step_costs_and_keeps_the_tokens(monkeypatch):
    """With the measured costs (not pinned), the runner times decode and verify steps, and whatever
    steps the policy speculates on, the tokens are plain decoding's (sampled rows: drafts are
    mostly rejected, so the policy declines and decode steps happen)."""
    monkeypatch.undo()
    prompt = list(b"the string to the string to the string")
    requests = [GenerationRequest(prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=s)) for s in range(3)]
    with launch_engine(EngineConfig(device="cpu", max_batch=4)) as engine:
        plain = engine.generate(requests)
    cfg = EngineConfig(device="cpu", max_batch=4, speculative_method="ngram", num_speculative_tokens=4)
    with launch_engine(cfg) as engine:
        spec = engine.generate(requests) + engine.generate(requests[:1])
        costs = engine.runner.drafts.step_costs
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain + plain[:1]]
    assert costs.decode  # decode steps were timed
    assert all(c >= 0.0 for c in (costs.draft_cost(b) for b in (1, 2, 3)) if c is not None)


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
