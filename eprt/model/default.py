"""The built-in default model: a small Qwen3-MoE trained on Python's docstrings, with the byte tokenizer.

Nothing is downloaded: its bfloat16 safetensors ship in ``eprt/model/default_model/`` and go through
the same reader as any ``--model DIR``. ``scripts/train_default_model.py`` made them; README,
"Built-in default model", says how.
"""

from __future__ import annotations

import os

from eprt.model.config import load_config
from eprt.model.safetensors_io import SafetensorsCheckpoint
from eprt.model.tokenizer import ByteTokenizer

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model")
DEFAULT_MODEL_NAME = "eprt-default-moe"


def default_checkpoint():
    """(config, tensor source, tokenizer, name) of the built-in model."""
    cfg = load_config(DEFAULT_MODEL_DIR)
    return cfg, SafetensorsCheckpoint(DEFAULT_MODEL_DIR), ByteTokenizer(), DEFAULT_MODEL_NAME
