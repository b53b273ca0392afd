"""Vision embeddings: rows given for image placeholder tokens replace their embeddings."""

import numpy as np
import pytest
import torch
from checkpoints import load_reference

from eprt.api import GenerationRequest, RequestError, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine

IMAGE = 250
PROMPT = [5, IMAGE, IMAGE, IMAGE, 9, 31, 44, IMAGE, 7]


def image_rows(n, d, seed=0):
    return np.random.default_rng(seed).normal(0, 0.3, size=(n, d)).astype(np.float32)


def hf_greedy_with_rows(path, prompt, rows, n):
    model = load_reference(path)
    with torch.no_grad():
        emb = model.get_input_embeddings()(torch.tensor([prompt])).clone()
        emb[0, torch.tensor(prompt) == IMAGE] = torch.from_numpy(rows)
        out = model.generate(
            inputs_embeds=emb,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
        )
    return out[0].tolist()


@pytest.mark.parametrize("arch,chunk", [("qwen3_moe", 0), ("mixtral", 4)])
def test_image_rows_match_transformers_inputs_embeds(checkpoint, arch, chunk):
    path = checkpoint(arch)
    rows = image_rows(4, 64)
    cfg = EngineConfig(
        model=path,
        device="cpu",
        max_batch=4,
        block_size=4,
        max_model_len=128,
        image_token_id=IMAGE,
        max_prefill_tokens=chunk,
    )
    with launch_engine(cfg) as engine:
        with_rows, plain = engine.generate(
            [
                GenerationRequest(PROMPT, SamplingParams(max_tokens=16), image_embeds=rows),
                GenerationRequest(PROMPT, SamplingParams(max_tokens=16)),
            ]
        )
    assert with_rows.token_ids == hf_greedy_with_rows(path, PROMPT, rows, 16)
    assert with_rows.token_ids != plain.token_ids


def test_wrong_row_count_or_width_is_rejected(checkpoint):
    cfg = EngineConfig(
        model=checkpoint("qwen3_moe"), device="cpu", max_batch=2, block_size=4, max_model_len=64, image_token_id=IMAGE
    )
    with launch_engine(cfg) as engine:
        with pytest.raises(RequestError, match="3 image_embeds rows for 4"):
            engine.submit(GenerationRequest(PROMPT, image_embeds=image_rows(3, 64)))
        with pytest.raises(RequestError, match=r"shape \[n, 64\]"):
            engine.submit(GenerationRequest(PROMPT, image_embeds=image_rows(4, 32)))


def test_prefix_cache_never_mixes_images(checkpoint):
    """Same placeholder tokens, different rows: no cache hit across images, a hit for the same image."""
    path = checkpoint("qwen3_moe")
    prompt = [IMAGE] * 8 + [5, 6, 7]
    rows_a, rows_b = image_rows(8, 64, seed=1), image_rows(8, 64, seed=2)
    cfg = EngineConfig(model=path, device="cpu", max_batch=2, block_size=4, max_model_len=64, image_token_id=IMAGE)
    with launch_engine(cfg) as engine:

        def gen(rows):
            return engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=10), image_embeds=rows)])[0]

        a, b, a_again = gen(rows_a), gen(rows_b), gen(rows_a)
    with launch_engine(cfg) as fresh:
        b_alone = fresh.generate([GenerationRequest(prompt, SamplingParams(max_tokens=10), image_embeds=rows_b)])[0]
    assert b.cached_tokens == 0 and b.token_ids == b_alone.token_ids
    assert a_again.cached_tokens == 8 and a_again.token_ids == a.token_ids
    assert a.token_ids != b.token_ids


def test_non_finite_rows_are_rejected(checkpoint):
    cfg = EngineConfig(
        model=checkpoint("qwen3_moe"), device="cpu", max_batch=2, block_size=4, max_model_len=64, image_token_id=IMAGE
    )
    rows = image_rows(4, 64)
    rows[1, 3] = np.nan
    with launch_engine(cfg) as engine:
        with pytest.raises(RequestError, match="finite"):
            engine.submit(GenerationRequest(PROMPT, image_embeds=rows))


def test_cli_image_embeds_from_npy_match_the_python_api(checkpoint, tmp_path):
    import json
    import subprocess
    import sys

    path = checkpoint("mixtral")
    rows = image_rows(4, 64, seed=3)
    np.save(tmp_path / "rows.npy", rows)
    cmd = [
        sys.executable,
        "-m",
        "eprt.cli",
        "generate",
        "--model",
        path,
        "--device",
        "cpu",
        "--json",
        "--max-tokens",
        "8",
        "--image-token-id",
        str(IMAGE),
        "--prompt-ids",
        "1,2,3",
        "--prompt-ids",
        ",".join(map(str, PROMPT)),
        "--image-embeds",
        f"1:{tmp_path / 'rows.npy'}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
    cli = json.loads(out[1])["token_ids"]
    cfg = EngineConfig(model=path, device="cpu", max_batch=2, block_size=16, max_model_len=64, image_token_id=IMAGE)
    with launch_engine(cfg) as engine:
        api = engine.generate([GenerationRequest(PROMPT, SamplingParams(max_tokens=8), image_embeds=rows)])[0]
    assert cli == api.token_ids == hf_greedy_with_rows(path, PROMPT, rows, 8)
