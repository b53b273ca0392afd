"""--overlap: a decode step's sampling plan and the next step's frame are made while its forward
pass runs; tokens, logprobs and the frames the workers would see are those without it."""

import os
import threading

import numpy as np
import pytest
from lora_adapters import peft_adapter

from eprt.api import ENGINE_FAILED, GenerationRequest, SamplingParams
from eprt.comm import protocol as P
from eprt.engine.engine import EngineConfig, launch_engine

ATTENTION = dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])  # as test_lora.py
PROMPTS = [[5, 77, 3, 19], list(range(40, 71)), [8, 8], list(range(90, 150)), [140, 9, 9, 31, 200, 17]]


def mixed_params(seeded: bool) -> list:
    """Requests that end at different steps (lengths, a stop id), so rows drop out and slots compact."""
    sampled = dict(temperature=0.9, top_p=0.9, seed=7) if seeded else {}
    return [
        SamplingParams(max_tokens=9, ignore_eos=True, **sampled),
        SamplingParams(max_tokens=3, ignore_eos=True, **sampled),
        SamplingParams(max_tokens=12, stop_token_ids=(11, 12, 13), **sampled),
        SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2, **sampled),
        SamplingParams(max_tokens=10, ignore_eos=True, presence_penalty=0.5, top_k=5, **sampled),
    ]


def run(path, overlap: bool, params: list, **kw) -> tuple:
    """(tokens, logprobs, finish reasons, the frames rank 0 sent as (head, hash)) of two waves of
    requests, the second arriving while the first decodes."""
    cfg = EngineConfig(model=path, device="cpu", max_batch=4, block_size=8, max_model_len=128, overlap=overlap, **kw)
    with launch_engine(cfg) as engine:
        assert (engine.runner.overlap is not None) == overlap
        handles = [engine.submit(GenerationRequest(p, q)) for p, q in zip(PROMPTS[:3], params[:3])]
        for _ in range(3):
            engine.step()
        handles += [engine.submit(GenerationRequest(p, q)) for p, q in zip(PROMPTS[3:], params[3:])]
        while not all(h.done() for h in handles):
            engine.step()
        results = [h.result() for h in handles]
        frames = [(e["head"], e["hash"]) for e in engine.transport.recorder.ring if e["kind"] == "frame"]
    return [r.token_ids for r in results], [h.logprobs for h in handles], [r.finish_reason for r in results], frames


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v2", "glm4_moe"])
def test_greedy_tokens_and_frames_are_those_without_overlap(checkpoint, arch):
    path = checkpoint(arch)
    for kw in (dict(max_prefill_tokens=0), dict(max_prefill_tokens=16, batch_prefill=False)):
        off = run(path, False, mixed_params(seeded=False), **kw)
        on = run(path, True, mixed_params(seeded=False), **kw)
        assert on == off, (arch, kw)
        assert len({len(t) for t in on[0]}) > 2  # rows did drop out at different steps


def test_seeded_sampling_is_that_without_overlap(checkpoint):
    path = checkpoint("qwen3_moe")
    off = run(path, False, mixed_params(seeded=True))
    assert run(path, True, mixed_params(seeded=True)) == off
    assert off[1][3] is not None and len(off[1][3]) == 6  # the logprobs came with the tokens


def test_prefix_cache_hits_and_choices_are_those_without_overlap(checkpoint):
    path = checkpoint("olmoe")
    system = list(range(30, 62))

    def go(overlap):
        cfg = EngineConfig(model=path, device="cpu", max_batch=6, block_size=16, max_model_len=128, overlap=overlap)
        with launch_engine(cfg) as engine:
            first = engine.generate([GenerationRequest(system + [1], SamplingParams(max_tokens=5, ignore_eos=True))])
            second = engine.generate_choices(
                [
                    GenerationRequest(system + [2, 3], SamplingParams(max_tokens=7, ignore_eos=True)),
                    GenerationRequest([4, 5], SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=3)),
                ]
            )
        return [r.token_ids for r in first + [c for cs in second for c in cs]], second[0][0].cached_tokens

    off = go(False)
    assert go(True) == off and off[1] == 32


def test_lora_and_speculation_are_those_without_overlap(checkpoint, ckpt_root):
    base = checkpoint("qwen3_moe")
    adapter = peft_adapter(base, os.path.join(ckpt_root, "lora-qwen3-attn"), seed=2, **ATTENTION)[0]
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]

    def go(overlap, **kw):
        cfg = EngineConfig(model=base, device="cpu", max_batch=4, block_size=4, max_model_len=96, overlap=overlap, **kw)
        reqs = [
            GenerationRequest(prompt, SamplingParams(max_tokens=8, ignore_eos=True), adapter=a)
            for a in (None, "attn", None)
        ]
        with launch_engine(cfg) as engine:
            return [r.token_ids for r in engine.generate(reqs if "lora_modules" in kw else reqs[::2])]

    lora = dict(lora_modules=(("attn", adapter),))
    assert go(True, **lora) == go(False, **lora)
    spec = dict(speculative_method="ngram", num_speculative_tokens=3)
    assert go(True, **spec) == go(False, **spec)


def test_next_frame_encoded_ahead_is_the_encoders():
    slots = (0, 2, 5)
    words = P.DecodeBatchWords(slots)
    np.testing.assert_array_equal(words.fill([7, 0, 11]), P.encode(P.DecodeBatch(slots, (7, 0, 11))))
    np.testing.assert_array_equal(words.fill([1, 2, 3]), P.encode(P.DecodeBatch(slots, (1, 2, 3))))
    with pytest.raises(P.ProtocolError, match="-1 is not an unsigned 32-bit"):
        words.fill([1, -1, 3])


def test_a_failing_forward_pass_on_the_helper_thread_fails_the_requests_as_before(checkpoint):
    """(The first decode step fails: the prefill's pass is not the helper thread's.)"""
    path = checkpoint("qwen3_moe")
    cfg = EngineConfig(model=path, device="cpu", max_batch=4, max_model_len=64, overlap=True)
    with launch_engine(cfg) as engine:
        assert engine.runner.overlap.threaded

        threads = []

        def broken(inputs):
            threads.append(threading.current_thread().name)
            raise FloatingPointError("forward pass broke")

        engine.runner.executor.decode_forward = broken
        sampled = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.8, seed=1)  # planned on the thread
        handle = engine.submit(GenerationRequest([5, 6, 7], sampled))
        with pytest.raises(FloatingPointError, match="forward pass broke"):
            while not handle.done():
                engine.step()
        result = handle.result()
        assert result.finish_reason == "error" and result.error.startswith(ENGINE_FAILED)
        assert "forward pass broke" in result.error
        assert threads and threads[0].startswith("eprt-forward")


def test_the_overlap_flag_of_every_command_defaults_to_off():
    import argparse

    from eprt.engine.config import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args([])).overlap is False
    assert engine_config_from_args(parser.parse_args(["--overlap", "on"])).overlap is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--overlap", "maybe"])


def test_structured_outputs_are_those_without_overlap():
    """The masks of guided rows are computed while the pass runs; the same tokens come out."""
    import json

    from eprt.api import Guide
    from eprt.model.tokenizer import ByteTokenizer

    prompt = ByteTokenizer().encode("Here is the data: ")
    guides = [Guide("regex", r"[0-9]{3}-[a-z]{2}"), Guide("choice", json.dumps(["yes", "no", "maybe"])), None]

    def go(overlap):
        reqs = [
            GenerationRequest(prompt, SamplingParams(max_tokens=16, temperature=t, seed=s, guide=g))
            for g in guides
            for t, s in ((0.0, None), (0.8, 1))
        ]
        with launch_engine(EngineConfig(model=None, device="cpu", max_batch=8, overlap=overlap)) as engine:
            return [(r.token_ids, r.finish_reason) for r in engine.generate(reqs)]

    off = go(False)
    assert go(True) == off
    assert off[0][1] == "stop"  # the regex's rows ended with their grammar


@pytest.mark.gpu
def test_gpu_launches_without_a_thread_and_gives_the_tokens_without_overlap(checkpoint):
    """The CuPy backend (on cusim in CI): the pass is launched inline, the wait is the readback."""
    from eprt.ops.device import cuda_usable

    if not cuda_usable():
        pytest.skip("no usable CUDA device")
    path = checkpoint("qwen3_moe")
    params = [
        SamplingParams(max_tokens=5, ignore_eos=True),
        SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.9, seed=4),
        SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1),
    ]

    def go(overlap):
        cfg = EngineConfig(model=path, device="cuda", max_batch=4, max_model_len=64, overlap=overlap)
        with launch_engine(cfg) as engine:
            assert overlap == (engine.runner.overlap is not None and not engine.runner.overlap.threaded)
            return [r.token_ids for r in engine.generate([GenerationRequest(p, q) for p, q in zip(PROMPTS, params)])]

    assert go(True) == go(False)
