"""qwen3_vl_moe: greedy parity with transformers for text-only prompts and one or two images
(interleaved MRoPE, rope deltas, deepstack), eprt's own image preprocessing against
transformers' PIL processor, the encoder's LRU and the prefix cache keyed by image, bad images."""

import json
import os
import struct
import threading
import time
import zlib

import numpy as np
import pytest
import torch
from checkpoints import (
    VL_END,
    VL_IMAGE,
    VL_START,
    build_vl_checkpoint,
    load_vl_reference,
    png_bytes,
    vl_reference_greedy,
)
from PIL import Image

from eprt.api import GenerationRequest, RequestError, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.model.config import ConfigError, config_from_dict, load_config
from eprt.model.mrope import prompt_positions
from eprt.model.vision import ImageInputs, ImageLimits, ImageProcessorConfig, decode_image, preprocess

STEPS = 10


@pytest.fixture(scope="module")
def vl(ckpt_root):
    return build_vl_checkpoint(os.path.join(ckpt_root, "qwen3_vl_moe"))


png = png_bytes


def png_header(w: int, h: int) -> bytes:
    """A PNG file claiming a w x h RGB image: signature, IHDR, one tiny IDAT and IEND."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def processor(path) -> ImageProcessorConfig:
    with open(os.path.join(path, "preprocessor_config.json")) as f:
        return ImageProcessorConfig.from_dict(json.load(f))


def hf_greedy(path, prompt, images=()):
    return vl_reference_greedy(path, prompt, images, STEPS)


def engine_config(path, **kw):
    return EngineConfig(model=path, device="cpu", max_batch=4, block_size=4, max_model_len=160, **kw)


def greedy(params=None):
    return SamplingParams(max_tokens=STEPS, ignore_eos=True) if params is None else params


CASES = {
    "text": ([5, 17, 33, 9, 100, 7, 8, 9, 10], []),
    "one image": ([5, VL_START, VL_IMAGE, VL_END, 9, 31, 44], [png(1, 40, 56)]),
    "two images": ([5, 17, VL_IMAGE, 9, 100, VL_IMAGE, 7, 8], [png(2, 64, 30), png(3, 24, 24)]),
}


@pytest.mark.parametrize("chunk", [0, 5])
def test_greedy_matches_transformers_text_and_images(vl, chunk):
    with launch_engine(engine_config(vl, max_prefill_tokens=chunk)) as engine:
        results = engine.generate(
            [GenerationRequest(list(p), greedy(), images=list(imgs) or None) for p, imgs in CASES.values()]
        )
    for name, res in zip(CASES, results):
        assert res.finish_reason == "length", (name, res.error)
        assert res.token_ids == hf_greedy(vl, res.prompt_ids, CASES[name][1]), name
    assert results[1].prompt_ids.count(VL_IMAGE) == 8  # 40x56 -> 32x64 pixels -> 2x4 merged placeholders


def test_preprocessing_matches_transformers_pil_processor(vl):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    with open(os.path.join(vl, "preprocessor_config.json")) as f:
        raw = json.load(f)
    raw.pop("image_processor_type")
    reference = Qwen2VLImageProcessorPil(**raw)
    for w, h in [(41, 57), (300, 90), (7, 9), (64, 64)]:  # in bounds, shrunk, grown, exact
        rgb = np.random.default_rng(w).integers(0, 256, (h, w, 3), dtype=np.uint8)
        ref = reference(images=[Image.fromarray(rgb)], return_tensors="np")
        mine, grid = preprocess(rgb, processor(vl))
        assert [1, *grid] == ref["image_grid_thw"][0].tolist()
        np.testing.assert_allclose(mine, ref["pixel_values"], atol=1e-5)


def test_rope_positions_match_get_rope_index(vl):
    model = load_vl_reference(vl).model
    prompt, imgs = CASES["two images"]
    with launch_engine(engine_config(vl)) as engine:
        engine.images.apply(req := GenerationRequest(list(prompt), images=list(imgs)))
    ids = torch.tensor([req.prompt_ids])
    grids = torch.tensor([[1, *preprocess(decode_image(b, ImageLimits()), processor(vl))[1]] for b in imgs])
    want, delta = model.get_rope_index(ids, (ids == VL_IMAGE).int(), grids)
    width = load_config(vl).hidden_size * 3
    got, got_delta = prompt_positions(req.prompt_ids, VL_IMAGE, req.image_embeds[:, width:].astype(np.int64))
    assert got.tolist() == want[:, 0].tolist() and got_delta == int(delta) < 0


def test_repeated_image_is_encoded_once_and_hits_the_prefix_cache(vl):
    prompt, image = [VL_IMAGE, 5, 6, 7, 8, 9], png(4, 48, 48)
    with launch_engine(engine_config(vl)) as engine:
        first = engine.generate([GenerationRequest(list(prompt), greedy(), images=[image])])[0]
        again = engine.generate([GenerationRequest(list(prompt), greedy(), images=[image])])[0]
        other = engine.generate([GenerationRequest(list(prompt), greedy(), images=[png(5, 48, 48)])])[0]
        encoded = engine.images.inputs().encoded
    assert first.cached_tokens == 0 and again.cached_tokens > 0 and other.cached_tokens == 0
    assert again.token_ids == first.token_ids and encoded == 2


def test_concurrent_requests_share_one_encoder_pass(vl):
    """Images of requests that arrive while the tower runs are encoded together in the next pass,
    each request gets its own rows, and they equal one-at-a-time encodings (up to float rounding:
    torch's matmuls of a batch sum in another order)."""
    batched, serial = ImageInputs(vl, load_config(vl)), ImageInputs(vl, load_config(vl))
    started, release, sizes = threading.Event(), threading.Event(), []
    tower = batched.encoder.encode

    def held(pixels):
        sizes.append(len(pixels))
        started.set()
        release.wait(60)
        return tower(pixels)

    batched.encoder.encode = held
    images = [[png(20, 32, 32)], [png(21, 48, 16)], [png(22, 16, 16), png(20, 32, 32)], [png(23, 24, 40)]]
    out = [None] * len(images)

    def request(i):
        out[i] = batched.encode(images[i])

    threads = [threading.Thread(target=request, args=(i,)) for i in range(len(images))]
    threads[0].start()
    assert started.wait(60)
    for t in threads[1:]:
        t.start()
    while len(batched._queue) < 3:  # the three new images of the later requests (png 20 is in flight)
        time.sleep(0.01)
    release.set()
    for t in threads:
        t.join(60)
    assert sizes == [1, 3] and batched.encoded == 4 and batched.forward_passes == 2
    for got, imgs in zip(out, images):
        for g, want in zip(got, serial.encode(imgs)):
            np.testing.assert_allclose(g.main, want.main, atol=1e-5)
            np.testing.assert_allclose(g.deepstack, want.deepstack, atol=1e-5)


BAD = {
    "truncated PNG": (png(6, 32, 32)[:-40], "cannot decode"),
    "0x0": (png_header(0, 0), "image is 0x0 pixels"),
    "20k x 20k": (png_header(20000, 20000), "over the limit of 16000000 pixels"),
    "8k x 8k": (png_header(8000, 8000), "8000x8000 = 64000000 pixels, over the limit"),
    "not an image": (b"GIF? no, plain text pretending to be image/png", "not a PNG, JPEG or WebP"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_images_are_refused_and_the_engine_goes_on(vl, name):
    data, message = BAD[name]
    with launch_engine(engine_config(vl)) as engine:
        with pytest.raises(RequestError, match=message):
            engine.submit(GenerationRequest([VL_IMAGE, 5], greedy(), images=[data]))
        ok = engine.generate([GenerationRequest([VL_IMAGE, 5], greedy(), images=[png(7, 16, 16)])])[0]
    assert ok.finish_reason == "length"


def test_image_count_must_match_placeholders_and_text_models_take_no_images(vl, checkpoint):
    with launch_engine(engine_config(vl)) as engine:
        with pytest.raises(RequestError, match="2 images for 1 image placeholder"):
            engine.submit(GenerationRequest([VL_IMAGE, 5], images=[png(1, 16, 16), png(2, 16, 16)]))
    with launch_engine(engine_config(checkpoint("qwen3_moe"))) as engine:
        with pytest.raises(RequestError, match="has no vision encoder"):
            engine.submit(GenerationRequest([5, 6], images=[png(1, 16, 16)]))


def test_config_reads_text_config_and_names_bad_fields(vl):
    cfg = load_config(vl)
    assert (cfg.model_type, cfg.mrope_section, cfg.deepstack_layers, cfg.norm_topk_prob) == (
        "qwen3_vl_moe",
        (2, 3, 3),
        2,
        True,
    )
    with open(os.path.join(vl, "config.json")) as f:
        raw = json.load(f)
    raw["text_config"]["rope_parameters"]["mrope_section"] = [2, 3, 4]
    with pytest.raises(ConfigError, match="must sum to head_dim/2 = 8"):
        config_from_dict(raw)
    raw.pop("vision_config")
    with pytest.raises(ConfigError, match="'vision_config' must be an object"):
        config_from_dict(raw)
