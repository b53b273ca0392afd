"""Structured outputs (llguidance) on the default model and its byte tokenizer: json_schema
outputs parse and validate, guided choice / regex / grammar match, forks keep their own grammar
state, and the server answers bad or doubled constraints with a 400 naming the field."""

import json
import re

import httpx
import jsonschema
import numpy as np
import pytest
from test_server import running_server

from eprt.api import GenerationRequest, Guide, RequestError, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.model.tokenizer import ByteTokenizer

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 99}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        },
        "required": ["ok", "color", "tags"],
        "additionalProperties": False,
    },
    {"type": "string", "pattern": "^[A-Z][a-z]{2,8}$"},
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["x"],
                "additionalProperties": False,
            },
            "label": {"type": ["string", "null"], "maxLength": 6},
        },
        "required": ["point", "label"],
        "additionalProperties": False,
    },
]
PROMPT = ByteTokenizer().encode("Here is the data: ")


@pytest.fixture(scope="module")
def engine():
    with launch_engine(EngineConfig(model=None, device="cpu", max_batch=8)) as e:
        yield e


def _texts(engine, guide, temperatures=(0.0, 0.8, 1.2), max_tokens=160):
    reqs = [
        GenerationRequest(PROMPT, SamplingParams(max_tokens=max_tokens, temperature=t, seed=s, guide=guide))
        for t in temperatures
        for s in ((0,) if t == 0.0 else (1, 2))
    ]
    results = engine.generate(reqs)
    assert all(r.finish_reason == "stop" for r in results), [(r.text, r.finish_reason) for r in results]
    return [r.text for r in results]


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_json_schema_outputs_parse_and_validate(engine, schema):
    for text in _texts(engine, Guide("json_schema", json.dumps(schema))):
        jsonschema.validate(json.loads(text), schema)


def test_json_object_outputs_are_objects(engine):
    guide = Guide("json_schema", json.dumps({"type": "object", "maxProperties": 0}))  # bounded for a tiny model
    assert all(json.loads(t) == {} for t in _texts(engine, guide))
    (res,) = engine.generate([GenerationRequest(PROMPT, SamplingParams(max_tokens=12, guide=Guide("json_object")))])
    assert res.text.startswith("{")  # an object begins, whatever the model would have said


def test_guided_choice_regex_and_grammar(engine):
    assert set(_texts(engine, Guide("choice", json.dumps(["yes", "no", "maybe"])))) <= {"yes", "no", "maybe"}
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", t) for t in _texts(engine, Guide("regex", r"[0-9]{3}-[a-z]{2}")))
    lark = 'start: "(" num ("," num)? ")"\nnum: /[0-9]{1,2}/'
    assert all(re.fullmatch(r"\(\d{1,2}(,\d{1,2})?\)", t) for t in _texts(engine, Guide("grammar", lark)))


def test_forked_choices_follow_the_grammar_each(engine):
    schema = SCHEMAS[2]
    params = SamplingParams(
        max_tokens=160, temperature=1.0, seed=4, n=4, guide=Guide("json_schema", json.dumps(schema))
    )
    (choices,) = engine.generate_choices([GenerationRequest(PROMPT, params)])
    for r in choices:
        jsonschema.validate(json.loads(r.text), schema)
    assert len({r.text for r in choices}) > 1


def test_an_uncompilable_guide_is_a_request_error(engine):
    for guide in (Guide("json_schema", '{"type": "nonsense"}'), Guide("regex", "[a-z"), Guide("grammar", "start: ???")):
        with pytest.raises(RequestError, match="cannot be compiled"):
            engine.submit(GenerationRequest(PROMPT, SamplingParams(guide=guide)))


@pytest.fixture(scope="module")
def base(engine):
    with running_server(engine) as url:
        yield url


def _post(base, body, path="/v1/completions"):
    with httpx.Client(base_url=base, timeout=60) as c:
        return c.post(path, json={"prompt": "Here is the data: ", "max_tokens": 120, **body})


def test_server_response_format_json_schema_and_vllm_fields(base):
    schema = SCHEMAS[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    chat = {"messages": [{"role": "user", "content": "Who?"}], "max_tokens": 120, "response_format": fmt}
    with httpx.Client(base_url=base, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=chat).json()
    jsonschema.validate(json.loads(r["choices"][0]["message"]["content"]), schema)
    r = _post(base, {"guided_choice": ["left", "right"], "temperature": 0.9, "seed": 3}).json()
    assert r["choices"][0]["text"] in ("left", "right")
    r = _post(base, {"structured_outputs": {"regex": "[A-Z]{4}"}}).json()
    assert re.fullmatch("[A-Z]{4}", r["choices"][0]["text"])
    r = _post(base, {"guided_json": json.dumps(SCHEMAS[1])}).json()
    jsonschema.validate(json.loads(r["choices"][0]["text"]), SCHEMAS[1])


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_regex": "[a-z"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ],
)
def test_server_bad_constraints_are_400_naming_the_field(base, body, param):
    r = _post(base, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_tokenizer_json_model_gets_masks_of_whole_tokens():
    """A checkpoint's tokenizer.json (byte-level BPE here): the mask allows exactly the tokens
    whose text keeps the output inside the grammar, multi-character ones included."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from eprt.engine.structured import GrammarCompiler, GuidedRows
    from eprt.model.tokenizer import Tokenizer

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], initial_alphabet=alphabet)
    hf.train_from_iterator(["the cat sat on the mat 123 456 789 12"] * 20, trainer)
    eos = hf.token_to_id("<eos>")
    tok = Tokenizer(hf, [eos])
    compiler = GrammarCompiler(tok, hf.get_vocab_size(), [eos])
    rows = GuidedRows(compiler)
    matcher = compiler.matcher(Guide("regex", "[0-9]{3}"))

    def allowed_ids():
        bits = rows.allowed([matcher])  # [1, W]
        return np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[: hf.get_vocab_size()])

    texts = {tok.decode([int(i)]) for i in allowed_ids()}
    assert texts == {t for t in (tok.decode([i]) for i in range(hf.get_vocab_size())) if re.fullmatch("[0-9]{1,3}", t)}
    assert any(len(t) > 1 for t in texts)
    rows.advance([matcher], [hf.token_to_id("12")])
    after = {tok.decode([int(i)]) for i in allowed_ids()}
    assert after == {str(d) for d in range(10)}


def test_eprt_run_lines_take_the_guided_fields(tmp_path):
    import io

    from eprt.serve.batch import run_batch

    lines = [
        {"id": "choice", "prompt": "Pick: ", "guided_choice": ["alpha", "beta"], "temperature": 0.9, "seed": 1},
        {
            "id": "json",
            "prompt": "Data: ",
            "max_tokens": 160,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[2]}},
        },
        {"id": "bad", "prompt": "Data: ", "guided_regex": "(unclosed"},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    with launch_engine(EngineConfig(model=None, device="cpu", max_batch=8)) as engine:  # not the server's
        run_batch(engine, str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), progress_stream=io.StringIO())
    out = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert out["choice"]["text"] in ("alpha", "beta")
    jsonschema.validate(json.loads(out["json"]["text"]), SCHEMAS[2])
    assert "guided_regex" in out["bad"]["error"] and "cannot be compiled" in out["bad"]["error"]


def test_guided_rows_with_speculation_on_follow_the_grammar_and_plain_decoding():
    """A guided row keeps its step a plain decode step (no verify readback without the mask). Both
    engines start with an empty prefix cache: a prefix hit computes fewer rows, whose bits may differ."""
    schema = {"type": "array", "items": {"type": "integer", "maximum": 99}, "maxItems": 4}
    guided = SamplingParams(max_tokens=24, guide=Guide("json_schema", json.dumps(schema)))
    # the default model loops, so prompt lookup drafts for the plain row in the same batch
    requests = [GenerationRequest(PROMPT, guided), GenerationRequest(PROMPT, SamplingParams(max_tokens=24))]
    with launch_engine(EngineConfig(model=None, device="cpu", max_batch=8)) as engine:
        plain = [r.token_ids for r in engine.generate(requests)]
    cfg = EngineConfig(model=None, device="cpu", max_batch=8, speculative_method="ngram", num_speculative_tokens=3)
    with launch_engine(cfg) as spec:
        results = spec.generate(requests)
    assert [r.token_ids for r in results] == plain
    json.loads(results[0].text)


def _ids(bits: np.ndarray, vocab_size: int) -> list:
    """The allowed token ids of each row of bitmasks [B, W]."""
    keep = np.unpackbits(bits.view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    return [np.flatnonzero(row).tolist() for row in keep]


@pytest.mark.parametrize("parallel_vocab", [4096, 0], ids=["per row", "llguidance threads"])
def test_guided_rows_copied_from_a_template_give_a_fresh_matchers_masks(monkeypatch, parallel_vocab):
    """Matchers copied from a guide's template (sharing its lexer cache, rebuilt after
    TEMPLATE_COPIES copies) step by step allow exactly what a fresh matcher of the grammar does,
    each row on its own path, filled one call per row or on llguidance's threads; a row its
    grammar left in an error state may only end."""
    import llguidance

    from eprt.engine import structured
    from eprt.engine.structured import GrammarCompiler, GuidedRows

    monkeypatch.setattr(structured, "TEMPLATE_COPIES", 3)
    monkeypatch.setattr(structured, "PARALLEL_VOCAB", parallel_vocab)
    V, eos = 258, ByteTokenizer.EOS
    compiler = GrammarCompiler(ByteTokenizer(), V, [eos])
    rows = GuidedRows(compiler)
    guide = Guide("json_schema", json.dumps(SCHEMAS[0]))
    matchers = [compiler.matcher(guide) for _ in range(8)]  # two template rebuilds on the way
    fresh = [llguidance.LLMatcher(compiler._lltok(), compiler.grammar(guide)) for _ in range(8)]
    rng = np.random.default_rng(3)
    for _ in range(40):
        got, want = _ids(rows.allowed(matchers), V), _ids(rows.allowed(fresh), V)
        assert got == want
        tokens = [int(rng.choice(ids)) for ids in got]
        rows.advance(matchers, tokens)
        rows.advance(fresh, tokens)
    assert len({tuple(ids) for ids in got}) > 1  # the rows went their own ways
    broken = compiler.matcher(Guide("regex", "[0-9]+"))
    rows.advance([broken], [ord("x")])
    assert broken.is_error() and _ids(rows.allowed([broken]), V) == [[eos]]


def test_guided_rows_among_greedy_and_sampled_unguided_rows_keep_their_masks():
    """A batch whose host-sampled rows are not all guided (greedy plain rows take the device
    argmax): each guided row gets its own mask, the unguided rows none. (Its own engine: the
    module's runs the server's loop from the server tests on.)"""
    schema = SCHEMAS[1]
    guided = [
        SamplingParams(max_tokens=60, temperature=t, seed=3, guide=Guide("json_schema", json.dumps(schema)))
        for t in (0.0, 0.9)
    ]
    plain = [
        SamplingParams(max_tokens=20, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.9, seed=4, ignore_eos=True),
    ]
    order = [plain[0], guided[0], plain[1], plain[0], guided[1]]
    with launch_engine(EngineConfig(model=None, device="cpu", max_batch=8)) as engine:
        results = engine.generate([GenerationRequest(PROMPT, p) for p in order])
    for i in (1, 4):
        jsonschema.validate(json.loads(results[i].text), schema)
    assert not all(results[i].text.startswith("[") for i in (0, 2, 3))
