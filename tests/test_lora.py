"""Multi-LoRA serving: PEFT adapters against transformers + peft merged, batched LoRA ops,
the LoRA frames, slots and the prefix cache keyed by adapter (docs/lora.md)."""

import json
import os

import numpy as np
import pytest
from checkpoints import reference_greedy
from lora_adapters import peft_adapter, per_expert_adapter

from eprt.api import GenerationRequest, SamplingParams
from eprt.comm import protocol as P
from eprt.engine.adapters import UnknownAdapter
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.engine.executor import ShardExecutor
from eprt.model.loader import load_model
from eprt.model.lora import LoraError, LoraSlots
from eprt.ops import lora_ops
from eprt.ops.numpy_ops import NumpyOps

PROMPT = [5, 77, 3, 140, 9, 9, 31, 200, 17, 64, 12, 250, 11]
STEPS = 10
ATTENTION = dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
EXPERTS = dict(  # peft's target_parameters on the fused experts, ranks and alphas by pattern
    r=4,
    lora_alpha=8,
    target_modules=["q_proj", "o_proj"],
    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    rank_pattern={"down_proj": 2},
    alpha_pattern={"down_proj": 6},
)


@pytest.fixture(scope="module")
def qwen(checkpoint, ckpt_root):
    """(base, {name: (adapter dir, merged dir)}) for qwen3_moe: attention-only r=8, experts r=4/2."""
    base = checkpoint("qwen3_moe")
    return base, {
        "attn": peft_adapter(base, os.path.join(ckpt_root, "lora-qwen3-attn"), seed=2, **ATTENTION),
        "experts": peft_adapter(base, os.path.join(ckpt_root, "lora-qwen3-experts"), seed=1, **EXPERTS),
    }


def generate(base, adapters: dict, requests: list, **kw) -> list:
    """eprt's greedy tokens of (adapter name or None, prompt) requests, all submitted at once."""
    modules = tuple((name, paths[0]) for name, paths in adapters.items())
    cfg = EngineConfig(model=base, device="cpu", max_batch=8, block_size=4, max_model_len=96, lora_modules=modules)
    for k, v in kw.items():
        setattr(cfg, k, v)
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    with launch_engine(cfg) as engine:
        return [r.token_ids for r in engine.generate([GenerationRequest(p, params, adapter=a) for a, p in requests])]


def test_mixed_batch_of_base_and_two_adapters_matches_peft_merged(qwen):
    """One batch: the base model, an attention-only adapter (rank 8) and one with experts (ranks
    4 and 2); every row follows its own reference, transformers with the adapter merged."""
    base, adapters = qwen
    got = generate(base, adapters, [(None, PROMPT), ("attn", PROMPT), ("experts", PROMPT), ("attn", PROMPT[:5])])
    refs = [base, adapters["attn"][1], adapters["experts"][1], adapters["attn"][1]]
    prompts = [PROMPT, PROMPT, PROMPT, PROMPT[:5]]
    want = [reference_greedy(ref, p, STEPS)[0] for ref, p in zip(refs, prompts)]
    assert got == want
    assert len({tuple(t) for t in got[:3]}) == 3  # the adapters do change the output


def test_one_lora_slot_serves_two_adapters_by_eviction(qwen):
    base, adapters = qwen
    got = generate(base, adapters, [("experts", PROMPT), ("attn", PROMPT), ("experts", PROMPT[:6])], max_loras=1)
    assert got[0] == reference_greedy(adapters["experts"][1], PROMPT, STEPS)[0]
    assert got[1] == reference_greedy(adapters["attn"][1], PROMPT, STEPS)[0]
    assert got[2] == reference_greedy(adapters["experts"][1], PROMPT[:6], STEPS)[0]


def test_per_expert_modules_with_rank_pattern_match_the_merged_model(checkpoint, ckpt_root):
    """Mixtral's per-expert modules (w1/w3/w2), expert ranks 4 and 2 by rank_pattern, and q_proj."""
    base = checkpoint("mixtral")
    adapter, merged = per_expert_adapter(base, os.path.join(ckpt_root, "lora-mixtral-experts"), ("w1", "w3", "w2"))
    got = generate(base, {"e": (adapter, merged)}, [("e", PROMPT), (None, PROMPT)])
    assert got[0] == reference_greedy(merged, PROMPT, STEPS)[0]
    assert got[1] == reference_greedy(base, PROMPT, STEPS)[0]
    assert got[0] != got[1]


def test_unknown_adapter_is_refused_at_submit_and_others_finish(qwen):
    base, adapters = qwen
    cfg = EngineConfig(model=base, device="cpu", max_batch=4, block_size=4, max_model_len=64, enable_lora=True)
    with launch_engine(cfg) as engine:
        ok = engine.submit(GenerationRequest(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True)))
        with pytest.raises(UnknownAdapter, match="'nope' is neither the base model nor a loaded LoRA adapter"):
            engine.submit(GenerationRequest(PROMPT, SamplingParams(max_tokens=4), adapter="nope"))
        engine.load_adapter("attn", adapters["attn"][0])
        late = engine.submit(GenerationRequest(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True), adapter="attn"))
        while not (ok.done() and late.done()):
            engine.step()
        assert ok.result(timeout=1).finish_reason == "length"
        assert late.result(timeout=1).token_ids == reference_greedy(adapters["attn"][1], PROMPT, 4)[0]
        engine.unload_adapter("attn")
        assert engine.adapter_names() == []
        with pytest.raises(UnknownAdapter):
            engine.submit(GenerationRequest(PROMPT, SamplingParams(max_tokens=4), adapter="attn"))
        assert 1 in engine.runner.executor.lora.ids  # its LoRA slot empties at the next planning step
        engine.generate([GenerationRequest(PROMPT, SamplingParams(max_tokens=2))])
        assert engine.runner.executor.lora.ids == [-1] * 4


def _executor(path, max_loras=2, max_rank=8):
    lm = load_model(path, NumpyOps(), 128)
    lora = LoraSlots(lm.model.ops, lm.config, max_loras, max_rank, 0, lm.config.num_experts)
    return ShardExecutor(lm.model, 64, 4, 4, prefix_cache=True, lora=lora)


def test_prefix_cache_never_shares_blocks_across_adapters(qwen):
    base, adapters = qwen
    ex = _executor(base)
    ex.adapters.load(0, 1, adapters["attn"][0])
    ex.adapters.load(1, 2, adapters["experts"][0])
    assert ex.allocate(0, PROMPT, adapter=1) == 0
    ex.prefill(0, PROMPT, 0, len(PROMPT))
    ex.release(0)
    assert ex.allocate(0, PROMPT, adapter=2) == 0  # another adapter: no hit
    assert ex.allocate(1, PROMPT, adapter=-1) == 0  # nor the base model
    assert ex.allocate(2, PROMPT, adapter=1) == 12  # the same adapter: its three full blocks


def test_a_lora_slot_in_use_cannot_be_replaced(qwen):
    base, adapters = qwen
    ex = _executor(base)
    ex.adapters.load(0, 1, adapters["attn"][0])
    ex.allocate(0, PROMPT, adapter=1)
    with pytest.raises(P.ProtocolError, match="LoRA slot 0 holds adapter 1, in use by slot"):
        ex.adapters.load(0, 2, adapters["experts"][0])
    with pytest.raises(P.ProtocolError, match="LoRA slot 1 holds no adapter"):
        ex.adapters.set_slot(1, 1)


def test_adapter_rank_above_the_limit_and_unsupported_targets_are_named(qwen, tmp_path):
    base, adapters = qwen
    lm = load_model(base, NumpyOps(), 64)
    with pytest.raises(LoraError, match="has rank 8, above --max-lora-rank 4"):
        LoraSlots(lm.model.ops, lm.config, 1, 4, 0, 6).read(adapters["attn"][0])
    from safetensors.numpy import save_file

    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2}))
    key = "base_model.model.model.embed_tokens"
    save_file(
        {f"{key}.lora_A.weight": np.zeros((2, 256), np.float32), f"{key}.lora_B.weight": np.zeros((64, 2), np.float32)},
        str(tmp_path / "adapter_model.safetensors"),
    )
    with pytest.raises(LoraError, match="'model.embed_tokens': eprt applies LoRA to"):
        LoraSlots(lm.model.ops, lm.config, 1, 4, 0, 6).read(str(tmp_path))


def test_experts_adapters_are_refused_at_load_under_eplb(qwen):
    """EPLB puts the experts on physical slots that expert LoRA does not follow: refused at load,
    while an attention adapter still loads."""
    base, adapters = qwen
    lm = load_model(base, NumpyOps(), 64)
    slots = LoraSlots(lm.model.ops, lm.config, 1, 8, 0, 6, routed_experts=False)
    with pytest.raises(LoraError, match="targets the routed experts, which EPLB places"):
        slots.read(adapters["experts"][0])
    slots.read(adapters["attn"][0])


def test_each_rank_keeps_only_its_experts_factors(qwen):
    base, adapters = qwen
    lm = load_model(base, NumpyOps(), 64)
    full = LoraSlots(lm.model.ops, lm.config, 1, 8, 0, 6).read(adapters["experts"][0])
    part = LoraSlots(lm.model.ops, lm.config, 1, 8, 2, 4).read(adapters["experts"][0])
    for key, f in full.targets.items():
        if key[1].startswith("experts"):
            assert part.targets[key].a.shape[0] == 2
            np.testing.assert_array_equal(part.targets[key].a, f.a[2:4])
            np.testing.assert_array_equal(part.targets[key].b, f.b[2:4])


def test_lora_apply_equals_a_per_row_loop():
    rng = np.random.default_rng(0)
    S, R, K, N, T = 3, 4, 16, 12, 9
    a, b = rng.normal(size=(S, R, K)).astype(np.float32), rng.normal(size=(S, R, N)).astype(np.float32)
    x, y = rng.normal(size=(T, K)).astype(np.float32), rng.normal(size=(T, N)).astype(np.float32)
    slots = np.array([2, -1, 0, 2, 1, -1, 0, 0, 2], np.int32)
    want = y.copy()
    for t, s in enumerate(slots):
        if s >= 0:
            want[t] += b[s].T @ (a[s] @ x[t])
    rows = lora_ops.LoraRows.group(slots)
    np.testing.assert_allclose(lora_ops.lora_apply(y.copy(), x, a, b, rows), want, rtol=1e-5, atol=1e-5)
    assert lora_ops.LoraRows.group(np.full(T, -1)) is None  # no adapter: the base path


def test_lora_frames_round_trip_and_other_frames_are_unchanged():
    cmds = [
        P.LoraLoad(3, (1 << 40) + 7, "/adapters/é-ü/lora"),
        P.SlotAdapter(2, 3),
        P.Prefill(2, 0, 3, (5, 6, 7)),
        P.LoraUnload(3),
    ]
    words = np.concatenate([P.encode(c) for c in cmds])
    assert P.decode_all(words, max_slots=4, vocab_size=256) == cmds
    assert P.encode(P.Prefill(2, 0, 3, (5, 6, 7))).tolist() == [2, P.PREFILL, 3, 0, 3, 5, 6, 7, 0]
    with pytest.raises(P.ProtocolError, match="LORA_LOAD path of 0 bytes"):
        P.encode(P.LoraLoad(0, 1, ""))


def test_cli_generate_and_run_pick_adapters(qwen, tmp_path):
    """eprt generate --lora-modules attn=DIR --adapter attn, and eprt run lines with a model key
    (the base model's name, an adapter, an unknown one: a line error, the others unaffected)."""
    import subprocess
    import sys

    base, adapters = qwen
    common = ["--model", base, "--device", "cpu", "--lora-modules", f"attn={adapters['attn'][0]}"]
    cmd = [sys.executable, "-m", "eprt.cli", "generate", *common, "--adapter", "attn", "--json", "--ignore-eos"]
    cmd += ["--max-tokens", "6", "--prompt-ids", ",".join(map(str, PROMPT))]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    assert json.loads(out)["token_ids"] == reference_greedy(adapters["attn"][1], PROMPT, 6)[0]
    lines = [
        {"id": "a", "prompt_ids": PROMPT, "max_tokens": 6, "model": "attn"},
        {"id": "b", "prompt_ids": PROMPT, "max_tokens": 6, "model": os.path.basename(base)},
        {"id": "c", "prompt_ids": PROMPT, "max_tokens": 6, "model": "nope"},
    ]
    inp, res = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cmd = [sys.executable, "-m", "eprt.cli", "run", *common, "--input", str(inp), "--output", str(res)]
    subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    records = {r["id"]: r for r in map(json.loads, res.read_text().splitlines()) if "id" in r}
    eos = 2
    for rid, ref in (("a", adapters["attn"][1]), ("b", base)):
        want = reference_greedy(ref, PROMPT, 6)[0]
        want = want[: want.index(eos) + 1] if eos in want else want
        assert records[rid]["token_ids"] == want, rid
    assert "'nope' is neither the base model nor a loaded LoRA adapter" in records["c"]["error"]
