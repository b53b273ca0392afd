"""The HTTP API as pydantic models, for ``/openapi.json`` (schema-based clients and fuzzers).

These models document the bodies; they do not validate them. The server reads each body itself
(size limit and deadline: body.py), type-checks the generation fields with ``openai``'s models
(which the request models here extend) and checks the values in ``params`` (the ranges there
are the truth; the schema gives only those kept as constants). Unknown fields are allowed
(``additionalProperties``), as the server ignores them with a warning line (docs/serving.md).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
from pydantic.json_schema import models_json_schema

from eprt.api import MAX_CHOICES, MAX_LOGPROBS
from eprt.serve.openai import CHAT_ROLES, ChatCompletionBody, CompletionBody
from eprt.serve.params import MAX_BAD_WORDS, MAX_STOPS, MAX_TOKEN_LIST
from eprt.serve.tool_calls import MAX_TOOLS

Logprobs = Field(None, ge=0, le=MAX_LOGPROBS)
TokenIds = list[StrictInt]


def _no_default(field: dict) -> None:
    field.pop("default", None)  # optional, but not nullable


class _Processing(BaseModel):
    """The logits processing, structured-output and metadata fields both routes take."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr = Field(
        None, description="the served model or a LoRA adapter (default: the base model)", json_schema_extra=_no_default
    )
    n: StrictInt | None = Field(None, ge=1, le=MAX_CHOICES)
    best_of: StrictInt | None = Field(None, ge=1, le=MAX_CHOICES, description="at least n")
    stop: StrictStr | list[StrictStr | StrictInt] | None = Field(None, description=f"at most {MAX_STOPS} entries")
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    logit_bias: dict[str, StrictFloat] | None = Field(None, description="token id -> bias")
    min_tokens: StrictInt | None = Field(None, ge=0)
    min_p: StrictFloat | None = None
    bad_words: list[StrictStr] | None = Field(None, max_length=MAX_BAD_WORDS)
    allowed_token_ids: TokenIds | None = Field(None, max_length=MAX_TOKEN_LIST)
    ignore_eos: StrictBool | None = None
    stop_token_ids: TokenIds | None = None
    prompt_logprobs: StrictInt | None = Logprobs
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictBool | StrictStr | None = Field(None, description="a JSON schema, or its text")
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    user: StrictStr | None = None
    request_id: StrictStr | None = None
    return_token_ids: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = Field(
        None, description="vLLM: the matched stop string ends the text"
    )
    truncate_prompt_tokens: StrictInt | None = Field(
        None, ge=-1, description="vLLM: keep the prompt's last k tokens (-1: max_model_len)"
    )


class CompletionRequest(_Processing, CompletionBody):
    """POST /v1/completions."""

    prompt: StrictStr | TokenIds | list[StrictStr | TokenIds] = Field(
        description="text or token ids, or a list of prompts (choice k of prompt p is choice p * n + k)"
    )
    echo: StrictBool = False
    logprobs: StrictInt | None = Logprobs


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="allow")
    url: StrictStr = Field(description="a data: URL, or file:// under --allowed-local-media-path")


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageUrl


class FunctionCall(BaseModel):
    name: StrictStr
    arguments: StrictStr | dict[str, Any] = Field(description="the arguments object, as JSON text")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
    content: StrictStr | list[TextPart | ImagePart] | None = Field(description="null: an assistant's tool calls alone")
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant's calls")
    tool_call_id: StrictStr | None = Field(None, description="a tool message's call")
    reasoning_content: StrictStr | None = Field(None, description="an assistant's reasoning (also: reasoning)")


class Function(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr = Field(min_length=1, max_length=64)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema")


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: Function


class ChatCompletionRequest(_Processing, ChatCompletionBody):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Logprobs
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = Field(
        None, description='or {"type": "function", "function": {"name": ...}}; "auto" needs --enable-auto-tool-choice'
    )
    parallel_tool_calls: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="the chat template's variables")
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = Field(
        None, description="the chat template's reasoning_effort variable (gpt-oss reads it)"
    )
    max_thinking_tokens: StrictInt | None = Field(None, ge=0, description="needs --reasoning-parser")
    thinking_token_budget: StrictInt | None = Field(None, ge=0, description="vLLM's name of max_thinking_tokens")


class LoadLoraAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter: the adapter directory must lie under --lora-modules-dir."""

    lora_name: StrictStr = Field(min_length=1)
    lora_path: StrictStr = Field(min_length=1, description="absolute, or relative to --lora-modules-dir")


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: StrictStr = Field(min_length=1)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx answer (OpenAI's error body)."""

    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = Field(None, description="the base model's context")
    parent: str | None = Field(None, description="a LoRA adapter's base model")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    """A non-streamed answer (``stream: true`` answers text/event-stream chunks of this shape)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: Usage


class Health(BaseModel):
    status: str


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): exactly one of prompt or messages."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = Field(None, description="default: true for prompt, false for messages")
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS, description="with messages: as a chat renders them")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="with messages: the template's variables")
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = Field(
        None, description="with messages: the template's reasoning_effort variable"
    )


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    tokens: TokenIds


class DetokenizeResponse(BaseModel):
    prompt: str


class Version(BaseModel):
    version: str


MODELS = (CompletionRequest, ChatCompletionRequest, LoadLoraAdapterRequest, UnloadLoraAdapterRequest)
MODELS += (ErrorResponse, ModelList, ModelCard, CompletionResponse, Health)
MODELS += (TokenizeRequest, TokenizeResponse, DetokenizeRequest, DetokenizeResponse, Version)


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel]) -> dict:
    return {"application/json": {"schema": _ref(model)}}


ERRORS = {"default": {"description": "an error (4xx, 5xx)", "content": _json(ErrorResponse)}}
TEXT = {"text/plain": {"schema": {"type": "string"}}}


def operation(
    answer: type[BaseModel] | None, body: type[BaseModel] | None = None, stream: bool = False, text=False
) -> dict:
    """The ``openapi_extra`` of a route: its request body's model, its answer's, the error body."""
    ok = _json(answer) if answer is not None else {}
    if stream:
        ok["text/event-stream"] = {"schema": {"type": "string", "description": "data: <chunk> events, then [DONE]"}}
    if text:
        ok.update(TEXT)
    spec: dict = {"responses": {"200": {"description": "OK", "content": ok}, **ERRORS}}
    if body is not None:
        spec["requestBody"] = {"required": True, "content": _json(body)}
    return spec


def openapi(app, api_key: bool) -> dict:
    """The OpenAPI document of ``app``: FastAPI's paths, these models as its components, FastAPI's
    422 answers removed (a bad request is a 400 here), and the bearer key when the server has one."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    _, defs = models_json_schema([(m, "validation") for m in MODELS], ref_template="#/components/schemas/{model}")
    doc.setdefault("components", {})["schemas"] = defs["$defs"]
    for path, item in doc["paths"].items():
        for op in item.values():
            op["responses"].pop("422", None)
            if api_key and path != "/health":
                op["security"] = [{"bearer": []}]
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc
