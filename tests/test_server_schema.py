"""``/openapi.json``: a valid OpenAPI document whose request bodies are typed (schema-based
clients and fuzzers can run on it) and agree with what the server accepts; ``/v1/models/{id}``."""

from __future__ import annotations

import httpx
import jsonschema
import pytest
from fake_engine import FakeEngine
from openapi_spec_validator import validate
from test_server import running_server
from test_server_lora import LoraFakeEngine, adapter_dir

BODIES = {
    "/v1/completions": "CompletionRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/load_lora_adapter": "LoadLoraAdapterRequest",
    "/v1/unload_lora_adapter": "UnloadLoraAdapterRequest",
    "/tokenize": "TokenizeRequest",
    "/detokenize": "DetokenizeRequest",
}


@pytest.fixture(scope="module")
def doc():
    with running_server(FakeEngine()) as url, httpx.Client(base_url=url) as c:
        r = c.get("/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    return r.json()


def _schema(doc, name: str):
    """Component ``name`` as a JSON schema that resolves the document's references."""
    return {**doc["components"]["schemas"][name], "components": doc["components"]}


def test_the_document_is_valid_openapi_and_lists_every_route(doc):
    validate(doc)
    assert set(doc["paths"]) == {"/health", "/metrics", "/v1/models", "/v1/models/{model}", "/version", *BODIES}
    for path, item in doc["paths"].items():
        for op in item.values():
            assert "422" not in op["responses"], path  # a bad request is a 400 with an OpenAI body
            assert op["responses"]["default"]["content"]["application/json"]["schema"]["$ref"].endswith(
                "/ErrorResponse"
            )


def test_every_post_body_is_a_typed_model(doc):
    for path, name in BODIES.items():
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["required"] and body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{name}"
        }
    completion = doc["components"]["schemas"]["CompletionRequest"]
    assert "prompt" in completion["required"] and completion["additionalProperties"] is True  # unknown: ignored
    props = completion["properties"]
    assert props["max_tokens"]["anyOf"][0] == {"type": "integer"} and props["echo"]["type"] == "boolean"
    assert props["logprobs"]["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": 20}
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["required"] == ["messages"] and chat["properties"]["messages"]["items"]["$ref"].endswith("ChatMessage")
    assert doc["components"]["schemas"]["LoadLoraAdapterRequest"]["required"] == ["lora_name", "lora_path"]


# (body, what the server answers) for bodies the schema accepts and refuses
COMPLETIONS = [
    ({"prompt": "ab", "max_tokens": 2, "temperature": 0.5, "stop": ["x", 3], "top_k": 4}, 200),
    ({"prompt": [97, 98], "max_tokens": 2, "logit_bias": {"5": 1.0}, "unknown_field": 1}, 200),
    ({"prompt": "ab", "max_tokens": "2"}, 400),
    ({"prompt": 5}, 400),
    ({"prompt": "ab", "echo": None}, 400),
    ({"prompt": "ab", "model": None}, 400),
    ({"max_tokens": 2}, 400),
]
CHATS = [
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, 200),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 2}, 200),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400),
    ({"messages": []}, 400),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 3}, 400),
]
TOKENIZES = [
    ({"prompt": "ab", "return_token_strs": True}, 200),
    ({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}, 200),
    ({"prompt": 5}, 400),
    ({"prompt": "ab", "add_special_tokens": "yes"}, 400),
]
DETOKENIZES = [
    ({"tokens": [97, 98]}, 200),
    ({"tokens": "ab"}, 400),
    ({"tokens": [97, 1.5]}, 400),
]


ROUTES = [
    ("/v1/completions", "CompletionRequest", "CompletionResponse", COMPLETIONS),
    ("/v1/chat/completions", "ChatCompletionRequest", "CompletionResponse", CHATS),
    ("/tokenize", "TokenizeRequest", "TokenizeResponse", TOKENIZES),
    ("/detokenize", "DetokenizeRequest", "DetokenizeResponse", DETOKENIZES),
]


@pytest.mark.parametrize("path, name, answer, cases", ROUTES)
def test_the_schema_agrees_with_the_server_on_types(doc, path, name, answer, cases):
    validator = jsonschema.Draft202012Validator(_schema(doc, name))
    answer = _schema(doc, answer)
    with running_server(FakeEngine()) as url, httpx.Client(base_url=url, timeout=20) as c:
        for body, status in cases:
            assert validator.is_valid(body) == (status == 200), body
            r = c.post(path, json=body)
            assert r.status_code == status, (body, r.text)
            jsonschema.validate(r.json(), answer if status == 200 else _schema(doc, "ErrorResponse"))


def test_retrieve_a_model(tmp_path):
    import os

    engine = LoraFakeEngine()
    settings = dict(served_model_name="org/base", lora_dir=os.path.realpath(tmp_path))
    with running_server(engine, **settings) as url, httpx.Client(base_url=url) as c:
        assert c.get("/v1/models/org/base").json() == c.get("/v1/models").json()["data"][0]  # an id with a slash
        c.post("/v1/load_lora_adapter", json={"lora_name": "fr", "lora_path": adapter_dir(tmp_path, "fr")})
        assert c.get("/v1/models/fr").json()["parent"] == "org/base"
        for missing in ("/v1/models/nope", "/v1/models/", "/v1/models/org"):
            r = c.get(missing)
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", (missing, r.text)
        assert 'route="/v1/models/{model}",status="404"} 3.0' in c.get("/metrics").text


def test_with_a_key_the_document_needs_it_and_says_so():
    with running_server(FakeEngine(), api_key="s3cret") as url, httpx.Client(base_url=url) as c:
        assert c.get("/openapi.json").status_code == 401
        doc = c.get("/openapi.json", headers={"Authorization": "Bearer s3cret"}).json()
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert doc["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/health"]["get"]
