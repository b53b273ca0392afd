"""Tokenizers: a checkpoint's ``tokenizer.json`` (the ``tokenizers`` package) or bytes.

Both expose ``encode(text) -> ids``, ``decode(ids) -> text``, ``eos_token_ids`` and
``apply_chat_template(messages) -> text``. Text is encoded and chat templates rendered as
transformers does (docs/tokenizer.md): special tokens by the tokenizer's own post-processor,
none added to a rendered chat, templates in transformers' Jinja environment.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers >= 4.53 / 5.x saves the template


class TokenizerFileError(ValueError):
    """A tokenizer file eprt cannot read; the message names the file and the field."""


class ChatPrompt(str):
    """Text rendered by a chat template. It already holds the special tokens the template
    wrote (a BOS, role markers), so ``encode`` adds none, as transformers'
    ``apply_chat_template(tokenize=True)`` encodes with ``add_special_tokens=False``."""


def _raise_exception(message):
    raise ValueError(f"chat template: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' ``tojson``: plain ``json.dumps`` (Jinja's own escapes HTML characters)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


def compile_chat_template(source: str):
    """A chat template compiled in transformers' environment: sandboxed and immutable, trim_blocks,
    lstrip_blocks, loopcontrols, ``{% generation %}`` blocks, ``raise_exception``, ``strftime_now``,
    ``tojson`` without HTML escaping, and a namespace that refuses underscore attributes."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` (assistant-mask markers) render their body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat template: namespace attribute {name!r} is not allowed")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=TemplateNamespace)
    return env.from_string(source)


class Tokenizer:
    def __init__(
        self,
        tok,
        eos_token_ids,
        chat_template: str | None = None,
        bos_token: str = "",
        eos_token: str = "",
        special_tokens: dict | None = None,
    ):
        self._tok = tok
        self.eos_token_ids = list(eos_token_ids)
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        # what a template sees besides its messages: every named special token (bos_token, eos_token, ...)
        self.special_tokens = {**(special_tokens or {}), "bos_token": bos_token, "eos_token": eos_token}
        self._bos_id = tok.token_to_id(bos_token) if tok is not None and bos_token else None
        self._compiled = None

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of ``text``. By default special tokens are added as the tokenizer's own
        post-processor says (a Llama/Mixtral tokenizer prepends BOS), except to a ``ChatPrompt``,
        which carries its own; a text that already starts with BOS gets no second one."""
        add = not isinstance(text, ChatPrompt) if add_special_tokens is None else add_special_tokens
        ids = list(self._tok.encode(str(text), add_special_tokens=add).ids)
        if (
            add
            and self._bos_id is not None
            and ids[:2] == [self._bos_id, self._bos_id]
            and text.startswith(self.bos_token)
        ):
            del ids[0]  # the text's own BOS: BOS exactly once
        return ids

    def to_json(self) -> str:
        """The ``tokenizer.json`` text of the underlying tokenizer (for grammar libraries)."""
        return self._tok.to_str()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str | None:
        """The vocabulary string of one token (special ones included), None if there is none."""
        return self._tok.id_to_token(int(token_id)) if self._tok is not None else None

    def token_id(self, text: str) -> int | None:
        """The id of the vocabulary string ``text`` (a special token's included), None if it is none."""
        return self._tok.token_to_id(text) if self._tok is not None else None

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: list | None = None,
        **kwargs,
    ):
        """The checkpoint's template rendered in a sandbox (templates are data from the checkpoint),
        as a ``ChatPrompt`` (or its ids with ``tokenize=True``); ``tools`` (OpenAI's function tools)
        and ``kwargs`` (a request's ``chat_template_kwargs``: enable_thinking, ...) are the
        template's variables too; a template's own ``raise_exception(msg)`` becomes ValueError(msg)."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        if self._compiled is None:
            self._compiled = compile_chat_template(self.chat_template)
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]  # as transformers drops None
        text = ChatPrompt(
            self._compiled.render(
                **{**self.special_tokens, **kwargs},
                messages=messages,
                tools=tools or None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
            )
        )
        return self.encode(text) if tokenize else text


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus <bos>=256, <eos>=257 (the default model's tokenizer). Its chat
    template ends each assistant turn with ``<eos>``, the model's eos_token_id: the turn the model
    writes ends where generation stops (the default model was trained on exchanges rendered so)."""

    BOS, EOS = 256, 257
    vocab_size = 258
    SPECIAL_TOKENS = {"<bos>": BOS, "<eos>": EOS}
    END_OF_TURN = "<eos>"  # what the template writes after an assistant's content

    def __init__(self):
        self.eos_token_ids = [self.EOS]
        self.chat_template = None

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """The text's bytes. In a ``ChatPrompt`` the special tokens' texts (``<bos>``, ``<eos>``) are
        their ids, as transformers parses a rendered chat; the default model was built without BOS,
        so none is ever added."""
        if not isinstance(text, ChatPrompt):
            return list(text.encode("utf-8"))
        ids = []
        for i, part in enumerate(re.split("(<bos>|<eos>)", text)):
            ids += [self.SPECIAL_TOKENS[part]] if i % 2 else list(part.encode("utf-8"))
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_id(self, text: str) -> int | None:
        return None  # no named special tokens but BOS and EOS

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False, tools=None, **kwargs
    ):
        """``<|role|>\\n`` and the content of each message, then ``\\n``, or ``<eos>`` after an
        assistant's; ``<|assistant|>\\n`` opens the reply to generate."""
        text = "".join(
            f"<|{m['role']}|>\n{m.get('content') or ''}" + (self.END_OF_TURN if m["role"] == "assistant" else "\n")
            for m in messages
        )
        text = ChatPrompt(text + ("<|assistant|>\n" if add_generation_prompt else ""))
        return self.encode(text) if tokenize else text


def _token_text(v) -> str:
    return v.get("content", "") if isinstance(v, dict) else (v or "")


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise TokenizerFileError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise TokenizerFileError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _config_template(value, path: str) -> str | None:
    """``chat_template`` of tokenizer_config.json: a string, or a list of {name, template} (the "default" one)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in value):
        named = {t.get("name"): t["template"] for t in value}
        return named.get("default")
    raise TokenizerFileError(
        f"{path} field 'chat_template' must be a string or a list of "
        f"{{name, template}} objects, got {type(value).__name__}"
    )


def load_chat_template(model_dir: str, tokenizer_config: dict) -> str | None:
    """``chat_template.jinja`` (transformers 5.x) first, as transformers reads it, else tokenizer_config.json's."""
    path = os.path.join(model_dir, CHAT_TEMPLATE_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    return _config_template(tokenizer_config.get("chat_template"), os.path.join(model_dir, "tokenizer_config.json"))


def load_tokenizer(model_dir: str, cfg) -> Tokenizer | None:
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(path)
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    tc = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
    special = {
        k: _token_text(v)
        for k, v in tc.items()
        if k.endswith("_token") and (isinstance(v, str) or isinstance(v, dict) and "content" in v)
    }
    bos, eos = special.get("bos_token", ""), special.get("eos_token", "")
    eos_ids = list(cfg.eos_token_ids)
    if eos and tok.token_to_id(eos) is not None and tok.token_to_id(eos) not in eos_ids:
        eos_ids.append(tok.token_to_id(eos))
    return Tokenizer(tok, eos_ids, load_chat_template(model_dir, tc), bos, eos, special)
