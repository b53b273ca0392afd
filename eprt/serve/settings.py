"""The settings of ``eprt serve``'s HTTP side, importable without the web stack (FastAPI,
uvicorn): ``eprt serve --help`` and the command line's checks need them before anything heavy."""

from __future__ import annotations

from dataclasses import dataclass

from eprt.serve.body import DEFAULT_MAX_BODY_BYTES
from eprt.serve.media import MediaPolicy
from eprt.serve.params import DEFAULT_CHAT_MAX_TOKENS
from eprt.serve.tool_calls import ToolSettings

# Longer than the idle time of common clients' pools (httpx 5 s, aiohttp 15 s, Go and hyper 90 s),
# so that the client, not the server, closes an idle connection: a server closing one races with
# the client's next request on it, which then dies with a reset (docs/serving.md, "Keep-alive")
KEEP_ALIVE_S = 120.0


@dataclass(frozen=True)
class HttpSettings:
    api_key: str | None = None  # None: no authentication (an empty or blank key is refused here)
    served_model_name: str | None = None  # the model name clients see (default: the engine's)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    http_timeout_s: float = 30.0  # a request's headers, and then its body, must arrive within this
    keep_alive_s: float = KEEP_ALIVE_S  # an idle keep-alive connection is closed after this
    backlog: int = 2048  # pending TCP connections the kernel queues for us
    media: MediaPolicy = MediaPolicy()  # where chat image parts may come from (--allowed-local-media-path)
    lora_dir: str | None = None  # the real path of --lora-modules-dir (None: no adapter loading at run time)
    chat_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS  # a chat's max_tokens when it sets none (0: the context's rest)
    reasoning_parser: str | None = None  # --reasoning-parser (auto, none, a name; None: none)
    tools: ToolSettings = ToolSettings()  # --enable-auto-tool-choice, --tool-call-parser

    def __post_init__(self):
        check_api_key(self.api_key, "the API key")


def check_api_key(key: str | None, source: str = "--api-key") -> str | None:
    """``key`` itself, None for no key; ValueError naming ``source`` for an empty or whitespace
    key (an unset variable in ``--api-key "$KEY"`` or ``EPRT_API_KEY=$KEY`` must not turn
    authentication off)."""
    if key is not None and not key.strip():
        raise ValueError(
            f"{source} is {key!r}: an empty key would turn authentication off; "
            f"give a real key, or leave --api-key and EPRT_API_KEY unset to serve without one"
        )
    return key
