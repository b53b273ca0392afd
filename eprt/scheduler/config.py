"""The scheduler's settings, and the checks a request must pass before it is queued."""

from __future__ import annotations

from dataclasses import dataclass

from eprt.api import RANGES, TOKEN_ID_LIMIT, GenerationRequest, RequestError, is_int


@dataclass(frozen=True)
class SchedulerConfig:
    vocab_size: int
    eos_token_ids: tuple = ()
    max_batch: int = 8
    max_prefill_tokens: int = 0  # > 0: chunked prefill with this per-tick budget
    block_size: int = 16  # must match the model's block manager
    max_model_len: int | None = None  # context limit, prompt included
    num_speculative_tokens: int = 0  # > 0: the verify lane proposes up to this many drafts per sequence

    def __post_init__(self) -> None:
        if not 1 <= self.vocab_size <= TOKEN_ID_LIMIT:
            raise ValueError(f"vocab_size must be in [1, {TOKEN_ID_LIMIT:#x}], got {self.vocab_size}")
        for name in ("max_batch", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.num_speculative_tokens <= 4:
            raise ValueError(f"num_speculative_tokens must be in [0, 4], got {self.num_speculative_tokens}")
        if self.max_prefill_tokens < 0:
            raise ValueError(f"max_prefill_tokens must be >= 0, got {self.max_prefill_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


def validate_request(cfg: SchedulerConfig, request: GenerationRequest) -> list:
    """The prompt as a list of ints, or RequestError naming what is wrong."""
    if isinstance(request.prompt_ids, (str, bytes)) or not hasattr(request.prompt_ids, "__iter__"):
        raise RequestError(f"the prompt must be a list of token ids, got {type(request.prompt_ids).__name__}")
    prompt = list(request.prompt_ids)
    if not prompt:
        raise RequestError("the prompt is empty")
    for t in prompt:
        if not is_int(t) or not 0 <= t < cfg.vocab_size:
            raise RequestError(f"prompt token {t!r} is outside the vocabulary [0, {cfg.vocab_size})")
    request.params.validate(cfg.vocab_size)
    if cfg.max_model_len is not None and len(prompt) >= cfg.max_model_len:
        raise RequestError(
            f"the prompt has {len(prompt)} tokens but max_model_len={cfg.max_model_len} "
            f"leaves room for at most {cfg.max_model_len - 1}"
        )
    if request.timeout_s is not None:
        RANGES["timeout"].check("timeout", request.timeout_s)
    return [int(t) for t in prompt]
