"""qwen3_vl_moe against transformers' own PIL image processor and model, on three checkpoints
(VL_VARIANTS: deepstack into two or three layers, issue 36's patch-16 tower with weights x2, text
heads of 8): expanded prompts, greedy tokens and first-step logits of text-only prompts, images
with and without a resize, several images in one prompt, transparent and EXIF-rotated pictures
(interleaved MRoPE, rope deltas, deepstack); eprt's preprocessing against the processor, the
encoder's LRU and the prefix cache keyed by image, bad images."""

import io
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
    VL_VARIANTS,
    hf_image_inputs,
    load_vl_reference,
    png_bytes,
    vl_checkpoint,
    vl_reference,
)
from PIL import Image

from eprt.api import GenerationRequest, RequestError, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.engine.executor import ShardExecutor
from eprt.model.config import ConfigError, config_from_dict, load_config
from eprt.model.loader import load_model
from eprt.model.mrope import prompt_positions
from eprt.model.vision import ImageInputs, ImageLimits, ImageProcessorConfig, decode_image, preprocess
from eprt.ops.numpy_ops import NumpyOps

STEPS = 10


@pytest.fixture(scope="module")
def vl(ckpt_root):
    return vl_checkpoint(ckpt_root)


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
    return vl_reference(path, prompt, images, STEPS)[1]


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
        assert res.token_ids == hf_greedy(vl, CASES[name][0], CASES[name][1]), name
    assert results[1].prompt_ids.count(VL_IMAGE) == 8  # 40x56 -> 32x64 pixels -> 2x4 merged placeholders


def variant_cases(path) -> dict:
    """Prompts (one placeholder per image) and images sized for the checkpoint's preprocessor:
    f = patch * merge pixels a placeholder side, at most 4f x 4f pixels an image."""
    f = processor(path).patch_size * processor(path).merge_size
    return {
        "text": ([5, 17, 33, 9, 100, 7], []),
        "no resize": ([5, 17, VL_START, VL_IMAGE, VL_END, 9, 31], [png(30, 3 * f, 4 * f)]),
        "resize, transparent": ([VL_START, VL_IMAGE, VL_END, 44, 12], [png(31, 5 * f + 7, f + 3, alpha=True)]),
        "EXIF rotated": ([8, VL_START, VL_IMAGE, VL_END, 9], [png(32, 3 * f, 4 * f, orientation=6)]),
        "three images": (
            [5, VL_START, VL_IMAGE, VL_END, 9, VL_START, VL_IMAGE, VL_END, VL_START, VL_IMAGE, VL_END, 7],
            [png(33, 2 * f, 3 * f), png(34, 7, 9), png(35, 4 * f - 5, 2 * f + 1, orientation=8, fmt="JPEG")],
        ),
    }


_REFERENCE: dict = {}


def reference(path, name, prompt, images) -> tuple:
    """vl_reference's (expanded prompt, greedy tokens, first logits), once per checkpoint and case."""
    if (path, name) not in _REFERENCE:
        _REFERENCE[path, name] = vl_reference(path, prompt, images, STEPS)
    return _REFERENCE[path, name]


@pytest.fixture(scope="module", params=list(VL_VARIANTS))
def variant(request, ckpt_root):
    return vl_checkpoint(ckpt_root, request.param)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [0, 7])
def test_every_variant_matches_transformers_processor_and_model(variant, chunk):
    """Expanded prompts and greedy tokens equal transformers' (its PIL processor's pixels and
    placeholder counts, its model's tokens), whole and in 7-token prefill chunks."""
    cases = variant_cases(variant)
    with launch_engine(engine_config(variant, max_prefill_tokens=chunk)) as engine:
        results = engine.generate(
            [GenerationRequest(list(p), greedy(), images=list(imgs) or None) for p, imgs in cases.values()]
        )
    for (name, (prompt, images)), res in zip(cases.items(), results):
        want_prompt, want_tokens, _ = reference(variant, name, prompt, images)
        assert res.finish_reason == "length", (name, res.error)
        assert res.prompt_ids == want_prompt, name
        assert res.token_ids == want_tokens, name


def test_every_variant_prefill_logits_match_transformers(variant):
    """The first step's logits of each image prompt, through the executor, within 1e-4 of the logits' scale."""
    lm = load_model(variant, NumpyOps(), max_len=256)
    images = ImageInputs(variant, load_config(variant))
    for name, (prompt, imgs) in variant_cases(variant).items():
        if not imgs:
            continue
        ids, rows = images.prepare(list(prompt), list(imgs))
        ex = ShardExecutor(lm.model, 64, 4, 1, prefix_cache=False)
        ex.allocate(0, ids, vision_rows=rows)
        got = ex.prefill(0, ids, 0, len(ids), rows)[0]
        want = reference(variant, name, prompt, imgs)[2]
        np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0, err_msg=name)


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


def palette_png(seed: int, w: int, h: int, transparent: bool) -> bytes:
    """A palette ("P") PNG, its most used colour transparent (a tRNS chunk) when ``transparent``."""
    img = Image.open(io.BytesIO(png(seed, w, h))).convert("P")
    common = int(np.bincount(np.asarray(img).ravel()).argmax())
    buf = io.BytesIO()
    img.save(buf, format="PNG", **({"transparency": common} if transparent else {}))
    return buf.getvalue()


def mode_png(seed: int, w: int, h: int, mode: str) -> bytes:
    buf = io.BytesIO()
    Image.open(io.BytesIO(png(seed, w, h, alpha=True))).convert(mode).save(buf, format="PNG")
    return buf.getvalue()


PICTURES = {  # encoded bytes whose decoding matters: transparency, EXIF orientation, modes
    "RGBA": png(40, 41, 57, alpha=True),
    "grey + alpha": mode_png(41, 30, 20, "LA"),
    "grey": mode_png(42, 30, 20, "L"),
    "palette": palette_png(43, 33, 18, transparent=False),
    "palette + tRNS": palette_png(44, 33, 18, transparent=True),
    "PNG EXIF 6": png(45, 48, 20, orientation=6),
    "JPEG EXIF 8": png(46, 40, 64, orientation=8, fmt="JPEG"),
    "WebP EXIF 3 + alpha": png(47, 50, 30, alpha=True, orientation=3, fmt="WEBP"),
}


@pytest.mark.parametrize("name", list(PICTURES))
def test_decoding_matches_transformers_load_and_processor(vl, name):
    """Bytes to pixels as transformers does it: the picture as viewers show it (EXIF orientation,
    transformers' load_image) and transparency composited onto white (its processor's RGB conversion)."""
    data = PICTURES[name]
    ref = hf_image_inputs(vl, [data])
    mine, grid = preprocess(decode_image(data, ImageLimits()), processor(vl))
    assert [1, *grid] == ref["image_grid_thw"][0].tolist()
    np.testing.assert_allclose(mine, ref["pixel_values"].numpy(), atol=1e-5)


def test_an_unreadable_exif_block_is_ignored():
    """A picture whose EXIF block is not even a TIFF header decodes to its pixels as stored."""
    plain = Image.open(io.BytesIO(png(48, 30, 20)))
    buf = io.BytesIO()
    plain.save(buf, format="PNG", exif=b"Exif\0\0\0\0\0")
    np.testing.assert_array_equal(decode_image(buf.getvalue(), ImageLimits()), np.asarray(plain))


def test_rope_positions_match_get_rope_index(vl):
    model = load_vl_reference(vl).model
    prompt, imgs = CASES["two images"]
    with launch_engine(engine_config(vl)) as engine:
        engine.images.apply(req := GenerationRequest(list(prompt), images=list(imgs)))
    ids = torch.tensor([req.prompt_ids])
    grids = hf_image_inputs(vl, imgs)["image_grid_thw"]
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
