"""OpenAI wire format: request models (validated by pydantic) and the error shape every failure uses.

Like vLLM's server, a request may carry fields this server does not declare: they are accepted and named in one
warning per request (``ignored_fields``), so clients written for vLLM or OpenAI work unchanged. Fields vLLM
implements and this server does not (beam search, the legacy ``functions``, ...) are refused with a 400 when
they ask for something (``UNSUPPORTED``), and accepted when they carry their neutral value. Structured outputs
(``response_format``, ``structured_outputs``, vLLM's ``guided_*``) and tools are declared here and turned into the
engine's constraint by ``structured_requests`` and ``tool_calls``. Declared fields are
strict (no string-to-number coercion). Value ranges are left to `SamplingParams`, the single source of truth;
its `ValueError`s become 400s too. Every string of a request, ignored fields included, must be valid Unicode (JSON
may escape a lone surrogate, ``"\\ud800"``, which no tokenizer encodes): one that is not is a 400 naming it.
"""

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from zipage_jax.entrypoints.constraint_protocol import ChatTool, NamedToolChoice, ResponseFormat, \
    StructuredOutputsRequest, template_call
from zipage_jax.sampling_params import MAX_LOGPROBS

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
    if kind == "invalid_unicode":
        field = first["ctx"]["field"]
        return APIError(400, first["msg"], param=field.split(".")[0].split("[")[0], code="invalid_unicode")
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "invalid JSON")
        return APIError(400, f"malformed JSON body: {detail}", code="invalid_json")
    if not loc:
        return APIError(400, f"request body must be a JSON object: {first.get('msg', '')}")
    field = ".".join(loc)
    return APIError(400, f"{field}: {first.get('msg', 'invalid value')}", param=loc[0])


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


def invalid_unicode(value, path: str = "") -> str | None:
    """The path (``messages[0].content``) of the first string in ``value`` that is no valid Unicode (a lone
    surrogate cannot be encoded), or None."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode()
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, BaseModel):
        value = {**{name: getattr(value, name) for name in type(value).model_fields}, **(value.model_extra or {})}
    if isinstance(value, dict):
        for key, item in value.items():
            name = str(key).encode("utf-8", "backslashreplace").decode()  # a path naming a bad key prints
            inner = f"{path}.{name}" if path else name
            found = invalid_unicode(key, inner) or invalid_unicode(item, inner)
            if found:
                return found
    elif isinstance(value, list):
        if set(map(type, value)) <= {int, float, bool, type(None)}:  # token ids: no strings inside (at C speed)
            return None
        for i, item in enumerate(value):
            found = invalid_unicode(item, f"{path}[{i}]")
            if found:
                return found
    return None


class _Request(_Open):
    """A request body: its strings checked for valid Unicode once the fields are."""

    @model_validator(mode="after")
    def _valid_unicode(self):
        field = invalid_unicode(self)
        if field is not None:
            raise PydanticCustomError("invalid_unicode", "{field}: invalid Unicode (a lone surrogate such as "
                                      "\\ud800); send UTF-8 text", {"field": field})
        return self


def _empty(value) -> bool:
    return value is None or value == [] or value == {} or value == ""


# Fields vLLM implements and this server does not: a 400 unless the value asks for nothing (True = neutral).
UNSUPPORTED: dict[str, Callable[[Any, "_GenerationRequest"], bool]] = {
    "best_of": lambda v, r: v is None or v == r.n,
    "use_beam_search": lambda v, r: v in (None, False),
    "allowed_token_ids": lambda v, r: _empty(v),
    "bad_words": lambda v, r: _empty(v),
    "logits_processors": lambda v, r: _empty(v),
    "prompt_embeds": lambda v, r: _empty(v),
    "suffix": lambda v, r: _empty(v),
    "structural_tag": lambda v, r: v is None,
    "functions": lambda v, r: _empty(v),
    "function_call": lambda v, r: v in (None, "none", "auto"),
    "chat_template": lambda v, r: v is None,
    "priority": lambda v, r: v in (None, 0),
}


def ignored_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Names of the undeclared fields of ``model`` and of the models nested in it (``messages[].name``)."""
    names = [prefix + name for name in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, BaseModel):
                suffix = "[]." if isinstance(value, list) else "."
                names += ignored_fields(item, prefix + name + suffix)
    return sorted(set(names))


class StreamOptions(_Open):
    include_usage: bool = Field(True, description="A last chunk with the usage of the whole request (vLLM's "
                                                  "default when stream_options is given).")
    continuous_usage_stats: bool = Field(False, description="Extension (vLLM): every chunk carries the usage so "
                                                            "far of its choice.")


class _GenerationRequest(_Request):
    """Fields shared by completions and chat; `None` means "the engine's default"."""

    model: str | None = Field(None, description="Optional (vLLM): the served model when left out.")
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
    spaces_between_special_tokens: bool | None = Field(
        None, description="Extension: spaces between special tokens in text (slow tokenizers).")
    include_stop_str_in_output: bool | None = Field(
        None, description="Extension: keep the matched stop string (or stop token's text) in the text.")
    truncate_prompt_tokens: int | None = Field(None, ge=1, description="Extension: keep the prompt's last k tokens.")
    prompt_logprobs: int | None = Field(
        None, description=f"Extension: logprobs of the prompt tokens with this many alternatives (0-{MAX_LOGPROBS}; "
                          "not with stream). Such a request computes its whole prompt (no prefix cache).")
    return_tokens_as_token_ids: bool = Field(
        False, description="Extension: logprobs name tokens as 'token_id:N' instead of their text.")
    kv_budget_pages: int | None = Field(
        None, description="Extension: the most KV pages one choice may hold; older tokens are evicted "
                          "(compressed) to stay within it.")
    user: str | None = Field(None, description="Accepted for compatibility; not used.")
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (a string, as OpenAI sends it) -> a bias added to its logit, clamped to "
                          "[-100, 100].")
    response_format: ResponseFormat | None = Field(
        None, description="json_object: any JSON object; json_schema: JSON valid against json_schema.schema.")
    structured_outputs: StructuredOutputsRequest | None = Field(
        None, description="Extension (vLLM): the output satisfies one of json, regex, choice, grammar, json_object.")
    guided_json: dict[str, Any] | str | None = Field(None, description="Extension (vLLM): a JSON schema.")
    guided_regex: str | None = Field(None, description="Extension (vLLM): a regular expression.")
    guided_choice: list[str] | None = Field(None, description="Extension (vLLM): one of these strings.")
    guided_grammar: str | None = Field(None, description="Extension (vLLM): a Lark or GBNF grammar.")
    guided_whitespace_pattern: str | None = Field(None, description="Extension (vLLM): JSON's whitespace, a "
                                                                    "regular expression.")

    def sampling_kwargs(self) -> dict:
        """The SamplingParams fields the client set (everything else keeps the engine default)."""
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed", "stop", "stop_token_ids", "min_tokens", "ignore_eos",
                 "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
                 "truncate_prompt_tokens", "kv_budget_pages")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def check(self) -> list[str]:
        """Refuse what cannot be honoured (a 400 naming the field); return the fields to ignore."""
        extra = self.model_extra or {}
        for name, neutral in UNSUPPORTED.items():
            if name in extra and not neutral(extra[name], self):
                raise APIError(400, f"{name}: not supported by this server", param=name,
                               code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only with stream=true", param="stream_options")
        if self.stream and self.prompt_logprobs:
            raise APIError(400, "prompt_logprobs: not available with stream=true", param="prompt_logprobs")
        return [name for name in ignored_fields(self) if name not in UNSUPPORTED]

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="A string, a list of token ids, or a batch of either (each prompt gets n choices).")
    max_tokens: int | None = Field(16, ge=0, description="0 (with echo): score the prompt, generate nothing.")
    logprobs: int | None = Field(
        None, description=f"Each token's logprob and its N most likely alternatives (0-{MAX_LOGPROBS}).")
    echo: bool = Field(False, description="Return the prompt before the completion (with its logprobs when "
                                          "logprobs is set; the first prompt token's is null).")
    add_special_tokens: bool = Field(True, description="Extension: let the tokenizer add its special tokens "
                                                       "(e.g. BOS) to a text prompt.")

    def prompt_batch(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        return list(p)

    @property
    def logprobs_width(self) -> int | None:
        return self.logprobs

    def logprob_widths(self) -> dict[str, int | None]:
        """Each field asking for logprobs: how many alternatives."""
        return {"logprobs": self.logprobs, "prompt_logprobs": self.prompt_logprobs}

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def prompt_logprobs_width(self) -> int | None:
        """vLLM: echo with logprobs scores the prompt with as many alternatives."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    @property
    def echo_only(self) -> bool:
        """max_tokens 0 with echo: the prompt is scored (one token is generated and dropped, as in vLLM)."""
        return self.echo and self.max_tokens == 0

    def check(self) -> list[str]:
        ignored = super().check()
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens: must be >= 1 (0 only with echo)", param="max_tokens")
        return ignored


class TextPart(_Open):
    type: Literal["text"]
    text: str


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, description="An assistant message's calls (OpenAI's "
                                                                      "shape), shown to the chat template.")
    tool_call_id: str | None = Field(None, description="A tool message's call.")

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)

    def as_template_message(self) -> dict:
        """What a chat template expects: role + plain string content ("developer" is OpenAI's new "system"), and
        an assistant's tool calls with their arguments as objects (vLLM parses them: templates write them with
        ``tojson``) and a tool message's call id."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [template_call(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Default: the rest of the context.")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, description=f"With logprobs: the N most likely alternatives of each "
                                                       f"token (0-{MAX_LOGPROBS}).")
    echo: bool = Field(False, description="Extension: prepend the last message's content to the reply when it "
                                          "has the reply's role.")
    add_generation_prompt: bool = Field(True, description="Extension: end the prompt with the assistant header.")
    continue_final_message: bool = Field(False, description="Extension: continue the last (assistant) message "
                                                            "instead of starting a new one.")
    add_special_tokens: bool = Field(False, description="Extension: let the tokenizer add special tokens beyond "
                                                        "the chat template's.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extension: variables for the chat template (e.g. enable_thinking).")
    documents: list[dict[str, str]] | None = Field(None, description="Extension: documents for the chat template.")
    include_reasoning: bool = Field(True, description="Extension: with --reasoning-parser, return the thinking "
                                                      "as reasoning_content.")
    tools: list[ChatTool] | None = Field(None, description="Functions the model may call (the chat template gets "
                                                           "them).")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (with --enable-auto-tool-choice; the default with tools), required (at least "
                          "one call, forced by the grammar) or a named function (its arguments, forced).")
    parallel_tool_calls: bool | None = Field(None, description="false: only the first tool call is returned.")

    @property
    def logprobs_width(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def logprob_widths(self) -> dict[str, int | None]:
        return {"top_logprobs": self.top_logprobs, "prompt_logprobs": self.prompt_logprobs}

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def prompt_logprobs_width(self) -> int | None:
        return self.prompt_logprobs

    @property
    def echo_only(self) -> bool:
        return False

    @property
    def reply_role(self) -> str:
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def check(self) -> list[str]:
        ignored = super().check()
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs: must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs=true", param="top_logprobs")
        if self.add_generation_prompt and self.continue_final_message:
            raise APIError(400, "continue_final_message: not with add_generation_prompt=true",
                           param="continue_final_message")
        return ignored


class TokenizeCompletionRequest(_Request):
    """vLLM's ``/tokenize`` of a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = Field(False, description="Also each token's vocabulary entry.")


class TokenizeChatRequest(_Request):
    """vLLM's ``/tokenize`` of chat messages, rendered by the chat template as a chat completion would be."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    tools: list[ChatTool] | None = None

    def check(self):
        if self.add_generation_prompt and self.continue_final_message:
            raise APIError(400, "continue_final_message: not with add_generation_prompt=true",
                           param="continue_final_message")


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


def chat_template_kwargs(body) -> dict:
    """What a chat request asks of the template beside its messages."""
    kwargs = dict(body.chat_template_kwargs or {}, add_generation_prompt=body.add_generation_prompt,
                  continue_final_message=body.continue_final_message)
    if body.documents is not None:
        kwargs["documents"] = body.documents
    if body.tools:  # as vLLM, the template sees the tools whatever tool_choice says
        kwargs["tools"] = [tool.model_dump(by_alias=True, exclude_none=True) for tool in body.tools]
    return kwargs
