"""dp attention on one process: the OWNER and DECODE_DP frames, the owner choice, the executor's
refusals and the scenario keys (the multi-rank runs: tests/mpi/test_dp_attention_mpi.py)."""

import numpy as np
import pytest

from eprt.cache.owners import OwnerPools
from eprt.comm import protocol as P
from eprt.comm.dp_combine import DpExchange
from eprt.comm.slots import SlotError
from eprt.comm.transport import LocalTransport
from eprt.comm.worker import _execute
from eprt.engine.dp_executor import dp_executor
from eprt.engine.executor import ExecutorError
from eprt.entry.scenario import ScenarioError, parse
from eprt.model.loader import load_model
from eprt.ops.numpy_ops import NumpyOps


def test_owner_and_decode_dp_round_trip():
    cmds = [
        P.Owner(slot=2, owner=1),
        P.DecodeDp(slots=(0, 2, 3), tokens=(7, 8, 9), counts=(2, 1)),
        P.Owner(slot=3, owner=0, prompt_hidden=1),
    ]
    words = np.concatenate([P.encode(c) for c in cmds])
    assert words[:4].tolist() == [2, P.OWNER, 1, 0]
    assert words[4:16].tolist() == [0, P.DECODE_DP, 3, 2, 2, 1, 0, 2, 3, 7, 8, 9]
    assert words[16:].tolist() == [3, P.OWNER, 0, 1]
    assert P.decode_all(words, max_slots=4, vocab_size=16) == cmds
    with pytest.raises(P.ProtocolError, match="OWNER prompt_hidden 2 \\(must be 0 or 1\\)"):
        P.decode_all([3, P.OWNER, 0, 2], max_slots=4)


def test_decode_dp_counts_must_add_up():
    with pytest.raises(P.ProtocolError, match="rows per rank \\[1, 1\\]"):
        P.encode(P.DecodeDp(slots=(0, 1, 2), tokens=(1, 2, 3), counts=(1, 1)))
    with pytest.raises(P.ProtocolError, match="do not sum to its 2 rows"):
        P.decode_all([0, P.DECODE_DP, 2, 2, 2, 1, 0, 1, 5, 6])


def test_owner_choice_affinity_then_load_then_rank():
    pools = OwnerPools([10, 10, 10], block_size=4)
    assert pools.choose(list(range(9))) == 0  # all empty: the lowest rank
    pools.pools[0].allocate("a", list(range(1, 10)))  # 3 blocks on rank 0
    pools.pools[1].allocate("b", list(range(50, 55)))  # 2 blocks on rank 1
    assert pools.choose([5, 6, 7]) == 2  # the fewest blocks in use
    pools.pools[0].cache("a", list(range(1, 10)))
    assert pools.choose(list(range(1, 10)) + [99]) == 0  # the cached prefix wins over the load
    assert pools.choose(list(range(40))) is None  # 11 blocks: no rank has room


def test_owner_choice_skips_a_full_rank():
    pools = OwnerPools([3, 30], block_size=4)
    assert pools.choose(list(range(12))) == 1  # 4 blocks: only rank 1 has room


@pytest.fixture(scope="module")
def executor(checkpoint):
    model = load_model(checkpoint("mixtral"), NumpyOps(), 64).model
    return dp_executor(model, [40], 4, 4, DpExchange(LocalTransport()))


def test_prefill_needs_an_owner_first(executor):
    with pytest.raises(ExecutorError, match="OWNER frame must name its rank first"):
        executor.prefill(0, [3, 4, 5], 0, 3)
    with pytest.raises(ExecutorError, match="rank 1 is outside the world \\[0, 1\\)"):
        executor.assign_owner(0, 1)


def test_decode_dp_counts_checked_against_the_owners(executor):
    executor.assign_owner(1, 0)
    out = executor.prefill(1, [3, 4, 5], 0, 3)
    assert out.tokens.shape == (1,) and out.hidden.shape == (1, executor.cfg.hidden_size)
    with pytest.raises(SlotError, match="OWNER slot 1: the slot is occupied"):
        executor.assign_owner(1, 0)
    with pytest.raises(ExecutorError, match="rows per rank \\[2\\], but the owners of slots \\[1\\]"):
        executor.decode([1], [int(out.tokens[0])], [2])
    step = executor.decode([1], [int(out.tokens[0])], [1])
    assert step.tokens.shape == (1,)
    executor.free(1)


def test_replicated_worker_refuses_dp_frames():
    with pytest.raises(P.ProtocolError, match="Owner \\(slot 0\\) is for dp attention"):
        _execute(P.Owner(0, 1), None, object(), P.Decoder())


def test_hybrid_models_are_refused(checkpoint):
    model = load_model(checkpoint("qwen3_next"), NumpyOps(), 64).model
    with pytest.raises(ValueError, match="--attention dp does not serve qwen3_next"):
        dp_executor(model, [40], 4, 4, DpExchange(LocalTransport()))


@pytest.mark.parametrize(
    "engine, message",
    [
        ({"rank_blocks": [4, 0]}, "rank_blocks must be a non-empty list of ints >= 1"),
        ({"rank_blocks": []}, "rank_blocks must be a non-empty list"),
        ({"rank_blocks": [4], "snapshots": 2}, "do not go together"),
    ],
)
def test_scenario_rank_blocks_checked(engine, message):
    doc = {"name": "x", "engine": engine, "request": [{"id": 1, "prompt_len": 2, "script": [1]}]}
    with pytest.raises(ScenarioError, match=message):
        parse(doc)


def test_attention_flag_checked():
    from eprt.engine.config import EngineConfig

    with pytest.raises(ValueError, match="--attention must be auto, dp or replicated, got 'ring'"):
        EngineConfig(attention="ring").validate()
    with pytest.raises(ValueError, match="eprt replay rebuilds replicated attention only"):
        EngineConfig(attention="dp", record_payloads=True).validate()


def test_auto_attention_picks_dp_only_for_a_multi_rank_job_dp_serves(monkeypatch):
    from types import SimpleNamespace

    from eprt.engine import startup
    from eprt.engine.config import EngineConfig

    plain = SimpleNamespace(model_type="qwen3_moe", mrope_section=None, is_hybrid=False)
    hybrid = SimpleNamespace(model_type="qwen3_next", mrope_section=None, is_hybrid=True)
    assert EngineConfig().attention == "auto"
    assert startup.choose_attention(EngineConfig(attention="dp"), 1, plain) == ("dp", "--attention dp")
    assert startup.choose_attention(EngineConfig(attention="replicated"), 4, plain)[0] == "replicated"
    assert startup.DEFAULT_MULTI_RANK_ATTENTION == "dp"  # bench_ep.py: docs/design.md, "dp attention"
    assert startup.choose_attention(EngineConfig(cuda_graphs=False), 2, plain, "cuda")[0] == "dp"
    assert startup.choose_attention(EngineConfig(), 2, plain) == (
        "dp",
        "auto: 2 ranks, and dp serves everything this job uses",
    )
    cases = [
        (EngineConfig(), 1, plain, "auto: one rank"),
        (EngineConfig(record_payloads=True), 4, plain, "--record-payloads"),
        (EngineConfig(overlap=True), 2, plain, "auto: --overlap on"),
        (EngineConfig(), 2, plain, "auto: --cuda-graphs on", "cuda"),
        (EngineConfig(speculative_method="mtp"), 2, plain, "dp does not serve --speculative-method mtp yet"),
        (EngineConfig(), 2, hybrid, "qwen3_next checkpoint (recurrent state)"),
    ]
    for cfg, world, model_cfg, why, *device in cases:
        mode, reason = startup.choose_attention(cfg, world, model_cfg, *device)
        assert mode == "replicated" and why in reason, (mode, reason)
    monkeypatch.setattr(startup, "DEFAULT_MULTI_RANK_ATTENTION", "replicated")
    assert startup.choose_attention(EngineConfig(), 2, plain) == (
        "replicated",
        "auto: dp does not win benchmarks/bench_ep.py yet (DEFAULT_MULTI_RANK_ATTENTION)",
    )


def test_dp_refuses_what_it_does_not_serve_yet_naming_the_flag():
    from types import SimpleNamespace

    from eprt.engine.config import EngineConfig
    from eprt.engine.startup import check_dp_features

    plain = SimpleNamespace(model_type="qwen3_moe", mrope_section=None, is_hybrid=False)
    vision = SimpleNamespace(model_type="qwen3_vl_moe", mrope_section=[24, 20, 20], is_hybrid=False)
    check_dp_features(EngineConfig(attention="dp"), plain)  # nothing refused
    check_dp_features(EngineConfig(attention="dp", speculative_method="ngram"), plain)
    check_dp_features(EngineConfig(attention="dp", enable_lora=True), plain)
    check_dp_features(EngineConfig(attention="dp"), vision)
    hybrid = SimpleNamespace(model_type="qwen3_next", mrope_section=None, is_hybrid=True)
    cases = [
        (EngineConfig(attention="dp", speculative_method="mtp"), plain, "--speculative-method mtp"),
        (EngineConfig(attention="dp"), hybrid, "qwen3_next checkpoint \\(recurrent state\\)"),
    ]
    for cfg, model_cfg, named in cases:
        with pytest.raises(ValueError, match=named):
            check_dp_features(cfg, model_cfg)
