"""Decode throughput and achieved memory bandwidth of the CuPy backend on a random MoE.

Builds a Qwen3-30B-A3B-shaped MoE (random bf16 weights generated on the GPU, nothing is
downloaded), fills a paged KV cache for B sequences of --context tokens, and times decode
steps with the ops directly (embedding -> layers -> final norm -> lm_head -> argmax, the
token copied to the host every step as the scheduler needs it). The context stays fixed:
each step rewrites the same position, so every step does the same work.

Bandwidth = bytes a step must read (every dense weight, the weights of the experts the
router actually chose, the KV of every sequence, the lm_head) / step time, reported as a
fraction of the device's peak (table below, or --peak-gbs).

Then decode attention of one layer alone at batch 1 and 8, one pass per (sequence, KV
head) vs split into partitions (flash-decoding), side by side.

    python benchmarks/bench_gpu.py                      # batches 1, 32, 128; 16 layers
    python benchmarks/bench_gpu.py --layers 48 --context 4096 --peak-gbs 4800
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import numpy as np

# Peak HBM bandwidth in GB/s by device-name substring; first match wins (specific first).
PEAK_GBS = (
    ("GH200", 4000),
    ("H200", 4800),
    ("H100 PCIe", 2000),
    ("H100 NVL", 3900),
    ("H100", 3350),
    ("H800", 3350),
    ("A100 80GB PCIe", 1935),
    ("A100-SXM4-80GB", 2039),
    ("A100", 1555),
    ("B200", 8000),
    ("L40S", 864),
    ("RTX 4090", 1008),
)


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int = 2048  # D
    heads: int = 32  # H
    kv_heads: int = 4  # Hk
    head_dim: int = 128  # Dh
    experts: int = 128  # E
    top_k: int = 8  # k
    inter: int = 768  # I
    vocab: int = 151936  # V
    block_size: int = 16  # BS


TINY = Shape(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=16, top_k=4, inter=128, vocab=1024)


def peak_gbs(name: str) -> float | None:
    for key, gbs in PEAK_GBS:
        if key in name:
            return float(gbs)
    return None


def random_bf16(cp, shape, scale: float):
    """Normal(0, scale) values as bf16 bits, generated and rounded on the GPU (round to
    nearest even, as eprt.ops.bf16.f32_to_bf16_bits)."""
    b = (cp.random.standard_normal(shape, dtype=cp.float32) * np.float32(scale)).view(cp.uint32)
    b += 0x7FFF + ((b >> 16) & 1)
    return (b >> 16).astype(cp.uint16)


class Model:
    def __init__(self, ops, s: Shape, context: int):
        cp = ops.xp
        D, H, Hk, Dh, E, I = s.hidden, s.heads, s.kv_heads, s.head_dim, s.experts, s.inter
        self.ops, self.s, self.context = ops, s, context
        w = lambda *shape: random_bf16(cp, shape, shape[-1] ** -0.5)  # noqa: E731
        ones = lambda n: ops.weight(np.ones(n, np.float32))  # noqa: E731
        self.layers = [
            dict(
                q=w(H * Dh, D),
                k=w(Hk * Dh, D),
                v=w(Hk * Dh, D),
                o=w(D, H * Dh),
                q_norm=ones(Dh),
                k_norm=ones(Dh),
                in_norm=ones(D),
                post_norm=ones(D),
                router=w(E, D),
                gate_up=w(E, 2 * I, D),
                down=w(E, D, I),
            )
            for _ in range(s.layers)
        ]
        self.embed, self.lm_head, self.norm = w(s.vocab, D), w(s.vocab, D), ones(D)
        freqs = np.arange(context + 1)[:, None] * (1e6 ** (-np.arange(0, Dh, 2) / Dh))[None, :]
        self.cos_sin = ops.activation(np.concatenate([np.cos(freqs), np.sin(freqs)], -1))
        self.batch = 0

    def set_batch(self, batch: int) -> None:
        """Fresh KV and decode inputs for ``batch`` sequences of ``context`` tokens each."""
        ops, s, context, cp = self.ops, self.s, self.context, self.ops.xp
        self.batch, self.k_cache, self.v_cache = batch, [], []
        cp.get_default_memory_pool().free_all_blocks()
        # each sequence owns ceil((context + 1) / BS) consecutive blocks
        per_seq = -(-(context + 1) // s.block_size)
        shape = (batch * per_seq, s.block_size, s.kv_heads, s.head_dim)
        self.k_cache = [random_bf16(cp, shape, 1.0) for _ in range(s.layers)]
        self.v_cache = [random_bf16(cp, shape, 1.0) for _ in range(s.layers)]
        tables = np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq)  # [B, MB]
        self.block_tables = ops.index(tables)
        self.positions = ops.index(np.full(batch, context, np.int32))  # [B]
        self.slot_mapping = ops.index(tables[:, context // s.block_size] * s.block_size + context % s.block_size)
        self.context_lens = ops.index(np.full(batch, context + 1, np.int32))
        self.ids = ops.index(np.random.default_rng(0).integers(0, s.vocab, batch))
        self.last_ids: list = []

    def step(self) -> np.ndarray:
        ops, s, B = self.ops, self.s, self.batch
        eps, scale = 1e-6, s.head_dim**-0.5
        h = ops.embedding(self.embed, self.ids)  # [B, D]
        residual, self.last_ids = h, []
        x = ops.rms_norm(h, self.layers[0]["in_norm"], eps)
        for i, lw in enumerate(self.layers):
            if i:
                x, residual = ops.add_rms_norm(h, residual, lw["in_norm"], eps)
            q = ops.rms_norm(ops.linear(x, lw["q"]).reshape(-1, s.head_dim), lw["q_norm"], eps)
            k = ops.rms_norm(ops.linear(x, lw["k"]).reshape(-1, s.head_dim), lw["k_norm"], eps)
            v = ops.linear(x, lw["v"]).reshape(B, s.kv_heads, s.head_dim)
            q = ops.rope(q.reshape(B, s.heads, s.head_dim), self.positions, self.cos_sin)
            k = ops.rope(k.reshape(B, s.kv_heads, s.head_dim), self.positions, self.cos_sin)
            ops.kv_write(self.k_cache[i], self.v_cache[i], k, v, self.slot_mapping)
            o = ops.attention_decode(q, self.k_cache[i], self.v_cache[i], self.block_tables, self.context_lens, scale)
            h = ops.linear(o.reshape(B, -1), lw["o"])
            x, residual = ops.add_rms_norm(h, residual, lw["post_norm"], eps)
            weights, ids = ops.router(ops.linear(x, lw["router"]), s.top_k, True)
            self.last_ids.append(ids)
            h = ops.moe_experts(x, weights, ids, lw["gate_up"], lw["down"], 0)  # [B, D] fp32
        x, _ = ops.add_rms_norm(h, residual, self.norm, eps)
        return ops.argmax(ops.linear(x, self.lm_head))  # host [B]

    def bytes_per_step(self) -> int:
        """Bytes the last step had to read: dense weights, chosen experts, KV, lm_head."""
        s, B = self.s, self.batch
        dense = sum(
            lw[n].nbytes
            for lw in self.layers
            for n in ("q", "k", "v", "o", "router", "q_norm", "k_norm", "in_norm", "post_norm")
        )
        expert = 2 * 3 * s.inter * s.hidden
        chosen = sum(len(np.unique(self.ops.to_host(ids))) for ids in self.last_ids)
        ctx = int(self.ops.to_host(self.context_lens).sum())
        kv = s.layers * ctx * s.kv_heads * s.head_dim * 2 * 2
        return dense + chosen * expert + kv + self.lm_head.nbytes + B * s.hidden * 2


def time_ms(fn, steps: int, sync) -> float:
    for _ in range(2):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - t0) / steps * 1e3


def attention_split_table(s: Shape, batches, contexts, steps: int, moe_impl: str) -> None:
    """Decode attention of one layer alone, one pass per (sequence, KV head) vs split into
    partitions (flash-decoding), measured side by side."""
    from eprt.ops.cupy_ops import CupyOps

    one, split = CupyOps(moe_impl, decode_split="off"), CupyOps(moe_impl, decode_split="on")
    cp, scale = one.xp, s.head_dim**-0.5
    print("decode attention, one layer: one pass vs split (flash-decoding)")
    print(f"{'batch':>6} {'context':>8} {'partitions':>10} {'one pass us':>12} {'split us':>9} {'speed-up':>9}")
    for batch in batches:
        for context in contexts:
            per_seq = -(-context // s.block_size)
            shape = (batch * per_seq, s.block_size, s.kv_heads, s.head_dim)
            k, v = random_bf16(cp, shape, 1.0), random_bf16(cp, shape, 1.0)
            q = random_bf16(cp, (batch, s.heads, s.head_dim), 1.0)
            tables = one.index(np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq))
            lens = one.index(np.full(batch, context, np.int32))
            a = time_ms(lambda: one.attention_decode(q, k, v, tables, lens, scale), steps, one.synchronize)  # noqa: B023
            b = time_ms(lambda: split.attention_decode(q, k, v, tables, lens, scale), steps, one.synchronize)  # noqa: B023
            parts = split._decode_partitions(batch * s.kv_heads, per_seq * s.block_size)[0]
            print(f"{batch:6d} {context:8d} {parts:10d} {a * 1e3:12.1f} {b * 1e3:9.1f} {a / b:9.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--context", type=int, default=1024, help="tokens already in each sequence's KV")
    p.add_argument("--batches", default="1,32,128", help="comma-separated decode batch sizes")
    p.add_argument("--steps", type=int, default=20, help="timed steps per batch size (after 3 warm-ups)")
    p.add_argument("--peak-gbs", type=float, default=None, help="device peak memory bandwidth, GB/s")
    p.add_argument("--moe-impl", default="auto", choices=("auto", "grouped", "gathered"))
    p.add_argument(
        "--attention-contexts",
        default="1024,4096,16384",
        help="contexts of the one-pass vs split decode attention table ('' skips it)",
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="a toy shape, to check the script itself (e.g. on cusim: python -m cusim.run)",
    )
    args = p.parse_args(argv)

    from eprt.ops import device

    if not device.cuda_usable():
        print("bench_gpu: no usable CUDA device (CuPy cannot see one)", file=sys.stderr)
        return 1
    import cupy as cp

    from eprt.ops.cupy_ops import CupyOps

    device.bind_local_gpu()
    ops = CupyOps(moe_impl=args.moe_impl)
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    peak = args.peak_gbs or peak_gbs(name)
    shape = TINY if args.tiny else Shape(layers=args.layers)
    print(f"device {name}; peak {peak or 'unknown (pass --peak-gbs)'} GB/s; {shape}; context {args.context}")
    print(f"{'batch':>6} {'ms/step':>9} {'tokens/s':>10} {'GB/step':>8} {'GB/s':>8} {'of peak':>8}")
    model = Model(ops, shape, args.context)
    for batch in (int(b) for b in args.batches.split(",")):
        model.set_batch(batch)
        for _ in range(3):
            model.step()
        ops.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            model.step()
        dt = (time.perf_counter() - t0) / args.steps
        gb = model.bytes_per_step() / 1e9
        frac = f"{gb / dt / peak:8.1%}" if peak else f"{'-':>8}"
        print(f"{batch:6d} {dt * 1e3:9.2f} {batch / dt:10.1f} {gb:8.2f} {gb / dt:8.0f} {frac}")
    if args.attention_contexts:
        del model
        attention_split_table(
            shape, (1, 8), [int(c) for c in args.attention_contexts.split(",")], max(args.steps, 1), args.moe_impl
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
