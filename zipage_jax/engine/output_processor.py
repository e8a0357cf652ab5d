"""From read-back tokens to what callers get: detokenization, stop checks, logprob dicts and ``RequestOutput``s.

The scheduling state of a request (tokens, pages, rows) is ``core.request.Request``, written by the scheduler and
the page manager; what only its output needs (the text so far, its logprob dicts, why it stopped, when its first
token came) lives here, in one ``RequestState`` per request, dropped when its final output is built.
"""

import dataclasses
import time

from zipage_jax.core.request import Request
from zipage_jax.core.stopping import Stop, check_stop
from zipage_jax.engine.detokenizer import IncrementalDetokenizer
from zipage_jax.engine.outputs import CompletionOutput, Logprob, RequestOutput


@dataclasses.dataclass
class RequestState:
    """The output side of one request."""

    detokenizer: IncrementalDetokenizer | None
    arrival_time: float
    text: str = ""
    text_complete: bool = False  # the stop check fixed ``text`` (it cut off a stop string or a stop token)
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    sample_logprobs: list[dict] | None = None  # {token id: Logprob} per resolved output token, if asked for
    prompt_logprobs: list[dict | None] | None = None  # per prompt token (None: the first, and those not scored)


class OutputProcessor:
    """Turns read-back rows of the device's logprob layout (``layers.logprobs``) into request outputs.
    ``tokenizer``: None where the engine serves token ids only (outputs then carry no text)."""

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.states: dict[str, RequestState] = {}
        self._token_texts: dict[int, str] = {}

    def add(self, request: Request):
        params = request.sampling_params
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens,
                                                 params.spaces_between_special_tokens)
        self.states[request.request_id] = RequestState(
            detokenizer, time.perf_counter(), sample_logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=None if params.prompt_logprobs is None else [None] * len(request.prompt_token_ids))

    def set_prompt_logprobs(self, request: Request, position: int, ids, values):
        """Prompt token ``position``'s logprobs, from one row of the prompt-logprobs program."""
        self.states[request.request_id].prompt_logprobs[position] = self.logprob_dict(
            ids, values, request.sampling_params.prompt_logprobs)

    def accept(self, request: Request, ids, values) -> Stop | None:
        """Record the request's newest resolved output token (its row of the device's logprob layout) and check
        every stop condition; returns the stop, if it ends here."""
        state = self.states[request.request_id]
        token, num_out = int(ids[0]), len(request.output_logprobs)
        params = request.sampling_params
        if state.sample_logprobs is not None:
            state.sample_logprobs.append(self.logprob_dict(ids, values, params.logprobs))
        if state.first_token_time is None:
            state.first_token_time = time.perf_counter()
        before = state.text
        if params.stop:  # stop strings need the text now; otherwise it is decoded when an output is built
            self._detokenize(request, state)
        stop = check_stop(params, self.eos_token_ids, token, num_out, state.text, len(before))
        if stop is None:
            return None
        state.stop_reason = stop.reason
        if stop.text_end is not None:
            state.text = state.text[:stop.text_end]
            state.detokenizer.text = state.text
            state.text_complete = True
        elif stop.reason is not None and not params.include_stop_str_in_output:
            # a stop token's own text is left out (vLLM): the text before it
            if params.stop:
                state.text = before
            else:
                self._detokenize(request, state, num_out - 1)
            state.text_complete = True
        return stop

    def output(self, request: Request) -> RequestOutput:
        """The request's cumulative output; a finished request's state is dropped with its final one."""
        state = self.states[request.request_id]
        if not state.text_complete:  # a stop string or stop token may have fixed the text already
            self._detokenize(request, state)
        ids = request.output_token_ids[:len(request.output_logprobs)]  # resolved tokens come first
        want_logprobs = state.sample_logprobs is not None
        finished = request.status.finished
        completion = CompletionOutput(
            index=0, text=state.text, token_ids=ids,
            cumulative_logprob=float(sum(request.output_logprobs)) if want_logprobs else None,
            logprobs=list(state.sample_logprobs) if want_logprobs else None,
            finish_reason=request.status.value if finished else None, stop_reason=state.stop_reason)
        if finished:
            del self.states[request.request_id]
        prompt_logprobs = None if state.prompt_logprobs is None else list(state.prompt_logprobs)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [completion], finished,
                             _request_metrics(request, state), prompt_logprobs)

    def logprob_dict(self, ids, values, num_top: int) -> dict:
        """{token: Logprob} of one row of the device's logprob layout: the row's token first, then its ``num_top``
        most likely tokens in rank order."""
        token = int(ids[0])
        out = {token: Logprob(float(values[0]), int(ids[1]), self._token_text(token))}
        for j in range(num_top):
            top = int(ids[2 + j])
            if top not in out:
                out[top] = Logprob(float(values[1 + j]), j + 1, self._token_text(top))
        return out

    def _token_text(self, token: int) -> str | None:
        """One token's own text (special tokens included), as logprobs show it; memoized."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    @staticmethod
    def _detokenize(request: Request, state: RequestState, resolved: int | None = None):
        """Bring the text up to the first ``resolved`` output tokens (default: all resolved ones; in one batch when
        it lags)."""
        detok = state.detokenizer
        if detok is None:
            return
        resolved = len(request.output_logprobs) if resolved is None else resolved
        if detok.num_added < resolved:
            detok.extend(request.output_token_ids[detok.num_added:resolved])
        state.text = detok.text


def _request_metrics(request: Request, state: RequestState) -> dict:
    return dict(peak_kv_pages=request.peak_pages, num_cached_tokens=request.num_cached_tokens,
                num_preemptions=request.num_preemptions, num_compressions=request.num_compressions,
                peak_kv_pages_after_compression=request.peak_pages_after_compression,
                time_to_first_token=(state.first_token_time - state.arrival_time
                                     if state.first_token_time else None))
