"""Thinking blocks on the real engine (the default model, its byte tokenizer): the scheduler's
count is the tokens inside the block, the sampler masks EOS inside it and forces the end token
once the budget is spent, a structured-output grammar applies after the block (and lets a row
open one at its first token), and speculation leaves the tokens unchanged."""

import json

import jsonschema
import pytest

from eprt.api import GenerationRequest, Guide, SamplingParams, Thinking
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.model.tokenizer import ByteTokenizer
from eprt.scheduler import thinking

# the block starts with BOS (special: no grammar writes it) and ends with a byte
START, END, EOS = ByteTokenizer.BOS, ord("}") + 1, ByteTokenizer.EOS
PROMPT = ByteTokenizer().encode("Think about the data: ")
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "s": {"type": "string", "maxLength": 4}},
    "required": ["n", "s"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine():
    with launch_engine(EngineConfig(model=None, device="cpu", max_batch=8)) as e:
        yield e


def run(engine, prompt, **params):
    (result,) = engine.generate([GenerationRequest(list(prompt), SamplingParams(**params))])
    return result


def test_the_budget_forces_the_end_token_and_the_count_is_the_tokens_inside(engine):
    out = run(engine, PROMPT + [START], max_tokens=12, thinking=Thinking(START, END, budget=5))
    assert out.token_ids[5] == END and END not in out.token_ids[:5]
    assert out.reasoning_tokens == 5
    free = run(engine, PROMPT + [START], max_tokens=12)  # no thinking: the same first five tokens
    assert free.token_ids[:5] == out.token_ids[:5] and free.reasoning_tokens is None


def test_eos_is_masked_inside_the_block_only(engine):
    """EOS biased to +100: inside the block the model cannot end; right after the forced end it does."""
    bias = ((EOS, 100.0),)
    out = run(engine, PROMPT + [START], max_tokens=12, logit_bias=bias, thinking=Thinking(START, END, budget=3))
    assert EOS not in out.token_ids[:3] and out.token_ids[3:] == [END, EOS]
    assert out.finish_reason == "stop" and out.reasoning_tokens == 3
    spec = Thinking(START, END)
    ignored = run(engine, PROMPT + [START], max_tokens=4, logit_bias=bias, ignore_eos=True, thinking=spec)
    assert ignored.token_ids == [EOS] * 4 and ignored.reasoning_tokens == 4  # an ordinary token then


def test_a_grammar_applies_after_the_block(engine):
    guide = Guide("json_schema", json.dumps(SCHEMA))
    out = run(engine, PROMPT + [START], max_tokens=60, guide=guide, thinking=Thinking(START, END, budget=4))
    assert out.reasoning_tokens == 4 and out.token_ids[4] == END
    answer = bytes(out.token_ids[5:-1]).decode()
    assert out.token_ids[-1] == EOS and out.finish_reason == "stop"
    jsonschema.validate(json.loads(answer), SCHEMA)


def test_a_guided_row_may_open_a_block_at_its_first_token(engine):
    guide = Guide("json_schema", json.dumps(SCHEMA))
    spec = Thinking(START, END, budget=2)
    out = run(engine, PROMPT, max_tokens=60, guide=guide, logit_bias=((START, 100.0),), thinking=spec)
    assert out.token_ids[0] == START and out.token_ids[3] == END and out.reasoning_tokens == 2
    jsonschema.validate(json.loads(bytes(out.token_ids[4:-1]).decode()), SCHEMA)
    plain = run(engine, PROMPT, max_tokens=60, guide=guide, logit_bias=((START, 100.0),))
    assert START not in plain.token_ids  # without a thinking block the grammar forbids it


def test_speculation_gives_the_same_tokens():
    prompt = ByteTokenizer().encode("abc abc abc abc abc ") + [START] + ByteTokenizer().encode("abc abc abc")
    cfg = dict(model=None, device="cpu", max_batch=4)
    with launch_engine(EngineConfig(**cfg)) as plain:
        want = [run(plain, prompt, max_tokens=24, thinking=Thinking(START, END, budget=b)) for b in (6, None)]
    with launch_engine(EngineConfig(**cfg, speculative_method="ngram", num_speculative_tokens=3)) as spec:
        got = [run(spec, prompt, max_tokens=24, thinking=Thinking(START, END, budget=b)) for b in (6, None)]
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.reasoning_tokens for r in got] == [r.reasoning_tokens for r in want] == [6, 24]


def test_the_state_of_a_prompt():
    spec = Thinking(4, 5)
    assert thinking.begin(spec, [1, 4, 2]).inside and not thinking.begin(spec, [4, 5, 2]).inside
    assert not thinking.begin(spec, [1, 2]).inside and thinking.begin(None, [4]) is None
    state = thinking.begin(Thinking(4, 5, budget=2), [4])
    assert [thinking.take(state, t, (63,)) for t in (7, 63, 8, 9, 63)] == [7, None, 8, 5, 63]
    assert (state.count, state.discarded, state.forced, state.inside) == (2, 1, 1, False)
    assert [thinking.take(state, t, (63,)) for t in (4, 6)] == [4, 5]  # a second block: the budget is spent
