"""The server's LoRA adapter routes and the ``model`` field's adapter choice (docs/lora.md):
``POST /v1/load_lora_adapter`` {lora_name, lora_path}, ``POST /v1/unload_lora_adapter`` {lora_name},
as vLLM spells them; an unknown model is HTTP 400 before anything is queued (404: unloading an unknown one)."""

from __future__ import annotations

from eprt.api import RequestError
from eprt.engine.adapters import UnknownAdapter
from eprt.model.lora import LoraError
from eprt.serve.body import ApiError
from eprt.serve.params import FieldError


def adapter_names(engine) -> list[str]:
    names = getattr(engine, "adapter_names", None)
    return names() if names is not None else []


def pick_model(engine, model: str, model_name: str) -> str | None:
    """The adapter the request's ``model`` names (None: the base model); FieldError (400) for neither."""
    if model == model_name:
        return None
    names = adapter_names(engine)
    if model in names:
        return model
    raise FieldError(
        "model",
        f"model {model!r:.80} is not served here; this server serves {model_name!r}"
        + (f" and the LoRA adapters {names}" if names else ""),
    )


def model_entries(engine, created: int, base: str) -> list[dict]:
    """/v1/models entries of the adapters (after the base model's)."""
    return [
        {"id": n, "object": "model", "created": created, "owned_by": "eprt", "root": n, "parent": base}
        for n in adapter_names(engine)
    ]


def _field(body, name: str) -> str:
    v = body.get(name) if isinstance(body, dict) else None
    if not isinstance(v, str) or not v:
        raise ApiError(400, f"{name} must be a non-empty string", param=name)
    return v


def load_adapter(engine, body) -> str:
    """Register the adapter (read and checked on rank 0 now); the message of the 200 answer."""
    name, path = _field(body, "lora_name"), _field(body, "lora_path")
    try:
        engine.load_adapter(name, path)
    except (LoraError, RequestError, OSError) as e:
        raise ApiError(400, f"cannot load LoRA adapter {name!r}: {e}", param="lora_path") from None
    return f"Success: LoRA adapter '{name}' added successfully."


def unload_adapter(engine, body) -> str:
    name = _field(body, "lora_name")
    try:
        engine.unload_adapter(name)
    except UnknownAdapter as e:
        raise ApiError(404, str(e), param="lora_name", code="model_not_found") from None
    except RequestError as e:
        raise ApiError(400, str(e), param="lora_name") from None
    return f"Success: LoRA adapter '{name}' removed successfully."
