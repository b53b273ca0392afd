"""dp attention (--attention dp) with the real model, written once and run at several world sizes:

    mpiexec -n 1|2|3 python -m pytest --with-mpi tests/mpi/test_dp_attention_mpi.py

Each sequence's KV and attention live on one owner rank; the MoE layers all-gather every rank's
rows and reduce-scatter them back. Greedy (and seeded sampled) tokens must equal a single-rank
run with replicated attention, over uneven expert splits (7 experts: 4+3, 3+2+2).
"""

import logging

import numpy as np
import pytest
from test_expert_parallel_mpi import COMM, IMAGE, PROMPTS, engine_config, run_single, shared_checkpoint

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.engine import launch_engine


def run_dp(cfg, reqs_fn, inspect=None):
    """Generate under dp attention on every rank; rank 0 returns (results, inspect(engine))."""
    try:
        with launch_engine(cfg) as engine:
            out = engine.generate(reqs_fn())
            return out, None if inspect is None else inspect(engine)
    except SystemExit as e:  # worker ranks leave the engine at SHUTDOWN
        assert e.code == 0, f"worker rank {COMM.rank} exited with {e.code}"
        return None, None


def cached_blocks_per_rank(engine):
    return [pool.num_cached_blocks() for pool in engine.runner.executor.pools.pools]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral", "deepseek_v3", "glm4_moe"])
def test_dp_tokens_equal_single_rank(arch):
    """Four architectures (DeepSeek's MLA latent cache, grouped routing, shared experts and a dense
    first layer among them); every rank owns some of the sequences."""
    path = shared_checkpoint(arch)
    reqs = lambda: [GenerationRequest(p, SamplingParams(max_tokens=12)) for p in PROMPTS]  # noqa: E731
    inspect = lambda engine: (cached_blocks_per_rank(engine), engine.runner.prefill_passes)  # noqa: E731
    multi, seen = run_dp(engine_config(path, attention="dp"), reqs, inspect)
    single = run_single(engine_config(path, attention="replicated"), reqs)
    if COMM.rank == 0:
        cached, passes = seen
        assert [r.token_ids for r in multi] == [r.token_ids for r in single]
        assert all(len(r.token_ids) > 0 for r in multi)
        assert len(cached) == COMM.size and all(n > 0 for n in cached), cached  # each rank owned sequences
        assert passes < len(PROMPTS), f"{passes} prefill passes for {len(PROMPTS)} prompts (not batched)"


@pytest.mark.mpi(min_size=1)
def test_dp_sampled_rows_equal_single_rank():
    """Seeded sampling: the sampled rows' logits come from the gathered hidden states on rank 0."""
    path = shared_checkpoint("qwen2_moe")

    def reqs():
        params = [SamplingParams(max_tokens=10, temperature=0.8, seed=i) for i in range(3)]
        params += [SamplingParams(max_tokens=10) for _ in range(3)]
        return [GenerationRequest(p, sp) for p, sp in zip(PROMPTS, params)]

    multi, _ = run_dp(engine_config(path, attention="dp"), reqs)
    single = run_single(engine_config(path, attention="replicated"), reqs)
    if COMM.rank == 0:
        assert [r.token_ids for r in multi] == [r.token_ids for r in single]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_dp_chunked_prefill_and_prefix_affinity(arch):
    """6-token prefill chunks and a shared system prompt: later prompts go to the rank caching it
    (prefix-cache affinity) and reuse it; tokens equal a single rank with the prefix cache off."""
    path = shared_checkpoint(arch)
    system = list(range(20, 52))

    def reqs():
        return [GenerationRequest(system + [i, i + 1], SamplingParams(max_tokens=6)) for i in range(6)]

    def each(engine):
        return [engine.generate([r])[0] for r in reqs()]  # one after another: the cache is warm

    cfg = engine_config(path, attention="dp", max_prefill_tokens=6)
    multi, later = run_dp(cfg, reqs, each)
    single = run_single(engine_config(path, attention="replicated", prefix_cache=False), reqs)
    if COMM.rank == 0:
        assert [r.token_ids for r in multi] == [r.token_ids for r in single]
        assert [r.token_ids for r in later] == [r.token_ids for r in single]
        assert all(r.cached_tokens == 32 for r in later)


@pytest.mark.mpi(min_size=1)
def test_dp_preemption_on_small_pools_equal_single_rank(monkeypatch):
    """Pools of 30 + 9r blocks of 4 tokens (rank 0 the smallest): long generations run out of one
    rank's pool and preempt there, and the tokens still equal a single rank's."""
    from eprt.engine import startup

    monkeypatch.setattr(startup, "_kv_blocks", lambda cfg, ops, model_cfg, model_len, sharers: 30 + 9 * COMM.rank)
    path = shared_checkpoint("olmoe")
    prompts = [[(7 * i + j) % 250 + 1 for j in range(20)] for i in range(4)]
    reqs = lambda: [GenerationRequest(p, SamplingParams(max_tokens=48, ignore_eos=True)) for p in prompts]  # noqa
    cfg = engine_config(path, attention="dp")
    multi, preemptions = run_dp(cfg, reqs, lambda engine: engine.scheduler.preemptions)
    monkeypatch.setattr(startup, "_kv_blocks", lambda cfg, ops, model_cfg, model_len, sharers: 1000)
    single = run_single(engine_config(path, attention="replicated"), reqs)
    if COMM.rank == 0:
        assert [r.token_ids for r in multi] == [r.token_ids for r in single]
        assert preemptions > 0


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])
def test_dp_choices_fork_on_the_owner_and_equal_single_rank(arch):
    """n = 3 and best_of = 3 (sampled, seeded): FORK puts every choice in its prompt's owner's pool
    (the owner copies the partial block's KV, every rank mirrors the fork), and the choices equal a
    single rank's with replicated attention."""
    path = shared_checkpoint(arch)
    params = [SamplingParams(max_tokens=8, temperature=0.9, seed=7, n=3), SamplingParams(max_tokens=6, best_of=3)]

    def reqs():
        return [GenerationRequest(p, params[i % 2]) for i, p in enumerate(PROMPTS[:4])]

    def choices(engine):
        owners = []

        def fork(seq, child, inner=engine.runner.kv.fork):
            row = inner(seq, child)
            owners.append(int(engine.runner.executor.owners[seq.slot]) == int(engine.runner.executor.owners[row.slot]))
            return row

        engine.runner.kv.fork = fork
        return engine.generate_choices(reqs()), owners

    cfg = engine_config(path, attention="dp")
    cfg.max_batch = 8
    _, seen = run_dp(cfg, lambda: [], choices)
    single_cfg = engine_config(path, attention="replicated")
    single_cfg.max_batch = 8
    single = None
    if COMM.rank == 0:
        from test_expert_parallel_mpi import LocalTransport

        with launch_engine(single_cfg, transport=LocalTransport()) as engine:
            single = engine.generate_choices(reqs())
        multi, owners = seen
        assert [[r.token_ids for r in c] for c in multi] == [[r.token_ids for r in c] for c in single]
        assert owners and all(owners)  # (a choice finding no free slot prefills its prompt itself)
        assert all(len(c) == (3 if i % 2 == 0 else 1) for i, c in enumerate(multi))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v2"])
def test_dp_prompt_logprobs_equal_single_rank(arch):
    """Prompt logprobs under dp, in 5-token prefill chunks: OWNER asks the owner for every prompt
    position's hidden state, rank 0 gathers them in a second gather of the pass (the requests
    without prompt logprobs in the same runs send only their last row), and the logprobs and the
    tokens equal a single rank's with replicated attention."""
    path = shared_checkpoint(arch)

    def reqs():
        return [
            GenerationRequest(p, SamplingParams(max_tokens=5, prompt_logprobs=2 if i % 2 == 0 else None))
            for i, p in enumerate(PROMPTS)
        ]

    multi, _ = run_dp(engine_config(path, attention="dp", max_prefill_tokens=5), reqs)
    single = run_single(engine_config(path, attention="replicated", max_prefill_tokens=5), reqs)
    if COMM.rank == 0:
        assert [r.token_ids for r in multi] == [r.token_ids for r in single]
        for i, (m, s) in enumerate(zip(multi, single)):
            if i % 2:
                assert m.prompt_logprobs is None and s.prompt_logprobs is None
                continue
            assert len(m.prompt_logprobs) == len(PROMPTS[i]) and m.prompt_logprobs[0] is None
            for got, want in zip(m.prompt_logprobs[1:], s.prompt_logprobs[1:]):
                assert (got.token_id, got.rank, [t for t, _ in got.top]) == (
                    want.token_id,
                    want.rank,
                    [t for t, _ in want.top],
                )
                values = [got.logprob] + [lp for _, lp in got.top]
                np.testing.assert_allclose(values, [want.logprob] + [lp for _, lp in want.top], rtol=1e-5, atol=1e-6)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("attention", ["dp", "replicated"])
def test_startup_log_states_kv_capacity(monkeypatch, attention):
    """Rank r's pool is 26 + 9r blocks of 4 tokens: dp adds the pools up, replicated takes the smallest;
    under dp the prefill budget is stated per owner rank."""
    from eprt.engine import startup

    monkeypatch.setattr(startup, "_kv_blocks", lambda cfg, ops, model_cfg, model_len, sharers: 26 + 9 * COMM.rank)
    lines = _Lines()
    logging.getLogger("eprt.engine").addHandler(lines)
    try:
        cfg = engine_config(shared_checkpoint("mixtral"), attention=attention, max_prefill_tokens=6)
        _, total = run_dp(cfg, lambda: [GenerationRequest([3, 4])], lambda engine: engine.stats()["total_blocks"])
    finally:
        logging.getLogger("eprt.engine").removeHandler(lines)
    pools = [26 + 9 * r for r in range(COMM.size)]
    tokens = 4 * (sum(pools) if attention == "dp" else min(pools))
    if COMM.rank == 0:
        stated = [line for line in lines.lines if line.startswith("KV capacity")]
        assert len(stated) == 1 and stated[0].startswith(f"KV capacity {tokens} tokens ("), stated
        assert total * 4 == tokens  # the stats line counts the same blocks
        per = " per owner rank" if attention == "dp" else ""
        assert any(f"prefill chunks of 6 tokens{per}, up to" in line for line in lines.lines), lines.lines


@pytest.mark.mpi(min_size=1)
def test_dp_vision_rows_equal_single_rank():
    """Vision rows reach every rank with the PREFILL; the owner scatters them into its embedding."""
    path = shared_checkpoint("mixtral")
    rows = np.random.default_rng(1).normal(0, 0.3, size=(2, 64)).astype(np.float32)

    def reqs():
        return [
            GenerationRequest(PROMPTS[1], SamplingParams(max_tokens=8)),
            GenerationRequest([4, IMAGE, 9, IMAGE, 13], SamplingParams(max_tokens=8), image_embeds=rows),
        ]

    multi, _ = run_dp(engine_config(path, attention="dp"), reqs)
    single = run_single(engine_config(path, attention="replicated"), reqs)
    if COMM.rank == 0:
        assert [r.token_ids for r in multi] == [r.token_ids for r in single]
