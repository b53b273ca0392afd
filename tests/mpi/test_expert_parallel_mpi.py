"""Expert parallelism with the real model, written once and run at several world sizes:

    mpiexec -n 1|2|3 python -m pytest --with-mpi tests/mpi

Every world size must give exactly the tokens of a single-rank run.  The checkpoints
have 7 experts, so 2 and 3 ranks split them unevenly (4+3, 3+2+2); the DeepSeek-class ones
(MLA latent cache, grouped routing, shared experts, a dense first layer) and the hybrid qwen3_next
(recurrent state replicated like attention) included.
"""

import os
import tempfile

import numpy as np
import pytest
from checkpoints import EXPERT_KEY, build_checkpoint, build_fp8_copy

from eprt.api import GenerationRequest, SamplingParams
from eprt.comm.transport import LocalTransport
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.model.loader import expert_shard, load_model
from eprt.ops.numpy_ops import NumpyOps

MPI = pytest.importorskip("mpi4py.MPI")
COMM = MPI.COMM_WORLD
IMAGE = 250
PROMPTS = [
    [5, 77, 3],
    [140, 9, 9, 31, 200, 17, 64, 12, 250, 11],
    [8],
    list(range(90, 130)),
    [7, 7, 7, 7, 7],
    [200, 100, 50, 25, 12, 6, 3],
]


# 7 experts: deepseek_v2 in 7 groups of one (top-3 from the best 4), the sigmoid routers in one group
SEVEN_EXPERT_GROUPS = {
    "deepseek_v2": dict(n_group=7, topk_group=4),
    "deepseek_v3": dict(n_group=1, topk_group=1),
    "glm4_moe": dict(n_group=1, topk_group=1),
}


def shared_checkpoint(arch, dtype="float32", **overrides):
    """Rank 0 builds the checkpoint once; every rank gets its path."""
    path = None
    if COMM.rank == 0:
        root = os.environ.get("EPRT_TEST_CKPT_DIR") or os.path.join(tempfile.gettempdir(), "eprt-mpi-ckpt")
        expert_key = EXPERT_KEY.get(arch, "num_experts")
        overrides = {**SEVEN_EXPERT_GROUPS.get(arch, {}), **overrides}
        name = f"{arch}-7experts" + ("" if dtype == "float32" else f"-{dtype}")
        path = build_checkpoint(arch, os.path.join(root, name), dtype=dtype, **{expert_key: 7}, **overrides)
    return COMM.bcast(path, root=0)


def engine_config(path, **kw):
    """The tests' engine: replicated attention unless ``attention`` says otherwise (not auto, so
    these tests keep testing replicated attention whichever mode auto picks on 2+ ranks)."""
    base = dict(model=path, device="cpu", max_batch=4, block_size=4, max_model_len=96, image_token_id=IMAGE)
    return EngineConfig(**{**base, "attention": "replicated", **kw})


def run_everywhere(cfg, reqs_fn):
    """Generate on every rank of the world; rank 0 returns the results, workers None."""
    try:
        with launch_engine(cfg) as engine:
            return engine.generate(reqs_fn())
    except SystemExit as e:  # worker ranks leave the engine at SHUTDOWN
        assert e.code == 0, f"worker rank {COMM.rank} exited with {e.code}"
        return None


def run_single(cfg, reqs_fn):
    """The single-rank reference, computed on rank 0 only."""
    if COMM.rank != 0:
        return None
    with launch_engine(cfg, transport=LocalTransport()) as engine:
        return engine.generate(reqs_fn())


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "arch", ["qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe", "qwen3_next"]
)
def test_batch_tokens_equal_single_rank(arch):
    cfg = engine_config(shared_checkpoint(arch))
    reqs = lambda: [GenerationRequest(p, SamplingParams(max_tokens=12)) for p in PROMPTS]  # noqa: E731
    multi = run_everywhere(cfg, reqs)
    single = run_single(cfg, reqs)
    if COMM.rank == 0:
        assert [r.token_ids for r in multi] == [r.token_ids for r in single]
        assert all(len(r.token_ids) > 0 for r in multi)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("chunk", [0, 5])
def test_hybrid_bf16_tokens_equal_single_rank(chunk):
    """qwen3_next stored in bf16, whole prompts and 5-token prefill chunks: the recurrent state of
    every linear layer is computed identically on every rank."""
    cfg = engine_config(shared_checkpoint("qwen3_next", dtype="bfloat16"), max_prefill_tokens=chunk)
    reqs = lambda: [GenerationRequest(p, SamplingParams(max_tokens=10)) for p in PROMPTS]  # noqa: E731
    multi = run_everywhere(cfg, reqs)
    single = run_single(cfg, reqs)
    if COMM.rank == 0:
        assert [r.token_ids for r in multi] == [r.token_ids for r in single]


def conversation(engine):
    """Requests one after another: two sharing a system prompt (the second snapshots the branch
    point), a third that reuses it, then a second turn that resumes from the first turn's end."""
    system, params = list(range(20, 50)), SamplingParams(max_tokens=9, ignore_eos=True)
    out = [engine.generate([GenerationRequest(system + q, params)])[0] for q in ([1, 2], [3, 4, 5], [6])]
    turn = [7, 100, 101, 102, 103, 104, 105]
    out.append(engine.generate([GenerationRequest(turn, params)])[0])
    out.append(engine.generate([GenerationRequest(turn + out[-1].token_ids + [106, 107], params)])[0])
    return [r.token_ids for r in out], [r.cached_tokens for r in out]


@pytest.mark.mpi(min_size=1)
def test_hybrid_state_snapshots_equal_single_rank_without_cache():
    """DECODE_CKPT on every rank: prefix hits restore the same snapshot everywhere, and the tokens
    equal a single-rank run with the prefix cache off."""
    cfg = engine_config(shared_checkpoint("qwen3_next"), max_prefill_tokens=5, num_blocks=300)
    try:
        with launch_engine(cfg) as engine:
            multi = conversation(engine)
    except SystemExit as e:
        assert e.code == 0, f"worker rank {COMM.rank} exited with {e.code}"
        multi = None
    if COMM.rank == 0:
        with launch_engine(engine_config(cfg.model, prefix_cache=False), transport=LocalTransport()) as engine:
            single = conversation(engine)
        assert multi[0] == single[0]
        assert multi[1][2] > 0 and multi[1][4] > 0 and single[1] == [0] * 5


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_fp8_checkpoint_tokens_equal_single_rank(arch):
    """FP8 block-scaled copies (each rank dequantizes only its experts) across uneven expert splits."""
    path = shared_checkpoint(arch)
    fp8 = COMM.bcast(build_fp8_copy(path, path + "-fp8", (16, 32))[0] if COMM.rank == 0 else None, root=0)
    cfg = engine_config(fp8)
    reqs = lambda: [GenerationRequest(p, SamplingParams(max_tokens=8)) for p in PROMPTS]  # noqa: E731
    multi = run_everywhere(cfg, reqs)
    single = run_single(cfg, reqs)
    if COMM.rank == 0:
        assert [r.token_ids for r in multi] == [r.token_ids for r in single]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "qwen3_next"])
def test_chunked_prefill_and_prefix_cache_equal_single_rank(arch):
    cfg = engine_config(shared_checkpoint(arch), max_prefill_tokens=6)
    system = list(range(20, 52))
    reqs = lambda: [GenerationRequest(system + [i, i + 1], SamplingParams(max_tokens=6)) for i in range(6)]  # noqa
    multi = run_everywhere(cfg, reqs)
    single = run_single(engine_config(cfg.model, prefix_cache=False), reqs)
    if COMM.rank == 0:
        assert [r.token_ids for r in multi] == [r.token_ids for r in single]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v2"])
def test_batched_prefill_equals_one_pass_per_sequence_on_one_rank(arch):
    """Workers group a frame's PREFILL / PREFILL_NEXT commands into one forward as rank 0 does: prompts
    of different lengths, a prefix hit, a chunked prompt and one with vision rows, in one tick."""
    cfg = engine_config(shared_checkpoint(arch), max_prefill_tokens=40, num_blocks=120)
    system, rows = list(range(20, 36)), np.random.default_rng(2).normal(0, 0.3, size=(2, 64)).astype(np.float32)
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    def reqs():
        return [GenerationRequest(system + [1], params)] + [
            GenerationRequest(system + [2, 3], params),
            GenerationRequest(PROMPTS[1], params),
            GenerationRequest(list(range(60, 95)), params),
            GenerationRequest([4, IMAGE, 9, IMAGE, 13], params, image_embeds=rows),
        ]

    def waves(engine):
        first, rest = reqs()[:1], reqs()[1:]
        return [r.token_ids for r in engine.generate(first) + engine.generate(rest)], engine.runner.prefill_passes

    try:
        with launch_engine(cfg) as engine:
            multi, passes = waves(engine)
    except SystemExit as e:
        assert e.code == 0, f"worker rank {COMM.rank} exited with {e.code}"
        multi = None
    if COMM.rank == 0:
        single_cfg = engine_config(cfg.model, max_prefill_tokens=40, num_blocks=120, batch_prefill=False)
        with launch_engine(single_cfg, transport=LocalTransport()) as engine:
            single, single_passes = waves(engine)
        assert multi == single and passes < single_passes


@pytest.mark.mpi(min_size=1)
def test_vision_rows_equal_single_rank():
    cfg = engine_config(shared_checkpoint("mixtral"))
    rows = np.random.default_rng(1).normal(0, 0.3, size=(2, 64)).astype(np.float32)

    def reqs():
        return [
            GenerationRequest([4, IMAGE, 9, IMAGE, 13], SamplingParams(max_tokens=8), image_embeds=rows),
            GenerationRequest(PROMPTS[1], SamplingParams(max_tokens=8)),
        ]

    multi = run_everywhere(cfg, reqs)
    single = run_single(cfg, reqs)
    if COMM.rank == 0:
        assert [r.token_ids for r in multi] == [r.token_ids for r in single]


@pytest.mark.mpi(min_size=1)
def test_each_rank_reads_only_its_experts():
    path = shared_checkpoint("olmoe")
    loaded = load_model(path, NumpyOps(), 64, rank=COMM.rank, world=COMM.size)
    start, end = expert_shard(7, COMM.rank, COMM.size)
    cfg = loaded.config
    layers = cfg.num_layers
    replicated = 3 + layers * (2 + 4 + 2 + 1)  # embed, norm, lm_head; norms, q/k/v/o, q/k norm, router
    assert (loaded.model.w.expert_start, loaded.model.w.expert_end) == (start, end)
    assert loaded.tensors_read == replicated + layers * 3 * (end - start)
    expert_bytes = layers * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
    counts = COMM.allgather((loaded.tensors_read, loaded.bytes_read))
    if COMM.rank == 0:
        total_experts = sum(c[0] - replicated for c in counts) // (3 * layers)
        assert total_experts == 7
        replicated_bytes = counts[0][1] - expert_bytes * (expert_shard(7, 0, COMM.size)[1])
        for r, (_, b) in enumerate(counts):
            s, e = expert_shard(7, r, COMM.size)
            assert b == replicated_bytes + expert_bytes * (e - s)


@pytest.mark.mpi(min_size=1)
def test_ranks_agree_on_the_kv_pool_size(monkeypatch):
    # On GPUs each rank sizes its KV pool from its own free memory, which differs with an
    # uneven expert split or a shared GPU. The ranks' block managers must make identical
    # decisions (evictions, prefix hits) from the one command stream, so they must all use
    # the smallest pool. Rank 0 gets the smallest here; workers would otherwise keep prefix
    # blocks that rank 0 evicted.
    from eprt.engine import startup as engine_mod

    monkeypatch.setattr(engine_mod, "_kv_blocks", lambda cfg, ops, model_cfg, model_len, sharers: 26 + 9 * COMM.rank)
    cfg = engine_config(shared_checkpoint("qwen3_moe"))
    # five distinct 24-token prompts, then the first two again: rank 0's 26 blocks have
    # evicted them by then (cached 0), a worker's pool of 35+ would still hold them (cached 20)
    prompts = [[(7 * i + j) % 250 + 1 for j in range(24)] for i in range(5)]
    reqs = lambda: [GenerationRequest(p, SamplingParams(max_tokens=6)) for p in prompts + prompts[:2]]  # noqa
    multi = run_everywhere(cfg, reqs)
    monkeypatch.setattr(engine_mod, "_kv_blocks", lambda cfg, ops, model_cfg, model_len, sharers: 26)
    single = run_single(cfg, reqs)
    if COMM.rank == 0:
        assert [r.token_ids for r in multi] == [r.token_ids for r in single]
        assert [r.cached_tokens for r in multi] == [r.cached_tokens for r in single]
