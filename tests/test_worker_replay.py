"""A worker replaying rank 0's real command stream ends with bitwise the same KV pool,
block tables and prefix cache as rank 0, through chunked prefill, prefix-cache hits,
preemption, compaction and vision rows: the state the protocol keeps in step."""

import numpy as np

from eprt.api import GenerationRequest, SamplingParams
from eprt.comm.transport import LocalTransport
from eprt.comm.worker import run_worker
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.engine.executor import ShardExecutor
from eprt.model.loader import load_model
from eprt.ops.numpy_ops import NumpyOps

IMAGE = 250


class RecordingTransport(LocalTransport):
    """Rank 0 in a world of one that also keeps every frame and vision-row block it would
    send to workers (a world of one sends none)."""

    def __init__(self):
        super().__init__()
        self.frames, self.rows = [], []

    def flush(self):
        if self.queue.pending:
            self.frames.append(self.queue.out[1 : self.queue.n].copy())
        super().flush()

    def send(self, cmd, vision_rows=None):
        super().send(cmd, vision_rows)  # a frame announcing rows is flushed before them
        if vision_rows is not None and len(vision_rows):
            self.rows.append(np.ascontiguousarray(vision_rows, np.float32))


class Replay:
    """The worker side of a recorded stream."""

    rank = 1

    def __init__(self, frames, rows):
        self.frames, self.rows = list(frames), list(rows)

    def recv_frame(self):
        return self.frames.pop(0)

    def recv_rows(self, n, width):
        rows = self.rows.pop(0)
        assert rows.shape == (n, width)
        return rows

    def report_error(self, text):
        raise AssertionError(f"worker failed: {text}")


def test_worker_replay_matches_rank_0_bitwise(checkpoint):
    path = checkpoint("qwen2_moe")
    cfg = EngineConfig(
        model=path,
        device="cpu",
        max_batch=3,
        block_size=4,
        max_model_len=48,
        num_blocks=14,
        max_prefill_tokens=6,
        image_token_id=IMAGE,
    )
    system = list(range(30, 46))
    rows = np.random.default_rng(0).normal(0, 0.3, size=(2, 64)).astype(np.float32)
    reqs = [
        GenerationRequest(system + [i, i + 1, i + 2], SamplingParams(max_tokens=14 + 3 * i, ignore_eos=True))
        for i in range(4)
    ]
    reqs.append(GenerationRequest([7, IMAGE, IMAGE, 9], SamplingParams(max_tokens=6), image_embeds=rows))
    transport = RecordingTransport()
    with launch_engine(cfg, transport=transport) as engine:
        first = engine.generate(reqs[:1])  # fills the prefix cache
        rest = engine.generate(reqs[1:])  # hits it, under KV pressure
        rank0 = engine.runner.executor
        stats = engine.stats()
    assert first[0].cached_tokens == 0 and any(r.cached_tokens for r in rest)
    assert stats["preemptions"] > 0, "the pool is meant to be small enough to preempt"

    worker = ShardExecutor(load_model(path, NumpyOps(), 64).model, 14, 4, 3, image_token_id=IMAGE)
    worker.compute_logits = False
    assert run_worker(Replay(transport.frames, transport.rows), worker, 3, 256) == 0
    for layer in range(len(rank0.kv.k)):
        assert np.array_equal(rank0.kv.k[layer], worker.kv.k[layer])
        assert np.array_equal(rank0.kv.v[layer], worker.kv.v[layer])
    assert rank0.blocks._block_of == worker.blocks._block_of  # the same prefix cache
    assert list(rank0.blocks._evictable) == list(worker.blocks._evictable)
    assert rank0.blocks.num_free_blocks() == worker.blocks.num_free_blocks() == 14
