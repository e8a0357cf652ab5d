"""What callers get back, shaped like vLLM's so users need no new vocabulary."""

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[float] | None
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
