"""Reasoning parsers (vLLM's ``--reasoning-parser``): a reply's ``<think>...</think>`` block becomes
``reasoning_content``, the rest ``content``.

``deepseek_r1``: the reply starts inside the thinking (its chat template opens it), so everything before
``</think>`` is reasoning, all of it while ``</think>`` has not come. ``qwen3``: the reply thinks when it opens
with ``<think>`` or when the prompt ends with an open ``<think>`` (templates that open it for the model);
otherwise it is all content (thinking disabled). A leading ``<think>`` is dropped either way. The split of a
growing text only ever grows both parts, so a stream sends each part's new characters; it holds back a partial
tag (``tags``) and a reply's leading whitespace until it shows whether it opens with ``<think>``.
"""

import dataclasses

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    name: str

    def __post_init__(self):
        if self.name not in PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(PARSERS)}, got {self.name!r}")

    tags = (START, END)

    def opens_thinking(self, prompt_text: str) -> bool:
        """Whether the reply to this prompt starts inside the thinking block."""
        return self.name == "deepseek_r1" or prompt_text.rstrip().endswith(START)

    @staticmethod
    def decided(text: str) -> bool:
        """Whether ``text`` (a reply's beginning) shows whether it opens with ``<think>``: until then a stream
        sends nothing, since that tag (and the whitespace before it) is dropped."""
        head = text.lstrip()
        return bool(head) and not (START.startswith(head) and head != START)

    def split(self, text: str, opened: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of a reply; None for an absent part."""
        head = text.lstrip()
        if head.startswith(START):
            text, opened = head[len(START):], True
        if not opened:
            return None, text
        reasoning, end, content = text.partition(END)
        return reasoning, (content if end else None)
