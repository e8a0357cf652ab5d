"""When a request stops: the one pure check the engine applies to every token it reads back (vLLM's ``check_stop``)."""

import dataclasses

from zipage_jax.core.request import RequestStatus
from zipage_jax.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class Stop:
    status: RequestStatus
    reason: int | str | None = None  # the stop token or stop string (vLLM's ``stop_reason``)
    text_end: int | None = None  # a matched stop string: where the text ends (its start, or its end if included)


def check_stop(params: SamplingParams, eos_token_ids, token: int, num_output_tokens: int, text: str = "",
               searched: int = 0) -> Stop | None:
    """Whether the request stops at ``token``, its ``num_output_tokens``-th output token.

    In order: a stop token (or EOS, unless ignored) once ``min_tokens`` are out; past ``min_tokens`` (vLLM), the
    earliest stop string in the output ``text`` (its first ``searched`` characters held none before, so only
    matches reaching past them are new; the text keeps it with ``include_stop_str_in_output``); the length limit
    ``max_tokens``.
    """
    if num_output_tokens >= params.min_tokens and (
            token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids)):
        return Stop(RequestStatus.FINISHED_STOPPED, token)
    if params.stop and num_output_tokens > params.min_tokens:
        hits = [(text.find(s, max(0, searched - len(s) + 1)), s) for s in params.stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if hits:
            pos, stop = min(hits)
            end = pos + len(stop) if params.include_stop_str_in_output else pos
            return Stop(RequestStatus.FINISHED_STOPPED, stop, end)
    if num_output_tokens >= params.max_tokens:
        return Stop(RequestStatus.FINISHED_LENGTH)
    return None
