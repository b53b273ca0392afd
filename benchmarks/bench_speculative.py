"""Speculative decoding: decode tokens/s and mean accepted length, off vs ngram (vs mtp), batch 1 and 8.

    python benchmarks/bench_speculative.py [--model DIR | --bench-model DIR | --mtp-model DIR [--mtp-echo]]
        [--new-tokens 96] [--k 4]

One checkpoint, on the CPU, one rank: the built-in model (3.7 MB: a step costs its Python and
per-token compute, so verifying K + 1 positions costs several decode steps), --model DIR, or
--bench-model DIR, bench_decode_cpu.py's ~115M-parameter Qwen3-MoE with random weights (built
once), where a step at small batch is bound by reading the weights, as on a serving GPU. A
prompt without a tokenizer is the text's bytes. Two workloads:
- rewrite: the prompt holds a text twice and the start of a third copy; greedy (lookup pays
  when the model repeats what it has seen);
- sampled: a short code prompt sampled at temperature 1.0 (drafts are proposed, rarely accepted:
  lookup does not pay, the verify step must not cost more than it saves).
A checkpoint with an MTP layer (num_nextn_predict_layers and its tensors) gets an mtp column too:
--mtp-model DIR builds (once) tests/checkpoints.py's tiny deepseek_v3 with a random MTP layer,
whose drafts are rarely accepted, or with --mtp-echo the one whose MTP layer drafts what the model
decodes (an upper bound on acceptance, not a real model's), with --mtp-layers N layers of which
all but the first add nothing (so the MTP layer costs 1 / N of the model, as in a deep one).
Decode tokens/s: the tokens after each request's first, over the time from the batch's first
first token to its last token (streamed timestamps), best of --repeats. Mean accepted length:
tokens emitted per row with drafts (accepted drafts + 1), from the engine's counters.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from eprt.api import GenerationRequest, SamplingParams
from eprt.comm.transport import LocalTransport
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.model.config import load_config
from eprt.model.safetensors_io import SafetensorsCheckpoint

TEXT = (
    "Return a new list containing all items from the iterable in ascending order. A custom key function "
    "can be supplied to customize the sort order, and the reverse flag can be set to request the result "
    "in descending order."
)
WORKLOADS = {
    "rewrite": (f"{TEXT}\n\n{TEXT}\n\n{TEXT[:40]}", 0.0),
    "sampled": ('def parse_args(argv):\n    """', 1.0),
}


def measure(engine, prompt: list, batch: int, n: int, temperature: float, repeats: int) -> tuple[float, float]:
    """(decode tokens/s, mean accepted length of these runs' verify steps): every token after a
    request's first, over the time from the batch's first first-token to its last token; best of
    ``repeats`` runs."""
    runner = engine.runner
    rows0, acc0 = runner.verify_rows, runner.accepted_tokens
    best = 0.0
    for _ in range(repeats):
        stamps: list[list[float]] = [[] for _ in range(batch)]
        reqs = [
            GenerationRequest(
                prompt,
                SamplingParams(max_tokens=n, temperature=temperature, seed=i, ignore_eos=True),
                stream=True,
                on_token=lambda _t, s=stamps[i]: s.append(time.perf_counter()),
            )
            for i in range(batch)
        ]
        engine.generate(reqs)
        tokens = sum(len(s) - 1 for s in stamps)
        best = max(best, tokens / (max(s[-1] for s in stamps) - min(s[0] for s in stamps)))
    rows, acc = runner.verify_rows - rows0, runner.accepted_tokens - acc0
    return best, (rows + acc) / rows if rows else 0.0


def has_mtp(model_dir: str | None) -> bool:
    """Whether the checkpoint holds an MTP layer --speculative-method mtp can load."""
    if model_dir is None:
        return False
    cfg = load_config(model_dir)
    return cfg.mtp_layers > 0 and f"model.layers.{cfg.num_layers}.eh_proj.weight" in SafetensorsCheckpoint(model_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    ap.add_argument("--bench-model", default=None, metavar="DIR", help="build/use bench_decode_cpu.py's model here")
    ap.add_argument("--mtp-model", default=None, metavar="DIR", help="build/use a tiny deepseek_v3 with an MTP layer")
    ap.add_argument("--mtp-echo", action="store_true", help="--mtp-model: the MTP layer drafts what the model decodes")
    ap.add_argument("--mtp-layers", type=int, default=1, help="--mtp-echo: the model's layers (the MTP layer is 1)")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.bench_model:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_decode_cpu import BENCH_MODEL
        from checkpoints import build_checkpoint

        args.model = build_checkpoint("qwen3_moe", args.bench_model, **BENCH_MODEL)
    if args.mtp_model:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from checkpoints import build_mtp_checkpoint

        args.model = build_mtp_checkpoint(args.mtp_model, echo=args.mtp_echo, echo_layers=args.mtp_layers)
    methods = ("ngram", "mtp") if has_mtp(args.model) else ("ngram",)
    results = {}
    for method in (None, *methods):
        cfg = EngineConfig(
            model=args.model,
            device="cpu",
            max_batch=8,
            max_model_len=1024,
            prefix_cache=False,
            speculative_method=method,
            num_speculative_tokens=args.k,
        )
        with launch_engine(cfg, transport=LocalTransport()) as engine:
            for name, (text, temperature) in WORKLOADS.items():
                tok = engine.tokenizer
                prompt = tok.encode(text) if tok is not None else [3 + b for b in text.encode()]
                for batch in (1, 8):
                    results[method, name, batch] = measure(
                        engine, prompt, batch, args.new_tokens, temperature, args.repeats
                    )
    head = "".join(f" {m + ' tok/s':>12} {'speedup':>8} {'acc len':>8}" for m in methods)
    print(f"{'workload':<9} {'batch':>5} {'off tok/s':>10}{head}")
    for name in WORKLOADS:
        for batch in (1, 8):
            off, _ = results[None, name, batch]
            cells = ""
            for m in methods:
                on, length = results[m, name, batch]
                cells += f" {on:>12.1f} {on / off:>7.2f}x {length:>8.2f}"
            print(f"{name:<9} {batch:>5} {off:>10.1f}{cells}")


if __name__ == "__main__":
    main()
