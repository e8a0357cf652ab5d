"""What callers get back, shaped like vLLM's so users need no new vocabulary."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Logprob:
    """One token's log-probability under the model's raw logits (before penalties, temperature and filters), its
    rank among the vocabulary (1 = most likely) and its text (None without a tokenizer): vLLM's ``Logprob``."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: {token id: Logprob}, the position's own token first, then the requested most likely
# alternatives in rank order (a token already listed is not repeated): vLLM's ``SampleLogprobs`` entries.
TokenLogprobs = dict[int, Logprob]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprobs] | None  # one dict per output token with SamplingParams.logprobs set
    finish_reason: str | None = None  # None while running, then "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = dataclasses.field(default_factory=dict)
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing predicts it)
    # and for those not computed yet.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
