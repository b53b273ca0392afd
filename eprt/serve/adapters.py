"""The server's LoRA adapter routes and the ``model`` field's adapter choice (docs/lora.md):
``POST /v1/load_lora_adapter`` {lora_name, lora_path}, ``POST /v1/unload_lora_adapter`` {lora_name},
as vLLM spells them; an unknown model is HTTP 400 before anything is queued (404: unloading an unknown one).
A path to load must lie under ``--lora-modules-dir``: it is checked (``allowed_adapter_dir``) before
the engine opens anything, and any failure to read the adapter is a 400 naming it."""

from __future__ import annotations

import os
import stat

from eprt.api import RequestError
from eprt.engine.adapters import UnknownAdapter
from eprt.model.lora import ADAPTER_CONFIG
from eprt.model.safetensors_io import CheckpointError
from eprt.serve.body import ApiError
from eprt.serve.params import FieldError

SAFETENSORS_INDEX = "model.safetensors.index.json"  # may name files anywhere: never in a loaded adapter
# what a malformed adapter makes its reader raise (LoraError and CheckpointError are ValueErrors)
ADAPTER_READ_ERRORS = (RequestError, OSError, ValueError, TypeError, LookupError)


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


def check_adapters_dir(path: str | None) -> str | None:
    """``--lora-modules-dir`` as its real path (None: runtime loading off); ValueError if not a directory."""
    if path is None:
        return None
    if not os.path.isdir(path):
        raise ValueError(f"--lora-modules-dir {path!r} is not a directory")
    return os.path.realpath(path)


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([root, path]) == root


def allowed_adapter_dir(lora_path: str, root: str | None) -> str:
    """The real path of the adapter directory ``lora_path`` names (relative: to ``root``), after
    checking without opening any file that it and every file the loader reads (adapter_config.json,
    the .safetensors files) are regular files under ``root``, symlinks resolved; ApiError (400) else."""
    if root is None:
        raise ApiError(
            400,
            "loading LoRA adapters at run time is off: start the server with --lora-modules-dir DIR "
            "to allow adapters under DIR",
            param="lora_path",
        )
    shown = f"lora_path {lora_path!r:.200}"
    if "\0" in lora_path:
        raise ApiError(400, f"{shown} has a NUL character", param="lora_path")
    named = os.path.normpath(os.path.join(root, lora_path))  # an absolute lora_path stays itself
    try:
        real = os.path.realpath(named) if _inside(named, root) else named  # nothing outside looked up
        if not _inside(real, root):
            raise ApiError(400, f"{shown} is outside --lora-modules-dir", param="lora_path")
        names = os.listdir(real)  # a directory under root
        if SAFETENSORS_INDEX in names:
            raise ApiError(400, f"{shown} has a {SAFETENSORS_INDEX}: a PEFT adapter has none", param="lora_path")
        for name in names:
            if name != ADAPTER_CONFIG and not name.endswith(".safetensors"):
                continue  # never read
            target = os.path.realpath(os.path.join(real, name))
            if not _inside(target, root) or not stat.S_ISREG(os.stat(target).st_mode):
                raise ApiError(
                    400, f"{shown}: {name} is not a regular file under --lora-modules-dir", param="lora_path"
                )
    except OSError as e:
        raise ApiError(400, f"{shown}: {e.strerror or e}", param="lora_path") from None
    return real


def _field(body, name: str) -> str:
    v = body.get(name) if isinstance(body, dict) else None
    if not isinstance(v, str) or not v:
        raise ApiError(400, f"{name} must be a non-empty string", param=name)
    return v


def load_adapter(engine, body, root: str | None) -> str:
    """Register the adapter (its path checked against ``root``, then read and checked on rank 0
    now); the message of the 200 answer."""
    name, lora_path = _field(body, "lora_name"), _field(body, "lora_path")
    path = allowed_adapter_dir(lora_path, root)
    try:
        engine.load_adapter(name, path)
    except ADAPTER_READ_ERRORS as e:  # not CheckpointError etc.: a field of a type the reader did not check
        why = str(e) if isinstance(e, (CheckpointError, RequestError, OSError)) else f"{type(e).__name__}: {e}"
        raise ApiError(400, f"cannot load LoRA adapter {name!r}: {why}", param="lora_path") from None
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
