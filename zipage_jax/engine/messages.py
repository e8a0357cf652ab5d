"""What the server and its engine loop (``engine_core.EngineCore``) say to each other: one frozen dataclass per
message, dispatched by type (``match``), never by position.

They cross a ``multiprocessing`` pipe when the loop runs in a process of its own (``core_client.ProcessCore``), so
they are small and picklable (``slots``: a message pickles as its values, without its field names). Commands go to
the loop; events come back, in the order the loop emitted them.
"""

import dataclasses

from zipage_jax.sampling_params import ContextLengthError, SamplingParams

_message = dataclasses.dataclass(frozen=True, slots=True)

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def field_of(error: ValueError) -> str | None:
    """The input an engine's ``ValueError`` blames: ``"<field>: <reason>"``, or SamplingParams' ``"<field> must
    ..."``; None if it names none."""
    text = str(error)
    field, colon, _ = text.partition(": ")
    if colon and field.isidentifier():
        return field
    word = text.split(" ", 1)[0]
    return word if word in SAMPLING_FIELDS else None


# -- commands ---------------------------------------------------------------------------------------------------
@_message
class NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # max_tokens as the client asked (None: the rest of the context), not yet checked


@_message
class AddRequests:
    """Queue these requests, all or none; answered by ``Added`` or ``Refused`` with the same ``token``."""

    token: int
    requests: list[NewRequest]


@_message
class Abort:
    request_ids: list[str]


@_message
class Stop:
    """Retire every request (their pages go back to the pool), then end the loop."""


Command = AddRequests | Abort | Stop


# -- events -----------------------------------------------------------------------------------------------------
@_message
class Startup:
    detail: str  # what the warm-up is doing now (``/health`` shows it)


@_message
class Ready:
    """The warm-up is done (or there is none): requests are served from here on."""


@_message
class Accepted:
    """One request as the engine queued it: its prompt's length after ``truncate_prompt_tokens``, and the kept
    tokens themselves where truncation changed the prompt (otherwise the server holds them already)."""

    num_prompt_tokens: int
    truncated_prompt: list[int] | None = None


@_message
class Added:
    token: int
    accepted: list[Accepted]  # in the order of the command's requests


@_message
class Refused:
    """The engine queued none of a command's requests. ``field`` names the input at fault (``field_of``);
    ``over_context``: the request does not fit the model's context (vLLM's ``context_length_exceeded``);
    ``bad_input`` False: not the client's fault (a bug)."""

    token: int
    message: str
    field: str | None = None
    over_context: bool = False
    bad_input: bool = True

    @classmethod
    def of(cls, token: int, error: Exception) -> "Refused":
        if not isinstance(error, ValueError):
            return cls(token, f"{type(error).__name__}: {error}", bad_input=False)
        return cls(token, str(error), field_of(error), isinstance(error, ContextLengthError))

    @property
    def reason(self) -> str:
        """The message without its ``"<field>: "`` (what vLLM says of a context overflow)."""
        return self.message.removeprefix(f"{self.field}: ") if self.field else self.message


@_message
class RequestStats:
    """How the engine ran a request, carried by its final delta (the engine's clock: its loop measures them)."""

    num_prompt_tokens: int  # after truncation
    queue_s: float | None  # from the engine queuing it to its first scheduled step (None: never scheduled)
    num_evicted_tokens: int  # tokens compression dropped from its KV (of its last admission: a recompute restarts)
    peak_kv_pages: int
    num_compressions: int
    num_preemptions: int


@_message
class OutputDelta:
    """What one step added to a request's output. The text and token lists are replaced from ``text_start`` /
    ``token_start`` on (a stop string found late truncates text already reported)."""

    request_id: str
    token_start: int
    token_ids: list[int]
    text_start: int
    text: str
    logprobs: list | None  # of the new tokens, where asked
    finish_reason: str | None  # None while the request runs
    stop_reason: int | str | None
    prompt_logprobs: list | None  # where asked: whole, until a delta has carried them complete
    stats: RequestStats | None = None  # the final delta's

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@_message
class Outputs:
    deltas: list[OutputDelta]


@_message
class Failed:
    """These requests ended without finishing; ``step_failure``: an ``engine.step()`` raised (counted even when
    no request was in flight)."""

    request_ids: list[str]
    message: str
    step_failure: bool = False


@_message
class Metrics:
    values: dict  # engine.metrics()


@_message
class Stopped:
    """The loop ended on ``Stop``."""


@_message
class Exited:
    """The engine process ended without being asked to (the server's side notices its pipe close)."""


Event = Startup | Ready | Added | Refused | Outputs | Failed | Metrics | Stopped | Exited


# -- the engine process's start (``ProcessCore.launch``), before any event -------------------------------------
@_message
class EngineInfo:
    """What the server reads of the engine it serves."""

    model_name: str
    max_model_len: int
    config: object  # EngineConfig
    tokenizer_path: str | None  # None: the engine serves token ids only
    model_path: str | None = None  # the model's directory (a Hub id's snapshot): its generation_config.json


@_message
class Built:
    """The engine process built its engine; the loop starts next."""

    info: EngineInfo


@_message
class LaunchError:
    """Building the engine failed; ``bad_input``: a ``ValueError`` (what only the model and the device tell: the
    memory plan, the context), else a bug or a broken installation."""

    message: str
    bad_input: bool
