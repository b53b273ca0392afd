"""Tokenizers: a checkpoint's ``tokenizer.json`` (the ``tokenizers`` package) or bytes.

Both expose ``encode(text) -> ids``, ``decode(ids) -> text``, ``eos_token_ids`` and
``apply_chat_template(messages) -> str``.
"""
from __future__ import annotations

import json
import os
from typing import Optional


class Tokenizer:
    def __init__(self, tok, eos_token_ids, chat_template: Optional[str] = None, bos_token: str = "",
                 eos_token: str = ""):
        self._tok = tok
        self.eos_token_ids = list(eos_token_ids)
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The checkpoint's template rendered in a sandbox (templates are data from the
        checkpoint); a template's own ``raise_exception(msg)`` becomes ValueError(msg)."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # only needed for chat

        def raise_exception(message):
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token)


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus <bos>=256, <eos>=257 (the default model's tokenizer)."""
    BOS, EOS = 256, 257
    vocab_size = 258

    def __init__(self):
        self.eos_token_ids = [self.EOS]
        self.chat_template = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> str:
        return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def _token_text(v) -> str:
    return v.get("content", "") if isinstance(v, dict) else (v or "")


def load_tokenizer(model_dir: str, cfg) -> Optional[Tokenizer]:
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(path)
    template, bos, eos = None, "", ""
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            tc = json.load(f)
        template = tc.get("chat_template")
        bos, eos = _token_text(tc.get("bos_token")), _token_text(tc.get("eos_token"))
    eos_ids = list(cfg.eos_token_ids)
    if eos and tok.token_to_id(eos) is not None and tok.token_to_id(eos) not in eos_ids:
        eos_ids.append(tok.token_to_id(eos))
    return Tokenizer(tok, eos_ids, template, bos, eos)
