"""Time to first token of a conversation's second turn on a hybrid (qwen3_next) model, with
recurrent-state snapshots (the prefix cache) on and off, one run each.

    python benchmarks/bench_hybrid_snapshots.py [--dir /tmp/eprt-bench-hybrid] [--prompt 1024]

Turn 1: a ``--prompt``-token prompt, 16 new tokens. Turn 2: turn 1's prompt and answer plus 16
new tokens; its time to first token is the wall time of a 1-token generation. Reports that time,
the prompt tokens turn 2 computed and its cached tokens. Checkpoint: a random 8-layer qwen3_next
(hidden 256, 6 Gated DeltaNet + 2 gated attention layers, 16 experts), built once with transformers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

MODEL = dict(
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=256,
    mlp_only_layers=[],
    full_attention_interval=4,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    max_position_embeddings=4096,
)


def second_turn(path: str, prompt_len: int, cache: bool) -> dict:
    from eprt.api import GenerationRequest, SamplingParams
    from eprt.engine.engine import EngineConfig, launch_engine

    turn1 = [(13 * j) % 4000 + 3 for j in range(prompt_len)]
    cfg = EngineConfig(model=path, device="cpu", max_batch=4, max_model_len=prompt_len + 64, prefix_cache=cache)
    with launch_engine(cfg) as engine:
        answer = engine.generate([GenerationRequest(turn1, SamplingParams(max_tokens=16, ignore_eos=True))])[0]
        turn2 = turn1 + answer.token_ids + [(7 * j) % 4000 + 3 for j in range(16)]
        before = engine.stats()["prompt_tokens_computed"]
        t = time.perf_counter()
        first = engine.generate([GenerationRequest(turn2, SamplingParams(max_tokens=1, ignore_eos=True))])[0]
        ttft = time.perf_counter() - t
        computed = engine.stats()["prompt_tokens_computed"] - before
    return {"ttft_s": ttft, "computed": computed, "cached": first.cached_tokens, "token": first.token_ids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/eprt-bench-hybrid")
    ap.add_argument("--prompt", type=int, default=1024)
    args = ap.parse_args()
    from checkpoints import build_checkpoint

    path = build_checkpoint("qwen3_next", os.path.join(args.dir, "qwen3_next-bench"), **MODEL)
    on, off = second_turn(path, args.prompt, True), second_turn(path, args.prompt, False)
    assert on["token"] == off["token"], "snapshots changed the output"
    for name, r in (("snapshots on ", on), ("snapshots off", off)):
        print(
            f"{name}: second-turn TTFT {r['ttft_s'] * 1e3:8.1f} ms, computed {r['computed']:5d}, cached {r['cached']}"
        )
    print(f"speed-up {off['ttft_s'] / on['ttft_s']:.1f}x")


if __name__ == "__main__":
    main()
