"""OpenAI wire format: request models (validated by pydantic) and the error shape every failure uses.

Requests are strict (no string-to-number coercion) and closed (an unknown field is a 400 naming it), so a
client never silently gets behaviour it did not ask for. Value ranges are left to `SamplingParams`, the single
source of truth; its `ValueError`s become 400s too.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 128  # choices per request; larger fan-outs belong in separate requests


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(errors: list[dict]) -> APIError:
    """Turn pydantic/FastAPI validation errors into one 400 that names the offending field."""
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "invalid JSON")
        return APIError(400, f"malformed JSON body: {detail}", code="invalid_json")
    if not loc:
        return APIError(400, f"request body must be a JSON object: {first.get('msg', '')}")
    field = ".".join(loc)
    if kind == "extra_forbidden":
        return APIError(400, f"unsupported parameter: '{field}'", param=field, code="unsupported_parameter")
    return APIError(400, f"{field}: {first.get('msg', 'invalid value')}", param=loc[0])


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Closed):
    include_usage: bool = False


class _GenerationRequest(_Closed):
    """Fields shared by completions and chat; `None` means "the engine's default"."""

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, description="Extension: sample from the k most likely tokens (0 or -1: off).")
    min_p: float | None = Field(None, description="Extension: drop tokens below min_p * p(most likely).")
    repetition_penalty: float | None = Field(None, description="Extension: vLLM's repetition penalty (1: off).")
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = Field(None, description="Choice i of a seeded request uses seed + i.")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, description="Extension: token ids that end a choice.")
    min_tokens: int | None = Field(None, description="Extension: no stop before this many tokens.")
    ignore_eos: bool | None = Field(None, description="Extension: keep generating past end-of-sequence.")
    skip_special_tokens: bool | None = Field(None, description="Extension: drop special tokens from text.")
    kv_budget_pages: int | None = Field(
        None, description="Extension: the most KV pages one choice may hold; older tokens are evicted "
                          "(compressed) to stay within it.")
    user: str | None = Field(None, description="Accepted for compatibility; not used.")

    def sampling_kwargs(self) -> dict:
        """The SamplingParams fields the client set (everything else keeps the engine default)."""
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed", "stop", "stop_token_ids", "min_tokens", "ignore_eos",
                 "skip_special_tokens", "kv_budget_pages")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="A string, a list of token ids, or a batch of either (each prompt gets n choices).")
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(
        None, ge=0, le=0, description="0: return each sampled token's log-probability (top alternatives "
                                      "are not computed, so larger values are refused).")

    def prompt_batch(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        return list(p)


class TextPart(_Closed):
    type: Literal["text"]
    text: str


class ChatMessage(_Closed):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_message(self) -> dict:
        """What a chat template expects: role + plain string content ("developer" is OpenAI's new "system")."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Default: the rest of the context.")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0, description="Only 0: alternatives are not computed.")
