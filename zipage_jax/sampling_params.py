"""SamplingParams: per-request sampling settings with vLLM's names and defaults, validated on the host.

Plain Python (no jax): the server's request models and the command lines import it without loading jax.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable, Sequence

import numpy as np

from zipage_jax.structured_output.params import StructuredOutputsParams

# Below this a temperature is indistinguishable from argmax and only risks overflow (vLLM uses the same).
GREEDY_TEMPERATURE = 1e-5
# Most alternatives a request may ask for per token (`logprobs`, `prompt_logprobs`): vLLM's default
# `max_logprobs` and OpenAI's limit; the device computes this many for every sampled token.
MAX_LOGPROBS = 20
_PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's; vLLM clamps to it


def _real(name: str, value, lo: float | None = None, hi: float | None = None,
          lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    value = float(value)
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
    return value


def check_int(name: str, value, lo: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    value = int(value)
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return value


def _bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return bool(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request sampling settings with vLLM's names and defaults; validated on construction.

    `stop` is normalized to a tuple of strings, `stop_token_ids` to a tuple of ints and `top_k=-1` to 0
    (disabled). `logprobs=N` returns, for each output token, its logprob and rank and the N most likely
    alternatives (0: the token's alone; True means 0); `prompt_logprobs=N` the same for every prompt token after
    the first (a request asking for them computes its whole prompt: it does not use the prefix cache).
    `structured_outputs` constrains the output (``StructuredOutputsParams``: a JSON schema, regex, choice or grammar);
    `logit_bias` ({token id: bias}, clamped to [-100, 100] as vLLM does) is added to the logits before sampling, and
    kept as sorted ``(id, bias)`` pairs. `truncate_prompt_tokens=K` keeps a prompt's last K tokens. `max_tokens=None` generates until the context
    (`max_model_len`) ends, as in vLLM. Use `dataclasses.replace(params, ...)` to derive
    a modified copy (it is validated again).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    kv_budget_pages: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | Sequence[tuple[int, float]] | None = None

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)

        put("n", check_int("n", self.n, lo=1))
        put("temperature", _real("temperature", self.temperature, lo=0.0))
        put("top_p", _real("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True))
        top_k = check_int("top_k", self.top_k, lo=-1)
        put("top_k", max(top_k, 0))
        put("min_p", _real("min_p", self.min_p, lo=0.0, hi=1.0))
        put("repetition_penalty",
            _real("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True))
        put("presence_penalty", _real("presence_penalty", self.presence_penalty, *_PENALTY_RANGE))
        put("frequency_penalty", _real("frequency_penalty", self.frequency_penalty, *_PENALTY_RANGE))
        if self.seed is not None:
            seed = check_int("seed", self.seed)
            if not -(2**63) <= seed < 2**64:
                raise ValueError(f"seed must fit in 64 bits, got {seed}")
            put("seed", seed)
        put("stop", _stop_strings(self.stop))
        put("stop_token_ids", check_token_ids("stop_token_ids", self.stop_token_ids))
        if self.max_tokens is not None:  # None: until the context ends (the engine resolves it per prompt)
            put("max_tokens", check_int("max_tokens", self.max_tokens, lo=1))
        put("min_tokens", check_int("min_tokens", self.min_tokens, lo=0))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        put("ignore_eos", _bool("ignore_eos", self.ignore_eos))
        put("logprobs", _logprobs("logprobs", self.logprobs))
        put("prompt_logprobs", _logprobs("prompt_logprobs", self.prompt_logprobs))
        put("include_stop_str_in_output", _bool("include_stop_str_in_output", self.include_stop_str_in_output))
        put("skip_special_tokens", _bool("skip_special_tokens", self.skip_special_tokens))
        put("spaces_between_special_tokens",
            _bool("spaces_between_special_tokens", self.spaces_between_special_tokens))
        if self.truncate_prompt_tokens is not None:
            put("truncate_prompt_tokens", check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, lo=1))
        if self.kv_budget_pages is not None:
            put("kv_budget_pages", check_int("kv_budget_pages", self.kv_budget_pages, lo=1))
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams, got {self.structured_outputs!r}")
        put("logit_bias", _logit_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        """Temperature 0 (or below `GREEDY_TEMPERATURE`): argmax after penalties."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    if bias is None:
        return ()
    items = bias.items() if isinstance(bias, dict) else bias
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}")
    out = {}
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2:
            raise ValueError(f"logit_bias must map token ids to numbers, got {item!r}")
        token = check_int("logit_bias", item[0], lo=0)
        out[token] = min(max(_real("logit_bias", item[1]), LOGIT_BIAS_RANGE[0]), LOGIT_BIAS_RANGE[1])
    return tuple(sorted(out.items()))


def _stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, Iterable):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    items = tuple(items)
    for s in items:
        if not isinstance(s, str):
            raise ValueError(f"stop must contain only strings, got {s!r}")
        if not s:
            raise ValueError("stop must not contain an empty string")
    return items


def check_token_ids(name: str, ids) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ValueError(f"{name} must be a list of ints, got {ids!r}")
    return tuple(check_int(name, i, lo=0) for i in ids)


def _logprobs(name: str, value) -> int | None:
    """None (off), or how many most likely alternatives to return beside the token's own logprob."""
    if value is None or value is False:
        return None
    if value is True:
        return 0
    if isinstance(value, numbers.Integral) and 0 <= value <= MAX_LOGPROBS:
        return int(value)
    raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}")


class ContextLengthError(ValueError):
    """A request that does not fit the model's context (vLLM's ``context_length_exceeded``)."""


def completion_budget(prompt_len: int, max_tokens: int | None, max_model_len: int, *, reject: bool) -> int:
    """How many tokens a request may generate: vLLM's rule, applied by the engine (``LLMEngine.add_request``).

    A prompt must leave room for one token (else a ContextLengthError naming the prompt); without ``max_tokens``
    the request may fill the context. A ``max_tokens`` beyond the context is, as in vLLM, capped by the offline API
    (``LLM`` / ``LLMEngine.add_request``: generation ends at ``max_model_len`` with finish reason ``length``) and,
    with ``reject`` (the OpenAI server), a ContextLengthError naming ``max_tokens`` in vLLM's words.
    """
    room = max_model_len - prompt_len
    if room < 1:
        raise ContextLengthError(f"prompt: This model's maximum context length is {max_model_len} tokens; the "
                                 f"prompt has {prompt_len}, which leaves no room to generate")
    if max_tokens is None:
        return room
    if max_tokens > room and reject:
        raise ContextLengthError(f"max_tokens: 'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. "
                                 f"This model's maximum context length is {max_model_len} tokens and your request "
                                 f"has {prompt_len} input tokens ({max_tokens} > {max_model_len} - {prompt_len})")
    return min(max_tokens, room)
