"""Structured outputs on rank 0 with llguidance: a request's Guide compiled against the model's
tokenizer, one matcher per sequence (copied from the guide's template), and a token bitmask per
step applied to its logits before sampling, filled after the next forward pass is issued
(docs/design.md, "Structured outputs"). B guided rows, V vocabulary, W = ceil(V / 32) words.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from eprt.api import Guide, RequestError
from eprt.model.tokenizer import ByteTokenizer

JSON_OBJECT_SCHEMA = '{"type": "object"}'
GRAMMAR_CACHE = 256  # compiled guides kept (a guide is compiled at submit and again at admission)
TEMPLATE_COPIES = 256  # matchers copied from a guide's template before a fresh one (their lexer cache is shared)
PARALLEL_VOCAB = 4096  # above it llguidance's threads fill the rows' masks; below, one call per row is cheaper
# JSON without free whitespace (a schema's own "x-guidance" overrides it): a small model would
# otherwise fill its budget with blanks the grammar allows between tokens
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class _ByteVocab:
    """llguidance's view of the byte tokenizer: ids 0..255 are the bytes, then BOS and EOS."""

    eos_token_id, bos_token_id = ByteTokenizer.EOS, ByteTokenizer.BOS
    tokens = [bytes([i]) for i in range(256)] + [b"<bos>", b"<eos>"]
    special_token_ids = [ByteTokenizer.BOS, ByteTokenizer.EOS]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise RequestError("structured outputs need llguidance: pip install 'eprt[structured]'") from None
    return llguidance


class GrammarCompiler:
    """Compiles Guides for one model's tokenizer (built once, on first use)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self._tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, list(eos_token_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()  # HTTP threads compile at submit, the scheduler thread at admission
        self._grammars: OrderedDict[Guide, _Compiled] = OrderedDict()

    def _lltok(self):
        with self._lock:
            return self._build_lltok()

    def _build_lltok(self):
        if self._ll_tokenizer is None:
            llg = _llguidance()
            if self._tokenizer is None:
                raise RequestError("structured outputs need the model's tokenizer, and this model has none")
            if isinstance(self._tokenizer, ByteTokenizer):
                source = llg.TokenizerWrapper(_ByteVocab())
            else:
                source = self._tokenizer.to_json()  # tokenizer.json, as the tokenizers package writes it
            try:
                self._ll_tokenizer = llg.LLTokenizer(source, n_vocab=self.vocab_size, eos_token=self.eos)
            except (ValueError, TypeError, RuntimeError) as e:  # a tokenizer llguidance cannot read
                raise RequestError(f"structured outputs are not available for this model's tokenizer: {e}") from None
        return self._ll_tokenizer

    def grammar(self, guide: Guide) -> str:
        """llguidance's grammar of ``guide``; RequestError naming the problem if it does not compile."""
        return self._compiled(guide).grammar

    def matcher(self, guide: Guide):
        """A matcher for one sequence: a copy of the guide's template matcher. The copies share the
        template's lexer state cache, so rows of one guide build each lexer state once rather than
        each its own (fresh matchers filled bench_structured.py's string-schema masks 5x slower);
        after TEMPLATE_COPIES copies a fresh template bounds that cache."""
        compiled = self._compiled(guide)
        with self._lock:
            if compiled.copies >= TEMPLATE_COPIES:
                compiled.template, compiled.copies = _llguidance().LLMatcher(self._build_lltok(), compiled.grammar), 0
            compiled.copies += 1
            return compiled.template.deep_copy()

    def _compiled(self, guide: Guide) -> _Compiled:
        with self._lock:
            if guide in self._grammars:
                self._grammars.move_to_end(guide)
                return self._grammars[guide]
        compiled = self._compile(guide)
        with self._lock:
            self._grammars[guide] = compiled
            if len(self._grammars) > GRAMMAR_CACHE:
                self._grammars.popitem(last=False)
        return compiled

    def _compile(self, guide: Guide) -> _Compiled:
        llg = _llguidance()
        text = JSON_OBJECT_SCHEMA if guide.kind == "json_object" else guide.spec
        kind = {"json_object": "json_schema"}.get(guide.kind, guide.kind)
        try:
            if kind == "json_schema":
                grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
            else:
                grammar = llg.grammar_from(kind, json.loads(text) if kind == "choice" else text)
        except (ValueError, TypeError) as e:
            raise RequestError(f"the {guide.kind} cannot be compiled: {e}") from None
        try:
            matcher = llg.LLMatcher(self._lltok(), grammar)
        except (ValueError, TypeError, RuntimeError) as e:
            raise RequestError(f"the {guide.kind} cannot be compiled: {e}") from None
        if matcher.is_error():
            raise RequestError(f"the {guide.kind} cannot be compiled: {matcher.get_error()}")
        return _Compiled(grammar, matcher)


@dataclass
class _Compiled:
    """A compiled guide: its grammar, the template matcher sequences copy and how many did."""

    grammar: str
    template: object
    copies: int = 0


class GuidedRows:
    """The guided sequences' masks: ``advance`` feeds each matcher its sampled token, ``allowed``
    fills the next step's bitmasks of the given matchers on the calling thread, after the next
    forward pass was issued (on a GPU it runs while the device computes that pass; on the CPU
    backend it costs its time in the step: llguidance's fill drops the GIL, a mask thread would
    fight the forward pass for it)."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self.words = (compiler.vocab_size + 31) // 32
        self._executor = None  # llguidance's thread pool, for large vocabularies
        eos = np.asarray(compiler.eos, dtype=np.int64)
        self._eos_words, self._eos_bits = eos // 32, (np.uint32(1) << (eos % 32).astype(np.uint32))

    def masks(self, matchers: list) -> np.ndarray:
        """Bitmasks [B, W] int32 of each matcher's next step (bit t % 32 of word t // 32: token t
        allowed; llguidance's layout): one llguidance call per matcher, or for a vocabulary over
        PARALLEL_VOCAB one call that fills every row on llguidance's threads."""
        masks = np.empty((len(matchers), self.words), dtype=np.int32)  # [B, W]
        size = self.words * 4
        if self.compiler.vocab_size > PARALLEL_VOCAB:
            if self._executor is None:
                self._executor = _llguidance().LLExecutor()
            rows = [(m, i) for i, m in enumerate(matchers)]
            self._executor.unsafe_compute_mask_ptr(rows, masks.ctypes.data, size, len(matchers))
        else:
            base = masks.ctypes.data
            for i, m in enumerate(matchers):
                m.unsafe_compute_mask_ptr(base + i * size, size)
        return masks

    def allowed(self, matchers: list) -> np.ndarray:
        """Bitmasks [B, W] uint32 (``masks``) of each matcher's next step; a row its grammar left
        no token (an error state) may only end (its EOS ids)."""
        bits = self.masks(matchers).view(np.uint32)  # [B, W]
        empty = np.flatnonzero(~bits.any(axis=1))
        if empty.size:
            np.bitwise_or.at(bits, (empty[:, None], self._eos_words[None, :]), self._eos_bits[None, :])
        return bits

    def advance(self, matchers: list, tokens: list) -> None:
        """Feed each matcher its sampled token (a row it leaves in an error state gets only EOS
        allowed from its next mask on)."""
        for m, t in zip(matchers, tokens):
            m.consume_token(int(t))
