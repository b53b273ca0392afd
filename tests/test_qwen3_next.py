"""Qwen3-Next (hybrid: Gated DeltaNet + gated attention + MoE) against transformers: greedy tokens and
every step's logits, the recurrent state carried across prefill chunks, moved by COMPACT and rebuilt
after preemption, the prefix cache kept off, the config's switches and the linear-attention ops."""

import numpy as np
import pytest
import torch
from checkpoints import load_reference, reference_greedy

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.engine.executor import ShardExecutor
from eprt.model.config import ConfigError, config_from_dict, load_config
from eprt.model.kv_cache import KVCache
from eprt.model.loader import load_model
from eprt.model.recurrent_state import RecurrentState
from eprt.ops.numpy_ops import NumpyOps

PROMPTS = [[5, 77, 3, 140, 9, 9, 31, 200, 17, 64, 2, 250, 11], [8, 19], [200, 100, 50, 25, 12, 6, 3]]
STEPS = 8


def executor(path, max_slots=8):
    return ShardExecutor(load_model(path, NumpyOps(), max_len=512).model, 64, 4, max_slots, prefix_cache=False)


def eprt_greedy(path, prompts, steps, chunk=0):
    """Prefill each prompt (in chunks of ``chunk`` tokens; 0: whole), then batched decode of all of them."""
    ex = executor(path)
    logits = []
    for s, p in enumerate(prompts):
        ex.allocate(s, p)
        size = chunk or len(p)
        for start in range(0, len(p), size):
            last = ex.prefill(s, p, start, min(size, len(p) - start))
        logits.append([last[0]])
    slots = list(range(len(prompts)))
    for _ in range(steps - 1):
        step = ex.decode(slots, [int(np.argmax(rows[-1])) for rows in logits])
        for s in slots:
            logits[s].append(step[s])
    rows = np.asarray(logits)  # [P, steps, V]
    return [list(map(int, np.argmax(r, axis=-1))) for r in rows], rows


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [0, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_and_logits_match_transformers(checkpoint, dtype, chunk):
    path = checkpoint("qwen3_next", dtype=dtype)
    tokens, logits = eprt_greedy(path, PROMPTS, STEPS, chunk)
    for p, prompt in enumerate(PROMPTS):
        ref_tokens, ref_logits = reference_greedy(path, prompt, STEPS)
        assert tokens[p] == ref_tokens, (dtype, chunk, p)
        np.testing.assert_allclose(logits[p], ref_logits, atol=2e-4, rtol=0)


def test_prefill_one_token_at_a_time_carries_the_state(checkpoint):
    """Each 1-token chunk starts from the state the previous chunk left: every position's logits match."""
    path = checkpoint("qwen3_next")
    ex = executor(path)
    ex.allocate(0, PROMPTS[0])
    rows = [ex.prefill(0, PROMPTS[0], i, 1)[0] for i in range(len(PROMPTS[0]))]
    with torch.no_grad():
        ref = load_reference(path)(torch.tensor([PROMPTS[0]])).logits[0].numpy()
    np.testing.assert_allclose(np.stack(rows), ref, atol=1e-4, rtol=0)


def test_compact_moves_the_state_and_a_new_sequence_starts_from_zero(checkpoint):
    path = checkpoint("qwen3_next")
    want, _ = eprt_greedy(path, PROMPTS[:1], 4)
    ex = executor(path, max_slots=3)
    ex.allocate(2, [9, 9, 9])  # a sequence in slot 2 leaves state behind when it is released
    ex.prefill(2, [9, 9, 9], 0, 3)
    ex.release(2)
    ex.allocate(2, PROMPTS[0])  # the slot's state is zeroed for the new sequence
    tokens = [int(np.argmax(ex.prefill(2, PROMPTS[0], 0, len(PROMPTS[0]))[0]))]
    ex.compact(2, 0)  # and moves with it
    for _ in range(3):
        tokens.append(int(np.argmax(ex.decode([0], [tokens[-1]])[0])))
    assert tokens == want[0]


def test_hf_generate_matches_the_engine_with_chunked_prefill_on_and_off(checkpoint):
    """transformers' own cached generation (conv and recurrent state) against the engine, whole and chunked."""
    path = checkpoint("qwen3_next")
    prompt = PROMPTS[0] + PROMPTS[2]
    with torch.no_grad():
        out = load_reference(path).generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12, attention_mask=None
        )
    want = out[0, len(prompt) :].tolist()
    for chunk in (0, 5):
        got, _, _ = generate(path, [prompt], n=12, max_prefill_tokens=chunk)
        assert got[0] == want, chunk


def generate(path, prompts, n=6, **kw):
    cfg = EngineConfig(model=path, device="cpu", max_batch=4, block_size=4, max_model_len=96, **kw)
    with launch_engine(cfg) as engine:
        params = [SamplingParams(max_tokens=n + i % 3, ignore_eos=True) for i in range(len(prompts))]
        results = engine.generate([GenerationRequest(p, q) for p, q in zip(prompts, params)])
        return [r.token_ids for r in results], [r.cached_tokens for r in results], engine.stats()


@pytest.mark.slow
def test_chunked_prefill_compaction_and_preemption_keep_outputs(checkpoint):
    path = checkpoint("qwen3_next")
    system = list(range(20, 44))
    prompts = [system + [i, i + 1] for i in range(6)]  # uneven lengths finish apart: slots are compacted
    ref = [reference_greedy(path, p, 6 + i % 3)[0] for i, p in enumerate(prompts)]
    got, _, _ = generate(path, prompts, prefix_cache=True, max_prefill_tokens=7, num_blocks=400)
    assert got == ref
    small, _, stats = generate(path, prompts, n=20, prefix_cache=True, num_blocks=60)
    assert stats["preemptions"] > 0
    full, _, _ = generate(path, prompts, n=20, prefix_cache=False, num_blocks=400)
    assert small == full


def conversation(path, prefix_cache, chunk=0):
    """One engine, requests one after another: three sharing a system prompt, then two turns of a
    conversation. Returns (tokens, cached_tokens) per request and the engine's executor."""
    cfg = EngineConfig(
        model=path,
        device="cpu",
        max_batch=4,
        block_size=4,
        max_model_len=128,
        num_blocks=400,
        prefix_cache=prefix_cache,
        max_prefill_tokens=chunk,
    )
    system = list(range(20, 50))  # 30 tokens: 7 full blocks
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    out = []
    with launch_engine(cfg) as engine:
        for question in ([1, 2], [3, 4, 5], [6]):
            out.append(engine.generate([GenerationRequest(system + question, params)])[0])
        turn1 = [7, 100, 101, 102, 103, 104, 105]
        out.append(engine.generate([GenerationRequest(turn1, params)])[0])
        turn2 = turn1 + out[-1].token_ids + [106, 107, 108]
        out.append(engine.generate([GenerationRequest(turn2, params)])[0])
        return [r.token_ids for r in out], [r.cached_tokens for r in out], engine.runner.executor


@pytest.mark.parametrize("chunk", [0, 5])
def test_snapshots_serve_shared_prefixes_and_the_next_turn_with_identical_outputs(checkpoint, chunk, capfd):
    path = checkpoint("qwen3_next")
    off, off_hits, _ = conversation(path, prefix_cache=False, chunk=chunk)
    on, hits, ex = conversation(path, prefix_cache=True, chunk=chunk)
    assert on == off and off_hits == [0] * 5
    # the second request finds the system prompt's KV cached but no state there: it snapshots the
    # branch point, which the third reuses; the second turn resumes from the first turn's end
    assert hits[:3] == [0, 0, 28] and hits[3] == 0
    assert hits[4] == 12  # turn 1 stored 7 prompt + 8 fed tokens: its last boundary, 12, is the turn end
    assert ex.snapshots.restored == 2 and len(ex.snapshots) >= 3
    assert "recurrent-state snapshots" in capfd.readouterr().err
    ref = reference_greedy(path, list(range(20, 50)) + [6], 9)[0]
    assert on[2] == ref


def test_snapshots_are_paid_for_in_kv_blocks(checkpoint):
    path = checkpoint("qwen3_next")
    model = load_model(path, NumpyOps(), max_len=512).model
    cfg = model.cfg
    ex = ShardExecutor(model, 100, 4, 3, prefix_cache=True)
    per_block, per_row = KVCache.bytes_per_block(cfg, 4, 4), RecurrentState.bytes_per_slot(cfg)
    reserved = 100 - ex.blocks.num_blocks
    assert ex.snapshots.rows == 3 and ex.state.conv_snapshots[0].shape[0] == 3
    assert (reserved - 1) * per_block < 3 * per_row <= reserved * per_block
    assert ex.kv.k[1].shape[0] == ex.blocks.num_blocks and ex.pool_blocks == 100
    tiny = ShardExecutor(model, 8, 4, 3, prefix_cache=True)  # a quarter of 8 blocks holds no snapshot
    assert tiny.snapshots is None and not tiny.blocks.enabled and tiny.blocks.num_blocks == 8


def test_decode_ckpt_is_checked_against_the_slot(checkpoint):
    from eprt.comm.slots import SlotError
    from eprt.engine.executor import ExecutorError

    path = checkpoint("qwen3_next")
    ex = ShardExecutor(load_model(path, NumpyOps(), max_len=512).model, 100, 4, 3, prefix_cache=True)
    prompt = list(range(30, 39))
    ex.allocate(0, prompt)
    ex.prefill(0, prompt, 0, 8)
    tokens, end_block, session, adapter = ex.checkpoint_words(0)
    assert (tokens, end_block, adapter) == (8, 2, 2**64 - 1)
    with pytest.raises(SlotError, match="snapshot of 4 tokens, but the slot holds 8"):
        ex.checkpoint(0, 4, 1, session, adapter)
    with pytest.raises(SlotError, match="end block 3 / adapter"):
        ex.checkpoint(0, 8, 3, session, adapter)
    with pytest.raises(ExecutorError, match="snapshot diverged on slot 0"):
        ex.checkpoint(0, 8, 2, session ^ 1, adapter)
    assert len(ex.snapshots) == 0
    ex.checkpoint(0, 8, 2, session, adapter)
    assert len(ex.snapshots) == 1
    ex.prefill(0, prompt, 8, 1)
    ex.release(0)
    assert ex.allocate(1, prompt[:8] + [5, 6]) == 8  # the hit ends at the snapshot
    np.testing.assert_array_equal(ex.state.delta[0][1], ex.state.delta_snapshots[0][0])
    plain = executor(checkpoint("qwen3_moe"))
    plain.allocate(0, prompt)
    with pytest.raises(ExecutorError, match="keeps no recurrent-state snapshots \\(qwen3_moe has no recurrent"):
        plain.checkpoint(0, 8, 2, 0, adapter)


def test_config_layer_types_and_state_sizes(checkpoint):
    cfg = load_config(checkpoint("qwen3_next"))
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2 and cfg.is_hybrid
    la = cfg.linear_attention
    assert (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel) == (
        2,
        4,
        16,
        12,
        4,
    )
    assert cfg.rotary_dim == 4 and cfg.attention_output_gate and cfg.norm_unit_offset
    assert cfg.sparse_layers == (True, False, True, True) and cfg.shared_expert_gated
    assert cfg.kv_values_per_token() == 2 * 2 * 2 * 16  # two attention layers of K and V
    conv, delta = (la.conv_kernel - 1) * (2 * 2 * 16 + 4 * 12), 4 * 16 * 12
    assert RecurrentState.bytes_per_slot(cfg) == 2 * (conv + delta) * 4
    ex = executor(checkpoint("qwen3_next"), max_slots=5)
    assert ex.kv.k[0] is None and ex.kv.k[1] is not None
    assert ex.kv.allocated_bytes_per_token == KVCache.bytes_per_token(cfg, 4)
    assert ex.state.conv[0].shape == (5, 3, 112) and ex.state.delta[2].shape == (5, 4, 16, 12)
    assert ex.state.conv[1] is None


QN = {
    "model_type": "qwen3_next",
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
}


def test_released_config_defaults():
    """No layer_types: every 4th layer full attention; no partial_rotary_factor: 0.25; conv kernel 4."""
    cfg = config_from_dict(QN)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [3, 7]
    assert cfg.rotary_dim == 4 and cfg.linear_attention.conv_kernel == 4
    assert config_from_dict({**QN, "full_attention_interval": 2}).layer_types[:2] == (
        "linear_attention",
        "full_attention",
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"linear_num_value_heads": 3}, "linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"),
        ({"layer_types": ["full_attention"] * 3}, "'layer_types' must list num_hidden_layers=8 entries"),
        ({"layer_types": ["mamba"] * 8}, "full_attention or linear_attention"),
        ({"linear_conv_kernel_dim": 1}, "'linear_conv_kernel_dim' must be >= 2, got 1"),
        ({"attention_bias": True}, "attention_bias=true is not supported for qwen3_next"),
        ({"linear_key_head_dim": None}, "config.json has no 'linear_key_head_dim'"),
    ],
)
def test_bad_qwen3_next_configs_name_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({**QN, **change})


def test_a_backend_without_the_linear_attention_ops_is_refused_at_load(checkpoint):
    from eprt.ops.base import Ops

    partial = type("NoDeltaStep", (NumpyOps,), {"gated_delta_rule_step": Ops.gated_delta_rule_step})()
    with pytest.raises(NotImplementedError, match="does not implement gated_delta_rule_step needed by qwen3_next"):
        load_model(checkpoint("qwen3_next"), partial, 64)


def test_snapshot_index_keeps_branches_and_the_last_turn():
    from eprt.cache.snapshots import SnapshotIndex, prefill_points

    assert prefill_points(cached=0, prompt_len=30, cached_prefix=28, block_size=4) == (28,)
    assert prefill_points(cached=0, prompt_len=31, cached_prefix=8, block_size=4) == (8, 28)
    assert prefill_points(cached=28, prompt_len=31, cached_prefix=28, block_size=4) == ()
    index = SnapshotIndex(3)
    assert index.save(b"branch") == 0 and index.save(b"turn-a", owner=1) == 1
    assert index.save(b"turn-b", owner=1) == 1  # replaces the sequence's previous turn end
    assert b"turn-a" not in index and index.usable_blocks([b"x", b"branch", b"y"]) == 2
    assert index.lookup(b"turn-b") == 1
    index.save(b"turn-c", owner=1)  # turn-b was used by a hit: it stays, shared
    assert b"turn-b" in index and index.save(b"other") in (0, 1, 2) and index.evicted == 1
    assert b"branch" not in index  # the least recently used went


# ---- the ops: chunked against recurrent forms ---------------------------------------------------------
def _delta_inputs(rng, T, Hk=2, Hv=4, dk=8, dv=6):
    q, k = (rng.normal(size=(T, Hk, dk)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(T, Hv, dv)).astype(np.float32)
    g = -rng.uniform(0.0, 0.5, size=(T, Hv)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=(T, Hv)).astype(np.float32)
    return q, k, v, g, beta


@pytest.mark.parametrize("T", [1, 7, 64, 150])
def test_chunked_delta_rule_equals_the_recurrence_from_a_nonzero_state(T):
    ops, rng = NumpyOps(), np.random.default_rng(T)
    q, k, v, g, beta = _delta_inputs(rng, T)
    start = rng.normal(size=(3, 4, 8, 6)).astype(np.float32)
    chunked, stepped = start.copy(), start.copy()
    out = ops.gated_delta_rule_chunked(q, k, v, g, beta, chunked, 1)  # [T, Hv, dv]
    rows = [
        ops.gated_delta_rule_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], stepped, [1])
        for t in range(T)
    ]
    np.testing.assert_allclose(out, np.concatenate(rows), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(chunked, stepped, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(chunked[[0, 2]], start[[0, 2]])  # other slots untouched


def test_causal_conv_chunks_and_steps_agree_with_torch():
    ops, rng = NumpyOps(), np.random.default_rng(0)
    T, C, K = 9, 5, 4
    x = rng.normal(size=(T, C)).astype(np.float32)
    w = rng.normal(size=(C, K)).astype(np.float32)
    conv = torch.nn.functional.conv1d(torch.tensor(x.T[None]), torch.tensor(w[:, None]), padding=K - 1, groups=C)
    want = torch.nn.functional.silu(conv[0, :, :T]).numpy().T  # [T, C]
    state = np.zeros((2, K - 1, C), dtype=np.float32)
    first = ops.causal_conv1d(x[:4], w, state, 1)
    rest = [ops.causal_conv1d_update(x[t : t + 1], w, state, np.asarray([1])) for t in range(4, T)]
    np.testing.assert_allclose(np.concatenate([first, *rest]), want, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(state[1], x[T - (K - 1) :])
    assert not state[0].any()
