"""Tool calls on chat completions, as vLLM serves them: what a request's ``tools`` and ``tool_choice`` ask of the
output, and the calls read back from a reply, whole or streamed.

- ``none``: a plain reply (the template still sees the tools, as vLLM's default).
- ``auto`` (the default when tools are given): needs ``--enable-auto-tool-choice`` and ``--tool-call-parser``; the
  model writes calls in its own format, the parser (``tool_parsers``) reads them out of the content.
- ``required``: the grammar forces a JSON array of at least one ``{"name": <a tool's name>, "parameters": <its
  schema>}`` (vLLM's ``_get_json_schema_from_tool``); its items are the calls.
- a named function: the grammar forces that function's parameters; the whole content is its arguments.

``finish_reason`` is ``tool_calls`` when calls were made under ``auto``, or under ``required`` with the grammar
complete; a named function keeps ``stop`` (vLLM and OpenAI). The calls' ``content`` is null when the reply has no
other text. A stream sends each ``auto`` / ``required`` call whole once its JSON is complete, a named function's
arguments as they come, so that its deltas reassemble to the calls of the same reply unstreamed.
"""

import dataclasses
import json
import uuid

from zipage_jax.entrypoints.protocol import APIError, ChatCompletionRequest
from zipage_jax.entrypoints.tool_parsers import PARSERS, FunctionCall, HermesParser
from zipage_jax.structured_output.params import StructuredOutputsParams

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclasses.dataclass(frozen=True)
class ToolSettings:
    """The server's: ``auto`` (--enable-auto-tool-choice) and ``parser`` (--tool-call-parser)."""

    auto: bool = False
    parser: str | None = None

    def __post_init__(self):
        if self.parser is not None and self.parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {self.parser!r}")
        if self.auto and self.parser is None:
            raise ValueError("enable_auto_tool_choice: needs --tool-call-parser")


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def wire(call: FunctionCall) -> dict:
    return {"id": tool_call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def required_schema(tools) -> dict:
    """vLLM's schema for ``tool_choice: required``: an array of calls, one of the tools each; the tools' ``$defs``
    move to the top, where their ``#/$defs/...`` references resolve."""
    defs, items = {}, []
    for tool in tools:
        parameters = dict(tool.function.parameters or {"type": "object", "properties": {}})
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise APIError(400, f"tools: the definition {name!r} has several schemas", param="tools")
        items.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "parameters": parameters}, "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    return {**schema, "$defs": defs} if defs else schema


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What one request's tools ask: ``mode`` is ``none``, ``auto``, ``required`` or ``named`` (``name``)."""

    mode: str
    tools: tuple
    name: str | None = None
    parser: HermesParser | None = None
    parallel: bool = True

    @classmethod
    def of(cls, body: ChatCompletionRequest, settings: ToolSettings) -> "ToolPlan | None":
        """The plan of ``body`` (None without tools), checked as vLLM checks it: a 400 naming the field."""
        tools, choice = body.tools, body.tool_choice
        if tools is None:
            if choice not in (None, "none"):
                raise APIError(400, "tool_choice: When using `tool_choice`, `tools` must be set.", param="tool_choice")
            return None
        if not tools:
            raise APIError(400, "tools: must not be an empty array; give at least one tool or leave the field out",
                           param="tools")
        for i, tool in enumerate(tools):
            if tool.function.parameters is not None:
                try:
                    StructuredOutputsParams(json=tool.function.parameters)
                except ValueError as exc:
                    reason = str(exc).partition(": ")[2]
                    raise APIError(400, f"tools[{i}].function.parameters: {reason}", param="tools") from exc
        names = [tool.function.name for tool in tools]
        choice = "auto" if choice is None else choice
        parallel = body.parallel_tool_calls is not False
        if choice == "auto":
            if not settings.auto:
                raise APIError(400, AUTO_NEEDS_FLAGS, param="tool_choice")
            return cls("auto", tuple(tools), parser=PARSERS[settings.parser](), parallel=parallel)
        if choice in ("none", "required"):
            return cls(choice, tuple(tools), parallel=parallel)
        if choice.function.name not in names:
            raise APIError(400, "tool_choice: The tool specified in `tool_choice` does not match any of the specified "
                                "`tools`", param="tool_choice")
        return cls("named", tuple(tools), name=choice.function.name, parallel=parallel)

    def constraint(self) -> tuple[str, dict] | None:
        """What the grammar forces (``structured_requests.Constraint``), for ``required`` and a named function."""
        if self.mode == "required":
            return "tool_choice", {"json": required_schema(self.tools)}
        if self.mode == "named":
            tool = next(t for t in self.tools if t.function.name == self.name)
            return "tool_choice", {"json": tool.function.parameters or {"type": "object", "properties": {}}}
        return None

    @property
    def skip_special_tokens(self) -> bool | None:
        """vLLM's hermes parser reads the text with special tokens (some models mark ``<tool_call>`` special)."""
        return False if self.mode == "auto" else None

    def read(self, content: str | None) -> tuple[str | None, list[FunctionCall]]:
        """A finished reply's content and calls."""
        if self.mode == "none" or content is None:
            return content, []
        if self.mode == "named":
            return None, [FunctionCall(self.name, content)]
        if self.mode == "required":
            calls, _ = array_calls(content)
            return (None, calls[:1 if not self.parallel else None]) if calls else (content, [])
        content, calls = self.parser.extract(content)
        return content, calls[:1 if not self.parallel else None]

    def finish_reason(self, finish: str | None, called: bool) -> str | None:
        if called and (self.mode == "auto" or (self.mode == "required" and finish == "stop")):
            return "tool_calls"
        return finish

    def stream(self) -> "ToolStream":
        return ToolStream(self)


def array_calls(text: str) -> tuple[list[FunctionCall], bool]:
    """The calls of a ``required`` reply, a JSON array of ``{"name", "parameters"}`` objects, as far as its items are
    complete (a stream's, or a reply cut by ``max_tokens``), and whether the array is."""
    calls, depth, in_string, escaped, start = [], 0, False, False, None
    for i, c in enumerate(text):
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            start = i if depth == 2 else start
        elif c in "]}":
            depth -= 1
            if depth == 1 and start is not None:
                try:
                    item = json.loads(text[start:i + 1])
                    calls.append(FunctionCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)))
                except (ValueError, KeyError, TypeError):
                    return calls, False
                start = None
            elif depth == 0:
                return calls, True
    return calls, False


class ToolStream:
    """The tool calls of one streamed choice: fed its content so far, it says what to send of it."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.sent_content = 0  # characters of content sent (auto: the text before the calls)
        self.sent_calls = 0
        self.sent_arguments = 0  # a named function's characters of arguments sent

    @property
    def called(self) -> bool:
        return self.sent_calls > 0

    def feed(self, content: str | None, final: bool) -> tuple[str, list[dict]]:
        """(new content, new ``tool_calls`` deltas) for the content so far; ``final``: the reply is done."""
        plan = self.plan
        if plan.mode == "none" or content is None:
            return self._content(content or ""), []
        if plan.mode == "named":
            return "", self._arguments(content, final)
        if plan.mode == "required":
            calls, _ = array_calls(content)
            return "", self._calls(calls)
        if final:
            text, calls = plan.read(content)
            return self._content(text or ""), self._calls(calls)
        end, calls = plan.parser.scan(content)
        return self._content(content[:end]), self._calls(calls)

    def _content(self, text: str) -> str:
        new = text[self.sent_content:]
        self.sent_content = max(self.sent_content, len(text))
        return new

    def _calls(self, calls: list[FunctionCall]) -> list[dict]:
        limit = len(calls) if self.plan.parallel else min(len(calls), 1)
        new = [{"index": i, **wire(call)} for i, call in enumerate(calls[:limit]) if i >= self.sent_calls]
        self.sent_calls = max(self.sent_calls, limit)
        return new

    def _arguments(self, content: str, final: bool) -> list[dict]:
        piece = content[self.sent_arguments:]
        self.sent_arguments = len(content)
        if self.sent_calls:
            return [{"index": 0, "function": {"arguments": piece}}] if piece else []
        if not piece and not final:
            return []
        self.sent_calls = 1
        return [{"index": 0, **wire(FunctionCall(self.plan.name, piece))}]
