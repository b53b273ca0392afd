"""DeepSeek's multi-token prediction layer (--speculative-method mtp) on one rank: its forward
against transformers' decoder layer, the drafts of VERIFY_MTP, greedy and sampled outputs against
plain decoding, and the start-up errors of a checkpoint without MTP layers."""

import json
import os
import shutil

import numpy as np
import pytest
from checkpoints import build_mtp_checkpoint, load_reference

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.engine.executor import ShardExecutor
from eprt.model.loader import load_model
from eprt.model.safetensors_io import CheckpointError
from eprt.ops.numpy_ops import NumpyOps

PROMPT = [5, 77, 3, 9, 11, 200, 31, 64, 8]


@pytest.fixture(scope="session")
def mtp_checkpoint(ckpt_root):
    """mtp_checkpoint(echo=False) -> a deepseek_v3 directory with an MTP layer (tests/checkpoints.py)."""
    return lambda echo=False: build_mtp_checkpoint(
        os.path.join(ckpt_root, f"deepseek_v3-mtp{'-echo' if echo else ''}"), echo=echo
    )


def reference_mtp_logits(path: str, prompt: list, next_token: int) -> np.ndarray:
    """transformers in float32: the main model's final hidden states of ``prompt``, then the MTP
    layer as vLLM runs it (embedding of the next token, zeroed at position 0, enorm | hnorm,
    eh_proj, the decoder layer model.layers.{L} loaded by transformers as one more layer, the
    shared head): logits [P, V]."""
    import torch

    main = load_reference(path)
    L = main.config.num_hidden_layers
    extended = path + "-as-layers"
    if not os.path.isdir(extended):
        os.makedirs(extended)
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        with open(os.path.join(extended, "config.json"), "w") as f:
            json.dump({**cfg, "num_hidden_layers": L + 1}, f)
        shutil.copy(os.path.join(path, "model.safetensors"), extended)
    block = load_reference(extended).model
    from safetensors.torch import load_file

    t = {k: v.float() for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    p, eps = f"model.layers.{L}.", main.config.rms_norm_eps

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    with torch.no_grad():
        ids = torch.tensor([prompt])
        hidden = main.model(ids).last_hidden_state[0]  # [P, D] final-normed
        nxt = torch.tensor(prompt[1:] + [next_token])
        e = t["model.embed_tokens.weight"][nxt].clone()  # [P, D]
        e[0] = 0  # position 0
        x = (
            torch.cat([rms(e, t[p + "enorm.weight"]), rms(hidden, t[p + "hnorm.weight"])], -1)
            @ t[p + "eh_proj.weight"].T
        )
        P = len(prompt)
        pos = torch.arange(P)[None]
        mask = torch.full((P, P), float("-inf")).triu(1)[None, None]
        h = block.layers[L](
            x[None], attention_mask=mask, position_ids=pos, position_embeddings=block.rotary_emb(x[None], pos)
        )
        h = h[0] if isinstance(h, tuple) else h
        return (rms(h[0], t[p + "shared_head.norm.weight"]) @ t[p + "shared_head.head.weight"].T).numpy()


def test_mtp_layer_matches_transformers(mtp_checkpoint):
    path = mtp_checkpoint()
    model = load_model(path, NumpyOps(), max_len=64, mtp=True).model
    ex = ShardExecutor(model, 32, 4, 2, prefix_cache=False)
    outputs, run = [], model.mtp_hidden
    model.mtp_hidden = lambda *args: outputs.append(run(*args)) or outputs[-1]  # noqa: E731
    ex.prefill(0, PROMPT, 0, 4)  # the MTP layer over positions 0..2 (the prompt holds their next tokens)
    ex.prefill_next(0, 4, PROMPT[4:])  # 3..7, attending over the first chunk's MTP KV
    ex.verify_mtp([0], [123], [1])  # the catch-up: 8, fed the token after the prompt
    assert [len(o) for o in outputs] == [3, 5, 1]
    got = np.asarray(model.mtp_logits(np.concatenate(outputs)))
    want = reference_mtp_logits(path, PROMPT, 123)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_verify_mtp_drafts_recursively_and_rolls_back(mtp_checkpoint):
    """After a partial ACCEPT the held rows are those of the kept positions only, and the next
    drafts equal those of an executor that decoded the kept tokens one by one (whose catch-up
    pass then covers one more position): the rejected positions' MTP KV is overwritten."""
    model = load_model(mtp_checkpoint(), NumpyOps(), max_len=64, mtp=True).model
    a, b = (ShardExecutor(model, 32, 4, 2, prefix_cache=False) for _ in range(2))
    for ex in (a, b):
        ex.prefill(0, PROMPT, 0, len(PROMPT))
    drafts, logits = a.verify_mtp([0], [40], [3])
    assert len(drafts[0]) == 3 and logits.shape == (4, 256)
    a.accept([0], [1])  # keeps 40 and the first draft
    b.decode([0], [40])
    b.decode([0], [drafts[0][0]])
    assert a.slots.get(0).tokens == b.slots.get(0).tokens
    held_a, held_b = a.mtp_layer.held[a.slots.get(0).key], b.mtp_layer.held[b.slots.get(0).key]
    (start_a, rows_a), (start_b, rows_b) = (held_a.start, held_a.rows(a.ops)), (held_b.start, held_b.rows(b.ops))
    assert (start_a, len(rows_a), start_b, len(rows_b)) == (len(PROMPT), 2, len(PROMPT) - 1, 3)
    np.testing.assert_allclose(np.asarray(rows_a), np.asarray(rows_b[1:]), atol=1e-5)
    da, _ = a.verify_mtp([0], [7], [2])
    db, _ = b.verify_mtp([0], [7], [2])
    assert da == db


def test_verify_mtp_leaves_a_row_without_drafts_its_held_rows(mtp_checkpoint):
    """A row with no drafts in a VERIFY_MTP is not caught up: its held rows grow by the step's
    position, and when it drafts, its catch-up over all of them gives the drafts of an executor
    that caught it up at every step (the same MTP KV, computed later)."""
    model = load_model(mtp_checkpoint(), NumpyOps(), max_len=64, mtp=True).model
    a, b = (ShardExecutor(model, 32, 4, 2, prefix_cache=False) for _ in range(2))
    other = [11, 12, 13, 14, 11, 12, 13]
    for ex in (a, b):
        ex.prefill(0, PROMPT, 0, len(PROMPT))
        ex.prefill(1, other, 0, len(other))
    assert (a.mtp_layer.caught_up, b.mtp_layer.caught_up) == ((0, 0), (0, 0))
    for tokens in ([40, 50], [41, 51], [42, 52]):
        da, _ = a.verify_mtp([0, 1], tokens, [1, 0])  # row 1 never drafts here
        db, _ = b.verify_mtp([0, 1], tokens, [1, 1])
        assert da[0] == db[0] and da[1] == ()
        # (rows, positions): one position each
        assert (a.mtp_layer.caught_up, b.mtp_layer.caught_up) == ((1, 1), (2, 2))
        a.accept([0, 1], [0, 0])
        b.accept([0, 1], [0, 0])
    held = a.mtp_layer.held[a.slots.get(1).key]
    assert (held.start, held.end, len(held.chunks)) == (len(other) - 1, len(other) + 3, 4)  # the pieces, not joined
    da, _ = a.verify_mtp([0, 1], [43, 53], [2, 3])
    db, _ = b.verify_mtp([0, 1], [43, 53], [2, 3])
    assert da == db and a.mtp_layer.caught_up == (2, 1 + 4)  # row 1: the prompt's last position and 3 steps'


def engine_config(path, mtp: bool, **kw):
    kw = dict(dict(max_batch=8, block_size=4, max_model_len=96), **kw)
    k = kw.pop("k", 3)
    return EngineConfig(
        model=path, device="cpu", speculative_method="mtp" if mtp else None, num_speculative_tokens=k, **kw
    )


PROMPTS = [PROMPT, [11, 12, 13, 14, 11, 12, 13], list(range(60, 80)), [3, 4]]


@pytest.mark.parametrize("echo", [False, True])
def test_greedy_mtp_equals_plain_decoding(mtp_checkpoint, echo):
    path = mtp_checkpoint(echo)
    reqs = [GenerationRequest(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in PROMPTS]
    with launch_engine(engine_config(path, False)) as engine:
        plain = engine.generate(reqs)
    with launch_engine(engine_config(path, True, k=4, max_prefill_tokens=6)) as engine:
        spec = engine.generate(reqs)
        mean = engine.runner.mean_accepted_length()
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    accepted = sum(r.accepted_tokens for r in spec)
    if echo:  # the echo layer drafts what the model decodes: most drafts are accepted
        assert accepted > len(PROMPTS) * 24 // 2 and mean > 2.5, (accepted, mean)


def test_sampled_mtp_emits_the_tokens_of_plain_sampling(mtp_checkpoint):
    """A draft is accepted iff the token drawn at its position with that position's uniform equals
    it: the same tokens as plain sampling with the same seeds (so the same distribution)."""
    path = mtp_checkpoint(echo=True)
    reqs = [
        GenerationRequest(p, SamplingParams(max_tokens=16, temperature=0.7, top_k=8, seed=i, ignore_eos=True))
        for i, p in enumerate(PROMPTS)
    ]
    with launch_engine(engine_config(path, False)) as engine:
        plain = engine.generate(reqs)
    with launch_engine(engine_config(path, True)) as engine:
        spec = engine.generate(reqs)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert sum(r.accepted_tokens for r in spec) > 0


def test_verify_mtp_on_a_rank_without_the_mtp_layer_is_refused(checkpoint):
    from eprt.engine.executor import ExecutorError

    ex = ShardExecutor(load_model(checkpoint("deepseek_v3"), NumpyOps(), max_len=64).model, 32, 4, 2)
    ex.prefill(0, PROMPT, 0, len(PROMPT))
    with pytest.raises(ExecutorError, match="VERIFY_MTP: this rank has no MTP layer"):
        ex.verify_mtp([0], [4], [2])


def test_a_checkpoint_without_mtp_layers_is_a_start_up_error(checkpoint):
    with pytest.raises(ValueError, match=r"--speculative-method mtp: .*num_nextn_predict_layers is 0"):
        load_model(checkpoint("deepseek_v2"), NumpyOps(), max_len=64, mtp=True)
    # deepseek_v3's config names one MTP layer, but transformers saves none of its tensors
    with pytest.raises(
        CheckpointError, match=r"--speculative-method mtp: .*num_nextn_predict_layers is 1.*model\.layers\.3"
    ):
        load_model(checkpoint("deepseek_v3"), NumpyOps(), max_len=64, mtp=True)
    with pytest.raises(ValueError, match="--speculative-method mtp"):
        with launch_engine(engine_config(checkpoint("qwen3_moe"), True)):
            pass


def test_worker_replaying_verify_mtp_keeps_rank_0_state_bitwise(mtp_checkpoint):
    """A worker fed rank 0's real frames (VERIFY_MTP, ACCEPT, chunked prefill, prefix hits,
    preemption) drafts the same tokens: the same KV, MTP layer included, and the same held rows."""
    from test_worker_replay import RecordingTransport, Replay

    from eprt.comm.worker import run_worker

    path = mtp_checkpoint(echo=True)
    cfg = engine_config(path, True, k=3, num_blocks=14, max_prefill_tokens=6, max_batch=3, max_model_len=48)
    system = list(range(30, 46))
    reqs = [
        GenerationRequest(system + [i, i + 1, i + 2], SamplingParams(max_tokens=14 + 3 * i, ignore_eos=True))
        for i in range(4)
    ]
    transport = RecordingTransport()
    with launch_engine(cfg, transport=transport) as engine:
        first = engine.generate(reqs[:1])
        rest = engine.generate(reqs[1:])
        rank0 = engine.runner.executor
        stats = engine.stats()
    assert any(r.cached_tokens for r in rest) and sum(r.accepted_tokens for r in first + rest) > 0
    assert stats["preemptions"] > 0
    worker = ShardExecutor(load_model(path, NumpyOps(), 48, mtp=True).model, 14, 4, 3)
    worker.compute_logits = False
    assert run_worker(Replay(transport.frames, transport.rows), worker, 3, 256) == 0
    assert len(rank0.kv.latent) == 2  # the model's layer and the MTP layer's
    for a, b in zip(rank0.kv.latent, worker.kv.latent):
        assert np.array_equal(a, b)
    assert rank0.blocks._block_of == worker.blocks._block_of
    assert rank0.mtp_layer.held.keys() == worker.mtp_layer.held.keys() == set()


def sampled_tokens(path, mtp: bool, seeds, position: int):
    params = lambda s: SamplingParams(max_tokens=position + 1, temperature=0.5, top_k=6, seed=s, ignore_eos=True)  # noqa: E731
    with launch_engine(engine_config(path, mtp, max_batch=32, max_model_len=64)) as engine:
        results = engine.generate([GenerationRequest(PROMPT, params(s)) for s in seeds])
    return [r.token_ids[position] for r in results], sum(r.accepted_tokens or 0 for r in results)


def test_sampled_mtp_tokens_follow_the_plain_distribution_chi_square(mtp_checkpoint):
    """Disjoint seed sets, so the two samples are independent: a two-sample chi-square over the
    tokens seen at output position 2 (rare tokens pooled), as for ngram in test_speculative.py; the
    first verify step's drafts cover positions 1..3."""
    from test_speculative import assert_same_distribution

    path = mtp_checkpoint(echo=True)
    off, _ = sampled_tokens(path, False, range(0, 300), 2)
    on, accepted = sampled_tokens(path, True, range(1000, 1300), 2)
    assert accepted > 0
    assert_same_distribution(off, on)


def test_generate_json_reports_mtp_accepted_tokens(mtp_checkpoint, capsys):
    from eprt import cli

    argv = ["generate", "--model", mtp_checkpoint(echo=True), "--prompt-ids", "5,6,7,8", "--max-tokens", "16"]
    argv += ["--json", "--device", "cpu", "--ignore-eos"]
    assert cli.main([*argv, "--speculative-method", "mtp", "--num-speculative-tokens", "3"]) == 0
    assert cli.main(argv) == 0
    on, off = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert on["token_ids"] == off["token_ids"] and "accepted_tokens" not in off
    assert 0 < on["accepted_tokens"] < 16
