"""What the worker hands back for work it dispatched without waiting: device results the host reads one step
later, and the host copies a swap-out made."""

import dataclasses

import jax
import numpy as np


@dataclasses.dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens in flight: row i is prompt token ``positions[i]`` of ``requests[i]``; ``ids`` and
    ``values`` in the layout of ``layers.logprobs.token_logprobs`` (rows past ``len(positions)`` are padding)."""

    requests: list
    positions: list[int]
    ids: jax.Array
    values: jax.Array

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.ids), np.asarray(self.values)


@dataclasses.dataclass
class StepHandle:
    """A dispatched step: which request each output row belongs to (None = no sample) and its device results
    (a fake device gives host arrays): ``ids [B, 2 + K]`` int32 (sampled token, its rank, the top-K ids) and
    ``values [B, 1 + K]`` f32 (its logprob, the top-K logprobs), and the prompt logprobs it computed."""

    requests: list
    ids: jax.Array
    values: jax.Array
    kind: str  # "decode" or "prefill"
    num_tokens: int
    prompt_logprobs: list[PromptLogprobs] = dataclasses.field(default_factory=list)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.ids), np.asarray(self.values)


@dataclasses.dataclass
class ExecuteResult:
    """What one ``execute`` returns: the handles of the steps that sample, read back by the engine one step later,
    and the host copies of the requests swapped out (request id -> contents), which the scheduler keeps until it
    swaps them back in."""

    handles: list[StepHandle] = dataclasses.field(default_factory=list)
    swapped_out: dict = dataclasses.field(default_factory=dict)
