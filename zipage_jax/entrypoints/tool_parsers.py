"""Tool-call parsers (vLLM's ``--tool-call-parser``): the calls a model wrote in its own format, read from a reply's
content, whole (``extract``) or as it grows (``scan``, for streams).

``hermes`` (Hermes 2 Pro, Qwen 2.5 and Qwen3): any text, then calls as ``<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>``, any number of them (the last may lack its closing tag). As vLLM's, a reply whose calls do
not all parse is left whole as content, and the arguments are re-serialized (``json.dumps``).
"""

import dataclasses
import json
import re


@dataclasses.dataclass(frozen=True)
class FunctionCall:
    name: str
    arguments: str  # JSON text


def partial_overlap(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (a tag that may still be coming)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"
    _regions = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.S)

    @staticmethod
    def _call(region: str) -> FunctionCall:
        """A region's call; a ValueError if it is no ``{"name": str, "arguments": ...}`` object."""
        value = json.loads(region)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or "arguments" not in value:
            raise ValueError("not a tool call")
        return FunctionCall(value["name"], json.dumps(value["arguments"], ensure_ascii=False))

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        """(the content before the calls, None if empty; the calls), or (``text``, []) when a call does not parse."""
        if self.START not in text:
            return text, []
        try:
            calls = [self._call(closed or open_) for closed, open_ in self._regions.findall(text)]
        except ValueError:
            return text, []
        return text[:text.index(self.START)] or None, calls

    def scan(self, text: str) -> tuple[int, list[FunctionCall]]:
        """For a reply still growing: how much of ``text`` is surely content (a partial start tag is held back),
        and the calls whose closing tag has come, up to the first that does not parse."""
        start = text.find(self.START)
        if start < 0:
            return len(text) - partial_overlap(text, self.START), []
        calls = []
        for closed, _ in self._regions.findall(text[start:]):
            if not closed:
                break
            try:
                calls.append(self._call(closed))
            except ValueError:
                break
        return start, calls


PARSERS = {"hermes": HermesParser}
