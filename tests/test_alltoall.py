"""--moe-exchange: the flag, the start-up choice and what a world of one counts (the exchange itself
runs in tests/mpi/test_alltoall_mpi.py at 1 to 4 ranks)."""

import argparse

import numpy as np
import pytest

from eprt.comm.alltoall import _units
from eprt.engine import startup
from eprt.engine.config import EngineConfig, EplbConfig, add_engine_arguments, engine_config_from_args


def test_moe_exchange_flag_checked_and_parsed():
    with pytest.raises(ValueError, match="--moe-exchange must be auto, allgather or alltoall, got 'ring'"):
        EngineConfig(moe_exchange="ring").validate()
    with pytest.raises(
        ValueError, match="does not serve LoRA adapters on the routed experts .* yet; use --moe-exchange allgather"
    ):
        EngineConfig(moe_exchange="alltoall", enable_lora=True).validate()
    with pytest.raises(ValueError, match="--record-payloads"):
        EngineConfig(moe_exchange="alltoall", record_payloads=True).validate()
    EngineConfig(moe_exchange="alltoall", enable_lora=True, eplb=EplbConfig(enabled=True)).validate()  # no expert LoRA
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args(["--moe-exchange", "alltoall"])).moe_exchange == "alltoall"
    assert engine_config_from_args(parser.parse_args([])).moe_exchange == "auto"


def test_auto_picks_alltoall_under_dp_attention_from_three_ranks_for_what_it_serves():
    assert startup.choose_exchange(EngineConfig(), 1, dp=False)[0] == "allgather"
    assert startup.choose_exchange(EngineConfig(), 2, dp=True)[0] == "allgather"
    assert startup.choose_exchange(EngineConfig(), 3, dp=True) == (
        "alltoall",
        "auto: dp attention on 3 ranks (from 3 on: benchmarks/bench_ep.py)",
    )
    mode, why = startup.choose_exchange(EngineConfig(), 4, dp=False)
    assert mode == "allgather" and "replicated attention" in why
    mode, why = startup.choose_exchange(EngineConfig(enable_lora=True), 4, dp=True)
    assert mode == "allgather" and "LoRA adapters on the routed experts" in why
    assert startup.choose_exchange(EngineConfig(moe_exchange="allgather"), 8, True) == (
        "allgather",
        "--moe-exchange allgather",
    )
    assert startup.choose_exchange(EngineConfig(moe_exchange="alltoall"), 1, False)[0] == "alltoall"


def test_units_are_row_rank_pairs_or_row_choice_pairs_in_row_order():
    dest = np.array([[1, 0, 1], [2, 2, 2], [0, 1, 2]])  # [N=3, k=3] the rank of each choice
    row, _, rank = _units(dest, 3, per_choice=False)
    assert list(zip(row.tolist(), rank.tolist())) == [(0, 0), (0, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    row, choice, rank = _units(dest, 3, per_choice=True)
    assert row.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2] and choice.tolist() == [0, 1, 2] * 3
    assert rank.tolist() == dest.reshape(-1).tolist()


@pytest.mark.slow
def test_one_rank_alltoall_counts_layers_and_no_bytes():
    from eprt.api import GenerationRequest, SamplingParams
    from eprt.engine.engine import launch_engine

    cfg = EngineConfig(device="cpu", max_batch=2, moe_exchange="alltoall")
    with launch_engine(cfg) as engine:
        out = engine.generate([GenerationRequest([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))])
        stats = engine.stats()
    assert len(out[0].token_ids) == 3 and stats["moe_exchange"] == "alltoall"
    assert (
        stats["moe_layers"] == 4 * 3 and stats["moe_sent_bytes"] == stats["moe_recv_bytes"] == 0
    )  # 4 layers, 3 passes


def test_metrics_publish_the_exchange_and_its_counters():
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from eprt.serve.metrics import EngineCollector

    stats = dict(moe_exchange="alltoall", moe_layers=8, moe_sent_bytes=4096, moe_recv_bytes=2048)
    registry = CollectorRegistry()
    registry.register(EngineCollector(SimpleNamespace(stats=lambda: dict(stats, moe_exchange_seconds=0.5))))
    text = generate_latest(registry).decode()
    for line in (
        'eprt_moe_exchange_info{exchange="alltoall"} 1.0',
        "eprt_moe_exchange_layers_total 8.0",
        "eprt_moe_exchange_sent_bytes_total 4096.0",
        "eprt_moe_exchange_received_bytes_total 2048.0",
        "eprt_moe_exchange_seconds_total 0.5",
    ):
        assert line in text, text
