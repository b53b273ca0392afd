"""Image references of requests -> encoded image bytes: ``data:`` URLs (base64 PNG / JPEG /
WebP), local files (``file://`` only under ``--allowed-local-media-path``); remote ``http(s)``
URLs are refused. Decoding and the pixel limits are rank 0's engine's (docs/vision.md)."""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

from eprt.serve.params import FieldError

IMAGE_MIME_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp")
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # one image's encoded bytes (eprt.model.vision.ImageLimits.max_bytes)


@dataclass(frozen=True)
class MediaPolicy:
    allowed_local_path: str | None = None  # file:// images must lie under this directory; None: none allowed


def _data_url(url: str, param: str, where: str) -> bytes:
    header, sep, payload = url[len("data:") :].partition(",")
    mime, _, encoding = header.partition(";")
    if not sep or encoding.lower() != "base64":
        raise FieldError(param, f"{where}: a data: URL must be data:<image type>;base64,<data>")
    if mime.lower() not in IMAGE_MIME_TYPES:
        raise FieldError(param, f"{where}: image type {mime!r} is not one of {', '.join(IMAGE_MIME_TYPES)}")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise FieldError(param, f"{where}: the image is over the limit of {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise FieldError(param, f"{where}: the data: URL is not valid base64 ({e})") from None


def read_local_image(path: str, param: str, where: str) -> bytes:
    """The bytes of a local image file, with its size checked first."""
    try:
        size = os.path.getsize(path)
        if size > MAX_IMAGE_BYTES:
            raise FieldError(param, f"{where}: {path} is {size} bytes, over the limit of {MAX_IMAGE_BYTES}")
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise FieldError(param, f"{where}: cannot read {path}: {e.strerror or e}") from None


def _file_url(url: str, policy: MediaPolicy, param: str, where: str) -> bytes:
    if policy.allowed_local_path is None:
        raise FieldError(
            param, f"{where}: file:// images are off; the server allows them with --allowed-local-media-path"
        )
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise FieldError(param, f"{where}: file:// URL names host {parsed.netloc!r}; only local files are read")
    root = os.path.realpath(policy.allowed_local_path)
    path = os.path.realpath(unquote(parsed.path))
    if os.path.commonpath([root, path]) != root:
        raise FieldError(param, f"{where}: {unquote(parsed.path)} is outside the allowed media directory")
    return read_local_image(path, param, where)


def image_bytes(url, policy: MediaPolicy, param: str, where: str) -> bytes:
    """The encoded image an ``image_url`` names; FieldError naming ``where`` otherwise."""
    if not isinstance(url, str) or not url:
        raise FieldError(param, f"{where}: image_url.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        return _data_url(url, param, where)
    if scheme == "file":
        return _file_url(url, policy, param, where)
    if scheme in ("http", "https"):
        raise FieldError(param, f"{where}: remote image URLs are not fetched; send the image as a data: URL")
    raise FieldError(param, f"{where}: unsupported image URL scheme {scheme!r} (data: or file://)")


def image_part_bytes(part: dict, policy: MediaPolicy, param: str, where: str) -> bytes:
    """An OpenAI content part ``{"type": "image_url", "image_url": {"url": ...}}`` -> image bytes."""
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    return image_bytes(url, policy, param, where)


def image_text(engine, param: str) -> str:
    """The text that stands for one image in a rendered chat: the tokenizer's strings of the
    model's ``<vision_start> <image> <vision_end>`` tokens."""
    images = getattr(engine, "images", None)
    ids = images.frame_tokens() if images is not None else []
    if not ids or engine.tokenizer is None:
        raise FieldError(param, f"model {engine.model_name} takes no images")
    texts = [engine.tokenizer.token_text(t) for t in ids]
    if any(t is None for t in texts):
        raise FieldError(param, f"this model's tokenizer has no token for image token ids {ids}")
    return "".join(texts)
