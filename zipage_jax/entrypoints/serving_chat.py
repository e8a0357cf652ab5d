"""``/v1/chat/completions`` (vLLM's ``serving_chat``): messages rendered by the model's chat template, the reply as
a message (its thinking as ``reasoning_content`` with a reasoning parser), chat logprobs, and vLLM's echo of the
last message when the reply continues it."""

import time

from fastapi import Request

from zipage_jax.engine.messages import Accepted
from zipage_jax.engine.request_group import ChoiceOutput
from zipage_jax.entrypoints import logprob_formats
from zipage_jax.entrypoints.protocol import ChatCompletionRequest, chat_template_kwargs
from zipage_jax.entrypoints.reasoning import ReasoningParser
from zipage_jax.entrypoints.serving_engine import ChoiceStream, OpenAIServing, RequestView


class OpenAIServingChat(OpenAIServing):
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prompt_field = "messages"

    def __init__(self, async_engine, tokenizing, settings, reasoning: ReasoningParser | None):
        super().__init__(async_engine, tokenizing, settings)
        self.reasoning = reasoning

    async def create(self, body: ChatCompletionRequest, request: Request):
        arrival = time.monotonic()
        request_id = self.start(body)
        prompt = await self.tokenizing.render_chat([m.as_template_message() for m in body.messages],
                                                   **chat_template_kwargs(body))
        # Special tokens are not added by default: the chat template places them, as vLLM does.
        ids = await self.tokenizing.encode(prompt, body.add_special_tokens, field=None)
        group = await self.submit(request_id, body, [ids], arrival)
        return await self.respond(request_id, ChatView(self, body, group.accepted[:1], prompt), group, request)


class ChatView(RequestView):
    def __init__(self, serving: OpenAIServingChat, body: ChatCompletionRequest, accepted: list[Accepted],
                 prompt: str):
        super().__init__(serving, body, accepted)
        self.reasoning = serving.reasoning
        # whether the reply starts inside a thinking block its template opened (reasoning parsers read its end)
        self.opened = self.reasoning is not None and self.reasoning.opens_thinking(prompt)

    def echo_prefix(self) -> str:
        """Chat echo (vLLM): the last message's content, when the reply continues that role."""
        last = self.body.messages[-1]
        return last.text if self.body.echo and last.role == self.body.reply_role else ""

    def logprobs(self, token_ids: list[int], entries: list) -> dict | None:
        if not self.body.logprobs:
            return None
        return logprob_formats.chat_logprobs(token_ids, entries, self.body.top_logprobs or 0, self.labels)

    def message(self, text: str) -> dict:
        message = {"role": self.body.reply_role, "content": text}
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(text, self.opened)
            message["content"] = content
            message["reasoning_content"] = reasoning if self.body.include_reasoning else None
        prefix = self.echo_prefix()
        if prefix:
            message["content"] = prefix + (message["content"] or "")
        return message

    def choice(self, index: int, output: ChoiceOutput) -> dict:
        return {"index": index, "message": self.message(output.text),
                "logprobs": self.logprobs(output.token_ids, output.logprobs or []),
                "finish_reason": output.finish_reason, "stop_reason": output.stop_reason}

    def extras(self, outputs: list[ChoiceOutput]) -> dict:
        """vLLM puts a chat response's prompt logprobs beside its choices (one prompt: the first choice's)."""
        if self.body.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": logprob_formats.prompt_logprobs(outputs[0].prompt_logprobs)}

    def stream(self, index: int) -> "ChatStream":
        holds = self.body.stop_strings + (self.reasoning.tags if self.reasoning is not None else ())
        return ChatStream(self, index, holds, echo=bool(self.echo_prefix()))


class ChatStream(ChoiceStream):
    """A reply's deltas; with a reasoning parser, nothing until the reply shows whether it opens with
    ``<think>``, then each part's new characters (a partial tag is held back)."""

    view: ChatView

    def __init__(self, view: ChatView, index: int, holds: tuple[str, ...], echo: bool):
        super().__init__(view, index, holds, echo)
        self.sent_parts = [0, 0]  # reasoning, content characters sent

    def opening(self) -> dict | None:
        return {"index": self.index, "delta": {"role": self.view.body.reply_role, "content": ""}, "logprobs": None,
                "finish_reason": None}

    def sendable(self, text: str, end: int) -> int:
        reasoning = self.view.reasoning
        return 0 if reasoning is not None and not reasoning.decided(text[:end]) else end

    def content(self, output: ChoiceOutput, piece: str, token_ids: list[int], logprobs: list) -> dict:
        prefix = self.view.echo_prefix() if self.echo else ""
        return {"delta": self.delta(output.text[:self.sent_chars], piece, prefix),
                "logprobs": self.view.logprobs(token_ids, logprobs)}

    def delta(self, sent_text: str, piece: str, prefix: str) -> dict:
        view = self.view
        if view.reasoning is None:
            return {"content": prefix + piece} if prefix + piece else {}
        parts = view.reasoning.split(sent_text, view.opened)
        delta = {}
        for i, (name, part) in enumerate(zip(("reasoning_content", "content"), parts)):
            new = (part or "")[self.sent_parts[i]:]
            self.sent_parts[i] += len(new)
            if new and (name == "content" or view.body.include_reasoning):
                delta[name] = new
        if prefix:
            delta["content"] = prefix + delta.get("content", "")
        return delta
