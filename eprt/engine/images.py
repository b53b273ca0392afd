"""Rank 0's image inputs of a request: ``GenerationRequest.images`` (encoded bytes) become the
expanded prompt and its vision rows before the scheduler sees the request (docs/vision.md).
The encoder starts loading in the background when the engine starts (``preload``)."""

from __future__ import annotations

import json
import logging
import os
import threading

from eprt.api import GenerationRequest, RequestError
from eprt.model.config import ModelConfig

log = logging.getLogger("eprt.engine")


class EngineImages:
    def __init__(self, model_dir: str | None, cfg: ModelConfig):
        self.model_dir, self.cfg = model_dir, cfg
        self._inputs = None  # eprt.model.vision.ImageInputs, made on first use
        self._lock = threading.Lock()

    def frame_tokens(self) -> list:
        """Token ids that stand for one image in a prompt before expansion: ``<vision_start> <image>
        <vision_end>`` as config.json names them ([] for a model without a vision encoder)."""
        if self.model_dir is None or not self.cfg.mrope_section:
            return []
        with open(os.path.join(self.model_dir, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
        ids = (raw.get("vision_start_token_id"), self.cfg.image_token_id, raw.get("vision_end_token_id"))
        return [t for t in ids if t is not None]

    def inputs(self):
        """The image path (made once); RequestError when this installation cannot encode images."""
        with self._lock:
            if self._inputs is None:
                from eprt.model.vision import ImageInputs

                try:
                    self._inputs = ImageInputs(self.model_dir, self.cfg)
                except (ImportError, RuntimeError) as e:
                    raise RequestError(f"images cannot be served here: {e}") from None
            return self._inputs

    def preload(self) -> None:
        """Load the vision encoder on a background thread (torch imports take seconds), so the first
        image request does not wait for it; a failure is logged and reported to image requests."""
        if self.model_dir is None or not self.cfg.mrope_section:
            return
        try:  # the packages themselves here: a package initialising on a thread while the caller's
            import torch  # noqa: F401  # thread imports it too can hand the caller a half-made module
            import transformers  # noqa: F401
        except ImportError:
            pass  # reported by the load below, to the requests that bring an image

        def load():
            try:
                self.inputs()
                log.info("vision encoder of %s loaded on rank 0", self.cfg.model_type)
            except Exception as e:  # reported again to every request that brings an image
                log.warning("vision encoder not loaded: %s", e)

        threading.Thread(target=load, name="eprt-vision-load", daemon=True).start()

    def apply(self, req: GenerationRequest) -> None:
        """Replace ``req.images`` by the expanded prompt and ``req.image_embeds``; RequestError on bad input."""
        if not req.images:
            return
        if req.image_embeds is not None:
            raise RequestError("give images or image_embeds, not both")
        if self.model_dir is None or not self.cfg.mrope_section:
            raise RequestError(
                f"model {self.cfg.model_type} has no vision encoder: send image_embeds rows instead of images"
            )
        req.prompt_ids, req.image_embeds = self.inputs().prepare(list(req.prompt_ids), list(req.images))
        req.images = None
