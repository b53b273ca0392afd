"""Structured-output fields of a request -> an ``eprt.api.Guide``: OpenAI's ``response_format``
(json_object, json_schema) and vLLM's ``structured_outputs`` / ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``; at most one of them (docs/serving.md, "Structured outputs").
"""

from __future__ import annotations

import json

from eprt.api import Guide, RequestError
from eprt.serve.params import FieldError

GUIDED_FIELDS = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _schema_text(value, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise FieldError(param, f"{param} is not valid JSON: {e}") from None
    if not isinstance(value, (dict, bool)):
        raise FieldError(param, f"{param} must be a JSON schema (an object), got {type(value).__name__}")
    return json.dumps(value)


def _guide(kind: str, value, param: str) -> Guide:
    if kind == "json_schema":
        return Guide(kind, _schema_text(value, param))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise FieldError(param, f"{param} must be a non-empty list of non-empty strings, got {value!r:.80}")
        return Guide(kind, json.dumps(value))
    if not isinstance(value, str) or not value:
        raise FieldError(param, f"{param} must be a non-empty string, got {value!r:.80}")
    return Guide(kind, value)


def _response_format(value) -> Guide | None:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise FieldError(
            "response_format",
            f'response_format must be {{"type": "text" | "json_object" | "json_schema"}}, got {value!r:.80}',
        )
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return Guide("json_object")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise FieldError(
            "response_format", 'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}'
        )
    return _guide("json_schema", spec["schema"], "response_format")


def _structured_outputs(value) -> Guide | None:
    if not isinstance(value, dict):
        raise FieldError("structured_outputs", f"structured_outputs must be an object, got {value!r:.80}")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    if given.keys() - STRUCTURED_KEYS.keys() - {"json_object"}:
        bad = sorted(given.keys() - STRUCTURED_KEYS.keys() - {"json_object"})[0]
        raise FieldError(
            "structured_outputs",
            f"structured_outputs.{bad} is not supported (json, json_object, regex, choice, grammar)",
        )
    if len(given) > 1:
        raise FieldError(
            "structured_outputs",
            f"structured_outputs gives {len(given)} constraints ({', '.join(sorted(given))}); give one",
        )
    if not given:
        return None
    ((key, v),) = given.items()
    return Guide("json_object") if key == "json_object" else _guide(STRUCTURED_KEYS[key], v, "structured_outputs")


def parse_guide(body: dict) -> tuple[Guide | None, str | None]:
    """(the request's guide, the field that gave it); FieldError for a bad value or two of them."""
    found = []
    if body.get("response_format") is not None:
        guide = _response_format(body["response_format"])
        if guide is not None:
            found.append((guide, "response_format"))
    if body.get("structured_outputs") is not None:
        guide = _structured_outputs(body["structured_outputs"])
        if guide is not None:
            found.append((guide, "structured_outputs"))
    for name, kind in GUIDED_FIELDS.items():
        if body.get(name) is not None:
            found.append((_guide(kind, body[name], name), name))
    if len(found) > 1:
        raise FieldError(found[1][1], f"{found[0][1]} and {found[1][1]} both constrain the output; give one")
    return found[0] if found else (None, None)


def compile_guide(engine, guide: Guide | None, param: str | None) -> None:
    """The engine's compile check of ``guide`` as a FieldError naming ``param`` (a 400)."""
    if guide is None:
        return
    try:
        engine.compile_guide(guide)
    except RequestError as e:
        raise FieldError(param, f"{param}: {e}") from None
