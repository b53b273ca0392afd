"""``eprt serve`` / ``eprt run`` with failures planted in per-request stages (tests/test_fuzz_sampling.py,
tests/test_batch_run.py, tests/test_isolation.py):

    [mpiexec -n N] python planted_faults.py serve|run ARGS...

Each planted failure fires only for requests that carry its marker (every rank installs them, as
the same code runs everywhere; only rank 0 samples, masks and detokenizes):
- ``seed`` PLANTED_SEED with a logits processing field (a penalty): the logits processing raises
  for any batch holding such a row (a failing logits processor); sampled in a verify step
  (speculative decoding), the draw of its positions raises;
- a ``guided_regex`` containing PLANTED_REGEX: filling that grammar's token mask raises (a failing
  structured-output mask); one containing PLANTED_MATCHER: making its matcher raises (when the
  sequence is first admitted);
- the token PLANTED_TOKEN among the ids decoded (force it with ``logit_bias``): the tokenizer's
  decode raises (a failing detokenizer).
"""

from __future__ import annotations

import sys

from eprt import cli
from eprt.engine import sampler, sampling, structured
from eprt.model.tokenizer import ByteTokenizer

PLANTED_SEED = 4242
PLANTED_REGEX = "PLANTED"
PLANTED_MATCHER = "NOMATCHER"
PLANTED_TOKEN = 1  # a control byte the built-in model never writes unforced


def plant(patch=None) -> None:
    """Install the planted failures (``patch``: how to set an attribute; a pytest monkeypatch's
    ``setattr`` undoes them, the default keeps them)."""
    patch = setattr if patch is None else patch.setattr
    process = sampling.process_logits

    def failing_process(x, params, *args, **kwargs):
        if any(p.seed == PLANTED_SEED for p in params):
            raise RuntimeError("planted failure in the logits processing")
        return process(x, params, *args, **kwargs)

    patch(sampling, "process_logits", failing_process)
    draw = sampler.sample_rows  # the verify readback's draw (RowSampler.targets)

    def failing_draw(logits, params, uniforms):
        if any(p.seed == PLANTED_SEED for p in params):
            raise RuntimeError("planted failure in a verify step's sampling")
        return draw(logits, params, uniforms)

    patch(sampler, "sample_rows", failing_draw)

    marked: set = set()  # ids of the matchers of a planted guide
    matcher, allowed = structured.GrammarCompiler.matcher, structured.GuidedRows.allowed

    def marking_matcher(self, guide):
        if PLANTED_MATCHER in guide.spec:
            raise RuntimeError("planted failure making the structured-output matcher")
        m = matcher(self, guide)
        if PLANTED_REGEX in guide.spec:
            marked.add(id(m))
        return m

    def failing_allowed(self, matchers):
        if any(id(m) in marked for m in matchers):
            raise RuntimeError("planted failure in the structured-output mask")
        return allowed(self, matchers)

    patch(structured.GrammarCompiler, "matcher", marking_matcher)
    patch(structured.GuidedRows, "allowed", failing_allowed)

    decode = ByteTokenizer.decode

    def failing_decode(self, ids):
        if PLANTED_TOKEN in list(ids):
            raise ValueError(f"planted failure decoding token {PLANTED_TOKEN}")
        return decode(self, ids)

    patch(ByteTokenizer, "decode", failing_decode)


if __name__ == "__main__":
    plant()
    sys.exit(cli.main(sys.argv[1:]))
