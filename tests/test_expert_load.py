"""Expert-load statistics: counted per layer and expert as tokens are routed, in the engine's
log line and /metrics, written by eprt run --stats-out and drawn by eprt stats --plot."""

import json
import subprocess
import sys

import numpy as np
import pytest

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.engine.expert_load import imbalance, rank_load, read_stats
from eprt.serve.metrics import EngineCollector


def test_every_routed_token_is_counted_once_per_layer(checkpoint):
    path = checkpoint("qwen3_moe")
    cfg = EngineConfig(model=path, device="cpu", max_batch=4, block_size=4, max_model_len=64)
    prompts = [[5, 6, 7, 8, 9], [3, 4, 5]]
    with launch_engine(cfg) as engine:
        results = engine.generate(
            [GenerationRequest(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in prompts]
        )
        counts = engine.expert_load(refresh=True)
        families = {f.name: f for f in EngineCollector(engine).collect()}
        top_k, sparse = engine.model_config.top_k, engine.model_config.sparse_layers
    # every prompt token and every fed-back generated token (not the last) goes through each MoE layer
    routed = sum(len(p) + len(r.token_ids) - 1 for p, r in zip(prompts, results))
    for layer, is_sparse in enumerate(sparse):
        assert counts[layer].sum() == (routed * top_k if is_sparse else 0)
    samples = {(s.labels["layer"], s.labels["expert"]): s.value for s in families["eprt_expert_tokens"].samples}
    assert samples[("0", "3")] == counts[0, 3] and len(samples) == sum(sparse) * counts.shape[1]
    moe_layers = {str(i) for i, is_sparse in enumerate(sparse) if is_sparse}
    assert {s.labels["layer"] for s in families["eprt_expert_imbalance_ratio"].samples} == moe_layers


def test_imbalance_and_rank_load():
    counts = np.array([[4, 4, 4, 4], [10, 2, 2, 2], [0, 0, 0, 0]])
    np.testing.assert_allclose(imbalance(counts), [1.0, 2.5, 0.0])
    np.testing.assert_array_equal(rank_load(counts, 3), [14 + 6, 6, 6])  # experts 0-1, 2, 3


@pytest.mark.slow
def test_run_stats_out_then_stats_plot(checkpoint, tmp_path):
    pytest.importorskip("matplotlib")
    path = checkpoint("mixtral")
    lines = [json.dumps({"id": i, "prompt_ids": [3 + i, 40, 41, 42], "max_tokens": 5}) for i in range(4)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    stats, png = tmp_path / "stats.json", tmp_path / "load.png"
    run = [
        sys.executable,
        "-m",
        "eprt",
        "run",
        "--model",
        path,
        "--device",
        "cpu",
        "--input",
        str(tmp_path / "in.jsonl"),
        "--output",
        str(tmp_path / "out.jsonl"),
        "--stats-out",
        str(stats),
    ]
    subprocess.run(run, check=True, capture_output=True, timeout=300)
    counts, model, world = read_stats(str(stats))
    assert world == 1 and counts.sum() > 0
    out = subprocess.run(
        [sys.executable, "-m", "eprt", "stats", str(stats), "--plot", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "max/mean" in out.stdout and "rank 0:" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    (tmp_path / "bad.json").write_text('{"counts": "x"}')
    bad = subprocess.run(
        [sys.executable, "-m", "eprt", "stats", str(tmp_path / "bad.json")], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "not an eprt expert-load statistics file" in bad.stderr
