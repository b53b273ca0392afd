"""gpt-oss on the CPU: the forward pass against transformers (bf16, float32 and MXFP4 checkpoints),
the sliding-window KV (bounded blocks, the same tokens), MXFP4 kept MXFP4, and the config's checks.
The MPI tests (every world size, both attention modes, speculation): tests/mpi/test_gptoss_mpi.py."""

import json
import os

import numpy as np
import pytest
import torch
from checkpoints import GPT_OSS, build_gptoss_checkpoint, load_reference, reference_greedy

from eprt.cache.block_manager import BlockManager
from eprt.cache.window import NULL, WindowSpec
from eprt.engine.executor import ShardExecutor
from eprt.model.config import ConfigError, config_from_dict
from eprt.model.loader import load_model
from eprt.ops.gptoss_ops import Mxfp4Weight, dequantize_mxfp4
from eprt.ops.numpy_ops import NumpyOps

WINDOW = GPT_OSS["sliding_window"]  # 8
PROMPT = [5, 77, 3, 140, 9, 9, 31, 200, 17, 64, 2, 250, 11, 40, 41, 42, 43, 44, 45, 46, 47, 48]  # > 2 windows
VARIANTS = {"bf16": dict(dtype="bfloat16"), "f32": dict(dtype="float32"), "mxfp4": dict(dtype="bfloat16", mxfp4=True)}


@pytest.fixture(scope="session")
def gptoss(ckpt_root):
    """gptoss(variant) -> checkpoint directory (built once)."""
    return lambda variant: build_gptoss_checkpoint(os.path.join(ckpt_root, f"gpt_oss-{variant}"), **VARIANTS[variant])


def executor_for(path, num_blocks=64, block_size=4, prefix_cache=False, prefill_tokens=0, max_slots=4):
    lm = load_model(path, NumpyOps(), max_len=512)
    return ShardExecutor(
        lm.model, num_blocks, block_size, max_slots, prefix_cache=prefix_cache, prefill_tokens=prefill_tokens
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers_at_every_position(gptoss, variant):
    """Token by token through the paged cache, the whole prompt at once and in chunks that cross the
    window: sinks, biases, YaRN, the window, the router and the clamped SwiGLU all as transformers."""
    path = gptoss(variant)
    with torch.no_grad():
        ref = load_reference(path)(torch.tensor([PROMPT])).logits[0].numpy()
    ex = executor_for(path)  # (chunks of any size: whole prompts reserve their window's blocks)
    ex.allocate(0, PROMPT)
    rows = [ex.prefill(0, PROMPT, i, 1)[0] for i in range(len(PROMPT))]
    np.testing.assert_allclose(np.stack(rows), ref, atol=1e-4, rtol=0)
    ex.allocate(1, PROMPT)
    np.testing.assert_allclose(ex.prefill(1, PROMPT, 0, len(PROMPT))[0], ref[-1], atol=1e-4, rtol=0)
    ex.allocate(2, PROMPT)
    for start in range(0, len(PROMPT), 7):
        last = ex.prefill(2, PROMPT, start, min(7, len(PROMPT) - start))
    np.testing.assert_allclose(last[0], ref[-1], atol=1e-4, rtol=0)


def test_mxfp4_experts_stay_mxfp4_and_dequantize_as_transformers(gptoss):
    path = gptoss("mxfp4")
    lw = load_model(path, NumpyOps(), max_len=64).model.w.layers[0]
    assert isinstance(lw.w_gate_up, Mxfp4Weight) and isinstance(lw.w_down, Mxfp4Weight)
    E, D, I = GPT_OSS["num_local_experts"], GPT_OSS["hidden_size"], GPT_OSS["intermediate_size"]
    assert lw.w_gate_up.shape == (E, 2 * I, D) and lw.w_down.shape == (E, D, I)
    bf16_bytes = 2 * 3 * E * D * I
    assert lw.w_gate_up.nbytes + lw.w_down.nbytes == bf16_bytes // 4 + bf16_bytes // 2 // 32  # nibbles + scales
    ref = load_reference(path).model.layers[0].mlp.experts
    # transformers' [E, D, 2I] with gate and up interleaved; eprt's [E, 2I, D], gate rows then up rows
    want = ref.gate_up_proj.detach().numpy().transpose(0, 2, 1)
    got = dequantize_mxfp4(lw.w_gate_up.blocks, lw.w_gate_up.scales)
    np.testing.assert_array_equal(got[:, :I], want[:, 0::2])
    np.testing.assert_array_equal(got[:, I:], want[:, 1::2])
    np.testing.assert_array_equal(
        dequantize_mxfp4(lw.w_down.blocks, lw.w_down.scales), ref.down_proj.detach().numpy().transpose(0, 2, 1)
    )


def _window_held(ex, slot):
    key = ex.slots.get(slot).key
    return sum(b != NULL for b in ex.blocks.window._tables[key])


def test_window_kv_is_bounded_for_a_4x_window_sequence_and_tokens_equal_transformers(gptoss):
    """A 4-window prompt in chunks, then decode to over 6 windows: after every step the sliding
    layers hold at most span(T) blocks (T the step's positions; with the window of 8 in blocks of 4:
    2 + 1 + ceil((T - 1) / 4)), the full layers L // 4 + 1, the pool's free count is the rest, and
    the greedy tokens are transformers'."""
    path, bs, chunk = gptoss("bf16"), 4, 6
    prompt = [(7 * i + 3) % 250 + 3 for i in range(4 * WINDOW)]  # 32 tokens
    ex = executor_for(path, num_blocks=40, block_size=bs, prefill_tokens=chunk)
    window = ex.blocks.window
    ex.allocate(0, prompt)
    spans = []
    for start in range(0, len(prompt), chunk):
        out = ex.prefill(0, prompt, start, min(chunk, len(prompt) - start))
        spans.append(_window_held(ex, 0))
        assert spans[-1] <= window.span(chunk) == 2 + 1 + 2
    tokens = [int(np.argmax(out[0]))]
    for _ in range(20):
        out = ex.decode([0], [tokens[-1]])
        tokens.append(int(np.argmax(out[0])))
        length = ex.slots.get(0).length
        assert _window_held(ex, 0) <= window.span(1) == 3
        assert len(ex.blocks.block_table(ex.slots.get(0).key)) == length // bs + 1
        assert ex.blocks.num_free_blocks() == 40 - (length // bs + 1) - window.decode_credits
    assert ex.slots.get(0).length > 6 * WINDOW
    assert tokens == reference_greedy(path, prompt, len(tokens))[0]
    ex.free(0)
    assert ex.blocks.num_free_blocks() == 40 and window.reserve == 0


def test_window_prefix_hit_copies_the_cached_window_and_gives_the_same_tokens(gptoss):
    """A second prompt sharing 24 tokens hits them: the full blocks are shared, the window's cached
    blocks (left behind by the first prompt's prefill) copied; its tokens equal a cold run's."""
    path, bs = gptoss("bf16"), 4
    shared = [(11 * i + 5) % 250 + 3 for i in range(24)]
    ex = executor_for(path, num_blocks=60, block_size=bs, prefix_cache=True, prefill_tokens=5)

    def run(slot, prompt, steps=6):
        cached = ex.allocate(slot, prompt)
        for start in range(cached, len(prompt), 5):
            out = ex.prefill(slot, prompt, start, min(5, len(prompt) - start))
        tokens = [int(np.argmax(out[0]))]
        for _ in range(steps):
            tokens.append(int(np.argmax(ex.decode([slot], [tokens[-1]])[0])))
        ex.release(slot)
        return cached, tokens

    assert run(0, shared + [1, 2, 3])[0] == 0
    cached, tokens = run(1, shared + [9, 8, 7, 6])
    assert cached == 24
    cold = executor_for(path, num_blocks=60, block_size=bs)
    cold.allocate(0, shared + [9, 8, 7, 6])
    out = cold.prefill(0, shared + [9, 8, 7, 6], 0, 28)
    want = [int(np.argmax(out[0]))]
    for _ in range(6):
        want.append(int(np.argmax(cold.decode([0], [want[-1]])[0])))
    assert tokens == want


def _window_manager(num_blocks=40, decode_tokens=1):
    return BlockManager(num_blocks, 4, window=WindowSpec(8, prefill_tokens=6, decode_tokens=decode_tokens))


def test_window_blocks_move_with_the_window_and_their_credits_keep_the_count_exact():
    bm = _window_manager()
    w = bm.window
    assert (w.reach, w.span(1), w.span(6), w.decode_credits) == (2, 3, 5, 3)
    prompt = list(range(30))
    bm.allocate("a", prompt)
    assert bm.num_free_blocks() == 40 - (30 // 4 + 1) - w.credits(30, 0)
    free = bm.num_free_blocks()
    for start in range(0, 30, 6):  # a prefill's chunks: the window's blocks come and go within its credits
        bm.grow("a", start + 6, first=start)
        assert bm.num_free_blocks() == free
    held = w._tables["a"]
    assert held[:4] == [NULL] * 4 and NULL not in held[4:]  # the last chunk's first query 24: 25 // 4 - 2 = 4
    bm.grow("a", 31, first=30)  # the first decode step: credits drop to a decode step's
    assert bm.num_free_blocks() == 40 - 8 - w.decode_credits
    for length in range(31, 80):
        crossing = (length + 1) % 4 == 0
        before = bm.num_free_blocks()
        bm.grow("a", length + 1, first=length)
        assert bm.num_free_blocks() == before - crossing  # one block per boundary, as the scheduler counts
        assert sum(b != NULL for b in w._tables["a"]) <= 3
    bm.free("a")
    assert bm.num_free_blocks() == 40 and w.reserve == 0


def test_window_rollback_fork_and_hits_are_deterministic():
    a, b = _window_manager(decode_tokens=5), _window_manager(decode_tokens=5)
    prompt = list(range(100, 126))
    for bm in (a, b):
        bm.allocate("s", prompt)
        for start in range(0, 26, 6):
            bm.grow("s", min(start + 6, 26), first=start)
        bm.grow("s", 26 + 5, first=26)  # a verify of 4 drafts
        bm.shrink("s", 28)  # two accepted
        assert bm.fork("s", "t", 28) is None  # 28 = 7 full blocks: nothing partial in the full group
        copies = bm.window.pop_copies()
        assert len(copies) == 3 and all(src != dst for src, dst in copies)  # the window's blocks 5..7 copied
        bm.cache("s", prompt + [1, 2])
        bm.free("s")
        bm.free("t")
        assert bm.allocate("u", prompt + [1, 2, 3]) == 28  # the full blocks and the cached window
        assert len(bm.window.pop_copies()) == 2  # the window of position 28: blocks 5, 6
    assert _plain(a.mirrored_state()) == _plain(b.mirrored_state())


def _plain(x):
    """A mirrored state as plain lists (its arrays compared by value)."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return [_plain(v) for v in x]
    return x.tolist() if isinstance(x, np.ndarray) else x


def test_a_hit_stops_where_the_window_was_not_cached():
    """Without the prefix cache keeping the window's blocks (another prompt evicted them) a hit stops
    where its window is still cached; here nothing of the window is: no hit."""
    bm = _window_manager(num_blocks=30)
    prompt = list(range(50, 70))
    bm.allocate("a", prompt)
    for start in range(0, 20, 6):
        bm.grow("a", min(start + 6, 20), first=start)
    bm.cache("a", prompt)
    bm.free("a")
    assert bm.match_prefix(prompt + [1]) == 20
    for h in [h for h in bm._block_of if h.endswith(b"window")]:  # forget the window's cached blocks
        del bm._key_of[bm._block_of.pop(h)]
    assert bm.match_prefix(prompt + [1]) == 0


def test_gpt_oss_config_checks_name_the_field(gptoss):
    with open(os.path.join(gptoss("bf16"), "config.json")) as f:
        raw = json.load(f)
    cfg = config_from_dict(raw)
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2 and cfg.sliding_window == WINDOW
    assert cfg.kv_tensors == 2 and cfg.swiglu.limit == 0.6 and cfg.attention_sinks and cfg.o_bias
    with pytest.raises(ConfigError, match="layer_types"):
        config_from_dict({**raw, "layer_types": ["sliding_attention", "linear_attention"] * 2})
    with pytest.raises(ConfigError, match="sliding_window"):
        config_from_dict({**raw, "sliding_window": 0})
    with pytest.raises(ConfigError, match="swiglu_limit"):
        config_from_dict({**raw, "swiglu_limit": -1})
    mx = {**raw, "model_type": "mixtral", "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(ConfigError, match="mxfp4"):
        config_from_dict(mx)


def test_mxfp4_tensors_are_checked(gptoss, tmp_path):
    """A NaN scale (e8m0 255) or blocks of the wrong shape are named with the tensor."""
    from safetensors.torch import load_file, save_file

    from eprt.model.safetensors_io import CheckpointError

    src = gptoss("mxfp4")

    def nan_scale(a):
        a[2, 0, 0] = 255
        return a.contiguous()

    for name, edit, match in (
        ("model.layers.1.mlp.experts.down_proj_scales", nan_scale, "NaN scale"),
        ("model.layers.0.mlp.experts.gate_up_proj_blocks", lambda a: a[:, :-1].contiguous(), "implies"),
    ):
        out = tmp_path / name.split(".")[-1]
        out.mkdir()
        tensors = load_file(os.path.join(src, "model.safetensors"))
        tensors[name] = edit(tensors[name].clone())
        save_file(tensors, str(out / "model.safetensors"))
        for f in ("config.json", "generation_config.json"):
            if os.path.exists(os.path.join(src, f)):
                (out / f).write_text(open(os.path.join(src, f)).read())
        with pytest.raises(CheckpointError, match=match):
            load_model(str(out), NumpyOps(), max_len=64)


@pytest.mark.parametrize("path", ["numba", "numpy"])
def test_mxfp4_experts_on_each_cpu_path_equal_the_dequantized_reference(path):
    """The compiled path decodes MXFP4 as it sums (mxfp4_cpu); NumPy's dequantizes one expert at a time;
    both equal the float32 experts of the dequantized weights, biases and clamps included."""
    from eprt.ops.numpy_ops import numba_available

    if path == "numba" and not numba_available():
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(0)
    El, D, I = 3, 64, 32
    blocks = [rng.integers(0, 256, (El, n, k // 32, 16), dtype=np.uint8) for n, k in ((2 * I, D), (D, I))]
    scales = [rng.integers(120, 126, (El, n, k // 32), dtype=np.uint8) for n, k in ((2 * I, D), (D, I))]
    x = rng.standard_normal((5, D)).astype(np.float32)
    ids = np.asarray([[3, 4], [2, 4], [3, 2], [4, 0], [2, 2]], np.int32)  # expert_start 2: 0 is another rank's
    w = rng.random((5, 2)).astype(np.float32)
    biases = (rng.standard_normal((El, 2 * I)).astype(np.float32), rng.standard_normal((El, D)).astype(np.float32))
    ops = NumpyOps(path)
    stacks = ops.mxfp4_expert_weights(blocks[0], scales[0], blocks[1], scales[1])
    got = ops.moe_experts_swiglu(x, w, ids, *stacks, *biases, 2, 1.702, 0.5)
    dense = [dequantize_mxfp4(b, s) for b, s in zip(blocks, scales)]
    want = NumpyOps("numpy").moe_experts_swiglu(x, w, ids, *dense, *biases, 2, 1.702, 0.5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want[3]).max() > 0 and not np.array_equal(want[3], want[1])  # (row 3: one local choice)
