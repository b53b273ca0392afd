"""CUDA graphs for the decode step (eprt/engine/cuda_graphs.py) against eager launches, on cusim in
CI: greedy and seeded-sampled tokens with --cuda-graphs on equal off, for every architecture the
GPU backend serves, at batch sizes that hit and miss the buckets, with rows joining and leaving
between steps. On cusim each replay is also checked against a fresh capture of the same step (a
Python scalar or buffer fixed at capture that the step would now pass differently is refused)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.cuda_graphs import batch_buckets, bucket_of
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.ops.device import cuda_usable

# 5 requests of different lengths, greedy and seeded-sampled ones together. On max-batch 8
# (buckets 1, 2, 4, 8) the batch shrinks as they finish: 5 rows (padded to 8), 4, 3 (padded to 4),
# 2, 1. On max-batch 3 (buckets 1, 2, 3) rows join as others leave and every size hits a bucket.
PROMPTS = [[5, 77, 3], [140, 9, 9, 31, 200, 17], list(range(40, 60)), [7, 7, 7, 7], [250, 11]]
LENGTHS = [6, 3, 8, 5, 4]


def generate(path, graphs: bool, max_batch: int, prompts=PROMPTS, lengths=LENGTHS, **kw):
    """(each request's tokens, the engine's DecodeGraphs): even requests greedy, odd ones sampled."""
    cfg = EngineConfig(
        model=path, device="cuda", max_batch=max_batch, block_size=16, max_model_len=96, cuda_graphs=graphs, **kw
    )
    params = [
        SamplingParams(max_tokens=n, temperature=0.8 * (i % 2), top_p=0.9 if i % 2 else 1.0, seed=10 + i)
        for i, n in enumerate(lengths)
    ]
    with launch_engine(cfg) as engine:
        out = [r.token_ids for r in engine.generate([GenerationRequest(p, s) for p, s in zip(prompts, params)])]
        return out, engine.runner.executor.passes.graphs


def test_buckets_are_powers_of_two_to_32_then_steps_of_32():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(3) == (1, 2, 3)
    assert batch_buckets(32) == (1, 2, 4, 8, 16, 32)
    assert batch_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 96, 100)
    assert batch_buckets(128) == (1, 2, 4, 8, 16, 32, 64, 96, 128)
    assert bucket_of(batch_buckets(128), 33) == 64 and bucket_of(batch_buckets(128), 129) is None
    with pytest.raises(ValueError, match="max_batch must be >= 1, got 0"):
        batch_buckets(0)


@pytest.mark.parametrize(
    "arch, max_batch",
    [
        ("qwen3_moe", 8),
        pytest.param("qwen3_moe", 3, marks=pytest.mark.slow),
        pytest.param("deepseek_v3", 8, marks=pytest.mark.slow),
    ],
)
@pytest.mark.gpu
@pytest.mark.skipif(not cuda_usable(), reason="no usable CUDA device")
def test_graph_tokens_equal_eager_tokens(checkpoint, arch, max_batch):
    path = checkpoint(arch, dtype="bfloat16")
    eager, used = generate(path, False, max_batch)
    assert used.replays == 0
    graphs, used = generate(path, True, max_batch)
    assert used.replays > 0
    assert graphs == eager
    assert [len(t) for t in graphs] == LENGTHS


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "glm4_moe", "gpt_oss"])
@pytest.mark.gpu
@pytest.mark.skipif(not cuda_usable(), reason="no usable CUDA device")
def test_graph_tokens_equal_eager_tokens_every_architecture(checkpoint, arch, tmp_path_factory):
    if arch == "gpt_oss":  # sinks, biases, sliding layers whose windowed KV has its own tables (blocks of 4)
        from checkpoints import build_gptoss_checkpoint

        root = os.environ.get("EPRT_TEST_CKPT_DIR") or str(tmp_path_factory.mktemp("ckpt"))
        path = build_gptoss_checkpoint(os.path.join(root, "gpt_oss-bf16"), dtype="bfloat16")
    else:
        path = checkpoint(arch, dtype="bfloat16")
    eager, _ = generate(path, False, 8)
    graphs, used = generate(path, True, 8)
    assert used.replays > 0
    assert graphs == eager


def test_padded_rows_are_masked_out_of_the_expert_load():
    from eprt.model.moe_model import MoEModel

    model = MoEModel.__new__(MoEModel)
    ids = np.array([[1, 2], [3, 0], [2, 2]], np.int32)
    model.row_mask = None
    assert model._counted(ids) is ids
    model.row_mask = np.array([[1], [1], [0]], np.int32)
    np.testing.assert_array_equal(model._counted(ids), [[1, 2], [3, 0], [-1, -1]])


def test_cuda_graphs_flag_reaches_the_engine_config():
    import argparse

    from eprt.engine.config import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args([])).cuda_graphs is True
    assert engine_config_from_args(parser.parse_args(["--cuda-graphs", "off"])).cuda_graphs is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--cuda-graphs", "maybe"])


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not cuda_usable(), reason="no usable CUDA device")
def test_verify_steps_replayed_from_graphs_give_the_eager_tokens(checkpoint):
    """ngram speculation, K = 3: a verify step's positions (1 + its drafts per row) run as decode
    rows in the graph of their bucket; with several rows in the step (one runs eagerly)."""
    path = checkpoint("qwen3_moe", dtype="bfloat16")
    loops = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [12, 13] * 7, [14, 15, 16, 17, 18] * 3]
    lengths = [12, 9, 14, 10]
    spec = dict(speculative_method="ngram", num_speculative_tokens=3)
    eager, _ = generate(path, False, 4, loops, lengths, **spec)
    graphs, used = generate(path, True, 4, loops, lengths, **spec)
    assert used.verify_replays > 0
    assert graphs == eager


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_usable(), reason="no usable CUDA device")
def test_kernels_are_looked_up_once_and_run_on_the_ranks_own_stream():
    import cupy

    from eprt.ops import kernel_loader
    from eprt.ops.cupy_ops import CupyOps

    kernel = kernel_loader.get_kernel("argmax.cu", "argmax_f32")
    assert kernel_loader.get_kernel("argmax.cu", "argmax_f32") is kernel  # no RawKernel rebuilt per launch
    ops = CupyOps()
    assert ops.stream.ptr != 0 and cupy.cuda.get_current_stream() is ops.stream  # never the legacy stream
