"""n and best_of: choices of one prompt share its prefill (FORK, copy of the partial block),
each samples with its own key; best_of keeps the n most likely; the block manager's fork."""

import io
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from eprt.api import GenerationRequest, RequestError, SamplingParams
from eprt.cache.block_manager import BlockManager, OutOfBlocks
from eprt.engine.choices import best_choices, choice_seed, ranked, token_logprobs
from eprt.engine.engine import EngineConfig, launch_engine

PROMPT = list(b"Once upon a time, there was a")  # 29 bytes: a partial last block at block size 16


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    bm = BlockManager(10, 4)
    bm.allocate("a", list(range(10)))  # 10 tokens: blocks [0, 1] full, block 2 holds 2 tokens
    table = bm.block_table("a")
    free = bm.num_free_blocks()
    assert bm.fork("a", "b", 10) == (table[2], bm.block_table("b")[2])
    assert bm.block_table("b")[:2] == table[:2] and bm.block_table("b")[2] not in table
    assert bm.num_free_blocks() == free - 1
    assert bm.fork("a", "c", 8) is None  # ends on a boundary: nothing to copy
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks() == 10 - 3  # c still holds the two shared blocks and its own
    bm.free("c")
    assert bm.num_free_blocks() == 10
    with pytest.raises(KeyError):
        bm.fork("a", "d", 4)


def test_fork_without_a_free_block_is_refused():
    bm = BlockManager(3, 4)
    bm.allocate("a", list(range(10)))
    with pytest.raises(OutOfBlocks):
        bm.fork("a", "b", 10)


def test_choice_seeds_keep_choice_0_and_differ_for_the_others():
    assert choice_seed(7, 0) == 7
    seeds = {choice_seed(7, k) for k in range(1, 5)}
    assert len(seeds) == 4 and 7 not in seeds and choice_seed(7, 1) == choice_seed(7, 1)
    assert all(0 <= s < 2**128 for s in seeds)


def test_token_logprobs_are_the_log_softmax_at_temperature():
    logits = np.array([[1.0, 2.0, 3.0], [0.5, 0.5, 4.0]], dtype=np.float32)
    got = token_logprobs(logits, np.array([0.5, 0.0]), np.array([0, 2]))
    x = logits[0] / 0.5
    assert got[0] == pytest.approx(x[0] - math.log(np.exp(x).sum()))
    assert got[1] == pytest.approx(4.0 - math.log(np.exp(logits[1].astype(np.float64)).sum()))


def test_n_and_best_of_are_checked():
    for params, message in [
        (SamplingParams(n=0), "n must be"),
        (SamplingParams(n=3, best_of=2), "best_of must be"),
        (SamplingParams(n=True), "n must be"),
    ]:
        with pytest.raises(RequestError, match=message):
            params.validate(10)


def _run(engine, params, count=1):
    before = engine.stats()["prompt_tokens_computed"]
    out = engine.generate_choices([GenerationRequest(PROMPT, params) for _ in range(count)])
    return out, engine.stats()["prompt_tokens_computed"] - before


def test_n4_at_temperature_08_gives_four_distinct_reproducible_choices_from_one_prefill():
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=1234, n=4, ignore_eos=True)
    with launch_engine(EngineConfig(model=None, device="cpu", max_batch=8, prefix_cache=False)) as engine:
        (first,), computed = _run(engine, params)
        finished = engine.stats()["requests_finished"]
        prompt_counted = engine.stats()["prompt_tokens"]
        (again,), _ = _run(engine, params)
        (plain,), _ = _run(engine, SamplingParams(max_tokens=12, temperature=0.8, seed=1234, ignore_eos=True))
    assert computed == len(PROMPT)  # one prefill for the four choices
    assert finished == 4 and prompt_counted == len(PROMPT)  # the prompt counted once
    assert [r.index for r in first] == [0, 1, 2, 3]
    outputs = [tuple(r.token_ids) for r in first]
    assert len(set(outputs)) == 4 and all(len(o) == 12 for o in outputs)
    assert outputs == [tuple(r.token_ids) for r in again]  # the seed makes them reproducible
    assert outputs[0] == tuple(plain[0].token_ids)  # choice 0 samples as a request of one choice


def test_a_fork_follows_the_same_tokens_as_its_own_prefill():
    """Greedy choices must all equal the greedy output: the copied partial block holds the right KV."""
    greedy = SamplingParams(max_tokens=10, n=3, ignore_eos=True)
    with launch_engine(EngineConfig(model=None, device="cpu", max_batch=4, prefix_cache=False)) as engine:
        (choices,), computed = _run(engine, greedy)
        (single,) = engine.generate([GenerationRequest(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True))])
    assert computed == len(PROMPT)
    assert [r.token_ids for r in choices] == [single.token_ids] * 3


def test_choices_beyond_max_batch_prefill_their_prompt_themselves():
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=5, n=3, ignore_eos=True)
    with launch_engine(EngineConfig(model=None, device="cpu", max_batch=2, prefix_cache=False)) as engine:
        (squeezed,), computed = _run(engine, params)
    with launch_engine(EngineConfig(model=None, device="cpu", max_batch=4, prefix_cache=False)) as engine:
        (roomy,), _ = _run(engine, params)
    assert computed == 2 * len(PROMPT)  # the third choice could not fork: it prefilled
    assert [r.token_ids for r in squeezed] == [r.token_ids for r in roomy]  # same keys either way


def test_choices_of_several_prompts_beyond_max_batch_wait_for_slots_in_a_batched_prefill():
    """Four prompts of 3 choices each on 8 slots: the lane's plan holds slots for the prompts it
    prefills together, leaving room for their forks; a choice finding no slot waits for one (it
    used to find every slot held and stop the engine), and the choices equal a roomy run's."""
    params = [SamplingParams(max_tokens=6, temperature=0.9, seed=7, n=3), SamplingParams(max_tokens=5, best_of=3)]
    prompts = [PROMPT, PROMPT[:11], list(b"The socket module"), list(b"def parse(")]
    reqs = [GenerationRequest(p, params[i % 2]) for i, p in enumerate(prompts)]

    def run(max_batch):
        with launch_engine(EngineConfig(model=None, device="cpu", max_batch=max_batch, prefix_cache=False)) as engine:
            return [[r.token_ids for r in c] for c in engine.generate_choices(reqs)]

    squeezed = run(8)
    assert squeezed == run(16)
    assert [len(c) for c in squeezed] == [3, 1, 3, 1] and all(len(t) > 0 for c in squeezed for t in c)


def test_best_of_returns_the_n_most_likely_choices():
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=9, n=2, best_of=5, ignore_eos=True)
    with launch_engine(EngineConfig(model=None, device="cpu", max_batch=8)) as engine:
        (best,), _ = _run(engine, params)
        (every,), _ = _run(
            engine, SamplingParams(max_tokens=8, temperature=1.0, seed=9, n=5, best_of=5, ignore_eos=True)
        )
    scores = sorted((r.cumulative_logprob for r in every), reverse=True)
    assert [r.index for r in best] == [0, 1]
    assert [r.cumulative_logprob for r in best] == pytest.approx(scores[:2])
    assert all(r.cumulative_logprob < 0 for r in every)


def test_best_choices_ranks_errors_last():
    from eprt.api import GenerationResult

    rs = [GenerationResult(None, [1], [2], "stop", index=i, cumulative_logprob=lp) for i, lp in enumerate([-3.0, -1.0])]
    rs.append(GenerationResult(None, [1], [], "error", index=2))
    assert [r.token_ids for r in best_choices(rs, 2)] == [[2], [2]]
    assert [r.cumulative_logprob for r in best_choices(rs, 3)][:2] == [-1.0, -3.0]


def test_ranked_keeps_each_choice_with_its_companion():
    """best_of re-indexes the results it returns; each keeps what rode with it (the server's and
    eprt run's ChatOutput of that choice), not the one at its new index."""
    from eprt.api import GenerationResult

    rs = [GenerationResult(None, [1], [i], "stop", index=i, cumulative_logprob=lp) for i, lp in enumerate([-3, -1, -2])]
    pairs = ranked([(r, f"output of {r.token_ids[0]}") for r in rs], SamplingParams(n=2, best_of=3))
    assert [(r.index, r.token_ids, out) for r, out in pairs] == [(0, [1], "output of 1"), (1, [2], "output of 2")]
    assert ranked([(r, None) for r in rs], SamplingParams(n=3)) == [(r, None) for r in rs]  # no best_of: as given


def test_eprt_generate_prints_one_json_line_per_choice():
    cmd = [sys.executable, "-m", "eprt.cli", "generate", "--device", "cpu", "--prompt", "Hi", "--max-tokens", "6"]
    cmd += ["--temperature", "0.8", "--seed", "3", "-n", "3", "--json"]
    rows = [
        json.loads(line)
        for line in subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
    ]
    assert [r.get("index", 0) for r in rows] == [0, 1, 2]
    assert all(r["prompt_ids"] == [72, 105] for r in rows) and len({tuple(r["token_ids"]) for r in rows}) == 3


def test_eprt_run_writes_the_choices_of_a_line(tmp_path):
    from eprt.serve.batch import run_batch

    lines = [
        {"id": "four", "prompt": "Return the", "max_tokens": 6, "temperature": 0.8, "seed": 2, "n": 4},
        {"id": "best", "prompt": "Once upon", "max_tokens": 6, "temperature": 1.0, "seed": 2, "n": 1, "best_of": 3},
        {"id": "bad", "prompt": "Once upon", "n": 0},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    with launch_engine(EngineConfig(model=None, device="cpu", max_batch=8)) as engine:
        run_batch(engine, str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), progress_stream=io.StringIO())
    out = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    four = out["four"]["choices"]
    assert [c["index"] for c in four] == [0, 1, 2, 3] and len({tuple(c["token_ids"]) for c in four}) == 4
    assert out["four"]["token_ids"] == four[0]["token_ids"]
    assert len(out["best"]["choices"]) == 1 and out["best"]["choices"][0]["cumulative_logprob"] < 0
    assert "n must be an integer" in out["bad"]["error"]


def test_a_hybrid_model_forks_its_recurrent_state_too(checkpoint):
    """qwen3_next: the fork copies the slot's recurrent state, so greedy choices decode alike."""
    cfg = EngineConfig(model=checkpoint("qwen3_next"), device="cpu", max_batch=4)
    prompt = list(range(3, 40))
    with launch_engine(cfg) as engine:
        before = engine.stats()["prompt_tokens_computed"]
        (choices,) = engine.generate_choices([GenerationRequest(prompt, SamplingParams(max_tokens=6, n=3))])
        computed = engine.stats()["prompt_tokens_computed"] - before
        (single,) = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=6))])
    assert [r.token_ids for r in choices] == [single.token_ids] * 3
    assert computed == len(prompt)  # one prefill
