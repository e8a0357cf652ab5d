"""``/v1/chat/completions`` (vLLM's ``serving_chat``): messages rendered by the model's chat template, the reply as
a message (its thinking as ``reasoning_content`` with a reasoning parser, its tool calls as ``tool_calls``), chat
logprobs, and vLLM's echo of the last message when the reply continues it. A constraint (``structured_requests``,
or a forced tool call) starts after the thinking when a reasoning parser is set, as vLLM's reasoning-aware
structured outputs do."""

import time

from fastapi import Request

from zipage_jax.engine.messages import Accepted
from zipage_jax.engine.request_group import ChoiceOutput
from zipage_jax.entrypoints import logprob_formats, structured_requests
from zipage_jax.entrypoints.protocol import ChatCompletionRequest, chat_template_kwargs
from zipage_jax.entrypoints.reasoning import ReasoningParser
from zipage_jax.entrypoints.serving_engine import ChoiceStream, OpenAIServing, RequestView
from zipage_jax.entrypoints.tool_calls import ToolPlan, ToolSettings, wire


class OpenAIServingChat(OpenAIServing):
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prompt_field = "messages"

    def __init__(self, async_engine, tokenizing, settings, reasoning: ReasoningParser | None,
                 tool_settings: ToolSettings = ToolSettings()):
        super().__init__(async_engine, tokenizing, settings)
        self.reasoning, self.tool_settings = reasoning, tool_settings

    async def create(self, body: ChatCompletionRequest, request: Request):
        arrival = time.monotonic()
        request_id = self.start(body)
        tools = ToolPlan.of(body, self.tool_settings)
        found = structured_requests.requested(body)
        if tools is not None and tools.constraint() is not None:
            found.append(tools.constraint())
        # vLLM: the structure applies after the thinking, unless the thinking is not returned
        extra = await self.constraints(body, found, self.settings.reasoning_end if body.include_reasoning else None)
        if tools is not None and tools.skip_special_tokens is not None:
            extra["skip_special_tokens"] = tools.skip_special_tokens
        prompt = await self.tokenizing.render_chat([m.as_template_message() for m in body.messages],
                                                   **chat_template_kwargs(body))
        # Special tokens are not added by default: the chat template places them, as vLLM does.
        ids = await self.tokenizing.encode(prompt, body.add_special_tokens, field=None)
        group = await self.submit(request_id, body, [ids], arrival, extra)
        return await self.respond(request_id, ChatView(self, body, group.accepted[:1], prompt, tools), group,
                                  request)


class ChatView(RequestView):
    def __init__(self, serving: OpenAIServingChat, body: ChatCompletionRequest, accepted: list[Accepted],
                 prompt: str, tools: ToolPlan | None = None):
        super().__init__(serving, body, accepted)
        self.reasoning, self.tools = serving.reasoning, tools
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
        if self.tools is not None:
            message["content"], calls = self.tools.read(message["content"])
            message["tool_calls"] = [wire(call) for call in calls]
        prefix = self.echo_prefix()
        if prefix:
            message["content"] = prefix + (message["content"] or "")
        return message

    def choice(self, index: int, output: ChoiceOutput) -> dict:
        message = self.message(output.text)
        finish = output.finish_reason
        if self.tools is not None:
            finish = self.tools.finish_reason(finish, bool(message["tool_calls"]))
        return {"index": index, "message": message, "logprobs": self.logprobs(output.token_ids, output.logprobs or []),
                "finish_reason": finish, "stop_reason": output.stop_reason}

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
        self.tools = view.tools.stream() if view.tools is not None else None

    def opening(self) -> dict | None:
        return {"index": self.index, "delta": {"role": self.view.body.reply_role, "content": ""}, "logprobs": None,
                "finish_reason": None}

    def sendable(self, text: str, end: int) -> int:
        reasoning = self.view.reasoning
        return 0 if reasoning is not None and not reasoning.decided(text[:end]) else end

    def content(self, output: ChoiceOutput, piece: str, token_ids: list[int], logprobs: list) -> dict:
        prefix = self.view.echo_prefix() if self.echo else ""
        return {"delta": self.delta(output.text[:self.sent_chars], piece, prefix, output.finish_reason is not None),
                "logprobs": self.view.logprobs(token_ids, logprobs)}

    def chunk(self, output: ChoiceOutput) -> dict | None:
        """As vLLM's, no chunk for tokens that add nothing to send (a parser holds them: a tool call not complete
        yet, hidden reasoning) unless they carry logprobs."""
        chunk = super().chunk(output)
        if chunk is None or (not chunk["delta"] and chunk["finish_reason"] is None and chunk["logprobs"] is None):
            return None
        if self.tools is not None:
            chunk["finish_reason"] = self.view.tools.finish_reason(chunk["finish_reason"], self.tools.called)
        return chunk

    def delta(self, sent_text: str, piece: str, prefix: str, final: bool = False) -> dict:
        view = self.view
        if view.reasoning is None and self.tools is None:
            return {"content": prefix + piece} if prefix + piece else {}
        parts = view.reasoning.split(sent_text, view.opened) if view.reasoning is not None else (None, sent_text)
        delta = {}
        for i, (name, part) in enumerate(zip(("reasoning_content", "content"), parts)):
            if name == "content" and self.tools is not None:
                new, calls = self.tools.feed(part, final)
                if calls:
                    delta["tool_calls"] = calls
            else:
                new = (part or "")[self.sent_parts[i]:]
                self.sent_parts[i] += len(new)
            if new and (name == "content" or view.body.include_reasoning):
                delta[name] = new
        if prefix:
            delta["content"] = prefix + delta.get("content", "")
        return delta
