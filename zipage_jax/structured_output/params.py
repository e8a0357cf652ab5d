"""StructuredOutputsParams: the constraint a request's output must satisfy, in vLLM's shape, checked on the host.

Exactly one of ``json`` (a JSON schema), ``regex``, ``choice``, ``grammar`` (Lark or GBNF) or ``json_object`` (any
JSON object). Each compiles to one llguidance grammar definition here, without a tokenizer, so a bad schema or regex
is a ``ValueError`` naming its field before anything is queued; the engine binds the definition to its tokenizer
(``structured_output.manager``). No jax: the server builds these in its own process.
"""

from __future__ import annotations

import dataclasses
import functools
import json as jsonlib
from collections.abc import Sequence

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """``json``: a JSON schema (a dict, or its text); ``regex``: a regular expression (Rust ``regex`` syntax, as
    vLLM's llguidance backend); ``choice``: the output is one of these strings; ``grammar``: a Lark or GBNF grammar;
    ``json_object=True``: any JSON object.

    JSON whitespace: by default (``disable_any_whitespace=None``) a JSON output is laid out as ``json.dumps`` does,
    ``{"a": 1, "b": [2, 3]}``: with any whitespace allowed between tokens (vLLM's default, ``False`` here) a model
    can spend its whole budget on newlines, which small and quantized models often do. ``whitespace_pattern``: a
    regular expression for the whitespace instead.

    ``reasoning_end``: the constraint starts after this text's tokens first appear in the prompt or the output
    (``"</think>"``: a reasoning model thinks freely, then answers in the structure), as vLLM does with a reasoning
    parser; None: from the first output token.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    whitespace_pattern: str | None = None
    reasoning_end: str | None = None

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: exactly one of {', '.join(KINDS)} must be given, got "
                             f"{', '.join(given) if given else 'none'}")
        if isinstance(self.json, dict):  # text keeps the params hashable (SamplingParams is a cache key)
            object.__setattr__(self, "json", jsonlib.dumps(self.json))
        if self.json is not None and not isinstance(self.json, str):
            raise ValueError(f"structured_outputs.json: expected a JSON schema (an object or its text), got "
                             f"{type(self.json).__name__}")
        if self.choice is not None:
            choice = (self.choice,) if isinstance(self.choice, str) else self.choice
            if isinstance(choice, (bytes, dict)) or not isinstance(choice, Sequence) or not choice or \
                    not all(isinstance(c, str) and c for c in choice):
                raise ValueError("structured_outputs.choice: expected a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(choice))
        if self.disable_any_whitespace is not None and not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace: expected a bool, got "
                             f"{self.disable_any_whitespace!r}")
        for name in ("regex", "grammar", "reasoning_end", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}: expected a non-empty string")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object: expected true, got {self.json_object!r}")
        self.definition  # noqa: B018 (compiles it: a bad schema, regex or grammar raises here)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def source(self) -> str:
        """The constraint as text (a choice list as JSON)."""
        value = getattr(self, self.kind)
        return jsonlib.dumps(list(value)) if self.kind == "choice" else "" if self.kind == "json_object" else value

    @property
    def json_layout(self) -> str:
        """llguidance's JSON whitespace options, as JSON text ("" for the other kinds)."""
        if self.kind not in ("json", "json_object"):
            return ""
        if self.whitespace_pattern is not None:
            return jsonlib.dumps({"whitespace_pattern": self.whitespace_pattern})
        if self.disable_any_whitespace is False:
            return jsonlib.dumps({"whitespace_flexible": True})
        return jsonlib.dumps({"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})

    @property
    def definition(self) -> str:
        """The llguidance grammar definition (cached per constraint: requests of one schema compile it once)."""
        return _definition(self.kind, self.source, self.json_layout)


@functools.lru_cache(maxsize=256)
def _definition(kind: str, source: str, json_layout: str) -> str:
    import llguidance  # here, not at import: the server's command line parses without it

    from llguidance import LLMatcher
    field = f"structured_outputs.{kind}"
    try:
        if kind == "json":
            schema = jsonlib.loads(source)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema is an object")
            definition = LLMatcher.grammar_from_json_schema(schema, defaults=jsonlib.loads(json_layout))
        elif kind == "json_object":
            definition = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=jsonlib.loads(json_layout))
        elif kind == "choice":
            # string literals, not Lark text: a choice may hold quotes, slashes or grammar syntax
            definition = LLMatcher.grammar_from_lark("start: " + " | ".join(jsonlib.dumps(c) for c in
                                                                            jsonlib.loads(source)))
        elif kind == "regex":
            definition = llguidance.grammar_from("regex", source)
        else:
            definition = llguidance.grammar_from("grammar", source)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{field}: invalid {_WHAT[kind]}: {error}") from None
    error = LLMatcher.validate_grammar(definition, None)
    if error:
        raise ValueError(f"{field}: invalid {_WHAT[kind]}: {error.strip().splitlines()[0]}")
    return definition


_WHAT = {"json": "JSON schema", "regex": "regular expression", "choice": "choice", "grammar": "grammar",
         "json_object": "JSON object constraint"}
