"""Images in for qwen3_vl_moe, on rank 0 only: decode and check the bytes, preprocess as
Qwen2VLImageProcessor (smart resize, rescale, normalise, patchify) with PIL and NumPy, encode
with the checkpoint's vision tower (torch, the ``[vision]`` extra), keep encodings in an LRU by
image hash, and expand the prompt's placeholders into the rows of the vision sync. docs/vision.md.

N patches of an image, F = C * temporal * patch * patch values a patch, n merged placeholders, D hidden.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from eprt.api import RequestError
from eprt.model.config import ConfigError, ModelConfig
from eprt.model.mrope import image_positions, pack_vision_rows

PREPROCESSOR_FILE = "preprocessor_config.json"
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
log = logging.getLogger("eprt.model")


@dataclass(frozen=True)
class ImageLimits:
    """Per-request bounds on images, checked before any pixel is decoded."""

    max_images: int = 8  # images in one request
    max_bytes: int = 20 * 1024 * 1024  # encoded bytes of one image
    max_pixels: int = 16_000_000  # width * height of one decoded image (before resizing)


@dataclass(frozen=True)
class ImageProcessorConfig:
    """``preprocessor_config.json`` as Qwen2VLImageProcessor reads it."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def from_dict(cls, raw: dict) -> ImageProcessorConfig:
        size = raw.get("size") or {}
        fields = dict(
            patch_size=raw.get("patch_size", cls.patch_size),
            temporal_patch_size=raw.get("temporal_patch_size", cls.temporal_patch_size),
            merge_size=raw.get("merge_size", cls.merge_size),
            min_pixels=raw.get("min_pixels", size.get("shortest_edge", cls.min_pixels)),
            max_pixels=raw.get("max_pixels", size.get("longest_edge", cls.max_pixels)),
        )
        for name, value in fields.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{PREPROCESSOR_FILE} field {name!r} must be a positive integer, got {value!r}")
        mean, std = tuple(raw.get("image_mean", cls.image_mean)), tuple(raw.get("image_std", cls.image_std))
        if len(mean) != 3 or len(std) != 3 or not all(s > 0 for s in std):
            raise ConfigError(
                f"{PREPROCESSOR_FILE}: image_mean / image_std must be 3 values (std > 0), got {mean} {std}"
            )
        return cls(
            **fields,
            image_mean=mean,
            image_std=std,
            rescale_factor=float(raw.get("rescale_factor", cls.rescale_factor)),
            do_rescale=bool(raw.get("do_rescale", True)),
            do_normalize=bool(raw.get("do_normalize", True)),
        )


def decode_image(data: bytes, limits: ImageLimits, where: str = "image") -> np.ndarray:
    """PNG / JPEG / WebP bytes -> RGB uint8 [H, W, 3] of the picture as viewers show it (its EXIF
    orientation applied: ``upright``; transparency on white: ``to_rgb``); RequestError naming the problem otherwise."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise RequestError(f"{where}: empty image data")
    if len(data) > limits.max_bytes:
        raise RequestError(f"{where}: {len(data)} bytes is over the limit of {limits.max_bytes} bytes an image")
    if data[:8] == PNG_SIGNATURE and len(data) >= 24:  # PIL cannot even open a PNG of zero size: name it
        w, h = struct.unpack(">II", data[16:24])
        if w < 1 or h < 1:
            raise RequestError(f"{where}: image is {w}x{h} pixels; it must be at least 1x1")
    try:
        img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise RequestError(f"{where}: image is over the limit of {limits.max_pixels} pixels ({e})") from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise RequestError(f"{where}: not a PNG, JPEG or WebP image ({e})") from None
    if img.format not in IMAGE_FORMATS:
        raise RequestError(f"{where}: image format {img.format} is not one of {', '.join(IMAGE_FORMATS)}")
    w, h = img.size
    if w < 1 or h < 1:
        raise RequestError(f"{where}: image is {w}x{h} pixels; it must be at least 1x1")
    if w * h > limits.max_pixels:
        raise RequestError(f"{where}: image is {w}x{h} = {w * h} pixels, over the limit of {limits.max_pixels}")
    if max(w, h) / min(w, h) > 200:
        raise RequestError(f"{where}: image is {w}x{h}; its aspect ratio must be at most 200")
    try:
        img.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise RequestError(f"{where}: cannot decode the {img.format} image ({e})") from None
    return np.asarray(to_rgb(upright(img)), dtype=np.uint8)


def upright(img):
    """The image turned as its EXIF Orientation tag says (ImageOps.exif_transpose); an unreadable
    EXIF block is ignored, as image viewers do: the pixels as stored."""
    from PIL import ImageOps

    try:
        return ImageOps.exif_transpose(img)
    except Exception as e:  # noqa: BLE001 - whatever a malformed EXIF block raises, the pixels are fine
        log.debug("unreadable EXIF block ignored: %s", e)
        return img


def to_rgb(img):
    """A decoded PIL image as RGB the way transformers' image processors convert it: transparency
    (an alpha band or a transparent palette / grey colour) composited onto white, as viewers and
    vLLM show it, instead of dropped."""
    from PIL import Image

    if "A" not in img.getbands() and img.info.get("transparency") is None:
        return img.convert("RGB")
    rgba = img.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize target: multiples of ``factor``, within the pixel bounds, the aspect ratio kept."""
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess(rgb: np.ndarray, cfg: ImageProcessorConfig) -> tuple[np.ndarray, tuple[int, int]]:
    """RGB uint8 [H, W, 3] -> (patches [N, F] float32, (grid_h, grid_w) in patches): bicubic resize,
    rescale, normalise, then Qwen2VLImageProcessor's patch order (merge windows row-major)."""
    from PIL import Image

    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    h, w = smart_resize(rgb.shape[0], rgb.shape[1], p * m, cfg.min_pixels, cfg.max_pixels)
    resized = np.asarray(Image.fromarray(rgb).resize((w, h), resample=Image.BICUBIC), dtype=np.float32)  # [h, w, 3]
    x = resized * np.float32(cfg.rescale_factor) if cfg.do_rescale else resized
    if cfg.do_normalize:
        x = (x - np.asarray(cfg.image_mean, np.float32)) / np.asarray(cfg.image_std, np.float32)
    x = x.transpose(2, 0, 1).astype(np.float32)  # [3, h, w]
    gh, gw = h // p, w // p
    patches = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, 3, p, p]
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))  # frames repeat
    return np.ascontiguousarray(patches.reshape(gh * gw, 3 * t * p * p)), (gh, gw)


@dataclass(frozen=True)
class EncodedImage:
    """One image's vision-tower output: main rows [n, D], deepstack rows [K, n, D], merged grid."""

    main: np.ndarray
    deepstack: np.ndarray
    grid_h: int  # merged placeholders down
    grid_w: int  # merged placeholders across


class VisionEncoder:
    """The checkpoint's vision tower (``model.visual.*``) in torch float32 on the CPU."""

    def __init__(self, model_dir: str, raw_config: dict):
        try:
            import torch
            from safetensors import safe_open
            from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as hf
            from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeVisionConfig
        except ImportError as e:
            raise RuntimeError(
                f"the vision encoder needs torch and transformers: pip install 'eprt[vision]' ({e})"
            ) from None
        self.torch = torch
        self.model = hf.Qwen3VLMoeVisionModel._from_config(Qwen3VLMoeVisionConfig(**raw_config["vision_config"]))
        state, prefix = {}, "model.visual."
        for name in sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")):
            with safe_open(os.path.join(model_dir, name), framework="pt") as f:
                for key in f.keys():
                    if key.startswith(prefix):
                        state[key[len(prefix) :]] = f.get_tensor(key).float()
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ConfigError(f"{model_dir}: vision tower tensors missing {missing[:4]}, unexpected {unexpected[:4]}")
        self.model = self.model.float().eval()
        self.merge = self.model.spatial_merge_size

    def encode(self, images: list) -> list:
        """[(patches [N, F], (gh, gw))] -> [EncodedImage], every image in one forward pass."""
        torch = self.torch
        pixels = torch.from_numpy(np.concatenate([p for p, _ in images]))
        grid = torch.tensor([[1, gh, gw] for _, (gh, gw) in images])
        with torch.no_grad():
            out = self.model(pixels, grid_thw=grid)
        sizes = [gh * gw // self.merge**2 for _, (gh, gw) in images]
        main = torch.split(out.pooler_output, sizes)
        deep = [torch.split(f, sizes) for f in out.deepstack_features]
        return [
            EncodedImage(
                main[i].numpy().astype(np.float32),
                np.stack([d[i].numpy() for d in deep]).astype(np.float32),
                gh // self.merge,
                gw // self.merge,
            )
            for i, (_, (gh, gw)) in enumerate(images)
        ]


@dataclass
class _Pending:
    """An image waiting for (or in) an encoder forward pass."""

    pixels: tuple  # (patches [N, F], (gh, gw))
    result: EncodedImage | None = None
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


class ImageInputs:
    """Rank 0's image path for one checkpoint: bytes -> rows of the vision sync, with an LRU of
    encodings keyed by the image bytes' hash so a repeated image is encoded once. Each request
    decodes and preprocesses its own images (a bad one fails only its request); the new images
    of every request waiting meanwhile go through the tower together, in one forward pass."""

    def __init__(self, model_dir: str, cfg: ModelConfig, limits: ImageLimits = ImageLimits(), capacity: int = 64):
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
        path = os.path.join(model_dir, PREPROCESSOR_FILE)
        processor = {}
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                processor = json.load(f)
        self.processor = ImageProcessorConfig.from_dict(processor)
        self.encoder = VisionEncoder(model_dir, raw)
        self.cfg, self.limits, self.capacity = cfg, limits, capacity
        self.start_token, self.end_token = raw.get("vision_start_token_id"), raw.get("vision_end_token_id")
        self._cache: OrderedDict[bytes, EncodedImage] = OrderedDict()
        self._inflight: dict[bytes, _Pending] = {}  # queued or being encoded, by image hash
        self._queue: list[bytes] = []  # hashes for the next forward pass
        self._running = False  # a thread is running the tower now
        self._cond = threading.Condition()
        self.encoded = 0  # images run through the tower (cache misses)
        self.forward_passes = 0

    def encode(self, images: list) -> list:
        """Bytes of each image -> EncodedImage, from the LRU where the same bytes were seen."""
        if len(images) > self.limits.max_images:
            raise RequestError(f"{len(images)} images in one request, over the limit of {self.limits.max_images}")
        keys = [hashlib.sha256(bytes(b)).digest() for b in images]
        with self._cond:
            known = set(self._cache) | set(self._inflight)
        pixels = {}  # this request's new images, preprocessed on its own thread
        for i, (k, b) in enumerate(zip(keys, images)):
            if k not in known and k not in pixels:
                pixels[k] = preprocess(decode_image(b, self.limits, f"image {i}"), self.processor)
        with self._cond:
            found = {k: self._cache[k] for k in keys if k in self._cache}
            waiting = {}
            for k in keys:
                if k in found or k in waiting:
                    continue
                if k not in self._inflight:
                    if k not in pixels:  # evicted since: preprocess it now
                        pixels[k] = preprocess(
                            decode_image(images[keys.index(k)], self.limits, "image"), self.processor
                        )
                    self._inflight[k] = _Pending(pixels[k])
                    self._queue.append(k)
                waiting[k] = self._inflight[k]
            while not all(p.done for p in waiting.values()):
                if self._running:
                    self._cond.wait()
                else:
                    self._forward()
            for k, p in waiting.items():
                if p.error is not None:
                    raise RequestError(f"the vision encoder failed: {p.error}")
                found[k] = p.result
            for k in keys:
                if k in self._cache:
                    self._cache.move_to_end(k)
        return [found[k] for k in keys]

    def _forward(self) -> None:
        """Encode every queued image in one forward pass; called with the condition held, which is
        released while the tower runs so more requests can queue."""
        batch = [(k, self._inflight[k]) for k in self._queue]
        self._queue.clear()
        self._running = True
        self._cond.release()
        try:
            outputs, error = self.encoder.encode([p.pixels for _, p in batch]), None
        except Exception as e:  # noqa: BLE001 - reported to every request of the batch
            outputs, error = None, f"{type(e).__name__}: {e}"
        finally:
            self._cond.acquire()
        for i, (k, p) in enumerate(batch):
            if error is None:
                p.result = self._cache[k] = outputs[i]
            else:
                p.error = error
            del self._inflight[k]
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        self.encoded += len(batch) if error is None else 0
        self.forward_passes += 1
        self._running = False
        self._cond.notify_all()

    def prepare(self, prompt: list, images: list) -> tuple[list, np.ndarray]:
        """(prompt with each image placeholder expanded to its n_i placeholders, vision rows [sum n_i, W]).
        A prompt without placeholders gets ``<vision_start> <image> <vision_end>`` per image in front."""
        token = self.cfg.image_token_id
        encoded = self.encode(images)
        count = sum(1 for t in prompt if t == token)
        if count == 0:
            frame = [t for t in (self.start_token, token, self.end_token) if t is not None]
            prompt = frame * len(images) + list(prompt)
        elif count != len(images):
            raise RequestError(f"{len(images)} images for {count} image placeholder tokens ({token}) in the prompt")
        out, positions, current, index = [], [], 0, 0
        for t in prompt:
            if t != token:
                out.append(int(t))
                current += 1
                continue
            e = encoded[index]
            index += 1
            out.extend([token] * len(e.main))
            positions.append(image_positions(current, e.grid_h, e.grid_w))
            current += max(e.grid_h, e.grid_w)
        main = np.concatenate([e.main for e in encoded])
        deep = [np.concatenate([e.deepstack[k] for e in encoded]) for k in range(self.cfg.deepstack_layers)]
        return out, pack_vision_rows(main, deep, np.concatenate(positions))
