"""Structured outputs on rank 0 with llguidance: a request's Guide compiled against the model's
tokenizer, one matcher per sequence, and a token bitmask per step applied to its logits before
sampling; the next step's masks are computed on a thread while the forward pass runs
(docs/design.md, "Structured outputs"). B guided rows, V vocabulary, W = ceil(V / 32) words.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from eprt.api import Guide, RequestError
from eprt.model.tokenizer import ByteTokenizer

JSON_OBJECT_SCHEMA = '{"type": "object"}'
# JSON without free whitespace (a schema's own "x-guidance" overrides it): a small model would
# otherwise fill its budget with blanks the grammar allows between tokens
GRAMMAR_CACHE = 256  # compiled guides kept (a guide is compiled at submit and again at admission)
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
        self._grammars: OrderedDict[Guide, str] = OrderedDict()

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
        with self._lock:
            if guide in self._grammars:
                self._grammars.move_to_end(guide)
                return self._grammars[guide]
        grammar = self._compile(guide)
        with self._lock:
            self._grammars[guide] = grammar
            if len(self._grammars) > GRAMMAR_CACHE:
                self._grammars.popitem(last=False)
        return grammar

    def _compile(self, guide: Guide) -> str:
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
        ok, message = self._check(grammar)
        if not ok:
            raise RequestError(f"the {guide.kind} cannot be compiled: {message}")
        return grammar

    def _check(self, grammar: str) -> tuple[bool, str]:
        llg = _llguidance()
        try:
            matcher = llg.LLMatcher(self._lltok(), grammar)
        except (ValueError, TypeError, RuntimeError) as e:
            return False, str(e)
        return (not matcher.is_error(), matcher.get_error())

    def matcher(self, guide: Guide):
        """A fresh matcher for one sequence."""
        return _llguidance().LLMatcher(self._lltok(), self.grammar(guide))


class GuidedRows:
    """The matchers of the guided sequences and their masks: ``allowed`` gives a step's masks
    (waiting for the masks computed during the forward pass, or computing them now), ``advance``
    feeds the sampled tokens and starts the next step's masks on a thread."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self.words = (compiler.vocab_size + 31) // 32
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eprt-mask")
        self._executor = None
        self._pending: dict[int, tuple[Future, int]] = {}  # id(matcher) -> (mask job, its row)

    def _fill(self, matchers: list, tokens: list | None = None) -> np.ndarray:
        """Masks [B, W] of the matchers' next step, after feeding them ``tokens`` (one each) if given."""
        llg = _llguidance()
        from llguidance.numpy import fill_next_token_bitmask_par

        if self._executor is None:
            self._executor = llg.LLExecutor()
        for m, t in zip(matchers, tokens or ()):  # one at a time: cheaper than the executor's threads here
            m.consume_token(int(t))
        masks = np.full((len(matchers), self.words), -1, dtype=np.int32)  # [B, W]
        fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], masks)
        return masks

    def masks(self, matchers: list) -> np.ndarray:
        """Allowed tokens [B, V] (bool) of each matcher's next step."""
        rows = [None] * len(matchers)
        todo = []
        for i, m in enumerate(matchers):
            job = self._pending.pop(id(m), None)
            if job is not None:
                rows[i] = job[0].result()[job[1]]
            else:
                todo.append(i)
        if todo:
            for i, row in zip(todo, self._fill([matchers[i] for i in todo])):
                rows[i] = row
        words = np.ascontiguousarray(np.stack(rows))  # [B, W]
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")  # [B, 32 W]
        return bits[:, : self.compiler.vocab_size].astype(bool)

    def allowed(self, matchers: list) -> np.ndarray:
        """Allowed tokens [B, V] (bool) of each matcher's next step; a row its grammar left no
        token (an error state) may only end (its EOS ids)."""
        allowed = self.masks(matchers)  # [B, V]
        allowed[~allowed.any(axis=1)[:, None] & np.isin(np.arange(allowed.shape[1]), self.compiler.eos)] = True
        return allowed

    def advance(self, matchers: list, tokens: list) -> None:
        """Feed each matcher its sampled token and compute its next mask, both on the thread, while
        the next forward pass runs (``masks`` waits for them)."""
        job = self._pool.submit(self._fill, list(matchers), list(tokens))
        for i, m in enumerate(matchers):
            self._pending[id(m)] = (job, i)

    def forget(self, matcher) -> None:
        self._pending.pop(id(matcher), None)
