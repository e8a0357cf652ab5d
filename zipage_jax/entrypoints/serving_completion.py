"""``/v1/completions`` (vLLM's ``serving_completion``): a prompt or a batch of prompts, text or token ids, each with
``n`` choices; echo (the prompt before its completion, with its logprobs), OpenAI's completion logprobs, structured
outputs and logit_bias (``structured_requests``)."""

import time

from fastapi import Request

from zipage_jax.engine.messages import Accepted
from zipage_jax.engine.request_group import ChoiceOutput
from zipage_jax.entrypoints import logprob_formats, structured_requests
from zipage_jax.entrypoints.protocol import CompletionRequest
from zipage_jax.entrypoints.serving_engine import ChoiceStream, OpenAIServing, RequestView


class OpenAIServingCompletion(OpenAIServing):
    id_prefix = "cmpl"
    object = chunk_object = "text_completion"
    prompt_field = "prompt"

    async def create(self, body: CompletionRequest, request: Request):
        arrival = time.monotonic()
        request_id = self.start(body)
        prompts = body.prompt_batch()
        extra = await self.constraints(body, structured_requests.requested(body), self.settings.reasoning_end)
        for text in prompts:
            if isinstance(text, str):
                self.tokenizing.check_chars([text], "prompt")  # every prompt, before any is tokenized
        ids = [await self.tokenizing.encode(p, body.add_special_tokens) if isinstance(p, str) else list(p)
               for p in prompts]
        group = await self.submit(request_id, body, ids, arrival, extra)
        texts = [p if isinstance(p, str) else None for p in prompts]
        return await self.respond(request_id, CompletionView(self, body, group.accepted[::body.n], ids, texts), group,
                                  request)


class CompletionView(RequestView):
    def __init__(self, serving: OpenAIServing, body: CompletionRequest, accepted: list[Accepted],
                 sent: list[list[int]], texts: list[str | None]):
        super().__init__(serving, body, accepted)
        # what echo returns of each prompt: what the engine kept of it, as sent or decoded from the kept ids
        self.prompt_ids = [ids if a.truncated_prompt is None else a.truncated_prompt for ids, a in zip(sent, accepted)]
        self.texts = [text if a.truncated_prompt is None else None for text, a in zip(texts, accepted)]

    def echoed(self, index: int, output: ChoiceOutput) -> tuple[str, list[int], list]:
        """What echo puts before a completion: the prompt's text, ids and logprobs (null where not computed)."""
        p = index // self.body.n
        if self.texts[p] is None:
            self.texts[p] = self.serving.tokenizing.tokenizer.decode(self.prompt_ids[p])
        ids = self.prompt_ids[p]
        return self.texts[p], list(ids), list(output.prompt_logprobs or [None] * len(ids))

    def logprobs(self, token_ids: list[int], entries: list, text_offset: int = 0) -> dict | None:
        if self.body.logprobs is None:
            return None
        return logprob_formats.completion_logprobs(token_ids, entries, self.body.logprobs, self.labels, text_offset)

    def choice(self, index: int, output: ChoiceOutput) -> dict:
        generated = not self.body.echo_only
        text = output.text if generated else ""
        token_ids = output.token_ids if generated else []
        entries = (output.logprobs or []) if generated else []
        if self.body.echo:
            prompt_text, prompt_ids, prompt_entries = self.echoed(index, output)
            text, token_ids, entries = prompt_text + text, prompt_ids + token_ids, prompt_entries + entries
        choice = {"index": index, "text": text, "logprobs": self.logprobs(token_ids, entries),
                  "finish_reason": output.finish_reason, "stop_reason": output.stop_reason}
        if self.body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = logprob_formats.prompt_logprobs(output.prompt_logprobs)
        return choice

    def stream(self, index: int) -> "CompletionStream":
        return CompletionStream(self, index, self.body.stop_strings, echo=self.body.echo)


class CompletionStream(ChoiceStream):
    view: CompletionView

    def __init__(self, view: CompletionView, index: int, holds: tuple[str, ...], echo: bool):
        super().__init__(view, index, holds, echo)
        self.text_offset = 0  # of the next token's text in the whole streamed text (logprobs' text_offset)

    def content(self, output: ChoiceOutput, piece: str, token_ids: list[int], logprobs: list) -> dict:
        if self.echo:
            prompt_text, prompt_ids, prompt_entries = self.view.echoed(self.index, output)
            piece, token_ids, logprobs = prompt_text + piece, prompt_ids + token_ids, prompt_entries + logprobs
        lp = self.view.logprobs(token_ids, logprobs, self.text_offset)
        self.text_offset += len(piece)
        return {"text": piece, "logprobs": lp}
