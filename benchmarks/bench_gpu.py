"""Decode throughput and achieved memory bandwidth of the CuPy backend on a random MoE.

Builds a Qwen3-30B-A3B-shaped MoE (random bf16 weights generated on the GPU, nothing is
downloaded), fills a paged KV cache for B sequences of --context tokens, and times decode
steps with the ops directly (embedding -> layers -> final norm -> lm_head -> argmax, the
token copied to the host every step as the scheduler needs it). The context stays fixed:
each step rewrites the same position, so every step does the same work.

Bandwidth = bytes a step must read (every dense weight, the weights of the experts the
router actually chose, the KV of every sequence, the lm_head) / step time, reported as a
fraction of the device's peak (table below, or --peak-gbs).

Then, beside torch on the same device in the same run, tokens per second of the prefill of one
prompt (--prefill, 512 and 4096 tokens) and of a decode step at --torch-batch (128), for the whole
model and for one layer's components: the experts (ours: router + grouped tensor-core or CUDA-core
GEMM, chosen by shape; torch: torch.matmul per expert after sorting the rows, as a torch MoE runs
them), prefill and decode attention (torch: scaled_dot_product_attention over contiguous K/V) and
DeepSeek-V3-shaped MLA prefill in the latent space (torch: SDPA with the latent rows as one shared
K/V head). The torch model has the same layers and shapes, with its own random weights.

Then decode attention of one layer alone at batch 1 and 8, one pass per (sequence, KV
head) vs split into partitions (flash-decoding), side by side.

    python benchmarks/bench_gpu.py                      # batches 1, 32, 128; 16 layers; the table beside torch
    python benchmarks/bench_gpu.py --layers 48 --context 4096 --peak-gbs 4800 --prefill 512,4096,16384
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

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
    def __init__(self, ops, s: Shape, context: int, max_prompt: int = 0):
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
        rows = max(context + 1, max_prompt)
        freqs = np.arange(rows)[:, None] * (1e6 ** (-np.arange(0, Dh, 2) / Dh))[None, :]
        self.cos_sin = ops.activation(np.concatenate([np.cos(freqs), np.sin(freqs)], -1))
        self.batch = 0

    def _caches(self, blocks: int) -> None:
        """Fresh random K and V caches of ``blocks`` blocks per layer."""
        s, cp = self.s, self.ops.xp
        self.k_cache, self.v_cache = [], []
        cp.get_default_memory_pool().free_all_blocks()
        shape = (blocks, s.block_size, s.kv_heads, s.head_dim)
        self.k_cache = [random_bf16(cp, shape, 1.0) for _ in range(s.layers)]
        self.v_cache = [random_bf16(cp, shape, 1.0) for _ in range(s.layers)]

    def set_batch(self, batch: int) -> None:
        """Fresh KV and decode inputs for ``batch`` sequences of ``context`` tokens each."""
        ops, s, context = self.ops, self.s, self.context
        self.batch = batch
        per_seq = -(-(context + 1) // s.block_size)  # each sequence owns ceil((context + 1) / BS) consecutive blocks
        self._caches(batch * per_seq)
        tables = np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq)  # [B, MB]
        self.block_tables = ops.index(tables)
        self.positions = ops.index(np.full(batch, context, np.int32))  # [B]
        self.slot_mapping = ops.index(tables[:, context // s.block_size] * s.block_size + context % s.block_size)
        self.context_lens = ops.index(np.full(batch, context + 1, np.int32))
        self.ids = ops.index(np.random.default_rng(0).integers(0, s.vocab, batch))
        self.last_ids: list = []

    def set_prompt(self, tokens: int) -> None:
        """Fresh KV and prefill inputs for one sequence's prompt of ``tokens`` tokens."""
        ops, s = self.ops, self.s
        self.batch = tokens
        self._caches(-(-tokens // s.block_size))
        self.block_table = ops.index(np.arange(-(-tokens // s.block_size), dtype=np.int32))  # [MB]
        self.positions = self.slot_mapping = ops.index(np.arange(tokens, dtype=np.int32))  # [T]
        self.ids = ops.index(np.random.default_rng(0).integers(0, s.vocab, tokens))
        self.last_ids = []

    def _forward(self, attend):
        """Hidden states [rows, D] after the final norm; ``attend(layer, q)`` is the attention."""
        ops, s, rows = self.ops, self.s, self.batch
        eps = 1e-6
        h = ops.embedding(self.embed, self.ids)  # [rows, D]
        residual, self.last_ids = h, []
        x = ops.rms_norm(h, self.layers[0]["in_norm"], eps)
        for i, lw in enumerate(self.layers):
            if i:
                x, residual = ops.add_rms_norm(h, residual, lw["in_norm"], eps)
            q = ops.rms_norm(ops.linear(x, lw["q"]).reshape(-1, s.head_dim), lw["q_norm"], eps)
            k = ops.rms_norm(ops.linear(x, lw["k"]).reshape(-1, s.head_dim), lw["k_norm"], eps)
            v = ops.linear(x, lw["v"]).reshape(rows, s.kv_heads, s.head_dim)
            q = ops.rope(q.reshape(rows, s.heads, s.head_dim), self.positions, self.cos_sin)
            k = ops.rope(k.reshape(rows, s.kv_heads, s.head_dim), self.positions, self.cos_sin)
            ops.kv_write(self.k_cache[i], self.v_cache[i], k, v, self.slot_mapping)
            h = ops.linear(attend(i, q).reshape(rows, -1), lw["o"])
            x, residual = ops.add_rms_norm(h, residual, lw["post_norm"], eps)
            weights, ids = ops.router(ops.linear(x, lw["router"]), s.top_k, True)
            self.last_ids.append(ids)
            h = ops.moe_experts(x, weights, ids, lw["gate_up"], lw["down"], 0)  # [rows, D] fp32
        return ops.add_rms_norm(h, residual, self.norm, eps)[0]

    def step(self) -> np.ndarray:
        """One decode step of the batch; the next tokens on the host [B]."""
        ops, scale = self.ops, self.s.head_dim**-0.5
        attend = lambda i, q: ops.attention_decode(  # noqa: E731
            q, self.k_cache[i], self.v_cache[i], self.block_tables, self.context_lens, scale
        )
        return ops.argmax(ops.linear(self._forward(attend), self.lm_head))

    def prefill(self) -> np.ndarray:
        """The prompt's prefill (causal attention over its own KV); the next token on the host [1]."""
        ops, scale = self.ops, self.s.head_dim**-0.5
        attend = lambda i, q: ops.attention_prefill(q, self.k_cache[i], self.v_cache[i], self.block_table, 0, scale)  # noqa: E731
        x = self._forward(attend)
        return ops.argmax(ops.linear(x[x.shape[0] - 1 :], self.lm_head))

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


class TorchModel:
    """The same layer stack in torch on its own device, for the comparison table: dense projections
    and the router with torch.matmul, attention with scaled_dot_product_attention over contiguous
    K/V (GQA), the experts as per-expert torch.matmul after sorting the rows by expert (how a torch
    MoE runs them; the counts come to the host, as in Hugging Face's implementation)."""

    def __init__(self, s: Shape, device: str, max_rows: int):
        import torch

        self.torch, self.s, self.device = torch, s, device
        D, H, Hk, Dh, E, I = s.hidden, s.heads, s.kv_heads, s.head_dim, s.experts, s.inter
        g = lambda *shape: (torch.randn(*shape, device=device) * shape[-1] ** -0.5).to(torch.bfloat16)  # noqa: E731
        self.layers = [
            dict(q=g(H * Dh, D), k=g(Hk * Dh, D), v=g(Hk * Dh, D), o=g(D, H * Dh), router=g(E, D),
                 gate_up=g(E, 2 * I, D), down=g(E, D, I))
            for _ in range(s.layers)
        ]  # fmt: skip
        self.lm_head = g(s.vocab, D)
        freqs = torch.arange(max_rows, device=device)[:, None] * (1e6 ** (-torch.arange(0, Dh, 2, device=device) / Dh))
        self.cos, self.sin = freqs.cos().to(torch.bfloat16), freqs.sin().to(torch.bfloat16)

    def norm(self, x):
        xf = x.float()
        return (xf * self.torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def rope(self, x, pos):  # x [rows, heads, Dh], rotate half
        half = x.shape[-1] // 2
        c, s_ = self.cos[pos][:, None], self.sin[pos][:, None]
        return self.torch.cat([x[..., :half] * c - x[..., half:] * s_, x[..., half:] * c + x[..., :half] * s_], -1)

    def experts(self, x, lw):
        torch, s = self.torch, self.s
        probs = (x @ lw["router"].T).float().softmax(-1)
        w, ids = torch.topk(probs, s.top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        order = ids.flatten().argsort()
        counts = torch.bincount(ids.flatten(), minlength=s.experts).tolist()
        tok, wts = order // s.top_k, w.flatten()[order][:, None]
        xs, out, o = x[tok], torch.zeros(x.shape, dtype=torch.float32, device=x.device), 0
        for e, c in enumerate(counts):
            if c:
                h = xs[o : o + c] @ lw["gate_up"][e].T
                y = (torch.nn.functional.silu(h[:, : s.inter]) * h[:, s.inter :]) @ lw["down"][e].T
                out.index_add_(0, tok[o : o + c], y.float() * wts[o : o + c])
            o += c
        return out.to(x.dtype)

    def layer(self, h, lw, pos, attend):
        s = self.s
        x = self.norm(h)
        q = self.rope(self.norm((x @ lw["q"].T).view(-1, s.heads, s.head_dim)), pos)
        k = self.rope(self.norm((x @ lw["k"].T).view(-1, s.kv_heads, s.head_dim)), pos)
        v = (x @ lw["v"].T).view(-1, s.kv_heads, s.head_dim)
        h = h + attend(q, k, v).reshape(h.shape[0], -1) @ lw["o"].T
        return h + self.experts(self.norm(h), lw)

    def sdpa(self, q, k, v, causal: bool):  # [B, heads, rows, Dh]
        return tm_sdpa(self.torch, q, k, v, causal)

    def prefill(self, tokens: int):
        torch = self.torch
        pos = torch.arange(tokens, device=self.device)
        h = torch.randn(tokens, self.s.hidden, device=self.device).to(torch.bfloat16)
        attend = lambda q, k, v: self.sdpa(*(a.transpose(0, 1)[None] for a in (q, k, v)), True)[0].transpose(0, 1)  # noqa: E731
        for lw in self.layers:
            h = self.layer(h, lw, pos, attend)
        return (self.norm(h[-1:]) @ self.lm_head.T).argmax(-1).tolist()

    def decode(self, batch: int, context: int):
        """One decode step of ``batch`` sequences over KV caches [B, Hk, context + 1, Dh] per layer."""
        torch, s = self.torch, self.s
        if getattr(self, "_kv_shape", None) != (batch, context):
            shape = (batch, s.kv_heads, context + 1, s.head_dim)
            rand = lambda: torch.randn(shape, device=self.device).to(torch.bfloat16)  # noqa: E731
            self.kv = [(rand(), rand()) for _ in self.layers]
            self._kv_shape = (batch, context)
        pos = torch.full((batch,), context, device=self.device)
        h = torch.randn(batch, s.hidden, device=self.device).to(torch.bfloat16)
        for lw, (kc, vc) in zip(self.layers, self.kv):

            def attend(q, k, v, kc=kc, vc=vc):
                kc[:, :, context], vc[:, :, context] = k, v
                return self.sdpa(q[:, :, None], kc, vc, False)[:, :, 0]

            h = self.layer(h, lw, pos, attend)
        return (self.norm(h) @ self.lm_head.T).argmax(-1).tolist()


def time_ms(fn, steps: int, sync) -> float:
    for _ in range(min(2, steps)):  # warm-ups (one when a single step is asked for: a dry run)
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - t0) / steps * 1e3


# DeepSeek-V3's MLA in the latent space: 128 heads, latent rows of 512 + 64 rope dims
MLA = dict(heads=128, latent=576, values=512)
MLA_TINY = dict(heads=4, latent=48, values=32)


class Comparison:
    """Ours beside torch, timed in the same run on the same device: tokens per second of the whole
    model (prefill of one prompt; a decode step of a batch) and of one layer's components."""

    def __init__(self, ops, model: Model, steps: int, tiny: bool):
        import torch

        self.ops, self.model, self.s, self.steps, self.torch = ops, model, model.s, steps, torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.sync = torch.cuda.synchronize if self.device == "cuda" else (lambda: None)
        self.mla_shape = MLA_TINY if tiny else MLA
        self.rows: list = []

    def row(self, what: str, tokens: int, ours, theirs) -> None:
        a, b = time_ms(ours, self.steps, self.ops.synchronize), time_ms(theirs, self.steps, self.sync)
        self.rows.append((what, tokens / a * 1e3, tokens / b * 1e3))

    def whole_model(self, tm: TorchModel, prompts, batch: int) -> None:
        m, s = self.model, self.s
        for T in prompts:
            m.set_prompt(T)
            self.row(f"prefill {T} tokens, {s.layers} layers", T, m.prefill, lambda: tm.prefill(T))  # noqa: B023
        m.set_batch(batch)
        what = f"decode batch {batch}, context {m.context}, {s.layers} layers"
        self.row(what, batch, m.step, lambda: tm.decode(batch, m.context))

    def experts(self, tm: TorchModel, tokens: int, what: str) -> None:
        """One layer's router and experts on ``tokens`` rows (torch: matmul per expert)."""
        ops, s, lw, torch = self.ops, self.s, self.model.layers[0], self.torch
        x = random_bf16(ops.xp, (tokens, s.hidden), 1.0)
        tx = torch.randn(tokens, s.hidden, device=self.device).to(torch.bfloat16)

        def ours():
            weights, ids = ops.router(ops.linear(x, lw["router"]), s.top_k, True)
            return ops.moe_experts(x, weights, ids, lw["gate_up"], lw["down"], 0)

        self.row(f"MoE experts (router + grouped GEMM), {what}", tokens, ours, lambda: tm.experts(tx, tm.layers[0]))

    def attention(self, tokens: int) -> None:
        """Causal prefill attention of one layer over a prompt of ``tokens`` (torch: SDPA, contiguous K/V)."""
        ops, s, m, torch = self.ops, self.s, self.model, self.torch
        m.set_prompt(tokens)
        q = random_bf16(ops.xp, (tokens, s.heads, s.head_dim), 1.0)
        k0, v0, table, scale = m.k_cache[0], m.v_cache[0], m.block_table, s.head_dim**-0.5
        tq = torch.randn(1, s.heads, tokens, s.head_dim, device=self.device).to(torch.bfloat16)
        tk, tv = (torch.randn(1, s.kv_heads, tokens, s.head_dim, device=self.device).to(torch.bfloat16) for _ in "kv")
        ours = lambda: ops.attention_prefill(q, k0, v0, table, 0, scale)  # noqa: E731
        self.row(f"attention prefill, {tokens} tokens", tokens, ours, lambda: tm_sdpa(torch, tq, tk, tv, True))

    def attention_decode(self, batch: int) -> None:
        ops, s, m, torch = self.ops, self.s, self.model, self.torch
        m.set_batch(batch)
        q = random_bf16(ops.xp, (batch, s.heads, s.head_dim), 1.0)
        tq = torch.randn(batch, s.heads, 1, s.head_dim, device=self.device).to(torch.bfloat16)
        shape = (batch, s.kv_heads, m.context + 1, s.head_dim)
        tk, tv = (torch.randn(shape, device=self.device).to(torch.bfloat16) for _ in "kv")
        args = (q, m.k_cache[0], m.v_cache[0], m.block_tables, m.context_lens, s.head_dim**-0.5)
        ours = lambda: ops.attention_decode(*args)  # noqa: E731
        self.row(
            f"attention decode, batch {batch}, context {m.context}",
            batch,
            ours,
            lambda: tm_sdpa(torch, tq, tk, tv, False),
        )

    def mla(self, tokens: int) -> None:
        """MLA prefill in the latent space (torch: SDPA with the latent rows as a shared K/V head)."""
        ops, torch, bs = self.ops, self.torch, self.s.block_size
        H, L, C = self.mla_shape["heads"], self.mla_shape["latent"], self.mla_shape["values"]
        q = random_bf16(ops.xp, (tokens, H, L), 1.0)
        cache = random_bf16(ops.xp, (-(-tokens // bs), bs, L), 1.0)
        table = ops.index(np.arange(-(-tokens // bs), dtype=np.int32))
        tq = torch.randn(1, H, tokens, L, device=self.device).to(torch.bfloat16)
        latent = torch.randn(1, 1, tokens, L, device=self.device).to(torch.bfloat16)
        tk, tv = latent.expand(1, H, tokens, L), latent[..., :C].expand(1, H, tokens, C)
        ours = lambda: ops.mla_attention_prefill(q, cache, table, 0, L**-0.5, C)  # noqa: E731
        what = f"MLA prefill ({H} heads, latent {L}, values {C}), {tokens} tokens"
        self.row(what, tokens, ours, lambda: tm_sdpa(torch, tq, tk, tv, True))

    def print(self) -> None:
        print(f"beside torch {self.torch.__version__} on {self.device} (tokens/s; the same run, the same device):")
        print("| what | ours tok/s | torch tok/s | ours / torch |\n|---|---|---|---|")
        for what, ours, theirs in self.rows:
            print(f"| {what} | {_rate(ours)} | {_rate(theirs)} | {ours / theirs:.2f} |")


def _rate(tok_s: float) -> str:
    """Tokens per second as the table prints them: whole numbers, three figures below 100 (cusim's
    rates are a few tokens a second and must not print as 0)."""
    return f"{tok_s:,.0f}" if tok_s >= 100 else f"{tok_s:.3g}"


def tm_sdpa(torch, q, k, v, causal: bool):
    """torch's scaled_dot_product_attention, GQA through enable_gqa (torch >= 2.5) or repeated K/V heads."""
    f = torch.nn.functional.scaled_dot_product_attention
    if q.shape[1] == k.shape[1]:
        return f(q, k, v, is_causal=causal)
    try:
        return f(q, k, v, is_causal=causal, enable_gqa=True)
    except TypeError:
        group = q.shape[1] // k.shape[1]
        return f(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=causal)


def comparison_table(ops, model: Model, prompts, batch: int, steps: int, tiny: bool) -> None:
    """The prefill and large-batch decode table, ours beside torch (docs/gpu.md, "Benchmark")."""
    c = Comparison(ops, model, steps, tiny)
    tm = TorchModel(model.s, c.device, max(max(prompts), model.context + 1))
    c.whole_model(tm, prompts, batch)
    for T in prompts:
        c.experts(tm, T, f"prefill {T} tokens")
    c.experts(tm, batch, f"decode batch {batch}")
    for T in prompts:
        c.attention(T)
    c.attention_decode(batch)
    del tm
    for T in prompts:
        c.mla(T)
    c.print()


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
    p.add_argument("--moe-impl", default="auto", choices=("auto", "grouped", "tc", "gathered"))
    p.add_argument(
        "--prefill",
        default=None,
        help="prompt lengths of the table beside torch (512,4096; --tiny: 24,48; '' skips it)",
    )
    p.add_argument(
        "--torch-batch", type=int, default=None, help="decode batch of the table beside torch (128; --tiny: 4)"
    )
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
    p.add_argument(
        "--count",
        action="store_true",
        help="on cusim: kernel launches, H2D copies and host syncs per decode step and layer, eager and with CUDA "
        "graphs, for a ~115M Qwen3-MoE and a DeepSeek-V3-shaped model (benchmarks/gpu_counts.py)",
    )
    args = p.parse_args(argv)
    if args.count:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from gpu_counts import main as count_main

        return count_main()

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
    prefill = ("24,48" if args.tiny else "512,4096") if args.prefill is None else args.prefill
    prompts = [int(t) for t in prefill.split(",")] if prefill else []
    torch_batch = args.torch_batch or (4 if args.tiny else 128)
    model = Model(ops, shape, args.context, max(prompts, default=0))
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
    if prompts:
        comparison_table(ops, model, prompts, torch_batch, max(args.steps, 1), args.tiny)
    if args.attention_contexts:
        del model
        attention_split_table(
            shape, (1, 8), [int(c) for c in args.attention_contexts.split(",")], max(args.steps, 1), args.moe_impl
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
